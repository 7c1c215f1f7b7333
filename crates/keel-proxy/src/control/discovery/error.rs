//! Why discovery found no endpoints: the sources' one error type ([`DiscoveryError`]) and
//! what it is made of, each with its source error. Turned into text by the log and the admin.

use std::path::PathBuf;
use std::sync::Arc;

use hickory_resolver::ResolveError;

#[cfg(feature = "etcd")]
use crate::control::etcd::EtcdError;
use crate::upstream::discovered::RefreshError;

/// Why a source gave no endpoints this time (the last set stays). Stored, shared, in
/// [`crate::upstream::discovered::State::last_error`]; the admin and the log turn it into text.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DiscoveryError {
    /// No resolver could be made (a system resolver without a usable /etc/resolv.conf).
    #[error("cannot make a resolver: {0}")]
    Resolver(#[source] ResolveError),
    /// The name's lookup failed (NXDOMAIN, a timeout, the server's refusal).
    #[error(transparent)]
    Lookup(ResolveError),
    /// The address lookup of an SRV record's target failed.
    #[error("target {target}: {source}")]
    Target {
        /// The target's name.
        target: String,
        /// Why.
        #[source]
        source: ResolveError,
    },
    /// A file source could not be read or holds no valid endpoints.
    #[error(transparent)]
    File(#[from] FileSourceError),
    /// The task reading a file source failed (panicked or was cancelled).
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// etcd could not be read or watched.
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// An etcd source without the top-level `[etcd]`.
    #[cfg(feature = "etcd")]
    #[error("no [etcd] section")]
    NoEtcdSection,
    /// An etcd source in a keel built without etcd.
    #[cfg(not(feature = "etcd"))]
    #[error("this keel was built without etcd (cargo feature `etcd`)")]
    NoEtcdFeature,
}

impl DiscoveryError {
    /// As [`crate::upstream::discovered::Discovered::record`] keeps it.
    pub(crate) fn shared(self) -> RefreshError {
        Arc::new(self)
    }
}

/// Why a file source holds no endpoints.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FileSourceError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not `endpoints = [...]` in TOML.
    #[error(
        "{}: expected `endpoints = [{{ address = \"host:port\" }}, ...]`: {}",
        path.display(),
        source.message().trim()
    )]
    Syntax {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: toml::de::Error,
    },
    /// An endpoint of the file is refused.
    #[error("{}: {source}", path.display())]
    Endpoint {
        /// The file.
        path: PathBuf,
        /// Which endpoint, and why.
        #[source]
        source: EndpointError,
    },
}

/// A discovered endpoint that is refused (from a file or an etcd key).
#[derive(Debug, thiserror::Error)]
pub(crate) enum EndpointError {
    /// The address is not `host:port`.
    #[error("`{address}` is not an address; expected host:port")]
    NotAnAddress {
        /// The address given.
        address: String,
        /// Why it does not parse, when it does not (it may parse and lack a port).
        #[source]
        source: Option<hyper::http::uri::InvalidUri>,
    },
    /// A weight of 0.
    #[error("`{address}` has weight 0; at least 1")]
    ZeroWeight {
        /// The endpoint's address.
        address: String,
    },
    /// The same address twice.
    #[error("`{address}` is listed twice")]
    Duplicate {
        /// The address.
        address: String,
    },
}
