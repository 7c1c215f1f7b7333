//! `keel analyze`: the closed forms of the reliability model for one setting, or a sweep of
//! f(p) over q and k written as a CSV table and SVG charts (docs/reliability.md); with
//! `--inference`, whether prefix affinity pays in an inference pool (docs/inference.md).

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;
use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_model::plot::{self, ChartSpec, Series, Style};
use serde::Serialize;

use crate::cmd::usage;

/// Arguments of `keel analyze`.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    keel analyze --strategy least-connections --servers 5 --failed 1 --q 100 --calls 3\n  \
    keel analyze --strategy random --p 0.2 --calls 3 --json\n  \
    keel analyze --sweep --q 0.1,0.5,1,10,100 --calls 1,3,5 --out docs/img\n  \
    keel analyze --inference --engines 3 --groups 6 --prefix-tokens 400 --unique-tokens 40 --load 0.5")]
pub struct Args {
    /// Strategy with a closed form: round-robin, weighted-round-robin, random, weighted-random
    /// (equal weights), least-connections. The others need `keel simulate`.
    #[arg(long, conflicts_with_all = ["sweep", "inference"])]
    strategy: Option<String>,
    /// Servers in the cluster (m). Give with --failed, or give --p instead.
    #[arg(long, requires = "failed", conflicts_with_all = ["p", "sweep"])]
    servers: Option<u64>,
    /// Failed servers (n_f); p = n_f / m.
    #[arg(long, requires = "servers", conflicts_with = "sweep")]
    failed: Option<u64>,
    /// Fraction of failed servers, in [0, 1] (instead of --servers/--failed).
    #[arg(long, conflicts_with = "sweep", allow_negative_numbers = true)]
    p: Option<f64>,
    /// q = t_fail / t_ok: how much longer a failed server holds a call than a healthy one
    /// answers it (1 s timeout / 10 ms = 100). Needed by least-connections. With --sweep, a
    /// comma-separated list (default 0.1,0.5,1,10,100).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    q: Vec<f64>,
    /// Calls per request, one after another (k); the request succeeds only if all do. Default 1;
    /// with --sweep a comma-separated list (default 1,3,5).
    #[arg(long, value_delimiter = ',')]
    calls: Vec<u32>,
    /// Retries per call on distinct servers (needs --servers/--failed): adds the retry formula,
    /// C(n_f, r+1) / C(m, r+1) per call under uniform choice; for least-connections its
    /// extension with healthy servers weighted by q (docs/reliability.md).
    #[arg(long, conflicts_with = "sweep")]
    retries: Option<u64>,
    /// Sweep p over [0, 1] for each q and k: writes f_p.csv and SVG charts into --out.
    #[arg(long, conflicts_with = "inference")]
    sweep: bool,
    /// Inference pools: does routing by prompt prefix (prefix-affinity) beat load balancing
    /// (round-robin, least-request) for this workload and load? See docs/inference.md.
    #[arg(long)]
    inference: bool,
    #[command(flatten)]
    pool: InferenceArgs,
    /// Directory for the sweep's files (created if missing).
    /// Default: ./keel-analyze.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Step of p in the sweep; must divide 1 (0.01, 0.005, ...). Default 0.01.
    #[arg(long)]
    step: Option<f64>,
    /// With --sweep: results of `keel simulate ... --json` (JSON Lines or one object) to draw
    /// as points with their 95% intervals over the analytic curves (f_p_simulated_k*.svg), and
    /// to compare with the closed form row by row.
    #[arg(long, value_name = "FILE")]
    overlay: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Writes to stdout; a closed pipe (`keel analyze ... | head`) ends the output quietly.
fn emit(text: &str) -> anyhow::Result<()> {
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Runs `keel analyze`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.inference {
        run_inference(&args.pool, args.json)
    } else if args.pool.given() {
        usage("--engines, --groups and the other pool flags belong to --inference")
    } else if args.sweep {
        run_sweep(&args)
    } else {
        run_single(&args)
    }
}

/// The JSON of one analysis; field order is the documented one.
#[derive(Serialize)]
struct Analysis {
    strategy: &'static str,
    servers: Option<u64>,
    failed: Option<u64>,
    p: f64,
    q: Option<f64>,
    calls: u32,
    healthy_pick: f64,
    success: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    retries: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_call_failure: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_success: Option<f64>,
}

fn parse_strategy(name: &str) -> anyhow::Result<StrategyKind> {
    let strategy: StrategyKind = match name.parse() {
        Ok(s) => s,
        Err(e) => return usage(format!("{e}")),
    };
    if !analytic::has_closed_form(strategy) {
        let with_form: Vec<&str> = analytic::CLOSED_FORM.iter().map(|s| s.name()).collect();
        return usage(format!(
            "{strategy} has no closed form: its choices follow latency estimates, sampling or hashing, \
             not a fixed share; run `keel simulate` to measure it. Closed forms exist for: {}",
            with_form.join(", ")
        ));
    }
    Ok(strategy)
}

fn check_q(q: f64) -> anyhow::Result<f64> {
    if !(q.is_finite() && q > 0.0) {
        return usage(format!(
            "--q must be a finite number > 0 (t_fail / t_ok), got {q}"
        ));
    }
    Ok(q)
}

fn check_calls(k: u32) -> anyhow::Result<u32> {
    if k == 0 {
        return usage("--calls must be at least 1 (calls per request)");
    }
    Ok(k)
}

fn run_single(args: &Args) -> anyhow::Result<()> {
    if args.out.is_some() || args.step.is_some() || args.overlay.is_some() {
        return usage("--out, --step and --overlay belong to --sweep");
    }
    let Some(name) = args.strategy.as_deref() else {
        return usage(
            "give --strategy NAME (or --sweep for charts of every strategy with a closed form)",
        );
    };
    let strategy = parse_strategy(name)?;

    let (servers, failed, p) = match (args.servers, args.failed, args.p) {
        (Some(m), Some(n_f), None) => {
            if m == 0 {
                return usage("--servers must be at least 1");
            }
            if n_f > m {
                return usage(format!("--failed ({n_f}) cannot exceed --servers ({m})"));
            }
            (Some(m), Some(n_f), n_f as f64 / m as f64)
        }
        (None, None, Some(p)) => {
            if !(0.0..=1.0).contains(&p) {
                return usage(format!(
                    "--p is a fraction of servers and must be in [0, 1], got {p}"
                ));
            }
            (None, None, p)
        }
        (None, None, None) => return usage("give either --p FRACTION or --servers M --failed N_F"),
        // clap's requires/conflicts rule out the other combinations
        _ => return usage("give either --p or --servers with --failed, not both"),
    };

    let q = match args.q.as_slice() {
        [] if strategy == StrategyKind::LeastConnections => {
            return usage(
                "least-connections needs --q (t_fail / t_ok: 100 for a failed server that hangs to a \
                 1 s timeout while healthy ones answer in 10 ms; 0.1 for one that fails 10x faster)",
            )
        }
        [] => None,
        [q] => Some(check_q(*q)?),
        _ => return usage("give one --q value (lists are for --sweep)"),
    };
    let calls = match args.calls.as_slice() {
        [] => 1,
        [k] => check_calls(*k)?,
        _ => return usage("give one --calls value (lists are for --sweep)"),
    };
    // round-robin and random ignore q; 1 keeps the call defined when it was not given
    let q_value = q.unwrap_or(1.0);
    let healthy_pick = analytic::healthy_pick(strategy, p, q_value).context("closed form")?;
    let success = analytic::success(strategy, p, q_value, calls).context("closed form")?;

    let (retry_call_failure, retry_success) = match args.retries {
        None => (None, None),
        Some(r) => {
            let (Some(m), Some(n_f)) = (servers, failed) else {
                return usage(
                    "--retries needs --servers and --failed (the retry formula counts servers)",
                );
            };
            let failure = match strategy {
                StrategyKind::LeastConnections => {
                    analytic::retry_call_failure_weighted(m, n_f, r, q_value)
                }
                _ => analytic::retry_call_failure(m, n_f, r),
            };
            let success = analytic::retry_success(strategy, m, n_f, q_value, r, calls)
                .context("closed form")?;
            (Some(failure), Some(success))
        }
    };

    let analysis = Analysis {
        strategy: strategy.name(),
        servers,
        failed,
        p,
        q,
        calls,
        healthy_pick,
        success,
        retries: args.retries,
        retry_call_failure,
        retry_success,
    };
    if args.json {
        emit(&format!("{}\n", serde_json::to_string(&analysis)?))?;
    } else {
        emit(&describe(&analysis))?;
    }
    Ok(())
}

/// The readable form of one analysis.
fn describe(a: &Analysis) -> String {
    let mut text = String::new();
    let cluster = match (a.servers, a.failed) {
        (Some(m), Some(n_f)) => format!("{n_f} of {m} servers failed (p = {})", a.p),
        _ => format!("a fraction p = {} of the servers failed", a.p),
    };
    let q = match a.q {
        Some(q) => format!(", q = t_fail/t_ok = {q}"),
        None => String::new(),
    };
    let plural = if a.calls == 1 { "call" } else { "calls" };
    let _ = writeln!(
        text,
        "{}: {cluster}{q}, {} {plural} per request",
        a.strategy, a.calls
    );
    let failed_share = 1.0 - a.healthy_pick;
    let one_in = if failed_share > 0.0 {
        let n = 1.0 / failed_share;
        // 1/401 prints as "1 in 401", 0.3 as "1 in 3.3"
        if (n - n.round()).abs() < 1e-6 {
            format!(" (1 in {})", n.round())
        } else {
            format!(" (1 in {n:.1})")
        }
    } else {
        String::new()
    };
    let _ = writeln!(
        text,
        "  a call lands on a healthy server     h = {:.6}",
        a.healthy_pick
    );
    let _ = writeln!(
        text,
        "  share of calls to failed servers  1-h = {failed_share:.6}{one_in}"
    );
    let _ = writeln!(
        text,
        "  request success                 h^{} = {:.6}",
        a.calls, a.success
    );
    if a.strategy == "least-connections" {
        let uniform = (1.0 - a.p).powi(a.calls as i32);
        let _ = writeln!(
            text,
            "  (round-robin / random here:  (1-p)^{} = {uniform:.6})",
            a.calls
        );
    }
    if let (Some(r), Some(call_failure), Some(success)) =
        (a.retries, a.retry_call_failure, a.retry_success)
    {
        let plural = if r == 1 { "retry" } else { "retries" };
        let _ = writeln!(
            text,
            "  with {r} {plural} on distinct servers: a call fails {call_failure:.6}, request success {success:.6}"
        );
    }
    text
}

/// The strategies the sweep covers: the weighted ones equal these with equal weights.
const SWEEP_STRATEGIES: [StrategyKind; 3] = [
    StrategyKind::RoundRobin,
    StrategyKind::Random,
    StrategyKind::LeastConnections,
];

const P_LABEL: &str = "fraction of failed servers p";
const F_LABEL: &str = "request success rate f(p)";

/// The result of a sweep, for --json.
#[derive(Serialize)]
struct SweepReport {
    csv: PathBuf,
    rows: usize,
    charts: Vec<PathBuf>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    overlay: Vec<SimPoint>,
    seconds: f64,
}

fn run_sweep(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let qs = if args.q.is_empty() {
        vec![0.1, 0.5, 1.0, 10.0, 100.0]
    } else {
        args.q.clone()
    };
    for &q in &qs {
        check_q(q)?;
    }
    let ks = if args.calls.is_empty() {
        vec![1, 3, 5]
    } else {
        args.calls.clone()
    };
    for &k in &ks {
        check_calls(k)?;
    }
    let step = args.step.unwrap_or(0.01);
    let steps = 1.0 / step;
    let n = steps.round();
    if !(step > 0.0 && (steps - n).abs() < 1e-6 && (1.0..=1e6).contains(&n)) {
        return usage(format!(
            "--step must divide 1 into at most a million steps (0.01, 0.005, ...), got {step}"
        ));
    }
    let n = n as u32;
    // i / n, not i * step: exact endpoints and the shortest decimal form in the CSV
    let ps: Vec<f64> = (0..=n).map(|i| i as f64 / n as f64).collect();

    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("keel-analyze"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let csv_path = out.join("f_p.csv");
    let mut csv = String::from("strategy,q,k,p,healthy_pick,success\n");
    let mut rows = 0;
    for strategy in SWEEP_STRATEGIES {
        for &q in &qs {
            for &k in &ks {
                for &p in &ps {
                    let h = analytic::healthy_pick(strategy, p, q).context("closed form")?;
                    let f = analytic::success(strategy, p, q, k).context("closed form")?;
                    let _ = writeln!(csv, "{},{q},{k},{p},{h},{f}", strategy.name());
                    rows += 1;
                }
            }
        }
    }
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;

    let sim_points = match &args.overlay {
        Some(path) => read_overlay(path)?,
        None => Vec::new(),
    };
    let mut charts = write_charts(&out, &qs, &ks, &ps)?;
    charts.extend(write_overlay_charts(&out, &qs, &ps, &sim_points)?);
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let report = SweepReport {
            csv: csv_path,
            rows,
            charts,
            overlay: sim_points,
            seconds,
        };
        emit(&format!("{}\n", serde_json::to_string(&report)?))
    } else {
        let mut text = format!("wrote {} ({rows} rows)\n", csv_path.display());
        for chart in &charts {
            let _ = writeln!(text, "wrote {}", chart.display());
        }
        if !sim_points.is_empty() {
            text.push_str("simulated vs closed form:\n");
            for point in &sim_points {
                let _ = writeln!(text, "  {}", point.describe());
            }
        }
        let _ = writeln!(text, "in {seconds:.3} s");
        emit(&text)
    }
}

fn curve(strategy: StrategyKind, q: f64, k: u32, ps: &[f64]) -> Vec<(f64, f64)> {
    ps.iter()
        .filter_map(|&p| analytic::success(strategy, p, q, k).map(|f| (p, f)))
        .collect()
}

/// Line style by position of k in the list, so colour can carry q.
fn k_style(i: usize) -> Style {
    [Style::Line, Style::Dashed, Style::Dotted][i % 3]
}

fn unit_square(title: String) -> ChartSpec {
    ChartSpec::new(title, P_LABEL, F_LABEL)
        .x_range(0.0, 1.0)
        .y_range(0.0, 1.0)
}

fn write_chart(
    path: PathBuf,
    spec: &ChartSpec,
    series: &[Series],
    written: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    plot::write_svg(&path, spec, series)?;
    written.push(path);
    Ok(())
}

fn write_charts(out: &Path, qs: &[f64], ks: &[u32], ps: &[f64]) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();

    // Round-robin and random share one curve per k; q plays no part in them.
    let series: Vec<Series> = ks
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            Series::line(
                format!("k = {k}"),
                curve(StrategyKind::RoundRobin, 1.0, k, ps),
            )
            .with_color(plot::palette(i))
        })
        .collect();
    let spec = unit_square("Round-robin and random: f(p) = (1 - p)^k (independent of q)".into());
    write_chart(
        out.join("f_p_round-robin_random.svg"),
        &spec,
        &series,
        &mut written,
    )?;

    // Least-connections: colour by q, line style by k.
    let mut series = Vec::new();
    for (qi, &q) in qs.iter().enumerate() {
        for (ki, &k) in ks.iter().enumerate() {
            let points = curve(StrategyKind::LeastConnections, q, k, ps);
            series.push(
                Series::new(format!("q = {q}, k = {k}"), points, k_style(ki))
                    .with_color(plot::palette(qi)),
            );
        }
    }
    let spec = unit_square("Least-connections: f(p) = [q(1-p) / (q(1-p) + p)]^k".into());
    write_chart(
        out.join("f_p_least-connections.svg"),
        &spec,
        &series,
        &mut written,
    )?;

    // The strategies side by side for one k: round-robin/random in black, least-connections per q.
    for &k in ks {
        let mut series = vec![Series::line(
            "round-robin / random",
            curve(StrategyKind::RoundRobin, 1.0, k, ps),
        )
        .with_color((0, 0, 0))];
        for (qi, &q) in qs.iter().enumerate() {
            let points = curve(StrategyKind::LeastConnections, q, k, ps);
            series.push(
                Series::dashed(format!("least-connections, q = {q}"), points)
                    .with_color(plot::palette(qi)),
            );
        }
        let spec = unit_square(format!("Strategies compared, k = {k} calls per request"));
        write_chart(
            out.join(format!("f_p_compare_k{k}.svg")),
            &spec,
            &series,
            &mut written,
        )?;
    }
    Ok(written)
}

/// One simulated result that has a closed form to compare with.
#[derive(Serialize, Clone)]
struct SimPoint {
    experiment: String,
    label: String,
    strategy: &'static str,
    p: f64,
    q: Option<f64>,
    k: u32,
    success: f64,
    ci95: (f64, f64),
    analytic: f64,
    within_ci: bool,
}

impl SimPoint {
    fn describe(&self) -> String {
        let q = self.q.map(|q| format!(" q={q}")).unwrap_or_default();
        let verdict = if self.within_ci {
            "within the CI".to_string()
        } else {
            let gap = if self.analytic < self.ci95.0 {
                self.ci95.0 - self.analytic
            } else {
                self.analytic - self.ci95.1
            };
            format!("outside the CI by {gap:.4}")
        };
        format!(
            "{} {} p={} k={}{q}: simulated {:.4} [{:.4}, {:.4}], analytic {:.4} ({verdict})",
            self.experiment,
            self.strategy,
            self.p,
            self.k,
            self.success,
            self.ci95.0,
            self.ci95.1,
            self.analytic
        )
    }
}

/// Reads `keel simulate --json` output: JSON Lines (one experiment per line) or one JSON value
/// (an experiment or an array of them). Keeps the unprotected server-side rows of strategies
/// with a closed form: the setting the model describes.
fn read_overlay(path: &Path) -> anyhow::Result<Vec<SimPoint>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let experiments: Vec<serde_json::Value> = match serde_json::from_str(&text) {
        Ok(serde_json::Value::Array(items)) => items,
        Ok(value) => vec![value],
        Err(_) => {
            let mut items = Vec::new();
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str(line) {
                    Ok(value) => items.push(value),
                    Err(e) => {
                        return usage(format!(
                            "{}:{}: not JSON from `keel simulate --json`: {e}",
                            path.display(),
                            n + 1
                        ))
                    }
                }
            }
            items
        }
    };
    let mut points = Vec::new();
    for experiment in &experiments {
        let id = experiment["experiment"].as_str().unwrap_or("?").to_string();
        let Some(results) = experiment["results"].as_array() else {
            return usage(format!(
                "{}: an experiment without \"results\" (expected `keel simulate --json` output)",
                path.display()
            ));
        };
        for r in results {
            if let Some(point) = sim_point(&id, r) {
                points.push(point);
            }
        }
    }
    if points.is_empty() {
        return usage(format!(
            "{}: no unprotected server-side result of a strategy with a closed form to draw",
            path.display()
        ));
    }
    Ok(points)
}

fn sim_point(experiment: &str, r: &serde_json::Value) -> Option<SimPoint> {
    let strategy: StrategyKind = r["strategy"].as_str()?.parse().ok()?;
    if !analytic::has_closed_form(strategy)
        || r["protections"].as_str() != Some("none")
        || r["placement"].as_str().is_some_and(|p| p != "server-side")
    {
        return None;
    }
    let p = r["p"].as_f64()?;
    let q = r["q"].as_f64();
    let k = u32::try_from(r["k"].as_u64()?).ok()?;
    let success = r["success"].as_f64()?;
    let ci = r["ci95"].as_array()?;
    let ci95 = (ci.first()?.as_f64()?, ci.get(1)?.as_f64()?);
    let analytic = analytic::success(strategy, p, q.unwrap_or(1.0), k)?;
    Some(SimPoint {
        experiment: experiment.to_string(),
        label: r["label"].as_str().unwrap_or_default().to_string(),
        strategy: strategy.name(),
        p,
        // q does not enter round-robin and random
        q: if strategy == StrategyKind::LeastConnections {
            q
        } else {
            None
        },
        k,
        success,
        ci95,
        analytic,
        within_ci: ci95.0 <= analytic && analytic <= ci95.1,
    })
}

/// Simulated points drawn as one legend entry: strategy, q (least-connections only), colour.
type PointGroup = (&'static str, Option<f64>, (u8, u8, u8));

/// One chart per k present in the overlay: analytic curves (round-robin/random black,
/// least-connections per q in colour) with the simulated points and their 95% intervals on top.
fn write_overlay_charts(
    out: &Path,
    qs: &[f64],
    ps: &[f64],
    points: &[SimPoint],
) -> anyhow::Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut ks: Vec<u32> = points.iter().map(|p| p.k).collect();
    ks.sort_unstable();
    ks.dedup();
    // the curves' q values: the sweep's, and any other q a simulated point was run at
    let mut all_q = qs.to_vec();
    for q in points.iter().filter_map(|p| p.q) {
        if !all_q.contains(&q) {
            all_q.push(q);
        }
    }
    for k in ks {
        let at_k: Vec<&SimPoint> = points.iter().filter(|p| p.k == k).collect();
        let mut series = vec![Series::line(
            "round-robin / random (closed form)",
            curve(StrategyKind::RoundRobin, 1.0, k, ps),
        )
        .with_color((0, 0, 0))];
        let lc_qs: Vec<(usize, f64)> = all_q
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, q)| at_k.iter().any(|p| p.q == Some(*q)))
            .collect();
        for &(qi, q) in &lc_qs {
            series.push(
                Series::dashed(
                    format!("least-connections q = {q} (closed form)"),
                    curve(StrategyKind::LeastConnections, q, k, ps),
                )
                .with_color(plot::palette(qi)),
            );
        }
        let groups: Vec<PointGroup> = [
            ("round-robin", None, (0, 0, 0)),
            ("random", None, (110, 110, 110)),
        ]
        .into_iter()
        .chain(
            lc_qs
                .iter()
                .map(|&(qi, q)| ("least-connections", Some(q), plot::palette(qi))),
        )
        .collect();
        for (strategy, q, color) in groups {
            let mine: Vec<&&SimPoint> = at_k
                .iter()
                .filter(|p| p.strategy == strategy && (q.is_none() || p.q == q))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let label = match q {
                Some(q) => format!("{strategy} q = {q}, simulated"),
                None => format!("{strategy}, simulated"),
            };
            series.push(
                Series::points(label, mine.iter().map(|p| (p.p, p.success)).collect())
                    .with_error_bars(mine.iter().map(|p| p.ci95).collect())
                    .with_color(color),
            );
        }
        let spec = unit_square(format!(
            "Simulated (points, 95% CI) vs closed form (lines), k = {k}"
        ));
        write_chart(
            out.join(format!("f_p_simulated_k{k}.svg")),
            &spec,
            &series,
            &mut written,
        )?;
    }
    Ok(written)
}

/// The pool and workload of `keel analyze --inference` (defaults: the measured pool).
#[derive(clap::Args)]
struct InferenceArgs {
    /// Engines in the pool (N). Default 3.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    engines: Option<usize>,
    /// Prefix groups: requests of a group share its prefix. Default 6.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    groups: Option<usize>,
    /// Tokens of a group's prefix. Default 400.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    prefix_tokens: Option<usize>,
    /// Tokens of each request's own suffix. Default 40.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    unique_tokens: Option<usize>,
    /// Tokens of each answer. Default 24.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    output_tokens: Option<usize>,
    /// Offered load per engine under load balancing (open loop): arrivals x the service time
    /// of a request served alone; batching engines keep up past 1. Default 0.5.
    #[arg(
        long,
        help_heading = "Inference pools (--inference)",
        conflicts_with = "clients"
    )]
    load: Option<f64>,
    /// Closed loop instead: this many clients with one request each in flight (hit ratios
    /// only; the boundary needs --load).
    #[arg(long, help_heading = "Inference pools (--inference)")]
    clients: Option<usize>,
    /// Zipf exponent of the groups' popularity (0 = uniform). Default 0.
    #[arg(
        long,
        help_heading = "Inference pools (--inference)",
        conflicts_with = "hot_share"
    )]
    skew: Option<f64>,
    /// Instead of --skew: the first group's share of requests, the rest split evenly.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    hot_share: Option<f64>,
    /// Affinity's cap on an engine's share of requests, as a multiple of the mean (>= 1);
    /// the excess goes to the other engines. Default: none.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    bound: Option<f64>,
    /// Count a finite run of this many requests (each group's first request on an engine
    /// misses). Default: the steady state.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    requests: Option<u64>,
    /// KV cache blocks per engine. Default 120.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    kv_blocks: Option<usize>,
    /// Tokens per KV block. Default 16.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    block_tokens: Option<usize>,
    /// Prefill speed, prompt tokens per second. Default 4000.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    prefill_tps: Option<f64>,
    /// Fixed cost of a step, milliseconds. Default 6.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    step_ms: Option<f64>,
    /// Added cost per running sequence in a step, milliseconds. Default 0.3.
    #[arg(long, help_heading = "Inference pools (--inference)")]
    step_per_seq_ms: Option<f64>,
}

impl InferenceArgs {
    fn given(&self) -> bool {
        self.engines.is_some()
            || self.groups.is_some()
            || self.prefix_tokens.is_some()
            || self.unique_tokens.is_some()
            || self.output_tokens.is_some()
            || self.load.is_some()
            || self.clients.is_some()
            || self.skew.is_some()
            || self.hot_share.is_some()
            || self.bound.is_some()
            || self.requests.is_some()
            || self.kv_blocks.is_some()
            || self.block_tokens.is_some()
            || self.prefill_tps.is_some()
            || self.step_ms.is_some()
            || self.step_per_seq_ms.is_some()
    }
}

/// The JSON of `keel analyze --inference`.
#[derive(Serialize)]
struct InferenceAnalysis {
    /// "prefix-affinity" or "load-balancing".
    #[serde(rename = "use")]
    use_: &'static str,
    engines: usize,
    groups: usize,
    prefix_tokens: usize,
    unique_tokens: usize,
    output_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    load: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    clients: Option<usize>,
    popularity: String,
    bound: Option<f64>,
    engine: keel_model::inference::EngineSpec,
    affinity: PoolJson,
    balanced: PoolJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    r: Option<f64>,
    k: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_order_wins: Option<bool>,
    /// First-order load above which affinity stops paying (null: never below saturation).
    #[serde(skip_serializing_if = "Option::is_none")]
    first_order_limit: Option<Option<f64>>,
    /// Load above which affinity's mean TTFT is no longer below balancing's (null: it is up to
    /// load 10; absent with --clients).
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<Option<f64>>,
    /// Above `limit` the two tie (under balancing too every prefix stays held by a running
    /// request) rather than affinity losing.
    ties_above: bool,
}

#[derive(Serialize)]
struct PoolJson {
    cached: f64,
    /// Mean TTFT, seconds (continuous batching).
    ttft: f64,
    hot_spot: f64,
    shares: Vec<f64>,
    cached_per_engine: Vec<f64>,
    utilization: Vec<f64>,
}

impl PoolJson {
    fn of(p: &keel_model::inference::formula::PoolLoad) -> Self {
        PoolJson {
            cached: p.cached,
            ttft: p.ttft,
            hot_spot: p.hot_spot(),
            shares: p.engines.iter().map(|e| e.share).collect(),
            cached_per_engine: p.engines.iter().map(|e| e.cached).collect(),
            utilization: p.engines.iter().map(|e| e.utilization).collect(),
        }
    }
}

fn run_inference(a: &InferenceArgs, json: bool) -> anyhow::Result<()> {
    use keel_model::inference::formula::{self, Arrivals, Popularity, Routing, Workload};
    use keel_model::inference::EngineSpec;

    let d = EngineSpec::default();
    let spec = EngineSpec {
        kv_blocks: a.kv_blocks.unwrap_or(d.kv_blocks),
        block_tokens: a.block_tokens.unwrap_or(d.block_tokens),
        prefill_tps: a.prefill_tps.unwrap_or(d.prefill_tps),
        step_ms: a.step_ms.unwrap_or(d.step_ms),
        step_per_seq_ms: a.step_per_seq_ms.unwrap_or(d.step_per_seq_ms),
        ..d
    };
    let engines = a.engines.unwrap_or(3);
    if engines == 0 {
        return usage("--engines must be at least 1");
    }
    let groups = a.groups.unwrap_or(6);
    if groups == 0 {
        return usage("--groups must be at least 1");
    }
    if spec.kv_blocks == 0 || spec.block_tokens == 0 {
        return usage("--kv-blocks and --block-tokens must be at least 1");
    }
    if !(spec.prefill_tps.is_finite() && spec.prefill_tps > 0.0) {
        return usage("--prefill-tps must be a finite number > 0");
    }
    if !(spec.step_ms >= 0.0 && spec.step_per_seq_ms >= 0.0) {
        return usage("--step-ms and --step-per-seq-ms must be >= 0");
    }
    let popularity = match (a.skew, a.hot_share) {
        (_, Some(h)) if !(0.0..=1.0).contains(&h) => {
            return usage(format!(
                "--hot-share is a share of requests in [0, 1], got {h}"
            ))
        }
        (_, Some(h)) => Popularity::Hot(h),
        (Some(s), None) if !(s.is_finite() && s >= 0.0) => {
            return usage(format!("--skew is a Zipf exponent >= 0, got {s}"))
        }
        (s, None) => Popularity::Zipf(s.unwrap_or(0.0)),
    };
    if let Some(b) = a.bound {
        if !(b.is_finite() && b >= 1.0) {
            return usage(format!(
                "--bound is a multiple of the mean share, >= 1, got {b}"
            ));
        }
    }
    let w = Workload {
        groups,
        prefix_tokens: a.prefix_tokens.unwrap_or(400),
        unique_tokens: a.unique_tokens.unwrap_or(40),
        output_tokens: a.output_tokens.unwrap_or(24),
        popularity,
        requests: a.requests,
    };
    if w.prompt_tokens() == 0 || w.output_tokens == 0 {
        return usage("the prompt and the answer need at least one token each");
    }
    let popularity_text = match popularity {
        Popularity::Zipf(0.0) => "uniform".to_string(),
        Popularity::Zipf(s) => format!("Zipf {s}"),
        Popularity::Hot(h) => format!("hot share {h}"),
    };
    let affinity_routing = Routing::Affinity { bound: a.bound };

    let out = match a.clients {
        Some(0) => return usage("--clients must be at least 1"),
        Some(c) => {
            let aff = formula::pool(&spec, &w, engines, affinity_routing, Arrivals::Clients(c));
            let lb = formula::pool(&spec, &w, engines, Routing::Balanced, Arrivals::Clients(c));
            let k = aff.hot_spot();
            InferenceAnalysis {
                use_: if aff.cached > lb.cached + 1e-9 {
                    "prefix-affinity"
                } else {
                    "load-balancing"
                },
                engines,
                groups,
                prefix_tokens: w.prefix_tokens,
                unique_tokens: w.unique_tokens,
                output_tokens: w.output_tokens,
                load: None,
                clients: Some(c),
                popularity: popularity_text,
                bound: a.bound,
                engine: spec,
                affinity: PoolJson::of(&aff),
                balanced: PoolJson::of(&lb),
                r: None,
                k,
                first_order_wins: None,
                first_order_limit: None,
                limit: None,
                ties_above: false,
            }
        }
        None => {
            let rho = a.load.unwrap_or(0.5);
            if !(rho.is_finite() && rho > 0.0) {
                return usage(format!("--load is an offered load > 0, got {rho}"));
            }
            let c = formula::compare(&spec, &w, engines, a.bound, rho);
            let first = formula::first_order_limit(c.r, c.k);
            let limit = formula::affinity_limit(&spec, &w, engines, a.bound);
            // Past the limit affinity either loses or ties (every prefix held by a running
            // request under balancing too): say which.
            let ties_above = limit.filter(|l| l.is_finite()).is_some_and(|l| {
                let next = formula::compare(&spec, &w, engines, a.bound, l + 0.01);
                next.affinity.ttft <= next.balanced.ttft * 1.001
            });
            InferenceAnalysis {
                use_: if c.wins {
                    "prefix-affinity"
                } else {
                    "load-balancing"
                },
                engines,
                groups,
                prefix_tokens: w.prefix_tokens,
                unique_tokens: w.unique_tokens,
                output_tokens: w.output_tokens,
                load: Some(rho),
                clients: None,
                popularity: popularity_text,
                bound: a.bound,
                engine: spec,
                affinity: PoolJson::of(&c.affinity),
                balanced: PoolJson::of(&c.balanced),
                r: Some(c.r),
                k: c.k,
                first_order_wins: Some(c.first_order_wins),
                first_order_limit: Some(first.is_finite().then_some(first)),
                // None from the scan: no win even at the lowest load: the limit is 0.
                limit: Some(match limit {
                    Some(l) if l.is_infinite() => None,
                    Some(l) => Some(l),
                    None => Some(0.0),
                }),
                ties_above,
            }
        }
    };
    if json {
        emit(&format!("{}\n", serde_json::to_string(&out)?))?;
    } else {
        emit(&describe_inference(&out))?;
    }
    Ok(())
}

fn share(x: f64) -> String {
    format!("{x:.3}")
}

fn ms(seconds: f64) -> String {
    if seconds.is_finite() {
        format!("{:.1} ms", seconds * 1000.0)
    } else {
        "unbounded (overloaded)".to_string()
    }
}

/// The readable form: the answer first, then the numbers, then the method.
fn describe_inference(a: &InferenceAnalysis) -> String {
    let mut t = String::new();
    let (aff, lb) = (&a.affinity, &a.balanced);
    match a.load {
        Some(rho) => {
            let stops = match a.limit.flatten() {
                None => "affinity pays at every load up to 10 at this skew".to_string(),
                Some(l) if l <= 0.0 => "affinity does not pay at any load at this skew".to_string(),
                Some(l) if a.ties_above => format!(
                    "affinity stops paying above load {l:.2} at this skew (the two tie there: \
                     under balancing too, running requests keep every prefix cached)"
                ),
                Some(l) => format!("affinity stops paying above load {l:.2} at this skew"),
            };
            let _ = writeln!(
                t,
                "use {}: {} of prompt tokens from cache against {}; mean TTFT {} against {} at \
                 load {rho}; {stops}",
                a.use_,
                share(aff.cached),
                share(lb.cached),
                ms(aff.ttft),
                ms(lb.ttft),
            );
        }
        None => {
            let _ = writeln!(
                t,
                "use {}: {} of prompt tokens from cache against {} with {} clients; busiest \
                 engine {:.2}x the mean under affinity; mean TTFT {} against {} (give --load \
                 for the boundary)",
                a.use_,
                share(aff.cached),
                share(lb.cached),
                a.clients.unwrap_or(0),
                aff.hot_spot,
                ms(aff.ttft),
                ms(lb.ttft),
            );
        }
    }
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "pool: {} engines of {} KV blocks x {} tokens, prefill {} tokens/s, step {} ms + {} ms \
         per sequence",
        a.engines,
        a.engine.kv_blocks,
        a.engine.block_tokens,
        a.engine.prefill_tps,
        a.engine.step_ms,
        a.engine.step_per_seq_ms
    );
    let _ = writeln!(
        t,
        "workload: {} groups ({}) of {} prefix tokens + {} own + {} output{}",
        a.groups,
        a.popularity,
        a.prefix_tokens,
        a.unique_tokens,
        a.output_tokens,
        a.bound.map_or(String::new(), |b| format!(
            "; affinity bounded at {b}x the mean share"
        ))
    );
    for (name, p) in [("prefix-affinity", aff), ("load-balancing", lb)] {
        let _ = writeln!(
            t,
            "{name:>16}: cached {}  mean TTFT {}  shares {}  cached per engine {}{}",
            share(p.cached),
            ms(p.ttft),
            list(&p.shares),
            list(&p.cached_per_engine),
            if a.load.is_some() {
                format!("  utilization {}", list(&p.utilization))
            } else {
                String::new()
            }
        );
    }
    if let (Some(r), Some(rho)) = (a.r, a.load) {
        let first = match a.first_order_limit.flatten() {
            Some(l) => format!("wins below load {l:.2}"),
            None if r < 1.0 => "wins at every load".to_string(),
            None => "never wins".to_string(),
        };
        let _ = writeln!(
            t,
            "first order: r = {r:.3} (hot engine's service time / balanced), k = {:.2}; affinity \
             wins where r < 1/(1 + (k-1) rho) = {:.3} at rho = {rho}: {} ({first})",
            a.k,
            1.0 / (1.0 + (a.k - 1.0) * rho),
            if a.first_order_wins == Some(true) {
                "yes"
            } else {
                "no"
            },
        );
    }
    let _ = writeln!(
        t,
        "method: affinity partitions the groups (largest first onto the least loaded engine); \
         each engine's LRU cache by Che's approximation on its own mix, less the blocks pinned \
         by requests in flight (Little's law); TTFT of continuous batching per engine; load = \
         arrivals x service time alone (docs/inference.md)"
    );
    t
}

fn list(xs: &[f64]) -> String {
    let items: Vec<String> = xs.iter().map(|x| format!("{x:.2}")).collect();
    format!("[{}]", items.join(", "))
}
