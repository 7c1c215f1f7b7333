//! `discovery = { etcd = "/keel/clusters/api/" }` on a three-member etcd.

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::Client;
use keel_proxy::etcd::{register, Registration};
use keel_proxy::ProxyHandle;

use crate::*;

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
