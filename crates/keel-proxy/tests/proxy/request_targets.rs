//! What a request may name, checked on both front ends before anything is routed or
//! forwarded: `CONNECT` is refused (`501`), the target is origin form (`*` for `OPTIONS`
//! only; an `http://` absolute form becomes origin form with its authority as `Host`), and
//! `Host` / `:authority` must be a valid `host[:port]` (else `400`). An HTTP/2 client's
//! `CONNECT` never reaches an endpoint, so the endpoint's keep-alive connections can never
//! be turned into a tunnel that other clients' requests are written into.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// An HTTP/1.1 endpoint that records each request line (and `Host`) it reads. A request
/// answers `200 normal`; a `CONNECT` answers `200` and turns the connection into a tunnel,
/// which answers whatever it receives with `200 tunnel` (as a real tunnel to another HTTP
/// server would answer the next client's request).
async fn endpoint() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let mut tunnel = false;
                loop {
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut buf).await {
                            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).into_owned();
                    got.drain(..end + 4);
                    let line = head.lines().next().unwrap_or("").to_string();
                    let host = head
                        .lines()
                        .find_map(|l| l.strip_prefix("host: ").or(l.strip_prefix("Host: ")))
                        .unwrap_or("-")
                        .to_string();
                    let mut seen = format!("{line} | {host}");
                    for l in head.lines() {
                        if l.to_ascii_lowercase().starts_with("cookie:") {
                            seen.push_str(&format!(" | {l}"));
                        }
                    }
                    log.lock().unwrap().push(seen);
                    let answer: &[u8] = if tunnel {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\ntunnel"
                    } else if line.starts_with("CONNECT ") {
                        tunnel = true;
                        b"HTTP/1.1 200 Connection Established\r\ncontent-length: 0\r\n\r\n"
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nnormal"
                    };
                    if s.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

fn config(endpoint: SocketAddr) -> ProxyConfig {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n"
    );
    ProxyConfig::from_toml_str(&text, "t.toml").unwrap()
}

/// Sends `raw` on a new HTTP/1.1 connection and reads the answer until the connection
/// closes or 2 s pass.
async fn h1_raw(addr: SocketAddr, raw: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(raw.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// An HTTP/2 connection on the `h2` crate's client, which sends any method and target.
async fn h2_client(addr: SocketAddr) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client.ready().await.unwrap()
}

/// One HTTP/2 request without a body: (status, body).
async fn h2_ask(
    client: &mut h2::client::SendRequest<Bytes>,
    req: hyper::Request<()>,
) -> (u16, String) {
    let (resp, _) = client.send_request(req, true).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(3), resp)
        .await
        .expect("an answer within 3 s")
        .unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut text = Vec::new();
    while let Some(Ok(d)) = body.data().await {
        let _ = body.flow_control().release_capacity(d.len());
        text.extend_from_slice(&d);
    }
    (status, String::from_utf8_lossy(&text).into_owned())
}

/// The attack: an HTTP/2 client's `CONNECT` used to reach the HTTP/1.1 endpoint as
/// `CONNECT / HTTP/1.1`, and after its `200` the connection went back to the pool as a tunnel,
/// into which other clients' requests were written. Now the `CONNECT` is answered `501` by
/// keel and every later request, from other connections, gets the endpoint's own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_connect_is_refused_and_cannot_poison_the_endpoint_pool() {
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut h2 = h2_client(addr).await;
    for _ in 0..4 {
        let req = hyper::Request::builder()
            .method("CONNECT")
            .uri(up.to_string())
            .body(())
            .unwrap();
        let (status, _) = h2_ask(&mut h2, req).await;
        assert_eq!(status, 501, "CONNECT is answered as over HTTP/1.1");
    }
    // Followed by ordinary requests from other clients, both protocols, one connection each.
    for i in 0..8 {
        if i % 2 == 0 {
            let text = h1_raw(
                addr,
                "GET /next HTTP/1.1\r\nHost: app\r\nCookie: secret=1\r\nConnection: close\r\n\r\n",
            )
            .await;
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            assert!(text.ends_with("normal"), "request {i} got {text:?}");
        } else {
            let mut other = h2_client(addr).await;
            let req = hyper::Request::get(format!("http://{addr}/next"))
                .body(())
                .unwrap();
            assert_eq!(
                h2_ask(&mut other, req).await,
                (200, "normal".into()),
                "request {i}"
            );
        }
    }
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|l| !l.starts_with("CONNECT")),
        "no CONNECT reached the endpoint: {seen:?}"
    );
    assert_eq!(seen.len(), 8, "{seen:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Over HTTP/1.1: `CONNECT` is `501`, a `*` target other than `OPTIONS *` and a relative or
/// non-HTTP target are `400`, none of them reaches the endpoint; `OPTIONS *` is forwarded as
/// it is, and an absolute-form target is sent in origin form with its authority as `Host`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_targets_other_than_origin_form_are_refused_or_normalised() {
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    for (raw, status) in [
        (
            "CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n",
            "501",
        ),
        ("GET * HTTP/1.1\r\nHost: app\r\n\r\n", "400"),
        ("DELETE * HTTP/1.1\r\nHost: app\r\n\r\n", "400"),
        ("GET x/y HTTP/1.1\r\nHost: app\r\n\r\n", "400"),
        ("GET ftp://app/x HTTP/1.1\r\n\r\n", "400"),
    ] {
        let text = h1_raw(addr, raw).await;
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status}")),
            "{raw:?}: {text}"
        );
    }
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );
    let text = h1_raw(
        addr,
        "OPTIONS * HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let text = h1_raw(
        addr,
        "GET http://api.example:8080/p?q=1 HTTP/1.1\r\nHost: ignored\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(text.ends_with("normal"), "{text}");
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "OPTIONS * HTTP/1.1 | app",
            "GET /p?q=1 HTTP/1.1 | api.example:8080"
        ]
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Over HTTP/2: `CONNECT` is `501` as over HTTP/1.1, `GET *` is `400`, `OPTIONS *` is
/// forwarded as `OPTIONS *`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_targets_other_than_origin_form_are_refused() {
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut h2 = h2_client(addr).await;
    let star = |method: &str| {
        let uri = hyper::Uri::builder()
            .scheme("http")
            .authority("app")
            .path_and_query("*")
            .build()
            .unwrap();
        hyper::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
    };
    let connect = hyper::Request::builder()
        .method("CONNECT")
        .uri("app:443")
        .body(())
        .unwrap();
    assert_eq!(h2_ask(&mut h2, connect).await.0, 501);
    assert_eq!(h2_ask(&mut h2, star("GET")).await.0, 400);
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );
    assert_eq!(
        h2_ask(&mut h2, star("OPTIONS")).await,
        (200, "normal".into())
    );
    assert_eq!(*seen.lock().unwrap(), ["OPTIONS * HTTP/1.1 | app"]);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// `Host` values that are not a `host[:port]` (spaces, a path or query, user info, control
/// bytes, a bad or empty port) are refused with `400` before routing, on both front ends: an
/// endpoint never sees them and no redirect can reflect them. Valid ones (a name with a port,
/// an IPv6 literal) pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_host_and_authority_are_refused_on_both_front_ends() {
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let bad = [
        "a b",
        "evil/x?",
        "evil?x",
        "user@evil",
        "a\tb",
        "h:99999",
        "h:",
        "h:8a",
        "[::1",
        "",
    ];
    for host in bad {
        let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let text = h1_raw(addr, &raw).await;
        assert!(text.starts_with("HTTP/1.1 400"), "Host {host:?}: {text}");
        assert!(text.contains("invalid Host"), "Host {host:?}: {text}");
    }
    let mut h2 = h2_client(addr).await;
    for host in bad.iter().filter(|h| !h.is_empty()) {
        let req = hyper::Request::get("/x").header("host", *host).body(());
        // The h2 crate sends a request without an authority as it is (`:path` only).
        let mut req = req.unwrap();
        *req.uri_mut() = hyper::Uri::from_static("/x");
        let (status, body) = h2_ask(&mut h2, req).await;
        assert_eq!(status, 400, "host {host:?}: {body}");
    }
    // User info in `:authority` itself.
    let req = hyper::Request::get("http://user@evil/x").body(()).unwrap();
    assert_eq!(h2_ask(&mut h2, req).await.0, 400);
    assert!(
        seen.lock().unwrap().is_empty(),
        "{:?}",
        seen.lock().unwrap()
    );
    for host in ["app.example:8080", "[::1]:80", "app_1.internal."] {
        let raw = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let text = h1_raw(addr, &raw).await;
        assert!(text.ends_with("normal"), "Host {host:?}: {text}");
        let req = hyper::Request::get(format!("http://{host}/"))
            .body(())
            .unwrap();
        assert_eq!(h2_ask(&mut h2, req).await, (200, "normal".into()), "{host}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A `#fragment` is no part of a request target (RFC 9112 section 3.2): keel drops it, for
/// routing and for the endpoint, over HTTP/1.1 and HTTP/2 (a raw `:path` with one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_in_the_target_is_dropped() {
    use crate::h2_frames::{frame, get_block, open, END_HEADERS, END_STREAM, HEADERS};
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let text = h1_raw(
        addr,
        "GET /a/b?q=1#frag/../x HTTP/1.1\r\nHost: app\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(text.ends_with("normal"), "{text}");
    let mut s = open(addr).await;
    s.write_all(&frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        1,
        &get_block("/c#frag", &[]),
    ))
    .await
    .unwrap();
    assert!(eventually(Duration::from_secs(3), || seen.lock().unwrap().len() == 2).await);
    assert_eq!(
        *seen.lock().unwrap(),
        ["GET /a/b?q=1 HTTP/1.1 | app", "GET /c HTTP/1.1 | x"]
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// RFC 9113 section 8.2.3: an HTTP/2 client's `cookie` fields reach an HTTP/1.1 endpoint as
/// one line, joined with "; " in their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_cookie_fields_reach_an_http1_endpoint_as_one_line() {
    let (up, seen) = endpoint().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut client = h2_client(addr).await;
    let req = hyper::Request::get("http://app/p")
        .header("cookie", "a=1")
        .header("x-other", "o")
        .header("cookie", "b=2; c=3")
        .body(())
        .unwrap();
    assert_eq!(h2_ask(&mut client, req).await, (200, "normal".to_string()));
    assert_eq!(
        *seen.lock().unwrap(),
        ["GET /p HTTP/1.1 | app | cookie: a=1; b=2; c=3"]
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}
