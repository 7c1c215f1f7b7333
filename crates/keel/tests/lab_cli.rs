//! `keel lab --quick` end to end: real sockets on loopback, the model's thresholds, and a report
//! that opens with its answer.

use std::process::Command;

/// The columns of a terminal line.
fn columns(line: &str) -> usize {
    line.chars().count()
}

#[test]
fn quick_lab_reproduces_e1_e2_e6_over_real_sockets() {
    // CI runs the README's `keel lab --quick` once, before the tests, and names its output
    // here (its stdout in stdout.txt); elsewhere the test runs it.
    let given = std::env::var_os("KEEL_LAB_QUICK_OUT").map(std::path::PathBuf::from);
    let out_dir = given.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("keel-lab-test-{}", std::process::id()))
    });
    let stdout = match &given {
        Some(dir) => std::fs::read_to_string(dir.join("stdout.txt")).expect("stdout.txt"),
        None => {
            let out = Command::new(env!("CARGO_BIN_EXE_keel"))
                .args(["lab", "--quick", "--quiet", "--out"])
                .arg(&out_dir)
                .output()
                .expect("run keel lab");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "keel lab failed: {stderr}");
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("results.json")).unwrap())
            .expect("results.json");
    let rows = v["rows"].as_array().expect("rows");
    answer_comes_first(&v, &stdout, &out_dir);
    let of = |e: &str| -> Vec<&serde_json::Value> {
        rows.iter().filter(|r| r["experiment"] == e).collect()
    };
    // E1: round-robin and random, failing fast with a 503 and with a 500 (`server-error`),
    // their requests stopping at the first failed call as applications' do; the same two with
    // 24 clients that make all 3 calls, round-robin again with 2 such clients; ring-hash with
    // one key per request.
    let e1 = of("e1");
    assert_eq!(e1.len(), 8);
    let app: Vec<_> = e1
        .iter()
        .filter(|r| r["client"] == "stops at first failure" && r["key_share"].is_null())
        .collect();
    assert_eq!(app.len(), 4);
    // 0.03 is 3.3 standard errors of 3,000 requests at 0.512 (0.0091), and random's rows move
    // with the failed server's drawn share (about 1 standard error of it more).
    for r in app {
        let m = r["measured"].as_f64().unwrap();
        assert!((m - 0.512).abs() <= 0.03, "E1 {}: {m}", r["strategy"]);
        assert!((r["analytic"].as_f64().unwrap() - 0.512).abs() < 1e-12);
        let ci = r["measured_ci95"].as_array().unwrap();
        assert!(ci[0].as_f64().unwrap() <= m && m <= ci[1].as_f64().unwrap());
    }
    for r in e1.iter().filter(|r| r["client"] == "all calls") {
        // Success is 1 - k s / m of the row's own histogram of failed calls per request (an
        // identity, to rounding), between 1 - k p = 0.4 (no request fails twice) and
        // independent calls' 0.512, with 3.3 standard errors (0.03) either side.
        let h: Vec<u64> = r["failed_calls_per_request"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect();
        let requests: u64 = h.iter().sum();
        let failed: u64 = h.iter().skip(1).sum();
        assert_eq!(requests, r["requests"].as_u64().unwrap());
        let m = r["measured"].as_f64().unwrap();
        assert!((m - (1.0 - failed as f64 / requests as f64)).abs() < 1e-12);
        assert!(
            (0.37..=0.542).contains(&m),
            "E1 all calls {}: {m}",
            r["strategy"]
        );
        if r["strategy"] == "round-robin" {
            // The closed form at the row's concurrency (lab/rotation.rs): 2 clients keep the
            // rotation in step, a request's 3 calls land on 3 distinct servers, 1 - 3/5; 24
            // interleave, independent calls' 0.8^3. It must lie in the measured interval, or
            // the row names its mechanism with m, failed calls per failed request.
            let clients = r["concurrency"].as_u64().unwrap();
            let form = r["analytic"].as_f64().unwrap();
            let expected = if clients <= 2 { 0.4 } else { 0.512 };
            assert!((form - expected).abs() < 1e-12, "{r}");
            let ci = r["measured_ci95"].as_array().unwrap();
            let inside = ci[0].as_f64().unwrap() <= form && form <= ci[1].as_f64().unwrap();
            eprintln!("E1 round-robin, all calls x{clients}: {m} {ci:?}, closed form {form:.4}");
            if !inside {
                assert!(
                    r["explanation"]
                        .as_str()
                        .unwrap()
                        .contains("failed calls per failed request"),
                    "{r}"
                );
            }
        }
    }
    let in_step: Vec<_> = e1
        .iter()
        .filter(|r| r["client"] == "all calls" && r["concurrency"] == 2)
        .collect();
    assert_eq!(in_step.len(), 1, "round-robin with 2 all-calls clients");
    let hashed: Vec<_> = e1.iter().filter(|r| !r["key_share"].is_null()).collect();
    assert_eq!(hashed.len(), 1);
    for r in hashed {
        // One key per request: success is 1 minus the failed server's share of the keys. The
        // run's 1,500 keys are a sample of the key space the share is measured over (100,000
        // keys): their share moves by sqrt(0.2 x 0.8 / 1500) = 0.010, and 0.04 is 4 of those.
        let share = r["key_share"].as_f64().unwrap();
        let m = r["measured"].as_f64().unwrap();
        assert!((r["analytic"].as_f64().unwrap() - (1.0 - share)).abs() < 1e-12);
        assert!(
            (m - (1.0 - share)).abs() <= 0.04,
            "ring-hash {m} vs 1 - {share}"
        );
        assert!(
            (0.1..=0.3).contains(&share),
            "a ring of 5 gives about 1/5: {share}"
        );
    }
    let e2 = of("e2");
    assert_eq!(e2.len(), 1);
    assert_eq!(e2[0]["strategy"], "least-connections");
    // README's 0.992 is the closed form at q = 97.6 (the 400 ms timeout over a 4.1 ms call);
    // the measurement sits below it by the hung server's in-flight count building up first,
    // which the simulation (keel-balance's own least-connections) models. So: the closed form
    // exactly, and the measurement within 4 standard deviations of the simulation (of their
    // difference, each from its own 95 % interval: about 0.0025 at 1,500 requests, so 0.01;
    // 4 of them fail a true agreement once in 16,000 runs).
    let r = e2[0];
    let m = r["measured"].as_f64().unwrap();
    let model = r["analytic"].as_f64().expect("E2 has a model value");
    assert!((model - 0.9924).abs() < 5e-5, "E2 closed form {model}");
    let sd =
        |ci: &serde_json::Value| (ci[1].as_f64().unwrap() - ci[0].as_f64().unwrap()) / (2.0 * 1.96);
    let sim = r["simulated"].as_f64().unwrap();
    let sd_diff = sd(&r["measured_ci95"]).hypot(sd(&r["simulated_ci95"]));
    eprintln!(
        "E2: measured {m}, simulated {sim}, closed form {model}, sd of difference {sd_diff:.4}"
    );
    assert!(
        (m - sim).abs() <= 4.0 * sd_diff && m >= 0.9,
        "E2 least-connections measured {m}, simulated {sim}: {}",
        r["explanation"]
    );
    let e6 = of("e6");
    assert!(e6.len() >= 8, "E6 covers strategies x failure modes");
    for r in e6 {
        assert_eq!(r["protections"], "outlier+retry+health");
        let m = r["measured"].as_f64().unwrap();
        // A fast 500 costs the failures before its ejection (it is not retried by default):
        // the threshold's (3 here, 5 with keel's defaults) and the calls already sent to it;
        // 4-11 failed requests a row measured (docs/reliability.md), so 0.99 (10 of 1,000, 20
        // of 2,000) is about twice the most seen. Every other failure mode is retried on
        // another server of five within the budget: no request may fail (README's 1.000).
        let goal = if r["failure_mode"] == "server-error" {
            0.99
        } else {
            1.0
        };
        assert!(
            m >= goal,
            "E6 {} {}: {m}: {}",
            r["strategy"],
            r["failure_mode"],
            r["explanation"]
        );
        assert!(r["requests"].as_u64().unwrap() >= 1000);
    }
    // What a user writes first (only endpoints; one dead of three) keeps 0.999 with keel's
    // default protections.
    let e6b = of("e6b");
    assert!(e6b.len() >= 4, "E6B covers strategies x failure modes");
    for r in e6b {
        assert_eq!(r["protections"], "keel defaults");
        let m = r["measured"].as_f64().unwrap();
        // As E6 (the 500's ejection costs 5 to 11 of 2,000 here), and no failure otherwise.
        let goal = if r["failure_mode"] == "server-error" {
            0.99
        } else {
            1.0
        };
        assert!(
            m >= goal,
            "E6B {} {}: {m}",
            r["strategy"],
            r["failure_mode"]
        );
    }
    // A row agrees with the model exactly when the model is inside the measured interval, and
    // a row that does not says by how many standard errors.
    for r in rows {
        let Some(a) = r["analytic"].as_f64() else {
            assert!(r["model"].is_null());
            continue;
        };
        let ci = r["measured_ci95"].as_array().unwrap();
        let inside = ci[0].as_f64().unwrap() <= a && a <= ci[1].as_f64().unwrap();
        assert_eq!(r["model"]["agrees"].as_bool(), Some(inside), "{r}");
        if !inside {
            let why = r["explanation"].as_str().unwrap();
            assert!(why.contains("standard errors"), "{why}");
        }
    }
    // "Where they part, the report names why" (README): every row that departs from the model
    // or the simulation has `explained` true (a mechanism whose condition holds on the row's
    // own numbers), counted from the field, not from words every row carries.
    let departing: Vec<_> = rows
        .iter()
        .filter(|r| r["model"]["agrees"] == false || r["simulation"]["agrees"] == false)
        .collect();
    let unexplained: Vec<String> = departing
        .iter()
        .filter(|r| r["explained"] != true)
        .map(|r| {
            format!(
                "{} {} {} {} {}: {}",
                r["experiment"],
                r["strategy"],
                r["failure_mode"],
                r["protections"],
                r["client"],
                r["explanation"]
            )
        })
        .collect();
    eprintln!(
        "{} rows, {} departing, {} unexplained",
        rows.len(),
        departing.len(),
        unexplained.len()
    );
    assert!(unexplained.is_empty(), "unexplained: {unexplained:#?}");
    // A self-contained page with charts and the table.
    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    assert!(
        html.contains("<svg") && html.contains("<table"),
        "charts and table"
    );
    assert!(!html.contains("src=\"http"), "self-contained");
    // E6's chart has one labelled category per failure mode, and E6 is explained once.
    for mode in ["hang", "fail-fast", "refuse", "reset"] {
        assert!(
            html.contains(&format!("\n{mode}\n</text>")),
            "E6 axis label {mode}"
        );
    }
    let e6_section = html.split("<h3>E6</h3>").nth(1).expect("an E6 section");
    assert!(
        !e6_section.contains("<li>"),
        "E6 is one paragraph, not one per row"
    );
    if given.is_none() {
        let _ = std::fs::remove_dir_all(&out_dir);
    }
}

/// The terminal output and the page open with the run's answer: a strategy, its protections
/// and a margin with its interval that results.json holds, and that its rows bear out; every
/// terminal line fits 100 columns.
fn answer_comes_first(v: &serde_json::Value, stdout: &str, out_dir: &std::path::Path) {
    for line in stdout.lines() {
        assert!(columns(line) <= 100, "{} columns: {line}", columns(line));
    }
    let answer = &v["answer"][0];
    assert_eq!(answer["experiment"], "all", "{answer}");
    let strategy = answer["strategy"].as_str().unwrap();
    let protections = answer["protections"].as_str().unwrap();
    // A protected setting wins: the lab's own protections or keel's defaults (the same three
    // protections, E6B), whichever measured higher in this run.
    assert!(
        ["outlier+retry+health", "keel defaults"].contains(&protections),
        "{answer}"
    );
    let margin = answer["margin"].as_f64().expect("a margin");
    let ci = answer["margin_ci95"].as_array().expect("its interval");
    let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
    assert!(lo <= margin && margin <= hi, "{answer}");
    // The margin is what two rows measured: the best strategy with protections against the
    // best without them, in the same failure mode.
    let rows = v["rows"].as_array().unwrap();
    let value = answer["value"].as_f64().unwrap();
    let versus = answer["versus_value"].as_f64().unwrap();
    assert!((margin - (value - versus)).abs() < 1e-12, "{answer}");
    assert!(rows.iter().any(|r| r["strategy"] == strategy
        && r["protections"] == protections
        && r["measured"].as_f64() == Some(value)));
    // `versus` is the best row without protections in the failure mode the answer compares
    // (the one where that best is lowest: fail-fast, or the fast 500 `server-error`, ...).
    let best_bare = |mode: &str| {
        rows.iter()
            .filter(|r| r["protections"] == "none" && r["placement"] == "server-side")
            .filter(|r| r["client"] == "stops at first failure" && r["p"] == 0.2 && r["k"] == 3)
            .filter(|r| r["failure_mode"] == mode)
            .filter_map(|r| r["measured"].as_f64())
            .fold(0.0, f64::max)
    };
    // One margin per failure mode measured with the recommended protections, each against the
    // best row without them in that mode (never a row against itself), and the headline's
    // margin is the one the protections win most surely (the largest lower bound).
    let by = answer["by_failure"].as_array().expect("by_failure");
    assert!(!by.is_empty(), "{answer}");
    let mut top = f64::NEG_INFINITY;
    for g in by {
        let mode = g["failure_mode"].as_str().unwrap();
        let (value, versus_value) = (
            g["value"].as_f64().unwrap(),
            g["versus_value"].as_f64().unwrap(),
        );
        assert_eq!(versus_value, best_bare(mode), "{g}");
        assert!((g["margin"].as_f64().unwrap() - (value - versus_value)).abs() < 1e-12);
        assert!(
            g["versus"]
                .as_str()
                .unwrap()
                .ends_with("without protections"),
            "{g}"
        );
        assert!(rows.iter().any(|r| r["failure_mode"] == mode
            && r["protections"] == protections
            && r["strategy"] == g["strategy"]
            && r["measured"].as_f64() == Some(value)));
        top = top.max(g["margin_ci95"][0].as_f64().unwrap());
    }
    assert_eq!(lo, top, "{answer}");
    let modes: Vec<&str> = rows
        .iter()
        .filter(|r| r["protections"] == "none")
        .filter_map(|r| r["failure_mode"].as_str())
        .collect();
    assert!(modes.iter().any(|m| best_bare(m) == versus), "{answer}");
    assert!(lo > 0.3, "protections win by far more than noise: {answer}");
    // The terminal says it first: the answer's lines come before any table.
    let head: Vec<&str> = stdout.lines().take(10).collect();
    assert_eq!(head[0], "What this run shows:");
    // Wrapped lines joined back into words.
    let head = head
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let margin_text = format!("{margin:+.4} [{lo:+.4}, {hi:+.4}]");
    for needle in [strategy, protections, margin_text.as_str()] {
        assert!(
            head.contains(needle),
            "{needle:?} not in the first lines:\n{stdout}"
        );
    }
    assert!(
        stdout.find("What this run shows").unwrap() < stdout.find("exp ").expect("the table"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&out_dir.display().to_string()),
        "says where"
    );
    // So does the page: its first section, before the method and the settings.
    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    let first = html
        .split("<section id=\"answer\">")
        .nth(1)
        .and_then(|s| s.split("</section>").next())
        .expect("an answer section");
    assert!(html.find("id=\"answer\"") < html.find("<h2>Method"));
    assert!(html.find("id=\"answer\"") < html.find("<h2>Settings"));
    for needle in [
        "What this run shows",
        strategy,
        protections,
        margin_text.as_str(),
    ] {
        assert!(
            first.contains(needle),
            "{needle:?} not in the first section: {first}"
        );
    }
}

#[test]
fn runs_without_out_write_their_own_directories() {
    let cwd = std::env::temp_dir().join(format!("keel-lab-dirs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cwd);
    std::fs::create_dir_all(&cwd).unwrap();
    let run = || {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(["lab", "--quick", "--quiet", "--experiments", "e1"])
            .args(["--strategies", "round-robin"])
            .current_dir(&cwd)
            .output()
            .expect("run keel lab");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (first, second) = (run(), run());
    let mut dirs: Vec<String> = std::fs::read_dir(&cwd)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dirs.sort();
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    for (dir, stdout) in dirs.iter().zip([&first, &second]) {
        assert!(dir.starts_with("keel-lab-"), "{dir}");
        assert!(stdout.contains(&format!("Report: {dir}")), "{stdout}");
        for f in ["index.html", "results.json"] {
            assert!(cwd.join(dir).join(f).is_file(), "{dir}/{f}");
        }
    }
    let _ = std::fs::remove_dir_all(&cwd);
}

#[test]
fn bad_lab_arguments_exit_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["lab", "--experiments", "e7", "--quiet"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("e1, e2") && stderr.contains("e8, e9"),
        "{stderr}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["lab", "--strategies", "fastest", "--quiet"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
