//! The one decoder of an HTTP/1.1 message body by its framing (RFC 9112 section 6): a
//! length, the chunked coding, or until the connection's end. It holds no buffer and does no
//! I/O: each reader (the client's request body, an endpoint's response relayed or read as
//! frames, the HTTP/1.1 client of health checks and scrapes) hands it the bytes it has read
//! and is told which are framing and which are data, when the body ends, and whether a body
//! over its limit or cut by the connection's end is an error.

use crate::codec::chunked::{ChunkError, ChunkedDecoder};

pub(crate) use crate::codec::chunked::Step;

/// How a message's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body (`HEAD`, 1xx, 204, 304, a request without one).
    Empty,
    /// This many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Until the sender closes the connection (a response only).
    Close,
}

impl Framing {
    /// When the whole body is within the first `buffered` bytes a reader has (no body, or a
    /// length that has all arrived): its length. A reader can then pass it on in one piece,
    /// without following it.
    #[inline]
    pub fn whole_within(self, buffered: usize) -> Option<usize> {
        match self {
            Framing::Empty => Some(0),
            Framing::Length(n) if n <= buffered as u64 => Some(n as usize),
            _ => None,
        }
    }
}

/// Why a body could not be read to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BodyError {
    /// The chunked framing is malformed.
    #[error("chunked body: {0}")]
    Chunked(#[from] ChunkError),
    /// The connection ended before the body did (its length, or its last chunk).
    #[error("connection closed in the middle of the body")]
    Cut,
    /// More data than the reader's limit (its field).
    #[error("body larger than {0} bytes")]
    TooLarge(u64),
}

/// Follows one body as its bytes arrive.
#[derive(Debug, Clone)]
pub(crate) struct BodyDecoder {
    kind: Kind,
    /// Data bytes handed out so far.
    received: u64,
    /// Most data bytes accepted.
    max: u64,
}

#[derive(Debug, Clone)]
enum Kind {
    /// Data bytes still to come (within the limit: checked once, when made).
    Length(u64),
    /// A declared length over the limit: refused before any of it is read.
    TooLong,
    Chunked(ChunkedDecoder),
    /// `true` once the connection ended.
    Close(bool),
}

impl BodyDecoder {
    /// The decoder of a body framed by `framing`, of at most `max` data bytes.
    #[inline]
    pub fn new(framing: Framing, max: u64) -> Self {
        let kind = match framing {
            Framing::Empty => Kind::Length(0),
            Framing::Length(n) if n > max => Kind::TooLong,
            Framing::Length(n) => Kind::Length(n),
            Framing::Chunked => Kind::Chunked(ChunkedDecoder::default()),
            Framing::Close => Kind::Close(false),
        };
        Self {
            kind,
            received: 0,
            max,
        }
    }

    /// True once the whole body has passed.
    #[inline]
    pub fn is_done(&self) -> bool {
        match &self.kind {
            Kind::Length(left) => *left == 0,
            Kind::TooLong => false,
            Kind::Chunked(d) => d.is_done(),
            Kind::Close(ended) => *ended,
        }
    }

    /// Data bytes still to come, when the framing says (a length).
    pub fn remaining(&self) -> Option<u64> {
        match self.kind {
            Kind::Length(left) => Some(left),
            _ => None,
        }
    }

    /// Looks at the next bytes of the body in `input` (which starts where the last step's
    /// bytes ended): framing up to the first data byte, then at most one run of data. The
    /// caller consumes `framing + data` bytes; what follows the body's end is not looked at.
    #[inline]
    pub fn step(&mut self, input: &[u8]) -> Result<Step, BodyError> {
        let step = match &mut self.kind {
            // The common case first, and without counting: its limit was checked once.
            Kind::Length(left) => {
                let n = (input.len() as u64).min(*left);
                *left -= n;
                return Ok(Step {
                    framing: 0,
                    data: n as usize,
                    done: *left == 0,
                });
            }
            Kind::TooLong => return Err(BodyError::TooLarge(self.max)),
            // Past its end the decoder would read the next message's bytes as framing.
            Kind::Chunked(d) if d.is_done() => Step {
                framing: 0,
                data: 0,
                done: true,
            },
            Kind::Chunked(d) => d.step(input)?,
            Kind::Close(ended) => Step {
                framing: 0,
                data: input.len(),
                done: *ended,
            },
        };
        self.received += step.data as u64;
        if self.received > self.max {
            return Err(BodyError::TooLarge(self.max));
        }
        Ok(step)
    }

    /// How many bytes at the start of `input` belong to the body (all of them unless it ends
    /// inside), checked: for passing a body through as it is.
    #[inline]
    pub fn skip(&mut self, input: &[u8]) -> Result<usize, BodyError> {
        let mut used = 0;
        while used < input.len() && !self.is_done() {
            let s = self.step(&input[used..])?;
            used += s.framing + s.data;
        }
        Ok(used)
    }

    /// When `input` (where the last step's bytes ended) holds the rest of a chunked body
    /// with no more data (the last chunk and its trailers): consumes them and gives their
    /// length, so that a reader can end the body with its last data. Else `None` and the
    /// decoder is left as it was.
    pub fn end_within(&mut self, input: &[u8]) -> Option<usize> {
        match &mut self.kind {
            Kind::Chunked(d) => d.end_within(input),
            _ => None,
        }
    }

    /// The connection ended: the end of a body that runs until then, else a cut (unless the
    /// body had already ended).
    pub fn at_eof(&mut self) -> Result<(), BodyError> {
        if let Kind::Close(ended) = &mut self.kind {
            *ended = true;
        }
        if self.is_done() {
            Ok(())
        } else {
            Err(BodyError::Cut)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Decodes `wire` handed over in pieces cut at `cuts`, as a reader would: data bytes, the
    /// bytes that belonged to the body, and whether it ended (the connection ending after
    /// the last piece).
    fn decode(
        framing: Framing,
        max: u64,
        wire: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, usize), BodyError> {
        let mut d = BodyDecoder::new(framing, max);
        let mut data = Vec::new();
        // What the reader has read and not consumed.
        let mut buf: Vec<u8> = Vec::new();
        let mut used = 0;
        let mut from = 0;
        for &cut in cuts.iter().chain([wire.len()].iter()) {
            buf.extend_from_slice(&wire[from..cut.max(from)]);
            from = cut.max(from);
            while !buf.is_empty() && !d.is_done() {
                let s = d.step(&buf)?;
                data.extend_from_slice(&buf[s.framing..s.framing + s.data]);
                buf.drain(..s.framing + s.data);
                used += s.framing + s.data;
                if s.framing + s.data == 0 {
                    break;
                }
            }
        }
        if !d.is_done() {
            d.at_eof()?;
        }
        Ok((data, used))
    }

    fn chunked(pieces: &[&[u8]], trailers: &str) -> Vec<u8> {
        let mut wire = Vec::new();
        let mut line = [0u8; 18];
        for p in pieces {
            for s in crate::codec::chunked::chunk(p, &mut line) {
                wire.extend_from_slice(&s);
            }
        }
        wire.extend_from_slice(b"0\r\n");
        wire.extend_from_slice(trailers.as_bytes());
        wire.extend_from_slice(b"\r\n");
        wire
    }

    #[test]
    fn every_framing_gives_its_data_and_stops_at_its_end() {
        let next = b"GET /next HTTP/1.1\r\n\r\n";
        let with_next = |body: &[u8]| [body, &next[..]].concat();
        // A length: that many bytes, the next request untouched.
        let wire = with_next(b"hello");
        assert_eq!(
            decode(Framing::Length(5), u64::MAX, &wire, &[]),
            Ok((b"hello".to_vec(), 5))
        );
        // Empty and zero-length bodies are done before any byte.
        for f in [Framing::Empty, Framing::Length(0)] {
            let d = BodyDecoder::new(f, 0);
            assert!(d.is_done(), "{f:?}");
            assert_eq!(decode(f, 0, next, &[]), Ok((Vec::new(), 0)));
        }
        // Chunked, with an extension and trailers.
        let body = b"5;x=1\r\nhello\r\n6\r\n world\r\n0\r\nT: t\r\n\r\n";
        assert_eq!(
            decode(Framing::Chunked, u64::MAX, &with_next(body), &[]),
            Ok((b"hello world".to_vec(), body.len()))
        );
        // Until close: everything.
        assert_eq!(
            decode(Framing::Close, u64::MAX, b"all of it", &[3]),
            Ok((b"all of it".to_vec(), 9))
        );
        assert_eq!(Framing::Length(5).whole_within(5), Some(5));
        assert_eq!(Framing::Length(5).whole_within(4), None);
        assert_eq!(Framing::Empty.whole_within(0), Some(0));
        assert_eq!(Framing::Chunked.whole_within(100), None);
        assert_eq!(Framing::Close.whole_within(100), None);
        let mut d = BodyDecoder::new(Framing::Length(7), u64::MAX);
        assert_eq!(d.remaining(), Some(7));
        assert_eq!(d.skip(&with_next(b"1234567")), Ok(7));
        assert!(d.is_done() && d.remaining() == Some(0));
        assert_eq!(BodyDecoder::new(Framing::Chunked, 9).remaining(), None);
    }

    #[test]
    fn a_body_cut_by_the_connection_is_an_error_unless_it_ends_there() {
        assert_eq!(
            decode(Framing::Length(10), u64::MAX, b"short", &[]),
            Err(BodyError::Cut)
        );
        assert_eq!(
            decode(Framing::Chunked, u64::MAX, b"5\r\nhello\r\n", &[]),
            Err(BodyError::Cut)
        );
        let mut d = BodyDecoder::new(Framing::Close, u64::MAX);
        assert!(!d.is_done());
        assert_eq!(d.at_eof(), Ok(()));
        assert!(d.is_done());
        let mut d = BodyDecoder::new(Framing::Length(2), u64::MAX);
        assert_eq!(d.skip(b"ok"), Ok(2));
        assert_eq!(d.at_eof(), Ok(()), "ended before the close");
    }

    #[test]
    fn limits_hold_for_every_framing() {
        // A declared length over the limit fails at once, before its bytes arrive.
        let mut d = BodyDecoder::new(Framing::Length(11), 10);
        assert_eq!(d.step(b""), Err(BodyError::TooLarge(10)));
        assert_eq!(
            decode(Framing::Length(10), 10, &[b'x'; 10], &[4]).map(|(d, _)| d.len()),
            Ok(10)
        );
        let wire = chunked(&[b"hello", b" world"], "");
        assert_eq!(
            decode(Framing::Chunked, 10, &wire, &[]),
            Err(BodyError::TooLarge(10))
        );
        assert_eq!(
            decode(Framing::Chunked, 11, &wire, &[]).map(|(d, _)| d),
            Ok(b"hello world".to_vec())
        );
        assert_eq!(
            decode(Framing::Close, 3, b"four", &[]),
            Err(BodyError::TooLarge(3))
        );
        // Extensions and trailers are bounded too (16 KiB in one body).
        let long = format!("X: {}\r\n", "y".repeat(17 * 1024));
        assert_eq!(
            decode(Framing::Chunked, u64::MAX, &chunked(&[b"a"], &long), &[]),
            Err(BodyError::Chunked(ChunkError::ExtraTooLong))
        );
    }

    #[test]
    fn malformed_chunks_are_refused_with_their_kind() {
        for (wire, why) in [
            (&b"ZZ\r\nhello\r\n0\r\n\r\n"[..], ChunkError::Size),
            (b"\r\n", ChunkError::Size),
            (b"-1\r\n", ChunkError::Size),
            (b"3\r\nhello\r\n", ChunkError::Framing),
            (b"3\nabc\r\n", ChunkError::Size),
            (b"3;ext\nabc\r\n", ChunkError::Framing),
            (b"0\r\nT: t\rX", ChunkError::Framing),
            (b"ffffffffffffffff\r\n", ChunkError::SizeTooLarge),
        ] {
            assert_eq!(
                decode(Framing::Chunked, u64::MAX, wire, &[]),
                Err(BodyError::Chunked(why)),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    proptest! {
        /// A chunked body decoded from pieces cut anywhere (every byte boundary among them)
        /// gives the same data and the same end as when it arrives whole.
        #[test]
        fn chunked_bodies_decode_the_same_however_they_are_cut(
            pieces in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..6),
            trailer in "[a-z]{0,8}",
            mut cuts in prop::collection::vec(0usize..400, 0..8),
        ) {
            let refs: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
            let trailers = if trailer.is_empty() { String::new() } else { format!("X-{trailer}: v\r\n") };
            let body = chunked(&refs, &trailers);
            let wire = [&body[..], b"NEXT"].concat();
            let whole = decode(Framing::Chunked, u64::MAX, &wire, &[]);
            prop_assert_eq!(&whole, &Ok((pieces.concat(), body.len())));
            // Every single cut.
            for cut in 0..=wire.len() {
                prop_assert_eq!(&decode(Framing::Chunked, u64::MAX, &wire, &[cut]), &whole);
            }
            // And several at once.
            for c in &mut cuts {
                *c = (*c).min(wire.len());
            }
            cuts.sort_unstable();
            prop_assert_eq!(&decode(Framing::Chunked, u64::MAX, &wire, &cuts), &whole);
            // Byte by byte.
            let every: Vec<usize> = (1..wire.len()).collect();
            prop_assert_eq!(&decode(Framing::Chunked, u64::MAX, &wire, &every), &whole);
        }
    }
}
