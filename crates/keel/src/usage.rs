//! The binary's ground floor: an error in what the user asked for, which both `cmd` and
//! `lab` raise (exit code 2).

/// A mistake in what the user asked for (bad flag value, unknown name): exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}
