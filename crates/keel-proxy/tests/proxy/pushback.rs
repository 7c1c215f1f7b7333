//! An endpoint's `Retry-After` is about that endpoint: it is passed over for that long and the
//! retry goes to another endpoint at once; no request waits for it while another endpoint may
//! answer; a huge or malformed value neither turns retries off nor keeps anyone waiting; the
//! pushing endpoint's failures still eject it. Real backends on loopback.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, StatusCode};

/// A backend that answers `503` with `Retry-After: retry_after` to the requests whose number
/// (from 1) `fails` says, `200` to the others, each after `delay`; it counts what it got.
async fn pushing_backend(
    retry_after: &'static str,
    fails: fn(u64) -> bool,
    delay: Duration,
) -> (SocketAddr, Arc<AtomicU64>) {
    backend_answering(503, retry_after, fails, delay).await
}

/// [`pushing_backend`] answering `status` instead of `503`.
async fn backend_answering(
    status: u16,
    retry_after: &'static str,
    fails: fn(u64) -> bool,
    delay: Duration,
) -> (SocketAddr, Arc<AtomicU64>) {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: hyper::Request<hyper::body::Incoming>| {
                    let n = seen.fetch_add(1, Relaxed) + 1;
                    async move {
                        tokio::time::sleep(delay).await;
                        let b = hyper::Response::builder();
                        let resp = if fails(n) {
                            b.status(status).header("retry-after", retry_after)
                        } else {
                            b.status(200)
                        };
                        Ok::<_, std::convert::Infallible>(
                            resp.body(Full::new(Bytes::from_static(b"pushing")))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, count)
}

/// GETs `/` `n` times one after the other; each answer's status, endpoint and time taken.
async fn sequential(addr: SocketAddr, n: usize) -> Vec<(StatusCode, String, Duration)> {
    let c = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let g = send(&c, Method::GET, &format!("http://{addr}/"), &[], b"")
            .await
            .expect("answered within 5 s");
        let ep = g.header("x-keel-endpoint").unwrap_or("").to_string();
        out.push((g.status, ep, t.elapsed()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_alternating_200_and_503_retry_after_10_delays_no_request() {
    let (pushing, got) = pushing_backend("10", |n| n % 2 == 0, Duration::ZERO).await;
    let healthy = backends(1, Duration::ZERO).await;
    let addrs = [pushing, healthy[0].addr()];
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let answers = sequential(proxy.listener_addrs()[0], 40).await;
    let slowest = answers.iter().map(|a| a.2).max().unwrap();
    let statuses: Vec<_> = answers.iter().map(|a| a.0.as_u16()).collect();
    // A 503 is retried on the other endpoint at once: every answer is a 200, none waited.
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        slowest < Duration::from_secs(3),
        "a request took {slowest:?}"
    );
    assert_eq!(
        metric(admin, "keel_retry_pushbacks_total{cluster=\"app\"}").await,
        Some(0.0)
    );
    // After its 503 the pushing endpoint is passed over for its 10 s: it got its first 200
    // and its 503, nothing more.
    assert_eq!(
        got.load(Relaxed),
        2,
        "the pushing endpoint was not backed off"
    );
    let from_pushing = answers
        .iter()
        .filter(|a| a.1 == pushing.to_string())
        .count();
    println!(
        "40 GETs, one endpoint alternating 200 and 503 Retry-After: 10: all 200, slowest {slowest:?}, {from_pushing} answered by it"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_or_malformed_retry_after_values_neither_stop_retries_nor_delay_them() {
    for value in ["9999999999", "soon", "Fri, 31 Dec 9999 23:59:59 GMT", "-5"] {
        let (pushing, _) = pushing_backend(value, |_| true, Duration::ZERO).await;
        let healthy = backends(1, Duration::ZERO).await;
        let addrs = [pushing, healthy[0].addr()];
        let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
            .await
            .unwrap();
        let answers = sequential(proxy.listener_addrs()[0], 6).await;
        for (status, ep, took) in &answers {
            assert_eq!(
                *status,
                StatusCode::OK,
                "Retry-After {value:?}: {answers:?}"
            );
            assert_eq!(*ep, healthy[0].addr().to_string(), "{value:?}");
            assert!(*took < Duration::from_secs(3), "{value:?}: {took:?}");
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_pushes_back_is_still_ejected_by_its_consecutive_failures() {
    // Every answer a 503 with Retry-After: 10, after 300 ms: ten requests at once put five on
    // it before its first 503 comes back.
    let (pushing, _) = pushing_backend("10", |_| true, Duration::from_millis(300)).await;
    let healthy = backends(1, Duration::ZERO).await;
    let addrs = [pushing, healthy[0].addr()];
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let c = client();
    let t = Instant::now();
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                send(&c, Method::GET, &format!("http://{addr}/"), &[], b"").await
            })
        })
        .collect();
    for task in tasks {
        let g = task.await.unwrap().expect("answered within 5 s");
        assert_eq!(g.status, StatusCode::OK, "{}", g.text());
    }
    let took = t.elapsed();
    assert!(took < Duration::from_secs(3), "the burst took {took:?}");
    let st = proxy.cluster_status("app").unwrap();
    let p = st
        .iter()
        .find(|e| e.address == pushing.to_string())
        .unwrap();
    assert!(p.failures >= 5, "{p:?}");
    assert!(
        p.ejected_until.is_some(),
        "five 503s in a row did not eject it: {p:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_other_endpoint_the_retry_waits_as_the_endpoint_asked() {
    let (pushing, got) = pushing_backend("1", |n| n == 1, Duration::ZERO).await;
    let proxy = keel_proxy::start(simple_config(&[pushing], "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let answers = sequential(proxy.listener_addrs()[0], 1).await;
    let (status, _, took) = &answers[0];
    assert_eq!(*status, StatusCode::OK);
    assert!(
        *took >= Duration::from_millis(900),
        "retried after {took:?}"
    );
    assert_eq!(got.load(Relaxed), 2);
    assert_eq!(
        metric(admin, "keel_retry_pushbacks_total{cluster=\"app\"}").await,
        Some(1.0)
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Sends GETs one after the other until `done` holds (at most 50); the statuses seen.
async fn until(addr: SocketAddr, done: impl Fn() -> bool) -> Vec<u16> {
    let mut seen = Vec::new();
    while !done() {
        assert!(seen.len() < 50, "never got there: {seen:?}");
        seen.push(sequential(addr, 1).await[0].0.as_u16());
    }
    seen
}

/// How many of `answers` each of `addrs` gave.
fn shares(answers: &[(StatusCode, String, Duration)], addrs: &[SocketAddr]) -> Vec<usize> {
    let by = |a: &SocketAddr| answers.iter().filter(|x| x.1 == a.to_string()).count();
    addrs.iter().map(by).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_three_endpoints_asking_30_s_back_off_only_the_share_max_backed_off_percent_allows()
{
    // Two endpoints answer their first request `503 Retry-After: 30`, then 200s; the third
    // is healthy. At the default 10 % only one of three may be backed off at once: the
    // other 503 is retried but not obeyed, and the next requests share two endpoints, not one.
    let (a, got_a) = pushing_backend("30", |n| n == 1, Duration::ZERO).await;
    let (b, got_b) = pushing_backend("30", |n| n == 1, Duration::ZERO).await;
    let healthy = backends(1, Duration::ZERO).await;
    let addrs = [a, b, healthy[0].addr()];
    let config = simple_config(&addrs, "round-robin", "[cluster.retry]\nattempts = 2\n");
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let before = until(addr, || {
        got_a.load(Relaxed) >= 1 && got_b.load(Relaxed) >= 1
    })
    .await;
    assert!(before.iter().all(|s| *s == 200), "{before:?}");
    let answers = sequential(addr, 30).await;
    assert!(answers.iter().all(|a| a.0 == StatusCode::OK), "{answers:?}");
    let [on_a, on_b, on_c] = shares(&answers, &addrs)[..] else {
        unreachable!()
    };
    println!("30 GETs after two 503 Retry-After: 30 of three endpoints: {on_a} / {on_b} / {on_c}");
    assert_eq!(
        on_a.min(on_b),
        0,
        "one of the two is backed off: {on_a} / {on_b} / {on_c}"
    );
    assert!(
        on_a.max(on_b) >= 10 && on_c <= 20,
        "the other two share the load: {on_a} / {on_b} / {on_c}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_backs_its_endpoint_off() {
    // A 429 is not the endpoint's failure and is not retried: it goes to the client. Its
    // Retry-After still backs the endpoint off, as it says.
    let (pushing, got) = backend_answering(429, "5", |n| n == 1, Duration::ZERO).await;
    let healthy = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(simple_config(
        &[pushing, healthy[0].addr()],
        "round-robin",
        "",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let before = until(addr, || got.load(Relaxed) >= 1).await;
    assert_eq!(before.last(), Some(&429), "{before:?}");
    let answers = sequential(addr, 20).await;
    assert!(answers.iter().all(|a| a.0 == StatusCode::OK), "{answers:?}");
    assert_eq!(
        got.load(Relaxed),
        1,
        "the endpoint that said 429 Retry-After: 5 was picked again"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_off_lasts_at_most_max_back_off() {
    let (pushing, got) = pushing_backend("30", |n| n == 1, Duration::ZERO).await;
    let healthy = backends(1, Duration::ZERO).await;
    let addrs = [pushing, healthy[0].addr()];
    let proxy = keel_proxy::start(simple_config(
        &addrs,
        "round-robin",
        "max_back_off = \"1s\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    until(addr, || got.load(Relaxed) >= 1).await;
    let during = shares(&sequential(addr, 6).await, &addrs);
    assert_eq!(during[0], 0, "backed off: {during:?}");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let after = shares(&sequential(addr, 10).await, &addrs);
    assert!(
        after[0] >= 4,
        "Retry-After: 30 outlasted max_back_off = 1s: {after:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
