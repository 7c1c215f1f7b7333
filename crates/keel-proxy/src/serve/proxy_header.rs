//! The PROXY protocol header a listener with `proxy_protocol = true` reads first on each
//! connection (version 1, text, or 2, binary; HAProxy's `proxy-protocol.txt`): who the client
//! is, as the proxy in front of keel saw it. `ppp` parses it; this file reads exactly its bytes
//! off the socket, so that what follows (TLS, HTTP/1.1, HTTP/2, a tunnel's bytes) is left in
//! the socket for the front end as if no header had been there.

use std::net::SocketAddr;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use std::sync::atomic::Ordering::Relaxed;

use crate::state::{ListenerSlot, PROXY_REFUSALS};

/// The first 12 bytes of a version 2 header.
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
/// A version 1 header's start.
const V1_START: &[u8; 6] = b"PROXY ";
/// Version 1's longest header (`PROXY TCP6`, two full IPv6 addresses and ports), CRLF
/// included, as the protocol's text sets it.
const V1_MAX: usize = 107;
/// Most bytes of addresses and TLVs accepted after a version 2 header's first 16 (AWS's and
/// GCP's TLVs take tens of bytes).
const V2_MAX_BODY: usize = 4096;

/// Why a connection's PROXY header was refused; each closes the connection and is counted
/// by listener and reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The peer is not one of the listener's `trusted_proxies`.
    Untrusted = 0,
    /// The bytes are not a PROXY header (none was sent, or it is not one `ppp` accepts).
    Malformed = 1,
    /// The header was not whole within the listener's `header_read_timeout`.
    Timeout = 2,
}

impl Refusal {
    /// Its label (`/metrics`, the log), from [`PROXY_REFUSALS`] where the counters are.
    pub(crate) fn name(self) -> &'static str {
        PROXY_REFUSALS[self as usize]
    }
}

/// What a header said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Addresses {
    /// The client's address and the one it connected to.
    pub(crate) source: SocketAddr,
    pub(crate) destination: SocketAddr,
}

/// A `proxy_protocol` listener's first step on a connection: the client's address and the
/// one it connected to, from the header when it names them, else the socket's own; `None`
/// when the connection is refused (counted by reason, the first of each reason logged at
/// `warn` and the rest at `debug`): the caller closes it.
pub(crate) async fn accept(
    stream: &mut TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    settings: &crate::config::ListenerConfig,
    listener: &ListenerSlot,
) -> Option<(SocketAddr, SocketAddr)> {
    let got = if settings.trusts(peer.ip()) {
        match tokio::time::timeout(settings.header_read_timeout, read(stream)).await {
            Ok(got) => got,
            Err(_) => Err(Refusal::Timeout),
        }
    } else {
        Err(Refusal::Untrusted)
    };
    match got {
        Ok(Some(a)) => Some((canonical(a.source), canonical(a.destination))),
        Ok(None) => Some((peer, local)),
        Err(why) => {
            let k = why as usize;
            listener.proxy_refused[k].fetch_add(1, Relaxed);
            let first = !listener.proxy_refusal_logged[k].swap(true, Relaxed);
            let reason = why.name();
            if first {
                tracing::warn!(listener = %listener.addr, %peer, reason, "PROXY protocol header refused, connection closed (further ones of this reason are logged at debug and counted in keel_proxy_protocol_refused_total)");
            } else {
                tracing::debug!(listener = %listener.addr, %peer, reason, "PROXY protocol header refused, connection closed");
            }
            None
        }
    }
}

/// An IPv4 client named in IPv6 form (`::ffff:a.b.c.d`) is that IPv4 address, as the accept
/// loop takes a socket's.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Reads one PROXY header off `stream`, no byte past it. `Ok(None)`: a header that names no
/// address to use (version 2's LOCAL command, `UNKNOWN`, a UNIX or unspecified family): the
/// socket's own addresses stand.
pub(crate) async fn read(stream: &mut TcpStream) -> Result<Option<Addresses>, Refusal> {
    // Every valid header is at least 15 bytes long (`PROXY UNKNOWN\r\n`), so the first 12 are
    // the header's whichever version it is.
    let mut buf = Vec::with_capacity(V1_MAX);
    buf.resize(12, 0);
    stream
        .read_exact(&mut buf)
        .await
        .map_err(|_| Refusal::Malformed)?;
    if buf[..] == V2_SIGNATURE[..] {
        buf.resize(16, 0);
        stream
            .read_exact(&mut buf[12..])
            .await
            .map_err(|_| Refusal::Malformed)?;
        let body = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        if body > V2_MAX_BODY {
            return Err(Refusal::Malformed);
        }
        buf.resize(16 + body, 0);
        stream
            .read_exact(&mut buf[16..])
            .await
            .map_err(|_| Refusal::Malformed)?;
        return parse_v2(&buf);
    }
    if !buf.starts_with(V1_START) {
        return Err(Refusal::Malformed);
    }
    // Version 1 ends at its first LF. Bytes before it are the header's and may be taken as
    // they come; the read that reaches it takes no byte further (a peek says where it is).
    while buf.last() != Some(&b'\n') {
        if buf.len() >= V1_MAX {
            return Err(Refusal::Malformed);
        }
        let mut ahead = [0u8; V1_MAX];
        let room = V1_MAX - buf.len();
        let seen = stream
            .peek(&mut ahead[..room])
            .await
            .map_err(|_| Refusal::Malformed)?;
        if seen == 0 {
            return Err(Refusal::Malformed);
        }
        let take = ahead[..seen]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(seen, |i| i + 1);
        let start = buf.len();
        buf.resize(start + take, 0);
        stream
            .read_exact(&mut buf[start..])
            .await
            .map_err(|_| Refusal::Malformed)?;
    }
    parse_v1(&buf)
}

/// A whole version 1 header.
fn parse_v1(bytes: &[u8]) -> Result<Option<Addresses>, Refusal> {
    use ppp::v1::{Addresses as A, Header};
    let header = Header::try_from(bytes).map_err(|_| Refusal::Malformed)?;
    if header.header.len() != bytes.len() {
        // ppp ends the header at its CR; a lone LF or bytes between CR and LF are not a header.
        return Err(Refusal::Malformed);
    }
    Ok(match header.addresses {
        A::Unknown => None,
        A::Tcp4(a) => Some(Addresses {
            source: SocketAddr::from((a.source_address, a.source_port)),
            destination: SocketAddr::from((a.destination_address, a.destination_port)),
        }),
        A::Tcp6(a) => Some(Addresses {
            source: SocketAddr::from((a.source_address, a.source_port)),
            destination: SocketAddr::from((a.destination_address, a.destination_port)),
        }),
    })
}

/// A whole version 2 header (its 16 bytes, addresses and TLVs).
fn parse_v2(bytes: &[u8]) -> Result<Option<Addresses>, Refusal> {
    use ppp::v2::{Addresses as A, Command, Header};
    let header = Header::try_from(bytes).map_err(|_| Refusal::Malformed)?;
    if header.command == Command::Local {
        // The proxy's own connection (its health check): no client to name.
        return Ok(None);
    }
    Ok(match header.addresses {
        A::IPv4(a) => Some(Addresses {
            source: SocketAddr::from((a.source_address, a.source_port)),
            destination: SocketAddr::from((a.destination_address, a.destination_port)),
        }),
        A::IPv6(a) => Some(Addresses {
            source: SocketAddr::from((a.source_address, a.source_port)),
            destination: SocketAddr::from((a.destination_address, a.destination_port)),
        }),
        A::Unspecified | A::Unix(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio::io::AsyncWriteExt;

    /// `bytes` sent on a loopback connection in pieces of `piece` bytes, then `after`; what
    /// `read` made of them, and what the socket held after it.
    async fn over_socket(
        bytes: &[u8],
        piece: usize,
        after: &[u8],
    ) -> (Result<Option<Addresses>, Refusal>, Vec<u8>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (bytes, after) = (bytes.to_vec(), after.to_vec());
        let sender = tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            for p in bytes.chunks(piece.max(1)) {
                s.write_all(p).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            s.write_all(&after).await.unwrap();
        });
        let (mut stream, _) = listener.accept().await.unwrap();
        let got = read(&mut stream).await;
        sender.await.unwrap();
        let mut rest = Vec::new();
        if got.is_ok() {
            stream.read_to_end(&mut rest).await.unwrap();
        }
        (got, rest)
    }

    fn v4(s: &str, d: &str) -> Option<Addresses> {
        Some(Addresses {
            source: s.parse().unwrap(),
            destination: d.parse().unwrap(),
        })
    }

    fn v2_header(command: u8, family: u8, addresses: &[u8], tlvs: &[u8]) -> Vec<u8> {
        let mut h = V2_SIGNATURE.to_vec();
        h.push(0x20 | command);
        h.push(family);
        h.extend_from_slice(&((addresses.len() + tlvs.len()) as u16).to_be_bytes());
        h.extend_from_slice(addresses);
        h.extend_from_slice(tlvs);
        h
    }

    const V2_TCP4: [u8; 12] = [203, 0, 113, 7, 127, 0, 0, 1, 0xc3, 0x50, 0x1f, 0x90];

    #[tokio::test]
    async fn version_1_and_2_name_the_client_and_leave_what_follows() {
        let v1 = b"PROXY TCP4 203.0.113.7 127.0.0.1 50000 8080\r\n";
        for piece in [1, 7, v1.len()] {
            let (got, rest) = over_socket(v1, piece, b"GET / HTTP/1.1\r\n").await;
            assert_eq!(
                got,
                Ok(v4("203.0.113.7:50000", "127.0.0.1:8080")),
                "{piece}"
            );
            assert_eq!(rest, b"GET / HTTP/1.1\r\n");
        }
        let v1_6 = b"PROXY TCP6 2001:db8::7 ::1 50000 443\r\n";
        let (got, _) = over_socket(v1_6, 100, b"").await;
        assert_eq!(
            got.unwrap().unwrap().source,
            "[2001:db8::7]:50000".parse().unwrap()
        );
        let unknown = b"PROXY UNKNOWN\r\n";
        assert_eq!(
            over_socket(unknown, 100, b"x").await,
            (Ok(None), b"x".to_vec())
        );

        // A TLV (type 0x04, NOOP) after the addresses is read and left unused.
        let v2 = v2_header(1, 0x11, &V2_TCP4, &[0x04, 0, 2, 0, 0]);
        for piece in [1, 5, v2.len()] {
            let (got, rest) = over_socket(&v2, piece, b"\x16\x03\x01").await;
            assert_eq!(
                got,
                Ok(v4("203.0.113.7:50000", "127.0.0.1:8080")),
                "{piece}"
            );
            assert_eq!(rest, b"\x16\x03\x01", "the TLS hello after it is intact");
        }
    }

    #[tokio::test]
    async fn local_and_unix_and_unspecified_keep_the_socket_address() {
        let local = v2_header(0, 0x00, &[], &[]);
        assert_eq!(over_socket(&local, 100, b"").await.0, Ok(None));
        let local_with_addresses = v2_header(0, 0x11, &V2_TCP4, &[]);
        assert_eq!(
            over_socket(&local_with_addresses, 100, b"").await.0,
            Ok(None)
        );
        let unix = v2_header(1, 0x31, &[0u8; 216], &[]);
        assert_eq!(over_socket(&unix, 100, b"").await.0, Ok(None));
    }

    #[tokio::test]
    async fn what_is_not_a_header_is_refused() {
        for bad in [
            &b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"[..],
            b"PROXY TCP4 203.0.113.7 127.0.0.1 50000\r\n",
            b"PROXY TCP4 999.0.113.7 127.0.0.1 50000 80\r\n",
            b"PROXY TCP4 203.0.113.7 127.0.0.1 50000 80\n",
            b"PROXY TCP4 203.0.113.7 127.0.0.1 50000 80 \r\n",
            b"PROXY UNKNOWN",
        ] {
            let (got, _) = over_socket(bad, 100, b"").await;
            assert_eq!(
                got,
                Err(Refusal::Malformed),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = [&b"PROXY "[..], &[b'1'; 200][..], b"\r\n"].concat();
        assert_eq!(
            over_socket(&long, 100, b"").await.0,
            Err(Refusal::Malformed)
        );
        // A length past what the addresses need with junk, a version 3, a family of 0x4.
        let mut v3 = v2_header(1, 0x11, &V2_TCP4, &[]);
        v3[12] = 0x31;
        assert_eq!(over_socket(&v3, 100, b"").await.0, Err(Refusal::Malformed));
        let family = v2_header(1, 0x41, &V2_TCP4, &[]);
        assert_eq!(
            over_socket(&family, 100, b"").await.0,
            Err(Refusal::Malformed)
        );
        let short = v2_header(1, 0x11, &V2_TCP4[..8], &[]);
        assert_eq!(
            over_socket(&short, 100, b"").await.0,
            Err(Refusal::Malformed)
        );
        let huge = v2_header(1, 0x11, &V2_TCP4, &[0x04; V2_MAX_BODY]);
        assert_eq!(
            over_socket(&huge, 5000, b"").await.0,
            Err(Refusal::Malformed)
        );
        // The sender closes inside the header.
        let cut = b"PROXY TCP4 203.0.1";
        assert_eq!(over_socket(cut, 100, b"").await.0, Err(Refusal::Malformed));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any bytes: the parsers say yes or no without panicking, and a yes to version 1
        /// bytes comes only from bytes that end with CRLF.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let one = parse_v1(&bytes);
            if matches!(one, Ok(Some(_))) {
                prop_assert!(bytes.ends_with(b"\r\n"));
            }
            let _ = parse_v2(&bytes);
        }

        /// Every address HAProxy could send (both versions) comes back as sent.
        #[test]
        fn sent_addresses_come_back(a in any::<[u8; 4]>(), sp in any::<u16>(), dp in any::<u16>()) {
            let s = std::net::Ipv4Addr::from(a);
            let text = format!("PROXY TCP4 {s} 127.0.0.1 {sp} {dp}\r\n");
            let got = parse_v1(text.as_bytes()).unwrap().unwrap();
            prop_assert_eq!(got.source, SocketAddr::from((s, sp)));
            prop_assert_eq!(got.destination.port(), dp);
            let mut addresses = a.to_vec();
            addresses.extend_from_slice(&[127, 0, 0, 1]);
            addresses.extend_from_slice(&sp.to_be_bytes());
            addresses.extend_from_slice(&dp.to_be_bytes());
            let got = parse_v2(&v2_header(1, 0x11, &addresses, &[])).unwrap().unwrap();
            prop_assert_eq!(got.source, SocketAddr::from((s, sp)));
        }
    }
}
