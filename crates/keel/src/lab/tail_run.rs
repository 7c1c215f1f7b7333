//! E8 and E9 as one experiment: every case (tail.rs) measured under open-loop load, then its
//! simulator twin run on what the backends served, then its row (tail_rows.rs).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::lab::answer::{self, Finding};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::options::LabOptions;
use crate::lab::report_tail;
use crate::lab::results::LabReport;
use crate::lab::tail::{self, TailCase};
use crate::lab::tail_rows::{self, LatencyRow, ReactionRow};

/// The latency experiments' names: run only when named, never by default.
pub const NAMES: [&str; 2] = ["e8", "e9"];

/// E8 (tail latency under load) and E9 (reaction to a server slowed and back).
pub struct TailRun {
    cases: Vec<TailCase>,
    latency: Vec<LatencyRow>,
    reaction: Vec<ReactionRow>,
}

impl TailRun {
    /// The cases of E8 and E9 when named in `--experiments`.
    pub fn new(opts: &LabOptions) -> Self {
        let named = |e: &str| opts.experiments.iter().any(|x| x == e);
        TailRun {
            cases: tail::plan(named("e8"), named("e9"), opts.quick, &opts.strategies),
            latency: Vec::new(),
            reaction: Vec::new(),
        }
    }
}

impl Experiment for TailRun {
    fn names(&self) -> &'static [&'static str] {
        &NAMES
    }

    fn plan(&self) -> Vec<Planned> {
        self.cases
            .iter()
            .map(|c| Planned {
                what: c.describe(),
                requests: c.requests(),
            })
            .collect()
    }

    /// Every case measured, then simulated. The bar moves within a case: its arrivals follow
    /// their schedule once the first is due, so the requests sent so far and the seconds left
    /// are known from the clock.
    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        for case in &self.cases {
            let base = lab.done.get();
            let sending: Arc<OnceLock<Instant>> = Arc::new(OnceLock::new());
            let ticker = lab.bar.cloned().map(|bar| {
                let (sending, total, rate, label) = (
                    sending.clone(),
                    case.requests(),
                    case.rate(),
                    case.describe(),
                );
                let span = total as f64 / rate;
                lab.runtime.spawn(async move {
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
            let measured = lab
                .runtime
                .block_on(tail::measure(case, lab.seed, &sending));
            if let Some(t) = ticker {
                t.abort();
            }
            let m = measured.with_context(|| format!("measuring {}", case.describe()))?;
            lab.advance(case.requests());
            if let Some(bar) = lab.bar {
                bar.set_message(format!("{}: simulating its twin", case.describe()));
            }
            let sim = keel_model::sim::run(&case.scenario(&m, lab.seed))
                .with_context(|| format!("simulating {}", case.describe()))?;
            if case.step.is_some() {
                self.reaction.push(tail_rows::reaction_row(case, &m, &sim));
            } else {
                self.latency.push(tail_rows::latency_row(case, &m, &sim));
            }
        }
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.tail_rows.append(&mut self.latency);
        report.reaction_rows.append(&mut self.reaction);
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        answer::latency(&report.tail_rows, &report.reaction_rows)
    }

    fn html(&self, report: &LabReport) -> String {
        report_tail::html(report)
    }

    fn print(&self, report: &LabReport, wide: bool) {
        report_tail::print_tables(report, wide);
    }
}
