//! What a request is, as the front ends, the driver and the legs know it: the client, the
//! body as a leg sends it, the route it took, what was learned of its head
//! ([`RequestHead`]), and why it may be refused ([`Reject`], turned into a status and a cause
//! in one place). The rules that make a client's head the endpoint's are in
//! `exchange::rewrite`; the head's two forms in `exchange::head`.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};

use tokio::time::Sleep;

use crate::config::{ErrorDetail, ListenerConfig};
use crate::io::{until, BodyProgress};

/// A client connection, as the driver needs to know it.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    /// The client's address.
    pub peer: SocketAddr,
    /// Its IP as text, for `X-Forwarded-For`.
    pub ip: String,
    /// The same as a header value, made once per connection (an HTTP/2 client's requests
    /// share it).
    pub ip_value: hyper::header::HeaderValue,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'static str,
    /// The client is one of the listener's `trusted_proxies`.
    pub trust_forwarded: bool,
    /// Then the listener's `trusted_hops`: the client is the `X-Forwarded-For` entry this
    /// many from the right of the header as received.
    pub trusted_hops: u8,
    /// The worker thread serving the connection (its stack in every endpoint's pool).
    pub worker: usize,
    /// How much of a failure's cause keel's own answers show.
    pub error_detail: ErrorDetail,
    /// The certificate the client presented, verified against the listener's `client_ca`
    /// (read once at the handshake; `None` without one).
    pub client_cert: Option<std::sync::Arc<crate::tls::ClientCert>>,
    /// `Alt-Svc` for the answers (a TLS listener that serves HTTP/3 too, to its TCP clients).
    pub alt_svc: Option<hyper::header::HeaderValue>,
}

/// A request body as a leg sends it.
pub(crate) trait RequestBody {
    /// The whole body, when it is in memory: sent in one write with the head, and again on a
    /// retry. (Streamed bodies have none.)
    fn inline(&self) -> Option<&[u8]> {
        None
    }
    /// The next piece of a streamed body; empty at its end. An error is the client's fault.
    async fn next_piece(&mut self) -> Result<&[u8], Reject>;
    /// True once a piece of a streamed body was handed out (it cannot be sent again).
    fn started(&self) -> bool;
    /// True while a piece is being read from the client: a try that runs out of time then
    /// waited on the client, not on the endpoint.
    fn waiting_on_client(&self) -> bool {
        false
    }
    /// Makes the body ready to be sent again from its start, for another try; false if it
    /// cannot be (part of a streamed body is gone).
    fn rewind(&mut self) -> bool {
        self.inline().is_some() || !self.started()
    }
    /// The trailers that ended the body, once [`Self::next_piece`] returned its end
    /// (HTTP/2 clients).
    fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        None
    }
    /// The client may wait for the response before it ends its body (an HTTP/2 stream, a
    /// bidirectional gRPC call): the HTTP/2 leg then returns at the response head and the
    /// front end sends the rest.
    fn full_duplex(&self) -> bool {
        false
    }
}

/// A body that is all in memory (or empty).
impl RequestBody for &[u8] {
    fn inline(&self) -> Option<&[u8]> {
        Some(self)
    }
    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        Ok(std::mem::take(self))
    }
    fn started(&self) -> bool {
        false
    }
}

/// Which target a request was routed to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum RouteRef {
    /// No route matched and the listener has no `cluster`: `404`.
    #[default]
    NotFound,
    /// No route matched: the listener's `cluster`.
    Listener,
    /// This route (its index in the listener's `route` list), and the side of its `split`
    /// chosen (0 without one).
    Route(u16, u8),
}

impl RouteRef {
    /// The route's index, if a route matched.
    pub fn index(self) -> Option<u16> {
        match self {
            RouteRef::Route(i, _) => Some(i),
            _ => None,
        }
    }
}

/// Why a request is refused before it reaches any endpoint. The connection is closed after
/// the answer (the client may not agree with keel on where the next request starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reject {
    /// Not an HTTP/1.x request line and headers.
    Malformed,
    /// More header lines than `max_headers`.
    TooManyHeaders,
    /// A head longer than `max_header_bytes`.
    HeadTooLarge,
    /// A `Content-Length` that is not a number.
    InvalidContentLength,
    /// More than one `Content-Length` header, even equal ones: RFC 9112 section 6.3 lets a
    /// recipient merge equal values, but a hop that merges next to one that does not is how
    /// requests are smuggled; refused, as NGINX does.
    RepeatedContentLength,
    /// Both `Content-Length` and `Transfer-Encoding` (RFC 9112 section 6.3: a request
    /// smuggling vector; refused, as NGINX does).
    LengthAndTransferEncoding,
    /// A `Transfer-Encoding` whose last coding is not `chunked`, or one in HTTP/1.0: the body's
    /// end cannot be known (RFC 9112 section 6.3).
    TransferEncodingNotChunked,
    /// A transfer coding before `chunked` (e.g. `gzip, chunked`), which keel does not forward.
    UnsupportedTransferEncoding,
    /// An `Expect` other than `100-continue`.
    UnsupportedExpectation,
    /// HTTP/1.1 without `Host` (and not in absolute form).
    MissingHost,
    /// More than one `Host`.
    DuplicateHost,
    /// A `Host` or authority that is not a valid `host[:port]`.
    InvalidHost,
    /// More `Connection` options than keel tracks.
    TooManyConnectionOptions,
    /// A target that is neither origin form nor an `http(s)://` absolute form (nor `*` for
    /// `OPTIONS`).
    UnsupportedTarget,
    /// A path whose `..` segments climb above the root (`/a/../../b`), as NGINX refuses.
    PathAboveRoot,
    /// `CONNECT`: keel is a reverse proxy, not a tunnel to anywhere.
    Connect,
    /// A body declared or found larger than `max_request_body_bytes`.
    BodyTooLarge,
    /// A chunked body that is malformed, or a body cut short by the client.
    InvalidBody,
    /// A read of the body waited longer than `client_idle_timeout`.
    Timeout,
    /// The body arrived slower than `request_body_timeout` and `request_body_min_rate` allow.
    BodyTooSlow,
    /// The body was still arriving at the request's `max_duration`.
    BodyPastMaxDuration,
}

impl Reject {
    /// The status keel answers with.
    pub fn status(self) -> u16 {
        match self {
            Reject::TooManyHeaders | Reject::HeadTooLarge | Reject::TooManyConnectionOptions => 431,
            Reject::BodyTooLarge => 413,
            Reject::UnsupportedTransferEncoding | Reject::Connect => 501,
            Reject::UnsupportedExpectation => 417,
            Reject::Timeout | Reject::BodyTooSlow | Reject::BodyPastMaxDuration => 408,
            Reject::Malformed
            | Reject::InvalidContentLength
            | Reject::RepeatedContentLength
            | Reject::LengthAndTransferEncoding
            | Reject::TransferEncodingNotChunked
            | Reject::MissingHost
            | Reject::DuplicateHost
            | Reject::InvalidHost
            | Reject::UnsupportedTarget
            | Reject::PathAboveRoot
            | Reject::InvalidBody => 400,
        }
    }

    /// The cause, one line (no client data in it).
    pub fn cause(self) -> &'static str {
        match self {
            Reject::Malformed => "malformed request head",
            Reject::TooManyHeaders => "more request headers than max_headers",
            Reject::HeadTooLarge => "request head larger than max_header_bytes",
            Reject::InvalidContentLength => "invalid Content-Length",
            Reject::RepeatedContentLength => "repeated Content-Length header",
            Reject::LengthAndTransferEncoding => {
                "both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)"
            }
            Reject::TransferEncodingNotChunked => {
                "Transfer-Encoding must end in chunked, and needs HTTP/1.1"
            }
            Reject::UnsupportedTransferEncoding => "only the chunked transfer coding is supported",
            Reject::UnsupportedExpectation => "only Expect: 100-continue is supported",
            Reject::MissingHost => "Host header missing (required since HTTP/1.1)",
            Reject::DuplicateHost => "more than one Host header",
            Reject::InvalidHost => "invalid Host or authority (not a host[:port])",
            Reject::TooManyConnectionOptions => "too many Connection options",
            Reject::UnsupportedTarget => "unsupported request target",
            Reject::PathAboveRoot => "the path's dot segments climb above the root",
            Reject::Connect => "CONNECT is not supported (keel is a reverse proxy)",
            Reject::BodyTooLarge => "request body larger than max_request_body_bytes",
            Reject::InvalidBody => "the request body is malformed or was cut short",
            Reject::Timeout => {
                "the request's body stalled: nothing arrived within client_idle_timeout"
            }
            Reject::BodyTooSlow => {
                "the request's body was too slow: not all in within request_body_timeout \
                 (plus a second per request_body_min_rate bytes)"
            }
            Reject::BodyPastMaxDuration => "the request's body was still arriving at max_duration",
        }
    }
}

/// What the rewrite needs to know about the client and the listener.
pub(crate) struct RequestRules<'a> {
    /// The client's IP, for `X-Forwarded-For`.
    pub client_ip: &'a str,
    /// The same as a header value.
    pub client_ip_value: &'a hyper::header::HeaderValue,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'static str,
    /// The client is a trusted proxy (`trusted_proxies`): its `X-Forwarded-For` is kept and
    /// appended to. From any other client the header is replaced.
    pub trust_forwarded: bool,
    /// Hash on this header's value (lower-case name).
    pub hash_header: Option<&'a str>,
    /// Hash on the path (without the query).
    pub hash_path: bool,
    /// Most headers accepted (`max_headers`).
    pub max_headers: usize,
    /// Largest body accepted (`max_request_body_bytes`; `u64::MAX`: none).
    pub max_body: u64,
    /// Make an `x-request-id` when the client sent none (`generate_request_id`).
    pub request_id: bool,
    /// Send several `cookie` fields to an HTTP/1.1 endpoint as one line (an HTTP/2 client's:
    /// RFC 9113 section 8.2.3); an HTTP/1.1 client's repeated lines pass as sent.
    pub join_cookies: bool,
}

impl<'a> RequestRules<'a> {
    /// The rules for a request from `client` to a cluster that hashes on `hash_on`.
    pub fn new(
        client: &'a Client,
        hash_on: Option<&'a crate::config::HashOn>,
        max_headers: usize,
        max_body: u64,
    ) -> Self {
        let (hash_header, hash_path) = hash_rule(hash_on);
        Self {
            client_ip: &client.ip,
            client_ip_value: &client.ip_value,
            proto: client.proto,
            trust_forwarded: client.trust_forwarded,
            hash_header,
            hash_path,
            max_headers,
            max_body,
            request_id: true,
            join_cookies: false,
        }
    }
}

/// Where a cluster hashing on `hash_on` takes the key: a header's name, or the path.
pub(crate) fn hash_rule(hash_on: Option<&crate::config::HashOn>) -> (Option<&str>, bool) {
    match hash_on {
        Some(crate::config::HashOn::Header(h)) => (Some(h.as_str()), false),
        Some(crate::config::HashOn::Path) => (None, true),
        _ => (None, false),
    }
}

/// How a request body is delimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    /// No body.
    #[default]
    None,
    /// This many bytes (`Content-Length`).
    Length(u64),
    /// Chunked (HTTP/1.1), or of unknown length (HTTP/2 without `content-length`).
    Chunked,
}

/// A request head, checked and rewritten.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RequestHead {
    /// Bytes of the head, final CRLF included (HTTP/1.1 clients).
    pub head_len: usize,
    /// How the body is delimited.
    pub body: BodyFraming,
    /// The method may be sent twice with the effect of once (RFC 9110 section 9.2.2).
    pub idempotent: bool,
    /// `HEAD`: the response has no body whatever its headers say.
    pub is_head: bool,
    /// The client wants the connection kept after the response.
    pub keep_alive: bool,
    /// HTTP/1.0 client (no chunked responses).
    pub http10: bool,
    /// HTTP/2 client: an HTTP/1.1 endpoint's response head is read into a header map, the
    /// form its renderer takes, not written as text.
    pub http2: bool,
    /// `Host` was sent (else the endpoint's address is used).
    pub has_host: bool,
    /// The client waits for `100 Continue` before it sends the body.
    pub expect_continue: bool,
    /// The hash-strategy key's bytes were found: their hash.
    pub hash: Option<u64>,
    /// The route chosen (HTTP/1.1 clients, when the rules had routes).
    pub route: RouteRef,
    /// An HTTP/1.1 `GET` with `Connection: upgrade` and `Upgrade` (WebSocket and the like):
    /// both are forwarded, and a `101` makes the connection a tunnel.
    pub upgrade: bool,
    /// The `Upgrade` value asked for: a `101` must switch to one of its protocols.
    pub upgrade_to: UpgradeTo,
    /// A gRPC call (`content-type: application/grpc*`): its outcome is its `grpc-status`,
    /// and keel's own failures are answered as gRPC statuses.
    pub grpc: bool,
}

/// An `Upgrade` request value, kept inline (no allocation per request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct UpgradeTo {
    len: u8,
    bytes: [u8; UpgradeTo::MAX],
}

impl UpgradeTo {
    /// Longest `Upgrade` value passed on (`websocket` is 9 bytes); a longer one is not an
    /// upgrade keel forwards.
    pub const MAX: usize = 32;

    pub(crate) fn new(value: &[u8]) -> Option<Self> {
        let value = value.trim_ascii();
        let mut u = UpgradeTo::default();
        u.bytes.get_mut(..value.len())?.copy_from_slice(value);
        u.len = value.len() as u8;
        Some(u)
    }

    /// True if a `101`'s `Upgrade` value names only protocols this request asked for
    /// (RFC 9110 section 7.8), compared without case.
    pub fn allows(&self, answered: &[u8]) -> bool {
        let asked = &self.bytes[..usize::from(self.len)];
        let mut any = false;
        for p in answered.split(|b| *b == b',') {
            let p = p.trim_ascii();
            if p.is_empty() {
                continue;
            }
            any = true;
            if !asked
                .split(|b| *b == b',')
                .any(|a| a.trim_ascii().eq_ignore_ascii_case(p))
            {
                return false;
            }
        }
        any
    }
}

/// Longest client `x-request-id` passed on; a longer or non-printable one is replaced.
pub(crate) const MAX_REQUEST_ID: usize = 64;

/// 64 random-looking bits: unique, not secret. Each thread steps its own SplitMix64 sequence
/// from a random start. The one generator of request ids and trace ids.
pub(crate) fn random_u64() -> u64 {
    use std::cell::Cell;
    use std::hash::{BuildHasher, Hasher};
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            std::collections::hash_map::RandomState::new().build_hasher().finish(),
        );
    }
    STATE.with(|s| {
        let x = s.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        s.set(x);
        mix64(x)
    })
}

/// SplitMix64's output function: a bijection of 64 bits that spreads every input bit.
pub(crate) fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A new request id: 128 random-looking bits ([`random_u64`]) in UUID version 4 form. The
/// one generator of request ids (the `x-request-id` keel adds, and `$request_id` in
/// rewrites).
pub(crate) fn new_request_id() -> [u8; 36] {
    let hi = (random_u64() & !0xf000) | 0x4000; // version 4
    let lo = (random_u64() & !(0b11 << 62)) | (0b10 << 62); // RFC 4122 variant
    let (h, l) = (hex16(hi), hex16(lo));
    // 8-4-4-4-12.
    let mut id = [b'-'; 36];
    id[..8].copy_from_slice(&h[..8]);
    id[9..13].copy_from_slice(&h[8..12]);
    id[14..18].copy_from_slice(&h[12..]);
    id[19..23].copy_from_slice(&l[..4]);
    id[24..].copy_from_slice(&l[4..]);
    id
}

/// `x` as 16 lowercase hex digits, most significant first, a byte lane per digit (no loop:
/// this runs for every request).
pub(crate) fn hex16(x: u64) -> [u8; 16] {
    // Each half's 8 nibbles spread to the low nibbles of 8 bytes, the first digit highest.
    fn spread(x: u32) -> u64 {
        let x = u64::from(x);
        let x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
        let x = (x | (x << 8)) & 0x00ff_00ff_00ff_00ff;
        (x | (x << 4)) & 0x0f0f_0f0f_0f0f_0f0f
    }
    let digits = |n: u64| {
        // Nibbles of 10 and more get 'a' - 10, the others '0'.
        let letters = ((n + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
        n + 0x3030_3030_3030_3030 + letters * (b'a' - b'0' - 10) as u64
    };
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&digits(spread((x >> 32) as u32)).to_be_bytes());
    out[8..].copy_from_slice(&digits(spread(x as u32)).to_be_bytes());
    out
}

/// The request target a front end accepts, as the path sent on and an absolute-form target's
/// authority. The one check of a request's method and target, for every front end (an
/// HTTP/1.1 request line; HTTP/2's `:method` and `:path`, `path` empty when there is none):
/// `CONNECT` is refused (`501`: keel is a reverse proxy, not a tunnel, and a tunnel's bytes
/// must never reach a pooled endpoint connection); the target is origin form (`/path?query`),
/// `*` for `OPTIONS` only (forwarded as `OPTIONS *`), or an `http(s)://` absolute form (RFC
/// 9112 section 3.2.2: a server must accept it), whose authority then stands for `Host`.
/// Anything else, `GET *` included, is `400`.
pub(crate) fn request_target<'t>(
    method: &str,
    target: &'t str,
) -> Result<(&'t str, Option<&'t str>), Reject> {
    if method == "CONNECT" {
        return Err(Reject::Connect);
    }
    if target.starts_with('/') {
        return Ok((target, None));
    }
    if target == "*" {
        return if method == "OPTIONS" {
            Ok((target, None))
        } else {
            Err(Reject::UnsupportedTarget)
        };
    }
    let (scheme, rest) = target.split_once("://").ok_or(Reject::UnsupportedTarget)?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err(Reject::UnsupportedTarget);
    }
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    if path.starts_with('?') {
        return Err(Reject::UnsupportedTarget);
    }
    if !valid_authority(authority.as_bytes()) {
        return Err(Reject::InvalidHost);
    }
    Ok((if path.is_empty() { "/" } else { path }, Some(authority)))
}

/// Bytes allowed in a host name: RFC 3986's unreserved characters (letters, digits, `-`, `.`,
/// `_`, `~`). Its sub-delimiters and percent-encoding are refused: no DNS name has them, and
/// a `,` or `;` would be read as a list by whoever gets `X-Forwarded-Host` or a redirect.
const HOST_BYTE: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        t[b] = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~');
        b += 1;
    }
    t
};

/// True if `v` is a valid `Host` or `:authority`: `host[:port]`, the host a name of
/// [`HOST_BYTE`]s or a bracketed IPv6 address, the port 1 to 5 digits up to 65535. No
/// user info (`@`), no path or query (`/`, `?`), no spaces or control bytes, no empty port.
/// Checked before a request is routed or rewritten, so that nothing invalid is forwarded or
/// reflected into a redirect.
pub(crate) fn valid_authority(v: &[u8]) -> bool {
    // The host (checked here), then what follows it: nothing, or `:` and the port.
    let rest = if v.first() == Some(&b'[') {
        let Some(close) = v.iter().position(|b| *b == b']') else {
            return false;
        };
        let inside = &v[1..close];
        if inside.len() < 2
            || !inside
                .iter()
                .all(|b| b.is_ascii_hexdigit() || *b == b':' || *b == b'.')
        {
            return false;
        }
        &v[close + 1..]
    } else {
        // One pass: `:` is not a host byte, so the host ends at the port's colon.
        let host = v
            .iter()
            .position(|b| !HOST_BYTE[usize::from(*b)])
            .unwrap_or(v.len());
        if host == 0 {
            return false;
        }
        &v[host..]
    };
    match rest {
        [] => true,
        [b':', port @ ..] => {
            port.len() <= 5
                && port
                    .iter()
                    .try_fold(0u32, |n, d| {
                        d.is_ascii_digit().then(|| n * 10 + u32::from(d - b'0'))
                    })
                    .is_some_and(|n| !port.is_empty() && n <= 65535)
        }
        _ => false,
    }
}

pub(crate) use crate::codec::parse_content_length;

/// The bounds of a request body's reads from its client, one model for every front end
/// (`client_idle_timeout` per read, `request_body_timeout` and `request_body_min_rate` for the
/// whole body, the cluster's `max_duration` for the whole request). A slow upload is cut by
/// its own bounds, never by a try's clock: time waiting on the client stops the try's clock
/// ([`BodyProgress`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct UploadBounds {
    /// Each read within this.
    pub idle: Duration,
    /// The whole body within this from the end of the head, plus a second per `min_rate`
    /// bytes received.
    pub total: Duration,
    /// Bytes a second that earn more time (0: none, `total` is a hard limit).
    pub min_rate: u64,
    /// The request's end (`max_duration` from its start), if any.
    pub max_end: Option<Instant>,
}

impl UploadBounds {
    /// A listener's bounds, for a request started at `start` to a cluster with `max_duration`.
    pub fn of(listener: &ListenerConfig, max_duration: Option<Duration>, start: Instant) -> Self {
        Self {
            idle: listener.client_idle_timeout,
            total: listener.request_body_timeout,
            min_rate: listener.request_body_min_rate,
            max_end: max_duration.map(|d| start + d),
        }
    }

    /// The deadline of a read starting `now`, for a body begun at `began` with `received`
    /// bytes in, and the refusal when it passes (which bound cut it).
    pub fn next_read(&self, began: Instant, received: u64, now: Instant) -> (Instant, Reject) {
        let mut due = (now + self.idle, Reject::Timeout);
        let earned = match self.min_rate {
            0 => Duration::ZERO,
            rate => Duration::from_secs_f64(received as f64 / rate as f64),
        };
        let whole = began + self.total + earned;
        if whole < due.0 {
            due = (whole, Reject::BodyTooSlow);
        }
        if let Some(end) = self.max_end.filter(|end| *end < due.0) {
            due = (end, Reject::BodyPastMaxDuration);
        }
        due
    }
}

/// A request body's reads from its client, as both front ends make them: each within
/// [`UploadBounds`], each reported to the driver's try clock ([`BodyProgress`]) so that the
/// client's time never counts against an endpoint's try.
pub(crate) struct Upload<'p> {
    bounds: UploadBounds,
    began: Instant,
    received: u64,
    reading: bool,
    /// Where the body is, for the driver's try clock; and the request's start it counts from.
    progress: Option<(&'p BodyProgress, Instant)>,
}

impl<'p> Upload<'p> {
    /// A body whose head ended at `began`.
    pub fn new(bounds: UploadBounds, began: Instant) -> Self {
        Self {
            bounds,
            began,
            received: 0,
            reading: false,
            progress: None,
        }
    }

    /// Reports each read to `progress` (times from `start`, the request's).
    pub fn with_progress(mut self, progress: &'p BodyProgress, start: Instant) -> Self {
        self.progress = Some((progress, start));
        self
    }

    /// A read from the client is under way.
    pub fn reading(&self) -> bool {
        self.reading
    }

    /// Counts `n` more bytes received (they earn time at `min_rate`).
    pub fn received(&mut self, n: u64) {
        self.received += n;
    }

    /// Runs one read from the client (`read`) within the bounds, on `timer`.
    pub async fn read<F: Future>(
        &mut self,
        timer: &mut Pin<Box<Sleep>>,
        read: F,
    ) -> Result<F::Output, Reject> {
        let (deadline, cut) = self
            .bounds
            .next_read(self.began, self.received, Instant::now());
        self.reading = true;
        if let Some((p, start)) = self.progress {
            p.mark(start.elapsed(), true);
        }
        let got = until(timer, deadline, read).await;
        self.reading = false;
        if let Some((p, start)) = self.progress {
            p.mark(start.elapsed(), false);
        }
        got.ok_or(cut)
    }
}

#[cfg(test)]
mod tests {
    use super::{request_target, valid_authority, Reject};

    #[test]
    fn hosts_are_a_host_and_an_optional_port() {
        for ok in [
            "a",
            "app.example",
            "app.example.",
            "APP-1_x.internal",
            "h:80",
            "h:65535",
            "10.0.0.1:8080",
            "[::1]",
            "[::1]:443",
            "[2001:db8::ffff:10.0.0.1]:1",
        ] {
            assert!(valid_authority(ok.as_bytes()), "{ok:?}");
        }
        for bad in [
            "", "a b", "evil/x", "evil?x", "evil#x", "u@h", "u:p@h", "h:", "h:65536", "h:123456",
            "h:8a", "h:-1", ":80", "[::1", "[::1]x", "[]", "[zz::1]", "a\tb", "a\0b", "a,b", "a;b",
            "%41", "h:80:80", "a\\b",
        ] {
            assert!(!valid_authority(bad.as_bytes()), "{bad:?}");
        }
    }

    /// `valid_authority` against a plain reading of its rule (split at the first `:` outside
    /// brackets, check each part on its own) on every string of up to 5 bytes from an
    /// alphabet of the bytes that matter.
    #[test]
    fn hosts_agree_with_the_rule_read_plainly() {
        fn plain(v: &[u8]) -> bool {
            let (host, port) = if v.first() == Some(&b'[') {
                let Some(close) = v.iter().position(|b| *b == b']') else {
                    return false;
                };
                let inside = &v[1..close];
                if inside.len() < 2
                    || !inside
                        .iter()
                        .all(|b| b.is_ascii_hexdigit() || b":.".contains(b))
                {
                    return false;
                }
                match &v[close + 1..] {
                    [] => return true,
                    [b':', port @ ..] => (&v[..=close], Some(port)),
                    _ => return false,
                }
            } else {
                match v.iter().position(|b| *b == b':') {
                    Some(colon) => (&v[..colon], Some(&v[colon + 1..])),
                    None => (v, None),
                }
            };
            let host_ok = host.first() == Some(&b'[')
                || (!host.is_empty()
                    && host
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || b"-._~".contains(b)));
            host_ok
                && port.is_none_or(|p| {
                    !p.is_empty()
                        && p.len() <= 5
                        && p.iter().all(u8::is_ascii_digit)
                        && std::str::from_utf8(p).unwrap().parse::<u32>().unwrap() <= 65535
                })
        }
        let alphabet = b"a9:[]. /@\x00";
        let mut checked = 0;
        let mut stack = vec![Vec::new()];
        while let Some(v) = stack.pop() {
            assert_eq!(
                valid_authority(&v),
                plain(&v),
                "{:?}",
                String::from_utf8_lossy(&v)
            );
            checked += 1;
            if v.len() < 5 {
                for b in alphabet {
                    let mut w = v.clone();
                    w.push(*b);
                    stack.push(w);
                }
            }
        }
        assert!(checked > 100_000, "{checked}");
        for edge in [
            "h:65535",
            "h:65536",
            "h:99999",
            "h:00080",
            "h:000080",
            "[::1]:65535",
        ] {
            assert_eq!(
                valid_authority(edge.as_bytes()),
                plain(edge.as_bytes()),
                "{edge}"
            );
        }
    }

    #[test]
    fn targets_are_origin_form_options_star_or_absolute_http() {
        assert_eq!(request_target("GET", "/a?b"), Ok(("/a?b", None)));
        assert_eq!(request_target("OPTIONS", "*"), Ok(("*", None)));
        assert_eq!(
            request_target("GET", "http://h:8/p"),
            Ok(("/p", Some("h:8")))
        );
        assert_eq!(request_target("GET", "HTTPS://h"), Ok(("/", Some("h"))));
        assert_eq!(request_target("CONNECT", "h:443"), Err(Reject::Connect));
        assert_eq!(request_target("CONNECT", "/"), Err(Reject::Connect));
        for bad in ["*", "", "a/b", "ftp://h/", "http://h?q"] {
            assert_eq!(
                request_target("GET", bad),
                Err(Reject::UnsupportedTarget),
                "{bad:?}"
            );
        }
        assert_eq!(
            request_target("GET", "http://u@h/"),
            Err(Reject::InvalidHost)
        );
        assert_eq!(request_target("GET", "http:///p"), Err(Reject::InvalidHost));
    }

    #[test]
    fn hex16_writes_what_format_writes() {
        let mut x = 0x0123_4567_89ab_cdefu64;
        for _ in 0..10_000 {
            let want = format!("{x:016x}");
            assert_eq!(std::str::from_utf8(&super::hex16(x)).unwrap(), want);
            x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17) ^ 0xdead_beef;
        }
        for x in [0, u64::MAX, 0xa0a0_a0a0_a0a0_a0a0, 0x0909_0909_0909_0909] {
            assert_eq!(
                std::str::from_utf8(&super::hex16(x)).unwrap(),
                format!("{x:016x}")
            );
        }
    }

    #[test]
    fn request_ids_are_uuid_v4_text_and_differ() {
        let ids: Vec<[u8; 36]> = (0..1000).map(|_| super::new_request_id()).collect();
        for id in &ids {
            let text = std::str::from_utf8(id).unwrap();
            let groups: Vec<&str> = text.split('-').collect();
            assert_eq!(
                groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
                [8, 4, 4, 4, 12]
            );
            assert!(groups.concat().bytes().all(|b| b.is_ascii_hexdigit()));
            assert_eq!(&text[14..15], "4", "version 4: {text}");
            assert!("89ab".contains(&text[19..20]), "RFC 4122 variant: {text}");
        }
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len());
    }
}
