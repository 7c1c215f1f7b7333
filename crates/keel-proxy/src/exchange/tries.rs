//! What one try of a request came to ([`TryOutcome`]) and its record ([`TryRecord`]): the
//! words the driver (which records them), the access log (`tries`) and the span export
//! (`crate::exchange::trace`) share.

use crate::exchange::error::{Cause, TryFailure};

/// What one try came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum TryOutcome {
    /// The endpoint answered (the last try of a request the endpoint answered).
    #[default]
    Ok,
    /// A status that counts as the endpoint's failure (a 5xx but 501 and 505, or one in
    /// `retry_on_status`), retried or not.
    Status(u16),
    /// A gRPC status that counts as the endpoint's failure.
    GrpcStatus(u32),
    /// The connection was refused.
    ConnectRefused,
    /// Another connect or TLS handshake failure.
    ConnectError,
    /// The connect did not finish within `connect_timeout`.
    ConnectTimeout,
    /// No answer within the per-try (or request) timeout.
    Timeout,
    /// The connection closed or reset before the whole answer.
    Reset,
    /// The answer was not valid HTTP.
    InvalidResponse,
    /// The client's fault (its body broke or timed out): not the endpoint's.
    Client,
    /// A hedge race's loser, dropped when the other try answered (never in the access log).
    Cancelled,
}

impl TryOutcome {
    /// The outcome of a failed try.
    pub fn of_failure<W>(f: &TryFailure<W>) -> Self {
        match f {
            TryFailure::Status(_, Cause::GrpcStatus(c)) => TryOutcome::GrpcStatus(*c),
            TryFailure::Status(_, Cause::Status(s)) => TryOutcome::Status(*s),
            TryFailure::Status(..) => TryOutcome::InvalidResponse,
            TryFailure::Client(_) => TryOutcome::Client,
            TryFailure::Upstream(e) => match &e.cause {
                Cause::Connect(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
                    TryOutcome::ConnectRefused
                }
                Cause::Connect(_) => TryOutcome::ConnectError,
                Cause::ConnectTimeout(_) => TryOutcome::ConnectTimeout,
                Cause::TryTimeout(_) | Cause::RequestTimeout(_) => TryOutcome::Timeout,
                Cause::InvalidResponse(_) => TryOutcome::InvalidResponse,
                Cause::Status(s) => TryOutcome::Status(*s),
                Cause::GrpcStatus(c) => TryOutcome::GrpcStatus(*c),
                Cause::Client(_) => TryOutcome::Client,
                Cause::Write(_)
                | Cause::Read(_)
                | Cause::ClosedEarly
                | Cause::BodyFailed(_)
                | Cause::Overloaded { .. }
                | Cause::RateLimited { .. }
                | Cause::NoEndpoint => TryOutcome::Reset,
            },
        }
    }

    /// The text the access log writes: `ok`, `status 503`, `grpc-status 14`, `connect
    /// refused`, `connect error`, `connect timeout`, `timeout`, `reset`, `invalid response`,
    /// `client`, `cancelled`.
    pub fn push_text(&self, out: &mut Vec<u8>) {
        let fixed: &[u8] = match self {
            TryOutcome::Ok => b"ok",
            TryOutcome::Status(s) => {
                out.extend_from_slice(b"status ");
                crate::codec::push_u64(out, u64::from(*s));
                return;
            }
            TryOutcome::GrpcStatus(c) => {
                out.extend_from_slice(b"grpc-status ");
                crate::codec::push_u64(out, u64::from(*c));
                return;
            }
            TryOutcome::ConnectRefused => b"connect refused",
            TryOutcome::ConnectError => b"connect error",
            TryOutcome::ConnectTimeout => b"connect timeout",
            TryOutcome::Timeout => b"timeout",
            TryOutcome::Reset => b"reset",
            TryOutcome::InvalidResponse => b"invalid response",
            TryOutcome::Client => b"client",
            TryOutcome::Cancelled => b"cancelled",
        };
        out.extend_from_slice(fixed);
    }
}

/// One try.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct TryRecord {
    /// The endpoint's index in its cluster's `endpoints`.
    pub endpoint: u32,
    /// What it came to.
    pub outcome: TryOutcome,
    /// When it started, since the request arrived, in microseconds.
    pub start_us: u32,
    /// How long it took, in microseconds; `None` for the try whose response went to the
    /// client: it lasts until the response's end.
    pub duration_us: Option<u32>,
    /// The endpoint's calls in flight when it was picked (this one not counted).
    pub in_flight: u32,
    /// The driver's attempt: 0 for the first try (and its hedge), then each retry's number.
    pub attempt: u8,
    /// The try was the first try's hedge.
    pub hedge: bool,
    /// A hedge race's other try (cancelled, or failed while the other went on): exported as a
    /// span, left out of the access log's `tries` (whose outcomes `keel advise` fits).
    pub lost: bool,
}
