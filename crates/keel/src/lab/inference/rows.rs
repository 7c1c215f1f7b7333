//! E13-E15's rows and their part of a lab run's report: below the experiment (mod.rs), so the
//! lab's report holds them without reading the experiment.

use serde::Serialize;

/// One row: a workload and a routing, three ways (and the peers' rows: traffic only).
#[derive(Debug, Clone, Serialize)]
pub struct InferenceRow {
    /// `e13` or `e15`.
    pub experiment: String,
    /// The workload in words.
    pub workload: String,
    /// Prefix groups.
    pub groups: usize,
    /// KV cache blocks per engine.
    pub kv_blocks: usize,
    /// Requests in flight (closed loop).
    pub clients: usize,
    /// Requests sent.
    pub requests: u64,
    /// `keel`, `vllm-router` or `smg`.
    pub router: String,
    /// The routing policy.
    pub policy: String,
    /// Closed form: share of prompt tokens from cache (its own routing's mix).
    pub formula_cached: Option<f64>,
    /// Simulator (mean over seeds).
    pub sim_cached: Option<f64>,
    /// Real traffic.
    pub traffic_cached: Option<f64>,
    /// Closed form given the mix the simulator made.
    pub formula_on_sim_mix: Option<f64>,
    /// Closed form given the mix the traffic made.
    pub formula_on_traffic_mix: Option<f64>,
    /// The closed form (its own routing's mix) within [`HIT_TOLERANCE`](crate::lab::inference::HIT_TOLERANCE) of the simulator and
    /// of the traffic (keel's rows).
    pub formula_holds: Option<bool>,
    /// Mean TTFT, ms: closed form (service time, closed loop), simulator, traffic.
    pub formula_ttft_ms: Option<f64>,
    /// Simulator's mean TTFT, ms.
    pub sim_ttft_ms: Option<f64>,
    /// Traffic's mean TTFT, ms.
    pub traffic_ttft_ms: Option<f64>,
    /// Requests per engine (traffic).
    pub per_engine: Vec<u64>,
    /// Busiest engine's requests over the idlest's (traffic).
    pub busiest_over_idlest: f64,
    /// Calls to the engines per request besides the request itself (traffic).
    pub extra_calls_per_request: Option<f64>,
    /// Those calls by path.
    pub extra_paths: Vec<(String, u64)>,
}

/// E14: one skew of prefix popularity.
#[derive(Debug, Clone, Serialize)]
pub struct CrossoverRow {
    /// The skew in words.
    pub skew: String,
    /// Closed form: the highest load (per engine) of the first run of affinity wins from 0.2
    /// in steps of 0.1; none when it loses at 0.2; 1.0 when it wins up to 0.9.
    pub formula: Option<f64>,
    /// The closed form given the partition the simulated strategy made (a hash does not
    /// place groups largest first); M/G/1 per engine, so it does not see batching absorb a
    /// hot engine's queue.
    pub formula_on_sim_mix: Option<f64>,
    /// The same from the simulator.
    pub sim: Option<f64>,
    /// Formula and simulator within 0.1.
    pub agrees: bool,
    /// Real traffic (the quick form: uniform groups only): the load per engine it was offered
    /// at, Poisson.
    pub traffic_load: Option<f64>,
    /// keel's prefix-affinity's mean TTFT there, ms.
    pub traffic_affinity_ttft_ms: Option<f64>,
    /// keel's round-robin's mean TTFT there, ms.
    pub traffic_round_robin_ttft_ms: Option<f64>,
    /// Traffic's verdict at that load (affinity faster) is the closed form's.
    pub traffic_agrees: Option<bool>,
}

/// E13-E15's result.
#[derive(Debug, Clone, Serialize)]
pub struct InferenceReport {
    /// The answer: which routing for this pool, and the load above which affinity stops paying.
    pub answer: String,
    /// E13 and E15 rows.
    pub rows: Vec<InferenceRow>,
    /// E14.
    pub crossover: Vec<CrossoverRow>,
    /// keel's affinity in this run: `prefix-affinity`, or the stand-in.
    pub affinity: String,
    /// Peers named and not found, or that failed.
    pub skipped: Vec<String>,
    /// Wall time, seconds.
    pub seconds: f64,
}
