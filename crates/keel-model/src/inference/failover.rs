//! An engine that holds prefixes fails under `prefix-affinity`: the failed tries before its
//! prefixes move, and the cache hits lost while they warm elsewhere (the lab's E17). Derivation
//! and limits: docs/inference.md, "An affine engine fails".
//!
//! keel's rule (keel-balance's `prefix-affinity`): a failed call (refused, reset, timed out, a
//! 5xx; never a 4xx) empties the engine's estimate and passes the engine over for 5 s or until
//! one of its calls succeeds. So the first failure that is *seen* moves every group the engine
//! held, not only the group whose call failed: each held group's next request is matched
//! nowhere, goes to the engine holding the fewest prefixes, and warms the cache there.
//!
//! - **Failed tries.** The first try on the failed engine fails; so does every try that starts
//!   there before that failure is seen, `d` seconds later (`d`: a hang's per-try timeout, a
//!   500's answer time, a refused connection's round trip). With `C` closed-loop clients, each
//!   sending its next request `S` seconds after its last (the healthy pool's cycle), a share
//!   `h = H / G` of them for the `H` of `G` groups the engine held, each other client starts a
//!   try there within `d` with probability `1 - e^{-h d / S}`; a hung try holds its client past
//!   the window, so each client adds at most one:
//!   `F = 1 + (C - 1) (1 - e^{-h d / S})`. For a failure seen at once (`d -> 0`), `F = 1`: one
//!   failed try in all, at most one per group. Open loop at `lambda` requests per second:
//!   `F = 1 + lambda h d`.
//! - **Who sees them.** A 500 is the client's failure (an answer, not retried); a hang ends at
//!   the per-try timeout before its answer began and a refused connection at once, and keel
//!   retries both on the next-best engine, so the client sees none.
//! - **Hits lost.** Each of the `H` held groups misses its prefix once, on its first request at
//!   its new engine (the compulsory miss of a cold cache, when the survivors' caches hold the
//!   moved groups): `L = H` requests, `H x` the prefix's cached tokens. With an even partition
//!   `H = G / N`: the failed engine's share of the groups times one warm-up miss each.

/// How an engine fails, as far as the cost of its failure goes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Failover {
    /// Engines in the pool (N).
    pub engines: usize,
    /// Prefix groups, equally popular (G).
    pub groups: usize,
    /// Closed-loop clients (C), each with one request in flight.
    pub clients: usize,
    /// A client's time from one request to its next while the pool is healthy (S), seconds.
    pub cycle: f64,
    /// From the start of a try on the failed engine to its failure being seen (d), seconds.
    pub detection: f64,
    /// The failed try is retried at once elsewhere (a refused connection).
    pub retried: bool,
}

/// What the failure costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FailoverCost {
    /// Groups the failed engine held (H = G / N under affinity's even partition).
    pub held: f64,
    /// Failed tries in all before the engine is passed over (F).
    pub failed_tries: f64,
    /// Per held group (F / H).
    pub per_group: f64,
    /// Of the failed tries, those the clients see (0 when retried).
    pub client_failures: f64,
    /// Requests that miss their prefix because their group moved (L = H).
    pub misses: f64,
}

impl Failover {
    /// The closed forms (see the module's text).
    pub fn cost(&self) -> FailoverCost {
        let g = self.groups.max(1) as f64;
        let held = g / self.engines.max(1) as f64;
        let h = held / g;
        let others = self.clients.saturating_sub(1) as f64;
        let window = if self.cycle > 0.0 {
            h * self.detection.max(0.0) / self.cycle
        } else {
            0.0
        };
        let failed_tries = 1.0 + others * (1.0 - (-window).exp());
        FailoverCost {
            held,
            failed_tries,
            per_group: failed_tries / held,
            client_failures: if self.retried { 0.0 } else { failed_tries },
            misses: held,
        }
    }
}

/// A closed-loop client's cycle in a healthy pool (S): its request's time to first token plus
/// the rest of its answer's steps, each step taking `step_ms + step_per_seq_ms x` the
/// sequences an engine runs (`clients / engines` in flight on each).
pub fn cycle(
    spec: &super::EngineSpec,
    w: &super::formula::Workload,
    ttft: f64,
    clients: usize,
    engines: usize,
) -> f64 {
    let running = clients as f64 / engines.max(1) as f64;
    let step = (spec.step_ms + spec.step_per_seq_ms * running.max(1.0)) / 1000.0;
    ttft + w.output_tokens.saturating_sub(1) as f64 * step
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_seen_at_once_costs_one_try() {
        let f = Failover {
            engines: 3,
            groups: 6,
            clients: 3,
            cycle: 0.08,
            detection: 0.0,
            retried: false,
        };
        let c = f.cost();
        assert_eq!((c.held, c.failed_tries, c.per_group), (2.0, 1.0, 0.5));
        assert_eq!((c.client_failures, c.misses), (1.0, 2.0));
        let refused = Failover { retried: true, ..f }.cost();
        assert_eq!(refused.client_failures, 0.0);
    }

    #[test]
    fn a_hang_costs_the_tries_started_before_its_timeout() {
        let f = Failover {
            engines: 3,
            groups: 6,
            clients: 3,
            cycle: 0.1,
            detection: 0.3,
            retried: false,
        };
        // h d / S = 1/3 x 3 = 1: each of the 2 other clients with probability 1 - 1/e.
        let want = 1.0 + 2.0 * (1.0 - (-1.0f64).exp());
        assert!((f.cost().failed_tries - want).abs() < 1e-12);
        // Never more than one per client.
        let long = Failover {
            detection: 1e3,
            ..f
        };
        assert!((long.cost().failed_tries - 3.0).abs() < 1e-9);
    }
}
