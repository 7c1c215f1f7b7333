//! `keel lab`: the reliability experiments E1-E6 (docs/reliability.md) three ways at once: the
//! closed form, the simulator, and real traffic through keel's proxy to in-process backends
//! that fail on purpose, all on loopback. Each case is one value (cases.rs): the same latency and
//! failure mode go to the backends and to the simulated servers, and the proxy's configuration
//! is built from the same balancer and protections as the scenario's.
//!
//! Times are scaled down from the model's example (10 ms healthy, 1 s timeout) to 4 ms and
//! 400 ms so that a run takes about a minute; q = t_fail / t_ok stays 100 for a hanging server.
//!
//! E8 and E9 (tail.rs, only when named: `--experiments e8,e9`) are latency experiments under
//! open-loop load: percentiles with their intervals, measured against the simulation of what
//! the backends actually served and, for random placement, against queueing theory. E10
//! (e10.rs, only when named) checks `keel advise` against real traffic; E12 (fleet.rs, only when
//! named) measures a fleet of keel proxies on etcd; `--peers` puts NGINX, HAProxy and Envoy next
//! to keel (peers.rs).
//!
//! Every experiment has one shape, [`Experiment`] (experiment.rs): `keel lab` lists them
//! (cmd/lab.rs) and [`run`] drives each through the same loop.

pub mod answer;
mod cases;
mod compare;
pub mod e10;
mod experiment;
mod fleet;
pub mod inference;
mod measure;
mod peers;
pub mod queueing;
mod reliability;
mod report;
mod report_tail;
mod rows;
mod style;
pub mod tail;
pub mod tail_rows;
mod tail_run;

use std::cell::Cell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;

pub use cases::Timing;
pub use e10::E10;
pub use experiment::{Experiment, Lab, Planned};
pub use fleet::Fleet;
pub use inference::Inference;
pub use peers::Peers;
pub use reliability::Reliability;
pub use rows::Row;
pub use tail_run::TailRun;

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

/// Everything a lab run produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LabReport {
    /// What the run shows, from its own numbers: the answer first (the best strategy and
    /// protections, by how much, and the closed form that predicts it), then one finding per
    /// experiment.
    pub answer: Vec<answer::Finding>,
    /// One row per case of E1-E6B.
    pub rows: Vec<Row>,
    /// E8: one row per strategy, latency percentiles three ways (two without a closed form).
    pub tail_rows: Vec<tail_rows::LatencyRow>,
    /// E9: one row per strategy, the slowed server's share of calls measured and simulated.
    pub reaction_rows: Vec<tail_rows::ReactionRow>,
    /// The scaled times used.
    pub timing: Timing,
    /// The seed.
    pub seed: u64,
    /// Quick mode.
    pub quick: bool,
    /// Wall time of the whole run, seconds.
    pub wall_seconds: f64,
    /// The machine it ran on.
    pub machine: report::Machine,
    /// NGINX, HAProxy and Envoy next to keel (`--peers`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<peers::PeersReport>,
    /// E10: keel advise's top three configurations and the running one, predicted and measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e10: Option<e10::E10Report>,
    /// E12: a fleet of keel proxies on etcd, local against shared evidence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<fleet::FleetReport>,
    /// E13-E15: prefix-cache affinity in an inference pool, and vLLM Router and SMG.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference: Option<inference::InferenceReport>,
}

/// Runs the lab: every experiment with a non-empty plan run in turn on one runtime and one
/// progress bar, its rows moved into the report, then the findings of each; writes
/// `OUT/index.html` and `OUT/results.json`.
pub fn run(
    opts: &LabOptions,
    experiments: &mut [Box<dyn Experiment>],
) -> anyhow::Result<LabReport> {
    let started = Instant::now();
    let timing = Timing::default();
    for e in &opts.experiments {
        if !experiments.iter().any(|x| x.names().contains(&e.as_str())) {
            let allowed: Vec<&str> = experiments
                .iter()
                .flat_map(|x| x.names())
                .copied()
                .collect();
            return Err(crate::usage::UsageError(format!(
                "unknown experiment `{e}`; allowed: {}",
                allowed.join(", ")
            ))
            .into());
        }
    }
    let plans: Vec<Vec<Planned>> = experiments.iter().map(|e| e.plan()).collect();
    if plans.iter().all(Vec::is_empty) {
        return Err(crate::usage::UsageError(
            "no case left to run: check --experiments and --strategies".into(),
        )
        .into());
    }
    let total_requests: u64 = plans.iter().flatten().map(|p| p.requests).sum();
    let bar = opts.progress.then(|| {
        let bar = indicatif::ProgressBar::new(total_requests);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} requests  {msg}",
            )
            .expect("valid template"),
        );
        bar
    });

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the lab's runtime")?;
    let lab = Lab {
        runtime: &runtime,
        bar: bar.as_ref(),
        done: Cell::new(0),
        timing: &timing,
        seed: opts.seed,
        quick: opts.quick,
        out: &opts.out,
    };
    for (e, plan) in experiments.iter_mut().zip(&plans) {
        if plan.is_empty() {
            continue;
        }
        if let Some(bar) = &bar {
            bar.set_position(lab.done.get());
            bar.set_message(plan[0].what.clone());
        }
        e.run(&lab)?;
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    runtime.shutdown_timeout(Duration::from_secs(1));

    let mut report = LabReport {
        answer: Vec::new(),
        rows: Vec::new(),
        tail_rows: Vec::new(),
        reaction_rows: Vec::new(),
        timing,
        seed: opts.seed,
        quick: opts.quick,
        wall_seconds: 0.0,
        machine: report::Machine::detect(),
        peers: None,
        e10: None,
        fleet: None,
        inference: None,
    };
    for e in experiments.iter_mut() {
        e.rows(&mut report);
    }
    report.answer = experiments.iter().flat_map(|e| e.answer(&report)).collect();
    report.wall_seconds = started.elapsed().as_secs_f64();
    report::write(&report, experiments, &opts.out)?;
    Ok(report)
}

/// Prints a report for a terminal: what it shows first, then its tables (at most 100 columns
/// unless `wide`).
pub fn print_table(report: &LabReport, experiments: &[Box<dyn Experiment>], wide: bool) {
    report::print_answer(report);
    for e in experiments {
        e.print(report, wide);
    }
}

/// The `{"rows": [...]}` JSON document (also written as `results.json`).
pub fn results_json(report: &LabReport) -> serde_json::Value {
    report::results_json(report)
}
