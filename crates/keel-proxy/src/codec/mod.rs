//! keel's HTTP/1.1 wire helpers and the chunked coding ([`chunked`]), shared by both front
//! ends, the legs and the access log: header lines written straight into the bytes sent.
//!
//! Why keel has its own HTTP/1.1 codec (front end in `front::h1`, leg in `leg::h1`, request
//! heads in `exchange::request`): under load, hyper's server and client cost keel about twice
//! NGINX's CPU per request (a header map and channels per request, a timer per read, two
//! codecs; see BENCHMARKS.md). Here heads are parsed in place (`httparse`) and rewritten
//! straight into the bytes sent on, bodies pass through reused buffers, and a request's
//! upstream exchange runs in its client connection's task with reusable timers.

pub(crate) mod chunked;

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::time::Instant;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::time::Sleep;

/// Response header naming the endpoint that answered (or that the last try went to).
pub const X_KEEL_ENDPOINT: hyper::header::HeaderName =
    hyper::header::HeaderName::from_static("x-keel-endpoint");

/// Headers that concern one connection only (RFC 9110 section 7.6.1), never forwarded
/// (lower-case).
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

/// Appends `name: value\r\n`.
pub(crate) fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `date: <now>` (RFC 9110 section 6.6.1), formatted at most once a second per thread.
pub(crate) fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static TODAY: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((0, String::new())) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    TODAY.with_borrow_mut(|(at, text)| {
        if *at != secs || text.is_empty() {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        push_header(out, b"date", text.as_bytes());
    });
}

/// Appends `content-length: n\r\n`.
pub(crate) fn push_content_length(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(b"content-length: ");
    push_u64(out, n);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n` in decimal (without formatting machinery: this runs for every response).
pub(crate) fn push_u64(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// Writes every slice in order, as few `writev`s as the stream takes.
pub(crate) async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    slices: &mut [IoSlice<'_>],
) -> io::Result<()> {
    let mut slices = slices;
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = w.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Writes `a` then `b` (one `writev` when both fit) and flushes (TLS keeps records in its
/// buffer until flushed; a no-op for TCP).
pub(crate) async fn write_all_2<W: AsyncWrite + Unpin>(
    w: &mut W,
    a: &[u8],
    b: &[u8],
) -> io::Result<()> {
    write_all_vectored(w, &mut [IoSlice::new(a), IoSlice::new(b)]).await?;
    w.flush().await
}

/// Runs `fut` until `deadline` (`None` if it passed first), on a timer reused across calls:
/// moving a registered timer's deadline later costs no timer-wheel work.
pub(crate) async fn until<F: Future>(
    timer: &mut Pin<Box<Sleep>>,
    deadline: Instant,
    fut: F,
) -> Option<F::Output> {
    let deadline = tokio::time::Instant::from_std(deadline);
    if timer.deadline() != deadline {
        timer.as_mut().reset(deadline);
    }
    tokio::select! {
        biased;
        r = fut => Some(r),
        _ = timer.as_mut() => None,
    }
}

/// A timer for [`until`], set far in the future until first used.
pub(crate) fn idle_timer() -> Pin<Box<Sleep>> {
    let far = tokio::time::Instant::now() + std::time::Duration::from_secs(86_400 * 365);
    Box::pin(tokio::time::sleep_until(far))
}
