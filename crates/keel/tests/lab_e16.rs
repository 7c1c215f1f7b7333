//! `keel lab --experiments e16`: a fleet of keel proxies (prefix-affinity) in front of three
//! fake vLLM engines on loopback. The quick form's rows (N = 1 and 2 sharing nothing, N = 2
//! with a key hashed alike; 72 requests each) must agree three ways on the share of prompt
//! tokens from cache: the simulator's mean and the traffic each within 0.08 of the closed form
//! (one run of 72 requests moves by about 0.03 from seed to seed: 0.08 is over two of its
//! standard deviations plus the form's 0.03 off the presets). With a key, the simulator and the
//! traffic are each held to the form for the placement their hash drew (the traffic's engine
//! ports differ from run to run), not to its mean over placements: one traffic run of 18 put
//! every group on one engine. Two proxies sharing nothing lose hits against one by about what
//! the closed form says: the two runs send the same prompts in the same order (one seed), so
//! their difference moves by less than either, and is held to 0.05 of the form's; and a key
//! hashed alike gives each group one home again.

#[path = "support/quick_lab.rs"]
mod quick_lab;

#[test]
fn e16_agrees_three_ways_and_two_proxies_lose_what_the_formula_says() {
    let v = quick_lab::run("e16", 180.0, "E16: a fleet of routers");
    let r = &v["e16"];
    let rows = r["rows"].as_array().expect("rows");
    let names: Vec<(u64, &str)> = rows
        .iter()
        .map(|x| {
            (
                x["proxies"].as_u64().unwrap(),
                x["sharing"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(names, [(1, "none"), (2, "none"), (2, "prefix key")]);
    let three = |x: &serde_json::Value, k: &str| -> [f64; 3] {
        let a = x[k].as_array().unwrap_or_else(|| panic!("{k}: {x}"));
        [0, 1, 2].map(|i| a[i].as_f64().unwrap())
    };
    for x in rows {
        let [f, s, t] = three(x, "cached");
        // A key's runs are each one draw of the placements its form averages over: held to
        // the form for the placement they drew.
        let (fs, ft) = match x["cached_placed"].as_array() {
            Some(p) => (p[0].as_f64().unwrap(), p[1].as_f64().unwrap()),
            None => (f, f),
        };
        assert!((s - fs).abs() <= 0.08, "simulator {s} against {fs}: {x}");
        assert!((t - ft).abs() <= 0.08, "traffic {t} against {ft}: {x}");
        assert_eq!(x["agrees"], true, "{x}");
        let served: u64 = x["per_engine"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        assert_eq!(served, 72, "{x}");
    }
    let (one, two, key) = (&rows[0], &rows[1], &rows[2]);
    let [f1, _, t1] = three(one, "cached");
    let [f2, s2, t2] = three(two, "cached");
    let lost = (f1 - f2, t1 - t2);
    assert!(
        lost.0 > 0.03,
        "the closed form says two proxies lose hits: {lost:?}"
    );
    assert!(
        (lost.1 - lost.0).abs() <= 0.05,
        "two proxies lose {:.3} measured against {:.3} by the closed form (simulator {:.3})",
        lost.1,
        lost.0,
        f1 - s2
    );
    // Each proxy places a group on its own: more homes than one router's.
    let ([h1, _, th1], [h2, sh2, th2]) = (three(one, "homes"), three(two, "homes"));
    assert!((h1 - 1.0).abs() < 1e-9 && (h2 - 5.0 / 3.0).abs() < 1e-9);
    assert!(
        th2 > th1 && sh2 > 1.3,
        "homes: {th1} then {th2} (simulator {sh2})"
    );
    // A key hashed alike: one home a group at any N, and, over placements, the hits of a
    // hash's (the form's 0.81 against 0.77 sharing nothing, 72 requests). One run draws one
    // placement: every group is placed, on an engine, and the form for it is the one held.
    let [fk, _, _] = three(key, "cached");
    let [_, _, tkh] = three(key, "homes");
    assert!(fk > f2 && tkh == 1.0, "{key}");
    let placement = key["placement"].as_array().expect("the key's placement");
    assert_eq!(placement.len(), 6, "{key}");
    assert!(placement.iter().all(|j| j.as_u64().unwrap() < 3), "{key}");
    for x in [one, two] {
        assert!(x["cached_placed"].is_null() && x["placement"] == serde_json::json!([]));
    }
}
