//! The request path: pick an endpoint, forward, finish the pick with the outcome; retry on
//! another endpoint when that is safe and the budget allows; answer 502/503/504 otherwise.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Incoming};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::http::uri::PathAndQuery;
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use keel_balance::{EndpointId, Outcome, PickContext};

use crate::body::{
    ClientBodyFault, ConnActivity, DownstreamGuard, RespBody, SharedBody, StreamTail, UpstreamBody,
};
use crate::cluster::Cluster;
use crate::config::MAX_RETRY_ATTEMPTS;
use crate::metrics::{class_index, ErrorKind};
use crate::pool::UpstreamError;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// Response header naming the endpoint that answered.
pub const X_KEEL_ENDPOINT: HeaderName = HeaderName::from_static("x-keel-endpoint");
/// Headers that concern one connection only (RFC 9110 section 7.6.1), never forwarded
/// (lower-case; keel's own HTTP/1.1 path uses the same list).
pub(crate) const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop headers, including those that `Connection` names.
pub fn remove_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names (comparisons of known names, no hashing) finds whether there is
    // anything to remove: on most requests and responses there is not, and nine `remove`s
    // would each hash a name.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(&k.as_str())) {
        return;
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // The chunks delimit the body: a Content-Length beside them is stale (RFC 9112
        // section 6.3), and the body is re-framed on the next hop anyway.
        headers.remove(header::CONTENT_LENGTH);
    }
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Prepares a client's request headers for the upstream: hop-by-hop headers removed,
/// `X-Forwarded-For` appended to, `X-Forwarded-Proto` (`http` or `https`, the client
/// connection's scheme) and `X-Forwarded-Host` set, `Host` kept
/// (taken from the URI for HTTP/2 clients, which send `:authority` instead).
pub fn prepare_request_headers(parts: &mut hyper::http::request::Parts, client: &Client) {
    let headers = &mut parts.headers;
    remove_hop_by_hop(headers);
    if !headers.contains_key(header::HOST) {
        if let Some(a) = parts.uri.authority() {
            if let Ok(v) = HeaderValue::from_str(a.as_str()) {
                headers.insert(header::HOST, v);
            }
        }
    }
    if headers.contains_key(&X_FORWARDED_FOR) {
        let mut joined = String::new();
        for v in headers.get_all(&X_FORWARDED_FOR) {
            if let Ok(s) = v.to_str() {
                joined.push_str(s);
                joined.push_str(", ");
            }
        }
        joined.push_str(client.ip_header.to_str().unwrap_or(""));
        if let Ok(v) = HeaderValue::from_str(&joined) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    } else {
        headers.insert(X_FORWARDED_FOR, client.ip_header.clone());
    }
    headers.insert(X_FORWARDED_PROTO, client.proto_header.clone());
    match headers.get(header::HOST).cloned() {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        // Never the client's own: it would pass for the proxy's.
        None => {
            headers.remove(X_FORWARDED_HOST);
        }
    }
}

/// The client end of a connection, prepared once per connection.
#[derive(Debug, Clone)]
pub struct Client {
    /// The client's address.
    pub peer: SocketAddr,
    /// Its IP as a header value (for `X-Forwarded-For`).
    pub ip_header: HeaderValue,
    /// The connection's scheme as a header value (for `X-Forwarded-Proto`): `https` when the
    /// listener terminated TLS, else `http`.
    pub proto_header: HeaderValue,
    /// Largest request body accepted (`u64::MAX`: no limit).
    pub max_request_body: u64,
    /// Requests in flight on this connection (for its idle timeout).
    pub activity: Arc<ConnActivity>,
}

impl Client {
    /// Prepares a connection's client, without a body limit.
    pub fn new(peer: SocketAddr) -> Self {
        let ip_header = HeaderValue::from_str(&peer.ip().to_string())
            .expect("an IP address is a valid header value");
        Self {
            peer,
            ip_header,
            proto_header: HeaderValue::from_static("http"),
            max_request_body: u64::MAX,
            activity: Arc::new(ConnActivity::new()),
        }
    }

    /// Marks the connection as TLS (`X-Forwarded-Proto: https`) or not.
    pub fn with_tls(mut self, tls: bool) -> Self {
        self.proto_header = HeaderValue::from_static(if tls { "https" } else { "http" });
        self
    }

    /// Sets the largest request body accepted.
    pub fn with_max_request_body(mut self, limit: Option<u64>) -> Self {
        self.max_request_body = limit.unwrap_or(u64::MAX);
        self
    }
}

/// The proxy's answer when the client's body was at fault.
fn client_body_response(
    fault: ClientBodyFault,
    limit: u64,
    guard: DownstreamGuard,
) -> Response<RespBody> {
    match fault {
        ClientBodyFault::TooLarge => proxy_response(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body larger than {limit} bytes (max_request_body_bytes)"),
            Some(guard),
        ),
        ClientBodyFault::Invalid => proxy_response(
            StatusCode::BAD_REQUEST,
            "the request body is malformed or was cut short",
            Some(guard),
        ),
    }
}

/// Methods that may be sent twice with the effect of once (RFC 9110 section 9.2.2).
fn is_idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// A response made by the proxy itself: a status and a one-line plain-text cause.
pub fn proxy_response(
    status: StatusCode,
    cause: &str,
    guard: Option<DownstreamGuard>,
) -> Response<RespBody> {
    let text = format!(
        "{} {}: {cause}\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or("")
    );
    let mut r = Response::new(RespBody::full(text, guard));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Why a try failed.
enum Failure {
    /// No usable answer.
    Error { kind: ErrorKind, cause: String },
    /// The endpoint answered with a status that counts as failure; forwarded if it is the
    /// last try.
    Status(Response<Incoming>),
}

impl Failure {
    fn into_response(
        self,
        endpoint: &HeaderValue,
        guard: DownstreamGuard,
        deadline: tokio::time::Instant,
    ) -> Response<RespBody> {
        match self {
            Failure::Error { kind, cause } => {
                let status = match kind {
                    ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
                    ErrorKind::Connect | ErrorKind::Reset => StatusCode::BAD_GATEWAY,
                };
                let mut r = proxy_response(status, &cause, Some(guard));
                r.headers_mut().insert(X_KEEL_ENDPOINT, endpoint.clone());
                r
            }
            Failure::Status(resp) => {
                let (mut parts, body) = resp.into_parts();
                remove_hop_by_hop(&mut parts.headers);
                parts.headers.insert(X_KEEL_ENDPOINT, endpoint.clone());
                Response::from_parts(
                    parts,
                    RespBody::Stream {
                        body,
                        deadline: tokio::time::sleep_until(deadline),
                        tail: None,
                        guard: Some(guard),
                    },
                )
            }
        }
    }
}

/// Describes a client error (innermost cause, which says "connection refused" and the like).
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut inner: &(dyn std::error::Error + 'static) = e;
    while let Some(s) = inner.source() {
        inner = s;
    }
    inner.to_string()
}

/// Reads a small body whole (at most `limit` bytes).
async fn read_small(body: Incoming, limit: u64) -> Result<Bytes, String> {
    let mut body = body;
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| describe(&e))?;
        if let Ok(data) = frame.into_data() {
            if (buf.len() + data.len()) as u64 > limit {
                return Err("response body longer than its Content-Length".into());
            }
            if buf.is_empty() && body.is_end_stream() {
                return Ok(data);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf.freeze())
}

/// What is wrong with an HTTP/1 request's `Host` (RFC 9112 section 3.2), if anything: more
/// than one, or none in HTTP/1.1 unless the target is in absolute form (whose authority
/// stands for it, as NGINX takes it). HTTP/2 carries `:authority` instead.
fn host_problem<B>(req: &Request<B>) -> Option<&'static str> {
    if !matches!(
        req.version(),
        Version::HTTP_09 | Version::HTTP_10 | Version::HTTP_11
    ) {
        return None;
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => Some("more than one Host header"),
        (None, _) if req.version() == Version::HTTP_11 && req.uri().authority().is_none() => {
            Some("Host header missing (required since HTTP/1.1)")
        }
        _ => None,
    }
}

/// Serves one client request on `cluster`.
pub async fn handle(
    cluster: Arc<Cluster>,
    client: &Client,
    req: Request<Incoming>,
) -> Response<RespBody> {
    if let Some(cause) = host_problem(&req) {
        // Refused before any accounting, and the connection closed, as keel's own path does.
        let mut r = proxy_response(StatusCode::BAD_REQUEST, cause, None);
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return r;
    }
    let start = Instant::now();
    let Some(guard) = DownstreamGuard::try_new(
        &cluster.metrics,
        start,
        cluster.config.max_in_flight,
        Some(&client.activity),
    ) else {
        cluster.metrics.overloaded.fetch_add(1, Relaxed);
        cluster.metrics.responses[class_index(503)].fetch_add(1, Relaxed);
        return proxy_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!(
                "cluster `{}` is overloaded: {} requests in flight (max_in_flight); refused without trying an endpoint",
                cluster.name(),
                cluster.config.max_in_flight
            ),
            None,
        );
    };
    if client.max_request_body != u64::MAX {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > client.max_request_body) {
            let r = client_body_response(ClientBodyFault::TooLarge, client.max_request_body, guard);
            cluster.metrics.responses[class_index(413)].fetch_add(1, Relaxed);
            return r;
        }
    }
    let deadline = tokio::time::Instant::from_std(start + cluster.config.request_timeout);
    let (mut parts, body) = req.into_parts();
    prepare_request_headers(&mut parts, client);
    let hash = cluster.hash_key(&parts, client.peer);
    let idempotent = is_idempotent(&parts.method);
    let client_body =
        (!body.is_end_stream()).then(|| SharedBody::new(body, client.max_request_body));
    let path = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));

    let first_now = cluster.now();
    cluster.budget.record_request(first_now);
    let attempts = cluster.config.retry.attempts.min(MAX_RETRY_ATTEMPTS) as usize;
    let mut tried = [EndpointId(0); MAX_RETRY_ATTEMPTS as usize + 1];
    let mut headers = Some(std::mem::take(&mut parts.headers));
    let mut attempt = 0;
    let response = loop {
        let now = cluster.now();
        let mut ctx = PickContext::new(now).with_avoid(&tried[..attempt]);
        if let Some(k) = hash {
            ctx = ctx.with_hash_key(k);
        }
        let Some(pick) = cluster.balancer.pick(&ctx) else {
            cluster.metrics.no_endpoint.fetch_add(1, Relaxed);
            break proxy_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("no endpoint available in cluster `{}`", cluster.name()),
                Some(guard),
            );
        };
        tried[attempt] = pick.id();
        let entry = &cluster.endpoints[pick.index()];
        let last = attempt >= attempts;

        // Origin form (`/path?query`): the connection is to the endpoint already.
        let uri = Uri::from(path.clone());
        let mut try_headers = if last {
            headers.take().unwrap_or_default()
        } else {
            headers.clone().unwrap_or_default()
        };
        if !try_headers.contains_key(header::HOST) {
            // HTTP/1.0 clients may send none; HTTP/1.1 requires one.
            try_headers.insert(header::HOST, entry.header.clone());
        }
        let mut up = Request::new(match &client_body {
            Some(b) => UpstreamBody::Client(b.clone()),
            None => UpstreamBody::Empty,
        });
        *up.method_mut() = parts.method.clone();
        *up.uri_mut() = uri;
        *up.version_mut() = Version::HTTP_11;
        *up.headers_mut() = try_headers;

        let try_deadline = deadline.min(tokio::time::Instant::now() + cluster.per_try_timeout);
        let result = tokio::time::timeout_at(try_deadline, entry.pool.send(up)).await;
        let failure = match result {
            Err(_) => Failure::Error {
                kind: ErrorKind::Timeout,
                cause: cluster.timeout_cause(entry, try_deadline == deadline),
            },
            Ok(Err(UpstreamError::Connect { cause })) => Failure::Error {
                kind: ErrorKind::Connect,
                cause: format!("cannot connect to upstream {}: {cause}", entry.authority),
            },
            Ok(Err(UpstreamError::Http(e))) => Failure::Error {
                kind: ErrorKind::Reset,
                cause: format!(
                    "upstream {} closed the connection or sent an invalid response: {}",
                    entry.authority,
                    describe(&e)
                ),
            },
            Ok(Ok((resp, mut conn))) => {
                let status = resp.status().as_u16();
                entry.metrics.responses[class_index(status)].fetch_add(1, Relaxed);
                if cluster.is_failure_status(status) {
                    // Its body is streamed to the client (last try) or dropped: either way
                    // the connection is driven elsewhere from now on.
                    entry.pool.put(conn);
                    Failure::Status(resp)
                } else {
                    let small = resp
                        .headers()
                        .get(header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .filter(|n| *n <= cluster.config.max_buffered_response);
                    let (mut rparts, rbody) = resp.into_parts();
                    remove_hop_by_hop(&mut rparts.headers);
                    rparts.headers.insert(X_KEEL_ENDPOINT, entry.header.clone());
                    match small {
                        Some(limit) => {
                            let read = tokio::time::timeout_at(
                                try_deadline,
                                conn.drive(read_small(rbody, limit)),
                            )
                            .await;
                            entry.pool.put(conn);
                            match read {
                                Ok(Ok(data)) => {
                                    cluster.finish(pick, now, Outcome::Success, None);
                                    break Response::from_parts(
                                        rparts,
                                        RespBody::full(data, Some(guard)),
                                    );
                                }
                                Ok(Err(cause)) => Failure::Error {
                                    kind: ErrorKind::Reset,
                                    cause: format!(
                                        "upstream {} failed in the middle of the response body: {cause}",
                                        entry.authority
                                    ),
                                },
                                Err(_) => Failure::Error {
                                    kind: ErrorKind::Timeout,
                                    cause: format!(
                                        "upstream {} did not send the response body in time",
                                        entry.authority
                                    ),
                                },
                            }
                        }
                        None => {
                            // Streamed: a task drives the connection until the body is done.
                            entry.pool.put(conn);
                            break Response::from_parts(
                                rparts,
                                RespBody::Stream {
                                    body: rbody,
                                    deadline: tokio::time::sleep_until(deadline),
                                    tail: Some(StreamTail {
                                        cluster: cluster.clone(),
                                        pick,
                                        picked_at: now,
                                    }),
                                    guard: Some(guard),
                                },
                            );
                        }
                    }
                }
            }
        };

        // The client's body broke the try (malformed, cut short, too large): the client's
        // fault, so the pick is cancelled (not held against the endpoint) and never retried.
        if let Some(fault) = client_body.as_ref().and_then(|b| b.fault()) {
            drop(pick);
            let limit = client_body.as_ref().map_or(u64::MAX, |b| b.limit());
            break client_body_response(fault, limit, guard);
        }
        // The try failed: record it, then retry if that is safe, useful and within budget.
        let kind = match &failure {
            Failure::Error { kind, .. } => Some(*kind),
            Failure::Status(_) => None,
        };
        let endpoint_header = entry.header.clone();
        if tracing::enabled!(tracing::Level::DEBUG) {
            let cause = match &failure {
                Failure::Error { cause, .. } => cause.clone(),
                Failure::Status(r) => format!("status {}", r.status()),
            };
            tracing::debug!(cluster = cluster.name(), endpoint = %entry.authority, attempt, %cause, "try failed");
        }
        cluster.finish(pick, now, Outcome::Failure, kind);
        let body_ok = match &client_body {
            None => true,
            Some(b) => b.replayable(),
        };
        // A connect failure means the request never left: any method may go again. Otherwise
        // the endpoint may have acted on it, so only idempotent methods are retried.
        let safe = body_ok && (idempotent || kind == Some(ErrorKind::Connect));
        if cluster.may_retry(last, safe, tokio::time::Instant::now() < deadline) {
            attempt += 1;
            continue;
        }
        break failure.into_response(&endpoint_header, guard, deadline);
    };
    cluster.metrics.responses[class_index(response.status().as_u16())].fetch_add(1, Relaxed);
    response
}
