//! Shared outlier evidence: three proxies on a three-member etcd in front of three endpoints, one
//! failing fast (503 at once). The fleet's failed tries at that endpoint (summed over the
//! proxies' counts) with `shared = { quorum = 1 }` against local detection, for traffic dealt to
//! the proxies in turn, spread at random, and in blocks (one proxy after another). The
//! bound: shared pays at most half of local.

use std::time::Duration;

use keel_model::FailureMode;
use keel_proxy::ProxyHandle;
use keel_testbed::etcd::EtcdCluster;

use super::*;

/// Requests per run, fixed.
const REQUESTS: usize = 150;
/// Time between two requests (the whole fleet's), so that evidence has time to travel as it
/// would under moderate traffic.
const PACE: Duration = Duration::from_millis(10);

/// How the fleet's requests reach its proxies.
#[derive(Clone, Copy, Debug)]
pub enum Arrival {
    /// Request i goes to proxy i mod N (round-robin DNS, an L4 balancer): keel-model's in turn.
    InTurn,
    /// Each request to a proxy drawn at random (seeded): keel-model's spread.
    Spread,
    /// The first requests/N go to proxy 0, the next to proxy 1, ...: one proxy after another.
    Blocks,
}

/// Runs the fleet once (round-robin picks, requests PACE apart); returns the failed tries at the
/// failing endpoint, summed over the proxies.
pub async fn fleet_failed_tries(
    etcd: &EtcdCluster,
    n: usize,
    shared: bool,
    arrival: Arrival,
    requests: usize,
) -> u64 {
    let bs = backends(3, Duration::ZERO).await;
    fault(
        &bs[0],
        FailureMode::FailFast {
            after: Duration::ZERO,
        },
    )
    .await;
    let eps: Vec<String> = bs
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    let lines = format!(
        "strategy = \"round-robin\"\nendpoints = [{}]\n[cluster.outlier_detection]\nconsecutive_failures = 5\nmax_ejection_percent = 34\n{}",
        eps.join(", "),
        if shared { "shared = { quorum = 1 }\n" } else { "" }
    );
    let mut proxies: Vec<ProxyHandle> = Vec::new();
    for i in 0..n {
        proxies.push(
            keel_proxy::start(config(etcd, &format!("p{i}"), &lines))
                .await
                .unwrap(),
        );
    }
    if shared {
        for p in &proxies {
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
    }
    let c = client();
    let urls: Vec<String> = proxies
        .iter()
        .map(|p| format!("http://{}/", p.listener_addrs()[0]))
        .collect();
    let per = requests.div_ceil(n);
    let mut tick = tokio::time::interval(PACE);
    let mut pick = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(7 ^ 0x5eed);
    for i in 0..requests {
        tick.tick().await;
        let p = match arrival {
            Arrival::InTurn => i % n,
            Arrival::Spread => rand::Rng::gen_range(&mut pick, 0..n),
            Arrival::Blocks => (i / per).min(n - 1),
        };
        let r = send(&c, hyper::Method::GET, &urls[p], &[], b"")
            .await
            .unwrap();
        assert!(r.status == 200 || r.status == 503, "{}", r.status);
    }
    // Evidence still on its way when the last request ended (at most a put and a batch).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let failing = bs[0].addr().to_string();
    let mut failed = 0;
    for p in &proxies {
        let s = p.cluster_status("api").unwrap();
        failed += s
            .iter()
            .find(|e| e.address == failing)
            .map_or(0, |e| e.failures);
    }
    for p in proxies {
        p.shutdown(Duration::from_millis(200)).await;
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn a_fleet_of_three_sharing_evidence_pays_at_most_half_the_failed_tries_of_local_detection() {
    let etcd = etcd3();
    for arrival in [Arrival::InTurn, Arrival::Spread, Arrival::Blocks] {
        let local = fleet_failed_tries(&etcd, 3, false, arrival, REQUESTS).await;
        let shared = fleet_failed_tries(&etcd, 3, true, arrival, REQUESTS).await;
        println!("fleet of 3, {arrival:?}: failed tries local {local}, shared {shared}");
        // Local: each proxy learns alone, 5 failures each.
        assert!((13..=17).contains(&local), "{arrival:?}: local {local}");
        assert!(
            shared * 2 <= local,
            "{arrival:?}: shared {shared} > half of local {local}"
        );
        assert!(
            shared >= 5,
            "{arrival:?}: shared {shared} below the threshold"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn without_etcd_shared_evidence_falls_back_to_local_detection_and_says_so() {
    let mut etcd = etcd3();
    let bs = backends(3, Duration::ZERO).await;
    let eps: Vec<String> = bs
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    let lines = format!(
        "strategy = \"round-robin\"\nendpoints = [{}]\n[cluster.outlier_detection]\nconsecutive_failures = 5\nmax_ejection_percent = 34\nshared = {{ quorum = 1 }}\n",
        eps.join(", ")
    );
    let proxy = keel_proxy::start(config(&etcd, "p0", &lines))
        .await
        .unwrap();
    let connected =
        |v: &serde_json::Value| v["clusters"][0]["shared_evidence"]["connected"] == true;
    let mut ok = false;
    for _ in 0..100 {
        if connected(&status(&proxy).await) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok);
    etcd.kill_all();
    let mut local = false;
    for _ in 0..100 {
        let st = status(&proxy).await;
        if !connected(&st) {
            let ev = &st["clusters"][0]["shared_evidence"];
            assert!(ev["last_error"].is_string(), "{ev}");
            assert!(ev["mode"].as_str().unwrap().contains("local only"), "{ev}");
            local = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(local, "{}", status(&proxy).await);
    // Local detection still ejects: 5 failures in a row at b0.
    fault(
        &bs[0],
        FailureMode::FailFast {
            after: Duration::ZERO,
        },
    )
    .await;
    let c = client();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    for _ in 0..60 {
        send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
    }
    let s = proxy.cluster_status("api").unwrap();
    let b0 = s
        .iter()
        .find(|e| e.address == bs[0].addr().to_string())
        .unwrap();
    assert_eq!(b0.failures, 5, "ejected after its own 5 failures");
    assert!(b0.ejected_until.is_some());
    // Back: exchanging again.
    etcd.restart_all().unwrap();
    let mut back = false;
    for _ in 0..150 {
        if connected(&status(&proxy).await) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "{}", status(&proxy).await);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Sends requests through `proxy` until `n` more of them failed at `failing` (round robin over
/// three endpoints: every third); returns the proxy's failures there.
async fn fail_through(proxy: &ProxyHandle, failing: &str, n: u64) -> u64 {
    let failures = || {
        proxy
            .cluster_status("api")
            .unwrap()
            .iter()
            .find(|e| e.address == failing)
            .map_or(0, |e| e.failures)
    };
    let want = failures() + n;
    let c = client();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    for _ in 0..3 * n + 3 {
        if failures() >= want {
            break;
        }
        send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
    }
    failures()
}

/// True when `proxy` has ejected `failing`.
fn ejected(proxy: &ProxyHandle, failing: &str) -> bool {
    proxy
        .cluster_status("api")
        .unwrap()
        .iter()
        .find(|e| e.address == failing)
        .is_some_and(|e| e.ejected_until.is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn with_quorum_two_one_proxys_evidence_alone_does_not_eject_two_proxies_do() {
    let etcd = etcd3();
    let bs = backends(3, Duration::ZERO).await;
    fault(
        &bs[0],
        FailureMode::FailFast {
            after: Duration::ZERO,
        },
    )
    .await;
    let failing = bs[0].addr().to_string();
    let eps: Vec<String> = bs
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    let lines = format!(
        "strategy = \"round-robin\"\nendpoints = [{}]\n[cluster.outlier_detection]\nconsecutive_failures = 5\nmax_ejection_percent = 34\nshared = {{ quorum = 2 }}\n",
        eps.join(", ")
    );
    let mut proxies = Vec::new();
    for i in 0..3 {
        proxies.push(
            keel_proxy::start(config(&etcd, &format!("p{i}"), &lines))
                .await
                .unwrap(),
        );
    }
    for p in &proxies {
        assert!(wait_connected(p).await, "{}", status(p).await);
    }
    // Ten failures in a row, all seen by p0: twice the threshold, one source.
    assert_eq!(fail_through(&proxies[0], &failing, 10).await, 10);
    for p in &proxies[1..] {
        let mut got = false;
        for _ in 0..50 {
            let st = status(p).await;
            if st["clusters"][0]["shared_evidence"]["received"].as_u64() > Some(0) {
                got = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(got, "p0's evidence reached the others: {}", status(p).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, p) in proxies.iter().enumerate() {
        assert!(
            !ejected(p, &failing),
            "p{i} ejected on one proxy's evidence alone"
        );
    }
    // One failure at p1: a second source in the same run, and every proxy ejects.
    assert_eq!(fail_through(&proxies[1], &failing, 1).await, 1);
    for (i, p) in proxies.iter().enumerate() {
        let ok = eventually(Duration::from_secs(3), || ejected(p, &failing)).await;
        assert!(
            ok,
            "p{i} did not eject on two proxies' evidence: {}",
            status(p).await
        );
    }
    for p in proxies {
        p.shutdown(Duration::from_millis(200)).await;
    }
}

/// Waits (at most 5 s) until `proxy` exchanges evidence through etcd.
async fn wait_connected(proxy: &ProxyHandle) -> bool {
    for _ in 0..100 {
        if status(proxy).await["clusters"][0]["shared_evidence"]["connected"] == true {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn evidence_under_invented_names_without_a_lease_of_their_own_ejects_nothing() {
    let etcd = etcd3();
    let bs = backends(3, Duration::ZERO).await;
    let healthy = bs[0].addr().to_string();
    let eps: Vec<String> = bs
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    let lines = format!(
        "strategy = \"round-robin\"\nendpoints = [{}]\n[cluster.outlier_detection]\nconsecutive_failures = 5\nmax_ejection_percent = 34\nshared = {{ quorum = 2 }}\n",
        eps.join(", ")
    );
    let proxy = keel_proxy::start(config(&etcd, "p0", &lines))
        .await
        .unwrap();
    assert!(wait_connected(&proxy).await, "{}", status(&proxy).await);
    let batch = format!("{{\"e\":{{\"{healthy}\":[0,0,10]}}}}");
    let mut c = client_of(&etcd).await;
    use etcd_client::{Txn, TxnOp};
    // Two invented proxies in one write, no lease: no proxy's.
    let key = |n: &str| format!("/keel/evidence/api/{n}");
    let forged = Txn::new().and_then([
        TxnOp::put(key("x1"), batch.clone(), None),
        TxnOp::put(key("x2"), batch.clone(), None),
    ]);
    c.txn(forged).await.unwrap();
    // Two names on one lease: one writer, not two proxies.
    let lease = c.lease_grant(30, None).await.unwrap().id();
    let on_one = etcd_client::PutOptions::new().with_lease(lease);
    let forged = Txn::new().and_then([
        TxnOp::put(key("y1"), batch.clone(), Some(on_one.clone())),
        TxnOp::put(key("y2"), batch.clone(), Some(on_one)),
    ]);
    c.txn(forged).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let st = status(&proxy).await;
    assert!(
        !ejected(&proxy, &healthy),
        "a healthy endpoint ejected on forged evidence: {st}"
    );
    // y1, the first name on its lease, counts as one proxy: one more name on a lease of its
    // own makes the two that quorum 2 needs.
    let own = c.lease_grant(30, None).await.unwrap().id();
    let opts = etcd_client::PutOptions::new().with_lease(own);
    c.put(key("z1"), batch, Some(opts)).await.unwrap();
    let ok = eventually(Duration::from_secs(3), || ejected(&proxy, &healthy)).await;
    assert!(
        ok,
        "two leased names are two proxies: {}",
        status(&proxy).await
    );
    proxy.shutdown(Duration::from_millis(200)).await;
}
