//! A bounded HTTP/1.1 load generator: a fixed number of requests from a fixed number of
//! workers, each call with a timeout, stopping by itself.
//!
//! Each worker keeps one kept-alive hyper connection per endpoint it talks to, so `concurrency`
//! is both the number of requests in flight and the number of connections per endpoint. A
//! connection that fails (refused, reset, timed out, garbage) is dropped and the next call opens
//! a new one.
//!
//! A *request* is `calls_per_request` calls made one after another, as a service that calls a
//! cluster k times per request (the reliability model's k). It succeeds only if every call gets
//! a 2xx. Which [`Client`] makes it decides what happens after a failed call: an application
//! stops there and returns the error (the default, so `calls` may be less than
//! `requests * calls_per_request`); the reliability model's client makes all k calls, which is
//! what lets a closed loop's placement of the calls after a failure show.
//!
//! With [`LoadOptions::request_key`], every call of a request carries that header with one value
//! per request (`r<index>`), so a balancer that hashes the header sends a request's calls to one
//! endpoint; a client-side balancer hashes the same value with [`keel_balance::hash_key`].
//!
//! [`Target::ClientSide`] runs a keel [`Balancer`] in the load generator itself, as a client-side
//! load balancer does: each call picks an endpoint, calls it directly and finishes the pick with
//! the outcome (failure: transport error, timeout or 5xx). The balancer's clock is the run's
//! start.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, HOST};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use keel_balance::{Balancer, Outcome, PickContext};
use tokio::net::TcpStream;

/// Builds the balancer of one worker (its argument is the worker's index, e.g. to vary a seed).
pub type BalancerFactory = Arc<dyn Fn(usize) -> Balancer + Send + Sync>;

/// Where the load goes.
#[derive(Clone)]
pub enum Target {
    /// One URL, `http://host:port/path` (a proxy or a single backend).
    Url(String),
    /// Client-side balancing with one balancer shared by every worker (one client process with
    /// `concurrency` requests in flight).
    ClientSide {
        /// The endpoints, in the balancer's order (a pick's address is used when it parses as a
        /// socket address; its index into this list otherwise).
        endpoints: Vec<SocketAddr>,
        /// The balancer every call picks with.
        balancer: Arc<Balancer>,
        /// Request path, e.g. `/`.
        path: String,
    },
    /// Client-side balancing with one balancer per worker (many clients, each with one request
    /// in flight and its own view of the in-flight counts: the experiment E5 setting).
    ClientSidePerWorker {
        /// The endpoints, in the balancers' order.
        endpoints: Vec<SocketAddr>,
        /// Makes worker i's balancer.
        make_balancer: BalancerFactory,
        /// Request path, e.g. `/`.
        path: String,
    },
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Url(url) => f.debug_tuple("Url").field(url).finish(),
            Target::ClientSide {
                endpoints, path, ..
            } => f
                .debug_struct("ClientSide")
                .field("endpoints", endpoints)
                .field("path", path)
                .finish_non_exhaustive(),
            Target::ClientSidePerWorker {
                endpoints, path, ..
            } => f
                .debug_struct("ClientSidePerWorker")
                .field("endpoints", endpoints)
                .field("path", path)
                .finish_non_exhaustive(),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Where the calls go.
    pub target: Target,
    /// Number of requests (each `calls_per_request` calls).
    pub requests: u64,
    /// Workers, i.e. requests in flight at once (>= 1).
    pub concurrency: usize,
    /// Limit on one call: connect, send, and read the whole response (> 0).
    pub timeout: Duration,
    /// Calls per request, made in sequence; the request succeeds iff all succeed (>= 1).
    pub calls_per_request: u32,
}

impl LoadSpec {
    /// `requests` single-call requests to `target` from 32 workers with a 1 s timeout.
    pub fn new(target: Target, requests: u64) -> Self {
        Self {
            target,
            requests,
            concurrency: 32,
            timeout: Duration::from_secs(1),
            calls_per_request: 1,
        }
    }

    /// The longest a run can take if every call times out: the default overall deadline.
    pub fn worst_case_duration(&self) -> Duration {
        let rounds = self.requests.div_ceil(self.concurrency.max(1) as u64);
        self.timeout
            .saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX))
            .saturating_mul(self.calls_per_request.max(1))
    }

    fn check(&self) -> Result<(), LoadError> {
        let bad = |msg: &str| Err(LoadError(msg.to_string()));
        if self.concurrency == 0 {
            return bad("concurrency must be at least 1");
        }
        if self.calls_per_request == 0 {
            return bad("calls_per_request must be at least 1");
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0");
        }
        match &self.target {
            Target::Url(_) => Ok(()),
            Target::ClientSide { path, .. } | Target::ClientSidePerWorker { path, .. } => {
                if path.starts_with('/') {
                    Ok(())
                } else {
                    Err(LoadError(format!("path {path:?} must start with '/'")))
                }
            }
        }
    }
}

/// What a client does after a failed call of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Client {
    /// Stops at the first failed call and returns the error, as applications do.
    #[default]
    StopsAtFirstFailure,
    /// Makes all k calls whatever their outcome (the reliability model's client).
    AllCalls,
}

impl Client {
    /// Its name in reports: `stops at first failure` or `all calls`.
    pub fn name(self) -> &'static str {
        match self {
            Client::StopsAtFirstFailure => "stops at first failure",
            Client::AllCalls => "all calls",
        }
    }
}

/// The value of [`LoadOptions::request_key`] for request `index` (0-based, in the order requests
/// start): what a balancer hashing that header hashes.
pub fn request_key_value(index: u64) -> String {
    format!("r{index}")
}

/// Extra controls of a run.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// What a request does after a failed call.
    pub client: Client,
    /// The name of a header set on every call of a request to one value per request
    /// ([`request_key_value`]); none by default. A name that is not a header name fails the run.
    pub request_key: Option<String>,
    /// Stop starting requests after this long, and cut calls still running then (counted as
    /// timeouts). Default: [`LoadSpec::worst_case_duration`] plus 5 s, which a run reaches
    /// only if something is wrong with the timer.
    pub deadline: Option<Duration>,
    /// Incremented once per finished request, for a progress bar.
    pub progress: Option<Arc<AtomicU64>>,
}

/// A load specification that cannot run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError(pub String);

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid load: {}", self.0)
    }
}

impl std::error::Error for LoadError {}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Requests made (all of them unless the deadline cut the run).
    pub requests: u64,
    /// Requests whose every call got a 2xx.
    pub succeeded: u64,
    /// Calls made.
    pub calls: u64,
    /// Calls that got a 2xx.
    pub calls_ok: u64,
    /// Calls with a complete response, by status code.
    pub by_status: BTreeMap<u16, u64>,
    /// Calls without a complete response: refused, reset, garbage, timed out.
    pub transport_errors: u64,
    /// The part of `transport_errors` that timed out.
    pub timeouts: u64,
    /// Client-side calls for which the balancer had no endpoint to give.
    pub no_endpoint: u64,
    /// Calls with a complete response, by the `x-backend` header (`"-"` when absent).
    pub per_endpoint: BTreeMap<String, u64>,
    /// Client-side calls by the address the balancer picked, whatever their outcome.
    pub picks: BTreeMap<String, u64>,
    /// Requests by their number of failed calls (index 0: none failed). With
    /// [`Client::StopsAtFirstFailure`] no request has more than one.
    pub failed_calls_per_request: Vec<u64>,
    /// Calls made right after a failed call of the same request, and how many of them failed
    /// ([`Client::AllCalls`]): how a failure places the next call (a fast failure whose client
    /// picks again before anyone else takes the next server in a rotation, which is healthy).
    pub after_failure: [u64; 2],
    /// Median request latency (all requests, failed ones included).
    pub latency_p50: Duration,
    /// 90th percentile request latency.
    pub latency_p90: Duration,
    /// 99th percentile request latency.
    pub latency_p99: Duration,
    /// Slowest request.
    pub latency_max: Duration,
    /// Mean request latency.
    pub latency_mean: Duration,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Whether the overall deadline cut the run short.
    pub deadline_hit: bool,
}

impl LoadReport {
    /// Share of requests that succeeded (0 when none ran).
    pub fn success_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.succeeded as f64 / self.requests as f64
        }
    }

    /// Share of calls that got a 2xx (0 when none ran).
    pub fn call_success_rate(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.calls_ok as f64 / self.calls as f64
        }
    }

    /// Wilson score 95% confidence interval of the request success rate ((0, 1) with no
    /// requests).
    pub fn ci95(&self) -> (f64, f64) {
        keel_model::stats::wilson95(self.succeeded, self.requests)
    }

    /// Requests finished per second of wall time.
    pub fn requests_per_second(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.requests as f64 / secs
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for LoadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (lo, hi) = self.ci95();
        writeln!(
            f,
            "requests {} in {:.2?} ({:.0}/s), succeeded {} = {:.4} (95% CI {:.4}..{:.4})",
            self.requests,
            self.elapsed,
            self.requests_per_second(),
            self.succeeded,
            self.success_rate(),
            lo,
            hi
        )?;
        let statuses: Vec<String> = self
            .by_status
            .iter()
            .map(|(s, n)| format!("{s}: {n}"))
            .collect();
        writeln!(
            f,
            "calls {} ok {}; status {{{}}}; transport errors {} (timeouts {}){}",
            self.calls,
            self.calls_ok,
            statuses.join(", "),
            self.transport_errors,
            self.timeouts,
            if self.deadline_hit {
                "; DEADLINE HIT"
            } else {
                ""
            }
        )?;
        write!(
            f,
            "latency p50 {:.2?} p90 {:.2?} p99 {:.2?} max {:.2?} mean {:.2?}",
            self.latency_p50,
            self.latency_p90,
            self.latency_p99,
            self.latency_max,
            self.latency_mean
        )
    }
}

/// Runs the load and reports what it measured.
///
/// # Panics
/// If the spec is invalid (see [`try_run`]).
pub async fn run(spec: LoadSpec) -> LoadReport {
    match try_run(spec, LoadOptions::default()).await {
        Ok(report) => report,
        Err(e) => panic!("{e}"),
    }
}

/// Runs the load with extra options. Fails before sending anything if the spec is invalid
/// (zero concurrency, calls or timeout; a URL that is not `http://host:port/...` or whose host
/// does not resolve; a path without a leading `/`).
pub async fn try_run(spec: LoadSpec, options: LoadOptions) -> Result<LoadReport, LoadError> {
    spec.check()?;
    let plan = Arc::new(Plan::new(&spec, options).await?);
    let workers = (spec.concurrency as u64).min(spec.requests) as usize;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(workers);
    for index in 0..workers {
        let balancer = match &spec.target {
            Target::Url(_) => None,
            Target::ClientSide { balancer, .. } => Some(balancer.clone()),
            Target::ClientSidePerWorker { make_balancer, .. } => {
                Some(Arc::new(make_balancer(index)))
            }
        };
        tasks.push(tokio::spawn(worker(plan.clone(), balancer, start)));
    }
    let mut total = WorkerStats::default();
    for task in tasks {
        match task.await {
            Ok(stats) => total.merge(stats),
            Err(e) => return Err(LoadError(format!("a load worker failed: {e}"))),
        }
    }
    Ok(total.into_report(start.elapsed()))
}

/// Everything a worker needs, resolved once.
struct Plan {
    requests: u64,
    calls_per_request: u32,
    client: Client,
    request_key: Option<hyper::header::HeaderName>,
    timeout: Duration,
    deadline: Instant,
    next: AtomicU64,
    progress: Option<Arc<AtomicU64>>,
    /// `Url`: the one address and its Host header; client-side: none.
    url_addr: Option<(SocketAddr, HeaderValue)>,
    path: Uri,
    endpoints: Vec<SocketAddr>,
}

impl Plan {
    async fn new(spec: &LoadSpec, options: LoadOptions) -> Result<Plan, LoadError> {
        let (url_addr, path, endpoints) = match &spec.target {
            Target::Url(url) => {
                let (addr, host, path) = resolve_url(url).await?;
                (Some((addr, host)), path, Vec::new())
            }
            Target::ClientSide {
                endpoints, path, ..
            }
            | Target::ClientSidePerWorker {
                endpoints, path, ..
            } => {
                let path: Uri = path
                    .parse()
                    .map_err(|e| LoadError(format!("path {path:?}: {e}")))?;
                (None, path, endpoints.clone())
            }
        };
        let request_key = match &options.request_key {
            Some(name) => Some(
                hyper::header::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|e| LoadError(format!("request key header {name:?}: {e}")))?,
            ),
            None => None,
        };
        let deadline = options
            .deadline
            .unwrap_or_else(|| spec.worst_case_duration() + Duration::from_secs(5));
        Ok(Plan {
            requests: spec.requests,
            calls_per_request: spec.calls_per_request,
            client: options.client,
            request_key,
            timeout: spec.timeout,
            deadline: Instant::now() + deadline,
            next: AtomicU64::new(0),
            progress: options.progress,
            url_addr,
            path,
            endpoints,
        })
    }
}

pub(crate) async fn resolve_url(url: &str) -> Result<(SocketAddr, HeaderValue, Uri), LoadError> {
    let bad = |why: String| LoadError(format!("URL {url:?}: {why}"));
    let uri: Uri = url.parse().map_err(|e| bad(format!("{e}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(bad("only http:// is supported".into()));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| bad("no host".into()))?
        .clone();
    let port = authority.port_u16().unwrap_or(80);
    let addr = tokio::net::lookup_host((authority.host(), port))
        .await
        .map_err(|e| bad(format!("cannot resolve: {e}")))?
        .next()
        .ok_or_else(|| bad("host resolves to no address".into()))?;
    let host = HeaderValue::from_str(authority.as_str()).map_err(|e| bad(format!("{e}")))?;
    let path: Uri = uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .parse()
        .map_err(|e| bad(format!("{e}")))?;
    Ok((addr, host, path))
}

/// One worker's counts, merged at the end.
#[derive(Default)]
struct WorkerStats {
    requests: u64,
    succeeded: u64,
    calls: u64,
    calls_ok: u64,
    by_status: BTreeMap<u16, u64>,
    transport_errors: u64,
    timeouts: u64,
    no_endpoint: u64,
    per_endpoint: BTreeMap<String, u64>,
    picks: BTreeMap<String, u64>,
    failed_calls_per_request: Vec<u64>,
    after_failure: [u64; 2],
    latencies: Vec<Duration>,
    deadline_hit: bool,
}

impl WorkerStats {
    fn merge(&mut self, o: WorkerStats) {
        self.requests += o.requests;
        self.succeeded += o.succeeded;
        self.calls += o.calls;
        self.calls_ok += o.calls_ok;
        for (k, v) in o.by_status {
            *self.by_status.entry(k).or_default() += v;
        }
        self.transport_errors += o.transport_errors;
        self.timeouts += o.timeouts;
        self.no_endpoint += o.no_endpoint;
        for (k, v) in o.per_endpoint {
            *self.per_endpoint.entry(k).or_default() += v;
        }
        for (k, v) in o.picks {
            *self.picks.entry(k).or_default() += v;
        }
        if self.failed_calls_per_request.len() < o.failed_calls_per_request.len() {
            self.failed_calls_per_request
                .resize(o.failed_calls_per_request.len(), 0);
        }
        for (i, v) in o.failed_calls_per_request.into_iter().enumerate() {
            self.failed_calls_per_request[i] += v;
        }
        self.after_failure[0] += o.after_failure[0];
        self.after_failure[1] += o.after_failure[1];
        self.latencies.extend(o.latencies);
        self.deadline_hit |= o.deadline_hit;
    }

    fn record(&mut self, result: &CallResult) -> bool {
        self.calls += 1;
        match result {
            CallResult::Response { status, backend } => {
                *self.by_status.entry(*status).or_default() += 1;
                *self.per_endpoint.entry(backend.clone()).or_default() += 1;
                let ok = (200..300).contains(status);
                if ok {
                    self.calls_ok += 1;
                }
                ok
            }
            CallResult::Transport { timed_out } => {
                self.transport_errors += 1;
                if *timed_out {
                    self.timeouts += 1;
                }
                false
            }
            CallResult::NoEndpoint => {
                self.no_endpoint += 1;
                false
            }
        }
    }

    fn into_report(mut self, elapsed: Duration) -> LoadReport {
        self.latencies.sort_unstable();
        let pct = |q: f64| percentile(&self.latencies, q);
        let mean = if self.latencies.is_empty() {
            Duration::ZERO
        } else {
            self.latencies.iter().sum::<Duration>() / self.latencies.len() as u32
        };
        LoadReport {
            requests: self.requests,
            succeeded: self.succeeded,
            calls: self.calls,
            calls_ok: self.calls_ok,
            by_status: self.by_status,
            transport_errors: self.transport_errors,
            timeouts: self.timeouts,
            no_endpoint: self.no_endpoint,
            per_endpoint: self.per_endpoint,
            picks: self.picks,
            failed_calls_per_request: self.failed_calls_per_request,
            after_failure: self.after_failure,
            latency_p50: pct(0.50),
            latency_p90: pct(0.90),
            latency_p99: pct(0.99),
            latency_max: self.latencies.last().copied().unwrap_or_default(),
            latency_mean: mean,
            elapsed,
            deadline_hit: self.deadline_hit,
        }
    }
}

/// Nearest-rank percentile of sorted values (zero when empty).
fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

enum CallResult {
    /// A complete response (its `x-backend`, or `"-"`).
    Response { status: u16, backend: String },
    /// No complete response.
    Transport { timed_out: bool },
    /// Client-side: the balancer gave no endpoint.
    NoEndpoint,
}

/// A kept-alive connection; dropping it aborts its task, which closes the socket.
pub(crate) struct Conn {
    pub(crate) sender: SendRequest<Empty<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn worker(plan: Arc<Plan>, balancer: Option<Arc<Balancer>>, epoch: Instant) -> WorkerStats {
    let mut stats = WorkerStats::default();
    let mut conns: HashMap<SocketAddr, Conn> = HashMap::new();
    loop {
        if Instant::now() >= plan.deadline {
            stats.deadline_hit = plan.next.load(Ordering::Relaxed) < plan.requests;
            break;
        }
        let index = plan.next.fetch_add(1, Ordering::Relaxed);
        if index >= plan.requests {
            break;
        }
        let started = Instant::now();
        let key = plan.request_key.as_ref().map(|name| {
            let value = request_key_value(index);
            let hash = keel_balance::hash_key(value.as_bytes());
            let value = HeaderValue::from_str(&value).expect("r<digits> is a header value");
            (name, value, hash)
        });
        let mut failed = 0usize;
        let mut previous_failed = false;
        for _ in 0..plan.calls_per_request {
            let extra = key.as_ref().map(|(n, v, _)| (*n, v));
            let result = match &balancer {
                None => {
                    let (addr, host) = plan.url_addr.clone().expect("a URL target");
                    call(&plan, &mut conns, addr, host, extra).await
                }
                Some(lb) => {
                    let hash = key.as_ref().map(|k| k.2);
                    client_side_call(&plan, lb, &mut conns, epoch, &mut stats, extra, hash).await
                }
            };
            let ok = stats.record(&result);
            if previous_failed {
                stats.after_failure[0] += 1;
                stats.after_failure[1] += u64::from(!ok);
            }
            previous_failed = !ok;
            if !ok {
                failed += 1;
                if plan.client == Client::StopsAtFirstFailure {
                    break;
                }
            }
        }
        stats.requests += 1;
        if failed == 0 {
            stats.succeeded += 1;
        }
        if stats.failed_calls_per_request.len() <= failed {
            stats.failed_calls_per_request.resize(failed + 1, 0);
        }
        stats.failed_calls_per_request[failed] += 1;
        stats.latencies.push(started.elapsed());
        if let Some(p) = &plan.progress {
            p.fetch_add(1, Ordering::Relaxed);
        }
    }
    stats
}

async fn client_side_call(
    plan: &Plan,
    lb: &Balancer,
    conns: &mut HashMap<SocketAddr, Conn>,
    epoch: Instant,
    stats: &mut WorkerStats,
    extra: Option<(&hyper::header::HeaderName, &HeaderValue)>,
    hash: Option<u64>,
) -> CallResult {
    let mut ctx = PickContext::new(epoch.elapsed());
    if let Some(h) = hash {
        ctx = ctx.with_hash_key(h);
    }
    let Some(pick) = lb.pick(&ctx) else {
        return CallResult::NoEndpoint;
    };
    *stats.picks.entry(pick.address().to_string()).or_default() += 1;
    let addr = match pick.address().parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => match plan.endpoints.get(pick.index()) {
            Some(a) => *a,
            None => {
                // Nothing to call: the balancer knows an endpoint the spec does not.
                lb.finish(pick, Outcome::Failure, epoch.elapsed());
                return CallResult::Transport { timed_out: false };
            }
        },
    };
    let host = HeaderValue::from_str(&addr.to_string()).expect("an address is a header value");
    let result = call(plan, conns, addr, host, extra).await;
    let outcome = match &result {
        CallResult::Response { status, .. } if *status < 500 => Outcome::Success,
        _ => Outcome::Failure,
    };
    lb.finish(pick, outcome, epoch.elapsed());
    result
}

/// One call with the per-call timeout (cut shorter by the overall deadline).
async fn call(
    plan: &Plan,
    conns: &mut HashMap<SocketAddr, Conn>,
    addr: SocketAddr,
    host: HeaderValue,
    extra: Option<(&hyper::header::HeaderName, &HeaderValue)>,
) -> CallResult {
    let left = plan.deadline.saturating_duration_since(Instant::now());
    let limit = plan.timeout.min(left);
    let mut conn = conns.remove(&addr);
    match tokio::time::timeout(limit, call_on(&mut conn, addr, host, &plan.path, extra)).await {
        Ok(result) => {
            if let Some(c) = conn {
                conns.insert(addr, c);
            }
            result
        }
        // The connection is in an unknown state: drop it (closes the socket).
        Err(_) => CallResult::Transport { timed_out: true },
    }
}

/// Sends one GET on the kept-alive connection (opening one if needed). On any error the
/// connection is dropped.
async fn call_on(
    slot: &mut Option<Conn>,
    addr: SocketAddr,
    host: HeaderValue,
    path: &Uri,
    extra: Option<(&hyper::header::HeaderName, &HeaderValue)>,
) -> CallResult {
    if !matches!(slot, Some(c) if !c.sender.is_closed()) {
        *slot = None;
        match connect(addr).await {
            Ok(c) => *slot = Some(c),
            Err(_) => return CallResult::Transport { timed_out: false },
        }
    }
    let conn = slot.as_mut().expect("connected above");
    if conn.sender.ready().await.is_err() {
        *slot = None;
        return CallResult::Transport { timed_out: false };
    }
    let mut req = Request::get(path.clone()).header(HOST, host);
    if let Some((name, value)) = extra {
        req = req.header(name, value);
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .expect("a GET with a valid path is a valid request");
    let resp = match conn.sender.send_request(req).await {
        Ok(r) => r,
        Err(_) => {
            *slot = None;
            return CallResult::Transport { timed_out: false };
        }
    };
    let status = resp.status().as_u16();
    let backend = resp
        .headers()
        .get("x-backend")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string();
    // Read the whole body: a reset mid-body is a transport error, not a response.
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            *slot = None;
            return CallResult::Transport { timed_out: false };
        }
    }
    CallResult::Response { status, backend }
}

pub(crate) async fn connect(addr: SocketAddr) -> std::io::Result<Conn> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    let task = tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(Conn { sender, task })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 0.5), Duration::from_millis(50));
        assert_eq!(percentile(&v, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&v, 1.0), Duration::from_millis(100));
        assert_eq!(percentile(&v[..1], 0.99), Duration::from_millis(1));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn worst_case_duration_counts_rounds_and_calls() {
        let mut spec = LoadSpec::new(Target::Url("http://127.0.0.1:1/".into()), 100);
        spec.concurrency = 32;
        spec.calls_per_request = 3;
        spec.timeout = Duration::from_millis(100);
        // 4 rounds of 3 calls of at most 100 ms.
        assert_eq!(spec.worst_case_duration(), Duration::from_millis(1200));
    }
}
