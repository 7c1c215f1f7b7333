//! Active health checks: every `interval`, a probe of each endpoint (`GET path` by default, a TCP
//! connect, or gRPC's `grpc.health.v1.Health/Check`, by `kind`); `unhealthy_threshold`
//! failures in a row mark it down and `healthy_threshold` passes mark it up again, through
//! keel-balance's `set_healthy` (which starts a slow start on the way back up).
//!
//! Each probe opens its own connection (TCP, then TLS for a cluster with `[cluster.tls]`), as
//! the request path opens them but never pooled, so a probe tests that a new connection can be
//! made, and the checks do not depend on the request path's idle connections.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::config::{HealthCheckConfig, HealthCheckKind, UpstreamProtocol};
use crate::control::health_error::CheckFailed;
use crate::upstream::cluster::{Cluster, EndpointEntry};

/// Starts one checker task per endpoint of the cluster (none without `[health_check]`), and
/// with outlier detection a task that logs ejections as they end.
pub fn spawn(cluster: &Arc<Cluster>, rt: &tokio::runtime::Handle) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    if cluster.config.protections.health_check.is_some() {
        tasks
            .extend((0..cluster.endpoints.len()).map(|i| rt.spawn(check_loop(cluster.clone(), i))));
    }
    if cluster.config.protections.outlier_detection.is_some() {
        tasks.push(rt.spawn(watch_ejections(cluster.clone())));
    }
    tasks
}

/// Logs each endpoint whose ejection ended (ejections start in `Cluster::finish`, which logs
/// them). keel-balance ends an ejection by time alone, so a look every half second tells.
async fn watch_ejections(cluster: Arc<Cluster>) {
    let mut ejected: Vec<bool> = Vec::new();
    let mut ticker = tokio::time::interval(std::time::Duration::from_millis(500));
    loop {
        ticker.tick().await;
        let now = cluster.now();
        let endpoints = cluster.balancer.endpoints();
        ejected.resize(endpoints.len(), false);
        for (i, e) in endpoints.iter().enumerate() {
            let now_ejected = e.ejected_until(now).is_some();
            if ejected[i] && !now_ejected {
                tracing::info!(cluster = cluster.name(), endpoint = %e.address(), "endpoint back from ejection");
            }
            ejected[i] = now_ejected;
        }
    }
}

/// Most bytes of an answer's body searched for `expected_body`.
const BODY_SEARCHED: usize = 64 * 1024;

/// One probe on a new connection (TCP, then TLS for a `[cluster.tls]`) made as the request
/// path makes them, to the check's `port` if it has one: `Ok` for an answer whose status is
/// one of `expected_statuses` and whose body (whole within the timeout) has `expected_body`.
async fn probe(
    entry: &EndpointEntry,
    hc: &HealthCheckConfig,
    tls: bool,
    head: &[u8],
) -> Result<(), CheckFailed> {
    let timeout = hc.timeout;
    let work = async {
        if hc.kind == HealthCheckKind::Grpc {
            return crate::control::grpc_health::probe(entry, tls, &hc.service).await;
        }
        let mut conn = entry
            .pool
            .connect_on(hc.port)
            .await
            .map_err(CheckFailed::Connect)?;
        if hc.kind == HealthCheckKind::Tcp {
            return Ok(());
        }
        let mut body = Vec::new();
        let keep = hc
            .expected_body
            .as_ref()
            .map(|_| (&mut body, BODY_SEARCHED));
        let is_head = hc.method == "HEAD";
        let resp =
            crate::upstream::h1_client::exchange_into(&mut conn, head, is_head, keep).await?;
        if !hc.expected_statuses.iter().any(|r| r.contains(resp.status)) {
            return Err(CheckFailed::Status(resp.status));
        }
        match &hc.expected_body {
            Some(text) if !contains(&body, text.as_bytes()) => Err(CheckFailed::Body),
            _ => Ok(()),
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(CheckFailed::Timeout(timeout)),
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The request a check sends: its method and path, its `Host` (the check's `host`, else the
/// endpoint's address).
fn request_head(hc: &HealthCheckConfig, authority: &str) -> String {
    format!(
        "{} {} HTTP/1.1\r\nhost: {}\r\nuser-agent: keel-health-check\r\nconnection: close\r\n\r\n",
        hc.method,
        hc.path,
        hc.host.as_deref().unwrap_or(authority)
    )
}

async fn check_loop(cluster: Arc<Cluster>, index: usize) {
    let hc = cluster
        .config
        .protections
        .health_check
        .clone()
        .expect("checked by spawn");
    let entry = &cluster.endpoints[index];
    let head = request_head(&hc, entry.authority.as_str());
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
        let tls = cluster.config.protocol == UpstreamProtocol::H2;
        let result = probe(entry, &hc, tls, head.as_bytes()).await;
        match result {
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
