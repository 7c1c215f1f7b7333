//! The proxy's TOML configuration: listeners, clusters (keel-balance strategy and protections,
//! timeouts, retries, health checks) and the admin listener.
//!
//! Every option has a default (documented in `docs/configuration.md`); unknown keys are errors.
//! Errors name the file, the line and column, the key, and what is allowed.
//!
//! One file per section, each with its types, defaults and `validate` (no I/O): [`listener`],
//! [`route`], [`cluster`] (with retry), [`health`] (health checks and load probes), [`policy`]
//! (rate limits, rewrites, sticky sessions, `hash_on`), [`discovery`] and [`observe`]
//! (admin, access log). This file holds the whole ([`ProxyConfig`]), the order in which the
//! sections are checked and the checks across sections; [`locate`] turns a failed check into
//! a `file:line:col: key: message` error, and [`group`] reads a flat table (`[[cluster]]`,
//! `[[listener.route]]`) into its type's groups, key by key. Nothing here reads a file the configuration names:
//! the components that use them check them (`tls::check_*`, `discovery::check`), and
//! `ProxyConfig::from_file` (in `control::load`) runs those checks after this room's.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_balance::{FieldPath, InvalidField, Problem};
use serde::Deserialize;

pub(crate) mod budget;
pub(crate) mod cluster;
pub(crate) mod compress;
pub(crate) mod discovery;
pub(crate) mod etcd;
pub(crate) mod group;
pub(crate) mod health;
pub(crate) mod listener;
pub(crate) mod locate;
pub(crate) mod observe;
pub(crate) mod policy;
pub(crate) mod route;
#[cfg(test)]
mod tests;

pub use budget::{BudgetKey, BudgetUnit, TokenBudgetConfig, WithoutKey};
pub use cluster::{
    Amplification, ClusterConfig, EngineSignalsConfig, ProxyProtocol, RetryConfig, SignalSource,
    UpstreamProtocol, UpstreamTlsConfig, MAX_RETRY_ATTEMPTS,
};
pub use compress::{Coding, CompressionConfig};
pub use discovery::{DiscoveryConfig, DiscoveryKind, DEFAULT_DISCOVERY_REFRESH};
pub use etcd::{EtcdConfig, EtcdTlsConfig};
pub use health::{HealthCheckConfig, HealthCheckKind, ProbeConfig, StatusRange};
pub use listener::{
    CertificateFiles, ClientAuth, ErrorDetail, ListenerConfig, ListenerProtocol, ListenerTlsConfig,
    TlsVersion, MIN_HEADER_BYTES,
};
pub use locate::ConfigError;
pub use observe::{
    parse_json_fields, parse_log_line, AccessLogConfig, AccessLogFormat, AdminConfig, LinePiece,
    LogField, TracingConfig, DEFAULT_JSON_FIELDS, LOG_NAMES,
};
pub use policy::{
    HashOn, HashOnError, HeaderEdits, RateKey, RateLimitConfig, RedirectConfig, ReplacePrefix,
    RequestPolicy, ResponseHeaders, StickyConfig,
};
pub(crate) use route::{HostPattern, PathPattern};
pub use route::{MirrorConfig, RouteConfig, SplitArm, SplitBy, ValueMatch, ValueTest};

/// The whole proxy configuration (one TOML file).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// On shutdown, how long in-flight requests may take to finish before they are cut.
    /// Default 10 s.
    #[serde(
        default = "default_drain_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub drain_timeout: Duration,
    /// On SIGTERM (and SIGINT), how long `/ready` answers 503 while the listeners still
    /// accept and serve, before the drain (`drain_timeout`) begins: the time a load balancer
    /// in front needs to see the failing probe and stop sending. Default 5 s.
    #[serde(default = "default_drain_delay", with = "keel_balance::duration_serde")]
    pub drain_delay: Duration,
    /// The admin listener (`/metrics`, `/status`, `/`, `POST /reload`); none unless the
    /// `[admin]` table is present.
    #[serde(default)]
    pub admin: Option<AdminConfig>,
    /// The client-facing listeners (`[[listener]]`), at least one.
    #[serde(default, rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    /// The upstream clusters (`[[cluster]]`), at least one.
    #[serde(default, rename = "cluster")]
    pub clusters: Vec<ClusterConfig>,
    /// The access log (`[access_log]`); none unless the table is present.
    #[serde(default)]
    pub access_log: Option<AccessLogConfig>,
    /// W3C Trace Context (`[tracing]`); none unless the table is present (`traceparent`
    /// then passes as any other header).
    #[serde(default)]
    pub tracing: Option<TracingConfig>,
    /// The zone this proxy runs in, for clusters with `[cluster.zone_routing]`.
    #[serde(default)]
    pub zone: Option<String>,
    /// This proxy's name in a fleet: the key its shared outlier evidence is published under
    /// (`[cluster.outlier_detection] shared`). Letters, digits, `-`, `_` and `.`.
    #[serde(default)]
    pub name: Option<String>,
    /// The etcd cluster of `discovery = { etcd = ... }` and shared evidence (`[etcd]`).
    #[serde(default)]
    pub etcd: Option<EtcdConfig>,
    /// The file this configuration came from (for `POST /reload`), if any.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_drain_delay() -> Duration {
    Duration::from_secs(5)
}

/// True if two listening addresses would take the same port: the same port (not 0) on the
/// same address, or on any address when one of them is unspecified (`0.0.0.0`, `[::]`).
fn same_port(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

impl ProxyConfig {
    /// The most upstream tries one request may cost `cluster`: its own worst case, or a
    /// route's to it with more `retry_attempts` (`keel proxy --check`, `keel_max_amplification`).
    pub fn worst_amplification(&self, cluster: &ClusterConfig) -> u32 {
        self.listeners
            .iter()
            .flat_map(|l| &l.routes)
            .filter(|r| r.clusters().any(|c| c == cluster.name))
            .filter_map(|r| r.retry_attempts)
            .map(|n| cluster.amplification_with(n).worst_case)
            .fold(cluster.amplification().worst_case, u32::max)
    }

    /// A failed check of the configuration file `text` (read from `origin`) at its key's
    /// line and column, as [`ProxyConfig::from_file`] reports its own: for checks made by
    /// the caller (`keel proxy --check` opening the access log).
    pub fn locate(text: &str, origin: &str, e: &InvalidField) -> ConfigError {
        match locate::Document::parse(text, origin) {
            Ok(doc) => doc.error(e),
            Err(parse) => parse,
        }
    }

    /// Parses and validates TOML without reading the files it names; `origin` (a file
    /// name) appears in error messages. Relative paths are made relative to `base` when
    /// given. Returns the located document too, so that a later check of those files
    /// (`control::load`) can place its errors.
    pub(crate) fn parse<'a>(
        text: &'a str,
        origin: &'a str,
        base: Option<&Path>,
    ) -> Result<(locate::Document<'a>, ProxyConfig), ConfigError> {
        let doc = locate::Document::parse(text, origin)?;
        let mut config: ProxyConfig = toml::from_str(text).map_err(|e| doc.serde_error(&e))?;
        if let Some(base) = base {
            config.resolve_paths(base);
        }
        config.set_zone(config.zone.clone());
        config.validate().map_err(|e| doc.error(&e))?;
        Ok((doc, config))
    }

    /// Makes the TLS file paths that are relative relative to `base` (the directory of the
    /// configuration file).
    fn resolve_paths(&mut self, base: &Path) {
        let resolve = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        for l in &mut self.listeners {
            if let Some(t) = &mut l.tls {
                resolve(&mut t.cert);
                resolve(&mut t.key);
                for c in &mut t.certificates {
                    resolve(&mut c.cert);
                    resolve(&mut c.key);
                }
                if let Some(p) = &mut t.client_ca {
                    resolve(p);
                }
            }
        }
        for c in &mut self.clusters {
            if let Some(t) = &mut c.tls {
                for p in [&mut t.ca, &mut t.cert, &mut t.key].into_iter().flatten() {
                    resolve(p);
                }
            }
        }
        if let Some(a) = &mut self.access_log {
            if a.file().is_some() {
                resolve(&mut a.path);
            }
        }
        for c in &mut self.clusters {
            if let Some(DiscoveryConfig::File { path }) = &mut c.discovery {
                resolve(path);
            }
        }
        if let Some(t) = self.etcd.as_mut().and_then(|e| e.tls.as_mut()) {
            resolve(&mut t.ca);
            for p in [&mut t.cert, &mut t.key].into_iter().flatten() {
                resolve(p);
            }
        }
    }

    /// The cluster of this name.
    pub fn cluster(&self, name: &str) -> Option<&ClusterConfig> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// Checks everything serde cannot, without I/O: references between sections, ranges, and
    /// that each cluster's balancer builds. Each section checks itself
    /// ([`ListenerConfig::validate`], [`ClusterConfig::validate`], ...); the error's field is
    /// the key's path in the document, e.g. `cluster[0].endpoints[1].weight`.
    /// [`ProxyConfig::from_toml_str`] calls it and adds the key's line, then checks the files
    /// named ([`ProxyConfig::check_files`]); a configuration built in code should call both
    /// before [`crate::start`].
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.listeners.is_empty() {
            return Err(InvalidField::new(
                FieldPath::root(),
                Problem::Invalid(
                    "at least one [[listener]] is required (listen = \"127.0.0.1:8080\", cluster = \"NAME\")"
                        .into(),
                ),
            ));
        }
        if self.clusters.is_empty() {
            return Err(InvalidField::new(
                FieldPath::root(),
                Problem::Invalid("at least one [[cluster]] is required".into()),
            ));
        }
        if let Some(a) = &self.admin {
            a.validate().map_err(|e| e.under(FieldPath::key("admin")))?;
        }
        if let Some(a) = &self.access_log {
            a.validate()
                .map_err(|e| e.under(FieldPath::key("access_log")))?;
        }
        if let Some(e) = &self.etcd {
            e.validate().map_err(|e| e.under(FieldPath::key("etcd")))?;
        }
        if let Some(n) = &self.name {
            let ok = !n.is_empty()
                && n.len() <= 128
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
            if !ok {
                return Err(InvalidField::at(
                    "name",
                    Problem::Invalid(format!(
                        "`{n}` is not a proxy name: 1-128 letters, digits, `-`, `_` or `.` (it is part of etcd keys)"
                    )),
                ));
            }
        }
        if let Some(t) = &self.tracing {
            t.validate()
                .map_err(|e| e.under(FieldPath::key("tracing")))?;
        }
        let names: Vec<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
        for (i, l) in self.listeners.iter().enumerate() {
            let at = FieldPath::key("listener").at(i);
            l.validate().map_err(|e| e.under(at.clone()))?;
            let unknown = |name: &str| {
                Problem::Invalid(format!(
                    "no cluster named `{name}`; defined: {}",
                    names.join(", ")
                ))
            };
            match &l.cluster {
                Some(c) if !names.contains(&c.as_str()) => {
                    return Err(InvalidField::new(at.then("cluster"), unknown(c)));
                }
                None if l.routes.is_empty() => {
                    return Err(InvalidField::new(
                        at.then("cluster"),
                        Problem::Invalid("a listener needs `cluster`, or routes ([[listener.route]]) and then `cluster` for the requests no route matches".into()),
                    ));
                }
                _ => {}
            }
            if let Some(c) = l
                .cluster
                .as_ref()
                .filter(|_| l.protocol == ListenerProtocol::Tcp)
                .and_then(|name| self.clusters.iter().find(|c| &c.name == name))
                .filter(|c| c.protocol != UpstreamProtocol::Http1)
            {
                return Err(InvalidField::new(
                    at.then("cluster"),
                    Problem::NotApplicable(format!(
                        "a TCP listener copies bytes; cluster `{}` speaks HTTP/2 (protocol = \"h2c\" or \"h2\")",
                        c.name
                    )),
                ));
            }
            for (j, r) in l.routes.iter().enumerate() {
                let route = at.clone().then("route").at(j);
                if let Some(name) = r.name.as_deref() {
                    if l.routes[..j]
                        .iter()
                        .any(|o| o.name.as_deref() == Some(name))
                    {
                        return Err(InvalidField::new(
                            route.then("name"),
                            Problem::Invalid(format!(
                                "route `{name}` is named twice in this listener"
                            )),
                        ));
                    }
                }
                for (k, arm) in r.split.iter().enumerate() {
                    if !self.clusters.iter().any(|c| c.name == arm.cluster) {
                        return Err(InvalidField::new(
                            route.then("split").at(k).then("cluster"),
                            unknown(&arm.cluster),
                        ));
                    }
                }
                if let Some(m) = &r.mirror {
                    let Some(mc) = self.clusters.iter().find(|c| c.name == m.cluster) else {
                        return Err(InvalidField::new(
                            route.then("mirror").then("cluster"),
                            unknown(&m.cluster),
                        ));
                    };
                    // The copy is the head written for the route's own endpoints, in their
                    // protocol's form.
                    let mut own: Vec<&str> = r.clusters().collect();
                    if own.is_empty() {
                        own.extend(l.cluster.as_deref());
                    }
                    if let Some(other) = own
                        .into_iter()
                        .filter_map(|n| self.clusters.iter().find(|c| c.name == n))
                        .find(|c| c.protocol != mc.protocol)
                    {
                        return Err(InvalidField::new(
                            route.then("mirror").then("cluster"),
                            Problem::Invalid(format!(
                                "cluster `{}` speaks another protocol than the route's cluster `{}`: a mirror gets the head written for the route's endpoints",
                                mc.name, other.name
                            )),
                        ));
                    }
                }
                if !r.models.is_empty() {
                    // Every model's cluster exists, and all speak one protocol: the head is
                    // written for the leg before the body names the model.
                    let mut first: Option<&ClusterConfig> = None;
                    let default = (!r.cluster.is_empty()).then_some(("", r.cluster.as_str()));
                    for (model, name) in default
                        .into_iter()
                        .chain(r.models.iter().map(|(m, c)| (m.as_str(), c.as_str())))
                    {
                        let key = if model.is_empty() {
                            "cluster"
                        } else {
                            "models"
                        };
                        let Some(c) = self.clusters.iter().find(|c| c.name == name) else {
                            let problem = match unknown(name) {
                                Problem::Invalid(text) if !model.is_empty() => {
                                    Problem::Invalid(format!("model {model:?}: {text}"))
                                }
                                p => p,
                            };
                            return Err(InvalidField::new(route.then(key), problem));
                        };
                        match first {
                            Some(f) if f.protocol != c.protocol => {
                                return Err(InvalidField::new(
                                    route.then(key),
                                    Problem::Invalid(format!(
                                        "cluster `{}` speaks another protocol than cluster `{}`: the clusters of a `models` route speak one (the request's head is written before its body names the model)",
                                        c.name, f.name
                                    )),
                                ));
                            }
                            None => first = Some(c),
                            _ => {}
                        }
                    }
                    continue;
                }
                if !r.split.is_empty() {
                    continue;
                }
                if r.cluster.is_empty() {
                    let problem = match (&r.redirect, &l.cluster) {
                        (Some(_), Some(_)) => continue,
                        (Some(_), None) => "a redirect route without `cluster` counts under the listener's `cluster`, and this listener has none: set `cluster` on the route or on the listener",
                        (None, _) => "required: the cluster that serves the route's requests (only a `redirect` route may leave it out)",
                    };
                    return Err(InvalidField::new(
                        route.then("cluster"),
                        Problem::Invalid(problem.into()),
                    ));
                }
                let Some(c) = self.clusters.iter().find(|c| c.name == r.cluster) else {
                    return Err(InvalidField::new(
                        route.then("cluster"),
                        unknown(&r.cluster),
                    ));
                };
                if let Some(attempts) = r.retry_attempts {
                    c.check_amplification(attempts).map_err(|e| {
                        InvalidField::new(
                            route.clone().then("retry_attempts"),
                            Problem::Invalid(format!("cluster `{}`: {}", c.name, e.problem)),
                        )
                    })?;
                }
            }
            if let Some(o) = self.listeners[..i]
                .iter()
                .find(|o| same_port(o.listen, l.listen))
            {
                return Err(InvalidField::new(
                    at.then("listen"),
                    Problem::Invalid(format!(
                        "{} is already used by another listener ({})",
                        l.listen, o.listen
                    )),
                ));
            }
            if let Some(a) = self
                .admin
                .as_ref()
                .filter(|a| same_port(a.listen, l.listen))
            {
                return Err(InvalidField::new(
                    at.then("listen"),
                    Problem::Invalid(format!(
                        "{} is the admin listener's address ({}); give one of them another port",
                        l.listen, a.listen
                    )),
                ));
            }
        }
        for (i, c) in self.clusters.iter().enumerate() {
            let at = FieldPath::key("cluster").at(i);
            if names[..i].contains(&c.name.as_str()) {
                return Err(InvalidField::new(
                    at.then("name"),
                    Problem::Invalid(format!("cluster `{}` is defined twice", c.name)),
                ));
            }
            c.validate().map_err(|e| e.under(at.clone()))?;
            if c.protections
                .outlier_detection
                .as_ref()
                .is_some_and(|o| o.shared.is_some())
            {
                let missing = match (&self.etcd, &self.name) {
                    (None, _) => Some("shared evidence travels through etcd: add the top-level [etcd] section (endpoints = [\"http://127.0.0.1:2379\"])"),
                    (_, None) => Some("shared evidence is published under this proxy's name: set the top-level `name` (e.g. name = \"keel-1\"), distinct in the fleet"),
                    _ => None,
                };
                if let Some(why) = missing {
                    return Err(InvalidField::new(
                        at.clone().then("outlier_detection").then("shared"),
                        Problem::Invalid(why.into()),
                    ));
                }
            }
            if matches!(c.discovery, Some(DiscoveryConfig::Etcd { .. })) && self.etcd.is_none() {
                return Err(InvalidField::new(
                    at.clone().then("discovery").then("etcd"),
                    Problem::Invalid(
                        "etcd discovery needs the top-level [etcd] section (endpoints = [\"http://127.0.0.1:2379\"])".into(),
                    ),
                ));
            }
            // Only TCP listeners send the PROXY header: an endpoint expecting one would refuse
            // keel's HTTP connections.
            let http_user = self.listeners.iter().find(|l| {
                l.protocol != ListenerProtocol::Tcp
                    && (l.cluster.as_deref() == Some(c.name.as_str())
                        || l.routes.iter().any(|r| r.clusters().any(|n| n == c.name)))
            });
            if let (Some(_), Some(l)) = (c.proxy_protocol, http_user) {
                return Err(InvalidField::new(
                    at.then("proxy_protocol"),
                    Problem::NotApplicable(format!(
                        "only TCP listeners send the PROXY header, and the HTTP listener on {} uses cluster `{}`",
                        l.listen, c.name
                    )),
                ));
            }
        }
        Ok(())
    }
}

// Building a configuration in code (the lab does): every option not given is at the default
// a TOML file would get (a test holds the two equal).

impl ProxyConfig {
    /// A configuration of these listeners and clusters, without `[admin]`; other options at
    /// their defaults. Check it with [`ProxyConfig::validate`].
    pub fn new(listeners: Vec<ListenerConfig>, clusters: Vec<ClusterConfig>) -> Self {
        ProxyConfig {
            drain_timeout: default_drain_timeout(),
            drain_delay: default_drain_delay(),
            admin: None,
            listeners,
            clusters,
            access_log: None,
            tracing: None,
            zone: None,
            name: None,
            etcd: None,
            source: None,
        }
    }

    /// Sets the proxy's zone and hands it to every cluster's balancer.
    pub fn set_zone(&mut self, zone: Option<String>) {
        for c in &mut self.clusters {
            c.zone.clone_from(&zone);
        }
        self.zone = zone;
    }
}
