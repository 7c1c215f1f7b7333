//! The strategies' choice rules. Each reads endpoint state through a [`View`] that already knows
//! which endpoints are allowed for this pick (health, ejection, panic mode, retry avoidance).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::{StrategyKind, StrategyOptions, TieBreak};
use crate::endpoint::{nanos, Endpoint, EndpointId};
use crate::hash::{rendezvous_score, Maglev, Ring};
use crate::rng::{below, mix64, unit_f64, SharedRng};
use crate::slow_start::SlowStartConfig;
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

    #[inline]
    fn load(&self, i: usize) -> u64 {
        self.eps[i].in_flight() as u64 + 1
    }

    /// Compares the load per unit of weight of `a` with that of `b` (`Less`: `a` is lighter).
    #[inline]
    fn lighter(&self, a: usize, b: usize) -> std::cmp::Ordering {
        let la = self.load(a) as u128 * self.weight_milli(b) as u128;
        let lb = self.load(b) as u128 * self.weight_milli(a) as u128;
        la.cmp(&lb)
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

    /// A random allowed endpoint other than `not`, if there is one.
    fn random_other(&self, not: usize) -> Option<usize> {
        let n = self.eps.len();
        for _ in 0..RANDOM_TRIES {
            let i = self.rng.below(n);
            if i != not && self.allowed(i) {
                return Some(i);
            }
        }
        let count = (0..n).filter(|&i| i != not && self.allowed(i)).count();
        if count == 0 {
            return None;
        }
        let nth = self.rng.below(count);
        (0..n).filter(|&i| i != not && self.allowed(i)).nth(nth)
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
    },
    LeastTime {
        tie: TieBreak,
        decay_ns: f64,
    },
    PeakEwma {
        choices: u32,
        decay_ns: f64,
        default_rtt_ns: f64,
        penalty_ns: f64,
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
            StrategyKind::LeastRequest => Strategy::LeastRequest { choices: o.choices },
            StrategyKind::LeastTime => Strategy::LeastTime {
                tie: o.tie_break,
                decay_ns: nanos(o.decay) as f64,
            },
            StrategyKind::PeakEwma => Strategy::PeakEwma {
                choices: o.choices,
                decay_ns: nanos(o.decay) as f64,
                default_rtt_ns: nanos(o.default_rtt) as f64,
                penalty_ns: nanos(o.failure_penalty) as f64,
            },
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
            Strategy::LeastRequest { choices } => {
                let mut best = v.random_allowed()?;
                for _ in 1..*choices {
                    let Some(other) = v.random_other(best) else {
                        break;
                    };
                    if v.lighter(other, best).is_lt() {
                        best = other;
                    }
                }
                Some(best)
            }
            Strategy::LeastTime { tie, .. } => v.min_by(*tie, |i| {
                let e = &v.eps[i];
                if e.has_latency.load(Ordering::Relaxed) {
                    e.latency_ns()
                } else {
                    0.0
                }
            }),
            Strategy::PeakEwma {
                choices,
                decay_ns,
                default_rtt_ns,
                ..
            } => {
                let cost = |i: usize| {
                    let e = &v.eps[i];
                    let rtt = if e.has_latency.load(Ordering::Relaxed) {
                        decayed(e, v.now, *decay_ns)
                    } else {
                        *default_rtt_ns
                    };
                    rtt * (e.in_flight() as f64 + 1.0) / v.weight_milli(i) as f64
                };
                let mut best = v.random_allowed()?;
                let mut best_cost = cost(best);
                for _ in 1..*choices {
                    let Some(other) = v.random_other(best) else {
                        break;
                    };
                    let c = cost(other);
                    if c < best_cost {
                        best = other;
                        best_cost = c;
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
                let x = latency_ns as f64;
                if !e.has_latency.load(Ordering::Relaxed) {
                    e.set_latency_ns(x, now);
                } else {
                    let prev = e.latency_ns();
                    let dt = now.saturating_sub(e.latency_stamp.load(Ordering::Relaxed));
                    let w = (-(dt as f64) / decay_ns).exp();
                    e.set_latency_ns(prev * w + x * (1.0 - w), now);
                }
            }
            Strategy::PeakEwma {
                decay_ns,
                penalty_ns,
                ..
            } => {
                let mut x = latency_ns as f64;
                if outcome == Outcome::Failure {
                    x = x.max(*penalty_ns);
                }
                if !e.has_latency.load(Ordering::Relaxed) {
                    e.set_latency_ns(x, now);
                    return;
                }
                let dt = now.saturating_sub(e.latency_stamp.load(Ordering::Relaxed));
                let w = (-(dt as f64) / decay_ns).exp();
                let current = e.latency_ns() * w;
                let next = if x > current {
                    x
                } else {
                    current + x * (1.0 - w)
                };
                e.set_latency_ns(next, now);
            }
            _ => {}
        }
    }
}

/// Least-connections' scan: the smallest (in flight + 1) / weight, each endpoint's atomics read
/// once, ties broken as told (reservoir sampling for random ties).
fn least_loaded(v: &View<'_>, tie: TieBreak) -> Option<usize> {
    let mut best: Option<(usize, u128, u128)> = None;
    let mut ties = 0u64;
    let mut bits = 0u64;
    for i in 0..v.eps.len() {
        if !v.allowed(i) {
            continue;
        }
        let (load, weight) = (v.load(i) as u128, v.weight_milli(i) as u128);
        let Some((_, best_load, best_weight)) = best else {
            best = Some((i, load, weight));
            ties = 1;
            continue;
        };
        // load / weight < best_load / best_weight, without division.
        let (mine, theirs) = (load * best_weight, best_load * weight);
        if mine < theirs {
            best = Some((i, load, weight));
            ties = 1;
        } else if mine == theirs && tie == TieBreak::Random {
            ties += 1;
            bits = if ties == 2 {
                v.rng.next_u64()
            } else {
                mix64(bits)
            };
            if below(bits, ties as usize) == 0 {
                best = Some((i, load, weight));
            }
        }
    }
    best.map(|b| b.0)
}

/// The peak-EWMA estimate decayed to `now` (read-only: an endpoint that gets no traffic slowly
/// looks cheaper again, so it is probed after a while).
#[inline]
fn decayed(e: &Endpoint, now: u64, decay_ns: f64) -> f64 {
    let dt = now.saturating_sub(e.latency_stamp.load(Ordering::Relaxed));
    e.latency_ns() * (-(dt as f64) / decay_ns).exp()
}

/// Orders endpoints by (in flight + 1) / weight without division.
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
