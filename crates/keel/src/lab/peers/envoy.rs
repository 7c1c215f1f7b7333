//! Envoy's configuration for a peer row: a static listener and cluster (YAML, API v3), run as
//! operators run it, with `--concurrency 2` (two worker threads, each with its own load
//! balancer); the admin port answers `/ready` once the listener serves.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::plan::{PeerConfig, PeerStrategy, Setting, WORKERS};

/// A protobuf Duration in YAML: seconds with an `s`.
fn secs(d: Duration) -> String {
    format!("{}s", d.as_secs_f64())
}

/// Envoy consecutive-5xx ejection threshold in the operators' setting (Envoy's default,
/// written out).
const CONSECUTIVE_5XX: u32 = 5;
/// Retries per call in the operators' setting.
const RETRIES: u32 = 2;

/// `envoy.yaml` for the row.
pub(crate) fn config(c: &PeerConfig<'_>) -> String {
    let timeout = secs(c.timeout);
    let mut route = String::new();
    match c.setting {
        Setting::Bare => {
            let _ = writeln!(route, "                  timeout: {timeout}");
        }
        Setting::Operators => {
            // Each try has the row's timeout; the whole call has room for every try.
            let _ = write!(
                route,
                "                  timeout: {}\n                  \
                 retry_policy:\n                    \
                 retry_on: \"5xx,connect-failure\"\n                    \
                 num_retries: {RETRIES}\n                    \
                 per_try_timeout: {timeout}\n",
                secs(c.timeout * (RETRIES + 1))
            );
        }
    }
    if c.strategy == PeerStrategy::Hash {
        // The header the client sets, one value per request: a request's calls hash alike.
        let _ = writeln!(
            route,
            "                  hash_policy:\n                  \
             - header:\n                      \
             header_name: {}",
            crate::lab::cases::REQUEST_KEY
        );
    }
    let lb_policy = match c.strategy {
        PeerStrategy::RoundRobin => "ROUND_ROBIN",
        PeerStrategy::Random => "RANDOM",
        PeerStrategy::LeastConnections => "LEAST_REQUEST",
        PeerStrategy::Hash => "RING_HASH",
    };
    let mut s = String::new();
    let _ = write!(
        s,
        "# keel lab --peers: {} / {}\n\
         admin:\n  \
         address:\n    \
         socket_address: {{ address: 127.0.0.1, port_value: {admin} }}\n\
         static_resources:\n  \
         listeners:\n  \
         - name: lab\n    \
         address:\n      \
         socket_address: {{ address: 127.0.0.1, port_value: {listen} }}\n    \
         filter_chains:\n    \
         - filters:\n      \
         - name: envoy.filters.network.http_connection_manager\n        \
         typed_config:\n          \
         \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager\n          \
         stat_prefix: lab\n          \
         route_config:\n            \
         virtual_hosts:\n            \
         - name: lab\n              \
         domains: [\"*\"]\n              \
         routes:\n              \
         - match: {{ prefix: \"/\" }}\n                \
         route:\n                  \
         cluster: lab\n\
         {route}          \
         http_filters:\n          \
         - name: envoy.filters.http.router\n            \
         typed_config:\n              \
         \"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router\n  \
         clusters:\n  \
         - name: lab\n    \
         type: STATIC\n    \
         connect_timeout: {connect}\n    \
         lb_policy: {lb_policy}\n",
        c.strategy.name(),
        c.setting.name(),
        admin = c.admin,
        listen = c.listen,
        connect = secs(c.connect_timeout),
    );
    if c.setting == Setting::Operators {
        let _ = write!(
            s,
            "    outlier_detection:\n      consecutive_5xx: {CONSECUTIVE_5XX}\n"
        );
    }
    s.push_str(
        "    load_assignment:\n      cluster_name: lab\n      endpoints:\n      - lb_endpoints:\n",
    );
    for b in c.backends {
        let _ = writeln!(
            s,
            "        - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
            b.ip(),
            b.port()
        );
    }
    s
}

/// Runs Envoy in the foreground on `conf` with two worker threads.
pub(crate) fn command(bin: &Path, dir: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("-c")
        .arg(conf)
        .arg("--concurrency")
        .arg(WORKERS.to_string())
        .args(["--disable-hot-restart", "-l", "error"])
        .arg("--log-path")
        .arg(dir.join("envoy.log"));
    cmd
}

/// `envoy --mode validate`: checks `conf` without serving.
#[cfg(test)]
pub(crate) fn check(bin: &Path, _dir: &Path, conf: &Path) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["--mode", "validate", "-l", "error", "-c"])
        .arg(conf);
    cmd
}
