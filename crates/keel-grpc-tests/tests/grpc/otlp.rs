//! keel's spans exported over OTLP/gRPC (`[tracing] otlp`) to a real collector on loopback: a
//! tonic `TraceService` server built on the `opentelemetry-proto` definitions. A request's
//! span (SERVER) and one span per try (CLIENT) share one trace id; each try's span is the
//! request span's child, with the span id the try sent its endpoint in `traceparent`; two
//! retries make three try spans, a hedge race two (the loser marked cancelled); sampled-out
//! requests export nothing, and a collector that does not answer fills the queue, which
//! drops and counts (`keel_trace_spans_dropped_total`) while requests go on at full speed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::Span;
use tonic::{Request, Response, Status};

/// An OTLP/gRPC collector that keeps every span it is sent (or, `stall`ing, holds every
/// export call unanswered), and counts the calls.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    services: Arc<Mutex<Vec<String>>>,
    calls: Arc<AtomicUsize>,
    stall: bool,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.stall {
            std::future::pending::<()>().await;
        }
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                });
            self.services
                .lock()
                .unwrap()
                .push(service.unwrap_or_default());
            for ss in rs.scope_spans {
                self.spans.lock().unwrap().extend(ss.spans);
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn collector(stall: bool) -> (SocketAddr, Collector) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let c = Collector {
        stall,
        ..Collector::default()
    };
    let service = c.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(service))
            .serve_with_incoming(
                tonic::codegen::tokio_stream::wrappers::TcpListenerStream::new(listener),
            )
            .await
            .unwrap();
    });
    (addr, c)
}

/// What an endpoint does with the `n`-th request all of them got together: wait, then answer
/// this status.
type Script = fn(usize) -> (u64, u16);

/// `count` HTTP/1.1 endpoints that share one `script` and record every request's
/// `traceparent`, in arrival order.
async fn endpoints(count: usize, script: Script) -> (Vec<SocketAddr>, Arc<Mutex<Vec<String>>>) {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let n = Arc::new(AtomicUsize::new(0));
    let mut addrs = Vec::new();
    for _ in 0..count {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        let (seen, n) = (seen.clone(), n.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (seen, n) = (seen.clone(), n.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: hyper::Request<_>| {
                        let parent = req
                            .headers()
                            .get("traceparent")
                            .map(|v| v.to_str().unwrap().to_string())
                            .unwrap_or_default();
                        seen.lock().unwrap().push(parent);
                        let (wait, status) = script(n.fetch_add(1, Ordering::SeqCst));
                        async move {
                            tokio::time::sleep(Duration::from_millis(wait)).await;
                            Ok::<_, Infallible>(
                                hyper::Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from_static(b"ok")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
    }
    (addrs, seen)
}

fn config(endpoints: &[SocketAddr], tracing: &str, extra: &str) -> keel_proxy::ProxyConfig {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let text = format!(
        "[tracing]\n{tracing}\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\noutlier_detection = false\n\
         endpoints = [{}]\n{extra}\n",
        eps.join(", ")
    );
    keel_proxy::ProxyConfig::from_toml_str(&text, "otlp.toml")
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// A GET of `url` with `headers`: its status.
async fn get(url: &str, headers: &[(&str, &str)]) -> u16 {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let mut req = hyper::Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    resp.into_body().collect().await.unwrap();
    status
}

/// The admin's `/metrics` value of `name`.
async fn metric(proxy: &keel_proxy::ProxyHandle, name: &str) -> u64 {
    let url = format!("http://{}/metrics", proxy.admin_addr().unwrap());
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} in /metrics:\n{text}"))
        .parse()
        .unwrap()
}

/// `name` once it reads `want` (the exporter counts a batch after the collector's answer,
/// which may come after the test saw the spans); its last value otherwise.
async fn metric_reaches(proxy: &keel_proxy::ProxyHandle, name: &str, want: u64) -> u64 {
    let start = Instant::now();
    loop {
        let v = metric(proxy, name).await;
        if v == want || start.elapsed() > Duration::from_secs(5) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The collector's spans once it has at least `n`.
async fn spans(c: &Collector, n: usize) -> Vec<Span> {
    let start = Instant::now();
    while c.spans.lock().unwrap().len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{n} spans: {:#?}",
            c.spans.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.spans.lock().unwrap().clone()
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn text<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(span, key) {
        Some(Value::StringValue(s)) => s,
        other => panic!("{key}: {other:?} in {span:#?}"),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::IntValue(i)) => *i,
        other => panic!("{key}: {other:?} in {span:#?}"),
    }
}

fn hex(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// The server span and the try spans (by attempt, the first try before its hedge).
fn split(spans: &[Span]) -> (Span, Vec<Span>) {
    let servers: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(servers.len(), 1, "one request span: {spans:#?}");
    let mut tries: Vec<Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .cloned()
        .collect();
    tries.sort_by_key(|s| {
        (
            int(s, "keel.try.attempt"),
            text(s, "keel.try.kind") == "hedge",
        )
    });
    (servers[0].clone(), tries)
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_trace_exports_the_request_span_and_three_try_spans_for_two_retries() {
    let (otlp, c) = collector(false).await;
    // 503, 503, then 200: whichever endpoint each try picks.
    let (eps, seen) = endpoints(3, |n| (0, if n < 2 { 503 } else { 200 })).await;
    let tracing = format!("sample = 0.0\notlp = \"http://{otlp}\"\nservice_name = \"edge\"");
    let retry = "[cluster.retry]\nattempts = 2\nbudget_percent = 100.0\n";
    let proxy = keel_proxy::start(config(&eps, &tracing, retry))
        .await
        .unwrap();
    let url = format!("http://{}/orders?id=7", proxy.listener_addrs()[0]);
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    assert_eq!(get(&url, &[("traceparent", &incoming)]).await, 200);

    let all = spans(&c, 4).await;
    assert_eq!(all.len(), 4, "{all:#?}");
    assert!(all.iter().all(|s| hex(&s.trace_id) == TRACE), "one trace");
    let (server, tries) = split(&all);
    // The request's span: the caller's span its parent.
    assert_eq!(hex(&server.parent_span_id), PARENT);
    assert_eq!(server.name, "GET");
    assert_eq!(text(&server, "url.path"), "/orders");
    assert_eq!(int(&server, "http.response.status_code"), 200);
    assert_eq!(int(&server, "keel.tries"), 3);
    assert_eq!(text(&server, "keel.cluster"), "app");
    assert!(server.status.is_none());
    assert_eq!(*c.services.lock().unwrap(), ["edge"]);
    // Three tries, the request span their parent, each with the span id its endpoint saw as
    // its parent in `traceparent`.
    let sent: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|p| {
            let parts: Vec<&str> = p.split('-').collect();
            assert_eq!(parts[1], TRACE);
            parts[2].to_string()
        })
        .collect();
    assert_eq!(sent.len(), 3);
    let summary: Vec<(String, i64, String, String)> = tries
        .iter()
        .map(|t| {
            assert_eq!(t.parent_span_id, server.span_id);
            assert_eq!(text(t, "server.address"), "127.0.0.1");
            let port = int(t, "server.port") as u16;
            assert!(eps.iter().any(|e| e.port() == port));
            assert!(t.start_time_unix_nano >= server.start_time_unix_nano);
            assert!(t.end_time_unix_nano <= server.end_time_unix_nano);
            (
                hex(&t.span_id),
                int(t, "keel.try.attempt"),
                text(t, "keel.try.kind").to_string(),
                text(t, "keel.try.outcome").to_string(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (sent[0].clone(), 0, "first".into(), "status 503".into()),
            (sent[1].clone(), 1, "retry".into(), "status 503".into()),
            (sent[2].clone(), 2, "retry".into(), "ok".into()),
        ]
    );
    // Failed tries are errors; the last one's status the client's.
    assert_eq!(
        tries[0].status.as_ref().unwrap().code,
        StatusCode::Error as i32
    );
    assert!(tries[2].status.is_none());
    assert_eq!(int(&tries[2], "http.response.status_code"), 200);
    assert_eq!(int(&tries[1], "http.request.resend_count"), 1);
    // One after another.
    assert!(tries[0].end_time_unix_nano <= tries[1].start_time_unix_nano);
    assert!(tries[1].end_time_unix_nano <= tries[2].start_time_unix_nano);
    assert_eq!(
        metric_reaches(&proxy, "keel_trace_spans_exported_total", 4).await,
        4
    );
    assert_eq!(metric(&proxy, "keel_trace_spans_dropped_total").await, 0);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_request_exports_both_tries_the_loser_cancelled() {
    let (otlp, c) = collector(false).await;
    // The first try answers only after 2 s; the hedge, sent at 50 ms, at once.
    let (eps, seen) = endpoints(2, |n| if n == 0 { (2000, 200) } else { (0, 200) }).await;
    let tracing = format!("sample = 1.0\notlp = \"http://{otlp}\"");
    let hedge = "[cluster.hedge]\ndelay = \"50ms\"\nbudget_percent = 100.0\n";
    let proxy = keel_proxy::start(config(&eps, &tracing, hedge))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let start = Instant::now();
    assert_eq!(get(&url, &[]).await, 200);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the hedge answered"
    );

    let all = spans(&c, 3).await;
    assert_eq!(all.len(), 3, "{all:#?}");
    let (server, tries) = split(&all);
    // A new trace: no parent; both tries the request span's children.
    assert!(server.parent_span_id.is_empty());
    assert!(all.iter().all(|s| s.trace_id == server.trace_id));
    assert_eq!(int(&server, "keel.tries"), 1, "the access log's count");
    let (first, hedge) = (&tries[0], &tries[1]);
    for t in &tries {
        assert_eq!(t.parent_span_id, server.span_id);
        assert_eq!(int(t, "keel.try.attempt"), 0);
    }
    assert_eq!(text(first, "keel.try.kind"), "first");
    assert_eq!(text(first, "keel.try.outcome"), "cancelled");
    assert_eq!(
        attr(first, "keel.try.cancelled"),
        Some(&Value::BoolValue(true))
    );
    assert!(first.status.is_none(), "cancelled is not an error");
    assert_eq!(text(hedge, "keel.try.kind"), "hedge");
    assert_eq!(text(hedge, "keel.try.outcome"), "ok");
    assert_ne!(int(first, "server.port"), int(hedge, "server.port"));
    // Each try's span id is the one its endpoint saw.
    let sent: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.split('-').nth(2).unwrap().to_string())
        .collect();
    assert_eq!(sent, [hex(&first.span_id), hex(&hedge.span_id)]);
    // The loser ran from its start until the hedge won: about 50 ms, well under its 2 s.
    let ran = Duration::from_nanos(first.end_time_unix_nano - first.start_time_unix_nano);
    assert!(
        ran >= Duration::from_millis(40) && ran < Duration::from_secs(1),
        "{ran:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_out_requests_export_nothing() {
    let (otlp, c) = collector(false).await;
    let (eps, _) = endpoints(1, |_| (0, 200)).await;
    let tracing = format!("sample = 0.0\notlp = \"http://{otlp}\"");
    let proxy = keel_proxy::start(config(&eps, &tracing, "")).await.unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let other = "0af7651916cd43dd8448eb211c80319c";
    // A new trace at sample 0, and a caller's unsampled one: nothing exported.
    assert_eq!(get(&url, &[]).await, 200);
    let unsampled = format!("00-{other}-{PARENT}-00");
    assert_eq!(get(&url, &[("traceparent", &unsampled)]).await, 200);
    // A caller's sampled trace is exported (parent-based), and it alone.
    let sampled = format!("00-{TRACE}-{PARENT}-01");
    assert_eq!(get(&url, &[("traceparent", &sampled)]).await, 200);
    spans(&c, 2).await;
    // Past another batch's wait: still only the sampled request's two spans.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let all = c.spans.lock().unwrap().clone();
    assert_eq!(all.len(), 2, "{all:#?}");
    assert!(all.iter().all(|s| hex(&s.trace_id) == TRACE));
    assert_eq!(
        metric_reaches(&proxy, "keel_trace_spans_exported_total", 2).await,
        2
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_drops_and_counts_and_never_holds_a_request() {
    // The collector takes the first export and never answers it.
    let (otlp, c) = collector(true).await;
    let (eps, _) = endpoints(1, |_| (0, 200)).await;
    let tracing = format!("sample = 1.0\notlp = \"http://{otlp}\"\nqueue = 4");
    let proxy = keel_proxy::start(config(&eps, &tracing, "")).await.unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    assert_eq!(get(&url, &[]).await, 200);
    let start = Instant::now();
    while c.calls.load(Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the export call");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The exporter now waits on the collector: 4 requests fill the queue, 6 more are dropped
    // (2 spans each), and none of them waits.
    let start = Instant::now();
    for _ in 0..10 {
        assert_eq!(get(&url, &[]).await, 200);
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert_eq!(metric(&proxy, "keel_trace_spans_dropped_total").await, 12);
    assert_eq!(metric(&proxy, "keel_trace_spans_exported_total").await, 0);
    assert_eq!(c.calls.load(Ordering::SeqCst), 1);
    proxy.shutdown(Duration::from_secs(1)).await;
}
