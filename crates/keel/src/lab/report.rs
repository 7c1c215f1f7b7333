//! The lab's report: a table on stdout, `results.json`, and a self-contained `index.html` with
//! SVG charts of measured and simulated points over the analytic curves, and sentences that
//! compare the three, generated from the numbers.
//!
//! A measurement agrees with the model when the model's value lies inside its 95 % interval,
//! and with the simulation when the two differ by less than 1.96 standard errors of their
//! difference; nothing is added to either tolerance. A row that disagrees says by how many
//! standard errors, and why, from its own numbers.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_model::plot::{render_svg, ChartSpec, Series, Style};
use keel_model::FailureMode;

use crate::lab::cases::{Timing, DEFAULT_RETRIES, PROTECTIONS};
use crate::lab::experiment::Experiment;
use crate::lab::results::LabReport;
use crate::lab::rows::Row;
use crate::lab::style::{esc, fmt_q, pct, strategy_colour, REFERENCE};

/// What every row of an experiment shares, said once.
fn experiment_intro(e: &str, rows: &[&Row], t: &Timing) -> String {
    let first = rows[0];
    let q_of = |mode: &str| {
        rows.iter()
            .find(|r| r.failure_mode == mode)
            .and_then(|r| r.q)
            .unwrap_or(f64::NAN)
    };
    match e {
        "e1" => format!(
            "Round-robin and random, {} servers of which one fails (p = {:.1}), {} calls per \
             request, the failed server answering an error at once. Whatever the failure mode, a \
             call reaches the failed server with probability p, so the model gives (1 - p)^{} = \
             {:.3}, the article's example.",
            first.measured_attempts.len(),
            first.p,
            first.k,
            first.k,
            (1.0 - first.p).powi(first.k as i32)
        ),
        "e2" => format!(
            "Least-connections with the failed server hanging until the {:?} timeout: it holds a \
             call q = {} times as long as a healthy server takes, so with equal in-flight \
             counts it gets p / (p + q (1 - p)) of the calls and a request succeeds with the \
             model's {:.4}. {} requests in flight.",
            t.timeout,
            fmt_q(q_of("hang")),
            first.analytic.unwrap_or(f64::NAN),
            first.concurrency
        ),
        "e3" => "f(p): round-robin and least-connections with 0 to 4 of the 5 servers hanging \
                 (the points of the first chart)."
            .into(),
        "e4" => format!(
            "Fast failure: the failed server answers an error at once, in about the loopback \
             round trip, sooner than a healthy server answers (q = {} < 1). Least-connections \
             sees its slot free sooner and least-time measures it as the fastest, so both \
             favour it: the model's black hole. Peak-EWMA counts a failure as at least its \
             failure penalty (1 s by default), so a fast failure looks slow to it.",
            fmt_q(q_of("fail-fast"))
        ),
        "e5" => format!(
            "Client-side least-connections at low concurrency: {} clients, each with its own \
             balancer and one call in flight, so every pick sees in-flight counts of 0 and the \
             tie-break decides, not capacity. The model's values (for equal in-flight counts) \
             do not apply here; the rows show what happens instead.",
            first.concurrency
        ),
        "e6" => e6_summary(rows),
        "e6b" => e6b_summary(rows),
        _ => String::new(),
    }
}

/// E6B in one paragraph: keel proxy's defaults, one failed endpoint (of three, or of five
/// answering 500).
fn e6b_summary(rows: &[&Row]) -> String {
    let lowest = rows
        .iter()
        .map(|r| r.measured)
        .fold(f64::INFINITY, f64::min);
    let below: Vec<String> = rows
        .iter()
        .filter(|r| r.measured < 0.999)
        .map(|r| format!("{} / {} ({:.4})", r.strategy, r.failure_mode, r.measured))
        .collect();
    format!(
        "A cluster written with nothing but its endpoints, one of them failed (one of three \
         dead, or one of five answering 500, which no default retries): keel proxy's \
         defaults, no protection configured: outlier detection (an endpoint ejected after {} \
         failures in a row, for {}), {} retry on another endpoint within the default retry \
         budget ({} % of requests, at least {} per second), no health checks. Lowest measured \
         success {lowest:.4}{}.",
        keel_balance::OutlierConfig::default().consecutive_failures,
        humantime::format_duration(keel_balance::OutlierConfig::default().base_ejection_time),
        DEFAULT_RETRIES,
        keel_balance::RetryBudgetConfig::default().budget_percent,
        keel_balance::RetryBudgetConfig::default().min_retries_per_second,
        if below.is_empty() {
            ": every row holds the 0.999 goal".to_string()
        } else {
            format!("; below 0.999: {}", below.join(", "))
        }
    )
}

/// E6 in one paragraph: the rows differ only in their numbers.
fn e6_summary(rows: &[&Row]) -> String {
    let p = &PROTECTIONS;
    let lowest = rows
        .iter()
        .map(|r| r.measured)
        .fold(f64::INFINITY, f64::min);
    let lowest_bound = rows
        .iter()
        .map(|r| r.measured_ci95[0])
        .fold(f64::INFINITY, f64::min);
    let (share_lo, share_hi) = rows.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), r| {
        (
            lo.min(r.measured_failed_share),
            hi.max(r.measured_failed_share),
        )
    });
    let below: Vec<String> = rows
        .iter()
        .filter(|r| r.measured < 0.999)
        .map(|r| format!("{} / {} ({:.4})", r.strategy, r.failure_mode, r.measured))
        .collect();
    let m = rows[0].measured_attempts.len();
    let failed = (rows[0].p * m as f64).round() as usize;
    let mut s = format!(
        "Protections on: outlier ejection after {} failures in a row, up to {} retries on other \
         servers within a {}% retry budget, health checks every {:?}. In all {} rows \
         (strategies x failure modes) the measured success is at least {lowest:.4} (lowest \
         95% bound {lowest_bound:.4}); the failed server took between {} and {} of the \
         attempts before it was ejected or marked unhealthy, and retries on another server \
         covered the calls it failed. With {failed} of {m} servers failed and {} retries on \
         distinct servers, the model's chance that a call fails, C({failed}, {r1}) / C({m}, {r1}), \
         is {:.4}.",
        p.consecutive_failures,
        p.retries,
        p.budget_percent,
        p.health_interval,
        rows.len(),
        pct(share_lo),
        pct(share_hi),
        p.retries,
        analytic::retry_call_failure(m as u64, failed as u64, u64::from(p.retries)),
        r1 = p.retries + 1,
    );
    if below.is_empty() {
        s.push_str(" The goal of 0.999 is met in every row.");
    } else {
        let _ = write!(s, " Below the goal of 0.999: {}.", below.join(", "));
    }
    s
}

/// Rows of every experiment: the report's own row lists, and each experiment part's `rows`
/// (E10, the peers, E12: whatever a new experiment adds under its field).
fn row_count(report: &LabReport) -> usize {
    let v = serde_json::to_value(report).expect("a lab report serializes");
    let len = |x: &serde_json::Value| x.as_array().map_or(0, Vec::len);
    let own = ["rows", "tail_rows", "reaction_rows"];
    let parts = v.as_object().map_or(0, |o| {
        o.iter()
            .filter(|(k, _)| !own.contains(&k.as_str()))
            .map(|(_, part)| len(&part["rows"]))
            .sum()
    });
    own.iter().map(|k| len(&v[*k])).sum::<usize>() + parts
}

/// `{"rows": [...], ...}`.
pub fn results_json(report: &LabReport) -> serde_json::Value {
    let mut v = serde_json::to_value(report).expect("a lab report serializes");
    // Every row says which balancer it measured: keel's own here, a peer's under `peers`.
    if let Some(rows) = v["rows"].as_array_mut() {
        for r in rows {
            r["balancer"] = "keel".into();
        }
    }
    v
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

/// Width of terminal output without `--wide`.
pub(crate) const COLUMNS: usize = 100;

/// "What this run shows", for a terminal: each finding wrapped to [`COLUMNS`].
pub fn print_answer(report: &LabReport) {
    if report.answer.is_empty() {
        return;
    }
    println!("What this run shows:");
    for f in &report.answer {
        for (i, line) in crate::lab::answer::wrap(&f.text, COLUMNS, "  ")
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
    let (ok, explained, open) = verdict_counts(report);
    if ok + explained + open > 0 {
        for line in crate::lab::answer::wrap(
            &format!(
                "Verdicts: {ok} rows agree; {explained} depart for a reason the report names \
                 (explained); {open} depart without one."
            ),
            COLUMNS,
            "",
        ) {
            println!("{line}");
        }
    }
    println!();
}

/// The table of E1-E6B, for a terminal: at most [`COLUMNS`] wide, or every column with `wide`.
pub(crate) fn print_reliability_table(report: &LabReport, wide: bool) {
    if !report.rows.is_empty() {
        if wide {
            print_wide_table(report);
        } else {
            print_narrow_table(report);
        }
    }
}

/// `s` in at most `w` characters (cut with a `~` when longer).
pub(crate) fn fit(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(w.saturating_sub(1)).collect();
        out.push('~');
        out
    }
}

fn failure_cell(r: &Row) -> String {
    if (r.p - 0.2).abs() > 1e-9 {
        format!("{} p={:.1}", r.failure_mode, r.p)
    } else {
        r.failure_mode.clone()
    }
}

/// The reliability table in 100 columns: protections and verdicts abbreviated (legend below).
fn print_narrow_table(report: &LabReport) {
    println!(
        "{:<4} {:<23} {:<15} {:<7} {:>6} {:>6} {:>6} {:<13} verdict",
        "exp", "strategy", "failure", "protect", "model", "sim.", "meas.", "measured 95%"
    );
    for r in &report.rows {
        let strategy = match (&r.tie_break, &r.failed_position) {
            (Some(t), Some(pos)) => format!(
                "{}/{}/{pos}",
                short_strategy(&r.strategy),
                t.split('-').next().unwrap_or(t)
            ),
            _ if r.client == keel_testbed::loadgen::Client::AllCalls.name() => {
                format!("{} (all x{})", r.strategy, r.concurrency)
            }
            _ if r.key_share.is_some() => format!("{} (key/request)", r.strategy),
            _ => r.strategy.clone(),
        };
        let protections = match r.protections.as_str() {
            "outlier+retry+health" => "o+r+h",
            "keel defaults" => "default",
            other => other,
        };
        let verdict = match r.verdict().0 {
            "ok" => "agrees",
            "explained" => "explained",
            _ => "unexplained",
        };
        println!(
            "{:<4} {:<23} {:<15} {:<7} {:>6} {:>6.4} {:>6.4} {:.4}-{:.4} {}",
            fit(&r.experiment, 4),
            fit(&strategy, 23),
            fit(&failure_cell(r), 15),
            fit(protections, 7),
            r.analytic.map_or("-".into(), |a| format!("{a:.4}")),
            r.simulated,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            verdict
        );
    }
    let footer = format!(
        "{} rows in {:.1} s (healthy {:?}, timeout {:?}, seed {}). o+r+h: outlier ejection, \
         retries and health checks; default: keel proxy's defaults; (all xN): N clients each \
         making all k calls (the others stop at a request's first failure). Every column and \
         the verdicts' words: --wide.",
        report.rows.len(),
        report.wall_seconds,
        report.timing.healthy,
        report.timing.timeout,
        report.seed
    );
    for line in crate::lab::answer::wrap(&footer, COLUMNS, "") {
        println!("{line}");
    }
}

fn print_wide_table(report: &LabReport) {
    println!(
        "{:<4} {:<40} {:<15} {:<21} {:<12} {:>8} {:>9} {:>8} {:>17} {:>8}  verdict",
        "exp",
        "strategy",
        "failure",
        "protections",
        "placement",
        "model",
        "simulated",
        "measured",
        "measured 95% CI",
        "requests"
    );
    for r in &report.rows {
        let strategy = match (&r.tie_break, &r.failed_position) {
            (Some(t), Some(pos)) => format!("{} ({t}, failed {pos})", short_strategy(&r.strategy)),
            _ if r.client == keel_testbed::loadgen::Client::AllCalls.name() => {
                format!("{} (all x{})", r.strategy, r.concurrency)
            }
            _ if r.key_share.is_some() => format!("{} (key per request)", r.strategy),
            _ => r.strategy.clone(),
        };
        println!(
            "{:<4} {:<40} {:<15} {:<21} {:<12} {:>8} {:>9.4} {:>8.4} {:>8.4}-{:<8.4} {:>8}  {}",
            r.experiment,
            strategy,
            failure_cell(r),
            r.protections,
            r.placement,
            fmt_opt(r.analytic),
            r.simulated,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            r.requests,
            r.verdict().1
        );
    }
    println!(
        "{} rows in {:.1} s (healthy {:?}, timeout {:?}, seed {}).",
        report.rows.len(),
        report.wall_seconds,
        report.timing.healthy,
        report.timing.timeout,
        report.seed
    );
}

/// Shorter names for the terminal table.
fn short_strategy(s: &str) -> &str {
    match s {
        "least-connections" => "least-conn",
        other => other,
    }
}

fn curve(f: impl Fn(f64) -> f64) -> Vec<(f64, f64)> {
    (0..=100)
        .map(|i| i as f64 / 100.0)
        .map(|p| (p, f(p)))
        .collect()
}

/// The strategies of `rows` in order of appearance.
fn strategies<'a>(rows: &[&'a Row]) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for r in rows {
        if !out.contains(&r.strategy.as_str()) {
            out.push(&r.strategy);
        }
    }
    out
}

/// Charts: measured points (filled, with 95 % bars) and simulated points (rings) over the
/// analytic curves, then E6 against its goal.
fn charts(report: &LabReport) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (failure, title) in [
        (FailureMode::Hang, "Failed servers hang to the timeout"),
        (
            FailureMode::FAIL_AT_ONCE,
            "Failed servers answer an error at once",
        ),
    ] {
        let k = 3;
        let rows: Vec<&Row> = report
            .rows
            .iter()
            .filter(|r| {
                r.failure_mode == failure.name()
                    && r.protections == "none"
                    && r.placement == "server-side"
                    && r.k == k
            })
            .collect();
        let Some(q) = rows.first().and_then(|r| r.q) else {
            continue;
        };
        let mut series = vec![
            Series::line(
                format!("model: round-robin / random, (1-p)^{k}"),
                curve(|p| (1.0 - p).powi(k as i32)),
            )
            .with_color(REFERENCE),
            Series::line(
                format!("model: least-connections, q = {}", fmt_q(q)),
                curve(|p| {
                    analytic::success(StrategyKind::LeastConnections, p, q, k).unwrap_or(f64::NAN)
                }),
            )
            .with_color(strategy_colour("least-connections")),
        ];
        let names = strategies(&rows);
        for (i, s) in names.iter().enumerate() {
            let mine: Vec<&&Row> = rows.iter().filter(|r| r.strategy == *s).collect();
            // Strategies measured at the same p are set apart so that every marker shows; a
            // simulated ring sits just right of its measured point.
            let dx = (i as f64 - (names.len() as f64 - 1.0) / 2.0) * 0.016;
            let color = strategy_colour(s);
            push_measured_and_simulated(&mut series, s, color, &mine, |r| r.p + dx, 0.0, 0.006);
        }
        let spec = ChartSpec::new(
            format!("{title} (q = {}, k = {k})", fmt_q(q)),
            "fraction of failed servers p",
            "request success rate",
        )
        .x_range(-0.03, 1.0)
        .y_range(0.0, 1.0);
        match render_svg(&spec, &series) {
            Ok(svg) => out.push((spec.title.clone(), svg)),
            Err(e) => tracing::warn!("chart {title}: {e}"),
        }
    }
    if let Some(chart) = e6_chart(report) {
        out.push(chart);
    }
    out
}

/// E6: one category per failure mode, one colour per strategy, measured (filled, 95 % bars)
/// and simulated (rings) side by side, against the 0.999 goal.
fn e6_chart(report: &LabReport) -> Option<(String, String)> {
    let rows: Vec<&Row> = report
        .rows
        .iter()
        .filter(|r| r.experiment == "e6")
        .collect();
    if rows.is_empty() {
        return None;
    }
    let mut modes: Vec<&str> = Vec::new();
    for r in &rows {
        if !modes.contains(&r.failure_mode.as_str()) {
            modes.push(&r.failure_mode);
        }
    }
    let x_of = |mode: &str| modes.iter().position(|m| *m == mode).unwrap_or(0) as f64 + 1.0;
    let names = strategies(&rows);
    let mut series = Vec::new();
    for (i, s) in names.iter().enumerate() {
        let mine: Vec<&&Row> = rows.iter().filter(|r| r.strategy == *s).collect();
        let dx = (i as f64 - (names.len() as f64 - 1.0) / 2.0) * 0.22;
        let color = strategy_colour(s);
        let x = |r: &Row| x_of(&r.failure_mode) + dx;
        push_measured_and_simulated(&mut series, s, color, &mine, x, -0.04, 0.04);
    }
    series.push(
        Series::dashed(
            "goal: 0.999",
            vec![(0.5, 0.999), (modes.len() as f64 + 0.5, 0.999)],
        )
        .with_color(REFERENCE),
    );
    // Low enough for every interval and for the goal line.
    let floor = rows
        .iter()
        .map(|r| r.measured_ci95[0].min(r.simulated_ci95[0]))
        .fold(0.998f64, f64::min);
    let spec = ChartSpec::new(
        "E6: protections on, one server of five failed",
        "failure mode of the failed server",
        "request success rate",
    )
    .x_categories(modes.iter().map(|m| m.to_string()).collect())
    .y_range((floor - 0.0005).max(0.0), 1.0002);
    match render_svg(&spec, &series) {
        Ok(svg) => Some((spec.title.clone(), svg)),
        Err(e) => {
            tracing::warn!("chart E6: {e}");
            None
        }
    }
}

fn html(report: &LabReport, experiments: &[Box<dyn Experiment>]) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>keel lab report</title><style>\
         body{{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;line-height:1.45}}\
         table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}\
         td.l,th.l{{text-align:left}}tr.ok td.v{{background:#e6f4e6}}tr.model-off td.v{{background:#fff3d6}}\
         tr.off td.v{{background:#fdeaea}}tr.explained td.v{{background:#eef0f3}}\
         #answer{{border-left:4px solid #2b6cb0;padding:.2em 1em;background:#f7f9fc}}#answer p.lead{{font-size:17px}}\
         #answer li{{margin:.25em 0;font-size:14px}}#answer h2{{margin:.3em 0}}figure{{margin:1em 0}}li{{margin:.4em 0}}\
         code{{background:#f4f4f4;padding:1px 3px}}.grid{{display:flex;flex-wrap:wrap;gap:0 12px}}\
         .grid figure{{margin:.5em 0}}</style></head><body>\
         <h1>keel lab report</h1>"
    );
    answer_html(&mut h, report);
    let _ = write!(
        h,
        "<h2>Method</h2><p>keel's experiments three ways: the closed form (the reliability model, or queueing \
         theory), keel's simulator driving the same balancer code, and real HTTP traffic over loopback through keel's proxy \
         (or client-side balancers) to in-process backends that fail, queue or slow down on purpose. The reliability model \
         comes from an article on common load-balancing strategies and their reliability analysis (the source; \
         <code>docs/reliability.md</code> in keel's repository states the model and the experiments E1-E6 in full; \
         <code>docs/tail-latency.md</code> E8 and E9). {} rows in {:.1} s{}.</p>",
        row_count(report),
        report.wall_seconds,
        if report.quick { " (quick mode: fewer experiments and requests)" } else { "" }
    );
    for e in experiments {
        h.push_str(&e.html(report));
    }
    let m = &report.machine;
    let _ = write!(
        h,
        "<p><small>Seed {}; {} CPUs, {}, {}, keel {}; load average {:.2} / {:.2} / {:.2} (1, 5, 15 \
         min) when the report was written.</small></p>",
        report.seed,
        m.cpus,
        esc(&m.cpu_model),
        esc(&m.os),
        m.keel_version,
        m.load_average[0],
        m.load_average[1],
        m.load_average[2]
    );
    h.push_str("</body></html>\n");
    h
}

/// "What this run shows": the run's answer, one finding per experiment, and how many of the
/// comparisons agree, have a named mechanism, or have none.
fn answer_html(h: &mut String, report: &LabReport) {
    h.push_str("<section id=\"answer\"><h2>What this run shows</h2>");
    let mut findings = report.answer.iter();
    if let Some(first) = report.answer.first().filter(|f| f.experiment == "all") {
        findings.next();
        let (lead, rest) = first.text.split_once(": ").unwrap_or((&first.text, ""));
        let _ = write!(h, "<p class=lead><b>{}</b>: {}</p>", esc(lead), esc(rest));
    }
    h.push_str("<ul>");
    for f in findings {
        let (lead, rest) = f.text.split_once(": ").unwrap_or((&f.text, ""));
        let _ = write!(h, "<li><b>{}</b>: {}</li>", esc(lead), esc(rest));
    }
    h.push_str("</ul>");
    let (ok, explained, open) = verdict_counts(report);
    if ok + explained + open > 0 {
        let _ = write!(
            h,
            "<p>Verdicts: {ok} rows agree with the model or the simulation; {explained} depart for a \
             reason this report names (shown as <i>explained</i>, in grey); {open} depart without \
             one (amber or red). Method, settings and every row follow.</p>"
        );
    }
    h.push_str("</section>");
}

/// Rows that agree, rows whose departures are all explained, and rows with a departure that is
/// not.
fn verdict_counts(report: &LabReport) -> (usize, usize, usize) {
    let mut counts = (0, 0, 0);
    let classes = report
        .rows
        .iter()
        .map(|r| r.verdict().0)
        .chain(report.tail_rows.iter().map(|r| r.verdict().0))
        .chain(report.reaction_rows.iter().map(|r| r.verdict().0));
    for class in classes {
        match class {
            "ok" => counts.0 += 1,
            "explained" => counts.1 += 1,
            _ => counts.2 += 1,
        }
    }
    counts
}

/// The sections of E1-E6B (empty when none ran).
pub(crate) fn reliability_html(report: &LabReport) -> String {
    let mut h = String::new();
    if report.rows.is_empty() {
        return h;
    }
    let q_of = |mode: &str| {
        report
            .rows
            .iter()
            .find(|r| r.failure_mode == mode)
            .and_then(|r| r.q)
    };
    reliability_sections(&mut h, report, q_of("hang"), q_of("fail-fast"));
    h
}

fn reliability_sections(
    h: &mut String,
    report: &LabReport,
    hang_q: Option<f64>,
    fail_fast_q: Option<f64>,
) {
    let t = &report.timing;
    let _ = write!(
        h,
        "<h2>Settings</h2><ul>\
         <li><b>q</b> = t_fail / t_ok: how many times longer a failed server holds a call before the caller sees the \
         failure than a healthy server takes to answer it. A failed server serves 1/q as many calls as a healthy one in \
         the same time, which is what least-connections' share follows. q &gt; 1: the failure is slow (a hang costs the \
         whole timeout); q &lt; 1: the failure is faster than a success (an instant error), and the failed server looks \
         like the best one.</li>\
         <li>Times scaled from the article's 10 ms healthy / 1 s timeout to <b>{:?}</b> and <b>{:?}</b>, so that a \
         hanging server keeps q = {:.0}. The simulation adds an assumed loopback round trip of {:?} to every call (its \
         servers have no network), which makes q {} for a hanging server and {} for an instant error: the q of the \
         tables and charts.</li>\
         <li>5 servers, k = 3 sequential calls per request (a request fails at its first failed call); closed-loop load. \
         Backends and simulated servers get the same latency ({}) and the same failure-mode values.</li>\
         <li>Protections (E6): outlier ejection after {} consecutive failures ({:?} base, at most {}%), up to {} retries \
         on other servers within a {}% retry budget, per-try timeout {:?}, health checks every {:?} ({} to fail, {} to \
         pass).</li>\
         <li>Agreement: the model agrees when its value is inside the measured 95% interval; the simulation agrees when \
         the two differ by less than 1.96 standard errors of their difference. Nothing else is tolerated.</li>\
         <li>Seed {}; simulation: 8 replications per row.</li><li>Machine: {} CPUs, {}, {}, keel {}.</li></ul>",
        t.healthy,
        t.timeout,
        t.timeout.as_secs_f64() / t.healthy.as_secs_f64(),
        t.round_trip,
        hang_q.map_or("-".to_string(), fmt_q),
        fail_fast_q.map_or("-".to_string(), fmt_q),
        t.latency(),
        PROTECTIONS.consecutive_failures,
        PROTECTIONS.base_ejection_time,
        PROTECTIONS.max_ejection_percent,
        PROTECTIONS.retries,
        PROTECTIONS.budget_percent,
        t.timeout,
        PROTECTIONS.health_interval,
        PROTECTIONS.health_threshold,
        PROTECTIONS.health_threshold,
        report.seed,
        report.machine.cpus,
        esc(&report.machine.cpu_model),
        esc(&report.machine.os),
        report.machine.keel_version
    );
    h.push_str(
        "<h2>Charts</h2><p>Filled dots: measured, with their 95% interval; rings: simulated, in the same colour \
         and just to the right; lines: the model.</p>",
    );
    for (title, svg) in charts(report) {
        let _ = write!(h, "<figure aria-label=\"{}\">{svg}</figure>", esc(&title));
    }
    h.push_str(
        "<h2>Results</h2><table><tr><th class=l>exp</th><th class=l>strategy</th><th class=l>failure</th>\
         <th class=l>protections</th><th class=l>placement</th><th>p</th><th>q</th><th>model</th><th>simulated</th>\
         <th>measured</th><th>95% CI</th><th>requests</th><th>failed share (measured)</th><th>p99 ms</th>\
         <th class=l>verdict</th></tr>",
    );
    for r in &report.rows {
        let (class, verdict) = r.verdict();
        let mut strategy = r.strategy.clone();
        if let (Some(t), Some(pos)) = (&r.tie_break, &r.failed_position) {
            strategy = format!("{strategy} ({t}, failed {pos})");
        }
        let _ = write!(
            h,
            "<tr class=\"{class}\"><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td>\
             <td>{:.1}</td><td>{}</td><td>{}</td><td>{:.4}</td><td>{:.4}</td><td>{:.4}-{:.4}</td><td>{}</td><td>{}</td><td>{:.1}</td>\
             <td class=\"l v\">{}</td></tr>",
            r.experiment,
            esc(&strategy),
            r.failure_mode,
            r.protections,
            r.placement,
            r.p,
            r.q.map_or("-".into(), fmt_q),
            fmt_opt(r.analytic),
            r.simulated,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            r.requests,
            pct(r.measured_failed_share),
            r.measured_p99_ms,
            esc(&verdict)
        );
    }
    h.push_str(
        "</table><p>Verdict: green, the model's value is inside the measured 95% interval (without a model: the \
         simulation agrees). Grey, <i>explained</i>: the measurement departs from the model or the simulation, and a \
         mechanism this report names applies to the row under its stated condition (the mechanisms are below, under \
         each experiment; docs/reliability.md explains them). Colour means not explained: amber, the model's value is \
         outside the interval (or the simulation differs while the model agrees) and no named mechanism applies; red, \
         the measurement differs from the simulation and none applies. SE: standard errors.</p>",
    );
    h.push_str("<h2>Where measurement, simulation and model agree, and why they differ</h2>");
    let mut experiments: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !experiments.contains(&r.experiment.as_str()) {
            experiments.push(&r.experiment);
        }
    }
    for e in experiments {
        let rows: Vec<&Row> = report.rows.iter().filter(|r| r.experiment == e).collect();
        let _ = write!(
            h,
            "<h3>{}</h3><p>{}</p>",
            e.to_uppercase(),
            esc(&experiment_intro(e, &rows, t))
        );
        if e == "e6" || e == "e6b" {
            // One paragraph says it all; the numbers of each row are in the table.
            continue;
        }
        h.push_str("<ul>");
        for r in rows.iter() {
            let mut what = format!("{} ({}", r.strategy, r.failure_mode);
            if let (Some(t), Some(pos)) = (&r.tie_break, &r.failed_position) {
                let _ = write!(what, ", {t} tie-break, failed server {pos}");
            }
            if e == "e3" {
                let _ = write!(what, ", p = {:.1}", r.p);
            }
            what.push(')');
            let _ = write!(h, "<li><b>{}</b>: {}</li>", esc(&what), esc(&r.explanation));
        }
        h.push_str("</ul>");
        let mut causes: Vec<&str> = Vec::new();
        for r in &rows {
            for c in &r.causes {
                if !causes.contains(&c.as_str()) {
                    causes.push(c);
                }
            }
        }
        for c in causes {
            let (name, rest) = c.split_once(':').unwrap_or((c, ""));
            let _ = write!(h, "<p><b>[{}]</b>{}</p>", esc(name), esc(rest));
        }
    }
}

/// Writes `index.html` and `results.json` into `out`.
pub fn write(
    report: &LabReport,
    experiments: &[Box<dyn Experiment>],
    out: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&results_json(report))?;
    std::fs::write(out.join("results.json"), json)
        .with_context(|| format!("writing {}", out.join("results.json").display()))?;
    std::fs::write(out.join("index.html"), html(report, experiments))
        .with_context(|| format!("writing {}", out.join("index.html").display()))?;
    Ok(())
}

/// A strategy's measured points (filled, with their 95 % intervals) and simulated points
/// (rings), each set `measured_dx` / `simulated_dx` from `x(row)` so that both show.
fn push_measured_and_simulated(
    series: &mut Vec<Series>,
    strategy: &str,
    color: (u8, u8, u8),
    rows: &[&&Row],
    x: impl Fn(&Row) -> f64,
    measured_dx: f64,
    simulated_dx: f64,
) {
    series.push(
        Series::points(
            format!("measured: {strategy}"),
            rows.iter()
                .map(|r| (x(r) + measured_dx, r.measured))
                .collect(),
        )
        .with_color(color)
        .with_error_bars(
            rows.iter()
                .map(|r| (r.measured_ci95[0], r.measured_ci95[1]))
                .collect(),
        ),
    );
    series.push(
        Series::new(
            format!("simulated: {strategy}"),
            rows.iter()
                .map(|r| (x(r) + simulated_dx, r.simulated))
                .collect(),
            Style::Rings,
        )
        .with_color(color),
    );
}
