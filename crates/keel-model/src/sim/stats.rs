//! A latency histogram with bounded relative error for quantiles. (Confidence intervals are in
//! [`crate::stats`].)

/// Sub-buckets per power of two: a bucket spans at most 1/128 of its lower bound, and a
/// quantile read at the bucket's middle is within 0.4 % of the true value.
const SUB_BITS: u32 = 7;
/// Buckets for every u64 value: exact below 128, then 128 per power of two.
const BUCKETS: usize = log_buckets::count(SUB_BITS);

use keel_balance::hedge::log_buckets::{self, index as log_index, value as log_value};

/// A log-linear histogram of durations in nanoseconds (HdrHistogram's layout with 7 bits of
/// precision): recording is a few instructions and no allocation, and a quantile is within
/// 0.4 % of the exact order statistic (well inside the 1 % the reports promise). The mean is
/// exact.
#[derive(Clone, PartialEq)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    sum_ns: u128,
    max_ns: u64,
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.total)
            .field("mean_ns", &self.mean_ns())
            .finish()
    }
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram (about 60 KB).
    pub fn new() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            total: 0,
            sum_ns: 0,
            max_ns: 0,
        }
    }

    #[inline]
    fn index(v: u64) -> usize {
        log_index(v, SUB_BITS)
    }

    fn value(i: usize) -> f64 {
        log_value(i, SUB_BITS)
    }

    /// Records one duration.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        self.counts[Self::index(ns)] += 1;
        self.total += 1;
        self.sum_ns += u128::from(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.sum_ns += other.sum_ns;
        self.max_ns = self.max_ns.max(other.max_ns);
    }

    /// Durations recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Exact mean in nanoseconds (0 when empty).
    pub fn mean_ns(&self) -> f64 {
        self.sum_ns as f64 / self.total.max(1) as f64
    }

    /// The `q` quantile in nanoseconds: the smallest recorded value with at least a share `q` of
    /// the values at or below it (nearest rank), read at its bucket's middle. 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::value(i).min(self.max_ns as f64);
            }
        }
        self.max_ns as f64
    }

    /// `(latency, share at or below it)` at every bucket that holds values: the empirical
    /// distribution function, for charts.
    pub fn cdf_ns(&self) -> Vec<(f64, f64)> {
        let mut seen = 0;
        let n = self.total.max(1) as f64;
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c > 0)
            .map(|(i, &c)| {
                seen += c;
                (Self::value(i), seen as f64 / n)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_half_a_percent() {
        let mut h = LatencyHistogram::new();
        // 1..=1_000_000 ns, each once: the q quantile is q x 10^6.
        for v in 1..=1_000_000u64 {
            h.record(v);
        }
        for q in [0.5, 0.9, 0.99, 0.999] {
            let exact = q * 1e6;
            let got = h.quantile_ns(q);
            assert!(
                (got - exact).abs() / exact < 0.004,
                "q={q}: {got} vs {exact}"
            );
        }
        assert!((h.mean_ns() - 500_000.5).abs() < 1e-6);
        assert_eq!(h.quantile_ns(1.0), 1_000_000.0);
        // Small values are exact.
        let mut s = LatencyHistogram::new();
        for v in [3u64, 5, 7, 9] {
            s.record(v);
        }
        assert_eq!(s.quantile_ns(0.5), 5.0);
        assert_eq!(s.quantile_ns(0.75), 7.0);
        // Every bucket index round-trips to a value inside its own bucket.
        for v in [128u64, 255, 256, 1 << 20, (1 << 20) + 12345, u64::MAX / 3] {
            let i = LatencyHistogram::index(v);
            assert_eq!(
                LatencyHistogram::index(LatencyHistogram::value(i) as u64),
                i,
                "{v}"
            );
            assert!((LatencyHistogram::value(i) - v as f64).abs() / v as f64 <= 1.0 / 128.0);
        }
        let mut m = h.clone();
        m.merge(&s);
        assert_eq!(m.count(), 1_000_004);
    }
}
