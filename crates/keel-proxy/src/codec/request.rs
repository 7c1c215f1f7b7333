//! Request heads as HTTP/1.1 clients send them, parsed in place with `httparse` (no copy, the
//! header slots on the stack up to [`STACK_HEADERS`]), and the request head keel writes for an
//! HTTP/1.1 endpoint from a map. What a head means (its target, routing, rewriting) is not read
//! here: the front end does that with the parsed head's fields.

use std::mem::MaybeUninit;

use hyper::http::request::Parts;

use crate::codec::push_header;

/// Most request headers parsed in slots on the stack; a listener allowing more parses into
/// slots on the heap.
pub(crate) const STACK_HEADERS: usize = 128;

/// The start of HTTP/2's connection preface (RFC 9113 section 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// A complete request head, borrowed from the bytes it was parsed from.
pub(crate) struct ParsedRequest<'b> {
    pub method: &'b str,
    /// The request target as sent.
    pub target: &'b str,
    /// `HTTP/1.0` (else `HTTP/1.1`).
    pub http10: bool,
    /// Bytes of the head, final CRLF included.
    pub head_len: usize,
    headers: &'b [httparse::Header<'b>],
}

impl<'b> ParsedRequest<'b> {
    /// The header fields in order, as sent: (name, value).
    pub fn fields(&self) -> impl Iterator<Item = (&'b str, &'b [u8])> + Clone {
        self.headers.iter().map(|h| (h.name, h.value))
    }
}

/// Why a request head cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadError {
    /// More header fields than allowed.
    TooManyHeaders,
    /// Not an HTTP/1.x request head.
    Malformed,
}

/// What [`parse_request`] found at the start of a buffer when it is not a complete head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unparsed {
    /// The head is not complete yet.
    Partial,
    /// HTTP/2's connection preface: the connection is HTTP/2 with prior knowledge.
    Http2Preface,
    Invalid(HeadError),
}

/// Parses the request head at the start of `buf` with at most `max_headers` fields and hands
/// `f` the head (which lives in this call's stack frame) or what it is instead; returns what
/// `f` made of it (as it is: no wrapping, since a caller's answer may be large).
#[inline]
pub(crate) fn parse_request<R>(
    buf: &[u8],
    max_headers: usize,
    f: impl FnOnce(Result<&ParsedRequest<'_>, Unparsed>) -> R,
) -> R {
    if !buf.is_empty() && (buf.starts_with(H2_PREFACE) || H2_PREFACE.starts_with(buf)) {
        return f(Err(if buf.len() >= H2_PREFACE.len() {
            Unparsed::Http2Preface
        } else {
            Unparsed::Partial
        }));
    }
    if max_headers <= STACK_HEADERS {
        let mut headers = [MaybeUninit::<httparse::Header<'_>>::uninit(); STACK_HEADERS];
        parse_in(buf, &mut headers[..max_headers], f)
    } else {
        let mut headers = vec![MaybeUninit::<httparse::Header<'_>>::uninit(); max_headers];
        parse_in(buf, &mut headers, f)
    }
}

#[inline]
fn parse_in<'b, R>(
    buf: &'b [u8],
    headers: &mut [MaybeUninit<httparse::Header<'b>>],
    f: impl FnOnce(Result<&ParsedRequest<'_>, Unparsed>) -> R,
) -> R {
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(buf, headers) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return f(Err(Unparsed::Partial)),
        Err(httparse::Error::TooManyHeaders) => {
            return f(Err(Unparsed::Invalid(HeadError::TooManyHeaders)))
        }
        Err(_) => return f(Err(Unparsed::Invalid(HeadError::Malformed))),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return f(Err(Unparsed::Invalid(HeadError::Malformed)));
    };
    f(Ok(&ParsedRequest {
        method,
        target,
        http10: version == 0,
        head_len,
        headers: req.headers,
    }))
}

/// Writes a request head given as hyper's parts (an HTTP/2 client's) as the HTTP/1.1 head an
/// HTTP/1.1 endpoint gets: no final CRLF and no `Host` when it has no authority (both are per
/// try). `chunked`: its body is sent with the chunked coding.
pub(crate) fn write_request_head(p: &Parts, chunked: bool, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(128 + 64 * p.headers.len());
    out.extend_from_slice(p.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        p.uri
            .path_and_query()
            .map_or("/", |t| t.as_str())
            .as_bytes(),
    );
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(a) = p.uri.authority() {
        push_header(out, b"host", a.as_str().as_bytes());
    }
    for (name, value) in &p.headers {
        push_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (method, target, http10, head_len, fields) of a complete head.
    type Seen = (String, String, bool, usize, Vec<(String, Vec<u8>)>);

    fn parse(raw: &[u8], max: usize) -> Result<Seen, Unparsed> {
        parse_request(raw, max, |p| {
            p.map(|p| {
                (
                    p.method.to_owned(),
                    p.target.to_owned(),
                    p.http10,
                    p.head_len,
                    p.fields()
                        .map(|(n, v)| (n.to_owned(), v.to_vec()))
                        .collect(),
                )
            })
        })
    }

    #[test]
    fn heads_are_parsed_in_place_up_to_their_end() {
        let raw = b"POST /u?q=1 HTTP/1.0\r\nHost: a\r\nX-Two:  2 \r\n\r\nbody";
        let Ok((method, target, http10, len, fields)) = parse(raw, 8) else {
            panic!("not complete");
        };
        assert_eq!(
            (&*method, &*target, http10, len),
            ("POST", "/u?q=1", true, raw.len() - 4)
        );
        assert_eq!(
            fields,
            [
                ("Host".into(), b"a".to_vec()),
                ("X-Two".into(), b"2".to_vec())
            ]
        );
        for cut in 0..raw.len() - 4 {
            assert_eq!(
                parse(&raw[..cut], 8),
                Err(Unparsed::Partial),
                "cut at {cut}"
            );
        }
        // More fields than the stack's slots go to the heap.
        let many: String = (0..200).map(|i| format!("X-{i}: v\r\n")).collect();
        let raw = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert!(matches!(parse(raw.as_bytes(), 200), Ok(s) if s.4.len() == 200));
        assert_eq!(
            parse(raw.as_bytes(), 199),
            Err(Unparsed::Invalid(HeadError::TooManyHeaders))
        );
        assert_eq!(
            parse(raw.as_bytes(), 20),
            Err(Unparsed::Invalid(HeadError::TooManyHeaders))
        );
    }

    #[test]
    fn prefaces_and_garbage_are_told_apart() {
        assert_eq!(parse(b"PRI * HTTP/2", 8), Err(Unparsed::Partial));
        assert_eq!(
            parse(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 8),
            Err(Unparsed::Http2Preface)
        );
        for raw in [
            &b"HELLO THERE\r\n\r\n"[..],
            b"GET / HTTP/7.3\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n",
        ] {
            assert_eq!(parse(raw, 8), Err(Unparsed::Invalid(HeadError::Malformed)));
        }
    }

    #[test]
    fn a_map_is_written_as_an_http1_head() {
        let p = hyper::Request::post("http://a.example/x?y=1")
            .header("x-one", "1")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let mut out = Vec::new();
        write_request_head(&p, true, &mut out);
        assert_eq!(
            out,
            b"POST /x?y=1 HTTP/1.1\r\nhost: a.example\r\nx-one: 1\r\ntransfer-encoding: chunked\r\n"
        );
    }
}
