//! keel never drops a request of its own doing: a drain with 2 and 4 workers answers every
//! request in flight (HTTP/1.1 and HTTP/2) and closes idle connections at once; tunnels
//! (WebSocket, TCP) get the drain time and are cut only then, counted by kind; a reload adds and
//! removes listeners, rotates a certificate and moves the access log and the admin listener
//! while a client loops, without one failure.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use rcgen::{CertificateParams, KeyPair, SerialNumber};
use rustls::pki_types::{CertificateDer, ServerName};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http_body_util::{BodyExt, Empty};
use hyper::StatusCode;
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;

use crate::protocols::{tcp_echo, websocket_echo};
use crate::support::*;

/// One HTTP/1.1 request on its own connection, read to the end (`Connection: close` asked).
async fn raw_get(addr: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Waits until the backends saw `n` requests in all (so they are in flight in the proxy).
async fn until_requests(bs: &[keel_testbed::backend::BackendHandle], n: u64) {
    let t = Instant::now();
    while bs.iter().map(|b| b.requests()).sum::<u64>() < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "requests never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn drain_answers_every_request_in_flight(workers: usize) {
    let bs = backends(2, Duration::from_millis(700)).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let proxy = keel_proxy::start_with_workers(
        simple_config(&addrs, "round-robin", "request_timeout = \"10s\""),
        workers,
    )
    .await
    .unwrap();
    let addr = proxy.listener_addrs()[0];
    // Idle keep-alive connections, one per worker at least: closed at once by the drain.
    let mut idle = Vec::new();
    for _ in 0..workers * 2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        idle.push(s);
    }
    until_requests(&bs, (workers * 2) as u64).await;
    for s in &mut idle {
        // Read the answer: the connection is now idle and kept alive.
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    let before = bs.iter().map(|b| b.requests()).sum::<u64>();
    // HTTP/1.1 requests in flight on every worker, and HTTP/2 streams on two connections.
    let mut h1 = Vec::new();
    for _ in 0..workers * 3 {
        h1.push(tokio::spawn(raw_get(addr)));
    }
    let mut h2 = Vec::new();
    for _ in 0..2 {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        for _ in 0..3 {
            let req = hyper::Request::get(format!("http://{addr}/h2"))
                .body(Empty::<Bytes>::new())
                .unwrap();
            let fut = send.send_request(req);
            h2.push(tokio::spawn(async move {
                let resp = fut.await.map_err(|e| e.to_string())?;
                let status = resp.status();
                resp.into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(status)
            }));
        }
    }
    until_requests(&bs, before + (workers * 3 + 6) as u64).await;
    let t = Instant::now();
    let stop = tokio::spawn(proxy.shutdown(Duration::from_secs(5)));
    // The idle connections are closed at once, not after the drain.
    for mut s in idle {
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf))
            .await
            .expect("an idle keep-alive connection is closed at once")
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without another byte");
    }
    for h in h1 {
        let text = h
            .await
            .unwrap()
            .expect("an HTTP/1.1 request in flight is answered");
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }
    for h in h2 {
        assert_eq!(
            h.await
                .unwrap()
                .expect("an HTTP/2 stream in flight is answered"),
            StatusCode::OK
        );
    }
    stop.await.unwrap();
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "done as soon as the requests were: {took:?}"
    );
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_2_workers_answers_every_request_in_flight() {
    drain_answers_every_request_in_flight(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_4_workers_answers_every_request_in_flight() {
    drain_answers_every_request_in_flight(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_get_the_whole_drain_time_then_are_cut_and_counted() {
    let (ws, _) = websocket_echo().await;
    let echo = tcp_echo().await;
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"ws\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\nprotocol = \"tcp\"\ncluster = \"tcp\"\n\n[[cluster]]\nname = \"ws\"\nendpoints = [{{ address = \"{ws}\" }}]\n\n[[cluster]]\nname = \"tcp\"\nendpoints = [{{ address = \"{echo}\" }}]\n"
    );
    let config = ProxyConfig::from_toml_str(&text, "t.toml").unwrap();
    let proxy = keel_proxy::start_with_workers(config, 2).await.unwrap();
    let [http, tcp] = proxy.listener_addrs()[..] else {
        panic!()
    };
    let stream = TcpStream::connect(http).await.unwrap();
    let (mut client, _) = tokio_tungstenite::client_async(format!("ws://{http}/chat"), stream)
        .await
        .unwrap();
    let mut raw = TcpStream::connect(tcp).await.unwrap();
    raw.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    raw.read_exact(&mut buf).await.unwrap();

    let drain = Duration::from_millis(1500);
    let t = Instant::now();
    let stop = tokio::spawn(proxy.shutdown(drain));
    // Both tunnels still work well into the drain.
    tokio::time::sleep(Duration::from_millis(800)).await;
    client.send(Message::text("still here")).await.unwrap();
    assert_eq!(
        client
            .next()
            .await
            .unwrap()
            .unwrap()
            .into_text()
            .unwrap()
            .as_str(),
        "still here"
    );
    raw.write_all(b"pong").await.unwrap();
    raw.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"pong");
    // Then they are cut, at the drain timeout and not before.
    let end = tokio::time::timeout(Duration::from_secs(5), raw.read(&mut buf))
        .await
        .unwrap();
    let cut_at = t.elapsed();
    assert!(matches!(end, Ok(0) | Err(_)), "{end:?}");
    assert!(
        cut_at >= drain - Duration::from_millis(50),
        "cut after {cut_at:?}"
    );
    let drained = stop.await.unwrap();
    assert_eq!(drained.tunnels, 2, "{drained:?}");
    assert_eq!(drained.total(), 2, "{drained:?}");
}

/// A port that was free a moment ago.
fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Sequential keep-alive GETs to `url` until `stop`; (answered 200, failed).
fn loop_client(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(u64, u64)> {
    tokio::spawn(async move {
        let c = client();
        let (ok, failed) = (AtomicU64::new(0), AtomicU64::new(0));
        while !stop.load(Relaxed) {
            match send(&c, hyper::Method::GET, &url, &[], b"").await {
                Ok(r) if r.status == StatusCode::OK => ok.fetch_add(1, Relaxed),
                Ok(r) => {
                    eprintln!("{} {}", r.status, r.text());
                    failed.fetch_add(1, Relaxed)
                }
                Err(e) => {
                    eprintln!("{e}");
                    failed.fetch_add(1, Relaxed)
                }
            };
        }
        (ok.into_inner(), failed.into_inner())
    })
}

fn two_listeners(a: SocketAddr, b: Option<SocketAddr>, backends: &[SocketAddr]) -> ProxyConfig {
    let eps: Vec<String> = backends
        .iter()
        .map(|a| format!("{{ address = \"{a}\" }}"))
        .collect();
    let mut text = format!("[[listener]]\nlisten = \"{a}\"\ncluster = \"app\"\n\n");
    if let Some(b) = b {
        text += &format!("[[listener]]\nlisten = \"{b}\"\ncluster = \"app\"\n\n");
    }
    text += &format!(
        "[[cluster]]\nname = \"app\"\nendpoints = [{}]\n",
        eps.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "t.toml").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_adds_and_removes_listeners_while_a_client_loops() {
    // Slow enough that a request is still in flight when its listener is removed.
    let bs = backends(2, Duration::from_millis(200)).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    let (a, b) = (free_port(), free_port());
    let proxy = keel_proxy::start_with_workers(two_listeners(a, None, &addrs), 2)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let looping = loop_client(format!("http://{a}/"), stop.clone());
    for round in 0..5 {
        // Added: bound before the swap, serving at once.
        proxy.reload(two_listeners(a, Some(b), &addrs)).unwrap();
        assert_eq!(proxy.listener_addrs(), vec![a, b], "round {round}");
        let text = raw_get(b).await.unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        // A request in flight on it when it is removed still gets its answer.
        let slow = {
            let mut s = TcpStream::connect(b).await.unwrap();
            s.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            s
        };
        proxy.reload(two_listeners(a, None, &addrs)).unwrap();
        assert_eq!(proxy.listener_addrs(), vec![a]);
        let mut slow = slow;
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.to_ascii_lowercase().contains("connection: close"),
            "{text}"
        );
        assert!(
            eventually(Duration::from_secs(2), || std::net::TcpStream::connect(b)
                .is_err())
            .await,
            "a removed listener stops accepting"
        );
    }
    // A bind failure refuses the whole reload: the old listeners keep serving.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let err = proxy
        .reload(two_listeners(a, Some(taken.local_addr().unwrap()), &addrs))
        .unwrap_err();
    assert!(format!("{err:#}").contains("cannot listen on"), "{err:#}");
    assert_eq!(proxy.listener_addrs(), vec![a]);
    stop.store(true, Relaxed);
    let (ok, failed) = looping.await.unwrap();
    assert_eq!(failed, 0, "{ok} answered");
    assert!(ok > 5, "{ok} answered");
    assert_eq!(proxy.drain_cut().total(), 0);
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// A certificate for `localhost` and 127.0.0.1 with this serial, signed by `ca`; (PEM, key PEM,
/// DER).
fn server_cert(
    ca: &rcgen::Certificate,
    ca_key: &KeyPair,
    serial: u64,
) -> (String, String, Vec<u8>) {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.serial_number = Some(SerialNumber::from(serial));
    let cert = params.signed_by(&key, ca, ca_key).unwrap();
    (cert.pem(), key.serialize_pem(), cert.der().to_vec())
}

/// The certificate the server at `addr` presents, and the open TLS connection.
async fn handshake(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
) -> (Vec<u8>, tokio_rustls::client::TlsStream<TcpStream>) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let der = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    (der, tls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_rotates_a_certificate_without_a_failed_request() {
    let bs = backends(1, Duration::ZERO).await;
    let dir = std::env::temp_dir().join(format!("keel-rotate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, ca_key) = crate::tls::make_ca("rotation CA");
    let write = |(pem, key, der): (String, String, Vec<u8>)| {
        std::fs::write(dir.join("server.pem"), pem).unwrap();
        std::fs::write(dir.join("server.key"), key).unwrap();
        der
    };
    let first = write(server_cert(&ca, &ca_key, 1001));
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[listener.tls]\ncert = {:?}\nkey = {:?}\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        dir.join("server.pem").display().to_string(),
        dir.join("server.key").display().to_string(),
        bs[0].addr()
    );
    let proxy =
        keel_proxy::start_with_workers(ProxyConfig::from_toml_str(&text, "t.toml").unwrap(), 2)
            .await
            .unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(ca.der().to_vec())).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let (seen, mut established) = handshake(&connector, addr).await;
    assert_eq!(seen, first);

    // New files at the same paths, and a reload of the same configuration.
    let second = write(server_cert(&ca, &ca_key, 2002));
    proxy
        .reload(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .unwrap();
    for _ in 0..4 {
        let (seen, mut tls) = handshake(&connector, addr).await;
        assert_eq!(seen, second, "a new handshake sees the new certificate");
        tls.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        tls.read_to_end(&mut out).await.unwrap();
        assert!(
            out.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }
    // The connection made before keeps its certificate and keeps working.
    established
        .write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    established.read_to_end(&mut out).await.unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );

    // A key that does not match is refused when the file is read (as SIGHUP reads it), and
    // the second certificate keeps serving.
    let (pem, _, _) = server_cert(&ca, &ca_key, 3003);
    std::fs::write(dir.join("server.pem"), pem).unwrap();
    let err = ProxyConfig::from_toml_str(&text, "t.toml").unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
    assert_eq!(handshake(&connector, addr).await.0, second);
    proxy.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_moves_the_access_log_and_the_admin_listener() {
    let bs = backends(1, Duration::ZERO).await;
    let dir = std::env::temp_dir().join(format!("keel-reload-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (admin_a, admin_b) = (free_port(), free_port());
    let text = |admin: SocketAddr, log: &str| {
        ProxyConfig::from_toml_str(
            &format!(
                "[admin]\nlisten = \"{admin}\"\n[access_log]\npath = {:?}\nformat = \"json\"\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
                dir.join(log).display().to_string(),
                bs[0].addr()
            ),
            "t.toml",
        )
        .unwrap()
    };
    let proxy = keel_proxy::start(text(admin_a, "one.log")).await.unwrap();
    let url = format!("http://{}/", proxy.listener_addrs()[0]);
    for _ in 0..3 {
        assert_eq!(get(&url).await.unwrap().status, StatusCode::OK);
    }
    proxy.reload(text(admin_b, "two.log")).unwrap();
    assert_eq!(proxy.admin_addr(), Some(admin_b));
    for _ in 0..5 {
        assert_eq!(get(&url).await.unwrap().status, StatusCode::OK);
    }
    assert_eq!(
        get(&format!("http://{admin_b}/status"))
            .await
            .unwrap()
            .status,
        StatusCode::OK
    );
    assert!(
        eventually(Duration::from_secs(2), || std::net::TcpStream::connect(
            admin_a
        )
        .is_err())
        .await,
        "the old admin address is closed"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
    let lines = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .unwrap_or_default()
            .lines()
            .count()
    };
    assert!(
        eventually(Duration::from_secs(4), || lines("one.log") == 3).await,
        "one.log has {} lines",
        lines("one.log")
    );
    // The admin /status request is not logged; the five requests after the reload are.
    assert_eq!(lines("two.log"), 5);
    let _ = std::fs::remove_dir_all(dir);
}

/// Requests on one keep-alive connection with no pause between them, until keel closes it:
/// (answered, lost). A request is lost when it was written and the connection ended without its
/// whole answer; the connection ends cleanly after an answer that says `Connection: close`.
async fn tight_keep_alive_loop(addr: SocketAddr) -> (u64, u64) {
    let Ok(mut s) = TcpStream::connect(addr).await else {
        return (0, 0);
    };
    let (mut answered, mut buf) = (0u64, Vec::with_capacity(4096));
    loop {
        if s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .is_err()
        {
            return (answered, 0);
        }
        buf.clear();
        // Read one answer: its head, then content-length bytes.
        let (head_end, length) = loop {
            let mut chunk = [0u8; 4096];
            let n = s.read(&mut chunk).await.unwrap_or(0);
            if n == 0 {
                // Written, and the connection ended before its answer: lost (a client without
                // pause never leaves keel a quiet moment to close in).
                return (answered, 1);
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                break (end + 4, length);
            }
        };
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match s.read(&mut chunk).await {
                Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return (answered, 1),
            }
        }
        answered += 1;
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        assert!(head.starts_with("http/1.1 200"), "{head}");
        if head.contains("connection: close") {
            return (answered, 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_clients_without_pause_lose_nothing_at_the_drain() {
    let bs = backends(2, Duration::ZERO).await;
    let addrs: Vec<_> = bs.iter().map(|b| b.addr()).collect();
    for round in 0..3 {
        let proxy = keel_proxy::start_with_workers(simple_config(&addrs, "round-robin", ""), 2)
            .await
            .unwrap();
        let addr = proxy.listener_addrs()[0];
        let clients: Vec<_> = (0..16)
            .map(|_| tokio::spawn(tight_keep_alive_loop(addr)))
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let drained = proxy.shutdown(Duration::from_secs(5)).await;
        let (mut answered, mut lost) = (0, 0);
        for c in clients {
            let (a, l) = c.await.unwrap();
            answered += a;
            lost += l;
        }
        assert_eq!(
            lost, 0,
            "round {round}: {answered} answered, {lost} lost, {drained:?}"
        );
        assert!(answered > 100, "round {round}: {answered} answered");
        assert_eq!(drained.total(), 0, "{drained:?}");
    }
}
