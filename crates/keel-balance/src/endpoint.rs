//! Endpoints and the shared, atomically updated state that strategies and protections read.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::outlier::OutlierState;
use crate::time::nanos;

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
    /// Priority level: 0 takes the traffic first, and each next level takes a share as the
    /// healthy share of the levels before it falls (Envoy's overprovisioning factor; see
    /// docs/balancing.md, "Priorities and zones"). Default 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: u32,
    /// The zone (availability zone, rack) the endpoint runs in, for zone-aware routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

fn default_weight() -> u32 {
    1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl EndpointSpec {
    /// An endpoint of weight 1.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            weight: 1,
            priority: 0,
            zone: None,
        }
    }

    /// The same endpoint with another weight.
    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight;
        self
    }

    /// The same endpoint at another priority level.
    pub fn with_priority(mut self, priority: u32) -> Self {
        self.priority = priority;
        self
    }

    /// The same endpoint in a zone.
    pub fn with_zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = Some(zone.into());
        self
    }
}

/// A stable identity for an endpoint inside one process: survives weight changes, reloads and
/// rebuilds of hash tables, so that a retry can say "not that one again".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub u64);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// One endpoint and the live state that the balancer keeps for it. Shared (`Arc`) between the
/// balancer's snapshots, so that counters, latency estimates and ejections survive a rebuild.
/// The state changes only through its methods, each of which keeps it consistent.
#[derive(Debug)]
pub struct Endpoint {
    id: EndpointId,
    address: String,
    /// xxh3 of the address: the endpoint's place in hash strategies.
    hash: u64,
    weight: AtomicU32,
    in_flight: AtomicU32,
    /// Its last call failed: strategies that shut endpoints out on their estimate give it one
    /// call at a time until one succeeds (half-open re-admission).
    on_trial: AtomicBool,
    healthy: AtomicBool,
    /// Taken out by the operator (an admin's drain): no new calls, whatever the health, panic
    /// mode included; calls in flight finish.
    draining: AtomicBool,
    /// Start of the current slow-start ramp (added or back to healthy), 0 = none.
    ramp_from: AtomicU64,
    /// Ejected until this instant; 0 = never ejected.
    ejected_until: AtomicU64,
    /// Passed over by picks until this instant while others may take the call: the endpoint
    /// asked for it (`Retry-After`, gRPC pushback; see [`crate::Balancer::back_off`]).
    backed_off_until: AtomicU64,
    /// The strategy's latency estimate (plain EWMA or peak-EWMA) and the time of its last
    /// sample, in one atomic word.
    latency: LatencyEstimate,
    successes: AtomicU64,
    failures: AtomicU64,
    outlier: Mutex<OutlierState>,
    /// What the endpoint last said about itself, for zone-aware routing: requests in flight
    /// (from a [`crate::LoadReport`]) and utilisation (f64 bits, from an ORCA report), each
    /// with the time it arrived (0: never).
    reported: Reported,
}

/// What an endpoint reported about itself (zone routing reads it), kept apart from the fields
/// every pick touches.
#[derive(Debug, Default)]
struct Reported {
    rif: AtomicU32,
    rif_at: AtomicU64,
    /// Requests waiting in the endpoint's own queue (an inference engine's
    /// `num_requests_waiting`), and when that was said.
    queue: AtomicU32,
    queue_at: AtomicU64,
    util: AtomicU64,
    util_at: AtomicU64,
}

impl Endpoint {
    pub(crate) fn new(spec: &EndpointSpec, ramp_from: u64) -> Self {
        Self {
            id: EndpointId(NEXT_ID.fetch_add(1, Ordering::Relaxed)),
            hash: xxhash_rust::xxh3::xxh3_64(spec.address.as_bytes()),
            address: spec.address.clone(),
            weight: AtomicU32::new(spec.weight.max(1)),
            in_flight: AtomicU32::new(0),
            on_trial: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            ramp_from: AtomicU64::new(ramp_from),
            ejected_until: AtomicU64::new(0),
            backed_off_until: AtomicU64::new(0),
            latency: LatencyEstimate::default(),
            successes: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            outlier: Mutex::new(OutlierState::default()),
            reported: Reported::default(),
        }
    }

    /// A stable token for this endpoint: the xxh3 of its address. The same across restarts,
    /// reloads and processes, and not the address itself, so that a sticky-session cookie can
    /// carry it ([`crate::Balancer::pick_pinned`]).
    pub fn token(&self) -> u64 {
        self.hash
    }

    /// Records the requests in flight the endpoint reported at `now`.
    pub(crate) fn set_reported_rif(&self, rif: u32, now: u64) {
        self.reported.rif.store(rif, Ordering::Relaxed);
        self.reported.rif_at.store(now.max(1), Ordering::Relaxed);
    }

    /// Records the requests waiting in its own queue that the endpoint reported at `now`.
    pub(crate) fn set_reported_queue(&self, waiting: u32, now: u64) {
        self.reported.queue.store(waiting, Ordering::Relaxed);
        self.reported.queue_at.store(now.max(1), Ordering::Relaxed);
    }

    /// The queue it reported no longer than `max_age` before `now`; 0 without such a report.
    #[inline]
    pub(crate) fn reported_queue(&self, now: u64, max_age: u64) -> u32 {
        let at = self.reported.queue_at.load(Ordering::Relaxed);
        if at != 0 && now.saturating_sub(at) <= max_age {
            self.reported.queue.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// Records the utilisation the endpoint reported at `now`.
    pub(crate) fn set_reported_util(&self, util: f64, now: u64) {
        self.reported.util.store(util.to_bits(), Ordering::Relaxed);
        self.reported.util_at.store(now.max(1), Ordering::Relaxed);
    }

    /// The requests in flight it reported no longer than `max_age` before `now`.
    #[inline]
    pub(crate) fn reported_rif(&self, now: u64, max_age: u64) -> Option<u32> {
        let at = self.reported.rif_at.load(Ordering::Relaxed);
        (at != 0 && now.saturating_sub(at) <= max_age)
            .then(|| self.reported.rif.load(Ordering::Relaxed))
    }

    /// The utilisation it reported no longer than `max_age` before `now`.
    #[inline]
    pub(crate) fn reported_util(&self, now: u64, max_age: u64) -> Option<f64> {
        let at = self.reported.util_at.load(Ordering::Relaxed);
        (at != 0 && now.saturating_sub(at) <= max_age)
            .then(|| f64::from_bits(self.reported.util.load(Ordering::Relaxed)))
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

    /// True while the operator keeps it out of new picks ([`crate::Balancer::set_draining`]).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// `Some(until)` while the outlier detector keeps this endpoint out.
    pub fn ejected_until(&self, now: Duration) -> Option<Duration> {
        let until = self.ejected_until.load(Ordering::Relaxed);
        (until > nanos(now)).then(|| Duration::from_nanos(until))
    }

    /// The strategy's latency estimate, if it keeps one and has a sample.
    pub fn latency_estimate(&self) -> Option<Duration> {
        self.latency
            .value()
            .map(|ns| Duration::from_nanos(ns as u64))
    }

    /// Outcomes recorded so far: (successes, failures).
    pub fn outcomes(&self) -> (u64, u64) {
        (
            self.successes.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
        )
    }

    #[inline]
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    pub(crate) fn set_weight(&self, weight: u32) {
        self.weight.store(weight.max(1), Ordering::Relaxed);
    }

    /// True while its last call failed (see `on_trial`'s field).
    #[inline]
    pub(crate) fn on_trial(&self) -> bool {
        self.on_trial.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn set_trial(&self, on: bool) {
        if self.on_trial() != on {
            self.on_trial.store(on, Ordering::Relaxed);
        }
    }

    /// A call starts: one more in flight.
    #[inline]
    pub(crate) fn begin_call(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A call ends (finished or cancelled).
    #[inline]
    pub(crate) fn end_call(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn count_outcome(&self, failed: bool) {
        let counter = if failed {
            &self.failures
        } else {
            &self.successes
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Healthy, not ejected at `now`, not draining.
    #[inline]
    pub(crate) fn is_available(&self, now: u64) -> bool {
        self.healthy.load(Ordering::Relaxed)
            && self.ejected_until.load(Ordering::Relaxed) <= now
            && !self.draining.load(Ordering::Relaxed)
    }

    /// Sets the operator's drain; returns true if it changed. Back from a drain starts a slow
    /// start, as back from an ejection does.
    pub(crate) fn set_draining(&self, on: bool, now: u64) -> bool {
        let was = self.draining.swap(on, Ordering::Relaxed);
        if was && !on {
            self.ramp_from.store(now.max(1), Ordering::Relaxed);
        }
        was != on
    }

    /// True while the endpoint asked picks to pass it over (`now` in nanoseconds).
    #[inline]
    pub(crate) fn backed_off(&self, now: u64) -> bool {
        self.backed_off_until.load(Ordering::Relaxed) > now
    }

    /// Passes the endpoint over until `until` (nanoseconds), or longer if it asked so already.
    pub(crate) fn back_off(&self, until: u64) {
        self.backed_off_until.fetch_max(until, Ordering::Relaxed);
    }

    /// Backed off until this instant, if still at `now`.
    pub fn backed_off_until(&self, now: Duration) -> Option<Duration> {
        let until = self.backed_off_until.load(Ordering::Relaxed);
        (until > nanos(now)).then(|| Duration::from_nanos(until))
    }

    /// Ejected until this instant (nanoseconds; 0 = never ejected).
    #[inline]
    pub(crate) fn ejected_until_ns(&self) -> u64 {
        self.ejected_until.load(Ordering::Relaxed)
    }

    /// When the endpoint's current slow start began at `now`: added, back to healthy, or back
    /// from an ejection, whichever is latest; 0 if none.
    #[inline]
    pub(crate) fn ramp_start(&self, now: u64) -> u64 {
        let since = self.ramp_from.load(Ordering::Relaxed);
        let ejected = self.ejected_until.load(Ordering::Relaxed);
        if ejected <= now {
            since.max(ejected)
        } else {
            since
        }
    }

    /// Records an active health check's verdict; returns true if it changed. Back to healthy
    /// starts a slow start; unhealthy forgets the latency estimate (back in service, the
    /// endpoint starts over like a new one).
    pub(crate) fn set_healthy(&self, healthy: bool, now: u64) -> bool {
        let was = self.healthy.swap(healthy, Ordering::Relaxed);
        if was != healthy {
            if healthy {
                self.ramp_from.store(now.max(1), Ordering::Relaxed);
            } else {
                self.latency.clear();
            }
        }
        was != healthy
    }

    /// Ejects the endpoint until `until`, and forgets its latency estimate: one from before the
    /// ejection says nothing about it when it is back.
    pub(crate) fn eject(&self, until: u64) {
        self.ejected_until.store(until, Ordering::Relaxed);
        self.latency.clear();
    }

    /// The latency estimate that the latency strategies keep.
    #[inline]
    pub(crate) fn latency(&self) -> &LatencyEstimate {
        &self.latency
    }

    /// The outlier detector's state for this endpoint.
    pub(crate) fn outlier(&self) -> std::sync::MutexGuard<'_, OutlierState> {
        self.outlier.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A latency estimate in nanoseconds and the time of its last sample, packed in one atomic word
/// so that a reader never sees the value of one sample with the time of another, and an update
/// is one compare-and-swap (no lock, no lost update).
///
/// Layout: bit 63 says "has a sample"; bits 36-62 hold the estimate as an `f32` without its sign
/// and its 4 lowest mantissa bits (relative precision 2^-19); bits 0-35 hold the time of the
/// last sample in units of 1024 ns, modulo 2^36 (about 19.5 hours). An age is therefore read
/// modulo 19.5 hours, and one of more than half that (a sample seemingly from the future) as 0:
/// harmless, since any decay time that keel uses has forgotten a sample long before that.
#[derive(Debug, Default)]
pub(crate) struct LatencyEstimate(AtomicU64);

const HAS_SAMPLE: u64 = 1 << 63;
const STAMP_BITS: u32 = 36;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;
const STAMP_UNIT_SHIFT: u32 = 10;

impl LatencyEstimate {
    fn pack(value_ns: f64, now: u64) -> u64 {
        let value = value_ns.clamp(0.0, f64::from(f32::MAX)) as f32;
        let bits = u64::from(value.to_bits() >> 4);
        HAS_SAMPLE | bits << STAMP_BITS | ((now >> STAMP_UNIT_SHIFT) & STAMP_MASK)
    }

    fn unpack(word: u64, now: u64) -> Option<(f64, u64)> {
        if word & HAS_SAMPLE == 0 {
            return None;
        }
        let value = f32::from_bits((((word & !HAS_SAMPLE) >> STAMP_BITS) as u32) << 4);
        let age_units = match (now >> STAMP_UNIT_SHIFT).wrapping_sub(word) & STAMP_MASK {
            // A sample stamped after `now` (another thread read its clock later and recorded
            // first): age 0, not 19.5 hours, which would decay the estimate to nothing and make
            // the endpoint look free.
            future if future > STAMP_MASK / 2 => 0,
            age => age,
        };
        Some((f64::from(value), age_units << STAMP_UNIT_SHIFT))
    }

    /// The estimate and its age at `now`, if there is a sample.
    #[inline]
    pub(crate) fn read(&self, now: u64) -> Option<(f64, u64)> {
        Self::unpack(self.0.load(Ordering::Relaxed), now)
    }

    /// The estimate as last recorded (no decay applied).
    #[inline]
    pub(crate) fn value(&self) -> Option<f64> {
        self.read(0).map(|(v, _)| v)
    }

    /// The estimate decayed to `now` (peak-EWMA's read: an endpoint that gets no traffic looks
    /// cheaper as time passes, so it is tried again after a while).
    #[inline]
    pub(crate) fn decayed(&self, now: u64, decay_ns: f64) -> Option<f64> {
        self.read(now).map(|(v, age)| v * keep(age, decay_ns))
    }

    /// Folds a sample `x` taken at `now` into the estimate as an EWMA with time constant
    /// `decay_ns`; with `peak`, a sample above the current (decayed) estimate replaces it at
    /// once (peak-EWMA). The first sample is taken as it is.
    pub(crate) fn record(&self, x: f64, now: u64, decay_ns: f64, peak: bool) {
        let mut word = self.0.load(Ordering::Relaxed);
        loop {
            let next = match Self::unpack(word, now) {
                None => x,
                Some((v, age)) => {
                    let w = keep(age, decay_ns);
                    if peak && x > v * w {
                        x
                    } else {
                        v * w + x * (1.0 - w)
                    }
                }
            };
            match self.0.compare_exchange_weak(
                word,
                Self::pack(next, now),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(current) => word = current,
            }
        }
    }

    /// Forgets every sample (an endpoint back from an ejection or a failed health check starts
    /// over, as a new one does).
    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// The weight an EWMA keeps on its past after `age_ns`: e^(-age / decay).
#[inline]
fn keep(age_ns: u64, decay_ns: f64) -> f64 {
    (-(age_ns as f64) / decay_ns).exp()
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
    /// Kept out of new picks by the operator ([`crate::Balancer::set_draining`]).
    pub draining: bool,
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn an_estimate_keeps_its_value_and_age_together() {
        let e = LatencyEstimate::default();
        assert_eq!(e.read(5 * MS), None);
        e.record(10.0 * MS as f64, 100 * MS, 1e9, false);
        let (v, age) = e.read(130 * MS).unwrap();
        assert!((v - 10.0 * MS as f64).abs() < 1e-4 * v, "{v}");
        // The age is kept to 1024 ns.
        assert!(age.abs_diff(30 * MS) < 2048, "{age}");
        // Read a little before the sample's time (another thread's clock): age 0, not 19 hours.
        assert_eq!(e.read(100 * MS - 5_000).unwrap().1, 0);
        e.clear();
        assert_eq!(e.value(), None);
    }

    #[test]
    fn ewma_weighs_a_sample_by_the_time_since_the_last() {
        let decay = 1e9; // 1 s
        let e = LatencyEstimate::default();
        e.record(10.0, 0, decay, false);
        // One decay time later the past keeps e^-1 of its weight.
        e.record(20.0, 1_000_000_000, decay, false);
        let keep = (-1.0f64).exp();
        let want = 10.0 * keep + 20.0 * (1.0 - keep);
        assert!((e.value().unwrap() - want).abs() < 1e-3, "{:?}", e.value());
        // Decayed reading: another decay time later, e^-1 of that.
        let later = e.decayed(2_000_000_000, decay).unwrap();
        assert!((later - want * keep).abs() < 1e-3, "{later}");
    }

    #[test]
    fn peak_ewma_jumps_to_a_higher_sample_and_decays_from_it() {
        let decay = 1e9;
        let e = LatencyEstimate::default();
        e.record(10.0 * MS as f64, 0, decay, true);
        e.record(500.0 * MS as f64, MS, decay, true);
        assert!((e.value().unwrap() - 500.0 * MS as f64).abs() < 1e-3 * 500.0 * MS as f64);
        // A lower sample is averaged in, not taken.
        e.record(10.0 * MS as f64, 2 * MS, decay, true);
        let v = e.value().unwrap();
        assert!(v > 400.0 * MS as f64 && v < 500.0 * MS as f64, "{v}");
    }

    #[test]
    fn concurrent_samples_are_all_folded_in() {
        // Every sample is 1 with an infinite decay time: the EWMA keeps its first value, but a
        // lost update would show as a CAS retry that never happened; count the successes.
        let e = LatencyEstimate::default();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let e = &e;
                s.spawn(move || {
                    for i in 0..10_000 {
                        e.record(1.0, t * 1_000_000 + i * 1024, f64::INFINITY, false);
                    }
                });
            }
        });
        assert_eq!(e.value(), Some(1.0));
    }

    #[test]
    fn ejection_and_ill_health_forget_the_estimate_and_return_restarts_the_ramp() {
        let e = Endpoint::new(&EndpointSpec::new("10.0.0.1:80"), 0);
        e.latency().record(5.0, 10, 1e9, false);
        e.eject(1_000);
        assert!(!e.is_available(999) && e.is_available(1_000));
        assert_eq!(e.latency_estimate(), None);
        assert_eq!(e.ramp_start(500), 0, "still ejected: no ramp yet");
        assert_eq!(e.ramp_start(2_000), 1_000, "back at the ejection's end");
        e.latency().record(5.0, 2_000, 1e9, false);
        assert!(e.set_healthy(false, 3_000));
        assert!(!e.set_healthy(false, 3_000), "no change");
        assert_eq!(e.latency_estimate(), None);
        assert!(e.set_healthy(true, 4_000));
        assert_eq!(e.ramp_start(5_000), 4_000);
    }

    #[test]
    fn calls_and_outcomes_are_counted() {
        let e = Endpoint::new(&EndpointSpec::new("10.0.0.1:80").with_weight(0), 0);
        assert_eq!(e.weight(), 1, "a weight is at least 1");
        e.begin_call();
        e.begin_call();
        e.end_call();
        assert_eq!(e.in_flight(), 1);
        e.count_outcome(true);
        e.count_outcome(false);
        e.count_outcome(false);
        assert_eq!(e.outcomes(), (2, 1));
    }
}
