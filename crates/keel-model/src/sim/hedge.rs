//! Hedged requests in the simulator: the delay after which a call is hedged, from the latencies
//! a balancer has observed lately, and the budget that bounds hedges.

use std::time::Duration;

use keel_balance::{RetryBudget, RetryBudgetConfig};

use super::scenario::{HedgeConfig, HedgeDelay};
use super::stats::{log_index, log_value};

/// 16 buckets per power of two: a delay read at a bucket's middle is within 3 % of the quantile.
const BITS: u32 = 4;
const BUCKETS: usize = ((64 - BITS as usize) + 1) << BITS;
/// Samples per generation: the quantile is over the last 1000 to 2000 calls.
const WINDOW: u32 = 1000;
/// No quantile (so no hedge) before this many samples: a p95 of fewer is mostly noise.
const MIN_SAMPLES: u32 = 100;
/// Samples between two readings of the quantile (reading scans every bucket).
const REREAD_EVERY: u32 = 32;

/// A quantile of the latest call latencies: two generations of a coarse log histogram, the
/// older dropped when the newer fills, so that the estimate follows changes within a few
/// thousand calls.
pub(super) struct RecentQuantile {
    q: f64,
    counts: [Vec<u32>; 2],
    current: usize,
    in_current: u32,
    in_previous: u32,
    since_read: u32,
    value_ns: Option<u64>,
}

impl RecentQuantile {
    pub(super) fn new(q: f64) -> Self {
        Self {
            q,
            counts: [vec![0; BUCKETS], vec![0; BUCKETS]],
            current: 0,
            in_current: 0,
            in_previous: 0,
            since_read: REREAD_EVERY,
            value_ns: None,
        }
    }

    #[inline]
    pub(super) fn record(&mut self, ns: u64) {
        self.counts[self.current][log_index(ns, BITS)] += 1;
        self.in_current += 1;
        self.since_read += 1;
        if self.in_current == WINDOW {
            self.current ^= 1;
            self.counts[self.current].fill(0);
            self.in_previous = WINDOW;
            self.in_current = 0;
        }
    }

    /// The quantile in nanoseconds, or `None` while fewer than `MIN_SAMPLES` calls were seen.
    pub(super) fn get(&mut self) -> Option<u64> {
        let n = self.in_current + self.in_previous;
        if n < MIN_SAMPLES {
            return None;
        }
        if self.since_read >= REREAD_EVERY {
            self.since_read = 0;
            let rank = ((self.q * f64::from(n)).ceil() as u32).clamp(1, n);
            let mut seen = 0;
            for i in 0..BUCKETS {
                seen += self.counts[0][i] + self.counts[1][i];
                if seen >= rank {
                    self.value_ns = Some(log_value(i, BITS) as u64);
                    break;
                }
            }
        }
        self.value_ns
    }
}

/// One balancer's hedging state.
pub(super) struct Hedger {
    delay: HedgeDelay,
    recent: Option<RecentQuantile>,
    pub(super) budget: RetryBudget,
}

impl Hedger {
    pub(super) fn new(config: &HedgeConfig) -> Self {
        Self {
            delay: config.delay,
            recent: match config.delay {
                HedgeDelay::Quantile(q) => Some(RecentQuantile::new(q)),
                HedgeDelay::Fixed(_) => None,
            },
            // No floor: at low rates a floor would let hedges exceed the budget's share.
            budget: RetryBudget::new(RetryBudgetConfig {
                budget_percent: config.budget_percent,
                min_retries_per_second: 0.0,
                window: Duration::from_secs(10),
            }),
        }
    }

    /// A first try's latency (what the quantile is over): its answer's, or how long it had run
    /// when its hedge won.
    #[inline]
    pub(super) fn observe(&mut self, ns: u64) {
        if let Some(r) = &mut self.recent {
            r.record(ns);
        }
    }

    /// How long to wait before hedging a call that starts now; `None`: do not hedge it.
    #[inline]
    pub(super) fn delay_ns(&mut self) -> Option<u64> {
        match self.delay {
            HedgeDelay::Fixed(d) => Some(d.as_nanos().min(u128::from(u64::MAX / 4)) as u64),
            HedgeDelay::Quantile(_) => self.recent.as_mut()?.get().map(|v| v.max(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_quantile_needs_samples_then_follows_the_latest_calls() {
        let mut r = RecentQuantile::new(0.95);
        for i in 0..99u64 {
            r.record(1_000_000 + i);
        }
        assert_eq!(r.get(), None);
        // 1..=1000 us: p95 = 950 us, within the 3 % of a bucket.
        let mut r = RecentQuantile::new(0.95);
        for i in 1..=1000u64 {
            r.record(i * 1000);
        }
        let p95 = r.get().unwrap() as f64;
        assert!((p95 - 950_000.0).abs() / 950_000.0 < 0.03, "{p95}");
        // Two windows later the old values are gone: everything is 10 ms now.
        for _ in 0..2000 {
            r.record(10_000_000);
        }
        let v = r.get().unwrap() as f64;
        assert!((v - 1e7).abs() / 1e7 < 0.03, "{v}");
    }
}
