//! `keel simulate` end to end: JSON shape and numbers for a preset, scenario files, exit codes.

use std::process::Command;

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .expect("keel runs")
}

#[test]
fn preset_e1_json() {
    let out = keel(&[
        "simulate",
        "--preset",
        "e1",
        "--json",
        "--quiet",
        "--replications",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object: {text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["experiment"], "e1");
    assert!(v["calls_per_second"].as_f64().unwrap() > 0.0);
    let results = v["results"].as_array().unwrap();
    let strategies: Vec<&str> = results
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(strategies, ["round-robin", "random"]);
    for r in results {
        assert_eq!(r["protections"], "none");
        assert_eq!(r["requests"], 100_000);
        assert_eq!(r["replications"], 4);
        let success = r["success"].as_f64().unwrap();
        let ci: Vec<f64> = r["ci95"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(ci[0] <= success && success <= ci[1]);
        assert!((success - 0.512).abs() < 0.01, "{success}");
        assert!((r["analytic_success"].as_f64().unwrap() - 0.512).abs() < 1e-12);
        assert!((r["failed_pick_share"].as_f64().unwrap() - 0.2).abs() < 0.01);
        // Servers without a capacity: no offered-load figure; a request takes three calls of
        // 10 ms on average, or stops at a hung server's 1 s timeout (half the requests do).
        assert!(r["load"].is_null());
        let l = &r["latency_ms"];
        let (p50, p99, p999) = (
            l["p50"].as_f64().unwrap(),
            l["p99"].as_f64().unwrap(),
            l["p999"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p50 <= p99 && p99 <= p999, "{l}");
        assert!((999.0..1100.0).contains(&p99), "p99 at the timeout: {l}");
        assert_eq!(r["extra_calls"], 0.0);
    }
}

#[test]
fn scenario_file_is_deterministic_for_a_seed_and_has_a_table() {
    let dir = std::env::temp_dir().join(format!("keel-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("small.toml");
    std::fs::write(
        &file,
        "name = \"small\"\nrequests = 2000\nreplications = 2\n[load]\nkind = \"closed\"\nclients = 20\n\
         [[clusters]]\nservers = 5\nfailed = 1\ncalls = 3\nfailure = { mode = \"hang\" }\n\
         latency = { dist = \"exponential\", mean = \"10ms\" }\n\
         [clusters.balancer]\nstrategy = \"least-connections\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let results = |seed: &str| {
        let out = keel(&["simulate", "--scenario", f, "--json", "--seed", seed]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["experiment"], "small");
        v["results"].clone()
    };
    assert_eq!(results("5"), results("5"));
    assert_ne!(results("5"), results("6"));
    let out = keel(&["simulate", "--scenario", f]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("least-connections") && table.contains("calls/s"),
        "{table}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_input_exits_with_code_2() {
    let dir = std::env::temp_dir().join(format!("keel-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "requests = 10\n[load]\nkind = \"closed\"\nclients = 1\n[[clusters]]\nservers = 2\nfailed = 3\n").unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["simulate", "--preset", "e9"], "unknown preset"),
        (&["simulate"], "--preset"),
        (
            &["simulate", "--preset", "e1", "--replications", "0"],
            "replications",
        ),
        (&["simulate", "--scenario", bad.to_str().unwrap()], "failed"),
        (
            &["simulate", "--scenario", "/nonexistent/keel.toml"],
            "cannot read",
        ),
    ];
    for (args, needle) in cases {
        let out = keel(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
