//! A response on its way to an HTTP/2 client: the head (with `date` when it has none, and
//! `content-length` when its body's length is known), then the body frame by frame, each
//! frame taken from the body only once the stream's window has room for the one before (the
//! connection's stall watch counts on it: see `ConnActivity`). A client that resets its
//! stream ends the request there: the attempt, or the body and with it its endpoint's pick.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use h2::server::SendResponse;
use h2::{Reason, SendStream};
use hyper::body::Body;
use hyper::header::HeaderValue;
use hyper::header::{CONTENT_LENGTH, DATE};
use hyper::Response;

use super::body::H2Body;

/// Serves one stream: the request until it is answered or the client resets the stream (or
/// the connection ends: then the request is dropped, which cancels its attempt), then the
/// answer. A hand-written future: tokio copies a task's future three times per stream, and
/// an `async fn` would hold the response, the body and its sending each in a slot of its own.
pub(crate) struct Respond<F> {
    reply: SendResponse<Bytes>,
    state: State<F>,
}

enum State<F> {
    Serving(Pin<Box<F>>),
    Body(Pipe),
    Done,
}

/// A body on its way, and a frame that waits for window (the body is not asked for more
/// meanwhile).
struct Pipe {
    body: H2Body,
    send: SendStream<Bytes>,
    waiting: Option<(Bytes, bool)>,
}

impl<F> Respond<F> {
    pub(crate) fn new(handled: Pin<Box<F>>, reply: SendResponse<Bytes>) -> Self {
        Self {
            reply,
            state: State::Serving(handled),
        }
    }
}

impl<F: Future<Output = Response<H2Body>>> Future for Respond<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if let State::Serving(handled) = &mut this.state {
            let response = match handled.as_mut().poll(cx) {
                Poll::Ready(r) => r,
                Poll::Pending => {
                    if this.reply.poll_reset(cx).is_ready() {
                        this.state = State::Done;
                        return Poll::Ready(());
                    }
                    return Poll::Pending;
                }
            };
            this.state = match send_head(response, &mut this.reply) {
                Some(pipe) => State::Body(pipe),
                None => State::Done,
            };
        }
        match &mut this.state {
            State::Body(pipe) => pipe.poll(cx),
            _ => Poll::Ready(()),
        }
    }
}

/// Sends the head; returns the body's sending unless the head ended the stream.
fn send_head(response: Response<H2Body>, reply: &mut SendResponse<Bytes>) -> Option<Pipe> {
    let (mut head, body) = response.into_parts();
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
    // keel's heads carry no connection-specific header (the legs drop them, and the
    // configuration refuses edits of them); h2 refuses a head that would.
    match reply.send_response(Response::from_parts(head, ()), end) {
        Ok(send) => (!end).then_some(Pipe {
            body,
            send,
            waiting: None,
        }),
        Err(e) => {
            tracing::debug!("HTTP/2 response head not sent: {e}");
            reply.send_reset(Reason::INTERNAL_ERROR);
            None
        }
    }
}

impl Pipe {
    /// Ready when the body is sent, failed (the stream is reset), or the client reset the
    /// stream.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Pipe {
            body,
            send,
            waiting,
        } = self;
        loop {
            if send.poll_reset(cx).is_ready() {
                return Poll::Ready(());
            }
            if let Some((data, last)) = waiting.take() {
                while send.capacity() == 0 {
                    match send.poll_capacity(cx) {
                        Poll::Pending => {
                            *waiting = Some((data, last));
                            return Poll::Pending;
                        }
                        Poll::Ready(Some(Ok(0))) => {}
                        Poll::Ready(Some(Ok(_))) => break,
                        Poll::Ready(_) => return Poll::Ready(()),
                    }
                }
                match send.send_data(data, last) {
                    Err(_) => return Poll::Ready(()),
                    Ok(()) if last => {
                        // The body said this frame was its last, and now the client has it:
                        // asked once more, the body answers its end at once, which finishes
                        // the pick and writes the record (as the empty frame's turn did).
                        let _ = Pin::new(&mut *body).poll_frame(cx);
                        return Poll::Ready(());
                    }
                    Ok(()) => continue,
                }
            }
            match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    let _ = send.send_data(Bytes::new(), true);
                    return Poll::Ready(());
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::debug!("HTTP/2 response body cut: {e}");
                    send.send_reset(Reason::INTERNAL_ERROR);
                    return Poll::Ready(());
                }
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let last = body.is_end_stream();
                        if data.is_empty() {
                            if last {
                                let _ = send.send_data(data, true);
                                return Poll::Ready(());
                            }
                            continue;
                        }
                        send.reserve_capacity(1);
                        *waiting = Some((data, last));
                    }
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            send.reserve_capacity(0);
                            let _ = send.send_trailers(trailers);
                        }
                        return Poll::Ready(());
                    }
                },
            }
        }
    }
}
