//! E7 (multiplex.rs) and the zone experiment (zones.rs) each have an event loop of their own.
//! Their rows that the simulator's engine (sim/engine.rs) can express run again on it here:
//! what the two loops measure side by side is what moving them onto the engine would change in
//! their results. E7's per-connection rows and the zone rules have no counterpart in the
//! engine (it picks per call and has no zones); the module docs say so.

use std::time::Duration;

use keel_balance::{BalancerConfig, OutlierConfig, RetryBudgetConfig, TieBreak};
use keel_model::multiplex::{self, Fault, Granularity, MultiplexScenario};
use keel_model::sim::{
    self, ClusterConfig, FailedPosition, HealthCheckConfig, Load, Placement, RetryConfig, Scenario,
};
use keel_model::{FailureMode, Latency};

/// The engine's twin of an E7 per-call row: one server-side balancer, the clients' streams as
/// closed-loop requests of one call, endpoint 0 failed; retries without a budget's limit.
fn twin(s: &MultiplexScenario) -> Scenario {
    let mut balancer = BalancerConfig::new(s.strategy);
    balancer.options.tie_break = TieBreak::LowestIndex;
    balancer.seed = s.seed;
    balancer.panic_threshold = 0.0;
    if s.protections {
        balancer.outlier_detection = Some(OutlierConfig {
            consecutive_failures: 5,
            max_ejection_percent: 50.0,
            ..OutlierConfig::default()
        });
    }
    Scenario {
        name: "e7".into(),
        label: format!("{} {} {}", s.strategy, s.fault.name(), s.protections),
        seed: s.seed,
        replications: 8,
        requests: s.calls_per_client * u64::from(s.clients),
        timeout: s.timeout,
        placement: match s.granularity {
            Granularity::PerRequest => Placement::ServerSide,
            Granularity::PerConnection => Placement::PerConnection,
        },
        load: Load::Closed {
            clients: s.clients,
            in_flight: s.streams,
            think_time: Duration::ZERO,
        },
        retry: (s.protections && s.granularity == Granularity::PerRequest).then(|| RetryConfig {
            max_retries: 2,
            budget: RetryBudgetConfig {
                budget_percent: 100.0,
                ..RetryBudgetConfig::default()
            },
        }),
        health_check: s.protections.then_some(HealthCheckConfig {
            interval: Duration::from_millis(100),
            unhealthy_threshold: 2,
            healthy_threshold: 2,
        }),
        clusters: vec![ClusterConfig {
            name: "e7".into(),
            calls: 1,
            servers: s.endpoints,
            failed: u32::from(s.fault != Fault::None),
            failed_position: FailedPosition::First,
            latency: Latency::fixed(s.latency),
            failure: match s.fault {
                Fault::FastError => FailureMode::FailFast {
                    after: s.fast_error,
                },
                _ => FailureMode::Hang,
            },
            balancer,
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    }
}

/// E7's per-connection rows on the engine's per-connection placement. Each client's calls go
/// over the one connection it opened, as in E7, but the engine's closed loop counts requests
/// over the run, not per client: a client whose connection landed on the failed endpoint
/// makes its calls at that endpoint's pace. So success is the healthy clients' share of the
/// call rate, `h r_ok / (h r_ok + f r_fail)` (h, f clients on healthy and failed endpoints,
/// r = streams / time per call), not E7's `h / (h + f)` with a fixed number of calls per
/// client: what moving these rows onto the engine would change.
#[test]
fn e7_per_connection_rows_weigh_clients_by_their_pace_on_the_engine() {
    let mut rows = 0;
    for s in multiplex::e7()
        .into_iter()
        .filter(|s| s.granularity == Granularity::PerConnection)
    {
        let own = multiplex::run(&s);
        let engine = sim::run(&twin(&s)).expect("a valid twin");
        let (lo, hi) = own.success_ci95();
        let engine_max_over_mean = engine.max_server_share * f64::from(s.endpoints);
        println!(
            "per connection {} {} protections={}: success own {:.4} [{lo:.4}, {hi:.4}] engine {:.4} [{:.4}, {:.4}]; max/mean own {:.3} engine {:.3}",
            s.strategy,
            s.fault.name(),
            s.protections,
            own.success(),
            engine.success,
            engine.ci95[0],
            engine.ci95[1],
            own.max_over_mean,
            engine_max_over_mean
        );
        // 4 clients on 4 distinct endpoints of 8, endpoint 0 among them (both strategies
        // place the first connection there).
        let (healthy, failed) = if s.fault == Fault::None {
            (4.0, 0.0)
        } else {
            (3.0, 1.0)
        };
        let pace = |d: Duration| f64::from(s.streams) / d.as_secs_f64();
        let r_ok = pace(s.latency);
        let r_fail = match s.fault {
            Fault::Hang => pace(s.timeout),
            _ => pace(s.fast_error),
        };
        let rate = healthy * r_ok + failed * r_fail;
        let want = healthy * r_ok / rate;
        assert!(
            engine.ci95[0] - 1e-9 <= want && want <= engine.ci95[1] + 1e-9,
            "success {} [{}, {}], closed form {want}",
            engine.success,
            engine.ci95[0],
            engine.ci95[1]
        );
        let busiest = if failed > 0.0 { r_ok.max(r_fail) } else { r_ok };
        let want_max = busiest / (rate / f64::from(s.endpoints));
        assert!(
            (engine_max_over_mean - want_max).abs() / want_max < 0.01,
            "max/mean {engine_max_over_mean}, closed form {want_max}"
        );
        // E7's own loop: a fixed number of calls per client.
        assert!((own.success() - healthy / (healthy + failed)).abs() < 1e-9);
        rows += 1;
    }
    assert_eq!(rows, 10, "E7's per-connection rows");
}

#[test]
fn e7_per_call_rows_measure_the_same_on_the_engine() {
    let mut rows = 0;
    for s in multiplex::e7()
        .into_iter()
        .filter(|s| s.granularity == Granularity::PerRequest)
    {
        let own = multiplex::run(&s);
        let engine = sim::run(&twin(&s)).expect("a valid twin");
        let (lo, hi) = own.success_ci95();
        let se = |lo: f64, hi: f64| (hi - lo) / (2.0 * 1.96);
        let z = (engine.success - own.success())
            / (se(lo, hi).powi(2) + se(engine.ci95[0], engine.ci95[1]).powi(2))
                .sqrt()
                .max(1e-9);
        let engine_max_over_mean = engine.max_server_share * f64::from(s.endpoints);
        println!(
            "{} {} protections={}: success own {:.4} [{lo:.4}, {hi:.4}] engine {:.4} [{:.4}, {:.4}] z {z:+.2}; max/mean own {:.3} engine {:.3}",
            s.strategy,
            s.fault.name(),
            s.protections,
            own.success(),
            engine.success,
            engine.ci95[0],
            engine.ci95[1],
            own.max_over_mean,
            engine_max_over_mean
        );
        assert!(z.abs() < 1.96, "success differs: z {z}");
        assert!(
            (engine_max_over_mean - own.max_over_mean).abs() < 0.02,
            "max/mean {} against {}",
            engine_max_over_mean,
            own.max_over_mean
        );
        rows += 1;
    }
    assert_eq!(rows, 10, "E7's per-call rows");
}

/// The zone experiment's zone-unaware row (zones.rs, a loop of its own) on the engine: 11
/// endpoints of 8 FIFO slots, exponential 10 ms, offered load 0.7, one least-request balancer
/// per zone fed each answer's requests in flight. The engine deals arrivals to its clients
/// evenly, not 60/30/10, and has no zones: the zone rules have no twin there.
#[test]
fn zone_unaware_row_on_the_engine() {
    use keel_model::sim::{CapacityConfig, Discipline};
    use keel_model::zones::{self, ZoneRule, ZoneScenario};
    use keel_model::LatencyDist;

    let z = ZoneScenario::preset(ZoneRule::Unaware, 1);
    let own = zones::run(&z);
    let servers: u32 = z.zones.iter().map(|x| x.1).sum();
    let rate = z.rho * f64::from(z.slots) / z.service.as_secs_f64() * f64::from(servers);
    let mut balancer = BalancerConfig::new(z.strategy);
    balancer.seed = z.seed;
    let twin = Scenario {
        name: "zones".into(),
        seed: z.seed,
        replications: 8,
        requests: (rate * z.measure.as_secs_f64()) as u64,
        warmup: z.warmup,
        timeout: Duration::from_secs(10),
        placement: Placement::ClientSide,
        load: Load::Open {
            rate,
            clients: z.zones.len() as u32,
        },
        load_reports: Some(keel_model::sim::scenario::LoadReportsConfig {
            probe_delay: Duration::ZERO,
            on_answers: true,
        }),
        clusters: vec![ClusterConfig {
            name: "zones".into(),
            servers,
            latency: Latency {
                mean: z.service,
                dist: LatencyDist::Exponential,
            },
            capacity: Some(CapacityConfig {
                concurrency: z.slots,
                discipline: Discipline::Fifo,
            }),
            balancer,
            ..ClusterConfig::default()
        }],
        ..Scenario::default()
    };
    let engine = sim::run(&twin).expect("a valid twin");
    println!(
        "zone-unaware: p50 own {:.2} engine {:.2} ms; p99 own {:.2} engine {:.2} [{:.2}, {:.2}] ms",
        own.p50_ms,
        engine.latency_ms.p50,
        own.p99_ms,
        engine.latency_ms.p99,
        engine.latency_ci95_ms.p99[0],
        engine.latency_ci95_ms.p99[1],
    );
    for (own, engine) in [
        (own.p50_ms, engine.latency_ms.p50),
        (own.p99_ms, engine.latency_ms.p99),
    ] {
        assert!(
            (own - engine).abs() / engine < 0.03,
            "own loop {own} ms, engine {engine} ms"
        );
    }
}

/// A call cannot leave its connection: the per-connection placement refuses retries.
#[test]
fn per_connection_refuses_retries() {
    let mut s = multiplex::e7()
        .into_iter()
        .find(|s| s.granularity == Granularity::PerConnection)
        .unwrap();
    s.protections = true;
    let mut sc = twin(&s);
    sc.retry = Some(RetryConfig {
        max_retries: 1,
        budget: RetryBudgetConfig::default(),
    });
    let e = sim::run(&sc).expect_err("retries on a connection");
    assert!(e.to_string().contains("per-connection"), "{e}");
}
