//! I/O helpers every room uses: vectored writes, and the reusable timer that bounds a future
//! by a deadline without timer-wheel work per call ([`until`]).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::time::Instant;

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::time::Sleep;

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

/// The driver's clock: the monotonic clock, read through tokio's so that tests on a paused
/// clock (`tokio::time::pause`) move it (outside such tests it is `Instant::now()`).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Time since `then` on [`now`]'s clock.
pub(crate) fn since(then: Instant) -> std::time::Duration {
    now().saturating_duration_since(then)
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
