//! `keel simulate`: the discrete-event simulator of `keel_model::sim`, on a scenario file or on
//! the built-in experiments E1-E6 (`keel_model::presets`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use keel_model::plot::{self, ChartSpec, Series, Style};
use keel_model::presets::{self, Experiment};
use keel_model::sim::{self, BatchReport, Reaction, Scenario, SimResult};
use serde::Serialize;

use crate::cmd::usage;

/// Arguments of `keel simulate`.
#[derive(clap::Args)]
#[command(after_help = "\
Examples:
  keel simulate --preset e2
  keel simulate --preset seed --json        # E1..E6, one JSON object per line
  keel simulate --scenario scenarios/source-example.toml --json

JSON (one object per experiment): {\"experiment\", \"title\", \"calls_per_second\" (calls / wall
seconds / threads), \"calls_per_cpu_second\" (calls / CPU seconds used), \"wall_seconds\",
\"threads\", \"ci_method\", \"results\": [{\"label\", \"strategy\", \"protections\", \"failure_mode\",
\"placement\", \"p\", \"q\", \"k\", \"requests\", \"success\", \"ci95\", \"failed_pick_share\",
\"analytic_success\", \"max_server_share\", \"retries_per_request\", \"no_endpoint\",
\"mean_latency_ms\", \"load\" (offered load / capacity, servers with a capacity and an open loop,
else null), \"latency_ms\": {\"mean\", \"p50\", \"p99\", \"p999\"}, \"latency_ci95_ms\": {\"p50\",
\"p99\", \"p999\"} (each [low, high]: Student-t over the replications), \"extra_calls\" (hedges
and retries per request), \"hedges\", \"hedges_won\", \"reaction\" (null, or {\"fair_share\", \"share_before\",
\"share_during\", \"share_after\", \"down_ms\", \"back_ms\"} with a slowdown), \"replications\"}, ...]}.
With --preset seed, the six objects are printed as JSON Lines (one per line, E1 first).")]
pub struct Args {
    /// A scenario file (TOML; see scenarios/*.toml for documented examples).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "sweep"])]
    pub scenario: Option<PathBuf>,
    /// A built-in experiment: e1, e2, e3, e4, e5, e6, or `seed` for all six; `e7` (long-lived
    /// multiplexed connections: per-connection against per-request balancing); `tail` (E8)
    /// or `reaction` (E9); `herd` (N = 1..16 proxies, each with its own balancer and share
    /// of the traffic, on the same 10 FIFO servers); `zones` (60/30/10 % of arrivals over
    /// zones of 4/4/3 endpoints: zone-unaware, Envoy's host-count rule, keel's load rule); `sticky` (E11: sessions
    /// moved when one of five endpoints fails, sticky cookie against ring-hash, Maglev,
    /// rendezvous); `fleet` (failed tries N = 1..32 proxies pay before all eject a failed
    /// endpoint: local outlier detection against shared evidence, with the closed form).
    #[arg(long, value_name = "ID", conflicts_with = "sweep")]
    pub preset: Option<String>,
    /// The sweep (docs/tail-latency.md, "The sweep"): load 0.5-0.97, 0-30 % slow servers at
    /// 1-5x, 10-200 servers, 1-1000 balancers, for random, round-robin, least-request,
    /// peak-ewma and prequal with and without hedging; prints the verdicts.
    #[arg(long)]
    pub sweep: bool,
    /// With --sweep: the CI-sized grid (12 cells, fewer requests).
    #[arg(long, requires = "sweep")]
    pub quick: bool,
    /// With --sweep: write sweep.csv, sweep.json and the heat maps (SVG) into this directory.
    #[arg(long, value_name = "DIR", requires = "sweep")]
    pub out: Option<PathBuf>,
    /// Seed of every random choice (overrides the scenario's); same seed, same results.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Replications per row (overrides the scenario's); the 95 % interval is over them.
    #[arg(long)]
    pub replications: Option<u32>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Machine-readable output (see below).
    #[arg(long)]
    pub json: bool,
    /// Tables with every column (wider than 100 columns).
    #[arg(long)]
    pub wide: bool,
    /// Also write SVG charts into this directory: for `tail`, latency distributions per
    /// strategy at each load and p99 against load; for `reaction`, the slowed server's share
    /// of calls over time.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
}

/// How `ci95` is computed, stated in every JSON report.
const CI_METHOD: &str = "union of a Student-t 95% interval over replication success rates and \
a Wilson 95% interval on the pooled request counts";

/// One experiment's report, as printed.
#[derive(Serialize)]
struct Report<'a> {
    experiment: &'a str,
    title: &'a str,
    calls_per_second: f64,
    calls_per_cpu_second: Option<f64>,
    wall_seconds: f64,
    threads: usize,
    ci_method: &'static str,
    results: &'a [SimResult],
}

/// E7 (long-lived multiplexed connections): its own simulation, a table or JSON Lines.
fn multiplex(args: &Args) -> anyhow::Result<()> {
    use keel_model::multiplex;
    let results: Vec<_> = multiplex::e7()
        .into_iter()
        .map(|mut s| {
            if let Some(seed) = args.seed {
                s.seed = seed;
            }
            multiplex::run(&s)
        })
        .collect();
    if args.json {
        for r in &results {
            let s = &r.scenario;
            let (lo, hi) = r.success_ci95();
            let row = serde_json::json!({
                "experiment": "e7",
                "strategy": s.strategy.to_string(),
                "balancing": s.granularity.name(),
                "failure_mode": s.fault.name(),
                "protections": s.protections,
                "clients": s.clients,
                "endpoints": s.endpoints,
                "calls": r.calls,
                "success": r.success(),
                "ci95": [lo, hi],
                "max_over_mean": r.max_over_mean,
                "per_endpoint": r.per_endpoint,
                "analytic_success": r.analytic_success,
                "analytic_max_over_mean": r.analytic_max_over_mean,
            });
            println!("{row}");
        }
    } else {
        print_lines(&e7_answer(&results));
        println!("E7: long-lived multiplexed connections, 4 clients x 1 connection, 8 endpoints (endpoint 0 fails)\n");
        print!("{}", multiplex::table(&results));
    }
    Ok(())
}

/// The zone experiment: its own simulation, a table or JSON Lines (and a chart with --plot).
fn zones(args: &Args) -> anyhow::Result<()> {
    use keel_model::zones;
    let results: Vec<_> = zones::preset(args.seed.unwrap_or(1))
        .iter()
        .map(zones::run)
        .collect();
    if args.json {
        for r in &results {
            let s = &r.scenario;
            let row = serde_json::json!({
                "experiment": "zones",
                "rule": s.rule.name(),
                "zones": s.zones.iter().map(|z| serde_json::json!({"zone": z.0, "endpoints": z.1, "arrivals": z.2})).collect::<Vec<_>>(),
                "rho": s.rho,
                "calls": r.calls,
                "cross_zone": r.cross_zone,
                "closed_form": s.closed_form().map(|c| serde_json::json!({"cross_zone": c.0, "offered": c.1})),
                "erlang_cross_zone": match s.rule { zones::ZoneRule::Load(t) => Some(s.erlang_cross_zone(t)), _ => None },
                "offered": r.offered,
                "busy": r.busy,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
            });
            println!("{row}");
        }
    } else {
        print_lines(&zones_answer(&results));
        println!(
            "ZONES: 60/30/10 % of arrivals in zones a/b/c (4/4/3 endpoints of 8 slots, 10 ms),"
        );
        println!("offered load 0.7, one balancer per zone\n");
        print!("{}", zones::table(&results));
    }
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("zones.svg");
        zones::chart(&path, &results)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// E11 (sticky sessions): a table or JSON Lines.
fn sticky(args: &Args) -> anyhow::Result<()> {
    use keel_model::sticky;
    let results = sticky::preset(args.seed.unwrap_or(1));
    if args.json {
        for r in &results {
            let row = serde_json::json!({
                "experiment": "e11",
                "affinity": r.affinity.name(),
                "loss": r.loss.name(),
                "sessions": r.sessions,
                "must_move": r.must_move,
                "moved": r.moved,
                "moved_needlessly": r.moved_needlessly,
                "moved_back": r.moved_back,
            });
            println!("{row}");
        }
    } else {
        print_lines(&sticky_answer(&results));
        println!("E11: sessions moved when one of five endpoints goes away and comes back, 10,000 sessions\n");
        print!("{}", sticky::table(&results));
    }
    Ok(())
}

/// "What this run shows" and its lines, wrapped to [`COLUMNS`]; nothing when there are none.
fn print_lines(findings: &[String]) {
    if findings.is_empty() {
        return;
    }
    println!("What this run shows:");
    for f in findings {
        for (i, line) in crate::lab::answer::wrap(f, COLUMNS, "  ")
            .into_iter()
            .enumerate()
        {
            if i == 0 {
                println!("- {}", &line[2..]);
            } else {
                println!("{line}");
            }
        }
    }
    println!();
}

/// E7's finding per failure mode: deciding per request against per connection, and what a
/// per-request strategy without protections can still lose.
fn e7_answer(results: &[keel_model::multiplex::MultiplexResult]) -> Vec<String> {
    use keel_model::multiplex::{Fault, Granularity, MultiplexResult};
    let who = |r: &MultiplexResult| {
        format!(
            "{}{}",
            r.scenario.strategy,
            if r.scenario.protections {
                " with protections"
            } else {
                ""
            }
        )
    };
    let mut out = Vec::new();
    for fault in [Fault::Hang, Fault::FastError] {
        let of = |g: Granularity| {
            results
                .iter()
                .filter(move |r| r.scenario.fault == fault && r.scenario.granularity == g)
        };
        let by_success =
            |a: &&MultiplexResult, b: &&MultiplexResult| a.success().total_cmp(&b.success());
        let (Some(req), Some(conn)) = (
            of(Granularity::PerRequest).max_by(by_success),
            of(Granularity::PerConnection).max_by(by_success),
        ) else {
            continue;
        };
        let (lo, hi) = req.success_ci95();
        let closed = conn
            .analytic_success
            .map_or_else(String::new, |a| format!(" (closed form {a:.4})"));
        let mut s = format!(
            "E7 ({}): decide per request. {} per request reaches {:.4} [{lo:.4}, {hi:.4}]; per \
             connection the best is {:.4}{closed}, protections or not: a connection pinned to \
             the failed endpoint fails until it closes",
            fault.name(),
            who(req),
            req.success(),
            conn.success()
        );
        if let Some(low) = of(Granularity::PerRequest)
            .min_by(by_success)
            .filter(|r| r.success() < conn.success())
        {
            s.push_str(&format!(
                ". Per request without protections, {} falls to {:.4}",
                who(low),
                low.success()
            ));
            if fault == Fault::FastError
                && low.scenario.strategy == keel_balance::StrategyKind::LeastConnections
            {
                s.push_str(" (the failing endpoint empties first, so it gets the most calls)");
            }
        }
        s.push('.');
        out.push(s);
    }
    out
}

/// The zones' finding: of the rules that overload no zone and keep p99 within 5 % of the lowest,
/// the one that keeps the most calls in their zone; and what a rule that overloads a zone costs.
fn zones_answer(results: &[keel_model::zones::ZoneResult]) -> Vec<String> {
    use keel_model::zones::ZoneResult;
    let max_offered = |r: &ZoneResult| r.offered.iter().copied().fold(0.0, f64::max);
    let fit: Vec<&ZoneResult> = results.iter().filter(|r| max_offered(r) < 1.0).collect();
    let low_p99 = fit.iter().map(|r| r.p99_ms).fold(f64::INFINITY, f64::min);
    let best = fit
        .iter()
        .filter(|r| r.p99_ms <= low_p99 * 1.05)
        .min_by(|a, b| a.cross_zone.total_cmp(&b.cross_zone));
    let Some(best) = best else {
        return Vec::new();
    };
    let mut s = format!(
        "ZONES: {} keeps {:.1} % of calls in their zone with p99 {:.1} ms (the lowest is {:.1} ms)",
        best.scenario.rule.name(),
        (1.0 - best.cross_zone) * 100.0,
        best.p99_ms,
        low_p99
    );
    if let Some(unaware) = results
        .iter()
        .find(|r| r.scenario.rule.name() == "zone-unaware" && !std::ptr::eq(*r, *best))
    {
        s.push_str(&format!(
            "; zone-unaware sends {:.1} % across zones",
            unaware.cross_zone * 100.0
        ));
    }
    if let Some(worst) = results
        .iter()
        .filter(|r| max_offered(r) >= 1.0)
        .max_by(|a, b| a.p99_ms.total_cmp(&b.p99_ms))
    {
        s.push_str(&format!(
            "; {} keeps more local ({:.1} %) but offers its busiest zone {:.2} of its capacity, \
             and p99 rises to {:.0} ms",
            worst.scenario.rule.name(),
            (1.0 - worst.cross_zone) * 100.0,
            max_offered(worst),
            worst.p99_ms
        ));
    }
    s.push('.');
    vec![s]
}

/// E11's finding per way of losing the endpoint: the affinity that moves the fewest sessions
/// needlessly, against the closed form's least share that must move.
fn sticky_answer(results: &[keel_model::sticky::StickyResult]) -> Vec<String> {
    use keel_model::sticky::Loss;
    let mut out = Vec::new();
    for loss in [Loss::Unhealthy, Loss::Removed] {
        let rows: Vec<_> = results.iter().filter(|r| r.loss == loss).collect();
        let cost = |r: &keel_model::sticky::StickyResult| r.moved_needlessly + r.moved_back;
        let best = rows.iter().min_by(|a, b| cost(a).total_cmp(&cost(b)));
        let worst = rows.iter().max_by(|a, b| cost(a).total_cmp(&cost(b)));
        let (Some(best), Some(worst)) = (best, worst) else {
            continue;
        };
        out.push(format!(
            "E11 (endpoint {}): {} moves {:.3} of sessions where {:.3} must move ({:.3} \
             needlessly, {:.3} back when it returns); {} moves {:.3} needlessly and {:.3} back.",
            loss.name(),
            best.affinity.name(),
            best.moved,
            best.must_move,
            best.moved_needlessly,
            best.moved_back,
            worst.affinity.name(),
            worst.moved_needlessly,
            worst.moved_back
        ));
    }
    out
}

/// The fleet of balancers: the answer, then a table, or JSON Lines.
fn fleet(args: &Args) -> anyhow::Result<()> {
    use keel_model::fleet;
    let reps = args.replications.unwrap_or(fleet::REPLICATIONS);
    let rows = fleet::preset(args.seed.unwrap_or(1), reps)?;
    if args.json {
        for r in &rows {
            for x in [&r.local, &r.shared] {
                let s = &x.setting;
                let row = serde_json::json!({
                    "experiment": "fleet", "proxies": s.proxies, "endpoints": s.endpoints,
                    "threshold": s.threshold, "rate": s.rate, "failure_mode": s.failure.name(),
                    "traffic": fleet::arrivals_name(s.arrivals), "detection": s.detection.name(),
                    "failed_tries": x.mean, "ci95": [x.ci95.0, x.ci95.1],
                    "closed_form": x.closed_form, "replications": x.replications,
                    "ejected_everywhere": x.ejected_everywhere, "seconds_to_eject": x.mean_time_s,
                });
                println!("{row}");
            }
        }
    } else {
        print!("{}", fleet::headline(&rows));
        println!("\nFLEET: failed tries until every proxy has ejected 1 failed endpoint of 10 (5 in a row),");
        println!("200 requests/s, shared evidence 50 ms behind (quorum 1), {reps} replications\n");
        print!("{}", fleet::table(&rows));
    }
    Ok(())
}

/// Runs `keel simulate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.replications == Some(0) {
        return usage("--replications must be at least 1");
    }
    if args.replications.is_some_and(|r| r > 10_000) {
        return usage("--replications must be at most 10000");
    }
    if args
        .preset
        .as_deref()
        .is_some_and(|p| p.eq_ignore_ascii_case("e7") || p.eq_ignore_ascii_case("multiplex"))
    {
        return multiplex(&args);
    }
    if args
        .preset
        .as_deref()
        .is_some_and(|p| p.eq_ignore_ascii_case("zones"))
    {
        return zones(&args);
    }
    if args
        .preset
        .as_deref()
        .is_some_and(|p| p.eq_ignore_ascii_case("sticky") || p.eq_ignore_ascii_case("e11"))
    {
        return sticky(&args);
    }
    if args
        .preset
        .as_deref()
        .is_some_and(|p| p.eq_ignore_ascii_case("fleet"))
    {
        return fleet(&args);
    }
    if args.sweep {
        return sweep(&args);
    }
    let experiments: Vec<Experiment> = match (&args.scenario, &args.preset) {
        (Some(path), None) => {
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) => {
                    return usage(format!("cannot read scenario file {}: {e}", path.display()))
                }
            };
            let sc = match Scenario::from_toml_str(&text, &path.display().to_string()) {
                Ok(sc) => sc,
                Err(e) => return usage(e.to_string()),
            };
            vec![Experiment {
                id: "scenario",
                title: "scenario file",
                rows: vec![sc],
            }]
        }
        (None, Some(id)) if id.eq_ignore_ascii_case("seed") => presets::all(),
        (None, Some(id)) => match presets::preset(id) {
            Some(e) => vec![e],
            None => {
                return usage(format!(
                    "unknown preset `{id}`; allowed: {}, seed, e7, zones, sticky, fleet, {}",
                    presets::IDS.join(", "),
                    presets::TAIL_IDS.join(", ")
                ))
            }
        },
        _ => {
            return usage(
                "give --scenario FILE, --preset ID (e1..e6, seed, tail, reaction) or --sweep",
            )
        }
    };
    let experiments: Vec<Experiment> = experiments
        .into_iter()
        .map(|mut e| {
            if let Some(seed) = args.seed {
                e = e.with_seed(seed);
            }
            if let Some(r) = args.replications {
                e = e.with_replications(r);
            }
            e
        })
        .collect();

    let total: u64 = experiments
        .iter()
        .map(|e| sim::total_requests(&e.rows))
        .sum();
    let bar = progress_bar(total, args.quiet);
    // Tables wait for the last experiment, so that the output opens with what they show.
    let mut done: Vec<(String, &str, BatchReport)> = Vec::new();
    for exp in &experiments {
        bar.set_message(exp.id.to_string());
        let progress = |n: u64| bar.inc(n);
        let report = match sim::run_batch(&exp.rows, &progress) {
            Ok(r) => r,
            Err(e) => return usage(e.to_string()),
        };
        // A scenario file names its own experiment.
        let id = if exp.id == "scenario" {
            exp.rows[0].name.as_str()
        } else {
            exp.id
        };
        if args.json {
            bar.suspend(|| print_report(id, exp.title, &report, true, false))?;
        }
        if let Some(dir) = &args.plot {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            for path in write_charts(dir, &report.results)? {
                bar.suspend(|| eprintln!("wrote {}", path.display()));
            }
        }
        if !args.json {
            done.push((id.to_string(), exp.title, report));
        }
    }
    bar.finish_and_clear();
    print_answer(&done);
    for (id, title, report) in &done {
        print_report(id, title, report, false, args.wide)?;
    }
    Ok(())
}

/// Width of terminal output without `--wide`.
const COLUMNS: usize = 100;

/// "What this run shows": per experiment of success rates, the best strategy and protections
/// where the choice matters most (the scenario whose rows differ most), the margin over the
/// runner-up with its 95 % interval (Newcombe's, from the two intervals), and the closed form.
fn print_answer(done: &[(String, &str, BatchReport)]) {
    let findings: Vec<String> = done
        .iter()
        .filter_map(|(id, _, report)| finding(id, &report.results))
        .collect();
    print_lines(&findings);
}

/// One experiment's finding, or None: the reaction to a slowed server (E9), latency under load
/// (E8 and queueing scenarios), else success rates.
fn finding(id: &str, results: &[SimResult]) -> Option<String> {
    if results.is_empty() {
        return None;
    }
    let id = id.to_uppercase();
    if results.iter().any(|r| r.reaction.is_some()) {
        return reaction_finding(&id, results);
    }
    if results.iter().any(|r| r.load.is_some()) {
        let parts = tail_findings(&id, results);
        return (!parts.is_empty()).then(|| parts.join(" "));
    }
    let mut labels: Vec<&str> = Vec::new();
    for r in results {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    let rows_of =
        |l: &str| -> Vec<&SimResult> { results.iter().filter(|r| r.label == l).collect() };
    let spread = |l: &str| {
        let xs = rows_of(l);
        xs.iter().map(|r| r.success).fold(0.0, f64::max)
            - xs.iter().map(|r| r.success).fold(1.0, f64::min)
    };
    let closed = |r: &SimResult| {
        r.analytic_success.map_or(String::new(), |a| {
            format!(
                " Closed form {a:.4}, {} the simulated interval.",
                if (r.ci95[0]..=r.ci95[1]).contains(&a) {
                    "inside"
                } else {
                    "outside"
                }
            )
        })
    };
    let who = |r: &SimResult| {
        if r.protections == "none" {
            r.strategy.clone()
        } else {
            format!("{} with {}", r.strategy, r.protections)
        }
    };
    // Every row protected: the lowest success is the answer.
    if results.iter().all(|r| r.protections != "none") {
        let worst = results
            .iter()
            .min_by(|a, b| a.success.total_cmp(&b.success))?;
        let bound = results.iter().map(|r| r.ci95[0]).fold(1.0, f64::min);
        return Some(format!(
            "{id} (protections): every one of {} rows reaches {:.4} or more (lowest 95% bound \
             {bound:.4}; lowest: {}, {}).",
            results.len(),
            worst.success,
            who(worst),
            worst.label
        ));
    }
    let label = labels
        .iter()
        .copied()
        .filter(|l| rows_of(l).len() > 1)
        .max_by(|a, b| spread(a).total_cmp(&spread(b)));
    let Some(label) = label else {
        // One row per scenario: its success and closed form.
        let r = results
            .iter()
            .max_by(|a, b| a.success.total_cmp(&b.success))?;
        return Some(format!(
            "{id} ({}): {} {:.4} [{:.4}, {:.4}].{}",
            r.label,
            who(r),
            r.success,
            r.ci95[0],
            r.ci95[1],
            closed(r)
        ));
    };
    let mut rows = rows_of(label);
    rows.sort_by(|a, b| b.success.total_cmp(&a.success));
    // Rows of one scenario that differ only in how the server fails are one strategy under two
    // failures, not two choices: each failure's value is said, none is "best over" another.
    let by_mode = rows.iter().any(|r| r.failure_mode != rows[0].failure_mode);
    if by_mode && rows.iter().all(|r| who(r) == who(rows[0])) {
        let parts: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{:.4} [{:.4}, {:.4}] ({})",
                    r.success, r.ci95[0], r.ci95[1], r.failure_mode
                )
            })
            .collect();
        let closed_forms: String = rows
            .iter()
            .filter(|r| r.analytic_success.is_some())
            .map(|r| format!(" {}:{}", r.failure_mode, closed(r)))
            .collect();
        return Some(format!(
            "{id} ({label}): {} measured {}: one strategy, so the failure mode makes the \
             difference.{closed_forms}",
            who(rows[0]),
            parts.join(", ")
        ));
    }
    // Several strategies under several failures: they are ranked within the best row's failure.
    if by_mode {
        let mode = rows[0].failure_mode.clone();
        rows.retain(|r| r.failure_mode == mode);
        if rows.len() < 2 {
            let r = rows[0];
            return Some(format!(
                "{id} ({label}): {} {:.4} [{:.4}, {:.4}] ({}).{}",
                who(r),
                r.success,
                r.ci95[0],
                r.ci95[1],
                r.failure_mode,
                closed(r)
            ));
        }
    }
    let who = |r: &SimResult| {
        if by_mode {
            format!("{} ({})", who(r), r.failure_mode)
        } else {
            who(r)
        }
    };
    let (best, next) = (rows[0], rows[1]);
    let ci = crate::lab::answer::difference_ci(best.success, best.ci95, next.success, next.ci95);
    let m = best.success - next.success;
    let mut s = format!(
        "{id} ({label}): {} is best at {:.4} [{:.4}, {:.4}], {m:+.4} [{:+.4}, {:+.4}] over {} \
         ({:.4}){}",
        who(best),
        best.success,
        best.ci95[0],
        best.ci95[1],
        ci[0],
        ci[1],
        who(next),
        next.success,
        if ci[0] <= 0.0 { ", a tie" } else { "" }
    );
    if let Some(worst) = rows
        .last()
        .filter(|w| rows.len() > 2 && w.success < next.success)
    {
        s.push_str(&format!("; {} lowest at {:.4}", who(worst), worst.success));
    }
    s.push('.');
    s.push_str(&closed(best));
    Some(s)
}

/// E9's finding: which strategy moved calls off the slowed servers fastest, and which never did.
fn reaction_finding(id: &str, results: &[SimResult]) -> Option<String> {
    let rows: Vec<(&SimResult, &Reaction)> = results
        .iter()
        .filter_map(|r| r.reaction.as_ref().map(|x| (r, x)))
        .collect();
    // Fastest down first; a strategy that never moved away ranks last, by its share while slow.
    let key = |x: &Reaction| (x.down_ms.unwrap_or(f64::INFINITY), x.share_during);
    let best = rows.iter().min_by(|a, b| {
        key(a.1)
            .partial_cmp(&key(b.1))
            .unwrap_or(std::cmp::Ordering::Equal)
    })?;
    let (r, x) = best;
    let Some(down) = x.down_ms else {
        return Some(format!(
            "{id} ({}): no strategy moved calls off the slowed servers while they were slow \
             (fair share {:.3}; lowest share while slowed {:.3}, {}).",
            r.label, x.fair_share, x.share_during, r.strategy
        ));
    };
    let mut never: Vec<&str> = Vec::new();
    for (r, _) in rows.iter().filter(|(_, x)| x.down_ms.is_none()) {
        if !never.contains(&r.strategy.as_str()) {
            never.push(&r.strategy);
        }
    }
    let mut s = format!(
        "{id} ({}): {} reacts fastest: the slowed servers' share fell below half their fair \
         share ({:.3}) {down:.0} ms after they slowed, {:.3} of calls while slow; p99 {:.2} ms",
        r.label, r.strategy, x.fair_share, x.share_during, r.latency_ms.p99
    );
    if !never.is_empty() {
        s.push_str(&format!(
            "; {} never moved away (blind to latency: the fair share stays)",
            never.join(", ")
        ));
    }
    s.push('.');
    Some(s)
}

/// Latency under load: at the highest load, per scenario (placement), the strategy with the
/// lowest p99 among those that lose nothing (success within the best's interval), against the
/// next and the highest.
fn tail_findings(id: &str, results: &[SimResult]) -> Vec<String> {
    let top_load = results
        .iter()
        .filter_map(|r| r.load)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut labels: Vec<&str> = Vec::new();
    for r in results.iter().filter(|r| r.load == Some(top_load)) {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    let who = |r: &SimResult| {
        if r.protections == "none" {
            r.strategy.clone()
        } else {
            format!("{} with {}", r.strategy, r.protections)
        }
    };
    let mut out = Vec::new();
    for label in labels {
        let mut rows: Vec<&SimResult> = results.iter().filter(|r| r.label == label).collect();
        let top = rows.iter().map(|r| r.ci95[0]).fold(0.0, f64::max);
        rows.retain(|r| r.ci95[1] >= top);
        rows.sort_by(|a, b| a.latency_ms.p99.total_cmp(&b.latency_ms.p99));
        let Some(best) = rows.first() else { continue };
        let ci = best.latency_ci95_ms.p99;
        let mut s = format!(
            "{id} ({label}): {} has the lowest p99, {:.1} ms [{:.1}, {:.1}]",
            who(best),
            best.latency_ms.p99,
            ci[0],
            ci[1]
        );
        if let Some(next) = rows.get(1) {
            let tie = next.latency_ci95_ms.p99[0] <= ci[1];
            s.push_str(&format!(
                ", {:.1} ms under {} ({:.1} ms){}",
                next.latency_ms.p99 - best.latency_ms.p99,
                who(next),
                next.latency_ms.p99,
                if tie {
                    ", a tie: the intervals overlap"
                } else {
                    ""
                }
            ));
        }
        if let Some(worst) = rows.last().filter(|_| rows.len() > 2) {
            s.push_str(&format!(
                "; {} highest at {:.1} ms",
                who(worst),
                worst.latency_ms.p99
            ));
        }
        s.push('.');
        out.push(s);
    }
    out
}

/// `--sweep`: every cell's rows as one parallel batch, then the verdicts (and files with --out).
fn sweep(args: &Args) -> anyhow::Result<()> {
    use keel_model::sweep::{self, Grid};
    let mut grid = if args.quick {
        Grid::quick()
    } else {
        Grid::full()
    };
    if let Some(r) = args.replications {
        grid.replications = r;
    }
    let mut rows = sweep::scenarios(&grid);
    if let Some(seed) = args.seed {
        for (_, sc) in &mut rows {
            sc.seed = seed;
        }
    }
    let scenarios: Vec<Scenario> = rows.iter().map(|(_, sc)| sc.clone()).collect();
    let bar = progress_bar(sim::total_requests(&scenarios), args.quiet);
    bar.set_message(format!("{} cells", grid.cells().len()));
    let progress = |n: u64| bar.inc(n);
    let result = match sweep::run(&grid, &progress) {
        Ok(r) => r,
        Err(e) => return usage(e.to_string()),
    };
    bar.finish_and_clear();
    if args.json {
        for r in &result.rows {
            println!("{}", serde_json::to_string(r).context("serialising a row")?);
        }
    } else {
        println!(
            "SWEEP: {} cells x {} rows, {} calls in {:.1} s\n",
            grid.cells().len(),
            sweep::STRATEGIES.len() * 2,
            result.calls,
            result.wall.as_secs_f64()
        );
        print!("{}", result.verdict().text());
    }
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let csv = dir.join("sweep.csv");
        std::fs::write(&csv, result.csv()).with_context(|| format!("writing {}", csv.display()))?;
        let json = dir.join("sweep.json");
        let body = serde_json::json!({ "grid": result.grid, "rows": result.rows });
        std::fs::write(&json, serde_json::to_string_pretty(&body)?)
            .with_context(|| format!("writing {}", json.display()))?;
        eprintln!("wrote {}", csv.display());
        eprintln!("wrote {}", json.display());
        for p in sweep::heat_maps(dir, &result)? {
            eprintln!("wrote {}", p.display());
        }
    }
    Ok(())
}

fn progress_bar(total: u64, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>4} [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} requests ({eta})",
        )
        .expect("valid template"),
    );
    bar
}

fn print_report(
    id: &str,
    title: &str,
    report: &BatchReport,
    json: bool,
    wide: bool,
) -> anyhow::Result<()> {
    if json {
        let out = Report {
            experiment: id,
            title,
            calls_per_second: report.calls_per_second(),
            calls_per_cpu_second: report.calls_per_cpu_second(),
            wall_seconds: report.wall.as_secs_f64(),
            threads: report.threads,
            ci_method: CI_METHOD,
            results: &report.results,
        };
        println!(
            "{}",
            serde_json::to_string(&out).context("serialising the report")?
        );
        return Ok(());
    }
    let heading = format!("{}: {title}", id.to_uppercase());
    if wide {
        println!("{heading}");
    } else {
        for line in crate::lab::answer::wrap(&heading, COLUMNS, "") {
            println!("{line}");
        }
    }
    if id == "herd" {
        print_herd_table(&report.results, wide);
    } else if report.results.iter().any(|r| r.reaction.is_some()) {
        print_reaction_table(&report.results, wide);
    } else if report.results.iter().any(|r| r.load.is_some()) {
        print_tail_table(&report.results, wide);
    } else if wide {
        print_reliability_table(&report.results);
    } else {
        print_narrow_reliability_table(&report.results);
    }
    let cpu = report.calls_per_cpu_second().map_or_else(String::new, |c| {
        format!(", {:.2} M per CPU second", c / 1e6)
    });
    println!(
        "  {} calls in {:.2} s on {} thread(s): {:.2} M calls/s per thread{cpu}\n",
        report.calls,
        report.wall.as_secs_f64(),
        report.threads,
        report.calls_per_second() / 1e6
    );
    Ok(())
}

/// `s` in at most `w` characters (cut with a `~` when longer).
fn fit(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
        out.push('~');
        out
    }
}

/// Success and where calls went in 100 columns: each scenario's label on a line of its own,
/// its rows under it (every column: --wide).
fn print_narrow_reliability_table(results: &[SimResult]) {
    println!(
        "    {:<18} {:<26} {:>7} {:>15} {:>7} {:>6} {:>8}",
        "strategy", "protections", "success", "95% CI", "closed", "fail%", "p99 ms"
    );
    let mut label: Option<&str> = None;
    for r in results {
        if label != Some(r.label.as_str()) {
            println!("  {}", fit(&r.label, COLUMNS - 2));
            label = Some(&r.label);
        }
        println!(
            "    {:<18} {:<26} {:>7.4} [{:.4},{:.4}] {:>7} {:>6.1} {:>8.1}",
            fit(&r.strategy, 18),
            fit(&r.protections, 26),
            r.success,
            r.ci95[0],
            r.ci95[1],
            r.analytic_success
                .map_or_else(|| "-".to_string(), |a| format!("{a:.4}")),
            r.failed_pick_share * 100.0,
            r.latency_ms.p99,
        );
    }
}

/// Success and where calls went (E1-E6 and scenario files), with request latency: every
/// column, the label column as wide as the widest label.
fn print_reliability_table(results: &[SimResult]) {
    let w = results
        .iter()
        .map(|r| r.label.chars().count())
        .max()
        .unwrap_or(5)
        .max(5);
    println!(
        "  {:<w$} {:<18} {:<27} {:>8} {:>19} {:>9} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "label",
        "strategy",
        "protections",
        "success",
        "95% CI",
        "analytic",
        "failed%",
        "max%",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "p99.9 ms"
    );
    for r in results {
        let analytic = r
            .analytic_success
            .map_or_else(|| "-".to_string(), |a| format!("{a:.5}"));
        let l = &r.latency_ms;
        println!(
            "  {:<w$} {:<18} {:<27} {:>8.5} [{:.5},{:.5}] {:>9} {:>8.3} {:>7.1} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            r.label,
            r.strategy,
            r.protections,
            r.success,
            r.ci95[0],
            r.ci95[1],
            analytic,
            r.failed_pick_share * 100.0,
            r.max_server_share * 100.0,
            l.mean,
            l.p50,
            l.p99,
            l.p999,
        );
    }
}

/// Latency under load (E8 and scenario files with servers that queue).
fn print_tail_table(results: &[SimResult], wide: bool) {
    if !wide {
        println!(
            "    {:<12} {:<18} {:<14} {:>5} {:>7} {:>8} {:>8} {:>8} {:>6}",
            "placement",
            "strategy",
            "protections",
            "load",
            "success",
            "p50 ms",
            "p99 ms",
            "p99.9 ms",
            "extra%"
        );
        let mut label: Option<&str> = None;
        for r in results {
            if label != Some(r.label.as_str()) {
                println!("  {}", fit(&r.label, COLUMNS - 2));
                label = Some(&r.label);
            }
            let l = &r.latency_ms;
            println!(
                "    {:<12} {:<18} {:<14} {:>5} {:>7.4} {:>8.2} {:>8.2} {:>8.2} {:>6.2}",
                fit(&r.placement, 12),
                fit(&r.strategy, 18),
                fit(&r.protections, 14),
                r.load.map_or_else(|| "-".into(), |x| format!("{x:.2}")),
                r.success,
                l.p50,
                l.p99,
                l.p999,
                r.extra_calls * 100.0,
            );
        }
        return;
    }
    println!(
        "  {:<44} {:<12} {:<18} {:<14} {:>5} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "label",
        "placement",
        "strategy",
        "protections",
        "load",
        "success",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "extra%"
    );
    for r in results {
        let l = &r.latency_ms;
        println!(
            "  {:<44} {:<12} {:<18} {:<14} {:>5} {:>8.5} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7.2}",
            r.label,
            r.placement,
            r.strategy,
            r.protections,
            r.load.map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            r.success,
            l.mean,
            l.p50,
            l.p99,
            l.p999,
            r.extra_calls * 100.0,
        );
    }
}

/// The herd: latency quantiles with their 95 % intervals.
fn print_herd_table(results: &[SimResult], wide: bool) {
    if !wide {
        println!(
            "    {:<14} {:>8} {:>20} {:>22} {:>22}",
            "strategy", "success", "p50 ms [95% CI]", "p99 ms [95% CI]", "p99.9 ms [95% CI]"
        );
        let q = |v: f64, ci: [f64; 2]| format!("{v:.1} [{:.1},{:.1}]", ci[0], ci[1]);
        let mut label: Option<&str> = None;
        for r in results {
            if label != Some(r.label.as_str()) {
                println!("  {}", fit(&r.label, COLUMNS - 2));
                label = Some(&r.label);
            }
            let (l, c) = (&r.latency_ms, &r.latency_ci95_ms);
            println!(
                "    {:<14} {:>8.5} {:>20} {:>22} {:>22}",
                fit(&r.strategy, 14),
                r.success,
                q(l.p50, c.p50),
                q(l.p99, c.p99),
                q(l.p999, c.p999),
            );
        }
        return;
    }
    println!(
        "  {:<24} {:<14} {:>8} {:>8} {:>20} {:>22} {:>22}",
        "label",
        "strategy",
        "success",
        "mean ms",
        "p50 ms [95% CI]",
        "p99 ms [95% CI]",
        "p99.9 ms [95% CI]"
    );
    let q = |v: f64, ci: [f64; 2]| format!("{v:.1} [{:.1},{:.1}]", ci[0], ci[1]);
    for r in results {
        let (l, c) = (&r.latency_ms, &r.latency_ci95_ms);
        println!(
            "  {:<24} {:<14} {:>8.5} {:>8.2} {:>20} {:>22} {:>22}",
            r.label,
            r.strategy,
            r.success,
            l.mean,
            q(l.p50, c.p50),
            q(l.p99, c.p99),
            q(l.p999, c.p999),
        );
    }
}

/// The "down ms" and "back ms" cells of a reaction row.
fn reaction_cells(x: &Reaction) -> (String, String) {
    let down = x
        .down_ms
        .map_or_else(|| "never".into(), |d| format!("{d:.0}"));
    let back = match (x.down_ms, x.back_ms) {
        (None, _) => "-".into(),
        (Some(_), None) => "never".into(),
        (Some(_), Some(b)) => format!("{b:.0}"),
    };
    (down, back)
}

/// How fast the slowed servers' share of calls fell and came back (E9).
fn print_reaction_table(results: &[SimResult], wide: bool) {
    if !wide {
        println!(
            "    {:<16} {:>6} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
            "strategy", "fair", "before", "during", "after", "down ms", "back ms", "p99 ms"
        );
        let mut label: Option<&str> = None;
        for r in results {
            let Some(x) = &r.reaction else { continue };
            if label != Some(r.label.as_str()) {
                println!("  {}", fit(&r.label, COLUMNS - 2));
                label = Some(&r.label);
            }
            let (down, back) = reaction_cells(x);
            println!(
                "    {:<16} {:>6.3} {:>8.3} {:>8.3} {:>8.3} {:>9} {:>9} {:>9.2}",
                fit(&r.strategy, 16),
                x.fair_share,
                x.share_before,
                x.share_during,
                x.share_after,
                down,
                back,
                r.latency_ms.p99,
            );
        }
        return;
    }
    println!(
        "  {:<34} {:<16} {:>6} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "label", "strategy", "fair", "before", "during", "after", "down ms", "back ms", "p99 ms"
    );
    for r in results {
        let Some(x) = &r.reaction else { continue };
        let (down, back) = reaction_cells(x);
        println!(
            "  {:<34} {:<16} {:>6.3} {:>8.3} {:>8.3} {:>8.3} {:>9} {:>9} {:>9.2}",
            r.label,
            r.strategy,
            x.fair_share,
            x.share_before,
            x.share_during,
            x.share_after,
            down,
            back,
            r.latency_ms.p99,
        );
    }
}

/// A row's name in a chart's legend: placement, strategy, hedging.
fn legend(r: &SimResult) -> String {
    let placement = if r.placement == "client-side" {
        "client"
    } else {
        "server"
    };
    let hedge = if r.protections.contains("hedge") {
        " + hedge"
    } else {
        ""
    };
    format!("{placement} {}{hedge}", r.strategy)
}

/// Line style by placement and hedging, so that colours can stay with strategies.
fn style(r: &SimResult) -> Style {
    if r.protections.contains("hedge") {
        Style::Dashed
    } else if r.placement == "server-side" {
        Style::Dotted
    } else {
        Style::Line
    }
}

/// A stable colour per strategy.
fn strategy_color(strategy: &str) -> (u8, u8, u8) {
    let i = keel_balance::StrategyKind::ALL
        .iter()
        .position(|k| k.name() == strategy)
        .unwrap_or(keel_balance::StrategyKind::ALL.len());
    plot::palette(i)
}

/// The charts of an E8- or E9-shaped result set; returns the files written (none for others).
fn write_charts(dir: &Path, results: &[SimResult]) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    if results.iter().any(|r| r.reaction.is_some()) {
        for placement in ["server-side", "client-side"] {
            let series: Vec<Series> = results
                .iter()
                .filter(|r| r.placement == placement)
                .filter_map(|r| {
                    let x = r.reaction.as_ref()?;
                    let label = match r.label.split_once("decay ") {
                        Some((_, d)) => format!("{}, decay {d}", r.strategy),
                        None => r.strategy.clone(),
                    };
                    Some(Series::line(label, x.series.clone()))
                })
                .collect();
            if series.is_empty() {
                continue;
            }
            let spec = ChartSpec::new(
                format!("E9: the slowed server's share of calls ({placement})"),
                "time (s); the server is 5x slower from 10 s to 25 s",
                "share of calls (fair share 0.1)",
            )
            .y_range(0.0, 0.3);
            let path = dir.join(format!("reaction_{placement}.svg"));
            plot::write_svg(&path, &spec, &series)?;
            written.push(path);
        }
        return Ok(written);
    }
    let mut loads: Vec<f64> = results.iter().filter_map(|r| r.load).collect();
    if loads.is_empty() {
        return Ok(written);
    }
    loads.sort_by(f64::total_cmp);
    loads.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    // Latency distributions at each load, on a scale of nines: y = -log10(1 - F), so that p90,
    // p99 and p99.9 sit at 1, 2 and 3.
    for &load in &loads {
        let rows: Vec<&SimResult> = results
            .iter()
            .filter(|r| r.load.is_some_and(|l| (l - load).abs() < 1e-9))
            .collect();
        let x_max = rows.iter().map(|r| r.latency_ms.p999).fold(0.0, f64::max) * 1.05;
        let series: Vec<Series> = rows
            .iter()
            .map(|r| {
                let points = (0..=165)
                    .filter_map(|i| {
                        let nines = f64::from(i) * 0.02;
                        let f = 1.0 - 10f64.powf(-nines);
                        let (ms, _) = r.latency_cdf.iter().find(|(_, c)| *c >= f)?;
                        Some((*ms, nines))
                    })
                    .collect();
                Series::new(legend(r), points, style(r)).with_color(strategy_color(&r.strategy))
            })
            .collect();
        let spec = ChartSpec::new(
            format!("E8: request latency at load {load:.2}"),
            "latency (ms)",
            "nines: -log10(1 - F); 2 = p99, 3 = p99.9",
        )
        .x_range(0.0, x_max)
        .y_range(0.0, 3.3);
        let path = dir.join(format!("tail_cdf_load_{load:.2}.svg"));
        plot::write_svg(&path, &spec, &series)?;
        written.push(path);
    }
    // p99 against load, one line per (placement, strategy, hedging).
    let mut keys: Vec<String> = Vec::new();
    for r in results {
        if r.load.is_some() && !keys.contains(&legend(r)) {
            keys.push(legend(r));
        }
    }
    let series: Vec<Series> = keys
        .iter()
        .map(|k| {
            let rows: Vec<&SimResult> = results.iter().filter(|r| &legend(r) == k).collect();
            let points = rows
                .iter()
                .filter_map(|r| Some((r.load?, r.latency_ms.p99)))
                .collect();
            Series::new(k.clone(), points, style(rows[0]))
                .with_color(strategy_color(&rows[0].strategy))
        })
        .collect();
    let spec = ChartSpec::new(
        "E8: p99 latency against offered load",
        "offered load (fraction of capacity)",
        "p99 latency (ms)",
    );
    let path = dir.join("tail_p99_load.svg");
    plot::write_svg(&path, &spec, &series)?;
    written.push(path);
    Ok(written)
}
