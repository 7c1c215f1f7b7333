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
//!
//! Each kind of source is a [`source::Source`] of its own file: [`dns`], [`srv`], [`file`].
//! Adding one is a file here, a variant of `config::DiscoveryConfig`, and an arm in [`run`].

mod dns;
mod file;
mod source;
mod srv;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use keel_balance::{EndpointSpec, InvalidField, Problem};

use crate::config::discovery::DiscoveryConfig;
use crate::control::discovery::dns::{absolute, resolver, Dns};
pub(crate) use crate::control::discovery::file::read_file;
use crate::control::discovery::file::File;
use crate::control::discovery::source::Source;
use crate::control::discovery::srv::Srv;

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

/// Follows one cluster's source until aborted: each new set goes to `apply`.
pub(crate) async fn run(
    cluster: String,
    discovered: Arc<Discovered>,
    apply: impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
) {
    let config = &discovered.config;
    let every = config.refresh();
    let resolver = || match resolver(config.resolver(), every) {
        Ok(r) => Some(r),
        Err(e) => {
            // Only a system resolver without a usable /etc/resolv.conf gets here.
            discovered.record(&cluster, Err(format!("cannot make a resolver: {e}")));
            None
        }
    };
    match config {
        DiscoveryConfig::Dns { name, port, .. } => {
            let Some(resolver) = resolver() else { return };
            let dns = Dns {
                resolver,
                name: absolute(name),
                port: *port,
                every,
            };
            follow(&cluster, &discovered, &apply, dns).await
        }
        DiscoveryConfig::Srv { name, .. } => {
            let Some(resolver) = resolver() else { return };
            let srv = Srv {
                resolver,
                name: absolute(name),
                every,
            };
            follow(&cluster, &discovered, &apply, srv).await
        }
        DiscoveryConfig::File { path } => {
            let file = File::new(path.clone());
            follow(&cluster, &discovered, &apply, file).await
        }
    }
}

/// Asks `source` every [`Source::every`] (missed ticks delayed, not bunched) and records
/// each answer; a changed set goes to `apply`.
async fn follow<S: Source>(
    cluster: &str,
    discovered: &Arc<Discovered>,
    apply: &impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    mut source: S,
) {
    let mut ticker = tokio::time::interval(source.every());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let failed = discovered.state().last_error.is_some();
        let Some(result) = source.look(failed).await else {
            discovered.unchanged();
            continue;
        };
        if let Some(set) = discovered.record(cluster, result) {
            tracing::info!(
                cluster = %cluster,
                source = %discovered.config.describe(),
                endpoints = set.len(),
                "discovery: new endpoints"
            );
            apply(cluster, discovered, set);
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
