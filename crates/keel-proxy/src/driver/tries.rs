//! Every try of one request, as the access log's `tries` records them (what `keel advise`
//! fits endpoints from): the endpoint, what the try came to, when it started and how long it
//! took, and the endpoint's calls in flight when it was picked. Kept inline in the request's
//! answer: no allocation.

use std::time::Duration;

use crate::config::MAX_RETRY_ATTEMPTS;
use crate::exchange::error::{Cause, TryFailure};
use crate::exchange::trace::Trace;

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
    /// `client`.
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
}

/// Most tries a request makes: the first, its retries, and a hedge.
const MAX_TRIES: usize = MAX_RETRY_ATTEMPTS as usize + 2;

/// Every try of one request, in order. The first is held inline and the others (retries,
/// a hedge: rare) on the heap: a request's record moves with its answer through the
/// driver and into the response body, and a fixed list of every possible try made that
/// 340 bytes, copied at each move.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Tries {
    /// The request's trace (`[tracing]`): each try's span id is made from it.
    pub trace: Option<Trace>,
    len: u8,
    first: TryRecord,
    /// All the tries, the first included, once there is more than one.
    spilled: Vec<TryRecord>,
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}

impl Tries {
    /// No try yet, in `trace` if any.
    pub fn traced(trace: Option<Trace>) -> Self {
        Tries {
            trace,
            ..Tries::default()
        }
    }

    /// Records a try that started `start` after the request and ended after `took` (`None`:
    /// it goes on with the response); `attempt` and `hedge` as [`TryRecord`] has them.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        endpoint: usize,
        outcome: TryOutcome,
        start: Duration,
        took: Option<Duration>,
        in_flight: u32,
        attempt: usize,
        hedge: bool,
    ) {
        let record = TryRecord {
            endpoint: endpoint as u32,
            outcome,
            start_us: micros(start),
            duration_us: took.map(micros),
            in_flight,
            attempt: attempt.min(usize::from(u8::MAX)) as u8,
            hedge,
        };
        match self.len as usize {
            0 => self.first = record,
            n if n < MAX_TRIES => {
                if self.spilled.is_empty() {
                    self.spilled.reserve_exact(MAX_TRIES);
                    self.spilled.push(self.first);
                }
                self.spilled.push(record);
            }
            _ => return,
        }
        self.len += 1;
    }

    /// The tries, first first.
    pub fn as_slice(&self) -> &[TryRecord] {
        match self.len {
            0 => &[],
            1 => std::slice::from_ref(&self.first),
            _ => &self.spilled,
        }
    }
}
