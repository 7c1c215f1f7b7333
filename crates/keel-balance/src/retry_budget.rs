//! A retry budget: retries are allowed while they stay under a share of the requests seen in a
//! sliding window, plus a small floor rate so that a quiet service can still retry. This is what
//! keeps retries from multiplying the load on a cluster that is already failing (a retry storm).

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::endpoint::nanos;

/// Retry budget settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Retries may be at most this percentage of the requests in the window. Default 20.
    pub budget_percent: f64,
    /// Retries always allowed per second, whatever the request count. Default 3.
    pub min_retries_per_second: f64,
    /// Sliding window over which requests and retries are counted. Default 10 s.
    #[serde(with = "humantime_serde")]
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
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), String> {
        if self.budget_percent.is_nan() || self.budget_percent < 0.0 {
            return Err(format!(
                "budget_percent must be 0 or more, got {}",
                self.budget_percent
            ));
        }
        if self.min_retries_per_second.is_nan() || self.min_retries_per_second < 0.0 {
            return Err(format!(
                "min_retries_per_second must be 0 or more, got {}",
                self.min_retries_per_second
            ));
        }
        if self.window < Duration::from_millis(10) {
            return Err("retry budget window must be at least 10ms".into());
        }
        Ok(())
    }
}

const BUCKETS: usize = 10;

#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    epoch: u64,
    requests: u64,
    retries: u64,
}

/// Counts requests and retries in a sliding window of ten buckets and says whether one more
/// retry fits. One short lock per call: the counts must move together.
#[derive(Debug)]
pub struct RetryBudget {
    config: RetryBudgetConfig,
    bucket_ns: u64,
    buckets: Mutex<[Bucket; BUCKETS]>,
}

impl RetryBudget {
    /// A budget with these settings (validate them first).
    pub fn new(config: RetryBudgetConfig) -> Self {
        let bucket_ns = (nanos(config.window) / BUCKETS as u64).max(1);
        Self {
            config,
            bucket_ns,
            buckets: Mutex::new([Bucket::default(); BUCKETS]),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RetryBudgetConfig {
        &self.config
    }

    fn with_current<R>(
        &self,
        now: Duration,
        f: impl FnOnce(&mut [Bucket; BUCKETS], usize) -> R,
    ) -> R {
        let epoch = nanos(now) / self.bucket_ns + 1;
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let i = (epoch % BUCKETS as u64) as usize;
        if buckets[i].epoch != epoch {
            buckets[i] = Bucket {
                epoch,
                requests: 0,
                retries: 0,
            };
        }
        // Buckets older than the window no longer count.
        for b in buckets.iter_mut() {
            if b.epoch + (BUCKETS as u64) <= epoch {
                *b = Bucket::default();
            }
        }
        f(&mut buckets, i)
    }

    /// Counts one original request (not a retry).
    pub fn record_request(&self, now: Duration) {
        self.with_current(now, |b, i| b[i].requests += 1);
    }

    /// Asks for one retry: true (and counted) while retries in the window stay within
    /// `budget_percent` of the requests plus `min_retries_per_second` x window.
    pub fn try_retry(&self, now: Duration) -> bool {
        let window_s = self.config.window.as_secs_f64();
        let pct = self.config.budget_percent;
        let floor = self.config.min_retries_per_second * window_s;
        self.with_current(now, |b, i| {
            let requests: u64 = b.iter().map(|x| x.requests).sum();
            let retries: u64 = b.iter().map(|x| x.retries).sum();
            let allowed = (requests as f64 * pct / 100.0 + floor).floor();
            if (retries as f64) < allowed {
                b[i].retries += 1;
                true
            } else {
                false
            }
        })
    }

    /// (requests, retries) counted in the current window.
    pub fn counts(&self, now: Duration) -> (u64, u64) {
        self.with_current(now, |b, _| {
            (
                b.iter().map(|x| x.requests).sum(),
                b.iter().map(|x| x.retries).sum(),
            )
        })
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
