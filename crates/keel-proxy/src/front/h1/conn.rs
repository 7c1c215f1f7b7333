//! The HTTP/1.1 front end: a client connection (plain TCP or TLS) served request by request.
//! Each request head is parsed and rewritten ([`crate::exchange::rewrite`]), its body read
//! whole when small (so that any try can send it again) or streamed, the request handed to the attempt
//! driver, and the driver's answer sent back: keel's own, or the endpoint's response relayed
//! as it arrives (an HTTP/2 endpoint's rendered as HTTP/1.1), or after a `101` to an upgrade
//! request, a tunnel until either side closes.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;

use crate::codec::body::{BodyDecoder, BodyError, Framing};
use crate::codec::response::{push_framing, push_status_line};
use crate::codec::{push_content_length, push_date, push_header};
use crate::config::ListenerConfig;
use crate::driver::answer::{self, OwnAnswer, Upstream};
use crate::driver::tries::Tries;
use crate::exchange::error::BodyEnd;
use crate::exchange::head::{HeadView, UpstreamHead};
use crate::exchange::request::{BodyFraming, Client, Reject, RequestHead, RequestRules};
use crate::exchange::request::{Upload, UploadBounds};
use crate::forward::{self, Request};
use crate::front::h1::parse::{parse_request, RequestParse};
use crate::front::h1::relay::{relay_frames, relay_response, ClientBody, RelayError};
use crate::io::BodyIdle;
use crate::io::{idle_timer, until, write_all_2};
use crate::leg::{HttpAnswer, UpstreamResponse};
use crate::observe::access_log::AccessLog;
use crate::observe::record::Record;
use crate::route::{RouteRef, Target};
use crate::state::Shared;
use crate::upstream::cluster::Cluster;

/// Request bodies up to this size are read whole before the request is forwarded, so that
/// any try can send them again; larger ones, and chunked ones, are streamed.
const MAX_INLINE_BODY: u64 = 64 * 1024;

/// How a client connection's service ended.
pub(crate) enum Served<S> {
    /// Closed (by either side, by a timeout, or by shutdown).
    Closed,
    /// The client sent HTTP/2's preface: the HTTP/2 front end takes the connection, with the
    /// bytes read so far.
    Http2(S, BytesMut),
}

/// A client connection and its reusable buffers and timers.
struct Conn<S> {
    stream: Counted<S>,
    /// Bytes read from the client not yet consumed: the current request first.
    rbuf: BytesMut,
    /// The request head for the upstream, in its leg's form (as text: its common part, then
    /// the per-try end).
    up_head: UpstreamHead,
    /// The response head for the client.
    out: Vec<u8>,
    /// Deadlines of reads from the client. (One timer per kind of deadline: each moves only
    /// later, which costs no timer-wheel work.)
    client_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Per-try deadlines.
    try_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Whole-request deadlines, while a response body streams.
    request_timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// keel closes before reading the request to its end: the client may still be sending.
    unread: bool,
    /// An upgraded connection idle this long is closed (`tunnel_idle_timeout`).
    tunnel_idle: Duration,
    /// A client that takes no byte of its response for this long is cut.
    client_idle: Duration,
    /// Why the last forwarded response was cut short, if it was (for the access log).
    cut: Option<&'static str>,
    /// The status keel answered in place of the endpoint's, if it did (for the access log).
    replaced: Option<u16>,
    /// A small chunked request body, decoded (reused from request to request).
    body: Vec<u8>,
}

/// How long, and how many bytes, a closing connection keeps reading what the client still
/// sends. Closing a socket with unread bytes makes the kernel send a reset, which may destroy
/// the answer before the client reads it (NGINX's lingering close does the same).
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1 << 20;

/// Once the proxy drains, an idle keep-alive connection is closed after this much quiet, not at
/// once: a client under load sends its next request microseconds after reading an answer, and
/// closing in between loses that request (the chaos run lost 4-48 that way at each upgrade;
/// HAProxy's `idle-close-on-response` closes the same gap). A request that arrives within it is
/// answered with `Connection: close`.
const DRAIN_QUIET: Duration = Duration::from_millis(250);

/// A connection with no request byte for this long, between requests, lets go of its buffers,
/// its timers and its request state (the busy period's future), and waits with a few bytes of
/// its own ([`serve`]): as NGINX frees a keep-alive connection's buffers, but only after a
/// quiet spell, so that requests that follow closely reuse them and pay nothing.
pub(crate) const QUIET_SPELL: Duration = Duration::from_secs(1);

/// The first bytes a parked connection reads when its client speaks again; the busy period
/// that starts then takes them first and reads the rest. 32, not 64: the parked connection's
/// future ([`serve`]) is then 496 bytes, in mimalloc's 512-byte size class, not its 640.
const WAKE_BYTES: usize = 32;

/// Serves a client connection until it closes, or until HTTP/2 takes it over: busy periods
/// (a boxed future with the buffers and timers, requests served back to back), each ended by
/// a quiet spell, and between them a parked wait that holds the stream and one timer. An
/// `async` block, not an `async fn`, which would hold each argument twice (as given, and
/// moved into its body) for the connection's life.
#[allow(clippy::manual_async_fn)] // the async block is the point (see above)
pub(crate) fn serve<'a, S: AsyncRead + AsyncWrite + Unpin + 'a>(
    shared: Arc<Shared>,
    index: usize,
    settings: &'a ListenerConfig,
    client: &'a Client,
    mut stream: S,
    stop: watch::Receiver<Option<Duration>>,
) -> impl std::future::Future<Output = Served<S>> + 'a {
    async move {
        // The wait for a request's first byte: set to the quiet spell's end at each wait (only
        // ever later while requests follow, which costs no timer-wheel work), then to the rest
        // of the idle timeout while parked. Kept across busy periods.
        let mut wait_timer = idle_timer();
        let mut woke = [0u8; WAKE_BYTES];
        let mut early = 0;
        let mut waited = Instant::now();
        loop {
            let at = Serving {
                shared: &shared,
                index,
                settings,
                client,
                stop: &stop,
            };
            let busy = Box::pin(busy(at, stream, &mut wait_timer, waited, &woke[..early]));
            stream = match busy.await {
                Busy::Served(served) => return served,
                Busy::Quiet(stream, since) => {
                    waited = since;
                    stream
                }
            };
            let _parked = Parked::new(&shared, index);
            let first_byte = waited + settings.header_read_timeout.min(settings.idle_timeout);
            match park(&mut stream, &mut wait_timer, first_byte, &stop, &mut woke).await {
                Some(n) => early = n,
                None => return Served::Closed,
            }
        }
    }
}

/// What a connection is served with for its life: the proxy's state, its listener (index
/// and settings), its client, and the signal of a drain.
#[derive(Clone, Copy)]
struct Serving<'a> {
    shared: &'a Shared,
    index: usize,
    settings: &'a ListenerConfig,
    client: &'a Client,
    stop: &'a watch::Receiver<Option<Duration>>,
}

/// How a busy period ended.
enum Busy<S> {
    Served(Served<S>),
    /// No request byte within the quiet spell: the stream, to wait parked, and when its wait
    /// for a request began.
    Quiet(S, Instant),
}

/// Counts a parked connection in its listener's `keel_connections_parked` while it lives.
struct Parked(Option<Arc<crate::state::ListenerSlot>>);

impl Parked {
    fn new(shared: &Shared, index: usize) -> Self {
        let slot = shared.listening.all_listeners.load().get(index).cloned();
        if let Some(l) = &slot {
            l.parked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Parked(slot)
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        if let Some(l) = &self.0 {
            l.parked.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// Waits, parked, for the client's next bytes until `first_byte` (sooner once the proxy
/// drains: [`DRAIN_QUIET`]); returns how many were read into `woke`, or `None` once the
/// connection is closed. (An `async` block: see [`serve`].)
#[allow(clippy::manual_async_fn)] // the async block is the point (see above)
fn park<'a, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &'a mut S,
    timer: &'a mut Pin<Box<tokio::time::Sleep>>,
    first_byte: Instant,
    stop: &'a watch::Receiver<Option<Duration>>,
    woke: &'a mut [u8],
) -> impl std::future::Future<Output = Option<usize>> + 'a {
    async move {
        let mut stop_waiter = stop.clone();
        let mut draining = stop.borrow().is_some();
        let mut deadline = first_byte;
        if draining {
            deadline = deadline.min(Instant::now() + DRAIN_QUIET);
        }
        loop {
            let read = tokio::select! {
                biased;
                r = until(timer, deadline, stream.read(woke)) => r,
                _ = crate::state::wait_shutdown(&mut stop_waiter), if !draining => {
                    draining = true;
                    deadline = deadline.min(Instant::now() + DRAIN_QUIET);
                    continue;
                }
            };
            return match read {
                Some(Ok(n)) if n > 0 => Some(n),
                // Quiet through the drain's grace: closed with a lingering read, as a busy
                // period's wait is (boxed: rare, and every parked connection holds this future).
                None if draining => {
                    Box::pin(async {
                        let _ = stream.shutdown().await;
                        drop_unread(stream, timer, &mut BytesMut::new()).await;
                    })
                    .await;
                    None
                }
                _ => None,
            };
        }
    }
}

/// A busy period: requests served back to back until the connection closes, HTTP/2 takes it,
/// or no request byte comes within [`QUIET_SPELL`]. `waited`: when the wait for its first
/// request began; `early`: bytes of it read while parked.
async fn busy<S: AsyncRead + AsyncWrite + Unpin>(
    at: Serving<'_>,
    stream: S,
    wait_timer: &mut Pin<Box<tokio::time::Sleep>>,
    waited: Instant,
    early: &[u8],
) -> Busy<S> {
    let Serving {
        shared,
        index,
        settings,
        client,
        stop,
    } = at;
    // One shutdown waiter for the busy period: it registers once, instead of at every wait
    // for a request.
    let mut stop_waiter = stop.clone();
    let mut shutdown = std::pin::pin!(async move {
        crate::state::wait_shutdown(&mut stop_waiter).await;
    });
    let mut conn = Conn {
        stream: Counted {
            inner: stream,
            sent: 0,
        },
        // Held for the busy period but while an answer is awaited: 4 KB fits most heads (it
        // grows for others).
        rbuf: BytesMut::with_capacity(crate::io::spare::SIZE),
        // Made at the first request (parse_request), to its size.
        up_head: UpstreamHead {
            text: Vec::new(),
            map: None,
        },
        // Made at the first answer (codec::reserve_head): a connection whose first request
        // waits for its answer holds none.
        out: Vec::new(),
        client_timer: idle_timer(),
        try_timer: idle_timer(),
        request_timer: idle_timer(),
        unread: false,
        tunnel_idle: settings.tunnel_idle_timeout,
        client_idle: settings.client_idle_timeout,
        cut: None,
        replaced: None,
        body: Vec::new(),
    };
    conn.rbuf.extend_from_slice(early);
    let mut first_wait = Some(waited);
    let max_body = settings.max_request_body_bytes.unwrap_or(u64::MAX);
    // Set once the drain has begun while this connection waited for a request.
    let mut draining = stop.borrow().is_some();
    loop {
        // Waiting for a request: the idle timeout until its first byte, the header-read
        // timeout until its last (it runs between keep-alive requests too). Draining, a quiet
        // connection is closed sooner (DRAIN_QUIET); a request already read or on its way is
        // still answered (with `Connection: close`).
        let waited = first_wait.take().unwrap_or_else(Instant::now);
        let mut first_byte = waited + settings.header_read_timeout.min(settings.idle_timeout);
        if draining || stop.borrow().is_some() {
            draining = true;
            first_byte = first_byte.min(waited + DRAIN_QUIET);
        }
        let whole_head = waited + settings.header_read_timeout;
        // Bytes of this request already searched for the blank line that ends a head.
        let mut searched = None;
        let (target, req) = loop {
            let parsed = if conn.rbuf.is_empty() || !may_end_head(&conn.rbuf, &mut searched) {
                RequestParse::Partial
            } else {
                let routing = shared.routing.load();
                let routes = &routing.listeners[index];
                let rules = RequestRules {
                    request_id: settings.generate_request_id,
                    ..RequestRules::new(client, None, settings.max_headers, max_body)
                };
                match parse_request(&conn.rbuf, &rules, Some(routes), &mut conn.up_head) {
                    RequestParse::Ready(h) if h.head_len <= settings.max_header_bytes => {
                        break (routes.target(h.route).cloned(), h)
                    }
                    // However it arrived (one read may bring more than the limit).
                    RequestParse::Ready(_) => RequestParse::Reject(Reject::HeadTooLarge),
                    other => other,
                }
            };
            match parsed {
                RequestParse::Http2Preface => {
                    return Busy::Served(Served::Http2(conn.stream.inner, conn.rbuf))
                }
                RequestParse::Reject(r) => {
                    return Busy::Served(conn.refuse(shared, client, r).await)
                }
                RequestParse::Partial if conn.rbuf.len() >= settings.max_header_bytes => {
                    return Busy::Served(conn.refuse(shared, client, Reject::HeadTooLarge).await)
                }
                _ => {}
            }
            let idle = conn.rbuf.is_empty();
            // Waiting for a request's first byte, the quiet spell ends the busy period first
            // (not once the proxy drains: that wait closes the connection).
            let quiet = waited + QUIET_SPELL;
            let parks = idle && !draining && quiet < first_byte;
            let (timer, deadline) = match (idle, parks) {
                (true, true) => (&mut *wait_timer, quiet),
                (true, false) => (&mut *wait_timer, first_byte),
                (false, _) => (&mut conn.client_timer, whole_head),
            };
            conn.rbuf.reserve(4096);
            let read = tokio::select! {
                biased;
                r = until(timer, deadline, conn.stream.read_buf(&mut conn.rbuf)) => r,
                _ = shutdown.as_mut(), if idle && !draining => {
                    draining = true;
                    first_byte = first_byte.min(Instant::now() + DRAIN_QUIET);
                    continue;
                }
            };
            match read {
                Some(Ok(n)) if n > 0 => {}
                None if parks => return Busy::Quiet(conn.stream.inner, waited),
                // Quiet through the drain's grace: closed with a lingering read, so that a
                // request crossing the close gets an end of stream rather than a reset.
                None if draining && idle => {
                    conn.unread = true;
                    conn.close().await;
                    return Busy::Served(Served::Closed);
                }
                // Closed, failed, or too slow: nothing to answer.
                _ => return Busy::Served(Served::Closed),
            }
        };
        conn.rbuf.advance(req.head_len);
        let started = Instant::now();
        let Some(target) = target else {
            // No route and no listener cluster. The body is not read: a request with one
            // leaves the connection where only a close is safe.
            shared.count_not_found(index);
            let own = answer::not_found();
            let keep = req.keep_alive && req.body == BodyFraming::None && stop.borrow().is_none();
            conn.stream.sent = 0;
            let kept = conn.answer(&own, keep, &req).await;
            let access_log = shared.access_log.load();
            let scope = Scope {
                log: access_log.as_deref(),
                client,
                cluster: None,
                route: req.route,
                metrics: None,
                started,
            };
            conn.record_own(&scope, &req, &own);
            if !kept {
                conn.unread |= req.body != BodyFraming::None;
                conn.close().await;
                return Busy::Served(Served::Closed);
            }
            continue;
        };
        // Loaded per request: a reload may have changed the log.
        let access_log = shared.access_log.load();
        let scope = Scope {
            log: access_log.as_deref(),
            client,
            cluster: Some(&target.cluster),
            route: req.route,
            metrics: Some(&target.route.metrics),
            started,
        };
        let keep = match req.body {
            BodyFraming::Length(n) if n > MAX_INLINE_BODY => {
                conn.streamed(&target, client, settings, &req, max_body, stop, &scope)
                    .await
            }
            BodyFraming::Chunked => {
                let bounds = UploadBounds::of(
                    settings,
                    target.cluster.config.timeouts.max_duration,
                    started,
                );
                match conn
                    .read_small_chunked(bounds, started, max_body, req.expect_continue)
                    .await
                {
                    SmallChunked::Whole(raw) => {
                        // Sent with a length: checked whole, and retryable as any small body.
                        let mut whole = req.clone();
                        whole.body = BodyFraming::Length(conn.body.len() as u64);
                        whole.expect_continue = false;
                        conn.up_head.reframe_as_length(conn.body.len() as u64);
                        let answer = forward::forward(
                            &target.cluster,
                            client,
                            Request {
                                head: conn.up_head.headers(),
                                meta: &whole,
                                start: Instant::now(),
                                limits: target.limits,
                                policy: target.policy.as_deref(),
                                body_progress: None,
                                route: &target.route,
                            },
                            &mut &conn.body[..],
                            &mut conn.out,
                            &mut conn.try_timer,
                        )
                        .await;
                        conn.rbuf.advance(raw);
                        conn.send(answer, &whole, true, stop, &scope).await
                    }
                    SmallChunked::Large { continued } => {
                        let mut req = req.clone();
                        req.expect_continue &= !continued;
                        conn.streamed(&target, client, settings, &req, max_body, stop, &scope)
                            .await
                    }
                    SmallChunked::Refused(reject) => {
                        let own = HttpAnswer::Own(answer::refused(reject));
                        conn.send(own, &req, false, stop, &scope).await
                    }
                    SmallChunked::Closed => return Busy::Served(Served::Closed),
                }
            }
            framing => {
                let n = match framing {
                    BodyFraming::Length(n) => n as usize,
                    _ => 0,
                };
                if conn.rbuf.len() < n && req.expect_continue {
                    let sent =
                        write_all_2(&mut conn.stream, b"HTTP/1.1 100 Continue\r\n\r\n", &[]).await;
                    if sent.is_err() {
                        return Busy::Served(Served::Closed);
                    }
                }
                // Read whole, within the body's bounds.
                let bounds = UploadBounds::of(
                    settings,
                    target.cluster.config.timeouts.max_duration,
                    started,
                );
                while conn.rbuf.len() < n {
                    conn.rbuf.reserve(n - conn.rbuf.len());
                    let received = conn.rbuf.len() as u64;
                    let (deadline, _) = bounds.next_read(started, received, Instant::now());
                    let read = until(
                        &mut conn.client_timer,
                        deadline,
                        conn.stream.read_buf(&mut conn.rbuf),
                    )
                    .await;
                    if !matches!(read, Some(Ok(n)) if n > 0) {
                        return Busy::Served(Served::Closed);
                    }
                }
                // Nothing in the read buffer (no body, no next request): lent while the
                // answer is awaited, which may take long.
                crate::io::spare::lend(&mut conn.rbuf);
                let answer = forward::forward(
                    &target.cluster,
                    client,
                    Request {
                        head: conn.up_head.headers(),
                        meta: &req,
                        start: Instant::now(),
                        limits: target.limits,
                        policy: target.policy.as_deref(),
                        body_progress: None,
                        route: &target.route,
                    },
                    &mut &conn.rbuf[..n],
                    &mut conn.out,
                    &mut conn.try_timer,
                )
                .await;
                crate::io::spare::take(&mut conn.rbuf);
                conn.rbuf.advance(n);
                conn.send(answer, &req, true, stop, &scope).await
            }
        };
        if !keep {
            conn.close().await;
            return Busy::Served(Served::Closed);
        }
    }
}

/// True if the head in `buf` may be complete: on the first look (so that a request line that
/// is not HTTP gets its 400 at once), then only once a blank line may have arrived. Parsing
/// restarts from the head's first byte, so without this a client sending its head a byte at
/// a time would cost time quadratic in its length.
fn may_end_head(buf: &[u8], searched: &mut Option<usize>) -> bool {
    let Some(from) = *searched else {
        *searched = Some(buf.len());
        return true;
    };
    // A blank line is `\n\n` or `\n\r\n`; it may straddle the last search's end.
    let new = &buf[from.saturating_sub(2)..];
    *searched = Some(buf.len());
    new.windows(2).any(|w| w == b"\n\n") || new.windows(3).any(|w| w == b"\n\r\n")
}

/// What [`Conn::read_small_chunked`] found.
enum SmallChunked {
    /// The body ended within [`MAX_INLINE_BODY`] bytes: decoded in `Conn::body`, its encoded
    /// form the first this many bytes of the read buffer.
    Whole(usize),
    /// Longer: streamed instead, from the read buffer's start (`continued`: `100 Continue`
    /// was sent).
    Large { continued: bool },
    /// Malformed, too large, or stalled: refused before any byte went upstream.
    Refused(Reject),
    /// The client closed.
    Closed,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// Reads a chunked request body that ends within [`MAX_INLINE_BODY`] bytes whole and
    /// decodes it into `self.body`, so that a malformed one is refused without touching an
    /// endpoint (as NGINX, which reads bodies before it forwards them). Nothing is consumed
    /// from the read buffer: a longer body streams from its start.
    async fn read_small_chunked(
        &mut self,
        bounds: UploadBounds,
        began: Instant,
        max_body: u64,
        expect_continue: bool,
    ) -> SmallChunked {
        let mut decoder = BodyDecoder::new(Framing::Chunked, max_body);
        let mut pos = 0;
        let mut continued = false;
        self.body.clear();
        loop {
            while pos < self.rbuf.len() {
                let step = match decoder.step(&self.rbuf[pos..]) {
                    Ok(step) => step,
                    Err(BodyError::TooLarge(_)) => {
                        return SmallChunked::Refused(Reject::BodyTooLarge)
                    }
                    Err(_) => return SmallChunked::Refused(Reject::InvalidBody),
                };
                let data = pos + step.framing;
                self.body
                    .extend_from_slice(&self.rbuf[data..data + step.data]);
                pos = data + step.data;
                if step.done {
                    return SmallChunked::Whole(pos);
                }
                if pos as u64 > MAX_INLINE_BODY {
                    return SmallChunked::Large { continued };
                }
            }
            if expect_continue && !continued {
                continued = true;
                let sent = write_all_2(&mut self.stream, b"HTTP/1.1 100 Continue\r\n\r\n", &[]);
                if sent.await.is_err() {
                    return SmallChunked::Closed;
                }
            }
            self.rbuf.reserve(16 * 1024);
            let (deadline, cut) = bounds.next_read(began, self.rbuf.len() as u64, Instant::now());
            let read = until(
                &mut self.client_timer,
                deadline,
                self.stream.read_buf(&mut self.rbuf),
            )
            .await;
            match read {
                Some(Ok(n)) if n > 0 => {}
                None => return SmallChunked::Refused(cut),
                _ => return SmallChunked::Closed,
            }
        }
    }

    /// Forwards a request whose body is streamed from the client as the leg sends it; the
    /// connection stays open only if the body was read to its end.
    #[allow(clippy::too_many_arguments)]
    async fn streamed(
        &mut self,
        target: &Target,
        client: &Client,
        settings: &ListenerConfig,
        req: &RequestHead,
        max_body: u64,
        stop: &watch::Receiver<Option<Duration>>,
        scope: &Scope<'_>,
    ) -> bool {
        let start = Instant::now();
        let progress = crate::io::BodyProgress::default();
        // The body's reads within its bounds (a slow or stalled upload is the client's 408,
        // whose cause names the bound); the try's clock stands still meanwhile (see
        // BodyProgress).
        let bounds = UploadBounds::of(settings, target.cluster.config.timeouts.max_duration, start);
        let upload = Upload::new(bounds, start).with_progress(&progress, start);
        let mut body = ClientBody::new(
            &mut self.stream,
            &mut self.rbuf,
            &mut self.client_timer,
            upload,
            req.body,
            max_body,
            req.expect_continue,
        );
        let answer = forward::forward(
            &target.cluster,
            client,
            Request {
                head: self.up_head.headers(),
                meta: req,
                start,
                limits: target.limits,
                policy: target.policy.as_deref(),
                body_progress: Some(&progress),
                route: &target.route,
            },
            &mut body,
            &mut self.out,
            &mut self.try_timer,
        )
        .await;
        let finished = body.finished();
        self.send(answer, req, finished, stop, scope).await
    }

    /// Sends the driver's answer; returns whether the connection stays open. `reusable`:
    /// the request was read to its end.
    ///
    /// Not an `async fn`: that would keep the answer (704 bytes) twice in the connection's
    /// future, as its argument and as the body's copy of it, and a third time while it is
    /// relayed. The block below captures it once and moves it into the relay.
    #[allow(clippy::manual_async_fn)]
    fn send<'a>(
        &'a mut self,
        answer: HttpAnswer,
        req: &'a RequestHead,
        reusable: bool,
        stop: &'a watch::Receiver<Option<Duration>>,
        scope: &'a Scope<'a>,
    ) -> impl std::future::Future<Output = bool> + 'a {
        async move {
            let keep = req.keep_alive && reusable && stop.borrow().is_none();
            self.unread |= !reusable;
            self.stream.sent = 0;
            // The answer moves into the relay in a scope of its own: no binding of it lives
            // across the relay's await (one would keep its room in the future meanwhile).
            let (status, attempts, endpoint, tries, served);
            let forwarding;
            {
                let up = match answer {
                    HttpAnswer::Own(own) => {
                        // A refused body leaves the connection in an unknown state.
                        let refused = own.status == 400 || own.status == 413 || own.status == 408;
                        self.unread |= refused;
                        let keep = keep && !refused;
                        let kept = self.answer(&own, keep, req).await;
                        self.record_own(scope, req, &own);
                        return kept;
                    }
                    HttpAnswer::Upstream(up) => up,
                };
                (status, attempts) = (up.response.status(), up.tail.attempts);
                endpoint = up.tail.endpoint;
                // A `models` route's answer may come from another cluster than the route's
                // first (held only then: the common case touches no reference count).
                served = scope
                    .cluster
                    .is_some_and(|c| !std::ptr::eq(c, &*up.tail.cluster))
                    .then(|| up.tail.cluster.clone());
                // Copied only for the access log, or a sampled trace's spans.
                tries =
                    (scope.log.is_some() || up.tail.tries.sampled()).then(|| up.tail.tries.clone());
                forwarding = self.forward(up, keep, req);
            }
            let kept = forwarding.await;
            let served_scope;
            let scope = match &served {
                Some(c) => {
                    served_scope = Scope {
                        cluster: Some(c),
                        ..*scope
                    };
                    &served_scope
                }
                None => scope,
            };
            let answered = Answered {
                status: self.replaced.unwrap_or(status),
                endpoint: scope
                    .cluster
                    .and_then(|c| c.endpoints.get(endpoint))
                    .map(|e| e.header.as_bytes()),
                attempts,
                cause: self.cut,
                own: self.replaced.is_some(),
                tries: tries.as_ref(),
            };
            self.record(scope, req, &answered);
            kept
        }
    }

    /// Records keel's own answer.
    fn record_own(&self, scope: &Scope<'_>, req: &RequestHead, own: &OwnAnswer) {
        let answered = Answered {
            status: own.status,
            endpoint: own.endpoint.as_ref().map(|e| e.as_bytes()),
            attempts: own.attempts,
            cause: Some(&own.cause),
            own: true,
            tries: Some(&own.tries),
        };
        self.record(scope, req, &answered);
    }

    /// Records the request just answered (its head is in `up_head`, the answer's in `out`).
    fn record(&self, scope: &Scope<'_>, req: &RequestHead, a: &Answered<'_>) {
        let sent = self.stream.sent;
        Record {
            client: scope.client,
            cluster: scope.cluster,
            route: scope.route.index(),
            protocol: if req.http10 { "HTTP/1.0" } else { "HTTP/1.1" },
            started: scope.started,
            request: self.up_head.view(),
            status: a.status,
            endpoint: a.endpoint,
            attempts: a.attempts,
            tries: a.tries,
            cause: a.cause,
            own: a.own,
            bytes_sent: sent,
            body_bytes_sent: sent.saturating_sub(self.out.len() as u64),
            route_metrics: scope.metrics,
            bytes_received: req.head_len as u64
                + match req.body {
                    BodyFraming::Length(n) => n,
                    _ => 0,
                },
        }
        .write(scope.log);
    }

    /// Forwards an endpoint's response (its head is in `self.out`) and its body, then ends
    /// its tail with the body's outcome. Returns whether the client connection stays. Not an
    /// `async fn`, for the reason [`Self::send`] gives.
    #[allow(clippy::manual_async_fn)]
    fn forward<'a>(
        &'a mut self,
        up: Upstream<UpstreamResponse>,
        keep_alive: bool,
        req: &'a RequestHead,
    ) -> impl std::future::Future<Output = bool> + 'a {
        async move {
            // The answer's fields are used where they are, not moved into locals of their own:
            // those would hold it twice in the connection's future while it is relayed.
            self.cut = None;
            self.replaced = None;
            let (mut conn, head) = match up.response {
                // An HTTP/1.1 endpoint's response to an HTTP/1.1 client: relayed as it is.
                UpstreamResponse::H1(conn, head) => (conn, head),
                other => {
                    let Ok((parts, mut body)) = other.into_parts(&self.out) else {
                        up.tail.end(BodyEnd::UpstreamFailed, None);
                        return false;
                    };
                    let endpoint = up.tail.shown_endpoint().cloned();
                    let idle = BodyIdle {
                        upstream: up.tail.upstream_idle,
                        client: self.client_idle,
                    };
                    let relayed = relay_frames(
                        &mut self.stream,
                        &mut self.out,
                        &parts,
                        &mut body,
                        endpoint.as_ref(),
                        req,
                        keep_alive,
                        idle,
                    );
                    let relayed = match up.tail.max_end {
                        Some(end) => until(&mut self.request_timer, end, relayed).await,
                        None => Some(relayed.await),
                    };
                    self.cut = match relayed {
                        None => Some("max_duration"),
                        Some((BodyEnd::Done | BodyEnd::Grpc(_), _)) => None,
                        Some((BodyEnd::Timeout, _)) => Some("upstream idle"),
                        Some((BodyEnd::ClientGone, _)) => Some("client gone or idle"),
                        Some(_) => Some("upstream failed"),
                    };
                    let (end, keep) = relayed.unwrap_or((BodyEnd::ClientGone, false));
                    up.tail.end(end, body.reusable());
                    return keep && matches!(end, BodyEnd::Done | BodyEnd::Grpc(_));
                }
            };
            if head.status == 101 {
                // The endpoint switched protocols: the connection is a tunnel from here on.
                self.out.extend_from_slice(b"connection: upgrade\r\n");
                if let Some(e) = up.tail.shown_endpoint() {
                    push_header(&mut self.out, b"x-keel-endpoint", e.as_bytes());
                }
                self.out.extend_from_slice(b"\r\n");
                if write_all_2(&mut self.stream, &self.out, &[]).await.is_err() {
                    up.tail.end(BodyEnd::ClientGone, None);
                    return false;
                }
                let _open = crate::leg::tunnel::TunnelGauge::new(up.tail.metrics());
                let early = std::mem::take(&mut conn.buf);
                let end = crate::leg::tunnel::run(
                    &mut self.stream,
                    &mut conn.io,
                    &self.rbuf,
                    &early,
                    self.tunnel_idle,
                )
                .await;
                up.tail.end(end.outcome(), None);
                return false;
            }
            // An HTTP/1.0 client cannot take chunks: such a body ends with the connection.
            let streamed = matches!(head.framing, Framing::Chunked | Framing::Close);
            let keep = keep_alive && !(req.http10 && streamed);
            if let Some(e) = up.tail.shown_endpoint() {
                push_header(&mut self.out, b"x-keel-endpoint", e.as_bytes());
            }
            if !head.has_date {
                push_date(&mut self.out);
            }
            push_framing(&mut self.out, head.framing, req.http10, keep);
            let idle = BodyIdle {
                upstream: up.tail.upstream_idle,
                client: self.client_idle,
            };
            let relayed = {
                let fut = relay_response(
                    &mut self.stream,
                    &self.out,
                    &mut conn,
                    head.framing,
                    !req.http10,
                    &mut self.client_timer,
                    idle,
                );
                match up.tail.max_end {
                    Some(end) => until(&mut self.request_timer, end, fut).await,
                    None => Some(fut.await),
                }
            };
            let (end, cut) = match relayed {
                Some(Ok(())) => (BodyEnd::Done, None),
                Some(Err(RelayError::Upstream(cause))) => {
                    tracing::debug!("response body failed: {cause}");
                    (BodyEnd::UpstreamFailed, Some("upstream failed"))
                }
                Some(Err(RelayError::UpstreamBeforeHead(cause))) => {
                    tracing::debug!("response body malformed from its start: {cause}");
                    up.tail.end(BodyEnd::UpstreamFailed, None);
                    let own = answer::unforwardable("the endpoint's response body is malformed");
                    self.replaced = Some(502);
                    self.cut = Some("upstream invalid");
                    self.answer(&own, false, req).await;
                    return false;
                }
                Some(Err(RelayError::Client)) => (BodyEnd::ClientGone, Some("client gone")),
                Some(Err(RelayError::UpstreamIdle)) => (BodyEnd::Timeout, Some("upstream idle")),
                // Not the endpoint's fault: its pick is dropped, not failed.
                Some(Err(RelayError::ClientIdle)) => (BodyEnd::ClientGone, Some("client idle")),
                None => (BodyEnd::ClientGone, Some("max_duration")),
            };
            self.cut = cut;
            up.tail.end(end, head.keep_alive.then_some(conn));
            // A client that saw a head and part of a body only learns it is cut by the close.
            keep && end == BodyEnd::Done
        }
    }

    /// Writes keel's own answer; returns whether the connection stays open.
    async fn answer(&mut self, own: &OwnAnswer, keep: bool, req: &RequestHead) -> bool {
        self.out.clear();
        crate::codec::reserve_head(&mut self.out);
        push_status_line(&mut self.out, own.status, answer::reason(own.status));
        // Text, unless the answer says otherwise (an OpenAI-shaped error is JSON).
        if !own
            .headers
            .iter()
            .any(|(n, _)| n == hyper::header::CONTENT_TYPE)
        {
            push_header(&mut self.out, b"content-type", b"text/plain; charset=utf-8");
        }
        push_content_length(&mut self.out, own.text.len() as u64);
        push_date(&mut self.out);
        if let Some(e) = own.shown_endpoint() {
            push_header(&mut self.out, b"x-keel-endpoint", e.as_bytes());
        }
        for (name, value) in &own.headers {
            push_header(&mut self.out, name.as_str().as_bytes(), value.as_bytes());
        }
        if !keep {
            self.out.extend_from_slice(b"connection: close\r\n");
        } else if req.http10 {
            self.out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        self.out.extend_from_slice(b"\r\n");
        let body = if req.is_head {
            &[][..]
        } else {
            own.text.as_bytes()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let written = until(
            &mut self.client_timer,
            deadline,
            write_all_2(&mut self.stream, &self.out, body),
        )
        .await;
        keep && matches!(written, Some(Ok(())))
    }

    /// Answers a request refused before it reached the driver, and closes the connection.
    async fn refuse(&mut self, shared: &Shared, client: &Client, reject: Reject) -> Served<S> {
        let started = Instant::now();
        let own = answer::refused(reject);
        tracing::debug!(client = %client.peer, "refused a request: {}", reject.cause());
        self.stream.sent = 0;
        self.answer(&own, false, &RequestHead::default()).await;
        // What can be read of the refused head (it may be anything).
        let head = &self.rbuf[..self.rbuf.len().min(8192)];
        let sent = self.stream.sent;
        Record {
            bytes_sent: sent,
            body_bytes_sent: sent.saturating_sub(self.out.len() as u64),
            ..Record::refused(
                client,
                "HTTP/1.1",
                started,
                HeadView::Lines(head),
                own.status,
                &own.cause,
            )
        }
        .write(shared.access_log.load().as_deref());
        self.unread = true;
        self.close().await;
        Served::Closed
    }

    /// Closes the connection; when the request was not read to its end, first reads and
    /// drops what the client still sends, bounded by `LINGER_TIME` and `LINGER_BYTES`, so that
    /// it reads keel's answer instead of a reset.
    async fn close(&mut self) {
        let _ = self.stream.shutdown().await;
        if self.unread {
            drop_unread(&mut self.stream, &mut self.client_timer, &mut self.rbuf).await;
        }
    }
}

/// Reads and drops what a client still sends after keel closed its side, bounded by
/// `LINGER_TIME` and `LINGER_BYTES`, so that it reads keel's answer (or the close) instead of
/// a reset.
async fn drop_unread<S: AsyncRead + Unpin>(
    stream: &mut S,
    timer: &mut Pin<Box<tokio::time::Sleep>>,
    buf: &mut BytesMut,
) {
    let deadline = Instant::now() + LINGER_TIME;
    let mut dropped = 0;
    while dropped < LINGER_BYTES {
        buf.clear();
        buf.reserve(16384);
        match until(timer, deadline, stream.read_buf(buf)).await {
            Some(Ok(n)) if n > 0 => dropped += n,
            _ => return,
        }
    }
}

/// What a request's [`Record`] takes from its connection and route besides its answer.
struct Scope<'a> {
    /// The access log, when one is configured (loaded per request: a reload may change it).
    log: Option<&'a AccessLog>,
    client: &'a Client,
    cluster: Option<&'a Cluster>,
    route: RouteRef,
    /// The route's counters for its cluster.
    metrics: Option<&'a crate::metrics::RouteMetrics>,
    started: Instant,
}

/// What a request's [`Record`] says of its answer.
struct Answered<'a> {
    status: u16,
    endpoint: Option<&'a [u8]>,
    attempts: u32,
    cause: Option<&'a str>,
    /// keel answered itself (or replaced the endpoint's response).
    own: bool,
    tries: Option<&'a Tries>,
}

/// A client stream that counts the bytes written to it (the access log's `bytes_sent`).
struct Counted<S> {
    inner: S,
    /// Bytes written since the count was last reset.
    sent: u64,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.sent += n as u64;
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            this.sent += n as u64;
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::may_end_head;
    use crate::future_size::returned;

    /// What a waiting connection's HTTP/1.1 front end holds (run with `--nocapture` to see the
    /// sizes): its boxed future for the connection's life, the parked wait inside it.
    #[test]
    fn a_parked_connection_is_small() {
        use tokio::net::TcpStream;
        let serve = returned(super::serve::<TcpStream>);
        let park = returned(super::park::<TcpStream>);
        let busy = returned(super::busy::<TcpStream>);
        eprintln!("sizes: h1 serve {serve} B, park {park} B, busy {busy} B");
        // 640 and 376 before they were `async` blocks. At most 512: mimalloc's size class
        // above is 640.
        assert!(serve <= 512, "{serve}");
    }

    #[test]
    fn a_head_is_parsed_first_then_only_once_a_blank_line_may_have_come() {
        let mut searched = None;
        let mut buf = b"GET / HTTP/1.1\r\n".to_vec();
        assert!(may_end_head(&buf, &mut searched), "first look");
        buf.extend_from_slice(b"Host: x\r");
        assert!(!may_end_head(&buf, &mut searched));
        buf.extend_from_slice(b"\n");
        assert!(!may_end_head(&buf, &mut searched));
        // The blank line straddles two reads.
        buf.extend_from_slice(b"\r");
        assert!(!may_end_head(&buf, &mut searched));
        buf.extend_from_slice(b"\n");
        assert!(may_end_head(&buf, &mut searched));
        // Bare line feeds end a head too (httparse accepts them).
        let mut searched = None;
        assert!(may_end_head(b"GET / HTTP/1.1\n", &mut searched));
        assert!(may_end_head(b"GET / HTTP/1.1\nHost: x\n\n", &mut searched));
        // Trickled one byte at a time, the head is searched once, not once per byte from its
        // start: every byte is looked at a bounded number of times.
        let head = format!("GET / HTTP/1.1\r\n{}\r\n", "X-A: b\r\n".repeat(2000));
        let mut searched = None;
        let parses = (1..=head.len())
            .filter(|&n| may_end_head(&head.as_bytes()[..n], &mut searched))
            .count();
        assert_eq!(parses, 2, "the first byte and the last");
    }
}
