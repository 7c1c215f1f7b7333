//! Service discovery: a cluster's endpoints found in DNS (A and AAAA records of a name, or the
//! SRV records of a service, RFC 2782) or in a file, and followed while the proxy runs.
//!
//! One task per cluster resolves its source every `refresh` (a file: looks at it every second
//! and reads it again when it changed). A new set is applied as a reload applies a cluster:
//! the cluster is rebuilt from the running one ([`crate::upstream::cluster::Cluster::build`], which
//! keeps the state of the endpoints that stay through `Balancer::rebuild`) and swapped in.
//! A resolver error, a timeout, NXDOMAIN or an empty answer keeps the last known set; it is
//! logged and counted (`keel_discovery_errors_total{cluster}`). A cluster whose source has not
//! answered yet has no endpoint: it answers `503` until one arrives. DNS goes through
//! hickory-resolver, with its cache off so that each refresh asks the server.
//!
//! Each kind of source is a [`source::Source`] of its own file: [`dns`], [`srv`], [`file`].
//! Adding one is a file here, a variant of `config::DiscoveryConfig`, and an arm in [`run`].
//! etcd (`etcd`, with the `etcd` feature) pushes its changes: it has a task of its own shape
//! (read, then watch) in its file rather than a `Source`.

mod dns;
mod error;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
mod file;
mod source;
mod srv;

use std::sync::Arc;

use keel_balance::{EndpointSpec, InvalidField, Problem};

use crate::config::discovery::DiscoveryConfig;
use crate::control::discovery::dns::{absolute, resolver, Dns};
pub(crate) use crate::control::discovery::error::DiscoveryError;
pub(crate) use crate::control::discovery::file::read_file;
use crate::control::discovery::file::File;
use crate::control::discovery::source::Source;
use crate::control::discovery::srv::Srv;

/// The discovery component's check of a source, the I/O part (the syntax is
/// [`DiscoveryConfig::validate`]'s): a file source reads and holds valid endpoints. Nothing is
/// resolved. Paths are relative to `discovery`.
pub(crate) fn check(config: &DiscoveryConfig) -> Result<(), InvalidField> {
    match config {
        DiscoveryConfig::File { path } => read_file(path)
            .map(drop)
            .map_err(|e| InvalidField::at("file", Problem::Invalid(e.to_string()))),
        DiscoveryConfig::Dns { .. } | DiscoveryConfig::Srv { .. } => Ok(()),
        #[cfg(feature = "etcd")]
        DiscoveryConfig::Etcd { .. } => Ok(()),
        #[cfg(not(feature = "etcd"))]
        DiscoveryConfig::Etcd { .. } => Err(InvalidField::at(
            "etcd",
            Problem::NotApplicable(
                "this keel was built without etcd (cargo feature `etcd`)".into(),
            ),
        )),
    }
}

pub(crate) use crate::upstream::discovered::Discovered;

/// Follows one cluster's source until aborted: each new set goes to `apply`. `etcd`: the
/// top-level `[etcd]`, for an etcd source.
pub(crate) async fn run(
    cluster: String,
    discovered: Arc<Discovered>,
    apply: impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    etcd: Option<crate::config::EtcdConfig>,
) {
    let config = &discovered.config;
    let every = config.refresh();
    let resolver = || match resolver(config.resolver(), every) {
        Ok(r) => Some(r),
        Err(e) => {
            // Only a system resolver without a usable /etc/resolv.conf gets here.
            discovered.record(&cluster, Err(DiscoveryError::Resolver(e).shared()));
            None
        }
    };
    match config {
        DiscoveryConfig::Dns { name, port, .. } => {
            let Some(resolver) = resolver() else { return };
            let dns = Dns {
                resolver,
                name: absolute(name),
                port: *port,
                every,
            };
            follow(&cluster, &discovered, &apply, dns).await
        }
        DiscoveryConfig::Srv { name, .. } => {
            let Some(resolver) = resolver() else { return };
            let srv = Srv {
                resolver,
                name: absolute(name),
                every,
            };
            follow(&cluster, &discovered, &apply, srv).await
        }
        DiscoveryConfig::File { path } => {
            let file = File::new(path.clone());
            follow(&cluster, &discovered, &apply, file).await
        }
        DiscoveryConfig::Etcd { prefix } => {
            #[cfg(feature = "etcd")]
            match &etcd {
                Some(e) => etcd::follow(&cluster, &discovered, &apply, e, prefix).await,
                None => {
                    discovered.record(&cluster, Err(DiscoveryError::NoEtcdSection.shared()));
                }
            }
            #[cfg(not(feature = "etcd"))]
            {
                let _ = (prefix, etcd);
                discovered.record(&cluster, Err(DiscoveryError::NoEtcdFeature.shared()));
            }
        }
    }
}

/// Asks `source` every [`Source::every`] (missed ticks delayed, not bunched) and records
/// each answer; a changed set goes to `apply`.
async fn follow<S: Source>(
    cluster: &str,
    discovered: &Arc<Discovered>,
    apply: &impl Fn(&str, &Arc<Discovered>, Vec<EndpointSpec>),
    mut source: S,
) {
    let mut ticker = tokio::time::interval(source.every());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let failed = discovered.state().last_error.is_some();
        let Some(result) = source.look(failed).await else {
            discovered.unchanged();
            continue;
        };
        if let Some(set) = discovered.record(cluster, result.map_err(DiscoveryError::shared)) {
            tracing::info!(
                cluster = %cluster,
                source = %discovered.config.describe(),
                endpoints = set.len(),
                "discovery: new endpoints"
            );
            apply(cluster, discovered, set);
        }
    }
}
