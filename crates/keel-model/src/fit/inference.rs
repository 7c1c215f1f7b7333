//! `keel advise` for an inference pool: fit the workload from keel's access log (the lines of
//! an `inference = true` cluster: `ttft_ms`, `prompt_tokens`, `cached_tokens`, `prefix`,
//! `prompt_blocks`, ...) and say whether `prefix-affinity` pays there, by how much and up to
//! which load, with the closed form of `inference::formula` for the point and the simulator
//! (`inference::sim`, keel-balance's own strategies over the engine model) for the interval.
//! docs/advise.md, "Inference pools", says what is fitted and what is left out.

use std::collections::HashMap;
use std::io::BufRead;

use keel_balance::StrategyKind;
use keel_balance::DEFAULT_AFFINITY_BOUND;
use serde::Serialize;

use crate::fit::log::parse_rfc3339;
use crate::inference::formula::{self, Arrivals, Popularity, Routing, Workload};
use crate::inference::sim::{self, SimConfig};
use crate::inference::EngineSpec;

/// prefix-affinity's second term: an engine is full only when this many calls ahead of the
/// least loaded (keel-balance's rule; the closed form's `slack`).
const SLACK: f64 = 5.0;

/// prefix-affinity's estimate of an engine's cache as a share of the engine's blocks (the
/// advised `cache_blocks`).
const ESTIMATE_SHARE: f64 = 0.8;

/// Fewest measured answers the fit accepts.
pub const MIN_ANSWERS: usize = 30;

/// One measured inference answer of the log.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// When it ended, seconds since the epoch.
    pub end: f64,
    /// From its head to its end, seconds.
    pub duration: f64,
    /// The endpoint that answered.
    pub endpoint: String,
    /// The prompt's first block's name (`prefix`), when keel named one.
    pub prefix: Option<u64>,
    /// Full blocks keel named (`prompt_blocks`).
    pub prompt_blocks: Option<u32>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Time to first token, milliseconds.
    pub ttft_ms: f64,
}

/// Why a log cannot be fitted as an inference pool's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InferenceFitError {
    /// Reading the input failed.
    #[error("cannot read the log: {0}")]
    Read(String),
    /// Too few answers with the fields the fit needs.
    #[error("{found} answers with ttft_ms, prompt_tokens, cached_tokens and prefix (need {need}); log an `inference = true` cluster with keel's JSON access log")]
    TooFew {
        /// Answers found.
        found: usize,
        /// Answers needed.
        need: usize,
    },
    /// Several clusters and none chosen.
    #[error("the log has inference answers of several clusters ({0}); choose one with --cluster")]
    Clusters(String),
}

/// Whether a line of keel's JSON access log is an inference answer's (it has `ttft_ms`).
pub fn is_inference_line(line: &str) -> bool {
    line.contains("\"ttft_ms\"")
}

/// Reads the measured inference answers (2xx, with tokens, TTFT and a `prefix` field) of
/// `cluster` (or of the log's one cluster); other lines are skipped.
pub fn read_answers(
    input: impl BufRead,
    cluster: Option<&str>,
) -> Result<(String, Vec<Answer>), InferenceFitError> {
    let mut by_cluster: HashMap<String, Vec<Answer>> = HashMap::new();
    for line in input.lines() {
        let line = line.map_err(|e| InferenceFitError::Read(e.to_string()))?;
        if !is_inference_line(&line) {
            continue;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        let status = v["status"].as_u64().unwrap_or(0);
        let name = v["cluster"].as_str().unwrap_or("").to_string();
        if !(200..300).contains(&status) || cluster.is_some_and(|c| c != name) {
            continue;
        }
        let (Some(end), Some(ttft), Some(prompt), Some(endpoint)) = (
            v["time"].as_str().and_then(parse_rfc3339),
            v["ttft_ms"].as_f64(),
            v["prompt_tokens"].as_u64(),
            v["endpoint"].as_str(),
        ) else {
            continue;
        };
        by_cluster.entry(name).or_default().push(Answer {
            end,
            duration: v["duration_ms"].as_f64().unwrap_or(ttft) / 1e3,
            endpoint: endpoint.to_string(),
            prefix: v["prefix"]
                .as_str()
                .and_then(|h| u64::from_str_radix(h, 16).ok()),
            prompt_blocks: v["prompt_blocks"].as_u64().map(|b| b as u32),
            prompt_tokens: prompt,
            completion_tokens: v["completion_tokens"].as_u64().unwrap_or(0),
            cached_tokens: v["cached_tokens"].as_u64().unwrap_or(0),
            ttft_ms: ttft,
        });
    }
    if by_cluster.len() > 1 {
        let mut names: Vec<&str> = by_cluster.keys().map(String::as_str).collect();
        names.sort();
        return Err(InferenceFitError::Clusters(names.join(", ")));
    }
    let (name, answers) = by_cluster.into_iter().next().unwrap_or_default();
    let named = answers.iter().filter(|a| a.prefix.is_some()).count();
    if named < MIN_ANSWERS {
        return Err(InferenceFitError::TooFew {
            found: named,
            need: MIN_ANSWERS,
        });
    }
    Ok((name, answers))
}

/// A prefix group: the requests whose prompts share a first block.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Group {
    /// The first block's name, as the log writes it.
    pub prefix: String,
    /// Its requests.
    pub requests: u64,
    /// Tokens of its prefix found cached at most (the engines' own count: the shared part).
    pub shared_tokens: u64,
}

/// How the log's requests were routed, read from the log itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SeenRouting {
    /// Each group spread over the engines (round-robin, least-request, ...).
    Balanced,
    /// Each group mostly on one engine.
    Affinity,
}

/// The workload and pool fitted from the log.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InferenceFit {
    /// The cluster.
    pub cluster: String,
    /// Answers fitted.
    pub requests: u64,
    /// From the first answer's start to the last one's end, seconds.
    pub seconds: f64,
    /// Arrivals per second.
    pub rate_per_s: f64,
    /// Requests in flight on average (rate x mean duration).
    pub mean_in_flight: f64,
    /// The engines (the log's endpoints) and their answers.
    pub engines: Vec<(String, u64)>,
    /// Groups of two requests or more, most requested first.
    pub groups: Vec<Group>,
    /// Requests whose first block no other request has.
    pub singletons: u64,
    /// Zipf exponent of the groups' popularity (maximum likelihood; 0 uniform).
    pub zipf: f64,
    /// Mean prompt tokens of the grouped requests.
    pub prompt_tokens: f64,
    /// Shared tokens of a group's prefix (the median over groups, of the engines' cached
    /// tokens at most: what a request of the group can find).
    pub shared_tokens: u64,
    /// Mean completion tokens.
    pub output_tokens: f64,
    /// Tokens per block (from `prompt_tokens` against `prompt_blocks`; `None`: not in the log).
    pub block_tokens: Option<usize>,
    /// Share of prompt tokens the engines found cached, over the whole log.
    pub cached: f64,
    /// Mean TTFT over the log, milliseconds, with its standard error.
    pub ttft_ms: (f64, f64),
    /// Prefill speed from TTFT against uncached tokens (least squares), tokens per second.
    pub prefill_tps: Option<f64>,
    /// How the log's requests were routed, and the share of a group's requests on its most
    /// used engine (1 / engines under balancing, near 1 under affinity).
    pub routing: SeenRouting,
    /// The share of a group's requests on its modal engine.
    pub on_home: f64,
}

/// Fits the workload and pool of a log's answers.
pub fn fit(cluster: &str, answers: &[Answer]) -> InferenceFit {
    let named: Vec<&Answer> = answers.iter().filter(|a| a.prefix.is_some()).collect();
    let n = named.len().max(1) as f64;
    let start = named
        .iter()
        .map(|a| a.end - a.duration)
        .fold(f64::INFINITY, f64::min);
    let end = named
        .iter()
        .map(|a| a.end)
        .fold(f64::NEG_INFINITY, f64::max);
    let seconds = (end - start).max(1e-3);
    let rate = n / seconds;
    let mean_duration = named.iter().map(|a| a.duration).sum::<f64>() / n;
    let mut engines: Vec<(String, u64)> = Vec::new();
    for a in &named {
        match engines.iter_mut().find(|(e, _)| *e == a.endpoint) {
            Some((_, c)) => *c += 1,
            None => engines.push((a.endpoint.clone(), 1)),
        }
    }
    engines.sort();
    // Groups by first block.
    let mut by_prefix: HashMap<u64, Vec<&Answer>> = HashMap::new();
    for a in &named {
        by_prefix.entry(a.prefix.unwrap_or(0)).or_default().push(a);
    }
    let mut groups: Vec<Group> = Vec::new();
    let mut singletons = 0;
    let (mut home, mut grouped) = (0u64, 0u64);
    let mut prompt_sum = 0.0;
    for (p, members) in &by_prefix {
        if members.len() < 2 {
            singletons += 1;
            continue;
        }
        let mut per: HashMap<&str, u64> = HashMap::new();
        for a in members {
            *per.entry(a.endpoint.as_str()).or_default() += 1;
            prompt_sum += a.prompt_tokens as f64;
        }
        home += per.values().copied().max().unwrap_or(0);
        grouped += members.len() as u64;
        groups.push(Group {
            prefix: format!("{p:016x}"),
            requests: members.len() as u64,
            shared_tokens: members.iter().map(|a| a.cached_tokens).max().unwrap_or(0),
        });
    }
    groups.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.prefix.cmp(&b.prefix)));
    let counts: Vec<u64> = groups.iter().map(|g| g.requests).collect();
    let mut shared: Vec<u64> = groups
        .iter()
        .filter(|g| g.shared_tokens > 0)
        .map(|g| g.shared_tokens)
        .collect();
    shared.sort_unstable();
    let shared_tokens = shared.get(shared.len() / 2).copied().unwrap_or(0);
    let on_home = if grouped > 0 {
        home as f64 / grouped as f64
    } else {
        0.0
    };
    let e = engines.len().max(1) as f64;
    // Between a spread's 1 / N and a partition's 1: nearer the partition is affinity.
    let routing = if engines.len() > 1 && on_home > 0.5 * (1.0 + 1.0 / e) {
        SeenRouting::Affinity
    } else {
        SeenRouting::Balanced
    };
    let prompt_all: u64 = named.iter().map(|a| a.prompt_tokens).sum();
    let cached_all: u64 = named.iter().map(|a| a.cached_tokens).sum();
    let ttfts: Vec<f64> = named.iter().map(|a| a.ttft_ms).collect();
    let ttft_mean = ttfts.iter().sum::<f64>() / n;
    let ttft_var = ttfts.iter().map(|t| (t - ttft_mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    InferenceFit {
        cluster: cluster.to_string(),
        requests: named.len() as u64,
        seconds,
        rate_per_s: rate,
        mean_in_flight: rate * mean_duration,
        engines,
        zipf: zipf_mle(&counts),
        groups,
        singletons,
        prompt_tokens: if grouped > 0 {
            prompt_sum / grouped as f64
        } else {
            prompt_all as f64 / n
        },
        shared_tokens,
        output_tokens: named
            .iter()
            .map(|a| a.completion_tokens as f64)
            .sum::<f64>()
            / n,
        block_tokens: block_tokens(&named),
        cached: if prompt_all > 0 {
            cached_all as f64 / prompt_all as f64
        } else {
            0.0
        },
        ttft_ms: (ttft_mean, (ttft_var / n).sqrt()),
        prefill_tps: prefill_speed(&named),
        routing,
        on_home,
    }
}

/// The block size consistent with every answer: `prompt_blocks = floor(prompt_tokens / B)`.
fn block_tokens(answers: &[&Answer]) -> Option<usize> {
    let (mut lo, mut hi) = (1.0f64, f64::INFINITY);
    let mut any = false;
    for a in answers {
        let Some(b) = a.prompt_blocks.filter(|&b| b > 0) else {
            continue;
        };
        any = true;
        let t = a.prompt_tokens as f64;
        lo = lo.max(t / (f64::from(b) + 1.0));
        hi = hi.min(t / f64::from(b));
    }
    if !any {
        return None;
    }
    // The smallest power of two in the range (engines' block sizes are), else its floor.
    let mut b = 1usize;
    while (b as f64) <= hi {
        if (b as f64) > lo {
            return Some(b);
        }
        b *= 2;
    }
    (hi.is_finite() && hi >= 1.0).then_some(hi.floor() as usize)
}

/// Prefill speed from the TTFT of the answers against their uncached tokens: the slope of
/// least squares, tokens per second (`None` without spread in the uncached tokens).
fn prefill_speed(answers: &[&Answer]) -> Option<f64> {
    let n = answers.len() as f64;
    let xs: Vec<f64> = answers
        .iter()
        .map(|a| a.prompt_tokens.saturating_sub(a.cached_tokens) as f64)
        .collect();
    let mx = xs.iter().sum::<f64>() / n;
    let my = answers.iter().map(|a| a.ttft_ms).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, a) in xs.iter().zip(answers) {
        sxy += (x - mx) * (a.ttft_ms - my);
        sxx += (x - mx) * (x - mx);
    }
    if sxx <= 0.0 || sxy <= 0.0 {
        return None;
    }
    Some(1e3 * sxx / sxy)
}

/// The Zipf exponent that makes ranked counts most likely (0 for one group).
fn zipf_mle(counts: &[u64]) -> f64 {
    if counts.len() < 2 {
        return 0.0;
    }
    let ll = |s: f64| -> f64 {
        let h: f64 = (1..=counts.len()).map(|i| (i as f64).powf(-s)).sum();
        let total: f64 = counts.iter().map(|&c| c as f64).sum();
        counts
            .iter()
            .enumerate()
            .map(|(i, &c)| -s * c as f64 * ((i + 1) as f64).ln())
            .sum::<f64>()
            - total * h.ln()
    };
    // Golden section on [0, 4].
    let (mut a, mut b) = (0.0f64, 4.0f64);
    let g = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..80 {
        let c = b - g * (b - a);
        let d = a + g * (b - a);
        if ll(c) > ll(d) {
            b = d;
        } else {
            a = c;
        }
    }
    let s = 0.5 * (a + b);
    if s < 0.05 {
        0.0
    } else {
        (s * 100.0).round() / 100.0
    }
}

/// What advise is given besides the log.
#[derive(Clone, Debug, PartialEq)]
pub struct InferenceOptions {
    /// The engines' model: prefill speed and step costs (the measured fake engine's by
    /// default).
    pub spec: EngineSpec,
    /// The engines' KV blocks were given (else fitted from the log's hit ratio).
    pub kv_blocks_given: bool,
    /// The engines' block size was given (else read from the log).
    pub block_tokens_given: bool,
    /// Simulated runs per routing for the interval.
    pub seeds: u64,
    /// Seed of the first.
    pub seed: u64,
}

impl Default for InferenceOptions {
    fn default() -> Self {
        InferenceOptions {
            spec: EngineSpec::default(),
            kv_blocks_given: false,
            block_tokens_given: false,
            seeds: 20,
            seed: 1,
        }
    }
}

/// One routing's prediction for a run like the log's (as many requests, at its rate).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// `round-robin` or `prefix-affinity`.
    pub strategy: String,
    /// Share of prompt tokens from cache: the closed form, and the 95 % interval of a run.
    pub cached: [f64; 3],
    /// Mean TTFT, milliseconds: point and 95 % interval of a run.
    pub ttft_ms: [f64; 3],
    /// N x the busiest engine's share of the requests (1: even).
    pub hot_spot: f64,
}

/// The recommendation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Run `prefix-affinity`.
    Affinity,
    /// Affinity saves nothing or costs: balance (round-robin, least-request).
    Balance,
}

/// `keel advise`'s answer for an inference pool.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InferenceAdvice {
    /// What to run.
    pub verdict: Verdict,
    /// The answer in sentences.
    pub answer: String,
    /// Why, in numbers.
    pub why: Vec<String>,
    /// The fit.
    pub fit: InferenceFit,
    /// The engine model used, and how its cache size and block size were obtained.
    pub kv_blocks: usize,
    /// How `kv_blocks` was obtained.
    pub kv_blocks_from: String,
    /// Tokens per block used.
    pub block_tokens: usize,
    /// Offered load per engine under balancing (the closed form's `rho`).
    pub load: f64,
    /// Round-robin's prediction.
    pub balanced: Prediction,
    /// prefix-affinity's (its defaults: bound 1.25, 5 ahead).
    pub affinity: Prediction,
    /// The load per engine up to which affinity's mean TTFT stays below balancing's (`None`:
    /// at no load; infinite: at every load scanned).
    pub affinity_limit: Option<f64>,
    /// The `[[cluster]]` section to paste.
    pub cluster_toml: String,
}

/// The closed form's workload of the fit (its groups; `requests`: the run's).
fn workload(fit: &InferenceFit, prefix: usize, requests: u64) -> Workload {
    let prompt = fit.prompt_tokens.round().max(1.0) as usize;
    let prefix = prefix.min(prompt);
    Workload {
        groups: fit.groups.len().max(1),
        prefix_tokens: prefix,
        unique_tokens: prompt - prefix,
        output_tokens: fit.output_tokens.round().max(1.0) as usize,
        popularity: Popularity::Zipf(fit.zipf),
        requests: Some(requests.max(1)),
    }
}

/// The load per engine (`rho`) at which the pool's arrival rate is `rate`.
fn load_of_rate(spec: &EngineSpec, w: &Workload, engines: usize, rate: f64) -> f64 {
    let (mut lo, mut hi) = (1e-4f64, 10.0f64);
    if formula::rate_at_load(spec, w, engines, hi) < rate {
        return hi;
    }
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if formula::rate_at_load(spec, w, engines, mid) < rate {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// The two routings' mixes: round-robin's spread, and prefix-affinity's partition with its
/// bound and slack at the fit's requests in flight.
fn mixes(w: &Workload, engines: usize, in_flight: f64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let shares = w.popularity.shares(w.groups);
    (
        formula::mix(&shares, engines, Routing::Balanced),
        formula::affinity_mix(
            &shares,
            engines,
            DEFAULT_AFFINITY_BOUND,
            SLACK,
            in_flight.max(1.0),
        ),
    )
}

/// The closed form's hit ratio of the routing the log saw, for engines of `kv_blocks`.
fn seen_cached(fit: &InferenceFit, spec: &EngineSpec, w: &Workload, rho: f64) -> f64 {
    let n = fit.engines.len().max(1);
    let (bal, aff) = mixes(w, n, fit.mean_in_flight);
    let m = match fit.routing {
        SeenRouting::Balanced => bal,
        SeenRouting::Affinity => aff,
    };
    formula::pool_with_mix(spec, w, &m, Arrivals::Load(rho)).cached
}

/// Quantile `q` of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Fits, predicts both routings and recommends.
pub fn advise(fit: InferenceFit, opts: &InferenceOptions) -> InferenceAdvice {
    let n = fit.engines.len().max(1);
    let mut spec = opts.spec;
    if !opts.block_tokens_given {
        if let Some(b) = fit.block_tokens {
            spec.block_tokens = b;
        }
    }
    let grouped: u64 = fit.groups.iter().map(|g| g.requests).sum();
    // No group at all: every request is its own, as one group with nothing shared (both
    // routings then spread the requests alike: prefix-affinity places a prompt matched nowhere
    // on the engine holding the fewest, then by load).
    let none_shared = grouped == 0 || fit.shared_tokens == 0;
    let w = workload(
        &fit,
        if none_shared {
            0
        } else {
            fit.shared_tokens as usize
        },
        if none_shared { fit.requests } else { grouped }.max(1),
    );
    // The rate of the grouped requests: singletons are modelled apart (below).
    let (rate, single_share) = if none_shared {
        (fit.rate_per_s, 0.0)
    } else {
        (
            fit.rate_per_s * grouped as f64 / fit.requests.max(1) as f64,
            fit.singletons as f64 / fit.requests.max(1) as f64,
        )
    };
    // The cache size: given, or the one that makes the closed form's hit ratio for the
    // routing the log saw equal to the log's own (the grouped requests' share of it).
    let seen = if !none_shared {
        (fit.cached / (1.0 - single_share).max(1e-9)).min(1.0)
    } else {
        0.0
    };
    let kv_blocks_from;
    if opts.kv_blocks_given || none_shared {
        kv_blocks_from = if opts.kv_blocks_given {
            "given (--kv-blocks)".to_string()
        } else {
            "the default engine's (no shared prefix to fit it from)".to_string()
        };
    } else {
        let at = |blocks: usize| {
            let s = EngineSpec {
                kv_blocks: blocks,
                ..spec
            };
            let rho = load_of_rate(&s, &w, n, rate);
            seen_cached(&fit, &s, &w, rho)
        };
        let own = w.own_blocks(&spec);
        let mut lo = own * (fit.mean_in_flight.ceil() as usize / n + 1) + 1;
        let mut hi = 1usize << 20;
        let top = at(hi);
        if seen >= top - 0.005 {
            // Everything the log asked for fitted: the smallest cache that holds it all.
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                if at(mid) >= top - 0.005 {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            kv_blocks_from = format!(
                "fitted: the smallest cache with the log's hit ratio {seen:.3} ({} of the engines' cached tokens; every prefix fitted, so the engines may hold more)",
                fit.routing_name()
            );
        } else {
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                if at(mid) >= seen {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            kv_blocks_from = format!(
                "fitted: the cache whose closed-form hit ratio under {} is the log's {seen:.3}",
                fit.routing_name()
            );
        }
        spec.kv_blocks = hi;
    }
    let rho = load_of_rate(&spec, &w, n, rate);
    let (bal_mix, mut aff_mix) = mixes(&w, n, fit.mean_in_flight);
    if none_shared {
        aff_mix = bal_mix.clone();
    }
    let bal = formula::pool_with_mix(&spec, &w, &bal_mix, Arrivals::Load(rho));
    let aff = formula::pool_with_mix(&spec, &w, &aff_mix, Arrivals::Load(rho));
    let hot =
        |m: &[Vec<f64>]| m.iter().map(|r| r.iter().sum::<f64>()).fold(0.0, f64::max) * n as f64;

    // The interval: the simulator, runs like the log's (its requests, its rate), per seed.
    let sim_runs = |strategy: StrategyKind| -> Vec<(f64, f64)> {
        (0..opts.seeds)
            .filter_map(|i| {
                let c = SimConfig {
                    engines: n,
                    spec,
                    strategy,
                    bounded_load: None,
                    cache_blocks: Some(((spec.kv_blocks as f64 * ESTIMATE_SHARE) as u32).max(1)),
                    workload: w,
                    arrivals: sim::Arrivals::Poisson(rate.max(1e-6)),
                    seed: opts.seed + i,
                };
                sim::run(&c).ok().map(|r| (r.cached, r.ttft_mean * 1e3))
            })
            .collect()
    };
    let (bal_runs, aff_runs) = if !none_shared {
        (
            sim_runs(StrategyKind::RoundRobin),
            sim_runs(StrategyKind::PrefixAffinity),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    // Singletons find nothing: the pool's share of cached prompt tokens scales by the grouped
    // requests' share of prompt tokens (taken as their share of requests).
    let scale = 1.0 - single_share;
    let seen_ttft = fit.ttft_ms.0;
    let seen_is_balanced = fit.routing == SeenRouting::Balanced;
    // TTFT on this pool's engines: the log's own mean under the routing it ran, moved by the
    // difference the closed form predicts between the routings (the engines and the machine
    // add what the form leaves out, the same to both).
    let (seen_form, seen_runs) = if seen_is_balanced {
        (bal.ttft * 1e3, &bal_runs)
    } else {
        (aff.ttft * 1e3, &aff_runs)
    };
    let predict = |name: &str, p: &formula::PoolLoad, runs: &[(f64, f64)], m: &[Vec<f64>]| {
        let cached_point = p.cached * scale;
        let mut c: Vec<f64> = runs.iter().map(|r| r.0 * scale).collect();
        c.sort_by(f64::total_cmp);
        let (clo, chi) = if c.is_empty() {
            (cached_point, cached_point)
        } else {
            (
                quantile(&c, 0.025).min(cached_point),
                quantile(&c, 0.975).max(cached_point),
            )
        };
        // Paired by seed: this routing's TTFT less the seen one's.
        let diffs: Vec<f64> = runs
            .iter()
            .zip(seen_runs.iter())
            .map(|(a, b)| a.1 - b.1)
            .collect();
        let shift = p.ttft * 1e3 - seen_form;
        let point = seen_ttft + shift * scale;
        let (mut dlo, mut dhi) = (shift, shift);
        if !diffs.is_empty() {
            let mut d = diffs.clone();
            d.sort_by(f64::total_cmp);
            dlo = dlo.min(quantile(&d, 0.025));
            dhi = dhi.max(quantile(&d, 0.975));
        }
        let se = 1.96 * fit.ttft_ms.1;
        let ttft = [
            point,
            seen_ttft + dlo * scale - se,
            seen_ttft + dhi * scale + se,
        ];
        Prediction {
            strategy: name.to_string(),
            cached: [cached_point, clo, chi],
            ttft_ms: ttft,
            hot_spot: hot(m),
        }
    };
    let balanced = predict("round-robin", &bal, &bal_runs, &bal_mix);
    let affinity = predict("prefix-affinity", &aff, &aff_runs, &aff_mix);
    let limit = if !none_shared {
        formula::affinity_limit(&spec, &w, n, Some(DEFAULT_AFFINITY_BOUND))
    } else {
        None
    };
    let gain = affinity.cached[0] - balanced.cached[0];
    // Affinity pays when it serves more from cache and its mean TTFT is lower, the two
    // intervals of TTFT apart.
    let pays = gain > 0.01 && affinity.ttft_ms[2] < balanced.ttft_ms[1];
    let verdict = if pays {
        Verdict::Affinity
    } else {
        Verdict::Balance
    };
    let fmt_limit = |l: Option<f64>| match l {
        None => "at no load".to_string(),
        Some(l) if l.is_infinite() => "at every load up to 10 per engine".to_string(),
        Some(l) => format!("up to a load of {l:.2} per engine"),
    };
    let answer = match verdict {
        Verdict::Affinity => format!(
            "Use prefix-affinity: predicted {:.3} [{:.3}, {:.3}] of prompt tokens from cache against round-robin's {:.3} [{:.3}, {:.3}], mean TTFT {:.1} ms [{:.1}, {:.1}] against {:.1} ms [{:.1}, {:.1}] ({:.2}x) at this log's load ({rho:.2} per engine); affinity pays {}.",
            affinity.cached[0], affinity.cached[1], affinity.cached[2],
            balanced.cached[0], balanced.cached[1], balanced.cached[2],
            affinity.ttft_ms[0], affinity.ttft_ms[1], affinity.ttft_ms[2],
            balanced.ttft_ms[0], balanced.ttft_ms[1], balanced.ttft_ms[2],
            affinity.ttft_ms[0] / balanced.ttft_ms[0].max(1e-9),
            fmt_limit(limit),
        ),
        Verdict::Balance => {
            let why = if none_shared {
                "no two requests share a prompt block, so there is nothing to keep together".to_string()
            } else if gain <= 0.01 {
                format!(
                    "it serves no more from cache ({:.3} against {:.3}: every engine keeps the shared prefixes under round-robin too)",
                    affinity.cached[0], balanced.cached[0]
                )
            } else {
                format!(
                    "its cache gain ({:.3} against {:.3}) does not lower the mean TTFT beyond the intervals ({:.1} ms [{:.1}, {:.1}] against {:.1} ms [{:.1}, {:.1}])",
                    affinity.cached[0], balanced.cached[0],
                    affinity.ttft_ms[0], affinity.ttft_ms[1], affinity.ttft_ms[2],
                    balanced.ttft_ms[0], balanced.ttft_ms[1], balanced.ttft_ms[2]
                )
            };
            format!(
                "Keep round-robin (or least-request): prefix-affinity pays nothing here, {why}; predicted {:.3} [{:.3}, {:.3}] from cache and mean TTFT {:.1} ms [{:.1}, {:.1}] with round-robin, {:.3} and {:.1} ms with prefix-affinity (hot spot {:.2}x) at this log's load ({rho:.2} per engine).",
                balanced.cached[0], balanced.cached[1], balanced.cached[2],
                balanced.ttft_ms[0], balanced.ttft_ms[1], balanced.ttft_ms[2],
                affinity.cached[0], affinity.ttft_ms[0], affinity.hot_spot
            )
        }
    };
    let mut why = vec![
        format!(
            "{} requests in {:.1} s ({:.1}/s, {:.1} in flight) on {} engines; {} prefix groups of two requests or more (popularity Zipf {:.2}; largest {} requests), {} requests with a first block of their own",
            fit.requests,
            fit.seconds,
            fit.rate_per_s,
            fit.mean_in_flight,
            n,
            fit.groups.len(),
            fit.zipf,
            fit.groups.first().map_or(0, |g| g.requests),
            fit.singletons
        ),
        format!(
            "prompts {:.0} tokens, {} of them a group's shared prefix (the engines' cached tokens), {:.0} out; {:.3} of prompt tokens were found cached in the log, under {}{}",
            fit.prompt_tokens,
            fit.shared_tokens,
            fit.output_tokens,
            fit.cached,
            fit.routing_name(),
            match fit.routing {
                SeenRouting::Balanced => format!(" ({:.2} of a group's requests on its most used engine)", fit.on_home),
                SeenRouting::Affinity => format!(" ({:.2} of a group's requests on its own engine)", fit.on_home),
            }
        ),
        format!(
            "engines: {} KV blocks ({kv_blocks_from}), {} tokens a block ({}), prefill {:.0} tokens/s, steps {} ms + {} ms a sequence{}",
            spec.kv_blocks,
            spec.block_tokens,
            if opts.block_tokens_given {
                "given"
            } else if fit.block_tokens.is_some() {
                "from prompt_tokens against prompt_blocks"
            } else {
                "the default"
            },
            spec.prefill_tps,
            spec.step_ms,
            spec.step_per_seq_ms,
            fit.prefill_tps.map_or(String::new(), |t| format!(
                " (the log's TTFT against uncached tokens says {t:.0} tokens/s)"
            ))
        ),
        format!(
            "the closed form gives the points; the intervals are those of {} simulated runs of {} requests at {:.1}/s per routing (keel-balance's strategies over the engine model), widened to hold the point; TTFT is the log's own mean ({:.1} ms) moved by the difference the closed form puts between the routings",
            opts.seeds, grouped, rate, seen_ttft
        ),
    ];
    if let Some(l) = limit {
        why.push(format!(
            "affinity's mean TTFT stays below round-robin's {} (the closed form, bound {DEFAULT_AFFINITY_BOUND}); first order: {}",
            fmt_limit(Some(l)),
            {
                let c = formula::compare(&spec, &w, n, Some(DEFAULT_AFFINITY_BOUND), rho);
                let f = formula::first_order_limit(c.r, c.k);
                if f.is_infinite() {
                    format!("no limit (k = {:.2}, r = {:.2})", c.k, c.r)
                } else {
                    format!("{f:.2} (k = {:.2}, r = {:.2})", c.k, c.r)
                }
            }
        ));
    }
    let cluster_toml = cluster_toml(&fit, &spec, verdict);
    InferenceAdvice {
        verdict,
        answer,
        why,
        kv_blocks: spec.kv_blocks,
        kv_blocks_from,
        block_tokens: spec.block_tokens,
        load: rho,
        balanced,
        affinity,
        affinity_limit: limit,
        cluster_toml,
        fit,
    }
}

impl InferenceFit {
    /// The routing the log saw, in words.
    pub fn routing_name(&self) -> &'static str {
        match self.routing {
            SeenRouting::Balanced => "a balancing strategy",
            SeenRouting::Affinity => "affinity",
        }
    }
}

/// The `[[cluster]]` section for the verdict, with the log's engines.
fn cluster_toml(fit: &InferenceFit, spec: &EngineSpec, verdict: Verdict) -> String {
    let endpoints: Vec<String> = fit
        .engines
        .iter()
        .map(|(e, _)| format!("{{ address = \"{e}\" }}"))
        .collect();
    let mut t = format!(
        "[[cluster]]\nname = \"{}\"\ninference = true\n",
        fit.cluster
    );
    match verdict {
        Verdict::Affinity => {
            t.push_str("strategy = \"prefix-affinity\"\n");
            t.push_str(&format!(
                "cache_blocks = {}             # 0.8 x the engines' KV blocks ({})\nblock_tokens = {}\n# bounded_load = {DEFAULT_AFFINITY_BOUND}            # the load bound (default)\n",
                ((spec.kv_blocks as f64 * ESTIMATE_SHARE) as u32).max(1),
                spec.kv_blocks,
                spec.block_tokens
            ));
        }
        Verdict::Balance => t.push_str("strategy = \"round-robin\"    # or \"least-request\"\n"),
    }
    t.push_str(&format!("endpoints = [{}]\n", endpoints.join(", ")));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_of_uniform_and_skewed_counts() {
        assert_eq!(zipf_mle(&[50, 50, 50, 50]), 0.0);
        assert_eq!(zipf_mle(&[7]), 0.0);
        // Counts of Zipf 1 over 6 groups, 2,450 requests.
        let h: f64 = (1..=6).map(|i| 1.0 / i as f64).sum();
        let counts: Vec<u64> = (1..=6)
            .map(|i| (2450.0 / h / i as f64).round() as u64)
            .collect();
        let s = zipf_mle(&counts);
        assert!((s - 1.0).abs() < 0.03, "{s}");
    }

    fn answer(prefix: u64, tokens: u64, blocks: u32, cached: u64, ttft: f64, at: f64) -> Answer {
        Answer {
            end: at,
            duration: 0.05,
            endpoint: format!("127.0.0.1:{}", 9000 + (at * 10.0) as u64 % 3),
            prefix: Some(prefix),
            prompt_blocks: Some(blocks),
            prompt_tokens: tokens,
            completion_tokens: 24,
            cached_tokens: cached,
            ttft_ms: ttft,
        }
    }

    #[test]
    fn groups_block_size_and_prefill_from_answers() {
        // 4 groups of 10, 440-token prompts (27 blocks of 16), half found 400 cached; TTFT
        // 10 ms + uncached / 4,000 tokens/s.
        let mut a = Vec::new();
        for i in 0..40u64 {
            let cached = if i % 2 == 0 { 400 } else { 0 };
            let ttft = 10.0 + (440 - cached) as f64 / 4.0;
            a.push(answer(i % 4, 440, 27, cached, ttft, i as f64 * 0.1));
        }
        a.push(answer(99, 441, 27, 0, 120.25, 4.0));
        let f = fit("llm", &a);
        assert_eq!(f.groups.len(), 4);
        assert_eq!(f.singletons, 1);
        assert_eq!(f.shared_tokens, 400);
        assert_eq!(f.block_tokens, Some(16));
        assert_eq!(f.zipf, 0.0);
        let tps = f.prefill_tps.unwrap();
        assert!((tps - 4000.0).abs() < 1.0, "{tps}");
        assert_eq!(f.engines.len(), 3);
    }
}
