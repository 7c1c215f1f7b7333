//! How a measurement compares with a prediction: the lab's rule, and the standard errors it
//! is stated in.

use keel_model::stats::Z95;
use serde::Serialize;

/// How a measurement compares with a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Comparison {
    /// Whether the prediction is within the measurement's 95 % interval (for the simulation:
    /// whether the difference is within 1.96 standard errors of the difference).
    pub agrees: bool,
    /// Measured minus predicted, in standard errors (of the measurement; for the simulation,
    /// of the difference of the two).
    pub z: f64,
}

/// Standard error of a rate on one side, from the half of its 95 % interval on that side.
pub(crate) fn side_se(value: f64, ci: [f64; 2], toward: f64) -> f64 {
    let half = if toward >= value {
        ci[1] - value
    } else {
        value - ci[0]
    };
    half.max(0.0) / Z95
}

/// `(a - b) / se`, 0 when both are equal and infinite (with a's side) when `se` is 0.
pub(crate) fn z_score(a: f64, b: f64, se: f64) -> f64 {
    let d = a - b;
    if d == 0.0 {
        0.0
    } else if se > 0.0 {
        d / se
    } else {
        f64::INFINITY.copysign(d)
    }
}
