//! Body types: what the proxy sends upstream (the client's body, streamed, and recoverable while
//! no byte of it has been sent) and what it sends to clients (an upstream body streamed under
//! the request deadline, whose end records the endpoint's outcome; or a small complete body).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use keel_balance::{Outcome, Pick};

use crate::cluster::Cluster;
use crate::metrics::{ClusterMetrics, ErrorKind};

/// Errors of the bodies the proxy produces.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The client's body on its way upstream, shared with the request handler so that it can be
/// taken back for another try as long as no byte of it was sent.
#[derive(Debug)]
pub struct SharedBody {
    slot: Mutex<Option<Incoming>>,
    sent: AtomicBool,
    /// Bytes handed upstream so far (counted against `limit`).
    received: AtomicU64,
    /// Largest body accepted (`u64::MAX`: no limit).
    limit: u64,
    /// A [`ClientBodyFault`] as u8 (0: none).
    fault: AtomicU8,
}

/// Why the client's body could not be forwarded: the client's fault, not the endpoint's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientBodyFault {
    /// The body was malformed (invalid chunked encoding) or cut short by the client.
    Invalid = 1,
    /// The body passed the listener's `max_request_body_bytes`.
    TooLarge = 2,
}

impl SharedBody {
    /// Wraps a client body; `limit` is the most bytes it may carry (`u64::MAX`: no limit).
    pub fn new(body: Incoming, limit: u64) -> Arc<Self> {
        Arc::new(Self {
            slot: Mutex::new(Some(body)),
            sent: AtomicBool::new(false),
            received: AtomicU64::new(0),
            limit,
            fault: AtomicU8::new(0),
        })
    }

    /// Set once reading the client's body failed by the client's doing.
    pub fn fault(&self) -> Option<ClientBodyFault> {
        match self.fault.load(Ordering::Acquire) {
            1 => Some(ClientBodyFault::Invalid),
            2 => Some(ClientBodyFault::TooLarge),
            _ => None,
        }
    }

    /// The limit in force (`u64::MAX`: none).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// True once a data byte has been handed upstream.
    pub fn any_sent(&self) -> bool {
        self.sent.load(Ordering::Acquire)
    }

    /// True while the body can be sent again (nothing sent and not lost).
    pub fn replayable(&self) -> bool {
        !self.any_sent() && self.slot.lock().map(|s| s.is_some()).unwrap_or(false)
    }
}

/// A request body sent upstream.
#[derive(Debug)]
pub enum UpstreamBody {
    /// No body (GET, HEAD, health checks, ...).
    Empty,
    /// The client's body, streamed.
    Client(Arc<SharedBody>),
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Empty => Poll::Ready(None),
            UpstreamBody::Client(shared) => {
                let mut slot = shared.slot.lock().unwrap_or_else(|e| e.into_inner());
                let Some(body) = slot.as_mut() else {
                    return Poll::Ready(Some(Err("request body taken back for a retry".into())));
                };
                match Pin::new(body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Some(d) = frame.data_ref() {
                            if !d.is_empty() {
                                shared.sent.store(true, Ordering::Release);
                                let total =
                                    shared.received.fetch_add(d.len() as u64, Ordering::Relaxed)
                                        + d.len() as u64;
                                if total > shared.limit {
                                    shared
                                        .fault
                                        .store(ClientBodyFault::TooLarge as u8, Ordering::Release);
                                    // Cuts the upstream request: its body never arrives whole.
                                    return Poll::Ready(Some(Err(format!(
                                        "request body larger than {} bytes",
                                        shared.limit
                                    )
                                    .into())));
                                }
                            }
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Err(e))) => {
                        shared.sent.store(true, Ordering::Release);
                        shared
                            .fault
                            .store(ClientBodyFault::Invalid as u8, Ordering::Release);
                        Poll::Ready(Some(Err(e.into())))
                    }
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Empty => true,
            UpstreamBody::Client(shared) => shared
                .slot
                .lock()
                .map(|s| s.as_ref().is_some_and(|b| b.is_end_stream()))
                .unwrap_or(false),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Empty => SizeHint::with_exact(0),
            UpstreamBody::Client(shared) => shared
                .slot
                .lock()
                .ok()
                .and_then(|s| s.as_ref().map(|b| b.size_hint()))
                .unwrap_or_default(),
        }
    }
}

/// Counts a client request while it is served and records its latency when its response is
/// done (sent, or dropped because the client went away); also marks the client connection
/// busy meanwhile (for its idle timeout).
pub struct DownstreamGuard {
    metrics: Arc<ClusterMetrics>,
    start: Instant,
    conn: Option<Arc<ConnActivity>>,
}

impl DownstreamGuard {
    /// Starts counting.
    pub fn new(metrics: Arc<ClusterMetrics>, start: Instant) -> Self {
        metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Self {
            metrics,
            start,
            conn: None,
        }
    }

    /// Starts counting unless the cluster already serves `max_in_flight` requests (the
    /// circuit breaker): then nothing is counted and `None` is returned. The in-flight gauge
    /// is the counter, so the check costs no extra atomic operation.
    pub fn try_new(
        metrics: &Arc<ClusterMetrics>,
        start: Instant,
        max_in_flight: usize,
        conn: Option<&Arc<ConnActivity>>,
    ) -> Option<Self> {
        let before = metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        if before >= max_in_flight as i64 {
            metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let conn = conn.map(|c| {
            c.active.fetch_add(1, Ordering::Relaxed);
            c.clone()
        });
        Some(Self {
            metrics: metrics.clone(),
            start,
            conn,
        })
    }
}

impl Drop for DownstreamGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        let now = Instant::now();
        self.metrics.latency.observe(now - self.start);
        if let Some(c) = &self.conn {
            c.last_end_nanos.store(
                now.saturating_duration_since(c.base).as_nanos() as u64,
                Ordering::Relaxed,
            );
            c.active.fetch_sub(1, Ordering::Release);
        }
    }
}

/// A client connection's activity: requests being served and when the last one ended, read
/// by the connection's idle timer.
#[derive(Debug)]
pub struct ConnActivity {
    /// When the connection was accepted.
    pub base: Instant,
    /// Requests whose response is not finished.
    pub active: std::sync::atomic::AtomicU32,
    /// When the last response finished, in nanoseconds since `base` (0: none yet).
    pub last_end_nanos: AtomicU64,
}

impl ConnActivity {
    /// A connection accepted now.
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            active: std::sync::atomic::AtomicU32::new(0),
            last_end_nanos: AtomicU64::new(0),
        }
    }

    /// Resolves once the connection has had no request in flight for `idle`.
    pub async fn idle_for(&self, idle: std::time::Duration) {
        loop {
            let last = self.last_end_nanos.load(Ordering::Relaxed);
            let deadline = self.base + std::time::Duration::from_nanos(last) + idle;
            tokio::time::sleep_until(deadline.into()).await;
            if self.active.load(Ordering::Acquire) > 0 {
                // Busy: look again one idle period later.
                tokio::time::sleep(idle).await;
                continue;
            }
            if self.last_end_nanos.load(Ordering::Relaxed) == last {
                return;
            }
        }
    }
}

impl Default for ConnActivity {
    fn default() -> Self {
        Self::new()
    }
}

/// The pick of a response being streamed: finished with the body's outcome.
pub struct StreamTail {
    /// The cluster (the configuration the request started on).
    pub cluster: Arc<Cluster>,
    /// The endpoint's pick.
    pub pick: Pick,
    /// When it was picked (proxy clock).
    pub picked_at: std::time::Duration,
}

impl StreamTail {
    fn finish(self, outcome: Outcome, kind: Option<ErrorKind>) {
        self.cluster
            .finish(self.pick, self.picked_at, outcome, kind);
    }
}

pin_project_lite::pin_project! {
    /// A response body sent to a client. `guard` does the client-side accounting (released at
    /// the end); `tail` is the pick to finish with the body's outcome (none once finished);
    /// `deadline` is the whole-request deadline.
    #[allow(missing_docs)]
    #[project = RespProj]
    pub enum RespBody {
        /// A complete body (the proxy's own answers, and small upstream bodies read whole).
        Full {
            data: Option<Bytes>,
            guard: Option<DownstreamGuard>,
        },
        /// An upstream body, streamed until the request's deadline.
        Stream {
            body: Incoming,
            #[pin]
            deadline: tokio::time::Sleep,
            tail: Option<StreamTail>,
            guard: Option<DownstreamGuard>,
        },
    }
}

impl RespBody {
    /// A complete body.
    pub fn full(data: impl Into<Bytes>, guard: Option<DownstreamGuard>) -> Self {
        let data: Bytes = data.into();
        RespBody::Full {
            data: (!data.is_empty()).then_some(data),
            guard,
        }
    }
}

#[derive(Debug)]
struct DeadlineExceeded;

impl std::fmt::Display for DeadlineExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request timeout reached while streaming the response body")
    }
}

impl std::error::Error for DeadlineExceeded {}

impl Body for RespBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project() {
            RespProj::Full { data, guard } => match data.take() {
                Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
                None => {
                    guard.take();
                    Poll::Ready(None)
                }
            },
            RespProj::Stream {
                body,
                deadline,
                tail,
                guard,
            } => match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(None) => {
                    if let Some(t) = tail.take() {
                        t.finish(Outcome::Success, None);
                    }
                    guard.take();
                    Poll::Ready(None)
                }
                Poll::Ready(Some(Ok(frame))) => {
                    // With a Content-Length, hyper stops polling once that many bytes are out:
                    // the last frame is the end, there may be no `None` after it.
                    if body.is_end_stream() {
                        if let Some(t) = tail.take() {
                            t.finish(Outcome::Success, None);
                        }
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(Some(Err(e))) => {
                    if let Some(t) = tail.take() {
                        t.finish(Outcome::Failure, Some(ErrorKind::Reset));
                    }
                    guard.take();
                    Poll::Ready(Some(Err(e.into())))
                }
                Poll::Pending => {
                    if deadline.poll(cx).is_ready() {
                        if let Some(t) = tail.take() {
                            t.finish(Outcome::Failure, Some(ErrorKind::Timeout));
                        }
                        guard.take();
                        return Poll::Ready(Some(Err(DeadlineExceeded.into())));
                    }
                    Poll::Pending
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RespBody::Full { data, .. } => data.is_none(),
            RespBody::Stream { body, tail, .. } => tail.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RespBody::Stream { body, .. } => body.size_hint(),
        }
    }
}
