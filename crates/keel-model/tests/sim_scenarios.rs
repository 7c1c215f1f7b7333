//! Scenario files: the documented examples load and run; bad input is refused with the key named.

use std::path::Path;

use keel_model::sim::{self, Discipline, HedgeDelay, Scenario};

fn scenario_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scenarios")
}

#[test]
fn every_example_scenario_loads_and_runs() {
    let mut seen = 0;
    for entry in std::fs::read_dir(scenario_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut sc = Scenario::from_toml_str(&text, &path.display().to_string())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // A short run of each, to show it really simulates.
        sc.requests = (sc.requests / 50).max(100);
        sc.replications = 2;
        let r = sim::run(&sc).unwrap();
        assert_eq!(r.requests, 2 * sc.requests, "{}", path.display());
        assert!(r.success > 0.0 && r.success <= 1.0, "{}", path.display());
        seen += 1;
    }
    assert!(seen >= 3, "expected the example scenarios, found {seen}");
}

#[test]
fn source_example_predicts_the_closed_form() {
    let text = std::fs::read_to_string(scenario_dir().join("source-example.toml")).unwrap();
    let sc = Scenario::from_toml_str(&text, "source-example.toml").unwrap();
    assert_eq!(sc.clusters.len(), 3);
    let a = sc.analytic_success().unwrap();
    assert!((a - (400.0f64 / 401.0).powi(3)).abs() < 1e-12, "{a}");
}

#[test]
fn bad_scenarios_are_refused_with_the_key_named() {
    let base = "requests = 10\n[load]\nkind = \"closed\"\nclients = 2\n[[clusters]]\nservers = 3\n";
    assert!(Scenario::from_toml_str(base, "ok.toml").is_ok());
    let cases = [
        (format!("{base}failed = 4\n"), "failed"),
        (format!("{base}colour = 1\n"), "colour"),
        (
            format!("{base}failure = {{ mode = \"error\", probability = 2.0 }}\n"),
            "probability",
        ),
        (format!("{base}failure = {{ mode = \"melt\" }}\n"), "melt"),
        (base.replace("requests = 10", "requests = 0"), "requests"),
        (base.replace("clients = 2", "clients = 0"), "clients"),
        (
            format!("{base}[clusters.balancer]\nstrategy = \"fastest\"\n"),
            "fastest",
        ),
        (
            format!("{base}capacity = {{ concurrency = 0 }}\n"),
            "capacity.concurrency",
        ),
        (
            format!("{base}capacity = {{ concurrency = 1, discipline = \"lifo\" }}\n"),
            "lifo",
        ),
        (
            format!("{base}antagonist = {{ servers = 4, factor = 3.0, period = \"1s\" }}\n"),
            "antagonist.servers",
        ),
        (
            format!("{base}antagonist = {{ servers = 1, factor = 0.5, period = \"1s\" }}\n"),
            "antagonist.factor",
        ),
        (
            format!("{base}slowdown = {{ factor = 5.0, start = \"2s\", end = \"1s\" }}\n"),
            "slowdown.end",
        ),
        (
            base.replace("[load]", "[hedge]\ndelay = \"p100\"\n[load]"),
            "quantile",
        ),
        (
            base.replace("[load]", "[hedge]\ndelay = \"soon\"\n[load]"),
            "soon",
        ),
        (
            base.replace("[load]", "[hedge]\ndelay = \"p95\"\nmax = 2\n[load]"),
            "hedge.max",
        ),
    ];
    for (text, key) in cases {
        let err = Scenario::from_toml_str(&text, "bad.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(key) && err.contains("bad.toml"),
            "{key}: {err}"
        );
    }
}

#[test]
fn open_loop_client_side_health_checks_and_retries_run() {
    let text = r#"
        requests = 3000
        replications = 2
        placement = "client-side"
        call_gap = "2ms"
        [load]
        kind = "open"
        rate = 2000.0
        clients = 4
        [retry]
        max_retries = 1
        [health_check]
        interval = "200ms"
        [[clusters]]
        servers = 4
        failed = 2
        calls = 2
        failure = { mode = "hang" }
        [clusters.balancer]
        strategy = "random"
    "#;
    let sc = Scenario::from_toml_str(text, "inline").unwrap();
    let r = sim::run(&sc).unwrap();
    assert_eq!(r.requests, 6000);
    // Without protections random would give (1/2)^2 = 0.25; health checks remove the hung
    // servers within two probes and retries cover the calls before that.
    assert!(r.success > 0.9, "{r:?}");
    assert!(r.failed_pick_share < 0.1, "{r:?}");
    assert_eq!(r.protections, "health-check+retry");
}

/// As users first write it: a cluster of 100 servers with `capacity = { concurrency = 1 }`, and
/// the optional processor-sharing discipline, load as written.
#[test]
fn capacity_keys_load_as_documented() {
    let text = r#"
        requests = 2000
        [load]
        kind = "open"
        rate = 5000.0
        [hedge]
        delay = "p99.9"
        [[clusters]]
        servers = 100
        latency = { dist = "exponential", mean = "10ms" }
        capacity = { concurrency = 1 }   # at most this many calls in service per server; the rest
                                         # wait in FIFO order. Absent: unlimited (today's model).
    "#;
    let sc = Scenario::from_toml_str(text, "inline").unwrap();
    let c = &sc.clusters[0];
    let cap = c.capacity.as_ref().unwrap();
    assert_eq!((cap.concurrency, cap.discipline), (1, Discipline::Fifo));
    let HedgeDelay::Quantile(q) = sc.hedge.as_ref().unwrap().delay else {
        panic!("p99.9 is a quantile")
    };
    assert!((q - 0.999).abs() < 1e-12, "{q}");
    assert_eq!(sc.hedge.as_ref().unwrap().budget_percent, 5.0);
    assert!((sc.offered_load().unwrap() - 0.5).abs() < 1e-12);
    let ps = text.replace(
        "concurrency = 1 }",
        "concurrency = 1, discipline = \"ps\" }",
    );
    let sc = Scenario::from_toml_str(&ps, "inline").unwrap();
    assert_eq!(
        sc.clusters[0].capacity.as_ref().unwrap().discipline,
        Discipline::Ps
    );
    let r = sim::run(&sc).unwrap();
    assert!((r.load.unwrap() - 0.5).abs() < 1e-12);
    assert_eq!(r.protections, "hedge");
    assert!(r.latency_ms.p50 > 0.0 && r.latency_ms.p50 <= r.latency_ms.p99);
    assert!(r.latency_ms.p99 <= r.latency_ms.p999);
}
