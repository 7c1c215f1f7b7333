//! HTTP/2 clients written frame by frame, for what no client library sends: a header block
//! left open, a GOAWAY's PING never answered, a malformed field in one stream of several.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use hyper::Method;
use keel_proxy::ProxyConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;

/// One frame: its 9-byte header and payload.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK field "literal without indexing" with a new name (RFC 7541 6.2.2), written as
/// sent: no check of the name's case or of the bytes of either.
fn literal(name: &[u8], value: &[u8]) -> Vec<u8> {
    assert!(name.len() < 127 && value.len() < 127);
    let mut b = vec![0x00, name.len() as u8];
    b.extend_from_slice(name);
    b.push(value.len() as u8);
    b.extend_from_slice(value);
    b
}

/// A GET's header block: `:method GET`, `:scheme http` (static table), `:path` and
/// `:authority` (literals with indexed names), then `extra`.
pub fn get_block(path: &str, extra: &[u8]) -> Vec<u8> {
    let mut b = vec![0x82, 0x86];
    b.push(0x04);
    b.push(path.len() as u8);
    b.extend_from_slice(path.as_bytes());
    b.push(0x01);
    b.push(1);
    b.push(b'x');
    b.extend_from_slice(extra);
    b
}

/// A connection that has sent the preface and an empty SETTINGS.
pub async fn open(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    s
}

/// Frames read until the proxy closes the connection or `limit` passes: (type, flags,
/// stream, payload); and whether it was closed.
async fn frames_until_close(
    s: &mut TcpStream,
    limit: Duration,
) -> (Vec<(u8, u8, u32, Vec<u8>)>, bool) {
    let mut got = Vec::new();
    let closed = tokio::time::timeout(limit, s.read_to_end(&mut got))
        .await
        .is_ok();
    (parse(&got), closed)
}

fn parse(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 9 {
        let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
        if b.len() < 9 + len {
            break;
        }
        let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff;
        out.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
        b = &b[9 + len..];
    }
    out
}

fn listener_config(endpoint: SocketAddr, listener_extra: &str) -> ProxyConfig {
    let text = format!(
        "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n{listener_extra}\n[[cluster]]\nname = \"app\"\nendpoints = [{{ address = \"{endpoint}\" }}]\n"
    );
    ProxyConfig::from_toml_str(&text, "t.toml").unwrap()
}

/// A normal client (one HTTP/2 GET on a new connection); true if answered 200 within `limit`.
async fn served(addr: SocketAddr, limit: Duration) -> bool {
    tokio::time::timeout(limit, async {
        let mut send = h2_connect(addr).await;
        h2_send(&mut send, Method::GET, &format!("http://{addr}/"), &[]).await
    })
    .await
    .is_ok_and(|g| g.status == 200)
}

/// Holds `max_connections` connections with `hold` and measures when they are closed, while a
/// normal client keeps asking.
async fn held_connections_are_closed(hold: Vec<u8>, bound: Duration) {
    let bs = backends(1, Duration::ZERO).await;
    let cfg = listener_config(
        bs[0].addr(),
        "max_connections = 4\nheader_read_timeout = \"1s\"\nidle_timeout = \"2s\"",
    );
    let proxy = keel_proxy::start(cfg).await.unwrap();
    let addr = proxy.listener_addrs()[0];
    let start = Instant::now();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = open(addr).await;
        s.write_all(&hold).await.unwrap();
        held.push(tokio::spawn(async move {
            let (_, closed) = frames_until_close(&mut s, Duration::from_secs(15)).await;
            closed.then(|| start.elapsed())
        }));
    }
    // Beyond max_connections, the normal client waits in the accept queue until a slot frees;
    // it is served within the bound, and again once the slots are back.
    let first = tokio::spawn(served(addr, bound + Duration::from_secs(3)));
    for h in held {
        let closed = h.await.unwrap();
        let at = closed.expect("a held connection was never closed");
        assert!(
            at <= bound,
            "a held connection was closed after {at:?}, not within {bound:?}"
        );
    }
    assert!(
        first.await.unwrap(),
        "the normal client was not served while the slots were held"
    );
    assert!(served(addr, Duration::from_secs(2)).await);
}

/// A HEADERS frame without END_HEADERS, then nothing: closed at `header_read_timeout` (1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_header_block_is_cut_at_header_read_timeout() {
    let half = frame(HEADERS, END_STREAM, 1, &get_block("/", &[]));
    held_connections_are_closed(half, Duration::from_millis(2500)).await;
}

/// Nothing after the SETTINGS (so no answer to the GOAWAY's PING): the GOAWAY comes at
/// `header_read_timeout` (1 s, no request yet), the close `header_read_timeout` after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_after_its_goaway() {
    held_connections_are_closed(Vec::new(), Duration::from_millis(3500)).await;
}

/// Reads frames until `done` says so or 5 s pass; all frames read.
async fn frames_until(
    s: &mut TcpStream,
    done: impl Fn(&[(u8, u8, u32, Vec<u8>)]) -> bool,
) -> Vec<(u8, u8, u32, Vec<u8>)> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 16384];
    loop {
        let frames = parse(&got);
        if done(&frames) {
            return frames;
        }
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return frames,
        }
    }
}

/// RFC 9113 section 8.1.1: a malformed request is a stream error. Streams with an uppercase
/// field name, a CR in a value (indexed into the HPACK table, so that the table must stay
/// right), a NUL, and a reference to that invalid table entry are each reset with
/// PROTOCOL_ERROR; the good streams between them, on the same connection, are answered, and
/// no GOAWAY comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_field_resets_its_stream_only() {
    let bs = backends(1, Duration::ZERO).await;
    let proxy = keel_proxy::start(listener_config(bs[0].addr(), ""))
        .await
        .unwrap();
    let addr = proxy.listener_addrs()[0];
    let mut s = open(addr).await;
    // Literal with incremental indexing, new name (RFC 7541 6.2.1): enters the dynamic table
    // at index 62.
    let mut indexed_cr = vec![0x40, 5];
    indexed_cr.extend_from_slice(b"x-bad");
    indexed_cr.extend_from_slice(&[3, b'a', b'\r', b'b']);
    let blocks: [(u32, Vec<u8>); 6] = [
        (1, get_block("/", &literal(b"X-Upper", b"v"))),
        (3, get_block("/", &indexed_cr)),
        (5, get_block("/", &[])),
        (7, get_block("/", &literal(b"x-nul", b"a\0b"))),
        (9, get_block("/", &[0xbe])),
        (11, get_block("/", &literal(b"x-good", b"fine"))),
    ];
    for (id, block) in &blocks {
        s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, *id, block))
            .await
            .unwrap();
    }
    let ended = |f: &[(u8, u8, u32, Vec<u8>)], id: u32| {
        f.iter().any(|(kind, flags, sid, _)| {
            *sid == id && (*kind == 0x0 || *kind == HEADERS) && flags & END_STREAM != 0
        })
    };
    let reset = |f: &[(u8, u8, u32, Vec<u8>)], id: u32| {
        f.iter()
            .find(|(kind, _, sid, _)| *kind == RST_STREAM && *sid == id)
            .map(|(_, _, _, p)| u32::from_be_bytes([p[0], p[1], p[2], p[3]]))
    };
    let frames = frames_until(&mut s, |f| {
        ended(f, 5) && ended(f, 11) && [1, 3, 7, 9].iter().all(|id| reset(f, *id).is_some())
    })
    .await;
    let kinds: Vec<(u8, u32)> = frames.iter().map(|(k, _, id, _)| (*k, *id)).collect();
    assert!(
        !frames.iter().any(|(k, ..)| *k == GOAWAY),
        "a GOAWAY closed the connection: {kinds:?}"
    );
    for id in [1, 3, 7, 9] {
        assert_eq!(
            reset(&frames, id),
            Some(1),
            "stream {id} reset with PROTOCOL_ERROR: {kinds:?}"
        );
    }
    for id in [5, 11] {
        assert!(ended(&frames, id), "stream {id} answered: {kinds:?}");
        let status = frames
            .iter()
            .find(|(k, _, sid, _)| *k == HEADERS && *sid == id)
            .map(|(_, _, _, p)| p.clone())
            .unwrap();
        // `:status 200` is index 8 of the static table.
        assert_eq!(status.first(), Some(&0x88), "stream {id}: 200");
    }
    assert_eq!(
        bs[0].requests(),
        2,
        "only the good streams reached the endpoint"
    );
}
