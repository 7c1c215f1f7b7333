//! An HTTP/3 client's request stream as the shared handling (`front::stream`) reads it: the
//! receiving half of its QUIC stream, DATA by DATA, the trailers after the end.

use std::task::Poll;

use bytes::{Buf, Bytes};
use h3::server::RequestStream;

use crate::exchange::request::Reject;
use crate::front::stream::ClientStream;
use crate::leg::h2::RequestPump;

/// The receiving half of a request's stream.
pub(crate) type RecvHalf = RequestStream<h3_quinn::RecvStream, Bytes>;

/// A request's stream, read by the shared handling.
pub(crate) struct H3Stream(pub(crate) RecvHalf);

impl ClientStream for H3Stream {
    const PROTOCOL: &'static str = "HTTP/3.0";
    /// An HTTP/3 client's body is sent whole before the response.
    const FULL_DUPLEX: bool = false;

    async fn start(&mut self) -> Result<(bool, Option<Bytes>), Reject> {
        // Whether a body follows: HTTP/3 says so only by the stream's end, which usually
        // comes with the head. What is already there is read now; a stream still open has a
        // body to stream (of unknown length unless `content-length` says).
        let recv = &mut self.0;
        match std::future::poll_fn(|cx| Poll::Ready(recv.poll_recv_data(cx))).await {
            Poll::Ready(Ok(Some(mut buf))) => Ok((false, Some(buf.copy_to_bytes(buf.remaining())))),
            Poll::Ready(Ok(None)) => Ok((true, None)),
            Poll::Ready(Err(_)) => Err(Reject::InvalidBody),
            Poll::Pending => Ok((false, None)),
        }
    }

    async fn next_data(&mut self) -> Result<Option<Bytes>, Reject> {
        match self.0.recv_data().await {
            Ok(Some(mut buf)) => Ok(Some(buf.copy_to_bytes(buf.remaining()))),
            Ok(None) => Ok(None),
            Err(_) => Err(Reject::InvalidBody),
        }
    }

    async fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        self.0.recv_trailers().await.ok().flatten()
    }

    fn pump(self, _: ::h2::SendStream<Bytes>, _: Option<Bytes>) -> Option<RequestPump> {
        None
    }
}
