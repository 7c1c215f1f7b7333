//! Random choices: uniform, and in proportion to weight.

use std::sync::Arc;

use super::api::{Call, Strategy, View, RANDOM_TRIES};
use super::weights::WeightLine;
use crate::endpoint::Endpoint;
use crate::rng::{below, mix64};

/// Uniform random choice; weights ignored.
pub(crate) struct Random;

impl Strategy for Random {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        v.random_allowed()
    }
}

/// Random choice in proportion to weight: a uniform point on the line of weights.
pub(crate) struct WeightedRandom {
    line: WeightLine,
}

impl WeightedRandom {
    pub(crate) fn new(eps: &[Arc<Endpoint>]) -> Self {
        Self {
            line: WeightLine::new(eps.iter().map(|e| e.weight())),
        }
    }
}

impl Strategy for WeightedRandom {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        if self.line.total() == 0 {
            return None;
        }
        let mut bits = v.rng.next_u64();
        for _ in 0..RANDOM_TRIES {
            let i = self.line.draw(bits);
            bits = mix64(bits);
            // Slow start by rejection: accepted draws follow weight x ramp.
            if v.allowed(i) && v.ramp_accepts(i, bits) {
                return Some(i);
            }
            bits = mix64(bits);
        }
        weighted_scan(v)
    }
}

/// A draw in proportion to effective weight over the allowed endpoints, by a scan: the way out
/// when most of the weight is unavailable.
pub(crate) fn weighted_scan(v: &View<'_>) -> Option<usize> {
    let allowed_total: u64 = (0..v.eps.len())
        .filter(|&i| v.allowed(i))
        .map(|i| v.weight_milli(i))
        .sum();
    if allowed_total == 0 {
        return None;
    }
    let mut r = below(v.rng.next_u64(), allowed_total as usize) as u64;
    for i in (0..v.eps.len()).filter(|&i| v.allowed(i)) {
        let w = v.weight_milli(i);
        if r < w {
            return Some(i);
        }
        r -= w;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    #[test]
    fn weighted_random_follows_weights_and_skips_the_unavailable() {
        let b = Bench::new(&[5, 1, 1]);
        let s = WeightedRandom::new(&b.eps);
        // 70,000 draws: sd of a share under 0.002; 0.01 is 5 sigma.
        assert_shares(&b.sequential(&s, 70_000, 0), &[5, 1, 1], 0.01);
        b.eps[0].eject(u64::MAX);
        assert_shares(&b.sequential(&s, 20_000, 0), &[0, 1, 1], 0.02);
    }

    #[test]
    fn random_ignores_weights() {
        let b = Bench::new(&[5, 1, 1]);
        assert_shares(&b.sequential(&Random, 30_000, 0), &[1, 1, 1], 0.015);
    }
}
