//! Benchmark-only crate: see `benches/compare.rs`.
