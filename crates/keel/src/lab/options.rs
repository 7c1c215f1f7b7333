//! What a lab run is asked for: its own file, below every experiment and the cases, which read
//! it.

use std::path::PathBuf;

use keel_balance::StrategyKind;

/// What to run and where to write the report.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Fewer experiments and requests: a first look in about a minute on 2 shared cores.
    pub quick: bool,
    /// Experiments to run (e1..e6b, e8, e9, e10, e12); empty: the default set (e1..e6b; quick: e1, e2,
    /// e6, e6b).
    pub experiments: Vec<String>,
    /// Only these strategies; empty: all of each experiment.
    pub strategies: Vec<StrategyKind>,
    /// Report directory.
    pub out: PathBuf,
    /// Seed of every balancer, backend and simulation.
    pub seed: u64,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Balancers to measure next to keel (`--peers`); alone, they run instead of E1-E6B.
    pub peers: Vec<String>,
}
