//! E12: a fleet of keel proxies on a real three-member etcd on loopback, in front of three
//! backends, one failing at once (503). Random picks, Poisson arrivals of 100 requests/s over the
//! fleet (seeded), dealt to the proxies in turn or spread at random. Measured: the fleet's failed
//! tries at the failing backend (summed over the proxies' own counts) with local outlier
//! detection and with shared evidence (`shared = { quorum = 1 }`), next to keel-model's closed
//! form and simulation of the same setting (`keel_model::fleet`; docs/reliability.md, "A fleet
//! of balancers"). Run only when named (`--experiments e12`); needs `etcd` on PATH (Debian's
//! etcd-server): without it E12 is named and skipped.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use keel_model::fleet::{self, Detection, FleetSetting};
use keel_model::sim::Arrivals;
use keel_model::FailureMode;
use keel_testbed::etcd::EtcdCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::lab::answer::{self, Finding};
use crate::lab::experiment::{Experiment, Lab, Planned};
use crate::lab::fleet_rows::{FleetReport, FleetRow};
use crate::lab::options::LabOptions;
use crate::lab::results::LabReport;
use crate::lab::style::esc;

/// Requests per run: enough for every proxy to see its k-th failure alone at the largest N.
const REQUESTS: u64 = 240;
/// The fleet's request rate (Poisson), requests per second.
const RATE: f64 = 100.0;
/// Consecutive failures that eject (keel's default).
const THRESHOLD: u32 = 5;
/// Backends; the first fails.
const ENDPOINTS: u32 = 3;
/// Simulated replications per row.
const REPLICATIONS: u32 = 200;

/// E12 as a lab experiment: run only when named.
pub struct Fleet {
    selected: bool,
    quick: bool,
    report: Option<FleetReport>,
}

impl Fleet {
    /// E12 when `--experiments` names it.
    pub fn new(opts: &LabOptions) -> Self {
        Fleet {
            selected: opts.experiments.iter().any(|e| e == "e12"),
            quick: opts.quick,
            report: None,
        }
    }

    fn sizes(&self) -> &'static [u32] {
        if self.quick {
            &[1, 3]
        } else {
            &[1, 2, 3, 4]
        }
    }

    fn runs(&self) -> u64 {
        if self.quick {
            3
        } else {
            8
        }
    }
}

/// How requests reach the proxies.
#[derive(Debug, Clone, Copy)]
enum Traffic {
    InTurn,
    Spread,
}

impl Traffic {
    fn name(self) -> &'static str {
        match self {
            Traffic::InTurn => "in-turn",
            Traffic::Spread => "spread",
        }
    }

    fn arrivals(self) -> Arrivals {
        match self {
            Traffic::InTurn => Arrivals::InTurn,
            Traffic::Spread => Arrivals::Random,
        }
    }
}

fn setting(
    n: u32,
    traffic: Traffic,
    shared: bool,
    healthy: Duration,
    delay: Duration,
) -> FleetSetting {
    let detection = if shared {
        Detection::Shared { delay, quorum: 1 }
    } else {
        Detection::Local
    };
    let mut s = FleetSetting::new(n, FailureMode::FAIL_AT_ONCE, traffic.arrivals(), detection);
    s.endpoints = ENDPOINTS;
    s.threshold = THRESHOLD;
    s.rate = RATE;
    s.latency = keel_model::Latency::fixed(healthy);
    s
}

impl Experiment for Fleet {
    fn names(&self) -> &'static [&'static str] {
        &["e12"]
    }

    fn plan(&self) -> Vec<Planned> {
        if !self.selected {
            return Vec::new();
        }
        let mut plan = Vec::new();
        for &n in self.sizes() {
            for traffic in [Traffic::InTurn, Traffic::Spread] {
                for shared in [false, true] {
                    plan.push(Planned {
                        what: format!(
                            "e12 {n} proxies, traffic {}, {} detection",
                            traffic.name(),
                            if shared { "shared" } else { "local" }
                        ),
                        requests: REQUESTS * self.runs(),
                    });
                }
            }
        }
        plan
    }

    fn run(&mut self, lab: &Lab<'_>) -> anyhow::Result<()> {
        let started = Instant::now();
        let etcd = match EtcdCluster::start(3) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("E12 skipped: {e}");
                self.report = Some(FleetReport {
                    rows: Vec::new(),
                    skipped: Some(e.to_string()),
                    evidence_delay_ms: 0.0,
                    seconds: started.elapsed().as_secs_f64(),
                });
                lab.advance(self.plan().iter().map(|p| p.requests).sum());
                return Ok(());
            }
        };
        let delay = lab
            .runtime
            .block_on(evidence_delay(&etcd))
            .context("E12: timing etcd's put-to-watch delay")?;
        let mut rows = Vec::new();
        for &n in self.sizes() {
            for traffic in [Traffic::InTurn, Traffic::Spread] {
                for shared in [false, true] {
                    if let Some(bar) = lab.bar {
                        bar.set_message(format!(
                            "e12 {n} proxies, {}, {}",
                            traffic.name(),
                            if shared { "shared" } else { "local" }
                        ));
                    }
                    let mut runs = Vec::new();
                    let mut writes = 0;
                    for r in 0..self.runs() {
                        let seed = lab
                            .seed
                            .wrapping_mul(1_000_003)
                            .wrapping_add(1000 * u64::from(n) + 10 * r + u64::from(shared));
                        let got = lab
                            .runtime
                            .block_on(fleet_run(
                                &etcd,
                                n as usize,
                                shared,
                                traffic,
                                seed,
                                lab.timing.healthy,
                                &|| {
                                    if let Some(bar) = lab.bar {
                                        bar.inc(1);
                                    }
                                },
                            ))
                            .with_context(|| format!("E12: {n} proxies, run {r}"))?;
                        runs.push(got.failed);
                        writes += got.published;
                        lab.done.set(lab.done.get() + REQUESTS);
                    }
                    let st = setting(n, traffic, shared, lab.timing.healthy, delay);
                    let sim = fleet::run(&st, lab.seed, REPLICATIONS)
                        .map_err(|e| anyhow::anyhow!("E12 simulation: {e}"))?;
                    let failed: u64 = runs.iter().sum();
                    let mut x = row(n, traffic, shared, runs, st.closed_form(), &sim);
                    if shared {
                        x.writes_per_failed_try = Some(writes as f64 / failed.max(1) as f64);
                    }
                    rows.push(x);
                }
            }
        }
        self.report = Some(FleetReport {
            rows,
            skipped: None,
            evidence_delay_ms: delay.as_secs_f64() * 1e3,
            seconds: started.elapsed().as_secs_f64(),
        });
        Ok(())
    }

    fn rows(&mut self, report: &mut LabReport) {
        report.fleet = self.report.take();
    }

    fn answer(&self, report: &LabReport) -> Vec<Finding> {
        report
            .fleet
            .as_ref()
            .and_then(finding)
            .into_iter()
            .collect()
    }

    fn html(&self, report: &LabReport) -> String {
        report.fleet.as_ref().map(html).unwrap_or_default()
    }

    fn print(&self, report: &LabReport, _wide: bool) {
        if let Some(r) = &report.fleet {
            for line in table(r) {
                println!("{line}");
            }
        }
    }
}

fn row(
    n: u32,
    traffic: Traffic,
    shared: bool,
    runs: Vec<u64>,
    closed_form: Option<f64>,
    sim: &fleet::FleetResult,
) -> FleetRow {
    let xs: Vec<f64> = runs.iter().map(|&x| x as f64).collect();
    let measured = xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    // A count is never negative: the interval of a few runs is cut at 0. Runs that all paid the
    // same count give a zero-width t interval; a mean of R integer counts is known to 1/R, so
    // the interval is never narrower than half of that each side.
    let (lo, hi) = keel_model::stats::student_t95(&xs).unwrap_or((measured, measured));
    let resolution = 0.5 / xs.len().max(1) as f64;
    let lo = lo.min(measured - resolution).max(0.0);
    let hi = hi.max(measured + resolution);
    let inside = |v: f64| (lo..=hi).contains(&v);
    let overlaps = lo <= sim.ci95.1 && sim.ci95.0 <= hi;
    let counted = closed_form.is_some_and(|c| excess_agrees(&runs, THRESHOLD, c));
    FleetRow {
        proxies: n,
        traffic: traffic.name().into(),
        detection: if shared { "shared" } else { "local" }.into(),
        runs,
        measured,
        measured_ci95: [lo, hi],
        closed_form,
        simulated: sim.mean,
        simulated_ci95: [sim.ci95.0, sim.ci95.1],
        agrees: closed_form.is_some_and(inside) || overlaps || counted,
        writes_per_failed_try: None,
    }
}

/// The tries a fleet pays beyond the threshold are a count of rare events (tries that reach
/// the failed endpoint while evidence travels): over R runs their total is close to
/// Poisson(R (model - k)). Agrees when the measured total is not in either 2.5 % tail: eight
/// runs of exactly k against a model of k + 0.09 are likely (P = 0.49), not a departure.
fn excess_agrees(runs: &[u64], k: u32, model: f64) -> bool {
    if runs.is_empty() || runs.iter().any(|&x| x < u64::from(k)) {
        return false;
    }
    let total: u64 = runs.iter().map(|&x| x - u64::from(k)).sum();
    let mean = runs.len() as f64 * (model - f64::from(k)).max(0.0);
    // P(X <= n) for X ~ Poisson(mean).
    let cdf = |n: u64| {
        let (mut term, mut sum) = ((-mean).exp(), 0.0);
        for i in 0..=n {
            if i > 0 {
                term *= mean / i as f64;
            }
            sum += term;
        }
        sum
    };
    let below = cdf(total);
    let above = if total == 0 {
        1.0
    } else {
        1.0 - cdf(total - 1)
    };
    below >= 0.025 && above >= 0.025
}

/// etcd's part of the evidence's delay: 60 puts, each timed from before the put to the watch
/// event at another client (the path a published failure takes); their mean.
#[cfg(feature = "etcd")]
async fn evidence_delay(etcd: &EtcdCluster) -> anyhow::Result<Duration> {
    let key = "/keel/lab/e12/delay";
    let mut writer = etcd_client::Client::connect(etcd.endpoints(), None).await?;
    let mut reader = etcd_client::Client::connect(etcd.endpoints(), None).await?;
    let mut watch = reader.watch(key, None).await?;
    let mut took = Duration::ZERO;
    const PUTS: u32 = 60;
    for i in 0..PUTS {
        let start = Instant::now();
        writer.put(key, i.to_string(), None).await?;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), watch.message())
                .await
                .context("no watch event within 5 s")??
                .context("the watch ended")?;
            if !m.events().is_empty() {
                break;
            }
        }
        took += start.elapsed();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(took / PUTS)
}

/// Without etcd support there is no proxy to measure (E12's configuration needs `[etcd]`).
#[cfg(not(feature = "etcd"))]
async fn evidence_delay(_: &EtcdCluster) -> anyhow::Result<Duration> {
    anyhow::bail!("this keel was built without the `etcd` feature")
}

/// What one run counted, summed over the proxies.
struct RunCount {
    /// Failed tries at the failing backend (each proxy's own count).
    failed: u64,
    /// Evidence records written to etcd (`shared_evidence.published` of `/status`).
    published: u64,
}

/// One run: `n` proxies started on `etcd`, 3 backends (the first failing at once), REQUESTS
/// Poisson arrivals at RATE dealt by `traffic`; what it counted.
async fn fleet_run(
    etcd: &EtcdCluster,
    n: usize,
    shared: bool,
    traffic: Traffic,
    seed: u64,
    healthy: Duration,
    sent: &dyn Fn(),
) -> anyhow::Result<RunCount> {
    let timing = crate::lab::cases::Timing {
        healthy,
        ..crate::lab::cases::Timing::default()
    };
    let backends = crate::lab::measure::backends(
        ENDPOINTS,
        FailureMode::FAIL_AT_ONCE,
        |i| i == 0,
        &timing,
        seed,
    )
    .await?;
    let endpoints: Vec<String> = backends
        .iter()
        .map(|b| format!("{{ address = \"{}\" }}", b.addr()))
        .collect();
    let members: Vec<String> = etcd
        .endpoints()
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect();
    let mut proxies = Vec::new();
    for i in 0..n {
        let text = format!(
            "name = \"e12-{i}\"\n\n[etcd]\nendpoints = [{}]\ndial_timeout = \"1s\"\n\n\
             [admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\
             cluster = \"e12\"\n\n[[cluster]]\nname = \"e12\"\nstrategy = \"random\"\nseed = {}\n\
             endpoints = [{}]\n[cluster.outlier_detection]\nconsecutive_failures = {THRESHOLD}\n\
             max_ejection_percent = 34\n{}",
            members.join(", "),
            seed.wrapping_add(i as u64),
            endpoints.join(", "),
            if shared {
                "shared = { quorum = 1 }\n"
            } else {
                ""
            }
        );
        let config = keel_proxy::ProxyConfig::from_toml_str(&text, "e12.toml")
            .map_err(|e| anyhow::anyhow!("E12 proxy configuration: {e}"))?;
        proxies.push(keel_proxy::start(config).await?);
    }
    if shared {
        // Every proxy exchanging evidence before the first request.
        for p in &proxies {
            let admin = p.admin_addr().context("E12: a proxy without its admin")?;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let (_, body) = get(admin, "/status").await?;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if v["clusters"][0]["shared_evidence"]["connected"] == true {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "E12: a proxy did not connect to etcd within 10 s: {}",
                    v["clusters"][0]["shared_evidence"]
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let listeners: Vec<SocketAddr> = proxies.iter().map(|p| p.listener_addrs()[0]).collect();
    let mut gaps = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    let mut deal = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed ^ 0x5eed);
    let mut next = tokio::time::Instant::now();
    let pace = Duration::from_secs_f64(1.0 / RATE);
    for i in 0..REQUESTS as usize {
        let u: f64 = rand::Rng::gen_range(&mut gaps, f64::EPSILON..1.0);
        next += pace.mul_f64(-u.ln());
        tokio::time::sleep_until(next).await;
        let p = match traffic {
            Traffic::InTurn => i % n,
            Traffic::Spread => rand::Rng::gen_range(&mut deal, 0..n),
        };
        let (status, _) = get(listeners[p], "/").await?;
        anyhow::ensure!(
            status == 200 || status == 503,
            "E12: unexpected status {status}"
        );
        sent();
    }
    let failing = backends[0].addr().to_string();
    let mut count = RunCount {
        failed: 0,
        published: 0,
    };
    for p in &proxies {
        if shared {
            let admin = p.admin_addr().context("E12: a proxy without its admin")?;
            let (_, body) = get(admin, "/status").await?;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            count.published += v["clusters"][0]["shared_evidence"]["published"]
                .as_u64()
                .context("E12: /status without shared_evidence.published")?;
        }
        count.failed += p
            .cluster_status("e12")
            .unwrap_or_default()
            .iter()
            .find(|e| e.address == failing)
            .map_or(0, |e| e.failures);
    }
    for p in proxies {
        p.shutdown(Duration::from_millis(200)).await;
    }
    for b in backends {
        b.shutdown().await;
    }
    Ok(count)
}

/// One GET on a connection of its own: the status and the body. HTTP/1.0, so that the body
/// comes whole (never chunked) and the connection closes after it; `Host` is the address (the
/// admin listener answers only to an address or localhost).
async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .with_context(|| format!("E12: GET {path} from {addr} took over 5 s"))?
        .with_context(|| format!("E12: GET {path} from {addr}"))?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("E12: no status in the answer from {addr}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// At the largest N with traffic in turn: shared against local.
fn finding(r: &FleetReport) -> Option<Finding> {
    let n = r.rows.iter().map(|x| x.proxies).max()?;
    let at = |detection: &str| {
        r.rows
            .iter()
            .find(|x| x.proxies == n && x.traffic == "in-turn" && x.detection == detection)
    };
    let (local, shared) = (at("local")?, at("shared")?);
    let margin = shared.measured - local.measured;
    // The difference of two independent means: their half-widths added in quadrature.
    let half = |x: &FleetRow| (x.measured_ci95[1] - x.measured_ci95[0]) / 2.0;
    let h = (half(local).powi(2) + half(shared).powi(2)).sqrt();
    let ci = [margin - h, margin + h];
    let tie = ci[0] <= 0.0 && ci[1] >= 0.0;
    let agreeing = r.rows.iter().filter(|x| x.agrees).count();
    let mut f = Finding::new(
        "e12",
        "How many failed tries does a fleet of keel proxies pay before every proxy stops sending \
         to a failed endpoint, each learning alone or sharing evidence on etcd?",
        "random".into(),
        "outlier detection, shared evidence (quorum 1)".into(),
        shared.measured,
        Some(shared.measured_ci95),
    );
    f.formula = shared.closed_form.map(|c| {
            format!(
                "shared, quorum 1: k + (N - 1) E[min(X, k)] + Λ p t_fail, X ~ Poisson(Λ p d / N), \
                 at N = {n}, k = {THRESHOLD}, Λ = {RATE}/s, p = 1/{ENDPOINTS}, d = {:.1} ms: {c:.2}",
                r.evidence_delay_ms
            )
        });
    f.against(
        format!("local detection at N = {n}"),
        local.measured,
        margin,
        Some(ci),
        tie,
    );
    f.text = format!(
        "E12 (a fleet of {n} keel proxies on a three-member etcd, one backend of {ENDPOINTS} \
         failing at once, traffic in turn): shared evidence paid {:.1} {} failed tries before \
         every proxy stopped sending to it, local detection {:.1} {} ({:.0} % of local; closed \
         forms {} and {}, simulated {:.1} and {:.1}); {agreeing} of {} rows agree with the closed \
         form or the simulation.",
        shared.measured,
        bracket(shared.measured_ci95),
        local.measured,
        bracket(local.measured_ci95),
        100.0 * shared.measured / local.measured.max(f64::MIN_POSITIVE),
        fmt_opt(shared.closed_form),
        fmt_opt(local.closed_form),
        shared.simulated,
        local.simulated,
        r.rows.len()
    );
    Some(f)
}

fn fmt_opt(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.2}"))
}

fn bracket(x: [f64; 2]) -> String {
    format!("[{:.1}, {:.1}]", x[0], x[1])
}

fn interval(x: [f64; 2]) -> String {
    format!("{:.1}-{:.1}", x[0], x[1])
}

/// The terminal table: within 100 columns.
fn table(r: &FleetReport) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(why) = &r.skipped {
        out.extend(answer::wrap(
            &format!("E12 skipped: {why}"),
            crate::lab::report::COLUMNS,
            "",
        ));
        return out;
    }
    out.push(
        "E12: failed tries a fleet pays before every proxy stops sending to a failed endpoint"
            .into(),
    );
    out.push(format!(
        "{:>2} {:<8} {:<7} {:>6} {:<11} {:>6} {:>6} {:<11} {:<7} runs",
        "N", "traffic", "detect", "meas.", "95% CI", "model", "sim.", "sim. 95%", "verdict"
    ));
    for x in &r.rows {
        let runs: Vec<String> = x.runs.iter().map(|v| v.to_string()).collect();
        out.push(format!(
            "{:>2} {:<8} {:<7} {:>6.1} {:<11} {:>6} {:>6.1} {:<11} {:<7} {}",
            x.proxies,
            x.traffic,
            x.detection,
            x.measured,
            interval(x.measured_ci95),
            fmt_opt(x.closed_form),
            x.simulated,
            interval(x.simulated_ci95),
            if x.agrees { "agrees" } else { "differs" },
            crate::lab::report::fit(&runs.join(","), 16)
        ));
    }
    out.extend(answer::wrap(
        &format!(
            "{} rows in {:.0} s: {REQUESTS} requests a run at {RATE} requests/s (Poisson), random \
             picks over {ENDPOINTS} backends, consecutive_failures = {THRESHOLD}; the model's \
             evidence delay d = {:.1} ms (etcd's put-to-watch time, measured first).",
            r.rows.len(),
            r.seconds,
            r.evidence_delay_ms
        ),
        crate::lab::report::COLUMNS,
        "",
    ));
    if let Some(w) = writes(r) {
        out.extend(answer::wrap(
            &format!("What sharing costs etcd: {w}."),
            crate::lab::report::COLUMNS,
            "",
        ));
    }
    out
}

/// The shared rows' evidence writes per failed try, as their range.
fn writes(r: &FleetReport) -> Option<String> {
    let w: Vec<f64> = r
        .rows
        .iter()
        .filter_map(|x| x.writes_per_failed_try)
        .collect();
    let lo = w.iter().copied().reduce(f64::min)?;
    let hi = w.iter().copied().reduce(f64::max)?;
    Some(format!(
        "{lo:.2}-{hi:.2} evidence records written per failed try (each failure is published at \
         once, and the success that ends a run)"
    ))
}

/// E12's section of the HTML report.
fn html(r: &FleetReport) -> String {
    let mut h = String::from("<h2 id=\"e12\">E12: a fleet of keel proxies on etcd</h2>");
    if let Some(why) = &r.skipped {
        let _ = write!(h, "<p>Skipped: {}</p>", esc(why));
        return h;
    }
    if let Some(f) = finding(r) {
        let _ = write!(h, "<p><b>{}</b></p>", esc(&f.text));
    }
    h.push_str(
        "<table><tr><th>N</th><th class=\"l\">traffic</th><th class=\"l\">detection</th>\
         <th>measured failed tries</th><th>95 % interval</th><th>closed form</th>\
         <th>simulated</th><th>simulated 95 %</th><th class=\"l\">verdict</th>\
         <th class=\"l\">runs</th></tr>",
    );
    for x in &r.rows {
        let runs: Vec<String> = x.runs.iter().map(|v| v.to_string()).collect();
        let _ = write!(
            h,
            "<tr><td>{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{:.1}</td>\
             <td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td class=\"l\"{}>{}</td>\
             <td class=\"l\">{}</td></tr>",
            x.proxies,
            x.traffic,
            x.detection,
            x.measured,
            interval(x.measured_ci95),
            fmt_opt(x.closed_form),
            x.simulated,
            interval(x.simulated_ci95),
            if x.agrees {
                ""
            } else {
                " style=\"background:#fdeaea\""
            },
            if x.agrees {
                "agrees"
            } else {
                "differs: mechanism unknown"
            },
            runs.join(", ")
        );
    }
    let _ = write!(
        h,
        "</table><p><small>Real keel proxies (in this process) on a three-member etcd on \
         loopback, {REQUESTS} requests a run at {RATE} requests/s (Poisson, seeded), random picks \
         over {ENDPOINTS} backends, the first answering 503 at once; consecutive_failures = \
         {THRESHOLD}; failed tries summed over the proxies' own counts. The closed form and the \
         simulation (keel-model's fleet, {REPLICATIONS} replications) take the evidence's delay \
         d = {:.1} ms, etcd's put-to-watch time measured before the runs (a failure is published \
         at once). {:.0} s.{}</small></p>",
        r.evidence_delay_ms,
        r.seconds,
        writes(r).map_or(String::new(), |w| format!(" What sharing costs etcd: {w}."))
    );
    h
}

#[cfg(test)]
mod tests {
    use super::excess_agrees;

    #[test]
    fn a_few_extra_tries_are_judged_as_a_poisson_count() {
        // Eight runs of exactly 5 against 5.09: P(no extra try) = e^-0.72 = 0.49.
        assert!(excess_agrees(&[5; 8], 5, 5.09));
        // Against 6.0 (8 extra tries expected), none at all is a departure (e^-8).
        assert!(!excess_agrees(&[5; 8], 5, 6.0));
        // 8 extra tries over 8 runs against 5.09 (0.72 expected) is a departure too.
        assert!(!excess_agrees(&[6; 8], 5, 5.09));
        // A run below the threshold is not this count.
        assert!(!excess_agrees(&[4, 5], 5, 5.0));
    }
}
