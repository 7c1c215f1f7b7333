//! Server-reported load through the proxy: with `strategy = "prequal"` the HTTP/1.1 leg reads
//! `x-keel-rif` and `x-keel-latency-us` from every answer, and load probes (`[cluster.probe]`,
//! `GET /keel/load` after each pick) bring more; both reach the balancer as load reports.

use std::time::Duration;

use crate::support::*;
use hyper::{Method, StatusCode};
use keel_model::vocab::Latency;
use keel_testbed::backend::{self, BackendConfig};

/// Two endpoints (`keel backend` with a capacity): one answers in 1 ms, one in 150 ms. Once
/// both have served a call, their reports say so, and prequal's hot-cold rule (neither is hot,
/// so the lower latency) sends every call to the fast one; random would send half to each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prequal_balances_on_the_load_endpoints_report_in_their_answers() {
    let mut bs = Vec::new();
    for (name, ms) in [("fast", 1), ("slow", 150)] {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(ms)),
            name: name.into(),
            concurrency: Some(1),
            ..BackendConfig::default()
        };
        bs.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "prequal", ""))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let mut by = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..40 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        // The endpoint's report is forwarded with the answer.
        assert!(r.header("x-keel-rif").is_some() && r.header("x-keel-latency-us").is_some());
        *by.entry(r.header("x-backend").unwrap().to_string())
            .or_default() += 1;
    }
    // Until the endpoints have latencies to report (a backend with no recent request reports
    // 0), the slow one may get a call or two; then none.
    let slow = by.get("slow").copied().unwrap_or(0);
    assert!(slow <= 6, "{by:?}");
    assert!(bs[1].requests() as usize == slow);
    // And each pick sent probes (`[cluster.probe]`, 3 per request: here both endpoints).
    assert!(
        eventually(Duration::from_secs(2), || bs
            .iter()
            .all(|b| b.load_probes() >= 30))
        .await,
        "{:?}",
        bs.iter().map(|b| b.load_probes()).collect::<Vec<_>>()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// E4's black hole on real traffic: an endpoint that fails at once reports the best load of all
/// (nothing in flight, answers in no time), in its 503s and at `/keel/load`. After each failure
/// prequal ignores its reports for `failure_penalty` (1 s), so it gets about one call a second
/// (each retried on another endpoint), not the most calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_failing_endpoint_does_not_attract_prequal() {
    use keel_model::vocab::FailureMode;
    let mut bs = Vec::new();
    for (name, fault) in [
        ("bad", FailureMode::FAIL_AT_ONCE),
        ("good-1", FailureMode::None),
        ("good-2", FailureMode::None),
    ] {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(2)),
            fault,
            name: name.into(),
            concurrency: Some(4),
            ..BackendConfig::default()
        };
        bs.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, "prequal", ""))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let start = std::time::Instant::now();
    for _ in 0..300 {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK, "retried on a good endpoint");
    }
    let seconds = start.elapsed().as_secs_f64();
    // One call when the penalty ends, a few more at most before the failure comes back.
    let bad = bs[0].requests() as f64;
    assert!(
        bad <= 3.0 * (seconds + 1.0),
        "{bad} calls to the failing endpoint in {seconds:.2} s"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// ORCA through the proxy: two `keel backend --orca` endpoints (one writing the TEXT form, one
/// JSON), one answering in 2 ms and one in 10 ms. Each reports its requests per second and its
/// mean requests in flight as cpu_utilization, so A58's weight qps / utilization comes to
/// 1 / latency, and orca-wrr gives the slower one (1/10) / (1/10 + 1/2) = 1/6 of the calls
/// once the reports count (blackout 0 s here, weights recomputed every 100 ms); before any
/// report, round-robin's 1/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orca_wrr_sends_fewer_calls_to_the_endpoint_whose_orca_report_says_it_is_loaded() {
    use keel_testbed::backend::OrcaForm;
    // The backends' first report with rates comes a second after they start: the round-robin
    // phase is timed from here, not from the proxy's start (which may take a while on a busy
    // machine).
    let spawned = std::time::Instant::now();
    let mut bs = Vec::new();
    for (name, ms, form) in [("light", 2, OrcaForm::Text), ("loaded", 10, OrcaForm::Json)] {
        let cfg = BackendConfig {
            latency: Latency::fixed(Duration::from_millis(ms)),
            name: name.into(),
            orca: Some(form),
            ..BackendConfig::default()
        };
        bs.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let extra = "blackout_period = \"0s\"\nweight_update_period = \"100ms\"";
    let proxy = keel_proxy::start(simple_config(&addrs, "orca-wrr", extra))
        .await
        .unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let start = std::time::Instant::now();
    let (mut first_second, mut later) = ([0usize; 2], [0usize; 2]);
    while start.elapsed() < Duration::from_secs(4) {
        let r = send(&c, Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        let orca = r
            .header("endpoint-load-metrics")
            .expect("the report is forwarded");
        let which = usize::from(r.header("x-backend") == Some("loaded"));
        assert!(orca.starts_with(["TEXT ", "JSON "][which]), "{orca}");
        let at = spawned.elapsed();
        if at < Duration::from_millis(900) {
            first_second[which] += 1;
        } else if at > Duration::from_millis(2500) {
            later[which] += 1;
        }
    }
    // Before the first full second no report has rates: round-robin.
    assert!(
        first_second[0].abs_diff(first_second[1]) <= 1,
        "{first_second:?}"
    );
    let share = later[1] as f64 / (later[0] + later[1]) as f64;
    println!(
        "orca-wrr: first 0.9 s {first_second:?}, after 2.5 s {later:?}: loaded share {share:.3}"
    );
    // 1/6 by the closed form; timers, loopback and the proxy add about 1 ms to both, which
    // pulls it towards 1/2 a little (1/11 / (1/11 + 1/3) = 0.21; 0.222-0.225 in 3 runs).
    assert!(
        share > 0.08 && share < 0.3,
        "loaded share {share:.3}: {later:?}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
