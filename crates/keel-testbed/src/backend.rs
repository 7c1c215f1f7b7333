//! A small HTTP/1.1 server for experiments, demos and tests, with injectable faults.
//!
//! [`spawn`] binds a listener and answers every path with a body of
//! [`BackendConfig::body_bytes`] bytes after a sampled latency, with a `x-backend: <name>` header
//! so that a client can tell which backend answered. `/healthz` answers `ok` the same way but is
//! never hit by the random error rate (only by the fault), and is counted apart from the other
//! requests.
//!
//! The fault can change while the backend runs ([`BackendHandle::set_fault`]), which is how tests
//! and the lab kill and restore a server. What each [`Fault`] does:
//!
//! | fault | what a client sees |
//! | --- | --- |
//! | `None` | 200 after the latency; 503 at once with probability `error_rate` |
//! | `Refuse` | the listener is closed (connects are refused) and open connections are closed, as if the process died; back to another fault re-binds the same port |
//! | `Hang` | the request is read and never answered: the connection is held until the fault changes or the backend shuts down, then closed without an answer |
//! | `Error` | an instant `503 Service Unavailable` |
//! | `Slow { factor }` | as `None`, with the sampled latency multiplied by `factor` |
//! | `Reset` | after the latency, the status line, headers (with the full `content-length`) and half of the body, then the TCP connection is reset (`SO_LINGER` 0, RST) |
//! | `Flap { up, down }` | alternates: `up` as `None`, then `down` as `Error` (instant 503), starting with `up` when the fault is set |
//!
//! Flap's down phase answers 503 rather than closing the port so that the phases switch exactly
//! on time for requests on kept-alive connections too; use `Refuse` toggled by a driver for an
//! up/down cycle of the port itself.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use keel_balance::{mix64, SharedRng};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

/// The longest latency a distribution may draw: keeps a heavy tail from parking a call forever.
const MAX_LATENCY: Duration = Duration::from_secs(60);
/// How long a reset response waits after sending half of its body, so that the client has
/// received the headers and the partial body before the reset arrives.
const RESET_PAUSE: Duration = Duration::from_millis(20);

/// What a backend does wrong, on purpose. See the [module docs](self) for what a client sees.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Fault {
    /// Behave as configured.
    #[default]
    None,
    /// Close the listener and all connections: connects are refused.
    Refuse,
    /// Read requests and never answer them.
    Hang,
    /// Answer `503` at once.
    Error,
    /// Multiply the sampled latency by `factor`.
    Slow {
        /// Latency multiplier (> 0).
        factor: f64,
    },
    /// Send headers and half of the body, then reset the TCP connection.
    Reset,
    /// Alternate `up` (no fault) and `down` (instant 503) periods, starting with `up`.
    Flap {
        /// Length of a healthy period.
        up: Duration,
        /// Length of a failing period.
        down: Duration,
    },
}

impl Fault {
    /// The fault's name as `keel backend --fault` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::Refuse => "refuse",
            Fault::Hang => "hang",
            Fault::Error => "error",
            Fault::Slow { .. } => "slow",
            Fault::Reset => "reset",
            Fault::Flap { .. } => "flap",
        }
    }

    /// Every fault name, for help texts and error messages.
    pub const NAMES: [&'static str; 7] =
        ["none", "refuse", "hang", "error", "slow", "reset", "flap"];
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Slow { factor } => write!(f, "slow (x{factor})"),
            Fault::Flap { up, down } => write!(f, "flap (up {up:?}, down {down:?})"),
            other => f.write_str(other.name()),
        }
    }
}

/// How the latency of a response is drawn; [`BackendConfig::latency`] is its mean.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LatencyDist {
    /// Exactly the latency, every time.
    #[default]
    Fixed,
    /// Exponential with the latency as its mean.
    Exponential,
    /// Log-normal with the latency as its mean and `sigma` the standard deviation of its log
    /// (1.0 is a heavy tail: p99 is about 4.5 times the mean).
    LogNormal {
        /// Standard deviation of the underlying normal (>= 0).
        sigma: f64,
    },
}

impl LatencyDist {
    /// Draws one latency of mean `mean` from two independent uniforms in `[0, 1)`.
    pub fn sample(&self, mean: Duration, u1: f64, u2: f64) -> Duration {
        let mean_s = mean.as_secs_f64();
        let secs = match self {
            LatencyDist::Fixed => mean_s,
            // 1 - u is in (0, 1], so its log is finite.
            LatencyDist::Exponential => -mean_s * (1.0 - u1).ln(),
            LatencyDist::LogNormal { sigma } => {
                if mean_s <= 0.0 {
                    0.0
                } else {
                    // Box-Muller; mu chosen so that E[exp(mu + sigma z)] = mean.
                    let z =
                        (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                    let mu = mean_s.ln() - sigma * sigma / 2.0;
                    (mu + sigma * z).exp()
                }
            }
        };
        Duration::from_secs_f64(secs.clamp(0.0, MAX_LATENCY.as_secs_f64()))
    }
}

/// How a backend behaves.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Mean response latency (0: answer at once).
    pub latency: Duration,
    /// Distribution of the latency around its mean.
    pub latency_dist: LatencyDist,
    /// The fault at start; change it later with [`BackendHandle::set_fault`].
    pub fault: Fault,
    /// Probability in `[0, 1]` that a request (other than `/healthz`) gets an instant 503.
    pub error_rate: f64,
    /// Size of a 200 response body.
    pub body_bytes: usize,
    /// Value of the `x-backend` header; empty: the bound address.
    pub name: String,
}

impl Default for BackendConfig {
    /// No latency, no fault, no errors, a 64-byte body, named after its address.
    fn default() -> Self {
        Self {
            latency: Duration::ZERO,
            latency_dist: LatencyDist::Fixed,
            fault: Fault::None,
            error_rate: 0.0,
            body_bytes: 64,
            name: String::new(),
        }
    }
}

/// The fault in force and since when (a flap's phases count from there).
#[derive(Clone, Debug)]
struct Control {
    fault: Fault,
    since: Instant,
    shutdown: bool,
}

/// State shared by the listener task, the connections and the handle.
struct Shared {
    latency: Duration,
    latency_dist: LatencyDist,
    error_rate: f64,
    body: Bytes,
    name: HeaderValue,
    error_rng: SharedRng,
    latency_rng: SharedRng,
    requests: AtomicU64,
    healthz: AtomicU64,
    connections: AtomicU64,
    control: watch::Sender<Control>,
    listening: watch::Sender<bool>,
}

/// A running backend. Dropping it stops the backend too (without waiting).
pub struct BackendHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Starts a backend on `listen` (port 0: an ephemeral port; see [`BackendHandle::addr`]).
/// Random draws (error rate, latency) use a seed derived from the backend's name.
pub async fn spawn(listen: SocketAddr, cfg: BackendConfig) -> io::Result<BackendHandle> {
    spawn_inner(listen, cfg, None).await
}

/// As [`spawn`], with an explicit seed for the random draws. Error draws and latency draws come
/// from two separate streams, so the number of 503s among the first N requests depends only on
/// the seed, whatever the order in which concurrent requests arrive.
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
    let refusing = cfg.fault == Fault::Refuse;
    let (control, _) = watch::channel(Control {
        fault: cfg.fault.clone(),
        since: Instant::now(),
        shutdown: false,
    });
    let (listening, _) = watch::channel(!refusing);
    let shared = Arc::new(Shared {
        latency: cfg.latency,
        latency_dist: cfg.latency_dist,
        error_rate: cfg.error_rate,
        body: Bytes::from(vec![b'x'; cfg.body_bytes]),
        name: name_header,
        error_rng: SharedRng::new(mix64(seed ^ 0xE77)),
        latency_rng: SharedRng::new(mix64(seed ^ 0x1A7)),
        requests: AtomicU64::new(0),
        healthz: AtomicU64::new(0),
        connections: AtomicU64::new(0),
        control,
        listening,
    });
    // A backend that starts refusing keeps its port reserved only by knowing the number.
    let first = if refusing { None } else { Some(listener) };
    let task = tokio::spawn(listen_loop(shared.clone(), first, addr));
    Ok(BackendHandle {
        addr,
        shared,
        task: Some(task),
    })
}

fn validate(cfg: &BackendConfig) -> io::Result<()> {
    let bad = |msg: String| Err(io::Error::new(io::ErrorKind::InvalidInput, msg));
    if !(0.0..=1.0).contains(&cfg.error_rate) {
        return bad(format!("error rate {} is not in [0, 1]", cfg.error_rate));
    }
    if let LatencyDist::LogNormal { sigma } = cfg.latency_dist {
        if !(sigma.is_finite() && sigma >= 0.0) {
            return bad(format!("log-normal sigma {sigma} must be finite and >= 0"));
        }
    }
    validate_fault(&cfg.fault)
}

fn validate_fault(fault: &Fault) -> io::Result<()> {
    match fault {
        Fault::Slow { factor } if !(factor.is_finite() && *factor > 0.0) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("slow factor {factor} must be finite and > 0"),
        )),
        Fault::Flap { up, down } if up.is_zero() || down.is_zero() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "flap periods must both be > 0",
        )),
        _ => Ok(()),
    }
}

/// Binds with `SO_REUSEADDR`, so that a port given up by `Refuse` can be bound again while old
/// connections sit in TIME_WAIT.
fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
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

    /// The fault in force.
    pub fn fault(&self) -> Fault {
        self.shared.control.borrow().fault.clone()
    }

    /// Changes the fault now. Responses already being produced keep the fault they started
    /// with, except that `Refuse` closes every connection and a change away from `Hang` closes
    /// the hung ones. The listener closes or re-binds asynchronously, within milliseconds; use
    /// [`BackendHandle::apply_fault`] to wait for it. An invalid fault (a slow factor <= 0, a
    /// zero flap period) is ignored with a warning.
    pub fn set_fault(&self, fault: Fault) {
        if let Err(e) = validate_fault(&fault) {
            tracing::warn!(backend = %self.addr, "ignoring fault: {e}");
            return;
        }
        self.shared.control.send_modify(|c| {
            c.fault = fault;
            c.since = Instant::now();
        });
    }

    /// Changes the fault and waits until the listener is closed (`Refuse`) or accepting again
    /// (any other fault). Fails if re-binding the port does not succeed within 5 s (another
    /// process took it).
    pub async fn apply_fault(&self, fault: Fault) -> io::Result<()> {
        validate_fault(&fault)?;
        let want_listening = fault != Fault::Refuse;
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
/// fault changes; ends at shutdown.
async fn listen_loop(shared: Arc<Shared>, mut listener: Option<TcpListener>, addr: SocketAddr) {
    let mut rx = shared.control.subscribe();
    loop {
        let (refuse, shutdown) = {
            let c = rx.borrow_and_update();
            (c.fault == Fault::Refuse, c.shutdown)
        };
        if shutdown {
            break;
        }
        if refuse {
            if listener.take().is_some() {
                tracing::debug!(backend = %addr, "listener closed (refuse)");
            }
            shared.listening.send_replace(false);
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
            shared.listening.send_replace(true);
        }
        match &listener {
            Some(l) => {
                tokio::select! {
                    accepted = l.accept() => match accepted {
                        Ok((stream, _)) => {
                            tokio::spawn(serve_connection(shared.clone(), stream));
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
    shared.listening.send_replace(false);
}

/// Serves one connection until the client closes it, a reset fault ends it, or the backend
/// starts refusing or shuts down (then it is dropped as a dying process would drop it).
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    shared.connections.fetch_add(1, Ordering::Relaxed);
    let _open = OpenConnection(shared.clone());
    let _ = stream.set_nodelay(true);
    let reset = Arc::new(AtomicBool::new(false));
    let io = TokioIo::new(ResettableStream {
        inner: stream,
        reset: reset.clone(),
    });
    let svc_shared = shared.clone();
    let service =
        hyper::service::service_fn(move |req| handle(svc_shared.clone(), req, reset.clone()));
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut rx = shared.control.subscribe();
    loop {
        {
            let c = rx.borrow_and_update();
            if c.shutdown || c.fault == Fault::Refuse {
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
enum ResponseBody {
    Whole(Option<Bytes>),
    Reset {
        first: Option<Bytes>,
        pause: Pin<Box<tokio::time::Sleep>>,
        reset: Arc<AtomicBool>,
        total: u64,
    },
}

impl ResponseBody {
    fn whole(bytes: Bytes) -> Self {
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

fn unavailable(shared: &Shared, why: &str) -> Response<ResponseBody> {
    let text = format!("backend {}: {why}\n", shared.name.to_str().unwrap_or(""));
    respond(
        shared,
        StatusCode::SERVICE_UNAVAILABLE,
        ResponseBody::whole(Bytes::from(text)),
    )
}

/// Whether a flap that started at `since` is in its up phase at `now`.
fn flap_is_up(since: Instant, now: Instant, up: Duration, down: Duration) -> bool {
    let period = (up + down).as_nanos();
    let into = now.saturating_duration_since(since).as_nanos() % period;
    into < up.as_nanos()
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    reset: Arc<AtomicBool>,
) -> Result<Response<ResponseBody>, io::Error> {
    let health = req.uri().path() == "/healthz";
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
    match control.fault {
        Fault::None | Fault::Reset => {}
        Fault::Refuse => {
            // Raced with the listener closing: drop the connection like a dead process.
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "refusing"));
        }
        Fault::Hang => {
            hang(&shared).await;
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "hung"));
        }
        Fault::Error => return Ok(unavailable(&shared, "injected error")),
        Fault::Slow { factor: f } => factor = f,
        Fault::Flap { up, down } => {
            if !flap_is_up(control.since, Instant::now(), up, down) {
                return Ok(unavailable(&shared, "flapping (down)"));
            }
        }
    }
    if !health && shared.error_rate > 0.0 {
        let u = unit_f64(shared.error_rng.next_u64());
        if u < shared.error_rate {
            return Ok(unavailable(&shared, "injected error (error rate)"));
        }
    }
    if !shared.latency.is_zero() {
        let u1 = unit_f64(shared.latency_rng.next_u64());
        let u2 = unit_f64(shared.latency_rng.next_u64());
        let latency = shared.latency_dist.sample(shared.latency, u1, u2);
        let latency = Duration::from_secs_f64(
            (latency.as_secs_f64() * factor).min(MAX_LATENCY.as_secs_f64()),
        );
        tokio::time::sleep(latency).await;
    }
    if health {
        return Ok(respond(
            &shared,
            StatusCode::OK,
            ResponseBody::whole(Bytes::from_static(b"ok\n")),
        ));
    }
    if control.fault == Fault::Reset {
        let total = shared.body.len().max(2);
        let body = ResponseBody::Reset {
            first: Some(Bytes::from(vec![b'x'; total / 2])),
            pause: Box::pin(tokio::time::sleep(RESET_PAUSE)),
            reset,
            total: total as u64,
        };
        return Ok(respond(&shared, StatusCode::OK, body));
    }
    Ok(respond(
        &shared,
        StatusCode::OK,
        ResponseBody::whole(shared.body.clone()),
    ))
}

/// Waits until the fault is no longer `Hang` or the backend shuts down.
async fn hang(shared: &Shared) {
    let mut rx = shared.control.subscribe();
    let _ = rx.wait_for(|c| c.shutdown || c.fault != Fault::Hang).await;
}

/// A uniform float in `[0, 1)` from 64 random bits.
fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A TCP stream that closes with a reset (RST) instead of a FIN once `reset` is set, which is
/// how the `Reset` fault cuts a response in the middle of its body.
struct ResettableStream {
    inner: TcpStream,
    reset: Arc<AtomicBool>,
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
    fn latency_distributions_have_the_configured_mean() {
        let mean = Duration::from_millis(10);
        let rng = SharedRng::new(42);
        for dist in [
            LatencyDist::Fixed,
            LatencyDist::Exponential,
            LatencyDist::LogNormal { sigma: 0.5 },
        ] {
            let n = 200_000;
            let total: f64 = (0..n)
                .map(|_| {
                    let u1 = unit_f64(rng.next_u64());
                    let u2 = unit_f64(rng.next_u64());
                    dist.sample(mean, u1, u2).as_secs_f64()
                })
                .sum();
            let avg = total / n as f64;
            // Standard error of the mean is at most 10 ms / sqrt(200k) = 22 us; allow 5 sigma.
            assert!((avg - 0.010).abs() < 0.000_12, "{dist:?}: mean {avg}");
        }
    }

    #[test]
    fn exponential_median_is_mean_ln2() {
        let mean = Duration::from_millis(10);
        let rng = SharedRng::new(7);
        let mut v: Vec<f64> = (0..100_001)
            .map(|_| {
                let u1 = unit_f64(rng.next_u64());
                LatencyDist::Exponential.sample(mean, u1, 0.0).as_secs_f64()
            })
            .collect();
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        let expected = 0.010 * std::f64::consts::LN_2;
        assert!((median - expected).abs() < 0.000_1, "median {median}");
    }

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
