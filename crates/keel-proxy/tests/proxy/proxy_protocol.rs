//! PROXY protocol on listeners (`proxy_protocol = true`) and `trusted_hops`, on loopback: the
//! header's source is the client for `X-Forwarded-For`, allow/deny and the access log, on
//! HTTP/1.1, HTTP/2 (prior knowledge), TLS and TCP listeners; a header from a peer outside
//! `trusted_proxies`, a malformed one and a slow one are refused, counted by reason. The test
//! behind a real HAProxy (`send-proxy-v2`) is ignored by default: `scripts/test-haproxy.sh`
//! installs HAProxy and runs it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::body::Bytes;
use keel_proxy::{ProxyConfig, ProxyHandle, ProxyRefusals};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::support::*;

/// A version 2 PROXY header (PROXY command, TCP over IPv4) naming `source` as the client.
fn v2(source: SocketAddr, destination: SocketAddr) -> Vec<u8> {
    let (SocketAddr::V4(s), SocketAddr::V4(d)) = (source, destination) else {
        panic!("IPv4 only here");
    };
    let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
    h.extend_from_slice(&[0x21, 0x11, 0, 12]);
    h.extend_from_slice(&s.ip().octets());
    h.extend_from_slice(&d.ip().octets());
    h.extend_from_slice(&s.port().to_be_bytes());
    h.extend_from_slice(&d.port().to_be_bytes());
    h
}

/// Version 2's LOCAL command (a proxy's own health check): no client named.
const V2_LOCAL: &[u8] = b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00";

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

/// A scratch directory for one test's access log.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("keel-pp-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A proxy whose one listener has `listener_extra`, over the echo server, writing its access
/// log to `log`.
async fn proxy(listener_extra: &str, log: &std::path::Path) -> (ProxyHandle, SocketAddr) {
    let (echo, _task) = echo_server().await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[access_log]\npath = {:?}\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{echo}\" }}]\n",
        log.display().to_string()
    );
    let config = ProxyConfig::from_toml_str(&text, "t.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
    let p = keel_proxy::start(config).await.unwrap();
    let a = p.listener_addrs()[0];
    (p, a)
}

/// Sends `header`, then an HTTP/1.1 request on `stream`; what comes back until close.
async fn h1_over<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, extra: &str) -> String {
    let request = format!("GET /who HTTP/1.1\r\nhost: app\r\nconnection: close\r\n{extra}\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut got)).await;
    String::from_utf8_lossy(&got).into_owned()
}

/// A connection to `to` from the loopback address `from`, that has sent `header`.
async fn connect_from(from: &str, to: SocketAddr, header: &[u8]) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(addr(&format!("{from}:0"))).unwrap();
    let mut s = socket.connect(to).await.unwrap();
    s.write_all(header).await.unwrap();
    s
}

/// True if the proxy closes `s` (a read sees the end or a reset) within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(limit, s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

async fn access_log_clients(log: &std::path::Path, n: usize) -> Vec<String> {
    let got = eventually(Duration::from_secs(3), || {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .count()
            >= n
    })
    .await;
    assert!(got, "{n} access-log lines");
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["client"].as_str().unwrap().to_string()
        })
        .collect()
}

/// HTTP/1.1 and HTTP/2 (prior knowledge) after a version 1 or 2 header from a trusted proxy:
/// the endpoint's `X-Forwarded-For`, the listener's `deny` and the access log take the
/// header's source; a LOCAL header leaves the socket's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_headers_source_is_the_client_for_forwarding_deny_and_the_log() {
    let d = dir("http");
    let log = d.join("access.log");
    let (p, a) = proxy(
        "proxy_protocol = true\ntrusted_proxies = [\"127.0.0.1/32\"]\ndeny = [\"203.0.113.0/24\"]",
        &log,
    )
    .await;
    let v1 = b"PROXY TCP4 198.51.100.7 127.0.0.1 50000 80\r\n";
    let text = h1_over(connect_from("127.0.0.1", a, v1).await, "").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("x-forwarded-for: 198.51.100.7\n"), "{text}");

    let header = v2(addr("198.51.100.8:50001"), a);
    let text = h1_over(connect_from("127.0.0.1", a, &header).await, "").await;
    assert!(text.contains("x-forwarded-for: 198.51.100.8\n"), "{text}");

    // The client's own X-Forwarded-For is its word, not believed: it is replaced.
    let header = v2(addr("198.51.100.9:50002"), a);
    let text = h1_over(
        connect_from("127.0.0.1", a, &header).await,
        "x-forwarded-for: 10.1.1.1\r\n",
    )
    .await;
    assert!(text.contains("x-forwarded-for: 198.51.100.9\n"), "{text}");

    let denied = v2(addr("203.0.113.5:50003"), a);
    let text = h1_over(connect_from("127.0.0.1", a, &denied).await, "").await;
    assert!(text.starts_with("HTTP/1.1 403"), "{text}");

    let text = h1_over(connect_from("127.0.0.1", a, V2_LOCAL).await, "").await;
    assert!(
        text.contains("x-forwarded-for: 127.0.0.1\n"),
        "LOCAL: {text}"
    );

    // HTTP/2 with prior knowledge, its preface after the header.
    let stream = connect_from("127.0.0.1", a, &v2(addr("198.51.100.10:50004"), a)).await;
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{a}/who"))
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("x-forwarded-for: 198.51.100.10\n"), "{body}");
    drop(sender);

    assert_eq!(
        access_log_clients(&log, 6).await,
        [
            "198.51.100.7",
            "198.51.100.8",
            "198.51.100.9",
            "203.0.113.5",
            "127.0.0.1",
            "198.51.100.10"
        ]
    );
    assert_eq!(p.proxy_header_refusals(0), ProxyRefusals::default());
    p.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);
}

/// A TLS listener reads the header before the handshake; a TCP listener hands the header's
/// source on to its endpoint in the PROXY header it sends (`proxy_protocol = "v1"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_tcp_listeners_take_the_header_first() {
    let d = dir("tls");
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(d.join("c.pem"), cert.cert.pem()).unwrap();
    std::fs::write(d.join("k.pem"), cert.key_pair.serialize_pem()).unwrap();
    let (p, a) = proxy(
        &format!(
            "proxy_protocol = true\ntrusted_proxies = [\"127.0.0.0/8\"]\n[listener.tls]\ncert = {:?}\nkey = {:?}\n",
            d.join("c.pem").display().to_string(),
            d.join("k.pem").display().to_string()
        ),
        &d.join("access.log"),
    )
    .await;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.cert.der().clone()).unwrap();
    let mut tls = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let stream = connect_from("127.0.0.1", a, &v2(addr("198.51.100.20:50000"), a)).await;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
        .connect("localhost".try_into().unwrap(), stream)
        .await
        .unwrap();
    let text = h1_over(stream, "").await;
    assert!(text.contains("x-forwarded-for: 198.51.100.20\n"), "{text}");
    assert!(text.contains("x-forwarded-proto: https\n"), "{text}");
    p.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);

    // The endpoint answers with the first line it got: the PROXY header keel sent.
    let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = backend.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = backend.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut b = [0u8; 1];
                while !got.ends_with(b"\n") && s.read(&mut b).await.unwrap_or(0) == 1 {
                    got.push(b[0]);
                }
                let _ = s.write_all(&got).await;
            });
        }
    });
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\nprotocol = \"tcp\"\ncluster = \"db\"\nproxy_protocol = true\ntrusted_proxies = [\"127.0.0.1/32\"]\n\n[[cluster]]\nname = \"db\"\nendpoints = [{{ address = \"{endpoint}\" }}]\nproxy_protocol = \"v1\"\n"
    );
    let p = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let a = p.listener_addrs()[0];
    let mut s = connect_from(
        "127.0.0.1",
        a,
        &v2(addr("198.51.100.21:50001"), addr("192.0.2.1:5432")),
    )
    .await;
    let mut line = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut line)).await;
    assert_eq!(
        String::from_utf8_lossy(&line),
        "PROXY TCP4 198.51.100.21 192.0.2.1 50001 5432\r\n"
    );
    p.shutdown(Duration::from_secs(1)).await;
}

/// Closed and counted by reason: a peer outside `trusted_proxies` (header or not), bytes that
/// are no PROXY header, a header cut short, one sent a byte at a time past
/// `header_read_timeout`; each reason in `/metrics`. No request reaches the endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_malformed_and_slow_headers_are_refused() {
    let d = dir("refused");
    let log = d.join("access.log");
    let (p, a) = proxy(
        "proxy_protocol = true\ntrusted_proxies = [\"127.0.0.2/32\"]\nheader_read_timeout = \"300ms\"",
        &log,
    )
    .await;
    let header = v2(addr("198.51.100.7:50000"), a);
    let mut s = connect_from("127.0.0.1", a, &header).await;
    assert!(
        closed_within(&mut s, Duration::from_secs(2)).await,
        "untrusted"
    );
    let mut s = connect_from("127.0.0.3", a, b"GET / HTTP/1.1\r\n\r\n").await;
    assert!(
        closed_within(&mut s, Duration::from_secs(2)).await,
        "untrusted, no header"
    );

    let mut s = connect_from("127.0.0.2", a, b"GET / HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert!(
        closed_within(&mut s, Duration::from_secs(2)).await,
        "not a header"
    );
    let mut s = connect_from("127.0.0.2", a, b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2 3\r\nGET /").await;
    assert!(
        closed_within(&mut s, Duration::from_secs(2)).await,
        "malformed v1"
    );
    let mut bad_family = header.clone();
    bad_family[13] = 0x51;
    let mut s = connect_from("127.0.0.2", a, &bad_family).await;
    assert!(
        closed_within(&mut s, Duration::from_secs(2)).await,
        "malformed v2"
    );

    // Half a header, then silence: cut at the header-read timeout, not before.
    let started = Instant::now();
    let mut s = connect_from("127.0.0.2", a, b"PROXY TCP4 198.51").await;
    assert!(
        closed_within(&mut s, Duration::from_secs(3)).await,
        "stalled"
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(280) && took < Duration::from_secs(2),
        "{took:?}"
    );
    // A byte every 100 ms: still cut at 300 ms from the start.
    let started = Instant::now();
    let mut s = connect_from("127.0.0.2", a, b"P").await;
    let mut cut = false;
    for b in b"ROXY TCP4 198.51.100.7 127.0.0.1 50000 80\r\n" {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if s.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
    }
    assert!(cut || closed_within(&mut s, Duration::from_secs(1)).await);
    assert!(started.elapsed() < Duration::from_secs(2));

    let counted = eventually(Duration::from_secs(2), || {
        p.proxy_header_refusals(0)
            == ProxyRefusals {
                untrusted: 2,
                malformed: 3,
                timeout: 2,
            }
    })
    .await;
    assert!(counted, "{:?}", p.proxy_header_refusals(0));
    let admin = p.admin_addr().unwrap();
    let line = |reason: &str| {
        format!("keel_proxy_protocol_refused_total{{listener=\"{a}\",reason=\"{reason}\"}}")
    };
    assert_eq!(metric(admin, &line("untrusted")).await, Some(2.0));
    assert_eq!(metric(admin, &line("malformed")).await, Some(3.0));
    assert_eq!(metric(admin, &line("timeout")).await, Some(2.0));
    assert!(std::fs::read_to_string(&log).unwrap_or_default().is_empty());
    p.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);
}

/// `trusted_hops = 2`: two proxies in front of keel, the nearest its peer; of a three-entry
/// `X-Forwarded-For` (a made-up entry, the client, the far proxy) the second from the right
/// is the client, for `deny`. With the default (1) it is the far proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_hops_choose_the_client_among_forwarded_entries() {
    let d = dir("hops");
    let xff = "x-forwarded-for: 6.6.6.6, 203.0.113.9, 10.0.0.2\r\n";
    let (p, a) = proxy(
        "trusted_proxies = [\"127.0.0.1/32\"]\ntrusted_hops = 2\ndeny = [\"203.0.113.0/24\"]",
        &d.join("a.log"),
    )
    .await;
    let text = h1_over(TcpStream::connect(a).await.unwrap(), xff).await;
    assert!(text.starts_with("HTTP/1.1 403"), "{text}");
    let fine = "x-forwarded-for: 203.0.113.9, 198.51.100.3, 10.0.0.2\r\n";
    let text = h1_over(TcpStream::connect(a).await.unwrap(), fine).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("x-forwarded-for: 203.0.113.9, 198.51.100.3, 10.0.0.2, 127.0.0.1\n"),
        "the chain goes on as it came, keel's peer added: {text}"
    );
    p.shutdown(Duration::from_secs(1)).await;

    let (p, a) = proxy(
        "trusted_proxies = [\"127.0.0.1/32\"]\ndeny = [\"203.0.113.0/24\"]",
        &d.join("b.log"),
    )
    .await;
    let text = h1_over(TcpStream::connect(a).await.unwrap(), xff).await;
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "one hop: 10.0.0.2 is the client: {text}"
    );
    p.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);
}

/// Mistakes in the new keys are refused at their line and column, as `keel proxy --check`
/// reports them.
#[test]
fn bad_proxy_protocol_and_hops_are_located() {
    let base = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n";
    let tail = "\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:1\" }]\n";
    for (extra, line, key) in [
        ("proxy_protocol = true\n", 4, "proxy_protocol"),
        ("proxy_protocol = \"v2\"\n", 4, "proxy_protocol"),
        (
            "trusted_proxies = [\"10.0.0.0/8\"]\ntrusted_hops = 0\n",
            5,
            "trusted_hops",
        ),
        ("trusted_hops = 17\n", 4, "trusted_hops"),
    ] {
        let e = ProxyConfig::from_toml_str(&format!("{base}{extra}{tail}"), "t.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&format!("t.toml:{line}:")), "{extra}: {e}");
        assert!(e.contains(&format!("`listener[0].{key}`")), "{extra}: {e}");
    }
}

/// Behind HAProxy with `send-proxy-v2` (TCP mode), clients on two loopback addresses: keel's
/// endpoint, its `deny` and its access log see each client's own address, not HAProxy's.
/// Needs `haproxy` (PATH, /usr/sbin or `KEEL_HAPROXY`): `scripts/test-haproxy.sh`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs haproxy: scripts/test-haproxy.sh"]
async fn behind_haproxy_send_proxy_v2_keel_sees_the_real_client() {
    let haproxy = std::env::var("KEEL_HAPROXY").unwrap_or_else(|_| {
        ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy", "haproxy"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("haproxy")
            .to_string()
    });
    let d = dir("haproxy");
    let log = d.join("access.log");
    let (p, a) = proxy(
        "proxy_protocol = true\ntrusted_proxies = [\"127.0.0.1/32\"]\ndeny = [\"127.0.0.6/32\"]",
        &log,
    )
    .await;
    let front = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let cfg = format!(
        "global\n    maxconn 100\ndefaults\n    mode tcp\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\
         frontend f\n    bind {front}\n    default_backend k\n\
         backend k\n    server keel {a} send-proxy-v2\n"
    );
    std::fs::write(d.join("haproxy.cfg"), cfg).unwrap();
    let mut child = std::process::Command::new(&haproxy)
        .args(["-db", "-f"])
        .arg(d.join("haproxy.cfg"))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {haproxy}: {e}"));
    let up = {
        let start = Instant::now();
        loop {
            if TcpStream::connect(front).await.is_ok() {
                break true;
            }
            if start.elapsed() > Duration::from_secs(5) {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let log_file = log.clone();
    let result = async move {
        let log = log_file;
        assert!(up, "haproxy listening on {front}");
        let text = h1_over(connect_from("127.0.0.5", front, b"").await, "").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(text.contains("x-forwarded-for: 127.0.0.5\n"), "{text}");
        let text = h1_over(connect_from("127.0.0.6", front, b"").await, "").await;
        assert!(
            text.starts_with("HTTP/1.1 403"),
            "denied by its own address: {text}"
        );
        let clients = access_log_clients(&log, 2).await;
        assert_eq!(clients, ["127.0.0.5", "127.0.0.6"]);
    };
    let outcome = tokio::spawn(result).await;
    let _ = child.kill();
    let _ = child.wait();
    p.shutdown(Duration::from_secs(1)).await;
    let _ = std::fs::remove_dir_all(&d);
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}
