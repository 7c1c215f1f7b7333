//! A retry budget: retries are allowed while they stay under a share of the requests seen in a
//! sliding window, plus a small floor rate so that a quiet service can still retry. This is what
//! keeps retries from multiplying the load on a cluster that is already failing (a retry storm).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::{InvalidField, Problem};
use crate::time::nanos;

/// Retry budget settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Retries may be at most this percentage of the requests in the window. Default 20.
    pub budget_percent: f64,
    /// Retries always allowed per second, whatever the request count. Default 3.
    pub min_retries_per_second: f64,
    /// Sliding window over which requests and retries are counted. Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub window: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            budget_percent: 20.0,
            min_retries_per_second: 3.0,
            window: Duration::from_secs(10),
        }
    }
}

impl RetryBudgetConfig {
    /// Checks the ranges; the error names the field relative to this table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let bad = |key, problem| Err(InvalidField::at(key, problem));
        if self.budget_percent.is_nan() || self.budget_percent < 0.0 {
            return bad(
                "budget_percent",
                Problem::out_of_range("0 or more", self.budget_percent),
            );
        }
        if self.min_retries_per_second.is_nan() || self.min_retries_per_second < 0.0 {
            return bad(
                "min_retries_per_second",
                Problem::out_of_range("0 or more", self.min_retries_per_second),
            );
        }
        if self.window < Duration::from_millis(10) {
            return bad(
                "window",
                Problem::out_of_range("at least 10ms", format!("{:?}", self.window)),
            );
        }
        Ok(())
    }
}

const BUCKETS: usize = 10;

/// One tenth of the window: the requests and retries counted in it, and which tenth it is.
#[derive(Debug, Default)]
struct Bucket {
    epoch: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

/// Counts requests and retries in a sliding window of ten buckets and says whether one more
/// retry fits. Lock-free: every request of a cluster passes here, so it must not serialise
/// them. Under a race two threads may both take the last retry of the budget, and a count
/// made at the instant its bucket is recycled may be lost; both are off by one at most.
#[derive(Debug)]
pub struct RetryBudget {
    config: RetryBudgetConfig,
    bucket_ns: u64,
    buckets: [Bucket; BUCKETS],
}

impl RetryBudget {
    /// A budget with these settings (validate them first).
    pub fn new(config: RetryBudgetConfig) -> Self {
        let bucket_ns = (nanos(config.window) / BUCKETS as u64).max(1);
        Self {
            config,
            bucket_ns,
            buckets: Default::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RetryBudgetConfig {
        &self.config
    }

    fn epoch(&self, now: Duration) -> u64 {
        nanos(now) / self.bucket_ns + 1
    }

    /// The bucket of `epoch`, recycled if it still holds an older tenth.
    fn current(&self, epoch: u64) -> &Bucket {
        let b = &self.buckets[(epoch % BUCKETS as u64) as usize];
        let seen = b.epoch.load(Ordering::Acquire);
        if seen < epoch
            && b.epoch
                .compare_exchange(seen, epoch, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            b.requests.store(0, Ordering::Relaxed);
            b.retries.store(0, Ordering::Relaxed);
        }
        b
    }

    /// (requests, retries) in the buckets of the window ending at `epoch`.
    fn window(&self, epoch: u64) -> (u64, u64) {
        self.buckets
            .iter()
            .filter(|b| {
                let e = b.epoch.load(Ordering::Acquire);
                e <= epoch && e + (BUCKETS as u64) > epoch
            })
            .fold((0, 0), |(q, r), b| {
                (
                    q + b.requests.load(Ordering::Relaxed),
                    r + b.retries.load(Ordering::Relaxed),
                )
            })
    }

    /// Counts one original request (not a retry).
    pub fn record_request(&self, now: Duration) {
        self.current(self.epoch(now))
            .requests
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Asks for one retry: true (and counted) while retries in the window stay within
    /// `budget_percent` of the requests plus `min_retries_per_second` x window.
    pub fn try_retry(&self, now: Duration) -> bool {
        let epoch = self.epoch(now);
        let bucket = self.current(epoch);
        let (requests, retries) = self.window(epoch);
        let floor = self.config.min_retries_per_second * self.config.window.as_secs_f64();
        let allowed = (requests as f64 * self.config.budget_percent / 100.0 + floor).floor();
        if (retries as f64) < allowed {
            bucket.retries.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// (requests, retries) counted in the current window.
    pub fn counts(&self, now: Duration) -> (u64, u64) {
        let epoch = self.epoch(now);
        self.current(epoch);
        self.window(epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn retries_stay_within_percent_of_requests() {
        let b = RetryBudget::new(RetryBudgetConfig {
            budget_percent: 20.0,
            min_retries_per_second: 0.0,
            window: Duration::from_secs(10),
        });
        for _ in 0..100 {
            b.record_request(ms(100));
        }
        let granted = (0..100).filter(|_| b.try_retry(ms(200))).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn floor_allows_retries_without_traffic() {
        let b = RetryBudget::new(RetryBudgetConfig {
            budget_percent: 20.0,
            min_retries_per_second: 1.0,
            window: Duration::from_secs(10),
        });
        let granted = (0..100).filter(|_| b.try_retry(ms(5))).count();
        assert_eq!(granted, 10, "1/s over a 10 s window");
    }

    #[test]
    fn concurrent_requests_are_all_counted() {
        let b = RetryBudget::new(RetryBudgetConfig::default());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        b.record_request(ms(1_500));
                    }
                });
            }
        });
        assert_eq!(b.counts(ms(1_500)), (40_000, 0));
    }

    #[test]
    fn window_slides_and_old_requests_stop_counting() {
        let b = RetryBudget::new(RetryBudgetConfig {
            budget_percent: 50.0,
            min_retries_per_second: 0.0,
            window: Duration::from_secs(1),
        });
        for _ in 0..10 {
            b.record_request(ms(0));
        }
        assert!(b.try_retry(ms(500)));
        // 1.5 s later the requests at t=0 are out of the window: no budget left.
        assert!(!b.try_retry(ms(2_000)));
        assert_eq!(b.counts(ms(2_000)), (0, 0));
    }
}
