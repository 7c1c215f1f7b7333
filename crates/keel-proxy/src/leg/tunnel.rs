//! Byte tunnels between a client and an endpoint: an upgraded HTTP/1.1 connection (a `101`
//! to a WebSocket or other upgrade) and each connection of a TCP listener. Bytes are copied
//! both ways until both sides are done, either side fails, or nothing moved for the idle
//! timeout; the pick of the endpoint is finished with the tunnel's outcome when it ends.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::exchange::error::BodyEnd;
use crate::metrics::ClusterMetrics;

/// How a tunnel ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TunnelEnd {
    /// Bytes that came from the endpoint.
    pub from_upstream: u64,
    /// Reading from or writing to the endpoint failed (a reset).
    pub upstream_failed: bool,
    /// Reading from or writing to the client failed.
    pub client_failed: bool,
    /// Closed after the idle timeout.
    pub idle: bool,
}

impl TunnelEnd {
    /// The outcome for the pick: the endpoint's failure only when it reset the connection
    /// before any byte came back; a client that went away cancels the pick; anything else
    /// (a clean close, an idle timeout) is a success.
    pub fn outcome(&self) -> BodyEnd {
        if self.upstream_failed && self.from_upstream == 0 {
            BodyEnd::UpstreamFailed
        } else if self.client_failed && !self.upstream_failed {
            BodyEnd::ClientGone
        } else {
            BodyEnd::Done
        }
    }
}

/// What both directions of a tunnel record.
struct Activity {
    base: Instant,
    /// When bytes last moved, in nanoseconds since `base`.
    last: AtomicU64,
    from_upstream: AtomicU64,
    upstream_failed: AtomicBool,
    client_failed: AtomicBool,
}

impl Activity {
    fn touch(&self) {
        self.last
            .store(self.base.elapsed().as_nanos() as u64, Relaxed);
    }

    /// Resolves once no byte moved for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.last.load(Relaxed);
            tokio::time::sleep_until((self.base + Duration::from_nanos(last) + idle).into()).await;
            if self.last.load(Relaxed) == last {
                return;
            }
        }
    }
}

/// One side of the tunnel, recording its activity.
struct Watched<'a, S> {
    io: &'a mut S,
    activity: &'a Activity,
    upstream: bool,
}

impl<S> Watched<'_, S> {
    fn record<T>(&self, r: Poll<io::Result<T>>, moved: usize) -> Poll<io::Result<T>> {
        match &r {
            Poll::Ready(Ok(_)) if moved > 0 => {
                self.activity.touch();
                if self.upstream {
                    self.activity.from_upstream.fetch_add(moved as u64, Relaxed);
                }
            }
            Poll::Ready(Err(_)) => {
                let failed = if self.upstream {
                    &self.activity.upstream_failed
                } else {
                    &self.activity.client_failed
                };
                failed.store(true, Relaxed);
            }
            _ => {}
        }
        r
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut *this.io).poll_read(cx, buf);
        let moved = buf.filled().len() - before;
        this.record(r, moved)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_write(cx, buf);
        match r {
            Poll::Ready(Ok(n)) => {
                this.activity.touch();
                Poll::Ready(Ok(n))
            }
            // Written bytes are not counted as received from the endpoint.
            r => this.record_error(r),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_flush(cx);
        this.record_error(r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.io).poll_shutdown(cx);
        // A peer that already closed may refuse the shutdown: not a failure of the tunnel.
        match r {
            Poll::Ready(Err(_)) => Poll::Ready(Ok(())),
            r => r,
        }
    }
}

impl<S> Watched<'_, S> {
    fn record_error<T>(&self, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        self.record(r, 0)
    }
}

/// Copies bytes both ways between `client` and `upstream` until both are done, one fails,
/// or nothing moved for `idle`. `to_upstream` and `to_client` are bytes already read from
/// one side (with the request or the `101`), sent to the other first.
pub(crate) async fn run<C, U>(
    client: &mut C,
    upstream: &mut U,
    to_upstream: &[u8],
    to_client: &[u8],
    idle: Duration,
) -> TunnelEnd
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity {
        base: Instant::now(),
        last: AtomicU64::new(0),
        from_upstream: AtomicU64::new(to_client.len() as u64),
        upstream_failed: AtomicBool::new(false),
        client_failed: AtomicBool::new(false),
    };
    let mut c = Watched {
        io: client,
        activity: &activity,
        upstream: false,
    };
    let mut u = Watched {
        io: upstream,
        activity: &activity,
        upstream: true,
    };
    let mut idle_out = false;
    let early = async {
        if !to_upstream.is_empty() {
            u.write_all(to_upstream).await?;
        }
        if !to_client.is_empty() {
            c.write_all(to_client).await?;
            c.flush().await?;
        }
        Ok::<_, io::Error>(())
    }
    .await;
    if early.is_ok() {
        tokio::select! {
            r = tokio::io::copy_bidirectional(&mut c, &mut u) => {
                if let Err(e) = r {
                    tracing::debug!("tunnel ended: {e}");
                }
            }
            _ = activity.idle_for(idle) => idle_out = true,
        }
    }
    TunnelEnd {
        from_upstream: activity.from_upstream.load(Relaxed),
        upstream_failed: activity.upstream_failed.load(Relaxed),
        client_failed: activity.client_failed.load(Relaxed),
        idle: idle_out,
    }
}

/// Counts a tunnel in `keel_tunnels_open` while it lives.
pub(crate) struct TunnelGauge(Arc<ClusterMetrics>);

impl TunnelGauge {
    /// One more tunnel open on the cluster.
    pub fn new(metrics: &Arc<ClusterMetrics>) -> Self {
        let open: &AtomicI64 = &metrics.tunnels_open;
        open.fetch_add(1, Relaxed);
        crate::metrics::mark_connection(crate::metrics::ConnKind::Tunnel);
        Self(metrics.clone())
    }
}

impl Drop for TunnelGauge {
    fn drop(&mut self) {
        self.0.tunnels_open.fetch_sub(1, Relaxed);
    }
}
