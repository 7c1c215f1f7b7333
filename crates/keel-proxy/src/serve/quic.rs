//! The QUIC side of a TLS listener that serves HTTP/3: a UDP socket on the TCP listener's
//! address and port, quinn's endpoint on it, its accept loop and each connection's drain.
//! QUIC connections are served on the proxy's own runtime (not handed to the workers: quinn's
//! endpoint drives all of them from one socket).

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::state::{wait_shutdown, ConnKind, Connection, ListenerSlot, Shared};

/// The listener's UDP socket and quinn's endpoint on it, at `addr` (the TCP listener's bound
/// address: the same port number).
pub(crate) fn endpoint(
    addr: SocketAddr,
    config: quinn::ServerConfig,
) -> std::io::Result<quinn::Endpoint> {
    let socket = std::net::UdpSocket::bind(addr)?;
    socket.set_nonblocking(true)?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(config),
        socket,
        Arc::new(quinn::TokioRuntime),
    )
}

/// Accepts QUIC connections until the listener drains; then refuses new ones, lets those
/// open finish within the drain time (each sends GOAWAY), and closes the endpoint.
pub(crate) async fn accept_loop(
    shared: Arc<Shared>,
    listener: Arc<ListenerSlot>,
    endpoint: quinn::Endpoint,
) {
    let mut stop = listener.stop.subscribe();
    let mut conns = JoinSet::new();
    let drain = loop {
        tokio::select! {
            d = wait_shutdown(&mut stop) => break d,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break wait_shutdown(&mut stop).await };
                // `max_connections` counts QUIC connections with the TCP ones.
                let Ok(slot) = listener.slots.clone().try_acquire_owned() else {
                    incoming.refuse();
                    continue;
                };
                let peer = incoming.remote_address();
                let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
                let conn = Connection::new(&listener, peer, slot);
                conns.spawn(serve(shared.clone(), conn, incoming, stop.clone()));
            }
        }
    };
    endpoint.set_server_config(None);
    // Each connection drains on its own (see `serve`); a backstop a little past the drain time
    // aborts any that did not (none should).
    let all = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(drain + Duration::from_secs(1), all)
        .await
        .is_err()
    {
        tracing::warn!(
            "{} HTTP/3 connection(s) outlived the drain; aborted",
            conns.len()
        );
        conns.abort_all();
    }
    endpoint.close(crate::front::h3::NO_ERROR, b"");
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
}

/// One QUIC connection: its handshake (within `header_read_timeout`, counted with the TLS
/// handshakes when it fails), then the HTTP/3 front end; once its listener drains it has the
/// drain time to finish, then it is closed and counted with the HTTP/2 connections cut.
async fn serve(
    shared: Arc<Shared>,
    conn: Connection,
    incoming: quinn::Incoming,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let ctx = conn.ctx.clone();
    let settings = ctx.settings.clone();
    let listener = conn.listener.clone();
    let handshake = async {
        match incoming.accept() {
            Ok(connecting) => connecting.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    };
    let quic = match tokio::time::timeout(settings.header_read_timeout, handshake).await {
        Ok(Ok(quic)) => quic,
        Ok(Err(cause)) => {
            listener.tls_handshake_failures.fetch_add(1, Relaxed);
            tracing::debug!(peer = %conn.peer, "QUIC handshake failed: {cause}");
            return;
        }
        Err(_) => {
            listener.tls_handshake_failures.fetch_add(1, Relaxed);
            tracing::debug!(peer = %conn.peer, "QUIC handshake not finished within header_read_timeout");
            return;
        }
    };
    let mut client = ctx.client(conn.peer, 0);
    // Only its TCP clients are told where HTTP/3 is.
    client.alt_svc = None;
    // Only a listener with `client_ca` asks for one; rustls has verified it.
    let certs = quic.peer_identity().and_then(|id| {
        id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
            .ok()
    });
    if let Some(leaf) = certs.as_ref().and_then(|c| c.first()) {
        client.client_cert = crate::tls::ClientCert::of(leaf).map(Arc::new);
    }
    let served = crate::front::h3::serve(
        shared,
        ctx.index,
        settings,
        Arc::new(client),
        quic.clone(),
        stop.clone(),
    );
    tokio::pin!(served);
    let deadline = async {
        let drain = wait_shutdown(&mut stop).await;
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        () = &mut served => {}
        () = deadline => {
            listener.cut[ConnKind::Http2 as usize].fetch_add(1, Relaxed);
            quic.close(crate::front::h3::NO_ERROR, b"drain timeout");
            tracing::debug!(peer = %conn.peer, "drain timeout: HTTP/3 connection cut");
        }
    }
    drop(conn);
}
