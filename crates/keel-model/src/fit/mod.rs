//! Fitting a model of a cluster from keel proxy's access log: per endpoint, the latency of
//! successes (empirical quantiles and the best family of [`crate::vocab::Latency`], with its
//! Kolmogorov-Smirnov distance), how it fails (fast errors, hangs to the timeout, resets: rates
//! with Wilson intervals), its concurrency capacity when latency rises with the calls in flight
//! (Little's law); and the arrival rate with its burstiness (index of dispersion of counts).
//!
//! [`fit_log`] refuses, with a typed [`FitError`], what it cannot fit: too few requests, no
//! endpoint recorded, several clusters and none chosen. [`scenario`] turns a fit into a
//! simulator scenario (and its editable TOML); [`synth`] writes logs from a known model, for
//! tests and benchmarks.

pub mod envoy;
pub mod haproxy;
pub mod inference;
pub mod log;
pub mod nginx;
pub mod scenario;
pub mod synth;
mod template;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use serde::Serialize;

use crate::stats::wilson95;
use crate::vocab::{Latency, LatencyDist};
pub use log::{read_log, FitError, LineError, Log, RequestRecord, TryClass, TryRecord};

/// Fewest requests (in the chosen cluster and window) a fit accepts by default.
pub const MIN_REQUESTS: u64 = 100;
/// Fewest successes of an endpoint from which its latency family is fitted (below, the
/// cluster's pooled successes stand in).
pub const MIN_SUCCESSES: u64 = 20;
/// Samples an in-flight level needs to count in the capacity fit.
const MIN_LEVEL_SAMPLES: u64 = 30;
/// Latency at the highest in-flight level must be this many times the unloaded latency before
/// a capacity is inferred.
const CAPACITY_RISE: f64 = 1.25;

/// What to fit.
#[derive(Debug, Clone, Default)]
pub struct FitOptions {
    /// The cluster; `None`: the only one in the window.
    pub cluster: Option<String>,
    /// Only requests that ended within this long of the log's last line.
    pub since: Option<Duration>,
    /// Fewest requests; `None`: [`MIN_REQUESTS`].
    pub min_requests: Option<u64>,
}

/// A rate with its 95 % Wilson interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rate {
    /// Events.
    pub count: u64,
    /// Out of this many.
    pub of: u64,
    /// count / of.
    pub share: f64,
    /// Wilson 95 % interval.
    pub ci95: [f64; 2],
}

impl Rate {
    fn new(count: u64, of: u64) -> Rate {
        let (lo, hi) = wilson95(count, of);
        Rate {
            count,
            of,
            share: count as f64 / of.max(1) as f64,
            ci95: [lo, hi],
        }
    }
}

/// An endpoint's success latency.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LatencyFit {
    /// Successes the fit is made of (after the capacity fit, only those that did not queue).
    pub samples: u64,
    /// Empirical mean, in ms.
    pub mean_ms: f64,
    /// Empirical quantiles, in ms.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// The family chosen (the smallest Kolmogorov-Smirnov distance), in the vocabulary the
    /// simulator reads.
    pub family: Latency,
    /// Its KS distance to the empirical distribution (`None` for `fixed`, chosen when the
    /// latencies hardly vary).
    pub ks: Option<f64>,
    /// The 95 % critical value of KS for this many samples (1.36 / sqrt(n)): a distance above
    /// it is a detectable misfit (with many samples, any real log shows one; the distance says
    /// how large).
    pub ks_critical: f64,
    /// Every family tried, with its KS distance.
    pub candidates: Vec<(String, f64)>,
    /// `(lower ms, upper ms, count)` bins of the samples, for the report's histogram.
    #[serde(skip)]
    pub histogram: Vec<(f64, f64, u64)>,
    /// True when the endpoint had too few successes and the cluster's pooled fit stands in.
    pub pooled: bool,
}

/// How an endpoint fails.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureFit {
    /// Errors answered without waiting (failure statuses, refused connections).
    pub error: Rate,
    /// Tries that ran to the timeout.
    pub timeout: Rate,
    /// Connections closed or reset before the whole answer.
    pub reset: Rate,
    /// Median time of an error, in ms.
    pub error_ms: Option<f64>,
    /// Median time of a reset, in ms.
    pub reset_ms: Option<f64>,
}

/// A concurrency limit inferred from latency rising with the calls in flight.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityFit {
    /// Calls the endpoint serves at once: the highest in-flight level (this call included)
    /// whose mean latency is still the unloaded one; a call that finds this many others waits.
    /// By Little's law the endpoint then completes at most `concurrency / service` calls a
    /// second.
    pub concurrency: u32,
    /// Mean success latency at the lowest in-flight level, in ms (the service time S).
    pub service_ms: f64,
    /// `(calls at the endpoint with this one, samples, mean latency ms)` per level.
    pub levels: Vec<(u32, u64, f64)>,
}

/// One endpoint's fitted behaviour.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EndpointFit {
    /// Its address, as logged.
    pub name: String,
    /// Tries it got.
    pub tries: u64,
    /// Its share of the cluster's tries (what the running strategy gave it).
    pub share: f64,
    /// Latency of its successes.
    pub latency: LatencyFit,
    /// How it fails.
    pub failures: FailureFit,
    /// Its concurrency limit, when the log shows one.
    pub capacity: Option<CapacityFit>,
    /// Whether its in-flight counts came from the log (`tries[].in_flight`) or were
    /// reconstructed from the tries' start and end times.
    pub in_flight_logged: bool,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Arrival {
    /// Requests per second over the window.
    pub rate_per_s: f64,
    /// Variance over mean of the request counts per `window_s` (1 for Poisson arrivals; above
    /// 1: bursts the simulation's Poisson arrivals leave out).
    pub dispersion: f64,
    /// Width of the counting windows, in seconds.
    pub window_s: f64,
    /// Mean requests in flight at the cluster (rate x mean duration, Little's law).
    pub mean_in_flight: f64,
}

/// A fitted model of one cluster.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FittedModel {
    /// The cluster.
    pub cluster: String,
    /// First and last request of the window (RFC 3339).
    pub from: String,
    /// Last.
    pub to: String,
    /// Seconds between them.
    pub seconds: f64,
    /// Requests in the window.
    pub requests: u64,
    /// Tries attributed to an endpoint.
    pub tries: u64,
    /// Arrivals.
    pub arrival: Arrival,
    /// The per-try timeout the log shows (median time of the tries that timed out), in ms.
    pub timeout_ms: Option<f64>,
    /// Every endpoint, in order of first appearance.
    pub endpoints: Vec<EndpointFit>,
    /// What the fit had to leave out, in words.
    pub notes: Vec<String>,
}

/// Whose access log it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogFormat {
    /// keel proxy's JSON lines.
    Keel,
    /// NGINX, in the user's `log_format`.
    Nginx(nginx::Format),
    /// HAProxy's `option httplog` default format.
    Haproxy,
    /// Envoy, in its default format or the one given.
    Envoy(envoy::Format),
}

/// Reads a log of any [`LogFormat`] into the shared records, one line at a time.
pub fn read_log_as(input: impl std::io::BufRead, format: &LogFormat) -> Result<Log, FitError> {
    match format {
        LogFormat::Keel => read_log(input),
        LogFormat::Nginx(f) => log::read_lines(input, "NGINX log_format", |l| f.read(l)),
        LogFormat::Haproxy => log::read_lines(input, "HAProxy httplog", haproxy::read),
        LogFormat::Envoy(f) => log::read_lines(input, "Envoy", |l| f.read(l)),
    }
}

/// Reads and fits in one go (streaming parse; see [`read_log`]).
pub fn fit_reader(
    input: impl std::io::BufRead,
    opts: &FitOptions,
) -> Result<FittedModel, FitError> {
    let log = read_log(input)?;
    fit_log(&log, opts)
}

/// Fits one cluster of a read log.
pub fn fit_log(log: &Log, opts: &FitOptions) -> Result<FittedModel, FitError> {
    if log.skipped > 0 && log.skipped * 100 > log.lines {
        let (first, why) = log.first_skipped.clone().unwrap_or_default();
        return Err(FitError::Unparsable {
            format: log.format,
            hint: match log.format {
                "keel proxy's JSON" => "keel advise reads the proxy's `format = \"json\"` log by default; --log-format names another balancer's",
                "Envoy" => "check --log-format, and --envoy-log-format: without it the log must be in Envoy's default format; Istio's default is --envoy-log-format istio, any other the format string your access logger was given",
                _ => "check --log-format (and for NGINX, that --nginx-log-format is the log_format the file was written with)",
            },
            lines: log.lines,
            skipped: log.skipped,
            first,
            why,
        });
    }
    let timed = log.requests.iter().any(|r| r.start > 0.0);
    if !timed && !log.requests.is_empty() {
        return Err(FitError::NoTimes);
    }
    let last_end = log
        .requests
        .iter()
        .map(|r| r.start + f64::from(r.duration_ms) / 1e3)
        .fold(f64::NEG_INFINITY, f64::max);
    let cutoff = opts
        .since
        .map_or(f64::NEG_INFINITY, |s| last_end - s.as_secs_f64());
    let in_window = |start: f64, ms: f32| start > 0.0 && start + f64::from(ms) / 1e3 >= cutoff;

    let mut per_cluster = vec![0u64; log.clusters.len()];
    for r in &log.requests {
        if in_window(r.start, r.duration_ms) {
            per_cluster[r.cluster as usize] += 1;
        }
    }
    let present: Vec<(String, u64)> = log
        .clusters
        .iter()
        .zip(&per_cluster)
        .filter(|(_, &n)| n > 0)
        .map(|(c, &n)| (c.clone(), n))
        .collect();
    let cluster = match &opts.cluster {
        Some(name) => match log.clusters.iter().position(|c| c == name) {
            Some(i) if per_cluster[i] > 0 => i as u16,
            _ => {
                return Err(FitError::UnknownCluster {
                    name: name.clone(),
                    since: opts.since.is_some(),
                    known: present.iter().map(|(c, _)| c.clone()).collect(),
                })
            }
        },
        None if present.len() > 1 => return Err(FitError::MixedClusters { clusters: present }),
        None => match per_cluster.iter().position(|&n| n > 0) {
            Some(i) => i as u16,
            None => {
                return Err(FitError::TooFewLines {
                    cluster: String::new(),
                    have: 0,
                    need: opts.min_requests.unwrap_or(MIN_REQUESTS),
                })
            }
        },
    };
    let cluster_name = log.clusters[cluster as usize].clone();
    let requests: Vec<&RequestRecord> = log
        .requests
        .iter()
        .filter(|r| r.cluster == cluster && in_window(r.start, r.duration_ms))
        .collect();
    let need = opts.min_requests.unwrap_or(MIN_REQUESTS);
    if (requests.len() as u64) < need {
        return Err(FitError::TooFewLines {
            cluster: cluster_name,
            have: requests.len() as u64,
            need,
        });
    }
    let tries: Vec<&TryRecord> = log
        .tries
        .iter()
        .filter(|t| t.cluster == cluster && in_window(t.start, t.duration_ms))
        .collect();
    if tries.is_empty() {
        return Err(FitError::NoEndpoints {
            cluster: cluster_name,
            multi_try: log.multi_try_lines,
        });
    }

    let mut notes = Vec::new();
    if log.skipped > 0 {
        let shown: Vec<String> = log
            .unreadable
            .iter()
            .take(5)
            .map(|(n, why)| format!("line {n}: {why}"))
            .collect();
        notes.push(format!(
            "{} of {} lines could not be read as {} lines and were left out ({}{})",
            log.skipped,
            log.lines,
            log.format,
            shown.join("; "),
            if log.skipped as usize > shown.len() {
                "; ..."
            } else {
                ""
            }
        ));
    }
    if log.unattributed > 0 {
        notes.push(format!(
            "{} requests reached no endpoint (no server available: the balancer's own failure); they count in the arrivals, not in any endpoint's fit",
            log.unattributed
        ));
    }
    if log.proxy_side > 0 {
        notes.push(format!(
            "{} requests were ended by the balancer itself (not an endpoint's doing) and left out of the per-endpoint fit",
            log.proxy_side
        ));
    }
    if log.multi_try_lines > 0 {
        notes.push(format!(
            "{} requests with several tries left out of the per-endpoint fit (the log names only the last try's endpoint{}); their earlier tries failed somewhere, so the failure shares are biased low by up to {:.2} points",
            log.multi_try_lines,
            if log.format == "keel proxy's JSON" {
                "; the `tries` field records every try"
            } else {
                ""
            },
            log.multi_try_lines as f64 / (log.tries.len() as u64 + log.multi_try_lines).max(1) as f64 * 100.0
        ));
    }

    let arrival = fit_arrival(&requests);
    let first = requests
        .iter()
        .map(|r| r.start)
        .fold(f64::INFINITY, f64::min);
    let last = requests
        .iter()
        .map(|r| r.start + f64::from(r.duration_ms) / 1e3)
        .fold(f64::NEG_INFINITY, f64::max);

    let timeouts: Vec<f32> = tries
        .iter()
        .filter(|t| t.class == TryClass::Timeout)
        .map(|t| t.duration_ms)
        .collect();
    let timeout_ms = median(timeouts);

    // Group tries by endpoint (only endpoints of this cluster, in order of first appearance).
    let mut order: Vec<u16> = Vec::new();
    let mut by_endpoint: Vec<Vec<&TryRecord>> = vec![Vec::new(); log.endpoints.len()];
    for t in &tries {
        if by_endpoint[t.endpoint as usize].is_empty() {
            order.push(t.endpoint);
        }
        by_endpoint[t.endpoint as usize].push(t);
    }
    let all_ok: Vec<f64> = tries
        .iter()
        .filter(|t| t.class == TryClass::Ok)
        .map(|t| f64::from(t.duration_ms))
        .collect();
    let pooled = fit_latency(all_ok);
    let total_tries = tries.len() as u64;
    let mut endpoints = Vec::new();
    for e in order {
        let ts = &by_endpoint[e as usize];
        let fit = fit_endpoint(&log.endpoints[e as usize], ts, total_tries, pooled.as_ref());
        if fit.latency.pooled {
            notes.push(format!(
                "endpoint {}: {} successes, too few for its own latency fit; the cluster's pooled fit stands in",
                fit.name, fit.latency.samples
            ));
        }
        endpoints.push(fit);
    }
    Ok(FittedModel {
        cluster: cluster_name,
        from: log::format_rfc3339(first),
        to: log::format_rfc3339(last),
        seconds: last - first,
        requests: requests.len() as u64,
        tries: total_tries,
        arrival,
        timeout_ms,
        endpoints,
        notes,
    })
}

fn median(mut v: Vec<f32>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mid = v.len() / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, f32::total_cmp);
    Some(f64::from(*m))
}

fn fit_arrival(requests: &[&RequestRecord]) -> Arrival {
    let n = requests.len();
    let t0 = requests
        .iter()
        .map(|r| r.start)
        .fold(f64::INFINITY, f64::min);
    let t1 = requests
        .iter()
        .map(|r| r.start)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = (t1 - t0).max(1e-3);
    let rate = (n.saturating_sub(1)).max(1) as f64 / span;
    // Windows holding about 10 requests on average, at least 10 ms, and at least 10 of them.
    let window = (10.0 / rate).max(0.01).min(span / 10.0).max(1e-3);
    let bins = ((span / window).floor() as usize).clamp(1, 1 << 22);
    let mut counts = vec![0u32; bins];
    for r in requests {
        let i = ((r.start - t0) / window) as usize;
        if i < bins {
            counts[i] += 1;
        }
    }
    let mean = counts.iter().map(|&c| f64::from(c)).sum::<f64>() / bins as f64;
    let var = counts
        .iter()
        .map(|&c| (f64::from(c) - mean).powi(2))
        .sum::<f64>()
        / (bins.max(2) - 1) as f64;
    let mean_duration = requests
        .iter()
        .map(|r| f64::from(r.duration_ms))
        .sum::<f64>()
        / n.max(1) as f64
        / 1e3;
    Arrival {
        rate_per_s: rate,
        dispersion: if mean > 0.0 { var / mean } else { f64::NAN },
        window_s: window,
        mean_in_flight: rate * mean_duration,
    }
}

fn fit_endpoint(
    name: &str,
    tries: &[&TryRecord],
    total_tries: u64,
    pooled: Option<&LatencyFit>,
) -> EndpointFit {
    let n = tries.len() as u64;
    let count = |c: TryClass| tries.iter().filter(|t| t.class == c).count() as u64;
    let durations = |c: TryClass| -> Vec<f32> {
        tries
            .iter()
            .filter(|t| t.class == c)
            .map(|t| t.duration_ms)
            .collect()
    };
    let failures = FailureFit {
        error: Rate::new(count(TryClass::Error), n),
        timeout: Rate::new(count(TryClass::Timeout), n),
        reset: Rate::new(count(TryClass::Reset), n),
        error_ms: median(durations(TryClass::Error)),
        reset_ms: median(durations(TryClass::Reset)),
    };

    // In flight at each try's pick: logged, or rebuilt from the tries' intervals.
    let in_flight_logged = tries.iter().all(|t| t.in_flight.is_some());
    let in_flight: Vec<u32> = if in_flight_logged {
        tries.iter().map(|t| t.in_flight.unwrap_or(0)).collect()
    } else {
        rebuild_in_flight(tries)
    };
    let ok: Vec<(u32, f64)> = tries
        .iter()
        .zip(&in_flight)
        .filter(|(t, _)| t.class == TryClass::Ok)
        .map(|(t, &f)| (f + 1, f64::from(t.duration_ms)))
        .collect();
    let capacity = fit_capacity(&ok);
    let samples: Vec<f64> = match &capacity {
        // The service time is what calls that did not queue took.
        Some(c) => ok
            .iter()
            .filter(|(level, _)| *level <= c.concurrency)
            .map(|&(_, ms)| ms)
            .collect(),
        None => ok.iter().map(|&(_, ms)| ms).collect(),
    };
    let latency = if (samples.len() as u64) < MIN_SUCCESSES {
        let mut p = pooled
            .cloned()
            .unwrap_or_else(|| default_latency_fit(&samples));
        p.pooled = true;
        p.samples = samples.len() as u64;
        p
    } else {
        fit_latency(samples).expect("at least MIN_SUCCESSES samples")
    };
    EndpointFit {
        name: name.to_string(),
        tries: n,
        share: n as f64 / total_tries.max(1) as f64,
        latency,
        failures,
        capacity,
        in_flight_logged,
    }
}

/// For an endpoint without successes anywhere in the cluster: a fixed latency at the mean of
/// what there is (or 10 ms); it only matters for resets and errors that take the usual time.
fn default_latency_fit(samples: &[f64]) -> LatencyFit {
    let mean = if samples.is_empty() {
        10.0
    } else {
        samples.iter().sum::<f64>() / samples.len() as f64
    };
    LatencyFit {
        samples: 0,
        mean_ms: mean,
        p50_ms: mean,
        p90_ms: mean,
        p99_ms: mean,
        p999_ms: mean,
        family: Latency::fixed(ms_duration(mean)),
        ks: None,
        ks_critical: 1.0,
        candidates: Vec::new(),
        histogram: Vec::new(),
        pooled: true,
    }
}

/// Calls at the endpoint when each try was picked, from the tries' start and end times.
fn rebuild_in_flight(tries: &[&TryRecord]) -> Vec<u32> {
    let mut order: Vec<usize> = (0..tries.len()).collect();
    order.sort_by(|&a, &b| tries[a].start.total_cmp(&tries[b].start));
    let mut ends: BinaryHeap<Reverse<u64>> = BinaryHeap::new();
    let mut out = vec![0u32; tries.len()];
    for i in order {
        let t = tries[i];
        let start_us = (t.start * 1e6) as u64;
        while ends.peek().is_some_and(|Reverse(e)| *e <= start_us) {
            ends.pop();
        }
        out[i] = ends.len() as u32;
        ends.push(Reverse(start_us + (f64::from(t.duration_ms) * 1e3) as u64));
    }
    out
}

fn fit_capacity(ok: &[(u32, f64)]) -> Option<CapacityFit> {
    let top = ok.iter().map(|&(l, _)| l).max()? as usize;
    if top > 1 << 16 {
        return None;
    }
    // Per level: count, sum, sum of squares.
    let mut sums = vec![(0u64, 0.0f64, 0.0f64); top + 1];
    for &(l, ms) in ok {
        let s = &mut sums[l as usize];
        s.0 += 1;
        s.1 += ms;
        s.2 += ms * ms;
    }
    let levels: Vec<(u32, u64, f64, f64)> = sums
        .iter()
        .enumerate()
        .filter(|(_, s)| s.0 >= MIN_LEVEL_SAMPLES)
        .map(|(l, &(n, s, s2))| {
            let mean = s / n as f64;
            let var = (s2 / n as f64 - mean * mean).max(0.0);
            (l as u32, n, mean, (var / n as f64).sqrt())
        })
        .collect();
    if levels.len() < 3 {
        return None;
    }
    let (first, _, service, _) = levels[0];
    let &(_, _, highest, _) = levels.last()?;
    if first != 1 || highest < CAPACITY_RISE * service {
        return None;
    }
    // A call that finds c others in service waits: the limit is the last level before the
    // mean latency rises beyond its noise (three standard errors, and at least 10 %).
    let rise = levels
        .iter()
        .position(|&(_, _, mean, se)| mean > service * 1.1 && mean > service + 3.0 * se)?;
    if rise == 0 {
        return None;
    }
    let c = levels[rise - 1].0;
    // Levels must be contiguous around the step, or the step is not located.
    if levels[rise].0 != c + 1 {
        return None;
    }
    Some(CapacityFit {
        concurrency: c,
        service_ms: service,
        levels: levels.iter().map(|&(l, n, m, _)| (l, n, m)).collect(),
    })
}

fn ms_duration(ms: f64) -> Duration {
    Duration::from_nanos((ms.max(0.0) * 1e6).round() as u64)
}

/// Fits the latency families to `samples` (ms); `None` when there are none.
pub fn fit_latency(mut samples: Vec<f64>) -> Option<LatencyFit> {
    samples.retain(|x| x.is_finite() && *x >= 0.0);
    if samples.is_empty() {
        return None;
    }
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let q = |p: f64| samples[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    let mean = samples.iter().sum::<f64>() / n as f64;
    // Log-normal by the moments of the logarithm (zeros floored at 1 us).
    let logs: Vec<f64> = samples.iter().map(|x| x.max(1e-3).ln()).collect();
    let mu = logs.iter().sum::<f64>() / n as f64;
    let sigma = (logs.iter().map(|l| (l - mu).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64).sqrt();
    let ks_of = |cdf: &dyn Fn(f64) -> f64| {
        let mut d: f64 = 0.0;
        for (i, &x) in samples.iter().enumerate() {
            let f = cdf(x);
            d = d
                .max((f - i as f64 / n as f64).abs())
                .max(((i + 1) as f64 / n as f64 - f).abs());
        }
        d
    };
    let ks_exp = ks_of(&|x: f64| 1.0 - (-x / mean).exp());
    let ks_ln = ks_of(&|x: f64| normal_cdf((x.max(1e-3).ln() - mu) / sigma.max(1e-12)));
    let candidates = vec![
        ("exponential".to_string(), ks_exp),
        ("lognormal".to_string(), ks_ln),
    ];
    let (family, ks) = if sigma < 0.02 {
        (Latency::fixed(ms_duration(mean)), None)
    } else if ks_ln <= ks_exp {
        (
            Latency {
                // The vocabulary's log-normal is given by its mean: exp(mu + sigma^2 / 2).
                mean: ms_duration((mu + sigma * sigma / 2.0).exp()),
                dist: LatencyDist::LogNormal {
                    sigma: (sigma * 1000.0).round() / 1000.0,
                },
            },
            Some(ks_ln),
        )
    } else {
        (
            Latency {
                mean: ms_duration(mean),
                dist: LatencyDist::Exponential,
            },
            Some(ks_exp),
        )
    };
    Some(LatencyFit {
        samples: n as u64,
        mean_ms: mean,
        p50_ms: q(0.5),
        p90_ms: q(0.9),
        p99_ms: q(0.99),
        p999_ms: q(0.999),
        family,
        ks,
        ks_critical: 1.36 / (n as f64).sqrt(),
        candidates,
        histogram: histogram(&samples),
        pooled: false,
    })
}

/// 30 log-spaced bins from the 0.1th to the 99.9th percentile of sorted samples.
fn histogram(sorted: &[f64]) -> Vec<(f64, f64, u64)> {
    let n = sorted.len();
    let lo = sorted[n / 1000].max(1e-3);
    let hi = sorted[(n - 1) - (n - 1) / 1000].max(lo * 1.01);
    const BINS: usize = 30;
    let ratio = (hi / lo).ln() / BINS as f64;
    let mut counts = vec![0u64; BINS];
    for &x in sorted {
        if x < lo || x > hi {
            continue;
        }
        let i = (((x.max(1e-3) / lo).ln() / ratio) as usize).min(BINS - 1);
        counts[i] += 1;
    }
    (0..BINS)
        .map(|i| {
            (
                lo * (ratio * i as f64).exp(),
                lo * (ratio * (i + 1) as f64).exp(),
                counts[i],
            )
        })
        .collect()
}

/// The standard normal CDF (Abramowitz and Stegun 7.1.26, error below 1.5e-7).
pub fn normal_cdf(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

impl LatencyFit {
    /// The fitted family's CDF at `ms`.
    pub fn family_cdf(&self, ms: f64) -> f64 {
        let mean = self.family.mean.as_secs_f64() * 1e3;
        match self.family.dist {
            LatencyDist::Fixed => f64::from(u8::from(ms >= mean)),
            LatencyDist::Exponential => 1.0 - (-ms / mean).exp(),
            LatencyDist::LogNormal { sigma } => {
                let mu = mean.ln() - sigma * sigma / 2.0;
                normal_cdf((ms.max(1e-9).ln() - mu) / sigma.max(1e-12))
            }
        }
    }
}
