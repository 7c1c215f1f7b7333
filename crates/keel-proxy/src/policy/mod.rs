//! What a route or a cluster does to a request besides choosing its endpoint: local rate
//! limits ([`rate`]), rewrites of requests and responses and redirects ([`rewrite`]). Compiled once per route target when the routing is built; a target with
//! nothing configured has no [`Policy`], so a request to it pays one `None` check.
//!
//! Applied in [`crate::forward::forward`], the one function both front ends hand requests to, on
//! the head already rewritten for the endpoint (HTTP/1.1 text for both front ends).

pub(crate) mod access;
pub(crate) mod budget;
pub(crate) mod compress;
pub(crate) mod inference;
pub(crate) mod meter;
pub(crate) mod rate;
pub(crate) mod rewrite;
pub(crate) mod sticky;

use std::sync::Arc;
use std::time::Instant;

use crate::config::{ClusterConfig, ListenerConfig, RouteConfig};
use crate::exchange::head::HeadView;
use crate::exchange::request::Client;
use access::{Access, AccessList, Refused};
use rate::{Limited, RateLimiter};
use rewrite::{RewriteSource, Rewrites};

/// A target's policy: everything its route and its cluster configure.
pub(crate) struct Policy {
    /// The listener's and the route's `allow`/`deny`, if either has them.
    access: Option<Access>,
    /// The route's limit, then the cluster's (shared by every route to the cluster).
    limits: Vec<Arc<RateLimiter>>,
    /// The route's and the cluster's rewrites, if any.
    pub(crate) rewrites: Option<Rewrites>,
    /// The responses' compression: the route's setting, else the cluster's.
    pub(crate) compression: Option<compress::Compression>,
    /// `$route`: the route's index in its listener (empty for the listener's `cluster`).
    pub(crate) route: Box<[u8]>,
}

impl Policy {
    /// The policy of `route` (with its index in `listener`) to the cluster configured by
    /// `cluster`, whose own limiter (`cluster_limit`, shared by every route to it and kept
    /// across reloads by the cluster) is taken after the route's; `workers` divides a
    /// `per_worker` limit. `None` when none of them configures anything.
    pub fn build(
        route: Option<(usize, &RouteConfig)>,
        cluster: &ClusterConfig,
        workers: usize,
        cluster_limit: Option<&Arc<RateLimiter>>,
        listener: &ListenerConfig,
    ) -> Option<Arc<Self>> {
        let access = Access::new(
            AccessList::new(&listener.allow, &listener.deny),
            route.and_then(|(_, r)| AccessList::new(&r.allow, &r.deny)),
        );
        let mut limits = Vec::new();
        if let Some((i, r)) = route {
            if let Some(l) = &r.policy.rate_limit {
                limits.push(Arc::new(RateLimiter::new(l, format!("route {i}"), workers)));
            }
        }
        limits.extend(cluster_limit.cloned());
        let c = cluster;
        let rewrites = Rewrites::new(
            route.map(|(_, r)| RewriteSource {
                strip_prefix: r.policy.strip_prefix.as_ref(),
                replace_prefix: r.policy.replace_prefix.as_ref(),
                host_rewrite: r.policy.host_rewrite.as_ref(),
                request_headers: r.policy.request_headers.as_ref(),
                response_headers: r.policy.response_headers.as_ref().map(|h| h.edits()),
                redirect: r.redirect.as_ref(),
                rewrite_location: r.policy.rewrite_location,
            }),
            RewriteSource {
                strip_prefix: c.policy.strip_prefix.as_ref(),
                replace_prefix: c.policy.replace_prefix.as_ref(),
                host_rewrite: c.policy.host_rewrite.as_ref(),
                request_headers: c.policy.request_headers.as_ref(),
                response_headers: c.policy.response_headers.as_ref().map(|h| h.edits()),
                redirect: None,
                rewrite_location: c.policy.rewrite_location,
            },
        );
        let compression = route
            .and_then(|(_, r)| r.policy.compression.as_ref())
            .or(c.policy.compression.as_ref())
            .and_then(compress::Compression::new);
        if limits.is_empty() && rewrites.is_none() && access.is_none() && compression.is_none() {
            return None;
        }
        let route = route.map_or_else(Vec::new, |(i, _)| i.to_string().into_bytes());
        Some(Arc::new(Policy {
            access,
            limits,
            rewrites,
            compression,
            route: route.into(),
        }))
    }

    /// Checks the client against the listener's and the route's `allow`/`deny`: the peer's
    /// address, or behind a trusted proxy the one it forwarded (as the rate limits take it).
    /// A forwarded entry that is not an address is refused.
    pub fn access(
        &self,
        client: &Client,
        head: HeadView<'_>,
    ) -> Result<(), (Refused, Option<std::net::IpAddr>)> {
        let Some(access) = &self.access else {
            return Ok(());
        };
        let forwarded = client
            .trust_forwarded
            .then(|| {
                head.value("x-forwarded-for")
                    .and_then(|v| proxied_client(v, client.trusted_hops))
            })
            .flatten();
        let ip = match forwarded {
            Some(text) => std::str::from_utf8(text)
                .ok()
                .and_then(|t| t.parse::<std::net::IpAddr>().ok())
                .map(|ip| ip.to_canonical()),
            None => Some(client.peer.ip()),
        };
        access.check(ip).map_err(|r| (r, ip))
    }

    /// Takes the request from each rate limit; the first that refuses it, with how long to
    /// wait. `head`: the request head for the endpoint.
    pub fn limit(
        &self,
        client: &Client,
        head: HeadView<'_>,
        now: Instant,
    ) -> Result<(), (&RateLimiter, Limited)> {
        for l in &self.limits {
            let ip;
            let key = if l.by_client_ip() {
                ip = ip_bytes(client);
                // Behind a trusted proxy, the client is the address that proxy added to
                // `X-Forwarded-For` (the one before keel's own entry, the proxy's), or with
                // `trusted_hops` the one the farthest trusted proxy added.
                let forwarded = client
                    .trust_forwarded
                    .then(|| {
                        head.value("x-forwarded-for")
                            .and_then(|v| proxied_client(v, client.trusted_hops))
                    })
                    .flatten();
                forwarded.or(Some(&ip.0[..ip.1]))
            } else {
                l.key_header().and_then(|name| head.value(name))
            };
            l.take(client.worker, key, now).map_err(|e| (&**l, e))?;
        }
        Ok(())
    }
}

/// The client in an `X-Forwarded-For` value whose last entry is keel's own (the peer): the
/// entry `hops` before it, as `hops` trusted proxies in a row wrote them, the nearest last;
/// the leftmost when there are fewer (all of them were written by trusted proxies). `None`
/// when keel's is the only entry, or the one chosen is empty.
fn proxied_client(xff: &[u8], hops: u8) -> Option<&[u8]> {
    let mut entries = xff.rsplit(|b| *b == b',');
    entries.next()?;
    entries
        .take(usize::from(hops.max(1)))
        .last()
        .map(<[u8]>::trim_ascii)
        .filter(|e| !e.is_empty())
}

/// The client's IP address as bytes (4 or 16 of them).
fn ip_bytes(client: &Client) -> ([u8; 16], usize) {
    let mut b = [0u8; 16];
    match client.peer.ip() {
        std::net::IpAddr::V4(ip) => {
            b[..4].copy_from_slice(&ip.octets());
            (b, 4)
        }
        std::net::IpAddr::V6(ip) => (ip.octets(), 16),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trusted_proxy_names_the_client_before_keels_entry() {
        assert_eq!(
            proxied_client(b"6.6.6.6, 1.2.3.4, 10.0.0.1", 1),
            Some(&b"1.2.3.4"[..])
        );
        assert_eq!(proxied_client(b"10.0.0.1", 1), None);
        assert_eq!(proxied_client(b" , 10.0.0.1", 1), None);
    }

    #[test]
    fn trusted_hops_count_proxies_from_the_nearest() {
        // A client's made-up entry, the client as the far proxy saw it, the far proxy as the
        // near one saw it; then keel's own entry, the near proxy.
        let xff = b"6.6.6.6, 203.0.113.9, 10.0.0.2, 10.0.0.1";
        assert_eq!(proxied_client(xff, 1), Some(&b"10.0.0.2"[..]));
        assert_eq!(proxied_client(xff, 2), Some(&b"203.0.113.9"[..]));
        assert_eq!(proxied_client(xff, 3), Some(&b"6.6.6.6"[..]));
        assert_eq!(
            proxied_client(xff, 9),
            Some(&b"6.6.6.6"[..]),
            "fewer entries than hops: the leftmost"
        );
        assert_eq!(proxied_client(b"10.0.0.1", 2), None);
    }
}
