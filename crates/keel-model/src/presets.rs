//! The experiments E1-E6 of the reliability model (docs/reliability.md) as built-in simulation
//! presets: one [`Experiment`] per id, each a list of [`Scenario`] rows
//! (`keel simulate --preset e2`); and the tail-latency experiments E8 (`--preset tail`: latency
//! under load on servers that queue) and E9 (`--preset reaction`: how fast calls move off a
//! server that slows down, and back), and the herd (`--preset herd`: N proxies, each with its own
//! balancer and its own share of the traffic, in front of the same servers).
//!
//! Sizes are chosen so that every row's 95 % interval is at most about ±0.005 wide and
//! `keel simulate --preset seed` (all six) finishes in well under a minute on two cores.

use std::time::Duration;

use keel_balance::{
    BalancerConfig, FailureRate, OutlierConfig, RetryBudgetConfig, StrategyKind, TieBreak,
};

use crate::sim::{
    AntagonistConfig, CapacityConfig, ClusterConfig, Discipline, FailedPosition, HealthCheckConfig,
    HedgeConfig, HedgeDelay, Load, Placement, RetryConfig, Scenario, SlowdownConfig,
};
use crate::vocab::{FailureMode, Latency, LatencyDist, DEFAULT_SIGMA};

/// The reliability experiments' ids, in order (what `--preset seed` runs).
pub const IDS: [&str; 6] = ["e1", "e2", "e3", "e4", "e5", "e6"];

/// The tail-latency experiments' preset names (`e8` and `e9` are accepted too).
pub const TAIL_IDS: [&str; 3] = ["tail", "reaction", "herd"];

/// One experiment: an id, what it shows, and its rows.
#[derive(Debug, Clone)]
pub struct Experiment {
    /// `e1` ... `e6`.
    pub id: &'static str,
    /// One line on what it shows.
    pub title: &'static str,
    /// The scenarios, one result row each.
    pub rows: Vec<Scenario>,
}

impl Experiment {
    /// Sets every row's seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        for r in &mut self.rows {
            r.seed = seed;
        }
        self
    }

    /// Sets every row's replication count.
    pub fn with_replications(mut self, replications: u32) -> Self {
        for r in &mut self.rows {
            r.replications = replications;
        }
        self
    }

    /// Divides every row's request count by `factor` (at least 1 request), for quick runs
    /// and tests.
    pub fn scaled_down(mut self, factor: u64) -> Self {
        for r in &mut self.rows {
            r.requests = (r.requests / factor.max(1)).max(1);
        }
        self
    }
}

/// The experiment with this id (`e1` ... `e6`, `tail` or `e8`, `reaction` or `e9`, `herd`;
/// case-insensitive).
pub fn preset(id: &str) -> Option<Experiment> {
    match id.to_ascii_lowercase().as_str() {
        "e1" => Some(e1()),
        "e2" => Some(e2()),
        "e3" => Some(e3()),
        "e4" => Some(e4()),
        "e5" => Some(e5()),
        "e6" => Some(e6()),
        "tail" | "e8" => Some(tail()),
        "reaction" | "e9" => Some(reaction()),
        "herd" => Some(herd()),
        _ => None,
    }
}

/// All six experiments, in order.
pub fn all() -> Vec<Experiment> {
    IDS.iter().map(|id| preset(id).expect("known id")).collect()
}

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    MS * n as u32
}

/// The source's cluster B: m servers, n_f failed, k calls per request, 10 ms healthy.
fn cluster(
    strategy: StrategyKind,
    m: u32,
    failed: u32,
    k: u32,
    failure: FailureMode,
) -> ClusterConfig {
    ClusterConfig {
        name: "B".into(),
        calls: k,
        servers: m,
        failed,
        failed_position: FailedPosition::Last,
        latency: Latency::default(),
        failure,
        balancer: BalancerConfig::new(strategy),
        ..ClusterConfig::default()
    }
}

fn scenario(
    id: &str,
    label: String,
    cluster: ClusterConfig,
    clients: u32,
    requests: u64,
    replications: u32,
) -> Scenario {
    Scenario {
        name: id.into(),
        label,
        seed: 1,
        replications,
        requests,
        warmup: Duration::from_secs(2),
        timeout: Duration::from_secs(1),
        round_trip: Duration::ZERO,
        abort_on_failure: true,
        call_gap: Duration::ZERO,
        placement: Placement::ServerSide,
        load: Load::Closed {
            clients,
            in_flight: 1,
            think_time: Duration::ZERO,
        },
        retry: None,
        health_check: None,
        hedge: None,
        load_reports: None,
        clusters: vec![cluster],
    }
}

/// E1: round-robin and random, m = 5, n_f = 1, k = 3: success (4/5)^3 = 0.512. Exponential
/// service times, so that the calls of one request fall at unrelated places of the
/// round-robin cycle.
pub fn e1() -> Experiment {
    let rows = [StrategyKind::RoundRobin, StrategyKind::Random]
        .into_iter()
        .map(|s| {
            let mut c = cluster(s, 5, 1, 3, FailureMode::Hang);
            c.latency.dist = LatencyDist::Exponential;
            scenario("e1", "m=5 n_f=1 k=3, hang".into(), c, 200, 25_000, 8)
        })
        .collect();
    Experiment {
        id: "e1",
        title: "round-robin and random, m=5, n_f=1, k=3: success 0.512",
        rows,
    }
}

/// E2: least-connections, the failed server hangs to the 1 s timeout, healthy 10 ms (q = 100),
/// 200 requests in flight (about 40 per server): success (400/401)^3 = 0.99253, failed share
/// 1/401.
pub fn e2() -> Experiment {
    let c = cluster(StrategyKind::LeastConnections, 5, 1, 3, FailureMode::Hang);
    Experiment {
        id: "e2",
        title: "least-connections, hang to 1 s timeout (q=100), 200 in flight: success 0.9925",
        rows: vec![scenario(
            "e2",
            "m=5 n_f=1 k=3 q=100, 200 in flight".into(),
            c,
            200,
            100_000,
            8,
        )],
    }
}

/// E3: points of f(p) for q in {0.1, 0.5, 1, 10, 100} and k in {1, 3, 5}, m = 10, where the model
/// holds: server-side, calls independent of each other. That takes an open loop (Poisson
/// arrivals, 20 000 requests/s, tens of calls in flight per server) and a random gap (the
/// caller's own work, exponential, mean 10 ms) before each call after the first; with calls
/// issued back to back by a closed loop, least-connections sends a request's next call to the
/// server its previous call just freed, and calls stop being independent (see E4). The failed
/// servers fail after q x 10 ms. Round-robin and random do not depend on q and run at q = 1.
pub fn e3() -> Experiment {
    let mut rows = Vec::new();
    let model_load = |sc: &mut Scenario, q: f64| {
        sc.load = Load::Open {
            rate: 20_000.0,
            clients: 1,
        };
        sc.call_gap = ms(10);
        // q = 100 fails at 1 s: the timeout must not cut it short.
        sc.timeout = Duration::from_secs(2);
        // The failed servers' in-flight counts reach their level only after many failure
        // times (with a 2 s warm-up, q = 100 reads up to 0.07 below the closed form; with
        // 10 s, on it): warm up for about ten t_fail, and measure over more than one t_fail.
        if q >= 100.0 {
            sc.warmup = Duration::from_secs(10);
            sc.requests = 40_000;
            sc.replications = 4;
        } else if q >= 10.0 {
            sc.warmup = Duration::from_millis(1500);
        } else {
            sc.warmup = Duration::from_millis(200);
        }
    };
    for p_tenths in [2u32, 5, 8] {
        for k in [1u32, 3, 5] {
            for s in [StrategyKind::RoundRobin, StrategyKind::Random] {
                let c = cluster(s, 10, p_tenths, k, FailureMode::FailFast { after: ms(10) });
                let label = format!("p={:.1} k={k} q=1", f64::from(p_tenths) / 10.0);
                let mut sc = scenario("e3", label, c, 1, 15_000, 8);
                model_load(&mut sc, 1.0);
                rows.push(sc);
            }
            for q in [0.1f64, 0.5, 1.0, 10.0, 100.0] {
                let after = Duration::from_secs_f64(0.010 * q);
                let c = cluster(
                    StrategyKind::LeastConnections,
                    10,
                    p_tenths,
                    k,
                    FailureMode::FailFast { after },
                );
                let label = format!("p={:.1} k={k} q={q}", f64::from(p_tenths) / 10.0);
                let mut sc = scenario("e3", label, c, 1, 15_000, 8);
                model_load(&mut sc, q);
                rows.push(sc);
            }
        }
    }
    Experiment {
        id: "e3",
        title: "f(p) points for q in {0.1,0.5,1,10,100}, k in {1,3,5}, m=10, open loop",
        rows,
    }
}

/// E4: fast failure (q < 1: the failed server answers an error after 1 ms or 5 ms, healthy
/// 10 ms as in the source), m = 5, n_f = 1, k = 3, 200 requests in flight: least-connections
/// collapses (least-time no longer, since its half-open re-admission); peak-EWMA's failure penalty (1 s) avoids the failed server;
/// power-of-two-choices is shown beside them, with round-robin as the reference at the same p.
/// Prequal too: the failed server reports few calls in flight and a fast latency (the black
/// hole's bait); its failure penalty keeps it out.
/// Three more rows at q = 0.1 use exponential service times: there peak-EWMA's estimate of a
/// healthy server follows its latency peaks, and times its ~40 calls in flight it can exceed
/// the 1 s penalty of an idle failed server; a 10 s penalty restores the avoidance.
pub fn e4() -> Experiment {
    let mut rows = Vec::new();
    for after_ms in [1u64, 5] {
        for s in [
            StrategyKind::RoundRobin,
            StrategyKind::LeastConnections,
            StrategyKind::LeastTime,
            StrategyKind::PeakEwma,
            StrategyKind::LeastRequest,
            StrategyKind::Prequal,
        ] {
            let c = cluster(
                s,
                5,
                1,
                3,
                FailureMode::FailFast {
                    after: ms(after_ms),
                },
            );
            let q = after_ms as f64 / 10.0;
            rows.push(scenario(
                "e4",
                format!("fail-fast q={q}"),
                c,
                200,
                25_000,
                8,
            ));
        }
    }
    for (s, penalty) in [
        (StrategyKind::RoundRobin, 1u64),
        (StrategyKind::PeakEwma, 1),
        (StrategyKind::PeakEwma, 10),
    ] {
        let mut c = cluster(s, 5, 1, 3, FailureMode::FailFast { after: ms(1) });
        c.latency.dist = LatencyDist::Exponential;
        c.balancer.options.failure_penalty = Duration::from_secs(penalty);
        let mut label = "fail-fast q=0.1, exponential service times".to_string();
        if s == StrategyKind::PeakEwma {
            label = format!("{label}, failure_penalty={penalty}s");
        }
        rows.push(scenario("e4", label, c, 200, 25_000, 8));
    }
    Experiment {
        id: "e4",
        title: "fast failure (q<1): least-connections collapses; least-time, re-admitting one trial call at a time, and peak-ewma do not",
        rows,
    }
}

/// E5: client-side least-connections at low concurrency: 50 clients, each with its own
/// balancer and 1 (or 4) requests in flight; tie-break random vs lowest-index; failed server
/// hanging or failing fast; for lowest-index, the failed server first or last in the list.
pub fn e5() -> Experiment {
    let mut rows = Vec::new();
    let modes = [FailureMode::Hang, FailureMode::FailFast { after: ms(1) }];
    for in_flight in [1u32, 4] {
        for mode in &modes {
            for (tie, position) in [
                (TieBreak::Random, FailedPosition::Last),
                (TieBreak::LowestIndex, FailedPosition::First),
                (TieBreak::LowestIndex, FailedPosition::Last),
            ] {
                let mut c = cluster(StrategyKind::LeastConnections, 5, 1, 3, *mode);
                c.balancer.options.tie_break = tie;
                c.failed_position = position;
                let tie_name = match tie {
                    TieBreak::Random => "random",
                    TieBreak::LowestIndex => "lowest-index",
                };
                let pos = match position {
                    FailedPosition::First => "first",
                    FailedPosition::Last => "last",
                };
                let label = format!(
                    "tie-break={tie_name} in-flight={in_flight}/client failed-server={pos}"
                );
                let mut sc = scenario("e5", label, c, 50, 25_000, 8);
                sc.placement = Placement::ClientSide;
                sc.load = Load::Closed {
                    clients: 50,
                    in_flight,
                    think_time: Duration::ZERO,
                };
                rows.push(sc);
            }
        }
    }
    Experiment {
        id: "e5",
        title:
            "client-side least-connections at low concurrency: tie-break and failure timing decide",
        rows,
    }
}

/// The protections of E6: outlier ejection after 5 failures in a row (Envoy's defaults: 30 s
/// base ejection, at most 10 % of the servers, at least one) or, for servers that fail only
/// part of their calls, 30 % failures out of at least 20 calls in a 10 s window; and up to 2
/// retries on other endpoints within a 20 % retry budget (which, by design, refuses to cover a
/// server failing more than a fifth of all calls for long: ejection has to do that).
fn protect(sc: &mut Scenario) {
    for c in &mut sc.clusters {
        c.balancer.outlier_detection = Some(OutlierConfig {
            failure_rate: Some(FailureRate {
                threshold_percent: 30.0,
                minimum_requests: 20,
            }),
            ..OutlierConfig::default()
        });
    }
    sc.retry = Some(RetryConfig {
        max_retries: 2,
        budget: RetryBudgetConfig::default(),
    });
}

/// E6: the failure modes of E1-E5 (hang, fast error, slow, errors with a probability, flapping)
/// with protections on, for the strategies of E1-E5 and peak-EWMA: success >= 0.999 each.
/// Runs cover minutes of virtual time, so that ejections end and repeat.
pub fn e6() -> Experiment {
    let modes: [(FailureMode, &str); 5] = [
        (FailureMode::Hang, "hang"),
        (FailureMode::FailFast { after: ms(1) }, "fail-fast 1ms"),
        (FailureMode::Slow { factor: 50.0 }, "slow x50 (lognormal)"),
        (FailureMode::Error { probability: 0.5 }, "error p=0.5"),
        (
            FailureMode::Flap {
                up: Duration::from_secs(5),
                down: Duration::from_secs(5),
                down_fails_after: None,
            },
            "flap 5s/5s (hang when down)",
        ),
    ];
    let mut rows = Vec::new();
    for (mode, mode_label) in &modes {
        let setups: [(StrategyKind, Placement, TieBreak, &str); 6] = [
            (
                StrategyKind::RoundRobin,
                Placement::ServerSide,
                TieBreak::Random,
                "E1",
            ),
            (
                StrategyKind::LeastConnections,
                Placement::ServerSide,
                TieBreak::Random,
                "E2",
            ),
            (
                StrategyKind::LeastTime,
                Placement::ServerSide,
                TieBreak::Random,
                "E4",
            ),
            (
                StrategyKind::PeakEwma,
                Placement::ServerSide,
                TieBreak::Random,
                "E4",
            ),
            (
                StrategyKind::LeastConnections,
                Placement::ClientSide,
                TieBreak::LowestIndex,
                "E5",
            ),
            (
                StrategyKind::LeastConnections,
                Placement::ClientSide,
                TieBreak::Random,
                "E5",
            ),
        ];
        for (strategy, placement, tie, from) in setups {
            let mut c = cluster(strategy, 5, 1, 3, *mode);
            c.balancer.options.tie_break = tie;
            if matches!(mode, FailureMode::Slow { .. }) {
                c.latency.dist = LatencyDist::LogNormal {
                    sigma: DEFAULT_SIGMA,
                };
            }
            let mut label = format!("{from}: {mode_label}");
            if placement == Placement::ClientSide {
                c.failed_position = FailedPosition::First;
                let t = if tie == TieBreak::Random {
                    "random"
                } else {
                    "lowest-index"
                };
                label = format!("{label}, client-side tie-break={t}, failed-server=first");
            }
            let mut sc = scenario("e6", label, c, 40, 150_000, 4);
            // Detection itself counts: measure from the start.
            sc.warmup = Duration::ZERO;
            sc.placement = placement;
            protect(&mut sc);
            rows.push(sc);
        }
    }
    // Active health checks on top, where they matter: a server down for long (hang) or often
    // (flap).
    for (mode, mode_label) in [&modes[0], &modes[4]] {
        let c = cluster(StrategyKind::RoundRobin, 5, 1, 3, *mode);
        let mut sc = scenario("e6", format!("E1: {mode_label}"), c, 40, 150_000, 4);
        sc.warmup = Duration::ZERO;
        protect(&mut sc);
        sc.health_check = Some(HealthCheckConfig {
            interval: Duration::from_secs(1),
            unhealthy_threshold: 2,
            healthy_threshold: 2,
        });
        rows.push(sc);
    }
    Experiment {
        id: "e6",
        title: "E1-E5 failure modes with protections (outlier ejection, retries within a budget)",
        rows,
    }
}

/// Mean service time of the tail-latency experiments' servers.
const TAIL_SERVICE: Duration = Duration::from_millis(10);

/// E8's cluster: 40 servers that each serve one call at a time (FIFO, exponential 10 ms); 4 of
/// them 3x slower for good, and 4 more (a new random draw every 5 s) slowed 3x by antagonists.
fn tail_cluster(strategy: StrategyKind) -> ClusterConfig {
    ClusterConfig {
        name: "backend".into(),
        servers: 40,
        failed: 4,
        failure: FailureMode::Slow { factor: 3.0 },
        latency: Latency {
            dist: LatencyDist::Exponential,
            mean: TAIL_SERVICE,
        },
        capacity: Some(CapacityConfig {
            concurrency: 1,
            discipline: Discipline::Fifo,
        }),
        antagonist: Some(AntagonistConfig {
            servers: 4,
            factor: 3.0,
            period: Duration::from_secs(5),
        }),
        balancer: BalancerConfig::new(strategy),
        ..ClusterConfig::default()
    }
}

/// One E8 row: `strategy` at `load` (offered work / capacity), client-side (100 clients, each
/// with its own balancer) or server-side (one balancer for all), hedged or not.
fn tail_row(strategy: StrategyKind, load: f64, client_side: bool, hedge: bool) -> Scenario {
    let clients = 100;
    let mut sc = Scenario {
        name: "e8".into(),
        seed: 1,
        replications: 4,
        requests: 150_000,
        // The queues start empty; hedging reads its p95 from the latencies seen.
        warmup: Duration::from_secs(10),
        // A caller's patience: 200 service times. Past it, the call fails and its queued work
        // is dropped (strategies that overload a slow server hit it).
        timeout: Duration::from_secs(2),
        placement: if client_side {
            Placement::ClientSide
        } else {
            Placement::ServerSide
        },
        load: Load::Open { rate: 1.0, clients },
        hedge: hedge.then_some(HedgeConfig {
            delay: HedgeDelay::Quantile(0.95),
            max: 1,
            budget_percent: 5.0,
        }),
        clusters: vec![tail_cluster(strategy)],
        ..Scenario::default()
    };
    sc.set_offered_load(load)
        .expect("open loop into servers with a capacity");
    let placement = if client_side {
        "client-side x100"
    } else {
        "server-side"
    };
    sc.label = format!("load {load:.2}, {placement}");
    sc
}

/// The offered loads of E8, as fractions of capacity.
pub const TAIL_LOADS: [f64; 5] = [0.5, 0.7, 0.8, 0.9, 0.95];

/// E8 tail: latency under load on heterogeneous servers that queue (see `tail_cluster`), for
/// the strategies a client can run on its own (random, the source's advice for clients;
/// round-robin; least-connections; least-request; peak-EWMA), with hedging (delay p95, budget
/// 5 %) on top of some, and server-side balancers (one balancer that sees every call) for
/// reference. Offered load 0.5 to 0.95 of capacity; Poisson arrivals spread over 100 clients.
pub fn tail() -> Experiment {
    use StrategyKind::*;
    let mut rows = Vec::new();
    for load in TAIL_LOADS {
        for s in [
            Random,
            RoundRobin,
            LeastConnections,
            LeastRequest,
            PeakEwma,
            Prequal,
        ] {
            rows.push(tail_row(s, load, true, false));
        }
        for s in [Random, LeastRequest, PeakEwma, Prequal] {
            rows.push(tail_row(s, load, true, true));
        }
        for s in [LeastConnections, LeastRequest, PeakEwma, Prequal] {
            rows.push(tail_row(s, load, false, false));
        }
    }
    Experiment {
        id: "e8",
        title: "tail latency on 40 queueing servers (4 at 1/3 speed, 4 antagonised), load 0.5-0.95",
        rows,
    }
}

/// One E9 row: 10 servers of 8 workers each (FIFO, exponential 10 ms) at half load, behind one
/// balancer or 100 clients' own; the first server works 5x slower from 10 s to 25 s.
fn reaction_row(strategy: StrategyKind, decay: Option<Duration>, client_side: bool) -> Scenario {
    let mut balancer = BalancerConfig::new(strategy);
    if let Some(d) = decay {
        balancer.options.decay = d;
    }
    let mut sc = Scenario {
        name: "e9".into(),
        seed: 1,
        replications: 4,
        warmup: Duration::from_secs(2),
        timeout: Duration::from_secs(2),
        placement: if client_side {
            Placement::ClientSide
        } else {
            Placement::ServerSide
        },
        load: Load::Open {
            rate: 1.0,
            clients: 100,
        },
        clusters: vec![ClusterConfig {
            name: "backend".into(),
            servers: 10,
            latency: Latency {
                dist: LatencyDist::Exponential,
                mean: TAIL_SERVICE,
            },
            capacity: Some(CapacityConfig {
                concurrency: 8,
                discipline: Discipline::Fifo,
            }),
            slowdown: Some(SlowdownConfig {
                servers: 1,
                factor: 5.0,
                start: Duration::from_secs(10),
                end: Duration::from_secs(25),
            }),
            balancer,
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    };
    let rate = sc
        .set_offered_load(0.5)
        .expect("open loop into servers with a capacity");
    // Measure until 40 s: 38 s after the warm-up.
    sc.requests = (rate * 38.0) as u64;
    let placement = if client_side {
        "client-side x100"
    } else {
        "server-side"
    };
    sc.label = match decay {
        Some(d) => format!(
            "{placement}, decay {}",
            humantime_serde::re::humantime::format_duration(d)
        ),
        None => placement.into(),
    };
    sc
}

/// E9 reaction: one of 10 servers steps up to 5x its service time at 10 s and back at 25 s;
/// how long until its share of calls is below half its fair share, and back. Least-time (the
/// source's minimum average response time) at decays of 1 s, 10 s (keel's default) and 60 s,
/// peak-EWMA, least-request, and round-robin as the reference that does not react; behind one
/// balancer (server-side) and behind 100 clients' own (client-side).
pub fn reaction() -> Experiment {
    use StrategyKind::*;
    let mut rows = Vec::new();
    for client_side in [false, true] {
        rows.push(reaction_row(RoundRobin, None, client_side));
        for d in [1u64, 10, 60] {
            rows.push(reaction_row(
                LeastTime,
                Some(Duration::from_secs(d)),
                client_side,
            ));
        }
        rows.push(reaction_row(PeakEwma, None, client_side));
        rows.push(reaction_row(LeastRequest, None, client_side));
        rows.push(reaction_row(Prequal, None, client_side));
    }
    Experiment {
        id: "e9",
        title: "reaction: one of 10 servers 5x slower from 10 s to 25 s, half load",
        rows,
    }
}

/// Servers of the herd preset.
pub const HERD_SERVERS: u32 = 10;

/// The herd preset's numbers of balancers (proxies).
pub const HERD_BALANCERS: [u32; 6] = [1, 2, 3, 4, 8, 16];

/// The herd preset's offered loads, as fractions of capacity.
pub const HERD_LOADS: [f64; 2] = [0.8, 0.9];

/// The herd preset's strategies (random as the reference that does not depend on N).
pub const HERD_STRATEGIES: [StrategyKind; 4] = [
    StrategyKind::LeastRequest,
    StrategyKind::PeakEwma,
    StrategyKind::Prequal,
    StrategyKind::Random,
];

/// One herd row: `balancers` proxies, each with its own balancer of `strategy`, each taking a
/// random share of Poisson arrivals at `load` of the capacity of 10 FIFO servers (one call at a
/// time, exponential 10 ms, 2 s timeout).
///
/// N proxies each balancing its own share is the simulator's client-side placement with N
/// clients: every client has its own balancer and sees only its own calls, and each Poisson
/// arrival goes to a client drawn at random (so each proxy gets a Poisson stream of 1/N of the
/// rate). With N = 1 it is one balancer that sees every call.
pub fn herd_row(strategy: StrategyKind, balancers: u32, load: f64) -> Scenario {
    let mut sc = Scenario {
        name: "herd".into(),
        seed: 1,
        replications: 8,
        requests: 60_000,
        warmup: Duration::from_secs(5),
        timeout: Duration::from_secs(2),
        placement: Placement::ClientSide,
        load: Load::Open {
            rate: 1.0,
            clients: balancers,
        },
        clusters: vec![ClusterConfig {
            name: "backend".into(),
            servers: HERD_SERVERS,
            latency: Latency {
                dist: LatencyDist::Exponential,
                mean: TAIL_SERVICE,
            },
            capacity: Some(CapacityConfig {
                concurrency: 1,
                discipline: Discipline::Fifo,
            }),
            balancer: BalancerConfig::new(strategy),
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    };
    sc.set_offered_load(load)
        .expect("open loop into servers with a capacity");
    let noun = if balancers == 1 { "proxy" } else { "proxies" };
    sc.label = format!("load {load:.2}, N={balancers} {noun}");
    sc
}

/// The herd: N = 1, 2, 3, 4, 8, 16 proxies, each with its own balancer and its own
/// random share of the traffic, in front of the same 10 FIFO servers (one call at a time,
/// exponential 10 ms) at load 0.8 and 0.9, for least-request, peak-EWMA and prequal; random
/// (which does not depend on N) at N = 1 as the reference a balancer that knows nothing gives.
pub fn herd() -> Experiment {
    let mut rows = Vec::new();
    for load in HERD_LOADS {
        for s in HERD_STRATEGIES {
            if s == StrategyKind::Random {
                rows.push(herd_row(s, 1, load));
                continue;
            }
            for n in HERD_BALANCERS {
                rows.push(herd_row(s, n, load));
            }
        }
    }
    Experiment {
        id: "herd",
        title: "N proxies (own balancer, own share) on the same 10 FIFO servers, exponential 10 ms",
        rows,
    }
}
