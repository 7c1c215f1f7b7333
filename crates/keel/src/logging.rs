//! keel's own process logs (not the access log): where they go and in which format.
//!
//! Every subcommand logs through `tracing` to stderr, never stdout: stdout is for results
//! (reports, tables) and, when `[access_log] path = "-"`, for access-log lines only. The
//! format is chosen once for the process with `keel proxy --log-format`.

use std::sync::OnceLock;

/// The format of keel's own log lines (`--log-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event (colours only on a terminal).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the event's
    /// fields at the top level, for log shippers.
    Json,
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The format the process logs in (text until [`init`] ran).
pub fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

/// Installs the process's log subscriber: `filter` in RUST_LOG syntax (RUST_LOG, when set,
/// wins), lines on stderr in `format`. An invalid filter is a usage error.
pub fn init(format: LogFormat, filter: &str) -> anyhow::Result<()> {
    let parsed = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(filter));
    let filter = match parsed {
        Ok(f) => f,
        Err(e) => {
            return Err(
                crate::usage::UsageError(format!("invalid log filter `{filter}`: {e}")).into(),
            )
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder
            .with_ansi(colour(
                std::io::IsTerminal::is_terminal(&std::io::stderr()),
                std::env::var_os("NO_COLOR"),
            ))
            .try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    installed.map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))?;
    let _ = FORMAT.set(format);
    Ok(())
}

/// Whether log lines carry ANSI colours: only on a terminal, and never when `NO_COLOR` is set
/// to anything but the empty string (<https://no-color.org>).
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())), "NO_COLOR empty is unset");
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None), "a file or a pipe");
    }
}
