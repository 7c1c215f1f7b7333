//! An endpoint's multiplexed HTTP/2 connections (clusters with `protocol = "h2c"` or `"h2"`),
//! a list per worker; the HTTP/2 leg takes a stream on the first connection below the
//! endpoint's `SETTINGS_MAX_CONCURRENT_STREAMS`, or opens another. Held by the endpoint's
//! entry beside its HTTP/1.1 pool, whose connector opens them.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use h2::client::SendRequest;

use crate::upstream::pool::{ConnectError, EndpointPool};

/// Stream and connection windows keel offers endpoints: large enough that a response body
/// is not held back by window updates on a fast network.
const WINDOW: u32 = 1 << 20;
const CONNECTION_WINDOW: u32 = 4 << 20;

/// One multiplexed connection to an endpoint.
struct H2Conn {
    send: SendRequest<Bytes>,
    /// Streams of keel's requests open on it.
    open: Arc<AtomicUsize>,
    /// The connection ended (its driver returned).
    closed: Arc<AtomicBool>,
}

/// An endpoint's HTTP/2 connections, a list per worker (used only by that worker's thread,
/// whose runtime drives them).
pub(crate) struct H2Conns {
    lists: Box<[Mutex<Vec<H2Conn>>]>,
}

/// A stream counted on its connection until the response is done with.
pub(crate) struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl H2Conns {
    /// Empty lists for `workers` workers.
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            lists: (0..workers.max(1))
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
        }
    }

    fn list(&self, worker: usize) -> std::sync::MutexGuard<'_, Vec<H2Conn>> {
        self.lists[worker % self.lists.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A stream on one of worker `worker`'s connections with room for it, or on a new one.
    pub(crate) async fn stream(
        &self,
        worker: usize,
        pool: &EndpointPool,
    ) -> Result<(SendRequest<Bytes>, StreamSlot), ConnectError> {
        {
            let mut list = self.list(worker);
            list.retain(|c| !c.closed.load(Relaxed));
            for c in list.iter() {
                // The endpoint's SETTINGS_MAX_CONCURRENT_STREAMS, as last announced.
                if c.open.load(Relaxed) < c.send.current_max_send_streams() {
                    c.open.fetch_add(1, Relaxed);
                    return Ok((c.send.clone(), StreamSlot(c.open.clone())));
                }
            }
        }
        // Boxed: the connect and handshake futures are large, and every request's future
        // would carry them though few requests open a connection.
        let (send, driver) = Box::pin(async {
            let conn = pool.connect().await?;
            h2::client::Builder::new()
                .initial_window_size(WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .handshake::<_, Bytes>(conn.io)
                .await
                .map_err(|e| ConnectError::Failed(std::io::Error::other(e)))
        })
        .await?;
        let closed = Arc::new(AtomicBool::new(false));
        let ended = closed.clone();
        // The connection's frames are read and written by its own task, on this worker's
        // runtime, for as long as it lives.
        tokio::spawn(async move {
            if let Err(e) = driver.await {
                tracing::debug!("HTTP/2 connection to an endpoint ended: {e}");
            }
            ended.store(true, Relaxed);
        });
        let open = Arc::new(AtomicUsize::new(1));
        self.list(worker).push(H2Conn {
            send: send.clone(),
            open: open.clone(),
            closed,
        });
        Ok((send, StreamSlot(open)))
    }
}
