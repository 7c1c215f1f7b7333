//! Inference pools: an engine that caches prompt prefixes in KV blocks, and what routing by
//! prefix affinity does to it.
//!
//! - [`EngineSpec`]: the one description of an engine, used by the pure engine ([`engine`]), the
//!   testbed's `keel backend --llm` that runs it in real time, the simulator ([`sim`]) that runs
//!   it in virtual time, and the closed forms ([`formula`]; an engine's failure: [`failover`];
//!   a fleet of routers: [`fleet`]; a recorded trace replayed: [`trace`]).
//! - Prompts become tokens and named blocks by `keel_balance::prefix`, the same rule the
//!   `prefix-affinity` strategy and the proxy's prompt reader use.

use serde::{Deserialize, Serialize};

pub mod engine;
pub mod failover;
pub mod fleet;
pub mod formula;
pub mod sim;
pub mod trace;

/// One inference engine: its KV cache and how long a step of continuous batching takes.
///
/// A step runs every sequence in the batch once: `step_ms + step_per_seq_ms x running +
/// prefill_tokens / prefill_tps` (seconds converted), where `prefill_tokens` is at most
/// `max_batch_tokens` (chunked prefill). The defaults are one H100 serving an 8B model (about
/// 6.5 ms per decode step at 1-4 sequences and 10.9 ms at 16, so about 6 ms + 0.3 ms per
/// sequence; 16-token blocks), with the KV cache scaled down 256 times (31,250 blocks -> 120)
/// so that a handful of shared prefixes fills it as thousands fill a production engine, and
/// prefill at 4,000 tokens/s so that a CPU's timers can keep up.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSpec {
    /// KV cache size in blocks.
    pub kv_blocks: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Prefill speed, prompt tokens per second.
    pub prefill_tps: f64,
    /// Fixed cost of a step, milliseconds.
    pub step_ms: f64,
    /// Added cost per running sequence in a step, milliseconds.
    pub step_per_seq_ms: f64,
    /// Most prompt tokens prefilled in one step (chunked prefill's budget).
    pub max_batch_tokens: usize,
    /// Most sequences running at once (vLLM's `max_num_seqs`).
    pub max_running: usize,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            kv_blocks: 120,
            block_tokens: 16,
            prefill_tps: 4000.0,
            step_ms: 6.0,
            step_per_seq_ms: 0.3,
            max_batch_tokens: 2048,
            max_running: 256,
        }
    }
}
