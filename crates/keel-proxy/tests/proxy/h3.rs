//! HTTP/3 on loopback with a real HTTP/3 client (hyperium's h3 over quinn, the client side of
//! the crates keel serves it with): a TLS listener with `h3 = true` answers over QUIC as it
//! does over HTTP/2 (status, headers, body, through routes, a retry and the access log), its
//! TCP answers carry `Alt-Svc`, request bodies stream both ways, many requests on several
//! connections all succeed, a client that stops reading is cut, and a drain sends GOAWAY.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Empty};
use hyper::{Request, StatusCode};
use keel_proxy::ProxyConfig;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::CertificateDer;

use crate::support::echo_server;

/// A CA and a server certificate for `localhost` and `127.0.0.1`, in a directory of their own.
struct Pki {
    dir: PathBuf,
    ca: CertificateDer<'static>,
}

impl Pki {
    fn generate(test: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("keel-h3-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        Pki {
            dir,
            ca: ca.der().clone(),
        }
    }

    fn toml(&self, name: &str) -> String {
        format!("{:?}", self.dir.join(name).display().to_string())
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.clone()).unwrap();
        roots
    }

    /// A TLS client config trusting the CA, offering `alpn`.
    fn client(&self, alpn: &[u8]) -> rustls::ClientConfig {
        let mut config = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(self.roots())
            .with_no_client_auth();
        config.alpn_protocols = vec![alpn.to_vec()];
        config
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server that drops the first connection it gets without an answer (its endpoint fails
/// once) and answers `ok` on every other.
async fn fails_once() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            n += 1;
            let first = n == 1;
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) if first => return,
                        Ok(_) => {
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-backend: flaky\r\n\r\nok";
                            if stream.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

/// A TLS listener with `h3 = true`: `/flaky` to an endpoint that fails once, everything else
/// to the echo server; the access log in `log` when given.
fn config(
    pki: &Pki,
    echo: SocketAddr,
    flaky: SocketAddr,
    log: Option<&PathBuf>,
    extra: &str,
) -> ProxyConfig {
    let log = log.map_or(String::new(), |p| {
        format!(
            "[access_log]\npath = {:?}\nformat = \"json\"\n\n",
            p.display().to_string()
        )
    });
    let text = format!(
        r#"{log}[[listener]]
listen = "127.0.0.1:0"
cluster = "echo"
h3 = true
{extra}
[listener.tls]
cert = {cert}
key = {key}

[[listener.route]]
path_prefix = "/flaky"
cluster = "flaky"

[[cluster]]
name = "echo"
response_headers = {{ endpoint = true }}
endpoints = [{{ address = "{echo}" }}]

[[cluster]]
name = "flaky"
response_headers = {{ endpoint = true }}
endpoints = [{{ address = "{flaky}" }}]
[cluster.retry]
attempts = 2
budget_percent = 100
"#,
        cert = pki.toml("server.pem"),
        key = pki.toml("server.key"),
    );
    ProxyConfig::from_toml_str(&text, "test.toml").unwrap_or_else(|e| panic!("{e}\n{text}"))
}

type H3Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

/// An HTTP/3 connection to `addr`, its driver running in a task.
async fn h3_connect(pki: &Pki, addr: SocketAddr) -> (quinn::Endpoint, H3Send) {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(pki.client(b"h3")).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = endpoint
        .connect(addr, "localhost")
        .unwrap()
        .await
        .expect("QUIC handshake");
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = std::future::poll_fn(|cx| driver.poll_close(cx)).await;
    });
    (endpoint, send)
}

/// A response read whole: status, headers, body.
struct Answer {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends a request over HTTP/3 (with `body`, in pieces of 16 KiB) and reads the answer.
async fn h3_request(
    send: &mut H3Send,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Answer, String> {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let work = async {
        let mut stream = send
            .send_request(b.body(()).unwrap())
            .await
            .map_err(|e| e.to_string())?;
        for piece in body.chunks(16 * 1024) {
            stream
                .send_data(Bytes::copy_from_slice(piece))
                .await
                .map_err(|e| e.to_string())?;
        }
        stream.finish().await.map_err(|e| e.to_string())?;
        let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
        let mut data = Vec::new();
        while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
            while chunk.has_remaining() {
                let c = chunk.chunk();
                data.extend_from_slice(c);
                let n = c.len();
                chunk.advance(n);
            }
        }
        Ok(Answer {
            status: resp.status(),
            headers: resp.headers().clone(),
            body: Bytes::from(data),
        })
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| "HTTP/3 client timeout".to_string())?
}

/// An HTTP/2 connection over TLS (ALPN `h2`) to `addr`.
async fn h2_connect(
    pki: &Pki,
    addr: SocketAddr,
) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(pki.client(b"h2")));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

async fn h2_get(
    send: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    url: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut b = Request::builder().uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = send
        .send_request(b.body(Empty::new()).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The headers that matter in a comparison of two answers (not `date`, not `alt-svc`).
fn compared(a: &Answer) -> Vec<(String, String)> {
    let mut v: Vec<_> = a
        .headers
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "date" | "alt-svc"))
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").to_string()))
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_answers_as_h2_through_routes_retries_and_the_access_log() {
    let pki = Pki::generate("same");
    let (echo, _e) = echo_server().await;
    let flaky = fails_once().await;
    let log = pki.dir.join("access.log");
    let proxy = keel_proxy::start(config(&pki, echo, flaky, Some(&log), ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (_ep, mut h3) = h3_connect(&pki, addr).await;
    let mut h2 = h2_connect(&pki, addr).await;
    let url = format!("https://localhost:{}/echo?x=1", addr.port());
    let headers = [("x-request-id", "same-id"), ("user-agent", "keel-test")];
    let over3 = h3_request(&mut h3, "GET", &url, &headers, b"")
        .await
        .unwrap();
    let over2 = h2_get(&mut h2, &url, &headers).await;
    assert_eq!(over3.status, StatusCode::OK);
    assert_eq!(over3.status, over2.status);
    assert_eq!(compared(&over3), compared(&over2));
    // The endpoint got the same request either way (the echo shows its head).
    assert_eq!(
        String::from_utf8_lossy(&over3.body),
        String::from_utf8_lossy(&over2.body)
    );
    assert!(String::from_utf8_lossy(&over3.body).contains("x-forwarded-proto: https"));
    // HTTP/2 answers announce HTTP/3; HTTP/3 answers do not repeat it.
    assert_eq!(
        over2.header("alt-svc"),
        Some(format!("h3=\":{}\"; ma=86400", addr.port()).as_str())
    );
    assert_eq!(over3.header("alt-svc"), None);

    // A route to an endpoint that fails once: the retry answers.
    let flaky_url = format!("https://localhost:{}/flaky", addr.port());
    let retried = h3_request(&mut h3, "GET", &flaky_url, &[], b"")
        .await
        .unwrap();
    assert_eq!(retried.status, StatusCode::OK);
    assert_eq!(&retried.body[..], b"ok");
    assert_eq!(retried.header("x-backend"), Some("flaky"));

    // A body larger than what is read whole streams to the endpoint.
    let big = vec![b'x'; 300 * 1024];
    let posted = h3_request(&mut h3, "POST", &url, &[], &big).await.unwrap();
    assert_eq!(posted.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&posted.body).into_owned();
    assert!(text.contains("body-length: 307200"), "{text}");
    // And one that is read whole, with its length.
    let small = h3_request(&mut h3, "PUT", &url, &[("content-length", "5")], b"hello")
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&small.body).contains("body-length: 5"));

    drop(h3);
    proxy.shutdown(Duration::from_secs(2)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let h3_lines: Vec<_> = lines
        .iter()
        .filter(|l| l["protocol"] == "HTTP/3.0")
        .collect();
    assert_eq!(h3_lines.len(), 4, "{text}");
    let flaky_line = h3_lines.iter().find(|l| l["path"] == "/flaky").unwrap();
    assert_eq!(flaky_line["attempts"], 2, "{text}");
    assert_eq!(flaky_line["route"], 0);
    assert_eq!(flaky_line["status"], 200);
    assert!(lines.iter().any(|l| l["protocol"] == "HTTP/2.0"));
}

/// A request whose head goes first and whose data (if any) and end follow 200 ms later: the
/// response's body, as text.
async fn late_end(h3: &mut H3Send, url: &str, method: &str, body: &'static [u8]) -> String {
    let request = Request::builder().method(method).uri(url).body(()).unwrap();
    let mut stream = h3.send_request(request).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    if !body.is_empty() {
        stream.send_data(Bytes::from_static(body)).await.unwrap();
    }
    stream.finish().await.unwrap();
    let response = stream.recv_response().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut text = Vec::new();
    while let Some(mut chunk) = stream.recv_data().await.unwrap() {
        text.extend_from_slice(&chunk.copy_to_bytes(chunk.remaining()));
    }
    String::from_utf8(text).unwrap()
}

/// HTTP/3 tells a request's end only by its stream's end, which may come after the head: a
/// GET whose end comes 200 ms after its head reaches an HTTP/1.1 endpoint framed as having no
/// body (as the same GET whose end came with its head), not chunked; a POST of no declared
/// length whose data comes late is sent chunked, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_a_request_whose_end_comes_after_its_head_is_framed_by_it() {
    let pki = Pki::generate("late-end");
    let (echo, _e) = echo_server().await;
    let flaky = fails_once().await;
    let proxy = keel_proxy::start(config(&pki, echo, flaky, None, ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (_ep, mut h3) = h3_connect(&pki, addr).await;
    let url = format!("https://localhost:{}/echo", addr.port());
    let get = late_end(&mut h3, &url, "GET", b"").await;
    assert!(get.contains("body-length: 0"), "{get}");
    assert!(!get.contains("transfer-encoding"), "{get}");
    let post = late_end(&mut h3, &url, "POST", b"hello").await;
    assert!(post.contains("body-length: 5"), "{post}");
    assert!(post.contains("transfer-encoding: chunked"), "{post}");
    let prompt = h3_request(&mut h3, "GET", &url, &[], b"").await.unwrap();
    // The same head either way, but for the request id keel makes for each.
    let id = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with("x-request-id:"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(id(&String::from_utf8_lossy(&prompt.body)), id(&get));
    drop(h3);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_serves_many_requests_on_several_connections_without_an_error() {
    let pki = Pki::generate("many");
    let (echo, _e) = echo_server().await;
    let flaky = fails_once().await;
    let proxy = keel_proxy::start(config(&pki, echo, flaky, None, ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let ok = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (ep, send) = h3_connect(&pki, addr).await;
        let ok = ok.clone();
        let url = format!("https://localhost:{}/", addr.port());
        tasks.push(tokio::spawn(async move {
            let _ep = ep;
            // 10 requests at a time on each connection.
            for _ in 0..25 {
                let mut batch = Vec::new();
                for _ in 0..10 {
                    let mut s = send.clone();
                    let url = url.clone();
                    batch.push(tokio::spawn(async move {
                        h3_request(&mut s, "GET", &url, &[], b"").await
                    }));
                }
                for b in batch {
                    let a = b.await.unwrap().unwrap();
                    assert_eq!(a.status, StatusCode::OK);
                    ok.fetch_add(1, Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(ok.load(Relaxed), 1000);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h3_cuts_a_response_the_client_does_not_read_and_drains_with_goaway() {
    // A large response the client never reads: the stream is cut at `client_idle_timeout`,
    // and the connection stays usable.
    let pki = Pki::generate("stall");
    let big = keel_testbed::backend::spawn(
        "127.0.0.1:0".parse().unwrap(),
        keel_testbed::backend::BackendConfig {
            body_bytes: 8 << 20,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let flaky = fails_once().await;
    let proxy = keel_proxy::start(config(
        &pki,
        big.addr(),
        flaky,
        None,
        "client_idle_timeout = \"300ms\"",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (_ep, mut send) = h3_connect(&pki, addr).await;
    let url = format!("https://localhost:{}/", addr.port());
    let mut stream = send
        .send_request(Request::get(&url).body(()).unwrap())
        .await
        .unwrap();
    stream.finish().await.unwrap();
    let resp = stream.recv_response().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // Read nothing for a while: keel holds at most the stream's window, then cuts.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let started = Instant::now();
    let mut got = 0usize;
    let cut = loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.recv_data()).await {
            Ok(Ok(Some(c))) => got += c.remaining(),
            Ok(Ok(None)) => break false,
            Ok(Err(_)) => break true,
            Err(_) => panic!("no end of the stream within 5 s"),
        }
    };
    assert!(cut, "the stream was cut (got {got} bytes)");
    assert!(got < 4 << 20, "got {got} bytes of 8 MiB before the cut");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The connection still serves.
    let flaky_url = format!("https://localhost:{}/flaky", addr.port());
    let a = h3_request(&mut send, "GET", &flaky_url, &[], b"")
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::OK);

    // A drain: the connection gets GOAWAY and closes; nothing was left to cut.
    let drained = proxy.shutdown(Duration::from_secs(2)).await;
    assert_eq!(drained.total(), 0);
    // After the GOAWAY, new requests are refused.
    let after = h3_request(&mut send, "GET", &url, &[], b"").await;
    assert!(after.is_err());
}

#[test]
fn h3_needs_a_tls_listener_without_proxy_protocol() {
    let pki = Pki::generate("config");
    let listener = |keys: &str, tls: bool| {
        let tls = if tls {
            format!(
                "[listener.tls]\ncert = {}\nkey = {}\n",
                pki.toml("server.pem"),
                pki.toml("server.key")
            )
        } else {
            String::new()
        };
        format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{keys}\n{tls}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"127.0.0.1:1\" }}]\n"
        )
    };
    let err = |text: String| {
        ProxyConfig::from_toml_str(&text, "keel.toml")
            .unwrap_err()
            .to_string()
    };
    let e = err(listener("h3 = true", false));
    assert!(e.contains("h3") && e.contains("needs TLS"), "{e}");
    let e = err(listener("protocol = \"h3\"", false));
    assert!(e.contains("protocol") && e.contains("needs TLS"), "{e}");
    let e = err(listener(
        "h3 = true\nproxy_protocol = true\ntrusted_proxies = [\"127.0.0.1/32\"]",
        true,
    ));
    assert!(e.contains("PROXY protocol"), "{e}");
    let e = err(listener("h3 = true\nprotocol = \"tcp\"", true));
    assert!(e.contains("not `protocol = \"tcp\"`"), "{e}");
    for keys in ["h3 = true", "protocol = \"h3\""] {
        let c = ProxyConfig::from_toml_str(&listener(keys, true), "keel.toml").unwrap();
        assert!(c.listeners[0].serves_h3(), "{keys}");
    }
    let c = ProxyConfig::from_toml_str(&listener("", true), "keel.toml").unwrap();
    assert!(!c.listeners[0].serves_h3());
}

/// A listener whose UDP port is taken still serves TCP, and announces no HTTP/3 it cannot
/// serve (a client told `Alt-Svc` would try QUIC there and find another program).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_without_its_udp_port_announces_no_h3() {
    let pki = Pki::generate("udp-taken");
    let (echo, _e) = echo_server().await;
    // A UDP port held here, and keel's TCP listener on the same number. Another test may hold
    // that number in TCP: then try another.
    let mut tries = 0;
    let (proxy, port, taken) = loop {
        tries += 1;
        let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:{port}\"\ncluster = \"echo\"\nh3 = true\n\
             [listener.tls]\ncert = {cert}\nkey = {key}\n\n\
             [[cluster]]\nname = \"echo\"\nendpoints = [{{ address = \"{echo}\" }}]\n",
            cert = pki.toml("server.pem"),
            key = pki.toml("server.key"),
        );
        let config = ProxyConfig::from_toml_str(&text, "test.toml").unwrap();
        match keel_proxy::start(config).await {
            Ok(proxy) => break (proxy, port, taken),
            Err(e) if tries < 20 => eprintln!("port {port} taken in TCP ({e}); another"),
            Err(e) => panic!("no port free in both UDP and TCP after 20 tries: {e}"),
        }
    };
    let addr = proxy.listener_addrs()[0];
    let mut h2 = h2_connect(&pki, addr).await;
    let url = format!("https://localhost:{port}/echo");
    let answer = h2_get(&mut h2, &url, &[]).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(answer.header("alt-svc"), None);
    proxy.shutdown(Duration::from_secs(1)).await;
    drop(taken);
}
