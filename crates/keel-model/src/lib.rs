//! # keel-model
//!
//! keel's reliability model: what share of requests succeeds when some servers of a cluster
//! have failed, depending on how the balancer picks (docs/reliability.md states the model and
//! its source, the article *Common Load-Balancing Strategies and Their Reliability Analysis in
//! Distributed Systems*, which comments here call "the source"). It
//! holds the closed forms ([`analytic`]), a discrete-event simulator on a virtual clock that
//! drives keel-balance's own balancers ([`sim`]), the experiments as presets ([`presets`]),
//! confidence intervals ([`stats`]), SVG charts ([`plot`]), and the vocabulary every experiment
//! is written in ([`vocab`]: latency distributions and failure modes), which the testbed's
//! backend and the lab use too.

pub mod advise;
pub mod analytic;
pub mod fit;
pub mod fleet;
pub mod inference;
pub mod multiplex;
pub mod plot;
pub mod presets;
pub mod sim;
pub mod stats;
pub mod sticky;
pub mod sweep;
pub mod vocab;
pub mod zones;

pub use vocab::{FailureMode, Latency, LatencyDist};
