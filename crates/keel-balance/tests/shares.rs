//! Shares of picks per endpoint, for every strategy: weights honoured at zero concurrency,
//! equal shares with calls in flight, and a new endpoint's share right after an update.

use std::collections::VecDeque;
use std::time::Duration;

use keel_balance::{
    mix64, Balancer, BalancerConfig, EndpointSpec, Outcome, Pick, PickContext, StrategyKind,
};

fn specs(weights: &[u32]) -> Vec<EndpointSpec> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| EndpointSpec::new(format!("10.2.0.{i}:80")).with_weight(w))
        .collect()
}

/// A balancer with default options, except ring-hash's vnodes: with the default 160 per
/// endpoint, a ring of 5 endpoints has arcs about 1/sqrt(160) = 8 % off their weight's share
/// (a property of the ring, tested in strategies.rs); 4096 bring that to 1.6 %, so that these
/// tests see the weighting, not the ring's variance.
fn balancer(kind: StrategyKind, weights: &[u32]) -> Balancer {
    let mut cfg = BalancerConfig::new(kind);
    cfg.options.vnodes = 4096;
    Balancer::new(cfg, &specs(weights)).unwrap()
}

/// The share each endpoint should get: its weight's share, or an equal share for the
/// strategies that ignore weights.
fn expected(kind: StrategyKind, weights: &[u32]) -> Vec<f64> {
    let ignores = matches!(
        kind,
        StrategyKind::RoundRobin | StrategyKind::Random | StrategyKind::Prequal
    );
    let total: u32 = weights.iter().sum();
    weights
        .iter()
        .map(|&w| {
            if ignores {
                1.0 / weights.len() as f64
            } else {
                f64::from(w) / f64::from(total)
            }
        })
        .collect()
}

/// Makes `picks` picks on a virtual clock: every call takes `latency`, and `in_flight` calls
/// are outstanding at each pick (the oldest finishes first). Returns the picks per index.
fn drive(
    b: &Balancer,
    picks: u64,
    in_flight: usize,
    latency: Duration,
    start: Duration,
) -> Vec<u64> {
    let mut counts = vec![0u64; b.endpoints().len()];
    let mut open: VecDeque<(Pick, Duration)> = VecDeque::new();
    // Picks are spaced so that exactly `in_flight` calls overlap.
    let spacing = latency / in_flight.max(1) as u32;
    let mut now = start;
    for k in 0..picks {
        while open.len() >= in_flight.max(1) {
            let (p, at) = open.pop_front().unwrap();
            now = now.max(at);
            b.finish(p, Outcome::Success, at);
        }
        let ctx = PickContext::new(now).with_hash_key(mix64(k ^ 0x5eed));
        let p = b.pick(&ctx).expect("all endpoints are available");
        counts[p.index()] += 1;
        let done = now + latency;
        if in_flight == 0 {
            b.finish(p, Outcome::Success, done);
        } else {
            open.push_back((p, done));
        }
        now += spacing;
    }
    for (p, at) in open {
        b.finish(p, Outcome::Success, at);
    }
    counts
}

fn shares(counts: &[u64]) -> Vec<f64> {
    let total: u64 = counts.iter().sum();
    counts.iter().map(|&c| c as f64 / total as f64).collect()
}

fn assert_close(kind: StrategyKind, got: &[f64], want: &[f64], tolerance: f64, what: &str) {
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= tolerance,
            "{kind} ({what}): shares {got:.4?}, expected {want:.4?}"
        );
    }
}

/// (a) Weights 2,1,1,1,1 at zero concurrency (each pick finished at once, taking no time):
/// every share within 0.02 of its weight's share over 100,000 picks.
#[test]
fn weights_are_honoured_at_zero_concurrency() {
    let weights = [2, 1, 1, 1, 1];
    for kind in StrategyKind::ALL {
        let b = balancer(kind, &weights);
        let counts = drive(&b, 100_000, 0, Duration::ZERO, Duration::from_secs(1));
        assert_close(
            kind,
            &shares(&counts),
            &expected(kind, &weights),
            0.02,
            "zero concurrency",
        );
    }
}

/// The same with calls that take 10 ms each, one at a time: the latency strategies then see
/// real (equal) estimates instead of zeros.
#[test]
fn weights_are_honoured_one_call_at_a_time_with_equal_latencies() {
    let weights = [2, 1, 1, 1, 1];
    for kind in StrategyKind::ALL {
        let b = balancer(kind, &weights);
        let counts = drive(
            &b,
            30_000,
            1,
            Duration::from_millis(10),
            Duration::from_secs(1),
        );
        // 30,000 picks: binomial sd of a 1/3 share is 0.003; 0.02 leaves room for the
        // hash strategies' table imbalance.
        assert_close(
            kind,
            &shares(&counts),
            &expected(kind, &weights),
            0.02,
            "one in flight, 10 ms",
        );
    }
}

/// (b) Equal endpoints with 8 calls in flight: equal shares within 0.02.
#[test]
fn equal_endpoints_share_equally_with_eight_in_flight() {
    let weights = [1; 5];
    for kind in StrategyKind::ALL {
        let b = balancer(kind, &weights);
        let counts = drive(
            &b,
            100_000,
            8,
            Duration::from_millis(10),
            Duration::from_secs(1),
        );
        assert_close(kind, &shares(&counts), &[0.2; 5], 0.02, "8 in flight");
    }
}

/// (c) An endpoint added by `update` gets at least half its fair share of the next 10,000
/// picks, once the others have latency estimates (the cold-start case).
#[test]
fn an_added_endpoint_gets_at_least_half_its_share() {
    for kind in StrategyKind::ALL {
        for in_flight in [1, 8] {
            let all = specs(&[1; 5]);
            let mut cfg = BalancerConfig::new(kind);
            cfg.options.vnodes = 4096;
            let b = Balancer::new(cfg, &all[..4]).unwrap();
            let latency = Duration::from_millis(10);
            drive(&b, 2_000, in_flight, latency, Duration::from_secs(1));
            let at = Duration::from_secs(100);
            b.update(&all, at).unwrap();
            let counts = drive(&b, 10_000, in_flight, latency, at);
            let new_share = counts[4] as f64 / 10_000.0;
            assert!(
                new_share >= 0.5 * 0.2,
                "{kind}, {in_flight} in flight: the new endpoint got {new_share} ({counts:?})"
            );
        }
    }
}
