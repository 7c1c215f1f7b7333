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

/// A table of GCRA buckets: one, or one per key; for the whole proxy, or one set per worker.
/// A take costs a number of nanoseconds of refill (a request's `interval`, or a token
/// budget's estimate in tokens); a bucket holds `capacity` of them. Shared by the request
/// rate limits and the token budgets (`policy/budget.rs`), which also correct a take after
/// the fact ([`Gcra::adjust`]).
pub(crate) struct Gcra {
    /// How much a full bucket holds, in nanoseconds of refill.
    capacity: u64,
    /// One entry, or one per worker.
    buckets: Box<[Buckets]>,
    /// Keys are hashed with a per-table secret, so clients cannot aim at one set.
    hasher: std::collections::hash_map::RandomState,
    epoch: Instant,
}

/// The hash [`Gcra::key`] never gives: the bucket of requests without a key, when they
/// share one.
pub(crate) const SHARED_KEY: u64 = 1;

impl Gcra {
    /// `shares` sets of buckets (one per worker, or one), each holding `capacity`
    /// nanoseconds; keyed with `keys` keys per set of buckets, else one bucket.
    pub fn new(capacity: u64, shares: usize, keyed: bool, keys: usize) -> Self {
        let buckets = (0..shares.max(1))
            .map(|_| match keyed {
                false => Buckets::One(AtomicU64::new(0)),
                true => Buckets::Keyed(
                    (0..keys.div_ceil(WAYS).max(1))
                        .map(|_| Mutex::new([Slot::default(); WAYS]))
                        .collect(),
                ),
            })
            .collect();
        Self {
            capacity,
            buckets,
            hasher: Default::default(),
            epoch: Instant::now(),
        }
    }

    /// The key of `bytes` in this table: a keyed hash, never 0 (an empty slot) nor
    /// [`SHARED_KEY`].
    pub fn key(&self, bytes: &[u8]) -> u64 {
        self.hasher.hash_one(bytes).max(SHARED_KEY + 1)
    }

    /// Takes `cost` nanoseconds at `now` from the bucket of `key` (`None`: an unkeyed
    /// table's one bucket; a keyed table lets it through) of `worker`'s buckets.
    pub fn take(
        &self,
        worker: usize,
        key: Option<u64>,
        cost: u64,
        now: Instant,
    ) -> Result<(), Limited> {
        let now = now.saturating_duration_since(self.epoch).as_nanos() as u64;
        match (self.of(worker), key) {
            (Buckets::One(tat), _) => {
                let mut old = tat.load(Relaxed);
                loop {
                    let next = self.admit(old, now, cost)?;
                    match tat.compare_exchange_weak(old, next, Relaxed, Relaxed) {
                        Ok(_) => return Ok(()),
                        Err(seen) => old = seen,
                    }
                }
            }
            (Buckets::Keyed(sets), Some(hash)) => {
                let mut set = lock(sets, hash);
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
                set[slot].tat = self.admit(set[slot].tat, now, cost)?;
                Ok(())
            }
            // A keyed limit and no key (the header is absent): not limited.
            (Buckets::Keyed(_), None) => Ok(()),
        }
    }

    /// Takes `more` nanoseconds from (positive) or gives them back to (negative) the bucket a
    /// [`Gcra::take`] of `key` took from, as of that take. A bucket forgotten since (its key
    /// evicted by others) is not brought back: it starts full when its key returns.
    pub fn adjust(&self, worker: usize, key: Option<u64>, more: i64) {
        let apply = |tat: u64| match more >= 0 {
            true => tat.saturating_add(more as u64),
            false => tat.saturating_sub(more.unsigned_abs()),
        };
        match (self.of(worker), key) {
            (Buckets::One(tat), _) => {
                let _ = tat.fetch_update(Relaxed, Relaxed, |t| Some(apply(t)));
            }
            (Buckets::Keyed(sets), Some(hash)) => {
                let mut set = lock(sets, hash);
                if let Some(s) = set.iter_mut().find(|s| s.key == hash) {
                    // Never 0: a taken bucket stays distinct from an empty slot's time.
                    s.tat = apply(s.tat).max(1);
                }
            }
            (Buckets::Keyed(_), None) => {}
        }
    }

    fn of(&self, worker: usize) -> &Buckets {
        &self.buckets[worker % self.buckets.len()]
    }

    /// The bucket's next time if `cost` is taken at `now`, else how long until it could be.
    fn admit(&self, tat: u64, now: u64, cost: u64) -> Result<u64, Limited> {
        let tat = tat.max(now);
        let need = (tat - now).saturating_add(cost);
        if need > self.capacity {
            return Err(Limited {
                retry_after: Duration::from_nanos(need - self.capacity),
            });
        }
        Ok(tat + cost)
    }
}

/// The set of `hash`'s bucket, locked.
fn lock(sets: &[Mutex<[Slot; WAYS]>], hash: u64) -> std::sync::MutexGuard<'_, [Slot; WAYS]> {
    sets[(hash % sets.len() as u64) as usize]
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// A compiled `rate_limit`.
pub(crate) struct RateLimiter {
    /// What it is for (`route 2`, `cluster app`), for the cause of a 429.
    pub(crate) scope: String,
    pub(crate) config: RateLimitConfig,
    /// Nanoseconds between two requests of one bucket (each worker's, with `per_worker`).
    interval: u64,
    /// The buckets, each holding `burst` requests.
    gcra: Gcra,
}

/// Why a request was limited: how long until it would have been let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limited {
    pub retry_after: Duration,
}

impl Limited {
    /// Whole seconds to wait, at least 1 (`Retry-After`, as RFC 9110 section 10.2.3 has it).
    pub fn seconds(&self) -> u64 {
        self.retry_after.as_nanos().div_ceil(1_000_000_000).max(1) as u64
    }
}

impl RateLimiter {
    /// The limiter of `config` for `workers` worker threads.
    pub fn new(config: &RateLimitConfig, scope: String, workers: usize) -> Self {
        let shares = if config.per_worker { workers.max(1) } else { 1 };
        let interval = (1e9 / config.rate * shares as f64).max(1.0) as u64;
        let burst = (u64::from(config.burst()) / shares as u64).max(1);
        let keys = config.max_keys.div_ceil(shares);
        Self {
            scope,
            config: config.clone(),
            interval,
            gcra: Gcra::new(
                burst.saturating_mul(interval),
                shares,
                config.key.is_some(),
                keys,
            ),
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
        let key = key.map(|k| self.gcra.key(k));
        self.gcra.take(worker, key, self.interval, now)
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
        let t0 = l.gcra.epoch + Duration::from_secs(1);
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
        let t0 = l.gcra.epoch + Duration::from_secs(1);
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
        match &l.gcra.buckets[0] {
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
        let t0 = l.gcra.epoch + Duration::from_secs(1);
        let ok = |w| (0..10).filter(|_| l.take(w, None, t0).is_ok()).count();
        assert_eq!((ok(0), ok(1)), (2, 2));
        assert_eq!(l.interval, 200_000_000);
    }
}
