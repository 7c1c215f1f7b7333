//! `keel simulate` end to end: JSON shape and numbers for a preset, scenario files, exit codes.

use std::process::Command;

fn keel(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(args)
        .output()
        .expect("keel runs")
}

#[test]
fn preset_e1_json() {
    let out = keel(&[
        "simulate",
        "--preset",
        "e1",
        "--json",
        "--quiet",
        "--replications",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object: {text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["experiment"], "e1");
    assert!(v["calls_per_second"].as_f64().unwrap() > 0.0);
    let results = v["results"].as_array().unwrap();
    let strategies: Vec<&str> = results
        .iter()
        .map(|r| r["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(strategies, ["round-robin", "random"]);
    for r in results {
        assert_eq!(r["protections"], "none");
        assert_eq!(r["requests"], 100_000);
        assert_eq!(r["replications"], 4);
        let success = r["success"].as_f64().unwrap();
        let ci: Vec<f64> = r["ci95"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(ci[0] <= success && success <= ci[1]);
        assert!((success - 0.512).abs() < 0.01, "{success}");
        assert!((r["analytic_success"].as_f64().unwrap() - 0.512).abs() < 1e-12);
        assert!((r["failed_pick_share"].as_f64().unwrap() - 0.2).abs() < 0.01);
        // Servers without a capacity: no offered-load figure; a request takes three calls of
        // 10 ms on average, or stops at a hung server's 1 s timeout (half the requests do).
        assert!(r["load"].is_null());
        let l = &r["latency_ms"];
        let (p50, p99, p999) = (
            l["p50"].as_f64().unwrap(),
            l["p99"].as_f64().unwrap(),
            l["p999"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p50 <= p99 && p99 <= p999, "{l}");
        assert!((999.0..1100.0).contains(&p99), "p99 at the timeout: {l}");
        assert_eq!(r["extra_calls"], 0.0);
    }
}

#[test]
fn scenario_file_is_deterministic_for_a_seed_and_has_a_table() {
    let dir = std::env::temp_dir().join(format!("keel-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("small.toml");
    std::fs::write(
        &file,
        "name = \"small\"\nrequests = 2000\nreplications = 2\n[load]\nkind = \"closed\"\nclients = 20\n\
         [[clusters]]\nservers = 5\nfailed = 1\ncalls = 3\nfailure = { mode = \"hang\" }\n\
         latency = { dist = \"exponential\", mean = \"10ms\" }\n\
         [clusters.balancer]\nstrategy = \"least-connections\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let results = |seed: &str| {
        let out = keel(&["simulate", "--scenario", f, "--json", "--seed", seed]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["experiment"], "small");
        v["results"].clone()
    };
    assert_eq!(results("5"), results("5"));
    assert_ne!(results("5"), results("6"));
    let out = keel(&["simulate", "--scenario", f]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("least-connections") && table.contains("calls/s"),
        "{table}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn preset_e7_compares_per_connection_and_per_request_balancing() {
    let out = keel(&["simulate", "--preset", "e7", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 20);
    let find = |balancing: &str, fault: &str, protections: bool| {
        rows.iter()
            .find(|r| {
                r["strategy"] == "round-robin"
                    && r["balancing"] == balancing
                    && r["failure_mode"] == fault
                    && r["protections"] == protections
            })
            .unwrap()
    };
    assert_eq!(find("per-connection", "none", false)["max_over_mean"], 2.0);
    assert_eq!(find("per-connection", "fast-error", true)["success"], 0.75);
    assert_eq!(find("per-request", "fast-error", true)["success"], 1.0);
}

#[test]
fn bad_input_exits_with_code_2() {
    let dir = std::env::temp_dir().join(format!("keel-sim-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "requests = 10\n[load]\nkind = \"closed\"\nclients = 1\n[[clusters]]\nservers = 2\nfailed = 3\n").unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["simulate", "--preset", "e77"], "unknown preset"),
        (&["simulate"], "--preset"),
        (
            &["simulate", "--preset", "e1", "--replications", "0"],
            "replications",
        ),
        (&["simulate", "--scenario", bad.to_str().unwrap()], "failed"),
        (
            &["simulate", "--scenario", "/nonexistent/keel.toml"],
            "cannot read",
        ),
    ];
    for (args, needle) in cases {
        let out = keel(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A scenario with servers that queue, antagonists and hedging: the E8 fields in the JSON, the
/// latency columns in the table, and the charts with --plot.
#[test]
fn queueing_scenario_reports_latency_and_plots() {
    let dir = std::env::temp_dir().join(format!("keel-sim-tail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tail.toml");
    std::fs::write(
        &file,
        "name = \"tail\"\nrequests = 20000\nreplications = 2\nwarmup = \"2s\"\n\
         placement = \"client-side\"\n\
         [load]\nkind = \"open\"\nrate = 1500.0\nclients = 10\n\
         [hedge]\ndelay = \"p95\"\n\
         [[clusters]]\nservers = 20\nlatency = { dist = \"exponential\", mean = \"10ms\" }\n\
         capacity = { concurrency = 1 }\n\
         antagonist = { servers = 2, factor = 3.0, period = \"2s\" }\n\
         [clusters.balancer]\nstrategy = \"least-request\"\n",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let charts = dir.join("charts");
    let out = keel(&[
        "simulate",
        "--scenario",
        f,
        "--json",
        "--plot",
        charts.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let r = &v["results"][0];
    assert_eq!(r["strategy"], "least-request");
    assert_eq!(r["placement"], "client-side");
    assert_eq!(r["protections"], "hedge");
    // 1500/s of 10 ms calls on 20 servers, 2 of them at a third of their speed on average.
    let load = r["load"].as_f64().unwrap();
    let capacity = 100.0 * (20.0 - 2.0 + 2.0 / 3.0);
    assert!((load - 1500.0 / capacity).abs() < 1e-9, "{load}");
    for q in ["mean", "p50", "p99", "p999"] {
        assert!(r["latency_ms"][q].as_f64().unwrap() > 0.0, "{q}");
    }
    let extra = r["extra_calls"].as_f64().unwrap();
    assert!(extra > 0.0 && extra <= 0.0505, "{extra}");
    assert!(r["hedges"].as_u64().unwrap() >= r["hedges_won"].as_u64().unwrap());
    for chart in ["tail_cdf_load_0.80.svg", "tail_p99_load.svg"] {
        let svg = std::fs::read_to_string(charts.join(chart)).unwrap();
        assert!(svg.contains("client least-request + hedge"), "{chart}");
    }
    let table = String::from_utf8(keel(&["simulate", "--scenario", f]).stdout).unwrap();
    assert!(
        table.contains("p99.9 ms") && table.contains("extra%"),
        "{table}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The columns of a terminal line.
fn columns(line: &str) -> usize {
    line.chars().count()
}

#[test]
fn preset_output_opens_with_its_answer_from_its_own_rows() {
    let args = [
        "simulate",
        "--preset",
        "e4",
        "--replications",
        "2",
        "--quiet",
    ];
    let text = keel(&args);
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    let json = keel(&[&args[..], &["--json"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    // The scenario whose strategies differ most, its best and runner-up, from the JSON.
    let success = |r: &serde_json::Value| r["success"].as_f64().unwrap();
    let mut labels: Vec<&str> = rows.iter().map(|r| r["label"].as_str().unwrap()).collect();
    labels.dedup();
    let group = |l: &str| -> Vec<&serde_json::Value> {
        let mut g: Vec<_> = rows.iter().filter(|r| r["label"] == l).collect();
        g.sort_by(|a, b| success(b).total_cmp(&success(a)));
        g
    };
    let spread = |l: &str| {
        let g = group(l);
        success(g[0]) - success(g[g.len() - 1])
    };
    let label = labels
        .iter()
        .copied()
        .filter(|l| group(l).len() > 1)
        .max_by(|a, b| spread(a).total_cmp(&spread(b)))
        .unwrap();
    let g = group(label);
    let best = g[0]["strategy"].as_str().unwrap();
    let margin = format!("{:+.4}", success(g[0]) - success(g[1]));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "What this run shows:", "{text}");
    let answer = lines[1..4].join(" ");
    let answer = answer.split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in [label, best, margin.as_str()] {
        assert!(
            answer.contains(needle),
            "{needle:?} not in {answer:?}\n{text}"
        );
    }
    for line in &lines {
        assert!(columns(line) <= 100, "{} columns: {line}", columns(line));
    }
}

#[test]
fn e5_table_fits_100_columns_with_its_labels_aligned() {
    for wide in [false, true] {
        let mut args = vec![
            "simulate",
            "--preset",
            "e5",
            "--replications",
            "1",
            "--quiet",
        ];
        if wide {
            args.push("--wide");
        }
        let out = keel(&args);
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        // Every row of the table has the same width: its columns line up whatever the label.
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("least-connections") && l.contains(" none "))
            .collect();
        assert!(rows.len() >= 6, "{text}");
        let at = |l: &str| l.find("least-connections").unwrap();
        for r in &rows {
            assert_eq!(columns(r), columns(rows[0]), "{text}");
            assert_eq!(at(r), at(rows[0]), "strategy column: {text}");
        }
        if !wide {
            for line in text.lines() {
                assert!(columns(line) <= 100, "{} columns: {line}", columns(line));
            }
        } else {
            assert!(columns(rows[0]) > 100, "--wide shows every column");
        }
    }
}

#[test]
fn preset_fleet_answers_first_and_reports_every_proxy_count() {
    let out = keel(&["simulate", "--preset", "fleet", "--replications", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("Shared evidence cuts the fleet's failed tries from 160.0 to "),
        "{text}"
    );
    assert!(text.lines().all(|l| l.len() <= 100), "{text}");
    let out = keel(&[
        "simulate",
        "--preset",
        "fleet",
        "--replications",
        "2",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 6 fleet sizes x 2 failure modes x 2 traffic shapes x local and shared.
    assert_eq!(rows.len(), 48);
    for r in &rows {
        assert_eq!(r["ejected_everywhere"], 2, "{r}");
        // A fast failure under local detection costs exactly N x k.
        if r["detection"] == "local" && r["failure_mode"] == "fail-fast" {
            let n = r["proxies"].as_f64().unwrap();
            assert_eq!(r["failed_tries"].as_f64(), Some(n * 5.0), "{r}");
            assert_eq!(r["closed_form"].as_f64(), Some(n * 5.0), "{r}");
        }
    }
}

/// The answer block of a terminal run: the bullet lines after "What this run shows:", joined
/// (a bullet wraps over several lines).
fn answer_of(text: &str) -> String {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("What this run shows:"), "{text}");
    let block: Vec<&str> = lines.take_while(|l| !l.is_empty()).collect();
    block
        .join(" ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn json_rows(args: &[&str]) -> Vec<serde_json::Value> {
    let out = keel(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn e7_zones_and_e11_open_with_their_answer_from_their_own_rows() {
    // E7: per request beats per connection; the numbers are the JSON rows' own.
    let text = String::from_utf8(keel(&["simulate", "--preset", "e7"]).stdout).unwrap();
    let answer = answer_of(&text);
    let rows = json_rows(&["simulate", "--preset", "e7", "--json"]);
    for fault in ["hang", "fast-error"] {
        let best = |balancing: &str| {
            rows.iter()
                .filter(|r| r["failure_mode"] == fault && r["balancing"] == balancing)
                .map(|r| r["success"].as_f64().unwrap())
                .fold(0.0, f64::max)
        };
        let (req, conn) = (best("per-request"), best("per-connection"));
        assert!(
            req > conn,
            "{fault}: per request {req} <= per connection {conn}"
        );
        let needle = format!(
            "E7 ({fault}): decide per request. least-connections with protections per request reaches {req:.4}"
        );
        assert!(answer.contains(&needle), "{needle:?} not in {answer:?}");
        assert!(
            answer.contains(&format!("per connection the best is {conn:.4}")),
            "{answer}"
        );
    }

    // Zones: the named rule overloads no zone and keeps p99 within 5 % of the lowest.
    let text = String::from_utf8(keel(&["simulate", "--preset", "zones"]).stdout).unwrap();
    let answer = answer_of(&text);
    let rows = json_rows(&["simulate", "--preset", "zones", "--json"]);
    let named = rows
        .iter()
        .find(|r| answer.starts_with(&format!("- ZONES: {} keeps", r["rule"].as_str().unwrap())))
        .unwrap_or_else(|| panic!("no rule of the rows opens {answer:?}"));
    assert!(named["offered"]
        .as_array()
        .unwrap()
        .iter()
        .all(|o| o.as_f64().unwrap() < 1.0));
    let low = rows
        .iter()
        .filter(|r| {
            r["offered"]
                .as_array()
                .unwrap()
                .iter()
                .all(|o| o.as_f64().unwrap() < 1.0)
        })
        .map(|r| r["p99_ms"].as_f64().unwrap())
        .fold(f64::INFINITY, f64::min);
    assert!(named["p99_ms"].as_f64().unwrap() <= low * 1.05, "{named}");
    assert!(answer.contains("offers its busiest zone"), "{answer}");

    // E11: the affinity named first moves no session needlessly.
    let text = String::from_utf8(keel(&["simulate", "--preset", "sticky"]).stdout).unwrap();
    let answer = answer_of(&text);
    assert!(
        answer.contains("E11 (endpoint unhealthy): sticky cookie moves"),
        "{answer}"
    );
    assert!(
        answer.contains("(0.000 needlessly, 0.000 back when it returns)"),
        "{answer}"
    );
    for line in text.lines().take_while(|l| !l.is_empty()) {
        assert!(columns(line) <= 100, "{} columns: {line}", columns(line));
    }
}

#[test]
fn reaction_opens_with_the_fastest_strategy_and_those_that_never_moved() {
    let text =
        String::from_utf8(keel(&["simulate", "--preset", "reaction", "--quiet"]).stdout).unwrap();
    let answer = answer_of(&text);
    let rows = json_rows(&["simulate", "--preset", "reaction", "--quiet", "--json"]);
    let results: Vec<&serde_json::Value> = rows
        .iter()
        .flat_map(|r| r["results"].as_array().unwrap())
        .collect();
    // Fastest down; among equals, the lowest share while slowed.
    let fastest = results
        .iter()
        .filter_map(|r| {
            let x = &r["reaction"];
            Some((x["down_ms"].as_f64()?, x["share_during"].as_f64()?, r))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)))
        .map(|(down, _, r)| (down, r))
        .unwrap();
    let name = fastest.1["strategy"].as_str().unwrap();
    assert!(
        answer.contains(&format!("{name} reacts fastest"))
            && answer.contains(&format!("{:.0} ms after they slowed", fastest.0)),
        "{answer}"
    );
    // Round-robin cannot see latency: it keeps sending the slowed server its fair share.
    assert!(answer.contains("round-robin never moved away"), "{answer}");
}

#[test]
fn e5_gives_each_failure_of_one_strategy_without_ranking_it_against_itself() {
    // Every E5 row is least-connections; its rows differ by tie-break and failure mode. The
    // answer says each failure's value, not "least-connections (hang) is best ... over
    // least-connections (fail-fast)".
    let text = String::from_utf8(keel(&["simulate", "--preset", "e5"]).stdout).unwrap();
    let answer = answer_of(&text);
    assert!(
        answer.contains("one strategy, so the failure mode makes the difference"),
        "{answer}"
    );
    assert!(!answer.contains("is best at"), "{answer}");
}
