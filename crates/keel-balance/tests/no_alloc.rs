//! A pick and its finish allocate nothing, with priority levels, zone routing (both modes) and
//! orca-wrr as well as without: a counting global allocator over 2,000 pick + finish after a
//! warm-up, counting the allocations of the picking thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::time::Duration;

use keel_balance::{
    Balancer, BalancerConfig, EndpointSpec, LoadReport, Outcome, PickContext, StrategyKind,
    Utilization, ZoneMode, ZoneRouting,
};

struct Counting;

thread_local! {
    /// Counted on the test's thread only, and per thread: the harness's own thread allocates
    /// meanwhile, and the tests run at once on threads of their own.
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ALLOCATIONS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Allocations made so far on this thread while it counted.
fn allocations() -> usize {
    ALLOCATIONS.with(|c| c.get())
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTED.with(|c| c.get()) {
            ALLOCATIONS.with(|c| c.set(c.get() + 1));
        }
        // SAFETY: forwarded as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as given.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn specs() -> Vec<EndpointSpec> {
    (0..12)
        .map(|i| {
            EndpointSpec::new(format!("10.0.{}.{}:80", i / 4, i % 4))
                .with_zone(["a", "b", "c"][i / 4])
                .with_priority(u32::from(i % 4 == 3))
        })
        .collect()
}

#[test]
fn picks_allocate_nothing() {
    COUNTED.with(|c| c.set(true));
    let zoned = |mode| {
        let mut c = BalancerConfig::new(StrategyKind::LeastRequest);
        c.zone = Some("a".into());
        c.zone_routing = Some(ZoneRouting {
            mode,
            threshold: 1.0,
            ..ZoneRouting::default()
        });
        c
    };
    let mut orca = BalancerConfig::new(StrategyKind::OrcaWrr);
    orca.options.blackout_period = Duration::ZERO;
    let configs = [
        (
            "least-request",
            BalancerConfig::new(StrategyKind::LeastRequest),
        ),
        ("ring-hash", BalancerConfig::new(StrategyKind::RingHash)),
        ("zones load", zoned(ZoneMode::Load)),
        ("zones host-count", zoned(ZoneMode::HostCount)),
        ("orca-wrr", orca),
    ];
    for (name, config) in configs {
        let lb = Balancer::new(config, &specs()).unwrap();
        let mut t = Duration::from_secs(1);
        let run = |n: usize, t: &mut Duration| {
            for i in 0..n {
                *t += Duration::from_micros(50);
                let p = lb
                    .pick(&PickContext::new(*t).with_hash_key(i as u64))
                    .unwrap();
                let id = p.id();
                // Some held open, so that zones fill and spill.
                if i % 3 == 0 {
                    std::mem::forget(p);
                } else {
                    lb.finish(p, Outcome::Success, *t + Duration::from_micros(20));
                }
                let load = LoadReport {
                    in_flight: (i % 5) as u32,
                    latency: Duration::from_micros(20),
                };
                lb.report_load(id, load, *t);
                let u = Utilization {
                    cpu: 0.2 + (i % 4) as f64 * 0.1,
                    qps: 100.0,
                    ..Utilization::default()
                };
                lb.report_utilization(id, u, *t);
            }
        };
        run(200, &mut t);
        let before = allocations();
        // The counter counts: building a balancer allocated.
        assert!(before > 0);
        run(2_000, &mut t);
        let allocated = allocations() - before;
        assert_eq!(
            allocated, 0,
            "{name}: {allocated} allocations in 2,000 picks"
        );
    }
}

/// prefix-affinity in steady state: prompts of 30 blocks from 12 shared prefixes with unique
/// tails, more blocks than the estimates hold (evictions on every pick), some held open.
#[test]
fn prefix_affinity_picks_allocate_nothing_once_its_estimates_are_full() {
    COUNTED.with(|c| c.set(true));
    let mut config = BalancerConfig::new(StrategyKind::PrefixAffinity);
    config.options.cache_blocks = 96;
    let eps: Vec<EndpointSpec> = (0..3)
        .map(|i| EndpointSpec::new(format!("10.1.0.{i}:80")))
        .collect();
    let lb = Balancer::new(config, &eps).unwrap();
    // Block names made once, outside the count: the proxy names them per request.
    let prompts: Vec<Vec<u64>> = (0..600u64)
        .map(|r| {
            let group = r % 12;
            (0..30u64)
                .map(|k| {
                    let owner = if k < 24 { group } else { 1_000 + r };
                    keel_balance::mix64(owner << 32 | k)
                })
                .collect()
        })
        .collect();
    let mut t = Duration::from_secs(1);
    let mut held = Vec::with_capacity(8);
    let mut run = |n: usize, t: &mut Duration| {
        for i in 0..n {
            *t += Duration::from_micros(50);
            let ctx = PickContext::new(*t).with_prefix(&prompts[i % prompts.len()]);
            let p = lb.pick(&ctx).unwrap();
            if i % 4 == 0 && held.len() < held.capacity() {
                held.push(p);
            } else {
                lb.finish(p, Outcome::Success, *t + Duration::from_micros(20));
            }
            if held.len() == held.capacity() {
                for p in held.drain(..) {
                    lb.finish(p, Outcome::Success, *t);
                }
            }
        }
    };
    run(3_000, &mut t);
    let before = allocations();
    run(3_000, &mut t);
    let allocated = allocations() - before;
    assert_eq!(allocated, 0, "{allocated} allocations in 3,000 picks");
}
