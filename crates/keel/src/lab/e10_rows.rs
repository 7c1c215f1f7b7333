//! E10's rows and its part of a lab run's report: below the experiment (e10.rs), so the lab's
//! report holds them without reading the experiment.

use serde::Serialize;

/// One configuration, predicted and measured.
#[derive(Debug, Clone, Serialize)]
pub struct E10Row {
    /// Rank in the advice (1 = recommended).
    pub rank: usize,
    /// Strategy.
    pub strategy: String,
    /// Protections label.
    pub protections: String,
    /// Whether it is the configuration the log was written under.
    pub running: bool,
    /// Predicted success [mean, lo95, hi95].
    pub predicted: [f64; 3],
    /// Measured success [rate, lo95, hi95] (Wilson).
    pub measured: [f64; 3],
    /// Requests measured.
    pub requests: u64,
    /// Predicted p99 in ms [mean, lo95, hi95].
    pub predicted_p99_ms: [f64; 3],
    /// Measured p99 of request latency, ms.
    pub measured_p99_ms: f64,
    /// (measured - predicted) / standard error of the difference.
    pub z: f64,
    /// |z| <= 1.96.
    pub agrees: bool,
}

/// E10's result.
#[derive(Debug, Clone, Serialize)]
pub struct E10Report {
    /// Rows: the recommended three, then the running configuration.
    pub rows: Vec<E10Row>,
    /// Requests of the logged run.
    pub logged_requests: u64,
    /// Share of time the flapping backend is down (drawn from the seed).
    pub down_share: f64,
    /// Rows that agree.
    pub agreeing: usize,
    /// The recommended configuration was measured best, or the best measured rate is within
    /// its interval.
    pub recommended_holds: bool,
    /// The advice's sentences.
    pub why: Vec<String>,
}
