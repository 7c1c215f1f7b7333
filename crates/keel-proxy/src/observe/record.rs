//! One record per request. Every front end fills a [`Record`] when a request's answer is
//! done: sent or cut (an endpoint's response when its body ends; keel's own answer over
//! HTTP/2 when it is handed to hyper, its body being in memory), and [`Record::write`] writes
//! everything keel keeps of the request from it, in one place: the response counted by status
//! class (`keel_requests_total`, and by route `keel_route_*` with its bytes), the warning line of a 5xx keel answered itself, the
//! access-log line, and a sampled request's spans for export (`[tracing] otlp`).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Instant, SystemTime};

use crate::driver::tries::Tries;
use crate::exchange::head::HeadView;
use crate::exchange::request::Client;
use crate::exchange::trace::{Finished, SpanQueue, Text, TrySpan};
use crate::metrics::class_index;
use crate::observe::access_log::{AccessLog, Entry, RequestLine, TryLog};
use crate::upstream::cluster::Cluster;
use hyper::header::HeaderValue;

/// A request as keel answered it.
pub(crate) struct Record<'a> {
    pub client: &'a Client,
    /// The cluster that served it; `None` before a route chose one.
    pub cluster: Option<&'a Cluster>,
    /// The route's index, if a route matched.
    pub route: Option<u16>,
    /// `HTTP/1.0`, `HTTP/1.1`, `HTTP/2.0` or `TCP`.
    pub protocol: &'static str,
    /// When its head was read.
    pub started: Instant,
    /// Its request line and headers as sent upstream, or as much as keel read of them.
    pub request: HeadView<'a>,
    /// The status sent.
    pub status: u16,
    /// The endpoint of the last try, if any.
    pub endpoint: Option<&'a [u8]>,
    /// Tries made.
    pub attempts: u32,
    /// Every try; `None` or empty: none was made.
    pub tries: Option<&'a Tries>,
    /// Why keel answered itself, or why the endpoint's response was cut.
    pub cause: Option<&'a str>,
    /// keel answered itself (its 5xx are logged as warnings).
    pub own: bool,
    /// Bytes of the response written to the client: head and body over HTTP/1.1, the body
    /// over HTTP/2.
    pub bytes_sent: u64,
    /// Bytes of its body written to the client.
    pub body_bytes_sent: u64,
    /// The counters of its route to its cluster (`keel_route_*`); `None` before a route
    /// chose one.
    pub route_metrics: Option<&'a crate::metrics::RouteMetrics>,
    /// Bytes of the request received: head and body over HTTP/1.1, the body over HTTP/2
    /// (a body's when its length was announced).
    pub bytes_received: u64,
}

impl Record<'_> {
    /// A record of keel's answer to a request it refused or could not route: no cluster, no
    /// try.
    pub fn refused<'a>(
        client: &'a Client,
        protocol: &'static str,
        started: Instant,
        request: HeadView<'a>,
        status: u16,
        cause: &'a str,
    ) -> Record<'a> {
        Record {
            client,
            cluster: None,
            route: None,
            protocol,
            started,
            request,
            status,
            endpoint: None,
            attempts: 0,
            tries: None,
            cause: Some(cause),
            own: true,
            bytes_sent: 0,
            body_bytes_sent: 0,
            route_metrics: None,
            bytes_received: 0,
        }
    }

    /// Writes the request's counter, warning and access-log line (`log`: the access log, when
    /// one is configured). Called once per request.
    pub fn write(&self, log: Option<&AccessLog>) {
        // A sampled trace's spans, when they are exported.
        if let Some(tries) = self.tries.filter(|t| t.sampled()) {
            let export = self
                .cluster
                .and_then(|c| Some((c, c.tracing.as_ref()?.export.as_ref()?)));
            if let Some((cluster, queue)) = export {
                self.export(cluster, tries, queue);
            }
        }
        if let Some(m) = self.route_metrics {
            m.responses[class_index(self.status)].fetch_add(1, Relaxed);
            m.request_bytes.fetch_add(self.bytes_received, Relaxed);
            m.response_bytes.fetch_add(self.bytes_sent, Relaxed);
        }
        if let Some(cluster) = self.cluster {
            cluster.metrics.responses[class_index(self.status)].fetch_add(1, Relaxed);
            if self.own && self.status >= 500 && cluster.log_budget.allow() {
                tracing::warn!(
                    cluster = cluster.name(),
                    client = %self.client.peer,
                    suppressed = cluster.log_budget.take_suppressed(),
                    "answered {}: {}",
                    self.status,
                    self.cause.unwrap_or(""),
                );
            }
        }
        let Some(log) = log else { return };
        log.log(
            self.client.worker,
            &Entry {
                client: &self.client.ip,
                client_cert_subject: self.client.client_cert.as_deref().map(|c| &*c.subject),
                request: RequestLine::of(self.request),
                protocol: self.protocol,
                status: self.status,
                bytes_sent: self.bytes_sent,
                body_bytes_sent: self.body_bytes_sent,
                duration: self.started.elapsed(),
                cluster: self.cluster.map(|c| c.name()),
                endpoint: self.endpoint,
                attempts: self.attempts,
                route: self.route,
                cause: self.cause,
                tries: match (self.cluster, self.tries) {
                    (Some(c), Some(tries)) => Some(TryLog {
                        tries,
                        endpoints: &c.endpoints,
                    }),
                    _ => None,
                },
                trace_id: self
                    .tries
                    .and_then(|t| t.trace.as_deref())
                    .map(|t| t.trace_id_hex()),
                inference: self
                    .tries
                    .and_then(|t| t.inference.as_deref())
                    .and_then(|m| m.get()),
                prompt: self.tries.and_then(|t| t.prompt),
            },
        );
    }

    /// Queues the request's spans: its own and one per try.
    fn export(&self, cluster: &Cluster, tries: &Tries, queue: &SpanQueue) {
        let Some(trace) = tries.trace.as_deref() else {
            return;
        };
        let line = RequestLine::of(self.request);
        let duration = self.started.elapsed();
        let try_span = |r: &crate::exchange::tries::TryRecord| TrySpan {
            record: *r,
            endpoint: cluster
                .endpoints
                .get(r.endpoint as usize)
                .map_or_else(|| HeaderValue::from_static(""), |e| e.header.clone()),
        };
        let (first, rest) = match tries.as_slice().split_first() {
            Some((f, rest)) => (Some(try_span(f)), rest),
            None => (None, &[][..]),
        };
        queue.push(Finished {
            trace: *trace,
            start: SystemTime::now() - duration,
            duration,
            status: self.status,
            protocol: self.protocol,
            method: Text::new(line.method.unwrap_or_default()),
            target: Text::new(line.path.unwrap_or_default()),
            cluster: Text::new(cluster.name().as_bytes()),
            client: Text::new(self.client.ip.as_bytes()),
            first,
            more: rest.iter().map(try_span).collect(),
        });
    }
}
