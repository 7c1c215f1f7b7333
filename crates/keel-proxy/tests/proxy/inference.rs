//! `strategy = "prefix-affinity"` through the proxy, on loopback: the prompt is read from the
//! body within `prompt_read_limit`, the body reaches the endpoint unchanged (a digest checks
//! it), requests sharing a prompt prefix land on one endpoint, a session header keeps a
//! conversation together, a body that is not JSON is routed, answers stream. A binary of its
//! own: one test reads the process's peak RSS.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// FNV-1a over a body fed in pieces (the digest both ends compute).
#[derive(Clone, Copy)]
struct Digest(u64);

impl Digest {
    fn new() -> Self {
        Digest(0xcbf2_9ce4_8422_2325)
    }
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn of(bytes: &[u8]) -> u64 {
        let mut d = Self::new();
        d.feed(bytes);
        d.0
    }
}

/// An endpoint named `name`: reads each request body as it streams (never whole) and
/// answers with its name, the body's length and digest. `/stream` answers three
/// server-sent events 300 ms apart.
async fn digest_backend(name: &'static str) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| async move {
                    let streaming = req.uri().path() == "/stream";
                    let mut body = req.into_body();
                    let mut digest = Digest::new();
                    let mut len = 0u64;
                    while let Some(frame) = body.frame().await {
                        let Ok(frame) = frame else { break };
                        if let Ok(data) = frame.into_data() {
                            len += data.len() as u64;
                            digest.feed(&data);
                        }
                    }
                    let head = Response::builder()
                        .header("x-backend", name)
                        .header("x-len", len.to_string())
                        .header("x-digest", format!("{:016x}", digest.0));
                    let events = if streaming { 3 } else { 0 };
                    let stream = futures_util::stream::unfold(0, move |k| async move {
                        if k >= events {
                            return None;
                        }
                        if k > 0 {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                        let event = Bytes::from(format!("data: event {k}\n\n"));
                        Some((Ok::<_, Infallible>(Frame::data(event)), k + 1))
                    });
                    let resp = head
                        .header("content-type", "text/event-stream")
                        .body(StreamBody::new(stream))
                        .unwrap();
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

async fn backends3() -> Vec<SocketAddr> {
    vec![
        digest_backend("b0").await,
        digest_backend("b1").await,
        digest_backend("b2").await,
    ]
}

/// A chat request: a system prompt of `system_bytes` bytes for `group`, then `user`'s text.
fn chat(group: usize, system_bytes: usize, user: &str) -> Vec<u8> {
    let mut system = format!("You are assistant number {group}. ");
    system.extend((system.len()..system_bytes).map(|i| (b'a' + (i * 7 % 26) as u8) as char));
    format!(
        r#"{{"model":"m","stream":false,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{user}"}}]}}"#
    )
    .into_bytes()
}

/// POSTs `body` over HTTP/1.1 and returns (backend, status, the backend's length and digest
/// check).
async fn post(url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> (String, u16, bool) {
    let want = (body.len() as u64, Digest::of(&body));
    let mut b = Request::builder().method("POST").uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let c = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        c.request(b.body(Full::new(Bytes::from(body))).unwrap()),
    )
    .await
    .expect("an answer within 10 s")
    .unwrap();
    answered(resp, want).await
}

async fn answered(resp: Response<Incoming>, want: (u64, u64)) -> (String, u16, bool) {
    let status = resp.status().as_u16();
    let h = |k: &str| {
        resp.headers()
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let intact = h("x-len") == want.0.to_string() && h("x-digest") == format!("{:016x}", want.1);
    let name = h("x-backend");
    let _ = resp.into_body().collect().await;
    (name, status, intact)
}

/// Waits until the proxy finished every pick (a response's last byte reaches the client a
/// moment before its pick is finished): the next request then sees an idle pool, and the
/// load bound cannot be what moves it.
async fn settle(proxy: &keel_proxy::ProxyHandle) {
    let idle = || {
        proxy
            .cluster_status("app")
            .is_some_and(|eps| eps.iter().all(|e| e.in_flight == 0))
    };
    assert!(eventually(Duration::from_secs(2), idle).await);
}

fn config(addrs: &[SocketAddr], extra: &str) -> keel_proxy::ProxyConfig {
    simple_config(addrs, "prefix-affinity", extra)
}

/// VmHWM (peak resident set) of this process, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10_mb_prompt_passes_intact_with_memory_bounded() {
    let addrs = backends3().await;
    let proxy = keel_proxy::start(config(&addrs, "")).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    // Warm up: connections, pools, the runtime's buffers.
    let url = format!("http://{addr}/v1/completions");
    for g in 0..3 {
        let (_, status, intact) = post(&url, chat(g, 2000, "hi"), &[]).await;
        assert_eq!((status, intact), (200, true));
    }
    // 10 MB of prompt written from one 64 KiB buffer: neither end holds the body.
    let prefix = br#"{"model":"m","max_tokens":1,"prompt":""#;
    let suffix = br#""}"#;
    let filler = 10 * 1024 * 1024;
    let total = prefix.len() + filler + suffix.len();
    let before = peak_rss();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {total}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut digest = Digest::new();
    s.write_all(prefix).await.unwrap();
    digest.feed(prefix);
    let mut piece = vec![0u8; 64 * 1024];
    let mut left = filler;
    let mut k = 0usize;
    while left > 0 {
        let n = left.min(piece.len());
        for (i, b) in piece[..n].iter_mut().enumerate() {
            *b = b'a' + ((k + i) % 26) as u8;
        }
        k += n;
        s.write_all(&piece[..n]).await.unwrap();
        digest.feed(&piece[..n]);
        left -= n;
    }
    s.write_all(suffix).await.unwrap();
    digest.feed(suffix);
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut answer))
        .await
        .expect("an answer within 20 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(answer.contains(&format!("x-len: {total}")), "{answer}");
    assert!(
        answer.contains(&format!("x-digest: {:016x}", digest.0)),
        "{answer}"
    );
    let grew = peak_rss().saturating_sub(before);
    eprintln!(
        "peak RSS grew by {} KiB for a {total}-byte body",
        grew / 1024
    );
    // The body is 10 MiB; keel holds at most its 256 KiB prompt bound and its read buffers.
    assert!(grew < 8 * 1024 * 1024, "peak RSS grew by {grew} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_routed() {
    let addrs = backends3().await;
    let proxy = keel_proxy::start(config(&addrs, "prompt_read_limit = 65536"))
        .await
        .unwrap();
    let url = format!("http://{}/v1/completions", proxy.listener_addrs()[0]);
    let binary: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
    for body in [
        b"not json".to_vec(),
        b"{\"prompt\": tru".to_vec(),
        binary.clone(),
        b"[1,2,3]".to_vec(),
        Vec::new(),
    ] {
        let (_, status, intact) = post(&url, body, &[]).await;
        assert_eq!((status, intact), (200, true));
    }
    // Chunked, past the limit, not JSON.
    let c = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
    let pieces: Vec<Result<Frame<Bytes>, Infallible>> = binary
        .chunks(10_000)
        .map(|p| Ok(Frame::data(Bytes::copy_from_slice(p))))
        .collect();
    let req = Request::post(&url)
        .body(StreamBody::new(futures_util::stream::iter(pieces)))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let (_, status, intact) = answered(resp, (binary.len() as u64, Digest::of(&binary))).await;
    assert_eq!((status, intact), (200, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_land_together_and_distinct_ones_spread() {
    let addrs = backends3().await;
    // Estimates large enough for two groups' longest prompts each (4,097 blocks read of 300
    // KB): with the default 96, one long prompt evicts its neighbour group's prefix, as it
    // would from an engine of that size, and the neighbour then goes by load.
    let proxy = keel_proxy::start(config(&addrs, "cache_blocks = 20000"))
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", proxy.listener_addrs()[0]);
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    // Six groups, three requests each, in turns; a group's system prompt is 1,600 bytes (25
    // blocks), 100 KB (past the inline bound, 64 KiB) or 300 KB (past the read limit), the
    // same for each of its requests: a group's prompts share all but their question, as a
    // conversation's turns do (a match of under 0.3 of the prompt counts as none).
    for round in 0..3 {
        for g in 0..6 {
            let system = [1_600, 100_000, 300_000][g % 3];
            let body = chat(g, system, &format!("q{round}"));
            settle(&proxy).await;
            let (name, status, intact) = post(&url, body, &[]).await;
            assert_eq!((status, intact), (200, true), "group {g} round {round}");
            homes.entry(g).or_default().insert(name);
        }
    }
    for (g, names) in &homes {
        assert_eq!(names.len(), 1, "group {g} went to {names:?}");
    }
    let used: HashSet<&String> = homes.values().flatten().collect();
    assert!(used.len() >= 2, "six groups on {used:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_read_and_forwarded_too() {
    let addrs = backends3().await;
    // Room for the 100 KB prompts (1,563 blocks) of two groups per endpoint.
    let proxy = keel_proxy::start(config(&addrs, "cache_blocks = 20000"))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    for round in 0..3 {
        for g in 0..4 {
            // Small (read whole by the front end) and 100 KB (streamed) bodies alike, one size
            // a group (its prompts then share all but their end).
            let size = if g % 2 == 0 { 1_600 } else { 100_000 };
            let body = chat(g, size, &format!("h2 {round}"));
            let want = (body.len() as u64, Digest::of(&body));
            settle(&proxy).await;
            let req = Request::post(format!("http://{addr}/v1/chat/completions"))
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
                .await
                .unwrap()
                .unwrap();
            let (name, status, intact) = answered(resp, want).await;
            assert_eq!((status, intact), (200, true));
            homes.entry(g).or_default().insert(name);
        }
    }
    for (g, names) in &homes {
        assert_eq!(names.len(), 1, "group {g} went to {names:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_header_keeps_a_conversation_together() {
    let addrs = backends3().await;
    let proxy = keel_proxy::start(config(&addrs, "hash_on = \"header:x-session\""))
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", proxy.listener_addrs()[0]);
    let mut seen = HashSet::new();
    for session in 0..8 {
        let id = format!("s{session}");
        let mut names = HashSet::new();
        // Prompts shorter than a block: nothing to match, the session decides.
        for turn in 0..4 {
            let body = format!(r#"{{"messages":[{{"role":"user","content":"t{turn}"}}]}}"#);
            settle(&proxy).await;
            let (name, status, intact) =
                post(&url, body.into_bytes(), &[("x-session", id.as_str())]).await;
            assert_eq!((status, intact), (200, true));
            names.insert(name);
        }
        assert_eq!(names.len(), 1, "session {id} went to {names:?}");
        seen.extend(names);
    }
    assert!(seen.len() >= 2, "eight sessions on {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_stream_event_by_event() {
    let addrs = backends3().await;
    let proxy = keel_proxy::start(config(&addrs, "")).await.unwrap();
    let url = format!("http://{}/stream", proxy.listener_addrs()[0]);
    let c = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    let req = Request::post(&url)
        .body(Full::new(Bytes::from(chat(1, 1_600, "stream"))))
        .unwrap();
    let mut body = c.request(req).await.unwrap().into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            arrivals.push((start.elapsed(), data));
        }
    }
    let text: Vec<u8> = arrivals.iter().flat_map(|(_, d)| d.to_vec()).collect();
    assert_eq!(
        String::from_utf8_lossy(&text),
        "data: event 0\n\ndata: event 1\n\ndata: event 2\n\n"
    );
    // The first event arrived long before the last was sent (600 ms after the first).
    assert!(arrivals[0].0 < Duration::from_millis(400), "{arrivals:?}");
    assert!(arrivals.last().unwrap().0 >= Duration::from_millis(550));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_sends_the_same_body() {
    // One endpoint refuses connections: a request picked there is retried on the other
    // with the same bytes, whether its body was read whole or only its first bytes.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let live = digest_backend("live").await;
    let proxy = keel_proxy::start(config(
        &[closed, live],
        "outlier_detection = false\nprompt_read_limit = 65536\n[cluster.retry]\nattempts = 1\nmin_retries_per_second = 100",
    ))
    .await
    .unwrap();
    let url = format!("http://{}/v1/chat/completions", proxy.listener_addrs()[0]);
    for g in 0..8 {
        for size in [1_600, 50_000, 200_000] {
            let (name, status, intact) = post(&url, chat(g, size, "retry"), &[]).await;
            assert_eq!(
                (name.as_str(), status, intact),
                ("live", 200, true),
                "{g} {size}"
            );
        }
    }
}
