//! `keel register`: registers one endpoint in etcd for a process that cannot do it itself, under
//! a lease kept alive while `keel register` runs; SIGTERM or SIGINT deletes the key (and revokes
//! the lease) before it exits, and a crash lets the lease expire after `--ttl`.

use std::time::Duration;

use anyhow::Context as _;
use keel_proxy::config::EtcdConfig;
use keel_proxy::etcd::{register, Registration};

#[derive(clap::Args)]
pub struct Args {
    /// etcd member URL(s), comma-separated, e.g. http://127.0.0.1:2379.
    #[arg(long, value_name = "URL")]
    etcd: String,
    /// The key prefix the proxies watch (`discovery = { etcd = "PREFIX" }`), ending in `/`.
    #[arg(long, value_name = "PREFIX")]
    prefix: String,
    /// The endpoint's address, host:port.
    #[arg(long, value_name = "HOST:PORT")]
    address: String,
    /// The lease's time to live: how long after a crash the endpoint stays registered.
    #[arg(long, default_value = "10s")]
    ttl: String,
    /// The endpoint's weight.
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// The endpoint's zone.
    #[arg(long)]
    zone: Option<String>,
    /// The endpoint's priority level (0 first).
    #[arg(long, default_value_t = 0)]
    priority: u32,
    /// The key under the prefix (default: the address).
    #[arg(long)]
    name: Option<String>,
    /// How long connecting and each request to etcd may take.
    #[arg(long, default_value = "2s")]
    dial_timeout: String,
    /// Log filter (RUST_LOG syntax).
    #[arg(long, default_value = "info")]
    pub log: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let duration = |flag: &str, v: &str| -> anyhow::Result<Duration> {
        humantime::parse_duration(v).or_else(|e| {
            super::usage(format!(
                "--{flag} {v:?}: {e} (write a duration such as 10s)"
            ))
        })
    };
    let ttl = duration("ttl", &args.ttl)?;
    if ttl < Duration::from_secs(1) {
        return super::usage("--ttl: at least 1s (etcd leases count whole seconds)");
    }
    let mut etcd = EtcdConfig::new(args.etcd.split(',').map(|s| s.trim().to_string()).collect());
    etcd.dial_timeout = duration("dial-timeout", &args.dial_timeout)?;
    if let Err(e) = etcd.validate() {
        return super::usage(format!("--etcd: {}", e.problem));
    }
    if !args.prefix.ends_with('/') {
        return super::usage(format!(
            "--prefix {:?}: a prefix ends in `/`, e.g. /keel/clusters/app/",
            args.prefix
        ));
    }
    let ok = args
        .address
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok {
        return super::usage(format!("--address {:?}: expected host:port", args.address));
    }
    if args.weight == 0 {
        return super::usage("--weight: at least 1");
    }
    let key = format!(
        "{}{}",
        args.prefix,
        args.name.as_deref().unwrap_or(&args.address)
    );
    let registration = Registration {
        address: args.address,
        weight: args.weight,
        zone: args.zone,
        priority: args.priority,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
        let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
        let stop = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        };
        let k = key.clone();
        register(&etcd, &key, &registration, ttl, stop, move |lease| {
            // One line on stdout per (re-)registration: scripts wait for it.
            println!("registered {k} (lease {lease:x})");
        })
        .await
        .with_context(|| format!("deregistering {key}"))
    })
}
