//! TLS on loopback with certificates generated at test time (rcgen): the listener terminates
//! TLS (HTTP/1.1 and HTTP/2 by ALPN), a client that never completes a handshake is cut after
//! the handshake timeout without holding up others, clusters reach TLS endpoints verified
//! against their CA (a wrong CA or name is a 502, never a success), and bad TLS settings are
//! located configuration errors.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A directory of PEM files made for one test, removed on drop.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// A CA, a server certificate for `localhost` and `127.0.0.1` signed by it, its key, a
    /// second unrelated CA and an unrelated key.
    fn generate(test: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("keel-tls-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, ca_key) = make_ca("keel test CA");
        let (other_ca, other_key) = make_ca("another CA");
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        let write = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
        write("ca.pem", ca.pem());
        write("other-ca.pem", other_ca.pem());
        write("server.pem", cert.pem());
        write("server.key", key.serialize_pem());
        write("other.key", KeyPair::generate().unwrap().serialize_pem());
        // Client certificates (mutual TLS): one from the test CA, one from the other.
        let leaf =
            |names: &[&str], signer: &rcgen::Certificate, signer_key: &KeyPair, file: &str| {
                let key = KeyPair::generate().unwrap();
                let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
                let cert = CertificateParams::new(names)
                    .unwrap()
                    .signed_by(&key, signer, signer_key)
                    .unwrap();
                write(&format!("{file}.pem"), cert.pem());
                write(&format!("{file}.key"), key.serialize_pem());
            };
        leaf(&["client.test"], &ca, &ca_key, "client");
        leaf(&["stranger.test"], &other_ca, &other_key, "stranger");
        // Certificates a listener chooses by SNI.
        leaf(&["a.test"], &ca, &ca_key, "a");
        leaf(&["*.b.test"], &ca, &ca_key, "wild-b");
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `path` as a TOML string (the directory is absolute).
    fn toml(&self, name: &str) -> String {
        format!("{:?}", self.path(name).display().to_string())
    }

    fn certs(&self, name: &str) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(self.path(name))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// A client trusting the test CA, offering `versions`, presenting `client` (a pair of
    /// files `NAME.pem`, `NAME.key`) when given.
    fn client(
        &self,
        client: Option<&str>,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for c in self.certs("ca.pem") {
            roots.add(c).unwrap();
        }
        let builder = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots);
        let mut config = match client {
            Some(name) => builder
                .with_client_auth_cert(
                    self.certs(&format!("{name}.pem")),
                    PrivateKeyDer::from_pem_file(self.path(&format!("{name}.key"))).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// A client trusting the test CA, offering these ALPN protocols.
    fn connector(&self, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for c in self.certs("ca.pem") {
            roots.add(c).unwrap();
        }
        let mut config = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }

    /// A server with the test server certificate, offering ALPN `http/1.1`.
    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        let key = PrivateKeyDer::from_pem_file(self.path("server.key")).unwrap();
        let mut config = rustls::ServerConfig::builder_with_provider(keel_proxy::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(self.certs("server.pem"), key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn make_ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    (params.self_signed(&key).unwrap(), key)
}

/// What a test backend saw.
#[derive(Default)]
struct Seen {
    /// `x-forwarded-proto` of each request other than health checks.
    proto: Mutex<Vec<String>>,
    /// Requests to `/healthz`.
    healthz: AtomicU64,
}

/// A small HTTP/1.1 backend (over TLS with `tls`) answering 200 `ok` and recording what it saw.
async fn backend(tls: Option<tokio_rustls::TlsAcceptor>) -> (SocketAddr, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Seen::default());
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        if req.uri().path() == "/healthz" {
                            seen.healthz.fetch_add(1, Relaxed);
                        } else {
                            let proto = req
                                .headers()
                                .get("x-forwarded-proto")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("(none)")
                                .to_string();
                            seen.proto.lock().unwrap().push(proto);
                        }
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
                    }
                });
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    None => {
                        let _ = http.serve_connection(TokioIo::new(tcp), svc).await;
                    }
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(tcp).await {
                            let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                        }
                    }
                }
            });
        }
    });
    (addr, seen)
}

/// One listener (with `listener_extra` lines, e.g. a `[listener.tls]` table) and one cluster over
/// `backend` (with `cluster_extra` lines).
fn config(backend: SocketAddr, listener_extra: &str, cluster_extra: &str) -> ProxyConfig {
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nerror_detail = \"full\"\n{listener_extra}\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{backend}\" }}]\nconnect_timeout = \"500ms\"\nrequest_timeout = \"3s\"\n{cluster_extra}\n"
    );
    ProxyConfig::from_toml_str(&text, "tls-test.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

fn listener_tls(pki: &Pki, extra: &str) -> String {
    format!(
        "{extra}\n[listener.tls]\ncert = {}\nkey = {}\n",
        pki.toml("server.pem"),
        pki.toml("server.key")
    )
}

/// A TLS connection to the proxy offering `alpn`; returns the stream and the negotiated ALPN.
async fn tls_connect(
    pki: &Pki,
    addr: SocketAddr,
    alpn: &[&[u8]],
) -> (tokio_rustls::client::TlsStream<TcpStream>, Option<Vec<u8>>) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let stream = pki.connector(alpn).connect(name, tcp).await.unwrap();
    let negotiated = stream.get_ref().1.alpn_protocol().map(|p| p.to_vec());
    (stream, negotiated)
}

/// `GET /` over HTTP/1.1 on an open stream (TLS or plain TCP): (status, version, body).
async fn get_h1<S>(stream: S) -> (StatusCode, Version, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get("/")
        .header("host", "localhost")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let (status, version) = (resp.status(), resp.version());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, version, String::from_utf8_lossy(&body).into_owned())
}

/// Plain `GET /` to the proxy: (status, body).
async fn get_plain(addr: SocketAddr) -> (StatusCode, String) {
    let (status, _, body) = get_h1(TcpStream::connect(addr).await.unwrap()).await;
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_serves_http1_and_http2_by_alpn() {
    let pki = Pki::generate("listener");
    let (backend_addr, seen) = backend(None).await;
    let proxy = keel_proxy::start(config(backend_addr, &listener_tls(&pki, ""), ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];

    // HTTP/1.1: the client offers only http/1.1.
    let (stream, alpn) = tls_connect(&pki, addr, &[b"http/1.1"]).await;
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    let (status, version, body) = get_h1(stream).await;
    assert_eq!(
        (status, version, body.as_str()),
        (StatusCode::OK, Version::HTTP_11, "ok")
    );

    // HTTP/2: the client offers both; the proxy prefers h2.
    let (stream, alpn) = tls_connect(&pki, addr, &[b"h2", b"http/1.1"]).await;
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    for _ in 0..3 {
        let req = Request::get("https://localhost/")
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.version(), Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
    }

    let proto = seen.proto.lock().unwrap().clone();
    assert_eq!(
        proto,
        vec!["https"; 4],
        "x-forwarded-proto seen by the backend"
    );
    assert_eq!(proxy.tls_handshake_failures(0), 0);

    // A plain-HTTP request on the TLS port is a failed handshake, not a request.
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), raw.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/"),
        "answered as plain HTTP: {buf:?}"
    );
    assert_eq!(
        seen.proto.lock().unwrap().len(),
        4,
        "forwarded a plain request"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_is_cut_and_holds_nobody_up() {
    let pki = Pki::generate("stall");
    let (backend_addr, seen) = backend(None).await;
    let timeout = Duration::from_millis(600);
    let proxy = keel_proxy::start(config(
        backend_addr,
        &listener_tls(&pki, "header_read_timeout = \"600ms\"\nmax_connections = 4"),
        "",
    ))
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];

    let started = Instant::now();
    // Three clients that never send a ClientHello take three of the four slots.
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    // A garbage "ClientHello" is refused at once.
    let mut garbage = TcpStream::connect(addr).await.unwrap();
    garbage
        .write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5])
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), garbage.read_to_end(&mut buf))
        .await
        .expect("garbage connection not closed")
        .ok();

    // Meanwhile a real client is served, well before the silent ones time out.
    let (stream, _) = tls_connect(&pki, addr, &[b"http/1.1"]).await;
    let (status, _, _) = get_h1(stream).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        started.elapsed() < timeout,
        "served only after {:?}",
        started.elapsed()
    );

    // The silent clients are disconnected at the handshake timeout.
    for mut s in silent {
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
            .await
            .expect("silent connection still open after 3 s");
        assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    }
    let waited = started.elapsed();
    assert!(
        waited >= timeout - Duration::from_millis(50) && waited < timeout * 3,
        "silent clients closed after {waited:?}, handshake timeout {timeout:?}"
    );
    // Their slots came back: four new clients at once (max_connections = 4) are all served.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let connector = pki.connector(&[b"http/1.1"]);
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let s = connector
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .unwrap();
            get_h1(s).await.0
        }));
    }
    for t in tasks {
        let status = tokio::time::timeout(Duration::from_secs(2), t)
            .await
            .expect("a client waited for a slot")
            .unwrap();
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(proxy.tls_handshake_failures(0), 4, "3 silent + 1 garbage");
    let metrics = crate::support::get(&format!("http://{}/metrics", proxy.admin_addr().unwrap()))
        .await
        .unwrap()
        .text();
    let line = format!(
        "keel_tls_handshake_failures_total{{listener=\"{}\"}} 4",
        proxy.listener_addrs()[0]
    );
    assert!(metrics.contains(&line), "{line} not in /metrics");
    assert_eq!(seen.proto.lock().unwrap().len(), 5);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_upstream_is_verified_against_the_cluster_ca() {
    let pki = Pki::generate("upstream");
    let (backend_addr, seen) = backend(Some(pki.acceptor())).await;
    let tls_table = |ca: &str, extra: &str| {
        format!(
            "[cluster.health_check]\ninterval = \"100ms\"\ntimeout = \"500ms\"\n[cluster.tls]\nca = {}\n{extra}",
            pki.toml(ca)
        )
    };
    let proxy = keel_proxy::start(config(backend_addr, "", &tls_table("ca.pem", "")))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    for _ in 0..3 {
        assert_eq!(get_plain(addr).await, (StatusCode::OK, "ok".to_string()));
    }
    assert_eq!(*seen.proto.lock().unwrap(), vec!["http"; 3]);
    // Health checks reach the TLS-only backend too (it answers nothing but TLS).
    let deadline = Instant::now() + Duration::from_secs(3);
    while seen.healthz.load(Relaxed) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen.healthz.load(Relaxed) >= 2, "no health check over TLS");
    assert!(proxy.cluster_status("app").unwrap()[0].healthy);

    // A CA that did not sign the backend's certificate: 502, the backend never sees a request.
    let before = seen.proto.lock().unwrap().len();
    proxy
        .reload(config(backend_addr, "", &tls_table("other-ca.pem", "")))
        .unwrap();
    let (status, body) = get_plain(addr).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert!(body.contains("certificate"), "{body}");
    // A name the certificate is not valid for: 502 too.
    proxy
        .reload(config(
            backend_addr,
            "",
            &tls_table("ca.pem", "server_name = \"other.example\""),
        ))
        .unwrap();
    let (status, body) = get_plain(addr).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(seen.proto.lock().unwrap().len(), before);

    // The right CA again (a reload may change [cluster.tls]), and a name the cert has.
    proxy
        .reload(config(
            backend_addr,
            "",
            &tls_table("ca.pem", "server_name = \"localhost\""),
        ))
        .unwrap();
    assert_eq!(get_plain(addr).await, (StatusCode::OK, "ok".to_string()));
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_cluster_to_a_tls_backend_is_a_502() {
    let pki = Pki::generate("plain-to-tls");
    let (backend_addr, seen) = backend(Some(pki.acceptor())).await;
    let proxy = keel_proxy::start(config(backend_addr, "", ""))
        .await
        .unwrap();
    let (status, _) = get_plain(proxy.listener_addrs()[0]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(seen.proto.lock().unwrap().is_empty());
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_tls_change_applies_by_reload_on_the_same_socket() {
    let pki = Pki::generate("reload");
    let (backend_addr, _) = backend(None).await;
    let proxy = keel_proxy::start(config(backend_addr, &listener_tls(&pki, ""), ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (_, alpn) = tls_connect(&pki, addr, &[b"http/1.1"]).await;
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    // TLS off: the same address now speaks plain HTTP to new connections.
    proxy.reload(config(backend_addr, "", "")).unwrap();
    assert_eq!(proxy.listener_addrs(), vec![addr]);
    assert_eq!(get_plain(addr).await, (StatusCode::OK, "ok".to_string()));
    // And on again.
    proxy
        .reload(config(backend_addr, &listener_tls(&pki, ""), ""))
        .unwrap();
    let (_, alpn) = tls_connect(&pki, addr, &[b"http/1.1"]).await;
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// Writes `text` as `proxy.toml` in the PKI directory and loads it.
fn load_file(pki: &Pki, text: &str) -> Result<ProxyConfig, keel_proxy::ConfigError> {
    let path = pki.path("proxy.toml");
    std::fs::write(&path, text).unwrap();
    ProxyConfig::from_file(&path)
}

const FILE_HEAD: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n";
const FILE_CLUSTER: &str =
    "\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9\" }]\n";

#[test]
fn tls_files_are_relative_to_the_config_file_and_errors_are_located() {
    let pki = Pki::generate("config");
    let with_listener_tls = |cert: &str, key: &str| {
        format!("{FILE_HEAD}[listener.tls]\ncert = \"{cert}\"\nkey = \"{key}\"\n{FILE_CLUSTER}")
    };
    // Relative names are found next to the file, whatever the current directory.
    let c = load_file(&pki, &with_listener_tls("server.pem", "server.key")).unwrap();
    let tls = c.listeners[0].tls.as_ref().unwrap();
    assert_eq!(tls.cert, pki.path("server.pem"));

    let e = load_file(&pki, &with_listener_tls("missing.pem", "server.key")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.cert"), "{e}");
    assert_eq!(e.line, Some(5), "{e}");
    assert!(
        e.message.contains("cannot read") && e.message.contains("missing.pem"),
        "{e}"
    );
    assert!(e.to_string().contains("proxy.toml:5:"), "{e}");

    let e = load_file(&pki, &with_listener_tls("server.pem", "other.key")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.key"), "{e}");
    assert_eq!(e.line, Some(6), "{e}");
    assert!(e.message.contains("does not match"), "{e}");

    let e = load_file(&pki, &with_listener_tls("server.key", "server.key")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.cert"), "{e}");
    assert!(e.message.contains("no certificate"), "{e}");

    let e = load_file(&pki, &with_listener_tls("server.pem", "server.pem")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.key"), "{e}");
    assert!(e.message.contains("no private key"), "{e}");

    let with_cluster_tls =
        |table: &str| format!("{FILE_HEAD}{FILE_CLUSTER}[cluster.tls]\n{table}\n");
    load_file(&pki, &with_cluster_tls("ca = \"ca.pem\"")).unwrap();
    let e = load_file(&pki, &with_cluster_tls("ca = \"nope.pem\"")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].tls.ca"), "{e}");
    assert_eq!(e.line, Some(9), "{e}");
    assert!(e.message.contains("cannot read"), "{e}");
    let e = load_file(
        &pki,
        &with_cluster_tls("ca = \"ca.pem\"\nserver_name = \"not a name\""),
    )
    .unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].tls.server_name"), "{e}");
    let e = load_file(&pki, &with_cluster_tls("server_name = \"localhost\"")).unwrap_err();
    assert!(e.message.contains("ca"), "{e}");
}

#[test]
fn certificate_paths_without_a_file_are_relative_to_the_current_directory() {
    // The test binary runs in the crate directory; a path that exists only next to the PKI
    // files is not found from there.
    let pki = Pki::generate("cwd");
    assert!(!Path::new("server.pem").exists());
    let text = format!(
        "{FILE_HEAD}[listener.tls]\ncert = \"server.pem\"\nkey = \"server.key\"\n{FILE_CLUSTER}"
    );
    let e = ProxyConfig::from_toml_str(&text, "inline").unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.cert"), "{e}");
    drop(pki);
}

/// `GET /` over TLS with `connector` and SNI `name`: the status, or the error that ended the
/// handshake or the exchange (with TLS 1.3 a refused client certificate shows on the first
/// read, after the client's side of the handshake is done).
async fn get_tls(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
    name: &str,
) -> Result<StatusCode, String> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(name.to_string()).unwrap();
    let mut stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let request = b"GET / HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n";
    stream
        .write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    match read {
        Err(_) => Err("no answer within 5 s".into()),
        Ok(Err(e)) if answer.is_empty() => Err(format!("read: {e}")),
        Ok(_) => {
            let text = String::from_utf8_lossy(&answer);
            let code = text
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse::<u16>().ok())
                .ok_or_else(|| format!("no status in {text:?}"))?;
            Ok(StatusCode::from_u16(code).unwrap())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_with_client_ca_serves_only_clients_with_a_certificate_from_it() {
    let pki = Pki::generate("client-ca");
    let (backend_addr, seen) = backend(None).await;
    let tls13 = &[&rustls::version::TLS13][..];
    let tls12 = &[&rustls::version::TLS12][..];
    let with = |auth: &str| {
        let mut t = listener_tls(&pki, "");
        t.push_str(&format!(
            "client_ca = {}
{auth}",
            pki.toml("ca.pem")
        ));
        config(backend_addr, &t, "")
    };
    let proxy = keel_proxy::start(with("")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    for versions in [tls13, tls12] {
        assert_eq!(
            get_tls(&pki.client(Some("client"), versions), addr, "localhost").await,
            Ok(StatusCode::OK)
        );
        let none = get_tls(&pki.client(None, versions), addr, "localhost").await;
        assert!(none.is_err(), "no client certificate: {none:?}");
        let stranger = get_tls(&pki.client(Some("stranger"), versions), addr, "localhost").await;
        assert!(
            stranger.is_err(),
            "a certificate of another CA: {stranger:?}"
        );
    }
    assert_eq!(
        seen.proto.lock().unwrap().len(),
        2,
        "only the two good clients got through"
    );

    // `request`: a client without a certificate is served; a bad certificate still is not.
    proxy.reload(with("client_auth = \"request\"\n")).unwrap();
    assert_eq!(
        get_tls(&pki.client(None, tls13), addr, "localhost").await,
        Ok(StatusCode::OK)
    );
    assert!(
        get_tls(&pki.client(Some("stranger"), tls13), addr, "localhost")
            .await
            .is_err()
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sni_chooses_the_certificate_whose_names_match_and_min_version_refuses_older_clients() {
    let pki = Pki::generate("sni");
    let (backend_addr, _) = backend(None).await;
    let mut t = listener_tls(&pki, "");
    t.push_str(&format!(
        "certificates = [{{ cert = {}, key = {} }}, {{ cert = {}, key = {} }}]\nmin_version = \"1.3\"\n",
        pki.toml("a.pem"),
        pki.toml("a.key"),
        pki.toml("wild-b.pem"),
        pki.toml("wild-b.key")
    ));
    let proxy = keel_proxy::start(config(backend_addr, &t, ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let served = |file: &str| pki.certs(file)[0].clone();
    let connector = pki.client(None, &[&rustls::version::TLS13]);
    for (sni, file) in [
        ("a.test", "a.pem"),
        ("x.b.test", "wild-b.pem"),
        ("localhost", "server.pem"),
        ("unknown.test", "server.pem"),
    ] {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from(sni.to_string()).unwrap();
        // A certificate that is not valid for the name fails the client's verification: the
        // handshake itself says which certificate came.
        let result = connector.connect(name, tcp).await;
        if file == "server.pem" && sni != "localhost" {
            let Err(e) = result else {
                panic!("{sni}: the default certificate is not valid for it, yet it was accepted")
            };
            assert!(e.to_string().contains("certificate"), "{sni}: {e}");
            continue;
        }
        let stream = result.unwrap_or_else(|e| panic!("{sni}: {e}"));
        let peer = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
        assert_eq!(peer, served(file), "{sni}");
    }
    assert_eq!(
        get_tls(&connector, addr, "a.test").await,
        Ok(StatusCode::OK)
    );
    // TLS 1.2 only: refused by min_version = "1.3".
    let old = get_tls(
        &pki.client(None, &[&rustls::version::TLS12]),
        addr,
        "a.test",
    )
    .await;
    assert!(old.is_err(), "{old:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_presents_its_client_certificate_to_endpoints_that_require_one() {
    let pki = Pki::generate("upstream-mtls");
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.certs("ca.pem") {
        roots.add(c).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        keel_proxy::tls::provider(),
    )
    .build()
    .unwrap();
    let mut server = rustls::ServerConfig::builder_with_provider(keel_proxy::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            pki.certs("server.pem"),
            PrivateKeyDer::from_pem_file(pki.path("server.key")).unwrap(),
        )
        .unwrap();
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    let (backend_addr, seen) =
        backend(Some(tokio_rustls::TlsAcceptor::from(Arc::new(server)))).await;
    let cluster = |extra: &str| format!("[cluster.tls]\nca = {}\n{extra}", pki.toml("ca.pem"));
    let proxy = keel_proxy::start(config(backend_addr, "", &cluster("")))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let (status, body) = get_plain(addr).await;
    assert_eq!(
        status,
        StatusCode::BAD_GATEWAY,
        "no client certificate: {body}"
    );
    assert!(seen.proto.lock().unwrap().is_empty());
    proxy
        .reload(config(
            backend_addr,
            "",
            &cluster(&format!(
                "cert = {}\nkey = {}\n",
                pki.toml("client.pem"),
                pki.toml("client.key")
            )),
        ))
        .unwrap();
    assert_eq!(get_plain(addr).await, (StatusCode::OK, "ok".to_string()));
    assert_eq!(seen.proto.lock().unwrap().len(), 1);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[test]
fn tls_options_are_checked_and_their_errors_located() {
    let pki = Pki::generate("tls-options");
    let listener = |extra: &str| {
        format!("{FILE_HEAD}[listener.tls]\ncert = \"server.pem\"\nkey = \"server.key\"\n{extra}\n{FILE_CLUSTER}")
    };
    // IANA's names, OpenSSL's, and rustls's own.
    for names in [
        "\"TLS_AES_128_GCM_SHA256\", \"TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256\"",
        "\"ECDHE-RSA-AES128-GCM-SHA256\", \"ecdhe-ecdsa-chacha20-poly1305\"",
        "\"TLS13_AES_128_GCM_SHA256\"",
    ] {
        load_file(&pki, &listener(&format!("cipher_suites = [{names}]")))
            .unwrap_or_else(|e| panic!("{names}: {e}"));
    }
    let e = load_file(&pki, &listener("cipher_suites = [\"RC4_MD5\"]")).unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("listener[0].tls.cipher_suites"),
        "{e}"
    );
    assert!(
        e.message.contains("TLS_AES_256_GCM_SHA384")
            && e.message.contains("ECDHE-RSA-AES128-GCM-SHA256"),
        "names the known ones: {e}"
    );
    let e = load_file(&pki, &listener("min_version = \"1.1\"")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.min_version"), "{e}");
    let e = load_file(&pki, &listener("client_ca = \"missing.pem\"")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("listener[0].tls.client_ca"), "{e}");
    let e = load_file(
        &pki,
        &listener("certificates = [{ cert = \"a.pem\", key = \"server.key\" }]"),
    )
    .unwrap_err();
    assert_eq!(
        e.key.as_deref(),
        Some("listener[0].tls.certificates"),
        "{e}"
    );
    assert!(e.message.contains("does not match"), "{e}");

    let cluster = |table: &str| format!("{FILE_HEAD}{FILE_CLUSTER}[cluster.tls]\n{table}\n");
    let e = load_file(&pki, &cluster("ca = \"ca.pem\"\ncert = \"client.pem\"")).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].tls.key"), "{e}");
    load_file(
        &pki,
        &cluster("ca = \"ca.pem\"\ncert = \"client.pem\"\nkey = \"client.key\""),
    )
    .unwrap();
    let e = load_file(
        &pki,
        &cluster("ca = \"ca.pem\"\ncert = \"client.pem\"\nkey = \"a.key\""),
    )
    .unwrap_err();
    assert_eq!(e.key.as_deref(), Some("cluster[0].tls.key"), "{e}");
    // The system's store: loads when it holds CAs (Debian's ca-certificates), and says so
    // by name when it holds none.
    match load_file(&pki, &cluster("system_roots = true")) {
        Ok(_) => assert!(std::fs::read_dir("/etc/ssl/certs").is_ok_and(|mut d| d.next().is_some())),
        Err(e) => {
            assert_eq!(e.key.as_deref(), Some("cluster[0].tls.system_roots"), "{e}");
            assert!(e.message.contains("system"), "{e}");
        }
    }
}

/// A backend that answers each request with the values of `x-client-dn`, `x-client-san` and
/// `x-client-fp` it received, one a line (empty when absent).
async fn echo_cert_headers() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
                    let value = |n: &str| {
                        let all: Vec<&str> = req
                            .headers()
                            .get_all(n)
                            .iter()
                            .map(|v| v.to_str().unwrap())
                            .collect();
                        all.join("|")
                    };
                    let body = format!(
                        "{}\n{}\n{}",
                        value("x-client-dn"),
                        value("x-client-san"),
                        value("x-client-fp")
                    );
                    async move {
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                            body,
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    addr
}

/// `GET /` over TLS offering `alpn` (`h2` or `http/1.1`) and presenting `cert` (files
/// `NAME.pem`, `NAME.key`) when given; the answer's body. `spoof`: a header the client sends
/// to pass for someone else.
async fn get_as(
    pki: &Pki,
    addr: SocketAddr,
    cert: Option<&str>,
    alpn: &[u8],
    spoof: Option<&str>,
) -> String {
    let mut roots = rustls::RootCertStore::empty();
    for c in pki.certs("ca.pem") {
        roots.add(c).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match cert {
        Some(name) => builder
            .with_client_auth_cert(
                pki.certs(&format!("{name}.pem")),
                PrivateKeyDer::from_pem_file(pki.path(&format!("{name}.key"))).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(alpn));
    let mut req = Request::get("https://localhost/");
    if alpn == b"http/1.1" {
        req = req.header("host", "localhost");
    }
    if let Some(dn) = spoof {
        req = req.header("x-client-dn", dn);
    }
    let req = req.body(Empty::<Bytes>::new()).unwrap();
    let resp = if alpn == b"h2" {
        let (mut sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    };
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_certificate_reaches_header_variables_and_the_access_log_over_http1_and_http2() {
    let pki = Pki::generate("client-subject");
    // alice's certificate, from a client CA of this test: a subject with a comma to escape,
    // a DNS name and a URI.
    let (client_ca, client_ca_key) = make_ca("client CA");
    std::fs::write(pki.path("client-ca.pem"), client_ca.pem()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["alice.test".to_string()]).unwrap();
    params.subject_alt_names.push(rcgen::SanType::URI(
        "spiffe://example.test/alice".try_into().unwrap(),
    ));
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Example, Inc.");
    params.distinguished_name.push(DnType::CommonName, "alice");
    let alice = params.signed_by(&key, &client_ca, &client_ca_key).unwrap();
    std::fs::write(pki.path("alice.pem"), alice.pem()).unwrap();
    std::fs::write(pki.path("alice.key"), key.serialize_pem()).unwrap();
    let fingerprint: String = ring::digest::digest(&ring::digest::SHA256, alice.der())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();

    let backend = echo_cert_headers().await;
    let log = pki.path("access.log");
    let text = format!(
        "[access_log]\npath = {:?}\nformat = \"json\"\n\n\
         [[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\
         [listener.tls]\ncert = {}\nkey = {}\nclient_ca = {}\nclient_auth = \"request\"\n\n\
         [[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{backend}\" }}]\n\
         request_headers = {{ set = {{ x-client-dn = \"$client_cert_subject\", \
         x-client-san = \"$client_cert_san\", x-client-fp = \"$client_cert_fingerprint\" }} }}\n",
        log.display().to_string(),
        pki.toml("server.pem"),
        pki.toml("server.key"),
        pki.toml("client-ca.pem"),
    );
    let config = ProxyConfig::from_toml_str(&text, "client-subject.toml")
        .unwrap_or_else(|e| panic!("{e}\n{text}"));
    let proxy = keel_proxy::start(config).await.unwrap();
    let addr = proxy.listener_addrs()[0];

    let expected = format!(
        "CN=alice,O=Example\\, Inc.\nalice.test,spiffe://example.test/alice\n{fingerprint}"
    );
    for alpn in [&b"http/1.1"[..], b"h2"] {
        let seen = get_as(&pki, addr, Some("alice"), alpn, None).await;
        assert_eq!(seen, expected, "{}", String::from_utf8_lossy(alpn));
        // Without a certificate the variables are empty, and `set` replaces what the client
        // sent in their name.
        let seen = get_as(&pki, addr, None, alpn, Some("CN=admin")).await;
        assert_eq!(seen, "\n\n", "{}", String::from_utf8_lossy(alpn));
    }

    // The access log names the subject on the requests that had one, and only on those.
    let deadline = Instant::now() + Duration::from_secs(3);
    let lines = loop {
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        if lines.len() == 4 || Instant::now() > deadline {
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(lines.len(), 4, "{lines:?}");
    let subjects: Vec<(&str, Option<&str>)> = lines
        .iter()
        .map(|l| {
            (
                l["protocol"].as_str().unwrap(),
                l.get("client_cert_subject").map(|s| s.as_str().unwrap()),
            )
        })
        .collect();
    for protocol in ["HTTP/1.1", "HTTP/2.0"] {
        let of: Vec<Option<&str>> = subjects
            .iter()
            .filter(|(p, _)| *p == protocol)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(of.len(), 2, "{subjects:?}");
        assert!(
            of.contains(&Some("CN=alice,O=Example\\, Inc.")),
            "{subjects:?}"
        );
        assert!(of.contains(&None), "{subjects:?}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}
