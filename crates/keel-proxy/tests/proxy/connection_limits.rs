//! Limits: `max_connections` per listener (extra clients wait in the accept
//! queue) and `max_in_flight` per cluster (a circuit breaker answering a fast 503).

use std::time::{Duration, Instant};

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";

/// Sends a keep-alive GET and reads the first answer bytes (None if none within `limit`).
async fn ask(s: &mut TcpStream, limit: Duration) -> Option<String> {
    s.write_all(GET).await.unwrap();
    let mut buf = [0u8; 4096];
    match tokio::time::timeout(limit, s.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_wait_for_a_free_slot() {
    let bs = backends(1, Duration::ZERO).await;
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nmax_connections = 2\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    let slow = Duration::from_secs(2);
    assert!(ask(&mut first, slow)
        .await
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    assert!(ask(&mut second, slow)
        .await
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    // The third connects (the kernel completes the handshake) but is not served...
    let mut third = TcpStream::connect(addr).await.unwrap();
    let waited = ask(&mut third, Duration::from_millis(400)).await;
    assert_eq!(
        waited, None,
        "a third connection was served beyond max_connections = 2"
    );
    // ...until a slot frees: then its request, already sent, is answered.
    drop(first);
    let start = Instant::now();
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(slow, third.read(&mut buf))
        .await
        .expect("served once a slot freed")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    // The second, still open, is still served.
    assert!(ask(&mut second, slow)
        .await
        .unwrap()
        .starts_with("HTTP/1.1 200"));
    eprintln!(
        "max_connections = 2: third connection unserved for 400 ms, served {:?} after a slot freed",
        start.elapsed()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_in_flight_get_a_fast_503() {
    let bs = backends(1, Duration::from_millis(500)).await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nerror_detail = \"full\"\n[[cluster]]\nname = \"app\"\nmax_in_flight = 2\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { get(&url).await })
        })
        .collect();
    // Both slow requests are in flight (the backend holds them 500 ms).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let start = Instant::now();
    let r = get(&url).await.unwrap();
    let took = start.elapsed();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert!(
        r.text().contains("overloaded") && r.text().contains("max_in_flight"),
        "{}",
        r.text()
    );
    assert!(took < Duration::from_millis(200), "the 503 took {took:?}");
    assert_eq!(
        bs[0].requests(),
        2,
        "the refused request never reached the endpoint"
    );
    for s in slow {
        assert_eq!(s.await.unwrap().unwrap().status, StatusCode::OK);
    }
    // Capacity is back once they finished.
    assert_eq!(get(&url).await.unwrap().status, StatusCode::OK);
    let admin = proxy.admin_addr().unwrap();
    let metrics = send(
        &client(),
        Method::GET,
        &format!("http://{admin}/metrics"),
        &[],
        b"",
    )
    .await
    .unwrap()
    .text();
    assert!(
        metrics.contains("keel_overloaded_total{cluster=\"app\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("keel_requests_in_flight{cluster=\"app\"} 0"));
    eprintln!("max_in_flight = 2: third concurrent request answered 503 in {took:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_validated_and_changed_by_reload() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9\" }]\n";
    for (edit, key) in [
        ("max_connections = 0", "listener[0].max_connections"),
        ("max_header_bytes = 4096", "listener[0].max_header_bytes"),
        ("max_headers = 0", "listener[0].max_headers"),
        (
            "header_read_timeout = \"0s\"",
            "listener[0].header_read_timeout",
        ),
        ("idle_timeout = \"0s\"", "listener[0].idle_timeout"),
    ] {
        let text = base.replace(
            "cluster = \"app\"\n[[",
            &format!("cluster = \"app\"\n{edit}\n[["),
        );
        let e = ProxyConfig::from_toml_str(&text, "t.toml").unwrap_err();
        assert_eq!(e.key.as_deref(), Some(key), "{e}");
        assert_eq!(e.line, Some(4), "{e}");
    }
    let e =
        ProxyConfig::from_toml_str(&format!("{base}max_in_flight = 0\n"), "t.toml").unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].max_in_flight"), "{e}");

    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(base, "t.toml").unwrap())
        .await
        .unwrap();
    let changed = base.replace(
        "cluster = \"app\"\n[[",
        "cluster = \"app\"\nmax_connections = 5\n[[",
    );
    proxy
        .reload(ProxyConfig::from_toml_str(&changed, "t.toml").unwrap())
        .unwrap();
    assert_eq!(proxy.config().listeners[0].max_connections, 5);
    // The lower limit applies to the same listening socket: 5 connections are taken, a sixth
    // waits in the kernel's queue until one of them closes.
    let addr = proxy.listener_addrs()[0];
    async fn probe(s: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 16];
        tokio::time::timeout(Duration::from_millis(400), s.read(&mut buf))
            .await
            .is_ok_and(|r| r.is_ok_and(|n| n > 0))
    }
    let mut held = Vec::new();
    for _ in 0..5 {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(probe(&mut s).await, "served (502: no endpoint listens)");
        held.push(s);
    }
    let mut sixth = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(
        !probe(&mut sixth).await,
        "a sixth connection is not served while 5 are open"
    );
    drop(held);
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(
        Duration::from_secs(3),
        tokio::io::AsyncReadExt::read(&mut sixth, &mut buf),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(n > 0, "served once the others closed");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn max_amplification_bounds_tries_hedges_and_route_overrides() {
    let base = |cluster_extra: &str, route: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{route}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"127.0.0.1:9\" }}]\n{cluster_extra}\n"
        )
    };
    // 1 try + 1 hedge + 2 retries = 4.
    let hedged =
        "max_amplification = 4\n[cluster.retry]\nattempts = 2\n[cluster.hedge]\ndelay = \"10ms\"\n";
    let c = ProxyConfig::from_toml_str(&base(hedged, ""), "t.toml").unwrap();
    let a = c.clusters[0].amplification();
    assert_eq!(a.worst_case, 4);
    assert!((a.long_run - (1.0 + 0.20 + 0.05)).abs() < 1e-9, "{a:?}");
    let over = hedged.replace("max_amplification = 4", "max_amplification = 3");
    let e = ProxyConfig::from_toml_str(&base(&over, ""), "t.toml").unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].max_amplification"),
        "{e}"
    );
    assert_eq!(e.line, Some(8), "{e}");
    assert!(
        e.message
            .contains("4 upstream tries (1 + 1 hedge(s) + 2 retries)"),
        "{e}"
    );
    // A route's retry_attempts counts too, at the route's key.
    let route =
        "[[listener.route]]\npath_prefix = \"/api\"\ncluster = \"app\"\nretry_attempts = 5\n";
    let e = ProxyConfig::from_toml_str(&base(hedged, route), "t.toml").unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("listener[0].route[0].retry_attempts"),
        "{e}"
    );
    assert!(
        e.message
            .contains("cluster `app`: a request may cost 7 upstream tries"),
        "{e}"
    );
    let e = ProxyConfig::from_toml_str(&base("max_amplification = 0\n", ""), "t.toml").unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("cluster[0].max_amplification"),
        "{e}"
    );
}
