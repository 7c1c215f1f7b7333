//! An open-loop load generator: Poisson arrivals at a fixed rate, bounded in count, each sent to
//! one of several URLs drawn at random (so each URL gets a Poisson stream of its own share), with
//! no limit on requests in flight (an arrival never waits for an earlier answer, as the
//! simulator's `kind = "open"` load).
//!
//! Arrivals are scheduled at absolute times from the run's start (an exponential gap after the
//! previous one, from a seeded generator) and sent when tokio's timer wakes for them: the timer's
//! granularity (1 ms) and a busy machine delay a send past its schedule, which the report states
//! as `lag`. Latency runs from the send to the end of the answer's body. Each URL has a pool of
//! kept-alive connections: a request takes an idle one or opens one, and gives it back after a
//! complete answer (a connection that failed or timed out is closed).
//!
//! The first `warmup` arrivals are sent and answered like the others but not measured. The
//! quantiles' 95 % intervals come from batch means: the measured requests in arrival order cut
//! into [`BATCHES`] batches, a Student-t interval over the batches' quantiles (consecutive
//! batches of a queue are correlated, so the interval is a little narrow at high load).
//!
//! Answers that carry `x-keel-service-us` ([`crate::backend::SERVICE_HEADER`], what a
//! `keel backend` actually spent on the request) are summarised as `service`: what the servers
//! served, to compare with what they were asked for.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, Uri};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::SERVICE_HEADER;
use crate::loadgen::{connect, resolve_url, Conn, LoadError};

/// Batches of the batch-means intervals.
pub const BATCHES: usize = 10;

/// What to run.
#[derive(Clone, Debug)]
pub struct OpenLoopSpec {
    /// `http://host:port/path` URLs; each arrival goes to one drawn uniformly at random.
    pub targets: Vec<String>,
    /// Arrivals per second, over all targets (> 0).
    pub rate: f64,
    /// Measured requests (>= [`BATCHES`]).
    pub requests: u64,
    /// Arrivals sent before the measured ones, not measured.
    pub warmup: u64,
    /// Limit on one request: connect, send, and read the whole answer (> 0).
    pub timeout: Duration,
    /// Seed of the arrival times and of the targets' draw.
    pub seed: u64,
}

/// Quantiles of a sample, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Quantiles {
    /// Values in the sample.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

impl Quantiles {
    /// Of values in milliseconds (sorted here; nearest rank).
    pub fn of(mut xs: Vec<f64>) -> Self {
        if xs.is_empty() {
            return Self::default();
        }
        xs.sort_by(f64::total_cmp);
        Self {
            count: xs.len() as u64,
            mean: xs.iter().sum::<f64>() / xs.len() as f64,
            p50: nearest_rank(&xs, 0.5),
            p99: nearest_rank(&xs, 0.99),
            p999: nearest_rank(&xs, 0.999),
            max: xs[xs.len() - 1],
        }
    }
}

fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpenLoopReport {
    /// Measured requests sent.
    pub requests: u64,
    /// Measured requests answered 2xx.
    pub succeeded: u64,
    /// Measured requests that timed out.
    pub timeouts: u64,
    /// Measured requests that failed otherwise (transport error, non-2xx).
    pub errors: u64,
    /// Measured requests sent to each target, in the spec's order.
    pub per_target: Vec<u64>,
    /// Latency of the measured requests (failed ones at the time they failed).
    pub latency: Quantiles,
    /// 95 % batch-means intervals of `latency`'s p50, p99 and p99.9.
    pub latency_ci95: [[f64; 2]; 3],
    /// What the servers actually spent on the measured requests, from `x-keel-service-us`
    /// (count 0 when no answer carried it).
    pub service: Quantiles,
    /// How late sends started against their schedule.
    pub lag: Quantiles,
    /// Wall time from the first arrival's schedule to the last answer.
    pub elapsed: Duration,
    /// Wall time over which the measured arrivals were scheduled.
    pub measured_span: Duration,
}

impl OpenLoopReport {
    /// Measured arrivals per second of their schedule.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.measured_span.as_secs_f64().max(1e-9)
    }
}

struct Target {
    addr: SocketAddr,
    host: HeaderValue,
    path: Uri,
    idle: Mutex<Vec<Conn>>,
}

struct Sample {
    index: u64,
    target: usize,
    latency_ms: f64,
    lag_ms: f64,
    outcome: Outcome,
    service_ms: Option<f64>,
}

#[derive(PartialEq)]
enum Outcome {
    Ok,
    Timeout,
    Error,
}

/// Runs the arrivals and reports what it measured. Fails before sending anything if the spec is
/// invalid or a URL does not resolve.
pub async fn run(spec: OpenLoopSpec) -> Result<OpenLoopReport, LoadError> {
    let bad = |m: &str| Err(LoadError(m.to_string()));
    if spec.targets.is_empty() {
        return bad("at least one target URL");
    }
    if !(spec.rate.is_finite() && spec.rate > 0.0) {
        return bad("rate must be a positive number");
    }
    if spec.requests < BATCHES as u64 {
        return bad("requests must be at least 10");
    }
    if spec.timeout.is_zero() {
        return bad("timeout must be > 0");
    }
    let mut targets = Vec::with_capacity(spec.targets.len());
    for url in &spec.targets {
        let (addr, host, path) = resolve_url(url).await?;
        targets.push(Arc::new(Target {
            addr,
            host,
            path,
            idle: Mutex::new(Vec::new()),
        }));
    }
    let total = spec.warmup + spec.requests;
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Sample>();
    let start = Instant::now();
    let mut at = 0.0f64;
    let mut first_measured = start;
    let mut last_measured = start;
    for index in 0..total {
        let u: f64 = rng.gen();
        at += -(1.0 - u).ln() / spec.rate;
        let due = start + Duration::from_secs_f64(at);
        if index == spec.warmup {
            first_measured = due;
        }
        last_measured = due;
        let which = rng.gen_range(0..targets.len());
        tokio::time::sleep_until(due.into()).await;
        let target = targets[which].clone();
        let tx = tx.clone();
        let timeout = spec.timeout;
        tokio::spawn(async move {
            let sent = Instant::now();
            let result = tokio::time::timeout(timeout, request(&target)).await;
            let latency_ms = sent.elapsed().as_secs_f64() * 1e3;
            let (outcome, service_ms) = match result {
                Ok(Ok((status, service))) if (200..300).contains(&status) => (Outcome::Ok, service),
                Ok(Ok((_, service))) => (Outcome::Error, service),
                Ok(Err(())) => (Outcome::Error, None),
                Err(_) => (Outcome::Timeout, None),
            };
            let _ = tx.send(Sample {
                index,
                target: which,
                latency_ms,
                lag_ms: sent.saturating_duration_since(due).as_secs_f64() * 1e3,
                outcome,
                service_ms,
            });
        });
    }
    drop(tx);
    let mut samples = Vec::with_capacity(spec.requests as usize);
    while let Some(s) = rx.recv().await {
        if s.index >= spec.warmup {
            samples.push(s);
        }
    }
    let elapsed = start.elapsed();
    samples.sort_by_key(|s| s.index);
    let mut report = OpenLoopReport {
        requests: samples.len() as u64,
        per_target: vec![0; targets.len()],
        elapsed,
        measured_span: last_measured.saturating_duration_since(first_measured),
        ..OpenLoopReport::default()
    };
    for s in &samples {
        report.per_target[s.target] += 1;
        match s.outcome {
            Outcome::Ok => report.succeeded += 1,
            Outcome::Timeout => report.timeouts += 1,
            Outcome::Error => report.errors += 1,
        }
    }
    report.latency = Quantiles::of(samples.iter().map(|s| s.latency_ms).collect());
    report.service = Quantiles::of(samples.iter().filter_map(|s| s.service_ms).collect());
    report.lag = Quantiles::of(samples.iter().map(|s| s.lag_ms).collect());
    let per_batch = samples.len() / BATCHES;
    let batches: Vec<Quantiles> = samples
        .chunks(per_batch.max(1))
        .take(BATCHES)
        .map(|c| Quantiles::of(c.iter().map(|s| s.latency_ms).collect()))
        .collect();
    let point = [report.latency.p50, report.latency.p99, report.latency.p999];
    for (i, pick) in [
        (|q: &Quantiles| q.p50) as fn(&Quantiles) -> f64,
        |q| q.p99,
        |q| q.p999,
    ]
    .iter()
    .enumerate()
    {
        let xs: Vec<f64> = batches.iter().map(pick).collect();
        report.latency_ci95[i] = match keel_model::stats::student_t95(&xs) {
            Some((lo, hi)) => [lo.min(point[i]).max(0.0), hi.max(point[i])],
            None => [point[i], point[i]],
        };
    }
    Ok(report)
}

/// One GET on an idle kept-alive connection of `target` (or a new one): its status and the
/// service time it reports.
async fn request(target: &Target) -> Result<(u16, Option<f64>), ()> {
    let idle = target.idle.lock().expect("no panic holds the lock").pop();
    let mut conn = match idle {
        Some(c) if !c.sender.is_closed() => c,
        _ => connect(target.addr).await.map_err(|_| ())?,
    };
    conn.sender.ready().await.map_err(|_| ())?;
    let req = Request::get(target.path.clone())
        .header(HOST, target.host.clone())
        .body(Empty::<Bytes>::new())
        .expect("a GET with a valid path is a valid request");
    let resp = conn.sender.send_request(req).await.map_err(|_| ())?;
    let status = resp.status().as_u16();
    let service = resp
        .headers()
        .get(SERVICE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|us| us as f64 / 1e3);
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        frame.map_err(|_| ())?;
    }
    target
        .idle
        .lock()
        .expect("no panic holds the lock")
        .push(conn);
    Ok((status, service))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let q = Quantiles::of((1..=1000).rev().map(f64::from).collect());
        assert_eq!(q.count, 1000);
        assert_eq!(q.p50, 500.0);
        assert_eq!(q.p99, 990.0);
        assert_eq!(q.p999, 999.0);
        assert_eq!(q.max, 1000.0);
        assert!((q.mean - 500.5).abs() < 1e-9);
        assert_eq!(Quantiles::of(Vec::new()), Quantiles::default());
    }
}
