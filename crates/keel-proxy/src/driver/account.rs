//! The driver's accounting of a request: the in-flight gauge and latency
//! ([`DownstreamGuard`]), a failed try's pick finished and logged ([`failed`]), and the
//! [`Tail`] that finishes the winning pick once the response body is through.

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_balance::{Outcome, Pick};

use crate::exchange::error::{BodyEnd, Cause, Detailed, ErrorKind, TryError, TryFailure};
use crate::metrics::ClusterMetrics;
use crate::route::Limits;
use crate::upstream::cluster::{Cluster, EndpointEntry};
use crate::upstream::pool::RawConn;

/// The end of a forwarded response: the pick to finish with the body's outcome (none when the
/// response is a failure status already counted), the endpoint's pool, the request's
/// accounting.
pub(crate) struct Tail {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) endpoint: usize,
    pub(crate) worker: usize,
    pub(crate) pick: Option<(Pick, Duration)>,
    pub(crate) guard: DownstreamGuard,
    /// Once the head is in, the body may go this long without a byte from the endpoint.
    pub upstream_idle: Duration,
    /// The request's end at the latest (`max_duration`), if it has one.
    pub max_end: Option<Instant>,
    /// The request timeout that set it (for the cause when it passes).
    pub(crate) request_timeout: Duration,
    /// Tries made, this one included.
    pub attempts: u32,
    /// Every try (the access log's `tries`), this one last.
    pub tries: crate::driver::tries::Tries,
}

impl Tail {
    /// When the body is cut if the endpoint sends nothing more from `now` on.
    pub fn body_deadline(&self, now: Instant) -> Instant {
        let idle = now + self.upstream_idle;
        self.max_end.map_or(idle, |m| m.min(idle))
    }

    /// Why a body cut at [`Self::body_deadline`] was cut.
    pub fn cut_cause(&self, now: Instant) -> &'static str {
        if self.max_end.is_some_and(|m| now >= m) {
            "max_duration"
        } else {
            "upstream idle"
        }
    }

    /// The endpoint's address as a header value (logged).
    pub fn endpoint_header(&self) -> &hyper::http::HeaderValue {
        &self.cluster.endpoints[self.endpoint].header
    }

    /// The `x-keel-endpoint` value to send, if the cluster shows it
    /// (`response_headers.endpoint`).
    pub fn shown_endpoint(&self) -> Option<&hyper::http::HeaderValue> {
        let shown = self.cluster.config.policy.response_headers.as_ref();
        shown
            .is_some_and(|r| r.endpoint)
            .then(|| self.endpoint_header())
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

/// The failure of a try that ran out of time: the per-try timeout's, or the request's when
/// that came first.
pub(crate) fn timed_out<W>(
    limits: &Limits,
    try_deadline: Instant,
    deadline: Instant,
) -> TryFailure<W> {
    let cause = if try_deadline == deadline {
        Cause::RequestTimeout(limits.request_timeout)
    } else {
        Cause::TryTimeout(limits.per_try_timeout)
    };
    TryFailure::Upstream(TryError::after_sending(ErrorKind::Timeout, cause))
}

/// Records a failed try: logged, and its pick finished as the endpoint's failure (a client's
/// fault is not the endpoint's: its pick is dropped, cancelled).
pub(crate) fn failed<W>(
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

/// Logs a failed try at info level, rate-limited per cluster.
pub(crate) fn log_try_failure(cluster: &Cluster, entry: &EndpointEntry, cause: &Cause) {
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
