//! `keel lab --peers nginx,haproxy,envoy`: the source's example (5 servers, one failed; a hang
//! and a fast 503; 1 and 3 calls a request) through NGINX, HAProxy and Envoy in front of the
//! same in-process backends as keel's own rows, next to the closed form and keel.
//!
//! Each peer runs in two settings: bare (no retries, no passive health) and as operators
//! usually write it (NGINX `proxy_next_upstream error timeout`, `max_fails=1 fail_timeout=10s`;
//! HAProxy `retries 3`, `option redispatch`, `observe layer7`; Envoy retries on
//! `5xx,connect-failure`, consecutive-5xx outlier detection), for each of its strategies with a
//! closed form. A row's configuration is generated (peers/{nginx,haproxy,envoy}.rs) into a
//! temporary directory, the peer started on a free loopback port as operators run it (two
//! workers: NGINX's master and 2 worker processes sharing an upstream `zone`, HAProxy
//! `nbthread 2`, Envoy `--concurrency 2`), driven by the lab's load generator and stopped. A
//! peer that is not installed is named and skipped.

mod envoy;
mod haproxy;
mod nginx;
pub(crate) mod plan;
mod render;
pub(crate) mod rows;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_testbed::loadgen::{self, Client, LoadOptions, LoadReport, LoadSpec, Target};

use crate::lab::answer::Finding;
use crate::lab::cases::{Timing, REQUEST_KEY};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::measure;
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;

use plan::{
    ms, requests_per_row, Peer, PeerCase, PeerConfig, PeerStrategy, UnknownPeer, CONNECT_TIMEOUT,
    WORKERS,
};
use render::{finding, html, print_table};
use rows::{PeerRow, PeersReport, Skipped};

/// Writing, starting and checking a peer's configuration: here rather than in plan.rs, because
/// the generators it calls read plan.rs.
impl Peer {
    fn config(self, c: &PeerConfig<'_>) -> String {
        match self {
            Peer::Nginx => nginx::config(c),
            Peer::Haproxy => haproxy::config(c),
            Peer::Envoy => envoy::config(c),
        }
    }

    fn command(self, bin: &Path, dir: &Path, conf: &Path) -> Command {
        match self {
            Peer::Nginx => nginx::command(bin, dir, conf),
            Peer::Haproxy => haproxy::command(bin, dir, conf),
            Peer::Envoy => envoy::command(bin, dir, conf),
        }
    }

    /// The peer's own check of a configuration file (`nginx -t`, `haproxy -c`,
    /// `envoy --mode validate`).
    #[cfg(test)]
    fn check_command(self, bin: &Path, dir: &Path, conf: &Path) -> Command {
        match self {
            Peer::Nginx => nginx::check(bin, dir, conf),
            Peer::Haproxy => haproxy::check(bin, dir, conf),
            Peer::Envoy => envoy::check(bin, dir, conf),
        }
    }
}

/// Parses `--peers`.
pub(crate) fn parse(names: &[String]) -> Result<Vec<Peer>, UnknownPeer> {
    let mut out = Vec::new();
    for n in names {
        let p: Peer = n.parse()?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

fn version(peer: Peer, bin: &Path) -> String {
    let out = Command::new(bin)
        .arg(match peer {
            Peer::Nginx => "-v",
            Peer::Haproxy => "-v",
            Peer::Envoy => "--version",
        })
        .output();
    let Ok(out) = out else {
        return "?".into();
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    match peer {
        Peer::Nginx => line
            .trim_start_matches("nginx version: ")
            .trim()
            .to_string(),
        Peer::Haproxy => line.split_whitespace().nth(2).unwrap_or("?").to_string(),
        Peer::Envoy => line
            .split("version: ")
            .nth(1)
            .and_then(|v| v.split('/').nth(1))
            .unwrap_or("?")
            .to_string(),
    }
}

/// Runs every row through every peer found and through keel; prints and reports the peers it
/// skips.
pub(crate) fn run(
    runtime: &tokio::runtime::Runtime,
    peers: &[Peer],
    quick: bool,
    only: &[StrategyKind],
    seed: u64,
    t: &Timing,
    progress: &dyn Fn(&str, u64),
) -> anyhow::Result<PeersReport> {
    let started = Instant::now();
    let mut found = Vec::new();
    let mut skipped = Vec::new();
    let mut versions = Vec::new();
    for &p in peers {
        match p.find() {
            Some(bin) => {
                versions.push((p.name().to_string(), version(p, &bin)));
                found.push((p, bin));
            }
            None => {
                let reason = format!(
                    "`{}` is not on PATH (nor ${}): scripts/install-peers.sh installs it",
                    p.name(),
                    p.env_var()
                );
                eprintln!("keel lab: skipping {}: {reason}", p.name());
                skipped.push(Skipped {
                    balancer: p.name().into(),
                    reason,
                });
            }
        }
    }
    let mut rows = Vec::new();
    for case in plan::plan(quick, only) {
        let timing = case.timing(t);
        let t = &timing;
        {
            let kc = case.keel_case();
            progress(&format!("keel {}", case.describe()), 0);
            let m = runtime
                .block_on(measure::measure(&kc, t, seed, Arc::new(AtomicU64::new(0))))
                .with_context(|| format!("measuring keel {}", case.describe()))?;
            rows.push(row(None, &case, t, m.load, m.attempts, m.key_share, None));
            progress("", case.requests);
        }
        let mut broken = Vec::new();
        for (peer, bin) in &found {
            progress(&format!("{} {}", peer.name(), case.describe()), 0);
            match runtime.block_on(measure_peer(*peer, bin, &case, t, seed)) {
                Ok(run) => rows.push(row(
                    Some(*peer),
                    &case,
                    t,
                    run.load,
                    run.attempts,
                    run.key_share,
                    Some(run.stats),
                )),
                // A peer that cannot run a row is named and left out of the rest, not hidden.
                Err(e) => {
                    let reason = format!("failed on {}: {e:#}", case.describe());
                    eprintln!("keel lab: skipping {}: {reason}", peer.name());
                    skipped.push(Skipped {
                        balancer: peer.name().into(),
                        reason,
                    });
                    broken.push(*peer);
                }
            }
            progress("", case.requests);
        }
        found.retain(|(p, _)| !broken.contains(p));
    }
    render::flag_disagreements(&mut rows);
    Ok(PeersReport {
        rows,
        skipped,
        versions,
        method: format!(
            "5 servers on loopback, the last one failed (a hang: no answer, the balancer's {} ms \
             timeout; or fail-fast: a 503 at once); healthy ones answer in {} ms; {} requests a \
             row from {} closed-loop clients, 1 or 3 sequential calls a request (a request stops \
             at its first failed call; bare round-robin's 3-call rows also from a client that \
             makes all 3). Each peer runs as operators run it, with {WORKERS} workers: NGINX a \
             master and {WORKERS} worker processes whose upstream `zone` shares the servers' \
             counters, HAProxy nbthread {WORKERS}, Envoy --concurrency {WORKERS} (a load \
             balancer per worker thread; circuit breakers and outlier detection per cluster). \
             Hash rows hash the request's {REQUEST_KEY} header (one value per request); the \
             failed server's key share is counted on each balancer's own ring.",
            ms(t.timeout),
            ms(t.healthy),
            requests_per_row(quick),
            24
        ),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The peers' rows as a lab experiment: selected by `--peers`, not by a name.
pub struct Peers {
    peers: Vec<Peer>,
    quick: bool,
    only: Vec<StrategyKind>,
    report: Option<PeersReport>,
}

impl Peers {
    /// The peers named by `--peers` (none: nothing to run); an unknown name is a usage error.
    pub fn new(opts: &LabOptions) -> Result<Self, crate::usage::UsageError> {
        Ok(Peers {
            peers: parse(&opts.peers).map_err(|e| crate::usage::UsageError(e.to_string()))?,
            quick: opts.quick,
            only: opts.strategies.clone(),
            report: None,
        })
    }
}

impl Experiment for Peers {
    fn names(&self) -> &'static [&'static str] {
        &[]
    }

    /// Every case once through keel (where keel has the strategy) and once through each peer
    /// found.
    fn plan(&self) -> Vec<Planned> {
        if self.peers.is_empty() {
            return Vec::new();
        }
        let found = self.peers.iter().filter(|p| p.find().is_some()).count() as u64;
        plan::plan(self.quick, &self.only)
            .iter()
            .map(|c| Planned {
                what: c.describe(),
                requests: c.requests * (found + 1),
            })
            .collect()
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        let report = run(
            lab.runtime,
            &self.peers,
            self.quick,
            &self.only,
            lab.seed,
            lab.timing,
            &|what, done| {
                if let Some(bar) = lab.bar {
                    bar.inc(done);
                    if !what.is_empty() {
                        bar.set_message(what.to_string());
                    }
                }
            },
        )?;
        self.report = Some(report);
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.peers = self.report.take();
    }

    /// The peers' answer joins the run's (it also opens their section).
    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report
            .peers
            .as_ref()
            .and_then(finding)
            .into_iter()
            .collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.peers.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, _wide: bool) {
        if let Some(peers) = &report.peers {
            print_table(peers);
        }
    }
}

fn row(
    peer: Option<Peer>,
    case: &PeerCase,
    t: &Timing,
    load: LoadReport,
    attempts: Vec<u64>,
    key_share: Option<f64>,
    peer_stats: Option<std::collections::BTreeMap<String, u64>>,
) -> PeerRow {
    let p = case.p();
    let q = case.q(t);
    let analytic = match key_share {
        // One key per request: its calls all go to one server, failed or not.
        Some(share) => Some(1.0 - share),
        // Round-robin's all-calls rows with clients few enough to stay in step: the rotation's
        // 1 - k / n, hang or fast failure (one rotation per Envoy worker is in step as well).
        // Spread healthy times: the picks shuffle, and what a failure does to the next call
        // (measured: the share of calls after a failed call that failed too) sets the rest.
        None if case.spread => after_failure_rate(&load)
            .map(|s| crate::lab::rotation::after_failure_success(p, case.calls, s)),
        None if case.client == Client::AllCalls
            && case.strategy == PeerStrategy::RoundRobin
            && case.concurrency <= crate::lab::rotation::IN_STEP_CLIENTS
            && case.calls < case.servers =>
        {
            Some(crate::lab::rotation::rotation_success(
                case.servers,
                case.calls,
            ))
        }
        None => q.and_then(|q| analytic::success(case.strategy.model(), p, q, case.calls)),
    };
    let (lo, hi) = load.ci95();
    let measured = load.success_rate();
    let total = attempts.iter().sum::<u64>().max(1) as f64;
    let failed: u64 = attempts
        .iter()
        .enumerate()
        .filter(|(i, _)| case.is_failed(*i as u32))
        .map(|(_, a)| *a)
        .sum();
    let share = failed as f64 / total;
    let agrees = analytic.map(|a| (lo..=hi).contains(&a));
    let z = analytic.map(|a| {
        let se = crate::lab::compare::side_se(measured, [lo, hi], a);
        crate::lab::compare::z_score(measured, a, se)
    });
    let mean_failing_call = match case.client {
        Client::StopsAtFirstFailure => load.requests.checked_sub(load.succeeded).and_then(|n| {
            (n > 0).then(|| {
                (load.calls as f64 - f64::from(case.calls) * load.succeeded as f64) / n as f64
            })
        }),
        Client::AllCalls => None,
    };
    let repeat_failures = match case.client {
        Client::AllCalls => {
            crate::lab::rows::repeat_failures(&load.failed_calls_per_request, case.calls)
                .map(|(m, i)| [m, i])
        }
        Client::StopsAtFirstFailure => None,
    };
    let mut r = PeerRow {
        balancer: peer.map(Peer::name).unwrap_or("keel").to_string(),
        setting: case.setting.name().into(),
        strategy: case.strategy.name().into(),
        native_strategy: case.strategy.native(peer).into(),
        run_as: run_as(peer),
        client: case.client.name().into(),
        failure_mode: case.failure.name().into(),
        p,
        q,
        k: case.calls,
        concurrency: case.concurrency,
        requests: load.requests,
        succeeded: load.succeeded,
        calls: load.calls,
        key_share,
        analytic,
        measured,
        measured_ci95: [lo, hi],
        agrees,
        z,
        measured_failed_share: share,
        implied_by_measured_share: (1.0 - share).powi(case.calls as i32),
        attempts,
        by_status: load.by_status.clone(),
        transport_errors: load.transport_errors,
        failed_calls_per_request: load.failed_calls_per_request.clone(),
        mean_failing_call,
        repeat_failures,
        after_failure: (case.client == Client::AllCalls).then_some(load.after_failure),
        healthy_times: match t.healthy_dist {
            keel_model::LatencyDist::Fixed => format!("fixed {} ms", ms(t.healthy)),
            _ => format!("exponential, mean {} ms", ms(t.healthy)),
        },
        p50_ms: load.latency_p50.as_secs_f64() * 1e3,
        p99_ms: load.latency_p99.as_secs_f64() * 1e3,
        seconds: load.elapsed.as_secs_f64(),
        peer_stats: peer_stats.unwrap_or_default(),
        mechanism: None,
        evidence: Vec::new(),
        explained: true,
        disagrees_with: Vec::new(),
    };
    if let Some((text, evidence)) = render::mechanism(peer, case, &r) {
        r.mechanism = Some(text);
        r.evidence = evidence;
    }
    r.explained = r.agrees != Some(false) || (r.mechanism.is_some() && !r.evidence.is_empty());
    r
}

/// The share of calls made right after a failed call of the same request that failed too.
fn after_failure_rate(load: &LoadReport) -> Option<f64> {
    let [after, failed] = load.after_failure;
    (after > 0).then(|| failed as f64 / after as f64)
}

/// How a balancer ran, as the page says it.
fn run_as(peer: Option<Peer>) -> String {
    match peer {
        None => "keel's proxy: one balancer shared by its tokio workers".into(),
        Some(Peer::Nginx) => format!(
            "as operators run it: a master and {WORKERS} worker processes, the upstream in a \
             shared zone (one set of max_fails counters and weights)"
        ),
        Some(Peer::Haproxy) => format!(
            "as operators run it: nbthread {WORKERS} (the threads share the servers' counters)"
        ),
        Some(Peer::Envoy) => format!(
            "as operators run it: --concurrency {WORKERS} (a load balancer per worker thread; \
             circuit breakers and outlier detection per cluster)"
        ),
    }
}

/// A free loopback port (bound and released: the peer binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// A running peer, killed when dropped.
struct Running {
    child: Child,
    dir: PathBuf,
}

impl Drop for Running {
    /// SIGTERM first: NGINX's master stops its worker processes on it (SIGKILL would leave them
    /// serving); SIGKILL after 3 s.
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child's pid, which is not reaped until wait below.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh directory for one peer run.
fn work_dir(peer: Peer) -> anyhow::Result<PathBuf> {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "keel-peer-{}-{}-{n}",
        peer.name(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Writes the row's configuration for `peer` into its directory; returns its path.
fn write_config(peer: Peer, cfg: &PeerConfig<'_>) -> anyhow::Result<PathBuf> {
    let path = cfg.dir.join(peer.file_name());
    std::fs::write(&path, peer.config(cfg))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Starts `peer` on its configuration and waits until it serves (Envoy: until its admin says
/// `/ready`), at most 10 s.
async fn start(
    peer: Peer,
    bin: &Path,
    dir: PathBuf,
    conf: &Path,
    listen: u16,
    admin: u16,
) -> anyhow::Result<Running> {
    let log = std::fs::File::create(dir.join("stderr.log"))?;
    let child = peer
        .command(bin, &dir, conf)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut running = Running { child, dir };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = running.child.try_wait()? {
            anyhow::bail!(
                "{} exited ({status}) before serving: {}",
                peer.name(),
                log_tail(&running.dir)
            );
        }
        let ready = match peer {
            Peer::Envoy => http_status(admin, "/ready").await == Some(200),
            _ => tokio::net::TcpStream::connect(("127.0.0.1", listen))
                .await
                .is_ok(),
        };
        if ready {
            return Ok(running);
        }
        if Instant::now() > deadline {
            anyhow::bail!(
                "{} did not serve on 127.0.0.1:{listen} within 10 s: {}",
                peer.name(),
                log_tail(&running.dir)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn log_tail(dir: &Path) -> String {
    let mut text = String::new();
    for f in ["stderr.log", "error.log", "envoy.log"] {
        if let Ok(s) = std::fs::read_to_string(dir.join(f)) {
            text.push_str(&s);
        }
    }
    let lines: Vec<&str> = text.lines().rev().take(8).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// `GET path` on 127.0.0.1:port: the status and the body, if it answers within a second.
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf);
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Some((status, body.to_string()))
}

async fn http_status(port: u16, path: &str) -> Option<u16> {
    http_get(port, path).await.map(|(s, _)| s)
}

/// Envoy's own counts of what its retries and outlier detection did in the row (the non-zero
/// ones), from its admin: the evidence for a departure's mechanism.
async fn envoy_stats(admin: u16) -> std::collections::BTreeMap<String, u64> {
    let Some((200, body)) = http_get(admin, "/stats?filter=^cluster\\.lab\\.").await else {
        return Default::default();
    };
    body.lines()
        .filter_map(|l| {
            let (name, v) = l.split_once(": ")?;
            let name = name.strip_prefix("cluster.lab.")?;
            let keep = name.starts_with("upstream_rq_retry")
                || name.starts_with("outlier_detection.ejections_")
                || name == "upstream_rq_pending_overflow";
            let v: u64 = v.trim().parse().ok()?;
            (keep && v > 0).then(|| (name.to_string(), v))
        })
        .collect()
}

/// One row through `peer`: the backends, the peer in front of them, the load; then all of it
/// stopped. Returns the load's report and each backend's request count. Hash rows first send
/// each of the row's request keys once with every server healthy and count where each lands
/// (the failed server's key share on the peer's own ring), then fail the server.
async fn measure_peer(
    peer: Peer,
    bin: &Path,
    case: &PeerCase,
    t: &Timing,
    seed: u64,
) -> anyhow::Result<PeerRun> {
    let hashed = case.strategy == PeerStrategy::Hash;
    let backends = measure::backends(
        case.servers,
        case.failure,
        |i| !hashed && case.is_failed(i),
        t,
        seed,
    )
    .await?;
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.addr()).collect();
    let dir = work_dir(peer)?;
    let (listen, admin) = (free_port()?, free_port()?);
    let conf = write_config(
        peer,
        &PeerConfig {
            listen,
            admin,
            backends: &addrs,
            strategy: case.strategy,
            setting: case.setting,
            timeout: t.timeout,
            connect_timeout: CONNECT_TIMEOUT,
            dir: &dir,
        },
    )?;
    let running = start(peer, bin, dir, &conf, listen, admin).await?;
    let url = format!("http://127.0.0.1:{listen}/");
    let key = hashed.then(|| REQUEST_KEY.to_string());
    let counts = |bs: &[keel_testbed::backend::BackendHandle]| -> Vec<u64> {
        bs.iter().map(|b| b.requests()).collect()
    };
    let mut key_share = None;
    if hashed {
        let probe = LoadSpec {
            target: Target::Url(url.clone()),
            requests: case.requests,
            concurrency: case.concurrency,
            timeout: Duration::from_secs(3),
            calls_per_request: 1,
        };
        let options = LoadOptions {
            deadline: Some(Duration::from_secs(60)),
            request_key: key.clone(),
            ..LoadOptions::default()
        };
        loadgen::try_run(probe, options)
            .await
            .map_err(|e| anyhow::anyhow!("counting the ring's keys: {e}"))?;
        let landed = counts(&backends);
        let total = landed.iter().sum::<u64>().max(1) as f64;
        let on_failed: u64 = landed
            .iter()
            .enumerate()
            .filter(|(i, _)| case.is_failed(*i as u32))
            .map(|(_, n)| *n)
            .sum();
        key_share = Some(on_failed as f64 / total);
        for (i, b) in backends.iter().enumerate() {
            if case.is_failed(i as u32) {
                b.apply_fault(case.failure)
                    .await
                    .context("failing the server after the key count")?;
            }
        }
    }
    let before = counts(&backends);
    let spec = LoadSpec {
        target: Target::Url(url),
        requests: case.requests,
        concurrency: case.concurrency,
        // Every peer answers within its own timeouts; this one only guards the lab.
        timeout: Duration::from_secs(3),
        calls_per_request: case.calls,
    };
    let options = LoadOptions {
        deadline: Some(Duration::from_secs(120)),
        client: case.client,
        request_key: key,
        ..LoadOptions::default()
    };
    let load = loadgen::try_run(spec, options)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"));
    let stats = match peer {
        Peer::Envoy => envoy_stats(admin).await,
        _ => Default::default(),
    };
    drop(running);
    let attempts = counts(&backends)
        .iter()
        .zip(&before)
        .map(|(a, b)| a - b)
        .collect();
    for b in backends {
        b.shutdown().await;
    }
    Ok(PeerRun {
        load: load?,
        attempts,
        key_share,
        stats,
    })
}

/// What a peer's row measured.
struct PeerRun {
    load: LoadReport,
    /// Requests each backend received.
    attempts: Vec<u64>,
    /// Hash rows: the failed server's share of the row's keys on the peer's ring.
    key_share: Option<f64>,
    /// The peer's own counters (Envoy's retry and ejection stats).
    stats: std::collections::BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests;
