//! Cost of keel-balance's hot path and of its table rebuilds.
//!
//! - `pick_finish_1t/<strategy>/<n>`: one `pick` + `finish(Success)` on one thread, n endpoints
//!   (`least-request+zones-*`: over three zones with zone-aware routing).
//! - `pick_finish_2t/<strategy>/<n>`: two threads doing pick + finish on one shared balancer;
//!   the time is per op of one thread while the other contends (equal to the 1-thread number
//!   under perfect scaling, larger with contention).
//! - `pick_finish_prompts/prefix-affinity/<n>`: prefix-affinity with a prompt of 30 blocks per
//!   pick (12 shared prefixes of 24 blocks, unique tails, estimates full: evictions every pick).
//! - `build/<strategy>/<n>`: `Balancer::new` (every strategy's tables built from scratch).
//! - `update_remove_one/<strategy>/<n>`: `Balancer::update` with one endpoint removed.
//!
//! Endpoints have weights 1, 2, 3, 1, 2, 3, ... (the strategies that honour weights see
//! unequal ones). `KEEL_BENCH_SIZES=10000` (a comma-separated list) runs only those sizes.
//!
//! Time is this process's CPU time by default, wall time with `KEEL_BENCH_CLOCK=wall`
//! (see common/clock.rs: the CPU clock keeps other processes' load out of the numbers).
//!
//! Run: `cargo bench -p keel-balance --bench pick` (bench/balance.sh runs it together with the
//! pingora comparison and prints the tables). Measurement times are short on purpose, so that
//! the whole run takes a few minutes on 2 cores.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use keel_balance::{
    mix64, Balancer, BalancerConfig, EndpointSpec, Outcome, PickContext, StrategyKind, ZoneMode,
    ZoneRouting,
};

#[path = "common/clock.rs"]
mod clock;
use clock::BenchClock;

/// Endpoint counts, or those of `KEEL_BENCH_SIZES`.
fn sizes() -> Vec<usize> {
    match std::env::var("KEEL_BENCH_SIZES") {
        Ok(list) => list
            .split(',')
            .map(|s| s.trim().parse().expect("KEEL_BENCH_SIZES: numbers"))
            .collect(),
        Err(_) => vec![10, 100, 1000, 10_000],
    }
}

/// Endpoints `127.a.b.c:80` of weights 1-3; the addresses are only hashed, never contacted.
fn endpoints(n: usize) -> Vec<EndpointSpec> {
    (0..n)
        .map(|i| {
            EndpointSpec::new(format!("127.1.{}.{}:80", i / 256, i % 256))
                .with_weight(1 + (i % 3) as u32)
                // Three zones, used only by the `+zones` configurations.
                .with_zone(["z0", "z1", "z2"][i % 3])
        })
        .collect()
}

/// Every strategy by its name, plus the hash strategies with bounded loads (c = 1.25).
fn configs() -> Vec<(String, BalancerConfig)> {
    let mut out: Vec<(String, BalancerConfig)> = StrategyKind::ALL
        .into_iter()
        .map(|k| (k.name().to_string(), BalancerConfig::new(k)))
        .collect();
    for k in [
        StrategyKind::RingHash,
        StrategyKind::Maglev,
        StrategyKind::Rendezvous,
    ] {
        let mut cfg = BalancerConfig::new(k);
        cfg.options.bounded_load = Some(1.25);
        out.push((format!("{}+bounded-1.25", k.name()), cfg));
    }
    // Zone-aware routing over three zones (keel's load rule, and Envoy's host-count rule):
    // the layer's cost on top of the strategy.
    for mode in [ZoneMode::Load, ZoneMode::HostCount] {
        let mut cfg = BalancerConfig::new(StrategyKind::LeastRequest);
        cfg.zone = Some("z0".into());
        cfg.zone_routing = Some(ZoneRouting {
            mode,
            ..ZoneRouting::default()
        });
        let m = if mode == ZoneMode::Load {
            "load"
        } else {
            "host-count"
        };
        out.push((format!("least-request+zones-{m}"), cfg));
    }
    out
}

/// One request: pick (with a fresh hash key, used only by the hash strategies) and finish it
/// 0.5-1.2 µs later on the driver's clock, so the latency strategies see varied samples.
#[inline]
fn pick_finish(lb: &Balancer, i: u64) {
    let now = Duration::from_nanos(i * 2_000);
    let ctx = PickContext::new(now).with_hash_key(mix64(i));
    let pick = lb
        .pick(&ctx)
        .expect("a balancer with endpoints always picks");
    let latency = Duration::from_nanos(500 + (i % 8) * 100);
    lb.finish(black_box(pick), Outcome::Success, now + latency);
}

fn bench_pick_finish(c: &mut Criterion<BenchClock>) {
    let clock = BenchClock::from_env();
    let mut one = c.benchmark_group("pick_finish_1t");
    for (name, cfg) in configs() {
        for &n in &sizes() {
            let lb = Balancer::new(cfg.clone(), &endpoints(n)).expect("valid config");
            let mut i = 0u64;
            one.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter(|| {
                    i += 1;
                    pick_finish(&lb, i);
                })
            });
        }
    }
    one.finish();

    let mut two = c.benchmark_group("pick_finish_2t");
    for (name, cfg) in configs() {
        for &n in &sizes() {
            let lb = Balancer::new(cfg.clone(), &endpoints(n)).expect("valid config");
            two.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter_custom(|iters| {
                    let start = clock.now();
                    std::thread::scope(|s| {
                        for t in 0..2u64 {
                            let lb = &lb;
                            s.spawn(move || {
                                // Disjoint key/time streams per thread.
                                let base = t << 40;
                                for i in 0..iters {
                                    pick_finish(lb, base + i);
                                }
                            });
                        }
                    });
                    // Each thread did `iters` ops: time per op of one contending thread.
                    clock.per_thread_since(start, 2)
                })
            });
        }
    }
    two.finish();
}

/// prefix-affinity with prompts: the estimates' lookups and updates on top of the pick.
fn bench_prompts(c: &mut Criterion<BenchClock>) {
    let prompts: Vec<Vec<u64>> = (0..600u64)
        .map(|r| {
            (0..30u64)
                .map(|k| mix64(if k < 24 { r % 12 } else { 1_000 + r } << 32 | k))
                .collect()
        })
        .collect();
    let mut group = c.benchmark_group("pick_finish_prompts");
    for &n in &sizes() {
        let cfg = BalancerConfig::new(StrategyKind::PrefixAffinity);
        let lb = Balancer::new(cfg, &endpoints(n)).expect("valid config");
        let mut i = 0u64;
        group.bench_with_input(BenchmarkId::new("prefix-affinity", n), &n, |b, _| {
            b.iter(|| {
                i += 1;
                let now = Duration::from_nanos(i * 2_000);
                let ctx = PickContext::new(now).with_prefix(&prompts[i as usize % prompts.len()]);
                let pick = lb.pick(&ctx).expect("an endpoint");
                lb.finish(
                    black_box(pick),
                    Outcome::Success,
                    now + Duration::from_nanos(700),
                );
            })
        });
    }
    group.finish();
}

fn bench_tables(c: &mut Criterion<BenchClock>) {
    let mut build = c.benchmark_group("build");
    for (name, cfg) in configs() {
        for &n in &sizes() {
            let specs = endpoints(n);
            build.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter(|| Balancer::new(black_box(cfg.clone()), black_box(&specs)).unwrap())
            });
        }
    }
    build.finish();

    // Round-robin has no table: its row is the cost of carrying endpoint state over alone.
    let mut update = c.benchmark_group("update_remove_one");
    for (name, cfg) in configs() {
        for &n in &sizes() {
            let specs = endpoints(n);
            // Remove one from the middle.
            let mut fewer = specs.clone();
            fewer.remove(n / 2);
            update.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter_batched(
                    || Balancer::new(cfg.clone(), &specs).unwrap(),
                    |lb| {
                        lb.update(black_box(&fewer), Duration::from_secs(1))
                            .unwrap();
                        lb // dropped outside the timed part
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    update.finish();
}

fn config() -> Criterion<BenchClock> {
    let clock = BenchClock::from_env();
    eprintln!("measuring {} (KEEL_BENCH_CLOCK=cpu|wall)", clock.name());
    Criterion::default()
        .with_measurement(clock)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_pick_finish, bench_prompts, bench_tables
}
criterion_main!(benches);
