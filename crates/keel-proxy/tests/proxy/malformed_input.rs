//! Malformed input: bad input sent on raw TCP sockets to a running proxy,
//! each answer asserted, while a well-behaved client on other connections keeps being served;
//! and upstreams that answer malformed or cut-short responses, which must never reach the
//! client as a success.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What a raw exchange gave: the bytes read, whether the proxy closed the connection, and
/// when (since the request was written).
struct Answer {
    text: String,
    closed_after: Option<Duration>,
}

impl Answer {
    /// The status code of the first status line, if any.
    fn status(&self) -> Option<u16> {
        let line = self.text.lines().next()?;
        let mut words = line.split(' ');
        (words.next()? == "HTTP/1.1").then_some(())?;
        words.next()?.parse().ok()
    }
}

/// Writes `bytes` on a new connection, then reads until the proxy closes it or `limit` passes.
async fn exchange(addr: SocketAddr, bytes: &[u8], limit: Duration) -> Answer {
    let mut s = TcpStream::connect(addr).await.unwrap();
    // The proxy may answer and close before it has read everything: ignore write errors.
    let _ = s.write_all(bytes).await;
    let start = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let closed_after = loop {
        let left = limit.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => break None,
            Ok(Ok(0)) | Ok(Err(_)) => break Some(start.elapsed()),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    };
    Answer {
        text: String::from_utf8_lossy(&out).into_owned(),
        closed_after,
    }
}

/// An upstream that records the path and body length of every request whose body arrived
/// whole, and answers 200 `ok`.
async fn recording_upstream() -> (SocketAddr, Arc<Mutex<Vec<(String, usize)>>>) {
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let record = record.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let record = record.clone();
                    async move {
                        let path = req.uri().path().to_string();
                        let status = match req.into_body().collect().await {
                            Ok(b) => {
                                record.lock().unwrap().push((path, b.to_bytes().len()));
                                StatusCode::OK
                            }
                            Err(_) => StatusCode::BAD_REQUEST,
                        };
                        let mut r = hyper::Response::new(Full::new(Bytes::from_static(b"ok")));
                        *r.status_mut() = status;
                        Ok::<_, std::convert::Infallible>(r)
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

/// An upstream that reads a request's headers and answers `script` verbatim, then closes.
async fn scripted_upstream(script: &'static [u8]) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(script).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

fn config(upstream: SocketAddr) -> ProxyConfig {
    let text = format!(
        r#"
[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
max_header_bytes = 16384
max_headers = 20
header_read_timeout = "500ms"
max_request_body_bytes = 1024

[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
idle_timeout = "300ms"

[[cluster]]
name = "app"
endpoints = [{{ address = "{upstream}" }}]
[cluster.retry]
attempts = 0
"#
    );
    ProxyConfig::from_toml_str(&text, "hardening.toml").unwrap()
}

/// A well-behaved client: GETs on its own keep-alive connection every 10 ms until stopped.
fn steady_client(
    url: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, Vec<String>)> {
    tokio::spawn(async move {
        let c = client();
        let mut ok = 0;
        let mut bad = Vec::new();
        while !stop.load(Relaxed) {
            match send(&c, Method::GET, &url, &[], b"").await {
                Ok(g) if g.status == StatusCode::OK => ok += 1,
                Ok(g) => bad.push(format!("{} {}", g.status, g.text())),
                Err(e) => bad.push(e),
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (ok, bad)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_answered_and_good_clients_keep_being_served() {
    let (up, seen) = recording_upstream().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let stop = Arc::new(AtomicBool::new(false));
    let good = steady_client(format!("http://{addr}/good"), stop.clone());

    // The slow client runs during the whole corpus: it must be cut, nobody else delayed.
    let slow = tokio::spawn(exchange(
        addr,
        b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Partial: 1\r\n",
        Duration::from_secs(3),
    ));

    let wait = Duration::from_secs(2);
    let big_header = format!(
        "GET /big HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let fits_header = format!(
        "GET /fits HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
        "a".repeat(12_000)
    );
    let many: String = (0..30).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many_headers = format!("GET /many HTTP/1.1\r\nHost: x\r\n{many}\r\n");
    let some: String = (0..15).map(|i| format!("X-H{i}: v\r\n")).collect();
    let some_headers = format!("GET /some HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{some}\r\n");
    let at_limit = format!(
        "POST /at-limit HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 1024\r\n\r\n{}",
        "b".repeat(1024)
    );
    let over_cl = format!(
        "POST /over-cl HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n{}",
        "b".repeat(2000)
    );
    let chunk = "c".repeat(600);
    let over_chunked = format!(
        "POST /over-chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    // (name, request, expected status; None: the connection must be closed without a
    // success, any status allowed but 2xx)
    let corpus: Vec<(&str, Vec<u8>, Option<u16>)> = vec![
        ("not HTTP at all", b"HELLO THERE\r\n\r\n".to_vec(), Some(400)),
        ("binary garbage", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\r\n\r\n".to_vec(), Some(400)),
        ("missing version", b"GET /\r\nHost: x\r\n\r\n".to_vec(), Some(400)),
        ("extra word in request line", b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n".to_vec(), Some(400)),
        ("unknown version", b"GET / HTTP/7.3\r\nHost: x\r\n\r\n".to_vec(), Some(400)),
        ("control byte in target", b"GET /a\x01b HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), Some(400)),
        ("space in header name", b"GET / HTTP/1.1\r\nHost: x\r\nBad Name: v\r\n\r\n".to_vec(), Some(400)),
        ("header without colon", b"GET / HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n".to_vec(), Some(400)),
        ("NUL in header value", b"GET / HTTP/1.1\r\nHost: x\r\nX-V: a\x00b\r\n\r\n".to_vec(), Some(400)),
        ("headers over max_header_bytes", big_header.into_bytes(), Some(431)),
        ("headers under max_header_bytes", fits_header.into_bytes(), Some(200)),
        ("more than max_headers", many_headers.into_bytes(), Some(431)),
        ("fewer than max_headers", some_headers.into_bytes(), Some(200)),
        ("two different Content-Lengths", b"POST /cl2 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd".to_vec(), Some(400)),
        ("Content-Length not a number", b"POST /clx HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".to_vec(), Some(400)),
        ("negative Content-Length", b"POST /cln HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n".to_vec(), Some(400)),
        ("Transfer-Encoding not ending in chunked", b"POST /te HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc".to_vec(), Some(400)),
        ("Transfer-Encoding on HTTP/1.0", b"POST /te10 HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(), Some(400)),
        ("invalid chunk size", b"POST /bad-chunk HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n0\r\n\r\n".to_vec(), Some(400)),
        ("chunk longer than its size", b"POST /long-chunk HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n".to_vec(), Some(400)),
        ("body at max_request_body_bytes", at_limit.into_bytes(), Some(200)),
        ("Content-Length over max_request_body_bytes", over_cl.into_bytes(), Some(413)),
        ("chunked body over max_request_body_bytes", over_chunked.into_bytes(), Some(413)),
    ];
    let mut figures = Vec::new();
    for (name, bytes, want) in &corpus {
        let a = exchange(addr, bytes, wait).await;
        let got = a.status();
        match want {
            Some(w) => assert_eq!(got, Some(*w), "{name}: answered {:?}", a.text),
            None => {
                assert!(
                    !got.is_some_and(|s| (200..300).contains(&s)),
                    "{name}: answered {:?}",
                    a.text
                );
                assert!(a.closed_after.is_some(), "{name}: connection left open");
            }
        }
        if !matches!(got, Some(s) if s < 400) {
            assert!(
                a.closed_after.is_some(),
                "{name}: connection left open after {got:?}"
            );
        }
        figures.push(format!("{name}: {got:?}"));
    }

    // Content-Length and Transfer-Encoding together (RFC 9112 section 6.3): refused with 400
    // and the connection closed, never forwarded, so bytes smuggled after the chunked body are
    // never read as a request.
    let smuggle = b"POST /cl-te HTTP/1.1\r\nHost: x\r\nContent-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";
    let a = exchange(addr, smuggle, wait).await;
    assert_eq!(
        a.text.matches("HTTP/1.1 ").count(),
        1,
        "one answer only: {:?}",
        a.text
    );
    assert_eq!(a.status(), Some(400), "{:?}", a.text);
    assert!(a.closed_after.is_some(), "closed after a CL+TE request");
    figures.push(format!(
        "Content-Length + Transfer-Encoding: {:?}, then closed",
        a.status()
    ));

    // The slow client was cut after header_read_timeout (500 ms) without an answer.
    let s = slow.await.unwrap();
    let cut = s.closed_after.expect("slow client closed");
    assert!(
        cut >= Duration::from_millis(400) && cut < Duration::from_millis(2000),
        "slow client closed after {cut:?}"
    );
    assert!(s.status() != Some(200), "{:?}", s.text);
    figures.push(format!("headers never finished: closed after {cut:?}"));

    stop.store(true, Relaxed);
    let (ok, bad) = good.await.unwrap();
    assert!(bad.is_empty(), "the well-behaved client failed: {bad:?}");
    assert!(ok >= 20, "the well-behaved client was served {ok} times");

    // The client's faults are not the endpoint's: none counted as its failure.
    let st = proxy.cluster_status("app").unwrap();
    assert_eq!(
        st[0].failures, 0,
        "bad clients were held against the endpoint: {st:?}"
    );
    let seen = seen.lock().unwrap().clone();
    let paths: Vec<&str> = seen.iter().map(|(p, _)| p.as_str()).collect();
    for never in [
        "/big",
        "/many",
        "/cl2",
        "/clx",
        "/cln",
        "/te",
        "/te10",
        "/bad-chunk",
        "/long-chunk",
        "/over-cl",
        "/over-chunked",
        "/smuggled",
        "/cl-te",
        "/slow",
    ] {
        assert!(
            !paths.contains(&never),
            "{never} reached the upstream whole: {paths:?}"
        );
    }
    for forwarded in ["/fits", "/some", "/at-limit"] {
        assert!(
            paths.contains(&forwarded),
            "{forwarded} was not forwarded: {paths:?}"
        );
    }
    assert!(seen.contains(&("/at-limit".to_string(), 1024)));
    eprintln!(
        "hardening corpus ({} inputs + CL/TE + slow headers), good client served {ok} times:\n  {}",
        corpus.len(),
        figures.join("\n  ")
    );
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed_after_idle_timeout() {
    let (up, _) = recording_upstream().await;
    let proxy = keel_proxy::start(config(up)).await.unwrap();
    // Second listener: idle_timeout 300 ms, header_read_timeout 10 s (the default).
    let addr = proxy.listener_addrs()[1];
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 4096];
    for round in 0..3 {
        // Requests 200 ms apart keep it open: the idle time restarts at each response.
        s.write_all(b"GET /ka HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "round {round}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let start = Instant::now();
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .expect("closed by the idle timeout")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without sending anything");
    // 200 ms of the 300 ms had passed already.
    let closed = start.elapsed() + Duration::from_millis(200);
    assert!(
        closed >= Duration::from_millis(250) && closed < Duration::from_millis(1500),
        "closed after {closed:?} idle"
    );
    eprintln!("idle keep-alive connection closed after {closed:?} (idle_timeout 300ms)");
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_request_is_not_cut_by_the_idle_timeout() {
    // The backend takes 600 ms; idle_timeout is 300 ms: the request is in flight, not idle.
    let bs = backends(1, Duration::from_millis(600)).await;
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nidle_timeout = \"300ms\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{}\" }}]\n",
        bs[0].addr()
    );
    let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
        .await
        .unwrap();
    let r = get(&format!("http://{}/", proxy.listener_addrs()[0]))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    proxy.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_short_upstream_answers_are_never_a_success() {
    let cases: [(&str, &'static [u8], bool); 6] = [
        ("not HTTP", b"SMTP ready\r\n\r\n", true),
        (
            "invalid status code",
            b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
            true,
        ),
        (
            "invalid header",
            b"HTTP/1.1 200 OK\r\nBad Header: x\r\nContent-Length: 2\r\n\r\nok",
            true,
        ),
        (
            "closed before the headers end",
            b"HTTP/1.1 200 OK\r\nContent-Le",
            true,
        ),
        // Buffered (Content-Length at most max_buffered_response): 502 before any byte.
        (
            "body shorter than its Content-Length",
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
            true,
        ),
        // Streamed: the 200 is already out, so the client's body must end in an error.
        (
            "chunked body cut short",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
            false,
        ),
    ];
    let mut figures = Vec::new();
    for (name, script, buffered) in cases {
        let up = scripted_upstream(script).await;
        let text = format!(
            "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\nerror_detail = \"full\"\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{up}\" }}]\n[cluster.retry]\nattempts = 0\n"
        );
        let proxy = keel_proxy::start(ProxyConfig::from_toml_str(&text, "t.toml").unwrap())
            .await
            .unwrap();
        let url = format!("http://{}/", proxy.listener_addrs()[0]);
        let c = client();
        let req = Request::get(&url).body(Full::new(Bytes::new())).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(5), c.request(req))
            .await
            .unwrap()
            .unwrap();
        let status = resp.status();
        let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
            .await
            .unwrap();
        if buffered {
            assert_eq!(status, StatusCode::BAD_GATEWAY, "{name}");
            let text = String::from_utf8_lossy(&body.unwrap().to_bytes()).into_owned();
            assert!(
                text.starts_with("502 Bad Gateway: upstream"),
                "{name}: {text}"
            );
            figures.push(format!("{name}: 502"));
        } else {
            assert!(
                body.is_err(),
                "{name}: the cut body reached the client as complete"
            );
            figures.push(format!("{name}: {status}, then the body ends in an error"));
        }
        proxy.shutdown(Duration::from_secs(1)).await;
    }
    eprintln!("upstream faults:\n  {}", figures.join("\n  "));
}
