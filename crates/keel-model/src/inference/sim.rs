//! The inference pool in virtual time: engines of [`super::engine`] behind keel-balance's own
//! [`Balancer`], fed by a seeded workload of prompts that share prefixes.
//!
//! A request is its group's prefix text, then its own random suffix, named in blocks by
//! `keel_balance::prefix::PrefixHasher` (the engine's and the proxy's rule). It is picked with
//! `PickContext::with_prefix(blocks)` (and the first block's name as the hash key, so the hash
//! strategies partition the groups), submitted to the engine, and finished on the balancer when
//! the engine reports it finished. An engine steps back to back while it has work; a step's
//! events happen at its end.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use keel_balance::prefix::PrefixHasher;
use keel_balance::{mix64, Balancer, BalancerConfig, EndpointSpec, Outcome, Pick, PickContext};
use keel_balance::{BuildError, EndpointId, StrategyKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::engine::{Engine, Event, Request, SubmitError};
use super::formula::Workload;
use super::EngineSpec;
use crate::vocab::FailureMode;

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// Closed loop: this many clients, each sending its next request when the last finishes
    /// (the measurement table's "N at a time").
    Clients(usize),
    /// Open loop: Poisson arrivals at this many requests per second to the pool.
    Poisson(f64),
}

/// One run of the simulator.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Engines in the pool.
    pub engines: usize,
    /// Each engine.
    pub spec: EngineSpec,
    /// The balancer's strategy.
    pub strategy: StrategyKind,
    /// Its bound on an endpoint's load as a multiple of the mean (`bounded_load`): `None`
    /// keeps the strategy's default (prefix-affinity 1.25, the hash strategies none).
    pub bounded_load: Option<f64>,
    /// prefix-affinity's estimate of each engine's cache, in blocks (`cache_blocks`): `None`
    /// keeps the strategy's default (96, 0.8 x the default engine's 120).
    pub cache_blocks: Option<u32>,
    /// The prompts; `workload.requests` is how many to send (default 1,000).
    pub workload: Workload,
    /// How they arrive.
    pub arrivals: Arrivals,
    /// The seed of the group choices, suffixes, arrivals and the balancer.
    pub seed: u64,
}

/// Why a run could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The balancer refused its configuration.
    #[error("cannot build the balancer: {0}")]
    Balancer(#[from] BuildError),
    /// An engine refused a request (too long for its cache, or empty).
    #[error("the engine refuses the workload's requests: {0}")]
    Request(#[from] SubmitError),
    /// The pool or workload is empty or the rate is not positive.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The parameter.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
}

/// What a run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// Of those, found in the engines' caches.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub cached: f64,
    /// Time to first token, seconds: mean, median, 99th percentile.
    pub ttft_mean: f64,
    /// Median TTFT, seconds.
    pub ttft_p50: f64,
    /// 99th percentile TTFT, seconds.
    pub ttft_p99: f64,
    /// Requests per engine.
    pub per_engine: Vec<u64>,
    /// Busiest engine's requests over the idlest's (infinite when one got none).
    pub busiest_over_idlest: f64,
    /// Share of all requests of group `g` on engine `j`: `mix[j][g]` (the formula's input).
    pub mix: Vec<Vec<f64>>,
    /// Virtual time from the first arrival to the last completion, seconds.
    pub elapsed: f64,
}

/// An engine that fails during a run: after `after` requests the engine that served group 0's
/// last request fails, the way keel's proxy meets it. A hung try ends in a failure at the
/// per-try `timeout` (its answer never began, so the proxy retries it: the client sees none), a
/// 500 (`ServerError`) after its delay reaches the client; a refused connection fails at once
/// and the request is picked again with that engine avoided, as the proxy retries it. Requests already on the engine
/// finish (the testbed's engine fails new requests only).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fault {
    /// Requests sent before the engine fails.
    pub after: u64,
    /// How it fails: `Hang`, `ServerError` or `Refuse` (any other: a failure at once).
    pub mode: FailureMode,
    /// The proxy's per-try timeout: when a hung try ends.
    pub timeout: Duration,
}

/// What a fault cost in a run.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultReport {
    /// The engine that failed.
    pub engine: usize,
    /// Groups it held when it failed (the last pick of each was it).
    pub held: Vec<usize>,
    /// Failed tries on it after the fault, per group.
    pub failed_tries: Vec<u64>,
    /// Requests answered with a failure.
    pub failed_requests: u64,
    /// Requests sent after the fault and answered.
    pub answered: u64,
    /// Of those, the ones of a group sent before the fault that found less than its prefix in
    /// cache (a group first sent after the fault misses anyway).
    pub misses: u64,
}

/// Requests sent when the workload does not say.
pub const DEFAULT_REQUESTS: u64 = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    /// Engine `j`'s step ends.
    StepEnd(usize),
    /// The try of request `id` on the failed engine ends in a failure.
    Failed(u64),
    /// A request arrives (from client `c`, or the open loop's next).
    Arrival(usize),
}

struct InFlight {
    pick: Pick,
    /// The balancer that picked it.
    proxy: usize,
    engine: usize,
    group: usize,
    /// The client to send the next request (closed loop).
    client: usize,
    /// Sent after the fault.
    after_fault: bool,
}

/// Runs the pool until every request has finished.
pub fn run(c: &SimConfig) -> Result<SimReport, SimError> {
    run_with_fault(c, None).map(|(r, _)| r)
}

/// A fleet of routers in front of the pool (the lab's E16): `proxies` balancers of their own,
/// each with its own estimates and load view, request `i` (from 0) to balancer `i mod
/// proxies`, as the lab's clients deal them to the proxies in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routers {
    /// Balancers (at least 1).
    pub proxies: usize,
    /// Every pick carries the prompt's first block name as its key (prefix-affinity's
    /// `hash_on` session key): a prompt matched nowhere goes where the key's rendezvous says,
    /// the same engine in every balancer.
    pub key: bool,
    /// Every balancer is told each engine's queue (`Balancer::report_queue`) at the end of
    /// each of its steps: the engines' own signals, read alike by every proxy.
    pub signals: bool,
}

impl Routers {
    /// One router, as [`run`].
    pub const ONE: Routers = Routers {
        proxies: 1,
        key: false,
        signals: false,
    };
}

/// Runs the pool behind a fleet of routers (see [`Routers`]).
pub fn run_fleet(c: &SimConfig, routers: &Routers) -> Result<SimReport, SimError> {
    run_inner(c, None, routers).map(|(r, _)| r)
}

/// Runs the pool with an engine failing during the run (see [`Fault`]); without one, as
/// [`run`].
pub fn run_with_fault(
    c: &SimConfig,
    fault: Option<&Fault>,
) -> Result<(SimReport, Option<FaultReport>), SimError> {
    run_inner(c, fault, &Routers::ONE)
}

fn run_inner(
    c: &SimConfig,
    fault: Option<&Fault>,
    routers: &Routers,
) -> Result<(SimReport, Option<FaultReport>), SimError> {
    let w = &c.workload;
    if c.engines == 0 {
        return Err(SimError::Invalid {
            field: "engines",
            reason: "at least 1",
        });
    }
    if routers.proxies == 0 {
        return Err(SimError::Invalid {
            field: "proxies",
            reason: "at least 1",
        });
    }
    if w.groups == 0 || w.prompt_tokens() == 0 || w.output_tokens == 0 {
        return Err(SimError::Invalid {
            field: "workload",
            reason: "needs a group, a prompt token and an output token",
        });
    }
    match c.arrivals {
        Arrivals::Clients(0) => {
            return Err(SimError::Invalid {
                field: "clients",
                reason: "at least 1",
            })
        }
        Arrivals::Poisson(r) if !(r.is_finite() && r > 0.0) => {
            return Err(SimError::Invalid {
                field: "rate",
                reason: "a finite number > 0",
            })
        }
        _ => {}
    }
    let total = w.requests.unwrap_or(DEFAULT_REQUESTS);
    let specs: Vec<EndpointSpec> = (0..c.engines)
        .map(|i| EndpointSpec::new(format!("engine-{i}")))
        .collect();
    let mut config = BalancerConfig {
        seed: mix64(c.seed ^ 0x5151),
        ..BalancerConfig::new(c.strategy)
    };
    if c.bounded_load.is_some() {
        config.options.bounded_load = c.bounded_load;
    }
    if let Some(b) = c.cache_blocks {
        config.options.cache_blocks = b;
    }
    if routers.signals {
        // The proxy's default `max_age`: a report lasts until the engine's next step anyway.
        config.queue_max_age = Some(Duration::from_secs(2));
    }
    // Each balancer its own seed: the fleet's proxies draw their ties independently.
    let lbs: Vec<Balancer> = (0..routers.proxies)
        .map(|p| {
            let mut config = config.clone();
            if p > 0 {
                config.seed = mix64(config.seed ^ p as u64);
            }
            Balancer::new(config, &specs)
        })
        .collect::<Result<_, _>>()?;
    let ids: Vec<Vec<EndpointId>> = lbs
        .iter()
        .map(|lb| lb.endpoints().iter().map(|e| e.id()).collect())
        .collect();
    let mut engines: Vec<Engine> = (0..c.engines).map(|_| Engine::new(c.spec)).collect();
    let mut stepping = vec![false; c.engines];
    let mut pending: Vec<Vec<Event>> = vec![Vec::new(); c.engines];
    let mut rng = StdRng::seed_from_u64(c.seed);

    // Each group's prefix named once; a request clones its group's hasher and adds a suffix.
    let cumulative: Vec<f64> = w
        .popularity
        .shares(w.groups)
        .iter()
        .scan(0.0, |acc, &p| {
            *acc += p;
            Some(*acc)
        })
        .collect();
    let bt = c.spec.block_tokens;
    let groups: Vec<PrefixHasher> = (0..w.groups)
        .map(|g| {
            let mut h = PrefixHasher::new(bt);
            let text: Vec<u8> = (0..w.prefix_tokens as u64)
                .flat_map(|i| (mix64((g as u64) << 32 | i) as u32).to_le_bytes())
                .collect();
            h.push(&text);
            h
        })
        .collect();

    let mut heap: BinaryHeap<Reverse<(Duration, u64, Due)>> = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, at: Duration, due: Due| {
        order += 1;
        heap.push(Reverse((at, order, due)));
    };
    match c.arrivals {
        Arrivals::Clients(n) => {
            for client in 0..n.min(total as usize) {
                push(&mut heap, Duration::ZERO, Due::Arrival(client));
            }
        }
        Arrivals::Poisson(_) => push(&mut heap, Duration::ZERO, Due::Arrival(0)),
    }

    let mut sent = 0u64;
    let mut next_id = 0u64;
    let mut flights: HashMap<u64, InFlight> = HashMap::new();
    let mut ttfts: Vec<f64> = Vec::with_capacity(total as usize);
    let mut per_engine = vec![0u64; c.engines];
    let mut mix = vec![vec![0.0; w.groups]; c.engines];
    let (mut prompt_tokens, mut cached_tokens, mut done) = (0u64, 0u64, 0u64);
    let mut suffix = vec![0u8; w.unique_tokens * keel_balance::prefix::BYTES_PER_TOKEN];
    let mut last = Duration::ZERO;
    // The last engine each group was picked onto; the fault's engine and cost once it failed.
    let mut home: Vec<Option<usize>> = vec![None; w.groups];
    let mut failed: Option<FaultReport> = None;
    let mut warm = vec![false; w.groups];
    let shared_tokens = w.shared_tokens(&c.spec) as u64;

    while let Some(Reverse((now, _, due))) = heap.pop() {
        last = now;
        match due {
            Due::Arrival(client) => {
                if sent >= total {
                    continue;
                }
                sent += 1;
                if let Arrivals::Poisson(rate) = c.arrivals {
                    let gap = -(1.0 - rng.gen::<f64>()).ln() / rate;
                    push(
                        &mut heap,
                        now + Duration::from_secs_f64(gap),
                        Due::Arrival(0),
                    );
                }
                let x: f64 = rng.gen();
                let group = cumulative
                    .iter()
                    .position(|&a| x < a)
                    .unwrap_or(w.groups - 1);
                let mut h = groups[group].clone();
                rng.fill(&mut suffix[..]);
                h.push(&suffix);
                let blocks = h.blocks();
                if fault.is_some_and(|f| failed.is_none() && sent > f.after) {
                    let engine = home[0].unwrap_or(0);
                    for (g, seen) in warm.iter_mut().enumerate() {
                        *seen = home[g].is_some();
                    }
                    failed = Some(FaultReport {
                        engine,
                        held: (0..w.groups).filter(|&g| home[g] == Some(engine)).collect(),
                        failed_tries: vec![0; w.groups],
                        failed_requests: 0,
                        answered: 0,
                        misses: 0,
                    });
                }
                let mut ctx = PickContext::new(now).with_prefix(blocks);
                // The hash strategies partition the groups on the first block's name; the
                // proxy gives prefix-affinity no key unless `hash_on` asks for one.
                if let (Some(&first), true) = (blocks.first(), c.strategy.is_hash() || routers.key)
                {
                    ctx = ctx.with_hash_key(first);
                }
                let proxy = (sent - 1) as usize % routers.proxies;
                let lb = &lbs[proxy];
                let no_engine = SimError::Invalid {
                    field: "strategy",
                    reason: "picked no engine",
                };
                let mut pick = lb.pick(&ctx).ok_or(no_engine.clone())?;
                next_id += 1;
                let after_fault = failed.is_some();
                if let (Some(f), Some(r)) = (fault, failed.as_mut()) {
                    if pick.index() == r.engine {
                        r.failed_tries[group] += 1;
                        if f.mode == FailureMode::Refuse {
                            // Refused: seen at once, retried with the engine avoided.
                            let avoid: [EndpointId; 1] = [pick.id()];
                            lb.finish(pick, Outcome::Failure, now);
                            pick = lb.pick(&ctx.with_avoid(&avoid)).ok_or(no_engine)?;
                        } else {
                            let ends = match f.mode {
                                FailureMode::Hang => f.timeout,
                                FailureMode::ServerError { after } => after,
                                _ => Duration::ZERO,
                            };
                            if ends.is_zero() {
                                // Seen at once: before the next arrival of this instant picks.
                                lb.finish(pick, Outcome::Failure, now);
                                r.failed_requests += 1;
                                if let Arrivals::Clients(_) = c.arrivals {
                                    push(&mut heap, now, Due::Arrival(client));
                                }
                                continue;
                            }
                            flights.insert(
                                next_id,
                                InFlight {
                                    pick,
                                    proxy,
                                    engine: r.engine,
                                    group,
                                    client,
                                    after_fault,
                                },
                            );
                            push(&mut heap, now + ends, Due::Failed(next_id));
                            continue;
                        }
                    }
                }
                let j = pick.index();
                home[group] = Some(j);
                engines[j].submit(
                    Request {
                        id: next_id,
                        blocks: blocks.to_vec(),
                        prompt_tokens: w.prompt_tokens(),
                        max_tokens: w.output_tokens,
                    },
                    now,
                )?;
                per_engine[j] += 1;
                mix[j][group] += 1.0;
                flights.insert(
                    next_id,
                    InFlight {
                        pick,
                        proxy,
                        engine: j,
                        group,
                        client,
                        after_fault,
                    },
                );
                if !stepping[j] {
                    start_step(
                        &mut engines[j],
                        j,
                        now,
                        &mut pending[j],
                        &mut stepping,
                        |at| push(&mut heap, at, Due::StepEnd(j)),
                    );
                }
            }
            Due::Failed(id) => {
                let f = flights.remove(&id).expect("a failing try in flight");
                lbs[f.proxy].finish(f.pick, Outcome::Failure, now);
                // A hung try ends at its timeout before its answer began, so the proxy retries
                // it: no failure for the client. The retry is modelled as the client's next
                // request (its group drawn again), which leaves failed tries and misses as
                // they are. A 500 is an answer, and is the client's.
                let retried = fault.is_some_and(|x| x.mode == FailureMode::Hang);
                if let (Some(r), false) = (failed.as_mut(), retried) {
                    r.failed_requests += 1;
                }
                if let Arrivals::Clients(_) = c.arrivals {
                    push(&mut heap, now, Due::Arrival(f.client));
                }
            }
            Due::StepEnd(j) => {
                for ev in std::mem::take(&mut pending[j]) {
                    match ev {
                        Event::FirstToken { ttft, .. } => ttfts.push(ttft.as_secs_f64()),
                        Event::Token { .. } => {}
                        Event::Finished { id, usage } => {
                            let f = flights.remove(&id).expect("a request in flight");
                            debug_assert_eq!((f.engine, f.group < w.groups), (j, true));
                            lbs[f.proxy].finish(f.pick, Outcome::Success, now);
                            prompt_tokens += usage.prompt_tokens as u64;
                            cached_tokens += usage.cached_tokens as u64;
                            done += 1;
                            if let (true, Some(r)) = (f.after_fault, failed.as_mut()) {
                                r.answered += 1;
                                let missed = (usage.cached_tokens as u64) < shared_tokens;
                                r.misses += u64::from(missed && warm[f.group]);
                            }
                            if let Arrivals::Clients(_) = c.arrivals {
                                push(&mut heap, now, Due::Arrival(f.client));
                            }
                        }
                    }
                }
                stepping[j] = false;
                if routers.signals {
                    let waiting = engines[j].counters().waiting as u32;
                    for (lb, ids) in lbs.iter().zip(&ids) {
                        lb.report_queue(ids[j], waiting, now);
                    }
                }
                start_step(
                    &mut engines[j],
                    j,
                    now,
                    &mut pending[j],
                    &mut stepping,
                    |at| push(&mut heap, at, Due::StepEnd(j)),
                );
            }
        }
    }

    ttfts.sort_by(f64::total_cmp);
    let pct = |p: f64| -> f64 {
        if ttfts.is_empty() {
            return 0.0;
        }
        let i = ((p * ttfts.len() as f64).ceil() as usize).clamp(1, ttfts.len()) - 1;
        ttfts[i]
    };
    let (most, least) = (
        per_engine.iter().copied().max().unwrap_or(0),
        per_engine.iter().copied().min().unwrap_or(0),
    );
    let n = done.max(1) as f64;
    for row in mix.iter_mut() {
        for x in row.iter_mut() {
            *x /= n;
        }
    }
    let report = SimReport {
        requests: done,
        prompt_tokens,
        cached_tokens,
        cached: cached_tokens as f64 / prompt_tokens.max(1) as f64,
        ttft_mean: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_p50: pct(0.5),
        ttft_p99: pct(0.99),
        per_engine,
        busiest_over_idlest: if least == 0 {
            f64::INFINITY
        } else {
            most as f64 / least as f64
        },
        mix,
        elapsed: last.as_secs_f64(),
    };
    Ok((report, failed))
}

/// Starts engine `j`'s next step at `now` if it has work, scheduling its end.
fn start_step(
    engine: &mut Engine,
    j: usize,
    now: Duration,
    events: &mut Vec<Event>,
    stepping: &mut [bool],
    mut schedule: impl FnMut(Duration),
) {
    if let Some(out) = engine.step(now, events) {
        stepping[j] = true;
        schedule(now + out.duration);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::formula::{self, Popularity, Routing};

    fn config(groups: usize, kv_blocks: usize, strategy: StrategyKind) -> SimConfig {
        SimConfig {
            engines: 3,
            spec: EngineSpec {
                kv_blocks,
                ..EngineSpec::default()
            },
            strategy,
            bounded_load: None,
            cache_blocks: None,
            workload: Workload {
                groups,
                prefix_tokens: 400,
                unique_tokens: 40,
                output_tokens: 24,
                popularity: Popularity::Zipf(0.0),
                requests: Some(1500),
            },
            arrivals: Arrivals::Clients(6),
            seed: 11,
        }
    }

    #[test]
    fn a_seed_gives_the_same_run() {
        let c = config(6, 120, StrategyKind::LeastRequest);
        let (a, b) = (run(&c).unwrap(), run(&c).unwrap());
        assert_eq!(a, b);
        let mut other = c.clone();
        other.seed = 12;
        assert_ne!(run(&other).unwrap().ttft_mean, a.ttft_mean);
        assert_eq!(a.requests, 1500);
        assert_eq!(a.per_engine.iter().sum::<u64>(), 1500);
    }

    /// The simulator's share of prompt tokens from cache against the closed form's, for
    /// round-robin (Che) and for a partition of the groups (rendezvous hashing on the first
    /// block's name; the formula is given the partition the run made).
    #[test]
    fn hit_ratio_matches_the_closed_form() {
        let mut worst: f64 = 0.0;
        for groups in [1, 3, 6, 12, 48] {
            for kv in [100_000, 120] {
                for strategy in [StrategyKind::RoundRobin, StrategyKind::Rendezvous] {
                    let c = config(groups, kv, strategy);
                    let s = run(&c).unwrap();
                    let mix = match strategy {
                        StrategyKind::RoundRobin => formula::mix(
                            &c.workload.popularity.shares(groups),
                            c.engines,
                            Routing::Balanced,
                        ),
                        _ => s.mix.clone(),
                    };
                    let f = formula::pool_with_mix(
                        &c.spec,
                        &c.workload,
                        &mix,
                        formula::Arrivals::Clients(6),
                    );
                    let err = (f.cached - s.cached).abs();
                    worst = worst.max(err);
                    eprintln!(
                        "groups {groups:2} kv {kv:6} {strategy}: sim {:.3} formula {:.3} per engine {:?}",
                        s.cached, f.cached, s.per_engine
                    );
                    assert!(err < 0.05, "groups {groups} kv {kv} {strategy}");
                }
            }
        }
        eprintln!("largest |formula - sim|: {worst:.3}");
    }

    /// The closed form's share of prompt tokens from cache against the simulator's off the
    /// lab's presets, each routing with its own mix (round-robin: every group everywhere;
    /// prefix-affinity: [`formula::affinity_mix`], its estimate sized 0.8 x the engine as
    /// docs/configuration.md advises): 2 to 4 engines, 1 to 48 uniform groups, caches of 120,
    /// 400 and 2,400 blocks, runs of 60, 150 and 600 requests from cold caches, 2 requests in
    /// flight per engine, mean of 1,500 requests' worth of seeds. Tolerance 0.05 (the lab's).
    #[test]
    fn hit_ratio_holds_off_the_presets() {
        let spec = EngineSpec {
            step_per_seq_ms: 0.1,
            ..EngineSpec::default()
        };
        let (mut worst, mut at, mut cases) = (0.0f64, String::new(), 0);
        let mut fails = Vec::new();
        for engines in [2usize, 3, 4] {
            for groups in [1usize, 2, 3, 5, 8, 12, 20, 32, 48] {
                for kv in [120usize, 400, 2400] {
                    for requests in [60u64, 150, 600] {
                        for strategy in [StrategyKind::RoundRobin, StrategyKind::PrefixAffinity] {
                            let clients = 2 * engines;
                            let mut c = config(groups, kv, strategy);
                            c.engines = engines;
                            c.spec = EngineSpec {
                                kv_blocks: kv,
                                ..spec
                            };
                            c.cache_blocks = Some((kv * 4 / 5) as u32);
                            c.arrivals = Arrivals::Clients(clients);
                            c.workload.requests = Some(requests);
                            // A run of 60 requests moves by 0.04 from seed to seed (one
                            // first miss more or less is 0.015): about 1,500 requests a case.
                            let seeds = (1500 / requests).max(3);
                            let mut sim = 0.0;
                            for seed in 0..seeds {
                                c.seed = seed;
                                sim += run(&c).unwrap().cached / seeds as f64;
                            }
                            let shares = c.workload.popularity.shares(groups);
                            let mix = match strategy {
                                StrategyKind::RoundRobin => {
                                    formula::mix(&shares, engines, Routing::Balanced)
                                }
                                _ => formula::affinity_mix(
                                    &shares,
                                    engines,
                                    1.25,
                                    5.0,
                                    clients as f64,
                                ),
                            };
                            let f = formula::pool_with_mix(
                                &c.spec,
                                &c.workload,
                                &mix,
                                formula::Arrivals::Clients(clients),
                            )
                            .cached;
                            let err = (f - sim).abs();
                            cases += 1;
                            let what = format!(
                                "{engines} engines, {groups} groups, kv {kv}, {requests} requests, \
                                 {strategy}: formula {f:.3} simulator {sim:.3}"
                            );
                            if err > worst {
                                worst = err;
                                at = what.clone();
                            }
                            if err > 0.05 {
                                fails.push(what);
                            }
                        }
                    }
                }
            }
        }
        eprintln!("{cases} cases; largest |formula - simulator| {worst:.3} at {at}");
        assert!(
            fails.is_empty(),
            "{} over 0.05:\n{}",
            fails.len(),
            fails.join("\n")
        );
    }

    /// An affine engine failing: the simulator's failed tries, client failures and misses
    /// against `failover`'s closed forms (3 engines, 6 groups, 2 clients, mean of 20 seeds):
    /// within 0.5 for a failure seen at once and a refusal, and within 0.5 for a hang, whose
    /// window the closed form takes as a client's cycle S from the healthy run.
    #[test]
    fn a_failed_affine_engine_costs_what_the_closed_form_says() {
        use crate::inference::failover::Failover;
        let timeout = Duration::from_millis(300);
        for (mode, detection) in [
            (FailureMode::Hang, 0.3),
            (FailureMode::SERVER_ERROR_AT_ONCE, 0.0),
            (FailureMode::Refuse, 0.0),
        ] {
            let mut c = config(6, 2400, StrategyKind::PrefixAffinity);
            c.arrivals = Arrivals::Clients(2);
            c.workload.output_tokens = 8;
            c.workload.requests = Some(24 + 24);
            let (mut tries, mut client, mut misses, mut cycle) = (0.0, 0.0, 0.0, 0.0);
            let seeds = 20;
            for seed in 0..seeds {
                c.seed = seed;
                let healthy = run(&c).unwrap();
                cycle += 2.0 * healthy.elapsed / healthy.requests as f64 / seeds as f64;
                let fault = Fault {
                    after: 24,
                    mode,
                    timeout,
                };
                let (_, r) = run_with_fault(&c, Some(&fault)).unwrap();
                let r = r.unwrap();
                tries += r.failed_tries.iter().sum::<u64>() as f64 / seeds as f64;
                client += r.failed_requests as f64 / seeds as f64;
                misses += r.misses as f64 / seeds as f64;
                if mode != FailureMode::Hang {
                    assert!(r.failed_tries.iter().all(|&n| n <= 1), "{mode:?} {r:?}");
                }
            }
            let f = Failover {
                engines: 3,
                groups: 6,
                clients: 2,
                cycle,
                detection,
                retried: matches!(mode, FailureMode::Refuse | FailureMode::Hang),
            }
            .cost();
            eprintln!(
                "{mode:?}: failed tries {tries:.2} (formula {:.2}), client {client:.2} ({:.2}), \
                 misses {misses:.2} ({:.2}), cycle {:.1} ms",
                f.failed_tries,
                f.client_failures,
                f.misses,
                cycle * 1e3
            );
            assert!((tries - f.failed_tries).abs() < 0.5, "{mode:?}");
            assert!((client - f.client_failures).abs() < 0.5, "{mode:?}");
            assert!((misses - f.misses).abs() < 0.5, "{mode:?}");
        }
    }

    #[test]
    fn poisson_runs_are_seeded_too() {
        let mut c = config(6, 120, StrategyKind::RoundRobin);
        c.arrivals = Arrivals::Poisson(20.0);
        c.workload.requests = Some(400);
        let (a, b) = (run(&c).unwrap(), run(&c).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.requests, 400);
        // 400 arrivals at 20 per second take about 20 s.
        assert!((a.elapsed - 20.0).abs() < 3.0, "{}", a.elapsed);
        assert!(a.ttft_p50 <= a.ttft_p99 && a.ttft_mean > 0.0);
    }

    /// The closed form's mean TTFT against the simulator's, open loop at offered loads 0.2,
    /// 0.5, 0.8 (6 uniform groups, 3,000 requests): within 15 % (at 1.5 the form is 23 % low
    /// for round-robin: it leaves out the variance of the steps' prefill).
    #[test]
    fn ttft_matches_the_batching_form() {
        for rho in [0.2, 0.5, 0.8] {
            for strategy in [StrategyKind::RoundRobin, StrategyKind::Rendezvous] {
                let mut c = config(6, 120, strategy);
                c.workload.requests = Some(3000);
                c.arrivals = Arrivals::Poisson(formula::rate_at_load(&c.spec, &c.workload, 3, rho));
                let s = run(&c).unwrap();
                let mix = match strategy {
                    StrategyKind::RoundRobin => {
                        formula::mix(&c.workload.popularity.shares(6), 3, Routing::Balanced)
                    }
                    _ => s.mix.clone(),
                };
                let f = formula::pool_with_mix(
                    &c.spec,
                    &c.workload,
                    &mix,
                    formula::Arrivals::Load(rho),
                );
                let rel = (f.ttft - s.ttft_mean).abs() / s.ttft_mean;
                assert!(
                    rel < 0.15,
                    "rho {rho} {strategy}: formula {:.1} ms sim {:.1} ms",
                    f.ttft * 1e3,
                    s.ttft_mean * 1e3
                );
            }
        }
    }

    /// The closed form's TTFT (continuous batching per engine) against the simulator's
    /// over loads; prints a table for docs/inference.md (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn ttft_table() {
        for (groups, skew) in [(6, 0.0), (6, 1.5), (1, 0.0)] {
            for rho in [0.2, 0.5, 0.8] {
                let mut line = format!("groups {groups} skew {skew} rho {rho}:");
                for (name, strategy, routing) in [
                    ("rr", StrategyKind::RoundRobin, Routing::Balanced),
                    ("hash", StrategyKind::Rendezvous, Routing::Balanced),
                ] {
                    let mut c = config(groups, 120, strategy);
                    c.workload.popularity = Popularity::Zipf(skew);
                    c.workload.requests = Some(3000);
                    let rate = formula::rate_at_load(&c.spec, &c.workload, 3, rho);
                    c.arrivals = Arrivals::Poisson(rate);
                    let s = run(&c).unwrap();
                    let mix = match routing {
                        _ if strategy == StrategyKind::RoundRobin => formula::mix(
                            &c.workload.popularity.shares(groups),
                            3,
                            Routing::Balanced,
                        ),
                        _ => s.mix.clone(),
                    };
                    let f = formula::pool_with_mix(
                        &c.spec,
                        &c.workload,
                        &mix,
                        formula::Arrivals::Load(rho),
                    );
                    line += &format!(
                        "  {name}: sim cached {:.3} ttft {:.1} ms p99 {:.1} / formula {:.3} {:.1} ms {:?}",
                        s.cached,
                        s.ttft_mean * 1e3,
                        s.ttft_p99 * 1e3,
                        f.cached,
                        f.ttft * 1e3,
                        s.per_engine
                    );
                }
                eprintln!("{line}");
            }
        }
    }

    /// prefix-affinity off the lab's presets: 1 shared prefix 12 at a time, and 3, 6, 12
    /// groups 6 at a time, on 2, 3 and 4 engines, 150 requests, mean of 5 seeds against
    /// round-robin (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn affinity_shapes() {
        let spec = EngineSpec {
            step_per_seq_ms: 0.1,
            ..EngineSpec::default()
        };
        for engines in [2, 3, 4] {
            for (groups, clients) in [(1, 12), (3, 6), (6, 6), (12, 6)] {
                let mut line = format!("engines {engines} groups {groups:2} x{clients:2}:");
                let mut rr_ttft = 0.0;
                for (name, strategy, bound) in [
                    ("rr", StrategyKind::RoundRobin, None),
                    ("pa", StrategyKind::PrefixAffinity, None),
                    ("pa-inf", StrategyKind::PrefixAffinity, Some(1e6)),
                ] {
                    let (mut cached, mut ttft, mut spread, mut worst) = (0.0, 0.0, 0.0, 0.0f64);
                    for seed in 0..5 {
                        let mut c = config(groups, 120, strategy);
                        c.spec = spec;
                        c.engines = engines;
                        c.bounded_load = bound;
                        c.arrivals = Arrivals::Clients(clients);
                        c.workload.requests = Some(150);
                        c.seed = seed;
                        let s = run(&c).unwrap();
                        cached += s.cached / 5.0;
                        ttft += s.ttft_mean * 1e3 / 5.0;
                        let b = s.busiest_over_idlest.min(99.0);
                        spread += b / 5.0;
                        worst = worst.max(b);
                    }
                    if name == "rr" {
                        rr_ttft = ttft;
                    }
                    line += &format!(
                        "  {name} {cached:.3} {ttft:5.1}ms ({:.2}x) b/i {spread:.2} max {worst:.2}",
                        ttft / rr_ttft
                    );
                }
                eprintln!("{line}");
            }
        }
    }
}
