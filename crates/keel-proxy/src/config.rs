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
    Balancer, BalancerConfig, EndpointSpec, OutlierConfig, SlowStartConfig, StrategyKind,
    StrategyOptions, TieBreak,
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

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

/// `[[listener]]`: one address that clients connect to, routed to one cluster.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to listen on (port 0 = an ephemeral port).
    pub listen: SocketAddr,
    /// Name of the cluster that serves this listener's requests.
    pub cluster: String,
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

/// `[cluster.tls]`: the cluster's endpoints are reached over TLS (HTTP/1.1). Relative paths
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
    /// True if everything but the routed cluster is the same (what a reload may not change,
    /// TLS certificate paths included).
    pub fn same_socket_settings(&self, other: &ListenerConfig) -> bool {
        let mut a = self.clone();
        a.cluster.clone_from(&other.cluster);
        a == *other
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
    /// The endpoints: `{ address = "host:port", weight = 1 }`.
    pub endpoints: Vec<EndpointSpec>,

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

/// `[cluster.health_check]`: periodic `GET path` to every endpoint; a 2xx answer within the
/// timeout passes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
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
        };
        b.outlier_detection = self.outlier_detection.clone();
        b.panic_threshold = self.panic_threshold;
        b.slow_start = self.slow_start.clone();
        if let Some(seed) = self.seed {
            b.seed = seed;
        }
        b
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
    /// Relative TLS file paths are taken from the current directory.
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
        if let Err((path, message)) = config.validate() {
            let (span, key) = span_of(&index, &path);
            return Err(locate(span, Some(key), message));
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
    }

    /// The cluster of this name.
    pub fn cluster(&self, name: &str) -> Option<&ClusterConfig> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// Checks everything serde cannot: references, ranges, and that each balancer builds.
    /// The error names the key path (as segments) and the problem.
    fn validate(&self) -> Result<(), (Vec<Seg>, String)> {
        use Seg::{I, K};
        if self.listeners.is_empty() {
            return Err((
                vec![],
                "at least one [[listener]] is required (listen = \"127.0.0.1:8080\", cluster = \"NAME\")"
                    .into(),
            ));
        }
        if self.clusters.is_empty() {
            return Err((vec![], "at least one [[cluster]] is required".into()));
        }
        if let Some(a) = &self.admin {
            match &a.token {
                None if !a.listen.ip().is_loopback() => {
                    return Err((
                        vec![K("admin"), K("token")],
                        format!(
                            "the admin listener {} is not on loopback: set `token` in [admin] (every admin request must then carry `Authorization: Bearer TOKEN`), or listen on 127.0.0.1",
                            a.listen
                        ),
                    ));
                }
                Some(t)
                    if t.len() < 16 || t.chars().any(|c| c.is_whitespace() || c.is_control()) =>
                {
                    return Err((
                        vec![K("admin"), K("token")],
                        "must be at least 16 characters, without spaces or control characters"
                            .into(),
                    ));
                }
                _ => {}
            }
        }
        let names: Vec<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
        for (i, l) in self.listeners.iter().enumerate() {
            let at = |key: &'static str| vec![K("listener"), I(i), K(key)];
            if l.max_connections == 0 {
                return Err((at("max_connections"), "must be at least 1".into()));
            }
            if l.max_header_bytes < MIN_HEADER_BYTES || l.max_header_bytes > u32::MAX as usize {
                return Err((
                    at("max_header_bytes"),
                    format!(
                        "must be within {MIN_HEADER_BYTES}..={}, got {}",
                        u32::MAX,
                        l.max_header_bytes
                    ),
                ));
            }
            if l.max_headers == 0 {
                return Err((at("max_headers"), "must be at least 1".into()));
            }
            if l.header_read_timeout.is_zero() {
                return Err((
                    at("header_read_timeout"),
                    "must be greater than zero".into(),
                ));
            }
            if l.idle_timeout.is_zero() {
                return Err((at("idle_timeout"), "must be greater than zero".into()));
            }
            if !names.contains(&l.cluster.as_str()) {
                return Err((
                    vec![K("listener"), I(i), K("cluster")],
                    format!(
                        "no cluster named `{}`; defined: {}",
                        l.cluster,
                        names.join(", ")
                    ),
                ));
            }
            if let Some(o) = self.listeners[..i]
                .iter()
                .find(|o| same_port(o.listen, l.listen))
            {
                return Err((
                    vec![K("listener"), I(i), K("listen")],
                    format!(
                        "{} is already used by another listener ({})",
                        l.listen, o.listen
                    ),
                ));
            }
            if let Some(a) = self
                .admin
                .as_ref()
                .filter(|a| same_port(a.listen, l.listen))
            {
                return Err((
                    vec![K("listener"), I(i), K("listen")],
                    format!(
                        "{} is the admin listener's address ({}); give one of them another port",
                        l.listen, a.listen
                    ),
                ));
            }
            if let Some(t) = &l.tls {
                // Loads the files now, so that `--check` and a reload catch a bad certificate.
                if let Err(e) = crate::tls::server_config(t) {
                    return Err((vec![K("listener"), I(i), K("tls"), K(e.key)], e.message));
                }
            }
        }
        for (i, c) in self.clusters.iter().enumerate() {
            let at = |key: &'static str| vec![K("cluster"), I(i), K(key)];
            if c.name.is_empty() {
                return Err((at("name"), "a cluster name cannot be empty".into()));
            }
            if names[..i].contains(&c.name.as_str()) {
                return Err((at("name"), format!("cluster `{}` is defined twice", c.name)));
            }
            if c.endpoints.is_empty() {
                return Err((at("endpoints"), "at least one endpoint is required".into()));
            }
            for (j, e) in c.endpoints.iter().enumerate() {
                let ok = e
                    .address
                    .parse::<hyper::http::uri::Authority>()
                    .ok()
                    .filter(|a| a.port_u16().is_some() && !a.host().is_empty());
                if ok.is_none() {
                    return Err((
                        vec![K("cluster"), I(i), K("endpoints"), I(j), K("address")],
                        format!(
                            "`{}` is not an address; expected host:port, e.g. \"127.0.0.1:9001\"",
                            e.address
                        ),
                    ));
                }
            }
            if c.connect_timeout.is_zero() {
                return Err((at("connect_timeout"), "must be greater than zero".into()));
            }
            if c.request_timeout < Duration::from_millis(1) {
                // Shared by the tries, it must leave each of them a usable slice.
                return Err((at("request_timeout"), "must be at least 1ms".into()));
            }
            if c.max_in_flight == 0 {
                return Err((at("max_in_flight"), "must be at least 1".into()));
            }
            if let Some(t) = &c.tls {
                let tls = |key: &'static str| vec![K("cluster"), I(i), K("tls"), K(key)];
                if let Err(e) = crate::tls::UpstreamTls::new(t, c.connect_timeout) {
                    return Err((tls(e.key), e.message));
                }
                if t.server_name.is_none() {
                    for (j, e) in c.endpoints.iter().enumerate() {
                        let host = e
                            .address
                            .parse::<hyper::http::uri::Authority>()
                            .map(|a| a.host().to_string())
                            .unwrap_or_default();
                        if let Err(m) = crate::tls::server_name(&host) {
                            return Err((
                                vec![K("cluster"), I(i), K("endpoints"), I(j), K("address")],
                                format!("{m}: it cannot be verified against a certificate; set `server_name` in [cluster.tls]"),
                            ));
                        }
                    }
                }
            }
            if c.hash_on.is_some() && !c.strategy.is_hash() {
                return Err((
                    at("hash_on"),
                    format!(
                        "hash_on applies to the hash strategies (ring-hash, maglev, rendezvous), not {}",
                        c.strategy
                    ),
                ));
            }
            let r = &c.retry;
            let retry = |key: &'static str| vec![K("cluster"), I(i), K("retry"), K(key)];
            if r.attempts > MAX_RETRY_ATTEMPTS {
                return Err((
                    retry("attempts"),
                    format!(
                        "must be within 0..={MAX_RETRY_ATTEMPTS}, got {}",
                        r.attempts
                    ),
                ));
            }
            if let Some(t) = r.per_try_timeout {
                if t.is_zero() || t > c.request_timeout {
                    return Err((
                        retry("per_try_timeout"),
                        format!(
                            "must be greater than zero and at most request_timeout ({})",
                            humantime::format_duration(c.request_timeout)
                        ),
                    ));
                }
            }
            if let Some(s) = r.retry_on_status.iter().find(|s| !(400..=599).contains(*s)) {
                return Err((
                    retry("retry_on_status"),
                    format!("status {s} is not an error status; allowed: 400..=599"),
                ));
            }
            if let Err(m) = r.budget().validate() {
                let key = if m.starts_with("budget_percent") {
                    "budget_percent"
                } else if m.starts_with("min_retries") {
                    "min_retries_per_second"
                } else {
                    "budget_window"
                };
                return Err((retry(key), m));
            }
            if let Some(e) = c.hedge.as_ref().and_then(|h| h.validate().err()) {
                return Err((vec![K("cluster"), I(i), K("hedge"), K(e.field)], e.problem));
            }
            if let Some(h) = &c.health_check {
                let hc = |key: &'static str| vec![K("cluster"), I(i), K("health_check"), K(key)];
                if !h.path.starts_with('/')
                    || h.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
                {
                    return Err((
                        hc("path"),
                        format!("`{}` is not a path; it must start with `/`", h.path),
                    ));
                }
                if h.interval.is_zero() {
                    return Err((hc("interval"), "must be greater than zero".into()));
                }
                if h.timeout.is_zero() {
                    return Err((hc("timeout"), "must be greater than zero".into()));
                }
                if h.unhealthy_threshold == 0 {
                    return Err((hc("unhealthy_threshold"), "must be at least 1".into()));
                }
                if h.healthy_threshold == 0 {
                    return Err((hc("healthy_threshold"), "must be at least 1".into()));
                }
            }
            if let Some(od) = &c.outlier_detection {
                if let Err(m) = od.validate() {
                    let key = first_word(&m);
                    let mut path = at("outlier_detection");
                    path.push(K(leak_known(key)));
                    return Err((path, m));
                }
            }
            if let Some(ss) = &c.slow_start {
                if let Err(m) = ss.validate() {
                    let key = first_word(&m);
                    let key = key.strip_prefix("slow_start.").unwrap_or(key);
                    let mut path = at("slow_start");
                    path.push(K(leak_known(key)));
                    return Err((path, m));
                }
            }
            let bc = c.balancer_config();
            if let Err(m) = bc.validate() {
                return Err((at(leak_known(first_word(&m))), m));
            }
            if let Err(e) = Balancer::new(bc, &c.endpoints) {
                return Err((at("endpoints"), e.to_string()));
            }
        }
        Ok(())
    }
}

fn first_word(m: &str) -> &str {
    m.split_whitespace().next().unwrap_or("")
}

/// Maps an option name found in a keel-balance message to a static key (unknown: empty, which
/// points at the enclosing table).
fn leak_known(key: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "choices",
        "decay",
        "vnodes",
        "table_size",
        "bounded_load",
        "panic_threshold",
        "max_ejection_percent",
        "interval",
        "base_ejection_time",
        "max_ejection_time",
        "failure_rate",
        "window",
        "aggression",
        "min_weight_percent",
    ];
    let key = key.split('.').next().unwrap_or(key);
    KNOWN.iter().find(|k| **k == key).copied().unwrap_or("")
}

/// One step of a key path.
#[derive(Debug, Clone, PartialEq)]
enum Seg {
    K(&'static str),
    I(usize),
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
fn span_of(index: &[Located], path: &[Seg]) -> (Option<Range<usize>>, String) {
    let strings: Vec<String> = path
        .iter()
        .map(|s| match s {
            Seg::K(k) => k.to_string(),
            Seg::I(i) => format!("[{i}]"),
        })
        .filter(|s| !s.is_empty())
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
    pub(crate) const ISSUE_CONFIG: &str = include_str!("../../../examples/proxy.toml");

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
        let docs = include_str!("../../../docs/configuration.md");
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
