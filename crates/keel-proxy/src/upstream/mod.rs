//! What the proxy keeps per cluster and per endpoint for the legs: the cluster and its
//! balancer ([`cluster`]), connection pools ([`pool`]), active health checks ([`health`]) and
//! load probes ([`probe`]).

pub(crate) mod cluster;
pub(crate) mod grpc_health;
pub(crate) mod h2_conns;
pub(crate) mod health;
pub(crate) mod pool;
pub(crate) mod probe;
