//! Sticky sessions (the proxy's side) on loopback: the cookie keel inserts on
//! a session's first answer (opaque: no address in it) and honours over HTTP/1.1 and HTTP/2;
//! a session whose endpoint refuses connections moves once to the endpoint that answered, and
//! stays there when the first one comes back; a session whose endpoint was removed by a reload
//! moves too; `hash_on = "cookie:NAME"` keeps a cookie's requests on one endpoint; config
//! errors at their key and line.

use std::time::Duration;

use hyper::{Method, StatusCode};
use keel_model::FailureMode;
use keel_proxy::ProxyConfig;

use crate::support::*;

/// One request with an optional cookie: (the backend that answered, the `Set-Cookie` if any).
async fn visit(
    addr: std::net::SocketAddr,
    h2: bool,
    cookie: Option<&str>,
) -> (String, Option<String>) {
    let url = format!("http://{addr}/");
    let headers: Vec<(&str, &str)> = cookie.map(|c| ("cookie", c)).into_iter().collect();
    let r = if h2 {
        let mut s = h2_connect(addr).await;
        h2_send(&mut s, Method::GET, &url, &headers).await
    } else {
        send(&client(), Method::GET, &url, &headers, b"")
            .await
            .unwrap()
    };
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    (
        r.header("x-backend").unwrap_or("?").to_string(),
        r.header("set-cookie").map(str::to_string),
    )
}

/// `srv=VALUE` of a `Set-Cookie`.
fn pair(set_cookie: &str) -> String {
    set_cookie.split(';').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_the_endpoint_its_cookie_names_over_http1_and_http2() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let config = simple_config(
        &addrs,
        "round-robin",
        "sticky = { cookie = \"srv\", ttl = \"1h\", same_site = \"lax\" }",
    );
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        let (first, set) = visit(addr, h2, None).await;
        let set = set.expect("the first answer sets the cookie");
        assert!(
            set.ends_with("; Path=/; Max-Age=3600; HttpOnly; SameSite=Lax"),
            "{set}"
        );
        let cookie = pair(&set);
        for a in &addrs {
            assert!(!cookie.contains(&a.port().to_string()), "opaque: {cookie}");
        }
        // Round-robin would spread these over all three: the cookie keeps them on one.
        for _ in 0..9 {
            let (b, set) = visit(addr, h2, Some(&format!("a=1; {cookie}"))).await;
            assert_eq!(b, first, "h2 {h2}");
            assert_eq!(set, None, "no new cookie while the session stays");
        }
        // A cookie naming no endpoint gets a new one.
        let (_, set) = visit(addr, h2, Some("srv=0123456789abcdef")).await;
        assert!(set.is_some());
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_moves_once_when_its_endpoint_fails_or_is_removed() {
    let bs = backends(3, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let config = simple_config(&addrs, "round-robin", "sticky = { cookie = \"srv\" }");
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let (first, set) = visit(addr, false, None).await;
    let cookie = pair(&set.unwrap());
    let failed = bs.iter().find(|b| b.name() == first).unwrap();
    fault(failed, FailureMode::Refuse).await;
    // The pinned try is refused, the retry answers elsewhere and re-pins the session.
    let (moved, set) = visit(addr, false, Some(&cookie)).await;
    assert_ne!(moved, first);
    let cookie = pair(&set.expect("re-pinned to the endpoint that answered"));
    fault(failed, FailureMode::None).await;
    for _ in 0..5 {
        let (b, set) = visit(addr, false, Some(&cookie)).await;
        assert_eq!(
            (b.as_str(), set),
            (moved.as_str(), None),
            "stays where it moved"
        );
    }
    // The session's endpoint removed by a reload: the strategy picks, and the cookie follows.
    let gone = bs.iter().find(|b| b.name() == moved).unwrap().addr();
    let left: Vec<_> = addrs.iter().copied().filter(|a| *a != gone).collect();
    proxy
        .reload(simple_config(
            &left,
            "round-robin",
            "sticky = { cookie = \"srv\" }",
        ))
        .unwrap();
    let (b, set) = visit(addr, false, Some(&cookie)).await;
    assert_ne!(b, moved);
    assert!(set.is_some());
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hash_on_a_cookie_keeps_its_requests_on_one_endpoint() {
    let bs = backends(4, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let config = simple_config(&addrs, "ring-hash", "hash_on = \"cookie:sid\"");
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut seen = std::collections::BTreeSet::new();
    for user in 0..20 {
        let cookie = format!("theme=dark; sid=user-{user}");
        let (first, _) = visit(addr, user % 2 == 0, Some(&cookie)).await;
        for _ in 0..3 {
            assert_eq!(visit(addr, user % 2 == 1, Some(&cookie)).await.0, first);
        }
        seen.insert(first);
    }
    assert!(seen.len() >= 2, "20 sessions over 4 endpoints: {seen:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn sticky_errors_name_their_key_and_line() {
    let with = |extra: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n[[cluster]]\nname = \"a\"\nendpoints = [{{ address = \"127.0.0.1:1\" }}]\n{extra}\n"
        )
    };
    let err = |text: String| {
        ProxyConfig::from_toml_str(&text, "t.toml")
            .unwrap_err()
            .to_string()
    };
    let e = err(with("sticky = { cookie = \"a b\" }"));
    assert!(
        e.contains("t.toml:7:") && e.contains("cluster[0].sticky.cookie"),
        "{e}"
    );
    let e = err(with("sticky = { cookie = \"s\", same_site = \"none\" }"));
    assert!(
        e.contains("sticky.same_site") && e.contains("secure"),
        "{e}"
    );
    let e = err(with("strategy = \"ring-hash\"\nhash_on = \"cookie:\""));
    assert!(
        e.contains("t.toml:8:") && e.contains("not a cookie name"),
        "{e}"
    );
}
