//! Shared outlier evidence (`[cluster.outlier_detection] shared = { quorum = 1 }`): each proxy
//! of a fleet publishes what it observed of each endpoint, and judges endpoints on the fleet's
//! outcomes (`Balancer::record_remote`), so that a failing endpoint costs the fleet about the
//! threshold in failed tries instead of the threshold times the number of proxies.
//!
//! Key layout: `/keel/evidence/<cluster>/<proxy name>`, bound to a lease of this proxy (TTL
//! [`LEASE_TTL`], kept alive): a proxy that dies takes its key with it. A key without a lease,
//! or on a lease that already carries another name's key, is no proxy's and is not counted:
//! a quorum is of proxies that hold a live lease each. Whoever may write under the prefix
//! with a lease of its own can still speak as a proxy: etcd's authentication (a role per
//! proxy, TLS client certificates) is the boundary (docs/configuration.md). Its value, rewritten as
//! soon as something failed (at most once per [`BATCH_EVERY`], one put at a time; and once
//! after, to carry the success that ends a run it published): `{"e": {"host:port": [f, s, t], ...}}`, per
//! endpoint the failures before the batch's last success, the successes, and the failures after
//! it (the run still going). The others watch the prefix and replay each batch in that order. While etcd cannot be reached, the
//! proxy judges on its own outcomes only (as without `shared`), and says so in `/status` and its
//! log; the outcomes of that time are not published later.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{EventType, PutOptions, WatchOptions};
use keel_balance::Outcome;

use crate::config::EtcdConfig;
use crate::control::etcd::{connect, escaped, explain, within, EtcdError};
use crate::metrics::evidence::{Batch, FAILED};
use crate::state::Shared;
use crate::upstream::evidence::Evidence;

/// Time between two publications of a proxy (a failure leaves at once if the last left at least
/// this long ago), and between two looks for successes to publish.
pub(crate) const BATCH_EVERY: Duration = Duration::from_millis(25);

/// The lease of a proxy's evidence key, in seconds: a dead proxy's evidence goes within this.
pub(crate) const LEASE_TTL: i64 = 5;

/// Most outcomes of one kind replayed from one batch of one endpoint (bounds the work a confused
/// or malicious proxy can cause; far above any threshold).
const MAX_REPLAY: u32 = 1000;

/// The etcd prefix of a cluster's evidence.
pub(crate) fn prefix(cluster: &str) -> String {
    format!("/keel/evidence/{cluster}/")
}

/// A batch as published: endpoint address to `[f, s, t]`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Published {
    e: BTreeMap<String, [u32; 3]>,
}

impl Shared {
    /// (Re)starts one evidence task per cluster with `shared` outlier detection.
    pub(crate) fn restart_evidence(&self) {
        let mut tasks = self
            .control
            .evidence_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for t in tasks.drain(..) {
            t.abort();
        }
        let config = self.config.load();
        let mut states = self
            .control
            .evidence
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut now = std::collections::HashMap::new();
        let (Some(etcd), Some(name)) = (&config.etcd, &config.name) else {
            *states = now;
            return;
        };
        for c in &config.clusters {
            let shares = c
                .protections
                .outlier_detection
                .as_ref()
                .is_some_and(|o| o.shared.is_some());
            if !shares {
                continue;
            }
            let st = states.get(&c.name).cloned().unwrap_or_default();
            now.insert(c.name.clone(), st.clone());
            tasks.push(self.runtime.spawn(run(
                self.me.clone(),
                c.name.clone(),
                name.clone(),
                etcd.clone(),
                st,
            )));
        }
        *states = now;
    }
}

/// A proxy's name as a source number for `record_remote` (never 0: that is the local source).
fn source_of(name: &str) -> u64 {
    keel_balance::hash_key(name.as_bytes()).max(1)
}

/// Exchanges evidence for `cluster` until aborted, reconnecting after each failure.
async fn run(me: Weak<Shared>, cluster: String, name: String, etcd: EtcdConfig, st: Arc<Evidence>) {
    loop {
        let e = session(&me, &cluster, &name, &etcd, &st)
            .await
            .for_config(&etcd);
        let was = st.state().connected;
        st.update(|s| {
            s.connected = false;
            s.last_error = Some(e.to_string());
        });
        if was {
            tracing::warn!(
                cluster,
                "shared evidence: etcd unreachable, judging on this proxy's own outcomes only: {e}"
            );
        }
        // Outcomes of the outage were judged locally; publishing them later would count them
        // twice at the others' and out of time.
        let until = tokio::time::Instant::now() + Duration::from_millis(500);
        while tokio::time::Instant::now() < until {
            let Some(shared) = me.upgrade() else { return };
            drain(&shared, &cluster);
            drop(shared);
            tokio::time::sleep(BATCH_EVERY).await;
        }
    }
}

/// Takes (and drops) the cluster's pending outcomes.
fn drain(shared: &Shared, cluster: &str) {
    let routing = shared.routing.load();
    if let Some(c) = routing.clusters.iter().find(|c| c.name() == cluster) {
        for e in &c.endpoints {
            e.metrics.evidence.take();
        }
    }
}

/// One connection: lease, watch, then evidence out and in until something fails. Publishing,
/// receiving and the lease's keep-alive run side by side, so that a put waiting for etcd's
/// quorum never holds back the replay of what the others published.
async fn session(
    me: &Weak<Shared>,
    cluster: &str,
    name: &str,
    etcd: &EtcdConfig,
    st: &Evidence,
) -> EtcdError {
    let t = etcd.dial_timeout;
    let mut client = match connect(etcd).await {
        Ok(c) => c,
        Err(e) => return e,
    };
    let lease = match within(t, client.lease_grant(LEASE_TTL, None)).await {
        Ok(l) => l.id(),
        Err(e) => return e,
    };
    let (keeper, kept) = match within(t, client.lease_keep_alive(lease)).await {
        Ok(k) => k,
        Err(e) => return e,
    };
    let prefix = prefix(cluster);
    let key = format!("{prefix}{name}");
    let watch = match within(
        t,
        client.watch(prefix.as_str(), Some(WatchOptions::new().with_prefix())),
    )
    .await
    {
        Ok(w) => w,
        Err(e) => return e,
    };
    let Some(shared) = me.upgrade() else {
        return EtcdError::WatchEnded("proxy stopped".into());
    };
    drain(&shared, cluster);
    drop(shared);
    st.update(|s| {
        s.connected = true;
        s.last_error = None;
        s.peers = 0;
    });
    tracing::info!(cluster, key, "shared evidence: publishing and watching");
    let options = PutOptions::new().with_lease(lease);
    tokio::select! {
        e = publish(me, cluster, &key, client, options, t, st) => e,
        e = receive(me, cluster, name, &prefix, watch, st) => e,
        e = keep_alive(lease, keeper, kept) => e,
    }
}

/// Publishes this proxy's outcomes until a put fails. A failure leaves at once (woken by
/// [`FAILED`]), unless the last put began less than [`BATCH_EVERY`] ago: then at that mark,
/// with whatever else failed meanwhile. Successes wait for the next [`BATCH_EVERY`] tick and
/// leave alone only to end a run of failures this proxy published. One put at a time (awaited here), so a proxy never
/// writes more than once per [`BATCH_EVERY`] nor faster than etcd answers: at most what
/// batching alone wrote, and a failure no longer waits for the batch.
async fn publish(
    me: &Weak<Shared>,
    cluster: &str,
    key: &str,
    mut client: etcd_client::Client,
    options: PutOptions,
    t: Duration,
    st: &Evidence,
) -> EtcdError {
    let mut tick = tokio::time::interval(BATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Endpoints whose run of failures this proxy published and no published success ended yet.
    let mut open: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut last_put: Option<tokio::time::Instant> = None;
    loop {
        // Registered before looking at the counters: a failure recorded after the look still
        // wakes this future (a `Notified` made before `notify_waiters` completes).
        let woken = FAILED.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        {
            let Some(shared) = me.upgrade() else {
                return EtcdError::WatchEnded("proxy stopped".into());
            };
            if !has_failures(&shared, cluster) {
                drop(shared);
                tokio::select! {
                    _ = &mut woken => {}
                    _ = tick.tick() => {}
                }
            }
        }
        if let Some(at) = last_put {
            tokio::time::sleep_until(at + BATCH_EVERY).await;
        }
        let Some(shared) = me.upgrade() else {
            return EtcdError::WatchEnded("proxy stopped".into());
        };
        let Some(out) = collect(&shared, cluster) else {
            continue;
        };
        drop(shared);
        let failed = out.e.values().any(|b| b[0] + b[2] > 0);
        // Successes alone matter only to end a run this proxy published: the others count the
        // rest of an endpoint's runs from their own outcomes.
        let ends_a_run = out.e.iter().any(|(a, b)| b[1] > 0 && open.contains(a));
        if !(failed || ends_a_run) {
            continue;
        }
        let value = serde_json::to_vec(&out).expect("a batch serializes");
        last_put = Some(tokio::time::Instant::now());
        if let Err(e) = within(t, client.put(key, value, Some(options.clone()))).await {
            return e;
        }
        st.published.fetch_add(1, Relaxed);
        for (a, b) in &out.e {
            if b[2] > 0 {
                open.insert(a.clone());
            } else if b[1] > 0 {
                open.remove(a);
            }
        }
    }
}

/// Keeps the evidence key's lease alive (every third of its TTL) until that fails.
async fn keep_alive(
    lease: i64,
    mut keeper: etcd_client::LeaseKeeper,
    mut kept: etcd_client::LeaseKeepAliveStream,
) -> EtcdError {
    let mut keep = tokio::time::interval(Duration::from_secs((LEASE_TTL as u64 / 3).max(1)));
    loop {
        tokio::select! {
            _ = keep.tick() => {
                if let Err(e) = keeper.keep_alive().await {
                    return explain(e);
                }
            }
            a = kept.message() => match a {
                Ok(Some(a)) if a.ttl() > 0 => {}
                Ok(Some(_)) => return EtcdError::LeaseExpired(lease),
                Ok(None) => return EtcdError::WatchEnded("keep-alive stream".into()),
                Err(e) => return explain(e),
            },
        }
    }
}

/// Replays the others' batches as the watch delivers them, until the watch fails.
async fn receive(
    me: &Weak<Shared>,
    cluster: &str,
    name: &str,
    prefix: &str,
    mut watch: etcd_client::WatchStream,
    st: &Evidence,
) -> EtcdError {
    let mut peers = std::collections::HashSet::new();
    // The lease each peer's key was attached to, by lease: one lease speaks for one proxy name
    // (two names written under one lease, in one transaction or not, are one writer).
    let mut names: std::collections::HashMap<i64, Vec<u8>> = std::collections::HashMap::new();
    loop {
        let m = match watch.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return EtcdError::WatchEnded("closed by etcd".into()),
            Err(e) => return explain(e),
        };
        if m.canceled() {
            return EtcdError::WatchEnded(m.cancel_reason().to_string());
        }
        let Some(shared) = me.upgrade() else {
            return EtcdError::WatchEnded("proxy stopped".into());
        };
        for ev in m.events() {
            let Some(kv) = ev.kv() else { continue };
            if ev.event_type() != EventType::Put {
                continue;
            }
            let Some(peer) = kv.key().strip_prefix(prefix.as_bytes()) else {
                continue;
            };
            if peer == name.as_bytes() {
                continue;
            }
            // A proxy's evidence key lives on its lease (kept alive, gone with the proxy): a
            // key written without one, or under a lease that already speaks for another name,
            // is no proxy's, and its outcomes do not count toward any quorum.
            let lease = kv.lease();
            let owner = names.entry(lease).or_insert_with(|| peer.to_vec());
            if lease == 0 || owner.as_slice() != peer {
                tracing::warn!(
                    cluster,
                    key = %escaped(kv.key()),
                    lease = format!("{lease:x}"),
                    "shared evidence: value skipped (its key is not on a lease of its own: not a proxy's)"
                );
                continue;
            }
            let Ok(batch) = serde_json::from_slice::<Published>(kv.value()) else {
                tracing::warn!(cluster, key = %escaped(kv.key()), "shared evidence: value skipped (not a batch)");
                continue;
            };
            let peer = escaped(peer).to_string();
            replay(&shared, cluster, &peer, &batch, st);
            if peers.insert(peer) {
                st.update(|s| s.peers = peers.len());
            }
            st.received.fetch_add(1, Relaxed);
        }
    }
}

/// True when an endpoint of the cluster has a failure not yet published.
fn has_failures(shared: &Shared, cluster: &str) -> bool {
    let routing = shared.routing.load();
    routing
        .clusters
        .iter()
        .find(|c| c.name() == cluster)
        .is_some_and(|c| c.endpoints.iter().any(|e| e.metrics.evidence.failed()))
}

/// The cluster's pending outcomes, taken; `None` when nothing happened.
fn collect(shared: &Shared, cluster: &str) -> Option<Published> {
    let routing = shared.routing.load();
    let c = routing.clusters.iter().find(|c| c.name() == cluster)?;
    let mut e = BTreeMap::new();
    for ep in &c.endpoints {
        let b = ep.metrics.evidence.take();
        if !b.is_empty() {
            e.insert(ep.authority.as_str().to_string(), [b.f, b.s, b.t]);
        }
    }
    (!e.is_empty()).then_some(Published { e })
}

/// Feeds a peer's batch to the cluster's balancer, in the order that keeps its runs.
fn replay(shared: &Shared, cluster: &str, peer: &str, batch: &Published, st: &Evidence) {
    let routing = shared.routing.load();
    let Some(c) = routing.clusters.iter().find(|c| c.name() == cluster) else {
        return;
    };
    let source = source_of(peer);
    let now = c.now();
    for (address, [f, s, t]) in &batch.e {
        let Some(ep) = c.endpoints.iter().find(|e| e.authority.as_str() == address) else {
            continue;
        };
        let b = Batch {
            f: *f,
            s: *s,
            t: *t,
        };
        let steps = [
            (Outcome::Failure, b.f),
            (Outcome::Success, b.s),
            (Outcome::Failure, b.t),
        ];
        for (outcome, n) in steps {
            for _ in 0..n.min(MAX_REPLAY) {
                if c.balancer.record_remote(ep.id, outcome, source, now) {
                    ep.metrics.ejections.fetch_add(1, Relaxed);
                    st.remote_ejections.fetch_add(1, Relaxed);
                    tracing::warn!(
                        cluster,
                        endpoint = %ep.authority,
                        peer,
                        "endpoint ejected by outlier detection on the fleet's evidence"
                    );
                }
            }
        }
    }
}
