//! The strategies' choice rules. Each reads endpoint state through a [`View`] that already knows
//! which endpoints are allowed for this pick (health, ejection, panic mode, retry avoidance).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::{StrategyKind, StrategyOptions, TieBreak};
use crate::endpoint::{nanos, Endpoint, EndpointId, LatencyEstimate};
use crate::hash::{rendezvous_score, Maglev, Ring};
use crate::rng::{below, mix64, unit_f64, SharedRng};
use crate::slow_start::SlowStartConfig;
use crate::weights::WeightLine;
use crate::Outcome;

/// How many random draws a random strategy makes before it falls back to a scan of the allowed
/// endpoints (only when many are unavailable).
const RANDOM_TRIES: usize = 8;

/// What one pick may choose from.
pub(crate) struct View<'a> {
    pub eps: &'a [Arc<Endpoint>],
    pub now: u64,
    pub avoid: &'a [EndpointId],
    /// Panic mode: health and ejection are ignored.
    pub ignore_health: bool,
    pub slow_start: Option<&'a SlowStartConfig>,
    pub rng: &'a SharedRng,
}

impl View<'_> {
    #[inline]
    pub fn allowed(&self, i: usize) -> bool {
        let e = &self.eps[i];
        (self.ignore_health || e.is_available(self.now))
            && (self.avoid.is_empty() || !self.avoid.contains(&e.id()))
    }

    /// Slow-start factor in (0, 1].
    #[inline]
    pub fn ramp(&self, i: usize) -> f64 {
        let Some(ss) = self.slow_start else {
            return 1.0;
        };
        let e = &self.eps[i];
        let mut since = e.ramp_from.load(Ordering::Relaxed);
        let ejected = e.ejected_until.load(Ordering::Relaxed);
        if ejected <= self.now {
            since = since.max(ejected);
        }
        if since == 0 {
            return 1.0;
        }
        ss.factor(since, self.now)
    }

    /// Effective weight in thousandths (weight x ramp), at least 1.
    #[inline]
    pub fn weight_milli(&self, i: usize) -> u64 {
        let w = self.eps[i].weight() as u64 * 1000;
        if self.slow_start.is_none() {
            return w;
        }
        ((w as f64 * self.ramp(i)) as u64).max(1)
    }

    /// Compares the calls in flight per unit of weight of `a` with those of `b` (`Less`: `a`
    /// is lighter). Idle endpoints tie whatever their weights, so that the tie-break, not the
    /// weight, decides among them (with `(in_flight + 1) / weight` the heaviest idle endpoint
    /// would win every pick at low load).
    #[inline]
    fn lighter(&self, a: usize, b: usize) -> std::cmp::Ordering {
        let la = u128::from(self.eps[a].in_flight()) * u128::from(self.weight_milli(b));
        let lb = u128::from(self.eps[b].in_flight()) * u128::from(self.weight_milli(a));
        la.cmp(&lb)
    }

    /// Slow start for strategies that draw candidates by configured weight: accept a drawn
    /// endpoint with probability equal to its ramp, so that accepted draws follow weight x ramp.
    #[inline]
    fn ramp_accepts(&self, i: usize, bits: u64) -> bool {
        self.slow_start.is_none() || unit_f64(bits) < self.ramp(i)
    }

    /// Draws allowed candidates in proportion to weight for a power-of-two-choices pick: two
    /// distinct ones when possible (see [`WeightLine::pair`]), then more up to `choices`.
    /// Returns how many it wrote into `out`.
    fn candidates(&self, line: &WeightLine, choices: u32, out: &mut [usize; MAX_CHOICES]) -> usize {
        let want = (choices as usize).clamp(2, MAX_CHOICES);
        for _ in 0..RANDOM_TRIES {
            let bits = self.rng.next_u64();
            let more = mix64(bits);
            let (a, b) = line.pair(bits, more);
            let mut count = 0;
            let mut next_bits = mix64(more);
            for c in [a, b] {
                if self.allowed(c) && self.ramp_accepts(c, next_bits) {
                    out[count] = c;
                    count += 1;
                }
                next_bits = mix64(next_bits);
            }
            while count > 0 && count < want {
                let c = line.draw(next_bits);
                next_bits = mix64(next_bits);
                if self.allowed(c) && !out[..count].contains(&c) {
                    out[count] = c;
                    count += 1;
                } else {
                    break;
                }
            }
            if count > 0 {
                return count;
            }
        }
        // Most of the weight is unavailable: one uniform draw over the allowed endpoints.
        match self.random_allowed() {
            Some(i) => {
                out[0] = i;
                1
            }
            None => 0,
        }
    }

    /// A uniformly random allowed endpoint.
    fn random_allowed(&self) -> Option<usize> {
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

    /// Scans every allowed endpoint and returns the one with the smallest `key`, breaking ties
    /// as told (reservoir sampling for random ties: each tied endpoint equally likely).
    fn min_by<K: PartialOrd>(&self, tie: TieBreak, key: impl Fn(usize) -> K) -> Option<usize> {
        let mut best: Option<(usize, K)> = None;
        let mut ties = 0u64;
        let mut bits = 0u64;
        for i in 0..self.eps.len() {
            if !self.allowed(i) {
                continue;
            }
            let k = key(i);
            match &best {
                None => {
                    best = Some((i, k));
                    ties = 1;
                }
                Some((_, bk)) => {
                    if k < *bk {
                        best = Some((i, k));
                        ties = 1;
                    } else if k == *bk && tie == TieBreak::Random {
                        ties += 1;
                        if ties == 2 {
                            bits = self.rng.next_u64();
                        } else {
                            bits = mix64(bits);
                        }
                        if below(bits, ties as usize) == 0 {
                            best = Some((i, k));
                        }
                    }
                }
            }
        }
        best.map(|b| b.0)
    }
}

/// Most candidates a power-of-two-choices pick compares (`choices` above this count as this).
const MAX_CHOICES: usize = 8;

/// Per-strategy state and tables, rebuilt when the endpoint list changes.
pub(crate) enum Strategy {
    RoundRobin {
        next: AtomicUsize,
    },
    WeightedRoundRobin {
        current: Mutex<Vec<i64>>,
    },
    Random,
    WeightedRandom {
        cumulative: Vec<u64>,
    },
    LeastConnections {
        tie: TieBreak,
    },
    LeastRequest {
        choices: u32,
        line: WeightLine,
    },
    LeastTime {
        tie: TieBreak,
        decay_ns: f64,
        tolerance: f64,
    },
    PeakEwma {
        choices: u32,
        line: WeightLine,
        tolerance: f64,
        decay_ns: f64,
        default_rtt_ns: f64,
        penalty_ns: f64,
        /// An EWMA of every sample of the cluster: the prior of an endpoint without a sample.
        cluster: LatencyEstimate,
    },
    RingHash {
        ring: Ring,
        bound: Option<f64>,
    },
    Maglev {
        table: Maglev,
        bound: Option<f64>,
    },
    Rendezvous {
        uniform: bool,
        bound: Option<f64>,
    },
}

impl Strategy {
    pub(crate) fn build(kind: StrategyKind, o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        let named: Vec<(&str, u32)> = eps.iter().map(|e| (e.address(), e.weight())).collect();
        match kind {
            StrategyKind::RoundRobin => Strategy::RoundRobin {
                next: AtomicUsize::new(0),
            },
            StrategyKind::WeightedRoundRobin => Strategy::WeightedRoundRobin {
                current: Mutex::new(vec![0; eps.len()]),
            },
            StrategyKind::Random => Strategy::Random,
            StrategyKind::WeightedRandom => Strategy::WeightedRandom {
                cumulative: eps
                    .iter()
                    .scan(0u64, |acc, e| {
                        *acc += e.weight() as u64;
                        Some(*acc)
                    })
                    .collect(),
            },
            StrategyKind::LeastConnections => Strategy::LeastConnections { tie: o.tie_break },
            StrategyKind::LeastRequest => Strategy::LeastRequest {
                choices: o.choices,
                line: WeightLine::new(eps.iter().map(|e| e.weight())),
            },
            StrategyKind::LeastTime => Strategy::LeastTime {
                tie: o.tie_break,
                decay_ns: nanos(o.decay) as f64,
                tolerance: o.latency_tolerance,
            },
            StrategyKind::PeakEwma => {
                let cluster = LatencyEstimate::default();
                // The endpoints that stay through an update keep their estimates: their mean
                // is the prior of the new ones until the first samples arrive.
                let known: Vec<f64> = eps.iter().filter_map(|e| e.latency.value()).collect();
                if !known.is_empty() {
                    let mean = known.iter().sum::<f64>() / known.len() as f64;
                    cluster.record(mean, 0, 1.0, false);
                }
                Strategy::PeakEwma {
                    choices: o.choices,
                    line: WeightLine::new(eps.iter().map(|e| e.weight())),
                    tolerance: o.latency_tolerance,
                    decay_ns: nanos(o.decay) as f64,
                    default_rtt_ns: nanos(o.default_rtt) as f64,
                    penalty_ns: nanos(o.failure_penalty) as f64,
                    cluster,
                }
            }
            StrategyKind::RingHash => Strategy::RingHash {
                ring: Ring::build(&named, o.vnodes),
                bound: o.bounded_load,
            },
            StrategyKind::Maglev => Strategy::Maglev {
                table: Maglev::build(&named, o.table_size),
                bound: o.bounded_load,
            },
            StrategyKind::Rendezvous => Strategy::Rendezvous {
                uniform: named.windows(2).all(|w| w[0].1 == w[1].1),
                bound: o.bounded_load,
            },
        }
    }

    /// True when picks must track the group's total in-flight count (bounded loads).
    pub(crate) fn bounded(&self) -> bool {
        matches!(
            self,
            Strategy::RingHash { bound: Some(_), .. }
                | Strategy::Maglev { bound: Some(_), .. }
                | Strategy::Rendezvous { bound: Some(_), .. }
        )
    }

    /// Number of ring points (ring-hash only), for reports.
    pub(crate) fn ring_points(&self) -> Option<usize> {
        match self {
            Strategy::RingHash { ring, .. } => Some(ring.len()),
            _ => None,
        }
    }

    pub(crate) fn pick(
        &self,
        v: &View<'_>,
        key: Option<u64>,
        group_load: u64,
        total_weight: u64,
    ) -> Option<usize> {
        let n = v.eps.len();
        if n == 0 {
            return None;
        }
        match self {
            Strategy::RoundRobin { next } => {
                // An unavailable endpoint's turn goes to the next value of the counter, not to
                // its neighbour in the list, so that the others keep equal shares (walking to
                // the neighbour would give it a double share).
                for _ in 0..n {
                    let i = next.fetch_add(1, Ordering::Relaxed) % n;
                    if v.allowed(i) {
                        return Some(i);
                    }
                }
                None
            }
            Strategy::WeightedRoundRobin { current } => {
                let mut cur = current.lock().unwrap_or_else(|e| e.into_inner());
                let mut total = 0i64;
                let mut best: Option<usize> = None;
                for i in 0..n {
                    if !v.allowed(i) {
                        continue;
                    }
                    let w = v.weight_milli(i) as i64;
                    cur[i] += w;
                    total += w;
                    if best.is_none_or(|b| cur[i] > cur[b]) {
                        best = Some(i);
                    }
                }
                if let Some(b) = best {
                    cur[b] -= total;
                }
                best
            }
            Strategy::Random => v.random_allowed(),
            Strategy::WeightedRandom { cumulative } => {
                let total = *cumulative.last()?;
                for _ in 0..RANDOM_TRIES {
                    let bits = v.rng.next_u64();
                    let r = below(bits, total as usize) as u64;
                    let i = cumulative.partition_point(|&c| c <= r);
                    if !v.allowed(i) {
                        continue;
                    }
                    // Slow start by rejection: accept with probability ramp, so that the
                    // accepted picks are proportional to weight x ramp.
                    if v.slow_start.is_some() && unit_f64(mix64(bits)) >= v.ramp(i) {
                        continue;
                    }
                    return Some(i);
                }
                // Many endpoints refused: draw over the allowed ones only.
                let allowed_total: u64 = (0..n)
                    .filter(|&i| v.allowed(i))
                    .map(|i| v.weight_milli(i))
                    .sum();
                if allowed_total == 0 {
                    return None;
                }
                let mut r = below(v.rng.next_u64(), allowed_total as usize) as u64;
                for i in (0..n).filter(|&i| v.allowed(i)) {
                    let w = v.weight_milli(i);
                    if r < w {
                        return Some(i);
                    }
                    r -= w;
                }
                None
            }
            Strategy::LeastConnections { tie } => least_loaded(v, *tie),
            Strategy::LeastRequest { choices, line } => {
                let mut c = [0; MAX_CHOICES];
                let count = v.candidates(line, *choices, &mut c);
                let mut best = *c[..count].first()?;
                for &other in &c[1..count] {
                    if v.lighter(other, best).is_lt() {
                        best = other;
                    }
                }
                Some(best)
            }
            Strategy::LeastTime { tie, tolerance, .. } => least_time(v, *tie, *tolerance),
            Strategy::PeakEwma {
                choices,
                line,
                tolerance,
                decay_ns,
                default_rtt_ns,
                cluster,
                ..
            } => {
                // An endpoint without a sample (new, or back from an ejection) counts the
                // cluster's mean latency, so that it is neither starved (a high prior) nor
                // flooded (a zero prior).
                let prior = cluster.value().unwrap_or(*default_rtt_ns);
                // Cost: rtt x (1 + in_flight / weight), the expected time of one more call on
                // an endpoint that serves `weight` calls at once. Idle endpoints cost their rtt
                // whatever their weight: weights act through the candidate draw at low load and
                // through the queue term under load.
                let cost = |i: usize| {
                    let rtt = v.eps[i].latency.decayed(v.now, *decay_ns).unwrap_or(prior);
                    let queue = f64::from(v.eps[i].in_flight()) * 1000.0 / v.weight_milli(i) as f64;
                    (rtt, queue)
                };
                let mut c = [0; MAX_CHOICES];
                let count = v.candidates(line, *choices, &mut c);
                let mut best = *c[..count].first()?;
                let mut best_cost = cost(best);
                for &other in &c[1..count] {
                    let other_cost = cost(other);
                    if cheaper(other_cost, best_cost, *tolerance) {
                        best = other;
                        best_cost = other_cost;
                    }
                }
                Some(best)
            }
            Strategy::RingHash { ring, bound } => {
                let key = key.unwrap_or_else(|| v.rng.next_u64());
                let accept =
                    |i| v.allowed(i) && under_bound(v, i, *bound, group_load, total_weight);
                ring.find(key, n, accept).or_else(|| overflow(v, *bound))
            }
            Strategy::Maglev { table, bound } => {
                let key = key.unwrap_or_else(|| v.rng.next_u64());
                let accept =
                    |i| v.allowed(i) && under_bound(v, i, *bound, group_load, total_weight);
                table.find(key, accept).or_else(|| {
                    // The table's owner and its re-hashes are all refused: fall back to
                    // rendezvous over the allowed endpoints, which is still key-stable.
                    rendezvous(v, key, false, *bound, group_load, total_weight)
                        .or_else(|| overflow(v, *bound))
                })
            }
            Strategy::Rendezvous { uniform, bound } => {
                let key = key.unwrap_or_else(|| v.rng.next_u64());
                rendezvous(v, key, *uniform, *bound, group_load, total_weight)
                    .or_else(|| overflow(v, *bound))
            }
        }
    }

    /// Updates the strategy's latency estimate after a call.
    pub(crate) fn record(&self, e: &Endpoint, outcome: Outcome, latency_ns: u64, now: u64) {
        match self {
            Strategy::LeastTime { decay_ns, .. } => {
                // The source's rule: the average of observed response times, failures included.
                // That is exactly the trap of experiment E4 when failures are fast.
                e.latency.record(latency_ns as f64, now, *decay_ns, false);
            }
            Strategy::PeakEwma {
                decay_ns,
                penalty_ns,
                cluster,
                ..
            } => {
                let mut x = latency_ns as f64;
                if outcome == Outcome::Failure {
                    x = x.max(*penalty_ns);
                }
                e.latency.record(x, now, *decay_ns, true);
                cluster.record(x, now, *decay_ns, false);
            }
            _ => {}
        }
    }
}

/// Least-connections' scan: the fewest calls in flight per unit of weight. Ties go to a draw
/// in proportion to weight among the tied endpoints (weighted reservoir sampling), so that at
/// low load, where every endpoint is idle and all tie, the shares follow the weights; or, with
/// `lowest-index`, to the first.
fn least_loaded(v: &View<'_>, tie: TieBreak) -> Option<usize> {
    let mut best: Option<(usize, u128, u128)> = None;
    let mut tied_weight = 0u64;
    let mut bits = v.rng.next_u64();
    for i in 0..v.eps.len() {
        if !v.allowed(i) {
            continue;
        }
        let (load, weight) = (u128::from(v.eps[i].in_flight()), v.weight_milli(i));
        let Some((_, best_load, best_weight)) = best else {
            best = Some((i, load, u128::from(weight)));
            tied_weight = weight;
            continue;
        };
        // load / weight < best_load / best_weight, without division.
        let (mine, theirs) = (load * best_weight, best_load * u128::from(weight));
        if mine < theirs {
            best = Some((i, load, u128::from(weight)));
            tied_weight = weight;
        } else if mine == theirs && tie == TieBreak::Random {
            tied_weight += weight;
            bits = mix64(bits);
            if (below(bits, tied_weight as usize) as u64) < weight {
                best = Some((i, load, u128::from(weight)));
            }
        }
    }
    best.map(|b| b.0)
}

/// Least-time: the lowest latency estimate. With the random tie-break, every endpoint whose
/// estimate is within `tolerance` of the lowest counts as equally fast, and they share the
/// picks in proportion to weight (a weighted draw); an endpoint without a sample (new, or back
/// from an ejection) joins them, so that it gets its share until its first samples say how
/// fast it is. Anything slower gets nothing until the others slow down: that is least-time's
/// rule, sluggish by design.
fn least_time(v: &View<'_>, tie: TieBreak, tolerance: f64) -> Option<usize> {
    if tie == TieBreak::LowestIndex {
        // The lowest estimate, unsampled endpoints first, the first of equals.
        return v.min_by(tie, |i| v.eps[i].latency.value().unwrap_or(0.0));
    }
    let fastest = (0..v.eps.len())
        .filter(|&i| v.allowed(i))
        .filter_map(|i| v.eps[i].latency.value())
        .fold(f64::INFINITY, f64::min);
    let limit = fastest * (1.0 + tolerance);
    let mut chosen = None;
    let mut total = 0u64;
    let mut bits = v.rng.next_u64();
    for i in 0..v.eps.len() {
        if !v.allowed(i) || v.eps[i].latency.value().is_some_and(|x| x > limit) {
            continue;
        }
        let w = v.weight_milli(i);
        total += w;
        bits = mix64(bits);
        if (below(bits, total as usize) as u64) < w {
            chosen = Some(i);
        }
    }
    chosen
}

/// Peak-EWMA's comparison of two `(rtt, queue)` costs: is `a` cheaper than `b`? Rtts within
/// `tolerance` of each other count as equal, and then only the queues compare (exactly): the
/// read-side decay alone makes an endpoint that was used less recently look a little faster,
/// and without the tolerance that noise, not the weights, would decide between equally fast
/// idle endpoints.
#[inline]
fn cheaper(a: (f64, f64), b: (f64, f64), tolerance: f64) -> bool {
    let (lo, hi) = if a.0 < b.0 { (a.0, b.0) } else { (b.0, a.0) };
    if hi <= lo * (1.0 + tolerance) {
        a.1 < b.1
    } else {
        a.0 * (1.0 + a.1) < b.0 * (1.0 + b.1)
    }
}

/// Orders endpoints by calls in flight per unit of weight without division.
struct LoadKey<'a, 'b>(&'a View<'b>, usize);

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

/// Bounded loads: may endpoint `i` take one more call without going above
/// ceil(c x (total in flight + 1) x w_i / W)?
#[inline]
fn under_bound(v: &View<'_>, i: usize, bound: Option<f64>, group_load: u64, total_w: u64) -> bool {
    let Some(c) = bound else {
        return true;
    };
    let share = v.eps[i].weight() as f64 / total_w.max(1) as f64;
    let cap = (c * (group_load + 1) as f64 * share).ceil() as u64;
    (v.eps[i].in_flight() as u64) < cap.max(1)
}

fn rendezvous(
    v: &View<'_>,
    key: u64,
    uniform: bool,
    bound: Option<f64>,
    group_load: u64,
    total_w: u64,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for i in 0..v.eps.len() {
        if !v.allowed(i) || !under_bound(v, i, bound, group_load, total_w) {
            continue;
        }
        let e = &v.eps[i];
        let s = rendezvous_score(key, e.hash, e.weight(), uniform);
        if best.is_none_or(|b| s > b.1) {
            best = Some((i, s));
        }
    }
    best.map(|b| b.0)
}

/// Every allowed endpoint is at its bound (possible only when some are unavailable): take the
/// least loaded rather than fail the call.
fn overflow(v: &View<'_>, bound: Option<f64>) -> Option<usize> {
    bound?;
    v.min_by(TieBreak::LowestIndex, |i| LoadKey(v, i))
}
