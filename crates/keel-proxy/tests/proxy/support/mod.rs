//! Helpers shared by the proxy's loopback tests: backends on ephemeral ports, configurations
//! derived from examples/proxy.toml, and a small HTTP client.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use keel_model::{FailureMode, Latency};
use keel_proxy::ProxyConfig;
use keel_testbed::backend::{self, BackendConfig, BackendHandle};

/// examples/proxy.toml, verbatim.
pub const EXAMPLE_CONFIG: &str = include_str!("../../../../../examples/proxy.toml");

/// Loopback, any port.
pub fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Starts `n` backends named b0..b{n-1} with this latency.
pub async fn backends(n: usize, latency: Duration) -> Vec<BackendHandle> {
    let mut v = Vec::new();
    for i in 0..n {
        let cfg = BackendConfig {
            latency: Latency::fixed(latency),
            name: format!("b{i}"),
            ..BackendConfig::default()
        };
        v.push(backend::spawn(any_port(), cfg).await.unwrap());
    }
    v
}

/// examples/proxy.toml with listener and admin on ephemeral ports and the five endpoints replaced
/// by `addrs` (the first keeps weight 2), then `edit` applied to the text.
pub fn example_config(addrs: &[SocketAddr], edit: impl Fn(String) -> String) -> ProxyConfig {
    assert_eq!(addrs.len(), 5);
    let mut text = EXAMPLE_CONFIG
        .replace("127.0.0.1:9901", "127.0.0.1:0")
        .replace("127.0.0.1:8080", "127.0.0.1:0");
    for (i, a) in addrs.iter().enumerate() {
        text = text.replace(&format!("127.0.0.1:900{}", i + 1), &a.to_string());
    }
    // The tests tell endpoints apart by `x-keel-endpoint`, off by default.
    text = text.replace(
        "[[cluster]]\n",
        "[[cluster]]\nresponse_headers = { endpoint = true }\n",
    );
    ProxyConfig::from_toml_str(&edit(text), "test.toml").unwrap()
}

/// A configuration with one listener, one cluster over `addrs` and `cluster_extra` lines
/// appended to the cluster table (tables may follow).
pub fn simple_config(addrs: &[SocketAddr], strategy: &str, cluster_extra: &str) -> ProxyConfig {
    let eps: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nerror_detail = \"full\"\ntrusted_proxies = [\"127.0.0.1/32\"]\n\n[[cluster]]\nname = \"app\"\nresponse_headers = {{ endpoint = true }}\nstrategy = \"{strategy}\"\nendpoints = [{}]\n{cluster_extra}\n",
        eps.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "test.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// A response read whole.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Got {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A plain HTTP/1.1 client.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends a request and reads the whole response (or the error, as text) within 5 s.
pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &'static [u8],
) -> Result<Got, String> {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(Bytes::from_static(body))).unwrap();
    let work = async {
        let resp = client.request(req).await.map_err(|e| format!("{e:?}"))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| format!("body: {e:?}"))?
            .to_bytes();
        Ok(Got {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .map_err(|_| "client timeout".to_string())?
}

/// GET `url` with a fresh client.
pub async fn get(url: &str) -> Result<Got, String> {
    send(&client(), Method::GET, url, &[], b"").await
}

/// Sets a fault and waits until it is in force.
pub async fn fault(b: &BackendHandle, f: FailureMode) {
    b.apply_fault(f).await.unwrap();
}

/// A server that answers every request with its method, headers and body length as text
/// (one `name: value` per line), plus hop-by-hop headers of its own that a proxy must drop.
pub async fn echo_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<hyper::body::Incoming>| async move {
                    let (parts, body) = req.into_parts();
                    let body = body
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    let mut text =
                        format!("method: {}\nbody-length: {}\n", parts.method, body.len());
                    for (k, v) in &parts.headers {
                        text.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
                    }
                    let resp = hyper::Response::builder()
                        .header("x-backend", "echo")
                        .header("keep-alive", "timeout=5")
                        .header("connection", "x-secret")
                        .header("x-secret", "1")
                        .body(Full::new(Bytes::from(text)))
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

/// A server that answers every connection with bytes that are not HTTP.
pub async fn garbage_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = stream.read(&mut buf).await;
                let _ = stream.write_all(b"SMTP ready, not HTTP\r\n\r\n").await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (addr, task)
}

/// Polls `cond` every 20 ms for up to `limit`; true if it became true.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}

/// An HTTP/2 connection (prior knowledge) to `addr`.
pub async fn h2_connect(
    addr: SocketAddr,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// Sends a bodiless request on an HTTP/2 connection and reads the whole response.
pub async fn h2_send(
    sender: &mut hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
) -> Got {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(http_body_util::Empty::new()).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), sender.send_request(req))
        .await
        .expect("HTTP/2 response within 5 s")
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Got {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// The value of a metric line (`name{labels}`) in the admin listener's `/metrics`.
pub async fn metric(admin: SocketAddr, line_start: &str) -> Option<f64> {
    let text = get(&format!("http://{admin}/metrics")).await.ok()?.text();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

/// Sends `bytes` on a new connection and reads what comes back until the proxy closes it (or
/// 5 s pass): for requests no HTTP client library would send as written.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}
