//! What the proxy keeps per cluster and per endpoint for the legs: the cluster and its
//! balancer ([`cluster`]), what discovery found for it ([`discovered`]), how its shared outlier
//! evidence is going ([`evidence`]), connection pools
//! ([`pool`], [`h2_conns`]), the HTTP/1.1 client the legs, health checks and probes share
//! ([`h1_client`]), load probes ([`probe`]) and engine signals ([`signals`]). Active health
//! checks, which run beside the requests and never on their path, are in `control/`.

pub(crate) mod cluster;
pub(crate) mod discovered;
// Without etcd nothing publishes or exchanges evidence.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) mod evidence;
pub(crate) mod h1_client;
pub(crate) mod h2_conns;
pub(crate) mod pool;
pub(crate) mod probe;
pub(crate) mod signals;
