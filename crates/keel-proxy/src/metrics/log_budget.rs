//! A rate limit for log lines, per cluster: failures are logged, but an outage's thousands
//! of failed tries a second must not become its bottleneck.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A log rate limit: at most `per_second` lines a second (per cluster), counting the lines
/// it suppressed so that the next line says how many. A few atomics, no lock: the logging of
/// failures must not become the outage's bottleneck.
#[derive(Debug)]
pub(crate) struct LogBudget {
    per_second: u64,
    /// The second (since the epoch) the count is for.
    second: AtomicU64,
    /// Lines allowed in that second.
    used: AtomicU64,
    /// Lines suppressed since the last line written.
    suppressed: AtomicU64,
    epoch: Instant,
}

impl LogBudget {
    /// At most `per_second` lines a second.
    pub fn new(per_second: u64, epoch: Instant) -> Self {
        Self {
            per_second,
            second: AtomicU64::new(0),
            used: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            epoch,
        }
    }

    /// True if a line may be written now (then call [`Self::take_suppressed`] for it).
    pub fn allow(&self) -> bool {
        let now = self.epoch.elapsed().as_secs();
        if self.second.load(Relaxed) != now {
            self.second.store(now, Relaxed);
            self.used.store(0, Relaxed);
        }
        if self.used.fetch_add(1, Relaxed) < self.per_second {
            true
        } else {
            self.suppressed.fetch_add(1, Relaxed);
            false
        }
    }

    /// Lines suppressed since the last one written (reset to 0).
    pub fn take_suppressed(&self) -> u64 {
        self.suppressed.swap(0, Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_budget_allows_a_few_lines_a_second_and_counts_the_rest() {
        let budget = LogBudget::new(3, Instant::now());
        let allowed = (0..10).filter(|_| budget.allow()).count();
        assert_eq!(allowed, 3);
        assert_eq!(budget.take_suppressed(), 7);
        assert_eq!(budget.take_suppressed(), 0);
    }
}
