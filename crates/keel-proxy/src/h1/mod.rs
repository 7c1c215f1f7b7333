//! keel's own HTTP/1.1 path, for plain-TCP listeners (the default `http1 = "keel"`).
//!
//! Why: under load, hyper's server and client cost keel about twice NGINX's CPU per request
//! (a header map and channels per request, a timer per read, two codecs; see BENCHMARKS.md).
//! Here a request head is parsed in place (`httparse`) and rewritten straight into the bytes
//! sent upstream; the response head likewise into the bytes sent to the client; bodies pass
//! through reused buffers; one request's upstream exchange runs in the client connection's
//! task with two reusable timers per connection. The balancer calls are exactly those of
//! [`crate::forward`]: `pick`, then `finish` with the outcome, retries within the budget.
//!
//! What this path does not do itself it hands to the general (hyper) path for the rest of the
//! connection, bytes already read included: HTTP/2 with prior knowledge, chunked or large
//! request bodies, `Expect`, `CONNECT`. TLS listeners always use the general path.

mod head;

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use keel_balance::{EndpointId, Outcome, PickContext};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Sleep;

use crate::body::DownstreamGuard;
use crate::cluster::{Cluster, EndpointEntry};
use crate::config::{HashOn, ListenerConfig, MAX_RETRY_ATTEMPTS};
use crate::metrics::{class_index, ErrorKind};
use crate::pool::{RawConn, UpstreamError};
use crate::server::Shared;
use head::{Framing, RequestHead, RequestParse, RequestRules, ResponseHead};

/// Request bodies up to this size are read whole before the request is forwarded (so a
/// request can be retried on another endpoint); larger ones go to the general path, which
/// streams them.
const MAX_INLINE_BODY: u64 = 64 * 1024;

/// An endpoint's response head larger than this is refused (502).
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// How a client connection's service ended.
pub(crate) enum Served {
    /// Closed (by either side, by a timeout, or by shutdown).
    Closed,
    /// The general path takes the connection over; `BytesMut` holds what was read of it.
    Handoff(TcpStream, BytesMut),
}

/// Serves a plain-TCP client connection until it closes, or hands it off.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    index: usize,
    settings: Arc<ListenerConfig>,
    stream: TcpStream,
    peer: SocketAddr,
    stop: watch::Receiver<Option<Duration>>,
) -> Served {
    // One shutdown waiter for the connection's life: it registers once, instead of at every
    // wait for a request.
    let mut stop_waiter = stop.clone();
    let mut shutdown = std::pin::pin!(async move {
        crate::server::wait_shutdown(&mut stop_waiter).await;
    });
    let far = tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
    let mut conn = Downstream {
        stream,
        rbuf: BytesMut::with_capacity(8192),
        up_head: Vec::with_capacity(1024),
        out: Vec::with_capacity(1024),
        ip: peer.ip().to_string(),
        peer,
        client_timer: Box::pin(tokio::time::sleep_until(far)),
        try_timer: Box::pin(tokio::time::sleep_until(far)),
        request_timer: Box::pin(tokio::time::sleep_until(far)),
    };
    let max_body = settings.max_request_body_bytes.unwrap_or(u64::MAX);
    loop {
        if stop.borrow().is_some() {
            return Served::Closed;
        }
        // Waiting for a request: the idle timeout until its first byte, the header-read
        // timeout until its last (as hyper's `header_read_timeout`, it runs between
        // keep-alive requests too).
        let waited = Instant::now();
        let first_byte = waited + settings.header_read_timeout.min(settings.idle_timeout);
        let whole_head = waited + settings.header_read_timeout;
        // Bytes of this request already searched for the blank line that ends a head.
        let mut searched = None;
        let (cluster, req) = loop {
            if !conn.rbuf.is_empty() && may_end_head(&conn.rbuf, &mut searched) {
                let cluster = shared.routing.load().listeners[index].clone();
                let (hash_header, hash_path) = match &cluster.config.hash_on {
                    Some(HashOn::Header(h)) => (Some(h.as_str()), false),
                    Some(HashOn::Path) => (None, true),
                    _ => (None, false),
                };
                let rules = RequestRules {
                    client_ip: &conn.ip,
                    proto: "http",
                    hash_header,
                    hash_path,
                    max_headers: settings.max_headers,
                    max_body,
                    max_inline_body: MAX_INLINE_BODY,
                };
                match head::parse_request(&conn.rbuf, &rules, &mut conn.up_head) {
                    // However it arrived (one read may bring more than the limit).
                    RequestParse::Ready(h) if h.head_len > settings.max_header_bytes => {
                        conn.answer_and_close(431, "request head larger than max_header_bytes")
                            .await;
                        return Served::Closed;
                    }
                    RequestParse::Ready(h) => break (cluster, h),
                    RequestParse::Handoff => return Served::Handoff(conn.stream, conn.rbuf),
                    RequestParse::Reject(status, cause) => {
                        conn.answer_and_close(status, cause).await;
                        return Served::Closed;
                    }
                    RequestParse::Partial if conn.rbuf.len() >= settings.max_header_bytes => {
                        conn.answer_and_close(431, "request head larger than max_header_bytes")
                            .await;
                        return Served::Closed;
                    }
                    RequestParse::Partial => {}
                }
            } else if conn.rbuf.len() >= settings.max_header_bytes {
                conn.answer_and_close(431, "request head larger than max_header_bytes")
                    .await;
                return Served::Closed;
            }
            let deadline = if conn.rbuf.is_empty() {
                first_byte
            } else {
                whole_head
            };
            let idle = conn.rbuf.is_empty();
            conn.rbuf.reserve(4096);
            let read = tokio::select! {
                biased;
                r = until(&mut conn.client_timer, deadline, conn.stream.read_buf(&mut conn.rbuf)) => r,
                _ = shutdown.as_mut(), if idle => return Served::Closed,
            };
            match read {
                Some(Ok(n)) if n > 0 => {}
                // Closed, failed, or too slow: nothing to answer.
                _ => return Served::Closed,
            }
        };
        // The body, read whole (at most MAX_INLINE_BODY), each read within the header-read
        // timeout.
        let end = req.head_len + req.body_len;
        while conn.rbuf.len() < end {
            conn.rbuf.reserve(end - conn.rbuf.len());
            let deadline = Instant::now() + settings.header_read_timeout;
            let read = until(
                &mut conn.client_timer,
                deadline,
                conn.stream.read_buf(&mut conn.rbuf),
            )
            .await;
            if !matches!(read, Some(Ok(n)) if n > 0) {
                return Served::Closed;
            }
        }
        let keep = conn.exchange(&cluster, &req, &stop).await;
        conn.rbuf.advance(end);
        if !keep {
            let _ = conn.stream.shutdown().await;
            return Served::Closed;
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

/// A client connection and its reusable buffers and timers.
struct Downstream {
    stream: TcpStream,
    /// Bytes read from the client not yet consumed: the current request first.
    rbuf: BytesMut,
    /// The request head for the upstream (its common part, then the per-try end).
    up_head: Vec<u8>,
    /// The response head for the client.
    out: Vec<u8>,
    /// The client's IP, for `X-Forwarded-For`.
    ip: String,
    peer: SocketAddr,
    /// Deadlines of reads from the client.
    client_timer: Pin<Box<Sleep>>,
    /// Per-try deadlines. (One timer per kind of deadline: each moves only later, which
    /// costs no timer-wheel work.)
    try_timer: Pin<Box<Sleep>>,
    /// Whole-request deadlines, while a response body streams.
    request_timer: Pin<Box<Sleep>>,
}

/// Why a try failed.
enum Failure {
    /// No usable answer.
    Error(ErrorKind, String),
    /// The endpoint answered with a status that counts as failure: forwarded if it is the
    /// last try (the connection carries its body).
    Status(RawConn, ResponseHead),
}

/// Why streaming a body stopped early.
enum RelayError {
    /// The endpoint failed or sent a malformed body.
    Upstream(String),
    /// The request deadline passed.
    Timeout,
    /// The client went away.
    Client,
}

impl Downstream {
    /// Serves one complete request (head and body in `rbuf`); returns whether the client
    /// connection stays open.
    async fn exchange(
        &mut self,
        cluster: &Arc<Cluster>,
        req: &RequestHead,
        stop: &watch::Receiver<Option<Duration>>,
    ) -> bool {
        let start = Instant::now();
        let Some(guard) =
            DownstreamGuard::try_new(&cluster.metrics, start, cluster.config.max_in_flight, None)
        else {
            cluster.metrics.overloaded.fetch_add(1, Relaxed);
            cluster.metrics.responses[class_index(503)].fetch_add(1, Relaxed);
            let cause = format!(
                "cluster `{}` is overloaded: {} requests in flight (max_in_flight); refused without trying an endpoint",
                cluster.name(),
                cluster.config.max_in_flight
            );
            return self.answer(503, &cause, None, req.keep_alive, req).await;
        };
        let deadline = start + cluster.config.request_timeout;
        let common_len = self.up_head.len();
        let body_range = req.head_len..req.head_len + req.body_len;
        let hash = match cluster.config.hash_on {
            Some(HashOn::ClientIp) => Some(crate::cluster::client_ip_key(self.peer)),
            _ => req.hash,
        };
        // The first try's clock readings are `start`'s; later ones read the clock again.
        let start_on_clock = cluster.at(start);
        cluster.budget.record_request(start_on_clock);
        let attempts = cluster.config.retry.attempts.min(MAX_RETRY_ATTEMPTS) as usize;
        let mut tried = [EndpointId(0); MAX_RETRY_ATTEMPTS as usize + 1];
        let mut attempt = 0;
        loop {
            let (now, wall) = if attempt == 0 {
                (start_on_clock, start)
            } else {
                (cluster.now(), Instant::now())
            };
            let mut ctx = PickContext::new(now).with_avoid(&tried[..attempt]);
            if let Some(k) = hash {
                ctx = ctx.with_hash_key(k);
            }
            let Some(pick) = cluster.balancer.pick(&ctx) else {
                cluster.metrics.no_endpoint.fetch_add(1, Relaxed);
                let cause = format!("no endpoint available in cluster `{}`", cluster.name());
                let kept = self.finish_answer(cluster, 503, &cause, None, req).await;
                drop(guard);
                return kept;
            };
            tried[attempt] = pick.id();
            let entry = &cluster.endpoints[pick.index()];
            let last = attempt >= attempts;
            // The per-try end of the head: `Host` if the client sent none, and the blank line.
            self.up_head.truncate(common_len);
            if !req.has_host {
                head::push_header(&mut self.up_head, b"host", entry.header.as_bytes());
            }
            self.up_head.extend_from_slice(b"\r\n");
            let try_deadline = deadline.min(wall + cluster.per_try_timeout);
            let tried_once = {
                let body = &self.rbuf[body_range.clone()];
                let fut = try_once(entry, cluster, &self.up_head, body, req, &mut self.out);
                until(&mut self.try_timer, try_deadline, fut).await
            };
            let failure = match tried_once {
                None => Failure::Error(
                    ErrorKind::Timeout,
                    cluster.timeout_cause(entry, try_deadline == deadline),
                ),
                Some(Err(f)) => f,
                Some(Ok((conn, resp))) => {
                    // A success: forward it, finishing the pick when its body is through.
                    let keep = req.keep_alive && stop.borrow().is_none();
                    let kept = self
                        .forward(
                            cluster,
                            entry,
                            conn,
                            resp,
                            Some((pick, now)),
                            keep,
                            req,
                            deadline,
                        )
                        .await;
                    drop(guard);
                    return kept;
                }
            };
            let kind = match &failure {
                Failure::Error(kind, _) => Some(*kind),
                Failure::Status(..) => None,
            };
            if tracing::enabled!(tracing::Level::DEBUG) {
                let cause = match &failure {
                    Failure::Error(_, cause) => cause.clone(),
                    Failure::Status(_, h) => format!("status {}", h.status),
                };
                tracing::debug!(cluster = cluster.name(), endpoint = %entry.authority, attempt, %cause, "try failed");
            }
            cluster.finish(pick, now, Outcome::Failure, kind);
            // A connect failure means the request never left: any method may go again.
            // Otherwise the endpoint may have acted on it, so only idempotent methods are.
            let safe = req.idempotent || kind == Some(ErrorKind::Connect);
            if cluster.may_retry(last, safe, Instant::now() < deadline) {
                attempt += 1;
                continue;
            }
            return match failure {
                Failure::Error(kind, cause) => {
                    let status = match kind {
                        ErrorKind::Timeout => 504,
                        ErrorKind::Connect | ErrorKind::Reset => 502,
                    };
                    let kept = self
                        .finish_answer(cluster, status, &cause, Some(entry), req)
                        .await;
                    drop(guard);
                    kept
                }
                Failure::Status(conn, resp) => {
                    let keep = req.keep_alive && stop.borrow().is_none();
                    let kept = self
                        .forward(cluster, entry, conn, resp, None, keep, req, deadline)
                        .await;
                    drop(guard);
                    kept
                }
            };
        }
    }

    /// Forwards an endpoint's response (its head is in `self.out`) and its body; finishes
    /// `tail`'s pick with the body's outcome. Returns whether the client connection stays.
    #[allow(clippy::too_many_arguments)]
    async fn forward(
        &mut self,
        cluster: &Arc<Cluster>,
        entry: &EndpointEntry,
        mut conn: RawConn,
        resp: ResponseHead,
        tail: Option<(keel_balance::Pick, Duration)>,
        keep_alive: bool,
        req: &RequestHead,
        deadline: Instant,
    ) -> bool {
        // An HTTP/1.0 client cannot take chunks: such a body ends with the connection.
        let streamed = matches!(resp.framing, Framing::Chunked | Framing::Close);
        let keep = keep_alive && !(req.http10 && streamed);
        head::push_header(&mut self.out, b"x-keel-endpoint", entry.header.as_bytes());
        match resp.framing {
            Framing::Length(n) => head::push_content_length(&mut self.out, n),
            Framing::Chunked | Framing::Close if !req.http10 => {
                self.out
                    .extend_from_slice(b"transfer-encoding: chunked\r\n");
            }
            _ => {}
        }
        if !keep {
            self.out.extend_from_slice(b"connection: close\r\n");
        } else if req.http10 {
            self.out.extend_from_slice(b"connection: keep-alive\r\n");
        }
        self.out.extend_from_slice(b"\r\n");
        cluster.metrics.responses[class_index(resp.status)].fetch_add(1, Relaxed);

        let result = {
            let fut = relay(
                &mut self.stream,
                &self.out,
                &mut conn,
                resp.framing,
                !req.http10,
            );
            until(&mut self.request_timer, deadline, fut)
                .await
                .unwrap_or(Err(RelayError::Timeout))
        };
        match result {
            Ok(()) => {
                if let Some((pick, at)) = tail {
                    cluster.finish(pick, at, Outcome::Success, None);
                }
                if resp.keep_alive {
                    entry.pool.put_raw(conn);
                }
                keep
            }
            Err(e) => {
                let kind = match e {
                    RelayError::Upstream(cause) => {
                        tracing::debug!(endpoint = %entry.authority, "response body failed: {cause}");
                        Some(ErrorKind::Reset)
                    }
                    RelayError::Timeout => Some(ErrorKind::Timeout),
                    // The client went away: the pick is cancelled (dropped), not failed.
                    RelayError::Client => None,
                };
                if let (Some((pick, at)), Some(kind)) = (tail, kind) {
                    cluster.finish(pick, at, Outcome::Failure, Some(kind));
                }
                // The client saw a head and part of a body: only closing says it is cut.
                false
            }
        }
    }

    /// Answers with the proxy's own response, counted in the cluster's responses.
    async fn finish_answer(
        &mut self,
        cluster: &Cluster,
        status: u16,
        cause: &str,
        endpoint: Option<&EndpointEntry>,
        req: &RequestHead,
    ) -> bool {
        cluster.metrics.responses[class_index(status)].fetch_add(1, Relaxed);
        self.answer(status, cause, endpoint, req.keep_alive, req)
            .await
    }

    /// Writes the proxy's own response: a status and a one-line plain-text cause.
    async fn answer(
        &mut self,
        status: u16,
        cause: &str,
        endpoint: Option<&EndpointEntry>,
        keep: bool,
        req: &RequestHead,
    ) -> bool {
        let reason = hyper::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        let body = format!("{status} {reason}: {cause}\n");
        self.out.clear();
        self.out
            .extend_from_slice(format!("HTTP/1.1 {status} {reason}\r\n").as_bytes());
        head::push_header(&mut self.out, b"content-type", b"text/plain; charset=utf-8");
        head::push_content_length(&mut self.out, body.len() as u64);
        head::push_header(
            &mut self.out,
            b"date",
            httpdate::fmt_http_date(std::time::SystemTime::now()).as_bytes(),
        );
        if let Some(e) = endpoint {
            head::push_header(&mut self.out, b"x-keel-endpoint", e.header.as_bytes());
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
            body.as_bytes()
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

    /// Answers a request this path refuses (malformed, too large) and says the connection
    /// closes; the caller closes it.
    async fn answer_and_close(&mut self, status: u16, cause: &str) {
        let req = RequestHead::default();
        self.answer(status, cause, None, false, &req).await;
        let _ = self.stream.shutdown().await;
    }
}

/// One try: a connection to the endpoint (pooled or new), the request written, the response
/// head read (1xx skipped) and rewritten into `out`. A pooled connection found closed before
/// any answer byte is replaced by another (the request goes again) when that is safe.
async fn try_once(
    entry: &EndpointEntry,
    cluster: &Cluster,
    head_bytes: &[u8],
    body: &[u8],
    req: &RequestHead,
    out: &mut Vec<u8>,
) -> Result<(RawConn, ResponseHead), Failure> {
    loop {
        let mut conn = entry.pool.get_raw().await.map_err(|e| match e {
            UpstreamError::Connect { cause } => Failure::Error(
                ErrorKind::Connect,
                format!("cannot connect to upstream {}: {cause}", entry.authority),
            ),
            UpstreamError::Http(e) => Failure::Error(ErrorKind::Connect, e.to_string()),
        })?;
        let reused = conn.reused;
        // A reused connection that fails before any answer byte was most likely closed by
        // the endpoint while idle: the request did not reach it.
        let stale = |cause: &str| {
            Failure::Error(
                ErrorKind::Reset,
                format!(
                    "upstream {} closed the connection or sent an invalid response: {cause}",
                    entry.authority
                ),
            )
        };
        // (The flush matters for TLS, whose records may wait in its buffer; none for TCP.)
        let written = match write_all_2(&mut conn.io, head_bytes, body).await {
            Ok(()) => conn.io.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            if reused {
                continue;
            }
            return Err(stale(&e.to_string()));
        }
        let mut answered = false;
        loop {
            match head::parse_response(&conn.buf, req.is_head, out) {
                Ok(Some(resp)) if resp.status < 200 => {
                    // 101 cannot be: Upgrade is never forwarded.
                    if resp.status == 101 {
                        return Err(stale("unexpected 101 Switching Protocols"));
                    }
                    answered = true;
                    conn.buf.advance(resp.head_len);
                    continue;
                }
                Ok(Some(resp)) => {
                    conn.buf.advance(resp.head_len);
                    entry.metrics.responses[class_index(resp.status)].fetch_add(1, Relaxed);
                    if cluster.is_failure_status(resp.status) {
                        return Err(Failure::Status(conn, resp));
                    }
                    if let Framing::Length(n) = resp.framing {
                        if n <= cluster.config.max_buffered_response {
                            // Read whole before anything is sent, so that an endpoint failing
                            // mid-body is a failed try (retried), not a cut response.
                            read_at_least(&mut conn, n as usize).await.map_err(|cause| {
                                Failure::Error(
                                    ErrorKind::Reset,
                                    format!(
                                        "upstream {} failed in the middle of the response body: {cause}",
                                        entry.authority
                                    ),
                                )
                            })?;
                        }
                    }
                    return Ok((conn, resp));
                }
                Ok(None) if conn.buf.len() > MAX_RESPONSE_HEAD => {
                    return Err(stale("response head too large"));
                }
                Ok(None) => {}
                Err(cause) => return Err(stale(cause)),
            }
            conn.buf.reserve(8192);
            match conn.io.read_buf(&mut conn.buf).await {
                Ok(n) if n > 0 => answered = true,
                Ok(_) if reused && !answered && req.idempotent => break,
                Err(_) if reused && !answered && req.idempotent => break,
                Ok(_) => return Err(stale("connection closed before the response")),
                Err(e) => return Err(stale(&e.to_string())),
            }
        }
    }
}

/// Reads until the connection's buffer holds at least `n` bytes.
async fn read_at_least(conn: &mut RawConn, n: usize) -> Result<(), String> {
    while conn.buf.len() < n {
        conn.buf.reserve(n - conn.buf.len());
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) => return Err("response body shorter than its Content-Length".into()),
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Sends the response head `head` and the body that `framing` delimits on `conn` to the
/// client: the bytes already read go out with the head, the rest as it arrives. Bodies
/// without a length go to HTTP/1.1 clients chunked (passed through as the endpoint chunked
/// them, or chunked here when it ends the body by closing).
async fn relay(
    client: &mut TcpStream,
    head: &[u8],
    conn: &mut RawConn,
    framing: Framing,
    chunked_to_client: bool,
) -> Result<(), RelayError> {
    let mut head = head;
    let to_client = |e: io::Error| {
        tracing::debug!("client went away while its response was sent: {e}");
        RelayError::Client
    };
    match framing {
        Framing::Empty => write_all_2(client, head, &[]).await.map_err(to_client),
        Framing::Length(n) => {
            let mut left = n as usize;
            loop {
                let take = left.min(conn.buf.len());
                write_all_2(client, head, &conn.buf[..take])
                    .await
                    .map_err(to_client)?;
                head = &[];
                conn.buf.advance(take);
                left -= take;
                if left == 0 {
                    return Ok(());
                }
                read_more(conn).await?;
            }
        }
        Framing::Chunked => {
            let mut decoder = head::ChunkedDecoder::default();
            let mut plain = Vec::new();
            loop {
                let used = decoder
                    .decode(&conn.buf, |d| {
                        if !chunked_to_client {
                            plain.extend_from_slice(d)
                        }
                    })
                    .map_err(|e| RelayError::Upstream(e.to_string()))?;
                let piece = if chunked_to_client {
                    &conn.buf[..used]
                } else {
                    &plain[..]
                };
                write_all_2(client, head, piece).await.map_err(to_client)?;
                head = &[];
                plain.clear();
                conn.buf.advance(used);
                if decoder.is_done() {
                    return Ok(());
                }
                read_more(conn).await?;
            }
        }
        Framing::Close => {
            let mut framed = Vec::new();
            loop {
                let piece: &[u8] = if chunked_to_client {
                    framed.clear();
                    if !conn.buf.is_empty() {
                        framed.extend_from_slice(format!("{:x}\r\n", conn.buf.len()).as_bytes());
                        framed.extend_from_slice(&conn.buf);
                        framed.extend_from_slice(b"\r\n");
                    }
                    &framed
                } else {
                    &conn.buf
                };
                write_all_2(client, head, piece).await.map_err(to_client)?;
                head = &[];
                conn.buf.clear();
                conn.buf.reserve(16 * 1024);
                match conn.io.read_buf(&mut conn.buf).await {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => return Err(RelayError::Upstream(e.to_string())),
                }
            }
            if chunked_to_client {
                write_all_2(client, b"0\r\n\r\n", &[])
                    .await
                    .map_err(to_client)?;
            }
            Ok(())
        }
    }
}

/// Reads more of a body the endpoint has not finished.
async fn read_more(conn: &mut RawConn) -> Result<(), RelayError> {
    if conn.buf.capacity() - conn.buf.len() < 4096 {
        conn.buf.reserve(16 * 1024);
    }
    match conn.io.read_buf(&mut conn.buf).await {
        Ok(0) => Err(RelayError::Upstream(
            "connection closed in the middle of the body".into(),
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(RelayError::Upstream(e.to_string())),
    }
}

/// Writes `a` then `b` (one `writev` when both fit).
async fn write_all_2<W: AsyncWrite + Unpin>(w: &mut W, a: &[u8], b: &[u8]) -> io::Result<()> {
    let (mut a, mut b) = (a, b);
    while !a.is_empty() || !b.is_empty() {
        let n = if a.is_empty() {
            w.write(b).await?
        } else if b.is_empty() {
            w.write(a).await?
        } else {
            w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
                .await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// Runs `fut` until `deadline` (`None` if it passed first), on a timer reused across calls:
/// moving a registered timer's deadline later costs no timer-wheel work.
async fn until<F: std::future::Future>(
    timer: &mut Pin<Box<Sleep>>,
    deadline: Instant,
    fut: F,
) -> Option<F::Output> {
    let deadline = tokio::time::Instant::from_std(deadline);
    if timer.deadline() != deadline {
        timer.as_mut().reset(deadline);
    }
    tokio::select! {
        biased;
        r = fut => Some(r),
        _ = timer.as_mut() => None,
    }
}

/// A stream whose first bytes were already read (by this path): they are read again first.
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
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return std::task::Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::may_end_head;

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
