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
use keel_model::sim::SimResult;
use keel_model::stats::Z95;
use keel_model::FailureMode;
use serde::Serialize;

use super::cases::{tie_name, Case, Protection, Timing, DEFAULT_RETRIES, PROTECTIONS};
use super::measure::Measured;
use super::LabReport;

/// How a measurement compares with a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Comparison {
    /// Whether the prediction is within the measurement's 95 % interval (for the simulation:
    /// whether the difference is within 1.96 standard errors of the difference).
    pub agrees: bool,
    /// Measured minus predicted, in standard errors (of the measurement; for the simulation,
    /// of the difference of the two).
    pub z: f64,
}

/// One row: a case, three ways.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// e1..e6.
    pub experiment: String,
    /// Strategy name.
    pub strategy: String,
    /// `none` or `outlier+retry+health`.
    pub protections: String,
    /// The failure mode's name (keel-model's vocabulary: hang, fail-fast, refuse, reset).
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
    /// What the measured share implies if every call to a failed server fails and calls are
    /// independent: (1 - share)^k (unprotected rows).
    pub implied_by_measured_share: Option<f64>,
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
    /// Measured against the model (null without a model).
    pub model: Option<Comparison>,
    /// Measured against the simulation.
    pub simulation: Comparison,
    /// Sentences on this row, generated from its numbers (what every row of its experiment
    /// shares is said once, in the report's introduction to the experiment).
    pub explanation: String,
    /// The mechanisms the explanation names, in full (the report says each once per
    /// experiment).
    pub causes: Vec<String>,
}

/// Standard error of a rate on one side, from the half of its 95 % interval on that side.
pub(super) fn side_se(value: f64, ci: [f64; 2], toward: f64) -> f64 {
    let half = if toward >= value {
        ci[1] - value
    } else {
        value - ci[0]
    };
    half.max(0.0) / Z95
}

/// `(a - b) / se`, 0 when both are equal and infinite (with a's side) when `se` is 0.
pub(super) fn z_score(a: f64, b: f64, se: f64) -> f64 {
    let d = a - b;
    if d == 0.0 {
        0.0
    } else if se > 0.0 {
        d / se
    } else {
        f64::INFINITY.copysign(d)
    }
}

impl Row {
    pub(super) fn new(case: &Case, m: Measured, sim: SimResult) -> Row {
        let q = sim.q;
        let p = case.p();
        let analytic = q.and_then(|q| {
            if case.protections != Protection::None {
                analytic::retry_success(
                    case.strategy,
                    case.servers as u64,
                    case.failed as u64,
                    q,
                    case.retries() as u64,
                    case.calls,
                )
            } else {
                analytic::success(case.strategy, p, q, case.calls)
            }
        });
        let (lo, hi) = m.load.ci95();
        let measured_ci95 = [lo, hi];
        let measured = m.load.success_rate();
        let model = analytic.map(|a| Comparison {
            agrees: (lo..=hi).contains(&a),
            z: z_score(measured, a, side_se(measured, measured_ci95, a)),
        });
        let se_m = side_se(measured, measured_ci95, sim.success);
        let se_s = side_se(sim.success, sim.ci95, measured);
        let z_sim = z_score(measured, sim.success, (se_m * se_m + se_s * se_s).sqrt());
        let simulation = Comparison {
            agrees: z_sim.abs() <= Z95,
            z: z_sim,
        };
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
            simulated_ci95: sim.ci95,
            measured,
            measured_ci95,
            requests: m.load.requests,
            analytic_failed_share: q.and_then(|q| analytic::failed_share(case.strategy, p, q)),
            simulated_failed_share: sim.failed_pick_share,
            measured_failed_share: m.failed_share,
            implied_by_measured_share: (case.protections == Protection::None)
                .then(|| (1.0 - m.failed_share).powi(case.calls as i32)),
            measured_max_server_share: m.max_share,
            measured_attempts: m.attempts.clone(),
            measured_p50_ms: m.load.latency_p50.as_secs_f64() * 1e3,
            measured_p99_ms: m.load.latency_p99.as_secs_f64() * 1e3,
            seconds: m.load.elapsed.as_secs_f64(),
            model,
            simulation,
            explanation: String::new(),
            causes: Vec::new(),
        };
        (row.explanation, row.causes) = explain(&row, case);
        row
    }

    /// Attempts measured in all (retries included).
    fn attempts(&self) -> u64 {
        self.measured_attempts.iter().sum()
    }

    /// The table's verdict: a CSS class and the words.
    fn verdict(&self) -> (&'static str, String) {
        let sim = &self.simulation;
        match (&self.model, sim.agrees) {
            (Some(m), _) if m.agrees => ("ok", "agrees with the model".into()),
            (Some(m), true) => (
                "model-off",
                format!(
                    "model outside the interval ({:+.1} SE); simulation agrees",
                    m.z
                ),
            ),
            (Some(m), false) => (
                "off",
                format!("model {:+.1} SE, simulation {:+.1} SE away", m.z, sim.z),
            ),
            (None, true) => ("ok", "agrees with the simulation (no closed form)".into()),
            (None, false) => (
                "off",
                format!("simulation {:+.1} SE away (no closed form)", sim.z),
            ),
        }
    }
}

fn pct(x: f64) -> String {
    if x > 0.0 && x < 0.01 {
        format!("{:.2}%", x * 100.0)
    } else {
        format!("{:.1}%", x * 100.0)
    }
}

fn se_text(z: f64) -> String {
    if z.is_infinite() {
        "infinitely many standard errors (the interval has no width on that side)".into()
    } else {
        format!("{:.1} standard errors", z.abs())
    }
}

/// The q that would give least-connections this share of calls on the failed servers:
/// share = p / (p + q (1 - p)) solved for q.
fn q_for_share(p: f64, share: f64) -> Option<f64> {
    (share > 0.0 && share < 1.0 && p > 0.0 && p < 1.0)
        .then(|| p * (1.0 - share) / (share * (1.0 - p)))
}

fn fmt_q(q: f64) -> String {
    if q >= 10.0 {
        format!("{q:.1}")
    } else if q >= 1.0 {
        format!("{q:.2}")
    } else {
        format!("{q:.3}")
    }
}

/// Mechanisms behind departures, each said once per experiment in the report (the rows name
/// them by their first words).
mod cause {
    pub const IN_FLIGHT: &str =
        "In-flight counts: least-connections sees a server's capacity only \
        through its count of calls in flight. A hung server's count must first build up to the \
        others' level, and healthy calls take longer than the nominal time when proxy, load \
        generator and backends share the machine's cores, so the hung server holds a call fewer \
        times as long as a healthy one than the nominal q says: it gets more calls, as a lower q \
        would give it.";
    pub const SLOWER_ERRORS: &str = "Slower errors: an error \"at once\" still costs the loopback \
        round trip and the proxy's and the backend's own work, which grow when the cores are \
        busy; the failed server then holds a call longer than the simulation's assumed round \
        trip, as a higher q would, and gets fewer calls than the model and the simulation give it.";
    pub const NOT_INDEPENDENT: &str = "Correlated calls: the model treats the calls of a request \
        as independent; in a closed loop they are not (a request whose call has just finished on \
        a healthy server tends to find that server's count low again), so success is higher than \
        the share of calls on failed servers implies. The simulation shows the same.";
    pub const RANDOM_SAMPLE: &str = "A sample of picks: random choices over a few thousand calls \
        put a share on the failed server that varies by its standard error around p; a fixed \
        seed gives one draw of it, in the proxy and in the simulation alike (not the same draw).";
    pub const CONTENTION: &str = "Contention: the simulated servers answer in exactly the healthy \
        time plus an assumed round trip, with no contention for the CPU; here proxy, load \
        generator and backends share the machine's cores, so real times are longer and vary.";
}

/// Sentences on one row: its numbers, how they compare, and which mechanisms (in [`cause`])
/// explain where they differ. What all rows of an experiment share is in
/// [`experiment_intro`].
fn explain(r: &Row, case: &Case) -> (String, Vec<String>) {
    let mut causes: Vec<&str> = Vec::new();
    let mut s = format!(
        "Measured {:.4} ({:.4}-{:.4}, {} requests), simulated {:.4}",
        r.measured, r.measured_ci95[0], r.measured_ci95[1], r.requests, r.simulated
    );
    match (r.analytic, &r.model) {
        (Some(a), Some(m)) if m.agrees => {
            let _ = write!(s, ", model {a:.4}, inside the measured interval.");
        }
        (Some(a), Some(m)) => {
            let _ = write!(
                s,
                ", model {a:.4}: the model lies {} from the measurement ({:+.4}).",
                se_text(m.z),
                r.measured - a
            );
        }
        _ => s.push_str(", no closed form."),
    }
    let share = r.measured_failed_share;
    if case.protections != Protection::None {
        let _ = write!(
            s,
            " The failed server took {} of {} attempts.",
            pct(share),
            r.attempts()
        );
        if r.measured < 0.999 {
            s.push_str(
                " Below 0.999: calls failed before the failed server was ejected or marked \
                 unhealthy, and retries did not cover all of them (the retry budget or the \
                 request timeout ran out).",
            );
        }
    } else if case.client_side {
        if case.tie_break == keel_balance::TieBreak::LowestIndex {
            let _ = write!(
                s,
                " Lowest-index sent {} of attempts to the first server, which is {}.",
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
                " Random ties spread attempts like random picks: {} to the failed server \
                 (round-robin's share {}), so least-connections' advantage in the model is gone.",
                pct(share),
                pct(r.p)
            );
        }
    } else {
        let _ = write!(s, " The failed servers took {} of attempts", pct(share));
        match r.analytic_failed_share {
            Some(f) => {
                let _ = write!(
                    s,
                    " (model {}, simulated {}).",
                    pct(f),
                    pct(r.simulated_failed_share)
                );
            }
            None => {
                let _ = write!(s, " (simulated {}).", pct(r.simulated_failed_share));
            }
        }
        let off = r.model.is_some_and(|m| !m.agrees) || !r.simulation.agrees;
        if let (true, Some(implied)) = (off, r.implied_by_measured_share) {
            why_it_differs(&mut s, &mut causes, r, case, implied);
        }
    }
    if !r.simulation.agrees {
        let _ = write!(
            s,
            " Measurement and simulation differ by {:+.4} ({}).",
            r.measured - r.simulated,
            se_text(r.simulation.z),
        );
        if causes.is_empty() {
            causes.push(cause::CONTENTION);
        }
    }
    for c in &causes {
        // The cause's name: its first words, up to the colon.
        let name = c.split(':').next().unwrap_or(c);
        let _ = write!(s, " [{name}]");
    }
    (s, causes.into_iter().map(String::from).collect())
}

/// Why an unprotected server-side row departs from the model or the simulation: is it where
/// the calls went (the measured share of attempts on failed servers), and why did they go
/// there?
fn why_it_differs(s: &mut String, causes: &mut Vec<&str>, r: &Row, case: &Case, implied: f64) {
    let share = r.measured_failed_share;
    let inside = (r.measured_ci95[0]..=r.measured_ci95[1]).contains(&implied);
    let _ = write!(
        s,
        " The measured share implies (1 - {})^{} = {implied:.4}, {} the measured interval",
        pct(share),
        r.k,
        if inside { "inside" } else { "outside" }
    );
    if inside {
        s.push_str(": where the calls went accounts for the difference.");
    } else {
        s.push_str(": where the calls went does not account for it alone.");
        causes.push(cause::NOT_INDEPENDENT);
    }
    match case.strategy {
        StrategyKind::Random => {
            let model_share = r.p;
            let n = r.attempts().max(1) as f64;
            let se = (model_share * (1.0 - model_share) / n).sqrt();
            let _ = write!(
                s,
                " {} is {} from the expected {} over {} attempts; the simulation's draws put {} \
                 there.",
                pct(share),
                se_text(z_score(share, model_share, se)),
                pct(model_share),
                r.attempts(),
                pct(r.simulated_failed_share)
            );
            causes.push(cause::RANDOM_SAMPLE);
        }
        StrategyKind::LeastConnections => {
            if let (Some(q_eff), Some(q)) = (q_for_share(r.p, share), r.q) {
                let _ = write!(
                    s,
                    " That share is what q = {} would give, not {}.",
                    fmt_q(q_eff),
                    fmt_q(q)
                );
                causes.push(if q_eff < q {
                    cause::IN_FLIGHT
                } else {
                    cause::SLOWER_ERRORS
                });
            }
        }
        _ => {
            if !r.simulation.agrees {
                causes.push(cause::CONTENTION);
            }
        }
    }
}

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

/// E6B in one paragraph: keel proxy's defaults, one dead endpoint of three.
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
        "A cluster written with nothing but its three endpoints, one of them dead: keel proxy's \
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
    /// The load average (1, 5 and 15 minutes) when the report was written: other work on the
    /// machine moves real-traffic latencies.
    pub load_average: [f64; 3],
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
            load_average: load_average(),
        }
    }
}

/// /proc/loadavg's first three fields (zeros where there is none).
fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut out = [0.0; 3];
    for (o, v) in out.iter_mut().zip(text.split_whitespace()) {
        *o = v.parse().unwrap_or(0.0);
    }
    out
}

/// `{"rows": [...], ...}`.
pub fn results_json(report: &LabReport) -> serde_json::Value {
    serde_json::to_value(report).expect("a lab report serializes")
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.4}")).unwrap_or_else(|| "-".into())
}

/// The tables, for a terminal.
pub fn print_table(report: &LabReport) {
    if !report.rows.is_empty() {
        print_reliability_table(report);
    }
    super::report_tail::print_tables(report);
}

fn print_reliability_table(report: &LabReport) {
    println!(
        "{:<4} {:<40} {:<15} {:<21} {:<12} {:>8} {:>9} {:>8} {:>17} {:>8}",
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

/// The colour of lines that belong to no strategy (the uniform model's curve, goals, fair
/// shares): near black, which no strategy has.
pub(super) const REFERENCE: (u8, u8, u8) = (40, 40, 40);

/// One colour per strategy, the same in every chart of the report (and the same as `keel
/// simulate --plot`'s: keel-model's palette by the strategy's place in
/// [`StrategyKind::ALL`]): a strategy's measured points, simulated rings, closed-form curve
/// and latency distributions all take it.
pub(super) fn strategy_colour(strategy: &str) -> (u8, u8, u8) {
    let i = StrategyKind::ALL
        .iter()
        .position(|k| k.name() == strategy)
        .unwrap_or(StrategyKind::ALL.len());
    keel_model::plot::palette(i)
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

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn html(report: &LabReport) -> String {
    let mut h = String::new();
    let q_of = |mode: &str| {
        report
            .rows
            .iter()
            .find(|r| r.failure_mode == mode)
            .and_then(|r| r.q)
    };
    let (hang_q, fail_fast_q) = (q_of("hang"), q_of("fail-fast"));
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>keel lab report</title><style>\
         body{{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;line-height:1.45}}\
         table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}\
         td.l,th.l{{text-align:left}}tr.ok td.v{{background:#e6f4e6}}tr.model-off td.v{{background:#fff3d6}}\
         tr.off td.v{{background:#fdeaea}}figure{{margin:1em 0}}li{{margin:.4em 0}}\
         code{{background:#f4f4f4;padding:1px 3px}}.grid{{display:flex;flex-wrap:wrap;gap:0 12px}}\
         .grid figure{{margin:.5em 0}}</style></head><body>\
         <h1>keel lab report</h1><p>keel's experiments three ways: the closed form (the reliability model, or queueing \
         theory), keel's simulator driving the same balancer code, and real HTTP traffic over loopback through keel's proxy \
         (or client-side balancers) to in-process backends that fail, queue or slow down on purpose. The reliability model \
         comes from an article on common load-balancing strategies and their reliability analysis (the source; \
         <code>docs/reliability.md</code> in keel's repository states the model and the experiments E1-E6 in full; \
         <code>docs/tail-latency.md</code> E8 and E9). {} rows in {:.1} s{}.</p>",
        report.rows.len() + report.tail_rows.len() + report.reaction_rows.len(),
        report.wall_seconds,
        if report.quick { " (quick mode: fewer experiments and requests)" } else { "" }
    );
    if !report.rows.is_empty() {
        reliability_html(&mut h, report, hang_q, fail_fast_q);
    }
    h.push_str(&super::report_tail::html(report));
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

/// The sections of E1-E6B.
fn reliability_html(
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
         simulation agrees); amber, the model's value is outside it but the simulation, which runs the same balancer \
         without the model's assumptions, agrees with the measurement; red, the measurement differs from the \
         simulation too. SE: standard errors.</p>",
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
pub fn write(report: &LabReport, out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let json = serde_json::to_string_pretty(&results_json(report))?;
    std::fs::write(out.join("results.json"), json)
        .with_context(|| format!("writing {}", out.join("results.json").display()))?;
    std::fs::write(out.join("index.html"), html(report))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_colour_per_strategy_and_none_for_references() {
        let lab = [
            StrategyKind::RoundRobin,
            StrategyKind::Random,
            StrategyKind::LeastConnections,
            StrategyKind::LeastRequest,
            StrategyKind::LeastTime,
            StrategyKind::PeakEwma,
            StrategyKind::Prequal,
        ];
        let colours: Vec<_> = lab.iter().map(|k| strategy_colour(k.name())).collect();
        for (i, c) in colours.iter().enumerate() {
            assert_ne!(*c, REFERENCE, "{}", lab[i].name());
            for (j, d) in colours.iter().enumerate().skip(i + 1) {
                assert_ne!(c, d, "{} and {}", lab[i].name(), lab[j].name());
            }
        }
        // The same name gives the same colour wherever it is drawn.
        assert_eq!(strategy_colour("prequal"), strategy_colour("prequal"));
    }
}
