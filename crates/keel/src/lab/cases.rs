//! The lab's cases: one per (experiment, strategy, failure mode, protections), each described
//! once and turned into a proxy configuration, a simulator scenario and a closed form. The
//! backends and the simulated servers get the same [`Latency`] and [`FailureMode`] values.

use std::time::Duration;

use std::net::SocketAddr;

use keel_balance::{
    BalancerConfig, EndpointSpec, OutlierConfig, RetryBudgetConfig, StrategyKind, TieBreak,
};
use keel_model::sim::{self, FailedPosition, Load, Placement, RetryConfig, Scenario};
use keel_model::{FailureMode, Latency};
use keel_proxy::config::{ClusterConfig, HashOn, HealthCheckConfig, ListenerConfig};
use keel_proxy::ProxyConfig;
use keel_testbed::loadgen::Client;
use serde::Serialize;

use crate::lab::options::LabOptions;

/// The model's times scaled down (10 ms -> 4 ms, 1 s -> 400 ms), so that a hanging server keeps
/// q = 100 and a run takes about a minute.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// Healthy service time (the mean when `healthy_dist` spreads it).
    #[serde(with = "humantime_serde")]
    pub healthy: Duration,
    /// The healthy times' shape: fixed but for one row (round-robin's all-calls clients with
    /// times spread, exponential).
    #[serde(skip)]
    pub healthy_dist: keel_model::LatencyDist,
    /// The caller's timeout for one try (a hanging server costs this much).
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// What the simulation adds to every call for the loopback round trip through the proxy,
    /// which its servers do not have: without it, an error "at once" would take no time at all.
    #[serde(with = "humantime_serde")]
    pub round_trip: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            healthy: Duration::from_millis(4),
            healthy_dist: keel_model::LatencyDist::Fixed,
            timeout: Duration::from_millis(400),
            round_trip: Duration::from_micros(100),
        }
    }
}

impl Timing {
    /// The healthy servers' latency.
    pub fn latency(&self) -> Latency {
        Latency {
            mean: self.healthy,
            dist: self.healthy_dist,
        }
    }
}

/// The protections of E6, one value for the proxy and the simulator: outlier ejection after 3
/// failures in a row (5 s, at most half of the servers), up to 2 retries on other servers
/// within a 20 % retry budget, health checks every 100 ms (2 to fail, 2 to pass).
#[derive(Debug, Clone, Serialize)]
pub struct Protections {
    /// Failures in a row that eject a server.
    pub consecutive_failures: u32,
    /// First ejection time.
    #[serde(with = "humantime_serde")]
    pub base_ejection_time: Duration,
    /// Most servers ejected at once, in percent.
    pub max_ejection_percent: f64,
    /// Retries per call, each on a server the call has not tried.
    pub retries: u32,
    /// Retries as a share of requests, in percent.
    pub budget_percent: f64,
    /// Time between health checks of a server (also a check's own time limit in the proxy).
    #[serde(with = "humantime_serde")]
    pub health_interval: Duration,
    /// Checks in a row that mark a server unhealthy, or healthy again.
    pub health_threshold: u32,
}

/// `[cluster.retry] attempts`' default in keel proxy.
pub const DEFAULT_RETRIES: u32 = 1;

/// The protections every E6 case uses.
pub const PROTECTIONS: Protections = Protections {
    consecutive_failures: 3,
    base_ejection_time: Duration::from_secs(5),
    max_ejection_percent: 50.0,
    retries: 2,
    budget_percent: 20.0,
    health_interval: Duration::from_millis(100),
    health_threshold: 2,
};

impl Protections {
    /// keel-balance's outlier detection.
    pub fn outlier(&self) -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: self.consecutive_failures,
            base_ejection_time: self.base_ejection_time,
            max_ejection_percent: self.max_ejection_percent,
            ..OutlierConfig::default()
        }
    }

    /// keel-balance's retry budget.
    pub fn budget(&self) -> RetryBudgetConfig {
        RetryBudgetConfig {
            budget_percent: self.budget_percent,
            ..RetryBudgetConfig::default()
        }
    }
}

/// Which protections a case runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// None at all: no retries, no outlier detection, no health checks.
    None,
    /// E6's: [`PROTECTIONS`].
    Lab,
    /// What `keel proxy` does with a cluster written with nothing but its endpoints: outlier
    /// detection and the retry budget at their defaults, one retry, no health checks (the
    /// request timeout scaled as every lab time is, so that a try has the case's timeout).
    Defaults,
}

/// One experiment case.
#[derive(Debug, Clone)]
pub struct Case {
    /// e1..e6.
    pub experiment: &'static str,
    /// The balancer's strategy.
    pub strategy: StrategyKind,
    /// Tie-break (least-connections).
    pub tie_break: TieBreak,
    /// The failed servers come first in the endpoint list (matters for lowest-index).
    pub failed_first: bool,
    /// Outlier ejection, retries with a budget, health checks.
    pub protections: Protection,
    /// How the failed servers fail, the same value for the backends and the simulated servers.
    pub failure: FailureMode,
    /// Servers in the cluster.
    pub servers: u32,
    /// Failed servers.
    pub failed: u32,
    /// Calls per request (k).
    pub calls: u32,
    /// The balancer runs in each client (one per worker) instead of in the proxy.
    pub client_side: bool,
    /// Requests in flight at once (workers).
    pub concurrency: usize,
    /// Requests measured.
    pub requests: u64,
    /// What a request does after a failed call: stop there (applications) or make all k calls
    /// (the model's client).
    pub client: Client,
}

/// The header a hash row's client sets, one value per request, and its proxy hashes.
pub const REQUEST_KEY: &str = "x-lab-key";

impl Case {
    fn new(
        experiment: &'static str,
        strategy: StrategyKind,
        failure: FailureMode,
        requests: u64,
    ) -> Self {
        Case {
            experiment,
            strategy,
            tie_break: TieBreak::Random,
            failed_first: false,
            protections: Protection::None,
            failure,
            servers: 5,
            failed: 1,
            calls: 3,
            client_side: false,
            concurrency: 24,
            requests,
            client: Client::StopsAtFirstFailure,
        }
    }

    /// Hash rows hash one key per request ([`REQUEST_KEY`]), so a request's calls go to one
    /// server, as a hash strategy is used.
    pub fn request_key(&self) -> bool {
        self.strategy.is_hash()
    }

    /// Failed share of servers.
    pub fn p(&self) -> f64 {
        self.failed as f64 / self.servers as f64
    }

    /// `none` or the protections in force.
    pub fn protections_name(&self) -> &'static str {
        match self.protections {
            Protection::None => "none",
            Protection::Lab => "outlier+retry+health",
            Protection::Defaults => "keel defaults",
        }
    }

    /// Retries per call under this case's protections: none after a 500, which is not in the
    /// default `retry_on_status` (it still counts as the endpoint's failure).
    pub fn retries(&self) -> u32 {
        match self.protections {
            Protection::None => 0,
            _ if !self.failure_retried() => 0,
            Protection::Lab => PROTECTIONS.retries,
            Protection::Defaults => DEFAULT_RETRIES,
        }
    }

    /// Whether the proxy retries a failed server's failure: every mode's but `server-error`'s
    /// 500, which the default `retry_on_status` (502, 503, 504) leaves out.
    pub fn failure_retried(&self) -> bool {
        !matches!(self.failure, FailureMode::ServerError { .. })
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} {} {} p={:.1} {}",
            self.experiment,
            self.strategy,
            self.failure,
            self.p(),
            self.protections_name()
        );
        if self.client == Client::AllCalls {
            s.push_str(&format!(" all-calls x{}", self.concurrency));
        }
        if self.client_side {
            s.push_str(&format!(
                " client-side tie-break={} failed={}",
                tie_name(self.tie_break),
                if self.failed_first { "first" } else { "last" }
            ));
        }
        s
    }

    /// Is server `i` (in endpoint order) one of the failed ones?
    pub fn is_failed(&self, i: u32) -> bool {
        if self.failed_first {
            i < self.failed
        } else {
            i >= self.servers - self.failed
        }
    }

    /// keel-balance configuration of the cluster.
    pub fn balancer(&self, seed: u64) -> BalancerConfig {
        let mut cfg = BalancerConfig::new(self.strategy);
        cfg.options.tie_break = self.tie_break;
        cfg.seed = seed;
        cfg.outlier_detection = match self.protections {
            Protection::None => None,
            Protection::Lab => Some(PROTECTIONS.outlier()),
            Protection::Defaults => Some(OutlierConfig::default()),
        };
        cfg
    }

    /// The proxy configuration for a server-side case: one listener on an ephemeral port, one
    /// cluster of `endpoints` with this case's balancer, timeout and protections.
    pub fn proxy_config(&self, t: &Timing, endpoints: &[SocketAddr], seed: u64) -> ProxyConfig {
        let specs = endpoints
            .iter()
            .map(|a| EndpointSpec::new(a.to_string()))
            .collect();
        let mut c = ClusterConfig::new("lab", specs).with_balancer(&self.balancer(seed));
        if self.request_key() {
            let on: HashOn = format!("header:{REQUEST_KEY}")
                .parse()
                .expect("a literal header name");
            c.balance.hash_on = Some(on);
        }
        c.timeouts.connect = Duration::from_millis(100);
        if self.protections == Protection::Defaults {
            // Every retry setting at its default; only the timeout is scaled.
            c.timeouts.request = t.timeout * (DEFAULT_RETRIES + 1);
        } else if self.protections == Protection::Lab {
            let p = &PROTECTIONS;
            // The whole request may use every try; each try has the case's timeout.
            c.timeouts.request = t.timeout * (p.retries + 1);
            let budget = p.budget();
            c.protections.retry = keel_proxy::config::RetryConfig {
                attempts: p.retries,
                per_try_timeout: Some(t.timeout),
                budget_percent: budget.budget_percent,
                min_retries_per_second: budget.min_retries_per_second,
                budget_window: budget.window,
                ..Default::default()
            };
            c.protections.health_check = Some(HealthCheckConfig {
                interval: p.health_interval,
                timeout: p.health_interval,
                unhealthy_threshold: p.health_threshold,
                healthy_threshold: p.health_threshold,
                ..HealthCheckConfig::default()
            });
        } else {
            c.timeouts.request = t.timeout;
            c.protections.retry.attempts = 0;
        }
        let listen = SocketAddr::from(([127, 0, 0, 1], 0));
        ProxyConfig::new(vec![ListenerConfig::new(listen, "lab")], vec![c])
    }

    /// The same case for the simulator.
    pub fn scenario(&self, t: &Timing, seed: u64) -> Scenario {
        let replications = 8;
        Scenario {
            name: self.experiment.to_string(),
            label: self.describe(),
            seed,
            replications,
            requests: self.requests.div_ceil(2).max(200),
            warmup: Duration::ZERO,
            timeout: t.timeout,
            round_trip: t.round_trip,
            abort_on_failure: self.client == Client::StopsAtFirstFailure,
            call_gap: Duration::ZERO,
            placement: if self.client_side {
                Placement::ClientSide
            } else {
                Placement::ServerSide
            },
            load: Load::Closed {
                clients: self.concurrency as u32,
                in_flight: 1,
                think_time: Duration::ZERO,
            },
            retry: match self.protections {
                Protection::None => None,
                _ if !self.failure_retried() => None,
                Protection::Lab => Some(RetryConfig {
                    max_retries: PROTECTIONS.retries,
                    budget: PROTECTIONS.budget(),
                }),
                Protection::Defaults => Some(RetryConfig {
                    max_retries: DEFAULT_RETRIES,
                    budget: RetryBudgetConfig::default(),
                }),
            },
            health_check: (self.protections == Protection::Lab).then_some(sim::HealthCheckConfig {
                interval: PROTECTIONS.health_interval,
                unhealthy_threshold: PROTECTIONS.health_threshold,
                healthy_threshold: PROTECTIONS.health_threshold,
            }),
            clusters: vec![sim::ClusterConfig {
                name: "b".into(),
                calls: self.calls,
                servers: self.servers,
                failed: self.failed,
                failed_position: if self.failed_first {
                    FailedPosition::First
                } else {
                    FailedPosition::Last
                },
                latency: t.latency(),
                failure: self.failure,
                balancer: self.balancer(seed),
                hash_key_per_request: self.request_key(),
                ..sim::ClusterConfig::default()
            }],
            ..Scenario::default()
        }
    }
}

pub(crate) fn tie_name(t: TieBreak) -> &'static str {
    match t {
        TieBreak::Random => "random",
        TieBreak::LowestIndex => "lowest-index",
    }
}

/// The experiments of this file, in `--experiments`' spelling.
pub const NAMES: [&str; 7] = ["e1", "e2", "e3", "e4", "e5", "e6", "e6b"];

/// The cases of the selected experiments (names of other experiments are ignored here).
pub fn plan(opts: &LabOptions) -> Vec<Case> {
    use StrategyKind::*;
    let quick = opts.quick;
    let known = NAMES;
    let default: &[&str] = if quick {
        &["e1", "e2", "e6", "e6b"]
    } else {
        &known
    };
    let selected = |e: &str| {
        if opts.experiments.is_empty() {
            default.contains(&e)
        } else {
            opts.experiments.iter().any(|x| x == e)
        }
    };
    let n = |full: u64, fast: u64| if quick { fast } else { full };
    let mut cases = Vec::new();
    if selected("e1") {
        for s in [RoundRobin, Random] {
            for failure in [FailureMode::FAIL_AT_ONCE, FailureMode::SERVER_ERROR_AT_ONCE] {
                cases.push(Case::new("e1", s, failure, n(5000, 3000)));
            }
        }
        // The model's client, which makes all k calls: round-robin's rotation sends the call
        // after a fast failure to the next, healthy server, which an application's client
        // (stopping at the failure) never shows; random's picks do not depend on the last one.
        for s in [RoundRobin, Random] {
            let mut c = Case::new("e1", s, FailureMode::FAIL_AT_ONCE, n(5000, 3000));
            c.client = Client::AllCalls;
            cases.push(c);
        }
        // The same with two clients: the rotation stays in step, a request's calls land on 3
        // distinct servers, and its closed form is 1 - k p = 0.400, not (1 - p)^k = 0.512.
        let mut c = Case::new("e1", RoundRobin, FailureMode::FAIL_AT_ONCE, n(2000, 1000));
        c.client = Client::AllCalls;
        c.concurrency = crate::lab::rotation::IN_STEP_CLIENTS;
        cases.push(c);
        // A hash strategy with one key per request: a request's calls land on one server, so
        // it fails exactly when its key is on the failed server's part of the ring.
        cases.push(Case::new(
            "e1",
            RingHash,
            FailureMode::FAIL_AT_ONCE,
            n(3000, 1500),
        ));
    }
    if selected("e2") {
        cases.push(Case::new(
            "e2",
            LeastConnections,
            FailureMode::Hang,
            n(4000, 1500),
        ));
    }
    if selected("e3") {
        for s in [RoundRobin, LeastConnections] {
            for failed in 0..=4 {
                let mut c = Case::new(
                    "e3",
                    s,
                    FailureMode::Hang,
                    if failed == 0 {
                        n(1000, 300)
                    } else {
                        n(500, 200)
                    },
                );
                c.failed = failed;
                // Round-robin's success does not depend on concurrency, and its hanging calls
                // dominate the run time: more workers keep the run short.
                if s == RoundRobin {
                    c.concurrency = 96;
                }
                cases.push(c);
            }
        }
    }
    if selected("e4") {
        for s in [RoundRobin, LeastConnections, LeastTime, PeakEwma] {
            for failure in [FailureMode::FAIL_AT_ONCE, FailureMode::SERVER_ERROR_AT_ONCE] {
                cases.push(Case::new("e4", s, failure, n(3000, 1000)));
            }
        }
    }
    if selected("e5") {
        for failure in [FailureMode::Hang, FailureMode::FAIL_AT_ONCE] {
            for (tie, first) in [
                (TieBreak::Random, false),
                (TieBreak::LowestIndex, true),
                (TieBreak::LowestIndex, false),
            ] {
                let mut c = Case::new("e5", LeastConnections, failure, n(320, 160));
                c.client_side = true;
                c.concurrency = 32;
                c.tie_break = tie;
                c.failed_first = first;
                cases.push(c);
            }
        }
    }
    if selected("e6") {
        for s in [RoundRobin, LeastConnections, PeakEwma] {
            for failure in [
                FailureMode::Hang,
                FailureMode::FAIL_AT_ONCE,
                FailureMode::SERVER_ERROR_AT_ONCE,
                FailureMode::Refuse,
                FailureMode::Reset,
            ] {
                let mut c = Case::new("e6", s, failure, n(2000, 1000));
                c.protections = Protection::Lab;
                cases.push(c);
            }
        }
    }
    if selected("e6b") {
        // What a user writes first: one dead endpoint of three, nothing configured.
        for s in [RoundRobin, LeastConnections] {
            for failure in [FailureMode::FAIL_AT_ONCE, FailureMode::Refuse] {
                let mut c = Case::new("e6b", s, failure, n(2000, 1000));
                c.protections = Protection::Defaults;
                c.servers = 3;
                cases.push(c);
            }
        }
        // The source's cluster with keel's defaults, one endpoint answering 500 at once: a
        // status no default retries, so only counting it as the endpoint's failure (outlier
        // detection, the latency estimates) keeps the calls after it off that endpoint.
        for s in [
            RoundRobin,
            Random,
            LeastConnections,
            LeastRequest,
            LeastTime,
            PeakEwma,
            RingHash,
            Maglev,
            Rendezvous,
        ] {
            let mut c = Case::new("e6b", s, FailureMode::SERVER_ERROR_AT_ONCE, n(3000, 2000));
            c.protections = Protection::Defaults;
            cases.push(c);
        }
    }
    if !opts.strategies.is_empty() {
        cases.retain(|c| opts.strategies.contains(&c.strategy));
    }
    cases
}
