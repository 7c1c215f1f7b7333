//! The control plane: what changes the routing while the proxy runs, never on a request's
//! path. Discovery finds endpoints; active health checks ([`health`], [`grpc_health`]) mark
//! them up and down; reloads ([`reload`]) rebuild the routing; [`load`] reads a
//! configuration file and checks the files it names. [`etcd`] (feature `etcd`) is the etcd client
//! that discovery, shared evidence and `keel register` use.

pub(crate) mod discovery;
pub(crate) mod escape;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
#[cfg(feature = "etcd")]
pub(crate) mod evidence;
pub(crate) mod grpc_health;
pub(crate) mod health;
pub(crate) mod health_error;
pub(crate) mod load;
pub(crate) mod reload;

/// Without etcd there is no evidence to exchange (the configuration check refuses `shared`).
#[cfg(not(feature = "etcd"))]
impl crate::state::Shared {
    pub(crate) fn restart_evidence(&self) {}
}
