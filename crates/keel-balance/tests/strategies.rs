//! Behaviour of every strategy, with fixed seeds and stated tolerances.

use std::collections::HashMap;
use std::time::Duration;

use keel_balance::{
    hash_key, Balancer, BalancerConfig, EndpointSpec, Outcome, Pick, PickContext, StrategyKind,
    TieBreak,
};

fn specs(n: usize) -> Vec<EndpointSpec> {
    (0..n)
        .map(|i| EndpointSpec::new(format!("10.0.{}.{}:8080", i / 250, i % 250)))
        .collect()
}

fn weighted(weights: &[u32]) -> Vec<EndpointSpec> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| EndpointSpec::new(format!("10.1.0.{i}:80")).with_weight(w))
        .collect()
}

fn lb(kind: StrategyKind, eps: &[EndpointSpec]) -> Balancer {
    Balancer::new(BalancerConfig::new(kind), eps).unwrap()
}

const T0: Duration = Duration::from_secs(1);

/// Picks `n` times, finishing each pick at once; returns the count per index.
fn shares(b: &Balancer, n: usize) -> Vec<usize> {
    let mut counts = vec![0; b.endpoints().len()];
    for i in 0..n {
        let key = hash_key(&(i as u64).to_le_bytes());
        let p = b.pick(&PickContext::new(T0).with_hash_key(key)).unwrap();
        counts[p.index()] += 1;
        b.finish(p, Outcome::Success, T0);
    }
    counts
}

/// Earliest deadline first, each endpoint starting half a turn in: the heavy one first, the
/// light ones spread between its turns.
#[test]
fn weighted_round_robin_sequence_is_smooth() {
    let b = lb(StrategyKind::WeightedRoundRobin, &weighted(&[5, 1, 1]));
    let seq: String = (0..14)
        .map(|_| {
            let p = b.pick(&PickContext::new(T0)).unwrap();
            let c = (b'a' + p.index() as u8) as char;
            b.finish(p, Outcome::Success, T0);
            c
        })
        .collect();
    assert_eq!(seq, "aaabcaaaaabcaa");
}

#[test]
fn round_robin_visits_each_in_turn() {
    let b = lb(StrategyKind::RoundRobin, &specs(4));
    let idx: Vec<usize> = (0..8)
        .map(|_| b.pick(&PickContext::new(T0)).unwrap().index())
        .collect();
    assert_eq!(idx, [0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn round_robin_shares_evenly_around_an_unavailable_endpoint() {
    let b = lb(StrategyKind::RoundRobin, &specs(5));
    b.set_healthy(b.endpoints()[4].id(), false, T0);
    let counts = shares(&b, 4_000);
    assert_eq!(counts, [1_000, 1_000, 1_000, 1_000, 0]);
}

#[test]
fn weighted_shares_follow_weights() {
    let n = 70_000;
    for kind in [
        StrategyKind::WeightedRandom,
        StrategyKind::WeightedRoundRobin,
    ] {
        let counts = shares(&lb(kind, &weighted(&[5, 1, 1])), n);
        let expected = [5.0 / 7.0, 1.0 / 7.0, 1.0 / 7.0];
        for (c, e) in counts.iter().zip(expected) {
            let share = *c as f64 / n as f64;
            // Binomial sd at n = 70,000 is under 0.002; 0.01 is 5 sigma.
            assert!((share - e).abs() < 0.01, "{kind}: {counts:?}");
        }
    }
    // Unweighted strategies ignore weights.
    for kind in [StrategyKind::Random, StrategyKind::RoundRobin] {
        let counts = shares(&lb(kind, &weighted(&[5, 1, 1])), 30_000);
        for c in counts {
            assert!((c as f64 / 30_000.0 - 1.0 / 3.0).abs() < 0.015, "{kind}");
        }
    }
}

#[test]
fn least_connections_keeps_in_flight_level() {
    let b = lb(StrategyKind::LeastConnections, &specs(7));
    let mut open: Vec<Pick> = Vec::new();
    for step in 0..2_000u64 {
        // Mostly opens calls, sometimes finishes a random one: the spread stays at most 1.
        if step % 3 == 2 && !open.is_empty() {
            let i = (keel_balance::mix64(step) % open.len() as u64) as usize;
            b.finish(open.swap_remove(i), Outcome::Success, T0);
        } else {
            open.push(b.pick(&PickContext::new(T0)).unwrap());
        }
        let loads: Vec<u32> = b.endpoints().iter().map(|e| e.in_flight()).collect();
        let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        // A finish can open a gap of 2 before the next pick closes it.
        assert!(hi - lo <= 2, "step {step}: {loads:?}");
    }
}

#[test]
fn least_connections_tie_break_random_spreads_lowest_index_concentrates() {
    // One call at a time: every pick sees all counts equal (the E5 situation).
    let random = shares(&lb(StrategyKind::LeastConnections, &specs(5)), 10_000);
    for c in &random {
        assert!((*c as f64 / 10_000.0 - 0.2).abs() < 0.02, "{random:?}");
    }
    let mut cfg = BalancerConfig::new(StrategyKind::LeastConnections);
    cfg.options.tie_break = TieBreak::LowestIndex;
    let lowest = shares(&Balancer::new(cfg, &specs(5)).unwrap(), 10_000);
    assert_eq!(lowest[0], 10_000, "{lowest:?}");
}

#[test]
fn weighted_least_connections_follows_weights_under_load() {
    let b = lb(StrategyKind::LeastConnections, &weighted(&[3, 1]));
    let picks: Vec<Pick> = (0..400)
        .map(|_| b.pick(&PickContext::new(T0)).unwrap())
        .collect();
    let loads: Vec<u32> = b.endpoints().iter().map(|e| e.in_flight()).collect();
    assert!((299..=301).contains(&loads[0]), "{loads:?}");
    drop(picks);
    assert!(b.endpoints().iter().all(|e| e.in_flight() == 0));
}

#[test]
fn power_of_two_never_picks_the_more_loaded_of_its_two() {
    // With two endpoints the two candidates are always both of them.
    let b = lb(StrategyKind::LeastRequest, &specs(2));
    let mut held = Vec::new();
    for _ in 0..50 {
        held.push(b.pick(&PickContext::new(T0)).unwrap());
    }
    for _ in 0..500 {
        let loads: Vec<u32> = b.endpoints().iter().map(|e| e.in_flight()).collect();
        let p = b.pick(&PickContext::new(T0)).unwrap();
        let other = 1 - p.index();
        assert!(
            loads[p.index()] <= loads[other],
            "{loads:?} picked {}",
            p.index()
        );
        held.push(p);
    }
    // With ten endpoints, the unique most loaded endpoint is never chosen.
    let b = lb(StrategyKind::LeastRequest, &specs(10));
    let heavy: Vec<Pick> = std::iter::repeat_with(|| b.pick(&PickContext::new(T0)).unwrap())
        .take(1)
        .collect();
    let hot = heavy[0].index();
    for _ in 0..5_000 {
        let p = b.pick(&PickContext::new(T0)).unwrap();
        assert_ne!(p.index(), hot);
        b.finish(p, Outcome::Success, T0);
    }
}

fn owners(b: &Balancer, keys: usize) -> Vec<String> {
    (0..keys)
        .map(|k| {
            let key = hash_key(format!("user-{k}").as_bytes());
            let p = b.pick(&PickContext::new(T0).with_hash_key(key)).unwrap();
            let a = p.address().to_string();
            b.finish(p, Outcome::Success, T0);
            a
        })
        .collect()
}

#[test]
fn removing_one_of_n_moves_about_one_nth_of_keys_and_no_others() {
    let n = 20;
    let keys = 50_000;
    for kind in [
        StrategyKind::RingHash,
        StrategyKind::Maglev,
        StrategyKind::Rendezvous,
    ] {
        let all = specs(n);
        let b = lb(kind, &all);
        let before = owners(&b, keys);
        let removed = all[7].address.clone();
        let rest: Vec<EndpointSpec> = all
            .iter()
            .filter(|s| s.address != removed)
            .cloned()
            .collect();
        b.update(&rest, T0).unwrap();
        let after = owners(&b, keys);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        let moved_from_others = before
            .iter()
            .zip(&after)
            .filter(|(a, b)| a != b && **a != removed)
            .count();
        let share = moved as f64 / keys as f64;
        // The removed endpoint owned about 1/20 = 0.05 of the keys.
        assert!((0.03..0.075).contains(&share), "{kind}: moved {share}");
        if kind == StrategyKind::Maglev {
            // Maglev trades perfect stability for balance: a few keys of others move too.
            assert!(
                (moved_from_others as f64) < 0.01 * keys as f64,
                "{kind}: {moved_from_others}"
            );
        } else {
            assert_eq!(moved_from_others, 0, "{kind}");
        }
    }
}

#[test]
fn maglev_balances_keys_within_five_percent() {
    let b = lb(StrategyKind::Maglev, &specs(100));
    let counts = shares(&b, 1_000_000);
    let mean = 10_000.0;
    let max = *counts.iter().max().unwrap() as f64;
    // The table is balanced to +-1 slot; key sampling adds about 1 % sd per endpoint.
    assert!(max / mean <= 1.05, "max/mean {}", max / mean);
}

#[test]
fn hash_strategies_are_sticky_and_avoid_unavailable_endpoints() {
    for kind in [
        StrategyKind::RingHash,
        StrategyKind::Maglev,
        StrategyKind::Rendezvous,
    ] {
        let b = lb(kind, &specs(10));
        let key = hash_key(b"session-42");
        let first = b.pick(&PickContext::new(T0).with_hash_key(key)).unwrap();
        let owner = first.id();
        drop(first);
        for _ in 0..10 {
            assert_eq!(
                b.pick(&PickContext::new(T0).with_hash_key(key))
                    .unwrap()
                    .id(),
                owner
            );
        }
        // Retry avoidance moves it elsewhere, consistently.
        let avoid = [owner];
        let second = b
            .pick(&PickContext::new(T0).with_hash_key(key).with_avoid(&avoid))
            .unwrap()
            .id();
        assert_ne!(second, owner);
        b.set_healthy(owner, false, T0);
        for _ in 0..10 {
            assert_eq!(
                b.pick(&PickContext::new(T0).with_hash_key(key))
                    .unwrap()
                    .id(),
                second
            );
        }
    }
}

#[test]
fn bounded_loads_never_exceed_the_cap() {
    for kind in [
        StrategyKind::RingHash,
        StrategyKind::Maglev,
        StrategyKind::Rendezvous,
    ] {
        let mut cfg = BalancerConfig::new(kind);
        cfg.options.bounded_load = Some(1.25);
        let b = Balancer::new(cfg, &specs(8)).unwrap();
        let mut held = Vec::new();
        // A hot key: without bounds every call would land on one endpoint.
        let key = hash_key(b"hot");
        for total in 1..=400u64 {
            held.push(b.pick(&PickContext::new(T0).with_hash_key(key)).unwrap());
            let cap = (1.25 * total as f64 / 8.0).ceil() as u32;
            for e in b.endpoints() {
                assert!(
                    e.in_flight() <= cap,
                    "{kind}: {} > {cap} at {total}",
                    e.in_flight()
                );
            }
        }
        // The spill-over fills endpoints up to the cap: at least ceil(400 / 63) = 7 are used.
        let loads: Vec<u32> = b.endpoints().iter().map(|e| e.in_flight()).collect();
        assert_eq!(loads.iter().sum::<u32>(), 400);
        assert!(
            loads.iter().filter(|&&l| l > 0).count() >= 7,
            "{kind}: {loads:?}"
        );
    }
}

#[test]
fn least_time_prefers_the_lowest_average_and_falls_for_fast_failures() {
    let b = lb(StrategyKind::LeastTime, &specs(3));
    let mut now = T0;
    // Teach it: endpoint 0 takes 30 ms, 1 takes 10 ms, 2 fails in 1 ms.
    for _ in 0..30 {
        let p = b.pick(&PickContext::new(now)).unwrap();
        let (lat, outcome) = match p.index() {
            0 => (30, Outcome::Success),
            1 => (10, Outcome::Success),
            _ => (1, Outcome::Failure),
        };
        b.finish(p, outcome, now + Duration::from_millis(lat));
        now += Duration::from_millis(50);
    }
    // The source's rule sends everything to the fast-failing endpoint (experiment E4's trap).
    let counts = shares(&b, 100);
    assert_eq!(counts[2], 100, "{counts:?}");
}

#[test]
fn peak_ewma_penalises_fast_failures() {
    let b = lb(StrategyKind::PeakEwma, &specs(3));
    let mut now = T0;
    let mut counts: HashMap<usize, usize> = HashMap::new();
    for _ in 0..3_000 {
        let p = b.pick(&PickContext::new(now)).unwrap();
        *counts.entry(p.index()).or_default() += 1;
        let (lat, outcome) = if p.index() == 2 {
            (1, Outcome::Failure)
        } else {
            (10, Outcome::Success)
        };
        b.finish(p, outcome, now + Duration::from_millis(lat));
        now += Duration::from_millis(1);
    }
    let bad = *counts.get(&2).unwrap_or(&0);
    assert!(
        bad < 30,
        "fast-failing endpoint got {bad} of 3000: {counts:?}"
    );
}

#[test]
fn every_strategy_skips_unhealthy_and_honours_avoid() {
    for kind in StrategyKind::ALL {
        let b = lb(kind, &specs(5));
        let eps = b.endpoints();
        b.set_healthy(eps[1].id(), false, T0);
        let avoid = [eps[3].id()];
        for i in 0..500u64 {
            let ctx = PickContext::new(T0)
                .with_hash_key(keel_balance::mix64(i))
                .with_avoid(&avoid);
            let p = b.pick(&ctx).unwrap();
            assert!(
                p.index() != 1 && p.index() != 3,
                "{kind} picked {}",
                p.index()
            );
            b.finish(p, Outcome::Success, T0);
        }
    }
}

#[test]
fn avoid_is_ignored_when_nothing_else_is_left() {
    let b = lb(StrategyKind::RoundRobin, &specs(1));
    let only = b.endpoints()[0].id();
    let avoid = [only];
    let p = b.pick(&PickContext::new(T0).with_avoid(&avoid)).unwrap();
    assert_eq!(p.id(), only);
}

#[test]
fn concurrent_picks_keep_counts_consistent() {
    for kind in StrategyKind::ALL {
        let b = lb(kind, &specs(16));
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let b = &b;
                s.spawn(move || {
                    for i in 0..5_000u64 {
                        let key = keel_balance::mix64(t * 1_000_000 + i);
                        let p = b.pick(&PickContext::new(T0).with_hash_key(key)).unwrap();
                        b.finish(p, Outcome::Success, T0);
                    }
                });
            }
        });
        let eps = b.endpoints();
        assert!(eps.iter().all(|e| e.in_flight() == 0), "{kind}");
        let total: u64 = eps.iter().map(|e| e.outcomes().0).sum();
        assert_eq!(total, 20_000, "{kind}");
        // Each of 16 endpoints expects 1,250; even the hash strategies stay within 2x. Not
        // for the strategies that steer by calls in flight (or by latency): a thread preempted
        // between its pick and its finish (on 2 busy cores, for milliseconds) keeps a call in
        // flight on one endpoint, and they rightly send the other threads' thousands of calls
        // elsewhere meanwhile (seen: 317 of 20,000 for one of 16 endpoints under least-request,
        // about one run in 12).
        let load_aware = matches!(
            kind,
            StrategyKind::LeastConnections
                | StrategyKind::LeastRequest
                | StrategyKind::LeastTime
                | StrategyKind::PeakEwma
        );
        let counts: Vec<u64> = eps.iter().map(|e| e.outcomes().0).collect();
        assert!(
            load_aware || counts.iter().all(|&c| c > 500),
            "{kind}: {counts:?}"
        );
    }
}

#[test]
fn balancer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Balancer>();
    check::<Pick>();
}

/// orca-wrr through the balancer: ORCA headers parsed and reported, then picks. Two endpoints
/// at 100 qps, one at cpu 0.9 and one at 0.3: weights 100/0.9 and 100/0.3, shares 1/4 and 3/4
/// once the 10 s blackout has passed; before it, round-robin.
#[test]
fn orca_wrr_sends_less_to_the_busier_endpoint_after_the_blackout() {
    use keel_balance::OrcaReport;
    let b = lb(StrategyKind::OrcaWrr, &specs(2));
    assert!(b.uses_utilization());
    let eps = b.endpoints();
    let headers: [&[u8]; 2] = [
        b"TEXT cpu_utilization=0.9, rps_fractional=100",
        br#"JSON {"cpu_utilization":0.3,"rps_fractional":100}"#,
    ];
    let report = |at: Duration| {
        for (e, h) in eps.iter().zip(headers) {
            let u = OrcaReport::parse(h).unwrap().utilization();
            assert!(b.report_utilization(e.id(), u, at));
        }
    };
    let share_of_first = |at: Duration| {
        let mut first = 0;
        for _ in 0..4000 {
            let p = b.pick(&PickContext::new(at)).unwrap();
            first += usize::from(p.index() == 0);
        }
        first as f64 / 4000.0
    };
    report(T0);
    assert_eq!(share_of_first(T0 + Duration::from_secs(5)), 0.5);
    report(T0 + Duration::from_secs(11));
    let got = share_of_first(T0 + Duration::from_secs(12));
    assert!((got - 0.25).abs() < 0.002, "{got}");
}

/// A retry goes to an endpoint not tried yet even when that one is on half-open trial with a
/// call in flight (peak-ewma, least-time and prequal hold such an endpoint to one call at a
/// time): the endpoint that just failed this very request is the worse of the two. Before, the
/// pick gave up the avoid list first and sent the retry back to the endpoint that had failed.
#[test]
fn a_retry_prefers_an_untried_endpoint_on_trial_to_the_one_that_failed() {
    for kind in [
        StrategyKind::PeakEwma,
        StrategyKind::LeastTime,
        StrategyKind::Prequal,
    ] {
        let b = lb(kind, &specs(2));
        let (e0, e1) = (b.endpoints()[0].id(), b.endpoints()[1].id());
        // e1's last call failed (on trial) and a call is in flight on it.
        let mut p = b.pick(&PickContext::new(T0)).unwrap();
        while p.id() != e1 {
            b.finish(p, Outcome::Success, T0);
            p = b.pick(&PickContext::new(T0)).unwrap();
        }
        b.finish(p, Outcome::Failure, T0);
        let in_flight = b
            .pick(&PickContext::new(T0).with_avoid(&[e0]))
            .expect("e1 takes one call on trial");
        assert_eq!(in_flight.id(), e1, "{kind}");
        // A request failed on e0: its retry avoids e0.
        let avoid = [e0];
        let retry = b.pick(&PickContext::new(T0).with_avoid(&avoid)).unwrap();
        assert_eq!(
            retry.id(),
            e1,
            "{kind}: the retry went back to the endpoint that failed"
        );
        b.finish(retry, Outcome::Success, T0);
        b.finish(in_flight, Outcome::Success, T0);
    }
}

/// An endpoint's reported queue (an inference engine's `num_requests_waiting`, which other
/// proxies of a fleet may have built) counts in least-request's and prefix-affinity's load
/// while fresh, is ignored once older than `queue_max_age`, and is never read without it.
#[test]
fn a_reported_queue_is_load_while_fresh_and_only_when_asked_for() {
    let at = |s: f64| T0 + Duration::from_secs_f64(s);
    let prompt: Vec<u64> = (1..=8).collect();
    for kind in [StrategyKind::LeastRequest, StrategyKind::PrefixAffinity] {
        for reads in [true, false] {
            let mut c = BalancerConfig::new(kind);
            c.queue_max_age = reads.then_some(Duration::from_secs(2));
            let b = Balancer::new(c, &specs(3)).unwrap();
            let busy = b.endpoints()[0].id();
            // Six calls held open: without the report they spread two per endpoint (and the
            // prompt's home, whichever it is, takes its share).
            let mut held = Vec::new();
            let mut on = [0usize; 3];
            assert!(b.report_queue(busy, 20, at(0.0)));
            for _ in 0..6 {
                let mut ctx = PickContext::new(at(0.5));
                ctx.prefix = &prompt;
                let p = b.pick(&ctx).unwrap();
                on[p.index()] += 1;
                held.push(p);
            }
            if reads {
                assert_eq!(on[0], 0, "{kind:?}: a queue of 20 takes nothing: {on:?}");
            } else {
                assert!(
                    on[0] >= 1,
                    "{kind:?}: not read, the endpoint takes calls: {on:?}"
                );
            }
            for p in held.drain(..) {
                b.finish(p, Outcome::Success, at(0.6));
            }
            // Stale (3 s > 2 s): the endpoint is back in the least-loaded rotation.
            let mut on = [0usize; 3];
            for _ in 0..6 {
                let p = b.pick(&PickContext::new(at(3.0))).unwrap();
                on[p.index()] += 1;
                held.push(p);
            }
            assert!(
                on[0] >= 1,
                "{kind:?} reads={reads}: a stale queue is ignored: {on:?}"
            );
            for p in held.drain(..) {
                b.finish(p, Outcome::Success, at(3.1));
            }
        }
    }
}

/// The engine that holds a prefix fails one call: that prefix, and every other prefix it held,
/// goes to a next-best engine at once (one failed try in all, not one per outlier detector's
/// count); once an engine has failed, new prefixes are not sent to it while it is passed over,
/// and after that it takes new prefixes again.
#[test]
fn a_failed_affine_engine_loses_its_prefixes_after_one_failed_try() {
    let at = |s: f64| T0 + Duration::from_secs_f64(s);
    let b = lb(StrategyKind::PrefixAffinity, &specs(3));
    let prompts: Vec<Vec<u64>> = (0..6u64)
        .map(|g| (0..20).map(|k| g * 1000 + k).collect())
        .collect();
    let go = |p: &[u64], t: f64, outcome: Outcome| {
        let mut ctx = PickContext::new(at(t));
        ctx.prefix = p;
        let pick = b.pick(&ctx).unwrap();
        let i = pick.index();
        b.finish(pick, outcome, at(t));
        i
    };
    let homes: Vec<usize> = prompts
        .iter()
        .map(|p| go(p, 0.0, Outcome::Success))
        .collect();
    for (p, &h) in prompts.iter().zip(&homes) {
        assert_eq!(go(p, 0.1, Outcome::Success), h, "affinity holds");
    }
    let failed = homes[0];
    assert_eq!(go(&prompts[0], 0.2, Outcome::Failure), failed);
    // No further try lands on the failed engine, for its prefixes or anyone's.
    let mut moved = [usize::MAX; 6];
    for (g, p) in prompts.iter().enumerate() {
        let i = go(p, 0.3, Outcome::Success);
        assert_ne!(i, failed, "prefix {g} (home {}) went back", homes[g]);
        moved[g] = i;
    }
    for (g, p) in prompts.iter().enumerate() {
        assert_eq!(
            go(p, 0.4, Outcome::Success),
            moved[g],
            "prefix {g} stays moved"
        );
    }
    let fresh: Vec<u64> = (0..20).map(|k| 77_000 + k).collect();
    assert_ne!(go(&fresh, 1.0, Outcome::Success), failed, "passed over");
    // After the pass-over period its emptied estimate takes the next new prefix.
    let newer: Vec<u64> = (0..20).map(|k| 88_000 + k).collect();
    assert_eq!(go(&newer, 6.0, Outcome::Success), failed, "back after 5 s");
}
