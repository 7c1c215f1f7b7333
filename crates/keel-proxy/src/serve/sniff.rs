//! Which front end serves an accepted connection: TLS and ALPN, HTTP/2's preface on plain
//! TCP, or a TCP listener's tunnel.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::exchange::request::Client;
use crate::front::h1;
use crate::state::{mark_connection, ConnKind, ListenerCtx, ListenerSlot, Shared};

/// Serves one accepted connection: TLS handshake if the listener has TLS, then keel's
/// HTTP/1.1 front end, or the HTTP/2 one (ALPN `h2`, or HTTP/2's preface on plain TCP), or
/// for a TCP listener a tunnel to one endpoint. All hand their requests (or the connection)
/// to the same attempt driver.
///
/// Each front end's future but plain HTTP/1.1's is boxed: this future would otherwise be as
/// large as the largest of them (HTTP/1.1 over TLS), and a connection holds it for its whole
/// life: plain HTTP/1.1 connections held 14 KB where they need 7 (BENCHMARKS.md, 4,000
/// connections). An `async` block, not an `async fn`, for the same reason: an `async fn` holds
/// each argument twice, as given and as moved into its body.
#[allow(clippy::manual_async_fn)] // the async block is the point (see above)
pub(crate) fn serve_accepted<'a>(
    shared: Arc<Shared>,
    ctx: &'a ListenerCtx,
    listener: &'a ListenerSlot,
    worker: usize,
    mut stream: TcpStream,
    peer: SocketAddr,
    stop: watch::Receiver<Option<Duration>>,
) -> impl Future<Output = ()> + 'a {
    async move {
        let index = ctx.index;
        let settings = &ctx.settings;
        // Of the peer's family (see the accept loop), for a PROXY protocol header.
        let local = stream
            .local_addr()
            .map_or(peer, |a| SocketAddr::new(a.ip().to_canonical(), a.port()));
        // Behind a proxy that sends a PROXY header, the client is the one it names, for every
        // use below (allow/deny, rate limits, X-Forwarded-For, the access log, a PROXY header
        // sent on); it comes before anything else, TLS included.
        let (peer, local) = if settings.proxy_protocol {
            match Box::pin(crate::serve::proxy_header::accept(
                &mut stream,
                peer,
                local,
                settings,
                listener,
            ))
            .await
            {
                Some(addresses) => addresses,
                None => return,
            }
        } else {
            (peer, local)
        };
        let tcp = settings.protocol == crate::config::ListenerProtocol::Tcp;
        if let Some(access) = &ctx.tcp_access {
            if !access.permits(peer.ip()) {
                // A TCP listener has no request to answer 403 to: the connection is closed.
                let routing = shared.routing.load();
                if let Some(t) = routing
                    .listeners
                    .get(index)
                    .and_then(|r| r.target(crate::route::RouteRef::Listener))
                {
                    t.cluster.metrics.access_denied.fetch_add(1, Relaxed);
                }
                tracing::debug!(%peer, "connection refused by the listener's allow/deny");
                return;
            }
        }
        // The client made where it is handed on: a local moved into the front end would keep
        // its room in this future beside the front end's copy.
        if tcp && ctx.tls.is_none() {
            mark_connection(ConnKind::Tunnel);
            let client = ctx.client(peer, worker);
            Box::pin(crate::front::tcp::serve(
                shared, index, settings, &client, local, stream,
            ))
            .await;
            return;
        }
        let Some(acceptor) = &ctx.tls else {
            serve_http1(shared, ctx, ctx.client(peer, worker), stream, stop).await;
            return;
        };
        // Boxed: a TLS stream and its handshake are large, and a plain connection's future
        // would otherwise hold room for them (4,000 waiting connections held 8.9 KB each in all).
        Box::pin(serve_tls(
            shared,
            ctx,
            listener,
            acceptor,
            ctx.client(peer, worker),
            stream,
            peer,
            local,
            stop,
        ))
        .await;
    }
}

/// The TLS handshake, then the TCP listener's tunnel, or HTTP/2 (ALPN `h2`), or HTTP/1.1.
#[allow(clippy::too_many_arguments)]
async fn serve_tls(
    shared: Arc<Shared>,
    ctx: &ListenerCtx,
    listener: &ListenerSlot,
    acceptor: &tokio_rustls::TlsAcceptor,
    mut client: Client,
    stream: TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    stop: watch::Receiver<Option<Duration>>,
) {
    let index = ctx.index;
    let settings = &ctx.settings;
    let tcp = settings.protocol == crate::config::ListenerProtocol::Tcp;
    // Here, not in the accept loop: a slow or silent client delays only itself.
    // The header-read timeout bounds the handshake, so it cannot hold a slot. A drain does
    // not cut it: with TLS 1.3 the client has finished its side and may have sent requests
    // already; the connection is then served as draining (answers say `Connection: close`,
    // HTTP/2 gets a GOAWAY), and the drain's own timeout still bounds it.
    let handshake_timeout = settings.header_read_timeout;
    let handshake = Box::pin(tokio::time::timeout(
        handshake_timeout,
        acceptor.accept(stream),
    ))
    .await;
    let cause = match handshake {
        Ok(Ok(tls_stream)) if tcp => {
            mark_connection(ConnKind::Tunnel);
            Box::pin(crate::front::tcp::serve(
                shared, index, settings, &client, local, tls_stream,
            ))
            .await;
            return;
        }
        Ok(Ok(tls_stream)) => {
            // Only a listener with `client_ca` asks for one; rustls has verified it.
            if let Some(leaf) = tls_stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
            {
                client.client_cert = crate::tls::ClientCert::of(leaf).map(Arc::new);
            }
            let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2);
            if h2 {
                mark_connection(ConnKind::Http2);
                Box::pin(crate::front::h2::serve(
                    shared,
                    index,
                    settings.clone(),
                    Arc::new(client),
                    tls_stream,
                    stop,
                ))
                .await;
                return;
            }
            serve_http1(shared, ctx, client, tls_stream, stop).await;
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!(
            "not finished within {}",
            humantime::format_duration(handshake_timeout)
        ),
    };
    listener.tls_handshake_failures.fetch_add(1, Relaxed);
    tracing::debug!(%peer, "TLS handshake failed: {cause}");
}

/// keel's HTTP/1.1 front end on a connection; the HTTP/2 one takes it over if the client sends
/// HTTP/2's preface (prior knowledge), with the bytes read so far. (An `async` block: see
/// [`serve_accepted`].)
#[allow(clippy::manual_async_fn)] // the async block is the point (see above)
fn serve_http1<'a, S>(
    shared: Arc<Shared>,
    ctx: &'a ListenerCtx,
    client: Client,
    stream: S,
    stop: watch::Receiver<Option<Duration>>,
) -> impl Future<Output = ()> + 'a
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    async move {
        mark_connection(ConnKind::Http1);
        let settings = &ctx.settings;
        let served = Box::pin(h1::conn::serve(
            shared.clone(),
            ctx.index,
            settings,
            &client,
            stream,
            stop.clone(),
        ))
        .await;
        if let h1::conn::Served::Http2(stream, read) = served {
            mark_connection(ConnKind::Http2);
            let io = crate::front::h2::Prefixed::new(read, stream);
            Box::pin(crate::front::h2::serve(
                shared,
                ctx.index,
                settings.clone(),
                Arc::new(client),
                io,
                stop,
            ))
            .await;
        }
    }
}

#[cfg(test)]
mod tests {
    /// Sizes of the front ends' futures a connection's task holds inline (run with
    /// `--nocapture`).
    #[test]
    fn front_end_sizes() {
        let http1 = crate::future_size::returned(super::serve_http1::<tokio::net::TcpStream>);
        eprintln!("sizes: serve_http1 {http1} B");
    }
}
