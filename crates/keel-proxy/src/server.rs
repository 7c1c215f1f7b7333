//! Listeners, lifecycle and reload: [`start`] binds everything and returns a [`ProxyHandle`];
//! the routing (listener -> cluster) lives behind an `ArcSwap`, so a reload swaps it atomically
//! while requests in flight finish on the clusters they started on.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arc_swap::{ArcSwap, ArcSwapOption};
use keel_balance::EndpointSpec;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::config::{ClusterConfig, ProxyConfig};
use crate::control::discovery::Discovered;
use crate::exchange::request::Client;
use crate::front::h1;
use crate::observe::metrics::Registry;
use crate::route::ListenerRoutes;
use crate::upstream::cluster::Cluster;

/// What requests see: each listener's routes, and the clusters they lead to. Swapped whole on
/// reload.
pub(crate) struct Routing {
    /// Routes by listener index ([`ListenerSlot::index`]).
    pub listeners: Vec<Arc<ListenerRoutes>>,
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
    /// The listeners in force, in configuration order.
    pub listeners: ArcSwap<Vec<Arc<ListenerSlot>>>,
    /// Every listener this process bound, by [`ListenerSlot::index`] (removed ones included,
    /// while their connections drain and after).
    pub all_listeners: ArcSwap<Vec<Arc<ListenerSlot>>>,
    /// The admin listener in force.
    pub admin: Mutex<Option<AdminSlot>>,
    /// The access log, if configured; swapped by reload.
    pub access_log: ArcSwapOption<crate::observe::access_log::AccessLog>,
    /// Client connections open on each worker thread (empty without workers).
    pub worker_connections: Arc<[AtomicUsize]>,
    /// Hands accepted connections to the workers (`None`: served on `runtime`).
    dispatch: Option<Arc<Dispatch>>,
    /// Set once by shutdown: listeners added after it would never drain.
    stopping: AtomicBool,
    /// Listening sockets handed over by the process this one replaces (binary upgrade), by
    /// configured address; taken by the first bind of that address.
    inherited: Mutex<Vec<(SocketAddr, std::net::TcpListener)>>,
}

/// A listening socket while the configuration has it, and its connections while they drain.
/// Its `index` is never reused, so a connection's route table stays its own across reloads that
/// add or remove other listeners.
pub(crate) struct ListenerSlot {
    /// Position of its route table in [`Routing::listeners`].
    pub index: usize,
    /// The address as configured (port 0 stays 0).
    pub listen: SocketAddr,
    /// The bound address.
    pub addr: SocketAddr,
    /// Settings and TLS acceptor for new connections; a reload swaps them (new handshakes use
    /// the new certificate, established connections keep theirs).
    ctx: ArcSwap<ListenerCtx>,
    /// Connections beyond `max_connections` wait in the kernel's accept queue.
    slots: Arc<tokio::sync::Semaphore>,
    max_connections: AtomicUsize,
    /// Its connections' drain signal: this listener removed, or the proxy shutting down.
    stop: watch::Sender<Option<Duration>>,
    /// Connections open on it.
    open: AtomicUsize,
    /// Connections cut at the drain timeout, by [`ConnKind`].
    cut: [AtomicU64; ConnKind::COUNT],
    /// TLS handshakes that failed or timed out.
    pub tls_handshake_failures: AtomicU64,
    /// Requests that no route matched and no listener cluster took (`404`).
    pub not_found: AtomicU64,
    /// The socket's descriptor while its accept loop runs (handed to a new binary on upgrade).
    fd: std::os::fd::RawFd,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// The admin listener in force.
pub(crate) struct AdminSlot {
    pub listen: SocketAddr,
    pub addr: SocketAddr,
    fd: std::os::fd::RawFd,
    stop: watch::Sender<Option<Duration>>,
    task: JoinHandle<()>,
}

/// What a connection is doing, for the drain's count of what it cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum ConnKind {
    /// TLS handshake, or not yet told.
    Opening = 0,
    Http1 = 1,
    Http2 = 2,
    /// An upgraded HTTP/1.1 connection (WebSocket ...) or a TCP listener's connection.
    Tunnel = 3,
}

impl ConnKind {
    const COUNT: usize = 4;
    const NAMES: [&'static str; Self::COUNT] = ["opening", "HTTP/1.1", "HTTP/2", "tunnel"];
}

tokio::task_local! {
    /// The kind of the connection this task serves (set by its front end).
    static CONN_KIND: Arc<AtomicU8>;
}

/// Marks the connection served by the current task as `kind` (a no-op outside one).
pub(crate) fn mark_connection(kind: ConnKind) {
    let _ = CONN_KIND.try_with(|k| k.store(kind as u8, Relaxed));
}

impl Shared {
    /// Counts a `404` for want of a route on listener `index`.
    pub fn count_not_found(&self, index: usize) {
        if let Some(l) = self.all_listeners.load().get(index) {
            l.not_found.fetch_add(1, Relaxed);
        }
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

    /// The listeners' route tables over `clusters`, by listener index: `indexes[i]` is the
    /// index of `config.listeners[i]`. A removed listener keeps its last table while
    /// connections are open on it (they drain on the clusters they started on), then routes
    /// nothing.
    fn build_listeners(
        &self,
        config: &ProxyConfig,
        clusters: &[Arc<Cluster>],
        indexes: &[usize],
        previous: Option<&Routing>,
    ) -> anyhow::Result<Vec<Arc<ListenerRoutes>>> {
        let len = indexes
            .iter()
            .map(|i| i + 1)
            .chain(previous.map(|p| p.listeners.len()))
            .max()
            .unwrap_or(0);
        let all = self.all_listeners.load();
        let none = Arc::new(ListenerRoutes::none());
        let mut out: Vec<Arc<ListenerRoutes>> = (0..len)
            .map(|i| {
                let draining = all.get(i).is_some_and(|l| l.open.load(Relaxed) > 0);
                match previous.and_then(|p| p.listeners.get(i)) {
                    Some(table) if draining => table.clone(),
                    _ => none.clone(),
                }
            })
            .collect();
        for (i, l) in config.listeners.iter().enumerate() {
            let table = ListenerRoutes::build(l, |name| {
                clusters.iter().find(|c| c.name() == name).cloned()
            })
            .with_context(|| format!("listener[{i}]"))?;
            out[indexes[i]] = Arc::new(table);
        }
        Ok(out)
    }

    /// The indexes of the listeners in force, in configuration order.
    fn live_indexes(&self) -> Vec<usize> {
        self.listeners.load().iter().map(|l| l.index).collect()
    }

    /// Builds what requests see from `config`; a cluster with discovery gets the endpoints
    /// `discovered` last found for it. `indexes`: see [`Self::build_listeners`].
    fn build_routing(
        &self,
        config: &ProxyConfig,
        previous: Option<&Routing>,
        discovered: &HashMap<String, Arc<Discovered>>,
        indexes: &[usize],
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
        let listeners = self.build_listeners(config, &clusters, indexes, previous)?;
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
                        e.record(&c.name, crate::control::discovery::read_file(path));
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
            tasks.push(self.runtime.spawn(crate::control::discovery::run(
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
            let listeners =
                self.build_listeners(&config, &clusters, &self.live_indexes(), Some(&routing))?;
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
            for t in crate::upstream::health::spawn(c, &self.runtime) {
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
        for t in crate::upstream::health::spawn(cluster, &self.runtime) {
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
        if self.stopping.load(Relaxed) {
            anyhow::bail!("the proxy is shutting down");
        }
        let old = self.config.load();
        let live = self.listeners.load_full();
        // Everything that can fail comes first, the swap after: a listener that cannot be bound,
        // a certificate that cannot be read, an access log that cannot be opened or a cluster
        // that cannot be built refuses the whole reload, and the old configuration keeps
        // serving untouched (sockets bound for it are closed again when `plan` is dropped).
        let mut taken = vec![false; live.len()];
        let mut plan = Vec::with_capacity(config.listeners.len());
        let mut next_index = self.all_listeners.load().len();
        for (i, l) in config.listeners.iter().enumerate() {
            let ctx_for = |index| {
                ListenerCtx::build(index, l)
                    .with_context(|| format!("listener[{i}] ({})", l.listen))
            };
            let kept = live
                .iter()
                .enumerate()
                .find(|(k, s)| !taken[*k] && s.listen == l.listen);
            match kept {
                Some((k, slot)) => {
                    taken[k] = true;
                    plan.push(Planned::Keep(slot.clone(), ctx_for(slot.index)?));
                }
                None => {
                    let ctx = ctx_for(next_index)?;
                    let listener = self
                        .bind(l.listen)
                        .with_context(|| format!("listener[{i}]: cannot listen on {}", l.listen))?;
                    plan.push(Planned::New(listener, ctx));
                    next_index += 1;
                }
            }
        }
        let admin = match (&config.admin, old.admin.as_ref()) {
            (Some(new), Some(was)) if new.listen == was.listen => AdminPlan::Keep,
            (Some(new), _) => AdminPlan::Move(Some(
                self.bind_admin(new.listen)
                    .with_context(|| format!("cannot listen on {} (admin)", new.listen))?,
            )),
            (None, Some(_)) => AdminPlan::Move(None),
            (None, None) => AdminPlan::Keep,
        };
        let access_log = if old.access_log == config.access_log {
            None
        } else {
            Some(
                config
                    .access_log
                    .as_ref()
                    .map(|a| {
                        crate::observe::access_log::AccessLog::start(a, self.workers).map(Arc::new)
                    })
                    .transpose()?,
            )
        };
        let indexes: Vec<usize> = plan.iter().map(Planned::index).collect();
        let previous = self.routing.load();
        let discovered = self.sync_discovery(&config);
        let routing = self.build_routing(&config, Some(&previous), &discovered, &indexes)?;

        // The swap: nothing below fails.
        let mut now_live = Vec::with_capacity(plan.len());
        for p in plan {
            match p {
                Planned::Keep(slot, ctx) => {
                    slot.set_ctx(ctx);
                    now_live.push(slot);
                }
                Planned::New(listener, ctx) => now_live.push(self.open_listener(listener, ctx)),
            }
        }
        self.restart_health_checks(&routing);
        self.routing.store(Arc::new(routing));
        self.listeners.store(Arc::new(now_live));
        self.config.store(Arc::new(config));
        self.restart_discovery(discovered);
        let drain = self.config.load().drain_timeout;
        for (k, slot) in live.iter().enumerate() {
            if !taken[k] {
                self.remove_listener(slot.clone(), drain);
            }
        }
        if let AdminPlan::Move(admin) = admin {
            let old = self.admin.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(old) = old {
                let _ = old.stop.send(Some(Duration::ZERO));
                tracing::info!(admin = %old.addr, "admin listener closed");
            }
            if let Some(listener) = admin {
                self.open_admin(listener);
            }
        }
        if let Some(log) = access_log {
            let old = self.access_log.swap(log);
            // Requests that took the old log a moment ago still write to it; it is closed (its
            // lines written) when the last of them lets it go, or here after a grace period.
            if let Some(old) = old {
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(2));
                    drop(old);
                });
            }
        }
        Ok(())
    }

    /// A listening socket for `addr`: the one inherited from the process this one replaces,
    /// if it had that address, else a new one.
    fn bind(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        if let Some(l) = self.take_inherited(addr) {
            return l;
        }
        let _rt = self.runtime.enter();
        bind_listener(addr)
    }

    fn bind_admin(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        self.bind(addr)
    }

    fn take_inherited(&self, addr: SocketAddr) -> Option<std::io::Result<TcpListener>> {
        let mut inherited = self.inherited.lock().unwrap_or_else(|e| e.into_inner());
        let pos = inherited.iter().position(|(a, _)| *a == addr)?;
        let (_, l) = inherited.remove(pos);
        let _rt = self.runtime.enter();
        Some(
            l.set_nonblocking(true)
                .and_then(|()| TcpListener::from_std(l)),
        )
    }

    /// Starts accepting on a bound listener.
    fn open_listener(&self, listener: TcpListener, ctx: ListenerCtx) -> Arc<ListenerSlot> {
        let addr = listener.local_addr().unwrap_or(ctx.settings.listen);
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
            cut: Default::default(),
            tls_handshake_failures: AtomicU64::new(0),
            not_found: AtomicU64::new(0),
            fd: std::os::fd::AsRawFd::as_raw_fd(&listener),
            task: Mutex::new(None),
        });
        let mut all = Vec::clone(&self.all_listeners.load());
        debug_assert_eq!(
            all.len(),
            slot.index,
            "listener indexes are handed out in order"
        );
        all.push(slot.clone());
        self.all_listeners.store(Arc::new(all));
        let me = self
            .me
            .upgrade()
            .expect("the proxy is alive while it opens listeners");
        let task = self.runtime.spawn(accept_loop(
            me,
            slot.clone(),
            listener,
            self.dispatch.clone(),
        ));
        *slot.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        slot
    }

    fn open_admin(&self, listener: TcpListener) {
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
            .spawn(crate::observe::admin::serve(me, listener, stop_rx));
        *self.admin.lock().unwrap_or_else(|e| e.into_inner()) = Some(AdminSlot {
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
    fn remove_listener(&self, slot: Arc<ListenerSlot>, drain: Duration) {
        let _ = slot.stop.send(Some(drain));
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

/// What a reload does with one listener of the new configuration.
enum Planned {
    /// The listener of that address stays; its settings and certificate are swapped.
    Keep(Arc<ListenerSlot>, ListenerCtx),
    /// A new listener, already bound.
    New(TcpListener, ListenerCtx),
}

impl Planned {
    fn index(&self) -> usize {
        match self {
            Planned::Keep(slot, _) => slot.index,
            Planned::New(_, ctx) => ctx.index,
        }
    }
}

enum AdminPlan {
    Keep,
    /// Bound at its new address (or none), the old one closed after the swap.
    Move(Option<TcpListener>),
}

impl ListenerSlot {
    /// New settings and certificate for the connections accepted from now on.
    fn set_ctx(&self, ctx: ListenerCtx) {
        let max = ctx.settings.max_connections;
        let was = self.max_connections.swap(max, Relaxed);
        if max > was {
            self.slots.add_permits(max - was);
        } else if was > max {
            // Permits held by open connections are not taken back: the limit applies as they end.
            self.slots.forget_permits(was - max);
        }
        self.ctx.store(Arc::new(ctx));
    }

    /// Connections this listener's drain cut, by kind.
    fn cut_counts(&self) -> [u64; ConnKind::COUNT] {
        std::array::from_fn(|k| self.cut[k].load(Relaxed))
    }
}

/// Logs what a drain cut (a warning) or that nothing was cut.
fn log_drained(what: &str, slots: &[Arc<ListenerSlot>]) {
    let mut cut = [0u64; ConnKind::COUNT];
    for s in slots {
        for (k, n) in s.cut_counts().into_iter().enumerate() {
            cut[k] += n;
        }
    }
    let total: u64 = cut.iter().sum();
    if total == 0 {
        tracing::info!("{what}: every connection finished within the drain timeout");
        return;
    }
    let kinds = cut
        .iter()
        .zip(ConnKind::NAMES)
        .filter(|(n, _)| **n > 0)
        .map(|(n, name)| format!("{n} {name}"))
        .collect::<Vec<_>>()
        .join(", ");
    tracing::warn!("{what}: drain timeout cut {total} connection(s) still busy ({kinds})");
}

/// A running proxy.
pub struct ProxyHandle {
    shared: Arc<Shared>,
    shutdown: watch::Sender<Option<Duration>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("listeners", &self.listener_addrs())
            .field("admin", &self.admin_addr())
            .finish()
    }
}

/// How to start a proxy (see [`start_with`]).
#[derive(Debug, Default)]
pub struct StartOptions {
    /// Threads that serve connections (0: served on the calling runtime).
    pub workers: usize,
    /// Listening sockets handed over by the process this one replaces (binary upgrade), with
    /// the address each was configured with; a listener or admin address of the configuration
    /// takes its socket from here instead of binding. Those left over are closed.
    pub inherited: Vec<(SocketAddr, std::net::TcpListener)>,
}

/// Binds every listener (port 0 = ephemeral) and the admin listener, starts health checks,
/// returns once it is accepting. Connections are served on the calling runtime.
pub async fn start(config: ProxyConfig) -> anyhow::Result<ProxyHandle> {
    start_with(config, StartOptions::default()).await
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
    start_with(
        config,
        StartOptions {
            workers,
            ..StartOptions::default()
        },
    )
    .await
}

/// Starts a proxy with [`StartOptions`].
pub async fn start_with(config: ProxyConfig, options: StartOptions) -> anyhow::Result<ProxyHandle> {
    let workers = options.workers;
    // TLS files are read again here (validation read them too) so that start fails, rather
    // than each connection, if they went away since.
    let ctxs = config
        .listeners
        .iter()
        .enumerate()
        .map(|(i, l)| {
            ListenerCtx::build(i, l).with_context(|| format!("listener[{i}] ({}) tls", l.listen))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let access_log = config
        .access_log
        .as_ref()
        .map(|a| crate::observe::access_log::AccessLog::start(a, workers.max(1)).map(Arc::new))
        .transpose()?;
    let worker_connections: Arc<[AtomicUsize]> =
        (0..workers).map(|_| AtomicUsize::new(0)).collect();
    let mut senders = Vec::with_capacity(workers);
    let mut receivers = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        senders.push(tx);
        receivers.push(rx);
    }
    let dispatch = (workers > 0).then(|| {
        Arc::new(Dispatch {
            senders,
            open: worker_connections.clone(),
            next: AtomicUsize::new(0),
        })
    });
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
        listeners: ArcSwap::from_pointee(Vec::new()),
        all_listeners: ArcSwap::from_pointee(Vec::new()),
        admin: Mutex::new(None),
        access_log: ArcSwapOption::new(access_log),
        worker_connections,
        dispatch,
        stopping: AtomicBool::new(false),
        inherited: Mutex::new(options.inherited),
    });
    let mut bound = Vec::with_capacity(config.listeners.len());
    for l in &config.listeners {
        bound.push(
            shared
                .bind(l.listen)
                .with_context(|| format!("cannot listen on {}", l.listen))?,
        );
    }
    let admin = match &config.admin {
        Some(a) => Some(
            shared
                .bind_admin(a.listen)
                .with_context(|| format!("cannot listen on {} (admin)", a.listen))?,
        ),
        None => None,
    };
    // Inherited sockets no listener took are closed.
    shared
        .inherited
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    let discovered = shared.sync_discovery(&config);
    let indexes: Vec<usize> = (0..config.listeners.len()).collect();
    let routing = shared.build_routing(&config, None, &discovered, &indexes)?;
    shared.restart_health_checks(&routing);
    shared.routing.store(Arc::new(routing));
    shared.restart_discovery(discovered);

    let (shutdown, shutdown_rx) = watch::channel(None);
    let mut worker_tasks = Vec::new();
    for (w, rx) in receivers.into_iter().enumerate() {
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
        worker_tasks.push(tokio::spawn(async move {
            let _ = done_rx.await;
        }));
    }
    let live: Vec<_> = bound
        .into_iter()
        .zip(ctxs)
        .map(|(listener, ctx)| shared.open_listener(listener, ctx))
        .collect();
    shared.listeners.store(Arc::new(live));
    if let Some(admin) = admin {
        shared.open_admin(admin);
    }
    Ok(ProxyHandle {
        shared,
        shutdown,
        workers: worker_tasks,
    })
}

impl ProxyHandle {
    /// The listeners' bound addresses, in configuration order.
    pub fn listener_addrs(&self) -> Vec<SocketAddr> {
        self.shared
            .listeners
            .load()
            .iter()
            .map(|l| l.addr)
            .collect()
    }

    /// The admin listener's bound address, if any.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.shared
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|a| a.addr)
    }

    /// The listening sockets in force with the address each was configured with (listeners,
    /// then admin): what a new binary needs to take over without refusing a connection (see
    /// [`StartOptions::inherited`]). The descriptors stay owned by the proxy.
    pub fn listening_fds(&self) -> Vec<(SocketAddr, std::os::fd::RawFd)> {
        let mut out: Vec<_> = self
            .shared
            .listeners
            .load()
            .iter()
            .map(|l| (l.listen, l.fd))
            .collect();
        if let Some(a) = &*self.shared.admin.lock().unwrap_or_else(|e| e.into_inner()) {
            out.push((a.listen, a.fd));
        }
        out
    }

    /// Swaps in a new configuration atomically: clusters and routes (endpoints that stay keep
    /// their state), listeners added (bound first) and removed (drained), a listener's
    /// settings and TLS certificate (for new connections), the admin listener and the access
    /// log. Refused as a whole, the old configuration kept, if any part cannot be applied.
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
            .listeners
            .load()
            .get(listener)
            .map_or(0, |l| l.tls_handshake_failures.load(Relaxed))
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
        if let Some(log) = &*self.shared.access_log.load() {
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

    /// Connections cut so far by drains (listeners removed by reload).
    pub fn drain_cut(&self) -> Drained {
        Drained::of(&self.shared.all_listeners.load())
    }

    /// Stops accepting on every listener at once; idle connections close at once (HTTP/1.1
    /// keep-alive, HTTP/2 after a GOAWAY); requests in flight, on every worker, get up to
    /// `drain` to finish (HTTP/1.1 answers then say `Connection: close`), tunnels too; what is
    /// still busy then is cut, counted by kind in the log and in the answer.
    pub async fn shutdown(self, drain: Duration) -> Drained {
        self.shared.stopping.store(true, Relaxed);
        // Serialized with reloads: a listener a reload is adding is drained too.
        let slots = {
            let _serial = self
                .shared
                .reload_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let slots = self.shared.all_listeners.load_full();
            for s in slots.iter() {
                let _ = s.stop.send(Some(drain));
            }
            let _ = self.shutdown.send(Some(drain));
            if let Some(a) = &*self.shared.admin.lock().unwrap_or_else(|e| e.into_inner()) {
                let _ = a.stop.send(Some(drain));
            }
            slots
        };
        for s in slots.iter() {
            let task = s.task.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(t) = task {
                let _ = t.await;
            }
        }
        for t in self.workers {
            let _ = t.await;
        }
        let admin = self
            .shared
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(a) = admin {
            let _ = a.task.await;
        }
        log_drained("shutdown", &slots);
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
        if let Some(log) = self.shared.access_log.swap(None) {
            // Writes the lines still queued.
            let _ = tokio::task::spawn_blocking(move || log.close()).await;
        }
        Drained::of(&slots)
    }
}

/// Connections a drain cut because they were still busy at the drain timeout (everything else
/// finished or was idle and closed), by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drained {
    /// Connections still in a TLS handshake.
    pub opening: u64,
    /// HTTP/1.1 connections with a request in flight.
    pub http1: u64,
    /// HTTP/2 connections with streams in flight.
    pub http2: u64,
    /// Tunnels: WebSocket and other upgrades, connections of TCP listeners.
    pub tunnels: u64,
}

impl Drained {
    fn of(slots: &[Arc<ListenerSlot>]) -> Self {
        let mut cut = [0u64; ConnKind::COUNT];
        for s in slots {
            for (k, n) in s.cut_counts().into_iter().enumerate() {
                cut[k] += n;
            }
        }
        Drained {
            opening: cut[ConnKind::Opening as usize],
            http1: cut[ConnKind::Http1 as usize],
            http2: cut[ConnKind::Http2 as usize],
            tunnels: cut[ConnKind::Tunnel as usize],
        }
    }

    /// Connections cut in all.
    pub fn total(&self) -> u64 {
        self.opening + self.http1 + self.http2 + self.tunnels
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

/// What serving one listener's connections needs, for the connections accepted while it is
/// in force.
pub(crate) struct ListenerCtx {
    index: usize,
    settings: Arc<crate::config::ListenerConfig>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl ListenerCtx {
    /// Reads the listener's certificate and key (if it has TLS).
    fn build(index: usize, settings: &crate::config::ListenerConfig) -> anyhow::Result<Self> {
        let tls = settings
            .tls
            .as_ref()
            .map(|t| crate::tls::server_config(t).map(tokio_rustls::TlsAcceptor::from))
            .transpose()?;
        Ok(Self {
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
    conn: Connection,
    stream: std::net::TcpStream,
    open: OpenConnection,
}

/// One accepted connection's listener, settings and place in its listener's limit and count.
struct Connection {
    listener: Arc<ListenerSlot>,
    ctx: Arc<ListenerCtx>,
    peer: SocketAddr,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Connection {
    fn new(
        listener: &Arc<ListenerSlot>,
        peer: SocketAddr,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Self {
        listener.open.fetch_add(1, Relaxed);
        Connection {
            listener: listener.clone(),
            ctx: listener.ctx.load_full(),
            peer,
            _slot: slot,
        }
    }

    /// Serves the connection until it ends; once its listener drains (removed, or the proxy
    /// stopping) it has the drain time to finish, then it is cut and counted.
    async fn serve(self, shared: Arc<Shared>, worker: usize, stream: TcpStream) {
        let mut stop = self.listener.stop.subscribe();
        let kind = Arc::new(AtomicU8::new(ConnKind::Opening as u8));
        let served = CONN_KIND.scope(
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
        );
        tokio::pin!(served);
        let deadline = async {
            let drain = wait_shutdown(&mut stop).await;
            tokio::time::sleep(drain).await;
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

impl Drop for Connection {
    fn drop(&mut self) {
        self.listener.open.fetch_sub(1, Relaxed);
    }
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
    fn send(&self, conn: Connection, stream: TcpStream) {
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
                tracing::warn!(peer = %conn.peer, "cannot hand a connection to a worker: {e}");
                return;
            }
        };
        self.open[worker].fetch_add(1, Relaxed);
        let accepted = Accepted {
            conn,
            stream,
            open: OpenConnection {
                open: self.open.clone(),
                worker,
            },
        };
        // A worker that stopped (shutdown) drops the connection, which closes it.
        let _ = self.senders[worker].send(accepted);
    }
}

/// A worker thread's life: serves the connections handed to it until shutdown, then waits
/// for them to end (each drains on its own: see [`Connection::serve`]).
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
                let shared = shared.clone();
                conns.spawn(async move {
                    let _open = a.open;
                    a.conn.serve(shared, worker, stream).await;
                });
            }
        }
    };
    rx.close();
    wait_connections(conns, drain).await;
}

/// Waits for connections that drain on their own; a backstop a little past the drain time
/// aborts any that did not (none should).
async fn wait_connections(mut conns: JoinSet<()>, drain: Duration) {
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

async fn accept_loop(
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
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
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

/// Serves one accepted connection: TLS handshake if the listener has TLS, then keel's
/// HTTP/1.1 front end, or the HTTP/2 one (ALPN `h2`, or HTTP/2's preface on plain TCP), or
/// for a TCP listener a tunnel to one endpoint. All hand their requests (or the connection)
/// to the same attempt driver.
async fn serve_accepted(
    shared: Arc<Shared>,
    ctx: &ListenerCtx,
    listener: &ListenerSlot,
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
        mark_connection(ConnKind::Tunnel);
        crate::front::tcp::serve(shared, index, settings, &client, local, stream).await;
        return;
    }
    let Some(acceptor) = &ctx.tls else {
        mark_connection(ConnKind::Http1);
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
            mark_connection(ConnKind::Http2);
            let io = crate::front::h2::Prefixed::new(read, stream);
            crate::front::h2::serve(shared, index, settings.clone(), Arc::new(client), io, stop)
                .await;
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
            mark_connection(ConnKind::Tunnel);
            crate::front::tcp::serve(shared, index, settings, &client, local, tls_stream).await;
            return;
        }
        Ok(Ok(tls_stream)) => {
            let h2 = tls_stream.get_ref().1.alpn_protocol() == Some(crate::tls::ALPN_H2);
            if h2 {
                mark_connection(ConnKind::Http2);
                crate::front::h2::serve(
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
            mark_connection(ConnKind::Http1);
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
                mark_connection(ConnKind::Http2);
                let io = crate::front::h2::Prefixed::new(read, stream);
                crate::front::h2::serve(
                    shared,
                    index,
                    settings.clone(),
                    Arc::new(client),
                    io,
                    stop,
                )
                .await;
            }
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!(
            "not finished within {}",
            humantime::format_duration(handshake_timeout)
        ),
    };
    listener.tls_handshake_failures.fetch_add(1, Relaxed);
    tracing::debug!(%peer, "TLS handshake failed: {cause}");
}
