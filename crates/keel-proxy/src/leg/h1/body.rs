//! An HTTP/1.1 endpoint's response body as data frames: its framing (a length, chunks, or the
//! connection's end) followed by the codec's decoder, and the data handed out as slices of the
//! connection's buffer (no copy). The HTTP/1.1 front end relays such a body to an HTTP/1.1
//! client as it is (`front/h1/relay.rs`, no decoding); every other renderer reads it here.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes};
use hyper::body::SizeHint;
use tokio::io::{AsyncRead, ReadBuf};

use crate::codec::body::{BodyDecoder, BodyError, Framing};
use crate::codec::response::ResponseHead;
use crate::upstream::pool::RawConn;

/// Why an HTTP/1.1 response body could not be read to its end.
#[derive(Debug, thiserror::Error)]
pub(crate) enum H1BodyError {
    /// The framing is malformed, or the connection ended before the body's end.
    #[error("{0}")]
    Framing(#[source] BodyError),
    /// Reading the connection failed.
    #[error("{0}")]
    Read(#[source] io::Error),
}

/// The body of a response read from an endpoint's HTTP/1.1 connection.
pub(crate) struct H1Body {
    conn: Option<RawConn>,
    framing: Framing,
    decoder: BodyDecoder,
    /// The endpoint keeps the connection open after the body.
    keep_alive: bool,
}

impl H1Body {
    /// The body that `head` announces, on `conn` (whose buffer holds what was read past the
    /// head).
    pub(crate) fn new(conn: RawConn, head: &ResponseHead) -> Self {
        Self {
            conn: Some(conn),
            framing: head.framing,
            decoder: BodyDecoder::new(head.framing, u64::MAX),
            keep_alive: head.keep_alive,
        }
    }

    /// The next piece of data: `Ok(None)` at the end of the body.
    pub(crate) fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, H1BodyError>> {
        let Some(conn) = self.conn.as_mut() else {
            return Poll::Ready(Ok(None));
        };
        loop {
            if self.decoder.is_done() {
                return Poll::Ready(Ok(None));
            }
            if !conn.buf.is_empty() {
                let step = self.decoder.step(&conn.buf).map_err(H1BodyError::Framing)?;
                conn.buf.advance(step.framing);
                if step.data > 0 {
                    let data = conn.buf.split_to(step.data).freeze();
                    // The last chunk read with this data: the body ends with this piece.
                    if let Some(end) = self.decoder.end_within(&conn.buf) {
                        conn.buf.advance(end);
                    }
                    return Poll::Ready(Ok(Some(data)));
                }
                if step.done {
                    return Poll::Ready(Ok(None));
                }
            }
            match poll_read_buf(conn, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    // The end of a body that runs until then; else a cut.
                    self.decoder.at_eof().map_err(H1BodyError::Framing)?;
                    self.keep_alive = false;
                    return Poll::Ready(Ok(None));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(H1BodyError::Read(e))),
            }
        }
    }

    /// True once the body was handed out whole (a declared length, or chunks whose last
    /// chunk came with the last data): its renderer can end the client's stream with the
    /// last piece. A close-delimited body ends only when the connection does.
    pub(crate) fn is_end_stream(&self) -> bool {
        match self.framing {
            Framing::Length(_) | Framing::Chunked => self.decoder.is_done(),
            _ => false,
        }
    }

    /// What is known of the body's length.
    pub(crate) fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(_) => SizeHint::with_exact(self.decoder.remaining().unwrap_or(0)),
            Framing::Empty => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }

    /// The connection, for its pool, if the endpoint keeps it open (the caller gives it back
    /// only after a body read to its end).
    pub(crate) fn reusable(&mut self) -> Option<RawConn> {
        self.conn.take().filter(|_| self.keep_alive)
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
