//! The weights laid end to end on a line `[0, total)`: endpoint `i` owns an interval as long as
//! its weight. A uniform point on the line is a draw in proportion to weight; a guide table
//! (one bucket per endpoint or more) finds the owner of a point in O(1) on average instead of a
//! binary search.

/// Cumulative weights with a guide table.
#[derive(Debug)]
pub(crate) struct WeightLine {
    /// `ends[i]`: the end of endpoint i's interval (the sum of the weights up to i included).
    ends: Vec<u64>,
    /// `guide[b]`: the first endpoint whose interval reaches bucket b.
    guide: Vec<u32>,
    /// Buckets per unit of weight.
    scale: f64,
    /// The largest weight.
    max: u64,
}

impl WeightLine {
    /// A line over these weights (each at least 1).
    pub(crate) fn new(weights: impl IntoIterator<Item = u32>) -> Self {
        let ends: Vec<u64> = weights
            .into_iter()
            .scan(0u64, |sum, w| {
                *sum += u64::from(w.max(1));
                Some(*sum)
            })
            .collect();
        let total = ends.last().copied().unwrap_or(0);
        let buckets = ends.len().next_power_of_two();
        let scale = if total == 0 {
            0.0
        } else {
            buckets as f64 / total as f64
        };
        let mut line = WeightLine {
            ends,
            guide: vec![0; buckets],
            scale,
            max: 0,
        };
        let mut prev = 0;
        let mut next_bucket = 0;
        for (i, &end) in line.ends.iter().enumerate() {
            line.max = line.max.max(end - prev);
            prev = end;
            // Every bucket up to the one holding this interval's last point starts at i or
            // before it.
            let last = line.bucket(end - 1);
            while next_bucket <= last {
                line.guide[next_bucket] = i as u32;
                next_bucket += 1;
            }
        }
        let last = line.ends.len().saturating_sub(1) as u32;
        line.guide[next_bucket.min(buckets)..].fill(last);
        line
    }

    /// The sum of the weights.
    #[inline]
    pub(crate) fn total(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    #[inline]
    fn bucket(&self, x: u64) -> usize {
        // Monotone in x, which is all the guide table needs.
        ((x as f64 * self.scale) as usize).min(self.guide.len() - 1)
    }

    /// The endpoint whose interval holds `x` (`x < total`).
    #[inline]
    pub(crate) fn at(&self, x: u64) -> usize {
        let mut i = self.guide[self.bucket(x)] as usize;
        while self.ends[i] <= x {
            i += 1;
        }
        i
    }

    /// Maps 64 random bits to a point on the line.
    #[inline]
    fn point(&self, bits: u64) -> u64 {
        ((u128::from(bits) * u128::from(self.total())) >> 64) as u64
    }

    /// An endpoint drawn in proportion to weight (line not empty).
    #[inline]
    pub(crate) fn draw(&self, bits: u64) -> usize {
        self.at(self.point(bits))
    }

    /// Two endpoints for a power-of-two-choices pick: two points on the line (as a circle), the
    /// second at least the largest weight away from the first. Each point alone is uniform, so
    /// each candidate alone is drawn in proportion to weight; and the two are distinct whenever
    /// no endpoint holds more than half the total weight.
    #[inline]
    pub(crate) fn pair(&self, bits: u64, more: u64) -> (usize, usize) {
        let total = self.total();
        let first = self.point(bits);
        let gap = if total >= 2 * self.max {
            self.max + ((u128::from(more) * u128::from(total - 2 * self.max + 1)) >> 64) as u64
        } else {
            total / 2
        };
        let mut second = first + gap;
        if second >= total {
            second -= total;
        }
        (self.at(first), self.at(second))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::mix64;

    #[test]
    fn every_point_belongs_to_the_interval_that_holds_it() {
        for weights in [
            vec![1],
            vec![5, 1, 1],
            vec![2, 1, 1, 1, 1],
            vec![1, 1000, 1, 3, 7, 1, 1, 250],
            (1..=37).collect(),
        ] {
            let line = WeightLine::new(weights.iter().copied());
            let mut x = 0;
            for (i, &w) in weights.iter().enumerate() {
                for _ in 0..w {
                    assert_eq!(line.at(x), i, "{weights:?} at {x}");
                    x += 1;
                }
            }
            assert_eq!(x, line.total());
        }
    }

    #[test]
    fn draws_follow_weights() {
        let line = WeightLine::new([2, 1, 1, 1, 1]);
        let mut counts = [0u32; 5];
        for k in 0..60_000u64 {
            counts[line.draw(mix64(k))] += 1;
        }
        // Expected 20,000 / 10,000; binomial sd under 120, so 600 is 5 sigma.
        assert!((counts[0] as i32 - 20_000).abs() < 600, "{counts:?}");
        for &c in &counts[1..] {
            assert!((c as i32 - 10_000).abs() < 600, "{counts:?}");
        }
    }

    #[test]
    fn pairs_are_distinct_and_each_side_follows_weights() {
        let line = WeightLine::new([2, 1, 1, 1, 1]);
        let mut first = [0u32; 5];
        let mut second = [0u32; 5];
        for k in 0..60_000u64 {
            let (a, b) = line.pair(mix64(k), mix64(k ^ 0xABCD));
            assert_ne!(a, b);
            first[a] += 1;
            second[b] += 1;
        }
        for counts in [first, second] {
            assert!((counts[0] as i32 - 20_000).abs() < 600, "{counts:?}");
            for &c in &counts[1..] {
                assert!((c as i32 - 10_000).abs() < 600, "{counts:?}");
            }
        }
        // Two endpoints: always both.
        let two = WeightLine::new([1, 1]);
        for k in 0..1000u64 {
            let (a, b) = two.pair(mix64(k), mix64(!k));
            assert_ne!(a, b);
        }
    }
}
