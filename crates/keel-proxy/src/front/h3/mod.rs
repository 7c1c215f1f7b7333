//! The HTTP/3 front end: hyperium's `h3` over quinn is the codec, a task per request stream.
//! It parses and renders only: each request is handled by `front::stream`, as the HTTP/2
//! front end's are (checked, rewritten, forwarded, answered with `front::h2`'s responses:
//! keel's own answers, an endpoint's body frame by frame, the record written when it ends);
//! this module reads its stream ([`body`]) and sends the response as the client's flow
//! control takes it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use h3::error::Code;
use h3::server::RequestStream;
use http_body_util::BodyExt;
use hyper::body::Body;
use hyper::header::{HeaderValue, CONTENT_LENGTH, DATE};
use hyper::Response;
use tokio::sync::watch;

use crate::config::ListenerConfig;
use crate::exchange::request::Client;
use crate::front::h2::body::{ActiveRequest, ConnActivity, H2Body};
use crate::front::stream::handle;
use crate::state::Shared;

mod body;

use body::H3Stream;

/// HTTP/3's code for a connection or stream closed without an error.
pub(crate) const NO_ERROR: quinn::VarInt = quinn::VarInt::from_u32(0x100);

/// The sending half of a request's stream.
type SendHalf = RequestStream<h3_quinn::SendStream<Bytes>, Bytes>;

/// Serves an HTTP/3 connection (its QUIC handshake done) until it ends, stays idle too long,
/// or the proxy shuts down; then it sends GOAWAY and finishes the requests it accepted. The
/// timeouts are HTTP/2's: no request in flight for `header_read_timeout` before the first
/// request and `idle_timeout` after, a request's head not whole within `header_read_timeout`
/// of its stream (the stream is refused), a response that the client takes no byte of for
/// `client_idle_timeout` (the stream is cut). After GOAWAY the connection is closed as soon as
/// no request is left in flight (HTTP/3 refuses the later ones; the client sends them again).
pub(crate) async fn serve(
    shared: Arc<Shared>,
    index: usize,
    settings: Arc<ListenerConfig>,
    client: Arc<Client>,
    quic: quinn::Connection,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let peer = client.peer;
    let activity = Arc::new(ConnActivity::new());
    let first = settings.header_read_timeout.min(settings.idle_timeout);
    let idle = activity.idle_for(first, settings.idle_timeout, Instant::now());
    let shutdown = crate::state::wait_shutdown(&mut stop);
    tokio::pin!(idle, shutdown);
    let mut builder = h3::server::builder();
    builder.max_field_section_size(settings.max_header_bytes as u64);
    let built = builder.build::<_, Bytes>(h3_quinn::Connection::new(quic.clone()));
    let mut conn = tokio::select! {
        biased;
        c = built => match c {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%peer, "HTTP/3 client connection: {e}");
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
                Ok(Some(resolver)) => spawn_stream(&shared, index, &settings, &client, &activity, resolver),
                Ok(None) => return,
                Err(e) => {
                    if !e.is_h3_no_error() {
                        tracing::debug!(%peer, "HTTP/3 client connection: {e}");
                    }
                    return;
                }
            },
            _ = &mut shutdown => break,
            _ = &mut idle => {
                tracing::debug!(%peer, "closing an idle HTTP/3 connection (idle_timeout, or header_read_timeout before its first request)");
                break;
            }
        }
    }
    // GOAWAY: the requests accepted so far are served, later ones refused (the client may
    // send them again elsewhere). Once none is left in flight the connection is closed,
    // after a linger of a few round trips: the last response's final packets may still be on
    // their way, and a close discards what the client has not acknowledged.
    let grace = settings.header_read_timeout;
    let goaway = conn.shutdown(0);
    if !matches!(tokio::time::timeout(grace, goaway).await, Ok(Ok(()))) {
        quic.close(NO_ERROR, b"");
        return;
    }
    let linger = (quic.rtt() * 4).clamp(Duration::from_millis(100), grace);
    let quiet = activity.idle_for(linger, linger, Instant::now());
    tokio::pin!(quiet);
    loop {
        tokio::select! {
            biased;
            next = conn.accept() => match next {
                Ok(Some(resolver)) => spawn_stream(&shared, index, &settings, &client, &activity, resolver),
                _ => break,
            },
            _ = &mut quiet => break,
        }
    }
    quic.close(NO_ERROR, b"");
}

type Resolver = h3::server::RequestResolver<h3_quinn::Connection, Bytes>;

/// One request stream, in a task of its own: its head read (within `header_read_timeout`),
/// the request handled, its response sent.
fn spawn_stream(
    shared: &Arc<Shared>,
    index: usize,
    settings: &Arc<ListenerConfig>,
    client: &Arc<Client>,
    activity: &Arc<ConnActivity>,
    resolver: Resolver,
) {
    let active = ActiveRequest::new(activity);
    let (shared, settings, client) = (shared.clone(), settings.clone(), client.clone());
    // Boxed: tokio copies a task's future when it spawns it, and this one is large.
    tokio::spawn(Box::pin(async move {
        let resolved =
            tokio::time::timeout(settings.header_read_timeout, resolver.resolve_request()).await;
        let (req, stream) = match resolved {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                tracing::debug!(peer = %client.peer, "HTTP/3 request refused: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!(peer = %client.peer, "HTTP/3 request head not whole within header_read_timeout");
                return;
            }
        };
        let (mut send, recv) = stream.split();
        let (parts, ()) = req.into_parts();
        let recv = H3Stream(recv);
        let response = handle(&shared, index, &settings, &client, parts, recv, active).await;
        respond(response, &mut send, settings.client_idle_timeout).await;
    }));
}

/// Sends a response: its head (with `date` when it has none, and `content-length` when its
/// body's length is known), then its body frame by frame, each sent once the stream's flow
/// control takes the one before; a frame the client takes nothing of for `client_idle` cuts
/// the stream, and with it the body, its endpoint connection and its pick. quinn holds at
/// most the stream's window of unsent data, so a client that stops reading costs a bounded
/// amount of memory until then.
async fn respond(response: Response<H2Body>, send: &mut SendHalf, client_idle: Duration) {
    let (mut head, mut body) = response.into_parts();
    head.headers
        .entry(DATE)
        .or_insert_with(crate::codec::date_value);
    let end = body.is_end_stream();
    if !end {
        if let Some(n) = body.size_hint().exact() {
            head.headers
                .entry(CONTENT_LENGTH)
                .or_insert_with(|| HeaderValue::from(n));
        }
    }
    let cut = |send: &mut SendHalf, code: Code| send.stop_stream(code);
    let head = Response::from_parts(head, ());
    match tokio::time::timeout(client_idle, send.send_response(head)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!("HTTP/3 response head not sent: {e}");
            return;
        }
        Err(_) => return cut(send, Code::H3_REQUEST_CANCELLED),
    }
    if !end {
        loop {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(e)) => {
                    tracing::debug!("HTTP/3 response body cut: {e}");
                    return cut(send, Code::H3_INTERNAL_ERROR);
                }
            };
            match frame.into_data() {
                Ok(data) if data.is_empty() => {}
                Ok(data) => match tokio::time::timeout(client_idle, send.send_data(data)).await {
                    Ok(Ok(())) => {}
                    // The client reset or stopped the stream: the body is dropped, which ends
                    // it as the client's going.
                    Ok(Err(_)) => return,
                    Err(_) => {
                        tracing::info!("cutting an HTTP/3 response whose client took no data for {} (client_idle_timeout)", humantime::format_duration(client_idle));
                        return cut(send, Code::H3_REQUEST_CANCELLED);
                    }
                },
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let sent = tokio::time::timeout(client_idle, send.send_trailers(trailers));
                        if !matches!(sent.await, Ok(Ok(()))) {
                            return cut(send, Code::H3_REQUEST_CANCELLED);
                        }
                    }
                    break;
                }
            }
        }
    }
    drop(body);
    let _ = tokio::time::timeout(client_idle, send.finish()).await;
}
