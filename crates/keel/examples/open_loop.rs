//! Open-loop Poisson load over one or more URLs (keel-testbed's `openloop`), for scripts such as
//! scripts/herd.sh: prints one JSON object with what it measured.
//!
//!   cargo build --release -p keel --example open_loop
//!   target/release/examples/open_loop --target http://127.0.0.1:19700/ \
//!       --target http://127.0.0.1:19701/ --rate 800 --requests 20000 --warmup 2000
//!
//! Loopback or any reachable http:// URL; bounded: it sends warmup + requests arrivals and
//! stops, each request cut at --timeout.

use std::time::Duration;

use clap::Parser;
use keel_testbed::openloop::{self, OpenLoopSpec, Quantiles};

#[derive(Parser)]
struct Args {
    /// A URL to send to (repeat: each arrival goes to one drawn at random).
    #[arg(long = "target", required = true)]
    targets: Vec<String>,
    /// Arrivals per second over all targets.
    #[arg(long)]
    rate: f64,
    /// Measured requests.
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Arrivals sent first and not measured.
    #[arg(long, default_value_t = 2_000)]
    warmup: u64,
    /// Limit on one request, e.g. 2s.
    #[arg(long, default_value = "2s")]
    timeout: humantime::Duration,
    /// Seed of the arrival times and of the targets' draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn q(x: &Quantiles) -> serde_json::Value {
    serde_json::json!({
        "count": x.count, "mean": x.mean, "p50": x.p50, "p99": x.p99, "p999": x.p999, "max": x.max,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let spec = OpenLoopSpec {
        targets: args.targets,
        rate: args.rate,
        requests: args.requests,
        warmup: args.warmup,
        timeout: Duration::from(args.timeout),
        seed: args.seed,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = runtime.block_on(openloop::run(spec))?;
    let ci = |i: usize| r.latency_ci95[i];
    let out = serde_json::json!({
        "requests": r.requests,
        "succeeded": r.succeeded,
        "timeouts": r.timeouts,
        "errors": r.errors,
        "per_target": r.per_target,
        "rate": r.rate(),
        "elapsed_s": r.elapsed.as_secs_f64(),
        "latency_ms": q(&r.latency),
        "latency_ci95_ms": { "p50": ci(0), "p99": ci(1), "p999": ci(2) },
        "service_ms": q(&r.service),
        "lag_ms": q(&r.lag),
    });
    println!("{out}");
    Ok(())
}
