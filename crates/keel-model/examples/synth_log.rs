//! Writes an access log in keel proxy's JSON form from a known model, to standard output: the
//! example of examples/advise/ and the input of the 1,000,000-line benchmark (docs/advise.md).
//!
//! `cargo run --release -p keel-model --example synth_log -- LINES [SEED] [--today]`: three
//! endpoints behind round-robin at 200 requests/s: 10.0.0.1 healthy (log-normal 10 ms, sigma
//! 0.5), 10.0.0.2 answers 20 % of its calls 503 after 0.5 ms, 10.0.0.3 three times slower
//! (log-normal 30 ms) and serving 4 calls at once. `--today` leaves out `tries`.

use std::io::Write;
use std::time::Duration;

use keel_model::fit::synth::{write_log, SynthEndpoint, SynthLog};
use keel_model::vocab::{Latency, LatencyDist};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let lines: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let seed: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let today = args.iter().any(|a| a == "--today");
    let lognormal = |ms: u64, sigma: f64| Latency {
        mean: Duration::from_millis(ms),
        dist: LatencyDist::LogNormal { sigma },
    };
    let a = SynthEndpoint::healthy("10.0.0.1:8080", lognormal(10, 0.5));
    let mut b = SynthEndpoint::healthy("10.0.0.2:8080", lognormal(10, 0.5));
    b.error_share = 0.2;
    b.error_after_ms = 0.5;
    let mut c = SynthEndpoint::healthy("10.0.0.3:8080", lognormal(30, 0.5));
    c.capacity = Some(4);
    let spec = SynthLog {
        cluster: "app".into(),
        endpoints: vec![a, b, c],
        rate: 200.0,
        requests: lines,
        timeout_ms: 1000.0,
        tries: !today,
        seed,
        start: 1_764_576_000.0, // 2025-12-01T08:00:00Z
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    write_log(&spec, &mut out)?;
    out.flush()
}
