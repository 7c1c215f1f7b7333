//! An endpoint's multiplexed HTTP/2 connections (clusters with `protocol = "h2c"` or `"h2"`),
//! a list per worker; the HTTP/2 leg takes a stream on the first connection below the
//! endpoint's `SETTINGS_MAX_CONCURRENT_STREAMS`, or waits for the connection being opened,
//! or opens another. Held by the endpoint's entry beside its HTTP/1.1 pool, whose connector
//! opens them.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::sync::watch;

use crate::upstream::pool::{ConnectError, EndpointPool};

/// Stream and connection windows keel offers endpoints: large enough that a response body
/// is not held back by window updates on a fast network.
const WINDOW: u32 = 1 << 20;
const CONNECTION_WINDOW: u32 = 4 << 20;

/// Streams a connection is assumed to take before the endpoint's SETTINGS say how many it
/// takes (RFC 9113 section 6.5.2 recommends allowing no fewer than 100): the h2 client's
/// limit until then, and how many requests wait on a connection being opened.
const ASSUMED_STREAMS: usize = 100;

/// One multiplexed connection to an endpoint.
struct H2Conn {
    send: SendRequest<Bytes>,
    /// Streams of keel's requests open on it.
    open: Arc<AtomicUsize>,
    /// The connection ended (its driver returned).
    closed: Arc<AtomicBool>,
}

/// A worker's connections to the endpoint, and the one being opened, if any.
#[derive(Default)]
struct Conns {
    ready: Vec<H2Conn>,
    opening: Option<Opening>,
}

/// A connection being opened: the requests that wait for it instead of opening their own
/// (a burst at start would otherwise open one connection per request).
struct Opening {
    /// Tells apart an opening from the one after it (the first was cancelled).
    id: u64,
    outcome: watch::Receiver<Option<Outcome>>,
    waiting: usize,
}

/// How an opening ended: `Ok` with the connection in the list, or the connect's error.
type Outcome = Result<(), SharedConnectError>;

/// A connect error every waiting request reports (`ConnectError` holds an `io::Error`,
/// which does not clone).
#[derive(Clone)]
enum SharedConnectError {
    Failed(std::io::ErrorKind, String),
    TimedOut(Duration),
}

impl From<&ConnectError> for SharedConnectError {
    fn from(e: &ConnectError) -> Self {
        match e {
            ConnectError::Failed(e) => SharedConnectError::Failed(e.kind(), e.to_string()),
            ConnectError::TimedOut(d) => SharedConnectError::TimedOut(*d),
        }
    }
}

impl From<SharedConnectError> for ConnectError {
    fn from(e: SharedConnectError) -> Self {
        match e {
            SharedConnectError::Failed(kind, text) => {
                ConnectError::Failed(std::io::Error::new(kind, text))
            }
            SharedConnectError::TimedOut(d) => ConnectError::TimedOut(d),
        }
    }
}

/// An endpoint's HTTP/2 connections, a list per worker (used only by that worker's thread,
/// whose runtime drives them).
pub(crate) struct H2Conns {
    lists: Box<[Mutex<Conns>]>,
    openings: AtomicU64,
}

/// A stream counted on its connection until the response is done with.
pub(crate) struct StreamSlot(Arc<AtomicUsize>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// What a request does next: take a stream, wait for the connection being opened, or open
/// one itself.
enum Next {
    Stream(SendRequest<Bytes>, StreamSlot),
    Wait(watch::Receiver<Option<Outcome>>),
    Open(u64, watch::Sender<Option<Outcome>>),
}

/// Clears the opening when it ends, and when its request drops it before (the client went
/// away, or the try's deadline passed): then its waiters see the sender go and look again.
struct OpeningGuard<'a> {
    conns: &'a H2Conns,
    worker: usize,
    id: u64,
}

impl Drop for OpeningGuard<'_> {
    fn drop(&mut self) {
        let mut list = self.conns.list(self.worker);
        if list.opening.as_ref().is_some_and(|o| o.id == self.id) {
            list.opening = None;
        }
    }
}

impl H2Conns {
    /// Empty lists for `workers` workers.
    pub(crate) fn new(workers: usize) -> Self {
        Self {
            lists: (0..workers.max(1))
                .map(|_| Mutex::new(Conns::default()))
                .collect(),
            openings: AtomicU64::new(0),
        }
    }

    fn list(&self, worker: usize) -> std::sync::MutexGuard<'_, Conns> {
        self.lists[worker % self.lists.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A stream on one of worker `worker`'s connections with room for it; else on the
    /// connection being opened, once it is (while fewer than [`ASSUMED_STREAMS`] requests
    /// wait for it); else on a new one.
    pub(crate) async fn stream(
        &self,
        worker: usize,
        pool: &EndpointPool,
    ) -> Result<(SendRequest<Bytes>, StreamSlot), ConnectError> {
        loop {
            match self.next(worker) {
                Next::Stream(send, slot) => return Ok((send, slot)),
                Next::Wait(mut outcome) => {
                    // A sender gone (the opening request dropped) means: look again.
                    if let Ok(done) = outcome.wait_for(Option::is_some).await {
                        if let Some(Err(e)) = &*done {
                            return Err(e.clone().into());
                        }
                    }
                }
                Next::Open(id, tell) => return self.open(worker, pool, id, tell).await,
            }
        }
    }

    fn next(&self, worker: usize) -> Next {
        let mut list = self.list(worker);
        list.ready.retain(|c| !c.closed.load(Relaxed));
        for c in list.ready.iter() {
            // The endpoint's SETTINGS_MAX_CONCURRENT_STREAMS, as last announced.
            if c.open.load(Relaxed) < c.send.current_max_send_streams() {
                c.open.fetch_add(1, Relaxed);
                return Next::Stream(c.send.clone(), StreamSlot(c.open.clone()));
            }
        }
        if let Some(o) = list
            .opening
            .as_mut()
            .filter(|o| o.waiting < ASSUMED_STREAMS)
        {
            o.waiting += 1;
            return Next::Wait(o.outcome.clone());
        }
        let id = self.openings.fetch_add(1, Relaxed);
        let (tell, outcome) = watch::channel(None);
        list.opening = Some(Opening {
            id,
            outcome,
            waiting: 0,
        });
        Next::Open(id, tell)
    }

    /// Opens a connection, puts it in the list and takes its first stream; the requests
    /// waiting for it are told.
    async fn open(
        &self,
        worker: usize,
        pool: &EndpointPool,
        id: u64,
        tell: watch::Sender<Option<Outcome>>,
    ) -> Result<(SendRequest<Bytes>, StreamSlot), ConnectError> {
        let guard = OpeningGuard {
            conns: self,
            worker,
            id,
        };
        // Boxed: the connect and handshake futures are large, and every request's future
        // would carry them though few requests open a connection.
        let opened = Box::pin(async {
            let conn = pool.connect().await?;
            h2::client::Builder::new()
                .initial_window_size(WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .initial_max_send_streams(ASSUMED_STREAMS)
                .handshake::<_, Bytes>(conn.io)
                .await
                .map_err(|e| ConnectError::Failed(std::io::Error::other(e)))
        })
        .await;
        let (send, driver) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                drop(guard);
                let _ = tell.send(Some(Err((&e).into())));
                return Err(e);
            }
        };
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
        self.list(worker).ready.push(H2Conn {
            send: send.clone(),
            open: open.clone(),
            closed,
        });
        drop(guard);
        let _ = tell.send(Some(Ok(())));
        Ok((send, StreamSlot(open)))
    }
}
