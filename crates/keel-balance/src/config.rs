//! Strategy names and options, and the balancer's whole configuration.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::field::{FieldPath, InvalidField, Problem};
pub use crate::locality::{ZoneMode, ZoneRouting, ZoneSignal};
use crate::outlier::OutlierConfig;
use crate::slow_start::SlowStartConfig;

/// Every strategy keel knows, by the kebab-case name used in config, CLI and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    /// Each endpoint in turn; weights ignored.
    RoundRobin,
    /// Weighted round-robin, earliest deadline first (smooth: weights 5,1,1 give
    /// `a a a b c a a`), O(log n) per pick.
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
    /// Prequal: the hot-cold rule over a pool of recent load reports (requests in flight and
    /// latency) that the endpoints send back, probed after each pick; weights ignored (as in
    /// the paper: the servers' own load says what they can take).
    Prequal,
    /// Weighted round-robin on weights from the endpoints' ORCA reports (gRFC A58):
    /// `qps / (utilization + eps / qps x error_utilization_penalty)`.
    OrcaWrr,
    /// Inference pools: a prompt goes to the endpoint whose prefix cache likely holds most of
    /// its leading blocks (keel's estimate of each endpoint's cache), within bounded loads; a
    /// request without a prompt goes to the least loaded.
    PrefixAffinity,
}

impl StrategyKind {
    /// All strategies, in documentation order.
    pub const ALL: [StrategyKind; 14] = [
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
        StrategyKind::Prequal,
        StrategyKind::OrcaWrr,
        StrategyKind::PrefixAffinity,
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
            StrategyKind::Prequal => "prequal",
            StrategyKind::OrcaWrr => "orca-wrr",
            StrategyKind::PrefixAffinity => "prefix-affinity",
        }
    }

    /// True for the strategies that map a hash key to an endpoint.
    pub fn is_hash(self) -> bool {
        matches!(
            self,
            StrategyKind::RingHash | StrategyKind::Maglev | StrategyKind::Rendezvous
        )
    }

    /// False for the strategies that ignore endpoint weights (round-robin, random).
    pub fn uses_weights(self) -> bool {
        !matches!(self, StrategyKind::RoundRobin | StrategyKind::Random)
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
    /// least-time, peak-ewma: latency estimates within this fraction of each other count as
    /// equal, so that weights, not noise, decide between equally fast endpoints (least-time:
    /// within this fraction of the lowest; peak-ewma: of the other candidate's). Default 0.5.
    pub latency_tolerance: f64,
    /// least-time, peak-ewma: EWMA time constant (a sample's weight halves in about 0.7 x
    /// decay). Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub decay: Duration,
    /// peak-ewma: the latency assumed for an endpoint with no sample yet. Default 30 ms.
    #[serde(with = "crate::duration_serde")]
    pub default_rtt: Duration,
    /// peak-ewma: a failure counts as a call that took at least this long, so that an endpoint
    /// that fails fast does not look fast; prequal: after a failed call, the endpoint's load
    /// reports are dropped and ignored for this long. Default 1 s.
    #[serde(with = "crate::duration_serde")]
    pub failure_penalty: Duration,
    /// ring-hash: virtual nodes per endpoint of mean weight, at most 65536. Default 160
    /// (ketama's 40 x 4).
    pub vnodes: u32,
    /// maglev: lookup table size, a prime larger than the endpoint count, at most
    /// 5000011. Default 65537.
    pub table_size: u64,
    /// Hash strategies and prefix-affinity: bounded loads; no endpoint takes more than
    /// ceil(c x mean load) calls in flight (Mirrokni et al.), overflow walks on to the next
    /// endpoint. Hash strategies: off unless set; 1.25 is the usual value. prefix-affinity:
    /// always on, [`DEFAULT_AFFINITY_BOUND`] unless set.
    pub bounded_load: Option<f64>,
    /// prefix-affinity: the blocks keel's estimate of one endpoint's prefix cache holds (an
    /// LRU of block names), 1 to [`MAX_CACHE_BLOCKS`]. Default 96: the engine's 120 blocks of
    /// 16 tokens (`EngineSpec`'s default) x 0.8, because the engine spends blocks the estimate
    /// never sees (the running sequences' decoded tokens), and an estimate larger than the
    /// cache sends prompts to endpoints that evicted their prefix. Set it to the engine's
    /// block count (vLLM logs it as `# GPU blocks`) x 0.8.
    pub cache_blocks: u32,
    /// prequal: endpoints probed after each pick (the paper's r_probe), 1 to 16. Default 3.
    pub probes_per_pick: u32,
    /// prequal: load reports kept (the paper's pool size), 1 to 64. Default 16.
    pub pool_size: u32,
    /// prequal: a pooled report older than this is dropped. Default 1 s.
    #[serde(with = "crate::duration_serde")]
    pub max_probe_age: Duration,
    /// prequal: the worst pooled reports removed after each pick (the paper's r_remove), 0 to
    /// 16. Default 1.
    pub removes_per_pick: u32,
    /// prequal: a report whose requests in flight are above this quantile of the pool's is
    /// hot (the paper's Q_RIF), in (0, 1]. Default 0.84.
    pub q_rif: f64,
    /// orca-wrr: an endpoint's weight counts only once it has reported for this long (gRFC
    /// A58's `blackout_period`). Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub blackout_period: Duration,
    /// orca-wrr: a weight not refreshed by a report for this long expires. Default 3 min.
    #[serde(with = "crate::duration_serde")]
    pub weight_expiration_period: Duration,
    /// orca-wrr: how often the weights are recomputed, at least 100 ms. Default 1 s.
    #[serde(with = "crate::duration_serde")]
    pub weight_update_period: Duration,
    /// orca-wrr: the multiplier of the error rate `eps / qps` in the weight, 0 or more.
    /// Default 1.
    pub error_utilization_penalty: f64,
}

impl Default for StrategyOptions {
    fn default() -> Self {
        Self {
            tie_break: TieBreak::Random,
            choices: 2,
            latency_tolerance: 0.5,
            decay: Duration::from_secs(10),
            default_rtt: Duration::from_millis(30),
            failure_penalty: Duration::from_secs(1),
            vnodes: 160,
            table_size: 65537,
            bounded_load: None,
            probes_per_pick: 3,
            pool_size: 16,
            max_probe_age: Duration::from_secs(1),
            removes_per_pick: 1,
            q_rif: 0.84,
            blackout_period: Duration::from_secs(10),
            weight_expiration_period: Duration::from_secs(180),
            weight_update_period: Duration::from_secs(1),
            error_utilization_penalty: 1.0,
            cache_blocks: 96,
        }
    }
}

/// prefix-affinity's load bound when `bounded_load` is not set: an endpoint takes at most
/// ceil(1.25 x (calls in flight + 1) x its weight share).
pub const DEFAULT_AFFINITY_BOUND: f64 = 1.25;

/// Largest prefix-affinity `cache_blocks` (the estimate keeps about 40 bytes per block per
/// endpoint).
pub const MAX_CACHE_BLOCKS: u32 = 1 << 20;

/// Largest `vnodes`: the ring holds about `vnodes x endpoints` points (8 bytes each), so an
/// unbounded value could ask for more memory than there is (4 billion vnodes: 32 GiB per
/// endpoint) and abort the process that loads the configuration.
pub const MAX_VNODES: u32 = 65536;

/// Largest maglev `table_size` (a prime).
pub const MAX_TABLE_SIZE: u64 = 5_000_011;

/// Most reports a prequal pool may hold (`pool_size`'s upper bound).
pub(crate) const MAX_POOL: usize = 64;

/// Most prequal probes per pick and removals per pick (`probes_per_pick`, `removes_per_pick`).
pub(crate) const MAX_PER_PICK: u32 = 16;

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
    /// The balancer's own zone (the proxy's `zone`), for zone-aware routing.
    pub zone: Option<String>,
    /// Zone-aware routing among the endpoints' zones; off unless given (needs `zone`).
    pub zone_routing: Option<ZoneRouting>,
    /// Priority levels: a level's healthy share times this factor, capped at 100 %, is the
    /// share of traffic it keeps (Envoy's overprovisioning factor: a level takes everything
    /// while at least 1 / 1.4 = 71.4 % of its endpoints are healthy). At least 1. Default 1.4.
    pub overprovisioning_factor: f64,
    /// Cap on endpoints backed off at once because they asked (`Retry-After`, a gRPC
    /// pushback), as `max_ejection_percent` caps ejections: `max(1, floor(n x percent / 100))`
    /// of the n endpoints; a back-off beyond it is refused (`0`: none is ever backed off).
    /// One answer must not be able to move every request to the endpoints left. Default 10.
    pub max_backed_off_percent: f64,
    /// Longest one back-off lasts, whatever the endpoint asked. Default 10 s.
    #[serde(with = "crate::duration_serde")]
    pub max_back_off: Duration,
    /// Count what each endpoint reports waiting in its own queue
    /// ([`crate::Balancer::report_queue`]) in its load, while the report is at most this old:
    /// least-request and the bounded loads (prefix-affinity's spill, bounded hashing) then see a
    /// queue that other clients of the endpoint built. Off (`None`) unless the driver reads the
    /// endpoints' own signals (the proxy's `[cluster.engine_signals]` sets it to its `max_age`).
    #[serde(skip)]
    pub queue_max_age: Option<Duration>,
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
            zone: None,
            zone_routing: None,
            overprovisioning_factor: 1.4,
            max_backed_off_percent: 10.0,
            max_back_off: Duration::from_secs(10),
            queue_max_age: None,
        }
    }

    /// Checks every range; the error names the field (relative to this configuration, as its
    /// TOML key is spelled) and what is allowed.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let o = &self.options;
        let bad = |key, problem| Err(InvalidField::at(key, problem));
        if o.choices < 2 {
            return bad("choices", Problem::out_of_range("at least 2", o.choices));
        }
        if !(0.0..=10.0).contains(&o.latency_tolerance) {
            return bad(
                "latency_tolerance",
                Problem::out_of_range("within 0..=10", o.latency_tolerance),
            );
        }
        if o.decay.is_zero() {
            return bad("decay", Problem::out_of_range("greater than zero", "0s"));
        }
        if o.vnodes == 0 || o.vnodes > MAX_VNODES {
            return bad(
                "vnodes",
                Problem::out_of_range(format!("within 1..={MAX_VNODES}"), o.vnodes),
            );
        }
        // The bound first: trial division of a huge prime would take seconds.
        if o.table_size > MAX_TABLE_SIZE || !crate::hash::is_prime(o.table_size) {
            return bad(
                "table_size",
                Problem::out_of_range(format!("a prime of at most {MAX_TABLE_SIZE}"), o.table_size),
            );
        }
        if let Some(c) = o.bounded_load {
            if c.is_nan() || c < 1.0 || !c.is_finite() {
                return bad("bounded_load", Problem::out_of_range("1.0 or more", c));
            }
            if !self.strategy.is_hash() && self.strategy != StrategyKind::PrefixAffinity {
                return bad(
                    "bounded_load",
                    Problem::NotApplicable(format!(
                        "it is for the hash strategies (ring-hash, maglev, rendezvous) and \
                         prefix-affinity, not {}",
                        self.strategy
                    )),
                );
            }
        }
        if o.cache_blocks == 0 || o.cache_blocks > MAX_CACHE_BLOCKS {
            return bad(
                "cache_blocks",
                Problem::out_of_range(format!("within 1..={MAX_CACHE_BLOCKS}"), o.cache_blocks),
            );
        }
        let per_pick = MAX_PER_PICK;
        if o.probes_per_pick == 0 || o.probes_per_pick > per_pick {
            return bad(
                "probes_per_pick",
                Problem::out_of_range(format!("within 1..={per_pick}"), o.probes_per_pick),
            );
        }
        let max_pool = MAX_POOL;
        if o.pool_size == 0 || o.pool_size as usize > max_pool {
            return bad(
                "pool_size",
                Problem::out_of_range(format!("within 1..={max_pool}"), o.pool_size),
            );
        }
        if o.max_probe_age.is_zero() {
            return bad(
                "max_probe_age",
                Problem::out_of_range("greater than zero", "0s"),
            );
        }
        if o.removes_per_pick > per_pick {
            return bad(
                "removes_per_pick",
                Problem::out_of_range(format!("within 0..={per_pick}"), o.removes_per_pick),
            );
        }
        if !(o.q_rif > 0.0 && o.q_rif <= 1.0) {
            return bad("q_rif", Problem::out_of_range("within (0, 1]", o.q_rif));
        }
        if o.weight_update_period < Duration::from_millis(100) {
            return bad(
                "weight_update_period",
                Problem::out_of_range(
                    "at least 100ms",
                    humantime::format_duration(o.weight_update_period),
                ),
            );
        }
        if o.weight_expiration_period.is_zero() {
            return bad(
                "weight_expiration_period",
                Problem::out_of_range("greater than zero", "0s"),
            );
        }
        let p = o.error_utilization_penalty;
        if !(p.is_finite() && p >= 0.0) {
            return bad(
                "error_utilization_penalty",
                Problem::out_of_range("0 or more", p),
            );
        }
        if !(0.0..=100.0).contains(&self.panic_threshold) {
            return bad(
                "panic_threshold",
                Problem::out_of_range("within 0..=100", self.panic_threshold),
            );
        }
        if let Some(od) = &self.outlier_detection {
            od.validate()
                .map_err(|e| e.under(FieldPath::key("outlier_detection")))?;
        }
        if let Some(ss) = &self.slow_start {
            ss.validate()
                .map_err(|e| e.under(FieldPath::key("slow_start")))?;
        }
        if !(0.0..=100.0).contains(&self.max_backed_off_percent) {
            return bad(
                "max_backed_off_percent",
                Problem::out_of_range("within 0..=100", self.max_backed_off_percent),
            );
        }
        let f = self.overprovisioning_factor;
        if !(f.is_finite() && f >= 1.0) {
            return bad(
                "overprovisioning_factor",
                Problem::out_of_range("1.0 or more", f),
            );
        }
        if let Some(zr) = &self.zone_routing {
            if self.zone.is_none() {
                return bad(
                    "zone",
                    Problem::Invalid(
                        "zone-aware routing needs the balancer's own zone (the proxy's `zone`)"
                            .into(),
                    ),
                );
            }
            zr.validate()
                .map_err(|e| e.under(FieldPath::key("zone_routing")))?;
        }
        Ok(())
    }

    /// [`BalancerConfig::validate`], then what the endpoint list must satisfy for this
    /// configuration (what [`crate::Balancer::new`] checks); endpoint fields are named
    /// `endpoints[i].address` and `endpoints[i].weight`.
    pub fn validate_with(&self, endpoints: &[crate::EndpointSpec]) -> Result<(), InvalidField> {
        self.validate()?;
        check_endpoints(self, endpoints).map_err(|e| e.invalid_field())
    }
}

/// The endpoint rules of [`crate::Balancer::new`] and `update`.
pub(crate) fn check_endpoints(
    config: &BalancerConfig,
    endpoints: &[crate::EndpointSpec],
) -> Result<(), crate::BuildError> {
    use crate::BuildError;
    let mut seen = std::collections::HashSet::with_capacity(endpoints.len());
    for (index, e) in endpoints.iter().enumerate() {
        if !seen.insert(e.address.as_str()) {
            return Err(BuildError::DuplicateEndpoint {
                index,
                address: e.address.clone(),
            });
        }
        if e.weight == 0 {
            return Err(BuildError::ZeroWeight {
                index,
                address: e.address.clone(),
            });
        }
    }
    if config.strategy == StrategyKind::Maglev
        && endpoints.len() as u64 >= config.options.table_size
    {
        return Err(BuildError::TableTooSmall {
            size: config.options.table_size,
            count: endpoints.len(),
        });
    }
    if config.strategy == StrategyKind::RingHash
        && endpoints.len() > crate::hash::RING_MAX_ENDPOINTS
    {
        return Err(BuildError::TooManyEndpoints {
            strategy: config.strategy,
            max: crate::hash::RING_MAX_ENDPOINTS,
            count: endpoints.len(),
        });
    }
    Ok(())
}

impl crate::BuildError {
    /// The field at fault and what is wrong, relative to the configuration and its endpoint
    /// list (`choices`, `endpoints[2].weight`, `table_size`, ...).
    pub fn invalid_field(&self) -> InvalidField {
        use crate::BuildError::*;
        match self {
            Config(e) => e.clone(),
            DuplicateEndpoint { index, address } => InvalidField::new(
                FieldPath::key("endpoints").at(*index).then("address"),
                Problem::Duplicate(address.clone()),
            ),
            ZeroWeight { index, .. } => InvalidField::new(
                FieldPath::key("endpoints").at(*index).then("weight"),
                Problem::out_of_range("at least 1", 0),
            ),
            TooManyEndpoints {
                strategy,
                max,
                count,
            } => InvalidField::at(
                "endpoints",
                Problem::out_of_range(format!("at most {max} endpoints for {strategy}"), count),
            ),
            TableTooSmall { size, count } => InvalidField::at(
                "table_size",
                Problem::out_of_range(format!("larger than the endpoint count ({count})"), size),
            ),
        }
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

    /// Every option error names its field, relative to the configuration, and what is wrong.
    #[test]
    fn every_option_error_names_its_field() {
        use crate::{EndpointSpec, FailureRate, OutlierConfig, SlowStartConfig};
        let field = |cfg: &BalancerConfig, eps: &[EndpointSpec]| {
            cfg.validate_with(eps).unwrap_err().field.to_string()
        };
        let two = [EndpointSpec::new("a:1"), EndpointSpec::new("b:1")];
        let base = BalancerConfig::new(StrategyKind::RoundRobin);
        type Edit = fn(&mut BalancerConfig);
        let cases: Vec<(&str, Edit)> = vec![
            ("choices", |c| c.options.choices = 1),
            ("latency_tolerance", |c| c.options.latency_tolerance = -0.1),
            ("decay", |c| c.options.decay = Duration::ZERO),
            ("vnodes", |c| c.options.vnodes = 0),
            ("table_size", |c| c.options.table_size = 65536),
            ("bounded_load", |c| c.options.bounded_load = Some(1.25)),
            ("probes_per_pick", |c| c.options.probes_per_pick = 0),
            ("pool_size", |c| c.options.pool_size = 65),
            ("max_probe_age", |c| {
                c.options.max_probe_age = Duration::ZERO
            }),
            ("removes_per_pick", |c| c.options.removes_per_pick = 17),
            ("cache_blocks", |c| c.options.cache_blocks = 0),
            ("q_rif", |c| c.options.q_rif = 0.0),
            ("weight_update_period", |c| {
                c.options.weight_update_period = Duration::from_millis(50)
            }),
            ("weight_expiration_period", |c| {
                c.options.weight_expiration_period = Duration::ZERO
            }),
            ("error_utilization_penalty", |c| {
                c.options.error_utilization_penalty = -1.0
            }),
            ("overprovisioning_factor", |c| {
                c.overprovisioning_factor = 0.9
            }),
            ("panic_threshold", |c| c.panic_threshold = 101.0),
            ("outlier_detection.max_ejection_percent", |c| {
                c.outlier_detection = Some(OutlierConfig {
                    max_ejection_percent: 150.0,
                    ..OutlierConfig::default()
                })
            }),
            ("outlier_detection.interval", |c| {
                c.outlier_detection = Some(OutlierConfig {
                    interval: Duration::ZERO,
                    ..OutlierConfig::default()
                })
            }),
            ("outlier_detection.base_ejection_time", |c| {
                c.outlier_detection = Some(OutlierConfig {
                    base_ejection_time: Duration::ZERO,
                    ..OutlierConfig::default()
                })
            }),
            ("outlier_detection.max_ejection_time", |c| {
                c.outlier_detection = Some(OutlierConfig {
                    max_ejection_time: Duration::from_secs(1),
                    ..OutlierConfig::default()
                })
            }),
            ("outlier_detection.failure_rate.threshold_percent", |c| {
                c.outlier_detection = Some(OutlierConfig {
                    failure_rate: Some(FailureRate {
                        threshold_percent: 100.5,
                        ..FailureRate::default()
                    }),
                    ..OutlierConfig::default()
                })
            }),
            ("slow_start.window", |c| {
                c.slow_start = Some(SlowStartConfig {
                    window: Duration::ZERO,
                    ..SlowStartConfig::default()
                })
            }),
            ("slow_start.aggression", |c| {
                c.slow_start = Some(SlowStartConfig {
                    aggression: 0.0,
                    ..SlowStartConfig::default()
                })
            }),
            ("slow_start.min_weight_percent", |c| {
                c.slow_start = Some(SlowStartConfig {
                    min_weight_percent: -1.0,
                    ..SlowStartConfig::default()
                })
            }),
        ];
        for (want, edit) in &cases {
            let mut cfg = base.clone();
            edit(&mut cfg);
            assert_eq!(field(&cfg, &two), *want);
            // Balancer::new refuses it with the same field.
            let err = crate::Balancer::new(cfg, &two).unwrap_err();
            assert_eq!(err.invalid_field().field.to_string(), *want);
        }
        // The endpoint rules, at the endpoint's own key.
        let zero = [
            EndpointSpec::new("a:1"),
            EndpointSpec::new("b:1").with_weight(0),
        ];
        assert_eq!(field(&base, &zero), "endpoints[1].weight");
        let twice = [
            EndpointSpec::new("a:1"),
            EndpointSpec::new("b:1"),
            EndpointSpec::new("a:1"),
        ];
        assert_eq!(field(&base, &twice), "endpoints[2].address");
        let mut maglev = BalancerConfig::new(StrategyKind::Maglev);
        maglev.options.table_size = 2;
        assert_eq!(field(&maglev, &two), "table_size");
        let err = crate::Balancer::new(maglev, &two).unwrap_err();
        assert_eq!(err.invalid_field().field.to_string(), "table_size");
        // What the problem says.
        let mut cfg = base.clone();
        cfg.options.choices = 1;
        assert_eq!(
            cfg.validate().unwrap_err().to_string(),
            "choices: must be at least 2, got 1"
        );
        let mut cfg = BalancerConfig::new(StrategyKind::Random);
        cfg.options.bounded_load = Some(1.25);
        assert!(matches!(
            cfg.validate().unwrap_err().problem,
            Problem::NotApplicable(_)
        ));
    }

    /// Regression: `vnodes = 4000000000` was accepted, and building the ring then asked for
    /// tens of GiB and aborted the process (a reload could kill a running proxy).
    #[test]
    fn vnodes_are_bounded() {
        let mut cfg = BalancerConfig::new(StrategyKind::RingHash);
        cfg.options.vnodes = MAX_VNODES + 1;
        let err = cfg.validate().unwrap_err();
        assert_eq!(err.field, FieldPath::key("vnodes"));
        assert!(err.to_string().contains("65536"), "{err}");
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
        assert_eq!(err.field, FieldPath::key("table_size"), "{err}");
        // Trial division would take seconds; the bound check takes nanoseconds.
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        cfg.options.table_size = MAX_TABLE_SIZE;
        assert!(cfg.validate().is_ok());
    }
}
