//! Passive outlier detection: eject endpoints whose recent calls keep failing, for a time that
//! grows when they are ejected again, never more than a cap of the endpoints at once.
//!
//! The semantics follow Envoy's outlier detection, with time passed in:
//! - **consecutive failures**: `consecutive_failures` failures in a row eject the endpoint;
//! - **failure rate**: within the current `interval`, once an endpoint has at least
//!   `minimum_requests` outcomes and `threshold_percent` of them failed, it is ejected (checked on
//!   every outcome, so a bad endpoint does not wait for the interval to end);
//! - **ejection time** = `base_ejection_time` x times ejected in a row, at most
//!   `max_ejection_time`; the multiplier drops by one for each `interval` the endpoint spends back
//!   in service;
//! - **cap**: at most `max(1, floor(n x max_ejection_percent / 100))` of the n endpoints are
//!   ejected at once (a cluster of 5 at 50 % may lose 2, not 3); `0` disables ejection;
//! - **return**: an endpoint is back in service as soon as its ejection time has passed, and a
//!   configured slow start then ramps its weight up again;
//! - **half-open**: a returned endpoint is on probation until its first success: its first
//!   failure ejects it again at once (for the next, longer ejection time), so an endpoint that
//!   keeps failing costs one failed call per ejection, not `consecutive_failures`; with a
//!   quorum, that failure's run must still have the quorum's sources;
//! - **shared evidence**: outcomes other balancers of a fleet observed
//!   ([`crate::Balancer::record_remote`]) count toward the same rules as the balancer's own, in
//!   the order they reach it; with a [`SharedEvidence`] quorum, the failures that eject must come
//!   from at least that many distinct sources (this balancer and the others).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::{FieldPath, InvalidField, Problem};

/// Outlier detection settings. Every field has a default, so `OutlierConfig::default()` is a
/// working detector.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutlierConfig {
    /// Failures in a row that eject an endpoint (`0` turns this rule off). Default 5.
    pub consecutive_failures: u32,
    /// Failure-rate rule; off unless given.
    pub failure_rate: Option<FailureRate>,
    /// The failure-rate window, and the time in service that removes one step of the ejection
    /// multiplier. Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub interval: Duration,
    /// Ejection time for a first ejection. Default 30 s.
    #[serde(with = "crate::duration_serde")]
    pub base_ejection_time: Duration,
    /// Longest ejection. Default 300 s.
    #[serde(with = "crate::duration_serde")]
    pub max_ejection_time: Duration,
    /// Most endpoints out at once, in percent (rounded down, at least one). Default 10.
    pub max_ejection_percent: f64,
    /// Judging on a fleet's shared evidence (`shared = { quorum = 1 }`): the quorum of distinct
    /// sources. Only a driver that feeds [`crate::Balancer::record_remote`] should accept it
    /// (keel-proxy does with `[etcd]` and a proxy `name`). Absent: this balancer's own calls
    /// only (quorum 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedEvidence>,
}

/// How a balancer judges an endpoint on evidence shared by a fleet of balancers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SharedEvidence {
    /// Distinct sources (this balancer and others) that must have contributed failures to the
    /// run of consecutive failures (or the failure-rate window) that ejects: 1 lets any one
    /// balancer's evidence eject for all; more keeps a single confused balancer from ejecting.
    /// Within `1..=`[`MAX_QUORUM`]. Default 1.
    #[serde(default = "one")]
    pub quorum: u32,
}

fn one() -> u32 {
    1
}

/// The largest [`SharedEvidence::quorum`] (the detector remembers that many distinct sources per
/// endpoint, without allocating).
pub const MAX_QUORUM: u32 = 8;

/// The source an outcome recorded by [`crate::Balancer::finish`] counts under: the balancer's
/// own calls. Remote sources are any other number.
pub(crate) const LOCAL_SOURCE: u64 = 0;

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            failure_rate: None,
            interval: Duration::from_secs(10),
            base_ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 10.0,
            shared: None,
        }
    }
}

/// The failure-rate ejection rule.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FailureRate {
    /// Failed share, in percent, at or above which an endpoint is ejected. Default 85.
    pub threshold_percent: f64,
    /// Outcomes needed in the window before the rule judges. Default 50.
    pub minimum_requests: u32,
}

impl Default for FailureRate {
    fn default() -> Self {
        Self {
            threshold_percent: 85.0,
            minimum_requests: 50,
        }
    }
}

impl OutlierConfig {
    /// Checks the ranges; the error names the field (relative to this table) and what is
    /// allowed.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let bad = |key, problem| Err(InvalidField::at(key, problem));
        if !(0.0..=100.0).contains(&self.max_ejection_percent) {
            return bad(
                "max_ejection_percent",
                Problem::out_of_range("within 0..=100", self.max_ejection_percent),
            );
        }
        if self.interval.is_zero() {
            return bad("interval", Problem::out_of_range("greater than zero", "0s"));
        }
        if self.base_ejection_time.is_zero() {
            return bad(
                "base_ejection_time",
                Problem::out_of_range("greater than zero", "0s"),
            );
        }
        if self.max_ejection_time < self.base_ejection_time {
            return bad(
                "max_ejection_time",
                Problem::out_of_range(
                    format!(
                        "at least base_ejection_time ({:?})",
                        self.base_ejection_time
                    ),
                    format!("{:?}", self.max_ejection_time),
                ),
            );
        }
        if let Some(sh) = &self.shared {
            if !(1..=MAX_QUORUM).contains(&sh.quorum) {
                return Err(InvalidField::new(
                    FieldPath::key("shared").then("quorum"),
                    Problem::out_of_range(format!("within 1..={MAX_QUORUM}"), sh.quorum),
                ));
            }
        }
        if let Some(fr) = &self.failure_rate {
            if !(0.0..=100.0).contains(&fr.threshold_percent) {
                return Err(InvalidField::new(
                    FieldPath::key("failure_rate").then("threshold_percent"),
                    Problem::out_of_range("within 0..=100", fr.threshold_percent),
                ));
            }
        }
        Ok(())
    }

    /// How many of `n` endpoints may be ejected at once.
    pub fn max_ejected(&self, n: usize) -> usize {
        share_of(n, self.max_ejection_percent)
    }

    /// The quorum of distinct sources an ejection needs (1 without shared evidence).
    fn quorum(&self) -> u32 {
        self.shared.map_or(1, |s| s.quorum)
    }
}

/// Up to [`MAX_QUORUM`] distinct sources, in place.
#[derive(Debug, Default, Clone, Copy)]
struct Sources {
    ids: [u64; MAX_QUORUM as usize],
    len: u8,
}

impl Sources {
    fn add(&mut self, source: u64) {
        let len = self.len as usize;
        if len < self.ids.len() && !self.ids[..len].contains(&source) {
            self.ids[len] = source;
            self.len += 1;
        }
    }

    fn count(&self) -> u32 {
        u32::from(self.len)
    }
}

/// Per-endpoint detector state (behind the endpoint's own mutex, touched only when an outcome
/// is recorded with outlier detection on).
#[derive(Debug, Default)]
pub(crate) struct OutlierState {
    consecutive: u32,
    window_start: u64,
    window_requests: u32,
    window_failures: u32,
    /// Sources of the current run of consecutive failures (tracked only with a quorum above 1).
    run_sources: Sources,
    /// Sources of the window's failures (likewise).
    window_sources: Sources,
    /// Ejections in a row: the ejection-time multiplier.
    pub(crate) ejections: u32,
    /// Ejections since the endpoint was created.
    pub(crate) ejections_total: u64,
    /// When the last ejection ended (or will end).
    last_ejection_end: u64,
    /// Ejected since its last success: once back, its first failure ejects it again.
    probation: bool,
}

impl OutlierState {
    /// Records an outcome observed by `source` ([`LOCAL_SOURCE`]: this balancer); returns true
    /// when a rule says "eject".
    pub(crate) fn record(
        &mut self,
        cfg: &OutlierConfig,
        failed: bool,
        source: u64,
        now: u64,
    ) -> bool {
        let interval = crate::time::nanos(cfg.interval);
        let quorum = cfg.quorum();
        if now.saturating_sub(self.window_start) >= interval {
            self.window_start = now;
            self.window_requests = 0;
            self.window_failures = 0;
            self.window_sources = Sources::default();
        }
        self.window_requests += 1;
        if failed {
            self.window_failures += 1;
            self.consecutive += 1;
            if quorum > 1 {
                self.run_sources.add(source);
                self.window_sources.add(source);
            }
        } else {
            self.consecutive = 0;
            self.run_sources = Sources::default();
            // A success after the ejection ended: back to the ordinary rules. (A call that was
            // in flight when the endpoint was ejected may still end during the ejection.)
            if now >= self.last_ejection_end {
                self.probation = false;
            }
        }
        let by_probation = self.probation
            && now >= self.last_ejection_end
            && (quorum <= 1 || self.run_sources.count() >= quorum);
        let by_consecutive = cfg.consecutive_failures > 0
            && self.consecutive >= cfg.consecutive_failures
            && (quorum <= 1 || self.run_sources.count() >= quorum);
        let by_rate = cfg.failure_rate.as_ref().is_some_and(|fr| {
            self.window_requests >= fr.minimum_requests.max(1)
                && self.window_failures as f64 * 100.0
                    >= fr.threshold_percent * self.window_requests as f64
                && (quorum <= 1 || self.window_sources.count() >= quorum)
        });
        failed && (by_probation || by_consecutive || by_rate)
    }

    /// Starts an ejection at `now`; returns the instant it ends.
    pub(crate) fn eject(&mut self, cfg: &OutlierConfig, now: u64) -> u64 {
        let interval = crate::time::nanos(cfg.interval).max(1);
        if self.ejections > 0 && now > self.last_ejection_end {
            let healthy_intervals = (now - self.last_ejection_end) / interval;
            self.ejections = self
                .ejections
                .saturating_sub(healthy_intervals.min(u32::MAX as u64) as u32);
        }
        self.ejections = self.ejections.saturating_add(1);
        self.ejections_total += 1;
        let base = crate::time::nanos(cfg.base_ejection_time);
        let max = crate::time::nanos(cfg.max_ejection_time);
        let duration = base.saturating_mul(self.ejections as u64).min(max);
        self.consecutive = 0;
        self.run_sources = Sources::default();
        self.window_sources = Sources::default();
        self.window_start = now;
        self.window_requests = 0;
        self.window_failures = 0;
        self.last_ejection_end = now.saturating_add(duration);
        self.probation = true;
        self.last_ejection_end
    }
}

/// How many of `n` endpoints a cap of `percent` lets out at once: `max(1, floor(n x percent /
/// 100))`, rounded down but at least one; none when `percent` is 0 (or `n` is). Ejections
/// (`max_ejection_percent`) and back-offs (`max_backed_off_percent`) are capped alike.
pub(crate) fn share_of(n: usize, percent: f64) -> usize {
    if percent <= 0.0 || n == 0 {
        return 0;
    }
    ((n as f64 * percent / 100.0).floor() as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn config() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            failure_rate: None,
            interval: Duration::from_secs(10),
            base_ejection_time: Duration::from_secs(10),
            max_ejection_time: Duration::from_secs(25),
            max_ejection_percent: 50.0,
            shared: None,
        }
    }

    const L: u64 = LOCAL_SOURCE;

    #[test]
    fn consecutive_failures_eject_and_a_success_resets_the_count() {
        let cfg = config();
        let mut st = OutlierState::default();
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, false, L, S), "a success in between");
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, true, L, S));
        assert!(st.record(&cfg, true, L, S), "third in a row");
    }

    #[test]
    fn ejection_time_grows_to_the_cap_and_the_multiplier_decays_in_service() {
        let cfg = config();
        let mut st = OutlierState::default();
        assert_eq!(st.eject(&cfg, S), 11 * S, "base x 1");
        assert_eq!(st.eject(&cfg, 11 * S), 31 * S, "base x 2");
        assert_eq!(
            st.eject(&cfg, 31 * S),
            56 * S,
            "base x 3 = 30 s, capped at 25 s"
        );
        assert_eq!((st.ejections, st.ejections_total), (3, 3));
        // Back at 56 s; 50 s in service (five intervals) take the multiplier back to zero.
        assert_eq!(st.eject(&cfg, 106 * S), 116 * S);
        assert_eq!((st.ejections, st.ejections_total), (1, 4));
    }

    #[test]
    fn a_returned_endpoint_is_ejected_again_by_its_first_failure_until_a_success() {
        let cfg = config();
        let mut st = OutlierState::default();
        for _ in 0..2 {
            assert!(!st.record(&cfg, true, L, S));
        }
        assert!(st.record(&cfg, true, L, S));
        let back = st.eject(&cfg, S);
        // A call in flight at the ejection that fails during it does not eject again.
        assert!(!st.record(&cfg, true, L, back - 1));
        // Back: one failure is enough, and the next ejection is twice as long.
        assert!(st.record(&cfg, true, L, back));
        assert_eq!(st.eject(&cfg, back), back + 20 * S);
        // After a success back in service, three failures in a row again.
        let back = back + 20 * S;
        assert!(!st.record(&cfg, false, L, back));
        assert!(!st.record(&cfg, true, L, back));
        assert!(!st.record(&cfg, true, L, back));
        assert!(st.record(&cfg, true, L, back));
    }

    #[test]
    fn failure_rate_judges_only_with_enough_requests_in_the_window() {
        let cfg = OutlierConfig {
            consecutive_failures: 0,
            failure_rate: Some(FailureRate {
                threshold_percent: 50.0,
                minimum_requests: 10,
            }),
            ..config()
        };
        let mut st = OutlierState::default();
        // 9 outcomes, all failed: not enough to judge.
        for _ in 0..9 {
            assert!(!st.record(&cfg, true, L, S));
        }
        // The 10th failure: 100 % of 10.
        assert!(st.record(&cfg, true, L, S));
        // A new window (10 s later) starts from zero.
        let mut st = OutlierState::default();
        for _ in 0..9 {
            st.record(&cfg, true, L, S);
        }
        assert!(!st.record(&cfg, true, L, 12 * S));
        // A success never ejects, even above the rate.
        assert!(!st.record(&cfg, false, L, 12 * S));
    }

    #[test]
    fn a_quorum_needs_failures_from_that_many_distinct_sources() {
        let cfg = OutlierConfig {
            shared: Some(SharedEvidence { quorum: 2 }),
            ..config()
        };
        let mut st = OutlierState::default();
        // Three failures in a row from one source: enough by count, not by quorum.
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, true, L, S));
        // A fourth from another source completes the quorum.
        assert!(st.record(&cfg, true, 7, S));
        // A success starts a new run, sources and all: 7 then 3 x local is a quorum again only
        // once both are in the run.
        let mut st = OutlierState::default();
        st.record(&cfg, true, 7, S);
        st.record(&cfg, false, L, S);
        assert!(!st.record(&cfg, true, L, S));
        assert!(!st.record(&cfg, true, L, S));
        assert!(
            !st.record(&cfg, true, L, S),
            "7's failure was before the success"
        );
        assert!(st.record(&cfg, true, 9, S));
        let bad = OutlierConfig {
            shared: Some(SharedEvidence {
                quorum: MAX_QUORUM + 1,
            }),
            ..config()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            InvalidField::new(
                FieldPath::key("shared").then("quorum"),
                Problem::out_of_range("within 1..=8", 9)
            )
            .to_string()
        );
    }

    #[test]
    fn at_most_the_cap_of_endpoints_is_ejected() {
        let cfg = config();
        assert_eq!(cfg.max_ejected(5), 2, "50 % of 5, rounded down");
        assert_eq!(cfg.max_ejected(1), 1, "at least one");
        let off = OutlierConfig {
            max_ejection_percent: 0.0,
            ..config()
        };
        assert_eq!(off.max_ejected(10), 0);
    }
}
