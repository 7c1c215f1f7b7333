//! How a try fails, in types: what failed ([`ErrorKind`], for metrics and the status), why
//! ([`Cause`], rendered at the edge: [`Cause::brief`] for clients, [`Detailed`] for logs),
//! and whether the endpoint may have acted on the request ([`TryError::may_have_acted`]).
//! Every leg reports these; the driver decides on them.

use std::fmt;
use std::io;
use std::time::Duration;

use crate::exchange::request::Reject;

pub(crate) use crate::metrics::ErrorKind;

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
    /// The endpoint answered with a status that counts as its failure (a 5xx but 501 and
    /// 505, or one in `retry_on_status`).
    Status(u16),
    /// The endpoint answered a gRPC call with a status that counts as its failure
    /// (2, 13, 14, 15, or one in `retry_on_grpc_status`).
    GrpcStatus(u32),
    /// The client's request or body was refused.
    Client(Reject),
    /// A `rate_limit` refused the request.
    RateLimited {
        /// Whose limit (`route 0`, `cluster app`).
        scope: String,
        /// Its rate, requests a second.
        rate: f64,
        /// Its burst.
        burst: u32,
    },
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
            Cause::RateLimited { .. } => "rate limit exceeded",
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
            Cause::RateLimited { scope, rate, burst } => write!(
                f,
                "rate limit exceeded: {scope}'s rate_limit ({rate} a second, burst {burst}); refused without trying an endpoint"
            ),
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
pub(crate) enum TryFailure<W> {
    /// No usable answer from the endpoint.
    Upstream(TryError),
    /// The endpoint answered with a status that counts as its failure
    /// ([`crate::upstream::cluster::Cluster::is_failure_status`], or a gRPC status): retried
    /// only when the cluster retries it, else forwarded as it is.
    Status(W, Cause),
    /// The client's body broke the try: the client's fault, never the endpoint's.
    Client(Reject),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
