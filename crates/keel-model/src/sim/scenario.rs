//! What a simulation runs: load, clusters of servers with their failure modes, balancers and
//! protections. Every type deserializes from TOML (see `scenarios/*.toml` for documented
//! examples) with defaults and `deny_unknown_fields`; durations are humantime strings ("10ms").

use std::fmt;
use std::time::Duration;

use keel_balance::{
    BalancerConfig, FieldPath, InvalidField, Problem, RetryBudgetConfig, StrategyKind,
};
use serde::{Deserialize, Serialize};

use crate::vocab::{FailureMode, Latency};

/// A scenario that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// Out of range or unparsable input; the message names the key.
    #[error("{0}")]
    Invalid(String),
}

/// One simulated setup: the unit that produces one row of results.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Name shown as `experiment` in reports.
    #[serde(default = "default_name")]
    pub name: String,
    /// What distinguishes this row from its siblings (shown as `label`).
    #[serde(default)]
    pub label: String,
    /// Seed of everything random: latencies, arrivals, and every balancer's own seed.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Independent replications (run in parallel); the confidence interval is over them.
    #[serde(default = "default_replications")]
    pub replications: u32,
    /// Measured requests per replication.
    pub requests: u64,
    /// Virtual time before requests count (lets in-flight counts and estimates settle).
    #[serde(default, with = "humantime_serde")]
    pub warmup: Duration,
    /// The caller's timeout for one attempt of one call.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Time the network adds to every try, whatever the server does (a hanging server still
    /// costs exactly the timeout). Default 0, the model's idealisation; the lab sets the
    /// loopback round trip through its proxy, so that an error "at once" takes the time it
    /// takes on real sockets. Servers with a `capacity` do not take it yet.
    #[serde(default, with = "humantime_serde")]
    pub round_trip: Duration,
    /// A request stops at its first failed call (the caller returns the error).
    #[serde(default = "default_true")]
    pub abort_on_failure: bool,
    /// The caller's own work between two calls of a request: exponential with this mean;
    /// `0s` (the default) makes the next call start the instant the previous one ends.
    #[serde(default, with = "humantime_serde")]
    pub call_gap: Duration,
    /// Where the balancers live.
    #[serde(default)]
    pub placement: Placement,
    /// How requests arrive.
    pub load: Load,
    /// Retries to another endpoint, bounded by a budget; off unless given.
    #[serde(default)]
    pub retry: Option<RetryConfig>,
    /// Active health checks; off unless given.
    #[serde(default)]
    pub health_check: Option<HealthCheckConfig>,
    /// Hedged requests: a second try of a slow call to another endpoint; off unless given.
    #[serde(default)]
    pub hedge: Option<HedgeConfig>,
    /// How servers' load reports reach balancers that balance on them (prequal). Absent: probes
    /// answered after 1 ms, no reports on answers.
    #[serde(default)]
    pub load_reports: Option<LoadReportsConfig>,
    /// The call graph: every request calls these clusters in order, each `calls` times.
    pub clusters: Vec<ClusterConfig>,
}

impl Default for Scenario {
    /// One closed-loop client, 1000 measured requests, one default cluster; no protections.
    fn default() -> Self {
        Self {
            name: default_name(),
            label: String::new(),
            seed: default_seed(),
            replications: default_replications(),
            requests: 1000,
            warmup: Duration::ZERO,
            timeout: default_timeout(),
            round_trip: Duration::ZERO,
            abort_on_failure: true,
            call_gap: Duration::ZERO,
            placement: Placement::ServerSide,
            load: Load::Closed {
                clients: 1,
                in_flight: 1,
                think_time: Duration::ZERO,
            },
            retry: None,
            health_check: None,
            hedge: None,
            load_reports: None,
            clusters: vec![ClusterConfig::default()],
        }
    }
}

fn default_name() -> String {
    "scenario".into()
}
fn default_seed() -> u64 {
    1
}
fn default_replications() -> u32 {
    4
}
fn default_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_true() -> bool {
    true
}
fn default_one() -> u32 {
    1
}

/// Where the balancers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// One balancer per cluster, shared by every client (a proxy in front of the cluster).
    #[default]
    ServerSide,
    /// Every client has its own balancer per cluster and sees only its own calls.
    ClientSide,
    /// One balancer per cluster at L4 (kube-proxy, a TCP load balancer): each client opens one
    /// long-lived connection per cluster, picked once when the run starts and held to its end
    /// (least-connections counts connections), and sends every call over it. The balancer sees
    /// no call's outcome, and a call cannot be retried elsewhere (no `retry`, no `hedge`).
    PerConnection,
}

/// How requests arrive.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Load {
    /// `clients` clients, each keeping `in_flight` requests going back to back (with an
    /// optional think time between them).
    Closed {
        /// Number of clients.
        clients: u32,
        /// Requests each client keeps in flight.
        #[serde(default = "default_one")]
        in_flight: u32,
        /// Pause between a client's request and its next.
        #[serde(default, with = "humantime_serde")]
        think_time: Duration,
    },
    /// Poisson arrivals at `rate` requests per second, each from a client drawn at random among
    /// `clients` (so each client sends a Poisson stream of its own; this matters only
    /// client-side, where each client has its own balancers).
    Open {
        /// Requests per second of virtual time.
        rate: f64,
        /// Clients the arrivals are spread over.
        #[serde(default = "default_one")]
        clients: u32,
    },
}

impl Load {
    /// Number of clients (balancer owners when client-side).
    pub fn clients(&self) -> u32 {
        match self {
            Load::Closed { clients, .. } | Load::Open { clients, .. } => *clients,
        }
    }
}

/// Retries of a failed call on another endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Retries per call at most (each to an endpoint this call has not tried yet, while one is
    /// left). Default 2, at most 7.
    #[serde(default = "default_retries")]
    pub max_retries: u32,
    /// The budget that caps retries as a share of calls (one budget per balancer).
    #[serde(default)]
    pub budget: RetryBudgetConfig,
}

fn default_retries() -> u32 {
    2
}

/// Active health checks: every `interval`, each balancer probes each server of a cluster.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// Time between probes. Default 1 s.
    #[serde(default = "default_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Failed probes in a row that mark a server unhealthy. Default 2.
    #[serde(default = "default_two")]
    pub unhealthy_threshold: u32,
    /// Passed probes in a row that mark it healthy again. Default 2.
    #[serde(default = "default_two")]
    pub healthy_threshold: u32,
}

fn default_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_two() -> u32 {
    2
}

/// One cluster of identical servers, some of which have failed.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Name, for reports.
    #[serde(default)]
    pub name: String,
    /// Calls a request makes to this cluster, one after the other.
    #[serde(default = "default_one")]
    pub calls: u32,
    /// Servers in the cluster.
    pub servers: u32,
    /// How many of them have failed (they behave as `failure` says).
    #[serde(default)]
    pub failed: u32,
    /// Which servers are the failed ones, in configuration order.
    #[serde(default)]
    pub failed_position: FailedPosition,
    /// Healthy service time.
    #[serde(default)]
    pub latency: Latency,
    /// How the failed servers fail.
    #[serde(default)]
    pub failure: FailureMode,
    /// The balancer in front of the cluster (keel-balance's own configuration).
    #[serde(default)]
    pub balancer: BalancerConfig,
    /// How much work each server does at once; absent, unlimited (a call's time never depends
    /// on load).
    #[serde(default)]
    pub capacity: Option<CapacityConfig>,
    /// Servers slowed by other tenants' work, a new random set each period; off unless given.
    #[serde(default)]
    pub antagonist: Option<AntagonistConfig>,
    /// One step of slowness on the first servers, from `start` to `end`; off unless given.
    #[serde(default)]
    pub slowdown: Option<SlowdownConfig>,
    /// The servers described one by one (as `keel advise` fits them from an access log):
    /// empty, every server is the cluster's `latency` and `capacity`, `failed` of them failing
    /// as `failure` says; given, exactly `servers` entries, each overriding the cluster's
    /// values for its server, and `failed` must be 0 (each entry says how it fails).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointConfig>,
    /// The clients' balancers of this cluster as a fleet of proxies (client-side placement and
    /// an open load only): how arrivals reach them and whether they share what they observe.
    /// Absent: arrivals go to clients at random, each balancer judges on its own calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<FleetConfig>,
    /// A hash strategy hashes one key per request (a header the client sets once for all its
    /// calls), so a request's calls go to one server; false: a new key every call, as a
    /// proxy with no `hash_on` has it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hash_key_per_request: bool,
}

/// A fleet of proxies in front of one cluster: each client is a proxy with its own balancer.
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// How arrivals are dealt to the proxies. Default `random`.
    #[serde(default)]
    pub arrivals: Arrivals,
    /// Outcomes every proxy publishes and every other proxy's balancer counts
    /// (keel-balance's `Balancer::record_remote`); absent, each judges alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedEvidenceConfig>,
}

/// How open-loop arrivals are dealt to the clients (proxies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arrivals {
    /// Each arrival to a client drawn at random: every client gets a Poisson stream.
    #[default]
    Random,
    /// Arrivals to the clients one after another, in turn (a round-robin DNS or an L4 balancer
    /// in front of the fleet).
    InTurn,
}

/// Evidence shared by the fleet: every outcome a proxy observes on this cluster reaches every
/// other proxy's balancer `delay` later.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SharedEvidenceConfig {
    /// From an outcome at one proxy to the others' balancers (publish, store, watch).
    #[serde(with = "humantime_serde")]
    pub delay: Duration,
    /// Distinct proxies whose failures an ejection needs (keel-balance's `SharedEvidence`).
    /// Default 1.
    #[serde(default = "default_one")]
    pub quorum: u32,
}

/// One server of a cluster with its own latency, capacity, weight and failures.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// Name, for reports (e.g. the address in the access log it was fitted from).
    #[serde(default)]
    pub name: String,
    /// The balancer's weight of this endpoint (strategies that use weights). Default 1.
    #[serde(default = "default_one")]
    pub weight: u32,
    /// Its healthy service time; absent, the cluster's `latency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
    /// Its capacity; absent, the cluster's `capacity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityConfig>,
    /// How its calls fail: each call fails in the first mode whose share a uniform draw falls
    /// in, and is answered like a healthy server's otherwise (shares add up to at most 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<FailureShare>,
}

/// A share of an endpoint's calls that fail in one mode.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FailureShare {
    /// Share of calls, in `[0, 1]`.
    pub share: f64,
    /// How those calls fail: `hang`, `fail-fast`, `refuse`, `reset`, `slow` or `error`.
    pub failure: FailureMode,
}

/// Most failure modes one endpoint mixes.
pub const MAX_FAILURE_MIX: usize = 4;

impl Default for ClusterConfig {
    /// One healthy server of unlimited capacity behind round-robin, called once.
    fn default() -> Self {
        Self {
            name: String::new(),
            calls: 1,
            servers: 1,
            failed: 0,
            failed_position: FailedPosition::Last,
            latency: Latency::default(),
            failure: FailureMode::None,
            balancer: BalancerConfig::default(),
            capacity: None,
            antagonist: None,
            slowdown: None,
            endpoints: Vec::new(),
            fleet: None,
            hash_key_per_request: false,
        }
    }
}

/// A server's capacity: at most `concurrency` calls in service, the rest waiting in FIFO order
/// (`discipline = "fifo"`), or every call present sharing `concurrency` units of service
/// (`discipline = "ps"`, processor sharing).
///
/// A call whose caller has gone (timed out, or a hedge that lost) is dropped if it is still
/// waiting; work the server has started runs to its end (the server cannot tell that nobody
/// waits for the answer). Under processor sharing every call present is in service.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityConfig {
    /// Calls in service at once (FIFO), or units of service shared (PS). At least 1.
    pub concurrency: u32,
    /// The queueing discipline. Default FIFO.
    #[serde(default)]
    pub discipline: Discipline,
}

/// How a server with a capacity orders its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Discipline {
    /// First in, first out: up to `concurrency` calls in service, the others wait.
    #[default]
    Fifo,
    /// Processor sharing: n calls present each progress at min(1, concurrency / n) of full
    /// speed.
    Ps,
}

/// Antagonists: every `period`, `servers` servers drawn at random (a new draw each period) do
/// their work `factor` times slower, as when other tenants' jobs share their machines.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AntagonistConfig {
    /// Servers slowed at any time.
    pub servers: u32,
    /// Slow-down factor (>= 1).
    pub factor: f64,
    /// Time between two draws.
    #[serde(with = "humantime_serde")]
    pub period: Duration,
}

/// A step of slowness (experiment E9): the first `servers` servers work `factor` times slower
/// from `start` to `end` of virtual time.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlowdownConfig {
    /// How many servers (the first ones in the list). Default 1.
    #[serde(default = "default_one")]
    pub servers: u32,
    /// Slow-down factor (>= 1).
    pub factor: f64,
    /// When the step up happens.
    #[serde(with = "humantime_serde")]
    pub start: Duration,
    /// When the servers are back to normal speed.
    #[serde(with = "humantime_serde")]
    pub end: Duration,
}

/// Hedged requests: keel-balance's policy, the same `[hedge]` table as the proxy's
/// `[cluster.hedge]`.
pub use keel_balance::{HedgeConfig, HedgeDelay};

/// Servers' load reports (requests in flight and their latency estimate, keel-balance's
/// `ServerLoad`) for balancers that balance on them (prequal). A probe reads the server's state
/// when it is sent and reaches the balancer `probe_delay` later (so its age on arrival is the
/// whole round trip); with `on_answers`, every answer also carries the server's report (as
/// `x-keel-rif` headers do), with no delay.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadReportsConfig {
    /// Probe round trip. Default 1 ms.
    #[serde(default = "default_probe_delay", with = "humantime_serde")]
    pub probe_delay: Duration,
    /// Answers carry the server's report too. Default false (probes only, as in the paper).
    #[serde(default)]
    pub on_answers: bool,
}

impl Default for LoadReportsConfig {
    fn default() -> Self {
        Self {
            probe_delay: default_probe_delay(),
            on_answers: false,
        }
    }
}

fn default_probe_delay() -> Duration {
    Duration::from_millis(1)
}

/// Where in the endpoint list the failed servers sit (it matters for lowest-index tie-breaks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailedPosition {
    /// The last `failed` servers.
    #[default]
    Last,
    /// The first `failed` servers.
    First,
}

/// Most stages (calls per request over all clusters) and servers a scenario may have; keeps
/// indices in compact event and slot fields.
pub const MAX_STAGES: u32 = 1024;
/// Most servers per cluster.
pub const MAX_SERVERS: u32 = 4096;
/// Most retries per call.
pub const MAX_RETRIES: u32 = 7;
/// Most calls a server serves at once.
pub const MAX_CONCURRENCY: u32 = 1 << 20;

/// A scenario that is refused: where (the scenario itself or one of its clusters) and what is
/// wrong. The edge (the CLI, [`Scenario::from_toml_str`]) turns it into text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}{problem}", .cluster.as_ref().map(|c| format!("{c}: ")).unwrap_or_default())]
pub struct ScenarioError {
    /// The cluster the key is in; `None` for the scenario's own keys.
    pub cluster: Option<ClusterRef>,
    /// What is wrong.
    pub problem: ScenarioProblem,
}

/// One of a scenario's clusters, as messages name it: by name, or by index when unnamed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterRef {
    /// Its index in `clusters`.
    pub index: usize,
    /// Its name (`""`: none).
    pub name: String,
}

impl fmt::Display for ClusterRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.name.is_empty() {
            write!(f, "clusters[{}]", self.index)
        } else {
            write!(f, "cluster `{}`", self.name)
        }
    }
}

/// What is wrong with a scenario.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScenarioProblem {
    /// A key's value (its path relative to the scenario or the cluster), e.g. `servers must be
    /// within 1..=4096, got 0`.
    #[error("{}", field_text(.0))]
    Field(InvalidField),
    /// The cluster's balancer configuration is refused.
    #[error("balancer: {0}")]
    Balancer(#[source] InvalidField),
    /// The retry budget is refused.
    #[error("retry.budget: {0}")]
    RetryBudget(#[source] InvalidField),
    /// A product of keys is over its limit (`what` names the keys).
    #[error("{what} must be at most {max}")]
    TooMany {
        /// The keys multiplied, e.g. `load.clients x load.in_flight`.
        what: &'static str,
        /// The limit.
        max: u64,
    },
    /// A request makes more calls over all clusters than [`MAX_STAGES`].
    #[error("a request makes {calls} calls in all; at most {max}")]
    TooManyStages {
        /// Calls per request over all clusters.
        calls: u32,
        /// The limit.
        max: u32,
    },
    /// Settings that do not go together, or one that needs another, in words.
    #[error("{0}")]
    Conflict(String),
}

/// `{field} {problem}` (`{field}: {why}` for a problem in words).
fn field_text(e: &InvalidField) -> String {
    match &e.problem {
        Problem::Invalid(why) => format!("{}: {why}", e.field),
        p => format!("{} {p}", e.field),
    }
}

/// [`ScenarioProblem::Field`] of `field`.
fn refuse(field: FieldPath, problem: Problem) -> ScenarioProblem {
    ScenarioProblem::Field(InvalidField { field, problem })
}

/// `a.b.c` as a path.
fn path(keys: &[&'static str]) -> FieldPath {
    keys.iter().fold(FieldPath::root(), |p, k| p.then(k))
}

/// A nested value's own [`InvalidField`] under `prefix`.
fn nested(prefix: FieldPath, e: InvalidField) -> ScenarioProblem {
    refuse(e.field.under(prefix), e.problem)
}

/// Checks a cluster's `endpoints`: one per server, each in range.
fn validate_endpoints(c: &ClusterConfig, round_trip: bool) -> Result<(), ScenarioProblem> {
    if c.endpoints.is_empty() {
        return Ok(());
    }
    if c.endpoints.len() != c.servers as usize {
        return Err(ScenarioProblem::Conflict(format!(
            "endpoints has {} entries for {} servers; give one per server",
            c.endpoints.len(),
            c.servers
        )));
    }
    if c.failed != 0 {
        return Err(ScenarioProblem::Conflict(
            "failed must be 0 when endpoints are given (each says how it fails in `failures`)"
                .into(),
        ));
    }
    for (i, e) in c.endpoints.iter().enumerate() {
        let at = FieldPath::key("endpoints").at(i);
        if e.weight == 0 {
            return Err(refuse(
                at.then("weight"),
                Problem::out_of_range("at least 1", 0),
            ));
        }
        if let Some(l) = &e.latency {
            if l.mean.is_zero() {
                return Err(refuse(
                    at.then("latency").then("mean"),
                    Problem::out_of_range("greater than zero", "0s"),
                ));
            }
            l.validate()
                .map_err(|m| nested(at.clone().then("latency"), m))?;
        }
        if let Some(cap) = &e.capacity {
            if round_trip {
                return Err(ScenarioProblem::Conflict(format!(
                    "{at}: round_trip is not modelled for servers with a capacity; set it to 0s"
                )));
            }
            if cap.concurrency == 0 || cap.concurrency > MAX_CONCURRENCY {
                return Err(refuse(
                    at.then("capacity").then("concurrency"),
                    Problem::out_of_range(format!("within 1..={MAX_CONCURRENCY}"), cap.concurrency),
                ));
            }
        }
        if e.failures.len() > MAX_FAILURE_MIX {
            return Err(refuse(
                at.then("failures"),
                Problem::out_of_range(format!("at most {MAX_FAILURE_MIX} modes"), e.failures.len()),
            ));
        }
        let mut total = 0.0;
        for (j, f) in e.failures.iter().enumerate() {
            let at = at.clone().then("failures").at(j);
            if !(0.0..=1.0).contains(&f.share) {
                return Err(refuse(
                    at.then("share"),
                    Problem::out_of_range("within 0..=1", f.share),
                ));
            }
            total += f.share;
            if matches!(f.failure, FailureMode::None | FailureMode::Flap { .. }) {
                return Err(refuse(
                    at.then("failure"),
                    Problem::Invalid(format!(
                        "`{}` cannot be a share of calls (use hang, fail-fast, refuse, reset, slow or error)",
                        f.failure.name()
                    )),
                ));
            }
            f.failure
                .validate()
                .map_err(|m| nested(at.then("failure"), m))?;
        }
        if total > 1.0 + 1e-9 {
            return Err(refuse(
                at.then("failures"),
                Problem::Invalid(format!("shares add up to {total}, more than 1")),
            ));
        }
    }
    Ok(())
}

impl Scenario {
    /// Parses a scenario from TOML; `origin` (a file name) prefixes error messages.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Scenario, SimError> {
        let sc: Scenario =
            toml::from_str(text).map_err(|e| SimError::Invalid(format!("{origin}: {e}")))?;
        sc.validate()
            .map_err(|e| SimError::Invalid(format!("{origin}: {e}")))?;
        Ok(sc)
    }

    /// Checks every range; the error names the key (and the cluster it is in).
    pub fn validate(&self) -> Result<(), ScenarioError> {
        self.validate_own().map_err(|problem| ScenarioError {
            cluster: None,
            problem,
        })?;
        let mut stages = 0u32;
        for (index, c) in self.clusters.iter().enumerate() {
            stages = stages.saturating_add(c.calls);
            self.validate_cluster(c).map_err(|problem| ScenarioError {
                cluster: Some(ClusterRef {
                    index,
                    name: c.name.clone(),
                }),
                problem,
            })?;
        }
        if stages > MAX_STAGES {
            return Err(ScenarioError {
                cluster: None,
                problem: ScenarioProblem::TooManyStages {
                    calls: stages,
                    max: MAX_STAGES,
                },
            });
        }
        Ok(())
    }

    /// The scenario's own keys (not its clusters').
    fn validate_own(&self) -> Result<(), ScenarioProblem> {
        if self.requests == 0 {
            return Err(refuse(
                FieldPath::key("requests"),
                Problem::out_of_range("at least 1", 0),
            ));
        }
        if self.replications == 0 || self.replications > 10_000 {
            return Err(refuse(
                FieldPath::key("replications"),
                Problem::out_of_range("within 1..=10000", self.replications),
            ));
        }
        if self.timeout.is_zero() {
            return Err(refuse(
                FieldPath::key("timeout"),
                Problem::out_of_range("greater than zero", "0s"),
            ));
        }
        match &self.load {
            Load::Closed {
                clients, in_flight, ..
            } => {
                for (key, n) in [("clients", clients), ("in_flight", in_flight)] {
                    if *n == 0 {
                        return Err(refuse(
                            path(&["load", key]),
                            Problem::out_of_range("at least 1", 0),
                        ));
                    }
                }
                if u64::from(*clients) * u64::from(*in_flight) > 10_000_000 {
                    return Err(ScenarioProblem::TooMany {
                        what: "load.clients x load.in_flight",
                        max: 10_000_000,
                    });
                }
            }
            Load::Open { rate, clients } => {
                if !(rate.is_finite() && *rate > 0.0) {
                    return Err(refuse(
                        path(&["load", "rate"]),
                        Problem::out_of_range("a positive number", rate),
                    ));
                }
                if *clients == 0 {
                    return Err(refuse(
                        path(&["load", "clients"]),
                        Problem::out_of_range("at least 1", 0),
                    ));
                }
            }
        }
        let balancers = match self.placement {
            Placement::ServerSide | Placement::PerConnection => 1,
            Placement::ClientSide => u64::from(self.load.clients()),
        };
        if self.placement == Placement::PerConnection
            && (self.retry.is_some() || self.hedge.is_some())
        {
            return Err(ScenarioProblem::Conflict(
                "placement = \"per-connection\": a call cannot move off its connection, so no \
                 retry and no hedge"
                    .into(),
            ));
        }
        if balancers * self.clusters.len() as u64 > 1_000_000 {
            return Err(ScenarioProblem::TooMany {
                what: "client-side: clients x clusters",
                max: 1_000_000,
            });
        }
        if let Some(r) = &self.retry {
            if r.max_retries > MAX_RETRIES {
                return Err(refuse(
                    path(&["retry", "max_retries"]),
                    Problem::out_of_range(format!("at most {MAX_RETRIES}"), r.max_retries),
                ));
            }
            r.budget.validate().map_err(ScenarioProblem::RetryBudget)?;
        }
        if let Some(h) = &self.health_check {
            if h.interval.is_zero() {
                return Err(refuse(
                    path(&["health_check", "interval"]),
                    Problem::out_of_range("greater than zero", "0s"),
                ));
            }
            for (key, n) in [
                ("unhealthy_threshold", h.unhealthy_threshold),
                ("healthy_threshold", h.healthy_threshold),
            ] {
                if n == 0 {
                    return Err(refuse(
                        path(&["health_check", key]),
                        Problem::out_of_range("at least 1", 0),
                    ));
                }
            }
        }
        if let Some(e) = self.hedge.as_ref().and_then(|h| h.validate().err()) {
            return Err(nested(FieldPath::key("hedge"), e));
        }
        if self.clusters.is_empty() {
            return Err(ScenarioProblem::Conflict(
                "at least one [[clusters]] entry is needed".into(),
            ));
        }
        Ok(())
    }

    /// One cluster's keys; paths are relative to the cluster.
    fn validate_cluster(&self, c: &ClusterConfig) -> Result<(), ScenarioProblem> {
        if c.servers == 0 || c.servers > MAX_SERVERS {
            return Err(refuse(
                FieldPath::key("servers"),
                Problem::out_of_range(format!("within 1..={MAX_SERVERS}"), c.servers),
            ));
        }
        if c.failed > c.servers {
            return Err(refuse(
                FieldPath::key("failed"),
                Problem::out_of_range(format!("at most servers ({})", c.servers), c.failed),
            ));
        }
        if c.calls == 0 {
            return Err(refuse(
                FieldPath::key("calls"),
                Problem::out_of_range("at least 1", 0),
            ));
        }
        if let Some(f) = &c.fleet {
            if self.placement != Placement::ClientSide || !matches!(self.load, Load::Open { .. }) {
                return Err(ScenarioProblem::Conflict(
                    "fleet needs placement = \"client-side\" and an open load (each client is a proxy)"
                        .into(),
                ));
            }
            if self.clusters.iter().filter(|c| c.fleet.is_some()).count() > 1 {
                return Err(ScenarioProblem::Conflict(
                    "fleet may be given for one cluster only".into(),
                ));
            }
            if let Some(sh) = &f.shared {
                if !(1..=keel_balance::MAX_QUORUM).contains(&sh.quorum) {
                    return Err(refuse(
                        path(&["fleet", "shared", "quorum"]),
                        Problem::out_of_range(
                            format!("within 1..={}", keel_balance::MAX_QUORUM),
                            sh.quorum,
                        ),
                    ));
                }
                if c.balancer.outlier_detection.is_none() {
                    return Err(ScenarioProblem::Conflict(
                        "fleet.shared needs balancer.outlier_detection (the evidence feeds it)"
                            .into(),
                    ));
                }
            }
        }
        if c.latency.mean.is_zero() {
            return Err(refuse(
                path(&["latency", "mean"]),
                Problem::out_of_range("greater than zero", "0s"),
            ));
        }
        c.latency
            .validate()
            .map_err(|e| nested(FieldPath::key("latency"), e))?;
        c.failure
            .validate()
            .map_err(|e| nested(FieldPath::key("failure"), e))?;
        if let Some(cap) = &c.capacity {
            if !self.round_trip.is_zero() {
                return Err(ScenarioProblem::Conflict(
                    "round_trip is not modelled for servers with a capacity; set it to 0s".into(),
                ));
            }
            if cap.concurrency == 0 || cap.concurrency > MAX_CONCURRENCY {
                return Err(refuse(
                    path(&["capacity", "concurrency"]),
                    Problem::out_of_range(format!("within 1..={MAX_CONCURRENCY}"), cap.concurrency),
                ));
            }
        }
        if let Some(a) = &c.antagonist {
            if a.servers > c.servers {
                return Err(refuse(
                    path(&["antagonist", "servers"]),
                    Problem::out_of_range(format!("at most servers ({})", c.servers), a.servers),
                ));
            }
            if !(a.factor.is_finite() && a.factor >= 1.0) {
                return Err(refuse(
                    path(&["antagonist", "factor"]),
                    Problem::out_of_range("1 or more", a.factor),
                ));
            }
            if a.period.is_zero() {
                return Err(refuse(
                    path(&["antagonist", "period"]),
                    Problem::out_of_range("greater than zero", "0s"),
                ));
            }
        }
        if let Some(sd) = &c.slowdown {
            if sd.servers == 0 || sd.servers > c.servers {
                return Err(refuse(
                    path(&["slowdown", "servers"]),
                    Problem::out_of_range(format!("within 1..={}", c.servers), sd.servers),
                ));
            }
            if !(sd.factor.is_finite() && sd.factor >= 1.0) {
                return Err(refuse(
                    path(&["slowdown", "factor"]),
                    Problem::out_of_range("1 or more", sd.factor),
                ));
            }
            if sd.end <= sd.start {
                return Err(refuse(
                    path(&["slowdown", "end"]),
                    Problem::out_of_range(
                        "after slowdown.start",
                        humantime::format_duration(sd.end),
                    ),
                ));
            }
        }
        c.balancer.validate().map_err(ScenarioProblem::Balancer)?;
        validate_endpoints(c, !self.round_trip.is_zero())
    }

    /// The cluster the report is about: the first with failed servers, else the first.
    pub fn focus(&self) -> usize {
        self.clusters
            .iter()
            .position(|c| c.failed > 0 && c.failure != FailureMode::None)
            .unwrap_or(0)
    }

    /// The protections in force, as a short label: `none`, or e.g. `outlier+retry`.
    pub fn protections(&self) -> String {
        let mut p = Vec::new();
        if self
            .clusters
            .iter()
            .any(|c| c.balancer.outlier_detection.is_some())
        {
            p.push("outlier");
        }
        if self.health_check.is_some() {
            p.push("health-check");
        }
        if self.retry.is_some() {
            p.push("retry");
        }
        if self.hedge.is_some() {
            p.push("hedge");
        }
        if p.is_empty() {
            "none".into()
        } else {
            p.join("+")
        }
    }

    /// q = t_fail / t_ok of a cluster when its failure mode fixes t_fail (hang, fail-fast,
    /// refuse, reset; see [`FailureMode::failure_time`]), with the round trip added to both
    /// times as the simulation adds it.
    pub fn q(&self, cluster: &ClusterConfig) -> Option<f64> {
        let t_fail = cluster
            .failure
            .failure_time(self.timeout, cluster.latency.mean)?;
        let t_fail = (t_fail + self.round_trip).min(self.timeout);
        let t_ok = cluster.latency.mean + self.round_trip;
        Some(t_fail.as_secs_f64() / t_ok.as_secs_f64())
    }

    /// The closed form's success for this scenario, when the model covers it: no protections,
    /// and every cluster either without failures or failing in a mode that fixes q (see
    /// [`Scenario::q`]) under a strategy with a closed form.
    pub fn analytic_success(&self) -> Option<f64> {
        if self.protections() != "none" {
            return None;
        }
        let mut total = 1.0;
        for c in &self.clusters {
            if c.failed == 0 || c.failure == FailureMode::None {
                continue;
            }
            let q = self.q(c)?;
            let p = f64::from(c.failed) / f64::from(c.servers);
            total *= crate::analytic::success(c.balancer.strategy, p, q, c.calls)?;
        }
        Some(total)
    }

    /// Offered load as a fraction of the focus cluster's capacity, for an open loop into a
    /// cluster whose servers have a capacity: arrival rate x calls per request x mean service
    /// time, over the sum of the servers' concurrency, each divided by its slow-down (a `slow`
    /// failure's factor; antagonists at their long-run average). Retries and hedges are not
    /// offered load: they are what a strategy adds.
    pub fn offered_load(&self) -> Option<f64> {
        let Load::Open { rate, .. } = self.load else {
            return None;
        };
        let c = &self.clusters[self.focus_or_first_with_capacity()?];
        let cap = c.capacity.as_ref()?;
        let m = f64::from(c.servers);
        let slowed = match &c.failure {
            FailureMode::Slow { factor } => f64::from(c.failed) / factor,
            _ => f64::from(c.failed),
        };
        let mut speed = m - f64::from(c.failed) + slowed;
        if let Some(a) = &c.antagonist {
            // Each server is an antagonist's victim a/m of the time.
            let share = f64::from(a.servers) / m;
            speed *= 1.0 - share + share / a.factor;
        }
        let capacity = f64::from(cap.concurrency) * speed / c.latency.mean.as_secs_f64();
        Some(rate * f64::from(c.calls) / capacity)
    }

    /// Sets an open loop's arrival rate so that [`Self::offered_load`] is `load`, and returns
    /// it; `None` (and nothing changed) unless it is an open loop into a cluster with a
    /// capacity.
    pub fn set_offered_load(&mut self, load: f64) -> Option<f64> {
        let Load::Open { rate, clients } = self.load else {
            return None;
        };
        self.load = Load::Open { rate: 1.0, clients };
        let set = self.offered_load().map(|at_unit_rate| load / at_unit_rate);
        self.load = Load::Open {
            rate: set.unwrap_or(rate),
            clients,
        };
        set
    }

    fn focus_or_first_with_capacity(&self) -> Option<usize> {
        let f = self.focus();
        if self.clusters[f].capacity.is_some() {
            return Some(f);
        }
        self.clusters.iter().position(|c| c.capacity.is_some())
    }

    /// The focus cluster's strategy.
    pub fn strategy(&self) -> StrategyKind {
        self.clusters[self.focus()].balancer.strategy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(extra: &str) -> Scenario {
        toml::from_str(&format!(
            "requests = 10\n[load]\nkind = \"open\"\nrate = 100.0\n[[clusters]]\nname = \"api\"\nservers = 2\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn errors_name_the_cluster_and_the_field() {
        assert_eq!(scenario("").validate(), Ok(()));
        let e = scenario("[[clusters.endpoints]]\nweight = 0\n[[clusters.endpoints]]\n")
            .validate()
            .unwrap_err();
        assert_eq!(
            e.cluster,
            Some(ClusterRef {
                index: 0,
                name: "api".into()
            })
        );
        let ScenarioProblem::Field(f) = &e.problem else {
            panic!("{e:?}")
        };
        assert_eq!(f.field.to_string(), "endpoints[0].weight");
        assert_eq!(
            e.to_string(),
            "cluster `api`: endpoints[0].weight must be at least 1, got 0"
        );
        // A nested value's field is under its key, as the old messages had it.
        let e = scenario("latency = { dist = \"lognormal\", mean = \"10ms\", sigma = -1.0 }\n")
            .validate()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cluster `api`: latency.sigma must be a number >= 0, got -1"
        );
        // The scenario's own keys have no cluster.
        let mut sc = scenario("");
        sc.requests = 0;
        let e = sc.validate().unwrap_err();
        assert_eq!(e.cluster, None);
        assert_eq!(e.to_string(), "requests must be at least 1, got 0");
    }

    #[test]
    fn sigma_applies_to_lognormal_only() {
        let e = toml::from_str::<Scenario>(
            "requests = 10\n[load]\nkind = \"open\"\nrate = 100.0\n[[clusters]]\nservers = 2\nlatency = { dist = \"fixed\", sigma = 1.0 }\n",
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("`sigma` applies to dist = \"lognormal\" only, not dist = \"fixed\""),
            "{e}"
        );
    }
}
