//! The HTTP/2 front end: the `h2` crate's server is the codec, a task per stream. Each
//! request's head is checked and rewritten by the same rules as an HTTP/1.1 one
//! (`crate::exchange::rewrite`), in the form its endpoint's leg sends, and handed to the same
//! attempt driver; `send` writes the response. An HTTP/1.1 endpoint's response head is read
//! into a header map, and its body is read from the endpoint's connection as the client's
//! window takes it; an HTTP/2 endpoint's response passes frame by frame, trailers included,
//! with the rest of a full-duplex request body sent alongside. keel's own answers to gRPC
//! calls are gRPC statuses (HTTP 200, trailers-only).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Body;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use crate::config::{ListenerConfig, UpstreamProtocol};
use crate::driver::account::Tail;
use crate::driver::answer::{self, Answer, OwnAnswer, Upstream};
use crate::exchange::error::BodyEnd;
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{
    request_target, valid_authority, BodyFraming, Client, Reject, RequestHead, RequestRules,
};
use crate::exchange::request::{Upload, UploadBounds};
use crate::forward::{self, Request};
use crate::leg::h2::{RecvBody, RequestPump};
use crate::leg::ResponseBody;
use crate::observe::record::Record;
use crate::state::Shared;
use crate::upstream::cluster::Cluster;

mod blocks;
pub(crate) mod body;
pub(crate) mod log;
mod send;

use body::{ActiveRequest, ClientBody, ConnActivity, H2Body, UpstreamBody, MAX_INLINE_BODY};
use log::{H2Answered, H2Scope, LoggedHead};

/// Serves an HTTP/2 connection (TLS with ALPN `h2`, or plain with prior knowledge) until it
/// ends, stays idle too long, or the proxy shuts down (then it finishes its requests).
/// Only requests count as activity: a connection with none in flight is idle, whatever
/// other frames (PING, SETTINGS, WINDOW_UPDATE, a header block not finished) it sends. Until
/// its first request it may stay idle for `header_read_timeout` at most (the wait an
/// HTTP/1.1 connection has for its first byte), then `idle_timeout` between requests; a
/// header block left open is cut at `header_read_timeout` ([`blocks`]). After its GOAWAY, a
/// connection with no request in flight is closed `header_read_timeout` later, whether or
/// not the client answered the GOAWAY's PING or closed its side.
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
    let peer = client.peer;
    let first = settings.header_read_timeout.min(settings.idle_timeout);
    let idle = activity.idle_for(first, settings.idle_timeout, Instant::now());
    let stalled = activity.stalled_for(settings.client_idle_timeout);
    let shutdown = crate::state::wait_shutdown(&mut stop);
    tokio::pin!(idle, stalled, shutdown);
    let io = blocks::HeaderBlocks::new(io, settings.header_read_timeout);
    let handshake = builder(&settings).handshake::<_, Bytes>(io);
    let mut conn = tokio::select! {
        biased;
        r = handshake => match r {
            Ok(conn) => conn,
            Err(e) => {
                tracing::debug!(%peer, "HTTP/2 client connection: {e}");
                return;
            }
        },
        _ = &mut shutdown => return,
        _ = &mut idle => return,
    };
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Some(Ok((req, reply))) => spawn_stream(&shared, index, &settings, &client, &activity, req, reply),
                Some(Err(e)) => {
                    tracing::debug!(%peer, "HTTP/2 client connection: {e}");
                    return;
                }
                None => return,
            },
            _ = &mut shutdown => break,
            _ = &mut idle => {
                tracing::debug!(%peer, "closing an idle HTTP/2 connection (idle_timeout, or header_read_timeout before its first request)");
                break;
            }
            _ = &mut stalled => {
                // No single stream is reset: the connection goes, and with it every stream,
                // its endpoint connection and its slots.
                tracing::info!(%peer, "closing an HTTP/2 connection whose client took no response data for {} (client_idle_timeout)", humantime::format_duration(settings.client_idle_timeout));
                return;
            }
        }
    }
    // GOAWAY; the streams the client opened before it saw it are still served. `h2` sends
    // the last GOAWAY once the client answers its PING, then closes when no stream is left;
    // a client that never answers would keep the connection, so it is closed once it has had
    // no request in flight for `header_read_timeout` since the GOAWAY.
    conn.graceful_shutdown();
    let grace = settings.header_read_timeout;
    let quiet = activity.idle_for(grace, grace, Instant::now());
    tokio::pin!(quiet);
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Some(Ok((req, reply))) => spawn_stream(&shared, index, &settings, &client, &activity, req, reply),
                _ => return,
            },
            _ = &mut quiet => {
                tracing::debug!(%peer, "closing an HTTP/2 connection {} after its GOAWAY", humantime::format_duration(grace));
                return;
            }
        }
    }
}

/// One stream, in a task of its own: the request handled, its response sent.
fn spawn_stream(
    shared: &Arc<Shared>,
    index: usize,
    settings: &Arc<ListenerConfig>,
    client: &Arc<Client>,
    activity: &Arc<ConnActivity>,
    req: hyper::Request<h2::RecvStream>,
    reply: h2::server::SendResponse<Bytes>,
) {
    let active = ActiveRequest::new(activity);
    let (shared, settings, client) = (shared.clone(), settings.clone(), client.clone());
    // Boxed: tokio copies a task's future when it spawns it, and this one is large.
    let handled =
        Box::pin(async move { handle(&shared, index, &settings, &client, req, active).await });
    tokio::spawn(send::Respond::new(handled, reply));
}

/// The connection's settings: hyper's server defaults (its windows of 1 MiB, 200 streams,
/// a send buffer of 400 KiB per stream, 1,024 locally caused resets before GOAWAY), and the
/// listener's header list limit.
fn builder(settings: &ListenerConfig) -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(1 << 20)
        .initial_connection_window_size(1 << 20)
        .max_frame_size(16 * 1024)
        .max_concurrent_streams(200)
        .max_send_buffer_size(400 * 1024)
        .max_local_error_reset_streams(Some(1024))
        .max_header_list_size(settings.max_header_bytes.min(u32::MAX as usize) as u32);
    b
}

/// One request: rewritten, forwarded by the attempt driver, answered.
async fn handle(
    shared: &Shared,
    index: usize,
    settings: &ListenerConfig,
    client: &Arc<Client>,
    req: hyper::Request<h2::RecvStream>,
    active: ActiveRequest,
) -> Response<H2Body> {
    let started = Instant::now();
    let mut scope = H2Scope {
        log: shared.access_log.load_full(),
        client: client.clone(),
        started,
        route: None,
        request: LoggedHead::None,
        protocol: "HTTP/2.0",
        metrics: None,
        received: 0,
    };
    let (mut parts, body) = req.into_parts();
    let body = RecvBody::new(body);
    // The method, the target and the authority are checked before routing, by the rules the
    // HTTP/1.1 front end applies: no CONNECT, `:path` in origin form (or `*` for OPTIONS),
    // `:authority` and `Host` valid. An absolute form has no place in `:path`.
    let target = parts.uri.path_and_query().map_or("", |p| p.as_str());
    let checked = match request_target(parts.method.as_str(), target) {
        Ok((_, Some(_))) => Err(Reject::UnsupportedTarget),
        Ok(_) => Ok(()),
        Err(r) => Err(r),
    }
    .and_then(|()| {
        let authority = parts.uri.authority().map(|a| a.as_str().as_bytes());
        let host = parts.headers.get(hyper::header::HOST).map(|h| h.as_bytes());
        if authority.into_iter().chain(host).all(valid_authority) {
            Ok(())
        } else {
            Err(Reject::InvalidHost)
        }
    });
    if let Err(reject) = checked {
        let grpc = is_grpc(&parts.headers);
        let scope = scope.with_request(|| LoggedHead::Map(Box::new(parts)));
        return refused(reject, active, scope, None, grpc);
    }
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
        let scope = scope.with_request(|| LoggedHead::Map(Box::new(parts)));
        return own_response(answer::not_found(), active, scope, None);
    };
    scope.route = route.index();
    scope.metrics = Some(target.route.metrics.clone());
    let cluster = &*target.cluster;
    let max_body = settings.max_request_body_bytes.unwrap_or(u64::MAX);
    let rules = RequestRules {
        request_id: settings.generate_request_id,
        join_cookies: true,
        ..RequestRules::new(
            client,
            target.cluster.config.balance.hash_on.as_ref(),
            usize::MAX,
            max_body,
        )
    };
    // The head is written in the form its leg sends: HTTP/1.1 text for an HTTP/1.1 endpoint
    // (written straight from h2's map: cheaper than editing the map, then writing it out),
    // the map itself, edited in place, for an HTTP/2 one.
    let http1 = cluster.config.protocol == UpstreamProtocol::Http1;
    let mut text = Vec::new();
    let unframed = !body.is_end_stream();
    let rewritten = if http1 {
        text.reserve(512);
        let authority = parts.uri.authority().map(|a| a.as_str());
        let method = parts.method.as_str();
        crate::exchange::rewrite::rewrite(
            method, path, authority, false, unframed, fields, &rules, &mut text,
        )
    } else {
        crate::exchange::rewrite::rewrite_h2(&mut parts, unframed, &rules)
    };
    let meta = match rewritten {
        // An HTTP/1.1 endpoint's answer is read into a header map, which `send` sends.
        Ok(meta) => RequestHead {
            http2: true,
            ..meta
        },
        Err(reject) => {
            let grpc = is_grpc(&parts.headers);
            let scope = scope.with_request(|| LoggedHead::Map(Box::new(parts)));
            return refused(reject, active, scope, Some(cluster), grpc);
        }
    };
    let grpc = meta.grpc;
    if let BodyFraming::Length(n) = meta.body {
        scope.received = n;
    }
    // Where an HTTP/1.1 leg writes a response head as text: never, for an HTTP/2 client (it
    // reads the head into a map), so not allocated.
    let mut out = Vec::new();
    let mut timer = crate::io::idle_timer();
    let start = Instant::now();
    let request = Request {
        head: if http1 {
            RequestHeaders::Lines(&mut text)
        } else {
            RequestHeaders::Map(&mut parts)
        },
        meta: &meta,
        start,
        limits: target.limits,
        policy: target.policy.as_deref(),
        body_progress: None,
        route: &target.route,
    };
    let progress = crate::io::BodyProgress::default();
    let mut streamed = None;
    let answer = match meta.body {
        BodyFraming::Length(n) if n <= MAX_INLINE_BODY => {
            let read = tokio::time::timeout(settings.client_idle_timeout, body.collect()).await;
            // A body of another length than announced is malformed.
            let data = match read {
                Ok(Ok(collected)) => Some(collected.to_bytes())
                    .filter(|d| d.len() as u64 == n)
                    .ok_or(Reject::InvalidBody),
                Ok(Err(_)) => Err(Reject::InvalidBody),
                Err(_) => Err(Reject::Timeout),
            };
            let data = match data {
                Ok(data) => data,
                Err(reject) => {
                    let scope = scope.with_request(|| LoggedHead::of(http1, text, parts));
                    return refused(reject, active, scope, Some(cluster), grpc);
                }
            };
            let mut inline = &data[..];
            forward::forward(
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
            forward::forward(
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
            // The body's reads within its bounds; the try's clock stands still while they
            // wait on the client (the HTTP/1.1 front end's upload model).
            let bounds = UploadBounds::of(settings, cluster.config.timeouts.max_duration, start);
            let upload = Upload::new(bounds, start).with_progress(&progress, start);
            let streamed = streamed.insert(ClientBody::new(body, max_body, upload));
            let request = Request {
                body_progress: Some(&progress),
                ..request
            };
            let cluster = &target.cluster;
            forward::forward(cluster, client, request, streamed, &mut out, &mut timer).await
        }
    };
    let scope = scope.with_request(|| LoggedHead::of(http1, text, parts));
    let up = match answer {
        Answer::Own(own) if grpc => return grpc_own_response(own, active, scope, Some(cluster)),
        Answer::Own(own) => return own_response(own, active, scope, Some(cluster)),
        Answer::Upstream(up) => up,
    };
    let Upstream { mut response, tail } = up;
    let pump = match (response.rest_of_request(), streamed) {
        (Some((send, pending)), Some(mut body)) => {
            let pending = pending.or_else(|| body.take_unsent());
            Some(RequestPump::new((send, pending), body.body))
        }
        _ => None,
    };
    match response.into_parts(&out) {
        Ok((head, body)) => upstream_response(head, body, tail, pump, active, scope),
        Err(_) => {
            // The leg wrote this head itself: it always converts. Should it not, the pick
            // is finished as the endpoint's failure.
            let cluster = tail.cluster.clone();
            tail.end(BodyEnd::UpstreamFailed, None);
            let own = answer::unforwardable("the endpoint's response head could not be forwarded");
            own_response(own, active, scope, Some(&cluster))
        }
    }
}

/// True for a gRPC call.
pub(crate) fn is_grpc(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// keel's answer to a request refused before it reached the driver.
pub(crate) fn refused(
    reject: Reject,
    active: ActiveRequest,
    scope: H2Scope,
    cluster: Option<&Cluster>,
    grpc: bool,
) -> Response<H2Body> {
    if grpc {
        grpc_own_response(answer::refused(reject), active, scope, cluster)
    } else {
        own_response(answer::refused(reject), active, scope, cluster)
    }
}

/// Writes the record of keel's own answer (`sent`: its body's bytes).
fn record_own(scope: &H2Scope, cluster: Option<&Cluster>, own: &OwnAnswer, sent: u64) {
    Record {
        endpoint: own.endpoint.as_ref().map(|e| e.as_bytes()),
        attempts: own.attempts,
        tries: Some(&own.tries),
        cause: Some(&own.cause),
        own: true,
        bytes_sent: sent,
        body_bytes_sent: sent,
        ..scope.record(cluster, own.status)
    }
    .write(scope.log.as_deref());
}

/// keel's own answer to a gRPC call: HTTP 200, trailers-only, its status as `grpc-status`
/// (14 UNAVAILABLE for 502/503, 4 DEADLINE_EXCEEDED for 504) and its text as `grpc-message`.
pub(crate) fn grpc_own_response(
    own: OwnAnswer,
    active: ActiveRequest,
    scope: H2Scope,
    cluster: Option<&Cluster>,
) -> Response<H2Body> {
    let shown = own.shown_endpoint().cloned();
    record_own(&scope, cluster, &own, 0);
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
    if let Some(e) = shown {
        headers.insert(crate::codec::X_KEEL_ENDPOINT, e);
    }
    for (name, value) in own.headers {
        headers.append(name, value);
    }
    r
}

/// An endpoint's response, whichever leg read it: its head (with `x-keel-endpoint`) and its
/// body frame by frame; a body already at its end (a gRPC trailers-only answer) finishes the
/// pick at once.
pub(crate) fn upstream_response(
    mut head: hyper::http::response::Parts,
    body: ResponseBody,
    tail: Tail,
    pump: Option<RequestPump>,
    mut active: ActiveRequest,
    scope: H2Scope,
) -> Response<H2Body> {
    active.owe();
    if let Some(e) = tail.shown_endpoint() {
        head.headers
            .insert(crate::codec::X_KEEL_ENDPOINT, e.clone());
    }
    let due = tail.body_deadline(Instant::now());
    let record = H2Answered {
        scope,
        status: head.status.as_u16(),
        sent: 0,
    };
    let mut body = UpstreamBody {
        body,
        tail: Some(tail),
        pump,
        due,
        timer: None,
        record,
        active,
    };
    if body.body.is_end_stream() {
        let end = body.body.end();
        body.end(end);
    }
    Response::from_parts(head, H2Body::Upstream(Box::new(body)))
}

pub(crate) fn own_response(
    own: OwnAnswer,
    active: ActiveRequest,
    scope: H2Scope,
    cluster: Option<&Cluster>,
) -> Response<H2Body> {
    let shown = own.shown_endpoint().cloned();
    record_own(&scope, cluster, &own, own.text.len() as u64);
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
    if let Some(e) = shown {
        r.headers_mut().insert(crate::codec::X_KEEL_ENDPOINT, e);
    }
    for (name, value) in own.headers {
        // Its own content type replaces the text one (an OpenAI-shaped error is JSON).
        if name == CONTENT_TYPE {
            r.headers_mut().insert(name, value);
        } else {
            r.headers_mut().append(name, value);
        }
    }
    r
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
