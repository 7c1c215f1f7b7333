//! Bodies between a client's HTTP/1.1 connection and an endpoint's: the client's request body
//! as the leg streams it ([`ClientBody`]), and the endpoint's response on its way to the
//! client: an HTTP/1.1 endpoint's body passed through as it arrives ([`relay_response`], no
//! decoding, no copy), any other leg's response rendered frame by frame ([`relay_frames`]).

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::time::Instant;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Sleep;

use crate::codec::body::{BodyDecoder, BodyError, Framing};
use crate::codec::chunked::{chunk, LAST_CHUNK};
use crate::codec::response::{push_framing, push_status_line};
use crate::codec::{parse_content_length, push_date, push_header};
use crate::exchange::error::BodyEnd;
use crate::exchange::request::RequestHead;
use crate::exchange::request::Upload;
use crate::exchange::request::{BodyFraming, Reject, RequestBody};
use crate::io::{until, write_all_2, write_all_vectored, BodyIdle};
use crate::leg::ResponseBody;
use crate::upstream::pool::RawConn;
use hyper::header::HeaderValue;

/// A request body streamed from the client as the leg asks for it: a piece at a time from
/// the connection's read buffer, each read within the body's bounds (`Upload`, shared with
/// the HTTP/2 front end), its framing followed by the codec's decoder. Chunked bodies are
/// decoded (the leg frames them again);
/// `100 Continue` goes out before the first read when the client waits for it.
pub(crate) struct ClientBody<'c, S> {
    pub stream: &'c mut S,
    /// Bytes read from the client; the body (then any pipelined request) at its front.
    pub rbuf: &'c mut BytesMut,
    pub timer: &'c mut Pin<Box<Sleep>>,
    decoder: BodyDecoder,
    /// Bytes of the last piece, consumed at the next call.
    pending: usize,
    started: bool,
    expect_continue: bool,
    /// The reads' bounds, and the driver's try clock they report to.
    upload: Upload<'c>,
}

impl<'c, S: AsyncRead + AsyncWrite + Unpin> ClientBody<'c, S> {
    /// A body of `framing` at the front of `rbuf`, at most `max` bytes.
    pub fn new(
        stream: &'c mut S,
        rbuf: &'c mut BytesMut,
        timer: &'c mut Pin<Box<Sleep>>,
        upload: Upload<'c>,
        framing: BodyFraming,
        max: u64,
        expect_continue: bool,
    ) -> Self {
        let wire = match framing {
            BodyFraming::None => Framing::Empty,
            BodyFraming::Length(n) => Framing::Length(n),
            BodyFraming::Chunked => Framing::Chunked,
        };
        Self {
            stream,
            rbuf,
            timer,
            decoder: BodyDecoder::new(wire, max),
            pending: 0,
            started: false,
            expect_continue,
            upload,
        }
    }

    /// True once the whole body was read: the connection can carry another request.
    pub fn finished(&self) -> bool {
        self.decoder.is_done() && self.pending == 0
    }

    async fn read_more(&mut self) -> Result<(), Reject> {
        if self.expect_continue {
            self.expect_continue = false;
            write_all_2(self.stream, b"HTTP/1.1 100 Continue\r\n\r\n", &[])
                .await
                .map_err(|_| Reject::InvalidBody)?;
        }
        self.rbuf.reserve(16 * 1024);
        let read = self.stream.read_buf(self.rbuf);
        match self.upload.read(self.timer, read).await? {
            Ok(n) if n > 0 => {
                self.upload.received(n as u64);
                Ok(())
            }
            _ => Err(Reject::InvalidBody),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> RequestBody for ClientBody<'_, S> {
    fn started(&self) -> bool {
        self.started
    }

    fn waiting_on_client(&self) -> bool {
        self.upload.reading()
    }

    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        self.started = true;
        self.rbuf.advance(std::mem::take(&mut self.pending));
        let data = loop {
            if self.decoder.is_done() {
                return Ok(&[]);
            }
            if !self.rbuf.is_empty() {
                let step = self.decoder.step(self.rbuf).map_err(|e| match e {
                    BodyError::TooLarge(_) => Reject::BodyTooLarge,
                    _ => Reject::InvalidBody,
                })?;
                self.rbuf.advance(step.framing);
                if step.data > 0 {
                    break step.data;
                }
                if step.done {
                    return Ok(&[]);
                }
            }
            self.read_more().await?;
        };
        self.pending = data;
        Ok(&self.rbuf[..data])
    }
}

/// Why relaying a response body stopped early.
#[derive(Debug)]
pub(crate) enum RelayError {
    /// The endpoint failed or sent a malformed body.
    Upstream(String),
    /// The endpoint's body was malformed from its first bytes, before any byte reached the
    /// client: keel can still answer `502` instead of cutting a response never begun.
    UpstreamBeforeHead(String),
    /// The client went away.
    Client,
    /// The endpoint sent nothing for `upstream_idle_timeout`.
    UpstreamIdle,
    /// The client took nothing for `client_idle_timeout`.
    ClientIdle,
}

/// One write to the client within the client's idle limit.
async fn to_client<F: std::future::Future<Output = io::Result<()>>>(
    timer: &mut Pin<Box<Sleep>>,
    idle: BodyIdle,
    write: F,
) -> Result<(), RelayError> {
    match until(timer, Instant::now() + idle.client, write).await {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => {
            tracing::debug!("client went away while its response was sent: {e}");
            Err(RelayError::Client)
        }
        None => Err(RelayError::ClientIdle),
    }
}

/// One read from the endpoint within its idle limit.
async fn from_upstream<F: std::future::Future<Output = Result<(), RelayError>>>(
    timer: &mut Pin<Box<Sleep>>,
    idle: BodyIdle,
    read: F,
) -> Result<(), RelayError> {
    until(timer, Instant::now() + idle.upstream, read)
        .await
        .unwrap_or(Err(RelayError::UpstreamIdle))
}

/// Sends the response head `head` and the body that `framing` delimits on `conn` to the
/// client: the bytes already read go out with the head, the rest as it arrives. Bodies without
/// a length go to HTTP/1.1 clients chunked (passed through as the endpoint chunked them, or
/// chunked here when it ends the body by closing); to HTTP/1.0 clients as they are.
pub(crate) async fn relay_response<W: AsyncWrite + Unpin>(
    client: &mut W,
    head: &[u8],
    conn: &mut RawConn,
    framing: Framing,
    chunked_to_client: bool,
    timer: &mut Pin<Box<Sleep>>,
    idle: BodyIdle,
) -> Result<(), RelayError> {
    // The common answer: a small body the leg read whole, sent with its head in one write.
    if let Some(n) = framing.whole_within(conn.buf.len()) {
        to_client(timer, idle, write_all_2(client, head, &conn.buf[..n])).await?;
        conn.buf.advance(n);
        return Ok(());
    }
    let mut head = head;
    let mut decoder = BodyDecoder::new(framing, u64::MAX);
    // Chunks pass through as they are, checked on the way; a body that ends with the
    // connection is chunked here; any other body goes as its data (an HTTP/1.0 client's then
    // ends with the connection).
    let pass_chunks = chunked_to_client && framing == Framing::Chunked;
    let chunk_here = chunked_to_client && framing == Framing::Close;
    let mut line = [0u8; 18];
    loop {
        if pass_chunks {
            let used = decoder.skip(&conn.buf).map_err(|e| failed(head, e))?;
            to_client(timer, idle, write_all_2(client, head, &conn.buf[..used])).await?;
            conn.buf.advance(used);
        } else {
            loop {
                let step = decoder.step(&conn.buf).map_err(|e| failed(head, e))?;
                let data = &conn.buf[step.framing..step.framing + step.data];
                if chunk_here {
                    let [size, data, end] = chunk(data, &mut line);
                    let mut all = [IoSlice::new(head), size, data, end];
                    to_client(timer, idle, async {
                        write_all_vectored(client, &mut all).await?;
                        client.flush().await
                    })
                    .await?;
                } else {
                    to_client(timer, idle, write_all_2(client, head, data)).await?;
                }
                head = &[];
                conn.buf.advance(step.framing + step.data);
                if step.done || conn.buf.is_empty() {
                    break;
                }
            }
        }
        head = &[];
        if decoder.is_done() {
            break;
        }
        from_upstream(timer, idle, read_more(conn, &mut decoder)).await?;
    }
    if chunk_here {
        to_client(timer, idle, write_all_2(client, LAST_CHUNK, &[])).await?;
    }
    Ok(())
}

/// A malformed body, told apart by whether the head (still in `head`) was sent.
fn failed(head: &[u8], e: impl std::fmt::Display) -> RelayError {
    if head.is_empty() {
        RelayError::Upstream(e.to_string())
    } else {
        RelayError::UpstreamBeforeHead(e.to_string())
    }
}

/// Reads more of a body the endpoint has not finished; its end of stream is the end of a
/// body that runs until then, else a cut.
async fn read_more(conn: &mut RawConn, decoder: &mut BodyDecoder) -> Result<(), RelayError> {
    if conn.buf.capacity() - conn.buf.len() < 4096 {
        conn.buf.reserve(16 * 1024);
    }
    match conn.io.read_buf(&mut conn.buf).await {
        Ok(0) => decoder
            .at_eof()
            .map_err(|e| RelayError::Upstream(e.to_string())),
        Ok(_) => Ok(()),
        Err(e) => Err(RelayError::Upstream(e.to_string())),
    }
}

/// Sends a response that is not an HTTP/1.1 endpoint's own (an HTTP/2 endpoint's, say) to
/// an HTTP/1.1 client: the head rendered as HTTP/1.1 (with `endpoint` as `x-keel-endpoint`,
/// and the framing), the body's frames as they come (chunked unless its length is known; as
/// they are to an HTTP/1.0 client, ending with the connection), the trailers in the chunked
/// body's trailer section. Returns how the body ended and whether the client connection may
/// stay open.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn relay_frames<W: AsyncWrite + Unpin>(
    client: &mut W,
    out: &mut Vec<u8>,
    head: &hyper::http::response::Parts,
    body: &mut ResponseBody,
    endpoint: Option<&HeaderValue>,
    req: &RequestHead,
    keep_alive: bool,
    idle: BodyIdle,
) -> (BodyEnd, bool) {
    // Each read from the endpoint and each write to the client within its side's idle limit
    // (a timeout whose inner future is ready at once registers no timer).
    use tokio::time::timeout;
    let status = head.status.as_u16();
    let length = head
        .headers
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| parse_content_length(v.as_bytes()));
    let empty = req.is_head || status == 204 || status == 304;
    // A body of unknown length is chunked, or ends with the connection (HTTP/1.0).
    let framing = match length {
        _ if empty => Framing::Empty,
        Some(n) => Framing::Length(n),
        None => Framing::Chunked,
    };
    let chunked = framing == Framing::Chunked && !req.http10;
    let keep = keep_alive && (chunked || framing != Framing::Chunked);
    out.clear();
    push_status_line(out, status, head.status.canonical_reason().unwrap_or(""));
    for (name, value) in &head.headers {
        if name != hyper::header::CONTENT_LENGTH || empty {
            push_header(out, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    if let Some(e) = endpoint {
        push_header(out, b"x-keel-endpoint", e.as_bytes());
    }
    if !head.headers.contains_key(hyper::header::DATE) {
        push_date(out);
    }
    push_framing(out, framing, req.http10, keep);
    if !matches!(
        timeout(idle.client, client.write_all(out)).await,
        Ok(Ok(()))
    ) {
        return (BodyEnd::ClientGone, false);
    }
    let mut line = [0u8; 18];
    let mut trailers_sent = false;
    loop {
        let Ok(frame) = timeout(idle.upstream, poll_fn(|cx| body.poll_frame(cx))).await else {
            tracing::debug!(
                "response body: nothing from the endpoint for {:?}",
                idle.upstream
            );
            return (BodyEnd::Timeout, false);
        };
        let written = match frame {
            None => break,
            Some(Err(e)) => {
                tracing::debug!("response body failed: {e}");
                return (BodyEnd::UpstreamFailed, false);
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if empty || data.is_empty() => Ok(()),
                Ok(data) if chunked => timeout(
                    idle.client,
                    write_all_vectored(client, &mut chunk(&data, &mut line)),
                )
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
                Ok(data) => timeout(idle.client, client.write_all(&data))
                    .await
                    .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) if chunked => {
                        trailers_sent = true;
                        out.clear();
                        out.extend_from_slice(b"0\r\n");
                        for (name, value) in &trailers {
                            push_header(out, name.as_str().as_bytes(), value.as_bytes());
                        }
                        out.extend_from_slice(b"\r\n");
                        client.write_all(out).await
                    }
                    _ => Ok(()),
                },
            },
        };
        if written.is_err() {
            return (BodyEnd::ClientGone, false);
        }
    }
    if chunked && !trailers_sent && client.write_all(LAST_CHUNK).await.is_err() {
        return (BodyEnd::ClientGone, false);
    }
    if client.flush().await.is_err() {
        return (BodyEnd::ClientGone, false);
    }
    (body.end(), keep)
}
