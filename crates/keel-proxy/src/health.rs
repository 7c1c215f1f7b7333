//! Active HTTP health checks: every `interval`, `GET path` on each endpoint; `unhealthy_threshold`
//! failures in a row mark it down and `healthy_threshold` passes mark it up again, through
//! keel-balance's `set_healthy` (which starts a slow start on the way back up).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::header;
use hyper::http::uri::Scheme;
use hyper::{Request, Uri};
use tokio::task::JoinHandle;

use crate::body::UpstreamBody;
use crate::cluster::Cluster;

/// Starts one checker task per endpoint of the cluster (none without `[health_check]`).
pub fn spawn(cluster: &Arc<Cluster>, rt: &tokio::runtime::Handle) -> Vec<JoinHandle<()>> {
    if cluster.config.health_check.is_none() {
        return Vec::new();
    }
    (0..cluster.endpoints.len())
        .map(|i| rt.spawn(check_loop(cluster.clone(), i)))
        .collect()
}

/// One probe: true for a 2xx answer whose body arrives whole within the timeout.
async fn probe(cluster: &Cluster, index: usize) -> Result<(), String> {
    let hc = cluster
        .config
        .health_check
        .as_ref()
        .expect("checked by spawn");
    let entry = &cluster.endpoints[index];
    let mut p = hyper::http::uri::Parts::default();
    p.scheme = Some(Scheme::HTTP);
    p.authority = Some(entry.authority.clone());
    p.path_and_query = Some(hc.path.parse().map_err(|e| format!("bad path: {e}"))?);
    let uri = Uri::from_parts(p).map_err(|e| e.to_string())?;
    let req = Request::get(uri)
        .header(header::USER_AGENT, "keel-health-check")
        .body(UpstreamBody::Empty)
        .map_err(|e| e.to_string())?;
    let work = async {
        let resp = cluster
            .client
            .request(req)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let status = resp.status();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("status {status}"))
        }
    };
    match tokio::time::timeout(hc.timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(hc.timeout)
        )),
    }
}

async fn check_loop(cluster: Arc<Cluster>, index: usize) {
    let hc = cluster
        .config
        .health_check
        .clone()
        .expect("checked by spawn");
    let entry = &cluster.endpoints[index];
    let mut ticker = tokio::time::interval(hc.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut passes = 0u32;
    let mut fails = 0u32;
    loop {
        ticker.tick().await;
        let healthy = cluster
            .balancer
            .endpoints()
            .get(index)
            .is_some_and(|e| e.is_healthy());
        match probe(&cluster, index).await {
            Ok(()) => {
                entry.metrics.health_checks_passed.fetch_add(1, Relaxed);
                fails = 0;
                passes = passes.saturating_add(1);
                if !healthy && passes >= hc.healthy_threshold {
                    cluster.balancer.set_healthy(entry.id, true, cluster.now());
                    tracing::info!(cluster = cluster.name(), endpoint = %entry.authority, "health check: endpoint is healthy again");
                }
            }
            Err(cause) => {
                entry.metrics.health_checks_failed.fetch_add(1, Relaxed);
                passes = 0;
                fails = fails.saturating_add(1);
                if healthy && fails >= hc.unhealthy_threshold {
                    cluster.balancer.set_healthy(entry.id, false, cluster.now());
                    tracing::warn!(cluster = cluster.name(), endpoint = %entry.authority, %cause, "health check: endpoint marked unhealthy");
                }
            }
        }
    }
}
