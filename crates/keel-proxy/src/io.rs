//! I/O helpers every room uses: vectored writes, and the reusable timer that bounds a future
//! by a deadline without timer-wheel work per call ([`until`]).

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::time::{Duration, Instant};

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
pub(crate) fn until<'t, F: Future>(
    timer: &'t mut Pin<Box<Sleep>>,
    deadline: Instant,
    fut: F,
) -> Until<'t, 'static, F> {
    Until::new(timer, deadline, None, fut)
}

pin_project_lite::pin_project! {
    /// The future of [`until`] and [`until_sent`]. Written by hand so that it holds `fut`
    /// once: an `async fn` holding it would keep its argument and its pinned copy side by
    /// side, and every request's future (moved whole when hyper spawns a stream's task)
    /// would carry both.
    pub(crate) struct Until<'t, 'p, F> {
        timer: &'t mut Pin<Box<Sleep>>,
        deadline: Instant,
        progress: Option<(&'p BodyProgress, Instant, Duration)>,
        #[pin]
        fut: F,
    }
}

impl<'t, 'p, F: Future> Until<'t, 'p, F> {
    fn new(
        timer: &'t mut Pin<Box<Sleep>>,
        deadline: Instant,
        progress: Option<(&'p BodyProgress, Instant, Duration)>,
        fut: F,
    ) -> Self {
        let at = tokio::time::Instant::from_std(deadline);
        if timer.deadline() != at {
            timer.as_mut().reset(at);
        }
        Until {
            timer,
            deadline,
            progress,
            fut,
        }
    }
}

impl<F: Future> Future for Until<'_, '_, F> {
    type Output = Option<F::Output>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = self.project();
        if let Poll::Ready(r) = this.fut.poll(cx) {
            return Poll::Ready(Some(r));
        }
        loop {
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let Some(moved) = this
                .progress
                .and_then(|(p, start, per_try)| p.moved(start, per_try, *this.deadline))
            else {
                return Poll::Ready(None);
            };
            *this.deadline = moved;
            this.timer
                .as_mut()
                .reset(tokio::time::Instant::from_std(moved));
        }
    }
}

/// A timer for [`until`], set far in the future until first used.
pub(crate) fn idle_timer() -> Pin<Box<Sleep>> {
    let far = tokio::time::Instant::now() + std::time::Duration::from_secs(86_400 * 365);
    Box::pin(tokio::time::sleep_until(far))
}

/// How long a response body may wait on each side once it streams: the endpoint for its next
/// bytes (`upstream_idle_timeout`), the client for taking them (`client_idle_timeout`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyIdle {
    pub upstream: Duration,
    pub client: Duration,
}

/// Where a streamed request body is, for the driver's try clock: the time of the last piece
/// read from the client (nanoseconds from the request's start), and whether a read from the
/// client is under way. Time waiting on the client never counts against the endpoint: the
/// try's clock restarts from each piece, and stands still while keel waits for the next.
#[derive(Debug, Default)]
pub(crate) struct BodyProgress(std::sync::atomic::AtomicU64);

impl BodyProgress {
    const READING: u64 = 1 << 63;

    /// A read from the client starts (`reading`) or ended, at `since` from the request's start.
    pub fn mark(&self, since: Duration, reading: bool) {
        let nanos = (since.as_nanos() as u64) & !Self::READING;
        let v = if reading {
            nanos | Self::READING
        } else {
            nanos
        };
        self.0.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// The deadline a try whose deadline `deadline` passed now has instead, if any: `per_try`
    /// from the last piece, or from now while keel waits on the client.
    pub fn moved(&self, start: Instant, per_try: Duration, deadline: Instant) -> Option<Instant> {
        let v = self.0.load(std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        let moved = if v & Self::READING != 0 {
            now + per_try
        } else {
            start + Duration::from_nanos(v) + per_try
        };
        (moved > now && moved > deadline).then_some(moved)
    }
}

/// [`until`] for a try whose request body streams: its deadline moves with `progress` (see
/// [`BodyProgress`]).
pub(crate) fn until_sent<'t, 'p, F: Future>(
    timer: &'t mut Pin<Box<Sleep>>,
    deadline: Instant,
    progress: Option<(&'p BodyProgress, Instant, Duration)>,
    fut: F,
) -> Until<'t, 'p, F> {
    Until::new(timer, deadline, progress, fut)
}

/// Spare read buffers, per thread: a connection that waits with nothing in its read buffer
/// (a client's request forwarded, an endpoint's answer not yet begun, an endpoint connection
/// idle in its pool) lends the buffer here and takes one back when it has bytes to read, so
/// that thousands of waiting connections do not hold 4 KB each, while a loaded thread reuses
/// the same few buffers and allocates none per request. [`spare::trim`], once a second, frees
/// those no connection took since the last trim.
pub(crate) mod spare {
    use std::cell::RefCell;

    use bytes::BytesMut;

    /// A read buffer's size: a request or response head fits (reads grow it for others).
    pub(crate) const SIZE: usize = 4096;
    /// At most this many spares a thread (4 MB).
    const MAX: usize = 1024;
    /// A buffer grown past this (a large head or body) is freed rather than kept.
    const KEEP_UP_TO: usize = 4 * SIZE;

    struct Spares {
        bufs: Vec<BytesMut>,
        /// The fewest spares held since the last trim: those below it were not taken.
        low: usize,
    }

    thread_local! {
        static SPARES: RefCell<Spares> = const {
            RefCell::new(Spares {
                bufs: Vec::new(),
                low: 0,
            })
        };
    }

    /// Lends `buf` to this thread's spares if it holds nothing (it is left without memory).
    pub(crate) fn lend(buf: &mut BytesMut) {
        if !buf.is_empty() || buf.capacity() == 0 {
            return;
        }
        let b = std::mem::take(buf);
        if b.capacity() > KEEP_UP_TO {
            return;
        }
        // Not there once the thread ends: the buffer is freed.
        let _ = SPARES.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.bufs.len() < MAX {
                s.bufs.push(b);
            }
        });
    }

    /// Gives `buf` memory again if it has none: a spare, or a new [`SIZE`] buffer.
    pub(crate) fn take(buf: &mut BytesMut) {
        if buf.capacity() != 0 {
            return;
        }
        let spare = SPARES
            .try_with(|s| {
                let mut s = s.borrow_mut();
                let b = s.bufs.pop();
                s.low = s.low.min(s.bufs.len());
                b
            })
            .ok()
            .flatten();
        *buf = spare.unwrap_or_else(|| BytesMut::with_capacity(SIZE));
    }

    /// Frees this thread's spares that were not taken since the last trim.
    pub(crate) fn trim() {
        let _ = SPARES.try_with(|s| {
            let mut s = s.borrow_mut();
            let unused = s.low;
            s.bufs.drain(..unused);
            s.low = s.bufs.len();
        });
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_spare_is_reused_and_trimmed_once_untaken() {
            let mut a = BytesMut::with_capacity(SIZE);
            let ptr = a.as_ptr();
            lend(&mut a);
            assert_eq!(a.capacity(), 0);
            take(&mut a);
            assert_eq!(a.as_ptr(), ptr, "the same memory back");
            // A buffer with bytes in it is not lent.
            a.extend_from_slice(b"x");
            lend(&mut a);
            assert_eq!(a.len(), 1);
            a.clear();
            lend(&mut a);
            trim(); // taken since the last trim: kept
            let mut b = BytesMut::new();
            take(&mut b);
            assert_eq!(b.as_ptr(), ptr);
            lend(&mut b);
            trim();
            assert_eq!(held(), 1, "lent since the last trim: kept");
            trim();
            assert_eq!(held(), 0, "not taken for a whole period: freed");
            let mut c = BytesMut::new();
            take(&mut c);
            assert_eq!(c.capacity(), SIZE);
        }

        fn held() -> usize {
            SPARES.with(|s| s.borrow().bufs.len())
        }
    }
}
