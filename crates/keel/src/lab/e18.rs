//! E18: a real trace replayed. A slice of Mooncake's conversation trace
//! (`crates/keel/data/mooncake/`, its README says how it was cut and scaled) becomes streaming
//! completions whose prompts are one deterministic block of text per hash id, sent at the
//! trace's times (compressed to a stated load) to 3 fake vLLM engines (`keel_testbed::llm`)
//! through each routing: keel's round-robin, least-request, prefix-affinity without and with
//! the derived conversation as its session key (`hash_on = "header:x-session-id"`), and the
//! peers of `--peers` (vLLM Router's `sticky_least_loaded` and `cache_aware`, SMG's
//! `cache_aware`). Three ways at once: the closed form predicts each routing's share of prompt
//! tokens from cache from the trace's own reuse before anything runs
//! (`keel_model::inference::trace::predict`), the simulator replays the trace through
//! keel-balance's own balancer (`trace::replay`), and real traffic measures it, with the mean
//! and 99th percentile time to first token and the requests per engine. Only when named
//! (`--experiments e18`).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::StrategyKind;
use keel_model::inference::trace::{self, Placement, ReplayConfig, Replayed, Trace};
use keel_model::inference::EngineSpec;

use crate::lab::answer::Finding;
use crate::lab::e18_rows::{E18Report, E18Row};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::inference::routers::{self, Router};
use crate::lab::inference::traffic;
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;
use crate::lab::style::esc;

/// The slice of the trace (crates/keel/data/mooncake/README.md).
const SLICE: &str = include_str!("../../data/mooncake/conversation_slice.jsonl");
/// Minutes of the trace the slice covers.
const SLICE_MINUTES: f64 = 20.0;
const ENGINES: usize = 3;
/// Offered load per engine the arrivals are compressed to: arrivals per engine x a request's
/// service time alone, uncached (E14's definition).
const LOAD: f64 = 0.5;
/// Each engine's KV cache: 600 blocks of 16 tokens, about 22 of the slice's mean prompts, so
/// that an engine keeps a conversation for a few minutes of the trace and routing decides.
const KV_BLOCKS: usize = 600;
/// `--quick`: the slice's first requests.
const QUICK_REQUESTS: usize = 150;
/// Simulated seeds (the balancer's) per keel row.
const SIM_SEEDS: u64 = 5;
/// How far the closed form (on the run's placement) and the simulator may be from the
/// traffic's share of prompt tokens from cache: the simulator's own seeds move it by up to
/// 0.05 on this slice (least-request), and a run on the real-time engines differs from the
/// simulated one by the timing of its arrivals (which requests overlap, so which are in flight
/// when a block is evicted).
pub const TOLERANCE: f64 = 0.05;
/// The header carrying the derived conversation.
const SESSION_HEADER: &str = "x-session-id";

/// The engines: the measurement table's, with 600 blocks.
fn spec() -> EngineSpec {
    EngineSpec {
        kv_blocks: KV_BLOCKS,
        step_per_seq_ms: 0.1,
        ..EngineSpec::default()
    }
}

/// prefix-affinity's estimate: 0.8 x the engine's blocks, as docs/configuration.md advises.
fn estimate_blocks(spec: &EngineSpec) -> u32 {
    (spec.kv_blocks * 4 / 5) as u32
}

/// keel's routings.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Keel {
    RoundRobin,
    LeastRequest,
    Affinity,
    AffinitySession,
}

impl Keel {
    fn name(self) -> &'static str {
        match self {
            Keel::RoundRobin => "round-robin",
            Keel::LeastRequest => "least-request",
            Keel::Affinity => "prefix-affinity",
            Keel::AffinitySession => "prefix-affinity, session key",
        }
    }

    fn strategy(self) -> StrategyKind {
        match self {
            Keel::RoundRobin => StrategyKind::RoundRobin,
            Keel::LeastRequest => StrategyKind::LeastRequest,
            Keel::Affinity | Keel::AffinitySession => StrategyKind::PrefixAffinity,
        }
    }

    fn placement(self) -> Placement {
        match self {
            Keel::RoundRobin | Keel::LeastRequest => Placement::EachRequest,
            Keel::Affinity | Keel::AffinitySession => Placement::EachSession,
        }
    }

    /// The cluster's strategy lines of the proxy's configuration.
    fn toml(self, spec: &EngineSpec) -> String {
        let affinity = format!(
            "strategy = \"prefix-affinity\"\ncache_blocks = {}\n",
            estimate_blocks(spec)
        );
        match self {
            Keel::RoundRobin => "strategy = \"round-robin\"\n".into(),
            Keel::LeastRequest => "strategy = \"least-request\"\n".into(),
            Keel::Affinity => affinity,
            Keel::AffinitySession => format!("{affinity}hash_on = \"header:{SESSION_HEADER}\"\n"),
        }
    }
}

fn placement_name(p: Placement) -> &'static str {
    match p {
        Placement::EachRequest => "requests spread evenly",
        Placement::EachSession => "conversations spread evenly",
    }
}

/// A peer's policies that E18 runs: vLLM Router's sticky sessions (on `X-Session-ID`) and
/// cache-aware routing, SMG's cache-aware routing.
fn peer_policies(r: Router) -> &'static [&'static str] {
    match r {
        Router::VllmRouter => &["sticky_least_loaded", "cache_aware"],
        Router::Smg => &["cache_aware"],
    }
}

/// E18 as a lab experiment: run only when named.
pub struct E18 {
    selected: bool,
    quick: bool,
    routers: Vec<Router>,
    report: Option<E18Report>,
}

impl E18 {
    /// From `--experiments` and `--peers`.
    pub fn new(opts: &LabOptions) -> Self {
        E18 {
            selected: opts.experiments.iter().any(|e| e == "e18"),
            quick: opts.quick,
            routers: opts.peers.iter().filter_map(|p| Router::parse(p)).collect(),
            report: None,
        }
    }

    fn trace(&self) -> anyhow::Result<Trace> {
        let t = Trace::parse_jsonl(SLICE).context("reading E18's trace slice")?;
        Ok(if self.quick {
            t.head(QUICK_REQUESTS)
        } else {
            t
        })
    }

    fn keel_routings(&self) -> Vec<Keel> {
        if self.quick {
            vec![Keel::RoundRobin, Keel::AffinitySession]
        } else {
            vec![
                Keel::RoundRobin,
                Keel::LeastRequest,
                Keel::Affinity,
                Keel::AffinitySession,
            ]
        }
    }

    fn runs(&self) -> usize {
        let peers: usize = if self.quick {
            0
        } else {
            self.routers.iter().map(|&r| peer_policies(r).len()).sum()
        };
        self.keel_routings().len() + peers
    }
}

/// The replay's requests and their bodies, at the stated load.
struct Replay {
    requests: Vec<Replayed>,
    bodies: Vec<String>,
    rate: f64,
}

impl Replay {
    fn new(t: &Trace, spec: &EngineSpec) -> Replay {
        // The service time alone, uncached, at rate 1; then the rate that makes it LOAD.
        let unit = t.scaled(spec.block_tokens, 1.0);
        let step = (spec.step_ms + spec.step_per_seq_ms) / 1e3;
        let service = unit
            .iter()
            .map(|r| r.prompt_tokens as f64 / spec.prefill_tps + r.max_tokens as f64 * step)
            .sum::<f64>()
            / unit.len().max(1) as f64;
        let rate = LOAD * ENGINES as f64 / service;
        let requests = t.scaled(spec.block_tokens, rate);
        let bodies = requests
            .iter()
            .map(|r| {
                format!(
                    "{{\"model\":\"keel-llm\",\"prompt\":\"{}\",\"max_tokens\":{},\
                     \"stream\":true,\"stream_options\":{{\"include_usage\":true}}}}",
                    trace::prompt_text(r, spec.block_tokens),
                    r.max_tokens
                )
            })
            .collect();
        Replay {
            requests,
            bodies,
            rate,
        }
    }
}

impl Experiment for E18 {
    fn names(&self) -> &'static [&'static str] {
        &["e18"]
    }

    fn plan(&self) -> Vec<Planned> {
        if !self.selected {
            return Vec::new();
        }
        let n = self.trace().map_or(0, |t| t.requests.len());
        vec![Planned {
            what: "e18 a real trace replayed (Mooncake conversations)".into(),
            requests: (self.runs() * n) as u64,
        }]
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        let started = Instant::now();
        let spec = spec();
        let t = self.trace()?;
        let replay = Replay::new(&t, &spec);
        let reqs = &replay.requests;
        let mut seen = std::collections::HashSet::new();
        let continuing = reqs.iter().filter(|r| !seen.insert(r.session)).count();
        let sessions = seen.len();
        // Requests in flight per engine (Little's law: the offered load, as each request's
        // service time is near its time in the engine at this load).
        let in_flight = LOAD;
        let ceiling = trace::predict(
            reqs,
            &EngineSpec {
                kv_blocks: usize::MAX / 4,
                ..spec
            },
            1,
            Placement::EachRequest,
            0.0,
        )
        .cached;
        let mut rows = Vec::new();
        let mut skipped = Vec::new();
        for k in self.keel_routings() {
            if let Some(bar) = lab.bar {
                bar.set_message(format!("e18 keel {}", k.name()));
            }
            let f = trace::predict(reqs, &spec, ENGINES, k.placement(), in_flight);
            let s = simulate(&spec, k, reqs, lab.seed)?;
            let m = lab
                .runtime
                .block_on(measure(lab, &spec, &replay, Target::Keel(k)))?;
            let on_run = trace::predict_on(reqs, &spec, ENGINES, &m.engines, in_flight);
            rows.push(row(
                "keel",
                k.name(),
                k.placement(),
                [f.cached, on_run.cached],
                Some(&s),
                &m,
            ));
        }
        if !self.quick {
            for &r in &self.routers {
                let Some(bin) = r.find() else {
                    skipped.push(format!(
                        "{}: not found (KEEL_{}, ~/.cache/keel/inference-peers/bin, PATH; \
                         scripts/install-inference-peers.sh installs it)",
                        r.name(),
                        r.name().to_ascii_uppercase().replace('-', "_")
                    ));
                    continue;
                };
                for &policy in peer_policies(r) {
                    if let Some(bar) = lab.bar {
                        bar.set_message(format!("e18 {} {policy}", r.name()));
                    }
                    let placement = Placement::EachSession;
                    let f = trace::predict(reqs, &spec, ENGINES, placement, in_flight);
                    let target = Target::Peer(r, &bin, policy);
                    match lab.runtime.block_on(measure(lab, &spec, &replay, target)) {
                        Ok(m) => {
                            let on_run =
                                trace::predict_on(reqs, &spec, ENGINES, &m.engines, in_flight);
                            let f = [f.cached, on_run.cached];
                            rows.push(row(r.name(), policy, placement, f, None, &m));
                        }
                        Err(e) => skipped.push(format!("{} {policy}: {e:#}", r.name())),
                    }
                }
            }
        }
        let n = reqs.len().max(1) as f64;
        let mut report = E18Report {
            answer: String::new(),
            requests: reqs.len(),
            sessions,
            continuing,
            trace_minutes: if self.quick {
                t.requests.last().map_or(0.0, |r| r.timestamp as f64 / 60e3)
            } else {
                SLICE_MINUTES
            },
            load: LOAD,
            rate: replay.rate,
            replay_seconds: reqs.last().map_or(0.0, |r| r.at.as_secs_f64()),
            token_divisor: trace::TRACE_BLOCK_TOKENS / spec.block_tokens,
            mean_tokens: [
                reqs.iter().map(|r| r.prompt_tokens as f64).sum::<f64>() / n,
                reqs.iter().map(|r| r.max_tokens as f64).sum::<f64>() / n,
            ],
            engines: ENGINES,
            kv_blocks: spec.kv_blocks,
            ceiling,
            rows,
            skipped,
            seconds: started.elapsed().as_secs_f64(),
        };
        report.answer = answer_text(&report);
        self.report = Some(report);
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.e18 = self.report.take();
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report.e18.as_ref().and_then(finding).into_iter().collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.e18.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, _wide: bool) {
        if let Some(r) = &report.e18 {
            for line in table(r) {
                println!("{line}");
            }
        }
    }
}

/// The simulator's means over [`SIM_SEEDS`] balancer seeds, and its spread.
struct Simulated {
    cached: f64,
    spread: f64,
    ttft_mean: f64,
    ttft_p99: f64,
}

fn simulate(spec: &EngineSpec, k: Keel, reqs: &[Replayed], seed: u64) -> anyhow::Result<Simulated> {
    let mut all = Vec::new();
    let (mut mean, mut p99) = (0.0, 0.0);
    for s in 0..SIM_SEEDS {
        let r = trace::replay(
            &ReplayConfig {
                engines: ENGINES,
                spec: *spec,
                strategy: k.strategy(),
                bounded_load: None,
                cache_blocks: Some(estimate_blocks(spec)),
                session_key: k == Keel::AffinitySession,
                seed: seed.wrapping_mul(31).wrapping_add(s),
            },
            reqs,
        )
        .map_err(|e| anyhow::anyhow!("simulating E18 {}: {e}", k.name()))?;
        all.push(r.cached);
        mean += r.ttft_mean;
        p99 += r.ttft_p99;
    }
    let n = SIM_SEEDS as f64;
    let most = all.iter().copied().fold(f64::MIN, f64::max);
    let least = all.iter().copied().fold(f64::MAX, f64::min);
    Ok(Simulated {
        cached: all.iter().sum::<f64>() / n,
        spread: most - least,
        ttft_mean: mean / n,
        ttft_p99: p99 / n,
    })
}

/// What real traffic through one router measured.
struct Measured {
    cached: f64,
    ttft_mean: f64,
    ttft_p99: f64,
    per_engine: Vec<u64>,
    /// Each request's engine (`None`: failed).
    engines: Vec<Option<usize>>,
    requests: u64,
    failed: u64,
    extra_calls: u64,
}

/// The router in front of the engines.
enum Target<'a> {
    Keel(Keel),
    Peer(Router, &'a std::path::PathBuf, &'a str),
}

/// Fresh engines, the router, and every request at its time (open loop).
async fn measure(
    lab: &Lab<'_>,
    spec: &EngineSpec,
    replay: &Replay,
    target: Target<'_>,
) -> anyhow::Result<Measured> {
    let seed = lab.seed;
    let pool = traffic::Pool::start(ENGINES, *spec, seed).await?;
    let m = async {
        match target {
            Target::Keel(k) => {
                let endpoints: Vec<String> = pool
                    .addrs()
                    .iter()
                    .map(|a| format!("{{ address = \"{a}\" }}"))
                    .collect();
                let config = format!(
                    "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"llm\"\n\n[[cluster]]\n\
                     name = \"llm\"\n{}seed = {seed}\nendpoints = [{}]\n",
                    k.toml(spec),
                    endpoints.join(", ")
                );
                let config = keel_proxy::ProxyConfig::from_toml_str(&config, "e18.toml")
                    .map_err(|e| anyhow::anyhow!("E18's proxy configuration: {e}"))?;
                let proxy = keel_proxy::start(config).await?;
                let m = drive(lab, &pool, proxy.listener_addrs()[0], replay).await;
                proxy.shutdown(Duration::from_millis(200)).await;
                m
            }
            Target::Peer(r, bin, policy) => {
                std::fs::create_dir_all(lab.out)?;
                let log = lab.out.join(format!("e18-{}-{policy}.log", r.name()));
                let peer = routers::start(r, bin, policy, pool.addrs(), &log).await?;
                drive(lab, &pool, peer.addr, replay).await
            }
        }
    }
    .await;
    pool.shutdown().await;
    lab.done.set(lab.done.get() + replay.requests.len() as u64);
    m
}

async fn drive(
    lab: &Lab<'_>,
    pool: &traffic::Pool,
    router: SocketAddr,
    replay: &Replay,
) -> anyhow::Result<Measured> {
    let before = pool.calls();
    let start = tokio::time::Instant::now();
    let one = |i: usize| {
        let r = &replay.requests[i];
        let headers = format!("{SESSION_HEADER}: s{}\r\n", r.session);
        async move {
            tokio::time::sleep_until(start + r.at).await;
            let reply = traffic::ask_with(router, &replay.bodies[i], &headers).await;
            if let Some(bar) = lab.bar {
                bar.inc(1);
            }
            reply
        }
    };
    let replies =
        traffic::futures_join((0..replay.requests.len()).map(one).collect::<Vec<_>>()).await;
    let mut m = Measured {
        cached: 0.0,
        ttft_mean: 0.0,
        ttft_p99: 0.0,
        per_engine: vec![0; ENGINES],
        engines: Vec::with_capacity(replies.len()),
        requests: 0,
        failed: 0,
        extra_calls: 0,
    };
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut ttfts = Vec::new();
    for reply in replies {
        match reply {
            Ok(r) if r.status == 200 && r.ttft.is_some() && r.prompt_tokens.is_some() => {
                m.requests += 1;
                prompt += r.prompt_tokens.unwrap_or(0);
                cached += r.cached_tokens;
                ttfts.push(r.ttft.map_or(0.0, |d| d.as_secs_f64()));
                let j = r.engine.filter(|&j| j < ENGINES);
                if let Some(j) = j {
                    m.per_engine[j] += 1;
                }
                m.engines.push(j);
            }
            _ => {
                m.failed += 1;
                m.engines.push(None);
            }
        }
    }
    anyhow::ensure!(
        m.requests > 0,
        "no request through {router} was answered ({} failed)",
        m.failed
    );
    ttfts.sort_by(f64::total_cmp);
    m.cached = cached as f64 / prompt.max(1) as f64;
    m.ttft_mean = ttfts.iter().sum::<f64>() / ttfts.len() as f64;
    m.ttft_p99 = trace::percentile(&ttfts, 0.99);
    m.extra_calls = traffic::extra_calls(&before, &pool.calls());
    Ok(m)
}

fn row(
    router: &str,
    policy: &str,
    placement: Placement,
    formula: [f64; 2],
    sim: Option<&Simulated>,
    m: &Measured,
) -> E18Row {
    let near = |x: f64| (x - m.cached).abs() <= TOLERANCE;
    E18Row {
        router: router.into(),
        policy: policy.into(),
        placement: placement_name(placement).into(),
        cached: [Some(formula[0]), sim.map(|s| s.cached), Some(m.cached)],
        formula_on_run: formula[1],
        sim_spread: sim.map(|s| s.spread),
        ttft_mean_ms: [sim.map(|s| s.ttft_mean * 1e3), Some(m.ttft_mean * 1e3)],
        ttft_p99_ms: [sim.map(|s| s.ttft_p99 * 1e3), Some(m.ttft_p99 * 1e3)],
        per_engine: m.per_engine.clone(),
        requests: m.requests,
        failed: m.failed,
        extra_calls_per_request: m.extra_calls as f64 / m.requests.max(1) as f64,
        agrees: sim.is_none_or(|s| near(s.cached)) && near(formula[1]),
    }
}

fn traffic_cached(x: &E18Row) -> f64 {
    x.cached[2].unwrap_or(0.0)
}

fn p99(x: &E18Row) -> f64 {
    x.ttft_p99_ms[1].unwrap_or(f64::INFINITY)
}

/// The row of the most prompt tokens from cache among `rows` (the lower p99 on a tie).
fn best<'a>(rows: impl Iterator<Item = &'a E18Row>) -> Option<&'a E18Row> {
    rows.max_by(|a, b| {
        traffic_cached(a)
            .total_cmp(&traffic_cached(b))
            .then(p99(b).total_cmp(&p99(a)))
    })
}

fn answer_text(r: &E18Report) -> String {
    let keel = best(r.rows.iter().filter(|x| x.router == "keel"));
    let rr = r
        .rows
        .iter()
        .find(|x| x.router == "keel" && x.policy == "round-robin");
    let peer = best(r.rows.iter().filter(|x| x.router != "keel"));
    let mut s = String::new();
    let (Some(k), Some(rr)) = (keel, rr) else {
        return s;
    };
    let _ = write!(
        s,
        "On Mooncake's conversation trace ({} requests of {} conversations from {:.0} minutes, \
         replayed in {:.0} s at load {} on {} engines of {} blocks), keel's {} serves {:.3} of \
         prompt tokens from cache (closed form {:.3} on the run's placement, {:.3} with {}; \
         simulator {}) against round-robin's {:.3}, at a p99 TTFT of {:.0} ms against {:.0} ms \
         (mean {:.0} against {:.0} ms), with {} requests per engine; one engine with an \
         unbounded cache would serve {:.3}.",
        r.requests,
        r.sessions,
        r.trace_minutes,
        r.replay_seconds,
        r.load,
        r.engines,
        r.kv_blocks,
        k.policy,
        traffic_cached(k),
        k.formula_on_run,
        k.cached[0].unwrap_or(0.0),
        k.placement,
        k.cached[1].map_or("-".into(), |x| format!("{x:.3}")),
        traffic_cached(rr),
        p99(k),
        p99(rr),
        k.ttft_mean_ms[1].unwrap_or(0.0),
        rr.ttft_mean_ms[1].unwrap_or(0.0),
        k.per_engine
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join("/"),
        r.ceiling,
    );
    if let Some(p) = peer {
        let at_least = traffic_cached(k) >= traffic_cached(p);
        let no_worse = p99(k) <= p99(p);
        let _ = write!(
            s,
            " The best peer, {} {}, serves {:.3} at a p99 TTFT of {:.0} ms: keel's hit ratio is \
             {} its, at a p99 TTFT {}.",
            p.router,
            p.policy,
            traffic_cached(p),
            p99(p),
            if at_least { "at least" } else { "below" },
            if no_worse {
                "no worse".to_string()
            } else {
                format!("{:.0} ms worse", p99(k) - p99(p))
            }
        );
    }
    let agree = r.rows.iter().filter(|x| x.agrees).count();
    let _ = write!(
        s,
        " The closed form (Che's characteristic time on the trace's own reuse distances) on each \
         run's placement, and the simulator, are within {TOLERANCE} of the traffic on {agree} of \
         {} rows.",
        r.rows.len()
    );
    s
}

fn finding(r: &E18Report) -> Option<Finding> {
    let k = best(r.rows.iter().filter(|x| x.router == "keel"))?;
    let versus = best(r.rows.iter().filter(|x| x.router != "keel")).or_else(|| {
        r.rows
            .iter()
            .find(|x| x.router == "keel" && x.policy == "round-robin")
    })?;
    let mut f = Finding::new(
        "e18",
        "On a real conversation trace, which routing serves the most prompt tokens from cache?",
        k.policy.clone(),
        "keel defaults".into(),
        traffic_cached(k),
        None,
    );
    f.versus = Some(format!("{} {}", versus.router, versus.policy));
    f.versus_value = Some(traffic_cached(versus));
    f.margin = Some(traffic_cached(k) - traffic_cached(versus));
    f.formula = Some(format!(
        "Che's characteristic time on the trace's reuse distances: {:.3}",
        k.cached[0].unwrap_or(0.0)
    ));
    f.text = r.answer.clone();
    Some(f)
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn table(r: &E18Report) -> Vec<String> {
    let mut out = vec![
        String::new(),
        format!(
            "E18: Mooncake's conversation trace replayed ({} requests, {} conversations, {:.1} \
             req/s, load {}; formula/simulator/traffic)",
            r.requests, r.sessions, r.rate, r.load
        ),
        format!(
            "{:<11} {:<28} {:<19} {:<9} {:<10} {:<11} {:>3}",
            "router", "policy", "cache f/run/sim/t", "mean ms", "p99 ms", "per engine", "ok"
        ),
    ];
    for x in &r.rows {
        out.push(format!(
            "{:<11} {:<28} {:<19} {:<9} {:<10} {:<11} {:>3}",
            x.router,
            x.policy,
            format!(
                "{}/{:.2}/{}/{}",
                opt(x.cached[0], 2),
                x.formula_on_run,
                opt(x.cached[1], 2),
                opt(x.cached[2], 2)
            ),
            format!(
                "{}/{}",
                opt(x.ttft_mean_ms[0], 0),
                opt(x.ttft_mean_ms[1], 0)
            ),
            format!("{}/{}", opt(x.ttft_p99_ms[0], 0), opt(x.ttft_p99_ms[1], 0)),
            x.per_engine
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            if x.agrees { "yes" } else { "no" },
        ));
    }
    for s in &r.skipped {
        out.push(format!("skipped: {s}"));
    }
    out
}

fn html(r: &E18Report) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<h2>E18: a real trace replayed</h2><p>{}</p><table><tr><th>router</th><th>policy</th>\
         <th>closed form's placement</th><th>from cache: formula / formula on the run's \
         placement / simulator / traffic</th>\
         <th>mean TTFT ms: simulator / traffic</th><th>p99 TTFT ms: simulator / traffic</th>\
         <th>requests per engine</th><th>failed</th><th>calls per request besides</th>\
         <th>agrees</th></tr>",
        esc(&r.answer)
    );
    for x in &r.rows {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} / {:.3} / {} / {}</td><td>{} / {}</td>\
             <td>{} / {}</td><td>{}</td><td>{}</td><td>{:.2}</td><td>{}</td></tr>",
            esc(&x.router),
            esc(&x.policy),
            esc(&x.placement),
            opt(x.cached[0], 3),
            x.formula_on_run,
            opt(x.cached[1], 3),
            opt(x.cached[2], 3),
            opt(x.ttft_mean_ms[0], 0),
            opt(x.ttft_mean_ms[1], 0),
            opt(x.ttft_p99_ms[0], 0),
            opt(x.ttft_p99_ms[1], 0),
            x.per_engine
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" / "),
            x.failed,
            x.extra_calls_per_request,
            x.agrees
        );
    }
    let _ = write!(
        h,
        "</table><p>{} requests ({} continue an earlier turn) from {:.0} minutes of the trace, \
         token counts divided by {} (mean prompt {:.0} tokens, output {:.0}), replayed in {:.0} \
         s ({:.1} requests/s, load {} per engine). The simulator is the mean of {SIM_SEEDS} \
         balancer seeds (keel only).</p>",
        r.requests,
        r.continuing,
        r.trace_minutes,
        r.token_divisor,
        r.mean_tokens[0],
        r.mean_tokens[1],
        r.replay_seconds,
        r.rate,
        r.load
    );
    for s in &r.skipped {
        let _ = write!(h, "<p>skipped: {}</p>", esc(s));
    }
    h
}
