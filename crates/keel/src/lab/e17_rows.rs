//! E17's rows and its part of a lab run's report: below the experiment (e17.rs), so the lab's
//! report holds them without reading the experiment.

use serde::Serialize;

/// One way the engine fails, three ways: closed form, simulator, real traffic.
#[derive(Debug, Clone, Serialize)]
pub struct E17Row {
    /// `hang`, `server-error` (a 500 at once) or `refuse`.
    pub failure: String,
    /// From the start of a try on the failed engine to its failure being seen, ms (the
    /// closed form's d: a hang's per-try timeout).
    pub detection_ms: f64,
    /// Groups the failed engine held: closed form (G / N), simulator (mean), traffic.
    pub held: [f64; 3],
    /// Failed tries in all before the engine is passed over: closed form, simulator (mean),
    /// traffic.
    pub failed_tries: [f64; 3],
    /// The most failed tries of one group: simulator (largest over its seeds), traffic.
    pub most_per_group: [u64; 2],
    /// Failed tries the clients saw (not retried): closed form, simulator (mean), traffic.
    pub client_failures: [f64; 3],
    /// Requests that missed their prefix after the failure (the moved groups' warm-ups):
    /// closed form, simulator (mean), traffic.
    pub misses: [f64; 3],
    /// Requests sent after the failure (traffic).
    pub requests_after: u64,
    /// Every group the engine held answered from another engine after the failure (traffic).
    pub moved: bool,
    /// Simulator and traffic within [`crate::lab::e17::TOLERANCE`] of the closed form, on
    /// failed tries, client failures and misses.
    pub agrees: bool,
}

/// E17's result.
#[derive(Debug, Clone, Serialize)]
pub struct E17Report {
    /// What it shows, in a sentence or two.
    pub answer: String,
    /// Engines (N), groups (G) and closed-loop clients (C).
    pub engines: usize,
    /// Prefix groups, equally popular.
    pub groups: usize,
    /// Requests in flight.
    pub clients: usize,
    /// Requests before the failure (every group warmed) and after it.
    pub requests: [u64; 2],
    /// A client's healthy cycle the closed form uses (S), ms.
    pub cycle_ms: f64,
    /// One row per way of failing.
    pub rows: Vec<E17Row>,
    /// Wall time, seconds.
    pub seconds: f64,
}
