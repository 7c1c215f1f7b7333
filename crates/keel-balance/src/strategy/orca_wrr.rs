//! `orca-wrr`: weighted round-robin on weights the endpoints' own ORCA reports give (gRFC A58,
//! gRPC's and Envoy's client-side weighted round-robin).
//!
//! An endpoint's weight is `qps / (utilization + eps / qps x error_utilization_penalty)`, with
//! utilization = `application_utilization` when above zero, else `cpu_utilization`; a report
//! with no qps or no utilization is ignored. As A58 specifies, a weight counts only after the
//! endpoint has reported for `blackout_period` (10 s: a fresh endpoint's first reports are
//! noisy), and expires `weight_expiration_period` (3 min) after its last report (the blackout
//! then starts over). Weights are recomputed every `weight_update_period` (1 s); endpoints
//! without a weight get the mean of the others', and every weight is kept within 0.1 to 2
//! times the **median** reported weight. (gRPC's scheduler keeps weights within 0.1 to 10 times
//! the mean; but the mean moves with the very report it bounds, so one endpoint reporting a
//! huge qps or a near-zero utilisation took 61 % of the picks. The median does not
//! move with one report: among N >= 3 endpoints reporting alike, one that lies gets at most
//! twice the others' weight, a share of at most 2 / (N + 1), under twice its fair share. With
//! two endpoints the upper median is the larger weight, and nothing tells the liar from a
//! truly faster endpoint: no bound. A zero utilisation is no report at all (A58), so it
//! leaves the weight as it was. The price: an endpoint truly more than twice the median's
//! capacity is held at twice.) Until any
//! endpoint has a weight, the configured weights are used (with the default weight 1 that is
//! A58's round-robin).
//!
//! Picks are earliest-deadline-first over those weights, as `weighted-round-robin`'s: exact
//! shares per cycle, O(log n) per pick under one short lock; the recomputation reuses its
//! buffer (no allocation per pick).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::api::{Call, Observation, Strategy, View};
use crate::config::StrategyOptions;
use crate::load::Utilization;
use crate::time::nanos;

/// Deadlines advance by `TURN / weight` (weights scaled to a mean of 1000).
const TURN: u64 = 1 << 40;

/// Weights are kept within these multiples of the median reported weight (gRPC's
/// `kMinRatio`; its `kMaxRatio` is 10 times the mean, which one report can move).
const MIN_RATIO: f64 = 0.1;
const MAX_RATIO: f64 = 2.0;

/// Turns passed over before a pick falls back to a draw over the allowed endpoints.
const EDF_TRIES: usize = 16;

/// One endpoint's weight and A58's two timestamps (nanoseconds; 0: never).
#[derive(Default)]
struct Reported {
    weight: AtomicU64,
    non_empty_since: AtomicU64,
    last_updated: AtomicU64,
}

struct Scheduler {
    heap: BinaryHeap<Reverse<(u64, u32)>>,
    /// The weights in force (scaled to a mean of 1000), one per endpoint.
    weights: Vec<f64>,
    /// When the weights are next recomputed.
    next_update: u64,
    /// Scratch for the median (kept: no allocation per recomputation).
    sorted: Vec<f64>,
}

pub(crate) struct OrcaWrr {
    blackout: u64,
    expiration: u64,
    update: u64,
    penalty: f64,
    reported: Vec<Reported>,
    sched: Mutex<Scheduler>,
}

impl OrcaWrr {
    pub(crate) fn new(o: &StrategyOptions, n: usize) -> Self {
        Self {
            blackout: nanos(o.blackout_period),
            expiration: nanos(o.weight_expiration_period),
            update: nanos(o.weight_update_period).max(1),
            penalty: o.error_utilization_penalty,
            reported: (0..n).map(|_| Reported::default()).collect(),
            sched: Mutex::new(Scheduler {
                heap: (0..n as u32).map(|i| Reverse((0, i))).collect(),
                weights: vec![0.0; n],
                next_update: 0,
                sorted: Vec::with_capacity(n),
            }),
        }
    }

    /// A58's weight of a report: `qps / (utilization + eps / qps x penalty)`, or `None` for a
    /// report that says nothing (no qps or no utilization).
    pub(crate) fn weight_of(u: &Utilization, penalty: f64) -> Option<f64> {
        let util = u.value();
        if !(u.qps > 0.0 && util > 0.0) {
            return None;
        }
        let w = u.qps / (util + u.eps / u.qps * penalty);
        (w.is_finite() && w > 0.0).then_some(w)
    }

    fn record(&self, i: usize, u: &Utilization, now: u64) {
        let (Some(r), Some(w)) = (self.reported.get(i), Self::weight_of(u, self.penalty)) else {
            return;
        };
        r.weight.store(w.to_bits(), Ordering::Relaxed);
        if r.non_empty_since.load(Ordering::Relaxed) == 0 {
            r.non_empty_since.store(now.max(1), Ordering::Relaxed);
        }
        r.last_updated.store(now.max(1), Ordering::Relaxed);
    }

    /// A58's weight lookup at `now`: 0 while blacked out or after expiry (which restarts the
    /// blackout).
    fn weight_at(&self, i: usize, now: u64) -> f64 {
        let r = &self.reported[i];
        let last = r.last_updated.load(Ordering::Relaxed);
        if last == 0 {
            return 0.0;
        }
        if now.saturating_sub(last) >= self.expiration {
            r.non_empty_since.store(0, Ordering::Relaxed);
            return 0.0;
        }
        let since = r.non_empty_since.load(Ordering::Relaxed);
        if since == 0 || (self.blackout > 0 && now.saturating_sub(since) < self.blackout) {
            return 0.0;
        }
        f64::from_bits(r.weight.load(Ordering::Relaxed))
    }

    /// Recomputes the scheduler's weights at `now` (in place).
    fn reweigh(&self, v: &View<'_>, s: &mut Scheduler) {
        let n = s.weights.len().min(v.eps.len());
        let mut count = 0usize;
        for i in 0..n {
            let w = self.weight_at(i, v.now);
            s.weights[i] = w;
            count += usize::from(w > 0.0);
        }
        if count == 0 {
            // Nothing reported yet: the configured weights.
            for i in 0..n {
                s.weights[i] = v.weight_milli(i) as f64;
            }
            let mean = s.weights[..n].iter().sum::<f64>() / n.max(1) as f64;
            for w in &mut s.weights[..n] {
                *w *= 1000.0 / mean.max(f64::MIN_POSITIVE);
            }
            return;
        }
        // The median of the reported weights (upper median), in a kept buffer: no allocation.
        s.sorted.clear();
        s.sorted
            .extend(s.weights[..n].iter().copied().filter(|w| *w > 0.0));
        let mid = s.sorted.len() / 2;
        let median = *s.sorted.select_nth_unstable_by(mid, f64::total_cmp).1;
        let (lo, hi) = (median * MIN_RATIO, median * MAX_RATIO);
        let (mut sum, mut count) = (0.0, 0usize);
        for w in &mut s.weights[..n] {
            if *w > 0.0 {
                *w = w.clamp(lo, hi);
                sum += *w;
                count += 1;
            }
        }
        let reported_mean = sum / count as f64;
        for w in &mut s.weights[..n] {
            if *w <= 0.0 {
                *w = reported_mean;
            }
        }
        let mean = s.weights[..n].iter().sum::<f64>() / n as f64;
        for w in &mut s.weights[..n] {
            *w *= 1000.0 / mean;
        }
    }

    #[cfg(test)]
    fn weights(&self, v: &View<'_>) -> Vec<f64> {
        let mut s = self.sched.lock().unwrap();
        self.reweigh(v, &mut s);
        s.weights.clone()
    }
}

impl Strategy for OrcaWrr {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        let mut guard = self.sched.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *guard;
        if v.now >= s.next_update {
            self.reweigh(v, s);
            s.next_update = v.now.saturating_add(self.update);
        }
        for _ in 0..EDF_TRIES {
            let mut top = s.heap.peek_mut()?;
            let Reverse((deadline, i)) = *top;
            let w = s.weights.get(i as usize).copied().unwrap_or(1000.0);
            let next = deadline.saturating_add((TURN as f64 / w.max(1e-9)) as u64);
            *top = Reverse((next, i));
            drop(top);
            if next >= 1 << 62 {
                let base = s.heap.peek().map_or(0, |Reverse((d, _))| *d);
                let moved: BinaryHeap<_> = s
                    .heap
                    .drain()
                    .map(|Reverse((d, j))| Reverse((d - base.min(d), j)))
                    .collect();
                s.heap = moved;
            }
            if (i as usize) < v.eps.len() && v.allowed(i as usize) {
                return Some(i as usize);
            }
        }
        super::random::weighted_scan(v)
    }

    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        if let Observation::Utilization(u) = what {
            self.record(i, u, v.now);
        }
    }

    fn uses_utilization(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::Bench;

    const S: u64 = 1_000_000_000;

    fn util(qps: f64, cpu: f64, app: f64, eps: f64) -> Utilization {
        Utilization {
            cpu,
            application: app,
            qps,
            eps,
        }
    }

    fn strategy(n: usize) -> OrcaWrr {
        OrcaWrr::new(&StrategyOptions::default(), n)
    }

    fn report(s: &OrcaWrr, b: &Bench, i: usize, u: Utilization, now: u64) {
        s.observe(&b.view(now), i, &Observation::Utilization(u));
    }

    #[test]
    fn weights_follow_a58s_formula() {
        let p = 1.0;
        // qps / (utilization + eps / qps x penalty), by hand.
        let cases = [
            (util(100.0, 0.5, 0.0, 0.0), Some(200.0)),
            (util(100.0, 0.5, 0.0, 10.0), Some(100.0 / 0.6)),
            // application_utilization wins when above zero.
            (util(100.0, 0.5, 0.25, 0.0), Some(400.0)),
            (util(0.0, 0.5, 0.0, 0.0), None),
            (util(10.0, 0.0, 0.0, 0.0), None),
        ];
        for (u, want) in cases {
            let got = OrcaWrr::weight_of(&u, p);
            match (got, want) {
                (Some(g), Some(w)) => assert!((g - w).abs() < 1e-9, "{u:?}: {g} vs {w}"),
                (g, w) => assert_eq!(g, w, "{u:?}"),
            }
        }
        // A penalty of 0 ignores errors.
        assert_eq!(
            OrcaWrr::weight_of(&util(100.0, 0.5, 0.0, 50.0), 0.0),
            Some(200.0)
        );
    }

    #[test]
    fn blackout_expiry_and_the_mean_for_silent_endpoints() {
        let b = Bench::new(&[1, 1, 1]);
        let s = strategy(3);
        let t0 = 5 * S;
        // Weights 100 and 300 (qps 100 and 300 at utilisation 1); endpoint 2 never reports.
        report(&s, &b, 0, util(100.0, 1.0, 0.0, 0.0), t0);
        report(&s, &b, 1, util(300.0, 1.0, 0.0, 0.0), t0);
        // Within the 10 s blackout: nothing counts, the configured (equal) weights.
        assert_eq!(s.weights(&b.view(t0 + 9 * S)), vec![1000.0; 3]);
        // After it: 100, 300 and the mean 200 for the silent one, scaled to a mean of 1000.
        let w = s.weights(&b.view(t0 + 10 * S));
        let want = [100.0, 300.0, 200.0].map(|x| x * 1000.0 / 200.0);
        for (g, w) in w.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{g} vs {w}");
        }
        // Endpoint 1 keeps reporting, endpoint 0 stops: 3 min after its last report its weight
        // expires (it gets the mean of the others: endpoint 1's 300).
        let late = t0 + 180 * S;
        report(&s, &b, 1, util(300.0, 1.0, 0.0, 0.0), late - S);
        let w = s.weights(&b.view(late));
        assert!(w.iter().all(|x| (x - 1000.0).abs() < 1e-9), "{w:?}");
        // Its next report starts a new blackout.
        report(&s, &b, 0, util(100.0, 1.0, 0.0, 0.0), late);
        let w = s.weights(&b.view(late + 5 * S));
        assert!(w.iter().all(|x| (x - 1000.0).abs() < 1e-9), "{w:?}");
        let w = s.weights(&b.view(late + 10 * S));
        assert!((w[0] / w[1] - 1.0 / 3.0).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn weights_are_kept_within_a_tenth_and_twice_the_median() {
        let b = Bench::new(&[1, 1, 1, 1]);
        let s = OrcaWrr::new(
            &StrategyOptions {
                blackout_period: std::time::Duration::ZERO,
                ..StrategyOptions::default()
            },
            4,
        );
        // Weights 1, 1000, 1000 and a liar's 1,000,000 (qps a thousand times its peers').
        report(&s, &b, 0, util(1.0, 1.0, 0.0, 0.0), S);
        report(&s, &b, 1, util(1000.0, 1.0, 0.0, 0.0), S);
        report(&s, &b, 2, util(1000.0, 1.0, 0.0, 0.0), S);
        report(&s, &b, 3, util(1e6, 1.0, 0.0, 0.0), S);
        let w = s.weights(&b.view(2 * S));
        // Median 1000: the low one raised to 100, the liar cut to 2000; scaled to a mean of
        // 1000 (the four sum to 4100).
        let want = [100.0, 1000.0, 1000.0, 2000.0].map(|x| x * 4000.0 / 4100.0);
        for (g, w) in w.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{g} vs {w}");
        }
    }

    /// One endpoint among ten reports what no peer does (a near-zero utilisation, or a huge
    /// qps): it gets at most twice its fair share of the picks (2 / 11 of them), where with
    /// the mean-based bound it got most of them.
    #[test]
    fn a_lying_report_gets_at_most_twice_the_fair_share() {
        let n = 10;
        for liar in [util(100.0, 1e-9, 0.0, 0.0), util(1e12, 0.5, 0.0, 0.0)] {
            let b = Bench::new(&[1; 10]);
            let s = strategy(n);
            for i in 0..n - 1 {
                report(&s, &b, i, util(100.0, 0.5, 0.0, 0.0), S);
            }
            report(&s, &b, n - 1, liar, S);
            let mut counts = vec![0usize; n];
            let picks = 110_000;
            for _ in 0..picks {
                counts[s.pick(&b.view(12 * S), Call::NONE).unwrap()] += 1;
            }
            let share = counts[n - 1] as f64 / picks as f64;
            assert!(share <= 2.0 / 11.0 + 0.002, "{liar:?}: {share} {counts:?}");
            assert!(share <= 2.0 / n as f64, "{liar:?}: {share}");
        }
    }

    #[test]
    fn picks_follow_the_weights() {
        // Weights 1 : 2 : 3 (qps 10, 20, 30 at utilisation 0.5): over 60,000 picks each share
        // within 0.002 of 1/6, 2/6, 3/6 (EDF is exact to a pick per cycle).
        let b = Bench::new(&[1, 1, 1]);
        let s = strategy(3);
        for (i, q) in [10.0, 20.0, 30.0].into_iter().enumerate() {
            report(&s, &b, i, util(q, 0.5, 0.0, 0.0), S);
        }
        let mut counts = [0usize; 3];
        let now = 12 * S;
        for _ in 0..60_000 {
            counts[s.pick(&b.view(now), Call::NONE).unwrap()] += 1;
        }
        for (c, w) in counts.iter().zip([1.0, 2.0, 3.0]) {
            assert!((*c as f64 / 60_000.0 - w / 6.0).abs() < 0.002, "{counts:?}");
        }
    }
}
