//! A small h2c (HTTP/2 with prior knowledge) backend for bench/proxy/h2.sh: every request gets a
//! 13-byte body, except gRPC calls (`content-type: application/grpc*`), which get a
//! `grpc.health.v1.HealthCheckResponse { status: SERVING }` message and `grpc-status: 0` in the
//! trailers, as a gRPC server answers a unary call. Each request's body is read to its end
//! before the answer (as a gRPC server reads a unary call's message before it runs the call).
//!
//!     h2-backend PORT

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::Frame;
use hyper::{HeaderMap, Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

fn main() {
    let port: u16 = std::env::args()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("usage: h2-backend PORT");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async move {
                        let grpc = req
                            .headers()
                            .get("content-type")
                            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
                        // An answer that ends the stream before the request's body has ended
                        // makes h2 reset the stream (RST_STREAM NO_ERROR) under DATA still on
                        // its way; under load NGINX's grpc_pass then logs `upstream rejected
                        // request with error 5` and marks the endpoint down. Frames are dropped
                        // as they come (nothing kept); a body already ended costs nothing.
                        let mut body = req.into_body();
                        while let Some(Ok(_)) = body.frame().await {}
                        if !grpc {
                            return Ok::<_, Infallible>(Response::new(Either::Left(Full::new(
                                Bytes::from_static(b"backend: ok\n\n"),
                            ))));
                        }
                        let mut trailers = HeaderMap::new();
                        trailers.insert("grpc-status", "0".parse().expect("value"));
                        let frames = [
                            Ok::<_, Infallible>(Frame::data(Bytes::from_static(&[
                                0, 0, 0, 0, 2, 0x08, 0x01,
                            ]))),
                            Ok(Frame::trailers(trailers)),
                        ];
                        let mut r = Response::new(Either::Right(StreamBody::new(
                            futures_lite_iter(frames),
                        )));
                        r.headers_mut()
                            .insert("content-type", "application/grpc".parse().expect("value"));
                        Ok(r)
                    });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(1000)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

/// The frames as a stream.
fn futures_lite_iter<const N: usize>(
    frames: [Result<Frame<Bytes>, Infallible>; N],
) -> tokio_stream::Iter<std::array::IntoIter<Result<Frame<Bytes>, Infallible>, N>> {
    tokio_stream::iter(frames)
}
