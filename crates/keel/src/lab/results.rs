//! Everything a lab run produced, [`LabReport`]: below the experiments, which fill it in
//! (`Experiment::rows`) and read it (`Experiment::answer`, `print`, `html`), and made only of
//! their row types (rows.rs, tail_rows.rs, e10_rows.rs, fleet_rows.rs, peers/rows.rs,
//! inference/rows.rs, e16_rows.rs, e17_rows.rs, e18_rows.rs), so no experiment reads the file
//! that runs it.

use serde::Serialize;

use crate::lab::answer::Finding;
use crate::lab::cases::Timing;
use crate::lab::e10_rows::E10Report;
use crate::lab::e16_rows::E16Report;
use crate::lab::e17_rows::E17Report;
use crate::lab::e18_rows::E18Report;
use crate::lab::fleet_rows::FleetReport;
use crate::lab::inference::rows::InferenceReport;
use crate::lab::peers::rows::PeersReport;
use crate::lab::rows::Row;
use crate::lab::tail_rows::{LatencyRow, ReactionRow};

/// Everything a lab run produced.
#[derive(Debug, Clone, Serialize)]
pub struct LabReport {
    /// What the run shows, from its own numbers: the answer first (the best strategy and
    /// protections, by how much, and the closed form that predicts it), then one finding per
    /// experiment.
    pub answer: Vec<Finding>,
    /// One row per case of E1-E6B.
    pub rows: Vec<Row>,
    /// E8: one row per strategy, latency percentiles three ways (two without a closed form).
    pub tail_rows: Vec<LatencyRow>,
    /// E9: one row per strategy, the slowed server's share of calls measured and simulated.
    pub reaction_rows: Vec<ReactionRow>,
    /// The scaled times used.
    pub timing: Timing,
    /// The seed.
    pub seed: u64,
    /// Quick mode.
    pub quick: bool,
    /// Wall time of the whole run, seconds.
    pub wall_seconds: f64,
    /// The machine it ran on.
    pub machine: Machine,
    /// NGINX, HAProxy and Envoy next to keel (`--peers`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<PeersReport>,
    /// E10: keel advise's top three configurations and the running one, predicted and measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e10: Option<E10Report>,
    /// E12: a fleet of keel proxies on etcd, local against shared evidence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetReport>,
    /// E13-E15: prefix-cache affinity in an inference pool, and vLLM Router and SMG.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceReport>,
    /// E16: a fleet of routers under prefix-affinity, sharing nothing, signals or a key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e16: Option<E16Report>,
    /// E17: an affine engine fails (hang, 500, refuse) under prefix-affinity.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e17: Option<E17Report>,
    /// E18: Mooncake's conversation trace replayed through keel and the inference peers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub e18: Option<E18Report>,
}

/// The machine a report was made on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPUs available to the process.
    pub cpus: usize,
    /// CPU model.
    pub cpu_model: String,
    /// Operating system and kernel.
    pub os: String,
    /// keel's version.
    pub keel_version: String,
    /// The load average (1, 5 and 15 minutes) when the report was written: other work on the
    /// machine moves real-traffic latencies.
    pub load_average: [f64; 3],
}

impl Machine {
    pub(crate) fn detect() -> Machine {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Machine {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            os: format!("{} {kernel}", std::env::consts::OS),
            keel_version: env!("CARGO_PKG_VERSION").to_string(),
            load_average: load_average(),
        }
    }
}

/// /proc/loadavg's first three fields (zeros where there is none).
fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (o, v) in out.iter_mut().zip(text.split_whitespace()) {
        *o = v.parse().unwrap_or(0.0);
    }
    out
}
