//! Property tests of configuration loading.
//!
//! 1. Random configurations with every option inside its documented range always load, and
//!    the loaded values are the ones written.
//! 2. One out-of-range or ill-typed value put into such a configuration is always refused with
//!    a `ConfigError` whose `key` is the path of the value changed and whose `line` is that
//!    value's line; never a panic, never a silent acceptance. (A weight of 0, a duplicated
//!    endpoint, a maglev table no larger than the endpoint count and
//!    `failure_rate.threshold_percent` were once located at an enclosing key;
//!    `formerly_coarse_errors_name_the_exact_key` runs those four alone.)
//! 3. (Ignored, fails today) durations too long for the clock are refused.
//!
//! The generated configurations include routes (`[[listener.route]]`), DNS discovery (`dns` or
//! `srv` in place of `endpoints`) and `[access_log]`, and the mutations cover their errors.
//!
//! The documents are built as sections of `key = value` lines, so the test knows the line of
//! every key it writes.

use std::collections::BTreeMap;
use std::time::Duration;

use keel_balance::{StrategyKind, TieBreak};
use keel_proxy::config::{AccessLogFormat, DiscoveryConfig, HashOn};
use keel_proxy::{ConfigError, ProxyConfig};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// A document as sections of lines, and where each key lands.

/// One `[table]` (or the top level) and its `key = value` lines.
#[derive(Debug, Clone)]
struct Section {
    /// `[[cluster]]`, `[cluster.retry]`, ... (None: the top level).
    header: Option<String>,
    /// The key path of the table, as `ConfigError::key` spells it (`cluster[1].retry`).
    path: String,
    entries: Vec<(String, String)>,
}

impl Section {
    fn new(header: Option<&str>, path: &str) -> Self {
        Section {
            header: header.map(str::to_string),
            path: path.to_string(),
            entries: Vec::new(),
        }
    }
    fn set(&mut self, key: &str, value: impl Into<String>) {
        let value = value.into();
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = value,
            None => self.entries.push((key.to_string(), value)),
        }
    }
}

#[derive(Debug, Clone)]
struct Doc {
    sections: Vec<Section>,
}

impl Doc {
    /// The TOML text, and the 1-based line of every key path (and of every table header).
    /// A multi-line `endpoints` array has one endpoint per line: `endpoints[j]` maps there.
    fn render(&self) -> (String, BTreeMap<String, usize>) {
        let mut text = String::new();
        let mut lines = BTreeMap::new();
        let mut line = 1;
        for s in &self.sections {
            if let Some(h) = &s.header {
                lines.insert(s.path.clone(), line);
                text.push_str(h);
                text.push('\n');
                line += 1;
            }
            for (k, v) in &s.entries {
                let path = if s.path.is_empty() {
                    k.clone()
                } else {
                    format!("{}.{k}", s.path)
                };
                if k == "endpoints" {
                    for j in 0..v.matches('\n').count().saturating_sub(1) {
                        lines.insert(format!("{path}[{j}]"), line + 1 + j);
                    }
                }
                lines.insert(path, line);
                text.push_str(&format!("{k} = {v}\n"));
                line += 1 + v.matches('\n').count();
            }
            text.push('\n');
            line += 1;
        }
        (text, lines)
    }

    fn section(&mut self, path: &str) -> &mut Section {
        self.sections
            .iter_mut()
            .find(|s| s.path == path)
            .unwrap_or_else(|| panic!("no section {path}"))
    }
}

fn q(s: &str) -> String {
    format!("{s:?}")
}

fn ms(n: u64) -> String {
    q(&format!("{n}ms"))
}

// ---------------------------------------------------------------------------------------------
// Valid configurations.

#[derive(Debug, Clone)]
struct ListenerSpec {
    port: u16,
    cluster: usize,
    max_connections: usize,
    max_header_bytes: usize,
    max_headers: usize,
    header_read_timeout_ms: u64,
    idle_timeout_ms: u64,
    max_request_body_bytes: Option<u64>,
    routes: Vec<RouteSpec>,
}

/// `[[listener.route]]`.
#[derive(Debug, Clone)]
struct RouteSpec {
    /// (wildcard, name): `*.name` or `name`.
    host: Option<(bool, String)>,
    /// (exact, path): `path` or `path_prefix`.
    path: Option<(bool, String)>,
    methods: Vec<String>,
    headers: BTreeMap<String, String>,
    cluster: usize,
    request_timeout_ms: Option<u64>,
    retry_attempts: Option<u32>,
}

/// A cluster's `discovery` by DNS (a file source needs a file: the integration tests).
#[derive(Debug, Clone)]
struct DiscoverySpec {
    /// SRV (`_http._tcp.` + name), else A/AAAA with `port`.
    srv: bool,
    name: String,
    port: u16,
    resolver_port: Option<u16>,
    refresh_ms: Option<u64>,
}

/// `[access_log]`.
#[derive(Debug, Clone)]
struct AccessLogSpec {
    path: String,
    /// None: the default (json).
    combined: Option<bool>,
}

#[derive(Debug, Clone)]
struct RetrySpec {
    attempts: u32,
    /// Per-try timeout as a share (per mille) of the request timeout.
    per_try_permille: Option<u64>,
    retry_on_status: Vec<u16>,
    budget_percent_cents: u32,
    min_retries_per_second: u32,
    budget_window_ms: u64,
}

#[derive(Debug, Clone)]
struct HealthSpec {
    path: String,
    interval_ms: u64,
    timeout_ms: u64,
    unhealthy_threshold: u32,
    healthy_threshold: u32,
}

#[derive(Debug, Clone)]
struct OutlierSpec {
    consecutive_failures: u32,
    interval_ms: u64,
    base_ejection_ms: u64,
    extra_max_ejection_ms: u64,
    max_ejection_percent: u32,
    failure_rate: Option<(u32, u32)>,
}

#[derive(Debug, Clone)]
struct SlowStartSpec {
    window_ms: u64,
    aggression_quarters: u32,
    min_weight_percent: u32,
}

#[derive(Debug, Clone)]
struct ClusterSpec {
    name: String,
    strategy: StrategyKind,
    /// (port, weight) of each endpoint; the host is 10.0.<cluster>.<index>.
    endpoints: Vec<(u16, u32)>,
    lowest_index: bool,
    choices: u32,
    decay_ms: u64,
    default_rtt_ms: u64,
    failure_penalty_ms: u64,
    vnodes: u32,
    table_size: u64,
    /// Hundredths above 1.0 (hash strategies only).
    bounded_load_cents: Option<u32>,
    panic_threshold: u32,
    seed: Option<u64>,
    /// 0: path, 1: client-ip, 2: header (hash strategies only).
    hash_on: Option<u8>,
    connect_timeout_ms: u64,
    request_timeout_ms: u64,
    max_buffered_response: u64,
    pool_idle_timeout_ms: u64,
    pool_max_idle_per_endpoint: usize,
    max_in_flight: usize,
    retry: RetrySpec,
    health_check: Option<HealthSpec>,
    outlier: Option<OutlierSpec>,
    slow_start: Option<SlowStartSpec>,
    /// In place of `endpoints`.
    discovery: Option<DiscoverySpec>,
}

#[derive(Debug, Clone)]
struct ConfigSpec {
    drain_timeout_ms: u64,
    /// Admin on loopback, with or without a token.
    admin: Option<Option<String>>,
    access_log: Option<AccessLogSpec>,
    listeners: Vec<ListenerSpec>,
    clusters: Vec<ClusterSpec>,
}

fn duration_ms() -> impl Strategy<Value = u64> {
    1u64..=120_000
}

fn listener_spec() -> impl Strategy<Value = ListenerSpec> {
    (
        any::<u16>(),
        0usize..8,
        1usize..=100_000,
        8192usize..=1 << 20,
        1usize..=1000,
        duration_ms(),
        duration_ms(),
        proptest::option::of(0u64..=1 << 40),
        proptest::collection::vec(route_spec(), 0..=3),
    )
        .prop_map(
            |(port, cluster, mc, mhb, mh, hrt, idle, body, routes)| ListenerSpec {
                port,
                cluster,
                max_connections: mc,
                max_header_bytes: mhb,
                max_headers: mh,
                header_read_timeout_ms: hrt,
                idle_timeout_ms: idle,
                max_request_body_bytes: body,
                routes,
            },
        )
}

fn route_spec() -> impl Strategy<Value = RouteSpec> {
    let name = "[a-z][a-z0-9-]{0,8}(\\.[a-z][a-z0-9-]{0,8}){0,2}";
    (
        proptest::option::of((any::<bool>(), name)),
        proptest::option::of((any::<bool>(), "/[a-z0-9/_.-]{0,12}")),
        proptest::collection::btree_set(
            proptest::sample::select(vec!["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]),
            0..3,
        ),
        proptest::collection::btree_map("x-[a-z]{1,8}", "[a-zA-Z0-9._-]{0,10}", 0..3),
        0usize..8,
        proptest::option::of(1u64..=120_000),
        proptest::option::of(0u32..=10),
    )
        .prop_map(
            |(host, path, methods, headers, cluster, timeout, attempts)| RouteSpec {
                host,
                path,
                methods: methods.into_iter().map(str::to_string).collect(),
                headers,
                cluster,
                request_timeout_ms: timeout,
                retry_attempts: attempts,
            },
        )
}

fn discovery_spec() -> impl Strategy<Value = DiscoverySpec> {
    (
        any::<bool>(),
        "[a-z][a-z0-9-]{0,8}(\\.[a-z][a-z0-9-]{0,8}){1,3}",
        1u16..=65535,
        proptest::option::of(1u16..=65535),
        proptest::option::of(1000u64..=120_000),
    )
        .prop_map(|(srv, name, port, resolver, refresh)| DiscoverySpec {
            srv,
            name,
            port,
            resolver_port: resolver,
            refresh_ms: refresh,
        })
}

impl DiscoverySpec {
    /// The inline table.
    fn value(&self) -> String {
        let mut v = if self.srv {
            format!("{{ srv = {}", q(&format!("_http._tcp.{}", self.name)))
        } else {
            format!("{{ dns = {}, port = {}", q(&self.name), self.port)
        };
        if let Some(p) = self.resolver_port {
            v.push_str(&format!(", resolver = {}", q(&format!("127.0.0.1:{p}"))));
        }
        if let Some(r) = self.refresh_ms {
            v.push_str(&format!(", refresh = {}", ms(r)));
        }
        v.push_str(" }");
        v
    }
}

impl RouteSpec {
    fn section(&self, listener: usize, index: usize, clusters: &[ClusterSpec]) -> Section {
        let mut s = Section::new(
            Some("[[listener.route]]"),
            &format!("listener[{listener}].route[{index}]"),
        );
        if let Some((wild, h)) = &self.host {
            s.set("host", q(&format!("{}{h}", if *wild { "*." } else { "" })));
        }
        if let Some((exact, p)) = &self.path {
            s.set(if *exact { "path" } else { "path_prefix" }, q(p));
        }
        if !self.methods.is_empty() {
            s.set("methods", format!("{:?}", self.methods));
        }
        if !self.headers.is_empty() {
            let pairs: Vec<String> = self
                .headers
                .iter()
                .map(|(k, v)| format!("{k} = {}", q(v)))
                .collect();
            s.set("headers", format!("{{ {} }}", pairs.join(", ")));
        }
        s.set("cluster", q(&clusters[self.cluster].name));
        if let Some(t) = self.request_timeout_ms {
            s.set("request_timeout", ms(t));
        }
        if let Some(a) = self.retry_attempts {
            s.set("retry_attempts", a.to_string());
        }
        s
    }
}

fn retry_spec() -> impl Strategy<Value = RetrySpec> {
    (
        0u32..=10,
        proptest::option::of(1u64..=1000),
        proptest::collection::btree_set(400u16..=599, 0..5),
        0u32..=100_000,
        0u32..=100,
        10u64..=120_000,
    )
        .prop_map(|(attempts, ptt, statuses, bp, mr, bw)| RetrySpec {
            attempts,
            per_try_permille: ptt,
            retry_on_status: statuses.into_iter().collect(),
            budget_percent_cents: bp,
            min_retries_per_second: mr,
            budget_window_ms: bw,
        })
}

fn health_spec() -> impl Strategy<Value = HealthSpec> {
    (
        "/[a-z0-9/_-]{0,12}",
        duration_ms(),
        duration_ms(),
        1u32..=10,
        1u32..=10,
    )
        .prop_map(|(path, interval, timeout, u, h)| HealthSpec {
            path,
            interval_ms: interval,
            timeout_ms: timeout,
            unhealthy_threshold: u,
            healthy_threshold: h,
        })
}

fn outlier_spec() -> impl Strategy<Value = OutlierSpec> {
    (
        0u32..=20,
        duration_ms(),
        duration_ms(),
        0u64..=600_000,
        0u32..=100,
        proptest::option::of((0u32..=100, 0u32..=1000)),
    )
        .prop_map(|(cf, iv, base, extra, mep, fr)| OutlierSpec {
            consecutive_failures: cf,
            interval_ms: iv,
            base_ejection_ms: base,
            extra_max_ejection_ms: extra,
            max_ejection_percent: mep,
            failure_rate: fr,
        })
}

fn slow_start_spec() -> impl Strategy<Value = SlowStartSpec> {
    (duration_ms(), 1u32..=40, 0u32..=100).prop_map(|(w, a, m)| SlowStartSpec {
        window_ms: w,
        aggression_quarters: a,
        min_weight_percent: m,
    })
}

/// Primes larger than the largest endpoint count generated (6), small enough to build fast.
const PRIMES: [u64; 4] = [7, 251, 1009, 65537];

fn cluster_spec() -> impl Strategy<Value = ClusterSpec> {
    let strategy = proptest::sample::select(StrategyKind::ALL.to_vec());
    let endpoints = proptest::collection::btree_map(1u16..=65535, 1u32..=1000, 1..=6)
        .prop_map(|m| m.into_iter().collect::<Vec<_>>());
    let balance = (
        any::<bool>(),
        2u32..=10,
        duration_ms(),
        0u64..=5000,
        0u64..=5000,
        1u32..=500,
        proptest::sample::select(PRIMES.to_vec()),
        proptest::option::of(0u32..=300),
        0u32..=100,
        proptest::option::of(0u64..=i64::MAX as u64),
        proptest::option::of(0u8..3),
    );
    let traffic = (
        duration_ms(),
        duration_ms(),
        0u64..=1 << 30,
        duration_ms(),
        0usize..=1000,
        1usize..=100_000,
    );
    let protections = (
        retry_spec(),
        proptest::option::of(health_spec()),
        proptest::option::of(outlier_spec()),
        proptest::option::of(slow_start_spec()),
    );
    (
        "[a-z][a-z0-9_-]{0,10}",
        strategy,
        endpoints,
        balance,
        traffic,
        protections,
        proptest::option::weighted(0.25, discovery_spec()),
    )
        .prop_map(|(name, strategy, endpoints, b, t, p, discovery)| {
            let hash = strategy.is_hash();
            ClusterSpec {
                name,
                strategy,
                endpoints,
                lowest_index: b.0,
                choices: b.1,
                decay_ms: b.2,
                default_rtt_ms: b.3,
                failure_penalty_ms: b.4,
                vnodes: b.5,
                table_size: b.6,
                bounded_load_cents: b.7.filter(|_| hash),
                panic_threshold: b.8,
                seed: b.9,
                hash_on: b.10.filter(|_| hash),
                connect_timeout_ms: t.0,
                request_timeout_ms: t.1,
                max_buffered_response: t.2,
                pool_idle_timeout_ms: t.3,
                pool_max_idle_per_endpoint: t.4,
                max_in_flight: t.5,
                retry: p.0,
                health_check: p.1,
                outlier: p.2,
                slow_start: p.3,
                discovery,
            }
        })
}

fn config_spec() -> impl Strategy<Value = ConfigSpec> {
    (
        duration_ms(),
        proptest::option::of(proptest::option::of("[A-Za-z0-9_-]{16,40}")),
        proptest::option::of((
            prop_oneof!["-", "[a-z]{1,8}\\.log"],
            proptest::option::of(any::<bool>()),
        )),
        proptest::collection::vec(listener_spec(), 1..=3),
        proptest::collection::vec(cluster_spec(), 1..=3),
    )
        .prop_map(|(drain, admin, log, mut listeners, mut clusters)| {
            // Cluster names are unique, listeners name existing clusters, and two listeners
            // never share a fixed port.
            for (i, c) in clusters.iter_mut().enumerate() {
                c.name = format!("{}-{i}", c.name);
            }
            for (i, l) in listeners.iter_mut().enumerate() {
                l.cluster %= clusters.len();
                for r in &mut l.routes {
                    r.cluster %= clusters.len();
                }
                if l.port != 0 {
                    l.port = 20000 + i as u16;
                }
            }
            ConfigSpec {
                drain_timeout_ms: drain,
                admin,
                access_log: log.map(|(path, combined)| AccessLogSpec { path, combined }),
                listeners,
                clusters,
            }
        })
}

fn endpoint_address(cluster: usize, index: usize, port: u16) -> String {
    format!("10.0.{cluster}.{index}:{port}")
}

fn endpoints_value(endpoints: &[(String, String)]) -> String {
    let mut v = String::from("[\n");
    for (address, weight) in endpoints {
        v.push_str(&format!(
            "  {{ address = {address}, weight = {weight} }},\n"
        ));
    }
    v.push(']');
    v
}

impl ConfigSpec {
    fn doc(&self) -> Doc {
        let mut sections = Vec::new();
        let mut top = Section::new(None, "");
        top.set("drain_timeout", ms(self.drain_timeout_ms));
        sections.push(top);
        if let Some(token) = &self.admin {
            let mut s = Section::new(Some("[admin]"), "admin");
            s.set("listen", q("127.0.0.1:9901"));
            if let Some(t) = token {
                s.set("token", q(t));
            }
            sections.push(s);
        }
        if let Some(log) = &self.access_log {
            let mut s = Section::new(Some("[access_log]"), "access_log");
            s.set("path", q(&log.path));
            if let Some(c) = log.combined {
                s.set("format", q(if c { "combined" } else { "json" }));
            }
            sections.push(s);
        }
        for (i, l) in self.listeners.iter().enumerate() {
            let mut s = Section::new(Some("[[listener]]"), &format!("listener[{i}]"));
            s.set("listen", q(&format!("127.0.0.1:{}", l.port)));
            s.set("cluster", q(&self.clusters[l.cluster].name));
            s.set("max_connections", l.max_connections.to_string());
            s.set("max_header_bytes", l.max_header_bytes.to_string());
            s.set("max_headers", l.max_headers.to_string());
            s.set("header_read_timeout", ms(l.header_read_timeout_ms));
            s.set("idle_timeout", ms(l.idle_timeout_ms));
            if let Some(b) = l.max_request_body_bytes {
                s.set("max_request_body_bytes", b.to_string());
            }
            sections.push(s);
            for (j, r) in l.routes.iter().enumerate() {
                sections.push(r.section(i, j, &self.clusters));
            }
        }
        for (i, c) in self.clusters.iter().enumerate() {
            let p = format!("cluster[{i}]");
            let mut s = Section::new(Some("[[cluster]]"), &p);
            s.set("name", q(&c.name));
            s.set("strategy", q(c.strategy.name()));
            let eps: Vec<(String, String)> = c
                .endpoints
                .iter()
                .enumerate()
                .map(|(j, (port, w))| (q(&endpoint_address(i, j, *port)), w.to_string()))
                .collect();
            match &c.discovery {
                Some(d) => s.set("discovery", d.value()),
                None => s.set("endpoints", endpoints_value(&eps)),
            }
            s.set(
                "tie_break",
                q(if c.lowest_index {
                    "lowest-index"
                } else {
                    "random"
                }),
            );
            s.set("choices", c.choices.to_string());
            s.set("decay", ms(c.decay_ms));
            s.set("default_rtt", ms(c.default_rtt_ms));
            s.set("failure_penalty", ms(c.failure_penalty_ms));
            s.set("vnodes", c.vnodes.to_string());
            s.set("table_size", c.table_size.to_string());
            if let Some(b) = c.bounded_load_cents {
                s.set("bounded_load", format!("{}", 1.0 + b as f64 / 100.0));
            }
            // Integer and float spellings of a float option are both accepted.
            s.set(
                "panic_threshold",
                if c.panic_threshold.is_multiple_of(2) {
                    c.panic_threshold.to_string()
                } else {
                    format!("{}.0", c.panic_threshold)
                },
            );
            if let Some(seed) = c.seed {
                s.set("seed", seed.to_string());
            }
            if let Some(h) = c.hash_on {
                s.set(
                    "hash_on",
                    q(["path", "client-ip", "header:X-Session"][h as usize]),
                );
            }
            s.set("connect_timeout", ms(c.connect_timeout_ms));
            s.set("request_timeout", ms(c.request_timeout_ms));
            s.set("max_buffered_response", c.max_buffered_response.to_string());
            s.set("pool_idle_timeout", ms(c.pool_idle_timeout_ms));
            s.set(
                "pool_max_idle_per_endpoint",
                c.pool_max_idle_per_endpoint.to_string(),
            );
            s.set("max_in_flight", c.max_in_flight.to_string());
            sections.push(s);

            let r = &c.retry;
            let mut s = Section::new(Some("[cluster.retry]"), &format!("{p}.retry"));
            s.set("attempts", r.attempts.to_string());
            if let Some(pm) = r.per_try_permille {
                s.set("per_try_timeout", ms(per_try_ms(c, pm)));
            }
            s.set("retry_on_status", format!("{:?}", r.retry_on_status));
            s.set(
                "budget_percent",
                format!("{}", r.budget_percent_cents as f64 / 100.0),
            );
            s.set(
                "min_retries_per_second",
                r.min_retries_per_second.to_string(),
            );
            s.set("budget_window", ms(r.budget_window_ms));
            sections.push(s);

            if let Some(h) = &c.health_check {
                let mut s =
                    Section::new(Some("[cluster.health_check]"), &format!("{p}.health_check"));
                s.set("path", q(&h.path));
                s.set("interval", ms(h.interval_ms));
                s.set("timeout", ms(h.timeout_ms));
                s.set("unhealthy_threshold", h.unhealthy_threshold.to_string());
                s.set("healthy_threshold", h.healthy_threshold.to_string());
                sections.push(s);
            }
            if let Some(o) = &c.outlier {
                let op = format!("{p}.outlier_detection");
                let mut s = Section::new(Some("[cluster.outlier_detection]"), &op);
                s.set("consecutive_failures", o.consecutive_failures.to_string());
                s.set("interval", ms(o.interval_ms));
                s.set("base_ejection_time", ms(o.base_ejection_ms));
                s.set(
                    "max_ejection_time",
                    ms(o.base_ejection_ms + o.extra_max_ejection_ms),
                );
                s.set("max_ejection_percent", o.max_ejection_percent.to_string());
                sections.push(s);
                if let Some((t, m)) = o.failure_rate {
                    let mut s = Section::new(
                        Some("[cluster.outlier_detection.failure_rate]"),
                        &format!("{op}.failure_rate"),
                    );
                    s.set("threshold_percent", t.to_string());
                    s.set("minimum_requests", m.to_string());
                    sections.push(s);
                }
            }
            if let Some(ss) = &c.slow_start {
                let mut s = Section::new(Some("[cluster.slow_start]"), &format!("{p}.slow_start"));
                s.set("window", ms(ss.window_ms));
                s.set(
                    "aggression",
                    format!("{}", ss.aggression_quarters as f64 / 4.0),
                );
                s.set("min_weight_percent", ss.min_weight_percent.to_string());
                sections.push(s);
            }
        }
        Doc { sections }
    }
}

/// A discovery's refresh: as written, else the default 5 s.
fn w_refresh(ms: Option<u64>) -> Duration {
    ms.map_or(Duration::from_secs(5), d)
}

/// The per-try timeout written: a share of the request timeout, at least 1 ms.
fn per_try_ms(c: &ClusterSpec, permille: u64) -> u64 {
    (c.request_timeout_ms * permille / 1000).max(1)
}

fn d(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Every value read back equals the one written.
fn assert_round_trip(spec: &ConfigSpec, c: &ProxyConfig) {
    assert_eq!(c.drain_timeout, d(spec.drain_timeout_ms));
    match &spec.admin {
        None => assert!(c.admin.is_none()),
        Some(token) => {
            let a = c.admin.as_ref().expect("[admin]");
            assert_eq!(a.listen.to_string(), "127.0.0.1:9901");
            assert_eq!(&a.token, token);
        }
    }
    assert_eq!(c.listeners.len(), spec.listeners.len());
    for (l, s) in c.listeners.iter().zip(&spec.listeners) {
        assert_eq!(l.listen.port(), s.port);
        assert_eq!(
            l.cluster.as_deref(),
            Some(spec.clusters[s.cluster].name.as_str())
        );
        assert_eq!(l.max_connections, s.max_connections);
        assert_eq!(l.max_header_bytes, s.max_header_bytes);
        assert_eq!(l.max_headers, s.max_headers);
        assert_eq!(l.header_read_timeout, d(s.header_read_timeout_ms));
        assert_eq!(l.idle_timeout, d(s.idle_timeout_ms));
        assert_eq!(l.max_request_body_bytes, s.max_request_body_bytes);
        assert_eq!(l.routes.len(), s.routes.len());
        for (r, w) in l.routes.iter().zip(&s.routes) {
            let host = w
                .host
                .as_ref()
                .map(|(wild, h)| format!("{}{h}", if *wild { "*." } else { "" }));
            assert_eq!(r.host, host);
            let exact = |e: bool| {
                w.path
                    .as_ref()
                    .filter(|(x, _)| *x == e)
                    .map(|(_, p)| p.clone())
            };
            assert_eq!(r.path, exact(true));
            assert_eq!(r.path_prefix, exact(false));
            assert_eq!(r.methods, w.methods);
            let want_headers: BTreeMap<String, keel_proxy::config::ValueMatch> = w
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), keel_proxy::config::ValueMatch::exact(v.clone())))
                .collect();
            assert_eq!(r.headers, want_headers);
            assert_eq!(r.cluster, spec.clusters[w.cluster].name);
            assert_eq!(r.request_timeout, w.request_timeout_ms.map(d));
            assert_eq!(r.retry_attempts, w.retry_attempts);
        }
    }
    match (&c.access_log, &spec.access_log) {
        (None, None) => {}
        (Some(a), Some(w)) => {
            assert_eq!(a.path, std::path::PathBuf::from(&w.path));
            let format = if w.combined == Some(true) {
                AccessLogFormat::Combined
            } else {
                AccessLogFormat::Json
            };
            assert_eq!(a.format, format);
        }
        (got, want) => panic!("access_log {got:?}, wrote {want:?}"),
    }
    assert_eq!(c.clusters.len(), spec.clusters.len());
    for (i, (c, s)) in c.clusters.iter().zip(&spec.clusters).enumerate() {
        assert_eq!(c.name, s.name);
        assert_eq!(c.balance.strategy, s.strategy);
        let eps: Vec<(String, u32)> = c
            .endpoints
            .iter()
            .map(|e| (e.address.clone(), e.weight))
            .collect();
        let want: Vec<(String, u32)> = s
            .endpoints
            .iter()
            .enumerate()
            .filter(|_| s.discovery.is_none())
            .map(|(j, (port, w))| (endpoint_address(i, j, *port), *w))
            .collect();
        assert_eq!(eps, want);
        let discovery = s.discovery.as_ref().map(|w| {
            let resolver = w
                .resolver_port
                .map(|p| std::net::SocketAddr::from(([127, 0, 0, 1], p)));
            let refresh = w.refresh_ms.map(d);
            if w.srv {
                DiscoveryConfig::Srv {
                    name: format!("_http._tcp.{}", w.name),
                    resolver,
                    refresh,
                }
            } else {
                DiscoveryConfig::Dns {
                    name: w.name.clone(),
                    port: w.port,
                    resolver,
                    refresh,
                }
            }
        });
        assert_eq!(c.discovery, discovery);
        if let Some(dc) = &c.discovery {
            assert_eq!(
                dc.refresh(),
                w_refresh(s.discovery.as_ref().and_then(|w| w.refresh_ms))
            );
        }
        let tie = if s.lowest_index {
            TieBreak::LowestIndex
        } else {
            TieBreak::Random
        };
        assert_eq!(c.balance.tie_break, tie);
        assert_eq!(c.balance.choices, s.choices);
        assert_eq!(c.balance.decay, d(s.decay_ms));
        assert_eq!(c.balance.default_rtt, d(s.default_rtt_ms));
        assert_eq!(c.balance.failure_penalty, d(s.failure_penalty_ms));
        assert_eq!(c.balance.vnodes, s.vnodes);
        assert_eq!(c.balance.table_size, s.table_size);
        assert_eq!(
            c.balance.bounded_load,
            s.bounded_load_cents.map(|b| 1.0 + b as f64 / 100.0)
        );
        assert_eq!(c.balance.panic_threshold, s.panic_threshold as f64);
        assert_eq!(c.balance.seed, s.seed);
        let hash_on = s.hash_on.map(|h| match h {
            0 => HashOn::Path,
            1 => HashOn::ClientIp,
            _ => "header:x-session".parse().unwrap(),
        });
        assert_eq!(c.balance.hash_on, hash_on);
        assert_eq!(c.timeouts.connect, d(s.connect_timeout_ms));
        assert_eq!(c.timeouts.request, d(s.request_timeout_ms));
        assert_eq!(c.max_buffered_response, s.max_buffered_response);
        assert_eq!(c.timeouts.pool_idle, d(s.pool_idle_timeout_ms));
        assert_eq!(c.pool_max_idle_per_endpoint, s.pool_max_idle_per_endpoint);
        assert_eq!(c.protections.max_in_flight, s.max_in_flight);

        let r = &c.protections.retry;
        assert_eq!(r.attempts, s.retry.attempts);
        assert_eq!(
            r.per_try_timeout,
            s.retry.per_try_permille.map(|pm| d(per_try_ms(s, pm)))
        );
        assert_eq!(r.retry_on_status, s.retry.retry_on_status);
        assert_eq!(
            r.budget_percent,
            s.retry.budget_percent_cents as f64 / 100.0
        );
        assert_eq!(
            r.min_retries_per_second,
            s.retry.min_retries_per_second as f64
        );
        assert_eq!(r.budget_window, d(s.retry.budget_window_ms));
        let per_try = c.per_try_timeout();
        assert!(!per_try.is_zero() && per_try <= c.timeouts.request);

        match (&c.protections.health_check, &s.health_check) {
            (None, None) => {}
            (Some(h), Some(w)) => {
                assert_eq!(h.path, w.path);
                assert_eq!(h.interval, d(w.interval_ms));
                assert_eq!(h.timeout, d(w.timeout_ms));
                assert_eq!(h.unhealthy_threshold, w.unhealthy_threshold);
                assert_eq!(h.healthy_threshold, w.healthy_threshold);
            }
            (got, want) => panic!("health_check {got:?}, wrote {want:?}"),
        }
        match (&c.protections.outlier_detection, &s.outlier) {
            // No table: on, with keel-balance's defaults.
            (Some(o), None) => assert_eq!(*o, keel_balance::OutlierConfig::default()),
            (Some(o), Some(w)) => {
                assert_eq!(o.consecutive_failures, w.consecutive_failures);
                assert_eq!(o.interval, d(w.interval_ms));
                assert_eq!(o.base_ejection_time, d(w.base_ejection_ms));
                assert_eq!(
                    o.max_ejection_time,
                    d(w.base_ejection_ms + w.extra_max_ejection_ms)
                );
                assert_eq!(o.max_ejection_percent, w.max_ejection_percent as f64);
                let fr = o
                    .failure_rate
                    .as_ref()
                    .map(|f| (f.threshold_percent, f.minimum_requests));
                assert_eq!(fr, w.failure_rate.map(|(t, m)| (t as f64, m)));
            }
            (got, want) => panic!("outlier_detection {got:?}, wrote {want:?}"),
        }
        match (&c.protections.slow_start, &s.slow_start) {
            (None, None) => {}
            (Some(ss), Some(w)) => {
                assert_eq!(ss.window, d(w.window_ms));
                assert_eq!(ss.aggression, w.aggression_quarters as f64 / 4.0);
                assert_eq!(ss.min_weight_percent, w.min_weight_percent as f64);
            }
            (got, want) => panic!("slow_start {got:?}, wrote {want:?}"),
        }

        // What the proxy builds from it: the keel-balance configuration and the balancer.
        let bc = c.balancer_config();
        assert_eq!(bc.strategy, s.strategy);
        assert_eq!(bc.options.vnodes, s.vnodes);
        assert_eq!(bc.panic_threshold, s.panic_threshold as f64);
        keel_balance::Balancer::new(bc, &c.endpoints).expect("a validated cluster builds");
    }
}

// ---------------------------------------------------------------------------------------------
// Single mutations that make a valid configuration invalid.

/// One change to a valid document, and where the error must point.
#[derive(Debug, Clone)]
struct Mutation {
    /// What was changed, for failure messages.
    what: String,
    /// The key path the error must name.
    key: String,
    /// The key path whose line the error must point at (usually `key`).
    line_of: String,
}

/// Applies mutation number `kind` (modulo the list) with random parameter `r`, to cluster
/// `ci` / listener `li` / endpoint `ej` (each taken modulo what exists).
fn mutate(
    spec: &ConfigSpec,
    kind: usize,
    r: u64,
    ci: usize,
    li: usize,
    ej: usize,
) -> (Doc, Mutation) {
    let mut doc = spec.doc();
    let ci = ci % spec.clusters.len();
    let li = li % spec.listeners.len();
    let c = &spec.clusters[ci];
    let ej = ej % c.endpoints.len();
    let cp = format!("cluster[{ci}]");
    let lp = format!("listener[{li}]");
    // Out-of-range numbers of several sizes, so shrinking shows the smallest.
    let big = |min: u64| min + r % 1000;
    let pick = |xs: &[&str]| xs[(r % xs.len() as u64) as usize].to_string();

    // (section, key, value): sets one value; the error must name section.key at its line.
    let set = |doc: &mut Doc, section: &str, key: &str, value: String| -> Mutation {
        let path = if section.is_empty() {
            key.to_string()
        } else {
            format!("{section}.{key}")
        };
        let what = format!("{path} = {value}");
        doc.section(section).set(key, value);
        Mutation {
            what,
            key: path.clone(),
            line_of: path,
        }
    };
    // Adds a section (right after its cluster's other sections) if it is absent.
    let ensure = |doc: &mut Doc, header: &str, path: &str| {
        if !doc.sections.iter().any(|s| s.path == path) {
            let after = doc
                .sections
                .iter()
                .rposition(|s| s.path == cp || s.path.starts_with(&format!("{cp}.")))
                .unwrap();
            doc.sections
                .insert(after + 1, Section::new(Some(header), path));
        }
    };
    let retry = format!("{cp}.retry");
    let od = format!("{cp}.outlier_detection");
    let hc = format!("{cp}.health_check");
    let ss = format!("{cp}.slow_start");

    // A cluster that finds its endpoints by DNS: `discovery` replaces `endpoints`.
    let discovering = |doc: &mut Doc, value: &str| {
        let section = doc.section(&cp);
        section
            .entries
            .retain(|(k, _)| k != "endpoints" && k != "discovery");
        section.set("discovery", value.to_string());
    };
    // A cluster with these endpoints (and no `discovery`).
    let with_endpoints = |doc: &mut Doc, eps: &[(String, String)]| {
        let section = doc.section(&cp);
        section.entries.retain(|(k, _)| k != "discovery");
        section.set("endpoints", endpoints_value(eps));
    };
    // A further route on listener `li`, after its section and its routes; returns its path.
    let add_route = |doc: &mut Doc| -> String {
        let j = spec.listeners[li].routes.len();
        let path = format!("{lp}.route[{j}]");
        let at = doc
            .sections
            .iter()
            .rposition(|s| s.path == lp || s.path.starts_with(&format!("{lp}.")))
            .unwrap();
        let mut s = Section::new(Some("[[listener.route]]"), &path);
        s.set("cluster", q(&c.name));
        doc.sections.insert(at + 1, s);
        path
    };
    let at_discovery = |key: &str, what: String| Mutation {
        what,
        key: format!("{cp}.discovery{key}"),
        line_of: format!("{cp}.discovery"),
    };

    const KINDS: usize = 62;
    let m = match kind % KINDS {
        0 => set(&mut doc, &retry, "attempts", big(11).to_string()),
        1 => set(
            &mut doc,
            &retry,
            "attempts",
            pick(&["-1", "\"two\"", "1.5"]),
        ),
        2 => set(
            &mut doc,
            &cp,
            "strategy",
            q(&pick(&["fastest", "Round-Robin", ""])),
        ),
        3 => {
            // A listener naming a cluster that does not exist.
            set(&mut doc, &lp, "cluster", q("no-such-cluster"))
        }
        4 => {
            // A further cluster with the name of an existing one: the new one is the error.
            let n = spec.clusters.len();
            let mut extra = Section::new(Some("[[cluster]]"), &format!("cluster[{n}]"));
            extra.set("name", q(&spec.clusters[r as usize % n].name));
            extra.set("endpoints", "[{ address = \"127.0.0.1:1\" }]");
            doc.sections.push(extra);
            let path = format!("cluster[{n}].name");
            Mutation {
                what: "a second cluster of the same name".into(),
                key: path.clone(),
                line_of: path,
            }
        }
        5 => set(
            &mut doc,
            &cp,
            "connect_timeout",
            q(&pick(&["fast", "5 parsecs", "-1s", "10"])),
        ),
        6 => set(&mut doc, &cp, "request_timeout", q("0s")),
        7 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            set(
                &mut doc,
                &od,
                "max_ejection_percent",
                format!("{}.5", big(100)),
            )
        }
        8 => set(
            &mut doc,
            &cp,
            "panic_threshold",
            pick(&["100.5", "-1", "1000", "nan", "inf"]),
        ),
        9 => set(&mut doc, &cp, "choices", pick(&["0", "1"])),
        10 => set(
            &mut doc,
            &cp,
            "vnodes",
            pick(&["0", "65537", "4000000000", "-1"]),
        ),
        11 => set(
            &mut doc,
            &cp,
            "table_size",
            pick(&[
                "65536",
                "1",
                "0",
                "5000012",
                "5000023",
                "9223372036854775783",
            ]),
        ),
        12 => set(
            &mut doc,
            &retry,
            "per_try_timeout",
            ms(c.request_timeout_ms + 1 + r % 1000),
        ),
        13 => set(
            &mut doc,
            &retry,
            "retry_on_status",
            format!("[502, {}]", pick(&["200", "399", "600", "302"])),
        ),
        14 => set(
            &mut doc,
            &retry,
            "budget_percent",
            pick(&["-1", "-0.5", "nan"]),
        ),
        15 => set(&mut doc, &retry, "budget_window", ms(r % 10)),
        16 => set(
            &mut doc,
            &retry,
            "min_retries_per_second",
            pick(&["-1", "nan"]),
        ),
        17 => {
            ensure(&mut doc, "[cluster.health_check]", &hc);
            set(&mut doc, &hc, "path", q(&pick(&["healthz", "", "/a b"])))
        }
        18 => {
            ensure(&mut doc, "[cluster.health_check]", &hc);
            let key = pick(&["interval", "timeout"]);
            set(&mut doc, &hc, &key, q("0s"))
        }
        19 => {
            ensure(&mut doc, "[cluster.health_check]", &hc);
            let key = pick(&["unhealthy_threshold", "healthy_threshold"]);
            set(&mut doc, &hc, &key, "0".into())
        }
        20 => {
            ensure(&mut doc, "[cluster.slow_start]", &ss);
            set(&mut doc, &ss, "window", q("0ms"))
        }
        21 => {
            ensure(&mut doc, "[cluster.slow_start]", &ss);
            set(&mut doc, &ss, "aggression", pick(&["0", "-1", "nan"]))
        }
        22 => {
            ensure(&mut doc, "[cluster.slow_start]", &ss);
            set(
                &mut doc,
                &ss,
                "min_weight_percent",
                pick(&["100.1", "-1", "1000"]),
            )
        }
        23 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            set(&mut doc, &od, "base_ejection_time", q("0s"))
        }
        24 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            // Shorter than the base ejection time.
            doc.section(&od).set("base_ejection_time", q("10s"));
            set(&mut doc, &od, "max_ejection_time", q("9s"))
        }
        25 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            set(&mut doc, &od, "interval", q("0s"))
        }
        26 => set(&mut doc, &lp, "max_header_bytes", (r % 8192).to_string()),
        27 => {
            let key = pick(&["max_connections", "max_headers"]);
            set(&mut doc, &lp, &key, "0".into())
        }
        28 => {
            let key = pick(&["header_read_timeout", "idle_timeout"]);
            set(&mut doc, &lp, &key, q("0s"))
        }
        29 => set(&mut doc, &cp, "max_in_flight", "0".into()),
        30 => {
            // A hash-only option on a strategy without it, or vice versa a bad hash_on.
            if takes_hash_options(c.strategy) {
                set(
                    &mut doc,
                    &cp,
                    "hash_on",
                    q(&pick(&["cookie", "header:bad name", "header:"])),
                )
            } else {
                set(&mut doc, &cp, "hash_on", q("path"))
            }
        }
        31 => {
            if takes_hash_options(c.strategy) {
                set(
                    &mut doc,
                    &cp,
                    "bounded_load",
                    pick(&["0.99", "0", "-1", "nan", "inf"]),
                )
            } else {
                set(&mut doc, &cp, "bounded_load", "1.25".into())
            }
        }
        32 => {
            // An endpoint address that is not host:port.
            let mut eps = endpoint_list(c, ci);
            eps[ej].0 = q(&pick(&[
                "localhost",
                "10.0.0.1",
                ":80",
                "10.0.0.1:99999",
                "",
            ]));
            with_endpoints(&mut doc, &eps);
            let path = format!("{cp}.endpoints[{ej}].address");
            Mutation {
                what: format!("endpoint {ej} address {}", eps[ej].0),
                key: path.clone(),
                line_of: format!("{cp}.endpoints[{ej}]"),
            }
        }
        33 => {
            // A negative or too large weight: a type error at the weight.
            let mut eps = endpoint_list(c, ci);
            eps[ej].1 = pick(&["-1", "4294967296", "1.5", "\"2\""]);
            with_endpoints(&mut doc, &eps);
            let path = format!("{cp}.endpoints[{ej}].weight");
            Mutation {
                what: format!("endpoint {ej} weight {}", eps[ej].1),
                key: path,
                line_of: format!("{cp}.endpoints[{ej}]"),
            }
        }
        34 => {
            // Weight 0: keel-balance refuses it when the balancer is built.
            let mut eps = endpoint_list(c, ci);
            eps[ej].1 = "0".into();
            with_endpoints(&mut doc, &eps);
            let path = format!("{cp}.endpoints[{ej}].weight");
            Mutation {
                what: format!("endpoint {ej} weight 0"),
                key: path,
                line_of: format!("{cp}.endpoints[{ej}]"),
            }
        }
        35 => {
            // The same address twice: the second is the error.
            let mut eps = endpoint_list(c, ci);
            let dup = eps[ej].clone();
            eps.push(dup);
            let j = eps.len() - 1;
            with_endpoints(&mut doc, &eps);
            Mutation {
                what: format!("endpoint {ej} listed twice"),
                key: format!("{cp}.endpoints[{j}].address"),
                line_of: format!("{cp}.endpoints[{j}]"),
            }
        }
        36 => {
            // An unknown key in one of the tables.
            let section = pick(&[cp.as_str(), lp.as_str(), retry.as_str(), ""]);
            if section.is_empty() {
                let path = "max_connections".to_string();
                doc.sections[0].set("max_connections", "5");
                Mutation {
                    what: "top-level max_connections".into(),
                    key: path.clone(),
                    line_of: path,
                }
            } else {
                set(&mut doc, &section, "budget", "20".into())
            }
        }
        37 => {
            // Two listeners on one fixed address.
            let mut extra = Section::new(
                Some("[[listener]]"),
                &format!("listener[{}]", spec.listeners.len()),
            );
            extra.set("listen", q("127.0.0.1:29999"));
            extra.set("cluster", q(&spec.clusters[0].name));
            doc.section(&lp).set("listen", q("127.0.0.1:29999"));
            let at = doc
                .sections
                .iter()
                .rposition(|s| s.path.starts_with("listener["))
                .unwrap();
            doc.sections.insert(at + 1, extra);
            let path = format!("listener[{}].listen", spec.listeners.len());
            Mutation {
                what: "two listeners on 127.0.0.1:29999".into(),
                key: path.clone(),
                line_of: path,
            }
        }
        38 => {
            // The admin listener off loopback without a token, or with a short token.
            let admin = Section::new(Some("[admin]"), "admin");
            doc.sections.retain(|s| s.path != "admin");
            doc.sections.insert(1, admin);
            if r.is_multiple_of(2) {
                doc.section("admin").set("listen", q("0.0.0.0:9901"));
                Mutation {
                    what: "admin on 0.0.0.0 without a token".into(),
                    key: "admin.token".into(),
                    // The key is absent: the error points at its table.
                    line_of: "admin".into(),
                }
            } else {
                set(&mut doc, "admin", "token", q("short token"))
            }
        }
        39 => {
            // A maglev table no larger than the endpoint count (2, a prime, with at least two
            // endpoints).
            doc.section(&cp).set("strategy", q("maglev"));
            let mut eps = endpoint_list(c, ci);
            if eps.len() < 2 {
                eps.push((q(&format!("10.9.{ci}.1:80")), "1".into()));
            }
            with_endpoints(&mut doc, &eps);
            set(&mut doc, &cp, "table_size", "2".into())
        }
        40 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            let fr = format!("{od}.failure_rate");
            if !doc.sections.iter().any(|s| s.path == fr) {
                let at = doc.sections.iter().position(|s| s.path == od).unwrap();
                doc.sections.insert(
                    at + 1,
                    Section::new(Some("[cluster.outlier_detection.failure_rate]"), &fr),
                );
            }
            set(
                &mut doc,
                &fr,
                "threshold_percent",
                pick(&["100.5", "-1", "nan", "1000"]),
            )
        }
        41 => set(
            &mut doc,
            "",
            "drain_timeout",
            q(&pick(&["soon", "1 fortnight", ""])),
        ),
        42 => set(
            &mut doc,
            &lp,
            "listen",
            q(&pick(&[
                "localhost:80",
                "127.0.0.1",
                "127.0.0.1:65536",
                "*:80",
            ])),
        ),
        43 => {
            ensure(&mut doc, "[cluster.outlier_detection]", &od);
            set(
                &mut doc,
                &od,
                "consecutive_failures",
                pick(&["-1", "4294967296", "\"5\""]),
            )
        }
        44 => set(
            &mut doc,
            &cp,
            "tie_break",
            q(&pick(&["first", "lowest_index", ""])),
        ),
        45 => set(&mut doc, &cp, "seed", pick(&["-1", "\"7\"", "1.0"])),
        46 => set(&mut doc, &cp, "decay", q(&pick(&["0s", "0ms"]))),
        48 => {
            let v = format!(
                "{{ dns = \"api.internal.test\", port = 80, refresh = {} }}",
                q(&pick(&["500ms", "999ms", "0s"]))
            );
            discovering(&mut doc, &v);
            at_discovery(".refresh", v)
        }
        49 => {
            let v = "{ srv = \"_http._tcp.api.internal.test\", port = 80 }".to_string();
            discovering(&mut doc, &v);
            at_discovery(".port", v)
        }
        50 => {
            let v = format!(
                "{{ dns = {}, port = 80 }}",
                q(&pick(&["api internal.test", "a..b", "api.test:53", ""]))
            );
            discovering(&mut doc, &v);
            at_discovery(".dns", v)
        }
        51 => {
            let v = pick(&[
                "{ dns = \"api.internal.test\" }",
                "{ dns = \"api.internal.test\", port = 0 }",
            ]);
            discovering(&mut doc, &v);
            at_discovery(".port", v)
        }
        52 => {
            let v = pick(&[
                "{ srv = \"api.internal.test\" }",
                "{ srv = \"_http.api.test\" }",
            ]);
            discovering(&mut doc, &v);
            at_discovery(".srv", v)
        }
        53 => {
            // Both `endpoints` and `discovery`, or neither of the sources, or an unknown key.
            let v = pick(&[
                "{ dns = \"a.test\", srv = \"_a._tcp.b.test\", port = 80 }",
                "{ port = 80 }",
            ]);
            discovering(&mut doc, &v);
            at_discovery("", v)
        }
        54 => {
            with_endpoints(&mut doc, &endpoint_list(c, ci));
            doc.section(&cp)
                .set("discovery", "{ dns = \"a.test\", port = 80 }".to_string());
            at_discovery("", "endpoints and discovery".into())
        }
        55 => {
            let v = "{ dns = \"a.test\", port = 80, ttl = 5 }".to_string();
            discovering(&mut doc, &v);
            at_discovery(".ttl", v)
        }
        56 => {
            let rp = add_route(&mut doc);
            doc.section(&rp).set("path_prefix", q("/a/"));
            set(&mut doc, &rp, "path", q("/a"))
        }
        57 => {
            let rp = add_route(&mut doc);
            set(&mut doc, &rp, "cluster", q("no-such-cluster"))
        }
        58 => {
            let rp = add_route(&mut doc);
            let key = pick(&["path", "path_prefix"]);
            set(&mut doc, &rp, &key, q(&pick(&["v1/", "/a?b", "/a b", ""])))
        }
        59 => {
            let rp = add_route(&mut doc);
            match r % 4 {
                0 => set(
                    &mut doc,
                    &rp,
                    "methods",
                    pick(&["[\"G ET\"]", "[\"GET\", \"\"]"]),
                ),
                1 => set(&mut doc, &rp, "retry_attempts", big(11).to_string()),
                2 => set(&mut doc, &rp, "request_timeout", q("0s")),
                _ => set(
                    &mut doc,
                    &rp,
                    "host",
                    q(&pick(&[
                        "api.example.test:8080",
                        "http://a.test",
                        "a..b",
                        "*",
                    ])),
                ),
            }
        }
        60 => {
            let rp = add_route(&mut doc);
            set(&mut doc, &rp, "weight", "1".into())
        }
        61 => {
            doc.sections.retain(|s| s.path != "access_log");
            let mut log = Section::new(Some("[access_log]"), "access_log");
            log.set("path", q("access.log"));
            doc.sections.insert(1, log);
            set(
                &mut doc,
                "access_log",
                "format",
                q(&pick(&["xml", "JSON", "nginx", ""])),
            )
        }
        _ => set(
            &mut doc,
            &cp,
            "max_buffered_response",
            pick(&["-1", "true", "[]"]),
        ),
    };
    (doc, m)
}

/// The endpoints of cluster `ci` as written: (quoted address, weight).
fn endpoint_list(c: &ClusterSpec, ci: usize) -> Vec<(String, String)> {
    c.endpoints
        .iter()
        .enumerate()
        .map(|(j, (port, w))| (q(&endpoint_address(ci, j, *port)), w.to_string()))
        .collect()
}

/// The strategies that take `hash_on` and `bounded_load`: the hash strategies, and
/// prefix-affinity (its session key and its load bound).
fn takes_hash_options(s: StrategyKind) -> bool {
    s.is_hash() || s == StrategyKind::PrefixAffinity
}

fn load(text: &str) -> Result<ProxyConfig, ConfigError> {
    ProxyConfig::from_toml_str(text, "props.toml")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Valid configurations load, and every value reads back as written.
    #[test]
    fn valid_configurations_load_with_their_values(spec in config_spec()) {
        let (text, _) = spec.doc().render();
        let config = load(&text).unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
        assert_round_trip(&spec, &config);
    }

    /// One bad value is refused, naming its key and line.
    #[test]
    fn one_bad_value_is_refused_at_its_key_and_line(
        spec in config_spec(),
        kind in 0usize..62,
        r in any::<u64>(),
        ci in 0usize..3,
        li in 0usize..3,
        ej in 0usize..6,
    ) {
        let (doc, m) = mutate(&spec, kind, r, ci, li, ej);
        let (text, lines) = doc.render();
        let e = match load(&text) {
            Ok(_) => panic!("accepted after {}\n--- config ---\n{text}", m.what),
            Err(e) => e,
        };
        let (want_key, want_line) = (m.key.as_str(), lines[&m.line_of]);
        prop_assert_eq!(
            e.key.as_deref(), Some(want_key),
            "{} gave: {}\n--- config ---\n{}", m.what, e, text
        );
        prop_assert_eq!(
            e.line, Some(want_line),
            "{} gave: {}\n--- config ---\n{}", m.what, e, text
        );
        prop_assert!(e.to_string().starts_with(&format!("props.toml:{want_line}:")), "{}", e);
    }

    /// The four errors once located at an enclosing key (a weight of 0, a duplicated endpoint,
    /// a maglev table no larger than the endpoint count, `failure_rate.threshold_percent`),
    /// alone, held to the exact key and line.
    #[test]
    fn formerly_coarse_errors_name_the_exact_key(
        spec in config_spec(),
        which in 0usize..4,
        r in any::<u64>(),
        ci in 0usize..3,
        ej in 0usize..6,
    ) {
        let kind = [34, 35, 39, 40][which];
        let (doc, m) = mutate(&spec, kind, r, ci, 0, ej);
        let (text, lines) = doc.render();
        let e = load(&text).expect_err("refused");
        prop_assert_eq!(e.key.as_deref(), Some(m.key.as_str()), "{}: {}", m.what, e);
        prop_assert_eq!(e.line, Some(lines[&m.line_of]), "{}: {}", m.what, e);
    }
}

/// Every duration option, where it goes in a minimal configuration.
const DURATION_KEYS: &[(&str, &str)] = &[
    ("", "drain_timeout"),
    ("listener", "header_read_timeout"),
    ("listener", "idle_timeout"),
    ("cluster", "decay"),
    ("cluster", "default_rtt"),
    ("cluster", "failure_penalty"),
    ("cluster", "connect_timeout"),
    ("cluster", "request_timeout"),
    ("cluster", "pool_idle_timeout"),
    ("cluster.retry", "budget_window"),
    ("cluster.health_check", "interval"),
    ("cluster.health_check", "timeout"),
    ("cluster.outlier_detection", "interval"),
    ("cluster.outlier_detection", "base_ejection_time"),
    ("cluster.outlier_detection", "max_ejection_time"),
    ("cluster.slow_start", "window"),
];

/// A duration so long that `Instant::now() + d` overflows (about 3e11 years; humantime
/// parses up to about 5.8e11) must be refused at load time: today `idle_timeout` or
/// `header_read_timeout` set so is accepted, and then every client connection panics
/// ("overflow when adding duration to instant", in keel-proxy's body.rs `idle_for` and in
/// hyper's header timer) and gets no answer. Every duration is now at most 365 days
/// (`keel_balance::duration_serde`).
#[test]

fn durations_too_long_for_the_clock_are_refused() {
    let mut accepted = Vec::new();
    for (table, key) in DURATION_KEYS {
        let mut doc = ConfigSpec {
            drain_timeout_ms: 1000,
            admin: None,
            access_log: None,
            listeners: vec![],
            clusters: vec![],
        }
        .doc();
        doc.sections
            .push(Section::new(Some("[[listener]]"), "listener[0]"));
        doc.section("listener[0]").set("listen", q("127.0.0.1:0"));
        doc.section("listener[0]").set("cluster", q("app"));
        doc.sections
            .push(Section::new(Some("[[cluster]]"), "cluster[0]"));
        doc.section("cluster[0]").set("name", q("app"));
        doc.section("cluster[0]")
            .set("endpoints", "[{ address = \"127.0.0.1:9001\" }]");
        let path = match *table {
            "" => String::new(),
            "listener" => "listener[0]".to_string(),
            t => t.replacen("cluster", "cluster[0]", 1),
        };
        if !doc.sections.iter().any(|s| s.path == path) {
            doc.sections
                .push(Section::new(Some(&format!("[{table}]")), &path));
        }
        // max_ejection_time must stay at least base_ejection_time: the longest allowed.
        if *key == "base_ejection_time" {
            doc.section(&path).set("max_ejection_time", q("365d"));
        }
        doc.section(&path).set(key, q("300000000000y"));
        let (text, _) = doc.render();
        match load(&text) {
            Ok(_) if path.is_empty() => accepted.push(key.to_string()),
            Ok(_) => accepted.push(format!("{path}.{key}")),
            Err(e) => assert!(
                e.key.as_deref().is_some_and(|k| k.ends_with(key)),
                "{key}: {e}"
            ),
        }
    }
    assert!(accepted.is_empty(), "accepted: {accepted:?}");
}

/// Found by `scripts/fuzz-config.sh` (config_structured): a request timeout shorter than
/// `attempts + 1` nanoseconds is accepted, and the default per-try timeout
/// (`request_timeout / (attempts + 1)`) is then 0: every try times out at once. Either the
/// configuration should be refused (at `cluster[0].request_timeout`) or the per-try timeout
/// kept above zero. Fixed: request_timeout must be at least 1ms.
#[test]
fn per_try_timeout_is_never_zero() {
    let text = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nrequest_timeout = \"1ns\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    match load(text) {
        Ok(c) => assert!(
            !c.clusters[0].per_try_timeout().is_zero(),
            "accepted with a per-try timeout of 0"
        ),
        Err(e) => assert_eq!(e.key.as_deref(), Some("cluster[0].request_timeout"), "{e}"),
    }
}
