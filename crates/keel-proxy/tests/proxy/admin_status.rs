//! `/status`'s last minute: request rate, error rate and p50/p99 latency per
//! cluster and per endpoint, with their per-second series, from real traffic on loopback; and
//! the admin page that draws them.

use std::time::{Duration, Instant};

use keel_model::vocab::FailureMode;

use crate::support::*;

async fn status(admin: std::net::SocketAddr) -> serde_json::Value {
    let text = get(&format!("http://{admin}/status")).await.unwrap().text();
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_last_minute_per_cluster_and_endpoint() {
    // b0 answers in 60 ms (inside the histogram bucket (50, 100] ms, with room for a slow machine); b1 fails at once with 503 (no retry: the client sees it).
    let bs = backends(2, Duration::from_millis(60)).await;
    fault(
        &bs[1],
        FailureMode::FailFast {
            after: Duration::ZERO,
        },
    )
    .await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "outlier_detection = false\n[cluster.retry]\nattempts = 0\n",
    ))
    .await
    .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let started = Instant::now();
    let mut statuses = [0u32; 2];
    for _ in 0..40 {
        let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
        statuses[usize::from(r.status != 200)] += 1;
    }
    assert_eq!(statuses, [20, 20], "round-robin over one good, one failing");
    let sent_for = started.elapsed().as_secs_f64();

    // Sampled once a second: within ~2 s every request is in the window.
    let deadline = Instant::now() + Duration::from_secs(5);
    let st = loop {
        let st = status(admin).await;
        if st["clusters"][0]["last_minute"]["requests"] == 40 || Instant::now() > deadline {
            break st;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cluster = &st["clusters"][0];
    let m = &cluster["last_minute"];
    assert_eq!(m["requests"], 40, "{m}");
    assert_eq!(m["error_rate"], 0.5, "{m}");
    let window = m["window_s"].as_f64().unwrap();
    assert!(window >= sent_for * 0.9 && window <= 60.0, "{m}");
    let rate = m["rate_per_s"].as_f64().unwrap();
    assert!((rate - 40.0 / window).abs() < 0.01, "{m}");
    // Half the answers took >= 60 ms (the histogram bucket (50, 100] ms), half were at once.
    let p99 = m["p99_ms"].as_f64().unwrap();
    assert!((50.0..=100.0).contains(&p99), "{m}");
    let p50 = m["p50_ms"].as_f64().unwrap();
    assert!(p50 <= 50.0, "{m}");
    // One point per sampled second, at most a minute of them; the requests are in them.
    let series = m["series"]["rate_per_s"].as_array().unwrap();
    assert!(!series.is_empty() && series.len() <= 60, "{m}");
    let summed: f64 = series.iter().map(|v| v.as_f64().unwrap()).sum();
    assert!(summed > 0.0, "{m}");

    let endpoint = |addr: std::net::SocketAddr| {
        cluster["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["address"] == addr.to_string())
            .unwrap()["last_minute"]
            .clone()
    };
    let good = endpoint(addrs[0]);
    assert_eq!(good["requests"], 20, "{good}");
    assert_eq!(good["error_rate"], 0.0, "{good}");
    for q in ["p50_ms", "p99_ms"] {
        let v = good[q].as_f64().unwrap();
        assert!((50.0..=100.0).contains(&v), "{q}: {good}");
    }
    let bad = endpoint(addrs[1]);
    assert_eq!(bad["requests"], 20, "{bad}");
    assert_eq!(bad["error_rate"], 1.0, "{bad}");
    assert!(bad["p99_ms"].as_f64().unwrap() <= 50.0, "{bad}");

    // The page is one self-contained document drawing those figures as inline SVG.
    let page = get(&format!("http://{admin}/")).await.unwrap();
    assert_eq!(page.status, 200);
    let html = page.text();
    for needle in [
        "<svg class='spark'",
        "last_minute",
        "Listeners",
        "discovery",
    ] {
        assert!(html.contains(needle), "no {needle} in the page");
    }
    for external in ["src=\"http", "href=\"http", "<link", "@import"] {
        assert!(!html.contains(external), "the page loads {external}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}
