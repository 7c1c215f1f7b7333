//! Every 5xx an endpoint sends is evidence against it, retried or not: with nothing but the
//! defaults (500 is not in `retry_on_status`), one endpoint of five answering 500 at once is
//! ejected by outlier detection and avoided by the latency-aware strategies, so that requests
//! of 3 sequential calls keep succeeding. Before, its instant 500 finished each pick as a fast
//! success: round-robin kept sending it a fifth of the calls (success near 0.8^3 = 0.512) and
//! least-connections most of them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use keel_model::vocab::FailureMode;

use crate::support::*;

/// Requests per strategy, each of `CALLS` sequential calls, from `WORKERS` clients at once.
const REQUESTS: u64 = 1500;
const CALLS: usize = 3;
const WORKERS: u64 = 8;

/// What one strategy came to.
struct Run {
    strategy: &'static str,
    success: f64,
    ejected: bool,
    /// The failing endpoint's share of the tries.
    failing_share: f64,
    failing_counts: (u64, u64),
}

async fn run(strategy: &'static str) -> Run {
    let bs = backends(5, Duration::from_millis(2)).await;
    fault(&bs[4], FailureMode::SERVER_ERROR_AT_ONCE).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start(simple_config(&addrs, strategy, ""))
        .await
        .unwrap();
    let url = Arc::new(format!("http://{}/", proxy.listener_addrs()[0]));
    let next = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let (url, next, ok) = (url.clone(), next.clone(), ok.clone());
        workers.push(tokio::spawn(async move {
            let c = client();
            while next.fetch_add(1, Relaxed) < REQUESTS {
                let mut good = true;
                for _ in 0..CALLS {
                    let r = send(&c, hyper::Method::GET, &url, &[], b"").await;
                    if !r.is_ok_and(|r| r.status == 200) {
                        good = false;
                        break;
                    }
                }
                if good {
                    ok.fetch_add(1, Relaxed);
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let status = proxy.cluster_status("app").unwrap();
    let failing = status
        .iter()
        .find(|s| s.address == addrs[4].to_string())
        .unwrap();
    let tries: u64 = status.iter().map(|s| s.successes + s.failures).sum();
    let run = Run {
        strategy,
        success: ok.load(Relaxed) as f64 / REQUESTS as f64,
        ejected: failing.ejected_until.is_some(),
        failing_share: (failing.successes + failing.failures) as f64 / tries.max(1) as f64,
        failing_counts: (failing.successes, failing.failures),
    };
    proxy.shutdown(Duration::from_millis(200)).await;
    for b in bs {
        b.shutdown().await;
    }
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_500_at_once_is_ejected_and_requests_succeed_with_the_defaults() {
    let mut runs = Vec::new();
    for strategy in [
        "round-robin",
        "least-connections",
        "peak-ewma",
        "random",
        "least-request",
        "least-time",
        "maglev",
    ] {
        runs.push(run(strategy).await);
    }
    let table: String = runs
        .iter()
        .map(|r| {
            format!(
                "\n{:<18} success {:.4}  ejected {:<5}  failing endpoint: {:.4} of tries, \
                 (successes, failures) {:?}",
                r.strategy, r.success, r.ejected, r.failing_share, r.failing_counts
            )
        })
        .collect();
    eprintln!("{table}");
    for r in &runs {
        // Every 500 is a failure for the balancer, never a success.
        assert_eq!(r.failing_counts.0, 0, "{table}");
        assert!(r.failing_counts.1 >= 1, "{table}");
        // The calls before the ejection (5 failures in a row, and those already in flight)
        // are all that fails: at most 15 requests of 1,500.
        assert!(r.success >= 0.99, "{table}");
        // Ejected by outlier detection, or (the latency-aware strategies, whose estimate
        // of the endpoint the failures made 1 s long) avoided before it failed 5 in a row.
        let avoided = matches!(r.strategy, "peak-ewma" | "least-time") && r.failing_share < 0.01;
        assert!(r.ejected || avoided, "{table}");
    }
}
