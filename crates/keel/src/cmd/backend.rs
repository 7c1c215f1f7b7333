//! `keel backend`: the experiment backend of `keel_testbed::backend` as a process, for demos and
//! for trying the proxy by hand. Several `--listen` start several backends in one process.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use keel_testbed::backend::{self, BackendConfig, Fault, LatencyDist};

use crate::cmd::usage;

/// Arguments of `keel backend`.
#[derive(clap::Args)]
#[command(after_help = "Faults:\n  \
    none    answer 200 after the latency (503 at once with --error-rate)\n  \
    refuse  do not listen: connects are refused\n  \
    hang    read requests and never answer them\n  \
    error   answer 503 at once\n  \
    slow    the latency multiplied by --slow-factor\n  \
    reset   send headers and half of the body, then reset the TCP connection\n  \
    flap    alternate --flap-up periods of `none` and --flap-down periods of `error` (503)\n\
/healthz answers 200 `ok` unless the fault says otherwise; --error-rate does not apply to it.\n\
Every response carries `x-backend: <name>`.\n\n\
Examples:\n  \
    keel backend --listen 127.0.0.1:9001 --latency 10ms\n  \
    keel backend --listen 127.0.0.1:9001 --listen 127.0.0.1:9002 --latency 10ms --latency-dist exp\n  \
    keel backend --listen 127.0.0.1:9005 --fault hang\n  \
    keel backend --listen 127.0.0.1:9005 --fault flap --flap-up 2s --flap-down 1s")]
pub struct Args {
    /// Address to listen on (port 0: any free port). Repeat for several backends in one process.
    #[arg(long, required = true, value_name = "ADDR")]
    listen: Vec<String>,
    /// Mean response latency, e.g. 10ms.
    #[arg(long, default_value = "0ms")]
    latency: String,
    /// Latency distribution around its mean: fixed, exp (exponential) or lognormal.
    #[arg(long, default_value = "fixed", value_name = "DIST")]
    latency_dist: String,
    /// Standard deviation of the log of the latency, for --latency-dist lognormal.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.5)]
    sigma: f64,
    /// Fault to inject: none, refuse, hang, error, slow, reset, flap (see below).
    #[arg(long, default_value = "none")]
    fault: String,
    /// Probability in [0, 1] that a request gets an instant 503.
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    error_rate: f64,
    /// Latency multiplier of --fault slow.
    #[arg(long, allow_negative_numbers = true, default_value_t = 10.0)]
    slow_factor: f64,
    /// Length of a healthy period of --fault flap.
    #[arg(long, default_value = "2s")]
    flap_up: String,
    /// Length of a failing (503) period of --fault flap.
    #[arg(long, default_value = "1s")]
    flap_down: String,
    /// Size of a response body in bytes.
    #[arg(long, default_value_t = 64)]
    body_bytes: usize,
    /// Value of the `x-backend` header (default: the bound address); with several --listen,
    /// NAME-1, NAME-2, ...
    #[arg(long)]
    name: Option<String>,
    /// Seed of the random draws (error rate, latency); default: derived from the name.
    #[arg(long)]
    seed: Option<u64>,
}

fn duration(flag: &str, text: &str) -> anyhow::Result<Duration> {
    match humantime::parse_duration(text) {
        Ok(d) => Ok(d),
        Err(e) => usage(format!(
            "--{flag} {text:?}: {e} (write a duration such as 10ms or 2s)"
        )),
    }
}

fn latency_dist(args: &Args) -> anyhow::Result<LatencyDist> {
    match args.latency_dist.as_str() {
        "fixed" => Ok(LatencyDist::Fixed),
        "exp" | "exponential" => Ok(LatencyDist::Exponential),
        "lognormal" | "log-normal" => {
            if !(args.sigma.is_finite() && args.sigma >= 0.0) {
                return usage(format!("--sigma {}: must be a number >= 0", args.sigma));
            }
            Ok(LatencyDist::LogNormal { sigma: args.sigma })
        }
        other => usage(format!(
            "--latency-dist {other:?}: unknown distribution; allowed: fixed, exp, lognormal"
        )),
    }
}

fn fault(args: &Args) -> anyhow::Result<Fault> {
    Ok(match args.fault.as_str() {
        "none" => Fault::None,
        "refuse" => Fault::Refuse,
        "hang" => Fault::Hang,
        "error" => Fault::Error,
        "reset" => Fault::Reset,
        "slow" => {
            if !(args.slow_factor.is_finite() && args.slow_factor > 0.0) {
                return usage(format!(
                    "--slow-factor {}: must be a number > 0",
                    args.slow_factor
                ));
            }
            Fault::Slow {
                factor: args.slow_factor,
            }
        }
        "flap" => {
            let up = duration("flap-up", &args.flap_up)?;
            let down = duration("flap-down", &args.flap_down)?;
            if up.is_zero() || down.is_zero() {
                return usage("--flap-up and --flap-down must both be > 0");
            }
            Fault::Flap { up, down }
        }
        other => {
            return usage(format!(
                "--fault {other:?}: unknown fault; allowed: {}",
                Fault::NAMES.join(", ")
            ))
        }
    })
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
    if !(0.0..=1.0).contains(&args.error_rate) {
        return usage(format!(
            "--error-rate {}: must be in [0, 1]",
            args.error_rate
        ));
    }
    let cfg = BackendConfig {
        latency: duration("latency", &args.latency)?,
        latency_dist: latency_dist(args)?,
        fault: fault(args)?,
        error_rate: args.error_rate,
        body_bytes: args.body_bytes,
        name: String::new(),
    };
    if matches!(cfg.fault, Fault::Slow { .. }) && cfg.latency.is_zero() {
        eprintln!("keel backend: warning: --fault slow multiplies --latency, which is 0");
    }
    Ok((addrs, cfg))
}

/// Runs `keel backend` until Ctrl-C (or SIGTERM).
pub fn run(args: Args) -> anyhow::Result<()> {
    let (addrs, cfg) = parse(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(serve(args, addrs, cfg))
}

async fn serve(args: Args, addrs: Vec<SocketAddr>, cfg: BackendConfig) -> anyhow::Result<()> {
    let several = addrs.len() > 1;
    let mut handles = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let name = match (&args.name, several) {
            (Some(n), true) => format!("{n}-{}", i + 1),
            (Some(n), false) => n.clone(),
            (None, _) => String::new(),
        };
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
        let dist = match &cfg.latency_dist {
            LatencyDist::Fixed => "fixed".to_string(),
            LatencyDist::Exponential => "exponential".to_string(),
            LatencyDist::LogNormal { sigma } => format!("log-normal sigma {sigma}"),
        };
        println!(
            "keel backend {} listening on {} (latency {:?} {dist}, fault {}, error rate {}, body {} bytes)",
            handle.name(),
            handle.addr(),
            cfg.latency,
            cfg.fault,
            cfg.error_rate,
            cfg.body_bytes
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
            "--error-rate",
            "0.1",
            "--body-bytes",
            "10",
        ])
        .unwrap();
        assert_eq!(addrs.len(), 2);
        assert_eq!(cfg.latency, Duration::from_millis(10));
        assert_eq!(cfg.latency_dist, LatencyDist::LogNormal { sigma: 1.0 });
        assert_eq!(
            cfg.fault,
            Fault::Flap {
                up: Duration::from_millis(300),
                down: Duration::from_secs(1)
            }
        );
        assert_eq!((cfg.error_rate, cfg.body_bytes), (0.1, 10));
        let (_, cfg) = parse_cli(&["--listen", "127.0.0.1:0", "--fault", "slow"]).unwrap();
        assert_eq!(cfg.fault, Fault::Slow { factor: 10.0 });
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for argv in [
            &["--listen", "localhost"][..],
            &["--listen", "127.0.0.1:0", "--fault", "crash"],
            &["--listen", "127.0.0.1:0", "--latency", "fast"],
            &["--listen", "127.0.0.1:0", "--latency-dist", "pareto"],
            &["--listen", "127.0.0.1:0", "--error-rate", "-0.1"],
            &[
                "--listen",
                "127.0.0.1:0",
                "--fault",
                "slow",
                "--slow-factor",
                "-2",
            ],
            &[
                "--listen",
                "127.0.0.1:0",
                "--fault",
                "flap",
                "--flap-down",
                "0s",
            ],
            &[
                "--listen",
                "127.0.0.1:0",
                "--latency-dist",
                "lognormal",
                "--sigma",
                "-1",
            ],
        ] {
            assert!(is_usage(parse_cli(argv)), "{argv:?}");
        }
    }
}
