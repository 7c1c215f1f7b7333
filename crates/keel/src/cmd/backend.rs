//! `keel backend`: the experiment backend of `keel_testbed::backend` as a process, for demos and
//! for trying the proxy by hand. Several `--listen` start several backends in one process.
//!
//! The latency and the failure mode are keel-model's vocabulary (the names of `--latency-dist`
//! and `--fault` are those of the simulator's scenario files), so a backend started here fails
//! exactly as a simulated server of the same setting.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use keel_model::inference::EngineSpec;
use keel_model::vocab::{FailureMode, Latency};
use keel_testbed::backend::{self, BackendConfig};
use keel_testbed::llm::{self, LlmConfig};

use crate::cmd::usage;

/// Arguments of `keel backend`.
#[derive(clap::Args)]
#[command(after_help = "Failure modes (--fault):\n  \
    none       answer 200 after the latency\n  \
    hang       read requests and never answer them\n  \
    fail-fast  answer 503 after --fail-after (default: at once)\n  \
    server-error  answer 500 after --fail-after (default: at once)\n  \
    refuse     do not listen: connects are refused\n  \
    reset      after the latency, send the headers and half of the body, then reset the connection\n  \
    slow       the latency multiplied by --slow-factor\n  \
    error      after the latency, answer 503 with probability --error-probability\n  \
    flap       alternate --flap-up periods of `none` and --flap-down periods that hang (or answer\n             \
               503 after --fail-after, when given)\n\
/healthz answers 200 `ok` and fails the same way as every other path; it is counted apart.\n\
With --concurrency N at most N requests are worked on at once; the others wait in FIFO order\n\
(a fail-fast 503, a server-error 500 or a hang never waits; /healthz never waits).\n\
Every response carries `x-backend: <name>` and the backend's load: `x-keel-rif` (requests in\n\
flight, waiting ones included) and `x-keel-latency-us` (the median latency of recent requests\n\
that arrived to about as many in flight). GET /keel/load answers them at once, in the headers\n\
and as JSON, without being counted in flight (a hanging backend does not answer it).\n\n\
Examples:\n  \
    keel backend --listen 127.0.0.1:9001 --latency 10ms\n  \
    keel backend --listen 127.0.0.1:9001 --latency 10ms --latency-dist exponential --concurrency 1\n  \
    keel backend --listen 127.0.0.1:9001 --listen 127.0.0.1:9002 --latency 10ms --latency-dist exponential\n  \
    keel backend --listen 127.0.0.1:9005 --fault hang\n  \
    keel backend --listen 127.0.0.1:9005 --fault error --error-probability 0.1\n  \
    keel backend --listen 127.0.0.1:9005 --fault flap --flap-up 2s --flap-down 1s --fail-after 0ms\n\n\
With --llm it is a fake vLLM engine instead (docs/inference.md): keel-model's inference engine\n\
(continuous batching over a KV cache that keeps prompt prefixes) behind vLLM's OpenAI API:\n\
POST /v1/completions and /v1/chat/completions (streamed or whole, usage with cached_tokens),\n\
/tokenize, /v1/completions/render, /v1/chat/completions/render; GET /v1/models, /health and\n\
/metrics (vLLM's names); vLLM's ORCA header when asked (endpoint-load-metrics-format). The\n\
failure modes apply (slow stretches every engine step).\n  \
    keel backend --llm --listen 127.0.0.1:8001 --listen 127.0.0.1:8002 --listen 127.0.0.1:8003\n  \
    keel backend --llm --listen 127.0.0.1:8001 --kv-blocks 120 --prefill-tps 4000 --step-ms 6")]
pub struct Args {
    /// Address to listen on (port 0: any free port). Repeat for several backends in one process.
    #[arg(long, required = true, value_name = "ADDR")]
    listen: Vec<String>,
    /// Mean response latency, e.g. 10ms.
    #[arg(long, default_value = "0ms")]
    latency: String,
    /// Latency distribution around its mean: fixed, exponential or lognormal.
    #[arg(long, default_value = "fixed", value_name = "DIST")]
    latency_dist: String,
    /// Standard deviation of the log of the latency, for --latency-dist lognormal.
    #[arg(long, allow_negative_numbers = true, default_value_t = keel_model::vocab::DEFAULT_SIGMA)]
    sigma: f64,
    /// Failure mode: none, hang, fail-fast, server-error, refuse, reset, slow, error, flap (see
    /// below).
    #[arg(long, default_value = "none", value_name = "MODE")]
    fault: String,
    /// fail-fast, server-error: delay before the 503 or 500 (default 0ms); flap: answer 503 after this delay while
    /// down instead of hanging.
    #[arg(long, value_name = "DURATION")]
    fail_after: Option<String>,
    /// Latency multiplier of --fault slow (1 or more).
    #[arg(long, allow_negative_numbers = true, default_value_t = 10.0)]
    slow_factor: f64,
    /// Probability in [0, 1] of a 503, for --fault error.
    #[arg(long, allow_negative_numbers = true, value_name = "P")]
    error_probability: Option<f64>,
    /// Length of a healthy period of --fault flap.
    #[arg(long, default_value = "2s")]
    flap_up: String,
    /// Length of a failing period of --fault flap.
    #[arg(long, default_value = "1s")]
    flap_down: String,
    /// Size of a response body in bytes.
    #[arg(long, default_value_t = 64)]
    body_bytes: usize,
    /// Value of the `x-backend` header (default: the bound address); with several --listen,
    /// NAME-1, NAME-2, ...
    #[arg(long)]
    name: Option<String>,
    /// Seed of the random draws (latency, errors); default: derived from the name.
    #[arg(long)]
    seed: Option<u64>,
    /// Requests worked on at once (1 or more); the others wait in FIFO order. Default: no
    /// limit.
    #[arg(long, value_name = "N")]
    concurrency: Option<u32>,
    /// Put an ORCA load report (`endpoint-load-metrics`) on every answer, in the `text` or
    /// `json` form: requests and 503s per second over the last second, and the mean requests
    /// in flight over --concurrency (1 without) as cpu_utilization.
    #[arg(long, value_name = "FORM", value_parser = ["text", "json"])]
    orca: Option<String>,
    /// Serve a fake vLLM engine (see below) instead of the plain backend.
    #[arg(long, conflicts_with_all = ["latency", "latency_dist", "sigma", "body_bytes", "concurrency", "orca"])]
    llm: bool,
    /// --llm: KV cache size in blocks.
    #[arg(long, requires = "llm", value_name = "N", default_value_t = EngineSpec::default().kv_blocks)]
    kv_blocks: usize,
    /// --llm: tokens per KV block (a token is 4 bytes of prompt).
    #[arg(long, requires = "llm", value_name = "N", default_value_t = EngineSpec::default().block_tokens)]
    block_tokens: usize,
    /// --llm: prefill speed, prompt tokens per second.
    #[arg(long, requires = "llm", allow_negative_numbers = true, value_name = "TPS", default_value_t = EngineSpec::default().prefill_tps)]
    prefill_tps: f64,
    /// --llm: fixed cost of an engine step, milliseconds.
    #[arg(long, requires = "llm", allow_negative_numbers = true, value_name = "MS", default_value_t = EngineSpec::default().step_ms)]
    step_ms: f64,
    /// --llm: added cost of a step per running sequence, milliseconds.
    #[arg(long, requires = "llm", allow_negative_numbers = true, value_name = "MS", default_value_t = EngineSpec::default().step_per_seq_ms)]
    step_per_seq_ms: f64,
    /// --llm: most prompt tokens prefilled in one step (chunked prefill).
    #[arg(long, requires = "llm", value_name = "N", default_value_t = EngineSpec::default().max_batch_tokens)]
    max_batch_tokens: usize,
    /// --llm: the model name served.
    #[arg(
        long,
        requires = "llm",
        value_name = "NAME",
        default_value = "keel-llm"
    )]
    model: String,
}

fn duration(flag: &str, text: &str) -> anyhow::Result<Duration> {
    match humantime::parse_duration(text) {
        Ok(d) => Ok(d),
        Err(e) => usage(format!(
            "--{flag} {text:?}: {e} (write a duration such as 10ms or 2s)"
        )),
    }
}

fn latency(args: &Args) -> anyhow::Result<Latency> {
    super::latency_flags(&args.latency, &args.latency_dist, args.sigma)
}

fn fault(args: &Args) -> anyhow::Result<FailureMode> {
    let fail_after = match &args.fail_after {
        Some(t) => Some(duration("fail-after", t)?),
        None => None,
    };
    if fail_after.is_some() && !matches!(args.fault.as_str(), "fail-fast" | "server-error" | "flap")
    {
        return usage("--fail-after applies to --fault fail-fast, server-error and flap only");
    }
    if args.error_probability.is_some() && args.fault != "error" {
        return usage("--error-probability applies to --fault error only");
    }
    let mode = match args.fault.as_str() {
        "none" => FailureMode::None,
        "hang" => FailureMode::Hang,
        "fail-fast" => FailureMode::FailFast {
            after: fail_after.unwrap_or(Duration::ZERO),
        },
        "server-error" => FailureMode::ServerError {
            after: fail_after.unwrap_or(Duration::ZERO),
        },
        "refuse" => FailureMode::Refuse,
        "reset" => FailureMode::Reset,
        "slow" => FailureMode::Slow {
            factor: args.slow_factor,
        },
        "error" => match args.error_probability {
            Some(probability) => FailureMode::Error { probability },
            None => return usage("--fault error needs --error-probability P"),
        },
        "flap" => FailureMode::Flap {
            up: duration("flap-up", &args.flap_up)?,
            down: duration("flap-down", &args.flap_down)?,
            down_fails_after: fail_after,
        },
        other => {
            return usage(format!(
                "--fault {other:?}: unknown failure mode; allowed: {}",
                FailureMode::NAMES.join(", ")
            ))
        }
    };
    // The vocabulary names the parameter; the flag is the mode's flag for it.
    if let Err(e) = mode.validate() {
        let flag = match e.field.to_string().as_str() {
            "factor" => "--slow-factor",
            "probability" => "--error-probability",
            "up" => "--flap-up",
            "down" => "--flap-down",
            _ => "--failure",
        };
        return usage(format!("{flag}: {}", e.problem));
    }
    Ok(mode)
}

/// Checks every flag and returns the listen addresses and the shared configuration.
fn parse(args: &Args) -> anyhow::Result<(Vec<SocketAddr>, BackendConfig)> {
    let mut addrs = Vec::new();
    for text in &args.listen {
        match text.parse::<SocketAddr>() {
            Ok(a) => addrs.push(a),
            Err(_) => {
                return usage(format!(
                    "--listen {text:?}: not an IP address with a port (e.g. 127.0.0.1:9001)"
                ))
            }
        }
    }
    let cfg = BackendConfig {
        latency: latency(args)?,
        fault: fault(args)?,
        body_bytes: args.body_bytes,
        name: String::new(),
        concurrency: args.concurrency,
        orca: args.orca.as_deref().map(|f| match f {
            "json" => backend::OrcaForm::Json,
            _ => backend::OrcaForm::Text,
        }),
        precise_timer: false,
    };
    if cfg.concurrency == Some(0) {
        return usage("--concurrency must be at least 1");
    }
    if matches!(cfg.fault, FailureMode::Slow { .. }) && cfg.latency.mean.is_zero() {
        eprintln!("keel backend: warning: --fault slow multiplies --latency, which is 0");
    }
    Ok((addrs, cfg))
}

/// The engine of `--llm`, its flags checked.
fn engine_spec(args: &Args) -> anyhow::Result<EngineSpec> {
    let spec = EngineSpec {
        kv_blocks: args.kv_blocks,
        block_tokens: args.block_tokens,
        prefill_tps: args.prefill_tps,
        step_ms: args.step_ms,
        step_per_seq_ms: args.step_per_seq_ms,
        max_batch_tokens: args.max_batch_tokens,
        ..EngineSpec::default()
    };
    if spec.kv_blocks == 0 {
        return usage("--kv-blocks must be at least 1");
    }
    if !(1..=keel_balance::prefix::MAX_BLOCK_TOKENS).contains(&spec.block_tokens) {
        return usage(format!(
            "--block-tokens must be 1 to {}",
            keel_balance::prefix::MAX_BLOCK_TOKENS
        ));
    }
    if !(spec.prefill_tps.is_finite() && spec.prefill_tps > 0.0) {
        return usage("--prefill-tps must be a positive number");
    }
    for (flag, v) in [
        ("--step-ms", spec.step_ms),
        ("--step-per-seq-ms", spec.step_per_seq_ms),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return usage(format!("{flag} must be 0 or more"));
        }
    }
    if spec.max_batch_tokens == 0 {
        return usage("--max-batch-tokens must be at least 1");
    }
    if args.model.is_empty() {
        return usage("--model must not be empty");
    }
    Ok(spec)
}

/// Runs `keel backend` until Ctrl-C (or SIGTERM).
pub fn run(args: Args) -> anyhow::Result<()> {
    let (addrs, cfg) = parse(&args)?;
    let spec = if args.llm {
        Some(engine_spec(&args)?)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    match spec {
        Some(spec) => runtime.block_on(serve_llm(args, addrs, cfg.fault, spec)),
        None => runtime.block_on(serve(args, addrs, cfg)),
    }
}

/// The `i`th server's name: `--name` itself for one listener, `NAME-1`, `NAME-2`, ... for several.
fn server_name(name: Option<&str>, several: bool, i: usize) -> String {
    match (name, several) {
        (Some(n), true) => format!("{n}-{}", i + 1),
        (Some(n), false) => n.to_string(),
        (None, _) => String::new(),
    }
}

async fn serve_llm(
    args: Args,
    addrs: Vec<SocketAddr>,
    fault: FailureMode,
    spec: EngineSpec,
) -> anyhow::Result<()> {
    let several = addrs.len() > 1;
    let mut handles = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let name = server_name(args.name.as_deref(), several, i);
        let cfg = LlmConfig {
            spec,
            model: args.model.clone(),
            // Distinct engines write distinct words from one seed.
            seed: args.seed.unwrap_or(0).wrapping_add(i as u64),
            fault,
            name,
        };
        let handle = match llm::spawn(*addr, cfg).await {
            Ok(h) => h,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return usage(format!("{e}")),
            Err(e) => return Err(e).with_context(|| format!("cannot listen on {addr}")),
        };
        println!(
            "keel backend --llm {} listening on {} (model {}, {} KV blocks of {} tokens, prefill {} tokens/s, step {} ms + {} ms per sequence, {} tokens per step, failure {})",
            handle.name(),
            handle.addr(),
            handle.model(),
            spec.kv_blocks,
            spec.block_tokens,
            spec.prefill_tps,
            spec.step_ms,
            spec.step_per_seq_ms,
            spec.max_batch_tokens,
            fault
        );
        handles.push(handle);
    }
    println!("Ctrl-C to stop");
    wait_for_stop().await?;
    for h in handles {
        println!(
            "keel backend --llm {}: {} generation requests",
            h.name(),
            h.requests()
        );
        h.shutdown().await;
    }
    Ok(())
}

async fn serve(args: Args, addrs: Vec<SocketAddr>, cfg: BackendConfig) -> anyhow::Result<()> {
    let several = addrs.len() > 1;
    let mut handles = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let name = server_name(args.name.as_deref(), several, i);
        let cfg = BackendConfig {
            name,
            ..cfg.clone()
        };
        let handle = match args.seed {
            // Distinct backends get distinct streams from one seed.
            Some(seed) => {
                backend::spawn_with_seed(*addr, cfg.clone(), seed.wrapping_add(i as u64)).await
            }
            None => backend::spawn(*addr, cfg.clone()).await,
        };
        let handle = match handle {
            Ok(h) => h,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => return usage(format!("{e}")),
            Err(e) => return Err(e).with_context(|| format!("cannot listen on {addr}")),
        };
        let capacity = match cfg.concurrency {
            Some(n) => format!("{n} at once"),
            None => "unlimited".to_string(),
        };
        println!(
            "keel backend {} listening on {} (latency {}, failure {}, body {} bytes, capacity {})",
            handle.name(),
            handle.addr(),
            cfg.latency,
            cfg.fault,
            cfg.body_bytes,
            capacity
        );
        handles.push(handle);
    }
    println!("Ctrl-C to stop");
    wait_for_stop().await?;
    for h in handles {
        println!(
            "keel backend {}: {} requests, {} health checks",
            h.name(),
            h.requests(),
            h.healthz_requests()
        );
        h.shutdown().await;
    }
    Ok(())
}

async fn wait_for_stop() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r.context("cannot handle Ctrl-C")?,
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("cannot handle Ctrl-C")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use keel_model::vocab::LatencyDist;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse_cli(argv: &[&str]) -> anyhow::Result<(Vec<SocketAddr>, BackendConfig)> {
        let cli = Cli::try_parse_from(std::iter::once("backend").chain(argv.iter().copied()))
            .expect("clap accepts the flags");
        parse(&cli.args)
    }

    fn is_usage(r: anyhow::Result<(Vec<SocketAddr>, BackendConfig)>) -> bool {
        r.err()
            .is_some_and(|e| e.downcast_ref::<crate::cmd::UsageError>().is_some())
    }

    #[test]
    fn flags_build_the_config() {
        let (addrs, cfg) = parse_cli(&[
            "--listen",
            "127.0.0.1:0",
            "--listen",
            "[::1]:9002",
            "--latency",
            "10ms",
            "--latency-dist",
            "lognormal",
            "--sigma",
            "1",
            "--fault",
            "flap",
            "--flap-up",
            "300ms",
            "--fail-after",
            "0ms",
            "--body-bytes",
            "10",
            "--concurrency",
            "4",
        ])
        .unwrap();
        assert_eq!(addrs.len(), 2);
        assert_eq!(cfg.concurrency, Some(4));
        assert_eq!(
            cfg.latency,
            Latency {
                mean: Duration::from_millis(10),
                dist: LatencyDist::LogNormal { sigma: 1.0 }
            }
        );
        assert_eq!(
            cfg.fault,
            FailureMode::Flap {
                up: Duration::from_millis(300),
                down: Duration::from_secs(1),
                down_fails_after: Some(Duration::ZERO),
            }
        );
        assert_eq!(cfg.body_bytes, 10);
        let mode = |argv: &[&str]| {
            let mut all = vec!["--listen", "127.0.0.1:0"];
            all.extend_from_slice(argv);
            parse_cli(&all).unwrap().1.fault
        };
        assert_eq!(
            mode(&["--fault", "slow"]),
            FailureMode::Slow { factor: 10.0 }
        );
        assert_eq!(mode(&["--fault", "fail-fast"]), FailureMode::FAIL_AT_ONCE);
        assert_eq!(
            mode(&["--fault", "fail-fast", "--fail-after", "5ms"]),
            FailureMode::FailFast {
                after: Duration::from_millis(5)
            }
        );
        assert_eq!(
            mode(&["--fault", "error", "--error-probability", "0.1"]),
            FailureMode::Error { probability: 0.1 }
        );
        // Every name of the vocabulary is a --fault value.
        for name in FailureMode::NAMES {
            let extra: &[&str] = match name {
                "error" => &["--error-probability", "0.5"],
                _ => &[],
            };
            let mut argv = vec!["--fault", name];
            argv.extend_from_slice(extra);
            assert_eq!(mode(&argv).name(), name);
        }
    }

    #[test]
    fn bad_values_are_usage_errors() {
        let base = ["--listen", "127.0.0.1:0"];
        for extra in [
            &["--fault", "crash"][..],
            &["--latency", "fast"],
            &["--latency-dist", "pareto"],
            &["--latency-dist", "lognormal", "--sigma", "-1"],
            &["--fault", "error"],
            &["--fault", "error", "--error-probability", "-0.1"],
            &["--error-probability", "0.5"],
            &["--fault", "slow", "--slow-factor", "0.5"],
            &["--fault", "flap", "--flap-down", "0s"],
            &["--fault", "hang", "--fail-after", "1ms"],
            &["--fault", "fail-fast", "--fail-after", "soon"],
            &["--concurrency", "0"],
        ] {
            let argv: Vec<&str> = base.iter().chain(extra).copied().collect();
            assert!(is_usage(parse_cli(&argv)), "{argv:?}");
        }
        assert!(is_usage(parse_cli(&["--listen", "localhost"])));
    }

    #[test]
    fn llm_flags_build_the_engine() {
        let cli = |argv: &[&str]| {
            Cli::try_parse_from(std::iter::once("backend").chain(argv.iter().copied()))
                .map(|c| c.args)
        };
        let args = cli(&["--listen", "127.0.0.1:0", "--llm"]).unwrap();
        assert_eq!(engine_spec(&args).unwrap(), EngineSpec::default());
        assert_eq!(args.model, "keel-llm");
        let args = cli(&[
            "--listen",
            "127.0.0.1:0",
            "--llm",
            "--kv-blocks",
            "64",
            "--block-tokens",
            "8",
            "--prefill-tps",
            "1000",
            "--step-ms",
            "5",
            "--step-per-seq-ms",
            "0.5",
            "--max-batch-tokens",
            "512",
            "--model",
            "m",
        ])
        .unwrap();
        let spec = engine_spec(&args).unwrap();
        assert_eq!(
            (spec.kv_blocks, spec.block_tokens, spec.max_batch_tokens),
            (64, 8, 512)
        );
        assert_eq!(
            (spec.prefill_tps, spec.step_ms, spec.step_per_seq_ms),
            (1000.0, 5.0, 0.5)
        );
        // Engine flags need --llm; the plain backend's own flags do not go with it.
        assert!(cli(&["--listen", "127.0.0.1:0", "--kv-blocks", "64"]).is_err());
        assert!(cli(&["--listen", "127.0.0.1:0", "--llm", "--latency", "5ms"]).is_err());
        for bad in [
            &["--kv-blocks", "0"][..],
            &["--block-tokens", "0"],
            &["--prefill-tps", "0"],
            &["--step-ms", "-1"],
            &["--max-batch-tokens", "0"],
        ] {
            let mut argv = vec!["--listen", "127.0.0.1:0", "--llm"];
            argv.extend_from_slice(bad);
            let args = cli(&argv).unwrap();
            assert!(engine_spec(&args)
                .err()
                .is_some_and(|e| e.downcast_ref::<crate::cmd::UsageError>().is_some()));
        }
    }
}
