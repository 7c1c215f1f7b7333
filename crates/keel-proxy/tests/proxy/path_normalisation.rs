//! Request paths are normalised before routing and before a prefix rewrite, as NGINX does:
//! dot segments resolved (`%2e` included), `//` merged, and a path that climbs above the root
//! refused with 400. A route then sees the path its endpoint gets: `/public/../admin/x` is
//! `/admin/x` to both. Over HTTP/1.1 (raw bytes, nothing normalised by a client library) and
//! HTTP/2.

use std::net::SocketAddr;
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::Full;
use hyper::Method;
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An endpoint that answers `NAME TARGET`: its name and the request target it got.
async fn target_echo(name: &'static str) -> SocketAddr {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let target = req.uri().path_and_query().map_or("", |p| p.as_str());
                    let text = format!("{name} {target}");
                    async move {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            Bytes::from(text),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// `GET target` over HTTP/1.1 as raw bytes: the status and the body.
async fn h1_get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("answered within 5 s")
        .unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, body.to_string())
}

async fn h2_get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut s = h2_connect(addr).await;
    let g = h2_send(&mut s, Method::GET, &format!("http://{addr}{target}"), &[]).await;
    (g.status.as_u16(), g.text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_and_empty_segments_are_resolved_before_routing_and_prefix_rewrites() {
    let (api, public, admin) = (
        target_echo("api").await,
        target_echo("public").await,
        target_echo("admin").await,
    );
    let text = format!(
        r#"[[listener]]
listen = "127.0.0.1:0"
error_detail = "full"

[[listener.route]]
path_prefix = "/v1/"
cluster = "api"
replace_prefix = {{ from = "/v1/", to = "/internal/v2/" }}

[[listener.route]]
path_prefix = "/public/"
cluster = "public"
strip_prefix = "/public"

[[listener.route]]
path_prefix = "/admin/"
cluster = "admin"

[[cluster]]
name = "api"
endpoints = [{{ address = "{api}" }}]
[[cluster]]
name = "public"
endpoints = [{{ address = "{public}" }}]
[[cluster]]
name = "admin"
endpoints = [{{ address = "{admin}" }}]
"#
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    // (target sent, what answers: status and "endpoint target-it-got")
    let cases: [(&str, u16, &str); 12] = [
        ("/v1/users", 200, "api /internal/v2/users"),
        ("/v1//x/./y/../z", 200, "api /internal/v2/x/z"),
        ("/v1/../../admin", 400, ""),
        ("/v1/%2e%2e/%2E%2e/admin", 400, ""),
        ("/v1/..", 404, ""),
        ("/public/../admin/x", 200, "admin /admin/x"),
        ("/public/%2e%2e/admin/x", 200, "admin /admin/x"),
        ("//public//a/", 200, "public /a/"),
        ("/public/./a?q=/../b", 200, "public /a?q=/../b"),
        // An escaped `/` stays escaped, its hex in capitals (RFC 3986 section 6.2.2.1).
        (
            "/public/.well-known/a%2fb",
            200,
            "public /.well-known/a%2Fb",
        ),
        // Escaped unreserved characters are the characters (section 6.2.2.2).
        ("/%70ublic/%7Ea%2d%5F", 200, "public /~a-_"),
        ("/admin/x/../../public/y", 200, "public /y"),
    ];
    for (target, status, body) in cases {
        for (proto, (got_status, got_body)) in [
            ("HTTP/1.1", h1_get(addr, target).await),
            ("HTTP/2", h2_get(addr, target).await),
        ] {
            assert_eq!(got_status, status, "{proto} {target}: {got_body}");
            if status == 200 {
                assert_eq!(got_body, body, "{proto} {target}");
            } else if status == 400 {
                assert!(
                    got_body.contains("climb above the root"),
                    "{proto} {target}: {got_body}"
                );
            }
        }
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}
