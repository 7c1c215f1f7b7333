//! A request trace replayed on the inference pool: Mooncake's format (one JSON object a line:
//! `timestamp` in ms, `input_length` and `output_length` in tokens, `hash_ids`, one id per
//! 512-token block of the prompt, two requests sharing their first n ids sharing their first
//! n blocks' KV cache).
//!
//! - [`Trace::parse_jsonl`] reads it; [`Trace::sessions`] derives conversations (the trace has
//!   no session id); [`Trace::scaled`] scales it for a CPU engine: token counts divided by
//!   `512 / block_tokens`, so that a trace block is one engine block, and time compressed to a
//!   rate.
//! - [`prompt_text`] gives each request its text: one deterministic block of text per hash id,
//!   so two requests sharing their first n ids share their first n blocks' names
//!   (`keel_balance::prefix`), on the engine, in the proxy and in the strategy alike.
//! - [`predict`]: the hit ratio from the trace's own reuse, before anything runs: Che's
//!   characteristic time per engine ([`super::formula::che_time`]'s idea) with each block's
//!   reuse distances in the trace in place of an independent-reference popularity.
//! - [`replay`]: the simulator, the same engines in virtual time behind keel-balance's own
//!   balancer, the requests at their (scaled) times.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Duration;

use keel_balance::prefix::{PrefixHasher, BYTES_PER_TOKEN};
use keel_balance::{hash_key, mix64, Balancer, BalancerConfig, EndpointSpec, Outcome, Pick};
use keel_balance::{PickContext, StrategyKind};
use serde::Deserialize;

use super::engine::{Engine, Event, Request};
use super::sim::SimError;
use super::EngineSpec;

/// Tokens per hash id in Mooncake's traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a trace, as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: usize,
    /// One id per [`TRACE_BLOCK_TOKENS`] tokens of the prompt (the last block may be partial).
    pub hash_ids: Vec<u64>,
}

/// A trace: its requests in arrival order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The requests.
    pub requests: Vec<TraceRequest>,
}

/// Why a trace could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    /// A line is not a request of the format.
    #[error("line {line}: {reason}")]
    Line {
        /// 1-based.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// No request at all.
    #[error("the trace has no request")]
    Empty,
}

/// One request scaled for the engines.
#[derive(Clone, Debug, PartialEq)]
pub struct Replayed {
    /// When it is sent, from the first request.
    pub at: Duration,
    /// Its conversation ([`Trace::sessions`]).
    pub session: usize,
    /// Prompt tokens, scaled.
    pub prompt_tokens: usize,
    /// Output tokens, scaled.
    pub max_tokens: usize,
    /// The trace's hash ids.
    pub hash_ids: Vec<u64>,
}

impl Trace {
    /// Reads one JSON request a line (blank lines skipped).
    pub fn parse_jsonl(text: &str) -> Result<Trace, TraceError> {
        let mut requests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let r: TraceRequest = serde_json::from_str(line).map_err(|e| TraceError::Line {
                line: i + 1,
                reason: e.to_string(),
            })?;
            if r.hash_ids.is_empty() {
                return Err(TraceError::Line {
                    line: i + 1,
                    reason: "no hash_ids".into(),
                });
            }
            requests.push(r);
        }
        if requests.is_empty() {
            return Err(TraceError::Empty);
        }
        Ok(Trace { requests })
    }

    /// The first `n` requests.
    pub fn head(&self, n: usize) -> Trace {
        Trace {
            requests: self.requests.iter().take(n).cloned().collect(),
        }
    }

    /// Each request's conversation, numbered in order of first appearance. The trace has no
    /// session id; every request shares its first block (the system prompt), so a request
    /// continues the conversation of the latest earlier request with which it shares the
    /// longest run of leading hash ids, when that run is longer than the first block: its
    /// prompt is that turn's prompt (and answer) plus more. Otherwise it starts a new one.
    pub fn sessions(&self) -> Vec<usize> {
        // Each leading run of ids (by the hash of the run) -> its latest conversation.
        let mut runs: HashMap<u64, usize> = HashMap::new();
        let mut out = Vec::with_capacity(self.requests.len());
        let mut next = 0;
        for r in &self.requests {
            let chain = chain_keys(&r.hash_ids);
            let found = chain
                .iter()
                .skip(1)
                .rev()
                .find_map(|k| runs.get(k).copied());
            let s = found.unwrap_or_else(|| {
                next += 1;
                next - 1
            });
            for k in chain.iter().skip(1) {
                runs.insert(*k, s);
            }
            out.push(s);
        }
        out
    }

    /// The requests scaled for engines of `block_tokens`-token blocks: token counts divided by
    /// `512 / block_tokens` (rounded up, at least 1; a prompt at most its ids' blocks), and the
    /// arrivals spread evenly in proportion so that the whole trace arrives at `rate`
    /// requests per second (each gap the trace's, times one factor).
    pub fn scaled(&self, block_tokens: usize, rate: f64) -> Vec<Replayed> {
        let divisor = (TRACE_BLOCK_TOKENS / block_tokens.max(1)).max(1);
        let first = self.requests.first().map_or(0, |r| r.timestamp);
        let span = self
            .requests
            .last()
            .map_or(0, |r| r.timestamp.saturating_sub(first))
            .max(1) as f64
            / 1e3;
        // n - 1 gaps in `span` seconds of the trace; the same n - 1 at `rate`.
        let n = self.requests.len().max(2) as f64;
        let factor = (n - 1.0) / rate.max(1e-9) / span;
        self.sessions()
            .into_iter()
            .zip(&self.requests)
            .map(|(session, r)| Replayed {
                at: Duration::from_secs_f64(
                    r.timestamp.saturating_sub(first) as f64 / 1e3 * factor,
                ),
                session,
                prompt_tokens: r
                    .input_length
                    .div_ceil(divisor)
                    .clamp(1, r.hash_ids.len() * block_tokens),
                max_tokens: r.output_length.div_ceil(divisor).max(1),
                hash_ids: r.hash_ids.clone(),
            })
            .collect()
    }
}

/// The key of each leading run of `ids` (run `k` = the first `k + 1` ids).
fn chain_keys(ids: &[u64]) -> Vec<u64> {
    let mut h = 0x0074_7261_6365_u64;
    ids.iter()
        .map(|&id| {
            h = mix64(h ^ mix64(id.wrapping_add(0x9e37_79b9)));
            h
        })
        .collect()
}

/// One block's text for hash id `id`: `block_tokens` tokens of lowercase letters (JSON needs
/// no escape), the same for every request that has the id.
pub fn block_text(id: u64, block_tokens: usize, out: &mut String) {
    let bytes = block_tokens * BYTES_PER_TOKEN;
    let mut x = mix64(id ^ 0x6d6f_6f6e);
    for i in 0..bytes {
        if i % 12 == 0 {
            x = mix64(x);
        }
        out.push((b'a' + ((x >> ((i % 12) * 5)) & 31) as u8 % 26) as char);
    }
}

/// A request's prompt: its ids' blocks in order, cut to its tokens.
pub fn prompt_text(r: &Replayed, block_tokens: usize) -> String {
    let mut s = String::with_capacity(r.hash_ids.len() * block_tokens * BYTES_PER_TOKEN);
    for &id in &r.hash_ids {
        block_text(id, block_tokens, &mut s);
    }
    s.truncate(r.prompt_tokens * BYTES_PER_TOKEN);
    s
}

/// The names of a request's full blocks, as the engine and the proxy name them.
pub fn block_names(r: &Replayed, block_tokens: usize) -> Vec<u64> {
    let mut h = PrefixHasher::new(block_tokens);
    h.push(prompt_text(r, block_tokens).as_bytes());
    h.blocks().to_vec()
}

/// Where a routing sends requests, for [`predict`]: each request on its own (round-robin,
/// least-request: request `i` on engine `i mod N`), or each conversation whole (affinity,
/// sticky sessions: conversation `s` on engine `s mod N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Requests spread one by one.
    EachRequest,
    /// Conversations kept whole.
    EachSession,
}

/// What [`predict`] expects.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// Share of prompt tokens served from cache.
    pub cached: f64,
    /// Requests per engine.
    pub per_engine: Vec<u64>,
    /// Each engine's characteristic time, in its own requests (infinite: all fits).
    pub char_time: Vec<f64>,
}

/// The share of prompt tokens served from cache under `placement` on `engines` engines of
/// `spec`, each running `in_flight` requests on average, from the trace's own reuse.
///
/// Che's approximation with the trace's reuse distances: an LRU cache keeps a block for about
/// `T` requests (at its engine) after its last use, `T` the characteristic time at which the
/// blocks kept fill the cache: `sum over uses of min(gap to the block's next use, T) + sum
/// over requests of o min(requests left, T) = n (C + o)`, `o` a request's own blocks used once
/// (its partial block and answer), `C` the blocks not pinned by the requests in flight
/// (`kv_blocks - in_flight x o`), the `+ o` because those are freed before the prefix (as in
/// [`super::formula::che_time`]). A use finds its block when the block's previous use on the
/// same engine came within `T + in_flight` requests (a running request's blocks are not
/// evicted); a request is served the leading run of blocks found, at most the full blocks
/// before its last token.
pub fn predict(
    requests: &[Replayed],
    spec: &EngineSpec,
    engines: usize,
    placement: Placement,
    in_flight: f64,
) -> Prediction {
    let engines = engines.max(1);
    let on: Vec<Option<usize>> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            Some(
                match placement {
                    Placement::EachRequest => i,
                    Placement::EachSession => r.session,
                } % engines,
            )
        })
        .collect();
    predict_on(requests, spec, engines, &on, in_flight)
}

/// [`predict`] for a placement already made: request `i` on engine `on[i]` (`None`: left
/// out, e.g. a request that failed), as a run placed them.
pub fn predict_on(
    requests: &[Replayed],
    spec: &EngineSpec,
    engines: usize,
    on: &[Option<usize>],
    in_flight: f64,
) -> Prediction {
    let engines = engines.max(1);
    let bt = spec.block_tokens.max(1);
    let mut streams: Vec<Vec<&Replayed>> = vec![Vec::new(); engines];
    for (r, j) in requests.iter().zip(on) {
        if let Some(j) = j {
            streams[j % engines].push(r);
        }
    }
    let (mut cached, mut prompt) = (0u64, 0u64);
    let mut char_time = Vec::with_capacity(engines);
    for stream in &streams {
        let n = stream.len();
        if n == 0 {
            char_time.push(f64::INFINITY);
            continue;
        }
        // Each use: (request index, previous use's index, next use's index or n).
        let mut last: HashMap<u64, usize> = HashMap::new();
        let mut uses: Vec<(usize, Option<usize>)> = Vec::new();
        let mut next_of: Vec<usize> = Vec::new();
        let mut own = 0.0;
        for (t, r) in stream.iter().enumerate() {
            let named = (r.prompt_tokens / bt).min(r.hash_ids.len());
            own += ((r.prompt_tokens + r.max_tokens).div_ceil(bt) - named) as f64;
            for &id in &r.hash_ids[..named] {
                let prev = last.insert(id, uses.len());
                if let Some(p) = prev {
                    next_of[p] = t;
                }
                uses.push((t, prev.map(|p| uses[p].0)));
                next_of.push(n);
            }
        }
        let own = own / n as f64;
        let room = (spec.kv_blocks as f64 - in_flight.max(0.0) * own).max(0.0) + own;
        let occupied = |tt: f64| -> f64 {
            let blocks: f64 = uses
                .iter()
                .zip(&next_of)
                .map(|(&(t, _), &nx)| ((nx - t) as f64).min(tt))
                .sum();
            let once: f64 = (0..n).map(|t| own * ((n - t) as f64).min(tt)).sum();
            (blocks + once) / n as f64
        };
        let t_char = if occupied(n as f64 + 1.0) <= room {
            f64::INFINITY
        } else {
            let (mut lo, mut hi) = (0.0, n as f64 + 1.0);
            for _ in 0..60 {
                let mid = 0.5 * (lo + hi);
                if occupied(mid) < room {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            0.5 * (lo + hi)
        };
        char_time.push(t_char);
        let mut u = 0;
        for (t, r) in stream.iter().enumerate() {
            let named = (r.prompt_tokens / bt).min(r.hash_ids.len());
            let most = r.prompt_tokens.saturating_sub(1) / bt;
            // The leading run of blocks found.
            let run = uses[u..u + named]
                .iter()
                .take(most)
                .take_while(|(_, prev)| {
                    prev.is_some_and(|p| ((t - p) as f64) <= t_char + in_flight)
                })
                .count();
            u += named;
            cached += (run * bt) as u64;
            prompt += r.prompt_tokens as u64;
        }
    }
    Prediction {
        cached: cached as f64 / prompt.max(1) as f64,
        per_engine: streams.iter().map(|s| s.len() as u64).collect(),
        char_time,
    }
}

/// One replay of a trace in the simulator.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Engines in the pool.
    pub engines: usize,
    /// Each engine.
    pub spec: EngineSpec,
    /// The balancer's strategy.
    pub strategy: StrategyKind,
    /// `bounded_load` (`None`: the strategy's default).
    pub bounded_load: Option<f64>,
    /// prefix-affinity's `cache_blocks` (`None`: its default).
    pub cache_blocks: Option<u32>,
    /// Give the balancer each request's conversation as its hash key, as the proxy does with
    /// `hash_on = "header:x-session-id"`.
    pub session_key: bool,
    /// The balancer's seed.
    pub seed: u64,
}

/// What a replay measured.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayReport {
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// Of those, found in the engines' caches.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`.
    pub cached: f64,
    /// Mean time to first token, seconds.
    pub ttft_mean: f64,
    /// 99th percentile, seconds.
    pub ttft_p99: f64,
    /// Requests per engine.
    pub per_engine: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    StepEnd(usize),
    Arrival(usize),
}

/// Replays `requests` at their times through keel-balance's balancer onto engines of
/// `c.spec` in virtual time, until every request has finished.
pub fn replay(c: &ReplayConfig, requests: &[Replayed]) -> Result<ReplayReport, SimError> {
    if c.engines == 0 {
        return Err(SimError::Invalid {
            field: "engines",
            reason: "at least 1",
        });
    }
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
    let lb = Balancer::new(config, &specs)?;
    let bt = c.spec.block_tokens;
    let names: Vec<Vec<u64>> = requests.iter().map(|r| block_names(r, bt)).collect();
    let mut engines: Vec<Engine> = (0..c.engines).map(|_| Engine::new(c.spec)).collect();
    let mut stepping = vec![false; c.engines];
    let mut pending: Vec<Vec<Event>> = vec![Vec::new(); c.engines];
    let mut heap: BinaryHeap<Reverse<(Duration, u64, Due)>> = BinaryHeap::new();
    let mut order = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, at: Duration, due: Due| {
        order += 1;
        heap.push(Reverse((at, order, due)));
    };
    for (i, r) in requests.iter().enumerate() {
        push(&mut heap, r.at, Due::Arrival(i));
    }
    let mut flights: HashMap<u64, Pick> = HashMap::new();
    let mut ttfts = Vec::with_capacity(requests.len());
    let mut per_engine = vec![0u64; c.engines];
    let (mut prompt_tokens, mut cached_tokens, mut done) = (0u64, 0u64, 0u64);
    while let Some(Reverse((now, _, due))) = heap.pop() {
        match due {
            Due::Arrival(i) => {
                let r = &requests[i];
                let blocks = &names[i];
                let mut ctx = PickContext::new(now).with_prefix(blocks);
                if c.session_key {
                    ctx = ctx.with_hash_key(hash_key(format!("s{}", r.session).as_bytes()));
                } else if let (Some(&first), true) = (blocks.first(), c.strategy.is_hash()) {
                    ctx = ctx.with_hash_key(first);
                }
                let pick = lb.pick(&ctx).ok_or(SimError::Invalid {
                    field: "strategy",
                    reason: "picked no engine",
                })?;
                let j = pick.index();
                engines[j].submit(
                    Request {
                        id: i as u64,
                        blocks: blocks.clone(),
                        prompt_tokens: r.prompt_tokens,
                        max_tokens: r.max_tokens,
                    },
                    now,
                )?;
                per_engine[j] += 1;
                flights.insert(i as u64, pick);
                if !stepping[j] {
                    start_step(
                        &mut engines[j],
                        now,
                        &mut pending[j],
                        &mut stepping[j],
                        |at| push(&mut heap, at, Due::StepEnd(j)),
                    );
                }
            }
            Due::StepEnd(j) => {
                for ev in std::mem::take(&mut pending[j]) {
                    match ev {
                        Event::FirstToken { ttft, .. } => ttfts.push(ttft.as_secs_f64()),
                        Event::Token { .. } => {}
                        Event::Finished { id, usage } => {
                            let pick = flights.remove(&id).expect("a request in flight");
                            lb.finish(pick, Outcome::Success, now);
                            prompt_tokens += usage.prompt_tokens as u64;
                            cached_tokens += usage.cached_tokens as u64;
                            done += 1;
                        }
                    }
                }
                stepping[j] = false;
                start_step(
                    &mut engines[j],
                    now,
                    &mut pending[j],
                    &mut stepping[j],
                    |at| push(&mut heap, at, Due::StepEnd(j)),
                );
            }
        }
    }
    ttfts.sort_by(f64::total_cmp);
    Ok(ReplayReport {
        requests: done,
        prompt_tokens,
        cached_tokens,
        cached: cached_tokens as f64 / prompt_tokens.max(1) as f64,
        ttft_mean: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_p99: percentile(&ttfts, 0.99),
        per_engine,
    })
}

/// The `p` quantile of sorted `xs` (nearest rank; 0 when empty).
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let i = ((p * xs.len() as f64).ceil() as usize).clamp(1, xs.len()) - 1;
    xs[i]
}

fn start_step(
    engine: &mut Engine,
    now: Duration,
    events: &mut Vec<Event>,
    stepping: &mut bool,
    mut schedule: impl FnMut(Duration),
) {
    if let Some(out) = engine.step(now, events) {
        *stepping = true;
        schedule(now + out.duration);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(lines: &[(u64, usize, &[u64])]) -> Trace {
        Trace {
            requests: lines
                .iter()
                .map(|&(t, input, ids)| TraceRequest {
                    timestamp: t,
                    input_length: input,
                    output_length: 64,
                    hash_ids: ids.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_turn_continues_the_conversation_whose_ids_it_extends() {
        let t = trace(&[
            (0, 1500, &[0, 1, 2]),
            (0, 1000, &[0, 3]),
            (10, 2500, &[0, 1, 2, 4, 5]),
            (20, 1200, &[0, 3, 6]),
            (30, 600, &[0, 7]),
            (40, 3000, &[0, 1, 2, 4, 5, 8]),
        ]);
        assert_eq!(t.sessions(), [0, 1, 0, 1, 2, 0]);
    }

    #[test]
    fn shared_ids_give_shared_block_names_and_scaling_keeps_a_block_a_block() {
        let t = trace(&[(0, 1500, &[0, 1, 2]), (1000, 1100, &[0, 1, 9])]);
        let r = t.scaled(16, 2.0);
        // 1,500 / 32 = 47 tokens (2 full blocks), 1,100 / 32 = 35 (2 full blocks).
        assert_eq!((r[0].prompt_tokens, r[1].prompt_tokens), (47, 35));
        assert_eq!(r[0].max_tokens, 2);
        // Two requests, one gap, at 2 per second.
        assert_eq!(r[1].at, Duration::from_millis(500));
        let (a, b) = (block_names(&r[0], 16), block_names(&r[1], 16));
        assert_eq!((a.len(), b.len()), (2, 2));
        assert_eq!(a, b);
        let text = prompt_text(&r[0], 16);
        assert!(text.bytes().all(|c| c.is_ascii_lowercase()));
    }

    /// The prediction against an exact LRU of the same streams: a cache that holds
    /// everything finds every reuse; one that holds nothing, none.
    #[test]
    fn the_prediction_bounds_hold() {
        let t = trace(&[
            (0, 2048, &[0, 1, 2, 3]),
            (1, 2560, &[0, 1, 2, 3, 7]),
            (2, 2048, &[0, 4, 5, 6]),
            (3, 2560, &[0, 4, 5, 6, 8]),
        ]);
        let r = t.scaled(16, 10.0);
        let big = EngineSpec {
            kv_blocks: 10_000,
            ..EngineSpec::default()
        };
        let p = predict(&r, &big, 1, Placement::EachRequest, 0.0);
        // 64 and 80 tokens: the second turns find 4 blocks (64 tokens; a prompt of exactly 4
        // blocks computes its last), the second conversation's first turn the system block.
        let prompt: usize = r.iter().map(|x| x.prompt_tokens).sum();
        assert!((p.cached - (16.0 + 64.0 + 64.0) / prompt as f64).abs() < 1e-9);
        // Two engines: conversations kept whole find their turns (128 tokens); spread one by
        // one, each second turn lands where its first is not (32: the system block twice).
        let whole = predict(&r, &big, 2, Placement::EachSession, 0.0);
        let spread = predict(&r, &big, 2, Placement::EachRequest, 0.0);
        assert!((whole.cached - 128.0 / prompt as f64).abs() < 1e-9);
        assert!((spread.cached - 32.0 / prompt as f64).abs() < 1e-9);
        let none = predict(
            &r,
            &EngineSpec {
                kv_blocks: 0,
                ..EngineSpec::default()
            },
            1,
            Placement::EachRequest,
            0.0,
        );
        assert_eq!(none.cached, 0.0);
    }
}
