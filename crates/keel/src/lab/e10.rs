//! E10: `keel advise` checked against what then happens. keel-testbed backends with a mix drawn
//! from the seed (one failing fast for part of every 100 ms, one 3x slower serving 2 calls at
//! once, one healthy) behind keel proxy running round-robin without protections and writing
//! the JSON access log, for a bounded number of requests; `keel advise`'s fit and ranking on
//! that log; then the top three recommended configurations and the running one measured for
//! real on the same backends, each through keel proxy with the recommendation's own
//! `[[cluster]]` settings. A row agrees when the measured and predicted success differ by less
//! than 1.96 standard errors of their difference (the lab's rule for the simulation).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use keel_model::advise::{self, Advice, RunningConfig};
use keel_model::fit::scenario::ScenarioOptions;
use keel_model::fit::{self, FitOptions};
use keel_model::stats::{wilson95, Z95};
use keel_model::{FailureMode, Latency, LatencyDist};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};
use keel_testbed::loadgen::{self, LoadOptions, LoadSpec, Target};

use crate::lab::answer::{self, Finding};
use crate::lab::e10_rows::{E10Report, E10Row};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;
use crate::lab::style::esc;

const LATENCY_MS: u64 = 4;
const PER_TRY: &str = "400ms";

struct Mix {
    backends: Vec<BackendHandle>,
    addrs: Vec<SocketAddr>,
    down_share: f64,
}

async fn backends(seed: u64) -> anyhow::Result<Mix> {
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let lognormal = |ms: u64| Latency {
        mean: Duration::from_millis(ms),
        dist: LatencyDist::LogNormal { sigma: 0.5 },
    };
    // The seed draws how long the flapping backend is down in every 100 ms: 20, 30 or 40 ms.
    let down = 20 + 10 * (seed % 3);
    let configs = [
        BackendConfig {
            latency: lognormal(LATENCY_MS),
            name: "healthy".into(),
            ..BackendConfig::default()
        },
        BackendConfig {
            latency: lognormal(LATENCY_MS),
            fault: FailureMode::Flap {
                up: Duration::from_millis(100 - down),
                down: Duration::from_millis(down),
                down_fails_after: Some(Duration::ZERO),
            },
            name: "fails-fast".into(),
            ..BackendConfig::default()
        },
        BackendConfig {
            latency: lognormal(3 * LATENCY_MS),
            concurrency: Some(2),
            name: "slow-2-slots".into(),
            ..BackendConfig::default()
        },
    ];
    let mut out = Vec::new();
    for (i, cfg) in configs.into_iter().enumerate() {
        out.push(
            backend::spawn_with_seed(loopback, cfg, seed.wrapping_add(i as u64))
                .await
                .context("starting an E10 backend")?,
        );
    }
    let addrs = out.iter().map(|b| b.addr()).collect();
    Ok(Mix {
        backends: out,
        addrs,
        down_share: down as f64 / 100.0,
    })
}

/// The running configuration: round-robin, no protections, the JSON access log at `log`.
fn running_toml(addrs: &[SocketAddr], log: &Path) -> String {
    let eps: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    format!(
        "[access_log]\npath = {:?}\nformat = \"json\"\n\n{}\
         [[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\nendpoints = [{}]\n\
         outlier_detection = false\nrequest_timeout = \"1s\"\n\n[cluster.retry]\nattempts = 0\nper_try_timeout = \"{PER_TRY}\"\n",
        log.display(),
        LISTENER,
        eps.join(", ")
    )
}

const LISTENER: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n";

/// Runs `requests` through a proxy started from `toml`; returns the load report.
async fn measure(
    toml: &str,
    requests: u64,
    concurrency: usize,
) -> anyhow::Result<keel_testbed::loadgen::LoadReport> {
    let config = keel_proxy::ProxyConfig::from_toml_str(toml, "e10")
        .map_err(|e| anyhow::anyhow!("E10 proxy configuration: {e}\n{toml}"))?;
    let proxy = keel_proxy::start(config).await?;
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    let spec = LoadSpec {
        target: Target::Url(url),
        requests,
        concurrency,
        timeout: Duration::from_secs(3),
        calls_per_request: 1,
    };
    let options = LoadOptions {
        deadline: Some(Duration::from_secs(120)),
        ..LoadOptions::default()
    };
    let load = loadgen::try_run(spec, options)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // The shutdown flushes the access log.
    proxy.shutdown(Duration::from_millis(500)).await;
    Ok(load)
}

fn row(rank: usize, r: &advise::Ranked, load: &keel_testbed::loadgen::LoadReport) -> E10Row {
    let (lo, hi) = wilson95(load.succeeded, load.requests);
    let m = load.success_rate();
    let se = |lo: f64, hi: f64| (hi - lo) / (2.0 * Z95);
    let se_diff = (se(lo, hi).powi(2) + se(r.success[1], r.success[2]).powi(2)).sqrt();
    let diff = m - r.success[0];
    let z = if se_diff > 0.0 {
        diff / se_diff
    } else if diff == 0.0 {
        0.0
    } else {
        diff.signum() * f64::INFINITY
    };
    E10Row {
        rank,
        strategy: r.strategy.clone(),
        protections: r.protections.clone(),
        running: r.running,
        predicted: r.success,
        measured: [m, lo, hi],
        requests: load.requests,
        predicted_p99_ms: r.p99_ms,
        measured_p99_ms: load.latency_p99.as_secs_f64() * 1e3,
        z,
        agrees: z.abs() <= Z95,
    }
}

/// The requests of the logged run and of each measured configuration.
fn requests(quick: bool) -> u64 {
    if quick {
        1_500
    } else {
        3_000
    }
}

/// Runs E10 on `runtime`, writing the log, the advice and the fitted scenario under
/// `out/e10/`; `measured(requests)` is told of every run's requests when it ends.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    out: &Path,
    seed: u64,
    quick: bool,
    measured: &dyn Fn(u64),
) -> anyhow::Result<E10Report> {
    let dir = out.join("e10");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let dir = dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dir.display()))?;
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let requests = requests(quick);
    let concurrency = 6;
    let mix = runtime.block_on(backends(seed))?;
    let running = running_toml(&mix.addrs, &log);
    runtime.block_on(measure(&running, requests, concurrency))?;
    measured(requests);

    let model = fit::fit_reader(
        std::io::BufReader::new(
            std::fs::File::open(&log).with_context(|| format!("opening {}", log.display()))?,
        ),
        &FitOptions::default(),
    )
    .map_err(|e| anyhow::anyhow!("E10: {}: {e}", log.display()))?;
    let config = keel_proxy::ProxyConfig::from_toml_str(&running, "e10")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let c = &config.clusters[0];
    let running_cfg = RunningConfig {
        balancer: c.balancer_config(),
        retry_attempts: c.protections.retry.attempts,
        retry_budget: c.protections.retry.budget(),
        health_check: None,
        per_try_timeout: c.per_try_timeout(),
        weights: Vec::new(),
    };
    let mut sopts = ScenarioOptions::for_model(&model);
    sopts.seed = seed;
    let advice: Advice = advise::advise(
        &model,
        &sopts,
        Some(&running_cfg),
        &log.display().to_string(),
        &|_| {},
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    std::fs::write(
        dir.join("advice.json"),
        serde_json::to_string_pretty(&advice)?,
    )?;
    std::fs::write(dir.join("fitted.toml"), &advice.scenario_toml)?;

    let mut chosen: Vec<usize> = (0..advice.ranking.len().min(3)).collect();
    if let Some(r) = advice.running {
        if !chosen.contains(&r) {
            chosen.push(r);
        }
    }
    let mut rows = Vec::new();
    for i in chosen {
        let r = &advice.ranking[i];
        let toml = format!("{LISTENER}{}", r.cluster_toml);
        let load = runtime.block_on(measure(&toml, requests, concurrency))?;
        measured(requests);
        rows.push(row(i + 1, r, &load));
    }
    runtime.block_on(async {
        for b in mix.backends {
            b.shutdown().await;
        }
    });
    let best = rows
        .iter()
        .map(|r| r.measured[0])
        .fold(f64::NEG_INFINITY, f64::max);
    let recommended_holds = rows[0].measured[2] >= best;
    let report = E10Report {
        agreeing: rows.iter().filter(|r| r.agrees).count(),
        rows,
        logged_requests: model.requests,
        down_share: mix.down_share,
        recommended_holds,
        why: advice.why.clone(),
    };
    std::fs::write(dir.join("e10.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(report)
}

/// The table's lines: at most 100 columns (z and p99 only with `wide`).
fn table(r: &E10Report, wide: bool) -> Vec<String> {
    let columns = crate::lab::report::COLUMNS;
    let mut out = answer::wrap(
        &format!(
            "E10: keel advise on {} logged requests (round-robin, no protections; one backend \
             fails fast {:.0} % of the time, one is 3x slower with 2 slots), then measured:",
            r.logged_requests,
            r.down_share * 100.0
        ),
        columns,
        "",
    );
    let pct = |x: &[f64; 3]| {
        format!(
            "{:.2} [{:.2}, {:.2}]",
            x[0] * 100.0,
            x[1] * 100.0,
            x[2] * 100.0
        )
    };
    let mark = |row: &E10Row| if row.running { "*" } else { " " };
    let verdict = |row: &E10Row| if row.agrees { "agrees" } else { "differs" };
    if wide {
        out.push(format!(
            "{:>4}  {:<18} {:<33} {:<26} {:<26} {:>7} {:>9} {:>9}  verdict",
            "rank",
            "strategy",
            "protections",
            "predicted % [95 %]",
            "measured % [95 %]",
            "z",
            "p99 pred",
            "p99 meas"
        ));
        for row in &r.rows {
            out.push(format!(
                "{:>3}{} {:<18} {:<33} {:<26} {:<26} {:>7.2} {:>9.1} {:>9.1}  {}",
                row.rank,
                mark(row),
                row.strategy,
                row.protections,
                pct(&row.predicted),
                pct(&row.measured),
                row.z,
                row.predicted_p99_ms[0],
                row.measured_p99_ms,
                verdict(row)
            ));
        }
    } else {
        // 4 + 1 + 16 + 1 + 24 + 1 + 22 + 1 + 22 + 1 + 7 = 100 columns.
        out.push(format!(
            "{:>4} {:<16} {:<24} {:<22} {:<22} verdict",
            "rank", "strategy", "protections", "predicted % [95 %]", "measured % [95 %]"
        ));
        for row in &r.rows {
            out.push(format!(
                "{:>3}{} {:<16} {:<24} {:<22} {:<22} {}",
                row.rank,
                mark(row),
                crate::lab::report::fit(&row.strategy, 16),
                crate::lab::report::fit(&row.protections, 24),
                pct(&row.predicted),
                pct(&row.measured),
                verdict(row)
            ));
        }
    }
    out.extend(answer::wrap(
        &format!(
            "{} of {} rows agree (|z| <= 1.96); the recommended configuration {} (* the running \
             one{})",
            r.agreeing,
            r.rows.len(),
            if r.recommended_holds {
                "was measured best or within its interval of the best"
            } else {
                "was NOT measured best, nor within its interval of the best"
            },
            if wide { "" } else { "; z and p99 with --wide" }
        ),
        columns,
        "",
    ));
    out
}

/// E10 as a lab experiment: run only when named.
pub struct E10 {
    selected: bool,
    quick: bool,
    out: PathBuf,
    report: Option<E10Report>,
}

impl E10 {
    /// E10 when `--experiments` names it.
    pub fn new(opts: &LabOptions) -> Self {
        E10 {
            selected: opts.experiments.iter().any(|e| e == "e10"),
            quick: opts.quick,
            out: opts.out.clone(),
            report: None,
        }
    }
}

impl Experiment for E10 {
    fn names(&self) -> &'static [&'static str] {
        &["e10"]
    }

    /// The logged run, then at most four configurations measured (the top three and the
    /// running one, when it is not among them).
    fn plan(&self) -> Vec<Planned> {
        if !self.selected {
            return Vec::new();
        }
        let requests = requests(self.quick);
        let mut plan = vec![Planned {
            what: "e10 logged run (round-robin, no protections)".into(),
            requests,
        }];
        for rank in 1..=4 {
            plan.push(Planned {
                what: format!("e10 configuration {rank} of the advice"),
                requests,
            });
        }
        plan
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        if let Some(bar) = lab.bar {
            bar.set_message("e10: keel advise on a logged run");
        }
        let report = run(lab.runtime, lab.out, lab.seed, lab.quick, &|n| {
            lab.advance(n)
        })?;
        self.report = Some(report);
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.e10 = self.report.take();
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report.e10.as_ref().and_then(finding).into_iter().collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.e10.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, wide: bool) {
        if let Some(r) = &report.e10 {
            for line in table(r, wide) {
                println!("{line}");
            }
            println!(
                "E10: {} (log, advice.json, fitted.toml, e10.json)",
                self.out.join("e10").display()
            );
        }
    }
}

fn with_protections(r: &E10Row) -> String {
    if r.protections == "none" {
        format!("{} without protections", r.strategy)
    } else {
        format!("{} with {}", r.strategy, r.protections)
    }
}

/// E10's answer: the recommendation as measured, its margin over the running configuration,
/// and how many predictions the measurements bore out.
fn finding(r: &E10Report) -> Option<Finding> {
    let best = r.rows.first()?;
    let ci = [best.measured[1], best.measured[2]];
    let mut f = Finding {
        experiment: "e10".into(),
        question: "Does keel advise's recommendation, fitted on a logged run, hold on real \
                   traffic?"
            .into(),
        strategy: best.strategy.clone(),
        protections: best.protections.clone(),
        value: best.measured[0],
        ci95: Some(ci),
        versus: None,
        versus_value: None,
        margin: None,
        margin_ci95: None,
        tie: false,
        formula: None,
        text: String::new(),
        by_failure: Vec::new(),
    };
    let mut text = format!(
        "E10 (keel advise on {} logged requests): its recommendation, {}, measured {:.4} {} \
         against {:.4} predicted",
        r.logged_requests,
        with_protections(best),
        best.measured[0],
        answer::ci_text(ci),
        best.predicted[0]
    );
    if let Some(running) = r.rows.iter().find(|x| x.running && x.rank != best.rank) {
        let m = best.measured[0] - running.measured[0];
        let mci = answer::difference_ci(
            best.measured[0],
            ci,
            running.measured[0],
            [running.measured[1], running.measured[2]],
        );
        let tie = mci[0] <= 0.0;
        f.against(
            format!("the running configuration, {}", with_protections(running)),
            running.measured[0],
            m,
            Some(mci),
            tie,
        );
        text.push_str(&format!(
            ", {} over the running {} ({:.4}){}",
            answer::margin_text(m, mci),
            with_protections(running),
            running.measured[0],
            if tie { ", a tie" } else { "" }
        ));
    }
    text.push_str(&format!(
        "; {} of {} configurations measured within 1.96 standard errors of their prediction{}.",
        r.agreeing,
        r.rows.len(),
        if r.recommended_holds {
            ""
        } else {
            "; the recommendation was NOT measured best, nor within its interval of the best"
        }
    ));
    f.text = text;
    Some(f)
}

/// E10's section of the HTML report.
fn html(r: &E10Report) -> String {
    let pct = |x: &[f64; 3]| {
        format!(
            "{:.2} [{:.2}, {:.2}]",
            x[0] * 100.0,
            x[1] * 100.0,
            x[2] * 100.0
        )
    };
    let mut h = format!(
        "<h2>E10: keel advise checked against real traffic</h2><p>keel advise fitted on {} \
         logged requests through keel proxy (round-robin, no protections; one backend fails fast \
         {:.0} % of the time, one is 3x slower with 2 slots), then its top three configurations \
         and the running one (*) measured through keel proxy with the recommendation's own \
         <code>[[cluster]]</code> settings. A row agrees when measured and predicted success \
         differ by less than 1.96 standard errors of their difference. The log, the advice and \
         the fitted scenario are in <code>e10/</code>.</p><table><tr><th>rank</th>\
         <th class=l>strategy</th><th class=l>protections</th><th>predicted % [95%]</th>\
         <th>measured % [95%]</th><th>z</th><th>p99 ms predicted</th><th>p99 ms measured</th>\
         <th class=l>verdict</th></tr>",
        r.logged_requests,
        r.down_share * 100.0
    );
    for row in &r.rows {
        let class = if row.agrees { "ok" } else { "off" };
        let _ =
            write!(
            h,
            "<tr class=\"{class}\"><td>{}{}</td><td class=l>{}</td><td class=l>{}</td><td>{}</td>\
             <td>{}</td><td>{:.2}</td><td>{:.1}</td><td>{:.1}</td><td class=\"l v\">{}</td></tr>",
            row.rank,
            if row.running { "*" } else { "" },
            esc(&row.strategy),
            esc(&row.protections),
            pct(&row.predicted),
            pct(&row.measured),
            row.z,
            row.predicted_p99_ms[0],
            row.measured_p99_ms,
            if row.agrees { "agrees" } else { "differs, mechanism unknown" }
        );
    }
    let _ = write!(
        h,
        "</table><p>{} of {} rows agree; the recommended configuration {}.</p>",
        r.agreeing,
        r.rows.len(),
        if r.recommended_holds {
            "was measured best or within its interval of the best"
        } else {
            "was NOT measured best, nor within its interval of the best"
        }
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rank: usize, strategy: &str, protections: &str, running: bool) -> E10Row {
        E10Row {
            rank,
            strategy: strategy.into(),
            protections: protections.into(),
            running,
            predicted: [0.9995, 0.9990, 0.9999],
            measured: [0.9987, 0.9975, 0.9993],
            requests: 3000,
            predicted_p99_ms: [41.2, 39.0, 44.1],
            measured_p99_ms: 43.7,
            z: -1.21,
            agrees: true,
        }
    }

    /// The terminal table fits 100 columns with the longest names advise ranks; `--wide` keeps
    /// z and p99.
    #[test]
    fn table_fits_100_columns_unless_wide() {
        let r = E10Report {
            rows: vec![
                row(1, "least-connections", "outlier+retry+health+budget", false),
                row(2, "peak-ewma", "outlier+retry+health", false),
                row(3, "prequal", "retry", false),
                row(12, "round-robin", "none", true),
            ],
            logged_requests: 3000,
            down_share: 0.25,
            agreeing: 4,
            recommended_holds: true,
            why: Vec::new(),
        };
        let narrow = table(&r, false);
        for l in &narrow {
            assert!(
                l.chars().count() <= 100,
                "{} columns: {l}",
                l.chars().count()
            );
        }
        assert!(narrow.iter().any(|l| l.starts_with(" 12* round-robin")));
        assert!(narrow
            .iter()
            .any(|l| l.starts_with("rank") && !l.contains("p99")));
        let wide = table(&r, true);
        assert!(wide.iter().any(|l| l.contains("p99 meas")));
        assert!(wide.iter().any(|l| l.chars().count() > 100));
    }
}
