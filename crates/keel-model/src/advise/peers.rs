//! The balancers whose logs `keel advise` reads besides keel's own (NGINX, HAProxy, Envoy):
//! which of their strategies and protections the simulator can run (by keel-balance's code for
//! the same rule), how, and the recommendation written in their own configuration language,
//! saying what that language cannot express.

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::{OutlierConfig, RetryBudgetConfig, StrategyKind};
use serde::Serialize;

use super::{human, Protections};
use crate::fit::FittedModel;
use crate::sim::{HealthCheckConfig, RetryConfig, Scenario};

/// The balancer a log comes from, and whose configuration the advice is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Balancer {
    /// keel proxy.
    #[default]
    Keel,
    /// NGINX (open source).
    Nginx,
    /// HAProxy.
    Haproxy,
    /// Envoy.
    Envoy,
}

/// No retry budget: the peers cap retries per request only.
fn unlimited() -> RetryBudgetConfig {
    RetryBudgetConfig {
        budget_percent: 1000.0,
        ..RetryBudgetConfig::default()
    }
}

impl Balancer {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Balancer::Keel => "keel",
            Balancer::Nginx => "NGINX",
            Balancer::Haproxy => "HAProxy",
            Balancer::Envoy => "Envoy",
        }
    }

    /// The strategies it offers that keel-balance simulates: (its own spelling, the rule).
    pub fn strategies(self) -> Vec<(&'static str, StrategyKind)> {
        use StrategyKind::*;
        match self {
            Balancer::Keel => StrategyKind::ALL
                .into_iter()
                .filter(|s| *s != OrcaWrr)
                .map(|s| (s.name(), s))
                .collect(),
            Balancer::Nginx => vec![
                ("round-robin", RoundRobin),
                ("least_conn", LeastConnections),
                ("random", Random),
                ("random two least_conn", LeastRequest),
                ("hash consistent", RingHash),
            ],
            Balancer::Haproxy => vec![
                ("roundrobin", RoundRobin),
                ("leastconn", LeastConnections),
                ("random", Random),
                ("random(2)", LeastRequest),
                ("hash-type consistent", RingHash),
            ],
            Balancer::Envoy => vec![
                ("ROUND_ROBIN", RoundRobin),
                ("LEAST_REQUEST", LeastRequest),
                ("RANDOM", Random),
                ("RING_HASH", RingHash),
                ("MAGLEV", Maglev),
            ],
        }
    }

    /// The protection sets simulated for it, least first.
    pub fn protection_sets(self) -> [Protections; 3] {
        [
            Protections::None,
            Protections::Defaults,
            Protections::Protected,
        ]
    }

    /// A protection set in its own words.
    pub fn label(self, p: Protections) -> &'static str {
        match (self, p) {
            (Balancer::Keel, p) => p.label(),
            (_, Protections::None) => "none",
            (_, Protections::Running) => "as configured",
            (Balancer::Nginx, Protections::Defaults) => "max_fails=1 + 1 retry",
            (Balancer::Nginx, Protections::Protected) => "max_fails=1 + 2 retries",
            (Balancer::Haproxy, Protections::Defaults) => "retries 1 + redispatch",
            (Balancer::Haproxy, Protections::Protected) => {
                "retries 2 + redispatch + check + observe"
            }
            (Balancer::Envoy, Protections::Defaults) => "outlier + 1 retry",
            (Balancer::Envoy, Protections::Protected) => "outlier + 2 retries + health",
        }
    }

    /// The per-try timeout when the log shows none: the balancer's own default.
    pub fn default_timeout(self) -> Duration {
        match self {
            // keel proxy: 15 s over 2 tries.
            Balancer::Keel => Duration::from_millis(7_500),
            // proxy_read_timeout.
            Balancer::Nginx => Duration::from_secs(60),
            // `timeout server` has no default; 30 s is the value its examples use.
            Balancer::Haproxy => Duration::from_secs(30),
            // The route's timeout.
            Balancer::Envoy => Duration::from_secs(15),
        }
    }

    /// Applies protection set `p` to a scenario the way this balancer would run it.
    pub fn protect(self, mut sc: Scenario, p: Protections) -> Scenario {
        let retries = match p {
            Protections::None | Protections::Running => return sc,
            Protections::Defaults => 1,
            Protections::Protected => 2,
        };
        let b = &mut sc.clusters[0].balancer;
        match self {
            Balancer::Keel => unreachable!("keel's sets are advise's own"),
            Balancer::Nginx => {
                // max_fails=1 fail_timeout=10s: one failure takes the server out for 10 s
                // (the same as one failure in a row); NGINX lets every server be out.
                b.outlier_detection = Some(OutlierConfig {
                    consecutive_failures: 1,
                    base_ejection_time: Duration::from_secs(10),
                    max_ejection_time: Duration::from_secs(10),
                    max_ejection_percent: 100.0,
                    ..OutlierConfig::default()
                });
                sc.retry = Some(RetryConfig {
                    max_retries: retries,
                    budget: unlimited(),
                });
            }
            Balancer::Haproxy => {
                sc.retry = Some(RetryConfig {
                    max_retries: retries,
                    budget: unlimited(),
                });
                if p == Protections::Protected {
                    // observe layer7 error-limit 5 on-error mark-down: down until `rise` checks
                    // pass (inter 5s x rise 2).
                    b.outlier_detection = Some(OutlierConfig {
                        consecutive_failures: 5,
                        base_ejection_time: Duration::from_secs(10),
                        max_ejection_time: Duration::from_secs(10),
                        max_ejection_percent: 100.0,
                        ..OutlierConfig::default()
                    });
                    sc.health_check = Some(HealthCheckConfig {
                        interval: Duration::from_secs(5),
                        unhealthy_threshold: 2,
                        healthy_threshold: 2,
                    });
                }
            }
            Balancer::Envoy => {
                // Envoy's outlier_detection defaults are keel's: 5 consecutive 5xx, 30 s,
                // at most 10 % of the hosts.
                b.outlier_detection = Some(OutlierConfig::default());
                sc.retry = Some(RetryConfig {
                    max_retries: retries,
                    budget: unlimited(),
                });
                if p == Protections::Protected {
                    sc.health_check = Some(HealthCheckConfig {
                        interval: Duration::from_secs(5),
                        unhealthy_threshold: 2,
                        healthy_threshold: 2,
                    });
                }
            }
        }
        sc
    }

    /// What its configuration cannot express of keel's choices, and where the simulation only
    /// approximates it.
    pub fn limits(self) -> Vec<String> {
        let v: &[&str] = match self {
            Balancer::Keel => &[],
            Balancer::Nginx => &[
                "open-source NGINX has no active health checks (NGINX Plus's `health_check`): a server is marked failed only by real requests (max_fails / fail_timeout)",
                "no retry budget: proxy_next_upstream_tries caps the tries of one request only, so retries can double the load of an outage",
                "no least-time, peak-EWMA or Prequal (NGINX Plus has least_time); these are not ranked",
                "max_fails counts failures within fail_timeout, not in a row (the same for max_fails=1, which is what is simulated); when every server is marked failed NGINX tries them all again, as the simulation's panic threshold does",
                "POST and other non-idempotent requests are not retried unless proxy_next_upstream says non_idempotent",
            ],
            Balancer::Haproxy => &[
                "HAProxy's log names servers, not addresses: keep each `server` line's address from your configuration",
                "no retry budget: `retries` caps the tries of one request only",
                "passive detection (observe layer7) needs active checks to bring a server back: simulated as 5 errors in a row taking it out for inter x rise = 10 s",
                "no least-time, peak-EWMA or Prequal; these are not ranked",
            ],
            Balancer::Envoy => &[
                "retries are a route's setting in Envoy (retry_policy), not the cluster's: the block shows both",
                "the default access-log format names only the last try's host: with retries on, earlier tries' failures are not in the log, so the fitted failure shares are low",
                "no least-time or Prequal (LEAST_REQUEST with active_request_bias comes closest to peak-EWMA); these are not ranked",
                "Envoy's retry budget (circuit_breakers retry_budget) is not set: retries are capped per request only",
            ],
        };
        v.iter().map(|s| s.to_string()).collect()
    }
}

/// `host:port` split (IPv6 in brackets kept whole).
fn host_port(addr: &str) -> (&str, &str) {
    match addr.rsplit_once(':') {
        Some((h, p)) => (h.trim_start_matches('[').trim_end_matches(']'), p),
        None => (addr, "80"),
    }
}

fn ms(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

/// The recommendation in the balancer's own configuration language. `native` is the
/// strategy's own spelling, `name` the upstream / backend / cluster name.
pub fn config_text(
    balancer: Balancer,
    model: &FittedModel,
    native: &str,
    p: Protections,
    sc: &Scenario,
) -> String {
    let name = if model.cluster.is_empty() {
        "app"
    } else {
        model.cluster.as_str()
    };
    let retries = sc.retry.as_ref().map_or(0, |r| r.max_retries);
    let kind = sc.clusters[0].balancer.strategy;
    let mut t = String::new();
    let head = format!(
        "keel advise: {native} with {} ({})",
        balancer.label(p),
        balancer.name()
    );
    match balancer {
        Balancer::Keel => unreachable!("keel's paste block is a [[cluster]] table"),
        Balancer::Nginx => {
            let _ = writeln!(t, "# {head}\nupstream {name} {{\n    zone {name} 64k;  # least_conn and max_fails shared by every worker");
            match kind {
                StrategyKind::LeastConnections => {
                    let _ = writeln!(t, "    least_conn;");
                }
                StrategyKind::Random => {
                    let _ = writeln!(t, "    random;");
                }
                StrategyKind::LeastRequest => {
                    let _ = writeln!(t, "    random two least_conn;");
                }
                StrategyKind::RingHash => {
                    let _ = writeln!(t, "    hash $request_id consistent;  # or the key your requests should stick by");
                }
                _ => {}
            }
            let fails = if p == Protections::None {
                " max_fails=0".to_string()
            } else {
                " max_fails=1 fail_timeout=10s".to_string()
            };
            for e in &model.endpoints {
                let _ = writeln!(t, "    server {}{fails};", e.name);
            }
            let _ = writeln!(t, "}}\n# in each location with proxy_pass http://{name};");
            if retries == 0 {
                let _ = writeln!(t, "proxy_next_upstream off;");
            } else {
                let _ = writeln!(
                    t,
                    "proxy_next_upstream error timeout http_500 http_502 http_503 http_504;\nproxy_next_upstream_tries {};  # the first try and {retries} retries",
                    retries + 1
                );
            }
            let _ = writeln!(t, "proxy_read_timeout {};  # per try", ms(sc.timeout));
        }
        Balancer::Haproxy => {
            let _ = writeln!(t, "# {head}\nbackend {name}");
            let balance = match kind {
                StrategyKind::LeastConnections => "leastconn",
                StrategyKind::Random => "random",
                StrategyKind::LeastRequest => "random(2)",
                StrategyKind::RingHash => "uri\n    hash-type consistent",
                _ => "roundrobin",
            };
            let _ = writeln!(t, "    balance {balance}");
            let _ = writeln!(t, "    retries {retries}");
            if retries > 0 {
                let _ = writeln!(
                    t,
                    "    option redispatch 1  # every retry to another server\n    retry-on conn-failure empty-response response-timeout 500 502 503 504"
                );
            }
            let _ = writeln!(t, "    timeout server {}  # per try", ms(sc.timeout));
            let server_opts = if let Some(h) = &sc.health_check {
                let _ = writeln!(t, "    option httpchk GET /healthz");
                format!(
                    " check inter {} fall {} rise {} observe layer7 error-limit 5 on-error mark-down",
                    ms(h.interval),
                    h.unhealthy_threshold,
                    h.healthy_threshold
                )
            } else {
                String::new()
            };
            for e in &model.endpoints {
                let _ = writeln!(t, "    server {0} <address of {0}>{server_opts}", e.name);
            }
        }
        Balancer::Envoy => {
            let _ = writeln!(t, "# {head}\nname: {name}\ntype: STRICT_DNS\nlb_policy: {native}\nload_assignment:\n  cluster_name: {name}\n  endpoints:\n  - lb_endpoints:");
            for e in &model.endpoints {
                let (h, port) = host_port(&e.name);
                let _ = writeln!(t, "    - endpoint: {{address: {{socket_address: {{address: {h}, port_value: {port}}}}}}}");
            }
            if let Some(o) = &sc.clusters[0].balancer.outlier_detection {
                let _ = writeln!(
                    t,
                    "outlier_detection:\n  consecutive_5xx: {}\n  base_ejection_time: {}\n  max_ejection_percent: {}",
                    o.consecutive_failures,
                    human(o.base_ejection_time),
                    o.max_ejection_percent
                );
            }
            if let Some(h) = &sc.health_check {
                let _ = writeln!(
                    t,
                    "health_checks:\n- timeout: 1s\n  interval: {}\n  unhealthy_threshold: {}\n  healthy_threshold: {}\n  http_health_check: {{path: /healthz}}",
                    human(h.interval),
                    h.unhealthy_threshold,
                    h.healthy_threshold
                );
            }
            if retries > 0 {
                let _ = writeln!(
                    t,
                    "# and in the route that sends to it (route: {{cluster: {name}, ...}}):\n# retry_policy:\n#   retry_on: 5xx,connect-failure,reset\n#   num_retries: {retries}\n#   per_try_timeout: {}\n#   retry_host_predicate: [{{name: envoy.retry_host_predicates.previous_hosts}}]\n#   host_selection_retry_max_attempts: 3",
                    human(sc.timeout)
                );
            } else {
                let _ = writeln!(t, "# and no retry_policy in the route that sends to it");
            }
        }
    }
    for l in balancer.limits().iter().take(2) {
        comment(&mut t, &format!("cannot express: {l}"));
    }
    t
}

/// `text` as configuration comment lines of at most 100 columns (`# `, then `#   ` on the
/// lines it continues on).
fn comment(t: &mut String, text: &str) {
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() > 4 && line.len() + 1 + word.len() > 100 {
            t.push_str(&line);
            t.push('\n');
            line = String::from("#  ");
        }
        line.push(' ');
        line.push_str(word);
    }
    t.push_str(&line);
    t.push('\n');
}
