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
    let doc: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    // E10 is one experiment of the lab's report: its part is `e10`, its answer one finding.
    let v = &doc["e10"];
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
    let answer = doc["answer"].as_array().unwrap();
    assert_eq!(answer.len(), 1, "{doc}");
    let finding = &answer[0];
    assert_eq!(finding["experiment"], "e10");
    assert_eq!(finding["strategy"], rows[0]["strategy"]);
    assert_eq!(finding["value"], rows[0]["measured"][0]);
    // Its margin is the recommendation's over the running configuration, as measured.
    let margin = finding["margin"].as_f64().unwrap();
    assert!((margin - (measured(&rows[0]) - measured(running))).abs() < 1e-12);
    assert!(finding["text"]
        .as_str()
        .unwrap()
        .starts_with("E10 (keel advise on"));
    for f in ["access.log", "advice.json", "fitted.toml", "e10.json"] {
        assert!(out.join("e10").join(f).exists(), "{f}");
    }
    let html = std::fs::read_to_string(out.join("index.html")).unwrap();
    assert!(html.contains("<h2>E10: keel advise checked against real traffic</h2>"));
    assert!(
        html.contains("<li><b>E10 (keel advise on"),
        "E10 in the page's answer"
    );
    let _ = std::fs::remove_dir_all(&out);
}
