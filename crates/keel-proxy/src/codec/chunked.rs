//! The chunked transfer coding (RFC 9112 section 7.1): a decoder that finds where a chunked
//! body ends and which of its bytes are data, without copying them, and the framing that
//! chunks a body of unknown length.

use std::io::IoSlice;

/// What the next bytes of a chunked body are (see [`ChunkedDecoder::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Step {
    /// Bytes of framing first (sizes, extensions, line ends, trailers): not data.
    pub framing: usize,
    /// Then this many bytes of data.
    pub data: usize,
    /// The body ended with those bytes (the last chunk and its trailers passed).
    pub done: bool,
}

/// A malformed chunked body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ChunkError {
    /// A chunk size that is not hexadecimal, or has no digits.
    #[error("invalid chunk size")]
    Size,
    /// A chunk size over 15 hex digits.
    #[error("chunk size too large")]
    SizeTooLarge,
    /// A chunk size line or a chunk not ended by CRLF.
    #[error("invalid chunk framing")]
    Framing,
    /// More chunk extensions or trailers than accepted.
    #[error("chunk extensions or trailers too long")]
    ExtraTooLong,
}

/// Follows a chunked body as it passes: sizes, extensions, data, trailers.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChunkedDecoder {
    state: State,
    /// Bytes left in the current chunk's data (or its size being read).
    size: u64,
    /// Hex digits seen in the current size line.
    digits: u8,
    /// Bytes of chunk extensions or trailers seen (bounded).
    extra: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    #[default]
    Size,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    TrailerLine,
    TrailerLf,
    EndLf,
    Done,
}

/// Most bytes of chunk extensions and trailers accepted in one body.
const MAX_CHUNK_EXTRA: usize = 16 * 1024;

impl ChunkedDecoder {
    /// True once the last chunk and the trailers have passed.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Looks at the next bytes of the body in `input` (which starts where the last step's
    /// bytes ended): framing up to the first data byte, then at most one run of data. The
    /// caller consumes `framing + data` bytes. A step with `framing + data < input.len()` and
    /// not `done` cannot happen: all of `input` is looked at unless data or the end stops it.
    pub fn step(&mut self, input: &[u8]) -> Result<Step, ChunkError> {
        let mut i = 0;
        while i < input.len() {
            if self.state == State::Data {
                let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                self.size -= n as u64;
                if self.size == 0 {
                    self.state = State::DataCr;
                }
                return Ok(Step {
                    framing: i,
                    data: n,
                    done: false,
                });
            }
            self.framing_byte(input[i])?;
            i += 1;
            if self.state == State::Done {
                return Ok(Step {
                    framing: i,
                    data: 0,
                    done: true,
                });
            }
        }
        Ok(Step {
            framing: i,
            data: 0,
            done: self.is_done(),
        })
    }

    /// When `input` (where the last step's bytes ended) holds the rest of the body with no
    /// more data, the last chunk and trailers: consumes them and gives their length. Else
    /// the decoder is left as it was (more data follows, the end is not all here, or it is
    /// malformed: the next `step` says so).
    pub fn end_within(&mut self, input: &[u8]) -> Option<usize> {
        let mut ahead = self.clone();
        match ahead.step(input) {
            Ok(Step {
                framing,
                data: 0,
                done: true,
            }) => {
                *self = ahead;
                Some(framing)
            }
            _ => None,
        }
    }

    fn framing_byte(&mut self, b: u8) -> Result<(), ChunkError> {
        match self.state {
            State::Size => match b {
                b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                    let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                    self.digits += 1;
                    if self.digits > 15 {
                        return Err(ChunkError::SizeTooLarge);
                    }
                    self.size = self.size * 16 + d;
                }
                b';' | b' ' | b'\t' if self.digits > 0 => self.state = State::Extension,
                b'\r' if self.digits > 0 => self.state = State::SizeLf,
                _ => return Err(ChunkError::Size),
            },
            State::Extension => match b {
                b'\r' => self.state = State::SizeLf,
                b'\n' => return Err(ChunkError::Framing),
                _ => self.count_extra()?,
            },
            State::SizeLf => {
                if b != b'\n' {
                    return Err(ChunkError::Framing);
                }
                self.digits = 0;
                self.state = if self.size == 0 {
                    State::TrailerStart
                } else {
                    State::Data
                };
            }
            State::DataCr | State::DataLf => {
                let want = if self.state == State::DataCr {
                    b'\r'
                } else {
                    b'\n'
                };
                if b != want {
                    return Err(ChunkError::Framing);
                }
                self.state = if self.state == State::DataCr {
                    State::DataLf
                } else {
                    State::Size
                };
            }
            State::TrailerStart => {
                self.state = if b == b'\r' {
                    State::EndLf
                } else {
                    State::TrailerLine
                };
            }
            State::TrailerLine => {
                self.count_extra()?;
                if b == b'\r' {
                    self.state = State::TrailerLf;
                }
            }
            State::TrailerLf => {
                if b != b'\n' {
                    return Err(ChunkError::Framing);
                }
                self.state = State::TrailerStart;
            }
            State::EndLf => {
                if b != b'\n' {
                    return Err(ChunkError::Framing);
                }
                self.state = State::Done;
            }
            // `step` never feeds data or bytes after the end.
            State::Data | State::Done => {}
        }
        Ok(())
    }

    fn count_extra(&mut self) -> Result<(), ChunkError> {
        self.extra += 1;
        if self.extra > MAX_CHUNK_EXTRA {
            return Err(ChunkError::ExtraTooLong);
        }
        Ok(())
    }
}

/// The size line of a chunk of `len` bytes (`len` in hex, CRLF), written into `buf`; returns
/// its bytes.
pub(crate) fn size_line(len: usize, buf: &mut [u8; 18]) -> &[u8] {
    let mut i = 16;
    let mut n = len;
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            break;
        }
    }
    buf[16] = b'\r';
    buf[17] = b'\n';
    &buf[i..]
}

/// The slices that send `data` as one chunk (none for empty data: an empty chunk would end
/// the body).
pub(crate) fn chunk<'a>(data: &'a [u8], line: &'a mut [u8; 18]) -> [IoSlice<'a>; 3] {
    if data.is_empty() {
        return [IoSlice::new(&[]), IoSlice::new(&[]), IoSlice::new(&[])];
    }
    [
        IoSlice::new(size_line(data.len(), line)),
        IoSlice::new(data),
        IoSlice::new(b"\r\n"),
    ]
}

/// The last chunk, with no trailers.
pub(crate) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes pieces in order: (data, bytes that belonged to the body, done).
    fn decode_all(pieces: &[&[u8]]) -> Result<(Vec<u8>, usize, bool), ChunkError> {
        let mut d = ChunkedDecoder::default();
        let mut data = Vec::new();
        let mut used = 0;
        for p in pieces {
            let mut at = 0;
            while at < p.len() && !d.is_done() {
                let s = d.step(&p[at..])?;
                data.extend_from_slice(&p[at + s.framing..at + s.framing + s.data]);
                at += s.framing + s.data;
            }
            used += at;
        }
        Ok((data, used, d.is_done()))
    }

    #[test]
    fn chunked_bodies_are_followed_across_any_split() {
        let body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\nNEXT";
        let whole = decode_all(&[body]).unwrap();
        assert_eq!(whole, (b"hello world".to_vec(), body.len() - 4, true));
        // Every split into two pieces gives the same data and the same end.
        for cut in 1..body.len() {
            let (a, b) = body.split_at(cut);
            assert_eq!(decode_all(&[a, b]).unwrap(), whole, "cut at {cut}");
        }
        // After a chunk's data: the end found when all of it is there, and only then.
        for (rest, end) in [
            (&b"\r\n0\r\nX-Trailer: t\r\n\r\nNEXT"[..], Some(21)), // all but NEXT
            (b"\r\n0\r\n", None),
            (b"\r\n6\r\n world\r\n0\r\n\r\n", None),
            (b"XX", None),
        ] {
            let mut d = ChunkedDecoder::default();
            assert_eq!(d.step(b"5\r\nhello").unwrap().data, 5);
            assert_eq!(
                d.end_within(rest),
                end,
                "{:?}",
                String::from_utf8_lossy(rest)
            );
            assert_eq!(d.is_done(), end.is_some());
        }
        let (data, _, done) = decode_all(&[b"5\r\nhel"]).unwrap();
        assert_eq!((data, done), (b"hel".to_vec(), false));
        for bad in [
            &b"ZZ\r\nhello\r\n0\r\n\r\n"[..],
            b"3\r\nhello\r\n",
            b"\r\n",
            b"ffffffffffffffff\r\n",
            b"3\nabc\r\n",
        ] {
            assert!(
                decode_all(&[bad]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn chunks_are_framed_as_they_decode() {
        let mut line = [0u8; 18];
        let mut framed = Vec::new();
        for piece in [&b"hello"[..], &[b'x'; 300][..], b""] {
            for s in chunk(piece, &mut line) {
                framed.extend_from_slice(&s);
            }
        }
        framed.extend_from_slice(LAST_CHUNK);
        assert!(framed.starts_with(b"5\r\nhello\r\n12c\r\nxxx"));
        let (data, used, done) = decode_all(&[&framed]).unwrap();
        assert_eq!((data.len(), used, done), (305, framed.len(), true));
    }
}
