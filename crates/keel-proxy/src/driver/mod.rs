//! The attempt driver: the one place where a request meets the balancer. Every front end
//! (HTTP/1.1 over TCP or TLS, HTTP/2) hands it a rewritten request; it owns, once, the
//! `max_in_flight` check, the pick (avoiding endpoints already tried), the per-try and
//! whole-request deadlines, `finish` with the outcome, the retry decision within the budget,
//! and the answer when every try failed (502/503/504 with a typed [`Cause`]). The upstream
//! protocol is a [`Leg`] that moves one try's bytes and reports a typed [`TryFailure`]: what
//! failed, and whether the endpoint may have acted on the request. The legs: HTTP/1.1
//! ([`crate::leg::h1::upstream`], upgrades included), HTTP/2 ([`crate::leg::h2`], gRPC included),
//! both behind [`forward`], and TCP ([`crate::front::tcp`]), which calls [`drive`] itself.
//!
//! The front end then sends the [`Answer`]: keel's own, or the endpoint's response, whose
//! [`Tail`] finishes the pick with the body's (or tunnel's) outcome.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_balance::{EndpointId, Outcome, Pick, PickContext};
use tokio::time::Sleep;

use crate::config::{ErrorDetail, HashOn, UpstreamProtocol, MAX_RETRY_ATTEMPTS};
use crate::exchange::request::{Reject, RequestHead};
use crate::leg::h1::response::ResponseHead;
use crate::observe::metrics::{class_index, ClusterMetrics, ErrorKind};
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::pool::RawConn;

/// A client connection, as the driver needs to know it.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    /// The client's address.
    pub peer: SocketAddr,
    /// Its IP as text, for `X-Forwarded-For`.
    pub ip: String,
    /// `http` or `https`, for `X-Forwarded-Proto`.
    pub proto: &'static str,
    /// The client is one of the listener's `trusted_proxies`.
    pub trust_forwarded: bool,
    /// The worker thread serving the connection (its stack in every endpoint's pool).
    pub worker: usize,
    /// How much of a failure's cause keel's own answers show.
    pub error_detail: ErrorDetail,
}

/// A request body as a leg sends it.
pub(crate) trait RequestBody {
    /// The whole body, when it is in memory: sent in one write with the head, and again on a
    /// retry. (Streamed bodies have none.)
    fn inline(&self) -> Option<&[u8]> {
        None
    }
    /// The next piece of a streamed body; empty at its end. An error is the client's fault.
    async fn next_piece(&mut self) -> Result<&[u8], Reject>;
    /// True once a piece of a streamed body was handed out (it cannot be sent again).
    fn started(&self) -> bool;
    /// True while a piece is being read from the client: a try that runs out of time then
    /// waited on the client, not on the endpoint.
    fn waiting_on_client(&self) -> bool {
        false
    }
    /// Makes the body ready to be sent again from its start, for another try; false if it
    /// cannot be (part of a streamed body is gone).
    fn rewind(&mut self) -> bool {
        self.inline().is_some() || !self.started()
    }
    /// The trailers that ended the body, once [`Self::next_piece`] returned its end
    /// (HTTP/2 clients).
    fn trailers(&mut self) -> Option<hyper::HeaderMap> {
        None
    }
    /// The client may wait for the response before it ends its body (an HTTP/2 stream, a
    /// bidirectional gRPC call): the HTTP/2 leg then returns at the response head and the
    /// front end sends the rest.
    fn full_duplex(&self) -> bool {
        false
    }
}

/// A body that is all in memory (or empty).
impl RequestBody for &[u8] {
    fn inline(&self) -> Option<&[u8]> {
        Some(self)
    }
    async fn next_piece(&mut self) -> Result<&[u8], Reject> {
        Ok(std::mem::take(self))
    }
    fn started(&self) -> bool {
        false
    }
}

/// Why a try, or the request, failed: typed until the edge renders it.
#[derive(Debug)]
pub(crate) enum Cause {
    /// `max_in_flight` requests in the cluster already.
    Overloaded {
        /// The limit.
        limit: usize,
    },
    /// The balancer had no endpoint to offer.
    NoEndpoint,
    /// The TCP connect or the TLS handshake failed.
    Connect(io::Error),
    /// The connect did not finish within `connect_timeout`.
    ConnectTimeout(Duration),
    /// Writing the request failed.
    Write(io::Error),
    /// Reading the response failed.
    Read(io::Error),
    /// The endpoint closed the connection before a response.
    ClosedEarly,
    /// The response was not valid HTTP/1.1.
    InvalidResponse(&'static str),
    /// The response body failed midway.
    BodyFailed(String),
    /// No answer within the per-try timeout.
    TryTimeout(Duration),
    /// No answer within the request timeout.
    RequestTimeout(Duration),
    /// The endpoint answered with a status in `retry_on_status`.
    Status(u16),
    /// The endpoint answered a gRPC call with a status that counts as its failure
    /// (14 UNAVAILABLE, or one in `retry_on_grpc_status`).
    GrpcStatus(u32),
    /// The client's request or body was refused.
    Client(Reject),
}

impl Cause {
    /// The cause as a client may see it when `error_detail = "brief"`: no addresses, no
    /// operating-system errors.
    pub fn brief(&self) -> &'static str {
        match self {
            Cause::Overloaded { .. } => "the cluster is overloaded",
            Cause::NoEndpoint => "no endpoint available",
            Cause::Connect(_) | Cause::ConnectTimeout(_) => "cannot connect to an endpoint",
            Cause::TryTimeout(_) | Cause::RequestTimeout(_) => {
                "the endpoint did not answer in time"
            }
            Cause::Write(_)
            | Cause::Read(_)
            | Cause::ClosedEarly
            | Cause::InvalidResponse(_)
            | Cause::BodyFailed(_)
            | Cause::Status(_)
            | Cause::GrpcStatus(_) => "the endpoint failed",
            Cause::Client(r) => r.cause(),
        }
    }
}

/// The cause in full, with the endpoint's address when it is known: for logs, and for
/// clients when `error_detail = "full"`.
pub(crate) struct Detailed<'a> {
    /// The cause.
    pub cause: &'a Cause,
    /// The cluster.
    pub cluster: &'a str,
    /// The endpoint concerned, if any.
    pub endpoint: Option<&'a str>,
}

impl fmt::Display for Detailed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ep = self.endpoint.unwrap_or("?");
        match self.cause {
            Cause::Overloaded { limit } => write!(
                f,
                "cluster `{}` is overloaded: {limit} requests in flight (max_in_flight); refused without trying an endpoint",
                self.cluster
            ),
            Cause::NoEndpoint => write!(f, "no endpoint available in cluster `{}`", self.cluster),
            Cause::Connect(e) => write!(f, "cannot connect to upstream {ep}: {e}"),
            Cause::ConnectTimeout(d) => write!(
                f,
                "cannot connect to upstream {ep}: connect timed out after {}",
                humantime::format_duration(*d)
            ),
            Cause::Write(e) => write!(f, "upstream {ep} closed the connection while the request was sent: {e}"),
            Cause::Read(e) => write!(f, "upstream {ep} closed the connection or sent an invalid response: {e}"),
            Cause::ClosedEarly => write!(f, "upstream {ep} closed the connection before the response"),
            Cause::InvalidResponse(what) => write!(f, "upstream {ep} sent an invalid response: {what}"),
            Cause::BodyFailed(what) => write!(f, "upstream {ep} failed in the middle of the response body: {what}"),
            Cause::TryTimeout(d) | Cause::RequestTimeout(d) => write!(
                f,
                "upstream {ep} did not answer within {}",
                humantime::format_duration(*d)
            ),
            Cause::Status(s) => write!(f, "upstream {ep} answered {s}"),
            Cause::GrpcStatus(s) => write!(f, "upstream {ep} answered grpc-status {s}"),
            Cause::Client(r) => f.write_str(r.cause()),
        }
    }
}

/// A failed try, as a leg reports it.
#[derive(Debug)]
pub(crate) struct TryError {
    /// What failed (for metrics and the status).
    pub kind: ErrorKind,
    /// Any byte of the request reached the endpoint, so it may have acted on it: only an
    /// idempotent request may then go to another endpoint.
    pub may_have_acted: bool,
    /// Why.
    pub cause: Cause,
}

impl TryError {
    /// A failure before any byte of the request left.
    pub fn before_sending(kind: ErrorKind, cause: Cause) -> Self {
        Self {
            kind,
            may_have_acted: false,
            cause,
        }
    }

    /// A failure once the request (or part of it) was sent.
    pub fn after_sending(kind: ErrorKind, cause: Cause) -> Self {
        Self {
            kind,
            may_have_acted: true,
            cause,
        }
    }
}

/// How a try failed. `W` is what the leg yields when the endpoint answers.
pub(crate) enum TryFailure<W = UpstreamResponse> {
    /// No usable answer from the endpoint.
    Upstream(TryError),
    /// The endpoint answered with a status that counts as its failure (`retry_on_status`, or
    /// a gRPC status): forwarded as it is when no retry follows.
    Status(W, Cause),
    /// The client's body broke the try: the client's fault, never the endpoint's.
    Client(Reject),
}

/// An endpoint's response, as its leg read it.
pub(crate) enum UpstreamResponse {
    /// HTTP/1.1: the connection with what was read of the body, and the head (rewritten
    /// into the front end's buffer). A `101` to an upgrade request makes a tunnel.
    H1(RawConn, ResponseHead),
    /// HTTP/2: the head, the body stream (trailers included) and the request's stream.
    H2(Box<crate::leg::h2::H2Response>),
}

impl UpstreamResponse {
    /// The response's status code.
    pub fn status(&self) -> u16 {
        match self {
            UpstreamResponse::H1(_, head) => head.status,
            UpstreamResponse::H2(r) => r.head.status.as_u16(),
        }
    }
}

/// The body text of keel's own answers: `"<status> <reason>: <cause>\n"`.
pub(crate) fn answer_text(status: u16, cause: &str) -> String {
    format!("{status} {}: {cause}\n", reason(status))
}

/// The standard reason phrase of a status.
pub(crate) fn reason(status: u16) -> &'static str {
    hyper::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("")
}

/// keel's answer to a request that no route matches on a listener without `cluster`.
pub(crate) fn not_found() -> OwnAnswer {
    const CAUSE: &str = "no route matches the request";
    OwnAnswer {
        status: 404,
        text: answer_text(404, CAUSE),
        endpoint: None,
        guard: None,
        attempts: 0,
        cause: CAUSE.to_string(),
    }
}

/// keel's answer to a request refused before it reached the driver.
pub(crate) fn refused(reject: Reject) -> OwnAnswer {
    OwnAnswer {
        status: reject.status(),
        text: answer_text(reject.status(), reject.cause()),
        endpoint: None,
        guard: None,
        attempts: 0,
        cause: reject.cause().to_string(),
    }
}

/// keel's own answer to a request.
pub(crate) struct OwnAnswer {
    /// The status.
    pub status: u16,
    /// The body (see [`answer_text`]), with as much detail as the listener shows.
    pub text: String,
    /// The endpoint the last try went to (`x-keel-endpoint`), if any.
    pub endpoint: Option<hyper::http::HeaderValue>,
    /// Counts the request as in flight until the answer is sent.
    pub guard: Option<DownstreamGuard>,
    /// Tries made.
    pub attempts: u32,
    /// The cause in full, as logged (the access log's `cause`).
    pub cause: String,
}

/// The endpoint's response, head read; its body still to come unless it was small.
pub(crate) struct Upstream {
    /// The response.
    pub response: UpstreamResponse,
    /// Finishes the pick once the body is through.
    pub tail: Tail,
}

/// What the driver decided: the front end sends it.
pub(crate) enum Answer {
    /// keel answers itself.
    Own(OwnAnswer),
    /// The endpoint's response goes to the client.
    Upstream(Upstream),
}

/// How sending a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyEnd {
    /// All of it reached the client.
    Done,
    /// The endpoint failed or sent a malformed body.
    UpstreamFailed,
    /// The request deadline passed.
    Timeout,
    /// The client went away (not the endpoint's fault).
    ClientGone,
    /// A gRPC call ended with this `grpc-status`: the endpoint's failure if the cluster
    /// counts it as one.
    Grpc(u32),
}

/// The end of a forwarded response: the pick to finish with the body's outcome (none when the
/// response is a failure status already counted), the endpoint's pool, the request's
/// accounting.
pub(crate) struct Tail {
    cluster: Arc<Cluster>,
    endpoint: usize,
    worker: usize,
    pick: Option<(Pick, Duration)>,
    guard: DownstreamGuard,
    /// The request's deadline (bodies stream until then).
    pub deadline: Instant,
    /// The request timeout that set it (for the cause when it passes).
    request_timeout: Duration,
    /// Tries made, this one included.
    pub attempts: u32,
}

impl Tail {
    /// The endpoint's `x-keel-endpoint` value.
    pub fn endpoint_header(&self) -> &hyper::http::HeaderValue {
        &self.cluster.endpoints[self.endpoint].header
    }

    /// The cluster's counters.
    pub fn metrics(&self) -> &Arc<ClusterMetrics> {
        &self.cluster.metrics
    }

    /// Finishes the pick with the body's outcome and puts the connection back in its pool
    /// when the body was read to its end and the endpoint keeps it open.
    pub fn end(mut self, end: BodyEnd, conn: Option<RawConn>) {
        let entry = &self.cluster.endpoints[self.endpoint];
        let failure = match end {
            BodyEnd::Done => None,
            BodyEnd::Grpc(code) if self.cluster.is_failure_grpc_status(code) => {
                if let Some((pick, at)) = self.pick.take() {
                    self.cluster.finish(pick, at, Outcome::Failure, None);
                    log_try_failure(&self.cluster, entry, &Cause::GrpcStatus(code));
                }
                None
            }
            BodyEnd::Grpc(_) => None,
            BodyEnd::UpstreamFailed => Some(ErrorKind::Reset),
            BodyEnd::Timeout => Some(ErrorKind::Timeout),
            // Dropped below: cancelled, not held against the endpoint.
            BodyEnd::ClientGone => {
                self.pick = None;
                None
            }
        };
        if let Some((pick, at)) = self.pick.take() {
            match failure {
                None => self.cluster.finish(pick, at, Outcome::Success, None),
                Some(kind) => {
                    self.cluster.finish(pick, at, Outcome::Failure, Some(kind));
                    let cause = match kind {
                        ErrorKind::Timeout => Cause::RequestTimeout(self.request_timeout),
                        _ => Cause::BodyFailed("the response body was cut".into()),
                    };
                    log_try_failure(&self.cluster, entry, &cause);
                }
            }
        }
        if let (BodyEnd::Done, Some(conn)) = (end, conn) {
            entry.pool.put(self.worker, conn);
        }
        drop(self.guard);
    }
}

/// How long a request may take and how often it may be tried again: its cluster's settings,
/// or a route's overrides of them (`request_timeout`, `retry_attempts`), computed once when
/// the configuration is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The whole request, all tries included.
    pub request_timeout: Duration,
    /// One try, until the response head.
    pub per_try_timeout: Duration,
    /// Retries after the first try.
    pub retry_attempts: u32,
}

impl Limits {
    /// The cluster's limits with a route's overrides: an explicit `per_try_timeout` stays (at
    /// most the request timeout), else the request timeout is shared by every allowed try.
    pub fn new(
        cluster: &crate::config::ClusterConfig,
        request_timeout: Option<Duration>,
        retry_attempts: Option<u32>,
    ) -> Self {
        let request_timeout = request_timeout.unwrap_or(cluster.request_timeout);
        let retry_attempts = retry_attempts
            .unwrap_or(cluster.retry.attempts)
            .min(MAX_RETRY_ATTEMPTS);
        let per_try_timeout = match cluster.retry.per_try_timeout {
            Some(t) => t.min(request_timeout),
            None => request_timeout / (retry_attempts + 1),
        };
        Self {
            request_timeout,
            per_try_timeout,
            retry_attempts,
        }
    }
}

/// What the driver needs to forward one request.
pub(crate) struct Request<'a> {
    /// The head for the upstream (see [`crate::exchange::request::rewrite`]), without its per-try
    /// end; the leg appends that.
    pub head: &'a mut Vec<u8>,
    /// What was learned of the request.
    pub meta: &'a RequestHead,
    /// When the request arrived (its deadline counts from here).
    pub start: Instant,
    /// Its timeouts and retries (the cluster's, or its route's).
    pub limits: Limits,
}

/// An upstream protocol: one try of a request (or a connection) on one endpoint.
pub(crate) trait Leg {
    /// What a try yields when the endpoint answers.
    type Won;
    /// One try on the endpoint `entry` of `cluster`, from worker `worker`.
    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
    ) -> Result<Self::Won, TryFailure<Self::Won>>;
    /// Prepares the request to go again (to another endpoint); false if it cannot.
    fn rewind(&mut self) -> bool;
    /// Sending the request twice has the effect of once (RFC 9110 section 9.2.2).
    fn idempotent(&self) -> bool;
    /// A try that ran out of time was waiting on the client, not on the endpoint.
    fn waiting_on_client(&self) -> bool;
    /// The first try may be hedged (an idempotent HTTP/1.1 request whose body is in memory).
    fn hedgeable(&self) -> bool {
        false
    }
    /// The first try, hedged (see [`Race`]); only called when [`Self::hedgeable`].
    async fn hedged(
        &mut self,
        race: &Race<'_>,
        first: Tried,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (TryResult<Self::Won>, Tried, Option<EndpointId>) {
        let entry = &race.cluster.endpoints[first.pick.index()];
        let one = self.try_once(race.cluster, entry, race.client.worker);
        (
            crate::codec::until(timer, try_deadline, one).await,
            first,
            None,
        )
    }
}

/// What [`drive`] decided.
pub(crate) enum Driven<W> {
    /// An endpoint answered (possibly with a failure status, when no retry followed); the
    /// tail finishes the pick.
    Won(W, Tail),
    /// keel answers itself.
    Own(OwnAnswer),
}

/// The HTTP legs: HTTP/1.1 or HTTP/2, as the cluster speaks.
struct HttpLeg<'r, 'b, B> {
    /// The cluster speaks HTTP/1.1 (only that leg hedges).
    http1: bool,
    head: &'r mut Vec<u8>,
    common_len: usize,
    meta: &'r RequestHead,
    body: &'b mut B,
    out: &'r mut Vec<u8>,
}

impl<B: RequestBody> Leg for HttpLeg<'_, '_, B> {
    type Won = UpstreamResponse;

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
    ) -> Result<UpstreamResponse, TryFailure> {
        self.head.truncate(self.common_len);
        end_head(self.head, self.meta, entry);
        match cluster.config.protocol {
            UpstreamProtocol::Http1 => crate::leg::h1::upstream::try_once(
                entry,
                cluster,
                worker,
                self.head,
                self.meta,
                &mut *self.body,
                self.out,
            )
            .await
            .map(|(conn, head)| UpstreamResponse::H1(conn, head))
            .map_err(h1_failure),
            UpstreamProtocol::H2c | UpstreamProtocol::H2 => {
                crate::leg::h2::try_once(entry, cluster, worker, self.head, self.meta, self.body)
                    .await
            }
        }
    }

    fn rewind(&mut self) -> bool {
        self.body.rewind()
    }

    fn idempotent(&self) -> bool {
        self.meta.idempotent
    }

    fn waiting_on_client(&self) -> bool {
        self.body.waiting_on_client()
    }

    fn hedgeable(&self) -> bool {
        self.http1 && self.meta.idempotent && self.body.inline().is_some()
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
        let entry = &race.cluster.endpoints[first.pick.index()];
        self.head.truncate(self.common_len);
        end_head(self.head, self.meta, entry);
        let Some(inline) = self.body.inline() else {
            unreachable!("hedgeable: the body is in memory")
        };
        let (result, winner, hedged) = race
            .run(
                first,
                &self.head[..],
                self.common_len,
                self.meta,
                inline,
                self.out,
                timer,
                try_deadline,
            )
            .await;
        let result = result.map(|r| {
            r.map(|(conn, head)| UpstreamResponse::H1(conn, head))
                .map_err(h1_failure)
        });
        (result, winner, hedged)
    }
}

/// An HTTP/1.1 leg's failure, with its response (if any) as the driver carries it.
fn h1_failure(f: TryFailure<crate::leg::h1::upstream::H1Response>) -> TryFailure {
    match f {
        TryFailure::Status((conn, head), cause) => {
            TryFailure::Status(UpstreamResponse::H1(conn, head), cause)
        }
        TryFailure::Upstream(e) => TryFailure::Upstream(e),
        TryFailure::Client(r) => TryFailure::Client(r),
    }
}

/// Forwards a request to `cluster`: picks, tries, retries, and returns the answer to send.
/// `out` receives the endpoint's HTTP/1.1 response head; `timer` is the connection's
/// reusable per-try timer.
pub(crate) async fn forward<B: RequestBody>(
    cluster: &Arc<Cluster>,
    client: &Client,
    req: Request<'_>,
    body: &mut B,
    out: &mut Vec<u8>,
    timer: &mut Pin<Box<Sleep>>,
) -> Answer {
    let hash = match cluster.config.hash_on {
        Some(HashOn::ClientIp) => Some(crate::upstream::cluster::client_ip_key(client.peer)),
        _ => req.meta.hash,
    };
    let mut leg = HttpLeg {
        http1: cluster.config.protocol == UpstreamProtocol::Http1,
        common_len: req.head.len(),
        head: req.head,
        meta: req.meta,
        body,
        out,
    };
    match drive(
        cluster, client, req.start, req.limits, hash, &mut leg, timer,
    )
    .await
    {
        Driven::Won(response, tail) => {
            count_response(cluster, response.status());
            Answer::Upstream(Upstream { response, tail })
        }
        Driven::Own(own) => Answer::Own(own),
    }
}

/// The one attempt loop: `max_in_flight`, then picks (avoiding the endpoints tried, with the
/// hash key if any) and tries on `leg` within the per-try and request deadlines, finishing
/// each failed try's pick and retrying while it is safe and the budget allows.
pub(crate) async fn drive<L: Leg>(
    cluster: &Arc<Cluster>,
    client: &Client,
    start: Instant,
    limits: Limits,
    hash: Option<u64>,
    leg: &mut L,
    timer: &mut Pin<Box<Sleep>>,
) -> Driven<L::Won> {
    let Some(guard) =
        DownstreamGuard::try_new(&cluster.metrics, start, cluster.config.max_in_flight)
    else {
        cluster.metrics.overloaded.fetch_add(1, Relaxed);
        let cause = Cause::Overloaded {
            limit: cluster.config.max_in_flight,
        };
        return own(cluster, client, 503, &cause, None, None, 0);
    };
    let deadline = start + limits.request_timeout;
    // The first try's clock readings are `start`'s; later ones read the clock again.
    let start_on_clock = cluster.at(start);
    cluster.budget.record_request(start_on_clock);
    let attempts = limits.retry_attempts.min(MAX_RETRY_ATTEMPTS) as usize;
    // Endpoints tried so far (a hedge adds one), avoided by the next pick.
    let mut tried = [EndpointId(0); MAX_RETRY_ATTEMPTS as usize + 2];
    let mut n_tried = 0;
    // Hedging: first tries of requests the leg can send twice at once.
    let hedger = cluster.hedger.as_deref().filter(|_| leg.hedgeable());
    if let Some(h) = hedger {
        h.record_call(start_on_clock);
    }
    let mut attempt = 0;
    loop {
        let (now, wall) = if attempt == 0 {
            (start_on_clock, start)
        } else {
            (cluster.now(), Instant::now())
        };
        let mut ctx = PickContext::new(now).with_avoid(&tried[..n_tried]);
        if let Some(k) = hash {
            ctx = ctx.with_hash_key(k);
        }
        let Some(pick) = cluster.balancer.pick(&ctx) else {
            cluster.metrics.no_endpoint.fetch_add(1, Relaxed);
            let tried = attempt as u32;
            return own(
                cluster,
                client,
                503,
                &Cause::NoEndpoint,
                None,
                Some(guard),
                tried,
            );
        };
        tried[n_tried] = pick.id();
        n_tried += 1;
        if cluster.uses_load_reports {
            crate::upstream::probe::after_pick(cluster, now);
        }
        let last = attempt >= attempts;
        let try_deadline = deadline.min(wall + limits.per_try_timeout);
        let first = Tried {
            pick,
            at: now,
            wall,
        };
        let hedge = hedger
            .filter(|_| attempt == 0)
            .and_then(|h| Some((h, h.delay()?)));
        let (tried_once, Tried { pick, at: now, .. }) = match hedge {
            Some((hedger, delay)) => {
                let race = Race {
                    cluster,
                    client,
                    hash,
                    deadline,
                    limits,
                    hedger,
                    delay,
                    tried: &tried[..n_tried],
                };
                let (result, winner, hedged) = leg.hedged(&race, first, timer, try_deadline).await;
                if let Some(id) = hedged {
                    tried[n_tried] = id;
                    n_tried += 1;
                }
                (result, winner)
            }
            None => {
                let entry = &cluster.endpoints[first.pick.index()];
                let one = leg.try_once(cluster, entry, client.worker);
                let result = crate::codec::until(timer, try_deadline, one).await;
                if let Some(h) = hedger.filter(|_| attempt == 0) {
                    h.observe(wall.elapsed());
                }
                (result, first)
            }
        };
        let index = pick.index();
        let entry = &cluster.endpoints[index];
        let tail = |pick, guard| Tail {
            cluster: cluster.clone(),
            endpoint: index,
            worker: client.worker,
            pick,
            guard,
            deadline,
            request_timeout: limits.request_timeout,
            attempts: attempt as u32 + 1,
        };
        let failure = match tried_once {
            Some(Ok(won)) => return Driven::Won(won, tail(Some((pick, now)), guard)),
            Some(Err(f)) => f,
            // Out of time while the client was still sending its body: the client's fault
            // (a slow upload must not get healthy endpoints ejected).
            None if leg.waiting_on_client() => TryFailure::Client(Reject::Timeout),
            None => timed_out(&limits, try_deadline, deadline),
        };
        let may_have_acted = match &failure {
            TryFailure::Client(reject) => {
                // The client's fault: the pick is cancelled (dropped), never retried.
                drop(pick);
                let cause = Cause::Client(*reject);
                let tried = attempt as u32 + 1;
                return own(
                    cluster,
                    client,
                    reject.status(),
                    &cause,
                    None,
                    Some(guard),
                    tried,
                );
            }
            TryFailure::Upstream(e) => e.may_have_acted,
            // A gRPC status that counts as a failure (UNAVAILABLE: the call was not
            // processed) is retried whatever the method; an HTTP status only when idempotent.
            TryFailure::Status(_, cause) => !matches!(cause, Cause::GrpcStatus(_)),
        };
        failed(cluster, entry, &failure, pick, now);
        let before_deadline = Instant::now() < deadline;
        // Rewound only when a retry may follow.
        let safe =
            (leg.idempotent() || !may_have_acted) && !last && before_deadline && leg.rewind();
        if may_retry(cluster, last, safe, before_deadline) {
            attempt += 1;
            continue;
        }
        return match failure {
            TryFailure::Upstream(e) => {
                let status = match e.kind {
                    ErrorKind::Timeout => 504,
                    _ => 502,
                };
                let tried = attempt as u32 + 1;
                own(
                    cluster,
                    client,
                    status,
                    &e.cause,
                    Some(index),
                    Some(guard),
                    tried,
                )
            }
            TryFailure::Status(won, _) => Driven::Won(won, tail(None, guard)),
            TryFailure::Client(_) => unreachable!("answered above"),
        };
    }
}

/// The per-try end of a request head: `Host` (the endpoint's) if the client sent none, and the
/// blank line.
fn end_head(head: &mut Vec<u8>, meta: &RequestHead, entry: &EndpointEntry) {
    if !meta.has_host {
        crate::codec::push_header(head, b"host", entry.header.as_bytes());
    }
    head.extend_from_slice(b"\r\n");
}

/// The failure of a try that ran out of time: the per-try timeout's, or the request's when
/// that came first.
fn timed_out<W>(limits: &Limits, try_deadline: Instant, deadline: Instant) -> TryFailure<W> {
    let cause = if try_deadline == deadline {
        Cause::RequestTimeout(limits.request_timeout)
    } else {
        Cause::TryTimeout(limits.per_try_timeout)
    };
    TryFailure::Upstream(TryError::after_sending(ErrorKind::Timeout, cause))
}

/// Records a failed try: logged, and its pick finished as the endpoint's failure (a client's
/// fault is not the endpoint's: its pick is dropped, cancelled).
fn failed<W>(
    cluster: &Cluster,
    entry: &EndpointEntry,
    failure: &TryFailure<W>,
    pick: Pick,
    at: Duration,
) {
    let kind = match failure {
        TryFailure::Upstream(e) => {
            log_try_failure(cluster, entry, &e.cause);
            Some(e.kind)
        }
        TryFailure::Status(_, cause) => {
            log_try_failure(cluster, entry, cause);
            None
        }
        TryFailure::Client(_) => return drop(pick),
    };
    cluster.finish(pick, at, Outcome::Failure, kind);
}

/// A try's pick, and when it was made (the balancer's clock and the wall clock).
pub(crate) struct Tried {
    pick: Pick,
    at: Duration,
    wall: Instant,
}

/// A hedged first try: what it needs besides the tries themselves.
pub(crate) struct Race<'a> {
    cluster: &'a Arc<Cluster>,
    client: &'a Client,
    hash: Option<u64>,
    deadline: Instant,
    limits: Limits,
    hedger: &'a keel_balance::Hedger,
    /// How long the first try runs alone.
    delay: Duration,
    /// Endpoints tried so far (the hedge avoids them).
    tried: &'a [EndpointId],
}

/// A try's result: `None` when it ran out of time.
pub(crate) type TryResult<W = UpstreamResponse> = Option<Result<W, TryFailure<W>>>;

type H1Result = TryResult<crate::leg::h1::upstream::H1Response>;

impl Race<'_> {
    /// Runs the first try alone for `delay`; if it has not answered by then and the budget
    /// allows, sends a hedge to another endpoint, and the first good answer wins. The loser's
    /// pick is dropped (cancelled, not failed); a try that fails while the other runs is
    /// finished as a failure at once. Returns the result to go on with (a success, or the last
    /// failure when both failed), the pick it belongs to, and the hedge's endpoint if one went.
    /// `head` is the first try's (its first `common_len` bytes are every try's).
    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        first: Tried,
        head: &[u8],
        common_len: usize,
        meta: &RequestHead,
        inline: &[u8],
        out: &mut Vec<u8>,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (H1Result, Tried, Option<EndpointId>) {
        // Each try rewrites its response head into a buffer of its own; the winner's becomes
        // `out` once both tries' futures are gone.
        let mut out_a = std::mem::take(out);
        let mut out_b = Vec::new();
        let (result, winner, hedged, hedge_won) = self
            .race(
                first,
                head,
                common_len,
                meta,
                inline,
                &mut out_a,
                &mut out_b,
                timer,
                try_deadline,
            )
            .await;
        *out = if hedge_won { out_b } else { out_a };
        (result, winner, hedged)
    }

    #[allow(clippy::too_many_arguments)]
    async fn race(
        &self,
        first: Tried,
        head: &[u8],
        common_len: usize,
        meta: &RequestHead,
        inline: &[u8],
        out: &mut Vec<u8>,
        out_b: &mut Vec<u8>,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (H1Result, Tried, Option<EndpointId>, bool) {
        let (hedger, delay, tried) = (self.hedger, self.delay, self.tried);
        let cluster = self.cluster;
        let worker = self.client.worker;
        let entry_a = &cluster.endpoints[first.pick.index()];
        let mut body_a = inline;
        let leg_a = crate::leg::h1::upstream::try_once(
            entry_a,
            cluster,
            worker,
            head,
            meta,
            &mut body_a,
            out,
        );
        tokio::pin!(leg_a);
        let hedge_at = first.wall + delay;
        let alone = crate::codec::until(timer, try_deadline.min(hedge_at), &mut leg_a).await;
        if alone.is_some() || hedge_at >= try_deadline {
            hedger.observe(first.wall.elapsed());
            return (alone, first, None, false);
        }
        // No answer yet: a hedge, if the budget allows and another endpoint is there.
        let second = if hedger.try_hedge(cluster.now()) {
            let now = cluster.now();
            let mut ctx = PickContext::new(now).with_avoid(tried);
            if let Some(k) = self.hash {
                ctx = ctx.with_hash_key(k);
            }
            cluster
                .balancer
                .pick(&ctx)
                .filter(|p| p.id() != first.pick.id())
                .map(|pick| Tried {
                    pick,
                    at: now,
                    wall: Instant::now(),
                })
        } else {
            None
        };
        let Some(second) = second else {
            let r = crate::codec::until(timer, try_deadline, &mut leg_a).await;
            hedger.observe(first.wall.elapsed());
            return (r, first, None, false);
        };
        cluster.metrics.hedges.fetch_add(1, Relaxed);
        let hedged_id = second.pick.id();
        let entry_b = &cluster.endpoints[second.pick.index()];
        let mut head_b = head[..common_len].to_vec();
        end_head(&mut head_b, meta, entry_b);
        let mut body_b = inline;
        let leg_b = crate::leg::h1::upstream::try_once(
            entry_b,
            cluster,
            worker,
            &head_b,
            meta,
            &mut body_b,
            out_b,
        );
        tokio::pin!(leg_b);
        let deadline_b = self.deadline.min(second.wall + self.limits.per_try_timeout);
        let (mut a, mut b) = (Some(first), Some(second));
        loop {
            tokio::select! {
                r = crate::codec::until(timer, try_deadline, &mut leg_a), if a.is_some() => {
                    let Some(first) = a.take() else { unreachable!() };
                    hedger.observe(first.wall.elapsed());
                    let r = match r {
                        Some(r) => r,
                        None => Err(timed_out(&self.limits, try_deadline, self.deadline)),
                    };
                    match r {
                        Ok(won) => return (Some(Ok(won)), first, Some(hedged_id), false),
                        Err(f) if b.is_none() => return (Some(Err(f)), first, Some(hedged_id), false),
                        Err(f) => failed(cluster, entry_a, &f, first.pick, first.at),
                    }
                }
                r = tokio::time::timeout_at(deadline_b.into(), &mut leg_b), if b.is_some() => {
                    let Some(second) = b.take() else { unreachable!() };
                    let r = match r {
                        Ok(r) => r,
                        Err(_) => Err(timed_out(&self.limits, deadline_b, self.deadline)),
                    };
                    match r {
                        Ok(won) => {
                            cluster.metrics.hedges_won.fetch_add(1, Relaxed);
                            if let Some(first) = &a {
                                // It would have taken at least this long.
                                hedger.observe(first.wall.elapsed());
                            }
                            return (Some(Ok(won)), second, Some(hedged_id), true);
                        }
                        Err(f) if a.is_none() => return (Some(Err(f)), second, Some(hedged_id), true),
                        Err(f) => failed(cluster, entry_b, &f, second.pick, second.at),
                    }
                }
            }
        }
    }
}

/// After a failed try, whether to try again: not after the last try, only when it is safe
/// (the request can be sent again, and the endpoint cannot have acted on it or it is
/// idempotent), before the request's deadline, and within the retry budget. Counts the retry
/// or the budget's refusal.
fn may_retry(cluster: &Cluster, last: bool, safe: bool, before_deadline: bool) -> bool {
    if last || !safe || !before_deadline {
        return false;
    }
    if cluster.budget.try_retry(cluster.now()) {
        cluster.metrics.retries.fetch_add(1, Relaxed);
        true
    } else {
        cluster.metrics.budget_refusals.fetch_add(1, Relaxed);
        false
    }
}

fn count_response(cluster: &Cluster, status: u16) {
    cluster.metrics.responses[class_index(status)].fetch_add(1, Relaxed);
}

/// keel's own answer: counted, logged (5xx, rate-limited), its text as detailed as the
/// listener shows.
fn own<W>(
    cluster: &Cluster,
    client: &Client,
    status: u16,
    cause: &Cause,
    endpoint: Option<usize>,
    guard: Option<DownstreamGuard>,
    attempts: u32,
) -> Driven<W> {
    count_response(cluster, status);
    let entry = endpoint.map(|i| &cluster.endpoints[i]);
    let address = entry.map(|e| e.authority.as_str());
    let full = Detailed {
        cause,
        cluster: cluster.name(),
        endpoint: address,
    }
    .to_string();
    if status >= 500 && cluster.log_budget.allow() {
        tracing::warn!(
            cluster = cluster.name(),
            client = %client.peer,
            suppressed = cluster.log_budget.take_suppressed(),
            "answered {status}: {full}",
        );
    }
    let text = match client.error_detail {
        ErrorDetail::Full => answer_text(status, &full),
        ErrorDetail::Brief => answer_text(status, cause.brief()),
    };
    Driven::Own(OwnAnswer {
        status,
        text,
        endpoint: entry.map(|e| e.header.clone()),
        guard,
        attempts,
        cause: full,
    })
}

/// Logs a failed try at info level, rate-limited per cluster.
fn log_try_failure(cluster: &Cluster, entry: &EndpointEntry, cause: &Cause) {
    if cluster.log_budget.allow() {
        tracing::info!(
            cluster = cluster.name(),
            endpoint = %entry.authority,
            suppressed = cluster.log_budget.take_suppressed(),
            "try failed: {}",
            Detailed { cause, cluster: cluster.name(), endpoint: Some(entry.authority.as_str()) }
        );
    }
}

/// A log rate limit: at most `per_second` lines a second (per cluster), counting the lines
/// it suppressed so that the next line says how many. A few atomics, no lock: the logging of
/// failures must not become the outage's bottleneck.
#[derive(Debug)]
pub(crate) struct LogBudget {
    per_second: u64,
    /// The second (since the epoch) the count is for.
    second: AtomicU64,
    /// Lines allowed in that second.
    used: AtomicU64,
    /// Lines suppressed since the last line written.
    suppressed: AtomicU64,
    epoch: Instant,
}

impl LogBudget {
    /// At most `per_second` lines a second.
    pub fn new(per_second: u64, epoch: Instant) -> Self {
        Self {
            per_second,
            second: AtomicU64::new(0),
            used: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            epoch,
        }
    }

    /// True if a line may be written now (then call [`Self::take_suppressed`] for it).
    pub fn allow(&self) -> bool {
        let now = self.epoch.elapsed().as_secs();
        if self.second.load(Relaxed) != now {
            self.second.store(now, Relaxed);
            self.used.store(0, Relaxed);
        }
        if self.used.fetch_add(1, Relaxed) < self.per_second {
            true
        } else {
            self.suppressed.fetch_add(1, Relaxed);
            false
        }
    }

    /// Lines suppressed since the last one written (reset to 0).
    pub fn take_suppressed(&self) -> u64 {
        self.suppressed.swap(0, Relaxed)
    }
}

/// Counts a client request while it is served and records its latency when its response is
/// done (sent, or dropped because the client went away).
pub(crate) struct DownstreamGuard {
    metrics: Arc<ClusterMetrics>,
    start: Instant,
}

impl DownstreamGuard {
    /// Starts counting unless the cluster already serves `max_in_flight` requests (the
    /// circuit breaker): then nothing is counted and `None` is returned. The in-flight gauge
    /// is the counter, so the check costs no extra atomic operation.
    pub fn try_new(
        metrics: &Arc<ClusterMetrics>,
        start: Instant,
        max_in_flight: usize,
    ) -> Option<Self> {
        let in_flight: &AtomicI64 = &metrics.in_flight;
        let before = in_flight.fetch_add(1, Relaxed);
        if before >= max_in_flight as i64 {
            in_flight.fetch_sub(1, Relaxed);
            return None;
        }
        Some(Self {
            metrics: metrics.clone(),
            start,
        })
    }
}

impl Drop for DownstreamGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Relaxed);
        self.metrics.latency.observe(self.start.elapsed());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_budget_allows_a_few_lines_a_second_and_counts_the_rest() {
        let budget = LogBudget::new(3, Instant::now());
        let allowed = (0..10).filter(|_| budget.allow()).count();
        assert_eq!(allowed, 3);
        assert_eq!(budget.take_suppressed(), 7);
        assert_eq!(budget.take_suppressed(), 0);
    }

    #[test]
    fn brief_causes_name_no_address_and_no_os_error() {
        let refused = Cause::Connect(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(refused.brief(), "cannot connect to an endpoint");
        let full = Detailed {
            cause: &refused,
            cluster: "app",
            endpoint: Some("10.0.0.7:9000"),
        }
        .to_string();
        assert!(
            full.contains("10.0.0.7:9000") && full.contains("refused"),
            "{full}"
        );
        assert_eq!(answer_text(502, "x"), "502 Bad Gateway: x\n");
    }
}
