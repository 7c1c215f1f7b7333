//! The HTTP/2 leg (clusters with `protocol = "h2c"` or `"h2"`): one try of a request as one
//! stream on one of an endpoint's multiplexed connections. Each worker keeps its own
//! connections per endpoint (`upstream::h2_conns`); a request takes a stream on the first connection
//! below the endpoint's `SETTINGS_MAX_CONCURRENT_STREAMS`, or waits for the connection being
//! opened, or opens another when all are full. The pick is per request, never per
//! connection.
//!
//! The request head becomes the stream's HEADERS: an HTTP/2 client's parts as the rewrite
//! left them (copied per try, values shared, not re-parsed), an HTTP/1.1 client's text parsed
//! once per try. Its body is streamed with HTTP/2 flow control and its trailers follow. The
//! response stays HTTP/2 ([`H2Response`]: head, body stream, trailers), and every front end
//! renders it frame by frame (`leg::ResponseBody`). gRPC calls are judged
//! by their `grpc-status`: a trailers-only answer that counts as a failure (14 UNAVAILABLE) is
//! a failed try, retried while no byte of it reached the client.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use hyper::body::{Body, Frame};
use hyper::http::uri::{Authority, PathAndQuery};
use hyper::http::{HeaderName, HeaderValue, Request, Uri, Version};

use crate::config::UpstreamProtocol;
use crate::exchange::error::{BodyEnd, Cause, TryError, TryFailure};
use crate::exchange::request::RequestBody;
use crate::exchange::request::{BodyFraming, Reject, RequestHead};
use crate::exchange::trace::TraceParent;
use crate::metrics::{class_index, ErrorKind};
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::h2_conns::StreamSlot;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// An endpoint's HTTP/2 response: its head, its body and trailers to come, and the request's
/// own stream when the client is still sending (full duplex).
impl H2Response {
    /// When the endpoint asks to be retried (`Retry-After`, `grpc-retry-pushback-ms`).
    pub(crate) fn pushback(&self) -> Option<crate::codec::pushback::Pushback> {
        // A success (no gRPC status in its head) asks nothing: its headers are not scanned.
        if self.head.status.as_u16() < 400 && self.grpc_status.is_none() {
            return None;
        }
        let headers = self.head.headers.iter();
        crate::codec::pushback::of_headers(
            self.head.status.as_u16(),
            headers.map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())),
        )
    }
}

pub(crate) struct H2Response {
    /// Status and headers.
    pub head: hyper::http::response::Parts,
    body: RecvStream,
    data_done: bool,
    trailers_done: bool,
    /// The `grpc-status` of a gRPC call, once known (a trailers-only answer has it in its
    /// head).
    grpc_status: Option<u32>,
    /// A gRPC call.
    grpc: bool,
    /// The request's stream and the piece not yet sent, when the endpoint answered before
    /// the client's body ended: the front end sends the rest ([`RequestPump`]).
    pub rest_of_request: Option<(SendStream<Bytes>, Option<Bytes>)>,
    _slot: StreamSlot,
}

impl H2Response {
    /// The next frame of the body (data, then trailers): `None` at its end.
    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        if !self.data_done {
            match ready!(self.body.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = self.body.flow_control().release_capacity(data.len());
                    self.settle_end();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => self.data_done = true,
            }
        }
        if self.trailers_done {
            return Poll::Ready(None);
        }
        match ready!(self.body.poll_trailers(cx)) {
            Ok(Some(trailers)) => {
                self.trailers_done = true;
                if let Some(code) = crate::exchange::grpc::grpc_status(&trailers) {
                    self.grpc_status = Some(code);
                }
                Poll::Ready(Some(Ok(Frame::trailers(trailers))))
            }
            Ok(None) => {
                self.trailers_done = true;
                Poll::Ready(None)
            }
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    /// True once the body and trailers are through.
    pub(crate) fn is_end_stream(&self) -> bool {
        self.trailers_done
    }

    /// After a DATA frame: when it carried END_STREAM, the body is at its end now, so that
    /// its renderer ends the client's stream on that same frame, not on an empty one after
    /// it. (h2's `is_end_stream`: END_STREAM received, not a reset, and nothing left to read,
    /// trailers included.)
    fn settle_end(&mut self) {
        if self.body.is_end_stream() {
            self.data_done = true;
            self.trailers_done = true;
        }
    }

    /// How a body read to its end ended, for the pick: a gRPC call by its status.
    pub(crate) fn end(&self) -> BodyEnd {
        match self.grpc_status {
            Some(code) if self.grpc => BodyEnd::Grpc(code),
            _ => BodyEnd::Done,
        }
    }

    /// The body's length, when the endpoint declared it.
    pub(crate) fn content_length(&self) -> Option<u64> {
        self.head
            .headers
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| crate::exchange::request::parse_content_length(v.as_bytes()))
    }
}

/// An HTTP/2 client's request body as h2 hands it over, read as a [`Body`] (by the front
/// end, and by [`RequestPump`] on its way to an HTTP/2 endpoint): each DATA
/// frame's bytes go back to the client's window as they are taken, the trailers come after
/// the data, and a stream the client ended with NO_ERROR or CANCEL (done sending) just ends.
pub(crate) struct RecvBody {
    recv: h2::RecvStream,
    data_done: bool,
}

impl RecvBody {
    pub(crate) fn new(recv: h2::RecvStream) -> Self {
        Self {
            recv,
            data_done: false,
        }
    }
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = self.get_mut();
        if !this.data_done {
            match std::task::ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => {
                    return match e.reason() {
                        Some(h2::Reason::NO_ERROR | h2::Reason::CANCEL) => Poll::Ready(None),
                        _ => Poll::Ready(Some(Err(e))),
                    }
                }
                None => this.data_done = true,
            }
        }
        match std::task::ready!(this.recv.poll_trailers(cx)) {
            Ok(trailers) => Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t)))),
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// Sends the rest of an HTTP/2 client's request body on the endpoint's stream, as the
/// response is relayed (polled by the response body: no task of its own).
pub(crate) struct RequestPump {
    send: SendStream<Bytes>,
    pending: Option<Bytes>,
    source: RecvBody,
    done: bool,
}

impl RequestPump {
    /// The rest of `source` goes to `send`, `pending` first.
    pub(crate) fn new(
        (send, pending): (SendStream<Bytes>, Option<Bytes>),
        source: RecvBody,
    ) -> Self {
        Self {
            send,
            pending,
            source,
            done: false,
        }
    }

    /// Moves what can move now; registers for wake-ups otherwise.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) {
        while !self.done {
            if let Some(data) = &mut self.pending {
                self.send.reserve_capacity(data.len());
                match self.send.poll_capacity(cx) {
                    Poll::Pending => return,
                    Poll::Ready(Some(Ok(n))) => {
                        let piece = data.split_to(n.min(data.len()));
                        if data.is_empty() {
                            self.pending = None;
                        }
                        if self.send.send_data(piece, false).is_err() {
                            self.done = true;
                        }
                    }
                    Poll::Ready(_) => self.done = true,
                }
                continue;
            }
            match Pin::new(&mut self.source).poll_frame(cx) {
                Poll::Pending => return,
                Poll::Ready(None) => {
                    let _ = self.send.send_data(Bytes::new(), true);
                    self.done = true;
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => self.pending = Some(data).filter(|d| !d.is_empty()),
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            let _ = self.send.send_trailers(trailers);
                        }
                        self.done = true;
                    }
                },
                Poll::Ready(Some(Err(_))) => {
                    self.send.send_reset(h2::Reason::CANCEL);
                    self.done = true;
                }
            }
        }
    }
}

/// The HTTP/2 request for a head as the rewrite left it (an HTTP/2 client's, or an HTTP/1.1
/// client's built as a map): its authority, or the endpoint's when it has none, and
/// `te: trailers` for a gRPC call. The header map is copied: its names and values are shared,
/// not copied, and a retry needs the original.
fn h2_request_of(
    parts: &hyper::http::request::Parts,
    entry: &EndpointEntry,
    tls: bool,
    grpc: bool,
    trace: Option<&TraceParent>,
) -> Option<Request<()>> {
    let mut uri = hyper::http::uri::Parts::default();
    uri.scheme = Some(if tls {
        hyper::http::uri::Scheme::HTTPS
    } else {
        hyper::http::uri::Scheme::HTTP
    });
    uri.authority = match parts.uri.authority() {
        Some(a) => Some(a.clone()),
        None => Some(Authority::try_from(entry.header.as_bytes()).ok()?),
    };
    uri.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    let mut r = Request::new(());
    *r.method_mut() = parts.method.clone();
    *r.uri_mut() = Uri::from_parts(uri).ok()?;
    *r.version_mut() = Version::HTTP_2;
    *r.headers_mut() = parts.headers.clone();
    if grpc {
        r.headers_mut()
            .insert(hyper::header::TE, HeaderValue::from_static("trailers"));
    }
    if let Some(t) = trace {
        let mut v = HeaderValue::from_bytes(&t.0).ok()?;
        // New on every try: a literal, not an HPACK table entry (as `x-request-id`).
        v.set_sensitive(true);
        r.headers_mut().insert(TRACEPARENT, v);
    }
    Some(r)
}

fn upstream(kind: ErrorKind, acted: bool, cause: Cause) -> TryFailure<Box<H2Response>> {
    TryFailure::Upstream(TryError {
        kind,
        may_have_acted: acted,
        cause,
    })
}

fn h2_cause(e: &h2::Error, reading: bool) -> Cause {
    let io = std::io::Error::other(e.to_string());
    if reading {
        Cause::Read(io)
    } else {
        Cause::Write(io)
    }
}

/// How sending the body ended.
enum Pumped {
    Done,
    Client(Reject),
    Upstream(h2::Error),
}

/// One step of sending a streamed body: a piece from the client, or as much of the pending
/// piece as the stream's window takes. Cancel-safe: what was read waits in `pending`.
async fn pump_step<B: RequestBody>(
    body: &mut B,
    send: &mut SendStream<Bytes>,
    pending: &mut Option<Bytes>,
) -> Option<Pumped> {
    if let Some(data) = pending {
        send.reserve_capacity(data.len());
        return match poll_fn(|cx| send.poll_capacity(cx)).await {
            Some(Ok(n)) => {
                let piece = data.split_to(n.min(data.len()));
                if data.is_empty() {
                    *pending = None;
                }
                send.send_data(piece, false).err().map(Pumped::Upstream)
            }
            Some(Err(e)) => Some(Pumped::Upstream(e)),
            None => Some(Pumped::Upstream(h2::Error::from(h2::Reason::STREAM_CLOSED))),
        };
    }
    match body.next_piece().await {
        Err(r) => Some(Pumped::Client(r)),
        Ok([]) => {
            let sent = match body.trailers() {
                Some(t) => send.send_trailers(t),
                None => send.send_data(Bytes::new(), true),
            };
            Some(sent.map_or_else(Pumped::Upstream, |()| Pumped::Done))
        }
        Ok(piece) => {
            *pending = Some(Bytes::copy_from_slice(piece));
            None
        }
    }
}

/// One try on an HTTP/2 endpoint: a stream on one of its connections, the request sent
/// (its body as the window allows, its trailers after), the response head awaited.
pub(crate) async fn try_once<B: RequestBody>(
    entry: &EndpointEntry,
    cluster: &Cluster,
    worker: usize,
    head: &hyper::http::request::Parts,
    meta: &RequestHead,
    body: &mut B,
    trace: Option<&TraceParent>,
) -> Result<Box<H2Response>, TryFailure<Box<H2Response>>> {
    let tls = cluster.config.protocol == UpstreamProtocol::H2;
    // The head came from a request keel parsed: it converts, unless the client sent
    // something HTTP/2 cannot carry.
    let h2_head = || {
        h2_request_of(head, entry, tls, meta.grpc, trace)
            .ok_or(TryFailure::Client(Reject::Malformed))
    };
    let mut request = Some(h2_head()?);
    let no_body = meta.body == BodyFraming::None;
    // A connection that failed between two requests is replaced (the request never left).
    let mut stale_left = 2;
    let (mut response, mut send, slot) = loop {
        let (sender, slot) = entry.h2.stream(worker, &entry.pool).await.map_err(|e| {
            let cause = Cause::from(e);
            upstream(ErrorKind::Connect, false, cause)
        })?;
        let sent = match sender.ready().await {
            // Built again only after a stale connection took the first one (rare).
            Ok(mut sender) => {
                let request = match request.take() {
                    Some(r) => r,
                    None => h2_head()?,
                };
                sender.send_request(request, no_body)
            }
            Err(e) => Err(e),
        };
        match sent {
            Ok((response, send)) => break (response, send, slot),
            Err(e) if stale_left > 0 => {
                tracing::debug!("HTTP/2 connection to {} unusable: {e}", entry.authority);
                stale_left -= 1;
            }
            Err(e) => return Err(upstream(ErrorKind::Reset, false, h2_cause(&e, false))),
        }
    };
    let mut rest_of_request = None;
    let answered = if no_body {
        response.await
    } else if let Some(inline) = body.inline() {
        // Small: h2 buffers it and sends it as the window opens.
        if let Err(e) = send.send_data(Bytes::copy_from_slice(inline), true) {
            return Err(upstream(ErrorKind::Reset, true, h2_cause(&e, false)));
        }
        response.await
    } else {
        let mut pending = None;
        loop {
            tokio::select! {
                biased;
                r = &mut response => {
                    // The endpoint answered before the body ended: a full-duplex client
                    // goes on sending through the front end; any other stops here.
                    if body.full_duplex() {
                        rest_of_request = Some((send, pending));
                    }
                    break r;
                }
                step = pump_step(&mut *body, &mut send, &mut pending) => match step {
                    None => {}
                    Some(Pumped::Done) => break (&mut response).await,
                    Some(Pumped::Client(r)) => {
                        send.send_reset(h2::Reason::CANCEL);
                        return Err(TryFailure::Client(r));
                    }
                    Some(Pumped::Upstream(e)) => {
                        return Err(upstream(ErrorKind::Reset, true, h2_cause(&e, false)))
                    }
                }
            }
        }
    };
    let response = match answered {
        Ok(r) => r,
        // RFC 9113 section 8.7: a stream refused was not processed; safe to send again.
        Err(e) if e.reason() == Some(h2::Reason::REFUSED_STREAM) => {
            return Err(upstream(ErrorKind::Reset, false, h2_cause(&e, true)))
        }
        Err(e) => return Err(upstream(ErrorKind::Reset, true, h2_cause(&e, true))),
    };
    let (head, recv) = response.into_parts();
    if head
        .headers
        .get_all(hyper::header::CONTENT_LENGTH)
        .iter()
        .nth(1)
        .is_some()
    {
        // As from an HTTP/1.1 endpoint: a second content-length is refused, even an equal one.
        let cause = Cause::InvalidResponse("repeated content-length header");
        return Err(upstream(ErrorKind::Protocol, true, cause));
    }
    let status = head.status.as_u16();
    entry.metrics.responses[class_index(status)].fetch_add(1, Relaxed);
    // A trailers-only answer (HEADERS with END_STREAM) carries its grpc-status in its head.
    let grpc_status = (meta.grpc && recv.is_end_stream())
        .then(|| crate::exchange::grpc::grpc_status(&head.headers))
        .flatten();
    let failure = if cluster.is_failure_status(status) {
        Some(Cause::Status(status))
    } else {
        grpc_status
            .filter(|c| cluster.is_failure_grpc_status(*c))
            .map(Cause::GrpcStatus)
    };
    // A HEAD's answer has no body whatever the endpoint sends (as from an HTTP/1.1 endpoint):
    // h2 refuses DATA on it as the endpoint's protocol error, which would reset the client's
    // stream and count against the endpoint.
    let ended = recv.is_end_stream() || meta.is_head;
    let response = Box::new(H2Response {
        data_done: ended,
        trailers_done: ended,
        head,
        body: recv,
        grpc_status,
        grpc: meta.grpc,
        rest_of_request,
        _slot: slot,
    });
    match failure {
        Some(cause) => Err(TryFailure::Status(response, cause)),
        None => Ok(response),
    }
}
