//! The one shape of a lab experiment: what it will run ([`Experiment::plan`]), running it
//! ([`Experiment::run`]), its rows in the report ([`Experiment::rows`]), and what it adds to
//! the report: findings for the answer, a section of the page and of the terminal output.
//! `keel lab` builds a list of experiments (cmd/lab.rs) and `lab::run` drives every one through
//! the same loop, so that a new experiment is one new file that implements this trait.
//!
//! An experiment is one family of cases that share a row type and a report section: E1-E6B
//! (reliability.rs) are one value because their rows share one table, its charts and the run's
//! headline; E8 and E9 (tail_run.rs) one; E10 (e10.rs) one; the peers' rows (peers.rs) one;
//! E12, the fleet on etcd (fleet.rs), one.

use std::cell::Cell;
use std::path::Path;

use crate::lab::answer::Finding;
use crate::lab::cases::Timing;
use crate::lab::results::LabReport;

/// One case an experiment will run: for the progress bar and the run's size.
#[derive(Debug, Clone)]
pub struct Planned {
    /// A one-line description.
    pub what: String,
    /// Requests it sends (the progress bar's unit).
    pub requests: u64,
}

/// What every experiment runs with: the lab's runtime, its progress bar and settings.
pub struct Lab<'a> {
    /// The runtime every real-traffic run uses.
    pub runtime: &'a tokio::runtime::Runtime,
    /// The progress bar, when one is shown.
    pub bar: Option<&'a indicatif::ProgressBar>,
    /// Requests of the cases finished so far: where the bar stands between cases.
    pub done: Cell<u64>,
    /// The scaled times.
    pub timing: &'a Timing,
    /// Seed of every balancer, backend and simulation.
    pub seed: u64,
    /// `--quick`.
    pub quick: bool,
    /// The report directory (an experiment may write its own files under it).
    pub out: &'a Path,
}

impl Lab<'_> {
    /// Marks `requests` more as done and moves the bar there.
    pub fn advance(&self, requests: u64) {
        self.done.set(self.done.get() + requests);
        if let Some(bar) = self.bar {
            bar.set_position(self.done.get());
        }
    }
}

/// A lab experiment. `plan` is fixed when the value is built (from `--experiments`,
/// `--strategies` and `--quick`); an empty plan is not run, and contributes nothing.
pub trait Experiment {
    /// The names `--experiments` selects it by (none: selected another way, e.g. `--peers`).
    fn names(&self) -> &'static [&'static str];
    /// The cases it will run.
    fn plan(&self) -> Vec<Planned>;
    /// Runs every case: real traffic, then the simulator's twin and the closed form.
    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()>;
    /// Moves its rows into the report.
    fn rows(&mut self, report: &mut LabReport);
    /// Its findings for "What this run shows", from the report's rows (an experiment may
    /// compare with another's rows).
    fn answer(&self, report: &LabReport) -> Vec<Finding>;
    /// Its section of `index.html` (empty when it has no rows).
    fn html(&self, report: &LabReport) -> String;
    /// Its tables for a terminal: at most 100 columns, every column with `wide`.
    fn print(&self, report: &LabReport, wide: bool);
}
