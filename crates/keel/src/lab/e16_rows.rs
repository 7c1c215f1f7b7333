//! E16's rows and its part of a lab run's report: below the experiment (e16.rs), so the lab's
//! report holds them without reading the experiment.

use serde::Serialize;

/// One fleet size and way of sharing, three ways: closed form, simulator, real traffic.
#[derive(Debug, Clone, Serialize)]
pub struct E16Row {
    /// keel proxies in the fleet (N).
    pub proxies: usize,
    /// What the proxies share: `none`, `engine signals` (each reads every engine's `/metrics`)
    /// or `prefix key` (every proxy rendezvous-hashes the prompt's first block name alike).
    pub sharing: String,
    /// Engines a group was placed on, on average: closed form, simulator (mean), traffic.
    pub homes: [f64; 3],
    /// Share of prompt tokens served from cache: closed form, simulator (mean), traffic.
    pub cached: [f64; 3],
    /// Mean time to first token, ms: closed form, simulator (mean), traffic.
    pub ttft_ms: [f64; 3],
    /// Requests per engine: simulator (mean over its seeds).
    pub per_engine_sim: Vec<f64>,
    /// Requests per engine: traffic.
    pub per_engine: Vec<u64>,
    /// Calls to the engines besides the requests (the signals' `/metrics` reads), per request.
    pub extra_calls_per_request: f64,
    /// Simulator and traffic within [`crate::lab::e16::TOLERANCE`] of the closed form's share
    /// from cache; for `prefix key`, each within it of the form for its own placement
    /// (`cached_placed`).
    pub agrees: bool,
    /// `prefix key`: the engine each group's hash placed it on in the traffic (the engine that
    /// served most of its requests); empty otherwise.
    pub placement: Vec<usize>,
    /// `prefix key`: the closed form's share from cache for the simulator's placements (mean
    /// over its seeds) and for the traffic's. The form in `cached` is its mean over placements
    /// (each group's engine uniform): one run is one draw, and a draw may put every group on
    /// one engine.
    pub cached_placed: Option<[f64; 2]>,
}

/// E16's result.
#[derive(Debug, Clone, Serialize)]
pub struct E16Report {
    /// What it shows, in a sentence or two.
    pub answer: String,
    /// Engines (M).
    pub engines: usize,
    /// Prefix groups, equally popular.
    pub groups: usize,
    /// Closed-loop clients in all.
    pub clients: usize,
    /// Requests per row.
    pub requests: u64,
    /// How the clients' requests reach the proxies.
    pub dealt: String,
    /// The tolerance of `agrees`.
    pub tolerance: f64,
    /// One row per fleet size and way of sharing.
    pub rows: Vec<E16Row>,
    /// What was not measured, and why.
    pub not_measured: Vec<String>,
    /// Wall time, seconds.
    pub seconds: f64,
}
