//! The HTTP/1.1 leg: one try of a request on one of an endpoint's keep-alive connections
//! (pooled or new). It writes the request (head and body), reads the response head (1xx
//! skipped), rewrites it for the client, and reads a small body whole; it reports what failed
//! and whether the endpoint may have acted on the request. Retrying, finishing the pick and
//! answering are the attempt driver's.

use std::sync::atomic::Ordering::Relaxed;

use std::io::IoSlice;

use bytes::Buf;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::codec::chunked::{chunk, LAST_CHUNK};
use crate::codec::response::{parse_response, Framing, ResponseHead, MAX_RESPONSE_HEAD};
use crate::exchange::error::{Cause, TryError, TryFailure};
use crate::exchange::request::{BodyFraming, RequestBody, RequestHead};
use crate::io::write_all_vectored;
use crate::metrics::{class_index, ErrorKind};
use crate::tls::UpstreamStream;
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::h1_client::read_at_least;
use crate::upstream::pool::RawConn;
use crate::upstream::signals::{ORCA_ASK, ORCA_FORMAT};

/// What the HTTP/1.1 leg yields: the connection (what was read of the body in its buffer)
/// and the response head.
pub(crate) type H1Response = (RawConn, ResponseHead);

/// One try: a connection to the endpoint (pooled or new), the request written, the response
/// head read and rewritten into `out`. A pooled connection found closed before any answer
/// byte is replaced by another (the request goes again) when that is safe. A `101` to an
/// upgrade request is an answer like any other: the front end makes it a tunnel.
pub(crate) async fn try_once<B: RequestBody>(
    entry: &EndpointEntry,
    cluster: &Cluster,
    worker: usize,
    head: &[u8],
    req: &RequestHead,
    body: &mut B,
    out: &mut Vec<u8>,
) -> Result<H1Response, TryFailure<H1Response>> {
    loop {
        let mut conn = entry.pool.get(worker).await.map_err(|e| {
            let cause = Cause::from(e);
            TryFailure::Upstream(TryError::before_sending(ErrorKind::Connect, cause))
        })?;
        // A keep-alive connection the endpoint closed while it was idle fails at once, before
        // any answer: the request did not reach the endpoint, so it goes again on another
        // connection (a new one, or the next idle one) when that is safe.
        let reused = conn.reused;
        let stale = |f: &TryFailure<H1Response>, started: bool| {
            reused
                && !started
                && match f {
                    TryFailure::Upstream(e) => match e.cause {
                        Cause::Write(_) => true,
                        Cause::ClosedEarly => req.idempotent,
                        _ => false,
                    },
                    _ => false,
                }
        };
        // A client that asked itself gets the form it asked for (keel reads both).
        let ask = cluster.asks_orca && head_value(head, ORCA_FORMAT).is_none();
        if let Err(f) = send_request(&mut conn, head, ask, req, body).await {
            if stale(&f, body.started()) {
                continue;
            }
            return Err(f);
        }
        let read = read_response(&mut conn, entry, cluster, req, out).await;
        match read.map(|resp| never_pooled_after_tunnel(head, resp)) {
            Ok(resp) if cluster.is_failure_status(resp.status) => {
                let cause = Cause::Status(resp.status);
                return Err(TryFailure::Status((conn, resp), cause));
            }
            Ok(resp) => return Ok((conn, resp)),
            Err(f) if stale(&f, body.started()) => continue,
            Err(f) => return Err(f),
        }
    }
}

/// A response that turns its connection into a tunnel (`101 Switching Protocols`, or a `2xx`
/// to `CONNECT`) leaves it carrying bytes no other request may see: it is marked not to be
/// kept, so that it never goes back to the pool, whatever the front end refused before.
fn never_pooled_after_tunnel(head: &[u8], mut resp: ResponseHead) -> ResponseHead {
    if resp.status == 101 || (resp.status / 100 == 2 && head.starts_with(b"CONNECT ")) {
        resp.keep_alive = false;
    }
    resp
}

/// Writes the request: an inline body with the head in one write; a streamed one after it,
/// piece by piece, chunked when its length is unknown.
/// With `ask_orca`, the head gets one more line asking an inference engine for its ORCA
/// report (written beside the head, not copied into it).
async fn send_request<B: RequestBody>(
    conn: &mut RawConn,
    head: &[u8],
    ask_orca: bool,
    req: &RequestHead,
    body: &mut B,
) -> Result<(), TryFailure<H1Response>> {
    let upstream =
        |e| TryFailure::Upstream(TryError::after_sending(ErrorKind::Reset, Cause::Write(e)));
    // The head ends with an empty line: the asking line goes before it.
    let (lines, end) = match head.len().checked_sub(2) {
        Some(n) if ask_orca && head.ends_with(b"\r\n\r\n") => head.split_at(n),
        _ => (head, &[][..]),
    };
    let ask: &[u8] = if end.is_empty() { &[] } else { ORCA_ASK };
    let inline = body.inline();
    let mut slices = [
        IoSlice::new(lines),
        IoSlice::new(ask),
        IoSlice::new(end),
        IoSlice::new(inline.unwrap_or(&[])),
    ];
    write_all_vectored(&mut conn.io, &mut slices)
        .await
        .map_err(upstream)?;
    if inline.is_some() {
        return conn.io.flush().await.map_err(upstream);
    }
    let chunked = req.body == BodyFraming::Chunked;
    let mut line = [0u8; 18];
    loop {
        let piece = body.next_piece().await.map_err(TryFailure::Client)?;
        if piece.is_empty() {
            break;
        }
        let written = if chunked {
            write_all_vectored(&mut conn.io, &mut chunk(piece, &mut line)).await
        } else {
            conn.io.write_all(piece).await
        };
        written.map_err(upstream)?;
    }
    if chunked {
        conn.io.write_all(LAST_CHUNK).await.map_err(upstream)?;
    }
    conn.io.flush().await.map_err(upstream)
}

/// Reads the response head (skipping 1xx), rewriting it into `out`; a small body with a
/// length is read whole (unless the status counts as a failure), so that an endpoint failing
/// midway is a failed try, not a cut response. A connection that ends before any byte of an
/// answer is [`Cause::ClosedEarly`].
async fn read_response(
    conn: &mut RawConn,
    entry: &EndpointEntry,
    cluster: &Cluster,
    req: &RequestHead,
    out: &mut Vec<u8>,
) -> Result<ResponseHead, TryFailure<H1Response>> {
    let failed = |kind, cause| TryFailure::Upstream(TryError::after_sending(kind, cause));
    let invalid = |what| failed(ErrorKind::Protocol, Cause::InvalidResponse(what));
    let mut answered = false;
    loop {
        match parse_response(&conn.buf, req.is_head, out, req.http2) {
            Ok(Some(resp)) if resp.status == 101 && req.upgrade => {
                // A switch to a protocol the client did not ask for (h2c when it asked for
                // websocket, say) would tunnel something neither keel nor the client speaks.
                let to = head_value(out, b"upgrade").unwrap_or(b"");
                if !req.upgrade_to.allows(to) {
                    return Err(invalid(
                        "101 Switching Protocols to a protocol the client did not ask for",
                    ));
                }
                // The protocol switches after this head: what follows is the tunnel's.
                conn.buf.advance(resp.head_len);
                entry.metrics.responses[class_index(101)].fetch_add(1, Relaxed);
                return Ok(resp);
            }
            Ok(Some(resp)) if resp.status < 200 => {
                // A 101 to a request that asked for no upgrade cannot be forwarded.
                if resp.status == 101 {
                    return Err(invalid("unexpected 101 Switching Protocols"));
                }
                answered = true;
                conn.buf.advance(resp.head_len);
                continue;
            }
            Ok(Some(resp)) => {
                conn.buf.advance(resp.head_len);
                entry.metrics.responses[class_index(resp.status)].fetch_add(1, Relaxed);
                // Server-reported load, for a strategy that balances on it (prequal).
                if let Some(load) = resp.load {
                    if cluster.uses_load_reports {
                        cluster.balancer.report_load(entry.id, load, cluster.now());
                    }
                }
                // The engine's own load, when the cluster asked for it.
                if let Some(report) = resp.engine.filter(|_| cluster.asks_orca) {
                    let now = cluster.now();
                    crate::upstream::signals::take(cluster, entry, report, now, now);
                }
                // ORCA's utilisation, for orca-wrr and zone routing.
                if let Some(u) = resp.orca {
                    if cluster.uses_utilization {
                        cluster
                            .balancer
                            .report_utilization(entry.id, u, cluster.now());
                    }
                }
                if let Framing::Length(n) = resp.framing {
                    if n <= cluster.config.max_buffered_response
                        && !cluster.is_failure_status(resp.status)
                    {
                        read_at_least(conn, n as usize).await.map_err(|what| {
                            failed(ErrorKind::Reset, Cause::BodyFailed(what.to_string()))
                        })?;
                    }
                }
                return Ok(resp);
            }
            Ok(None) if conn.buf.len() > MAX_RESPONSE_HEAD => {
                return Err(invalid("response head too large"));
            }
            Ok(None) => {}
            Err(what) => return Err(invalid(what)),
        }
        if conn.buf.is_empty() {
            if let UpstreamStream::Plain(tcp) = &conn.io {
                // Waiting for the answer without a buffer: taken once there is something to
                // read. (A wake without bytes leaves the read below waiting with it.) Polled
                // as a read polls readiness: `readable()` would queue a waiter under a lock.
                crate::io::spare::lend(&mut conn.buf);
                let _ = std::future::poll_fn(|cx| tcp.poll_read_ready(cx)).await;
            }
            crate::io::spare::take(&mut conn.buf);
        }
        conn.buf.reserve(4096);
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(n) if n > 0 => answered = true,
            Ok(_) | Err(_) if !answered && conn.buf.is_empty() => {
                return Err(failed(ErrorKind::Reset, Cause::ClosedEarly))
            }
            Ok(_) => {
                return Err(invalid(
                    "connection closed in the middle of the response head",
                ))
            }
            Err(e) => return Err(failed(ErrorKind::Reset, Cause::Read(e))),
        }
    }
}

/// The value of header `name` in a head keel wrote (`name: value\r\n` lines).
fn head_value<'a>(head: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    head.split(|b| *b == b'\n').skip(1).find_map(|line| {
        let colon = line.iter().position(|b| *b == b':')?;
        line[..colon]
            .eq_ignore_ascii_case(name)
            .then(|| line[colon + 1..].trim_ascii())
    })
}

#[cfg(test)]
mod tests {
    use super::never_pooled_after_tunnel;
    use crate::codec::response::parse_response;

    fn kept(request: &[u8], response: &[u8]) -> bool {
        let head = parse_response(response, false, &mut Vec::new(), false)
            .unwrap()
            .unwrap();
        never_pooled_after_tunnel(request, head).keep_alive
    }

    #[test]
    fn a_connection_that_became_a_tunnel_is_never_kept() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(kept(b"GET / HTTP/1.1\r\n", ok));
        assert!(!kept(b"CONNECT / HTTP/1.1\r\n", ok));
        assert!(!kept(
            b"CONNECT h:443 HTTP/1.1\r\n",
            b"HTTP/1.1 204 OK\r\n\r\n"
        ));
        // A refused CONNECT leaves an ordinary HTTP connection.
        let refused = b"HTTP/1.1 405 No\r\ncontent-length: 0\r\n\r\n";
        assert!(kept(b"CONNECT h:443 HTTP/1.1\r\n", refused));
        let switched = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n";
        assert!(!kept(b"GET /ws HTTP/1.1\r\n", switched));
    }
}
