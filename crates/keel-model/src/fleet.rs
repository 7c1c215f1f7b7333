//! A fleet of balancers: N proxies, each with its own balancer and outlier detection, in front
//! of the same n endpoints, one of which has failed. How many failed tries does the fleet pay
//! before every proxy has ejected the failed endpoint, when each proxy judges on its own calls
//! (local detection) and when every proxy judges on the fleet's evidence (shared evidence)?
//! docs/reliability.md, "A fleet of balancers", states the setting and derives the closed forms
//! of [`FleetSetting::closed_form`]; [`run`] checks them with the simulator's engine
//! ([`crate::sim`]), which drives keel-balance's own balancers, one per proxy, and carries the
//! shared evidence between them (`Balancer::record_remote`).
//!
//! The closed forms, with p = 1/n, Λ the fleet's request rate, t_fail the time a try to the
//! failed endpoint takes to fail ([`FailureMode::failure_time`]: 0 for an error at once, the
//! timeout for a hang), k the consecutive-failure threshold and d the time evidence takes to
//! reach the other proxies:
//!
//! | detection | traffic | expected failed tries |
//! | --- | --- | --- |
//! | local | spread at random | N k + Λ p t_fail |
//! | local | in turn | N k + N p E[⌊M / N⌋], M ~ Poisson(Λ t_fail) |
//! | shared, quorum 1 | either | k + (N - 1) E[min(X, k)] + Λ p t_fail, X ~ Poisson(Λ p d / N) |
//!
//! Shared evidence with traffic in turn uses the spread form: exact at d = 0 and as d grows
//! without bound, an approximation in between (the simulation says how close).

use std::time::Duration;

use keel_balance::{BalancerConfig, OutlierConfig, StrategyKind};
use rayon::prelude::*;

use crate::sim::{
    self, Arrivals, ClusterConfig, FleetConfig, Load, Placement, Scenario, SharedEvidenceConfig,
    SimError,
};
use crate::stats::student_t95;
use crate::vocab::{FailureMode, Latency};

/// How the proxies judge an endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Detection {
    /// Each proxy on its own calls only.
    Local,
    /// Each proxy on the fleet's outcomes: its own at once, every other proxy's `delay` later;
    /// an ejection needs failures from `quorum` distinct proxies.
    Shared {
        /// From an outcome at one proxy to the others' balancers.
        delay: Duration,
        /// Distinct proxies whose failures an ejection needs.
        quorum: u32,
    },
}

impl Detection {
    /// `local` or `shared`.
    pub fn name(&self) -> &'static str {
        match self {
            Detection::Local => "local",
            Detection::Shared { .. } => "shared",
        }
    }
}

/// `random` or `in-turn`.
pub fn arrivals_name(a: Arrivals) -> &'static str {
    match a {
        Arrivals::Random => "spread",
        Arrivals::InTurn => "in-turn",
    }
}

/// One fleet setting: what the closed form and the simulation share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetSetting {
    /// Proxies (N), each with its own balancer.
    pub proxies: u32,
    /// Endpoints (n), the last of which has failed; each proxy picks at random among them, so
    /// a try goes to the failed one with probability p = 1/n until it is ejected.
    pub endpoints: u32,
    /// Consecutive failures that eject (k).
    pub threshold: u32,
    /// Requests per second over the whole fleet (Λ), Poisson.
    pub rate: f64,
    /// How the failed endpoint fails.
    pub failure: FailureMode,
    /// The caller's timeout (a hang fails at it).
    pub timeout: Duration,
    /// A healthy endpoint's service time.
    pub latency: Latency,
    /// How requests reach the proxies.
    pub arrivals: Arrivals,
    /// Local or shared detection.
    pub detection: Detection,
}

impl FleetSetting {
    /// The preset's setting: 10 endpoints, threshold 5 (keel's default), 200 requests/s over
    /// the fleet, healthy 10 ms, 1 s timeout.
    pub fn new(
        proxies: u32,
        failure: FailureMode,
        arrivals: Arrivals,
        detection: Detection,
    ) -> Self {
        Self {
            proxies,
            endpoints: 10,
            threshold: 5,
            rate: 200.0,
            failure,
            timeout: Duration::from_secs(1),
            latency: Latency::fixed(Duration::from_millis(10)),
            arrivals,
            detection,
        }
    }

    /// The time a try to the failed endpoint takes to fail (t_fail), when the failure mode
    /// fixes it.
    pub fn t_fail(&self) -> Option<Duration> {
        self.failure.failure_time(self.timeout, self.latency.mean)
    }

    /// The expected failed tries before every proxy has ejected the failed endpoint (the
    /// module's table), or `None` where there is no closed form: a failure mode that does not
    /// fail every try in a fixed time, or a quorum above 1.
    pub fn closed_form(&self) -> Option<f64> {
        let t = self.t_fail()?.as_secs_f64();
        let n = f64::from(self.proxies);
        let k = f64::from(self.threshold);
        let p = 1.0 / f64::from(self.endpoints);
        let lambda = self.rate;
        match self.detection {
            Detection::Local => Some(match self.arrivals {
                Arrivals::Random => n * k + lambda * p * t,
                Arrivals::InTurn => {
                    n * k + n * p * expected_floor_div(lambda * t, u64::from(self.proxies))
                }
            }),
            Detection::Shared { delay, quorum: 1 } => {
                let x = lambda * p * delay.as_secs_f64() / n;
                Some(k + (n - 1.0) * expected_capped(x, self.threshold) + lambda * p * t)
            }
            Detection::Shared { .. } => None,
        }
    }

    /// How long to run so that every proxy sees its k-th failure even alone: the failed
    /// endpoint's tries at one proxy come at Λ p / N per second, and k + 8 sqrt(k) + 10 of
    /// them are late by a chance far below 1e-9 (a Poisson tail).
    fn horizon(&self) -> Duration {
        let per_proxy = self.rate / f64::from(self.endpoints) / f64::from(self.proxies);
        let k = f64::from(self.threshold);
        let needed = (k + 8.0 * k.sqrt() + 10.0) / per_proxy;
        let delay = match self.detection {
            Detection::Shared { delay, .. } => delay,
            Detection::Local => Duration::ZERO,
        };
        Duration::from_secs_f64(needed) + self.timeout + delay + Duration::from_secs(1)
    }

    /// The simulated scenario: client-side placement (one balancer per proxy), Poisson
    /// arrivals dealt at random or in turn, random picks, outlier detection on consecutive
    /// failures with ejections that outlast the run.
    pub fn scenario(&self, seed: u64, replications: u32) -> Scenario {
        let requests = (self.horizon().as_secs_f64() * self.rate).ceil() as u64;
        let ejection = Duration::from_secs(3600);
        let shared = match self.detection {
            Detection::Local => None,
            Detection::Shared { delay, quorum } => Some(SharedEvidenceConfig { delay, quorum }),
        };
        Scenario {
            name: "fleet".into(),
            label: self.label(),
            seed,
            replications,
            requests,
            timeout: self.timeout,
            placement: Placement::ClientSide,
            load: Load::Open {
                rate: self.rate,
                clients: self.proxies,
            },
            clusters: vec![ClusterConfig {
                name: "backend".into(),
                servers: self.endpoints,
                failed: 1,
                latency: self.latency,
                failure: self.failure,
                balancer: BalancerConfig {
                    outlier_detection: Some(OutlierConfig {
                        consecutive_failures: self.threshold,
                        base_ejection_time: ejection,
                        max_ejection_time: ejection,
                        ..OutlierConfig::default()
                    }),
                    ..BalancerConfig::new(StrategyKind::Random)
                },
                fleet: Some(FleetConfig {
                    arrivals: self.arrivals,
                    shared,
                }),
                ..ClusterConfig::default()
            }],
            ..Scenario::default()
        }
    }

    /// E.g. `N=8 hang in-turn shared`.
    pub fn label(&self) -> String {
        format!(
            "N={} {} {} {}",
            self.proxies,
            self.failure.name(),
            arrivals_name(self.arrivals),
            self.detection.name()
        )
    }
}

/// One setting's simulated failed tries over its replications, next to the closed form.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetResult {
    /// The setting.
    pub setting: FleetSetting,
    /// Replications run.
    pub replications: u32,
    /// Mean failed tries per replication before every proxy had ejected the failed endpoint.
    pub mean: f64,
    /// Student-t 95 % interval of `mean` (the mean itself when every replication agrees).
    pub ci95: (f64, f64),
    /// Replications in which every proxy ejected it within the run (all of them, normally).
    pub ejected_everywhere: u32,
    /// Mean time from the start (the failure) until every proxy had ejected it, in seconds.
    pub mean_time_s: f64,
    /// [`FleetSetting::closed_form`].
    pub closed_form: Option<f64>,
}

/// Simulates `setting`: `replications` runs (in parallel) from `seed`.
pub fn run(setting: &FleetSetting, seed: u64, replications: u32) -> Result<FleetResult, SimError> {
    let sc = setting.scenario(seed, replications);
    sc.validate()
        .map_err(|e| SimError::Invalid(format!("fleet {}: {e}", sc.label)))?;
    let reps: Vec<sim::RepStats> = (0..replications)
        .into_par_iter()
        .map(|r| sim::run_replication(&sc, r, &|_| {}))
        .collect::<Result<_, _>>()?;
    let tries: Vec<f64> = reps.iter().map(|r| r.fleet_failed_tries as f64).collect();
    let mean = tries.iter().sum::<f64>() / tries.len().max(1) as f64;
    let done: Vec<f64> = reps
        .iter()
        .filter_map(|r| r.fleet_ejected_at.map(|t| t.as_secs_f64()))
        .collect();
    Ok(FleetResult {
        setting: *setting,
        replications,
        mean,
        ci95: student_t95(&tries).unwrap_or((mean, mean)),
        ejected_everywhere: done.len() as u32,
        mean_time_s: done.iter().sum::<f64>() / done.len().max(1) as f64,
        closed_form: setting.closed_form(),
    })
}

/// The preset's numbers of proxies.
pub const PROXIES: [u32; 6] = [1, 2, 4, 8, 16, 32];

/// The preset's propagation delay of shared evidence (a batch of outcomes written to the store
/// and read back through a watch).
pub const DELAY: Duration = Duration::from_millis(50);

/// The preset's replications per row.
pub const REPLICATIONS: u32 = 100;

/// One row of the preset: the same fleet with local and with shared detection.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetRow {
    /// Local detection.
    pub local: FleetResult,
    /// Shared evidence, quorum 1, [`DELAY`].
    pub shared: FleetResult,
}

/// `keel simulate --preset fleet`: N = 1 ... 32 proxies, the failed endpoint failing at once or
/// hanging to the timeout, traffic in turn or spread at random, local against shared detection.
pub fn preset(seed: u64, replications: u32) -> Result<Vec<FleetRow>, SimError> {
    let mut rows = Vec::new();
    for failure in [FailureMode::FAIL_AT_ONCE, FailureMode::Hang] {
        for arrivals in [Arrivals::InTurn, Arrivals::Random] {
            for n in PROXIES {
                let at = |detection| FleetSetting::new(n, failure, arrivals, detection);
                let shared = Detection::Shared {
                    delay: DELAY,
                    quorum: 1,
                };
                rows.push(FleetRow {
                    local: run(&at(Detection::Local), seed, replications)?,
                    shared: run(&at(shared), seed, replications)?,
                });
            }
        }
    }
    Ok(rows)
}

/// The answer first: what shared evidence saves at the largest fleet, fast and hung failures
/// (traffic spread at random), simulated and by the closed form; lines of at most 100 columns.
pub fn headline(rows: &[FleetRow]) -> String {
    let mut out = String::new();
    for failure in ["fail-fast", "hang"] {
        let Some(r) = rows
            .iter()
            .filter(|r| {
                r.local.setting.failure.name() == failure
                    && r.local.setting.arrivals == Arrivals::Random
            })
            .max_by_key(|r| r.local.setting.proxies)
        else {
            continue;
        };
        let s = &r.local.setting;
        let what = match s.failure {
            FailureMode::Hang => format!("hangs to the {} s timeout", s.timeout.as_secs_f64()),
            _ => "fails at once".to_string(),
        };
        let closed = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
        out.push_str(&wrap(&format!(
            "Shared evidence cuts the fleet's failed tries from {:.1} to {:.1} at N={} ({:.0}x \
             fewer) when the endpoint {what}; closed form: {} and {}.",
            r.local.mean,
            r.shared.mean,
            s.proxies,
            r.local.mean / r.shared.mean.max(1e-9),
            closed(r.local.closed_form),
            closed(r.shared.closed_form),
        )));
    }
    if let Some(r) = rows.iter().find(|r| {
        r.local.setting.failure == FailureMode::Hang && r.local.setting.arrivals == Arrivals::Random
    }) {
        let s = &r.local.setting;
        out.push_str(&wrap(&format!(
            "A hang's tries sent while the first ones wait for the timeout (rate x timeout / n = \
             {:.0}) are paid with or without sharing: sharing cuts the N x k part.",
            s.rate * s.timeout.as_secs_f64() / f64::from(s.endpoints)
        )));
    }
    out
}

/// `text` in lines of at most 100 columns, ending with a newline.
fn wrap(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > 100 {
            out.push_str(&line);
            out.push('\n');
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

/// The rows as a table (under 100 columns): simulated mean with its 95 % interval and the
/// closed form, local and shared, and the ratio.
pub fn table(rows: &[FleetRow]) -> String {
    let mut out = format!(
        "{:<9} {:<7} {:>3}  {:>19} {:>6}  {:>19} {:>6} {:>6}\n",
        "failure",
        "traffic",
        "N",
        "local: sim (95% CI)",
        "closed",
        "shared: sim (95% CI)",
        "closed",
        "cut"
    );
    let cell = |r: &FleetResult| format!("{:.1} ({:.1}-{:.1})", r.mean, r.ci95.0, r.ci95.1);
    let closed = |r: &FleetResult| r.closed_form.map_or("-".into(), |v| format!("{v:.1}"));
    for r in rows {
        let s = &r.local.setting;
        out.push_str(&format!(
            "{:<9} {:<7} {:>3}  {:>19} {:>6}  {:>19} {:>6} {:>5.1}x\n",
            s.failure.name(),
            arrivals_name(s.arrivals),
            s.proxies,
            cell(&r.local),
            closed(&r.local),
            cell(&r.shared),
            closed(&r.shared),
            r.local.mean / r.shared.mean.max(1e-9),
        ));
    }
    out
}

/// E[min(X, k)] for X ~ Poisson(mean): the sum over j < k of P(X > j).
pub fn expected_capped(mean: f64, k: u32) -> f64 {
    let mut pmf = (-mean).exp();
    let mut cdf = 0.0;
    let mut sum = 0.0;
    for j in 0..k {
        cdf += pmf;
        sum += (1.0 - cdf).max(0.0);
        pmf *= mean / f64::from(j + 1);
    }
    sum
}

/// E[⌊M / n⌋] for M ~ Poisson(mean): the sum over j >= 1 of P(M >= j n). The probabilities
/// are summed in log space, so that a mean of several hundred does not underflow.
pub fn expected_floor_div(mean: f64, n: u64) -> f64 {
    if mean <= 0.0 || n == 0 {
        return 0.0;
    }
    let top = (mean + 12.0 * mean.sqrt() + 40.0).ceil() as u64;
    let mut ln_fact = 0.0;
    let mut sum = 0.0;
    for m in 0..=top {
        if m > 0 {
            ln_fact += (m as f64).ln();
        }
        let pmf = (-mean + m as f64 * mean.ln() - ln_fact).exp();
        sum += pmf * (m / n) as f64;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_helpers_match_their_definitions() {
        // E[min(X, 1)] = P(X >= 1) = 1 - e^-m.
        assert!((expected_capped(0.7, 1) - (1.0 - (-0.7f64).exp())).abs() < 1e-12);
        // Large k: E[min(X, k)] -> E[X].
        assert!((expected_capped(3.0, 60) - 3.0).abs() < 1e-9);
        // n = 1: E[M] itself.
        assert!((expected_floor_div(200.0, 1) - 200.0).abs() < 1e-6);
        // E[floor(M / 2)] = (E[M] - P(M odd)) / 2, P(M odd) = (1 - e^-2m) / 2.
        let m: f64 = 3.5;
        let odd = (1.0 - (-2.0 * m).exp()) / 2.0;
        assert!((expected_floor_div(m, 2) - (m - odd) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_closed_forms_meet_at_their_limits() {
        let fast = FailureMode::FAIL_AT_ONCE;
        let local = FleetSetting::new(8, fast, Arrivals::Random, Detection::Local);
        assert_eq!(local.closed_form(), Some(40.0), "N k");
        let at_once = Detection::Shared {
            delay: Duration::ZERO,
            quorum: 1,
        };
        let shared = FleetSetting::new(8, fast, Arrivals::Random, at_once);
        assert_eq!(shared.closed_form(), Some(5.0), "k");
        // Evidence that never arrives in time is local detection.
        let never = Detection::Shared {
            delay: Duration::from_secs(1_000_000),
            quorum: 1,
        };
        let slow = FleetSetting::new(8, fast, Arrivals::Random, never);
        assert!((slow.closed_form().unwrap() - 40.0).abs() < 1e-9);
        // One proxy: the same with or without sharing, and the traffic shape plays no part.
        let hang = FailureMode::Hang;
        let one = |a, d| FleetSetting::new(1, hang, a, d).closed_form().unwrap();
        let expect = 5.0 + 200.0 * 0.1 * 1.0;
        for a in [Arrivals::Random, Arrivals::InTurn] {
            for d in [Detection::Local, never] {
                assert!((one(a, d) - expect).abs() < 1e-6, "{a:?} {d:?}");
            }
        }
        let quorum2 = Detection::Shared {
            delay: Duration::ZERO,
            quorum: 2,
        };
        assert_eq!(
            FleetSetting::new(8, fast, Arrivals::Random, quorum2).closed_form(),
            None
        );
    }
}
