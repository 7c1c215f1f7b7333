//! Fitting access logs written from a known model (fixed seeds), refusals, the scenario file's
//! round trip, and advise's ranking where the closed form knows the answer.

use std::time::Duration;

use keel_model::advise::{self, Protections};
use keel_model::fit::scenario::{scenario_toml, ScenarioOptions};
use keel_model::fit::synth::{write_log, SynthEndpoint, SynthLog};
use keel_model::fit::{fit_reader, FitError, FitOptions, FittedModel};
use keel_model::sim::Scenario;
use keel_model::vocab::{Latency, LatencyDist};

fn ms(x: f64) -> Duration {
    Duration::from_secs_f64(x / 1e3)
}

/// a: log-normal 10 ms (sigma 0.5), hangs on 2 % of calls; b: exponential 20 ms, 20 % fast
/// errors after 0.5 ms; c: log-normal 20 ms (sigma 0.3) behind a FIFO limit of 2 calls at once.
fn truth(tries: bool, requests: u64) -> SynthLog {
    let mut a = SynthEndpoint::healthy(
        "10.0.0.1:80",
        Latency {
            mean: ms(10.0),
            dist: LatencyDist::LogNormal { sigma: 0.5 },
        },
    );
    a.hang_share = 0.02;
    let mut b = SynthEndpoint::healthy(
        "10.0.0.2:80",
        Latency {
            mean: ms(20.0),
            dist: LatencyDist::Exponential,
        },
    );
    b.error_share = 0.2;
    b.error_after_ms = 0.5;
    let mut c = SynthEndpoint::healthy(
        "10.0.0.3:80",
        Latency {
            mean: ms(20.0),
            dist: LatencyDist::LogNormal { sigma: 0.3 },
        },
    );
    c.capacity = Some(2);
    SynthLog {
        cluster: "app".into(),
        endpoints: vec![a, b, c],
        rate: 150.0,
        requests,
        timeout_ms: 1000.0,
        tries,
        seed: 7,
        start: 1_714_564_800.0,
    }
}

fn log_text(spec: &SynthLog) -> Vec<u8> {
    let mut out = Vec::new();
    write_log(spec, &mut out).unwrap();
    out
}

fn fit(text: &[u8], opts: &FitOptions) -> Result<FittedModel, FitError> {
    fit_reader(text, opts)
}

fn within(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        (got - want).abs() <= rel * want.abs(),
        "{what}: got {got}, want {want} within {:.0} %",
        rel * 100.0
    );
}

#[test]
fn a_known_model_is_recovered_from_its_log() {
    let model = fit(&log_text(&truth(true, 60_000)), &FitOptions::default()).unwrap();
    assert_eq!(model.cluster, "app");
    assert_eq!(model.requests, 60_000);
    assert_eq!(model.endpoints.len(), 3);
    // Poisson at 150/s: the rate within 2 % (60,000 arrivals: 0.4 % standard error) and the
    // index of dispersion near 1 (its standard error over ~4,000 windows is about 0.02).
    within(model.arrival.rate_per_s, 150.0, 0.02, "rate");
    assert!(
        (model.arrival.dispersion - 1.0).abs() < 0.1,
        "{:?}",
        model.arrival
    );
    within(model.timeout_ms.unwrap(), 1000.0, 0.001, "timeout");

    let [a, b, c] = &model.endpoints[..] else {
        unreachable!()
    };
    // a: ~19,600 successes; log-normal chosen, mean within 3 %, sigma within 0.03.
    match a.latency.family.dist {
        LatencyDist::LogNormal { sigma } => assert!((sigma - 0.5).abs() < 0.03, "{sigma}"),
        other => panic!("a: {other:?}"),
    }
    within(
        a.latency.family.mean.as_secs_f64() * 1e3,
        10.0,
        0.03,
        "a mean",
    );
    let hang = a.failures.timeout;
    assert!(hang.ci95[0] <= 0.02 && 0.02 <= hang.ci95[1], "{hang:?}");
    assert_eq!(a.failures.error.count, 0);
    assert!(a.capacity.is_none(), "{:?}", a.capacity);

    // b: exponential chosen; 20 % fast errors at 0.5 ms.
    assert_eq!(b.latency.family.dist, LatencyDist::Exponential);
    within(
        b.latency.family.mean.as_secs_f64() * 1e3,
        20.0,
        0.04,
        "b mean",
    );
    let err = b.failures.error;
    assert!(err.ci95[0] <= 0.2 && 0.2 <= err.ci95[1], "{err:?}");
    within(b.failures.error_ms.unwrap(), 0.5, 0.01, "b error time");
    assert!(b.capacity.is_none(), "{:?}", b.capacity);
    assert!(b.latency.ks.unwrap() < 0.02, "{:?}", b.latency.ks);

    // c: 50 calls/s of 20 ms on 2 slots (utilisation 0.5) queue visibly: Little's law gives
    // the limit back, and the service time is fitted from the calls that did not wait.
    let cap = c.capacity.as_ref().expect("c's capacity");
    assert_eq!(cap.concurrency, 2, "{cap:?}");
    within(
        c.latency.family.mean.as_secs_f64() * 1e3,
        20.0,
        0.05,
        "c mean",
    );
    assert!(a.in_flight_logged && c.in_flight_logged);
}

#[test]
fn todays_log_without_tries_fits_from_single_try_lines() {
    let model = fit(&log_text(&truth(false, 60_000)), &FitOptions::default()).unwrap();
    let [a, b, c] = &model.endpoints[..] else {
        unreachable!()
    };
    assert!(!a.in_flight_logged);
    let err = b.failures.error;
    assert!(err.ci95[0] <= 0.2 && 0.2 <= err.ci95[1], "{err:?}");
    let hang = a.failures.timeout;
    assert!(hang.ci95[0] <= 0.02 && 0.02 <= hang.ci95[1], "{hang:?}");
    within(
        a.latency.family.mean.as_secs_f64() * 1e3,
        10.0,
        0.03,
        "a mean",
    );
    // In flight rebuilt from start and end times (times to the millisecond) still shows c's
    // limit.
    assert_eq!(
        c.capacity.as_ref().map(|c| c.concurrency),
        Some(2),
        "{:?}",
        c.capacity
    );
}

#[test]
fn since_keeps_the_end_of_the_log() {
    // 60,000 requests at 150/s span 400 s; the last 100 s hold about a quarter.
    let text = log_text(&truth(true, 60_000));
    let opts = FitOptions {
        since: Some(Duration::from_secs(100)),
        ..FitOptions::default()
    };
    let model = fit(&text, &opts).unwrap();
    within(
        model.requests as f64,
        15_000.0,
        0.05,
        "requests in the last 100 s",
    );
    assert!(model.seconds <= 101.5, "{}", model.seconds);
}

#[test]
fn what_cannot_be_fitted_is_refused_with_its_reason() {
    let few = log_text(&truth(true, 50));
    match fit(&few, &FitOptions::default()) {
        Err(FitError::TooFewLines {
            have: 50,
            need: 100,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // Two clusters and none chosen.
    let mut two = log_text(&truth(true, 300));
    let mut other = truth(true, 300);
    other.cluster = "billing".into();
    two.extend(log_text(&other));
    let e = fit(&two, &FitOptions::default()).unwrap_err();
    assert!(
        matches!(&e, FitError::MixedClusters { clusters } if clusters.len() == 2),
        "{e:?}"
    );
    assert!(e.to_string().contains("--cluster"), "{e}");
    let chosen = FitOptions {
        cluster: Some("billing".into()),
        ..FitOptions::default()
    };
    assert_eq!(fit(&two, &chosen).unwrap().requests, 300);
    let missing = FitOptions {
        cluster: Some("nope".into()),
        ..FitOptions::default()
    };
    assert!(matches!(
        fit(&two, &missing),
        Err(FitError::UnknownCluster { .. })
    ));
    // Today's form where every request took two tries: no endpoint is known for any try.
    let multi: String = (0..200)
        .map(|i| format!("{{\"time\":\"2024-05-01T12:00:{:02}.{:03}Z\",\"status\":200,\"duration_ms\":5.0,\"cluster\":\"app\",\"endpoint\":\"a:1\",\"attempts\":2}}\n", i / 100, i % 100 * 10))
        .collect();
    assert!(matches!(
        fit(multi.as_bytes(), &FitOptions::default()),
        Err(FitError::NoEndpoints { multi_try: 200, .. })
    ));
    // Not an access log.
    let text = "GET / 200\n".repeat(200);
    assert!(matches!(
        fit(text.as_bytes(), &FitOptions::default()),
        Err(FitError::Unparsable { skipped: 200, .. })
    ));
    // No times.
    let untimed = "{\"status\":200,\"duration_ms\":5.0,\"cluster\":\"app\",\"endpoint\":\"a:1\",\"attempts\":1}\n".repeat(200);
    assert_eq!(
        fit(untimed.as_bytes(), &FitOptions::default()),
        Err(FitError::NoTimes)
    );
}

#[test]
fn the_scenario_file_reads_back_to_the_simulated_scenario() {
    let model = fit(&log_text(&truth(true, 20_000)), &FitOptions::default()).unwrap();
    let opts = ScenarioOptions::for_model(&model);
    for c in advise::candidates(&model, &opts, None)
        .into_iter()
        .filter(|c| c.strategy == keel_balance::StrategyKind::LeastRequest)
    {
        let text = scenario_toml(&model, &c.scenario, "test.log");
        let back =
            Scenario::from_toml_str(&text, "fitted.toml").unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(back, c.scenario, "{text}");
    }
}

#[test]
fn advise_ranks_least_connections_below_round_robin_next_to_a_fast_failing_endpoint() {
    // Two healthy endpoints (fixed 10 ms) and one that answers half its calls with an error at
    // once. Round-robin without protections succeeds on 1 - 0.5 / 3 = 0.8333 of requests (the
    // closed form: each endpoint gets a third); least-connections sees the failing endpoint's
    // calls end at once, so it looks idle and gets more than its third (E4).
    let healthy = |n: &str| SynthEndpoint::healthy(n, Latency::fixed(ms(10.0)));
    let mut bad = healthy("10.0.0.3:80");
    bad.error_share = 0.5;
    bad.error_after_ms = 0.1;
    let spec = SynthLog {
        cluster: "app".into(),
        endpoints: vec![healthy("10.0.0.1:80"), healthy("10.0.0.2:80"), bad],
        rate: 300.0,
        requests: 6_000,
        timeout_ms: 1000.0,
        tries: true,
        seed: 3,
        start: 1_714_564_800.0,
    };
    let model = fit(&log_text(&spec), &FitOptions::default()).unwrap();
    let mut opts = ScenarioOptions::for_model(&model);
    opts.requests = 3_000;
    opts.replications = 3;
    let advice = advise::advise(&model, &opts, None, "test.log", &|_| {}).unwrap();
    let row = |s: &str, p: Protections| {
        advice
            .ranking
            .iter()
            .position(|r| r.strategy == s && r.protections == p.label())
            .unwrap()
    };
    let rr = &advice.ranking[row("round-robin", Protections::None)];
    let lc_at = row("least-connections", Protections::None);
    let lc = &advice.ranking[lc_at];
    // The fitted error share is within its interval of 0.5, so the closed form is evaluated at
    // the fitted share: 1 - share / 3.
    let share = model.endpoints[2].failures.error.share;
    let closed = 1.0 - share / 3.0;
    assert!(
        rr.success[1] - 0.01 <= closed && closed <= rr.success[2] + 0.01,
        "round-robin {:?} vs closed form {closed}",
        rr.success
    );
    assert!(
        lc.success[2] < rr.success[1],
        "lc {:?} rr {:?}",
        lc.success,
        rr.success
    );
    assert!(lc.pick_shares[2] > 0.4, "{:?}", lc.pick_shares);
    assert!(lc_at > row("round-robin", Protections::None));
    assert!(
        advice
            .traps
            .iter()
            .any(|t| t.contains("least-connections") && t.contains("E4")),
        "{:?}",
        advice.traps
    );
    // Protections beat none for every strategy here: the best row retries.
    assert_ne!(advice.ranking[0].protections, Protections::None.label());
    assert!(
        advice.ranking[0].success[0] > 0.99,
        "{:?}",
        advice.ranking[0]
    );
    assert_eq!(advice.running, None);
    // Ranked: success tiers first (rows whose success intervals overlap are a tie), then
    // more protection, then p99.
    for w in advice.ranking.windows(2) {
        let k = |r: &advise::Ranked| (r.tier, std::cmp::Reverse(r.protection));
        assert!(k(&w[0]) <= k(&w[1]), "{:?} then {:?}", w[0], w[1]);
    }
    assert_eq!(
        advice.tied,
        advice.ranking.iter().filter(|r| r.tier == 0).count()
    );
}

#[test]
fn per_endpoint_scenarios_are_validated_and_their_failure_mix_holds() {
    let text = |extra: &str| {
        format!(
            "requests = 20000\nreplications = 4\n[load]\nkind = \"open\"\nrate = 100.0\n[[clusters]]\nservers = 2\n{extra}\n[[clusters.endpoints]]\nname = \"a\"\n[[clusters.endpoints]]\nname = \"b\"\nfailures = [{{ share = 0.3, failure = {{ mode = \"fail-fast\", after = \"0s\" }} }}, {{ share = 0.1, failure = {{ mode = \"hang\" }} }}]\n"
        )
    };
    // Round-robin: half the calls go to b, which fails 40 % of them: success 0.8.
    let sc = Scenario::from_toml_str(&text(""), "mix.toml").unwrap();
    let r = keel_model::sim::run(&sc).unwrap();
    assert!(
        r.ci95[0] <= 0.8 && 0.8 <= r.ci95[1],
        "{} {:?}",
        r.success,
        r.ci95
    );
    let e = Scenario::from_toml_str(&text("failed = 1"), "mix.toml").unwrap_err();
    assert!(e.to_string().contains("failed must be 0"), "{e}");
    let three = text("").replace("servers = 2", "servers = 3");
    let e = Scenario::from_toml_str(&three, "mix.toml").unwrap_err();
    assert!(e.to_string().contains("one per server"), "{e}");
    let over = text("").replace("share = 0.1", "share = 0.8");
    let e = Scenario::from_toml_str(&over, "mix.toml").unwrap_err();
    assert!(e.to_string().contains("more than 1"), "{e}");
}

#[test]
fn endpoints_configured_but_never_tried_stay_in_the_settings_with_a_note() {
    let model = fit(&log_text(&truth(true, 3_000)), &FitOptions::default()).unwrap();
    let running = advise::RunningConfig {
        balancer: keel_balance::BalancerConfig::new(keel_balance::StrategyKind::RoundRobin),
        retry_attempts: 0,
        retry_budget: keel_balance::RetryBudgetConfig::default(),
        health_check: None,
        per_try_timeout: Duration::from_secs(1),
        weights: vec![("10.0.0.1:80".into(), 1), ("10.0.0.9:80".into(), 3)],
    };
    let mut opts = ScenarioOptions::for_model(&model);
    opts.requests = 500;
    opts.replications = 2;
    let advice = advise::advise(&model, &opts, Some(&running), "test.log", &|_| {}).unwrap();
    // The running configuration is round-robin without protections: one of the rows.
    let r = &advice.ranking[advice.running.unwrap()];
    assert_eq!(
        (r.strategy.as_str(), r.protections.as_str()),
        ("round-robin", "none")
    );
    for row in &advice.ranking {
        assert!(
            row.cluster_toml
                .contains("{ address = \"10.0.0.9:80\", weight = 3 }"),
            "{}",
            row.cluster_toml
        );
        // The model's three endpoints, no more (the unseen one is not simulated).
        assert_eq!(row.pick_shares.len(), 3);
    }
    assert!(
        advice.model.notes.iter().any(|n| n.contains("10.0.0.9:80")),
        "{:?}",
        advice.model.notes
    );
}
