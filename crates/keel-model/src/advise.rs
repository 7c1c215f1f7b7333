//! `keel advise`'s reasoning, free of I/O: every strategy of keel-balance under three sets of
//! protections (none, keel proxy's defaults, outlier detection + retries + health checks),
//! and the running configuration, simulated on a fitted model with replications; ranked by
//! success, then p99, then p99.9, each with its 95 % interval; why the best wins, and the traps
//! the model shows.

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::{BalancerConfig, OutlierConfig, RetryBudgetConfig, StrategyKind, TieBreak};
use rayon::prelude::*;
use serde::Serialize;

use crate::fit::scenario::{scenario_toml, to_scenario, ScenarioOptions};
use crate::fit::FittedModel;
use crate::sim::{run_replication, HealthCheckConfig, RepStats, RetryConfig, Scenario, SimError};
use crate::stats::{student_t95, wilson95};

/// Success rates are compared at this resolution before latency decides (0.01 %): closer than
/// that, two configurations are as reliable as the simulation can tell at its sizes.
pub const SUCCESS_RESOLUTION: f64 = 1e-4;

/// A set of protections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protections {
    /// No retry, no outlier detection, no health checks (`[cluster.retry] attempts = 0`).
    None,
    /// What keel proxy does with no protection table: outlier detection with keel-balance's
    /// defaults and one retry within the budget.
    Defaults,
    /// Outlier detection (keel-balance's defaults), two retries, health checks every 5 s.
    Protected,
    /// The running configuration's own, when it is none of the above.
    Running,
}

impl Protections {
    /// The label shown in reports.
    pub fn label(self) -> &'static str {
        match self {
            Protections::None => "none",
            Protections::Defaults => "keel defaults (outlier, retry 1)",
            Protections::Protected => "outlier + retry 2 + health",
            Protections::Running => "as configured",
        }
    }
}

/// The configuration a cluster runs, as read from the proxy's TOML by the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct RunningConfig {
    /// Its balancer (strategy, options, outlier detection).
    pub balancer: BalancerConfig,
    /// `[cluster.retry] attempts`.
    pub retry_attempts: u32,
    /// The retry budget.
    pub retry_budget: RetryBudgetConfig,
    /// `[cluster.health_check]`: interval and thresholds (unhealthy, healthy).
    pub health_check: Option<(Duration, u32, u32)>,
    /// The per-try timeout in force.
    pub per_try_timeout: Duration,
    /// Endpoint weights by address.
    pub weights: Vec<(String, u32)>,
}

/// One simulated configuration.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Strategy.
    pub strategy: StrategyKind,
    /// Protections.
    pub protections: Protections,
    /// The scenario that runs it.
    pub scenario: Scenario,
    /// The running configuration.
    pub running: bool,
}

/// One row of the ranking (what `advice.json` holds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Ranked {
    /// Strategy name.
    pub strategy: String,
    /// Protections label.
    pub protections: String,
    /// The `[[cluster]]` settings that reproduce this configuration, ready to paste.
    pub cluster_toml: String,
    /// Predicted success: mean, 95 % low, 95 % high.
    pub success: [f64; 3],
    /// Predicted request p99 in ms: mean over replications and its 95 % interval.
    pub p99_ms: [f64; 3],
    /// Predicted p99.9 in ms.
    pub p999_ms: [f64; 3],
    /// Mean request latency in ms.
    pub mean_ms: f64,
    /// Share of tries each endpoint got, in the model's endpoint order.
    pub pick_shares: Vec<f64>,
    /// Retries per request.
    pub retries_per_request: f64,
    /// Whether this is the running configuration.
    pub running: bool,
}

/// The whole advice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    /// Best first.
    pub ranking: Vec<Ranked>,
    /// Index of the running configuration in `ranking`, when known.
    pub running: Option<usize>,
    /// Why the best wins, in sentences.
    pub why: Vec<String>,
    /// Traps the model shows, in sentences.
    pub traps: Vec<String>,
    /// The fitted model.
    pub model: FittedModel,
    /// The fitted scenario as an editable TOML file (the running configuration's strategy and
    /// protections, or round-robin with keel's defaults).
    #[serde(skip)]
    pub scenario_toml: String,
    /// Replications per configuration and measured requests per replication.
    pub replications: u32,
    /// Requests per replication.
    pub requests_per_replication: u64,
}

fn retry(attempts: u32, budget: RetryBudgetConfig) -> Option<RetryConfig> {
    (attempts > 0).then(|| RetryConfig {
        max_retries: attempts.min(crate::sim::scenario::MAX_RETRIES),
        budget,
    })
}

/// keel proxy's `[cluster.health_check]` defaults: every 5 s, 2 failures down, 2 passes up.
fn default_health() -> HealthCheckConfig {
    HealthCheckConfig {
        interval: Duration::from_secs(5),
        unhealthy_threshold: 2,
        healthy_threshold: 2,
    }
}

fn with_protections(mut sc: Scenario, p: Protections) -> Scenario {
    match p {
        Protections::None | Protections::Running => {}
        Protections::Defaults => {
            sc.retry = retry(1, RetryBudgetConfig::default());
            sc.clusters[0].balancer.outlier_detection = Some(OutlierConfig::default());
        }
        Protections::Protected => {
            sc.retry = retry(2, RetryBudgetConfig::default());
            sc.health_check = Some(default_health());
            sc.clusters[0].balancer.outlier_detection = Some(OutlierConfig::default());
        }
    }
    sc
}

/// Every strategy x {none, defaults, protected}, and the running configuration (marked; a
/// row of its own when it is none of those).
pub fn candidates(
    model: &FittedModel,
    opts: &ScenarioOptions,
    running: Option<&RunningConfig>,
) -> Vec<Candidate> {
    let mut opts = opts.clone();
    if let Some(r) = running {
        opts.weights = r.weights.clone();
        if model.timeout_ms.is_none() {
            opts.timeout = r.per_try_timeout;
        }
    }
    let running_scenario = running.map(|r| {
        let mut sc = to_scenario(model, &opts, r.balancer.clone());
        sc.retry = retry(r.retry_attempts, r.retry_budget.clone());
        sc.health_check = r.health_check.map(|(interval, u, h)| HealthCheckConfig {
            interval,
            unhealthy_threshold: u,
            healthy_threshold: h,
        });
        sc
    });
    let mut out = Vec::new();
    let mut matched = false;
    // orca-wrr is left out: the simulated servers send no ORCA reports, so it would be
    // weighted round-robin under another name.
    for strategy in StrategyKind::ALL
        .into_iter()
        .filter(|s| *s != StrategyKind::OrcaWrr)
    {
        for p in [
            Protections::None,
            Protections::Defaults,
            Protections::Protected,
        ] {
            let sc = with_protections(to_scenario(model, &opts, BalancerConfig::new(strategy)), p);
            let is_running = running_scenario
                .as_ref()
                .is_some_and(|r| same_config(r, &sc));
            matched |= is_running;
            out.push(Candidate {
                strategy,
                protections: p,
                scenario: sc,
                running: is_running,
            });
        }
    }
    if let (Some(sc), false) = (running_scenario, matched) {
        out.push(Candidate {
            strategy: sc.clusters[0].balancer.strategy,
            protections: Protections::Running,
            scenario: sc,
            running: true,
        });
    }
    // Every candidate keeps the same seed: the configurations are compared on the same
    // arrivals and latency draws as far as their picks allow (common random numbers).
    for c in &mut out {
        c.scenario.label = format!("{} / {}", c.strategy.name(), c.protections.label());
    }
    out
}

/// Same strategy options, protections and retries (seeds aside).
fn same_config(a: &Scenario, b: &Scenario) -> bool {
    let (ba, bb) = (&a.clusters[0].balancer, &b.clusters[0].balancer);
    ba.strategy == bb.strategy
        && ba.options == bb.options
        && ba.outlier_detection == bb.outlier_detection
        && ba.slow_start == bb.slow_start
        && a.retry == b.retry
        && a.health_check == b.health_check
}

/// The `[[cluster]]` table that reproduces a candidate in keel proxy's configuration.
/// `unseen` are endpoints of the running configuration the log never tried (with their
/// weights): kept in the list, so that pasting the table removes no endpoint, though the model
/// could not include them.
pub fn cluster_toml(model: &FittedModel, c: &Candidate, unseen: &[(String, u32)]) -> String {
    let sc = &c.scenario;
    let cl = &sc.clusters[0];
    let mut t = String::new();
    let _ = writeln!(t, "[[cluster]]\nname = \"{}\"", model.cluster);
    let eps: Vec<String> = cl
        .endpoints
        .iter()
        .map(|e| (e.name.as_str(), e.weight))
        .chain(unseen.iter().map(|(n, w)| (n.as_str(), *w)))
        .map(|(name, weight)| {
            if weight == 1 {
                format!("{{ address = \"{name}\" }}")
            } else {
                format!("{{ address = \"{name}\", weight = {weight} }}")
            }
        })
        .collect();
    let _ = writeln!(t, "endpoints = [{}]", eps.join(", "));
    let b = &cl.balancer;
    let _ = writeln!(t, "strategy = \"{}\"", b.strategy.name());
    if b.options.tie_break == TieBreak::LowestIndex {
        let _ = writeln!(t, "tie_break = \"lowest-index\"");
    }
    // keel proxy turns outlier detection on by default: a configuration without it says so.
    if b.outlier_detection.is_none() {
        let _ = writeln!(t, "outlier_detection = false");
    }
    let timeout = humantime::format_duration(sc.timeout);
    let _ = writeln!(t, "\n[cluster.retry]");
    match &sc.retry {
        None => {
            let _ = writeln!(t, "attempts = 0\nper_try_timeout = \"{timeout}\"");
        }
        Some(r) => {
            let _ = writeln!(
                t,
                "attempts = {}\nper_try_timeout = \"{timeout}\"",
                r.max_retries
            );
            if r.budget != RetryBudgetConfig::default() {
                let _ = writeln!(
                    t,
                    "budget_percent = {}\nmin_retries_per_second = {}\nbudget_window = \"{}\"",
                    r.budget.budget_percent,
                    r.budget.min_retries_per_second,
                    humantime::format_duration(r.budget.window)
                );
            }
        }
    }
    if let Some(o) = &b.outlier_detection {
        let _ = writeln!(
            t,
            "\n[cluster.outlier_detection]\nconsecutive_failures = {}\nbase_ejection_time = \"{}\"\nmax_ejection_percent = {}",
            o.consecutive_failures,
            humantime::format_duration(o.base_ejection_time),
            o.max_ejection_percent
        );
    }
    if let Some(h) = &sc.health_check {
        let _ = writeln!(
            t,
            "\n[cluster.health_check]\ninterval = \"{}\"\nunhealthy_threshold = {}\nhealthy_threshold = {}",
            humantime::format_duration(h.interval),
            h.unhealthy_threshold,
            h.healthy_threshold
        );
    }
    t
}

fn interval(xs: &[f64]) -> [f64; 3] {
    let mean = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    match student_t95(xs) {
        Some((lo, hi)) => [mean, lo.max(0.0), hi],
        None => [mean, mean, mean],
    }
}

fn summarise(
    model: &FittedModel,
    c: &Candidate,
    reps: &[RepStats],
    unseen: &[(String, u32)],
) -> Ranked {
    let requests: u64 = reps.iter().map(|r| r.requests).sum();
    let successes: u64 = reps.iter().map(|r| r.successes).sum();
    let success = successes as f64 / requests.max(1) as f64;
    let (wl, wh) = wilson95(successes, requests);
    let rates: Vec<f64> = reps
        .iter()
        .map(|r| r.successes as f64 / r.requests.max(1) as f64)
        .collect();
    let (lo, hi) = match student_t95(&rates) {
        Some((tl, th)) => (wl.min(tl).max(0.0), wh.max(th).min(1.0)),
        None => (wl, wh),
    };
    let q = |p: f64| -> Vec<f64> {
        reps.iter()
            .map(|r| r.latency.quantile_ns(p) / 1e6)
            .collect()
    };
    let m = c.scenario.clusters[0].servers as usize;
    let mut picks = vec![0u64; m];
    for r in reps {
        for (a, b) in picks.iter_mut().zip(&r.focus_picks) {
            *a += b;
        }
    }
    let total: u64 = picks.iter().sum();
    Ranked {
        strategy: c.strategy.name().to_string(),
        protections: c.protections.label().to_string(),
        cluster_toml: cluster_toml(model, c, unseen),
        success: [success, lo, hi],
        p99_ms: interval(&q(0.99)),
        p999_ms: interval(&q(0.999)),
        mean_ms: reps.iter().map(|r| r.latency_sum_ns).sum::<u128>() as f64
            / requests.max(1) as f64
            / 1e6,
        pick_shares: picks
            .iter()
            .map(|&p| p as f64 / total.max(1) as f64)
            .collect(),
        retries_per_request: reps.iter().map(|r| r.retries).sum::<u64>() as f64
            / requests.max(1) as f64,
        running: c.running,
    }
}

/// Orders best first: success (at [`SUCCESS_RESOLUTION`]), then p99, then p99.9.
pub fn rank(rows: &mut [Ranked]) {
    let key = |r: &Ranked| (r.success[0] / SUCCESS_RESOLUTION).floor() as i64;
    rows.sort_by(|a, b| {
        key(b)
            .cmp(&key(a))
            .then(a.p99_ms[0].total_cmp(&b.p99_ms[0]))
            .then(a.p999_ms[0].total_cmp(&b.p999_ms[0]))
    });
}

/// Simulates every candidate (all replications as one parallel job list) and ranks them.
/// `progress` receives counts of completed measured requests, from any thread.
pub fn advise(
    model: &FittedModel,
    opts: &ScenarioOptions,
    running: Option<&RunningConfig>,
    source: &str,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Advice, SimError> {
    let cands = candidates(model, opts, running);
    for c in &cands {
        c.scenario
            .validate()
            .map_err(|e| SimError::Invalid(format!("{}: {e}", c.scenario.label)))?;
    }
    let jobs: Vec<(usize, u32)> = cands
        .iter()
        .enumerate()
        .flat_map(|(i, c)| (0..c.scenario.replications).map(move |r| (i, r)))
        .collect();
    let reps: Vec<RepStats> = jobs
        .par_iter()
        .map(|&(i, r)| run_replication(&cands[i].scenario, r, progress))
        .collect::<Result<_, _>>()?;
    // Endpoints configured but never tried in the window (unhealthy, ejected, or added
    // since): nothing to fit them from.
    let unseen: Vec<(String, u32)> = running
        .map(|r| {
            r.weights
                .iter()
                .filter(|(n, _)| !model.endpoints.iter().any(|e| e.name == *n))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let mut model = model.clone();
    if !unseen.is_empty() {
        let names: Vec<&str> = unseen.iter().map(|(n, _)| n.as_str()).collect();
        model.notes.push(format!(
            "configured but never tried in the log: {} (unhealthy or ejected the whole time?); not in the model, which predicts the cluster without them; kept in every cluster_toml",
            names.join(", ")
        ));
    }
    let model = &model;
    let mut rows = Vec::with_capacity(cands.len());
    let mut at = 0;
    for c in &cands {
        let n = c.scenario.replications as usize;
        rows.push(summarise(model, c, &reps[at..at + n], &unseen));
        at += n;
    }
    rank(&mut rows);
    let running_at = rows.iter().position(|r| r.running);
    let why = explain(model, &rows, running_at);
    let traps = traps(model, &rows);
    let shown = cands
        .iter()
        .find(|c| c.running)
        .or_else(|| {
            cands.iter().find(|c| {
                c.strategy == StrategyKind::RoundRobin && c.protections == Protections::Defaults
            })
        })
        .expect("round-robin with defaults is always a candidate");
    Ok(Advice {
        scenario_toml: scenario_toml(model, &shown.scenario, source),
        ranking: rows,
        running: running_at,
        why,
        traps,
        model: model.clone(),
        replications: opts.replications,
        requests_per_replication: opts.requests,
    })
}

fn pct(x: f64) -> String {
    format!("{:.2} %", x * 100.0)
}

fn ci(x: &[f64; 3]) -> String {
    format!(
        "{:.2} % [{:.2}, {:.2}]",
        x[0] * 100.0,
        x[1] * 100.0,
        x[2] * 100.0
    )
}

/// The endpoint that fails most (all modes), if any fails at all.
fn worst_endpoint(model: &FittedModel) -> Option<(usize, f64)> {
    model
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let f = &e.failures;
            (i, f.error.share + f.timeout.share + f.reset.share)
        })
        .filter(|&(_, s)| s > 0.0)
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

fn explain(model: &FittedModel, rows: &[Ranked], running: Option<usize>) -> Vec<String> {
    let mut why = Vec::new();
    let Some(best) = rows.first() else {
        return why;
    };
    let baseline = running
        .map(|i| (&rows[i], "the running configuration"))
        .or_else(|| {
            rows.iter()
                .find(|r| {
                    r.strategy == "round-robin" && r.protections == Protections::Defaults.label()
                })
                .map(|r| (r, "keel's default configuration"))
        });
    let mut s = format!(
        "Best: {} with {}: success {}, p99 {:.1} ms [{:.1}, {:.1}], p99.9 {:.1} ms.",
        best.strategy,
        best.protections,
        ci(&best.success),
        best.p99_ms[0],
        best.p99_ms[1],
        best.p99_ms[2],
        best.p999_ms[0]
    );
    if let Some((b, name)) = baseline {
        if std::ptr::eq(b, best) {
            s.push_str(&format!(" It is {name}."));
        } else {
            let overlap = best.success[1] <= b.success[2] && b.success[1] <= best.success[2];
            s.push_str(&format!(
                " Against {name}, {} with {}: success {}, p99 {:.1} ms{}.",
                b.strategy,
                b.protections,
                ci(&b.success),
                b.p99_ms[0],
                if overlap {
                    "; the success intervals overlap, so the latency decides"
                } else {
                    ""
                }
            ));
        }
        why.push(s);
        if let Some((w, share)) = worst_endpoint(model) {
            let name = &model.endpoints[w].name;
            why.push(format!(
                "{name} fails {} of its tries. {} gives it {} of the tries (retries included), {} gives it {}; retries per request: {:.3} against {:.3}.",
                pct(share),
                best.strategy,
                pct(best.pick_shares[w]),
                b.strategy,
                pct(b.pick_shares[w]),
                best.retries_per_request,
                b.retries_per_request
            ));
        }
        if let Some(slow) = model
            .endpoints
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.latency.mean_ms.total_cmp(&b.1.latency.mean_ms))
        {
            let fastest = model
                .endpoints
                .iter()
                .map(|e| e.latency.mean_ms)
                .fold(f64::INFINITY, f64::min);
            if slow.1.latency.mean_ms > 1.5 * fastest || slow.1.capacity.is_some() {
                why.push(format!(
                    "{} is the slowest ({:.1} ms mean{}): {} gives it {} of the tries, {} {}.",
                    slow.1.name,
                    slow.1.latency.mean_ms,
                    slow.1.capacity.as_ref().map_or(String::new(), |c| format!(
                        ", about {} calls at once",
                        c.concurrency
                    )),
                    best.strategy,
                    pct(best.pick_shares[slow.0]),
                    b.strategy,
                    pct(b.pick_shares[slow.0])
                ));
            }
        }
    } else {
        why.push(s);
    }
    why
}

fn traps(model: &FittedModel, rows: &[Ranked]) -> Vec<String> {
    let mut out = Vec::new();
    let m = model.endpoints.len();
    let find = |strategy: &str, p: Protections| {
        rows.iter()
            .find(|r| r.strategy == strategy && r.protections == p.label())
    };
    let mut ok_ms: Vec<f64> = model.endpoints.iter().map(|e| e.latency.p50_ms).collect();
    ok_ms.sort_by(f64::total_cmp);
    let typical = ok_ms.get(m / 2).copied().unwrap_or(0.0);
    // E4: an endpoint that fails fast looks idle (least-connections) or fast (least-time).
    for (i, e) in model.endpoints.iter().enumerate() {
        let f = &e.failures;
        let fast = f.error.share >= 0.02 && f.error_ms.is_some_and(|t| t < 0.5 * typical);
        if !fast {
            continue;
        }
        let Some(rr) = find("round-robin", Protections::None) else {
            continue;
        };
        for s in ["least-connections", "least-time"] {
            let Some(r) = find(s, Protections::None) else {
                continue;
            };
            if r.pick_shares[i] > 1.25 * rr.pick_shares[i] && r.success[0] < rr.success[0] {
                out.push(format!(
                    "{s} without protections sends {} of the tries to {}, which answers {} of its calls with an error in {:.2} ms: a fast failure frees its place at once (and looks fast), so the strategy is drawn to it (experiment E4). Success {} against round-robin's {}.",
                    pct(r.pick_shares[i]),
                    e.name,
                    pct(f.error.share),
                    f.error_ms.unwrap_or(0.0),
                    ci(&r.success),
                    ci(&rr.success)
                ));
            }
        }
    }
    // E5: at low concurrency least-connections is mostly ties.
    let per_endpoint = model.arrival.mean_in_flight / m.max(1) as f64;
    if m > 1 && per_endpoint < 1.0 {
        out.push(format!(
            "At this load ({:.2} requests in flight on average over {m} endpoints) least-connections mostly compares zeros: keel breaks the ties at random (its default), but with tie_break = \"lowest-index\", or as a client-side balancer that sees only its own few calls, it sends nearly everything to the first endpoint (experiment E5).",
            model.arrival.mean_in_flight
        ));
    }
    if model.arrival.dispersion.is_finite() && model.arrival.dispersion > 2.0 {
        out.push(format!(
            "Arrivals are burstier than the simulation's Poisson stream (index of dispersion {:.1} per {:.3} s; Poisson: 1): queueing in bursts is not in the model, so predicted p99 is optimistic where endpoints have a capacity.",
            model.arrival.dispersion, model.arrival.window_s
        ));
    }
    out
}
