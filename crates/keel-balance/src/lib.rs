//! # keel-balance
//!
//! keel's load-balancing core: every strategy and protection, pure (no I/O, no threads, no
//! clock). The reliability simulator and the HTTP proxy are two drivers of the same API:
//!
//! ```
//! use std::time::Duration;
//! use keel_balance::{Balancer, BalancerConfig, EndpointSpec, Outcome, PickContext, StrategyKind};
//!
//! let endpoints: Vec<EndpointSpec> = ["10.0.0.1:80", "10.0.0.2:80"]
//!     .into_iter()
//!     .map(EndpointSpec::new)
//!     .collect();
//! let lb = Balancer::new(BalancerConfig::new(StrategyKind::LeastConnections), &endpoints).unwrap();
//! let now = Duration::from_millis(5); // the driver's clock, passed in
//! let pick = lb.pick(&PickContext::new(now)).expect("an endpoint");
//! // ... call pick.address() ...
//! lb.finish(pick, Outcome::Success, now + Duration::from_millis(10));
//! ```
//!
//! Time is always a `Duration` since an epoch the driver chooses (the proxy: process start; the
//! simulator: virtual time zero), which is what makes simulation and deterministic tests
//! possible.
//!
//! "The source" in these docs is the article keel starts from, *Common Load-Balancing
//! Strategies and Their Reliability Analysis in Distributed Systems* (docs/reliability.md).

#![warn(missing_docs)]

mod balancer;
mod config;
pub mod duration_serde;
mod endpoint;
mod field;
mod hash;
pub mod hedge;
mod load;
mod locality;
pub mod orca;
mod outlier;
pub mod prefix;
mod retry_budget;
mod rng;
mod slow_start;
mod strategy;
mod time;

pub use balancer::{Balancer, BuildError, Outcome, Pick, PickContext};
pub use config::{
    BalancerConfig, StrategyKind, StrategyOptions, TieBreak, UnknownStrategy, ZoneMode,
    ZoneRouting, ZoneSignal, DEFAULT_AFFINITY_BOUND, MAX_CACHE_BLOCKS,
};
pub use endpoint::{Endpoint, EndpointId, EndpointSpec, EndpointStatus};
pub use field::{FieldPath, InvalidField, PathSegment, Problem};
pub use hash::hash_key;
pub use hedge::{HedgeConfig, HedgeDelay, HedgeDelayError, Hedger};
pub use load::{
    LoadReport, ServerLoad, Ticket, Utilization, LATENCY_HEADER, LOAD_PATH, RIF_HEADER,
    SERVER_WINDOW,
};
pub use orca::{OrcaError, OrcaErrorKind, OrcaReport, ORCA_HEADER};
pub use outlier::{FailureRate, OutlierConfig, SharedEvidence, MAX_QUORUM};
pub use retry_budget::{RetryBudget, RetryBudgetConfig};
pub use rng::{mix64, SharedRng};
pub use slow_start::SlowStartConfig;
