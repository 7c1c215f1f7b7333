//! What a fleet costs etcd, measured on a three-member etcd on loopback: N = 1, 5, 10, 25, 50
//! keel proxies, each discovering cluster `api` from a prefix (one watcher) and sharing its
//! outlier evidence (a second watcher and a lease kept alive). At each N: etcd's CPU (the three
//! members' `process_cpu_seconds_total`) and memory (`process_resident_memory_bytes`) idle,
//! the watch events etcd sends per change of the prefix (`etcd_debugging_mvcc_events_total`),
//! and how long a change takes to reach every proxy's balancer; then what a lease keep-alive
//! costs etcd (1,000 leases kept alive every second). Not part of scripts/test-etcd.sh:
//! `bash scripts/etcd-scale.sh` (about three minutes). Prints `scale | ...` lines.

use std::time::{Duration, Instant};

use keel_proxy::ProxyHandle;
use keel_testbed::etcd::EtcdCluster;

use super::*;

const PREFIX: &str = "/keel/clusters/api/";
/// Changes per N (a key put, then deleted: each changes the set every proxy holds).
const CHANGES: usize = 40;
/// Idle measurement window per N.
const IDLE: Duration = Duration::from_secs(8);

/// The sum over the members of one metric (a counter or gauge without labels).
async fn metric(etcd: &EtcdCluster, name: &str) -> f64 {
    let mut sum = 0.0;
    for url in etcd.endpoints() {
        let text = get(&format!("{url}/metrics")).await.unwrap().text();
        sum += text
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{name} missing at {url}"));
    }
    sum
}

/// True when every proxy's `api` holds `addr` (or, with `present` false, does not).
fn all_see(proxies: &[ProxyHandle], addr: &str, present: bool) -> bool {
    proxies.iter().all(|p| {
        p.cluster_status("api")
            .unwrap()
            .iter()
            .any(|e| e.address == addr)
            == present
    })
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "about three minutes: run scripts/etcd-scale.sh"]
async fn scale_etcd_cost_by_watchers_measured() {
    let etcd = etcd3();
    let bs = backends(2, Duration::ZERO).await;
    let mut c = client_of(&etcd).await;
    put(&mut c, &format!("{PREFIX}b0"), &value(bs[0].addr()), None).await;
    let changing = bs[1].addr().to_string();
    let lines = format!(
        "discovery = {{ etcd = \"{PREFIX}\" }}\n[cluster.outlier_detection]\nshared = {{ quorum = 1 }}\n"
    );
    // etcd's own idle cost, before any proxy (heartbeats between the members).
    let cpu0 = metric(&etcd, "process_cpu_seconds_total").await;
    tokio::time::sleep(IDLE).await;
    let baseline = (metric(&etcd, "process_cpu_seconds_total").await - cpu0) / IDLE.as_secs_f64();
    println!(
        "scale | 0 | 0 | {:.1} | {:.0} | - | - | -",
        baseline * 100.0,
        metric(&etcd, "process_resident_memory_bytes").await / (1 << 20) as f64
    );
    println!(
        "scale | proxies | watchers | idle etcd CPU (% of a core, 3 members) | etcd RSS (MiB, 3 members) | events per change | etcd CPU per change (ms) | change seen by all: p50 / p90 / max (ms)"
    );
    let mut proxies: Vec<ProxyHandle> = Vec::new();
    for n in [1usize, 5, 10, 25, 50] {
        while proxies.len() < n {
            let name = format!("p{}", proxies.len());
            proxies.push(
                keel_proxy::start(config(&etcd, &name, &lines))
                    .await
                    .unwrap(),
            );
        }
        for p in &proxies {
            follows(p, "api", &[bs[0].addr()], Duration::from_secs(10)).await;
            let mut ok = false;
            for _ in 0..100 {
                if status(p).await["clusters"][0]["shared_evidence"]["connected"] == true {
                    ok = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert!(ok, "{}", status(p).await);
        }
        let watchers = metric(&etcd, "etcd_debugging_mvcc_watcher_total").await;
        // Idle: keep-alives, the discovery's linearizable check, HTTP/2 pings.
        let cpu0 = metric(&etcd, "process_cpu_seconds_total").await;
        tokio::time::sleep(IDLE).await;
        let idle = (metric(&etcd, "process_cpu_seconds_total").await - cpu0) / IDLE.as_secs_f64();
        let rss = metric(&etcd, "process_resident_memory_bytes").await / (1 << 20) as f64;
        // Changes: one key put then deleted, each waited for at every proxy.
        let events0 = metric(&etcd, "etcd_debugging_mvcc_events_total").await;
        let cpu0 = metric(&etcd, "process_cpu_seconds_total").await;
        let mut seen = Vec::with_capacity(CHANGES);
        for i in 0..CHANGES {
            let present = i % 2 == 0;
            let start = Instant::now();
            if present {
                put(&mut c, &format!("{PREFIX}b1"), &value(bs[1].addr()), None).await;
            } else {
                c.delete(format!("{PREFIX}b1"), None).await.unwrap();
            }
            loop {
                if all_see(&proxies, &changing, present) {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "change {i} not followed"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            seen.push(start.elapsed().as_secs_f64() * 1e3);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let events =
            (metric(&etcd, "etcd_debugging_mvcc_events_total").await - events0) / CHANGES as f64;
        let busy = metric(&etcd, "process_cpu_seconds_total").await - cpu0;
        // The changes' own CPU: what the window used above idle.
        let window = seen.iter().sum::<f64>() / 1e3 + 0.05 * CHANGES as f64;
        let per_change = (busy - idle * window).max(0.0) / CHANGES as f64 * 1e3;
        println!(
            "scale | {n} | {watchers:.0} | {:.1} | {rss:.0} | {events:.1} | {per_change:.2} | {:.1} / {:.1} / {:.1}",
            idle * 100.0,
            quantile(&mut seen, 0.5),
            quantile(&mut seen, 0.9),
            quantile(&mut seen, 1.0),
        );
        // Every watcher of the prefix gets the change: one event per proxy, per change.
        assert!(events >= n as f64, "N = {n}: {events} events per change");
    }
    for p in proxies {
        p.shutdown(Duration::from_millis(200)).await;
    }

    // A lease keep-alive's cost: 1,000 leases on one client, each kept alive once a second.
    const LEASES: usize = 1000;
    const ROUNDS: u32 = 10;
    let mut keepers = Vec::with_capacity(LEASES);
    for _ in 0..LEASES {
        let id = c.lease_grant(60, None).await.unwrap().id();
        keepers.push(c.lease_keep_alive(id).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu0 = metric(&etcd, "process_cpu_seconds_total").await;
    let start = Instant::now();
    for r in 0..ROUNDS {
        for (k, answers) in &mut keepers {
            k.keep_alive().await.unwrap();
            let a = answers.message().await.unwrap().unwrap();
            assert!(a.ttl() > 0);
        }
        tokio::time::sleep_until(tokio::time::Instant::from_std(
            start + Duration::from_secs(u64::from(r) + 1),
        ))
        .await;
    }
    let cpu = metric(&etcd, "process_cpu_seconds_total").await - cpu0;
    let took = start.elapsed().as_secs_f64();
    let per = (cpu - baseline * took).max(0.0) / (LEASES as f64 * f64::from(ROUNDS)) * 1e6;
    println!(
        "scale | keep-alives | {LEASES} leases x {ROUNDS} rounds in {took:.1} s | etcd CPU {:.1} % of a core ({:.1} % idle) | {per:.0} us of etcd CPU per keep-alive (3 members, above idle)",
        cpu / took * 100.0,
        baseline * 100.0
    );
}
