//! Load probes (`[cluster.probe]`) for a strategy that balances on the load endpoints report
//! (prequal): after a pick the balancer names a few endpoints; each gets `GET path` on a
//! connection of its own, in a task of its own, and the `x-keel-rif` / `x-keel-latency-us`
//! headers of its answer reach the balancer as a load report, received when it arrives. The
//! request that caused the probes does not wait for them.

use std::cell::RefCell;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use keel_balance::EndpointId;

use crate::upstream::cluster::{Cluster, MAX_PROBES_IN_FLIGHT};

thread_local! {
    /// The balancer's targets, reused between picks.
    static TARGETS: RefCell<Vec<EndpointId>> = const { RefCell::new(Vec::new()) };
}

/// Sends the probes the balancer wants after a pick made at `now`.
pub(crate) fn after_pick(cluster: &Arc<Cluster>, now: Duration) {
    if cluster.config.probe.probes_per_request == 0 {
        return;
    }
    TARGETS.with_borrow_mut(|targets| {
        targets.clear();
        cluster.balancer.probe_targets(now, targets);
        for &id in targets.iter() {
            let Some(index) = cluster.endpoints.iter().position(|e| e.id == id) else {
                continue;
            };
            if cluster.probes_in_flight.fetch_add(1, Relaxed) >= MAX_PROBES_IN_FLIGHT {
                cluster.probes_in_flight.fetch_sub(1, Relaxed);
                return;
            }
            tokio::spawn(probe(cluster.clone(), index));
        }
    });
}

/// One probe of endpoint `index`; its report, if any, goes to the balancer.
async fn probe(cluster: Arc<Cluster>, index: usize) {
    let entry = &cluster.endpoints[index];
    let p = &cluster.config.probe;
    let head = format!(
        "GET {} HTTP/1.1\r\nhost: {}\r\nuser-agent: keel-load-probe\r\nconnection: close\r\n\r\n",
        p.path, entry.authority
    );
    let work = async {
        let mut conn = entry.pool.connect().await.ok()?;
        crate::upstream::h1_client::exchange_head(&mut conn, head.as_bytes())
            .await
            .ok()
    };
    if let Ok(Some(answer)) = tokio::time::timeout(p.timeout, work).await {
        if let Some(report) = answer.load {
            cluster
                .balancer
                .report_load(entry.id, report, cluster.now());
        }
        // An ORCA report on the probe's answer counts too (zone routing by utilisation).
        if let Some(u) = answer.orca.filter(|_| cluster.uses_utilization) {
            cluster
                .balancer
                .report_utilization(entry.id, u, cluster.now());
        }
    }
    cluster.probes_in_flight.fetch_sub(1, Relaxed);
}
