//! The outcomes of an endpoint a proxy observed since it last published them to its fleet
//! (`[cluster.outlier_detection] shared`): three counters per endpoint, taken whole by the
//! publisher. Recording is three relaxed atomic operations at most, no allocation; the first
//! failure since the last take also wakes the publishers ([`FAILED`]), so that a failure leaves
//! for the fleet at once instead of at the next batch.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use tokio::sync::Notify;

/// Woken by the first failure an endpoint records since its outcomes were last taken. One for
/// the process (an endpoint does not know its cluster's publisher): every publisher wakes and
/// looks; one that finds no failure of its own goes back to sleep. A wake costs a lock of this
/// `Notify` once per endpoint and publication, not per failure.
pub(crate) static FAILED: Notify = Notify::const_new();

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
    /// Counts one outcome; the first failure since the last take wakes the publishers.
    #[inline]
    pub fn record(&self, failed: bool) {
        if self.count(failed) {
            FAILED.notify_waiters();
        }
    }

    /// Counts one outcome; true for the first failure since the last take.
    #[inline]
    fn count(&self, failed: bool) -> bool {
        if failed {
            let first = self.failures.fetch_add(1, Relaxed) == 0;
            self.tail.fetch_add(1, Relaxed);
            first
        } else {
            self.successes.fetch_add(1, Relaxed);
            self.tail.store(0, Relaxed);
            false
        }
    }

    /// True when a failure was counted since the last take.
    pub fn failed(&self) -> bool {
        self.failures.load(Relaxed) > 0
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

    #[test]
    fn only_the_first_failure_since_a_take_wakes() {
        let p = Pending::default();
        assert!(!p.count(false), "a success does not wake");
        assert!(p.count(true));
        assert!(!p.count(true), "coalesced into the pending publication");
        assert_eq!(p.take(), Batch { f: 0, s: 1, t: 2 });
        assert!(p.count(true), "the next publication's first");
    }

    #[tokio::test]
    async fn a_failure_wakes_a_waiting_publisher() {
        let woken = FAILED.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        Pending::default().record(true);
        tokio::time::timeout(std::time::Duration::from_secs(1), woken)
            .await
            .expect("woken by the failure");
    }
}
