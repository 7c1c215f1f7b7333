//! E1-E6B as one experiment: every case (cases.rs) measured over real sockets (measure.rs),
//! simulated, and put next to its closed form (rows.rs).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::lab::answer::{self, Finding};
use crate::lab::cases::{self, Case};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::measure;
use crate::lab::options::LabOptions;
use crate::lab::report;
use crate::lab::results::LabReport;
use crate::lab::rows::Row;

/// E1-E6B: the reliability experiments of docs/reliability.md.
pub struct Reliability {
    cases: Vec<Case>,
    rows: Vec<Row>,
}

impl Reliability {
    /// The selected cases (none when `--peers` is given without `--experiments`: then only the
    /// peers' rows run). An unknown name is the caller's to reject (`lab::run`).
    pub fn new(opts: &LabOptions) -> Self {
        let cases = if opts.peers.is_empty() || !opts.experiments.is_empty() {
            cases::plan(opts)
        } else {
            Vec::new()
        };
        Reliability {
            cases,
            rows: Vec::new(),
        }
    }
}

impl Experiment for Reliability {
    fn names(&self) -> &'static [&'static str] {
        &cases::NAMES
    }

    fn plan(&self) -> Vec<Planned> {
        self.cases
            .iter()
            .map(|c| Planned {
                what: c.describe(),
                requests: c.requests,
            })
            .collect()
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        for case in &self.cases {
            if let Some(bar) = lab.bar {
                bar.set_message(format!(
                    "{} {} {}",
                    case.experiment,
                    case.strategy,
                    case.failure.name()
                ));
            }
            let progress = Arc::new(AtomicU64::new(0));
            let ticker = lab.bar.cloned().map(|bar| {
                let progress = progress.clone();
                let base = lab.done.get();
                lab.runtime.spawn(async move {
                    loop {
                        bar.set_position(base + progress.load(Ordering::Relaxed));
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                })
            });
            let measured = lab
                .runtime
                .block_on(measure::measure(case, lab.timing, lab.seed, progress))
                .with_context(|| format!("measuring {}", case.describe()))?;
            if let Some(t) = ticker {
                t.abort();
            }
            lab.done.set(lab.done.get() + case.requests);
            let simulated = keel_model::sim::run(&case.scenario(lab.timing, lab.seed))
                .with_context(|| format!("simulating {}", case.describe()))?;
            self.rows
                .push(Row::new(case, measured, simulated, lab.timing));
        }
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.rows.append(&mut self.rows);
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        answer::reliability(&report.rows)
    }

    fn html(&self, report: &LabReport) -> String {
        report::reliability_html(report)
    }

    fn print(&self, report: &LabReport, wide: bool) {
        report::print_reliability_table(report, wide);
    }
}
