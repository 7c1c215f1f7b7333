//! Least-time: the source's "minimum response time", the lowest latency estimate.

use super::{Observation, Strategy, View};
use crate::config::{StrategyOptions, TieBreak};
use crate::endpoint::nanos;
use crate::rng::{below, mix64};

/// The lowest EWMA of observed response times. With the random tie-break, every endpoint whose
/// estimate is within `tolerance` of the lowest counts as equally fast, and they share the picks
/// in proportion to weight; an endpoint without a sample (new, or back from an ejection) joins
/// them, so that it gets its share until its first samples say how fast it is. Anything slower
/// gets nothing until the others slow down: that is least-time's rule, sluggish by design.
pub(crate) struct LeastTime {
    tie: TieBreak,
    decay_ns: f64,
    tolerance: f64,
}

impl LeastTime {
    pub(crate) fn new(o: &StrategyOptions) -> Self {
        Self {
            tie: o.tie_break,
            decay_ns: nanos(o.decay) as f64,
            tolerance: o.latency_tolerance,
        }
    }
}

impl Strategy for LeastTime {
    fn pick(&self, v: &View<'_>, _key: Option<u64>) -> Option<usize> {
        if self.tie == TieBreak::LowestIndex {
            // The lowest estimate, unsampled endpoints first, the first of equals.
            return v.min_by(self.tie, |i| v.eps[i].latency().value().unwrap_or(0.0));
        }
        let fastest = (0..v.eps.len())
            .filter(|&i| v.allowed(i))
            .filter_map(|i| v.eps[i].latency().value())
            .fold(f64::INFINITY, f64::min);
        let limit = fastest * (1.0 + self.tolerance);
        let mut chosen = None;
        let mut total = 0u64;
        let mut bits = v.rng.next_u64();
        for i in 0..v.eps.len() {
            if !v.allowed(i) || v.eps[i].latency().value().is_some_and(|x| x > limit) {
                continue;
            }
            let w = v.weight_milli(i);
            total += w;
            bits = mix64(bits);
            if (below(bits, total as usize) as u64) < w {
                chosen = Some(i);
            }
        }
        chosen
    }

    fn follows_calls(&self) -> bool {
        true
    }

    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        let Observation::CallEnded { latency_ns, .. } = *what;
        // The source's rule: the average of observed response times, failures included. That
        // is exactly the trap of experiment E4 when failures are fast.
        v.eps[i]
            .latency()
            .record(latency_ns as f64, v.now, self.decay_ns, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    fn options(tie: TieBreak) -> StrategyOptions {
        StrategyOptions {
            tie_break: tie,
            ..StrategyOptions::default()
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn equally_fast_endpoints_share_by_weight() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random));
        assert_shares(&b.sequential(&s, 30_000, 10 * MS), &[2, 1, 1, 1, 1], 0.015);
    }

    #[test]
    fn the_fastest_takes_everything_even_when_it_fails_fast() {
        let b = Bench::new(&[1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random));
        // Teach it: 0 takes 30 ms, 1 takes 10 ms, 2 fails in 1 ms.
        let mut now = 0;
        for _ in 0..30 {
            let i = b.start(&s, now);
            let (lat, ok) = [(30, true), (10, true), (1, false)][i];
            b.end(&s, i, now + lat * MS, lat * MS, ok);
            now += 50 * MS;
        }
        let mut counts = [0; 3];
        for _ in 0..100 {
            let i = b.start(&s, now);
            counts[i] += 1;
            let (lat, ok) = [(30, true), (10, true), (1, false)][i];
            b.end(&s, i, now + lat * MS, lat * MS, ok);
            now += 50 * MS;
        }
        assert_eq!(counts, [0, 0, 100]);
    }

    #[test]
    fn an_endpoint_without_a_sample_gets_its_share() {
        let b = Bench::new(&[1, 1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random));
        b.sequential(&s, 1_000, 10 * MS);
        // Back from an ejection: no estimate, and still its share.
        b.eps[3].eject(1);
        assert_eq!(b.eps[3].latency_estimate(), None);
        assert_shares(&b.sequential(&s, 20_000, 10 * MS), &[1, 1, 1, 1], 0.02);
    }
}
