//! Runs one experiment of `keel lab` in its quick form, as a user would: the JSON document it
//! prints and the page it writes, checked for what every experiment owes (it ran, within the
//! hang guard; its answer comes first; its section is on the page). Each test binary that
//! includes it uses one of its two functions.
#![allow(dead_code)]

use std::process::Command;
use std::time::Instant;

/// `keel lab --json --quiet --out DIR ARGS...` with `env` set: the JSON document it prints, its
/// page, and the seconds it took (`tag` names its output folder).
pub fn lab(args: &[&str], env: &[(&str, &str)], tag: &str) -> (serde_json::Value, String, f64) {
    let out_dir = std::env::temp_dir().join(format!("keel-lab-{tag}-{}", std::process::id()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel"));
    cmd.args(["lab", "--json", "--quiet", "--out"])
        .arg(&out_dir)
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let out = cmd.output().expect("run keel lab");
    let took = started.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "keel lab failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(out_dir.join("index.html")).expect("index.html");
    let _ = std::fs::remove_dir_all(&out_dir);
    (
        serde_json::from_slice(&out.stdout).expect("one JSON document"),
        html,
        took,
    )
}

/// `keel lab --json --quiet --quick --experiments EXPERIMENT`: the JSON document it prints.
/// `hang_guard`: the seconds past which the run counts as hung (not a speed check: that is
/// for benchmarks; CI runs test binaries side by side on a shared machine, where 8-48 s has
/// been measured for these); `title`: the start of its section's heading.
pub fn run(experiment: &str, hang_guard: f64, title: &str) -> serde_json::Value {
    let (v, html, took) = lab(&["--quick", "--experiments", experiment], &[], experiment);
    eprintln!("{}", serde_json::to_string_pretty(&v[experiment]).unwrap());
    assert!(took < hang_guard, "the quick form took {took:.1} s");
    assert!(html.contains(title), "no section {title:?} on the page");
    assert_eq!(
        v["answer"][0]["experiment"], experiment,
        "the answer first: {}",
        v["answer"]
    );
    v
}
