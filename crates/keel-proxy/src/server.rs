//! Listeners, lifecycle and reload: [`start`] binds everything and returns a [`ProxyHandle`];
//! the routing (listener -> cluster) lives behind an `ArcSwap`, so a reload swaps it atomically
//! while requests in flight finish on the clusters they started on.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::cluster::Cluster;
use crate::config::ProxyConfig;
use crate::metrics::Registry;

/// What requests see: the cluster of each listener. Swapped whole on reload.
pub(crate) struct Routing {
    /// Cluster by listener index.
    pub listeners: Vec<Arc<Cluster>>,
    /// All clusters, in configuration order.
    pub clusters: Vec<Arc<Cluster>>,
}

/// State shared by listeners, the admin listener and the handle.
pub(crate) struct Shared {
    pub epoch: Instant,
    pub routing: ArcSwap<Routing>,
    pub config: ArcSwap<ProxyConfig>,
    pub registry: Registry,
    pub runtime: tokio::runtime::Handle,
    /// Threads serving connections (1 when they are served on `runtime`): the number of
    /// per-thread stacks in each endpoint's pool.
    pub workers: usize,
    /// Health-check tasks of the current clusters (cold path only).
    pub health_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Serializes reloads.
    pub reload_lock: Mutex<()>,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
    pub listener_addrs: Vec<SocketAddr>,
    /// TLS handshakes that failed or timed out, by listener index.
    pub tls_handshake_failures: Vec<AtomicU64>,
}

impl Shared {
    fn build_routing(
        &self,
        config: &ProxyConfig,
        previous: Option<&Routing>,
    ) -> anyhow::Result<Routing> {
        let mut clusters = Vec::with_capacity(config.clusters.len());
        for c in &config.clusters {
            let old = previous.and_then(|r| r.clusters.iter().find(|o| o.name() == c.name));
            let cluster = Cluster::build(
                c.clone(),
                old.map(|o| &**o),
                &self.registry,
                self.epoch,
                self.workers,
            )
            .with_context(|| format!("cluster `{}`", c.name))?;
            if c.health_check.is_none() {
                // Without checks nothing would ever mark an endpoint up again.
                for e in &cluster.endpoints {
                    cluster.balancer.set_healthy(e.id, true, cluster.now());
                }
            }
            clusters.push(Arc::new(cluster));
        }
        let listeners = config
            .listeners
            .iter()
            .map(|l| {
                clusters
                    .iter()
                    .find(|c| c.name() == l.cluster)
                    .cloned()
                    .with_context(|| format!("no cluster named `{}`", l.cluster))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Routing {
            listeners,
            clusters,
        })
    }

    fn restart_health_checks(&self, routing: &Routing) {
        let mut tasks = self.health_tasks.lock().unwrap_or_else(|e| e.into_inner());
        for t in tasks.drain(..) {
            t.abort();
        }
        for c in &routing.clusters {
            tasks.extend(crate::health::spawn(c, &self.runtime));
        }
    }

    /// Validates that the new configuration can be applied to the running listeners, then
    /// swaps it in.
    pub fn reload(&self, config: ProxyConfig) -> anyhow::Result<()> {
        let _serial = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        let result = self.try_reload(config);
        match &result {
            Ok(()) => {
                self.reloads.fetch_add(1, Relaxed);
                tracing::info!("configuration reloaded");
            }
            Err(e) => {
                self.reload_failures.fetch_add(1, Relaxed);
                tracing::error!("configuration reload refused, the old one keeps serving: {e:#}");
            }
        }
        result
    }

    fn try_reload(&self, config: ProxyConfig) -> anyhow::Result<()> {
        let old = self.config.load();
        let listens = |c: &ProxyConfig| c.listeners.iter().map(|l| l.listen).collect::<Vec<_>>();
        if listens(&old) != listens(&config) {
            anyhow::bail!(
                "the listeners' addresses changed ({:?} -> {:?}); a reload can change clusters and routes, not addresses: restart keel proxy instead",
                listens(&old),
                listens(&config)
            );
        }
        if let Some((i, _)) = old
            .listeners
            .iter()
            .zip(&config.listeners)
            .enumerate()
            .find(|(_, (a, b))| !a.same_socket_settings(b))
        {
            anyhow::bail!(
                "listener[{i}]'s connection limits, timeouts or TLS settings changed; a reload can change its cluster only: restart keel proxy to apply them"
            );
        }
        if old.admin != config.admin {
            anyhow::bail!("the [admin] listener changed; restart keel proxy to apply that");
        }
        let previous = self.routing.load();
        let routing = self.build_routing(&config, Some(&previous))?;
        self.restart_health_checks(&routing);
        self.routing.store(Arc::new(routing));
        self.config.store(Arc::new(config));
        Ok(())
    }
}

/// A running proxy.
pub struct ProxyHandle {
    shared: Arc<Shared>,
    admin_addr: Option<SocketAddr>,
    shutdown: watch::Sender<Option<Duration>>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("listeners", &self.shared.listener_addrs)
            .field("admin", &self.admin_addr)
            .finish()
    }
}

/// Binds every listener (port 0 = ephemeral) and the admin listener, starts health checks,
/// returns once it is accepting. Connections are served on the calling runtime.
pub async fn start(config: ProxyConfig) -> anyhow::Result<ProxyHandle> {
    start_with_workers(config, 0).await
}

/// Like [`start`], but with `workers` > 0 connections are served by that many threads, each
/// with its own single-threaded runtime and its own `SO_REUSEPORT` socket per listener (the
/// kernel spreads new connections over them), and its own stack of upstream connections in
/// every endpoint's pool: a request never leaves the thread that accepted its connection, so
/// threads do not wake each other. Admin, health checks and reloads stay on the calling
/// runtime. `workers` = 0 serves on the calling runtime.
pub async fn start_with_workers(
    config: ProxyConfig,
    workers: usize,
) -> anyhow::Result<ProxyHandle> {
    // TLS files are read again here (validation read them too) so that start fails, rather
    // than each connection, if they went away since.
    let acceptors = config
        .listeners
        .iter()
        .enumerate()
        .map(|(i, l)| {
            l.tls
                .as_ref()
                .map(|t| {
                    crate::tls::server_config(t)
                        .map(tokio_rustls::TlsAcceptor::from)
                        .with_context(|| format!("listener[{i}] ({}) tls", l.listen))
                })
                .transpose()
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Per listener, one socket per worker (one if no workers), all on the same port.
    let per_listener = workers.max(1);
    let mut bound: Vec<Vec<TcpListener>> = Vec::with_capacity(config.listeners.len());
    for l in &config.listeners {
        if workers > 0 && l.listen.port() != 0 {
            // SO_REUSEPORT would let a second proxy (same user) bind the same port and take
            // half the connections: a plain bind first makes that an "address in use" error.
            drop(
                std::net::TcpListener::bind(l.listen)
                    .with_context(|| format!("cannot listen on {}", l.listen))?,
            );
        }
        let mut sockets = Vec::with_capacity(per_listener);
        let mut addr = l.listen;
        for _ in 0..per_listener {
            let listener = bind_listener(addr, workers > 0)
                .with_context(|| format!("cannot listen on {}", l.listen))?;
            // An ephemeral port is chosen by the first bind; the others share it.
            addr = listener.local_addr()?;
            sockets.push(listener);
        }
        bound.push(sockets);
    }
    let admin = match &config.admin {
        Some(a) => Some(
            TcpListener::bind(a.listen)
                .await
                .with_context(|| format!("cannot listen on {} (admin)", a.listen))?,
        ),
        None => None,
    };
    let listener_addrs = bound
        .iter()
        .map(|l| l[0].local_addr())
        .collect::<std::io::Result<Vec<_>>>()?;
    let admin_addr = admin.as_ref().map(|a| a.local_addr()).transpose()?;

    let empty = Routing {
        listeners: Vec::new(),
        clusters: Vec::new(),
    };
    let shared = Arc::new(Shared {
        epoch: Instant::now(),
        routing: ArcSwap::from_pointee(empty),
        config: ArcSwap::from_pointee(config.clone()),
        registry: Registry::default(),
        runtime: tokio::runtime::Handle::current(),
        workers: per_listener,
        health_tasks: Mutex::new(Vec::new()),
        reload_lock: Mutex::new(()),
        reloads: AtomicU64::new(0),
        reload_failures: AtomicU64::new(0),
        tls_handshake_failures: listener_addrs.iter().map(|_| AtomicU64::new(0)).collect(),
        listener_addrs: listener_addrs.clone(),
    });
    let routing = shared.build_routing(&config, None)?;
    shared.restart_health_checks(&routing);
    shared.routing.store(Arc::new(routing));

    let (shutdown, shutdown_rx) = watch::channel(None);
    let mut tasks = Vec::new();
    if workers == 0 {
        for (i, (mut sockets, tls)) in bound.into_iter().zip(acceptors).enumerate() {
            tasks.push(tokio::spawn(accept_loop(
                shared.clone(),
                i,
                sockets.remove(0),
                tls,
                shutdown_rx.clone(),
            )));
        }
    } else {
        // Socket w of every listener goes to worker w. They are moved as std sockets and
        // registered again with the worker's own runtime.
        let mut per_worker: Vec<Vec<(usize, std::net::TcpListener)>> =
            (0..workers).map(|_| Vec::new()).collect();
        for (i, sockets) in bound.into_iter().enumerate() {
            for (w, l) in sockets.into_iter().enumerate() {
                per_worker[w].push((i, l.into_std()?));
            }
        }
        for (w, listeners) in per_worker.into_iter().enumerate() {
            let shared = shared.clone();
            let acceptors = acceptors.clone();
            let shutdown_rx = shutdown_rx.clone();
            let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("keel-worker-{w}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!("worker {w}: cannot build its runtime: {e}");
                            return;
                        }
                    };
                    crate::pool::set_worker(w);
                    rt.block_on(async move {
                        let mut loops = JoinSet::new();
                        for (i, l) in listeners {
                            match TcpListener::from_std(l) {
                                Ok(l) => {
                                    loops.spawn(accept_loop(
                                        shared.clone(),
                                        i,
                                        l,
                                        acceptors[i].clone(),
                                        shutdown_rx.clone(),
                                    ));
                                }
                                Err(e) => tracing::error!("worker {w}: listener[{i}]: {e}"),
                            }
                        }
                        while loops.join_next().await.is_some() {}
                    });
                    // Dropping the runtime here closes whatever the worker still held.
                    drop(rt);
                    let _ = done_tx.send(());
                })
                .context("cannot start a worker thread")?;
            tasks.push(tokio::spawn(async move {
                let _ = done_rx.await;
            }));
        }
    }
    if let Some(admin) = admin {
        tasks.push(tokio::spawn(crate::admin::serve(
            shared.clone(),
            admin,
            shutdown_rx.clone(),
        )));
    }
    Ok(ProxyHandle {
        shared,
        admin_addr,
        shutdown,
        tasks,
    })
}

impl ProxyHandle {
    /// The listeners' bound addresses, in configuration order.
    pub fn listener_addrs(&self) -> Vec<SocketAddr> {
        self.shared.listener_addrs.clone()
    }

    /// The admin listener's bound address, if any.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// Swaps in a new configuration atomically; endpoints that stay keep their state. Refused
    /// (and the old configuration kept) if it changes listener or admin addresses or a
    /// cluster cannot be built.
    pub fn reload(&self, config: ProxyConfig) -> anyhow::Result<()> {
        self.shared.reload(config)
    }

    /// TLS handshakes that failed or timed out on a listener (by configuration index).
    pub fn tls_handshake_failures(&self, listener: usize) -> u64 {
        self.shared
            .tls_handshake_failures
            .get(listener)
            .map_or(0, |c| c.load(Relaxed))
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<ProxyConfig> {
        self.shared.config.load_full()
    }

    /// keel-balance status of a cluster's endpoints (for tests and tools).
    pub fn cluster_status(&self, name: &str) -> Option<Vec<keel_balance::EndpointStatus>> {
        let routing = self.shared.routing.load();
        let c = routing.clusters.iter().find(|c| c.name() == name)?;
        Some(c.balancer.status(c.now()))
    }

    /// Stops accepting, lets requests in flight finish for up to `drain`, then cuts the rest.
    pub async fn shutdown(self, drain: Duration) {
        let _ = self.shutdown.send(Some(drain));
        for t in self.tasks {
            let _ = t.await;
        }
        let mut tasks = self
            .shared
            .health_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for t in tasks.drain(..) {
            t.abort();
        }
    }
}

/// Waits until the shutdown channel carries a drain time.
pub(crate) async fn wait_shutdown(rx: &mut watch::Receiver<Option<Duration>>) -> Duration {
    loop {
        if let Some(d) = *rx.borrow_and_update() {
            return d;
        }
        if rx.changed().await.is_err() {
            return Duration::ZERO;
        }
    }
}

/// A listening socket; with `reuse_port`, several can share the address (one per worker).
fn bind_listener(addr: SocketAddr, reuse_port: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's and tokio's `bind` do on Unix: a restarted proxy can bind at once.
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

async fn accept_loop(
    shared: Arc<Shared>,
    index: usize,
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut shutdown: watch::Receiver<Option<Duration>>,
) {
    // Listener settings cannot change by reload (it refuses that), so they are read once.
    let settings = Arc::new(shared.config.load().listeners[index].clone());
    let own_http1 = settings.http1 == crate::config::Http1Server::Keel;
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // hyper answers 431 when the line and headers do not fit, 400 when they are not HTTP.
        .max_buf_size(settings.max_header_bytes)
        .max_headers(settings.max_headers)
        // Runs from the moment the connection waits for a request (also between keep-alive
        // requests) until its headers are complete; then hyper closes the connection.
        .header_read_timeout(settings.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(settings.max_header_bytes.min(u32::MAX as usize) as u32);
    let builder = Arc::new(builder);
    let idle_timeout = settings.idle_timeout;
    let handshake_timeout = settings.header_read_timeout;
    let max_body = settings.max_request_body_bytes;
    // Connections beyond the limit are not accepted: they wait in the kernel's accept queue.
    let slots = Arc::new(tokio::sync::Semaphore::new(settings.max_connections));
    let mut conns = JoinSet::new();
    let drain = loop {
        tokio::select! {
            d = wait_shutdown(&mut shutdown) => break d,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = async {
                // Dropped (slot released) if another branch wins first; accept is cancel-safe.
                let slot = slots.clone().acquire_owned().await;
                (slot, listener.accept().await)
            } => {
                let (slot, accepted) = accepted;
                let Ok(slot) = slot else { continue };
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let builder = builder.clone();
                let mut stop = shutdown.clone();
                let tls = tls.clone();
                let settings = settings.clone();
                conns.spawn(async move {
                    let _slot = slot;
                    let client = crate::forward::Client::new(peer)
                        .with_max_request_body(max_body)
                        .with_tls(tls.is_some());
                    let Some(acceptor) = tls else {
                        if !own_http1 {
                            serve_connection(shared, index, &builder, TokioIo::new(stream), client, idle_timeout, stop).await;
                            return;
                        }
                        match crate::h1::serve(shared.clone(), index, settings, stream, peer, stop.clone()).await {
                            crate::h1::Served::Closed => {}
                            crate::h1::Served::Handoff(stream, read) => {
                                let io = TokioIo::new(crate::h1::Prefixed::new(read, stream));
                                serve_connection(shared, index, &builder, io, client, idle_timeout, stop).await;
                            }
                        }
                        return;
                    };
                    // Here, not in the accept loop: a slow or silent client delays only itself.
                    // The header-read timeout bounds the handshake, so it cannot hold a slot.
                    let handshake = tokio::select! {
                        r = tokio::time::timeout(handshake_timeout, acceptor.accept(stream)) => r,
                        _ = wait_shutdown(&mut stop) => return,
                    };
                    let cause = match handshake {
                        Ok(Ok(tls_stream)) => {
                            serve_connection(shared, index, &builder, TokioIo::new(tls_stream), client, idle_timeout, stop).await;
                            return;
                        }
                        Ok(Err(e)) => e.to_string(),
                        Err(_) => format!("not finished within {}", humantime::format_duration(handshake_timeout)),
                    };
                    shared.tls_handshake_failures[index].fetch_add(1, Relaxed);
                    tracing::debug!(%peer, "TLS handshake failed: {cause}");
                });
            }
        }
    };
    drop(listener);
    let finished =
        tokio::time::timeout(drain, async { while conns.join_next().await.is_some() {} }).await;
    if finished.is_err() {
        tracing::warn!(
            "drain timeout: cutting {} connection(s) still busy",
            conns.len()
        );
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

/// Serves one client connection (plain or TLS) until it ends, stays idle too long, or the
/// proxy shuts down (then it finishes its requests in flight).
async fn serve_connection<I>(
    shared: Arc<Shared>,
    index: usize,
    builder: &hyper_util::server::conn::auto::Builder<TokioExecutor>,
    io: TokioIo<I>,
    client: crate::forward::Client,
    idle_timeout: Duration,
    mut stop: watch::Receiver<Option<Duration>>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let peer = client.peer;
    let client = Arc::new(client);
    let activity = client.activity.clone();
    let svc = service_fn(move |req| {
        let cluster = shared.routing.load().listeners[index].clone();
        let client = client.clone();
        async move {
            Ok::<_, std::convert::Infallible>(crate::forward::handle(cluster, &client, req).await)
        }
    });
    let conn = builder.serve_connection(io, svc);
    tokio::pin!(conn);
    tokio::select! {
        biased;
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!("client connection: {e}");
            }
            return;
        }
        _ = wait_shutdown(&mut stop) => {}
        _ = activity.idle_for(idle_timeout) => {
            tracing::debug!(%peer, "closing a connection idle for {}", humantime::format_duration(idle_timeout));
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
}
