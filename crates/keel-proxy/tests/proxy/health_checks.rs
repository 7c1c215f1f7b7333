//! Health checks an operator points at what an endpoint serves: a `Host` (a name-based
//! endpoint answers 404 to any other), a method, the statuses that pass, text the body must
//! have, another port; each against a real server on loopback.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response};
use keel_proxy::{ProxyConfig, ProxyHandle};

use crate::support::*;

/// A server that serves only `app.example`: 200 and `ready: app` to it (any method; no body
/// to HEAD), 404 to any other `Host`; 503 for `/down`. Each request's `method host` is kept.
async fn name_based() -> (SocketAddr, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let log = log.clone();
                    async move {
                        let host = req
                            .headers()
                            .get("host")
                            .and_then(|h| h.to_str().ok())
                            .unwrap_or("")
                            .to_string();
                        log.lock().unwrap().push(format!("{} {host}", req.method()));
                        let _ = req.into_body().collect().await;
                        let (status, body) = if host != "app.example" {
                            (404, "no such site")
                        } else {
                            (200, "ready: app")
                        };
                        Ok::<_, std::convert::Infallible>(
                            Response::builder()
                                .status(status)
                                .body(Full::new(Bytes::from(body)))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, seen)
}

/// A proxy whose cluster `app` has `endpoint` and this `[cluster.health_check]` (every 50 ms,
/// one check decides).
async fn checked(endpoint: SocketAddr, check: &str) -> ProxyHandle {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n[cluster.health_check]\ninterval = \"50ms\"\ntimeout = \"1s\"\nunhealthy_threshold = 1\nhealthy_threshold = 1\n{check}\n"
    );
    let config = ProxyConfig::from_toml_str(&text, "t.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
    keel_proxy::start(config).await.unwrap()
}

fn healthy(p: &ProxyHandle) -> bool {
    p.cluster_status("app").unwrap()[0].healthy
}

/// After a few checks (50 ms apart), whether the endpoint is up: it starts up, so down is
/// seen as soon as it is marked; up is checked after enough rounds to have gone down.
async fn settles_healthy(p: &ProxyHandle) -> bool {
    tokio::time::sleep(Duration::from_millis(400)).await;
    healthy(p)
}

/// After a proxy's shutdown: a check already on the wire may reach the server just after (CI
/// saw one land after the list was cleared), so let it land; then no check may come, since the
/// checks stop with the proxy.
async fn no_more_checks(seen: &std::sync::Mutex<Vec<String>>) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let settled = seen.lock().unwrap().len();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(seen.lock().unwrap().len(), settled, "checks after shutdown");
}

/// The name-based endpoint is healthy only when the check sends its `Host`: without it every
/// check gets 404 and the endpoint is marked down; with `host = "app.example"` it stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_based_endpoint_is_healthy_only_with_its_host() {
    let (server, seen) = name_based().await;
    let p = checked(server, "path = \"/\"").await;
    assert!(!settles_healthy(&p).await, "404 without the Host");
    p.shutdown(Duration::from_secs(1)).await;
    no_more_checks(&seen).await;
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|s| s == &format!("GET {server}")));

    seen.lock().unwrap().clear();
    let p = checked(server, "path = \"/\"\nhost = \"app.example\"").await;
    assert!(settles_healthy(&p).await, "200 with it");
    // A request through keel is served, so the endpoint is in use.
    let r = send(
        &client(),
        hyper::Method::GET,
        &format!("http://{}/", p.listener_addrs()[0]),
        &[("host", "app.example")],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    p.shutdown(Duration::from_secs(1)).await;
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(seen.iter().all(|s| s == "GET app.example"), "{seen:?}");
}

/// `expected_statuses` lets a 404 pass (HAProxy's `http-check expect status 200-399` spelling
/// as well as single codes); `expected_body` fails a 200 whose body lacks the text; `method`
/// is sent as written (HEAD: no body awaited); `port` checks another port of the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_body_method_and_port_are_the_checks_own() {
    let (server, seen) = name_based().await;
    let p = checked(
        server,
        "path = \"/\"\nexpected_statuses = [\"200-399\", 404]",
    )
    .await;
    assert!(settles_healthy(&p).await, "404 listed");
    p.shutdown(Duration::from_secs(1)).await;

    let p = checked(server, "path = \"/\"\nexpected_statuses = [\"200-399\"]").await;
    assert!(!settles_healthy(&p).await, "404 not listed");
    p.shutdown(Duration::from_secs(1)).await;

    let p = checked(
        server,
        "host = \"app.example\"\nexpected_body = \"ready: app\"",
    )
    .await;
    assert!(settles_healthy(&p).await, "the body has the text");
    p.shutdown(Duration::from_secs(1)).await;
    let p = checked(
        server,
        "host = \"app.example\"\nexpected_body = \"ready: db\"",
    )
    .await;
    assert!(!settles_healthy(&p).await, "the body lacks the text");
    p.shutdown(Duration::from_secs(1)).await;

    no_more_checks(&seen).await;
    seen.lock().unwrap().clear();
    let p = checked(server, "host = \"app.example\"\nmethod = \"HEAD\"").await;
    assert!(settles_healthy(&p).await, "HEAD, answered without a body");
    p.shutdown(Duration::from_secs(1)).await;
    assert!(seen.lock().unwrap().iter().all(|s| s == "HEAD app.example"));

    // The endpoint's own port is closed; the check goes to the server's port instead.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let p = checked(
        closed,
        &format!("host = \"app.example\"\nport = {}", server.port()),
    )
    .await;
    assert!(settles_healthy(&p).await, "checked on the other port");
    p.shutdown(Duration::from_secs(1)).await;
    let p = checked(closed, "host = \"app.example\"").await;
    assert!(!settles_healthy(&p).await, "its own port is closed");
    p.shutdown(Duration::from_secs(1)).await;
}

/// Mistakes in the new keys are refused at their line and column (`keel proxy --check`).
#[test]
fn bad_check_keys_are_located() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:1\" }]\n[cluster.health_check]\n";
    for (extra, expect) in [
        ("expected_statuses = [\"399-200\"]\n", "t.toml:9:"),
        ("expected_statuses = [\"2xx\"]\n", "t.toml:9:"),
        ("expected_statuses = [700]\n", "t.toml:9:"),
        ("expected_statuses = []\n", "t.toml:9:"),
        ("method = \"get\"\n", "t.toml:9:"),
        ("host = \"a b\"\n", "t.toml:9:"),
        ("port = 0\n", "t.toml:9:"),
        ("expected_body = \"\"\n", "t.toml:9:"),
        ("kind = \"tcp\"\nhost = \"a\"\n", "t.toml:10:"),
        ("kind = \"tcp\"\nexpected_body = \"ok\"\n", "t.toml:10:"),
    ] {
        let e = ProxyConfig::from_toml_str(&format!("{base}{extra}"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(expect), "{extra}: {e}");
        assert!(e.contains("`cluster[0].health_check."), "{extra}: {e}");
    }
    ProxyConfig::from_toml_str(&format!("{base}kind = \"tcp\"\nport = 9000\n"), "t.toml").unwrap();
}
