//! `discovery = { etcd = "/keel/clusters/api/" }` on a three-member etcd.

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::Client;
use keel_proxy::etcd::{register, Registration};
use keel_proxy::ProxyHandle;

use super::*;

/// The discovery line docs/configuration.md shows.
const LINE: &str = r#"discovery = { etcd = "/keel/clusters/api/" }"#;
const PREFIX: &str = "/keel/clusters/api/";

/// A change in etcd reaches the proxy's balancer within this (a watch event, then a rebuild).
const FOLLOW_WITHIN: Duration = Duration::from_secs(2);

/// `n` requests through the proxy: all must be 200; returns the endpoints that answered.
async fn serve(proxy: &ProxyHandle, n: usize) -> BTreeSet<String> {
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let c = client();
    let mut seen = BTreeSet::new();
    for i in 0..n {
        let r = send(&c, hyper::Method::GET, &url, &[], b"").await.unwrap();
        assert_eq!(r.status, 200, "request {i}");
        seen.insert(r.header("x-keel-endpoint").unwrap().to_string());
    }
    seen
}

fn metric_value(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
        + key.len();
    text[at..]
        .trim_start()
        .lines()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn endpoints_registered_with_leases_are_followed_a_bad_value_skipped() {
    let etcd = etcd3();
    let bs = backends(5, Duration::ZERO).await;
    let addr = |i: usize| bs[i].addr();
    let mut c = client_of(&etcd).await;
    let lease = c.lease_grant(30, None).await.unwrap().id();
    put(&mut c, &format!("{PREFIX}b0"), &value(addr(0)), Some(lease)).await;
    put(
        &mut c,
        &format!("{PREFIX}b1"),
        &format!(
            "{{\"address\":\"{}\",\"weight\":2,\"zone\":\"a\",\"priority\":0}}",
            addr(1)
        ),
        Some(lease),
    )
    .await;
    // A bad value: logged with its key and skipped, the rest applied.
    put(&mut c, &format!("{PREFIX}broken"), "{\"weight\": 3}", None).await;

    let proxy = keel_proxy::start(config(&etcd, "p0", LINE)).await.unwrap();
    follows(&proxy, "api", &[addr(0), addr(1)], Duration::from_secs(5)).await;
    let weights: Vec<u32> = proxy
        .cluster_status("api")
        .unwrap()
        .iter()
        .map(|s| s.weight)
        .collect();
    assert!(weights.contains(&2), "{weights:?}");
    assert_eq!(serve(&proxy, 30).await.len(), 2);

    // An add, then a removal (the key deleted), each followed within FOLLOW_WITHIN.
    put(&mut c, &format!("{PREFIX}b2"), &value(addr(2)), Some(lease)).await;
    let took = follows(&proxy, "api", &[addr(0), addr(1), addr(2)], FOLLOW_WITHIN).await;
    println!("etcd discovery: add followed in {took:?}");
    assert_eq!(serve(&proxy, 30).await.len(), 3);
    c.delete(format!("{PREFIX}b0"), None).await.unwrap();
    let took = follows(&proxy, "api", &[addr(1), addr(2)], FOLLOW_WITHIN).await;
    println!("etcd discovery: removal followed in {took:?}");
    assert_eq!(serve(&proxy, 20).await.len(), 2);

    // A lease that is not kept alive: its endpoint goes when it expires (TTL 2 s).
    let short = c.lease_grant(2, None).await.unwrap().id();
    put(&mut c, &format!("{PREFIX}b3"), &value(addr(3)), Some(short)).await;
    follows(&proxy, "api", &[addr(1), addr(2), addr(3)], FOLLOW_WITHIN).await;
    let took = follows(
        &proxy,
        "api",
        &[addr(1), addr(2)],
        Duration::from_secs(2) + FOLLOW_WITHIN + Duration::from_secs(1),
    )
    .await;
    println!("etcd discovery: lease expiry followed in {took:?} after the put");

    // `keel register`'s loop: registered while it runs (lease kept alive past its TTL),
    // deregistered at once when stopped.
    let cfg = keel_proxy::config::EtcdConfig::new(etcd.endpoints());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let reg = Registration {
        address: addr(4).to_string(),
        weight: 1,
        zone: None,
        priority: 0,
    };
    let key = format!("{PREFIX}{}", addr(4));
    let task = tokio::spawn(async move {
        register(
            &cfg,
            &key,
            &reg,
            Duration::from_secs(2),
            async {
                let _ = stop_rx.await;
            },
            |_| {},
        )
        .await
    });
    follows(&proxy, "api", &[addr(1), addr(2), addr(4)], FOLLOW_WITHIN).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        endpoints(&proxy, "api").len(),
        3,
        "kept alive past its 2 s TTL"
    );
    stop_tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    let took = follows(&proxy, "api", &[addr(1), addr(2)], FOLLOW_WITHIN).await;
    println!("etcd discovery: deregistration followed in {took:?}");

    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    assert_eq!(d["kind"], "etcd", "{d}");
    assert_eq!(d["stale"], false, "{d}");
    assert_eq!(d["endpoints"], 2, "{d}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn with_etcd_down_the_last_set_serves_and_status_says_so_then_changes_follow_again() {
    let mut etcd = etcd3();
    let bs = backends(3, Duration::ZERO).await;
    let addr = |i: usize| bs[i].addr();
    {
        let mut c = client_of(&etcd).await;
        put(&mut c, &format!("{PREFIX}b0"), &value(addr(0)), None).await;
        put(&mut c, &format!("{PREFIX}b1"), &value(addr(1)), None).await;
    }
    let proxy = keel_proxy::start(config(&etcd, "p0", LINE)).await.unwrap();
    follows(&proxy, "api", &[addr(0), addr(1)], Duration::from_secs(5)).await;
    let admin = proxy.admin_addr().unwrap();
    let metrics = || async move {
        get(&format!("http://{admin}/metrics"))
            .await
            .unwrap()
            .text()
    };
    assert_eq!(
        metric_value(&metrics().await, "keel_discovery_stale{cluster=\"api\"}"),
        0.0
    );

    // Every member down: the proxy keeps serving the two, and says so.
    etcd.kill_all();
    let mut stale = false;
    for _ in 0..80 {
        let st = status(&proxy).await;
        if st["clusters"][0]["discovery"]["stale"] == true {
            stale = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        stale,
        "/status says stale within 8 s: {}",
        status(&proxy).await
    );
    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    assert!(d["last_error"].is_string(), "{d}");
    assert_eq!(d["endpoints"], 2, "{d}");
    let m = metrics().await;
    assert_eq!(
        metric_value(&m, "keel_discovery_stale{cluster=\"api\"}"),
        1.0
    );
    assert!(metric_value(&m, "keel_discovery_errors_total{cluster=\"api\"}") >= 1.0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(serve(&proxy, 40).await.len(), 2, "the last set serves");
    assert_eq!(endpoints(&proxy, "api").len(), 2);

    // Back: the proxy resumes its watch after the last revision it applied and follows changes.
    etcd.restart_all().unwrap();
    let mut c = client_of(&etcd).await;
    put(&mut c, &format!("{PREFIX}b2"), &value(addr(2)), None).await;
    c.delete(format!("{PREFIX}b0"), None).await.unwrap();
    let took = follows(&proxy, "api", &[addr(1), addr(2)], Duration::from_secs(10)).await;
    println!("etcd discovery: followed again {took:?} after etcd came back");
    let mut fresh = false;
    for _ in 0..50 {
        if status(&proxy).await["clusters"][0]["discovery"]["stale"] == false {
            fresh = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(fresh, "{}", status(&proxy).await);
    assert_eq!(
        metric_value(&metrics().await, "keel_discovery_stale{cluster=\"api\"}"),
        0.0
    );
    assert_eq!(serve(&proxy, 20).await.len(), 2);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn a_watch_compacted_away_reads_the_prefix_again_and_converges() {
    let mut etcd = etcd3();
    let bs = backends(3, Duration::ZERO).await;
    let addr = |i: usize| bs[i].addr();
    let before = {
        let mut c = client_of(&etcd).await;
        put(&mut c, &format!("{PREFIX}b0"), &value(addr(0)), None).await;
        c.put(format!("{PREFIX}b1"), value(addr(1)), None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision()
    };
    // The proxy reaches member 0 only: stopping it cuts the proxy's watch off while the other
    // two members go on writing.
    let proxy = keel_proxy::start(config_of(&etcd.endpoints()[..1], "p0", LINE))
        .await
        .unwrap();
    follows(&proxy, "api", &[addr(0), addr(1)], Duration::from_secs(5)).await;
    etcd.stop(0);
    let mut stale = false;
    for _ in 0..100 {
        if status(&proxy).await["clusters"][0]["discovery"]["stale"] == true {
            stale = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(stale, "{}", status(&proxy).await);

    // Meanwhile: b2 added, b0 removed, 300 other revisions, and everything up to now compacted
    // (retried while members 1 and 2 elect a leader, if member 0 led).
    let mut c = Client::connect(&etcd.endpoints()[1..], None).await.unwrap();
    let mut last = 0;
    for i in 0..302 {
        let mut tries = 0;
        last = loop {
            let op = async {
                let r = match i {
                    0 => c
                        .put(format!("{PREFIX}b2"), value(addr(2)), None)
                        .await?
                        .header()
                        .cloned(),
                    1 => c
                        .delete(format!("{PREFIX}b0"), None)
                        .await?
                        .header()
                        .cloned(),
                    _ => c
                        .put("/elsewhere/noise", format!("{i}"), None)
                        .await?
                        .header()
                        .cloned(),
                };
                Ok::<_, etcd_client::Error>(r.map_or(0, |h| h.revision()))
            };
            match tokio::time::timeout(Duration::from_secs(2), op).await {
                Ok(Ok(r)) => break r,
                other => {
                    tries += 1;
                    assert!(tries < 20, "write {i}: {other:?}");
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        };
    }
    c.compact(
        last,
        Some(etcd_client::CompactionOptions::new().with_physical()),
    )
    .await
    .unwrap();
    etcd.resume(0);

    let took = follows(&proxy, "api", &[addr(1), addr(2)], Duration::from_secs(15)).await;
    println!("etcd discovery: converged {took:?} after the member came back past a compaction");
    // The premise: a watch from after the proxy's last revision is refused as compacted.
    let mut m0 = Client::connect(&etcd.endpoints()[..1], None).await.unwrap();
    let mut w = m0
        .watch(
            PREFIX,
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(before + 1),
            ),
        )
        .await
        .unwrap();
    let mut compacted = 0;
    for _ in 0..3 {
        match tokio::time::timeout(Duration::from_secs(2), w.message()).await {
            Ok(Ok(Some(m))) if m.compact_revision() > 0 => {
                compacted = m.compact_revision();
                break;
            }
            Ok(Ok(Some(_))) => continue,
            other => panic!("{other:?}"),
        }
    }
    assert!(
        compacted > before,
        "compacted at {compacted}, proxy's last {before}"
    );
    let mut fresh = false;
    for _ in 0..50 {
        if status(&proxy).await["clusters"][0]["discovery"]["stale"] == false {
            fresh = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(fresh, "{}", status(&proxy).await);
    assert_eq!(serve(&proxy, 20).await.len(), 2);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Runs `etcdctl` with `args`; panics with its output when it fails.
fn etcdctl(args: &[&str]) {
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(args)
        .output()
        .expect("etcdctl (Debian's etcd-client) runs");
    assert!(
        out.status.success(),
        "etcdctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn a_store_restored_from_a_snapshot_is_followed_without_a_restart() {
    let mut etcd = etcd3();
    let bs = backends(4, Duration::ZERO).await;
    let addr = |i: usize| bs[i].addr();
    let mut c = client_of(&etcd).await;
    put(&mut c, &format!("{PREFIX}b0"), &value(addr(0)), None).await;
    put(&mut c, &format!("{PREFIX}b1"), &value(addr(1)), None).await;
    let proxy = keel_proxy::start(config(&etcd, "p0", LINE)).await.unwrap();
    follows(&proxy, "api", &[addr(0), addr(1)], Duration::from_secs(5)).await;
    let snap = etcd.dir().join("snap.db");
    let first = etcd.endpoints()[0].clone();
    etcdctl(&[
        "--endpoints",
        &first,
        "snapshot",
        "save",
        snap.to_str().unwrap(),
    ]);
    // More writes after the snapshot: the proxy's revision moves past the snapshot's.
    for i in 0..20 {
        put(&mut c, &format!("{PREFIX}churn"), &value(addr(3)), None).await;
        if i % 2 == 1 {
            c.delete(format!("{PREFIX}churn"), None).await.unwrap();
        }
    }
    c.delete(format!("{PREFIX}churn"), None).await.unwrap();
    put(&mut c, &format!("{PREFIX}b2"), &value(addr(2)), None).await;
    c.delete(format!("{PREFIX}b0"), None).await.unwrap();
    follows(&proxy, "api", &[addr(1), addr(2)], FOLLOW_WITHIN).await;
    let members = c.member_list().await.unwrap();
    let initial: Vec<String> = members
        .members()
        .iter()
        .map(|m| format!("{}={}", m.name(), m.peer_urls()[0]))
        .collect();
    drop(c);
    // Every member stopped, its data replaced by the snapshot, started on the same ports.
    etcd.kill_all();
    for m in members.members() {
        let dir = etcd.dir().join(m.name());
        std::fs::remove_dir_all(&dir).unwrap();
        etcdctl(&[
            "snapshot",
            "restore",
            snap.to_str().unwrap(),
            "--name",
            m.name(),
            "--data-dir",
            dir.to_str().unwrap(),
            "--initial-cluster",
            &initial.join(","),
            "--initial-cluster-token",
            "keel-test",
            "--initial-advertise-peer-urls",
            &m.peer_urls()[0],
        ]);
    }
    etcd.restart_all().unwrap();
    let back = std::time::Instant::now();
    let took = follows(&proxy, "api", &[addr(0), addr(1)], Duration::from_secs(6)).await;
    println!("etcd discovery: the restored store followed {took:?} after its members answered");
    // And the writes after the restore (revisions the proxy had seen before) are followed.
    let mut c = client_of(&etcd).await;
    put(&mut c, &format!("{PREFIX}b3"), &value(addr(3)), None).await;
    follows(&proxy, "api", &[addr(0), addr(1), addr(3)], FOLLOW_WITHIN).await;
    assert!(back.elapsed() < Duration::from_secs(10));
    let st = status(&proxy).await;
    assert_eq!(st["clusters"][0]["discovery"]["stale"], false, "{st}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn one_member_restarted_at_a_time_never_makes_the_set_stale() {
    let mut etcd = etcd3();
    let bs = backends(1, Duration::ZERO).await;
    {
        let mut c = client_of(&etcd).await;
        put(&mut c, &format!("{PREFIX}b0"), &value(bs[0].addr()), None).await;
    }
    let proxy = keel_proxy::start(config(&etcd, "p0", LINE)).await.unwrap();
    follows(&proxy, "api", &[bs[0].addr()], Duration::from_secs(5)).await;
    // Each follower in turn (one of them is the proxy's, it watches through one member):
    // killed for 3 s, then started again. The two others keep the leader and quorum
    // throughout, so etcd answers all along: the set is never stale.
    let leader = etcd.leader().expect("a leader");
    let stale = || async { status(&proxy).await["clusters"][0]["discovery"]["stale"] == true };
    let mut stale_polls = Vec::new();
    for i in (0..etcd.len()).filter(|i| *i != leader) {
        etcd.kill(i);
        let mut n = 0;
        for _ in 0..30 {
            n += u32::from(stale().await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        etcd.restart_all().unwrap();
        for _ in 0..10 {
            n += u32::from(stale().await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stale_polls.push(n);
    }
    println!("each follower restarted: /status said stale in {stale_polls:?} of 40 polls each");
    assert!(
        stale_polls.iter().all(|n| *n == 0),
        "{stale_polls:?}: {}",
        status(&proxy).await
    );
    // The watch still follows.
    let mut c = client_of(&etcd).await;
    c.delete(format!("{PREFIX}b0"), None).await.unwrap();
    let b1 = backends(1, Duration::ZERO).await;
    put(&mut c, &format!("{PREFIX}b1"), &value(b1[0].addr()), None).await;
    follows(&proxy, "api", &[b1[0].addr()], FOLLOW_WITHIN).await;
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd-server: run scripts/test-etcd.sh"]
async fn ready_waits_for_discoverys_first_endpoints_and_own_addresses_are_skipped() {
    let etcd = etcd3();
    let bs = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(config(&etcd, "p0", LINE)).await.unwrap();
    let admin = proxy.admin_addr().unwrap();
    let ready = || async move { get(&format!("http://{admin}/ready")).await.unwrap() };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = ready().await;
    assert_eq!(
        r.status,
        503,
        "ready with no endpoint discovered: {}",
        r.text()
    );
    assert!(r.text().contains("api"), "{}", r.text());
    // Endpoints at the proxy's own listener and admin: skipped (a loop), with a real one.
    let mut c = client_of(&etcd).await;
    let own = proxy.listener_addrs()[0];
    put(&mut c, &format!("{PREFIX}self"), &value(own), None).await;
    put(&mut c, &format!("{PREFIX}admin"), &value(admin), None).await;
    put(&mut c, &format!("{PREFIX}b0"), &value(bs[0].addr()), None).await;
    follows(&proxy, "api", &[bs[0].addr()], Duration::from_secs(3)).await;
    let ok = {
        let mut ok = false;
        for _ in 0..30 {
            if ready().await.status == 200 {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ok
    };
    assert!(
        ok,
        "not ready once endpoints arrived: {}",
        ready().await.text()
    );
    assert_eq!(serve(&proxy, 10).await.len(), 1);
    // No change for 3 s: `last_refresh` is the last contact (the 2 s check), `last_change`
    // the last change.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let st = status(&proxy).await;
    let d = &st["clusters"][0]["discovery"];
    let refreshed = d["last_refresh_ago_s"].as_f64().unwrap();
    assert!(refreshed <= 2.5, "last_refresh is the last contact: {d}");
    assert_ne!(d["last_change"], d["last_refresh"], "{d}");
    proxy.shutdown(Duration::from_secs(1)).await;
}
