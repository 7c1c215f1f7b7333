//! The answers of the HTTP/2 and HTTP/3 front ends, as responses whose body is an
//! [`H2Body`]: keel's own (text, or a gRPC status for a gRPC call) with its record written at
//! once, or an endpoint's, whose record is written when its body ends.

use std::time::Instant;

use bytes::Bytes;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Response, StatusCode};

use crate::driver::account::Tail;
use crate::driver::answer::{self, OwnAnswer};
use crate::exchange::request::Reject;
use crate::leg::h2::RequestPump;
use crate::leg::ResponseBody;
use crate::observe::record::Record;
use crate::upstream::cluster::Cluster;

use super::body::{ActiveRequest, H2Body, UpstreamBody};
use super::log::{H2Answered, H2Scope};

/// True for a gRPC call.
pub(crate) fn is_grpc(headers: &hyper::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// keel's answer to a request refused before it reached the driver.
pub(crate) fn refused(
    reject: Reject,
    active: ActiveRequest,
    scope: H2Scope,
    cluster: Option<&Cluster>,
    grpc: bool,
) -> Response<H2Body> {
    own_response(answer::refused(reject), active, scope, cluster, grpc)
}

/// Writes the record of keel's own answer (`sent`: its body's bytes).
fn record_own(scope: &H2Scope, cluster: Option<&Cluster>, own: &OwnAnswer, sent: u64) {
    Record {
        endpoint: own.endpoint.as_ref().map(|e| e.as_bytes()),
        attempts: own.attempts,
        tries: Some(&own.tries),
        cause: Some(&own.cause),
        own: true,
        bytes_sent: sent,
        body_bytes_sent: sent,
        ..scope.record(cluster, own.status)
    }
    .write(scope.log.as_deref());
}

/// An endpoint's response, whichever leg read it: its head (with `x-keel-endpoint`) and its
/// body frame by frame; a body already at its end (a gRPC trailers-only answer) finishes the
/// pick at once.
pub(crate) fn upstream_response(
    mut head: hyper::http::response::Parts,
    body: ResponseBody,
    tail: Tail,
    pump: Option<RequestPump>,
    mut active: ActiveRequest,
    scope: H2Scope,
) -> Response<H2Body> {
    active.owe();
    if let Some(e) = tail.shown_endpoint() {
        head.headers
            .insert(crate::codec::X_KEEL_ENDPOINT, e.clone());
    }
    let due = tail.body_deadline(Instant::now());
    let record = H2Answered {
        scope,
        status: head.status.as_u16(),
        sent: 0,
    };
    let mut body = UpstreamBody {
        body,
        tail: Some(tail),
        pump,
        due,
        timer: None,
        record,
        active,
    };
    if body.body.is_end_stream() {
        let end = body.body.end();
        body.end(end);
    }
    Response::from_parts(head, H2Body::Upstream(Box::new(body)))
}

/// keel's own answer: its text with its status, or to a gRPC call (`grpc`) HTTP 200,
/// trailers-only, its status as `grpc-status` (14 UNAVAILABLE for 502/503, 4
/// DEADLINE_EXCEEDED for 504) and its text as `grpc-message`.
pub(crate) fn own_response(
    own: OwnAnswer,
    active: ActiveRequest,
    scope: H2Scope,
    cluster: Option<&Cluster>,
    grpc: bool,
) -> Response<H2Body> {
    let shown = own.shown_endpoint().cloned();
    record_own(
        &scope,
        cluster,
        &own,
        if grpc { 0 } else { own.text.len() as u64 },
    );
    let (status, content_type, grpc_fields) = if grpc {
        let status = HeaderValue::from(crate::exchange::grpc::status_for(own.status));
        let message = crate::exchange::grpc::message(&own.text);
        (StatusCode::OK, "application/grpc", Some((status, message)))
    } else {
        let status = StatusCode::from_u16(own.status).unwrap_or(StatusCode::BAD_GATEWAY);
        (status, "text/plain; charset=utf-8", None)
    };
    let mut r = Response::new(H2Body::Own {
        data: (!grpc).then(|| Bytes::from(own.text)),
        _guard: own.guard,
        _active: active,
    });
    *r.status_mut() = status;
    let headers = r.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some((status, message)) = grpc_fields {
        headers.insert("grpc-status", status);
        headers.insert("grpc-message", message);
    }
    if let Some(e) = shown {
        headers.insert(crate::codec::X_KEEL_ENDPOINT, e);
    }
    for (name, value) in own.headers {
        // Its own content type replaces the text one (an OpenAI-shaped error is JSON).
        if name == CONTENT_TYPE && !grpc {
            headers.insert(name, value);
        } else {
            headers.append(name, value);
        }
    }
    r
}
