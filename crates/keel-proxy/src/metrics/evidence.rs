//! The outcomes of an endpoint a proxy observed since it last published them to its fleet
//! (`[cluster.outlier_detection] shared`): three counters per endpoint, taken whole by the
//! publisher every batch. Recording is three relaxed atomic operations at most, no allocation.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Outcomes not yet published.
#[derive(Debug, Default)]
pub struct Pending {
    failures: AtomicU32,
    successes: AtomicU32,
    /// Failures in a row at the end (reset by a success): the run the fleet must see continue.
    tail: AtomicU32,
}

/// One batch of an endpoint's outcomes, in the order that keeps what outlier detection judges:
/// the failures before the last success, the successes, then the trailing run of failures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Batch {
    /// Failures before the last success.
    pub f: u32,
    /// Successes.
    pub s: u32,
    /// Failures after the last success.
    pub t: u32,
}

impl Batch {
    /// Nothing observed.
    pub fn is_empty(&self) -> bool {
        self.f == 0 && self.s == 0 && self.t == 0
    }
}

impl Pending {
    /// Counts one outcome.
    #[inline]
    pub fn record(&self, failed: bool) {
        if failed {
            self.failures.fetch_add(1, Relaxed);
            self.tail.fetch_add(1, Relaxed);
        } else {
            self.successes.fetch_add(1, Relaxed);
            self.tail.store(0, Relaxed);
        }
    }

    /// Takes what was counted since the last take. Counters are taken one by one, so an outcome
    /// recorded meanwhile may land in this batch or the next, never twice or nowhere.
    pub fn take(&self) -> Batch {
        let tail = self.tail.swap(0, Relaxed);
        let failures = self.failures.swap(0, Relaxed);
        let s = self.successes.swap(0, Relaxed);
        let t = tail.min(failures);
        Batch {
            f: failures - t,
            s,
            t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_keeps_the_trailing_run_and_the_counts() {
        let p = Pending::default();
        for failed in [true, true, false, true, false, true, true, true] {
            p.record(failed);
        }
        assert_eq!(p.take(), Batch { f: 3, s: 2, t: 3 });
        assert!(p.take().is_empty());
        p.record(true);
        assert_eq!(p.take(), Batch { f: 0, s: 0, t: 1 });
    }
}
