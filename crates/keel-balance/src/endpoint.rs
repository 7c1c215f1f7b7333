//! Endpoints and the shared, atomically updated state that strategies and protections read.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::outlier::OutlierState;

/// What a user configures for one endpoint: where it is and its relative weight.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// The endpoint's identity and address, e.g. `127.0.0.1:9001`. Hash strategies hash it, so
    /// the same address keeps the same keys across restarts and reloads.
    pub address: String,
    /// Relative weight, at least 1. Strategies that ignore weights say so.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

impl EndpointSpec {
    /// An endpoint of weight 1.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            weight: 1,
        }
    }

    /// The same endpoint with another weight.
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }
}

/// A stable identity for an endpoint inside one process: survives weight changes, reloads and
/// rebuilds of hash tables, so that a retry can say "not that one again".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u64);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Nanoseconds since the driver's epoch. `0` stands for "never" in the fields below.
pub(crate) fn nanos(t: Duration) -> u64 {
    t.as_nanos().min(u64::MAX as u128) as u64
}

/// One endpoint and the live state that the balancer keeps for it. Shared (`Arc`) between the
/// balancer's snapshots, so that counters, latency estimates and ejections survive a rebuild.
#[derive(Debug)]
pub struct Endpoint {
    id: EndpointId,
    address: String,
    /// xxh3 of the address: the endpoint's place in hash strategies.
    pub(crate) hash: u64,
    pub(crate) weight: AtomicU32,
    pub(crate) in_flight: AtomicU32,
    pub(crate) healthy: AtomicBool,
    /// Start of the current slow-start ramp (added or back to healthy), 0 = none.
    pub(crate) ramp_from: AtomicU64,
    /// Ejected until this instant; 0 = never ejected.
    pub(crate) ejected_until: AtomicU64,
    /// Latency estimate in nanoseconds (f64 bits); its meaning is the strategy's (plain EWMA or
    /// peak-EWMA). Updated with a load and a store: a lost update under a race only delays the
    /// estimate by one sample, and it keeps the hot path free of locks.
    pub(crate) latency_bits: AtomicU64,
    pub(crate) latency_stamp: AtomicU64,
    pub(crate) has_latency: AtomicBool,
    pub(crate) successes: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) outlier: Mutex<OutlierState>,
}

impl Endpoint {
    pub(crate) fn new(spec: &EndpointSpec, ramp_from: u64) -> Self {
        Self {
            id: EndpointId(NEXT_ID.fetch_add(1, Ordering::Relaxed)),
            hash: xxhash_rust::xxh3::xxh3_64(spec.address.as_bytes()),
            address: spec.address.clone(),
            weight: AtomicU32::new(spec.weight.max(1)),
            in_flight: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            ramp_from: AtomicU64::new(ramp_from),
            ejected_until: AtomicU64::new(0),
            latency_bits: AtomicU64::new(0f64.to_bits()),
            latency_stamp: AtomicU64::new(0),
            has_latency: AtomicBool::new(false),
            successes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            outlier: Mutex::new(OutlierState::default()),
        }
    }

    /// Process-unique identity.
    pub fn id(&self) -> EndpointId {
        self.id
    }

    /// The configured address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The configured weight.
    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }

    /// Calls picked and not yet finished or dropped.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// What the active health check last concluded (true until told otherwise).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// `Some(until)` while the outlier detector keeps this endpoint out.
    pub fn ejected_until(&self, now: Duration) -> Option<Duration> {
        let until = self.ejected_until.load(Ordering::Relaxed);
        (until > nanos(now)).then(|| Duration::from_nanos(until))
    }

    /// The strategy's latency estimate, if it keeps one and has a sample.
    pub fn latency_estimate(&self) -> Option<Duration> {
        self.has_latency
            .load(Ordering::Relaxed)
            .then(|| Duration::from_nanos(self.latency_ns() as u64))
    }

    /// Outcomes recorded so far: (successes, failures).
    pub fn outcomes(&self) -> (u64, u64) {
        (
            self.successes.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    /// Healthy and not ejected at `now`.
    #[inline]
    pub(crate) fn is_available(&self, now: u64) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.ejected_until.load(Ordering::Relaxed) <= now
    }

    #[inline]
    pub(crate) fn latency_ns(&self) -> f64 {
        f64::from_bits(self.latency_bits.load(Ordering::Relaxed))
    }

    #[inline]
    pub(crate) fn set_latency_ns(&self, v: f64, now: u64) {
        self.latency_bits.store(v.to_bits(), Ordering::Relaxed);
        self.latency_stamp.store(now, Ordering::Relaxed);
        self.has_latency.store(true, Ordering::Relaxed);
    }
}

/// A read-only copy of one endpoint's state, for status pages and reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EndpointStatus {
    /// Process-unique identity.
    pub id: u64,
    /// The configured address.
    pub address: String,
    /// The configured weight.
    pub weight: u32,
    /// The weight in force now, after slow start (equal to `weight` outside a ramp).
    pub effective_weight: f64,
    /// Active health check verdict.
    pub healthy: bool,
    /// Ejected by the outlier detector until this time (driver's clock), if ejected now.
    pub ejected_until: Option<Duration>,
    /// Times ejected in a row (the ejection-time multiplier).
    pub ejections: u32,
    /// Times ejected since the endpoint was added.
    pub ejections_total: u64,
    /// Calls in flight.
    pub in_flight: u32,
    /// The strategy's latency estimate, if any.
    pub latency_estimate: Option<Duration>,
    /// Successes recorded.
    pub successes: u64,
    /// Failures recorded.
    pub failures: u64,
}
