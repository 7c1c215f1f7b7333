//! What a route or a cluster does to the requests it serves besides choosing an endpoint:
//! local rate limits (`rate_limit`), and rewrites of requests and responses (paths, `Host`,
//! headers, redirects, `Location`).

use keel_balance::{FieldPath, InvalidField, Problem};
use std::fmt;

use serde::Deserialize;

/// `rate_limit = { rate, burst, key, max_keys, per_worker }` on a route or a cluster: a token
/// bucket; a request that finds it empty is answered `429 Too Many Requests` with
/// `Retry-After`, without trying an endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Requests a second the bucket refills with (may be fractional: `0.5` is one every 2 s).
    pub rate: f64,
    /// Most requests taken at once from a full bucket; default: one second's worth
    /// (`rate` rounded up, at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
    /// One bucket per client IP or per value of a header; unset: one bucket for all.
    #[serde(default)]
    pub key: Option<RateKey>,
    /// Most keys followed at once (a keyed limit); beyond, the key closest to a full bucket is
    /// forgotten. Bounds memory whatever the clients send.
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// Each worker thread has its own buckets, each with a worker's share of `rate` and
    /// `burst`: no state shared between threads, the limit exact only when connections spread
    /// evenly. Default: one set of buckets for the proxy.
    #[serde(default)]
    pub per_worker: bool,
}

fn default_max_keys() -> usize {
    10_000
}

/// Most keys a keyed limit may follow.
pub const MAX_RATE_KEYS: usize = 1 << 24;

/// The key of a keyed rate limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateKey {
    /// The client's IP address (the connection's peer).
    ClientIp,
    /// This request header's value (lower-case name); requests without it are not limited.
    Header(hyper::header::HeaderName),
}

impl<'de> Deserialize<'de> for RateKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "client-ip" => Ok(RateKey::ClientIp),
            _ => match s.strip_prefix("header:") {
                Some(name) => hyper::header::HeaderName::from_bytes(name.trim().as_bytes())
                    .map(RateKey::Header)
                    .map_err(|_| {
                        serde::de::Error::custom(format!("`{name}` is not a header name"))
                    }),
                None => Err(serde::de::Error::custom(format!(
                    "unknown key `{s}`; allowed: \"client-ip\", \"header:NAME\""
                ))),
            },
        }
    }
}

impl RateLimitConfig {
    /// The burst in force.
    pub fn burst(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.rate.ceil().clamp(1.0, f64::from(u32::MAX)) as u32)
    }

    /// Checks the values; paths are relative to the `rate_limit` table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !(self.rate.is_finite() && self.rate >= 0.001 && self.rate <= 1e9) {
            return Err(InvalidField::at(
                "rate",
                Problem::out_of_range("within 0.001..=1e9 (requests a second)", self.rate),
            ));
        }
        if self.burst == Some(0) {
            return Err(InvalidField::at(
                "burst",
                Problem::out_of_range("at least 1", 0),
            ));
        }
        if self.max_keys == 0 || self.max_keys > MAX_RATE_KEYS {
            return Err(InvalidField::at(
                "max_keys",
                Problem::out_of_range(format!("within 1..={MAX_RATE_KEYS}"), self.max_keys),
            ));
        }
        Ok(())
    }
}

/// `request_headers` / `response_headers = { add, set, remove }`: headers removed (every line
/// of these names), set (every line of the name replaced by one) and added (one more line),
/// in that order. Values may hold variables: `$client_ip`, `$request_id`, `$trace_id`, `$route`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderEdits {
    /// Headers added (beside any of the same name).
    #[serde(default)]
    pub add: std::collections::BTreeMap<String, String>,
    /// Headers set (replacing every one of the same name).
    #[serde(default)]
    pub set: std::collections::BTreeMap<String, String>,
    /// Headers removed.
    #[serde(default)]
    pub remove: Vec<String>,
}

/// `response_headers = { add, set, remove, endpoint }`: [`HeaderEdits`] of the responses, and
/// whether they name the endpoint that answered (`x-keel-endpoint`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseHeaders {
    /// Send `x-keel-endpoint` (the endpoint's address) with every response. Default off.
    #[serde(default)]
    pub endpoint: bool,
    /// Headers added.
    #[serde(default)]
    pub add: std::collections::BTreeMap<String, String>,
    /// Headers set.
    #[serde(default)]
    pub set: std::collections::BTreeMap<String, String>,
    /// Headers removed.
    #[serde(default)]
    pub remove: Vec<String>,
}

impl ResponseHeaders {
    /// The edits, as [`HeaderEdits`].
    pub fn edits(&self) -> HeaderEdits {
        HeaderEdits {
            add: self.add.clone(),
            set: self.set.clone(),
            remove: self.remove.clone(),
        }
    }
}

/// `replace_prefix = { from, to }`: a path that starts with `from` gets `to` in its place.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplacePrefix {
    /// The prefix replaced.
    pub from: String,
    /// What replaces it.
    pub to: String,
}

/// `redirect = { status, location }`: keel answers the route's requests itself.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedirectConfig {
    /// 301, 302 (default), 303, 307 or 308.
    #[serde(default = "default_redirect_status")]
    pub status: u16,
    /// The `Location`; may hold `$host` and `$path` (the request's, path with its query),
    /// `$client_ip`, `$request_id`, `$trace_id`, `$route`.
    pub location: String,
}

fn default_redirect_status() -> u16 {
    302
}

/// The rewrites a route or a cluster may set (their keys, gathered to check them alike).
pub(crate) struct RewriteKeys<'a> {
    pub strip_prefix: Option<&'a String>,
    pub replace_prefix: Option<&'a ReplacePrefix>,
    pub host_rewrite: Option<&'a String>,
    pub request_headers: Option<&'a HeaderEdits>,
    pub response_headers: Option<&'a ResponseHeaders>,
    pub redirect: Option<&'a RedirectConfig>,
}

crate::config::group::group! {
    /// What a route or a cluster does to each request it serves besides choosing an endpoint:
    /// a local rate limit and the rewrites of the request and its response. The same keys in
    /// `[[listener.route]]` and `[[cluster]]`, side by side with the table's other keys.
    pub struct RequestPolicy {
        /// A local rate limit on every request (see [`RateLimitConfig`]); a route's comes
        /// before its cluster's.
        "rate_limit" => rate_limit: Option<RateLimitConfig> = None;
        /// Removes this prefix from the path sent to the endpoint (`/echo/status` -> `/status`).
        "strip_prefix" => strip_prefix: Option<String> = None;
        /// Replaces a path prefix (`{ from = "/v1/", to = "/v2/" }`).
        "replace_prefix" => replace_prefix: Option<ReplacePrefix> = None;
        /// The `Host` sent to the endpoint: this value, or `"$endpoint"` for the endpoint's
        /// address.
        "host_rewrite" => host_rewrite: Option<String> = None;
        /// Request headers removed, set and added.
        "request_headers" => request_headers: Option<HeaderEdits> = None;
        /// Response headers removed, set and added (and `endpoint`: `x-keel-endpoint`).
        "response_headers" => response_headers: Option<ResponseHeaders> = None;
        /// Rewrites `Location` and `Refresh` naming the endpoint's address to the client-facing
        /// host (NGINX's `proxy_redirect default`).
        "rewrite_location" => rewrite_location: bool = false;
        /// Compresses responses for clients that accept it (`true`, or a table of settings).
        "compression" => compression: Option<crate::config::compress::CompressionConfig> = None;
    }
}

impl RequestPolicy {
    /// The rewrite keys, with a route's `redirect` (a cluster has none).
    pub(crate) fn rewrites<'a>(&'a self, redirect: Option<&'a RedirectConfig>) -> RewriteKeys<'a> {
        RewriteKeys {
            strip_prefix: self.strip_prefix.as_ref(),
            replace_prefix: self.replace_prefix.as_ref(),
            host_rewrite: self.host_rewrite.as_ref(),
            request_headers: self.request_headers.as_ref(),
            response_headers: self.response_headers.as_ref(),
            redirect,
        }
    }
}

/// Headers a `request_headers` or `response_headers` edit may not touch: those that frame
/// the message or belong to one connection (keel sets them), and `Host` (`host_rewrite`).
const PROTECTED: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "host",
];

/// The variables a header value may hold.
pub const HEADER_VARIABLES: &[&str] = &[
    "$client_ip",
    "$client_cert_subject",
    "$client_cert_san",
    "$client_cert_fingerprint",
    "$request_id",
    "$trace_id",
    "$route",
];
/// The variables a redirect's location may hold.
pub const LOCATION_VARIABLES: &[&str] = &[
    "$client_ip",
    "$request_id",
    "$trace_id",
    "$route",
    "$host",
    "$path",
];

/// A `$` in a header value or a location that starts none of the variables allowed there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown variable `{word}`; allowed: {} (`$$` for a `$`)", allowed.join(", "))]
pub(crate) struct UnknownVariable {
    /// The `$` and the word after it.
    pub word: String,
    /// The variables allowed there.
    pub allowed: &'static [&'static str],
}

/// Checks that every `$` in `value` starts one of `allowed` (`$$` is a `$`).
pub(crate) fn check_variables(
    value: &str,
    allowed: &'static [&'static str],
) -> Result<(), UnknownVariable> {
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        rest = &rest[i..];
        if let Some(r) = rest.strip_prefix("$$") {
            rest = r;
            continue;
        }
        match allowed.iter().find(|v| rest.starts_with(**v)) {
            Some(v) => rest = &rest[v.len()..],
            None => {
                let word: String = rest
                    .chars()
                    .take(1)
                    .chain(
                        rest.chars()
                            .skip(1)
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_'),
                    )
                    .collect();
                return Err(UnknownVariable { word, allowed });
            }
        }
    }
    Ok(())
}

fn check_path(key: &'static str, p: &str) -> Result<(), InvalidField> {
    if !p.starts_with('/') || p.contains('?') || p.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(InvalidField::at(
            key,
            Problem::Invalid(format!(
                "`{p}` is not a path prefix; it must start with `/` and have no query (`?`) or spaces"
            )),
        ));
    }
    Ok(())
}

type Map = std::collections::BTreeMap<String, String>;

fn check_edits(
    key: &'static str,
    add: &Map,
    set: &Map,
    remove: &[String],
) -> Result<(), InvalidField> {
    let at = |sub: &'static str| FieldPath::key(key).then(sub);
    let name_ok = |sub: &'static str, name: &str| -> Result<(), InvalidField> {
        if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(InvalidField::new(
                at(sub),
                Problem::Invalid(format!("`{name}` is not a header name")),
            ));
        }
        if PROTECTED.iter().any(|p| name.eq_ignore_ascii_case(p)) {
            return Err(InvalidField::new(
                at(sub),
                Problem::Invalid(format!(
                    "`{name}` is set by keel (framing, connection, or `host_rewrite` for Host) and cannot be edited"
                )),
            ));
        }
        Ok(())
    };
    for name in remove {
        name_ok("remove", name)?;
    }
    let pairs = add
        .iter()
        .map(|p| ("add", p))
        .chain(set.iter().map(|p| ("set", p)));
    for (sub, (name, value)) in pairs {
        name_ok(sub, name)?;
        check_variables(value, HEADER_VARIABLES)
            .map_err(|e| InvalidField::new(at(sub), Problem::Invalid(format!("`{name}`: {e}"))))?;
        if hyper::header::HeaderValue::from_str(value).is_err() {
            return Err(InvalidField::new(
                at(sub),
                Problem::Invalid(format!("the value of `{name}` is not a header value")),
            ));
        }
    }
    Ok(())
}

impl RewriteKeys<'_> {
    /// Checks the keys (paths relative to the route or cluster).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(p) = self.strip_prefix {
            check_path("strip_prefix", p)?;
        }
        if let Some(r) = self.replace_prefix {
            check_path("replace_prefix", &r.from)?;
            check_path("replace_prefix", &r.to)?;
            if self.strip_prefix.is_some() {
                return Err(InvalidField::at(
                    "replace_prefix",
                    Problem::Invalid("set `strip_prefix` or `replace_prefix`, not both".into()),
                ));
            }
        }
        if let Some(h) = self.host_rewrite {
            if h != "$endpoint" && hyper::http::uri::Authority::try_from(h.as_str()).is_err() {
                return Err(InvalidField::at(
                    "host_rewrite",
                    Problem::Invalid(format!(
                        "`{h}` is not a host (optionally with a port); or \"$endpoint\" for the endpoint's address"
                    )),
                ));
            }
        }
        if let Some(e) = self.request_headers {
            check_edits("request_headers", &e.add, &e.set, &e.remove)?;
        }
        if let Some(e) = self.response_headers {
            check_edits("response_headers", &e.add, &e.set, &e.remove)?;
        }
        if let Some(r) = self.redirect {
            let at = |sub| FieldPath::key("redirect").then(sub);
            if ![301, 302, 303, 307, 308].contains(&r.status) {
                return Err(InvalidField::new(
                    at("status"),
                    Problem::out_of_range("one of 301, 302, 303, 307, 308", r.status),
                ));
            }
            check_variables(&r.location, LOCATION_VARIABLES)
                .map_err(|e| InvalidField::new(at("location"), Problem::Invalid(e.to_string())))?;
            if r.location.is_empty() || hyper::header::HeaderValue::from_str(&r.location).is_err() {
                return Err(InvalidField::new(
                    at("location"),
                    Problem::Invalid("`location` must be a non-empty header value".into()),
                ));
            }
        }
        Ok(())
    }
}

/// Where a hash strategy takes its key from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashOn {
    /// The value of this request header (lower-case name); requests without it get a random
    /// key.
    Header(hyper::header::HeaderName),
    /// The request path (without the query).
    Path,
    /// The client's IP address.
    ClientIp,
    /// The value of this cookie; requests without it get a random key.
    Cookie(String),
}

impl HashOn {
    const ALLOWED: &'static str = "\"header:NAME\", \"cookie:NAME\", \"path\", \"client-ip\"";
}

/// True for a cookie name (an RFC 6265 token).
pub(crate) fn is_cookie_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
}

/// A `hash_on` that is refused, and the text given.
#[derive(Debug, thiserror::Error)]
pub enum HashOnError {
    /// `cookie:NAME` with a NAME that is not an RFC 6265 token.
    #[error("`{0}` is not a cookie name")]
    CookieName(String),
    /// `header:NAME` with a NAME that is not a header name.
    #[error("`{name}` is not a valid header name")]
    HeaderName {
        /// The name given.
        name: String,
        /// Why.
        #[source]
        source: hyper::header::InvalidHeaderName,
    },
    /// None of the forms.
    #[error("unknown hash_on `{0}`; allowed: {allowed}", allowed = HashOn::ALLOWED)]
    Unknown(String),
}

impl std::str::FromStr for HashOn {
    type Err = HashOnError;
    fn from_str(s: &str) -> Result<Self, HashOnError> {
        match s {
            "path" => Ok(HashOn::Path),
            "client-ip" => Ok(HashOn::ClientIp),
            _ => {
                if let Some(name) = s.strip_prefix("cookie:") {
                    is_cookie_name(name)
                        .then(|| HashOn::Cookie(name.to_string()))
                        .ok_or_else(|| HashOnError::CookieName(name.to_string()))
                } else if let Some(name) = s.strip_prefix("header:") {
                    hyper::header::HeaderName::from_bytes(name.trim().as_bytes())
                        .map(HashOn::Header)
                        .map_err(|source| HashOnError::HeaderName {
                            name: name.to_string(),
                            source,
                        })
                } else {
                    Err(HashOnError::Unknown(s.to_string()))
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for HashOn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for HashOn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HashOn::Header(h) => write!(f, "header:{h}"),
            HashOn::Path => f.write_str("path"),
            HashOn::ClientIp => f.write_str("client-ip"),
            HashOn::Cookie(c) => write!(f, "cookie:{c}"),
        }
    }
}

/// `sticky = { cookie, ttl, path, secure, http_only, same_site, secret }`: sessions pinned to
/// an endpoint by a cookie keel inserts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StickyConfig {
    /// The cookie's name.
    pub cookie: String,
    /// The cookie's `Max-Age`; unset: a session cookie (until the browser closes).
    #[serde(default, with = "keel_balance::duration_serde::option")]
    pub ttl: Option<std::time::Duration>,
    /// The cookie's `Path`.
    #[serde(default = "default_cookie_path")]
    pub path: String,
    /// `Secure`.
    #[serde(default)]
    pub secure: bool,
    /// `HttpOnly` (default on).
    #[serde(default = "yes")]
    pub http_only: bool,
    /// `SameSite`: `"lax"`, `"strict"` or `"none"`; unset: none sent.
    #[serde(default)]
    pub same_site: Option<String>,
    /// Keys the cookie's value (a hash of the endpoint's token); unset: a secret chosen at
    /// start (sessions then survive reloads, not restarts, and differ between processes).
    #[serde(default)]
    pub secret: Option<String>,
}

fn default_cookie_path() -> String {
    "/".into()
}

fn yes() -> bool {
    true
}

impl StickyConfig {
    /// Checks the values; paths relative to the `sticky` table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !is_cookie_name(&self.cookie) {
            return Err(InvalidField::at(
                "cookie",
                Problem::Invalid(format!("`{}` is not a cookie name", self.cookie)),
            ));
        }
        if !self.path.starts_with('/')
            || self
                .path
                .bytes()
                .any(|b| b < b' ' || b == b';' || b == 0x7f)
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a cookie path (it starts with `/`, no `;`)",
                    self.path
                )),
            ));
        }
        if let Some(t) = self.ttl {
            if t < std::time::Duration::from_secs(1) {
                return Err(InvalidField::at(
                    "ttl",
                    Problem::out_of_range("at least 1s", humantime::format_duration(t)),
                ));
            }
        }
        if let Some(s) = &self.same_site {
            if !["lax", "strict", "none"].contains(&s.as_str()) {
                return Err(InvalidField::at(
                    "same_site",
                    Problem::Invalid(format!("`{s}`; allowed: \"lax\", \"strict\", \"none\"")),
                ));
            }
            if s == "none" && !self.secure {
                return Err(InvalidField::at(
                    "same_site",
                    Problem::Invalid(
                        "\"none\" needs `secure = true` (browsers refuse it otherwise)".into(),
                    ),
                ));
            }
        }
        Ok(())
    }
}
