//! `keel advise`'s reasoning, free of I/O: every strategy of keel-balance under three sets of
//! protections (none, keel proxy's defaults, outlier detection + retries + health checks),
//! and the running configuration, simulated on a fitted model with replications; ranked by
//! success, then p99, then p99.9, each with its 95 % interval, except that configurations whose
//! success intervals overlap the best's are a tie, broken by more protection first (see
//! [`protection_of`]); the answer in words, why the best wins, and the traps the model shows.

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::{BalancerConfig, RetryBudgetConfig, StrategyKind, TieBreak};
use rayon::prelude::*;
use serde::Serialize;

use crate::fit::scenario::{scenario_toml, to_scenario, ScenarioOptions};
use crate::fit::FittedModel;
use crate::sim::{run_replication, HealthCheckConfig, RepStats, RetryConfig, Scenario, SimError};
use crate::stats::{student_t95, wilson95};

mod peers;
mod terms;
pub use peers::Balancer;
pub use terms::{human, Protections};

/// Success rates are compared at this resolution before latency decides (0.01 %): closer than
/// that, two configurations are as reliable as the simulation can tell at its sizes.
pub const SUCCESS_RESOLUTION: f64 = 1e-4;

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
    /// The strategy as the balancer spells it.
    pub native: String,
    /// The protections in the balancer's words.
    pub label: String,
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
    /// How much protection it has, compared in this order (more first): how many of outlier
    /// detection, retries and health checks are on, then retries allowed per request.
    pub protection: [u32; 2],
    /// Its success tier: 0 when its success interval overlaps the best's (tied with it),
    /// 1 for the next group that overlaps among themselves, and so on.
    pub tier: u32,
    /// keel-balance's strategy that simulates it (the same as `strategy` for keel).
    pub simulated: String,
    /// For another balancer: the recommendation in its configuration language (for keel,
    /// `cluster_toml`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub config: String,
}

impl Ranked {
    /// The settings to paste, in the balancer's own language.
    pub fn paste(&self) -> &str {
        if self.config.is_empty() {
            &self.cluster_toml
        } else {
            &self.config
        }
    }
}

/// The whole advice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Advice {
    /// Best first.
    pub ranking: Vec<Ranked>,
    /// Index of the running configuration in `ranking`, when known.
    pub running: Option<usize>,
    /// The answer in a few sentences: what to run, by how much it differs from the running (or
    /// keel's default) configuration, and why; says when it is a tie.
    pub answer: String,
    /// How many configurations tie with the best on success (itself included).
    pub tied: usize,
    /// Whose log and configuration language.
    pub balancer: Balancer,
    /// What that balancer's configuration cannot express, and where the simulation only
    /// approximates its rules.
    pub limits: Vec<String>,
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

/// What `keel advise` knows of the running configuration, beyond [`RunningConfig`]'s numbers.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The running configuration, when `--config` gives it.
    pub running: Option<RunningConfig>,
    /// keel proxy's configuration file as written: each row's `cluster_toml` is then the
    /// running `[[cluster]]` table with only the keys that row changes rewritten (comments,
    /// timeouts, health check, discovery, endpoints and every other key stay).
    pub config_text: Option<String>,
    /// The cluster's `request_timeout` when its per-try timeout is derived from it (no
    /// `per_try_timeout`): each candidate then gets `request_timeout / (attempts + 1)`, as the
    /// proxy would with that candidate's retries.
    pub request_timeout: Option<Duration>,
    /// Whose strategies and protections to rank (keel's unless the log is another's).
    pub balancer: Balancer,
}

fn with_protections(mut sc: Scenario, p: Protections, running: Option<&RunningConfig>) -> Scenario {
    // Where the running configuration has a protection's table, a set that turns it on keeps
    // that table's settings (what pasting the row would run); otherwise keel's defaults.
    let outlier = running
        .and_then(|r| r.balancer.outlier_detection.clone())
        .unwrap_or_default();
    let budget = running.map_or_else(RetryBudgetConfig::default, |r| r.retry_budget.clone());
    let health =
        running
            .and_then(|r| r.health_check)
            .map_or_else(default_health, |(interval, u, h)| HealthCheckConfig {
                interval,
                unhealthy_threshold: u,
                healthy_threshold: h,
            });
    match p {
        Protections::None | Protections::Running => {}
        Protections::Defaults => {
            sc.retry = retry(1, budget);
            sc.clusters[0].balancer.outlier_detection = Some(outlier);
        }
        Protections::Protected => {
            sc.retry = retry(2, budget);
            sc.health_check = Some(health);
            sc.clusters[0].balancer.outlier_detection = Some(outlier);
        }
    }
    sc
}

/// The protection order (more first, compared as an array): how many of outlier detection,
/// retries and health checks are on, then the retries allowed per request. `none` is `[0, 0]`,
/// keel's defaults `[2, 1]`, outlier + retry 2 + health `[3, 2]`.
pub fn protection_of(sc: &Scenario) -> [u32; 2] {
    let retries = sc.retry.as_ref().map_or(0, |r| r.max_retries);
    let on = u32::from(sc.clusters[0].balancer.outlier_detection.is_some())
        + u32::from(retries > 0)
        + u32::from(sc.health_check.is_some());
    [on, retries]
}

/// Every strategy x {none, defaults, protected}, and the running configuration (marked; a
/// row of its own when it is none of those).
pub fn candidates(
    model: &FittedModel,
    opts: &ScenarioOptions,
    running: Option<&RunningConfig>,
) -> Vec<Candidate> {
    candidates_in(
        model,
        opts,
        &Context {
            running: running.cloned(),
            ..Context::default()
        },
    )
}

/// [`candidates`] with the whole context (per-candidate per-try timeouts).
pub fn candidates_in(model: &FittedModel, opts: &ScenarioOptions, ctx: &Context) -> Vec<Candidate> {
    if ctx.balancer != Balancer::Keel {
        return peer_candidates(model, opts, ctx.balancer);
    }
    let running = ctx.running.as_ref();
    let mut opts = opts.clone();
    if let Some(r) = running {
        opts.weights = r.weights.clone();
        if model.timeout_ms.is_none() {
            opts.timeout = r.per_try_timeout;
        }
    }
    // With a derived per-try timeout, a candidate with other retries has another per-try
    // timeout in the proxy; the log's own timeouts are the running configuration's.
    let timeout_for = |sc: &mut Scenario| {
        if let Some(rt) = ctx.request_timeout {
            let attempts = sc.retry.as_ref().map_or(0, |r| r.max_retries);
            sc.timeout = rt / (attempts + 1);
        }
    };
    let running_scenario = running.map(|r| {
        let mut sc = to_scenario(model, &opts, r.balancer.clone());
        sc.retry = retry(r.retry_attempts, r.retry_budget.clone());
        sc.health_check = r.health_check.map(|(interval, u, h)| HealthCheckConfig {
            interval,
            unhealthy_threshold: u,
            healthy_threshold: h,
        });
        timeout_for(&mut sc);
        sc
    });
    let mut out = Vec::new();
    let mut matched = false;
    // orca-wrr is left out: the simulated servers send no ORCA reports, so it would be
    // weighted round-robin under another name; prefix-affinity too: the simulated requests
    // carry no prompt, so it would be least-connections under another name.
    for strategy in StrategyKind::ALL
        .into_iter()
        .filter(|s| !matches!(s, StrategyKind::OrcaWrr | StrategyKind::PrefixAffinity))
    {
        for p in [
            Protections::None,
            Protections::Defaults,
            Protections::Protected,
        ] {
            // Every strategy runs with the running configuration's other balancer settings
            // (options, panic threshold, slow start): its row's cluster_toml keeps them.
            let balancer = match running {
                Some(r) => BalancerConfig {
                    strategy,
                    outlier_detection: None,
                    ..r.balancer.clone()
                },
                None => BalancerConfig::new(strategy),
            };
            let mut sc = with_protections(to_scenario(model, &opts, balancer), p, running);
            timeout_for(&mut sc);
            let is_running = running_scenario
                .as_ref()
                .is_some_and(|r| same_config(r, &sc));
            matched |= is_running;
            out.push(Candidate {
                strategy,
                protections: p,
                scenario: sc,
                running: is_running,
                native: strategy.name().to_string(),
                label: p.label().to_string(),
            });
        }
    }
    if let (Some(sc), false) = (running_scenario, matched) {
        let strategy = sc.clusters[0].balancer.strategy;
        out.push(Candidate {
            strategy,
            protections: Protections::Running,
            scenario: sc,
            running: true,
            native: strategy.name().to_string(),
            label: Protections::Running.label().to_string(),
        });
    }
    // Every candidate keeps the same seed: the configurations are compared on the same
    // arrivals and latency draws as far as their picks allow (common random numbers).
    for c in &mut out {
        c.scenario.label = format!("{} / {}", c.native, c.label);
    }
    out
}

/// Another balancer's strategies x its protection sets (no running row: its configuration is
/// not read).
fn peer_candidates(model: &FittedModel, opts: &ScenarioOptions, b: Balancer) -> Vec<Candidate> {
    let mut opts = opts.clone();
    opts.timeout = b.default_timeout();
    let mut out = Vec::new();
    for (native, strategy) in b.strategies() {
        for p in b.protection_sets() {
            let mut balancer = BalancerConfig::new(strategy);
            if b == Balancer::Haproxy {
                // HAProxy has no panic threshold: a server marked down stays out.
                balancer.panic_threshold = 0.0;
            }
            let mut sc = b.protect(to_scenario(model, &opts, balancer), p);
            sc.label = format!("{native} / {}", b.label(p));
            out.push(Candidate {
                strategy,
                protections: p,
                scenario: sc,
                running: false,
                native: native.to_string(),
                label: b.label(p).to_string(),
            });
        }
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
    let timeout = human(sc.timeout);
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
                    human(r.budget.window)
                );
            }
        }
    }
    if let Some(o) = &b.outlier_detection {
        let _ = writeln!(
            t,
            "\n[cluster.outlier_detection]\nconsecutive_failures = {}\nbase_ejection_time = \"{}\"\nmax_ejection_percent = {}",
            o.consecutive_failures,
            human(o.base_ejection_time),
            o.max_ejection_percent
        );
    }
    if let Some(h) = &sc.health_check {
        let _ = writeln!(
            t,
            "\n[cluster.health_check]\ninterval = \"{}\"\nunhealthy_threshold = {}\nhealthy_threshold = {}",
            human(h.interval),
            h.unhealthy_threshold,
            h.healthy_threshold
        );
    }
    t
}

/// The running `[[cluster]]` table of `config_text` with only what candidate `c` changes
/// rewritten, and a first comment line saying what changed; `None` when the text has no such
/// `[[cluster]]` table (then [`cluster_toml`] writes one from scratch).
pub fn merged_cluster_toml(
    config_text: &str,
    cluster: &str,
    c: &Candidate,
    running: &RunningConfig,
) -> Option<String> {
    use toml_edit::{value, ArrayOfTables, DocumentMut, Item, Table};
    let doc: DocumentMut = config_text.parse().ok()?;
    let mut t = doc
        .get("cluster")?
        .as_array_of_tables()?
        .iter()
        .find(|t| t.get("name").and_then(|v| v.as_str()) == Some(cluster))?
        .clone();
    // A key that changes from a table to a value (or back) keeps the old key's spacing (a
    // table header's has none): reset it to `key = value`.
    fn set(t: &mut Table, key: &str, item: Item) {
        t[key] = item;
        if let Some(mut k) = t.key_mut(key) {
            k.leaf_decor_mut().clear();
        }
    }
    let sc = &c.scenario;
    let b = &sc.clusters[0].balancer;
    let mut changes = Vec::new();
    if b.strategy != running.balancer.strategy {
        t["strategy"] = value(b.strategy.name());
        changes.push(format!(
            "strategy {} (was {})",
            b.strategy.name(),
            running.balancer.strategy.name()
        ));
    }
    match (&b.outlier_detection, &running.balancer.outlier_detection) {
        (None, Some(_)) => {
            set(&mut t, "outlier_detection", value(false));
            changes.push("outlier detection off".to_string());
        }
        (Some(o), r) if Some(o) != r.as_ref() => {
            let mut o_t = Table::new();
            o_t["consecutive_failures"] = value(i64::from(o.consecutive_failures));
            o_t["base_ejection_time"] = value(human(o.base_ejection_time));
            o_t["max_ejection_percent"] = value(o.max_ejection_percent);
            set(&mut t, "outlier_detection", Item::Table(o_t));
            changes.push(format!(
                "outlier detection on ({} failures in a row, {})",
                o.consecutive_failures,
                human(o.base_ejection_time)
            ));
        }
        _ => {}
    }
    let attempts = sc.retry.as_ref().map_or(0, |r| r.max_retries);
    if attempts != running.retry_attempts {
        if !t.contains_key("retry") {
            t["retry"] = Item::Table(Table::new());
        }
        t["retry"]["attempts"] = value(i64::from(attempts));
        let derived = t["retry"].get("per_try_timeout").is_none();
        changes.push(format!(
            "retries {attempts} (was {}){}",
            running.retry_attempts,
            if derived {
                format!(
                    "; per-try timeout request_timeout / {} = {}",
                    attempts + 1,
                    human(sc.timeout)
                )
            } else {
                String::new()
            }
        ));
    }
    match (&sc.health_check, &running.health_check) {
        (None, Some(_)) => {
            t.remove("health_check");
            changes.push("health checks removed".to_string());
        }
        (Some(h), None) => {
            let mut h_t = Table::new();
            h_t["interval"] = value(human(h.interval));
            h_t["unhealthy_threshold"] = value(i64::from(h.unhealthy_threshold));
            h_t["healthy_threshold"] = value(i64::from(h.healthy_threshold));
            set(&mut t, "health_check", Item::Table(h_t));
            changes.push(format!(
                "health checks every {} (GET /healthz)",
                human(h.interval)
            ));
        }
        _ => {}
    }
    t.decor_mut().set_prefix("");
    let mut aot = ArrayOfTables::new();
    aot.push(t);
    let mut out = DocumentMut::new();
    out.insert("cluster", Item::ArrayOfTables(aot));
    let head = if changes.is_empty() {
        "# keel advise: the running configuration, unchanged\n".to_string()
    } else {
        format!(
            "# keel advise: changed from the running configuration: {}; every other key as it was\n",
            changes.join(", ")
        )
    };
    Some(format!("{head}{out}"))
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
    ctx: &Context,
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
    let mean_ms =
        reps.iter().map(|r| r.latency_sum_ns).sum::<u128>() as f64 / requests.max(1) as f64 / 1e6;
    Ranked {
        strategy: c.native.clone(),
        protections: c.label.clone(),
        cluster_toml: match (ctx.balancer, &ctx.config_text, &ctx.running) {
            (Balancer::Keel, Some(text), Some(r)) => {
                merged_cluster_toml(text, &model.cluster, c, r)
                    .unwrap_or_else(|| cluster_toml(model, c, unseen))
            }
            (Balancer::Keel, _, _) => cluster_toml(model, c, unseen),
            _ => String::new(),
        },
        config: match ctx.balancer {
            Balancer::Keel => String::new(),
            b => peers::config_text(b, model, &c.native, c.protections, &c.scenario, mean_ms),
        },
        simulated: c.strategy.name().to_string(),
        success: [success, lo, hi],
        p99_ms: interval(&q(0.99)),
        p999_ms: interval(&q(0.999)),
        mean_ms,
        pick_shares: picks
            .iter()
            .map(|&p| p as f64 / total.max(1) as f64)
            .collect(),
        retries_per_request: reps.iter().map(|r| r.retries).sum::<u64>() as f64
            / requests.max(1) as f64,
        running: c.running,
        protection: protection_of(&c.scenario),
        tier: 0,
    }
}

fn overlaps(a: &[f64; 3], b: &[f64; 3]) -> bool {
    a[1] <= b[2] && b[1] <= a[2]
}

/// Orders best first. By success (compared at [`SUCCESS_RESOLUTION`]), then p99, then p99.9;
/// but success ties are settled by protection first: the best row and every row whose success
/// interval overlaps its interval form tier 0 (the simulation cannot tell their success apart),
/// the best of the rest and the rows overlapping it tier 1, and so on; within a tier, more
/// protection ([`protection_of`]) ranks first, then the lower p99, then the lower p99.9; and the
/// running configuration stays first when it has the best's protection and a p99 interval
/// that overlaps the best's (no change on noise). Returns how many rows tie with the best.
pub fn rank(rows: &mut [Ranked]) -> usize {
    let key = |r: &Ranked| (r.success[0] / SUCCESS_RESOLUTION).floor() as i64;
    let latency = |a: &Ranked, b: &Ranked| {
        a.p99_ms[0]
            .total_cmp(&b.p99_ms[0])
            .then(a.p999_ms[0].total_cmp(&b.p999_ms[0]))
    };
    rows.sort_by(|a, b| key(b).cmp(&key(a)).then(latency(a, b)));
    let mut tier: Vec<Option<u32>> = vec![None; rows.len()];
    let mut next = 0;
    for i in 0..rows.len() {
        if tier[i].is_some() {
            continue;
        }
        let lead = rows[i].success;
        for j in i..rows.len() {
            if tier[j].is_none() && overlaps(&lead, &rows[j].success) {
                tier[j] = Some(next);
            }
        }
        next += 1;
    }
    for (r, t) in rows.iter_mut().zip(tier) {
        r.tier = t.unwrap_or(0);
    }
    rows.sort_by(|a, b| {
        a.tier
            .cmp(&b.tier)
            .then(b.protection.cmp(&a.protection))
            .then(latency(a, b))
    });
    // No change on noise: when the running configuration has the best's protection and its p99
    // interval overlaps the best's, it stays first.
    if let Some(r) = rows.iter().position(|r| r.running) {
        let (best, run) = (&rows[0], &rows[r]);
        if r > 0
            && run.tier == best.tier
            && run.protection == best.protection
            && overlaps(&run.p99_ms, &best.p99_ms)
        {
            rows[..=r].rotate_right(1);
        }
    }
    rows.iter().filter(|r| r.tier == 0).count()
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
    let ctx = Context {
        running: running.cloned(),
        ..Context::default()
    };
    advise_in(model, opts, &ctx, source, progress)
}

/// [`advise`] with the whole context: the paste blocks keep the running `[[cluster]]` table's
/// keys, and per-try timeouts follow each candidate's retries.
pub fn advise_in(
    model: &FittedModel,
    opts: &ScenarioOptions,
    ctx: &Context,
    source: &str,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Advice, SimError> {
    let running = ctx.running.as_ref();
    let cands = candidates_in(model, opts, ctx);
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
        rows.push(summarise(model, c, &reps[at..at + n], &unseen, ctx));
        at += n;
    }
    let tied = rank(&mut rows);
    let running_at = rows.iter().position(|r| r.running);
    let mut answer = answer(&rows, tied, running_at);
    if ctx.balancer != Balancer::Keel {
        answer = format!("{}: {answer}", ctx.balancer.name());
    }
    let why = explain(model, &rows, running_at, ctx.balancer);
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
        answer,
        tied,
        balancer: ctx.balancer,
        limits: ctx.balancer.limits(),
        why,
        traps,
        model: model.clone(),
        replications: opts.replications,
        requests_per_replication: opts.requests,
    })
}

fn ms(x: &[f64; 3]) -> String {
    format!("{:.1} ms [{:.1}, {:.1}]", x[0], x[1], x[2])
}

/// The answer, first: what to run, against what, by how much, and why (saying when it is a
/// tie and what the tie rule chose over).
fn answer(rows: &[Ranked], tied: usize, running: Option<usize>) -> String {
    let Some(best) = rows.first() else {
        return String::new();
    };
    let mut s = format!(
        "Run {} with {}{}: predicted success {}, p99 {}.",
        best.strategy,
        best.protections,
        if best.running {
            " (the running configuration: keep it)"
        } else {
            ""
        },
        ci(&best.success),
        ms(&best.p99_ms)
    );
    if best.running && rows.len() > 1 {
        s.push_str(" No other configuration with as much protection has a p99 lower beyond the intervals: a change would be on noise.");
    }
    if tied > 1 {
        let tie = &rows[..tied];
        let lo = tie
            .iter()
            .map(|r| r.success[0])
            .fold(f64::INFINITY, f64::min);
        let hi = tie.iter().map(|r| r.success[0]).fold(0.0, f64::max);
        let _ = write!(
            s,
            " It is a tie on success: {tied} of {} configurations ({:.3} to {:.3} %) have success intervals that overlap the best's, so the simulation cannot rank them by success; among them keel advise prefers more protection (outlier detection, retries and health checks on, then more retries), then the lower p99.",
            rows.len(),
            lo * 100.0,
            hi * 100.0
        );
        let fastest = tie
            .iter()
            .min_by(|a, b| a.p99_ms[0].total_cmp(&b.p99_ms[0]))
            .expect("a tie has rows");
        if fastest.protection < best.protection && fastest.p99_ms[0] < best.p99_ms[0] {
            let _ = write!(
                s,
                " The fastest of the tie, {} with {}, has p99 {}: {:.1} ms lower{}, with less protection against failures the log did not show.",
                fastest.strategy,
                fastest.protections,
                ms(&fastest.p99_ms),
                best.p99_ms[0] - fastest.p99_ms[0],
                if fastest.p99_ms[2] < best.p99_ms[1] {
                    ""
                } else {
                    " (within the intervals)"
                }
            );
        }
    } else if let Some(next) = rows.get(1) {
        let _ = write!(
            s,
            " Its success interval overlaps no other configuration's: the next, {} with {}, succeeds {:.3} points less ({}).",
            next.strategy,
            next.protections,
            (best.success[0] - next.success[0]) * 100.0,
            ci(&next.success)
        );
    }
    match running {
        Some(0) | None => {}
        Some(i) => {
            let r = &rows[i];
            let _ = write!(
                s,
                " Against the running configuration ({} with {}, rank {}): success {:+.3} points{}, p99 {:+.1} ms.",
                r.strategy,
                r.protections,
                i + 1,
                (best.success[0] - r.success[0]) * 100.0,
                if r.tier == 0 {
                    " (a tie)"
                } else {
                    ""
                },
                best.p99_ms[0] - r.p99_ms[0]
            );
        }
    }
    s
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

fn explain(
    model: &FittedModel,
    rows: &[Ranked],
    running: Option<usize>,
    balancer: Balancer,
) -> Vec<String> {
    let mut why = Vec::new();
    let Some(best) = rows.first() else {
        return why;
    };
    let baseline = running
        .map(|i| (&rows[i], "the running configuration"))
        .or_else(|| {
            // The balancer's real defaults (round-robin, and what it does with no protection
            // written), by their name; for NGINX, HAProxy and Envoy a failure status gets
            // none, so they are the `none` row, not a protected set.
            let (p, name) = balancer.real_defaults();
            let label = balancer.label(p);
            rows.iter()
                .find(|r| r.simulated == "round-robin" && r.protections == label)
                .map(|r| (r, name))
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
                    "; the success intervals overlap (a tie), so protection, then the latency decides"
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
        let none = p == Protections::None;
        rows.iter()
            .find(|r| r.simulated == strategy && (r.protection == [0, 0]) == none)
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
                let s = &r.strategy;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, success: [f64; 3], p99: f64, protection: [u32; 2]) -> Ranked {
        Ranked {
            strategy: name.into(),
            protections: String::new(),
            cluster_toml: String::new(),
            success,
            p99_ms: [p99, p99 - 0.1, p99 + 0.1],
            p999_ms: [p99; 3],
            mean_ms: 0.0,
            pick_shares: Vec::new(),
            retries_per_request: 0.0,
            running: false,
            protection,
            tier: 0,
            simulated: name.into(),
            config: String::new(),
        }
    }

    #[test]
    fn a_success_tie_goes_to_more_protection_and_a_clear_margin_to_success() {
        let tie = [0.9999, 0.9998, 1.0];
        let mut rows = vec![
            row("fast-none", tie, 26.9, [0, 0]),
            row("slow-protected", [0.99985, 0.9997, 1.0], 27.8, [3, 2]),
            row("defaults", tie, 27.0, [2, 1]),
            row("worse-protected", [0.95, 0.94, 0.96], 20.0, [3, 2]),
            row("worst-none", [0.90, 0.89, 0.91], 10.0, [0, 0]),
        ];
        let tied = rank(&mut rows);
        let names: Vec<&str> = rows.iter().map(|r| r.strategy.as_str()).collect();
        assert_eq!(
            names,
            [
                "slow-protected",
                "defaults",
                "fast-none",
                "worse-protected",
                "worst-none"
            ]
        );
        assert_eq!(tied, 3);
        assert_eq!(
            rows.iter().map(|r| r.tier).collect::<Vec<_>>(),
            [0, 0, 0, 1, 2]
        );
        let a = answer(&rows, tied, None);
        assert!(a.starts_with("Run slow-protected"), "{a}");
        assert!(a.contains("tie on success: 3 of 5"), "{a}");
        assert!(a.contains("fast-none") && a.contains("0.9 ms lower"), "{a}");
    }

    #[test]
    fn the_running_configuration_stays_first_when_only_noise_beats_it() {
        let tie = [1.0, 0.9999, 1.0];
        let mut rows = vec![
            row("a", tie, 17.40, [3, 2]),
            row("b", tie, 17.45, [3, 2]),
            row("none", tie, 17.0, [0, 0]),
        ];
        rows[1].running = true;
        rank(&mut rows);
        assert_eq!(rows[0].strategy, "b");
        // Beyond the intervals, the faster one wins.
        rows[0].p99_ms = [19.0, 18.9, 19.1];
        rank(&mut rows);
        assert_eq!(rows[0].strategy, "a");
    }

    #[test]
    fn durations_are_written_as_a_person_would() {
        assert_eq!(human(Duration::from_nanos(333_333_333)), "333ms");
        assert_eq!(human(Duration::from_millis(7_500)), "7s 500ms");
        assert_eq!(human(Duration::from_secs(30)), "30s");
        assert_eq!(human(Duration::from_micros(1_234)), "1ms 230us");
        assert_eq!(human(Duration::from_nanos(7)), "7ns");
    }
}
