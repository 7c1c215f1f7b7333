//! `[admin]`, `[access_log]` and `[tracing]`: the sections about watching the proxy.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use keel_balance::{InvalidField, Problem};
use serde::Deserialize;

/// `[admin]`.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin listener. Default `127.0.0.1:9901` (loopback: the admin listener
    /// can reload the configuration, so it should not face the network).
    #[serde(default = "default_admin_listen")]
    pub listen: SocketAddr,
    /// Bearer token every admin request must carry (`Authorization: Bearer TOKEN`). Required
    /// when `listen` is not a loopback address; optional (but then enforced) on loopback.
    #[serde(default)]
    pub token: Option<String>,
    /// Host names the admin answers to besides IP addresses and `localhost` (a request whose
    /// `Host` is another name is refused: a DNS-rebinding page could otherwise read it).
    #[serde(default)]
    pub hosts: Vec<String>,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the token (configurations are logged and shown in errors).
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("hosts", &self.hosts)
            .finish()
    }
}

/// `[access_log]`: one line per request answered.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    /// The file lines are appended to (created if need be), relative to the configuration
    /// file's directory; `"-"` for standard output.
    pub path: PathBuf,
    /// `"json"` (default: one object a line) or `"combined"` (NGINX's combined format).
    #[serde(default)]
    pub format: AccessLogFormat,
}

impl AccessLogConfig {
    /// The file, or `None` for standard output.
    pub fn file(&self) -> Option<PathBuf> {
        (self.path.as_os_str() != "-").then(|| self.path.clone())
    }
}

/// The format of the access log's lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessLogFormat {
    /// One JSON object a line.
    #[default]
    Json,
    /// NGINX's `combined` format.
    Combined,
}

fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9901))
}

impl AdminConfig {
    /// Checks the token; paths are relative to `[admin]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        match &self.token {
            None if !self.listen.ip().is_loopback() => Err(InvalidField::at(
                "token",
                Problem::Invalid(format!(
                    "the admin listener {} is not on loopback: set `token` in [admin] (every admin request must then carry `Authorization: Bearer TOKEN`), or listen on 127.0.0.1",
                    self.listen
                )),
            )),
            Some(t) if t.len() < 16 || t.chars().any(|c| c.is_whitespace() || c.is_control()) => {
                Err(InvalidField::at(
                    "token",
                    Problem::Invalid(
                        "must be at least 16 characters, without spaces or control characters"
                            .into(),
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

impl AccessLogConfig {
    /// Checks the path; paths are relative to `[access_log]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.path.as_os_str().is_empty() || self.path.is_dir() {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a file path; expected e.g. \"access.log\", or \"-\" for standard output",
                    self.path.display()
                )),
            ));
        }
        Ok(())
    }
}

/// `[tracing]`: W3C Trace Context on every HTTP request. A client's valid `traceparent` is
/// continued, any other request starts a trace; each try sends the endpoint a `traceparent`
/// of its own span, and the access log records `trace_id`. With `otlp`, the spans of sampled
/// requests (the request's and one per try) are exported over OTLP/gRPC.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The share of new traces sampled, within 0..=1 (default 0.01). A continued trace keeps
    /// its caller's sampled flag (parent-based sampling).
    #[serde(default = "default_sample")]
    pub sample: f64,
    /// The OTLP/gRPC collector sampled spans go to (`http://host:4317`); none: no export.
    #[serde(default)]
    pub otlp: Option<String>,
    /// The resource's `service.name` on exported spans (default `keel`).
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Finished requests waiting for export (each a request span and its try spans; default
    /// 2048). A full queue drops a request's spans and counts them
    /// (`keel_trace_spans_dropped_total`): the request path never waits for the collector.
    #[serde(default = "default_queue")]
    pub queue: usize,
}

fn default_sample() -> f64 {
    0.01
}

fn default_service_name() -> String {
    "keel".into()
}

fn default_queue() -> usize {
    2048
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            sample: default_sample(),
            otlp: None,
            service_name: default_service_name(),
            queue: default_queue(),
        }
    }
}

impl TracingConfig {
    /// Checks the ratio, the collector's address and the queue's size.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !(0.0..=1.0).contains(&self.sample) {
            return Err(InvalidField::at(
                "sample",
                Problem::out_of_range(
                    "within 0..=1 (a ratio: 0.01 samples 1 % of new traces)",
                    self.sample,
                ),
            ));
        }
        if let Some(url) = &self.otlp {
            if !cfg!(feature = "otlp") {
                return Err(InvalidField::at(
                    "otlp",
                    Problem::Invalid(
                        "this keel was built without OTLP export (cargo feature `otlp`)".into(),
                    ),
                ));
            }
            let authority = url
                .parse::<hyper::Uri>()
                .ok()
                .filter(|u| u.scheme_str() == Some("http"))
                .and_then(|u| u.authority().map(|a| a.port_u16().is_some()));
            if authority != Some(true) {
                return Err(InvalidField::at(
                    "otlp",
                    Problem::Invalid(format!(
                        "`{url}`: an OTLP/gRPC collector as http://HOST:PORT (e.g. http://127.0.0.1:4317; https is not supported)"
                    )),
                ));
            }
        }
        if !(1..=1_000_000).contains(&self.queue) {
            return Err(InvalidField::at(
                "queue",
                Problem::out_of_range("within 1..=1000000 finished requests", self.queue),
            ));
        }
        Ok(())
    }
}
