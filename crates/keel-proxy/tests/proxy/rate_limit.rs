//! Local rate limits on loopback: a cluster's bucket lets its burst through
//! and answers the rest `429` with `Retry-After`, over HTTP/1.1 and HTTP/2 alike; a route's
//! limit keyed by a header keeps one bucket per value and leaves requests without it alone;
//! a limit keyed by client IP; refusals counted in `/metrics` and in the access log; config
//! errors at their key and line.

use std::time::Duration;

use hyper::{Method, StatusCode};
use keel_proxy::ProxyConfig;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_limit_answers_429_with_retry_after_over_http1_and_http2() {
    let bs = backends(1, Duration::ZERO).await;
    let dir = std::env::temp_dir().join(format!("keel-rate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let mut config = simple_config(
        &[bs[0].addr()],
        "round-robin",
        "rate_limit = { rate = 0.25, burst = 3 }",
    );
    config.access_log = Some(
        ProxyConfig::from_toml_str(
            &format!(
                "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n[[cluster]]\nname = \"a\"\nendpoints = [{{ address = \"127.0.0.1:1\" }}]\n[access_log]\npath = \"{}\"\n",
                log.display()
            ),
            "log.toml",
        )
        .unwrap()
        .access_log
        .unwrap(),
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let url = format!("http://{addr}/x");
    let c = client();
    // The burst: 2 over HTTP/1.1, 1 over HTTP/2 (one bucket for both front ends).
    for _ in 0..2 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
    }
    let mut h2 = h2_connect(addr).await;
    let r = h2_send(&mut h2, Method::GET, &url, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    // Empty: 429 on both, with Retry-After (one request every 4 s: slow enough that a loaded
    // machine does not refill the bucket between the burst and these).
    let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("4"));
    assert!(r.text().contains("rate limit"), "{}", r.text());
    assert_eq!(r.header("x-keel-endpoint"), None, "no endpoint was tried");
    let r = h2_send(&mut h2, Method::GET, &url, &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("4"));
    // A gRPC call is answered as gRPC: HTTP 200, grpc-status 8 (RESOURCE_EXHAUSTED).
    let r = h2_send(
        &mut h2,
        Method::POST,
        &url,
        &[("content-type", "application/grpc"), ("te", "trailers")],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("8"));
    assert_eq!(r.header("retry-after"), Some("4"));
    assert_eq!(
        bs[0].requests(),
        3,
        "refused requests never reach the endpoint"
    );
    let admin = proxy.admin_addr().unwrap();
    assert_eq!(
        metric(admin, "keel_rate_limited_total{cluster=\"app\"}").await,
        Some(3.0)
    );
    // After Retry-After, one more goes through.
    tokio::time::sleep(Duration::from_millis(4100)).await;
    let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    proxy.shutdown(Duration::from_secs(1)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let limited: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("\"status\":429"))
        .collect();
    // The gRPC call's line has keel's status too.
    assert_eq!(limited.len(), 3, "{text}");
    assert!(
        limited[0].contains("rate limit exceeded: cluster app's rate_limit"),
        "{}",
        limited[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_limit_keyed_by_a_header_keeps_a_bucket_per_value() {
    let bs = backends(1, Duration::ZERO).await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[listener.route]]\npath_prefix = \"/api/\"\ncluster = \"app\"\nrate_limit = {{ rate = 0.1, burst = 2, key = \"header:x-user\" }}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let c = client();
    let status = |path: &'static str, user: Option<&'static str>| {
        let c = c.clone();
        let url = format!("http://{addr}{path}");
        async move {
            let headers: Vec<(&str, &str)> = user.map(|u| ("x-user", u)).into_iter().collect();
            send(&c, Method::GET, &url, &headers, b"")
                .await
                .unwrap()
                .status
                .as_u16()
        }
    };
    let mut alice = Vec::new();
    for _ in 0..4 {
        alice.push(status("/api/a", Some("alice")).await);
    }
    assert_eq!(alice, vec![200, 200, 429, 429]);
    assert_eq!(status("/api/a", Some("bob")).await, 200, "bob's own bucket");
    // Without the header the keyed limit does not apply; off the route neither.
    for _ in 0..5 {
        assert_eq!(status("/api/a", None).await, 200);
        assert_eq!(status("/other", Some("alice")).await, 200);
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_keyed_by_client_ip_per_worker() {
    let bs = backends(1, Duration::ZERO).await;
    let config = simple_config(
        &[bs[0].addr()],
        "round-robin",
        "rate_limit = { rate = 0.1, burst = 2, key = \"client-ip\", per_worker = true }",
    );
    // One worker: its share is the whole limit.
    let proxy = keel_proxy::start_with_workers(config, 1).await.unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(
            send(&c, Method::GET, &url, &[], b"")
                .await
                .unwrap()
                .status
                .as_u16(),
        );
    }
    assert_eq!(got, vec![200, 200, 429]);
    // Through a trusted proxy (simple_config trusts 127.0.0.1), the client is the address the
    // proxy added to X-Forwarded-For: each has its own bucket, whatever the client put first.
    for (xff, want) in [
        ("9.9.9.9, 192.0.2.1", vec![200, 200, 429]),
        ("8.8.8.8, 192.0.2.2", vec![200, 200, 429]),
    ] {
        let mut got = Vec::new();
        for _ in 0..3 {
            let r = send(&c, Method::GET, &url, &[("x-forwarded-for", xff)], b"").await;
            got.push(r.unwrap().status.as_u16());
        }
        assert_eq!(got, want, "{xff}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn rate_limit_errors_name_their_key_and_line() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n[[listener.route]]\ncluster = \"a\"\nrate_limit = { rate = 1, burst = 0 }\n[[cluster]]\nname = \"a\"\nendpoints = [{ address = \"127.0.0.1:1\" }]\n";
    let e = ProxyConfig::from_toml_str(base, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("t.toml:6:") && e.contains("listener[0].route[0].rate_limit.burst"),
        "{e}"
    );
    let bad_rate = format!("{base}rate_limit = {{ rate = 0 }}\n").replace("burst = 0", "burst = 1");
    let e = ProxyConfig::from_toml_str(&bad_rate, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("t.toml:10:") && e.contains("cluster[0].rate_limit.rate"),
        "{e}"
    );
    let bad_key = base.replace("burst = 0", "key = \"cookie\"");
    let e = ProxyConfig::from_toml_str(&bad_key, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown key `cookie`") && e.contains(":6:"),
        "{e}"
    );
}
