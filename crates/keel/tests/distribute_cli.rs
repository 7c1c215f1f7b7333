//! `keel distribute` end to end: the done-criteria and its errors.

use std::process::Command;

fn keel(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .expect("run keel");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(args: &[&str]) -> serde_json::Value {
    let (code, out, err) = keel(args);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("one JSON object")
}

#[test]
fn maglev_removal_moves_few_keys_and_stays_balanced() {
    let v = json(&[
        "distribute",
        "--strategy",
        "maglev",
        "--endpoints",
        "100",
        "--keys",
        "1000000",
        "--remove",
        "1",
        "--json",
    ]);
    assert_eq!(v["strategy"], "maglev");
    assert_eq!(v["shares"].as_array().unwrap().len(), 100);
    let moved = v["moved"].as_f64().unwrap();
    assert!((0.009..=0.02).contains(&moved), "moved {moved}");
    assert!(v["max_over_mean"].as_f64().unwrap() <= 1.05);
}

#[test]
fn smooth_weighted_round_robin_shares_are_exact() {
    let v = json(&[
        "distribute",
        "--strategy",
        "weighted-round-robin",
        "--endpoints",
        "3",
        "--weights",
        "5,1,1",
        "--keys",
        "7000",
        "--json",
    ]);
    let shares: Vec<f64> = v["shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    for (s, e) in shares.iter().zip([5.0 / 7.0, 1.0 / 7.0, 1.0 / 7.0]) {
        assert!((s - e).abs() < 1e-9, "{shares:?}");
    }
    assert!(v["moved"].is_null());
}

#[test]
fn adding_to_a_ring_moves_about_the_new_share() {
    let v = json(&[
        "distribute",
        "--strategy",
        "ring-hash",
        "--endpoints",
        "9",
        "--keys",
        "100000",
        "--add",
        "1",
        "--json",
    ]);
    let moved = v["moved"].as_f64().unwrap();
    assert!((0.05..0.15).contains(&moved), "ideal 0.1, moved {moved}");
}

#[test]
fn bad_input_exits_2_with_the_allowed_values() {
    let (code, _, err) = keel(&["distribute", "--strategy", "fastest", "--endpoints", "3"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("round-robin") && err.contains("maglev"),
        "{err}"
    );
    let (code, _, err) = keel(&[
        "distribute",
        "--strategy",
        "random",
        "--endpoints",
        "3",
        "--weights",
        "1,2",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("one weight per endpoint"), "{err}");
    let (code, _, err) = keel(&[
        "distribute",
        "--strategy",
        "maglev",
        "--endpoints",
        "3",
        "--table-size",
        "100",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("prime"), "{err}");
}
