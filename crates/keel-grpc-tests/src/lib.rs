//! No code: this crate holds keel-proxy's gRPC tests (`tests/grpc.rs`), which use a real gRPC
//! client and server (tonic's `grpc.health.v1.Health`), apart from keel-proxy's own tests so
//! that those build without tonic.
//!
//! Its one binary, `h2-backend` (`src/bin/h2-backend.rs`), is the h2c and gRPC endpoint of
//! `bench/proxy/h2.sh`.
