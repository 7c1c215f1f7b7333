//! The HTTP/2 front end: the `h2` crate's server is the codec, a task per stream. Each
//! request is handled by `front::stream` (as HTTP/3's are): its head checked and rewritten
//! by the same rules as an HTTP/1.1 one (`crate::exchange::rewrite`), in the form its
//! endpoint's leg sends, and handed to the same attempt driver; `send` writes the response.
//! An HTTP/1.1 endpoint's response head is read into a header map, and its body is read from
//! the endpoint's connection as the client's window takes it; an HTTP/2 endpoint's response
//! passes frame by frame, trailers included, with the rest of a full-duplex request body sent
//! alongside. keel's own answers to gRPC calls are gRPC statuses (HTTP 200, trailers-only).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use crate::config::ListenerConfig;
use crate::exchange::request::{Client, Reject};
use crate::front::stream::{handle, ClientStream};
use crate::leg::h2::{RecvBody, RequestPump};
use crate::state::Shared;

pub(crate) mod answer;
mod blocks;
pub(crate) mod body;
pub(crate) mod log;
mod send;

use body::{ActiveRequest, ConnActivity};

/// Serves an HTTP/2 connection (TLS with ALPN `h2`, or plain with prior knowledge) until it
/// ends, stays idle too long, or the proxy shuts down (then it finishes its requests).
/// Only requests count as activity: a connection with none in flight is idle, whatever
/// other frames (PING, SETTINGS, WINDOW_UPDATE, a header block not finished) it sends. Until
/// its first request it may stay idle for `header_read_timeout` at most (the wait an
/// HTTP/1.1 connection has for its first byte), then `idle_timeout` between requests; a
/// header block left open is cut at `header_read_timeout` ([`blocks`]). After its GOAWAY, a
/// connection with no request in flight is closed `header_read_timeout` later, whether or
/// not the client answered the GOAWAY's PING or closed its side.
pub(crate) async fn serve<I>(
    shared: Arc<Shared>,
    index: usize,
    settings: Arc<ListenerConfig>,
    client: Arc<Client>,
    io: I,
    mut stop: watch::Receiver<Option<Duration>>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Arc::new(ConnActivity::new());
    let peer = client.peer;
    let first = settings.header_read_timeout.min(settings.idle_timeout);
    let idle = activity.idle_for(first, settings.idle_timeout, Instant::now());
    let stalled = activity.stalled_for(settings.client_idle_timeout);
    let shutdown = crate::state::wait_shutdown(&mut stop);
    tokio::pin!(idle, stalled, shutdown);
    let io = blocks::HeaderBlocks::new(io, settings.header_read_timeout);
    let handshake = builder(&settings).handshake::<_, Bytes>(io);
    let mut conn = tokio::select! {
        biased;
        r = handshake => match r {
            Ok(conn) => conn,
            Err(e) => {
                tracing::debug!(%peer, "HTTP/2 client connection: {e}");
                return;
            }
        },
        _ = &mut shutdown => return,
        _ = &mut idle => return,
    };
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Some(Ok((req, reply))) => spawn_stream(&shared, index, &settings, &client, &activity, req, reply),
                Some(Err(e)) => {
                    tracing::debug!(%peer, "HTTP/2 client connection: {e}");
                    return;
                }
                None => return,
            },
            _ = &mut shutdown => break,
            _ = &mut idle => {
                tracing::debug!(%peer, "closing an idle HTTP/2 connection (idle_timeout, or header_read_timeout before its first request)");
                break;
            }
            _ = &mut stalled => {
                // No single stream is reset: the connection goes, and with it every stream,
                // its endpoint connection and its slots.
                tracing::info!(%peer, "closing an HTTP/2 connection whose client took no response data for {} (client_idle_timeout)", humantime::format_duration(settings.client_idle_timeout));
                return;
            }
        }
    }
    // GOAWAY; the streams the client opened before it saw it are still served. `h2` sends
    // the last GOAWAY once the client answers its PING, then closes when no stream is left;
    // a client that never answers would keep the connection, so it is closed once it has had
    // no request in flight for `header_read_timeout` since the GOAWAY.
    conn.graceful_shutdown();
    let grace = settings.header_read_timeout;
    let quiet = activity.idle_for(grace, grace, Instant::now());
    tokio::pin!(quiet);
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Some(Ok((req, reply))) => spawn_stream(&shared, index, &settings, &client, &activity, req, reply),
                _ => return,
            },
            _ = &mut quiet => {
                tracing::debug!(%peer, "closing an HTTP/2 connection {} after its GOAWAY", humantime::format_duration(grace));
                return;
            }
        }
    }
}

/// One stream, in a task of its own: the request handled, its response sent.
fn spawn_stream(
    shared: &Arc<Shared>,
    index: usize,
    settings: &Arc<ListenerConfig>,
    client: &Arc<Client>,
    activity: &Arc<ConnActivity>,
    req: hyper::Request<h2::RecvStream>,
    reply: h2::server::SendResponse<Bytes>,
) {
    let active = ActiveRequest::new(activity);
    let (shared, settings, client) = (shared.clone(), settings.clone(), client.clone());
    // Boxed: tokio copies a task's future when it spawns it, and this one is large.
    let handled = Box::pin(async move {
        let (parts, body) = req.into_parts();
        let stream = H2Stream {
            body: RecvBody::new(body),
            trailers: None,
        };
        handle(&shared, index, &settings, &client, parts, stream, active).await
    });
    tokio::spawn(send::Respond::new(handled, reply));
}

/// An HTTP/2 request's stream as the shared handling reads it: its body's frames as h2
/// hands them over, the trailers kept until the data ends.
struct H2Stream {
    body: RecvBody,
    trailers: Option<hyper::HeaderMap>,
}

impl ClientStream for H2Stream {
    const PROTOCOL: &'static str = "HTTP/2.0";
    const FULL_DUPLEX: bool = true;

    async fn start(&mut self, _: Option<Duration>) -> Result<(bool, Option<Bytes>), Reject> {
        // h2 knows from the head's END_STREAM flag.
        Ok((self.body.is_end_stream(), None))
    }

    async fn next_data(&mut self) -> Result<Option<Bytes>, Reject> {
        match self.body.frame().await {
            None => Ok(None),
            Some(Err(_)) => Err(Reject::InvalidBody),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => Ok(Some(data)),
                Err(frame) => {
                    self.trailers = frame.into_trailers().ok();
                    Ok(Some(Bytes::new()))
                }
            },
        }
    }

    async fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        self.trailers.take()
    }

    fn pump(self, send: h2::SendStream<Bytes>, pending: Option<Bytes>) -> Option<RequestPump> {
        Some(RequestPump::new((send, pending), self.body))
    }
}

/// The connection's settings: hyper's server defaults (its windows of 1 MiB, 200 streams,
/// a send buffer of 400 KiB per stream, 1,024 locally caused resets before GOAWAY), and the
/// listener's header list limit.
fn builder(settings: &ListenerConfig) -> h2::server::Builder {
    let mut b = h2::server::Builder::new();
    b.initial_window_size(1 << 20)
        .initial_connection_window_size(1 << 20)
        .max_frame_size(16 * 1024)
        .max_concurrent_streams(200)
        .max_send_buffer_size(400 * 1024)
        .max_local_error_reset_streams(Some(1024))
        .max_header_list_size(settings.max_header_bytes.min(u32::MAX as usize) as u32);
    b
}

/// A stream whose first bytes were already read (by the HTTP/1.1 front end, which found
/// HTTP/2's preface): they are read again first.
pub(crate) struct Prefixed<S> {
    prefix: BytesMut,
    inner: S,
}

impl<S> Prefixed<S> {
    /// `prefix` comes out of reads before `inner`'s bytes.
    pub(crate) fn new(prefix: BytesMut, inner: S) -> Self {
        Self { prefix, inner }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
