//! Least-connections: the fewest calls in flight per unit of weight, kept in a tournament tree
//! so that a pick costs O(log n) instead of a scan (HAProxy keeps leastconn in a tree too).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::api::{Call, LoadKey, Observation, Strategy, View};
use crate::config::TieBreak;
use crate::endpoint::Endpoint;

/// Fewest calls in flight per unit of weight, `in_flight / weight`. Idle endpoints tie whatever
/// their weight, and ties go to a draw in proportion to weight among the least loaded (nginx
/// breaks them by weighted round-robin): at low load, where every endpoint is idle, the shares
/// are the weights'. With `lowest-index`, ties go to the first (only to reproduce experiment
/// E5: at low concurrency nearly everything goes to one endpoint).
///
/// The loads live in a [`LoadTree`]: each call's start and end updates its endpoint's leaf,
/// and ejections and health changes its availability. What the tree cannot hear of (a pick
/// dropped without `finish`, a slow-start weight growing, a call finished on another balancer
/// after a reload) is corrected by a sweep that re-reads one endpoint every [`SWEEP_EVERY`]
/// picks: a leaf is never stale for more than 8n picks (reading an endpoint at every pick would
/// cost one more cache miss per pick in a large cluster). In panic mode (health ignored) a pick
/// scans every endpoint.
pub(crate) struct LeastConnections {
    tie: TieBreak,
    tree: Mutex<LoadTree>,
    sweep: AtomicUsize,
}

/// Picks between two re-reads of an endpoint by the sweep.
pub(crate) const SWEEP_EVERY: usize = 8;

impl LeastConnections {
    pub(crate) fn new(tie: TieBreak, eps: &[Arc<Endpoint>]) -> Self {
        Self {
            tie,
            tree: Mutex::new(LoadTree::new(eps.len())),
            sweep: AtomicUsize::new(0),
        }
    }

    fn tree(&self) -> std::sync::MutexGuard<'_, LoadTree> {
        self.tree.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A leaf's key for endpoint `i`: its load, or infinity when it may not be picked.
fn leaf(v: &View<'_>, i: usize, extra: u32) -> Leaf {
    let e = &v.eps[i];
    if !e.is_available(v.now) {
        return Leaf::EXCLUDED;
    }
    let weight = v.weight_milli(i);
    Leaf {
        load: f64::from(e.in_flight() + extra) / weight as f64,
        tied: weight,
    }
}

impl Strategy for LeastConnections {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        if v.ignore_health || v.eps.is_empty() {
            return v.min_by(self.tie, |i| LoadKey(v, i));
        }
        let bits = v.rng.next_u64();
        let mut tree = self.tree();
        if !tree.filled {
            // First pick: every leaf from the endpoints' state.
            tree.fill(v);
        }
        let turn = self.sweep.fetch_add(1, Ordering::Relaxed);
        if turn.is_multiple_of(SWEEP_EVERY) {
            let i = (turn / SWEEP_EVERY) % v.eps.len();
            tree.set(i, leaf(v, i, 0));
        }
        // A retry's avoided endpoints leave the tree for this pick only.
        for id in v.avoid {
            if let Some(i) = v.eps.iter().position(|e| e.id() == *id) {
                tree.set(i, Leaf::EXCLUDED);
            }
        }
        let mut chosen = tree.least(self.tie, bits);
        for id in v.avoid {
            if let Some(i) = v.eps.iter().position(|e| e.id() == *id) {
                tree.set(i, leaf(v, i, 0));
            }
        }
        if let Some(i) = chosen {
            if !v.allowed(i) {
                // The tree was stale about this one (ejected by another balancer sharing it).
                tree.set(i, leaf(v, i, 0));
                drop(tree);
                chosen = v.min_by(self.tie, |i| LoadKey(v, i));
            } else {
                // The balancer counts the call in flight right after this: the leaf says so
                // now, which saves `started` a second lock.
                tree.set(i, leaf(v, i, 1));
            }
        }
        chosen
    }

    fn follows_calls(&self) -> bool {
        true
    }

    fn observe(&self, v: &View<'_>, i: usize, _what: &Observation) {
        self.tree().set(i, leaf(v, i, 0));
    }

    fn refresh(&self, v: &View<'_>, which: Option<usize>) {
        let mut tree = self.tree();
        match which {
            Some(i) => tree.set(i, leaf(v, i, 0)),
            None => tree.fill(v),
        }
    }
}

/// One leaf or node of the tree: the least load below it, and the total weight of the
/// endpoints below it that have that load (the tie-break's draw).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Leaf {
    /// Calls in flight per thousandth of weight; infinity: not pickable.
    load: f64,
    tied: u64,
}

impl Leaf {
    const EXCLUDED: Leaf = Leaf {
        load: f64::INFINITY,
        tied: 0,
    };

    /// The node above `l` and `r`. Loads are quotients of small integers, so equal loads are
    /// equal floats (a division is correctly rounded) and ties are exact.
    #[inline]
    fn join(l: Leaf, r: Leaf) -> Leaf {
        if l.load < r.load {
            l
        } else if r.load < l.load {
            r
        } else {
            Leaf {
                load: l.load,
                tied: l.tied + r.tied,
            }
        }
    }
}

/// A complete binary tree over the endpoints whose every node holds the least load below it:
/// a change is O(log n), the least loaded is at the root, and a descent finds one of them in
/// proportion to weight in O(log n).
pub(crate) struct LoadTree {
    /// Leaves at `size..2 * size`, node k's children at 2k and 2k + 1, the root at 1.
    nodes: Vec<Leaf>,
    size: usize,
    /// False until the leaves were first read from the endpoints (at the first pick: reading
    /// them needs the time).
    filled: bool,
}

impl LoadTree {
    fn new(n: usize) -> Self {
        let size = n.max(1).next_power_of_two();
        Self {
            nodes: vec![Leaf::EXCLUDED; 2 * size],
            size,
            filled: false,
        }
    }

    /// Every leaf from the endpoints' state, then every node: O(n).
    fn fill(&mut self, v: &View<'_>) {
        for i in 0..v.eps.len() {
            self.nodes[self.size + i] = leaf(v, i, 0);
        }
        self.filled = true;
        for k in (1..self.size).rev() {
            self.nodes[k] = Leaf::join(self.nodes[2 * k], self.nodes[2 * k + 1]);
        }
    }

    /// Sets a leaf and the nodes above it.
    fn set(&mut self, i: usize, leaf: Leaf) {
        let mut k = self.size + i;
        if self.nodes[k] == leaf {
            return;
        }
        self.nodes[k] = leaf;
        while k > 1 {
            k /= 2;
            let joined = Leaf::join(self.nodes[2 * k], self.nodes[2 * k + 1]);
            if self.nodes[k] == joined {
                break;
            }
            self.nodes[k] = joined;
        }
    }

    /// One of the least loaded: in proportion to weight among them (`Random`), or the first.
    fn least(&self, tie: TieBreak, bits: u64) -> Option<usize> {
        let root = self.nodes[1];
        if root.load.is_infinite() {
            return None;
        }
        // A point on the line of the tied weights; each step keeps it inside the chosen child.
        let mut point = crate::rng::below(bits, root.tied as usize) as u64;
        let mut k = 1;
        while k < self.size {
            let (l, r) = (self.nodes[2 * k], self.nodes[2 * k + 1]);
            k = if l.load < r.load {
                2 * k
            } else if r.load < l.load {
                2 * k + 1
            } else if tie == TieBreak::LowestIndex || point < l.tied {
                2 * k
            } else {
                point -= l.tied;
                2 * k + 1
            };
        }
        Some(k - self.size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    #[test]
    fn idle_endpoints_share_by_weight() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = LeastConnections::new(TieBreak::Random, &b.eps);
        // 60,000 picks: sd of a share under 0.002.
        assert_shares(&b.sequential(&s, 60_000, 1_000), &[2, 1, 1, 1, 1], 0.01);
    }

    #[test]
    fn lowest_index_gives_every_tie_to_the_first() {
        let b = Bench::new(&[1, 2, 1]);
        let s = LeastConnections::new(TieBreak::LowestIndex, &b.eps);
        assert_eq!(b.sequential(&s, 100, 1_000), [100, 0, 0]);
    }

    #[test]
    fn under_load_calls_in_flight_follow_weights() {
        let b = Bench::new(&[3, 1]);
        let s = LeastConnections::new(TieBreak::Random, &b.eps);
        for _ in 0..400 {
            b.start(&s, 0);
        }
        let loads: Vec<u32> = b.eps.iter().map(|e| e.in_flight()).collect();
        assert_eq!(loads, [300, 100]);
        // The least loaded per unit of weight takes the next call, whatever its index.
        b.end(&s, 0, 1, 10, true);
        b.end(&s, 0, 1, 10, true);
        assert_eq!(b.start(&s, 2), 0);
    }

    #[test]
    fn the_tree_always_picks_what_a_scan_would() {
        // 37 endpoints (a tree with empty leaves), random starts and ends: every pick's load
        // per unit of weight is the least of all.
        let weights: Vec<u32> = (0..37).map(|i| 1 + i % 4).collect();
        let b = Bench::new(&weights);
        let s = LeastConnections::new(TieBreak::Random, &b.eps);
        let mut open: Vec<usize> = Vec::new();
        let mut bits = 99u64;
        for step in 0..5_000u64 {
            bits = crate::rng::mix64(bits);
            if open.len() < 3 || (!bits.is_multiple_of(3) && open.len() < 200) {
                let least = (0..b.eps.len())
                    .map(|i| f64::from(b.eps[i].in_flight()) / f64::from(weights[i]))
                    .fold(f64::INFINITY, f64::min);
                let i = b.start(&s, step);
                let load = f64::from(b.eps[i].in_flight() - 1) / f64::from(weights[i]);
                assert!(
                    (load - least).abs() < 1e-12,
                    "step {step}: {load} > {least}"
                );
                open.push(i);
            } else {
                let i = open.swap_remove((bits >> 8) as usize % open.len());
                b.end(&s, i, step, 10, true);
            }
        }
    }

    #[test]
    fn an_ejected_endpoint_leaves_the_tree_and_comes_back() {
        let b = Bench::new(&[1, 1, 1]);
        let s = LeastConnections::new(TieBreak::Random, &b.eps);
        b.sequential(&s, 10, 1_000);
        b.eps[1].eject(5_000_000_000);
        s.refresh(&b.view(2_000_000_000), Some(1));
        let counts = b.sequential(&s, 300, 1_000);
        assert_eq!(counts[1], 0, "{counts:?}");
        // After the ejection, the endpoints are recounted (as the balancer does).
        s.refresh(&b.view(6_000_000_000), None);
        let mut counts = [0; 3];
        for k in 0..3_000 {
            let i = b.start(&s, 6_000_000_000 + k);
            counts[i] += 1;
            b.end(&s, i, 6_000_000_000 + k, 1, true);
        }
        assert_shares(&counts, &[1, 1, 1], 0.05);
    }

    #[test]
    fn a_cancelled_call_is_forgotten_within_one_sweep() {
        let b = Bench::new(&[1, 1, 1, 1]);
        let s = LeastConnections::new(TieBreak::Random, &b.eps);
        let i = b.start(&s, 0);
        // Dropped without `finish`: the balancer releases the slot and tells no strategy.
        b.eps[i].end_call();
        // One sweep later (4 endpoints x SWEEP_EVERY picks) the endpoint is idle again in the
        // tree.
        b.sequential(&s, 4 * SWEEP_EVERY, 10);
        let counts = b.sequential(&s, 4_000, 10);
        assert_shares(&counts, &[1, 1, 1, 1], 0.04);
    }
}
