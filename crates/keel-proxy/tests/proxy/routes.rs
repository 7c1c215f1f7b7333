//! Routes on loopback: the documented route as written, each kind of condition
//! chosen (exact and wildcard hosts, exact and prefix paths, methods, headers; the first match
//! wins), the `404` when nothing matches and the listener has no cluster, the per-route
//! `request_timeout` and `retry_attempts` reaching the attempt driver, routes over HTTP/2 and
//! TLS, and routes changed by a reload.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Method, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;

use crate::support::*;

/// The listener and route docs/configuration.md shows, verbatim.
const DOCUMENTED_ROUTE: &str = r#"[[listener]]
listen = "127.0.0.1:8080"
cluster = "web"              # optional once routes exist: used when no route matches

[[listener.route]]           # tried in order; the first match wins
host = "api.example.test"    # optional: exact, or "*.example.test" (one or more labels in
                             # place of *); case-insensitive; a port in Host is ignored
path_prefix = "/v1/"         # optional; or path = "/exact" (not both)
methods = ["GET", "HEAD"]    # optional
headers = { x-canary = "1" } # optional: each header present with exactly this value
cluster = "api"
request_timeout = "2s"       # optional overrides of the cluster's values
retry_attempts = 0
"#;

fn cluster(name: &str, addrs: &[SocketAddr], extra: &str) -> String {
    let eps: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    format!(
        "\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"{name}\"\nendpoints = [{}]\n{extra}\n",
        eps.join(", ")
    )
}

fn load(text: &str) -> ProxyConfig {
    ProxyConfig::from_toml_str(text, "routes.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// The endpoint that answered (`x-keel-endpoint`), or the status when keel answered itself.
async fn served_by(url: &str, method: Method, headers: &[(&str, &str)]) -> String {
    let r = send(&client(), method, url, headers, b"").await.unwrap();
    match r.header("x-keel-endpoint") {
        Some(e) if r.status == StatusCode::OK => e.to_string(),
        _ => format!("{} {}", r.status.as_u16(), r.text().trim()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_route_loads_and_works_as_written() {
    let bs = backends(2, Duration::ZERO).await;
    let (web, api) = (bs[0].addr().to_string(), bs[1].addr().to_string());
    let text = format!(
        "{}{}{}",
        DOCUMENTED_ROUTE.replace("127.0.0.1:8080", "127.0.0.1:0"),
        cluster("web", &[bs[0].addr()], ""),
        cluster(
            "api",
            &[bs[1].addr()],
            "request_timeout = \"15s\"\n[cluster.retry]\nattempts = 3\n"
        ),
    );
    let config = load(&text);
    let r = &config.listeners[0].routes[0];
    assert_eq!(r.request_timeout, Some(Duration::from_secs(2)));
    assert_eq!(r.retry_attempts, Some(0));
    let proxy = keel_proxy::start(config).await.unwrap();
    let url = |path: &str| format!("http://{}{path}", proxy.listener_addrs()[0]);
    let api_host = ("host", "api.example.test");
    let canary = ("x-canary", "1");
    // Every condition met: api, whatever the case of the host and its port.
    assert_eq!(
        served_by(&url("/v1/users"), Method::GET, &[api_host, canary]).await,
        api
    );
    assert_eq!(
        served_by(
            &url("/v1/x?y=1"),
            Method::GET,
            &[("host", "API.Example.TEST:8080"), canary]
        )
        .await,
        api
    );
    assert_eq!(
        served_by(&url("/v1/"), Method::HEAD, &[api_host, canary]).await,
        api
    );
    // Any condition missed: the listener's cluster.
    for (path, method, headers) in [
        ("/v1/users", Method::POST, vec![api_host, canary]),
        ("/v1/users", Method::GET, vec![api_host]),
        ("/v1/users", Method::GET, vec![api_host, ("x-canary", "2")]),
        ("/v2/users", Method::GET, vec![api_host, canary]),
        ("/v1", Method::GET, vec![api_host, canary]),
        (
            "/v1/users",
            Method::GET,
            vec![("host", "web.example.test"), canary],
        ),
        (
            "/v1/users",
            Method::GET,
            vec![("host", "x.api.example.test"), canary],
        ),
    ] {
        assert_eq!(
            served_by(&url(path), method.clone(), &headers).await,
            web,
            "{method} {path} {headers:?}"
        );
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_route_kind_is_chosen_and_no_match_is_a_404() {
    let bs = backends(7, Duration::ZERO).await;
    let a: Vec<String> = bs.iter().map(|b| b.addr().to_string()).collect();
    let mut text = String::from(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\n\n\
         [[listener.route]]\nhost = \"exact.example.test\"\ncluster = \"c0\"\n\n\
         [[listener.route]]\nhost = \"*.example.test\"\npath = \"/only\"\ncluster = \"c1\"\n\n\
         [[listener.route]]\nhost = \"*.Example.test\"\ncluster = \"c2\"\n\n\
         [[listener.route]]\npath = \"/exact\"\ncluster = \"c3\"\n\n\
         [[listener.route]]\npath_prefix = \"/static/\"\nmethods = [\"GET\"]\ncluster = \"c4\"\n\n\
         [[listener.route]]\nheaders = { X-Tenant = \"blue\", x-canary = \"1\" }\ncluster = \"c5\"\n\n\
         [[listener.route]]\npath_prefix = \"/static/\"\ncluster = \"c6\"\n",
    );
    for (i, b) in bs.iter().enumerate() {
        text.push_str(&cluster(&format!("c{i}"), &[b.addr()], ""));
    }
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let url = |path: &str| format!("http://{}{path}", proxy.listener_addrs()[0]);
    let host = |h: &'static str| ("host", h);
    type Case<'a> = (&'a str, Method, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case<'_>> = vec![
        // Exact host; a wildcard does not take the bare domain.
        ("/any", Method::GET, vec![host("exact.example.test")], &a[0]),
        (
            "/any",
            Method::GET,
            vec![host("EXACT.example.test:443")],
            &a[0],
        ),
        // Wildcard with a path: one label or more in place of `*`; the path exactly.
        ("/only", Method::GET, vec![host("a.example.test")], &a[1]),
        (
            "/only?x=1",
            Method::GET,
            vec![host("a.b.example.test")],
            &a[1],
        ),
        ("/only/", Method::GET, vec![host("a.example.test")], &a[2]),
        ("/other", Method::GET, vec![host("a.b.example.test")], &a[2]),
        // Exact path, any host.
        ("/exact", Method::GET, vec![host("example.test")], &a[3]),
        ("/exact?q", Method::DELETE, vec![host("other.test")], &a[3]),
        // Prefix and method; a later route takes the other methods.
        (
            "/static/app.js",
            Method::GET,
            vec![host("other.test")],
            &a[4],
        ),
        (
            "/static/app.js",
            Method::PUT,
            vec![host("other.test")],
            &a[6],
        ),
        // Headers: all present, names in any case, values exact. The earlier prefix route
        // wins when both match.
        (
            "/api",
            Method::GET,
            vec![host("other.test"), ("x-tenant", "blue"), ("X-Canary", "1")],
            &a[5],
        ),
        (
            "/static/x",
            Method::GET,
            vec![host("other.test"), ("x-tenant", "blue"), ("x-canary", "1")],
            &a[4],
        ),
    ];
    for (path, method, headers, want) in &cases {
        assert_eq!(
            &served_by(&url(path), method.clone(), headers).await,
            want,
            "{method} {path} {headers:?}"
        );
    }
    // Nothing matches and the listener has no cluster: 404, one line naming the cause.
    let not_found = "404 404 Not Found: no route matches the request";
    for (path, headers) in [
        ("/api", vec![host("other.test"), ("x-tenant", "blue")]),
        (
            "/api",
            vec![host("other.test"), ("x-tenant", "Blue"), ("x-canary", "1")],
        ),
        ("/exact/", vec![host("example.test")]),
        ("/", vec![host("example.test")]),
    ] {
        assert_eq!(
            served_by(&url(path), Method::GET, &headers).await,
            not_found,
            "{path} {headers:?}"
        );
    }
    // A 404 keeps the connection: two on one, then a routed request on it.
    let c = client();
    for _ in 0..2 {
        let r = send(&c, Method::GET, &url("/nope"), &[host("x.test")], b"")
            .await
            .unwrap();
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(r.text(), "404 Not Found: no route matches the request\n");
    }
    let r = send(&c, Method::GET, &url("/exact"), &[host("x.test")], b"")
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    let admin = proxy.admin_addr().unwrap();
    let m = get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    let line = format!(
        "keel_no_route_total{{listener=\"{}\"}} 6\n",
        proxy.listener_addrs()[0]
    );
    assert!(m.contains(&line), "{line} in\n{m}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_overrides_reach_the_attempt_driver() {
    let slow = backends(1, Duration::from_millis(400)).await;
    let good = backends(1, Duration::ZERO).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"slow\"\n\n\
         [[listener.route]]\npath = \"/hurry\"\ncluster = \"slow\"\nrequest_timeout = \"100ms\"\n\n\
         [[listener.route]]\npath = \"/once\"\ncluster = \"flaky\"\nretry_attempts = 0\n\n\
         [[listener.route]]\npath = \"/twice\"\ncluster = \"flaky\"\n\
         {}{}",
        cluster("slow", &[slow[0].addr()], "request_timeout = \"5s\""),
        cluster(
            "flaky",
            &[dead, good[0].addr()],
            "strategy = \"round-robin\"\n[cluster.retry]\nattempts = 1\n"
        ),
    );
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let url = |path: &str| format!("http://{}{path}", proxy.listener_addrs()[0]);
    let c = client();
    // request_timeout: the route's 100 ms against the slow endpoint's 400 ms; the cluster's
    // own 5 s elsewhere.
    let r = send(&c, Method::GET, &url("/hurry"), &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.text());
    let r = send(&c, Method::GET, &url("/leisure"), &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    // retry_attempts: round-robin alternates between the dead endpoint and the good one;
    // without retries every other request fails, with the cluster's one retry none does.
    let statuses = |path: &'static str| {
        let c = c.clone();
        let u = url(path);
        async move {
            let mut v = Vec::new();
            for _ in 0..4 {
                v.push(
                    send(&c, Method::GET, &u, &[], b"")
                        .await
                        .unwrap()
                        .status
                        .as_u16(),
                );
            }
            v.sort_unstable();
            v
        }
    };
    assert_eq!(statuses("/once").await, vec![200, 200, 502, 502]);
    assert_eq!(statuses("/twice").await, vec![200, 200, 200, 200]);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// GET over HTTP/2 on `io` with this authority; the `x-keel-endpoint` or the status.
async fn h2_get<I>(io: I, authority: &str, path: &str) -> String
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri(format!("https://{authority}{path}"))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status();
    let endpoint = resp
        .headers()
        .get("x-keel-endpoint")
        .map(|v| v.to_str().unwrap().to_string());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    match endpoint {
        Some(e) if status == StatusCode::OK => e,
        _ => format!(
            "{} {}",
            status.as_u16(),
            String::from_utf8_lossy(&body).trim()
        ),
    }
}

/// GET over HTTP/1.1 on `io` with this Host; the `x-keel-endpoint` or the status.
async fn h1_get<I>(io: I, host: &str, path: &str) -> String
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", host)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status();
    let endpoint = resp
        .headers()
        .get("x-keel-endpoint")
        .map(|v| v.to_str().unwrap().to_string());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    match endpoint {
        Some(e) if status == StatusCode::OK => e,
        _ => format!(
            "{} {}",
            status.as_u16(),
            String::from_utf8_lossy(&body).trim()
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_apply_to_http2_and_to_tls_listeners() {
    let bs = backends(2, Duration::ZERO).await;
    let (a, b) = (bs[0].addr().to_string(), bs[1].addr().to_string());
    // A self-signed certificate for the TLS listener.
    let dir = std::env::temp_dir().join(format!("keel-routes-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["a.example.test".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    let routes = "[[listener.route]]\nhost = \"a.example.test\"\ncluster = \"a\"\n\n[[listener.route]]\npath_prefix = \"/b/\"\ncluster = \"b\"\n";
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\n{routes}\n\
         [[listener]]\nlisten = \"127.0.0.1:0\"\n[listener.tls]\ncert = {:?}\nkey = {:?}\n{routes}\n{}{}",
        dir.join("cert.pem").display().to_string(),
        dir.join("key.pem").display().to_string(),
        cluster("a", &[bs[0].addr()], ""),
        cluster("b", &[bs[1].addr()], ""),
    );
    let proxy = keel_proxy::start(load(&text)).await.unwrap();
    let [plain, tls] = [proxy.listener_addrs()[0], proxy.listener_addrs()[1]];
    let not_found = "404 404 Not Found: no route matches the request";

    // HTTP/2 with prior knowledge on the plain listener: the `:authority` is the host.
    let tcp = || async { tokio::net::TcpStream::connect(plain).await.unwrap() };
    assert_eq!(h2_get(tcp().await, "a.example.test:1", "/x").await, a);
    assert_eq!(h2_get(tcp().await, "z.test", "/b/x").await, b);
    assert_eq!(h2_get(tcp().await, "z.test", "/x").await, not_found);

    // TLS, HTTP/1.1 and HTTP/2 by ALPN.
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let connect = |alpn: &'static [u8]| {
        let roots = roots.clone();
        async move {
            let mut config =
                rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
            config.alpn_protocols = vec![alpn.to_vec()];
            let tcp = tokio::net::TcpStream::connect(tls).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("a.example.test").unwrap();
            tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        h1_get(connect(b"http/1.1").await, "a.example.test", "/x").await,
        a
    );
    assert_eq!(h1_get(connect(b"http/1.1").await, "z.test", "/b/").await, b);
    assert_eq!(
        h1_get(connect(b"http/1.1").await, "z.test", "/").await,
        not_found
    );
    assert_eq!(
        h2_get(connect(b"h2").await, "a.example.test", "/x").await,
        a
    );
    assert_eq!(h2_get(connect(b"h2").await, "z.test", "/b/y").await, b);
    assert_eq!(h2_get(connect(b"h2").await, "z.test", "/").await, not_found);
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_change_by_reload() {
    let bs = backends(2, Duration::ZERO).await;
    let (a, b) = (bs[0].addr().to_string(), bs[1].addr().to_string());
    let text = |prefix: &str| {
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"a\"\n\n[[listener.route]]\npath_prefix = \"{prefix}\"\ncluster = \"b\"\n{}{}",
            cluster("a", &[bs[0].addr()], ""),
            cluster("b", &[bs[1].addr()], ""),
        )
    };
    let proxy = keel_proxy::start(load(&text("/one/"))).await.unwrap();
    let url = |path: &str| format!("http://{}{path}", proxy.listener_addrs()[0]);
    assert_eq!(served_by(&url("/one/x"), Method::GET, &[]).await, b);
    assert_eq!(served_by(&url("/two/x"), Method::GET, &[]).await, a);
    let mut next = load(&text("/two/"));
    next.listeners[0].listen = proxy.config().listeners[0].listen;
    proxy.reload(next).unwrap();
    assert_eq!(served_by(&url("/one/x"), Method::GET, &[]).await, a);
    assert_eq!(served_by(&url("/two/x"), Method::GET, &[]).await, b);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn route_errors_are_located() {
    let head = "[[listener]]\nlisten = \"127.0.0.1:0\"\n";
    let tail = "\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";
    let err = |route: &str| {
        ProxyConfig::from_toml_str(
            &format!("{head}[[listener.route]]\n{route}\n{tail}"),
            "r.toml",
        )
        .unwrap_err()
    };
    for (route, key, line, words) in [
        (
            "cluster = \"nope\"",
            "listener[0].route[0].cluster",
            4,
            "no cluster named `nope`",
        ),
        (
            "host = \"a.test:80\"\ncluster = \"app\"",
            "listener[0].route[0].host",
            4,
            "not a host name",
        ),
        (
            "host = \"a.*.test\"\ncluster = \"app\"",
            "listener[0].route[0].host",
            4,
            "not a host name",
        ),
        (
            "path = \"/a\"\npath_prefix = \"/b\"\ncluster = \"app\"",
            "listener[0].route[0].path",
            4,
            "not both",
        ),
        (
            "path_prefix = \"v1/\"\ncluster = \"app\"",
            "listener[0].route[0].path_prefix",
            4,
            "start with `/`",
        ),
        (
            "path = \"/a?b\"\ncluster = \"app\"",
            "listener[0].route[0].path",
            4,
            "no query",
        ),
        (
            "methods = [\"GE T\"]\ncluster = \"app\"",
            "listener[0].route[0].methods",
            4,
            "not a method",
        ),
        (
            "headers = { \"x y\" = \"1\" }\ncluster = \"app\"",
            "listener[0].route[0].headers",
            4,
            "not a header name",
        ),
        (
            "retry_attempts = 11\ncluster = \"app\"",
            "listener[0].route[0].retry_attempts",
            4,
            "0..=10",
        ),
        (
            "request_timeout = \"0s\"\ncluster = \"app\"",
            "listener[0].route[0].request_timeout",
            4,
            "at least 1ms",
        ),
        (
            "cluster = \"app\"\nweight = 3",
            "listener[0].route[0].weight",
            5,
            "unknown field",
        ),
    ] {
        let e = err(route);
        assert_eq!(e.key.as_deref(), Some(key), "{route}: {e}");
        assert_eq!(e.line, Some(line), "{route}: {e}");
        assert!(e.message.contains(words), "{route}: {e}");
    }
    // A listener without routes needs a cluster.
    let e = ProxyConfig::from_toml_str(&format!("{head}{tail}"), "r.toml").unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].cluster"), "{e}");
}
