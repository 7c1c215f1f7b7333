//! `allow` and `deny` on loopback: a listener's and a route's lists refuse with 403 before any
//! endpoint is tried, and count it; behind `trusted_proxies` the forwarded address decides;
//! a TCP listener closes a refused connection; bad blocks are refused naming their key.

use std::net::SocketAddr;
use std::time::Duration;

use hyper::Method;
use keel_proxy::{ProxyConfig, ProxyHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

/// A proxy with one listener (`listener_extra` lines in its table, routes after them) over
/// one backend; the backend's address.
async fn proxy(
    listener_extra: &str,
) -> (
    ProxyHandle,
    SocketAddr,
    Vec<keel_testbed::backend::BackendHandle>,
) {
    let bs = backends(1, Duration::ZERO).await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let config = ProxyConfig::from_toml_str(&text, "t.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
    let p = keel_proxy::start(config).await.unwrap();
    let addr = p.listener_addrs()[0];
    (p, addr, bs)
}

async fn status_of(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> u16 {
    let r = send(
        &client(),
        Method::GET,
        &format!("http://{addr}{path}"),
        headers,
        b"",
    )
    .await
    .unwrap();
    r.status.as_u16()
}

/// Requests the backend answered so far (keel-balance's successes).
fn served(p: &ProxyHandle) -> u64 {
    p.cluster_status("app").unwrap()[0].successes
}

/// Waits until the backend's count is `n` (a pick finishes just after its answer is sent).
async fn served_is(p: &ProxyHandle, n: u64) -> bool {
    eventually(Duration::from_secs(2), || served(p) == n).await && served(p) == n
}

/// 127.0.0.1 against a listener's `deny = ["127.0.0.0/8"]`: 403, counted, and the endpoint
/// never sees the request; a more specific `allow` of the one address lets it in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_deny_refuses_with_403_before_any_endpoint() {
    let (p, addr, _bs) = proxy("deny = [\"127.0.0.0/8\"]").await;
    let r = get(&format!("http://{addr}/x")).await.unwrap();
    assert_eq!(r.status, 403);
    assert_eq!(r.text(), "403 Forbidden: access denied\n");
    assert_eq!(status_of(addr, "/y", &[]).await, 403);
    assert_eq!(served(&p), 0, "no endpoint was tried");
    let admin = p.admin_addr().unwrap();
    assert_eq!(
        metric(admin, "keel_access_denied_total{cluster=\"app\"}").await,
        Some(2.0)
    );
    p.shutdown(Duration::from_secs(1)).await;

    let (p, addr, _bs) = proxy("deny = [\"127.0.0.0/8\"]\nallow = [\"127.0.0.1\"]").await;
    assert_eq!(status_of(addr, "/x", &[]).await, 200, "the /32 allow wins");
    assert!(served_is(&p, 1).await);
    p.shutdown(Duration::from_secs(1)).await;

    // An allow list that does not name the client refuses it.
    let (p, addr, _bs) = proxy("allow = [\"10.0.0.0/8\", \"::1\"]").await;
    assert_eq!(status_of(addr, "/x", &[]).await, 403);
    p.shutdown(Duration::from_secs(1)).await;
}

/// A route's lists apply to that route only; the listener's own route is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_deny_refuses_that_route_only() {
    let (p, addr, _bs) = proxy(
        "\n[[listener.route]]\npath_prefix = \"/private\"\ncluster = \"app\"\ndeny = [\"127.0.0.0/8\"]\n\n[[listener.route]]\npath_prefix = \"/office\"\ncluster = \"app\"\nallow = [\"192.0.2.0/24\"]\n",
    )
    .await;
    assert_eq!(status_of(addr, "/private/x", &[]).await, 403);
    assert_eq!(status_of(addr, "/office/x", &[]).await, 403);
    assert_eq!(status_of(addr, "/public", &[]).await, 200);
    assert!(served_is(&p, 1).await);
    let admin = p.admin_addr().unwrap();
    assert_eq!(
        metric(admin, "keel_access_denied_total{cluster=\"app\"}").await,
        Some(2.0)
    );
    p.shutdown(Duration::from_secs(1)).await;
}

/// A route's list meets every spelling of its path: percent-escapes of unreserved characters
/// are decoded before routing (`/%61dmin` is `/admin`), over HTTP/1.1 and HTTP/2; an escaped
/// `/` stays a different path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escaped_path_meets_its_routes_access_list() {
    let (p, addr, _bs) = proxy(
        "\n[[listener.route]]\npath_prefix = \"/admin\"\ncluster = \"app\"\nallow = [\"192.0.2.0/24\"]\n",
    )
    .await;
    let mut h2 = h2_connect(addr).await;
    for path in [
        "/admin",
        "/%61dmin",
        "/%61%64%6D%69%6E/x",
        "/x/%2e%2E/%61dmin",
    ] {
        assert_eq!(status_of(addr, path, &[]).await, 403, "HTTP/1.1 {path}");
        let got = h2_send(&mut h2, Method::GET, &format!("http://{addr}{path}"), &[]).await;
        assert_eq!(got.status, 403, "HTTP/2 {path}");
    }
    assert_eq!(status_of(addr, "/%2Fadmin", &[]).await, 200);
    assert!(served_is(&p, 1).await);
    p.shutdown(Duration::from_secs(1)).await;
}

/// On a dual-stack listener (`[::]`) an IPv4 client is its IPv4 address, not
/// `::ffff:127.0.0.1`: an IPv4 `allow` admits it, `trusted_proxies` trusts it (so the address
/// it forwards is the one `deny` judges), and the endpoint's `X-Forwarded-For` names it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_client_of_a_dual_stack_listener_is_its_ipv4_address() {
    let (echo, _task) = echo_server().await;
    let text = format!(
        "[[listener]]\nlisten = \"[::]:0\"\ncluster = \"app\"\ntrusted_proxies = [\"127.0.0.1/32\"]\ndeny = [\"203.0.113.0/24\"]\n\n[[listener.route]]\npath_prefix = \"/office\"\ncluster = \"app\"\nallow = [\"127.0.0.1\"]\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{echo}\" }}]\n"
    );
    let p = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let port = p.listener_addrs()[0].port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(
        status_of(addr, "/office/x", &[]).await,
        200,
        "allow = [\"127.0.0.1\"]"
    );
    let xff = [("x-forwarded-for", "203.0.113.9")];
    assert_eq!(
        status_of(addr, "/x", &xff).await,
        403,
        "trusted, so the forwarded address is denied"
    );
    let got = send(
        &client(),
        Method::GET,
        &format!("http://{addr}/x"),
        &[],
        b"",
    )
    .await
    .unwrap();
    assert!(
        got.text()
            .to_ascii_lowercase()
            .contains("x-forwarded-for: 127.0.0.1\n"),
        "{}",
        got.text()
    );
    p.shutdown(Duration::from_secs(1)).await;
}

/// Behind a trusted proxy the address it forwarded decides, for a listener's list and a
/// route's; from an untrusted client `X-Forwarded-For` changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_trusted_proxies_the_forwarded_address_decides() {
    let (p, addr, _bs) = proxy(
        "trusted_proxies = [\"127.0.0.1/32\"]\ndeny = [\"203.0.113.0/24\"]\n\n[[listener.route]]\npath_prefix = \"/office\"\ncluster = \"app\"\nallow = [\"198.51.100.0/24\"]\n",
    )
    .await;
    let xff = |v| [("x-forwarded-for", v)];
    assert_eq!(status_of(addr, "/x", &xff("203.0.113.9")).await, 403);
    assert_eq!(
        status_of(addr, "/x", &xff("203.0.113.9, 198.51.100.7")).await,
        200,
        "the entry the trusted proxy added (the last) is the client"
    );
    assert_eq!(status_of(addr, "/x", &xff("198.51.100.7")).await, 200);
    assert_eq!(
        status_of(addr, "/x", &[]).await,
        200,
        "no forwarded address: the peer"
    );
    assert_eq!(status_of(addr, "/office", &xff("198.51.100.7")).await, 200);
    assert_eq!(status_of(addr, "/office", &xff("192.0.2.1")).await, 403);
    assert_eq!(
        status_of(addr, "/office", &[]).await,
        403,
        "127.0.0.1 is not allowed there"
    );
    assert_eq!(
        status_of(addr, "/x", &xff("not-an-address")).await,
        403,
        "a forwarded entry that is not an address is refused"
    );
    p.shutdown(Duration::from_secs(1)).await;

    // The same lists without trusted_proxies: the header is the client's word, not believed.
    let (p, addr, _bs) = proxy("deny = [\"203.0.113.0/24\"]").await;
    assert_eq!(status_of(addr, "/x", &xff("203.0.113.9")).await, 200);
    p.shutdown(Duration::from_secs(1)).await;
}

/// A TCP listener closes a refused client's connection before any endpoint is connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_listener_closes_a_refused_connection() {
    let (p, addr, _bs) = proxy("protocol = \"tcp\"\ndeny = [\"127.0.0.1\"]").await;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .expect("closed at once");
    assert!(
        n.is_err() || buf.is_empty(),
        "got {:?}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(served(&p), 0);
    let admin = p.admin_addr().unwrap();
    assert_eq!(
        metric(admin, "keel_access_denied_total{cluster=\"app\"}").await,
        Some(1.0)
    );
    p.shutdown(Duration::from_secs(1)).await;
}

/// A block that is not one, or has bits past its prefix, is refused naming the key.
#[test]
fn bad_blocks_are_refused_naming_the_key() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n";
    let cluster = "\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:1\" }]\n";
    let cases = [
        (
            format!("{base}allow = [\"10.0.0.1/8\"]\n{cluster}"),
            "listener[0].allow",
            "\"10.0.0.0/8\"",
        ),
        (
            format!("{base}deny = [\"10.0.0.300\"]\n{cluster}"),
            "listener[0].deny",
            "not an IP address",
        ),
        (
            format!("{base}\n[[listener.route]]\ncluster = \"app\"\ndeny = [\"fe80::1/200\"]\n{cluster}"),
            "listener[0].route[0].deny",
            "not an IP address",
        ),
    ];
    for (text, key, says) in cases {
        let e = ProxyConfig::from_toml_str(&text, "t.toml").unwrap_err();
        assert_eq!(e.key.as_deref(), Some(key), "{e}");
        assert!(e.message.contains(says), "{e}");
    }
}
