//! The lab's report: a table on stdout, `results.json`, and a self-contained `index.html` with
//! SVG charts of measured and simulated points over the analytic curves, and sentences that
//! compare them, generated from the numbers.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_model::plot::{render_svg, ChartSpec, Series, Style};
use keel_model::sim::SimResult;
use serde::Serialize;

use keel_model::FailureMode;

use super::cases::{tie_name, Case, Timing};
use super::measure::Measured;
use super::LabReport;

/// One row: a case, three ways.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// e1..e6.
    pub experiment: String,
    /// Strategy name.
    pub strategy: String,
    /// `none` or `outlier+retry+health`.
    pub protections: String,
    /// hang, fast-error, refuse, reset.
    pub failure_mode: String,
    /// `server-side` (through keel's proxy) or `client-side` (balancer in each client).
    pub placement: String,
    /// Tie-break (least-connections only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie_break: Option<String>,
    /// Where the failed servers sit in the list (client-side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed_position: Option<String>,
    /// Failed share of servers.
    pub p: f64,
    /// t_fail / t_ok, as the simulation has it (round trip included); null when the failure
    /// mode does not fix t_fail.
    pub q: Option<f64>,
    /// Calls per request.
    pub k: u32,
    /// Requests in flight.
    pub concurrency: usize,
    /// The closed form (with the retry formula when retries are on); null without one.
    pub analytic: Option<f64>,
    /// Simulated success.
    pub simulated: f64,
    /// Its 95 % interval.
    pub simulated_ci95: [f64; 2],
    /// Measured success over real sockets.
    pub measured: f64,
    /// Wilson 95 % interval of `measured`.
    pub measured_ci95: [f64; 2],
    /// Requests measured.
    pub requests: u64,
    /// The model's share of calls to failed servers (round-robin/random: p; least-connections:
    /// p / (p + q (1 - p))), when it has one.
    pub analytic_failed_share: Option<f64>,
    /// Simulated share of attempts to failed servers.
    pub simulated_failed_share: f64,
    /// Measured share of attempts to failed servers.
    pub measured_failed_share: f64,
    /// Measured largest share of attempts to one server.
    pub measured_max_server_share: f64,
    /// Measured attempts per server, in endpoint order (retries included).
    pub measured_attempts: Vec<u64>,
    /// Measured median and 99th percentile request latency, ms.
    pub measured_p50_ms: f64,
    /// See `measured_p50_ms`.
    pub measured_p99_ms: f64,
    /// Wall time of the measurement, s.
    pub seconds: f64,
    /// Whether measured agrees with the model (null without a model).
    pub agrees_with_model: Option<bool>,
    /// Whether measured agrees with the simulation.
    pub agrees_with_simulation: bool,
    /// Plain sentences comparing the three, generated from the numbers.
    pub explanation: String,
}

fn half(ci: [f64; 2]) -> f64 {
    (ci[1] - ci[0]) / 2.0
}

impl Row {
    pub(super) fn new(case: &Case, t: &Timing, m: Measured, sim: SimResult) -> Row {
        let q = sim.q;
        let p = case.p();
        let analytic = q.and_then(|q| {
            if case.protections {
                analytic::retry_success(
                    case.strategy,
                    case.servers as u64,
                    case.failed as u64,
                    q,
                    2,
                    case.calls,
                )
            } else {
                analytic::success(case.strategy, p, q, case.calls)
            }
        });
        let (lo, hi) = m.load.ci95();
        let measured_ci95 = [lo, hi];
        let measured = m.load.success_rate();
        let simulated_ci95 = sim.ci95;
        let tol_m = 0.01 + half(measured_ci95);
        let agrees_with_model = analytic.map(|a| (measured - a).abs() <= tol_m);
        let agrees_with_simulation = (measured - sim.success).abs() <= tol_m + half(simulated_ci95);
        let analytic_failed_share = q.and_then(|q| analytic::failed_share(case.strategy, p, q));
        let mut row = Row {
            experiment: case.experiment.to_string(),
            strategy: case.strategy.name().to_string(),
            protections: case.protections_name().to_string(),
            failure_mode: case.failure.name().to_string(),
            placement: if case.client_side {
                "client-side"
            } else {
                "server-side"
            }
            .into(),
            tie_break: (case.strategy == StrategyKind::LeastConnections)
                .then(|| tie_name(case.tie_break).to_string()),
            failed_position: case
                .client_side
                .then(|| if case.failed_first { "first" } else { "last" }.to_string()),
            p,
            q,
            k: case.calls,
            concurrency: case.concurrency,
            analytic,
            simulated: sim.success,
            simulated_ci95,
            measured,
            measured_ci95,
            requests: m.load.requests,
            analytic_failed_share,
            simulated_failed_share: sim.failed_pick_share,
            measured_failed_share: m.failed_share,
            measured_max_server_share: m.max_share,
            measured_attempts: m.attempts.clone(),
            measured_p50_ms: m.load.latency_p50.as_secs_f64() * 1e3,
            measured_p99_ms: m.load.latency_p99.as_secs_f64() * 1e3,
            seconds: m.load.elapsed.as_secs_f64(),
            agrees_with_model,
            agrees_with_simulation,
            explanation: String::new(),
        };
        row.explanation = explain(&row, case, t);
        row
    }
}

/// How long a call to a failed server takes, round trip included, when the mode fixes it.
fn t_fail(case: &Case, t: &Timing) -> Duration {
    case.failure
        .failure_time(t.timeout, t.healthy)
        .unwrap_or(t.timeout)
        + t.round_trip
}

fn pct(x: f64) -> String {
    if x < 0.01 {
        format!("{:.2}%", x * 100.0)
    } else {
        format!("{:.1}%", x * 100.0)
    }
}

/// Sentences that say where measured, simulated and model agree, and why they differ.
fn explain(r: &Row, case: &Case, t: &Timing) -> String {
    let mut s = format!(
        "Measured {:.4} (95% CI {:.4}-{:.4}, {} requests), simulated {:.4}",
        r.measured, r.measured_ci95[0], r.measured_ci95[1], r.requests, r.simulated
    );
    match r.analytic {
        Some(a) => {
            let _ = write!(s, ", model {a:.4}. ");
        }
        None => s.push_str(", no closed form. "),
    }
    let failed_requests = r.requests - (r.measured * r.requests as f64).round() as u64;
    if case.protections {
        let _ = write!(
            s,
            "With outlier ejection, retries within a budget and health checks, {failed_requests} of {} requests failed; \
             the failed server took {} of the attempts (before its ejection), and retries on another server covered them.",
            r.requests,
            pct(r.measured_failed_share)
        );
        if r.measured < 0.999 {
            s.push_str(" That is below 0.999: failures outlasted the retry budget or the request timeout before ejection.");
        }
    } else if case.client_side {
        let _ = write!(
            s,
            "Each of the {} clients keeps one call in flight and has its own balancer, so every pick sees in-flight counts of 0 \
             and the tie-break decides, not capacity: ",
            r.concurrency
        );
        if case.tie_break == keel_balance::TieBreak::LowestIndex {
            let _ = write!(
                s,
                "lowest-index sent {} of calls to the first server, which is {}.",
                pct(r.measured_max_server_share),
                if case.failed_first {
                    "the failed one"
                } else {
                    "healthy"
                }
            );
        } else {
            let _ = write!(
                s,
                "random ties spread calls evenly ({} to the failed server, the round-robin share {}), \
                 so least-connections' advantage of the model is gone.",
                pct(r.measured_failed_share),
                pct(r.p)
            );
        }
    } else if case.failure == FailureMode::FAIL_AT_ONCE
        && r.q.is_some_and(|q| q < 1.0)
        && r.strategy != "round-robin"
        && r.strategy != "random"
    {
        match case.strategy {
            StrategyKind::PeakEwma => {
                let _ = write!(
                    s,
                    "peak-EWMA counts every failure as at least its failure penalty, so the server that fails in {:?} looks slow, \
                     not fast: it got {} of calls.",
                    t_fail(case, t),
                    pct(r.measured_failed_share)
                );
            }
            _ => {
                let _ = write!(
                    s,
                    "The failed server answers in about {:?}, faster than a healthy one ({:?}): q = {:.2} < 1, so {} sees it as the best \
                     server and sent it {} of calls{}: the black hole of the model.",
                    t_fail(case, t),
                    t.healthy,
                    r.q.unwrap_or(f64::NAN),
                    if case.strategy == StrategyKind::LeastTime {
                        "least-time (lowest average response time)"
                    } else {
                        "least-connections (its in-flight count is nearly always 0)"
                    },
                    pct(r.measured_failed_share),
                    match r.analytic_failed_share {
                        Some(f) => format!(" (model {})", pct(f)),
                        None => String::new(),
                    }
                );
            }
        }
    } else if r.agrees_with_model == Some(true) {
        let _ = write!(
            s,
            "Measurement agrees with the model (difference {:+.4}, within the 95% interval plus 0.01); the failed servers took {} of calls{}.",
            r.measured - r.analytic.unwrap_or(f64::NAN),
            pct(r.measured_failed_share),
            match r.analytic_failed_share {
                Some(f) => format!(" (model {})", pct(f)),
                None => String::new(),
            }
        );
    } else if let Some(a) = r.analytic {
        let _ = write!(
            s,
            "Measurement differs from the model by {:+.4}. ",
            r.measured - a
        );
        if case.strategy == StrategyKind::LeastConnections && case.failure == FailureMode::Hang {
            let _ = write!(
                s,
                "Least-connections sees capacity only through in-flight counts: the failed server got {} of calls (model {}). \
                 Its count must first build up to the others' level (about {:.0} with {} requests in flight), and healthy calls took \
                 longer than {:?} here (median request {:.1} ms for {} calls) because proxy, load generator and backends share this \
                 machine's cores, which lowers the effective q below {:.0}.",
                pct(r.measured_failed_share),
                pct(r.analytic_failed_share.unwrap_or(f64::NAN)),
                r.concurrency as f64 / case.servers as f64,
                r.concurrency,
                t.healthy,
                r.measured_p50_ms,
                r.k,
                r.q.unwrap_or(f64::NAN)
            );
        } else {
            let _ = write!(
                s,
                "The failed servers took {} of calls against the model's {}; the model assumes independent calls in steady state.",
                pct(r.measured_failed_share),
                pct(r.analytic_failed_share.unwrap_or(r.p))
            );
        }
    } else {
        let _ = write!(
            s,
            "The failed server took {} of calls.",
            pct(r.measured_failed_share)
        );
    }
    if !r.agrees_with_simulation {
        let _ = write!(
            s,
            " Measurement and simulation differ by {:+.4}: the simulator's servers answer in exactly {:?} with no CPU contention, \
             while here everything shares the machine.",
            r.measured - r.simulated,
            t.healthy
        );
    }
    s
}

/// The machine a report was made on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPUs available to the process.
    pub cpus: usize,
    /// CPU model.
    pub cpu_model: String,
    /// Operating system and kernel.
    pub os: String,
    /// keel's version.
    pub keel_version: String,
}

impl Machine {
    pub(super) fn detect() -> Machine {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Machine {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            os: format!("{} {kernel}", std::env::consts::OS),
            keel_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// `{"rows": [...], ...}`.
pub fn results_json(report: &LabReport) -> serde_json::Value {
    serde_json::to_value(report).expect("a lab report serializes")
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

/// The table, for a terminal.
pub fn print_table(report: &LabReport) {
    println!(
        "{:<4} {:<40} {:<15} {:<21} {:<12} {:>8} {:>9} {:>8} {:>17} {:>8}",
        "exp",
        "strategy",
        "failure",
        "protections",
        "placement",
        "analytic",
        "simulated",
        "measured",
        "measured 95% CI",
        "requests"
    );
    for r in &report.rows {
        let strategy = match (&r.tie_break, &r.failed_position) {
            (Some(t), Some(pos)) => format!("{} ({t}, failed {pos})", short_strategy(&r.strategy)),
            _ => r.strategy.clone(),
        };
        println!(
            "{:<4} {:<40} {:<15} {:<21} {:<12} {:>8} {:>9.4} {:>8.4} {:>8.4}-{:<8.4} {:>8}",
            r.experiment,
            strategy,
            format!(
                "{}{}",
                r.failure_mode,
                if r.p != 0.2 {
                    format!(" p={:.1}", r.p)
                } else {
                    String::new()
                }
            ),
            r.protections,
            r.placement,
            fmt_opt(r.analytic),
            r.simulated,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            r.requests
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

/// Charts: measured (with 95 % bars) and simulated points over the analytic curves.
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
            })
            .collect();
        let Some(q) = rows.first().and_then(|r| r.q) else {
            continue;
        };
        let mut series = vec![
            Series::line(
                "model: round-robin / random, (1-p)^3",
                curve(|p| (1.0 - p).powi(k)),
            )
            .with_color((31, 119, 180)),
            Series::line(
                format!("model: least-connections, q = {q:.2}"),
                curve(|p| {
                    analytic::success(StrategyKind::LeastConnections, p, q, k as u32)
                        .unwrap_or(f64::NAN)
                }),
            )
            .with_color((214, 39, 40)),
        ];
        let mut strategies: Vec<&str> = rows.iter().map(|r| r.strategy.as_str()).collect();
        strategies.dedup();
        for (i, s) in strategies.iter().enumerate() {
            let mine: Vec<&&Row> = rows.iter().filter(|r| r.strategy == *s).collect();
            // Strategies measured at the same p are nudged apart so that their markers show.
            let dx = (i as f64 - (strategies.len() as f64 - 1.0) / 2.0) * 0.012;
            let color = keel_model::plot::palette(i + 2);
            series.push(
                Series::points(
                    format!("measured: {s}"),
                    mine.iter().map(|r| (r.p + dx, r.measured)).collect(),
                )
                .with_color(color)
                .with_error_bars(
                    mine.iter()
                        .map(|r| (r.measured_ci95[0], r.measured_ci95[1]))
                        .collect(),
                ),
            );
            series.push(
                Series::new(
                    format!("simulated: {s}"),
                    mine.iter()
                        .map(|r| (r.p + dx + 0.006, r.simulated))
                        .collect(),
                    Style::Points,
                )
                .with_color((120, 120, 120)),
            );
        }
        let spec = ChartSpec::new(
            format!("{title} (q = {q:.2}, k = {k})"),
            "fraction of failed servers p",
            "request success rate",
        )
        .x_range(0.0, 1.0)
        .y_range(0.0, 1.0);
        match render_svg(&spec, &series) {
            Ok(svg) => out.push((spec.title.clone(), svg)),
            Err(e) => tracing::warn!("chart {title}: {e}"),
        }
    }
    let protected: Vec<&Row> = report
        .rows
        .iter()
        .filter(|r| r.protections != "none")
        .collect();
    if !protected.is_empty() {
        let xs = |f: &dyn Fn(&Row) -> f64| -> Vec<(f64, f64)> {
            protected
                .iter()
                .enumerate()
                .map(|(i, r)| (i as f64 + 1.0, f(r)))
                .collect()
        };
        let series = vec![
            Series::points("measured", xs(&|r| r.measured))
                .with_color((44, 160, 44))
                .with_error_bars(
                    protected
                        .iter()
                        .map(|r| (r.measured_ci95[0], r.measured_ci95[1]))
                        .collect(),
                ),
            Series::points("simulated", xs(&|r| r.simulated)).with_color((120, 120, 120)),
            Series::dashed(
                "0.999",
                vec![(0.5, 0.999), (protected.len() as f64 + 0.5, 0.999)],
            )
            .with_color((214, 39, 40)),
        ];
        let spec = ChartSpec::new(
            "E6: protections on, one server failed (x: row number in the E6 table)",
            "E6 row",
            "request success rate",
        )
        .x_range(0.5, protected.len() as f64 + 0.5)
        .y_range(0.99, 1.0005);
        if let Ok(svg) = render_svg(&spec, &series) {
            out.push((spec.title.clone(), svg));
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn html(report: &LabReport) -> String {
    let mut h = String::new();
    let t = &report.timing;
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>keel lab report</title><style>\
         body{{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}}\
         table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}\
         td.l,th.l{{text-align:left}}tr.ok td.m{{background:#e6f4e6}}tr.off td.m{{background:#fdeaea}}\
         figure{{margin:1em 0}}li{{margin:.4em 0}}code{{background:#f4f4f4;padding:1px 3px}}</style></head><body>\
         <h1>keel lab report</h1><p>The reliability experiments of the model, three ways: the closed form, keel's simulator \
         driving the same balancer code, and real HTTP traffic over loopback through keel's proxy (or a client-side balancer) \
         to in-process backends with injected faults. {} rows in {:.1} s{}.</p>",
        report.rows.len(),
        report.wall_seconds,
        if report.quick { " (quick mode: fewer experiments and requests)" } else { "" }
    );
    let _ = write!(
        h,
        "<h2>Settings</h2><ul><li>Times scaled from the source's 10 ms / 1 s to <b>{:?}</b> healthy service time and a \
         <b>{:?}</b> timeout, so a hanging server keeps q = {:.0}; an instant error is taken as {:?} (q = {:.2}).</li>\
         <li>5 servers, k = 3 sequential calls per request (a request fails at its first failed call); closed-loop load.</li>\
         <li>Protections (E6): outlier ejection after 3 consecutive failures (5 s base, at most 50%), up to 2 retries on \
         other servers within a 20% retry budget, per-try timeout {:?}, health checks every 100 ms (2 to fail, 2 to pass).</li>\
         <li>Seed {}; simulation: 8 replications per row.</li><li>Machine: {} CPUs, {}, {}, keel {}.</li></ul>",
        t.healthy,
        t.timeout,
        t.timeout.as_secs_f64() / t.healthy.as_secs_f64(),
        t.round_trip,
        t.round_trip.as_secs_f64() / (t.healthy + t.round_trip).as_secs_f64(),
        t.timeout,
        report.seed,
        report.machine.cpus,
        esc(&report.machine.cpu_model),
        esc(&report.machine.os),
        report.machine.keel_version
    );
    h.push_str("<h2>Charts</h2>");
    for (title, svg) in charts(report) {
        let _ = write!(h, "<figure aria-label=\"{}\">{svg}</figure>", esc(&title));
    }
    h.push_str(
        "<h2>Results</h2><table><tr><th class=l>exp</th><th class=l>strategy</th><th class=l>failure</th>\
         <th class=l>protections</th><th class=l>placement</th><th>p</th><th>q</th><th>analytic</th><th>simulated</th>\
         <th>measured</th><th>95% CI</th><th>requests</th><th>failed share (measured)</th><th>p99 ms</th></tr>",
    );
    for r in &report.rows {
        let ok = r.agrees_with_model.unwrap_or(r.agrees_with_simulation);
        let mut strategy = r.strategy.clone();
        if let (Some(t), Some(pos)) = (&r.tie_break, &r.failed_position) {
            strategy = format!("{strategy} ({t}, failed {pos})");
        }
        let _ = write!(
            h,
            "<tr class=\"{}\"><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td><td class=l>{}</td>\
             <td>{:.1}</td><td>{}</td><td>{}</td><td>{:.4}</td><td class=m>{:.4}</td><td>{:.4}-{:.4}</td><td>{}</td><td>{}</td><td>{:.1}</td></tr>",
            if ok { "ok" } else { "off" },
            r.experiment,
            esc(&strategy),
            r.failure_mode,
            r.protections,
            r.placement,
            r.p,
            r.q.map_or("-".into(), |q| format!("{q:.2}")),
            fmt_opt(r.analytic),
            r.simulated,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            r.requests,
            pct(r.measured_failed_share),
            r.measured_p99_ms
        );
    }
    h.push_str("</table><p>Green: measured agrees with the model (or, without one, with the simulation) within its 95% interval plus 0.01.</p>");
    h.push_str("<h2>Where measurement, simulation and model agree, and why they differ</h2><ul>");
    for r in &report.rows {
        let _ = write!(
            h,
            "<li><b>{} {} ({}, {}, {})</b>: {}</li>",
            r.experiment,
            esc(&r.strategy),
            r.failure_mode,
            r.protections,
            r.placement,
            esc(&r.explanation)
        );
    }
    h.push_str("</ul></body></html>\n");
    h
}

/// Writes `index.html` and `results.json` into `out`.
pub fn write(report: &LabReport, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&results_json(report))?;
    std::fs::write(out.join("results.json"), json)
        .with_context(|| format!("writing {}", out.join("results.json").display()))?;
    std::fs::write(out.join("index.html"), html(report))
        .with_context(|| format!("writing {}", out.join("index.html").display()))?;
    Ok(())
}
