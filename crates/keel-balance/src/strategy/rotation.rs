//! Rotations: round-robin, and nginx's smooth weighted round-robin.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::{Strategy, View};
use crate::endpoint::Endpoint;

/// Each endpoint in turn; weights ignored.
pub(crate) struct RoundRobin {
    next: AtomicUsize,
}

impl RoundRobin {
    pub(crate) fn new() -> Self {
        Self {
            next: AtomicUsize::new(0),
        }
    }
}

impl Strategy for RoundRobin {
    fn pick(&self, v: &View<'_>, _key: Option<u64>) -> Option<usize> {
        let n = v.eps.len();
        // An unavailable endpoint's turn goes to the next value of the counter, not to its
        // neighbour in the list, so that the others keep equal shares (walking to the neighbour
        // would give it a double share).
        for _ in 0..n {
            let i = self.next.fetch_add(1, Ordering::Relaxed) % n;
            if v.allowed(i) {
                return Some(i);
            }
        }
        None
    }
}

/// nginx's smooth weighted round-robin: each pick adds every endpoint's weight to its current
/// value, takes the largest, and subtracts the total from it.
pub(crate) struct WeightedRoundRobin {
    current: Mutex<Vec<i64>>,
}

impl WeightedRoundRobin {
    pub(crate) fn new(eps: &[Arc<Endpoint>]) -> Self {
        Self {
            current: Mutex::new(vec![0; eps.len()]),
        }
    }
}

impl Strategy for WeightedRoundRobin {
    fn pick(&self, v: &View<'_>, _key: Option<u64>) -> Option<usize> {
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0i64;
        let mut best: Option<usize> = None;
        for i in 0..v.eps.len() {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    #[test]
    fn round_robin_visits_each_in_turn_and_skips_the_unavailable() {
        let b = Bench::new(&[1, 1, 1, 1]);
        let s = RoundRobin::new();
        let order: Vec<usize> = (0..8).map(|_| s.pick(&b.view(0), None).unwrap()).collect();
        assert_eq!(order, [0, 1, 2, 3, 0, 1, 2, 3]);
        b.eps[2].eject(u64::MAX);
        let counts = b.sequential(&s, 3_000, 0);
        assert_eq!(counts, [1_000, 1_000, 0, 1_000]);
    }

    #[test]
    fn weighted_round_robin_is_smooth_and_exact_per_cycle() {
        let b = Bench::new(&[5, 1, 1]);
        let s = WeightedRoundRobin::new(&b.eps);
        let seq: String = (0..7)
            .map(|_| (b'a' + s.pick(&b.view(0), None).unwrap() as u8) as char)
            .collect();
        assert_eq!(seq, "aabacaa");
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = WeightedRoundRobin::new(&b.eps);
        assert_shares(&b.sequential(&s, 600, 0), &[2, 1, 1, 1, 1], 0.0);
    }
}
