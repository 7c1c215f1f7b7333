//! Servers with a capacity against queueing theory, and hedged requests against probability:
//! fixed seeds, tolerances stated at each assertion (about three standard errors of the
//! estimate, measured over seeds, unless said otherwise).
//!
//! Every test uses Poisson arrivals (an open loop), exponential or fixed service times with a
//! 10 ms mean, and a timeout far above any latency so that nothing is cut short.

use std::time::Duration;

use keel_balance::{BalancerConfig, StrategyKind};
use keel_model::sim::{
    self, AntagonistConfig, CapacityConfig, ClusterConfig, Discipline, HedgeConfig, HedgeDelay,
    Load, Scenario, SimResult,
};
use keel_model::{Latency, LatencyDist};

const S_MS: f64 = 10.0;

/// `servers` single-server queues at utilisation `rho`, fed through one balancer.
fn queues(
    strategy: StrategyKind,
    servers: u32,
    rho: f64,
    dist: LatencyDist,
    discipline: Discipline,
    requests: u64,
) -> Scenario {
    Scenario {
        seed: 1,
        replications: 4,
        requests,
        // Ten times the M/M/1 relaxation time at rho = 0.9 (about 1 / (mu (1 - sqrt rho)^2),
        // 3.8 s): the queues start empty.
        warmup: Duration::from_secs(20),
        timeout: Duration::from_secs(60),
        load: Load::Open {
            rate: rho * f64::from(servers) * 1000.0 / S_MS,
            clients: 1,
        },
        clusters: vec![ClusterConfig {
            servers,
            latency: Latency {
                dist,
                mean: Duration::from_millis(S_MS as u64),
            },
            capacity: Some(CapacityConfig {
                concurrency: 1,
                discipline,
            }),
            balancer: BalancerConfig::new(strategy),
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    }
}

/// Runs a scenario and prints what it measured (`-- --nocapture` shows the numbers that
/// docs/tail-latency.md quotes).
fn run(sc: &Scenario) -> SimResult {
    let r = sim::run(sc).expect("valid scenario");
    assert_eq!(r.success, 1.0, "nothing times out");
    let c = &sc.clusters[0];
    eprintln!(
        "{} x{} {:?} {:?} load {:.3}: latency_ms {:?}, hedges {} won {} of {} requests",
        c.balancer.strategy,
        c.servers,
        c.latency.dist,
        c.capacity.as_ref().map(|k| (k.concurrency, k.discipline)),
        r.load.unwrap_or(f64::NAN),
        r.latency_ms,
        r.hedges,
        r.hedges_won,
        r.requests
    );
    r
}

/// Random placement on 100 FIFO servers at rho = 0.9 is 100 independent M/M/1 queues: the
/// response time is exponential with mean S / (1 - rho) = 10 S, so p50 = 10 S ln 2 and
/// p99 = 10 S ln 100.
#[test]
fn random_placement_is_m_m_1() {
    let sc = queues(
        StrategyKind::Random,
        100,
        0.9,
        LatencyDist::Exponential,
        Discipline::Fifo,
        200_000,
    );
    assert!((sc.offered_load().unwrap() - 0.9).abs() < 1e-12);
    let r = run(&sc);
    assert!((r.load.unwrap() - 0.9).abs() < 1e-12);
    let l = r.latency_ms;
    let mean = 10.0 * S_MS;
    // M/M/1 at rho = 0.9 has long memory: the standard error of a mean over 800 000 calls on
    // 100 queues is about 2 % (Daley's variance constant), so 6 %.
    assert!((l.mean - mean).abs() / mean < 0.06, "mean {}", l.mean);
    assert!(
        (l.p50 - mean * 2f64.ln()).abs() / (mean * 2f64.ln()) < 0.06,
        "p50 {}",
        l.p50
    );
    // A tail quantile moves more than the mean: 10 %.
    let p99 = mean * 100f64.ln();
    assert!((l.p99 - p99).abs() / p99 < 0.10, "p99 {} vs {p99}", l.p99);
}

/// Power of two choices on exact queue lengths (least-request behind one balancer, which sees
/// every call) is Mitzenmacher's supermarket model: as n grows the mean response time tends to
/// sum_{i>=1} rho^(2^i - 2) service times, 2.614 at rho = 0.9, from above.
#[test]
fn power_of_two_choices_approaches_the_supermarket_model() {
    let limit: f64 = (1..20).map(|i| 0.9f64.powi((1 << i) - 2)).sum();
    assert!((limit - 2.6141).abs() < 1e-3, "{limit}");
    let means: Vec<f64> = [10u32, 20, 100]
        .iter()
        .map(|&n| {
            let sc = queues(
                StrategyKind::LeastRequest,
                n,
                0.9,
                LatencyDist::Exponential,
                Discipline::Fifo,
                3000 * u64::from(n),
            );
            run(&sc).latency_ms.mean / S_MS
        })
        .collect();
    // Measured over seeds: the means' standard error is below 0.5 %, the gaps between the
    // sizes are 5 % and 4 %.
    assert!(
        means[0] > means[1] && means[1] > means[2],
        "decreasing in n: {means:?}"
    );
    // At n = 100 the finite-n excess is about 1 %: within 4 % above the limit, never below it
    // by more than noise.
    assert!(
        means[2] > limit * 0.98 && means[2] < limit * 1.04,
        "n = 100: {} vs {limit}",
        means[2]
    );
    // Against random placement's 10 service times.
    assert!(means[0] < 3.2, "{means:?}");
}

/// Fixed service times: FIFO is M/D/1 (Pollaczek-Khinchine: S (1 + rho / (2 (1 - rho))) =
/// 5.5 S), while processor sharing is insensitive to the service distribution and keeps
/// M/M/1's 10 S.
#[test]
fn fifo_and_processor_sharing_follow_their_formulas() {
    let fifo = run(&queues(
        StrategyKind::Random,
        100,
        0.9,
        LatencyDist::Fixed,
        Discipline::Fifo,
        100_000,
    ));
    let ps = run(&queues(
        StrategyKind::Random,
        100,
        0.9,
        LatencyDist::Fixed,
        Discipline::Ps,
        100_000,
    ));
    let md1 = S_MS * (1.0 + 0.9 / (2.0 * 0.1));
    // Half the calls of the M/M/1 test, less variance: 6 %, and 8 % for PS.
    assert!(
        (fifo.latency_ms.mean - md1).abs() / md1 < 0.06,
        "M/D/1 {}",
        fifo.latency_ms.mean
    );
    assert!(
        (ps.latency_ms.mean - 10.0 * S_MS).abs() / (10.0 * S_MS) < 0.08,
        "M/D/1-PS {}",
        ps.latency_ms.mean
    );
}

/// With `concurrency = c`, a FIFO server is M/M/c: Erlang C gives the chance to wait, and the
/// mean wait is C / (c mu - lambda).
#[test]
fn concurrency_makes_m_m_c() {
    let c = 4u32;
    let rho = 0.8;
    let mut sc = queues(
        StrategyKind::Random,
        50,
        rho,
        LatencyDist::Exponential,
        Discipline::Fifo,
        200_000,
    );
    sc.clusters[0].capacity = Some(CapacityConfig {
        concurrency: c,
        discipline: Discipline::Fifo,
    });
    sc.load = Load::Open {
        rate: rho * 50.0 * f64::from(c) * 1000.0 / S_MS,
        clients: 1,
    };
    assert!((sc.offered_load().unwrap() - rho).abs() < 1e-12);
    let r = run(&sc);
    // Erlang C with a = c rho offered erlangs.
    let a = f64::from(c) * rho;
    let mut term = 1.0;
    let mut sum = 1.0;
    for k in 1..c {
        term *= a / f64::from(k);
        sum += term;
    }
    let top = term * a / f64::from(c) / (1.0 - rho);
    let erlang_c = top / (sum + top);
    let mean = S_MS + erlang_c * S_MS / (f64::from(c) * (1.0 - rho));
    assert!(
        (r.latency_ms.mean - mean).abs() / mean < 0.04,
        "M/M/{c}: {} vs {mean}",
        r.latency_ms.mean
    );
}

/// Antagonists slow `servers` of the servers at any time: with fixed 10 ms calls and no queue, a
/// call takes 30 ms with probability 2/10, so the mean is 14 ms and p99 is 30 ms, and the
/// offered-load figure counts the capacity they take away.
#[test]
fn antagonists_slow_their_share_of_calls() {
    let mut sc = queues(
        StrategyKind::Random,
        10,
        0.5,
        LatencyDist::Fixed,
        Discipline::Fifo,
        50_000,
    );
    sc.warmup = Duration::ZERO;
    sc.clusters[0].antagonist = Some(AntagonistConfig {
        servers: 2,
        factor: 3.0,
        period: Duration::from_millis(500),
    });
    // Capacity: 8 full servers and 2 at a third.
    let load = sc.offered_load().unwrap();
    assert!(
        (load - 0.5 * 10.0 / (8.0 + 2.0 / 3.0)).abs() < 1e-12,
        "{load}"
    );
    sc.clusters[0].capacity = None;
    let r = run(&sc);
    // The share of slowed calls is a binomial proportion over 200 000 calls, but the draws are
    // per period (50 000 calls / 500 /s = 100 s, 200 periods of 2 servers out of 10): 3 %.
    assert!(
        (r.latency_ms.mean - 14.0).abs() / 14.0 < 0.03,
        "{:?}",
        r.latency_ms
    );
    assert!((r.latency_ms.p50 - 10.0).abs() < 0.05, "{:?}", r.latency_ms);
    assert!((r.latency_ms.p99 - 30.0).abs() < 0.15, "{:?}", r.latency_ms);
}

/// Hedging with a fixed delay d on servers without a queue: the call takes min(X1, d + X2) for
/// independent exponential X1, X2, so P(T > t) = e^(-t/S) before d and e^(-(2t - d)/S) after:
/// p99 = (S ln 100 + d) / 2. A hedge goes out with probability e^(-d/S) and, by memorylessness,
/// wins half of those races.
#[test]
fn hedging_follows_the_race_of_two_exponentials() {
    let mut sc = queues(
        StrategyKind::Random,
        10,
        0.5,
        LatencyDist::Exponential,
        Discipline::Fifo,
        100_000,
    );
    sc.clusters[0].capacity = None;
    sc.warmup = Duration::ZERO;
    let d = 20.0;
    sc.hedge = Some(HedgeConfig {
        delay: HedgeDelay::Fixed(Duration::from_millis(d as u64)),
        max: 1,
        budget_percent: 100.0,
    });
    assert_eq!(sc.protections(), "hedge");
    let r = run(&sc);
    let calls = r.requests as f64;
    let sent = (-d / S_MS).exp();
    let hedged = r.hedges as f64 / calls;
    // Binomial proportions over 400 000 calls: standard error 0.05 %; 0.3 % absolute.
    assert!((hedged - sent).abs() < 0.003, "hedged {hedged} vs {sent}");
    assert!(
        (r.hedges_won as f64 / calls - sent / 2.0).abs() < 0.003,
        "won {} of {}",
        r.hedges_won,
        r.hedges
    );
    assert!((r.extra_calls - hedged).abs() < 1e-12);
    let p99 = (S_MS * 100f64.ln() + d) / 2.0;
    assert!(
        (r.latency_ms.p99 - p99).abs() / p99 < 0.03,
        "p99 {} vs {p99}",
        r.latency_ms.p99
    );
    // The mean: E[min] = S (1 - e^(-d/S)) + e^(-d/S) S / 2.
    let mean = S_MS * (1.0 - sent) + sent * S_MS / 2.0;
    assert!(
        (r.latency_ms.mean - mean).abs() / mean < 0.01,
        "mean {} vs {mean}",
        r.latency_ms.mean
    );
}

/// A p95 delay hedges about 5 % of calls on its own; a 2 % budget holds hedges to 2 % of calls.
#[test]
fn hedges_follow_the_quantile_and_stay_within_the_budget() {
    let mut sc = queues(
        StrategyKind::Random,
        10,
        0.5,
        LatencyDist::Exponential,
        Discipline::Fifo,
        100_000,
    );
    sc.clusters[0].capacity = None;
    sc.warmup = Duration::from_secs(1);
    sc.hedge = Some(HedgeConfig {
        delay: "p95".parse().unwrap(),
        max: 1,
        budget_percent: 100.0,
    });
    let free = run(&sc);
    let share = free.hedges as f64 / free.requests as f64;
    // The delay is the p95 of first tries (a first try that lost to its hedge counted at the
    // time it had run), read at the middle of buckets 6 % wide: 5.2 % measured, 4.5 to 6 %
    // allowed.
    assert!((0.045..0.06).contains(&share), "p95 hedged {share}");
    sc.hedge.as_mut().unwrap().budget_percent = 2.0;
    let capped = run(&sc);
    let share = capped.hedges as f64 / capped.requests as f64;
    assert!(share <= 0.02 && share > 0.015, "2 % budget: {share}");
    assert!(capped.latency_ms.p999 > free.latency_ms.p999);
}
