//! One timeout model for every front end: `request_timeout` runs until the response head,
//! then the body streams as long as the endpoint sends something every `upstream_idle_timeout`
//! and the client takes it within `client_idle_timeout` (and, if set, until `max_duration`).
//! A server-sent event stream longer than the request timeout is not cut (HTTP/1.1 and HTTP/2
//! clients); a stalled endpoint and a stalled client are.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// An endpoint that answers every request with a chunked body: `events` chunks, one every
/// `gap`, then (if `stall`) nothing more, holding the connection; or the last chunk.
async fn event_stream(events: usize, gap: Duration, stall: bool) -> SocketAddr {
    events_of(events, gap, stall, 0).await
}

/// As [`event_stream`], each event padded with `pad` bytes.
async fn events_of(events: usize, gap: Duration, stall: bool, pad: usize) -> SocketAddr {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                        _ => return,
                    }
                }
                let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                if s.write_all(head).await.is_err() {
                    return;
                }
                let padding = "x".repeat(pad);
                for i in 0..events {
                    let event = format!("data: {i}{padding}\n\n");
                    let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                    if s.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                    if !gap.is_zero() {
                        tokio::time::sleep(gap).await;
                    }
                }
                if stall {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    return;
                }
                let _ = s.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    addr
}

fn config(endpoint: SocketAddr, cluster_extra: &str, listener_extra: &str) -> ProxyConfig {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n{cluster_extra}\n"
    );
    ProxyConfig::from_toml_str(&text, "t.toml").unwrap()
}

/// `GET /` over HTTP/1.1 read to its end: (whole answer, time taken).
async fn h1_get(addr: SocketAddr) -> (String, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_outlasts_the_request_timeout_for_http1_and_http2_clients() {
    // 8 events 250 ms apart: 2 s of body behind a 500 ms request timeout.
    let up = event_stream(8, Duration::from_millis(250), false).await;
    let proxy = keel_proxy::start(config(up, "request_timeout = \"500ms\"", ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (text, took) = h1_get(addr).await;
    assert!(took >= Duration::from_millis(1900), "{took:?}");
    for i in 0..8 {
        assert!(
            text.contains(&format!("data: {i}\n")),
            "event {i} missing: {text}"
        );
    }
    assert!(
        text.ends_with("0\r\n\r\n"),
        "the body ended properly: {text:?}"
    );

    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{addr}/"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("the whole stream")
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    for i in 0..8 {
        assert!(
            body.contains(&format!("data: {i}\n")),
            "HTTP/2: event {i} missing: {body}"
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A streamed GET from an HTTP/1.1 client (`http2` false) or an HTTP/2 one: the body as
/// text, whether it ended properly (the last chunk; for HTTP/2, the stream's end rather than
/// a reset), and how long it took. Bounded: a body that is never cut fails the test.
async fn stream_get(addr: SocketAddr, http2: bool) -> (String, bool, Duration) {
    let get = async {
        if !http2 {
            let (text, took) = h1_get(addr).await;
            let ended = text.ends_with("0\r\n\r\n");
            return (text, ended, took);
        }
        let mut send = h2_connect(addr).await;
        let t = Instant::now();
        let req = hyper::Request::get(format!("http://{addr}/"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut text = String::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else {
                return (text, false, t.elapsed());
            };
            if let Some(d) = frame.data_ref() {
                text.push_str(&String::from_utf8_lossy(d));
            }
        }
        (text, true, t.elapsed())
    };
    tokio::time::timeout(Duration::from_secs(5), get)
        .await
        .expect("the body ends or is cut within 5 s")
}

/// For HTTP/1.1 and HTTP/2 clients alike: a stalled endpoint's body is cut once
/// `upstream_idle_timeout` passes with nothing from it (not at once, not never), and an
/// endless one at `max_duration`, without blaming the endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_endpoint_is_cut_after_upstream_idle_timeout_and_max_duration_caps_a_stream() {
    let stalling = event_stream(2, Duration::from_millis(50), true).await;
    let proxy = keel_proxy::start(config(stalling, "upstream_idle_timeout = \"400ms\"", ""))
        .await
        .unwrap();
    for http2 in [false, true] {
        let (text, ended, took) = stream_get(proxy.listener_addrs()[0], http2).await;
        assert!(text.contains("data: 1\n"), "http2 {http2}: {text}");
        assert!(!ended, "http2 {http2}: cut, not ended: {text:?}");
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_secs(3),
            "http2 {http2}: {took:?}"
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;

    // An endless stream (an event every 100 ms) is cut at max_duration, and the endpoint
    // is not counted failed for it.
    let endless = event_stream(1000, Duration::from_millis(100), false).await;
    let proxy = keel_proxy::start(config(
        endless,
        "request_timeout = \"500ms\"\nmax_duration = \"1s\"",
        "",
    ))
    .await
    .unwrap();
    for http2 in [false, true] {
        let (text, _, took) = stream_get(proxy.listener_addrs()[0], http2).await;
        assert!(text.contains("data: 3\n"), "http2 {http2}: {text}");
        assert!(
            took >= Duration::from_millis(950) && took < Duration::from_secs(3),
            "http2 {http2}: {took:?}"
        );
    }
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "{st:?}");
    assert_eq!(st[0].in_flight, 0, "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_after_client_idle_timeout() {
    // A body far larger than the socket buffers (64 MB), sent as fast as it can go.
    let big = events_of(1024, Duration::ZERO, false, 64 * 1024).await;
    let proxy = keel_proxy::start(config(big, "", "client_idle_timeout = \"500ms\""))
        .await
        .unwrap();
    let mut s = TcpStream::connect(proxy.listener_addrs()[0]).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 256];
    let _ = s.read(&mut first).await.unwrap();
    // Now the client reads nothing; the buffers fill and keel waits on it.
    let released = eventually(Duration::from_secs(5), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 0
    })
    .await;
    assert!(
        released,
        "the stalled client's request is cut and its pick released"
    );
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "the endpoint did nothing wrong: {st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn timeouts_are_checked() {
    let up: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let text = |c: &str, l: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{l}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{up}\" }}]\n{c}\n"
        )
    };
    let e = ProxyConfig::from_toml_str(&text("upstream_idle_timeout = \"0s\"", ""), "t.toml")
        .unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].upstream_idle_timeout"),
        "{e}"
    );
    let e = ProxyConfig::from_toml_str(&text("max_duration = \"1s\"", ""), "t.toml").unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].max_duration"), "{e}");
    assert!(e.message.contains("at least request_timeout (15s)"), "{e}");
    let e = ProxyConfig::from_toml_str(&text("", "client_idle_timeout = \"0s\""), "t.toml")
        .unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("listener[0].client_idle_timeout"),
        "{e}"
    );
    let c = ProxyConfig::from_toml_str(&text("", ""), "t.toml").unwrap();
    assert_eq!(
        c.clusters[0].timeouts.upstream_idle,
        Duration::from_secs(60)
    );
    assert_eq!(c.clusters[0].timeouts.max_duration, None);
    assert_eq!(c.listeners[0].client_idle_timeout, Duration::from_secs(10));
}

/// Sends a `Content-Length` body of `pieces` x `piece` bytes, one piece every `gap` (then
/// stops early after `stop_after` pieces if set), and reads the answer.
async fn slow_upload(
    addr: SocketAddr,
    pieces: usize,
    piece: usize,
    gap: Duration,
    stop_after: Option<usize>,
) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        pieces * piece
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let data = vec![b'u'; piece];
    for i in 0..pieces {
        if stop_after == Some(i) {
            break;
        }
        if s.write_all(&data).await.is_err() {
            break;
        }
        tokio::time::sleep(gap).await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_outlasts_the_per_try_and_request_timeouts_and_a_stalled_one_is_a_408() {
    let (echo, _) = echo_server().await;
    // 400 KB at about 200 KB/s (2 s) behind a 600 ms request timeout (300 ms per try).
    let proxy = keel_proxy::start(config(
        echo,
        "request_timeout = \"600ms\"\n[cluster.retry]\nattempts = 1",
        "client_idle_timeout = \"700ms\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let text = slow_upload(addr, 20, 20 * 1024, Duration::from_millis(100), None).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("body-length: 409600"), "{text}");
    // Half a body, then nothing: the client's 408 after client_idle_timeout, and the endpoint
    // is not blamed.
    let t = Instant::now();
    let text = slow_upload(addr, 20, 20 * 1024, Duration::from_millis(50), Some(10)).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_opens_no_window_is_cut_and_frees_its_slots() {
    // The attack: connections with SETTINGS_INITIAL_WINDOW_SIZE = 0 that never send a
    // WINDOW_UPDATE, each with many streams, against max_in_flight.
    let up = event_stream(1, Duration::ZERO, false).await;
    let proxy = keel_proxy::start(config(
        up,
        "max_in_flight = 300",
        "client_idle_timeout = \"500ms\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut conns = Vec::new();
    let mut responses = Vec::new();
    // The bound: reset within client_idle_timeout + 1 s of the stall's start.
    let stall_start = Instant::now();
    for _ in 0..2 {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::Builder::new()
            .initial_window_size(0)
            .handshake::<_, Bytes>(tcp)
            .await
            .unwrap();
        conns.push(tokio::spawn(conn));
        let mut client = client.ready().await.unwrap();
        for _ in 0..100 {
            let req = hyper::Request::get(format!("http://{addr}/"))
                .body(())
                .unwrap();
            let (resp, _) = client.send_request(req, true).unwrap();
            responses.push(resp);
            client = client.ready().await.unwrap();
        }
    }
    // The streams are in flight: their heads come (headers need no window), bodies cannot.
    let busy = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].in_flight >= 150
    })
    .await;
    assert!(busy, "{:?}", proxy.cluster_status("app"));
    let t = Instant::now();
    let freed = eventually(Duration::from_secs(5), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 0
    })
    .await;
    assert!(freed, "{:?}", proxy.cluster_status("app"));
    assert!(
        stall_start.elapsed() < Duration::from_millis(500 + 1000),
        "{:?} ({:?} after the streams were in flight)",
        stall_start.elapsed(),
        t.elapsed()
    );
    // Both connections were closed by keel.
    for c in conns {
        let ended = tokio::time::timeout(Duration::from_secs(2), c).await;
        assert!(ended.is_ok(), "the connection ended");
    }
    drop(responses);
    // Another client is served at once.
    let (text, _) = h1_get(addr).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "the endpoint did nothing wrong: {st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// With every timeout at its default (a config of one listener and one endpoint), an event
/// stream longer than the default `request_timeout` (15 s) and a 1 MB upload at about
/// 100 KB/s (10 s, longer than a per-try share of it) both succeed, side by side.
/// `KEEL_LONG_STREAM_SECS=60` runs the full-length stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_timeouts_carry_a_long_event_stream_and_a_slow_upload() {
    let secs: usize = std::env::var("KEEL_LONG_STREAM_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(17);
    let events = event_stream(secs, Duration::from_secs(1), false).await;
    let (echo, _) = echo_server().await;
    let sse = keel_proxy::start(config(events, "", "")).await.unwrap();
    let upload = keel_proxy::start(config(echo, "", "")).await.unwrap();
    let (sse_addr, upload_addr) = (sse.listener_addrs()[0], upload.listener_addrs()[0]);
    let stream = tokio::spawn(async move { h1_get(sse_addr).await });
    // 1 MB (100 pieces of 10 KiB, one every 100 ms).
    let t = Instant::now();
    let text = slow_upload(
        upload_addr,
        100,
        10 * 1024,
        Duration::from_millis(100),
        None,
    )
    .await;
    let took = t.elapsed();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("body-length: 1024000"), "{text}");
    assert!(took >= Duration::from_secs(10), "{took:?}");
    let (text, took) = stream.await.unwrap();
    assert!(took >= Duration::from_secs(secs as u64 - 1), "{took:?}");
    for i in 0..secs {
        assert!(text.contains(&format!("data: {i}\n")), "event {i} missing");
    }
    assert!(text.ends_with("0\r\n\r\n"), "the stream ended properly");
    sse.shutdown(Duration::from_secs(1)).await;
    upload.shutdown(Duration::from_secs(1)).await;
}

/// An HTTP/2 client that resets its stream while keel waits on the endpoint ends the request
/// there: the endpoint's slot is free at once (long before any timeout), the endpoint is not
/// blamed, and the client's connection goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_resets_its_stream_frees_the_endpoint_at_once() {
    // An endpoint that reads requests and never answers.
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let endpoint = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    let proxy = keel_proxy::start(config(endpoint, "", "")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = hyper::Request::get(format!("http://{addr}/"))
        .body(())
        .unwrap();
    let (resp, _) = client.send_request(req, true).unwrap();
    let waiting = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 1
    })
    .await;
    assert!(waiting, "{:?}", proxy.cluster_status("app"));
    // Dropping the response's handle resets the stream (RST_STREAM CANCEL).
    let t = Instant::now();
    drop(resp);
    let freed = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 0
    })
    .await;
    assert!(freed, "{:?}", proxy.cluster_status("app"));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "the endpoint did nothing wrong: {st:?}");
    // The connection still takes streams (`ready` hands the handle back: dropping the last
    // one would close the connection from the client's side).
    let _client = client
        .ready()
        .await
        .expect("the connection still takes streams");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!conn.is_finished(), "keel closed the connection: {conn:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}
