//! `keel lab --quick --experiments e8,e9` end to end (a test binary of its own, so that it does
//! not share the machine with the other lab test): real sockets on loopback, open-loop load.

use std::process::Command;

/// E8 and E9 in their short form on real sockets (about 16 s): what the backends served is
/// measured and is what the simulation and the closed form are fed, random's closed form
/// (M/G/1 per server) is held to the measured run, least-request moves calls off a server
/// slowed 5x and back, and the report draws both.
/// Runs the quick E8 and E9 into `out_dir`; returns the JSON document.
fn run_lab(out_dir: &std::path::Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "lab",
            "--quick",
            "--json",
            "--quiet",
            "--experiments",
            "e8,e9",
        ])
        .args(["--strategies", "random,least-request", "--out"])
        .arg(out_dir)
        .output()
        .expect("run keel lab");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "keel lab failed: {stderr}");
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

/// Send lag (99th percentile, and the longest) under which a row's speed checks run (see
/// `calm` below).
const CALM_LAG_P99_MS: f64 = 20.0;
const CALM_LAG_MAX_MS: f64 = 100.0;

/// Whether a row ran calm enough for its speed checks.
fn is_calm(r: &serde_json::Value) -> bool {
    let lag = |k: &str| r[k].as_f64().unwrap_or(f64::INFINITY);
    lag("send_lag_p99_ms") < CALM_LAG_P99_MS && lag("send_lag_max_ms") < CALM_LAG_MAX_MS
}

/// True when at least one E8 or E9 row ran calm enough for its speed checks.
fn any_calm(v: &serde_json::Value) -> bool {
    ["tail_rows", "reaction_rows"].iter().any(|k| {
        v[*k]
            .as_array()
            .is_some_and(|rows| rows.iter().any(is_calm))
    })
}

#[test]
fn quick_e8_e9_measure_what_was_served() {
    let out_dir = std::env::temp_dir().join(format!("keel-lab-e8-test-{}", std::process::id()));
    let mut v = run_lab(&out_dir);
    if !any_calm(&v) {
        eprintln!("every E8/E9 row stalled (send lag p99 >= {CALM_LAG_P99_MS} ms or max >= {CALM_LAG_MAX_MS} ms): running once more");
        v = run_lab(&out_dir);
    }
    // A skipped check is said, never passed in silence; in CI (KEEL_CI set by .ci/run) a run
    // whose every speed check was skipped twice fails.
    if !any_calm(&v) {
        eprintln!(
            "SKIPPED, not passed: every speed check of E8 and E9 (twice): the machine stalled"
        );
        assert!(
            std::env::var_os("KEEL_CI").is_none(),
            "every E8/E9 speed check was skipped in two runs: the machine stalled"
        );
    }
    assert_eq!(
        v["rows"].as_array().unwrap().len(),
        0,
        "E1-E6 only when asked"
    );
    let tail = v["tail_rows"].as_array().expect("tail_rows");
    assert_eq!(tail.len(), 2, "{tail:?}");
    let f = |r: &serde_json::Value, path: &[&str]| -> f64 {
        let mut x = r;
        for p in path {
            x = &x[*p];
        }
        x.as_f64().unwrap_or_else(|| panic!("{path:?} in {r}"))
    };
    // A machine that stalls (other work on shared cores) stalls the backends' timers and the
    // load generator alike, and the run says so: its send lag. What depends on the machine's
    // speed is checked only on a row whose arrivals were held up less than 20 ms at the 99th
    // percentile and 100 ms at the most. A CI run that shared the machine with other test
    // binaries had its served mean outside 9.5-11 ms with the p99 lag under 20 ms, so this
    // binary runs alone in CI (scripts/test-lanes.py); alone, on this 2-core machine, the lab
    // holds its own generator up 20-63 ms at the most in 8 rows of 9 (p99 2-31 ms) with every
    // served mean 10.2-10.5 ms and SCV 0.96-1.03: a limit of 20 ms on the longest skipped the
    // checks of most runs, and two runs in a row that skip them all fail in CI (likely why a
    // CI run failed here: its log kept no message).
    let calm = |r: &serde_json::Value| {
        let calm = is_calm(r);
        if !calm {
            eprintln!(
                "{}: send lag p99 {:.1} ms, max {:.1} ms, speed checks skipped",
                r["strategy"],
                f(r, &["send_lag_p99_ms"]),
                f(r, &["send_lag_max_ms"]),
            );
        }
        calm
    };
    for r in tail {
        let served = f(r, &["served_ms", "mean"]);
        let scv = f(r, &["served_ms", "scv"]);
        if calm(r) {
            // Exponential 10 ms asked, timed by the precise timer: served within 10 % of it
            // (a few thousand draws: the sample mean alone varies by 2-3 %), as variable as
            // an exponential (SCV 1 +- 0.25).
            assert!((9.5..11.0).contains(&served), "served {served} ms: {r}");
            assert!((0.75..1.25).contains(&scv), "SCV {scv}: {r}");
        }
        assert_eq!(r["comparisons"].as_array().unwrap().len(), 3);
        assert!(r["measured_cdf"].as_array().unwrap().len() > 50);
        assert!(r["simulated_cdf"].as_array().unwrap().len() > 50);
        // The offered load is what was served: the measured rate x the served mean.
        let load = f(r, &["load_offered"]);
        let want = f(r, &["rate"]) * served / 1e3 / 10.0;
        assert!((load - want).abs() < 1e-9, "{load} {want}");
        for q in ["p50", "p99"] {
            let m = f(r, &["measured", q]);
            let ci = &r["measured_ci95"][q];
            assert!(ci[0].as_f64().unwrap() <= m && m <= ci[1].as_f64().unwrap());
        }
    }
    let random = tail.iter().find(|r| r["strategy"] == "random").unwrap();
    // The closed form is fed the measured service times: its mean is Pollaczek-Khinchine's,
    // and M/M/1's at the measured mean and load is close to it (the service is exponential).
    let model = f(random, &["model", "mean"]);
    assert!(
        (model / f(random, &["model_pk_mean"]) - 1.0).abs() < 0.01,
        "{random}"
    );
    assert!(
        (model / f(random, &["mm1", "mean"]) - 1.0).abs() < 0.15,
        "{random}"
    );
    // A 3 s run at load 0.85 is short for M/M/1's long memory: its median within 30 % of the
    // closed form's, the simulation's (fed the same measurements) within 10 % of it.
    let p50 = f(random, &["measured", "p50"]);
    let model_p50 = f(random, &["model", "p50"]);
    assert!(
        (p50 / model_p50 - 1.0).abs() < 0.3,
        "measured {p50}, model {model_p50}"
    );
    let sim_p50 = f(random, &["simulated", "p50"]);
    assert!(
        (sim_p50 / model_p50 - 1.0).abs() < 0.1,
        "sim {sim_p50}, model {model_p50}"
    );
    let lr = tail
        .iter()
        .find(|r| r["strategy"] == "least-request")
        .unwrap();
    assert!(lr["model"].is_null(), "no closed form for least-request");
    assert!(f(lr, &["measured", "p99"]) < f(random, &["measured", "p99"]));

    let e9 = v["reaction_rows"].as_array().expect("reaction_rows");
    assert_eq!(e9.len(), 1);
    let r = &e9[0];
    assert_eq!(r["strategy"], "least-request");
    // 5x slower while slow, and least-request moves calls off it (fair share 0.1).
    if calm(r) {
        let slowed = f(r, &["slowed_served_ms", "mean"]) / f(r, &["served_ms", "mean"]);
        assert!((3.5..7.0).contains(&slowed), "slowed {slowed}x: {r}");
    }
    assert!(f(r, &["measured", "share_during"]) < 0.075, "{r}");
    assert!(f(r, &["simulated", "share_during"]) < 0.075, "{r}");
    assert!(f(r, &["measured", "share_before"]) > 0.07, "{r}");
    assert!(r["measured_series"].as_array().unwrap().len() > 20);

    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    assert!(html.contains("<h2>E8: tail latency under open-loop load</h2>"));
    assert!(html.contains("<h2>E9: reaction to a server that slows down</h2>"));
    // One overview, one chart per E8 row, one per E9 row.
    assert_eq!(html.matches("<svg").count(), 4, "charts");
    let _ = std::fs::remove_dir_all(&out_dir);
}
