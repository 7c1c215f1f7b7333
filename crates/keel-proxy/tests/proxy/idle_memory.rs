//! A waiting HTTP/1.1 keep-alive connection past the quiet spell (1 s) is parked: it holds no
//! buffer and no request state (what a connection costs while it waits, BENCHMARKS.md "Memory
//! per connection"), is counted in `keel_connections_parked`, and is served as before when its
//! client speaks again. A client that stalls in the middle of a head keeps its bytes; pipelined
//! requests are answered in order, before and after a park.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::{backends, eventually, metric, simple_config};

/// Longer than the quiet spell (1 s), with room for a loaded machine.
const PAST_QUIET: Duration = Duration::from_millis(1600);

/// Reads one response (a `Content-Length` body) from `s`, leaving any later bytes in `buf`;
/// returns its status.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                let status = head[9..12].parse().unwrap();
                buf.drain(..end + 4 + len);
                return status;
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline.into(), s.read(&mut chunk))
            .await
            .expect("a response within 5 s")
            .unwrap();
        assert!(n > 0, "closed before a whole response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

const GET: &[u8] = b"GET /parked HTTP/1.1\r\nHost: test\r\n\r\n";

async fn parked(admin: SocketAddr, handle: &keel_proxy::ProxyHandle) -> (usize, Option<f64>) {
    let listener = handle.listener_addrs()[0];
    let line = format!("keel_connections_parked{{listener=\"{listener}\"}}");
    (handle.connections_parked(0), metric(admin, &line).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_connections_park_after_the_quiet_spell_and_are_served_when_they_speak() {
    const N: usize = 200;
    let b = backends(1, Duration::ZERO).await;
    let handle = keel_proxy::start(simple_config(&[b[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let addr = handle.listener_addrs()[0];
    let admin = handle.admin_addr().unwrap();
    let mut conns = Vec::new();
    for _ in 0..N {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(GET).await.unwrap();
        let mut buf = Vec::new();
        assert_eq!(read_response(&mut s, &mut buf).await, 200);
        conns.push(s);
    }
    tokio::time::sleep(PAST_QUIET).await;
    assert!(
        eventually(Duration::from_secs(3), || handle.connections_parked(0) == N).await,
        "parked: {} of {N}",
        handle.connections_parked(0)
    );
    assert_eq!(parked(admin, &handle).await, (N, Some(N as f64)));
    // Each parked connection is served at once when its client speaks, twice in a row (the
    // second on the busy period the first began).
    let mut slowest = Duration::ZERO;
    for s in &mut conns {
        for _ in 0..2 {
            let t = Instant::now();
            s.write_all(GET).await.unwrap();
            let mut buf = Vec::new();
            assert_eq!(read_response(s, &mut buf).await, 200);
            assert!(buf.is_empty());
            slowest = slowest.max(t.elapsed());
        }
    }
    assert!(
        slowest < Duration::from_millis(500),
        "slowest answer {slowest:?}"
    );
    assert_eq!(handle.connections_parked(0), 0);
    // Closed while parked: the count follows.
    tokio::time::sleep(PAST_QUIET).await;
    assert!(eventually(Duration::from_secs(3), || handle.connections_parked(0) == N).await);
    conns.clear();
    assert!(
        eventually(Duration::from_secs(3), || handle.connections_parked(0) == 0).await,
        "still parked after close: {}",
        handle.connections_parked(0)
    );
    handle.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_a_head_across_the_quiet_spell_is_kept_and_pipelined_requests_stay_in_order() {
    let b = backends(1, Duration::ZERO).await;
    let handle = keel_proxy::start(simple_config(&[b[0].addr()], "round-robin", ""))
        .await
        .unwrap();
    let addr = handle.listener_addrs()[0];

    // Half a head, then a stall past the quiet spell: not parked, its bytes kept.
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"GET /half HTTP/1.1\r\nHo").await.unwrap();
    tokio::time::sleep(PAST_QUIET).await;
    assert_eq!(
        handle.connections_parked(0),
        0,
        "a connection with half a head parked"
    );
    half.write_all(b"st: test\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    assert_eq!(read_response(&mut half, &mut buf).await, 200);

    // Two requests in one write, answered in order; then parked; then a request split
    // across the park (its first bytes wake the connection), and two pipelined again.
    let mut pipe = TcpStream::connect(addr).await.unwrap();
    let two = [GET, b"GET /second HTTP/1.1\r\nHost: test\r\n\r\n"].concat();
    pipe.write_all(&two).await.unwrap();
    let mut buf = Vec::new();
    assert_eq!(read_response(&mut pipe, &mut buf).await, 200);
    assert_eq!(read_response(&mut pipe, &mut buf).await, 200);
    tokio::time::sleep(PAST_QUIET).await;
    assert!(eventually(Duration::from_secs(3), || handle.connections_parked(0) == 2).await);
    pipe.write_all(b"GET /wo").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(handle.connections_parked(0), 1, "woken by its first bytes");
    pipe.write_all(b"ke HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_response(&mut pipe, &mut buf).await, 200);
    // A head longer than the bytes a parked connection reads, with a second request behind.
    let long = format!("GET /{} HTTP/1.1\r\nHost: test\r\n\r\n", "x".repeat(300));
    tokio::time::sleep(PAST_QUIET).await;
    assert!(eventually(Duration::from_secs(3), || handle.connections_parked(0) == 2).await);
    pipe.write_all(&[long.as_bytes(), GET].concat())
        .await
        .unwrap();
    assert_eq!(read_response(&mut pipe, &mut buf).await, 200);
    assert_eq!(read_response(&mut pipe, &mut buf).await, 200);
    assert!(buf.is_empty());
    handle.shutdown(Duration::from_secs(1)).await;
}
