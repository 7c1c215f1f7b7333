//! HTTP/1.1 heads, parsed in place with `httparse` and rewritten straight into the bytes that
//! go out: no header map, no per-header allocation. The rules are those of
//! [`crate::forward`] (hop-by-hop headers and those `Connection` names removed,
//! `X-Forwarded-*` set), so both paths forward the same request.

use std::mem::MaybeUninit;

use crate::forward::HOP_BY_HOP;

/// Most header names a `Connection` header may list for removal (more: the request is left to
/// the general path, which has no such limit).
const MAX_CONNECTION_TOKENS: usize = 16;

/// Headers parsed on the stack up to this many; beyond, on the heap.
const STACK_HEADERS: usize = 128;

/// What the request path needs to know to rewrite a request.
pub(crate) struct RequestRules<'a> {
    /// The client's IP, for `X-Forwarded-For`.
    pub client_ip: &'a str,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'a str,
    /// Hash on this header's value (lower-case name).
    pub hash_header: Option<&'a str>,
    /// Hash on the path (without the query).
    pub hash_path: bool,
    /// Most headers accepted (`max_headers`).
    pub max_headers: usize,
    /// Largest body accepted (`max_request_body_bytes`; `u64::MAX`: none).
    pub max_body: u64,
    /// Largest body this path reads whole before forwarding; larger ones are handed off.
    pub max_inline_body: u64,
}

/// A request head, parsed and rewritten.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RequestHead {
    /// Bytes of the head, final CRLF included.
    pub head_len: usize,
    /// Bytes of the body (from `Content-Length`; 0 without one).
    pub body_len: usize,
    /// The method may be sent twice with the effect of once (RFC 9110 section 9.2.2).
    pub idempotent: bool,
    /// `HEAD`: the response has no body whatever its headers say.
    pub is_head: bool,
    /// The client wants the connection kept after the response.
    pub keep_alive: bool,
    /// HTTP/1.0 client (no chunked responses).
    pub http10: bool,
    /// `Host` was sent (else the endpoint's address is used).
    pub has_host: bool,
    /// The hash-strategy key's bytes were found: their hash.
    pub hash: Option<u64>,
}

/// The outcome of reading a request head.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RequestParse {
    /// The head is not complete yet.
    Partial,
    /// Complete: forward it.
    Ready(RequestHead),
    /// A request this path leaves to the general (hyper) path: a chunked or large body,
    /// `Expect`, `CONNECT`, HTTP/2's preface, more `Connection` tokens than it tracks.
    Handoff,
    /// Refused with this status (the connection is closed after the answer).
    Reject(u16, &'static str),
}

/// Parses the request head at the start of `buf`; when complete, writes into `out` the head
/// to send upstream, without `Host` when the client sent none and without the final CRLF
/// (both are per try).
pub(crate) fn parse_request(
    buf: &[u8],
    rules: &RequestRules<'_>,
    out: &mut Vec<u8>,
) -> RequestParse {
    if buf.starts_with(b"PRI * HTTP/2.0") || b"PRI * HTTP/2.0".starts_with(buf) && !buf.is_empty() {
        // HTTP/2 with prior knowledge (or the first bytes of its preface).
        return if buf.len() >= 14 {
            RequestParse::Handoff
        } else {
            RequestParse::Partial
        };
    }
    if rules.max_headers <= STACK_HEADERS {
        let mut headers = [MaybeUninit::<httparse::Header<'_>>::uninit(); STACK_HEADERS];
        parse_request_in(buf, rules, out, &mut headers[..rules.max_headers])
    } else {
        let mut headers = vec![MaybeUninit::<httparse::Header<'_>>::uninit(); rules.max_headers];
        parse_request_in(buf, rules, out, &mut headers)
    }
}

fn parse_request_in<'b>(
    buf: &'b [u8],
    rules: &RequestRules<'_>,
    out: &mut Vec<u8>,
    headers: &mut [MaybeUninit<httparse::Header<'b>>],
) -> RequestParse {
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(buf, headers) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return RequestParse::Partial,
        Err(httparse::Error::TooManyHeaders) => {
            return RequestParse::Reject(431, "more request headers than max_headers")
        }
        Err(_) => return RequestParse::Reject(400, "malformed request head"),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return RequestParse::Reject(400, "malformed request line");
    };
    if method == "CONNECT" {
        return RequestParse::Handoff;
    }
    let http10 = version == 0;

    // First pass: the framing, the connection's options and the headers it names.
    let mut named: [&[u8]; MAX_CONNECTION_TOKENS] = [b""; MAX_CONNECTION_TOKENS];
    let mut n_named = 0;
    let mut close = false;
    let mut keep_alive_token = false;
    let mut content_length: Option<u64> = None;
    let mut host: Option<&[u8]> = None;
    let mut forwarded_for = false;
    let mut hash = None;
    for h in req.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    keep_alive_token = true;
                } else if !token.is_empty() {
                    if n_named == MAX_CONNECTION_TOKENS {
                        return RequestParse::Handoff;
                    }
                    named[n_named] = token;
                    n_named += 1;
                }
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            let Some(n) = parse_content_length(h.value) else {
                return RequestParse::Reject(400, "invalid Content-Length");
            };
            if content_length.is_some_and(|m| m != n) {
                return RequestParse::Reject(400, "conflicting Content-Length headers");
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            || name.eq_ignore_ascii_case("expect")
        {
            return RequestParse::Handoff;
        } else if name.eq_ignore_ascii_case("host") {
            if host.is_some() {
                return RequestParse::Reject(400, "more than one Host header");
            }
            host = Some(h.value);
        } else if name.eq_ignore_ascii_case("x-forwarded-for") {
            forwarded_for = true;
        }
        if hash.is_none()
            && rules
                .hash_header
                .is_some_and(|k| name.eq_ignore_ascii_case(k))
        {
            hash = Some(keel_balance::hash_key(h.value));
        }
    }
    let body_len = content_length.unwrap_or(0);
    if body_len > rules.max_body {
        return RequestParse::Reject(413, "request body larger than max_request_body_bytes");
    }
    if body_len > rules.max_inline_body {
        return RequestParse::Handoff;
    }

    // The request line, in origin form: the connection is to the endpoint already.
    let (path, authority) = match origin_form(target) {
        Some(x) => x,
        None => return RequestParse::Handoff,
    };
    if !http10 && host.is_none() && authority.is_none() {
        // RFC 9112 section 3.2 (an absolute-form target names the host too, as NGINX takes).
        return RequestParse::Reject(400, "Host header missing (required since HTTP/1.1)");
    }
    if rules.hash_path {
        let end = path.find('?').unwrap_or(path.len());
        hash = Some(keel_balance::hash_key(&path.as_bytes()[..end]));
    }
    out.clear();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");

    // Second pass: every header but the hop-by-hop ones, those `Connection` names and those
    // the proxy sets itself.
    let named = &named[..n_named];
    for h in req.headers.iter() {
        let name = h.name;
        if HOP_BY_HOP.iter().any(|n| name.eq_ignore_ascii_case(n))
            || named
                .iter()
                .any(|n| name.as_bytes().eq_ignore_ascii_case(n))
            || name.eq_ignore_ascii_case("content-length")
            || name.eq_ignore_ascii_case("x-forwarded-for")
            || name.eq_ignore_ascii_case("x-forwarded-proto")
            || name.eq_ignore_ascii_case("x-forwarded-host")
        {
            continue;
        }
        push_header(out, name.as_bytes(), h.value);
    }
    // The client's `Host`, or for an absolute-form target its authority.
    let host = match (host, authority) {
        (Some(h), _) => Some(h),
        (None, Some(a)) => {
            push_header(out, b"host", a.as_bytes());
            Some(a.as_bytes())
        }
        (None, None) => None,
    };
    out.extend_from_slice(b"x-forwarded-for: ");
    if forwarded_for {
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("x-forwarded-for") {
                out.extend_from_slice(h.value);
                out.extend_from_slice(b", ");
            }
        }
    }
    out.extend_from_slice(rules.client_ip.as_bytes());
    out.extend_from_slice(b"\r\n");
    push_header(out, b"x-forwarded-proto", rules.proto.as_bytes());
    if let Some(h) = host {
        push_header(out, b"x-forwarded-host", h);
    }
    if let Some(n) = content_length {
        push_content_length(out, n);
    }
    RequestParse::Ready(RequestHead {
        head_len,
        body_len: body_len as usize,
        idempotent: matches!(
            method,
            "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
        ),
        is_head: method == "HEAD",
        // `close` wins over `keep-alive` (RFC 9112 section 9.3).
        keep_alive: !close && (!http10 || keep_alive_token),
        http10,
        has_host: host.is_some(),
        hash,
    })
}

/// The origin-form target (`/path?query` or `*`) of a request target, and the authority of
/// an absolute-form one (`http://authority/path?query`, RFC 9112 section 3.2.2). `None` for
/// the rarer forms, left to the general path.
fn origin_form(target: &str) -> Option<(&str, Option<&str>)> {
    if target.starts_with('/') || target == "*" {
        return Some((target, None));
    }
    let (scheme, rest) = target.split_once("://")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return None;
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if authority.is_empty() || authority.contains('@') || path.starts_with('?') {
        return None;
    }
    Some((if path.is_empty() { "/" } else { path }, Some(authority)))
}

/// A `Content-Length` value: digits only (RFC 9110 section 8.6), no sign, no overflow.
fn parse_content_length(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// Appends `name: value\r\n`.
pub(crate) fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `content-length: n\r\n`.
pub(crate) fn push_content_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
    out.extend_from_slice(b"\r\n");
}

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framing {
    /// No body (`HEAD`, 1xx, 204, 304).
    Empty,
    /// This many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Until the endpoint closes the connection.
    Close,
}

/// A response head, parsed and rewritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseHead {
    /// Bytes of the head, final CRLF included.
    pub head_len: usize,
    /// The status code.
    pub status: u16,
    /// How the body ends.
    pub framing: Framing,
    /// The endpoint keeps the connection open after this response.
    pub keep_alive: bool,
}

/// Most headers accepted in an upstream response.
const MAX_RESPONSE_HEADERS: usize = 128;

/// Parses the response head at the start of `buf`; when complete, writes into `out` the
/// status line and the headers to send to the client, without the framing headers, the
/// connection options and the final CRLF (the caller adds those). `Ok(None)`: not complete.
pub(crate) fn parse_response(
    buf: &[u8],
    request_is_head: bool,
    out: &mut Vec<u8>,
) -> Result<Option<ResponseHead>, &'static str> {
    let mut headers = [MaybeUninit::<httparse::Header<'_>>::uninit(); MAX_RESPONSE_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    );
    let head_len = match parsed {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err("too many response headers"),
        Err(_) => return Err("invalid response head"),
    };
    let (Some(version), Some(status)) = (resp.version, resp.code) else {
        return Err("invalid status line");
    };
    if !(100..=999).contains(&status) {
        return Err("invalid status code");
    }
    let mut named: [&[u8]; MAX_CONNECTION_TOKENS] = [b""; MAX_CONNECTION_TOKENS];
    let mut n_named = 0;
    let mut close = version == 0;
    let mut content_length: Option<u64> = None;
    let mut chunked = false;
    let mut transfer_encoding = false;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
                    if n_named == MAX_CONNECTION_TOKENS {
                        return Err("too many Connection options");
                    }
                    named[n_named] = token;
                    n_named += 1;
                }
            }
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = parse_content_length(h.value).ok_or("invalid Content-Length")?;
            if content_length.is_some_and(|m| m != n) {
                return Err("conflicting Content-Length headers");
            }
            content_length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoding = true;
            // Chunked must be the last coding (RFC 9112 section 6.1).
            chunked = h
                .value
                .rsplit(|b| *b == b',')
                .next()
                .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        }
    }
    let framing = if request_is_head || status < 200 || status == 204 || status == 304 {
        Framing::Empty
    } else if transfer_encoding {
        // Transfer-Encoding wins over Content-Length; without chunked last, the body runs
        // until close (RFC 9112 section 6.3).
        if chunked {
            Framing::Chunked
        } else {
            Framing::Close
        }
    } else if let Some(n) = content_length {
        Framing::Length(n)
    } else {
        Framing::Close
    };
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    push_status(out, status);
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let named = &named[..n_named];
    // A body-less answer keeps the length it declares (that of the GET for a HEAD).
    let keep_length = framing == Framing::Empty && status != 204 && status >= 200;
    for h in resp.headers.iter() {
        let name = h.name;
        if HOP_BY_HOP.iter().any(|n| name.eq_ignore_ascii_case(n))
            || named
                .iter()
                .any(|n| name.as_bytes().eq_ignore_ascii_case(n))
            || (!keep_length && name.eq_ignore_ascii_case("content-length"))
        {
            continue;
        }
        push_header(out, name.as_bytes(), h.value);
    }
    Ok(Some(ResponseHead {
        head_len,
        status,
        framing,
        keep_alive: !close && framing != Framing::Close,
    }))
}

fn push_status(out: &mut Vec<u8>, status: u16) {
    out.extend_from_slice(&[
        b'0' + (status / 100) as u8,
        b'0' + (status / 10 % 10) as u8,
        b'0' + (status % 10) as u8,
    ]);
}

/// Finds where a chunked body ends while it passes through (RFC 9112 section 7.1): sizes,
/// extensions, data, trailers. Bytes are checked, not copied.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChunkedDecoder {
    state: ChunkState,
    /// Bytes left in the current chunk's data (or its size being read).
    size: u64,
    /// Hex digits seen in the current size line.
    digits: u8,
    /// Bytes of chunk extensions or trailers seen (bounded).
    extra: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum ChunkState {
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
        self.state == ChunkState::Done
    }

    /// Consumes bytes of the body, calling `data` with each piece of chunk data; returns how
    /// many bytes belonged to the body (fewer than `input.len()` only once done).
    pub fn decode(
        &mut self,
        input: &[u8],
        mut data: impl FnMut(&[u8]),
    ) -> Result<usize, &'static str> {
        let mut i = 0;
        while i < input.len() {
            let b = input[i];
            match self.state {
                ChunkState::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                        self.digits += 1;
                        if self.digits > 15 {
                            return Err("chunk size too large");
                        }
                        self.size = self.size * 16 + d;
                    }
                    b';' | b' ' | b'\t' if self.digits > 0 => self.state = ChunkState::Extension,
                    b'\r' if self.digits > 0 => self.state = ChunkState::SizeLf,
                    _ => return Err("invalid chunk size"),
                },
                ChunkState::Extension => match b {
                    b'\r' => self.state = ChunkState::SizeLf,
                    b'\n' => return Err("invalid chunk extension"),
                    _ => {
                        self.extra += 1;
                        if self.extra > MAX_CHUNK_EXTRA {
                            return Err("chunk extensions too long");
                        }
                    }
                },
                ChunkState::SizeLf => {
                    if b != b'\n' {
                        return Err("invalid chunk size line");
                    }
                    self.digits = 0;
                    self.state = if self.size == 0 {
                        ChunkState::TrailerStart
                    } else {
                        ChunkState::Data
                    };
                }
                ChunkState::Data => {
                    let n = (input.len() - i).min(usize::try_from(self.size).unwrap_or(usize::MAX));
                    data(&input[i..i + n]);
                    self.size -= n as u64;
                    i += n;
                    if self.size == 0 {
                        self.state = ChunkState::DataCr;
                    }
                    continue;
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return Err("chunk longer than its size");
                    }
                    self.state = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return Err("chunk longer than its size");
                    }
                    self.state = ChunkState::Size;
                }
                ChunkState::TrailerStart => {
                    self.state = if b == b'\r' {
                        ChunkState::EndLf
                    } else {
                        ChunkState::TrailerLine
                    };
                }
                ChunkState::TrailerLine => {
                    self.extra += 1;
                    if self.extra > MAX_CHUNK_EXTRA {
                        return Err("trailers too long");
                    }
                    if b == b'\r' {
                        self.state = ChunkState::TrailerLf;
                    }
                }
                ChunkState::TrailerLf => {
                    if b != b'\n' {
                        return Err("invalid trailer line");
                    }
                    self.state = ChunkState::TrailerStart;
                }
                ChunkState::EndLf => {
                    if b != b'\n' {
                        return Err("invalid end of chunked body");
                    }
                    self.state = ChunkState::Done;
                    return Ok(i + 1);
                }
                ChunkState::Done => return Ok(i),
            }
            i += 1;
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> RequestRules<'static> {
        RequestRules {
            client_ip: "127.0.0.1",
            proto: "http",
            hash_header: None,
            hash_path: false,
            max_headers: 20,
            max_body: 1024,
            max_inline_body: 512,
        }
    }

    fn ready(raw: &[u8], rules: &RequestRules<'_>) -> (RequestHead, String) {
        let mut out = Vec::new();
        match parse_request(raw, rules, &mut out) {
            RequestParse::Ready(h) => (h, String::from_utf8(out).unwrap()),
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(raw)),
        }
    }

    #[test]
    fn a_request_is_rewritten_as_the_general_path_does() {
        let raw = b"GET /p?q=1 HTTP/1.1\r\nHost: app.example\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nTE: trailers\r\nProxy-Authorization: b\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: ftp\r\nX-Keep: yes\r\n\r\nNEXT";
        let (h, out) = ready(raw, &rules());
        assert_eq!(h.head_len, raw.len() - 4);
        assert!(h.keep_alive && h.idempotent && h.has_host && !h.http10 && !h.is_head);
        assert_eq!(
            out,
            "GET /p?q=1 HTTP/1.1\r\nHost: app.example\r\nX-Keep: yes\r\nx-forwarded-for: 10.0.0.1, 127.0.0.1\r\nx-forwarded-proto: http\r\nx-forwarded-host: app.example\r\n"
        );
    }

    #[test]
    fn framing_and_connection_options() {
        let (h, out) = ready(
            b"POST /u HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello",
            &rules(),
        );
        assert_eq!(
            (h.body_len, h.keep_alive, h.idempotent, h.has_host),
            (5, false, false, false)
        );
        let (h, _) = ready(
            b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, close\r\n\r\n",
            &rules(),
        );
        assert!(!h.keep_alive, "close wins");
        assert!(out.ends_with("content-length: 5\r\n"), "{out}");
        let (h, _) = ready(b"GET / HTTP/1.0\r\n\r\n", &rules());
        assert!(h.http10 && !h.keep_alive);
        let (h, _) = ready(
            b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n",
            &rules(),
        );
        assert!(h.http10 && h.keep_alive);
        let (h, out) = ready(b"GET http://a.example:8080/x?y HTTP/1.1\r\n\r\n", &rules());
        assert!(h.has_host);
        assert!(
            out.starts_with("GET /x?y HTTP/1.1\r\nhost: a.example:8080\r\n"),
            "{out}"
        );
        let (_, out) = ready(b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", &rules());
        assert!(out.starts_with("OPTIONS * HTTP/1.1\r\n"), "{out}");
    }

    #[test]
    fn bad_requests_are_refused_and_odd_ones_handed_off() {
        let mut out = Vec::new();
        let r = |raw: &[u8], out: &mut Vec<u8>| parse_request(raw, &rules(), out);
        assert_eq!(
            r(b"GET / HTTP/1.1\r\nHost: x\r\n", &mut out),
            RequestParse::Partial
        );
        assert_eq!(r(b"PRI * HTTP/2", &mut out), RequestParse::Partial);
        assert_eq!(
            r(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", &mut out),
            RequestParse::Handoff
        );
        for (raw, status) in [
            (&b"HELLO THERE\r\n\r\n"[..], 400),
            (b"GET / HTTP/7.3\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
            (
                b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                400,
            ),
            (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 1025\r\n\r\n", 413),
        ] {
            match r(raw, &mut out) {
                RequestParse::Reject(s, _) => {
                    assert_eq!(s, status, "{:?}", String::from_utf8_lossy(raw))
                }
                other => panic!("{other:?} for {:?}", String::from_utf8_lossy(raw)),
            }
        }
        let many: String = (0..21).map(|i| format!("X-{i}: v\r\n")).collect();
        let raw = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert!(matches!(
            r(raw.as_bytes(), &mut out),
            RequestParse::Reject(431, _)
        ));
        for raw in [
            &b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 600\r\n\r\n",
            b"PUT / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
            b"CONNECT a:443 HTTP/1.1\r\n\r\n",
            b"GET ftp://x/ HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(
                r(raw, &mut out),
                RequestParse::Handoff,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn hash_keys_match_the_general_path() {
        let mut rules = rules();
        rules.hash_header = Some("x-user");
        let (h, _) = ready(
            b"GET / HTTP/1.1\r\nHost: h\r\nX-User: alice\r\n\r\n",
            &rules,
        );
        assert_eq!(h.hash, Some(keel_balance::hash_key(b"alice")));
        rules.hash_header = None;
        rules.hash_path = true;
        let (h, _) = ready(b"GET /a/b?c=1 HTTP/1.1\r\nHost: h\r\n\r\n", &rules);
        assert_eq!(h.hash, Some(keel_balance::hash_key(b"/a/b")));
    }

    fn response(raw: &[u8], head: bool) -> (ResponseHead, String) {
        let mut out = Vec::new();
        let h = parse_response(raw, head, &mut out).unwrap().unwrap();
        (h, String::from_utf8(out).unwrap())
    }

    #[test]
    fn responses_are_framed_and_cleaned() {
        let (h, out) = response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x-secret\r\nX-Secret: s\r\nKeep-Alive: timeout=5\r\nX-Backend: b0\r\n\r\nok",
            false,
        );
        assert_eq!(
            (h.status, h.framing, h.keep_alive),
            (200, Framing::Length(2), true)
        );
        assert_eq!(out, "HTTP/1.1 200 OK\r\nX-Backend: b0\r\n");
        let (h, _) = response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 9\r\n\r\n",
            false,
        );
        assert_eq!(h.framing, Framing::Chunked);
        let (h, _) = response(b"HTTP/1.0 200 OK\r\n\r\nbody", false);
        assert_eq!((h.framing, h.keep_alive), (Framing::Close, false));
        let (h, out) = response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", true);
        assert_eq!(h.framing, Framing::Empty);
        assert!(
            out.contains("Content-Length: 9"),
            "HEAD keeps the GET's length: {out}"
        );
        let (h, _) = response(b"HTTP/1.1 100 Continue\r\n\r\n", false);
        assert_eq!((h.status, h.framing), (100, Framing::Empty));
        let (h, _) = response(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            false,
        );
        assert!(!h.keep_alive);
        let mut out = Vec::new();
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Le", false, &mut out),
            Ok(None)
        );
        assert!(parse_response(b"SMTP ready\r\n\r\n", false, &mut out).is_err());
        assert!(parse_response(b"HTTP/1.1 2000 OK\r\n\r\n", false, &mut out).is_err());
        assert!(parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            false,
            &mut out
        )
        .is_err());
    }

    fn decode_all(pieces: &[&[u8]]) -> Result<(Vec<u8>, usize, bool), &'static str> {
        let mut d = ChunkedDecoder::default();
        let mut data = Vec::new();
        let mut used = 0;
        for p in pieces {
            used += d.decode(p, |x| data.extend_from_slice(x))?;
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
        let (data, _, done) = decode_all(&[b"5\r\nhel"]).unwrap();
        assert_eq!((data, done), (b"hel".to_vec(), false));
        for bad in [
            &b"ZZ\r\nhello\r\n0\r\n\r\n"[..],
            b"3\r\nhello\r\n",
            b"\r\n",
            b"ffffffffffffffff\r\n",
        ] {
            assert!(
                decode_all(&[bad]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
