//! E12's rows and its part of a lab run's report: below the experiment (fleet.rs), so the lab's
//! report holds them without reading the experiment.

use serde::Serialize;

/// One measured row: N proxies, one way of dealing traffic, one detection.
#[derive(Debug, Clone, Serialize)]
pub struct FleetRow {
    /// Proxies (N).
    pub proxies: u32,
    /// `in-turn` or `spread`.
    pub traffic: String,
    /// `local` or `shared`.
    pub detection: String,
    /// Failed tries of each run.
    pub runs: Vec<u64>,
    /// Their mean.
    pub measured: f64,
    /// Student-t 95 % interval of the mean (the mean itself when every run agrees).
    pub measured_ci95: [f64; 2],
    /// keel-model's closed form.
    pub closed_form: Option<f64>,
    /// keel-model's simulation of the same setting: mean and 95 % interval.
    pub simulated: f64,
    /// Its interval.
    pub simulated_ci95: [f64; 2],
    /// The closed form lies inside the measured interval, the measured and simulated intervals
    /// overlap, or the runs' tries beyond the threshold are a likely Poisson count at the
    /// closed form's mean.
    pub agrees: bool,
    /// Shared detection: evidence records the proxies wrote to etcd per failed try, over all
    /// runs (each failure is published at once, so about 1; what a fleet costs etcd).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writes_per_failed_try: Option<f64>,
}

/// E12's result.
#[derive(Debug, Clone, Serialize)]
pub struct FleetReport {
    /// The rows, local then shared for each N and traffic.
    pub rows: Vec<FleetRow>,
    /// Why E12 did not run (etcd missing), when it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    /// The model's evidence delay d: etcd's put-to-watch-event time measured before the runs
    /// (mean of 60 puts), milliseconds. A failure is published at once, so keel's own part is
    /// microseconds.
    pub evidence_delay_ms: f64,
    /// Wall time, seconds.
    pub seconds: f64,
}
