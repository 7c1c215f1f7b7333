//! Closed forms of the reliability model (docs/reliability.md states it).
//!
//! Setting: a request calls a cluster of `m` servers `k` times, one call after another, and
//! succeeds only if every call succeeds. A fraction `p` of the servers has failed (`n_f = p m`).
//! A failed server holds a call `q` times as long as a healthy one answers it
//! (`q = t_fail / t_ok`), so its service capacity is `1/q` of a healthy server's.
//!
//! * Round-robin and random (and their weighted forms with equal weights): a call lands on a
//!   healthy server with probability `h = 1 - p`.
//! * Least-connections: with in-flight counts kept equal, Little's law (`L = lambda t`) makes each
//!   server's share of calls proportional to `1 / t`, so
//!   `h = q (1 - p) / (q (1 - p) + p)`, in counts `h = q (m - n_f) / (q (m - n_f) + n_f)`.
//!   The source prints this as "(m-1*q)/(m*q-1)", which is garbled (for m = 5, q = 100 it gives a
//!   negative number, or 400/499 read as `(m-1) q / (m q - 1)`, not the 400/401 of its own
//!   example); the form here is the corrected one that reproduces the example.
//! * Success over `k` sequential calls: `f(p) = h^k` (calls independent, steady state).
//!
//! Every function is pure and cheap; the simulator and `keel analyze` call them per point.

use keel_balance::StrategyKind;

/// The strategies that have a closed form here, in documentation order.
pub const CLOSED_FORM: [StrategyKind; 5] = [
    StrategyKind::RoundRobin,
    StrategyKind::WeightedRoundRobin,
    StrategyKind::Random,
    StrategyKind::WeightedRandom,
    StrategyKind::LeastConnections,
];

/// True when [`healthy_pick`] has a closed form for this strategy.
pub fn has_closed_form(strategy: StrategyKind) -> bool {
    CLOSED_FORM.contains(&strategy)
}

/// Probability that one call lands on a healthy server, for strategies with a closed form:
/// round-robin, weighted-round-robin, random, weighted-random (equal weights): `1 - p`;
/// least-connections: `q(1-p) / (q(1-p) + p)` (the corrected form, see the module docs).
/// None for every other strategy, and None when `p` is outside `[0, 1]` or (least-connections
/// only, the others ignore `q`) `q` is not a positive number.
pub fn healthy_pick(strategy: StrategyKind, p: f64, q: f64) -> Option<f64> {
    if !(0.0..=1.0).contains(&p) {
        return None;
    }
    match strategy {
        StrategyKind::RoundRobin
        | StrategyKind::WeightedRoundRobin
        | StrategyKind::Random
        | StrategyKind::WeightedRandom => Some(uniform_healthy_pick(p)),
        StrategyKind::LeastConnections => {
            // `q > 0.0` is false for NaN too.
            if q > 0.0 {
                Some(least_connections_healthy_pick(p, q))
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Share of calls that land on failed servers: `1 - healthy_pick`. For least-connections this
/// is `p / (p + q (1 - p))` (1/401 in the source's example). None as for [`healthy_pick`].
pub fn failed_share(strategy: StrategyKind, p: f64, q: f64) -> Option<f64> {
    healthy_pick(strategy, p, q).map(|h| 1.0 - h)
}

/// Success of a request that makes k calls in sequence: `healthy_pick^k`. None without closed
/// form (or with `p`, `q` out of range as for [`healthy_pick`]).
pub fn success(strategy: StrategyKind, p: f64, q: f64, k: u32) -> Option<f64> {
    healthy_pick(strategy, p, q).map(|h| h.powi(k as i32))
}

/// Round-robin / random: `1 - p`. Round-robin cycles through all servers, so over a cycle exactly
/// the fraction `1 - p` of its picks are healthy; random does so in expectation.
pub fn uniform_healthy_pick(p: f64) -> f64 {
    1.0 - p
}

/// Least-connections, fractions form: `q(1-p) / (q(1-p) + p)`.
///
/// Why: least-connections keeps every server's in-flight count `L` about equal. By Little's law
/// `L = lambda_i t_i`, so the call rate to server i is `lambda_i = L / t_i`: a healthy server
/// (`t_ok`) gets `q` times the calls of a failed one (`t_fail = q t_ok`). With weights `q` for
/// the `1 - p` healthy and `1` for the `p` failed, the healthy share is the formula. At `p = 1`
/// it is 0 and at `p = 0` it is 1, for every `q > 0`.
pub fn least_connections_healthy_pick(p: f64, q: f64) -> f64 {
    let healthy_weight = q * (1.0 - p);
    let total = healthy_weight + p;
    if total == 0.0 {
        // only when p = 0 and q = 0, which callers exclude; keep the result defined anyway
        return 1.0;
    }
    healthy_weight / total
}

/// Least-connections, counts form: `q (m - n_f) / (q (m - n_f) + n_f)`; the same as
/// [`least_connections_healthy_pick`] with `p = n_f / m`. The source's example `m = 5, n_f = 1,
/// q = 100` gives 400/401.
///
/// Panics if `n_f > m` or `m == 0`.
pub fn least_connections_healthy_pick_counts(m: u64, n_f: u64, q: f64) -> f64 {
    assert!(
        m > 0 && n_f <= m,
        "need 0 <= n_f <= m and m > 0, got m={m}, n_f={n_f}"
    );
    let healthy_weight = q * (m - n_f) as f64;
    healthy_weight / (healthy_weight + n_f as f64)
}

/// With r retries to distinct servers: a call fails only if all r+1 attempts hit failed servers:
/// `C(n_f, r+1) / C(m, r+1)` (0 when r+1 > n_f), under a uniform choice among the servers not yet
/// tried (round-robin / random with the tried servers avoided).
///
/// Computed as the product `prod_{i=0}^{r} (n_f - i) / (m - i)`, which never forms the large
/// binomials. Attempts are capped at `m` (there are no more distinct servers): with `r + 1 >= m`
/// the call fails only when every server has failed.
///
/// Panics if `n_f > m` or `m == 0`.
pub fn retry_call_failure(m: u64, n_f: u64, r: u64) -> f64 {
    retry_call_failure_weighted(m, n_f, r, 1.0)
}

/// The retry formula when the balancer favours healthy servers by the factor `q` on every
/// attempt, as least-connections does at steady state: the attempts are a draw without
/// replacement with weight `q` per healthy and `1` per failed server, so
/// `prod_{i=0}^{r} (n_f - i) / ((n_f - i) + q (m - n_f))`.
///
/// This extends the model (it assumes the `1/t` share also holds among the servers left for a
/// retry); with `q = 1` it is exactly [`retry_call_failure`]. Panics if `n_f > m`, `m == 0` or
/// `q` is not positive.
pub fn retry_call_failure_weighted(m: u64, n_f: u64, r: u64, q: f64) -> f64 {
    assert!(
        m > 0 && n_f <= m,
        "need 0 <= n_f <= m and m > 0, got m={m}, n_f={n_f}"
    );
    assert!(q > 0.0, "q must be positive, got {q}");
    let attempts = r.saturating_add(1).min(m);
    if attempts > n_f {
        return 0.0;
    }
    let healthy_weight = q * (m - n_f) as f64;
    (0..attempts)
        .map(|i| {
            let failed_left = (n_f - i) as f64;
            failed_left / (failed_left + healthy_weight)
        })
        .product()
}

/// Success of a request of `k` sequential calls when each call may retry `r` times on distinct
/// servers: `(1 - retry_call_failure)^k` for round-robin / random, and with the weighted form
/// ([`retry_call_failure_weighted`]) for least-connections. None without closed form.
///
/// Panics as [`retry_call_failure_weighted`].
pub fn retry_success(
    strategy: StrategyKind,
    m: u64,
    n_f: u64,
    q: f64,
    r: u64,
    k: u32,
) -> Option<f64> {
    let call_failure = match strategy {
        StrategyKind::LeastConnections => retry_call_failure_weighted(m, n_f, r, q),
        s if has_closed_form(s) => retry_call_failure(m, n_f, r),
        _ => return None,
    };
    Some((1.0 - call_failure).powi(k as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPS: f64 = 1e-12;

    #[test]
    fn round_robin_seed_example() {
        let f = success(StrategyKind::RoundRobin, 0.2, 100.0, 3).unwrap();
        assert!((f - 0.512).abs() < EPS, "{f}");
        let f = success(StrategyKind::Random, 0.2, 0.1, 3).unwrap();
        assert!((f - 0.512).abs() < EPS, "q must not matter for random: {f}");
    }

    #[test]
    fn least_connections_seed_example() {
        let h = healthy_pick(StrategyKind::LeastConnections, 0.2, 100.0).unwrap();
        assert!((h - 400.0 / 401.0).abs() < EPS, "{h}");
        let h_counts = least_connections_healthy_pick_counts(5, 1, 100.0);
        assert!((h_counts - 400.0 / 401.0).abs() < EPS, "{h_counts}");
        let f = success(StrategyKind::LeastConnections, 0.2, 100.0, 3).unwrap();
        assert!((f - (400.0f64 / 401.0).powi(3)).abs() < EPS);
        // 0.99253734..., not the "0.99252..." once quoted for it (a typo)
        assert!((f - 0.992_537_344).abs() < 1e-9, "{f}");
        let share = failed_share(StrategyKind::LeastConnections, 0.2, 100.0).unwrap();
        assert!((share - 1.0 / 401.0).abs() < EPS, "{share}");
    }

    #[test]
    fn garbled_source_formula_does_not_reproduce_the_example() {
        // The two readings of the printed "(m-1*q)/(m*q-1)" for m = 5, q = 100.
        let (m, q) = (5.0, 100.0);
        let literal = (m - 1.0 * q) / (m * q - 1.0);
        let grouped = ((m - 1.0) * q) / (m * q - 1.0);
        let corrected = least_connections_healthy_pick_counts(5, 1, q);
        assert!(literal < 0.0);
        assert!((grouped - 400.0 / 499.0).abs() < EPS);
        assert!((corrected - grouped).abs() > 0.19);
    }

    #[test]
    fn least_connections_with_q_one_is_round_robin() {
        for i in 0..=100 {
            let p = i as f64 / 100.0;
            let lc = success(StrategyKind::LeastConnections, p, 1.0, 3).unwrap();
            let rr = success(StrategyKind::RoundRobin, p, 1.0, 3).unwrap();
            assert!((lc - rr).abs() < EPS, "p={p}: {lc} vs {rr}");
        }
    }

    #[test]
    fn least_connections_with_fast_failure_is_worse_than_round_robin() {
        for q in [0.1, 0.5, 0.9] {
            for i in 1..100 {
                let p = i as f64 / 100.0;
                let lc = healthy_pick(StrategyKind::LeastConnections, p, q).unwrap();
                assert!(lc < 1.0 - p, "q={q} p={p}: {lc}");
            }
        }
        // the black hole: one failed server of 10 failing 10x faster takes over half the calls
        let share = failed_share(StrategyKind::LeastConnections, 0.1, 0.1).unwrap();
        assert!((share - 0.1 / (0.1 + 0.1 * 0.9)).abs() < EPS);
        assert!(share > 0.5, "{share}");
    }

    #[test]
    fn least_connections_with_slow_failure_is_better_than_round_robin() {
        for i in 1..100 {
            let p = i as f64 / 100.0;
            let lc = healthy_pick(StrategyKind::LeastConnections, p, 10.0).unwrap();
            assert!(lc > 1.0 - p, "p={p}: {lc}");
        }
    }

    #[test]
    fn endpoints_of_p() {
        for q in [0.1, 1.0, 100.0] {
            assert_eq!(
                healthy_pick(StrategyKind::LeastConnections, 0.0, q),
                Some(1.0)
            );
            assert_eq!(
                healthy_pick(StrategyKind::LeastConnections, 1.0, q),
                Some(0.0)
            );
        }
        assert_eq!(success(StrategyKind::Random, 1.0, 1.0, 1), Some(0.0));
        assert_eq!(success(StrategyKind::Random, 0.5, 1.0, 0), Some(1.0));
    }

    #[test]
    fn none_without_closed_form_or_out_of_range() {
        for s in StrategyKind::ALL {
            assert_eq!(
                healthy_pick(s, 0.2, 100.0).is_some(),
                has_closed_form(s),
                "{s}"
            );
        }
        assert_eq!(healthy_pick(StrategyKind::PeakEwma, 0.2, 100.0), None);
        assert_eq!(healthy_pick(StrategyKind::RoundRobin, 1.5, 1.0), None);
        assert_eq!(healthy_pick(StrategyKind::RoundRobin, -0.1, 1.0), None);
        assert_eq!(healthy_pick(StrategyKind::RoundRobin, f64::NAN, 1.0), None);
        assert_eq!(healthy_pick(StrategyKind::LeastConnections, 0.2, 0.0), None);
        assert_eq!(
            healthy_pick(StrategyKind::LeastConnections, 0.2, f64::NAN),
            None
        );
    }

    /// All ordered choices of `attempts` distinct servers out of `m`, servers `0..n_f` failed;
    /// each sequence weighted by the product of its draw probabilities.
    fn brute_force_failure(m: u64, n_f: u64, attempts: u64, q: f64) -> f64 {
        fn walk(m: u64, n_f: u64, left: u64, used: &mut Vec<u64>, q: f64) -> f64 {
            if left == 0 {
                return 1.0;
            }
            let weight = |s: u64| if s < n_f { 1.0 } else { q };
            let total: f64 = (0..m).filter(|s| !used.contains(s)).map(weight).sum();
            let mut all_failed = 0.0;
            let failed_left: Vec<u64> = (0..n_f).filter(|s| !used.contains(s)).collect();
            for s in failed_left {
                used.push(s);
                all_failed += weight(s) / total * walk(m, n_f, left - 1, used, q);
                used.pop();
            }
            all_failed
        }
        walk(m, n_f, attempts.min(m), &mut Vec::new(), q)
    }

    #[test]
    fn retry_formula_matches_enumeration() {
        for m in 1..=7u64 {
            for n_f in 0..=m {
                for r in 0..=m + 1 {
                    let formula = retry_call_failure(m, n_f, r);
                    let brute = brute_force_failure(m, n_f, r + 1, 1.0);
                    assert!(
                        (formula - brute).abs() < 1e-12,
                        "m={m} n_f={n_f} r={r}: {formula} vs {brute}"
                    );
                    for q in [0.1, 3.0, 100.0] {
                        let weighted = retry_call_failure_weighted(m, n_f, r, q);
                        let brute = brute_force_failure(m, n_f, r + 1, q);
                        assert!(
                            (weighted - brute).abs() < 1e-12,
                            "q={q} m={m} n_f={n_f} r={r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn retry_formula_known_values() {
        // C(2,2)/C(5,2) = 1/10
        assert!((retry_call_failure(5, 2, 1) - 0.1).abs() < EPS);
        // no retry: n_f / m
        assert!((retry_call_failure(5, 1, 0) - 0.2).abs() < EPS);
        // one failed server and one retry: never fails
        assert_eq!(retry_call_failure(5, 1, 1), 0.0);
        // all failed: always fails
        assert_eq!(retry_call_failure(5, 5, 10), 1.0);
        let s = retry_success(StrategyKind::RoundRobin, 5, 2, 1.0, 1, 3).unwrap();
        assert!((s - 0.9f64.powi(3)).abs() < EPS);
        assert_eq!(retry_success(StrategyKind::PeakEwma, 5, 2, 1.0, 1, 3), None);
        // weighted, no retry, equals the least-connections counts form's failed share
        let w = retry_call_failure_weighted(5, 1, 0, 100.0);
        assert!((w - 1.0 / 401.0).abs() < EPS);
    }
}
