//! Least-connections: the fewest calls in flight per unit of weight.

use super::{LoadKey, Strategy, View};
use crate::config::TieBreak;

/// Fewest calls in flight per unit of weight, `in_flight / weight`. Idle endpoints tie whatever
/// their weight, and ties go to a draw in proportion to weight among the least loaded (nginx
/// breaks them by weighted round-robin): at low load, where every endpoint is idle, the shares
/// are the weights'. With `lowest-index`, ties go to the first (only to reproduce experiment
/// E5: at low concurrency nearly everything goes to one endpoint).
pub(crate) struct LeastConnections {
    tie: TieBreak,
}

impl LeastConnections {
    pub(crate) fn new(tie: TieBreak) -> Self {
        Self { tie }
    }
}

impl Strategy for LeastConnections {
    fn pick(&self, v: &View<'_>, _key: Option<u64>) -> Option<usize> {
        v.min_by(self.tie, |i| LoadKey(v, i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    #[test]
    fn idle_endpoints_share_by_weight() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = LeastConnections::new(TieBreak::Random);
        // 60,000 picks: sd of a share under 0.002.
        assert_shares(&b.sequential(&s, 60_000, 1_000), &[2, 1, 1, 1, 1], 0.01);
    }

    #[test]
    fn lowest_index_gives_every_tie_to_the_first() {
        let b = Bench::new(&[1, 2, 1]);
        let s = LeastConnections::new(TieBreak::LowestIndex);
        assert_eq!(b.sequential(&s, 100, 1_000), [100, 0, 0]);
    }

    #[test]
    fn under_load_calls_in_flight_follow_weights() {
        let b = Bench::new(&[3, 1]);
        let s = LeastConnections::new(TieBreak::Random);
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
}
