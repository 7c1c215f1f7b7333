//! The proxy over time: outlier ejection and return, active health checks, reload under load
//! (no request lost, endpoint state kept, bad files refused), graceful shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_model::FailureMode;
use keel_proxy::ProxyConfig;
use keel_testbed::loadgen::{self, LoadSpec, Target};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejection_removes_a_failing_endpoint_and_brings_it_back() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "[cluster.retry]\nattempts = 0\n[cluster.outlier_detection]\nconsecutive_failures = 3\nbase_ejection_time = \"400ms\"\nmax_ejection_percent = 50\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    // Round-robin: every third request meets b0; its third 503 in a row ejects it.
    for _ in 0..9 {
        send(&c, Method::GET, &url, &[], b"").await.unwrap();
    }
    let st = proxy.cluster_status("app").unwrap();
    assert!(st[0].ejected_until.is_some(), "b0 ejected: {st:?}");
    let seen = bs[0].requests();
    assert_eq!(seen, 3);
    for _ in 0..30 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(
            r.status,
            StatusCode::OK,
            "no request reaches the ejected endpoint"
        );
    }
    assert_eq!(bs[0].requests(), seen);

    fault(&bs[0], FailureMode::None).await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    for _ in 0..30 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
    }
    let back = bs[0].requests() - seen;
    assert!(
        (9..=11).contains(&back),
        "b0 back in rotation: {back} of 30"
    );
    let admin = proxy.admin_addr().unwrap();
    let m = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let line = format!(
        "keel_endpoint_ejections_total{{cluster=\"app\",endpoint=\"{}\"}} 1\n",
        addrs[0]
    );
    assert!(m.contains(&line), "{line} in\n{m}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ejections_never_exceed_the_cap_on_a_small_cluster() {
    // Two endpoints, both failing, 50%: at most one ejected (floor(2 x 0.5) = 1).
    let bs = backends(2, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    for b in &bs {
        fault(b, FailureMode::FAIL_AT_ONCE).await;
    }
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "[cluster.retry]\nattempts = 0\n[cluster.outlier_detection]\nconsecutive_failures = 2\nbase_ejection_time = \"10s\"\nmax_ejection_percent = 50\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..20 {
        send(&c, Method::GET, &url, &[], b"").await.unwrap();
    }
    let st = proxy.cluster_status("app").unwrap();
    let ejected = st.iter().filter(|s| s.ejected_until.is_some()).count();
    assert_eq!(ejected, 1, "{st:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_mark_an_endpoint_down_and_up() {
    let bs = backends(2, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "[cluster.retry]\nattempts = 0\n[cluster.health_check]\ninterval = \"40ms\"\ntimeout = \"100ms\"\nunhealthy_threshold = 2\nhealthy_threshold = 2\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    fault(&bs[0], FailureMode::Hang).await;
    let t = Instant::now();
    let down = eventually(Duration::from_secs(3), || {
        !proxy.cluster_status("app").unwrap()[0].healthy
    })
    .await;
    assert!(down, "a hanging /healthz marks b0 unhealthy");
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "two failed checks: {:?}",
        t.elapsed()
    );
    assert!(proxy.cluster_status("app").unwrap()[1].healthy);
    let c = client();
    for _ in 0..20 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.header("x-backend"), Some("b1"));
    }
    fault(&bs[0], FailureMode::None).await;
    let up = eventually(Duration::from_secs(3), || {
        proxy.cluster_status("app").unwrap()[0].healthy
    })
    .await;
    assert!(up, "b0 healthy again after two good checks");
    let before = bs[0].requests();
    for _ in 0..20 {
        assert_eq!(
            send(&c, Method::GET, &url, &[], b"").await.unwrap().status,
            StatusCode::OK
        );
    }
    assert_eq!(bs[0].requests() - before, 10, "back in round-robin");
    let admin = proxy.admin_addr().unwrap();
    let m = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    assert!(
        m.contains("keel_health_checks_failed_total{cluster=\"app\""),
        "{m}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

fn variant(addrs: &[std::net::SocketAddr], i: usize) -> ProxyConfig {
    // Alternate strategies and endpoint sets; every endpoint is healthy.
    match i % 3 {
        0 => simple_config(addrs, "least-connections", ""),
        1 => simple_config(
            &addrs[..4],
            "round-robin",
            "[cluster.retry]\nattempts = 2\n",
        ),
        _ => simple_config(&addrs[1..], "maglev", "hash_on = \"path\""),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_loses_no_request() {
    let bs = backends(5, Duration::from_millis(2)).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = Arc::new(keel_proxy::start(variant(&addrs, 0)).await.unwrap());
    let url = format!("http://{}/r", proxy.listener_addrs()[0]);
    let mut spec = LoadSpec::new(Target::Url(url), 3000);
    spec.concurrency = 16;
    spec.timeout = Duration::from_secs(3);
    let load = tokio::spawn(loadgen::run(spec));
    let reloader = {
        let proxy = proxy.clone();
        let addrs = addrs.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while n < 200 {
                tokio::time::sleep(Duration::from_millis(25)).await;
                n += 1;
                proxy.reload(variant(&addrs, n)).unwrap();
            }
        })
    };
    let report = load.await.unwrap();
    reloader.abort();
    let _ = reloader.await;
    println!("{report}");
    assert_eq!(report.requests, 3000);
    assert_eq!(report.succeeded, 3000, "{report}");
    let admin = proxy.admin_addr().unwrap();
    let status: serde_json::Value =
        serde_json::from_slice(&get(&format!("http://{admin}/status")).await.unwrap().body)
            .unwrap();
    assert!(status["reloads"].as_u64().unwrap() >= 5, "{status}");
    Arc::try_unwrap(proxy)
        .unwrap()
        .shutdown(Duration::from_secs(1))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_endpoint_state_and_refuses_bad_files() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    let od = "[cluster.retry]\nattempts = 0\n[cluster.outlier_detection]\nconsecutive_failures = 1\nbase_ejection_time = \"30s\"\nmax_ejection_percent = 50\n";
    let dir = std::env::temp_dir().join(format!("keel-proxy-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("proxy.toml");
    let text = |strategy: &str| {
        let eps: Vec<String> = addrs
            .iter()
            .map(|a| format!("{{ address = \"{a}\" }}"))
            .collect();
        format!(
            "[admin]\nlisten = \"127.0.0.1:0\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nstrategy = \"{strategy}\"\nendpoints = [{}]\n{od}",
            eps.join(", ")
        )
    };
    std::fs::write(&file, text("round-robin")).unwrap();
    let proxy = keel_proxy::start(ProxyConfig::from_file(&file).unwrap())
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..3 {
        send(&c, Method::GET, &url, &[], b"").await.unwrap();
    }
    let st = proxy.cluster_status("app").unwrap();
    assert!(st[0].ejected_until.is_some(), "{st:?}");
    let id = st[0].id;

    // A valid new file through the admin listener: new strategy, b0 still ejected.
    std::fs::write(&file, text("random")).unwrap();
    let admin = format!("http://{}/reload", proxy.admin_addr().unwrap());
    let r = send(&c, Method::POST, &admin, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(proxy.config().clusters[0].balance.strategy.name(), "random");
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(st[0].id, id, "same endpoint identity");
    assert!(
        st[0].ejected_until.is_some(),
        "ejection kept across the reload: {st:?}"
    );
    for _ in 0..20 {
        assert_eq!(
            send(&c, Method::GET, &url, &[], b"").await.unwrap().status,
            StatusCode::OK
        );
    }

    // An invalid file is refused and the old configuration keeps serving.
    std::fs::write(&file, text("fastest")).unwrap();
    let r = send(&c, Method::POST, &admin, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(
        r.text().contains("proxy.toml:8"),
        "names file and line: {}",
        r.text()
    );
    assert_eq!(proxy.config().clusters[0].balance.strategy.name(), "random");
    assert_eq!(
        send(&c, Method::GET, &url, &[], b"").await.unwrap().status,
        StatusCode::OK
    );

    // So is a file that moves a listener to an address that cannot be bound (in use): the
    // whole reload is refused, the old listener keeps serving.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let moved = text("random").replacen(
        "listen = \"127.0.0.1:0\"\ncluster",
        &format!("listen = \"{}\"\ncluster", taken.local_addr().unwrap()),
        1,
    );
    let err = proxy
        .reload(ProxyConfig::from_toml_str(&moved, "moved.toml").unwrap())
        .unwrap_err();
    assert!(format!("{err:#}").contains("cannot listen on"), "{err:#}");
    assert_eq!(
        proxy.listener_addrs(),
        vec![url[7..url.len() - 1].parse().unwrap()]
    );
    assert_eq!(
        send(&c, Method::GET, &url, &[], b"").await.unwrap().status,
        StatusCode::OK
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_requests_in_flight_and_stops_accepting() {
    let bs = backends(2, Duration::from_millis(300)).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let url = format!("http://{addr}/");
    let mut in_flight = Vec::new();
    for _ in 0..8 {
        let url = url.clone();
        in_flight.push(tokio::spawn(async move { get(&url).await }));
    }
    // In flight: every request reached a backend (each takes 300 ms there). On a loaded
    // machine a fixed sleep may end before the proxy has even read them.
    let waited = Instant::now();
    while bs.iter().map(|b| b.requests()).sum::<u64>() < 8 {
        assert!(
            waited.elapsed() < Duration::from_secs(5),
            "requests never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = Instant::now();
    proxy.shutdown(Duration::from_secs(3)).await;
    let took = t.elapsed();
    for h in in_flight {
        let r = h.await.unwrap().expect("request in flight completes");
        assert_eq!(r.status, StatusCode::OK);
    }
    assert!(
        took < Duration::from_secs(2),
        "drained as soon as done: {took:?}"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cuts_requests_still_running_at_the_drain_timeout() {
    let bs = backends(1, Duration::ZERO).await;
    fault(&bs[0], FailureMode::Hang).await;
    let proxy = keel_proxy::start(simple_config(
        &[bs[0].addr()],
        "round-robin",
        "request_timeout = \"30s\"",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let pending = tokio::spawn(async move { get(&url).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    proxy.shutdown(Duration::from_millis(200)).await;
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(pending.await.unwrap().is_err(), "the hung request was cut");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_threshold_and_slow_start_come_from_the_cluster_config() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let hc = "[cluster.retry]\nattempts = 0\n[cluster.health_check]\ninterval = \"30ms\"\ntimeout = \"100ms\"\nunhealthy_threshold = 1\nhealthy_threshold = 1\n[cluster.slow_start]\nwindow = \"20s\"\n";
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    fault(&bs[1], FailureMode::FAIL_AT_ONCE).await;
    for (threshold, expect_panic) in [(50, true), (0, false)] {
        let proxy = keel_proxy::start(simple_config(
            &addrs,
            "round-robin",
            &format!("panic_threshold = {threshold}\n{hc}"),
        ))
        .await
        .unwrap();
        let down = eventually(Duration::from_secs(3), || {
            let st = proxy.cluster_status("app").unwrap();
            !st[0].healthy && !st[1].healthy
        })
        .await;
        assert!(down);
        let url = format!("http://{}/", proxy.listener_addrs()[0]);
        let c = client();
        let mut ok = 0;
        for _ in 0..30 {
            if send(&c, Method::GET, &url, &[], b"").await.unwrap().status == StatusCode::OK {
                ok += 1;
            }
        }
        if expect_panic {
            // 1 of 3 available < 50%: health is ignored and round-robin covers all three.
            assert_eq!(ok, 10, "panic mode spreads over every endpoint");
        } else {
            assert_eq!(ok, 30, "threshold 0: only the healthy endpoint serves");
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }

    // Slow start: an endpoint back from a failed health check ramps up its weight.
    let proxy = keel_proxy::start(simple_config(&addrs, "weighted-random", hc))
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(3), || !proxy
            .cluster_status("app")
            .unwrap()[0]
            .healthy)
        .await
    );
    fault(&bs[0], FailureMode::None).await;
    assert!(
        eventually(Duration::from_secs(3), || proxy
            .cluster_status("app")
            .unwrap()[0]
            .healthy)
        .await
    );
    let st = proxy.cluster_status("app").unwrap();
    assert!(
        st[0].effective_weight < 0.5 && st[2].effective_weight == 1.0,
        "b0 ramps up, b2 at full weight: {st:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
