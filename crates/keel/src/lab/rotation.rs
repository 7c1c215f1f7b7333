//! Round-robin's rotation in step: the closed form of a client that makes all k calls of a
//! request when one server of n has failed and the clients' calls keep their order.

/// Round-robin over `n` servers, one failed, clients that each make all `k` calls of a
/// request, in step: a request's success, `1 - k / n` (0.400 for 3 calls of 5). Only the
/// spacing after a healthy call matters (a failed request is failed whatever follows), so the
/// failure may be fast or a hang.
///
/// In step (every healthy call takes its time, the gap between two clients' picks is larger
/// than the noise in those times), a client whose call fails at once picks again before anyone
/// else and takes the next position itself, so the others keep their places in the rotation
/// and a request's k calls land on k distinct positions: it fails when the failed server is
/// among them. keel's simulator, whose calls take exactly their time, gives 0.400 with 2
/// clients and 0.403 with 24. Over real sockets that holds while the gap between picks (a healthy call's
/// time over the clients' count) is large against the noise: with 2 clients (a gap of about
/// 2 ms) the lab measures 0.400; with 24 (0.2 ms) the noise reorders the picks, a request's
/// calls land as independent calls do and success is (1 - 1/n)^k (Interleaving). One rotation
/// per worker (Envoy) changes nothing: each is in step.
///
/// Panics unless `0 < k < n`.
pub(crate) fn rotation_success(n: u32, k: u32) -> f64 {
    assert!(k > 0 && k < n, "0 < k < n, got k = {k}, n = {n}");
    1.0 - f64::from(k) / f64::from(n)
}

/// Clients of an all-calls row that keep the rotation in step: the gap between their picks
/// (a 4 ms call over 2 clients) is far above loopback's noise.
pub(crate) const IN_STEP_CLIENTS: usize = 2;

/// Round-robin with a failed share `p` of servers, clients that make all `k` calls of a
/// request, the order of their picks shuffled by the healthy times' spread, and `s` the share
/// of calls made right after a failed call that fail too: a request's success,
/// `(1 - p)(1 - r)^(k - 1)` with `r = p(1 - s) / (1 - p)`.
///
/// A call after a healthy one fails at rate `r`, a call after a failed one at `s`; the failed
/// server still takes its share `p` of all calls, which fixes `r` (the stationary share of a
/// two-state chain, `r / (1 + r - s) = p`). Independent calls have `s = r = p` and give
/// `(1 - p)^k`; a client whose call failed at once and picks again before anyone else takes the
/// next server in the rotation, a healthy one, so `s = 0` and the failed server's share falls
/// on more requests: 0.450 for 3 calls of 5 servers, one failed, against 0.512.
pub(crate) fn after_failure_success(p: f64, k: u32, s: f64) -> f64 {
    let r = p * (1.0 - s) / (1.0 - p);
    (1.0 - p) * (1.0 - r).powi(k as i32 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_step_calls_land_on_distinct_positions() {
        assert!((rotation_success(5, 3) - 0.4).abs() < 1e-12);
        assert!((rotation_success(5, 1) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn a_call_after_a_failure_landing_healthy_spreads_the_failures() {
        // s = 0: the failed client takes the next, healthy server.
        assert!((after_failure_success(0.2, 3, 0.0) - 0.45).abs() < 1e-12);
        // s = p: independent calls, (1 - p)^k.
        assert!((after_failure_success(0.2, 3, 0.2) - 0.512).abs() < 1e-12);
        // One call: no call follows a failure.
        assert!((after_failure_success(0.2, 1, 0.0) - 0.8).abs() < 1e-12);
    }

    /// The chain the closed form solves, drawn: its success and the failed share of calls.
    #[test]
    fn the_closed_form_matches_the_chain_it_solves() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (p, k, s) = (0.2, 3u32, 0.05);
        let r = p * (1.0 - s) / (1.0 - p);
        let (mut ok, mut failed_calls, mut previous_failed) = (0u64, 0u64, false);
        let requests = 200_000u64;
        for _ in 0..requests {
            let mut good = true;
            for _ in 0..k {
                let f = rng.gen::<f64>() < if previous_failed { s } else { r };
                previous_failed = f;
                failed_calls += u64::from(f);
                good &= !f;
            }
            ok += u64::from(good);
        }
        let share = failed_calls as f64 / (requests * u64::from(k)) as f64;
        let success = ok as f64 / requests as f64;
        // Standard errors about 0.0011 for the success over 200,000 requests.
        assert!((share - p).abs() < 0.005, "share {share}");
        assert!(
            (success - after_failure_success(p, k, s)).abs() < 0.005,
            "success {success}"
        );
    }
}
