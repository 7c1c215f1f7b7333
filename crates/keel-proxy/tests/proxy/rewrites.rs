//! Rewrites on loopback, over HTTP/1.1 and HTTP/2 clients alike: a route's
//! prefix stripped and replaced, `Host` rewritten to a value or to the endpoint's address,
//! request and response headers removed, set and added with variables, a redirect route
//! answered by keel, `Location`/`Refresh` naming the endpoint turned back to the client's host,
//! and config errors at their key and line.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use keel_proxy::ProxyConfig;

use crate::support::*;

/// A server that answers with the request's target and headers as text (`target: ...`, then
/// `name: value` lines) and `x-from-backend: 1`, `server: echo`; `/moved` answers `302` with
/// `Location` and `Refresh` naming its own address.
async fn target_echo() -> SocketAddr {
    target_echo_on(false).await
}

/// [`target_echo`], speaking HTTP/2 with prior knowledge (`h2c`) when `h2`.
async fn target_echo_on(h2: bool) -> SocketAddr {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| async move {
                    let (parts, body) = req.into_parts();
                    let _ = body.collect().await;
                    let mut text = format!("target: {}\n", parts.uri);
                    for (k, v) in &parts.headers {
                        text.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
                    }
                    let mut resp = hyper::Response::builder()
                        .header("x-from-backend", "1")
                        .header("server", "echo");
                    if parts.uri.path() == "/moved" {
                        resp = resp
                            .status(302)
                            .header("location", format!("http://{addr}/landed?x=1"))
                            .header("refresh", format!("3; url=http://{addr}/later"));
                    }
                    Ok::<_, std::convert::Infallible>(
                        resp.body(Full::new(Bytes::from(text))).unwrap(),
                    )
                });
                if h2 {
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                }
            });
        }
    });
    addr
}

fn config(text: &str) -> ProxyConfig {
    ProxyConfig::from_toml_str(text, "rewrites.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// The echoed value of a request header (`None` if the endpoint did not get it).
fn echoed<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
}

/// GET over HTTP/1.1 (`h2 = false`) or HTTP/2 with these headers.
async fn get_via(addr: SocketAddr, h2: bool, path: &str, headers: &[(&str, &str)]) -> Got {
    let url = format!("http://{addr}{path}");
    if h2 {
        let mut s = h2_connect(addr).await;
        h2_send(&mut s, Method::GET, &url, headers).await
    } else {
        send(&client(), Method::GET, &url, headers, b"")
            .await
            .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_strips_its_prefix_and_edits_headers_over_http1_and_http2() {
    let b = target_echo().await;
    let proxy = keel_proxy::start(config(&format!(
        r#"[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
trusted_proxies = ["127.0.0.1/32"]

[[listener.route]]
path_prefix = "/echo"
cluster = "app"
strip_prefix = "/echo"
host_rewrite = "internal.example"
request_headers = {{ add = {{ x-client = "$client_ip", x-route = "r$route" }}, set = {{ x-tenant = "t1" }}, remove = ["x-secret"] }}
response_headers = {{ add = {{ x-request-id = "$request_id" }}, set = {{ server = "keel" }}, remove = ["x-from-backend"] }}

[[listener.route]]
path_prefix = "/v1/"
cluster = "app"
replace_prefix = {{ from = "/v1/", to = "/v2/" }}

[[cluster]]
name = "app"
endpoints = [{{ address = "{b}" }}]
request_headers = {{ add = {{ x-cluster = "app" }}, set = {{ x-tenant = "cluster" }} }}
"#
    )))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        let r = get_via(
            addr,
            h2,
            "/echo/status?q=1",
            &[
                ("x-secret", "s"),
                ("x-tenant", "client"),
                ("x-request-id", "abc-1"),
            ],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "h2 {h2}");
        let body = r.text();
        assert_eq!(
            echoed(&body, "target"),
            Some("/status?q=1"),
            "h2 {h2}: {body}"
        );
        assert_eq!(echoed(&body, "host"), Some("internal.example"), "{body}");
        // X-Forwarded-Host keeps the client's host.
        assert_eq!(
            echoed(&body, "x-forwarded-host"),
            Some(addr.to_string().as_str())
        );
        assert_eq!(echoed(&body, "x-client"), Some("127.0.0.1"));
        assert_eq!(echoed(&body, "x-route"), Some("r0"));
        assert_eq!(echoed(&body, "x-cluster"), Some("app"));
        // The cluster's set, then the route's: the route wins, the client's value is gone.
        assert_eq!(echoed(&body, "x-tenant"), Some("t1"), "{body}");
        assert_eq!(body.matches("x-tenant").count(), 1, "{body}");
        assert_eq!(echoed(&body, "x-secret"), None);
        // The response: a trusted proxy's request id, `server` set, a header removed.
        assert_eq!(r.header("x-request-id"), Some("abc-1"));
        assert_eq!(r.header("server"), Some("keel"));
        assert_eq!(r.header("x-from-backend"), None);
        // A made-up request id without the client's.
        let r = get_via(addr, h2, "/echo", &[]).await;
        assert_eq!(echoed(&r.text(), "target"), Some("/"));
        let id = r.header("x-request-id").unwrap().to_string();
        // keel's own (generate_request_id), the one the endpoint got too: UUID v4 text.
        assert_eq!(id.len(), 36, "{id}");
        // The other route: a prefix replaced; only the cluster's edits.
        let r = get_via(addr, h2, "/v1/users", &[("x-secret", "s")]).await;
        let body = r.text();
        assert_eq!(echoed(&body, "target"), Some("/v2/users"));
        assert_eq!(echoed(&body, "host"), Some(addr.to_string().as_str()));
        assert_eq!(echoed(&body, "x-secret"), Some("s"));
        assert_eq!(echoed(&body, "x-tenant"), Some("cluster"));
        assert_eq!(r.header("x-from-backend"), Some("1"));
    }
    // An HTTP/1.0 request without Host gets the rewritten one, once.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /echo/old HTTP/1.0\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(answer.matches("host: ").count(), 1, "{answer}");
    assert!(answer.contains("\nhost: internal.example\n"), "{answer}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_rewrite_to_the_endpoint_and_locations_back_to_the_client() {
    let b = target_echo().await;
    let proxy = keel_proxy::start(config(&format!(
        r#"[[listener]]
listen = "127.0.0.1:0"
cluster = "app"

[[cluster]]
name = "app"
endpoints = [{{ address = "{b}" }}]
host_rewrite = "$endpoint"
rewrite_location = true
"#
    )))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        let r = get_via(addr, h2, "/x", &[]).await;
        assert_eq!(
            echoed(&r.text(), "host"),
            Some(b.to_string().as_str()),
            "h2 {h2}"
        );
        let r = get_via(addr, h2, "/moved", &[]).await;
        assert_eq!(r.status, StatusCode::FOUND);
        assert_eq!(
            r.header("location"),
            Some(format!("http://{addr}/landed?x=1").as_str()),
            "h2 {h2}"
        );
        assert_eq!(
            r.header("refresh"),
            Some(format!("3; url=http://{addr}/later").as_str())
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_endpoint_gets_and_answers_the_same_rewrites() {
    let b = target_echo_on(true).await;
    let proxy = keel_proxy::start(config(&format!(
        r#"[[listener]]
listen = "127.0.0.1:0"
cluster = "app"

[[cluster]]
name = "app"
protocol = "h2c"
endpoints = [{{ address = "{b}" }}]
strip_prefix = "/svc"
host_rewrite = "$endpoint"
rewrite_location = true
request_headers = {{ add = {{ x-client = "$client_ip" }} }}
response_headers = {{ set = {{ server = "keel" }}, remove = ["x-from-backend"], add = {{ x-route = "[$route]" }} }}
"#
    )))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        let r = get_via(addr, h2, "/svc/moved", &[]).await;
        assert_eq!(r.status, StatusCode::FOUND, "h2 {h2}");
        let body = r.text();
        // An HTTP/2 endpoint sees the host as :authority, in the request's URI.
        assert_eq!(
            echoed(&body, "target"),
            Some(format!("http://{b}/moved").as_str()),
            "{body}"
        );
        assert_eq!(echoed(&body, "x-client"), Some("127.0.0.1"));
        assert_eq!(
            r.header("location"),
            Some(format!("http://{addr}/landed?x=1").as_str())
        );
        assert_eq!(r.header("server"), Some("keel"));
        assert_eq!(r.header("x-from-backend"), None);
        assert_eq!(
            r.header("x-route"),
            Some("[]"),
            "the listener's cluster: no route"
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// The headers keel sets or drops, as an endpoint got them, sorted (`name: value`).
fn forwarding_lines(body: &str) -> Vec<String> {
    let mut lines: Vec<String> = body
        .lines()
        .filter(|l| {
            [
                "x-forwarded-",
                "x-real-ip",
                "x-request-id",
                "x-tenant",
                "x-secret",
                "forwarded",
                "cookie",
                "te:",
                "connection",
                "transfer-encoding",
                "content-length",
                "x-keep",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// An HTTP/2 client's head is edited in place, an HTTP/1.1 client's written as text for an
/// HTTP/1.1 endpoint and built as a map for an HTTP/2 one; every form must give an endpoint
/// the same headers, through the same policies, whichever
/// protocol it speaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_and_http2_clients_forward_the_same_headers_to_either_endpoint() {
    for h2_endpoint in [false, true] {
        let b = target_echo_on(h2_endpoint).await;
        let proxy = keel_proxy::start(config(&format!(
            r#"[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
trusted_proxies = ["10.9.9.9/32"]

[[cluster]]
name = "app"
protocol = "{}"
endpoints = [{{ address = "{b}" }}]
strip_prefix = "/svc"
request_headers = {{ set = {{ x-tenant = "t1" }}, remove = ["x-secret"] }}
"#,
            if h2_endpoint { "h2c" } else { "http1" }
        )))
        .await
        .unwrap();
        let addr = proxy.listener_addrs()[0];
        let headers = [
            ("x-forwarded-for", "6.6.6.6"),
            ("x-real-ip", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
            ("x-forwarded-host", "evil.example"),
            ("x-request-id", "req-77"),
            ("x-secret", "s"),
            ("x-tenant", "client"),
            ("x-keep", "1"),
            ("cookie", "a=1"),
        ];
        let mut seen = Vec::new();
        for h2 in [false, true] {
            let r = get_via(addr, h2, "/svc/p?q=1", &headers).await;
            assert_eq!(
                r.status,
                StatusCode::OK,
                "h2 client {h2}, h2 endpoint {h2_endpoint}"
            );
            let body = r.text();
            let target = echoed(&body, "target").unwrap();
            assert!(target.ends_with("/p?q=1"), "{body}");
            seen.push(forwarding_lines(&body));
        }
        let host = addr.to_string();
        let expected = [
            "cookie: a=1".to_owned(),
            "x-forwarded-for: 127.0.0.1".to_owned(),
            format!("x-forwarded-host: {host}"),
            "x-forwarded-proto: http".to_owned(),
            "x-keep: 1".to_owned(),
            "x-real-ip: 127.0.0.1".to_owned(),
            "x-request-id: req-77".to_owned(),
            "x-tenant: t1".to_owned(),
        ];
        assert_eq!(
            seen[0], expected,
            "HTTP/1.1 client, h2 endpoint {h2_endpoint}"
        );
        assert_eq!(
            seen[1], expected,
            "HTTP/2 client, h2 endpoint {h2_endpoint}"
        );
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_route_is_answered_by_keel() {
    let bs = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(config(&format!(
        r#"[[listener]]
listen = "127.0.0.1:0"
cluster = "app"

[[listener.route]]
path_prefix = "/old/"
redirect = {{ status = 301, location = "https://$host$path" }}

[[cluster]]
name = "app"
endpoints = [{{ address = "{}" }}]
"#,
        bs[0].addr()
    )))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    for h2 in [false, true] {
        let r = get_via(addr, h2, "/old/page?a=b", &[]).await;
        assert_eq!(r.status, StatusCode::MOVED_PERMANENTLY, "h2 {h2}");
        assert_eq!(
            r.header("location"),
            Some(format!("https://{addr}/old/page?a=b").as_str())
        );
        assert_eq!(get_via(addr, h2, "/new", &[]).await.status, StatusCode::OK);
    }
    assert_eq!(bs[0].requests(), 2, "redirects never reach the endpoint");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn rewrite_errors_name_their_key_and_line() {
    let with = |route_extra: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n[[listener.route]]\ncluster = \"a\"\n{route_extra}\n[[cluster]]\nname = \"a\"\nendpoints = [{{ address = \"127.0.0.1:1\" }}]\n"
        )
    };
    let err = |text: String| {
        ProxyConfig::from_toml_str(&text, "t.toml")
            .unwrap_err()
            .to_string()
    };
    let e = err(with(
        "request_headers = { set = { content-length = \"1\" } }",
    ));
    assert!(
        e.contains("t.toml:6:")
            && e.contains("listener[0].route[0].request_headers.set")
            && e.contains("`content-length` is set by keel"),
        "{e}"
    );
    let e = err(with("response_headers = { add = { x-a = \"$nope\" } }"));
    assert!(
        e.contains("response_headers.add") && e.contains("unknown variable `$nope`"),
        "{e}"
    );
    let e = err(with("redirect = { status = 200, location = \"/x\" }"));
    assert!(
        e.contains("route[0].redirect.status") && e.contains(":6:"),
        "{e}"
    );
    // A route needs a cluster unless it redirects, and then the listener needs one.
    let tail = "[[cluster]]\nname = \"a\"\nendpoints = [{ address = \"127.0.0.1:1\" }]\n";
    let e = err(format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n[[listener.route]]\npath = \"/x\"\n{tail}"
    ));
    assert!(
        e.contains("route[0].cluster") && e.contains("required"),
        "{e}"
    );
    let e = err(format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\n[[listener.route]]\nredirect = {{ location = \"/y\" }}\n{tail}"
    ));
    assert!(
        e.contains("route[0].cluster") && e.contains("this listener has none"),
        "{e}"
    );
    let e = err(with("strip_prefix = \"echo\""));
    assert!(e.contains("route[0].strip_prefix"), "{e}");
    let e = err(with("host_rewrite = \"a b\""));
    assert!(e.contains("route[0].host_rewrite"), "{e}");
}
