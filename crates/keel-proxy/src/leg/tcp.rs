//! The TCP leg of TCP listeners (`protocol = "tcp"`; their front end is `front::tcp`). Each
//! client connection is one "request" of the attempt driver: one pick (`hash_on = "client-ip"` allowed), a
//! connect (a refused or timed-out connect goes to another endpoint within `retry.attempts`),
//! an optional PROXY protocol header, then bytes both ways ([`crate::leg::tunnel`]) until the
//! connection closes, when the pick is finished: a success on a clean close, a failure when
//! the endpoint reset the connection before any byte came back. The pick is held while the
//! connection is open, so least-connections counts open connections.

use std::net::SocketAddr;

use crate::config::ProxyProtocol;
use crate::driver::leg::Leg;
use crate::exchange::error::{Cause, TryError, TryFailure};
use crate::metrics::ErrorKind;
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::pool::RawConn;

/// The TCP leg: a new connection to the endpoint, and the PROXY protocol header.
pub(crate) struct TcpLeg {
    /// The client's address and the address it connected to.
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
}

impl Leg for TcpLeg {
    type Won = RawConn;

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        _worker: usize,
        _trace: Option<&crate::exchange::trace::TraceParent>,
    ) -> Result<RawConn, TryFailure<RawConn>> {
        let mut conn = entry.pool.connect().await.map_err(|e| {
            let cause = Cause::from(e);
            TryFailure::Upstream(TryError::before_sending(ErrorKind::Connect, cause))
        })?;
        if let Some(version) = cluster.config.proxy_protocol {
            let header = proxy_header(version, self.peer, self.local);
            crate::io::write_all_2(&mut conn.io, &header, &[])
                .await
                .map_err(|e| {
                    TryFailure::Upstream(TryError::before_sending(
                        ErrorKind::Reset,
                        Cause::Write(e),
                    ))
                })?;
        }
        Ok(conn)
    }

    fn rewind(&mut self) -> bool {
        // Nothing of the client's was sent yet.
        true
    }

    fn idempotent(&self) -> bool {
        true
    }

    fn waiting_on_client(&self) -> bool {
        false
    }
}

/// The PROXY protocol header (version 1 or 2) telling the endpoint who the client is and
/// which address it connected to.
pub(crate) fn proxy_header(version: ProxyProtocol, peer: SocketAddr, local: SocketAddr) -> Vec<u8> {
    // Both addresses of one family (an IPv4 client on an IPv6 socket is mapped).
    let (peer, local) = match (peer, local) {
        (SocketAddr::V4(_), SocketAddr::V4(_)) | (SocketAddr::V6(_), SocketAddr::V6(_)) => {
            (peer, local)
        }
        _ => (
            SocketAddr::new(to_v6(peer.ip()).into(), peer.port()),
            SocketAddr::new(to_v6(local.ip()).into(), local.port()),
        ),
    };
    match version {
        ProxyProtocol::V1 => {
            let family = if peer.is_ipv4() { "TCP4" } else { "TCP6" };
            format!(
                "PROXY {family} {} {} {} {}\r\n",
                peer.ip(),
                local.ip(),
                peer.port(),
                local.port()
            )
            .into_bytes()
        }
        ProxyProtocol::V2 => {
            let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
            // Version 2, PROXY command.
            h.push(0x21);
            match (peer, local) {
                (SocketAddr::V4(p), SocketAddr::V4(l)) => {
                    // TCP over IPv4, 12 bytes of addresses.
                    h.push(0x11);
                    h.extend_from_slice(&12u16.to_be_bytes());
                    h.extend_from_slice(&p.ip().octets());
                    h.extend_from_slice(&l.ip().octets());
                    h.extend_from_slice(&p.port().to_be_bytes());
                    h.extend_from_slice(&l.port().to_be_bytes());
                }
                (p, l) => {
                    // TCP over IPv6, 36 bytes.
                    h.push(0x21);
                    h.extend_from_slice(&36u16.to_be_bytes());
                    h.extend_from_slice(&to_v6(p.ip()).octets());
                    h.extend_from_slice(&to_v6(l.ip()).octets());
                    h.extend_from_slice(&p.port().to_be_bytes());
                    h.extend_from_slice(&l.port().to_be_bytes());
                }
            }
            h
        }
    }
}

fn to_v6(ip: std::net::IpAddr) -> std::net::Ipv6Addr {
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        std::net::IpAddr::V6(v6) => v6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_protocol_headers() {
        let peer: SocketAddr = "192.0.2.7:51000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(
            proxy_header(ProxyProtocol::V1, peer, local),
            b"PROXY TCP4 192.0.2.7 127.0.0.1 51000 7000\r\n"
        );
        let v2 = proxy_header(ProxyProtocol::V2, peer, local);
        assert_eq!(&v2[..12], b"\r\n\r\n\0\r\nQUIT\n");
        assert_eq!(&v2[12..16], &[0x21, 0x11, 0, 12]);
        assert_eq!(&v2[16..20], &[192, 0, 2, 7]);
        assert_eq!(&v2[20..24], &[127, 0, 0, 1]);
        assert_eq!(&v2[24..28], &[0xc7, 0x38, 0x1b, 0x58]);
        let six: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        let v2 = proxy_header(ProxyProtocol::V2, six, local);
        assert_eq!(&v2[12..16], &[0x21, 0x21, 0, 36]);
        assert_eq!(v2.len(), 16 + 36);
    }
}
