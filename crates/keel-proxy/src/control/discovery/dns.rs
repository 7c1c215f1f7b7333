//! The DNS sources: the A and AAAA records of a name ([`Dns`]), through hickory-resolver with
//! its cache off, so that each refresh asks the server. (SRV records: [`super::srv`].)

use std::net::SocketAddr;
use std::time::Duration;

use hickory_resolver::config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::{ResolveError, TokioResolver};
use keel_balance::EndpointSpec;

use crate::control::discovery::error::DiscoveryError;
use crate::control::discovery::source::Source;

/// `{ dns = "NAME", port = N }`: each address of the name with `port`, weight 1.
pub(crate) struct Dns {
    pub(crate) resolver: TokioResolver,
    /// Absolute (no search domains).
    pub(crate) name: String,
    pub(crate) port: u16,
    pub(crate) every: Duration,
}

impl Source for Dns {
    fn every(&self) -> Duration {
        self.every
    }

    async fn look(
        &mut self,
        _last_failed: bool,
    ) -> Option<Result<Vec<EndpointSpec>, DiscoveryError>> {
        let ips = match self.resolver.lookup_ip(self.name.as_str()).await {
            Ok(ips) => ips,
            Err(e) => return Some(Err(DiscoveryError::Lookup(e))),
        };
        let mut set: Vec<EndpointSpec> = ips
            .iter()
            .map(|ip| EndpointSpec::new(SocketAddr::new(ip, self.port).to_string()))
            .collect();
        set.sort_by(|a, b| a.address.cmp(&b.address));
        set.dedup_by(|a, b| a.address == b.address);
        Some(Ok(set))
    }
}

/// A resolver asking `server` (the system's servers without one), without a cache, within
/// `refresh` for each query.
pub(crate) fn resolver(
    server: Option<SocketAddr>,
    refresh: Duration,
) -> Result<TokioResolver, ResolveError> {
    let mut builder = match server {
        Some(addr) => {
            let mut config = ResolverConfig::new();
            config.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
        }
        None => TokioResolver::builder_tokio()?,
    };
    let opts = builder.options_mut();
    opts.cache_size = 0;
    opts.positive_max_ttl = Some(Duration::ZERO);
    opts.negative_max_ttl = Some(Duration::ZERO);
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.use_hosts_file = ResolveHosts::Never;
    // A refresh should not outlast the next one.
    opts.timeout = refresh.min(Duration::from_secs(2));
    opts.attempts = 1;
    Ok(builder.build())
}

/// A name as an absolute one (no search domains).
pub(crate) fn absolute(name: &str) -> String {
    if name.ends_with('.') {
        name.to_string()
    } else {
        format!("{name}.")
    }
}

pub(crate) fn no_records(e: &ResolveError) -> bool {
    e.is_no_records_found()
}
