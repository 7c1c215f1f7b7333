//! The load generator against real backends on loopback: counts, outcomes, confidence intervals
//! and client-side balancing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_balance::{Balancer, BalancerConfig, EndpointSpec, OutlierConfig, StrategyKind, TieBreak};
use keel_model::stats::wilson95;
use keel_model::{FailureMode, Latency};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};
use keel_testbed::loadgen::{self, LoadOptions, LoadSpec, Target};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn backends(n: usize, cfg: BackendConfig) -> Vec<BackendHandle> {
    let mut v = Vec::new();
    for i in 0..n {
        let cfg = BackendConfig {
            name: format!("b{i}"),
            ..cfg.clone()
        };
        v.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    v
}

fn specs(bs: &[BackendHandle]) -> Vec<EndpointSpec> {
    bs.iter()
        .map(|b| EndpointSpec::new(b.addr().to_string()))
        .collect()
}

fn url(b: &BackendHandle) -> Target {
    Target::Url(format!("http://{}/work?x=1", b.addr()))
}

#[tokio::test]
async fn counts_every_request_call_status_and_endpoint() {
    let bs = backends(1, BackendConfig::default()).await;
    let progress = Arc::new(AtomicU64::new(0));
    let r = loadgen::try_run(
        LoadSpec {
            target: url(&bs[0]),
            requests: 500,
            concurrency: 8,
            timeout: Duration::from_secs(2),
            calls_per_request: 2,
        },
        LoadOptions {
            progress: Some(progress.clone()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!((r.requests, r.succeeded), (500, 500), "{r}");
    assert_eq!((r.calls, r.calls_ok), (1000, 1000));
    assert_eq!(r.by_status.get(&200), Some(&1000));
    assert_eq!(r.per_endpoint.get("b0"), Some(&1000));
    assert_eq!(r.transport_errors, 0);
    assert_eq!(bs[0].requests(), 1000, "the backend saw every call");
    assert_eq!(progress.load(Ordering::Relaxed), 500);
    assert_eq!(r.success_rate(), 1.0);
    assert_eq!(r.ci95(), wilson95(500, 500));
    assert!(r.latency_p50 <= r.latency_p99 && r.latency_p99 <= r.latency_max);
    assert!(!r.deadline_hit);
}

#[tokio::test]
async fn k_sequential_calls_succeed_together_as_the_model_says() {
    // Every call fails with probability 0.2, so a request of 3 calls succeeds with 0.8^3 = 0.512.
    // One worker and a seeded backend make the run repeatable.
    let b = backend::spawn_with_seed(
        any_port(),
        BackendConfig {
            fault: FailureMode::Error { probability: 0.2 },
            ..Default::default()
        },
        5,
    )
    .await
    .unwrap();
    let r = loadgen::run(LoadSpec {
        target: url(&b),
        requests: 2000,
        concurrency: 1,
        timeout: Duration::from_secs(2),
        calls_per_request: 3,
    })
    .await;
    assert_eq!(r.requests, 2000);
    // A request stops at its first failed call.
    assert_eq!(r.calls, b.requests());
    assert_eq!(r.by_status.values().sum::<u64>(), r.calls);
    assert_eq!(r.calls - r.calls_ok, r.requests - r.succeeded, "{r}");
    // sd of the rate: sqrt(0.512 * 0.488 / 2000) = 0.0112; allow 4 sd.
    assert!((r.success_rate() - 0.512).abs() < 0.045, "{r}");
    let (lo, hi) = r.ci95();
    assert!(lo < r.success_rate() && r.success_rate() < hi);
    // Wilson half-width at n = 2000 around 0.5 is about 0.022.
    assert!((hi - lo - 0.044).abs() < 0.004, "{lo}..{hi}");
    // Calls: 2000 requests * (1 + 0.8 + 0.64) = 4880 expected.
    assert!((4700..5060).contains(&r.calls), "{r}");
}

#[tokio::test]
async fn transport_errors_refused_and_timeouts_are_counted() {
    let bs = backends(1, BackendConfig::default()).await;
    bs[0].apply_fault(FailureMode::Refuse).await.unwrap();
    let r = loadgen::run(LoadSpec {
        target: url(&bs[0]),
        requests: 50,
        concurrency: 5,
        timeout: Duration::from_secs(1),
        calls_per_request: 1,
    })
    .await;
    assert_eq!((r.requests, r.succeeded, r.transport_errors), (50, 0, 50));
    assert_eq!(r.timeouts, 0);
    assert_eq!(r.ci95().0, 0.0);

    bs[0].apply_fault(FailureMode::Hang).await.unwrap();
    let r = loadgen::run(LoadSpec {
        target: url(&bs[0]),
        requests: 8,
        concurrency: 4,
        timeout: Duration::from_millis(150),
        calls_per_request: 3,
    })
    .await;
    assert_eq!((r.requests, r.calls, r.timeouts), (8, 8, 8), "{r}");
    // Two rounds of one 150 ms timeout each.
    assert!(r.elapsed >= Duration::from_millis(300), "{r}");
    assert!(r.elapsed < Duration::from_millis(1500), "{r}");
    assert!(r.latency_p50 >= Duration::from_millis(150));
}

#[tokio::test]
async fn the_overall_deadline_stops_a_run() {
    let bs = backends(
        1,
        BackendConfig {
            fault: FailureMode::Hang,
            ..Default::default()
        },
    )
    .await;
    let r = loadgen::try_run(
        LoadSpec {
            target: url(&bs[0]),
            requests: 1000,
            concurrency: 2,
            timeout: Duration::from_secs(10),
            calls_per_request: 1,
        },
        LoadOptions {
            deadline: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(r.deadline_hit, "{r}");
    assert_eq!(r.requests, 2, "{r}");
    assert!(r.elapsed < Duration::from_secs(2), "{r}");
}

#[tokio::test]
async fn invalid_specs_are_refused_before_sending() {
    let bad = [
        ("ftp://127.0.0.1:1/", 1, 1),
        ("not a url", 1, 1),
        ("http://127.0.0.1:1/", 0, 1),
        ("http://127.0.0.1:1/", 1, 0),
    ];
    for (u, concurrency, calls) in bad {
        let spec = LoadSpec {
            target: Target::Url(u.into()),
            requests: 1,
            concurrency,
            timeout: Duration::from_secs(1),
            calls_per_request: calls,
        };
        assert!(
            loadgen::try_run(spec, LoadOptions::default())
                .await
                .is_err(),
            "{u} {concurrency} {calls}"
        );
    }
}

fn balancer(kind: StrategyKind, bs: &[BackendHandle], tie: TieBreak, seed: u64) -> Balancer {
    let mut cfg = BalancerConfig::new(kind);
    cfg.options.tie_break = tie;
    cfg.seed = seed;
    Balancer::new(cfg, &specs(bs)).unwrap()
}

#[tokio::test]
async fn client_side_round_robin_spreads_calls_evenly() {
    let bs = backends(3, BackendConfig::default()).await;
    let lb = Arc::new(balancer(StrategyKind::RoundRobin, &bs, TieBreak::Random, 1));
    let r = loadgen::run(LoadSpec {
        target: Target::ClientSide {
            endpoints: bs.iter().map(|b| b.addr()).collect(),
            balancer: lb.clone(),
            path: "/".into(),
        },
        requests: 300,
        concurrency: 1,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    assert_eq!(r.succeeded, 300, "{r}");
    for (i, b) in bs.iter().enumerate() {
        assert_eq!(r.per_endpoint.get(&format!("b{i}")), Some(&100), "{r:?}");
        assert_eq!(r.picks.get(&b.addr().to_string()), Some(&100));
        assert_eq!(b.requests(), 100);
    }
    // Every pick was finished: nothing left in flight.
    assert!(lb.endpoints().iter().all(|e| e.in_flight() == 0));
}

#[tokio::test]
async fn client_side_failures_reach_the_balancer() {
    // One of three backends answers 503 at once; with outlier detection the balancer ejects it
    // after 3 consecutive failures, so it gets only a handful of the 300 calls.
    let bs = backends(3, BackendConfig::default()).await;
    bs[2].set_fault(FailureMode::FAIL_AT_ONCE);
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(OutlierConfig {
        consecutive_failures: 3,
        base_ejection_time: Duration::from_secs(30),
        ..Default::default()
    });
    let lb = Arc::new(Balancer::new(cfg, &specs(&bs)).unwrap());
    let r = loadgen::run(LoadSpec {
        target: Target::ClientSide {
            endpoints: bs.iter().map(|b| b.addr()).collect(),
            balancer: lb.clone(),
            path: "/".into(),
        },
        requests: 300,
        concurrency: 1,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    let failed = r.by_status.get(&503).copied().unwrap_or(0);
    assert_eq!(failed, 3, "{r}");
    assert_eq!(lb.endpoints()[2].outcomes(), (0, 3));
    assert_eq!(r.succeeded, 297);
}

#[tokio::test]
async fn per_worker_balancers_see_only_their_own_in_flight_calls() {
    // Least-connections with the lowest-index tie-break: one balancer per worker, each with at
    // most one call in flight, always sees all counts at 0 and picks endpoint 0 (the model's
    // client-side trap, experiment E5). One balancer shared by the same 6 workers sees the calls
    // in flight and spreads them.
    let bs = backends(
        3,
        BackendConfig {
            latency: Latency::fixed(Duration::from_millis(5)),
            ..Default::default()
        },
    )
    .await;
    let endpoints: Vec<SocketAddr> = bs.iter().map(|b| b.addr()).collect();
    let specs_ = specs(&bs);
    let made = Arc::new(AtomicU64::new(0));
    let made_in = made.clone();
    let per_worker = loadgen::run(LoadSpec {
        target: Target::ClientSidePerWorker {
            endpoints: endpoints.clone(),
            make_balancer: Arc::new(move |worker| {
                made_in.fetch_add(1, Ordering::Relaxed);
                let mut cfg = BalancerConfig::new(StrategyKind::LeastConnections);
                cfg.options.tie_break = TieBreak::LowestIndex;
                cfg.seed = worker as u64;
                Balancer::new(cfg, &specs_).unwrap()
            }),
            path: "/".into(),
        },
        requests: 120,
        concurrency: 6,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    assert_eq!(made.load(Ordering::Relaxed), 6);
    assert_eq!(
        per_worker.per_endpoint.get("b0"),
        Some(&120),
        "{per_worker:?}"
    );

    let shared = Arc::new(balancer(
        StrategyKind::LeastConnections,
        &bs,
        TieBreak::LowestIndex,
        1,
    ));
    let r = loadgen::run(LoadSpec {
        target: Target::ClientSide {
            endpoints,
            balancer: shared,
            path: "/".into(),
        },
        requests: 120,
        concurrency: 6,
        timeout: Duration::from_secs(2),
        calls_per_request: 1,
    })
    .await;
    // 6 in flight over 3 endpoints: about 2 each, so b0 gets about a third, far from all.
    let b0 = r.per_endpoint.get("b0").copied().unwrap_or(0);
    assert!(b0 < 80, "{r:?}");
    assert_eq!(r.per_endpoint.len(), 3, "{r:?}");
}

/// Direct-path throughput and latency of backend + load generator (no proxy): the baseline the
/// proxy's overhead is measured against. Not a pass/fail test; run it with
/// `cargo test --release -p keel-testbed --test testbed -- --ignored --nocapture loadgen::direct_path`.
/// `KEEL_BENCH_URL=http://127.0.0.1:9001/` targets a backend (or proxy) in another process
/// instead of an in-process one; `KEEL_BENCH_REQUESTS` and `KEEL_BENCH_CONCURRENCY` change the
/// defaults of 10,000 and 32.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a test"]
async fn direct_path_performance() {
    let env_num = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let requests = env_num("KEEL_BENCH_REQUESTS", 10_000);
    let concurrency = env_num("KEEL_BENCH_CONCURRENCY", 32) as usize;
    let local = backends(1, BackendConfig::default()).await;
    let target = match std::env::var("KEEL_BENCH_URL") {
        Ok(u) => Target::Url(u),
        Err(_) => url(&local[0]),
    };
    println!("target {target:?}, {requests} requests, concurrency {concurrency}");
    // A warm-up opens the connections.
    let mut spec = LoadSpec::new(target, 1_000);
    spec.concurrency = concurrency;
    loadgen::run(spec.clone()).await;
    spec.requests = requests;
    let r = loadgen::run(spec).await;
    println!("{r}");
    assert_eq!(r.succeeded, r.requests, "{r}");
}

#[tokio::test]
async fn the_client_decides_whether_a_failed_call_ends_its_request() {
    let bs = backends(1, BackendConfig::default()).await;
    bs[0].apply_fault(FailureMode::FAIL_AT_ONCE).await.unwrap();
    let spec = LoadSpec {
        target: url(&bs[0]),
        requests: 10,
        concurrency: 2,
        timeout: Duration::from_secs(1),
        calls_per_request: 3,
    };
    let run = |client| {
        let spec = spec.clone();
        async move {
            let options = LoadOptions {
                client,
                ..Default::default()
            };
            loadgen::try_run(spec, options).await.unwrap()
        }
    };
    let stops = run(loadgen::Client::StopsAtFirstFailure).await;
    assert_eq!((stops.calls, stops.succeeded), (10, 0), "{stops}");
    assert_eq!(stops.failed_calls_per_request, vec![0, 10]);
    let all = run(loadgen::Client::AllCalls).await;
    assert_eq!((all.calls, all.succeeded), (30, 0), "{all}");
    assert_eq!(all.failed_calls_per_request, vec![0, 0, 0, 10]);
}

#[tokio::test]
async fn one_key_per_request_sends_a_requests_calls_to_one_endpoint() {
    // Ring-hash in the client, one of five failing at once, every call made: with one key per
    // request a failed request failed all 3 of its calls; with a new key each call (no request
    // key), 200 requests would have some with 1 or 2.
    let bs = backends(5, BackendConfig::default()).await;
    bs[4].apply_fault(FailureMode::FAIL_AT_ONCE).await.unwrap();
    let endpoints: Vec<SocketAddr> = bs.iter().map(|b| b.addr()).collect();
    let balancer =
        Arc::new(Balancer::new(BalancerConfig::new(StrategyKind::RingHash), &specs(&bs)).unwrap());
    let spec = LoadSpec {
        target: Target::ClientSide {
            endpoints,
            balancer,
            path: "/".into(),
        },
        requests: 200,
        concurrency: 4,
        timeout: Duration::from_secs(1),
        calls_per_request: 3,
    };
    let options = LoadOptions {
        client: loadgen::Client::AllCalls,
        request_key: Some("x-key".into()),
        ..Default::default()
    };
    let r = loadgen::try_run(spec, options).await.unwrap();
    let h = &r.failed_calls_per_request;
    assert_eq!(h.len(), 4, "{h:?}");
    assert_eq!((h[1], h[2]), (0, 0), "{h:?}");
    assert!(h[3] > 0 && h[0] > 0, "{h:?}");
    assert_eq!(r.requests, 200);
}
