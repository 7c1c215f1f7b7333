//! One row of E1-E6B three ways (closed form, simulation, measurement), its sentences, and the
//! mechanisms that explain where the three differ.

use std::fmt::Write as _;

use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_model::sim::SimResult;
use keel_model::stats::Z95;
use serde::Serialize;

use crate::lab::cases::{tie_name, Case, Protection, Timing};
use crate::lab::compare::{side_se, z_score, Comparison};
use crate::lab::measure::Measured;
use crate::lab::style::{fmt_q, pct, se_text};
use keel_testbed::loadgen::Client;

/// One row: a case, three ways.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// e1..e6.
    pub experiment: String,
    /// Strategy name.
    pub strategy: String,
    /// `none` or `outlier+retry+health`.
    pub protections: String,
    /// The failure mode's name (keel-model's vocabulary: hang, fail-fast, refuse, reset).
    pub failure_mode: String,
    /// `server-side` (through keel's proxy) or `client-side` (balancer in each client).
    pub placement: String,
    /// Tie-break (least-connections only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie_break: Option<String>,
    /// Where the failed servers sit in the list (client-side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_position: Option<String>,
    /// Failed share of servers.
    pub p: f64,
    /// t_fail / t_ok, as the simulation has it (round trip included); null when the failure
    /// mode does not fix t_fail.
    pub q: Option<f64>,
    /// Calls per request.
    pub k: u32,
    /// What a request does after a failed call: `stops at first failure` (applications) or
    /// `all calls` (the model's client).
    pub client: String,
    /// Hash rows (one key per request): the failed server's share of request keys on the
    /// balancer's own ring; the closed form without protections is 1 minus it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_share: Option<f64>,
    /// Measured requests by their number of failed calls (index 0: none failed).
    pub failed_calls_per_request: Vec<u64>,
    /// Requests in flight.
    pub concurrency: usize,
    /// The closed form (with the retry formula when retries are on); null without one.
    pub analytic: Option<f64>,
    /// Simulated success.
    pub simulated: f64,
    /// Its 95 % interval.
    pub simulated_ci95: [f64; 2],
    /// Measured success over real sockets.
    pub measured: f64,
    /// Wilson 95 % interval of `measured`.
    pub measured_ci95: [f64; 2],
    /// Requests measured.
    pub requests: u64,
    /// The model's share of calls to failed servers (round-robin/random: p; least-connections:
    /// p / (p + q (1 - p))), when it has one.
    pub analytic_failed_share: Option<f64>,
    /// Simulated share of attempts to failed servers.
    pub simulated_failed_share: f64,
    /// Measured share of attempts to failed servers.
    pub measured_failed_share: f64,
    /// What the measured share implies if every call to a failed server fails and calls are
    /// independent: (1 - share)^k (unprotected rows).
    pub implied_by_measured_share: Option<f64>,
    /// Measured largest share of attempts to one server.
    pub measured_max_server_share: f64,
    /// Measured attempts per server, in endpoint order (retries included).
    pub measured_attempts: Vec<u64>,
    /// Measured median and 99th percentile request latency, ms.
    pub measured_p50_ms: f64,
    /// See `measured_p50_ms`.
    pub measured_p99_ms: f64,
    /// Wall time of the measurement, s.
    pub seconds: f64,
    /// Measured against the model (null without a model).
    pub model: Option<Comparison>,
    /// Measured against the simulation.
    pub simulation: Comparison,
    /// Sentences on this row, generated from its numbers (what every row of its experiment
    /// shares is said once, in the report's introduction to the experiment).
    pub explanation: String,
    /// The mechanisms the explanation names, in full (the report says each once per
    /// experiment).
    pub causes: Vec<String>,
    /// Null without a departure (the model inside the measured interval, or no model and the
    /// simulation agreeing); true when a named mechanism applies to every departure of the
    /// row (`causes`), false when one is not explained.
    pub explained: Option<bool>,
}

impl Row {
    pub(crate) fn new(case: &Case, m: Measured, sim: SimResult, t: &Timing) -> Row {
        let q = sim.q;
        let p = case.p();
        // A hash of one key per request sends all k calls to one server: the request fails
        // exactly when its key is on the failed server's part of the ring, whatever k.
        let hashed = m
            .key_share
            .filter(|_| case.protections == Protection::None)
            .map(|share| 1.0 - share);
        let analytic = hashed.or_else(|| {
            let q = q?;
            if case.protections != Protection::None {
                analytic::retry_success(
                    case.strategy,
                    case.servers as u64,
                    case.failed as u64,
                    q,
                    case.retries() as u64,
                    case.calls,
                )
            } else if let Some(a) = rotation(case) {
                Some(a)
            } else {
                analytic::success(case.strategy, p, q, case.calls)
            }
        });
        let (lo, hi) = m.load.ci95();
        let measured_ci95 = [lo, hi];
        let measured = m.load.success_rate();
        let model = analytic.map(|a| Comparison {
            agrees: (lo..=hi).contains(&a),
            z: z_score(measured, a, side_se(measured, measured_ci95, a)),
        });
        let se_m = side_se(measured, measured_ci95, sim.success);
        let se_s = side_se(sim.success, sim.ci95, measured);
        let z_sim = z_score(measured, sim.success, (se_m * se_m + se_s * se_s).sqrt());
        let simulation = Comparison {
            agrees: z_sim.abs() <= Z95,
            z: z_sim,
        };
        let mut row = Row {
            experiment: case.experiment.to_string(),
            strategy: case.strategy.name().to_string(),
            protections: case.protections_name().to_string(),
            failure_mode: case.failure.name().to_string(),
            placement: if case.client_side {
                "client-side"
            } else {
                "server-side"
            }
            .into(),
            tie_break: (case.strategy == StrategyKind::LeastConnections)
                .then(|| tie_name(case.tie_break).to_string()),
            failed_position: case
                .client_side
                .then(|| if case.failed_first { "first" } else { "last" }.to_string()),
            p,
            q,
            k: case.calls,
            client: case.client.name().to_string(),
            key_share: m.key_share,
            failed_calls_per_request: m.load.failed_calls_per_request.clone(),
            concurrency: case.concurrency,
            analytic,
            simulated: sim.success,
            simulated_ci95: sim.ci95,
            measured,
            measured_ci95,
            requests: m.load.requests,
            analytic_failed_share: match m.key_share {
                Some(share) => Some(share),
                None => q.and_then(|q| analytic::failed_share(case.strategy, p, q)),
            },
            simulated_failed_share: sim.failed_pick_share,
            measured_failed_share: m.failed_share,
            // Not for a hash of one key per request: its calls are all on one server.
            implied_by_measured_share: (case.protections == Protection::None
                && m.key_share.is_none())
            .then(|| (1.0 - m.failed_share).powi(case.calls as i32)),
            measured_max_server_share: m.max_share,
            measured_attempts: m.attempts.clone(),
            measured_p50_ms: m.load.latency_p50.as_secs_f64() * 1e3,
            measured_p99_ms: m.load.latency_p99.as_secs_f64() * 1e3,
            seconds: m.load.elapsed.as_secs_f64(),
            model,
            simulation,
            explanation: String::new(),
            causes: Vec::new(),
            explained: None,
        };
        (row.explanation, row.causes, row.explained) = explain(&row, case, t);
        row
    }

    /// Attempts measured in all (retries included).
    fn attempts(&self) -> u64 {
        self.measured_attempts.iter().sum()
    }

    /// The simulation's failed calls per failed request for an all-calls client without
    /// protections: k s / (1 - success), s its share of calls on failed servers.
    pub(crate) fn simulated_repeat_failures(&self) -> Option<f64> {
        (self.client == Client::AllCalls.name()
            && self.protections == "none"
            && self.simulated < 1.0)
            .then(|| f64::from(self.k) * self.simulated_failed_share / (1.0 - self.simulated))
    }

    /// An all-calls client's failed calls per failed request: (measured, what independent
    /// calls with the row's share of failed calls give). None for another client or without a
    /// failed request.
    pub(crate) fn repeat_failures(&self) -> Option<(f64, f64)> {
        if self.client != Client::AllCalls.name() {
            return None;
        }
        repeat_failures(&self.failed_calls_per_request, self.k)
    }

    /// The table's verdict: a CSS class and the words. `explained` (neutral): every departure
    /// has a mechanism the report names; `model-off` (amber): the model's departure has none
    /// but the simulation agrees; `off` (red): the simulation's departure has none.
    pub(crate) fn verdict(&self) -> (&'static str, String) {
        let sim = &self.simulation;
        let named = || {
            let names: Vec<&str> = self
                .causes
                .iter()
                .map(|c| c.split(':').next().unwrap_or(c))
                .collect();
            names.join("; ")
        };
        match (&self.model, sim.agrees) {
            (Some(m), false) if m.agrees && self.explained == Some(false) => (
                "model-off",
                format!(
                    "not explained, mechanism unknown: agrees with the model; simulation {:+.1} SE away",
                    sim.z
                ),
            ),
            (Some(m), _) if m.agrees => ("ok", "agrees with the model".into()),
            (None, true) => ("ok", "agrees with the simulation (no closed form)".into()),
            (Some(m), true) if self.explained == Some(true) => (
                "explained",
                format!(
                    "explained: model {:+.1} SE ({}); simulation agrees",
                    m.z,
                    named()
                ),
            ),
            (Some(m), false) if self.explained == Some(true) => (
                "explained",
                format!(
                    "explained: model {:+.1} SE, simulation {:+.1} SE ({})",
                    m.z,
                    sim.z,
                    named()
                ),
            ),
            (None, false) if self.explained == Some(true) => (
                "explained",
                format!("explained: simulation {:+.1} SE ({})", sim.z, named()),
            ),
            (Some(m), true) => (
                "model-off",
                format!(
                    "not explained, mechanism unknown: model outside the interval ({:+.1} SE); simulation agrees",
                    m.z
                ),
            ),
            (Some(m), false) => (
                "off",
                format!(
                    "not explained, mechanism unknown: model {:+.1} SE, simulation {:+.1} SE away",
                    m.z, sim.z
                ),
            ),
            (None, false) => (
                "off",
                format!(
                    "not explained, mechanism unknown: simulation {:+.1} SE away (no closed form)",
                    sim.z
                ),
            ),
        }
    }
}

/// Round-robin without protections, one server failed, an all-calls client with few enough
/// clients to stay in step: the rotation's closed form, 1 - k / n (a hang too: only the
/// spacing after healthy calls matters). None for any other
/// row (many clients interleave: their closed form is independent calls', (1 - p)^k).
pub(crate) fn rotation(case: &Case) -> Option<f64> {
    (case.strategy == StrategyKind::RoundRobin
        && case.protections == Protection::None
        && case.client == Client::AllCalls
        && case.concurrency <= crate::lab::rotation::IN_STEP_CLIENTS
        && case.failed == 1
        && case.calls < case.servers)
        .then(|| crate::lab::rotation::rotation_success(case.servers, case.calls))
}

/// The q that would give least-connections this share of calls on the failed servers:
/// share = p / (p + q (1 - p)) solved for q.
fn q_for_share(p: f64, share: f64) -> Option<f64> {
    (share > 0.0 && share < 1.0 && p > 0.0 && p < 1.0)
        .then(|| p * (1.0 - share) / (share * (1.0 - p)))
}

/// An all-calls client's failed calls per failed request, from its requests counted by their
/// failed calls (`h[i]`: requests with i failed calls): (measured, what independent calls
/// with the same share of failed calls give). None without a failed request.
pub(crate) fn repeat_failures(h: &[u64], k: u32) -> Option<(f64, f64)> {
    let requests: u64 = h.iter().sum();
    let failed_requests: u64 = h.iter().skip(1).sum();
    if failed_requests == 0 {
        return None;
    }
    let failed_calls: u64 = h.iter().enumerate().map(|(i, n)| i as u64 * n).sum();
    let measured = failed_calls as f64 / failed_requests as f64;
    // Independent calls, each failing with the row's share s: E[F | F > 0] = k s / (1 -
    // (1 - s)^k).
    let k = f64::from(k);
    let s = failed_calls as f64 / (k * requests as f64);
    let independent = k * s / (1.0 - (1.0 - s).powf(k));
    Some((measured, independent))
}

/// A mechanism that moves a measurement away from the model or the simulation, as
/// docs/reliability.md names them, with the condition under which it applies to a row
/// ([`Mechanism::applies`]). A departure is "explained" only when one applies; the report
/// colours the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mechanism {
    /// Client-side balancers with one call in flight each: every count is 0 at a pick.
    LowConcurrency,
    /// Random picks are a sample: the failed server's share is one draw around p.
    RandomSample,
    /// Least-connections' in-flight counts build up to a hung server's share, not at once.
    InFlight,
    /// Healthy calls slower than nominal on shared cores (a hung server then gets more calls).
    Contention,
    /// An error "at once" is slower than the assumed round trip (the failed server gets fewer).
    SlowerErrors,
    /// A closed loop's calls of one request are not independent.
    NotIndependent,
    /// Outlier detection takes out a server whose failure is not retried (a 500).
    Ejection,
    /// Round-robin's rotation sends the call after a fast failure to the next, healthy server:
    /// a request's failures rarely repeat (a client that makes all k calls shows it).
    Rotation,
    /// Other clients' picks come between a failed call and its request's next call.
    Interleaving,
    /// The simulated servers' ring is not the backends' ring.
    OtherRing,
}

/// Which comparison a mechanism explains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Against {
    Model,
    Simulation,
}

impl Mechanism {
    const ALL: [Mechanism; 10] = [
        Mechanism::LowConcurrency,
        Mechanism::RandomSample,
        Mechanism::InFlight,
        Mechanism::Contention,
        Mechanism::SlowerErrors,
        Mechanism::NotIndependent,
        Mechanism::Ejection,
        Mechanism::Rotation,
        Mechanism::Interleaving,
        Mechanism::OtherRing,
    ];

    /// Its name, as the rows cite it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mechanism::LowConcurrency => "Low concurrency",
            Mechanism::RandomSample => "A sample of picks",
            Mechanism::InFlight => "In-flight counts",
            Mechanism::Contention => "Contention",
            Mechanism::SlowerErrors => "Slower errors",
            Mechanism::NotIndependent => "Correlated calls",
            Mechanism::Ejection => "Ejection",
            Mechanism::Rotation => "Rotation",
            Mechanism::Interleaving => "Interleaving",
            Mechanism::OtherRing => "Another ring",
        }
    }

    /// What it is and when it applies, said once per experiment.
    pub(crate) fn text(self) -> &'static str {
        match self {
            Mechanism::LowConcurrency => {
                "Low concurrency: each client-side balancer has one call in flight, so every \
                 count is 0 when it picks and least-connections is its tie-break: random ties \
                 spread calls as random picks do, lowest-index sends them all to the first \
                 server. The model's values (for equal, large in-flight counts) do not apply; \
                 applies to client-side rows whose simulation, which runs the same balancers, \
                 agrees with the measurement."
            }
            Mechanism::RandomSample => {
                "A sample of picks: random choices over a few thousand calls put a share on the \
                 failed server that varies by its standard error around p; a fixed seed gives \
                 one draw of it, in the proxy and in the simulation alike (not the same draw). \
                 Applies to random rows whose measured share is within 3 standard errors of p \
                 and accounts for the success measured ((1 - share)^k inside its interval)."
            }
            Mechanism::InFlight => {
                "In-flight counts: least-connections sees a server's capacity only through its \
                 count of calls in flight, and a hung server's count must first build up to the \
                 others' level, so it gets more calls than p / (p + q (1 - p)) gives it, as a \
                 lower q would. Applies to least-connections rows with a slow failure (q > 1) \
                 whose failed server took more than the model's share, and whose share accounts \
                 for the success measured."
            }
            Mechanism::Contention => {
                "Contention: the simulated servers answer in exactly the healthy time plus an \
                 assumed round trip, with no contention for the CPU; here proxy, load generator \
                 and backends share the machine's cores, so healthy calls take longer and a \
                 hung server is fewer times slower than a healthy one than the simulation's q. \
                 Applies to least-connections rows with a slow failure whose median request \
                 took longer than the nominal k calls and whose failed server took more calls \
                 than in the simulation."
            }
            Mechanism::SlowerErrors => {
                "Slower errors: an error \"at once\" still costs the loopback round trip and the \
                 proxy's and the backend's own work, which grow when the cores are busy; the \
                 failed server then holds a call longer than the assumed round trip, as a \
                 higher q would, and gets fewer calls than the model and the simulation give \
                 it. Applies to least-connections rows with a fast failure (q < 1) whose failed \
                 server took fewer calls, and that succeeded more, than predicted."
            }
            Mechanism::NotIndependent => {
                "Correlated calls: the model treats the calls of a request as independent; in a \
                 closed loop they are not (a request whose call has just finished on a healthy \
                 server tends to find that server's count low again), so success departs from \
                 what the share of calls on failed servers implies. Applies to rows of several \
                 calls where (1 - share)^k is outside the measured interval and the simulation, \
                 which runs the same closed loop, departs from the model the same way."
            }
            Mechanism::Ejection => {
                "Ejection: keel does not retry a 500 (it is not in the default retry_on_status), \
                 so the closed form of such a row counts no retry; but a 500 is still the \
                 server's failure, and outlier detection takes the server out after its first \
                 consecutive failures, which the closed form leaves out. Applies to protected \
                 rows whose failure is not retried, whose failed server took under half of p's \
                 share of the calls, that succeeded more than the closed form, and whose \
                 simulation (which ejects the same way) agrees."
            }
            Mechanism::Rotation => {
                "Rotation: a failed server that fails fast frees its caller at once, and \
                 round-robin gives that caller's next call the next position of the rotation, a \
                 healthy server; so a request whose call failed rarely fails again, its failures \
                 spread over more requests, and a client that makes all k calls succeeds less \
                 than (1 - p)^k (at most 1 - k p when no request fails twice). Success is then \
                 1 - k s / m exactly (s: share of calls failed, m: failed calls per failed \
                 request); the row gives its m against independent calls' m. Applies to \
                 round-robin rows of an all-calls client whose failed requests failed more than \
                 once less often than independent calls would, and that succeeded less than \
                 the closed form."
            }
            Mechanism::Interleaving => {
                "Interleaving: in the simulation a call takes exactly its time, so a caller \
                 freed by a fast failure picks again before any other client and gets the next, \
                 healthy server (its failed requests fail about once: m near 1, success near \
                 1 - k p); over real sockets on shared cores other clients' picks come between, \
                 and the call after a failure lands anywhere in the rotation, as an independent \
                 call would. The row gives m measured, simulated (k s / (1 - success)) and for \
                 independent calls. Applies to round-robin rows of an all-calls client that \
                 succeeded more than the simulation and whose measured m is above the \
                 simulated one."
            }
            Mechanism::OtherRing => {
                "Another ring: a hash row's closed form is 1 minus the failed server's share of \
                 the keys on the balancer's ring, which is placed by the endpoints' addresses; \
                 the simulated servers have other names than the backends' loopback ports, so \
                 the simulation hashes onto another ring whose failed server holds another \
                 share (1 - simulated success, without protections). The row gives both shares. \
                 Applies to hash rows without protections whose measurement agrees with the \
                 closed form of its own ring."
            }
        }
    }

    /// Whether it applies to row `r` and explains its departure from `against`.
    fn applies(self, r: &Row, f: &Facts, against: Against) -> bool {
        let lc = r.strategy == StrategyKind::LeastConnections.name();
        let q = r.q.unwrap_or(f64::NAN);
        let (predicted, predicted_share) = match against {
            Against::Model => (r.analytic.unwrap_or(f64::NAN), r.analytic_failed_share),
            Against::Simulation => (r.simulated, Some(r.simulated_failed_share)),
        };
        let share = r.measured_failed_share;
        match self {
            Mechanism::LowConcurrency => {
                against == Against::Model && r.placement == "client-side" && r.simulation.agrees
            }
            Mechanism::RandomSample => {
                r.strategy == StrategyKind::Random.name()
                    && f.implied_inside
                    && f.share_z.is_some_and(|z| z.abs() <= 3.0)
            }
            Mechanism::InFlight => {
                against == Against::Model
                    && lc
                    && q > 1.0
                    && f.implied_inside
                    && predicted_share.is_some_and(|s| share > s)
                    && r.measured < predicted
            }
            Mechanism::Contention => {
                against == Against::Simulation
                    && lc
                    && q > 1.0
                    && r.measured_p50_ms > f.nominal_request_ms
                    && share > r.simulated_failed_share
                    && r.measured < predicted
            }
            Mechanism::SlowerErrors => {
                lc && q < 1.0
                    && predicted_share.is_some_and(|s| share < s)
                    && r.measured > predicted
            }
            Mechanism::Ejection => {
                against == Against::Model
                    && r.protections != "none"
                    && r.failure_mode == "server-error"
                    && share < r.p / 2.0
                    && r.measured > predicted
                    && r.simulation.agrees
            }
            Mechanism::Rotation => {
                against == Against::Model
                    && r.strategy == StrategyKind::RoundRobin.name()
                    && r.client == Client::AllCalls.name()
                    && r.k > 1
                    && r.measured < predicted
                    && r.repeat_failures()
                        .is_some_and(|(measured, independent)| measured < independent)
            }
            Mechanism::Interleaving => {
                // Against the rotation's closed form: its m is k p / (1 - form), what the
                // rotation in step gives; a measured m above it says the others' picks moved
                // the calls off the step.
                let in_step = (against == Against::Model && r.client == Client::AllCalls.name())
                    .then(|| f64::from(r.k) * r.p / (1.0 - predicted));
                r.strategy == StrategyKind::RoundRobin.name()
                    && r.measured > predicted
                    && match against {
                        Against::Simulation => r
                            .repeat_failures()
                            .zip(r.simulated_repeat_failures())
                            .is_some_and(|((measured, _), simulated)| measured > simulated),
                        Against::Model => r
                            .repeat_failures()
                            .zip(in_step)
                            .is_some_and(|((measured, _), form)| measured > form),
                    }
            }
            Mechanism::OtherRing => {
                against == Against::Simulation
                    && r.key_share.is_some()
                    && r.protections == "none"
                    && r.model.is_some_and(|m| m.agrees)
            }
            Mechanism::NotIndependent => {
                let Some(a) = r.analytic else { return false };
                against == Against::Model
                    && r.k > 1
                    && f.implied.is_some()
                    && !f.implied_inside
                    && !(r.simulated_ci95[0]..=r.simulated_ci95[1]).contains(&a)
                    && (r.simulated - a).signum() == (r.measured - a).signum()
            }
        }
    }
}

/// What the mechanisms' conditions read besides the row's own fields.
struct Facts {
    /// (1 - measured share)^k, unprotected rows.
    implied: Option<f64>,
    /// Whether it lies inside the measured interval.
    implied_inside: bool,
    /// Random: the measured share's distance from p in standard errors.
    share_z: Option<f64>,
    /// k calls of the healthy time plus the assumed round trip, ms.
    nominal_request_ms: f64,
}

impl Facts {
    fn of(r: &Row, t: &Timing) -> Facts {
        let implied = r.implied_by_measured_share;
        let attempts = r.attempts().max(1) as f64;
        let se = (r.p * (1.0 - r.p) / attempts).sqrt();
        Facts {
            implied,
            implied_inside: implied
                .is_some_and(|i| (r.measured_ci95[0]..=r.measured_ci95[1]).contains(&i)),
            share_z: (r.strategy == StrategyKind::Random.name())
                .then(|| z_score(r.measured_failed_share, r.p, se)),
            nominal_request_ms: f64::from(r.k) * (t.healthy + t.round_trip).as_secs_f64() * 1e3,
        }
    }
}

/// The mechanisms that explain each departure of a row: (against the model, against the
/// simulation); empty where there is no departure or none applies.
fn mechanisms(r: &Row, t: &Timing) -> (Vec<Mechanism>, Vec<Mechanism>) {
    let f = Facts::of(r, t);
    let of = |against: Against, off: bool| -> Vec<Mechanism> {
        if !off {
            return Vec::new();
        }
        Mechanism::ALL
            .into_iter()
            .filter(|m| m.applies(r, &f, against))
            .collect()
    };
    (
        of(Against::Model, r.model.is_some_and(|m| !m.agrees)),
        of(Against::Simulation, !r.simulation.agrees),
    )
}

/// Sentences on one row: its numbers, how they compare, and which mechanisms explain where
/// they differ (or that none does). What all rows of an experiment share is in the report's
/// introduction to the experiment.
fn explain(r: &Row, case: &Case, t: &Timing) -> (String, Vec<String>, Option<bool>) {
    let mut s = format!(
        "Measured {:.4} ({:.4}-{:.4}, {} requests), simulated {:.4}",
        r.measured, r.measured_ci95[0], r.measured_ci95[1], r.requests, r.simulated
    );
    match (r.analytic, &r.model) {
        (Some(a), Some(m)) if m.agrees => {
            let _ = write!(s, ", model {a:.4}, inside the measured interval.");
        }
        (Some(a), Some(m)) => {
            let _ = write!(
                s,
                ", model {a:.4}: the model lies {} from the measurement ({:+.4}).",
                se_text(m.z),
                r.measured - a
            );
        }
        _ => s.push_str(", no closed form."),
    }
    let share = r.measured_failed_share;
    if let Some(key_share) = r.key_share {
        let _ = write!(
            s,
            " One key per request: its {} calls go to one server, and the ring gives the failed \
             server {key_share:.4} of the keys",
            r.k
        );
        if case.protections == Protection::None {
            let _ = write!(
                s,
                " (closed form 1 - {key_share:.4} = {:.4}); the simulation's ring gives it \
                 {:.4}.",
                1.0 - key_share,
                1.0 - r.simulated
            );
        } else {
            s.push('.');
        }
    }
    if let Some((m, independent)) = r.repeat_failures() {
        let h = &r.failed_calls_per_request;
        let failed: u64 = h.iter().skip(1).sum();
        let twice: u64 = h.iter().skip(2).sum();
        let calls_failed = m * failed as f64 / (f64::from(r.k) * r.requests.max(1) as f64);
        let _ = write!(
            s,
            " All {} calls made: {twice} of {failed} failed requests failed more than once, {m:.3} \
             failed calls per failed request (independent calls: {independent:.3}); with {} of \
             calls failed, 1 - {} x {calls_failed:.4} / {m:.3} = {:.4}.",
            r.k,
            pct(calls_failed),
            r.k,
            1.0 - f64::from(r.k) * calls_failed / m
        );
        if let Some(sim_m) = r.simulated_repeat_failures() {
            let _ = write!(
                s,
                " The simulation's failed requests failed {sim_m:.3} times each (perfect \
                 rotation: 1)."
            );
        }
    }
    if case.protections != Protection::None {
        let _ = write!(
            s,
            " The failed server took {} of {} attempts.",
            pct(share),
            r.attempts()
        );
        if r.measured < 0.999 {
            s.push_str(
                " Below 0.999: calls failed before the failed server was ejected or marked \
                 unhealthy, and retries did not cover all of them (the retry budget or the \
                 request timeout ran out).",
            );
        }
    } else if case.client_side {
        if case.tie_break == keel_balance::TieBreak::LowestIndex {
            let _ = write!(
                s,
                " Lowest-index sent {} of attempts to the first server, which is {}.",
                pct(r.measured_max_server_share),
                if case.failed_first {
                    "the failed one"
                } else {
                    "healthy"
                }
            );
        } else {
            let _ = write!(
                s,
                " Random ties spread attempts like random picks: {} to the failed server \
                 (round-robin's share {}), so least-connections' advantage in the model is gone.",
                pct(share),
                pct(r.p)
            );
        }
    } else {
        let _ = write!(s, " The failed servers took {} of attempts", pct(share));
        match r.analytic_failed_share {
            Some(f) => {
                let _ = write!(
                    s,
                    " (model {}, simulated {}).",
                    pct(f),
                    pct(r.simulated_failed_share)
                );
            }
            None => {
                let _ = write!(s, " (simulated {}).", pct(r.simulated_failed_share));
            }
        }
        let off = r.model.is_some_and(|m| !m.agrees) || !r.simulation.agrees;
        if let (true, Some(implied)) = (off, r.implied_by_measured_share) {
            where_calls_went(&mut s, r, case, implied);
        }
    }
    if !r.simulation.agrees {
        let _ = write!(
            s,
            " Measurement and simulation differ by {:+.4} ({}).",
            r.measured - r.simulated,
            se_text(r.simulation.z),
        );
    }
    let (model, sim) = mechanisms(r, t);
    let model_off = r.model.is_some_and(|m| !m.agrees);
    let sim_off = !r.simulation.agrees;
    for (off, list, what) in [(model_off, &model, "model"), (sim_off, &sim, "simulation")] {
        if !off {
            continue;
        }
        if list.is_empty() {
            let _ = write!(
                s,
                " No mechanism this report names applies to the departure from the {what}: \
                 not explained."
            );
        } else {
            let names: Vec<String> = list.iter().map(|m| format!("[{}]", m.name())).collect();
            let _ = write!(s, " Departure from the {what}: {}.", names.join(" "));
        }
    }
    let explained = (model_off || sim_off)
        .then_some((!model_off || !model.is_empty()) && (!sim_off || !sim.is_empty()));
    let mut all: Vec<Mechanism> = model;
    for m in sim {
        if !all.contains(&m) {
            all.push(m);
        }
    }
    (
        s,
        all.into_iter().map(|m| m.text().to_string()).collect(),
        explained,
    )
}

/// Whether where the calls went (the measured share of attempts on failed servers) accounts
/// for an unprotected server-side row's departure, and what that share says.
fn where_calls_went(s: &mut String, r: &Row, case: &Case, implied: f64) {
    let share = r.measured_failed_share;
    let inside = (r.measured_ci95[0]..=r.measured_ci95[1]).contains(&implied);
    let _ = write!(
        s,
        " The measured share implies (1 - {})^{} = {implied:.4}, {} the measured interval",
        pct(share),
        r.k,
        if inside { "inside" } else { "outside" }
    );
    if inside {
        s.push_str(": where the calls went accounts for the difference.");
    } else {
        s.push_str(": where the calls went does not account for it alone.");
    }
    match case.strategy {
        StrategyKind::Random => {
            let model_share = r.p;
            let n = r.attempts().max(1) as f64;
            let se = (model_share * (1.0 - model_share) / n).sqrt();
            let _ = write!(
                s,
                " {} is {} from the expected {} over {} attempts; the simulation's draws put {} \
                 there.",
                pct(share),
                se_text(z_score(share, model_share, se)),
                pct(model_share),
                r.attempts(),
                pct(r.simulated_failed_share)
            );
        }
        StrategyKind::LeastConnections => {
            if let (Some(q_eff), Some(q)) = (q_for_share(r.p, share), r.q) {
                let _ = write!(
                    s,
                    " That share is what q = {} would give, not {}.",
                    fmt_q(q_eff),
                    fmt_q(q)
                );
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unprotected server-side random row of 5 servers, k = 3, 10,000 attempts, with the
    /// failed server's share `share` and a measured success of exactly what that share implies.
    fn random_row(share: f64) -> Row {
        let measured = (1.0 - share).powi(3);
        let ci = [measured - 0.01, measured + 0.01];
        let attempts = 10_000u64;
        let on_failed = (share * attempts as f64).round() as u64;
        let mut per = vec![(attempts - on_failed) / 4; 4];
        per.push(on_failed);
        let model = 0.512;
        Row {
            experiment: "e1".into(),
            strategy: "random".into(),
            protections: "none".into(),
            failure_mode: "fail-fast".into(),
            placement: "server-side".into(),
            tie_break: None,
            failed_position: None,
            p: 0.2,
            q: Some(0.024),
            k: 3,
            client: Client::StopsAtFirstFailure.name().into(),
            key_share: None,
            failed_calls_per_request: Vec::new(),
            concurrency: 24,
            analytic: Some(model),
            simulated: measured,
            simulated_ci95: ci,
            measured,
            measured_ci95: ci,
            requests: 4000,
            analytic_failed_share: Some(0.2),
            simulated_failed_share: share,
            measured_failed_share: share,
            implied_by_measured_share: Some(measured),
            measured_max_server_share: share.max(0.25),
            measured_attempts: per,
            measured_p50_ms: 12.0,
            measured_p99_ms: 20.0,
            seconds: 1.0,
            model: Some(Comparison {
                agrees: (ci[0]..=ci[1]).contains(&model),
                z: z_score(measured, model, side_se(measured, ci, model)),
            }),
            simulation: Comparison {
                agrees: true,
                z: 0.0,
            },
            explanation: String::new(),
            causes: Vec::new(),
            explained: None,
        }
    }

    #[test]
    fn a_random_draw_explains_a_departure_only_within_three_standard_errors() {
        let t = Timing::default();
        // SE of the share over 10,000 attempts: 0.004. 0.19 is 2.5 SE from 0.2, 0.17 is 7.5.
        let near = random_row(0.19);
        assert!(
            near.model.is_some_and(|m| !m.agrees),
            "a departure to explain"
        );
        assert_eq!(mechanisms(&near, &t).0, vec![Mechanism::RandomSample]);
        let far = random_row(0.17);
        assert!(far.model.is_some_and(|m| !m.agrees));
        assert!(mechanisms(&far, &t).0.is_empty(), "too far for a draw");
    }

    #[test]
    fn rotation_explains_an_all_calls_round_robin_row_whose_failures_do_not_repeat() {
        let t = Timing::default();
        // 3,000 requests of 3 calls: 1,650 failed once, none twice (m = 1), 0.45 measured.
        let mut r = random_row(0.2);
        r.strategy = "round-robin".into();
        r.client = Client::AllCalls.name().into();
        r.requests = 3000;
        r.failed_calls_per_request = vec![1350, 1650];
        r.measured = 0.45;
        r.measured_ci95 = [0.432, 0.468];
        r.model = Some(Comparison {
            agrees: false,
            z: z_score(0.45, 0.512, side_se(0.45, r.measured_ci95, 0.512)),
        });
        let (m, independent) = r.repeat_failures().unwrap();
        assert_eq!(m, 1.0);
        // s = 1650 / 9000: independent calls fail 3 s / (1 - (1 - s)^3) = 1.21 times.
        assert!((independent - 1.208).abs() < 0.001, "{independent}");
        assert_eq!(mechanisms(&r, &t).0, vec![Mechanism::Rotation]);
        // The application's client never shows it.
        r.client = Client::StopsAtFirstFailure.name().into();
        assert!(r.repeat_failures().is_none());
        assert!(mechanisms(&r, &t).0.is_empty());
    }

    #[test]
    fn only_rows_whose_every_departure_is_explained_are_grey() {
        let t = Timing::default();
        let case_free = |mut r: Row| {
            let (model, sim) = mechanisms(&r, &t);
            let model_off = r.model.is_some_and(|m| !m.agrees);
            r.explained = Some((!model_off || !model.is_empty()) && sim.is_empty());
            r.causes = model.iter().map(|m| m.text().to_string()).collect();
            r
        };
        assert_eq!(case_free(random_row(0.19)).verdict().0, "explained");
        assert_eq!(case_free(random_row(0.17)).verdict().0, "model-off");
        assert_eq!(case_free(random_row(0.2)).verdict().0, "ok");
    }
}
