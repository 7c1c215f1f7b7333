//! E13-E15: prefix-cache affinity in an inference pool, three ways at once: the closed form
//! (`keel_model::inference::formula`), the simulator (`keel_model::inference::sim`, the same
//! workload through keel-balance's own balancer) and real streaming traffic through `keel proxy`
//! (in this process) to N fake vLLM engines (`keel_testbed::llm`) on loopback, each behind a
//! relay that counts what the router asks it (traffic.rs). `--peers vllm-router,smg` puts vLLM
//! Router and SMG in front of the same engines with the same requests (routers.rs).
//!
//! - E13: prompt tokens from cache against cache pressure (1-48 prefix groups, a cache that
//!   holds them all or not), round-robin against affinity.
//! - E14: where affinity loses: the load above which its mean TTFT passes round-robin's, per
//!   skew of prefix popularity, closed form against simulator (Poisson arrivals).
//! - E15: the measurement table's two workloads (6 groups 6 at a time; one shared prefix 12 at
//!   a time): keel's round-robin and affinity with a relative bound, an absolute threshold of 64
//!   in flight (SMG's `balance_abs_threshold`, which 12 requests in flight never reach: plain
//!   affinity), and the peers.
//!
//! keel's affinity is the `prefix-affinity` strategy when this keel has it; otherwise
//! `rendezvous` on the prompt's first block name, sent by the lab's client in a header (the
//! rows say which).

pub(crate) mod routers;
pub(crate) mod rows;
pub(crate) mod traffic;

use std::fmt::Write as _;
use std::time::Instant;

use keel_balance::StrategyKind;
use keel_model::inference::formula::{self, Popularity, Routing, Workload};
use keel_model::inference::sim::{self, SimConfig};
use keel_model::inference::EngineSpec;

use crate::lab::answer::{self, Finding};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;
use crate::lab::style::esc;
use routers::Router;
use rows::{CrossoverRow, InferenceReport, InferenceRow};

/// Engines in the pool.
const ENGINES: usize = 3;
/// keel's relative bound for affinity (no engine above 1.25 x the mean share).
const BOUND: f64 = 1.25;
/// prefix-affinity "without a bound": one no pool of this size reaches.
const UNBOUNDED: f64 = 1_000_000.0;
/// SMG's default `balance_abs_threshold`.
const ABS_THRESHOLD: u32 = 64;
/// Ratios of mean TTFT closer than this are one as far as the answer goes: round-robin's own
/// runs of the same workload on this 2-core machine differ by up to 0.13 (46 and 52 ms).
const NOISE: f64 = 0.2;
/// Simulator seeds averaged per row.
const SIM_SEEDS: u64 = 5;
/// How far the closed form's share of prompt tokens from cache may be from the simulator's
/// and the traffic's on an E13 row (keel-model's `hit_ratio_holds_off_the_presets` holds it
/// over 486 settings, largest gap 0.030).
pub const HIT_TOLERANCE: f64 = 0.05;
/// prefix-affinity's slack: an endpoint is full only this many calls ahead of the least
/// loaded (keel-balance's `SLACK`), here for the closed form's [`formula::affinity_mix`].
const SLACK: f64 = 5.0;

/// prefix-affinity's estimate of an engine's cache, as docs/configuration.md advises: 0.8 x
/// its KV blocks (the strategy's default, 96, is that for 120 blocks; against engines of
/// 2,400 it forgets most of 48 groups and spreads them, 0.41 from cache against 0.63).
fn estimate_blocks(spec: &EngineSpec) -> u32 {
    (spec.kv_blocks * 4 / 5).max(1) as u32
}

/// The engines of the measurement table: 120 blocks of 16 tokens, 4,000 prompt tokens/s, a
/// step of 6 ms + 0.1 ms per running sequence.
pub fn table_spec() -> EngineSpec {
    EngineSpec {
        step_per_seq_ms: 0.1,
        ..EngineSpec::default()
    }
}

fn workload(groups: usize, popularity: Popularity, requests: u64) -> Workload {
    Workload {
        groups,
        prefix_tokens: 400,
        unique_tokens: 40,
        output_tokens: 24,
        popularity,
        requests: Some(requests),
    }
}

/// E13-E15 as a lab experiment: run only when named, or when `--peers` names an inference
/// router (then E15 with the peers).
pub struct Inference {
    e13: bool,
    e14: bool,
    e15: bool,
    routers: Vec<Router>,
    quick: bool,
    report: Option<InferenceReport>,
}

/// `opts` without the inference routers in `--peers` (for the HTTP peers' experiment).
pub fn others(opts: &LabOptions) -> LabOptions {
    let mut o = opts.clone();
    o.peers.retain(|p| Router::parse(p).is_none());
    o
}

/// keel's affinity: the `prefix-affinity` strategy when built in, else rendezvous on a header.
fn affinity_kind() -> (StrategyKind, bool) {
    match "prefix-affinity".parse::<StrategyKind>() {
        Ok(k) => (k, true),
        Err(_) => (StrategyKind::Rendezvous, false),
    }
}

/// A keel routing of a row.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Keel {
    RoundRobin,
    /// Affinity, with keel's relative bound or none.
    Affinity(Option<f64>),
}

impl Keel {
    fn name(self) -> String {
        match self {
            Keel::RoundRobin => "round-robin".into(),
            Keel::Affinity(None) => "prefix-affinity".into(),
            Keel::Affinity(Some(c)) => format!("prefix-affinity, bound {c}"),
        }
    }

    /// The closed form's mix of this routing at `clients` in flight: round-robin spreads
    /// every group; prefix-affinity partitions them, full at its bound and [`SLACK`] ahead.
    fn mix(self, w: &Workload, clients: usize) -> Vec<Vec<f64>> {
        let shares = w.popularity.shares(w.groups);
        match self {
            Keel::RoundRobin => formula::mix(&shares, ENGINES, Routing::Balanced),
            Keel::Affinity(bound) => formula::affinity_mix(
                &shares,
                ENGINES,
                bound.unwrap_or(UNBOUNDED),
                SLACK,
                clients as f64,
            ),
        }
    }

    fn strategy(self) -> StrategyKind {
        match self {
            Keel::RoundRobin => StrategyKind::RoundRobin,
            Keel::Affinity(_) => affinity_kind().0,
        }
    }

    /// The cluster's strategy lines of the proxy's configuration, for engines of `spec`.
    fn toml(self, spec: &EngineSpec) -> String {
        match self {
            Keel::RoundRobin => "strategy = \"round-robin\"\n".into(),
            Keel::Affinity(bound) => {
                let b = bound.map_or(String::new(), |c| format!("bounded_load = {c}\n"));
                if affinity_kind().1 {
                    // prefix-affinity is always bounded: a bound no pool of this size reaches.
                    let b = bound.map_or(format!("bounded_load = {UNBOUNDED:.1}\n"), |_| b);
                    format!(
                        "strategy = \"prefix-affinity\"\n{b}cache_blocks = {}\n",
                        estimate_blocks(spec)
                    )
                } else {
                    format!(
                        "strategy = \"rendezvous\"\nhash_on = \"header:{}\"\n{b}",
                        traffic::PREFIX_HEADER
                    )
                }
            }
        }
    }
}

/// One case of E13 or E15.
#[derive(Debug, Clone)]
struct Case {
    experiment: &'static str,
    label: String,
    w: Workload,
    spec: EngineSpec,
    clients: usize,
}

impl Inference {
    /// From `--experiments` and `--peers`.
    pub fn new(opts: &LabOptions) -> Self {
        let named = |e: &str| opts.experiments.iter().any(|x| x == e);
        let routers: Vec<Router> = opts.peers.iter().filter_map(|p| Router::parse(p)).collect();
        Inference {
            e13: named("e13"),
            e14: named("e14"),
            // With --peers alone, E15; E18 takes the peers itself.
            e15: named("e15") || (!routers.is_empty() && !named("e18")),
            routers,
            quick: opts.quick,
            report: None,
        }
    }

    fn requests(&self, full: u64, quick: u64) -> u64 {
        if self.quick {
            quick
        } else {
            full
        }
    }

    fn cases(&self) -> Vec<Case> {
        let mut out = Vec::new();
        let spec = table_spec();
        if self.e13 {
            let groups: &[usize] = if self.quick {
                &[3, 12]
            } else {
                &[1, 3, 6, 12, 48]
            };
            // Small: 120 blocks hold under 5 prefixes of 25 blocks; large: all 48 and what
            // is in flight.
            let kvs: &[usize] = if self.quick { &[120] } else { &[120, 2400] };
            for &kv in kvs {
                for &g in groups {
                    out.push(Case {
                        experiment: "e13",
                        label: format!("{g} groups, cache {kv} blocks"),
                        w: workload(g, Popularity::Zipf(0.0), self.requests(150, 36)),
                        spec: EngineSpec {
                            kv_blocks: kv,
                            ..spec
                        },
                        clients: 6,
                    });
                }
            }
        }
        if self.e15 {
            out.push(Case {
                experiment: "e15",
                label: "6 prefix groups of 400 tokens + 40 unique, 6 at a time".into(),
                w: workload(6, Popularity::Zipf(0.0), self.requests(150, 48)),
                spec,
                clients: 6,
            });
            out.push(Case {
                experiment: "e15",
                label: "1 shared prefix, 12 at a time".into(),
                w: workload(1, Popularity::Zipf(0.0), self.requests(150, 48)),
                spec,
                clients: 12,
            });
        }
        out
    }

    fn keel_routings(&self, c: &Case) -> Vec<Keel> {
        if c.experiment == "e15" {
            vec![
                Keel::RoundRobin,
                Keel::Affinity(Some(BOUND)),
                Keel::Affinity(None),
            ]
        } else {
            vec![Keel::RoundRobin, Keel::Affinity(Some(BOUND))]
        }
    }
}

impl Experiment for Inference {
    fn names(&self) -> &'static [&'static str] {
        &["e13", "e14", "e15"]
    }

    fn plan(&self) -> Vec<Planned> {
        let mut plan = Vec::new();
        for c in self.cases() {
            let peers = if c.experiment == "e15" {
                2 * self.routers.iter().filter(|r| r.find().is_some()).count()
            } else {
                0
            };
            let runs = self.keel_routings(&c).len() + peers;
            plan.push(Planned {
                what: format!("{} {}", c.experiment, c.label),
                requests: c.w.requests.unwrap_or(0) * runs as u64,
            });
        }
        if self.e14 {
            plan.push(Planned {
                what: "e14 crossover load per skew (formula, simulator, traffic at one load)"
                    .into(),
                requests: if self.quick {
                    2 * QUICK_TRAFFIC_REQUESTS as u64
                } else {
                    (2 * TRAFFIC_REQUESTS * skews().len()) as u64
                },
            });
        }
        plan
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut rows = Vec::new();
        let mut skipped = Vec::new();
        for c in self.cases() {
            if let Some(bar) = lab.bar {
                bar.set_message(format!("{} {}", c.experiment, c.label));
            }
            for k in self.keel_routings(&c) {
                rows.push(keel_row(lab, &c, k)?);
            }
            if c.experiment == "e15" {
                for &r in &self.routers {
                    let Some(bin) = r.find() else {
                        if !skipped.iter().any(|s: &String| s.starts_with(r.name())) {
                            skipped.push(format!(
                                "{}: not found (KEEL_{}, ~/.cache/keel/inference-peers/bin, \
                                 PATH; scripts/install-inference-peers.sh installs it)",
                                r.name(),
                                r.name().to_ascii_uppercase().replace('-', "_")
                            ));
                        }
                        continue;
                    };
                    for policy in ["round_robin", "cache_aware"] {
                        match peer_row(lab, &c, r, &bin, policy) {
                            Ok(row) => rows.push(row),
                            Err(e) => skipped.push(format!("{} {policy}: {e:#}", r.name())),
                        }
                    }
                }
            }
        }
        let crossover = if self.e14 {
            crossovers(lab, self.quick)?
        } else {
            Vec::new()
        };
        let (_, built_in) = affinity_kind();
        let mut report = InferenceReport {
            answer: String::new(),
            rows,
            crossover,
            affinity: if built_in {
                "prefix-affinity (keel-balance)".into()
            } else {
                format!(
                    "rendezvous on the prompt's first block name in `{}` (prefix-affinity is not \
                     in this keel)",
                    traffic::PREFIX_HEADER
                )
            },
            skipped,
            seconds: started.elapsed().as_secs_f64(),
        };
        report.answer = answer_text(&report) + &crossover_answer(&report);
        self.report = Some(report);
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.inference = self.report.take();
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report
            .inference
            .as_ref()
            .and_then(finding)
            .into_iter()
            .collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.inference.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, wide: bool) {
        if let Some(r) = &report.inference {
            for line in table(r, wide) {
                println!("{line}");
            }
        }
    }
}

/// Runs the simulator over [`SIM_SEEDS`] seeds: mean cached share, mean TTFT (s), and the
/// mean of the closed form given each run's own mix (a hash strategy's seed moves its
/// partition: an averaged mix would be none of them).
fn simulate(
    c: &Case,
    strategy: StrategyKind,
    bounded_load: Option<f64>,
    seed: u64,
) -> anyhow::Result<(f64, f64, f64)> {
    let (mut cached, mut ttft, mut on_mix) = (0.0, 0.0, 0.0);
    let fa = formula::Arrivals::Clients(c.clients);
    for s in 0..SIM_SEEDS {
        let r = sim::run(&SimConfig {
            engines: ENGINES,
            bounded_load,
            cache_blocks: Some(estimate_blocks(&c.spec)),
            spec: c.spec,
            strategy,
            workload: c.w,
            arrivals: sim::Arrivals::Clients(c.clients),
            seed: seed.wrapping_mul(31).wrapping_add(s),
        })
        .map_err(|e| anyhow::anyhow!("simulating {}: {e}", c.label))?;
        cached += r.cached;
        ttft += r.ttft_mean;
        on_mix += formula::pool_of_run(&c.spec, &c.w, &r.mix, fa).cached;
    }
    let n = SIM_SEEDS as f64;
    Ok((cached / n, ttft / n, on_mix / n))
}

fn keel_row(lab: &Lab<'_>, c: &Case, k: Keel) -> anyhow::Result<InferenceRow> {
    let requests = c.w.requests.unwrap_or(150);
    let fa = formula::Arrivals::Clients(c.clients);
    let f = formula::pool_with_mix(&c.spec, &c.w, &k.mix(&c.w, c.clients), fa);
    // The simulator runs the strategy the proxy runs, bound and all (the stand-in
    // rendezvous's bounded row only with the proxy: its key is the lab client's header).
    let built_in = affinity_kind().1;
    let simmed = match k {
        Keel::Affinity(Some(_)) if !built_in => None,
        Keel::Affinity(bound) => Some(simulate(
            c,
            k.strategy(),
            Some(bound.unwrap_or(UNBOUNDED)),
            lab.seed,
        )?),
        Keel::RoundRobin => Some(simulate(c, k.strategy(), None, lab.seed)?),
    };
    let prompts = traffic::Prompts::new(&c.w, &c.spec, requests as usize, lab.seed);
    let m = keel_traffic(
        lab,
        c.spec,
        k,
        &prompts,
        &c.w,
        traffic::Offered::Clients(c.clients),
    )?;
    lab.done.set(lab.done.get() + requests);
    let on = |mix: &[Vec<f64>]| formula::pool_of_run(&c.spec, &c.w, mix, fa).cached;
    Ok(row(
        c,
        "keel",
        &k.name(),
        Some((f.cached, f.ttft)),
        simmed,
        &m,
        Some(on(&m.mix)),
    ))
}

/// Real traffic through `keel proxy` with routing `k` to fresh engines of `spec`.
fn keel_traffic(
    lab: &Lab<'_>,
    spec: EngineSpec,
    k: Keel,
    prompts: &traffic::Prompts,
    w: &Workload,
    offered: traffic::Offered,
) -> anyhow::Result<traffic::Measured> {
    let seed = lab.seed;
    let text = k.toml(&spec);
    lab.runtime.block_on(async {
        let pool = traffic::Pool::start(ENGINES, spec, seed).await?;
        let endpoints: Vec<String> = pool
            .addrs()
            .iter()
            .map(|a| format!("{{ address = \"{a}\" }}"))
            .collect();
        let config = format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"llm\"\n\n[[cluster]]\n\
             name = \"llm\"\n{text}seed = {seed}\nendpoints = [{}]\n",
            endpoints.join(", ")
        );
        let config = keel_proxy::ProxyConfig::from_toml_str(&config, "inference.toml")
            .map_err(|e| anyhow::anyhow!("the inference lab's proxy configuration: {e}"))?;
        let proxy = keel_proxy::start(config).await?;
        let m = traffic::drive(
            &pool,
            proxy.listener_addrs()[0],
            prompts,
            w.groups,
            w.output_tokens,
            offered,
            &|| {
                if let Some(bar) = lab.bar {
                    bar.inc(1);
                }
            },
        )
        .await;
        proxy.shutdown(std::time::Duration::from_millis(200)).await;
        pool.shutdown().await;
        m
    })
}

fn peer_row(
    lab: &Lab<'_>,
    c: &Case,
    r: Router,
    bin: &std::path::PathBuf,
    policy: &str,
) -> anyhow::Result<InferenceRow> {
    let requests = c.w.requests.unwrap_or(150);
    let seed = lab.seed;
    let log = lab
        .out
        .join(format!("{}-{policy}-{}.log", r.name(), c.w.groups));
    std::fs::create_dir_all(lab.out)?;
    let m = lab.runtime.block_on(async {
        let pool = traffic::Pool::start(ENGINES, c.spec, seed).await?;
        let m = async {
            let peer = routers::start(r, bin, policy, pool.addrs(), &log).await?;
            let prompts = traffic::Prompts::new(&c.w, &c.spec, requests as usize, seed);
            traffic::drive(
                &pool,
                peer.addr,
                &prompts,
                c.w.groups,
                c.w.output_tokens,
                traffic::Offered::Clients(c.clients),
                &|| {
                    if let Some(bar) = lab.bar {
                        bar.inc(1);
                    }
                },
            )
            .await
        }
        .await;
        pool.shutdown().await;
        m
    })?;
    lab.done.set(lab.done.get() + requests);
    let fa = formula::Arrivals::Clients(c.clients);
    let on = formula::pool_of_run(&c.spec, &c.w, &m.mix, fa).cached;
    Ok(row(c, r.name(), policy, None, None, &m, Some(on)))
}

fn row(
    c: &Case,
    router: &str,
    policy: &str,
    formula: Option<(f64, f64)>,
    sim: Option<(f64, f64, f64)>,
    m: &traffic::Measured,
    formula_on_traffic_mix: Option<f64>,
) -> InferenceRow {
    let most = m.per_engine.iter().copied().max().unwrap_or(0);
    let least = m.per_engine.iter().copied().min().unwrap_or(0);
    InferenceRow {
        experiment: c.experiment.into(),
        workload: c.label.clone(),
        groups: c.w.groups,
        kv_blocks: c.spec.kv_blocks,
        clients: c.clients,
        requests: m.requests,
        router: router.into(),
        policy: policy.into(),
        formula_cached: formula.map(|f| f.0),
        sim_cached: sim.map(|s| s.0),
        traffic_cached: Some(m.cached()),
        formula_on_sim_mix: sim.map(|s| s.2),
        formula_on_traffic_mix,
        formula_holds: formula.map(|f| {
            let near = |x: Option<f64>| x.is_none_or(|x| (f.0 - x).abs() <= HIT_TOLERANCE);
            near(sim.map(|s| s.0)) && near(Some(m.cached()))
        }),
        formula_ttft_ms: formula.map(|f| f.1 * 1e3),
        sim_ttft_ms: sim.map(|s| s.1 * 1e3),
        traffic_ttft_ms: Some(m.ttft_mean * 1e3),
        per_engine: m.per_engine.clone(),
        busiest_over_idlest: if least == 0 {
            f64::INFINITY
        } else {
            most as f64 / least as f64
        },
        extra_calls_per_request: Some(m.extra_calls as f64 / m.requests.max(1) as f64),
        extra_paths: m.extra_paths.iter().map(|(k, v)| (k.clone(), *v)).collect(),
    }
}

/// The skews of E14, 6 groups: uniform, Zipf 1, Zipf 2, and one prefix taking all.
fn skews() -> Vec<(String, Workload)> {
    let w = |p: Popularity| Workload {
        requests: None,
        ..workload(6, p, 0)
    };
    vec![
        ("uniform (6 groups)".into(), w(Popularity::Zipf(0.0))),
        ("Zipf 1".into(), w(Popularity::Zipf(1.0))),
        ("Zipf 2".into(), w(Popularity::Zipf(2.0))),
        ("one prefix".into(), w(Popularity::Hot(1.0))),
    ]
}

/// Loads of E14's scan: 0.2 to 0.9 in steps of 0.1.
fn loads() -> Vec<f64> {
    (2..=9).map(|i| f64::from(i) / 10.0).collect()
}

/// The highest load of the first run of wins, scanning `wins` in order of `loads()`.
fn first_run(wins: &[bool]) -> Option<f64> {
    let ls = loads();
    let mut last = None;
    for (i, &w) in wins.iter().enumerate() {
        if !w {
            return last;
        }
        last = Some(ls[i]);
    }
    last.map(|_| 1.0)
}

/// Load per engine of E14's real traffic.
const TRAFFIC_LOAD: f64 = 0.5;
/// Requests per routing and skew in E14's real traffic (full runs).
const TRAFFIC_REQUESTS: usize = 90;
/// The quick form's: uniform groups only, where the two routings' TTFTs differ most (25 against
/// 62 ms in a full run), so that a few requests give the verdict.
const QUICK_TRAFFIC_REQUESTS: usize = 30;

fn crossovers(lab: &Lab<'_>, quick: bool) -> anyhow::Result<Vec<CrossoverRow>> {
    let seed = lab.seed;
    let spec = table_spec();
    let requests = if quick { 1500 } else { 4000 };
    let (kind, _) = affinity_kind();
    skews()
        .into_iter()
        .map(|(name, w)| {
            // The closed form is given the partition the simulated strategy makes (a hash
            // does not place groups largest first), taken from a run at load 0.5.
            let mid = formula::rate_at_load(&spec, &w, ENGINES, 0.5);
            let mix = sim::run(&SimConfig {
                engines: ENGINES,
                bounded_load: None,
                cache_blocks: Some(estimate_blocks(&spec)),
                spec,
                strategy: kind,
                workload: Workload {
                    requests: Some(requests),
                    ..w
                },
                arrivals: sim::Arrivals::Poisson(mid),
                seed,
            })
            .map(|r| r.mix)
            .unwrap_or_default();
            let own: Vec<bool> = loads()
                .iter()
                .map(|&rho| formula::compare(&spec, &w, ENGINES, None, rho).wins)
                .collect();
            let fwins: Vec<bool> = loads()
                .iter()
                .map(|&rho| {
                    let a = formula::Arrivals::Load(rho);
                    let aff = formula::pool_with_mix(&spec, &w, &mix, a);
                    let bal = formula::pool(&spec, &w, ENGINES, Routing::Balanced, a);
                    aff.ttft < bal.ttft
                })
                .collect();
            let swins: Vec<bool> = loads()
                .iter()
                .map(|&rho| {
                    let rate = formula::rate_at_load(&spec, &w, ENGINES, rho);
                    let run = |strategy| {
                        sim::run(&SimConfig {
                            engines: ENGINES,
                            bounded_load: None,
                            cache_blocks: Some(estimate_blocks(&spec)),
                            spec,
                            strategy,
                            workload: Workload {
                                requests: Some(requests),
                                ..w
                            },
                            arrivals: sim::Arrivals::Poisson(rate),
                            seed,
                        })
                        .map(|r| r.ttft_mean)
                        .unwrap_or(f64::INFINITY)
                    };
                    run(kind) < run(StrategyKind::RoundRobin)
                })
                .collect();
            let (f, on_mix, s) = (first_run(&own), first_run(&fwins), first_run(&swins));
            let agrees = match (f, s) {
                (Some(a), Some(b)) => (a - b).abs() <= 0.1 + 1e-9,
                (None, None) => true,
                (Some(a), None) | (None, Some(a)) => a <= 0.2 + 1e-9,
            };
            // Real traffic at one load: does it side with the closed form there?
            let n = if quick {
                QUICK_TRAFFIC_REQUESTS
            } else {
                TRAFFIC_REQUESTS
            };
            let traffic = if quick && w.popularity != Popularity::Zipf(0.0) {
                None
            } else {
                let rate = formula::rate_at_load(&spec, &w, ENGINES, TRAFFIC_LOAD);
                let prompts = traffic::Prompts::new(&w, &spec, n, seed);
                let offered = traffic::Offered::Poisson { rate, seed };
                let aff = keel_traffic(
                    lab,
                    spec,
                    Keel::Affinity(Some(BOUND)),
                    &prompts,
                    &w,
                    offered,
                )?;
                let rr = keel_traffic(lab, spec, Keel::RoundRobin, &prompts, &w, offered)?;
                lab.done.set(lab.done.get() + 2 * n as u64);
                Some((aff.ttft_mean * 1e3, rr.ttft_mean * 1e3))
            };
            let form_wins = formula::compare(&spec, &w, ENGINES, None, TRAFFIC_LOAD).wins;
            Ok(CrossoverRow {
                skew: name,
                formula: f,
                formula_on_sim_mix: on_mix,
                sim: s,
                agrees,
                traffic_load: traffic.map(|_| TRAFFIC_LOAD),
                traffic_affinity_ttft_ms: traffic.map(|t| t.0),
                traffic_round_robin_ttft_ms: traffic.map(|t| t.1),
                traffic_agrees: traffic.map(|(a, r)| (a < r) == form_wins),
            })
        })
        .collect()
}

/// "affinity stops paying above load X" (offered load per engine, the closed form's grid up
/// to 10: batching engines keep up past 1).
fn stops_text(x: Option<f64>) -> String {
    match x {
        None => "affinity does not pay even at load 0.01 per engine".into(),
        Some(v) if v.is_infinite() => {
            "affinity does not stop paying up to offered load 10 per engine".into()
        }
        Some(v) => format!("affinity stops paying above load {v:.2} per engine"),
    }
}

fn load_text(x: Option<f64>) -> String {
    match x {
        None => "below 0.2".into(),
        Some(v) if v >= 1.0 => "none up to 0.9".into(),
        Some(v) => format!("{v:.1}"),
    }
}

/// "For this pool, use X; affinity stops paying above load Y". With E15's workloads measured,
/// X is the keel policy whose worst mean TTFT against round-robin's over those workloads is
/// lowest (a policy that wins one workload and collapses on the other is not the answer);
/// otherwise the lowest mean TTFT of the rows run.
fn answer_text(r: &InferenceReport) -> String {
    let limit = formula::affinity_limit(
        &table_spec(),
        &workload(6, Popularity::Zipf(0.0), 150),
        ENGINES,
        Some(BOUND),
    );
    if let Some(text) = worst_case_answer(r, limit) {
        return text;
    }
    let rows: Vec<&InferenceRow> = r
        .rows
        .iter()
        .filter(|x| x.router == "keel" && x.groups > 1)
        .collect();
    let best = rows.iter().min_by(|a, b| {
        a.traffic_ttft_ms
            .unwrap_or(f64::INFINITY)
            .total_cmp(&b.traffic_ttft_ms.unwrap_or(f64::INFINITY))
    });
    match best {
        Some(b) => format!(
            "For this pool, use keel's {}; {} (closed form, uniform groups). Measured on \
             {ENGINES} engines of {} KV blocks, {} prefix groups: {:.2} of prompt tokens from \
             cache, mean TTFT {:.0} ms.",
            b.policy,
            stops_text(limit),
            b.kv_blocks,
            b.groups,
            b.traffic_cached.unwrap_or(0.0),
            b.traffic_ttft_ms.unwrap_or(0.0),
        ),
        None => format!(
            "For this pool, {} (closed form, 6 uniform groups).",
            stops_text(limit)
        ),
    }
}

/// E14's part of the answer: per skew, the load above which affinity stops paying, as the
/// simulator found it (and whether the closed form agrees).
fn crossover_answer(r: &InferenceReport) -> String {
    if r.crossover.is_empty() {
        return String::new();
    }
    let each: Vec<String> = r
        .crossover
        .iter()
        .map(|x| {
            let at = match x.sim {
                None => "at no load from 0.2".to_string(),
                Some(v) if v >= 1.0 => "at every load up to 0.9".to_string(),
                Some(v) => format!("up to load {v:.1}"),
            };
            format!(
                "{} {at}{}",
                x.skew,
                if x.agrees {
                    ""
                } else {
                    " (the closed form differs)"
                }
            )
        })
        .collect();
    format!(
        " Against round-robin on 6 groups (E14, simulator, Poisson arrivals), affinity pays: {}.",
        each.join("; ")
    )
}

/// The answer from E15's keel rows: each policy's mean TTFT over round-robin's on every
/// workload measured; among the policies whose worst ratio is within [`NOISE`] of the lowest,
/// the one with the lowest mean ratio.
fn worst_case_answer(r: &InferenceReport, limit: Option<f64>) -> Option<String> {
    let keel: Vec<&InferenceRow> = r
        .rows
        .iter()
        .filter(|x| x.router == "keel" && x.experiment == "e15" && x.traffic_ttft_ms.is_some())
        .collect();
    let mut workloads: Vec<&str> = Vec::new();
    for x in &keel {
        if !workloads.contains(&x.workload.as_str()) {
            workloads.push(&x.workload);
        }
    }
    let rr_ttft = |w: &str| {
        keel.iter()
            .find(|x| x.workload == w && x.policy == "round-robin")
            .and_then(|x| x.traffic_ttft_ms)
    };
    let mut policies: Vec<&str> = keel.iter().map(|x| x.policy.as_str()).collect();
    policies.sort_unstable();
    policies.dedup();
    // (policy, [(workload, ratio)], worst, mean)
    let mut scored = Vec::new();
    for p in policies {
        let mut ratios = Vec::new();
        for w in &workloads {
            let (Some(rr), Some(row)) = (
                rr_ttft(w),
                keel.iter().find(|x| x.workload == *w && x.policy == p),
            ) else {
                continue;
            };
            if rr > 0.0 {
                ratios.push((*w, row.traffic_ttft_ms.unwrap_or(f64::INFINITY) / rr));
            }
        }
        if ratios.len() < 2 {
            continue;
        }
        let worst = ratios.iter().map(|x| x.1).fold(0.0, f64::max);
        let mean = ratios.iter().map(|x| x.1).sum::<f64>() / ratios.len() as f64;
        scored.push((p, ratios, worst, mean));
    }
    let lowest = scored.iter().map(|x| x.2).fold(f64::INFINITY, f64::min);
    let (p, ratios, _, _) = scored
        .into_iter()
        .filter(|x| x.2 <= lowest + NOISE)
        .min_by(|a, b| a.3.total_cmp(&b.3).then(a.2.total_cmp(&b.2)))?;
    let each: Vec<String> = ratios
        .iter()
        .map(|(w, x)| format!("{x:.2}x with {w}"))
        .collect();
    Some(format!(
        "For this pool, use keel's {p}: its mean TTFT is {} of round-robin's (the best mean \
         of the policies whose worst workload is within {NOISE} of the best worst); {} (closed \
         form, uniform groups).",
        each.join(", "),
        stops_text(limit),
    ))
}

fn finding(r: &InferenceReport) -> Option<Finding> {
    let rr = r
        .rows
        .iter()
        .find(|x| x.router == "keel" && x.policy == "round-robin" && x.groups > 1)?;
    let best = r
        .rows
        .iter()
        .filter(|x| x.router == "keel" && x.groups == rr.groups && x.kv_blocks == rr.kv_blocks)
        .min_by(|a, b| {
            a.traffic_ttft_ms
                .unwrap_or(f64::INFINITY)
                .total_cmp(&b.traffic_ttft_ms.unwrap_or(f64::INFINITY))
        })?;
    let mut f = Finding::new(
        "e13-e15",
        "When does prefix-cache affinity pay in an inference pool?",
        best.policy.clone(),
        String::new(),
        best.traffic_cached.unwrap_or(0.0),
        None,
    );
    f.against(
        format!("round-robin on {}", rr.workload),
        rr.traffic_cached.unwrap_or(0.0),
        best.traffic_cached.unwrap_or(0.0) - rr.traffic_cached.unwrap_or(0.0),
        None,
        false,
    );
    f.text = r.answer.clone();
    Some(f)
}

/// A row's "f ok" cell.
fn holds_text(x: Option<bool>) -> &'static str {
    match x {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    }
}

/// "6 of 6 rows", and the largest gap of the closed form (its own mix) to a run.
fn holds_summary(r: &InferenceReport) -> String {
    let keel: Vec<&InferenceRow> = r
        .rows
        .iter()
        .filter(|x| x.formula_holds.is_some())
        .collect();
    let held = keel
        .iter()
        .filter(|x| x.formula_holds == Some(true))
        .count();
    let gap = keel
        .iter()
        .flat_map(|x| [x.sim_cached, x.traffic_cached].map(|y| x.formula_cached.zip(y)))
        .flatten()
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    format!("{held} of {} rows, largest gap {gap:.3}", keel.len())
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("-".into(), |v| format!("{v:.digits$}"))
}

/// The worst gap between the closed form (given the run's own mix) and a run, over the rows.
pub fn worst_gap(r: &InferenceReport) -> f64 {
    r.rows
        .iter()
        .flat_map(|x| {
            [
                x.formula_on_sim_mix.zip(x.sim_cached),
                x.formula_on_traffic_mix.zip(x.traffic_cached),
            ]
        })
        .flatten()
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

/// The terminal tables: the answer first, then E13, E15 and E14.
fn table(r: &InferenceReport, wide: bool) -> Vec<String> {
    // The answer is the finding printed first ("What this run shows").
    let cols = crate::lab::report::COLUMNS;
    let mut out = vec![format!(
        "E13-E15: prompt tokens from cache and mean TTFT, {ENGINES} fake vLLM engines"
    )];
    out.push(format!(
        "{:<4} {:>3} {:>5} {:>3} {:<12} {:<26} {:>5} {:>5} {:>5} {:>4} {:>5} {:>5} {:>5} {:>5}",
        "exp",
        "grp",
        "kv",
        "cl",
        "router",
        "policy",
        "f.hit",
        "s.hit",
        "t.hit",
        "f ok",
        "f.ttf",
        "s.ttf",
        "t.ttf",
        "extra"
    ));
    for x in &r.rows {
        let mut line = format!(
            "{:<4} {:>3} {:>5} {:>3} {:<12} {:<26} {:>5} {:>5} {:>5} {:>4} {:>5} {:>5} {:>5} {:>5}",
            x.experiment,
            x.groups,
            x.kv_blocks,
            x.clients,
            x.router,
            crate::lab::report::fit(&x.policy, 26),
            opt(x.formula_cached, 2),
            opt(x.sim_cached, 2),
            opt(x.traffic_cached, 2),
            holds_text(x.formula_holds),
            opt(x.formula_ttft_ms, 0),
            opt(x.sim_ttft_ms, 0),
            opt(x.traffic_ttft_ms, 0),
            opt(x.extra_calls_per_request, 1),
        );
        if wide {
            let per: Vec<String> = x.per_engine.iter().map(u64::to_string).collect();
            let _ = write!(line, " {}", per.join("/"));
        }
        out.push(line);
    }
    out.extend(answer::wrap(
        &format!(
            "Hit: share of prompt tokens from cache (f formula, s simulator, t traffic); f ok: the \
             formula within {HIT_TOLERANCE} of both ({}); ttf: mean time to first token, ms \
             (the formula's is the service time: no queueing in a closed \
             loop); extra: calls to the engines per request besides it. Largest gap between the \
             closed form given a run's own mix and that run: {:.3}. keel's affinity: {}.",
            holds_summary(r),
            worst_gap(r),
            r.affinity
        ),
        cols,
        "",
    ));
    if !r.crossover.is_empty() {
        out.push(
            "E14: the load per engine above which affinity's mean TTFT passes round-robin's; \
             traffic: both at one load (quick: uniform groups only)"
                .into(),
        );
        for x in &r.crossover {
            out.push(format!(
                "  {:<18} formula {:<14} on sim mix {:<14} sim {:<14} {}; traffic {}",
                x.skew,
                load_text(x.formula),
                load_text(x.formula_on_sim_mix),
                load_text(x.sim),
                if x.agrees { "agrees" } else { "differs" },
                traffic_text(x)
            ));
        }
    }
    for s in &r.skipped {
        out.extend(answer::wrap(&format!("Skipped: {s}"), cols, ""));
    }
    out
}

/// E14's traffic cell: both TTFTs at the load, and whether the closed form's verdict holds.
fn traffic_text(x: &CrossoverRow) -> String {
    match (
        x.traffic_load,
        x.traffic_affinity_ttft_ms,
        x.traffic_round_robin_ttft_ms,
        x.traffic_agrees,
    ) {
        (Some(l), Some(a), Some(r), Some(ok)) => format!(
            "at {l}: affinity {a:.0} ms, round-robin {r:.0} ms ({})",
            if ok {
                "as the closed form"
            } else {
                "not as the closed form"
            }
        ),
        _ => "not run".into(),
    }
}

fn html(r: &InferenceReport) -> String {
    let mut h = String::from(
        "<h2 id=\"inference\">E13-E15: prefix-cache affinity in an inference pool</h2>",
    );
    let _ = write!(h, "<p><b>{}</b></p>", esc(&r.answer));
    h.push_str(
        "<table><tr><th class=\"l\">exp.</th><th class=\"l\">workload</th><th>KV blocks</th>\
         <th class=\"l\">router</th><th class=\"l\">policy</th><th>cached, formula</th>\
         <th>simulator</th><th>traffic</th><th>formula within 0.05</th>\
         <th>TTFT ms, formula</th><th>simulator</th>\
         <th>traffic</th><th class=\"l\">per engine</th><th>extra calls / request</th></tr>",
    );
    for x in &r.rows {
        let per: Vec<String> = x.per_engine.iter().map(u64::to_string).collect();
        let _ = write!(
            h,
            "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td>\
             <td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td>\
             <td>{}</td><td class=\"l\">{}</td><td>{}</td></tr>",
            x.experiment,
            esc(&x.workload),
            x.kv_blocks,
            esc(&x.router),
            esc(&x.policy),
            opt(x.formula_cached, 3),
            opt(x.sim_cached, 3),
            opt(x.traffic_cached, 3),
            holds_text(x.formula_holds),
            opt(x.formula_ttft_ms, 0),
            opt(x.sim_ttft_ms, 0),
            opt(x.traffic_ttft_ms, 0),
            per.join("/"),
            opt(x.extra_calls_per_request, 2),
        );
    }
    h.push_str("</table>");
    if !r.crossover.is_empty() {
        h.push_str(
            "<h3>E14: where affinity loses</h3><p>The crossover load is closed form and \
             simulator (a scan of 8 loads); real traffic (Poisson arrivals; the quick form: \
             uniform groups only) \
             checks the verdict at one load.</p><table><tr><th class=\"l\">skew</th>\
             <th>closed form</th><th>closed form, simulator's partition</th><th>simulator</th>\
             <th class=\"l\">verdict</th><th class=\"l\">traffic</th></tr>",
        );
        for x in &r.crossover {
            let _ = write!(
                h,
                "<tr><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class=\"l\">{}</td><td class=\"l\">{}</td></tr>",
                esc(&x.skew),
                load_text(x.formula),
                load_text(x.formula_on_sim_mix),
                load_text(x.sim),
                if x.agrees { "agrees" } else { "differs" },
                esc(&traffic_text(x))
            );
        }
        h.push_str("</table>");
    }
    let _ = write!(
        h,
        "<p><small>{ENGINES} fake vLLM engines (keel backend --llm, in this process) on \
         loopback, each behind a relay counting the calls it gets by path; streaming \
         completions, prompts of 400 prefix tokens + 40 of their own, 24 tokens out. keel's \
         affinity: {}. Closed form within {HIT_TOLERANCE} of simulator and traffic: {}. \
         Largest gap \
         between the closed form given a run's own mix and that run: {:.3}. SMG's \
         balance_abs_threshold of {ABS_THRESHOLD} in flight is never reached by \
         12 requests in flight: there it is plain affinity. {:.0} s.{}</small></p>",
        esc(&r.affinity),
        holds_summary(r),
        worst_gap(r),
        r.seconds,
        r.skipped
            .iter()
            .map(|s| format!(" Skipped: {}.", esc(s)))
            .collect::<String>()
    );
    h
}
