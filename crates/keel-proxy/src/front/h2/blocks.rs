//! The clock of an HTTP/2 connection's open header block. A header block (HEADERS, then any
//! CONTINUATION frames, until END_HEADERS) stops the whole connection until it ends: no other
//! frame may come between, and no request exists before its last byte. The `h2` crate waits
//! for it without a limit, so a client that sends half a block and goes quiet would hold its
//! connection (and a `max_connections` slot) for ever. [`HeaderBlocks`] reads the frame
//! headers as the bytes pass to `h2` and fails the connection's reads and writes once a block
//! has been open for `header_read_timeout`, the limit an HTTP/1.1 head has.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The client's connection preface, which comes before its first frame.
const PREFACE_LEN: u8 = 24;
const HEADERS: u8 = 0x1;
const PUSH_PROMISE: u8 = 0x5;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;

/// A client connection whose reads are scanned for header blocks (frame headers only: a
/// payload is skipped by its length).
pub(crate) struct HeaderBlocks<I> {
    inner: I,
    limit: Duration,
    /// Preface bytes still to come.
    preface: u8,
    /// The frame header being read, and how many of its 9 bytes have come.
    head: [u8; 9],
    have: u8,
    /// Payload bytes of the current frame still to come.
    payload: u32,
    /// The current frame carries END_HEADERS.
    ends_block: bool,
    /// A header block has begun and not ended.
    open: bool,
    /// When the open block must end; set at the end of the read that left it open (most
    /// blocks end in the read that began them, and cost no clock reading).
    due: Option<Instant>,
    /// Wakes the connection at `due`; made the first time a block stays open across reads.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<I> HeaderBlocks<I> {
    pub(crate) fn new(inner: I, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            preface: PREFACE_LEN,
            head: [0; 9],
            have: 0,
            payload: 0,
            ends_block: false,
            open: false,
            due: None,
            timer: None,
        }
    }

    /// Follows the frames through bytes just read.
    fn scan(&mut self, mut b: &[u8]) {
        while !b.is_empty() {
            if self.preface > 0 {
                let n = b.len().min(self.preface as usize);
                self.preface -= n as u8;
                b = &b[n..];
            } else if self.payload > 0 {
                let n = b.len().min(self.payload as usize);
                self.payload -= n as u32;
                b = &b[n..];
                if self.payload == 0 && self.ends_block {
                    self.open = false;
                }
            } else {
                let have = self.have as usize;
                let n = b.len().min(9 - have);
                self.head[have..have + n].copy_from_slice(&b[..n]);
                self.have += n as u8;
                b = &b[n..];
                if self.have == 9 {
                    self.have = 0;
                    self.frame();
                }
            }
        }
    }

    /// A whole frame header has come.
    fn frame(&mut self) {
        let h = &self.head;
        self.payload = u32::from_be_bytes([0, h[0], h[1], h[2]]);
        let (kind, flags) = (h[3], h[4]);
        self.ends_block = false;
        if matches!(kind, HEADERS | PUSH_PROMISE | CONTINUATION) {
            self.open = true;
            self.ends_block = flags & END_HEADERS != 0;
            if self.payload == 0 && self.ends_block {
                self.open = false;
            }
        }
    }

    /// After a read: starts the clock of a block left open, stops it when none is.
    fn settle(&mut self) {
        match (self.open, self.due) {
            (true, None) => {
                let due = Instant::now() + self.limit;
                self.due = Some(due);
                match &mut self.timer {
                    Some(t) => t.as_mut().reset(due),
                    None => self.timer = Some(Box::pin(tokio::time::sleep_until(due))),
                }
            }
            (false, Some(_)) => self.due = None,
            _ => {}
        }
    }

    fn overdue(&self) -> bool {
        self.due.is_some_and(|due| Instant::now() >= due)
    }

    fn cut(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "a header block not finished within {} (header_read_timeout)",
                humantime::format_duration(self.limit)
            ),
        )
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for HeaderBlocks<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.due.is_some() {
            if let Some(t) = &mut this.timer {
                if t.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(this.cut()));
                }
            }
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read {
            this.scan(&buf.filled()[before..]);
            this.settle();
        }
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for HeaderBlocks<I> {
    // A connection that stops reading holds `h2` in its writes; the deadline is checked there
    // too, so that the timer's wake-up ends it either way.
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.overdue() {
            return Poll::Ready(Err(this.cut()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.overdue() {
            return Poll::Ready(Err(this.cut()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.overdue() {
            return Poll::Ready(Err(this.cut()));
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, len: u32) -> Vec<u8> {
        let l = len.to_be_bytes();
        let mut f = vec![l[1], l[2], l[3], kind, flags, 0, 0, 0, 1];
        f.resize(9 + len as usize, 0);
        f
    }

    fn blocks() -> HeaderBlocks<()> {
        let mut b = HeaderBlocks::new((), Duration::from_secs(1));
        b.scan(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        b
    }

    #[test]
    fn a_block_is_open_from_its_headers_frame_to_the_end_of_its_last_continuation() {
        let mut b = blocks();
        b.scan(&frame(0x4, 0, 6)); // SETTINGS
        assert!(!b.open);
        let headers = frame(HEADERS, 0, 10);
        b.scan(&headers[..12]);
        assert!(b.open);
        b.scan(&headers[12..]);
        assert!(b.open, "no END_HEADERS yet");
        let last = frame(CONTINUATION, END_HEADERS, 5);
        for byte in &last[..last.len() - 1] {
            b.scan(std::slice::from_ref(byte));
        }
        assert!(b.open, "a byte of the last CONTINUATION is still to come");
        b.scan(&last[last.len() - 1..]);
        assert!(!b.open);
        // One frame, whole, in one read; then data passes by its length.
        let mut both = frame(HEADERS, END_HEADERS, 30);
        both.extend(frame(0x0, 0, 100));
        b.scan(&both);
        assert!(!b.open && b.payload == 0 && b.have == 0);
    }
}
