//! A fleet of balancers (docs/reliability.md, "A fleet of balancers"): the failed tries N
//! proxies pay before every one has ejected a failed endpoint, simulated with keel-balance's
//! balancers (one per proxy, shared evidence through `Balancer::record_remote`) against the
//! closed forms of `keel_model::fleet`, off the preset's settings: 3 and 10 endpoints,
//! thresholds 3 and 5, traffic in turn and spread at random, fixed seeds.

use std::time::Duration;

use keel_model::fleet::{run, Detection, FleetResult, FleetSetting};
use keel_model::sim::Arrivals;
use keel_model::vocab::FailureMode;

const REPLICATIONS: u32 = 200;

fn setting(
    proxies: u32,
    endpoints: u32,
    threshold: u32,
    failure: FailureMode,
    arrivals: Arrivals,
    detection: Detection,
) -> FleetSetting {
    FleetSetting {
        endpoints,
        threshold,
        ..FleetSetting::new(proxies, failure, arrivals, detection)
    }
}

/// Simulated against closed form. Tolerance: 4 standard errors of the simulated mean (over
/// 200 replications; the Student-t interval's half-width is 1.97 of them) plus 1 % of the
/// closed form, which is exact for local detection and for shared evidence with traffic
/// spread at random, and first order for shared evidence with traffic in turn.
fn agrees(r: &FleetResult) {
    let closed = r.closed_form.expect("a closed form");
    let se = (r.ci95.1 - r.ci95.0) / 2.0 / 1.97;
    let allowed = 4.0 * se + 0.01 * closed;
    assert_eq!(
        r.ejected_everywhere,
        r.replications,
        "{}",
        r.setting.label()
    );
    assert!(
        (r.mean - closed).abs() <= allowed,
        "{} (n={}, k={}): simulated {:.3} ({:.3}-{:.3}), closed form {closed:.3}, allowed {allowed:.3}",
        r.setting.label(),
        r.setting.endpoints,
        r.setting.threshold,
        r.mean,
        r.ci95.0,
        r.ci95.1
    );
}

#[test]
fn simulated_failed_tries_agree_with_the_closed_form() {
    let mut seed = 10;
    for (endpoints, threshold) in [(3, 3), (10, 5), (3, 5), (10, 3)] {
        for proxies in [2, 5] {
            // The evidence takes as long as one proxy's mean gap between tries to the failed
            // endpoint (N n / rate): about one try per proxy in flight, so that the cap at k in
            // E[min(X, k)] and the proxies' own evidence both play a part.
            let delay = Duration::from_secs_f64(f64::from(proxies * endpoints) / 200.0);
            for failure in [FailureMode::FAIL_AT_ONCE, FailureMode::Hang] {
                for arrivals in [Arrivals::InTurn, Arrivals::Random] {
                    for detection in [Detection::Local, Detection::Shared { delay, quorum: 1 }] {
                        seed += 1;
                        let s =
                            setting(proxies, endpoints, threshold, failure, arrivals, detection);
                        let r = run(&s, seed, REPLICATIONS).unwrap();
                        if detection == Detection::Local && failure == FailureMode::FAIL_AT_ONCE {
                            // Every proxy pays exactly k: no try is in flight when one fails.
                            assert_eq!(r.mean, f64::from(proxies * threshold), "{}", s.label());
                        }
                        agrees(&r);
                    }
                }
            }
        }
    }
}

/// The fleet of three pays at most half with shared evidence (quorum 1) as long as few tries
/// reach each proxy while the evidence travels (rate p d / N well under k / 4: here 0.07-0.22
/// with evidence 10 ms behind), whether its traffic comes in turn or spread at random.
#[test]
fn a_fleet_of_three_sharing_evidence_pays_at_most_half() {
    let delay = Duration::from_millis(10);
    let mut seed = 100;
    for (endpoints, threshold) in [(3, 3), (10, 5), (3, 5), (10, 3)] {
        for arrivals in [Arrivals::InTurn, Arrivals::Random] {
            seed += 1;
            let fast = FailureMode::FAIL_AT_ONCE;
            let at = |d| setting(3, endpoints, threshold, fast, arrivals, d);
            let local = run(&at(Detection::Local), seed, REPLICATIONS).unwrap();
            let shared = run(
                &at(Detection::Shared { delay, quorum: 1 }),
                seed,
                REPLICATIONS,
            )
            .unwrap();
            assert!(
                shared.ci95.1 <= local.mean / 2.0,
                "{} (n={endpoints}, k={threshold}): shared {:.2} ({:.2}-{:.2}) against local {:.2}",
                shared.setting.label(),
                shared.mean,
                shared.ci95.0,
                shared.ci95.1,
                local.mean
            );
            agrees(&local);
            agrees(&shared);
        }
    }
}

/// A hang holds each try for the timeout: the tries sent meanwhile (rate x timeout / n) are
/// paid with or without sharing, so sharing saves the same N x k part it saves for a fast
/// failure, and no more.
#[test]
fn a_hang_costs_its_tries_in_flight_with_or_without_sharing() {
    let delay = Duration::ZERO;
    let at = |failure, d| setting(4, 10, 5, failure, Arrivals::Random, d);
    let shared = Detection::Shared { delay, quorum: 1 };
    let saved = |failure| {
        let local = run(&at(failure, Detection::Local), 7, REPLICATIONS).unwrap();
        let shared = run(&at(failure, shared), 7, REPLICATIONS).unwrap();
        agrees(&local);
        agrees(&shared);
        (local.mean, shared.mean)
    };
    let (fast_local, fast_shared) = saved(FailureMode::FAIL_AT_ONCE);
    let (hang_local, hang_shared) = saved(FailureMode::Hang);
    assert_eq!((fast_local, fast_shared), (20.0, 5.0), "N k and k");
    // 200 requests/s x 1 s / 10 endpoints = 20 tries in flight, on top of both.
    assert!((hang_shared - 25.0).abs() < 1.5, "{hang_shared}");
    assert!(
        ((hang_local - hang_shared) - 15.0).abs() < 2.0,
        "{hang_local} - {hang_shared}"
    );
}

/// A quorum of 2 keeps one proxy from ejecting on its own evidence, however much of it; in a
/// fleet of three it ejects, after more failed tries than a quorum of 1 (with k = 3, the first
/// three failures all come from one proxy in 1 run of 9) and fewer than local detection.
#[test]
fn a_quorum_of_two_needs_two_proxies_failures() {
    let fast = FailureMode::FAIL_AT_ONCE;
    let quorum = |q| Detection::Shared {
        delay: Duration::from_millis(10),
        quorum: q,
    };
    let alone = run(&setting(1, 10, 3, fast, Arrivals::Random, quorum(2)), 3, 20).unwrap();
    assert_eq!(
        alone.ejected_everywhere, 0,
        "one proxy never makes a quorum of 2"
    );
    let three = |d| {
        run(
            &setting(3, 10, 3, fast, Arrivals::Random, d),
            3,
            REPLICATIONS,
        )
        .unwrap()
    };
    let (one, two, local) = (three(quorum(1)), three(quorum(2)), three(Detection::Local));
    assert_eq!(two.ejected_everywhere, REPLICATIONS);
    assert!(
        one.mean < two.mean && two.mean < local.mean,
        "quorum 1 {:.2}, quorum 2 {:.2}, local {:.2}",
        one.mean,
        two.mean,
        local.mean
    );
}
