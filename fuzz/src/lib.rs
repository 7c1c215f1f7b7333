//! Shared code of keel's configuration fuzz targets: the checks run on every input, and a
//! generator of structured-but-random TOML documents that use the real option names, so that
//! the fuzzer gets past the TOML parser and serde into `validate` and the balancer builder.

use std::fmt::Write as _;
use std::time::Duration;

use arbitrary::{Arbitrary, Unstructured};
use keel_balance::{Balancer, Outcome, PickContext, RetryBudget};
use keel_proxy::ProxyConfig;

/// Loads `text` as a proxy configuration and checks what must hold whatever the input:
/// no panic (the fuzzer catches those), an error that renders and points inside the text, and
/// a configuration that, once accepted, really builds a balancer for every cluster.
pub fn check(text: &str) {
    match ProxyConfig::from_toml_str(text, "fuzz.toml") {
        Err(e) => {
            let shown = e.to_string();
            assert!(shown.starts_with("fuzz.toml"), "{shown}");
            assert!(!e.message.is_empty(), "empty message: {shown}");
            if let Some(line) = e.line {
                // A line past the end would send the user to nothing.
                let lines = text.split('\n').count();
                assert!(
                    line >= 1 && line <= lines,
                    "line {line} of {lines}: {shown}"
                );
                assert!(e.column.is_some_and(|c| c >= 1), "{shown}");
            }
        }
        Ok(config) => check_accepted(&config),
    }
}

/// What an accepted configuration promises to the proxy that runs it.
fn check_accepted(config: &ProxyConfig) {
    assert!(!config.listeners.is_empty() && !config.clusters.is_empty());
    for l in &config.listeners {
        let named = l.cluster.iter().chain(l.routes.iter().map(|r| &r.cluster));
        for name in named {
            assert!(
                config.cluster(name).is_some(),
                "listener routed to the missing cluster {name:?}"
            );
        }
        assert!(
            l.cluster.is_some() || !l.routes.is_empty(),
            "a listener with neither routes nor a cluster"
        );
    }
    for c in &config.clusters {
        let lb = Balancer::new(c.balancer_config(), &c.endpoints).unwrap_or_else(|e| {
            panic!("cluster {:?} was accepted but does not build: {e}", c.name)
        });
        if c.discovery.is_some() {
            // Its endpoints come when the source answers: it starts empty (503s).
            assert!(
                c.endpoints.is_empty(),
                "cluster {:?}: endpoints and discovery",
                c.name
            );
            let _ = c.discovery.as_ref().map(|d| (d.describe(), d.refresh()));
            continue;
        }
        // Every endpoint starts healthy, so a pick must succeed (with and without a hash key).
        let now = Duration::from_millis(1);
        // Both picks come before any outcome: a failure may eject the endpoint (failure rate
        // with minimum_requests = 0), and with the panic threshold off a cluster of one then
        // rightly has nothing to pick.
        let pick = lb.pick(&PickContext::new(now)).expect("a pick");
        let hashed = lb
            .pick(&PickContext::new(now).with_hash_key(0x6b65_656c))
            .expect("a hashed pick");
        lb.finish(hashed, Outcome::Success, now + Duration::from_millis(2));
        lb.finish(pick, Outcome::Failure, now + Duration::from_millis(3));
        let _ = lb.status(now);
        let per_try = c.per_try_timeout();
        assert!(
            per_try <= c.timeouts.request,
            "per-try timeout {per_try:?} above the request timeout {:?}",
            c.timeouts.request
        );
        // Found by this fuzzer (request_timeout = "1ns" gave a per-try timeout of 0); fixed:
        // request_timeout must be at least 1ms.
        assert!(
            !per_try.is_zero(),
            "per-try timeout 0 (request_timeout {:?}, attempts {})",
            c.timeouts.request,
            c.protections.retry.attempts
        );
        let budget = RetryBudget::new(c.protections.retry.budget());
        budget.record_request(now);
        let _ = budget.try_retry(now);
    }
}

/// The type of value an option takes (what the generator writes when it writes a well-typed
/// value).
#[derive(Clone, Copy, Debug)]
enum Kind {
    Count,
    Size,
    Float,
    Percent,
    Duration,
    Address,
    ClusterRef,
    Strategy,
    TieBreak,
    HashOn,
    Statuses,
    Path,
    Token,
    Endpoints,
    Seed,
    Weight,
    /// A PEM file path (none of them holds a usable certificate: the error paths).
    File,
    ServerName,
    /// A cluster's `discovery` inline table (`dns`, `srv` or `file`, with or without `port`,
    /// `resolver`, `refresh`).
    Discovery,
    /// A route's `host`.
    Host,
    /// A route's `methods`.
    Methods,
    /// A route's `headers` inline table.
    Headers,
    /// `[access_log]`'s `format`.
    LogFormat,
}

const TOP_KEYS: &[(&str, Kind)] = &[("drain_timeout", Kind::Duration)];
const ADMIN_KEYS: &[(&str, Kind)] = &[("listen", Kind::Address), ("token", Kind::Token)];
const LISTENER_KEYS: &[(&str, Kind)] = &[
    ("listen", Kind::Address),
    ("cluster", Kind::ClusterRef),
    ("max_connections", Kind::Size),
    ("max_header_bytes", Kind::Size),
    ("max_headers", Kind::Size),
    ("header_read_timeout", Kind::Duration),
    ("idle_timeout", Kind::Duration),
    ("max_request_body_bytes", Kind::Size),
];
const CLUSTER_KEYS: &[(&str, Kind)] = &[
    ("name", Kind::ClusterRef),
    ("strategy", Kind::Strategy),
    ("endpoints", Kind::Endpoints),
    ("tie_break", Kind::TieBreak),
    ("choices", Kind::Count),
    ("decay", Kind::Duration),
    ("default_rtt", Kind::Duration),
    ("failure_penalty", Kind::Duration),
    ("vnodes", Kind::Count),
    ("table_size", Kind::Size),
    ("bounded_load", Kind::Float),
    ("panic_threshold", Kind::Percent),
    ("seed", Kind::Seed),
    ("hash_on", Kind::HashOn),
    ("connect_timeout", Kind::Duration),
    ("request_timeout", Kind::Duration),
    ("max_buffered_response", Kind::Size),
    ("pool_idle_timeout", Kind::Duration),
    ("pool_max_idle_per_endpoint", Kind::Size),
    ("max_in_flight", Kind::Size),
    ("discovery", Kind::Discovery),
];
const ROUTE_KEYS: &[(&str, Kind)] = &[
    ("host", Kind::Host),
    ("path", Kind::Path),
    ("path_prefix", Kind::Path),
    ("methods", Kind::Methods),
    ("headers", Kind::Headers),
    ("cluster", Kind::ClusterRef),
    ("request_timeout", Kind::Duration),
    ("retry_attempts", Kind::Count),
];
const ACCESS_LOG_KEYS: &[(&str, Kind)] = &[("path", Kind::File), ("format", Kind::LogFormat)];
const RETRY_KEYS: &[(&str, Kind)] = &[
    ("attempts", Kind::Count),
    ("per_try_timeout", Kind::Duration),
    ("retry_on_status", Kind::Statuses),
    ("budget_percent", Kind::Percent),
    ("min_retries_per_second", Kind::Float),
    ("budget_window", Kind::Duration),
];
const HEALTH_KEYS: &[(&str, Kind)] = &[
    ("path", Kind::Path),
    ("interval", Kind::Duration),
    ("timeout", Kind::Duration),
    ("unhealthy_threshold", Kind::Count),
    ("healthy_threshold", Kind::Count),
];
const OUTLIER_KEYS: &[(&str, Kind)] = &[
    ("consecutive_failures", Kind::Count),
    ("interval", Kind::Duration),
    ("base_ejection_time", Kind::Duration),
    ("max_ejection_time", Kind::Duration),
    ("max_ejection_percent", Kind::Percent),
];
const FAILURE_RATE_KEYS: &[(&str, Kind)] = &[
    ("threshold_percent", Kind::Percent),
    ("minimum_requests", Kind::Count),
];
const SLOW_START_KEYS: &[(&str, Kind)] = &[
    ("window", Kind::Duration),
    ("aggression", Kind::Float),
    ("min_weight_percent", Kind::Percent),
];
const ENDPOINT_KEYS: &[(&str, Kind)] = &[("address", Kind::Address), ("weight", Kind::Weight)];
const LISTENER_TLS_KEYS: &[(&str, Kind)] = &[("cert", Kind::File), ("key", Kind::File)];
const CLUSTER_TLS_KEYS: &[(&str, Kind)] = &[("ca", Kind::File), ("server_name", Kind::ServerName)];

/// Integers at and around every bound in the configuration.
const EDGE_INTS: &[i128] = &[
    0,
    1,
    2,
    3,
    10,
    11,
    100,
    160,
    251,
    399,
    400,
    502,
    599,
    600,
    8191,
    8192,
    65536,
    65537,
    4999999,
    5000011,
    5000012,
    4294967295,
    4294967296,
    18446744073709551557, // the largest prime below 2^64 (out of i64 range: a TOML error)
    i64::MAX as i128,
    -1,
    i64::MIN as i128,
];
const EDGE_FLOATS: &[&str] = &[
    "0", "0.0", "0.5", "1", "1.0", "1.25", "50", "99.9", "100", "100.0001", "-0.0", "-1", "inf",
    "-inf", "nan", "1e308", "5e-324",
];
const DURATION_UNITS: &[&str] = &[
    "ns", "us", "ms", "s", "m", "h", "d", "w", "M", "y", "sec", "min", "", "x",
];
const STRATEGIES: &[&str] = &[
    "round-robin",
    "weighted-round-robin",
    "random",
    "weighted-random",
    "least-connections",
    "least-request",
    "least-time",
    "peak-ewma",
    "ring-hash",
    "maglev",
    "rendezvous",
    "fastest",
    "",
    "Round-Robin",
];
const CLUSTER_NAMES: &[&str] = &["app", "web", "a", "", "app "];
const HOSTS: &[&str] = &[
    "127.0.0.1",
    "[::1]",
    "0.0.0.0",
    "10.1.2.3",
    "localhost",
    "[::]",
    "example.com",
    "",
    "::1",
    "256.0.0.1",
];

/// A value: mostly (7 in 8) of the option's own kind, else of another kind, a boolean, a free
/// string or a TOML construct where a scalar goes. One wrong value stops a document at serde,
/// so wrong ones must stay rare for most documents to reach validation.
#[derive(Arbitrary, Debug)]
struct Val {
    mode: u8,
    sel: u16,
    n: u64,
    other: Other,
}

#[derive(Arbitrary, Debug)]
enum Other {
    Kind(u8),
    Bool(bool),
    Text(String),
    Raw(RawToml),
}

/// A few bytes of TOML syntax that serde must refuse (arrays, tables, dates where scalars go).
#[derive(Arbitrary, Debug)]
enum RawToml {
    EmptyArray,
    EmptyInlineTable,
    Date,
    Float(f64),
    Int(i64),
    Nested(Vec<u16>),
}

/// One `key = value` line: a known key of the table (chosen by index) or a made-up one.
#[derive(Arbitrary, Debug)]
struct Entry {
    key: u8,
    unknown_key: Option<String>,
    value: Val,
}

/// `[cluster.*]` sub-tables.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Sub {
    Retry,
    HealthCheck,
    OutlierDetection,
    FailureRate,
    SlowStart,
    Tls,
}

#[derive(Arbitrary, Debug)]
struct ClusterDoc {
    name: u8,
    /// `discovery` in place of `endpoints` (both when the entries add `endpoints`).
    discovery: Option<Val>,
    endpoints: Option<Vec<Vec<Entry>>>,
    entries: Vec<Entry>,
    subs: Vec<(Sub, Vec<Entry>)>,
}

#[derive(Arbitrary, Debug)]
struct ListenerDoc {
    cluster: u8,
    port: u16,
    entries: Vec<Entry>,
    /// `[[listener.route]]` tables.
    routes: Vec<Vec<Entry>>,
    tls: Option<Vec<Entry>>,
}

/// A whole configuration document, rendered to TOML by [`Doc::render`].
#[derive(Arbitrary, Debug)]
pub struct Doc {
    /// Unless its low three bits are 0, an empty listener or cluster list gets one default
    /// entry (an empty list is one error; most documents should get past it).
    bare: u8,
    clusters: Vec<ClusterDoc>,
    listeners: Vec<ListenerDoc>,
    admin: Option<Vec<Entry>>,
    access_log: Option<Vec<Entry>>,
    top: Vec<Entry>,
}

impl Doc {
    /// A document from fuzzer bytes.
    pub fn from_bytes(data: &[u8]) -> arbitrary::Result<Doc> {
        Doc::arbitrary_take_rest(Unstructured::new(data))
    }

    /// The TOML text. Listeners and clusters start valid (a name, an address, one endpoint)
    /// unless the entries override that, so that most documents reach validation.
    pub fn render(&self) -> String {
        let mut out = String::new();
        write_entries(&mut out, TOP_KEYS, &self.top, &[]);
        if let Some(admin) = &self.admin {
            out.push_str("[admin]\n");
            write_entries(&mut out, ADMIN_KEYS, admin, &[]);
        }
        if let Some(log) = &self.access_log {
            out.push_str("[access_log]\n");
            write_entries(&mut out, ACCESS_LOG_KEYS, log, &[("path", quote("-"))]);
        }
        let default_listener = [ListenerDoc {
            cluster: 0,
            port: 0,
            entries: Vec::new(),
            routes: Vec::new(),
            tls: None,
        }];
        let listeners: &[ListenerDoc] = if self.listeners.is_empty() && !self.bare.is_multiple_of(8)
        {
            &default_listener
        } else {
            &self.listeners
        };
        let default_cluster = [ClusterDoc {
            name: 0,
            discovery: None,
            endpoints: None,
            entries: Vec::new(),
            subs: Vec::new(),
        }];
        let clusters: &[ClusterDoc] = if self.clusters.is_empty() && !self.bare.is_multiple_of(8) {
            &default_cluster
        } else {
            &self.clusters
        };
        for l in listeners {
            out.push_str("[[listener]]\n");
            let base = [
                ("listen", format!("\"127.0.0.1:{}\"", l.port % 4)),
                ("cluster", quote(pick(CLUSTER_NAMES, l.cluster as u64))),
            ];
            write_entries(&mut out, LISTENER_KEYS, &l.entries, &base);
            for route in &l.routes {
                out.push_str("[[listener.route]]\n");
                let base = [("cluster", quote(pick(CLUSTER_NAMES, route.len() as u64)))];
                write_entries(&mut out, ROUTE_KEYS, route, &base);
            }
            if let Some(tls) = &l.tls {
                out.push_str("[listener.tls]\n");
                let base = [("cert", quote("/dev/null")), ("key", quote("/dev/null"))];
                write_entries(&mut out, LISTENER_TLS_KEYS, tls, &base);
            }
        }
        for c in clusters {
            out.push_str("[[cluster]]\n");
            let endpoints = match &c.endpoints {
                None => "[{ address = \"127.0.0.1:9001\" }]".to_string(),
                Some(list) => {
                    let items: Vec<String> = list
                        .iter()
                        .enumerate()
                        .map(|(i, e)| {
                            let mut t = String::new();
                            let base = [("address", format!("\"127.0.0.1:{}\"", 9001 + i))];
                            write_inline(&mut t, ENDPOINT_KEYS, e, &base);
                            t
                        })
                        .collect();
                    format!("[{}]", items.join(", "))
                }
            };
            let base = [
                ("name", quote(pick(CLUSTER_NAMES, c.name as u64))),
                match &c.discovery {
                    Some(v) => ("discovery", value(Kind::Discovery, v)),
                    None => ("endpoints", endpoints),
                },
            ];
            write_entries(&mut out, CLUSTER_KEYS, &c.entries, &base);
            let mut written: Vec<&str> = Vec::new();
            for (sub, entries) in &c.subs {
                let (header, keys) = match sub {
                    Sub::Retry => ("[cluster.retry]", RETRY_KEYS),
                    Sub::HealthCheck => ("[cluster.health_check]", HEALTH_KEYS),
                    Sub::OutlierDetection => ("[cluster.outlier_detection]", OUTLIER_KEYS),
                    Sub::FailureRate => (
                        "[cluster.outlier_detection.failure_rate]",
                        FAILURE_RATE_KEYS,
                    ),
                    Sub::SlowStart => ("[cluster.slow_start]", SLOW_START_KEYS),
                    Sub::Tls => ("[cluster.tls]", CLUSTER_TLS_KEYS),
                };
                // A table defined twice is a TOML error that would end most documents at
                // the parser.
                if written.contains(&header) {
                    continue;
                }
                written.push(header);
                out.push_str(header);
                out.push('\n');
                let base: &[(&str, String)] = match sub {
                    Sub::Tls => &[("ca", quote("/dev/null"))],
                    _ => &[],
                };
                write_entries(&mut out, keys, entries, base);
            }
        }
        out
    }
}

/// The key and value text of each entry, the first occurrence of a key winning (a repeated
/// key is a TOML error, which would stop most documents at the parser), then the `base`
/// entries not overridden.
fn lines(keys: &[(&str, Kind)], entries: &[Entry], base: &[(&str, String)]) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for e in entries {
        let (key, kind) = match &e.unknown_key {
            Some(k) if e.key % 8 == 7 => (bare_or_quoted(k), Kind::Count),
            _ => {
                let (k, kind) = keys[e.key as usize % keys.len()];
                (k.to_string(), kind)
            }
        };
        if seen.contains(&key) {
            continue;
        }
        out.push(format!("{key} = {}", value(kind, &e.value)));
        seen.push(key);
    }
    for (k, v) in base {
        if !seen.iter().any(|s| s == k) {
            out.push(format!("{k} = {v}"));
        }
    }
    out
}

fn write_entries(
    out: &mut String,
    keys: &[(&str, Kind)],
    entries: &[Entry],
    base: &[(&str, String)],
) {
    for l in lines(keys, entries, base) {
        out.push_str(&l);
        out.push('\n');
    }
}

fn write_inline(
    out: &mut String,
    keys: &[(&str, Kind)],
    entries: &[Entry],
    base: &[(&str, String)],
) {
    let _ = write!(out, "{{ {} }}", lines(keys, entries, base).join(", "));
}

fn pick<'a>(list: &[&'a str], n: u64) -> &'a str {
    list[(n % list.len() as u64) as usize]
}

/// A TOML basic string (escaping what must be escaped).
fn quote(s: &str) -> String {
    let mut q = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(q, "\\u{:04X}", c as u32);
            }
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

fn bare_or_quoted(k: &str) -> String {
    if !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        k.to_string()
    } else {
        quote(k)
    }
}

fn value(kind: Kind, v: &Val) -> String {
    if v.mode < 224 {
        return typed(kind, v.sel, v.n);
    }
    match &v.other {
        Other::Kind(k) => {
            const KINDS: [Kind; 23] = [
                Kind::Count,
                Kind::Size,
                Kind::Float,
                Kind::Percent,
                Kind::Duration,
                Kind::Address,
                Kind::ClusterRef,
                Kind::Strategy,
                Kind::TieBreak,
                Kind::HashOn,
                Kind::Statuses,
                Kind::Path,
                Kind::Token,
                Kind::Endpoints,
                Kind::Seed,
                Kind::Weight,
                Kind::File,
                Kind::ServerName,
                Kind::Discovery,
                Kind::Host,
                Kind::Methods,
                Kind::Headers,
                Kind::LogFormat,
            ];
            typed(KINDS[*k as usize % KINDS.len()], v.sel, v.n)
        }
        Other::Bool(b) => b.to_string(),
        Other::Text(s) => quote(s),
        Other::Raw(r) => match r {
            RawToml::EmptyArray => "[]".into(),
            RawToml::EmptyInlineTable => "{}".into(),
            RawToml::Date => "1979-05-27T07:32:00Z".into(),
            RawToml::Float(f) => float_text(*f),
            RawToml::Int(i) => i.to_string(),
            RawToml::Nested(xs) => format!(
                "[{}]",
                xs.iter()
                    .map(|x| format!("[{x}]"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    }
}

fn float_text(f: f64) -> String {
    if f.is_nan() {
        "nan".into()
    } else if f.is_infinite() {
        if f > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{f:?}")
    }
}

/// An integer: mostly one of the edge values, else a small or a full-width one.
fn int(sel: u16, n: u64) -> String {
    match sel % 4 {
        0 | 1 => EDGE_INTS[(n % EDGE_INTS.len() as u64) as usize].to_string(),
        2 => (n % 1000).to_string(),
        _ => (n as i64).to_string(),
    }
}

fn typed(kind: Kind, sel: u16, n: u64) -> String {
    match kind {
        Kind::Count | Kind::Size | Kind::Seed | Kind::Weight => int(sel, n),
        Kind::Float | Kind::Percent => match sel % 3 {
            0 => pick(EDGE_FLOATS, n).to_string(),
            1 => format!("{}.{}", n % 200, (n >> 8) % 100),
            _ => float_text(f64::from_bits(n)),
        },
        Kind::Duration => {
            let amount = match sel % 3 {
                0 => n % 1000,
                1 => EDGE_INTS[(n % EDGE_INTS.len() as u64) as usize].max(0) as u64,
                _ => n,
            };
            let unit = pick(DURATION_UNITS, (sel / 4) as u64);
            if sel % 16 == 15 {
                quote(&format!("{amount}{unit} {}ms", n % 7))
            } else {
                quote(&format!("{amount}{unit}"))
            }
        }
        Kind::Address => {
            let host = pick(HOSTS, n);
            let port = match sel % 4 {
                0 => "0".to_string(),
                1 => (9000 + sel as u32 % 8).to_string(),
                2 => (n >> 16).to_string(),
                _ => String::new(),
            };
            if port.is_empty() {
                quote(host)
            } else {
                quote(&format!("{host}:{port}"))
            }
        }
        Kind::ClusterRef => quote(pick(CLUSTER_NAMES, n)),
        Kind::Strategy => quote(pick(STRATEGIES, n)),
        Kind::TieBreak => quote(pick(&["random", "lowest-index", "first"], n)),
        Kind::HashOn => quote(pick(
            &[
                "path",
                "client-ip",
                "header:x-user",
                "header:X-User",
                "header:",
                "header:bad name",
                "header: x",
                "cookie",
            ],
            n,
        )),
        Kind::Statuses => {
            let len = sel % 5;
            let items: Vec<String> = (0..len)
                .map(|i| int(sel.rotate_left(i as u32 * 3), n.rotate_left(i as u32 * 13)))
                .collect();
            format!("[{}]", items.join(", "))
        }
        Kind::Path => quote(pick(
            &[
                "/healthz", "/", "healthz", "", "/a b", "/?q=1", "/\u{7f}", "//x",
            ],
            n,
        )),
        Kind::Token => quote(pick(
            &[
                "change-me-to-a-long-random-string",
                "short",
                "sixteen-chars-ok",
                "with a space in it!!",
                "tab\tin-the-middle-x",
                "",
            ],
            n,
        )),
        // Never a device or a FIFO: reading `/dev/zero` does not end (a known bug, reported).
        Kind::File => quote(pick(
            &[
                "/nonexistent/cert.pem",
                "/dev/null",
                "",
                "certs/server.pem",
                "/etc/hostname",
                "/",
                "Cargo.toml",
            ],
            n,
        )),
        Kind::ServerName => quote(pick(
            &[
                "localhost",
                "",
                "bad name",
                "127.0.0.1",
                "a..b",
                "xn--",
                "[::1]",
            ],
            n,
        )),
        Kind::Discovery => {
            let name = pick(
                &[
                    "api.internal.test",
                    "_http._tcp.api.internal.test",
                    "api.internal.test.",
                    "a..b",
                    "",
                    "api internal",
                    "_http.api.test",
                    "api.test:53",
                ],
                n,
            );
            let mut parts = match sel % 5 {
                0 | 1 => vec![format!("dns = {}", quote(name))],
                2 => vec![format!("srv = {}", quote(name))],
                3 => vec![format!("file = {}", typed(Kind::File, sel >> 3, n >> 5))],
                _ => vec![
                    format!("dns = {}", quote(name)),
                    format!("srv = {}", quote(name)),
                ],
            };
            // `dns` needs a port: mostly a good one, so that most such clusters get past it.
            if sel & 0x10 != 0 {
                parts.push(format!("port = {}", int(sel >> 5, n >> 7)));
            } else if sel % 5 < 2 {
                parts.push("port = 9000".into());
            }
            if sel & 0x20 != 0 {
                parts.push(format!(
                    "resolver = {}",
                    typed(Kind::Address, sel >> 6, n >> 9)
                ));
            }
            if sel & 0x40 != 0 {
                parts.push(format!(
                    "refresh = {}",
                    typed(Kind::Duration, sel >> 7, n >> 11)
                ));
            }
            format!("{{ {} }}", parts.join(", "))
        }
        Kind::Host => quote(pick(
            &[
                "api.example.test",
                "*.example.test",
                "API.Example.Test",
                "*",
                "*.",
                "a..b",
                "api.example.test:8080",
                "http://a.test",
                "[::1]",
                "",
            ],
            n,
        )),
        Kind::Methods => {
            let all = ["GET", "HEAD", "POST", "DELETE", "get", "", "G ET", "PURGE"];
            let len = sel % 4;
            let items: Vec<String> = (0..len)
                .map(|i| quote(pick(&all, n.rotate_left(i as u32 * 11))))
                .collect();
            format!("[{}]", items.join(", "))
        }
        Kind::Headers => {
            let names = ["x-canary", "X-Tenant", "bad name", "", "host"];
            let values = ["1", "", "a b", "\u{7f}", "v"];
            let len = sel % 3;
            let items: Vec<String> = (0..len)
                .map(|i| {
                    let k = pick(&names, n.rotate_left(i as u32 * 5));
                    let v = pick(&values, n.rotate_left(i as u32 * 9));
                    format!("{} = {}", bare_or_quoted(k), quote(v))
                })
                .collect();
            format!("{{ {} }}", items.join(", "))
        }
        Kind::LogFormat => quote(pick(&["json", "combined", "JSON", "nginx", ""], n)),
        Kind::Endpoints => {
            let len = sel % 4;
            let items: Vec<String> = (0..len)
                .map(|i| {
                    let addr = typed(
                        Kind::Address,
                        sel.wrapping_add(i),
                        n.rotate_left(i as u32 * 7),
                    );
                    if n & (1 << i) != 0 {
                        format!("{{ address = {addr}, weight = {} }}", int(sel >> 2, n >> i))
                    } else {
                        format!("{{ address = {addr} }}")
                    }
                })
                .collect();
            format!("[{}]", items.join(", "))
        }
    }
}
