//! Latency overhead of the proxy against calling a backend directly: the same bounded load
//! (backend with no latency, keep-alive connections, loopback) run direct and through a
//! round-robin proxy over one endpoint, at concurrency 1 and 32.
//!
//! `cargo run --release -p keel-proxy --example proxy_overhead [-- REQUESTS]`
//!
//! `KEEL_OVERHEAD_CLUSTER` (optional): lines appended to the cluster's table, to measure what a
//! setting costs, e.g. `rate_limit = { rate = 1e9 }` or
//! `request_headers = { add = { x-a = "$client_ip" } }`.

use std::time::Duration;

use keel_proxy::ProxyConfig;
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::loadgen::{self, LoadSpec, Target};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let requests: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(5_000);
    let b = backend::spawn("127.0.0.1:0".parse()?, BackendConfig::default()).await?;
    let extra = std::env::var("KEEL_OVERHEAD_CLUSTER").unwrap_or_default();
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"one\"\n[[cluster]]\nname = \"one\"\nendpoints = [{{ address = \"{}\" }}]\n{extra}\n",
        b.addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "overhead")?).await?;
    let direct = format!("http://{}/", b.addr());
    let proxied = format!("http://{}/", proxy.listener_addrs()[0]);
    println!("{requests} GETs per run, 64-byte body, backend latency 0, loopback\n");
    println!("| concurrency | path | p50 | p90 | p99 | mean | requests/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for concurrency in [1usize, 32] {
        let mut means = Vec::new();
        for (name, url) in [("direct", &direct), ("proxy", &proxied)] {
            // Warm-up: connections, pools, caches.
            let mut warm = LoadSpec::new(Target::Url(url.clone()), 500);
            warm.concurrency = concurrency;
            loadgen::run(warm).await;
            let mut spec = LoadSpec::new(Target::Url(url.clone()), requests);
            spec.concurrency = concurrency;
            spec.timeout = Duration::from_secs(2);
            let r = loadgen::run(spec).await;
            assert_eq!(r.succeeded, r.requests, "{r}");
            println!(
                "| {concurrency} | {name} | {:.0?} | {:.0?} | {:.0?} | {:.0?} | {:.0} |",
                r.latency_p50,
                r.latency_p90,
                r.latency_p99,
                r.latency_mean,
                r.requests_per_second()
            );
            means.push((r.latency_p50, r.latency_mean));
        }
        println!(
            "| {concurrency} | overhead | {:.0?} | | | {:.0?} | |",
            means[1].0.saturating_sub(means[0].0),
            means[1].1.saturating_sub(means[0].1)
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
    b.shutdown().await;
    Ok(())
}
