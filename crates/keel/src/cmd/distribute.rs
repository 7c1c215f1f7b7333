//! `keel distribute`: preview how a strategy spreads picks (or hash keys) over endpoints, and
//! how many keys move when endpoints are removed or added. Picks are finished at once by
//! default (no load); `--in-flight N` keeps N calls outstanding on a virtual clock, each taking
//! a latency drawn from `--latency` / `--latency-dist` (keel-model's vocabulary, as for
//! `keel backend`), so that the preview shows loaded behaviour too.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use keel_model::{Latency, LatencyDist};
use rand::SeedableRng;

use keel_balance::{
    hash_key, Balancer, BalancerConfig, EndpointSpec, Outcome, Pick, PickContext, StrategyKind,
};
use serde::Serialize;

use super::usage;

/// Arguments of `keel distribute`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Strategy name (e.g. round-robin, maglev, ring-hash, least-request).
    #[arg(long)]
    strategy: String,
    /// Number of endpoints.
    #[arg(long)]
    endpoints: usize,
    /// Comma-separated weights, one per endpoint (default: all 1).
    #[arg(long, value_delimiter = ',')]
    weights: Vec<u32>,
    /// Number of picks; for hash strategies, of distinct keys.
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Calls kept outstanding: each pick waits until fewer than N calls are in flight, and
    /// calls finish in the order they end (oldest first with a fixed latency), each taking a
    /// latency drawn from --latency and --latency-dist. 0 (the default): every pick is finished
    /// at once and no time passes.
    #[arg(long, default_value_t = 0)]
    in_flight: usize,
    /// Mean time a call takes with --in-flight, e.g. 10ms.
    #[arg(long, default_value = "10ms")]
    latency: String,
    /// Latency distribution around its mean: fixed, exponential or lognormal.
    #[arg(long, default_value = "fixed", value_name = "DIST")]
    latency_dist: String,
    /// Standard deviation of the log of the latency, for --latency-dist lognormal.
    #[arg(long, allow_negative_numbers = true, default_value_t = keel_model::vocab::DEFAULT_SIGMA)]
    sigma: f64,
    /// Then remove this many endpoints (the last ones) and report the keys that moved.
    #[arg(long, conflicts_with = "add")]
    remove: Option<usize>,
    /// Then add this many endpoints (weight 1) and report the keys that moved.
    #[arg(long)]
    add: Option<usize>,
    /// Bounded loads for hash strategies (c, e.g. 1.25).
    #[arg(long)]
    bounded_load: Option<f64>,
    /// Maglev table size (a prime).
    #[arg(long)]
    table_size: Option<u64>,
    /// Ring-hash virtual nodes per endpoint.
    #[arg(long)]
    vnodes: Option<u32>,
    /// Seed of the balancer's random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    strategy: String,
    endpoints: usize,
    keys: u64,
    /// Calls outstanding at each pick (0: finished at once).
    in_flight: usize,
    /// Mean duration of a call, in seconds (0 without --in-flight).
    latency_seconds: f64,
    /// Its distribution: fixed, exponential or lognormal.
    latency_dist: &'static str,
    shares: Vec<f64>,
    /// Largest share divided by the share its weight entitles it to.
    max_over_mean: f64,
    /// Share of keys (or of the i-th pick, for strategies without keys) whose endpoint changed.
    moved: Option<f64>,
    /// Shares after the removal or addition.
    #[serde(skip_serializing_if = "Option::is_none")]
    shares_after: Option<Vec<f64>>,
}

fn endpoint_specs(weights: &[u32]) -> Vec<EndpointSpec> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            EndpointSpec::new(format!(
                "10.{}.{}.{}:8080",
                i >> 16,
                (i >> 8) & 255,
                i & 255
            ))
            .with_weight(w)
        })
        .collect()
}

/// The load a preview puts on the balancer.
#[derive(Clone, Copy)]
struct Load {
    /// Calls outstanding at each pick; 0: each pick is finished at once.
    in_flight: usize,
    latency: Latency,
    seed: u64,
}

/// A call in flight: when it ends, then its place in the order of picks (so that calls ending
/// at the same instant end oldest first), and the pick.
struct Open(Duration, u64, Pick);

impl PartialEq for Open {
    fn eq(&self, other: &Self) -> bool {
        (self.0, self.1) == (other.0, other.1)
    }
}
impl Eq for Open {}
impl PartialOrd for Open {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Open {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(other.0, other.1))
    }
}

/// Makes `keys` picks on a virtual clock under `load`; returns the endpoint index of each.
fn assign(lb: &Balancer, keys: u64, hashed: bool, load: Load) -> Vec<u32> {
    let mut open: BinaryHeap<Reverse<Open>> = BinaryHeap::with_capacity(load.in_flight);
    // Picks spaced so that `in_flight` calls of the mean latency overlap.
    let spacing = load.latency.mean / load.in_flight.max(1) as u32;
    let sampler = load.latency.sampler();
    let mut rng = rand::rngs::StdRng::seed_from_u64(load.seed);
    let mut now = Duration::ZERO;
    let mut assigned = Vec::with_capacity(keys as usize);
    for k in 0..keys {
        while !open.is_empty() && open.len() >= load.in_flight {
            let Reverse(Open(at, _, pick)) = open.pop().expect("not empty");
            now = now.max(at);
            lb.finish(pick, Outcome::Success, at);
        }
        let mut ctx = PickContext::new(now);
        if hashed {
            ctx = ctx.with_hash_key(hash_key(format!("key-{k}").as_bytes()));
        }
        let pick = lb.pick(&ctx).expect("endpoints are all healthy");
        assigned.push(pick.index() as u32);
        if load.in_flight == 0 {
            lb.finish(pick, Outcome::Success, now);
        } else {
            let took = Duration::from_secs_f64(sampler.sample_secs(&mut rng));
            open.push(Reverse(Open(now + took, k, pick)));
            now += spacing;
        }
    }
    while let Some(Reverse(Open(at, _, pick))) = open.pop() {
        lb.finish(pick, Outcome::Success, at);
    }
    assigned
}

fn dist_name(d: LatencyDist) -> &'static str {
    match d {
        LatencyDist::Fixed => "fixed",
        LatencyDist::Exponential => "exponential",
        LatencyDist::LogNormal { .. } => "lognormal",
    }
}

fn shares(assigned: &[u32], n: usize) -> Vec<f64> {
    let mut counts = vec![0u64; n];
    for &i in assigned {
        counts[i as usize] += 1;
    }
    counts
        .iter()
        .map(|&c| c as f64 / assigned.len().max(1) as f64)
        .collect()
}

/// Runs `keel distribute`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let kind: StrategyKind = match args.strategy.parse() {
        Ok(k) => k,
        Err(e) => return usage(e.to_string()),
    };
    if args.endpoints == 0 || args.endpoints > 100_000 {
        return usage(format!(
            "--endpoints must be within 1..=100000, got {}",
            args.endpoints
        ));
    }
    if args.keys == 0 || args.keys > 100_000_000 {
        return usage(format!(
            "--keys must be within 1..=100000000, got {}",
            args.keys
        ));
    }
    let weights = if args.weights.is_empty() {
        vec![1; args.endpoints]
    } else if args.weights.len() != args.endpoints {
        return usage(format!(
            "--weights has {} values for {} endpoints; give one weight per endpoint",
            args.weights.len(),
            args.endpoints
        ));
    } else if args.weights.contains(&0) {
        return usage("--weights must all be 1 or more");
    } else {
        args.weights.clone()
    };
    let latency = super::latency_flags(&args.latency, &args.latency_dist, args.sigma)?;
    if args.in_flight > 100_000 {
        return usage(format!(
            "--in-flight must be within 0..=100000, got {}",
            args.in_flight
        ));
    }
    let load = Load {
        in_flight: args.in_flight,
        latency: if args.in_flight == 0 {
            Latency::fixed(Duration::ZERO)
        } else {
            latency
        },
        seed: args.seed,
    };
    if !args.weights.is_empty() && !kind.uses_weights() {
        eprintln!(
            "warning: {kind} ignores weights: every endpoint gets an equal share whatever --weights says"
        );
    }
    if args.remove.is_some_and(|r| r >= args.endpoints) {
        return usage(format!(
            "--remove must leave at least one endpoint (of {})",
            args.endpoints
        ));
    }

    let mut config = BalancerConfig::new(kind);
    config.seed = args.seed;
    config.options.bounded_load = args.bounded_load;
    if let Some(t) = args.table_size {
        config.options.table_size = t;
    }
    if let Some(v) = args.vnodes {
        config.options.vnodes = v;
    }
    config
        .validate()
        .map_err(|e| super::UsageError(e.to_string()))?;

    let specs = endpoint_specs(&weights);
    let lb = Balancer::new(config, &specs).map_err(|e| super::UsageError(e.to_string()))?;
    let hashed = kind.is_hash();
    let before = assign(&lb, args.keys, hashed, load);
    let shares_before = shares(&before, specs.len());
    let total_w: u64 = weights.iter().map(|&w| w as u64).sum();
    // What each endpoint should get: its weight's share, or an equal share if the strategy
    // ignores weights.
    let expected: Vec<f64> = weights
        .iter()
        .map(|&w| {
            if kind.uses_weights() {
                w as f64 / total_w as f64
            } else {
                1.0 / weights.len() as f64
            }
        })
        .collect();
    let max_over_mean = shares_before
        .iter()
        .zip(&expected)
        .map(|(s, e)| s / e)
        .fold(0.0, f64::max);

    let mut moved = None;
    let mut shares_after = None;
    if args.remove.is_some() || args.add.is_some() {
        let mut new_weights = weights.clone();
        match (args.remove, args.add) {
            (Some(r), _) => new_weights.truncate(weights.len() - r),
            (_, Some(a)) => new_weights.extend(std::iter::repeat_n(1, a)),
            _ => unreachable!(),
        }
        let new_specs = endpoint_specs(&new_weights);
        lb.update(&new_specs, Duration::ZERO)
            .map_err(|e| super::UsageError(e.to_string()))?;
        let after = assign(&lb, args.keys, hashed, load);
        // Indices are stable: removal drops the last endpoints, addition appends.
        let changed = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        moved = Some(changed as f64 / args.keys as f64);
        shares_after = Some(shares(&after, new_specs.len()));
    }

    let report = Report {
        strategy: kind.name().to_string(),
        endpoints: args.endpoints,
        keys: args.keys,
        in_flight: load.in_flight,
        latency_seconds: load.latency.mean.as_secs_f64(),
        latency_dist: dist_name(load.latency.dist),
        shares: shares_before,
        max_over_mean,
        moved,
        shares_after,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    let how = if load.in_flight == 0 {
        "each finished at once".to_string()
    } else {
        format!(
            "{} in flight, each taking {}{}",
            load.in_flight,
            humantime::format_duration(load.latency.mean),
            match load.latency.dist {
                LatencyDist::Fixed => String::new(),
                d => format!(" on average ({})", dist_name(d)),
            }
        )
    };
    println!(
        "{} over {} endpoints, {} {}, {how}:",
        report.strategy,
        report.endpoints,
        report.keys,
        if hashed { "distinct keys" } else { "picks" }
    );
    println!(
        "  {:>5}  {:>6}  {:>8}  {:>8}",
        "#", "weight", "expected", "share"
    );
    let show = report.shares.len().min(20);
    for (i, s) in report.shares.iter().enumerate().take(show) {
        println!(
            "  {:>5}  {:>6}  {:>7.3}%  {:>7.3}%",
            i,
            weights[i],
            100.0 * expected[i],
            100.0 * s
        );
    }
    if report.shares.len() > show {
        println!("  ... {} more endpoints", report.shares.len() - show);
    }
    println!("  max share / expected share: {:.4}", report.max_over_mean);
    if let Some(m) = report.moved {
        let what = match (args.remove, args.add) {
            (Some(r), _) => format!("removing {r}"),
            (_, Some(a)) => format!("adding {a}"),
            _ => unreachable!(),
        };
        let ideal = match (args.remove, args.add) {
            (Some(r), _) => r as f64 / args.endpoints as f64,
            (_, Some(a)) => a as f64 / (args.endpoints + a) as f64,
            _ => unreachable!(),
        };
        println!(
            "  {what} endpoint(s) moved {:.3}% of {} (ideal for consistent hashing: {:.3}%)",
            100.0 * m,
            if hashed {
                "keys"
            } else {
                "picks (no keys: the i-th pick is compared)"
            },
            100.0 * ideal
        );
    }
    Ok(())
}
