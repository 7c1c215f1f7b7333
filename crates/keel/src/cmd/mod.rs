//! Subcommands. Each module owns its arguments (`Args`) and a `run` function.

pub mod advise;
pub mod analyze;
pub mod backend;
pub mod distribute;
pub mod lab;
pub mod manual;
pub mod proxy;
#[cfg(feature = "etcd")]
pub mod register;
pub mod simulate;
mod upgrade;

use std::process::ExitCode;

pub use crate::usage::UsageError;

/// Returns a usage error (exit code 2) with this message.
pub fn usage<T>(msg: impl Into<String>) -> anyhow::Result<T> {
    Err(UsageError(msg.into()).into())
}

/// The latency flags that `keel backend` and `keel distribute` share, in keel-model's
/// vocabulary: `--latency` (the mean), `--latency-dist` (fixed, exponential, lognormal) and
/// `--sigma` (lognormal's).
pub fn latency_flags(mean: &str, dist: &str, sigma: f64) -> anyhow::Result<keel_model::Latency> {
    use keel_model::{Latency, LatencyDist};
    let mean = match humantime::parse_duration(mean) {
        Ok(d) => d,
        Err(e) => {
            return usage(format!(
                "--latency {mean:?}: {e} (write a duration such as 10ms or 2s)"
            ))
        }
    };
    let dist = match dist {
        "fixed" => LatencyDist::Fixed,
        "exponential" => LatencyDist::Exponential,
        "lognormal" => LatencyDist::LogNormal { sigma },
        other => {
            return usage(format!(
                "--latency-dist {other:?}: unknown distribution; allowed: fixed, exponential, lognormal"
            ))
        }
    };
    let latency = Latency { mean, dist };
    match latency.validate() {
        Ok(()) => Ok(latency),
        // The field is `sigma`, the flag's name.
        Err(e) => usage(format!("--{} {}", e.field, e.problem)),
    }
}

/// Maps a subcommand's result to the process exit code: 0 ok, 2 usage error, 1 anything else.
pub fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e);
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

/// Prints the error that ends the process on stderr: as text, or with `--log-format json` as
/// one JSON line shaped like the other log lines.
fn report(e: &anyhow::Error) {
    if crate::logging::format() == crate::logging::LogFormat::Json {
        let line = serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "ERROR",
            "message": format!("{e:#}"),
            "target": "keel",
        });
        eprintln!("{line}");
    } else {
        eprintln!("keel: error: {e:#}");
    }
}
