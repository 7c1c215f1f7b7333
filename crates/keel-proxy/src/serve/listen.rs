//! Sockets and threads: binding (or taking over an inherited socket), the accept loops, the
//! hand-off to the worker with the fewest connections, the workers' loops, and each
//! connection's drain.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::serve::quic;
use crate::serve::sniff::serve_accepted;
use crate::state::{
    log_drained, wait_shutdown, Accepted, AdminSlot, ConnKind, Connection, Dispatch, ListenerCtx,
    ListenerSlot, Shared, CONN_KIND,
};

impl Shared {
    /// A listening socket for `addr`: the one inherited from the process this one replaces,
    /// if it had that address, else a new one.
    pub(crate) fn bind(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        if let Some(l) = self.take_inherited(addr) {
            return l;
        }
        let _rt = self.runtime.enter();
        bind_listener(addr)
    }

    pub(crate) fn bind_admin(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        self.bind(addr)
    }

    pub(crate) fn take_inherited(&self, addr: SocketAddr) -> Option<std::io::Result<TcpListener>> {
        let mut inherited = self
            .listening
            .inherited
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let pos = inherited.iter().position(|(a, _)| *a == addr)?;
        let (_, l) = inherited.remove(pos);
        let _rt = self.runtime.enter();
        Some(
            l.set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(l)),
        )
    }

    /// Starts accepting on a bound listener.
    pub(crate) fn open_listener(
        &self,
        listener: TcpListener,
        ctx: ListenerCtx,
    ) -> Arc<ListenerSlot> {
        let addr = listener.local_addr().unwrap_or(ctx.settings.listen);
        // The UDP port first: TCP answers announce HTTP/3 only if it is served.
        let endpoint = self.open_quic(addr, &ctx);
        let ctx = ctx.bound_at(addr.port(), endpoint.is_some());
        let max = ctx.settings.max_connections;
        let (stop, _) = watch::channel(None);
        let slot = Arc::new(ListenerSlot {
            index: ctx.index,
            listen: ctx.settings.listen,
            addr,
            slots: Arc::new(tokio::sync::Semaphore::new(max)),
            max_connections: AtomicUsize::new(max),
            ctx: ArcSwap::from_pointee(ctx),
            stop,
            open: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            cut: Default::default(),
            tls_handshake_failures: AtomicU64::new(0),
            proxy_refused: Default::default(),
            proxy_refusal_logged: Default::default(),
            not_found: AtomicU64::new(0),
            fd: std::os::fd::AsRawFd::as_raw_fd(&listener),
            quic: endpoint
                .clone()
                .map(std::sync::OnceLock::from)
                .unwrap_or_default(),
            task: Mutex::new(None),
        });
        let mut all = Vec::clone(&self.listening.all_listeners.load());
        debug_assert_eq!(
            all.len(),
            slot.index,
            "listener indexes are handed out in order"
        );
        all.push(slot.clone());
        self.listening.all_listeners.store(Arc::new(all));
        let me = self
            .me
            .upgrade()
            .expect("the proxy is alive while it opens listeners");
        let tcp = accept_loop(
            me.clone(),
            slot.clone(),
            listener,
            self.listening.dispatch.clone(),
        );
        let quic = endpoint.map(|e| quic::accept_loop(me, slot.clone(), e));
        let task = self.runtime.spawn(async move {
            match quic {
                Some(quic) => drop(tokio::join!(tcp, quic)),
                None => tcp.await,
            }
        });
        *slot.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        slot
    }

    /// The QUIC endpoint of a listener that serves HTTP/3, on its bound address; `None` (and
    /// an error in the log) if the UDP port cannot be had.
    fn open_quic(&self, addr: SocketAddr, ctx: &ListenerCtx) -> Option<quinn::Endpoint> {
        let config = ctx.quic.clone()?;
        let _rt = self.runtime.enter();
        match quic::endpoint(addr, config) {
            Ok(endpoint) => Some(endpoint),
            Err(e) => {
                tracing::error!(listener = %addr, "cannot serve HTTP/3 (no Alt-Svc announced): UDP {addr}: {e}");
                None
            }
        }
    }

    pub(crate) fn open_admin(&self, listener: TcpListener) {
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => {
                tracing::error!("admin listener: {e}");
                return;
            }
        };
        let listen = self.config.load().admin.as_ref().map_or(addr, |a| a.listen);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let (stop, stop_rx) = watch::channel(None);
        let me = self
            .me
            .upgrade()
            .expect("the proxy is alive while it opens listeners");
        let task = self
            .runtime
            .spawn(crate::admin::serve(me, listener, stop_rx));
        *self
            .listening
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(AdminSlot {
            listen,
            addr,
            fd,
            stop,
            task,
        });
    }

    /// Stops accepting on a listener the configuration no longer has; its connections drain
    /// (idle ones close at once, requests in flight get `drain`, then are cut), counted in the
    /// log when the last one ends.
    pub(crate) fn remove_listener(&self, slot: Arc<ListenerSlot>, drain: Duration) {
        // send_replace: stored even before the accept loop has subscribed (send would drop it).
        slot.stop.send_replace(Some(drain));
        tracing::info!(listener = %slot.addr, "listener removed by reload: draining its connections for up to {}", humantime::format_duration(drain));
        let task = slot.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.runtime.spawn(async move {
            if let Some(t) = task {
                let _ = t.await;
            }
            // Connections served by workers end on their own threads.
            while slot.open.load(Relaxed) > 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            log_drained(&format!("listener {} drained", slot.addr), &[slot]);
        });
    }
}

/// A listening socket.
pub(crate) fn bind_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's and tokio's `bind` do on Unix: a restarted proxy can bind at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

impl Connection {
    /// Serves the connection until it ends; once its listener drains (removed, or the proxy
    /// stopping) it has the drain time to finish, then it is cut and counted.
    ///
    /// The connection's task, held for its whole life: an `async` block, not an `async fn`,
    /// which would keep each argument twice (as given, and moved into its body).
    #[allow(clippy::manual_async_fn)] // the async block is the point (see above)
    pub(crate) fn serve(
        self,
        shared: Arc<Shared>,
        worker: usize,
        stream: TcpStream,
    ) -> impl std::future::Future<Output = ()> {
        async move {
            let mut stop = self.listener.stop.subscribe();
            let kind = Arc::new(AtomicU8::new(ConnKind::Opening as u8));
            // Pinned where it is made (std's pin!, not tokio's, which moves it into a second
            // local, which the task may then hold twice).
            let mut served = std::pin::pin!(CONN_KIND.scope(
                kind.clone(),
                serve_accepted(
                    shared,
                    &self.ctx,
                    &self.listener,
                    worker,
                    stream,
                    self.peer,
                    stop.clone(),
                ),
            ));
            let deadline = async {
                let drain = wait_shutdown(&mut stop).await;
                // Boxed: made only once the listener drains, a timer held inline would sit in
                // every connection's task for its whole life.
                Box::pin(tokio::time::sleep(drain)).await;
            };
            tokio::select! {
                () = &mut served => {}
                () = deadline => {
                    let k = usize::from(kind.load(Relaxed)).min(ConnKind::COUNT - 1);
                    self.listener.cut[k].fetch_add(1, Relaxed);
                    tracing::debug!(peer = %self.peer, kind = ConnKind::NAMES[k], "drain timeout: connection cut");
                }
            }
        }
    }
}

/// A worker thread's life: serves the connections handed to it until shutdown, then waits
/// for them to end (each drains on its own: see [`Connection::serve`]).
pub(crate) async fn worker_loop(
    worker: usize,
    shared: Arc<Shared>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Accepted>,
    mut shutdown: watch::Receiver<Option<Duration>>,
) {
    let mut conns = JoinSet::new();
    let drain = loop {
        tokio::select! {
            d = wait_shutdown(&mut shutdown) => break d,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            got = rx.recv() => {
                // No more connections will come (the accept side is gone), which is not a
                // drain: the connections here still get theirs.
                let Some(a) = got else { break wait_shutdown(&mut shutdown).await };
                let stream = match TcpStream::from_std(a.stream) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(peer = %a.conn.peer, "worker cannot take a connection: {e}");
                        continue;
                    }
                };
                conns.spawn(a.conn.serve(shared.clone(), worker, stream));
            }
        }
    };
    // Connections accepted before the drain and still on their way here are served (as
    // draining), not dropped: their clients may have sent requests already.
    rx.close();
    while let Ok(a) = rx.try_recv() {
        let Ok(stream) = TcpStream::from_std(a.stream) else {
            continue;
        };
        conns.spawn(a.conn.serve(shared.clone(), worker, stream));
    }
    wait_connections(conns, drain).await;
}

/// How often [`collect_ticks`] calls the allocator's collection: past mimalloc's purge delay
/// (1 s in v3) a page freed at one tick is given back at the next or the one after.
const COLLECT_EVERY: Duration = Duration::from_secs(1);

/// Every [`COLLECT_EVERY`] on the thread it runs on, until shutdown: frees the thread's spare
/// read buffers no connection took ([`crate::io::spare::trim`]), then calls `collect`. A timer
/// per thread, not per connection: nothing is added to a request's path.
pub(crate) async fn collect_ticks(
    collect: Option<fn()>,
    mut shutdown: watch::Receiver<Option<Duration>>,
) {
    let mut every =
        tokio::time::interval_at(tokio::time::Instant::now() + COLLECT_EVERY, COLLECT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = wait_shutdown(&mut shutdown) => return,
            _ = every.tick() => {
                crate::io::spare::trim();
                if let Some(collect) = collect {
                    collect();
                }
            }
        }
    }
}

/// Waits for connections that drain on their own; a backstop a little past the drain time
/// aborts any that did not (none should).
pub(crate) async fn wait_connections(mut conns: JoinSet<()>, drain: Duration) {
    let backstop = drain + Duration::from_secs(1);
    let finished = tokio::time::timeout(backstop, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::warn!("{} connection(s) outlived the drain; aborted", conns.len());
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

pub(crate) async fn accept_loop(
    shared: Arc<Shared>,
    listener: Arc<ListenerSlot>,
    socket: TcpListener,
    dispatch: Option<Arc<Dispatch>>,
) {
    let mut stop = listener.stop.subscribe();
    // Connections served here (no workers).
    let mut conns = JoinSet::new();
    let drain = loop {
        tokio::select! {
            d = wait_shutdown(&mut stop) => break d,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = async {
                // Dropped (slot released) if another branch wins first; accept is cancel-safe.
                let slot = listener.slots.clone().acquire_owned().await;
                (slot, socket.accept().await)
            } => {
                let (slot, accepted) = accepted;
                let Ok(slot) = slot else { continue };
                let (stream, peer) = match accepted {
                    // An IPv4 client of a dual-stack (`[::]`) listener arrives as
                    // `::ffff:a.b.c.d`: it is that IPv4 address for every use (allow/deny,
                    // trusted_proxies, X-Forwarded-For, hashing, the access log).
                    Ok((stream, peer)) => (stream, SocketAddr::new(peer.ip().to_canonical(), peer.port())),
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if near_fd_limit(&stream) {
                    // Shed this connection rather than spend the last descriptors on it: the
                    // admin listener and the connections to endpoints need them.
                    drop(stream);
                    if shared.listening.fd_shed_log.allow() {
                        tracing::warn!(
                            suppressed = shared.listening.fd_shed_log.take_suppressed(),
                            "near the open-file limit ({} descriptors kept free): connection from {peer} closed",
                            fd_reserve(),
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let conn = Connection::new(&listener, peer, slot);
                match &dispatch {
                    Some(d) => d.send(conn, stream),
                    None => {
                        let shared = shared.clone();
                        conns.spawn(conn.serve(shared, 0, stream));
                    }
                }
            }
        }
    };
    drop(socket);
    wait_connections(conns, drain).await;
}

/// The process's open-file limit (soft), read once.
fn fd_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0;
        if ok && l.rlim_cur != libc::RLIM_INFINITY {
            l.rlim_cur
        } else {
            u64::MAX
        }
    })
}

/// Descriptors the data listeners leave free: 64, or a sixteenth of a small limit.
pub(crate) fn fd_reserve() -> u64 {
    (fd_limit() / 16).min(64)
}

/// True if an accepted connection's descriptor is among the last [`fd_reserve`] below the
/// limit. Descriptors are allocated lowest first, so a high one means all below it are open.
fn near_fd_limit(stream: &tokio::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd() as u64;
    fd.saturating_add(fd_reserve()) >= fd_limit()
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use super::*;
    use crate::future_size::returned;

    /// What every connection's task holds for its life, whatever it waits for (run with
    /// `--nocapture` to see the sizes): 1,544 bytes before it was made of `async` blocks.
    #[test]
    fn a_connection_task_is_small() {
        let task = returned(Connection::serve);
        let accepted = returned(serve_accepted);
        eprintln!(
            "sizes: task {task} B, serve_accepted {accepted} B, Connection {} B, Client {} B, \
             TcpStream {} B",
            size_of::<Connection>(),
            size_of::<crate::exchange::request::Client>(),
            size_of::<TcpStream>(),
        );
        assert!(task <= 1024, "{task}");
    }
}
