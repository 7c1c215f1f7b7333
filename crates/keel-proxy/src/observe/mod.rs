//! Watching each request: the one record of a request ([`record`]) and the access log
//! ([`access_log`]). Counters and their Prometheus text are the ground floor's
//! (`crate::metrics`); the admin listener that shows them is the top floor's (`crate::admin`).

pub(crate) mod access_log;
pub(crate) mod record;
