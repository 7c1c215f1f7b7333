//! Endpoint priorities and zone-aware routing through the proxy (keel-balance's layer, read
//! from `priority`, `zone`, the top-level `zone` and `[cluster.zone_routing]`).

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use keel_model::vocab::{FailureMode, Latency};
use keel_proxy::ProxyConfig;
use keel_testbed::backend::{self, BackendConfig, BackendHandle};

async fn backends(specs: &[(&str, u64)]) -> Vec<BackendHandle> {
    let mut bs = Vec::new();
    for (name, ms) in specs {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(*ms)),
            name: (*name).into(),
            ..BackendConfig::default()
        };
        bs.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    bs
}

fn config(top: &str, endpoints: &[(SocketAddr, &str)], cluster: &str) -> ProxyConfig {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|(a, extra)| format!("{{ address = \"{a}\"{extra} }}"))
        .collect();
    let text = format!(
        "{top}\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\nendpoints = [{}]\n{cluster}\n",
        eps.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "zones.toml").unwrap_or_else(|e| panic!("{e}\n{text}"))
}

async fn who(c: &Client<HttpConnector, Full<Bytes>>, url: &str) -> String {
    let r = send(c, Method::GET, url, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    r.header("x-backend").unwrap().to_string()
}

/// The proxy in zone a, one endpoint in a and two in b, threshold 1 call in flight per unit of
/// weight: one call at a time all stay in a (round-robin alone would send 2/3 to b); with a's
/// endpoint busy (a 300 ms call in flight), the next calls spill to b.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_stay_in_the_proxys_zone_until_it_is_loaded() {
    let bs = backends(&[("a", 300), ("b-1", 1), ("b-2", 1)]).await;
    let eps = [
        (bs[0].addr(), ", zone = \"a\""),
        (bs[1].addr(), ", zone = \"b\""),
        (bs[2].addr(), ", zone = \"b\""),
    ];
    let proxy = keel_proxy::start(config(
        "zone = \"a\"",
        &eps,
        "zone_routing = { threshold = 1 }",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..6 {
        assert_eq!(who(&c, &url).await, "a");
    }
    // Four at once: the first holds a's endpoint for 300 ms, the other three go to b.
    let calls: Vec<_> = (0..4)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50 * i)).await;
                who(&c, &url).await
            })
        })
        .collect();
    let mut got = Vec::new();
    for call in calls {
        got.push(call.await.unwrap());
    }
    assert_eq!(got[0], "a", "{got:?}");
    assert!(got[1..].iter().all(|w| w.starts_with("b-")), "{got:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Priority 0 takes everything while it is healthy; when its only endpoint fails its health
/// checks, priority 1 takes over (Envoy's overprovisioning: health 0 leaves 100 % to the next
/// level), with no failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_priority_level_takes_over_when_the_first_is_down() {
    let bs = backends(&[("primary", 1), ("backup", 1)]).await;
    let eps = [(bs[0].addr(), ""), (bs[1].addr(), ", priority = 1")];
    let proxy = keel_proxy::start(config(
        "",
        &eps,
        "panic_threshold = 0\n[cluster.health_check]\ninterval = \"100ms\"\ntimeout = \"100ms\"\nunhealthy_threshold = 1\nhealthy_threshold = 1",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..10 {
        assert_eq!(who(&c, &url).await, "primary");
    }
    bs[0].set_fault(FailureMode::FAIL_AT_ONCE);
    // Health checks every 100 ms, one failure marks it down: wait for two checks after the
    // fault (bounded), then a little for the verdict to land.
    let checks = bs[0].healthz_requests();
    let down = std::time::Instant::now();
    while bs[0].healthz_requests() < checks + 2 && down.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..10 {
        assert_eq!(who(&c, &url).await, "backup");
    }
    bs[0].set_fault(FailureMode::None);
    let up = std::time::Instant::now();
    let mut back = false;
    while !back && up.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        back = who(&c, &url).await == "primary";
    }
    assert!(back, "priority 0 takes traffic again once healthy");
    proxy.shutdown(Duration::from_secs(1)).await;
}
