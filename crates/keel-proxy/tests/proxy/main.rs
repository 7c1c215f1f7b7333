//! keel-proxy's integration tests, as one test binary: one link and one build of `support`
//! instead of one per file (the release build of the workspace's tests is most of CI's time).
//! Tests that read process-wide state (descriptors, RSS, thread names) stay in binaries of
//! their own, one at a time: `tests/process_wide/`. Run one file's tests with a filter,
//! e.g. `cargo test --release -p keel-proxy --test proxy h1_path::`. The etcd tests (module
//! `etcd`, built with the `etcd` feature) are ignored unless asked for: `scripts/test-etcd.sh`.

mod support;

mod access_lists;
mod access_log;
mod admin_access;
mod admin_ops;
mod admin_status;
mod affine_failures;
mod compression;
mod config_props;
mod connection_limits;
mod content_length;
mod discovery;
mod endpoint_state_over_time;
mod engine_signals;
#[cfg(feature = "etcd")]
mod etcd;
mod failure_evidence;
mod h1_path;
mod h2_frames;
mod h3;
mod health_checks;
mod hedging;
mod hostile_requests;
mod idle_memory;
mod inference;
mod inference_metering;
mod load_reports;
mod malformed_input;
mod models;
mod no_request_lost;
mod one_failed_of_five;
mod path_normalisation;
mod protocols;
mod proxy_behaviour;
mod proxy_protocol;
mod pushback;
mod rate_limit;
mod request_targets;
mod rewrites;
mod route_split;
mod routes;
mod slow_uploads;
mod sticky;
mod timeouts;
mod tls;
mod token_budget;
mod trace_context;

mod zones;
