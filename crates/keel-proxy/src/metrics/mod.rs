//! Counters and histograms on atomics, and their Prometheus text rendering. The hot path only
//! touches atomics; the registry (a map behind a mutex) is used when clusters are built and when
//! `/metrics` is scraped, so counters survive a configuration reload.

// Without etcd nothing publishes or exchanges evidence.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) mod evidence;

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(crate) mod engine;
pub(crate) mod inference;
pub(crate) mod log_budget;
pub(crate) mod text;

use text::header;
pub use text::{label, Histogram, LATENCY_BUCKETS};

/// Index of a status class: 0 = 1xx ... 4 = 5xx.
pub fn class_index(status: u16) -> usize {
    ((status / 100).clamp(1, 5) - 1) as usize
}

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Why a try to an endpoint failed without a usable answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The TCP connection could not be made (refused, unreachable, connect timeout).
    Connect = 0,
    /// No answer (or no complete body) within the per-try or request timeout.
    Timeout = 1,
    /// The connection was reset or closed early (before or during the response).
    Reset = 2,
    /// The answer was not valid HTTP/1.1.
    Protocol = 3,
}

const ERROR_KINDS: [&str; 4] = ["connect", "timeout", "reset", "protocol"];

/// What the proxy answered clients, per cluster.
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// Responses to clients by status class.
    pub responses: [AtomicU64; 5],
    /// Requests being served now.
    pub in_flight: AtomicI64,
    /// Tunnels open now (upgraded connections, TCP listeners' connections).
    pub tunnels_open: AtomicI64,
    /// Time from request to the end of the response, as the client sees it.
    pub latency: Histogram,
    /// Retries made.
    pub retries: AtomicU64,
    /// Retries wanted but refused by the retry budget.
    pub budget_refusals: AtomicU64,
    /// Retries that waited first, as the endpoint's `Retry-After` or
    /// `grpc-retry-pushback-ms` asked.
    pub pushbacks: AtomicU64,
    /// Requests answered 503 because no endpoint could be picked.
    pub no_endpoint: AtomicU64,
    /// Requests answered 503 at once because the cluster had `max_in_flight` requests.
    pub overloaded: AtomicU64,
    /// Requests answered 429 by a `rate_limit` (the cluster's or a route's to it).
    pub rate_limited: AtomicU64,
    /// Requests (and TCP connections) refused by `allow`/`deny`: a listener's, or a route's to
    /// the cluster.
    pub access_denied: AtomicU64,
    /// Hedges sent (second tries of slow requests).
    pub hedges: AtomicU64,
    /// Requests whose hedge answered first.
    pub hedges_won: AtomicU64,
    /// Inference answers by model (`inference = true`), made at the first one.
    pub inference: std::sync::OnceLock<Box<inference::InferenceMetrics>>,
}

/// What each endpoint answered.
#[derive(Debug, Default)]
pub struct EndpointMetrics {
    /// Upstream answers by status class.
    pub responses: [AtomicU64; 5],
    /// Failed tries by [`ErrorKind`].
    pub errors: [AtomicU64; 4],
    /// Time of each try, from the pick to the end of the body (or the failure).
    pub latency: Histogram,
    /// Ejections by the outlier detector.
    pub ejections: AtomicU64,
    /// Active health checks that passed.
    pub health_checks_passed: AtomicU64,
    /// Active health checks that failed.
    pub health_checks_failed: AtomicU64,
    /// Outcomes not yet published to the fleet (shared outlier evidence only).
    pub evidence: evidence::Pending,
    /// What the endpoint, an inference engine, last said about its load
    /// (`[cluster.engine_signals]`).
    pub engine: engine::EngineSignals,
}

/// What a listener's route answered, per cluster it sends to (a `split` route has several):
/// counted by each request's record, through the route's target (no lookup per request).
#[derive(Debug, Default)]
pub struct RouteMetrics {
    /// Responses to clients by status class.
    pub responses: [AtomicU64; 5],
    /// Bytes received of requests: over HTTP/1.1 the head and the body, over HTTP/2 the body.
    pub request_bytes: AtomicU64,
    /// Bytes sent of responses: over HTTP/1.1 the head and the body, over HTTP/2 the body.
    pub response_bytes: AtomicU64,
    /// Copies to the route's `mirror` by [`MirrorResult`].
    pub mirrored: [AtomicU64; 4],
}

/// What became of a request's copy to a route's `mirror`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorResult {
    /// Sent, and its answer read (whatever its status).
    Answered = 0,
    /// Not sent: `max_in_flight` copies were under way.
    Dropped = 1,
    /// Not sent: the request's body was streamed, not held whole.
    Skipped = 2,
    /// Sent, but no answer came within the mirror cluster's `request_timeout`, or the try
    /// failed.
    Failed = 3,
}

const MIRROR_RESULTS: [&str; 4] = ["answered", "dropped", "skipped", "failed"];

/// A route's figures for the text rendering.
pub struct RouteView<'a> {
    /// The listener's address.
    pub listener: &'a str,
    /// The route's `name`, else its index in the listener's list; `default` for the
    /// listener's own `cluster`.
    pub route: &'a str,
    /// The cluster the requests went to.
    pub cluster: &'a str,
    /// Its counters.
    pub metrics: &'a RouteMetrics,
    /// True if the route mirrors (its `mirrored` counters are rendered).
    pub mirrors: bool,
}

/// Renders the counters by listener and route.
pub fn render_routes(out: &mut String, routes: &[RouteView<'_>]) {
    let labels = |r: &RouteView<'_>| {
        format!(
            "listener=\"{}\",route=\"{}\",cluster=\"{}\"",
            label(r.listener),
            label(r.route),
            label(r.cluster)
        )
    };
    header(
        out,
        "keel_route_requests_total",
        "counter",
        "Responses sent to clients, by listener, route (its name, else its index; default: the listener's cluster), cluster and status class.",
    );
    for r in routes {
        let l = labels(r);
        for (i, class) in CLASSES.iter().enumerate() {
            let v = r.metrics.responses[i].load(Relaxed);
            let _ = writeln!(
                out,
                "keel_route_requests_total{{{l},class=\"{class}\"}} {v}"
            );
        }
    }
    for (name, help, value) in [
        (
            "keel_route_request_bytes_total",
            "Bytes received of requests (HTTP/1.1: head and body; HTTP/2: body), by listener, route and cluster.",
            (|m: &RouteMetrics| m.request_bytes.load(Relaxed)) as fn(&RouteMetrics) -> u64,
        ),
        (
            "keel_route_response_bytes_total",
            "Bytes sent of responses (HTTP/1.1: head and body; HTTP/2: body), by listener, route and cluster.",
            |m: &RouteMetrics| m.response_bytes.load(Relaxed),
        ),
    ] {
        header(out, name, "counter", help);
        for r in routes {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(r), value(r.metrics));
        }
    }
    if routes.iter().any(|r| r.mirrors) {
        header(
            out,
            "keel_route_mirrored_total",
            "counter",
            "Copies of a route's requests to its mirror, by result: answered, dropped (max_in_flight copies under way), skipped (a streamed body), failed (no answer in time, or the try failed).",
        );
        for r in routes.iter().filter(|r| r.mirrors) {
            let l = labels(r);
            for (i, result) in MIRROR_RESULTS.iter().enumerate() {
                let v = r.metrics.mirrored[i].load(Relaxed);
                let _ = writeln!(
                    out,
                    "keel_route_mirrored_total{{{l},result=\"{result}\"}} {v}"
                );
            }
        }
    }
}

/// Metrics by cluster name and endpoint address, and by listener and route, kept across
/// reloads.
#[derive(Debug, Default)]
pub struct Registry {
    clusters: Mutex<HashMap<String, ClusterEntry>>,
    /// By (listener, route label, cluster).
    routes: Mutex<HashMap<(String, String, String), Arc<RouteMetrics>>>,
    /// The span export's (`[tracing] otlp`), whatever exporter a reload starts.
    pub(crate) trace_spans: Arc<SpanCounters>,
}

/// Spans of sampled requests, by what became of them (`[tracing] otlp`).
#[derive(Debug, Default)]
pub struct SpanCounters {
    /// Dropped at a full queue (`keel_trace_spans_dropped_total`).
    pub dropped: AtomicU64,
    /// Accepted by the collector.
    pub exported: AtomicU64,
    /// Sent but refused, or not sent (the collector unreachable or slow).
    pub failed: AtomicU64,
}

#[derive(Debug, Default)]
struct ClusterEntry {
    metrics: Arc<ClusterMetrics>,
    endpoints: HashMap<String, Arc<EndpointMetrics>>,
}

impl Registry {
    /// The metrics of a cluster, created on first use.
    pub fn cluster(&self, name: &str) -> Arc<ClusterMetrics> {
        let mut map = self.clusters.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(name.to_string()).or_default().metrics.clone()
    }

    /// The metrics of a listener's route to a cluster, created on first use.
    pub fn route(&self, listener: &str, route: &str, cluster: &str) -> Arc<RouteMetrics> {
        let mut map = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((listener.to_string(), route.to_string(), cluster.to_string()))
            .or_default()
            .clone()
    }

    /// The metrics of an endpoint of a cluster, created on first use.
    pub fn endpoint(&self, cluster: &str, address: &str) -> Arc<EndpointMetrics> {
        let mut map = self.clusters.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(cluster.to_string())
            .or_default()
            .endpoints
            .entry(address.to_string())
            .or_default()
            .clone()
    }
}

/// The span export's counters (`[tracing] otlp`), in Prometheus text.
pub(crate) fn render_trace_spans(out: &mut String, c: &SpanCounters) {
    for (name, help, v) in [
        (
            "keel_trace_spans_dropped_total",
            "Spans of sampled requests dropped because the export queue was full (the collector slow or unreachable); requests never wait for it.",
            &c.dropped,
        ),
        (
            "keel_trace_spans_exported_total",
            "Spans the OTLP collector accepted.",
            &c.exported,
        ),
        (
            "keel_trace_spans_failed_total",
            "Spans sent to the OTLP collector that it refused or that could not be sent (error or timeout).",
            &c.failed,
        ),
    ] {
        header(out, name, "counter", help);
        let _ = writeln!(out, "{name} {}", v.load(Relaxed));
    }
}

/// One cluster's figures for the text rendering.
pub struct ClusterView<'a> {
    /// Cluster name.
    pub name: &'a str,
    /// Its metrics.
    pub metrics: &'a ClusterMetrics,
    /// True while the balancer ignores health (panic threshold).
    pub panicking: bool,
    /// Endpoints: status from keel-balance and the proxy's counters.
    pub endpoints: Vec<(keel_balance::EndpointStatus, Arc<EndpointMetrics>)>,
    /// Most upstream tries one request may cost (the configuration's worst case).
    pub max_amplification: u32,
    /// With `[cluster.engine_signals]`: the cluster's clock now and the reports' `max_age`.
    pub engine_signals: Option<(Duration, Duration)>,
}

/// One series per cluster: `name{cluster="..."} value`, under its HELP and TYPE lines.
fn cluster_series<V: std::fmt::Display>(
    out: &mut String,
    clusters: &[ClusterView<'_>],
    (name, kind, help): (&str, &str, &str),
    value: impl Fn(&ClusterView<'_>) -> V,
) {
    header(out, name, kind, help);
    for c in clusters {
        let _ = writeln!(out, "{name}{{cluster=\"{}\"}} {}", label(c.name), value(c));
    }
}

/// Renders the Prometheus text exposition format (version 0.0.4).
pub fn render(clusters: &[ClusterView<'_>], reloads: u64, reload_failures: u64) -> String {
    let mut out = String::with_capacity(8192);
    header(
        &mut out,
        "keel_requests_total",
        "counter",
        "Responses sent to clients, by cluster and status class.",
    );
    for c in clusters {
        let n = label(c.name);
        for (i, class) in CLASSES.iter().enumerate() {
            let v = c.metrics.responses[i].load(Relaxed);
            let _ = writeln!(
                out,
                "keel_requests_total{{cluster=\"{n}\",class=\"{class}\"}} {v}"
            );
        }
    }
    header(
        &mut out,
        "keel_request_duration_seconds",
        "histogram",
        "Time from a client's request to the end of its response.",
    );
    for c in clusters {
        c.metrics.latency.render(
            &mut out,
            "keel_request_duration_seconds",
            &format!("cluster=\"{}\"", label(c.name)),
        );
    }
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_requests_in_flight",
            "gauge",
            "Client requests being served.",
        ),
        |c| c.metrics.in_flight.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        ("keel_tunnels_open", "gauge", "Byte tunnels open: upgraded HTTP/1.1 connections (WebSocket) and TCP listeners' connections."),
        |c| c.metrics.tunnels_open.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_retries_total",
            "counter",
            "Retries made on another endpoint.",
        ),
        |c| c.metrics.retries.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        ("keel_retry_pushbacks_total", "counter", "Retries that first waited as the endpoint's Retry-After or grpc-retry-pushback-ms asked."),
        |c| c.metrics.pushbacks.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        ("keel_max_amplification", "gauge", "Most upstream tries one client request may cost this cluster: 1 + hedges + retries (routes' retry_attempts included), as keel proxy --check prints."),
        |c| c.max_amplification,
    );
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_retry_budget_refusals_total",
            "counter",
            "Retries refused by the retry budget.",
        ),
        |c| c.metrics.budget_refusals.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_no_endpoint_total",
            "counter",
            "Requests answered 503 because no endpoint was available.",
        ),
        |c| c.metrics.no_endpoint.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        ("keel_overloaded_total", "counter", "Requests answered 503 at once because the cluster had max_in_flight requests in flight."),
        |c| c.metrics.overloaded.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_rate_limited_total",
            "counter",
            "Requests answered 429 by a rate_limit (the cluster's, or a route's to the cluster).",
        ),
        |c| c.metrics.rate_limited.load(Relaxed),
    );
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_access_denied_total",
            "counter",
            "Requests answered 403 (TCP connections closed) by allow/deny: the listener's, or a route's to the cluster.",
        ),
        |c| c.metrics.access_denied.load(Relaxed),
    );
    for (name, help, value) in [
        (
            "keel_hedges_total",
            "Hedges sent: second tries of requests that had no answer after the hedge delay.",
            (|m: &ClusterMetrics| m.hedges.load(Relaxed)) as fn(&ClusterMetrics) -> u64,
        ),
        (
            "keel_hedges_won_total",
            "Requests whose hedge answered first (the first try was cancelled).",
            |m: &ClusterMetrics| m.hedges_won.load(Relaxed),
        ),
    ] {
        header(&mut out, name, "counter", help);
        for c in clusters {
            let _ = writeln!(
                out,
                "{name}{{cluster=\"{}\"}} {}",
                label(c.name),
                value(c.metrics)
            );
        }
    }
    cluster_series(
        &mut out,
        clusters,
        (
            "keel_cluster_panicking",
            "gauge",
            "1 while the panic threshold makes the balancer ignore health.",
        ),
        |c| c.panicking as u8,
    );
    header(
        &mut out,
        "keel_upstream_responses_total",
        "counter",
        "Answers of each endpoint, by status class.",
    );
    for c in clusters {
        for (s, m) in &c.endpoints {
            for (i, class) in CLASSES.iter().enumerate() {
                let _ = writeln!(out, "keel_upstream_responses_total{{cluster=\"{}\",endpoint=\"{}\",class=\"{class}\"}} {}", label(c.name), label(&s.address), m.responses[i].load(Relaxed));
            }
        }
    }
    header(
        &mut out,
        "keel_upstream_errors_total",
        "counter",
        "Tries that got no usable answer, by kind (connect, timeout, reset).",
    );
    for c in clusters {
        for (s, m) in &c.endpoints {
            for (i, kind) in ERROR_KINDS.iter().enumerate() {
                let _ = writeln!(out, "keel_upstream_errors_total{{cluster=\"{}\",endpoint=\"{}\",kind=\"{kind}\"}} {}", label(c.name), label(&s.address), m.errors[i].load(Relaxed));
            }
        }
    }
    header(
        &mut out,
        "keel_upstream_duration_seconds",
        "histogram",
        "Time of each try to an endpoint.",
    );
    for c in clusters {
        for (s, m) in &c.endpoints {
            m.latency.render(
                &mut out,
                "keel_upstream_duration_seconds",
                &format!(
                    "cluster=\"{}\",endpoint=\"{}\"",
                    label(c.name),
                    label(&s.address)
                ),
            );
        }
    }
    type Gauge = fn(&keel_balance::EndpointStatus, &EndpointMetrics) -> f64;
    let gauges: [(&str, &str, &str, Gauge); 8] = [
        (
            "keel_endpoint_in_flight",
            "gauge",
            "Calls in flight on the endpoint.",
            |s, _| s.in_flight as f64,
        ),
        (
            "keel_endpoint_healthy",
            "gauge",
            "1 if the active health check passes (or is off).",
            |s, _| s.healthy as u8 as f64,
        ),
        (
            "keel_endpoint_draining",
            "gauge",
            "1 while the admin's drain keeps the endpoint out of new picks.",
            |s, _| s.draining as u8 as f64,
        ),
        (
            "keel_endpoint_ejected",
            "gauge",
            "1 while the outlier detector keeps the endpoint out.",
            |s, _| s.ejected_until.is_some() as u8 as f64,
        ),
        (
            "keel_endpoint_ejections_total",
            "counter",
            "Ejections by the outlier detector.",
            |_, m| m.ejections.load(Relaxed) as f64,
        ),
        (
            "keel_endpoint_effective_weight",
            "gauge",
            "Weight in force after slow start.",
            |s, _| s.effective_weight,
        ),
        (
            "keel_endpoint_latency_estimate_seconds",
            "gauge",
            "The strategy's latency estimate (0 if none).",
            |s, _| s.latency_estimate.map_or(0.0, |d| d.as_secs_f64()),
        ),
        (
            "keel_health_checks_failed_total",
            "counter",
            "Active health checks that failed.",
            |_, m| m.health_checks_failed.load(Relaxed) as f64,
        ),
    ];
    for (name, kind, help, f) in gauges {
        header(&mut out, name, kind, help);
        for c in clusters {
            for (s, m) in &c.endpoints {
                let _ = writeln!(
                    out,
                    "{name}{{cluster=\"{}\",endpoint=\"{}\"}} {}",
                    label(c.name),
                    label(&s.address),
                    f(s, m)
                );
            }
        }
    }
    header(
        &mut out,
        "keel_health_checks_passed_total",
        "counter",
        "Active health checks that passed.",
    );
    for c in clusters {
        for (s, m) in &c.endpoints {
            let _ = writeln!(
                out,
                "keel_health_checks_passed_total{{cluster=\"{}\",endpoint=\"{}\"}} {}",
                label(c.name),
                label(&s.address),
                m.health_checks_passed.load(Relaxed)
            );
        }
    }
    render_engine_signals(&mut out, clusters);
    let measured: Vec<_> = clusters
        .iter()
        .filter_map(|c| Some((c.name, &**c.metrics.inference.get()?)))
        .collect();
    inference::render(&mut out, &measured);
    header(
        &mut out,
        "keel_config_reloads_total",
        "counter",
        "Configuration reloads, by result.",
    );
    let _ = writeln!(out, "keel_config_reloads_total{{result=\"ok\"}} {reloads}");
    let _ = writeln!(
        out,
        "keel_config_reloads_total{{result=\"refused\"}} {reload_failures}"
    );
    out
}

/// The engines' load as keel sees it (`[cluster.engine_signals]` clusters only): gauges of
/// the last report while it is fresh (absent otherwise), and the reports by what became of
/// them.
fn render_engine_signals(out: &mut String, clusters: &[ClusterView<'_>]) {
    let with: Vec<_> = clusters
        .iter()
        .filter_map(|c| c.engine_signals.map(|s| (c, s)))
        .collect();
    if with.is_empty() {
        return;
    }
    type Value = fn(&engine::EngineLoadView) -> f32;
    let gauges: [(&str, &str, Value); 3] = [
        (
            "keel_engine_requests_waiting",
            "Requests waiting in the engine's queue, as its last fresh report said (vLLM num_requests_waiting).",
            |l| l.waiting,
        ),
        (
            "keel_engine_requests_running",
            "Requests running on the engine, as its last fresh metrics said (vLLM num_requests_running; ORCA has none).",
            |l| l.running,
        ),
        (
            "keel_engine_kv_cache_usage_ratio",
            "Share of the engine's KV cache in use, 0 to 1, as its last fresh report said (vLLM kv_cache_usage_perc).",
            |l| l.kv_cache,
        ),
    ];
    for (name, help, value) in gauges {
        header(out, name, "gauge", help);
        for (c, (now, max_age)) in &with {
            for (s, m) in &c.endpoints {
                let Some((load, _)) = m.engine.view(*now, *max_age) else {
                    continue;
                };
                let v = value(&load);
                if v.is_finite() {
                    let _ = writeln!(
                        out,
                        "{name}{{cluster=\"{}\",endpoint=\"{}\"}} {v}",
                        label(c.name),
                        label(&s.address)
                    );
                }
            }
        }
    }
    header(
        out,
        "keel_engine_reports_total",
        "counter",
        "Engine load reports, by result: taken, malformed (ignored), stale (older than max_age on arrival, ignored), failed (a scrape with no answer).",
    );
    for (c, _) in &with {
        for (s, m) in &c.endpoints {
            let e = &m.engine;
            for (result, n) in [
                ("taken", &e.reports),
                ("malformed", &e.malformed),
                ("stale", &e.stale),
                ("failed", &e.failed),
            ] {
                let _ = writeln!(
                    out,
                    "keel_engine_reports_total{{cluster=\"{}\",endpoint=\"{}\",result=\"{result}\"}} {}",
                    label(c.name),
                    label(&s.address),
                    n.load(Relaxed)
                );
            }
        }
    }
}

/// The kind of connection a task serves, so that a drain can count what it cut by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ConnKind {
    /// TLS handshake, or not yet told.
    Opening = 0,
    Http1 = 1,
    Http2 = 2,
    /// An upgraded HTTP/1.1 connection (WebSocket ...) or a TCP listener's connection.
    Tunnel = 3,
}

impl ConnKind {
    pub(crate) const COUNT: usize = 4;
    pub(crate) const NAMES: [&'static str; Self::COUNT] =
        ["opening", "HTTP/1.1", "HTTP/2", "tunnel"];
}

tokio::task_local! {
    /// The kind of the connection this task serves (set by its front end).
    pub(crate) static CONN_KIND: Arc<AtomicU8>;
}

/// Marks the connection served by the current task as `kind` (a no-op outside one).
pub(crate) fn mark_connection(kind: ConnKind) {
    let _ = CONN_KIND.try_with(|k| k.store(kind as u8, Relaxed));
}

/// What `/proc` says of this process, in the units of Prometheus' standard `process_*`
/// metrics (the names every client library exports, so that existing dashboards and alerts
/// work unchanged).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    /// Seconds since the Unix epoch.
    pub start_time: f64,
    pub open_fds: f64,
    pub max_fds: f64,
}

impl ProcessStats {
    /// Reads `/proc/self/stat`, `/proc/stat` (boot time), `/proc/self/fd` and the open-file
    /// limit; `None` where `/proc` cannot be read (not Linux, or a restricted sandbox).
    pub(crate) fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        // SAFETY: sysconf reads a system constant.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let mut s = Self::parse(&stat, &boot, ticks as f64, page as f64)?;
        s.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0 {
            s.max_fds = if l.rlim_cur == libc::RLIM_INFINITY {
                f64::INFINITY
            } else {
                l.rlim_cur as f64
            };
        }
        Some(s)
    }

    /// The figures of `/proc/self/stat` (`stat`) and `/proc/stat`'s `btime` (`boot`), with the
    /// clock's ticks per second and the page size. Descriptors are left at 0.
    pub(crate) fn parse(stat: &str, boot: &str, ticks: f64, page: f64) -> Option<Self> {
        // The command name (field 2) is in parentheses and may hold spaces and parentheses:
        // the fields are counted after the last `)`, from field 3 (state).
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_ascii_whitespace().collect();
        let field = |n: usize| f.get(n - 3)?.parse::<f64>().ok();
        let btime = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse::<f64>()
            .ok()?;
        if ticks <= 0.0 || page <= 0.0 {
            return None;
        }
        Some(Self {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            start_time: btime + field(22)? / ticks,
            virtual_bytes: field(23)?,
            resident_bytes: field(24)? * page,
            open_fds: 0.0,
            max_fds: 0.0,
        })
    }
}

/// Appends the `process_*` metrics (when `/proc` can be read) and `keel_build_info`.
pub(crate) fn render_process(out: &mut String) {
    if let Some(p) = ProcessStats::read() {
        let rows = [
            (
                "process_cpu_seconds_total",
                "counter",
                "Total user and system CPU time spent in seconds.",
                p.cpu_seconds,
            ),
            (
                "process_resident_memory_bytes",
                "gauge",
                "Resident memory size in bytes.",
                p.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "gauge",
                "Virtual memory size in bytes.",
                p.virtual_bytes,
            ),
            (
                "process_start_time_seconds",
                "gauge",
                "Start time of the process since unix epoch in seconds.",
                p.start_time,
            ),
            (
                "process_open_fds",
                "gauge",
                "Number of open file descriptors.",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "gauge",
                "Maximum number of open file descriptors.",
                p.max_fds,
            ),
        ];
        for (name, kind, help, v) in rows {
            header(out, name, kind, help);
            if v.is_infinite() {
                let _ = writeln!(out, "{name} +Inf");
            } else {
                let _ = writeln!(out, "{name} {v}");
            }
        }
    }
    header(
        out,
        "keel_build_info",
        "gauge",
        "Always 1; the labels say which keel this is.",
    );
    let _ = writeln!(
        out,
        "keel_build_info{{version=\"{}\"}} 1",
        label(env!("CARGO_PKG_VERSION"))
    );
}

#[cfg(test)]
mod tests {
    use super::ProcessStats;

    /// A command name with spaces and a `)` must not shift the fields.
    #[test]
    fn process_stats_parse_counts_fields_after_the_command_name() {
        let stat = "4242 (keel (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 9 0 360000 123456789 2048 18446744073709551615";
        let boot = "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n";
        let p = ProcessStats::parse(stat, boot, 100.0, 4096.0).unwrap();
        assert_eq!(p.cpu_seconds, 4.0, "(250 + 150) ticks at 100 per second");
        assert_eq!(p.start_time, 1_700_003_600.0, "boot + 360000 ticks");
        assert_eq!(p.virtual_bytes, 123_456_789.0);
        assert_eq!(p.resident_bytes, 2048.0 * 4096.0);
        assert!(ProcessStats::parse("garbage", boot, 100.0, 4096.0).is_none());
        assert!(ProcessStats::parse(stat, "cpu 1\n", 100.0, 4096.0).is_none());
    }

    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_in_text() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(20));
        let mut s = String::new();
        h.render(&mut s, "x", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.0005\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.005\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"10\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{a=\"b\"} 3\n"), "{s}");
        assert_eq!(h.count(), 3);
    }

    #[test]
    fn status_classes() {
        assert_eq!(class_index(200), 1);
        assert_eq!(class_index(503), 4);
        assert_eq!(class_index(101), 0);
        assert_eq!(label("a\"b"), "a\\\"b");
    }
}
