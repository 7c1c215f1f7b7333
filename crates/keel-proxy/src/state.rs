//! The proxy's shared state: what requests see ([`Routing`], swapped whole by reload), the
//! listener slots and their connections' drain, the admin slot, and the hand-off of accepted
//! connections to the worker threads. The front ends, the admin listener and the control
//! plane read it; `serve/` runs it, `control/reload.rs` changes it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::ProxyConfig;
use crate::exchange::request::Client;
use crate::metrics::Registry;
use crate::route::ListenerRoutes;
use crate::upstream::cluster::Cluster;
use crate::upstream::discovered::Discovered;

/// What requests see: each listener's routes, and the clusters they lead to. Swapped whole on
/// reload.
pub(crate) struct Routing {
    /// Routes by listener index ([`ListenerSlot::index`]).
    pub listeners: Vec<Arc<ListenerRoutes>>,
    /// All clusters, in configuration order.
    pub clusters: Vec<Arc<Cluster>>,
    /// `[tracing]`, which every cluster holds too; kept by a reload that does not change it.
    pub tracing: Option<Arc<crate::exchange::trace::Tracing>>,
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

/// State shared by listeners, the admin listener and the handle. What one room owns is in its
/// own part: [`ControlState`] (the control plane's tasks and reloads) and [`Listening`] (the
/// sockets, workers and stop flags that `serve/` keeps); the rest is read by every room.
pub(crate) struct Shared {
    pub epoch: Instant,
    pub routing: ArcSwap<Routing>,
    pub config: ArcSwap<ProxyConfig>,
    pub registry: Registry,
    pub runtime: tokio::runtime::Handle,
    /// Threads serving connections (1 when they are served on `runtime`): the number of
    /// per-thread stacks in each endpoint's pool.
    pub workers: usize,
    /// Itself, for the tasks that apply what discovery finds (weak: they do not keep the proxy
    /// alive).
    pub me: std::sync::Weak<Shared>,
    /// The access log, if configured; swapped by reload.
    pub access_log: ArcSwapOption<crate::observe::access_log::AccessLog>,
    pub control: ControlState,
    pub listening: Listening,
}

/// What `control/` owns: the tasks it runs beside the requests, what they hold, and the reloads.
#[derive(Default)]
pub(crate) struct ControlState {
    /// Health-check tasks of the current clusters, by cluster name (cold path only).
    pub health_tasks: Mutex<Vec<(String, JoinHandle<()>)>>,
    /// Discovery state by cluster name.
    pub discovery: Mutex<HashMap<String, Arc<Discovered>>>,
    /// Discovery tasks of the current clusters.
    pub discovery_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Shared outlier evidence by cluster name (`[cluster.outlier_detection] shared`).
    pub evidence: Mutex<HashMap<String, Arc<crate::upstream::evidence::Evidence>>>,
    /// The evidence exchange tasks of the current clusters.
    pub evidence_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Serializes reloads.
    pub reload_lock: Mutex<()>,
    pub reloads: AtomicU64,
    pub reload_failures: AtomicU64,
}

/// What `serve/` owns: the listening sockets, the admin slot, the workers' connections and the
/// stop flags.
pub(crate) struct Listening {
    /// The listeners in force, in configuration order.
    pub listeners: ArcSwap<Vec<Arc<ListenerSlot>>>,
    /// Every listener this process bound, by [`ListenerSlot::index`] (removed ones included,
    /// while their connections drain and after).
    pub all_listeners: ArcSwap<Vec<Arc<ListenerSlot>>>,
    /// The admin listener in force.
    pub admin: Mutex<Option<AdminSlot>>,
    /// Client connections open on each worker thread (empty without workers).
    pub worker_connections: Arc<[AtomicUsize]>,
    /// Hands accepted connections to the workers (`None`: served on `runtime`).
    pub(crate) dispatch: Option<Arc<Dispatch>>,
    /// Set once by shutdown: listeners added after it would never drain.
    pub(crate) stopping: AtomicBool,
    /// Set once when a stop is asked for ([`crate::ProxyHandle::terminate`]): `/ready` fails
    /// from then on, while the listeners go on serving for `drain_delay` before `stopping`.
    pub(crate) leaving: AtomicBool,
    /// Listening sockets handed over by the process this one replaces (binary upgrade), by
    /// configured address; taken by the first bind of that address.
    pub(crate) inherited: Mutex<Vec<(SocketAddr, std::net::TcpListener)>>,
    /// Rate limit of the lines about connections shed near the open-file limit.
    pub(crate) fd_shed_log: crate::metrics::log_budget::LogBudget,
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
    pub(crate) ctx: ArcSwap<ListenerCtx>,
    /// Connections beyond `max_connections` wait in the kernel's accept queue.
    pub(crate) slots: Arc<tokio::sync::Semaphore>,
    pub(crate) max_connections: AtomicUsize,
    /// Its connections' drain signal: this listener removed, or the proxy shutting down.
    pub(crate) stop: watch::Sender<Option<Duration>>,
    /// Connections open on it.
    pub(crate) open: AtomicUsize,
    /// HTTP/1.1 connections parked: waiting for a request past the quiet spell, with no
    /// buffer or request state held (`keel_connections_parked`).
    pub(crate) parked: AtomicUsize,
    /// Connections cut at the drain timeout, by [`ConnKind`].
    pub(crate) cut: [AtomicU64; ConnKind::COUNT],
    /// TLS handshakes that failed or timed out.
    pub tls_handshake_failures: AtomicU64,
    /// Connections a `proxy_protocol` listener closed for their PROXY header, by reason (in
    /// the order of [`PROXY_REFUSALS`]), and whether each reason was logged yet (once each).
    pub(crate) proxy_refused: [AtomicU64; PROXY_REFUSALS.len()],
    pub(crate) proxy_refusal_logged: [std::sync::atomic::AtomicBool; PROXY_REFUSALS.len()],
    /// Requests that no route matched and no listener cluster took (`404`).
    pub not_found: AtomicU64,
    /// quinn's endpoint on the listener's UDP socket, when it serves HTTP/3.
    pub(crate) quic: std::sync::OnceLock<quinn::Endpoint>,
    /// The socket's descriptor while its accept loop runs (handed to a new binary on upgrade).
    pub(crate) fd: std::os::fd::RawFd,
    pub(crate) task: Mutex<Option<JoinHandle<()>>>,
}

/// Why a `proxy_protocol` listener closed a connection: the peer is not a trusted proxy, its
/// header is not one, or it was not whole within `header_read_timeout`.
pub(crate) const PROXY_REFUSALS: [&str; 3] = ["untrusted", "malformed", "timeout"];

/// The admin listener in force.
pub(crate) struct AdminSlot {
    pub listen: SocketAddr,
    pub addr: SocketAddr,
    pub(crate) fd: std::os::fd::RawFd,
    pub(crate) stop: watch::Sender<Option<Duration>>,
    pub(crate) task: JoinHandle<()>,
}

/// What a connection is doing, for the drain's count of what it cut.
pub(crate) use crate::metrics::{mark_connection, ConnKind, CONN_KIND};

impl Shared {
    /// Counts a `404` for want of a route on listener `index`.
    pub fn count_not_found(&self, index: usize) {
        if let Some(l) = self.listening.all_listeners.load().get(index) {
            l.not_found.fetch_add(1, Relaxed);
        }
    }
}

impl ListenerSlot {
    /// New settings and certificate for the connections accepted from now on.
    pub(crate) fn set_ctx(&self, ctx: ListenerCtx) {
        let ctx = ctx.bound_at(self.addr.port(), self.quic.get().is_some());
        if let Some(endpoint) = self.quic.get() {
            // New QUIC handshakes take the new certificate and limits; without `h3` now,
            // new QUIC connections are refused.
            endpoint.set_server_config(ctx.quic.clone());
        } else if ctx.quic.is_some() {
            tracing::warn!(listener = %self.addr, "`h3` takes effect on a listener added by a reload, not on one already listening: HTTP/3 not served here until a restart");
        }
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
    pub(crate) fn cut_counts(&self) -> [u64; ConnKind::COUNT] {
        std::array::from_fn(|k| self.cut[k].load(Relaxed))
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

/// What serving one listener's connections needs, for the connections accepted while it is
/// in force.
pub(crate) struct ListenerCtx {
    pub(crate) index: usize,
    pub(crate) settings: Arc<crate::config::ListenerConfig>,
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
    /// The QUIC side's TLS, when the listener serves HTTP/3 (`h3`).
    pub(crate) quic: Option<quinn::ServerConfig>,
    /// `Alt-Svc: h3=":PORT"`, which its HTTP/1.1 and HTTP/2 answers carry when it serves HTTP/3.
    pub(crate) alt_svc: Option<hyper::header::HeaderValue>,
    /// A TCP listener's `allow`/`deny`, checked when a connection opens (an HTTP listener's
    /// are checked per request, by the route targets' policies).
    pub(crate) tcp_access: Option<crate::policy::access::AccessList>,
}

impl ListenerCtx {
    /// Reads the listener's certificate and key (if it has TLS).
    pub(crate) fn build(
        index: usize,
        settings: &crate::config::ListenerConfig,
    ) -> anyhow::Result<Self> {
        let tls = settings
            .tls
            .as_ref()
            .map(crate::tls::server_config)
            .transpose()?;
        let quic = match &tls {
            Some(tls) if settings.serves_h3() => {
                Some(crate::tls::quic_server_config(tls, settings)?)
            }
            _ => None,
        };
        let tls = tls.map(tokio_rustls::TlsAcceptor::from);
        let tcp_access = (settings.protocol == crate::config::ListenerProtocol::Tcp)
            .then(|| crate::policy::access::AccessList::new(&settings.allow, &settings.deny))
            .flatten();
        Ok(Self {
            index,
            settings: Arc::new(settings.clone()),
            tls,
            quic,
            alt_svc: None,
            tcp_access,
        })
    }

    /// The context of a listener bound at `port`: when it serves HTTP/3 (`h3` set and its UDP
    /// port had: `serving`), its TCP answers announce it there (`Alt-Svc`, kept a day as
    /// Envoy's and NGINX's examples have it).
    pub(crate) fn bound_at(mut self, port: u16, serving: bool) -> Self {
        if self.quic.is_some() && serving {
            self.alt_svc =
                hyper::header::HeaderValue::try_from(format!("h3=\":{port}\"; ma=86400")).ok();
        }
        self
    }

    /// What the attempt driver needs to know of a client connection.
    pub(crate) fn client(&self, peer: SocketAddr, worker: usize) -> Client {
        let ip = peer.ip();
        let text = ip.to_string();
        Client {
            peer,
            ip_value: hyper::header::HeaderValue::try_from(text.clone())
                .expect("an IP address is a header value"),
            ip: text,
            proto: if self.tls.is_some() { "https" } else { "http" },
            trust_forwarded: self.settings.trusts(ip),
            trusted_hops: self.settings.trusted_hops,
            worker,
            error_detail: self.settings.error_detail,
            client_cert: None,
            alt_svc: self.alt_svc.clone(),
        }
    }
}

/// An accepted connection on its way to a worker, with its listener slot and its place in
/// the worker's count.
pub(crate) struct Accepted {
    pub(crate) conn: Connection,
    pub(crate) stream: std::net::TcpStream,
}

/// One accepted connection's listener, settings and place in its listener's limit and count.
pub(crate) struct Connection {
    pub(crate) listener: Arc<ListenerSlot>,
    pub(crate) ctx: Arc<ListenerCtx>,
    pub(crate) peer: SocketAddr,
    pub(crate) _slot: tokio::sync::OwnedSemaphorePermit,
    /// Its place in its worker's count, once handed to one (here rather than beside the
    /// connection in its task: one field, not a second layer of future).
    pub(crate) _open: Option<OpenConnection>,
}

impl Connection {
    pub(crate) fn new(
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
            _open: None,
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.listener.open.fetch_sub(1, Relaxed);
    }
}

/// Counts a connection on its worker while it lives.
pub(crate) struct OpenConnection {
    pub(crate) open: Arc<[AtomicUsize]>,
    pub(crate) worker: usize,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.open[self.worker].fetch_sub(1, Relaxed);
    }
}

/// Hands accepted connections to the worker with the fewest open (ties: in turn).
pub(crate) struct Dispatch {
    pub(crate) senders: Vec<tokio::sync::mpsc::UnboundedSender<Accepted>>,
    pub(crate) open: Arc<[AtomicUsize]>,
    pub(crate) next: AtomicUsize,
}

impl Dispatch {
    pub(crate) fn send(&self, mut conn: Connection, stream: TcpStream) {
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
        conn._open = Some(OpenConnection {
            open: self.open.clone(),
            worker,
        });
        let accepted = Accepted { conn, stream };
        // A worker that stopped (shutdown) drops the connection, which closes it.
        let _ = self.senders[worker].send(accepted);
    }
}

/// Logs what a drain cut (a warning) or that nothing was cut.
pub(crate) fn log_drained(what: &str, slots: &[Arc<ListenerSlot>]) {
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

impl Shared {
    /// The addresses this process listens on: its listeners (those in force) and its admin.
    pub(crate) fn own_addrs(&self) -> Vec<SocketAddr> {
        let mut own: Vec<SocketAddr> = self
            .listening
            .listeners
            .load()
            .iter()
            .map(|l| l.addr)
            .collect();
        if let Some(a) = &*self
            .listening
            .admin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            own.push(a.addr);
        }
        own
    }
}

/// True if an endpoint's `host:port` is one of `own` (this process's listening sockets): the
/// same address, or the same port on a loopback or unspecified address (or `localhost`) when
/// the socket listens on every address or on loopback.
pub(crate) fn is_own(endpoint: &str, own: &[SocketAddr]) -> bool {
    let (ip, port) = match endpoint.parse::<SocketAddr>() {
        Ok(a) => (Some(a.ip()), a.port()),
        Err(_) => match endpoint.rsplit_once(':') {
            Some((host, port)) if host.eq_ignore_ascii_case("localhost") => {
                let Ok(port) = port.parse::<u16>() else {
                    return false;
                };
                (None, port)
            }
            _ => return false,
        },
    };
    // `None`: localhost, a loopback address.
    let local = ip.is_none_or(|ip| ip.is_loopback() || ip.is_unspecified());
    own.iter().any(|o| {
        o.port() == port
            && (ip == Some(o.ip()) || (local && (o.ip().is_loopback() || o.ip().is_unspecified())))
    })
}

#[cfg(test)]
mod own_tests {
    use super::is_own;

    #[test]
    fn an_endpoint_at_one_of_the_proxys_own_sockets_is_recognised() {
        let own = [
            "127.0.0.1:8080".parse().unwrap(),
            "0.0.0.0:9901".parse().unwrap(),
        ];
        for e in [
            "127.0.0.1:8080",
            "localhost:8080",
            "127.0.0.1:9901",
            "[::1]:9901",
            "0.0.0.0:9901",
        ] {
            assert!(is_own(e, &own), "{e}");
        }
        for e in [
            "127.0.0.1:8081",
            "10.0.0.1:8080",
            "backend.test:8080",
            "[::1]:8080x",
        ] {
            assert!(!is_own(e, &own), "{e}");
        }
    }
}
