//! Properties over random inputs (proptest).

use std::time::Duration;

use keel_balance::{
    Balancer, BalancerConfig, EndpointSpec, Outcome, Pick, PickContext, StrategyKind,
};
use proptest::prelude::*;

const T0: Duration = Duration::from_secs(1);

fn weighted(weights: &[u32]) -> Vec<EndpointSpec> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| EndpointSpec::new(format!("e{i}")).with_weight(w))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Over one cycle of sum(weights) picks, weighted round-robin gives every endpoint exactly
    /// its weight, and after every pick each endpoint is less than two picks from its share.
    #[test]
    fn smooth_wrr_cycle_is_exact(weights in prop::collection::vec(1u32..20, 1..12)) {
        let b = Balancer::new(BalancerConfig::new(StrategyKind::WeightedRoundRobin), &weighted(&weights)).unwrap();
        let total: u32 = weights.iter().sum();
        let mut counts = vec![0u32; weights.len()];
        for t in 1..=total {
            let p = b.pick(&PickContext::new(T0)).unwrap();
            counts[p.index()] += 1;
            b.finish(p, Outcome::Success, T0);
            for (c, w) in counts.iter().zip(&weights) {
                let share = f64::from(t) * f64::from(*w) / f64::from(total);
                prop_assert!((f64::from(*c) - share).abs() < 2.0, "pick {}: {:?}", t, counts);
            }
        }
        prop_assert_eq!(counts, weights);
    }

    /// Whatever the strategy and the order in which calls finish, fail or are cancelled,
    /// in-flight counts return to zero and every outcome is counted once.
    #[test]
    fn in_flight_counts_balance(
        kind in prop::sample::select(StrategyKind::ALL.to_vec()),
        n in 1usize..8,
        ops in prop::collection::vec((any::<bool>(), 0u8..3, any::<u64>()), 1..200),
    ) {
        let specs: Vec<EndpointSpec> = (0..n).map(|i| EndpointSpec::new(format!("e{i}"))).collect();
        let b = Balancer::new(BalancerConfig::new(kind), &specs).unwrap();
        let mut open: Vec<Pick> = Vec::new();
        let mut finished = 0u64;
        for (start, how, r) in ops {
            if start || open.is_empty() {
                open.push(b.pick(&PickContext::new(T0).with_hash_key(r)).unwrap());
            } else {
                let p = open.swap_remove((r % open.len() as u64) as usize);
                match how {
                    0 => { b.finish(p, Outcome::Success, T0); finished += 1; }
                    1 => { b.finish(p, Outcome::Failure, T0); finished += 1; }
                    _ => drop(p),
                }
            }
            let in_flight: u32 = b.endpoints().iter().map(|e| e.in_flight()).sum();
            prop_assert_eq!(in_flight as usize, open.len());
        }
        drop(open);
        let eps = b.endpoints();
        prop_assert!(eps.iter().all(|e| e.in_flight() == 0));
        let counted: u64 = eps.iter().map(|e| e.outcomes().0 + e.outcomes().1).sum();
        prop_assert_eq!(counted, finished);
    }

    /// least-connections (a tournament tree, not a scan): whatever the weights, the order of
    /// starts and ends, and updates that add and remove endpoints, every pick goes to an
    /// endpoint whose calls in flight per unit of weight are the least of all.
    #[test]
    fn least_connections_always_picks_a_least_loaded_endpoint(
        weights in prop::collection::vec(1u32..5, 1..40),
        ops in prop::collection::vec((0u8..8, any::<u64>()), 1..400),
    ) {
        let b = Balancer::new(BalancerConfig::new(StrategyKind::LeastConnections), &weighted(&weights)).unwrap();
        let mut specs = weighted(&weights);
        let mut open: Vec<Pick> = Vec::new();
        let mut added = weights.len();
        for (op, r) in ops {
            match op {
                0..=3 => {
                    let eps = b.endpoints();
                    let load = |e: &keel_balance::Endpoint| f64::from(e.in_flight()) / f64::from(e.weight());
                    let least = eps.iter().map(|e| load(e)).fold(f64::INFINITY, f64::min);
                    let p = b.pick(&PickContext::new(T0)).unwrap();
                    let got = (f64::from(p.endpoint().in_flight()) - 1.0) / f64::from(p.endpoint().weight());
                    prop_assert!((got - least).abs() < 1e-12, "picked {} at {}, least {}", p.index(), got, least);
                    open.push(p);
                }
                4..=6 if !open.is_empty() => {
                    let p = open.swap_remove((r % open.len() as u64) as usize);
                    b.finish(p, Outcome::Success, T0);
                }
                7 => {
                    // Add one, or remove one (not the last).
                    if r % 2 == 0 || specs.len() == 1 {
                        specs.push(EndpointSpec::new(format!("e{added}")).with_weight(1 + (r >> 8) as u32 % 4));
                        added += 1;
                    } else {
                        specs.remove((r >> 8) as usize % specs.len());
                    }
                    b.update(&specs, T0).unwrap();
                }
                _ => {}
            }
        }
    }

    /// least-time (bands of latency, not a scan): every pick goes to an endpoint without a
    /// sample or whose estimate, decayed to now (e^(-age / decay)), is within the tolerance
    /// (0.5) of the fastest's, plus at most one band (1/32 here, a band being 1/64 of an
    /// octave), plus what the estimates decayed since the bands last read them (each endpoint
    /// is re-read at least every n picks: at most 30 x 200 ms here, e^(-6 s / 1000 s).
    #[test]
    fn least_time_picks_within_the_tolerance_of_the_fastest(
        latencies_ms in prop::collection::vec(1u64..200, 1..30),
        picks in 1usize..300,
    ) {
        let specs: Vec<EndpointSpec> = (0..latencies_ms.len()).map(|i| EndpointSpec::new(format!("e{i}"))).collect();
        let mut cfg = BalancerConfig::new(StrategyKind::LeastTime);
        cfg.options.decay = Duration::from_secs(1000);
        let b = Balancer::new(cfg, &specs).unwrap();
        let mut last_sample = vec![T0; specs.len()];
        let mut now = T0;
        for _ in 0..picks {
            let eps = b.endpoints();
            let decayed = |i: usize| {
                eps[i].latency_estimate().map(|e| {
                    e.as_secs_f64() * (-(now - last_sample[i]).as_secs_f64() / 1000.0).exp()
                })
            };
            let fastest = (0..eps.len()).filter_map(decayed).fold(f64::INFINITY, f64::min);
            let p = b.pick(&PickContext::new(now)).unwrap();
            if let Some(est) = decayed(p.index()) {
                let limit = fastest * 1.5 * (1.0 + 1.0 / 32.0) * (6.0f64 / 1000.0).exp();
                prop_assert!(est <= limit, "{} picked, fastest {}", est, fastest);
            }
            let took = Duration::from_millis(latencies_ms[p.index()]);
            let i = p.index();
            b.finish(p, Outcome::Success, now + took);
            now += took;
            last_sample[i] = now;
        }
    }
}
