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
//!
//! A `split` route then chooses its side: by the hash of its `split_by` key when the request
//! has one (the same key, the same side), else by a per-thread low-discrepancy sequence
//! (shares exact within a request or two over any run). A `mirror` samples its share the same
//! way. Neither takes a lock or allocates.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use crate::config::route::{compile_regex, SplitBy, ValueMatch, ValueTest};
use crate::config::{HostPattern, ListenerConfig, PathPattern, RouteConfig, MAX_RETRY_ATTEMPTS};
pub(crate) use crate::exchange::request::RouteRef;
use crate::metrics::{Registry, RouteMetrics};
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
    /// The route's counters for this cluster, and its mirror.
    pub route: Arc<RouteState>,
}

/// What a route keeps for each cluster it sends to, built at reload.
pub(crate) struct RouteState {
    /// Counted by each request's record (`keel_route_*`).
    pub metrics: Arc<RouteMetrics>,
    /// The route's `mirror` (one for all its sides).
    pub mirror: Option<Arc<Mirror>>,
    /// The route's label in metrics.
    pub label: Box<str>,
    /// A `models` route's table: the request's model chooses the target (see
    /// [`crate::forward`]); `None` for every other route.
    pub models: Option<Arc<Models>>,
}

/// A `models` route, compiled: each model's target among the route's clusters.
pub(crate) struct Models {
    /// One target per cluster of the route (the default's first, when there is one).
    targets: Box<[Target]>,
    /// Each model's target, by its name's bytes.
    by_name: Map<Box<[u8]>, u16>,
    /// The target of a request whose body names no model (the route's `cluster`).
    default: Option<u16>,
    /// The longest name listed: a longer `model` is none of them.
    longest: usize,
}

/// What a `models` route does with a request, by the `model` its body names.
pub(crate) enum ModelChoice<'m> {
    /// The target of the model named, or the default's of a body without one.
    Target(&'m Target),
    /// A model the route does not list.
    Unknown,
    /// No model named, and no default.
    Missing,
}

impl Models {
    /// The target of `model` (its JSON string's bytes, escapes decoded), or of a body
    /// without one (`None`).
    pub fn choose(&self, model: Option<&[u8]>) -> ModelChoice<'_> {
        let at = match model {
            Some(m) if m.len() <= self.longest => self.by_name.get(m).copied(),
            Some(_) => None,
            None => match self.default {
                Some(d) => Some(d),
                None => return ModelChoice::Missing,
            },
        };
        match at {
            Some(i) => ModelChoice::Target(&self.targets[usize::from(i)]),
            None => ModelChoice::Unknown,
        }
    }
}

/// A route's `mirror`, compiled: where copies go, and how many may be under way.
pub(crate) struct Mirror {
    /// The cluster the copies go to.
    pub cluster: Arc<Cluster>,
    /// The copy's limits: the mirror cluster's timeouts, no retry.
    pub limits: Limits,
    /// A request is copied when its sample is below this (of 2^64); `u64::MAX`: always.
    threshold: u64,
    /// The most copies under way.
    pub max_in_flight: u32,
    /// Copies under way.
    pub in_flight: AtomicU32,
}

impl Mirror {
    /// True if this request is to be copied: its share, on the thread's own sequence.
    pub fn sample(&self) -> bool {
        self.threshold == u64::MAX || weyl(&MIRROR_SEQ) < self.threshold
    }
}

thread_local! {
    /// Each thread's position in the sequence that places a `split` request without a key.
    static SPLIT_SEQ: Cell<u64> = const { Cell::new(0) };
    /// Each thread's position in the sequence that samples a `mirror`'s share.
    static MIRROR_SEQ: Cell<u64> = const { Cell::new(0) };
}

/// The next point of a thread's Weyl sequence `n * 2^64 / phi (mod 2^64)`: consecutive
/// points spread evenly over `0..2^64` (the fraction of any run that falls below `t` is within
/// a few requests of `t / 2^64`), with no lock and no shared counter.
fn weyl(seq: &'static std::thread::LocalKey<Cell<u64>>) -> u64 {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    seq.with(|n| {
        let v = n.get().wrapping_add(GOLDEN);
        n.set(v);
        v
    })
}

impl Target {
    fn new(
        cluster: Arc<Cluster>,
        route: Option<(usize, &RouteConfig)>,
        listener: &ListenerConfig,
        state: Arc<RouteState>,
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
            route: state,
        }
    }
}

/// A condition on a header's or a query parameter's value, compiled.
struct Condition {
    /// The header's name in lower case, or the query parameter's as written.
    name: Box<str>,
    test: Test,
    /// The condition holds when the test fails.
    not: bool,
}

enum Test {
    Exact(Box<[u8]>),
    Regex(regex::bytes::Regex),
    Present,
}

impl Condition {
    fn new(name: &str, m: &ValueMatch, lower: bool) -> anyhow::Result<Self> {
        let test = match &m.test {
            ValueTest::Exact(v) => Test::Exact(v.as_bytes().into()),
            ValueTest::Regex(r) => Test::Regex(compile_regex(r).map_err(anyhow::Error::msg)?),
            ValueTest::Present => Test::Present,
        };
        let name = if lower {
            name.to_ascii_lowercase()
        } else {
            name.to_string()
        };
        Ok(Condition {
            name: name.into(),
            test,
            not: m.not,
        })
    }

    fn test(&self, value: &[u8]) -> bool {
        match &self.test {
            Test::Exact(v) => value == &**v,
            Test::Regex(r) => r.is_match(value),
            Test::Present => true,
        }
    }

    /// The exact value an index may file the route under (a condition without `not`).
    fn exact(&self) -> Option<&[u8]> {
        match &self.test {
            Test::Exact(v) if !self.not => Some(v),
            _ => None,
        }
    }
}

/// The parameters of a query (`a=1&b&c=3`): name and value as sent (no value: empty).
fn query_pairs(query: &str) -> impl Iterator<Item = (&[u8], &[u8])> {
    query
        .as_bytes()
        .split(|b| *b == b'&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.iter().position(|b| *b == b'=') {
            Some(eq) => (&p[..eq], &p[eq + 1..]),
            None => (p, &b""[..]),
        })
}

/// The value of cookie `name` in a `Cookie` header's value.
fn cookie_in<'v>(value: &'v [u8], name: &str) -> Option<&'v [u8]> {
    value.split(|b| *b == b';').find_map(|pair| {
        let pair = pair.trim_ascii();
        let eq = pair.iter().position(|b| *b == b'=')?;
        (pair[..eq].trim_ascii() == name.as_bytes()).then(|| {
            let v = pair[eq + 1..].trim_ascii();
            v.strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(v)
        })
    })
}

/// A route's `split`, compiled: each side's upper bound on a point of `0..total`.
struct Split {
    bounds: Box<[u32]>,
    total: u32,
    by: Option<SplitBy>,
}

impl Split {
    /// The side of a request: by the hash of its key when it has one, else by the thread's
    /// sequence.
    fn side<'h, I>(&self, fields: &impl Fn() -> I) -> u8
    where
        I: Iterator<Item = (&'h str, &'h [u8])>,
    {
        let key = match &self.by {
            Some(SplitBy::Header(name)) => fields()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v),
            Some(SplitBy::Cookie(name)) => fields()
                .filter(|(n, _)| n.eq_ignore_ascii_case("cookie"))
                .find_map(|(_, v)| cookie_in(v, name)),
            None => None,
        };
        let x = match key {
            Some(k) => keel_balance::hash_key(k),
            None => weyl(&SPLIT_SEQ),
        };
        let point = ((u128::from(x) * u128::from(self.total)) >> 64) as u32;
        self.bounds.iter().position(|b| point < *b).unwrap_or(0) as u8
    }
}

/// One compiled route.
struct Route {
    path: PathPattern,
    path_regex: Option<regex::bytes::Regex>,
    methods: Box<[Box<str>]>,
    headers: Box<[Condition]>,
    query: Box<[Condition]>,
    /// Its cluster's target, or one per side of its `split`.
    targets: Box<[Target]>,
    split: Option<Split>,
}

impl Route {
    /// Path, methods, headers and query (the host was matched by the index).
    fn matches_rest<'h, I>(
        &self,
        method: &str,
        path: &str,
        query: &str,
        fields: &impl Fn() -> I,
    ) -> bool
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
            && self
                .path_regex
                .as_ref()
                .is_none_or(|r| r.is_match(path.as_bytes()))
            && self.headers.iter().all(|c| {
                let hit = fields().any(|(n, v)| n.eq_ignore_ascii_case(&c.name) && c.test(v));
                hit != c.not
            })
            && self.query.iter().all(|c| {
                let hit = query_pairs(query).any(|(n, v)| n == c.name.as_bytes() && c.test(v));
                hit != c.not
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

/// Routes in configuration order, those with a header or query condition that a request's
/// fields can look up filed under it.
#[derive(Default)]
struct Bucket {
    /// Routes without such a condition (or with one too long to index).
    plain: Vec<u16>,
    /// Routes by their first indexable condition, in this order: an exact header value
    /// (`h` lower-case name `\0` value), a header's presence (`p` lower-case name), an exact
    /// query parameter (`q` name `\0` value).
    by_key: Map<Box<[u8]>, Vec<u16>>,
    /// Which kinds of key `by_key` holds ([`KEY_HEADER`] ...), so a request looks up only those.
    kinds: u8,
}

const KEY_HEADER: u8 = 1;
const KEY_PRESENT: u8 = 2;
const KEY_QUERY: u8 = 4;

/// Writes an index key (`kind name [\0 value]`) into `key`; its length, or `None` if it is too
/// long to be in the index.
fn index_key(
    key: &mut [u8; MAX_HEADER_KEY],
    kind: u8,
    name: &[u8],
    value: Option<&[u8]>,
    lower: bool,
) -> Option<usize> {
    let len = 1 + name.len() + value.map_or(0, |v| 1 + v.len());
    if len > MAX_HEADER_KEY {
        return None;
    }
    key[0] = match kind {
        KEY_HEADER => b'h',
        KEY_PRESENT => b'p',
        _ => b'q',
    };
    for (k, b) in key[1..].iter_mut().zip(name) {
        *k = if lower { b.to_ascii_lowercase() } else { *b };
    }
    if let Some(v) = value {
        key[1 + name.len()] = 0;
        key[2 + name.len()..len].copy_from_slice(v);
    }
    Some(len)
}

impl Bucket {
    fn add(&mut self, route: &Route, index: u16) {
        let header = || {
            let c = route.headers.iter().find(|c| c.exact().is_some())?;
            Some((KEY_HEADER, &c.name, c.exact()))
        };
        let present = || {
            let c = route
                .headers
                .iter()
                .find(|c| matches!(c.test, Test::Present) && !c.not)?;
            Some((KEY_PRESENT, &c.name, None))
        };
        let query = || {
            let c = route.query.iter().find(|c| c.exact().is_some())?;
            Some((KEY_QUERY, &c.name, c.exact()))
        };
        let mut key = [0u8; MAX_HEADER_KEY];
        let filed = header()
            .or_else(present)
            .or_else(query)
            .and_then(|(kind, name, value)| {
                let len = index_key(&mut key, kind, name.as_bytes(), value, false)?;
                Some((kind, len))
            });
        match filed {
            Some((kind, len)) => {
                self.kinds |= kind;
                self.by_key
                    .entry(key[..len].into())
                    .or_default()
                    .push(index);
            }
            None => self.plain.push(index),
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
    fn add(&mut self, route: &Route, index: u16, regex: Option<&str>) {
        let segment = route
            .path
            .first_segment()
            .or_else(|| regex.and_then(regex_segment));
        let bucket = match segment {
            Some(seg) => self.by_segment.entry(seg.into()).or_default(),
            None => &mut self.rest,
        };
        bucket.add(route, index);
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
    /// validated: every name exists). Their counters come from `registry` (kept across
    /// reloads), under `listen` (the listener's configured address, which a reload that keeps
    /// the listener keeps).
    pub fn build(
        config: &ListenerConfig,
        cluster: impl Fn(&str) -> Option<Arc<Cluster>>,
        registry: &Registry,
        listen: &str,
    ) -> anyhow::Result<Self> {
        let find =
            |name: &str| cluster(name).ok_or_else(|| anyhow::anyhow!("no cluster named `{name}`"));
        let state = |label: &str, cluster: &Cluster, mirror: Option<Arc<Mirror>>| {
            Arc::new(RouteState {
                metrics: registry.route(listen, label, cluster.name()),
                mirror,
                label: label.into(),
                models: None,
            })
        };
        let mut table = ListenerRoutes {
            routes: Vec::with_capacity(config.routes.len()),
            exact: Map::default(),
            wildcard: Map::default(),
            any_host: Group::default(),
            listener: config
                .cluster
                .as_deref()
                .map(|name| {
                    find(name).map(|c| {
                        let s = state("default", &c, None);
                        Target::new(c, None, config, s)
                    })
                })
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
            let label = r.name.clone().unwrap_or_else(|| i.to_string());
            let mirror = match &r.mirror {
                None => None,
                Some(m) => {
                    let cluster = find(&m.cluster)?;
                    let share = m.percent / 100.0;
                    Some(Arc::new(Mirror {
                        limits: Limits::new(&cluster.config, None, Some(0)),
                        cluster,
                        threshold: if share >= 1.0 {
                            u64::MAX
                        } else {
                            (share * 18_446_744_073_709_551_616.0) as u64
                        },
                        max_in_flight: m.max_in_flight,
                        in_flight: AtomicU32::new(0),
                    }))
                }
            };
            // A redirect route without a cluster counts under the listener's (validated).
            let names: Vec<&str> = if !r.models.is_empty() {
                // The default first (the front ends write the head for side 0), then each
                // model's cluster once.
                let mut names: Vec<&str> = Vec::new();
                for n in r.clusters() {
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
                names
            } else if r.split.is_empty() {
                vec![match (r.cluster.as_str(), &config.cluster) {
                    ("", Some(listener)) => listener,
                    (name, _) => name,
                }]
            } else {
                r.split.iter().map(|a| a.cluster.as_str()).collect()
            };
            let targets = names
                .into_iter()
                .map(|name| {
                    let c = find(name)?;
                    let s = state(&label, &c, mirror.clone());
                    Ok(Target::new(c, Some((i, r)), config, s))
                })
                .collect::<anyhow::Result<Box<[Target]>>>()?;
            let targets = if r.models.is_empty() {
                targets
            } else {
                models_targets(r, targets)?
            };
            let split = (!r.split.is_empty()).then(|| {
                let mut sum = 0;
                Split {
                    bounds: r
                        .split
                        .iter()
                        .map(|a| {
                            sum += a.weight;
                            sum
                        })
                        .collect(),
                    total: r.split.iter().map(|a| a.weight).sum(),
                    by: r.split_by.clone(),
                }
            });
            let conditions = |map: &std::collections::BTreeMap<String, ValueMatch>, lower| {
                map.iter()
                    .map(|(k, v)| Condition::new(k, v, lower))
                    .collect::<anyhow::Result<Box<[Condition]>>>()
            };
            let route = Route {
                path,
                path_regex: r
                    .path_regex
                    .as_deref()
                    .map(compile_regex)
                    .transpose()
                    .map_err(anyhow::Error::msg)?,
                methods: r.methods.iter().map(|m| m.as_str().into()).collect(),
                headers: conditions(&r.headers, true)?,
                query: conditions(&r.query, false)?,
                targets,
                split,
            };
            group.add(&route, index, r.path_regex.as_deref());
            table.routes.push(route);
        }
        Ok(table)
    }

    /// Every target (its route's labels and counters are its `route`), for `/metrics`.
    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.listener
            .iter()
            .chain(self.routes.iter().flat_map(|r| r.targets.iter()))
    }

    /// The target of a route choice (`None` for [`RouteRef::NotFound`]).
    pub fn target(&self, r: RouteRef) -> Option<&Target> {
        match r {
            RouteRef::NotFound => None,
            RouteRef::Listener => self.listener.as_ref(),
            RouteRef::Route(i, side) => self
                .routes
                .get(usize::from(i))
                .and_then(|r| r.targets.get(usize::from(side))),
        }
    }

    /// Chooses the route of a request, and the side of its `split`. `path` is the target in
    /// origin form (its query is matched by `query` conditions only); `authority` is an absolute-form target's or HTTP/2's `:authority`,
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
        let (path, query) = path.split_once('?').unwrap_or((path, ""));
        // Matched as the endpoint will get it: dot segments resolved, `//` merged (borrowed
        // unless there is any). A path climbing above the root is matched as sent; the
        // request's rewrite refuses it.
        let normal = crate::exchange::rewrite::normal_path(path);
        let path = normal.as_deref().unwrap_or(path);
        let segment = request_segment(path);
        let mut best: Option<u16> = None;
        let routes = &self.routes[..];
        let consider_bucket = |bucket: &Bucket, best: &mut Option<u16>| {
            let at = (method, path, query);
            first_match(routes, &bucket.plain, at, &fields, best);
            if bucket.kinds == 0 {
                return;
            }
            let mut key = [0u8; MAX_HEADER_KEY];
            let mut look = |kind, name: &[u8], value, lower| {
                if bucket.kinds & kind == 0 {
                    return;
                }
                if let Some(len) = index_key(&mut key, kind, name, value, lower) {
                    if let Some(list) = bucket.by_key.get(&key[..len]) {
                        first_match(routes, list, at, &fields, best);
                    }
                }
            };
            for (name, value) in fields() {
                look(KEY_HEADER, name.as_bytes(), Some(value), true);
                look(KEY_PRESENT, name.as_bytes(), None, true);
            }
            for (name, value) in query_pairs(query) {
                look(KEY_QUERY, name, Some(value), false);
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
            Some(i) => {
                let side = self.routes[usize::from(i)]
                    .split
                    .as_ref()
                    .map_or(0, |s| s.side(&fields));
                RouteRef::Route(i, side)
            }
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

/// A `models` route's sides: its first target, whose route state holds the table the
/// request's model is looked up in, then the others; the table's targets are the plain ones.
fn models_targets(r: &RouteConfig, plain: Box<[Target]>) -> anyhow::Result<Box<[Target]>> {
    let index = |name: &str| {
        plain
            .iter()
            .position(|t| t.cluster.name() == name)
            .and_then(|i| u16::try_from(i).ok())
            .ok_or_else(|| anyhow::anyhow!("no cluster named `{name}`"))
    };
    let mut by_name = Map::default();
    for (model, cluster) in &r.models {
        by_name.insert(model.as_bytes().into(), index(cluster)?);
    }
    let default = (!r.cluster.is_empty())
        .then(|| index(&r.cluster))
        .transpose()?;
    let models = Models {
        longest: r.models.keys().map(String::len).max().unwrap_or(0),
        targets: plain.clone(),
        by_name,
        default,
    };
    let first = &plain[0];
    let entry = Target {
        route: Arc::new(RouteState {
            metrics: first.route.metrics.clone(),
            mirror: first.route.mirror.clone(),
            label: first.route.label.clone(),
            models: Some(Arc::new(models)),
        }),
        ..first.clone()
    };
    Ok(std::iter::once(entry)
        .chain(plain.iter().skip(1).cloned())
        .collect())
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
        let registry = Registry::default();
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
        let routes = ListenerRoutes::build(
            l,
            |name| clusters.iter().find(|c| c.name() == name).cloned(),
            &registry,
            &l.listen.to_string(),
        )?;
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
            RouteRef::Route(i, _) => Some(usize::from(i)),
            _ => None,
        }
    }

    /// The route a request takes and the cluster that serves it (the side of a `split`).
    pub fn choose_cluster(
        &self,
        method: &str,
        path: &str,
        authority: Option<&str>,
        headers: &[(&str, &[u8])],
    ) -> Option<(Option<usize>, &str)> {
        let r = self
            .routes
            .choose(method, path, authority, || headers.iter().copied());
        let t = self.routes.target(r)?;
        Some((r.index().map(usize::from), t.cluster.name()))
    }
}

/// The first route of `list` (in configuration order) that matches, if it comes before
/// `best`.
fn first_match<'h, I>(
    routes: &[Route],
    list: &[u16],
    (method, path, query): (&str, &str, &str),
    fields: &impl Fn() -> I,
    best: &mut Option<u16>,
) where
    I: Iterator<Item = (&'h str, &'h [u8])>,
{
    for &i in list {
        if best.is_some_and(|b| b <= i) {
            return;
        }
        if routes[usize::from(i)].matches_rest(method, path, query, fields) {
            *best = Some(i);
            return;
        }
    }
}

/// The first path segment of every path a `path_regex` matches, when the expression starts
/// with `^/` and a literal that goes past that segment (`^/users/[0-9]+$` -> `users`), so
/// that the index narrows such routes as it does prefixes. `None` when unsure: an alternation
/// anywhere, flags, or a quantifier on the literal's last character.
fn regex_segment(pattern: &str) -> Option<&str> {
    if pattern.contains('|') {
        return None;
    }
    let rest = pattern.strip_prefix("^/")?;
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || "-_~/:@!&=,;".contains(c)))
        .unwrap_or(rest.len());
    let mut literal = &rest[..end];
    if rest[end..].starts_with(['*', '+', '?', '{']) {
        // The quantifier applies to the literal's last character.
        literal = &literal[..literal.len().saturating_sub(1)];
    }
    literal.split_once('/').map(|(seg, _)| seg)
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

    #[test]
    fn anchored_regexes_with_a_literal_segment_are_indexed() {
        assert_eq!(regex_segment("^/users/[0-9]+$"), Some("users"));
        assert_eq!(regex_segment("^/api/v[0-9]+/"), Some("api"));
        assert_eq!(regex_segment("^/a/b?"), Some("a"));
        assert_eq!(regex_segment("^/ab?/"), None);
        assert_eq!(regex_segment("^/ab*/x"), None);
        assert_eq!(regex_segment("^/users$"), None);
        assert_eq!(regex_segment("/users/[0-9]+"), None);
        assert_eq!(regex_segment("^/a/x|^/b/y"), None);
        assert_eq!(regex_segment("(?i)^/a/"), None);
        assert_eq!(regex_segment("^/a.b/"), None);
    }
}
