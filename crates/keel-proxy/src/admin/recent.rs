//! The last minute of traffic for `/status` and the admin page: request rate, error rate and
//! p50/p99 latency per cluster and per endpoint, and a per-second series of each for the
//! sparklines.
//!
//! Nothing is added to the request path: the admin task copies the cumulative counters the
//! proxy keeps anyway ([`crate::metrics`]: responses by class, failed tries, latency
//! histograms) once a second into a ring of 61 samples, and figures come from the differences
//! between samples. Quantiles are interpolated linearly inside the histogram's buckets
//! ([`LATENCY_BUCKETS`]), so they are as precise as those buckets.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::metrics::LATENCY_BUCKETS;
use crate::state::Routing;

/// Time between two samples.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// The window the figures cover.
const WINDOW: Duration = Duration::from_secs(60);
/// Samples kept: the window's intervals and one more as the baseline.
const KEPT: usize = 61;

type Buckets = [u64; LATENCY_BUCKETS.len() + 1];

/// Cumulative counters of one cluster or endpoint at one instant.
#[derive(Clone, Copy, Default)]
struct Counts {
    /// Answers (to clients for a cluster, from the endpoint for an endpoint).
    answers: u64,
    /// Errors among them (5xx), plus failed tries without an answer for an endpoint.
    errors: u64,
    /// Latency histogram.
    latency: Buckets,
}

impl Counts {
    /// Requests between `base` and `self` (counters only grow; a reset counts as zero).
    fn since(&self, base: &Counts) -> Counts {
        Counts {
            answers: self.answers.saturating_sub(base.answers),
            errors: self.errors.saturating_sub(base.errors),
            latency: std::array::from_fn(|i| self.latency[i].saturating_sub(base.latency[i])),
        }
    }
}

/// One sample: every cluster and endpoint of the routing at that time.
struct Sample {
    at: Instant,
    clusters: HashMap<String, Counts>,
    /// By (cluster, endpoint address).
    endpoints: HashMap<(String, String), Counts>,
}

/// The ring of samples.
#[derive(Default)]
pub(crate) struct Recent {
    samples: VecDeque<Sample>,
}

/// The figures of one cluster or endpoint over the window.
struct Figures {
    window_s: f64,
    requests: u64,
    rate: f64,
    error_rate: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// Per sample interval, oldest first: requests/s, error ratio, p99 (ms).
    series: (Vec<f64>, Vec<Option<f64>>, Vec<Option<f64>>),
}

/// The `q` quantile of a (non-cumulative) bucket histogram, in ms, interpolated linearly
/// inside its bucket; `None` without observations. Past the last bound: that bound.
pub(crate) fn quantile_ms(buckets: &Buckets, q: f64) -> Option<f64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    // The rank of the quantile among the observations, 1-based.
    let rank = (q * total as f64).ceil().max(1.0);
    let mut below = 0u64;
    for (i, &n) in buckets.iter().enumerate() {
        if n == 0 {
            continue;
        }
        if (below + n) as f64 >= rank {
            let Some(&upper) = LATENCY_BUCKETS.get(i) else {
                return Some(LATENCY_BUCKETS[LATENCY_BUCKETS.len() - 1] * 1e3);
            };
            let lower = if i == 0 { 0.0 } else { LATENCY_BUCKETS[i - 1] };
            let within = (rank - below as f64) / n as f64;
            return Some((lower + (upper - lower) * within) * 1e3);
        }
        below += n;
    }
    None
}

impl Recent {
    /// Copies the counters of `routing`'s clusters and endpoints (the admin task, once a
    /// second).
    pub(crate) fn sample(&mut self, routing: &Routing, at: Instant) {
        let mut clusters = HashMap::with_capacity(routing.clusters.len());
        let mut endpoints = HashMap::new();
        for c in &routing.clusters {
            let m = &c.metrics;
            let answers: Vec<u64> = m.responses.iter().map(|r| r.load(Relaxed)).collect();
            clusters.insert(
                c.name().to_string(),
                Counts {
                    answers: answers.iter().sum(),
                    errors: answers[4],
                    latency: m.latency.buckets(),
                },
            );
            for e in &c.endpoints {
                let m = &e.metrics;
                let answers: Vec<u64> = m.responses.iter().map(|r| r.load(Relaxed)).collect();
                let failed: u64 = m.errors.iter().map(|r| r.load(Relaxed)).sum();
                endpoints.insert(
                    (c.name().to_string(), e.authority.to_string()),
                    Counts {
                        answers: answers.iter().sum::<u64>() + failed,
                        errors: answers[4] + failed,
                        latency: m.latency.buckets(),
                    },
                );
            }
        }
        if self.samples.len() == KEPT {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            at,
            clusters,
            endpoints,
        });
    }

    /// The figures of the counters `get` picks from each sample, over the samples of the last
    /// minute that hold them.
    fn figures(&self, get: impl Fn(&Sample) -> Option<&Counts>) -> Option<Figures> {
        let newest = self.samples.back()?;
        let now = get(newest)?;
        let held: Vec<(Instant, &Counts)> = self
            .samples
            .iter()
            .filter(|s| newest.at.duration_since(s.at) <= WINDOW + SAMPLE_EVERY / 2)
            .filter_map(|s| get(s).map(|c| (s.at, c)))
            .collect();
        let (first_at, first) = *held.first()?;
        let window_s = newest.at.duration_since(first_at).as_secs_f64();
        let total = now.since(first);
        let mut series = (Vec::new(), Vec::new(), Vec::new());
        for pair in held.windows(2) {
            let d = pair[1].1.since(pair[0].1);
            let secs = pair[1].0.duration_since(pair[0].0).as_secs_f64().max(1e-3);
            series.0.push(d.answers as f64 / secs);
            series
                .1
                .push((d.answers > 0).then(|| d.errors as f64 / d.answers as f64));
            series.2.push(quantile_ms(&d.latency, 0.99));
        }
        Some(Figures {
            window_s,
            requests: total.answers,
            rate: if window_s > 0.0 {
                total.answers as f64 / window_s
            } else {
                0.0
            },
            error_rate: (total.answers > 0).then(|| total.errors as f64 / total.answers as f64),
            p50_ms: quantile_ms(&total.latency, 0.5),
            p99_ms: quantile_ms(&total.latency, 0.99),
            series,
        })
    }

    /// `last_minute` of a cluster for `/status` (`null` before the first sample).
    pub(crate) fn cluster_json(&self, cluster: &str) -> Value {
        figures_json(self.figures(|s| s.clusters.get(cluster)))
    }

    /// `last_minute` of an endpoint for `/status` (`null` before it was first sampled).
    pub(crate) fn endpoint_json(&self, cluster: &str, address: &str) -> Value {
        let key = (cluster.to_string(), address.to_string());
        figures_json(self.figures(|s| s.endpoints.get(&key)))
    }
}

fn figures_json(f: Option<Figures>) -> Value {
    let Some(f) = f else {
        return Value::Null;
    };
    let round = |v: f64| (v * 1e3).round() / 1e3;
    json!({
        "window_s": round(f.window_s),
        "requests": f.requests,
        "rate_per_s": round(f.rate),
        "error_rate": f.error_rate.map(round),
        "p50_ms": f.p50_ms.map(round),
        "p99_ms": f.p99_ms.map(round),
        "series": {
            "rate_per_s": f.series.0.into_iter().map(round).collect::<Vec<_>>(),
            "error_rate": f.series.1.into_iter().map(|v| v.map(round)).collect::<Vec<_>>(),
            "p99_ms": f.series.2.into_iter().map(|v| v.map(round)).collect::<Vec<_>>(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(pairs: &[(usize, u64)]) -> Buckets {
        let mut b = [0; LATENCY_BUCKETS.len() + 1];
        for &(i, n) in pairs {
            b[i] = n;
        }
        b
    }

    #[test]
    fn quantiles_interpolate_inside_their_bucket() {
        assert_eq!(quantile_ms(&hist(&[]), 0.5), None);
        // 100 observations in (10 ms, 25 ms]: the median is half-way, p99 near the top.
        let b = hist(&[(5, 100)]);
        assert!((quantile_ms(&b, 0.5).unwrap() - 17.5).abs() < 1e-9);
        assert!((quantile_ms(&b, 0.99).unwrap() - 24.85).abs() < 1e-9);
        // 99 fast ones in (0, 0.5 ms] and one slow one in (1 s, 2.5 s]: p99 still fast, the
        // maximum slow.
        let b = hist(&[(0, 99), (11, 1)]);
        assert!(quantile_ms(&b, 0.99).unwrap() <= 0.5);
        assert!(quantile_ms(&b, 1.0).unwrap() > 1000.0);
        // Past the last bound: the last bound.
        let b = hist(&[(LATENCY_BUCKETS.len(), 3)]);
        assert_eq!(quantile_ms(&b, 0.5), Some(10_000.0));
    }
}
