//! `keel analyze` as a user runs it: the built binary, its JSON, its exit codes, its sweep files.

use std::path::PathBuf;
use std::process::{Command, Output};

fn keel(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .arg("analyze")
        .args(args)
        .output()
        .expect("run keel")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = keel(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.trim().lines().count(),
        1,
        "one JSON object on one line: {text}"
    );
    serde_json::from_str(&text).unwrap()
}

fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

#[test]
fn least_connections_seed_example_json() {
    let v = json(&[
        "--strategy",
        "least-connections",
        "--servers",
        "5",
        "--failed",
        "1",
        "--q",
        "100",
        "--calls",
        "3",
        "--json",
    ]);
    assert_eq!(v["strategy"], "least-connections");
    assert_eq!(v["servers"], 5);
    assert_eq!(v["failed"], 1);
    assert_eq!(v["calls"], 3);
    assert!((num(&v, "p") - 0.2).abs() < 1e-12);
    assert!((num(&v, "q") - 100.0).abs() < 1e-12);
    // Little's law: healthy share 400/401, success (400/401)^3
    let h = 400.0 / 401.0;
    assert!((num(&v, "healthy_pick") - h).abs() < 1e-9, "{v}");
    assert!((num(&v, "success") - f64::powi(h, 3)).abs() < 1e-9, "{v}");
    assert!((num(&v, "success") - 0.992_537).abs() < 1e-6, "{v}");
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    assert_eq!(keys.len(), 8, "no extra fields without --retries: {v}");
    // field order as documented (serde_json's map sorts keys, so look at the raw text)
    let raw = keel(&[
        "--strategy",
        "least-connections",
        "--servers",
        "5",
        "--failed",
        "1",
        "--q",
        "100",
        "--calls",
        "3",
        "--json",
    ]);
    let raw = String::from_utf8(raw.stdout).unwrap();
    let prefix = r#"{"strategy":"least-connections","servers":5,"failed":1,"p":0.2,"q":100.0,"calls":3,"healthy_pick":0.99750"#;
    assert!(raw.starts_with(prefix), "{raw}");
}

#[test]
fn fraction_form_has_null_counts_and_round_robin_gives_0_512() {
    let v = json(&[
        "--strategy",
        "round-robin",
        "--p",
        "0.2",
        "--calls",
        "3",
        "--json",
    ]);
    assert!(v["servers"].is_null() && v["failed"].is_null(), "{v}");
    assert!((num(&v, "healthy_pick") - 0.8).abs() < 1e-9);
    assert!((num(&v, "success") - 0.512).abs() < 1e-9);
}

#[test]
fn retries_add_the_retry_formula() {
    // C(2,2)/C(5,2) = 0.1 per call; 3 calls: 0.9^3
    let v = json(&[
        "--strategy",
        "random",
        "--servers",
        "5",
        "--failed",
        "2",
        "--calls",
        "3",
        "--retries",
        "1",
        "--json",
    ]);
    assert_eq!(v["retries"], 1);
    assert!((num(&v, "retry_call_failure") - 0.1).abs() < 1e-9, "{v}");
    assert!((num(&v, "retry_success") - 0.729).abs() < 1e-9, "{v}");
    assert!(
        (num(&v, "success") - 0.216).abs() < 1e-9,
        "no retries: 0.6^3: {v}"
    );
}

#[test]
fn readable_text_without_json() {
    let out = keel(&[
        "--strategy",
        "least-connections",
        "--servers",
        "5",
        "--failed",
        "1",
        "--q",
        "100",
        "--calls",
        "3",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("0.992537"), "{text}");
    assert!(text.contains("1 in 401"), "{text}");
    assert!(
        text.contains("0.512000"),
        "the round-robin comparison: {text}"
    );
}

#[test]
fn usage_errors_exit_2_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--strategy", "peak-ewma", "--p", "0.2", "--q", "100"],
            "keel simulate",
        ),
        (&["--strategy", "nope", "--p", "0.2"], "least-connections"),
        (&["--strategy", "random", "--p", "1.5"], "[0, 1]"),
        (&["--strategy", "random", "--p", "-0.1"], "[0, 1]"),
        (
            &["--strategy", "least-connections", "--p", "0.2", "--q", "0"],
            "--q",
        ),
        (
            &["--strategy", "least-connections", "--p", "0.2", "--q", "-3"],
            "--q",
        ),
        (
            &["--strategy", "least-connections", "--p", "0.2"],
            "needs --q",
        ),
        (
            &["--strategy", "random", "--p", "0.2", "--calls", "0"],
            "--calls",
        ),
        (
            &["--strategy", "random", "--servers", "5", "--failed", "6"],
            "cannot exceed",
        ),
        (
            &["--strategy", "random", "--p", "0.2", "--retries", "1"],
            "--servers",
        ),
        (&["--sweep", "--q", "0"], "--q"),
        (&["--sweep", "--step", "0.03"], "--step"),
    ];
    for (args, needle) in cases {
        let out = keel(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: `{needle}` not in {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed a result");
    }
}

#[test]
fn sweep_writes_csv_and_charts() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("analyze-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = keel(&[
        "--sweep",
        "--q",
        "0.1,0.5,1,10,100",
        "--calls",
        "1,3,5",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();

    let csv = std::fs::read_to_string(dir.join("f_p.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("strategy,q,k,p,healthy_pick,success"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // 3 strategies x 5 q x 3 k x 101 values of p
    assert_eq!(rows.len(), 3 * 5 * 3 * 101);
    let mut checked = 0;
    for row in &rows {
        assert_eq!(row.len(), 6, "{row:?}");
        let (q, k, p): (f64, i32, f64) = (
            row[1].parse().unwrap(),
            row[2].parse().unwrap(),
            row[3].parse().unwrap(),
        );
        let (h, f): (f64, f64) = (row[4].parse().unwrap(), row[5].parse().unwrap());
        let expected_h = match row[0] {
            "round-robin" | "random" => 1.0 - p,
            "least-connections" => q * (1.0 - p) / (q * (1.0 - p) + p),
            other => panic!("unexpected strategy {other}"),
        };
        assert!((h - expected_h).abs() < 1e-12, "{row:?}");
        assert!((f - h.powi(k)).abs() < 1e-12, "{row:?}");
        checked += 1;
    }
    assert_eq!(checked, 4545);
    let lc_seed = rows
        .iter()
        .find(|r| r[0] == "least-connections" && r[1] == "100" && r[2] == "3" && r[3] == "0.2")
        .expect("the seed example row");
    assert!((lc_seed[5].parse::<f64>().unwrap() - 0.992_537_344).abs() < 1e-9);

    let svgs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "svg"))
        .collect();
    // round-robin/random, least-connections, and a comparison per k
    assert_eq!(svgs.len(), 5, "{svgs:?}");
    for svg in &svgs {
        let text = std::fs::read_to_string(svg).unwrap();
        assert!(
            text.contains("<svg") && text.trim_end().ends_with("</svg>"),
            "{}",
            svg.display()
        );
        assert!(
            text.contains("fraction of failed servers p"),
            "{}",
            svg.display()
        );
        assert!(
            text.contains("request success rate f(p)"),
            "{}",
            svg.display()
        );
        assert!(
            stdout.contains(svg.to_str().unwrap()),
            "path printed: {stdout}"
        );
    }
    let lc = std::fs::read_to_string(dir.join("f_p_least-connections.svg")).unwrap();
    assert!(lc.contains("q = 100, k = 3"), "legend entry per (q, k)");
    let compare = std::fs::read_to_string(dir.join("f_p_compare_k3.svg")).unwrap();
    assert!(
        compare.contains("least-connections, q = 0.1") && compare.contains("round-robin / random")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn overlay_draws_simulated_points_and_compares_them() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("analyze-overlay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The shape `keel simulate --json` prints: one experiment per line.
    let row = |strategy: &str, protections: &str, q: f64, success: f64, ci: [f64; 2]| {
        serde_json::json!({"label": "t", "strategy": strategy, "protections": protections,
            "placement": "server-side", "p": 0.2, "q": q, "k": 3, "success": success, "ci95": ci})
    };
    let e1 = serde_json::json!({"experiment": "e1", "results": [
        row("round-robin", "none", 100.0, 0.511, [0.505, 0.517]),
        row("peak-ewma", "none", 100.0, 0.9, [0.89, 0.91]),
        row("round-robin", "outlier+retry", 100.0, 1.0, [1.0, 1.0]),
    ]});
    let e2 = serde_json::json!({"experiment": "e2", "results": [
        row("least-connections", "none", 100.0, 0.98, [0.979, 0.981]),
    ]});
    let overlay = dir.join("sim.jsonl");
    std::fs::write(&overlay, format!("{e1}\n{e2}\n")).unwrap();
    let out_dir = dir.join("out");
    let out = keel(&[
        "--sweep",
        "--q",
        "100",
        "--calls",
        "3",
        "--out",
        out_dir.to_str().unwrap(),
        "--overlay",
        overlay.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("  e")).collect();
    assert_eq!(
        lines.len(),
        2,
        "the protected and peak-ewma rows are left out: {text}"
    );
    assert!(
        lines[0].contains("e1 round-robin") && lines[0].contains("within the CI"),
        "{text}"
    );
    // analytic 0.99254 lies 0.0115 above the interval's top
    assert!(
        lines[1].contains("e2 least-connections") && lines[1].contains("outside the CI by 0.0115"),
        "{text}"
    );
    let svg = std::fs::read_to_string(out_dir.join("f_p_simulated_k3.svg")).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("<circle"),
        "points drawn"
    );
    assert!(svg.contains("least-connections q = 100, simulated"));

    std::fs::write(&overlay, "not json\n").unwrap();
    let out = keel(&[
        "--sweep",
        "--out",
        out_dir.to_str().unwrap(),
        "--overlay",
        overlay.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sim.jsonl:1"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inference_answers_the_measured_workload() {
    // 150 requests, 6 at a time, 6 groups of 400 + 40 tokens: affinity misses each group once,
    // (150 - 6) x 400 / (150 x 440) = 0.8727 (the measured 0.873).
    let v = json(&[
        "--inference",
        "--groups",
        "6",
        "--clients",
        "6",
        "--requests",
        "150",
        "--json",
    ]);
    assert_eq!(v["use"], "prefix-affinity");
    let aff = num(&v["affinity"], "cached");
    assert!((aff - 144.0 * 400.0 / 66000.0).abs() < 1e-3, "{v}");
    assert!(num(&v["balanced"], "cached") < 0.7, "{v}");
    // One shared prefix: affinity sends everything to one engine for no cache gain.
    let v = json(&["--inference", "--groups", "1", "--load", "0.3", "--json"]);
    assert_eq!(v["use"], "load-balancing");
    assert!((num(&v, "k") - 3.0).abs() < 1e-12, "{v}");
    assert_eq!(v["limit"], 0.0);
    // The text puts the answer first.
    let out = keel(&["--inference", "--groups", "6", "--load", "0.5"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with("use prefix-affinity: 0.909 of prompt tokens from cache against"),
        "{text}"
    );
    // Pool flags without --inference are a usage error.
    let out = keel(&["--groups", "6"]);
    assert_eq!(out.status.code(), Some(2));
}
