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
//! named) measures a fleet of keel proxies on etcd; E13-E15 (inference/), E16 (e16.rs, a fleet
//! of inference routers), E17 (e17.rs, an affine inference engine failing) and E18 (e18.rs, a
//! real trace replayed) only when named;
//! `--peers` puts NGINX, HAProxy and Envoy next to keel (peers.rs).
//!
//! Every experiment has one shape, [`Experiment`] (experiment.rs): `keel lab` lists them
//! (cmd/lab.rs) and [`run`] drives each through the same loop.

pub mod answer;
mod cases;
mod compare;
pub mod e10;
mod e10_rows;
mod e16;
mod e16_rows;
mod e17;
mod e17_rows;
mod e18;
mod e18_rows;
mod experiment;
mod fleet;
mod fleet_rows;
pub mod inference;
mod measure;
mod options;
mod peers;
pub mod queueing;
mod reliability;
mod report;
mod report_tail;
mod results;
mod rotation;
mod rows;
mod style;
pub mod tail;
pub mod tail_rows;
mod tail_run;

use std::cell::Cell;
use std::time::{Duration, Instant};

use anyhow::Context;

pub use cases::Timing;
pub use e10::E10;
pub use e16::E16;
pub use e17::E17;
pub use e18::E18;
pub use experiment::{Experiment, Lab, Planned};
pub use fleet::Fleet;
pub use inference::Inference;
pub use options::LabOptions;
pub use peers::Peers;
pub use reliability::Reliability;
pub use results::LabReport;
pub use tail_run::TailRun;

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
        machine: results::Machine::detect(),
        peers: None,
        e10: None,
        fleet: None,
        inference: None,
        e16: None,
        e17: None,
        e18: None,
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
