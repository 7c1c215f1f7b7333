//! Outlier ejection, panic threshold and slow start, driven on a virtual clock.

use std::time::Duration;

use keel_balance::{
    Balancer, BalancerConfig, EndpointSpec, FailureRate, Outcome, OutlierConfig, PickContext,
    SlowStartConfig, StrategyKind,
};

fn specs(n: usize) -> Vec<EndpointSpec> {
    (0..n)
        .map(|i| EndpointSpec::new(format!("127.0.0.1:{}", 9001 + i)))
        .collect()
}

fn s(v: u64) -> Duration {
    Duration::from_secs(v)
}

fn outlier(consecutive: u32, max_percent: f64) -> OutlierConfig {
    OutlierConfig {
        consecutive_failures: consecutive,
        base_ejection_time: s(10),
        max_ejection_time: s(25),
        max_ejection_percent: max_percent,
        interval: s(10),
        failure_rate: None,
        shared: None,
    }
}

/// Sends `calls` calls at `now` through round-robin, failing every call to the endpoints in
/// `bad`; returns how many reached a bad endpoint.
fn drive(b: &Balancer, now: Duration, calls: usize, bad: &[usize]) -> usize {
    let mut hits = 0;
    for _ in 0..calls {
        let p = b.pick(&PickContext::new(now)).unwrap();
        let failed = bad.contains(&p.index());
        hits += failed as usize;
        let outcome = if failed {
            Outcome::Failure
        } else {
            Outcome::Success
        };
        b.finish(p, outcome, now);
    }
    hits
}

#[test]
fn consecutive_failures_eject_for_base_times_count_then_return() {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(outlier(3, 50.0));
    let b = Balancer::new(cfg, &specs(5)).unwrap();
    let bad = b.endpoints()[2].clone();

    // Round-robin: every 5th call hits endpoint 2; the third failure ejects it.
    assert_eq!(drive(&b, s(1), 15, &[2]), 3);
    assert_eq!(bad.ejected_until(s(1)), Some(s(11)), "base 10 s x 1");
    assert_eq!(drive(&b, s(5), 100, &[2]), 0, "ejected: no traffic");

    // Back at expiry, on probation: its first failure ejects it again, for 2 x base.
    assert_eq!(bad.ejected_until(s(11)), None);
    assert_eq!(drive(&b, s(11), 15, &[2]), 1);
    assert_eq!(bad.ejected_until(s(11)), Some(s(31)));
    // Third in a row: capped at max_ejection_time (25 s, not 30 s).
    drive(&b, s(31), 15, &[2]);
    assert_eq!(bad.ejected_until(s(31)), Some(s(56)));
    assert_eq!(b.status(s(31))[2].ejections, 3);
}

/// One endpoint of five answering with a failure forever, under steady traffic (100 calls a
/// second, round-robin, keel's default outlier detection: 5 failures in a row, 30 s doubling
/// up to 300 s, 10 s interval): the failed calls it costs in each of the first two hours.
fn failures_per_hour_of_an_endpoint_failing_forever() -> (usize, usize) {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(OutlierConfig::default());
    let b = Balancer::new(cfg, &specs(5)).unwrap();
    let mut hours = [0usize; 2];
    for tick in 0..2 * 3600 * 100u64 {
        let now = Duration::from_millis(tick * 10);
        let p = b.pick(&PickContext::new(now)).unwrap();
        let failed = p.index() == 4;
        hours[(tick / (3600 * 100)) as usize] += failed as usize;
        let outcome = if failed {
            Outcome::Failure
        } else {
            Outcome::Success
        };
        b.finish(p, outcome, now + Duration::from_millis(4));
    }
    (hours[0], hours[1])
}

#[test]
fn an_endpoint_failing_forever_costs_one_call_per_ejection() {
    // Ejections of 30, 60, ..., 300 s end at 30, 90, ..., 1,650 s, then every 300 s (1,950 to
    // 3,450 s); each return costs one failed call, the first ejection five in a row:
    // 5 + 10 + 6 = 21 in the first hour, 12 an hour after. Without the half-open return every
    // ejection cost five: 85 and 60. A fixed clock and round-robin: exact counts.
    let (first, second) = failures_per_hour_of_an_endpoint_failing_forever();
    assert_eq!((first, second), (21, 12));
}

#[test]
fn ejection_multiplier_decays_while_in_service() {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(outlier(3, 50.0));
    let b = Balancer::new(cfg, &specs(5)).unwrap();
    drive(&b, s(1), 15, &[2]);
    drive(&b, s(11), 15, &[2]); // second ejection, until 31 s
                                // 50 s healthy after returning at 31 s: five intervals, multiplier back to 0, so 1 x base.
    drive(&b, s(81), 15, &[2]);
    assert_eq!(b.endpoints()[2].ejected_until(s(81)), Some(s(91)));
}

#[test]
fn success_resets_consecutive_count() {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(outlier(3, 50.0));
    let b = Balancer::new(cfg, &specs(1)).unwrap();
    for round in 0..10 {
        for outcome in [Outcome::Failure, Outcome::Failure, Outcome::Success] {
            let p = b.pick(&PickContext::new(s(1))).unwrap();
            b.finish(p, outcome, s(1));
        }
        assert_eq!(b.endpoints()[0].ejected_until(s(1)), None, "round {round}");
    }
}

#[test]
fn max_ejection_percent_caps_ejections_rounding_down_at_least_one() {
    for (n, percent, expect) in [(5, 50.0, 2), (5, 10.0, 1), (10, 35.0, 3), (4, 100.0, 4)] {
        let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
        cfg.outlier_detection = Some(outlier(1, percent));
        cfg.panic_threshold = 0.0;
        let b = Balancer::new(cfg, &specs(n)).unwrap();
        // Every endpoint fails every call: only the cap stops the ejections.
        for _ in 0..(n * 4) {
            if let Some(p) = b.pick(&PickContext::new(s(1))) {
                b.finish(p, Outcome::Failure, s(1));
            }
        }
        let ejected = b
            .endpoints()
            .iter()
            .filter(|e| e.ejected_until(s(1)).is_some())
            .count();
        assert_eq!(ejected, expect, "n={n} max={percent}%");
    }
}

#[test]
fn failure_rate_ejects_only_with_enough_volume() {
    let mut od = outlier(0, 50.0);
    od.failure_rate = Some(FailureRate {
        threshold_percent: 50.0,
        minimum_requests: 20,
    });
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(od);
    let b = Balancer::new(cfg, &specs(1)).unwrap();
    let e = b.endpoints()[0].clone();
    // Alternating failure/success: 50 % failures, ejected once 20 outcomes are in.
    for i in 0..19 {
        let p = b.pick(&PickContext::new(s(1))).unwrap();
        let o = if i % 2 == 0 {
            Outcome::Failure
        } else {
            Outcome::Success
        };
        b.finish(p, o, s(1));
    }
    assert_eq!(e.ejected_until(s(1)), None, "19 outcomes: below the volume");
    let p = b.pick(&PickContext::new(s(1))).unwrap();
    b.finish(p, Outcome::Failure, s(1));
    assert!(e.ejected_until(s(1)).is_some());
}

#[test]
fn panic_threshold_balances_over_all_when_too_few_are_healthy() {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.panic_threshold = 50.0;
    let b = Balancer::new(cfg, &specs(4)).unwrap();
    let eps = b.endpoints();
    b.set_healthy(eps[0].id(), false, s(1));
    // 3 of 4 healthy (75 %): the unhealthy one gets nothing.
    assert_eq!(drive(&b, s(1), 100, &[0]), 0);
    assert!(!b.is_panicking(s(1)));
    b.set_healthy(eps[1].id(), false, s(1));
    b.set_healthy(eps[2].id(), false, s(1));
    // 1 of 4 healthy (25 % < 50 %): panic, all four share the traffic.
    assert!(b.is_panicking(s(1)));
    assert_eq!(drive(&b, s(1), 100, &[0, 1, 2]), 75);
    // Threshold 0: never panic, the single healthy endpoint takes everything.
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.panic_threshold = 0.0;
    let b = Balancer::new(cfg, &specs(4)).unwrap();
    for e in &b.endpoints()[..3] {
        b.set_healthy(e.id(), false, s(1));
    }
    assert_eq!(drive(&b, s(1), 100, &[0, 1, 2]), 0);
    // All unhealthy and no panic mode: nothing to pick.
    b.set_healthy(b.endpoints()[3].id(), false, s(1));
    assert!(b.pick(&PickContext::new(s(1))).is_none());
}

#[test]
fn panic_mode_ends_when_ejections_expire() {
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(outlier(1, 100.0));
    let b = Balancer::new(cfg, &specs(2)).unwrap();
    drive(&b, s(1), 2, &[0, 1]);
    assert!(b.is_panicking(s(1)), "both ejected");
    assert!(!b.is_panicking(s(12)), "both back after 10 s");
}

#[test]
fn slow_start_ramps_a_new_endpoint_linearly() {
    let mut cfg = BalancerConfig::new(StrategyKind::WeightedRandom);
    cfg.slow_start = Some(SlowStartConfig {
        window: s(10),
        aggression: 1.0,
        min_weight_percent: 10.0,
    });
    let b = Balancer::new(cfg, &specs(1)).unwrap();
    b.update(&specs(2), s(100)).unwrap();
    let share_of_new = |now: Duration| {
        let mut new = 0;
        for _ in 0..20_000 {
            let p = b.pick(&PickContext::new(now)).unwrap();
            new += p.index();
            b.finish(p, Outcome::Success, now);
        }
        new as f64 / 20_000.0
    };
    // Weight factor f gives the newcomer f / (1 + f) of the picks.
    for (t, f) in [
        (100, 0.1),
        (101, 0.1),
        (105, 0.5),
        (108, 0.8),
        (110, 1.0),
        (200, 1.0),
    ] {
        let expect = f / (1.0 + f);
        let got = share_of_new(s(t));
        assert!((got - expect).abs() < 0.02, "t={t}: {got} vs {expect}");
    }
    assert!((b.status(s(105))[1].effective_weight - 0.5).abs() < 1e-9);
}

#[test]
fn slow_start_after_ejection_and_health_return() {
    let mut cfg = BalancerConfig::new(StrategyKind::WeightedRoundRobin);
    cfg.outlier_detection = Some(outlier(1, 50.0));
    cfg.slow_start = Some(SlowStartConfig {
        window: s(10),
        aggression: 1.0,
        min_weight_percent: 0.0,
    });
    let b = Balancer::new(cfg, &specs(2)).unwrap();
    // Initial endpoints are at full weight.
    assert_eq!(b.status(s(1))[0].effective_weight, 1.0);
    drive(&b, s(1), 2, &[0]);
    let until = b.endpoints()[0].ejected_until(s(1)).unwrap();
    // Half a window after the ejection ended, half the weight.
    let st = b.status(until + s(5));
    assert!((st[0].effective_weight - 0.5).abs() < 1e-9, "{st:?}");
    // Health: back to healthy at 100 s ramps from there.
    let id = b.endpoints()[1].id();
    b.set_healthy(id, false, s(99));
    b.set_healthy(id, true, s(100));
    assert!((b.status(s(102))[1].effective_weight - 0.2).abs() < 1e-9);
}

#[test]
fn update_keeps_state_of_endpoints_that_stay() {
    let mut cfg = BalancerConfig::new(StrategyKind::LeastConnections);
    cfg.outlier_detection = Some(outlier(1, 50.0));
    let b = Balancer::new(cfg.clone(), &specs(3)).unwrap();
    let held = b.pick(&PickContext::new(s(1))).unwrap();
    let held_addr = held.address().to_string();
    drive(&b, s(1), 1, &[0, 1, 2]);
    let ejected: Vec<String> = b
        .status(s(1))
        .into_iter()
        .filter(|e| e.ejected_until.is_some())
        .map(|e| e.address)
        .collect();
    assert_eq!(ejected.len(), 1);
    // A reload with another strategy keeps in-flight and ejection state.
    let mut cfg2 = cfg;
    cfg2.strategy = StrategyKind::RoundRobin;
    let b2 = b.rebuild(cfg2, &specs(4), s(2)).unwrap();
    let st = b2.status(s(2));
    assert_eq!(st.len(), 4);
    for e in &st {
        assert_eq!(e.ejected_until.is_some(), ejected.contains(&e.address));
        assert_eq!(e.in_flight, (e.address == held_addr) as u32);
    }
    // The old pick finishes on the old balancer and releases the shared counter.
    b.finish(held, Outcome::Success, s(2));
    assert!(b2.status(s(2)).iter().all(|e| e.in_flight == 0));
}
