//! The proxy on loopback: routing by strategy, the status of each fault, header handling,
//! retries and the retry budget, the admin listener.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_balance::StrategyKind;
use keel_model::FailureMode;

/// Sequential GETs; returns the count of answers per `x-backend` and per status.
async fn tally(url: &str, n: usize, headers: &[(&str, &str)]) -> BTreeMap<String, usize> {
    let c = client();
    let mut by = BTreeMap::new();
    for _ in 0..n {
        let r = send(&c, Method::GET, url, headers, b"").await.unwrap();
        let key = if r.status == StatusCode::OK {
            r.header("x-backend").unwrap_or("-").to_string()
        } else {
            format!("status {}", r.status.as_u16())
        };
        *by.entry(key).or_default() += 1;
    }
    by
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_strategy_routes_to_every_endpoint() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    for s in StrategyKind::ALL {
        let proxy = keel_proxy::start(simple_config(&addrs, s.name(), ""))
            .await
            .unwrap();
        let url = format!("http://{}/", proxy.listener_addrs()[0]);
        // Hash strategies without hash_on use a random key per request, so they spread too.
        let by = tally(&url, 60, &[]).await;
        assert_eq!(by.values().sum::<usize>(), 60, "{s}: {by:?}");
        assert!(
            by.keys().all(|k| k.starts_with('b')),
            "{s}: every answer is a 200 from a backend: {by:?}"
        );
        // Prequal goes by the backends' reports: idle backends that answer at once differ by
        // microseconds of reported latency, and one of them may take every call.
        if s != StrategyKind::Prequal {
            assert!(by.len() >= 2, "{s}: picks spread: {by:?}");
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_is_exactly_even_and_weighted_round_robin_follows_weights() {
    let bs = backends(4, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let by = tally(&url, 200, &[]).await;
    assert_eq!(by.len(), 4, "{by:?}");
    assert!(by.values().all(|n| *n == 50), "{by:?}");
    proxy.shutdown(Duration::from_secs(1)).await;

    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"w\"\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"w\"\nstrategy = \"weighted-round-robin\"\nendpoints = [{{ address = \"{}\", weight = 3 }}, {{ address = \"{}\" }}]\n",
        addrs[0], addrs[1]
    );
    let proxy = keel_proxy::start(keel_proxy::ProxyConfig::from_toml_str(&text, "w.toml").unwrap())
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let by = tally(&url, 100, &[]).await;
    assert_eq!(by.get("b0"), Some(&75), "{by:?}");
    assert_eq!(by.get("b1"), Some(&25), "{by:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_key_from_a_header_is_sticky() {
    let bs = backends(5, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    for strategy in ["ring-hash", "maglev", "rendezvous"] {
        let proxy = keel_proxy::start(simple_config(
            &addrs,
            strategy,
            "hash_on = \"header:x-user\"",
        ))
        .await
        .unwrap();
        let url = format!("http://{}/", proxy.listener_addrs()[0]);
        let mut owners = BTreeMap::new();
        for user in 0..20 {
            let u = format!("user-{user}");
            let by = tally(&url, 10, &[("x-user", &u)]).await;
            assert_eq!(
                by.len(),
                1,
                "{strategy}: user {u} always lands on one backend: {by:?}"
            );
            owners.insert(u, by.into_keys().next().unwrap());
        }
        let distinct: std::collections::BTreeSet<_> = owners.values().collect();
        assert!(
            distinct.len() >= 3,
            "{strategy}: 20 users spread: {owners:?}"
        );
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

/// One endpoint, no retries, short timeouts: what a client sees for each fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_fault_gives_its_documented_status() {
    let bs = backends(1, Duration::from_millis(5)).await;
    let b = &bs[0];
    let proxy = keel_proxy::start(simple_config(
        &[b.addr()],
        "round-robin",
        "request_timeout = \"200ms\"\nconnect_timeout = \"100ms\"\n[cluster.retry]\nattempts = 0\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/x", proxy.listener_addrs()[0]);

    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.header("x-keel-endpoint"),
        Some(b.addr().to_string().as_str())
    );

    fault(b, FailureMode::Refuse).await;
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(r.text().contains("cannot connect"), "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/plain; charset=utf-8"));

    fault(b, FailureMode::Hang).await;
    let t = std::time::Instant::now();
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.text());
    assert!(
        r.text().contains("did not answer within 200ms"),
        "{}",
        r.text()
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());

    fault(b, FailureMode::FAIL_AT_ONCE).await;
    let r = get(&url).await.unwrap();
    assert_eq!(
        r.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the endpoint's own 503 passes"
    );
    assert_eq!(r.header("x-backend"), Some("b0"));

    fault(b, FailureMode::Reset).await;
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(
        r.text().contains("middle of the response body"),
        "{}",
        r.text()
    );

    // 5 ms x 100 = 500 ms, past the 200 ms request timeout.
    fault(b, FailureMode::Slow { factor: 100.0 }).await;
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.text());
    // 5 ms x 4 = 20 ms: slow but in time.
    fault(b, FailureMode::Slow { factor: 4.0 }).await;
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);

    fault(b, FailureMode::None).await;
    assert_eq!(get(&url).await.unwrap().status, StatusCode::OK);
    proxy.shutdown(Duration::from_secs(1)).await;

    let (garbage, task) = garbage_server().await;
    let proxy = keel_proxy::start(simple_config(
        &[garbage],
        "round-robin",
        "[cluster.retry]\nattempts = 0\n",
    ))
    .await
    .unwrap();
    let r = get(&format!("http://{}/", proxy.listener_addrs()[0]))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.text());
    assert!(r.text().contains("invalid response"), "{}", r.text());
    proxy.shutdown(Duration::from_secs(1)).await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_available_endpoint_is_503() {
    let bs = backends(1, Duration::ZERO).await;
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    let proxy = keel_proxy::start(simple_config(
        &[bs[0].addr()],
        "round-robin",
        "panic_threshold = 0\n[cluster.health_check]\ninterval = \"30ms\"\ntimeout = \"100ms\"\nunhealthy_threshold = 1\n",
    ))
    .await
    .unwrap();
    let down = eventually(Duration::from_secs(3), || {
        !proxy.cluster_status("app").unwrap()[0].healthy
    })
    .await;
    assert!(down, "the health check marks the only endpoint down");
    let r = get(&format!("http://{}/", proxy.listener_addrs()[0]))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        r.text().contains("no endpoint available in cluster `app`"),
        "{}",
        r.text()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_that_breaks_mid_stream_aborts_the_client_response() {
    let cfg = keel_testbed::backend::BackendConfig {
        body_bytes: 200_000,
        ..Default::default()
    };
    let b = keel_testbed::backend::spawn(any_port(), cfg).await.unwrap();
    let proxy = keel_proxy::start(simple_config(
        &[b.addr()],
        "round-robin",
        "[cluster.retry]\nattempts = 0\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    // Streamed whole, and its end recorded as the endpoint's success.
    let r = get(&url).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.len(), 200_000);
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(
        (st[0].successes, st[0].failures, st[0].in_flight),
        (1, 0, 0)
    );
    let r = send(&client(), Method::HEAD, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.body.is_empty());

    fault(&b, FailureMode::Reset).await;
    let r = get(&url).await;
    // 200 KB is above max_buffered_response: the headers went out, then the body broke, and the
    // client must see a broken body, never a short one that looks complete.
    let err = r.expect_err("a truncated body must not look complete");
    assert!(err.contains("body"), "{err}");
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(
        st[0].failures, 1,
        "the break counts as the endpoint's failure"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_forwarded_as_a_proxy_should() {
    let (echo, task) = echo_server().await;
    let proxy = keel_proxy::start(simple_config(&[echo], "round-robin", ""))
        .await
        .unwrap();
    let url = format!("http://{}/path?q=1", proxy.listener_addrs()[0]);
    let c = client();
    let r = send(
        &c,
        Method::GET,
        &url,
        &[
            ("host", "app.example"),
            ("x-forwarded-for", "10.0.0.1"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic eA=="),
            ("x-keep", "yes"),
        ],
        b"",
    )
    .await
    .unwrap();
    let text = r.text();
    assert_eq!(r.status, StatusCode::OK, "{text}");
    assert!(text.contains("host: app.example\n"), "Host kept: {text}");
    assert!(
        text.contains("x-forwarded-for: 10.0.0.1, 127.0.0.1\n"),
        "{text}"
    );
    assert!(text.contains("x-forwarded-proto: http\n"), "{text}");
    assert!(text.contains("x-forwarded-host: app.example\n"), "{text}");
    assert!(text.contains("x-keep: yes\n"), "{text}");
    for gone in ["x-hop:", "te:", "proxy-authorization:"] {
        assert!(
            !text.contains(&format!("\n{gone}")),
            "{gone} removed: {text}"
        );
    }
    assert!(
        r.header("keep-alive").is_none(),
        "response hop-by-hop removed"
    );
    assert!(
        r.header("x-secret").is_none(),
        "header named by Connection removed"
    );
    assert_eq!(r.header("x-backend"), Some("echo"));

    let r = send(&c, Method::POST, &url, &[], b"0123456789")
        .await
        .unwrap();
    assert!(
        r.text().contains("method: POST\nbody-length: 10\n"),
        "{}",
        r.text()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_is_retried_only_when_its_request_never_left() {
    let (echo, task) = echo_server().await;
    let bs = backends(1, Duration::ZERO).await;
    fault(&bs[0], FailureMode::Refuse).await;
    // Round-robin starts at the refused endpoint half of the time; every POST must arrive
    // whole, through a retry with the body kept.
    let proxy = keel_proxy::start(simple_config(
        &[bs[0].addr(), echo],
        "round-robin",
        "[cluster.retry]\nattempts = 1\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    for _ in 0..6 {
        let r = send(&c, Method::POST, &url, &[], b"payload").await.unwrap();
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert!(r.text().contains("body-length: 7"), "{}", r.text());
    }
    proxy.shutdown(Duration::from_secs(1)).await;

    // An endpoint that answers 503 may have acted on a POST: no retry, the 503 passes.
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    let proxy = keel_proxy::start(simple_config(
        &[bs[0].addr(), echo],
        "round-robin",
        "[cluster.retry]\nattempts = 1\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let mut statuses = BTreeMap::new();
    for _ in 0..6 {
        let r = send(&c, Method::POST, &url, &[], b"payload").await.unwrap();
        *statuses.entry(r.status.as_u16()).or_insert(0) += 1;
    }
    assert_eq!(statuses.get(&503), Some(&3), "{statuses:?}");
    assert_eq!(statuses.get(&200), Some(&3), "{statuses:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_go_to_another_endpoint() {
    // Two of three endpoints fail; with two retries and the tried ones avoided, every request
    // reaches the good one.
    let bs = backends(3, Duration::ZERO).await;
    fault(&bs[0], FailureMode::FAIL_AT_ONCE).await;
    fault(&bs[1], FailureMode::Refuse).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "random",
        "[cluster.retry]\nattempts = 2\nbudget_percent = 200\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let by = tally(&url, 100, &[]).await;
    assert_eq!(by.get("b2"), Some(&100), "{by:?}");
    let errors_seen = bs[0].requests();
    assert!(
        errors_seen > 10,
        "the 503 endpoint was tried ({errors_seen})"
    );
    assert!(
        errors_seen < 100,
        "and never twice for one request ({errors_seen})"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_at_the_budget() {
    let bs = backends(2, Duration::ZERO).await;
    for b in &bs {
        fault(b, FailureMode::FAIL_AT_ONCE).await;
    }
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "[cluster.retry]\nattempts = 1\nbudget_percent = 10\nmin_retries_per_second = 0\n",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let n = 200;
    let by = tally(&url, n, &[]).await;
    assert_eq!(by.get("status 503"), Some(&n), "{by:?}");
    let calls = bs[0].requests() + bs[1].requests();
    let retries = calls - n as u64;
    // 10% of the requests in the window: 20 retries, give or take the rounding at each step.
    assert!((18..=20).contains(&retries), "retries {retries}");
    let admin = proxy.admin_addr().unwrap();
    let status: serde_json::Value =
        serde_json::from_slice(&get(&format!("http://{admin}/status")).await.unwrap().body)
            .unwrap();
    let c = &status["clusters"][0];
    assert_eq!(c["retries"].as_u64(), Some(retries));
    assert_eq!(
        c["retry_budget_refusals"].as_u64(),
        Some(n as u64 - retries)
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_serves_metrics_status_and_page() {
    let bs = backends(2, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "least-request", ""))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    tally(&url, 10, &[]).await;
    let admin = proxy.admin_addr().unwrap();

    let m = get(&format!("http://{admin}/metrics")).await.unwrap();
    assert_eq!(m.status, StatusCode::OK);
    let text = m.text();
    assert!(
        text.contains("keel_requests_total{cluster=\"app\",class=\"2xx\"} 10\n"),
        "{text}"
    );
    assert!(
        text.contains("keel_request_duration_seconds_count{cluster=\"app\"} 10\n"),
        "{text}"
    );
    let per_endpoint: u64 = text
        .lines()
        .filter(|l| l.starts_with("keel_upstream_responses_total") && l.contains("class=\"2xx\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(per_endpoint, 10, "{text}");
    for name in [
        "keel_requests_in_flight",
        "keel_retries_total",
        "keel_retry_budget_refusals_total",
        "keel_endpoint_ejections_total",
        "keel_endpoint_healthy",
        "keel_upstream_duration_seconds_bucket",
    ] {
        assert!(text.contains(&format!("\n{name}")), "{name} missing");
    }

    let s = get(&format!("http://{admin}/status")).await.unwrap();
    let status: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
    let c = &status["clusters"][0];
    assert_eq!(c["name"], "app");
    assert_eq!(c["strategy"], "least-request");
    assert_eq!(c["endpoints"].as_array().unwrap().len(), 2);
    assert_eq!(c["endpoints"][0]["healthy"], true);
    let successes: u64 = (0..2)
        .map(|i| c["endpoints"][i]["successes"].as_u64().unwrap())
        .sum();
    assert_eq!(successes, 10);

    let page = get(&format!("http://{admin}/")).await.unwrap();
    assert!(
        page.text().contains("fetch(\"/status\""),
        "the page refreshes itself"
    );
    let r = send(
        &client(),
        Method::POST,
        &format!("http://{admin}/reload"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, StatusCode::CONFLICT, "no file to reload from");
    assert_eq!(
        get(&format!("http://{admin}/nope")).await.unwrap().status,
        StatusCode::NOT_FOUND
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served_over_http1_upstreams() {
    let (echo, task) = echo_server().await;
    let proxy = keel_proxy::start(simple_config(&[echo], "round-robin", ""))
        .await
        .unwrap();
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let addr = proxy.listener_addrs()[0];
    let r = send(&h2, Method::POST, &format!("http://{addr}/h2"), &[], b"abc")
        .await
        .unwrap();
    let text = r.text();
    assert_eq!(r.status, StatusCode::OK, "{text}");
    assert!(text.contains("method: POST\nbody-length: 3\n"), "{text}");
    assert!(
        text.contains(&format!("host: {addr}\n")),
        "Host from :authority: {text}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    task.abort();
}

/// By default a listener trusts no client's `X-Forwarded-For` (it is replaced, so a client
/// cannot pass itself off as another) and keel's own answers name no address and no system
/// error (the full cause goes to the log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_forwarded_for_is_replaced_and_errors_are_brief() {
    let (echo, task) = echo_server().await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"echo\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"dead\"\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"echo\"\nendpoints = [{{ address = \"{echo}\" }}]\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"dead\"\nendpoints = [{{ address = \"{dead}\" }}]\n"
    );
    let proxy = keel_proxy::start(keel_proxy::ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let c = client();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let r = send(
        &c,
        Method::GET,
        &url,
        &[("x-forwarded-for", "10.9.9.9")],
        b"",
    )
    .await
    .unwrap();
    let seen = r.text();
    assert!(seen.contains("x-forwarded-for: 127.0.0.1\n"), "{seen}");
    assert!(
        !seen.contains("10.9.9.9"),
        "the client's claim is dropped: {seen}"
    );

    let url = format!("http://{}/", proxy.listener_addrs()[1]);
    let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.text(), "502 Bad Gateway: cannot connect to an endpoint\n");
    proxy.shutdown(Duration::from_secs(1)).await;
    task.abort();
}
