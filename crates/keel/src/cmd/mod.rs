//! Subcommands. Each module owns its arguments (`Args`) and a `run` function.

pub mod analyze;
pub mod backend;
pub mod distribute;
pub mod lab;
pub mod proxy;
pub mod simulate;

use std::process::ExitCode;

/// A mistake in what the user asked for (bad flag value, unknown name): exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Returns a usage error (exit code 2) with this message.
pub fn usage<T>(msg: impl Into<String>) -> anyhow::Result<T> {
    Err(UsageError(msg.into()).into())
}

/// Maps a subcommand's result to the process exit code: 0 ok, 2 usage error, 1 anything else.
pub fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel: error: {e:#}");
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
