//! The edge cases an attacker or a careless client tries, on real sockets:
//! h2c upgrades, a `101` to another protocol, `Connection` naming `Host`, forwarded headers
//! from untrusted clients, request ids, `x-keel-endpoint` off by default, a chunk size that
//! overflows, a malformed chunked body that must never reach the endpoint, and the admin's
//! cross-site and `Host` checks.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// Request heads an upstream received (lower-cased text), and its connections.
#[derive(Clone, Default)]
struct Seen {
    heads: Arc<Mutex<Vec<String>>>,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl Seen {
    fn last_head(&self) -> String {
        self.heads
            .lock()
            .unwrap()
            .last()
            .cloned()
            .unwrap_or_default()
    }
    fn count(&self) -> usize {
        self.heads.lock().unwrap().len()
    }
}

/// An upstream that records each request's head (and its `content-length` body) and answers
/// `answer` (after the head; `None`: `200 ok`), keeping the connection unless it answered
/// something else.
async fn upstream(answer: Option<&'static [u8]>) -> (SocketAddr, Seen) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let record = record.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut buf).await {
                            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    let chunked = head.contains("transfer-encoding: chunked");
                    // A chunked body is read to its last chunk (this test's bodies end there).
                    while got.len() < end + 4 + len || (chunked && !got.ends_with(b"0\r\n\r\n")) {
                        match s.read(&mut buf).await {
                            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    }
                    if chunked {
                        record.heads.lock().unwrap().push(head);
                        let close =
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
                        let _ = s.write_all(close).await;
                        return;
                    }
                    record.heads.lock().unwrap().push(head);
                    record
                        .bodies
                        .lock()
                        .unwrap()
                        .push(got[end + 4..end + 4 + len].to_vec());
                    got.drain(..end + 4 + len);
                    let reply = answer.unwrap_or(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
                    if s.write_all(reply).await.is_err() || answer.is_some() {
                        let _ = s.shutdown().await;
                        // Hold a tunnel open a moment (a 101 is followed by its protocol).
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        return;
                    }
                }
            });
        }
    });
    (addr, seen)
}

fn config(endpoint: SocketAddr, listener_extra: &str, cluster_extra: &str) -> ProxyConfig {
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n{cluster_extra}\n[cluster.retry]\nattempts = 0\n"
    );
    ProxyConfig::from_toml_str(&text, "edges.toml").unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// Writes `bytes` on a new connection and reads until the proxy closes or 3 s pass.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match s.read(&mut buf).await {
                Ok(n) if n > 0 => out.extend_from_slice(&buf[..n]),
                _ => return,
            }
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_cannot_remove_host_or_the_forwarded_headers() {
    let (up, seen) = upstream(None).await;
    let proxy = keel_proxy::start(config(up, "trusted_proxies = [\"127.0.0.1/32\"]", ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let answer = raw(
        addr,
        b"GET /x HTTP/1.1\r\nHost: app.test\r\nConnection: host, x-forwarded-for, x-request-id, x-secret, close\r\nX-Forwarded-For: 10.1.1.1\r\nX-Secret: s\r\nX-Request-Id: abc-1\r\n\r\n",
    )
    .await;
    assert_eq!(status(&answer), 200, "{answer}");
    let head = seen.last_head();
    assert!(head.contains("\r\nhost: app.test\r\n"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-for: 10.1.1.1, 127.0.0.1\r\n"),
        "{head}"
    );
    assert!(head.contains("\r\nx-request-id: abc-1\r\n"), "{head}");
    // A header that is not keel's own is still removed when Connection names it.
    assert!(!head.contains("x-secret"), "{head}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_upgrade_is_not_passed_on_and_a_101_to_another_protocol_is_a_502() {
    // h2c: the request goes on as plain HTTP/1.1, without Upgrade or HTTP2-Settings.
    let (up, seen) = upstream(None).await;
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let answer = raw(
        addr,
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    )
    .await;
    assert_eq!(status(&answer), 200, "{answer}");
    let head = seen.last_head();
    assert!(!head.contains("upgrade"), "{head}");
    assert!(!head.contains("http2-settings"), "{head}");
    proxy.shutdown(Duration::from_secs(1)).await;

    // An endpoint that switches to h2c anyway (it was not asked to): 502, no tunnel.
    let (up, _) = upstream(Some(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n",
    ))
    .await;
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let h2c = raw(
        addr,
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    )
    .await;
    assert_eq!(status(&h2c), 502, "{h2c}");
    // Asked for websocket, switched to h2c: 502.
    let ws = b"GET /ws HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
    let mismatch = raw(addr, ws).await;
    assert_eq!(status(&mismatch), 502, "{mismatch}");
    assert!(!mismatch.contains("101"), "{mismatch}");
    proxy.shutdown(Duration::from_secs(1)).await;

    // The control: a 101 to the protocol asked for is a tunnel.
    let (up, _) = upstream(Some(
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n",
    ))
    .await;
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    let matched = raw(proxy.listener_addrs()[0], ws).await;
    assert_eq!(status(&matched), 101, "{matched}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_of_untrusted_clients_are_replaced_and_of_trusted_ones_kept() {
    let (up, seen) = upstream(None).await;
    let request = b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Real-IP: 6.6.6.6\r\nForwarded: for=6.6.6.6\r\nX-Forwarded-For: 6.6.6.6\r\n\r\n";
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    assert_eq!(status(&raw(proxy.listener_addrs()[0], request).await), 200);
    let head = seen.last_head();
    assert!(head.contains("\r\nx-real-ip: 127.0.0.1"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{head}"
    );
    assert!(!head.contains("6.6.6.6"), "{head}");
    assert!(!head.contains("forwarded: for"), "{head}");
    proxy.shutdown(Duration::from_secs(1)).await;

    let proxy = keel_proxy::start(config(up, "trusted_proxies = [\"127.0.0.1/32\"]", ""))
        .await
        .unwrap();
    assert_eq!(status(&raw(proxy.listener_addrs()[0], request).await), 200);
    let head = seen.last_head();
    assert!(head.contains("\r\nx-real-ip: 6.6.6.6"), "{head}");
    assert!(head.contains("\r\nforwarded: for=6.6.6.6"), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-for: 6.6.6.6, 127.0.0.1\r\n"),
        "{head}"
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_passed_on_or_made_and_logged_with_the_user_agent_and_referer() {
    let (up, seen) = upstream(None).await;
    let dir = std::env::temp_dir().join(format!("keel-edges-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("access.log");
    let _ = std::fs::remove_file(&log);
    let cfg = ProxyConfig::from_toml_str(
        &format!(
            "[access_log]\npath = \"{}\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{up}\" }}]\n",
            log.display()
        ),
        "edges.toml",
    )
    .unwrap();
    let proxy = keel_proxy::start(cfg).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let made = raw(
        addr,
        b"GET /a HTTP/1.1\r\nHost: a\r\nConnection: close\r\nUser-Agent: edge-test/1\r\nReferer: https://ref.test/p\r\n\r\n",
    )
    .await;
    assert_eq!(status(&made), 200, "{made}");
    let head = seen.last_head();
    let id = head
        .lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .expect("a request id was made")
        .to_string();
    // UUID v4 text: 8-4-4-4-12 hex digits, version 4, variant 10xx.
    let groups: Vec<&str> = id.split('-').collect();
    assert_eq!(
        groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{id}"
    );
    assert!(
        groups[2].starts_with('4') && "89ab".contains(&groups[3][..1]),
        "{id}"
    );
    // Another request gets another id; the client's own is passed on as it is.
    raw(
        addr,
        b"GET /b HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_ne!(seen.last_head(), head);
    assert!(!seen.last_head().contains(&id));
    raw(
        addr,
        b"GET /c HTTP/1.1\r\nHost: a\r\nConnection: close\r\nX-Request-Id: client-7\r\n\r\n",
    )
    .await;
    assert!(seen.last_head().contains("\r\nx-request-id: client-7"));
    proxy.shutdown(Duration::from_secs(1)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert_eq!(lines[0]["request_id"], id.as_str());
    assert_eq!(lines[0]["user_agent"], "edge-test/1");
    assert_eq!(lines[0]["referer"], "https://ref.test/p");
    assert_eq!(lines[2]["request_id"], "client-7");
    assert!(lines[1]["user_agent"].is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_keel_endpoint_is_shown_only_when_asked_for() {
    let (up, _) = upstream(None).await;
    for (extra, shown) in [
        ("", false),
        ("response_headers = { endpoint = true }", true),
    ] {
        let proxy = keel_proxy::start(config(up, "", extra)).await.unwrap();
        let addr = proxy.listener_addrs()[0];
        let h1 = get(&format!("http://{addr}/")).await.unwrap();
        assert_eq!(h1.status, 200);
        assert_eq!(h1.header("x-keel-endpoint").is_some(), shown, "{extra}");
        if shown {
            assert_eq!(h1.header("x-keel-endpoint"), Some(up.to_string().as_str()));
        }
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        let resp = send
            .send_request(
                hyper::Request::get(format!("http://{addr}/"))
                    .body(Empty::<Bytes>::new())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers().contains_key("x-keel-endpoint"), shown);
        let _ = resp.into_body().collect().await;
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_size_that_overflows_is_a_502_not_an_empty_reply() {
    let (up, _) = upstream(Some(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff1\r\nx\r\n0\r\n\r\n",
    ))
    .await;
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    let answer = raw(
        proxy.listener_addrs()[0],
        b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    .await;
    assert_eq!(status(&answer), 502, "{answer:?}");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_chunked_body_is_checked_whole_before_the_endpoint_sees_it() {
    let (up, seen) = upstream(None).await;
    let proxy = keel_proxy::start(config(up, "", "")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    // Malformed (a size line that is not hex) after a valid chunk, all with the head: 400,
    // and the endpoint never saw the request.
    let bad = raw(
        addr,
        b"POST /bad HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\nworld\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status(&bad), 400, "{bad}");
    assert_eq!(seen.count(), 0, "the endpoint saw {:?}", seen.last_head());
    // A valid one arriving in pieces is decoded and sent with its length.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /good HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.write_all(b"lo\r\n6\r\n world\r\n0\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert_eq!(status(&out), 200, "{out}");
    let head = seen.last_head();
    assert!(head.contains("\r\ncontent-length: 11"), "{head}");
    assert!(!head.contains("transfer-encoding"), "{head}");
    assert_eq!(seen.bodies.lock().unwrap().last().unwrap(), b"hello world");
    // Larger than 64 KiB: streamed as before (chunked upstream).
    let big = vec![b'x'; 70_000];
    let mut req =
        b"POST /big HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    req.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
    req.extend_from_slice(&big);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    let answer = raw(addr, &req).await;
    assert_eq!(status(&answer), 200, "{answer}");
    assert!(seen.last_head().contains("transfer-encoding: chunked"));
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// `(status, body)` of one request to the admin listener.
async fn admin(addr: SocketAddr, request: &str) -> (u16, String) {
    let answer = raw(addr, request.as_bytes()).await;
    (status(&answer), answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_refuses_foreign_hosts_and_cross_site_posts() {
    let (up, _) = upstream(None).await;
    let mut cfg = config(up, "", "");
    cfg.admin.as_mut().unwrap().hosts = vec!["keel.internal".into()];
    let proxy = keel_proxy::start(cfg).await.unwrap();
    let a = proxy.admin_addr().unwrap();
    let get =
        |host: &str| format!("GET /status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    for host in [
        a.to_string(),
        "localhost".into(),
        format!("localhost:{}", a.port()),
        format!("[::1]:{}", a.port()),
        "keel.internal:9901".into(),
    ] {
        assert_eq!(admin(a, &get(&host)).await.0, 200, "{host}");
    }
    // A DNS-rebinding page: its own name, resolving to 127.0.0.1.
    for host in [
        "evil.example",
        "evil.example:9901",
        "127.0.0.1.evil.example",
    ] {
        let (status, text) = admin(a, &get(host)).await;
        assert_eq!(status, 403, "{host}: {text}");
    }
    let post = |headers: &str| {
        format!("POST /reload HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\nContent-Length: 0\r\n{headers}\r\n")
    };
    for headers in [
        "Origin: http://evil.example\r\n",
        "Origin: null\r\n",
        // Another site on an IP address (a device's page on the LAN) is another site too.
        "Origin: http://10.0.0.5:8080\r\n",
        "Origin: http://[2001:db8::1]\r\n",
        "Sec-Fetch-Site: cross-site\r\n",
        "Content-Type: application/x-www-form-urlencoded\r\n",
        "Content-Type: text/plain;charset=UTF-8\r\n",
        "Content-Type: multipart/form-data; boundary=x\r\n",
    ] {
        let (status, text) = admin(a, &post(headers)).await;
        assert_eq!(status, 403, "{headers}: {text}");
    }
    // What an operator sends (curl -X POST; the admin page itself): not refused. The proxy was
    // not started from a file, so the reload itself has nothing to do.
    for headers in [
        "",
        &format!("Origin: http://{a}\r\nSec-Fetch-Site: same-origin\r\n"),
        &format!("Origin: http://localhost:{}\r\n", a.port()),
    ] {
        let (status, text) = admin(a, &post(headers)).await;
        assert_ne!(status, 403, "{headers}: {text}");
        assert!(text.contains("not started from a file"), "{text}");
    }
    proxy.shutdown(Duration::from_secs(1)).await;
}

/// `(status, retry-after header, time taken)` of a GET through `addr`.
async fn timed_get(addr: SocketAddr) -> (u16, Option<String>, Duration) {
    let t = std::time::Instant::now();
    let answer = raw(
        addr,
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    let retry_after = answer.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("retry-after: ")
            .map(str::to_string)
    });
    (status(&answer), retry_after, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_sends_the_retry_to_another_endpoint_at_once_even_past_the_deadline() {
    let (good, _) = upstream(None).await;
    for wait in [1u64, 30] {
        let script: &'static [u8] = if wait == 1 {
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\ncontent-length: 0\r\n\r\n"
        } else {
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 30\r\ncontent-length: 0\r\n\r\n"
        };
        let (busy, _) = upstream(Some(script)).await;
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nstrategy = \"round-robin\"\nrequest_timeout = \"3s\"\noutlier_detection = false\nendpoints = [{{ address = \"{busy}\" }}, {{ address = \"{good}\" }}]\n[cluster.retry]\nattempts = 1\n"
        );
        let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "p.toml").unwrap())
            .await
            .unwrap();
        let addr = proxy.listener_addrs()[0];
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(timed_get(addr).await);
        }
        // Round-robin: a request that meets the busy endpoint first is retried on the other
        // at once (the Retry-After backs the busy one off), whether its wait would fit the 3 s
        // deadline or not (tests/proxy/pushback.rs has the rest).
        let slow: Vec<_> = got
            .iter()
            .filter(|g| g.2 >= Duration::from_millis(950))
            .collect();
        assert!(got.iter().all(|g| g.0 == 200), "{got:?}");
        assert!(slow.is_empty(), "a retry waited: {got:?}");
        proxy.shutdown(Duration::from_secs(1)).await;
    }
}
