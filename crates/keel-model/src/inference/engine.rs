//! The engine as a pure state machine, time passed in: continuous batching over a KV cache of
//! prefix blocks. The testbed's `keel backend --llm` runs it in real time (sleep a step's
//! duration, then deliver its events); the simulator runs it in virtual time. No I/O and no
//! randomness: the same calls give the same steps and events.
//!
//! The model, after vLLM's v1 scheduler (`vllm/v1/core/sched/scheduler.py`) and its KV cache
//! manager with prefix caching (`vllm/v1/core/kv_cache_manager.py`, `block_pool.py`), which
//! follow PagedAttention (Kwon et al., SOSP 2023):
//!
//! - **Blocks.** The cache is `kv_blocks` blocks of `block_tokens` tokens. A prompt's full
//!   blocks are named by `keel_balance::prefix` (a chain of hashes, so a name stands for the
//!   whole prefix up to it); partial blocks and output blocks are anonymous. A block is named
//!   (cached) when the step that computes its last token is scheduled, as vLLM caches a block
//!   when it allocates the slots that fill it.
//! - **Hits.** On admission a request references the longest run of its first block names that
//!   are cached, and computes only the rest. At least one prompt token is always computed (the
//!   step that computes the last token samples the first output), so a hit covers at most the
//!   full blocks within the first `prompt_tokens - 1` tokens, as in vLLM.
//! - **Eviction.** Blocks nobody references wait in one free queue, least recently freed first;
//!   a request's blocks are freed last-to-first, so a prompt's tail is evicted before its head.
//!   Taking a free block drops its name; a hit takes a named block back out of the queue.
//! - **A step.** Running requests first, in admission order, then waiting ones (FIFO), share a
//!   budget of `max_batch_tokens` tokens: a decoding request takes 1, a prefilling one the rest
//!   of its prompt up to the budget (chunked prefill). A step takes `step_ms + step_per_seq_ms x
//!   scheduled + prefill_tokens / prefill_tps`. A request whose prompt is fully computed by a
//!   step gets a token at its end, then one per step; it finishes after `max_tokens`.
//! - **Admission and preemption.** The head of the queue is admitted when `max_running` allows
//!   and the free queue holds the blocks its first chunk needs; otherwise it and all behind it
//!   wait. A running request that needs a block when none is free preempts the most recently
//!   admitted one (vLLM's recompute preemption): its blocks are freed (still named, so it hits
//!   them again) and it goes back to the head of the queue to recompute its prompt and output.
//!   No request is admitted in a step that preempted.
//! - **Counters** as vLLM's metrics count them: running, waiting, KV usage (referenced blocks /
//!   all), prefix-cache queries and hits in tokens (counted once per request, at its first
//!   admission), prompt and generation tokens, preemptions.
//!
//! A driver in virtual time (the real-time one sleeps `duration` instead):
//!
//! ```
//! use std::time::Duration;
//! use keel_model::inference::{engine::{Engine, Event, Request}, EngineSpec};
//!
//! let mut engine = Engine::new(EngineSpec::default());
//! let prompt = |id| Request { id, blocks: vec![1, 2, 3], prompt_tokens: 50, max_tokens: 4 };
//! engine.submit(prompt(1), Duration::ZERO).unwrap();
//! engine.submit(prompt(2), Duration::ZERO).unwrap();
//! let (mut now, mut events, mut cached) = (Duration::ZERO, Vec::new(), Vec::new());
//! while let Some(step) = engine.step(now, &mut events) {
//!     now += step.duration; // the step's events happen at its end
//!     for e in events.drain(..) {
//!         if let Event::Finished { usage, .. } = e {
//!             cached.push(usage.cached_tokens);
//!         }
//!     }
//! }
//! // Admitted in the same step: the second finds the first's 3 blocks (3 x 16 tokens) named.
//! assert_eq!(cached, [0, 48]);
//! ```

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use super::EngineSpec;

/// A request's id, chosen by the caller (unique among the requests in the engine).
pub type RequestId = u64;

/// One request: its prompt as tokens and named full blocks, and how many tokens to generate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The caller's id for it.
    pub id: RequestId,
    /// The names of the prompt's full blocks in order (`keel_balance::prefix::PrefixHasher`
    /// with the engine's `block_tokens`); fewer than the prompt's full blocks is allowed (the
    /// unnamed rest is never a hit).
    pub blocks: Vec<u64>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens to generate (at least 1).
    pub max_tokens: usize,
}

/// Tokens of a finished request, as an OpenAI `usage` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens found in the cache at the request's first admission (full blocks x
    /// `block_tokens`): `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
}

/// What happened to a request by the end of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The request's first output token; `ttft` runs from its submission to the step's end.
    FirstToken { id: RequestId, ttft: Duration },
    /// Another output token.
    Token { id: RequestId },
    /// The request got its last token (reported just before, in the same step) and left.
    Finished { id: RequestId, usage: Usage },
}

/// What a step did; its events went to the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// How long the step takes: its events happen at `now + duration`, and the next step may
    /// start then.
    pub duration: Duration,
    /// Requests in the batch (decoding and prefilling).
    pub scheduled: usize,
    /// Prompt tokens computed in the step (recomputed ones of preempted requests included).
    pub prefill_tokens: usize,
}

/// Why a request was refused at submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` is 0.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// Prompt and output cannot fit in the whole cache at once.
    #[error(
        "this model's maximum context length is {max_model_len} tokens; the request needs \
         {requested} ({prompt_tokens} in the prompt, {max_tokens} in the completion)"
    )]
    TooLong {
        requested: usize,
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
}

/// The engine's counters and gauges, named after vLLM's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    /// Requests in the batch (`vllm:num_requests_running`).
    pub running: usize,
    /// Requests queued for admission (`vllm:num_requests_waiting`).
    pub waiting: usize,
    /// Blocks referenced by a request.
    pub used_blocks: usize,
    /// `used_blocks / kv_blocks` (`vllm:kv_cache_usage_perc`, a fraction in 0..=1).
    pub kv_usage: f64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries_total`).
    pub prefix_queries: u64,
    /// Prompt tokens found there (`vllm:prefix_cache_hits_total`).
    pub prefix_hits: u64,
    /// Prompt tokens of requests that got their first token (`vllm:prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Output tokens generated (`vllm:generation_tokens_total`).
    pub generation_tokens: u64,
    /// Preemptions (`vllm:num_preemptions_total`).
    pub preemptions: u64,
    /// Requests finished.
    pub finished: u64,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    name: Option<u64>,
    refs: u32,
    /// When it joined the free queue (its key there).
    freed: u64,
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    arrival: Duration,
    names: Vec<u64>,
    prompt_tokens: usize,
    max_tokens: usize,
    /// Output tokens so far.
    output: usize,
    /// Tokens whose KV is in the blocks.
    computed: usize,
    /// Physical blocks held, in order.
    blocks: Vec<u32>,
    /// How many of `names` have been given to `blocks`.
    named: usize,
    /// Cached tokens at the first admission (`None` before it).
    cached: Option<usize>,
    done: bool,
}

impl Seq {
    /// Prompt and output tokens: what a recomputation after preemption must prefill.
    fn tokens(&self) -> usize {
        self.prompt_tokens + self.output
    }
}

/// Whether an engine of `spec` takes a request of `prompt_tokens` and `max_tokens` (what
/// [`Engine::submit`] checks first; a server checks it before it answers).
pub fn validate(
    spec: &EngineSpec,
    prompt_tokens: usize,
    max_tokens: usize,
) -> Result<(), SubmitError> {
    if prompt_tokens == 0 {
        return Err(SubmitError::EmptyPrompt);
    }
    if max_tokens == 0 {
        return Err(SubmitError::NoOutput);
    }
    let requested = prompt_tokens.saturating_add(max_tokens);
    let max_model_len = spec.kv_blocks.max(1) * spec.block_tokens.max(1);
    if requested > max_model_len {
        return Err(SubmitError::TooLong {
            requested,
            prompt_tokens,
            max_tokens,
            max_model_len,
        });
    }
    Ok(())
}

/// The engine: a KV cache of named blocks, a queue, and a batch.
#[derive(Debug)]
pub struct Engine {
    spec: EngineSpec,
    blocks: Vec<Block>,
    /// Cached blocks by name.
    by_name: HashMap<u64, u32>,
    /// Unreferenced blocks, least recently freed first: `(freed, block)`.
    free: BTreeSet<(u64, u32)>,
    /// Orders the free queue.
    tick: u64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// `(index in running, tokens)` of the step being planned (kept to reuse its allocation).
    scheduled: Vec<(usize, usize)>,
    counters: Counters,
}

impl Engine {
    /// An empty engine (`block_tokens`, `kv_blocks`, `max_batch_tokens` and `max_running` are
    /// taken as at least 1).
    pub fn new(spec: EngineSpec) -> Self {
        let spec = EngineSpec {
            kv_blocks: spec.kv_blocks.clamp(1, u32::MAX as usize),
            block_tokens: spec.block_tokens.max(1),
            max_batch_tokens: spec.max_batch_tokens.max(1),
            max_running: spec.max_running.max(1),
            ..spec
        };
        let n = spec.kv_blocks;
        Engine {
            spec,
            blocks: vec![
                Block {
                    name: None,
                    refs: 0,
                    freed: 0
                };
                n
            ],
            by_name: HashMap::new(),
            free: (0..n as u32).map(|b| (0, b)).collect(),
            tick: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            scheduled: Vec::new(),
            counters: Counters::default(),
        }
    }

    /// The parameters (after the clamps of [`Engine::new`]).
    pub fn spec(&self) -> &EngineSpec {
        &self.spec
    }

    /// The longest request, prompt and output, the cache can hold (vLLM's `max_model_len`).
    pub fn max_model_len(&self) -> usize {
        self.spec.kv_blocks * self.spec.block_tokens
    }

    /// Queues a request submitted at `now`; it is admitted by a later [`Engine::step`].
    pub fn submit(&mut self, request: Request, now: Duration) -> Result<(), SubmitError> {
        validate(&self.spec, request.prompt_tokens, request.max_tokens)?;
        self.waiting.push_back(Seq {
            id: request.id,
            arrival: now,
            names: request.blocks,
            prompt_tokens: request.prompt_tokens,
            max_tokens: request.max_tokens,
            output: 0,
            computed: 0,
            blocks: Vec::new(),
            named: 0,
            cached: None,
            done: false,
        });
        Ok(())
    }

    /// Drops a request (its client went away), freeing its blocks; whether it was there.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(mut s) = self.waiting.remove(i) {
                self.release(&mut s);
            }
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            self.release(&mut s);
            return true;
        }
        false
    }

    /// Whether there is nothing to run: no step until the next submission.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Whether the block named `name` is in the cache (referenced or waiting to be evicted).
    pub fn is_cached(&self, name: u64) -> bool {
        self.by_name.contains_key(&name)
    }

    /// The counters and gauges now.
    pub fn counters(&self) -> Counters {
        let used = self.blocks.len() - self.free.len();
        Counters {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_blocks: used,
            kv_usage: used as f64 / self.blocks.len() as f64,
            ..self.counters
        }
    }

    /// The duration of a step of `scheduled` requests that prefills `prefill_tokens` tokens.
    pub fn step_duration(&self, scheduled: usize, prefill_tokens: usize) -> Duration {
        let ms = self.spec.step_ms + self.spec.step_per_seq_ms * scheduled as f64;
        let prefill_s = if self.spec.prefill_tps > 0.0 {
            prefill_tokens as f64 / self.spec.prefill_tps
        } else {
            0.0
        };
        Duration::from_secs_f64((ms / 1000.0 + prefill_s).max(0.0))
    }

    /// Plans and commits one step starting at `now` (at or after the previous step's end),
    /// appending its events, which happen at `now + duration`, to `events`. `None` when there
    /// is nothing to run.
    pub fn step(&mut self, now: Duration, events: &mut Vec<Event>) -> Option<StepOutcome> {
        let bt = self.spec.block_tokens;
        let mut budget = self.spec.max_batch_tokens;
        let mut scheduled = std::mem::take(&mut self.scheduled);
        scheduled.clear();
        let mut preempted = false;

        // Running requests first, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let tokens = (s.tokens() - s.computed).min(budget);
            let need = (s.computed + tokens)
                .div_ceil(bt)
                .saturating_sub(s.blocks.len());
            while need > self.free.len() && i < self.running.len() {
                let mut victim = self.running.pop().expect("i < len");
                self.preempt(&mut victim);
                self.waiting.push_front(victim);
                preempted = true;
            }
            if i >= self.running.len() {
                break; // it preempted itself
            }
            self.grow(i, tokens);
            scheduled.push((i, tokens));
            budget -= tokens;
            i += 1;
        }

        // Then the queue, in order, while the head fits.
        while !preempted && budget > 0 && self.running.len() < self.spec.max_running {
            let Some(s) = self.waiting.front() else {
                break;
            };
            let total = s.tokens();
            let limit = ((total - 1) / bt).min(s.names.len());
            let (mut hits, mut free_hits) = (0, 0);
            while hits < limit {
                let Some(&b) = self.by_name.get(&s.names[hits]) else {
                    break;
                };
                free_hits += usize::from(self.blocks[b as usize].refs == 0);
                hits += 1;
            }
            let tokens = (total - hits * bt).min(budget);
            let fresh = (hits * bt + tokens).div_ceil(bt) - hits;
            if fresh + free_hits > self.free.len() {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            for j in 0..hits {
                let b = self.by_name[&s.names[j]];
                self.reference(b);
                s.blocks.push(b);
            }
            s.named = hits;
            s.computed = hits * bt;
            if s.cached.is_none() {
                s.cached = Some(hits * bt);
                self.counters.prefix_queries += s.prompt_tokens as u64;
                self.counters.prefix_hits += (hits * bt) as u64;
            }
            self.running.push(s);
            let i = self.running.len() - 1;
            self.grow(i, tokens);
            scheduled.push((i, tokens));
            budget -= tokens;
        }

        if scheduled.is_empty() {
            self.scheduled = scheduled;
            return None;
        }

        let prefill_tokens: usize = scheduled
            .iter()
            .filter(|&&(i, tokens)| {
                let s = &self.running[i];
                !(tokens == 1 && s.output > 0 && s.computed + 1 == s.tokens())
            })
            .map(|&(_, tokens)| tokens)
            .sum();
        let duration = self.step_duration(scheduled.len(), prefill_tokens);
        let end = now + duration;

        let mut finished = false;
        for &(i, tokens) in &scheduled {
            let s = &mut self.running[i];
            s.computed += tokens;
            if s.computed < s.tokens() {
                continue; // a chunk of prefill: no token yet
            }
            s.output += 1;
            self.counters.generation_tokens += 1;
            if s.output == 1 {
                self.counters.prompt_tokens += s.prompt_tokens as u64;
                events.push(Event::FirstToken {
                    id: s.id,
                    ttft: end.saturating_sub(s.arrival),
                });
            } else {
                events.push(Event::Token { id: s.id });
            }
            if s.output >= s.max_tokens {
                s.done = true;
                finished = true;
                events.push(Event::Finished {
                    id: s.id,
                    usage: Usage {
                        prompt_tokens: s.prompt_tokens,
                        completion_tokens: s.output,
                        cached_tokens: s.cached.unwrap_or(0),
                    },
                });
            }
        }
        if finished {
            let mut running = std::mem::take(&mut self.running);
            for s in running.iter_mut().filter(|s| s.done) {
                self.release(s);
                self.counters.finished += 1;
            }
            running.retain(|s| !s.done);
            self.running = running;
        }
        self.scheduled = scheduled;
        Some(StepOutcome {
            duration,
            scheduled: self.scheduled.len(),
            prefill_tokens,
        })
    }

    /// Gives running request `i` the blocks for `tokens` more tokens (the caller checked there
    /// are enough free) and names the prompt blocks those tokens fill.
    fn grow(&mut self, i: usize, tokens: usize) {
        let bt = self.spec.block_tokens;
        let upto = self.running[i].computed + tokens;
        while self.running[i].blocks.len() < upto.div_ceil(bt) {
            let b = self.take_free();
            self.running[i].blocks.push(b);
        }
        let s = &mut self.running[i];
        while s.named < s.names.len() && (s.named + 1) * bt <= upto {
            let (name, b) = (s.names[s.named], s.blocks[s.named]);
            // A block another request is computing under the same name stays the cached one.
            if let std::collections::hash_map::Entry::Vacant(e) = self.by_name.entry(name) {
                e.insert(b);
                self.blocks[b as usize].name = Some(name);
            }
            s.named += 1;
        }
    }

    /// Takes the least recently freed block, dropping its name.
    fn take_free(&mut self) -> u32 {
        let (_, b) = self
            .free
            .pop_first()
            .expect("caller checked a block is free");
        let block = &mut self.blocks[b as usize];
        if let Some(name) = block.name.take() {
            if self.by_name.get(&name) == Some(&b) {
                self.by_name.remove(&name);
            }
        }
        block.refs = 1;
        b
    }

    /// References a cached block (a hit), taking it out of the free queue if nobody held it.
    fn reference(&mut self, b: u32) {
        let block = &mut self.blocks[b as usize];
        if block.refs == 0 {
            self.free.remove(&(block.freed, b));
        }
        block.refs += 1;
    }

    /// Drops a request's references, last block first, so that its tail is evicted first.
    fn release(&mut self, s: &mut Seq) {
        for &b in s.blocks.iter().rev() {
            let block = &mut self.blocks[b as usize];
            block.refs -= 1;
            if block.refs == 0 {
                self.tick += 1;
                block.freed = self.tick;
                self.free.insert((self.tick, b));
            }
        }
        s.blocks.clear();
        s.named = 0;
        s.computed = 0;
    }

    fn preempt(&mut self, s: &mut Seq) {
        self.release(s);
        self.counters.preemptions += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn spec(kv_blocks: usize, block_tokens: usize) -> EngineSpec {
        EngineSpec {
            kv_blocks,
            block_tokens,
            prefill_tps: 1000.0, // 1 ms per token
            step_ms: 5.0,
            step_per_seq_ms: 1.0,
            max_batch_tokens: 1000,
            max_running: 256,
        }
    }

    fn request(id: u64, names: std::ops::Range<u64>, prompt_tokens: usize, max: usize) -> Request {
        Request {
            id,
            blocks: names.collect(),
            prompt_tokens,
            max_tokens: max,
        }
    }

    /// Runs steps back to back from `now` until idle; the events with their times, and the end.
    fn run(e: &mut Engine, mut now: Duration) -> (Vec<(Duration, Event)>, Duration) {
        let mut out = Vec::new();
        let mut events = Vec::new();
        while let Some(step) = e.step(now, &mut events) {
            now += step.duration;
            out.extend(events.drain(..).map(|ev| (now, ev)));
        }
        (out, now)
    }

    fn usage(events: &[(Duration, Event)], id: u64) -> Usage {
        events
            .iter()
            .find_map(|(_, ev)| match *ev {
                Event::Finished { id: i, usage } if i == id => Some(usage),
                _ => None,
            })
            .expect("finished")
    }

    fn close(a: Duration, b: Duration) -> bool {
        a.abs_diff(b) < Duration::from_micros(1)
    }

    #[test]
    fn a_steps_duration_is_fixed_plus_per_sequence_plus_prefill() {
        let e = Engine::new(spec(100, 16));
        // 5 ms + 1 ms x 3 + 200 tokens / 1000 per s = 208 ms.
        assert!(close(e.step_duration(3, 200), 208 * MS));
        // The defaults: 6 + 0.3 x 4 = 7.2 ms for a decode step of 4 (vLLM's ~6.5 on an H100).
        let d = Engine::new(EngineSpec::default());
        assert!(close(d.step_duration(4, 0), Duration::from_micros(7200)));
    }

    #[test]
    fn a_lone_requests_ttft_is_its_queue_plus_its_prefill_steps() {
        let mut e = Engine::new(EngineSpec {
            max_batch_tokens: 400,
            ..spec(100, 16)
        });
        e.submit(request(1, 0..0, 1000, 3), Duration::ZERO).unwrap();
        // The first step starts 10 ms after the submission (the queue).
        let (events, end) = run(&mut e, 10 * MS);
        // Prefill in chunks of 400, 400, 200: (5+1+400) + (5+1+400) + (5+1+200) ms, the
        // first token at the end of the third; then two decode steps of 5+1 ms.
        let ttft = 10 * MS + 406 * MS + 406 * MS + 206 * MS;
        match events[0] {
            (at, Event::FirstToken { id: 1, ttft: t }) => {
                assert!(close(t, ttft), "{t:?}");
                assert!(close(at, ttft));
            }
            other => panic!("{other:?}"),
        }
        assert!(close(end, ttft + 12 * MS));
        assert_eq!(events.len(), 4); // first, token, token, finished
        assert_eq!(
            usage(&events, 1),
            Usage {
                prompt_tokens: 1000,
                completion_tokens: 3,
                cached_tokens: 0
            }
        );
        assert!(e.is_idle());
    }

    #[test]
    fn two_prompts_sharing_n_blocks_share_n_cached_blocks() {
        let mut e = Engine::new(spec(100, 16));
        // A: 10 named blocks (160 tokens) + 5 tokens; B shares A's first 6 blocks.
        e.submit(request(1, 0..10, 165, 2), Duration::ZERO).unwrap();
        let (ev, now) = run(&mut e, Duration::ZERO);
        assert_eq!(usage(&ev, 1).cached_tokens, 0);
        let mut b = request(2, 0..6, 165, 2);
        b.blocks.extend(100..104);
        e.submit(b, now).unwrap();
        // B computes only the 69 tokens after the shared 96: 5 + 1 + 69 ms to its first token.
        let (ev, _) = run(&mut e, now);
        assert!(matches!(ev[0].1, Event::FirstToken { ttft, .. } if close(ttft, 75 * MS)));
        assert_eq!(usage(&ev, 2).cached_tokens, 6 * 16);
        let c = e.counters();
        assert_eq!((c.prefix_queries, c.prefix_hits), (330, 96));
        assert_eq!(
            (c.prompt_tokens, c.generation_tokens, c.finished),
            (330, 4, 2)
        );
    }

    #[test]
    fn a_whole_cached_prompt_still_computes_its_last_token() {
        let mut e = Engine::new(spec(100, 16));
        e.submit(request(1, 0..4, 64, 1), Duration::ZERO).unwrap();
        let (_, now) = run(&mut e, Duration::ZERO);
        e.submit(request(2, 0..4, 64, 1), now).unwrap();
        let (ev, _) = run(&mut e, now);
        // 3 of 4 blocks: the last block holds the token that must be computed.
        assert_eq!(usage(&ev, 2).cached_tokens, 48);
    }

    #[test]
    fn unreferenced_blocks_are_evicted_least_recently_freed_first_tail_first() {
        // 6 blocks of 4 tokens. A (blocks 10, 11 + 1 token) and B (20, 21 + 1 token) each hold
        // 3 blocks (prompt 9 tokens, 1 output token needs no block of its own).
        let mut e = Engine::new(spec(6, 4));
        e.submit(request(1, 10..12, 9, 1), Duration::ZERO).unwrap();
        let (_, now) = run(&mut e, Duration::ZERO);
        e.submit(request(2, 20..22, 9, 1), now).unwrap();
        let (_, now) = run(&mut e, now);
        assert!([10, 11, 20, 21].iter().all(|&n| e.is_cached(n)));
        assert_eq!(e.counters().used_blocks, 0);
        // The free queue holds A's blocks freed tail first (its anonymous block, 11, 10), then
        // B's. C needs 2 blocks: A's anonymous one and 11 go; 10 stays (a prompt that shares
        // only A's first block still hits it).
        e.submit(request(3, 30..31, 5, 1), now).unwrap();
        let (_, now) = run(&mut e, now);
        assert!(!e.is_cached(11) && e.is_cached(10));
        assert!(e.is_cached(20) && e.is_cached(21));
        // A hit takes 20 and 21 out of the queue; D's 2 fresh blocks evict 10 and B's anonymous one.
        let mut d = request(4, 20..22, 13, 1);
        d.blocks.push(40);
        e.submit(d, now).unwrap();
        let (ev, _) = run(&mut e, now);
        assert_eq!(usage(&ev, 4).cached_tokens, 8);
        assert!(!e.is_cached(10) && e.is_cached(20) && e.is_cached(21) && e.is_cached(40));
    }

    #[test]
    fn admission_waits_while_the_cache_is_full() {
        // 10 blocks of 4 tokens; A holds 8 for its 30-token prompt and 4 outputs.
        let mut e = Engine::new(spec(10, 4));
        e.submit(request(1, 0..0, 30, 4), Duration::ZERO).unwrap();
        e.submit(request(2, 0..0, 12, 1), Duration::ZERO).unwrap();
        let mut events = Vec::new();
        let s = e.step(Duration::ZERO, &mut events).unwrap();
        // B's 3 blocks don't fit beside A's 8: A alone.
        assert_eq!((s.scheduled, s.prefill_tokens), (1, 30));
        let c = e.counters();
        assert_eq!((c.running, c.waiting, c.used_blocks), (1, 1, 8));
        assert!((c.kv_usage - 0.8).abs() < 1e-12);
        let (ev, _) = run(&mut e, s.duration);
        // B was admitted only after A finished.
        let a_done = ev
            .iter()
            .position(|(_, x)| matches!(x, Event::Finished { id: 1, .. }))
            .unwrap();
        let b_first = ev
            .iter()
            .position(|(_, x)| matches!(x, Event::FirstToken { id: 2, .. }))
            .unwrap();
        assert!(a_done < b_first);
        assert_eq!(e.counters().preemptions, 0);
    }

    #[test]
    fn a_request_that_outgrows_the_cache_preempts_the_newest() {
        // 4 blocks of 4 tokens; A (4 tokens + 8 out) and B (4 tokens + 8 out) each start with 1
        // block and grow to 3: they cannot both finish together.
        let mut e = Engine::new(spec(4, 4));
        e.submit(request(1, 0..0, 4, 8), Duration::ZERO).unwrap();
        e.submit(request(2, 0..0, 4, 8), Duration::ZERO).unwrap();
        let (ev, _) = run(&mut e, Duration::ZERO);
        assert!(e.counters().preemptions >= 1);
        assert_eq!(usage(&ev, 1).completion_tokens, 8);
        assert_eq!(usage(&ev, 2).completion_tokens, 8);
        // A, admitted first, is never preempted: its tokens come one per step from the first.
        let a_tokens = ev
            .iter()
            .filter(|(_, x)| matches!(x, Event::FirstToken { id: 1, .. } | Event::Token { id: 1 }))
            .count();
        assert_eq!(a_tokens, 8);
        assert_eq!(e.counters().generation_tokens, 16);
    }

    #[test]
    fn refusals_and_aborts() {
        let mut e = Engine::new(spec(10, 4));
        assert_eq!(
            e.submit(request(1, 0..0, 0, 1), Duration::ZERO),
            Err(SubmitError::EmptyPrompt)
        );
        assert_eq!(
            e.submit(request(1, 0..0, 1, 0), Duration::ZERO),
            Err(SubmitError::NoOutput)
        );
        assert!(matches!(
            e.submit(request(1, 0..0, 38, 3), Duration::ZERO),
            Err(SubmitError::TooLong {
                requested: 41,
                max_model_len: 40,
                ..
            })
        ));
        e.submit(request(1, 0..2, 9, 5), Duration::ZERO).unwrap();
        let mut events = Vec::new();
        e.step(Duration::ZERO, &mut events).unwrap();
        assert!(e.abort(1));
        assert!(!e.abort(1));
        assert!(e.is_idle());
        assert_eq!(e.counters().used_blocks, 0);
        assert!(e.is_cached(0) && e.is_cached(1));
    }

    #[test]
    fn the_same_calls_give_the_same_events() {
        let go = || {
            let mut e = Engine::new(EngineSpec::default());
            for id in 0..20u64 {
                let names = (id % 3) * 100..(id % 3) * 100 + 25;
                e.submit(request(id, names, 410 + id as usize, 8), id as u32 * MS)
                    .unwrap();
            }
            run(&mut e, Duration::ZERO)
        };
        assert_eq!(go(), go());
    }
}
