//! Hedged requests (Dean and Barroso, "The Tail at Scale"): when a call has had no answer after
//! a delay, a second try goes to another endpoint; the first good answer wins and the other
//! try is cancelled (its pick dropped: cancelled, not failed). [`Hedger`] is the policy, shared
//! by the simulator and the proxy: the delay (a quantile of the latencies lately observed, or a
//! fixed duration) and the budget that bounds hedges. Time is passed in, as everywhere here.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use crate::{InvalidField, Problem, RetryBudget, RetryBudgetConfig};

/// `[hedge]`: when and how much to hedge.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct HedgeConfig {
    /// When to hedge: `"p95"` (a quantile of the latency observed lately for first tries) or
    /// a duration such as `"20ms"`.
    pub delay: HedgeDelay,
    /// Extra tries per call. 1 (the default) is what keel supports.
    #[serde(default = "one")]
    pub max: u32,
    /// Hedges may be at most this percentage of the calls in a 10 s window. Default 5.
    #[serde(default = "default_budget")]
    pub budget_percent: f64,
}

fn one() -> u32 {
    1
}

fn default_budget() -> f64 {
    5.0
}

impl HedgeConfig {
    /// Checks the ranges serde cannot; the error names the field relative to this table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.max != 1 {
            return Err(InvalidField::at(
                "max",
                Problem::out_of_range("1 (one extra try per call)", self.max),
            ));
        }
        if !(self.budget_percent.is_finite() && (0.0..=100.0).contains(&self.budget_percent)) {
            return Err(InvalidField::at(
                "budget_percent",
                Problem::out_of_range("within 0..=100", self.budget_percent),
            ));
        }
        if let HedgeDelay::Fixed(d) = self.delay {
            if d.is_zero() || d > crate::duration_serde::MAX_DURATION {
                return Err(InvalidField::at(
                    "delay",
                    Problem::out_of_range("greater than zero and at most 365d", format!("{d:?}")),
                ));
            }
        }
        Ok(())
    }
}

/// When a hedge goes out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HedgeDelay {
    /// This quantile (in (0, 1)) of the first tries' latencies observed lately.
    Quantile(f64),
    /// A fixed delay.
    Fixed(Duration),
}

impl std::fmt::Display for HedgeDelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // Rounded: 0.999 * 100 is 99.90000000000001 in binary floating point.
            HedgeDelay::Quantile(q) => write!(f, "p{}", (q * 100.0 * 1e6).round() / 1e6),
            HedgeDelay::Fixed(d) => write!(f, "{}", humantime::format_duration(*d)),
        }
    }
}

/// A hedge `delay` that is refused, and the text given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HedgeDelayError {
    /// `p` followed by something that is not a number.
    #[error("`{text}`: a quantile is written p50, p95, p99.9")]
    Quantile {
        /// The delay given.
        text: String,
        /// Why the number does not parse.
        #[source]
        source: std::num::ParseFloatError,
    },
    /// A quantile outside (0, 100).
    #[error("`{text}`: the quantile must be within (0, 100)")]
    QuantileRange {
        /// The delay given.
        text: String,
    },
    /// Neither a quantile nor a duration.
    #[error("`{text}`: neither a quantile (p95) nor a duration: {source}")]
    Neither {
        /// The delay given.
        text: String,
        /// Why it is not a duration.
        #[source]
        source: humantime::DurationError,
    },
}

impl std::str::FromStr for HedgeDelay {
    type Err = HedgeDelayError;
    fn from_str(s: &str) -> Result<Self, HedgeDelayError> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix('p') {
            let pct: f64 = rest.parse().map_err(|source| HedgeDelayError::Quantile {
                text: s.to_string(),
                source,
            })?;
            if !(pct > 0.0 && pct < 100.0) {
                return Err(HedgeDelayError::QuantileRange {
                    text: s.to_string(),
                });
            }
            return Ok(HedgeDelay::Quantile(pct / 100.0));
        }
        humantime::parse_duration(s)
            .map(HedgeDelay::Fixed)
            .map_err(|source| HedgeDelayError::Neither {
                text: s.to_string(),
                source,
            })
    }
}

impl serde::Serialize for HedgeDelay {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for HedgeDelay {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Log-linear buckets (HdrHistogram's layout): `bits` bits of precision, so a value read at a
/// bucket's middle is within 2^-(bits+1) of any value in it.
pub mod log_buckets {
    /// The bucket of `v`.
    #[inline]
    pub fn index(v: u64, bits: u32) -> usize {
        let sub = 1u64 << bits;
        if v < sub {
            return v as usize;
        }
        let e = 63 - v.leading_zeros();
        let shift = e - bits;
        ((e - bits + 1) as usize) * sub as usize + ((v >> shift) - sub) as usize
    }

    /// The middle of bucket `i`'s range.
    pub fn value(i: usize, bits: u32) -> f64 {
        let sub = 1u64 << bits;
        let i = i as u64;
        if i < sub {
            return i as f64;
        }
        let e = i / sub + u64::from(bits) - 1;
        let shift = e - u64::from(bits);
        let low = (i % sub + sub) << shift;
        low as f64 + ((1u64 << shift) as f64 - 1.0) / 2.0
    }

    /// Buckets needed for every `u64` at `bits` bits of precision.
    pub const fn count(bits: u32) -> usize {
        ((64 - bits as usize) + 1) << bits
    }
}

/// 16 buckets per power of two: a delay read at a bucket's middle is within 3 % of the quantile.
const BITS: u32 = 4;
const BUCKETS: usize = log_buckets::count(BITS);
/// Samples per generation: the quantile is over the last 1000 to 2000 first tries.
const WINDOW: u32 = 1000;
/// No quantile (so no hedge) before this many samples: a p95 of fewer is mostly noise.
const MIN_SAMPLES: u32 = 100;
/// Samples between two readings of the quantile (reading scans every bucket).
const REREAD_EVERY: u32 = 32;

/// A quantile of the latest latencies: two generations of a coarse log histogram, the older
/// dropped when the newer fills, so that the estimate follows changes within a few thousand
/// calls. Atomics only (the proxy's worker threads share one): under contention a sample
/// recorded while the generations switch may be lost, one among a thousand.
struct RecentQuantile {
    q: f64,
    counts: [Box<[AtomicU32]>; 2],
    current: AtomicUsize,
    in_current: AtomicU32,
    in_previous: AtomicU32,
    since_read: AtomicU32,
    /// The last reading in nanoseconds (0: none yet).
    value_ns: AtomicU64,
}

impl RecentQuantile {
    fn new(q: f64) -> Self {
        let buckets = || (0..BUCKETS).map(|_| AtomicU32::new(0)).collect();
        Self {
            q,
            counts: [buckets(), buckets()],
            current: AtomicUsize::new(0),
            in_current: AtomicU32::new(0),
            in_previous: AtomicU32::new(0),
            since_read: AtomicU32::new(REREAD_EVERY),
            value_ns: AtomicU64::new(0),
        }
    }

    fn record(&self, ns: u64) {
        let cur = self.current.load(Relaxed);
        self.counts[cur][log_buckets::index(ns, BITS)].fetch_add(1, Relaxed);
        self.since_read.fetch_add(1, Relaxed);
        // Exactly one recorder sees the window fill, and switches generations.
        if self.in_current.fetch_add(1, Relaxed) + 1 == WINDOW {
            let next = cur ^ 1;
            for c in self.counts[next].iter() {
                c.store(0, Relaxed);
            }
            self.in_previous.store(WINDOW, Relaxed);
            self.in_current.store(0, Relaxed);
            self.current.store(next, Relaxed);
        }
    }

    fn get(&self) -> Option<u64> {
        let n = self.in_current.load(Relaxed) + self.in_previous.load(Relaxed);
        if n < MIN_SAMPLES {
            return None;
        }
        if self.since_read.load(Relaxed) >= REREAD_EVERY {
            self.since_read.store(0, Relaxed);
            let rank = ((self.q * f64::from(n)).ceil() as u32).clamp(1, n);
            let mut seen = 0;
            for i in 0..BUCKETS {
                seen += self.counts[0][i].load(Relaxed) + self.counts[1][i].load(Relaxed);
                if seen >= rank {
                    self.value_ns
                        .store((log_buckets::value(i, BITS) as u64).max(1), Relaxed);
                    break;
                }
            }
        }
        match self.value_ns.load(Relaxed) {
            0 => None,
            v => Some(v),
        }
    }
}

/// One balancer's hedging policy: the delay and the budget. Shared by every thread that
/// forwards calls to the cluster (atomics, no lock).
pub struct Hedger {
    config: HedgeConfig,
    recent: Option<RecentQuantile>,
    budget: RetryBudget,
}

impl std::fmt::Debug for Hedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hedger")
            .field("config", &self.config)
            .field("delay", &self.delay())
            .finish()
    }
}

impl Hedger {
    /// A policy with no observations yet.
    pub fn new(config: &HedgeConfig) -> Self {
        Self {
            config: config.clone(),
            recent: match config.delay {
                HedgeDelay::Quantile(q) => Some(RecentQuantile::new(q)),
                HedgeDelay::Fixed(_) => None,
            },
            // No floor: at low rates a floor of hedges per second would let hedges exceed the
            // budget's share.
            budget: RetryBudget::new(RetryBudgetConfig {
                budget_percent: config.budget_percent,
                min_retries_per_second: 0.0,
                window: Duration::from_secs(10),
            }),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &HedgeConfig {
        &self.config
    }

    /// A first try's latency, what the delay's quantile is over: its answer's, or how long it
    /// had run when its hedge won (it would have taken at least that long; leaving such tries
    /// out would pull the quantile down and hedge ever more).
    pub fn observe(&self, latency: Duration) {
        if let Some(r) = &self.recent {
            r.record(latency.as_nanos().min(u128::from(u64::MAX)) as u64);
        }
    }

    /// How long a call that starts now waits for its first try before it is hedged; `None`:
    /// do not hedge it (a quantile delay needs 100 observations first).
    pub fn delay(&self) -> Option<Duration> {
        match self.config.delay {
            HedgeDelay::Fixed(d) => Some(d),
            HedgeDelay::Quantile(_) => self.recent.as_ref()?.get().map(Duration::from_nanos),
        }
    }

    /// Counts a call (the budget's base).
    pub fn record_call(&self, now: Duration) {
        self.budget.record_request(now);
    }

    /// True if the budget allows a hedge now (and counts it).
    pub fn try_hedge(&self, now: Duration) -> bool {
        self.budget.try_retry(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_needs_samples_then_follows_the_latest_first_tries() {
        let h = Hedger::new(&HedgeConfig {
            delay: "p95".parse().unwrap(),
            max: 1,
            budget_percent: 5.0,
        });
        for i in 0..99u64 {
            h.observe(Duration::from_micros(1000 + i));
        }
        assert_eq!(h.delay(), None, "fewer than 100 samples");
        let h = Hedger::new(h.config());
        // 1..=1000 us: p95 = 950 us, within the 3 % of a bucket.
        for i in 1..=1000u64 {
            h.observe(Duration::from_micros(i));
        }
        let p95 = h.delay().unwrap().as_secs_f64() * 1e6;
        assert!((p95 - 950.0).abs() / 950.0 < 0.03, "{p95}");
        // Two windows later the old values are gone: everything is 10 ms now.
        for _ in 0..2000 {
            h.observe(Duration::from_millis(10));
        }
        let v = h.delay().unwrap().as_secs_f64() * 1e3;
        assert!((v - 10.0).abs() / 10.0 < 0.03, "{v}");
    }

    #[test]
    fn hedges_stay_within_the_budget_share_of_calls() {
        let h = Hedger::new(&HedgeConfig {
            delay: "20ms".parse().unwrap(),
            max: 1,
            budget_percent: 2.0,
        });
        assert_eq!(h.delay(), Some(Duration::from_millis(20)));
        let mut hedged = 0;
        for i in 0..10_000u64 {
            let now = Duration::from_micros(i * 500);
            h.record_call(now);
            if h.try_hedge(now) {
                hedged += 1;
            }
        }
        // 2 % of 10 000 calls, give or take the window's edges.
        assert!((180..=220).contains(&hedged), "{hedged}");
    }

    #[test]
    fn the_config_is_parsed_and_checked() {
        let c: HedgeConfig = toml::from_str("delay = \"p99.9\"").unwrap();
        assert!(matches!(c.delay, HedgeDelay::Quantile(q) if (q - 0.999).abs() < 1e-12));
        assert_eq!((c.max, c.budget_percent), (1, 5.0));
        assert_eq!(c.delay.to_string(), "p99.9");
        let c: HedgeConfig = toml::from_str("delay = \"15ms\"\nmax = 2").unwrap();
        assert_eq!(c.validate().unwrap_err().field.to_string(), "max");
        assert!(toml::from_str::<HedgeConfig>("delay = \"p100\"").is_err());
        assert_eq!(
            "p100".parse::<HedgeDelay>(),
            Err(HedgeDelayError::QuantileRange {
                text: "p100".into()
            })
        );
        assert!(matches!(
            "pxx".parse::<HedgeDelay>(),
            Err(HedgeDelayError::Quantile { .. })
        ));
        let e = "soon".parse::<HedgeDelay>().unwrap_err();
        assert!(matches!(e, HedgeDelayError::Neither { .. }), "{e:?}");
        assert!(
            e.to_string().starts_with("`soon`: neither a quantile"),
            "{e}"
        );
        assert!(toml::from_str::<HedgeConfig>("delay = \"soon\"").is_err());
        let c: HedgeConfig = toml::from_str("delay = \"5ms\"\nbudget_percent = -1").unwrap();
        assert_eq!(
            c.validate().unwrap_err().field.to_string(),
            "budget_percent"
        );
    }
}
