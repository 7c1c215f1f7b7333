//! OTLP export of sampled requests' spans (`[tracing] otlp`): a thread of its own drains the
//! [`SpanQueue`] the requests' records fill, batches what it finds (up to [`MAX_BATCH`]
//! requests, or what came within [`FLUSH_EVERY`] of the first), and sends each batch to the
//! collector over OTLP/gRPC (`TraceService/Export`, the `opentelemetry-proto` definitions,
//! sent with tonic). The request path only copies its spans into the queue, and drops them
//! (counted) when the queue is full: a slow or absent collector never holds a request.
//!
//! Spans, as the OpenTelemetry HTTP conventions name them: the request's (`SERVER`, the child
//! of the caller's span when keel continued a trace) and one per try (`CLIENT`, children of
//! the request's, with the span id the try sent in its `traceparent`): the endpoint
//! (`server.address`, `server.port`), the outcome (`keel.try.outcome`: `ok`, `status 503`,
//! `connect refused`, ..., `cancelled` for a hedge race's loser), the attempt
//! (`keel.try.attempt`, `http.request.resend_count`) and `keel.try.kind` (`first`, `retry`,
//! `hedge`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};

use crate::config::TracingConfig;
use crate::exchange::trace::{Finished, SpanQueue};
use crate::exchange::tries::TryOutcome;
use crate::metrics::log_budget::LogBudget;
use crate::metrics::SpanCounters;

/// Most finished requests in one export.
pub(crate) const MAX_BATCH: usize = 512;
/// How long a batch waits for more after its first request.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// How long one export may take (a collector that does not answer in time fails the batch).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts the exporter of `config` (its `otlp` collector) and returns the queue that feeds
/// it. The exporter ends, after sending what is queued, once every holder of the queue has
/// dropped it (a reload that changed `[tracing]`, or the proxy's end).
pub(crate) fn start(
    config: &TracingConfig,
    url: &str,
    counters: Arc<SpanCounters>,
) -> anyhow::Result<SpanQueue> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| anyhow::anyhow!("[tracing] otlp `{url}`: {e}"))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(EXPORT_TIMEOUT);
    let (queue, rx) = SpanQueue::new(config.queue, counters.clone());
    let resource = Resource {
        attributes: vec![text("service.name", &config.service_name)],
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let url = url.to_string();
    std::thread::Builder::new()
        .name("keel-otlp".into())
        .spawn(move || {
            let channel = {
                let _in = rt.enter();
                endpoint.connect_lazy()
            };
            let mut exporter = Exporter {
                client: TraceServiceClient::new(channel),
                resource,
                counters,
                url,
                log: LogBudget::new(1, Instant::now()),
            };
            exporter.run(&rt, &rx);
        })?;
    Ok(queue)
}

struct Exporter {
    client: TraceServiceClient<tonic::transport::Channel>,
    resource: Resource,
    counters: Arc<SpanCounters>,
    url: String,
    log: LogBudget,
}

impl Exporter {
    /// Batches and sends until the queue's senders are all gone.
    fn run(&mut self, rt: &tokio::runtime::Runtime, rx: &Receiver<Finished>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let Ok(first) = rx.recv() else { return };
            batch.push(first);
            let until = Instant::now() + FLUSH_EVERY;
            let mut closed = false;
            while batch.len() < MAX_BATCH {
                match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                    Ok(f) => batch.push(f),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
            self.send(rt, &batch);
            batch.clear();
            if closed {
                return;
            }
        }
    }

    fn send(&mut self, rt: &tokio::runtime::Runtime, batch: &[Finished]) {
        let spans: Vec<Span> = batch.iter().flat_map(spans).collect();
        let n = spans.len() as u64;
        let request = ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                resource: Some(self.resource.clone()),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "keel".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans,
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        match rt.block_on(self.client.export(request)) {
            Ok(answer) => {
                // A partial success names the spans the collector refused.
                let refused = answer
                    .get_ref()
                    .partial_success
                    .as_ref()
                    .map_or(0, |p| p.rejected_spans.max(0) as u64)
                    .min(n);
                self.counters.exported.fetch_add(n - refused, Relaxed);
                self.counters.failed.fetch_add(refused, Relaxed);
            }
            Err(status) => {
                self.counters.failed.fetch_add(n, Relaxed);
                if self.log.allow() {
                    tracing::warn!(
                        collector = %self.url,
                        suppressed = self.log.take_suppressed(),
                        "OTLP export of {n} spans failed: {}",
                        status.message()
                    );
                }
            }
        }
    }
}

/// A finished request's spans: its own, then one per try.
fn spans(f: &Finished) -> Vec<Span> {
    let trace_id = f.trace.trace_id.to_vec();
    let start = unix_nanos(f.start);
    let end = start + f.duration.as_nanos() as u64;
    let method = String::from_utf8_lossy(f.method.as_bytes()).into_owned();
    let target = f.target.as_bytes();
    let path = &target[..target
        .iter()
        .position(|b| *b == b'?')
        .unwrap_or(target.len())];
    let flags = u32::from(f.trace.flags);
    let mut out = Vec::with_capacity(1 + f.more.len() + 1);
    let version = f.protocol.strip_prefix("HTTP/").unwrap_or(f.protocol);
    let version = if version == "2.0" { "2" } else { version };
    out.push(Span {
        trace_id: trace_id.clone(),
        span_id: f.trace.span.to_vec(),
        parent_span_id: if f.trace.continued() {
            f.trace.parent.to_vec()
        } else {
            Vec::new()
        },
        flags,
        name: method.clone(),
        kind: SpanKind::Server as i32,
        start_time_unix_nano: start,
        end_time_unix_nano: end,
        attributes: vec![
            text("http.request.method", &method),
            text("url.path", &String::from_utf8_lossy(path)),
            int("http.response.status_code", i64::from(f.status)),
            text("network.protocol.version", version),
            text(
                "client.address",
                &String::from_utf8_lossy(f.client.as_bytes()),
            ),
            text(
                "keel.cluster",
                &String::from_utf8_lossy(f.cluster.as_bytes()),
            ),
            int(
                "keel.tries",
                f.tries().filter(|t| !t.record.lost).count() as i64,
            ),
        ],
        // A server span's 5xx is its error (the OpenTelemetry HTTP conventions).
        status: (f.status >= 500).then(|| Status {
            code: StatusCode::Error as i32,
            message: String::new(),
        }),
        ..Default::default()
    });
    for t in f.tries() {
        let r = &t.record;
        let try_start = start + u64::from(r.start_us) * 1000;
        // The try whose response went to the client lasts until the response's end.
        let try_end = r
            .duration_us
            .map_or(end, |us| try_start + u64::from(us) * 1000);
        let (host, port) = split_address(t.endpoint.to_str().unwrap_or(""));
        let mut outcome = Vec::new();
        r.outcome.push_text(&mut outcome);
        let outcome = String::from_utf8_lossy(&outcome).into_owned();
        let kind = if r.hedge {
            "hedge"
        } else if r.attempt > 0 {
            "retry"
        } else {
            "first"
        };
        let mut attributes = vec![
            text("http.request.method", &method),
            text("server.address", host),
            text("keel.try.outcome", &outcome),
            int("keel.try.attempt", i64::from(r.attempt)),
            text("keel.try.kind", kind),
        ];
        if let Some(port) = port {
            attributes.push(int("server.port", i64::from(port)));
        }
        if r.attempt > 0 {
            attributes.push(int("http.request.resend_count", i64::from(r.attempt)));
        }
        let status_code = match r.outcome {
            TryOutcome::Status(s) => Some(s),
            TryOutcome::Ok => Some(f.status),
            _ => None,
        };
        if let Some(s) = status_code {
            attributes.push(int("http.response.status_code", i64::from(s)));
        }
        if r.outcome == TryOutcome::Cancelled {
            attributes.push(boolean("keel.try.cancelled", true));
        }
        let failed = !matches!(r.outcome, TryOutcome::Ok | TryOutcome::Cancelled);
        out.push(Span {
            trace_id: trace_id.clone(),
            span_id: f.trace.try_span(r.attempt, r.hedge).to_vec(),
            parent_span_id: f.trace.span.to_vec(),
            flags,
            name: method.clone(),
            kind: SpanKind::Client as i32,
            start_time_unix_nano: try_start,
            end_time_unix_nano: try_end.max(try_start),
            attributes,
            status: failed.then(|| Status {
                code: StatusCode::Error as i32,
                message: outcome.clone(),
            }),
            ..Default::default()
        });
    }
    out
}

/// `host:port` (`[v6]:port`) as its host and port.
fn split_address(a: &str) -> (&str, Option<u16>) {
    match a.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && !port.contains(']') => (
            host.trim_start_matches('[').trim_end_matches(']'),
            port.parse().ok(),
        ),
        _ => (a, None),
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn kv(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
    }
}

fn text(key: &str, value: &str) -> KeyValue {
    kv(key, Value::StringValue(value.into()))
}

fn int(key: &str, value: i64) -> KeyValue {
    kv(key, Value::IntValue(value))
}

fn boolean(key: &str, value: bool) -> KeyValue {
    kv(key, Value::BoolValue(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(split_address("127.0.0.1:9001"), ("127.0.0.1", Some(9001)));
        assert_eq!(split_address("[::1]:80"), ("::1", Some(80)));
        assert_eq!(
            split_address("backend.test:8080"),
            ("backend.test", Some(8080))
        );
        assert_eq!(split_address("backend.test"), ("backend.test", None));
    }
}
