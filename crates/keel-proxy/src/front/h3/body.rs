//! An HTTP/3 client's request stream as the shared handling (`front::stream`) reads it: the
//! receiving half of its QUIC stream, DATA by DATA, the trailers after the end.

use std::task::Poll;
use std::time::Duration;

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

    async fn start(&mut self, wait: Option<Duration>) -> Result<(bool, Option<Bytes>), Reject> {
        // Whether a body follows: HTTP/3 says so only by the stream's end, which often comes
        // with the head but may come in a later packet. What is already there is read now; a
        // stream still open has a body to stream (of unknown length unless `content-length`
        // says), or, with `wait`, is read until its end or its first data.
        let recv = &mut self.0;
        let read = match std::future::poll_fn(|cx| Poll::Ready(recv.poll_recv_data(cx))).await {
            Poll::Ready(read) => data(read),
            Poll::Pending => match wait {
                None => return Ok((false, None)),
                Some(wait) => tokio::time::timeout(wait, self.next_data())
                    .await
                    .map_err(|_| Reject::Timeout)?,
            },
        };
        Ok(match read? {
            Some(first) => (false, Some(first)),
            None => (true, None),
        })
    }

    async fn next_data(&mut self) -> Result<Option<Bytes>, Reject> {
        data(self.0.recv_data().await)
    }

    async fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        self.0.recv_trailers().await.ok().flatten()
    }

    fn pump(self, _: ::h2::SendStream<Bytes>, _: Option<Bytes>) -> Option<RequestPump> {
        None
    }
}

/// A read of the stream's DATA as the shared handling takes it: its bytes, `None` at the
/// stream's end; an error is the client's fault.
fn data<B: Buf, E>(read: Result<Option<B>, E>) -> Result<Option<Bytes>, Reject> {
    match read {
        Ok(Some(mut b)) => Ok(Some(b.copy_to_bytes(b.remaining()))),
        Ok(None) => Ok(None),
        Err(_) => Err(Reject::InvalidBody),
    }
}
