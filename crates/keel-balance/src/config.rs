//! Strategy names and options, and the balancer's whole configuration.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::outlier::OutlierConfig;
use crate::slow_start::SlowStartConfig;

/// Every strategy keel knows, by the kebab-case name used in config, CLI and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    /// Each endpoint in turn; weights ignored.
    RoundRobin,
    /// nginx's smooth weighted round-robin: weights 5,1,1 give `a a b a c a a`.
    WeightedRoundRobin,
    /// Uniform random choice; weights ignored.
    Random,
    /// Random choice with probability proportional to weight.
    WeightedRandom,
    /// Fewest calls in flight per unit of weight; ties broken at random (or by lowest index).
    LeastConnections,
    /// Power of two random choices: the less loaded of two random endpoints.
    LeastRequest,
    /// The source's minimum average response time: lowest latency EWMA.
    LeastTime,
    /// Peak-EWMA latency x (in flight + 1) over two random choices, with a failure penalty.
    PeakEwma,
    /// Consistent hashing on a ring of virtual nodes (ketama style).
    RingHash,
    /// Google's Maglev lookup table.
    Maglev,
    /// Highest random weight (rendezvous) hashing.
    Rendezvous,
}

impl StrategyKind {
    /// All strategies, in documentation order.
    pub const ALL: [StrategyKind; 11] = [
        StrategyKind::RoundRobin,
        StrategyKind::WeightedRoundRobin,
        StrategyKind::Random,
        StrategyKind::WeightedRandom,
        StrategyKind::LeastConnections,
        StrategyKind::LeastRequest,
        StrategyKind::LeastTime,
        StrategyKind::PeakEwma,
        StrategyKind::RingHash,
        StrategyKind::Maglev,
        StrategyKind::Rendezvous,
    ];

    /// The kebab-case name.
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::RoundRobin => "round-robin",
            StrategyKind::WeightedRoundRobin => "weighted-round-robin",
            StrategyKind::Random => "random",
            StrategyKind::WeightedRandom => "weighted-random",
            StrategyKind::LeastConnections => "least-connections",
            StrategyKind::LeastRequest => "least-request",
            StrategyKind::LeastTime => "least-time",
            StrategyKind::PeakEwma => "peak-ewma",
            StrategyKind::RingHash => "ring-hash",
            StrategyKind::Maglev => "maglev",
            StrategyKind::Rendezvous => "rendezvous",
        }
    }

    /// True for the strategies that map a hash key to an endpoint.
    pub fn is_hash(self) -> bool {
        matches!(
            self,
            StrategyKind::RingHash | StrategyKind::Maglev | StrategyKind::Rendezvous
        )
    }

    /// The names joined by ", ", for error messages.
    pub fn names() -> String {
        Self::ALL.map(|s| s.name()).join(", ")
    }
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown strategy name.
#[derive(Debug, Clone, thiserror::Error)]
#[error("unknown strategy `{0}`; allowed: {names}", names = StrategyKind::names())]
pub struct UnknownStrategy(pub String);

impl FromStr for StrategyKind {
    type Err = UnknownStrategy;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownStrategy(s.to_string()))
    }
}

/// How least-connections (and least-time) choose among equally good endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieBreak {
    /// Uniformly at random among the tied endpoints (the default, and the right choice).
    #[default]
    Random,
    /// The first tied endpoint in configuration order. Exists only to reproduce experiment E5:
    /// at low concurrency it sends nearly everything to one endpoint.
    LowestIndex,
}

/// Strategy options; each strategy reads the ones that concern it and ignores the rest.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct StrategyOptions {
    /// least-connections, least-time: tie-break. Default `random`.
    pub tie_break: TieBreak,
    /// least-request, peak-ewma: random candidates compared per pick. Default 2.
    pub choices: u32,
    /// least-time, peak-ewma: EWMA time constant (a sample's weight halves in about 0.7 x
    /// decay). Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub decay: Duration,
    /// peak-ewma: the latency assumed for an endpoint with no sample yet. Default 30 ms.
    #[serde(with = "crate::duration_serde")]
    pub default_rtt: Duration,
    /// peak-ewma: a failure counts as a call that took at least this long, so that an endpoint
    /// that fails fast does not look fast. Default 1 s.
    #[serde(with = "crate::duration_serde")]
    pub failure_penalty: Duration,
    /// ring-hash: virtual nodes per endpoint of mean weight, at most 65536. Default 160
    /// (ketama's 40 x 4).
    pub vnodes: u32,
    /// maglev: lookup table size, a prime larger than the endpoint count, at most
    /// 5000011. Default 65537.
    pub table_size: u64,
    /// Hash strategies: bounded loads; no endpoint takes more than ceil(c x mean load) calls in
    /// flight (Mirrokni et al.), overflow walks on to the next endpoint. Off unless set; 1.25 is
    /// the usual value.
    pub bounded_load: Option<f64>,
}

impl Default for StrategyOptions {
    fn default() -> Self {
        Self {
            tie_break: TieBreak::Random,
            choices: 2,
            decay: Duration::from_secs(10),
            default_rtt: Duration::from_millis(30),
            failure_penalty: Duration::from_secs(1),
            vnodes: 160,
            table_size: 65537,
            bounded_load: None,
        }
    }
}

/// Largest `vnodes`: the ring holds about `vnodes x endpoints` points (8 bytes each), so an
/// unbounded value could ask for more memory than there is (4 billion vnodes: 32 GiB per
/// endpoint) and abort the process that loads the configuration.
pub const MAX_VNODES: u32 = 65536;

/// Largest maglev `table_size` (a prime).
pub const MAX_TABLE_SIZE: u64 = 5_000_011;

/// Everything a [`crate::Balancer`] needs besides its endpoints.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalancerConfig {
    /// The strategy.
    pub strategy: StrategyKind,
    /// Its options.
    #[serde(flatten)]
    pub options: StrategyOptions,
    /// Passive outlier detection; off unless given.
    pub outlier_detection: Option<OutlierConfig>,
    /// When fewer than this percentage of endpoints are available (healthy and not ejected), the
    /// balancer ignores health and balances over all of them, as Envoy does: better some traffic
    /// to a maybe-bad endpoint than all of it to too few. `0` turns it off. Default 50.
    pub panic_threshold: f64,
    /// Slow start; off unless given.
    pub slow_start: Option<SlowStartConfig>,
    /// Seed of the balancer's random choices (fixed seed, repeatable run).
    pub seed: u64,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        Self::new(StrategyKind::RoundRobin)
    }
}

impl BalancerConfig {
    /// A configuration with default options and no protections.
    pub fn new(strategy: StrategyKind) -> Self {
        Self {
            strategy,
            options: StrategyOptions::default(),
            outlier_detection: None,
            panic_threshold: 50.0,
            slow_start: None,
            seed: 0x6b65_656c,
        }
    }

    /// Checks every range; the message names the option and what is allowed.
    pub fn validate(&self) -> Result<(), String> {
        let o = &self.options;
        if o.choices < 2 {
            return Err(format!("choices must be at least 2, got {}", o.choices));
        }
        if o.decay.is_zero() {
            return Err("decay must be greater than zero".into());
        }
        if o.vnodes == 0 || o.vnodes > MAX_VNODES {
            return Err(format!(
                "vnodes must be within 1..={MAX_VNODES}, got {}",
                o.vnodes
            ));
        }
        // The bound first: trial division of a huge prime would take seconds.
        if o.table_size > MAX_TABLE_SIZE || !crate::hash::is_prime(o.table_size) {
            return Err(format!(
                "table_size must be a prime of at most {MAX_TABLE_SIZE}, got {}",
                o.table_size
            ));
        }
        if let Some(c) = o.bounded_load {
            if c.is_nan() || c < 1.0 || !c.is_finite() {
                return Err(format!("bounded_load must be 1.0 or more, got {c}"));
            }
            if !self.strategy.is_hash() {
                return Err(format!(
                    "bounded_load applies to the hash strategies (ring-hash, maglev, rendezvous), not {}",
                    self.strategy
                ));
            }
        }
        if !(0.0..=100.0).contains(&self.panic_threshold) {
            return Err(format!(
                "panic_threshold must be within 0..=100, got {}",
                self.panic_threshold
            ));
        }
        if let Some(od) = &self.outlier_detection {
            od.validate()?;
        }
        if let Some(ss) = &self.slow_start {
            ss.validate()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in StrategyKind::ALL {
            assert_eq!(k.name().parse::<StrategyKind>().unwrap(), k);
        }
        let err = "fastest".parse::<StrategyKind>().unwrap_err().to_string();
        assert!(err.contains("fastest") && err.contains("maglev"), "{err}");
    }

    #[test]
    fn config_parses_from_toml_with_defaults() {
        let cfg: BalancerConfig = toml::from_str(
            r#"
            strategy = "maglev"
            bounded_load = 1.25
            [outlier_detection]
            consecutive_failures = 3
            base_ejection_time = "5s"
            "#,
        )
        .unwrap();
        assert_eq!(cfg.strategy, StrategyKind::Maglev);
        assert_eq!(cfg.options.bounded_load, Some(1.25));
        assert_eq!(cfg.options.table_size, 65537);
        let od = cfg.outlier_detection.unwrap();
        assert_eq!(od.base_ejection_time, Duration::from_secs(5));
        assert_eq!(od.max_ejection_percent, 10.0);
    }

    #[test]
    fn validation_names_the_option() {
        let mut cfg = BalancerConfig::new(StrategyKind::Random);
        cfg.options.bounded_load = Some(1.25);
        assert!(cfg.validate().unwrap_err().contains("bounded_load"));
        let mut cfg = BalancerConfig::new(StrategyKind::Maglev);
        cfg.options.table_size = 65536;
        assert!(cfg.validate().unwrap_err().contains("prime"));
    }

    /// Regression: `vnodes = 4000000000` was accepted, and building the ring then asked for
    /// tens of GiB and aborted the process (a reload could kill a running proxy).
    #[test]
    fn vnodes_are_bounded() {
        let mut cfg = BalancerConfig::new(StrategyKind::RingHash);
        cfg.options.vnodes = MAX_VNODES + 1;
        let err = cfg.validate().unwrap_err();
        assert!(err.starts_with("vnodes") && err.contains("65536"), "{err}");
        cfg.options.vnodes = u32::MAX;
        assert!(cfg.validate().is_err());
        cfg.options.vnodes = MAX_VNODES;
        let eps = [
            crate::EndpointSpec::new("10.0.0.1:80"),
            crate::EndpointSpec::new("10.0.0.2:80"),
        ];
        assert!(crate::Balancer::new(cfg, &eps).is_ok());
    }

    /// Regression: a huge prime `table_size` (2^63 - 25, the largest prime a TOML
    /// integer can hold) was refused only after seconds of trial division.
    #[test]
    fn a_huge_table_size_is_refused_at_once() {
        let mut cfg = BalancerConfig::new(StrategyKind::Maglev);
        cfg.options.table_size = (1u64 << 63) - 25;
        let start = std::time::Instant::now();
        let err = cfg.validate().unwrap_err();
        assert!(err.contains("table_size"), "{err}");
        // Trial division would take seconds; the bound check takes nanoseconds.
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        cfg.options.table_size = MAX_TABLE_SIZE;
        assert!(cfg.validate().is_ok());
    }
}
