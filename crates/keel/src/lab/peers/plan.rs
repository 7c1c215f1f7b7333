//! What the peers run: which balancer, in which setting, with which strategy, on which case of
//! the source's example, and what a configuration generator (nginx.rs, haproxy.rs, envoy.rs)
//! needs. Below the generators and the runner, so each reads it without reading its parent.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_balance::{StrategyKind, TieBreak};
use keel_model::FailureMode;
use keel_testbed::loadgen::Client;

use crate::lab::cases::{Case, Protection, Timing};

/// Workers (processes or threads) every peer runs with, as operators run them.
pub(crate) const WORKERS: u32 = 2;

/// A balancer measured next to keel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    Nginx,
    Haproxy,
    Envoy,
}

impl Peer {
    pub(crate) const ALL: [Peer; 3] = [Peer::Nginx, Peer::Haproxy, Peer::Envoy];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Peer::Nginx => "nginx",
            Peer::Haproxy => "haproxy",
            Peer::Envoy => "envoy",
        }
    }

    /// The environment variable that names the binary, ahead of PATH.
    pub(crate) fn env_var(self) -> &'static str {
        match self {
            Peer::Nginx => "KEEL_NGINX",
            Peer::Haproxy => "KEEL_HAPROXY",
            Peer::Envoy => "KEEL_ENVOY",
        }
    }

    /// The binary: `$KEEL_<PEER>`, else PATH, else /usr/sbin and /sbin (where Debian puts
    /// nginx and haproxy).
    pub(crate) fn find(self) -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(self.env_var()) {
            let p = PathBuf::from(p);
            return is_executable(&p).then_some(p);
        }
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
            .map(|d| d.join(self.name()))
            .find(|p| is_executable(p))
    }

    pub(crate) fn file_name(self) -> &'static str {
        match self {
            Peer::Nginx => "nginx.conf",
            Peer::Haproxy => "haproxy.cfg",
            Peer::Envoy => "envoy.yaml",
        }
    }
}

/// A `--peers` name that is none of the peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPeer(pub String);

impl std::fmt::Display for UnknownPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "unknown peer `{}`; allowed: nginx, haproxy, envoy",
            self.0
        )
    }
}

impl std::error::Error for UnknownPeer {}

impl std::str::FromStr for Peer {
    type Err = UnknownPeer;
    fn from_str(s: &str) -> Result<Self, UnknownPeer> {
        Peer::ALL
            .into_iter()
            .find(|p| p.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| UnknownPeer(s.to_string()))
    }
}

pub(crate) fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Bare, or as operators usually configure the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Setting {
    Bare,
    Operators,
}

impl Setting {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Setting::Bare => "bare",
            Setting::Operators => "operators",
        }
    }
}

/// The strategies every peer has and the closed forms cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PeerStrategy {
    RoundRobin,
    Random,
    LeastConnections,
    /// Consistent hashing on a key the client sets, one per request (its calls hash alike).
    Hash,
}

impl PeerStrategy {
    pub(crate) const ALL: [PeerStrategy; 4] = [
        PeerStrategy::RoundRobin,
        PeerStrategy::Random,
        PeerStrategy::LeastConnections,
        PeerStrategy::Hash,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            PeerStrategy::RoundRobin => "round-robin",
            PeerStrategy::Random => "random",
            PeerStrategy::LeastConnections => "least-connections",
            PeerStrategy::Hash => "hash",
        }
    }

    /// The peer's own spelling of the strategy.
    pub(crate) fn native(self, peer: Option<Peer>) -> &'static str {
        use PeerStrategy::*;
        match (peer, self) {
            (None, RoundRobin) => "round-robin",
            (None, Random) => "random",
            (None, LeastConnections) => "least-connections",
            (None, Hash) => "ring-hash on x-lab-key",
            (Some(Peer::Nginx), RoundRobin) => "(default)",
            (Some(Peer::Nginx), Random) => "random",
            (Some(Peer::Nginx), LeastConnections) => "least_conn",
            (Some(Peer::Nginx), Hash) => "hash $http_x_lab_key consistent",
            (Some(Peer::Haproxy), RoundRobin) => "balance roundrobin",
            (Some(Peer::Haproxy), Random) => "balance random (2 draws)",
            (Some(Peer::Haproxy), LeastConnections) => "balance leastconn",
            (Some(Peer::Haproxy), Hash) => "balance hdr(x-lab-key), hash-type consistent",
            (Some(Peer::Envoy), RoundRobin) => "ROUND_ROBIN",
            (Some(Peer::Envoy), Random) => "RANDOM",
            (Some(Peer::Envoy), LeastConnections) => "LEAST_REQUEST",
            (Some(Peer::Envoy), Hash) => "RING_HASH on header x-lab-key",
        }
    }

    /// keel's strategy for the same row.
    pub(crate) fn keel(self) -> StrategyKind {
        match self {
            PeerStrategy::RoundRobin => StrategyKind::RoundRobin,
            PeerStrategy::Random => StrategyKind::Random,
            PeerStrategy::LeastConnections => StrategyKind::LeastConnections,
            PeerStrategy::Hash => StrategyKind::RingHash,
        }
    }

    /// The closed form that covers it (hash rows: 1 minus the failed server's key share,
    /// measured on the balancer's own ring, see [`PeerRow::key_share`]; the uniform pick's
    /// share stands in for the failed share of calls when no key share is measured).
    pub(crate) fn model(self) -> StrategyKind {
        match self {
            PeerStrategy::RoundRobin => StrategyKind::RoundRobin,
            PeerStrategy::Random | PeerStrategy::Hash => StrategyKind::Random,
            PeerStrategy::LeastConnections => StrategyKind::LeastConnections,
        }
    }
}

/// What a configuration generator needs.
pub(crate) struct PeerConfig<'a> {
    /// Port the peer listens on (127.0.0.1).
    pub listen: u16,
    /// Envoy's admin port.
    pub admin: u16,
    /// The backends, the failed one last.
    pub backends: &'a [SocketAddr],
    pub strategy: PeerStrategy,
    pub setting: Setting,
    /// One try's time limit (the lab's timeout).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// Where the peer writes its pid, logs and temporary files.
    pub dir: &'a Path,
}

pub(crate) fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Connect timeout of every peer (keel's lab proxy uses the same).
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_millis(100);

/// One row of the source's example.
#[derive(Debug, Clone)]
pub(crate) struct PeerCase {
    pub strategy: PeerStrategy,
    pub setting: Setting,
    pub failure: FailureMode,
    pub calls: u32,
    pub servers: u32,
    pub failed: u32,
    pub concurrency: usize,
    pub requests: u64,
    /// What a request does after a failed call.
    pub client: Client,
    /// Healthy times spread (exponential, [`SPREAD_MEAN`]) rather than fixed.
    pub spread: bool,
}

/// Clients of the all-calls row whose healthy times are spread: few enough that two picks
/// rarely fall within a fast failure's round trip of each other (the backends' timers fire on
/// 1 ms ticks, so completions bunch when clients outnumber the milliseconds of a call), enough
/// that the order shuffles (4 clients kept some of it: 0.42-0.44; 8: 0.43-0.45; 12: 0.44-0.45).
pub(crate) const SPREAD_CLIENTS: usize = 12;

/// Mean healthy time of that row: long against one timer tick, so that the clients' picks come
/// one at a time, yet spread wide enough (exponential) that their order shuffles.
pub(crate) const SPREAD_MEAN: Duration = Duration::from_millis(20);

/// Requests of that row, quick or not: its closed form is compared with 0.512 and 0.400 on
/// either side, so its interval must be narrower than the quick rows' (about +-0.022; 9 s a
/// balancer).
pub(crate) const SPREAD_REQUESTS: u64 = 2000;

impl PeerCase {
    pub(crate) fn p(&self) -> f64 {
        self.failed as f64 / self.servers as f64
    }

    /// q = t_fail / t_ok as the lab's simulation has it (round trip added to both).
    pub(crate) fn q(&self, t: &Timing) -> Option<f64> {
        let t_fail = self.failure.failure_time(t.timeout, t.healthy)?;
        let t_fail = (t_fail + t.round_trip).min(t.timeout);
        Some(t_fail.as_secs_f64() / (t.healthy + t.round_trip).as_secs_f64())
    }

    /// The timing this row runs with: the lab's, with the healthy times spread for a spread row.
    pub(crate) fn timing(&self, t: &Timing) -> Timing {
        let mut t = t.clone();
        if self.spread {
            t.healthy = SPREAD_MEAN;
            t.healthy_dist = keel_model::LatencyDist::Exponential;
        }
        t
    }

    pub(crate) fn is_failed(&self, i: u32) -> bool {
        i >= self.servers - self.failed
    }

    /// The same row through keel's proxy: bare is no protection at all, operators is keel's
    /// defaults.
    pub(crate) fn keel_case(&self) -> Case {
        Case {
            experiment: "peers",
            strategy: self.strategy.keel(),
            tie_break: TieBreak::Random,
            failed_first: false,
            protections: match self.setting {
                Setting::Bare => Protection::None,
                Setting::Operators => Protection::Defaults,
            },
            failure: self.failure,
            servers: self.servers,
            failed: self.failed,
            calls: self.calls,
            client_side: false,
            concurrency: self.concurrency,
            requests: self.requests,
            client: self.client,
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "{} {} {} k={}{}",
            self.setting.name(),
            self.strategy.name(),
            self.failure.name(),
            self.calls,
            match self.client {
                Client::StopsAtFirstFailure => String::new(),
                Client::AllCalls => format!(
                    " all calls x{}{}",
                    self.concurrency,
                    if self.spread {
                        ", healthy times spread"
                    } else {
                        ""
                    }
                ),
            }
        )
    }
}

/// Requests per row.
pub(crate) fn requests_per_row(quick: bool) -> u64 {
    if quick {
        600
    } else {
        2000
    }
}

/// The rows: both settings, every strategy (or those of `only`: keel's names, ring-hash for
/// hash), a hang and a fast 503, 1 and 3 calls, from a client that stops at a request's first
/// failed call; and bare round-robin's 3-call rows again from a client that makes all 3.
pub(crate) fn plan(quick: bool, only: &[StrategyKind]) -> Vec<PeerCase> {
    let mut out = Vec::new();
    let wanted = |s: PeerStrategy| only.is_empty() || only.contains(&s.keel());
    for setting in [Setting::Bare, Setting::Operators] {
        for strategy in PeerStrategy::ALL.into_iter().filter(|s| wanted(*s)) {
            for failure in [FailureMode::Hang, FailureMode::FAIL_AT_ONCE] {
                for calls in [1, 3] {
                    let case = PeerCase {
                        strategy,
                        setting,
                        failure,
                        calls,
                        servers: 5,
                        failed: 1,
                        concurrency: 24,
                        requests: requests_per_row(quick),
                        client: Client::StopsAtFirstFailure,
                        spread: false,
                    };
                    // Bare round-robin's 3-call rows again from clients that make all 3 calls:
                    // 24 (other clients' picks interleave a request's calls); and, failing fast,
                    // 2 (in step: 1 - k p) and 12 with spread healthy times (the picks' order
                    // shuffles, but a client whose call failed at once picks again before
                    // anyone else). A hang's in-step row would take 75 s a balancer for what
                    // the fast one shows.
                    let all_calls = setting == Setting::Bare
                        && strategy == PeerStrategy::RoundRobin
                        && calls > 1;
                    out.push(case.clone());
                    if !all_calls {
                        continue;
                    }
                    let all = PeerCase {
                        client: Client::AllCalls,
                        ..case
                    };
                    out.push(all.clone());
                    if failure != FailureMode::Hang {
                        out.push(PeerCase {
                            concurrency: crate::lab::rotation::IN_STEP_CLIENTS,
                            ..all.clone()
                        });
                        out.push(PeerCase {
                            concurrency: SPREAD_CLIENTS,
                            requests: SPREAD_REQUESTS,
                            spread: true,
                            ..all
                        });
                    }
                }
            }
        }
    }
    out
}
