//! Chaos: a steady load of idempotent GETs through the proxy while a seeded random schedule
//! kills and restarts backends, makes them hang, fail or reset, reloads the configuration
//! (strategy and weights) and adds and removes endpoints. The schedule never takes more than
//! half of the configured endpoints down at once, so retries, ejection and health checks must
//! cover every fault: no request may fail. File descriptors must come back to their starting
//! count and memory must stay under a bound.
//!
//! `KEEL_CHAOS_SEED=N` replays another schedule (the seed is printed); `KEEL_CHAOS_SECS=N`
//! changes the length of the chaos phase (default 30 s). Run with `--nocapture` for the summary.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use keel_balance::StrategyKind;
use keel_model::{FailureMode, Latency, LatencyDist};
use keel_proxy::{ProxyConfig, ProxyHandle};
use keel_testbed::backend::{self, BackendConfig, BackendHandle};

/// The schedule used unless `KEEL_CHAOS_SEED` says otherwise.
const DEFAULT_SEED: u64 = 0x6b65_656c_c4a0_5001;
/// Length of the chaos phase unless `KEEL_CHAOS_SECS` says otherwise.
const DEFAULT_CHAOS: Duration = Duration::from_secs(30);
/// Backends in the configuration at the start; the schedule keeps between MIN and MAX.
const INITIAL_ENDPOINTS: usize = 6;
const MIN_ENDPOINTS: usize = 4;
const MAX_ENDPOINTS: usize = 9;
/// Concurrent keep-alive clients, each sending one request per PACE at most: <= 2000 req/s.
const CLIENTS: usize = 8;
const PACE: Duration = Duration::from_millis(4);
/// Size of every backend's 200 body (checked byte for byte).
const BODY_BYTES: usize = 64;
/// A removed endpoint's backend keeps serving this long, so that requests already routed to
/// it by the previous configuration finish (as an operator drains a server before stopping it).
const RETIRE_AFTER: Duration = Duration::from_secs(1);
/// Most growth of the resident set allowed from before the start to the peak. The process holds
/// the proxy, every backend and the clients; a few MB are expected (buffers of a few hundred
/// connections, the maglev tables of the reloads); 64 MB would be a leak.
const RSS_GROWTH_LIMIT_KB: u64 = 64 * 1024;
/// Descriptors allowed above the starting count once everything has stopped: none. Everything
/// this test opens after its first count is a socket that must be closed by then (the tokio
/// runtime's epoll and wake-up descriptors exist before it; address lookups are numeric and
/// open nothing). Sockets close asynchronously (a connection task ends after its peer closed),
/// which the wait of up to 3 s before the last count allows for, not a slack.
const FD_SLACK: usize = 0;

/// The proxy's cluster settings, tuned as a user would for this failure model:
/// - retries: 4 (5 tries, each on an endpoint not tried yet while one is left). At most half of
///   the endpoints (at most 4 of the at most 9) are down at once, so the 5th distinct try is on
///   a good one unless the schedule took another one down during that very request; with
///   ejection and health checks taking down endpoints out of rotation within ~0.5 s, most
///   requests meet none. Only a try on a good endpoint is never lost: the proxy retries every
///   failure of an idempotent GET (refused, reset, cut body, 503, per-try timeout). The budget
///   is raised so that a burst of failures (a kill with requests in flight) cannot use it up.
///   With `attempts = 1` this test does lose requests (4 with the default seed, 600 with seed 1).
/// - panic threshold: the default 50%. Endpoints still ejected after a restart can push the
///   available share under it for a moment; picks then ignore health and meet down endpoints
///   more often, which retries cover at the cost of latency.
/// - per-try timeout 250 ms: a hung endpoint costs a request 250 ms, not the whole
///   request timeout, and the retry goes elsewhere. Healthy answers take ~2 ms.
/// - outlier detection: 2 failures in a row eject for 1 s (at most 4 s), at most 50%.
/// - health checks every 100 ms (timeout 200 ms, 2 in a row): a killed or hung endpoint is out
///   of rotation within ~0.5 s, a restarted one back within ~0.2 s.
/// - pool idle timeout 2 s (default 90 s): pooled connections to a killed endpoint stay open
///   (CLOSE-WAIT) until reaped, so a short timeout gives their descriptors back soon.
const CLUSTER_SETTINGS: &str = r#"connect_timeout = "250ms"
request_timeout = "5s"
pool_idle_timeout = "2s"
[cluster.retry]
attempts = 4
per_try_timeout = "250ms"
budget_percent = 100.0
min_retries_per_second = 100.0
[cluster.outlier_detection]
consecutive_failures = 2
base_ejection_time = "1s"
max_ejection_time = "4s"
max_ejection_percent = 50.0
[cluster.health_check]
interval = "100ms"
timeout = "200ms"
unhealthy_threshold = 2
healthy_threshold = 2
"#;

/// splitmix64: a small, fixed, seedable generator (the schedule must replay from its seed).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn between_ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next_u64() % (hi - lo + 1))
    }
}

/// What a backend of the pool is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Up,
    /// Slow but answering (x20 latency, mean 40 ms): not down.
    Slow,
    Hang,
    Error,
    Reset,
    /// Stopped: the port refuses.
    Killed,
}

impl State {
    /// Down: every request sent to it fails.
    fn is_down(self) -> bool {
        !matches!(self, State::Up | State::Slow)
    }
}

/// One configured endpoint and its backend (none while killed).
struct Slot {
    addr: SocketAddr,
    backend: Option<BackendHandle>,
    state: State,
    weight: u32,
}

fn backend_config() -> BackendConfig {
    // Named after nothing: the `x-backend` header is then the bound address, which the test
    // compares with the proxy's `x-keel-endpoint`.
    BackendConfig {
        // Exponential, mean 2 ms: a kill usually finds requests in flight.
        latency: Latency {
            mean: Duration::from_millis(2),
            dist: LatencyDist::Exponential,
        },
        body_bytes: BODY_BYTES,
        ..BackendConfig::default()
    }
}

fn proxy_config(slots: &[Slot], strategy: StrategyKind) -> ProxyConfig {
    let eps: Vec<String> = slots
        .iter()
        .map(|s| format!("{{ address = \"{}\", weight = {} }}", s.addr, s.weight))
        .collect();
    let text = format!(
        "drain_timeout = \"2s\"\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nresponse_headers = {{ endpoint = true }}\nname = \"app\"\nstrategy = \"{}\"\nendpoints = [{}]\n{CLUSTER_SETTINGS}",
        strategy.name(),
        eps.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "chaos.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}

/// Waits up to `limit` for the open descriptors to come down to `target`; returns the last
/// count (a probe's socket may be open for a moment, hence the polling).
async fn settle_fds(target: usize, limit: Duration) -> usize {
    let start = Instant::now();
    loop {
        let n = open_fds();
        if n <= target || start.elapsed() >= limit {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd (Linux)")
        .count()
}

/// VmRSS and VmHWM in kB.
fn memory_kb() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/self/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The proxy's `/metrics` text, fetched on a plain socket.
async fn metrics_text(admin: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("/metrics within 5 s")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of the metric line that starts with `series` (name and labels), 0 if absent.
fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// What the clients saw.
struct LoadStats {
    sent: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    /// The first failures, described, with their time since the start.
    failures: Mutex<Vec<String>>,
    /// 200 responses by answering endpoint.
    by_endpoint: Mutex<BTreeMap<String, u64>>,
    /// Per second since the start: requests answered, and those that took >= 250 ms (one
    /// per-try timeout or more), for `KEEL_CHAOS_VERBOSE`.
    per_second: [AtomicU64; 128],
    slow_per_second: [AtomicU64; 128],
}

impl Default for LoadStats {
    fn default() -> Self {
        Self {
            sent: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failures: Mutex::new(Vec::new()),
            by_endpoint: Mutex::new(BTreeMap::new()),
            per_second: std::array::from_fn(|_| AtomicU64::new(0)),
            slow_per_second: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl LoadStats {
    fn fail(&self, t0: Instant, what: String) {
        self.failed.fetch_add(1, Relaxed);
        let mut f = self.failures.lock().unwrap();
        if f.len() < 50 {
            f.push(format!("t={:.3}s {what}", t0.elapsed().as_secs_f64()));
        }
    }
}

/// One keep-alive client: a GET per PACE (fewer if responses are slower), a new connection only
/// when the proxy closed the old one. Every response must be a 200 from a backend, whole.
async fn client(
    id: usize,
    proxy: SocketAddr,
    stop: Arc<AtomicBool>,
    stats: Arc<LoadStats>,
    t0: Instant,
) {
    let mut sender: Option<http1::SendRequest<Empty<Bytes>>> = None;
    let mut conn_tasks = Vec::new();
    let mut by_endpoint: BTreeMap<String, u64> = BTreeMap::new();
    let mut tick = tokio::time::interval(PACE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    while !stop.load(Relaxed) {
        tick.tick().await;
        let usable = matches!(&sender, Some(s) if !s.is_closed());
        if !usable {
            let connected = async {
                let stream = tokio::net::TcpStream::connect(proxy)
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                stream.set_nodelay(true).map_err(|e| e.to_string())?;
                http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("handshake: {e}"))
            }
            .await;
            match connected {
                Ok((s, conn)) => {
                    conn_tasks.push(tokio::spawn(conn));
                    sender = Some(s);
                }
                Err(e) => {
                    stats.sent.fetch_add(1, Relaxed);
                    stats.fail(t0, format!("client {id}: cannot reach the proxy: {e}"));
                    continue;
                }
            }
        }
        let s = sender.as_mut().expect("connected above");
        if s.ready().await.is_err() {
            sender = None;
            continue;
        }
        n += 1;
        let req = Request::get(format!("/chaos/{id}/{n}"))
            .header("host", "chaos.test")
            .body(Empty::<Bytes>::new())
            .expect("valid request");
        stats.sent.fetch_add(1, Relaxed);
        let sent_at = Instant::now();
        let exchange = async {
            let resp = s.send_request(req).await.map_err(|e| format!("{e:?}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("body: {e:?}"))?
                .to_bytes();
            Ok::<_, String>((parts, body))
        };
        // Longer than the proxy's request timeout (5 s): the proxy must answer first.
        let outcome = tokio::time::timeout(Duration::from_secs(10), exchange).await;
        let second = (t0.elapsed().as_secs() as usize).min(127);
        stats.per_second[second].fetch_add(1, Relaxed);
        if sent_at.elapsed() >= Duration::from_millis(250) {
            stats.slow_per_second[second].fetch_add(1, Relaxed);
        }
        match outcome {
            Err(_) => {
                sender = None;
                stats.fail(t0, format!("client {id} req {n}: no answer within 10 s"));
            }
            Ok(Err(e)) => {
                sender = None;
                stats.fail(t0, format!("client {id} req {n}: transport error {e}"));
            }
            Ok(Ok((parts, body))) => {
                let header = |name: &str| {
                    parts
                        .headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string()
                };
                let endpoint = header("x-keel-endpoint");
                let backend_name = header("x-backend");
                let whole = body.len() == BODY_BYTES && body.iter().all(|b| *b == b'x');
                if parts.status == StatusCode::OK
                    && !endpoint.is_empty()
                    && endpoint == backend_name
                    && whole
                {
                    stats.ok.fetch_add(1, Relaxed);
                    *by_endpoint.entry(endpoint).or_default() += 1;
                } else {
                    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
                    stats.fail(
                        t0,
                        format!(
                            "client {id} req {n}: status {} endpoint {endpoint:?} backend {backend_name:?} body {} bytes: {}",
                            parts.status,
                            body.len(),
                            text.trim_end()
                        ),
                    );
                }
            }
        }
    }
    drop(sender);
    for t in conn_tasks {
        let _ = t.await;
    }
    let mut all = stats.by_endpoint.lock().unwrap();
    for (k, v) in by_endpoint {
        *all.entry(k).or_default() += v;
    }
}

/// Peaks of descriptors and memory, sampled every 20 ms.
#[derive(Default)]
struct Peaks {
    fds: AtomicU64,
    rss_kb: AtomicU64,
}

/// Counters of the schedule, for the summary.
#[derive(Default)]
struct ChaosCounts {
    kills: u32,
    /// Connections open on the backends when they were killed (cut with them).
    connections_cut: u64,
    restarts: u32,
    restart_port_taken: u32,
    faults: BTreeMap<&'static str, u32>,
    cleared: u32,
    reloads: u32,
    added: u32,
    removed: u32,
    most_down: usize,
}

/// The chaos schedule's state: the configured endpoints, the strategy in force, backends
/// removed from the configuration and waiting to be stopped.
struct Chaos {
    rng: Rng,
    slots: Vec<Slot>,
    strategy: StrategyKind,
    retiring: Vec<(Instant, BackendHandle)>,
    counts: ChaosCounts,
    log: Vec<String>,
    t0: Instant,
}

impl Chaos {
    fn down(&self) -> usize {
        self.slots.iter().filter(|s| s.state.is_down()).count()
    }

    /// True if one more endpoint may go down: at most half of the configured ones at once.
    fn may_take_down(&self) -> bool {
        self.down() < self.slots.len() / 2
    }

    fn note(&mut self, what: String) {
        self.log
            .push(format!("t={:.3}s {what}", self.t0.elapsed().as_secs_f64()));
    }

    fn pick(&mut self, want: impl Fn(State) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.slots.len())
            .filter(|&i| want(self.slots[i].state))
            .collect();
        (!candidates.is_empty()).then(|| candidates[self.rng.below(candidates.len())])
    }

    fn reload(&mut self, proxy: &ProxyHandle) {
        proxy
            .reload(proxy_config(&self.slots, self.strategy))
            .expect("a valid configuration reloads");
        self.counts.reloads += 1;
    }

    /// One step of the schedule; returns what it did.
    async fn step(&mut self, proxy: &ProxyHandle) -> String {
        // Stop the backends whose endpoints were removed long enough ago.
        let now = Instant::now();
        let (old, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retiring)
            .into_iter()
            .partition(|(at, _)| now.duration_since(*at) >= RETIRE_AFTER);
        self.retiring = keep;
        for (_, b) in old {
            b.shutdown().await;
        }
        loop {
            match self.rng.below(15) {
                0..=2 => {
                    if !self.may_take_down() {
                        continue;
                    }
                    let Some(i) = self.pick(|s| !s.is_down()) else {
                        continue;
                    };
                    let b = self.slots[i].backend.take().expect("an up backend runs");
                    // Stops listening and drops every connection, in-flight requests included
                    // (closed with a FIN, as the kernel does for a process that exits; the
                    // `reset` fault covers RSTs).
                    self.counts.connections_cut += b.open_connections();
                    b.shutdown().await;
                    self.slots[i].state = State::Killed;
                    self.counts.kills += 1;
                    return format!("kill {}", self.slots[i].addr);
                }
                3..=5 => {
                    let Some(i) = self.pick(|s| s == State::Killed) else {
                        continue;
                    };
                    let addr = self.slots[i].addr;
                    // Same port: a restarted server. A connection of this process may have taken
                    // the port as its local port meanwhile (it is in the ephemeral range); then
                    // the backend stays down and a later step tries again.
                    let mut spawned = None;
                    for _ in 0..20 {
                        match backend::spawn(addr, backend_config()).await {
                            Ok(b) => {
                                spawned = Some(b);
                                break;
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                        }
                    }
                    let Some(b) = spawned else {
                        self.counts.restart_port_taken += 1;
                        return format!("restart {addr}: port taken, stays down");
                    };
                    self.slots[i].backend = Some(b);
                    self.slots[i].state = State::Up;
                    self.counts.restarts += 1;
                    return format!("restart {addr}");
                }
                6..=8 => {
                    let (state, fault, name) = match self.rng.below(4) {
                        0 => (State::Hang, FailureMode::Hang, "hang"),
                        1 => (State::Error, FailureMode::FAIL_AT_ONCE, "error"),
                        2 => (State::Reset, FailureMode::Reset, "reset"),
                        _ => (State::Slow, FailureMode::Slow { factor: 20.0 }, "slow"),
                    };
                    if state.is_down() && !self.may_take_down() {
                        continue;
                    }
                    let Some(i) = self.pick(|s| s == State::Up) else {
                        continue;
                    };
                    let b = self.slots[i].backend.as_ref().expect("an up backend runs");
                    b.apply_fault(fault).await.expect("fault applied");
                    self.slots[i].state = state;
                    *self.counts.faults.entry(name).or_default() += 1;
                    return format!("fault {name} on {}", self.slots[i].addr);
                }
                9..=10 => {
                    let Some(i) = self.pick(|s| s != State::Up && s != State::Killed) else {
                        continue;
                    };
                    let b = self.slots[i]
                        .backend
                        .as_ref()
                        .expect("a faulty backend runs");
                    b.apply_fault(FailureMode::None)
                        .await
                        .expect("fault cleared");
                    let was = self.slots[i].state;
                    self.slots[i].state = State::Up;
                    self.counts.cleared += 1;
                    return format!("clear {was:?} on {}", self.slots[i].addr);
                }
                11..=12 => {
                    self.strategy = StrategyKind::ALL[self.rng.below(StrategyKind::ALL.len())];
                    for i in 0..self.slots.len() {
                        self.slots[i].weight = 1 + self.rng.below(4) as u32;
                    }
                    self.reload(proxy);
                    let weights: Vec<u32> = self.slots.iter().map(|s| s.weight).collect();
                    return format!("reload {} weights {weights:?}", self.strategy.name());
                }
                13 => {
                    if self.slots.len() >= MAX_ENDPOINTS {
                        continue;
                    }
                    let b = backend::spawn("127.0.0.1:0".parse().unwrap(), backend_config())
                        .await
                        .expect("a new backend");
                    let addr = b.addr();
                    self.slots.push(Slot {
                        addr,
                        backend: Some(b),
                        state: State::Up,
                        weight: 1 + self.rng.below(4) as u32,
                    });
                    self.reload(proxy);
                    self.counts.added += 1;
                    return format!("add {addr} ({} endpoints)", self.slots.len());
                }
                _ => {
                    if self.slots.len() <= MIN_ENDPOINTS {
                        continue;
                    }
                    let i = self.rng.below(self.slots.len());
                    // What stays must keep at most half down.
                    let down_after = self.down() - usize::from(self.slots[i].state.is_down());
                    if down_after > (self.slots.len() - 1) / 2 {
                        continue;
                    }
                    let slot = self.slots.remove(i);
                    self.reload(proxy);
                    if let Some(b) = slot.backend {
                        self.retiring.push((Instant::now(), b));
                    }
                    self.counts.removed += 1;
                    return format!(
                        "remove {} ({:?}; {} endpoints)",
                        slot.addr,
                        slot.state,
                        self.slots.len()
                    );
                }
            }
        }
    }
}

#[test]
fn chaos_loses_no_request_and_leaks_nothing() {
    crate::alone(async {
        let seed = std::env::var("KEEL_CHAOS_SEED")
            .ok()
            .map(|s| {
                s.parse::<u64>()
                    .unwrap_or_else(|_| panic!("KEEL_CHAOS_SEED={s:?} is not a u64"))
            })
            .unwrap_or(DEFAULT_SEED);
        let chaos_for = std::env::var("KEEL_CHAOS_SECS")
            .ok()
            .map(|s| Duration::from_secs(s.parse().expect("KEEL_CHAOS_SECS in seconds")))
            .unwrap_or(DEFAULT_CHAOS);
        println!("chaos: seed {seed} (replay with KEEL_CHAOS_SEED={seed}), {chaos_for:?} of chaos");

        let fds_before = open_fds();
        let (rss_before, _) = memory_kb();
        let t0 = Instant::now();

        let mut slots = Vec::new();
        for _ in 0..INITIAL_ENDPOINTS {
            let b = backend::spawn("127.0.0.1:0".parse().unwrap(), backend_config())
                .await
                .unwrap();
            slots.push(Slot {
                addr: b.addr(),
                backend: Some(b),
                state: State::Up,
                weight: 1,
            });
        }
        let initial: Vec<SocketAddr> = slots.iter().map(|s| s.addr).collect();
        let proxy = keel_proxy::start(proxy_config(&slots, StrategyKind::RoundRobin))
            .await
            .unwrap();
        let proxy_addr = proxy.listener_addrs()[0];

        let stop_monitor = Arc::new(AtomicBool::new(false));
        let peaks = Arc::new(Peaks::default());
        let monitor = {
            let stop = stop_monitor.clone();
            let peaks = peaks.clone();
            tokio::spawn(async move {
                while !stop.load(Relaxed) {
                    peaks.fds.fetch_max(open_fds() as u64, Relaxed);
                    peaks.rss_kb.fetch_max(memory_kb().0, Relaxed);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };

        let stop_load = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(LoadStats::default());
        let clients: Vec<_> = (0..CLIENTS)
            .map(|id| tokio::spawn(client(id, proxy_addr, stop_load.clone(), stats.clone(), t0)))
            .collect();

        let mut chaos = Chaos {
            rng: Rng(seed),
            slots,
            strategy: StrategyKind::RoundRobin,
            retiring: Vec::new(),
            counts: ChaosCounts::default(),
            log: Vec::new(),
            t0,
        };
        // A moment of calm first, so that the load is flowing before the first fault.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let chaos_start = Instant::now();
        while chaos_start.elapsed() < chaos_for {
            let pause = chaos.rng.between_ms(100, 500);
            tokio::time::sleep(pause).await;
            let did = chaos.step(&proxy).await;
            chaos.note(did);
            chaos.counts.most_down = chaos.counts.most_down.max(chaos.down());
            assert!(chaos.down() * 2 <= chaos.slots.len(), "schedule invariant");
        }
        let chaos_took = chaos_start.elapsed();
        stop_load.store(true, Relaxed);
        for c in clients {
            c.await.unwrap();
        }
        let load_took = t0.elapsed();
        let sent = stats.sent.load(Relaxed);
        let ok = stats.ok.load(Relaxed);
        let failed = stats.failed.load(Relaxed);

        let m = metrics_text(proxy.admin_addr().expect("admin listener")).await;
        let retries = metric(&m, "keel_retries_total{cluster=\"app\"}");
        let budget_refusals = metric(&m, "keel_retry_budget_refusals_total{cluster=\"app\"}");
        let no_endpoint = metric(&m, "keel_no_endpoint_total{cluster=\"app\"}");
        let reloads_ok = metric(&m, "keel_config_reloads_total{result=\"ok\"}");

        // Everything stops: first every backend, with the proxy still running. Its pooled
        // connections to them are then closed by the peer, but the pool closes its side only when
        // it next checks a connection out or when `pool_idle_timeout` (2 s here) reaps it; until
        // then they sit in CLOSE-WAIT. So the running proxy must come down to its two listening
        // sockets (listener and admin) within a few idle timeouts.
        let final_endpoints: Vec<SocketAddr> = chaos.slots.iter().map(|s| s.addr).collect();
        for s in chaos.slots.drain(..) {
            if let Some(b) = s.backend {
                b.shutdown().await;
            }
        }
        for (_, b) in chaos.retiring.drain(..) {
            b.shutdown().await;
        }
        let proxy_listeners = 2;
        let fds_proxy_idle = settle_fds(fds_before + proxy_listeners, Duration::from_secs(8)).await;
        // Then the proxy; connection tasks end a moment after their peer closed.
        proxy.shutdown(Duration::from_secs(2)).await;
        let fds_after = settle_fds(fds_before, Duration::from_secs(3)).await;
        stop_monitor.store(true, Relaxed);
        monitor.await.unwrap();
        let (rss_after, hwm) = memory_kb();
        let fds_peak = peaks.fds.load(Relaxed);
        let rss_peak = peaks.rss_kb.load(Relaxed).max(hwm);

        let c = &chaos.counts;
        let faults: Vec<String> = c.faults.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let by_endpoint = stats.by_endpoint.lock().unwrap().clone();
        let mut summary = String::new();
        write!(
        summary,
        "chaos summary: seed {seed}; chaos {:.1}s (load {:.1}s); requests sent {sent} ok {ok} failed {failed} ({:.0}/s), proxy retries {retries} (budget refusals {budget_refusals}, no endpoint {no_endpoint}); \
         kills {} (connections cut {}) restarts {} (port taken {}); faults [{}] cleared {}; reloads {}; endpoints added {} removed {} (most down at once {}); \
         fds before {fds_before} peak {fds_peak} proxy idle {fds_proxy_idle} after {fds_after}; RSS kB before {rss_before} peak {rss_peak} after {rss_after}; \
         {} endpoints answered",
        chaos_took.as_secs_f64(),
        load_took.as_secs_f64(),
        sent as f64 / load_took.as_secs_f64(),
        c.kills,
        c.connections_cut,
        c.restarts,
        c.restart_port_taken,
        faults.join(", "),
        c.cleared,
        c.reloads,
        c.added,
        c.removed,
        c.most_down,
        by_endpoint.len(),
    )
    .unwrap();
        println!("{summary}");

        if failed > 0 || std::env::var_os("KEEL_CHAOS_VERBOSE").is_some() {
            println!("--- chaos schedule ---\n{}", chaos.log.join("\n"));
            let seconds: Vec<String> = (0..=(load_took.as_secs() as usize).min(127))
                .map(|i| {
                    format!(
                        "{i}s: {} ({} slow)",
                        stats.per_second[i].load(Relaxed),
                        stats.slow_per_second[i].load(Relaxed)
                    )
                })
                .collect();
            println!(
                "--- requests answered per second (slow: >= 250 ms) ---\n{}",
                seconds.join("\n")
            );
            println!(
                "--- failures (first 50) ---\n{}",
                stats.failures.lock().unwrap().join("\n")
            );
        }
        assert_eq!(
            failed, 0,
            "requests failed although at most half of the endpoints were down (see above)"
        );
        assert_eq!(ok, sent);
        // The faults were met (tries failed and were retried) and the proxy applied every reload.
        assert!(retries > 0, "{summary}");
        assert_eq!(reloads_ok, u64::from(c.reloads), "{summary}");
        // The chaos did something: load flowed, and (in a run of the default length, ~100 events)
        // every kind of event happened and added endpoints served requests. Shorter runs
        // (KEEL_CHAOS_SECS) may miss a kind by chance, so only the default length checks that.
        assert!(sent >= 1000, "too little load: {sent}");
        if chaos_for >= DEFAULT_CHAOS {
            assert!(
                c.kills > 0 && c.restarts > 0 && c.reloads > 0 && c.added > 0 && c.removed > 0,
                "{summary}"
            );
            assert!(
                c.faults.keys().filter(|k| **k != "slow").count() >= 2,
                "{summary}"
            );
            assert!(
                by_endpoint
                    .keys()
                    .any(|e| !initial.iter().any(|a| a.to_string() == *e)),
                "no answer from an added endpoint: {by_endpoint:?}"
            );
        }
        assert!(
            final_endpoints
                .iter()
                .any(|a| by_endpoint.contains_key(&a.to_string())),
            "{by_endpoint:?}"
        );
        assert!(
        fds_proxy_idle <= fds_before + proxy_listeners + FD_SLACK,
        "the running proxy holds descriptors after its backends stopped: {fds_before} before the start, {fds_proxy_idle} with the proxy idle (2 listeners)"
    );
        assert!(
            fds_after <= fds_before + FD_SLACK,
            "descriptors leaked: {fds_before} before, {fds_after} after (peak {fds_peak})"
        );
        assert!(
            rss_peak.saturating_sub(rss_before) < RSS_GROWTH_LIMIT_KB,
            "RSS grew by {} kB (limit {RSS_GROWTH_LIMIT_KB} kB)",
            rss_peak - rss_before
        );
    });
}
