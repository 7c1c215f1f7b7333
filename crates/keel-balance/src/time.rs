//! Time on the driver's clock, as keel-balance keeps it: nanoseconds since the driver's epoch.

use std::time::Duration;

/// Nanoseconds since the driver's epoch. `0` stands for "never" in the fields that keep an
/// instant.
#[inline]
pub(crate) fn nanos(t: Duration) -> u64 {
    t.as_nanos().min(u64::MAX as u128) as u64
}
