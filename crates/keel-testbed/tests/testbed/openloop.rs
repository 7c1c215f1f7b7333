//! The open-loop generator over real loopback sockets: Poisson arrivals split over two backends,
//! and the backends' own service time read from their answers.

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use keel_balance::{Balancer, BalancerConfig, EndpointSpec, StrategyKind};
use keel_model::vocab::{Latency, LatencyDist};
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::openloop::{self, ClientSide, OpenLoopSpec, RecordOutcome};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_split_over_targets_with_service_times() {
    let cfg = BackendConfig {
        latency: Latency::fixed(Duration::from_millis(5)),
        ..BackendConfig::default()
    };
    let a = backend::spawn(any_port(), cfg.clone()).await.unwrap();
    let b = backend::spawn(any_port(), cfg).await.unwrap();
    let spec = OpenLoopSpec {
        targets: vec![
            format!("http://{}/", a.addr()),
            format!("http://{}/", b.addr()),
        ],
        rate: 400.0,
        requests: 800,
        warmup: 40,
        timeout: Duration::from_secs(2),
        seed: 7,
    };
    let r = openloop::run(spec.clone()).await.unwrap();
    eprintln!("{r:?}");
    assert_eq!(r.requests, 800);
    assert_eq!(r.succeeded, 800, "{r:?}");
    assert_eq!(r.per_target.iter().sum::<u64>(), 800);
    // A fair coin per arrival: 400 +- 3 standard deviations (14.1).
    assert!(
        r.per_target.iter().all(|&n| (357..=443).contains(&n)),
        "{:?}",
        r.per_target
    );
    // 800 exponential gaps at 400/s: a span of 2 s +- 3 standard deviations (3.5 %).
    assert!((r.rate() / 400.0 - 1.0).abs() < 0.11, "{}", r.rate());
    // Every answer says what its work took: at least the 5 ms asked for, and no work waits
    // without a concurrency limit, so the latency is the service plus the round trip.
    assert_eq!(r.service.count, 800);
    assert!(
        r.service.p50 >= 5.0 && r.service.mean >= 5.0,
        "{:?}",
        r.service
    );
    assert!(
        r.latency.p50 >= r.service.p50,
        "{:?} {:?}",
        r.latency,
        r.service
    );
    for (i, ci) in r.latency_ci95.iter().enumerate() {
        let point = [r.latency.p50, r.latency.p99, r.latency.p999][i];
        assert!(ci[0] <= point && point <= ci[1], "{ci:?} {point}");
    }
    // The same seed draws the same targets.
    let again = openloop::run(spec).await.unwrap();
    assert_eq!(again.per_target, r.per_target);
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_side_open_loop_balances_probes_and_records_every_arrival() {
    // Three backends, one call at a time, exponential 5 ms; two clients with their own prequal
    // balancers at 150 arrivals/s (load 0.25).
    let cfg = BackendConfig {
        latency: Latency {
            mean: Duration::from_millis(5),
            dist: LatencyDist::Exponential,
        },
        concurrency: Some(1),
        precise_timer: true,
        ..BackendConfig::default()
    };
    let mut bs = Vec::new();
    for i in 0..3 {
        bs.push(
            backend::spawn_with_seed(any_port(), cfg.clone(), i)
                .await
                .unwrap(),
        );
    }
    let endpoints: Vec<SocketAddr> = bs.iter().map(|b| b.addr()).collect();
    let specs: Vec<EndpointSpec> = endpoints
        .iter()
        .map(|a| EndpointSpec::new(a.to_string()))
        .collect();
    let spec = OpenLoopSpec {
        targets: Vec::new(),
        rate: 150.0,
        requests: 300,
        warmup: 30,
        timeout: Duration::from_secs(2),
        seed: 3,
    };
    let clients = ClientSide {
        endpoints: endpoints.clone(),
        clients: 2,
        make_balancer: Arc::new(move |i| {
            let mut c = BalancerConfig::new(StrategyKind::Prequal);
            c.seed = i as u64;
            Balancer::new(c, &specs).unwrap()
        }),
        path: "/".into(),
        reports_on_answers: true,
    };
    let r = openloop::run_client_side(spec, clients).await.unwrap();
    assert_eq!((r.requests, r.succeeded), (300, 300), "{r:?}");
    assert_eq!(r.per_target.iter().sum::<u64>(), 300);
    // Prequal at low load ranks cold reports by latency: uneven, but every endpoint is used.
    assert!(r.per_target.iter().all(|&n| n > 0), "{:?}", r.per_target);
    // Every arrival is kept, warm-up first, each with its endpoint and its service time.
    assert_eq!(r.records.len(), 330);
    assert_eq!(r.records.iter().filter(|x| x.measured).count(), 300);
    assert!(!r.records[29].measured && r.records[30].measured);
    assert!(r.records.windows(2).all(|w| w[0].due_ms <= w[1].due_ms));
    for x in &r.records {
        assert_eq!(x.outcome, RecordOutcome::Ok);
        let t = x.target.expect("picked");
        assert_eq!(
            r.backends[x.backend.unwrap() as usize],
            endpoints[t].to_string()
        );
        assert!(x.service_ms.unwrap() >= 0.0);
    }
    // Prequal's probes: about 3 per pick, answered at once.
    let probes: u64 = bs.iter().map(|b| b.load_probes()).sum();
    assert!(probes >= 330 * 2, "{probes} probes");
    assert_eq!(r.probes.count + r.probe_failures, probes);
    assert!(r.probes.p50 < 5.0, "{:?}", r.probes);
    for b in bs {
        b.shutdown().await;
    }
}
