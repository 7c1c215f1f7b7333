//! keel's HTTP/1.1 client for one exchange on a pooled connection, shared by the HTTP/1.1
//! leg (a body of a known length), the active health checks and the load probes (a whole
//! answer read and its connection left ready for the next request), and the engine-signal
//! scrapes (a page read whole, within a limit): the codec reads the head and follows the
//! body's framing ([`crate::codec::body::BodyDecoder`]); this does the reads.

use std::io;

use bytes::Buf;
use tokio::io::AsyncReadExt;

use crate::codec::body::{BodyDecoder, BodyError};
use crate::codec::response::{parse_response, ResponseHead, MAX_RESPONSE_HEAD};
use crate::upstream::pool::RawConn;

/// Why an exchange failed; shown as text only where it is logged or reported.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    /// Writing the request failed.
    #[error("cannot send: {0}")]
    Send(#[source] io::Error),
    /// Reading failed.
    #[error("{0}")]
    Read(#[source] io::Error),
    /// The endpoint closed the connection before its response head.
    #[error("connection closed before the response")]
    ClosedEarly,
    /// The response head was not valid HTTP/1.1.
    #[error("invalid response: {0}")]
    Invalid(&'static str),
    /// The response head did not end within [`MAX_RESPONSE_HEAD`].
    #[error("response head too large")]
    HeadTooLarge,
    /// The body ended before its `Content-Length`.
    #[error("response body shorter than its Content-Length")]
    ShortBody,
    /// The body was malformed, cut, or over the reader's limit.
    #[error("{0}")]
    Framing(#[source] BodyError),
    /// The head arrived, the body failed.
    #[error("status {status}, then {source}")]
    Body {
        /// The head's status.
        status: u16,
        /// Why the body failed.
        #[source]
        source: Box<ClientError>,
    },
}

/// Reads until the connection's buffer holds at least `n` bytes.
pub(crate) async fn read_at_least(conn: &mut RawConn, n: usize) -> Result<(), ClientError> {
    while conn.buf.len() < n {
        conn.buf.reserve(n - conn.buf.len());
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) => return Err(ClientError::ShortBody),
            Ok(_) => {}
            Err(e) => return Err(ClientError::Read(e)),
        }
    }
    Ok(())
}

/// A plain exchange on `conn` (tests): writes `head` (a whole request without
/// a body), reads the response and its body to their end; returns the status and whether the
/// endpoint keeps the connection open.
#[cfg(test)]
pub(crate) async fn exchange(conn: &mut RawConn, head: &[u8]) -> Result<(u16, bool), ClientError> {
    exchange_head(conn, head)
        .await
        .map(|resp| (resp.status, resp.keep_alive))
}

/// [`exchange`], returning the parsed response head (its status, its reported load).
pub(crate) async fn exchange_head(
    conn: &mut RawConn,
    head: &[u8],
) -> Result<ResponseHead, ClientError> {
    exchange_into(conn, head, false, None).await
}

/// [`exchange_head`] for a request of any method (`HEAD`'s answer has no body) keeping the
/// first `body.1` bytes of the body in `body.0` (health checks that look for text in it).
pub(crate) async fn exchange_into(
    conn: &mut RawConn,
    head: &[u8],
    request_is_head: bool,
    body: Option<(&mut Vec<u8>, usize)>,
) -> Result<ResponseHead, ClientError> {
    exchange_within(conn, head, request_is_head, body, u64::MAX).await
}

/// [`exchange_head`] keeping the whole body in `body`; a body over `max` bytes fails the
/// exchange (a scrape of a page that should be small).
pub(crate) async fn exchange_body(
    conn: &mut RawConn,
    head: &[u8],
    body: &mut Vec<u8>,
    max: u64,
) -> Result<ResponseHead, ClientError> {
    body.clear();
    let keep = usize::try_from(max).unwrap_or(usize::MAX);
    exchange_within(conn, head, false, Some((body, keep)), max).await
}

async fn exchange_within(
    conn: &mut RawConn,
    head: &[u8],
    request_is_head: bool,
    mut body: Option<(&mut Vec<u8>, usize)>,
    max: u64,
) -> Result<ResponseHead, ClientError> {
    crate::io::write_all_2(&mut conn.io, head, &[])
        .await
        .map_err(ClientError::Send)?;
    let mut out = Vec::new();
    loop {
        match parse_response(&conn.buf, request_is_head, &mut out, false) {
            Ok(Some(resp)) if resp.status < 200 => {
                conn.buf.advance(resp.head_len);
                continue;
            }
            Ok(Some(resp)) => {
                conn.buf.advance(resp.head_len);
                let decoder = BodyDecoder::new(resp.framing, max);
                read_body(conn, decoder, &mut body)
                    .await
                    .map_err(|e| ClientError::Body {
                        status: resp.status,
                        source: Box::new(e),
                    })?;
                return Ok(resp);
            }
            Ok(None) => {}
            Err(what) => return Err(ClientError::Invalid(what)),
        }
        if conn.buf.len() > MAX_RESPONSE_HEAD {
            return Err(ClientError::HeadTooLarge);
        }
        conn.buf.reserve(4096);
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) => return Err(ClientError::ClosedEarly),
            Ok(_) => {}
            Err(e) => return Err(ClientError::Read(e)),
        }
    }
}

/// Adds `data` to the kept body, up to its limit.
fn keep(body: &mut Option<(&mut Vec<u8>, usize)>, data: &[u8]) {
    if let Some((kept, limit)) = body {
        let room = limit.saturating_sub(kept.len());
        kept.extend_from_slice(&data[..data.len().min(room)]);
    }
}

/// Reads a body to its end, keeping its data in `body` up to that one's limit.
async fn read_body(
    conn: &mut RawConn,
    mut decoder: BodyDecoder,
    body: &mut Option<(&mut Vec<u8>, usize)>,
) -> Result<(), ClientError> {
    loop {
        let mut used = 0;
        while used < conn.buf.len() && !decoder.is_done() {
            let step = decoder
                .step(&conn.buf[used..])
                .map_err(ClientError::Framing)?;
            let data = used + step.framing;
            keep(body, &conn.buf[data..data + step.data]);
            used = data + step.data;
        }
        conn.buf.advance(used);
        if decoder.is_done() {
            return Ok(());
        }
        // A length still to come is read in as few reads as it can be.
        let want = decoder
            .remaining()
            .map_or(4096, |n| n.clamp(4096, 1 << 20) as usize);
        conn.buf.reserve(want);
        match conn.io.read_buf(&mut conn.buf).await {
            Ok(0) => return decoder.at_eof().map_err(ClientError::Framing),
            Ok(_) => {}
            Err(e) => return Err(ClientError::Read(e)),
        }
    }
}
