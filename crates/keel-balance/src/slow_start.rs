//! Slow start: an endpoint that joins, or comes back from an ejection or a failed health check,
//! gets a weight that ramps up over a window instead of its full share at once (a cold cache or
//! a JIT that is still warming does not take a full share of traffic).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::{InvalidField, Problem};

/// Slow start settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlowStartConfig {
    /// Length of the ramp. Default 30 s.
    #[serde(with = "crate::duration_serde")]
    pub window: Duration,
    /// Shape of the ramp: factor = (elapsed / window)^(1 / aggression); 1 is linear, larger
    /// values ramp faster at first. Default 1.
    pub aggression: f64,
    /// The ramp never gives less than this share of the weight, in percent. Default 10.
    pub min_weight_percent: f64,
}

impl Default for SlowStartConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(30),
            aggression: 1.0,
            min_weight_percent: 10.0,
        }
    }
}

impl SlowStartConfig {
    /// Checks the ranges; the error names the field relative to this table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let bad = |key, problem| Err(InvalidField::at(key, problem));
        if self.window.is_zero() {
            return bad("window", Problem::out_of_range("greater than zero", "0s"));
        }
        if self.aggression.is_nan() || self.aggression <= 0.0 {
            return bad(
                "aggression",
                Problem::out_of_range("greater than zero", self.aggression),
            );
        }
        if !(0.0..=100.0).contains(&self.min_weight_percent) {
            return bad(
                "min_weight_percent",
                Problem::out_of_range("within 0..=100", self.min_weight_percent),
            );
        }
        Ok(())
    }

    /// The weight factor in (0, 1] for an endpoint whose ramp began at `since` (nanoseconds).
    pub(crate) fn factor(&self, since: u64, now: u64) -> f64 {
        let window = crate::time::nanos(self.window);
        let elapsed = now.saturating_sub(since);
        if elapsed >= window {
            return 1.0;
        }
        let linear = elapsed as f64 / window as f64;
        let shaped = if self.aggression == 1.0 {
            linear
        } else {
            linear.powf(1.0 / self.aggression)
        };
        shaped.max(self.min_weight_percent / 100.0).clamp(1e-6, 1.0)
    }
}
