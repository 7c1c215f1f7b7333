//! Listeners, lifecycle and reload: [`start`] binds everything and returns a [`ProxyHandle`];
//! the routing (listener -> cluster) lives behind an `ArcSwap`, so a reload swaps it atomically
//! while requests in flight finish on the clusters they started on.
//!
//! The rooms: [`listen`] (sockets, accept loops, workers), [`sniff`] (which front end), the
//! shared state in `crate::state`, and reload in `crate::control::reload`.

pub(crate) mod listen;
pub(crate) mod proxy_header;
pub(crate) mod quic;
pub(crate) mod sniff;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ProxyConfig;
use crate::metrics::Registry;
use crate::serve::listen::{collect_ticks, worker_loop};
use crate::state::{
    log_drained, ConnKind, ControlState, Dispatch, ListenerCtx, ListenerSlot, Listening,
    ReloadError, Routing, Shared,
};

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
    /// Called about once a second on every thread that serves or accepts connections (each
    /// worker and the calling runtime's): the binary sets it to its allocator's collection
    /// (keel: mimalloc's `mi_collect(false)`), so that memory freed by connections that went
    /// quiet is given back while the threads have nothing else to do. An allocator that only
    /// returns pages when it runs again would otherwise keep them (BENCHMARKS.md, memory per
    /// connection).
    pub collect: Option<fn()>,
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
    let collect = options.collect;
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
        tracing: None,
    };
    let shared = Arc::new_cyclic(|me| Shared {
        epoch: Instant::now(),
        routing: ArcSwap::from_pointee(empty),
        config: ArcSwap::from_pointee(config.clone()),
        registry: Registry::default(),
        runtime: tokio::runtime::Handle::current(),
        workers: workers.max(1),
        me: me.clone(),
        access_log: ArcSwapOption::new(access_log),
        control: ControlState::default(),
        listening: Listening {
            listeners: ArcSwap::from_pointee(Vec::new()),
            all_listeners: ArcSwap::from_pointee(Vec::new()),
            admin: Mutex::new(None),
            worker_connections,
            dispatch,
            stopping: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            inherited: Mutex::new(options.inherited),
            fd_shed_log: crate::metrics::log_budget::LogBudget::new(1, Instant::now()),
        },
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
        .listening
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
    shared.restart_evidence();

    let (shutdown, shutdown_rx) = watch::channel(None);
    tokio::spawn(collect_ticks(collect, shutdown_rx.clone()));
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
                rt.spawn(collect_ticks(collect, shutdown_rx.clone()));
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
    shared.listening.listeners.store(Arc::new(live));
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
            .listening
            .listeners
            .load()
            .iter()
            .map(|l| l.addr)
            .collect()
    }

    /// The admin listener's bound address, if any.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.shared
            .listening
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
            .listening
            .listeners
            .load()
            .iter()
            .map(|l| (l.listen, l.fd))
            .collect();
        if let Some(a) = &*self
            .shared
            .listening
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
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

    /// HTTP/1.1 connections parked on a listener (by configuration index): waiting for a
    /// request past the quiet spell, holding no buffer.
    pub fn connections_parked(&self, listener: usize) -> usize {
        self.shared
            .listening
            .listeners
            .load()
            .get(listener)
            .map_or(0, |l| l.parked.load(Relaxed))
    }

    /// TLS handshakes that failed or timed out on a listener (by configuration index).
    pub fn tls_handshake_failures(&self, listener: usize) -> u64 {
        self.shared
            .listening
            .listeners
            .load()
            .get(listener)
            .map_or(0, |l| l.tls_handshake_failures.load(Relaxed))
    }

    /// Connections a `proxy_protocol` listener (by configuration index) closed for their PROXY
    /// header: from a peer not in `trusted_proxies`, malformed, not whole in time.
    pub fn proxy_header_refusals(&self, listener: usize) -> ProxyRefusals {
        let n = |k: usize| {
            self.shared
                .listening
                .listeners
                .load()
                .get(listener)
                .map_or(0, |l| l.proxy_refused[k].load(Relaxed))
        };
        ProxyRefusals {
            untrusted: n(proxy_header::Refusal::Untrusted as usize),
            malformed: n(proxy_header::Refusal::Malformed as usize),
            timeout: n(proxy_header::Refusal::Timeout as usize),
        }
    }

    /// Client connections open on each worker thread (empty without workers).
    pub fn worker_connections(&self) -> Vec<usize> {
        self.shared
            .listening
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
        Drained::of(&self.shared.listening.all_listeners.load())
    }

    /// Closes the admin listener now (shutdown does it once the drain is over). For a binary
    /// upgrade: the new process answers on the admin socket it inherited, and a probe must not
    /// reach this one's `/ready`, which fails while it drains.
    pub fn stop_admin(&self) {
        if let Some(a) = &*self
            .shared
            .listening
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            a.stop.send_replace(Some(Duration::ZERO));
        }
    }

    /// True from the moment a shutdown begins (what the admin's `/ready` answers 503 to).
    pub fn is_draining(&self) -> bool {
        self.shared.listening.stopping.load(Relaxed)
    }

    /// The stop SIGTERM asks for (fail, then drain): `/ready` answers 503 at once while the
    /// listeners go on accepting and serving for the configuration's `drain_delay`, so that a
    /// load balancer in front sees the failing probe and stops sending before any connection
    /// is refused; then [`Self::shutdown`] with its `drain_timeout`.
    pub async fn terminate(self) -> Drained {
        self.shared.listening.leaving.store(true, Relaxed);
        let (delay, drain) = {
            let c = self.shared.config.load();
            (c.drain_delay, c.drain_timeout)
        };
        tokio::time::sleep(delay).await;
        self.shutdown(drain).await
    }

    /// Stops accepting on every listener at once; idle connections close at once (HTTP/1.1
    /// keep-alive, HTTP/2 after a GOAWAY); requests in flight, on every worker, get up to
    /// `drain` to finish (HTTP/1.1 answers then say `Connection: close`), tunnels too; what is
    /// still busy then is cut, counted by kind in the log and in the answer. The admin listener
    /// answers until then (`/ready` 503 from the start), then closes.
    pub async fn shutdown(self, drain: Duration) -> Drained {
        self.shared.listening.stopping.store(true, Relaxed);
        // Serialized with reloads: a listener a reload is adding is drained too.
        let slots = {
            let _serial = self
                .shared
                .control
                .reload_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let slots = self.shared.listening.all_listeners.load_full();
            for s in slots.iter() {
                // Stored even if the accept loop has not subscribed yet: `send` would drop
                // the value when no receiver exists, and that loop would then never stop.
                s.stop.send_replace(Some(drain));
            }
            self.shutdown.send_replace(Some(drain));
            slots
        };
        // The admin listener stays up while the requests in flight finish, so that `/ready`
        // can be seen failing (503) and `/metrics` and `/status` show the drain.
        for s in slots.iter() {
            let task = s.task.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(t) = task {
                let _ = t.await;
            }
        }
        for t in self.workers {
            let _ = t.await;
        }
        if let Some(a) = &*self
            .shared
            .listening
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            a.stop.send_replace(Some(drain));
        }
        let admin = self
            .shared
            .listening
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
                .control
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
                .control
                .discovery_tasks
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for t in tasks.drain(..) {
                t.abort();
            }
        }
        {
            // Its lease expires within its TTL, and its evidence key with it.
            let mut tasks = self
                .shared
                .control
                .evidence_tasks
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

/// Connections closed for their PROXY protocol header, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxyRefusals {
    /// From a peer not in the listener's `trusted_proxies`.
    pub untrusted: u64,
    /// Not a PROXY header (or none).
    pub malformed: u64,
    /// Not whole within `header_read_timeout`.
    pub timeout: u64,
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
    pub(crate) fn of(slots: &[Arc<ListenerSlot>]) -> Self {
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
