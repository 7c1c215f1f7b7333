//! The floor of bench/proxy/h2.sh: the least an HTTP/2 reverse proxy built on keel's crates
//! can cost. One thread (a current_thread runtime, as a keel worker), the `h2` crate's server
//! with keel's settings (a task per stream; FLOOR_SERVER=hyper: hyper's HTTP/2 server, which
//! keel used before), and either
//!   h2c  the `h2` crate's client, one connection per endpoint, round-robin per request,
//!        headers, body and trailers passed through both ways; or
//!   h1   hyper's HTTP/1.1 client, a pool of keep-alive connections per endpoint,
//!        round-robin per request.
//! No routing, logging, balancing or header rewriting beyond what the protocols require.
//!
//!     h2-floor LISTEN_PORT h2c|h1 PORT...
//!
//! Knobs, to see what lowers the floor (unset: hyper's / h2's defaults, with keel's values
//! where keel sets one): FLOOR_SEND_BUF, FLOOR_STREAM_WINDOW, FLOOR_CONN_WINDOW,
//! FLOOR_MAX_STREAMS, FLOOR_MAX_FRAME (either server), FLOOR_ADAPTIVE=1 (hyper's only);
//! FLOOR_UP_SEND_BUF, FLOOR_UP_STREAM_WINDOW, FLOOR_UP_CONN_WINDOW, FLOOR_UP_MAX_FRAME
//! (the h2 client); FLOOR_WRITE_BUF (bytes: each connection's writes, both sides, are
//! gathered into a buffer of that size and written at flush); FLOOR_NO_DATE=1 (no `date`;
//! the h2 server sends none).

use std::convert::Infallible;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, HOST};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// keel's allocator (crates/keel/src/main.rs): the floor is keel's crates, all of them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn knob(name: &str) -> Option<u32> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: h2-floor LISTEN_PORT h2c|h1 PORT...";
    let listen: u16 = args.next().and_then(|p| p.parse().ok()).expect(usage);
    let mode = args.next().expect(usage);
    let ports: Vec<u16> = args.map(|p| p.parse().expect(usage)).collect();
    assert!(
        !ports.is_empty() && (mode == "h2c" || mode == "h1"),
        "{usage}"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", listen))
            .await
            .expect("bind");
        let up = Arc::new(if mode == "h2c" {
            Upstream::H2(H2Endpoints::connect(&ports).await)
        } else {
            Upstream::H1(H1Endpoints::new(&ports))
        });
        let builder = Arc::new(server_builder());
        let write_buf = knob("FLOOR_WRITE_BUF");
        let hyper_server = std::env::var("FLOOR_SERVER").is_ok_and(|v| v == "hyper");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (b, up) = (builder.clone(), up.clone());
            if !hyper_server {
                tokio::spawn(raw::serve(stream, up));
                continue;
            }
            match write_buf {
                Some(cap) => tokio::spawn(serve(b, Gathered::new(stream, cap as usize), up)),
                None => tokio::spawn(serve(b, stream, up)),
            };
        }
    });
}

/// The settings keel's `front::h2::serve` uses (a timer, a header list limit of keel's
/// default `max_header_bytes`), plus the knobs.
fn server_builder() -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new()).max_header_list_size(65536);
    if let Some(n) = knob("FLOOR_SEND_BUF") {
        builder.max_send_buf_size(n as usize);
    }
    if let Some(n) = knob("FLOOR_STREAM_WINDOW") {
        builder.initial_stream_window_size(n);
    }
    if let Some(n) = knob("FLOOR_CONN_WINDOW") {
        builder.initial_connection_window_size(n);
    }
    if knob("FLOOR_ADAPTIVE") == Some(1) {
        builder.adaptive_window(true);
    }
    if let Some(n) = knob("FLOOR_MAX_STREAMS") {
        builder.max_concurrent_streams(n);
    }
    if let Some(n) = knob("FLOOR_MAX_FRAME") {
        builder.max_frame_size(n);
    }
    if knob("FLOOR_NO_DATE") == Some(1) {
        builder.auto_date_header(false);
    }
    builder
}

/// One client connection.
async fn serve<I>(
    builder: Arc<hyper::server::conn::http2::Builder<TokioExecutor>>,
    io: I,
    up: Arc<Upstream>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let up = up.clone();
        async move { Ok::<_, Infallible>(up.forward(req.map(ReqBody::Hyper)).await) }
    });
    let _ = builder.serve_connection(TokioIo::new(io), svc).await;
}

enum Upstream {
    H2(H2Endpoints),
    H1(H1Endpoints),
}

impl Upstream {
    async fn forward(&self, req: Request<ReqBody>) -> Response<FloorBody> {
        let r = match self {
            Upstream::H2(h2) => h2.forward(req).await,
            Upstream::H1(h1) => h1.forward(req).await,
        };
        r.unwrap_or_else(|()| {
            let mut r = Response::new(FloorBody::Empty);
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        })
    }
}

/// The client's request body, from either server.
enum ReqBody {
    Hyper(Incoming),
    /// h2's stream: its bytes go back to the client's window as they are taken.
    H2(h2::RecvStream),
}

impl Body for ReqBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ReqBody::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ReqBody::H2(recv) => poll_h2_frame(recv, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReqBody::Hyper(b) => b.is_end_stream(),
            ReqBody::H2(recv) => recv.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReqBody::Hyper(b) => b.size_hint(),
            ReqBody::H2(..) => SizeHint::default(),
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The next frame of an h2 stream, data then trailers. Its bytes go back to the peer's window
/// as soon as they are handed on: the server polls for more only once its own peer's window
/// has room, so the sender may send again at once.
fn poll_h2_frame(
    recv: &mut h2::RecvStream,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
    if !recv.is_end_stream() {
        match ready!(recv.poll_data(cx)) {
            Some(Ok(data)) => {
                let _ = recv.flow_control().release_capacity(data.len());
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => {}
        }
    }
    match ready!(recv.poll_trailers(cx)) {
        Ok(t) => Poll::Ready(t.map(|t| Ok(Frame::trailers(t)))),
        Err(e) => Poll::Ready(Some(Err(e.into()))),
    }
}

/// The response body: an h2 endpoint's stream, an HTTP/1.1 endpoint's body (its connection
/// goes back to the pool at the end), or nothing (502).
enum FloorBody {
    H2(h2::RecvStream),
    H1(Incoming, Option<(H1Sender, Arc<H1Endpoint>)>),
    Empty,
}

impl Body for FloorBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            FloorBody::H2(recv) => poll_h2_frame(recv, cx),
            FloorBody::H1(body, back) => {
                let r = ready!(Pin::new(&mut *body).poll_frame(cx));
                match &r {
                    Some(Ok(_)) if !body.is_end_stream() => {}
                    Some(Err(_)) => drop(back.take()),
                    _ => {
                        if let Some((sender, ep)) = back.take() {
                            ep.put(sender);
                        }
                    }
                }
                Poll::Ready(r.map(|f| f.map_err(Into::into)))
            }
            FloorBody::Empty => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            FloorBody::H2(recv) => recv.is_end_stream(),
            FloorBody::H1(body, _) => body.is_end_stream(),
            FloorBody::Empty => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            FloorBody::H2(_) => SizeHint::default(),
            FloorBody::H1(body, _) => body.size_hint(),
            FloorBody::Empty => SizeHint::with_exact(0),
        }
    }
}

// ------------------------------------------------------------------ h2c endpoints

struct H2Endpoints {
    endpoints: Vec<H2Endpoint>,
    next: AtomicUsize,
}

struct H2Endpoint {
    port: u16,
    /// The connection, replaced when it ends (a GOAWAY, a reset).
    conn: Mutex<h2::client::SendRequest<Bytes>>,
}

impl H2Endpoint {
    fn lock(&self) -> std::sync::MutexGuard<'_, h2::client::SendRequest<Bytes>> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl H2Endpoints {
    async fn connect(ports: &[u16]) -> Self {
        let mut endpoints = Vec::new();
        for &port in ports {
            let conn = connect_h2(port).await.expect("connect to an h2c endpoint");
            endpoints.push(H2Endpoint {
                port,
                conn: Mutex::new(conn),
            });
        }
        Self {
            endpoints,
            next: AtomicUsize::new(0),
        }
    }

    async fn forward(&self, req: Request<ReqBody>) -> Result<Response<FloorBody>, ()> {
        let i = self.next.fetch_add(1, Relaxed) % self.endpoints.len();
        let ep = &self.endpoints[i];
        let conn = ep.lock().clone();
        let mut send = match conn.ready().await {
            Ok(send) => send,
            Err(_) => {
                let new = connect_h2(ep.port).await.map_err(drop)?;
                *ep.lock() = new.clone();
                new.ready().await.map_err(drop)?
            }
        };
        // The h2 server already refused connection-specific headers (RFC 9113 8.2.2), and
        // its URI carries :scheme and :authority: the head goes on as it came.
        let (parts, body) = req.into_parts();
        let length = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        let head = Request::from_parts(parts, ());
        let response = if body.is_end_stream() {
            let (response, _) = send.send_request(head, true).map_err(drop)?;
            response.await.map_err(drop)?
        } else if length.is_some_and(|n| n <= INLINE) {
            // A small body is read whole and sent with its head, as keel's inline bodies are:
            // an endpoint that answers on the head alone (h2-backend) would reset the DATA
            // that came after, and hyper's server ends a connection after 1,024 such resets.
            let whole = body.collect().await.map_err(drop)?;
            let trailers = whole.trailers().cloned();
            let data = whole.to_bytes();
            let (response, mut stream) = send.send_request(head, false).map_err(drop)?;
            stream.send_data(data, trailers.is_none()).map_err(drop)?;
            if let Some(t) = trailers {
                stream.send_trailers(t).map_err(drop)?;
            }
            response.await.map_err(drop)?
        } else {
            let (response, stream) = send.send_request(head, false).map_err(drop)?;
            let mut pump = Box::pin(pump(body, stream));
            let mut response = std::pin::pin!(response);
            // A longer body (a stream) goes on in a task of its own once the response starts.
            let r = tokio::select! {
                biased;
                () = &mut pump => response.await,
                r = &mut response => {
                    tokio::spawn(pump);
                    r
                }
            };
            r.map_err(drop)?
        };
        Ok(response.map(FloorBody::H2))
    }
}

/// A connection to an h2c endpoint, with keel's windows (upstream/h2_conns.rs) unless a knob
/// says; its frames are read and written by a task of its own, as keel's are.
async fn connect_h2(port: u16) -> io::Result<h2::client::SendRequest<Bytes>> {
    let stream = TcpStream::connect(("127.0.0.1", port)).await?;
    stream.set_nodelay(true)?;
    let mut b = h2::client::Builder::new();
    b.initial_window_size(knob("FLOOR_UP_STREAM_WINDOW").unwrap_or(1 << 20))
        .initial_connection_window_size(knob("FLOOR_UP_CONN_WINDOW").unwrap_or(4 << 20));
    if let Some(n) = knob("FLOOR_UP_SEND_BUF") {
        b.max_send_buffer_size(n as usize);
    }
    if let Some(n) = knob("FLOOR_UP_MAX_FRAME") {
        b.max_frame_size(n);
    }
    match knob("FLOOR_WRITE_BUF") {
        Some(cap) => handshake(&b, Gathered::new(stream, cap as usize)).await,
        None => handshake(&b, stream).await,
    }
}

async fn handshake<T>(b: &h2::client::Builder, io: T) -> io::Result<h2::client::SendRequest<Bytes>>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = b
        .handshake::<_, Bytes>(io)
        .await
        .map_err(io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

/// The largest body read whole and sent with its head: within h2's initial stream window.
const INLINE: usize = 65_535;

/// The client's request body to the endpoint, frame by frame, within the stream's window.
async fn pump(mut body: ReqBody, mut send: h2::SendStream<Bytes>) {
    loop {
        match body.frame().await {
            None => {
                let _ = send.send_data(Bytes::new(), true);
                return;
            }
            Some(Err(_)) => {
                send.send_reset(h2::Reason::CANCEL);
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    while data.has_remaining() {
                        send.reserve_capacity(data.len());
                        let n = match poll_fn(|cx| send.poll_capacity(cx)).await {
                            Some(Ok(n)) => n.min(data.len()),
                            _ => return,
                        };
                        let piece = data.split_to(n);
                        let end = !data.has_remaining() && body.is_end_stream();
                        if send.send_data(piece, end).is_err() {
                            return;
                        }
                        if end {
                            return;
                        }
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let _ = send.send_trailers(trailers);
                    }
                    return;
                }
            },
        }
    }
}

/// A socket whose writes are gathered into one buffer and written at flush (h2 flushes
/// after each round of frames): the FLOOR_WRITE_BUF knob.
struct Gathered {
    io: TcpStream,
    buf: Vec<u8>,
    cap: usize,
}

impl Gathered {
    fn new(io: TcpStream, cap: usize) -> Self {
        Self {
            io,
            buf: Vec::with_capacity(cap),
            cap,
        }
    }

    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.buf.is_empty() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.buf))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.buf.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Gathered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Gathered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.buf.len() + data.len() > this.cap {
            ready!(this.poll_drain(cx))?;
        }
        let n = data.len().min(this.cap.max(1));
        this.buf.extend_from_slice(&data[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

// ------------------------------------------------------------------ HTTP/1.1 endpoints

type H1Sender = hyper::client::conn::http1::SendRequest<ReqBody>;

struct H1Endpoint {
    port: u16,
    /// Idle keep-alive connections, the last used first.
    idle: Mutex<Vec<H1Sender>>,
}

/// Idle connections kept per endpoint: enough for h2.sh's 160 streams over four endpoints.
const H1_IDLE: usize = 64;

impl H1Endpoint {
    fn take(&self) -> Option<H1Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(s) = idle.pop() {
            if !s.is_closed() {
                return Some(s);
            }
        }
        None
    }

    fn put(&self, sender: H1Sender) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < H1_IDLE {
            idle.push(sender);
        }
    }

    async fn connect(&self) -> Option<H1Sender> {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).await.ok()?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Some(sender)
    }
}

struct H1Endpoints {
    endpoints: Vec<Arc<H1Endpoint>>,
    next: AtomicUsize,
}

impl H1Endpoints {
    fn new(ports: &[u16]) -> Self {
        Self {
            endpoints: ports
                .iter()
                .map(|&port| {
                    Arc::new(H1Endpoint {
                        port,
                        idle: Mutex::new(Vec::new()),
                    })
                })
                .collect(),
            next: AtomicUsize::new(0),
        }
    }

    async fn forward(&self, req: Request<ReqBody>) -> Result<Response<FloorBody>, ()> {
        let i = self.next.fetch_add(1, Relaxed) % self.endpoints.len();
        let ep = &self.endpoints[i];
        let mut sender = match ep.take() {
            Some(s) => s,
            None => ep.connect().await.ok_or(())?,
        };
        // A connection handed back at its body's end may not have seen the end yet.
        sender.ready().await.map_err(drop)?;
        // HTTP/1.1 wants `host` and an origin-form target; :authority gives the first.
        let (mut parts, body) = req.into_parts();
        if let Some(a) = parts.uri.authority() {
            if !parts.headers.contains_key(HOST) {
                let host = HeaderValue::from_str(a.as_str()).map_err(drop)?;
                parts.headers.insert(HOST, host);
            }
        }
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = path.parse().map_err(drop)?;
        let response = sender
            .send_request(Request::from_parts(parts, body))
            .await
            .map_err(drop)?;
        // hyper's HTTP/2 server drops the connection-specific headers of the response.
        let (parts, body) = response.into_parts();
        let back = if body.is_end_stream() {
            // hyper will not poll an empty body: the connection is free now.
            ep.put(sender);
            None
        } else {
            Some((sender, ep.clone()))
        };
        Ok(Response::from_parts(parts, FloorBody::H1(body, back)))
    }
}

// ------------------------------------------------------------------ the h2 server

/// The `h2` crate's server, as keel's front end uses it: a task per stream, the response's
/// body sent as the client's window takes it, a stream reset by the client dropped.
mod raw {
    use super::*;
    use h2::server::SendResponse;

    pub(super) async fn serve(io: TcpStream, up: Arc<Upstream>) {
        let mut b = h2::server::Builder::new();
        // keel's settings (front/h2/mod.rs: hyper's server defaults, keel's header limit).
        b.initial_window_size(knob("FLOOR_STREAM_WINDOW").unwrap_or(1 << 20))
            .initial_connection_window_size(knob("FLOOR_CONN_WINDOW").unwrap_or(1 << 20))
            .max_frame_size(knob("FLOOR_MAX_FRAME").unwrap_or(16 * 1024))
            .max_concurrent_streams(knob("FLOOR_MAX_STREAMS").unwrap_or(200))
            .max_send_buffer_size(knob("FLOOR_SEND_BUF").map_or(400 * 1024, |n| n as usize))
            .max_local_error_reset_streams(Some(1024))
            .max_header_list_size(65536);
        let Ok(mut conn) = b.handshake::<_, Bytes>(io).await else {
            return;
        };
        while let Some(Ok((req, respond))) = conn.accept().await {
            let up = up.clone();
            tokio::spawn(async move {
                let req = req.map(ReqBody::H2);
                stream(Box::pin(async move { up.forward(req).await }), respond).await
            });
        }
    }

    async fn stream<F>(mut forward: Pin<Box<F>>, mut respond: SendResponse<Bytes>)
    where
        F: std::future::Future<Output = Response<FloorBody>>,
    {
        let answered = poll_fn(|cx| {
            if let Poll::Ready(r) = forward.as_mut().poll(cx) {
                return Poll::Ready(Some(r));
            }
            respond.poll_reset(cx).map(|_| None)
        })
        .await;
        drop(forward);
        let Some(response) = answered else { return };
        let (mut parts, mut body) = response.into_parts();
        // An HTTP/1.1 endpoint's connection-specific headers (RFC 9113 section 8.2.2).
        for name in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "upgrade",
            "te",
        ] {
            parts.headers.remove(name);
        }
        let end = body.is_end_stream();
        let Ok(mut send) = respond.send_response(Response::from_parts(parts, ()), end) else {
            respond.send_reset(h2::Reason::INTERNAL_ERROR);
            return;
        };
        if end {
            return;
        }
        loop {
            let frame = match poll_fn(|cx| {
                if send.poll_reset(cx).is_ready() {
                    return Poll::Ready(None);
                }
                Pin::new(&mut body).poll_frame(cx)
            })
            .await
            {
                None => {
                    let _ = send.send_data(Bytes::new(), true);
                    return;
                }
                Some(Err(_)) => {
                    send.send_reset(h2::Reason::INTERNAL_ERROR);
                    return;
                }
                Some(Ok(frame)) => frame,
            };
            match frame.into_data() {
                Ok(data) => {
                    let last = body.is_end_stream();
                    if !data.is_empty() {
                        send.reserve_capacity(1);
                        while send.capacity() == 0 {
                            match poll_fn(|cx| send.poll_capacity(cx)).await {
                                Some(Ok(_)) => {}
                                _ => return,
                            }
                        }
                    }
                    if send.send_data(data, last).is_err() || last {
                        return;
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        let _ = send.send_trailers(t);
                    }
                    return;
                }
            }
        }
    }
}
