//! The words advise's answers and the peers' paste blocks share: the protection sets and
//! durations as a configuration file writes them.

use std::time::Duration;

use serde::Serialize;

/// A duration in humantime form, rounded to three significant digits (`333ms`, not
/// `333ms 333us 333ns`), as a configuration file should say it.
pub fn human(d: Duration) -> String {
    let ns = d.as_nanos();
    let digits = ns.checked_ilog10().unwrap_or(0);
    let step = if digits > 2 {
        10u128.pow(digits - 2)
    } else {
        1
    };
    let rounded = (ns + step / 2) / step * step;
    humantime::format_duration(Duration::from_nanos(rounded as u64)).to_string()
}

/// A set of protections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Protections {
    /// No retry, no outlier detection, no health checks (`[cluster.retry] attempts = 0`).
    None,
    /// What keel proxy does with no protection table: outlier detection with keel-balance's
    /// defaults and one retry within the budget.
    Defaults,
    /// Outlier detection (keel-balance's defaults), two retries, health checks every 5 s.
    Protected,
    /// The running configuration's own, when it is none of the above.
    Running,
}

impl Protections {
    /// The label shown in reports.
    pub fn label(self) -> &'static str {
        match self {
            Protections::None => "none",
            Protections::Defaults => "keel defaults (outlier, retry 1)",
            Protections::Protected => "outlier + retry 2 + health",
            Protections::Running => "as configured",
        }
    }
}
