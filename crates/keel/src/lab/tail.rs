//! E8 (tail latency under load) and E9 (reaction to a server that slows down) on real traffic:
//! keel-testbed backends on loopback that serve one call at a time (or a few) in FIFO order,
//! open-loop Poisson arrivals spread over clients that each balance their own share with
//! keel-balance (the simulator's client-side placement), then the simulator and, where one
//! exists, queueing theory on what the backends actually served.
//!
//! What the backends served is measured, not assumed: every answer carries the time its work
//! took (`x-keel-service-us`), and the backends time their work with keel-testbed's precise
//! timer (tokio's rounds every deadline up to its next millisecond, which served exponential
//! 10 ms as about 10 ms + 1.1 ms). The simulation then runs the run's own measured arrival
//! rate, the measured mean service time, and the measured probe round trip; the closed form
//! (random placement: each server an M/G/1 queue, Pollaczek-Khinchine) takes the measured
//! service times themselves. Measured latency also holds the loopback round trip of a request
//! that takes no work (measured before the run), which the simulated servers do not have: it is
//! added to the simulated and closed-form latencies, a constant of about 0.1-0.3 ms.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_balance::{Balancer, BalancerConfig, EndpointSpec, StrategyKind};
use keel_model::sim::scenario::LoadReportsConfig;
use keel_model::sim::{
    self, CapacityConfig, Discipline, Load, Placement, Scenario, SlowdownConfig,
};
use keel_model::vocab::{FailureMode, Latency, LatencyDist};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};
use keel_testbed::openloop::{self, ClientSide, OpenLoopReport, OpenLoopSpec, RecordOutcome};
use serde::Serialize;

/// One slow-down step of E9, times from the start of the arrivals (warm-up included).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Step {
    /// Service-time factor while slow.
    pub factor: f64,
    /// Servers slowed (the first ones).
    pub servers: u32,
    /// When the step up happens.
    #[serde(with = "humantime_serde")]
    pub start: Duration,
    /// When the servers are back to normal speed.
    #[serde(with = "humantime_serde")]
    pub end: Duration,
}

/// One E8 or E9 case: a strategy on a cluster of queueing backends under open-loop load.
#[derive(Debug, Clone, Serialize)]
pub struct TailCase {
    /// `e8` or `e9`.
    pub experiment: &'static str,
    /// The strategy every client's balancer runs.
    #[serde(serialize_with = "strategy_name")]
    pub strategy: StrategyKind,
    /// Backends.
    pub servers: u32,
    /// Calls each backend works on at once (FIFO queue behind).
    pub concurrency: u32,
    /// Clients, each with its own balancer; each arrival goes to one drawn at random.
    pub clients: u32,
    /// Offered load asked for, as a fraction of capacity at the nominal service time.
    pub load: f64,
    /// The service time the backends are asked for.
    #[serde(skip)]
    pub service: Latency,
    /// Arrivals before the measured ones, as time.
    #[serde(with = "humantime_serde")]
    pub warmup: Duration,
    /// Time over which the measured arrivals come.
    #[serde(with = "humantime_serde")]
    pub measured: Duration,
    /// Limit on one request.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// E9's step.
    pub step: Option<Step>,
}

fn strategy_name<S: serde::Serializer>(s: &StrategyKind, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(s.name())
}

impl TailCase {
    /// Arrivals per second asked for.
    pub fn rate(&self) -> f64 {
        self.load * f64::from(self.servers * self.concurrency) / self.service.mean.as_secs_f64()
    }

    fn warmup_requests(&self) -> u64 {
        (self.rate() * self.warmup.as_secs_f64()).round() as u64
    }

    fn measured_requests(&self) -> u64 {
        ((self.rate() * self.measured.as_secs_f64()).round() as u64).max(100)
    }

    /// Arrivals in all (for a progress bar).
    pub fn requests(&self) -> u64 {
        self.warmup_requests() + self.measured_requests()
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        format!(
            "{} {} load {:.2} {} clients",
            self.experiment, self.strategy, self.load, self.clients
        )
    }

    fn balancer(&self, seed: u64) -> BalancerConfig {
        let mut cfg = BalancerConfig::new(self.strategy);
        cfg.seed = seed;
        cfg
    }

    /// The simulator's twin of a run: its measured arrival rate, mean service time (of the
    /// servers that were not slowed) and probe round trip.
    pub(crate) fn scenario(&self, m: &TailMeasured, seed: u64) -> Scenario {
        let e9 = self.step.is_some();
        let mean = Duration::from_secs_f64(m.served.mean.max(1e-3) / 1e3);
        let probe_delay = if m.report.probes.count > 0 {
            Duration::from_secs_f64(m.report.probes.p50 / 1e3)
        } else {
            Duration::from_millis(1)
        };
        Scenario {
            name: self.experiment.into(),
            label: self.describe(),
            seed,
            replications: if e9 { 4 } else { 8 },
            requests: if e9 {
                m.report.requests
            } else {
                m.report.requests.max(60_000)
            },
            warmup: self.warmup,
            timeout: self.timeout,
            placement: Placement::ClientSide,
            load: Load::Open {
                rate: m.rate,
                clients: self.clients,
            },
            load_reports: Some(LoadReportsConfig {
                probe_delay,
                on_answers: true,
            }),
            clusters: vec![sim::ClusterConfig {
                name: "backend".into(),
                servers: self.servers,
                latency: Latency {
                    mean,
                    dist: self.service.dist,
                },
                capacity: Some(CapacityConfig {
                    concurrency: self.concurrency,
                    discipline: Discipline::Fifo,
                }),
                slowdown: self.step.map(|s| SlowdownConfig {
                    servers: s.servers,
                    factor: s.factor,
                    start: s.start,
                    end: s.end,
                }),
                balancer: self.balancer(seed),
                ..sim::ClusterConfig::default()
            }],
            ..Scenario::default()
        }
    }
}

/// The lab's E8 and E9 settings.
#[derive(Debug, Clone, Copy)]
pub struct TailPlan {
    /// Backends.
    pub servers: u32,
    /// Clients (balancers).
    pub clients: u32,
    /// Requests in flight per backend (E8).
    pub e8_concurrency: u32,
    /// Offered load of E8.
    pub e8_load: f64,
    /// Requests in flight per backend (E9).
    pub e9_concurrency: u32,
    /// Offered load of E9.
    pub e9_load: f64,
}

/// The settings of the report.
pub const PLAN: TailPlan = TailPlan {
    servers: 10,
    clients: 10,
    e8_concurrency: 1,
    e8_load: 0.85,
    e9_concurrency: 2,
    e9_load: 0.5,
};

/// The exponential 10 ms the backends are asked for.
pub fn service() -> Latency {
    Latency {
        mean: Duration::from_millis(10),
        dist: LatencyDist::Exponential,
    }
}

/// E8's strategies.
pub const E8_STRATEGIES: [StrategyKind; 6] = [
    StrategyKind::Random,
    StrategyKind::RoundRobin,
    StrategyKind::LeastConnections,
    StrategyKind::LeastRequest,
    StrategyKind::PeakEwma,
    StrategyKind::Prequal,
];

/// E9's strategies.
pub const E9_STRATEGIES: [StrategyKind; 5] = [
    StrategyKind::RoundRobin,
    StrategyKind::LeastRequest,
    StrategyKind::LeastTime,
    StrategyKind::PeakEwma,
    StrategyKind::Prequal,
];

/// The cases of E8 and E9 (`quick`: shorter runs).
pub fn plan(e8: bool, e9: bool, quick: bool, strategies: &[StrategyKind]) -> Vec<TailCase> {
    let keep = |s: &StrategyKind| strategies.is_empty() || strategies.contains(s);
    let p = PLAN;
    let secs = |full: f64, fast: f64| Duration::from_secs_f64(if quick { fast } else { full });
    let mut out = Vec::new();
    if e8 {
        for s in E8_STRATEGIES.iter().filter(|s| keep(s)) {
            out.push(TailCase {
                experiment: "e8",
                strategy: *s,
                servers: p.servers,
                concurrency: p.e8_concurrency,
                clients: p.clients,
                load: p.e8_load,
                service: service(),
                warmup: secs(2.0, 1.0),
                measured: secs(20.0, 3.0),
                timeout: Duration::from_secs(2),
                step: None,
            });
        }
    }
    if e9 {
        for s in E9_STRATEGIES.iter().filter(|s| keep(s)) {
            out.push(TailCase {
                experiment: "e9",
                strategy: *s,
                servers: p.servers,
                concurrency: p.e9_concurrency,
                clients: p.clients,
                load: p.e9_load,
                service: service(),
                warmup: secs(1.0, 0.5),
                measured: secs(19.0, 6.5),
                timeout: Duration::from_secs(2),
                step: Some(Step {
                    factor: 5.0,
                    servers: 1,
                    start: secs(6.0, 2.0),
                    end: secs(14.0, 5.0),
                }),
            });
        }
    }
    out
}

/// Mean, quantiles and squared coefficient of variation of a sample, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Served {
    /// Values.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Variance over the squared mean (1 for an exponential, 0 for a constant).
    pub scv: f64,
}

impl Served {
    fn of(xs: &[f64]) -> Served {
        if xs.is_empty() {
            return Served::default();
        }
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        Served {
            count: v.len() as u64,
            mean,
            p50: nearest_rank(&v, 0.5),
            p99: nearest_rank(&v, 0.99),
            scv: var / (mean * mean).max(f64::MIN_POSITIVE),
        }
    }
}

pub(crate) fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// What a real run measured.
#[derive(Debug, Clone)]
pub struct TailMeasured {
    /// The open loop's report (with every arrival's record).
    pub report: OpenLoopReport,
    /// Median latency of a request that takes no work (`GET /keel/load`), ms.
    pub rtt_ms: f64,
    /// What the servers that were not slowed served (the measured arrivals' answers), ms.
    pub served: Served,
    /// Their service times themselves, for the closed form.
    pub served_sample: Vec<f64>,
    /// What the slowed server served while slow (E9; calls whose service started in the step
    /// and that were answered within half the timeout), ms.
    pub slowed: Option<Served>,
    /// Measured arrivals per second.
    pub rate: f64,
    /// Wall time of the run.
    pub seconds: f64,
}

async fn spawn_backends(case: &TailCase, seed: u64) -> anyhow::Result<Vec<BackendHandle>> {
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let mut out = Vec::new();
    for i in 0..case.servers {
        let cfg = BackendConfig {
            latency: case.service,
            concurrency: Some(case.concurrency),
            precise_timer: true,
            name: format!("server-{i}"),
            ..BackendConfig::default()
        };
        out.push(
            backend::spawn_with_seed(loopback, cfg, seed.wrapping_add(u64::from(i)))
                .await
                .context("starting a backend")?,
        );
    }
    Ok(out)
}

/// Median latency of requests that take no work: `GET /keel/load` on each backend.
async fn round_trip(addrs: &[SocketAddr], seed: u64) -> anyhow::Result<f64> {
    let spec = OpenLoopSpec {
        targets: addrs
            .iter()
            .map(|a| format!("http://{a}{}", keel_balance::LOAD_PATH))
            .collect(),
        rate: 1000.0,
        requests: 300,
        warmup: 30,
        timeout: Duration::from_secs(2),
        seed,
    };
    let r = openloop::run(spec)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(r.latency.p50)
}

/// Runs one case over real sockets; `sending` is set when the first arrival is due (for a
/// progress bar: arrivals follow their schedule from then on).
pub async fn measure(
    case: &TailCase,
    seed: u64,
    sending: &OnceLock<Instant>,
) -> anyhow::Result<TailMeasured> {
    let started = Instant::now();
    let backends = spawn_backends(case, seed).await?;
    let addrs: Vec<SocketAddr> = backends.iter().map(|b| b.addr()).collect();
    let rtt_ms = round_trip(&addrs, seed).await?;
    let specs: Vec<EndpointSpec> = addrs
        .iter()
        .map(|a| EndpointSpec::new(a.to_string()))
        .collect();
    let base = case.balancer(seed);
    let make = Arc::new(move |client: usize| {
        let mut cfg = base.clone();
        cfg.seed = base.seed.wrapping_add(client as u64);
        Balancer::new(cfg, &specs).expect("valid lab balancer")
    });
    let spec = OpenLoopSpec {
        targets: Vec::new(),
        rate: case.rate(),
        requests: case.measured_requests(),
        warmup: case.warmup_requests(),
        timeout: case.timeout,
        seed,
    };
    let clients = ClientSide {
        endpoints: addrs.clone(),
        clients: case.clients as usize,
        make_balancer: make,
        path: "/".into(),
        reports_on_answers: true,
    };
    // E9's step, from the start of the arrivals (which begin as the run is called).
    let stepper = case.step.map(|step| {
        let slowed: Vec<_> = backends
            .iter()
            .take(step.servers as usize)
            .map(|b| b.fault_switch())
            .collect();
        let t0 = tokio::time::Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep_until(t0 + step.start).await;
            for s in &slowed {
                s.set(FailureMode::Slow {
                    factor: step.factor,
                });
            }
            tokio::time::sleep_until(t0 + step.end).await;
            for s in &slowed {
                s.set(FailureMode::None);
            }
        })
    });
    let _ = sending.set(Instant::now());
    let report = openloop::run_client_side(spec, clients)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(s) = stepper {
        s.abort();
    }
    for b in backends {
        b.shutdown().await;
    }
    let slowed_servers = case.step.map_or(0, |s| s.servers as usize);
    let ok = |r: &&openloop::Record| r.measured && r.outcome == RecordOutcome::Ok;
    let served_sample: Vec<f64> = report
        .records
        .iter()
        .filter(ok)
        .filter(|r| r.target.is_some_and(|t| t >= slowed_servers))
        .filter_map(|r| r.service_ms)
        .collect();
    let half_timeout = case.timeout.as_secs_f64() * 1e3 / 2.0;
    let slowed = case.step.map(|step| {
        let (a, b) = (step.start.as_secs_f64() * 1e3, step.end.as_secs_f64() * 1e3);
        let xs: Vec<f64> = report
            .records
            .iter()
            .filter(ok)
            .filter(|r| r.target.is_some_and(|t| t < slowed_servers))
            // Its service started while slow (it ended at its answer; the round trip is
            // small), and it was answered well within the timeout: calls that queued near
            // the timeout are answered only when their service was short.
            .filter(|r| {
                let start = r.due_ms + r.latency_ms - r.service_ms.unwrap_or(0.0);
                start >= a && start < b && r.latency_ms < half_timeout
            })
            .filter_map(|r| r.service_ms)
            .collect();
        Served::of(&xs)
    });
    Ok(TailMeasured {
        rate: report.rate(),
        served: Served::of(&served_sample),
        served_sample,
        slowed,
        rtt_ms,
        seconds: started.elapsed().as_secs_f64(),
        report,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_sizes() {
        let full = plan(true, true, false, &[]);
        assert_eq!(full.len(), E8_STRATEGIES.len() + E9_STRATEGIES.len());
        for c in &full {
            assert!((c.warmup + c.measured).as_secs() <= 40, "{c:?}");
        }
        let quick = plan(true, true, true, &[StrategyKind::Random]);
        assert_eq!(quick.len(), 1);
        assert!(quick[0].requests() < 5_000);
    }
}
