//! keel-balance and pingora-load-balancing selection cost, side by side in one run.
//!
//! Groups (the parameter is the number of backends):
//! - `compare_1t/<impl>.<strategy>/<n>`: one selection on one thread.
//!   - `pingora.*`: `LoadBalancer::select(key, 256)`; pingora has no outcome to record.
//!   - `keel.*`: `Balancer::pick` + `finish(Success)`: keel's whole per-request cost, including
//!     the in-flight count and outcome that pingora does not keep.
//!   - `keel-pick-only.*`: `pick` and drop the pick (a cancel: releases the in-flight slot).
//! - `compare_2t/...`: two threads selecting from one shared balancer; time per op of one
//!   thread while the other contends.
//! - `compare_build/<impl>.<table>/<n>`: building the consistent-hash table alone.
//!
//! Hash strategies get their key as bytes (a request path) so that both sides pay for hashing
//! it: pingora hashes inside `select`, keel through `keel_balance::hash_key`.
//!
//! Time is this process's CPU time by default, wall time with `KEEL_BENCH_CLOCK=wall` (see
//! crates/keel-balance/benches/common/clock.rs).
//!
//! Run: `bash bench/balance.sh` (or `cargo bench --bench compare` in this directory).

use std::collections::BTreeSet;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use keel_balance::{
    hash_key, Balancer, BalancerConfig, EndpointSpec, Outcome, PickContext, StrategyKind,
};
use pingora_load_balancing::selection::{BackendSelection, Consistent, Random, RoundRobin};
use pingora_load_balancing::{Backend, LoadBalancer};

#[path = "../../../crates/keel-balance/benches/common/clock.rs"]
mod clock;
use clock::BenchClock;

const SIZES: [usize; 3] = [10, 100, 1000];
/// Pingora's documented example value; only the first candidate is ever taken here (all
/// backends are ready), so it does not change the cost.
const MAX_ITERATIONS: usize = 256;
/// Distinct request keys, cycled.
const KEYS: usize = 4096;

/// `127.1.a.b:80`: hashed and parsed, never contacted.
fn addresses(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("127.1.{}.{}:80", i / 256, i % 256))
        .collect()
}

fn keys() -> Vec<Vec<u8>> {
    (0..KEYS)
        .map(|i| format!("/objects/{i:08}").into_bytes())
        .collect()
}

/// The selectors under test, behind one call so that the 1- and 2-thread loops are shared.
enum Subject {
    PingoraRoundRobin(LoadBalancer<RoundRobin>),
    PingoraRandom(LoadBalancer<Random>),
    PingoraKetama(LoadBalancer<Consistent>),
    /// keel; `finish` false = pick and drop.
    Keel {
        lb: Balancer,
        hash: bool,
        finish: bool,
    },
}

impl Subject {
    fn all(n: usize) -> Vec<(String, Subject)> {
        let addrs = addresses(n);
        let addr_strs = || addrs.iter().map(|s| s.as_str());
        let specs: Vec<EndpointSpec> = addrs.iter().map(EndpointSpec::new).collect();
        let mut out = vec![
            (
                "pingora.round-robin".to_string(),
                Subject::PingoraRoundRobin(LoadBalancer::try_from_iter(addr_strs()).unwrap()),
            ),
            (
                "pingora.random".to_string(),
                Subject::PingoraRandom(LoadBalancer::try_from_iter(addr_strs()).unwrap()),
            ),
            (
                "pingora.ketama".to_string(),
                Subject::PingoraKetama(LoadBalancer::try_from_iter(addr_strs()).unwrap()),
            ),
        ];
        for finish in [true, false] {
            for kind in [
                StrategyKind::RoundRobin,
                StrategyKind::Random,
                StrategyKind::LeastRequest,
                StrategyKind::RingHash,
            ] {
                let prefix = if finish { "keel" } else { "keel-pick-only" };
                let lb = Balancer::new(BalancerConfig::new(kind), &specs).unwrap();
                out.push((
                    format!("{prefix}.{}", kind.name()),
                    Subject::Keel {
                        lb,
                        hash: kind.is_hash(),
                        finish,
                    },
                ));
            }
        }
        out
    }

    /// One request number `i`: select, and for keel finish (or drop) the pick.
    #[inline]
    fn run(&self, keys: &[Vec<u8>], i: u64) {
        let key = &keys[i as usize % keys.len()];
        match self {
            Subject::PingoraRoundRobin(lb) => {
                black_box(lb.select(b"", MAX_ITERATIONS).expect("a backend"));
            }
            Subject::PingoraRandom(lb) => {
                black_box(lb.select(b"", MAX_ITERATIONS).expect("a backend"));
            }
            Subject::PingoraKetama(lb) => {
                black_box(lb.select(key, MAX_ITERATIONS).expect("a backend"));
            }
            Subject::Keel { lb, hash, finish } => {
                let now = Duration::from_nanos(i * 2_000);
                let mut ctx = PickContext::new(now);
                if *hash {
                    ctx = ctx.with_hash_key(hash_key(key));
                }
                let pick = lb.pick(&ctx).expect("an endpoint");
                if *finish {
                    lb.finish(
                        black_box(pick),
                        Outcome::Success,
                        now + Duration::from_nanos(700),
                    );
                } else {
                    drop(black_box(pick));
                }
            }
        }
    }

    fn two_threads(&self) -> bool {
        // Pick-only is a 1-thread diagnostic; the 2-thread group compares whole requests.
        !matches!(self, Subject::Keel { finish: false, .. })
    }
}

fn bench_select(c: &mut Criterion<BenchClock>) {
    let clock = BenchClock::from_env();
    let keys = keys();
    let mut one = c.benchmark_group("compare_1t");
    for n in SIZES {
        for (name, subject) in Subject::all(n) {
            let mut i = 0u64;
            one.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter(|| {
                    i += 1;
                    subject.run(&keys, i);
                })
            });
        }
    }
    one.finish();

    let mut two = c.benchmark_group("compare_2t");
    for n in SIZES {
        for (name, subject) in Subject::all(n) {
            if !subject.two_threads() {
                continue;
            }
            two.bench_with_input(BenchmarkId::new(&name, n), &n, |b, _| {
                b.iter_custom(|iters| {
                    let start = clock.now();
                    std::thread::scope(|s| {
                        for t in 0..2u64 {
                            let (subject, keys) = (&subject, &keys);
                            s.spawn(move || {
                                let base = t * (KEYS as u64 / 2);
                                for i in 0..iters {
                                    subject.run(keys, base + i);
                                }
                            });
                        }
                    });
                    clock.per_thread_since(start, 2)
                })
            });
        }
    }
    two.finish();
}

fn bench_build(c: &mut Criterion<BenchClock>) {
    let mut build = c.benchmark_group("compare_build");
    for n in SIZES {
        let addrs = addresses(n);
        let backends: BTreeSet<Backend> = addrs.iter().map(|a| Backend::new(a).unwrap()).collect();
        build.bench_with_input(BenchmarkId::new("pingora.ketama", n), &n, |b, _| {
            b.iter(|| Consistent::build(black_box(&backends)))
        });
        let specs: Vec<EndpointSpec> = addrs.iter().map(EndpointSpec::new).collect();
        let cfg = BalancerConfig::new(StrategyKind::RingHash);
        build.bench_with_input(BenchmarkId::new("keel.ring-hash", n), &n, |b, _| {
            b.iter(|| Balancer::new(black_box(cfg.clone()), black_box(&specs)).unwrap())
        });
    }
    build.finish();
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
    targets = bench_select, bench_build
}
criterion_main!(benches);
