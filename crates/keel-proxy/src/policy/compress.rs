//! Response compression (`compression` on a route or a cluster): which coding a client's
//! `Accept-Encoding` takes, whether a response may be compressed (its status, type, length and
//! the endpoint's own say), and the encoders, fed a piece of the body at a time.
//!
//! The body's transform is `leg::ResponseBody::Compressed`, one for both front ends; this
//! file knows nothing of legs or front ends.

use std::io::Write;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::Frame;

use crate::config::{Coding, CompressionConfig};
use crate::exchange::head::HeadView;
use crate::exchange::request::RequestHead;

/// A route's or cluster's compression, compiled at reload.
#[derive(Debug)]
pub(crate) struct Compression {
    codings: Vec<Coding>,
    gzip_level: u32,
    brotli_level: u32,
    zstd_level: i32,
    min_length: u64,
    /// Media types, lower case: `text/html`, `text/` (a whole type), or `` (every type).
    types: Vec<String>,
}

/// What a request allows: compression applies to its response (`Vary` is due), and the coding
/// its client takes, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Offer {
    /// The coding the response may be sent in; `None`: as it is.
    pub coding: Option<Coding>,
}

impl Compression {
    /// The compression `config` sets up; `None` when it is off.
    pub fn new(config: &CompressionConfig) -> Option<Self> {
        if !config.enabled {
            return None;
        }
        let types = config
            .types
            .iter()
            .map(|t| {
                let t = t.to_ascii_lowercase();
                match t.as_str() {
                    "*" | "*/*" => String::new(),
                    _ => t.strip_suffix('*').map_or(t.clone(), str::to_string),
                }
            })
            .collect();
        Some(Compression {
            codings: config.algorithms.clone(),
            gzip_level: config.gzip_level,
            brotli_level: config.brotli_level,
            zstd_level: config.zstd_level,
            min_length: config.min_length,
            types,
        })
    }

    /// Reads the client's request (as it came, before any rewrite): the coding its
    /// `Accept-Encoding` weighs highest among those offered (ties go to the first offered),
    /// none for a `HEAD`, a range request or an HTTP/1.0 client.
    pub fn offer(&self, head: HeadView<'_>, meta: &RequestHead) -> Offer {
        let plain = meta.is_head || meta.http10 || head.value("range").is_some();
        let coding = if plain {
            None
        } else {
            let mut q = Weights::default();
            head.find_value("accept-encoding", |v| {
                q.read(v);
                None::<()>
            });
            q.best(&self.codings)
        };
        Offer { coding }
    }

    /// Whether a response of `status` with these headers is one to compress (`header` gives
    /// the first value of a name; `length` the body's, if known): a status NGINX compresses
    /// (200, 403, 404), no `Content-Encoding`, no `Cache-Control: no-transform`, a type of
    /// `types`, and no fewer bytes than `min_length`.
    pub fn applies<'a>(
        &self,
        status: u16,
        length: Option<u64>,
        header: impl Fn(&str) -> Option<&'a [u8]>,
    ) -> bool {
        if !matches!(status, 200 | 403 | 404) || length.is_some_and(|n| n < self.min_length) {
            return false;
        }
        if header("content-encoding").is_some() {
            return false;
        }
        if header("cache-control").is_some_and(|v| {
            v.split(|b| *b == b',')
                .any(|d| d.trim_ascii().eq_ignore_ascii_case(b"no-transform"))
        }) {
            return false;
        }
        let Some(ty) = header("content-type") else {
            return false;
        };
        let ty = ty
            .split(|b| *b == b';')
            .next()
            .unwrap_or_default()
            .trim_ascii();
        self.types.iter().any(|t| {
            if t.ends_with('/') || t.is_empty() {
                ty.len() >= t.len() && ty[..t.len()].eq_ignore_ascii_case(t.as_bytes())
            } else {
                ty.eq_ignore_ascii_case(t.as_bytes())
            }
        })
    }

    /// A new encoder for `coding` at its configured level.
    pub fn encoder(&self, coding: Coding) -> std::io::Result<Encoder> {
        let out = Vec::with_capacity(OUT_CHUNK);
        let inner = match coding {
            Coding::Gzip => Inner::Gzip(flate2::write::GzEncoder::new(
                out,
                flate2::Compression::new(self.gzip_level),
            )),
            Coding::Brotli => Inner::Brotli(Box::new(brotli::CompressorWriter::new(
                out,
                4096,
                self.brotli_level,
                BROTLI_WINDOW,
            ))),
            Coding::Zstd => {
                let mut e = zstd::stream::write::Encoder::new(out, self.zstd_level)?;
                e.window_log(ZSTD_WINDOW)?;
                Inner::Zstd(e)
            }
        };
        Ok(Encoder { inner: Some(inner) })
    }
}

/// brotli's window: 2^18 bytes (256 KiB, not its default 4 MiB), so that a response's encoder
/// stays small; web pages lose little by it.
const BROTLI_WINDOW: u32 = 18;
/// zstd's window: 2^20 bytes (its level 3 would take 2 MiB).
const ZSTD_WINDOW: u32 = 20;

/// Bytes of compressed output gathered before they are handed on as a frame (a body read in
/// large pieces is sent in frames about this big; a stalled one at once).
pub(crate) const OUT_CHUNK: usize = 16 * 1024;

/// The q-values an `Accept-Encoding` gives the codings keel knows, and `*`.
#[derive(Default)]
struct Weights {
    /// gzip, br, zstd, `*`: the weight in thousandths, if named.
    q: [Option<u16>; 4],
}

impl Weights {
    /// Reads one `Accept-Encoding` value (`gzip, br;q=0.8, *;q=0`).
    fn read(&mut self, value: &[u8]) {
        for item in value.split(|b| *b == b',') {
            let mut parts = item.split(|b| *b == b';');
            let name = parts.next().unwrap_or_default().trim_ascii();
            let slot = if name.eq_ignore_ascii_case(b"gzip") || name.eq_ignore_ascii_case(b"x-gzip")
            {
                0
            } else if name.eq_ignore_ascii_case(b"br") {
                1
            } else if name.eq_ignore_ascii_case(b"zstd") {
                2
            } else if name == b"*" {
                3
            } else {
                continue;
            };
            let mut q = 1000;
            for p in parts {
                let p = p.trim_ascii();
                if p.len() > 2 && p[..2].eq_ignore_ascii_case(b"q=") {
                    q = parse_q(&p[2..]).unwrap_or(0);
                }
            }
            // A name given twice keeps its highest weight.
            self.q[slot] = Some(self.q[slot].map_or(q, |old| old.max(q)));
        }
    }

    /// The offered coding of highest weight above 0; the first offered among equals.
    fn best(&self, offered: &[Coding]) -> Option<Coding> {
        let mut best: Option<(Coding, u16)> = None;
        for &c in offered {
            let slot = match c {
                Coding::Gzip => 0,
                Coding::Brotli => 1,
                Coding::Zstd => 2,
            };
            let q = self.q[slot].or(self.q[3]).unwrap_or(0);
            if q > 0 && best.is_none_or(|(_, b)| q > b) {
                best = Some((c, q));
            }
        }
        best.map(|(c, _)| c)
    }
}

/// A q-value (`0`, `0.5`, `1.000`) in thousandths; `None` if malformed.
fn parse_q(v: &[u8]) -> Option<u16> {
    let (int, frac) = match v.iter().position(|b| *b == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &[][..]),
    };
    if int.len() != 1 || frac.len() > 3 || !frac.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut q = match int[0] {
        b'0' => 0u16,
        b'1' => 1000,
        _ => return None,
    };
    for (i, d) in frac.iter().enumerate() {
        q += u16::from(d - b'0') * [100, 10, 1][i];
    }
    (q <= 1000).then_some(q)
}

/// One response's encoder: a piece of the body in, compressed bytes gathered, flushed on
/// demand (so that what was written so far decodes), finished at the body's end.
pub(crate) struct Encoder {
    /// `None` once finished.
    inner: Option<Inner>,
}

enum Inner {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Brotli(Box<brotli::CompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl Encoder {
    fn out(&mut self) -> Option<&mut Vec<u8>> {
        Some(match self.inner.as_mut()? {
            Inner::Gzip(e) => e.get_mut(),
            Inner::Brotli(e) => e.get_mut(),
            Inner::Zstd(e) => e.get_mut(),
        })
    }

    /// Compresses `data`.
    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self.inner.as_mut() {
            Some(Inner::Gzip(e)) => e.write_all(data),
            Some(Inner::Brotli(e)) => e.write_all(data),
            Some(Inner::Zstd(e)) => e.write_all(data),
            None => Ok(()),
        }
    }

    /// Bytes of output gathered.
    pub fn gathered(&mut self) -> usize {
        self.out().map_or(0, |o| o.len())
    }

    /// Flushes what was written so far: the output then decodes to all of it.
    pub fn flush(&mut self) -> std::io::Result<()> {
        match self.inner.as_mut() {
            Some(Inner::Gzip(e)) => e.flush(),
            Some(Inner::Brotli(e)) => e.flush(),
            Some(Inner::Zstd(e)) => e.flush(),
            None => Ok(()),
        }
    }

    /// The output gathered so far, taken.
    pub fn take(&mut self) -> Bytes {
        self.out().map_or_else(Bytes::new, |o| {
            Bytes::from(std::mem::replace(o, Vec::with_capacity(OUT_CHUNK)))
        })
    }

    /// Ends the stream: the rest of the output, with the coding's trailer.
    pub fn finish(&mut self) -> std::io::Result<Bytes> {
        let out = match self.inner.take() {
            Some(Inner::Gzip(e)) => e.finish()?,
            Some(Inner::Brotli(e)) => e.into_inner(),
            Some(Inner::Zstd(e)) => e.finish()?,
            None => Vec::new(),
        };
        Ok(Bytes::from(out))
    }
}

/// A body on its way through an [`Encoder`]: the source's pieces are compressed as they come
/// and handed on in frames of about [`OUT_CHUNK`] bytes; when the source has nothing more for
/// now (it would wait), what was written is flushed and sent, so that a streamed answer (an
/// event stream, say) reaches the client piece by piece. At the source's end the coding's
/// trailer goes out, then the source's trailers if it had any.
pub(crate) struct Compressing {
    encoder: Encoder,
    /// Input written since the last flush.
    unflushed: bool,
    /// The source has ended (the encoder is finished).
    done: bool,
    trailers: Option<hyper::HeaderMap>,
}

/// A frame of a body, or its end.
type Polled<E> = Poll<Option<Result<Frame<Bytes>, E>>>;

impl Compressing {
    /// A body to compress with `encoder`.
    pub fn new(encoder: Encoder) -> Self {
        Compressing {
            encoder,
            unflushed: false,
            done: false,
            trailers: None,
        }
    }

    /// True once every frame was handed on.
    pub fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }

    /// The next frame of the compressed body, reading the source with `source`.
    pub fn poll_frame<E: From<std::io::Error>>(
        &mut self,
        cx: &mut Context<'_>,
        mut source: impl FnMut(&mut Context<'_>) -> Polled<E>,
    ) -> Polled<E> {
        loop {
            if self.done {
                return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            match source(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        self.encoder.write(&data)?;
                        self.unflushed |= !data.is_empty();
                        if self.encoder.gathered() >= OUT_CHUNK {
                            return Poll::Ready(Some(Ok(Frame::data(self.encoder.take()))));
                        }
                    }
                    Err(frame) => {
                        self.trailers = frame.into_trailers().ok();
                        if let Some(last) = self.end()? {
                            return Poll::Ready(Some(Ok(last)));
                        }
                    }
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => {
                    if let Some(last) = self.end()? {
                        return Poll::Ready(Some(Ok(last)));
                    }
                }
                Poll::Pending => {
                    if self.unflushed {
                        self.unflushed = false;
                        self.encoder.flush()?;
                    }
                    if self.encoder.gathered() > 0 {
                        // The source is registered to wake this task: a later poll reads it.
                        return Poll::Ready(Some(Ok(Frame::data(self.encoder.take()))));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    /// Finishes the encoder: its last frame (with what was gathered before), if not empty.
    fn end(&mut self) -> std::io::Result<Option<Frame<Bytes>>> {
        self.done = true;
        let mut last = self.encoder.take().to_vec();
        last.extend_from_slice(&self.encoder.finish()?);
        Ok((!last.is_empty()).then(|| Frame::data(Bytes::from(last))))
    }
}

/// What a response's `Vary` needs so that caches know it depends on `Accept-Encoding`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Vary {
    /// It names `Accept-Encoding` (or `*`) already.
    Done,
    /// Its one line, with `Accept-Encoding` added.
    Replace(Vec<u8>),
    /// A line `Vary: Accept-Encoding` added (there was none, or several).
    Add,
}

impl Vary {
    /// The change to a response whose `Vary` lines are `lines`.
    pub fn of<'a>(lines: impl Iterator<Item = &'a [u8]>) -> Vary {
        let mut count = 0;
        let mut only = None;
        for v in lines {
            let named = v
                .split(|b| *b == b',')
                .map(<[u8]>::trim_ascii)
                .any(|t| t == b"*" || t.eq_ignore_ascii_case(b"accept-encoding"));
            if named {
                return Vary::Done;
            }
            count += 1;
            only = Some(v);
        }
        match only {
            Some(v) if count == 1 && !v.trim_ascii().is_empty() => {
                Vary::Replace([v.trim_ascii(), b", Accept-Encoding"].concat())
            }
            _ => Vary::Add,
        }
    }
}

/// A strong `ETag` made weak (`"x"` -> `W/"x"`), as NGINX does for the bodies it compresses:
/// the compressed bytes are not the endpoint's. A weak one stays as it is.
pub(crate) fn weak_etag(value: &[u8]) -> Option<Vec<u8>> {
    value.starts_with(b"\"").then(|| [b"W/", value].concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(v: &str) -> Weights {
        let mut w = Weights::default();
        w.read(v.as_bytes());
        w
    }

    const ALL: &[Coding] = &[Coding::Zstd, Coding::Brotli, Coding::Gzip];

    #[test]
    fn accept_encoding_is_weighed_by_q_then_by_the_order_offered() {
        assert_eq!(weights("gzip").best(ALL), Some(Coding::Gzip));
        assert_eq!(weights("gzip, br").best(ALL), Some(Coding::Brotli));
        assert_eq!(weights("gzip, br;q=0.5").best(ALL), Some(Coding::Gzip));
        assert_eq!(
            weights("GZIP;Q=0.3, zstd;q=0.2").best(ALL),
            Some(Coding::Gzip)
        );
        assert_eq!(weights("gzip;q=0").best(ALL), None);
        assert_eq!(weights("identity").best(ALL), None);
        assert_eq!(weights("").best(ALL), None);
        assert_eq!(weights("*").best(ALL), Some(Coding::Zstd));
        assert_eq!(weights("*;q=0.5, zstd;q=0").best(ALL), Some(Coding::Brotli));
        assert_eq!(weights("br;q=0, *").best(&[Coding::Brotli]), None);
        assert_eq!(weights("x-gzip").best(ALL), Some(Coding::Gzip));
        assert_eq!(weights("gzip;q=2").best(ALL), None, "a malformed q is 0");
        assert_eq!(weights("gzip;q=0.001").best(ALL), Some(Coding::Gzip));
        assert_eq!(parse_q(b"1.000"), Some(1000));
        assert_eq!(parse_q(b"1.5"), None);
        assert_eq!(parse_q(b"0.25"), Some(250));
    }

    fn compression() -> Compression {
        Compression::new(&CompressionConfig::default()).unwrap()
    }

    #[test]
    fn a_response_is_compressed_only_when_its_type_status_and_headers_allow() {
        let c = compression();
        let h = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(n))
                    .map(|(_, v)| v.as_bytes())
            }
        };
        let html = &[("Content-Type", "text/html; charset=utf-8")][..];
        assert!(c.applies(200, Some(1000), h(html)));
        assert!(c.applies(200, None, h(html)));
        assert!(c.applies(404, None, h(html)));
        assert!(!c.applies(206, None, h(html)));
        assert!(!c.applies(204, None, h(html)));
        assert!(!c.applies(200, Some(100), h(html)), "below min_length");
        assert!(!c.applies(200, None, h(&[("content-type", "image/png")])));
        assert!(!c.applies(200, None, h(&[])), "no type");
        assert!(!c.applies(
            200,
            None,
            h(&[("content-type", "text/html"), ("content-encoding", "br")])
        ));
        assert!(!c.applies(
            200,
            None,
            h(&[
                ("content-type", "text/html"),
                ("cache-control", "public, No-Transform")
            ])
        ));
        let star = Compression::new(&CompressionConfig {
            types: vec!["text/*".into()],
            ..CompressionConfig::default()
        })
        .unwrap();
        assert!(star.applies(200, None, h(&[("content-type", "text/event-stream")])));
        assert!(!star.applies(200, None, h(&[("content-type", "application/json")])));
    }

    #[test]
    fn every_coding_round_trips_through_flushes() {
        let c = compression();
        let text: Vec<u8> = (0..20_000u32)
            .flat_map(|i| format!("line {i}\n").into_bytes())
            .collect();
        for coding in [Coding::Gzip, Coding::Brotli, Coding::Zstd] {
            let mut e = c.encoder(coding).unwrap();
            let mut all = Vec::new();
            for (i, piece) in text.chunks(7000).enumerate() {
                e.write(piece).unwrap();
                if i == 0 {
                    // What is flushed decodes on its own to what was written.
                    e.flush().unwrap();
                    let first = e.take();
                    assert!(!first.is_empty(), "{coding:?}");
                    all.extend_from_slice(&first);
                } else {
                    all.extend_from_slice(&e.take());
                }
            }
            all.extend_from_slice(&e.finish().unwrap());
            assert!(all.len() < text.len() / 2, "{coding:?}: {}", all.len());
            let back = decode(coding, &all);
            assert_eq!(back, text, "{coding:?}");
        }
    }

    fn decode(coding: Coding, data: &[u8]) -> Vec<u8> {
        use std::io::Read;
        let mut out = Vec::new();
        match coding {
            Coding::Gzip => {
                flate2::read::GzDecoder::new(data)
                    .read_to_end(&mut out)
                    .unwrap();
            }
            Coding::Brotli => {
                brotli::Decompressor::new(data, 4096)
                    .read_to_end(&mut out)
                    .unwrap();
            }
            Coding::Zstd => {
                out = zstd::stream::decode_all(data).unwrap();
            }
        }
        out
    }
}
