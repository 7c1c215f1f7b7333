//! An endpoint's word on when to try it again: `Retry-After` on a `429` or `503` (RFC 9110
//! section 10.2.3) and gRPC's `grpc-retry-pushback-ms` (gRFC A6). It is about that endpoint
//! only: the driver backs the endpoint off for that long (every pick passes it over while
//! another endpoint may take the call) and retries elsewhere at once; it waits only when no
//! other endpoint may take the retry, and then only if the wait ends before the request's
//! deadline. Whatever the endpoint says, the time is at most [`MAX_PUSHBACK`]: a huge or
//! malformed value cannot keep an endpoint out longer, nor turn retries off.

use std::time::{Duration, SystemTime};

/// The longest an endpoint's pushback counts: a longer one is cut to this, a gRPC pushback
/// that says "never" (negative or malformed) is this. Long enough to honour a typical
/// `Retry-After` of a few seconds; an endpoint that goes on failing meanwhile is outlier
/// detection's to eject (its failures count as any other).
pub(crate) const MAX_PUSHBACK: Duration = Duration::from_secs(30);

/// What an endpoint said about retrying it: not before this long (at most [`MAX_PUSHBACK`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pushback(pub(crate) Duration);

impl Pushback {
    fn capped(d: Duration) -> Self {
        Self(d.min(MAX_PUSHBACK))
    }
}

/// Digits only, at most 10 of them; `None` otherwise.
fn number(v: &[u8]) -> Option<u64> {
    (!v.is_empty() && v.len() <= 10 && v.iter().all(u8::is_ascii_digit))
        .then(|| v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0')))
}

/// A `Retry-After` value: delay-seconds, or an HTTP-date (from `now`); `None` if neither (an
/// invalid field is ignored, RFC 9110 section 5.5).
pub(crate) fn retry_after(value: &[u8], now: SystemTime) -> Option<Pushback> {
    let v = value.trim_ascii();
    if let Some(secs) = number(v) {
        return Some(Pushback::capped(Duration::from_secs(secs)));
    }
    let date = httpdate::parse_http_date(std::str::from_utf8(v).ok()?).ok()?;
    Some(Pushback::capped(
        date.duration_since(now).unwrap_or(Duration::ZERO),
    ))
}

/// A `grpc-retry-pushback-ms` value: milliseconds to wait; anything else (A6's "do not
/// retry") backs the endpoint off for [`MAX_PUSHBACK`], and the call may go to another.
pub(crate) fn grpc_pushback(value: &[u8]) -> Pushback {
    match number(value.trim_ascii()) {
        Some(ms) => Pushback::capped(Duration::from_millis(ms)),
        None => Pushback(MAX_PUSHBACK),
    }
}

/// The pushback of a response with `status` whose headers are `headers` (name, value).
/// `Retry-After` counts on `429` and `503` only; `grpc-retry-pushback-ms` on any.
pub(crate) fn of_headers<'h>(
    status: u16,
    headers: impl Iterator<Item = (&'h [u8], &'h [u8])>,
) -> Option<Pushback> {
    let mut found = None;
    for (name, value) in headers {
        if name.eq_ignore_ascii_case(b"grpc-retry-pushback-ms") {
            return Some(grpc_pushback(value));
        }
        if (status == 429 || status == 503) && name.eq_ignore_ascii_case(b"retry-after") {
            found = found.or_else(|| retry_after(value, SystemTime::now()));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_and_grpc_pushback_are_read_as_their_specs_say_and_capped() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        let secs = |s| Some(Pushback(Duration::from_secs(s)));
        assert_eq!(retry_after(b" 12 ", now), secs(12));
        // 784111777 is Sun, 06 Nov 1994 08:49:37 GMT (RFC 9110's example date).
        assert_eq!(retry_after(b"Sun, 06 Nov 1994 08:49:57 GMT", now), secs(20));
        assert_eq!(
            retry_after(b"Sun, 06 Nov 1994 08:00:00 GMT", now),
            secs(0),
            "a date in the past: at once"
        );
        assert_eq!(retry_after(b"Fri, 31 Dec 9999 23:59:59 GMT", now), secs(30));
        assert_eq!(retry_after(b"9999999999", now), secs(30), "huge: capped");
        assert_eq!(retry_after(b"99999999999999999999", now), None);
        assert_eq!(retry_after(b"-1", now), None);
        assert_eq!(retry_after(b"soon", now), None);
        assert_eq!(grpc_pushback(b"250"), Pushback(Duration::from_millis(250)));
        assert_eq!(grpc_pushback(b"86400000"), Pushback(MAX_PUSHBACK));
        assert_eq!(grpc_pushback(b"-1"), Pushback(MAX_PUSHBACK));
        assert_eq!(grpc_pushback(b"x"), Pushback(MAX_PUSHBACK));
        let h = |v: &'static [(&'static [u8], &'static [u8])]| v.iter().copied();
        assert_eq!(of_headers(200, h(&[(b"Retry-After", b"5")])), None);
        assert_eq!(of_headers(503, h(&[(b"Retry-After", b"5")])), secs(5));
        assert_eq!(
            of_headers(200, h(&[(b"grpc-retry-pushback-ms", b"-5")])),
            Some(Pushback(MAX_PUSHBACK))
        );
    }
}
