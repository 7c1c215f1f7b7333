//! Rotations: round-robin, and weighted round-robin by earliest deadline first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::api::{Call, Strategy, View};
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
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
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

/// Weighted round-robin as earliest-deadline-first: endpoint i has a virtual deadline that
/// advances by `1 / weight` each time it is taken, and each pick takes the earliest. Over a
/// cycle every endpoint gets exactly its weight's share, spread out (no endpoint is ever two
/// picks ahead of or behind its share, like nginx's smooth weighted round-robin), and
/// a pick costs O(log n): one sift of a binary heap, instead of nginx's scan of every endpoint.
/// A slow-start weight is read at each of the endpoint's turns. An unavailable endpoint's turn
/// passes (its deadline advances), so the others keep their relative shares.
pub(crate) struct WeightedRoundRobin {
    heap: Mutex<BinaryHeap<Reverse<(u64, u32)>>>,
}

/// Deadlines are in units of 2^-32 of a turn of an endpoint of weight 1 (1000 thousandths).
const TURN: u64 = 1 << 32;

/// After this, every deadline is brought back near zero (an O(n) pass, once in a very long
/// while).
const RENORMALISE_AT: u64 = 1 << 62;

/// Turns passed over before a pick falls back to a draw over the allowed endpoints.
const EDF_TRIES: usize = 16;

impl WeightedRoundRobin {
    pub(crate) fn new(eps: &[Arc<Endpoint>]) -> Self {
        // Everyone starts half a step in, so that heavier endpoints come first and the lighter
        // ones fall between them.
        let heap = eps
            .iter()
            .enumerate()
            .map(|(i, e)| Reverse((step(u64::from(e.weight()) * 1000) / 2, i as u32)))
            .collect();
        Self {
            heap: Mutex::new(heap),
        }
    }
}

/// How far a deadline advances for an endpoint of this weight (thousandths).
#[inline]
fn step(weight_milli: u64) -> u64 {
    (TURN * 1000 / weight_milli.max(1)).max(1)
}

impl Strategy for WeightedRoundRobin {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        let mut heap = self.heap.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..EDF_TRIES {
            let mut top = heap.peek_mut()?;
            let Reverse((deadline, i)) = *top;
            let i = i as usize;
            let next = deadline + step(v.weight_milli(i));
            *top = Reverse((next, i as u32));
            // The sift happens when `top` is dropped.
            drop(top);
            if next >= RENORMALISE_AT {
                let base = heap.peek().map_or(0, |Reverse((d, _))| *d);
                let moved: BinaryHeap<_> = heap
                    .drain()
                    .map(|Reverse((d, j))| Reverse((d - base, j)))
                    .collect();
                *heap = moved;
            }
            if v.allowed(i) {
                return Some(i);
            }
        }
        drop(heap);
        // Most endpoints are out: a draw over those allowed.
        super::random::weighted_scan(v)
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
        let order: Vec<usize> = (0..8)
            .map(|_| s.pick(&b.view(0), Call::NONE).unwrap())
            .collect();
        assert_eq!(order, [0, 1, 2, 3, 0, 1, 2, 3]);
        b.eps[2].eject(u64::MAX);
        let counts = b.sequential(&s, 3_000, 0);
        assert_eq!(counts, [1_000, 1_000, 0, 1_000]);
    }

    #[test]
    fn weighted_round_robin_is_smooth_and_exact_per_cycle() {
        let b = Bench::new(&[5, 1, 1]);
        let s = WeightedRoundRobin::new(&b.eps);
        let seq: String = (0..14)
            .map(|_| (b'a' + s.pick(&b.view(0), Call::NONE).unwrap() as u8) as char)
            .collect();
        assert_eq!(seq, "aaabcaaaaabcaa");
        // Weights 1-4 on 13 endpoints: after every pick each endpoint is within one pick of
        // its share, and each cycle (the sum of the weights) is exact.
        let weights: Vec<u32> = (0..13).map(|i| 1 + i % 4).collect();
        let total: u32 = weights.iter().sum();
        let b = Bench::new(&weights);
        let s = WeightedRoundRobin::new(&b.eps);
        let mut counts = vec![0u32; weights.len()];
        for t in 1..=(3 * total) {
            counts[s.pick(&b.view(0), Call::NONE).unwrap()] += 1;
            for (c, w) in counts.iter().zip(&weights) {
                let share = f64::from(t) * f64::from(*w) / f64::from(total);
                assert!((f64::from(*c) - share).abs() <= 1.0, "pick {t}: {counts:?}");
            }
        }
        assert_eq!(counts, weights.iter().map(|w| 3 * w).collect::<Vec<_>>());
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = WeightedRoundRobin::new(&b.eps);
        assert_shares(&b.sequential(&s, 600, 0), &[2, 1, 1, 1, 1], 0.0);
    }

    #[test]
    fn weighted_round_robin_passes_over_the_unavailable() {
        let b = Bench::new(&[2, 1, 1, 1]);
        let s = WeightedRoundRobin::new(&b.eps);
        b.eps[1].eject(u64::MAX);
        assert_shares(&b.sequential(&s, 400, 0), &[2, 0, 1, 1], 0.0);
        b.eps[0].eject(u64::MAX);
        b.eps[2].eject(u64::MAX);
        b.eps[3].eject(u64::MAX);
        assert_eq!(s.pick(&b.view(0), Call::NONE), None);
    }
}
