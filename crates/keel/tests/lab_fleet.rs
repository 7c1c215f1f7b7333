//! `keel lab --experiments e12`: a fleet of keel proxies on a real three-member etcd (loopback).
//! Without etcd on PATH, E12 is named and skipped and the run still succeeds; with it (ignored
//! in a plain `cargo test`: .ci/run runs it after scripts/test-etcd.sh installs etcd), the
//! quick fleet's failed tries against the closed forms: local detection costs N x 5, shared
//! evidence at most half of that at N = 3, and at least the threshold.

use std::process::Command;

fn lab(path: Option<&str>) -> serde_json::Value {
    let out_dir = std::env::temp_dir().join(format!(
        "keel-lab-fleet-test-{}-{}",
        std::process::id(),
        path.is_some()
    ));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel"));
    cmd.args([
        "lab",
        "--experiments",
        "e12",
        "--quick",
        "--json",
        "--quiet",
        "--out",
    ])
    .arg(&out_dir);
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    let out = cmd.output().expect("run keel lab");
    assert!(
        out.status.success(),
        "keel lab failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(out_dir.join("index.html")).expect("index.html");
    assert!(html.contains("E12: a fleet of keel proxies on etcd"));
    let _ = std::fs::remove_dir_all(&out_dir);
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

#[test]
fn without_etcd_e12_is_named_and_skipped() {
    let empty = std::env::temp_dir().join(format!("keel-no-etcd-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let v = lab(Some(empty.to_str().unwrap()));
    let fleet = &v["fleet"];
    assert!(
        fleet["skipped"].as_str().unwrap().contains("etcd-server"),
        "{fleet}"
    );
    assert_eq!(fleet["rows"].as_array().unwrap().len(), 0);
    let _ = std::fs::remove_dir(&empty);
}

#[test]
#[ignore = "needs etcd-server: .ci/run runs it after scripts/test-etcd.sh"]
fn a_fleet_on_etcd_pays_the_closed_forms_failed_tries() {
    let v = lab(None);
    let rows = v["fleet"]["rows"].as_array().expect("fleet.rows");
    // N = 1 and 3, traffic in turn and spread, local and shared.
    assert_eq!(rows.len(), 8, "{v}");
    let mean = |n: u64, traffic: &str, detection: &str| {
        rows.iter()
            .find(|r| r["proxies"] == n && r["traffic"] == traffic && r["detection"] == detection)
            .and_then(|r| r["measured"].as_f64())
            .unwrap()
    };
    for traffic in ["in-turn", "spread"] {
        // Local: every proxy pays the threshold alone.
        assert!((mean(1, traffic, "local") - 5.0).abs() <= 1.0, "{v}");
        assert!((mean(3, traffic, "local") - 15.0).abs() <= 1.0, "{v}");
        // Shared: the fleet pays about the threshold, at most half of local.
        let shared = mean(3, traffic, "shared");
        assert!(
            shared >= 5.0,
            "{traffic}: shared {shared} below the threshold"
        );
        assert!(
            shared * 2.0 <= mean(3, traffic, "local"),
            "{traffic}: shared {shared} above half of local"
        );
    }
    for r in rows {
        let cf = r["closed_form"].as_f64().unwrap();
        let sim = r["simulated"].as_f64().unwrap();
        assert!((cf - sim).abs() <= 0.5, "closed form and simulation: {r}");
    }
    // docs/reliability.md: every row agrees with the closed form or the simulation. Each
    // verdict is a 95 % test, so 8 true rows still disagree by chance: 3 or more of 8 with
    // probability 0.006 (binomial, 8 rows at 0.05), 2 or more with 0.057. At most 2.
    let disagreeing: Vec<_> = rows.iter().filter(|r| r["agrees"] != true).collect();
    eprintln!(
        "E12: {} of {} rows agree",
        rows.len() - disagreeing.len(),
        rows.len()
    );
    assert!(
        disagreeing.len() <= 2,
        "E12 rows that disagree: {disagreeing:#?}"
    );
    let answer = v["answer"].as_array().unwrap();
    assert!(answer.iter().any(|f| f["experiment"] == "e12"), "{v}");
}
