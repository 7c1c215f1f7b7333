//! Body types: what the proxy sends upstream (the client's body, streamed, and recoverable while
//! no byte of it has been sent) and what it sends to clients (an upstream body streamed under
//! the request deadline, whose end records the endpoint's outcome; or a small complete body).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
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
}

impl SharedBody {
    /// Wraps a client body.
    pub fn new(body: Incoming) -> Arc<Self> {
        Arc::new(Self {
            slot: Mutex::new(Some(body)),
            sent: AtomicBool::new(false),
        })
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
                        if frame.data_ref().is_some_and(|d| !d.is_empty()) {
                            shared.sent.store(true, Ordering::Release);
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(Some(Err(e))) => {
                        shared.sent.store(true, Ordering::Release);
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
/// done (sent, or dropped because the client went away).
pub struct DownstreamGuard {
    metrics: Arc<ClusterMetrics>,
    start: Instant,
}

impl DownstreamGuard {
    /// Starts counting.
    pub fn new(metrics: Arc<ClusterMetrics>, start: Instant) -> Self {
        metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        Self { metrics, start }
    }
}

impl Drop for DownstreamGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.metrics.latency.observe(self.start.elapsed());
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
