//! Active HTTP health checks: every `interval`, `GET path` on each endpoint; `unhealthy_threshold`
//! failures in a row mark it down and `healthy_threshold` passes mark it up again, through
//! keel-balance's `set_healthy` (which starts a slow start on the way back up).
//!
//! Each probe opens its own connection (TCP, then TLS for a cluster with `[cluster.tls]`), so a
//! probe tests that a new connection can be made, and the checks do not depend on the request
//! path's connection pool.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header;
use hyper::http::uri::PathAndQuery;
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::cluster::{Cluster, EndpointEntry};
use crate::tls::UpstreamTls;

/// Starts one checker task per endpoint of the cluster (none without `[health_check]`).
pub fn spawn(cluster: &Arc<Cluster>, rt: &tokio::runtime::Handle) -> Vec<JoinHandle<()>> {
    if cluster.config.health_check.is_none() {
        return Vec::new();
    }
    (0..cluster.endpoints.len())
        .map(|i| rt.spawn(check_loop(cluster.clone(), i)))
        .collect()
}

/// One probe: `Ok` for a 2xx answer whose body arrives whole within the timeout.
async fn probe(
    entry: &EndpointEntry,
    path: &PathAndQuery,
    tls: Option<&UpstreamTls>,
    timeout: std::time::Duration,
) -> Result<(), String> {
    let req = Request::get(Uri::from(path.clone()))
        .header(header::HOST, entry.authority.as_str())
        .header(header::USER_AGENT, "keel-health-check")
        .header(header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let work = async {
        let tcp = TcpStream::connect(entry.authority.as_str())
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        match tls {
            None => exchange(TokioIo::new(tcp), req).await,
            Some(tls) => {
                let stream = tls
                    .connect(tcp, entry.authority.host())
                    .await
                    .map_err(|e| e.to_string())?;
                exchange(TokioIo::new(stream), req).await
            }
        }
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "no answer within {}",
            humantime::format_duration(timeout)
        )),
    }
}

/// Sends the probe on a new HTTP/1.1 connection, driving the connection in this task.
async fn exchange<I>(io: I, req: Request<Empty<Bytes>>) -> Result<(), String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    let answer = async move {
        let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
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
    tokio::pin!(answer);
    tokio::pin!(conn);
    let mut conn_done = false;
    loop {
        tokio::select! {
            biased;
            r = &mut answer => return r,
            // A connection that ends cleanly has delivered the answer: read it on the next turn.
            c = &mut conn, if !conn_done => match c {
                Ok(()) => conn_done = true,
                Err(e) => return Err(e.to_string()),
            },
        }
    }
}

async fn check_loop(cluster: Arc<Cluster>, index: usize) {
    let hc = cluster
        .config
        .health_check
        .clone()
        .expect("checked by spawn");
    let entry = &cluster.endpoints[index];
    let path = hc.path.parse::<PathAndQuery>();
    // Validation loaded the CA already; failing here (the file went away since) fails probes.
    let tls = cluster
        .config
        .tls
        .as_ref()
        .map(|t| UpstreamTls::new(t, hc.timeout).map_err(|e| format!("tls {e}")))
        .transpose();
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
        let result = match (&path, &tls) {
            (Ok(path), Ok(tls)) => probe(entry, path, tls.as_ref(), hc.timeout).await,
            (Err(e), _) => Err(format!("bad path: {e}")),
            (_, Err(e)) => Err(e.clone()),
        };
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
