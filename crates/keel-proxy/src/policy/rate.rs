//! Local rate limits: token buckets kept as GCRA (the generic cell rate algorithm, what a
//! token bucket is when only its next refill time is stored), one `u64` per bucket.
//!
//! An unkeyed shared bucket is one atomic updated by compare-and-swap (no lock). Keyed buckets
//! live in a fixed table of small sets, each behind its own lock (contention only between
//! requests whose keys fall in the same set); a key not in its set takes the place of the
//! bucket closest to full, which loses nothing when that bucket has refilled, so a flood of
//! made-up keys costs no memory and only weakens the limit of keys it evicts. `per_worker`
//! gives each worker thread its own buckets with its share of the rate.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::{RateKey, RateLimitConfig};

/// Buckets a set holds.
const WAYS: usize = 8;

/// One key's bucket in a keyed table: the key's hash (0: empty) and its GCRA time.
#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    tat: u64,
}

/// The buckets of one worker, or of all workers.
enum Buckets {
    /// One bucket for all requests: its theoretical arrival time (ns since the epoch).
    One(AtomicU64),
    /// One bucket per key, in `sets.len()` sets of [`WAYS`].
    Keyed(Box<[Mutex<[Slot; WAYS]>]>),
}

/// A compiled `rate_limit`.
pub(crate) struct RateLimiter {
    /// What it is for (`route 2`, `cluster app`), for the cause of a 429.
    pub(crate) scope: String,
    pub(crate) config: RateLimitConfig,
    /// Nanoseconds between two requests of one bucket (each worker's, with `per_worker`).
    interval: u64,
    /// How far ahead of now a bucket's time may run: `(burst - 1) x interval`.
    tolerance: u64,
    /// One entry, or one per worker (`per_worker`).
    buckets: Box<[Buckets]>,
    /// Keys are hashed with a per-limiter secret, so clients cannot aim at one set.
    hasher: std::collections::hash_map::RandomState,
    epoch: Instant,
}

/// Why a request was limited: how long until it would have been let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limited {
    pub retry_after: Duration,
}

impl RateLimiter {
    /// The limiter of `config` for `workers` worker threads.
    pub fn new(config: &RateLimitConfig, scope: String, workers: usize) -> Self {
        let shares = if config.per_worker { workers.max(1) } else { 1 };
        let interval = (1e9 / config.rate * shares as f64).max(1.0) as u64;
        let burst = (u64::from(config.burst()) / shares as u64).max(1);
        let keys = config.max_keys.div_ceil(shares);
        let buckets = (0..shares)
            .map(|_| match config.key {
                None => Buckets::One(AtomicU64::new(0)),
                Some(_) => Buckets::Keyed(
                    (0..keys.div_ceil(WAYS).max(1))
                        .map(|_| Mutex::new([Slot::default(); WAYS]))
                        .collect(),
                ),
            })
            .collect();
        Self {
            scope,
            config: config.clone(),
            interval,
            tolerance: (burst - 1).saturating_mul(interval),
            buckets,
            hasher: Default::default(),
            epoch: Instant::now(),
        }
    }

    /// True if the limit is keyed by the client's IP.
    pub fn by_client_ip(&self) -> bool {
        self.config.key == Some(RateKey::ClientIp)
    }

    /// The header the limit is keyed by, if it is.
    pub fn key_header(&self) -> Option<&str> {
        match &self.config.key {
            Some(RateKey::Header(h)) => Some(h.as_str()),
            _ => None,
        }
    }

    /// Takes one request at `now` from the bucket of `key` (`None` for an unkeyed limit) of
    /// `worker`'s buckets.
    pub fn take(&self, worker: usize, key: Option<&[u8]>, now: Instant) -> Result<(), Limited> {
        let now = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        let buckets = &self.buckets[worker % self.buckets.len()];
        match (buckets, key) {
            (Buckets::One(tat), _) => {
                let mut old = tat.load(Relaxed);
                loop {
                    let next = self.admit(old, now)?;
                    match tat.compare_exchange_weak(old, next, Relaxed, Relaxed) {
                        Ok(_) => return Ok(()),
                        Err(seen) => old = seen,
                    }
                }
            }
            (Buckets::Keyed(sets), Some(key)) => {
                // 0 marks an empty slot.
                let hash = self.hasher.hash_one(key).max(1);
                let set = &sets[(hash % sets.len() as u64) as usize];
                let mut set = set.lock().unwrap_or_else(|p| p.into_inner());
                let slot = match set.iter().position(|s| s.key == hash) {
                    Some(i) => i,
                    None => {
                        // The bucket closest to full (the earliest time) makes room.
                        let (i, _) = set
                            .iter()
                            .enumerate()
                            .min_by_key(|(_, s)| if s.key == 0 { 0 } else { s.tat.max(1) })
                            .unwrap_or((0, &set[0]));
                        set[i] = Slot { key: hash, tat: 0 };
                        i
                    }
                };
                set[slot].tat = self.admit(set[slot].tat, now)?;
                Ok(())
            }
            // A keyed limit and no key (the header is absent): not limited.
            (Buckets::Keyed(_), None) => Ok(()),
        }
    }

    /// The bucket's next time if a request at `now` is let through, else how long to wait.
    fn admit(&self, tat: u64, now: u64) -> Result<u64, Limited> {
        let tat = tat.max(now);
        let ahead = tat - now;
        if ahead > self.tolerance {
            return Err(Limited {
                retry_after: Duration::from_nanos(ahead - self.tolerance),
            });
        }
        Ok(tat + self.interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(rate: f64, burst: u32, key: Option<RateKey>, max_keys: usize) -> RateLimiter {
        let config = RateLimitConfig {
            rate,
            burst: Some(burst),
            key,
            max_keys,
            per_worker: false,
        };
        RateLimiter::new(&config, "test".into(), 1)
    }

    #[test]
    fn a_bucket_lets_its_burst_through_then_its_rate() {
        let l = limit(10.0, 3, None, 1);
        let t0 = l.epoch + Duration::from_secs(1);
        for _ in 0..3 {
            assert!(l.take(0, None, t0).is_ok());
        }
        let refused = l.take(0, None, t0).unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_millis(100));
        // One every 100 ms from then on.
        assert!(l.take(0, None, t0 + Duration::from_millis(100)).is_ok());
        assert!(l.take(0, None, t0 + Duration::from_millis(100)).is_err());
        // Idle long enough, the bucket is full again, and no fuller.
        let later = t0 + Duration::from_secs(10);
        assert_eq!((0..5).filter(|_| l.take(0, None, later).is_ok()).count(), 3);
    }

    #[test]
    fn keys_have_their_own_buckets_and_a_flood_of_keys_stays_bounded() {
        let l = limit(1.0, 2, Some(RateKey::ClientIp), 64);
        let t0 = l.epoch + Duration::from_secs(1);
        assert!(l.take(0, Some(b"a"), t0).is_ok());
        assert!(l.take(0, Some(b"a"), t0).is_ok());
        assert!(l.take(0, Some(b"a"), t0).is_err());
        assert!(
            l.take(0, Some(b"b"), t0).is_ok(),
            "another key, its own bucket"
        );
        // 100,000 made-up keys: the table keeps its size (64 keys in 8 sets).
        for i in 0..100_000u32 {
            let _ = l.take(0, Some(&i.to_le_bytes()), t0);
        }
        match &l.buckets[0] {
            Buckets::Keyed(sets) => assert_eq!(sets.len(), 8),
            _ => unreachable!(),
        }
        // No header: a keyed limit does not apply.
        assert!((0..10).all(|_| l.take(0, None, t0).is_ok()));
    }

    #[test]
    fn per_worker_buckets_share_the_rate() {
        let config = RateLimitConfig {
            rate: 10.0,
            burst: Some(4),
            key: None,
            max_keys: 1,
            per_worker: true,
        };
        let l = RateLimiter::new(&config, "w".into(), 2);
        let t0 = l.epoch + Duration::from_secs(1);
        let ok = |w| (0..10).filter(|_| l.take(w, None, t0).is_ok()).count();
        assert_eq!((ok(0), ok(1)), (2, 2));
        assert_eq!(l.interval, 200_000_000);
    }
}
