//! `keel advise` end to end on the example log: JSON shape, the running row, settings that
//! keel proxy accepts, the report and the scenario file `keel simulate` reruns, refusals.

use std::path::PathBuf;
use std::process::Command;

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .expect("keel runs")
}

fn example(name: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/advise");
    root.join(name).display().to_string()
}

#[test]
fn advise_on_the_example_log_marks_the_running_row_and_writes_a_rerunnable_model() {
    let out_dir = std::env::temp_dir().join(format!("keel-advise-test-{}", std::process::id()));
    let log = example("access.log");
    let config = example("keel.toml");
    let out = keel(&[
        "advise",
        "--access-log",
        &log,
        "--config",
        &config,
        "--json",
        "--quiet",
        "--requests",
        "1500",
        "--replications",
        "2",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ranking = v["ranking"].as_array().unwrap();
    // 12 strategies x 3 protection sets; the running one (round-robin, one retry) is among them.
    assert_eq!(ranking.len(), 36);
    let running = v["running"].as_u64().expect("running index") as usize;
    assert_eq!(ranking[running]["strategy"], "round-robin");
    assert_eq!(ranking[running]["running"], true);
    assert!(ranking[running]["protections"]
        .as_str()
        .unwrap()
        .starts_with("keel defaults"));
    for r in ranking {
        for key in ["success", "p99_ms", "p999_ms"] {
            let x: Vec<f64> = r[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert!(x[1] <= x[0] && x[0] <= x[2], "{key} {x:?}");
        }
    }
    // Success never rises down the ranking by more than the comparison's resolution.
    let s: Vec<f64> = ranking
        .iter()
        .map(|r| r["success"][0].as_f64().unwrap())
        .collect();
    assert!(s.windows(2).all(|w| w[0] + 1e-4 >= w[1]), "{s:?}");
    // The endpoint failing fast (20 % in the model) is found in the fit.
    let b = &v["model"]["endpoints"][1];
    assert_eq!(b["name"], "10.0.0.2:8080");
    let ci = &b["failures"]["error"]["ci95"];
    assert!(
        ci[0].as_f64().unwrap() <= 0.2 && 0.2 <= ci[1].as_f64().unwrap(),
        "{b}"
    );
    // Every configuration's settings are a cluster keel proxy accepts.
    for r in ranking {
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:8080\"\ncluster = \"app\"\n\n{}",
            r["cluster_toml"].as_str().unwrap()
        );
        keel_proxy::ProxyConfig::from_toml_str(&text, "advice")
            .unwrap_or_else(|e| panic!("{e}\n{text}"));
    }
    let html = std::fs::read_to_string(out_dir.join("index.html")).unwrap();
    assert!(html.contains("<svg") && html.contains("10.0.0.3:8080"));
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("advice.json")).unwrap())
            .unwrap();
    assert_eq!(file["ranking"], v["ranking"]);
    // The model reruns as a scenario.
    let scenario = out_dir.join("fitted.toml");
    let rerun = keel(&[
        "simulate",
        "--scenario",
        scenario.to_str().unwrap(),
        "--json",
        "--quiet",
        "--replications",
        "2",
    ]);
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    let _ = std::fs::remove_dir_all(&out_dir);
}

#[test]
fn advise_refuses_what_it_cannot_fit() {
    let dir = std::env::temp_dir().join(format!("keel-advise-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(example("access.log")).unwrap();
    let mixed = dir.join("mixed.log");
    std::fs::write(
        &mixed,
        format!(
            "{text}{}",
            text.replace("\"cluster\":\"app\"", "\"cluster\":\"billing\"")
        ),
    )
    .unwrap();
    let out = keel(&["advise", "--access-log", mixed.to_str().unwrap(), "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("mixes 2 clusters") && err.contains("--cluster"),
        "{err}"
    );
    let few = dir.join("few.log");
    std::fs::write(&few, text.lines().take(40).collect::<Vec<_>>().join("\n")).unwrap();
    let out = keel(&["advise", "--access-log", few.to_str().unwrap(), "--quiet"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has 40 requests") && err.contains("at least 100"),
        "{err}"
    );
    let out = keel(&[
        "advise",
        "--access-log",
        few.to_str().unwrap(),
        "--since",
        "soon",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let _ = std::fs::remove_dir_all(&dir);
}
