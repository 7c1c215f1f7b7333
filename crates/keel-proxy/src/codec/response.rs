//! Response heads from endpoints: parsed in place with `httparse` and rewritten into the
//! HTTP/1.1 head keel sends on (hop-by-hop headers and those `Connection` names removed, the
//! framing decided here and written by the front end).

use std::mem::MaybeUninit;

use keel_balance::{LoadReport, OrcaReport, Utilization, LATENCY_HEADER, ORCA_HEADER, RIF_HEADER};

pub(crate) use crate::codec::body::Framing;
use crate::codec::engine::EngineReport;
use crate::codec::{parse_content_length, push_content_length, push_header};

/// An endpoint's response head larger than this is refused (502).
pub(crate) const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// Most header names a `Connection` header of a response may list.
const MAX_CONNECTION_TOKENS: usize = 16;

/// A response head, parsed and rewritten.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResponseHead {
    /// Bytes of the head, final CRLF included.
    pub head_len: usize,
    /// The status code.
    pub status: u16,
    /// How the body ends.
    pub framing: Framing,
    /// The endpoint keeps the connection open after this response.
    pub keep_alive: bool,
    /// The head has a `Date` (else the front end adds one, as a proxy with a clock must).
    pub has_date: bool,
    /// The load the endpoint reported (`x-keel-rif` and `x-keel-latency-us`), if both are
    /// there and valid.
    pub load: Option<LoadReport>,
    /// The utilisation the endpoint reported in ORCA (`endpoint-load-metrics`, TEXT or JSON
    /// form), if the header is there and valid (a malformed one is ignored).
    pub orca: Option<Utilization>,
    /// The engine's own load in the same ORCA header (vLLM's named metrics), or that the
    /// header could not be read: `None` without the header.
    pub engine: Option<EngineReport>,
    /// When the endpoint asks to be retried (`Retry-After`, `grpc-retry-pushback-ms`).
    pub pushback: Option<crate::codec::pushback::Pushback>,
    /// The headers to send on as a map, when the client speaks HTTP/2 (then nothing is
    /// written as text: its renderer wants the map).
    pub headers: Option<Box<hyper::HeaderMap>>,
}

/// Most headers accepted in an upstream response.
const MAX_RESPONSE_HEADERS: usize = 128;

/// What keel reads a response header for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Other,
    Date,
    Rif,
    Latency,
    Orca,
    Connection,
    ContentLength,
    TransferEncoding,
    Upgrade,
    /// Another of `HOP_BY_HOP`.
    HopByHop,
}

impl Role {
    /// One of `HOP_BY_HOP`: not sent on.
    fn hop_by_hop(self) -> bool {
        matches!(
            self,
            Role::Connection | Role::TransferEncoding | Role::Upgrade | Role::HopByHop
        )
    }
}

/// A header's role, its length looked at first (one comparison for most names, where a
/// list of names would be one each; this runs for every header of every response).
fn role(name: &str) -> Role {
    let is = |n: &str| name.eq_ignore_ascii_case(n);
    match name.len() {
        2 if is("te") => Role::HopByHop,
        4 if is("date") => Role::Date,
        7 if is("upgrade") => Role::Upgrade,
        7 if is("trailer") => Role::HopByHop,
        10 if is("connection") => Role::Connection,
        10 if is("keep-alive") => Role::HopByHop,
        14 if is("content-length") => Role::ContentLength,
        14 if is("http2-settings") => Role::HopByHop,
        16 if is("proxy-connection") => Role::HopByHop,
        17 if is("transfer-encoding") => Role::TransferEncoding,
        18 if is("proxy-authenticate") => Role::HopByHop,
        19 if is("proxy-authorization") => Role::HopByHop,
        n if n == RIF_HEADER.len() && is(RIF_HEADER) => Role::Rif,
        n if n == LATENCY_HEADER.len() && is(LATENCY_HEADER) => Role::Latency,
        n if n == ORCA_HEADER.len() && is(ORCA_HEADER) => Role::Orca,
        _ => Role::Other,
    }
}

/// Parses the response head at the start of `buf`; when complete, writes into `out` the
/// status line and the headers to send to the client, without the framing headers, the
/// connection options and the final CRLF (the caller adds those); with `into_map`, puts the
/// headers into [`ResponseHead::headers`] instead. `Ok(None)`: not complete.
pub(crate) fn parse_response(
    buf: &[u8],
    request_is_head: bool,
    out: &mut Vec<u8>,
    into_map: bool,
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
    let mut has_date = false;
    let (mut rif, mut latency_us, mut orca) = (None, None, None);
    let mut roles = [Role::Other; MAX_RESPONSE_HEADERS];
    for (h, r) in resp.headers.iter().zip(&mut roles) {
        *r = role(h.name);
        match *r {
            Role::Date => has_date = true,
            Role::Rif => rif = Some(h.value),
            Role::Latency => latency_us = Some(h.value),
            Role::Orca => orca = Some(h.value),
            _ => {}
        }
        if *r == Role::Connection {
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
        } else if *r == Role::ContentLength {
            // Even equal ones: a second Content-Length is refused (the request side's rule).
            if content_length.is_some() {
                return Err("repeated Content-Length header");
            }
            content_length = Some(parse_content_length(h.value).ok_or("invalid Content-Length")?);
        } else if *r == Role::TransferEncoding {
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
    let mut map = None;
    if into_map {
        map = Some(Box::new(hyper::HeaderMap::with_capacity(
            resp.headers.len(),
        )));
    } else {
        out.clear();
        super::reserve_head(out);
        push_status_line(out, status, resp.reason.unwrap_or(""));
    }
    let named = &named[..n_named];
    // A body-less answer keeps the length it declares (that of the GET for a HEAD).
    let keep_length = framing == Framing::Empty && status != 204 && status >= 200;
    for (h, &r) in resp.headers.iter().zip(&roles) {
        let name = h.name;
        // A 101 names the protocol the tunnel switches to (the front end adds `Connection`).
        if status == 101 && r == Role::Upgrade {
            push_header(out, name.as_bytes(), h.value);
            continue;
        }
        if r.hop_by_hop()
            || named
                .iter()
                .any(|n| name.as_bytes().eq_ignore_ascii_case(n))
            || (!keep_length && r == Role::ContentLength)
        {
            continue;
        }
        match &mut map {
            Some(map) => {
                // httparse checked the name's and the value's bytes: both convert.
                let name = hyper::header::HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| "a response header name HTTP/2 cannot carry")?;
                let value = hyper::header::HeaderValue::from_bytes(h.value)
                    .map_err(|_| "a response header value HTTP/2 cannot carry")?;
                map.append(name, value);
            }
            None => push_header(out, name.as_bytes(), h.value),
        }
    }
    let orca_read = orca.map(EngineReport::of_orca);
    Ok(Some(ResponseHead {
        head_len,
        status,
        framing,
        keep_alive: !close && framing != Framing::Close,
        has_date,
        load: LoadReport::from_headers(rif, latency_us),
        // Parsed only when present: most endpoints send none.
        orca: orca_read
            .as_ref()
            .and_then(|(r, _)| r.as_ref())
            .map(OrcaReport::utilization),
        engine: orca_read.map(|(_, e)| e),
        pushback: if status >= 400 {
            crate::codec::pushback::of_headers(
                status,
                resp.headers.iter().map(|h| (h.name.as_bytes(), h.value)),
            )
        } else {
            None
        },
        headers: map,
    }))
}

/// Appends the status line `HTTP/1.1 <status> <reason>\r\n` (`status` of three digits).
#[inline]
pub(crate) fn push_status_line(out: &mut Vec<u8>, status: u16, reason: &str) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(&[
        b'0' + (status / 100 % 10) as u8,
        b'0' + (status / 10 % 10) as u8,
        b'0' + (status % 10) as u8,
        b' ',
    ]);
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Ends a response head written for a client: the framing of a body `framing` delimits (a
/// length; chunks for one without, unless the client speaks HTTP/1.0: then it ends with the
/// connection; nothing for no body, whose head keeps what it declared), the connection's
/// fate (`keep`), and the empty line.
#[inline]
pub(crate) fn push_framing(out: &mut Vec<u8>, framing: Framing, http10: bool, keep: bool) {
    match framing {
        Framing::Length(n) => push_content_length(out, n),
        Framing::Chunked | Framing::Close if !http10 => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        }
        _ => {}
    }
    if !keep {
        out.extend_from_slice(b"connection: close\r\n");
    } else if http10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// The status and headers of a head [`parse_response`] read, as renderers other than the
/// HTTP/1.1 relay take them: its map (taken), or the lines it wrote into `out` read back; its
/// length (`head.framing`) as `content-length`. HTTP/2 forbids connection-specific headers;
/// the rewrite removed them.
pub(crate) fn parts(
    out: &[u8],
    head: &mut ResponseHead,
) -> Result<hyper::http::response::Parts, ()> {
    use hyper::header::{HeaderName, HeaderValue};
    let (mut parts, ()) = hyper::Response::new(()).into_parts();
    parts.status = hyper::StatusCode::from_u16(head.status).map_err(|_| ())?;
    match head.headers.take() {
        Some(map) => parts.headers = *map,
        None => {
            for (name, value, _) in crate::codec::head::header_lines(out) {
                let name = HeaderName::from_bytes(name).map_err(|_| ())?;
                let value = HeaderValue::from_bytes(value).map_err(|_| ())?;
                parts.headers.append(name, value);
            }
        }
    }
    if let Framing::Length(n) = head.framing {
        parts
            .headers
            .insert(hyper::header::CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::{role, Role};

    #[test]
    fn every_hop_by_hop_name_has_that_role_in_any_case() {
        for name in crate::codec::HOP_BY_HOP {
            assert!(role(name).hop_by_hop(), "{name}");
            assert!(role(&name.to_ascii_uppercase()).hop_by_hop(), "{name}");
        }
        for name in [
            "content-type",
            "server",
            "x-trailer",
            "tee",
            "dates",
            "content-lengths",
        ] {
            assert_eq!(role(name), Role::Other, "{name}");
        }
        assert_eq!(role("Content-Length"), Role::ContentLength);
        assert_eq!(role(keel_balance::RIF_HEADER), Role::Rif);
        assert_eq!(role(keel_balance::LATENCY_HEADER), Role::Latency);
        assert_eq!(role(keel_balance::ORCA_HEADER), Role::Orca);
        assert_eq!(role("DATE"), Role::Date);
    }

    use super::*;

    fn response(raw: &[u8], head: bool) -> (ResponseHead, String) {
        let mut out = Vec::new();
        let h = parse_response(raw, head, &mut out, false).unwrap().unwrap();
        (h, String::from_utf8(out).unwrap())
    }

    /// What an HTTP/2 client gets of an HTTP/1.1 endpoint's head: its status, its headers but
    /// the hop-by-hop ones (values as sent, repeated names kept), its length.
    #[test]
    fn a_head_the_leg_wrote_becomes_status_and_headers() {
        let raw = b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nConnection: keep-alive\r\nSet-Cookie: a=1\r\nX-Backend:  b0 \r\nset-cookie: b=2\r\n\r\nno!";
        // Read into a map (an HTTP/2 client's), or written as lines and read back: the same.
        for into_map in [false, true] {
            let mut out = Vec::new();
            let mut head = parse_response(raw, false, &mut out, into_map)
                .unwrap()
                .unwrap();
            assert_eq!(out.is_empty(), into_map);
            let parts = parts(&out, &mut head).unwrap();
            assert_eq!(parts.status, 404);
            let cookies: Vec<_> = parts.headers.get_all("set-cookie").iter().collect();
            assert_eq!(cookies, ["a=1", "b=2"]);
            assert_eq!(parts.headers["x-backend"], "b0");
            assert_eq!(parts.headers["content-length"], "3");
            assert!(!parts.headers.contains_key("connection"));
            assert_eq!(parts.headers.len(), 4);
        }
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
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Le", false, &mut out, false),
            Ok(None)
        );
        assert!(parse_response(b"SMTP ready\r\n\r\n", false, &mut out, false).is_err());
        assert!(parse_response(b"HTTP/1.1 2000 OK\r\n\r\n", false, &mut out, false).is_err());
        assert!(parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            false,
            &mut out,
            false
        )
        .is_err());
    }
}
