//! Hash strategies: ring-hash, Maglev and rendezvous map a request's key to an endpoint, and
//! with bounded loads walk on from an endpoint that is full.

use std::sync::Arc;

use super::api::{Call, LoadKey, Strategy, View};
use crate::config::{StrategyKind, StrategyOptions, TieBreak};
use crate::endpoint::Endpoint;
use crate::hash::{rendezvous_score, Maglev, Ring};

/// One hash table and the bounded-loads factor.
pub(crate) struct Hashed {
    table: Table,
    /// Bounded loads: no endpoint takes more than ceil(c x (group in flight + 1) x its weight
    /// share) calls at once.
    bound: Option<f64>,
    total_weight: u64,
}

enum Table {
    Ring(Ring),
    Maglev(Maglev),
    /// `uniform`: every weight equal (the score skips its logarithm).
    Rendezvous {
        uniform: bool,
    },
}

impl Hashed {
    pub(crate) fn new(kind: StrategyKind, o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        let named: Vec<(&str, u32)> = eps.iter().map(|e| (e.address(), e.weight())).collect();
        let table = match kind {
            StrategyKind::RingHash => Table::Ring(Ring::build(&named, o.vnodes)),
            StrategyKind::Maglev => Table::Maglev(Maglev::build(&named, o.table_size)),
            _ => Table::Rendezvous {
                uniform: named.windows(2).all(|w| w[0].1 == w[1].1),
            },
        };
        Self {
            table,
            bound: o.bounded_load,
            total_weight: eps.iter().map(|e| u64::from(e.weight())).sum(),
        }
    }
}

impl Strategy for Hashed {
    fn pick(&self, v: &View<'_>, call: Call<'_>) -> Option<usize> {
        let n = v.eps.len();
        if n == 0 {
            return None;
        }
        let key = call.key.unwrap_or_else(|| v.rng.next_u64());
        let cap = Cap::new(v, self.bound, self.total_weight);
        let accept = |i| v.allowed(i) && cap.admits(v, i);
        let found = match &self.table {
            Table::Ring(ring) => ring.find(key, n, accept),
            // The table's owner and its re-hashes are all refused: rendezvous over the allowed
            // endpoints, which is still key-stable.
            Table::Maglev(table) => table
                .find(key, accept)
                .or_else(|| rendezvous(v, key, false, &cap)),
            Table::Rendezvous { uniform } => rendezvous(v, key, *uniform, &cap),
        };
        found.or_else(|| overflow(v, self.bound))
    }

    fn uses_group_load(&self) -> bool {
        self.bound.is_some()
    }

    fn ring_points(&self) -> Option<usize> {
        match &self.table {
            Table::Ring(ring) => Some(ring.len()),
            _ => None,
        }
    }
}

/// Bounded loads: endpoint i may take one more call while it has fewer than
/// ceil(c x (group in flight + 1) x w_i / W) in flight. The per-pick part is computed once.
pub(crate) struct Cap {
    /// c x (group in flight + 1) / W; `None`: no bound.
    per_weight: Option<f64>,
}

impl Cap {
    pub(crate) fn new(v: &View<'_>, bound: Option<f64>, total_weight: u64) -> Self {
        Self {
            per_weight: bound
                .map(|c| c * (v.group_in_flight() + 1) as f64 / total_weight.max(1) as f64),
        }
    }

    #[inline]
    pub(crate) fn admits(&self, v: &View<'_>, i: usize) -> bool {
        let Some(per_weight) = self.per_weight else {
            return true;
        };
        let cap = (per_weight * f64::from(v.eps[i].weight())).ceil() as u64;
        u64::from(v.load(i)) < cap.max(1)
    }
}

fn rendezvous(v: &View<'_>, key: u64, uniform: bool, cap: &Cap) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for i in 0..v.eps.len() {
        if !v.allowed(i) || !cap.admits(v, i) {
            continue;
        }
        let e = &v.eps[i];
        let s = rendezvous_score(key, e.hash(), e.weight(), uniform);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::Bench;

    #[test]
    fn a_key_stays_on_its_endpoint_and_moves_when_it_is_unavailable() {
        for kind in [
            StrategyKind::RingHash,
            StrategyKind::Maglev,
            StrategyKind::Rendezvous,
        ] {
            let b = Bench::new(&[1; 10]);
            let s = Hashed::new(kind, &StrategyOptions::default(), &b.eps);
            let owner = s.pick(&b.view(0), Call::key(42)).unwrap();
            for _ in 0..5 {
                assert_eq!(s.pick(&b.view(0), Call::key(42)), Some(owner), "{kind}");
            }
            b.eps[owner].eject(u64::MAX);
            let second = s.pick(&b.view(0), Call::key(42)).unwrap();
            assert_ne!(second, owner, "{kind}");
            assert_eq!(s.pick(&b.view(0), Call::key(42)), Some(second), "{kind}");
        }
    }

    #[test]
    fn bounded_loads_spill_a_hot_key() {
        let b = Bench::new(&[1; 4]);
        let o = StrategyOptions {
            bounded_load: Some(1.25),
            ..StrategyOptions::default()
        };
        let s = Hashed::new(StrategyKind::Rendezvous, &o, &b.eps);
        for total in 1..=40u64 {
            let i = s.pick(&b.view(0), Call::key(7)).unwrap();
            b.eps[i].begin_call();
            b.group.store(total, std::sync::atomic::Ordering::Relaxed);
            let cap = (1.25 * total as f64 / 4.0).ceil() as u32;
            assert!(b.eps.iter().all(|e| e.in_flight() <= cap), "at {total}");
        }
    }
}
