//! W3C Trace Context on loopback: a client's valid `traceparent` is
//! continued (same trace id at the endpoint, keel's try span as the parent, the sampled flag
//! kept), an absent or malformed one starts a new trace, each retry sends its own span id in
//! the same trace, `tracestate` passes unchanged, and the access log's `trace_id` is the trace
//! the endpoint saw; over HTTP/1.1 and HTTP/2 front ends, to HTTP/1.1 and h2c endpoints.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, StatusCode};
use keel_proxy::ProxyConfig;
use serde_json::Value;

use crate::support::*;

/// What an endpoint saw of one request: every `traceparent` and `tracestate` value.
#[derive(Debug, Clone)]
struct Seen {
    traceparent: Vec<String>,
    tracestate: Vec<String>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// An endpoint (HTTP/1.1 or h2c, whichever the connection speaks) that records the trace
/// headers of each request and answers 503 to paths under `/fail`, else 200.
async fn recording_endpoint() -> (SocketAddr, Log) {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log: Log = Arc::default();
    let seen = log.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let all = |name: &str| -> Vec<String> {
                        req.headers()
                            .get_all(name)
                            .iter()
                            .map(|v| v.to_str().unwrap().to_string())
                            .collect()
                    };
                    seen.lock().unwrap().push(Seen {
                        traceparent: all("traceparent"),
                        tracestate: all("tracestate"),
                    });
                    let status = if req.uri().path().starts_with("/fail") {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::OK
                    };
                    async move {
                        let resp = hyper::Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from_static(b"ok")))
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(resp)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    (addr, log)
}

/// A `traceparent` taken apart: (trace id, parent id, flags).
fn parts(v: &str) -> (String, String, String) {
    let p: Vec<&str> = v.split('-').collect();
    assert_eq!(p.len(), 4, "{v}");
    assert_eq!(p[0], "00", "{v}");
    assert_eq!((p[1].len(), p[2].len(), p[3].len()), (32, 16, 2), "{v}");
    for id in [p[1], p[2]] {
        assert!(
            id.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "lowercase hex: {v}"
        );
        assert!(id.bytes().any(|b| b != b'0'), "not all zero: {v}");
    }
    (p[1].to_string(), p[2].to_string(), p[3].to_string())
}

/// The only `traceparent` an endpoint saw in its `n`-th request.
fn sent(log: &Log, n: usize) -> (String, String, String) {
    let seen = log.lock().unwrap()[n].clone();
    assert_eq!(seen.traceparent.len(), 1, "one traceparent: {seen:?}");
    parts(&seen.traceparent[0])
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("keel-trace-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One listener, one cluster over `endpoints` (`cluster_extra` lines in its table), the
/// access log in `log` and `[tracing]` with `tracing` lines (none: no table).
fn config(
    endpoints: &[SocketAddr],
    cluster_extra: &str,
    tracing: Option<&str>,
    log: &std::path::Path,
) -> ProxyConfig {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let tracing = tracing.map_or(String::new(), |t| format!("[tracing]\n{t}\n\n"));
    let text = format!(
        "{tracing}[access_log]\npath = \"{}\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n\
         [[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\nendpoints = [{}]\n{cluster_extra}\n",
        log.display(),
        eps.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "test.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// The access log's lines as JSON, once `n` are written.
async fn log_lines(path: &std::path::Path, n: usize) -> Vec<Value> {
    let read = || {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<Value>>()
    };
    assert!(
        eventually(Duration::from_secs(5), || read().len() >= n).await,
        "{n} access-log lines: {:?}",
        read()
    );
    read()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_a_valid_traceparent_is_continued_and_a_missing_or_malformed_one_starts_a_trace() {
    let d = dir("h1");
    let (ep, seen) = recording_endpoint().await;
    let log = d.join("access.log");
    let proxy = keel_proxy::start(config(&[ep], "", Some("sample = 1.0"), &log))
        .await
        .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let c = client();
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let unsampled = format!("00-{TRACE}-{PARENT}-00");
    let requests: [&[(&str, &str)]; 4] = [
        &[
            ("traceparent", &incoming),
            ("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        ],
        &[("traceparent", &unsampled)],
        &[],
        &[("traceparent", "00-XYZ-nonsense-01"), ("tracestate", "a=1")],
    ];
    for headers in requests {
        let got = send(&c, Method::GET, &url, headers, b"").await.unwrap();
        assert_eq!(got.status, 200);
    }

    // Continued: the caller's trace and sampled flag; keel's try span as the parent.
    let (trace, parent, flags) = sent(&seen, 0);
    assert_eq!(trace, TRACE);
    assert_ne!(parent, PARENT, "the endpoint's parent is keel's span");
    assert_eq!(flags, "01");
    let first = seen.lock().unwrap()[0].clone();
    assert_eq!(
        first.tracestate,
        ["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"]
    );
    // Parent-based: the caller's "not sampled" wins over `sample = 1.0`.
    let (trace, parent, flags) = sent(&seen, 1);
    assert_eq!((trace.as_str(), flags.as_str()), (TRACE, "00"));
    assert_ne!(parent, PARENT);
    // New traces, sampled at 1.0 (and flagged random, level 2); the stale tracestate gone.
    let (new_a, _, flags_a) = sent(&seen, 2);
    let (new_b, _, flags_b) = sent(&seen, 3);
    assert_ne!(new_a, TRACE);
    assert_ne!(new_a, new_b);
    assert_eq!((flags_a.as_str(), flags_b.as_str()), ("03", "03"));
    assert!(seen.lock().unwrap()[3].tracestate.is_empty());

    // The access log's trace_id is the trace each endpoint saw.
    let lines = log_lines(&log, 4).await;
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| l["trace_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [TRACE, TRACE, &new_a, &new_b]);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_retry_sends_its_own_span_in_the_same_trace() {
    let d = dir("retry");
    let mut eps = Vec::new();
    let mut logs = Vec::new();
    for _ in 0..3 {
        let (a, l) = recording_endpoint().await;
        eps.push(a);
        logs.push(l);
    }
    let log = d.join("access.log");
    let retry = "[cluster.retry]\nattempts = 2\nbudget_percent = 100.0\n";
    let proxy = keel_proxy::start(config(&eps, retry, Some("sample = 0.0"), &log))
        .await
        .unwrap();
    let url = format!("http://{}/fail", proxy.listener_addrs()[0]);
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let got = send(
        &client(),
        Method::GET,
        &url,
        &[("traceparent", &incoming)],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(got.status, 503);
    let mut spans = Vec::new();
    for l in &logs {
        assert_eq!(l.lock().unwrap().len(), 1, "each endpoint tried once");
        let (trace, parent, flags) = sent(l, 0);
        assert_eq!((trace.as_str(), flags.as_str()), (TRACE, "01"));
        spans.push(parent);
    }
    spans.sort();
    spans.dedup();
    assert_eq!(spans.len(), 3, "three tries, three span ids: {spans:?}");
    assert!(!spans.contains(&PARENT.to_string()));
    let lines = log_lines(&log, 1).await;
    assert_eq!(lines[0]["trace_id"], TRACE);
    assert_eq!(lines[0]["tries"].as_array().unwrap().len(), 3);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_traced_to_http1_and_h2c_endpoints() {
    for protocol in ["http1", "h2c"] {
        let d = dir(&format!("h2-{protocol}"));
        let (ep, seen) = recording_endpoint().await;
        let log = d.join("access.log");
        let extra = format!("protocol = \"{protocol}\"\n");
        let proxy = keel_proxy::start(config(&[ep], &extra, Some("sample = 1.0"), &log))
            .await
            .unwrap();
        let addr = proxy.listener_addrs()[0];
        let url = format!("http://{addr}/x");
        let mut h2 = h2_connect(addr).await;
        let incoming = format!("00-{TRACE}-{PARENT}-01");
        let headers = [("traceparent", incoming.as_str()), ("tracestate", "k=v")];
        let got = h2_send(&mut h2, Method::GET, &url, &headers).await;
        assert_eq!(got.status, 200, "{protocol}");
        let got = h2_send(&mut h2, Method::GET, &url, &[("traceparent", "junk")]).await;
        assert_eq!(got.status, 200, "{protocol}");

        let (trace, parent, flags) = sent(&seen, 0);
        assert_eq!(
            (trace.as_str(), flags.as_str()),
            (TRACE, "01"),
            "{protocol}"
        );
        assert_ne!(parent, PARENT, "{protocol}");
        assert_eq!(seen.lock().unwrap()[0].tracestate, ["k=v"], "{protocol}");
        let (fresh, _, _) = sent(&seen, 1);
        assert_ne!(fresh, TRACE, "{protocol}");
        let lines = log_lines(&log, 2).await;
        assert_eq!(lines[0]["trace_id"], TRACE, "{protocol}");
        assert_eq!(lines[1]["trace_id"], fresh.as_str(), "{protocol}");
        assert_eq!(lines[1]["protocol"], "HTTP/2.0");
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tracing_a_traceparent_passes_untouched() {
    let d = dir("off");
    let (ep, seen) = recording_endpoint().await;
    let log = d.join("access.log");
    let proxy = keel_proxy::start(config(&[ep], "", None, &log))
        .await
        .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    send(
        &client(),
        Method::GET,
        &url,
        &[("traceparent", &incoming)],
        b"",
    )
    .await
    .unwrap();
    get(&url).await.unwrap();
    assert_eq!(seen.lock().unwrap()[0].traceparent, [incoming]);
    assert!(seen.lock().unwrap()[1].traceparent.is_empty());
    let lines = log_lines(&log, 2).await;
    assert!(lines.iter().all(|l| l["trace_id"].is_null()));
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_id_is_a_header_variable() {
    let edits = "request_headers = { set = { \"x-trace\" = \"t=$trace_id\" } }\n\
                 response_headers = { set = { \"x-trace-id\" = \"$trace_id\" } }\n";
    for tracing in [Some("sample = 0.0"), None] {
        let d = dir(&format!("var-{}", tracing.is_some()));
        let (ep, _) = recording_endpoint().await;
        let log = d.join("access.log");
        let proxy = keel_proxy::start(config(&[ep], edits, tracing, &log))
            .await
            .unwrap();
        let url = format!("http://{}/x", proxy.listener_addrs()[0]);
        let c = client();
        let incoming = format!("00-{TRACE}-{PARENT}-01");
        let continued = send(&c, Method::GET, &url, &[("traceparent", &incoming)], b"")
            .await
            .unwrap();
        let started = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        let id = |g: &Got| g.headers["x-trace-id"].to_str().unwrap().to_string();
        if tracing.is_some() {
            // The continued trace's id, and a new trace's: the access log's `trace_id`.
            assert_eq!(id(&continued), TRACE);
            let lines = log_lines(&log, 2).await;
            assert_eq!(lines[1]["trace_id"], id(&started).as_str());
            assert_eq!(id(&started).len(), 32);
            assert_ne!(id(&started), TRACE);
        } else {
            // Without `[tracing]` there is no trace: the variable is empty.
            assert_eq!(id(&continued), "");
            assert_eq!(id(&started), "");
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_gets_trace_id_as_a_header() {
    // An endpoint that echoes the `x-trace` it got as its answer's body.
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let ep = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
                    let v = req.headers().get("x-trace").cloned();
                    async move {
                        let body = v.map_or(Bytes::new(), |v| Bytes::copy_from_slice(v.as_bytes()));
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(body)))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let d = dir("var-endpoint");
    let edits = "request_headers = { set = { \"x-trace\" = \"t=$trace_id\" } }\n";
    let proxy = keel_proxy::start(config(&[ep], edits, Some("sample = 0.0"), &d.join("a.log")))
        .await
        .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);
    let incoming = format!("00-{TRACE}-{PARENT}-01");
    let got = send(
        &client(),
        Method::GET,
        &url,
        &[("traceparent", &incoming)],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(got.text(), format!("t={TRACE}"));
    proxy.shutdown(Duration::from_secs(1)).await;
}
