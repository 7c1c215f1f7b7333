//! gRPC as keel meets it: the status codes it uses, and its own failures rendered as gRPC
//! statuses (an HTTP 200 whose trailers carry `grpc-status`, never a bare 502 a gRPC client
//! cannot read). The health check `grpc.health.v1.Health/Check` is `control::grpc_health`.

use hyper::http::{HeaderMap, HeaderValue};

/// `DEADLINE_EXCEEDED`.
pub(crate) const DEADLINE_EXCEEDED: u32 = 4;
/// `UNAVAILABLE`: the call was not processed; always a failure for the balancer.
pub(crate) const UNAVAILABLE: u32 = 14;

/// True for the codes that say the server failed, whatever the call (the endpoint's failure
/// for the balancer): `UNKNOWN` (2), `INTERNAL` (13), `UNAVAILABLE` (14), `DATA_LOSS` (15).
/// The others answer the call (`NOT_FOUND`, `INVALID_ARGUMENT`, `UNIMPLEMENTED`, ...) or are
/// the client's (`CANCELLED`, `DEADLINE_EXCEEDED`: its own deadline).
#[inline]
pub(crate) fn server_failed(code: u32) -> bool {
    matches!(code, 2 | 13..=15)
}

/// The gRPC status of one of keel's own HTTP answers.
pub(crate) fn status_for(http: u16) -> u32 {
    match http {
        504 | 408 => DEADLINE_EXCEEDED,
        502 | 503 => UNAVAILABLE,
        // RESOURCE_EXHAUSTED
        413 | 431 | 429 => 8,
        // UNIMPLEMENTED
        501 => 12,
        // INTERNAL
        400 | 417 => 13,
        // UNKNOWN
        _ => 2,
    }
}

/// A `grpc-message` value: the text percent-encoded as the gRPC HTTP/2 protocol asks (bytes
/// outside printable ASCII, and `%`).
pub(crate) fn message(text: &str) -> HeaderValue {
    let mut out = String::with_capacity(text.len());
    for b in text.trim_end().bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).unwrap_or(HeaderValue::from_static(""))
}

/// The `grpc-status` of a head or trailers.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_and_messages_are_percent_encoded() {
        assert_eq!(message("503 é 100%\n"), "503 %C3%A9 100%25");
        assert_eq!(status_for(504), DEADLINE_EXCEEDED);
        assert_eq!(status_for(502), UNAVAILABLE);
        assert_eq!(status_for(503), UNAVAILABLE);
    }
}
