//! The proxy's TOML configuration: listeners, clusters (keel-balance strategy and protections,
//! timeouts, retries, health checks) and the admin listener.
//!
//! Every option has a default (documented in `docs/configuration.md`); unknown keys are errors.
//! Errors name the file, the line and column, the key, and what is allowed.

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_balance::{
    BalancerConfig, EndpointSpec, FieldPath, InvalidField, OutlierConfig, PathSegment, Problem,
    SlowStartConfig, StrategyKind, StrategyOptions, TieBreak,
};
use serde::Deserialize;

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
    /// The file this configuration came from (for `POST /reload`), if any.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(10)
}

/// `[admin]`.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener. Default `127.0.0.1:9901` (loopback: the admin listener
    /// can reload the configuration, so it should not face the network).
    #[serde(default = "default_admin_listen")]
    pub listen: SocketAddr,
    /// Bearer token every admin request must carry (`Authorization: Bearer TOKEN`). Required
    /// when `listen` is not a loopback address; optional (but then enforced) on loopback.
    #[serde(default)]
    pub token: Option<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the token (configurations are logged and shown in errors).
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// `[access_log]`: one line per request answered.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    /// The file lines are appended to (created if need be), relative to the configuration
    /// file's directory; `"-"` for standard output.
    pub path: PathBuf,
    /// `"json"` (default: one object a line) or `"combined"` (NGINX's combined format).
    #[serde(default)]
    pub format: AccessLogFormat,
}

impl AccessLogConfig {
    /// The file, or `None` for standard output.
    pub fn file(&self) -> Option<PathBuf> {
        (self.path.as_os_str() != "-").then(|| self.path.clone())
    }
}

/// The format of the access log's lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessLogFormat {
    /// One JSON object a line.
    #[default]
    Json,
    /// NGINX's `combined` format.
    Combined,
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

/// `[[listener]]`: one address that clients connect to; its routes choose the cluster of each
/// request, its `cluster` serves the requests no route matches.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to listen on (port 0 = an ephemeral port).
    pub listen: SocketAddr,
    /// What clients speak: `"http"` (default: HTTP/1.1 and HTTP/2) or `"tcp"` (bytes: each
    /// connection goes to one endpoint, picked when it opens and finished when it closes).
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// Name of the cluster that serves the requests no route matches. Required without
    /// routes; without it, a request no route matches gets `404`.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Routes (`[[listener.route]]`), tried in order; the first match wins.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
    /// Most client connections open at once; further clients wait in the kernel's accept
    /// queue until one closes. Default 10000.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Most bytes of a request's line and headers (HTTP/1.1; the header list for HTTP/2);
    /// beyond it the answer is `431`. At least 8192 (hyper's smallest read buffer). Default
    /// 65536.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Most header lines in an HTTP/1.1 request; beyond it the answer is `431`. Default 100.
    #[serde(default = "default_max_headers")]
    pub max_headers: usize,
    /// Time allowed to receive a request's headers, counted from the moment the connection
    /// waits for a request; then the connection is closed. HTTP/1.1 only. Default 10 s.
    #[serde(
        default = "default_header_read_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed. Default 60 s.
    #[serde(
        default = "default_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub idle_timeout: Duration,
    /// Largest request body accepted, in bytes; larger ones get `413` (at once when
    /// `Content-Length` says so, else when the streamed body passes the limit). Unset: no
    /// limit.
    #[serde(default)]
    pub max_request_body_bytes: Option<u64>,
    /// Terminate TLS on this listener (`[listener.tls]`); plain TCP unless present.
    #[serde(default)]
    pub tls: Option<ListenerTlsConfig>,
    /// Clients whose `X-Forwarded-For` is believed (CIDR blocks, e.g. `["10.0.0.0/8"]`): keel
    /// appends the client's address to theirs. From any other client the header is replaced
    /// by the client's address, so a client cannot pass itself off as another. Default: none.
    #[serde(default)]
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// How much of a failure's cause keel's own answers (502, 503, 504) tell the client:
    /// `"brief"` (default: the kind of failure, no addresses, no system errors) or `"full"`
    /// (the endpoint's address and the error, as logged). Logs and metrics always have it all.
    #[serde(default)]
    pub error_detail: ErrorDetail,
    /// An upgraded HTTP/1.1 connection (WebSocket and the like) with no byte either way for
    /// this long is closed. Default 1 h.
    #[serde(
        default = "default_tunnel_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub tunnel_idle_timeout: Duration,
}

/// `protocol` of a listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 (by ALPN or prior knowledge).
    #[default]
    Http,
    /// TCP: bytes both ways between the client and one endpoint.
    Tcp,
}

/// `protocol` of a cluster: how keel speaks to its endpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 on keep-alive connections (over `[cluster.tls]` when present).
    #[default]
    Http1,
    /// HTTP/2 over plain TCP, with prior knowledge.
    H2c,
    /// HTTP/2 over TLS (`[cluster.tls]` required), ALPN `h2`.
    H2,
}

/// `proxy_protocol` of a cluster: the PROXY protocol header sent at the start of each
/// connection of a TCP listener to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProxyProtocol {
    /// Version 1 (text).
    V1,
    /// Version 2 (binary).
    V2,
}

/// `error_detail` of a listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorDetail {
    /// The kind of failure only.
    #[default]
    Brief,
    /// The endpoint's address and the error too.
    Full,
}

impl ListenerConfig {
    /// True if `ip` is one of `trusted_proxies`.
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }
}

/// `[listener.tls]`: the listener terminates TLS (HTTP/2 or HTTP/1.1, chosen by ALPN).
/// Relative paths are taken from the configuration file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// PEM file with the certificate chain, the server's certificate first.
    pub cert: PathBuf,
    /// PEM file with the certificate's private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key: PathBuf,
}

/// `[cluster.tls]`: the cluster's endpoints are reached over TLS (ALPN `http/1.1`, or `h2`
/// with `protocol = "h2"`). Relative paths
/// are taken from the configuration file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTlsConfig {
    /// PEM file with the CA certificates that endpoints' certificates must chain to. Required:
    /// the system's roots are not used.
    pub ca: PathBuf,
    /// Name that every endpoint's certificate must be valid for (also sent as SNI). Default:
    /// each endpoint's host (an IP address is matched against the certificate's IP SANs).
    #[serde(default)]
    pub server_name: Option<String>,
}

fn default_max_connections() -> usize {
    10_000
}
fn default_max_header_bytes() -> usize {
    65536
}
fn default_max_headers() -> usize {
    100
}
fn default_header_read_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_tunnel_idle_timeout() -> Duration {
    Duration::from_secs(3600)
}

/// True if two listening addresses would take the same port: the same port (not 0) on the
/// same address, or on any address when one of them is unspecified (`0.0.0.0`, `[::]`).
fn same_port(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// hyper's smallest HTTP/1 read buffer, hence the smallest `max_header_bytes`.
pub const MIN_HEADER_BYTES: usize = 8192;

impl ListenerConfig {
    /// True if everything but the cluster and the routes is the same (what a reload may not
    /// change, TLS certificate paths included).
    pub fn same_socket_settings(&self, other: &ListenerConfig) -> bool {
        let mut a = self.clone();
        a.cluster.clone_from(&other.cluster);
        a.routes.clone_from(&other.routes);
        a == *other
    }
}

/// `[[listener.route]]`: the conditions a request must meet (all of them; none: every request)
/// and the cluster that then serves it, with optional overrides of the cluster's limits.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The request's host (`Host`, or the absolute target's or HTTP/2's authority, without
    /// its port; case-insensitive): exactly `api.example.test`, or `*.example.test` for one or
    /// more labels in place of `*`.
    #[serde(default)]
    pub host: Option<String>,
    /// The path (without the query) starts with this.
    #[serde(default)]
    pub path_prefix: Option<String>,
    /// The path (without the query) is exactly this.
    #[serde(default)]
    pub path: Option<String>,
    /// The method is one of these (case-sensitive, as methods are).
    #[serde(default)]
    pub methods: Vec<String>,
    /// Each of these headers is present with exactly this value (names case-insensitive).
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The cluster that serves the requests of this route.
    pub cluster: String,
    /// Overrides the cluster's `request_timeout` for this route.
    #[serde(default, with = "keel_balance::duration_serde::option")]
    pub request_timeout: Option<Duration>,
    /// Overrides the cluster's `retry.attempts` for this route.
    #[serde(default)]
    pub retry_attempts: Option<u32>,
}

/// A route's host condition, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HostPattern {
    /// Any host.
    Any,
    /// This host (lower case).
    Exact(String),
    /// Any host under this domain (lower case, without the `*.`).
    Wildcard(String),
}

/// A route's path condition, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PathPattern {
    /// Any path.
    Any,
    /// Exactly this path.
    Exact(String),
    /// Paths that start with this.
    Prefix(String),
}

impl PathPattern {
    /// The first segment every matching path has (`/v1/x` -> `v1`), when the condition fixes
    /// it: an exact path, or a prefix that goes past the first segment's end.
    pub fn first_segment(&self) -> Option<&str> {
        match self {
            PathPattern::Any => None,
            PathPattern::Exact(p) => {
                let rest = p.strip_prefix('/')?;
                Some(rest.split_once('/').map_or(rest, |(s, _)| s))
            }
            PathPattern::Prefix(p) => p.strip_prefix('/')?.split_once('/').map(|(s, _)| s),
        }
    }
}

impl RouteConfig {
    /// The host condition.
    pub(crate) fn host_pattern(&self) -> HostPattern {
        match self.host.as_deref().map(str::to_ascii_lowercase) {
            None => HostPattern::Any,
            Some(h) => match h.strip_prefix("*.") {
                Some(domain) => HostPattern::Wildcard(domain.to_string()),
                None => HostPattern::Exact(h),
            },
        }
    }

    /// The path condition.
    pub(crate) fn path_pattern(&self) -> PathPattern {
        match (&self.path, &self.path_prefix) {
            (Some(p), _) => PathPattern::Exact(p.clone()),
            (None, Some(p)) => PathPattern::Prefix(p.clone()),
            (None, None) => PathPattern::Any,
        }
    }

    /// Checks the conditions and overrides; paths are relative to the `[[listener.route]]`.
    /// The cluster it names is checked by [`ProxyConfig::validate`].
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(h) = &self.host {
            let name = h.strip_prefix("*.").unwrap_or(h);
            let ip6 = name.starts_with('[')
                && name.ends_with(']')
                && name[1..name.len() - 1]
                    .parse::<std::net::Ipv6Addr>()
                    .is_ok();
            if !ip6 && !crate::discovery::is_dns_name(name) {
                return Err(InvalidField::at("host", Problem::Invalid(format!("`{h}` is not a host name; expected e.g. \"api.example.test\" or \"*.example.test\" (no port, no scheme)"))));
            }
        }
        if self.path.is_some() && self.path_prefix.is_some() {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid("set `path` (exact) or `path_prefix`, not both".into()),
            ));
        }
        for (key, p) in [("path", &self.path), ("path_prefix", &self.path_prefix)] {
            if let Some(p) = p {
                if !p.starts_with('/')
                    || p.contains('?')
                    || p.bytes().any(|b| b <= b' ' || b == 0x7f)
                {
                    return Err(InvalidField::at(
                        key,
                        Problem::Invalid(format!("`{p}` is not a path; it must start with `/` and have no query (`?`) or spaces")),
                    ));
                }
            }
        }
        if let Some(m) = self
            .methods
            .iter()
            .find(|m| hyper::Method::from_bytes(m.as_bytes()).is_err() || m.is_empty())
        {
            return Err(InvalidField::at(
                "methods",
                Problem::Invalid(format!("`{m}` is not a method, e.g. \"GET\"")),
            ));
        }
        for (name, value) in &self.headers {
            if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(InvalidField::at(
                    "headers",
                    Problem::Invalid(format!("`{name}` is not a header name")),
                ));
            }
            if hyper::header::HeaderValue::from_str(value).is_err() {
                return Err(InvalidField::at(
                    "headers",
                    Problem::Invalid(format!("the value of `{name}` is not a header value")),
                ));
            }
        }
        if let Some(t) = self.request_timeout {
            if t < Duration::from_millis(1) {
                return Err(InvalidField::at(
                    "request_timeout",
                    Problem::out_of_range("at least 1ms", humantime::format_duration(t)),
                ));
            }
        }
        if let Some(a) = self.retry_attempts {
            if a > MAX_RETRY_ATTEMPTS {
                return Err(InvalidField::at(
                    "retry_attempts",
                    Problem::out_of_range(format!("within 0..={MAX_RETRY_ATTEMPTS}"), a),
                ));
            }
        }
        Ok(())
    }
}

/// `discovery` of a cluster: one source of its endpoints, e.g. `{ dns = "api.internal.test",
/// port = 9000 }`, `{ srv = "_http._tcp.api.internal.test" }` or `{ file = "endpoints.toml" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// A name whose A and AAAA records are the endpoints (each address with `port`, weight 1).
    #[serde(default)]
    pub dns: Option<String>,
    /// An SRV name (`_service._proto.name`, RFC 2782): each target of the lowest priority in
    /// use, with the record's port and weight.
    #[serde(default)]
    pub srv: Option<String>,
    /// A TOML file holding `endpoints = [...]` as in the configuration, read again when it
    /// changes; relative to the configuration file.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// The endpoints' port (`dns` only).
    #[serde(default)]
    pub port: Option<u16>,
    /// The DNS server to ask (`dns`, `srv`); the system's (`/etc/resolv.conf`) otherwise.
    #[serde(default)]
    pub resolver: Option<SocketAddr>,
    /// Time between two resolutions (`dns`, `srv`). Default 5 s, at least 1 s.
    #[serde(default, with = "keel_balance::duration_serde::option")]
    pub refresh: Option<Duration>,
}

/// How often a DNS source is resolved unless `refresh` says otherwise.
pub const DEFAULT_DISCOVERY_REFRESH: Duration = Duration::from_secs(5);

/// The kind of a discovery source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscoveryKind {
    /// A and AAAA records.
    Dns,
    /// SRV records.
    Srv,
    /// A file.
    File,
}

impl DiscoveryConfig {
    /// The kind of source (the configuration was validated: exactly one is set).
    pub fn kind(&self) -> DiscoveryKind {
        match (&self.dns, &self.srv) {
            (Some(_), _) => DiscoveryKind::Dns,
            (None, Some(_)) => DiscoveryKind::Srv,
            (None, None) => DiscoveryKind::File,
        }
    }

    /// Time between two resolutions.
    pub fn refresh(&self) -> Duration {
        self.refresh.unwrap_or(DEFAULT_DISCOVERY_REFRESH)
    }

    /// The source in words, e.g. `dns api.internal.test:9000 via 127.0.0.1:5353`.
    pub fn describe(&self) -> String {
        let via = self
            .resolver
            .map_or(" via the system's resolver".to_string(), |r| {
                format!(" via {r}")
            });
        match (&self.dns, &self.srv, &self.file) {
            (Some(d), _, _) => format!("dns {d}:{}{via}", self.port.unwrap_or(0)),
            (None, Some(s), _) => format!("srv {s}{via}"),
            (None, None, Some(f)) => format!("file {}", f.display()),
            (None, None, None) => "none".into(),
        }
    }

    /// Checks the source without resolving anything: one kind, a valid name, the keys that go
    /// with it, and for a file that it reads and holds valid endpoints. Paths are relative to
    /// `discovery`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let set = [self.dns.is_some(), self.srv.is_some(), self.file.is_some()];
        if set.iter().filter(|s| **s).count() != 1 {
            return Err(InvalidField::new(
                FieldPath::root(),
                Problem::Invalid("set one of `dns` (with `port`), `srv` or `file`".into()),
            ));
        }
        let not_here = |key: &'static str, why: &str| {
            Err(InvalidField::at(key, Problem::NotApplicable(why.into())))
        };
        match self.kind() {
            DiscoveryKind::Dns => {
                let name = self.dns.as_deref().unwrap_or_default();
                if let Err(m) = crate::discovery::check_name(name, false) {
                    return Err(InvalidField::at("dns", Problem::Invalid(m)));
                }
                if self.port.is_none_or(|p| p == 0) {
                    return Err(InvalidField::at(
                        "port",
                        Problem::Invalid("`dns` needs the endpoints' `port` (1..=65535)".into()),
                    ));
                }
            }
            DiscoveryKind::Srv => {
                let name = self.srv.as_deref().unwrap_or_default();
                if let Err(m) = crate::discovery::check_name(name, true) {
                    return Err(InvalidField::at("srv", Problem::Invalid(m)));
                }
                if self.port.is_some() {
                    return not_here("port", "SRV records carry the port");
                }
            }
            DiscoveryKind::File => {
                if self.port.is_some() {
                    return not_here("port", "the file lists addresses with their ports");
                }
                if self.resolver.is_some() {
                    return not_here("resolver", "a file is not resolved");
                }
                if self.refresh.is_some() {
                    return not_here(
                        "refresh",
                        "a file is looked at every second and read again when it changes",
                    );
                }
                let path = self.file.as_deref().unwrap_or(Path::new(""));
                if let Err(m) = crate::discovery::read_file(path) {
                    return Err(InvalidField::at("file", Problem::Invalid(m)));
                }
            }
        }
        if let Some(r) = self.refresh {
            if r < Duration::from_secs(1) {
                return Err(InvalidField::at(
                    "refresh",
                    Problem::out_of_range("at least 1s", humantime::format_duration(r)),
                ));
            }
        }
        Ok(())
    }
}

/// `[[cluster]]`: a set of endpoints, its balancer and how requests to it are made.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Unique name, referenced by listeners.
    pub name: String,
    /// keel-balance strategy. Default `round-robin`.
    #[serde(default = "default_strategy")]
    pub strategy: StrategyKind,
    /// The endpoints: `{ address = "host:port", weight = 1 }`. Required unless `discovery`
    /// finds them.
    #[serde(default)]
    pub endpoints: Vec<EndpointSpec>,
    /// Where the endpoints come from when they are not listed: DNS (A/AAAA or SRV records)
    /// or a file, refreshed while the proxy runs.
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// How keel speaks to the endpoints: `"http1"` (default), `"h2c"` (HTTP/2 with prior
    /// knowledge) or `"h2"` (HTTP/2 over `[cluster.tls]`, ALPN `h2`). Either way one pick per
    /// request.
    #[serde(default)]
    pub protocol: UpstreamProtocol,
    /// PROXY protocol header (`"v1"` or `"v2"`) at the start of each connection a TCP
    /// listener opens to an endpoint. Unset: none.
    #[serde(default)]
    pub proxy_protocol: Option<ProxyProtocol>,

    /// least-connections, least-time: tie-break (`random` or `lowest-index`). Default `random`.
    #[serde(default)]
    pub tie_break: TieBreak,
    /// least-request, peak-ewma: candidates compared per pick. Default 2.
    #[serde(default = "default_choices")]
    pub choices: u32,
    /// least-time, peak-ewma: EWMA time constant. Default 10 s.
    #[serde(default = "default_decay", with = "keel_balance::duration_serde")]
    pub decay: Duration,
    /// peak-ewma: latency assumed before the first sample. Default 30 ms.
    #[serde(default = "default_rtt", with = "keel_balance::duration_serde")]
    pub default_rtt: Duration,
    /// peak-ewma: a failure counts as at least this latency. Default 1 s.
    #[serde(
        default = "default_failure_penalty",
        with = "keel_balance::duration_serde"
    )]
    pub failure_penalty: Duration,
    /// ring-hash: virtual nodes per endpoint of mean weight. Default 160.
    #[serde(default = "default_vnodes")]
    pub vnodes: u32,
    /// maglev: lookup table size (a prime). Default 65537.
    #[serde(default = "default_table_size")]
    pub table_size: u64,
    /// Hash strategies: bounded load factor (e.g. 1.25); off unless set.
    #[serde(default)]
    pub bounded_load: Option<f64>,
    /// Panic threshold in percent of available endpoints (0 = off). Default 50.
    #[serde(default = "default_panic_threshold")]
    pub panic_threshold: f64,
    /// Seed of the balancer's random choices. Default keel-balance's fixed seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Passive outlier detection (`[cluster.outlier_detection]`); off unless present.
    #[serde(default)]
    pub outlier_detection: Option<OutlierConfig>,
    /// Slow start (`[cluster.slow_start]`); off unless present.
    #[serde(default)]
    pub slow_start: Option<SlowStartConfig>,
    /// Where hash strategies take the request's key: `"header:NAME"`, `"path"` or
    /// `"client-ip"`. Unset: a random key per request (no affinity).
    #[serde(default)]
    pub hash_on: Option<HashOn>,

    /// Time allowed to open a TCP connection to an endpoint. Default 1 s.
    #[serde(
        default = "default_connect_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub connect_timeout: Duration,
    /// Time allowed for the whole request, all tries included, until the response body has
    /// been sent. Default 15 s.
    #[serde(
        default = "default_request_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub request_timeout: Duration,
    /// Responses whose `Content-Length` is at most this many bytes are read whole before they
    /// are forwarded, so that an endpoint failing mid-body can still be retried; larger or
    /// chunked bodies stream through. 0 streams everything. Default 65536.
    #[serde(default = "default_max_buffered_response")]
    pub max_buffered_response: u64,
    /// Idle keep-alive connections to an endpoint are closed after this long. Default 90 s.
    #[serde(
        default = "default_pool_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub pool_idle_timeout: Duration,
    /// Most idle keep-alive connections kept per endpoint. Default 256.
    #[serde(default = "default_pool_max_idle")]
    pub pool_max_idle_per_endpoint: usize,
    /// Circuit breaker: most client requests served at once by this cluster; beyond it the
    /// proxy answers `503` at once, without trying an endpoint. Default 10000.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Retries (`[cluster.retry]`).
    #[serde(default)]
    pub retry: RetryConfig,
    /// Active HTTP health checks (`[cluster.health_check]`); off unless present.
    #[serde(default)]
    pub health_check: Option<HealthCheckConfig>,
    /// TLS to the endpoints (`[cluster.tls]`); plain TCP unless present.
    #[serde(default)]
    pub tls: Option<UpstreamTlsConfig>,
    /// Hedged requests (`[cluster.hedge]`): a second try of a slow idempotent request to
    /// another endpoint; off unless present.
    #[serde(default)]
    pub hedge: Option<keel_balance::HedgeConfig>,
    /// Load probes (`[cluster.probe]`) for a strategy that balances on the load endpoints
    /// report (prequal); other strategies send none.
    #[serde(default)]
    pub probe: ProbeConfig,
}

/// `[cluster.probe]`: after each pick, a prequal balancer names `probes_per_request` random
/// endpoints, and each gets `GET path` on a connection of its own; the `x-keel-rif` and
/// `x-keel-latency-us` headers of the answer are its load report (`keel backend` answers them
/// at `/keel/load`). Answers to requests carry the same headers and count too.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Path requested. Default `/keel/load`.
    #[serde(default = "default_probe_path")]
    pub path: String,
    /// Endpoints probed after each pick (prequal's `probes_per_pick`), 0 to 16; 0 sends none
    /// (reports come from answers only). Default 3.
    #[serde(default = "default_probes_per_request")]
    pub probes_per_request: u32,
    /// Time allowed for one probe (connect and answer); a late answer is dropped. Default
    /// 100 ms.
    #[serde(
        default = "default_probe_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub timeout: Duration,
}

fn default_probe_path() -> String {
    keel_balance::LOAD_PATH.into()
}
fn default_probes_per_request() -> u32 {
    StrategyOptions::default().probes_per_pick
}
fn default_probe_timeout() -> Duration {
    Duration::from_millis(100)
}

impl Default for ProbeConfig {
    /// `GET /keel/load` to 3 endpoints after each pick, 100 ms to answer.
    fn default() -> Self {
        Self {
            path: default_probe_path(),
            probes_per_request: default_probes_per_request(),
            timeout: default_probe_timeout(),
        }
    }
}

impl ProbeConfig {
    /// Checks the probe settings; paths are relative to `[cluster.probe]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.probes_per_request > 16 {
            return Err(InvalidField::at(
                "probes_per_request",
                Problem::out_of_range("within 0..=16", self.probes_per_request),
            ));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        Ok(())
    }
}

fn default_strategy() -> StrategyKind {
    StrategyKind::RoundRobin
}
fn default_choices() -> u32 {
    StrategyOptions::default().choices
}
fn default_decay() -> Duration {
    StrategyOptions::default().decay
}
fn default_rtt() -> Duration {
    StrategyOptions::default().default_rtt
}
fn default_failure_penalty() -> Duration {
    StrategyOptions::default().failure_penalty
}
fn default_vnodes() -> u32 {
    StrategyOptions::default().vnodes
}
fn default_table_size() -> u64 {
    StrategyOptions::default().table_size
}
fn default_panic_threshold() -> f64 {
    BalancerConfig::default().panic_threshold
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_request_timeout() -> Duration {
    Duration::from_secs(15)
}
fn default_max_buffered_response() -> u64 {
    65536
}
fn default_pool_idle_timeout() -> Duration {
    Duration::from_secs(90)
}
fn default_pool_max_idle() -> usize {
    256
}
fn default_max_in_flight() -> usize {
    10_000
}

/// Most retries a request may make (keeps the per-request list of tried endpoints inline).
pub const MAX_RETRY_ATTEMPTS: u32 = 10;

/// `[cluster.retry]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Retries after the first try (0 = never retry). Default 1.
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// Time allowed for one try until the response headers (and a buffered body) arrive.
    /// Default: `request_timeout / (attempts + 1)`, so that every allowed try fits.
    #[serde(default, with = "keel_balance::duration_serde::option")]
    pub per_try_timeout: Option<Duration>,
    /// Upstream statuses that count as the endpoint's failure (for outlier detection and
    /// latency-aware strategies) and are retried. Default `[502, 503, 504]`.
    #[serde(default = "default_retry_on_status")]
    pub retry_on_status: Vec<u16>,
    /// gRPC status codes (besides 14 UNAVAILABLE, always one) that count as the endpoint's
    /// failure and are retried while no response byte reached the client. Default none.
    #[serde(default)]
    pub retry_on_grpc_status: Vec<u32>,
    /// Retries may be at most this percentage of the requests in the budget window. Default 20.
    #[serde(default = "default_budget_percent")]
    pub budget_percent: f64,
    /// Retries always allowed per second whatever the traffic. Default 3.
    #[serde(default = "default_min_retries_per_second")]
    pub min_retries_per_second: f64,
    /// Sliding window of the retry budget. Default 10 s.
    #[serde(
        default = "default_budget_window",
        with = "keel_balance::duration_serde"
    )]
    pub budget_window: Duration,
}

fn default_attempts() -> u32 {
    1
}
fn default_retry_on_status() -> Vec<u16> {
    vec![502, 503, 504]
}
fn default_budget_percent() -> f64 {
    keel_balance::RetryBudgetConfig::default().budget_percent
}
fn default_min_retries_per_second() -> f64 {
    keel_balance::RetryBudgetConfig::default().min_retries_per_second
}
fn default_budget_window() -> Duration {
    keel_balance::RetryBudgetConfig::default().window
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            attempts: default_attempts(),
            per_try_timeout: None,
            retry_on_status: default_retry_on_status(),
            retry_on_grpc_status: Vec::new(),
            budget_percent: default_budget_percent(),
            min_retries_per_second: default_min_retries_per_second(),
            budget_window: default_budget_window(),
        }
    }
}

impl RetryConfig {
    /// The retry budget settings for keel-balance.
    pub fn budget(&self) -> keel_balance::RetryBudgetConfig {
        keel_balance::RetryBudgetConfig {
            budget_percent: self.budget_percent,
            min_retries_per_second: self.min_retries_per_second,
            window: self.budget_window,
        }
    }
}

/// `[cluster.health_check]`: a periodic probe of every endpoint: `GET path` (a 2xx answer
/// within the timeout passes), a TCP connect, or gRPC's `grpc.health.v1.Health/Check`
/// (`SERVING` passes).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// `"http"` (default), `"tcp"` (connect only) or `"grpc"` (an h2 or h2c cluster).
    #[serde(default)]
    pub kind: HealthCheckKind,
    /// gRPC: the service asked about (empty: the server as a whole). Default `""`.
    #[serde(default)]
    pub service: String,
    /// Path requested. Default `/healthz`.
    #[serde(default = "default_hc_path")]
    pub path: String,
    /// Time between checks of one endpoint. Default 5 s.
    #[serde(default = "default_hc_interval", with = "keel_balance::duration_serde")]
    pub interval: Duration,
    /// Time allowed for one check (connect, headers and body). Default 1 s.
    #[serde(default = "default_hc_timeout", with = "keel_balance::duration_serde")]
    pub timeout: Duration,
    /// Failed checks in a row that mark a healthy endpoint unhealthy. Default 2.
    #[serde(default = "default_threshold")]
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that mark an unhealthy endpoint healthy again. Default 2.
    #[serde(default = "default_threshold")]
    pub healthy_threshold: u32,
}

/// `kind` of a health check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HealthCheckKind {
    /// `GET path`, 2xx passes.
    #[default]
    Http,
    /// A TCP connect (and TLS handshake with `[cluster.tls]`) passes.
    Tcp,
    /// `grpc.health.v1.Health/Check`, `SERVING` passes.
    Grpc,
}

fn default_hc_path() -> String {
    "/healthz".into()
}
fn default_hc_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_hc_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_threshold() -> u32 {
    2
}

/// Where a hash strategy takes its key from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashOn {
    /// The value of this request header (lower-case name); requests without it get a random
    /// key.
    Header(hyper::header::HeaderName),
    /// The request path (without the query).
    Path,
    /// The client's IP address.
    ClientIp,
}

impl HashOn {
    const ALLOWED: &'static str = "\"header:NAME\", \"path\", \"client-ip\"";
}

impl std::str::FromStr for HashOn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "path" => Ok(HashOn::Path),
            "client-ip" => Ok(HashOn::ClientIp),
            _ => {
                if let Some(name) = s.strip_prefix("header:") {
                    hyper::header::HeaderName::from_bytes(name.trim().as_bytes())
                        .map(HashOn::Header)
                        .map_err(|_| format!("`{name}` is not a valid header name"))
                } else {
                    Err(format!(
                        "unknown hash_on `{s}`; allowed: {}",
                        HashOn::ALLOWED
                    ))
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for HashOn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for HashOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashOn::Header(h) => write!(f, "header:{h}"),
            HashOn::Path => f.write_str("path"),
            HashOn::ClientIp => f.write_str("client-ip"),
        }
    }
}

impl ClusterConfig {
    /// The keel-balance configuration of this cluster.
    pub fn balancer_config(&self) -> BalancerConfig {
        let mut b = BalancerConfig::new(self.strategy);
        b.options = StrategyOptions {
            tie_break: self.tie_break,
            choices: self.choices,
            decay: self.decay,
            default_rtt: self.default_rtt,
            failure_penalty: self.failure_penalty,
            vnodes: self.vnodes,
            table_size: self.table_size,
            bounded_load: self.bounded_load,
            probes_per_pick: self.probe.probes_per_request.max(1),
            ..StrategyOptions::default()
        };
        b.outlier_detection = self.outlier_detection.clone();
        b.panic_threshold = self.panic_threshold;
        b.slow_start = self.slow_start.clone();
        if let Some(seed) = self.seed {
            b.seed = seed;
        }
        b
    }

    /// The ALPN protocol offered to endpoints over TLS.
    pub fn alpn(&self) -> &'static [u8] {
        match self.protocol {
            UpstreamProtocol::H2 => crate::tls::ALPN_H2,
            _ => crate::tls::ALPN_HTTP11,
        }
    }

    /// The per-try timeout in force (explicit, or the request timeout shared by every try).
    pub fn per_try_timeout(&self) -> Duration {
        self.retry
            .per_try_timeout
            .unwrap_or_else(|| self.request_timeout / (self.retry.attempts + 1))
    }
}

/// A configuration error: where it is and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// The file (or other origin) of the configuration.
    pub origin: String,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// Dotted key path, e.g. `cluster[0].retry.attempts`, when known.
    pub key: Option<String>,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        if let Some(key) = &self.key {
            write!(f, ": `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl ProxyConfig {
    /// Parses and validates TOML; `origin` (a file name) appears in error messages.
    ///
    /// Relative TLS and access-log paths are taken from the current directory.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<ProxyConfig, ConfigError> {
        Self::parse(text, origin, None)
    }

    /// Parses, makes relative TLS paths relative to `base` (when given), and validates
    /// (loading the TLS files).
    fn parse(text: &str, origin: &str, base: Option<&Path>) -> Result<ProxyConfig, ConfigError> {
        let doc = match toml_edit::ImDocument::parse(text) {
            Ok(doc) => doc,
            Err(e) => {
                let (line, column) = e
                    .span()
                    .map(|s| line_col(text, s.start))
                    .map_or((None, None), |(l, c)| (Some(l), Some(c)));
                return Err(ConfigError {
                    origin: origin.to_string(),
                    line,
                    column,
                    key: None,
                    message: format!("invalid TOML: {}", e.message().trim()),
                });
            }
        };
        let mut index = Vec::new();
        collect_item(doc.as_item(), &mut Vec::new(), &mut index);
        let locate = |span: Option<Range<usize>>, key: Option<String>, message: String| {
            let (line, column) = span
                .map(|s| line_col(text, s.start))
                .map_or((None, None), |(l, c)| (Some(l), Some(c)));
            ConfigError {
                origin: origin.to_string(),
                line,
                column,
                key,
                message,
            }
        };
        let mut config: ProxyConfig = match toml::from_str(text) {
            Ok(c) => c,
            Err(e) => {
                let span = e.span();
                let key = span.as_ref().and_then(|s| key_at(&index, s.start));
                return Err(locate(span, key, e.message().trim().to_string()));
            }
        };
        if let Some(base) = base {
            config.resolve_paths(base);
        }
        if let Err(e) = config.validate() {
            let (span, key) = span_of(&index, &e.field);
            let key = (!key.is_empty()).then_some(key);
            return Err(locate(span, key, e.problem.to_string()));
        }
        Ok(config)
    }

    /// Reads, parses and validates a file.
    pub fn from_file(path: &Path) -> Result<ProxyConfig, ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            origin: origin.clone(),
            line: None,
            column: None,
            key: None,
            message: format!("cannot read the file: {e}"),
        })?;
        let mut config = Self::parse(&text, &origin, path.parent())?;
        config.source = Some(path.to_path_buf());
        Ok(config)
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
            }
        }
        for c in &mut self.clusters {
            if let Some(t) = &mut c.tls {
                resolve(&mut t.ca);
            }
        }
        if let Some(a) = &mut self.access_log {
            if a.file().is_some() {
                resolve(&mut a.path);
            }
        }
        for c in &mut self.clusters {
            if let Some(f) = c.discovery.as_mut().and_then(|d| d.file.as_mut()) {
                resolve(f);
            }
        }
    }

    /// The cluster of this name.
    pub fn cluster(&self, name: &str) -> Option<&ClusterConfig> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// Checks everything serde cannot: references between sections, ranges, TLS files, and
    /// that each cluster's balancer builds. Each section checks itself ([`ListenerConfig::validate`],
    /// [`ClusterConfig::validate`], ...); the error's field is the key's path in the document,
    /// e.g. `cluster[0].endpoints[1].weight`. [`ProxyConfig::from_toml_str`] calls it and adds
    /// the key's line; a configuration built in code should call it before [`crate::start`].
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
                if !names.contains(&r.cluster.as_str()) {
                    let field = at.clone().then("route").at(j).then("cluster");
                    return Err(InvalidField::new(field, unknown(&r.cluster)));
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
            // Only TCP listeners send the PROXY header: an endpoint expecting one would refuse
            // keel's HTTP connections.
            let http_user = self.listeners.iter().find(|l| {
                l.protocol == ListenerProtocol::Http
                    && (l.cluster.as_deref() == Some(c.name.as_str())
                        || l.routes.iter().any(|r| r.cluster == c.name))
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

impl AdminConfig {
    /// Checks the token; paths are relative to `[admin]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        match &self.token {
            None if !self.listen.ip().is_loopback() => Err(InvalidField::at(
                "token",
                Problem::Invalid(format!(
                    "the admin listener {} is not on loopback: set `token` in [admin] (every admin request must then carry `Authorization: Bearer TOKEN`), or listen on 127.0.0.1",
                    self.listen
                )),
            )),
            Some(t) if t.len() < 16 || t.chars().any(|c| c.is_whitespace() || c.is_control()) => {
                Err(InvalidField::at(
                    "token",
                    Problem::Invalid(
                        "must be at least 16 characters, without spaces or control characters"
                            .into(),
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// "must be greater than zero" for a duration key.
fn zero(key: &'static str) -> InvalidField {
    InvalidField::at(key, Problem::out_of_range("greater than zero", "0s"))
}

/// "must be at least 1" for a count key.
fn none(key: &'static str) -> InvalidField {
    InvalidField::at(key, Problem::out_of_range("at least 1", 0))
}

impl ListenerConfig {
    /// Checks the limits and loads the TLS files (so that `--check` and a reload catch a bad
    /// certificate); paths are relative to the `[[listener]]`. The cluster it names is checked
    /// by [`ProxyConfig::validate`].
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.max_connections == 0 {
            return Err(none("max_connections"));
        }
        if self.max_header_bytes < MIN_HEADER_BYTES || self.max_header_bytes > u32::MAX as usize {
            return Err(InvalidField::at(
                "max_header_bytes",
                Problem::out_of_range(
                    format!("within {MIN_HEADER_BYTES}..={}", u32::MAX),
                    self.max_header_bytes,
                ),
            ));
        }
        if self.max_headers == 0 {
            return Err(none("max_headers"));
        }
        if self.header_read_timeout.is_zero() {
            return Err(zero("header_read_timeout"));
        }
        if self.idle_timeout.is_zero() {
            return Err(zero("idle_timeout"));
        }
        if self.tunnel_idle_timeout.is_zero() {
            return Err(zero("tunnel_idle_timeout"));
        }
        if self.protocol == ListenerProtocol::Tcp {
            if !self.routes.is_empty() {
                return Err(InvalidField::at(
                    "route",
                    Problem::NotApplicable(
                        "a TCP listener has no requests to route: give it `cluster` only".into(),
                    ),
                ));
            }
            if self.cluster.is_none() {
                return Err(InvalidField::at(
                    "cluster",
                    Problem::Invalid("a TCP listener needs its `cluster`".into()),
                ));
            }
        }
        if let Some(t) = &self.tls {
            if let Err(e) = crate::tls::server_config(t) {
                return Err(InvalidField::new(
                    FieldPath::key("tls").then(e.key),
                    Problem::Invalid(e.message),
                ));
            }
        }
        if self.routes.len() > usize::from(u16::MAX) {
            return Err(InvalidField::at(
                "route",
                Problem::out_of_range(format!("at most {} routes", u16::MAX), self.routes.len()),
            ));
        }
        for (j, r) in self.routes.iter().enumerate() {
            r.validate()
                .map_err(|e| e.under(FieldPath::key("route").at(j)))?;
        }
        Ok(())
    }
}

impl AccessLogConfig {
    /// Checks the path; paths are relative to `[access_log]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.path.as_os_str().is_empty() || self.path.is_dir() {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a file path; expected e.g. \"access.log\", or \"-\" for standard output",
                    self.path.display()
                )),
            ));
        }
        Ok(())
    }
}

impl ClusterConfig {
    /// Checks the cluster: endpoints, timeouts, TLS, retries, health checks, and everything
    /// keel-balance checks of its balancer (options, protections, weights, duplicates). Paths
    /// are relative to the `[[cluster]]`, e.g. `endpoints[1].weight` or
    /// `outlier_detection.failure_rate.threshold_percent`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.name.is_empty() {
            return Err(InvalidField::at(
                "name",
                Problem::Invalid("a cluster name cannot be empty".into()),
            ));
        }
        match &self.discovery {
            Some(d) => {
                if !self.endpoints.is_empty() {
                    return Err(InvalidField::at(
                        "discovery",
                        Problem::Invalid(
                            "set `endpoints` or `discovery`, not both (discovery finds the endpoints)"
                                .into(),
                        ),
                    ));
                }
                d.validate()
                    .map_err(|e| e.under(FieldPath::key("discovery")))?;
            }
            None if self.endpoints.is_empty() => {
                return Err(InvalidField::at(
                    "endpoints",
                    Problem::Invalid(
                        "at least one endpoint is required (or `discovery`, to find them)".into(),
                    ),
                ));
            }
            None => {}
        }
        let address = |j: usize| FieldPath::key("endpoints").at(j).then("address");
        for (j, e) in self.endpoints.iter().enumerate() {
            let ok = e
                .address
                .parse::<hyper::http::uri::Authority>()
                .ok()
                .filter(|a| a.port_u16().is_some() && !a.host().is_empty());
            if ok.is_none() {
                return Err(InvalidField::new(
                    address(j),
                    Problem::Invalid(format!(
                        "`{}` is not an address; expected host:port, e.g. \"127.0.0.1:9001\"",
                        e.address
                    )),
                ));
            }
        }
        if self.connect_timeout.is_zero() {
            return Err(zero("connect_timeout"));
        }
        if self.request_timeout < Duration::from_millis(1) {
            // Shared by the tries, it must leave each of them a usable slice.
            return Err(InvalidField::at(
                "request_timeout",
                Problem::out_of_range(
                    "at least 1ms",
                    humantime::format_duration(self.request_timeout),
                ),
            ));
        }
        if self.max_in_flight == 0 {
            return Err(none("max_in_flight"));
        }
        if let Some(t) = &self.tls {
            if let Err(e) = crate::tls::UpstreamTls::new(t, self.connect_timeout, self.alpn()) {
                return Err(InvalidField::new(
                    FieldPath::key("tls").then(e.key),
                    Problem::Invalid(e.message),
                ));
            }
            if t.server_name.is_none() {
                for (j, e) in self.endpoints.iter().enumerate() {
                    let host = e
                        .address
                        .parse::<hyper::http::uri::Authority>()
                        .map(|a| a.host().to_string())
                        .unwrap_or_default();
                    if let Err(m) = crate::tls::server_name(&host) {
                        return Err(InvalidField::new(
                            address(j),
                            Problem::Invalid(format!(
                                "{m}: it cannot be verified against a certificate; set `server_name` in [cluster.tls]"
                            )),
                        ));
                    }
                }
            }
        }
        match (self.protocol, self.tls.is_some()) {
            (UpstreamProtocol::H2, false) => {
                return Err(InvalidField::at(
                    "protocol",
                    Problem::Invalid(
                        "\"h2\" is HTTP/2 over TLS: add [cluster.tls] (or use \"h2c\" for HTTP/2 without TLS)".into(),
                    ),
                ))
            }
            (UpstreamProtocol::H2c, true) => {
                return Err(InvalidField::at(
                    "protocol",
                    Problem::Invalid(
                        "\"h2c\" is HTTP/2 without TLS: use \"h2\" with [cluster.tls]".into(),
                    ),
                ))
            }
            _ => {}
        }
        if let Some(h) = &self.health_check {
            if h.kind == HealthCheckKind::Grpc && self.protocol == UpstreamProtocol::Http1 {
                return Err(InvalidField::new(
                    FieldPath::key("health_check").then("kind"),
                    Problem::NotApplicable(
                        "a gRPC health check needs an HTTP/2 cluster: set protocol = \"h2c\" or \"h2\""
                            .into(),
                    ),
                ));
            }
        }
        if self.hash_on.is_some() && !self.strategy.is_hash() {
            return Err(InvalidField::at(
                "hash_on",
                Problem::NotApplicable(format!(
                    "hash_on applies to the hash strategies (ring-hash, maglev, rendezvous), not {}",
                    self.strategy
                )),
            ));
        }
        // Load reports (headers and probes) and hedging live in the HTTP/1.1 leg only: refused
        // elsewhere rather than silently balancing without them.
        if self.protocol != UpstreamProtocol::Http1 {
            if self.strategy == StrategyKind::Prequal {
                return Err(InvalidField::at(
                    "strategy",
                    Problem::NotApplicable(
                        "prequal needs load reports, which keel reads from HTTP/1.1 endpoints only: use protocol = \"http1\" or another strategy"
                            .into(),
                    ),
                ));
            }
            if self.hedge.is_some() {
                return Err(InvalidField::at(
                    "hedge",
                    Problem::NotApplicable(
                        "hedged requests are sent to HTTP/1.1 clusters only (protocol = \"http1\")"
                            .into(),
                    ),
                ));
            }
        }
        self.retry
            .validate(self.request_timeout)
            .map_err(|e| e.under(FieldPath::key("retry")))?;
        if let Some(h) = &self.hedge {
            h.validate().map_err(|e| e.under(FieldPath::key("hedge")))?;
        }
        self.probe
            .validate()
            .map_err(|e| e.under(FieldPath::key("probe")))?;
        if let Some(h) = &self.health_check {
            h.validate()
                .map_err(|e| e.under(FieldPath::key("health_check")))?;
        }
        // keel-balance's own names are this table's keys (its options are flattened here).
        self.balancer_config().validate_with(&self.endpoints)
    }
}

impl RetryConfig {
    /// Checks the retries against the cluster's `request_timeout`; paths are relative to
    /// `[cluster.retry]`.
    pub fn validate(&self, request_timeout: Duration) -> Result<(), InvalidField> {
        if self.attempts > MAX_RETRY_ATTEMPTS {
            return Err(InvalidField::at(
                "attempts",
                Problem::out_of_range(format!("within 0..={MAX_RETRY_ATTEMPTS}"), self.attempts),
            ));
        }
        if let Some(t) = self.per_try_timeout {
            if t.is_zero() || t > request_timeout {
                return Err(InvalidField::at(
                    "per_try_timeout",
                    Problem::out_of_range(
                        format!(
                            "greater than zero and at most request_timeout ({})",
                            humantime::format_duration(request_timeout)
                        ),
                        humantime::format_duration(t),
                    ),
                ));
            }
        }
        if let Some(s) = self
            .retry_on_status
            .iter()
            .find(|s| !(400..=599).contains(*s))
        {
            return Err(InvalidField::at(
                "retry_on_status",
                Problem::Invalid(format!(
                    "status {s} is not an error status; allowed: 400..=599"
                )),
            ));
        }
        if let Some((i, s)) = self
            .retry_on_grpc_status
            .iter()
            .enumerate()
            .find(|(_, s)| !(1..=MAX_GRPC_STATUS).contains(*s))
        {
            return Err(InvalidField::new(
                FieldPath::key("retry_on_grpc_status").at(i),
                Problem::out_of_range(
                    format!("a gRPC error code, within 1..={MAX_GRPC_STATUS}"),
                    s,
                ),
            ));
        }
        self.budget().validate().map_err(|mut e| {
            // keel-balance's `window` is this table's `budget_window`.
            if e.field == FieldPath::key("window") {
                e.field = FieldPath::key("budget_window");
            }
            e
        })
    }
}

/// The highest gRPC status code (16 UNAUTHENTICATED).
const MAX_GRPC_STATUS: u32 = 16;

impl HealthCheckConfig {
    /// Checks the probe settings; paths are relative to `[cluster.health_check]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.service.is_empty() && self.kind != HealthCheckKind::Grpc {
            return Err(InvalidField::at(
                "service",
                Problem::NotApplicable("`service` is for kind = \"grpc\"".into()),
            ));
        }
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.interval.is_zero() {
            return Err(zero("interval"));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        if self.unhealthy_threshold == 0 {
            return Err(none("unhealthy_threshold"));
        }
        if self.healthy_threshold == 0 {
            return Err(none("healthy_threshold"));
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
            admin: None,
            listeners,
            clusters,
            access_log: None,
            source: None,
        }
    }
}

impl ListenerConfig {
    /// A plain-TCP listener on `listen` routed to `cluster`, other options at their defaults.
    pub fn new(listen: SocketAddr, cluster: impl Into<String>) -> Self {
        ListenerConfig {
            listen,
            cluster: Some(cluster.into()),
            routes: Vec::new(),
            protocol: ListenerProtocol::default(),
            tunnel_idle_timeout: default_tunnel_idle_timeout(),
            max_connections: default_max_connections(),
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_request_body_bytes: None,
            tls: None,
            trusted_proxies: Vec::new(),
            error_detail: ErrorDetail::default(),
        }
    }
}

impl ClusterConfig {
    /// A round-robin cluster of these endpoints, other options at their defaults (one retry,
    /// no health checks, no outlier detection).
    pub fn new(name: impl Into<String>, endpoints: Vec<EndpointSpec>) -> Self {
        let options = StrategyOptions::default();
        ClusterConfig {
            name: name.into(),
            protocol: UpstreamProtocol::default(),
            proxy_protocol: None,
            strategy: default_strategy(),
            endpoints,
            discovery: None,
            tie_break: options.tie_break,
            choices: options.choices,
            decay: options.decay,
            default_rtt: options.default_rtt,
            failure_penalty: options.failure_penalty,
            vnodes: options.vnodes,
            table_size: options.table_size,
            bounded_load: options.bounded_load,
            panic_threshold: default_panic_threshold(),
            seed: None,
            outlier_detection: None,
            slow_start: None,
            hash_on: None,
            connect_timeout: default_connect_timeout(),
            request_timeout: default_request_timeout(),
            max_buffered_response: default_max_buffered_response(),
            pool_idle_timeout: default_pool_idle_timeout(),
            pool_max_idle_per_endpoint: default_pool_max_idle(),
            max_in_flight: default_max_in_flight(),
            retry: RetryConfig::default(),
            health_check: None,
            tls: None,
            hedge: None,
            probe: ProbeConfig::default(),
        }
    }

    /// Applies a keel-balance configuration's strategy, options and protections (the inverse
    /// of [`ClusterConfig::balancer_config`]).
    pub fn with_balancer(mut self, b: &BalancerConfig) -> Self {
        let o = &b.options;
        self.strategy = b.strategy;
        self.tie_break = o.tie_break;
        self.choices = o.choices;
        self.decay = o.decay;
        self.default_rtt = o.default_rtt;
        self.failure_penalty = o.failure_penalty;
        self.vnodes = o.vnodes;
        self.table_size = o.table_size;
        self.bounded_load = o.bounded_load;
        self.probe.probes_per_request = o.probes_per_pick;
        self.panic_threshold = b.panic_threshold;
        self.seed = Some(b.seed);
        self.outlier_detection.clone_from(&b.outlier_detection);
        self.slow_start.clone_from(&b.slow_start);
        self
    }
}

impl Default for HealthCheckConfig {
    /// `GET /healthz` every 5 s, 1 s to answer, 2 to fail and 2 to pass.
    fn default() -> Self {
        HealthCheckConfig {
            kind: HealthCheckKind::default(),
            service: String::new(),
            path: default_hc_path(),
            interval: default_hc_interval(),
            timeout: default_hc_timeout(),
            unhealthy_threshold: default_threshold(),
            healthy_threshold: default_threshold(),
        }
    }
}

/// A key path and the span of its key and value (or table header) in the text.
struct Located {
    path: String,
    span: Range<usize>,
}

fn push_key(path: &[String], key: &str) -> Vec<String> {
    let mut p = path.to_vec();
    p.push(key.to_string());
    p
}

fn path_string(path: &[String]) -> String {
    let mut s = String::new();
    for p in path {
        if p.starts_with('[') {
            s.push_str(p);
        } else {
            if !s.is_empty() {
                s.push('.');
            }
            s.push_str(p);
        }
    }
    s
}

fn collect_item(item: &toml_edit::Item, path: &mut Vec<String>, out: &mut Vec<Located>) {
    match item {
        toml_edit::Item::Table(t) => collect_table(t, path, out),
        toml_edit::Item::ArrayOfTables(a) => {
            for (i, t) in a.iter().enumerate() {
                path.push(format!("[{i}]"));
                if let Some(span) = t.span() {
                    out.push(Located {
                        path: path_string(path),
                        span,
                    });
                }
                collect_table(t, path, out);
                path.pop();
            }
        }
        toml_edit::Item::Value(v) => collect_value(v, path, out),
        toml_edit::Item::None => {}
    }
}

fn collect_table(t: &toml_edit::Table, path: &[String], out: &mut Vec<Located>) {
    for (k, item) in t.iter() {
        let Some((key, _)) = t.get_key_value(k) else {
            continue;
        };
        let sub = push_key(path, k);
        let start = key.span().map(|s| s.start).or(item.span().map(|s| s.start));
        let end = item.span().map(|s| s.end).or(key.span().map(|s| s.end));
        if let (Some(start), Some(end)) = (start, end) {
            out.push(Located {
                path: path_string(&sub),
                span: start..end.max(start),
            });
        } else if let toml_edit::Item::Table(sub_t) = item {
            if let Some(span) = sub_t.span() {
                out.push(Located {
                    path: path_string(&sub),
                    span,
                });
            }
        }
        let mut sub = sub;
        collect_item(item, &mut sub, out);
    }
}

fn collect_value(v: &toml_edit::Value, path: &mut Vec<String>, out: &mut Vec<Located>) {
    match v {
        toml_edit::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                path.push(format!("[{i}]"));
                if let Some(span) = v.span() {
                    out.push(Located {
                        path: path_string(path),
                        span,
                    });
                }
                collect_value(v, path, out);
                path.pop();
            }
        }
        toml_edit::Value::InlineTable(t) => {
            for (k, _) in t.iter() {
                let Some((key, item)) = t.get_key_value(k) else {
                    continue;
                };
                let mut sub = push_key(path, k);
                let start = key.span().map(|s| s.start).or(item.span().map(|s| s.start));
                let end = item.span().map(|s| s.end);
                if let (Some(start), Some(end)) = (start, end) {
                    out.push(Located {
                        path: path_string(&sub),
                        span: start..end.max(start),
                    });
                }
                collect_item(item, &mut sub, out);
            }
        }
        _ => {}
    }
}

/// The key path whose text contains `offset`: the narrowest span that contains it, or else the
/// nearest one before it.
fn key_at(index: &[Located], offset: usize) -> Option<String> {
    index
        .iter()
        .filter(|l| l.span.start <= offset && offset < l.span.end.max(l.span.start + 1))
        .min_by_key(|l| l.span.end - l.span.start)
        .or_else(|| {
            index
                .iter()
                .filter(|l| l.span.start <= offset)
                .max_by_key(|l| l.span.start)
        })
        .map(|l| l.path.clone())
}

/// The span of a key path, or of its longest prefix present in the text (a key left to its
/// default is reported at its table).
fn span_of(index: &[Located], path: &FieldPath) -> (Option<Range<usize>>, String) {
    let strings: Vec<String> = path
        .segments()
        .iter()
        .map(|s| match s {
            PathSegment::Key(k) => k.to_string(),
            PathSegment::Index(i) => format!("[{i}]"),
        })
        .collect();
    let full = path_string(&strings);
    for n in (1..=strings.len()).rev() {
        let p = path_string(&strings[..n]);
        if let Some(l) = index.iter().find(|l| l.path == p) {
            return (Some(l.span.clone()), full);
        }
    }
    (None, full)
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(offset, |p| offset - p - 1) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration file of issue 4, verbatim.
    pub(crate) const ISSUE_CONFIG: &str = include_str!("../../../../examples/proxy.toml");

    #[test]
    fn the_issue_file_loads_with_its_values() {
        let c = ProxyConfig::from_toml_str(ISSUE_CONFIG, "proxy.toml").unwrap();
        assert_eq!(c.admin.as_ref().unwrap().listen.port(), 9901);
        assert_eq!(c.listeners.len(), 1);
        let app = c.cluster("app").unwrap();
        assert_eq!(app.strategy, StrategyKind::LeastConnections);
        assert_eq!(app.endpoints.len(), 5);
        assert_eq!(app.endpoints[0].weight, 2);
        assert_eq!(app.endpoints[1].weight, 1);
        assert_eq!(app.connect_timeout, Duration::from_millis(200));
        assert_eq!(app.request_timeout, Duration::from_secs(1));
        assert_eq!(app.retry.attempts, 2);
        assert_eq!(app.retry.budget_percent, 20.0);
        assert_eq!(app.per_try_timeout(), Duration::from_secs(1) / 3);
        let hc = app.health_check.as_ref().unwrap();
        assert_eq!(hc.interval, Duration::from_millis(500));
        assert_eq!(hc.unhealthy_threshold, 2);
        let od = app.outlier_detection.as_ref().unwrap();
        assert_eq!(od.consecutive_failures, 3);
        assert_eq!(od.max_ejection_percent, 50.0);
        assert_eq!(od.max_ejected(5), 2);
    }

    fn err(text: &str) -> ConfigError {
        ProxyConfig::from_toml_str(text, "bad.toml").unwrap_err()
    }

    const HEAD: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";

    #[test]
    fn unknown_key_names_file_line_key_and_allowed_keys() {
        let e = err(&format!(
            "{HEAD}[cluster.retry]\nattempts = 2\nbudget = 20\n"
        ));
        assert_eq!(e.line, Some(10), "{e}");
        assert_eq!(e.key.as_deref(), Some("cluster[0].retry.budget"), "{e}");
        let s = e.to_string();
        assert!(s.starts_with("bad.toml:10:1:"), "{s}");
        assert!(s.contains("budget_percent"), "lists allowed keys: {s}");
    }

    #[test]
    fn unknown_strategy_lists_the_strategies() {
        let e = err(&HEAD.replace(
            "name = \"app\"\n",
            "name = \"app\"\nstrategy = \"fastest\"\n",
        ));
        assert_eq!(e.line, Some(7), "{e}");
        assert_eq!(e.key.as_deref(), Some("cluster[0].strategy"), "{e}");
        assert!(
            e.message.contains("maglev") && e.message.contains("fastest"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_and_bad_duration_are_located() {
        let e = err(&format!("{HEAD}connect_timeout = \"fast\"\n"));
        assert_eq!(e.line, Some(8), "{e}");
        assert_eq!(e.key.as_deref(), Some("cluster[0].connect_timeout"), "{e}");
        let e = err(&format!("{HEAD}[cluster.retry]\nattempts = \"two\"\n"));
        assert_eq!(e.line, Some(9), "{e}");
        assert_eq!(e.key.as_deref(), Some("cluster[0].retry.attempts"), "{e}");
    }

    #[test]
    fn a_listener_on_the_admin_address_is_refused_at_check() {
        let text = "[admin]\nlisten = \"127.0.0.1:9901\"\n\n[[listener]]\nlisten = \"0.0.0.0:9901\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
        let e = err(text);
        assert_eq!(e.key.as_deref(), Some("listener[0].listen"), "{e}");
        assert_eq!(e.line, Some(5), "{e}");
        assert!(e.message.contains("admin"), "{e}");
        // Another port is fine.
        ProxyConfig::from_toml_str(&text.replace("0.0.0.0:9901", "0.0.0.0:9902"), "ok.toml")
            .unwrap();
    }

    #[test]
    fn trusted_proxies_are_cidr_blocks() {
        let c = ProxyConfig::from_toml_str(
            &HEAD.replace(
                "cluster = \"app\"\n",
                "cluster = \"app\"\ntrusted_proxies = [\"10.0.0.0/8\", \"::1/128\"]\nerror_detail = \"full\"\n",
            ),
            "ok.toml",
        )
        .unwrap();
        let l = &c.listeners[0];
        assert!(l.trusts("10.1.2.3".parse().unwrap()));
        assert!(l.trusts("::1".parse().unwrap()));
        assert!(!l.trusts("192.168.0.1".parse().unwrap()));
        assert_eq!(l.error_detail, ErrorDetail::Full);
        let e = err(&HEAD.replace(
            "cluster = \"app\"\n",
            "cluster = \"app\"\ntrusted_proxies = [\"10.0.0.0/33\"]\n",
        ));
        assert_eq!(
            e.key.as_deref(),
            Some("listener[0].trusted_proxies[0]"),
            "{e}"
        );
    }

    #[test]
    fn semantic_errors_are_located() {
        let e = err(&HEAD.replace("cluster = \"app\"", "cluster = \"web\""));
        assert_eq!(e.line, Some(3), "{e}");
        assert!(
            e.message.contains("web") && e.message.contains("app"),
            "{e}"
        );
        let e = err(&format!("{HEAD}[cluster.retry]\nattempts = 50\n"));
        assert_eq!(e.line, Some(9), "{e}");
        assert!(e.message.contains("0..=10"), "{e}");
        let e = err(&format!(
            "{HEAD}[cluster.outlier_detection]\nmax_ejection_percent = 150\n"
        ));
        assert_eq!(e.line, Some(9), "{e}");
        assert_eq!(
            e.key.as_deref(),
            Some("cluster[0].outlier_detection.max_ejection_percent")
        );
        let e = err(&format!("{HEAD}hash_on = \"header:x-user\"\n"));
        assert!(e.message.contains("hash strategies"), "{e}");
        let e = err(&HEAD.replace("9001\" }", "9001\" }, { address = \"127.0.0.1:9001\" }"));
        assert_eq!(e.line, Some(7), "{e}");
        assert!(e.message.contains("twice"), "{e}");
        let e = err(&HEAD.replace("127.0.0.1:9001", "localhost"));
        assert_eq!(
            e.key.as_deref(),
            Some("cluster[0].endpoints[0].address"),
            "{e}"
        );
        let e = err("[[cluster]]\nname = \"a\"\nendpoints = []\n");
        assert!(e.message.contains("listener"), "{e}");
        let e = err("[admin\n");
        assert_eq!(e.line, Some(1), "{e}");
    }

    /// Every error keel-balance can find in a cluster's options, at the exact key and its line.
    #[test]
    fn every_balancer_option_error_is_at_its_key_and_line() {
        // (extra lines after HEAD, the key the error must name, the 1-based line of that key)
        let cases: &[(&str, &str, usize)] = &[
            ("choices = 1\n", "cluster[0].choices", 8),
            ("decay = \"0s\"\n", "cluster[0].decay", 8),
            ("strategy = \"ring-hash\"\nvnodes = 0\n", "cluster[0].vnodes", 9),
            ("strategy = \"maglev\"\ntable_size = 65536\n", "cluster[0].table_size", 9),
            ("bounded_load = 1.25\n", "cluster[0].bounded_load", 8),
            ("strategy = \"maglev\"\nbounded_load = 0.5\n", "cluster[0].bounded_load", 9),
            ("panic_threshold = 101\n", "cluster[0].panic_threshold", 8),
            (
                "[cluster.outlier_detection]\nmax_ejection_percent = 101\n",
                "cluster[0].outlier_detection.max_ejection_percent",
                9,
            ),
            (
                "[cluster.outlier_detection]\ninterval = \"0s\"\n",
                "cluster[0].outlier_detection.interval",
                9,
            ),
            (
                "[cluster.outlier_detection]\nbase_ejection_time = \"0s\"\n",
                "cluster[0].outlier_detection.base_ejection_time",
                9,
            ),
            (
                "[cluster.outlier_detection]\nbase_ejection_time = \"10s\"\nmax_ejection_time = \"9s\"\n",
                "cluster[0].outlier_detection.max_ejection_time",
                10,
            ),
            (
                "[cluster.outlier_detection]\nconsecutive_failures = 3\n\n[cluster.outlier_detection.failure_rate]\nminimum_requests = 10\nthreshold_percent = 100.5\n",
                "cluster[0].outlier_detection.failure_rate.threshold_percent",
                13,
            ),
            (
                "[cluster.slow_start]\nwindow = \"0s\"\n",
                "cluster[0].slow_start.window",
                9,
            ),
            (
                "[cluster.slow_start]\naggression = 0\n",
                "cluster[0].slow_start.aggression",
                9,
            ),
            (
                "[cluster.slow_start]\nmin_weight_percent = 100.5\n",
                "cluster[0].slow_start.min_weight_percent",
                9,
            ),
            (
                "[cluster.retry]\nbudget_percent = -1\n",
                "cluster[0].retry.budget_percent",
                9,
            ),
            (
                "[cluster.retry]\nmin_retries_per_second = -1\n",
                "cluster[0].retry.min_retries_per_second",
                9,
            ),
            (
                "[cluster.retry]\nbudget_window = \"5ms\"\n",
                "cluster[0].retry.budget_window",
                9,
            ),
            (
                "[cluster.hedge]\ndelay = \"p95\"\nmax = 2\n",
                "cluster[0].hedge.max",
                10,
            ),
            (
                "[cluster.hedge]\ndelay = \"p95\"\nbudget_percent = 100.5\n",
                "cluster[0].hedge.budget_percent",
                10,
            ),
            (
                "[cluster.hedge]\ndelay = \"0s\"\n",
                "cluster[0].hedge.delay",
                9,
            ),
            (
                "[cluster.hedge]\ndelay = \"p100\"\n",
                "cluster[0].hedge.delay",
                9,
            ),
        ];
        for (extra, key, line) in cases {
            let e = err(&format!("{HEAD}{extra}"));
            assert_eq!(e.key.as_deref(), Some(*key), "{extra}: {e}");
            assert_eq!(e.line, Some(*line), "{extra}: {e}");
        }
        // The endpoint rules: the endpoint's own key, on its own line.
        let eps = "endpoints = [\n  { address = \"127.0.0.1:9001\" },\n  { address = \"127.0.0.1:9002\", weight = 0 },\n  { address = \"127.0.0.1:9001\" },\n]\n";
        let one = "endpoints = [{ address = \"127.0.0.1:9001\" }]\n";
        let e = err(&HEAD.replace(one, &eps.replace(", weight = 0", "")));
        assert_eq!(
            e.key.as_deref(),
            Some("cluster[0].endpoints[2].address"),
            "{e}"
        );
        assert_eq!(e.line, Some(10), "{e}");
        assert!(e.message.contains("twice"), "{e}");
        let e = err(&HEAD.replace(one, eps));
        assert_eq!(
            e.key.as_deref(),
            Some("cluster[0].endpoints[1].weight"),
            "{e}"
        );
        assert_eq!(e.line, Some(9), "{e}");
        let e = err(&HEAD.replace(
            one,
            &format!(
                "strategy = \"maglev\"\ntable_size = 2\n{}",
                eps.replace(", weight = 0", "")
                    .replace("9001\" },\n]", "9003\" },\n]")
            ),
        ));
        assert_eq!(e.key.as_deref(), Some("cluster[0].table_size"), "{e}");
        assert_eq!(e.line, Some(8), "{e}");
    }

    /// A configuration built in code gets the defaults a TOML file gets.
    #[test]
    fn built_in_code_equals_parsed() {
        let parsed =
            ProxyConfig::from_toml_str(&format!("{HEAD}[cluster.health_check]\n"), "t.toml")
                .unwrap();
        let mut cluster = ClusterConfig::new("app", vec![EndpointSpec::new("127.0.0.1:9001")]);
        cluster.health_check = Some(HealthCheckConfig::default());
        let built = ProxyConfig::new(
            vec![ListenerConfig::new("127.0.0.1:0".parse().unwrap(), "app")],
            vec![cluster],
        );
        assert_eq!(built, parsed);
        assert_eq!(built.validate(), Ok(()));
        // with_balancer is balancer_config's inverse.
        let mut b = BalancerConfig::new(StrategyKind::PeakEwma);
        b.options.choices = 3;
        b.outlier_detection = Some(OutlierConfig::default());
        b.seed = 42;
        let c = ClusterConfig::new("x", vec![]).with_balancer(&b);
        assert_eq!(c.balancer_config(), b);
    }

    #[test]
    fn every_strategy_and_its_options_load() {
        for s in StrategyKind::ALL {
            let extra = if s.is_hash() {
                "hash_on = \"header:x-user\"\nbounded_load = 1.25\n"
            } else {
                "choices = 3\ndecay = \"5s\"\n"
            };
            let text = HEAD.replace(
                "name = \"app\"\n",
                &format!("name = \"app\"\nstrategy = \"{s}\"\n{extra}"),
            );
            let c = ProxyConfig::from_toml_str(&text, "s.toml").unwrap();
            let bc = c.clusters[0].balancer_config();
            assert_eq!(bc.strategy, s);
        }
        let c = ProxyConfig::from_toml_str(
            &format!("{HEAD}panic_threshold = 0\n[cluster.slow_start]\nwindow = \"2s\"\n"),
            "s.toml",
        )
        .unwrap();
        let bc = c.clusters[0].balancer_config();
        assert_eq!(bc.panic_threshold, 0.0);
        assert_eq!(bc.slow_start.unwrap().window, Duration::from_secs(2));
    }

    /// The keys serde accepts in each table, read back from its "unknown field" error.
    fn allowed_keys(text: &str) -> Vec<String> {
        let e = err(text);
        let list = e
            .message
            .split("expected one of ")
            .nth(1)
            .or_else(|| e.message.split("expected ").nth(1))
            .unwrap_or_else(|| panic!("no key list in: {e}"));
        list.split(", ")
            .flat_map(|k| k.split(" or "))
            .map(|k| k.trim().trim_matches('`').to_string())
            .collect()
    }

    #[test]
    fn every_option_is_documented() {
        let docs = include_str!("../../../../docs/configuration.md");
        let tables = [
            format!("nonsense = 1\n{HEAD}"),
            format!("[admin]\nnonsense = 1\n{HEAD}"),
            HEAD.replace("cluster = \"app\"", "cluster = \"app\"\nnonsense = 1"),
            format!("{HEAD}nonsense = 1\n"),
            format!("{HEAD}[cluster.retry]\nnonsense = 1\n"),
            format!("{HEAD}[cluster.health_check]\nnonsense = 1\n"),
            format!("{HEAD}[cluster.outlier_detection]\nnonsense = 1\n"),
            format!("{HEAD}[cluster.outlier_detection.failure_rate]\nnonsense = 1\n"),
            format!("{HEAD}[cluster.slow_start]\nnonsense = 1\n"),
            HEAD.replace("9001\" }", "9001\", nonsense = 1 }"),
            HEAD.replace(
                "cluster = \"app\"",
                "cluster = \"app\"\n[listener.tls]\nnonsense = 1",
            ),
            format!("{HEAD}[cluster.tls]\nnonsense = 1\n"),
            format!("{HEAD}[cluster.hedge]\ndelay = \"p95\"\nnonsense = 1\n"),
            format!("[access_log]\npath = \"a.log\"\nnonsense = 1\n{HEAD}"),
            HEAD.replace(
                "endpoints = [{ address = \"127.0.0.1:9001\" }]",
                "discovery = { dns = \"a.test\", port = 80, nonsense = 1 }",
            ),
            HEAD.replace(
                "cluster = \"app\"\n\n[[cluster]]",
                "cluster = \"app\"\n\n[[listener.route]]\ncluster = \"app\"\nnonsense = 1\n\n[[cluster]]",
            ),
        ];
        let mut checked = 0;
        for t in &tables {
            for key in allowed_keys(t) {
                let documented = [
                    format!("`{key}`"),
                    format!("[{key}]"),
                    format!("[cluster.{key}]"),
                ]
                .iter()
                .any(|form| docs.contains(form.as_str()));
                assert!(
                    documented,
                    "option `{key}` is not documented in docs/configuration.md"
                );
                checked += 1;
            }
        }
        assert!(checked > 40, "{checked} options checked");
    }

    #[test]
    fn protocols_load_as_written_and_mismatches_are_refused() {
        // The TCP listener of issue 16, verbatim.
        let tcp = "[[listener]]\nlisten = \"127.0.0.1:7000\"\nprotocol = \"tcp\"       # default \"http\"\ncluster = \"db\"\n\n[[cluster]]\nname = \"db\"\nendpoints = [{ address = \"127.0.0.1:5432\" }]\nproxy_protocol = \"v2\"\n[cluster.health_check]\nkind = \"tcp\"\n";
        let c = ProxyConfig::from_toml_str(tcp, "tcp.toml").unwrap();
        assert_eq!(c.listeners[0].protocol, ListenerProtocol::Tcp);
        assert_eq!(
            c.listeners[0].tunnel_idle_timeout,
            Duration::from_secs(3600)
        );
        assert_eq!(c.clusters[0].proxy_protocol, Some(ProxyProtocol::V2));
        assert_eq!(c.clusters[0].protocol, UpstreamProtocol::Http1);
        let grpc = format!(
            "{HEAD}protocol = \"h2c\"\n[cluster.retry]\nretry_on_grpc_status = [8]\n[cluster.health_check]\nkind = \"grpc\"\n"
        );
        let c = ProxyConfig::from_toml_str(&grpc, "grpc.toml").unwrap();
        assert_eq!(c.clusters[0].protocol, UpstreamProtocol::H2c);
        assert_eq!(c.clusters[0].retry.retry_on_grpc_status, vec![8]);
        let e = err(&format!("{HEAD}protocol = \"h2\"\n"));
        assert_eq!(e.key.as_deref(), Some("cluster[0].protocol"), "{e}");
        assert!(e.message.contains("[cluster.tls]"), "{e}");
        let e = err(&format!("{HEAD}[cluster.health_check]\nkind = \"grpc\"\n"));
        assert_eq!(
            e.key.as_deref(),
            Some("cluster[0].health_check.kind"),
            "{e}"
        );
        let e = err(&format!("{HEAD}protocol = \"http3\"\n"));
        assert!(e.message.contains("h2c"), "{e}");
    }

    /// Every error of the protocol keys, at the exact key and its line.
    #[test]
    fn every_protocol_option_error_is_at_its_key_and_line() {
        let tcp = HEAD.replace(
            "cluster = \"app\"\n",
            "cluster = \"app\"\nprotocol = \"tcp\"\n",
        );
        let cases: Vec<(String, &str, usize)> = vec![
            (
                HEAD.replace(
                    "cluster = \"app\"\n",
                    "cluster = \"app\"\ntunnel_idle_timeout = \"0s\"\n",
                ),
                "listener[0].tunnel_idle_timeout",
                4,
            ),
            (
                HEAD.replace("cluster = \"app\"\n", "protocol = \"tcp\"\n"),
                "listener[0].cluster",
                1,
            ),
            (
                tcp.replace("name = \"app\"\n", "name = \"app\"\nprotocol = \"h2c\"\n"),
                "listener[0].cluster",
                3,
            ),
            (
                format!("{HEAD}proxy_protocol = \"v2\"\n"),
                "cluster[0].proxy_protocol",
                8,
            ),
            (
                format!("{HEAD}proxy_protocol = \"v3\"\n"),
                "cluster[0].proxy_protocol",
                8,
            ),
            (
                format!("{HEAD}protocol = \"h2\"\n"),
                "cluster[0].protocol",
                8,
            ),
            (
                format!(
                    "{HEAD}protocol = \"h2c\"\n[cluster.retry]\nretry_on_grpc_status = [8, 0]\n"
                ),
                "cluster[0].retry.retry_on_grpc_status[1]",
                10,
            ),
            (
                format!("{HEAD}[cluster.retry]\nretry_on_grpc_status = [17]\n"),
                "cluster[0].retry.retry_on_grpc_status[0]",
                9,
            ),
            (
                format!("{HEAD}[cluster.health_check]\nkind = \"udp\"\n"),
                "cluster[0].health_check.kind",
                9,
            ),
            (
                format!("{HEAD}[cluster.health_check]\nkind = \"tcp\"\nservice = \"x\"\n"),
                "cluster[0].health_check.service",
                10,
            ),
            (
                format!("{HEAD}protocol = \"h2c\"\nstrategy = \"prequal\"\n"),
                "cluster[0].strategy",
                9,
            ),
            (
                format!("{HEAD}protocol = \"h2c\"\n[cluster.hedge]\ndelay = \"p95\"\n"),
                "cluster[0].hedge",
                9,
            ),
        ];
        for (text, key, line) in &cases {
            let e = err(text);
            assert_eq!(e.key.as_deref(), Some(*key), "{text}: {e}");
            assert_eq!(e.line, Some(*line), "{text}: {e}");
        }
        // A TCP listener on a plain cluster with the PROXY header loads.
        ProxyConfig::from_toml_str(&format!("{tcp}proxy_protocol = \"v1\"\n"), "ok.toml").unwrap();
    }

    #[test]
    fn hash_on_parses() {
        assert_eq!("path".parse::<HashOn>().unwrap(), HashOn::Path);
        assert_eq!("client-ip".parse::<HashOn>().unwrap(), HashOn::ClientIp);
        assert_eq!(
            "header:X-User".parse::<HashOn>().unwrap().to_string(),
            "header:x-user"
        );
        assert!("cookie"
            .parse::<HashOn>()
            .unwrap_err()
            .contains("client-ip"));
    }
}
