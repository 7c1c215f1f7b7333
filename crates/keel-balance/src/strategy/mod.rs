//! The strategies, one module per family behind one small trait, [`Strategy`]:
//!
//! - [`rotation`]: round-robin, weighted round-robin;
//! - [`random`]: random, weighted random;
//! - [`least_connections`]: fewest calls in flight per unit of weight;
//! - [`least_time`]: lowest latency estimate;
//! - [`two_choices`]: least-request and peak-EWMA (power of two choices, by load or by cost);
//! - [`hashing`]: ring-hash, Maglev, rendezvous, with or without bounded loads;
//! - [`prequal`]: the hot-cold rule over the load reports endpoints send back;
//! - [`orca_wrr`]: weighted round-robin on weights from the endpoints' ORCA reports;
//! - [`prefix_affinity`]: an inference prompt to the endpoint that likely caches its prefix,
//!   within a bound on load.
//!
//! Each reads endpoint state through a [`View`] that already knows which endpoints this pick
//! may choose (health, ejection, panic mode, retry avoidance) and what time it is.

use std::sync::Arc;

use crate::config::{StrategyKind, StrategyOptions};
use crate::endpoint::Endpoint;

mod api;
mod hashing;
mod least_connections;
mod least_time;
mod orca_wrr;
mod prefix_affinity;
pub(crate) mod prequal;
mod random;
mod rotation;
#[cfg(test)]
pub(crate) mod testing;
mod two_choices;
mod weights;

pub(crate) use api::{Call, Observation, Strategy, View};

/// Builds the strategy `kind` over `eps` (at a build, an update or a rebuild).
pub(crate) fn build(
    kind: StrategyKind,
    o: &StrategyOptions,
    eps: &[Arc<Endpoint>],
) -> Box<dyn Strategy> {
    match kind {
        StrategyKind::RoundRobin => Box::new(rotation::RoundRobin::new()),
        StrategyKind::WeightedRoundRobin => Box::new(rotation::WeightedRoundRobin::new(eps)),
        StrategyKind::Random => Box::new(random::Random),
        StrategyKind::WeightedRandom => Box::new(random::WeightedRandom::new(eps)),
        StrategyKind::LeastConnections => {
            Box::new(least_connections::LeastConnections::new(o.tie_break, eps))
        }
        StrategyKind::LeastRequest => Box::new(two_choices::TwoChoices::least_request(o, eps)),
        StrategyKind::LeastTime => Box::new(least_time::LeastTime::new(o, eps)),
        StrategyKind::PeakEwma => Box::new(two_choices::TwoChoices::peak_ewma(o, eps)),
        StrategyKind::RingHash | StrategyKind::Maglev | StrategyKind::Rendezvous => {
            Box::new(hashing::Hashed::new(kind, o, eps))
        }
        StrategyKind::Prequal => Box::new(prequal::Prequal::new(o, eps.len())),
        StrategyKind::OrcaWrr => Box::new(orca_wrr::OrcaWrr::new(o, eps.len())),
        StrategyKind::PrefixAffinity => Box::new(prefix_affinity::PrefixAffinity::new(o, eps)),
    }
}
