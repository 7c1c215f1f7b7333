//! `keel proxy`: runs the HTTP reverse proxy from a TOML configuration file.
//!
//! Signals: SIGTERM or SIGINT drain and stop (a second one stops at once); SIGHUP reloads the
//! file (an invalid file is refused with a logged error and the old configuration keeps
//! serving); SIGUSR1 reopens the access log (after logrotate moved it); SIGUSR2 replaces the
//! process with the binary now at its path, handing over the listening sockets (see
//! `upgrade.rs`). The admin listener's `POST /reload` does the same as SIGHUP.

use std::io::Write;
use std::path::PathBuf;

use keel_proxy::ProxyConfig;

/// Arguments of `keel proxy`.
#[derive(clap::Args)]
pub struct Args {
    /// The TOML configuration file (see docs/configuration.md and examples/proxy.toml).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: PathBuf,
    /// Only check the configuration: print a summary and exit 0, or the error and exit 2.
    #[arg(long)]
    pub check: bool,
    /// Threads serving connections, each with its own runtime and keep-alive connections; a
    /// new connection goes to the one with the fewest open (default: one per CPU; 1 runs
    /// the whole proxy on one thread).
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// Log filter in RUST_LOG syntax (RUST_LOG, when set, wins).
    #[arg(long, default_value = "info", value_name = "FILTER")]
    pub log: String,
    /// The format of the proxy's own log lines, on stderr: `text` or `json` (one object a
    /// line; the access log has its own `format`).
    #[arg(long, value_enum, default_value_t = crate::logging::LogFormat::Text)]
    pub log_format: crate::logging::LogFormat,
    /// Write the process ID to this file once serving (a binary upgrade rewrites it with the
    /// new process's; removed at exit if it still names this process).
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
}

fn summary(config: &ProxyConfig) -> String {
    let mut s = String::new();
    for (l, addr) in config
        .listeners
        .iter()
        .zip(config.listeners.iter().map(|l| l.listen))
    {
        let default = l.cluster.as_deref().unwrap_or("none: 404");
        if l.routes.is_empty() {
            s.push_str(&format!("  listener {addr} -> cluster {default}\n"));
        } else {
            s.push_str(&format!(
                "  listener {addr}: {} route(s), else cluster {default}\n",
                l.routes.len()
            ));
        }
    }
    for c in &config.clusters {
        let over = match &c.discovery {
            Some(d) => format!("endpoints from {} (not resolved by --check)", d.describe()),
            None => format!("{} endpoint(s)", c.endpoints.len()),
        };
        let a = c.amplification();
        let worst_route = Some(config.worst_amplification(c)).filter(|&w| w > a.worst_case);
        let probes = if a.probes_per_try > 0 {
            format!(" (+{} load probe(s) per try)", a.probes_per_try)
        } else {
            String::new()
        };
        let routes = worst_route.map_or(String::new(), |w| format!(", {w} through a route"));
        s.push_str(&format!(
            "  cluster {}: {} over {over}; retries {}, health check {}, outlier detection {}\n",
            c.name,
            c.balance.strategy,
            c.protections.retry.attempts,
            if c.protections.health_check.is_some() {
                "on"
            } else {
                "off"
            },
            if c.protections.outlier_detection.is_some() {
                "on"
            } else {
                "off"
            },
        ));
        s.push_str(&format!(
            "    upstream tries per request: at most {}{probes}{routes}; in the long run at most {:.2} (retry and hedge budgets){}\n",
            a.worst_case,
            a.long_run,
            c.protections.max_amplification
                .map_or(String::new(), |m| format!("; max_amplification = {m}"))
        ));
    }
    if let Some(a) = &config.admin {
        s.push_str(&format!("  admin {}\n", a.listen));
    }
    s
}

/// Whether the access log's file can be opened for appending, as the start will open it. An
/// existing file is opened without writing to it; a missing one is created and removed again,
/// so that a check leaves nothing behind.
fn check_access_log(config: &ProxyConfig) -> Result<(), keel_balance::InvalidField> {
    use std::fs::OpenOptions;
    let Some(path) = config.access_log.as_ref().and_then(|a| a.file()) else {
        return Ok(());
    };
    let opened = match OpenOptions::new().append(true).open(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)
            .map(|_| {
                let _ = std::fs::remove_file(&path);
            }),
        other => other.map(drop),
    };
    opened.map_err(|e| {
        keel_balance::InvalidField::new(
            keel_balance::FieldPath::key("access_log").then("path"),
            keel_balance::Problem::Invalid(format!(
                "cannot open `{}` for appending: {e}",
                path.display()
            )),
        )
    })
}

/// Runs `keel proxy`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let config = match ProxyConfig::from_file(&args.config) {
        Ok(c) => c,
        Err(e) => return crate::cmd::usage(format!("invalid configuration: {e}")),
    };
    if args.check {
        if let Err(e) = check_access_log(&config) {
            let text = std::fs::read_to_string(&args.config).unwrap_or_default();
            let origin = args.config.display().to_string();
            let located = ProxyConfig::locate(&text, &origin, &e);
            return crate::cmd::usage(format!("invalid configuration: {located}"));
        }
        print!("{}: ok\n{}", args.config.display(), summary(&config));
        return Ok(());
    }
    let workers = match args.workers {
        Some(0) => return super::usage("--workers must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // The main thread runs admin, health checks, signals and reloads. With one worker it also
    // serves the connections (one thread in all); with more, it accepts them and hands each to
    // the worker thread with the fewest open, each worker with its own single-threaded runtime
    // (see keel_proxy::start_with_workers): no work-stealing scheduler, so threads do not wake
    // each other.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let workers = if workers == 1 { 0 } else { workers };
    // Captured now: after an upgrade replaced the file, this names the new binary, while
    // /proc/self/exe would name the deleted old one.
    let exe = std::env::current_exe()?;
    let result = runtime.block_on(serve(
        config,
        args.config,
        workers,
        exe,
        args.pid_file.as_ref(),
    ));
    if let Some(p) = &args.pid_file {
        if std::fs::read_to_string(p).is_ok_and(|s| s.trim() == std::process::id().to_string()) {
            let _ = std::fs::remove_file(p);
        }
    }
    result
}

/// One line per listener and one for the admin, for people and for scripts that start the
/// proxy on ephemeral ports: on stdout as text, or on stderr when stdout carries the access log
/// (which then holds access-log lines only); with `--log-format json`, log events
/// (`"message":"listening"`, `addr`) among the other process logs on stderr.
fn announce(
    listeners: &[keel_proxy::config::ListenerConfig],
    proxy: &keel_proxy::ProxyHandle,
    access_log_on_stdout: bool,
) -> std::io::Result<()> {
    let json = crate::logging::format() == crate::logging::LogFormat::Json;
    let mut lines = Vec::new();
    for (l, addr) in listeners.iter().zip(proxy.listener_addrs()) {
        let to = match (&l.cluster, l.routes.len()) {
            (Some(c), 0) => format!("cluster {c}"),
            (c, n) => format!(
                "{n} route(s), else {}",
                c.as_deref()
                    .map_or("404".to_string(), |c| format!("cluster {c}"))
            ),
        };
        if json {
            tracing::info!(addr = %format_args!("http://{addr}"), to = %to, "listening");
        } else {
            lines.push(format!("keel proxy: listening on http://{addr} ({to})\n"));
        }
    }
    if let Some(a) = proxy.admin_addr() {
        if json {
            tracing::info!(addr = %format_args!("http://{a}"), "admin listening");
        } else {
            lines.push(format!("keel proxy: admin on http://{a}\n"));
        }
    }
    let text = lines.concat();
    if access_log_on_stdout {
        let mut err = std::io::stderr().lock();
        err.write_all(text.as_bytes())?;
        err.flush()
    } else {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()
    }
}

async fn serve(
    config: ProxyConfig,
    path: PathBuf,
    workers: usize,
    exe: PathBuf,
    pid_file: Option<&PathBuf>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut usr1 = signal(SignalKind::user_defined1())?;
    let mut usr2 = signal(SignalKind::user_defined2())?;

    let drain = config.drain_timeout;
    let delay = config.drain_delay;
    let mut upgraded = false;
    let access_log_on_stdout = config
        .access_log
        .as_ref()
        .is_some_and(|a| a.file().is_none());
    let listeners = config.listeners.clone();
    let inherited = super::upgrade::inherited()?;
    let proxy = keel_proxy::start_with(
        config,
        keel_proxy::StartOptions {
            workers,
            inherited,
            collect: Some(crate::collect_allocator),
        },
    )
    .await?;
    if let Some(p) = pid_file {
        std::fs::write(p, format!("{}\n", std::process::id()))
            .map_err(|e| anyhow::anyhow!("cannot write the PID file {}: {e}", p.display()))?;
    }
    super::upgrade::signal_ready();
    announce(&listeners, &proxy, access_log_on_stdout)?;
    tracing::info!(config = %path.display(), "keel proxy started");
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => {
                tracing::info!(config = %path.display(), "SIGHUP: reloading");
                // Logged and counted by the proxy, refusals included.
                let _ = proxy.reload_from_file();
            }
            _ = usr1.recv() => {
                tracing::info!("SIGUSR1: reopening the access log");
                proxy.reopen_access_log();
            }
            _ = usr2.recv() => {
                tracing::info!(binary = %exe.display(), "SIGUSR2: starting the new binary with this one's listening sockets");
                match super::upgrade::start_successor(exe.clone(), proxy.listening_fds()).await {
                    Ok(pid) => {
                        tracing::info!("upgrade: PID {pid} serves; this process drains and exits");
                        // The new process answers the admin socket (its `/ready` is 200).
                        proxy.stop_admin();
                        upgraded = true;
                        break;
                    }
                    Err(e) => tracing::error!("upgrade failed: {e:#}"),
                }
            }
        }
    }
    // After an upgrade the new process serves the same sockets: this one drains at once.
    // Otherwise `/ready` fails first while the listeners still serve (`drain_delay`).
    let delay = if upgraded {
        std::time::Duration::ZERO
    } else {
        delay
    };
    tracing::info!(
        "shutting down: /ready fails now, no new connections in {}, then draining requests in flight for up to {}",
        humantime::format_duration(delay),
        humantime::format_duration(drain)
    );
    let stop = async {
        if upgraded {
            proxy.shutdown(drain).await
        } else {
            proxy.terminate().await
        }
    };
    tokio::select! {
        drained = stop => tracing::info!(cut = drained.total(), "stopped"),
        _ = term.recv() => tracing::warn!("second signal: stopping at once"),
        _ = int.recv() => tracing::warn!("second signal: stopping at once"),
    }
    Ok(())
}
