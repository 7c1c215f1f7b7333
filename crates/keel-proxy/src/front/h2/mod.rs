//! The HTTP/2 front end: hyper's HTTP/2 server is the codec; each request is rewritten by the
//! same rules as an HTTP/1.1 one ([`crate::exchange::request::rewrite`]) and handed to the same
//! attempt driver. An HTTP/1.1 endpoint's response head (HTTP/1.1 text, as the leg rewrote it)
//! becomes hyper's response, and its body is read from the endpoint's connection as hyper asks
//! for it; an HTTP/2 endpoint's response passes frame by frame, trailers included, with the
//! rest of a full-duplex request body sent alongside. keel's own answers to gRPC calls are
//! gRPC statuses (HTTP 200, trailers-only).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use crate::codec::chunked::ChunkedDecoder;
use crate::config::ListenerConfig;
use crate::driver::{
    self, Answer, BodyEnd, Client, OwnAnswer, Request, RequestBody, Tail, UpstreamResponse,
};
use crate::exchange::request::{BodyFraming, Reject, RequestRules};
use crate::leg::h1::response::Framing;
use crate::leg::h2::{H2Response, RequestPump};
use crate::observe::access_log::{AccessLog, Entry, RequestLine};
use crate::server::Shared;
use crate::upstream::pool::RawConn;

/// Request bodies with a length up to this are read whole before the request is forwarded
/// (any try can send them again); others stream.
const MAX_INLINE_BODY: u64 = 64 * 1024;

/// Serves an HTTP/2 connection (TLS with ALPN `h2`, or plain with prior knowledge) until it
/// ends, stays idle too long, or the proxy shuts down (then it finishes its requests).
pub(crate) async fn serve<I>(
    shared: Arc<Shared>,
    index: usize,
    settings: Arc<ListenerConfig>,
    client: Arc<Client>,
    io: I,
    mut stop: watch::Receiver<Option<Duration>>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(ConnActivity::new());
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_header_list_size(settings.max_header_bytes.min(u32::MAX as usize) as u32);
    let idle_timeout = settings.idle_timeout;
    let peer = client.peer;
    let conn_activity = activity.clone();
    let svc = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        let settings = settings.clone();
        let client = client.clone();
        let active = ActiveRequest::new(&conn_activity);
        async move { Ok::<_, Infallible>(handle(&shared, index, &settings, &client, req, active).await) }
    });
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    tokio::select! {
        biased;
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(%peer, "HTTP/2 client connection: {e}");
            }
            return;
        }
        _ = crate::server::wait_shutdown(&mut stop) => {}
        _ = activity.idle_for(idle_timeout) => {
            tracing::debug!(%peer, "closing a connection idle for {}", humantime::format_duration(idle_timeout));
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}

/// One request: rewritten, forwarded by the attempt driver, answered.
async fn handle(
    shared: &Shared,
    index: usize,
    settings: &ListenerConfig,
    client: &Arc<Client>,
    req: hyper::Request<Incoming>,
    active: ActiveRequest,
) -> Response<H2Body> {
    let started = Instant::now();
    let log = shared.access_log.load_full().map(|log| H2Log {
        log,
        client: client.clone(),
        started,
        cluster: None,
        route: None,
        head: Vec::new(),
    });
    let (parts, body) = req.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let fields = || {
        parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
    };
    let (target, route) = {
        let routing = shared.routing.load();
        let routes = &routing.listeners[index];
        let route = routes.choose(
            parts.method.as_str(),
            path,
            parts.uri.authority().map(|a| a.as_str()),
            fields,
        );
        (routes.target(route).cloned(), route)
    };
    let Some(target) = target else {
        shared.count_not_found(index);
        let mut log = log;
        if let Some(l) = &mut log {
            // The request as the log shows it: its line and `host`.
            l.head = format!(
                "{} {path} HTTP/2.0\r\nhost: {}\r\n",
                parts.method,
                parts.uri.authority().map_or("", |a| a.as_str())
            )
            .into_bytes();
        }
        return own_response(driver::not_found(), active, log);
    };
    let mut log = log;
    if let Some(l) = &mut log {
        l.cluster = Some(target.cluster.clone());
        l.route = route.index();
    }
    let max_body = settings.max_request_body_bytes.unwrap_or(u64::MAX);
    let rules = RequestRules::new(
        client,
        target.cluster.config.hash_on.as_ref(),
        usize::MAX,
        max_body,
    );
    let mut head = Vec::with_capacity(512);
    let meta = match crate::exchange::request::rewrite(
        parts.method.as_str(),
        path,
        parts.uri.authority().map(|a| a.as_str()),
        false,
        !body.is_end_stream(),
        fields,
        &rules,
        &mut head,
    ) {
        Ok(meta) => meta,
        Err(reject) => return refused(reject, active, log, is_grpc(&parts.headers)),
    };
    let grpc = meta.grpc;
    let mut out = Vec::with_capacity(512);
    let mut timer = crate::codec::idle_timer();
    let start = Instant::now();
    let request = Request {
        head: &mut head,
        meta: &meta,
        start,
        limits: target.limits,
    };
    let mut streamed = None;
    let answer = match meta.body {
        BodyFraming::Length(n) if n <= MAX_INLINE_BODY => {
            let read = tokio::time::timeout(settings.header_read_timeout, body.collect()).await;
            let data = match read {
                Ok(Ok(collected)) => collected.to_bytes(),
                Ok(Err(_)) => {
                    return refused(Reject::InvalidBody, active, log.with_head(head), grpc)
                }
                Err(_) => return refused(Reject::Timeout, active, log.with_head(head), grpc),
            };
            if data.len() as u64 != n {
                return refused(Reject::InvalidBody, active, log.with_head(head), grpc);
            }
            let mut inline = &data[..];
            driver::forward(
                &target.cluster,
                client,
                request,
                &mut inline,
                &mut out,
                &mut timer,
            )
            .await
        }
        BodyFraming::None => {
            driver::forward(
                &target.cluster,
                client,
                request,
                &mut &[][..],
                &mut out,
                &mut timer,
            )
            .await
        }
        _ => {
            let streamed = streamed.insert(ClientBody::new(body, max_body));
            let cluster = &target.cluster;
            driver::forward(cluster, client, request, streamed, &mut out, &mut timer).await
        }
    };
    let log = log.with_head(head);
    let up = match answer {
        Answer::Own(own) if grpc => return grpc_own_response(own, active, log),
        Answer::Own(own) => return own_response(own, active, log),
        Answer::Upstream(up) => up,
    };
    let (conn, rhead) = match up.response {
        UpstreamResponse::H1(conn, rhead) => (conn, rhead),
        UpstreamResponse::H2(mut response) => {
            let pump = match (response.rest_of_request.take(), streamed) {
                (Some((send, pending)), Some(mut body)) => {
                    let pending = pending.or_else(|| body.take_unsent());
                    Some(RequestPump::new((send, pending), body.body))
                }
                _ => None,
            };
            return h2_response(response, up.tail, pump, active, log);
        }
    };
    match response_parts(&out) {
        Ok(mut response) => {
            let framing = rhead.framing;
            if let Framing::Length(n) = framing {
                response
                    .headers_mut()
                    .insert(CONTENT_LENGTH, HeaderValue::from(n));
            }
            response.headers_mut().insert(
                crate::codec::X_KEEL_ENDPOINT,
                up.tail.endpoint_header().clone(),
            );
            let deadline = Box::pin(tokio::time::sleep_until(up.tail.deadline.into()));
            let left = match framing {
                Framing::Length(n) => n,
                _ => 0,
            };
            response.map(|()| {
                H2Body::Upstream(Box::new(UpstreamBody {
                    conn: Some(conn),
                    framing,
                    left,
                    decoder: ChunkedDecoder::default(),
                    keep_alive: rhead.keep_alive,
                    log: log.map(|l| {
                        Box::new(H2LogUpstream {
                            status: rhead.status,
                            endpoint: up.tail.endpoint_header().clone(),
                            attempts: up.tail.attempts,
                            sent: 0,
                            log: l,
                        })
                    }),
                    tail: Some(up.tail),
                    deadline,
                    _active: active,
                }))
            })
        }
        Err(()) => {
            // The leg wrote this head itself: it always parses. Should it not, the pick
            // is finished as the endpoint's failure.
            up.tail.end(BodyEnd::UpstreamFailed, None);
            const CAUSE: &str = "the endpoint's response head could not be forwarded";
            own_response(
                OwnAnswer {
                    status: 502,
                    text: driver::answer_text(502, CAUSE),
                    endpoint: None,
                    guard: None,
                    attempts: 1,
                    cause: CAUSE.to_string(),
                },
                active,
                log,
            )
        }
    }
}

/// True for a gRPC call.
fn is_grpc(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// keel's answer to a request refused before it reached the driver.
fn refused(
    reject: Reject,
    active: ActiveRequest,
    log: Option<H2Log>,
    grpc: bool,
) -> Response<H2Body> {
    if grpc {
        grpc_own_response(driver::refused(reject), active, log)
    } else {
        own_response(driver::refused(reject), active, log)
    }
}

/// keel's own answer to a gRPC call: HTTP 200, trailers-only, its status as `grpc-status`
/// (14 UNAVAILABLE for 502/503, 4 DEADLINE_EXCEEDED for 504) and its text as `grpc-message`.
fn grpc_own_response(
    own: OwnAnswer,
    active: ActiveRequest,
    log: Option<H2Log>,
) -> Response<H2Body> {
    if let Some(l) = &log {
        let endpoint = own.endpoint.as_ref().map(|e| e.as_bytes());
        l.write(own.status, 0, endpoint, own.attempts, Some(&own.cause));
    }
    let mut r = Response::new(H2Body::Own {
        data: None,
        _guard: own.guard,
        _active: active,
    });
    let headers = r.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(
        "grpc-status",
        HeaderValue::from(crate::exchange::grpc::status_for(own.status)),
    );
    headers.insert("grpc-message", crate::exchange::grpc::message(&own.text));
    if let Some(e) = own.endpoint {
        headers.insert(crate::codec::X_KEEL_ENDPOINT, e);
    }
    r
}

/// An HTTP/2 endpoint's response, passed on as it is (with `x-keel-endpoint`); a body
/// already at its end (trailers-only) finishes the pick at once.
fn h2_response(
    response: Box<H2Response>,
    tail: Tail,
    pump: Option<RequestPump>,
    active: ActiveRequest,
    log: Option<H2Log>,
) -> Response<H2Body> {
    let mut head = response.head.clone();
    head.headers.insert(
        crate::codec::X_KEEL_ENDPOINT,
        tail.endpoint_header().clone(),
    );
    let deadline = Box::pin(tokio::time::sleep_until(tail.deadline.into()));
    let log = log.map(|l| {
        Box::new(H2LogUpstream {
            status: head.status.as_u16(),
            endpoint: tail.endpoint_header().clone(),
            attempts: tail.attempts,
            sent: 0,
            log: l,
        })
    });
    let mut body = H2UpstreamBody {
        response,
        tail: Some(tail),
        pump,
        deadline,
        log,
        _active: active,
    };
    if body.response.is_end_stream() {
        let end = body.response.end();
        body.end(end);
    }
    Response::from_parts(head, H2Body::H2Upstream(Box::new(body)))
}

/// What the access log needs of an HTTP/2 request besides its answer.
struct H2Log {
    log: Arc<AccessLog>,
    client: Arc<Client>,
    started: Instant,
    cluster: Option<Arc<crate::upstream::cluster::Cluster>>,
    route: Option<u16>,
    /// The head as rewritten for the upstream (the request line and headers the log shows).
    head: Vec<u8>,
}

/// The answer's part of an HTTP/2 access-log line, written when its body ends.
struct H2LogUpstream {
    log: H2Log,
    status: u16,
    endpoint: HeaderValue,
    attempts: u32,
    /// Body bytes sent.
    sent: u64,
}

impl H2LogUpstream {
    /// Writes the line of a response whose body has ended.
    fn write(&self) {
        self.log.write(
            self.status,
            self.sent,
            Some(self.endpoint.as_bytes()),
            self.attempts,
            None,
        );
    }
}

trait WithHead {
    fn with_head(self, head: Vec<u8>) -> Self;
}

impl WithHead for Option<H2Log> {
    /// The log context with the request's rewritten head (moved, not copied).
    fn with_head(mut self, head: Vec<u8>) -> Self {
        if let Some(l) = &mut self {
            l.head = head;
        }
        self
    }
}

impl H2Log {
    fn write(
        &self,
        status: u16,
        sent: u64,
        endpoint: Option<&[u8]>,
        attempts: u32,
        cause: Option<&str>,
    ) {
        self.log.log(
            self.client.worker,
            &Entry {
                client: &self.client.ip,
                request: RequestLine::parse(&self.head),
                protocol: "HTTP/2.0",
                status,
                bytes_sent: sent,
                body_bytes_sent: sent,
                duration: self.started.elapsed(),
                cluster: self.cluster.as_ref().map(|c| c.name()),
                endpoint,
                attempts,
                route: self.route,
                cause,
            },
        );
    }
}

fn own_response(own: OwnAnswer, active: ActiveRequest, log: Option<H2Log>) -> Response<H2Body> {
    if let Some(l) = &log {
        let endpoint = own.endpoint.as_ref().map(|e| e.as_bytes());
        l.write(
            own.status,
            own.text.len() as u64,
            endpoint,
            own.attempts,
            Some(&own.cause),
        );
    }
    let mut r = Response::new(H2Body::Own {
        data: Some(Bytes::from(own.text)),
        _guard: own.guard,
        _active: active,
    });
    *r.status_mut() = StatusCode::from_u16(own.status).unwrap_or(StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Some(e) = own.endpoint {
        r.headers_mut().insert(crate::codec::X_KEEL_ENDPOINT, e);
    }
    r
}

/// The response that an HTTP/1.1 head (as the leg rewrote it: status line and headers, no
/// framing headers, no final blank line) stands for. HTTP/2 forbids connection-specific
/// headers; the rewrite already removed them.
fn response_parts(head: &[u8]) -> Result<Response<()>, ()> {
    let mut with_end = Vec::with_capacity(head.len() + 2);
    with_end.extend_from_slice(head);
    with_end.extend_from_slice(b"\r\n");
    let mut headers = [MaybeUninit::<httparse::Header<'_>>::uninit(); 128];
    let mut parsed = httparse::Response::new(&mut []);
    let complete = httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut parsed, &with_end, &mut headers)
        .map_err(|_| ())?;
    if !complete.is_complete() {
        return Err(());
    }
    let mut response = Response::new(());
    *response.status_mut() = StatusCode::from_u16(parsed.code.ok_or(())?).map_err(|_| ())?;
    let map = response.headers_mut();
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| ())?;
        let value = HeaderValue::from_bytes(h.value).map_err(|_| ())?;
        map.append(name, value);
    }
    Ok(response)
}

/// An HTTP/2 client's request body, streamed as the leg asks for it. Its first
/// `MAX_INLINE_BODY` bytes are kept, so that a try that failed before the endpoint acted
/// (a gRPC UNAVAILABLE) can send them again to another endpoint.
struct ClientBody {
    body: Incoming,
    piece: Bytes,
    started: bool,
    /// A frame is being awaited from the client.
    reading: bool,
    received: u64,
    max: u64,
    /// What was handed out so far, while it fits in `MAX_INLINE_BODY`.
    recorded: Vec<u8>,
    /// More was handed out than was kept: the body cannot be sent again.
    overflowed: bool,
    /// The recording goes out again before the rest.
    replay: bool,
    /// The client's stream ended.
    ended: bool,
    trailers: Option<hyper::HeaderMap>,
}

impl ClientBody {
    fn new(body: Incoming, max: u64) -> Self {
        Self {
            body,
            piece: Bytes::new(),
            started: false,
            reading: false,
            received: 0,
            max,
            recorded: Vec::new(),
            overflowed: false,
            replay: false,
            ended: false,
            trailers: None,
        }
    }

    /// The recording, when a rewind made it due again and it was not sent yet.
    fn take_unsent(&mut self) -> Option<Bytes> {
        let due = std::mem::take(&mut self.replay) && !self.recorded.is_empty();
        due.then(|| Bytes::from(std::mem::take(&mut self.recorded)))
    }
}

impl RequestBody for ClientBody {
    fn started(&self) -> bool {
        self.started
    }

    fn waiting_on_client(&self) -> bool {
        self.reading
    }

    fn rewind(&mut self) -> bool {
        if !self.started {
            return true;
        }
        if self.overflowed {
            return false;
        }
        self.replay = true;
        true
    }

    fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        self.trailers.clone()
    }

    fn full_duplex(&self) -> bool {
        true
    }

    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        self.started = true;
        if std::mem::take(&mut self.replay) && !self.recorded.is_empty() {
            return Ok(&self.recorded);
        }
        if self.ended {
            return Ok(&[]);
        }
        loop {
            self.reading = true;
            let frame = self.body.frame().await;
            self.reading = false;
            match frame {
                None => {
                    self.ended = true;
                    return Ok(&[]);
                }
                Some(Err(_)) => return Err(Reject::InvalidBody),
                Some(Ok(frame)) => {
                    // Trailers go to HTTP/2 endpoints (HTTP/1.1 ones get none).
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(frame) => {
                            self.trailers = frame.into_trailers().ok();
                            continue;
                        }
                    };
                    if data.is_empty() {
                        continue;
                    }
                    self.received += data.len() as u64;
                    if self.received > self.max {
                        return Err(Reject::BodyTooLarge);
                    }
                    if !self.overflowed {
                        if self.recorded.len() + data.len() <= MAX_INLINE_BODY as usize {
                            self.recorded.extend_from_slice(&data);
                        } else {
                            self.overflowed = true;
                            self.recorded = Vec::new();
                        }
                    }
                    self.piece = data;
                    return Ok(&self.piece);
                }
            }
        }
    }
}

/// A response body sent to an HTTP/2 client.
pub(crate) enum H2Body {
    /// keel's own answer.
    Own {
        data: Option<Bytes>,
        _guard: Option<driver::DownstreamGuard>,
        _active: ActiveRequest,
    },
    /// The endpoint's body, read from its connection.
    Upstream(Box<UpstreamBody>),
    /// An HTTP/2 endpoint's body and trailers.
    H2Upstream(Box<H2UpstreamBody>),
}

/// An HTTP/2 endpoint's body and trailers on their way to the client, the rest of the
/// client's body going the other way; the end finishes the pick (a gRPC call's by its status).
pub(crate) struct H2UpstreamBody {
    response: Box<H2Response>,
    tail: Option<Tail>,
    pump: Option<RequestPump>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// The access-log line to write when the body ends.
    log: Option<Box<H2LogUpstream>>,
    _active: ActiveRequest,
}

impl H2UpstreamBody {
    fn end(&mut self, end: BodyEnd) {
        if let Some(tail) = self.tail.take() {
            tail.end(end, None);
            if let Some(l) = self.log.take() {
                l.write();
            }
        }
    }
}

impl Drop for H2UpstreamBody {
    fn drop(&mut self) {
        self.end(BodyEnd::ClientGone);
    }
}

/// The endpoint's body, read from its connection as hyper asks for it, until the request's
/// deadline; its end finishes the pick.
pub(crate) struct UpstreamBody {
    conn: Option<RawConn>,
    framing: Framing,
    /// Bytes of a `Length` body not yet sent.
    left: u64,
    decoder: ChunkedDecoder,
    keep_alive: bool,
    tail: Option<Tail>,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// The access-log line to write when the body ends.
    log: Option<Box<H2LogUpstream>>,
    _active: ActiveRequest,
}

impl UpstreamBody {
    fn end(&mut self, end: BodyEnd) {
        if let Some(tail) = self.tail.take() {
            let conn = self.conn.take().filter(|_| self.keep_alive);
            tail.end(end, conn);
            if let Some(l) = self.log.take() {
                l.write();
            }
        }
    }

    /// The next frame's data: `Ok(None)` at the end of the body.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, String>> {
        let Some(conn) = self.conn.as_mut() else {
            return Poll::Ready(Ok(None));
        };
        loop {
            match self.framing {
                Framing::Empty => return Poll::Ready(Ok(None)),
                Framing::Length(_) if self.left == 0 => return Poll::Ready(Ok(None)),
                Framing::Length(_) if !conn.buf.is_empty() => {
                    let n = (conn.buf.len() as u64).min(self.left) as usize;
                    self.left -= n as u64;
                    return Poll::Ready(Ok(Some(conn.buf.split_to(n).freeze())));
                }
                Framing::Chunked if !conn.buf.is_empty() => {
                    let step = self.decoder.step(&conn.buf).map_err(|e| e.to_string())?;
                    conn.buf.advance(step.framing);
                    if step.data > 0 {
                        return Poll::Ready(Ok(Some(conn.buf.split_to(step.data).freeze())));
                    }
                    if step.done {
                        return Poll::Ready(Ok(None));
                    }
                    continue;
                }
                Framing::Chunked if self.decoder.is_done() => return Poll::Ready(Ok(None)),
                Framing::Close if !conn.buf.is_empty() => {
                    let n = conn.buf.len();
                    return Poll::Ready(Ok(Some(conn.buf.split_to(n).freeze())));
                }
                _ => {}
            }
            match poll_read_buf(conn, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) if self.framing == Framing::Close => {
                    self.keep_alive = false;
                    return Poll::Ready(Ok(None));
                }
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err("connection closed in the middle of the body".into()))
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
            }
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // hyper drops an unfinished body when the client resets the stream or goes away.
        self.end(BodyEnd::ClientGone);
    }
}

/// Reads what the endpoint's connection has into its buffer.
fn poll_read_buf(conn: &mut RawConn, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    if conn.buf.capacity() - conn.buf.len() < 4096 {
        conn.buf.reserve(16 * 1024);
    }
    let spare = conn.buf.chunk_mut();
    // SAFETY: `ReadBuf` only writes initialized bytes into the spare capacity and reports how
    // many; exactly those are then marked as filled.
    let spare = unsafe { &mut *(spare as *mut _ as *mut [MaybeUninit<u8>]) };
    let mut read = ReadBuf::uninit(spare);
    match Pin::new(&mut conn.io).poll_read(cx, &mut read) {
        Poll::Ready(Ok(())) => {
            let n = read.filled().len();
            // SAFETY: `n` bytes of the spare capacity were initialized by the read.
            unsafe { conn.buf.advance_mut(n) };
            Poll::Ready(Ok(n))
        }
        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        Poll::Pending => Poll::Pending,
    }
}

impl Body for H2Body {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            H2Body::Own { data, .. } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            H2Body::Upstream(up) => match up.poll_data(cx) {
                Poll::Ready(Ok(Some(data))) => {
                    if let Some(l) = &mut up.log {
                        l.sent += data.len() as u64;
                    }
                    Poll::Ready(Some(Ok(Frame::data(data))))
                }
                Poll::Ready(Ok(None)) => {
                    up.end(BodyEnd::Done);
                    Poll::Ready(None)
                }
                Poll::Ready(Err(cause)) => {
                    tracing::debug!("response body failed: {cause}");
                    up.end(BodyEnd::UpstreamFailed);
                    Poll::Ready(Some(Err(cause.into())))
                }
                Poll::Pending => {
                    if up.deadline.as_mut().poll(cx).is_ready() {
                        up.end(BodyEnd::Timeout);
                        return Poll::Ready(Some(Err(
                            "request timeout reached while streaming the response body".into(),
                        )));
                    }
                    Poll::Pending
                }
            },
            H2Body::H2Upstream(up) => {
                if let Some(pump) = &mut up.pump {
                    pump.poll(cx);
                }
                match up.response.poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let (Some(l), Some(data)) = (&mut up.log, frame.data_ref()) {
                            l.sent += data.len() as u64;
                        }
                        // Trailers end the body: hyper may not poll again after them.
                        if frame.is_trailers() {
                            let end = up.response.end();
                            up.end(end);
                        }
                        Poll::Ready(Some(Ok(frame)))
                    }
                    Poll::Ready(None) => {
                        let end = up.response.end();
                        up.end(end);
                        Poll::Ready(None)
                    }
                    Poll::Ready(Some(Err(e))) => {
                        tracing::debug!("response body failed: {e}");
                        up.end(BodyEnd::UpstreamFailed);
                        Poll::Ready(Some(Err(e.into())))
                    }
                    Poll::Pending => {
                        if up.tail.is_some() && up.deadline.as_mut().poll(cx).is_ready() {
                            up.end(BodyEnd::Timeout);
                            return Poll::Ready(Some(Err(
                                "request timeout reached while streaming the response body".into(),
                            )));
                        }
                        Poll::Pending
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            H2Body::Own { data, .. } => data.is_none(),
            H2Body::Upstream(up) => up.tail.is_none(),
            H2Body::H2Upstream(up) => up.response.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            H2Body::Own { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            H2Body::Upstream(up) => match up.framing {
                Framing::Length(_) => SizeHint::with_exact(up.left),
                Framing::Empty => SizeHint::with_exact(0),
                _ => SizeHint::default(),
            },
            H2Body::H2Upstream(up) => match up.response.content_length() {
                Some(n) if !up.response.is_end_stream() => SizeHint::with_exact(n),
                _ => SizeHint::default(),
            },
        }
    }
}

/// A connection's activity: requests being served and when the last one ended, read by the
/// connection's idle timer.
#[derive(Debug)]
struct ConnActivity {
    base: Instant,
    active: AtomicU32,
    /// When the last response finished, in nanoseconds since `base`.
    last_end_nanos: AtomicU64,
}

impl ConnActivity {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            active: AtomicU32::new(0),
            last_end_nanos: AtomicU64::new(0),
        }
    }

    /// Resolves once the connection has had no request in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.last_end_nanos.load(Ordering::Relaxed);
            let deadline = self.base + Duration::from_nanos(last) + idle;
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
pub(crate) struct ActiveRequest(Arc<ConnActivity>);

impl ActiveRequest {
    fn new(activity: &Arc<ConnActivity>) -> Self {
        activity.active.fetch_add(1, Ordering::Relaxed);
        Self(activity.clone())
    }
}

impl Drop for ActiveRequest {
    fn drop(&mut self) {
        let c = &self.0;
        c.last_end_nanos
            .store(c.base.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.active.fetch_sub(1, Ordering::Release);
    }
}

/// A stream whose first bytes were already read (by the HTTP/1.1 front end, which found
/// HTTP/2's preface): they are read again first.
pub(crate) struct Prefixed<S> {
    prefix: BytesMut,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `prefix` comes out of reads before `inner`'s bytes.
    pub(crate) fn new(prefix: BytesMut, inner: S) -> Self {
        Self { prefix, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
