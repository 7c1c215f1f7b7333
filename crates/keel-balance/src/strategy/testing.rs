//! A small harness for the strategies' unit tests: endpoints, a view over them, picks.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::api::{Call, Observation, Strategy, View};
use crate::endpoint::{Endpoint, EndpointSpec};
use crate::rng::SharedRng;
use crate::Outcome;

/// Endpoints of these weights.
pub fn endpoints(weights: &[u32]) -> Vec<Arc<Endpoint>> {
    weights
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            Arc::new(Endpoint::new(
                &EndpointSpec::new(format!("10.9.0.{i}:80")).with_weight(w),
                0,
            ))
        })
        .collect()
}

/// Everything a view borrows.
pub struct Bench {
    pub eps: Vec<Arc<Endpoint>>,
    pub rng: SharedRng,
    pub group: AtomicU64,
}

impl Bench {
    pub fn new(weights: &[u32]) -> Self {
        Self {
            eps: endpoints(weights),
            rng: SharedRng::new(7),
            group: AtomicU64::new(0),
        }
    }

    pub fn view(&self, now: u64) -> View<'_> {
        View {
            eps: &self.eps,
            now,
            avoid: &[],
            ignore_health: false,
            slow_start: None,
            rng: &self.rng,
            group: &self.group,
            half_open: true,
            back_off: false,
            queue_max_age: 0,
        }
    }

    /// Picks at `now` and counts the call in flight, as the balancer does.
    pub fn start(&self, s: &dyn Strategy, now: u64) -> usize {
        let v = self.view(now);
        let i = s.pick(&v, Call::NONE).expect("an endpoint");
        self.eps[i].begin_call();
        if s.follows_calls() {
            s.started(&v, i);
        }
        i
    }

    /// Ends a call on `i` at `now` that took `latency_ns`.
    pub fn end(&self, s: &dyn Strategy, i: usize, now: u64, latency_ns: u64, ok: bool) {
        self.eps[i].end_call();
        let outcome = if ok {
            Outcome::Success
        } else {
            Outcome::Failure
        };
        if s.follows_calls() {
            s.observe(
                &self.view(now),
                i,
                &Observation::CallEnded {
                    outcome,
                    latency_ns,
                },
            );
        }
    }

    /// `n` calls one after another, each taking `latency_ns`; picks per endpoint.
    pub fn sequential(&self, s: &dyn Strategy, n: usize, latency_ns: u64) -> Vec<usize> {
        let mut counts = vec![0; self.eps.len()];
        let mut now = 1_000_000_000;
        for _ in 0..n {
            let i = self.start(s, now);
            counts[i] += 1;
            now += latency_ns;
            self.end(s, i, now, latency_ns, true);
        }
        counts
    }
}

/// Asserts that `counts` follow `weights` within `tolerance` of each share.
pub fn assert_shares(counts: &[usize], weights: &[u32], tolerance: f64) {
    let n: usize = counts.iter().sum();
    let total: u32 = weights.iter().sum();
    for (c, w) in counts.iter().zip(weights) {
        let got = *c as f64 / n as f64;
        let want = f64::from(*w) / f64::from(total);
        assert!(
            (got - want).abs() <= tolerance,
            "{counts:?} vs weights {weights:?}"
        );
    }
}
