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
    /// `"json"` (default: one object a line), `"combined"` (NGINX's combined format), or a
    /// line of the operator's with variables (`"$remote_addr $status $request_time"`).
    #[serde(default)]
    pub format: AccessLogFormat,
    /// With `format = "json"`: the keys each object has, in this order (default: all of them).
    #[serde(default)]
    pub fields: Vec<String>,
}

impl AccessLogConfig {
    /// The file, or `None` for standard output.
    pub fn file(&self) -> Option<PathBuf> {
        (self.path.as_os_str() != "-").then(|| self.path.clone())
    }
}

/// The format of the access log's lines.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AccessLogFormat {
    /// One JSON object a line.
    #[default]
    Json,
    /// NGINX's `combined` format.
    Combined,
    /// A line of the operator's: text with variables ([`LOG_VARIABLES`]).
    Line(String),
}

impl<'de> Deserialize<'de> for AccessLogFormat {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "json" => Ok(AccessLogFormat::Json),
            "combined" => Ok(AccessLogFormat::Combined),
            _ if s.contains('$') => Ok(AccessLogFormat::Line(s)),
            _ => Err(serde::de::Error::custom(format!(
                "unknown format `{s}`; expected \"json\", \"combined\", or a line with variables (e.g. \"$remote_addr $status $request_time\")"
            ))),
        }
    }
}

/// What an access-log variable or JSON key stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogField {
    /// When the answer ended, RFC 3339 in UTC with milliseconds.
    Time,
    /// The same time as NGINX's `$time_local` writes it (in UTC).
    TimeLocal,
    /// The client's IP.
    Client,
    /// The subject of the client's verified certificate.
    ClientCertSubject,
    /// The method.
    Method,
    /// `Host`.
    Host,
    /// The target as sent on (path and query).
    Path,
    /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2.0`.
    Protocol,
    /// `METHOD PATH PROTOCOL`.
    Request,
    /// The status sent.
    Status,
    /// Bytes of the response written to the client.
    BytesSent,
    /// Bytes of its body written to the client.
    BodyBytesSent,
    /// From the request's head to the end of its response, in milliseconds (3 decimals).
    DurationMs,
    /// The same, in seconds (3 decimals), as NGINX's `$request_time`.
    RequestTime,
    /// The cluster.
    Cluster,
    /// The endpoint of the last try.
    Endpoint,
    /// Tries made.
    Attempts,
    /// The route's index.
    Route,
    /// Why keel answered itself.
    Cause,
    /// `x-request-id`.
    RequestId,
    /// The W3C trace id.
    TraceId,
    /// `User-Agent`.
    UserAgent,
    /// `Referer`.
    Referer,
    /// Every try (JSON only).
    Tries,
    /// An inference answer's time to first token, in milliseconds (`inference = true`).
    TtftMs,
    /// Its mean time between tokens, in milliseconds.
    ItlMs,
    /// `usage.prompt_tokens`.
    PromptTokens,
    /// `usage.completion_tokens`.
    CompletionTokens,
    /// `usage.prompt_tokens_details.cached_tokens`.
    CachedTokens,
    /// The model the answer named.
    Model,
    /// The name of the prompt's first block (`keel_balance::prefix`), 16 hex digits: requests
    /// that share a prefix of at least one block share it.
    Prefix,
    /// The prompt's full blocks as keel named them (within `prompt_read_limit`).
    PromptBlocks,
}

impl LogField {
    /// An inference answer's measure: absent from a JSON line of a request not measured.
    pub fn is_inference(self) -> bool {
        matches!(
            self,
            LogField::TtftMs
                | LogField::ItlMs
                | LogField::PromptTokens
                | LogField::CompletionTokens
                | LogField::CachedTokens
                | LogField::Model
                | LogField::Prefix
                | LogField::PromptBlocks
        )
    }
}

/// Every name of [`LogField`]: keel's (the JSON keys) first, then NGINX's for the same
/// values. A line's variable is `$` and one of them (`${name}` before a letter, digit or `_`);
/// a JSON `fields` entry is one of keel's.
pub const LOG_NAMES: &[(&str, LogField)] = &[
    ("time", LogField::Time),
    ("client", LogField::Client),
    ("client_cert_subject", LogField::ClientCertSubject),
    ("method", LogField::Method),
    ("host", LogField::Host),
    ("path", LogField::Path),
    ("protocol", LogField::Protocol),
    ("status", LogField::Status),
    ("bytes_sent", LogField::BytesSent),
    ("duration_ms", LogField::DurationMs),
    ("cluster", LogField::Cluster),
    ("endpoint", LogField::Endpoint),
    ("attempts", LogField::Attempts),
    ("route", LogField::Route),
    ("cause", LogField::Cause),
    ("request_id", LogField::RequestId),
    ("trace_id", LogField::TraceId),
    ("user_agent", LogField::UserAgent),
    ("referer", LogField::Referer),
    ("tries", LogField::Tries),
    ("time_local", LogField::TimeLocal),
    ("request", LogField::Request),
    ("body_bytes_sent", LogField::BodyBytesSent),
    ("request_time", LogField::RequestTime),
    ("ttft_ms", LogField::TtftMs),
    ("itl_ms", LogField::ItlMs),
    ("prompt_tokens", LogField::PromptTokens),
    ("completion_tokens", LogField::CompletionTokens),
    ("cached_tokens", LogField::CachedTokens),
    ("model", LogField::Model),
    ("prefix", LogField::Prefix),
    ("prompt_blocks", LogField::PromptBlocks),
    // NGINX's names.
    ("time_iso8601", LogField::Time),
    ("remote_addr", LogField::Client),
    ("request_method", LogField::Method),
    ("request_uri", LogField::Path),
    ("server_protocol", LogField::Protocol),
    ("upstream_addr", LogField::Endpoint),
    ("http_user_agent", LogField::UserAgent),
    ("http_referer", LogField::Referer),
    ("http_host", LogField::Host),
];

/// How many of [`LOG_NAMES`] are keel's own (the JSON keys; the rest are NGINX's).
const KEEL_NAMES: usize = 32;

/// The JSON line's keys by default, in order (`client_cert_subject` only when there is one,
/// the inference fields only for an answer measured).
pub const DEFAULT_JSON_FIELDS: &[LogField] = &[
    LogField::Time,
    LogField::Client,
    LogField::ClientCertSubject,
    LogField::Method,
    LogField::Host,
    LogField::Path,
    LogField::Protocol,
    LogField::Status,
    LogField::BytesSent,
    LogField::DurationMs,
    LogField::Cluster,
    LogField::Endpoint,
    LogField::Attempts,
    LogField::Route,
    LogField::Cause,
    LogField::RequestId,
    LogField::TraceId,
    LogField::UserAgent,
    LogField::Referer,
    LogField::Tries,
    LogField::TtftMs,
    LogField::ItlMs,
    LogField::PromptTokens,
    LogField::CompletionTokens,
    LogField::CachedTokens,
    LogField::Model,
    LogField::Prefix,
    LogField::PromptBlocks,
];

impl LogField {
    /// Its name as a JSON key (keel's name).
    pub fn key(self) -> &'static str {
        LOG_NAMES[..KEEL_NAMES]
            .iter()
            .find(|(_, f)| *f == self)
            .map_or("", |(n, _)| n)
    }
}

/// A piece of an access-log line of the operator's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinePiece {
    /// Text as it is.
    Text(String),
    /// A variable's value.
    Field(LogField),
}

/// A line format's variable that is none of [`LOG_NAMES`] (or `$tries`, JSON's only).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown variable `${name}`; known: {}", known_variables())]
pub struct UnknownLogVariable {
    /// The name after `$`.
    pub name: String,
}

fn known_variables() -> String {
    LOG_NAMES
        .iter()
        .filter(|(_, f)| *f != LogField::Tries)
        .map(|(n, _)| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses a line format: text, `$name` (the longest run of letters, digits and `_`),
/// `${name}`, and `$$` for a `$`. A line ends with a newline of keel's.
pub fn parse_log_line(format: &str) -> Result<Vec<LinePiece>, UnknownLogVariable> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut rest = format;
    while let Some(i) = rest.find('$') {
        text.push_str(&rest[..i]);
        rest = &rest[i + 1..];
        if let Some(r) = rest.strip_prefix('$') {
            text.push('$');
            rest = r;
            continue;
        }
        let name = match rest.strip_prefix('{') {
            Some(r) => {
                let end = r.find('}').unwrap_or(r.len());
                rest = r.get(end + 1..).unwrap_or("");
                &r[..end]
            }
            None => {
                let end = rest
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(rest.len());
                let name = &rest[..end];
                rest = &rest[end..];
                name
            }
        };
        let field = LOG_NAMES
            .iter()
            .find(|(n, f)| *n == name && *f != LogField::Tries)
            .map(|(_, f)| *f)
            .ok_or_else(|| UnknownLogVariable {
                name: name.to_string(),
            })?;
        if !text.is_empty() {
            pieces.push(LinePiece::Text(std::mem::take(&mut text)));
        }
        pieces.push(LinePiece::Field(field));
    }
    text.push_str(rest);
    if !text.is_empty() {
        pieces.push(LinePiece::Text(text));
    }
    Ok(pieces)
}

/// Reads a JSON `fields` list: keel's names only.
pub fn parse_json_fields(fields: &[String]) -> Result<Vec<LogField>, String> {
    fields
        .iter()
        .map(|k| {
            LOG_NAMES[..KEEL_NAMES]
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, f)| *f)
                .ok_or_else(|| {
                    let known: Vec<&str> =
                        LOG_NAMES[..KEEL_NAMES].iter().map(|(n, _)| *n).collect();
                    format!("unknown key `{k}`; known: {}", known.join(", "))
                })
        })
        .collect()
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
    /// Checks the path, the line format and the JSON keys; paths are relative to
    /// `[access_log]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let AccessLogFormat::Line(line) = &self.format {
            parse_log_line(line)
                .map_err(|e| InvalidField::at("format", Problem::Invalid(e.to_string())))?;
        }
        if !self.fields.is_empty() {
            if self.format != AccessLogFormat::Json {
                return Err(InvalidField::at(
                    "fields",
                    Problem::Invalid(
                        "`fields` chooses the keys of `format = \"json\"`; a line format names its variables itself".into(),
                    ),
                ));
            }
            parse_json_fields(&self.fields)
                .map_err(|e| InvalidField::at("fields", Problem::Invalid(e)))?;
        }
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
