//! The balancers whose logs `keel advise` reads besides keel's own (NGINX, HAProxy, Envoy):
//! which of their strategies and protections the simulator can run (by keel-balance's code for
//! the same rule), how, and the recommendation written in their own configuration language,
//! saying what that language cannot express.

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::{OutlierConfig, RetryBudgetConfig, StrategyKind};
use serde::Serialize;

use super::terms::{human, Protections};
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
            // HAProxy's `random` draws two servers and takes the less loaded one (`random(2)`,
            // its default): keel's least-request. One draw, `random(1)`, is the uniform pick.
            Balancer::Haproxy => vec![
                ("roundrobin", RoundRobin),
                ("leastconn", LeastConnections),
                ("random", LeastRequest),
                ("random(1)", Random),
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

    /// A protection set in its own words: what it turns on (only keel's `Defaults` set is its
    /// defaults; a peer's defaults are [`Balancer::real_defaults`]).
    pub fn label(self, p: Protections) -> &'static str {
        match (self, p) {
            (Balancer::Keel, p) => p.label(),
            (_, Protections::None) => "none",
            (_, Protections::Running) => "as configured",
            (Balancer::Nginx, Protections::Defaults) => "max_fails=1 + 1 retry",
            (Balancer::Nginx, Protections::Protected) => "max_fails=1 + 2 retries",
            (Balancer::Haproxy, Protections::Defaults) => "retries 1 + redispatch",
            (Balancer::Haproxy, Protections::Protected) => "retries 2 + redispatch + check",
            (Balancer::Envoy, Protections::Defaults) => "outlier + 1 retry",
            (Balancer::Envoy, Protections::Protected) => "outlier + 2 retries + health",
        }
    }

    /// The balancer's real defaults (what it does with none of these settings written), the
    /// simulated set that is them, and why, in words.
    pub fn real_defaults(self) -> (Protections, &'static str) {
        match self {
            Balancer::Keel => (
                Protections::Defaults,
                "keel proxy's defaults (outlier detection and one retry within the 20 % budget)",
            ),
            Balancer::Nginx => (
                Protections::None,
                "NGINX's defaults (max_fails=1 fail_timeout=10s and proxy_next_upstream error timeout: a failure status is passed on, neither retried nor counted as a failure, so for failure statuses they are the `none` row; they do retry and mark down on refused connections and timeouts)",
            ),
            Balancer::Haproxy => (
                Protections::None,
                "HAProxy's defaults (retries 3 on a failed connection, to the same server, no redispatch, no checks: a failure status is passed on, so they are the `none` row)",
            ),
            Balancer::Envoy => (
                Protections::None,
                "Envoy's defaults (no retry_policy, no outlier_detection, no health_checks: the `none` row)",
            ),
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

    /// Applies protection set `p` to a scenario the way this balancer would run it. The
    /// scenario's timeout is the per-try timeout of a request without retries (the log's, or
    /// the balancer's default).
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
                // `option redispatch 1`: every retry to another server, as the simulator's.
                sc.retry = Some(RetryConfig {
                    max_retries: retries,
                    budget: unlimited(),
                });
                if p == Protections::Protected {
                    // `check` with HAProxy's timing: the first check after `inter`, down after
                    // `fall` failed checks, up after `rise`; the simulator's probes run so.
                    sc.health_check = Some(haproxy_check());
                }
            }
            Balancer::Envoy => {
                // Envoy's outlier_detection defaults are keel's (5 consecutive 5xx, 30 s,
                // 300 s at most, 10 %), and with `always_eject_one_host` (written in the
                // block) its cap is keel's too: max(1, floor(n x 10 %)).
                b.outlier_detection = Some(OutlierConfig::default());
                sc.retry = Some(RetryConfig {
                    max_retries: retries,
                    budget: unlimited(),
                });
                // Without per_try_timeout a hung first try takes the route's whole timeout
                // and leaves none for a retry: the block splits the route timeout over the
                // tries, as keel proxy does.
                sc.timeout /= retries + 1;
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
                "the log's errors count failure statuses and refused connections alike: NGINX's defaults retry the second (proxy_next_upstream error) and not the first, and are simulated as retrying neither",
            ],
            Balancer::Haproxy => &[
                "HAProxy's log names servers, not addresses: the block sets a backend's lines and keeps your `server` lines (addresses, weights) as they are",
                "no retry budget: `retries` caps the tries of one request only",
                "passive detection (observe layer7) is not recommended: its timing against the checks is not modelled (a run by hand measured a hung server's p99 at 1,013 ms where 5 errors in a row were simulated at 13 ms)",
                "no least-time, peak-EWMA or Prequal; these are not ranked",
            ],
            Balancer::Envoy => &[
                "retries are a route's setting in Envoy (retry_policy), not the cluster's: the block shows both",
                "the default access-log format names only the last try's host: with retries on, earlier tries' failures are not in the log, so the fitted failure shares are low",
                "no least-time or Prequal (LEAST_REQUEST with active_request_bias comes closest to peak-EWMA); these are not ranked",
                "Envoy's retry budget (circuit_breakers retry_budget) is not set: retries are capped per request, and at once by circuit_breakers max_retries, which the block raises above what the fitted load can reach",
                "Envoy runs its first health check at once, the simulation after one interval",
            ],
        };
        v.iter().map(|s| s.to_string()).collect()
    }
}

/// HAProxy's own check timing (`check` alone: `inter 2s`, `fall 3`, `rise 2`).
fn haproxy_check() -> HealthCheckConfig {
    HealthCheckConfig {
        interval: Duration::from_secs(2),
        unhealthy_threshold: 3,
        healthy_threshold: 2,
    }
}

/// Envoy ejects a host while `(ejected + 1) / hosts <= max_ejection_percent` (rounding down:
/// 10 % of 5 hosts ejects none), or the first one with `always_eject_one_host`.
pub fn envoy_ejection_cap(hosts: usize, percent: f64, always_one: bool) -> usize {
    let floor = (hosts as f64 * percent / 100.0 + 1e-9).floor() as usize;
    if always_one {
        floor.max(1).min(hosts)
    } else {
        floor
    }
}

/// Envoy's `circuit_breakers` `max_retries` for retries that never wait on it: with Poisson
/// arrivals the requests in flight are Poisson (an M/G/infinity system) with mean `in_flight`,
/// and retries in flight are fewer; the smallest n with P(more than n) below 1e-4, at least
/// Envoy's default 3.
pub fn envoy_retry_breaker(in_flight: f64) -> u32 {
    let m = in_flight.max(0.0);
    if m > 500.0 {
        // The normal approximation (the exact sum underflows): 1e-4 above is 3.72 sd.
        return (m + 3.72 * m.sqrt()).ceil() as u32;
    }
    let mut p = (-m).exp();
    let mut cdf = p;
    let mut n = 0u32;
    while 1.0 - cdf >= 1e-4 && n < 100_000 {
        n += 1;
        p *= m / f64::from(n);
        cdf += p;
    }
    n.max(3)
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

/// A duration as Envoy's YAML takes it (`7.5s`: a protobuf Duration, seconds with a fraction).
fn envoy_duration(d: Duration) -> String {
    let s = format!("{:.3}", d.as_secs_f64());
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}s")
}

/// Where the simulated per-try timeout comes from, in words.
fn timeout_source(balancer: Balancer, model: &FittedModel) -> String {
    match model.timeout_ms {
        Some(t) => format!("the log's timed-out tries took {t:.0} ms"),
        None if balancer == Balancer::Haproxy => format!(
            "no try timed out in the log; HAProxy has no default, {} assumed",
            human(balancer.default_timeout())
        ),
        None => format!(
            "no try timed out in the log: {}'s default {} assumed",
            balancer.name(),
            human(balancer.default_timeout())
        ),
    }
}

/// The recommendation in the balancer's own configuration language. `native` is the
/// strategy's own spelling, `name` the upstream / backend / cluster name, `mean_ms` the
/// simulated mean request latency (it sizes Envoy's retry circuit breaker). Each block says
/// which of the operator's settings it keeps and which it assumes.
pub fn config_text(
    balancer: Balancer,
    model: &FittedModel,
    native: &str,
    p: Protections,
    sc: &Scenario,
    mean_ms: f64,
) -> String {
    let name = if model.cluster.is_empty() {
        "app"
    } else {
        model.cluster.as_str()
    };
    let retries = sc.retry.as_ref().map_or(0, |r| r.max_retries);
    let kind = sc.clusters[0].balancer.strategy;
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# keel advise: {native} with {} ({})",
        balancer.label(p),
        balancer.name()
    );
    match balancer {
        Balancer::Keel => unreachable!("keel's paste block is a [[cluster]] table"),
        Balancer::Nginx => {
            comment(
                &mut t,
                &format!(
                    "keeps: your proxy_read_timeout and proxy_connect_timeout (per try; simulated {}: {}), and every other directive; assumes no other `server` parameters (weight=, backup): add yours",
                    human(sc.timeout),
                    timeout_source(balancer, model)
                ),
            );
            let _ = writeln!(t, "upstream {name} {{\n    zone {name} 64k;  # least_conn and max_fails shared by every worker");
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
                " max_fails=0"
            } else {
                " max_fails=1 fail_timeout=10s"
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
        }
        Balancer::Haproxy => {
            let servers: Vec<&str> = model.endpoints.iter().map(|e| e.name.as_str()).collect();
            comment(
                &mut t,
                &format!(
                    "in `backend {name}`: set these lines; keep your `timeout server` (per try; simulated {}: {}), your other timeouts and your `server` lines ({}) with their addresses as they are",
                    human(sc.timeout),
                    timeout_source(balancer, model),
                    servers.join(", ")
                ),
            );
            let _ = writeln!(t, "backend {name}");
            let balance = match kind {
                StrategyKind::LeastConnections => "leastconn",
                StrategyKind::Random => "random(1)",
                StrategyKind::LeastRequest => "random  # two draws, the less loaded: random(2)",
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
            } else {
                let _ = writeln!(t, "    no option redispatch");
            }
            if let Some(h) = &sc.health_check {
                let _ = writeln!(
                    t,
                    "    option httpchk GET /healthz\n    default-server check inter {} fall {} rise {}  # HAProxy's own timing, written out",
                    ms(h.interval),
                    h.unhealthy_threshold,
                    h.healthy_threshold
                );
                comment(
                    &mut t,
                    "a `server` line's own inter, fall or rise overrides the default-server line",
                );
            } else {
                comment(
                    &mut t,
                    "assumes no `check` on the server lines (simulated without health checks)",
                );
            }
        }
        Balancer::Envoy => {
            comment(
                &mut t,
                &format!(
                    "the cluster (an entry of static_resources.clusters); keep your own connect_timeout, TLS and other fields. Assumes the route's timeout of {} ({})",
                    human(sc.timeout * (retries + 1)),
                    timeout_source(balancer, model)
                ),
            );
            let _ = writeln!(t, "name: \"{name}\"\ntype: STRICT_DNS\nlb_policy: {native}\nload_assignment:\n  cluster_name: \"{name}\"\n  endpoints:\n  - lb_endpoints:");
            for e in &model.endpoints {
                let (h, port) = host_port(&e.name);
                let _ = writeln!(t, "    - endpoint: {{address: {{socket_address: {{address: \"{h}\", port_value: {port}}}}}}}");
            }
            let hosts = model.endpoints.len();
            if let Some(o) = &sc.clusters[0].balancer.outlier_detection {
                let alone = envoy_ejection_cap(hosts, o.max_ejection_percent, false);
                let _ = writeln!(
                    t,
                    "outlier_detection:\n  consecutive_5xx: {}\n  base_ejection_time: {}\n  max_ejection_time: {}\n  max_ejection_percent: {}",
                    o.consecutive_failures,
                    envoy_duration(o.base_ejection_time),
                    envoy_duration(o.max_ejection_time),
                    o.max_ejection_percent
                );
                let _ = writeln!(
                    t,
                    "  always_eject_one_host: true  # {} % of {hosts} hosts alone ejects {alone} (Envoy rounds down)",
                    o.max_ejection_percent
                );
            }
            if retries > 0 {
                let in_flight = model.arrival.rate_per_s * mean_ms / 1e3;
                let n = envoy_retry_breaker(in_flight);
                comment(
                    &mut t,
                    &format!(
                        "retries at once: Envoy's default circuit breaker (max_retries 3) refuses the rest; at {in_flight:.1} requests in flight on average, more than {n} at once has odds below 1e-4"
                    ),
                );
                let _ = writeln!(t, "circuit_breakers:\n  thresholds:\n  - max_retries: {n}");
            }
            if let Some(h) = &sc.health_check {
                let _ = writeln!(
                    t,
                    "health_checks:\n- timeout: 1s\n  interval: {}\n  unhealthy_threshold: {}\n  healthy_threshold: {}\n  http_health_check: {{path: /healthz}}",
                    envoy_duration(h.interval),
                    h.unhealthy_threshold,
                    h.healthy_threshold
                );
            }
            let _ = writeln!(
                t,
                "# --- in the route that sends to it (route: {{cluster: {name}, ...}}) ---"
            );
            if retries > 0 {
                let _ = writeln!(
                    t,
                    "retry_policy:\n  retry_on: 5xx,connect-failure,reset\n  num_retries: {retries}\n  per_try_timeout: {}  # the route's timeout over {} tries\n  retry_host_predicate:\n  - name: envoy.retry_host_predicates.previous_hosts\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate\n  host_selection_retry_max_attempts: 3",
                    envoy_duration(sc.timeout),
                    retries + 1
                );
            } else {
                let _ = writeln!(t, "# no retry_policy");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_rounds_its_ejection_cap_down_unless_one_host_is_always_allowed() {
        // 10 % of 5 hosts: (0 + 1) / 5 = 20 % > 10 %, none; keel's rule is max(1, floor).
        assert_eq!(envoy_ejection_cap(5, 10.0, false), 0);
        assert_eq!(envoy_ejection_cap(5, 10.0, true), 1);
        assert_eq!(envoy_ejection_cap(10, 10.0, false), 1);
        assert_eq!(envoy_ejection_cap(25, 10.0, true), 2);
        assert_eq!(envoy_ejection_cap(5, 20.0, false), 1);
    }

    #[test]
    fn the_retry_breaker_is_the_poisson_tail_of_requests_in_flight() {
        // P(Poisson(m) > n) < 1e-4, never below Envoy's own 3.
        assert_eq!(envoy_retry_breaker(0.0), 3);
        // Poisson(0.5): P(X > 4) = 1.7e-4, P(X > 5) = 1.4e-5.
        assert_eq!(envoy_retry_breaker(0.5), 5);
        // Poisson(10): P(X > 23) = 1.2e-4, P(X > 24) = 4.7e-5.
        assert_eq!(envoy_retry_breaker(10.0), 24);
        let big = envoy_retry_breaker(10_000.0);
        assert!((10_370..=10_375).contains(&big), "{big}");
    }
}
