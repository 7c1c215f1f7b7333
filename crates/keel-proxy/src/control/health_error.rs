//! Why a health check failed (HTTP/1.1, TCP or gRPC), typed until it is logged.

use crate::upstream::h1_client::ClientError;
use crate::upstream::pool::ConnectError;

/// Why a health check failed; logged when it marks an endpoint unhealthy.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckFailed {
    /// No connection.
    #[error("cannot connect: {0}")]
    Connect(ConnectError),
    /// The HTTP/1.1 exchange failed.
    #[error(transparent)]
    Exchange(#[from] ClientError),
    /// The answer's status was not one of `expected_statuses` (HTTP/1.1) or 200 (gRPC).
    #[error("status {0}")]
    Status(u16),
    /// The answer's body did not have `expected_body` (in its first 64 KiB).
    #[error("the body lacks the expected text")]
    Body,
    /// No whole answer within the check's `timeout`.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(std::time::Duration),
    /// The HTTP/2 handshake failed (gRPC).
    #[error("HTTP/2 handshake failed: {0}")]
    Handshake(#[source] h2::Error),
    /// The HTTP/2 stream failed (gRPC).
    #[error("HTTP/2: {0}")]
    Http2(#[from] h2::Error),
    /// The check's request could not be built (an authority the URI refuses).
    #[error("invalid request: {0}")]
    Request(#[from] hyper::http::Error),
    /// A gRPC status other than OK.
    #[error("grpc-status {0}")]
    GrpcStatus(u32),
    /// An answer without a gRPC status.
    #[error("no grpc-status")]
    NoGrpcStatus,
    /// The `HealthCheckResponse` could not be read.
    #[error("{0}")]
    Response(&'static str),
    /// The service is not `SERVING`.
    #[error("status {0}")]
    NotServing(&'static str),
}
