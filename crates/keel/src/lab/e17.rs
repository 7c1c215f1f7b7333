//! E17: an affine engine fails. `prefix-affinity` over N fake vLLM engines (`keel_testbed::llm`)
//! and G equally popular prefix groups, closed-loop clients; once every group is warm, the
//! engine holding group 0 fails one of three ways (it hangs, answers 500, refuses connections)
//! and the run goes on. Measured: the failed tries before the engine's prefixes move (per group
//! and in all), those the clients saw, and the requests that missed their prefix while the
//! moved groups warmed elsewhere; three ways at once: the closed form
//! (`keel_model::inference::failover`), the simulator (`keel_model::inference::sim` with a
//! [`Fault`], keel-balance's own balancer) and real traffic through `keel proxy` in this
//! process, whose JSON access log gives each request's tries (`attempts`, by `x-request-id`).
//! Only when named (`--experiments e17`).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;
use keel_model::inference::failover::{self, Failover};
use keel_model::inference::formula::{self, Popularity, Routing, Workload};
use keel_model::inference::sim::{self, Fault, SimConfig};
use keel_model::inference::EngineSpec;
use keel_model::FailureMode;
use keel_testbed::llm::{self, LlmConfig};

use crate::lab::answer::Finding;
use crate::lab::e17_rows::{E17Report, E17Row};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::inference::traffic::{self, Prompts, Reply};
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;
use crate::lab::style::esc;

const ENGINES: usize = 3;
const GROUPS: usize = 6;
/// Requests in flight: two, so that a hang's window holds at most one other client's try.
const CLIENTS: usize = 2;
/// The proxy's per-try timeout: a hung try's end (d for a hang).
const PER_TRY: Duration = Duration::from_millis(300);
/// A 500 at once reaches the proxy about a loopback round trip after the try starts.
const SERVER_ERROR_MS: f64 = 1.0;
/// Simulated seeds per row.
const SIM_SEEDS: u64 = 8;
/// Simulator and traffic agree with the closed form within one try (failed tries, client
/// failures) and one request (misses): the counts are small integers.
pub const TOLERANCE: f64 = 1.0;

/// The engines: a cache that holds every group (no pressure: a moved group's only miss is
/// its warm-up), prefill at the table's speed.
fn spec() -> EngineSpec {
    EngineSpec {
        kv_blocks: 2400,
        step_per_seq_ms: 0.1,
        ..EngineSpec::default()
    }
}

fn workload(requests: u64) -> Workload {
    Workload {
        groups: GROUPS,
        prefix_tokens: 400,
        unique_tokens: 40,
        output_tokens: 8,
        popularity: Popularity::Zipf(0.0),
        requests: Some(requests),
    }
}

/// The failure modes, with their detection time d, seconds.
fn modes() -> [(FailureMode, f64); 3] {
    [
        (FailureMode::Hang, PER_TRY.as_secs_f64()),
        (
            FailureMode::ServerError {
                after: Duration::ZERO,
            },
            SERVER_ERROR_MS / 1e3,
        ),
        (FailureMode::Refuse, 0.0),
    ]
}

/// E17 as a lab experiment: run only when named.
pub struct E17 {
    selected: bool,
    quick: bool,
    report: Option<E17Report>,
}

impl E17 {
    /// From `--experiments`.
    pub fn new(opts: &LabOptions) -> Self {
        E17 {
            selected: opts.experiments.iter().any(|e| e == "e17"),
            quick: opts.quick,
            report: None,
        }
    }

    /// Requests before the failure (every group warmed twice) and after it.
    fn requests(&self) -> (u64, u64) {
        let warm = 2 * GROUPS as u64;
        (warm, if self.quick { 24 } else { 60 })
    }
}

impl Experiment for E17 {
    fn names(&self) -> &'static [&'static str] {
        &["e17"]
    }

    fn plan(&self) -> Vec<Planned> {
        if !self.selected {
            return Vec::new();
        }
        let (warm, after) = self.requests();
        vec![Planned {
            what: "e17 an affine engine fails (hang, 500, refuse)".into(),
            requests: 3 * (warm + after),
        }]
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        let started = Instant::now();
        let (warm, after) = self.requests();
        let spec = spec();
        let w = workload(warm + after);
        let healthy = formula::pool(
            &spec,
            &w,
            ENGINES,
            Routing::Affinity { bound: None },
            formula::Arrivals::Clients(CLIENTS),
        );
        let cycle = failover::cycle(&spec, &w, healthy.ttft, CLIENTS, ENGINES);
        let mut rows = Vec::new();
        for (mode, detection) in modes() {
            if let Some(bar) = lab.bar {
                bar.set_message(format!("e17 {}", mode.name()));
            }
            let f = Failover {
                engines: ENGINES,
                groups: GROUPS,
                clients: CLIENTS,
                cycle,
                detection,
                retried: matches!(mode, FailureMode::Refuse | FailureMode::Hang),
            }
            .cost();
            let s = simulate(&spec, &w, mode, warm, lab.seed)?;
            let t = lab
                .runtime
                .block_on(measure(lab, &spec, &w, mode, warm, after))?;
            let near = |x: f64, f: f64| (x - f).abs() <= TOLERANCE;
            let agrees = [
                (s.failed_tries, t.failed_tries, f.failed_tries),
                (s.client_failures, t.client_failures, f.client_failures),
                (s.misses, t.misses, f.misses),
            ]
            .iter()
            .all(|&(s, t, f)| near(s, f) && near(t, f));
            rows.push(E17Row {
                failure: mode.name().into(),
                detection_ms: detection * 1e3,
                held: [f.held, s.held, t.held],
                failed_tries: [f.failed_tries, s.failed_tries, t.failed_tries],
                most_per_group: [s.most_per_group, t.most_per_group],
                client_failures: [f.client_failures, s.client_failures, t.client_failures],
                misses: [f.misses, s.misses, t.misses],
                requests_after: t.requests_after,
                moved: t.moved,
                agrees,
            });
        }
        let mut report = E17Report {
            answer: String::new(),
            engines: ENGINES,
            groups: GROUPS,
            clients: CLIENTS,
            requests: [warm, after],
            cycle_ms: cycle * 1e3,
            rows,
            seconds: started.elapsed().as_secs_f64(),
        };
        report.answer = answer_text(&report);
        self.report = Some(report);
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.e17 = self.report.take();
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report.e17.as_ref().and_then(finding).into_iter().collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.e17.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, _wide: bool) {
        if let Some(r) = &report.e17 {
            for line in table(r) {
                println!("{line}");
            }
        }
    }
}

/// One way of measuring a row: held groups, failed tries (all, most of one group), client
/// failures, misses.
#[derive(Debug, Default)]
struct Counted {
    held: f64,
    failed_tries: f64,
    most_per_group: u64,
    client_failures: f64,
    misses: f64,
    requests_after: u64,
    moved: bool,
}

/// The simulator over [`SIM_SEEDS`] seeds (means; the most per group over all of them).
fn simulate(
    spec: &EngineSpec,
    w: &Workload,
    mode: FailureMode,
    warm: u64,
    seed: u64,
) -> anyhow::Result<Counted> {
    let mut c = Counted::default();
    let n = SIM_SEEDS as f64;
    // The simulator draws every group at random from the start: twice the traffic's warm-up
    // leaves a group cold before the fault about one run in 70.
    let sim_warm = 2 * warm;
    let w = Workload {
        requests: Some(w.requests.unwrap_or(0) - warm + sim_warm),
        ..*w
    };
    for s in 0..SIM_SEEDS {
        let config = SimConfig {
            engines: ENGINES,
            spec: *spec,
            strategy: StrategyKind::PrefixAffinity,
            bounded_load: None,
            cache_blocks: Some(estimate_blocks(spec)),
            workload: w,
            arrivals: sim::Arrivals::Clients(CLIENTS),
            seed: seed.wrapping_mul(31).wrapping_add(s),
        };
        let fault = Fault {
            after: sim_warm,
            mode,
            timeout: PER_TRY,
        };
        let (_, r) = sim::run_with_fault(&config, Some(&fault))
            .map_err(|e| anyhow::anyhow!("simulating E17: {e}"))?;
        let r = r.context("the simulated fault never started")?;
        let tries: u64 = r.failed_tries.iter().sum();
        c.held += r.held.len() as f64 / n;
        c.failed_tries += tries as f64 / n;
        c.most_per_group = c
            .most_per_group
            .max(r.failed_tries.iter().copied().max().unwrap_or(0));
        c.client_failures += r.failed_requests as f64 / n;
        c.misses += r.misses as f64 / n;
    }
    Ok(c)
}

/// prefix-affinity's estimate of each engine's cache (docs/configuration.md: 0.8 x the engine).
fn estimate_blocks(spec: &EngineSpec) -> u32 {
    (spec.kv_blocks * 4 / 5) as u32
}

/// Real traffic: fresh engines behind `keel proxy` (prefix-affinity, a JSON access log),
/// `warm` requests (each group in turn), the fault on the engine that answered group 0 last,
/// then `after` requests of random groups.
async fn measure(
    lab: &Lab<'_>,
    spec: &EngineSpec,
    w: &Workload,
    mode: FailureMode,
    warm: u64,
    after: u64,
) -> anyhow::Result<Counted> {
    let seed = lab.seed;
    let mut engines = Vec::new();
    for j in 0..ENGINES {
        let cfg = LlmConfig {
            spec: *spec,
            seed: seed.wrapping_add(j as u64),
            name: format!("engine-{j}"),
            ..LlmConfig::default()
        };
        engines.push(
            llm::spawn("127.0.0.1:0".parse()?, cfg)
                .await
                .context("starting an LLM engine")?,
        );
    }
    std::fs::create_dir_all(lab.out)?;
    let log = lab.out.join(format!("e17-{}.log", mode.name()));
    let _ = std::fs::remove_file(&log);
    let endpoints: Vec<String> = engines
        .iter()
        .map(|e| format!("{{ address = \"{}\" }}", e.addr()))
        .collect();
    let toml = format!(
        "[access_log]\npath = {:?}\nformat = \"json\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\
         cluster = \"llm\"\n\n[[cluster]]\nname = \"llm\"\nstrategy = \"prefix-affinity\"\n\
         cache_blocks = {}\nseed = {seed}\nendpoints = [{}]\n\n[cluster.retry]\n\
         per_try_timeout = \"{}ms\"\n",
        log.display(),
        estimate_blocks(spec),
        endpoints.join(", "),
        PER_TRY.as_millis()
    );
    let config = keel_proxy::ProxyConfig::from_toml_str(&toml, "e17.toml")
        .map_err(|e| anyhow::anyhow!("E17's proxy configuration: {e}\n{toml}"))?;
    let proxy = keel_proxy::start(config).await?;
    let router = proxy.listener_addrs()[0];
    let total = (warm + after) as usize;
    let mut prompts = Prompts::new(w, spec, total, seed);
    for (i, g) in prompts.groups.iter_mut().take(warm as usize).enumerate() {
        *g = i % GROUPS;
    }
    let sent = |n: u64| {
        if let Some(bar) = lab.bar {
            bar.inc(n);
        }
    };
    let first = phase(router, &prompts, w, 0..warm as usize).await?;
    sent(warm);
    // The engine that answered group 0 last holds it; the groups whose last answer it gave.
    let last_of = |g: usize| {
        first
            .iter()
            .filter(|(i, r)| prompts.groups[*i] == g && r.status == 200)
            .max_by_key(|(i, _)| *i)
            .and_then(|(_, r)| r.engine)
    };
    let failed = last_of(0).context("group 0 was never answered")?;
    let held: Vec<usize> = (0..GROUPS)
        .filter(|&g| last_of(g) == Some(failed))
        .collect();
    engines[failed].set_fault(mode);
    let second = phase(router, &prompts, w, warm as usize..total).await?;
    sent(after);
    // The shutdown flushes the access log.
    proxy.shutdown(Duration::from_millis(500)).await;
    for e in engines {
        e.shutdown().await;
    }
    let attempts = read_attempts(&log)?;
    let shared = w.shared_tokens(spec) as u64;
    let mut per_group = [0u64; GROUPS];
    let mut c = Counted {
        held: held.len() as f64,
        requests_after: after,
        ..Counted::default()
    };
    for (i, r) in &second {
        let tries = attempts
            .get(&request_id(*i))
            .copied()
            .with_context(|| format!("request {i} is not in the access log"))?;
        let failed_here = tries.saturating_sub(1) + u64::from(r.status != 200);
        per_group[prompts.groups[*i]] += failed_here;
        if r.status != 200 {
            c.client_failures += 1.0;
        } else if r.cached_tokens < shared {
            c.misses += 1.0;
        }
    }
    c.failed_tries = per_group.iter().sum::<u64>() as f64;
    c.most_per_group = per_group.iter().copied().max().unwrap_or(0);
    c.moved = held.iter().all(|&g| {
        second
            .iter()
            .filter(|(i, r)| prompts.groups[*i] == g && r.status == 200)
            .max_by_key(|(i, _)| *i)
            .is_some_and(|(_, r)| r.engine.is_some_and(|e| e != failed))
    });
    Ok(c)
}

fn request_id(i: usize) -> String {
    format!("e17-{i}")
}

/// Sends requests `range` of `prompts`, [`CLIENTS`] at a time; each reply with its index.
async fn phase(
    router: std::net::SocketAddr,
    prompts: &Prompts,
    w: &Workload,
    range: std::ops::Range<usize>,
) -> anyhow::Result<Vec<(usize, Reply)>> {
    let next = std::sync::atomic::AtomicUsize::new(range.start);
    let out = std::sync::Mutex::new(Vec::new());
    let client = || async {
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= range.end {
                return Ok::<(), anyhow::Error>(());
            }
            let body = prompts.body(i, w.output_tokens);
            let header = &prompts.first_blocks[prompts.groups[i]];
            let r = traffic::ask(router, &body, header, Some(&request_id(i)))
                .await
                .with_context(|| format!("E17 request {i}"))?;
            out.lock().expect("replies").push((i, r));
        }
    };
    for r in traffic::futures_join((0..CLIENTS).map(|_| client()).collect()).await {
        r?;
    }
    Ok(out.into_inner().expect("replies"))
}

/// Each request's tries, by its `x-request-id`, from the proxy's JSON access log.
fn read_attempts(log: &std::path::Path) -> anyhow::Result<std::collections::HashMap<String, u64>> {
    let text = std::fs::read_to_string(log)
        .with_context(|| format!("reading E17's access log {}", log.display()))?;
    let mut out = std::collections::HashMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(id), Some(n)) = (v["request_id"].as_str(), v["attempts"].as_u64()) {
            out.insert(id.to_string(), n);
        }
    }
    Ok(out)
}

fn answer_text(r: &E17Report) -> String {
    let row = |name: &str| r.rows.iter().find(|x| x.failure == name);
    let mut s = String::new();
    if let (Some(e), Some(h)) = (row("server-error"), row("hang")) {
        let _ = write!(
            s,
            "An affine engine that fails costs its prefixes one failed try in all when the failure \
             is seen at once (a 500: {:.1} measured, {:.1} simulated, {:.0} by the closed form; \
             at most {} for one group), then each of the {:.0} groups it held misses its prefix \
             once while it warms elsewhere ({:.0} measured, {:.1} simulated). A hang costs the \
             tries started before its {:.0} ms timeout: {:.1} measured, {:.1} simulated, \
             {:.2} by the closed form 1 + (C - 1)(1 - e^(-h d / S)); their answers never \
             began, so keel retried them: the clients saw {:.0} failures.",
            e.failed_tries[2],
            e.failed_tries[1],
            e.failed_tries[0],
            e.most_per_group[1],
            e.held[0],
            e.misses[2],
            e.misses[1],
            h.detection_ms,
            h.failed_tries[2],
            h.failed_tries[1],
            h.failed_tries[0],
            h.client_failures[2],
        );
    }
    if let Some(x) = row("refuse") {
        let _ = write!(
            s,
            " A refused connection is retried at once: the clients saw {:.0} failures.",
            x.client_failures[2]
        );
    }
    let off: Vec<&str> = r
        .rows
        .iter()
        .filter(|x| !x.agrees)
        .map(|x| x.failure.as_str())
        .collect();
    if !off.is_empty() {
        let _ = write!(
            s,
            " Outside the tolerance of {TOLERANCE} against the closed form: {}.",
            off.join(", ")
        );
    }
    s
}

fn finding(r: &E17Report) -> Option<Finding> {
    let e = r.rows.iter().find(|x| x.failure == "server-error")?;
    let mut f = Finding::new(
        "e17",
        "What does an affine engine's failure cost under prefix-affinity?",
        "prefix-affinity".into(),
        "keel defaults".into(),
        e.failed_tries[2],
        None,
    );
    f.formula = Some(format!(
        "failed tries F = 1 + (C - 1)(1 - e^(-h d / S)) = {:.2}; misses L = G / N = {:.0}",
        e.failed_tries[0], e.misses[0]
    ));
    f.text = r.answer.clone();
    Some(f)
}

fn table(r: &E17Report) -> Vec<String> {
    let mut out = vec![
        String::new(),
        format!(
            "E17: an affine engine fails ({} engines, {} groups, {} clients, {}+{} requests; \
             formula/simulator/traffic)",
            r.engines, r.groups, r.clients, r.requests[0], r.requests[1]
        ),
        format!(
            "{:<13} {:>6} {:<14} {:<14} {:>7} {:<14} {:<14} {:>5} {}",
            "failure",
            "d ms",
            "held",
            "failed tries",
            "most/gr",
            "client fails",
            "misses",
            "moved",
            "agrees"
        ),
    ];
    let three = |x: [f64; 3]| format!("{:.1}/{:.1}/{:.0}", x[0], x[1], x[2]);
    for x in &r.rows {
        out.push(format!(
            "{:<13} {:>6.0} {:<14} {:<14} {:>7} {:<14} {:<14} {:>5} {}",
            x.failure,
            x.detection_ms,
            three(x.held),
            three(x.failed_tries),
            format!("{}/{}", x.most_per_group[0], x.most_per_group[1]),
            three(x.client_failures),
            three(x.misses),
            if x.moved { "yes" } else { "no" },
            if x.agrees { "yes" } else { "no" },
        ));
    }
    out
}

fn html(r: &E17Report) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<h2>E17: an affine engine fails</h2><p>{}</p><table><tr><th>failure</th><th>d, ms</th>\
         <th>held groups</th><th>failed tries</th><th>most of one group</th>\
         <th>client failures</th><th>misses</th><th>moved</th><th>agrees</th></tr>",
        esc(&r.answer)
    );
    let three = |x: [f64; 3]| format!("{:.2} / {:.2} / {:.0}", x[0], x[1], x[2]);
    for x in &r.rows {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.0}</td><td>{}</td><td>{}</td><td>{} / {}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&x.failure),
            x.detection_ms,
            three(x.held),
            three(x.failed_tries),
            x.most_per_group[0],
            x.most_per_group[1],
            three(x.client_failures),
            three(x.misses),
            x.moved,
            x.agrees
        );
    }
    h.push_str(
        "</table><p>Each cell: closed form / simulator (mean of 8 seeds) / real traffic. \
         Failed tries are counted from the proxy's access log (a request's attempts beyond the \
         first, and a failed answer).</p>",
    );
    h
}
