//! The open-loop generator over real loopback sockets: Poisson arrivals split over two backends,
//! and the backends' own service time read from their answers.

use std::net::SocketAddr;
use std::time::Duration;

use keel_model::vocab::Latency;
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::openloop::{self, OpenLoopSpec};

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
