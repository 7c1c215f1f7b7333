//! Watching the proxy: the one record of each request ([`record`]), counters and their
//! Prometheus text ([`metrics`]), the access log ([`access_log`]), recent history
//! ([`recent`]) and the admin listener ([`admin`]).

pub(crate) mod access_log;
pub(crate) mod admin;
pub(crate) mod log_budget;
pub(crate) mod metrics;
pub(crate) mod recent;
pub(crate) mod record;
