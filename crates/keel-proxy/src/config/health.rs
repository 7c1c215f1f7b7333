//! `[cluster.health_check]` (active health checks) and `[cluster.probe]` (prequal's load
//! probes): how keel asks endpoints about themselves, apart from the requests it forwards.

use std::time::Duration;

use keel_balance::{InvalidField, Problem, StrategyOptions};
use serde::Deserialize;

use crate::config::locate::{none, zero};

/// `[cluster.probe]`: after each pick, a prequal balancer names `probes_per_request` random
/// endpoints, and each gets `GET path` on a connection of its own; the `x-keel-rif` and
/// `x-keel-latency-us` headers of the answer are its load report (`keel backend` answers them
/// at `/keel/load`). Answers to requests carry the same headers and count too.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Path requested. Default `/keel/load`.
    #[serde(default = "default_probe_path")]
    pub path: String,
    /// Endpoints probed after each pick (prequal's `probes_per_pick`), 0 to 16; 0 sends none
    /// (reports come from answers only). Default 3.
    #[serde(default = "default_probes_per_request")]
    pub probes_per_request: u32,
    /// Time allowed for one probe (connect and answer); a late answer is dropped. Default
    /// 100 ms.
    #[serde(
        default = "default_probe_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub timeout: Duration,
}

fn default_probe_path() -> String {
    keel_balance::LOAD_PATH.into()
}
fn default_probes_per_request() -> u32 {
    StrategyOptions::default().probes_per_pick
}
fn default_probe_timeout() -> Duration {
    Duration::from_millis(100)
}

impl Default for ProbeConfig {
    /// `GET /keel/load` to 3 endpoints after each pick, 100 ms to answer.
    fn default() -> Self {
        Self {
            path: default_probe_path(),
            probes_per_request: default_probes_per_request(),
            timeout: default_probe_timeout(),
        }
    }
}

impl ProbeConfig {
    /// Checks the probe settings; paths are relative to `[cluster.probe]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.probes_per_request > 16 {
            return Err(InvalidField::at(
                "probes_per_request",
                Problem::out_of_range("within 0..=16", self.probes_per_request),
            ));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        Ok(())
    }
}

/// `[cluster.health_check]`: a periodic probe of every endpoint: `GET path` (an answer in
/// `expected_statuses`, 2xx by default, within the timeout passes), a TCP connect, or gRPC's
/// `grpc.health.v1.Health/Check` (`SERVING` passes).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// `"http"` (default), `"tcp"` (connect only) or `"grpc"` (an h2 or h2c cluster).
    #[serde(default)]
    pub kind: HealthCheckKind,
    /// gRPC: the service asked about (empty: the server as a whole). Default `""`.
    #[serde(default)]
    pub service: String,
    /// Path requested. Default `/healthz`.
    #[serde(default = "default_hc_path")]
    pub path: String,
    /// Time between checks of one endpoint. Default 5 s.
    #[serde(default = "default_hc_interval", with = "keel_balance::duration_serde")]
    pub interval: Duration,
    /// Time allowed for one check (connect, headers and body). Default 1 s.
    #[serde(default = "default_hc_timeout", with = "keel_balance::duration_serde")]
    pub timeout: Duration,
    /// Failed checks in a row that mark a healthy endpoint unhealthy. Default 2.
    #[serde(default = "default_threshold")]
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that mark an unhealthy endpoint healthy again. Default 2.
    #[serde(default = "default_threshold")]
    pub healthy_threshold: u32,
    /// HTTP: the statuses that pass, each a code or an inclusive range (`["200-399"]`, `[204]`;
    /// HAProxy `http-check expect status 200-399`, Envoy `expected_statuses`). Default
    /// `["200-299"]`.
    #[serde(default = "default_expected_statuses")]
    pub expected_statuses: Vec<StatusRange>,
    /// HTTP: text the answer's body must contain (its first 64 KiB are searched; HAProxy
    /// `http-check expect string`). Default: any body.
    #[serde(default)]
    pub expected_body: Option<String>,
    /// HTTP: the `Host` header sent (Envoy `host`, HAProxy `http-check send hdr Host`), for an
    /// endpoint that serves several names. Default: the endpoint's `address`.
    #[serde(default)]
    pub host: Option<String>,
    /// HTTP: the request's method (`"GET"`, `"HEAD"`, ...; HAProxy `http-check send meth`,
    /// Envoy `method`). Default `"GET"`.
    #[serde(default = "default_hc_method")]
    pub method: String,
    /// HTTP and TCP: check this port of each endpoint's host instead of its own (HAProxy
    /// `port`, Envoy `port_value`), e.g. a separate management port. Default: the endpoint's.
    #[serde(default)]
    pub port: Option<u16>,
}

/// A status that passes a health check, or an inclusive range of them: `"200-399"`,
/// `"204"` or `204`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusRange {
    /// The first status that passes.
    pub first: u16,
    /// The last one (equal to `first` for a single status).
    pub last: u16,
}

impl StatusRange {
    /// True if `status` is in the range.
    pub fn contains(&self, status: u16) -> bool {
        (self.first..=self.last).contains(&status)
    }
}

impl std::str::FromStr for StatusRange {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let status = |t: &str| {
            t.trim()
                .parse::<u16>()
                .ok()
                .filter(|s| (100..=599).contains(s))
                .ok_or_else(|| {
                    format!(
                        "`{text}` is not a status (100 to 599) or a range of them (\"200-399\")"
                    )
                })
        };
        let (first, last) = match text.split_once('-') {
            Some((a, b)) => (status(a)?, status(b)?),
            None => (status(text)?, status(text)?),
        };
        if first > last {
            return Err(format!(
                "`{text}`: the range's first status is above its last"
            ));
        }
        Ok(StatusRange { first, last })
    }
}

impl<'de> Deserialize<'de> for StatusRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Code(i64),
            Text(String),
        }
        let text = match Written::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected a status or a range of them, e.g. \"200-399\"")
        })? {
            Written::Code(c) => c.to_string(),
            Written::Text(t) => t,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl std::fmt::Display for StatusRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// `kind` of a health check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HealthCheckKind {
    /// `GET path`, 2xx passes.
    #[default]
    Http,
    /// A TCP connect (and TLS handshake with `[cluster.tls]`) passes.
    Tcp,
    /// `grpc.health.v1.Health/Check`, `SERVING` passes.
    Grpc,
}

fn default_hc_path() -> String {
    "/healthz".into()
}
fn default_hc_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_hc_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_threshold() -> u32 {
    2
}
fn default_expected_statuses() -> Vec<StatusRange> {
    vec![StatusRange {
        first: 200,
        last: 299,
    }]
}
fn default_hc_method() -> String {
    "GET".into()
}

impl HealthCheckConfig {
    /// Checks the probe settings; paths are relative to `[cluster.health_check]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.service.is_empty() && self.kind != HealthCheckKind::Grpc {
            return Err(InvalidField::at(
                "service",
                Problem::NotApplicable("`service` is for kind = \"grpc\"".into()),
            ));
        }
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.interval.is_zero() {
            return Err(zero("interval"));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        let http_only = |key: &'static str| {
            InvalidField::at(
                key,
                Problem::NotApplicable(format!("`{key}` is for kind = \"http\"")),
            )
        };
        if self.kind != HealthCheckKind::Http {
            if self.expected_statuses != default_expected_statuses() {
                return Err(http_only("expected_statuses"));
            }
            if self.expected_body.is_some() {
                return Err(http_only("expected_body"));
            }
            if self.host.is_some() {
                return Err(http_only("host"));
            }
            if self.method != default_hc_method() {
                return Err(http_only("method"));
            }
        }
        if self.kind == HealthCheckKind::Grpc && self.port.is_some() {
            return Err(InvalidField::at(
                "port",
                Problem::NotApplicable("`port` is for kind = \"http\" or \"tcp\"".into()),
            ));
        }
        if self.port == Some(0) {
            return Err(InvalidField::at(
                "port",
                Problem::out_of_range("within 1..=65535", 0),
            ));
        }
        if self.expected_statuses.is_empty() {
            return Err(none("expected_statuses"));
        }
        if self.expected_body.as_deref() == Some("") {
            return Err(InvalidField::at(
                "expected_body",
                Problem::Invalid("empty: leave it out to accept any body".into()),
            ));
        }
        if let Some(host) = &self.host {
            if host.parse::<hyper::http::uri::Authority>().is_err() {
                return Err(InvalidField::at(
                    "host",
                    Problem::Invalid(format!(
                        "`{host}` is not a host name (with an optional `:port`)"
                    )),
                ));
            }
        }
        // Methods are case-sensitive: `get` would be another method than `GET`.
        let token = |b: u8| b.is_ascii_uppercase() || b == b'-' || b == b'_';
        if self.method.is_empty() || !self.method.bytes().all(token) {
            return Err(InvalidField::at(
                "method",
                Problem::Invalid(format!("`{}` is not an HTTP method", self.method)),
            ));
        }
        if self.unhealthy_threshold == 0 {
            return Err(none("unhealthy_threshold"));
        }
        if self.healthy_threshold == 0 {
            return Err(none("healthy_threshold"));
        }
        Ok(())
    }
}

impl Default for HealthCheckConfig {
    /// `GET /healthz` every 5 s, 1 s to answer, 2 to fail and 2 to pass.
    fn default() -> Self {
        HealthCheckConfig {
            kind: HealthCheckKind::default(),
            service: String::new(),
            path: default_hc_path(),
            interval: default_hc_interval(),
            timeout: default_hc_timeout(),
            unhealthy_threshold: default_threshold(),
            healthy_threshold: default_threshold(),
            expected_statuses: default_expected_statuses(),
            expected_body: None,
            host: None,
            method: default_hc_method(),
            port: None,
        }
    }
}
