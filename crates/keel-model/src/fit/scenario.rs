//! A fitted model as a simulator scenario, and as the TOML file a user reruns with
//! `keel simulate --scenario` and edits ("what if this endpoint failed completely").

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::BalancerConfig;

use super::{EndpointFit, FittedModel};
use crate::sim::{
    CapacityConfig, ClusterConfig, Discipline, EndpointConfig, FailureShare, Load, Scenario,
};
use crate::vocab::{FailureMode, Latency, LatencyDist};

/// How the fitted model is run.
#[derive(Debug, Clone)]
pub struct ScenarioOptions {
    /// Measured requests per replication.
    pub requests: u64,
    /// Replications.
    pub replications: u32,
    /// Virtual time before requests count.
    pub warmup: Duration,
    /// Seed.
    pub seed: u64,
    /// The per-try timeout when the log shows none (no try timed out).
    pub timeout: Duration,
    /// Weights by endpoint name (from the proxy's configuration); absent names weigh 1.
    pub weights: Vec<(String, u32)>,
}

impl ScenarioOptions {
    /// Defaults for a model: about a minute of virtual time at the fitted rate, within
    /// 2,000..=40,000 requests per replication; 5 replications; 1 s of warm-up; the proxy's
    /// default per-try timeout (15 s over 2 tries).
    pub fn for_model(model: &FittedModel) -> Self {
        let requests = (model.arrival.rate_per_s * 60.0).clamp(2_000.0, 40_000.0) as u64;
        ScenarioOptions {
            requests,
            replications: 5,
            warmup: Duration::from_secs(1),
            seed: 1,
            timeout: Duration::from_millis(7_500),
            weights: Vec::new(),
        }
    }
}

/// Rounded to whole microseconds (what the TOML form spells).
fn us(ms: f64) -> Duration {
    Duration::from_micros((ms.max(0.0) * 1e3).round() as u64)
}

fn round_latency(l: Latency) -> Latency {
    Latency {
        mean: us(l.mean.as_secs_f64() * 1e3).max(Duration::from_micros(1)),
        dist: l.dist,
    }
}

/// The endpoint's failures as shares of calls: errors and resets fail fast after their median
/// time (what a balancer sees of them: a failure, and how long it held the call), hangs run to
/// the timeout.
fn failure_shares(e: &EndpointFit) -> Vec<FailureShare> {
    let f = &e.failures;
    let mut v = Vec::new();
    if f.error.count > 0 {
        v.push(FailureShare {
            share: f.error.share,
            failure: FailureMode::FailFast {
                after: us(f.error_ms.unwrap_or(0.0)),
            },
        });
    }
    if f.timeout.count > 0 {
        v.push(FailureShare {
            share: f.timeout.share,
            failure: FailureMode::Hang,
        });
    }
    if f.reset.count > 0 {
        v.push(FailureShare {
            share: f.reset.share,
            failure: FailureMode::FailFast {
                after: us(f.reset_ms.unwrap_or(0.0)),
            },
        });
    }
    v
}

/// The per-try timeout the scenario uses.
pub fn timeout_of(model: &FittedModel, opts: &ScenarioOptions) -> Duration {
    model.timeout_ms.map_or(opts.timeout, us)
}

/// The scenario of a fitted model under `balancer` (no protections: add `retry` and
/// `health_check` to the result as needed).
pub fn to_scenario(
    model: &FittedModel,
    opts: &ScenarioOptions,
    balancer: BalancerConfig,
) -> Scenario {
    let endpoints: Vec<EndpointConfig> = model
        .endpoints
        .iter()
        .map(|e| EndpointConfig {
            name: e.name.clone(),
            weight: opts
                .weights
                .iter()
                .find(|(n, _)| *n == e.name)
                .map_or(1, |(_, w)| *w),
            latency: Some(round_latency(e.latency.family)),
            capacity: e.capacity.as_ref().map(|c| CapacityConfig {
                concurrency: c.concurrency,
                discipline: Discipline::Fifo,
            }),
            failures: failure_shares(e),
        })
        .collect();
    Scenario {
        name: "advise".into(),
        label: "fitted".into(),
        seed: opts.seed,
        replications: opts.replications,
        requests: opts.requests,
        warmup: opts.warmup,
        timeout: timeout_of(model, opts),
        load: Load::Open {
            rate: model.arrival.rate_per_s,
            clients: 1,
        },
        clusters: vec![ClusterConfig {
            name: model.cluster.clone(),
            servers: endpoints.len() as u32,
            // Every endpoint has its own; the cluster's stays at its default (unused).
            balancer,
            endpoints,
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    }
}

fn d(t: Duration) -> String {
    humantime::format_duration(t).to_string()
}

fn latency_toml(l: &Latency) -> String {
    match l.dist {
        LatencyDist::Fixed => format!("{{ dist = \"fixed\", mean = \"{}\" }}", d(l.mean)),
        LatencyDist::Exponential => {
            format!("{{ dist = \"exponential\", mean = \"{}\" }}", d(l.mean))
        }
        LatencyDist::LogNormal { sigma } => format!(
            "{{ dist = \"lognormal\", mean = \"{}\", sigma = {sigma} }}",
            d(l.mean)
        ),
    }
}

fn failure_toml(f: &FailureMode) -> String {
    match f {
        FailureMode::FailFast { after } => {
            format!("{{ mode = \"fail-fast\", after = \"{}\" }}", d(*after))
        }
        FailureMode::ServerError { after } => {
            format!("{{ mode = \"server-error\", after = \"{}\" }}", d(*after))
        }
        FailureMode::Slow { factor } => format!("{{ mode = \"slow\", factor = {factor} }}"),
        FailureMode::Error { probability } => {
            format!("{{ mode = \"error\", probability = {probability} }}")
        }
        other => format!("{{ mode = \"{}\" }}", other.name()),
    }
}

/// The scenario as a commented TOML file that [`Scenario::from_toml_str`] reads back to the
/// same value (the strategy and protections of `sc` included).
pub fn scenario_toml(model: &FittedModel, sc: &Scenario, source: &str) -> String {
    let mut t = String::new();
    let c = &sc.clusters[0];
    let _ = writeln!(
        t,
        "# Fitted by `keel advise` from {source}: cluster `{}`, {} to {} ({} requests, {} tries).",
        model.cluster, model.from, model.to, model.requests, model.tries
    );
    let _ = writeln!(
        t,
        "# Rerun it with `keel simulate --scenario FILE`; edit it to ask \"what if\" (an endpoint's\n# failures, its latency, the load, the strategy in [clusters.balancer])."
    );
    let _ = writeln!(t, "name = \"{}\"", sc.name);
    let _ = writeln!(t, "label = \"{}\"", sc.label);
    let _ = writeln!(t, "seed = {}", sc.seed);
    let _ = writeln!(t, "replications = {}", sc.replications);
    let _ = writeln!(t, "requests = {}", sc.requests);
    let _ = writeln!(t, "warmup = \"{}\"", d(sc.warmup));
    let timeout_note = match model.timeout_ms {
        Some(ms) => format!("the log's timed-out tries took {ms:.1} ms"),
        None => "no try timed out in the log: the proxy's default per-try timeout".into(),
    };
    let _ = writeln!(
        t,
        "timeout = \"{}\"  # per try; {timeout_note}",
        d(sc.timeout)
    );
    if let Some(r) = &sc.retry {
        let _ = writeln!(
            t,
            "\n[retry]\nmax_retries = {}\nbudget = {{ budget_percent = {}, min_retries_per_second = {}, window = \"{}\" }}",
            r.max_retries,
            r.budget.budget_percent,
            r.budget.min_retries_per_second,
            d(r.budget.window)
        );
    }
    if let Some(h) = &sc.health_check {
        let _ = writeln!(
            t,
            "\n[health_check]\ninterval = \"{}\"\nunhealthy_threshold = {}\nhealthy_threshold = {}",
            d(h.interval),
            h.unhealthy_threshold,
            h.healthy_threshold
        );
    }
    if let Load::Open { rate, clients } = &sc.load {
        let _ = writeln!(
            t,
            "\n# {:.1} requests/s over {:.0} s; index of dispersion {:.2} per {:.3} s (Poisson: 1; the\n# simulation's arrivals are Poisson); {:.2} requests in flight on average.",
            model.arrival.rate_per_s,
            model.seconds,
            model.arrival.dispersion,
            model.arrival.window_s,
            model.arrival.mean_in_flight
        );
        let _ = writeln!(
            t,
            "[load]\nkind = \"open\"\nrate = {rate}\nclients = {clients}"
        );
    }
    let _ = writeln!(
        t,
        "\n[[clusters]]\nname = \"{}\"\nservers = {}",
        c.name, c.servers
    );
    let b = &c.balancer;
    let _ = writeln!(
        t,
        "\n[clusters.balancer]\nstrategy = \"{}\"",
        b.strategy.name()
    );
    if b.options.tie_break != keel_balance::TieBreak::Random {
        let _ = writeln!(t, "tie_break = \"lowest-index\"");
    }
    if let Some(o) = &b.outlier_detection {
        let _ = writeln!(
            t,
            "\n[clusters.balancer.outlier_detection]\nconsecutive_failures = {}\ninterval = \"{}\"\nbase_ejection_time = \"{}\"\nmax_ejection_time = \"{}\"\nmax_ejection_percent = {}",
            o.consecutive_failures,
            d(o.interval),
            d(o.base_ejection_time),
            d(o.max_ejection_time),
            o.max_ejection_percent
        );
        if let Some(fr) = &o.failure_rate {
            let _ = writeln!(
                t,
                "failure_rate = {{ threshold_percent = {}, minimum_requests = {} }}",
                fr.threshold_percent, fr.minimum_requests
            );
        }
    }
    for (e, fit) in c.endpoints.iter().zip(&model.endpoints) {
        let _ = writeln!(t, "\n[[clusters.endpoints]]\nname = \"{}\"", e.name);
        if e.weight != 1 {
            let _ = writeln!(t, "weight = {}", e.weight);
        }
        let l = &fit.latency;
        if let Some(lat) = &e.latency {
            let fitness = match l.ks {
                Some(ks) => format!("KS {ks:.3} (critical {:.3})", l.ks_critical),
                None => "nearly constant".into(),
            };
            let _ = writeln!(
                t,
                "# {} tries ({:.1} % of the cluster's); successes: p50 {:.2} ms, p99 {:.2} ms, p99.9 {:.2} ms; {fitness}{}",
                fit.tries,
                fit.share * 100.0,
                l.p50_ms,
                l.p99_ms,
                l.p999_ms,
                if l.pooled { "; too few successes: the cluster's pooled fit" } else { "" }
            );
            let _ = writeln!(t, "latency = {}", latency_toml(lat));
        }
        if let Some(cap) = &e.capacity {
            if let Some(cf) = &fit.capacity {
                let _ = writeln!(
                    t,
                    "# latency rises with calls in flight: {:.2} ms up to {} at once, {:.2} ms at {}; so it serves\n# {} at once, at most {:.0} calls/s by Little's law",
                    cf.service_ms,
                    cf.concurrency,
                    cf.levels.last().map_or(0.0, |x| x.2),
                    cf.levels.last().map_or(0, |x| x.0),
                    cf.concurrency,
                    f64::from(cf.concurrency) / cf.service_ms * 1e3
                );
            }
            let _ = writeln!(t, "capacity = {{ concurrency = {} }}", cap.concurrency);
        }
        if !e.failures.is_empty() {
            let f = &fit.failures;
            let _ = writeln!(t, "failures = [");
            let mut notes = Vec::new();
            if f.error.count > 0 {
                notes.push(format!(
                    "errors {:.2} % [{:.2}, {:.2}], median {:.2} ms",
                    f.error.share * 100.0,
                    f.error.ci95[0] * 100.0,
                    f.error.ci95[1] * 100.0,
                    f.error_ms.unwrap_or(0.0)
                ));
            }
            if f.timeout.count > 0 {
                notes.push(format!(
                    "timeouts {:.2} % [{:.2}, {:.2}]",
                    f.timeout.share * 100.0,
                    f.timeout.ci95[0] * 100.0,
                    f.timeout.ci95[1] * 100.0
                ));
            }
            if f.reset.count > 0 {
                notes.push(format!(
                    "resets {:.2} % [{:.2}, {:.2}], median {:.2} ms",
                    f.reset.share * 100.0,
                    f.reset.ci95[0] * 100.0,
                    f.reset.ci95[1] * 100.0,
                    f.reset_ms.unwrap_or(0.0)
                ));
            }
            for (s, note) in e.failures.iter().zip(notes) {
                let _ = writeln!(
                    t,
                    "  {{ share = {}, failure = {} }},  # {note}",
                    s.share,
                    failure_toml(&s.failure)
                );
            }
            let _ = writeln!(t, "]");
        }
    }
    t
}
