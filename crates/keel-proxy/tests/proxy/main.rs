//! keel-proxy's integration tests, as one test binary: one link and one build of `support`
//! instead of one per file (the release build of the workspace's tests is most of CI's time).
//! Tests that read process-wide state (descriptors, RSS, thread names) stay in binaries of
//! their own: `tests/chaos.rs`, `tests/proxy_workers.rs`. Run one file's tests with a filter,
//! e.g. `cargo test --release -p keel-proxy --test proxy h1_path::`.

mod support;

mod access_log;
mod admin_status;
mod config_props;
mod discovery;
mod edges;
mod h1_path;
mod hardening;
mod hardening_admin;
mod hardening_limits;
mod hedging;
mod lifecycle;
mod load_reports;
mod protocols;
mod proxy_behaviour;
mod proxy_done;
mod proxy_lifecycle;
mod rate_limit;
mod rewrites;
mod routes;
mod sticky;
mod timeouts;
mod tls;
mod zones;
