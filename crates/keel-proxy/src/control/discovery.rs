//! Service discovery: a cluster's endpoints found in DNS (A and AAAA records of a name, or the
//! SRV records of a service, RFC 2782) or in a file, and followed while the proxy runs.
//!
//! One task per cluster resolves its source every `refresh` (a file: looks at it every second
//! and reads it again when it changed). A new set is applied as a reload applies a cluster:
//! the cluster is rebuilt from the running one ([`crate::upstream::cluster::Cluster::build`], which
//! keeps the state of the endpoints that stay through `Balancer::rebuild`) and swapped in.
//! A resolver error, a timeout, NXDOMAIN or an empty answer keeps the last known set; it is
//! logged and counted (`keel_discovery_errors_total{cluster}`). A cluster whose source has not
//! answered yet has no endpoint: it answers `503` until one arrives. DNS goes through
//! hickory-resolver, with its cache off so that each refresh asks the server.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::{ResolveError, TokioResolver};
use keel_balance::{EndpointSpec, InvalidField, Problem};
use serde::Deserialize;

use crate::config::discovery::DiscoveryConfig;

/// How often a file source is looked at.
const FILE_POLL: Duration = Duration::from_secs(1);

/// The discovery component's check of a source, the I/O part (the syntax is
/// [`DiscoveryConfig::validate`]'s): a file source reads and holds valid endpoints. Nothing is
/// resolved. Paths are relative to `discovery`.
pub(crate) fn check(config: &DiscoveryConfig) -> Result<(), InvalidField> {
    match config {
        DiscoveryConfig::File { path } => read_file(path)
            .map(drop)
            .map_err(|m| InvalidField::at("file", Problem::Invalid(m))),
        DiscoveryConfig::Dns { .. } | DiscoveryConfig::Srv { .. } => Ok(()),
    }
}

/// A file source's content: `endpoints = [...]`, as in a cluster.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointsFile {
    endpoints: Vec<EndpointSpec>,
}

/// Reads a file source and checks its endpoints as a cluster's are checked.
pub(crate) fn read_file(path: &Path) -> Result<Vec<EndpointSpec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: EndpointsFile = toml::from_str(&text).map_err(|e| {
        format!(
            "{}: expected `endpoints = [{{ address = \"host:port\" }}, ...]`: {}",
            path.display(),
            e.message().trim()
        )
    })?;
    check_endpoints(&file.endpoints).map_err(|m| format!("{}: {m}", path.display()))?;
    Ok(file.endpoints)
}

/// Addresses `host:port`, weights at least 1, each address once.
fn check_endpoints(endpoints: &[EndpointSpec]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for e in endpoints {
        let ok = e
            .address
            .parse::<hyper::http::uri::Authority>()
            .ok()
            .filter(|a| a.port_u16().is_some() && !a.host().is_empty());
        if ok.is_none() {
            return Err(format!(
                "`{}` is not an address; expected host:port",
                e.address
            ));
        }
        if e.weight == 0 {
            return Err(format!("`{}` has weight 0; at least 1", e.address));
        }
        if !seen.insert(e.address.as_str()) {
            return Err(format!("`{}` is listed twice", e.address));
        }
    }
    Ok(())
}

/// What discovery knows of one cluster: its source, the last set found, and how the last
/// refreshes went. Kept across reloads while the cluster's source stays the same.
pub(crate) struct Discovered {
    /// The source.
    pub config: DiscoveryConfig,
    state: Mutex<State>,
    /// Failed refreshes.
    pub errors: AtomicU64,
}

/// The mutable part of [`Discovered`] (cold path: a refresh a second at most).
#[derive(Default, Clone)]
pub(crate) struct State {
    /// The last set found (`None` until the source first answered).
    pub endpoints: Option<Vec<EndpointSpec>>,
    /// When the source last answered with endpoints (a file: was last looked at, unchanged
    /// or read).
    pub last_refresh: Option<SystemTime>,
    /// When the set last changed.
    pub last_change: Option<SystemTime>,
    /// The last failure, if the last refresh failed.
    pub last_error: Option<String>,
}

impl Discovered {
    /// Nothing found yet from `config`.
    pub fn new(config: DiscoveryConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::default()),
            errors: AtomicU64::new(0),
        }
    }

    /// A copy of the state.
    pub fn state(&self) -> State {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last set found (empty until the source first answered).
    pub fn endpoints(&self) -> Vec<EndpointSpec> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .endpoints
            .clone()
            .unwrap_or_default()
    }

    /// Records that a file source was looked at and had not changed (its last read stands).
    fn unchanged(&self) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_refresh = Some(SystemTime::now());
    }

    /// Records a refresh's result; returns the new set when it differs from the last one.
    pub fn record(
        &self,
        cluster: &str,
        result: Result<Vec<EndpointSpec>, String>,
    ) -> Option<Vec<EndpointSpec>> {
        let now = SystemTime::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let found = match result {
            Ok(v) if v.is_empty() => Err("the answer has no endpoint".to_string()),
            other => other,
        };
        match found {
            Ok(mut set) => {
                set.sort_by(|a, b| a.address.cmp(&b.address));
                state.last_refresh = Some(now);
                if state.last_error.take().is_some() {
                    tracing::info!(
                        cluster,
                        "discovery: {} answers again",
                        self.config.describe()
                    );
                }
                if state.endpoints.as_ref() == Some(&set) {
                    return None;
                }
                state.endpoints = Some(set.clone());
                state.last_change = Some(now);
                Some(set)
            }
            Err(e) => {
                self.errors.fetch_add(1, Relaxed);
                let kept = state.endpoints.as_ref().map_or(0, Vec::len);
                tracing::warn!(
                    cluster,
                    source = %self.config.describe(),
                    kept,
                    "discovery failed, the last known endpoints stay: {e}"
                );
                state.last_error = Some(e);
                None
            }
        }
    }
}

/// A source to ask.
enum Source {
    Dns {
        resolver: TokioResolver,
        name: String,
        port: u16,
    },
    Srv {
        resolver: TokioResolver,
        name: String,
    },
    File(std::path::PathBuf),
}

/// A resolver asking `server` (the system's servers without one), without a cache, within
/// `refresh` for each query.
fn resolver(server: Option<SocketAddr>, refresh: Duration) -> Result<TokioResolver, ResolveError> {
    let mut builder = match server {
        Some(addr) => {
            let mut config = ResolverConfig::new();
            config.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
        }
        None => TokioResolver::builder_tokio()?,
    };
    let opts = builder.options_mut();
    opts.cache_size = 0;
    opts.positive_max_ttl = Some(Duration::ZERO);
    opts.negative_max_ttl = Some(Duration::ZERO);
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.use_hosts_file = ResolveHosts::Never;
    // A refresh should not outlast the next one.
    opts.timeout = refresh.min(Duration::from_secs(2));
    opts.attempts = 1;
    Ok(builder.build())
}

/// A name as an absolute one (no search domains).
fn absolute(name: &str) -> String {
    if name.ends_with('.') {
        name.to_string()
    } else {
        format!("{name}.")
    }
}

fn no_records(e: &ResolveError) -> bool {
    e.is_no_records_found()
}

impl Source {
    fn new(config: &DiscoveryConfig) -> Result<Source, String> {
        let refresh = config.refresh();
        let resolver = || resolver(config.resolver(), refresh).map_err(|e| e.to_string());
        Ok(match config {
            DiscoveryConfig::Dns { name, port, .. } => Source::Dns {
                resolver: resolver()?,
                name: absolute(name),
                port: *port,
            },
            DiscoveryConfig::Srv { name, .. } => Source::Srv {
                resolver: resolver()?,
                name: absolute(name),
            },
            DiscoveryConfig::File { path } => Source::File(path.clone()),
        })
    }

    /// The endpoints the source gives now.
    async fn resolve(&self) -> Result<Vec<EndpointSpec>, String> {
        match self {
            Source::Dns {
                resolver,
                name,
                port,
            } => {
                let ips = resolver
                    .lookup_ip(name.as_str())
                    .await
                    .map_err(|e| e.to_string())?;
                let mut set: Vec<EndpointSpec> = ips
                    .iter()
                    .map(|ip| EndpointSpec::new(SocketAddr::new(ip, *port).to_string()))
                    .collect();
                set.sort_by(|a, b| a.address.cmp(&b.address));
                set.dedup_by(|a, b| a.address == b.address);
                Ok(set)
            }
            Source::Srv { resolver, name } => {
                let srv = resolver
                    .srv_lookup(name.as_str())
                    .await
                    .map_err(|e| e.to_string())?;
                // RFC 2782: only the lowest priority value in use.
                let Some(lowest) = srv.iter().map(|r| r.priority()).min() else {
                    return Ok(Vec::new());
                };
                // Weights add up when several records lead to one address.
                let mut weights: BTreeMap<String, u32> = BTreeMap::new();
                for r in srv.iter().filter(|r| r.priority() == lowest) {
                    let ips = match resolver.lookup_ip(r.target().clone()).await {
                        Ok(ips) => ips,
                        // A target without an address is left out; any other failure fails
                        // the refresh (the last set stays).
                        Err(e) if no_records(&e) => continue,
                        Err(e) => return Err(format!("target {}: {e}", r.target())),
                    };
                    for ip in ips.iter() {
                        // keel's weights start at 1: a weight of 0 counts as 1.
                        let w = u32::from(r.weight()).max(1);
                        *weights
                            .entry(SocketAddr::new(ip, r.port()).to_string())
                            .or_default() += w;
                    }
                }
                Ok(weights
                    .into_iter()
                    .map(|(a, w)| EndpointSpec::new(a).with_weight(w))
                    .collect())
            }
            Source::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || read_file(&path))
                    .await
                    .map_err(|e| e.to_string())?
            }
        }
    }
}

/// What identifies a version of a file (it is read again when this changes).
fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Follows one cluster's source until aborted: each new set goes to `apply`.
pub(crate) async fn run(
    cluster: String,
    discovered: Arc<Discovered>,
    apply: impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
) {
    let source = match Source::new(&discovered.config) {
        Ok(s) => s,
        Err(e) => {
            // Only a system resolver without a usable /etc/resolv.conf gets here.
            discovered.record(&cluster, Err(format!("cannot make a resolver: {e}")));
            return;
        }
    };
    let every = match source {
        Source::File(_) => FILE_POLL,
        _ => discovered.config.refresh(),
    };
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stamp = None;
    loop {
        ticker.tick().await;
        if let Source::File(path) = &source {
            // Read again only when it changed (or could not be read last time).
            let now = file_stamp(path);
            let failed = discovered.state().last_error.is_some();
            if now.is_some() && now == stamp && !failed {
                discovered.unchanged();
                continue;
            }
            stamp = now;
        }
        let result = source.resolve().await;
        if let Some(set) = discovered.record(&cluster, result) {
            tracing::info!(
                cluster = %cluster,
                source = %discovered.config.describe(),
                endpoints = set.len(),
                "discovery: new endpoints"
            );
            apply(&cluster, &discovered, set);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_or_empty_refresh_keeps_the_last_set_and_counts() {
        let d = Discovered::new(DiscoveryConfig::Dns {
            name: "a.test".into(),
            port: 80,
            resolver: None,
            refresh: None,
        });
        let set = vec![
            EndpointSpec::new("10.0.0.2:80"),
            EndpointSpec::new("10.0.0.1:80"),
        ];
        let applied = d.record("c", Ok(set)).unwrap();
        assert_eq!(applied[0].address, "10.0.0.1:80", "sorted");
        assert!(d.record("c", Ok(applied.clone())).is_none(), "unchanged");
        assert!(d.record("c", Err("timeout".into())).is_none());
        assert!(d.record("c", Ok(Vec::new())).is_none());
        assert_eq!(d.errors.load(Relaxed), 2);
        assert_eq!(d.endpoints(), applied);
        assert_eq!(
            d.state().last_error.as_deref(),
            Some("the answer has no endpoint")
        );
    }
}
