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
//! the backends actually served and, for random placement, against queueing theory.

mod cases;
pub mod e10;
mod measure;
pub mod queueing;
mod report;
mod report_tail;
pub mod tail;
pub mod tail_rows;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;

pub use cases::Timing;
pub use report::Row;

/// What to run and where to write the report.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Fewer experiments and requests: a first look in under 20 s.
    pub quick: bool,
    /// Experiments to run (e1..e6b, e8, e9); empty: the default set (e1..e6b; quick: e1, e2,
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
}

/// Everything a lab run produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LabReport {
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
}

/// Runs the lab: every selected case measured, simulated and computed; writes
/// `OUT/index.html` and `OUT/results.json`.
pub fn run(opts: &LabOptions) -> anyhow::Result<LabReport> {
    let started = Instant::now();
    let timing = Timing::default();
    let cases = cases::plan(opts)?;
    let (e8, e9) = cases::tail_selected(opts);
    let tail_cases = tail::plan(e8, e9, opts.quick, &opts.strategies);
    if cases.is_empty() && tail_cases.is_empty() {
        return Err(crate::cmd::UsageError(
            "no case left to run: check --experiments and --strategies".into(),
        )
        .into());
    }
    let total_requests: u64 = cases.iter().map(|c| c.requests).sum::<u64>()
        + tail_cases.iter().map(|c| c.requests()).sum::<u64>();
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
    let mut rows = Vec::with_capacity(cases.len());
    let done_before = Arc::new(AtomicU64::new(0));
    for case in &cases {
        if let Some(bar) = &bar {
            bar.set_message(format!(
                "{} {} {}",
                case.experiment,
                case.strategy,
                case.failure.name()
            ));
        }
        let progress = Arc::new(AtomicU64::new(0));
        let ticker = bar.clone().map(|bar| {
            let progress = progress.clone();
            let base = done_before.load(Ordering::Relaxed);
            runtime.spawn(async move {
                loop {
                    bar.set_position(base + progress.load(Ordering::Relaxed));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        });
        let measured = runtime
            .block_on(measure::measure(case, &timing, opts.seed, progress))
            .with_context(|| format!("measuring {}", case.describe()))?;
        if let Some(t) = ticker {
            t.abort();
        }
        done_before.fetch_add(case.requests, Ordering::Relaxed);
        let simulated = keel_model::sim::run(&case.scenario(&timing, opts.seed))
            .with_context(|| format!("simulating {}", case.describe()))?;
        rows.push(Row::new(case, measured, simulated));
    }
    let (tail_rows, reaction_rows) = tail::run_cases(&runtime, &tail_cases, opts.seed, &|case| {
        if let Some(bar) = &bar {
            bar.set_position(done_before.load(Ordering::Relaxed));
            bar.set_message(case.describe());
        }
        done_before.fetch_add(case.requests(), Ordering::Relaxed);
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    runtime.shutdown_timeout(Duration::from_secs(1));

    let report = LabReport {
        rows,
        tail_rows,
        reaction_rows,
        timing,
        seed: opts.seed,
        quick: opts.quick,
        wall_seconds: started.elapsed().as_secs_f64(),
        machine: report::Machine::detect(),
    };
    report::write(&report, &opts.out)?;
    Ok(report)
}

/// Prints the table of a report.
pub fn print_table(report: &LabReport) {
    report::print_table(report);
}

/// The `{"rows": [...]}` JSON document (also written as `results.json`).
pub fn results_json(report: &LabReport) -> serde_json::Value {
    report::results_json(report)
}
