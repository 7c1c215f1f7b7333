//! The engine as a pure state machine, time passed in: continuous batching over a KV cache of prefix blocks.
