//! E10 end to end (real sockets on loopback): keel advise on a log keel proxy wrote, then its
//! top three configurations and the running one measured through keel proxy with the
//! recommendation's own `[[cluster]]` settings.

use std::process::Command;

#[test]
fn e10_predictions_hold_on_real_traffic() {
    let out = std::env::temp_dir().join(format!("keel-e10-test-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args([
            "lab",
            "--experiments",
            "e10",
            "--quick",
            "--json",
            "--quiet",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("keel runs");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // The top three and the running configuration (round-robin without protections, ranked
    // below them: the backend failing fast costs it a share of its requests).
    assert_eq!(rows.len(), 4, "{v}");
    let running = rows
        .iter()
        .find(|r| r["running"] == true)
        .expect("the running row");
    assert_eq!(running["strategy"], "round-robin");
    assert!(running["rank"].as_u64().unwrap() > 3, "{v}");
    assert!(v["agreeing"].as_u64().unwrap() >= 3, "{v}");
    assert_eq!(v["recommended_holds"], true, "{v}");
    // The recommended configuration is measured better than the running one.
    let measured = |r: &serde_json::Value| r["measured"][0].as_f64().unwrap();
    assert!(measured(&rows[0]) > measured(running), "{v}");
    for f in ["access.log", "advice.json", "fitted.toml", "e10.json"] {
        assert!(out.join("e10").join(f).exists(), "{f}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
