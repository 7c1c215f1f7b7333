//! `[[listener.route]]`: which cluster serves a request, and its overrides of the cluster's limits.

use std::time::Duration;

use keel_balance::{InvalidField, Problem};
use serde::Deserialize;

use crate::config::cluster::MAX_RETRY_ATTEMPTS;
use crate::config::discovery::is_dns_name;
use crate::config::group::{KeySeed, Seen};
use crate::config::policy::{RedirectConfig, RequestPolicy, RewriteKeys};

/// `[[listener.route]]`: the conditions a request must meet (all of them; none: every request)
/// and the cluster that then serves it, with optional overrides of the cluster's limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouteConfig {
    /// The request's host (`Host`, or the absolute target's or HTTP/2's authority, without
    /// its port; case-insensitive): exactly `api.example.test`, or `*.example.test` for one or
    /// more labels in place of `*`.
    pub host: Option<String>,
    /// The path (without the query) starts with this.
    pub path_prefix: Option<String>,
    /// The path (without the query) is exactly this.
    pub path: Option<String>,
    /// The method is one of these (case-sensitive, as methods are).
    pub methods: Vec<String>,
    /// Each of these headers is present with exactly this value (names case-insensitive).
    pub headers: std::collections::BTreeMap<String, String>,
    /// The cluster that serves the requests of this route. Required, except on a `redirect`
    /// route, which then counts under the listener's `cluster` (empty: not set).
    pub cluster: String,
    /// Overrides the cluster's `request_timeout` for this route.
    pub request_timeout: Option<Duration>,
    /// Overrides the cluster's `retry.attempts` for this route.
    pub retry_attempts: Option<u32>,
    /// Rate limit and rewrites of this route's requests (the same keys as a cluster's); a
    /// route's rate limit comes before its cluster's.
    pub policy: RequestPolicy,
    /// keel answers the route's requests with this redirect; no endpoint is tried.
    pub redirect: Option<RedirectConfig>,
    /// Clients (IP addresses or CIDR blocks) this route serves; others get `403` (after the
    /// listener's own `allow`/`deny`). Empty: everyone not denied.
    pub allow: Vec<Cidr>,
    /// Clients this route refuses with `403`. Where a client is in both lists, the longer
    /// (more specific) prefix decides; at equal length, `deny`.
    pub deny: Vec<Cidr>,
}

/// Every key of `[[listener.route]]`, in the order of the "unknown field" error's list.
pub(crate) const ROUTE_KEYS: &[&str] = &[
    "host",
    "path_prefix",
    "path",
    "methods",
    "headers",
    "cluster",
    "request_timeout",
    "retry_attempts",
    "rate_limit",
    "strip_prefix",
    "replace_prefix",
    "host_rewrite",
    "request_headers",
    "response_headers",
    "rewrite_location",
    "compression",
    "redirect",
    "allow",
    "deny",
];

impl<'de> Deserialize<'de> for RouteConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Route;
        impl<'de> serde::de::Visitor<'de> for Route {
            type Value = RouteConfig;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("struct RouteConfig")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RouteConfig, A::Error> {
                struct Timeout;
                impl<'de> serde::de::DeserializeSeed<'de> for Timeout {
                    type Value = Option<Duration>;
                    fn deserialize<D: serde::Deserializer<'de>>(
                        self,
                        d: D,
                    ) -> Result<Option<Duration>, D::Error> {
                        keel_balance::duration_serde::option::deserialize(d)
                    }
                }
                let mut r = RouteConfig::default();
                let mut seen = Seen::default();
                while let Some(key) = map.next_key_seed(KeySeed(ROUTE_KEYS))? {
                    seen.first(key)?;
                    match key {
                        "host" => r.host = map.next_value()?,
                        "path_prefix" => r.path_prefix = map.next_value()?,
                        "path" => r.path = map.next_value()?,
                        "methods" => r.methods = map.next_value()?,
                        "headers" => r.headers = map.next_value()?,
                        "cluster" => r.cluster = map.next_value()?,
                        "request_timeout" => r.request_timeout = map.next_value_seed(Timeout)?,
                        "retry_attempts" => r.retry_attempts = map.next_value()?,
                        "redirect" => r.redirect = map.next_value()?,
                        "allow" => r.allow = map.next_value()?,
                        "deny" => r.deny = map.next_value()?,
                        _ => {
                            if !r.policy.take(key, &mut map)? {
                                // A key of ROUTE_KEYS that nothing reads (a test keeps the
                                // lists in step).
                                return Err(serde::de::Error::unknown_field(key, ROUTE_KEYS));
                            }
                        }
                    }
                }
                Ok(r)
            }
        }
        d.deserialize_struct("RouteConfig", ROUTE_KEYS, Route)
    }
}

/// An IP address or CIDR block of `allow` or `deny`: `"10.0.0.0/8"`, `"2001:db8::/32"`, or a
/// single address (`"192.0.2.7"`, as `/32`). Bits past the prefix are refused
/// (`"10.0.0.1/8"`): they would be ignored, which hides a typo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Cidr(pub ipnet::IpNet);

/// An `allow` or `deny` entry that is refused, and the text given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// Neither an IP address nor a CIDR block.
    #[error("{text:?} is not an IP address or a CIDR block (write e.g. \"10.0.0.0/8\", \"192.0.2.7\" or \"2001:db8::/32\")")]
    Syntax {
        /// The entry.
        text: String,
        /// Why it is not a CIDR block.
        #[source]
        source: ipnet::AddrParseError,
    },
    /// A block with bits set past its prefix (`10.0.0.1/8`).
    #[error(
        "{text:?} has bits set past its /{} prefix: write {:?} for the block, or {:?} for the one address",
        net.prefix_len(),
        net.trunc().to_string(),
        ipnet::IpNet::from(net.addr()).to_string()
    )]
    HostBits {
        /// The entry.
        text: String,
        /// The block as written.
        net: ipnet::IpNet,
    },
}

impl TryFrom<String> for Cidr {
    type Error = CidrError;

    fn try_from(s: String) -> Result<Self, CidrError> {
        let text = s.trim();
        if let Ok(ip) = text.parse::<std::net::IpAddr>() {
            return Ok(Cidr(ipnet::IpNet::from(ip)));
        }
        let net = text
            .parse::<ipnet::IpNet>()
            .map_err(|source| CidrError::Syntax {
                text: s.clone(),
                source,
            })?;
        if net.trunc() != net {
            return Err(CidrError::HostBits { text: s, net });
        }
        Ok(Cidr(net))
    }
}

/// A route's host condition, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HostPattern {
    /// Any host.
    Any,
    /// This host (lower case).
    Exact(String),
    /// Any host under this domain (lower case, without the `*.`).
    Wildcard(String),
}

/// A route's path condition, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PathPattern {
    /// Any path.
    Any,
    /// Exactly this path.
    Exact(String),
    /// Paths that start with this.
    Prefix(String),
}

impl PathPattern {
    /// The first segment every matching path has (`/v1/x` -> `v1`), when the condition fixes
    /// it: an exact path, or a prefix that goes past the first segment's end.
    pub fn first_segment(&self) -> Option<&str> {
        match self {
            PathPattern::Any => None,
            PathPattern::Exact(p) => {
                let rest = p.strip_prefix('/')?;
                Some(rest.split_once('/').map_or(rest, |(s, _)| s))
            }
            PathPattern::Prefix(p) => p.strip_prefix('/')?.split_once('/').map(|(s, _)| s),
        }
    }
}

impl RouteConfig {
    /// The route's rewrite keys.
    pub(crate) fn rewrites(&self) -> RewriteKeys<'_> {
        self.policy.rewrites(self.redirect.as_ref())
    }

    /// The host condition.
    pub(crate) fn host_pattern(&self) -> HostPattern {
        match self.host.as_deref().map(str::to_ascii_lowercase) {
            None => HostPattern::Any,
            Some(h) => match h.strip_prefix("*.") {
                Some(domain) => HostPattern::Wildcard(domain.to_string()),
                None => HostPattern::Exact(h),
            },
        }
    }

    /// The path condition.
    pub(crate) fn path_pattern(&self) -> PathPattern {
        match (&self.path, &self.path_prefix) {
            (Some(p), _) => PathPattern::Exact(p.clone()),
            (None, Some(p)) => PathPattern::Prefix(p.clone()),
            (None, None) => PathPattern::Any,
        }
    }

    /// Checks the conditions and overrides; paths are relative to the `[[listener.route]]`.
    /// The cluster it names is checked by [`ProxyConfig::validate`].
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let Some(h) = &self.host {
            let name = h.strip_prefix("*.").unwrap_or(h);
            let ip6 = name.starts_with('[')
                && name.ends_with(']')
                && name[1..name.len() - 1]
                    .parse::<std::net::Ipv6Addr>()
                    .is_ok();
            if !ip6 && !is_dns_name(name) {
                return Err(InvalidField::at("host", Problem::Invalid(format!("`{h}` is not a host name; expected e.g. \"api.example.test\" or \"*.example.test\" (no port, no scheme)"))));
            }
        }
        if self.path.is_some() && self.path_prefix.is_some() {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid("set `path` (exact) or `path_prefix`, not both".into()),
            ));
        }
        for (key, p) in [("path", &self.path), ("path_prefix", &self.path_prefix)] {
            if let Some(p) = p {
                if !p.starts_with('/')
                    || p.contains('?')
                    || p.bytes().any(|b| b <= b' ' || b == 0x7f)
                {
                    return Err(InvalidField::at(
                        key,
                        Problem::Invalid(format!("`{p}` is not a path; it must start with `/` and have no query (`?`) or spaces")),
                    ));
                }
            }
        }
        if let Some(m) = self
            .methods
            .iter()
            .find(|m| hyper::Method::from_bytes(m.as_bytes()).is_err() || m.is_empty())
        {
            return Err(InvalidField::at(
                "methods",
                Problem::Invalid(format!("`{m}` is not a method, e.g. \"GET\"")),
            ));
        }
        for (name, value) in &self.headers {
            if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(InvalidField::at(
                    "headers",
                    Problem::Invalid(format!("`{name}` is not a header name")),
                ));
            }
            if hyper::header::HeaderValue::from_str(value).is_err() {
                return Err(InvalidField::at(
                    "headers",
                    Problem::Invalid(format!("the value of `{name}` is not a header value")),
                ));
            }
        }
        if let Some(t) = self.request_timeout {
            if t < Duration::from_millis(1) {
                return Err(InvalidField::at(
                    "request_timeout",
                    Problem::out_of_range("at least 1ms", humantime::format_duration(t)),
                ));
            }
        }
        if let Some(a) = self.retry_attempts {
            if a > MAX_RETRY_ATTEMPTS {
                return Err(InvalidField::at(
                    "retry_attempts",
                    Problem::out_of_range(format!("within 0..={MAX_RETRY_ATTEMPTS}"), a),
                ));
            }
        }
        if let Some(r) = &self.policy.rate_limit {
            r.validate()
                .map_err(|e| e.under(keel_balance::FieldPath::key("rate_limit")))?;
        }
        self.rewrites().validate()?;
        self.policy
            .compression
            .as_ref()
            .map_or(Ok(()), |c| c.validate())?;
        Ok(())
    }
}
