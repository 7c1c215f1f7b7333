//! keel's HTTP/1.1 codec, sans I/O (in the shape of hyper's `proto::h1`): request heads parsed
//! in place ([`request`]), response heads read and rewritten ([`response`]), the one decoder of
//! a body by its framing ([`body`], over the chunked coding of [`chunked`]), the head writers
//! (here, [`response`]'s status line and framing, [`request`]'s head from a map), and the
//! reading of a written head's lines ([`head`]). It imports nothing of keel-proxy above it: the
//! front ends, legs and clients do the reads and writes and hand it bytes.
//!
//! Why keel has its own HTTP/1.1 codec (its I/O in `front::h1`, `leg::h1` and
//! `upstream::h1_client`): under load, hyper's server and client cost keel about twice
//! NGINX's CPU per request (a header map and channels per request, a timer per read, two
//! codecs; see BENCHMARKS.md). Here heads are parsed in place (`httparse`) and rewritten
//! straight into the bytes sent on, bodies pass through reused buffers, and a request's
//! upstream exchange runs in its client connection's task with reusable timers.

pub(crate) mod body;
pub(crate) mod chunked;
pub(crate) mod engine;
pub(crate) mod head;
pub(crate) mod pushback;
pub(crate) mod request;
pub(crate) mod response;

/// Response header naming the endpoint that answered (or that the last try went to).
pub const X_KEEL_ENDPOINT: hyper::header::HeaderName =
    hyper::header::HeaderName::from_static("x-keel-endpoint");

/// Headers that concern one connection only (RFC 9110 section 7.6.1), never forwarded
/// (lower-case).
pub(crate) const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    // RFC 9113 section 3.1's h2c upgrade, refused (see `exchange::request`).
    "http2-settings",
];

/// A response head buffer's first size: most heads fit.
const HEAD_SIZE: usize = 1024;

/// Gives an empty response head buffer room for a head, once: the buffer is made at the
/// first answer rather than with the connection, so that a connection waiting for its first
/// answer holds none (then it is kept, and this is one comparison).
pub(crate) fn reserve_head(out: &mut Vec<u8>) {
    out.reserve(HEAD_SIZE);
}

/// Appends `name: value\r\n`.
pub(crate) fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `date: <now>` (RFC 9110 section 6.6.1).
pub(crate) fn push_date(out: &mut Vec<u8>) {
    with_date(|v| push_header(out, b"date", v.as_bytes()));
}

/// `<now>` as a `date` value.
pub(crate) fn date_value() -> hyper::header::HeaderValue {
    with_date(Clone::clone)
}

/// Calls `f` with `<now>` as a `date` value, formatted at most once a second per thread.
fn with_date<R>(f: impl FnOnce(&hyper::header::HeaderValue) -> R) -> R {
    use hyper::header::HeaderValue;
    thread_local! {
        // (0, "") until first used: no clock reads 0 s since 1970.
        static TODAY: std::cell::RefCell<(u64, HeaderValue)> =
            const { std::cell::RefCell::new((0, HeaderValue::from_static(""))) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    TODAY.with_borrow_mut(|(at, value)| {
        if *at != secs || value.is_empty() {
            *at = secs;
            *value = HeaderValue::from_str(&httpdate::fmt_http_date(now))
                .expect("an HTTP date is a header value");
        }
        f(value)
    })
}

/// Appends `content-length: n\r\n`.
pub(crate) fn push_content_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    push_u64(out, n);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n` in decimal (without formatting machinery: this runs for every response).
pub(crate) fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// A `Content-Length` value: digits only (RFC 9110 section 8.6), no sign, no overflow.
pub(crate) fn parse_content_length(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}
