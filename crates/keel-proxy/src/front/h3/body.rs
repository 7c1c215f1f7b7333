//! An HTTP/3 client's request body, as the legs read it: streamed from the request's QUIC
//! stream, each piece awaited within the body's bounds (`Upload`, as the other front ends);
//! its first `MAX_INLINE_BODY` bytes kept so that a try that failed before its endpoint acted
//! can send them again.

use std::pin::Pin;

use bytes::{Buf, Bytes};
use h3::server::RequestStream;

use crate::exchange::request::{Reject, RequestBody, Upload};
use crate::front::h2::body::MAX_INLINE_BODY;

/// The receiving half of a request's stream.
pub(crate) type RecvHalf = RequestStream<h3_quinn::RecvStream, Bytes>;

/// The next DATA of a request's stream (`None` at its end); an error is the client's fault.
pub(crate) async fn next_data(recv: &mut RecvHalf) -> Result<Option<Bytes>, Reject> {
    match recv.recv_data().await {
        Ok(Some(mut buf)) => Ok(Some(buf.copy_to_bytes(buf.remaining()))),
        Ok(None) => Ok(None),
        Err(_) => Err(Reject::InvalidBody),
    }
}

/// A request body streamed from an HTTP/3 client.
pub(crate) struct ClientBody<'p> {
    recv: RecvHalf,
    /// A piece read before the body was handed to the leg (to learn whether there was one).
    first: Option<Bytes>,
    piece: Bytes,
    started: bool,
    upload: Upload<'p>,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    received: u64,
    max: u64,
    recorded: Vec<u8>,
    overflowed: bool,
    replay: bool,
    ended: bool,
    trailers: Option<hyper::HeaderMap>,
}

impl<'p> ClientBody<'p> {
    pub(crate) fn new(recv: RecvHalf, first: Option<Bytes>, max: u64, upload: Upload<'p>) -> Self {
        Self {
            recv,
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

impl RequestBody for ClientBody<'_> {
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
            match self.upload.read(timer, next_data(&mut self.recv)).await? {
                Err(reject) => return Err(reject),
                Ok(None) => {
                    self.ended = true;
                    // Trailers go to HTTP/2 endpoints (HTTP/1.1 ones get none).
                    self.trailers = self.recv.recv_trailers().await.ok().flatten();
                    return Ok(&[]);
                }
                Ok(Some(data)) if data.is_empty() => continue,
                Ok(Some(data)) => return self.take(data),
            }
        }
    }
}
