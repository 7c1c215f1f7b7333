//! `keel lab`: the main job. Formula, simulation and real traffic side by side.

use std::io::IsTerminal;
use std::path::PathBuf;

use keel_balance::StrategyKind;

use super::usage;
use crate::lab::{self, Experiment, LabOptions};

/// Arguments of `keel lab`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A first look in about a minute on 2 shared cores (66 s measured under a load of 12-13): experiments e1, e2, e6, e6b with fewer requests (e8 and e9
    /// only when named, then in a short form: about 4 s (e8) and 8 s (e9) per strategy).
    #[arg(long)]
    quick: bool,
    /// Experiments to run, comma-separated: e1..e6, e6b; e8 (tail latency under open-loop
    /// load, about 25 s per strategy) and e9 (reaction to a server slowed 5x and back, about
    /// 22 s per strategy), which run only when named; e10 (keel advise on a logged run, its
    /// top three configurations and the running one measured) and e12 (a fleet of keel proxies
    /// on a three-member etcd, local against shared outlier evidence; needs `etcd` on PATH,
    /// about 7 minutes, quick 1), also only when named; e13 (prompt tokens from cache against
    /// cache pressure), e14 (the load above which prefix affinity stops paying: closed form
    /// and simulator only) and e15 (bounded affinity on the two inference workloads, with the
    /// routers of --peers vllm-router,smg), fake vLLM engines on loopback, only when named
    /// (e15 also when --peers names an inference router); e16 (a fleet of 1, 2, 4 keel proxies
    /// in front of the same engines: cache hits lost, and what the engines' signals and a key
    /// hashed alike recover; quick about 10 s, N = 1, 2); e17 (an affine inference engine
    /// fails: hang, 500, refuse; failed tries and cache hits lost, closed form, simulator and
    /// traffic; quick about 10 s), only when named; e18 (Mooncake's conversation trace replayed
    /// through keel and the routers of --peers vllm-router,smg; about 5 minutes, quick keel
    /// only, about 45 s), only when named. Default: e1..e6b (quick: e1,e2,e6,e6b).
    #[arg(long, value_delimiter = ',')]
    experiments: Vec<String>,
    /// Only these strategies, comma-separated.
    #[arg(long, value_delimiter = ',')]
    strategies: Vec<String>,
    /// Report directory (index.html, results.json). Default: a new directory per run,
    /// keel-lab-YYYYMMDD-HHMMSS (UTC) in the current directory, so that no run overwrites
    /// another's report.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Terminal tables with every column (wider than 100 columns).
    #[arg(long)]
    wide: bool,
    /// Print the results JSON on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Seed of balancers, backends and simulations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Also measure these balancers in front of the same backends, comma-separated: nginx,
    /// haproxy, envoy (found on PATH or through KEEL_NGINX, KEEL_HAPROXY, KEEL_ENVOY;
    /// scripts/install-peers.sh installs them; one that is absent is named and skipped). Alone,
    /// only the peers' rows and keel's for the same cases run (--quick: about 4 minutes).
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
}

/// Runs `keel lab`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let mut strategies = Vec::new();
    for s in &args.strategies {
        match s.parse::<StrategyKind>() {
            Ok(k) => strategies.push(k),
            Err(e) => return usage(e.to_string()),
        }
    }
    let experiments: Vec<String> = args
        .experiments
        .iter()
        .map(|e| e.to_ascii_lowercase())
        .collect();
    let out = args.out.clone().unwrap_or_else(fresh_out_dir);
    let opts = LabOptions {
        quick: args.quick,
        experiments,
        strategies,
        out: out.clone(),
        seed: args.seed,
        progress: !args.quiet && std::io::stderr().is_terminal(),
        peers: args.peers,
    };
    // Every experiment of the lab, in the report's order; each runs when its plan is not empty.
    let mut experiments: Vec<Box<dyn Experiment>> = vec![
        Box::new(lab::Reliability::new(&opts)),
        Box::new(lab::TailRun::new(&opts)),
        Box::new(lab::Peers::new(&lab::inference::others(&opts))?),
        Box::new(lab::E10::new(&opts)),
        Box::new(lab::Fleet::new(&opts)),
        Box::new(lab::Inference::new(&opts)),
        Box::new(lab::E16::new(&opts)),
        Box::new(lab::E17::new(&opts)),
        Box::new(lab::E18::new(&opts)),
    ];
    let report = lab::run(&opts, &mut experiments)?;
    if args.json {
        println!("{}", serde_json::to_string(&lab::results_json(&report))?);
    } else {
        lab::print_table(&report, &experiments, args.wide);
        println!("Report: {} (index.html, results.json)", out.display());
    }
    Ok(())
}

/// `keel-lab-YYYYMMDD-HHMMSS` (UTC, now) in the current directory, with `-2`, `-3`, ... when a
/// run in the same second took it already.
fn fresh_out_dir() -> PathBuf {
    let stamp = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    // 2026-12-02T09:30:00Z -> 20261202-093000
    let digits: String = stamp.chars().filter(char::is_ascii_digit).collect();
    let name = format!("keel-lab-{}-{}", &digits[..8], &digits[8..14]);
    let mut dir = PathBuf::from(&name);
    let mut n = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{name}-{n}"));
        n += 1;
    }
    dir
}
