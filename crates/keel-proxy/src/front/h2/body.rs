//! The HTTP/2 (and HTTP/3) front end's bodies: the response body sent to the client
//! ([`H2Body`]: keel's own, or an endpoint's, frame by frame, whichever leg read it), and the
//! connection's activity that its idle timer watches ([`ActiveRequest`]). The client's
//! request body is `front::stream`'s.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use crate::driver::account::{DownstreamGuard, Tail};
use crate::exchange::error::BodyEnd;
use crate::leg::h2::RequestPump;
use crate::leg::{BodyError, ResponseBody};

use super::log::H2Answered;

/// Request bodies with a length up to this are read whole before the request is forwarded
/// (any try can send them again); others stream.
pub(crate) const MAX_INLINE_BODY: u64 = 64 * 1024;

/// A response body sent to an HTTP/2 client.
pub(crate) enum H2Body {
    /// keel's own answer.
    Own {
        data: Option<Bytes>,
        _guard: Option<DownstreamGuard>,
        _active: ActiveRequest,
    },
    /// An endpoint's body, whichever leg read it.
    Upstream(Box<UpstreamBody>),
}

/// An endpoint's body (and trailers) on their way to the client, frame by frame as `send` asks
/// for them, until the request's deadline; with the rest of the client's body going the
/// other way to an HTTP/2 endpoint. The end finishes the pick (a gRPC call's by its status)
/// and writes the request's record.
pub(crate) struct UpstreamBody {
    pub(crate) body: ResponseBody,
    pub(crate) tail: Option<Tail>,
    pub(crate) pump: Option<RequestPump>,
    /// When the endpoint's idleness (or `max_duration`) cuts the body.
    pub(crate) due: Instant,
    /// The timer for `due`, made and set only while the body waits on the endpoint: a body
    /// that never waits (a small one, read with its head) costs no timer.
    pub(crate) timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The request's record, written when the body ends.
    pub(crate) record: H2Answered,
    pub(crate) active: ActiveRequest,
}

impl UpstreamBody {
    pub(crate) fn end(&mut self, end: BodyEnd) {
        self.end_with(end, cut_cause(end));
    }

    /// Ready once `due` has passed.
    fn poll_due(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let due = tokio::time::Instant::from_std(self.due);
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if timer.deadline() != due {
            timer.as_mut().reset(due);
        }
        timer.as_mut().poll(cx)
    }

    /// Ends the body (`cause`: why it was cut, for the record).
    pub(crate) fn end_with(&mut self, end: BodyEnd, cause: Option<&str>) {
        if let Some(tail) = self.tail.take() {
            self.record.write(&tail, cause);
            tail.end(end, self.body.reusable());
        }
    }
}

/// Why a response body that ended so was cut, as the access log says it.
fn cut_cause(end: BodyEnd) -> Option<&'static str> {
    match end {
        BodyEnd::Done | BodyEnd::Grpc(_) => None,
        BodyEnd::UpstreamFailed => Some("upstream failed"),
        BodyEnd::Timeout => Some("upstream idle"),
        BodyEnd::ClientGone => Some("client gone"),
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // An unfinished body is dropped when the client resets the stream or goes away.
        self.end(BodyEnd::ClientGone);
    }
}

impl Body for H2Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let up = match self.get_mut() {
            H2Body::Own { data, .. } => {
                return Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            H2Body::Upstream(up) => up,
        };
        up.active.polled();
        if let Some(pump) = &mut up.pump {
            pump.poll(cx);
        }
        match up.body.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    up.active.sent_frame();
                    up.record.sent += data.len() as u64;
                }
                // The endpoint sent something: its idle time starts again.
                if let Some(t) = &up.tail {
                    if !up.body.is_end_stream() {
                        up.due = t.body_deadline(Instant::now());
                    }
                }
                // Trailers end the body: it is not polled again after them.
                if frame.is_trailers() {
                    let end = up.body.end();
                    up.end(end);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                let end = up.body.end();
                up.end(end);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::debug!("response body failed: {e}");
                up.end(BodyEnd::UpstreamFailed);
                Poll::Ready(Some(Err(e)))
            }
            Poll::Pending => {
                if up.tail.is_some() && up.poll_due(cx).is_ready() {
                    let cause = up
                        .tail
                        .as_ref()
                        .map_or("upstream idle", |t| t.cut_cause(Instant::now()));
                    // A stalled endpoint failed; a long response cut at max_duration did not.
                    let end = if cause == "max_duration" {
                        BodyEnd::ClientGone
                    } else {
                        BodyEnd::Timeout
                    };
                    up.end_with(end, Some(cause));
                    return Poll::Ready(Some(Err(cause.into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            H2Body::Own { data, .. } => data.is_none(),
            H2Body::Upstream(up) => up.tail.is_none() || up.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            H2Body::Own { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            H2Body::Upstream(up) => up.body.size_hint(),
        }
    }
}

/// A connection's activity: requests being served and when the last one ended, read by the
/// connection's idle timer.
#[derive(Debug)]
pub(crate) struct ConnActivity {
    pub(crate) base: Instant,
    pub(crate) active: AtomicU32,
    /// When the last response finished, in nanoseconds since `base`.
    pub(crate) last_end_nanos: AtomicU64,
    /// Response bodies owed a poll: not asked for their first frame yet, or not for the next
    /// one since the last. `send` asks only when the stream has flow-control window, so a
    /// client that opens none leaves them owed.
    owed: AtomicU32,
    /// When a data frame last went out on this connection, or a body became owed while
    /// none was (nanoseconds since `base`): the stall is counted from there.
    progress_nanos: AtomicU64,
}

impl ConnActivity {
    pub(crate) fn new() -> Self {
        Self {
            base: Instant::now(),
            active: AtomicU32::new(0),
            last_end_nanos: AtomicU64::new(0),
            owed: AtomicU32::new(0),
            progress_nanos: AtomicU64::new(0),
        }
    }

    /// Resolves once response bodies have been waiting for the client for `idle` with no data
    /// frame taken on the whole connection meanwhile: a client that opens no flow-control
    /// window (or reads nothing) would otherwise hold its streams, their endpoint connections
    /// and their `max_in_flight` slots for as long as it stays.
    /// It sleeps until the stall could be complete, so the cut comes at `idle` after the
    /// last progress (not one sampling step later), with one timer per connection.
    pub(crate) async fn stalled_for(&self, idle: Duration) {
        loop {
            let owed = self.owed.load(Ordering::Acquire);
            let progress = Duration::from_nanos(self.progress_nanos.load(Ordering::Acquire));
            let deadline = self.base + progress + idle;
            let wake = if owed > 0 {
                if Instant::now() >= deadline {
                    return;
                }
                deadline
            } else {
                // Nothing owed: a body that becomes owed sets progress, so its stall ends
                // `idle` after that, later than this wake-up.
                Instant::now() + idle
            };
            tokio::time::sleep_until(wake.into()).await;
        }
    }

    fn mark_progress(&self) {
        let now = self.base.elapsed().as_nanos() as u64;
        self.progress_nanos.store(now, Ordering::Release);
    }

    /// Resolves once the connection has had no request in flight for `first` since `since`
    /// (no request has ended yet) or for `idle` since the last one ended.
    pub(crate) async fn idle_for(&self, first: Duration, idle: Duration, since: Instant) {
        loop {
            let last = self.last_end_nanos.load(Ordering::Relaxed);
            let deadline = if last == 0 {
                since + first
            } else {
                (self.base + Duration::from_nanos(last)).max(since) + idle
            };
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

/// Marks the connection busy while a request and its response last.
pub(crate) struct ActiveRequest(Arc<ConnActivity>, bool);

impl ActiveRequest {
    pub(crate) fn new(activity: &Arc<ConnActivity>) -> Self {
        activity.active.fetch_add(1, Ordering::Relaxed);
        Self(activity.clone(), false)
    }

    /// The response body is owed a poll by `send` (set when it is handed over, and after each
    /// data frame).
    pub(crate) fn owe(&mut self) {
        if !self.1 {
            self.1 = true;
            // Progress is marked before the count is raised, so that a watchdog that sees
            // the body owed also sees when it became so.
            if self.0.owed.load(Ordering::Relaxed) == 0 {
                self.0.mark_progress();
            }
            self.0.owed.fetch_add(1, Ordering::Release);
        }
    }

    /// `send` polled the body.
    fn polled(&mut self) {
        if self.1 {
            self.1 = false;
            self.0.owed.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A data frame went to `send`; the next one is owed.
    fn sent_frame(&mut self) {
        self.0.mark_progress();
        self.owe();
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        self.polled();
        let c = &self.0;
        c.last_end_nanos
            .store(c.base.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.active.fetch_sub(1, Ordering::Release);
    }
}
