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
}
