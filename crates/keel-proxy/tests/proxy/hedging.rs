//! Hedged requests through the proxy (`[cluster.hedge]`): a slow first try gets a second try
//! on another endpoint after the delay, the first good answer wins, the loser is cancelled (not
//! held against its endpoint); only idempotent requests are hedged, within the budget.

use std::time::{Duration, Instant};

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_model::vocab::Latency;
use keel_testbed::backend::{self, BackendConfig};

/// Two endpoints, one answering in 250 ms and one at once; round-robin, hedge after 20 ms.
async fn setup(budget_percent: f64) -> (keel_proxy::ProxyHandle, Vec<backend::BackendHandle>) {
    let mut bs = Vec::new();
    for (name, latency) in [("slow", 250), ("fast", 0)] {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(latency)),
            name: name.into(),
            ..BackendConfig::default()
        };
        bs.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let extra = format!("[cluster.hedge]\ndelay = \"20ms\"\nbudget_percent = {budget_percent}\n");
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", &extra))
        .await
        .unwrap();
    (proxy, bs)
}

fn counter(metrics: &str, name: &str) -> u64 {
    let key = format!("{name}{{cluster=\"app\"}} ");
    let at = metrics
        .find(&key)
        .unwrap_or_else(|| panic!("{key} missing"))
        + key.len();
    metrics[at..]
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Twenty GETs through a round-robin cluster of a slow endpoint (250 ms) and a fast one,
/// hedged after 20 ms: round-robin sends first tries to the slow endpoint (every other one at
/// least; the hedge's pick advances the round too, so here every one), each is hedged and the
/// fast endpoint's answer wins, long before the slow one's. The losers were cancelled, not
/// failed: no endpoint has a failure. Returns the hedges sent.
async fn the_hedges_win_twenty_gets(
    proxy: &keel_proxy::ProxyHandle,
    c: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
) -> u64 {
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let mut slowest = Duration::ZERO;
    let mut by = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..20 {
        let t = Instant::now();
        let r = send(c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        slowest = slowest.max(t.elapsed());
        *by.entry(r.header("x-backend").unwrap().to_string())
            .or_default() += 1;
    }
    assert_eq!(by.get("fast"), Some(&20), "{by:?}");
    assert!(slowest < Duration::from_millis(200), "{slowest:?}");
    let admin = proxy.admin_addr().unwrap();
    let metrics = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let hedges = counter(&metrics, "keel_hedges_total");
    assert!((10..=20).contains(&hedges), "{hedges} hedges");
    assert_eq!(counter(&metrics, "keel_hedges_won_total"), hedges);
    let status = proxy.cluster_status("app").unwrap();
    assert!(status.iter().all(|e| e.failures == 0), "{status:?}");
    hedges
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_try_is_hedged_and_the_fast_answer_wins() {
    let (proxy, bs) = setup(100.0).await;
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let hedges = the_hedges_win_twenty_gets(&proxy, &c).await;
    let admin = proxy.admin_addr().unwrap();

    // A POST is never hedged: when it goes to the slow endpoint it takes its 250 ms.
    let mut took = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        let r = send(&c, Method::POST, &url, &[], b"x").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        took.push(t.elapsed());
    }
    assert!(
        took.iter().any(|t| *t >= Duration::from_millis(240)),
        "{took:?}"
    );
    let metrics = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    assert_eq!(counter(&metrics, "keel_hedges_total"), hedges);
    proxy.shutdown(Duration::from_secs(1)).await;
    for b in bs {
        b.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedges_stay_within_the_budget() {
    // 10 % of 40 requests: at most 4 hedges, whatever the delay says.
    let (proxy, bs) = setup(10.0).await;
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..40 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
    }
    let admin = proxy.admin_addr().unwrap();
    let metrics = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let hedges = counter(&metrics, "keel_hedges_total");
    assert!(
        (1..=4).contains(&hedges),
        "{hedges} hedges for 40 requests at 10 %"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    for b in bs {
        b.shutdown().await;
    }
}

/// An h2c endpoint (HTTP/2 with prior knowledge) that answers `x-backend: NAME` after `delay`.
async fn h2c_endpoint(name: &'static str, delay: Duration) -> std::net::SocketAddr {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |_req: hyper::Request<hyper::body::Incoming>| async move {
                        tokio::time::sleep(delay).await;
                        let r = hyper::Response::builder()
                            .header("x-backend", name)
                            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"ok")))
                            .unwrap();
                        Ok::<_, std::convert::Infallible>(r)
                    },
                );
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_cluster_is_hedged_too() {
    let slow = h2c_endpoint("slow", Duration::from_millis(250)).await;
    let fast = h2c_endpoint("fast", Duration::ZERO).await;
    let extra = "protocol = \"h2c\"\n[cluster.hedge]\ndelay = \"20ms\"\nbudget_percent = 100.0\n";
    let proxy = keel_proxy::start(simple_config(&[slow, fast], "round-robin", extra))
        .await
        .unwrap();
    let c = client();
    // As over HTTP/1.1.
    the_hedges_win_twenty_gets(&proxy, &c).await;
    proxy.shutdown(Duration::from_secs(1)).await;
}
