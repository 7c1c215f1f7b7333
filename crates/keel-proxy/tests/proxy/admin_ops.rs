//! The admin listener's operations on loopback: `/live` and `/ready` through a drain, an
//! endpoint drained and undrained by `POST /endpoints/{cluster}/{address}/drain`, and the
//! process metrics.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hyper::Method;
use keel_proxy::ProxyConfig;

use crate::support::*;

async fn status_code(url: &str) -> Option<u16> {
    get(url).await.ok().map(|r| r.status.as_u16())
}

/// `/ready` answers 200 while the proxy serves, 503 from the moment a shutdown begins while a
/// slow request still finishes, and the admin stays up meanwhile (`/live` 200); it closes once
/// the drain is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_fails_as_soon_as_a_drain_starts_while_requests_in_flight_finish() {
    let bs = backends(1, Duration::from_millis(1500)).await;
    let proxy = keel_proxy::start(simple_config(&[bs[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    assert_eq!(
        status_code(&format!("http://{admin}/ready")).await,
        Some(200)
    );
    assert_eq!(
        status_code(&format!("http://{admin}/live")).await,
        Some(200)
    );
    let status: serde_json::Value =
        serde_json::from_slice(&get(&format!("http://{admin}/status")).await.unwrap().body)
            .unwrap();
    assert_eq!(status["ready"], true);

    let slow = tokio::spawn(async move {
        let c = client();
        send(&c, Method::GET, &url, &[], b"").await
    });
    // The request is at the endpoint (1.5 s to go) before the drain begins.
    assert!(
        eventually(Duration::from_secs(2), || proxy
            .cluster_status("app")
            .unwrap()
            .iter()
            .any(|e| e.in_flight == 1))
        .await
    );
    let started = Instant::now();
    let drain = tokio::spawn(proxy.shutdown(Duration::from_secs(10)));

    // 503 within a moment of the drain's start, while the request is still in flight.
    let mut seen = None;
    while started.elapsed() < Duration::from_secs(1) {
        seen = status_code(&format!("http://{admin}/ready")).await;
        if seen == Some(503) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(seen, Some(503), "/ready during the drain");
    assert!(!slow.is_finished(), "the slow request is still in flight");
    assert_eq!(
        status_code(&format!("http://{admin}/live")).await,
        Some(200)
    );
    let body = get(&format!("http://{admin}/ready")).await.unwrap().text();
    assert_eq!(body, "draining\n");

    let answered = slow.await.unwrap().expect("the slow request completes");
    assert_eq!(answered.status, 200);
    let drained = drain.await.unwrap();
    assert_eq!(drained.total(), 0, "nothing was cut: {drained:?}");
    // The drain is over: the admin listener is closed too.
    assert_eq!(status_code(&format!("http://{admin}/live")).await, None);
}

/// The stop SIGTERM asks for fails `/ready` first: for `drain_delay` the listeners still
/// accept new connections and serve them, so that a load balancer in front sees the probe fail
/// before any connection is refused; then the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_fails_ready_while_the_listeners_still_serve_for_drain_delay() {
    let bs = backends(1, Duration::ZERO).await;
    let mut config = simple_config(&[bs[0].addr()], "round-robin", "");
    config.drain_delay = Duration::from_millis(1500);
    config.drain_timeout = Duration::from_secs(1);
    let proxy = keel_proxy::start(config).await.unwrap();
    let admin = proxy.admin_addr().unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let listener = proxy.listener_addrs()[0];
    assert_eq!(
        status_code(&format!("http://{admin}/ready")).await,
        Some(200)
    );
    let started = Instant::now();
    let stop = tokio::spawn(proxy.terminate());
    let mut seen = None;
    while started.elapsed() < Duration::from_millis(300) {
        seen = status_code(&format!("http://{admin}/ready")).await;
        if seen == Some(503) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(seen, Some(503), "/ready fails at once");
    // Still serving, on new connections, for the delay.
    let mut served = 0;
    while started.elapsed() < Duration::from_millis(1200) {
        let c = client();
        let r = send(&c, Method::GET, &url, &[], b"")
            .await
            .expect("served during the delay");
        assert_eq!(r.status, 200);
        served += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served >= 5, "{served}");
    let drained = stop.await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(drained.total(), 0);
    assert!(
        tokio::net::TcpStream::connect(listener).await.is_err(),
        "the listener is closed after the drain"
    );
}

/// `/live` and `/ready` answer probes without the admin token (they tell nothing else); every
/// other path, the drain included, still needs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_without_the_token_and_drains_need_it() {
    let bs = backends(1, Duration::ZERO).await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"test-token-0123456789abcdef\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    assert_eq!(
        status_code(&format!("http://{admin}/ready")).await,
        Some(200)
    );
    assert_eq!(
        status_code(&format!("http://{admin}/live")).await,
        Some(200)
    );
    assert_eq!(
        status_code(&format!("http://{admin}/status")).await,
        Some(401)
    );
    let c = client();
    let drain = format!("http://{admin}/endpoints/app/{}/drain", bs[0].addr());
    let r = send(&c, Method::POST, &drain, &[], b"").await.unwrap();
    assert_eq!(r.status, 401);
    assert!(!proxy.cluster_status("app").unwrap()[0].draining);
    let auth = [("authorization", "Bearer test-token-0123456789abcdef")];
    let r = send(&c, Method::POST, &drain, &auth, b"").await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(proxy.cluster_status("app").unwrap()[0].draining);
    proxy.shutdown(Duration::from_secs(1)).await;
}

async fn endpoint_counts(url: &str, n: usize, addrs: &[SocketAddr]) -> Vec<usize> {
    let c = client();
    let mut counts = vec![0; addrs.len()];
    for _ in 0..n {
        let r = send(&c, Method::GET, url, &[], b"").await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let e = r.header("x-keel-endpoint").unwrap().to_string();
        let i = addrs.iter().position(|a| a.to_string() == e).unwrap();
        counts[i] += 1;
    }
    counts
}

/// One of three endpoints drained through the admin gets none of 60 requests, shows as
/// draining in `/status` and `/metrics`, and gets its share again once undrained; a drain of
/// an unknown endpoint or cluster is 404, a GET is 405.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_endpoint_gets_no_requests_until_undrained() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();

    let r = send(
        &c,
        Method::POST,
        &format!("http://{admin}/endpoints/app/{}/drain", addrs[1]),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["draining"], true);

    let counts = endpoint_counts(&url, 60, &addrs).await;
    assert_eq!(counts, [30, 0, 30], "round-robin over the two left");
    let status: serde_json::Value =
        serde_json::from_slice(&get(&format!("http://{admin}/status")).await.unwrap().body)
            .unwrap();
    let eps = status["clusters"][0]["endpoints"].as_array().unwrap();
    let drained: Vec<_> = eps.iter().map(|e| e["draining"] == true).collect();
    assert_eq!(drained, [false, true, false]);
    let line = format!(
        "keel_endpoint_draining{{cluster=\"app\",endpoint=\"{}\"}}",
        addrs[1]
    );
    assert_eq!(metric(admin, &line).await, Some(1.0));

    // Unknown names: 404 naming what exists; the wrong method: 405.
    let r = send(
        &c,
        Method::POST,
        &format!("http://{admin}/endpoints/app/127.0.0.1:1/drain"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 404);
    assert!(r.text().contains(&addrs[0].to_string()), "{}", r.text());
    let r = send(
        &c,
        Method::POST,
        &format!("http://{admin}/endpoints/nope/{}/drain", addrs[0]),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 404);
    let r = send(
        &c,
        Method::GET,
        &format!("http://{admin}/endpoints/app/{}/drain", addrs[0]),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 405);

    let r = send(
        &c,
        Method::POST,
        &format!("http://{admin}/endpoints/app/{}/undrain", addrs[1]),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let counts = endpoint_counts(&url, 60, &addrs).await;
    assert_eq!(counts, [20, 20, 20], "round-robin over all three again");
    assert_eq!(metric(admin, &line).await, Some(0.0));
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A reload that keeps the endpoint keeps its drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_survives_a_reload_that_keeps_the_endpoint() {
    let bs = backends(2, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let c = client();
    let r = send(
        &c,
        Method::POST,
        &format!("http://{admin}/endpoints/app/{}/drain", addrs[0]),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    let mut config = (*proxy.config()).clone();
    config.clusters[0].protections.retry.attempts = 1;
    proxy.reload(config).unwrap();
    let st = proxy.cluster_status("app").unwrap();
    assert!(st[0].draining && !st[1].draining, "{st:?}");
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    assert_eq!(endpoint_counts(&url, 10, &addrs).await, [0, 10]);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// `/metrics` has Prometheus' standard `process_*` metrics with values this process can have,
/// and `keel_build_info` with the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_the_process_figures_and_the_build_info() {
    let bs = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(simple_config(&[bs[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let admin = proxy.admin_addr().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let m = |name: &'static str| async move {
        metric(admin, &format!("{name} "))
            .await
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    // The CPU this process has used, as getrusage counts it (`/proc` counts whole clock ticks
    // of 10 ms: a process that ran less shows 0, so some is spent first).
    let own_cpu = || {
        // SAFETY: getrusage writes the struct it is given.
        let u = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut u);
            u
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        secs(u.ru_utime) + secs(u.ru_stime)
    };
    let spin = std::time::Instant::now();
    while own_cpu() < 0.05 && spin.elapsed() < Duration::from_secs(10) {
        std::hint::black_box((0..10_000u64).sum::<u64>());
    }
    let before = own_cpu();
    let cpu = m("process_cpu_seconds_total").await;
    let after = own_cpu();
    assert!(
        before - 0.02 <= cpu && cpu <= after + 0.01,
        "cpu {cpu}, getrusage {before} then {after}"
    );
    let rss = m("process_resident_memory_bytes").await;
    assert!(rss > 1e6 && rss < 24e9, "rss {rss}");
    let vsz = m("process_virtual_memory_bytes").await;
    assert!(vsz >= rss, "virtual {vsz} < resident {rss}");
    let start = m("process_start_time_seconds").await;
    assert!(
        start > now - 3600.0 && start <= now + 2.0,
        "start {start}, now {now}"
    );
    let max = m("process_max_fds").await;
    // The count is this process's descriptors: held against /proc/self/fd read just before and
    // just after the scrape (this binary's other tests open and close sockets meanwhile, so a
    // try where the two differ, or a socket came and went between, is tried again); the
    // scrape's own connection and the listing's directory are the slack.
    let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count() as f64;
    let mut tries = Vec::new();
    let open = loop {
        let before = fds();
        let got = m("process_open_fds").await;
        if fds() == before && (got - before).abs() <= 4.0 {
            break got;
        }
        tries.push((before, got));
        assert!(
            tries.len() < 50,
            "process_open_fds never matched /proc/self/fd: {tries:?}"
        );
    };
    assert!(open >= 5.0 && open < max, "open {open}, max {max}");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        metric(admin, &format!("keel_build_info{{version=\"{version}\"}}")).await,
        Some(1.0)
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
