//! Engine signals (`[cluster.engine_signals]`): what inference engines say about their own
//! load reaches the endpoint's view ([`crate::metrics::engine::EngineSignals`], shown in
//! `/status` and `/metrics`) and the balancer (`Balancer::report_queue`: the engine's waiting
//! requests, which least-request and the bounded loads of prefix-affinity count in its load
//! until `max_age` old).
//!
//! Two sources: the ORCA header of each answer (the HTTP/1.1 leg asks for it and hands the
//! report to [`take`]), or a scrape of each endpoint's Prometheus text every `interval`
//! ([`spawn`]), on a keep-alive connection of its own. A malformed report, or one older than
//! `max_age` when it arrives, is counted and changes nothing.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::codec::engine::EngineReport;
use crate::config::SignalSource;
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::pool::RawConn;

/// The request header that asks vLLM for its ORCA report.
pub(crate) const ORCA_FORMAT: &[u8] = b"endpoint-load-metrics-format";

/// That header, asking for the text form.
pub(crate) const ORCA_ASK: &[u8] = b"endpoint-load-metrics-format: text\r\n";

/// Most bytes of a metrics page read (vLLM's is tens of KB with its histograms).
const MAX_METRICS_BODY: usize = 4 << 20;

/// Takes `report`, made when keel asked at `asked_at` and arrived at `now`, for endpoint
/// `entry` of `cluster`.
pub(crate) fn take(
    cluster: &Cluster,
    entry: &EndpointEntry,
    report: EngineReport,
    asked_at: Duration,
    now: Duration,
) {
    let Some(cfg) = &cluster.config.engine_signals else {
        return;
    };
    let view = &entry.metrics.engine;
    match report {
        EngineReport::Malformed => {
            view.malformed.fetch_add(1, Relaxed);
        }
        EngineReport::Load(_) if now.saturating_sub(asked_at) > cfg.max_age => {
            view.stale.fetch_add(1, Relaxed);
        }
        EngineReport::Load(load) => {
            view.take(load, now);
            let waiting = load.waiting.round().max(0.0) as u32;
            cluster.balancer.report_queue(entry.id, waiting, now);
        }
    }
}

/// Starts the scrapes of a `source = "metrics"` cluster, one task per endpoint.
pub(crate) fn spawn(cluster: &Arc<Cluster>, rt: &tokio::runtime::Handle) -> Vec<JoinHandle<()>> {
    match &cluster.config.engine_signals {
        Some(s) if s.source == SignalSource::Metrics => (0..cluster.endpoints.len())
            .map(|i| rt.spawn(scrape_loop(cluster.clone(), i)))
            .collect(),
        _ => Vec::new(),
    }
}

/// Why a scrape brought no report.
#[derive(Debug)]
enum Missed {
    /// No connection, no answer in time, or an answer that is not HTTP.
    Failed,
    /// An answer that is not 2xx.
    Status,
}

async fn scrape_loop(cluster: Arc<Cluster>, index: usize) {
    let Some(cfg) = cluster.config.engine_signals.clone() else {
        return;
    };
    let entry = &cluster.endpoints[index];
    let head = format!(
        "GET {} HTTP/1.1\r\nhost: {}\r\nuser-agent: keel-engine-signals\r\naccept: text/plain\r\n\r\n",
        cfg.metrics_path, entry.authority
    );
    let mut ticker = tokio::time::interval(cfg.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn: Option<RawConn> = None;
    // A late answer past max_age still arrives, so that it is counted as stale, within a bound.
    let timeout = cfg.max_age * 2 + cfg.interval;
    let mut body = Vec::new();
    loop {
        ticker.tick().await;
        let asked_at = cluster.now();
        let got = tokio::time::timeout(
            timeout,
            scrape(entry, &mut conn, head.as_bytes(), &mut body),
        )
        .await
        .unwrap_or(Err(Missed::Failed));
        match got {
            Ok(()) => {
                let report = EngineReport::of_prometheus(&body);
                take(&cluster, entry, report, asked_at, cluster.now());
            }
            Err(why) => {
                conn = None;
                entry.metrics.engine.failed.fetch_add(1, Relaxed);
                tracing::debug!(cluster = cluster.name(), endpoint = %entry.authority, ?why, "engine metrics not read");
            }
        }
    }
}

/// One read of the metrics page into `body`, on the kept connection or a new one.
async fn scrape(
    entry: &EndpointEntry,
    conn: &mut Option<RawConn>,
    head: &[u8],
    body: &mut Vec<u8>,
) -> Result<(), Missed> {
    let c = match conn {
        Some(c) => c,
        None => conn.insert(entry.pool.connect().await.map_err(|_| Missed::Failed)?),
    };
    let resp = crate::upstream::h1_client::exchange_body(c, head, body, MAX_METRICS_BODY as u64)
        .await
        .map_err(|_| Missed::Failed)?;
    if !resp.keep_alive {
        *conn = None;
    }
    if resp.status / 100 != 2 {
        return Err(Missed::Status);
    }
    Ok(())
}
