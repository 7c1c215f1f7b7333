//! The peers' rows and their part of a lab run's report: below the runner, so the lab's
//! report holds them without reading the runner.

use serde::Serialize;

/// One measured row: a balancer (a peer or keel) on one case.
#[derive(Debug, Clone, Serialize)]
pub struct PeerRow {
    /// `nginx`, `haproxy`, `envoy` or `keel`.
    pub balancer: String,
    /// `bare` (no retries, no passive health) or `operators` (as usually configured; keel: its
    /// defaults).
    pub setting: String,
    /// keel's name of the strategy (hash: a consistent hash of the request's key header).
    pub strategy: String,
    /// The balancer's own spelling.
    pub native_strategy: String,
    /// How the balancer ran: its workers and what they share.
    pub run_as: String,
    /// What a request does after a failed call: `stops at first failure` or `all calls`.
    pub client: String,
    /// hang or fail-fast (a 503 at once).
    pub failure_mode: String,
    /// Failed share of servers.
    pub p: f64,
    /// t_fail / t_ok.
    pub q: Option<f64>,
    /// Calls per request.
    pub k: u32,
    /// Requests in flight.
    pub concurrency: usize,
    /// Requests measured.
    pub requests: u64,
    /// Requests whose every call succeeded.
    pub succeeded: u64,
    /// Calls made (a request stops at its first failed call).
    pub calls: u64,
    /// Hash rows: the failed server's share of the row's request keys on this balancer's own
    /// ring, counted by sending each key once through it with every server healthy (keel:
    /// its ring's picks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_share: Option<f64>,
    /// The closed form (without retries or health: the bare setting's model; hash rows: 1
    /// minus `key_share`, one server per request whatever k).
    pub analytic: Option<f64>,
    /// Measured success.
    pub measured: f64,
    /// Its Wilson 95 % interval.
    pub measured_ci95: [f64; 2],
    /// Whether the closed form lies inside the interval.
    pub agrees: Option<bool>,
    /// Measured minus closed form, in standard errors of the measurement.
    pub z: Option<f64>,
    /// Share of the backends' requests that went to the failed one (retries included).
    pub measured_failed_share: f64,
    /// (1 - share)^k: what the measured share gives if calls were independent.
    pub implied_by_measured_share: f64,
    /// Requests each backend received, in endpoint order (the failed one last).
    pub attempts: Vec<u64>,
    /// Calls answered, by status.
    pub by_status: std::collections::BTreeMap<u16, u64>,
    /// Calls without a complete answer.
    pub transport_errors: u64,
    /// Requests by their number of failed calls (index 0: none).
    pub failed_calls_per_request: Vec<u64>,
    /// A first-failure-stops client's failed requests: the mean index (1-based) of the call
    /// that failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean_failing_call: Option<f64>,
    /// An all-calls client: failed calls per failed request, measured and what independent
    /// calls at the row's share of failed calls give.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_failures: Option<[f64; 2]>,
    /// An all-calls client: calls made right after a failed call of the same request, and how
    /// many of those failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_failure: Option<[u64; 2]>,
    /// The healthy servers' times: `fixed` or `exponential` (the all-calls row whose picks
    /// shuffle), with their mean.
    pub healthy_times: String,
    /// Median and 99th percentile request latency, ms.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// Wall time, s.
    pub seconds: f64,
    /// The peer's own counters for the row (Envoy: retries, overflows, ejections; non-zero
    /// ones only).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peer_stats: std::collections::BTreeMap<String, u64>,
    /// What moves the measurement away from the closed form, when it is outside the interval;
    /// for an all-calls round-robin row, whether the rotation showed (either way).
    pub mechanism: Option<String>,
    /// The numbers of this row the mechanism cites, each by its place in the row (a JSON
    /// pointer into it, e.g. `/peer_stats/upstream_rq_retry_overflow`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<Evidence>,
    /// False when the row departs and no mechanism with a number of its own is named for it.
    pub explained: bool,
    /// Other balancers' rows of the same case that measure the same behaviour (bare
    /// round-robin, and random where the balancer draws once) and whose intervals do not
    /// overlap this one's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disagrees_with: Vec<String>,
}

/// A number of a row that its mechanism cites.
#[derive(Debug, Clone, Serialize)]
pub struct Evidence {
    /// Where it is in the row: a JSON pointer (`/measured_failed_share`, `/attempts/4`).
    pub field: String,
    /// Its value.
    pub value: f64,
}

/// A peer that was asked for and could not be measured.
#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    /// The peer.
    pub balancer: String,
    /// Why.
    pub reason: String,
}

/// The peers' part of a lab run.
#[derive(Debug, Clone, Serialize)]
pub struct PeersReport {
    /// Every measured row, keel's included (`balancer: "keel"`).
    pub rows: Vec<PeerRow>,
    /// Peers named and not measured.
    pub skipped: Vec<Skipped>,
    /// Each peer's binary and version.
    pub versions: Vec<(String, String)>,
    /// How the peers ran.
    pub method: String,
    /// Wall time of the peers' rows, s.
    pub seconds: f64,
}
