//! Listeners, lifecycle and reload: [`start`] binds everything and returns a [`ProxyHandle`];
//! the routing (listener -> cluster) lives behind an `ArcSwap`, so a reload swaps it atomically
//! while requests in flight finish on the clusters they started on.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arc_swap::ArcSwap;
use keel_balance::EndpointSpec;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::attempt::Client;
use crate::cluster::Cluster;
use crate::config::{ClusterConfig, ProxyConfig};
use crate::discovery::Discovered;
use crate::h1;
use crate::metrics::Registry;
use crate::route::ListenerRoutes;

/// What requests see: each listener's routes, and the clusters they lead to. Swapped whole on
/// reload.
pub(crate) struct Routing {
    /// Routes by listener index.
    pub listeners: Vec<ListenerRoutes>,
    /// All clusters, in configuration order.
    pub clusters: Vec<Arc<Cluster>>,
}

/// Why a reload from the configuration file did not happen.
#[derive(Debug)]
pub enum ReloadError {
    /// The proxy was not started from a file.
    NoFile,
    /// The file is invalid, or cannot be applied to the running proxy; the old configuration
    /// keeps serving.
    Refused(anyhow::Error),
}

impl std::fmt::Display for ReloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReloadError::NoFile => f.write_str("the proxy was not started from a file"),
            ReloadError::Refused(e) => write!(f, "{e:#}"),
        }
    }
}

impl std::error::Error for ReloadError {}

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
    /// Health-check tasks of the current clusters, by cluster name (cold path only).
    pub health_tasks: Mutex<Vec<(String, JoinHandle<()>)>>,
    /// Discovery state by cluster name.
    pub discovery: Mutex<HashMap<String, Arc<Discovered>>>,
    /// Discovery tasks of the current clusters.
    pub discovery_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Itself, for the tasks that apply what discovery finds (weak: they do not keep the proxy
    /// alive).
    pub me: std::sync::Weak<Shared>,
    /// Serializes reloads.
    pub reload_lock: Mutex<()>,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
    pub listener_addrs: Vec<SocketAddr>,
    /// TLS handshakes that failed or timed out, by listener index.
    pub tls_handshake_failures: Vec<AtomicU64>,
    /// Requests that no route matched on a listener without `cluster` (`404`), by listener
    /// index.
    pub not_found: Vec<AtomicU64>,
    /// The access log, if configured.
    pub access_log: Option<Arc<crate::access_log::AccessLog>>,
    /// Client connections open on each worker thread (empty without workers).
    pub worker_connections: Arc<[AtomicUsize]>,
}

impl Shared {
    /// Counts a `404` for want of a route on listener `index`.
    pub fn count_not_found(&self, index: usize) {
        self.not_found[index].fetch_add(1, Relaxed);
    }

    /// Builds a cluster (from the running one of the same name, whose endpoints that stay keep
    /// their state).
    fn build_cluster(
        &self,
        config: ClusterConfig,
        old: Option<&Cluster>,
    ) -> anyhow::Result<Arc<Cluster>> {
        let name = config.name.clone();
        let cluster = Cluster::build(config, old, &self.registry, self.epoch, self.workers)
            .with_context(|| format!("cluster `{name}`"))?;
        if cluster.config.health_check.is_none() {
            // Without checks nothing would ever mark an endpoint up again.
            for e in &cluster.endpoints {
                cluster.balancer.set_healthy(e.id, true, cluster.now());
            }
        }
        Ok(Arc::new(cluster))
    }

    /// The listeners' route tables over `clusters`.
    fn build_listeners(
        config: &ProxyConfig,
        clusters: &[Arc<Cluster>],
    ) -> anyhow::Result<Vec<ListenerRoutes>> {
        config
            .listeners
            .iter()
            .enumerate()
            .map(|(i, l)| {
                ListenerRoutes::build(l, |name| {
                    clusters.iter().find(|c| c.name() == name).cloned()
                })
                .with_context(|| format!("listener[{i}]"))
            })
            .collect()
    }

    /// Builds what requests see from `config`; a cluster with discovery gets the endpoints
    /// `discovered` last found for it.
    fn build_routing(
        &self,
        config: &ProxyConfig,
        previous: Option<&Routing>,
        discovered: &HashMap<String, Arc<Discovered>>,
    ) -> anyhow::Result<Routing> {
        let mut clusters = Vec::with_capacity(config.clusters.len());
        for c in &config.clusters {
            let old = previous.and_then(|r| r.clusters.iter().find(|o| o.name() == c.name));
            let mut c = c.clone();
            if let Some(d) = discovered.get(&c.name) {
                c.endpoints = d.endpoints();
            }
            clusters.push(self.build_cluster(c, old.map(|o| &**o))?);
        }
        let listeners = Self::build_listeners(config, &clusters)?;
        Ok(Routing {
            listeners,
            clusters,
        })
    }

    /// The discovery state of `config`'s clusters: kept for a cluster whose source did not
    /// change; a new file source is read at once (DNS sources are first resolved by their
    /// task).
    fn sync_discovery(&self, config: &ProxyConfig) -> HashMap<String, Arc<Discovered>> {
        let old = self.discovery.lock().unwrap_or_else(|e| e.into_inner());
        let mut now = HashMap::new();
        for c in &config.clusters {
            let Some(d) = &c.discovery else { continue };
            let entry = match old.get(&c.name) {
                Some(e) if e.config == *d => e.clone(),
                _ => {
                    let e = Arc::new(Discovered::new(d.clone()));
                    if let crate::config::DiscoveryConfig::File { path } = d {
                        e.record(&c.name, crate::discovery::read_file(path));
                    }
                    e
                }
            };
            now.insert(c.name.clone(), entry);
        }
        now
    }

    /// Puts `discovered` in force and (re)starts one discovery task per cluster that has it.
    fn restart_discovery(&self, discovered: HashMap<String, Arc<Discovered>>) {
        let mut tasks = self
            .discovery_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for t in tasks.drain(..) {
            t.abort();
        }
        // In force before the tasks start: a set they find is applied only to the current
        // source (and it is recorded once, so one found too early would be lost).
        *self.discovery.lock().unwrap_or_else(|e| e.into_inner()) = discovered.clone();
        for (name, d) in discovered {
            let me = self.me.clone();
            tasks.push(self.runtime.spawn(crate::discovery::run(
                name,
                d,
                move |cluster, d, set| {
                    if let Some(shared) = me.upgrade() {
                        shared.apply_discovered(cluster, d, set);
                    }
                },
            )));
        }
    }

    /// Applies a new set of endpoints found for cluster `name`: the cluster is rebuilt from the
    /// running one (endpoints that stay keep their state) and swapped in, with the route tables
    /// that lead to it.
    fn apply_discovered(&self, name: &str, discovered: &Arc<Discovered>, set: Vec<EndpointSpec>) {
        let _serial = self.reload_lock.lock().unwrap_or_else(|e| e.into_inner());
        // A reload may have replaced the source since this set was found.
        let current = self
            .discovery
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .is_some_and(|d| Arc::ptr_eq(d, discovered));
        if !current {
            return;
        }
        let config = self.config.load();
        let routing = self.routing.load();
        let Some(pos) = routing.clusters.iter().position(|c| c.name() == name) else {
            return;
        };
        let old = &routing.clusters[pos];
        let mut cc = old.config.clone();
        cc.endpoints = set;
        let applied = self.build_cluster(cc, Some(old)).and_then(|cluster| {
            let mut clusters = routing.clusters.clone();
            clusters[pos] = cluster;
            let listeners = Self::build_listeners(&config, &clusters)?;
            Ok(Routing {
                listeners,
                clusters,
            })
        });
        match applied {
            Ok(next) => {
                self.restart_health_checks_of(&next.clusters[pos]);
                self.routing.store(Arc::new(next));
            }
            Err(e) => {
                discovered.errors.fetch_add(1, Relaxed);
                tracing::warn!(
                    cluster = name,
                    "discovery: the endpoints found cannot be applied: {e:#}"
                );
            }
        }
    }

    fn restart_health_checks(&self, routing: &Routing) {
        let mut tasks = self.health_tasks.lock().unwrap_or_else(|e| e.into_inner());
        for (_, t) in tasks.drain(..) {
            t.abort();
        }
        for c in &routing.clusters {
            for t in crate::health::spawn(c, &self.runtime) {
                tasks.push((c.name().to_string(), t));
            }
        }
    }

    /// Restarts the health checks of one cluster (rebuilt by discovery).
    fn restart_health_checks_of(&self, cluster: &Arc<Cluster>) {
        let mut tasks = self.health_tasks.lock().unwrap_or_else(|e| e.into_inner());
        tasks.retain(|(name, t)| {
            let other = name != cluster.name();
            if !other {
                t.abort();
            }
            other
        });
        for t in crate::health::spawn(cluster, &self.runtime) {
            tasks.push((cluster.name().to_string(), t));
        }
    }

    /// Reads the configuration file again and reloads it. Every refusal, the file's own
    /// errors included, is logged and counted (`keel_config_reloads_total{result="refused"}`).
    pub fn reload_from_file(&self) -> Result<(), ReloadError> {
        let Some(path) = self.config.load().source.clone() else {
            return Err(ReloadError::NoFile);
        };
        match ProxyConfig::from_file(&path) {
            Ok(config) => self.reload(config).map_err(ReloadError::Refused),
            Err(e) => {
                self.reload_failures.fetch_add(1, Relaxed);
                tracing::error!("configuration reload refused, the old one keeps serving: {e}");
                Err(ReloadError::Refused(e.into()))
            }
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
                "listener[{i}]'s connection limits, timeouts or TLS settings changed; a reload can change its cluster and routes only: restart keel proxy to apply them"
            );
        }
        if old.admin != config.admin {
            anyhow::bail!("the [admin] listener changed; restart keel proxy to apply that");
        }
        if old.access_log != config.access_log {
            anyhow::bail!("the [access_log] changed; restart keel proxy to apply that");
        }
        let previous = self.routing.load();
        let discovered = self.sync_discovery(&config);
        let routing = self.build_routing(&config, Some(&previous), &discovered)?;
        self.restart_health_checks(&routing);
        self.routing.store(Arc::new(routing));
        self.config.store(Arc::new(config));
        self.restart_discovery(discovered);
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
/// with its own single-threaded runtime and its own stack of upstream connections in every
/// endpoint's pool: a connection and its requests never leave the thread that serves it, so
/// threads do not wake each other. The calling runtime accepts the connections and hands each
/// to the worker with the fewest open connections (Envoy's "exact balance"; with
/// `SO_REUSEPORT` the kernel's hash would spread them unevenly: 16 connections on 2 workers
/// split 10/6 or worse almost half the time). Admin, health checks and reloads stay on the
/// calling runtime. `workers` = 0 serves on the calling runtime.
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
    let mut bound = Vec::with_capacity(config.listeners.len());
    for l in &config.listeners {
        bound.push(
            bind_listener(l.listen).with_context(|| format!("cannot listen on {}", l.listen))?,
        );
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
        .map(|l| l.local_addr())
        .collect::<std::io::Result<Vec<_>>>()?;
    let admin_addr = admin.as_ref().map(|a| a.local_addr()).transpose()?;
    let access_log = config
        .access_log
        .as_ref()
        .map(|a| crate::access_log::AccessLog::start(a, workers.max(1)).map(Arc::new))
        .transpose()?;

    let empty = Routing {
        listeners: Vec::new(),
        clusters: Vec::new(),
    };
    let shared = Arc::new_cyclic(|me| Shared {
        epoch: Instant::now(),
        routing: ArcSwap::from_pointee(empty),
        config: ArcSwap::from_pointee(config.clone()),
        registry: Registry::default(),
        runtime: tokio::runtime::Handle::current(),
        workers: workers.max(1),
        health_tasks: Mutex::new(Vec::new()),
        discovery: Mutex::new(HashMap::new()),
        discovery_tasks: Mutex::new(Vec::new()),
        me: me.clone(),
        reload_lock: Mutex::new(()),
        reloads: AtomicU64::new(0),
        reload_failures: AtomicU64::new(0),
        tls_handshake_failures: listener_addrs.iter().map(|_| AtomicU64::new(0)).collect(),
        not_found: listener_addrs.iter().map(|_| AtomicU64::new(0)).collect(),
        access_log,
        listener_addrs: listener_addrs.clone(),
        worker_connections: (0..workers).map(|_| AtomicUsize::new(0)).collect(),
    });
    let discovered = shared.sync_discovery(&config);
    let routing = shared.build_routing(&config, None, &discovered)?;
    shared.restart_health_checks(&routing);
    shared.routing.store(Arc::new(routing));
    shared.restart_discovery(discovered);

    let (shutdown, shutdown_rx) = watch::channel(None);
    let mut tasks = Vec::new();
    let mut senders = Vec::with_capacity(workers);
    for w in 0..workers {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        senders.push(tx);
        let shared = shared.clone();
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
                rt.block_on(worker_loop(w, shared, rx, shutdown_rx));
                // Dropping the runtime here closes whatever the worker still held.
                drop(rt);
                let _ = done_tx.send(());
            })
            .context("cannot start a worker thread")?;
        tasks.push(tokio::spawn(async move {
            let _ = done_rx.await;
        }));
    }
    let dispatch = (workers > 0).then(|| {
        Arc::new(Dispatch {
            senders,
            open: shared.worker_connections.clone(),
            next: AtomicUsize::new(0),
        })
    });
    for (i, (listener, tls)) in bound.into_iter().zip(acceptors).enumerate() {
        let ctx = ListenerCtx::new(i, &config.listeners[i], tls);
        tasks.push(tokio::spawn(accept_loop(
            shared.clone(),
            ctx,
            listener,
            dispatch.clone(),
            shutdown_rx.clone(),
        )));
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

    /// Reads the configuration file again and swaps it in (as SIGHUP and `POST /reload` do);
    /// a refusal, the file's own errors included, is logged and counted.
    pub fn reload_from_file(&self) -> Result<(), ReloadError> {
        self.shared.reload_from_file()
    }

    /// TLS handshakes that failed or timed out on a listener (by configuration index).
    pub fn tls_handshake_failures(&self, listener: usize) -> u64 {
        self.shared
            .tls_handshake_failures
            .get(listener)
            .map_or(0, |c| c.load(Relaxed))
    }

    /// Client connections open on each worker thread (empty without workers).
    pub fn worker_connections(&self) -> Vec<usize> {
        self.shared
            .worker_connections
            .iter()
            .map(|c| c.load(Relaxed))
            .collect()
    }

    /// Makes the access log reopen its file (SIGUSR1: after logrotate moved it); a no-op
    /// without a file.
    pub fn reopen_access_log(&self) {
        if let Some(log) = &self.shared.access_log {
            log.reopen();
        }
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
        {
            let mut tasks = self
                .shared
                .health_tasks
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for (_, t) in tasks.drain(..) {
                t.abort();
            }
        }
        {
            let mut tasks = self
                .shared
                .discovery_tasks
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for t in tasks.drain(..) {
                t.abort();
            }
        }
        if let Some(log) = self.shared.access_log.clone() {
            // Writes the lines still queued.
            let _ = tokio::task::spawn_blocking(move || log.close()).await;
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

/// A listening socket.
fn bind_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
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

/// What serving one listener's connections needs, shared by the threads that serve them.
struct ListenerCtx {
    index: usize,
    /// Listener settings cannot change by reload (it refuses that), so they are read once.
    settings: Arc<crate::config::ListenerConfig>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl ListenerCtx {
    fn new(
        index: usize,
        settings: &crate::config::ListenerConfig,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> Arc<Self> {
        Arc::new(Self {
            index,
            settings: Arc::new(settings.clone()),
            tls,
        })
    }

    /// What the attempt driver needs to know of a client connection.
    fn client(&self, peer: SocketAddr, worker: usize) -> Client {
        let ip = peer.ip();
        Client {
            peer,
            ip: ip.to_string(),
            proto: if self.tls.is_some() { "https" } else { "http" },
            trust_forwarded: self.settings.trusts(ip),
            worker,
            error_detail: self.settings.error_detail,
        }
    }
}

/// An accepted connection on its way to a worker, with its listener slot and its place in
/// the worker's count.
struct Accepted {
    ctx: Arc<ListenerCtx>,
    stream: std::net::TcpStream,
    peer: SocketAddr,
    slot: tokio::sync::OwnedSemaphorePermit,
    open: OpenConnection,
}

/// Counts a connection on its worker while it lives.
struct OpenConnection {
    open: Arc<[AtomicUsize]>,
    worker: usize,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.open[self.worker].fetch_sub(1, Relaxed);
    }
}

/// Hands accepted connections to the worker with the fewest open (ties: in turn).
struct Dispatch {
    senders: Vec<tokio::sync::mpsc::UnboundedSender<Accepted>>,
    open: Arc<[AtomicUsize]>,
    next: AtomicUsize,
}

impl Dispatch {
    fn send(
        &self,
        ctx: &Arc<ListenerCtx>,
        stream: TcpStream,
        peer: SocketAddr,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) {
        let n = self.senders.len();
        let start = self.next.fetch_add(1, Relaxed);
        let worker = (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&w| self.open[w].load(Relaxed))
            .unwrap_or(0);
        // Registered again with the worker's own runtime there.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%peer, "cannot hand a connection to a worker: {e}");
                return;
            }
        };
        self.open[worker].fetch_add(1, Relaxed);
        let accepted = Accepted {
            ctx: ctx.clone(),
            stream,
            peer,
            slot,
            open: OpenConnection {
                open: self.open.clone(),
                worker,
            },
        };
        // A worker that stopped (shutdown) drops the connection, which closes it.
        let _ = self.senders[worker].send(accepted);
    }
}

/// A worker thread's life: serves the connections handed to it until shutdown, then lets
/// them finish for up to the drain time.
async fn worker_loop(
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
                let Some(a) = got else { break Duration::ZERO };
                let stream = match TcpStream::from_std(a.stream) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(peer = %a.peer, "worker cannot take a connection: {e}");
                        continue;
                    }
                };
                let (shared, stop) = (shared.clone(), shutdown.clone());
                conns.spawn(async move {
                    let _held = (a.slot, a.open);
                    serve_accepted(shared, &a.ctx, worker, stream, a.peer, stop).await;
                });
            }
        }
    };
    drain_connections(conns, drain).await;
}

/// Lets connections finish for up to `drain`, then cuts the rest.
async fn drain_connections(mut conns: JoinSet<()>, drain: Duration) {
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

async fn accept_loop(
    shared: Arc<Shared>,
    ctx: Arc<ListenerCtx>,
    listener: TcpListener,
    dispatch: Option<Arc<Dispatch>>,
    mut shutdown: watch::Receiver<Option<Duration>>,
) {
    // Connections beyond the limit are not accepted: they wait in the kernel's accept queue.
    let slots = Arc::new(tokio::sync::Semaphore::new(ctx.settings.max_connections));
    // Connections served here (no workers).
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
                match &dispatch {
                    Some(d) => d.send(&ctx, stream, peer, slot),
                    None => {
                        let (shared, ctx, stop) = (shared.clone(), ctx.clone(), shutdown.clone());
                        conns.spawn(async move {
                            let _slot = slot;
                            serve_accepted(shared, &ctx, 0, stream, peer, stop).await;
                        });
                    }
                }
            }
        }
    };
    drop(listener);
    drain_connections(conns, drain).await;
}

/// Serves one accepted connection: TLS handshake if the listener has TLS, then keel's
/// HTTP/1.1 front end, or the HTTP/2 one (ALPN `h2`, or HTTP/2's preface on plain TCP), or
/// for a TCP listener a tunnel to one endpoint. All hand their requests (or the connection)
/// to the same attempt driver.
async fn serve_accepted(
    shared: Arc<Shared>,
    ctx: &ListenerCtx,
    worker: usize,
    stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let index = ctx.index;
    let settings = &ctx.settings;
    let client = ctx.client(peer, worker);
    let tcp = settings.protocol == crate::config::ListenerProtocol::Tcp;
    let local = stream.local_addr().unwrap_or(peer);
    if tcp && ctx.tls.is_none() {
        crate::tcp::serve(shared, index, settings, &client, local, stream).await;
        return;
    }
    let Some(acceptor) = &ctx.tls else {
        let served = h1::conn::serve(
            shared.clone(),
            index,
            settings,
            &client,
            stream,
            stop.clone(),
        )
        .await;
        if let h1::conn::Served::Http2(stream, read) = served {
            let io = crate::h2::Prefixed::new(read, stream);
            crate::h2::serve(shared, index, settings.clone(), Arc::new(client), io, stop).await;
        }
        return;
    };
    // Here, not in the accept loop: a slow or silent client delays only itself.
    // The header-read timeout bounds the handshake, so it cannot hold a slot.
    let handshake_timeout = settings.header_read_timeout;
    let handshake = tokio::select! {
        r = tokio::time::timeout(handshake_timeout, acceptor.accept(stream)) => r,
        _ = wait_shutdown(&mut stop) => return,
    };
    let cause = match handshake {
        Ok(Ok(tls_stream)) if tcp => {
            crate::tcp::serve(shared, index, settings, &client, local, tls_stream).await;
            return;
        }
        Ok(Ok(tls_stream)) => {
            let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2);
            if h2 {
                crate::h2::serve(
                    shared,
                    index,
                    settings.clone(),
                    Arc::new(client),
                    tls_stream,
                    stop,
                )
                .await;
                return;
            }
            let served = h1::conn::serve(
                shared.clone(),
                index,
                settings,
                &client,
                tls_stream,
                stop.clone(),
            )
            .await;
            if let h1::conn::Served::Http2(stream, read) = served {
                let io = crate::h2::Prefixed::new(read, stream);
                crate::h2::serve(shared, index, settings.clone(), Arc::new(client), io, stop).await;
            }
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!(
            "not finished within {}",
            humantime::format_duration(handshake_timeout)
        ),
    };
    shared.tls_handshake_failures[index].fetch_add(1, Relaxed);
    tracing::debug!(%peer, "TLS handshake failed: {cause}");
}
