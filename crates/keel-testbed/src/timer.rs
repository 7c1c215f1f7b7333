//! A timer finer than tokio's, for service times that must be what they were asked to be.
//!
//! tokio's timer wheel has a resolution of one millisecond and rounds every deadline up to its
//! next tick, so a backend asked for exponential 10 ms serves about 10 ms + 1.1 ms on a loaded
//! machine (the rounding plus the scheduler): a shift that adds to the mean (and so to the
//! offered load) but not to the variability, which queues then amplify (see
//! docs/tail-latency.md). [`sleep_until`] hands the deadline to one thread per process that
//! keeps every pending deadline in a heap and blocks on a channel with the time to the next
//! one as its timeout (a futex wait with the kernel's high-resolution timers: tens of
//! microseconds late, not a millisecond), then wakes the waiting task through a oneshot
//! channel.
//!
//! The thread starts at the first use and lives as long as the process. A sleep whose future is
//! dropped leaves its entry in the heap until its deadline, when the wake finds nobody.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::OnceLock;
use std::time::Instant;

use tokio::sync::oneshot;

struct Entry {
    at: Instant,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// Reversed: the heap's top is the earliest deadline.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

static TIMER: OnceLock<mpsc::Sender<(Instant, oneshot::Sender<()>)>> = OnceLock::new();

fn timer() -> &'static mpsc::Sender<(Instant, oneshot::Sender<()>)> {
    TIMER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<(Instant, oneshot::Sender<()>)>();
        std::thread::Builder::new()
            .name("keel-precise-timer".into())
            .spawn(move || run(rx))
            .expect("the precise timer's thread starts");
        tx
    })
}

fn run(rx: mpsc::Receiver<(Instant, oneshot::Sender<()>)>) {
    let mut heap: BinaryHeap<Entry> = BinaryHeap::new();
    let mut seq = 0u64;
    loop {
        let now = Instant::now();
        while heap.peek().is_some_and(|e| e.at <= now) {
            let e = heap.pop().expect("peeked");
            let _ = e.wake.send(());
        }
        let next = match heap.peek() {
            Some(e) => rx.recv_timeout(e.at.saturating_duration_since(now)),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match next {
            Ok((at, wake)) => {
                seq += 1;
                heap.push(Entry { at, seq, wake });
                // Take whatever else is queued before looking at the clock again.
                while let Ok((at, wake)) = rx.try_recv() {
                    seq += 1;
                    heap.push(Entry { at, seq, wake });
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Waits until `at`, to within tens of microseconds on an idle machine (tokio's own timer: up
/// to a millisecond late). Returns at once if `at` has passed.
pub async fn sleep_until(at: Instant) {
    if at <= Instant::now() {
        return;
    }
    let (tx, rx) = oneshot::channel();
    if timer().send((at, tx)).is_err() {
        // The timer's thread is gone (it never returns while the process runs): fall back.
        tokio::time::sleep_until(at.into()).await;
        return;
    }
    let _ = rx.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn wakes_in_deadline_order_and_not_early() {
        let start = Instant::now();
        let mut tasks = Vec::new();
        for ms in [7u64, 3, 5, 1] {
            tasks.push(tokio::spawn(async move {
                let at = start + Duration::from_millis(ms);
                sleep_until(at).await;
                let late = Instant::now().checked_duration_since(at);
                (ms, late.expect("woke before its deadline"))
            }));
        }
        for t in tasks {
            let (ms, late) = t.await.unwrap();
            // Generous: a shared CI machine can stall a thread for a while.
            assert!(late < Duration::from_millis(50), "{ms} ms: {late:?} late");
        }
        sleep_until(start).await; // in the past: at once
    }
}
