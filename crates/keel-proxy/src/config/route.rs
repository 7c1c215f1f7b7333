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
    /// Each of these headers meets its condition (names case-insensitive): a string is the
    /// exact value; a table says `exact`, `regex`, `present` or `absent`, and `not = true`
    /// inverts it.
    pub headers: std::collections::BTreeMap<String, ValueMatch>,
    /// The path (without the query, dot segments resolved) matches this regular expression
    /// (unanchored: write `^...$` for the whole path).
    pub path_regex: Option<String>,
    /// Each of these query parameters meets its condition, as `headers` (names and values as
    /// sent, not percent-decoded).
    pub query: std::collections::BTreeMap<String, ValueMatch>,
    /// The route's label in metrics (`route="..."`); unnamed routes are labelled by their
    /// index in the listener's list (`"0"`, `"1"`, ...).
    pub name: Option<String>,
    /// The cluster that serves the requests of this route. Required, except on a `redirect`
    /// route, which then counts under the listener's `cluster`, and on a `split` route
    /// (empty: not set).
    pub cluster: String,
    /// Weighted shares of the route's requests to several clusters (instead of `cluster`).
    pub split: Vec<SplitArm>,
    /// The cluster of each model an OpenAI request's body names in `model` (several models
    /// or adapters behind one route, as GIE's InferenceModel `modelName` maps to a pool).
    /// A model not listed gets `404` in OpenAI's error shape; a request whose body names no
    /// model (no body, not JSON, no `model`) goes to `cluster` if the route has one, else
    /// gets `400`. Empty: the route does not read the model.
    pub models: std::collections::BTreeMap<String, String>,
    /// What keeps a client on one side of a `split`: `header:NAME` or `cookie:NAME` (a
    /// request without it is placed by the share alone). Unset: requests are spread by share.
    pub split_by: Option<SplitBy>,
    /// A copy of a share of the route's requests goes to another cluster; its answer is
    /// read and dropped, never waited for.
    pub mirror: Option<MirrorConfig>,
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
    "path_regex",
    "query",
    "name",
    "cluster",
    "split",
    "models",
    "split_by",
    "mirror",
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
                        "path_regex" => r.path_regex = map.next_value()?,
                        "query" => r.query = map.next_value()?,
                        "name" => r.name = map.next_value()?,
                        "split" => r.split = map.next_value()?,
                        "models" => r.models = map.next_value()?,
                        "split_by" => r.split_by = map.next_value()?,
                        "mirror" => r.mirror = map.next_value()?,
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

/// The most bytes a route's regular expression may compile to (the `regex` crate's
/// `size_limit`): matching stays linear in the input, and this bounds its memory.
pub(crate) const MAX_REGEX_BYTES: usize = 256 * 1024;

/// Compiles a route's regular expression with keel's bound on its size.
pub(crate) fn compile_regex(pattern: &str) -> Result<regex::bytes::Regex, String> {
    regex::bytes::RegexBuilder::new(pattern)
        .size_limit(MAX_REGEX_BYTES)
        .build()
        .map_err(|e| match e {
            regex::Error::CompiledTooBig(n) => format!(
                "`{pattern}` compiles to more than {n} bytes; simplify it (e.g. fewer repetitions of large classes)"
            ),
            e => format!("`{pattern}` is not a regular expression: {e}"),
        })
}

/// A condition on a header's or a query parameter's value. In TOML: a string (exactly this
/// value), or a table with one of `exact`, `regex` (unanchored), `present = true`,
/// `absent = true`, and optionally `not = true`, which inverts the condition (`{ exact = "a",
/// not = true }` holds for any other value and for no value at all).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ValueMatch {
    /// What is tested.
    pub test: ValueTest,
    /// The condition holds when the test fails.
    pub not: bool,
}

/// What a [`ValueMatch`] tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueTest {
    /// A value equal to this.
    Exact(String),
    /// A value this regular expression matches.
    Regex(String),
    /// Any value (the name is there).
    Present,
}

impl ValueMatch {
    /// Exactly `value`.
    pub fn exact(value: impl Into<String>) -> Self {
        ValueMatch {
            test: ValueTest::Exact(value.into()),
            not: false,
        }
    }
}

/// As `/status` and the admin page show it: the exact value as written, `~ REGEX`,
/// `present`, each after `not ` when inverted (`not present` is `absent`).
impl std::fmt::Display for ValueMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.not {
            f.write_str("not ")?;
        }
        match &self.test {
            ValueTest::Exact(v) => f.write_str(v),
            ValueTest::Regex(r) => write!(f, "~ {r}"),
            ValueTest::Present => f.write_str("present"),
        }
    }
}

impl<'de> Deserialize<'de> for ValueMatch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            exact: Option<String>,
            regex: Option<String>,
            present: Option<bool>,
            absent: Option<bool>,
            #[serde(default)]
            not: bool,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Exact(String),
            Table(Table),
        }
        use serde::de::Error;
        match Either::deserialize(d).map_err(|_| {
            D::Error::custom("expected a value (\"v\") or a table with one of `exact`, `regex`, `present = true`, `absent = true`, and optionally `not = true`")
        })? {
            Either::Exact(v) => Ok(ValueMatch::exact(v)),
            Either::Table(t) => {
                let mut tests = Vec::new();
                if let Some(v) = t.exact {
                    tests.push((ValueTest::Exact(v), false));
                }
                if let Some(v) = t.regex {
                    tests.push((ValueTest::Regex(v), false));
                }
                if let Some(p) = t.present {
                    tests.push((ValueTest::Present, !p));
                }
                if let Some(a) = t.absent {
                    tests.push((ValueTest::Present, a));
                }
                match tests.pop() {
                    Some((test, not)) if tests.is_empty() => Ok(ValueMatch {
                        test,
                        not: not != t.not,
                    }),
                    _ => Err(D::Error::custom(
                        "give exactly one of `exact`, `regex`, `present` and `absent`",
                    )),
                }
            }
        }
    }
}

/// One side of a route's `split`: `{ cluster = "a", weight = 90 }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct SplitArm {
    /// The cluster.
    pub cluster: String,
    /// Its share: `weight` over the sum of the route's weights.
    pub weight: u32,
}

/// The most models a route's `models` may name.
pub const MAX_MODELS: usize = 4096;

/// The longest model name a route's `models` may name (a request's longer `model` is not one).
pub const MAX_MODEL_NAME: usize = 256;

/// The most sides a `split` may have.
pub const MAX_SPLIT_ARMS: usize = 64;

/// The largest sum of a `split`'s weights.
pub const MAX_SPLIT_WEIGHT: u32 = 1_000_000;

/// What keeps a client on one side of a `split` (`split_by`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum SplitBy {
    /// `header:NAME`: the value of this header (lower case).
    Header(String),
    /// `cookie:NAME`: the value of this cookie.
    Cookie(String),
}

impl TryFrom<String> for SplitBy {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let bad = || format!("`{s}`: write \"header:NAME\" or \"cookie:NAME\"");
        match s.split_once(':') {
            Some(("header", name))
                if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_ok() =>
            {
                Ok(SplitBy::Header(name.to_ascii_lowercase()))
            }
            Some(("cookie", name))
                if !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_graphic() && !b"=;,\"".contains(&b)) =>
            {
                Ok(SplitBy::Cookie(name.to_string()))
            }
            _ => Err(bad()),
        }
    }
}

impl From<SplitBy> for String {
    fn from(s: SplitBy) -> String {
        match s {
            SplitBy::Header(n) => format!("header:{n}"),
            SplitBy::Cookie(n) => format!("cookie:{n}"),
        }
    }
}

/// `mirror = { cluster = "m", percent = 10 }`: a copy of this share of the route's requests
/// goes to `cluster`, whose answer is read and dropped. The client's request never waits for
/// it; at most `max_in_flight` copies are under way (more are dropped, and counted); a
/// request whose body is streamed (over 64 KiB, or of unknown length past that) is not
/// copied.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorConfig {
    /// The cluster the copies go to.
    pub cluster: String,
    /// The share of requests copied, 0 to 100 (default 100).
    #[serde(default = "hundred")]
    pub percent: f64,
    /// The most copies under way at once (default 64).
    #[serde(default = "default_mirror_in_flight")]
    pub max_in_flight: u32,
}

fn hundred() -> f64 {
    100.0
}

fn default_mirror_in_flight() -> u32 {
    64
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

    /// The clusters the route's requests go to: its `cluster`, its `split`'s, its `models`'.
    pub fn clusters(&self) -> impl Iterator<Item = &str> {
        let own = (!self.cluster.is_empty()).then_some(self.cluster.as_str());
        own.into_iter()
            .chain(self.split.iter().map(|a| a.cluster.as_str()))
            .chain(self.models.values().map(String::as_str))
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
        for (name, m) in &self.headers {
            if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(InvalidField::at(
                    "headers",
                    Problem::Invalid(format!("`{name}` is not a header name")),
                ));
            }
            match &m.test {
                ValueTest::Exact(value) if hyper::header::HeaderValue::from_str(value).is_err() => {
                    return Err(InvalidField::at(
                        "headers",
                        Problem::Invalid(format!("the value of `{name}` is not a header value")),
                    ));
                }
                ValueTest::Regex(r) => {
                    compile_regex(r)
                        .map_err(|e| InvalidField::at("headers", Problem::Invalid(e)))?;
                }
                _ => {}
            }
        }
        for (name, m) in &self.query {
            if name.is_empty() || name.bytes().any(|b| b <= b' ' || b"&=#".contains(&b)) {
                return Err(InvalidField::at(
                    "query",
                    Problem::Invalid(format!("`{name}` is not a query parameter name")),
                ));
            }
            if let ValueTest::Regex(r) = &m.test {
                compile_regex(r).map_err(|e| InvalidField::at("query", Problem::Invalid(e)))?;
            }
        }
        if let Some(r) = &self.path_regex {
            if self.path.is_some() {
                return Err(InvalidField::at(
                    "path_regex",
                    Problem::Invalid("set `path` (exact) or `path_regex`, not both".into()),
                ));
            }
            compile_regex(r).map_err(|e| InvalidField::at("path_regex", Problem::Invalid(e)))?;
        }
        if let Some(n) = &self.name {
            if n.is_empty()
                || n.bytes().all(|b| b.is_ascii_digit())
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-.:/".contains(&b))
            {
                return Err(InvalidField::at(
                    "name",
                    Problem::Invalid(format!("`{n}`: a route's name is letters, digits and `_-.:/`, not digits alone (those label unnamed routes)")),
                ));
            }
        }
        if !self.split.is_empty() {
            if !self.cluster.is_empty() || self.redirect.is_some() {
                return Err(InvalidField::at(
                    "split",
                    Problem::Invalid(
                        "a `split` route chooses its cluster: leave out `cluster` and `redirect`"
                            .into(),
                    ),
                ));
            }
            if self.split.len() > MAX_SPLIT_ARMS {
                return Err(InvalidField::at(
                    "split",
                    Problem::out_of_range(
                        format!("at most {MAX_SPLIT_ARMS} sides"),
                        self.split.len(),
                    ),
                ));
            }
            if let Some((k, a)) = self
                .split
                .iter()
                .enumerate()
                .find(|(k, a)| self.split[..*k].iter().any(|o| o.cluster == a.cluster))
            {
                return Err(InvalidField::new(
                    keel_balance::FieldPath::key("split").at(k).then("cluster"),
                    Problem::Invalid(format!("cluster `{}` is a side of this split twice: give it one side with the sum of the weights", a.cluster)),
                ));
            }
            let total: u64 = self.split.iter().map(|a| u64::from(a.weight)).sum();
            if self.split.iter().any(|a| a.weight == 0) || total > u64::from(MAX_SPLIT_WEIGHT) {
                return Err(InvalidField::at(
                    "split",
                    Problem::out_of_range(
                        format!("weights of at least 1, summing to at most {MAX_SPLIT_WEIGHT}"),
                        total,
                    ),
                ));
            }
        } else if self.split_by.is_some() {
            return Err(InvalidField::at(
                "split_by",
                Problem::NotApplicable("only a `split` route has sides to keep a client on".into()),
            ));
        }
        if !self.models.is_empty() {
            if !self.split.is_empty() || self.redirect.is_some() {
                return Err(InvalidField::at(
                    "models",
                    Problem::Invalid(
                        "a `models` route chooses its cluster by the request's model: leave out `split` and `redirect` (`cluster` is where requests without a model go)"
                            .into(),
                    ),
                ));
            }
            if self.models.len() > MAX_MODELS {
                return Err(InvalidField::at(
                    "models",
                    Problem::out_of_range(
                        format!("at most {MAX_MODELS} models"),
                        self.models.len(),
                    ),
                ));
            }
            if let Some(name) = self.models.keys().find(|m| {
                m.is_empty() || m.len() > MAX_MODEL_NAME || m.bytes().any(|b| b.is_ascii_control())
            }) {
                return Err(InvalidField::at(
                    "models",
                    Problem::Invalid(format!(
                        "{name:?} is not a model name: 1 to {MAX_MODEL_NAME} bytes, no control characters"
                    )),
                ));
            }
        }
        if let Some(m) = &self.mirror {
            if !(0.0..=100.0).contains(&m.percent) {
                return Err(InvalidField::new(
                    keel_balance::FieldPath::key("mirror").then("percent"),
                    Problem::out_of_range("within 0..=100", m.percent),
                ));
            }
            if m.max_in_flight == 0 {
                return Err(InvalidField::new(
                    keel_balance::FieldPath::key("mirror").then("max_in_flight"),
                    Problem::out_of_range("at least 1", 0),
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

#[cfg(test)]
mod tests {
    use crate::ProxyConfig;

    const CLUSTERS: &str = "\n[[cluster]]\nname = \"llama\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n\n[[cluster]]\nname = \"qwen\"\nprotocol = \"h2c\"\nendpoints = [{ address = \"127.0.0.1:9002\" }]\n";

    fn route(lines: &str) -> String {
        format!("[[listener]]\nlisten = \"127.0.0.1:0\"\n\n[[listener.route]]\npath_prefix = \"/v1/\"\n{lines}\n{CLUSTERS}")
    }

    #[test]
    fn a_models_route_is_checked_at_its_key() {
        let ok = route("models = { \"llama-3\" = \"llama\", \"llama-3-sql\" = \"llama\" }");
        let c = ProxyConfig::from_toml_str(&ok, "ok.toml").unwrap();
        assert_eq!(c.listeners[0].routes[0].models.len(), 2);
        // Each mistake at `models` (line 6) or `cluster` (line 7), with file, line and column.
        for (lines, line, says) in [
            ("models = { \"a\" = \"nope\" }", 6, "model \"a\": "),
            (
                "models = { \"a\" = \"llama\", \"b\" = \"qwen\" }",
                6,
                "another protocol",
            ),
            (
                "models = { \"a\" = \"llama\" }\ncluster = \"qwen\"",
                6,
                "another protocol",
            ),
            (
                "models = { \"a\" = \"llama\" }\ncluster = \"nope\"",
                7,
                "nope",
            ),
            ("models = { \"\" = \"llama\" }", 6, "not a model name"),
            (
                "models = { \"a\" = \"llama\" }\nsplit = [{ cluster = \"llama\", weight = 1 }]",
                6,
                "leave out `split`",
            ),
        ] {
            let e = ProxyConfig::from_toml_str(&route(lines), "bad.toml").unwrap_err();
            let text = e.to_string();
            assert_eq!(e.line, Some(line), "{lines}: {text}");
            assert!(text.starts_with(&format!("bad.toml:{line}:1:")), "{text}");
            assert!(text.contains(says), "{lines}: {text}");
        }
    }
}
