//! The vocabulary every experiment is written in: how long a healthy server takes to answer a
//! call ([`Latency`]) and how a failed server fails ([`FailureMode`]).
//!
//! The simulator's scenarios, the testbed's backend and the lab's cases all hold these values,
//! so that one experiment's simulated and measured settings are one value, not two descriptions
//! of it. Each failure mode below says what a caller sees; the simulator and the backend each
//! implement exactly that:
//!
//! | mode | what a call to a failed server comes to |
//! | --- | --- |
//! | `none` | it is answered like a healthy server's |
//! | `hang` | never answered: the caller's timeout ends it |
//! | `fail-fast { after }` | an error (HTTP 503) after `after`; `0s`: at once |
//! | `server-error { after }` | an HTTP 500 after `after`; `0s`: at once (a proxy retries a 503 by default, a 500 not) |
//! | `refuse` | the connection is refused at once (the backend closes its port) |
//! | `reset` | the answer starts after the usual latency and is cut by a TCP reset [`RESET_CUT`] later |
//! | `slow { factor }` | answered correctly, `factor` times slower (a failure only past the timeout) |
//! | `error { probability }` | answered in the usual time, with an error with this probability |
//! | `flap { up, down, down_fails_after }` | healthy for `up`, then failing for `down`, and again: while down it hangs, or answers an error after `down_fails_after` |
//!
//! A flap starts up when the backend's fault is set; the simulator gives each failed server a
//! random phase, so that they do not all flap in step.

use std::fmt;
use std::time::Duration;

use keel_balance::{FieldPath, InvalidField, Problem};
use rand::Rng;
use rand_distr::{Exp1, StandardNormal};
use serde::{Deserialize, Serialize};

/// How long the `reset` failure lets the start of an answer travel before it resets the
/// connection (so that the caller has the headers and half of the body when the reset comes).
pub const RESET_CUT: Duration = Duration::from_millis(20);

/// A healthy server's service time: a distribution and its mean.
///
/// In TOML: `{ dist = "fixed" | "exponential" | "lognormal", mean = "10ms", sigma = 0.5 }`
/// (`sigma` for `lognormal` only, default 0.5; `dist` default `fixed`, `mean` default 10 ms).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(try_from = "LatencyTable", into = "LatencyTable")]
pub struct Latency {
    /// The mean.
    pub mean: Duration,
    /// The shape around it.
    pub dist: LatencyDist,
}

/// The shape of a service-time distribution.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum LatencyDist {
    /// Always the mean.
    #[default]
    Fixed,
    /// Exponential with that mean.
    Exponential,
    /// Log-normal with that mean; `sigma` is the standard deviation of the logarithm (1.0 is a
    /// heavy tail: the 99th percentile is about 4.5 times the mean).
    LogNormal {
        /// Standard deviation of the underlying normal (>= 0).
        sigma: f64,
    },
}

/// The `sigma` a log-normal latency gets when TOML does not say.
pub const DEFAULT_SIGMA: f64 = 0.5;

impl Default for Latency {
    /// Fixed 10 ms, the healthy service time of the reliability model's example.
    fn default() -> Self {
        Latency::fixed(Duration::from_millis(10))
    }
}

impl Latency {
    /// Always exactly `mean`.
    pub fn fixed(mean: Duration) -> Self {
        Latency {
            mean,
            dist: LatencyDist::Fixed,
        }
    }

    /// Checks the shape's parameter (any mean is allowed here: a backend may answer at once).
    /// The field is relative to the latency (`sigma`).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if let LatencyDist::LogNormal { sigma } = self.dist {
            if !(sigma.is_finite() && sigma >= 0.0) {
                return Err(InvalidField {
                    field: FieldPath::key("sigma"),
                    problem: Problem::out_of_range("a number >= 0", sigma),
                });
            }
        }
        Ok(())
    }

    /// A sampler with its parameters worked out once, for drawing many values.
    pub fn sampler(&self) -> LatencySampler {
        let mean = self.mean.as_secs_f64();
        let shape = match self.dist {
            LatencyDist::Fixed => Shape::Fixed,
            LatencyDist::Exponential => Shape::Exponential,
            // mu such that E[exp(mu + sigma Z)] = mean.
            LatencyDist::LogNormal { sigma } if mean > 0.0 => Shape::LogNormal {
                mu: mean.ln() - sigma * sigma / 2.0,
                sigma,
            },
            LatencyDist::LogNormal { .. } => Shape::Fixed,
        };
        LatencySampler { mean, shape }
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mean = humantime::format_duration(self.mean);
        match self.dist {
            LatencyDist::Fixed => write!(f, "{mean} fixed"),
            LatencyDist::Exponential => write!(f, "{mean} mean, exponential"),
            LatencyDist::LogNormal { sigma } => write!(f, "{mean} mean, log-normal sigma {sigma}"),
        }
    }
}

/// Draws latencies of one [`Latency`]; see [`LatencySampler::sample_secs`].
#[derive(Debug, Clone, Copy)]
pub struct LatencySampler {
    mean: f64,
    shape: Shape,
}

#[derive(Debug, Clone, Copy)]
enum Shape {
    Fixed,
    Exponential,
    LogNormal { mu: f64, sigma: f64 },
}

impl LatencySampler {
    /// One latency in seconds, drawn from `rng`: nothing for fixed, one exponential draw, or
    /// one standard normal for log-normal (rand_distr's ziggurat samplers). The caller chooses
    /// the random source: the simulator its seeded generator, the backend its per-backend
    /// stream.
    #[inline]
    pub fn sample_secs<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        match self.shape {
            Shape::Fixed => self.mean,
            Shape::Exponential => self.mean * rng.sample::<f64, _>(Exp1),
            Shape::LogNormal { mu, sigma } => {
                (mu + sigma * rng.sample::<f64, _>(StandardNormal)).exp()
            }
        }
    }
}

/// The TOML form of [`Latency`].
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct LatencyTable {
    #[serde(default)]
    dist: DistName,
    #[serde(default = "default_mean", with = "humantime_serde")]
    mean: Duration,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sigma: Option<f64>,
}

#[derive(Deserialize, Serialize, Default, PartialEq)]
#[serde(rename_all = "kebab-case")]
enum DistName {
    #[default]
    Fixed,
    Exponential,
    Lognormal,
}

fn default_mean() -> Duration {
    Latency::default().mean
}

/// A latency table that gives `sigma` with a `dist` other than `lognormal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("`sigma` applies to dist = \"lognormal\" only, not dist = \"{dist}\"")]
pub struct SigmaNotApplicable {
    /// The table's `dist`.
    pub dist: &'static str,
}

impl TryFrom<LatencyTable> for Latency {
    type Error = SigmaNotApplicable;
    fn try_from(t: LatencyTable) -> Result<Self, SigmaNotApplicable> {
        let dist = match (t.dist, t.sigma) {
            (DistName::Lognormal, sigma) => LatencyDist::LogNormal {
                sigma: sigma.unwrap_or(DEFAULT_SIGMA),
            },
            (DistName::Fixed, Some(_)) => return Err(SigmaNotApplicable { dist: "fixed" }),
            (DistName::Exponential, Some(_)) => {
                return Err(SigmaNotApplicable {
                    dist: "exponential",
                })
            }
            (DistName::Fixed, None) => LatencyDist::Fixed,
            (DistName::Exponential, None) => LatencyDist::Exponential,
        };
        Ok(Latency { mean: t.mean, dist })
    }
}

impl From<Latency> for LatencyTable {
    fn from(l: Latency) -> Self {
        let (dist, sigma) = match l.dist {
            LatencyDist::Fixed => (DistName::Fixed, None),
            LatencyDist::Exponential => (DistName::Exponential, None),
            LatencyDist::LogNormal { sigma } => (DistName::Lognormal, Some(sigma)),
        };
        LatencyTable {
            dist,
            mean: l.mean,
            sigma,
        }
    }
}

/// How a failed server fails. The [module docs](self) say what a caller sees in each mode.
///
/// In TOML: `{ mode = "hang" }`, `{ mode = "fail-fast", after = "1ms" }`,
/// `{ mode = "slow", factor = 50 }`, `{ mode = "error", probability = 0.5 }`,
/// `{ mode = "flap", up = "5s", down = "5s", down_fails_after = "1ms" }`, ...
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize, Serialize)]
#[serde(tag = "mode", rename_all = "kebab-case", deny_unknown_fields)]
pub enum FailureMode {
    /// Not failed: answers like a healthy server.
    #[default]
    None,
    /// Never answers: the caller's timeout ends the call.
    Hang,
    /// Answers an error after `after` (`0s`: at once).
    FailFast {
        /// Delay before the error.
        #[serde(with = "humantime_serde")]
        after: Duration,
    },
    /// Answers HTTP 500 (Internal Server Error) after `after` (`0s`: at once): what a crashed
    /// handler or a broken dependency sends. To a balancer it is a fast failure like
    /// `fail-fast`'s 503, but proxies do not retry a 500 by default (keel, NGINX, HAProxy), so
    /// only counting it as the endpoint's failure protects the calls after it.
    ServerError {
        /// Delay before the error.
        #[serde(with = "humantime_serde")]
        after: Duration,
    },
    /// Refuses connections: the call fails at once.
    Refuse,
    /// Starts the answer after the usual latency and resets the connection [`RESET_CUT`] later.
    Reset,
    /// Answers correctly but `factor` times slower (a failure only past the caller's timeout).
    Slow {
        /// Slow-down factor (>= 1).
        factor: f64,
    },
    /// Answers in the usual time, with an error with this probability.
    Error {
        /// Error probability in `[0, 1]`.
        probability: f64,
    },
    /// Alternates `up` (healthy) and `down`; while down it hangs, or answers an error after
    /// `down_fails_after` if given.
    Flap {
        /// Time up.
        #[serde(with = "humantime_serde")]
        up: Duration,
        /// Time down.
        #[serde(with = "humantime_serde")]
        down: Duration,
        /// While down, answer an error after this delay instead of hanging.
        #[serde(
            default,
            with = "humantime_serde",
            skip_serializing_if = "Option::is_none"
        )]
        down_fails_after: Option<Duration>,
    },
}

impl FailureMode {
    /// An error at once: `fail-fast` with `after = 0s`.
    pub const FAIL_AT_ONCE: FailureMode = FailureMode::FailFast {
        after: Duration::ZERO,
    };

    /// An HTTP 500 at once: `server-error` with `after = 0s`.
    pub const SERVER_ERROR_AT_ONCE: FailureMode = FailureMode::ServerError {
        after: Duration::ZERO,
    };

    /// Every mode's name, for help texts and error messages.
    pub const NAMES: [&'static str; 9] = [
        "none",
        "hang",
        "fail-fast",
        "server-error",
        "refuse",
        "reset",
        "slow",
        "error",
        "flap",
    ];

    /// The mode's kebab-case name (its `mode = ...` in TOML).
    pub fn name(&self) -> &'static str {
        match self {
            FailureMode::None => "none",
            FailureMode::Hang => "hang",
            FailureMode::FailFast { .. } => "fail-fast",
            FailureMode::ServerError { .. } => "server-error",
            FailureMode::Refuse => "refuse",
            FailureMode::Reset => "reset",
            FailureMode::Slow { .. } => "slow",
            FailureMode::Error { .. } => "error",
            FailureMode::Flap { .. } => "flap",
        }
    }

    /// Checks the mode's parameters; the error names the one out of range (relative to the
    /// mode: `factor`, `probability`, `up`, `down`).
    pub fn validate(&self) -> Result<(), InvalidField> {
        let (key, problem) = match self {
            FailureMode::Slow { factor } if !(factor.is_finite() && *factor >= 1.0) => {
                ("factor", Problem::out_of_range("1 or more", factor))
            }
            FailureMode::Error { probability } if !(0.0..=1.0).contains(probability) => (
                "probability",
                Problem::out_of_range("within 0..=1", probability),
            ),
            FailureMode::Flap { up, .. } if up.is_zero() => {
                ("up", Problem::out_of_range("greater than zero", "0s"))
            }
            FailureMode::Flap { down, .. } if down.is_zero() => {
                ("down", Problem::out_of_range("greater than zero", "0s"))
            }
            _ => return Ok(()),
        };
        Err(InvalidField {
            field: FieldPath::key(key),
            problem,
        })
    }

    /// How long a call to a failed server holds its caller before the caller sees the failure,
    /// when the mode fixes it (the model's t_fail): hang, fail-fast, server-error, refuse, reset.
    /// `timeout` is the caller's, which also caps the others; `mean` is the healthy mean
    /// latency.
    pub fn failure_time(&self, timeout: Duration, mean: Duration) -> Option<Duration> {
        let t = match self {
            FailureMode::Hang => timeout,
            FailureMode::FailFast { after } | FailureMode::ServerError { after } => *after,
            FailureMode::Refuse => Duration::ZERO,
            FailureMode::Reset => mean + RESET_CUT,
            _ => return None,
        };
        Some(t.min(timeout))
    }
}

impl fmt::Display for FailureMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = humantime::format_duration;
        match self {
            FailureMode::FailFast { after } if after.is_zero() => {
                f.write_str("fail-fast (at once)")
            }
            FailureMode::FailFast { after } => write!(f, "fail-fast after {}", d(*after)),
            FailureMode::ServerError { after } if after.is_zero() => {
                f.write_str("server-error 500 (at once)")
            }
            FailureMode::ServerError { after } => {
                write!(f, "server-error 500 after {}", d(*after))
            }
            FailureMode::Slow { factor } => write!(f, "slow x{factor}"),
            FailureMode::Error { probability } => write!(f, "error p={probability}"),
            FailureMode::Flap {
                up,
                down,
                down_fails_after,
            } => {
                write!(f, "flap {}/{} (", d(*up), d(*down))?;
                match down_fails_after {
                    None => f.write_str("hang when down)"),
                    Some(t) => write!(f, "error after {} when down)", d(*t)),
                }
            }
            other => f.write_str(other.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(latency: Latency, n: usize, seed: u64) -> Vec<f64> {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let s = latency.sampler();
        (0..n).map(|_| s.sample_secs(&mut rng)).collect()
    }

    #[test]
    fn every_shape_has_its_mean() {
        let mean = Duration::from_millis(10);
        for dist in [
            LatencyDist::Fixed,
            LatencyDist::Exponential,
            LatencyDist::LogNormal { sigma: 0.5 },
        ] {
            let n = 200_000;
            let avg = draws(Latency { mean, dist }, n, 42).iter().sum::<f64>() / n as f64;
            // The standard deviation is at most 10 ms here (exponential), so the standard
            // error of the mean is at most 22 us; 5 of them is 0.11 ms.
            assert!((avg - 0.010).abs() < 0.000_11, "{dist:?}: mean {avg}");
        }
    }

    #[test]
    fn exponential_median_is_mean_ln2_and_lognormal_median_is_exp_mu() {
        let mean = Duration::from_millis(10);
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let m = median(draws(
            Latency {
                mean,
                dist: LatencyDist::Exponential,
            },
            100_001,
            7,
        ));
        assert!((m - 0.010 * std::f64::consts::LN_2).abs() < 0.000_1, "{m}");
        // Log-normal: median exp(mu) = mean exp(-sigma^2 / 2) = 10 ms x 0.6065 for sigma 1.
        let m = median(draws(
            Latency {
                mean,
                dist: LatencyDist::LogNormal { sigma: 1.0 },
            },
            100_001,
            8,
        ));
        assert!((m - 0.010 * (-0.5f64).exp()).abs() < 0.000_15, "{m}");
    }

    #[test]
    fn toml_forms_round_trip() {
        #[derive(Deserialize, Serialize, PartialEq, Debug)]
        struct Doc {
            latency: Latency,
            failure: FailureMode,
        }
        let doc: Doc = toml::from_str(
            "latency = { dist = \"lognormal\", mean = \"5ms\" }\n\
             failure = { mode = \"flap\", up = \"5s\", down = \"1s\" }\n",
        )
        .unwrap();
        assert_eq!(
            doc.latency,
            Latency {
                mean: Duration::from_millis(5),
                dist: LatencyDist::LogNormal {
                    sigma: DEFAULT_SIGMA
                }
            }
        );
        assert_eq!(
            doc.failure,
            FailureMode::Flap {
                up: Duration::from_secs(5),
                down: Duration::from_secs(1),
                down_fails_after: None
            }
        );
        let back: Doc = toml::from_str(&toml::to_string(&doc).unwrap()).unwrap();
        assert_eq!(back, doc);
        let defaults: Latency = toml::from_str("").unwrap();
        assert_eq!(defaults, Latency::default());
        let err = toml::from_str::<Latency>("dist = \"fixed\"\nsigma = 1.0\n").unwrap_err();
        assert!(err.to_string().contains("lognormal"), "{err}");
        for name in FailureMode::NAMES {
            let text = match name {
                "fail-fast" => "mode = \"fail-fast\"\nafter = \"0s\"".to_string(),
                "server-error" => "mode = \"server-error\"\nafter = \"0s\"".to_string(),
                "slow" => "mode = \"slow\"\nfactor = 2.0".to_string(),
                "error" => "mode = \"error\"\nprobability = 0.5".to_string(),
                "flap" => "mode = \"flap\"\nup = \"1s\"\ndown = \"1s\"".to_string(),
                other => format!("mode = \"{other}\""),
            };
            let mode: FailureMode = toml::from_str(&text).unwrap();
            assert_eq!(mode.name(), name);
        }
    }

    #[test]
    fn failure_time_is_the_models_t_fail() {
        let timeout = Duration::from_millis(400);
        let mean = Duration::from_millis(4);
        let t = |m: FailureMode| m.failure_time(timeout, mean);
        assert_eq!(t(FailureMode::Hang), Some(timeout));
        assert_eq!(t(FailureMode::FAIL_AT_ONCE), Some(Duration::ZERO));
        assert_eq!(t(FailureMode::SERVER_ERROR_AT_ONCE), Some(Duration::ZERO));
        assert_eq!(t(FailureMode::Refuse), Some(Duration::ZERO));
        assert_eq!(t(FailureMode::Reset), Some(mean + RESET_CUT));
        assert_eq!(
            t(FailureMode::FailFast {
                after: Duration::from_secs(3)
            }),
            Some(timeout)
        );
        assert_eq!(t(FailureMode::Slow { factor: 2.0 }), None);
    }

    #[test]
    fn validation_names_the_parameter() {
        let field = |m: FailureMode| m.validate().unwrap_err().field.to_string();
        assert_eq!(field(FailureMode::Slow { factor: 0.5 }), "factor");
        assert_eq!(
            FailureMode::Error { probability: 1.5 }
                .validate()
                .unwrap_err()
                .to_string(),
            "probability: must be within 0..=1, got 1.5"
        );
        let flap = |up, down| FailureMode::Flap {
            up: Duration::from_secs(up),
            down: Duration::from_secs(down),
            down_fails_after: None,
        };
        assert_eq!(field(flap(0, 1)), "up");
        assert_eq!(field(flap(1, 0)), "down");
        assert!(flap(1, 1).validate().is_ok());
        let bad = Latency {
            mean: Duration::from_millis(1),
            dist: LatencyDist::LogNormal { sigma: -1.0 },
        };
        assert_eq!(bad.validate().unwrap_err().field.to_string(), "sigma");
    }
}
