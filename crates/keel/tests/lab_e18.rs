//! `keel lab --quick --experiments e18`: the first 150 requests of the Mooncake slice replayed
//! through keel's round-robin and prefix-affinity with the derived conversation as its session
//! key, three fake vLLM engines on loopback. The closed form (Che's characteristic time on the
//! trace's reuse distances, on the placement the run made) and the simulator must each be
//! within 0.08 of the traffic's share of prompt tokens from cache on both rows, and
//! prefix-affinity with sessions must serve at least round-robin's share.
//!
//! The tolerance: on the full slice the three agree within 0.05 on every row (the lab's own
//! `agrees`), where the simulator's balancer seeds alone move a row by up to 0.05
//! (least-request; prefix-affinity 0.03). The quick slice has half the requests, and its one
//! real-time run overlaps requests differently from the virtual-time one, more so on a loaded
//! machine: 0.059 (closed form) and 0.074 (simulator) from the traffic on prefix-affinity's row
//! in one run under a load average of 13, with the session key 0.23 against round-robin's 0.17.

#[path = "support/quick_lab.rs"]
mod quick_lab;

/// The quick form's tolerance (above; the lab's `e18::TOLERANCE` is 0.05, for the full slice).
const TOLERANCE: f64 = 0.08;

#[test]
fn e18_predicts_the_trace_and_sessions_keep_conversations_cached() {
    let v = quick_lab::run("e18", 300.0, "E18: a real trace replayed");
    let r = &v["e18"];
    assert_eq!(r["requests"], 150);
    let rows = r["rows"].as_array().expect("rows");
    let policies: Vec<&str> = rows.iter().map(|x| x["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["round-robin", "prefix-affinity, session key"]);
    let cached = |x: &serde_json::Value, i: usize| x["cached"][i].as_f64().unwrap();
    for x in rows {
        let name = x["policy"].as_str().unwrap();
        assert_eq!(x["failed"], 0, "{name}: failed requests");
        assert_eq!(x["requests"], 150, "{name}");
        let (s, t) = (cached(x, 1), cached(x, 2));
        let f = x["formula_on_run"].as_f64().unwrap();
        assert!(
            (f - t).abs() <= TOLERANCE,
            "{name}: closed form on the run's placement {f:.3} against traffic {t:.3}"
        );
        assert!(
            (s - t).abs() <= TOLERANCE,
            "{name}: simulator {s:.3} against traffic {t:.3}"
        );
        assert_eq!(x["extra_calls_per_request"], 0.0, "{name}");
    }
    let (rr, session) = (cached(&rows[0], 2), cached(&rows[1], 2));
    assert!(
        session >= rr,
        "prefix-affinity with sessions {session:.3} below round-robin's {rr:.3}"
    );
}
