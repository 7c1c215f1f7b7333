//! The herd preset (N proxies, each with its own balancer and its own share of the traffic, on
//! the same servers) held to what is known without the simulator: one proxy is one balancer
//! that sees every call, and many proxies that each see almost none of the calls place them as
//! blindly as random, whose FIFO servers are M/M/1 queues with closed forms.

use keel_balance::StrategyKind;
use keel_model::presets::{self, herd_row};
use keel_model::sim::{self, Placement, Scenario, SimResult};

/// A smaller run of the same setting (fixed seed 1).
fn small(mut sc: Scenario) -> Scenario {
    sc.replications = 4;
    sc.requests = 15_000;
    sc
}

fn run(rows: &[Scenario]) -> Vec<SimResult> {
    sim::run_batch(rows, &|_| {})
        .expect("presets are valid")
        .results
}

#[test]
fn the_preset_has_every_n_strategy_and_load() {
    let exp = presets::preset("herd").expect("herd is a preset");
    // 3 strategies x 6 values of N, and random once, at each of 2 loads.
    assert_eq!(exp.rows.len(), 2 * (3 * 6 + 1));
    for r in &exp.rows {
        assert_eq!(r.placement, Placement::ClientSide);
        assert_eq!(r.clusters[0].servers, presets::HERD_SERVERS);
        let load = r.offered_load().expect("open loop into a capacity");
        assert!(
            presets::HERD_LOADS.iter().any(|l| (l - load).abs() < 1e-9),
            "{}",
            r.label
        );
        assert!(
            r.label.contains(&format!("N={} ", r.load.clients())),
            "{}",
            r.label
        );
    }
}

#[test]
fn one_proxy_is_the_single_balancer_row() {
    // N = 1 client-side is one balancer that sees every call: the server-side row.
    let client = small(herd_row(StrategyKind::LeastRequest, 1, 0.8));
    let mut server = client.clone();
    server.placement = Placement::ServerSide;
    let rs = run(&[client, server]);
    let (c, s) = (&rs[0], &rs[1]);
    eprintln!(
        "N=1 client-side {:?}\n    server-side {:?}",
        c.latency_ms, s.latency_ms
    );
    assert_eq!(c.latency_ms, s.latency_ms);
    assert_eq!(c.requests, s.requests);
}

#[test]
fn least_request_herds_toward_random_as_n_grows() {
    let load = 0.8;
    let rows: Vec<Scenario> = [1u32, 4, 16, 400]
        .iter()
        .map(|&n| small(herd_row(StrategyKind::LeastRequest, n, load)))
        .chain(std::iter::once({
            // M/M/1's p99 has a long memory: twice the replications for the reference.
            let mut r = small(herd_row(StrategyKind::Random, 1, load));
            r.replications = 8;
            r
        }))
        .collect();
    let rs = run(&rows);
    for r in &rs {
        eprintln!(
            "{:<26} {:<14} mean {:7.2} p99 {:7.2} {:?}",
            r.label, r.strategy, r.latency_ms.mean, r.latency_ms.p99, r.latency_ci95_ms.p99
        );
        assert_eq!(r.success, 1.0, "{}", r.label);
    }
    let random = &rs[4];
    // Random placement splits Poisson arrivals into 10 Poisson streams: each FIFO server is an
    // M/M/1 queue at rho, whose sojourn time is exponential with mean S / (1 - rho): mean 50 ms,
    // p99 = S ln(100) / (1 - rho) = 230.3 ms at S = 10 ms, rho = 0.8.
    let s_ms = 10.0;
    let mean = s_ms / (1.0 - load);
    let p99 = s_ms * 100f64.ln() / (1.0 - load);
    assert!(
        (random.latency_ms.mean / mean - 1.0).abs() < 0.08,
        "random mean {} against M/M/1 {mean}",
        random.latency_ms.mean
    );
    assert!(
        (random.latency_ms.p99 / p99 - 1.0).abs() < 0.12,
        "random p99 {} against M/M/1 {p99}",
        random.latency_ms.p99
    );
    // More proxies, each with its own share: each sees fewer of the calls on the servers, its
    // in-flight counts say less, and p99 rises, from one balancer's towards random's.
    let p = |i: usize| rs[i].latency_ms.p99;
    assert!(
        p(0) < p(1) && p(1) < p(2) && p(2) < p(3),
        "{:?}",
        (0..4).map(p).collect::<Vec<_>>()
    );
    // One balancer's two choices are far from random (the supermarket model); 400 proxies
    // that each see 2 calls a second are close to it, and no worse.
    assert!(p(0) < 0.5 * p99, "N=1 {}", p(0));
    assert!(p(3) > 0.75 * p99 && p(3) < 1.1 * p99, "N=400 {}", p(3));
}
