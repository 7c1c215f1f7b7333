//! A second `Content-Length` header is refused even when it repeats the first one's value:
//! from a client (HTTP/1.1 or HTTP/2) with 400 before anything reaches an endpoint, from an
//! endpoint with 502. (RFC 9112 section 6.3 lets a recipient merge equal values; a hop that
//! merges next to one that refuses is how requests are smuggled. NGINX refuses too.)

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An endpoint that answers every request with `script` and closes.
async fn scripted(script: &'static [u8]) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(script).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_equal_content_lengths_from_a_client_are_refused_over_http1_and_http2() {
    let bs = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(simple_config(&[bs[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];

    let h1 = raw_exchange(
        addr,
        b"POST /twice HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 4\r\n\r\nabcd",
    )
    .await;
    assert!(h1.starts_with("HTTP/1.1 400 "), "HTTP/1.1: {h1:?}");
    assert!(h1.contains("repeated Content-Length"), "HTTP/1.1: {h1:?}");
    // One Content-Length still goes through.
    let once = raw_exchange(
        addr,
        b"POST /once HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 4\r\n\r\nabcd",
    )
    .await;
    assert!(once.starts_with("HTTP/1.1 200 "), "one header: {once:?}");

    let mut h2 = h2_connect(addr).await;
    let url = format!("http://{addr}/twice");
    let two = [("content-length", "0"), ("content-length", "0")];
    let got = h2_send(&mut h2, Method::GET, &url, &two).await;
    assert_eq!(
        got.status,
        StatusCode::BAD_REQUEST,
        "HTTP/2: {}",
        got.text()
    );
    let got = h2_send(&mut h2, Method::GET, &url, &two[..1]).await;
    assert_eq!(
        got.status,
        StatusCode::OK,
        "HTTP/2, one header: {}",
        got.text()
    );

    // Only the two accepted requests reached the endpoint.
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].successes + st[0].failures, 2, "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_equal_content_lengths_from_an_endpoint_are_a_bad_gateway() {
    let up = scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok").await;
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nerror_detail = \"full\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{up}\" }}]\n[cluster.retry]\nattempts = 0\n"
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let got = raw_exchange(
        addr,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(got.starts_with("HTTP/1.1 502 "), "{got:?}");
    assert!(got.contains("repeated Content-Length"), "{got:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}
