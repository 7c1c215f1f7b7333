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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_step_calls_land_on_distinct_positions() {
        assert!((rotation_success(5, 3) - 0.4).abs() < 1e-12);
        assert!((rotation_success(5, 1) - 0.8).abs() < 1e-12);
    }
}
