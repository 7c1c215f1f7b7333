//! `keel advise` on an inference pool's log: prefix-affinity or not, by how much and up to
//! which load, and the section to paste (keel_model::fit::inference does the work).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use anyhow::Context;
use keel_model::fit::inference::{self, InferenceAdvice, InferenceOptions};
use keel_model::inference::EngineSpec;

/// What `keel advise` was asked, for an inference pool's log.
pub(crate) struct Ask<'a> {
    pub access_log: &'a Path,
    pub cluster: Option<&'a str>,
    pub kv_blocks: Option<usize>,
    pub block_tokens: Option<usize>,
    pub prefill_tps: f64,
    pub step_ms: f64,
    pub step_per_seq_ms: f64,
    pub replications: Option<u32>,
    pub seed: u64,
    pub out: Option<&'a Path>,
    pub json: bool,
    /// Sentences on one line each; else wrapped to `columns`.
    pub wide: bool,
    pub columns: usize,
}

/// Lines read to tell an inference pool's log from another.
const SNIFF_LINES: usize = 1000;

/// Whether the log at `path` is an inference pool's: one of its first lines has `ttft_ms`
/// (keel writes it only for an `inference = true` cluster's answers).
pub(crate) fn looks_like_inference(path: &Path) -> bool {
    if path == Path::new("-") {
        return false;
    }
    let Ok(f) = File::open(path) else {
        return false;
    };
    BufReader::new(f)
        .lines()
        .take(SNIFF_LINES)
        .map_while(Result::ok)
        .any(|l| inference::is_inference_line(&l))
}

/// Runs advise on an inference pool's log.
pub(crate) fn run(args: &Ask<'_>) -> anyhow::Result<()> {
    let source = args.access_log.display().to_string();
    let (cluster, answers) = if args.access_log == Path::new("-") {
        inference::read_answers(std::io::stdin().lock(), args.cluster)
    } else {
        let file = File::open(args.access_log)
            .with_context(|| format!("cannot open {}", args.access_log.display()))?;
        inference::read_answers(BufReader::with_capacity(1 << 20, file), args.cluster)
    }
    .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    let d = EngineSpec::default();
    let spec = EngineSpec {
        kv_blocks: args.kv_blocks.unwrap_or(d.kv_blocks),
        block_tokens: args.block_tokens.unwrap_or(d.block_tokens),
        prefill_tps: args.prefill_tps,
        step_ms: args.step_ms,
        step_per_seq_ms: args.step_per_seq_ms,
        ..d
    };
    if !(spec.prefill_tps > 0.0 && spec.step_ms >= 0.0 && spec.step_per_seq_ms >= 0.0) {
        return crate::cmd::usage(
            "--prefill-tps must be above 0, --step-ms and --step-per-seq-ms at least 0",
        );
    }
    if spec.kv_blocks == 0 || spec.block_tokens == 0 {
        return crate::cmd::usage("--kv-blocks and --block-tokens must be at least 1");
    }
    let opts = InferenceOptions {
        spec,
        kv_blocks_given: args.kv_blocks.is_some(),
        block_tokens_given: args.block_tokens.is_some(),
        seeds: u64::from(args.replications.unwrap_or(20)),
        seed: args.seed,
    };
    let fit = inference::fit(&cluster, &answers);
    let advice = inference::advise(fit, &opts);
    if let Some(dir) = args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let p = dir.join("advice.json");
        std::fs::write(&p, serde_json::to_string_pretty(&advice)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&advice)?);
    } else {
        print(&advice, args.wide, args.columns);
    }
    Ok(())
}

fn print(a: &InferenceAdvice, wide: bool, columns: usize) {
    let say = |text: &str| {
        if wide {
            println!("{text}");
        } else {
            for (i, line) in crate::lab::answer::wrap(text, columns, "  ")
                .into_iter()
                .enumerate()
            {
                println!("{}", if i == 0 { &line[2..] } else { &line });
            }
        }
    };
    println!("keel advise: inference cluster `{}`", a.fit.cluster);
    say(&a.answer);
    for w in &a.why {
        say(&format!("why: {w}"));
    }
    println!();
    println!(
        "{:<16} {:>24} {:>30} {:>9}",
        "strategy", "from cache [95 %]", "mean TTFT ms [95 %]", "hot spot"
    );
    for p in [&a.balanced, &a.affinity] {
        println!(
            "{:<16} {:>24} {:>30} {:>8.2}x",
            p.strategy,
            format!(
                "{:.3} [{:.3}, {:.3}]",
                p.cached[0], p.cached[1], p.cached[2]
            ),
            format!(
                "{:.1} [{:.1}, {:.1}]",
                p.ttft_ms[0], p.ttft_ms[1], p.ttft_ms[2]
            ),
            p.hot_spot
        );
    }
    println!(
        "\nto run it, replace the cluster's [[cluster]] section with (keep your own timeouts and protections):\n{}",
        a.cluster_toml
    );
}
