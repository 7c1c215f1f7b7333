//! What a `keel backend` actually serves against what it was asked for: one backend (one call
//! at a time, exponential service) under open-loop Poisson arrivals, with tokio's timer and
//! with the precise one ([`keel_testbed::timer`]); prints the served mean, p50, p99 and the
//! squared coefficient of variation (1 for an exponential) of each.
//!
//!   cargo run --release -p keel-testbed --example served -- [MEAN_MS] [RATE] [REQUESTS]

use std::time::Duration;

use keel_model::vocab::{Latency, LatencyDist};
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::openloop::{self, OpenLoopSpec};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mean_ms: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10.0);
    let rate: f64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(50.0);
    let requests: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(1000);
    for precise in [false, true] {
        let cfg = BackendConfig {
            latency: Latency {
                mean: Duration::from_secs_f64(mean_ms / 1e3),
                dist: LatencyDist::Exponential,
            },
            concurrency: Some(1),
            precise_timer: precise,
            ..BackendConfig::default()
        };
        let b = backend::spawn_with_seed("127.0.0.1:0".parse().unwrap(), cfg, 1)
            .await
            .unwrap();
        let spec = OpenLoopSpec {
            targets: vec![format!("http://{}/", b.addr())],
            rate,
            requests,
            warmup: 10,
            timeout: Duration::from_secs(5),
            seed: 1,
        };
        let r = openloop::run(spec).await.unwrap();
        let served: Vec<f64> = r
            .records
            .iter()
            .filter(|x| x.measured)
            .filter_map(|x| x.service_ms)
            .collect();
        let n = served.len() as f64;
        let m = served.iter().sum::<f64>() / n;
        let var = served.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
        println!(
            "{:<13} asked exponential {mean_ms} ms: served mean {:.3} ms, p50 {:.3}, p99 {:.3}, SCV {:.3} (exponential: p50 {:.3}, p99 {:.3}); latency p50 {:.3} ms",
            if precise { "precise timer" } else { "tokio timer" },
            m,
            r.service.p50,
            r.service.p99,
            var / (m * m),
            mean_ms * 2f64.ln(),
            mean_ms * 100f64.ln(),
            r.latency.p50,
        );
        b.shutdown().await;
    }
}
