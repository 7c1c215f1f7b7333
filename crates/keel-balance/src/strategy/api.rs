//! What a strategy is ([`Strategy`]) and what one pick sees ([`View`]): the strategies'
//! common ground, apart from the module that builds them so that they depend on it alone.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::config::TieBreak;
use crate::endpoint::{Endpoint, EndpointId};
use crate::load::{LoadReport, Utilization};
use crate::rng::{below, mix64, unit_f64, SharedRng};
use crate::slow_start::SlowStartConfig;
use crate::Outcome;

/// How many random draws a random strategy makes before it falls back to a scan of the allowed
/// endpoints (only when many are unavailable).
pub(crate) const RANDOM_TRIES: usize = 8;

/// One strategy: its choice rule and the state it keeps (tables, counters, estimates' priors).
///
/// The balancer calls [`Strategy::pick`] for every call; then, for a strategy that
/// [`follows_calls`](Strategy::follows_calls), [`Strategy::started`] once the call is counted in
/// flight and [`Strategy::observe`] with what the balancer learns about an endpoint (a call's
/// end and its latency). A strategy that decides from data handed in from outside (probe
/// results: calls in flight and latency per endpoint, with the time) receives them through
/// `observe` too, as another kind of [`Observation`].
pub(crate) trait Strategy: Send + Sync {
    /// The index of the endpoint for this call, among those `v` allows; `None` if none is.
    /// `call` is what the request says of itself (its hash key, its prompt's blocks).
    fn pick(&self, v: &View<'_>, call: Call<'_>) -> Option<usize>;

    /// True if the strategy wants [`Strategy::started`] and [`Strategy::observe`] for every
    /// call (the others let `finish` skip the snapshot entirely).
    fn follows_calls(&self) -> bool {
        false
    }

    /// A call to endpoint `i` started: its in-flight count is already up.
    fn started(&self, _v: &View<'_>, _i: usize) {}

    /// What the balancer learned about endpoint `i` at `v.now`.
    fn observe(&self, _v: &View<'_>, _i: usize, _what: &Observation) {}

    /// Endpoint `which`'s availability changed outside a call (ejected, health changed), or,
    /// with `None`, any endpoint's may have (an ejection ended). Strategies that keep an index
    /// of the endpoints re-read them.
    fn refresh(&self, _v: &View<'_>, _which: Option<usize>) {}

    /// True if picks must see the group's total in flight ([`View::group_in_flight`]).
    fn uses_group_load(&self) -> bool {
        false
    }

    /// Number of ring points (ring-hash only), for reports.
    fn ring_points(&self) -> Option<usize> {
        None
    }

    /// True for the strategies that shut an endpoint out on its estimate and let it back in
    /// when the estimate recovers (least-time, peak-EWMA, prequal): the balancer then gives an
    /// endpoint whose last call failed one call at a time until one succeeds, instead of a
    /// whole timeout's worth of picks (before this: about 800 calls to a hung server per
    /// re-admission at 1,667 requests/s and a 1 s timeout).
    fn half_open(&self) -> bool {
        false
    }

    /// True if the strategy balances on load reports ([`Observation::Load`]); the balancer
    /// drops reports for the others without a lookup.
    fn uses_load_reports(&self) -> bool {
        false
    }

    /// True if the strategy balances on reported utilisation ([`Observation::Utilization`]).
    fn uses_utilization(&self) -> bool {
        false
    }

    /// Appends to `out` the endpoints whose load the driver should probe now (after a pick).
    fn probe_targets(&self, _v: &View<'_>, _out: &mut Vec<EndpointId>) {}
}

/// What a pick knows of its request besides the endpoints' state ([`crate::PickContext`]'s
/// request fields): the strategies that read none of it ignore it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Call<'a> {
    /// The request's hash key, if it has one.
    pub key: Option<u64>,
    /// The prompt's block names, first block first (`prefix-affinity`).
    pub prefix: &'a [u64],
}

impl Call<'_> {
    /// A call with no key and no prompt.
    #[cfg(test)]
    pub const NONE: Call<'static> = Call {
        key: None,
        prefix: &[],
    };

    /// A call with only a hash key.
    #[cfg(test)]
    pub fn key(key: u64) -> Call<'static> {
        Call {
            key: Some(key),
            prefix: &[],
        }
    }
}

/// Something the balancer learned about one endpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Observation {
    /// A call ended with `outcome` after `latency_ns`.
    CallEnded {
        /// How it ended.
        outcome: Outcome,
        /// From pick to finish, on the driver's clock.
        latency_ns: u64,
    },
    /// The endpoint reported its load (a probe's answer, or an answer's headers), received at
    /// the view's time.
    Load(LoadReport),
    /// The endpoint reported its utilisation (ORCA), received at the view's time.
    Utilization(Utilization),
}

/// What one pick may choose from, and when.
pub(crate) struct View<'a> {
    pub eps: &'a [Arc<Endpoint>],
    /// Nanoseconds on the driver's clock.
    pub now: u64,
    pub avoid: &'a [EndpointId],
    /// Panic mode: health and ejection are ignored.
    pub ignore_health: bool,
    pub slow_start: Option<&'a SlowStartConfig>,
    pub rng: &'a SharedRng,
    /// Calls in flight over the whole group (kept only for bounded loads).
    pub group: &'a AtomicU64,
    /// Half-open re-admission: an endpoint whose last call failed may take a call only while
    /// it has none in flight (strategies whose [`Strategy::half_open`] is true).
    pub half_open: bool,
    /// Pass over endpoints that asked to be backed off (set only while one may be).
    pub back_off: bool,
    /// Nanoseconds a reported queue counts in [`View::load`]; 0: reported queues are not read.
    pub queue_max_age: u64,
}

impl<'a> View<'a> {
    /// The same view over another list of endpoints (a priority level's or a zone's).
    #[inline]
    pub fn over(&self, eps: &'a [Arc<Endpoint>]) -> View<'a> {
        View {
            eps,
            now: self.now,
            avoid: self.avoid,
            ignore_health: self.ignore_health,
            slow_start: self.slow_start,
            rng: self.rng,
            group: self.group,
            half_open: self.half_open,
            queue_max_age: self.queue_max_age,
            back_off: self.back_off,
        }
    }

    /// Whether endpoint `i` takes calls at all: available, or in panic mode (health ignored) not
    /// draining (a drain holds in panic mode too; `is_available` covers it otherwise).
    #[inline]
    pub fn serving(&self, i: usize) -> bool {
        let e = &self.eps[i];
        if self.ignore_health {
            !e.is_draining()
        } else {
            e.is_available(self.now)
        }
    }

    /// May this pick choose endpoint `i`?
    #[inline]
    pub fn allowed(&self, i: usize) -> bool {
        let e = &self.eps[i];
        self.serving(i)
            && (self.avoid.is_empty() || !self.avoid.contains(&e.id()))
            && !(self.half_open && e.on_trial() && e.in_flight() > 0)
            && !(self.back_off && e.backed_off(self.now))
    }

    /// The group's calls in flight now.
    #[inline]
    pub fn group_in_flight(&self) -> u64 {
        self.group.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Slow-start factor in (0, 1].
    #[inline]
    pub fn ramp(&self, i: usize) -> f64 {
        let Some(ss) = self.slow_start else {
            return 1.0;
        };
        let since = self.eps[i].ramp_start(self.now);
        if since == 0 {
            return 1.0;
        }
        ss.factor(since, self.now)
    }

    /// Effective weight in thousandths (weight x ramp), at least 1.
    #[inline]
    pub fn weight_milli(&self, i: usize) -> u64 {
        let w = u64::from(self.eps[i].weight()) * 1000;
        if self.slow_start.is_none() {
            return w;
        }
        ((w as f64 * self.ramp(i)) as u64).max(1)
    }

    /// Endpoint `i`'s load: the calls this balancer has in flight on it, plus the queue it
    /// last reported, while that report is fresh (only with `queue_max_age`). A request of
    /// ours that waits there counts twice, which weighs a queue above a running batch; a queue
    /// other clients built (another proxy of a fleet) counts at all.
    #[inline]
    pub fn load(&self, i: usize) -> u32 {
        let own = self.eps[i].in_flight();
        if self.queue_max_age == 0 {
            return own;
        }
        own.saturating_add(self.eps[i].reported_queue(self.now, self.queue_max_age))
    }

    /// Compares the load per unit of weight of `a` with that of `b` (`Less`: `a`
    /// is lighter). Idle endpoints tie whatever their weights, so that the tie-break, not the
    /// weight, decides among them (with `(in_flight + 1) / weight` the heaviest idle endpoint
    /// would win every pick at low load).
    #[inline]
    pub fn lighter(&self, a: usize, b: usize) -> std::cmp::Ordering {
        let la = u128::from(self.load(a)) * u128::from(self.weight_milli(b));
        let lb = u128::from(self.load(b)) * u128::from(self.weight_milli(a));
        la.cmp(&lb)
    }

    /// Slow start for strategies that draw candidates by configured weight: accept a drawn
    /// endpoint with probability equal to its ramp, so that accepted draws follow weight x ramp.
    #[inline]
    pub fn ramp_accepts(&self, i: usize, bits: u64) -> bool {
        self.slow_start.is_none() || unit_f64(bits) < self.ramp(i)
    }

    /// A uniformly random allowed endpoint.
    pub fn random_allowed(&self) -> Option<usize> {
        let n = self.eps.len();
        if n == 0 {
            return None;
        }
        for _ in 0..RANDOM_TRIES {
            let i = self.rng.below(n);
            if self.allowed(i) {
                return Some(i);
            }
        }
        let count = (0..n).filter(|&i| self.allowed(i)).count();
        if count == 0 {
            return None;
        }
        let nth = self.rng.below(count);
        (0..n).filter(|&i| self.allowed(i)).nth(nth)
    }

    /// Scans every allowed endpoint and returns the one with the smallest `key`; ties go to a
    /// draw in proportion to (effective) weight among the tied (weighted reservoir sampling),
    /// or with `LowestIndex` to the first.
    pub fn min_by<K: PartialOrd>(&self, tie: TieBreak, key: impl Fn(usize) -> K) -> Option<usize> {
        let mut best: Option<(usize, K)> = None;
        let mut tied_weight = 0u64;
        let mut bits = self.rng.next_u64();
        for i in 0..self.eps.len() {
            if !self.allowed(i) {
                continue;
            }
            let k = key(i);
            let weight = self.weight_milli(i);
            match &best {
                Some((_, bk)) if k > *bk => {}
                Some((_, bk)) if k == *bk => {
                    if tie == TieBreak::Random {
                        tied_weight += weight;
                        bits = mix64(bits);
                        if (below(bits, tied_weight as usize) as u64) < weight {
                            best = Some((i, k));
                        }
                    }
                }
                _ => {
                    best = Some((i, k));
                    tied_weight = weight;
                }
            }
        }
        best.map(|b| b.0)
    }
}

/// Orders endpoints by load ([`View::load`]) per unit of weight (for [`View::min_by`]).
pub(crate) struct LoadKey<'a, 'b>(pub &'a View<'b>, pub usize);

impl PartialEq for LoadKey<'_, '_> {
    fn eq(&self, other: &Self) -> bool {
        self.0.lighter(self.1, other.1).is_eq()
    }
}

impl PartialOrd for LoadKey<'_, '_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.0.lighter(self.1, other.1))
    }
}
