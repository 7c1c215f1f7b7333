//! What an endpoint gets of a client's request: the one set of rules both front ends apply.
//! Hop-by-hop headers and those `Connection` names go, `X-Forwarded-For`/`-Proto`/`-Host`
//! and `x-request-id` are set, the body's framing is decided, and every refusal is a
//! [`Reject`]. [`scan`] checks the request once; its result is written either as the
//! HTTP/1.1 head an HTTP/1.1 client's request becomes ([`rewrite`]), or as edits in place of
//! an HTTP/2 client's header map ([`rewrite_h2`]), which no leg has to parse back.

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue, CONTENT_LENGTH};
use hyper::http::request::Parts;
use hyper::http::uri::Authority;

use crate::codec::{push_content_length, push_header, HOP_BY_HOP};
use crate::exchange::request::{
    new_request_id, parse_content_length, valid_authority, BodyFraming, Reject, RequestHead,
    RequestRules, RouteRef, UpgradeTo, MAX_REQUEST_ID,
};

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Most header names a `Connection` header may list for removal.
const MAX_CONNECTION_TOKENS: usize = 16;

/// What the first look at the headers found.
struct Scan<'h> {
    named: [&'h [u8]; MAX_CONNECTION_TOKENS],
    n_named: usize,
    close: bool,
    keep_alive_token: bool,
    content_length: Option<u64>,
    transfer_encoding: Option<&'h [u8]>,
    expect: Option<&'h [u8]>,
    host: Option<&'h [u8]>,
    forwarded_for: bool,
    hash: Option<u64>,
    upgrade_token: bool,
    upgrade: Option<&'h [u8]>,
    real_ip: bool,
    request_id: Option<&'h [u8]>,
    grpc: bool,
    /// The `Upgrade` value passed on, when the request is an upgrade keel forwards.
    upgrade_to: Option<&'h [u8]>,
    /// `cookie` fields: an HTTP/2 client may send one per cookie (RFC 9113 section 8.2.3).
    cookies: u8,
}

/// Headers a `Connection` header cannot name for removal: `Host` and those keel writes
/// itself. (Left to it, `Connection: host` would strip `Host` after routing used it, and
/// `Connection: x-forwarded-for` a trusted proxy's record of the client.)
const NOT_HOP_BY_HOP: [&str; 8] = [
    "host",
    "content-length",
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-real-ip",
    "forwarded",
    "x-request-id",
];

/// Checks a request: what it is (its [`RequestHead`]) and what its headers hold that the
/// rewrite needs. `fields` are the client's headers as (name, value), from a function called
/// for each pass over them; `authority`: an absolute-form target's (HTTP/1.1) or
/// `:authority` (HTTP/2). `unframed_body`: a body follows that no header delimits (HTTP/2
/// data frames without `content-length`); it is sent chunked. Inlined: its result is large
/// (a copy of it cost 7 % of the rewrite).
#[inline(always)]
fn scan<'h, I>(
    method: &str,
    path: &str,
    authority: Option<&'h str>,
    http10: bool,
    unframed_body: bool,
    fields: impl Fn() -> I,
    rules: &RequestRules<'_>,
) -> Result<(RequestHead, Scan<'h>), Reject>
where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    if authority.is_some_and(|a| !valid_authority(a.as_bytes())) {
        return Err(Reject::InvalidHost);
    }
    let mut s = Scan {
        named: [b""; MAX_CONNECTION_TOKENS],
        n_named: 0,
        close: false,
        keep_alive_token: false,
        content_length: None,
        transfer_encoding: None,
        expect: None,
        host: None,
        forwarded_for: false,
        hash: None,
        upgrade_token: false,
        upgrade: None,
        real_ip: false,
        request_id: None,
        grpc: false,
        upgrade_to: None,
        cookies: 0,
    };
    for (name, value) in fields() {
        if name.eq_ignore_ascii_case("connection") {
            for token in value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    s.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") {
                    s.keep_alive_token = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    s.upgrade_token = true;
                } else if !token.is_empty()
                    && !NOT_HOP_BY_HOP
                        .iter()
                        .any(|n| token.eq_ignore_ascii_case(n.as_bytes()))
                {
                    if s.n_named == MAX_CONNECTION_TOKENS {
                        return Err(Reject::TooManyConnectionOptions);
                    }
                    s.named[s.n_named] = token;
                    s.n_named += 1;
                }
            }
        } else if name.eq_ignore_ascii_case("content-length") {
            if s.content_length.is_some() {
                return Err(Reject::RepeatedContentLength);
            }
            s.content_length =
                Some(parse_content_length(value).ok_or(Reject::InvalidContentLength)?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if s.transfer_encoding.is_some() {
                return Err(Reject::UnsupportedTransferEncoding);
            }
            s.transfer_encoding = Some(value);
        } else if name.eq_ignore_ascii_case("expect") {
            s.expect = Some(value);
        } else if name.eq_ignore_ascii_case("host") {
            if s.host.is_some() {
                return Err(Reject::DuplicateHost);
            }
            if !valid_authority(value) {
                return Err(Reject::InvalidHost);
            }
            s.host = Some(value);
        } else if name.eq_ignore_ascii_case("x-forwarded-for") {
            s.forwarded_for = true;
        } else if name.eq_ignore_ascii_case("upgrade") {
            s.upgrade = Some(value);
        } else if name.eq_ignore_ascii_case("x-real-ip") {
            s.real_ip = true;
        } else if name.eq_ignore_ascii_case("x-request-id") {
            if s.request_id.is_none() && valid_request_id(value) {
                s.request_id = Some(value);
            }
        } else if name.eq_ignore_ascii_case("content-type") {
            s.grpc = value.len() >= 16 && value[..16].eq_ignore_ascii_case(b"application/grpc");
        } else if name.eq_ignore_ascii_case("cookie") {
            s.cookies = s.cookies.saturating_add(1);
        }
        if s.hash.is_none()
            && rules
                .hash_header
                .is_some_and(|k| name.eq_ignore_ascii_case(k))
        {
            s.hash = Some(keel_balance::hash_key(value));
        }
    }
    let body = match (s.transfer_encoding, s.content_length) {
        (Some(_), Some(_)) => return Err(Reject::LengthAndTransferEncoding),
        (Some(te), None) => {
            let last = te.rsplit(|b| *b == b',').next().unwrap_or(b"").trim_ascii();
            if http10 || !last.eq_ignore_ascii_case(b"chunked") {
                return Err(Reject::TransferEncodingNotChunked);
            }
            if !te.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(Reject::UnsupportedTransferEncoding);
            }
            BodyFraming::Chunked
        }
        (None, None) if unframed_body => BodyFraming::Chunked,
        (None, Some(0)) | (None, None) => BodyFraming::None,
        (None, Some(n)) => BodyFraming::Length(n),
    };
    if let BodyFraming::Length(n) = body {
        if n > rules.max_body {
            return Err(Reject::BodyTooLarge);
        }
    }
    let expect_continue = match s.expect {
        None => false,
        // No 1xx to an HTTP/1.0 client (RFC 9110 section 15.2): its Expect is ignored.
        Some(_) if http10 => false,
        Some(v) if v.trim_ascii().eq_ignore_ascii_case(b"100-continue") => true,
        Some(_) => return Err(Reject::UnsupportedExpectation),
    };
    if !http10 && s.host.is_none() && authority.is_none() {
        // RFC 9112 section 3.2 (an absolute-form target names the host too, as NGINX takes).
        return Err(Reject::MissingHost);
    }
    // RFC 9110 section 7.8; HTTP/1.0 has no upgrades. An upgrade to h2c is not passed on:
    // it would make the connection HTTP/2 straight to the endpoint, past keel's routes and
    // limits (h2c smuggling); the request goes on as a plain HTTP/1.1 one.
    let upgrade = match s.upgrade {
        Some(protocol) if s.upgrade_token && method == "GET" && !http10 && !names_h2c(protocol) => {
            UpgradeTo::new(protocol).map(|to| (protocol, to))
        }
        _ => None,
    };
    let mut hash = s.hash;
    if rules.hash_path {
        let end = path.find('?').unwrap_or(path.len());
        hash = Some(keel_balance::hash_key(&path.as_bytes()[..end]));
    }

    s.upgrade_to = upgrade.map(|(protocol, _)| protocol);
    let head = RequestHead {
        head_len: 0,
        body,
        idempotent: matches!(
            method,
            "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE"
        ),
        is_head: method == "HEAD",
        // `close` wins over `keep-alive` (RFC 9112 section 9.3).
        keep_alive: !s.close && (!http10 || s.keep_alive_token),
        http10,
        http2: false,
        has_host: authority.is_some() || s.host.is_some(),
        expect_continue,
        hash,
        route: RouteRef::NotFound,
        upgrade: upgrade.is_some(),
        upgrade_to: upgrade.map(|(_, to)| to).unwrap_or_default(),
        grpc: s.grpc,
    };
    Ok((head, s))
}

/// True if a client's header `name` goes to the endpoint as the client sent it: not a
/// hop-by-hop one or one its `Connection` names, not one keel sets itself, not `Expect`
/// (keel answers it), and not `Host` when the target's authority replaces it (`drop_host`).
#[inline(always)]
fn passed_on(name: &str, named: &[&[u8]], drop_host: bool, rules: &RequestRules<'_>) -> bool {
    !(HOP_BY_HOP.iter().any(|n| name.eq_ignore_ascii_case(n))
        || named
            .iter()
            .any(|n| name.as_bytes().eq_ignore_ascii_case(n))
        || name.eq_ignore_ascii_case("content-length")
        || name.eq_ignore_ascii_case("expect")
        || (drop_host && name.eq_ignore_ascii_case("host"))
        || name.eq_ignore_ascii_case("x-forwarded-for")
        || name.eq_ignore_ascii_case("x-forwarded-proto")
        || name.eq_ignore_ascii_case("x-forwarded-host")
        || (rules.request_id && name.eq_ignore_ascii_case("x-request-id"))
        || (!rules.trust_forwarded
            && (name.eq_ignore_ascii_case("x-real-ip") || name.eq_ignore_ascii_case("forwarded"))))
}

/// A client's `x-request-id` keel passes on: printable, not empty, not too long.
fn valid_request_id(value: &[u8]) -> bool {
    !value.is_empty() && value.len() <= MAX_REQUEST_ID && value.iter().all(|b| b.is_ascii_graphic())
}

/// A request target's path (query kept, untouched) in the normal form of RFC 3986 section 6:
/// percent-escapes of unreserved characters (ALPHA DIGIT `-` `.` `_` `~`) decoded (6.2.2.2:
/// `/%61dmin` is `/admin`, `%2e` is a `.`), the hex digits of the other escapes in capitals
/// (6.2.2.1: `%2f` is `%2F`; `/`, `?`, `#`, `%` and every other reserved or non-ASCII byte
/// stay encoded), dot segments resolved (5.2.4), and empty segments merged (`//` -> `/`), as
/// NGINX does before it matches a location; `Err` when `..` climbs above the root (NGINX
/// answers 400 too). Routing, access lists and the prefix rewrites then see the path the
/// endpoint gets, so `/public/../admin` and `/%61dmin` are `/admin` everywhere. The common
/// path (no escape to change, no `//`, no `.` or `..` segment) is one pass over its bytes
/// and is borrowed, not copied. A `#fragment` is dropped.
pub(crate) fn normal_path(target: &str) -> Result<std::borrow::Cow<'_, str>, Reject> {
    // A fragment is the client's own business and no part of a request target (RFC 9112
    // section 3.2): it is dropped, as NGINX does.
    let target = target.split_once('#').map_or(target, |(t, _)| t);
    let bytes = target.as_bytes();
    let end = bytes.iter().position(|b| *b == b'?').unwrap_or(bytes.len());
    if bytes.first() != Some(&b'/') || is_normal(&bytes[..end]) {
        return Ok(std::borrow::Cow::Borrowed(target));
    }
    let (path, query) = target.split_at(end);
    let mut out = String::with_capacity(target.len());
    let mut segments = path[1..].split('/').peekable();
    let mut segment = String::new();
    while let Some(raw) = segments.next() {
        let last = segments.peek().is_none();
        segment.clear();
        let mut rest = raw;
        while let Some(at) = rest.find('%') {
            let (before, after) = rest.split_at(at);
            segment.push_str(before);
            match escaped(after.as_bytes()) {
                Some(b) if is_unreserved(b) => {
                    segment.push(b as char);
                    rest = &after[3..];
                }
                Some(_) => {
                    segment.push('%');
                    segment.push_str(&after[1..3].to_ascii_uppercase());
                    rest = &after[3..];
                }
                None => {
                    segment.push('%');
                    rest = &after[1..];
                }
            }
        }
        segment.push_str(rest);
        match segment.as_str() {
            "" | "." => {}
            ".." => {
                let parent = out.rfind('/').ok_or(Reject::PathAboveRoot)?;
                out.truncate(parent);
            }
            s => {
                out.push('/');
                out.push_str(s);
                continue;
            }
        }
        // A path that ends in `/`, `/.` or `/..` names a directory: it keeps its `/`.
        if last {
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out.push_str(query);
    Ok(std::borrow::Cow::Owned(out))
}

/// The byte a percent-escape at the start of `s` stands for (`None`: not `%` and two hex
/// digits).
fn escaped(s: &[u8]) -> Option<u8> {
    let hex = |c: u8| (c as char).to_digit(16);
    match s {
        [b'%', h, l, ..] => Some((hex(*h)? * 16 + hex(*l)?) as u8),
        _ => None,
    }
}

/// RFC 3986 section 2.3: an escape of one of these means the character itself.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// True when `path` (no query) has nothing for [`normal_path`] to do: no escape of an
/// unreserved character, no escape in small hex letters, no `//`, no `.` or `..` segment.
#[inline]
fn is_normal(path: &[u8]) -> bool {
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'%' => {
                if let Some(b) = escaped(&path[i..]) {
                    if is_unreserved(b) || path[i + 1..i + 3].iter().any(u8::is_ascii_lowercase) {
                        return false;
                    }
                }
            }
            b'/' => match &path[i + 1..] {
                [b'/', ..] | [b'.'] | [b'.', b'/', ..] | [b'.', b'.'] | [b'.', b'.', b'/', ..] => {
                    return false
                }
                _ => {}
            },
            _ => {}
        }
        i += 1;
    }
    true
}

/// Checks an HTTP/1.1 client's request and writes the head sent upstream into `out` (request
/// line in origin form, headers, `X-Forwarded-*`, `Content-Length` or `Transfer-Encoding`; no
/// final CRLF and no `Host` when the client sent none: both are per try). See [`scan`] for
/// the arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rewrite<'h, I>(
    method: &str,
    path: &str,
    authority: Option<&'h str>,
    http10: bool,
    unframed_body: bool,
    fields: impl Fn() -> I,
    rules: &RequestRules<'_>,
    out: &mut Vec<u8>,
) -> Result<RequestHead, Reject>
where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    let path = normal_path(path)?;
    let path = &*path;
    let (meta, s) = scan(
        method,
        path,
        authority,
        http10,
        unframed_body,
        &fields,
        rules,
    )?;
    out.clear();
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let named = &s.named[..s.n_named];
    let mut cookies_sent = false;
    for (name, value) in fields() {
        if s.cookies > 1 && rules.join_cookies && name.eq_ignore_ascii_case("cookie") {
            // Several `cookie` fields go to an HTTP/1.1 endpoint as one line, joined by "; "
            // (RFC 9113 section 8.2.3), in their order, where the first one was.
            if !cookies_sent {
                cookies_sent = true;
                out.extend_from_slice(b"cookie: ");
                let all = fields().filter(|(n, _)| n.eq_ignore_ascii_case("cookie"));
                for (i, (_, v)) in all.enumerate() {
                    if i > 0 {
                        out.extend_from_slice(b"; ");
                    }
                    out.extend_from_slice(v);
                }
                out.extend_from_slice(b"\r\n");
            }
        } else if passed_on(name, named, authority.is_some(), rules) {
            push_header(out, name.as_bytes(), value);
        }
    }
    // The target's authority (an absolute-form target's, or HTTP/2's `:authority`) wins over
    // `Host` (RFC 9112 section 3.2.2), which was left out above; else the client's `Host`.
    let host = match (authority, s.host) {
        (Some(a), _) => {
            push_header(out, b"host", a.as_bytes());
            Some(a.as_bytes())
        }
        (None, Some(h)) => Some(h),
        (None, None) => None,
    };
    // An untrusted client's `X-Real-IP` is replaced as its `X-Forwarded-For` is; its
    // `Forwarded` is dropped (keel speaks `X-Forwarded-*`).
    if s.real_ip && !rules.trust_forwarded {
        push_header(out, b"x-real-ip", rules.client_ip.as_bytes());
    }
    if rules.request_id {
        out.extend_from_slice(b"x-request-id: ");
        match s.request_id {
            Some(id) => out.extend_from_slice(id),
            None => out.extend_from_slice(&new_request_id()),
        }
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"x-forwarded-for: ");
    if s.forwarded_for && rules.trust_forwarded {
        for (name, value) in fields() {
            if name.eq_ignore_ascii_case("x-forwarded-for") {
                out.extend_from_slice(value);
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
    if let Some(protocol) = s.upgrade_to {
        out.extend_from_slice(b"connection: upgrade\r\n");
        push_header(out, b"upgrade", protocol);
    }
    match meta.body {
        BodyFraming::Length(n) => push_content_length(out, n),
        BodyFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        // A `Content-Length: 0` is kept as such (some servers want a length on POST).
        BodyFraming::None if s.content_length == Some(0) => push_content_length(out, 0),
        BodyFraming::None => {}
    }
    Ok(meta)
}

/// A trusted proxy's `X-Forwarded-For` chain (`values`, the client's headers, read only for a
/// trusted client) with the client appended; from anyone else, or with no chain, the client
/// alone. `None` if the chain is no header value.
fn forwarded_for<'v>(
    values: impl Iterator<Item = &'v [u8]>,
    rules: &RequestRules<'_>,
) -> Option<HeaderValue> {
    if !rules.trust_forwarded {
        return Some(rules.client_ip_value.clone());
    }
    let mut chain = Vec::with_capacity(rules.client_ip.len() + 64);
    for v in values {
        chain.extend_from_slice(v);
        chain.extend_from_slice(b", ");
    }
    if chain.is_empty() {
        return Some(rules.client_ip_value.clone());
    }
    chain.extend_from_slice(rules.client_ip.as_bytes());
    HeaderValue::from_maybe_shared(Bytes::from(chain)).ok()
}

/// The headers keel sets on a head sent as a map ([`rewrite_to_parts`], [`rewrite_h2`]), as
/// [`rewrite`] writes them as text.
struct OwnHeaders {
    /// The client sent `X-Real-IP` (replaced when the client is not trusted).
    real_ip: bool,
    /// The client's valid `x-request-id`; a new one is made when it has none.
    request_id: Option<HeaderValue>,
    forwarded_for: Option<HeaderValue>,
    forwarded_host: Option<HeaderValue>,
    body: BodyFraming,
    /// The client sent `Content-Length: 0`.
    length_zero: bool,
}

impl OwnHeaders {
    fn insert(self, h: &mut hyper::HeaderMap, rules: &RequestRules<'_>) {
        if self.real_ip && !rules.trust_forwarded {
            h.insert(X_REAL_IP, rules.client_ip_value.clone());
        }
        if rules.request_id {
            let id = self
                .request_id
                .or_else(|| HeaderValue::from_bytes(&new_request_id()).ok());
            if let Some(mut id) = id {
                // A value new on every request never repeats: HPACK would search its table for
                // it and then insert it, evicting entries that do repeat. Sent as a literal.
                id.set_sensitive(true);
                h.insert(X_REQUEST_ID, id);
            }
        }
        if let Some(v) = self.forwarded_for {
            h.insert(X_FORWARDED_FOR, v);
        }
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static(rules.proto));
        if let Some(v) = self.forwarded_host {
            h.insert(X_FORWARDED_HOST, v);
        }
        match self.body {
            BodyFraming::Length(n) => {
                h.insert(CONTENT_LENGTH, HeaderValue::from(n));
            }
            // A `content-length: 0` is kept as such (some servers want a length on POST).
            BodyFraming::None if self.length_zero => {
                h.insert(CONTENT_LENGTH, HeaderValue::from_static("0"));
            }
            _ => {}
        }
    }
}

/// Checks an HTTP/1.1 client's request bound for an HTTP/2 endpoint and builds the head its
/// leg sends, by the rules [`rewrite`] writes as text, with no text between: the headers
/// [`passed_on`] and keel's own in a map, `Host` (or an absolute-form target's authority) as
/// the target's authority, no transfer coding (the leg frames the body in DATA frames) and no
/// `Upgrade` (HTTP/2 has none). `raw` is the client's head, which `method`, `path`,
/// `authority` and the fields are slices of: it is copied once, and every name's value and
/// the target are slices of that copy. See [`scan`] for the other arguments.
pub(crate) fn rewrite_to_parts<'h, I>(
    method: &'h str,
    path: &'h str,
    authority: Option<&'h str>,
    http10: bool,
    fields: impl Fn() -> I,
    rules: &RequestRules<'_>,
    raw: &'h [u8],
) -> Result<(RequestHead, Parts), Reject>
where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    let normal = normal_path(path)?;
    let (meta, s) = scan(method, &normal, authority, http10, false, &fields, rules)?;
    let shared = Bytes::copy_from_slice(raw);
    // A slice of the copy where `part` is one of `raw` (always, but for a normalised path).
    let share = |part: &[u8]| {
        let start = (part.as_ptr() as usize).wrapping_sub(raw.as_ptr() as usize);
        match start.checked_add(part.len()) {
            Some(end) if end <= raw.len() => shared.slice(start..end),
            _ => Bytes::copy_from_slice(part),
        }
    };
    let value = |v: &[u8]| HeaderValue::from_maybe_shared(share(v)).map_err(|_| Reject::Malformed);
    let named = &s.named[..s.n_named];
    let mut h = hyper::HeaderMap::with_capacity(16);
    for (name, v) in fields() {
        if passed_on(name, named, true, rules) {
            let mut v = value(v)?;
            // A value new on every request never repeats: sent as a literal (see `rewrite_h2`).
            if name.eq_ignore_ascii_case("traceparent") {
                v.set_sensitive(true);
            }
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| Reject::Malformed)?;
            h.append(name, v);
        }
    }
    let host = authority.map(str::as_bytes).or(s.host);
    let request_id = match s.request_id {
        Some(id) if rules.request_id => Some(value(id)?),
        _ => None,
    };
    let xff = fields().filter(|(n, _)| n.eq_ignore_ascii_case("x-forwarded-for"));
    let forwarded_for = forwarded_for(xff.map(|(_, v)| v), rules);
    let own = OwnHeaders {
        real_ip: s.real_ip,
        request_id,
        forwarded_for: Some(forwarded_for.ok_or(Reject::Malformed)?),
        forwarded_host: host.map(value).transpose()?,
        body: meta.body,
        length_zero: s.content_length == Some(0),
    };
    own.insert(&mut h, rules);
    let mut uri = hyper::http::uri::Parts::default();
    uri.path_and_query = Some(
        hyper::http::uri::PathAndQuery::from_maybe_shared(share(normal.as_bytes()))
            .map_err(|_| Reject::Malformed)?,
    );
    if let Some(host) = host {
        uri.scheme = Some(hyper::http::uri::Scheme::HTTP);
        uri.authority =
            Some(Authority::from_maybe_shared(share(host)).map_err(|_| Reject::Malformed)?);
    }
    let (mut parts, ()) = hyper::Request::new(()).into_parts();
    parts.method = hyper::Method::from_bytes(method.as_bytes()).map_err(|_| Reject::Malformed)?;
    parts.uri = hyper::Uri::from_parts(uri).map_err(|_| Reject::Malformed)?;
    parts.headers = h;
    Ok((meta, parts))
}

/// True if an `Upgrade` value lists `h2c`.
fn names_h2c(protocols: &[u8]) -> bool {
    protocols.split(|b| *b == b',').any(|p| {
        let p = p.trim_ascii();
        let name = p.split(|b| *b == b'/').next().unwrap_or(p);
        name.eq_ignore_ascii_case(b"h2c")
    })
}

/// Checks an HTTP/2 client's request and edits its head in place into what the endpoint gets,
/// by the rules [`rewrite`] writes as text: the headers not [`passed_on`] removed, keel's own
/// inserted, `Host` (if the client sent one in place of `:authority`) moved into the target's
/// authority, `content-length` as the body is framed. No transfer coding: a chunked body is
/// the HTTP/1.1 leg's to frame. Only what changes is touched; the rest stays as hyper parsed it.
pub(crate) fn rewrite_h2(
    parts: &mut Parts,
    unframed_body: bool,
    rules: &RequestRules<'_>,
) -> Result<RequestHead, Reject> {
    let raw_path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    if let std::borrow::Cow::Owned(normal) = normal_path(raw_path)? {
        let mut uri = std::mem::take(&mut parts.uri).into_parts();
        uri.path_and_query = Some(normal.parse().map_err(|_| Reject::Malformed)?);
        parts.uri = hyper::Uri::from_parts(uri).map_err(|_| Reject::Malformed)?;
    }
    let headers = &parts.headers;
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let authority = parts.uri.authority().map(|a| a.as_str());
    let fields = || headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes()));
    let (meta, s) = scan(
        parts.method.as_str(),
        path,
        authority,
        false,
        unframed_body,
        fields,
        rules,
    )?;
    if s.n_named > 0 {
        // A connection-specific header (RFC 9113 section 8.2.2).
        return Err(Reject::Malformed);
    }
    // What the edits need, read before the map changes under them.
    let moved_host = match (authority, s.host) {
        (None, Some(h)) => Some(Authority::try_from(h).map_err(|_| Reject::Malformed)?),
        _ => None,
    };
    let forwarded_host = authority
        .map(str::as_bytes)
        .or(s.host)
        .and_then(|h| HeaderValue::from_bytes(h).ok());
    let xff = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .map(|v| v.as_bytes());
    let own = OwnHeaders {
        real_ip: s.real_ip,
        request_id: match s.request_id {
            Some(_) if rules.request_id => headers
                .get_all(&X_REQUEST_ID)
                .iter()
                .find(|v| valid_request_id(v.as_bytes()))
                .cloned(),
            _ => None,
        },
        forwarded_for: forwarded_for(xff, rules),
        forwarded_host,
        body: meta.body,
        length_zero: s.content_length == Some(0),
    };
    let drops = headers
        .keys()
        .any(|n| !passed_on(n.as_str(), &[], true, rules));

    let h = &mut parts.headers;
    if drops {
        // One removal per name (all its values): bounded by the names `passed_on` drops.
        while let Some(name) = h
            .keys()
            .find(|n| !passed_on(n.as_str(), &[], true, rules))
            .cloned()
        {
            h.remove(&name);
        }
    }
    own.insert(h, rules);
    if let Some(a) = moved_host {
        let mut uri = parts.uri.clone().into_parts();
        uri.authority = Some(a);
        crate::exchange::head::set_uri(parts, uri);
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(trust_forwarded: bool) -> RequestRules<'static> {
        RequestRules {
            client_ip: "127.0.0.1",
            client_ip_value: Box::leak(Box::new(HeaderValue::from_static("127.0.0.1"))),
            proto: "http",
            trust_forwarded,
            hash_header: None,
            hash_path: false,
            max_headers: 32,
            max_body: 1 << 20,
            request_id: true,
            join_cookies: false,
        }
    }

    /// One request rewritten both ways: as the text an HTTP/1.1 endpoint gets and as the map
    /// an HTTP/2 one gets.
    fn both_ways(raw: &[u8], rules: &RequestRules<'_>) -> (RequestHead, Vec<u8>, Parts) {
        let mut fields = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut fields);
        let n = req.parse(raw).unwrap().unwrap();
        let (method, target) = (req.method.unwrap(), req.path.unwrap());
        let (path, authority) = crate::exchange::request::request_target(method, target).unwrap();
        let http10 = req.version == Some(0);
        let fields = || req.headers.iter().map(|h| (h.name, h.value));
        let mut text = Vec::new();
        let meta = rewrite(
            method, path, authority, http10, false, fields, rules, &mut text,
        );
        let (meta_too, parts) =
            rewrite_to_parts(method, path, authority, http10, fields, rules, &raw[..n]).unwrap();
        assert_eq!(meta.unwrap(), meta_too);
        (meta_too, text, parts)
    }

    #[test]
    fn an_http2_endpoint_gets_the_headers_an_http1_endpoint_gets_as_a_map() {
        let cases: [(&[u8], bool); 9] = [
            (b"GET /a/./b/../c?q=1 HTTP/1.1\r\nHost: app.example\r\nX-One: 1\r\nx-one: 2\r\nCookie: s=1\r\nX-Request-Id: abc-1\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nHost: a\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nTE: trailers\r\nProxy-Authorization: b\r\nKeep-Alive: 5\r\nX-Request-Id: r2\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\nx-forwarded-for: 10.0.0.2\r\nX-Forwarded-Proto: ftp\r\nX-Real-IP: 1.2.3.4\r\nForwarded: for=x\r\nX-Request-Id: r3\r\n\r\n", true),
            (b"GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.0.0.1\r\nX-Real-IP: 1.2.3.4\r\nForwarded: for=x\r\nX-Request-Id: r4\r\n\r\n", false),
            (b"GET http://b.example:8080/x?y HTTP/1.1\r\nHost: ignored\r\nX-Request-Id: r5\r\n\r\n", true),
            (b"POST /u HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\nX-Request-Id: r6\r\n\r\n", true),
            (b"POST /u HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nX-Request-Id: r7\r\n\r\n", true),
            (b"POST /u HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nX-Request-Id: r8\r\n\r\n", true),
            (b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nTraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX-Request-Id: r9\r\n\r\n", true),
        ];
        for (raw, trust) in cases {
            let (meta, text, parts) = both_ways(raw, &rules(trust));
            let shown = String::from_utf8_lossy(raw);
            // The text's header lines, but for what HTTP/2 carries elsewhere or not at all:
            // `Host` (the authority), the transfer coding (DATA frames), an upgrade's two.
            let mut lines: Vec<(String, Vec<u8>)> = crate::codec::head::header_lines(&text)
                .map(|(n, v, _)| (String::from_utf8_lossy(n).to_ascii_lowercase(), v.to_vec()))
                .collect();
            let host = lines
                .iter()
                .find(|(n, _)| n == "host")
                .map(|(_, v)| v.clone());
            lines.retain(|(n, _)| {
                !["host", "transfer-encoding", "connection", "upgrade"].contains(&n.as_str())
            });
            let mut map: Vec<(String, Vec<u8>)> = parts
                .headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                .collect();
            lines.sort();
            map.sort();
            assert_eq!(lines, map, "{shown}");
            assert_eq!(
                parts
                    .uri
                    .authority()
                    .map(|a| a.as_str().as_bytes().to_vec()),
                host,
                "{shown}"
            );
            let target = crate::exchange::head::HeadView::Lines(&text).target();
            assert_eq!(
                parts.uri.path_and_query().unwrap().as_str().as_bytes(),
                target
            );
            assert_eq!(
                parts.method.as_str().as_bytes(),
                &text[..text.iter().position(|b| *b == b' ').unwrap()]
            );
            // Values new on every request go as HPACK literals, not table entries.
            for name in ["x-request-id", "traceparent"] {
                assert!(
                    parts.headers.get_all(name).iter().all(|v| v.is_sensitive()),
                    "{name}"
                );
            }
            if meta.body == BodyFraming::Chunked {
                assert!(!parts.headers.contains_key(CONTENT_LENGTH), "{shown}");
            }
        }
        // An HTTP/1.0 client may send no `Host`: the target has no authority, and each try
        // names its endpoint.
        let (meta, _, parts) = both_ways(b"GET /old HTTP/1.0\r\n\r\n", &rules(true));
        assert!(!meta.has_host && parts.uri.authority().is_none());
        assert_eq!(parts.uri.to_string(), "/old");
    }

    #[test]
    fn paths_are_normalised_as_rfc_3986_resolves_dot_segments() {
        let n = |p: &'static str| normal_path(p).map(|c| c.into_owned());
        // Nothing to do: borrowed, not copied.
        for p in [
            "/",
            "/a/b",
            "/a/b/",
            "/.well-known/x",
            "/a..b/c.",
            "/a%2Fb",
            "/caf%C3%A9",
            "*",
            "/a?x=/../",
        ] {
            assert!(
                matches!(normal_path(p), Ok(std::borrow::Cow::Borrowed(_))),
                "{p}"
            );
        }
        let cases = [
            ("/a/./b", "/a/b"),
            ("/a/b/../c", "/a/c"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/a/..", "/"),
            ("//a///b//", "/a/b/"),
            ("/v1/%2e%2E/admin", "/admin"),
            ("/v1/%2e/x", "/v1/x"),
            ("/v1/.%2e/x?q=/../..", "/x?q=/../.."),
            ("/a%2eb/./c", "/a.b/c"),
            ("/public/../admin", "/admin"),
            ("/%61dmin", "/admin"),
            ("/%41%7a%30%2D%5f%7E", "/Az0-_~"),
            ("/a%2fb%3f%23%25/c", "/a%2Fb%3F%23%25/c"),
            ("/caf%c3%a9?x=%61", "/caf%C3%A9?x=%61"),
            ("/a%zz%4", "/a%zz%4"),
            ("/a/b#frag/../x", "/a/b"),
            ("/a/../b?q=1#f", "/b?q=1"),
            ("/%2e%2E%2f", "/..%2F"),
        ];
        for (p, want) in cases {
            assert_eq!(n(p).as_deref(), Ok(want), "{p}");
        }
        for p in ["/..", "/a/../..", "/v1/../../admin", "/%2e%2e/x", "//../x"] {
            assert_eq!(n(p), Err(Reject::PathAboveRoot), "{p}");
        }
    }
}
