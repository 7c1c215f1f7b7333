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
//!
//! [`run_client_side`] balances the arrivals itself instead of drawing a URL: each arrival goes
//! to one of several clients drawn at random, and that client's own keel-balance balancer picks
//! the endpoint (the simulator's client-side placement with an open load, `clients` balancers
//! that each see only their own calls). A strategy that balances on load reports (prequal) gets
//! its probes sent after each pick, as `GET /keel/load` on kept-alive connections of their own,
//! and, when asked, the report every answer carries, as keel's proxy reads them.
//!
//! Every arrival is also kept as a [`Record`] (when it was due, where it went, what it took),
//! for distributions and for time series such as the share of calls a server got per 100 ms.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, Uri};
use keel_balance::{
    Balancer, EndpointId, LoadReport, Outcome, Pick, PickContext, LATENCY_HEADER, LOAD_PATH,
    RIF_HEADER,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::SERVICE_HEADER;
use crate::loadgen::{connect, resolve_url, BalancerFactory, Conn, LoadError};

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

/// Client-side balancing of an open loop ([`run_client_side`]).
#[derive(Clone)]
pub struct ClientSide {
    /// The endpoints, in the balancers' order.
    pub endpoints: Vec<SocketAddr>,
    /// Clients the arrivals are spread over, each with its own balancer (>= 1).
    pub clients: usize,
    /// Makes client i's balancer (over `endpoints`, in that order).
    pub make_balancer: BalancerFactory,
    /// Request path, e.g. `/`.
    pub path: String,
    /// Hand the load report of every answer (`x-keel-rif`, `x-keel-latency-us`) to the balancer
    /// that picked, as keel's proxy does; probes are sent either way.
    pub reports_on_answers: bool,
}

impl std::fmt::Debug for ClientSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientSide")
            .field("endpoints", &self.endpoints)
            .field("clients", &self.clients)
            .field("path", &self.path)
            .field("reports_on_answers", &self.reports_on_answers)
            .finish_non_exhaustive()
    }
}

/// How one arrival ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordOutcome {
    /// A 2xx answer, read to its end.
    Ok,
    /// Cut at the spec's timeout.
    Timeout,
    /// A transport error, a non-2xx answer, or (client-side) no endpoint to pick.
    Error,
}

/// One arrival, warm-up included.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    /// When it was due, in milliseconds from the run's start.
    pub due_ms: f64,
    /// Latency, from the send to the end of the answer (or to the failure), ms.
    pub latency_ms: f64,
    /// What the server said it spent on it ([`SERVICE_HEADER`]), ms.
    pub service_ms: Option<f64>,
    /// The URL it went to (an index into the spec's targets), or client-side the endpoint
    /// picked (an index into [`ClientSide::endpoints`]); `None`: no endpoint was picked.
    pub target: Option<usize>,
    /// The answer's `x-backend` (an index into [`OpenLoopReport::backends`]).
    pub backend: Option<u32>,
    /// How it ended.
    pub outcome: RecordOutcome,
    /// Whether it is one of the measured arrivals (not the warm-up).
    pub measured: bool,
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
    /// Every arrival in arrival order, warm-up included.
    pub records: Vec<Record>,
    /// The `x-backend` values seen, in order of first appearance ([`Record::backend`]).
    pub backends: Vec<String>,
    /// Client-side: latency of the load probes answered (count 0 when none were sent).
    pub probes: Quantiles,
    /// Client-side: load probes that failed or timed out.
    pub probe_failures: u64,
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
    due_ms: f64,
    target: Option<usize>,
    latency_ms: f64,
    lag_ms: f64,
    outcome: RecordOutcome,
    service_ms: Option<f64>,
    backend: Option<HeaderValue>,
}

/// What an answer said.
struct Answer {
    status: u16,
    service_ms: Option<f64>,
    backend: Option<HeaderValue>,
    load: Option<LoadReport>,
}

/// The client-side state: one balancer per client, and the probes' connections.
struct Clients {
    balancers: Vec<Balancer>,
    /// Per client: each endpoint's id in its balancer, by endpoint index.
    ids: Vec<Vec<EndpointId>>,
    probe_targets: Vec<Arc<Target>>,
    on_answers: bool,
    epoch: Instant,
    probe_latency: Mutex<Vec<f64>>,
    probe_failures: std::sync::atomic::AtomicU64,
    /// Probes sent and not yet answered or failed.
    probes_in_flight: std::sync::atomic::AtomicU64,
}

impl Clients {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn index_of(&self, client: usize, id: EndpointId) -> Option<usize> {
        self.ids[client].iter().position(|&i| i == id)
    }
}

/// Runs the arrivals and reports what it measured. Fails before sending anything if the spec is
/// invalid or a URL does not resolve.
pub async fn run(spec: OpenLoopSpec) -> Result<OpenLoopReport, LoadError> {
    if spec.targets.is_empty() {
        return Err(LoadError("at least one target URL".into()));
    }
    run_inner(spec, None).await
}

/// Runs the arrivals with client-side balancing: each arrival goes to a client drawn at random
/// and that client's balancer picks the endpoint (`spec.targets` is not used; the report's
/// `per_target` counts picks per endpoint). Fails before sending anything if the spec is
/// invalid.
pub async fn run_client_side(
    spec: OpenLoopSpec,
    clients: ClientSide,
) -> Result<OpenLoopReport, LoadError> {
    if clients.endpoints.is_empty() {
        return Err(LoadError("at least one endpoint".into()));
    }
    if clients.clients == 0 {
        return Err(LoadError("at least one client".into()));
    }
    if !clients.path.starts_with('/') {
        return Err(LoadError(format!(
            "path {:?} must start with '/'",
            clients.path
        )));
    }
    run_inner(spec, Some(clients)).await
}

fn target_of(addr: SocketAddr, path: &str) -> Result<Arc<Target>, LoadError> {
    let bad = |e: String| LoadError(format!("endpoint {addr}{path}: {e}"));
    Ok(Arc::new(Target {
        addr,
        host: HeaderValue::from_str(&addr.to_string()).map_err(|e| bad(e.to_string()))?,
        path: path
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| bad(e.to_string()))?,
        idle: Mutex::new(Vec::new()),
    }))
}

async fn run_inner(
    spec: OpenLoopSpec,
    client_side: Option<ClientSide>,
) -> Result<OpenLoopReport, LoadError> {
    let bad = |m: &str| Err(LoadError(m.to_string()));
    if !(spec.rate.is_finite() && spec.rate > 0.0) {
        return bad("rate must be a positive number");
    }
    if spec.requests < BATCHES as u64 {
        return bad("requests must be at least 10");
    }
    if spec.timeout.is_zero() {
        return bad("timeout must be > 0");
    }
    let mut targets = Vec::new();
    let mut clients: Option<Arc<Clients>> = None;
    match &client_side {
        None => {
            for url in &spec.targets {
                let (addr, host, path) = resolve_url(url).await?;
                targets.push(Arc::new(Target {
                    addr,
                    host,
                    path,
                    idle: Mutex::new(Vec::new()),
                }));
            }
        }
        Some(cs) => {
            let mut probe_targets = Vec::new();
            for &addr in &cs.endpoints {
                targets.push(target_of(addr, &cs.path)?);
                probe_targets.push(target_of(addr, LOAD_PATH)?);
            }
            let balancers: Vec<Balancer> = (0..cs.clients).map(|i| (cs.make_balancer)(i)).collect();
            let mut ids = Vec::with_capacity(balancers.len());
            for b in &balancers {
                let eps = b.endpoints();
                let mut mine = Vec::with_capacity(cs.endpoints.len());
                for addr in &cs.endpoints {
                    let a = addr.to_string();
                    let Some(e) = eps.iter().find(|e| e.address() == a) else {
                        return Err(LoadError(format!(
                            "the balancer has no endpoint {a} (its endpoints must be the spec's)"
                        )));
                    };
                    mine.push(e.id());
                }
                ids.push(mine);
            }
            clients = Some(Arc::new(Clients {
                balancers,
                ids,
                probe_targets,
                on_answers: cs.reports_on_answers,
                epoch: Instant::now(),
                probe_latency: Mutex::new(Vec::new()),
                probe_failures: std::sync::atomic::AtomicU64::new(0),
                probes_in_flight: std::sync::atomic::AtomicU64::new(0),
            }));
        }
    }
    let total = spec.warmup + spec.requests;
    let mut probe_ids: Vec<EndpointId> = Vec::new();
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
        // URLs: one drawn at random; client-side: a client drawn at random, and its pick (made
        // when the arrival is sent, with the balancer's state then).
        let client = match &clients {
            None => rng.gen_range(0..targets.len()),
            Some(c) => rng.gen_range(0..c.balancers.len()),
        };
        tokio::time::sleep_until(due.into()).await;
        let tx = tx.clone();
        let timeout = spec.timeout;
        let due_ms = at * 1e3;
        let Some(c) = clients.clone() else {
            let target = targets[client].clone();
            tokio::spawn(async move {
                let sent = Instant::now();
                let result = tokio::time::timeout(timeout, request(&target)).await;
                let _ = tx.send(sample(index, due, due_ms, Some(client), sent, result));
            });
            continue;
        };
        let lb = &c.balancers[client];
        let Some(pick) = lb.pick(&PickContext::new(c.now())) else {
            let sent = Instant::now();
            let _ = tx.send(sample(index, due, due_ms, None, sent, Ok(Err(()))));
            continue;
        };
        let which = c.index_of(client, pick.id());
        probe_ids.clear();
        lb.probe_targets(c.now(), &mut probe_ids);
        for &id in &probe_ids {
            if let Some(i) = c.index_of(client, id) {
                c.probes_in_flight
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::spawn(probe(c.clone(), client, id, i, timeout));
            }
        }
        let target = which.map(|i| targets[i].clone());
        tokio::spawn(async move {
            let sent = Instant::now();
            let result = match &target {
                Some(t) => {
                    tokio::time::timeout(timeout, request_reporting(t, &c, client, pick.id())).await
                }
                None => Ok(Err(())),
            };
            let ok = matches!(&result, Ok(Ok(a)) if a.status < 500);
            finish(&c, client, pick, ok);
            let _ = tx.send(sample(index, due, due_ms, which, sent, result));
        });
    }
    drop(tx);
    let mut all = Vec::with_capacity(total as usize);
    while let Some(s) = rx.recv().await {
        all.push(s);
    }
    let elapsed = start.elapsed();
    all.sort_by_key(|s| s.index);
    let mut report = OpenLoopReport {
        per_target: vec![0; targets.len()],
        elapsed,
        measured_span: last_measured.saturating_duration_since(first_measured),
        ..OpenLoopReport::default()
    };
    report.records = Vec::with_capacity(all.len());
    for s in &all {
        let backend = s.backend.as_ref().map(|b| {
            let name = String::from_utf8_lossy(b.as_bytes());
            match report.backends.iter().position(|x| *x == name) {
                Some(i) => i as u32,
                None => {
                    report.backends.push(name.into_owned());
                    (report.backends.len() - 1) as u32
                }
            }
        });
        report.records.push(Record {
            due_ms: s.due_ms,
            latency_ms: s.latency_ms,
            service_ms: s.service_ms,
            target: s.target,
            backend,
            outcome: s.outcome,
            measured: s.index >= spec.warmup,
        });
    }
    if let Some(c) = &clients {
        // The last probes (each bounded by the timeout) before their count.
        let waited = Instant::now();
        while c
            .probes_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
            && waited.elapsed() < spec.timeout
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let probes = std::mem::take(&mut *c.probe_latency.lock().expect("no panic holds it"));
        report.probes = Quantiles::of(probes);
        report.probe_failures = c.probe_failures.load(std::sync::atomic::Ordering::Relaxed);
    }
    let samples: Vec<&Sample> = all.iter().filter(|s| s.index >= spec.warmup).collect();
    report.requests = samples.len() as u64;
    for s in &samples {
        if let Some(t) = s.target {
            report.per_target[t] += 1;
        }
        match s.outcome {
            RecordOutcome::Ok => report.succeeded += 1,
            RecordOutcome::Timeout => report.timeouts += 1,
            RecordOutcome::Error => report.errors += 1,
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

/// A finished arrival as a sample.
fn sample(
    index: u64,
    due: Instant,
    due_ms: f64,
    target: Option<usize>,
    sent: Instant,
    result: Result<Result<Answer, ()>, tokio::time::error::Elapsed>,
) -> Sample {
    let latency_ms = sent.elapsed().as_secs_f64() * 1e3;
    let (outcome, service_ms, backend) = match result {
        Ok(Ok(a)) if (200..300).contains(&a.status) => (RecordOutcome::Ok, a.service_ms, a.backend),
        Ok(Ok(a)) => (RecordOutcome::Error, a.service_ms, a.backend),
        Ok(Err(())) => (RecordOutcome::Error, None, None),
        Err(_) => (RecordOutcome::Timeout, None, None),
    };
    Sample {
        index,
        due_ms,
        target,
        latency_ms,
        lag_ms: sent.saturating_duration_since(due).as_secs_f64() * 1e3,
        outcome,
        service_ms,
        backend,
    }
}

/// Ends a client's pick: a success unless the call failed or the server answered 5xx (as the
/// closed-loop generator counts them); a pick cut by the timeout is a failure.
fn finish(c: &Clients, client: usize, pick: Pick, ok: bool) {
    let outcome = if ok {
        Outcome::Success
    } else {
        Outcome::Failure
    };
    c.balancers[client].finish(pick, outcome, c.now());
}

/// A request whose answer's load report goes to the picking balancer when the clients read
/// answers' reports (at the answer's head, as the proxy reads it).
async fn request_reporting(
    target: &Target,
    c: &Clients,
    client: usize,
    id: EndpointId,
) -> Result<Answer, ()> {
    let on_head = |load: Option<LoadReport>| {
        if let (true, Some(load)) = (c.on_answers, load) {
            c.balancers[client].report_load(id, load, c.now());
        }
    };
    request_with(target, on_head).await
}

/// One load probe of endpoint `index` for `client`'s balancer; its report counts when it
/// arrives.
async fn probe(c: Arc<Clients>, client: usize, id: EndpointId, index: usize, timeout: Duration) {
    let sent = Instant::now();
    let result = tokio::time::timeout(timeout, request(&c.probe_targets[index])).await;
    match result {
        Ok(Ok(Answer {
            status: 200..=299,
            load: Some(load),
            ..
        })) => {
            c.probe_latency
                .lock()
                .expect("no panic holds it")
                .push(sent.elapsed().as_secs_f64() * 1e3);
            c.balancers[client].report_load(id, load, c.now());
        }
        _ => {
            c.probe_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    c.probes_in_flight
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
}

/// One GET on an idle kept-alive connection of `target` (or a new one): what the answer said.
async fn request(target: &Target) -> Result<Answer, ()> {
    request_with(target, |_| {}).await
}

/// As [`request`], calling `on_head` with the answer's load report when its head arrives.
async fn request_with(
    target: &Target,
    on_head: impl FnOnce(Option<LoadReport>),
) -> Result<Answer, ()> {
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
    let headers = resp.headers();
    let service_ms = headers
        .get(SERVICE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|us| us as f64 / 1e3);
    let backend = headers.get("x-backend").cloned();
    let load = LoadReport::from_headers(
        headers.get(RIF_HEADER).map(|v| v.as_bytes()),
        headers.get(LATENCY_HEADER).map(|v| v.as_bytes()),
    );
    on_head(load);
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        frame.map_err(|_| ())?;
    }
    target
        .idle
        .lock()
        .expect("no panic holds the lock")
        .push(conn);
    Ok(Answer {
        status,
        service_ms,
        backend,
        load,
    })
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
