//! keel's keep-alive pool of HTTP/1.1 connections to one endpoint.
//!
//! A connection ([`RawConn`]: the stream and the bytes read from it but not yet used) is owned
//! by whoever uses it: the request's own task takes it, sends the request, reads the response,
//! and puts it back. The idle connections wait in one stack per worker thread (a connection is
//! only used on the thread, and runtime, that opened it; the worker's index is passed in), LIFO
//! so that the warmest connection is reused and the idle ones age at the bottom, where they are
//! pruned. Each stack has its own short lock, only ever taken by its worker and the reaper.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Context;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use crate::tls::{UpstreamStream, UpstreamTls};

/// A keep-alive connection to an endpoint: the stream and the bytes read from it but not yet
/// used. It goes back to its endpoint's pool only between responses.
pub struct RawConn {
    pub(crate) io: UpstreamStream,
    pub(crate) buf: bytes::BytesMut,
    idle_since: Instant,
    /// True if it came from the pool (a stale keep-alive connection may fail at first use).
    pub(crate) reused: bool,
}

impl RawConn {
    /// Anything to read while idle (end of stream, an error, or bytes nobody asked for) means
    /// it is no longer a clean idle connection. Does not wait, and makes no system call unless
    /// the runtime saw the socket become readable.
    fn is_dead(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut scratch = [0u8; 64];
        let mut read = tokio::io::ReadBuf::new(&mut scratch);
        let io = Pin::new(&mut self.io);
        tokio::io::AsyncRead::poll_read(io, &mut cx, &mut read).is_ready()
    }
}

/// Why no connection could be made: the request never left.
#[derive(Debug)]
pub enum ConnectError {
    /// What the OS or the TLS handshake said.
    Failed(std::io::Error),
    /// The connect (or handshake) did not finish within `connect_timeout`.
    TimedOut(Duration),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Failed(e) => write!(f, "{e}"),
            ConnectError::TimedOut(d) => write!(
                f,
                "connect timed out after {}",
                humantime::format_duration(*d)
            ),
        }
    }
}

impl From<ConnectError> for crate::exchange::error::Cause {
    fn from(e: ConnectError) -> Self {
        match e {
            ConnectError::Failed(e) => Self::Connect(e),
            ConnectError::TimedOut(d) => Self::ConnectTimeout(d),
        }
    }
}

/// Settings of an endpoint's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Connect timeout (the TLS handshake gets its own, of the same length).
    pub connect_timeout: Duration,
    /// Idle connections older than this are closed.
    pub idle_timeout: Duration,
    /// Most idle connections kept (per worker thread).
    pub max_idle: usize,
    /// Worker threads serving connections: one stack of idle connections each.
    pub workers: usize,
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
    /// Idle connections, a stack per worker, newest at the back.
    stacks: Box<[Mutex<VecDeque<RawConn>>]>,
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
            stacks: (0..settings.workers.max(1))
                .map(|_| Mutex::new(VecDeque::new()))
                .collect(),
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

    /// Idle connections held now.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.stacks
            .iter()
            .map(|q| q.lock().map(|q| q.len()).unwrap_or(0))
            .sum()
    }

    fn stack(&self, worker: usize) -> std::sync::MutexGuard<'_, VecDeque<RawConn>> {
        self.stacks[worker % self.stacks.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Closes idle connections past the idle timeout, and those the endpoint closed (which
    /// would otherwise sit in CLOSE-WAIT, holding a descriptor, until taken or timed out).
    pub fn prune(&self, now: Instant) {
        let idle_timeout = self.settings.idle_timeout;
        for q in self.stacks.iter() {
            let mut q = q.lock().unwrap_or_else(|e| e.into_inner());
            q.retain_mut(|c| now.duration_since(c.idle_since) < idle_timeout && !c.is_dead());
        }
    }

    /// Worker `worker`'s most recently used idle connection that is still open, or a new one.
    pub async fn get(&self, worker: usize) -> Result<RawConn, ConnectError> {
        let now = Instant::now();
        loop {
            let Some(mut c) = self.stack(worker).pop_back() else {
                break;
            };
            if now.duration_since(c.idle_since) >= self.settings.idle_timeout {
                // The newest is too old, so are all the others.
                self.stack(worker).clear();
                break;
            }
            if !c.is_dead() {
                c.reused = true;
                return Ok(c);
            }
        }
        // Boxed: a connect (and its TLS handshake) is a large future that most requests,
        // served by a pooled connection, would otherwise carry in theirs.
        Box::pin(self.connect()).await
    }

    /// A new connection, never pooled before.
    pub async fn connect(&self) -> Result<RawConn, ConnectError> {
        self.connect_on(None).await
    }

    /// A new connection to the endpoint's host on `port` instead of its own (a health check's
    /// `port`), as [`Self::connect`] makes them otherwise; never pooled.
    pub async fn connect_on(&self, port: Option<u16>) -> Result<RawConn, ConnectError> {
        Ok(RawConn {
            io: self.connect_stream(port).await?,
            // Taken when the first answer begins (`crate::io::spare`).
            buf: bytes::BytesMut::new(),
            idle_since: Instant::now(),
            reused: false,
        })
    }

    /// Puts back a connection whose last response was read to its end and nothing more, on
    /// worker `worker`'s stack (dropping the oldest beyond `max_idle` or `idle_timeout`).
    pub fn put(&self, worker: usize, mut c: RawConn) {
        if self.settings.max_idle == 0 || !c.buf.is_empty() {
            return;
        }
        let now = Instant::now();
        c.idle_since = now;
        // Idle, it needs no buffer until its next answer.
        crate::io::spare::lend(&mut c.buf);
        let mut q = self.stack(worker);
        while q.len() >= self.settings.max_idle
            || q.front()
                .is_some_and(|o| now.duration_since(o.idle_since) >= self.settings.idle_timeout)
        {
            q.pop_front();
        }
        q.push_back(c);
    }

    /// A new TCP (or TLS) connection to the endpoint, within the connect timeout.
    async fn connect_stream(&self, port: Option<u16>) -> Result<UpstreamStream, ConnectError> {
        let timeout = self.settings.connect_timeout;
        let connect = async {
            let stream = match (self.addr, port) {
                (Some(a), None) => TcpStream::connect(a).await?,
                (Some(a), Some(p)) => TcpStream::connect(SocketAddr::new(a.ip(), p)).await?,
                (None, None) => TcpStream::connect(self.authority.as_str()).await?,
                (None, Some(p)) => TcpStream::connect((self.host.as_str(), p)).await?,
            };
            stream.set_nodelay(true)?;
            Ok::<_, std::io::Error>(stream)
        };
        let stream = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(ConnectError::Failed(e)),
            Err(_) => return Err(ConnectError::TimedOut(timeout)),
        };
        match &self.tls {
            None => Ok(UpstreamStream::Plain(stream)),
            // A failed handshake is a connect failure: the request never left.
            Some(tls) => match tls.connect(stream, &self.host).await {
                Ok(s) => Ok(UpstreamStream::Tls(Box::new(s))),
                Err(e) => Err(ConnectError::Failed(e)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::Response;
    use hyper_util::rt::TokioIo;

    /// A loopback HTTP/1.1 server counting the connections it accepted; with `close_after`,
    /// it drops each connection after that many responses without saying so (as a server
    /// with a short keep-alive timeout does), leaving a stale connection in the pool.
    /// A hyper server on loopback; with `close_after`, it cuts each connection 20 ms after that
    /// many responses. Returns its address and how many connections it accepted and closed.
    async fn server(
        close_after: Option<usize>,
    ) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (count, closes) = (accepted.clone(), closed.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let closes = closes.clone();
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
                    // The connection was dropped with the select: its socket is closed.
                    closes.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        (addr, accepted, closed)
    }

    fn settings(idle_timeout: Duration) -> PoolSettings {
        PoolSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout,
            max_idle: 8,
            workers: 1,
        }
    }

    /// A GET on a pooled (or new) connection of worker 0's stack; the connection goes back
    /// when the endpoint keeps it.
    async fn get(pool: &Arc<EndpointPool>, addr: SocketAddr) -> Result<String, String> {
        let mut conn = pool.get(0).await.map_err(|e| e.to_string())?;
        let head = format!("GET / HTTP/1.1\r\nhost: {addr}\r\n\r\n");
        let (status, keep) = crate::upstream::h1_client::exchange(&mut conn, head.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        if keep {
            pool.put(0, conn);
        }
        Ok(if status == 200 {
            "ok".into()
        } else {
            status.to_string()
        })
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection() {
        let (addr, accepted, _) = server(None).await;
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
        let (addr, accepted, closed) = server(Some(1)).await;
        let pool = EndpointPool::new(&addr.to_string(), settings(Duration::from_secs(30)), None);
        for i in 0..10 {
            assert_eq!(get(&pool, addr).await.unwrap(), "ok", "request {i}");
            // Until the server has cut it (not a fixed sleep: a loaded machine can take longer
            // than any margin to run the server's timer).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while closed.load(Ordering::SeqCst) <= i {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "connection {i} never cut"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 10);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (addr, _, _) = server(None).await;
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
        let (addr, _, _) = server(Some(1)).await;
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
        match pool.get(0).await {
            Err(ConnectError::Failed(e)) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused)
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("connected to a closed port"),
        }
    }
}
