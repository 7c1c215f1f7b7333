//! `keel advise`: fit a model of a cluster from keel proxy's JSON access log, simulate every
//! strategy under three sets of protections on it, and rank them (keel_model::fit and
//! keel_model::advise do the work; this is the edge: files, flags, progress, output).

use std::fs::File;
use std::io::{BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use keel_model::advise::{self, Advice, Balancer, RunningConfig};
use keel_model::fit::scenario::ScenarioOptions;
use keel_model::fit::{self, FitOptions, FittedModel, LogFormat};

use crate::cmd::advise::text::{family, rate};
use crate::cmd::usage;

mod inference;
mod report;
mod text;

/// Arguments of `keel advise`.
#[derive(clap::Args)]
#[command(after_help = "\
Examples:
  keel advise --access-log examples/advise/access.log
  keel advise --access-log access.log --config keel.toml --since 1h --out advice/
  keel advise --access-log access.log --cluster app --json > advice.json
  keel advise --access-log llm-access.log --inference


What it does: reads the log (JSON lines; the `tries` field of each try when present), fits per
endpoint the latency of successes, the share of fast errors, timeouts and resets, and a
concurrency limit; then simulates every strategy x {none, keel defaults, outlier + retry 2 +
health} (and the configuration of --config) and ranks them by success, then p99, then p99.9;
where success intervals overlap the best's it is a tie, and more protection ranks first. The
output opens with the answer; the section to paste is the --config cluster's own with only the
keys the recommendation changes rewritten.
An inference pool's log (an `inference = true` cluster's lines carry ttft_ms; or --inference):
fits the prefix groups (the `prefix` field), their popularity, the tokens, the rate and the
engines' cache, and says whether prefix-affinity pays, by how much and up to which load, with
the section to paste (docs/advise.md, \"Inference pools\").
--out DIR writes index.html, advice.json and fitted.toml (the model as a scenario: rerun it with
`keel simulate --scenario DIR/fitted.toml`, edit it to ask what if). docs/advise.md says what is
fitted, what the model leaves out, and how to read the report.

JSON (--json, and advice.json): {\"answer\", \"tied\", \"ranking\": [{\"strategy\", \"protections\", \"cluster_toml\",
\"success\": [mean, lo95, hi95], \"p99_ms\": [...], \"p999_ms\": [...], \"mean_ms\",
\"pick_shares\", \"retries_per_request\", \"running\", \"protection\", \"tier\"}, ...] best first, \"running\" (index or
null), \"why\", \"traps\", \"model\": {...}, \"replications\", \"requests_per_replication\"}.")]
pub struct Args {
    /// keel proxy's access log in the JSON format (`-`: standard input).
    #[arg(long, value_name = "FILE")]
    pub access_log: PathBuf,
    /// keel proxy's configuration: the running strategy, protections, timeouts and weights of
    /// the cluster are read from it and its row is marked.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The cluster to advise on (needed when the log has several).
    #[arg(long, value_name = "NAME")]
    pub cluster: Option<String>,
    /// Only requests that ended within this long of the log's last line, e.g. `1h`, `15m`.
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    /// Write index.html, advice.json and fitted.toml into this directory.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Print the advice as JSON on standard output instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Measured requests per replication (default: about 60 s of the fitted traffic, within
    /// 2,000..=40,000).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Replications per configuration (default 5); the 95 % intervals are over them.
    #[arg(long)]
    pub replications: Option<u32>,
    /// Seed of the simulation.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fewest requests the fit accepts.
    #[arg(long, default_value_t = fit::MIN_REQUESTS)]
    pub min_requests: u64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Terminal output wider than 100 columns: sentences on one line each, and the endpoint
    /// table with every interval, the KS distance and the capacity.
    #[arg(long)]
    pub wide: bool,
    /// Whose log: keel (keel proxy's JSON), nginx (with --nginx-log-format), haproxy (`option
    /// httplog`) or envoy (the default format). The ranking covers that balancer's strategies
    /// and protections, and the recommendation is written in its configuration language.
    #[arg(long, value_enum, default_value_t = LogFormatArg::Keel)]
    pub log_format: LogFormatArg,
    /// With --log-format nginx: the log_format string the log was written with (as in
    /// nginx.conf; it must have $upstream_addr, $upstream_status, $upstream_response_time and
    /// a time: $msec, $time_iso8601 or $time_local).
    #[arg(long, value_name = "STRING")]
    pub nginx_log_format: Option<String>,
    /// With --log-format envoy: the access logger's format string the log was written with
    /// (`istio` for Istio's default; without it, Envoy's default format). It must have
    /// %START_TIME%, %RESPONSE_CODE%, %DURATION% and %UPSTREAM_HOST%.
    #[arg(long, value_name = "STRING")]
    pub envoy_log_format: Option<String>,
    /// The log is an inference pool's (`inference = true`): advise prefix-affinity or not.
    /// Without it, a keel log whose first lines carry `ttft_ms` is taken as one.
    #[arg(long)]
    pub inference: bool,
    /// Inference: the engines' KV cache in blocks (default: fitted from the log's hit ratio).
    #[arg(long, value_name = "N")]
    pub kv_blocks: Option<usize>,
    /// Inference: tokens per KV block (default: read from the log's `prompt_tokens` against
    /// `prompt_blocks`, else 16).
    #[arg(long, value_name = "N")]
    pub block_tokens: Option<usize>,
    /// Inference: the engines' prefill speed, prompt tokens per second (default: the fake
    /// engine's, `keel backend --llm`).
    #[arg(long, value_name = "TPS", default_value_t = 4000.0)]
    pub prefill_tps: f64,
    /// Inference: fixed cost of an engine step, milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 6.0)]
    pub step_ms: f64,
    /// Inference: added cost per running sequence in a step, milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0.3)]
    pub step_per_seq_ms: f64,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormatArg {
    /// keel proxy's JSON access log.
    Keel,
    /// NGINX's access log in the --nginx-log-format given.
    Nginx,
    /// HAProxy's `option httplog` default format.
    Haproxy,
    /// Envoy's access log, in its default format or the --envoy-log-format given.
    Envoy,
}

/// Runs `keel advise`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let since = match &args.since {
        None => None,
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if !d.is_zero() => Some(d),
            Ok(_) => return usage("--since must be greater than zero"),
            Err(e) => return usage(format!("--since {s:?}: {e} (write e.g. 1h or 15m)")),
        },
    };
    if args.replications == Some(0) || args.replications.is_some_and(|r| r > 1000) {
        return usage("--replications must be within 1..=1000");
    }
    if args.requests == Some(0) {
        return usage("--requests must be at least 1");
    }
    if args.inference
        || (args.log_format == LogFormatArg::Keel
            && inference::looks_like_inference(&args.access_log))
    {
        if args.log_format != LogFormatArg::Keel {
            return usage("--inference reads keel proxy's JSON access log (--log-format keel)");
        }
        return inference::run(&inference::Ask {
            access_log: &args.access_log,
            cluster: args.cluster.as_deref(),
            kv_blocks: args.kv_blocks,
            block_tokens: args.block_tokens,
            prefill_tps: args.prefill_tps,
            step_ms: args.step_ms,
            step_per_seq_ms: args.step_per_seq_ms,
            replications: args.replications,
            seed: args.seed,
            out: args.out.as_deref(),
            json: args.json,
            wide: args.wide,
            columns: COLUMNS,
        });
    }
    let (format, balancer) = match args.log_format {
        LogFormatArg::Keel => (LogFormat::Keel, Balancer::Keel),
        LogFormatArg::Nginx => {
            let Some(f) = &args.nginx_log_format else {
                return usage(format!(
                    "--log-format nginx needs --nginx-log-format '...' (the log_format string of your nginx.conf); recommended:\n  log_format keel '{}';",
                    fit::nginx::RECOMMENDED
                ));
            };
            match fit::nginx::Format::parse(f) {
                Ok(f) => (LogFormat::Nginx(f), Balancer::Nginx),
                Err(e) => return usage(format!("--nginx-log-format: {e}")),
            }
        }
        LogFormatArg::Haproxy => (LogFormat::Haproxy, Balancer::Haproxy),
        LogFormatArg::Envoy => match &args.envoy_log_format {
            None => (
                LogFormat::Envoy(fit::envoy::Format::default()),
                Balancer::Envoy,
            ),
            Some(f) => match fit::envoy::Format::parse(f) {
                Ok(f) => (LogFormat::Envoy(f), Balancer::Envoy),
                Err(e) => return usage(format!("--envoy-log-format: {e}")),
            },
        },
    };
    if args.envoy_log_format.is_some() && balancer != Balancer::Envoy {
        return usage("--envoy-log-format goes with --log-format envoy");
    }
    if args.nginx_log_format.is_some() && balancer != Balancer::Nginx {
        return usage("--nginx-log-format goes with --log-format nginx");
    }
    if args.config.is_some() && balancer != Balancer::Keel {
        return usage("--config reads keel proxy's configuration; leave it out with --log-format nginx, haproxy or envoy");
    }
    let proxy_config = match &args.config {
        None => None,
        Some(p) => Some(keel_proxy::ProxyConfig::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?),
    };
    // With a configuration of one cluster, that cluster is the one to fit.
    let cluster = args.cluster.clone().or_else(|| {
        proxy_config
            .as_ref()
            .filter(|c| c.clusters.len() == 1)
            .map(|c| c.clusters[0].name.clone())
    });
    let opts = FitOptions {
        cluster,
        since,
        min_requests: Some(args.min_requests),
    };
    let started = Instant::now();
    let source = args.access_log.display().to_string();
    let log = if args.access_log == Path::new("-") {
        fit::read_log_as(std::io::stdin().lock(), &format)
    } else {
        let file = File::open(&args.access_log)
            .with_context(|| format!("cannot open {}", args.access_log.display()))?;
        fit::read_log_as(BufReader::with_capacity(1 << 20, file), &format)
    }
    .and_then(|log| fit::fit_log(&log, &opts))
    .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    let model = log;
    let fitted_in = started.elapsed();

    let mut ctx = advise::Context {
        balancer,
        ..advise::Context::default()
    };
    if let (Some(c), Some(path)) = (&proxy_config, args.config.as_deref()) {
        let (running, request_timeout) = running_config(c, &model, path)?;
        ctx.running = Some(running);
        ctx.request_timeout = request_timeout;
        // The paste blocks rewrite the running [[cluster]] table as written (keys, comments).
        ctx.config_text = std::fs::read_to_string(path).ok();
    }
    let mut sopts = ScenarioOptions::for_model(&model);
    sopts.seed = args.seed;
    if let Some(r) = args.requests {
        sopts.requests = r;
    }
    if let Some(r) = args.replications {
        sopts.replications = r;
    }
    let n_configs = advise::candidates_in(&model, &sopts, &ctx).len() as u64;
    let bar = progress_bar(
        n_configs * sopts.requests * u64::from(sopts.replications),
        args.quiet,
    );
    let sim_started = Instant::now();
    let advice = advise::advise_in(&model, &sopts, &ctx, &source, &|n| bar.inc(n))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    bar.finish_and_clear();
    let simulated_in = sim_started.elapsed();

    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let write = |name: &str, text: &str| -> anyhow::Result<PathBuf> {
            let p = dir.join(name);
            std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))?;
            Ok(p)
        };
        write("advice.json", &serde_json::to_string_pretty(&advice)?)?;
        let scenario = write("fitted.toml", &advice.scenario_toml)?;
        let html = report::html(&advice, &source, fitted_in, simulated_in)?;
        let index = write("index.html", &html)?;
        eprintln!(
            "wrote {} and {} (rerun the model: keel simulate --scenario {})",
            index.display(),
            dir.join("advice.json").display(),
            scenario.display()
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&advice)?);
    } else {
        print_table(&advice, n_configs, fitted_in, simulated_in, args.wide);
    }
    Ok(())
}

/// The cluster's running configuration from keel proxy's TOML, and its `request_timeout` when
/// the per-try timeout is derived from it.
fn running_config(
    config: &keel_proxy::ProxyConfig,
    model: &FittedModel,
    path: &Path,
) -> anyhow::Result<(RunningConfig, Option<Duration>)> {
    let Some(c) = config.cluster(&model.cluster) else {
        let names: Vec<&str> = config.clusters.iter().map(|c| c.name.as_str()).collect();
        anyhow::bail!(
            "{}: no cluster `{}` (the log's); clusters: {}",
            path.display(),
            model.cluster,
            names.join(", ")
        );
    };
    let request_timeout = c
        .protections
        .retry
        .per_try_timeout
        .is_none()
        .then_some(c.timeouts.request);
    let running = RunningConfig {
        balancer: c.balancer_config(),
        retry_attempts: c.protections.retry.attempts,
        retry_budget: c.protections.retry.budget(),
        health_check: c
            .protections
            .health_check
            .as_ref()
            .map(|h| (h.interval, h.unhealthy_threshold, h.healthy_threshold)),
        per_try_timeout: c.per_try_timeout(),
        weights: c
            .endpoints
            .iter()
            .map(|e| (e.address.clone(), e.weight))
            .collect(),
    };
    Ok((running, request_timeout))
}

fn progress_bar(total: u64, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "simulating [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} requests ({eta})",
        )
        .expect("valid template"),
    );
    bar
}

/// Width of terminal output without `--wide`.
const COLUMNS: usize = 100;

fn print_table(a: &Advice, configs: u64, fitted: Duration, simulated: Duration, wide: bool) {
    let m = &a.model;
    // A sentence: one line with --wide, else wrapped to COLUMNS under a hanging indent.
    let say = |text: &str| {
        if wide {
            println!("{text}");
        } else {
            for (i, line) in crate::lab::answer::wrap(text, COLUMNS, "  ")
                .into_iter()
                .enumerate()
            {
                println!("{}", if i == 0 { &line[2..] } else { &line });
            }
        }
    };
    // The answer first; then how it was reached.
    println!("keel advise: cluster `{}`", m.cluster);
    say(&a.answer);
    for w in &a.why {
        say(&format!("why: {w}"));
    }
    for t in &a.traps {
        say(&format!("trap: {t}"));
    }
    println!("(the settings to paste are at the end)\n");
    say(&format!(
        "fitted from {} requests, {} tries from {} to {} ({:.0} s), {:.1} requests/s (dispersion {:.2}), {} endpoints; fitted in {:.2} s",
        m.requests,
        m.tries,
        m.from,
        m.to,
        m.seconds,
        m.arrival.rate_per_s,
        m.arrival.dispersion,
        m.endpoints.len(),
        fitted.as_secs_f64()
    ));
    for n in &m.notes {
        say(&format!("  note: {n}"));
    }
    println!();
    if wide {
        print_endpoints_wide(m);
    } else {
        print_endpoints(m);
    }
    println!();
    say(&format!(
        "{configs} configurations x {} replications of {} requests simulated in {:.1} s; best first (success; where success intervals overlap the best's, a tie (=): more protection, then p99, then p99.9; 95 % intervals):",
        a.replications,
        a.requests_per_replication,
        simulated.as_secs_f64()
    ));
    print_ranking(a, wide);
    if a.running.is_some() {
        println!("  * the running configuration (--config)");
    }
    if a.tied > 1 {
        println!("  = tied with the best on success (overlapping 95 % intervals)");
    }
    for l in &a.limits {
        say(&format!("{} cannot express: {l}", a.balancer.name()));
    }
    if let Some(best) = a.ranking.first() {
        if a.balancer == Balancer::Keel {
            println!(
                "\nto run {} with {}, replace the cluster's [[cluster]] section with:\n{}",
                best.strategy, best.protections, best.cluster_toml
            );
        } else {
            println!(
                "\nto run {} with {} in {}:\n{}",
                best.strategy,
                best.protections,
                a.balancer.name(),
                best.paste()
            );
        }
    }
}

/// The fitted endpoints within 100 columns: point values only (`--wide` has the intervals), the
/// name and the fit as wide as the widest (a name over 21 characters is cut, marked `~`).
fn print_endpoints(m: &FittedModel) {
    let name = |n: &str| {
        if n.len() > 21 {
            format!("{}~", &n[..20])
        } else {
            n.to_string()
        }
    };
    let fit = |l: &fit::LatencyFit| {
        format!(
            "{}{}",
            family(&l.family),
            if l.pooled { " (p)" } else { "" }
        )
    };
    let ew = m
        .endpoints
        .iter()
        .map(|e| name(&e.name).len())
        .max()
        .unwrap_or(0)
        .max(8);
    let fw = m
        .endpoints
        .iter()
        .map(|e| fit(&e.latency).len())
        .max()
        .unwrap_or(0)
        .max(14);
    println!(
        "{:<ew$} {:>6} {:>6} {:>7} {:>7}  {:<fw$}  {:>6} {:>6} {:>6}",
        "endpoint",
        "tries",
        "share",
        "p50 ms",
        "p99 ms",
        "fitted latency",
        "err %",
        "tmo %",
        "rst %"
    );
    let pct = |r: &fit::Rate| format!("{:.2}", r.share * 100.0);
    for e in &m.endpoints {
        let l = &e.latency;
        println!(
            "{:<ew$} {:>6} {:>5.1}% {:>7.2} {:>7.2}  {:<fw$}  {:>6} {:>6} {:>6}",
            name(&e.name),
            e.tries,
            e.share * 100.0,
            l.p50_ms,
            l.p99_ms,
            fit(l),
            pct(&e.failures.error),
            pct(&e.failures.timeout),
            pct(&e.failures.reset),
        );
    }
    if m.endpoints.iter().any(|e| e.latency.pooled) {
        println!("  (p): too few successes for its own fit; the cluster's pooled fit stands in");
    }
}

/// The fitted endpoints with every interval, the KS distance and the capacity (`--wide`).
fn print_endpoints_wide(m: &FittedModel) {
    println!(
        "{:<22} {:>7} {:>6} {:>8} {:>8}  {:<30} {:>6}  {:<20} {:<20} {:<20} {:>8}",
        "endpoint",
        "tries",
        "share",
        "p50 ms",
        "p99 ms",
        "fitted latency",
        "KS",
        "errors % [95 %]",
        "timeouts %",
        "resets %",
        "capacity"
    );
    for e in &m.endpoints {
        let l = &e.latency;
        println!(
            "{:<22} {:>7} {:>5.1}% {:>8.2} {:>8.2}  {:<30} {:>6}  {:<20} {:<20} {:<20} {:>8}",
            e.name,
            e.tries,
            e.share * 100.0,
            l.p50_ms,
            l.p99_ms,
            format!(
                "{}{}",
                family(&l.family),
                if l.pooled { " (pooled)" } else { "" }
            ),
            l.ks.map_or("-".into(), |k| format!("{k:.3}")),
            rate(&e.failures.error),
            rate(&e.failures.timeout),
            rate(&e.failures.reset),
            e.capacity
                .as_ref()
                .map_or("-".into(), |c| c.concurrency.to_string())
        );
    }
}

/// The ranking; with `--wide` in fixed columns, else each column as wide as its widest cell
/// (the success to 2 decimals): within 100 columns for every balancer's names.
fn print_ranking(a: &Advice, wide: bool) {
    let success = |r: &advise::Ranked| {
        let [m, lo, hi] = r.success.map(|x| x * 100.0);
        if wide {
            format!("{m:.3} [{lo:.3}, {hi:.3}]")
        } else {
            format!("{m:.2} [{lo:.2}, {hi:.2}]")
        }
    };
    let p99 = |r: &advise::Ranked| {
        format!(
            "{:.1} [{:.1}, {:.1}]",
            r.p99_ms[0], r.p99_ms[1], r.p99_ms[2]
        )
    };
    let width = |f: &dyn Fn(&advise::Ranked) -> String, head: &str, fixed: usize| {
        if wide {
            fixed
        } else {
            a.ranking
                .iter()
                .map(|r| f(r).len())
                .max()
                .unwrap_or(0)
                .max(head.len())
        }
    };
    let sw = width(&|r| r.strategy.clone(), "strategy", 22);
    let pw = width(&|r| r.protections.clone(), "protections", 33);
    let cw = width(&success, "success % [95 %]", 26);
    let qw = width(&p99, "p99 ms [95 %]", 24);
    println!(
        "{:>4} {:<sw$} {:<pw$} {:<cw$} {:<qw$} {:>7}",
        "rank", "strategy", "protections", "success % [95 %]", "p99 ms [95 %]", "p99.9"
    );
    for (i, r) in a.ranking.iter().enumerate() {
        println!(
            "{:>3}{}{:<sw$} {:<pw$} {:<cw$} {:<qw$} {:>7.1}",
            i + 1,
            match (r.running, r.tier == 0 && a.tied > 1) {
                (true, true) => "*=",
                (true, false) => "* ",
                (false, true) => " =",
                (false, false) => "  ",
            },
            r.strategy,
            r.protections,
            success(r),
            p99(r),
            r.p999_ms[0]
        );
    }
}
