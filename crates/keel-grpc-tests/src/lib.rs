//! No code: this crate holds keel-proxy's gRPC tests (`tests/grpc/calls.rs`), which use a real gRPC
//! client and server (tonic's `grpc.health.v1.Health`), and its OTLP span export's
//! (`tests/grpc/otlp.rs`, a real OTLP/gRPC collector), apart from keel-proxy's own tests so that
//! those build without tonic.
//!
//! Its binaries: `h2-backend` (`src/bin/h2-backend.rs`), the h2c and gRPC endpoint of
//! `bench/proxy/h2.sh`, and `h2-floor`, that benchmark's floor proxy; `otlp-collector`, the
//! OTLP/gRPC collector of `scripts/trace-envoy-check.sh`, which prints the spans it receives.
