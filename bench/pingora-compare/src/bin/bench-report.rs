//! Reads the criterion results of one `bench/balance.sh` run (both benches) and prints the
//! combined Markdown tables that go into BENCHMARKS.md.
//!
//! Usage: `bench-report <criterion-dir>`; every number is criterion's median estimate.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// (group, function, parameter) -> median ns.
type Results = BTreeMap<(String, String, String), f64>;

fn main() {
    let dir = match std::env::args_os().nth(1) {
        Some(d) => PathBuf::from(d),
        None => {
            eprintln!("usage: bench-report <criterion-dir>");
            std::process::exit(2);
        }
    };
    let mut results = Results::new();
    if let Err(e) = collect(&dir, &mut results) {
        eprintln!("bench-report: cannot read {}: {e}", dir.display());
        std::process::exit(1);
    }
    if results.is_empty() {
        eprintln!("bench-report: no criterion results under {}", dir.display());
        std::process::exit(1);
    }
    print!("{}", render(&results));
}

/// Finds every `new/benchmark.json` (this run's result; `base/` is an older one) and its
/// `new/estimates.json`.
fn collect(dir: &Path, out: &mut Results) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if !path.is_dir() {
            continue;
        }
        let bench = path.join("benchmark.json");
        if path.file_name().is_some_and(|n| n == "new") && bench.is_file() {
            let id: serde_json::Value = serde_json::from_slice(&std::fs::read(&bench)?)?;
            let est: serde_json::Value =
                serde_json::from_slice(&std::fs::read(path.join("estimates.json"))?)?;
            let s = |v: &serde_json::Value| v.as_str().unwrap_or("").to_string();
            let median = est["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            out.insert(
                (
                    s(&id["group_id"]),
                    s(&id["function_id"]),
                    s(&id["value_str"]),
                ),
                median,
            );
        } else {
            collect(&path, out)?;
        }
    }
    Ok(())
}

const SIZES: [&str; 3] = ["10", "100", "1000"];

fn get(r: &Results, group: &str, function: &str, n: &str) -> Option<f64> {
    r.get(&(group.to_string(), function.to_string(), n.to_string()))
        .copied()
}

/// ns with 3 significant digits, switching to µs / ms for large values.
fn fmt_time(ns: Option<f64>) -> String {
    match ns {
        None => "-".into(),
        Some(x) if x < 100.0 => format!("{x:.1} ns"),
        Some(x) if x < 10_000.0 => format!("{x:.0} ns"),
        Some(x) if x < 10_000_000.0 => format!("{:.1} µs", x / 1e3),
        Some(x) => format!("{:.1} ms", x / 1e6),
    }
}

fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

/// Functions of a group in first-seen order of the strategy list keel uses, then the rest.
fn functions(r: &Results, group: &str) -> Vec<String> {
    let order = [
        "round-robin",
        "weighted-round-robin",
        "random",
        "weighted-random",
        "least-connections",
        "least-request",
        "least-time",
        "peak-ewma",
        "ring-hash",
        "maglev",
        "rendezvous",
        "ring-hash+bounded-1.25",
        "maglev+bounded-1.25",
        "rendezvous+bounded-1.25",
    ];
    let mut fs: Vec<String> = r
        .keys()
        .filter(|k| k.0 == group)
        .map(|k| k.1.clone())
        .collect();
    fs.dedup();
    fs.sort_by_key(|f| order.iter().position(|o| o == f).unwrap_or(order.len()));
    fs
}

fn render(r: &Results) -> String {
    let mut s = String::new();
    let has = |g: &str| r.keys().any(|k| k.0 == g);

    if has("pick_finish_1t") {
        s += "### keel-balance: pick + finish, per op (median)\n\n";
        s += "1t: one thread. 2t: two threads on one shared balancer, time per op of one thread \
              (equal to 1t under perfect scaling).\n\n";
        s += "| strategy | 10 (1t) | 100 (1t) | 1000 (1t) | 10 (2t) | 100 (2t) | 1000 (2t) |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|\n";
        for f in functions(r, "pick_finish_1t") {
            s += &format!("| {f} |");
            for g in ["pick_finish_1t", "pick_finish_2t"] {
                for n in SIZES {
                    s += &format!(" {} |", fmt_time(get(r, g, &f, n)));
                }
            }
            s += "\n";
        }
        s += "\n";
    }

    if has("build") || has("update_remove_one") {
        s += "### keel-balance: table build (`Balancer::new`) and `update` removing one endpoint\n\n";
        s += "| strategy | build 10 | build 100 | build 1000 | update 10 | update 100 | update 1000 |\n";
        s += "|---|---:|---:|---:|---:|---:|---:|\n";
        let mut fs = functions(r, "update_remove_one");
        for f in functions(r, "build") {
            if !fs.contains(&f) {
                fs.push(f);
            }
        }
        for f in fs {
            s += &format!("| {f} |");
            for g in ["build", "update_remove_one"] {
                for n in SIZES {
                    s += &format!(" {} |", fmt_time(get(r, g, &f, n)));
                }
            }
            s += "\n";
        }
        s += "\n";
    }

    // keel strategy, the pingora selector it is compared with.
    let pairs = [
        ("round-robin", "round-robin"),
        ("random", "random"),
        ("least-request", "random"),
        ("least-request", "round-robin"),
        ("ring-hash", "ketama"),
    ];
    for (group, title) in [
        ("compare_1t", "one thread"),
        (
            "compare_2t",
            "two threads contending (time per op of one thread)",
        ),
    ] {
        if !has(group) {
            continue;
        }
        s += &format!("### keel vs pingora-load-balancing, same run, {title}\n\n");
        s += "ratio = keel pick+finish / pingora select (below 1: keel faster).\n\n";
        // Pick-only is measured on one thread only.
        let pick_only = group == "compare_1t";
        s += "| n | keel strategy | pingora selector | pingora select | keel pick+finish |";
        s += if pick_only {
            " keel pick only | ratio |\n"
        } else {
            " ratio |\n"
        };
        s += if pick_only {
            "|---:|---|---|---:|---:|---:|---:|\n"
        } else {
            "|---:|---|---|---:|---:|---:|\n"
        };
        for n in SIZES {
            for (k, p) in pairs {
                let pv = get(r, group, &format!("pingora.{p}"), n);
                let kv = get(r, group, &format!("keel.{k}"), n);
                s += &format!("| {n} | {k} | {p} | {} | {} |", fmt_time(pv), fmt_time(kv));
                if pick_only {
                    let ko = get(r, group, &format!("keel-pick-only.{k}"), n);
                    s += &format!(" {} |", fmt_time(ko));
                }
                s += &format!(" {} |\n", fmt_ratio(kv, pv));
            }
        }
        s += "\n";
    }

    if has("compare_build") {
        s += "### Consistent-hash table build, same run\n\n";
        s += "| n | pingora ketama (`Consistent::build`) | keel ring-hash (`Balancer::new`) | ratio |\n";
        s += "|---:|---:|---:|---:|\n";
        for n in SIZES {
            let p = get(r, "compare_build", "pingora.ketama", n);
            let k = get(r, "compare_build", "keel.ring-hash", n);
            s += &format!(
                "| {n} | {} | {} | {} |\n",
                fmt_time(p),
                fmt_time(k),
                fmt_ratio(k, p)
            );
        }
        s += "\n";
    }
    s
}
