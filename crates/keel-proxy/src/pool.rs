//! keel's own keep-alive pool of HTTP/1.1 connections to one endpoint.
//!
//! Why not hyper-util's pool: its client spawns a task per upstream connection, so every
//! request crosses two tasks (the client's and the connection's) through channels, and its
//! checkout takes a global lock and hashes the endpoint's key. Here a connection is a
//! `(SendRequest, Connection)` pair owned by whoever uses it: the request's own task drives
//! the connection while it sends the request and reads a small response, then puts the pair
//! back in the endpoint's stack. Only a response streamed to the client (large or without a
//! length) hands its connection to a spawned task, which returns it to the pool once the body
//! is done. The stack is per endpoint (one short, uncontended lock), LIFO so that the warmest
//! connection is reused and the idle ones age at the bottom, where they are pruned.

use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::body::UpstreamBody;
use crate::tls::{UpstreamStream, UpstreamTls};

/// The transport of an upstream connection (TCP, or TLS over TCP for a `[cluster.tls]`).
pub type UpstreamIo = TokioIo<UpstreamStream>;

/// One keep-alive connection: the sending half and the connection future that does its I/O.
pub struct PooledConn {
    send: http1::SendRequest<UpstreamBody>,
    conn: http1::Connection<UpstreamIo, UpstreamBody>,
    /// Set once the connection future finished (closed or failed): never pooled again.
    done: bool,
    /// When it was put back in the pool.
    idle_since: Instant,
    /// True if it came from the pool (a stale keep-alive connection may fail at first use).
    reused: bool,
}

/// Why a request could not get a response from the endpoint.
#[derive(Debug)]
pub enum UpstreamError {
    /// No connection could be made: the request never left.
    Connect {
        /// What the OS, the resolver or the TLS handshake said (a timeout says so).
        cause: String,
    },
    /// The connection failed while the request was sent or the response read.
    Http(hyper::Error),
}

impl UpstreamError {
    /// True if the request never reached the endpoint.
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. })
    }
}

/// Settings of an endpoint's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Idle connections older than this are closed.
    pub idle_timeout: Duration,
    /// Most idle connections kept (per worker thread).
    pub max_idle: usize,
    /// Worker threads serving connections: one stack of idle connections each, so that a
    /// connection is only ever used on the thread (and runtime) that opened it.
    pub workers: usize,
}

thread_local! {
    static WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Declares the current thread to be worker `w` (see [`PoolSettings::workers`]). Threads that
/// never call it use stack 0.
pub fn set_worker(w: usize) {
    WORKER.with(|c| c.set(w));
}

/// The keep-alive pool of one endpoint.
pub struct EndpointPool {
    /// `host:port` as configured (resolved at each connect unless it is an IP address).
    authority: String,
    addr: Option<SocketAddr>,
    /// The host part (the name TLS verifies unless the cluster sets `server_name`).
    host: String,
    settings: PoolSettings,
    tls: Option<UpstreamTls>,
    /// Idle connections of the hyper path.
    idle: IdleStacks<PooledConn>,
    /// Idle connections of keel's own HTTP/1.1 path.
    raw_idle: IdleStacks<RawConn>,
}

/// A connection that can wait in an [`IdleStacks`].
trait Idle {
    /// When it was put back.
    fn idle_since(&mut self) -> &mut Instant;
    /// True if it can no longer be used (the endpoint closed it, or it failed). Does not
    /// wait: a connection with nothing to read is still good.
    fn is_dead(&mut self) -> bool;
    /// Marks it as taken from the pool (a stale keep-alive connection may fail at first use).
    fn mark_reused(&mut self);
}

/// Idle connections of one kind: a stack per worker thread (so that a connection is only
/// used on the thread, and runtime, that opened it), newest at the back, taken LIFO so that
/// the warmest is reused and the idle ones age at the front, where they are pruned.
struct IdleStacks<C> {
    stacks: Box<[Mutex<VecDeque<C>>]>,
}

impl<C: Idle> IdleStacks<C> {
    fn new(workers: usize) -> Self {
        Self {
            stacks: (0..workers.max(1))
                .map(|_| Mutex::new(VecDeque::new()))
                .collect(),
        }
    }

    /// Connections held now.
    fn len(&self) -> usize {
        self.stacks
            .iter()
            .map(|q| q.lock().map(|q| q.len()).unwrap_or(0))
            .sum()
    }

    /// The current thread's stack.
    fn stack(&self) -> std::sync::MutexGuard<'_, VecDeque<C>> {
        self.stacks[WORKER.with(|w| w.get()) % self.stacks.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The most recently used connection that is still open, if any.
    fn take(&self, idle_timeout: Duration) -> Option<C> {
        let now = Instant::now();
        loop {
            let mut c = self.stack().pop_back()?;
            if now.duration_since(*c.idle_since()) >= idle_timeout {
                // The newest is too old, so are all the others.
                self.stack().clear();
                return None;
            }
            if !c.is_dead() {
                c.mark_reused();
                return Some(c);
            }
        }
    }

    /// Puts a connection back, dropping the oldest beyond `max_idle` or `idle_timeout`.
    fn put(&self, mut c: C, max_idle: usize, idle_timeout: Duration) {
        let now = Instant::now();
        *c.idle_since() = now;
        let mut q = self.stack();
        while q.len() >= max_idle
            || q.front_mut()
                .is_some_and(|o| now.duration_since(*o.idle_since()) >= idle_timeout)
        {
            q.pop_front();
        }
        q.push_back(c);
    }

    /// Closes connections past the idle timeout, and those the endpoint closed (which would
    /// otherwise sit in CLOSE-WAIT, holding a descriptor, until taken or timed out).
    fn prune(&self, now: Instant, idle_timeout: Duration) {
        for q in self.stacks.iter() {
            let mut q = q.lock().unwrap_or_else(|e| e.into_inner());
            q.retain_mut(|c| now.duration_since(*c.idle_since()) < idle_timeout && !c.is_dead());
        }
    }
}

/// A keep-alive connection of keel's own HTTP/1.1 path (`crate::h1`): the stream and the
/// bytes read from it but not yet used. Whoever holds it owns it; it goes back to its
/// endpoint's pool only between responses.
pub struct RawConn {
    pub(crate) io: UpstreamStream,
    pub(crate) buf: bytes::BytesMut,
    idle_since: Instant,
    /// True if it came from the pool (a stale keep-alive connection may fail at first use).
    pub(crate) reused: bool,
}

impl Idle for RawConn {
    fn idle_since(&mut self) -> &mut Instant {
        &mut self.idle_since
    }

    /// Anything to read (end of stream, an error, or bytes nobody asked for) means it is no
    /// longer a clean idle connection.
    fn is_dead(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut scratch = [0u8; 64];
        let mut read = tokio::io::ReadBuf::new(&mut scratch);
        let io = Pin::new(&mut self.io);
        tokio::io::AsyncRead::poll_read(io, &mut cx, &mut read).is_ready()
    }

    fn mark_reused(&mut self) {
        self.reused = true;
    }
}

impl Idle for PooledConn {
    fn idle_since(&mut self) -> &mut Instant {
        &mut self.idle_since
    }

    /// Lets the connection notice a close that arrived while it sat idle (EOF is read from
    /// the readiness the runtime already has; no syscall when nothing came).
    fn is_dead(&mut self) -> bool {
        self.poll_conn_once();
        self.done || self.send.is_closed()
    }

    fn mark_reused(&mut self) {
        self.reused = true;
    }
}

impl EndpointPool {
    /// A pool for `authority` (`host:port`); with `tls`, every connection is TLS.
    pub fn new(authority: &str, settings: PoolSettings, tls: Option<UpstreamTls>) -> Arc<Self> {
        let host = authority
            .parse::<hyper::http::uri::Authority>()
            .map(|a| a.host().to_string())
            .unwrap_or_else(|_| authority.to_string());
        let pool = Arc::new(Self {
            authority: authority.to_string(),
            addr: authority.parse().ok(),
            host,
            settings,
            tls,
            idle: IdleStacks::new(settings.workers),
            raw_idle: IdleStacks::new(settings.workers),
        });
        pool.spawn_reaper();
        pool
    }

    /// Closes idle connections past the idle timeout even when no request comes to take or
    /// return one (the pool prunes on use too). Ends once the pool is dropped.
    fn spawn_reaper(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pool = Arc::downgrade(self);
        // Often enough that connections closed by a stopped endpoint go within seconds.
        let every = (self.settings.idle_timeout / 2)
            .clamp(Duration::from_millis(100), Duration::from_secs(2));
        rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match pool.upgrade() {
                    Some(p) => p.prune(Instant::now()),
                    None => break,
                }
            }
        });
    }

    /// The pool's settings.
    pub fn settings(&self) -> PoolSettings {
        self.settings
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.len() + self.raw_idle.len()
    }

    /// Closes idle connections past the idle timeout, and those the endpoint closed.
    pub fn prune(&self, now: Instant) {
        self.idle.prune(now, self.settings.idle_timeout);
        self.raw_idle.prune(now, self.settings.idle_timeout);
    }

    /// The most recently used idle [`RawConn`] that is still open, or a new one.
    pub async fn get_raw(&self) -> Result<RawConn, UpstreamError> {
        match self.raw_idle.take(self.settings.idle_timeout) {
            Some(c) => Ok(c),
            None => self.connect_raw().await,
        }
    }

    /// A new [`RawConn`].
    pub async fn connect_raw(&self) -> Result<RawConn, UpstreamError> {
        Ok(RawConn {
            io: self.connect_stream().await?,
            buf: bytes::BytesMut::with_capacity(8192),
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// Puts back a [`RawConn`] whose last response was read to its end and nothing more
    /// (or closes it if the pool is full).
    pub fn put_raw(&self, c: RawConn) {
        if self.settings.max_idle == 0 || !c.buf.is_empty() {
            return;
        }
        self.raw_idle
            .put(c, self.settings.max_idle, self.settings.idle_timeout);
    }

    /// Puts a connection back (or closes it if it is not reusable or the pool is full). A
    /// connection whose response is still being read (streamed to a client) is handed to a
    /// task that drives it and puts it back once the response is done.
    pub fn put(self: &Arc<Self>, mut c: PooledConn) {
        c.poll_conn_once();
        if c.done || c.send.is_closed() || self.settings.max_idle == 0 {
            return;
        }
        if !c.send.is_ready() {
            // The response was not read to its end yet: return once it is.
            return self.put_when_ready(c);
        }
        self.idle
            .put(c, self.settings.max_idle, self.settings.idle_timeout);
    }

    fn put_when_ready(self: &Arc<Self>, c: PooledConn) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Holds only a weak reference: a pool dropped by a reload is not kept alive by it.
        let pool: Weak<Self> = Arc::downgrade(self);
        rt.spawn(async move {
            let mut c = c;
            if c.until_ready().await {
                if let Some(pool) = pool.upgrade() {
                    pool.put(c);
                }
            }
        });
    }

    /// A connection: an idle one, or a new one.
    async fn get(&self) -> Result<PooledConn, UpstreamError> {
        if let Some(c) = self.idle.take(self.settings.idle_timeout) {
            return Ok(c);
        }
        self.connect().await
    }

    async fn connect(&self) -> Result<PooledConn, UpstreamError> {
        let stream = self.connect_stream().await?;
        let (send, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(UpstreamError::Http)?;
        Ok(PooledConn {
            send,
            conn,
            done: false,
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// A new TCP (or TLS) connection to the endpoint, within the connect timeout.
    async fn connect_stream(&self) -> Result<UpstreamStream, UpstreamError> {
        let timeout = self.settings.connect_timeout;
        let connect = async {
            let stream = match self.addr {
                Some(a) => TcpStream::connect(a).await?,
                None => TcpStream::connect(self.authority.as_str()).await?,
            };
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(stream)
        };
        let stream = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return Err(UpstreamError::Connect {
                    cause: e.to_string(),
                })
            }
            Err(_) => {
                return Err(UpstreamError::Connect {
                    cause: format!(
                        "connect timed out after {}",
                        humantime::format_duration(timeout)
                    ),
                })
            }
        };
        match &self.tls {
            None => Ok(UpstreamStream::Plain(stream)),
            // A failed handshake is a connect failure: the request never left.
            Some(tls) => match tls.connect(stream, &self.host).await {
                Ok(s) => Ok(UpstreamStream::Tls(Box::new(s))),
                Err(e) => Err(UpstreamError::Connect {
                    cause: e.to_string(),
                }),
            },
        }
    }

    /// Sends `req` on a pooled or new connection and waits for the response head, driving the
    /// connection in this task. A request that never left because the pooled connection had
    /// closed goes again on another one; errors after that are the caller's to judge.
    pub async fn send(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<(Response<Incoming>, PooledConn), UpstreamError> {
        let mut req = req;
        loop {
            let mut c = self.get().await?;
            let reused = c.reused;
            let sent = c.send.try_send_request(req);
            match c.drive(sent).await {
                Ok(resp) => return Ok((resp, c)),
                Err(mut e) => match e.take_message() {
                    // Never written: a stale idle connection. Try the next (or a new) one.
                    Some(r) if reused => req = r,
                    _ => return Err(UpstreamError::Http(e.into_error())),
                },
            }
        }
    }
}

impl PooledConn {
    /// Polls the connection once without waiting (noticing EOF or errors).
    fn poll_conn_once(&mut self) {
        if self.done {
            return;
        }
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        if Pin::new(&mut self.conn).poll(&mut cx).is_ready() {
            self.done = true;
        }
    }

    /// Runs `fut` to completion while driving the connection's I/O in the same task.
    pub async fn drive<F: Future>(&mut self, fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        std::future::poll_fn(|cx| {
            if !self.done && Pin::new(&mut self.conn).poll(cx).is_ready() {
                self.done = true;
            }
            fut.as_mut().poll(cx)
        })
        .await
    }

    /// Drives the connection until it can take another request (true) or closes (false).
    async fn until_ready(&mut self) -> bool {
        std::future::poll_fn(|cx| {
            if !self.done && Pin::new(&mut self.conn).poll(cx).is_ready() {
                self.done = true;
            }
            match self.send.poll_ready(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(!self.done),
                Poll::Ready(Err(_)) => Poll::Ready(false),
                Poll::Pending if self.done => Poll::Ready(false),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;

    /// A loopback HTTP/1.1 server counting the connections it accepted; with `close_after`,
    /// it drops each connection after that many responses without saying so (as a server
    /// with a short keep-alive timeout does), leaving a stale connection in the pool.
    async fn server(close_after: Option<usize>) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let served = Arc::new(AtomicUsize::new(0));
                    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                    let tx = std::sync::Mutex::new(Some(tx));
                    let svc = hyper::service::service_fn(move |_req| {
                        let n = served.fetch_add(1, Ordering::SeqCst) + 1;
                        if close_after == Some(n) {
                            if let Some(tx) = tx.lock().unwrap().take() {
                                let _ = tx.send(());
                            }
                        }
                        async {
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        // Gives the response time to leave, then cuts the connection.
                        _ = async { let _ = rx.await; tokio::time::sleep(Duration::from_millis(20)).await } => {}
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn settings(idle_timeout: Duration) -> PoolSettings {
        PoolSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout,
            max_idle: 8,
            workers: 1,
        }
    }

    async fn get(pool: &Arc<EndpointPool>, addr: SocketAddr) -> Result<String, UpstreamError> {
        let req = Request::builder()
            .uri("/")
            .header(hyper::header::HOST, addr.to_string())
            .body(UpstreamBody::Empty)
            .unwrap();
        let (resp, mut conn) = pool.send(req).await?;
        let body = conn
            .drive(resp.into_body().collect())
            .await
            .map_err(UpstreamError::Http)?
            .to_bytes();
        pool.put(conn);
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let (addr, accepted) = server(None).await;
        let pool = EndpointPool::new(&addr.to_string(), settings(Duration::from_secs(30)), None);
        for _ in 0..20 {
            assert_eq!(get(&pool, addr).await.unwrap(), "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_connection_closed_while_idle_is_not_a_failure() {
        // Every connection is cut after one response: each pooled connection is stale by the
        // time the next request takes it.
        let (addr, accepted) = server(Some(1)).await;
        let pool = EndpointPool::new(&addr.to_string(), settings(Duration::from_secs(30)), None);
        for i in 0..10 {
            assert_eq!(get(&pool, addr).await.unwrap(), "ok", "request {i}");
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 10);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (addr, _) = server(None).await;
        let pool = EndpointPool::new(
            &addr.to_string(),
            settings(Duration::from_millis(100)),
            None,
        );
        // Two requests in flight at once leave two idle connections.
        let (a, b) = tokio::join!(get(&pool, addr), get(&pool, addr));
        assert_eq!((a.unwrap(), b.unwrap()), ("ok".into(), "ok".into()));
        assert_eq!(pool.idle_count(), 2);
        // Nobody uses the pool: the reaper closes them.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn connections_the_endpoint_closed_are_pruned_while_idle() {
        // The server cuts each connection after one response; nobody takes it from the pool,
        // yet the reaper (every 2 s at most) drops it long before the 60 s idle timeout.
        let (addr, _) = server(Some(1)).await;
        let pool = EndpointPool::new(&addr.to_string(), settings(Duration::from_secs(60)), None);
        assert_eq!(get(&pool, addr).await.unwrap(), "ok");
        assert_eq!(pool.idle_count(), 1);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let pool = EndpointPool::new(&addr.to_string(), settings(Duration::from_secs(30)), None);
        let err = get(&pool, addr).await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
    }
}
