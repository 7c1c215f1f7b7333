//! One request on an HTTP/2 or HTTP/3 stream, handled once for both front ends: its head
//! checked and rewritten by the HTTP/1.1 front end's rules (`crate::exchange::rewrite`), in
//! the form its endpoint's leg sends, its body read whole or streamed by its framing, handed
//! to `forward::forward`, and answered with `front::h2`'s responses. A front end gives only
//! its stream ([`ClientStream`]: how the body's pieces come, what is known of the body at the
//! head, what follows an early answer) and sends the response its own way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use hyper::Response;

use crate::config::{ListenerConfig, UpstreamProtocol};
use crate::driver::answer::{self, Answer, Upstream};
use crate::exchange::error::BodyEnd;
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{
    request_target, valid_authority, BodyFraming, Client, Reject, RequestBody, RequestHead,
    RequestRules, Upload, UploadBounds,
};
use crate::forward::{self, Request};
use crate::front::h2::answer::{is_grpc, own_response, refused, upstream_response};
use crate::front::h2::body::{ActiveRequest, H2Body, MAX_INLINE_BODY};
use crate::front::h2::log::{H2Scope, LoggedHead};
use crate::leg::h2::RequestPump;
use crate::state::Shared;

/// What differs between an HTTP/2 and an HTTP/3 request stream, as the shared handling reads
/// it. Static dispatch: `handle` and [`ClientBody`] are made once per front end.
pub(crate) trait ClientStream: Sized {
    /// As the access log names the protocol.
    const PROTOCOL: &'static str;
    /// The client may wait for the response before it ends its body (HTTP/2: the rest goes
    /// to an HTTP/2 endpoint alongside the response, see [`Self::pump`]).
    const FULL_DUPLEX: bool;
    /// Whether the body has already ended at the head (no body), and a first piece of it
    /// read to learn that; an error is the client's fault. With `wait`, a stream that cannot
    /// tell yet is waited on for up to that long (then `Reject::Timeout`).
    async fn start(&mut self, wait: Option<Duration>) -> Result<(bool, Option<Bytes>), Reject>;
    /// The next DATA (`None` at the body's end; empty for a frame without data, such as
    /// trailers kept for [`Self::trailers`]); an error is the client's fault.
    async fn next_data(&mut self) -> Result<Option<Bytes>, Reject>;
    /// The trailers, once [`Self::next_data`] returned the end.
    async fn trailers(&mut self) -> Option<hyper::HeaderMap>;
    /// Sends the rest of the body to an HTTP/2 endpoint that answered before it ended
    /// (`pending` first), as the response is relayed; `None`: the rest is dropped.
    fn pump(self, send: ::h2::SendStream<Bytes>, pending: Option<Bytes>) -> Option<RequestPump>;
}

/// One request: checked, rewritten, forwarded by the attempt driver, answered.
pub(crate) async fn handle<S: ClientStream>(
    shared: &Shared,
    index: usize,
    settings: &ListenerConfig,
    client: &Arc<Client>,
    mut parts: hyper::http::request::Parts,
    mut stream: S,
    active: ActiveRequest,
) -> Response<H2Body> {
    let started = Instant::now();
    let mut scope = H2Scope {
        log: shared.access_log.load_full(),
        client: client.clone(),
        started,
        route: None,
        request: LoggedHead::None,
        protocol: S::PROTOCOL,
        metrics: None,
        received: 0,
    };
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
        return own_response(answer::not_found(), active, scope, None, false);
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
    // (written straight from the client's map: cheaper than editing the map, then writing it
    // out), the map itself, edited in place, for an HTTP/2 one.
    let http1 = cluster.config.protocol == UpstreamProtocol::Http1;
    // Whether a body follows (HTTP/3 learns it only by reading: see its `start`). An
    // HTTP/1.1 head must say before it is sent, so without a `content-length` the stream is
    // waited on for its end or its first data.
    let sized = parts.headers.contains_key(hyper::header::CONTENT_LENGTH);
    let wait = (http1 && !sized).then_some(settings.client_idle_timeout);
    let (ended, first) = match stream.start(wait).await {
        Ok(started) => started,
        Err(reject) => {
            let scope = scope.with_request(|| LoggedHead::Map(Box::new(parts)));
            return refused(reject, active, scope, Some(cluster), false);
        }
    };
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
        // An HTTP/1.1 endpoint's answer is read into a header map, which the front end sends.
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
    // Where an HTTP/1.1 leg writes a response head as text: never, for these clients (the
    // head is read into a map), so not allocated.
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
            // Read whole first (any try can send it again).
            let read = tokio::time::timeout(
                settings.client_idle_timeout,
                read_whole(&mut stream, first, n),
            )
            .await;
            let data = match read.unwrap_or(Err(Reject::Timeout)) {
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
            let body = ClientBody::new(stream, first, max_body, upload);
            let streamed = streamed.insert(body);
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
        Answer::Own(own) => return own_response(own, active, scope, Some(cluster), grpc),
        Answer::Upstream(up) => up,
    };
    let Upstream { mut response, tail } = up;
    // An HTTP/2 endpoint that answered before the body ended gets the rest from the stream,
    // if its front end is full duplex.
    let pump = match (response.rest_of_request(), streamed) {
        (Some((send, pending)), Some(mut body)) => {
            let pending = pending.or_else(|| body.take_unsent());
            body.source.pump(send, pending)
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
            own_response(own, active, scope, Some(&cluster), false)
        }
    }
}

/// A body of `n` bytes, read whole (`first`: what was read of it already); of another length
/// than announced, it is malformed. A body in one piece (the usual) is kept as it came;
/// pieces are joined only when there are several.
async fn read_whole<S: ClientStream>(
    stream: &mut S,
    first: Option<Bytes>,
    n: u64,
) -> Result<Bytes, Reject> {
    let mut one = first.unwrap_or_default();
    let mut joined = BytesMut::new();
    while let Some(piece) = stream.next_data().await? {
        if piece.is_empty() {
            continue;
        }
        if (one.len() + joined.len() + piece.len()) as u64 > n {
            return Err(Reject::InvalidBody);
        }
        if one.is_empty() && joined.is_empty() {
            one = piece;
            continue;
        }
        if joined.is_empty() {
            joined.reserve(n as usize);
            joined.extend_from_slice(&std::mem::take(&mut one));
        }
        joined.extend_from_slice(&piece);
    }
    let data = if joined.is_empty() {
        one
    } else {
        joined.freeze()
    };
    Some(data)
        .filter(|d| d.len() as u64 == n)
        .ok_or(Reject::InvalidBody)
}

/// A client's request body, streamed as the leg asks for it, each piece awaited within the
/// body's bounds (`Upload`, shared with the HTTP/1.1 front end: the time waiting on the
/// client stops the try's clock). Its first `MAX_INLINE_BODY` bytes are kept, so that a try
/// that failed before the endpoint acted (a gRPC UNAVAILABLE) can send them again to another
/// endpoint.
pub(crate) struct ClientBody<'p, S> {
    source: S,
    /// A piece read before the body was handed to the leg (HTTP/3: to learn there was one).
    first: Option<Bytes>,
    piece: Bytes,
    started: bool,
    /// The reads' bounds, and the driver's try clock they report to.
    upload: Upload<'p>,
    /// The reads' timer, made at the first read.
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
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

impl<'p, S: ClientStream> ClientBody<'p, S> {
    fn new(source: S, first: Option<Bytes>, max: u64, upload: Upload<'p>) -> Self {
        Self {
            source,
            first,
            piece: Bytes::new(),
            started: false,
            upload,
            timer: None,
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

    /// Counts and keeps a piece, and hands it out.
    fn take(&mut self, data: Bytes) -> Result<&[u8], Reject> {
        self.upload.received(data.len() as u64);
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
        Ok(&self.piece)
    }
}

impl<S: ClientStream> RequestBody for ClientBody<'_, S> {
    fn started(&self) -> bool {
        self.started
    }

    fn waiting_on_client(&self) -> bool {
        self.upload.reading()
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
        S::FULL_DUPLEX
    }

    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        self.started = true;
        if std::mem::take(&mut self.replay) && !self.recorded.is_empty() {
            return Ok(&self.recorded);
        }
        if let Some(first) = self.first.take() {
            return self.take(first);
        }
        if self.ended {
            return Ok(&[]);
        }
        loop {
            let timer = self.timer.get_or_insert_with(crate::io::idle_timer);
            match self.upload.read(timer, self.source.next_data()).await? {
                Err(reject) => return Err(reject),
                Ok(None) => {
                    self.ended = true;
                    // Trailers go to HTTP/2 endpoints (HTTP/1.1 ones get none).
                    self.trailers = self.source.trailers().await;
                    return Ok(&[]);
                }
                Ok(Some(data)) if data.is_empty() => continue,
                Ok(Some(data)) => return self.take(data),
            }
        }
    }
}
