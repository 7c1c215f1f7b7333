//! A small HTTP/1.1 server for experiments, demos and tests, that fails on purpose.
//!
//! [`spawn`] binds a listener and answers every path with a body of
//! [`BackendConfig::body_bytes`] bytes after a latency drawn from [`BackendConfig::latency`],
//! with a `x-backend: <name>` header so that a client can tell which backend answered.
//! `/healthz` answers `ok` the same way (and fails the same way) and is counted apart from the
//! other requests.
//!
//! How it fails is a [`FailureMode`], keel-model's vocabulary, which also says what a caller sees
//! in each mode; the simulator implements the same modes, so a lab row's measured and simulated
//! settings are one value. An error is a `503 Service Unavailable`, but `server-error`'s is a
//! `500 Internal Server Error`. The mode can change while
//! the backend runs ([`BackendHandle::set_fault`]), which is how tests and the lab kill and
//! restore a server:
//!
//! - `refuse` closes the listener and every open connection, as if the process died; any other
//!   mode binds the same port again.
//! - `hang` (and a flap's down phase without `down_fails_after`) reads the request and holds the
//!   connection without an answer until the mode changes or the backend shuts down.
//! - `reset` sends the status line, the headers (with the full `content-length`) and half of the
//!   body, then resets the TCP connection (`SO_LINGER` 0, RST) [`RESET_CUT`] later.
//! - `flap` starts with its up phase when the mode is set; its down phase answers on kept-alive
//!   connections too, so the phases switch exactly on time (use `refuse`, toggled by a driver,
//!   for an up/down cycle of the port itself).
//!
//! A backend has a capacity as a simulated server has one: with [`BackendConfig::concurrency`]
//! N it works on at most N requests at once and the others wait in FIFO order (the work is the
//! latency draw; answers that take no work, a fail-fast 503, a server-error 500 or a hang,
//! never wait, as in the simulator). It keeps keel-balance's [`ServerLoad`] (requests in flight, queued ones included,
//! and the latency they see, queueing included) and reports it on every answer in the
//! [`RIF_HEADER`] and [`LATENCY_HEADER`] headers, and at `GET` [`LOAD_PATH`], which answers at
//! once, takes no place in the queue and is not counted in flight (a backend that hangs does not
//! answer it; one that fails fast does, which is the black hole's bait).
//!
//! With [`BackendConfig::orca`] it also puts an ORCA report on every answer (the
//! `endpoint-load-metrics` header, TEXT or JSON form) over the last full second:
//! `rps_fractional` (requests answered per second), `eps` (5xx answers per second) and
//! `cpu_utilization` = the mean requests in flight (Little's law: the summed latency of the
//! answered requests over the second) divided by the concurrency (1 without a limit).
//!
//! Every answer that took work carries [`SERVICE_HEADER`]: the time its work actually took.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use keel_balance::{
    mix64, LoadReport, OrcaReport, ServerLoad, SharedRng, Ticket, LATENCY_HEADER, LOAD_PATH,
    ORCA_HEADER, RIF_HEADER,
};
use keel_model::vocab::{FailureMode, Latency, LatencySampler, RESET_CUT};
use rand::{Rng, RngCore};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, Semaphore};

/// The header that carries, on every answer that took work, the time the backend actually spent
/// on it in microseconds: from the start of its work (after any wait for a place under
/// `concurrency`) to the end of its latency, the timer's granularity and the scheduler's delays
/// included. The experiments read it to simulate what the backends served, not what they were
/// asked for.
pub const SERVICE_HEADER: &str = "x-keel-service-us";

/// The longest latency a distribution may draw: keeps a heavy tail from parking a call forever.
const MAX_LATENCY: Duration = Duration::from_secs(60);

/// How a backend behaves.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Healthy service time (mean 0: answer at once).
    pub latency: Latency,
    /// The failure mode at start; change it later with [`BackendHandle::set_fault`].
    pub fault: FailureMode,
    /// Size of a 200 response body.
    pub body_bytes: usize,
    /// Value of the `x-backend` header; empty: the bound address.
    pub name: String,
    /// Requests worked on at once; the others wait in FIFO order. `None`: no limit.
    pub concurrency: Option<u32>,
    /// Put an ORCA report on every answer, in this form; `None`: no ORCA header.
    pub orca: Option<OrcaForm>,
    /// Time the latency with [`crate::timer`] (tens of microseconds late) instead of tokio's
    /// timer (which rounds every deadline up to its next millisecond: exponential 10 ms is then
    /// served as about 10 ms + 1.1 ms). Default false.
    pub precise_timer: bool,
}

/// The form of the ORCA header a backend writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrcaForm {
    /// `TEXT cpu_utilization=..., rps_fractional=..., eps=...`.
    Text,
    /// `JSON {"cpu_utilization":..., ...}`.
    Json,
}

/// The window of the ORCA report's rates.
const ORCA_WINDOW: Duration = Duration::from_secs(1);

/// What the ORCA report counts: answers, errors and their summed latency in the current
/// window, and the last full window's rates.
#[derive(Debug, Default)]
struct Rates {
    start: Duration,
    answered: u64,
    errors: u64,
    busy: Duration,
    /// (qps, eps, mean in flight) of the last full window.
    last: Option<(f64, f64, f64)>,
}

impl Rates {
    fn roll(&mut self, now: Duration) {
        let elapsed = now.saturating_sub(self.start);
        if elapsed >= ORCA_WINDOW {
            let secs = elapsed.as_secs_f64();
            self.last = Some((
                self.answered as f64 / secs,
                self.errors as f64 / secs,
                self.busy.as_secs_f64() / secs,
            ));
            *self = Rates {
                start: now,
                last: self.last,
                ..Rates::default()
            };
        }
    }
}

impl Default for BackendConfig {
    /// No latency, no failure, a 64-byte body, named after its address.
    fn default() -> Self {
        Self {
            latency: Latency::fixed(Duration::ZERO),
            fault: FailureMode::None,
            body_bytes: 64,
            name: String::new(),
            concurrency: None,
            orca: None,
            precise_timer: false,
        }
    }
}

/// The fault in force and since when (a flap's phases count from there).
#[derive(Clone, Debug)]
pub(crate) struct Control {
    pub(crate) fault: FailureMode,
    pub(crate) since: Instant,
    pub(crate) shutdown: bool,
}

/// State shared by the listener task, the connections and the handle.
struct Shared {
    latency: LatencySampler,
    body: Bytes,
    name: HeaderValue,
    error_rng: SharedRng,
    latency_rng: SharedRng,
    requests: AtomicU64,
    healthz: AtomicU64,
    load_probes: AtomicU64,
    connections: AtomicU64,
    /// Permits to work (the capacity); `None`: unlimited.
    slots: Option<Semaphore>,
    /// What the backend reports about its load; time is measured from `epoch`.
    load: Mutex<ServerLoad>,
    orca: Option<OrcaForm>,
    precise_timer: bool,
    rates: Mutex<Rates>,
    /// The concurrency the ORCA utilisation is a share of (1 without a limit).
    orca_capacity: f64,
    epoch: Instant,
    control: watch::Sender<Control>,
    listening: watch::Sender<bool>,
}

impl Shared {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn load(&self) -> std::sync::MutexGuard<'_, ServerLoad> {
        self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self) -> LoadReport {
        self.load().report(self.now())
    }

    fn rates(&self) -> std::sync::MutexGuard<'_, Rates> {
        self.rates.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An answered request that arrived at `arrived`.
    fn answered(&self, arrived: Duration, error: bool) {
        if self.orca.is_none() {
            return;
        }
        let now = self.now();
        let mut r = self.rates();
        r.roll(now);
        r.answered += 1;
        r.errors += u64::from(error);
        r.busy += now.saturating_sub(arrived);
    }

    /// The ORCA report of the last full window (zeros before the first).
    fn orca_report(&self) -> OrcaReport {
        let mut r = self.rates();
        r.roll(self.now());
        let (qps, eps, in_flight) = r.last.unwrap_or_default();
        OrcaReport {
            cpu_utilization: in_flight / self.orca_capacity,
            rps_fractional: qps,
            eps,
            ..OrcaReport::default()
        }
    }
}

/// A request counted in flight from its arrival until it is answered ([`Call::finish`]: its
/// latency is learned) or dropped unanswered (its client went away, or the backend hangs or
/// refuses: no longer in flight, nothing learned).
struct Call<'a> {
    shared: &'a Shared,
    ticket: Option<Ticket>,
}

impl<'a> Call<'a> {
    fn arrive(shared: &'a Shared) -> Self {
        let ticket = shared.load().start(shared.now());
        Self {
            shared,
            ticket: Some(ticket),
        }
    }

    fn finish(mut self) {
        if let Some(t) = self.ticket.take() {
            self.shared.load().finish(t, self.shared.now());
        }
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.shared.load().cancel(t);
        }
    }
}

/// A running backend. Dropping it stops the backend too (without waiting).
pub struct BackendHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Starts a backend on `listen` (port 0: an ephemeral port; see [`BackendHandle::addr`]).
/// Random draws (latency, errors of the `error` mode) use a seed derived from the backend's name.
pub async fn spawn(listen: SocketAddr, cfg: BackendConfig) -> io::Result<BackendHandle> {
    spawn_inner(listen, cfg, None).await
}

/// As [`spawn`], with an explicit seed for the random draws. Error draws and latency draws come
/// from two separate streams, so the number of 503s among the first N requests of the `error`
/// mode depends only on the seed, whatever the order in which concurrent requests arrive.
pub async fn spawn_with_seed(
    listen: SocketAddr,
    cfg: BackendConfig,
    seed: u64,
) -> io::Result<BackendHandle> {
    spawn_inner(listen, cfg, Some(seed)).await
}

async fn spawn_inner(
    listen: SocketAddr,
    cfg: BackendConfig,
    seed: Option<u64>,
) -> io::Result<BackendHandle> {
    validate(&cfg)?;
    let listener = bind(listen)?;
    let addr = listener.local_addr()?;
    let name = if cfg.name.is_empty() {
        addr.to_string()
    } else {
        cfg.name.clone()
    };
    let name_header = HeaderValue::from_str(&name).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("backend name {name:?} is not a valid header value"),
        )
    })?;
    let seed = seed.unwrap_or_else(|| keel_balance::hash_key(name.as_bytes()));
    let refusing = cfg.fault == FailureMode::Refuse;
    let (control, _) = watch::channel(Control {
        fault: cfg.fault,
        since: Instant::now(),
        shutdown: false,
    });
    let (listening, _) = watch::channel(!refusing);
    let shared = Arc::new(Shared {
        latency: cfg.latency.sampler(),
        body: Bytes::from(vec![b'x'; cfg.body_bytes]),
        name: name_header,
        error_rng: SharedRng::new(mix64(seed ^ 0xE77)),
        latency_rng: SharedRng::new(mix64(seed ^ 0x1A7)),
        requests: AtomicU64::new(0),
        healthz: AtomicU64::new(0),
        load_probes: AtomicU64::new(0),
        connections: AtomicU64::new(0),
        slots: cfg.concurrency.map(|n| Semaphore::new(n as usize)),
        load: Mutex::new(ServerLoad::default()),
        orca: cfg.orca,
        precise_timer: cfg.precise_timer,
        rates: Mutex::new(Rates::default()),
        orca_capacity: f64::from(cfg.concurrency.unwrap_or(1).max(1)),
        epoch: Instant::now(),
        control,
        listening,
    });
    // A backend that starts refusing keeps its port reserved only by knowing the number.
    let first = if refusing { None } else { Some(listener) };
    let task = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let serve = |stream| {
                tokio::spawn(serve_connection(shared.clone(), stream));
            };
            listen_loop(&shared.control, &shared.listening, first, addr, serve).await;
        })
    };
    Ok(BackendHandle {
        addr,
        shared,
        task: Some(task),
    })
}

fn validate(cfg: &BackendConfig) -> io::Result<()> {
    if cfg.concurrency == Some(0) {
        return Err(invalid("concurrency must be at least 1"));
    }
    cfg.latency.validate().map_err(invalid)?;
    cfg.fault.validate().map_err(invalid)
}

/// An `InvalidInput` error carrying `e` (a typed one stays reachable by downcasting).
fn invalid(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// Binds with `SO_REUSEADDR`, so that a port given up by `Refuse` can be bound again while old
/// connections sit in TIME_WAIT.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

impl BackendHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The value of the `x-backend` header.
    pub fn name(&self) -> &str {
        self.shared.name.to_str().unwrap_or("")
    }

    /// The failure mode in force.
    pub fn fault(&self) -> FailureMode {
        self.shared.control.borrow().fault
    }

    /// Changes the failure mode now. Responses already being produced keep the mode they
    /// started with, except that `refuse` closes every connection and any change ends the
    /// connections held by `hang` (or a flap's hanging down phase). The listener closes or
    /// re-binds asynchronously, within milliseconds; use [`BackendHandle::apply_fault`] to wait
    /// for it. An invalid mode (a slow factor below 1, a zero flap period) is ignored with a
    /// warning.
    pub fn set_fault(&self, fault: FailureMode) {
        set_fault(&self.shared, self.addr, fault);
    }

    /// A handle that changes this backend's failure mode as [`BackendHandle::set_fault`] does,
    /// which a task of its own can hold (e.g. to slow the backend down and back on a schedule)
    /// while the handle stays with its owner for [`BackendHandle::shutdown`].
    pub fn fault_switch(&self) -> FaultSwitch {
        FaultSwitch {
            addr: self.addr,
            shared: self.shared.clone(),
        }
    }

    /// Changes the failure mode and waits until the listener is closed (`refuse`) or accepting
    /// again (any other mode). Fails if re-binding the port does not succeed within 5 s
    /// (another process took it).
    pub async fn apply_fault(&self, fault: FailureMode) -> io::Result<()> {
        fault.validate().map_err(invalid)?;
        let want_listening = fault != FailureMode::Refuse;
        self.set_fault(fault);
        let mut rx = self.shared.listening.subscribe();
        let wait = rx.wait_for(|listening| *listening == want_listening);
        let result = tokio::time::timeout(Duration::from_secs(5), wait)
            .await
            .map(|r| r.map(|_| ()));
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(io::Error::other("the backend has stopped")),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{}: listener did not reach the new state in 5 s", self.addr),
            )),
        }
    }

    /// Requests received so far, other than `/healthz`, whatever their answer.
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// `/healthz` requests received so far.
    pub fn healthz_requests(&self) -> u64 {
        self.shared.healthz.load(Ordering::Relaxed)
    }

    /// Load probes (`GET /keel/load`) received so far.
    pub fn load_probes(&self) -> u64 {
        self.shared.load_probes.load(Ordering::Relaxed)
    }

    /// What the backend reports about its load now (what the headers of an answer sent now
    /// would carry).
    pub fn load_report(&self) -> LoadReport {
        self.shared.report()
    }

    /// Client connections open right now.
    pub fn open_connections(&self) -> u64 {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// Stops listening, closes every connection and waits for the listener task to end.
    pub async fn shutdown(mut self) {
        self.shared.control.send_modify(|c| c.shutdown = true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

fn set_fault(shared: &Shared, addr: SocketAddr, fault: FailureMode) {
    if let Err(e) = fault.validate() {
        tracing::warn!(backend = %addr, "ignoring fault: {e}");
        return;
    }
    shared.control.send_modify(|c| {
        c.fault = fault;
        c.since = Instant::now();
    });
}

/// Changes a backend's failure mode from wherever it is held ([`BackendHandle::fault_switch`]).
#[derive(Clone)]
pub struct FaultSwitch {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultSwitch {
    /// As [`BackendHandle::set_fault`].
    pub fn set(&self, fault: FailureMode) {
        set_fault(&self.shared, self.addr, fault);
    }
}

impl std::fmt::Debug for FaultSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultSwitch")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for BackendHandle {
    fn drop(&mut self) {
        self.shared.control.send_modify(|c| c.shutdown = true);
    }
}

impl std::fmt::Debug for BackendHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendHandle")
            .field("addr", &self.addr)
            .field("name", &self.name())
            .field("fault", &self.fault())
            .field("requests", &self.requests())
            .finish()
    }
}

/// Accepts connections while the fault is not `Refuse`; closes and re-binds the listener as the
/// fault changes; ends at shutdown. `serve` takes each accepted connection (this backend's and
/// the fake inference engine's servers share the loop).
pub(crate) async fn listen_loop<F>(
    control: &watch::Sender<Control>,
    listening: &watch::Sender<bool>,
    mut listener: Option<TcpListener>,
    addr: SocketAddr,
    serve: F,
) where
    F: Fn(TcpStream),
{
    let mut rx = control.subscribe();
    loop {
        let (refuse, shutdown) = {
            let c = rx.borrow_and_update();
            (c.fault == FailureMode::Refuse, c.shutdown)
        };
        if shutdown {
            break;
        }
        if refuse {
            if listener.take().is_some() {
                tracing::debug!(backend = %addr, "listener closed (refuse)");
            }
            listening.send_replace(false);
        } else if listener.is_none() {
            match bind(addr) {
                Ok(l) => {
                    tracing::debug!(backend = %addr, "listener bound again");
                    listener = Some(l);
                }
                Err(e) => {
                    tracing::warn!(backend = %addr, "cannot bind again: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        if listener.is_some() {
            listening.send_replace(true);
        }
        match &listener {
            Some(l) => {
                tokio::select! {
                    accepted = l.accept() => match accepted {
                        Ok((stream, _)) => {
                            serve(stream);
                        }
                        Err(e) => {
                            // Out of file descriptors and the like: back off instead of spinning.
                            tracing::warn!(backend = %addr, "accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    },
                    changed = rx.changed() => if changed.is_err() { break },
                }
            }
            None => {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        }
    }
    drop(listener);
    listening.send_replace(false);
}

/// Serves one connection until the client closes it, a reset fault ends it, or the backend
/// starts refusing or shuts down (then it is dropped as a dying process would drop it).
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    shared.connections.fetch_add(1, Ordering::Relaxed);
    let _open = OpenConnection(shared.clone());
    let svc = shared.clone();
    serve_http1(&shared.control, stream, move |req, reset| {
        handle(svc.clone(), req, reset)
    })
    .await;
}

/// One HTTP/1.1 connection of a testbed server (this backend's, the fake inference engine's):
/// `handle` answers each request (with the connection's reset switch for a `reset` fault),
/// until the client closes, or the server starts refusing or shuts down.
pub(crate) async fn serve_http1<H, F, B>(
    control: &watch::Sender<Control>,
    stream: TcpStream,
    handle: H,
) where
    H: Fn(Request<Incoming>, Arc<AtomicBool>) -> F + Send + 'static,
    F: std::future::Future<Output = Result<Response<B>, io::Error>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let _ = stream.set_nodelay(true);
    let reset = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(ResettableStream {
        inner: stream,
        reset: reset.clone(),
    });
    let service = hyper::service::service_fn(move |req| handle(req, reset.clone()));
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut rx = control.subscribe();
    loop {
        {
            let c = rx.borrow_and_update();
            if c.shutdown || c.fault == FailureMode::Refuse {
                return;
            }
        }
        tokio::select! {
            _ = &mut conn => return,
            changed = rx.changed() => if changed.is_err() { return },
        }
    }
}

/// Counts a connection as open until dropped (however the connection task ends).
struct OpenConnection(Arc<Shared>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The body of a response: whole, or half of it then an error that makes hyper drop the
/// connection (which [`ResettableStream`] turns into a reset).
pub(crate) enum ResponseBody {
    Whole(Option<Bytes>),
    Reset {
        first: Option<Bytes>,
        pause: Pin<Box<tokio::time::Sleep>>,
        reset: Arc<AtomicBool>,
        total: u64,
    },
}

impl ResponseBody {
    pub(crate) fn whole(bytes: Bytes) -> Self {
        ResponseBody::Whole(Some(bytes))
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            ResponseBody::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            ResponseBody::Reset {
                first,
                pause,
                reset,
                ..
            } => {
                if let Some(b) = first.take() {
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                // Pending here lets hyper flush what was written before the reset.
                match pause.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(()) => {
                        reset.store(true, Ordering::Relaxed);
                        Poll::Ready(Some(Err(io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            "injected reset",
                        ))))
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ResponseBody::Whole(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Whole(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ResponseBody::Whole(None) => SizeHint::with_exact(0),
            ResponseBody::Reset { total, .. } => SizeHint::with_exact(*total),
        }
    }
}

fn respond(shared: &Shared, status: StatusCode, body: ResponseBody) -> Response<ResponseBody> {
    let len = body.size_hint().exact().unwrap_or(0);
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert("x-backend", shared.name.clone());
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    h.insert(CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

/// Puts the backend's load report in `resp`'s headers.
fn with_load(shared: &Shared, mut resp: Response<ResponseBody>) -> Response<ResponseBody> {
    let r = shared.report();
    let h = resp.headers_mut();
    h.insert(RIF_HEADER, HeaderValue::from(r.in_flight));
    h.insert(LATENCY_HEADER, HeaderValue::from(r.latency_us()));
    if let Some(form) = shared.orca {
        let report = shared.orca_report();
        let text = match form {
            OrcaForm::Text => report.to_text(),
            OrcaForm::Json => report.to_json(),
        };
        if let Ok(v) = HeaderValue::from_str(&text) {
            h.insert(ORCA_HEADER, v);
        }
    }
    resp
}

/// A load probe's answer: the report, at once (a hanging or refusing backend gives none).
async fn load_probe(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, io::Error> {
    shared.load_probes.fetch_add(1, Ordering::Relaxed);
    let mut body = req.into_body();
    while let Some(frame) = body.frame().await {
        frame.map_err(io::Error::other)?;
    }
    let control = shared.control.borrow().clone();
    match control.fault {
        FailureMode::Refuse => {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "refusing"))
        }
        FailureMode::Hang => return hang(&shared, control.since).await,
        FailureMode::Flap {
            up,
            down,
            down_fails_after: None,
        } if !flap_is_up(control.since, Instant::now(), up, down) => {
            return hang(&shared, control.since).await
        }
        _ => {}
    }
    let r = shared.report();
    let text = format!(
        "{{\"in_flight\":{},\"latency_us\":{}}}\n",
        r.in_flight,
        r.latency_us()
    );
    let resp = respond(
        &shared,
        StatusCode::OK,
        ResponseBody::whole(Bytes::from(text)),
    );
    Ok(with_load(&shared, resp))
}

fn unavailable(shared: &Shared, why: &str) -> Response<ResponseBody> {
    let text = format!("backend {}: {why}\n", shared.name.to_str().unwrap_or(""));
    respond(
        shared,
        StatusCode::SERVICE_UNAVAILABLE,
        ResponseBody::whole(Bytes::from(text)),
    )
}

/// A 500, `server-error`'s answer.
fn server_error(shared: &Shared) -> Response<ResponseBody> {
    let text = format!(
        "backend {}: server-error\n",
        shared.name.to_str().unwrap_or("")
    );
    respond(
        shared,
        StatusCode::INTERNAL_SERVER_ERROR,
        ResponseBody::whole(Bytes::from(text)),
    )
}

/// Whether a flap that started at `since` is in its up phase at `now`.
pub(crate) fn flap_is_up(since: Instant, now: Instant, up: Duration, down: Duration) -> bool {
    let period = (up + down).as_nanos();
    let into = now.saturating_duration_since(since).as_nanos() % period;
    into < up.as_nanos()
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    reset: Arc<AtomicBool>,
) -> Result<Response<ResponseBody>, io::Error> {
    let path = req.uri().path();
    if path == LOAD_PATH {
        return load_probe(shared, req).await;
    }
    let health = path == "/healthz";
    // Health checks take no place in the queue and are not requests in flight.
    let call = (!health).then(|| Call::arrive(&shared));
    let arrived = shared.now();
    let resp = answer(&shared, req, reset, health).await?;
    if let Some(call) = call {
        call.finish();
        shared.answered(arrived, resp.status().is_server_error());
    }
    Ok(with_load(&shared, resp))
}

/// The answer to a request (or to a health check), after waiting for a permit to work when the
/// answer takes work and the backend has a capacity.
async fn answer(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    reset: Arc<AtomicBool>,
    health: bool,
) -> Result<Response<ResponseBody>, io::Error> {
    if health {
        shared.healthz.fetch_add(1, Ordering::Relaxed);
    } else {
        shared.requests.fetch_add(1, Ordering::Relaxed);
    }
    // Read the request body to its end so that the connection can be kept alive.
    let mut body = req.into_body();
    while let Some(frame) = body.frame().await {
        frame.map_err(io::Error::other)?;
    }
    let control = shared.control.borrow().clone();
    let mut factor = 1.0;
    let mut error = false;
    match control.fault {
        FailureMode::None | FailureMode::Reset => {}
        FailureMode::Refuse => {
            // Raced with the listener closing: drop the connection like a dead process.
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "refusing"));
        }
        FailureMode::Hang => return hang(shared, control.since).await,
        FailureMode::FailFast { after } => return fail_after(shared, after, "fail-fast").await,
        FailureMode::ServerError { after } => {
            if !after.is_zero() {
                tokio::time::sleep(after).await;
            }
            return Ok(server_error(shared));
        }
        FailureMode::Slow { factor: f } => factor = f,
        // Drawn before the latency, so that the error stream follows the arrival order.
        FailureMode::Error { probability } => {
            error = Draws(&shared.error_rng).gen::<f64>() < probability;
        }
        FailureMode::Flap {
            up,
            down,
            down_fails_after,
        } => {
            if !flap_is_up(control.since, Instant::now(), up, down) {
                return match down_fails_after {
                    None => hang(shared, control.since).await,
                    Some(after) => fail_after(shared, after, "flapping (down)").await,
                };
            }
        }
    }
    // The work: one permit while it lasts (FIFO among the waiting); health checks never wait.
    let _permit = match (&shared.slots, health) {
        (Some(slots), false) => Some(slots.acquire().await.map_err(io::Error::other)?),
        _ => None,
    };
    let began = Instant::now();
    // A slow-down in force when the work starts applies to it, as a simulated FIFO server
    // applies the factor in force when a call's service starts (a step that came while the
    // request waited for its permit counts).
    if !health && matches!(control.fault, FailureMode::None | FailureMode::Slow { .. }) {
        match shared.control.borrow().fault {
            FailureMode::Slow { factor: f } => factor = f,
            FailureMode::None => factor = 1.0,
            _ => {}
        }
    }
    let latency = shared.latency.sample_secs(&mut Draws(&shared.latency_rng));
    let latency = (latency * factor).min(MAX_LATENCY.as_secs_f64());
    if latency > 0.0 {
        let d = Duration::from_secs_f64(latency);
        if shared.precise_timer {
            crate::timer::sleep_until(began + d).await;
        } else {
            tokio::time::sleep(d).await;
        }
    }
    // What this request was actually served in (the timer's and the scheduler's time included),
    // as against the latency drawn.
    let served = HeaderValue::from(began.elapsed().as_micros() as u64);
    let served = |mut resp: Response<ResponseBody>| {
        resp.headers_mut().insert(SERVICE_HEADER, served);
        resp
    };
    if error {
        return Ok(served(unavailable(shared, "error (probability)")));
    }
    let whole = if health {
        Bytes::from_static(b"ok\n")
    } else {
        shared.body.clone()
    };
    if control.fault == FailureMode::Reset {
        let total = whole.len().max(2);
        let body = ResponseBody::Reset {
            first: Some(Bytes::from(vec![b'x'; total / 2])),
            pause: Box::pin(tokio::time::sleep(RESET_CUT)),
            reset,
            total: total as u64,
        };
        return Ok(served(respond(shared, StatusCode::OK, body)));
    }
    Ok(served(respond(
        shared,
        StatusCode::OK,
        ResponseBody::whole(whole),
    )))
}

/// A 503 after `after`.
async fn fail_after(
    shared: &Shared,
    after: Duration,
    why: &str,
) -> Result<Response<ResponseBody>, io::Error> {
    if !after.is_zero() {
        tokio::time::sleep(after).await;
    }
    Ok(unavailable(shared, why))
}

/// Holds a call without an answer until the failure mode set at `since` changes or the backend
/// shuts down, then drops the connection.
async fn hang(shared: &Shared, since: Instant) -> Result<Response<ResponseBody>, io::Error> {
    let mut rx = shared.control.subscribe();
    let _ = rx.wait_for(|c| c.shutdown || c.since != since).await;
    Err(io::Error::new(io::ErrorKind::ConnectionAborted, "hung"))
}

/// A backend's shared random stream as a `rand` generator, for the vocabulary's samplers.
struct Draws<'a>(&'a SharedRng);

impl RngCore for Draws<'_> {
    fn next_u32(&mut self) -> u32 {
        (self.0.next_u64() >> 32) as u32
    }

    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for chunk in dest.chunks_mut(8) {
            let bytes = self.0.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

/// A TCP stream that closes with a reset (RST) instead of a FIN once `reset` is set, which is
/// how the `Reset` fault cuts a response in the middle of its body.
pub(crate) struct ResettableStream {
    pub(crate) inner: TcpStream,
    pub(crate) reset: Arc<AtomicBool>,
}

impl Drop for ResettableStream {
    fn drop(&mut self) {
        if self.reset.load(Ordering::Relaxed) {
            // Linger 0: close() sends RST and discards unsent data.
            let _ = self.inner.set_zero_linger();
        }
    }
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.reset.load(Ordering::Relaxed) {
            // A FIN now would end the stream cleanly; the reset happens on drop instead.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flap_phases() {
        let t0 = Instant::now();
        let up = Duration::from_millis(200);
        let down = Duration::from_millis(100);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert!(flap_is_up(t0, at(0), up, down));
        assert!(flap_is_up(t0, at(199), up, down));
        assert!(!flap_is_up(t0, at(200), up, down));
        assert!(!flap_is_up(t0, at(299), up, down));
        assert!(flap_is_up(t0, at(300), up, down));
    }
}
