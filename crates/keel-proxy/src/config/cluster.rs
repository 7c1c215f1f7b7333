//! `[[cluster]]` and its tables: `[cluster.retry]`, `[cluster.health_check]`, `[cluster.probe]`,
//! `[cluster.tls]`, `[cluster.hedge]` (keel-balance's `HedgeConfig`) and
//! `[cluster.engine_signals]`, with the balancer's
//! options, timeouts and protections side by side in the cluster's table (grouped in the type).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use keel_balance::prefix::MAX_BLOCK_TOKENS;
use keel_balance::{
    BalancerConfig, EndpointSpec, FieldPath, InvalidField, OutlierConfig, Problem, SlowStartConfig,
    StrategyKind, StrategyOptions, TieBreak, ZoneRouting,
};
use serde::Deserialize;

use crate::config::health::{HealthCheckConfig, HealthCheckKind, ProbeConfig};

use crate::config::group::{group, KeySeed, Seen};
use crate::config::policy::{HashOn, RequestPolicy, StickyConfig};

use crate::config::discovery::DiscoveryConfig;
use crate::config::locate::{none, zero};

/// The ALPN id of HTTP/2.
pub const ALPN_H2: &[u8] = b"h2";
/// The ALPN id of HTTP/1.1.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

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

/// `[cluster.tls]`: the cluster's endpoints are reached over TLS (ALPN `http/1.1`, or `h2`
/// with `protocol = "h2"`). Relative paths are taken from the configuration file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamTlsConfig {
    /// PEM file with the CA certificates that endpoints' certificates must chain to. Required
    /// unless `system_roots` is on.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// Trust the operating system's CA certificates too (read once at load from the
    /// system's store, e.g. `/etc/ssl/certs`). Default `false`: only `ca`.
    #[serde(default)]
    pub system_roots: bool,
    /// PEM file with a client certificate chain keel presents to endpoints that ask for one
    /// (mutual TLS); with `key`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// PEM file with the client certificate's private key.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Name that every endpoint's certificate must be valid for (also sent as SNI). Default:
    /// each endpoint's host (an IP address is matched against the certificate's IP SANs).
    #[serde(default)]
    pub server_name: Option<String>,
}

impl UpstreamTlsConfig {
    /// Something to trust (`ca`, `system_roots`), and a client certificate whole or not at
    /// all; the files are the TLS component's check (`tls::check_upstream`).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.ca.is_none() && !self.system_roots {
            return Err(InvalidField::at(
                "ca",
                Problem::Invalid(
                    "nothing to verify endpoints' certificates against: set `ca = \"ca.pem\"`, or `system_roots = true` for the system's CAs".into(),
                ),
            ));
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => Err(InvalidField::at(
                "key",
                Problem::Invalid("`cert` (a client certificate) needs its `key`".into()),
            )),
            (None, Some(_)) => Err(InvalidField::at(
                "cert",
                Problem::Invalid("`key` needs the client certificate it belongs to: `cert`".into()),
            )),
            _ => Ok(()),
        }
    }
}

/// `[[cluster]]`: a set of endpoints, its balancer and how requests to it are made. The TOML
/// table is flat; its keys are held here in groups: [`BalanceConfig`] (the balancer's
/// options), [`TimeoutsConfig`], [`ProtectionsConfig`] and [`RequestPolicy`] (shared with
/// routes), besides the cluster's own keys.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// Unique name, referenced by listeners.
    pub name: String,
    /// The endpoints: `{ address = "host:port", weight = 1 }`. Required unless `discovery`
    /// finds them.
    pub endpoints: Vec<EndpointSpec>,
    /// Where the endpoints come from when they are not listed: DNS (A/AAAA or SRV records)
    /// or a file, refreshed while the proxy runs.
    pub discovery: Option<DiscoveryConfig>,
    /// How keel speaks to the endpoints: `"http1"` (default), `"h2c"` (HTTP/2 with prior
    /// knowledge) or `"h2"` (HTTP/2 over `[cluster.tls]`, ALPN `h2`). Either way one pick per
    /// request.
    pub protocol: UpstreamProtocol,
    /// PROXY protocol header (`"v1"` or `"v2"`) at the start of each connection a TCP
    /// listener opens to an endpoint. Unset: none.
    pub proxy_protocol: Option<ProxyProtocol>,
    /// TLS to the endpoints (`[cluster.tls]`); plain TCP unless present.
    pub tls: Option<UpstreamTlsConfig>,
    /// Load probes (`[cluster.probe]`) for a strategy that balances on the load endpoints
    /// report (prequal); other strategies send none.
    pub probe: ProbeConfig,
    /// What inference engines say about their own load (`[cluster.engine_signals]`): their
    /// ORCA header, asked for on every request, or their `/metrics`, scraped. Off unless
    /// present.
    pub engine_signals: Option<EngineSignalsConfig>,
    /// The endpoints are inference engines with an OpenAI API: each answer is measured (time
    /// to first token, time between tokens, `usage`'s tokens, the model) for the access log,
    /// `/metrics` and `/status`, and a streamed request that does not ask for `usage` is
    /// made to (the client does not see it). Default false.
    pub inference: bool,
    /// Token budgets per tenant (`[cluster.token_budget]`; `inference = true` clusters only).
    pub token_budget: Option<crate::config::budget::TokenBudgetConfig>,
    /// Responses whose `Content-Length` is at most this many bytes are read whole before they
    /// are forwarded, so that an endpoint failing mid-body can still be retried; larger or
    /// chunked bodies stream through. 0 streams everything. Default 65536.
    pub max_buffered_response: u64,
    /// Most idle keep-alive connections kept per endpoint. Default 256.
    pub pool_max_idle_per_endpoint: usize,
    /// Sticky sessions: a cookie naming the endpoint (see [`StickyConfig`]).
    pub sticky: Option<StickyConfig>,
    /// The proxy's own zone (the top-level `zone`), copied in when the file is read.
    pub zone: Option<String>,
    /// The balancer: strategy and its options.
    pub balance: BalanceConfig,
    /// Connect, request, idle and pool timeouts.
    pub timeouts: TimeoutsConfig,
    /// Outlier detection, slow start, retries, hedging, health checks and limits.
    pub protections: ProtectionsConfig,
    /// Rate limit and rewrites of every request to this cluster.
    pub policy: RequestPolicy,
}

group! {
    /// A cluster's balancer: the strategy and keel-balance's options (keys of `[[cluster]]`).
    pub struct BalanceConfig {
        /// keel-balance strategy. Default `round-robin`.
        "strategy" => strategy: StrategyKind = StrategyKind::RoundRobin;
        /// least-connections, least-time: tie-break (`random` or `lowest-index`). Default
        /// `random`.
        "tie_break" => tie_break: TieBreak = TieBreak::default();
        /// least-request, peak-ewma: candidates compared per pick. Default 2.
        "choices" => choices: u32 = StrategyOptions::default().choices;
        /// least-time, peak-ewma: EWMA time constant. Default 10 s.
        "decay" => decay: Duration = StrategyOptions::default().decay,
            with keel_balance::duration_serde::deserialize;
        /// peak-ewma: latency assumed before the first sample. Default 30 ms.
        "default_rtt" => default_rtt: Duration = StrategyOptions::default().default_rtt,
            with keel_balance::duration_serde::deserialize;
        /// peak-ewma: a failure counts as at least this latency. Default 1 s.
        "failure_penalty" => failure_penalty: Duration = StrategyOptions::default().failure_penalty,
            with keel_balance::duration_serde::deserialize;
        /// ring-hash: virtual nodes per endpoint of mean weight. Default 160.
        "vnodes" => vnodes: u32 = StrategyOptions::default().vnodes;
        /// maglev: lookup table size (a prime). Default 65537.
        "table_size" => table_size: u64 = StrategyOptions::default().table_size;
        /// Hash strategies: bounded load factor (e.g. 1.25); off unless set. prefix-affinity:
        /// its load bound, 1.25 unless set.
        "bounded_load" => bounded_load: Option<f64> = None;
        /// prefix-affinity: blocks in keel's estimate of each endpoint's prefix cache.
        /// Default 96 (see docs/configuration.md).
        "cache_blocks" => cache_blocks: u32 = StrategyOptions::default().cache_blocks;
        /// prefix-affinity: tokens per block, as the engines cache them (vLLM's
        /// `--block-size`). Default 16.
        "block_tokens" => block_tokens: u32 = DEFAULT_BLOCK_TOKENS;
        /// prefix-affinity: most bytes of a request body read for its prompt before the pick.
        /// Default 262144 (256 KiB).
        "prompt_read_limit" => prompt_read_limit: u64 = DEFAULT_PROMPT_READ_LIMIT;
        /// Panic threshold in percent of available endpoints (0 = off). Default 50.
        "panic_threshold" => panic_threshold: f64 = BalancerConfig::default().panic_threshold;
        /// Seed of the balancer's random choices. Default keel-balance's fixed seed.
        "seed" => seed: Option<u64> = None;
        /// orca-wrr: a weight counts after this long of ORCA reports (gRFC A58). Default 10 s.
        "blackout_period" => blackout_period: Duration = StrategyOptions::default().blackout_period,
            with keel_balance::duration_serde::deserialize;
        /// orca-wrr: a weight expires this long after its last report. Default 3 min.
        "weight_expiration_period" => weight_expiration_period: Duration =
            StrategyOptions::default().weight_expiration_period,
            with keel_balance::duration_serde::deserialize;
        /// orca-wrr: how often weights are recomputed. Default 1 s.
        "weight_update_period" => weight_update_period: Duration =
            StrategyOptions::default().weight_update_period,
            with keel_balance::duration_serde::deserialize;
        /// orca-wrr: multiplier of `eps / qps` in the weight. Default 1.
        "error_utilization_penalty" => error_utilization_penalty: f64 =
            StrategyOptions::default().error_utilization_penalty;
        /// Priority levels: Envoy's overprovisioning factor. Default 1.4.
        "overprovisioning_factor" => overprovisioning_factor: f64 =
            BalancerConfig::default().overprovisioning_factor;
        /// Cap on endpoints backed off at once for their `Retry-After` or gRPC pushback, in
        /// percent, counted as `max_ejection_percent` (0 = none). Default 10.
        "max_backed_off_percent" => max_backed_off_percent: f64 =
            BalancerConfig::default().max_backed_off_percent;
        /// Longest one back-off lasts, whatever the endpoint asked. Default 10 s.
        "max_back_off" => max_back_off: Duration = BalancerConfig::default().max_back_off,
            with keel_balance::duration_serde::deserialize;
        /// Zone-aware routing (`[cluster.zone_routing]`, keel-balance's `ZoneRouting`); needs
        /// the proxy's top-level `zone`. Off unless present.
        "zone_routing" => zone_routing: Option<ZoneRouting> = None;
        /// Where hash strategies take the request's key: `"header:NAME"`, `"path"` or
        /// `"client-ip"`. Unset: a random key per request (no affinity). prefix-affinity: a
        /// session's key (its requests stay on one endpoint among equal matches).
        "hash_on" => hash_on: Option<HashOn> = None;
    }
}

group! {
    /// A cluster's timeouts (keys of `[[cluster]]`, named `*_timeout` there but for
    /// `max_duration`).
    pub struct TimeoutsConfig {
        /// `connect_timeout`: time allowed to open a TCP connection to an endpoint. Default 1 s.
        "connect_timeout" => connect: Duration = Duration::from_secs(1),
            with keel_balance::duration_serde::deserialize;
        /// `request_timeout`: time allowed until the response head, all tries included (time
        /// to first byte); the body then streams under `upstream_idle_timeout` (and
        /// `max_duration`). Default 15 s.
        "request_timeout" => request: Duration = Duration::from_secs(15),
            with keel_balance::duration_serde::deserialize;
        /// `upstream_idle_timeout`: once the response head arrived, the body may go this long
        /// without a byte from the endpoint before it is cut (a server-sent event stream must
        /// send at least that often). Default 60 s.
        "upstream_idle_timeout" => upstream_idle: Duration = Duration::from_secs(60),
            with keel_balance::duration_serde::deserialize;
        /// `max_duration`: longest a request may last in all, from its arrival to the
        /// response's last byte; unset (the default): no limit beyond the idle timeouts.
        "max_duration" => max_duration: Option<Duration> = None,
            with keel_balance::duration_serde::option::deserialize;
        /// `pool_idle_timeout`: idle keep-alive connections to an endpoint are closed after
        /// this long. Default 90 s.
        "pool_idle_timeout" => pool_idle: Duration = Duration::from_secs(90),
            with keel_balance::duration_serde::deserialize;
    }
}

group! {
    /// What protects a cluster and its clients (keys and tables of `[[cluster]]`).
    pub struct ProtectionsConfig {
        /// Passive outlier detection (`[cluster.outlier_detection]`): on by default with
        /// keel-balance's defaults (5 failures in a row eject for 30 s, at most 10 % of the
        /// endpoints and at least one); `outlier_detection = false` turns it off.
        "outlier_detection" => outlier_detection: Option<OutlierConfig> =
            Some(OutlierConfig::default()),
            with outlier_toggle;
        /// Slow start (`[cluster.slow_start]`); off unless present.
        "slow_start" => slow_start: Option<SlowStartConfig> = None;
        /// Retries (`[cluster.retry]`).
        "retry" => retry: RetryConfig = RetryConfig::default();
        /// Hedged requests (`[cluster.hedge]`): a second try of a slow idempotent request to
        /// another endpoint; off unless present.
        "hedge" => hedge: Option<keel_balance::HedgeConfig> = None;
        /// Active HTTP health checks (`[cluster.health_check]`); off unless present.
        "health_check" => health_check: Option<HealthCheckConfig> = None;
        /// Circuit breaker: most client requests served at once by this cluster; beyond it the
        /// proxy answers `503` at once, without trying an endpoint. Default 10000.
        "max_in_flight" => max_in_flight: usize = 10_000;
        /// Most upstream tries one client request may cost (the first try, its hedges and its
        /// retries, routes' `retry_attempts` included); a configuration whose worst case is
        /// more is refused. Unset: no limit (the worst case is still printed by `--check`).
        "max_amplification" => max_amplification: Option<u32> = None;
    }
}

/// prefix-affinity's `block_tokens` default: vLLM's default block size.
pub const DEFAULT_BLOCK_TOKENS: u32 = 16;

/// prefix-affinity's `prompt_read_limit` default: 256 KiB, a prompt of about 64k tokens.
pub const DEFAULT_PROMPT_READ_LIMIT: u64 = 256 * 1024;

/// Largest `prompt_read_limit`: what one request may hold in memory for its pick.
pub const MAX_PROMPT_READ_LIMIT: u64 = 16 * 1024 * 1024;

/// Every key of `[[cluster]]`, in the order of the "unknown field" error's list.
pub(crate) const CLUSTER_KEYS: &[&str] = &[
    "name",
    "strategy",
    "endpoints",
    "discovery",
    "protocol",
    "proxy_protocol",
    "tie_break",
    "choices",
    "decay",
    "default_rtt",
    "failure_penalty",
    "vnodes",
    "table_size",
    "bounded_load",
    "cache_blocks",
    "block_tokens",
    "prompt_read_limit",
    "panic_threshold",
    "seed",
    "outlier_detection",
    "slow_start",
    "blackout_period",
    "weight_expiration_period",
    "weight_update_period",
    "error_utilization_penalty",
    "overprovisioning_factor",
    "max_backed_off_percent",
    "max_back_off",
    "zone_routing",
    "hash_on",
    "connect_timeout",
    "request_timeout",
    "upstream_idle_timeout",
    "max_duration",
    "max_buffered_response",
    "pool_idle_timeout",
    "pool_max_idle_per_endpoint",
    "max_in_flight",
    "retry",
    "health_check",
    "tls",
    "hedge",
    "probe",
    "engine_signals",
    "inference",
    "token_budget",
    "max_amplification",
    "rate_limit",
    "strip_prefix",
    "replace_prefix",
    "host_rewrite",
    "request_headers",
    "response_headers",
    "rewrite_location",
    "compression",
    "sticky",
];

impl<'de> Deserialize<'de> for ClusterConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Cluster;
        impl<'de> serde::de::Visitor<'de> for Cluster {
            type Value = ClusterConfig;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("struct ClusterConfig")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ClusterConfig, A::Error> {
                let mut name = None;
                let mut c = ClusterConfig::new(String::new(), Vec::new());
                let mut seen = Seen::default();
                while let Some(key) = map.next_key_seed(KeySeed(CLUSTER_KEYS))? {
                    seen.first(key)?;
                    match key {
                        "name" => name = Some(map.next_value()?),
                        "endpoints" => c.endpoints = map.next_value()?,
                        "discovery" => c.discovery = map.next_value()?,
                        "protocol" => c.protocol = map.next_value()?,
                        "proxy_protocol" => c.proxy_protocol = map.next_value()?,
                        "tls" => c.tls = map.next_value()?,
                        "probe" => c.probe = map.next_value()?,
                        "engine_signals" => c.engine_signals = Some(map.next_value()?),
                        "inference" => c.inference = map.next_value()?,
                        "token_budget" => c.token_budget = Some(map.next_value()?),
                        "max_buffered_response" => c.max_buffered_response = map.next_value()?,
                        "pool_max_idle_per_endpoint" => {
                            c.pool_max_idle_per_endpoint = map.next_value()?
                        }
                        "sticky" => c.sticky = map.next_value()?,
                        _ => {
                            let taken = c.balance.take(key, &mut map)?
                                || c.timeouts.take(key, &mut map)?
                                || c.protections.take(key, &mut map)?
                                || c.policy.take(key, &mut map)?;
                            if !taken {
                                // A key of CLUSTER_KEYS that no group owns (a test keeps the
                                // lists in step).
                                return Err(serde::de::Error::unknown_field(key, CLUSTER_KEYS));
                            }
                        }
                    }
                }
                c.name = name.ok_or_else(|| serde::de::Error::missing_field("name"))?;
                Ok(c)
            }
        }
        d.deserialize_struct("ClusterConfig", CLUSTER_KEYS, Cluster)
    }
}

fn default_max_buffered_response() -> u64 {
    65536
}
fn default_pool_max_idle() -> usize {
    256
}

/// Where an engine's load comes from (`[cluster.engine_signals] source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignalSource {
    /// Every request asks for the engine's ORCA header (`endpoint-load-metrics-format:
    /// text`); each answer's report counts when it arrives. vLLM answers on whole responses,
    /// not on streams.
    Orca,
    /// Each endpoint's Prometheus text (`metrics_path`) is read every `interval`.
    Metrics,
}

/// `[cluster.engine_signals]`: what inference engines (vLLM) say about their own load, its
/// queue depth (`num_requests_waiting`) and KV-cache use (`kv_cache_usage_perc`), read as
/// the engine gives it. A report is ignored and counted when it is malformed (no queue depth,
/// a value out of range) or older than `max_age` when it arrives; the load view forgets a
/// report once it is older than `max_age`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSignalsConfig {
    /// `"orca"` (the answers' header; default) or `"metrics"` (a scrape).
    #[serde(default = "default_signal_source")]
    pub source: SignalSource,
    /// `"metrics"`: time between two reads of an endpoint's metrics (GIE's
    /// `--refresh-metrics-interval`). Default 50 ms.
    #[serde(
        default = "default_signal_interval",
        with = "keel_balance::duration_serde"
    )]
    pub interval: Duration,
    /// A report older than this is ignored: on arrival (a scrape answered late), and by the
    /// load view afterwards (GIE's `--metrics-staleness-threshold`). Default 2 s.
    #[serde(
        default = "default_signal_max_age",
        with = "keel_balance::duration_serde"
    )]
    pub max_age: Duration,
    /// `"metrics"`: the path read. Default `/metrics`.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
}

fn default_signal_source() -> SignalSource {
    SignalSource::Orca
}
fn default_signal_interval() -> Duration {
    Duration::from_millis(50)
}
fn default_signal_max_age() -> Duration {
    Duration::from_secs(2)
}
fn default_metrics_path() -> String {
    "/metrics".into()
}

impl Default for EngineSignalsConfig {
    /// ORCA, a report counting for 2 s.
    fn default() -> Self {
        Self {
            source: default_signal_source(),
            interval: default_signal_interval(),
            max_age: default_signal_max_age(),
            metrics_path: default_metrics_path(),
        }
    }
}

impl EngineSignalsConfig {
    /// Checks the table; paths are relative to `[cluster.engine_signals]`.
    pub fn validate(&self, protocol: UpstreamProtocol) -> Result<(), InvalidField> {
        if self.source == SignalSource::Orca && protocol != UpstreamProtocol::Http1 {
            return Err(InvalidField::at(
                "source",
                Problem::NotApplicable(
                    "ORCA reports are read from HTTP/1.1 endpoints only (vLLM serves HTTP/1.1): use protocol = \"http1\" or source = \"metrics\""
                        .into(),
                ),
            ));
        }
        if self.interval < Duration::from_millis(1) || self.interval > Duration::from_secs(3600) {
            return Err(InvalidField::at(
                "interval",
                Problem::out_of_range("within 1ms..=1h", humantime::format_duration(self.interval)),
            ));
        }
        if self.max_age.is_zero() {
            return Err(InvalidField::at(
                "max_age",
                Problem::out_of_range("greater than zero", "0s"),
            ));
        }
        if self.source == SignalSource::Metrics && self.max_age < self.interval {
            return Err(InvalidField::at(
                "max_age",
                Problem::out_of_range(
                    format!(
                        "at least interval ({}): every report would be stale",
                        humantime::format_duration(self.interval)
                    ),
                    humantime::format_duration(self.max_age),
                ),
            ));
        }
        if !self.metrics_path.starts_with('/')
            || self.metrics_path.bytes().any(|b| b <= b' ' || b == 0x7f)
        {
            return Err(InvalidField::at(
                "metrics_path",
                Problem::Invalid(format!(
                    "{:?} is not an absolute path of visible characters",
                    self.metrics_path
                )),
            ));
        }
        Ok(())
    }
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

/// `outlier_detection = false | true | { table }`; a table's own errors keep their key and line.
fn outlier_toggle<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<OutlierConfig>, D::Error> {
    struct Toggle;
    impl<'de> serde::de::Visitor<'de> for Toggle {
        type Value = Option<OutlierConfig>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("`false`, `true` or a table of outlier-detection settings")
        }
        fn visit_bool<E>(self, on: bool) -> Result<Self::Value, E> {
            Ok(on.then(OutlierConfig::default))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            OutlierConfig::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Some)
        }
    }
    d.deserialize_any(Toggle)
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

impl ClusterConfig {
    /// The keel-balance configuration of this cluster.
    pub fn balancer_config(&self) -> BalancerConfig {
        let bal = &self.balance;
        let mut b = BalancerConfig::new(bal.strategy);
        b.options = StrategyOptions {
            tie_break: bal.tie_break,
            choices: bal.choices,
            decay: bal.decay,
            default_rtt: bal.default_rtt,
            failure_penalty: bal.failure_penalty,
            vnodes: bal.vnodes,
            table_size: bal.table_size,
            bounded_load: bal.bounded_load,
            cache_blocks: bal.cache_blocks,
            probes_per_pick: self.probe.probes_per_request.max(1),
            blackout_period: bal.blackout_period,
            weight_expiration_period: bal.weight_expiration_period,
            weight_update_period: bal.weight_update_period,
            error_utilization_penalty: bal.error_utilization_penalty,
            ..StrategyOptions::default()
        };
        b.outlier_detection = self.protections.outlier_detection.clone();
        b.panic_threshold = bal.panic_threshold;
        b.slow_start = self.protections.slow_start.clone();
        b.overprovisioning_factor = bal.overprovisioning_factor;
        b.max_backed_off_percent = bal.max_backed_off_percent;
        b.max_back_off = bal.max_back_off;
        b.zone_routing = bal.zone_routing.clone();
        b.zone = self.zone.clone();
        b.queue_max_age = self.engine_signals.as_ref().map(|s| s.max_age);
        if let Some(seed) = bal.seed {
            b.seed = seed;
        }
        b
    }

    /// The ALPN protocol offered to endpoints over TLS.
    pub fn alpn(&self) -> &'static [u8] {
        match self.protocol {
            UpstreamProtocol::H2 => ALPN_H2,
            _ => ALPN_HTTP11,
        }
    }

    /// The per-try timeout in force (explicit, or the request timeout shared by every try).
    pub fn per_try_timeout(&self) -> Duration {
        self.protections
            .retry
            .per_try_timeout
            .unwrap_or_else(|| self.timeouts.request / (self.protections.retry.attempts + 1))
    }
}

impl ClusterConfig {
    /// Checks the cluster: endpoints, timeouts, retries, health checks, and everything
    /// keel-balance checks of its balancer (options, protections, weights, duplicates); the
    /// TLS files are the TLS component's check (`tls::check_upstream`). Paths
    /// are relative to the `[[cluster]]`, e.g. `endpoints[1].weight` or
    /// `outlier_detection.failure_rate.threshold_percent`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.name.is_empty() {
            return Err(InvalidField::at(
                "name",
                Problem::Invalid("a cluster name cannot be empty".into()),
            ));
        }
        if let Some(r) = &self.policy.rate_limit {
            r.validate()
                .map_err(|e| e.under(FieldPath::key("rate_limit")))?;
        }
        if let Some(s) = &self.sticky {
            s.validate()
                .map_err(|e| e.under(FieldPath::key("sticky")))?;
        }
        if let Some(b) = &self.token_budget {
            b.validate()
                .map_err(|e| e.under(FieldPath::key("token_budget")))?;
            if !self.inference {
                return Err(InvalidField::at(
                    "token_budget",
                    Problem::Invalid(
                        "a token budget is charged from the engines' `usage`: set `inference = true`"
                            .into(),
                    ),
                ));
            }
        }
        self.policy.rewrites(None).validate()?;
        self.policy
            .compression
            .as_ref()
            .map_or(Ok(()), |c| c.validate())?;
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
        if self.timeouts.connect.is_zero() {
            return Err(zero("connect_timeout"));
        }
        if self.timeouts.upstream_idle.is_zero() {
            return Err(zero("upstream_idle_timeout"));
        }
        if self
            .timeouts
            .max_duration
            .is_some_and(|d| d < self.timeouts.request)
        {
            return Err(InvalidField::at(
                "max_duration",
                Problem::out_of_range(
                    format!(
                        "at least request_timeout ({})",
                        humantime::format_duration(self.timeouts.request)
                    ),
                    humantime::format_duration(self.timeouts.max_duration.unwrap_or_default()),
                ),
            ));
        }
        if self.timeouts.request < Duration::from_millis(1) {
            // Shared by the tries, it must leave each of them a usable slice.
            return Err(InvalidField::at(
                "request_timeout",
                Problem::out_of_range(
                    "at least 1ms",
                    humantime::format_duration(self.timeouts.request),
                ),
            ));
        }
        if self.protections.max_in_flight == 0 {
            return Err(none("max_in_flight"));
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
        if let Some(t) = &self.tls {
            t.validate().map_err(|e| e.under(FieldPath::key("tls")))?;
        }
        if let Some(h) = &self.protections.health_check {
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
        let bal = &self.balance;
        if !(1..=MAX_BLOCK_TOKENS as u32).contains(&bal.block_tokens) {
            return Err(InvalidField::at(
                "block_tokens",
                Problem::out_of_range(format!("within 1..={MAX_BLOCK_TOKENS}"), bal.block_tokens),
            ));
        }
        if bal.prompt_read_limit > MAX_PROMPT_READ_LIMIT {
            return Err(InvalidField::at(
                "prompt_read_limit",
                Problem::out_of_range(
                    format!("at most {MAX_PROMPT_READ_LIMIT}"),
                    bal.prompt_read_limit,
                ),
            ));
        }
        if self.balance.hash_on.is_some()
            && !self.balance.strategy.is_hash()
            && self.balance.strategy != StrategyKind::PrefixAffinity
        {
            return Err(InvalidField::at(
                "hash_on",
                Problem::NotApplicable(format!(
                    "hash_on applies to the hash strategies (ring-hash, maglev, rendezvous) and \
                     prefix-affinity, not {}",
                    self.balance.strategy
                )),
            ));
        }
        // Load reports (headers and probes) and hedging live in the HTTP/1.1 leg only: refused
        // elsewhere rather than silently balancing without them.
        if self.balance.zone_routing.is_some() && self.zone.is_none() {
            return Err(InvalidField::at(
                "zone_routing",
                Problem::Invalid(
                    "zone-aware routing needs the proxy's own zone: set the top-level `zone`"
                        .into(),
                ),
            ));
        }
        if self.protocol != UpstreamProtocol::Http1 {
            if self.balance.strategy == StrategyKind::OrcaWrr {
                return Err(InvalidField::at(
                    "strategy",
                    Problem::NotApplicable(
                        "orca-wrr needs ORCA reports (endpoint-load-metrics), which keel reads from HTTP/1.1 endpoints only: use protocol = \"http1\" or another strategy"
                            .into(),
                    ),
                ));
            }
            if self.balance.strategy == StrategyKind::Prequal {
                return Err(InvalidField::at(
                    "strategy",
                    Problem::NotApplicable(
                        "prequal needs load reports, which keel reads from HTTP/1.1 endpoints only: use protocol = \"http1\" or another strategy"
                            .into(),
                    ),
                ));
            }
        }
        self.protections
            .retry
            .validate(self.timeouts.request)
            .map_err(|e| e.under(FieldPath::key("retry")))?;
        self.check_amplification(self.protections.retry.attempts)?;
        if let Some(h) = &self.protections.hedge {
            h.validate().map_err(|e| e.under(FieldPath::key("hedge")))?;
        }
        self.probe
            .validate()
            .map_err(|e| e.under(FieldPath::key("probe")))?;
        if let Some(s) = &self.engine_signals {
            s.validate(self.protocol)
                .map_err(|e| e.under(FieldPath::key("engine_signals")))?;
        }
        if let Some(h) = &self.protections.health_check {
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

impl ClusterConfig {
    /// A round-robin cluster of these endpoints, other options at their defaults (one retry,
    /// no health checks, no outlier detection).
    pub fn new(name: impl Into<String>, endpoints: Vec<EndpointSpec>) -> Self {
        ClusterConfig {
            name: name.into(),
            endpoints,
            discovery: None,
            protocol: UpstreamProtocol::default(),
            proxy_protocol: None,
            tls: None,
            probe: ProbeConfig::default(),
            engine_signals: None,
            inference: false,
            token_budget: None,
            max_buffered_response: default_max_buffered_response(),
            pool_max_idle_per_endpoint: default_pool_max_idle(),
            sticky: None,
            zone: None,
            balance: BalanceConfig::default(),
            timeouts: TimeoutsConfig::default(),
            protections: ProtectionsConfig::default(),
            policy: RequestPolicy::default(),
        }
    }

    /// Applies a keel-balance configuration's strategy, options and protections (the inverse
    /// of [`ClusterConfig::balancer_config`]).
    pub fn with_balancer(mut self, b: &BalancerConfig) -> Self {
        let o = &b.options;
        let bal = &mut self.balance;
        bal.strategy = b.strategy;
        bal.tie_break = o.tie_break;
        bal.choices = o.choices;
        bal.decay = o.decay;
        bal.default_rtt = o.default_rtt;
        bal.failure_penalty = o.failure_penalty;
        bal.vnodes = o.vnodes;
        bal.table_size = o.table_size;
        bal.bounded_load = o.bounded_load;
        self.probe.probes_per_request = o.probes_per_pick;
        bal.panic_threshold = b.panic_threshold;
        bal.seed = Some(b.seed);
        self.protections
            .outlier_detection
            .clone_from(&b.outlier_detection);
        self.protections.slow_start.clone_from(&b.slow_start);
        bal.blackout_period = o.blackout_period;
        bal.weight_expiration_period = o.weight_expiration_period;
        bal.weight_update_period = o.weight_update_period;
        bal.error_utilization_penalty = o.error_utilization_penalty;
        bal.overprovisioning_factor = b.overprovisioning_factor;
        bal.max_backed_off_percent = b.max_backed_off_percent;
        bal.max_back_off = b.max_back_off;
        bal.zone_routing.clone_from(&b.zone_routing);
        self.zone.clone_from(&b.zone);
        self
    }
}

/// How many upstream tries one client request may cost a cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Amplification {
    /// The worst case for one request: the first try, its hedges, then every retry.
    pub worst_case: u32,
    /// Load probes sent per pick besides (prequal's `[cluster.probe]`; small `GET`s).
    pub probes_per_try: u32,
    /// The long-run bound on tries per request once traffic is steady: the budgets cap
    /// retries and hedges at their percentages of requests (plus `min_retries_per_second`,
    /// which matters at low rates only).
    pub long_run: f64,
}

impl ClusterConfig {
    /// Tries per request with `attempts` retries (the cluster's, or a route's override).
    pub fn amplification_with(&self, attempts: u32) -> Amplification {
        let hedges = self.protections.hedge.as_ref().map_or(0, |h| h.max);
        let hedge_share = self
            .protections
            .hedge
            .as_ref()
            .map_or(0.0, |h| h.budget_percent / 100.0);
        let retry_share = if attempts == 0 {
            0.0
        } else {
            self.protections.retry.budget_percent / 100.0
        };
        Amplification {
            worst_case: 1 + hedges + attempts,
            probes_per_try: if self.balance.strategy == StrategyKind::Prequal {
                self.probe.probes_per_request
            } else {
                0
            },
            long_run: 1.0 + retry_share + hedge_share,
        }
    }

    /// [`Self::amplification_with`] the cluster's own `retry.attempts`.
    pub fn amplification(&self) -> Amplification {
        self.amplification_with(self.protections.retry.attempts)
    }

    /// Refuses `attempts` retries (the cluster's, or a route's) if they break
    /// `max_amplification`.
    pub(crate) fn check_amplification(&self, attempts: u32) -> Result<(), InvalidField> {
        let Some(max) = self.protections.max_amplification else {
            return Ok(());
        };
        if max == 0 {
            return Err(crate::config::locate::none("max_amplification"));
        }
        let a = self.amplification_with(attempts);
        if a.worst_case > max {
            let hedges = a.worst_case - 1 - attempts;
            return Err(InvalidField::at(
                "max_amplification",
                Problem::Invalid(format!(
                    "a request may cost {} upstream tries (1 + {hedges} hedge(s) + {attempts} retries), more than max_amplification = {max}: lower retry.attempts or hedge.max, or raise the limit",
                    a.worst_case
                )),
            ));
        }
        Ok(())
    }
}
