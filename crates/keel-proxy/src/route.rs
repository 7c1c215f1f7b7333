//! Routes: which cluster serves a request. Each listener's `[[listener.route]]` entries are
//! tried in order and the first match wins; without a match the listener's own `cluster`
//! serves, and without one the answer is `404`.
//!
//! The routes are compiled when the configuration is loaded into a [`ListenerRoutes`] table.
//! Matching allocates nothing: the request's host is lower-cased into a stack buffer, and an
//! index narrows the routes to look at to those whose host condition can hold (a hash lookup
//! by exact host, one by each parent domain for `*.` wildcards, plus the routes without a
//! host condition) and, within those, whose path condition can hold (a lookup by the path's
//! first segment, plus the routes whose path condition does not fix one). Each candidate list
//! is in configuration order, so the first full match of each list is its best, and the
//! smallest index over the lists is the route (1,000 routes: see `benches/route.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{HostPattern, ListenerConfig, PathPattern, RouteConfig, MAX_RETRY_ATTEMPTS};
pub(crate) use crate::exchange::request::RouteRef;
use crate::policy::Policy;
use crate::upstream::cluster::Cluster;

/// How long a request may take and how often it may be tried again: its cluster's settings,
/// or a route's overrides of them (`request_timeout`, `retry_attempts`), computed once when
/// the configuration is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The whole request, all tries included.
    pub request_timeout: Duration,
    /// One try, until the response head.
    pub per_try_timeout: Duration,
    /// Retries after the first try.
    pub retry_attempts: u32,
}

impl Limits {
    /// The cluster's limits with a route's overrides: an explicit `per_try_timeout` stays (at
    /// most the request timeout), else the request timeout is shared by every allowed try.
    pub fn new(
        cluster: &crate::config::ClusterConfig,
        request_timeout: Option<Duration>,
        retry_attempts: Option<u32>,
    ) -> Self {
        let request_timeout = request_timeout.unwrap_or(cluster.timeouts.request);
        let retry_attempts = retry_attempts
            .unwrap_or(cluster.protections.retry.attempts)
            .min(MAX_RETRY_ATTEMPTS);
        let per_try_timeout = match cluster.protections.retry.per_try_timeout {
            Some(t) => t.min(request_timeout),
            None => request_timeout / (retry_attempts + 1),
        };
        Self {
            request_timeout,
            per_try_timeout,
            retry_attempts,
        }
    }
}

/// The longest host name that can match a host condition (a DNS name is at most 253 bytes).
const MAX_HOST: usize = 255;

/// Where a routed request goes: the cluster and the limits the attempt driver applies.
#[derive(Clone)]
pub(crate) struct Target {
    /// The cluster.
    pub cluster: Arc<Cluster>,
    /// Timeouts and retries: the cluster's, or the route's overrides.
    pub limits: Limits,
    /// What the route and the cluster do besides (rate limits); `None` when nothing.
    pub policy: Option<Arc<Policy>>,
}

impl Target {
    fn new(
        cluster: Arc<Cluster>,
        route: Option<(usize, &RouteConfig)>,
        listener: &ListenerConfig,
    ) -> Self {
        let limits = Limits::new(
            &cluster.config,
            route.and_then(|(_, r)| r.request_timeout),
            route.and_then(|(_, r)| r.retry_attempts),
        );
        let policy = Policy::build(
            route,
            &cluster.config,
            cluster.workers,
            cluster.rate_limit.as_ref(),
            listener,
        );
        Self {
            cluster,
            limits,
            policy,
        }
    }
}

/// A header condition: (lower-case name, exact value).
type HeaderCondition = (Box<str>, Box<[u8]>);

/// One compiled route.
struct Route {
    path: PathPattern,
    methods: Box<[Box<str>]>,
    headers: Box<[HeaderCondition]>,
    target: Target,
}

impl Route {
    /// Path, methods and headers (the host was matched by the index).
    fn matches_rest<'h, I>(&self, method: &str, path: &str, fields: &impl Fn() -> I) -> bool
    where
        I: Iterator<Item = (&'h str, &'h [u8])>,
    {
        let ok_path = match &self.path {
            PathPattern::Any => true,
            PathPattern::Exact(p) => path == &**p,
            PathPattern::Prefix(p) => path.starts_with(&**p),
        };
        ok_path
            && (self.methods.is_empty() || self.methods.iter().any(|m| &**m == method))
            && self.headers.iter().all(|(name, value)| {
                fields().any(|(n, v)| n.eq_ignore_ascii_case(name) && v == &**value)
            })
    }
}

/// A hasher for the index's keys (FxHash's multiply-rotate): the keys come from the
/// configuration and requests only look them up, so a keyed hash buys nothing here, and
/// SipHash would cost more than the rest of a lookup.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let word = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type Map<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<KeyHasher>>;

/// The longest header key (`name`, a 0 byte, `value`) the index holds; routes whose first
/// header condition is longer are kept with the routes it does not narrow.
const MAX_HEADER_KEY: usize = 256;

/// Routes in configuration order, those with a header condition by their first one's name
/// and value.
#[derive(Default)]
struct Bucket {
    /// Routes without a header condition (or with one too long to index).
    plain: Vec<u16>,
    /// Routes by their first header condition: `lower-case name \0 value`.
    by_header: Map<Box<[u8]>, Vec<u16>>,
}

impl Bucket {
    fn add(&mut self, headers: &[HeaderCondition], index: u16) {
        match headers.first() {
            Some((name, value)) if name.len() + 1 + value.len() <= MAX_HEADER_KEY => {
                let mut key = Vec::with_capacity(name.len() + 1 + value.len());
                key.extend_from_slice(name.as_bytes());
                key.push(0);
                key.extend_from_slice(value);
                self.by_header.entry(key.into()).or_default().push(index);
            }
            _ => self.plain.push(index),
        }
    }
}

/// Routes with the same host condition, by the first segment of their path condition.
#[derive(Default)]
struct Group {
    /// Routes whose path condition fixes the first segment (`/v1/...` or exactly `/v1`).
    by_segment: Map<Box<str>, Bucket>,
    /// The others (no path condition, or a prefix inside the first segment such as `/v`).
    rest: Bucket,
}

impl Group {
    fn add(&mut self, route: &Route, index: u16) {
        let bucket = match route.path.first_segment() {
            Some(seg) => self.by_segment.entry(seg.into()).or_default(),
            None => &mut self.rest,
        };
        bucket.add(&route.headers, index);
    }
}

/// A listener's routes, compiled.
pub(crate) struct ListenerRoutes {
    routes: Vec<Route>,
    /// Routes by exact host (lower case).
    exact: Map<Box<[u8]>, Group>,
    /// Wildcard routes (`*.example.test`) by the domain after `*.` (lower case).
    wildcard: Map<Box<[u8]>, Group>,
    /// Routes without a host condition.
    any_host: Group,
    /// The listener's `cluster`.
    listener: Option<Target>,
}

impl ListenerRoutes {
    /// A table that routes nothing (a removed listener whose connections have all ended).
    pub fn none() -> Self {
        ListenerRoutes {
            routes: Vec::new(),
            exact: Map::default(),
            wildcard: Map::default(),
            any_host: Group::default(),
            listener: None,
        }
    }

    /// Compiles a listener's routes; `cluster` finds a cluster by name (the configuration was
    /// validated: every name exists).
    pub fn build(
        config: &ListenerConfig,
        cluster: impl Fn(&str) -> Option<Arc<Cluster>>,
    ) -> anyhow::Result<Self> {
        let find =
            |name: &str| cluster(name).ok_or_else(|| anyhow::anyhow!("no cluster named `{name}`"));
        let mut table = ListenerRoutes {
            routes: Vec::with_capacity(config.routes.len()),
            exact: Map::default(),
            wildcard: Map::default(),
            any_host: Group::default(),
            listener: config
                .cluster
                .as_deref()
                .map(|name| find(name).map(|c| Target::new(c, None, config)))
                .transpose()?,
        };
        for (i, r) in config.routes.iter().enumerate() {
            let index =
                u16::try_from(i).map_err(|_| anyhow::anyhow!("more than {} routes", u16::MAX))?;
            let host = r.host_pattern();
            let path = r.path_pattern();
            let group = match &host {
                HostPattern::Any => &mut table.any_host,
                HostPattern::Exact(h) => table.exact.entry(h.as_bytes().into()).or_default(),
                HostPattern::Wildcard(d) => table.wildcard.entry(d.as_bytes().into()).or_default(),
            };
            let route = Route {
                path,
                methods: r.methods.iter().map(|m| m.as_str().into()).collect(),
                headers: r
                    .headers
                    .iter()
                    .map(|(k, v)| (k.to_ascii_lowercase().into(), v.as_bytes().into()))
                    .collect(),
                // A redirect route without a cluster counts under the listener's (validated).
                target: Target::new(
                    find(match (r.cluster.as_str(), &config.cluster) {
                        ("", Some(listener)) => listener,
                        (name, _) => name,
                    })?,
                    Some((i, r)),
                    config,
                ),
            };
            group.add(&route, index);
            table.routes.push(route);
        }
        Ok(table)
    }

    /// The target of a route choice (`None` for [`RouteRef::NotFound`]).
    pub fn target(&self, r: RouteRef) -> Option<&Target> {
        match r {
            RouteRef::NotFound => None,
            RouteRef::Listener => self.listener.as_ref(),
            RouteRef::Route(i) => self.routes.get(usize::from(i)).map(|r| &r.target),
        }
    }

    /// Chooses the route of a request. `path` is the target in origin form (a query is not
    /// part of the match); `authority` is an absolute-form target's or HTTP/2's `:authority`,
    /// which wins over the `Host` header among `fields` (RFC 9112 section 3.2.2).
    pub fn choose<'h, I>(
        &self,
        method: &str,
        path: &str,
        authority: Option<&str>,
        fields: impl Fn() -> I,
    ) -> RouteRef
    where
        I: Iterator<Item = (&'h str, &'h [u8])>,
    {
        if self.routes.is_empty() {
            return self.fallback();
        }
        let path = path.split_once('?').map_or(path, |(p, _)| p);
        // Matched as the endpoint will get it: dot segments resolved, `//` merged (borrowed
        // unless there is any). A path climbing above the root is matched as sent; the
        // request's rewrite refuses it.
        let normal = crate::exchange::rewrite::normal_path(path);
        let path = normal.as_deref().unwrap_or(path);
        let segment = request_segment(path);
        let mut best: Option<u16> = None;
        let routes = &self.routes[..];
        let consider_bucket = |bucket: &Bucket, best: &mut Option<u16>| {
            first_match(routes, &bucket.plain, method, path, &fields, best);
            if bucket.by_header.is_empty() {
                return;
            }
            let mut key = [0u8; MAX_HEADER_KEY];
            for (name, value) in fields() {
                let len = name.len() + 1 + value.len();
                if len > MAX_HEADER_KEY {
                    continue;
                }
                for (k, b) in key.iter_mut().zip(name.bytes()) {
                    *k = b.to_ascii_lowercase();
                }
                key[name.len()] = 0;
                key[name.len() + 1..len].copy_from_slice(value);
                if let Some(list) = bucket.by_header.get(&key[..len]) {
                    first_match(routes, list, method, path, &fields, best);
                }
            }
        };
        let mut consider = |group: &Group| {
            if let Some(b) = segment.and_then(|s| group.by_segment.get(s)) {
                consider_bucket(b, &mut best);
            }
            consider_bucket(&group.rest, &mut best);
        };
        if !self.exact.is_empty() || !self.wildcard.is_empty() {
            let mut buf = [0u8; MAX_HOST];
            let raw = authority.map(str::as_bytes).or_else(|| {
                fields()
                    .find(|(n, _)| n.eq_ignore_ascii_case("host"))
                    .map(|(_, v)| v)
            });
            if let Some(host) = raw.and_then(|h| normalize_host(h, &mut buf)) {
                if let Some(g) = self.exact.get(host) {
                    consider(g);
                }
                if !self.wildcard.is_empty() {
                    // Every parent domain, with at least one label in place of `*`.
                    for (i, _) in host.iter().enumerate().filter(|(_, b)| **b == b'.') {
                        if let Some(g) = self.wildcard.get(&host[i + 1..]) {
                            consider(g);
                        }
                    }
                }
            }
        }
        consider(&self.any_host);
        match best {
            Some(i) => RouteRef::Route(i),
            None => self.fallback(),
        }
    }

    fn fallback(&self) -> RouteRef {
        if self.listener.is_some() {
            RouteRef::Listener
        } else {
            RouteRef::NotFound
        }
    }
}

/// A listener's routes built from a configuration outside a running proxy, for benchmarks and
/// tools: the same table and the same matching as the front ends'.
pub struct RouteMatcher {
    routes: ListenerRoutes,
}

impl RouteMatcher {
    /// The routes of listener `listener` of a validated configuration (its clusters are built
    /// as a proxy builds them).
    pub fn new(config: &crate::ProxyConfig, listener: usize) -> anyhow::Result<Self> {
        let registry = crate::metrics::Registry::default();
        let epoch = std::time::Instant::now();
        let clusters = config
            .clusters
            .iter()
            .map(|c| Cluster::build(c.clone(), None, &registry, epoch, 1).map(Arc::new))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let l = config
            .listeners
            .get(listener)
            .ok_or_else(|| anyhow::anyhow!("no listener[{listener}]"))?;
        let routes = ListenerRoutes::build(l, |name| {
            clusters.iter().find(|c| c.name() == name).cloned()
        })?;
        Ok(Self { routes })
    }

    /// The index of the route a request takes (`None`: the listener's cluster, or `404`).
    /// `headers` are the request's header fields; `authority` an absolute target's.
    pub fn choose(
        &self,
        method: &str,
        path: &str,
        authority: Option<&str>,
        headers: &[(&str, &[u8])],
    ) -> Option<usize> {
        match self
            .routes
            .choose(method, path, authority, || headers.iter().copied())
        {
            RouteRef::Route(i) => Some(usize::from(i)),
            _ => None,
        }
    }
}

/// The first route of `list` (in configuration order) that matches, if it comes before
/// `best`.
fn first_match<'h, I>(
    routes: &[Route],
    list: &[u16],
    method: &str,
    path: &str,
    fields: &impl Fn() -> I,
    best: &mut Option<u16>,
) where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    for &i in list {
        if best.is_some_and(|b| b <= i) {
            return;
        }
        if routes[usize::from(i)].matches_rest(method, path, fields) {
            *best = Some(i);
            return;
        }
    }
}

/// The first segment of a request path (`/v1/users` -> `v1`); `None` for `*`.
fn request_segment(path: &str) -> Option<&str> {
    let rest = path.strip_prefix('/')?;
    Some(rest.split_once('/').map_or(rest, |(s, _)| s))
}

/// The host of a `Host` value or an authority, lower-cased into `buf`: without the port and
/// without a final dot. `None` if it is too long to match any host condition.
fn normalize_host<'b>(raw: &[u8], buf: &'b mut [u8; MAX_HOST]) -> Option<&'b [u8]> {
    let raw = raw.trim_ascii();
    let host = if raw.first() == Some(&b'[') {
        // An IPv6 literal: up to its closing bracket.
        let end = raw.iter().position(|b| *b == b']')?;
        &raw[..=end]
    } else {
        let end = raw.iter().position(|b| *b == b':').unwrap_or(raw.len());
        &raw[..end]
    };
    let host = host.strip_suffix(b".").unwrap_or(host);
    if host.len() > MAX_HOST {
        return None;
    }
    let out = &mut buf[..host.len()];
    for (o, b) in out.iter_mut().zip(host) {
        *o = b.to_ascii_lowercase();
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_lose_their_port_and_case() {
        let mut buf = [0u8; MAX_HOST];
        assert_eq!(
            normalize_host(b"API.Example.test:8080", &mut buf),
            Some(&b"api.example.test"[..])
        );
        assert_eq!(normalize_host(b"[::1]:80", &mut buf), Some(&b"[::1]"[..]));
        assert_eq!(
            normalize_host(b"a.example.test.", &mut buf),
            Some(&b"a.example.test"[..])
        );
        assert_eq!(normalize_host(&[b'a'; 300], &mut buf), None);
        assert_eq!(request_segment("/v1/users"), Some("v1"));
        assert_eq!(request_segment("/v1"), Some("v1"));
        assert_eq!(request_segment("/"), Some(""));
        assert_eq!(request_segment("*"), None);
    }
}
