//! The HTTP/3 front end: hyperium's `h3` over quinn is the codec, a task per request stream.
//! It parses and renders only, as the HTTP/2 front end does, and shares its pieces: each
//! request's head is checked and rewritten by the same rules (`crate::exchange::rewrite`), in
//! the form its endpoint's leg sends, handed to `forward::forward`, and answered with the
//! HTTP/2 front end's responses (`front::h2`: keel's own answers, an endpoint's body frame by
//! frame, the record written when it ends), sent as the client's flow control takes them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use h3::error::Code;
use h3::server::RequestStream;
use http_body_util::BodyExt;
use hyper::body::Body;
use hyper::header::{HeaderValue, CONTENT_LENGTH, DATE};
use hyper::Response;
use tokio::sync::watch;

use crate::config::{ListenerConfig, UpstreamProtocol};
use crate::driver::answer::{self, Answer, Upstream};
use crate::exchange::error::BodyEnd;
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{
    request_target, valid_authority, BodyFraming, Client, Reject, RequestHead, RequestRules,
};
use crate::exchange::request::{Upload, UploadBounds};
use crate::forward::{self, Request};
use crate::front::h2::body::{ActiveRequest, ConnActivity, H2Body, MAX_INLINE_BODY};
use crate::front::h2::log::{H2Scope, LoggedHead};
use crate::front::h2::{grpc_own_response, is_grpc, own_response, refused, upstream_response};
use crate::state::Shared;

mod body;

use body::{next_data, ClientBody, RecvHalf};

/// HTTP/3's code for a connection or stream closed without an error.
pub(crate) const NO_ERROR: quinn::VarInt = quinn::VarInt::from_u32(0x100);

/// The sending half of a request's stream.
type SendHalf = RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;

/// Serves an HTTP/3 connection (its QUIC handshake done) until it ends, stays idle too long,
/// or the proxy shuts down; then it sends GOAWAY and finishes the requests it accepted. The
/// timeouts are HTTP/2's: no request in flight for `header_read_timeout` before the first
/// request and `idle_timeout` after, a request's head not whole within `header_read_timeout`
/// of its stream (the stream is refused), a response that the client takes no byte of for
/// `client_idle_timeout` (the stream is cut). After GOAWAY the connection is closed as soon as
/// no request is left in flight (HTTP/3 refuses the later ones; the client sends them again).
pub(crate) async fn serve(
    shared: Arc<Shared>,
    index: usize,
    settings: Arc<ListenerConfig>,
    client: Arc<Client>,
    quic: quinn::Connection,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let peer = client.peer;
    let activity = Arc::new(ConnActivity::new());
    let first = settings.header_read_timeout.min(settings.idle_timeout);
    let idle = activity.idle_for(first, settings.idle_timeout, Instant::now());
    let shutdown = crate::state::wait_shutdown(&mut stop);
    tokio::pin!(idle, shutdown);
    let mut builder = h3::server::builder();
    builder.max_field_section_size(settings.max_header_bytes as u64);
    let built = builder.build::<_, Bytes>(h3_quinn::Connection::new(quic.clone()));
    let mut conn = tokio::select! {
        biased;
        c = built => match c {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%peer, "HTTP/3 client connection: {e}");
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
                Ok(Some(resolver)) => spawn_stream(&shared, index, &settings, &client, &activity, resolver),
                Ok(None) => return,
                Err(e) => {
                    if !e.is_h3_no_error() {
                        tracing::debug!(%peer, "HTTP/3 client connection: {e}");
                    }
                    return;
                }
            },
            _ = &mut shutdown => break,
            _ = &mut idle => {
                tracing::debug!(%peer, "closing an idle HTTP/3 connection (idle_timeout, or header_read_timeout before its first request)");
                break;
            }
        }
    }
    // GOAWAY: the requests accepted so far are served, later ones refused (the client may
    // send them again elsewhere). Once none is left in flight the connection is closed,
    // after a linger of a few round trips: the last response's final packets may still be on
    // their way, and a close discards what the client has not acknowledged.
    let grace = settings.header_read_timeout;
    let goaway = conn.shutdown(0);
    if !matches!(tokio::time::timeout(grace, goaway).await, Ok(Ok(()))) {
        quic.close(NO_ERROR, b"");
        return;
    }
    let linger = (quic.rtt() * 4).clamp(Duration::from_millis(100), grace);
    let quiet = activity.idle_for(linger, linger, Instant::now());
    tokio::pin!(quiet);
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Ok(Some(resolver)) => spawn_stream(&shared, index, &settings, &client, &activity, resolver),
                _ => break,
            },
            _ = &mut quiet => break,
        }
    }
    quic.close(NO_ERROR, b"");
}

type Resolver = h3::server::RequestResolver<h3_quinn::Connection, Bytes>;

/// One request stream, in a task of its own: its head read (within `header_read_timeout`),
/// the request handled, its response sent.
fn spawn_stream(
    shared: &Arc<Shared>,
    index: usize,
    settings: &Arc<ListenerConfig>,
    client: &Arc<Client>,
    activity: &Arc<ConnActivity>,
    resolver: Resolver,
) {
    let active = ActiveRequest::new(activity);
    let (shared, settings, client) = (shared.clone(), settings.clone(), client.clone());
    // Boxed: tokio copies a task's future when it spawns it, and this one is large.
    tokio::spawn(Box::pin(async move {
        let resolved =
            tokio::time::timeout(settings.header_read_timeout, resolver.resolve_request()).await;
        let (req, stream) = match resolved {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::debug!(peer = %client.peer, "HTTP/3 request refused: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = %client.peer, "HTTP/3 request head not whole within header_read_timeout");
                return;
            }
        };
        let (mut send, recv) = stream.split();
        let response = handle(&shared, index, &settings, &client, req, recv, active).await;
        respond(response, &mut send, settings.client_idle_timeout).await;
    }));
}

/// One request: rewritten, forwarded by the attempt driver, answered (as the HTTP/2 front
/// end's `handle`, from an HTTP/3 stream).
async fn handle(
    shared: &Shared,
    index: usize,
    settings: &ListenerConfig,
    client: &Arc<Client>,
    req: hyper::Request<()>,
    mut recv: RecvHalf,
    active: ActiveRequest,
) -> Response<H2Body> {
    let started = Instant::now();
    let mut scope = H2Scope {
        log: shared.access_log.load_full(),
        client: client.clone(),
        started,
        route: None,
        request: LoggedHead::None,
        protocol: "HTTP/3.0",
        metrics: None,
        received: 0,
    };
    let (mut parts, ()) = req.into_parts();
    // The method, the target and the authority, checked as for HTTP/2 (no CONNECT).
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
    // Whether a body follows: HTTP/3 says so only by the stream's end, which usually comes
    // with the head. What is already there is read now; a stream still open has a body to
    // stream (of unknown length unless `content-length` says).
    let peeked = std::future::poll_fn(|cx| std::task::Poll::Ready(recv.poll_recv_data(cx))).await;
    let (first, ended) = match peeked {
        std::task::Poll::Ready(Ok(Some(mut buf))) => {
            (Some(buf.copy_to_bytes(buf.remaining())), false)
        }
        std::task::Poll::Ready(Ok(None)) => (None, true),
        std::task::Poll::Ready(Err(_)) => {
            let scope = scope.with_request(|| LoggedHead::Map(Box::new(parts)));
            return refused(Reject::InvalidBody, active, scope, None, false);
        }
        std::task::Poll::Pending => (None, false),
    };
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
    let http1 = cluster.config.protocol == UpstreamProtocol::Http1;
    let mut text = Vec::new();
    let unframed = !ended;
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
        // An HTTP/1.1 endpoint's answer is read into a header map, as for HTTP/2 clients.
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
    let answer = match meta.body {
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
        BodyFraming::Length(n) if n <= MAX_INLINE_BODY => {
            // Read whole first (any try can send it again); of another length than
            // announced, it is malformed.
            let read = tokio::time::timeout(
                settings.client_idle_timeout,
                read_whole(&mut recv, first, n),
            )
            .await;
            let data = match read {
                Ok(Ok(data)) => data,
                Ok(Err(reject)) => Err(reject),
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
        _ => {
            let bounds = UploadBounds::of(settings, cluster.config.timeouts.max_duration, start);
            let upload = Upload::new(bounds, start).with_progress(&progress, start);
            let mut streamed = ClientBody::new(recv, first, max_body, upload);
            let request = Request {
                body_progress: Some(&progress),
                ..request
            };
            let cluster = &target.cluster;
            forward::forward(
                cluster,
                client,
                request,
                &mut streamed,
                &mut out,
                &mut timer,
            )
            .await
        }
    };
    let scope = scope.with_request(|| LoggedHead::of(http1, text, parts));
    let up = match answer {
        Answer::Own(own) if grpc => return grpc_own_response(own, active, scope, Some(cluster)),
        Answer::Own(own) => return own_response(own, active, scope, Some(cluster)),
        Answer::Upstream(up) => up,
    };
    let Upstream { mut response, tail } = up;
    // An HTTP/2 endpoint that answered before the body ended gets the rest only from an
    // HTTP/2 client (full duplex); an HTTP/3 client's body is sent whole first.
    let _ = response.rest_of_request();
    match response.into_parts(&out) {
        Ok((head, body)) => upstream_response(head, body, tail, None, active, scope),
        Err(_) => {
            let cluster = tail.cluster.clone();
            tail.end(BodyEnd::UpstreamFailed, None);
            let own = answer::unforwardable("the endpoint's response head could not be forwarded");
            own_response(own, active, scope, Some(&cluster))
        }
    }
}

/// A body of `n` bytes, read whole (`first`: what was read of it already).
async fn read_whole(
    recv: &mut RecvHalf,
    first: Option<Bytes>,
    n: u64,
) -> Result<Result<Bytes, Reject>, Reject> {
    let mut data = BytesMut::with_capacity(n as usize);
    if let Some(first) = first {
        data.extend_from_slice(&first);
    }
    while let Some(piece) = next_data(recv).await? {
        data.extend_from_slice(&piece);
        if data.len() as u64 > n {
            return Ok(Err(Reject::InvalidBody));
        }
    }
    Ok(Some(data.freeze())
        .filter(|d| d.len() as u64 == n)
        .ok_or(Reject::InvalidBody))
}

/// Sends a response: its head (with `date` when it has none, and `content-length` when its
/// body's length is known), then its body frame by frame, each sent once the stream's flow
/// control takes the one before; a frame the client takes nothing of for `client_idle` cuts
/// the stream, and with it the body, its endpoint connection and its pick. quinn holds at
/// most the stream's window of unsent data, so a client that stops reading costs a bounded
/// amount of memory until then.
async fn respond(response: Response<H2Body>, send: &mut SendHalf, client_idle: Duration) {
    let (mut head, mut body) = response.into_parts();
    head.headers
        .entry(DATE)
        .or_insert_with(crate::codec::date_value);
    let end = body.is_end_stream();
    if !end {
        if let Some(n) = body.size_hint().exact() {
            head.headers
                .entry(CONTENT_LENGTH)
                .or_insert_with(|| HeaderValue::from(n));
        }
    }
    let cut = |send: &mut SendHalf, code: Code| send.stop_stream(code);
    let head = Response::from_parts(head, ());
    match tokio::time::timeout(client_idle, send.send_response(head)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!("HTTP/3 response head not sent: {e}");
            return;
        }
        Err(_) => return cut(send, Code::H3_REQUEST_CANCELLED),
    }
    if !end {
        loop {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(e)) => {
                    tracing::debug!("HTTP/3 response body cut: {e}");
                    return cut(send, Code::H3_INTERNAL_ERROR);
                }
            };
            match frame.into_data() {
                Ok(data) if data.is_empty() => {}
                Ok(data) => match tokio::time::timeout(client_idle, send.send_data(data)).await {
                    Ok(Ok(())) => {}
                    // The client reset or stopped the stream: the body is dropped, which ends
                    // it as the client's going.
                    Ok(Err(_)) => return,
                    Err(_) => {
                        tracing::info!("cutting an HTTP/3 response whose client took no data for {} (client_idle_timeout)", humantime::format_duration(client_idle));
                        return cut(send, Code::H3_REQUEST_CANCELLED);
                    }
                },
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let sent = tokio::time::timeout(client_idle, send.send_trailers(trailers));
                        if !matches!(sent.await, Ok(Ok(()))) {
                            return cut(send, Code::H3_REQUEST_CANCELLED);
                        }
                    }
                    break;
                }
            }
        }
    }
    drop(body);
    let _ = tokio::time::timeout(client_idle, send.finish()).await;
}
