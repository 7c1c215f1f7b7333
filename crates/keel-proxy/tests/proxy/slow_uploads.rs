//! A request body is bounded by its own limits, the same on both front ends: each read within
//! `client_idle_timeout`, the whole body within `request_body_timeout` plus a second per
//! `request_body_min_rate` bytes received, the whole request within `max_duration`. A slow
//! upload gets `408` naming the bound that cut it, so it cannot hold an endpoint slot forever;
//! one that keeps to the bounds is never cut by a try's timeout (time waiting on the client
//! does not count against the endpoint), over HTTP/1.1 and HTTP/2 alike.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

fn config(endpoint: SocketAddr, cluster_extra: &str, listener_extra: &str) -> ProxyConfig {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n{cluster_extra}\n"
    );
    ProxyConfig::from_toml_str(&text, "t.toml").unwrap()
}

/// A slow uploader: a declared 1 MB body sent a byte every `gap`; the answer read
/// until the connection closes (or `limit` passes).
async fn trickle(addr: SocketAddr, gap: Duration, limit: Duration) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = "POST /upload HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n";
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    let end = Instant::now() + limit;
    while Instant::now() < end {
        // Another byte, unless keel has answered.
        match tokio::time::timeout(gap, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => {
                if s.write_all(b"u").await.is_err() {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /` on a new connection: the status line.
async fn status_of_get(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    text.lines().next().unwrap_or("").to_string()
}

/// The attack: 100 connections each trickling a byte every 200 ms of a declared 1 MB
/// body take all of `max_in_flight = 100`. Each is cut with `408` once its body is slower than
/// `request_body_timeout` and the minimum rate allow (1 s here, the default being 60 s), the
/// endpoint is not blamed, and a normal client is served again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_uploaders_cannot_hold_every_slot() {
    let (echo, _) = echo_server().await;
    let proxy = keel_proxy::start(config(
        echo,
        "max_in_flight = 100",
        "request_body_timeout = \"1s\"\nrequest_body_min_rate = 1000",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let t = Instant::now();
    let uploads: Vec<_> = (0..100)
        .map(|_| {
            tokio::spawn(trickle(
                addr,
                Duration::from_millis(200),
                Duration::from_secs(8),
            ))
        })
        .collect();
    let full = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].in_flight == 100
    })
    .await;
    assert!(full, "{:?}", proxy.cluster_status("app"));
    // The slots are all taken: a normal client is refused now, served once the bound cuts
    // the uploads (well before the 8 s they would go on for).
    let mut statuses = Vec::new();
    let served = loop {
        let status = status_of_get(addr).await;
        if status.starts_with("HTTP/1.1 200") {
            break t.elapsed();
        }
        statuses.push(status);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "never served: {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(served < Duration::from_secs(4), "{served:?}");
    for u in uploads {
        let text = u.await.unwrap();
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("request_body_timeout"), "{text}");
    }
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!((st[0].in_flight, st[0].failures), (0, 0), "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// With a generous body bound, `max_duration` cuts a slow upload first, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_duration_cuts_a_slow_upload_and_is_named() {
    let (echo, _) = echo_server().await;
    let proxy = keel_proxy::start(config(
        echo,
        "request_timeout = \"500ms\"\nmax_duration = \"1s\"",
        "request_body_timeout = \"30s\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let t = Instant::now();
    let text = trickle(addr, Duration::from_millis(100), Duration::from_secs(5)).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("max_duration"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// An HTTP/2 upload: `pieces` DATA frames of `piece` bytes, one every `gap`; (status, body).
async fn h2_upload(addr: SocketAddr, pieces: usize, piece: usize, gap: Duration) -> (u16, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = hyper::Request::post(format!("http://{addr}/upload"))
        .header("content-length", (pieces * piece).to_string())
        .body(())
        .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    let sending = tokio::spawn(async move {
        for _ in 0..pieces {
            send.reserve_capacity(piece);
            if send
                .send_data(Bytes::from(vec![b'u'; piece]), false)
                .is_err()
            {
                return;
            }
            tokio::time::sleep(gap).await;
        }
        let _ = send.send_data(Bytes::new(), true);
    });
    let resp = tokio::time::timeout(Duration::from_secs(20), resp)
        .await
        .expect("an answer")
        .unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        text.extend_from_slice(&d);
    }
    sending.abort();
    (status, String::from_utf8_lossy(&text).into_owned())
}

/// The HTTP/2 case: an upload longer than a try's timeout (300 KB over 3 s behind a
/// 500 ms per-try timeout) is `200`, as over HTTP/1.1: time waiting on the client's body does
/// not count against the try. A stalled one is the client's `408`, and the endpoint is not
/// blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_upload_outlasts_the_per_try_timeout() {
    let (echo, _) = echo_server().await;
    let proxy = keel_proxy::start(config(
        echo,
        "request_timeout = \"1s\"\n[cluster.retry]\nattempts = 1",
        "client_idle_timeout = \"700ms\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let t = Instant::now();
    let (status, text) = h2_upload(addr, 30, 10 * 1024, Duration::from_millis(100)).await;
    assert_eq!(status, 200, "{text} after {:?}", t.elapsed());
    assert!(text.contains("body-length: 307200"), "{text}");
    assert!(t.elapsed() >= Duration::from_secs(3), "{:?}", t.elapsed());
    // A byte every 2 s: the client's 408 after client_idle_timeout.
    let (status, text) = h2_upload(addr, 3, 70 * 1024, Duration::from_secs(2)).await;
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("client_idle_timeout"), "{text}");
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].failures, 0, "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// The body bound holds over HTTP/2 too: a stream trickling its body is cut with `408`,
/// `request_body_timeout` named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_slow_upload_is_cut_by_the_body_bound() {
    let (echo, _) = echo_server().await;
    let proxy = keel_proxy::start(config(
        echo,
        "",
        "request_body_timeout = \"1s\"\nrequest_body_min_rate = 100000",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let t = Instant::now();
    let (status, text) = h2_upload(addr, 100, 1024, Duration::from_millis(100)).await;
    assert_eq!(status, 408, "{text}");
    assert!(text.contains("request_body_timeout"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    proxy.shutdown(Duration::from_secs(1)).await;
}
