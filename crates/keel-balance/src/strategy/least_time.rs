//! Least-time: the source's "minimum response time", the lowest latency estimate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::api::{Call, Observation, Strategy, View, RANDOM_TRIES};
use crate::config::{StrategyOptions, TieBreak};
use crate::endpoint::Endpoint;
use crate::rng::{below, mix64};
use crate::time::nanos;

/// The lowest EWMA of observed response times. With the random tie-break, every endpoint whose
/// estimate is within `tolerance` of the lowest counts as equally fast, and they share the picks
/// in proportion to weight; an endpoint without a sample (new, or back from an ejection) joins
/// them, so that it gets its share until its first samples say how fast it is. Anything slower
/// gets nothing until the others slow down or its estimate, decayed with the time since its
/// last sample, comes within the tolerance: that is least-time's rule, sluggish by design (a
/// slow endpoint is tried again after about `decay x ln(its estimate / 1.5 x the fastest)`).
///
/// The endpoints are kept sorted into [`Bands`] of latency (64 per octave, so an estimate is
/// known to within 1.6 %), with the weight of each band in a Fenwick tree: a pick finds the
/// fastest band, the last band within the tolerance, and draws by weight among them in
/// O(log bands), whatever the number of endpoints. The tolerance is applied from the top of the
/// fastest band, so the set is the exact rule's plus at most one band (1.6 % slower). In
/// panic mode, on a retry that avoids most of the fast set, and with `lowest-index`, a pick
/// scans every endpoint.
pub(crate) struct LeastTime {
    tie: TieBreak,
    decay_ns: f64,
    tolerance: f64,
    bands: Mutex<Bands>,
    sweep: AtomicUsize,
}

impl LeastTime {
    pub(crate) fn new(o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        Self {
            tie: o.tie_break,
            decay_ns: nanos(o.decay) as f64,
            tolerance: o.latency_tolerance,
            bands: Mutex::new(Bands::new(eps)),
            sweep: AtomicUsize::new(0),
        }
    }

    fn bands(&self) -> std::sync::MutexGuard<'_, Bands> {
        self.bands.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Endpoint i's estimate decayed to now: one that no call refreshes looks faster as time
    /// passes (by e^(-age / decay), as peak-EWMA's), so an endpoint shut out by a few slow
    /// samples (a slow first call, a passing hiccup) is tried again after a while instead of
    /// never; endpoints in use are refreshed by every call and barely decay.
    #[inline]
    fn estimate(&self, v: &View<'_>, i: usize) -> Option<f64> {
        v.eps[i].latency().decayed(v.now, self.decay_ns)
    }

    /// Endpoint i's band now.
    #[inline]
    fn band_now(&self, v: &View<'_>, i: usize) -> usize {
        if !v.eps[i].is_available(v.now) {
            return OUT;
        }
        self.estimate(v, i).map_or(0, band_of)
    }

    /// The exact rule by a scan of every endpoint.
    fn scan(&self, v: &View<'_>) -> Option<usize> {
        if self.tie == TieBreak::LowestIndex {
            // The lowest estimate, unsampled endpoints first, the first of equals.
            return v.min_by(self.tie, |i| v.eps[i].latency().value().unwrap_or(0.0));
        }
        let fastest = (0..v.eps.len())
            .filter(|&i| v.allowed(i))
            .filter_map(|i| self.estimate(v, i))
            .fold(f64::INFINITY, f64::min);
        let limit = fastest * (1.0 + self.tolerance);
        let mut chosen = None;
        let mut total = 0u64;
        let mut bits = v.rng.next_u64();
        for i in 0..v.eps.len() {
            if !v.allowed(i) || self.estimate(v, i).is_some_and(|x| x > limit) {
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
}

impl Strategy for LeastTime {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        if self.tie == TieBreak::LowestIndex || v.ignore_health || v.eps.is_empty() {
            return self.scan(v);
        }
        let mut bands = self.bands();
        if !bands.filled {
            bands.fill(|i| self.band_now(v, i));
        }
        let sweep = self.sweep.fetch_add(1, Ordering::Relaxed) % v.eps.len();
        bands.place(sweep, self.band_now(v, sweep));
        let mut bits = v.rng.next_u64();
        if let Some(last) = bands.last_band(self.tolerance) {
            for _ in 0..RANDOM_TRIES {
                bits = mix64(bits);
                let i = bands.draw(last, bits);
                bits = mix64(bits);
                if v.allowed(i) && v.ramp_accepts(i, bits) {
                    return Some(i);
                }
            }
        }
        drop(bands);
        self.scan(v)
    }

    fn follows_calls(&self) -> bool {
        true
    }

    fn half_open(&self) -> bool {
        true
    }

    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        let Observation::CallEnded { latency_ns, .. } = *what else {
            return;
        };
        // The source's rule: the average of observed response times, failures included. That
        // is exactly the trap of experiment E4 when failures are fast.
        v.eps[i]
            .latency()
            .record(latency_ns as f64, v.now, self.decay_ns, false);
        self.bands().place(i, self.band_now(v, i));
    }

    fn refresh(&self, v: &View<'_>, which: Option<usize>) {
        let mut bands = self.bands();
        match which {
            Some(i) => bands.place(i, self.band_now(v, i)),
            None => bands.fill(|i| self.band_now(v, i)),
        }
    }
}

/// Sampled latencies span bands 1..=SAMPLED (1 ns to 2^44 ns, about 4.9 hours, 64 bands per
/// octave); band 0 holds the endpoints without a sample, band OUT the unavailable ones.
const SAMPLED: usize = 44 << 6;
const OUT: usize = SAMPLED + 1;

/// The band of a latency: the exponent and the 6 highest mantissa bits of the float, a
/// piecewise-linear log2 with 64 steps per octave (monotone, no logarithm computed).
#[inline]
fn band_of(ns: f64) -> usize {
    let x = ns.clamp(1.0, ((1u64 << 44) - 1) as f64);
    ((x.to_bits() >> 46) - (1023 << 6)) as usize + 1
}

/// The least latency of the band after `b` (the top of band `b`).
#[inline]
fn band_top(b: usize) -> f64 {
    f64::from_bits(((b as u64) + (1023 << 6)) << 46)
}

/// The endpoints sorted by band, each band's weight in a Fenwick tree.
pub(crate) struct Bands {
    /// Endpoint indices, band by band: band b is `order[start[b]..start[b + 1]]`.
    order: Vec<u32>,
    start: Vec<u32>,
    /// Endpoint i is at `order[pos[i]]`, in band `band[i]`.
    pos: Vec<u32>,
    band: Vec<u16>,
    /// Configured weights when built (an update builds a new strategy).
    weight: Vec<u32>,
    max_weight: u32,
    /// Sum of the weights per band, bands 0..=SAMPLED (OUT is never drawn).
    fenwick: Fenwick,
    filled: bool,
}

impl Bands {
    fn new(eps: &[Arc<Endpoint>]) -> Self {
        let weight: Vec<u32> = eps.iter().map(|e| e.weight()).collect();
        Self {
            order: (0..eps.len() as u32).collect(),
            start: vec![0; OUT + 2],
            pos: (0..eps.len() as u32).collect(),
            band: vec![0; eps.len()],
            max_weight: weight.iter().copied().max().unwrap_or(1),
            weight,
            fenwick: Fenwick::new(SAMPLED + 1),
            filled: false,
        }
    }

    /// Every endpoint placed from scratch (a counting sort): O(n + bands).
    fn fill(&mut self, band_now: impl Fn(usize) -> usize) {
        let n = self.band.len();
        let mut counts = vec![0u32; OUT + 2];
        for i in 0..n {
            let b = band_now(i);
            self.band[i] = b as u16;
            counts[b + 1] += 1;
        }
        for b in 1..counts.len() {
            counts[b] += counts[b - 1];
        }
        self.start.copy_from_slice(&counts);
        let mut next = counts;
        let mut sums = vec![0u64; SAMPLED + 1];
        for i in 0..n {
            let b = usize::from(self.band[i]);
            let p = next[b] as usize;
            next[b] += 1;
            self.order[p] = i as u32;
            self.pos[i] = p as u32;
            if b != OUT {
                sums[b] += u64::from(self.weight[i]);
            }
        }
        self.fenwick = Fenwick::from_values(&sums);
        self.filled = true;
    }

    /// Moves endpoint i to band `to`: one swap per band boundary crossed, no allocation.
    fn place(&mut self, i: usize, to: usize) {
        let from = usize::from(self.band[i]);
        if from == to || !self.filled {
            return;
        }
        let w = u64::from(self.weight[i]);
        if from != OUT {
            self.fenwick.add(from, -(w as i64));
        }
        if to != OUT {
            self.fenwick.add(to, w as i64);
        }
        let mut b = from;
        while b < to {
            // Swap with the last of band b, then band b + 1 starts one earlier.
            let last = self.start[b + 1] as usize - 1;
            self.swap(self.pos[i] as usize, last);
            self.start[b + 1] -= 1;
            b += 1;
        }
        while b > to {
            // Swap with the first of band b, then band b starts one later.
            let first = self.start[b] as usize;
            self.swap(self.pos[i] as usize, first);
            self.start[b] += 1;
            b -= 1;
        }
        self.band[i] = to as u16;
    }

    fn swap(&mut self, p: usize, q: usize) {
        self.order.swap(p, q);
        self.pos[self.order[p] as usize] = p as u32;
        self.pos[self.order[q] as usize] = q as u32;
    }

    /// The last band of the fast set: the bands up to the fastest sampled one's top times
    /// (1 + tolerance), or band 0 alone when no endpoint has a sample. `None` if every endpoint
    /// is out.
    fn last_band(&self, tolerance: f64) -> Option<usize> {
        let unsampled = self.fenwick.prefix(0);
        let total = self.fenwick.total();
        if total == 0 {
            return None;
        }
        if total == unsampled {
            return Some(0);
        }
        let fastest = self.fenwick.find(unsampled);
        Some(band_of(band_top(fastest) * (1.0 + tolerance)).min(SAMPLED))
    }

    /// An endpoint of bands 0..=last drawn in proportion to weight: a band by its weight, then
    /// a member of it by rejection (uniform, accepted with probability weight / largest weight;
    /// after 64 refusals the last one drawn, so weights more than about 20x apart within one
    /// band are drawn slightly flatter than they are).
    fn draw(&self, last: usize, bits: u64) -> usize {
        let within = self.fenwick.prefix(last);
        let b = self.fenwick.find(below(bits, within as usize) as u64);
        let (lo, hi) = (self.start[b] as usize, self.start[b + 1] as usize);
        let mut bits = mix64(bits);
        let mut i = self.order[lo] as usize;
        for _ in 0..64 {
            i = self.order[lo + below(bits, hi - lo)] as usize;
            bits = mix64(bits);
            let w = self.weight[i];
            if w == self.max_weight || below(bits, self.max_weight as usize) < w as usize {
                break;
            }
            bits = mix64(bits);
        }
        i
    }
}

/// A Fenwick (binary indexed) tree of weights: prefix sums and the search for a point, each in
/// O(log n).
pub(crate) struct Fenwick {
    /// 1-based: `tree[k]` sums the `k & -k` values ending at k.
    tree: Vec<u64>,
    /// The largest power of two up to `n`.
    top: usize,
}

impl Fenwick {
    fn new(n: usize) -> Self {
        Self::from_values(&vec![0; n])
    }

    /// Built in O(n).
    fn from_values(values: &[u64]) -> Self {
        let n = values.len();
        let mut tree = vec![0u64; n + 1];
        tree[1..].copy_from_slice(values);
        for k in 1..=n {
            let parent = k + (k & k.wrapping_neg());
            if parent <= n {
                tree[parent] += tree[k];
            }
        }
        let top = if n == 0 { 0 } else { 1 << n.ilog2() };
        Self { tree, top }
    }

    fn add(&mut self, index: usize, delta: i64) {
        let mut k = index + 1;
        while k < self.tree.len() {
            self.tree[k] = self.tree[k].wrapping_add_signed(delta);
            k += k & k.wrapping_neg();
        }
    }

    /// Sum of the values 0..=index.
    fn prefix(&self, index: usize) -> u64 {
        let mut k = index + 1;
        let mut sum = 0;
        while k > 0 {
            sum += self.tree[k];
            k &= k - 1;
        }
        sum
    }

    fn total(&self) -> u64 {
        self.prefix(self.tree.len() - 2)
    }

    /// The first index whose prefix sum exceeds `point` (`point` below the total).
    fn find(&self, mut point: u64) -> usize {
        let mut k = 0;
        let mut step = self.top;
        while step > 0 {
            let next = k + step;
            if next < self.tree.len() && self.tree[next] <= point {
                k = next;
                point -= self.tree[next];
            }
            step /= 2;
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    fn options(tie: TieBreak) -> StrategyOptions {
        StrategyOptions {
            tie_break: tie,
            ..StrategyOptions::default()
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn equally_fast_endpoints_share_by_weight() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random), &b.eps);
        assert_shares(&b.sequential(&s, 30_000, 10 * MS), &[2, 1, 1, 1, 1], 0.015);
    }

    #[test]
    fn the_fastest_takes_everything_even_when_it_fails_fast() {
        let b = Bench::new(&[1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random), &b.eps);
        // Teach it: 0 takes 30 ms, 1 takes 10 ms, 2 fails in 1 ms.
        let mut now = 0;
        for _ in 0..30 {
            let i = b.start(&s, now);
            let (lat, ok) = [(30, true), (10, true), (1, false)][i];
            b.end(&s, i, now + lat * MS, lat * MS, ok);
            now += 50 * MS;
        }
        let mut counts = [0; 3];
        for _ in 0..100 {
            let i = b.start(&s, now);
            counts[i] += 1;
            let (lat, ok) = [(30, true), (10, true), (1, false)][i];
            b.end(&s, i, now + lat * MS, lat * MS, ok);
            now += 50 * MS;
        }
        assert_eq!(counts, [0, 0, 100]);
    }

    #[test]
    fn an_endpoint_without_a_sample_gets_its_share() {
        let b = Bench::new(&[1, 1, 1, 1]);
        let s = LeastTime::new(&options(TieBreak::Random), &b.eps);
        b.sequential(&s, 1_000, 10 * MS);
        // Back from an ejection: no estimate, and still its share.
        b.eps[3].eject(1);
        s.refresh(&b.view(2), Some(3));
        assert_eq!(b.eps[3].latency_estimate(), None);
        assert_shares(&b.sequential(&s, 20_000, 10 * MS), &[1, 1, 1, 1], 0.02);
    }

    #[test]
    fn bands_are_monotone_and_64_to_the_octave() {
        let mut last = 0;
        let mut x = 1.0f64;
        while x < 1e13 {
            let b = band_of(x);
            assert!(b >= last && b <= SAMPLED, "{x}");
            assert!(
                band_top(b) > x && band_top(b) <= x * (1.0 + 1.0 / 32.0),
                "{x}"
            );
            last = b;
            x *= 1.003;
        }
        assert_eq!(band_of(2.0) - band_of(1.0), 64);
        assert_eq!(band_of(0.0), 1);
        assert_eq!(band_of(f64::INFINITY), SAMPLED);
    }

    #[test]
    fn the_fenwick_tree_finds_every_point_of_its_line() {
        let values = [3u64, 0, 0, 5, 1, 0, 2, 7, 0, 0, 4];
        let mut f = Fenwick::from_values(&values);
        let mut x = 0;
        for (i, &v) in values.iter().enumerate() {
            for _ in 0..v {
                assert_eq!(f.find(x), i);
                x += 1;
            }
            assert_eq!(f.prefix(i), x);
        }
        assert_eq!(f.total(), x);
        f.add(1, 2);
        f.add(3, -5);
        assert_eq!((f.find(3), f.find(4), f.find(5)), (1, 1, 4));
    }

    #[test]
    fn the_bands_pick_what_the_scan_would() {
        // 200 endpoints of weights 1-3 and latencies spread over two octaves (changing as
        // calls end): every pick is within the tolerance of the fastest (plus one band), and
        // the fast set's shares follow the weights.
        let weights: Vec<u32> = (0..200).map(|i| 1 + i % 3).collect();
        let b = Bench::new(&weights);
        let s = LeastTime::new(&options(TieBreak::Random), &b.eps);
        let latency = |i: usize| (5 + (i * 7919) % 15) as u64 * MS;
        let mut now = 0;
        for i in 0..200 {
            b.eps[i].begin_call();
            b.end(&s, i, now, latency(i), true);
            now += 1_000;
        }
        let fastest = (0..200).map(latency).min().unwrap() as f64;
        let mut counts = vec![0usize; 200];
        for _ in 0..40_000 {
            let i = b.start(&s, now);
            counts[i] += 1;
            let est = b.eps[i].latency_estimate().unwrap().as_nanos() as f64;
            assert!(
                est <= fastest * 1.5 * (1.0 + 1.0 / 32.0),
                "{est} vs {fastest}"
            );
            // Each call takes its endpoint's latency: estimates stay put.
            b.end(&s, i, now, latency(i), true);
            now += 1_000;
        }
        let fast: Vec<usize> = (0..200)
            .filter(|&i| (latency(i) as f64) <= fastest * 1.5)
            .collect();
        let total: u32 = fast.iter().map(|&i| weights[i]).sum();
        for &i in &fast {
            let want = 40_000.0 * f64::from(weights[i]) / f64::from(total);
            assert!(
                (counts[i] as f64 - want).abs() < 5.0 * want.sqrt() + 5.0,
                "{i}: {} vs {want}",
                counts[i]
            );
        }
    }
}

#[cfg(test)]
mod half_open_tests {
    use std::time::Duration;

    use crate::{Balancer, BalancerConfig, EndpointSpec, Outcome, PickContext, StrategyKind};

    /// A hung endpoint re-admitted by least-time took a whole timeout's worth of
    /// picks. Now an endpoint whose last call failed takes one call at a time until one
    /// succeeds, for least-time, peak-EWMA and prequal; least-request is not affected.
    #[test]
    fn an_endpoint_whose_last_call_failed_gets_one_call_at_a_time_until_one_succeeds() {
        let ms = Duration::from_millis;
        for kind in [
            StrategyKind::LeastTime,
            StrategyKind::PeakEwma,
            StrategyKind::Prequal,
        ] {
            let specs = [EndpointSpec::new("a")];
            let lb = Balancer::new(BalancerConfig::new(kind), &specs).unwrap();
            let p = lb.pick(&PickContext::new(ms(1))).unwrap();
            lb.finish(p, Outcome::Failure, ms(2));
            // On trial: its one trial call is in flight; a second pick still gets it (no other
            // endpoint), and with two endpoints the other one takes the calls meanwhile.
            let trial = lb.pick(&PickContext::new(ms(3))).unwrap();
            let again = lb.pick(&PickContext::new(ms(3))).unwrap();
            assert_eq!(again.index(), 0, "{kind}: alone, it is still picked");
            drop(again);
            lb.finish(trial, Outcome::Success, ms(4));
            let specs = [EndpointSpec::new("a"), EndpointSpec::new("b")];
            let lb = Balancer::new(BalancerConfig::new(kind), &specs).unwrap();
            // Make "a" look best (fast successes), then fail it.
            for t in 1..20 {
                let p = lb.pick(&PickContext::new(ms(t))).unwrap();
                lb.finish(p, Outcome::Success, ms(t));
            }
            let a = lb.endpoints()[0].id();
            let p = lb
                .pick(&PickContext::new(ms(20)).with_avoid(&[lb.endpoints()[1].id()]))
                .unwrap();
            assert_eq!(p.id(), a);
            lb.finish(p, Outcome::Failure, ms(21));
            let trial = lb
                .pick(&PickContext::new(ms(22)).with_avoid(&[lb.endpoints()[1].id()]))
                .unwrap();
            assert_eq!(trial.id(), a);
            // Its trial in flight: 50 picks go to "b".
            let mut held = Vec::new();
            for _ in 0..50 {
                let p = lb.pick(&PickContext::new(ms(22))).unwrap();
                assert_ne!(p.id(), a, "{kind}: a second call during the trial");
                held.push(p);
            }
            drop(held);
            // The trial succeeds: "a" takes calls in parallel again.
            lb.finish(trial, Outcome::Success, ms(23));
            let p1 = lb
                .pick(&PickContext::new(ms(24)).with_avoid(&[lb.endpoints()[1].id()]))
                .unwrap();
            let p2 = lb
                .pick(&PickContext::new(ms(24)).with_avoid(&[lb.endpoints()[1].id()]))
                .unwrap();
            assert_eq!((p1.id(), p2.id()), (a, a), "{kind}");
        }
        // least-request does not shut out on an estimate: no trial.
        let specs = [EndpointSpec::new("a"), EndpointSpec::new("b")];
        let lb = Balancer::new(BalancerConfig::new(StrategyKind::LeastRequest), &specs).unwrap();
        let b = lb.endpoints()[1].id();
        let p = lb.pick(&PickContext::new(ms(1)).with_avoid(&[b])).unwrap();
        lb.finish(p, Outcome::Failure, ms(2));
        let _held = lb.pick(&PickContext::new(ms(3)).with_avoid(&[b])).unwrap();
        let p = lb.pick(&PickContext::new(ms(3)).with_avoid(&[b])).unwrap();
        assert_eq!(p.index(), 0);
    }
}
