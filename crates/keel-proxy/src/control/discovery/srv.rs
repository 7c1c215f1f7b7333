//! The SRV source (RFC 2782): each target of the lowest priority in use, with the record's
//! port and weight.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::TokioResolver;
use keel_balance::EndpointSpec;

use crate::control::discovery::dns::no_records;
use crate::control::discovery::error::DiscoveryError;
use crate::control::discovery::source::Source;

/// `{ srv = "_service._proto.name" }`.
pub(crate) struct Srv {
    pub(crate) resolver: TokioResolver,
    /// Absolute (no search domains).
    pub(crate) name: String,
    pub(crate) every: Duration,
}

impl Source for Srv {
    fn every(&self) -> Duration {
        self.every
    }

    async fn look(
        &mut self,
        _last_failed: bool,
    ) -> Option<Result<Vec<EndpointSpec>, DiscoveryError>> {
        Some(self.resolve().await)
    }
}

impl Srv {
    async fn resolve(&self) -> Result<Vec<EndpointSpec>, DiscoveryError> {
        let resolver = &self.resolver;
        let srv = resolver
            .srv_lookup(self.name.as_str())
            .await
            .map_err(DiscoveryError::Lookup)?;
        // RFC 2782: only the lowest priority value in use.
        let Some(lowest) = srv.iter().map(|r| r.priority()).min() else {
            return Ok(Vec::new());
        };
        // Weights add up when several records lead to one address.
        let mut weights: BTreeMap<String, u32> = BTreeMap::new();
        for r in srv.iter().filter(|r| r.priority() == lowest) {
            let ips = match resolver.lookup_ip(r.target().clone()).await {
                Ok(ips) => ips,
                // A target without an address is left out; any other failure fails the
                // refresh (the last set stays).
                Err(e) if no_records(&e) => continue,
                Err(source) => {
                    return Err(DiscoveryError::Target {
                        target: r.target().to_string(),
                        source,
                    })
                }
            };
            for ip in ips.iter() {
                // keel's weights start at 1: a weight of 0 counts as 1.
                let w = u32::from(r.weight()).max(1);
                *weights
                    .entry(SocketAddr::new(ip, r.port()).to_string())
                    .or_default() += w;
            }
        }
        Ok(weights
            .into_iter()
            .map(|(a, w)| EndpointSpec::new(a).with_weight(w))
            .collect())
    }
}
