//! keel's view of one inference engine's load (`[cluster.engine_signals]`): its last report,
//! when it arrived, and how many reports were taken, malformed or stale. Atomics only, so
//! that a response's report costs the request a few stores.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

pub(crate) use crate::codec::engine::EngineLoad as EngineLoadView;
use crate::codec::engine::EngineLoad;

/// One endpoint's engine view, kept across reloads with its other counters.
#[derive(Debug, Default)]
pub struct EngineSignals {
    /// f32 bits of [`EngineLoad`]'s fields.
    waiting: AtomicU32,
    running: AtomicU32,
    kv_cache: AtomicU32,
    /// When the report arrived, in nanoseconds on the proxy's clock (at least 1; 0: never).
    at: AtomicU64,
    /// Reports taken.
    pub reports: AtomicU64,
    /// Reports ignored as unreadable.
    pub malformed: AtomicU64,
    /// Reports ignored as older than `max_age` when they arrived.
    pub stale: AtomicU64,
    /// Scrapes that brought no report (no connection, no answer, not 2xx).
    pub failed: AtomicU64,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

impl EngineSignals {
    /// Takes a report that arrived at `now`. The fields are stored one by one: a reader racing
    /// a writer may see two reports' fields mixed, each of them true within one report.
    pub(crate) fn take(&self, load: EngineLoad, now: Duration) {
        self.waiting.store(load.waiting.to_bits(), Relaxed);
        self.running.store(load.running.to_bits(), Relaxed);
        self.kv_cache.store(load.kv_cache.to_bits(), Relaxed);
        self.at.store(nanos(now), Relaxed);
        self.reports.fetch_add(1, Relaxed);
    }

    /// The last report and its age, if it arrived no longer than `max_age` before `now`.
    pub fn view(&self, now: Duration, max_age: Duration) -> Option<(EngineLoad, Duration)> {
        let at = self.at.load(Relaxed);
        let age = Duration::from_nanos(nanos(now).saturating_sub(at));
        (at != 0 && age <= max_age).then(|| {
            let f = |a: &AtomicU32| f32::from_bits(a.load(Relaxed));
            let load = EngineLoad {
                waiting: f(&self.waiting),
                running: f(&self.running),
                kv_cache: f(&self.kv_cache),
            };
            (load, age)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_counts_until_it_is_max_age_old() {
        let s = EngineSignals::default();
        let ms = Duration::from_millis;
        assert!(s.view(ms(5), ms(100)).is_none(), "nothing reported yet");
        let load = EngineLoad {
            waiting: 3.0,
            running: f32::NAN,
            kv_cache: 0.5,
        };
        s.take(load, ms(10));
        let (seen, age) = s.view(ms(60), ms(100)).unwrap();
        assert_eq!((seen.waiting, seen.kv_cache, age), (3.0, 0.5, ms(50)));
        assert!(s.view(ms(110), ms(100)).is_some());
        assert!(s.view(ms(111), ms(100)).is_none(), "stale");
    }
}
