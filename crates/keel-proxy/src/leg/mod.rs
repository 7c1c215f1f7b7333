//! The legs: one try of a request on one endpoint, in the endpoint's protocol. HTTP/1.1
//! ([`h1`], keel's pool), HTTP/2 and h2c ([`h2`], multiplexed), and the byte tunnel of
//! upgrades and TCP listeners ([`tunnel`]).

pub(crate) mod h1;
pub(crate) mod h2;
pub(crate) mod tcp;
pub(crate) mod tunnel;

use std::pin::Pin;
use std::time::Instant;

use hyper::http::request::Parts;
use keel_balance::EndpointId;
use tokio::time::Sleep;

use crate::codec::head::header_value;
use crate::codec::response::{Framing, ResponseHead};
use crate::config::UpstreamProtocol;
use crate::driver::answer::Answer;
use crate::driver::leg::{Leg, Race, Tried, TryResult};
use crate::exchange::error::{Cause, ErrorKind, TryError, TryFailure};
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{BodyFraming, Reject, RequestBody, RequestHead};
use crate::exchange::response::{Edit, ResponseHeaders};
use crate::exchange::trace::TraceParent;
use crate::leg::h1::body::H1Body;
use crate::leg::h1::upstream::H1Response;
use crate::leg::h2::H2Response;
use crate::policy::compress::{weak_etag, Compressing, Compression, Offer, Vary};
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::pool::RawConn;

/// What the HTTP legs answer with, as the front ends render it.
pub(crate) type HttpAnswer = Answer<UpstreamResponse>;

/// An endpoint's response, as its leg read it. HTTP/1.1's is kept unboxed: it is the common
/// answer, and a box would be an allocation per request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum UpstreamResponse {
    /// HTTP/1.1: the connection with what was read of the body, and the head (rewritten
    /// into the front end's buffer). A `101` to an upgrade request makes a tunnel.
    H1(RawConn, ResponseHead),
    /// HTTP/2: the head, the body stream (trailers included) and the request's stream.
    H2(Box<H2Response>),
    /// Either of the above as status, headers and a transformed body (compressed, say).
    Transformed(Box<(ResponseParts, ResponseBody)>),
}

/// A response's status and headers.
type ResponseParts = hyper::http::response::Parts;

impl UpstreamResponse {
    /// Waits until the body has begun: an HTTP/1.1 endpoint's first byte after the head is
    /// read into the connection's buffer (where the body's reader and the relay take it
    /// first). A body that cannot have bytes (none, or of length 0) has begun; so has an
    /// HTTP/2 endpoint's, which is not awaited. The failure if the endpoint closes or fails
    /// first.
    pub(crate) async fn first_byte(&mut self) -> Result<(), TryError> {
        let UpstreamResponse::H1(conn, head) = self else {
            return Ok(());
        };
        if matches!(head.framing, Framing::Empty | Framing::Length(0)) || !conn.buf.is_empty() {
            return Ok(());
        }
        conn.buf.reserve(4096);
        let failed = |cause| Err(TryError::after_sending(ErrorKind::Reset, cause));
        match tokio::io::AsyncReadExt::read_buf(&mut conn.io, &mut conn.buf).await {
            Ok(0) => failed(Cause::ClosedEarly),
            Ok(_) => Ok(()),
            Err(e) => failed(Cause::Read(e)),
        }
    }

    /// The response's status code.
    pub fn status(&self) -> u16 {
        match self {
            UpstreamResponse::H1(_, head) => head.status,
            UpstreamResponse::H2(r) => r.head.status.as_u16(),
            UpstreamResponse::Transformed(t) => t.0.status.as_u16(),
        }
    }

    /// The response phase of `compression`: a response it applies to gets `Vary:
    /// Accept-Encoding`, and when the request's `offer` names a coding, its body compressed
    /// as it streams (for both front ends alike), `Content-Length` and `Accept-Ranges`
    /// dropped, its `ETag` weakened. `out`: an HTTP/1.1 endpoint's head, as [`Self::headers_mut`].
    pub fn compress(self, out: &mut Vec<u8>, c: &Compression, offer: Offer) -> Self {
        let applies = match &self {
            UpstreamResponse::H1(_, head) => {
                let length = match head.framing {
                    Framing::Length(n) => Some(n),
                    Framing::Empty => Some(0),
                    Framing::Chunked | Framing::Close => None,
                };
                match head.headers.as_deref() {
                    Some(map) => c.applies(head.status, length, |n| {
                        map.get(n).map(|v| v.as_bytes().trim_ascii())
                    }),
                    None => c.applies(head.status, length, |n| header_value(out, n)),
                }
            }
            UpstreamResponse::H2(r) => {
                let length = r.content_length().or(r.is_end_stream().then_some(0));
                c.applies(r.head.status.as_u16(), length, |n| {
                    r.head.headers.get(n).map(|v| v.as_bytes().trim_ascii())
                })
            }
            UpstreamResponse::Transformed(t) => {
                let h = &t.0.headers;
                let length = h
                    .get(hyper::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse().ok());
                c.applies(t.0.status.as_u16(), length, |n| {
                    h.get(n).map(|v| v.as_bytes().trim_ascii())
                })
            }
        };
        if !applies {
            return self;
        }
        let Some(coding) = offer.coding else {
            let mut this = self;
            let mut headers = this.headers_mut(out);
            add_vary(&mut headers);
            return this;
        };
        // The leg wrote the head: it converts. Should it not, the answer goes as it is.
        let (mut head, body) = match self.into_parts(out) {
            Ok(parts) => parts,
            Err(this) => return this,
        };
        let encoder = match c.encoder(coding) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("cannot start a {} encoder: {e}", coding.token());
                return UpstreamResponse::Transformed(Box::new((head, body)));
            }
        };
        let h = &mut head.headers;
        h.remove(hyper::header::CONTENT_LENGTH);
        h.remove(hyper::header::ACCEPT_RANGES);
        h.insert(
            hyper::header::CONTENT_ENCODING,
            hyper::header::HeaderValue::from_static(coding.token()),
        );
        if let Some(weak) = h
            .get(hyper::header::ETAG)
            .and_then(|v| weak_etag(v.as_bytes()))
            .and_then(|v| hyper::header::HeaderValue::from_bytes(&v).ok())
        {
            h.insert(hyper::header::ETAG, weak);
        }
        add_vary(&mut ResponseHeaders::Map(h));
        let body = ResponseBody::Compressed(Box::new(Compressed {
            inner: body,
            stream: Compressing::new(encoder),
        }));
        UpstreamResponse::Transformed(Box::new((head, body)))
    }

    /// The response phase of an `inference = true` cluster: a 2xx answer's body measured as
    /// it streams (server-sent events, or one JSON body), for both front ends alike; `strip`:
    /// keel asked for the usage the client did not, and takes it out of the events. An answer
    /// in a content coding is not read. `out`: an HTTP/1.1 endpoint's head, as
    /// [`Self::into_parts`]. `charge`: the request's token budget charge, settled by the
    /// answer's `usage` (dropped with an answer not read, it keeps its estimate).
    pub fn meter(
        self,
        out: &[u8],
        started: Instant,
        strip: bool,
        slot: crate::metrics::inference::MeasuredSlot,
        metrics: std::sync::Arc<crate::metrics::ClusterMetrics>,
        charge: Option<crate::policy::budget::Charge>,
    ) -> Self {
        use crate::policy::meter::{Metering, Shape};
        if !(200..300).contains(&self.status()) {
            return self;
        }
        // The leg wrote the head: it converts. Should it not, the answer goes as it is.
        let (mut head, body) = match self.into_parts(out) {
            Ok(parts) => parts,
            Err(this) => return this,
        };
        let h = &mut head.headers;
        let coded = h
            .get(hyper::header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"));
        if coded {
            return UpstreamResponse::Transformed(Box::new((head, body)));
        }
        let events = h.get(hyper::header::CONTENT_TYPE).is_some_and(|v| {
            let v = v.as_bytes().trim_ascii();
            v.len() >= 17 && v[..17].eq_ignore_ascii_case(b"text/event-stream")
        });
        let shape = if events { Shape::Events } else { Shape::Whole };
        let strip = strip && events;
        if strip {
            // The client gets fewer bytes than the engine sent.
            h.remove(hyper::header::CONTENT_LENGTH);
        }
        let body = ResponseBody::Metered(Box::new(Metered {
            inner: body,
            metering: Metering::new(started, shape, strip, slot, metrics, charge),
            strip,
        }));
        UpstreamResponse::Transformed(Box::new((head, body)))
    }

    /// The response's headers to edit (an HTTP/1.1 endpoint's are the head its leg wrote into
    /// `out`).
    pub fn headers_mut<'a>(&'a mut self, out: &'a mut Vec<u8>) -> ResponseHeaders<'a> {
        match self {
            UpstreamResponse::H1(_, head) => match head.headers.as_deref_mut() {
                Some(map) => ResponseHeaders::Map(map),
                None => ResponseHeaders::Lines(out),
            },
            UpstreamResponse::H2(r) => ResponseHeaders::Map(&mut r.head.headers),
            UpstreamResponse::Transformed(t) => ResponseHeaders::Map(&mut t.0.headers),
        }
    }

    /// The request's own stream and the piece of its body not yet sent, when an HTTP/2
    /// endpoint answered before the client's body ended (the front end sends the rest).
    pub fn rest_of_request(
        &mut self,
    ) -> Option<(::h2::SendStream<bytes::Bytes>, Option<bytes::Bytes>)> {
        match self {
            UpstreamResponse::H1(..) => None,
            UpstreamResponse::H2(r) => r.rest_of_request.take(),
            UpstreamResponse::Transformed(t) => t.1.rest_of_request(),
        }
    }

    /// The response as every renderer but the HTTP/1.1 front end's zero-copy relay takes it:
    /// its head as status and headers (an HTTP/1.1 endpoint's read back from the head the leg
    /// wrote into `out`, its length as `content-length`), and its body as one stream of
    /// frames. `Err`: an HTTP/1.1 head that does not convert (the leg wrote it, so it does),
    /// given back as it was (large, but only moved in a case that does not happen).
    #[allow(clippy::result_large_err)]
    pub fn into_parts(
        self,
        out: &[u8],
    ) -> Result<(hyper::http::response::Parts, ResponseBody), Self> {
        match self {
            UpstreamResponse::H1(conn, mut head) => {
                match crate::codec::response::parts(out, &mut head) {
                    Ok(parts) => Ok((parts, ResponseBody::H1(H1Body::new(conn, &head)))),
                    Err(()) => Err(UpstreamResponse::H1(conn, head)),
                }
            }
            UpstreamResponse::H2(mut r) => {
                // Taken, not cloned: nothing reads the endpoint's head once it is the client's.
                let empty = hyper::Response::new(()).into_parts().0;
                let head = std::mem::replace(&mut r.head, empty);
                Ok((head, ResponseBody::H2(r)))
            }
            UpstreamResponse::Transformed(t) => Ok(*t),
        }
    }
}

/// Adds `Accept-Encoding` to a response's `Vary` (merged into its one `Vary` line).
fn add_vary(headers: &mut ResponseHeaders<'_>) {
    let vary = match headers {
        ResponseHeaders::Lines(head) => Vary::of(
            crate::codec::head::header_lines(head)
                .filter(|(n, _, _)| n.eq_ignore_ascii_case(b"vary"))
                .map(|(_, v, _)| v),
        ),
        ResponseHeaders::Map(map) => Vary::of(
            map.get_all(hyper::header::VARY)
                .iter()
                .map(|v| v.as_bytes().trim_ascii()),
        ),
    };
    match vary {
        Vary::Done => {}
        Vary::Add => headers.append(&hyper::header::VARY, b"Accept-Encoding"),
        Vary::Replace(v) => headers.edit(|name, _| {
            if name.eq_ignore_ascii_case(b"vary") {
                Edit::Replace(v.clone())
            } else {
                Edit::Keep
            }
        }),
    }
}

/// A body compressed on its way: the source's frames through an encoder.
pub(crate) struct Compressed {
    inner: ResponseBody,
    stream: Compressing,
}

/// A body measured on its way (`inference = true`).
pub(crate) struct Metered {
    inner: ResponseBody,
    metering: crate::policy::meter::Metering,
    /// Events are taken out: the body's length is not the source's.
    strip: bool,
}

/// An error of a response body, as renderers pass it on.
pub(crate) type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An endpoint's response body as one stream of frames (data, then trailers), whichever leg
/// read it. A new leg adds its variant here; the renderers do not change.
pub(crate) enum ResponseBody {
    /// HTTP/1.1: read from the endpoint's connection, its framing decoded.
    H1(H1Body),
    /// HTTP/2: the stream's DATA frames and trailers.
    H2(Box<H2Response>),
    /// Either, compressed (`compression`).
    Compressed(Box<Compressed>),
    /// Any, measured (`inference`).
    Metered(Box<Metered>),
}

impl ResponseBody {
    /// The next frame: `None` at the end of the body.
    pub fn poll_frame(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, BodyError>>> {
        use std::task::Poll;
        match self {
            ResponseBody::H1(b) => match b.poll_data(cx) {
                Poll::Ready(Ok(Some(data))) => {
                    Poll::Ready(Some(Ok(hyper::body::Frame::data(data))))
                }
                Poll::Ready(Ok(None)) => Poll::Ready(None),
                Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e.into()))),
                Poll::Pending => Poll::Pending,
            },
            ResponseBody::H2(r) => r.poll_frame(cx).map(|f| f.map(|f| f.map_err(Into::into))),
            ResponseBody::Compressed(c) => {
                let Compressed { inner, stream } = &mut **c;
                stream.poll_frame(cx, |cx| inner.poll_frame(cx))
            }
            ResponseBody::Metered(m) => {
                let Metered {
                    inner, metering, ..
                } = &mut **m;
                metering.poll_frame(cx, |cx| {
                    let polled = inner.poll_frame(cx);
                    (polled, inner.is_end_stream())
                })
            }
        }
    }

    /// True once the body (and its trailers) are through, as far as the leg knows without
    /// being polled.
    pub fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::H1(b) => b.is_end_stream(),
            ResponseBody::H2(r) => r.is_end_stream(),
            ResponseBody::Compressed(c) => c.stream.is_end_stream(),
            ResponseBody::Metered(m) => m.metering.is_end_stream(m.inner.is_end_stream()),
        }
    }

    /// What is known of the body's length.
    pub fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            ResponseBody::H1(b) => b.size_hint(),
            ResponseBody::H2(r) => match r.content_length() {
                Some(n) if !r.is_end_stream() => hyper::body::SizeHint::with_exact(n),
                _ => hyper::body::SizeHint::default(),
            },
            ResponseBody::Compressed(_) => hyper::body::SizeHint::default(),
            ResponseBody::Metered(m) if m.strip => hyper::body::SizeHint::default(),
            ResponseBody::Metered(m) => m.inner.size_hint(),
        }
    }

    /// How a body read to its end ended, for the pick: a gRPC call by its status.
    pub fn end(&self) -> crate::exchange::error::BodyEnd {
        match self {
            ResponseBody::H1(_) => crate::exchange::error::BodyEnd::Done,
            ResponseBody::H2(r) => r.end(),
            ResponseBody::Compressed(c) => c.inner.end(),
            ResponseBody::Metered(m) => m.inner.end(),
        }
    }

    /// The endpoint's connection, for its pool, when it keeps it open (given back only after a
    /// body read to its end).
    pub fn reusable(&mut self) -> Option<RawConn> {
        match self {
            ResponseBody::H1(b) => b.reusable(),
            ResponseBody::H2(_) => None,
            ResponseBody::Compressed(c) => c.inner.reusable(),
            ResponseBody::Metered(m) => m.inner.reusable(),
        }
    }

    /// The request's own stream and its unsent piece (see
    /// [`UpstreamResponse::rest_of_request`]).
    fn rest_of_request(
        &mut self,
    ) -> Option<(::h2::SendStream<bytes::Bytes>, Option<bytes::Bytes>)> {
        match self {
            ResponseBody::H1(_) => None,
            ResponseBody::H2(r) => r.rest_of_request.take(),
            ResponseBody::Compressed(c) => c.inner.rest_of_request(),
            ResponseBody::Metered(m) => m.inner.rest_of_request(),
        }
    }
}

/// The HTTP legs: HTTP/1.1 or HTTP/2, as the cluster speaks.
pub(crate) struct HttpLeg<'r, 'b, B> {
    /// The cluster speaks HTTP/1.1.
    http1: bool,
    head: RequestHeaders<'r>,
    /// An HTTP/2 client's head as HTTP/1.1 text, written at the first HTTP/1.1 try.
    text: Vec<u8>,
    /// The length of the text every try shares (each try ends it for its endpoint).
    common_len: usize,
    meta: &'r RequestHead,
    body: &'b mut B,
    out: &'r mut Vec<u8>,
    /// An OpenAI request keel read (see [`HttpLeg::openai`]).
    openai: bool,
}

impl<'r, 'b, B> HttpLeg<'r, 'b, B> {
    /// The leg of one request to `cluster`: `head` as the front end wrote it for the
    /// endpoint, `out` for an HTTP/1.1 endpoint's response head.
    pub(crate) fn new(
        cluster: &Cluster,
        head: RequestHeaders<'r>,
        meta: &'r RequestHead,
        body: &'b mut B,
        out: &'r mut Vec<u8>,
    ) -> Self {
        HttpLeg {
            http1: cluster.config.protocol == UpstreamProtocol::Http1,
            common_len: match &head {
                RequestHeaders::Lines(text) => text.len(),
                RequestHeaders::Map(_) => 0,
            },
            text: Vec::new(),
            head,
            meta,
            body,
            out,
            openai: false,
        }
    }

    /// An OpenAI request keel read (its model named, or its prompt): an engine's generation
    /// acts on nothing but itself, so it may go again until its answer has begun, and an
    /// HTTP/1.1 engine's try counts as answered at the first byte of its body (a stream's
    /// first event), not at its head.
    pub(crate) fn openai(mut self, openai: bool) -> Self {
        self.openai = openai;
        self
    }

    /// The buffer that holds an HTTP/1.1 endpoint's response head.
    pub(crate) fn out(&mut self) -> &mut Vec<u8> {
        self.out
    }
}

/// A head as HTTP/1.1 text ended for `entry` (see [`end_head`]): the part every try shares
/// (an HTTP/1.1 client's head as it came, an HTTP/2 client's written into `text` once), then
/// this try's end.
fn text_for<'a>(
    head: &'a mut RequestHeaders<'_>,
    text: &'a mut Vec<u8>,
    common_len: &mut usize,
    meta: &RequestHead,
    entry: &EndpointEntry,
    trace: Option<&TraceParent>,
) -> &'a mut Vec<u8> {
    let text = match head {
        RequestHeaders::Lines(head) => head,
        RequestHeaders::Map(parts) => {
            if text.is_empty() {
                let chunked = meta.body == BodyFraming::Chunked;
                crate::codec::request::write_request_head(parts, chunked, text);
                *common_len = text.len();
            }
            text
        }
    };
    text.truncate(*common_len);
    end_head(text, meta, entry, trace);
    text
}

impl<B: RequestBody> Leg for HttpLeg<'_, '_, B> {
    type Won = UpstreamResponse;

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
        trace: Option<&TraceParent>,
    ) -> Result<UpstreamResponse, TryFailure<UpstreamResponse>> {
        if self.http1 {
            let (text, len) = (&mut self.text, &mut self.common_len);
            let head = text_for(&mut self.head, text, len, self.meta, entry, trace);
            return crate::leg::h1::upstream::try_once(
                entry,
                cluster,
                worker,
                head,
                self.meta,
                &mut *self.body,
                self.out,
            )
            .await
            .map(|(conn, head)| UpstreamResponse::H1(conn, head))
            .map_err(h1_failure);
        }
        let Some(head) = h2_head(&self.head) else {
            return Err(TryFailure::Client(Reject::Malformed));
        };
        crate::leg::h2::try_once(entry, cluster, worker, head, self.meta, self.body, trace)
            .await
            .map(UpstreamResponse::H2)
            .map_err(h2_failure)
    }

    fn rewind(&mut self) -> bool {
        self.body.rewind()
    }

    fn pushback(won: &UpstreamResponse) -> Option<crate::codec::pushback::Pushback> {
        match won {
            UpstreamResponse::H1(_, head) => head.pushback,
            UpstreamResponse::H2(r) => r.pushback(),
            UpstreamResponse::Transformed(_) => None,
        }
    }

    fn idempotent(&self) -> bool {
        self.meta.idempotent || self.openai
    }

    fn waiting_on_client(&self) -> bool {
        self.body.waiting_on_client()
    }

    fn awaits_first_byte(&self) -> bool {
        self.openai && self.http1
    }

    async fn first_byte(won: &mut UpstreamResponse) -> Result<(), TryError> {
        won.first_byte().await
    }

    fn hedgeable(&self) -> bool {
        self.meta.idempotent && self.body.inline().is_some()
    }

    // A failed try carries the response it failed with (moved, not copied).
    #[allow(clippy::result_large_err)]
    async fn hedged(
        &mut self,
        race: &Race<'_>,
        first: Tried,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (TryResult<UpstreamResponse>, Tried, Option<EndpointId>) {
        let Some(inline) = self.body.inline() else {
            unreachable!("hedgeable: the body is in memory")
        };
        if !self.http1 {
            // HTTP/2: each try opens its own stream.
            let Some(common) = h2_head(&self.head) else {
                return (
                    Some(Err(TryFailure::Client(Reject::Malformed))),
                    first,
                    None,
                );
            };
            let mut a = H2Try::new(common, self.meta, inline);
            let mut b = H2Try::new(common, self.meta, inline);
            let (result, winner, hedged, _) =
                race.run(first, &mut a, &mut b, timer, try_deadline).await;
            let result = result.map(|r| r.map(UpstreamResponse::H2).map_err(h2_failure));
            return (result, winner, hedged);
        }
        // The first try's head is ended for its endpoint now; a hedge ends its own copy of
        // the common part, made only if it is sent. Each try rewrites its response head into
        // a buffer of its own; the winner's becomes `out` once both tries are gone.
        let entry = &race.cluster.endpoints[first.pick.index()];
        let (text, len) = (&mut self.text, &mut self.common_len);
        let trace = race.traceparent(false);
        let head = text_for(&mut self.head, text, len, self.meta, entry, trace.as_ref());
        let mut out_b = Vec::new();
        let mut a = H1Try {
            head: &head[..],
            ended: true,
            own: Vec::new(),
            meta: self.meta,
            body: inline,
            out: &mut *self.out,
        };
        let mut b = H1Try {
            head: &head[..self.common_len],
            ended: false,
            own: Vec::new(),
            meta: self.meta,
            body: inline,
            out: &mut out_b,
        };
        let (result, winner, hedged, hedge_won) =
            race.run(first, &mut a, &mut b, timer, try_deadline).await;
        if hedge_won {
            *self.out = out_b;
        }
        let result = result.map(|r| {
            r.map(|(conn, head)| UpstreamResponse::H1(conn, head))
                .map_err(h1_failure)
        });
        (result, winner, hedged)
    }
}

/// One HTTP/1.1 try of a request whose body is in memory: each of a hedge race's two tries
/// is one, with a response buffer of its own.
struct H1Try<'a> {
    /// The head, already ended for the try's endpoint (`ended`), or the part every try shares,
    /// ended per try in `own`.
    head: &'a [u8],
    ended: bool,
    own: Vec<u8>,
    meta: &'a RequestHead,
    body: &'a [u8],
    out: &'a mut Vec<u8>,
}

impl Leg for H1Try<'_> {
    type Won = H1Response;

    fn pushback((_, head): &H1Response) -> Option<crate::codec::pushback::Pushback> {
        head.pushback
    }

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
        trace: Option<&TraceParent>,
    ) -> Result<H1Response, TryFailure<H1Response>> {
        let H1Try {
            head,
            ended,
            own,
            meta,
            body,
            out,
        } = self;
        let head: &[u8] = if *ended {
            head
        } else {
            own.clear();
            own.extend_from_slice(head);
            end_head(own, meta, entry, trace);
            own
        };
        let mut body: &[u8] = body;
        crate::leg::h1::upstream::try_once(entry, cluster, worker, head, meta, &mut body, out).await
    }

    fn rewind(&mut self) -> bool {
        true
    }

    fn idempotent(&self) -> bool {
        self.meta.idempotent
    }

    fn waiting_on_client(&self) -> bool {
        false
    }
}

/// One HTTP/2 try of a request whose body is in memory: each of a hedge race's two tries is
/// one, on a stream of its own.
struct H2Try<'a> {
    common: &'a Parts,
    meta: &'a RequestHead,
    body: &'a [u8],
}

impl<'a> H2Try<'a> {
    fn new(common: &'a Parts, meta: &'a RequestHead, body: &'a [u8]) -> Self {
        Self { common, meta, body }
    }
}

impl Leg for H2Try<'_> {
    type Won = Box<H2Response>;

    fn pushback(won: &Box<H2Response>) -> Option<crate::codec::pushback::Pushback> {
        won.pushback()
    }

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
        trace: Option<&TraceParent>,
    ) -> Result<Box<H2Response>, TryFailure<Box<H2Response>>> {
        let mut body: &[u8] = self.body;
        let head = self.common;
        crate::leg::h2::try_once(entry, cluster, worker, head, self.meta, &mut body, trace).await
    }

    fn rewind(&mut self) -> bool {
        true
    }

    fn idempotent(&self) -> bool {
        self.meta.idempotent
    }

    fn waiting_on_client(&self) -> bool {
        false
    }
}

/// The head an HTTP/2 leg sends: every front end builds it as a map for an HTTP/2 endpoint
/// (text would be parsed back per try); `None` would be a front end's mistake.
fn h2_head<'a>(head: &'a RequestHeaders<'_>) -> Option<&'a Parts> {
    match head {
        RequestHeaders::Map(parts) => Some(parts),
        RequestHeaders::Lines(_) => {
            debug_assert!(false, "a text head for an HTTP/2 endpoint");
            None
        }
    }
}

/// An HTTP/1.1 leg's failure, with its response (if any) as the driver carries it.
fn h1_failure(f: TryFailure<H1Response>) -> TryFailure<UpstreamResponse> {
    match f {
        TryFailure::Status((conn, head), cause) => {
            TryFailure::Status(UpstreamResponse::H1(conn, head), cause)
        }
        TryFailure::Upstream(e) => TryFailure::Upstream(e),
        TryFailure::Client(r) => TryFailure::Client(r),
    }
}

/// An HTTP/2 leg's failure, with its response (if any) as the driver carries it.
fn h2_failure(f: TryFailure<Box<H2Response>>) -> TryFailure<UpstreamResponse> {
    match f {
        TryFailure::Status(r, cause) => TryFailure::Status(UpstreamResponse::H2(r), cause),
        TryFailure::Upstream(e) => TryFailure::Upstream(e),
        TryFailure::Client(r) => TryFailure::Client(r),
    }
}

/// The per-try end of a request head: `Host` (the endpoint's) if the client sent none, the
/// try's `traceparent` when the request is traced, and the blank line.
fn end_head(
    head: &mut Vec<u8>,
    meta: &RequestHead,
    entry: &EndpointEntry,
    trace: Option<&TraceParent>,
) {
    if !meta.has_host {
        crate::codec::push_header(head, b"host", entry.header.as_bytes());
    }
    if let Some(t) = trace {
        crate::codec::push_header(head, b"traceparent", &t.0);
    }
    head.extend_from_slice(b"\r\n");
}
