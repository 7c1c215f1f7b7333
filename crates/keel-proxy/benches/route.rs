//! Route matching with 1,000 routes (goal: at most 1 µs a request, no allocation).
//!
//! `cargo bench -p keel-proxy --bench route`. Four tables of 1,000 routes each:
//! - `hosts`: 100 exact hosts x 10 path prefixes; the request takes the last route;
//! - `wildcards`: 1,000 `*.dN.example.test` hosts; the request is two labels under the last;
//! - `prefixes`: one host, 1,000 path prefixes; the request takes the last;
//! - `miss`: the `hosts` table and a request that no route matches (every candidate looked at);
//! - `headers`: 1,000 routes on a header alone (`x-tenant = "tN"`); the request takes the last.
//! - `regex`: 1,000 routes on an anchored `path_regex` alone (`^/rN/[0-9]+$`): the index
//!   files each under its literal first segment, one expression runs;
//! - `regex-unindexed`: 1,000 unanchored ones (`/rN/[0-9]+$`): nothing narrows them, so the
//!   request that takes the last runs 1,000 expressions (the worst case);
//! - `query`: 1,000 routes on an exact query parameter alone (`tenant = "tN"`);
//! - `present`: 1,000 routes on a header's presence alone (`x-tN = { present = true }`);
//! - `split`: the `prefixes` table whose last route is a 90/10 `split` by a header.
//!
//! Before measuring, the bench counts heap allocations (a counting global allocator) over
//! 10,000 matches of each case and fails if there is any. The first match of each case runs
//! before the count: a regular expression's first match on a thread allocates its scratch
//! space (the `regex` crate keeps it for that thread), once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use keel_proxy::{ProxyConfig, RouteMatcher};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const CLUSTERS: &str = "\n[[cluster]]\nname = \"a\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n\n[[cluster]]\nname = \"b\"\nendpoints = [{ address = \"127.0.0.1:9002\" }]\n";

fn table(routes: impl Iterator<Item = String>) -> RouteMatcher {
    let mut text = String::from("[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n");
    for r in routes {
        text.push_str("\n[[listener.route]]\n");
        text.push_str(&r);
        text.push_str("cluster = \"b\"\n");
    }
    text.push_str(CLUSTERS);
    let config = ProxyConfig::from_toml_str(&text, "bench.toml").unwrap();
    RouteMatcher::new(&config, 0).unwrap()
}

/// Typical browser-like request headers, with `extra` last.
fn headers<'a>(host: &'a str, extra: (&'a str, &'a [u8])) -> Vec<(&'a str, &'a [u8])> {
    vec![
        ("host", host.as_bytes()),
        ("user-agent", b"Mozilla/5.0 (X11; Linux x86_64) keel-bench"),
        ("accept", b"text/html,application/xhtml+xml"),
        ("accept-encoding", b"gzip, deflate, br"),
        ("accept-language", b"en-GB,en;q=0.9"),
        ("cookie", b"session=0123456789abcdef"),
        ("x-request-id", b"7f1c2a9e-8d0b-4c7e-9a1b-2c3d4e5f6a7b"),
        extra,
    ]
}

struct Case {
    name: &'static str,
    table: RouteMatcher,
    method: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, &'static [u8])>,
    want: Option<usize>,
}

fn cases() -> Vec<Case> {
    let hosts = || {
        table((0..100).flat_map(|h| {
            (0..10)
                .map(move |p| format!("host = \"h{h}.example.test\"\npath_prefix = \"/svc{p}/\"\n"))
        }))
    };
    vec![
        Case {
            name: "hosts",
            table: hosts(),
            method: "GET",
            path: "/svc9/items/42?page=3",
            headers: headers("H99.example.test:8080", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "wildcards",
            table: table((0..1000).map(|i| format!("host = \"*.d{i}.example.test\"\npath_prefix = \"/api/\"\n"))),
            method: "GET",
            path: "/api/users",
            headers: headers("a.b.d999.example.test", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "prefixes",
            table: table((0..1000).map(|i| format!("host = \"api.example.test\"\npath_prefix = \"/p{i}/\"\nmethods = [\"GET\", \"POST\"]\n"))),
            method: "POST",
            path: "/p999/orders",
            headers: headers("api.example.test", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "miss",
            table: hosts(),
            method: "GET",
            path: "/other/x",
            headers: headers("h99.example.test", ("x-tenant", b"t1")),
            want: None,
        },
        Case {
            name: "headers",
            table: table((0..1000).map(|i| format!("headers = {{ x-tenant = \"t{i}\" }}\n"))),
            method: "GET",
            path: "/",
            headers: headers("api.example.test", ("x-tenant", b"t999")),
            want: Some(999),
        },
        Case {
            name: "regex",
            table: table((0..1000).map(|i| format!("path_regex = '^/r{i}/[0-9]+$'\n"))),
            method: "GET",
            path: "/r999/42",
            headers: headers("api.example.test", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "regex-unindexed",
            table: table((0..1000).map(|i| format!("path_regex = '/r{i}/[0-9]+$'\n"))),
            method: "GET",
            path: "/r999/42",
            headers: headers("api.example.test", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "query",
            table: table((0..1000).map(|i| format!("query = {{ tenant = \"t{i}\" }}\n"))),
            method: "GET",
            path: "/items?page=3&tenant=t999",
            headers: headers("api.example.test", ("x-tenant", b"t1")),
            want: Some(999),
        },
        Case {
            name: "present",
            table: table((0..1000).map(|i| format!("headers = {{ x-t{i} = {{ present = true }} }}\n"))),
            method: "GET",
            path: "/",
            headers: headers("api.example.test", ("x-t999", b"1")),
            want: Some(999),
        },
        Case {
            name: "split",
            table: split_table(),
            method: "POST",
            path: "/p999/orders",
            headers: headers("api.example.test", ("x-user", b"u-12345")),
            want: Some(999),
        },
    ]
}

/// The `prefixes` table, its last route a 90/10 `split` by `x-user`.
fn split_table() -> RouteMatcher {
    let mut text = String::from("[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n");
    for i in 0..1000 {
        text.push_str(&format!("\n[[listener.route]]\nhost = \"api.example.test\"\npath_prefix = \"/p{i}/\"\nmethods = [\"GET\", \"POST\"]\n"));
        if i == 999 {
            text.push_str("split_by = \"header:x-user\"\nsplit = [{ cluster = \"a\", weight = 90 }, { cluster = \"b\", weight = 10 }]\n");
        } else {
            text.push_str("cluster = \"b\"\n");
        }
    }
    text.push_str(CLUSTERS);
    let config = ProxyConfig::from_toml_str(&text, "bench.toml").unwrap();
    RouteMatcher::new(&config, 0).unwrap()
}

fn bench(c: &mut Criterion) {
    let cases = cases();
    for case in &cases {
        // Each thread's first match of an expression allocates its scratch space, once.
        case.table
            .choose(case.method, case.path, None, &case.headers);
        let before = ALLOCATIONS.load(Relaxed);
        for _ in 0..10_000 {
            let got = case
                .table
                .choose(case.method, case.path, None, &case.headers);
            assert_eq!(got, case.want, "{}", case.name);
        }
        let allocated = ALLOCATIONS.load(Relaxed) - before;
        assert_eq!(
            allocated, 0,
            "{}: {allocated} allocations in 10,000 matches",
            case.name
        );
    }
    let mut g = c.benchmark_group("route-1000");
    for case in &cases {
        g.bench_function(case.name, |b| {
            b.iter(|| {
                case.table.choose(
                    black_box(case.method),
                    black_box(case.path),
                    None,
                    black_box(&case.headers),
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
