//! An endpoint's word on when to try again: `Retry-After` on a `429` or `503` (RFC 9110
//! section 10.2.3) and gRPC's `grpc-retry-pushback-ms` (gRFC A6). The driver waits that long
//! before the retry, and does not retry when the wait would pass the request's deadline or
//! the endpoint says never.

use std::time::{Duration, SystemTime};

/// What an endpoint said about retrying its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushback {
    /// Retry, but not before this long.
    After(Duration),
    /// Do not retry (a negative or malformed `grpc-retry-pushback-ms`, as A6 has it).
    Never,
}

/// A `Retry-After` value: delay-seconds, or an HTTP-date (from `now`); `None` if neither.
pub(crate) fn retry_after(value: &[u8], now: SystemTime) -> Option<Pushback> {
    let v = value.trim_ascii();
    if !v.is_empty() && v.len() <= 10 && v.iter().all(u8::is_ascii_digit) {
        let secs = v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        return Some(Pushback::After(Duration::from_secs(secs)));
    }
    let date = httpdate::parse_http_date(std::str::from_utf8(v).ok()?).ok()?;
    Some(Pushback::After(
        date.duration_since(now).unwrap_or(Duration::ZERO),
    ))
}

/// A `grpc-retry-pushback-ms` value: milliseconds to wait, anything else means never.
pub(crate) fn grpc_pushback(value: &[u8]) -> Pushback {
    let v = value.trim_ascii();
    if !v.is_empty() && v.len() <= 10 && v.iter().all(u8::is_ascii_digit) {
        let ms = v.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        Pushback::After(Duration::from_millis(ms))
    } else {
        Pushback::Never
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
    fn retry_after_and_grpc_pushback_are_read_as_their_specs_say() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(
            retry_after(b" 120 ", now),
            Some(Pushback::After(Duration::from_secs(120)))
        );
        // 784111777 is Sun, 06 Nov 1994 08:49:37 GMT (RFC 9110's example date).
        assert_eq!(
            retry_after(b"Sun, 06 Nov 1994 08:49:57 GMT", now),
            Some(Pushback::After(Duration::from_secs(20)))
        );
        assert_eq!(
            retry_after(b"Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Pushback::After(Duration::ZERO)),
            "a date in the past: at once"
        );
        assert_eq!(retry_after(b"-1", now), None);
        assert_eq!(retry_after(b"soon", now), None);
        assert_eq!(
            grpc_pushback(b"250"),
            Pushback::After(Duration::from_millis(250))
        );
        assert_eq!(grpc_pushback(b"-1"), Pushback::Never);
        assert_eq!(grpc_pushback(b"x"), Pushback::Never);
        let h = |v: &'static [(&'static [u8], &'static [u8])]| v.iter().copied();
        assert_eq!(of_headers(200, h(&[(b"Retry-After", b"5")])), None);
        assert_eq!(
            of_headers(503, h(&[(b"Retry-After", b"5")])),
            Some(Pushback::After(Duration::from_secs(5)))
        );
        assert_eq!(
            of_headers(200, h(&[(b"grpc-retry-pushback-ms", b"-5")])),
            Some(Pushback::Never)
        );
    }
}
