//! Real traffic: in-process backends on loopback, keel's proxy (or a client-side balancer in
//! the load generator), and a bounded load.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use keel_balance::{Balancer, EndpointSpec, PickContext};
use keel_model::FailureMode;
use keel_testbed::backend::{self, BackendConfig, BackendHandle};
use keel_testbed::loadgen::{self, LoadOptions, LoadReport, LoadSpec, Target};

use crate::lab::cases::{Case, Timing};

/// What the real run measured.
#[derive(Debug, Clone)]
pub struct Measured {
    /// The load generator's report.
    pub load: LoadReport,
    /// Share of calls (attempts) that went to a failed server.
    pub failed_share: f64,
    /// Largest share of calls that went to one server.
    pub max_share: f64,
    /// Attempts per endpoint, in endpoint order.
    pub attempts: Vec<u64>,
    /// Hash rows: the failed servers' share of request keys on the balancer's own ring.
    pub key_share: Option<f64>,
}

/// The failed servers' share of the row's request keys: a balancer built as the case's (same
/// strategy, seed and endpoint addresses, so the same ring) picks once for each key the load
/// generator sends in the row (`r0` to `r<requests - 1>`), as the peers' rows count theirs. Over
/// the row's own keys the closed form 1 - share is what the ring does to those requests, not
/// a sample of it (100,000 other keys gave 0.189 where a row's 1,500 put 0.213 on the server).
pub(crate) fn key_share(case: &Case, addrs: &[SocketAddr], seed: u64) -> anyhow::Result<f64> {
    let specs: Vec<EndpointSpec> = addrs
        .iter()
        .map(|a| EndpointSpec::new(a.to_string()))
        .collect();
    let mut cfg = case.balancer(seed);
    // Only the ring matters here: nothing is finished, nothing ejected.
    cfg.outlier_detection = None;
    let lb = Balancer::new(cfg, &specs).context("the ring's balancer")?;
    let mut on_failed = 0u64;
    for i in 0..case.requests {
        let key = keel_balance::hash_key(loadgen::request_key_value(i).as_bytes());
        let pick = lb
            .pick(&PickContext::new(Duration::ZERO).with_hash_key(key))
            .context("the ring gave no endpoint")?;
        if case.is_failed(pick.index() as u32) {
            on_failed += 1;
        }
        lb.finish(pick, keel_balance::Outcome::Success, Duration::ZERO);
    }
    Ok(on_failed as f64 / case.requests.max(1) as f64)
}

/// `servers` backends on loopback, named `server-{i}`, each answering in `t`'s healthy time;
/// those that `is_failed` fail as `failure`. Backend `i` draws from `seed + i`.
pub(crate) async fn backends(
    servers: u32,
    failure: FailureMode,
    is_failed: impl Fn(u32) -> bool,
    t: &Timing,
    seed: u64,
) -> anyhow::Result<Vec<BackendHandle>> {
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let mut backends = Vec::new();
    for i in 0..servers {
        let cfg = BackendConfig {
            latency: t.latency(),
            fault: if is_failed(i) {
                failure
            } else {
                FailureMode::None
            },
            name: format!("server-{i}"),
            ..BackendConfig::default()
        };
        let b = backend::spawn_with_seed(loopback, cfg, seed.wrapping_add(i as u64))
            .await
            .context("starting a backend")?;
        backends.push(b);
    }
    Ok(backends)
}

/// Runs one case over real sockets.
pub async fn measure(
    case: &Case,
    t: &Timing,
    seed: u64,
    progress: Arc<AtomicU64>,
) -> anyhow::Result<Measured> {
    let backends = backends(case.servers, case.failure, |i| case.is_failed(i), t, seed).await?;
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.addr()).collect();

    let mut proxy = None;
    let (target, timeout) = if case.client_side {
        let specs: Vec<EndpointSpec> = addrs
            .iter()
            .map(|a| EndpointSpec::new(a.to_string()))
            .collect();
        let base = case.balancer(seed);
        let make = Arc::new(move |worker: usize| {
            let mut cfg = base.clone();
            cfg.seed = base.seed.wrapping_add(worker as u64);
            Balancer::new(cfg, &specs).expect("valid lab balancer")
        });
        (
            Target::ClientSidePerWorker {
                endpoints: addrs.clone(),
                make_balancer: make,
                path: "/".into(),
            },
            t.timeout,
        )
    } else {
        let config = case.proxy_config(t, &addrs, seed);
        config
            .validate()
            .map_err(|e| anyhow::anyhow!("lab proxy configuration: {e}"))?;
        let handle = keel_proxy::start(config).await?;
        let url = format!("http://{}/", handle.listener_addrs()[0]);
        proxy = Some(handle);
        // The proxy answers every call within its own timeouts; this one only guards the lab.
        (Target::Url(url), Duration::from_secs(3))
    };

    let spec = LoadSpec {
        target,
        requests: case.requests,
        concurrency: case.concurrency,
        timeout,
        calls_per_request: case.calls,
    };
    let options = LoadOptions {
        deadline: Some(Duration::from_secs(120)),
        progress: Some(progress),
        client: case.client,
        request_key: case
            .request_key()
            .then(|| crate::lab::cases::REQUEST_KEY.to_string()),
    };
    let key_share = if case.request_key() {
        Some(key_share(case, &addrs, seed)?)
    } else {
        None
    };
    let load = loadgen::try_run(spec, options)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;

    // Attempts per endpoint: the proxy's own counts (retries included), or the client's picks.
    let attempts: Vec<u64> = match &proxy {
        Some(p) => {
            let status = p.cluster_status("lab").unwrap_or_default();
            addrs
                .iter()
                .map(|a| {
                    status
                        .iter()
                        .find(|s| s.address == a.to_string())
                        .map(|s| s.successes + s.failures)
                        .unwrap_or(0)
                })
                .collect()
        }
        None => addrs
            .iter()
            .map(|a| load.picks.get(&a.to_string()).copied().unwrap_or(0))
            .collect(),
    };
    let total = attempts.iter().sum::<u64>().max(1) as f64;
    let failed_share = attempts
        .iter()
        .enumerate()
        .filter(|(i, _)| case.is_failed(*i as u32))
        .map(|(_, &a)| a as f64)
        .sum::<f64>()
        .max(0.0) // an empty float sum is -0.0
        / total;
    let max_share = attempts.iter().copied().max().unwrap_or(0) as f64 / total;

    if let Some(p) = proxy {
        p.shutdown(Duration::from_millis(300)).await;
    }
    for b in backends {
        b.shutdown().await;
    }
    Ok(Measured {
        load,
        failed_share,
        max_share,
        attempts,
        key_share,
    })
}
