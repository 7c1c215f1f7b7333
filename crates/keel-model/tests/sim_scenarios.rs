//! Scenario files: the documented examples load and run; bad input is refused with the key named.

use std::path::Path;

use keel_model::sim::{self, Scenario};

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
