//! Routes that split and match richly, on loopback: a 90/10 `split` measured over 10,000
//! requests (spread by share, and by a `split_by` header, which keeps each user on one side),
//! the `keel_route_*` counters by listener and route agreeing with what the clients saw, and
//! the conditions on a path's regular expression, query parameters and headers' presence.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use hyper::{Method, StatusCode};
use keel_proxy::ProxyConfig;

use crate::support::*;

fn cluster(name: &str, addr: SocketAddr) -> String {
    format!(
        "\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"{name}\"\nendpoints = [{{ address = \"{addr}\" }}]\n"
    )
}

fn load(text: &str) -> ProxyConfig {
    ProxyConfig::from_toml_str(text, "split.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// Sends `n` GETs of `path` over 4 connections, `header(i)` on request `i`; counts the
/// endpoints that answered.
async fn spread(
    proxy: SocketAddr,
    path: &str,
    n: usize,
    header: impl Fn(usize) -> Option<(String, String)> + Clone + Send + 'static,
) -> HashMap<String, usize> {
    const CONNS: usize = 4;
    let mut tasks = Vec::new();
    for c in 0..CONNS {
        let url = format!("http://{proxy}{path}");
        let header = header.clone();
        tasks.push(tokio::spawn(async move {
            let client = client();
            let mut seen: HashMap<String, usize> = HashMap::new();
            for i in (c..n).step_by(CONNS) {
                let h = header(i);
                let headers: Vec<(&str, &str)> =
                    h.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                let r = send(&client, Method::GET, &url, &headers, b"")
                    .await
                    .unwrap();
                assert_eq!(r.status, StatusCode::OK, "{}", r.text());
                *seen
                    .entry(r.header("x-keel-endpoint").unwrap().to_string())
                    .or_default() += 1;
            }
            seen
        }));
    }
    let mut all = HashMap::new();
    for t in tasks {
        for (k, v) in t.await.unwrap() {
            *all.entry(k).or_default() += v;
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_90_10_split_measures_90_percent_within_2_points_and_split_by_keeps_users() {
    let bs = backends(2, Duration::ZERO).await;
    let (a, b) = (bs[0].addr(), bs[1].addr());
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener.route]]\nname = \"canary\"\npath_prefix = \"/spread/\"\n\
         split = [{{ cluster = \"stable\", weight = 90 }}, {{ cluster = \"next\", weight = 10 }}]\n\n\
         [[listener.route]]\npath_prefix = \"/user/\"\nsplit_by = \"header:x-user\"\n\
         split = [{{ cluster = \"stable\", weight = 90 }}, {{ cluster = \"next\", weight = 10 }}]\n{}{}",
        cluster("stable", a),
        cluster("next", b),
    );
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let (addr, admin) = (proxy.listener_addrs()[0], proxy.admin_addr().unwrap());
    const N: usize = 10_000;
    // By share alone: each worker's sequence spreads its requests within a request or two of
    // the share; 2 points of 10,000 is 200 requests.
    let seen = spread(addr, "/spread/x", N, |_| None).await;
    let stable = seen.get(&a.to_string()).copied().unwrap_or(0);
    let next = seen.get(&b.to_string()).copied().unwrap_or(0);
    assert_eq!(stable + next, N, "{seen:?}");
    let share = stable as f64 / N as f64;
    assert!(
        (share - 0.90).abs() <= 0.02,
        "stable took {share:.4} ({seen:?})"
    );
    // By a header: 10,000 users, each one request; the hash's share is binomial (sd 0.3
    // points), so 2 points is over 6 sd.
    let keyed = spread(addr, "/user/x", N, |i| {
        Some(("x-user".to_string(), format!("user-{i}")))
    })
    .await;
    let stable_keyed = keyed.get(&a.to_string()).copied().unwrap_or(0);
    let share = stable_keyed as f64 / N as f64;
    assert!(
        (share - 0.90).abs() <= 0.02,
        "stable took {share:.4} ({keyed:?})"
    );
    // A user stays on one side: 200 users, 5 requests each.
    let client = client();
    let url = format!("http://{addr}/user/y");
    for u in 0..200 {
        let user = format!("sticky-{u}");
        let mut sides = Vec::new();
        for _ in 0..5 {
            let r = send(&client, Method::GET, &url, &[("x-user", &user)], b"")
                .await
                .unwrap();
            sides.push(r.header("x-keel-endpoint").unwrap().to_string());
        }
        sides.dedup();
        assert_eq!(sides.len(), 1, "user {user} moved: {sides:?}");
    }
    // The counters by listener and route say what the clients saw.
    let labels = |route: &str, cluster: &str| {
        format!("keel_route_requests_total{{listener=\"{addr}\",route=\"{route}\",cluster=\"{cluster}\",class=\"2xx\"}}")
    };
    assert_eq!(
        metric(admin, &labels("canary", "stable")).await,
        Some(stable as f64)
    );
    assert_eq!(
        metric(admin, &labels("canary", "next")).await,
        Some(next as f64)
    );
    // The unnamed second route is labelled by its index.
    let keyed_total = metric(admin, &labels("1", "stable")).await.unwrap()
        + metric(admin, &labels("1", "next")).await.unwrap();
    assert_eq!(keyed_total, (N + 1000) as f64);
    let bytes = metric(
        admin,
        &format!("keel_route_response_bytes_total{{listener=\"{addr}\",route=\"canary\",cluster=\"stable\"}}"),
    )
    .await
    .unwrap();
    assert!(
        bytes >= (stable * 20) as f64,
        "{bytes} bytes for {stable} responses"
    );
    let received = metric(
        admin,
        &format!("keel_route_request_bytes_total{{listener=\"{addr}\",route=\"canary\",cluster=\"stable\"}}"),
    )
    .await
    .unwrap();
    // Each GET's head is at least its request line and Host.
    assert!(
        received >= (stable * 30) as f64,
        "{received} bytes for {stable} requests"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_query_and_header_presence_conditions_choose_routes() {
    let bs = backends(6, Duration::ZERO).await;
    let a: Vec<String> = bs.iter().map(|b| b.addr().to_string()).collect();
    let mut text = String::from(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"c5\"\n\n\
         [[listener.route]]\npath_regex = '^/users/[0-9]+$'\ncluster = \"c0\"\n\n\
         [[listener.route]]\npath_prefix = \"/q/\"\nquery = { v = \"2\", debug = { present = true } }\ncluster = \"c1\"\n\n\
         [[listener.route]]\npath_prefix = \"/q/\"\nquery = { id = { regex = '^[0-9]{3}$' }, skip = { absent = true } }\ncluster = \"c2\"\n\n\
         [[listener.route]]\npath_prefix = \"/h/\"\nheaders = { x-beta = { present = true }, x-tier = { exact = \"free\", not = true } }\ncluster = \"c3\"\n\n\
         [[listener.route]]\npath_prefix = \"/h/\"\nheaders = { user-agent = { regex = '(?i)bot' } }\ncluster = \"c4\"\n",
    );
    for (i, b) in bs.iter().enumerate() {
        text.push_str(&cluster(&format!("c{i}"), b.addr()));
    }
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let url = |path: &str| format!("http://{}{path}", proxy.listener_addrs()[0]);
    let client = client();
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case<'_>> = vec![
        ("/users/42", vec![], &a[0]),
        ("/users/42?x=1", vec![], &a[0]),
        ("/users/42/posts", vec![], &a[5]),
        ("/users/x", vec![], &a[5]),
        // Dot segments are resolved before the match.
        ("/a/../users/7", vec![], &a[0]),
        ("/q/x?v=2&debug", vec![], &a[1]),
        ("/q/x?debug=1&v=2", vec![], &a[1]),
        ("/q/x?v=3&debug", vec![], &a[5]),
        ("/q/x?v=2", vec![], &a[5]),
        ("/q/x?id=123", vec![], &a[2]),
        ("/q/x?id=1234", vec![], &a[5]),
        ("/q/x?id=123&skip", vec![], &a[5]),
        ("/h/x", vec![("x-beta", "1")], &a[3]),
        ("/h/x", vec![("x-beta", "1"), ("x-tier", "pro")], &a[3]),
        ("/h/x", vec![("x-beta", "1"), ("x-tier", "free")], &a[5]),
        ("/h/x", vec![("user-agent", "GoogleBot/2.1")], &a[4]),
        ("/h/x", vec![("user-agent", "curl/8")], &a[5]),
    ];
    for (path, headers, want) in &cases {
        let r = send(&client, Method::GET, &url(path), headers, b"")
            .await
            .unwrap();
        assert_eq!(
            r.header("x-keel-endpoint"),
            Some(&want[..]),
            "{path} {headers:?}"
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn a_bad_regex_or_split_is_reported_at_its_line() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\n\n[[listener.route]]\n";
    let clusters = "\n[[cluster]]\nname = \"a\"\nendpoints = [{ address = \"127.0.0.1:9\" }]\n";
    for (route, want) in [
        ("path_regex = '^/users/(['\ncluster = \"a\"\n", "t.toml:5:"),
        (
            "cluster = \"a\"\nheaders = { x = { regex = 'a{99999}{99999}' } }\n",
            "t.toml:6:",
        ),
        (
            "split = [{ cluster = \"a\", weight = 1 }, { cluster = \"b\", weight = 1 }]\n",
            "t.toml:5:",
        ),
        (
            "cluster = \"a\"\nsplit_by = \"header:x-user\"\n",
            "t.toml:6:",
        ),
        (
            "cluster = \"a\"\nmirror = { cluster = \"a\", percent = 101 }\n",
            "t.toml:6:",
        ),
        (
            "cluster = \"a\"\nquery = { x = { present = true, exact = \"1\" } }\n",
            "t.toml:6:",
        ),
    ] {
        let text = format!("{base}{route}{clusters}");
        let e = ProxyConfig::from_toml_str(&text, "t.toml")
            .expect_err(&text)
            .to_string();
        assert!(e.starts_with(want), "{want} for\n{text}\ngot: {e}");
    }
}

/// The text format's rules that Prometheus' parser enforces, checked on `/metrics` with every
/// route label set in it: each sample's family has its `# TYPE` before it, no series twice,
/// every value a number. `scripts/check-metrics.sh` runs promtool on the same text
/// (`KEEL_METRICS_OUT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_by_listener_and_route_are_well_formed_text() {
    let bs = backends(3, Duration::ZERO).await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n\n\
         [[listener.route]]\nname = \"canary\"\npath_prefix = \"/s/\"\n\
         split = [{{ cluster = \"a\", weight = 1 }}, {{ cluster = \"b\", weight = 1 }}]\n\n\
         [[listener.route]]\npath_prefix = \"/m/\"\ncluster = \"a\"\nmirror = {{ cluster = \"m\" }}\n\n\
         [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"b\"\n{}{}{}",
        cluster("a", bs[0].addr()),
        cluster("b", bs[1].addr()),
        cluster("m", bs[2].addr()),
    );
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let admin = proxy.admin_addr().unwrap();
    for l in proxy.listener_addrs() {
        for path in ["/s/1", "/s/2", "/m/1", "/x"] {
            get(&format!("http://{l}{path}")).await.unwrap();
        }
    }
    let body = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    // For Prometheus' own checker (scripts/check-metrics.sh).
    if let Ok(path) = std::env::var("KEEL_METRICS_OUT") {
        std::fs::write(path, &body).unwrap();
    }
    let mut typed = std::collections::HashSet::new();
    let mut series = std::collections::HashSet::new();
    for line in body.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split(' ').next().unwrap();
            assert!(typed.insert(name.to_string()), "TYPE {name} twice");
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap();
        assert!(
            value.parse::<f64>().is_ok() || value == "+Inf",
            "value of {line}"
        );
        let name = key.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "{name} before its TYPE");
        assert!(series.insert(key.to_string()), "{key} twice");
    }
    let routes = body
        .lines()
        .filter(|l| l.starts_with("keel_route_requests_total{"))
        .count();
    // Listener 1: canary -> a, canary -> b, route 1 -> a, default -> a; listener 2: default.
    assert_eq!(routes, 5 * 5, "{body}");
    assert!(body.contains("keel_route_mirrored_total{"), "{body}");
    proxy.shutdown(Duration::from_secs(1)).await;
}
