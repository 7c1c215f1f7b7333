//! Power of two choices: compare a few candidates drawn in proportion to weight and take the
//! cheapest, by calls in flight per unit of weight (least-request) or by peak-EWMA cost.

use std::sync::Arc;

use super::api::{Call, Observation, Strategy, View, RANDOM_TRIES};
use super::weights::WeightLine;
use crate::config::StrategyOptions;
use crate::endpoint::{Endpoint, LatencyEstimate};
use crate::rng::mix64;
use crate::time::nanos;
use crate::Outcome;

/// Most candidates a pick compares (`choices` above this count as this).
const MAX_CHOICES: usize = 8;

/// least-request or peak-EWMA: `choices` candidates, the cheapest wins, the first on a tie.
pub(crate) struct TwoChoices {
    line: WeightLine,
    choices: u32,
    cost: Cost,
}

enum Cost {
    /// Calls in flight per unit of weight.
    Load,
    /// rtt x (1 + in_flight / weight), rtt a peak-EWMA of latencies.
    PeakEwma {
        tolerance: f64,
        decay_ns: f64,
        default_rtt_ns: f64,
        penalty_ns: f64,
        /// An EWMA of every sample of the cluster: the prior of an endpoint without a sample.
        cluster: LatencyEstimate,
    },
}

impl TwoChoices {
    pub(crate) fn least_request(o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        Self {
            line: WeightLine::new(eps.iter().map(|e| e.weight())),
            choices: o.choices,
            cost: Cost::Load,
        }
    }

    pub(crate) fn peak_ewma(o: &StrategyOptions, eps: &[Arc<Endpoint>]) -> Self {
        let cluster = LatencyEstimate::default();
        // The endpoints that stay through an update keep their estimates: their mean is the
        // prior of the new ones until the first samples arrive.
        let known: Vec<f64> = eps.iter().filter_map(|e| e.latency().value()).collect();
        if !known.is_empty() {
            let mean = known.iter().sum::<f64>() / known.len() as f64;
            cluster.record(mean, 0, 1.0, false);
        }
        Self {
            line: WeightLine::new(eps.iter().map(|e| e.weight())),
            choices: o.choices,
            cost: Cost::PeakEwma {
                tolerance: o.latency_tolerance,
                decay_ns: nanos(o.decay) as f64,
                default_rtt_ns: nanos(o.default_rtt) as f64,
                penalty_ns: nanos(o.failure_penalty) as f64,
                cluster,
            },
        }
    }

    /// Draws allowed candidates in proportion to weight: two distinct ones when possible (see
    /// [`WeightLine::pair`]), then more up to `choices`. Returns how many it wrote into `out`.
    fn candidates(&self, v: &View<'_>, out: &mut [usize; MAX_CHOICES]) -> usize {
        if self.line.total() == 0 {
            return 0;
        }
        let want = (self.choices as usize).clamp(2, MAX_CHOICES);
        for _ in 0..RANDOM_TRIES {
            let bits = v.rng.next_u64();
            let more = mix64(bits);
            let (a, b) = self.line.pair(bits, more);
            let mut count = 0;
            let mut next_bits = mix64(more);
            for c in [a, b] {
                if v.allowed(c) && v.ramp_accepts(c, next_bits) {
                    out[count] = c;
                    count += 1;
                }
                next_bits = mix64(next_bits);
            }
            while count > 0 && count < want {
                let c = self.line.draw(next_bits);
                next_bits = mix64(next_bits);
                if v.allowed(c) && !out[..count].contains(&c) {
                    out[count] = c;
                    count += 1;
                } else {
                    break;
                }
            }
            if count > 0 {
                return count;
            }
        }
        // Most of the weight is unavailable: one uniform draw over the allowed endpoints.
        match v.random_allowed() {
            Some(i) => {
                out[0] = i;
                1
            }
            None => 0,
        }
    }
}

impl Strategy for TwoChoices {
    fn pick(&self, v: &View<'_>, _call: Call<'_>) -> Option<usize> {
        let mut c = [0; MAX_CHOICES];
        let count = self.candidates(v, &mut c);
        let mut best = *c[..count].first()?;
        match &self.cost {
            Cost::Load => {
                for &other in &c[1..count] {
                    if v.lighter(other, best).is_lt() {
                        best = other;
                    }
                }
            }
            Cost::PeakEwma {
                tolerance,
                decay_ns,
                default_rtt_ns,
                cluster,
                ..
            } => {
                // An endpoint without a sample (new, or back from an ejection) counts the
                // cluster's mean latency: neither starved (a high prior) nor flooded (a zero
                // prior).
                let prior = cluster.value().unwrap_or(*default_rtt_ns);
                // rtt x (1 + in_flight / weight): the expected time of one more call on an
                // endpoint that serves `weight` calls at once. Idle endpoints cost their rtt
                // whatever their weight, so weights act through the candidate draw at low load
                // and through the queue term under load.
                let cost = |i: usize| {
                    let rtt = v.eps[i]
                        .latency()
                        .decayed(v.now, *decay_ns)
                        .unwrap_or(prior);
                    let queue = f64::from(v.eps[i].in_flight()) * 1000.0 / v.weight_milli(i) as f64;
                    (rtt, queue)
                };
                let mut best_cost = cost(best);
                for &other in &c[1..count] {
                    let other_cost = cost(other);
                    if cheaper(other_cost, best_cost, *tolerance) {
                        best = other;
                        best_cost = other_cost;
                    }
                }
            }
        }
        Some(best)
    }

    fn follows_calls(&self) -> bool {
        matches!(self.cost, Cost::PeakEwma { .. })
    }

    /// Peak-EWMA shuts an endpoint out on its cost; least-request does not.
    fn half_open(&self) -> bool {
        matches!(self.cost, Cost::PeakEwma { .. })
    }

    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        let Cost::PeakEwma {
            decay_ns,
            penalty_ns,
            cluster,
            ..
        } = &self.cost
        else {
            return;
        };
        let Observation::CallEnded {
            outcome,
            latency_ns,
        } = *what
        else {
            return;
        };
        let mut x = latency_ns as f64;
        if outcome == Outcome::Failure {
            x = x.max(*penalty_ns);
        }
        v.eps[i].latency().record(x, v.now, *decay_ns, true);
        cluster.record(x, v.now, *decay_ns, false);
    }
}

/// Peak-EWMA's comparison of two `(rtt, queue)` costs: is `a` cheaper than `b`? Rtts within
/// `tolerance` of each other count as equal, and then only the queues compare (exactly): the
/// read-side decay alone makes an endpoint that was used less recently look a little faster,
/// and without the tolerance that noise, not the weights, would decide between equally fast
/// idle endpoints.
#[inline]
fn cheaper(a: (f64, f64), b: (f64, f64), tolerance: f64) -> bool {
    let (lo, hi) = if a.0 < b.0 { (a.0, b.0) } else { (b.0, a.0) };
    if hi <= lo * (1.0 + tolerance) {
        a.1 < b.1
    } else {
        a.0 * (1.0 + a.1) < b.0 * (1.0 + b.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::testing::{assert_shares, Bench};

    const MS: u64 = 1_000_000;

    #[test]
    fn least_request_follows_weights_at_low_load() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = TwoChoices::least_request(&StrategyOptions::default(), &b.eps);
        assert_shares(&b.sequential(&s, 60_000, MS), &[2, 1, 1, 1, 1], 0.01);
    }

    #[test]
    fn least_request_never_takes_the_more_loaded_of_two() {
        let b = Bench::new(&[1, 1]);
        let s = TwoChoices::least_request(&StrategyOptions::default(), &b.eps);
        for _ in 0..200 {
            let loads: Vec<u32> = b.eps.iter().map(|e| e.in_flight()).collect();
            let i = b.start(&s, 0);
            assert!(loads[i] <= loads[1 - i], "{loads:?} picked {i}");
        }
    }

    #[test]
    fn peak_ewma_follows_weights_with_equal_latencies_and_avoids_fast_failures() {
        let b = Bench::new(&[2, 1, 1, 1, 1]);
        let s = TwoChoices::peak_ewma(&StrategyOptions::default(), &b.eps);
        assert_shares(&b.sequential(&s, 30_000, 10 * MS), &[2, 1, 1, 1, 1], 0.015);
        // Endpoint 4 now fails in 1 ms: its penalty (1 s) keeps it out.
        let mut now = 1_000_000_000_000;
        let mut bad = 0;
        for _ in 0..3_000 {
            let i = b.start(&s, now);
            let (lat, ok) = if i == 4 { (MS, false) } else { (10 * MS, true) };
            bad += usize::from(i == 4);
            b.end(&s, i, now + lat, lat, ok);
            now += MS;
        }
        assert!(bad < 30, "{bad}");
    }

    #[test]
    fn peak_ewma_prices_an_unmeasured_endpoint_at_the_cluster_mean() {
        let b = Bench::new(&[1, 1, 1]);
        let s = TwoChoices::peak_ewma(&StrategyOptions::default(), &b.eps);
        b.sequential(&s, 300, 2 * MS);
        b.eps[2].eject(1);
        // Measured endpoints at 2 ms; the prior is the cluster's 2 ms, not default_rtt's 30 ms.
        let Cost::PeakEwma { cluster, .. } = &s.cost else {
            unreachable!()
        };
        assert!((cluster.value().unwrap() - 2e6).abs() < 1e3);
        assert_shares(&b.sequential(&s, 3_000, 2 * MS), &[1, 1, 1], 0.03);
    }

    #[test]
    fn rtts_within_the_tolerance_compare_by_queue_only() {
        assert!(cheaper((10.5, 0.0), (10.0, 1.0), 0.1));
        assert!(!cheaper((10.0, 1.0), (10.5, 0.0), 0.1));
        // Beyond the tolerance the whole cost compares.
        assert!(cheaper((10.0, 1.0), (30.0, 0.0), 0.1));
    }
}
