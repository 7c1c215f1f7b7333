//! E18's rows and its part of a lab run's report: below the experiment (e18.rs), so the lab's
//! report holds them without reading the experiment.

use serde::Serialize;

/// One routing replaying the trace: predicted, simulated and measured.
#[derive(Debug, Clone, Serialize)]
pub struct E18Row {
    /// `keel`, `vllm-router` or `smg`.
    pub router: String,
    /// Its policy: keel's strategy (with `, session key` for `hash_on =
    /// "header:x-session-id"`) or the peer's `--policy`.
    pub policy: String,
    /// How the closed form places the requests before the run: `requests spread evenly` (one
    /// by one) or `conversations spread evenly` (each kept whole).
    pub placement: String,
    /// Share of prompt tokens served from cache: closed form (before the run, on the
    /// placement above), simulator (mean over seeds; keel only), traffic.
    pub cached: [Option<f64>; 3],
    /// The closed form on the placement the traffic made (each request on the engine that
    /// answered it).
    pub formula_on_run: f64,
    /// The simulator's largest minus smallest share over its seeds.
    pub sim_spread: Option<f64>,
    /// Mean time to first token, ms: simulator, traffic.
    pub ttft_mean_ms: [Option<f64>; 2],
    /// 99th percentile time to first token, ms: simulator, traffic.
    pub ttft_p99_ms: [Option<f64>; 2],
    /// Requests answered per engine (traffic).
    pub per_engine: Vec<u64>,
    /// Requests answered (traffic).
    pub requests: u64,
    /// Requests that failed (traffic).
    pub failed: u64,
    /// Calls to the engines per request besides the request itself (renders, polls).
    pub extra_calls_per_request: f64,
    /// The closed form on the run's placement and the simulator within
    /// [`crate::lab::e18::TOLERANCE`] of the traffic (the closed form alone for a peer).
    pub agrees: bool,
}

/// E18's result.
#[derive(Debug, Clone, Serialize)]
pub struct E18Report {
    /// What it shows, answer first.
    pub answer: String,
    /// Requests replayed.
    pub requests: usize,
    /// Conversations derived from the trace.
    pub sessions: usize,
    /// Requests that continue an earlier one's conversation.
    pub continuing: usize,
    /// Minutes of the trace they came from.
    pub trace_minutes: f64,
    /// Offered load per engine the arrivals were compressed to.
    pub load: f64,
    /// Requests per second to the pool.
    pub rate: f64,
    /// Seconds the replay takes (last arrival).
    pub replay_seconds: f64,
    /// Trace token counts are divided by this (512-token blocks to the engine's).
    pub token_divisor: usize,
    /// Mean prompt and output tokens after scaling.
    pub mean_tokens: [f64; 2],
    /// Engines in the pool.
    pub engines: usize,
    /// Each engine's KV blocks.
    pub kv_blocks: usize,
    /// Share of prompt tokens one engine with an unbounded cache would serve from cache: the
    /// most any routing can.
    pub ceiling: f64,
    /// One row per routing.
    pub rows: Vec<E18Row>,
    /// Peers asked for that did not run, and why.
    pub skipped: Vec<String>,
    /// Wall time, seconds.
    pub seconds: f64,
}
