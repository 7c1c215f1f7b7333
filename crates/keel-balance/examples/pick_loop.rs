//! Picks and finishes N calls on one strategy, sequentially (for whole-process timing).
use keel_balance::{Balancer, BalancerConfig, EndpointSpec, Outcome, PickContext, StrategyKind};
use std::time::Duration;

fn main() {
    let mut args = std::env::args().skip(1);
    let kind: StrategyKind = args.next().unwrap().parse().unwrap();
    let n: u64 = args.next().unwrap().parse().unwrap();
    let eps: usize = args.next().map(|s| s.parse().unwrap()).unwrap_or(10);
    let specs: Vec<_> = (0..eps)
        .map(|i| EndpointSpec::new(format!("10.0.0.{i}:80")))
        .collect();
    let b = Balancer::new(BalancerConfig::new(kind), &specs).unwrap();
    let mut sum = 0usize;
    for i in 0..n {
        let now = Duration::from_micros(i);
        let p = b
            .pick(&PickContext::new(now).with_hash_key(keel_balance::mix64(i)))
            .unwrap();
        sum += p.index();
        b.finish(p, Outcome::Success, now + Duration::from_micros(1));
    }
    println!("{sum}");
}
