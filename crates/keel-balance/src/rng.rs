//! A small lock-free random source that a balancer owns, so that a seed makes a run repeatable.

use std::sync::atomic::{AtomicU64, Ordering};

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64 finaliser: a good 64-bit mix, used for random numbers and for hashing keys.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator whose state is one atomic counter: any number of threads may draw from
/// it at once, and a single-threaded driver (the simulator) gets the same sequence for the same
/// seed.
#[derive(Debug)]
pub struct SharedRng {
    state: AtomicU64,
}

impl SharedRng {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&self) -> u64 {
        mix64(
            self.state
                .fetch_add(GOLDEN, Ordering::Relaxed)
                .wrapping_add(GOLDEN),
        )
    }

    /// A uniform integer in `0..n` (`n > 0`), by Lemire's multiply-shift (bias below 2^-32 for
    /// the sizes a balancer sees).
    #[inline]
    pub fn below(&self, n: usize) -> usize {
        below(self.next_u64(), n)
    }
}

/// Maps 64 random bits to `0..n` without a division.
#[inline]
pub fn below(bits: u64, n: usize) -> usize {
    ((bits as u128 * n as u128) >> 64) as usize
}

/// A uniform float in `[0, 1)` from 64 random bits.
#[inline]
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_uniform_enough() {
        let a = SharedRng::new(7);
        let b = SharedRng::new(7);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            let x = a.below(10);
            assert_eq!(x, b.below(10));
            counts[x] += 1;
        }
        // Each bucket expects 10,000; 5 sigma is about 475.
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }
}
