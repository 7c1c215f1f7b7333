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

pub mod answer;
mod cases;
mod compare;
pub mod e10;
mod measure;
mod peers;
pub mod queueing;
mod report;
mod report_tail;
mod rows;
mod style;
pub mod tail;
pub mod tail_rows;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;

pub use cases::Timing;
pub use rows::Row;

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
}

/// Runs the lab: every selected case measured, simulated and computed; writes
/// `OUT/index.html` and `OUT/results.json`.
pub fn run(opts: &LabOptions) -> anyhow::Result<LabReport> {
    let started = Instant::now();
    let timing = Timing::default();
    let peers = peers::parse(&opts.peers).map_err(crate::usage::UsageError)?;
    // `--peers` alone runs the peers' rows only; with `--experiments`, both.
    let cases = if peers.is_empty() || !opts.experiments.is_empty() {
        cases::plan(opts)?
    } else {
        Vec::new()
    };
    let (e8, e9) = cases::tail_selected(opts);
    let tail_cases = tail::plan(e8, e9, opts.quick, &opts.strategies);
    if cases.is_empty() && tail_cases.is_empty() && peers.is_empty() {
        return Err(crate::usage::UsageError(
            "no case left to run: check --experiments and --strategies".into(),
        )
        .into());
    }
    let total_requests: u64 = cases.iter().map(|c| c.requests).sum::<u64>()
        + tail_cases.iter().map(|c| c.requests()).sum::<u64>()
        + peers::total_requests(&peers, opts.quick, &opts.strategies);
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
        rows.push(Row::new(case, measured, simulated, &timing));
    }
    let base = done_before.load(Ordering::Relaxed);
    let (tail_rows, reaction_rows) =
        run_tail_cases(&runtime, &tail_cases, opts.seed, bar.as_ref(), base)?;
    let peers = (!peers.is_empty())
        .then(|| {
            peers::run(
                &runtime,
                &peers,
                opts.quick,
                &opts.strategies,
                opts.seed,
                &timing,
                &|what, done| {
                    if let Some(bar) = &bar {
                        bar.inc(done);
                        if !what.is_empty() {
                            bar.set_message(what.to_string());
                        }
                    }
                },
            )
        })
        .transpose()?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    runtime.shutdown_timeout(Duration::from_secs(1));

    let report = LabReport {
        answer: answer::findings(&rows, &tail_rows, &reaction_rows),
        rows,
        tail_rows,
        reaction_rows,
        timing,
        seed: opts.seed,
        quick: opts.quick,
        wall_seconds: started.elapsed().as_secs_f64(),
        machine: report::Machine::detect(),
        peers,
    };
    report::write(&report, &opts.out)?;
    Ok(report)
}

/// Prints a report for a terminal: what it shows first, then its tables (at most 100 columns
/// unless `wide`).
pub fn print_table(report: &LabReport, wide: bool) {
    report::print_answer(report);
    report::print_table(report, wide);
}

/// The `{"rows": [...]}` JSON document (also written as `results.json`).
pub fn results_json(report: &LabReport) -> serde_json::Value {
    report::results_json(report)
}

/// E8 and E9: every case measured, then simulated. The bar moves within a case: its arrivals
/// follow their schedule once the first is due, so the requests sent so far and the seconds
/// left are known from the clock.
fn run_tail_cases(
    runtime: &tokio::runtime::Runtime,
    cases: &[tail::TailCase],
    seed: u64,
    bar: Option<&indicatif::ProgressBar>,
    mut base: u64,
) -> anyhow::Result<(Vec<tail_rows::LatencyRow>, Vec<tail_rows::ReactionRow>)> {
    let mut latency = Vec::new();
    let mut reaction = Vec::new();
    for case in cases {
        let sending: Arc<OnceLock<Instant>> = Arc::new(OnceLock::new());
        let ticker = bar.cloned().map(|bar| {
            let (sending, total, rate, label) = (
                sending.clone(),
                case.requests(),
                case.rate(),
                case.describe(),
            );
            let span = total as f64 / rate;
            runtime.spawn(async move {
                loop {
                    match sending.get() {
                        None => {
                            bar.set_position(base);
                            bar.set_message(format!("{label}: starting backends"));
                        }
                        Some(t0) => {
                            let elapsed = t0.elapsed().as_secs_f64();
                            let sent = ((rate * elapsed) as u64).min(total);
                            bar.set_position(base + sent);
                            bar.set_message(format!(
                                "{label}: {sent} of {total} sent, {:.0} s left",
                                (span - elapsed).max(0.0)
                            ));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        });
        let measured = runtime.block_on(tail::measure(case, seed, &sending));
        if let Some(t) = ticker {
            t.abort();
        }
        let m = measured.with_context(|| format!("measuring {}", case.describe()))?;
        base += case.requests();
        if let Some(bar) = bar {
            bar.set_position(base);
            bar.set_message(format!("{}: simulating its twin", case.describe()));
        }
        let sim = keel_model::sim::run(&case.scenario(&m, seed))
            .with_context(|| format!("simulating {}", case.describe()))?;
        if case.step.is_some() {
            reaction.push(tail_rows::reaction_row(case, &m, &sim));
        } else {
            latency.push(tail_rows::latency_row(case, &m, &sim));
        }
    }
    Ok((latency, reaction))
}
