//! The engine that holds a prefix fails, through the proxy on loopback with real `keel backend
//! --llm` engines and `strategy = "prefix-affinity"`: each prefix it held moves to another
//! engine after at most one failed try (HTTP/1.1 and HTTP/2 clients; the engine answers 500,
//! or refuses); an engine's 400s (the client's error) neither eject it nor move its prefixes;
//! a stream that has sent its first event is never retried (the engine cuts it: the client
//! sees the cut), one that has not is (an engine that sends a stream's head and closes: the
//! client gets the whole stream from the other engine).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use keel_model::FailureMode;
use keel_testbed::llm::{self, LlmConfig, LlmHandle};

const GROUPS: usize = 6;

/// A completion whose prompt opens with group `g`'s shared 400-character prefix.
fn completion(g: usize, n: usize) -> Bytes {
    let shared = format!("System prompt of tenant {g}: ").repeat(16);
    Bytes::from(format!(
        r#"{{"model":"keel-llm","prompt":"{shared} question {n}","max_tokens":2}}"#
    ))
}

/// Sends a completion over HTTP/1.1 or HTTP/2 (prior knowledge); the status and the endpoint
/// keel names.
async fn ask(addr: SocketAddr, h2: bool, body: Bytes) -> (u16, String) {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-keel-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let _ = resp.into_body().collect().await;
    (status, endpoint)
}

async fn engines() -> Vec<LlmHandle> {
    let mut out = Vec::new();
    for _ in 0..3 {
        out.push(llm::spawn(any_port(), LlmConfig::default()).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_affine_engine_costs_each_prefix_at_most_one_failed_try() {
    for (h2, fault) in [
        (
            false,
            FailureMode::ServerError {
                after: Duration::ZERO,
            },
        ),
        (
            true,
            FailureMode::ServerError {
                after: Duration::ZERO,
            },
        ),
        (false, FailureMode::Refuse),
    ] {
        let engines = engines().await;
        let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
        // keel's defaults otherwise: the test is about the strategy, not an outlier detector.
        let proxy = keel_proxy::start(simple_config(&addrs, "prefix-affinity", ""))
            .await
            .unwrap();
        let listen = proxy.listener_addrs()[0];
        let mut home = HashMap::new();
        for round in 0..2 {
            for g in 0..GROUPS {
                let (status, ep) = ask(listen, h2, completion(g, round)).await;
                assert_eq!(status, 200);
                assert_eq!(*home.entry(g).or_insert(ep.clone()), ep, "group {g} stays");
            }
        }
        let failed_addr = home[&0].clone();
        let failed = engines
            .iter()
            .find(|e| e.addr().to_string() == failed_addr)
            .unwrap();
        let held = (0..GROUPS).filter(|g| home[g] == failed_addr).count();
        failed.set_fault(fault);
        let before = failed.requests();
        let mut failures = vec![0usize; GROUPS];
        for round in 2..6 {
            for (g, failed_here) in failures.iter_mut().enumerate() {
                let (status, ep) = ask(listen, h2, completion(g, round)).await;
                if status != 200 {
                    *failed_here += 1;
                } else {
                    assert_ne!(ep, failed_addr, "group {g} answered by the failed engine");
                }
            }
        }
        let reached = failed.requests() - before;
        assert!(
            failures.iter().all(|&f| f <= 1),
            "{fault:?} h2={h2}: failed tries per group {failures:?}"
        );
        // A refused connection is retried by keel (the engine cannot have acted): the client
        // sees no failure at all; a 500 to a POST is passed on, once.
        assert!(
            failures.iter().sum::<usize>() <= held,
            "{fault:?}: {failures:?}, {held} groups held"
        );
        if fault != FailureMode::Refuse {
            assert!(
                reached as usize <= held,
                "{fault:?}: the failed engine got {reached} requests for {held} groups"
            );
        }
        proxy.shutdown(Duration::from_secs(1)).await;
        for e in engines {
            e.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_400s_neither_eject_it_nor_move_its_prefixes() {
    let engines = engines().await;
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "prefix-affinity", ""))
        .await
        .unwrap();
    let listen = proxy.listener_addrs()[0];
    let (_, home) = ask(listen, false, completion(0, 0)).await;
    // A request of group 0 the engine refuses (`max_tokens` 0: the client's error): 400,
    // twenty times, on its home.
    let shared = "System prompt of tenant 0: ".repeat(16);
    let bad = Bytes::from(format!(
        r#"{{"model":"keel-llm","prompt":"{shared} question","max_tokens":0}}"#
    ));
    let mut on_home = 0;
    for _ in 0..20 {
        let (status, ep) = ask(listen, false, bad.clone()).await;
        assert_eq!(status, 400, "the engine refuses max_tokens 0");
        on_home += usize::from(ep == home);
    }
    assert!(on_home >= 15, "the prefix stayed home: {on_home} of 20");
    for n in 1..6 {
        let (status, ep) = ask(listen, false, completion(0, n)).await;
        assert_eq!((status, ep.as_str()), (200, home.as_str()), "still home");
    }
    let status = proxy.cluster_status("app").unwrap();
    assert!(
        status.iter().all(|e| e.ejections_total == 0),
        "no engine ejected: {status:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A streamed completion of group `g` (8 tokens).
fn streamed(g: usize, n: usize) -> Bytes {
    let shared = format!("System prompt of tenant {g}: ").repeat(16);
    Bytes::from(format!(
        r#"{{"model":"keel-llm","prompt":"{shared} question {n}","max_tokens":8,"stream":true}}"#
    ))
}

/// Sends a streamed completion; the status, the endpoint keel names, and the body as far as
/// it came (with whether it ended cleanly).
async fn ask_stream(addr: SocketAddr, h2: bool, body: Bytes) -> (u16, String, String, bool) {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(h2)
        .build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-keel-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    let mut clean = true;
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("the stream moves within 10 s")
    {
        match frame {
            Ok(f) => text.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
            Err(_) => {
                clean = false;
                break;
            }
        }
    }
    (
        status,
        endpoint,
        String::from_utf8_lossy(&text).into_owned(),
        clean,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_sent_its_first_event_is_never_retried() {
    for h2 in [false, true] {
        let engines = engines().await;
        let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
        let proxy = keel_proxy::start(simple_config(&addrs, "prefix-affinity", ""))
            .await
            .unwrap();
        let listen = proxy.listener_addrs()[0];
        let (status, home, text, clean) = ask_stream(listen, h2, streamed(0, 0)).await;
        assert!(
            status == 200 && clean && text.contains("data: [DONE]"),
            "{text}"
        );
        let failing = engines
            .iter()
            .find(|e| e.addr().to_string() == home)
            .unwrap();
        // The engine cuts each stream after half its tokens and resets the connection.
        failing.set_fault(keel_model::FailureMode::Reset);
        let before: Vec<u64> = engines.iter().map(|e| e.requests()).collect();
        let (status, ep, text, clean) = ask_stream(listen, h2, streamed(0, 1)).await;
        assert_eq!((status, ep.as_str()), (200, home.as_str()), "h2={h2}");
        assert!(
            text.contains("data: {"),
            "h2={h2}: a first event came: {text}"
        );
        assert!(
            !clean || !text.contains("[DONE]"),
            "h2={h2}: the stream was cut, not completed elsewhere: {text}"
        );
        let after: Vec<u64> = engines.iter().map(|e| e.requests()).collect();
        let grew: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        assert_eq!(
            grew.iter().sum::<u64>(),
            1,
            "h2={h2}: one try, no retry: {grew:?}"
        );
        proxy.shutdown(Duration::from_secs(1)).await;
        for e in engines {
            e.shutdown().await;
        }
    }
}

/// An engine that answers every request with a stream's head (`200`, `text/event-stream`,
/// chunked) and closes the connection before the first event; it counts the requests.
async fn dies_after_the_head() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut got = Vec::new();
                // The head, then the body by its length.
                loop {
                    let Ok(n) = s.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if got.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                seen.fetch_add(1, Relaxed);
                let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                let _ = s.write_all(head).await;
                let _ = s.flush().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            });
        }
    });
    (addr, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_has_not_sent_its_first_event_is_retried() {
    for h2 in [false, true] {
        let engine = llm::spawn(any_port(), LlmConfig::default()).await.unwrap();
        let (dying, died) = dies_after_the_head().await;
        let proxy = keel_proxy::start(simple_config(
            &[dying, engine.addr()],
            "prefix-affinity",
            "",
        ))
        .await
        .unwrap();
        let listen = proxy.listener_addrs()[0];
        for g in 0..GROUPS {
            let (status, ep, text, clean) = ask_stream(listen, h2, streamed(g, 0)).await;
            assert_eq!(status, 200, "h2={h2} group {g}: {text}");
            assert_eq!(ep, engine.addr().to_string(), "h2={h2} group {g}");
            assert!(
                clean && text.trim_end().ends_with("data: [DONE]"),
                "h2={h2} group {g}: the whole stream: {text}"
            );
        }
        let died = died.load(std::sync::atomic::Ordering::Relaxed);
        assert!(died >= 1, "h2={h2}: the dying engine was tried");
        assert_eq!(
            engine.requests() as usize,
            GROUPS,
            "h2={h2}: each request reached the engine once"
        );
        proxy.shutdown(Duration::from_secs(1)).await;
        engine.shutdown().await;
    }
}
