//! One replication: a discrete-event loop on a virtual clock (nanoseconds since 0).
//!
//! Hot-path layout, chosen for speed: an event is one `u128` (time in the high 64 bits, kind and
//! slot index below) in a `BinaryHeap`, so that ordering is one integer compare and ties break
//! deterministically by kind then slot; every request in progress lives in a preallocated
//! `Slot` that also holds its open [`Pick`]; servers, balancers and counters are flat vectors
//! indexed by position. One call costs one pick, one heap push and pop, one finish: no
//! allocation, no map.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use keel_balance::{
    mix64, Balancer, BalancerConfig, EndpointId, EndpointSpec, Outcome, Pick, PickContext,
    RetryBudget,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

use super::scenario::{
    FailedPosition, FailureMode, LatencyDist, Load, Placement, Scenario, MAX_RETRIES,
};
use super::SimError;

const KIND_CALL: u128 = 0;
const KIND_START: u128 = 1;
const KIND_ARRIVAL: u128 = 2;
const KIND_PROBE: u128 = 3;
const KIND_NEXT_CALL: u128 = 4;
const NO_SERVER: u32 = u32::MAX;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Measured requests between two progress reports.
const PROGRESS_EVERY: u64 = 1 << 14;

#[inline]
fn event(time: u64, kind: u128, index: u32) -> Reverse<u128> {
    Reverse(((time as u128) << 64) | (kind << 32) | index as u128)
}

#[inline]
fn dur(ns: u64) -> Duration {
    Duration::from_nanos(ns)
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128 / 4) as u64
}

/// What one replication counted (only measured requests, except `calls`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RepStats {
    /// Measured requests.
    pub requests: u64,
    /// Of which succeeded.
    pub successes: u64,
    /// Every attempt simulated, warm-up included (for the speed figure).
    pub calls: u64,
    /// Attempts of measured requests.
    pub attempts: u64,
    /// Attempts of measured requests on the focus cluster that landed on a server failing at
    /// that moment.
    pub failed_picks: u64,
    /// Attempts for which the balancer had no endpoint.
    pub no_endpoint: u64,
    /// Retries granted.
    pub retries: u64,
    /// Attempts per server of the focus cluster.
    pub focus_picks: Vec<u64>,
    /// Sum of request latencies, in nanoseconds.
    pub latency_sum_ns: u128,
}

#[derive(Clone, Copy)]
enum Latency {
    Fixed(u64),
    Exp(Exp<f64>),
    LogNormal(LogNormal<f64>),
}

#[derive(Clone, Copy)]
enum Fault {
    None,
    Hang,
    FailFast(u64),
    Slow(f64),
    Error(f64),
    Flap {
        up: u64,
        period: u64,
        offset: u64,
        fails_after: Option<u64>,
    },
}

#[derive(Clone, Copy)]
struct Server {
    latency: Latency,
    fault: Fault,
}

impl Server {
    #[inline]
    fn base(&self, rng: &mut StdRng) -> u64 {
        match self.latency {
            Latency::Fixed(t) => t,
            Latency::Exp(d) => d.sample(rng) as u64,
            Latency::LogNormal(d) => d.sample(rng) as u64,
        }
    }

    /// True while the server is failing (for a flapping one: while down).
    #[inline]
    fn failing(&self, now: u64) -> bool {
        match self.fault {
            Fault::None => false,
            Fault::Flap {
                up, period, offset, ..
            } => (now + offset) % period >= up,
            _ => true,
        }
    }

    /// How long the call takes and whether it succeeds (before the caller's timeout).
    #[inline]
    fn serve(&self, now: u64, timeout: u64, rng: &mut StdRng) -> (u64, bool) {
        match self.fault {
            Fault::None => (self.base(rng), true),
            Fault::Hang => (timeout, false),
            Fault::FailFast(after) => (after, false),
            Fault::Slow(f) => ((self.base(rng) as f64 * f) as u64, true),
            Fault::Error(p) => {
                let t = self.base(rng);
                (t, rng.gen::<f64>() >= p)
            }
            Fault::Flap { fails_after, .. } => {
                if self.failing(now) {
                    (fails_after.unwrap_or(timeout), false)
                } else {
                    (self.base(rng), true)
                }
            }
        }
    }

    /// An active health probe's verdict.
    fn probe(&self, now: u64, timeout: u64, rng: &mut StdRng) -> bool {
        match self.fault {
            Fault::None => true,
            Fault::Hang | Fault::FailFast(_) => false,
            _ => {
                let (t, ok) = self.serve(now, timeout, rng);
                ok && t < timeout
            }
        }
    }
}

/// A request in progress (or a closed-loop client slot between requests).
struct Slot {
    client: u32,
    stage: u32,
    attempt: u32,
    ok: bool,
    failed: bool,
    measured: bool,
    started: u64,
    pick: Option<Pick>,
    /// Index in its cluster of the server the open pick went to (`NO_SERVER`: none).
    server: u32,
    n_avoid: usize,
    avoid: [EndpointId; MAX_RETRIES as usize + 1],
}

impl Slot {
    fn new(client: u32) -> Self {
        Self {
            client,
            stage: 0,
            attempt: 0,
            ok: false,
            failed: false,
            measured: false,
            started: 0,
            pick: None,
            server: NO_SERVER,
            n_avoid: 0,
            avoid: [EndpointId(0); MAX_RETRIES as usize + 1],
        }
    }
}

/// Per (balancer, server) state of the active health checker.
#[derive(Clone, Copy)]
struct ProbeState {
    healthy: bool,
    streak: u32,
}

/// The seed of replication `rep` of a scenario seeded with `seed`.
pub fn replication_seed(seed: u64, rep: u32) -> u64 {
    mix64(seed ^ mix64(u64::from(rep).wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Runs one replication. `progress` is told about measured requests as they complete.
pub fn run_replication(
    sc: &Scenario,
    rep: u32,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<RepStats, SimError> {
    let seed = replication_seed(sc.seed, rep);
    let mut rng = StdRng::seed_from_u64(seed);
    let n_clusters = sc.clusters.len();

    // Servers, flattened; the call graph as a list of cluster indices.
    let mut offsets = Vec::with_capacity(n_clusters);
    let mut servers = Vec::new();
    for c in &sc.clusters {
        offsets.push(servers.len());
        let mean = ns(c.latency.mean) as f64;
        let latency = match c.latency.dist {
            LatencyDist::Fixed => Latency::Fixed(mean as u64),
            LatencyDist::Exponential => Latency::Exp(Exp::new(1.0 / mean).expect("mean > 0")),
            LatencyDist::Lognormal => {
                let s = c.latency.sigma;
                Latency::LogNormal(
                    LogNormal::new(mean.ln() - s * s / 2.0, s).expect("validated sigma"),
                )
            }
        };
        let n = c.servers as usize;
        let nf = c.failed as usize;
        for i in 0..n {
            let is_failed = match c.failed_position {
                FailedPosition::Last => i >= n - nf,
                FailedPosition::First => i < nf,
            };
            let fault = if !is_failed {
                Fault::None
            } else {
                match &c.failure {
                    FailureMode::None => Fault::None,
                    FailureMode::Hang => Fault::Hang,
                    FailureMode::FailFast { after } => Fault::FailFast(ns(*after)),
                    FailureMode::Slow { factor } => Fault::Slow(*factor),
                    FailureMode::Error { probability } => Fault::Error(*probability),
                    FailureMode::Flap {
                        up,
                        down,
                        down_fails_after,
                    } => {
                        let period = ns(*up) + ns(*down);
                        Fault::Flap {
                            up: ns(*up),
                            period,
                            offset: rng.gen_range(0..period),
                            fails_after: down_fails_after.map(ns),
                        }
                    }
                }
            };
            servers.push(Server { latency, fault });
        }
    }
    let stages: Vec<u32> = sc
        .clusters
        .iter()
        .enumerate()
        .flat_map(|(i, c)| (0..c.calls).map(move |_| i as u32))
        .collect();
    let focus = sc.focus();

    // Balancers: one per cluster, or one per client and cluster.
    let owners = match sc.placement {
        Placement::ServerSide => 1,
        Placement::ClientSide => sc.load.clients() as usize,
    };
    let mut balancers = Vec::with_capacity(owners * n_clusters);
    let mut budgets = Vec::new();
    let mut ids: Vec<Vec<EndpointId>> = Vec::new();
    for owner in 0..owners {
        for (ci, c) in sc.clusters.iter().enumerate() {
            let specs: Vec<EndpointSpec> = (0..c.servers)
                .map(|i| EndpointSpec::new(format!("c{ci}-s{i}")))
                .collect();
            let b = owner * n_clusters + ci;
            let config = BalancerConfig {
                seed: mix64(seed ^ (b as u64 + 1).wrapping_mul(GOLDEN)),
                ..c.balancer.clone()
            };
            let lb = Balancer::new(config, &specs).map_err(|e| {
                SimError::Invalid(format!("cluster {ci}: cannot build its balancer: {e}"))
            })?;
            ids.push(lb.endpoints().iter().map(|e| e.id()).collect());
            balancers.push(lb);
            if let Some(r) = &sc.retry {
                budgets.push(RetryBudget::new(r.budget.clone()));
            }
        }
    }

    let mut sim = Sim {
        sc,
        servers,
        offsets,
        stages,
        focus,
        n_clusters,
        client_side: sc.placement == Placement::ClientSide,
        balancers,
        ids,
        budgets,
        max_retries: sc.retry.as_ref().map_or(0, |r| r.max_retries),
        call_gap: (!sc.call_gap.is_zero())
            .then(|| Exp::new(1.0 / ns(sc.call_gap) as f64).expect("gap > 0")),
        timeout: ns(sc.timeout),
        warmup: ns(sc.warmup),
        rng,
        heap: BinaryHeap::new(),
        slots: Vec::new(),
        free: Vec::new(),
        live: 0,
        measured_started: 0,
        arrivals_open: false,
        arrivals: 0,
        stats: RepStats {
            focus_picks: vec![0; sc.clusters[focus].servers as usize],
            ..RepStats::default()
        },
        progress,
        unreported: 0,
    };
    sim.run();
    progress(sim.unreported);
    Ok(sim.stats)
}

struct Sim<'a> {
    sc: &'a Scenario,
    servers: Vec<Server>,
    offsets: Vec<usize>,
    stages: Vec<u32>,
    focus: usize,
    n_clusters: usize,
    client_side: bool,
    balancers: Vec<Balancer>,
    /// Endpoint ids per balancer, by position (for retries' avoid lists and health checks).
    ids: Vec<Vec<EndpointId>>,
    budgets: Vec<RetryBudget>,
    max_retries: u32,
    call_gap: Option<Exp<f64>>,
    timeout: u64,
    warmup: u64,
    rng: StdRng,
    heap: BinaryHeap<Reverse<u128>>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Slots in a request or waiting to start one.
    live: u64,
    measured_started: u64,
    arrivals_open: bool,
    arrivals: u64,
    stats: RepStats,
    progress: &'a (dyn Fn(u64) + Sync),
    unreported: u64,
}

impl Sim<'_> {
    fn run(&mut self) {
        let sc = self.sc;
        let first_mean = ns(sc.clusters[0].latency.mean).max(1);
        match &sc.load {
            Load::Closed {
                clients, in_flight, ..
            } => {
                let n = (*clients as usize) * (*in_flight as usize);
                self.slots.reserve_exact(n);
                for i in 0..n {
                    self.slots.push(Slot::new((i / *in_flight as usize) as u32));
                    // Staggered starts, so that fixed service times do not run in lockstep.
                    let at = self.rng.gen_range(0..first_mean);
                    self.heap.push(event(at, KIND_START, i as u32));
                    self.live += 1;
                }
            }
            Load::Open { .. } => {
                self.arrivals_open = true;
                self.heap.push(event(0, KIND_ARRIVAL, 0));
            }
        }
        let mut probes = Vec::new();
        if let Some(h) = &sc.health_check {
            let interval = ns(h.interval).max(1);
            for c in 0..self.n_clusters {
                self.heap.push(event(interval, KIND_PROBE, c as u32));
                let per = sc.clusters[c].servers as usize;
                let owners = self.balancers.len() / self.n_clusters;
                probes.push(vec![
                    ProbeState {
                        healthy: true,
                        streak: 0
                    };
                    per * owners
                ]);
            }
        }
        while let Some(Reverse(ev)) = self.heap.pop() {
            if self.live == 0 && !self.arrivals_open {
                break;
            }
            let now = (ev >> 64) as u64;
            let index = ev as u32;
            match (ev >> 32) as u32 as u128 {
                KIND_CALL => self.call_done(index as usize, now),
                KIND_START => self.start_request(index as usize, now),
                KIND_ARRIVAL => self.arrival(now),
                KIND_NEXT_CALL => self.start_call(index as usize, now),
                _ => self.probe(index as usize, now, &mut probes),
            }
        }
    }

    /// Whether a new request may start now, and whether it is measured.
    #[inline]
    fn admit(&mut self, now: u64) -> Option<bool> {
        if now < self.warmup {
            Some(false)
        } else if self.measured_started < self.sc.requests {
            self.measured_started += 1;
            Some(true)
        } else {
            None
        }
    }

    fn arrival(&mut self, now: u64) {
        let Some(measured) = self.admit(now) else {
            self.arrivals_open = false;
            return;
        };
        let Load::Open { rate, clients } = self.sc.load else {
            unreachable!("arrivals only in open loops")
        };
        let client = (self.arrivals % u64::from(clients)) as u32;
        self.arrivals += 1;
        let s = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize].client = client;
                s as usize
            }
            None => {
                self.slots.push(Slot::new(client));
                self.slots.len() - 1
            }
        };
        self.live += 1;
        self.begin(s, now, measured);
        let gap = Exp::new(rate).expect("rate > 0").sample(&mut self.rng) * 1e9;
        self.heap
            .push(event(now + (gap as u64).max(1), KIND_ARRIVAL, 0));
    }

    fn start_request(&mut self, s: usize, now: u64) {
        match self.admit(now) {
            Some(measured) => self.begin(s, now, measured),
            None => self.live -= 1,
        }
    }

    #[inline]
    fn begin(&mut self, s: usize, now: u64, measured: bool) {
        let slot = &mut self.slots[s];
        slot.stage = 0;
        slot.failed = false;
        slot.measured = measured;
        slot.started = now;
        self.start_call(s, now);
    }

    #[inline]
    fn start_call(&mut self, s: usize, now: u64) {
        let slot = &mut self.slots[s];
        slot.attempt = 0;
        slot.n_avoid = 0;
        if !self.budgets.is_empty() {
            let c = self.stages[slot.stage as usize] as usize;
            let b = if self.client_side {
                slot.client as usize * self.n_clusters + c
            } else {
                c
            };
            self.budgets[b].record_request(dur(now));
        }
        self.start_attempt(s, now);
    }

    #[inline]
    fn start_attempt(&mut self, s: usize, now: u64) {
        let slot = &mut self.slots[s];
        let c = self.stages[slot.stage as usize] as usize;
        let b = if self.client_side {
            slot.client as usize * self.n_clusters + c
        } else {
            c
        };
        let ctx = PickContext::new(dur(now)).with_avoid(&slot.avoid[..slot.n_avoid]);
        let pick = self.balancers[b].pick(&ctx);
        self.stats.calls += 1;
        let (took, ok) = match &pick {
            None => {
                if slot.measured {
                    self.stats.attempts += 1;
                    self.stats.no_endpoint += 1;
                }
                (0, false)
            }
            Some(p) => {
                let server = &self.servers[self.offsets[c] + p.index()];
                if slot.measured {
                    self.stats.attempts += 1;
                    if c == self.focus {
                        self.stats.focus_picks[p.index()] += 1;
                        if server.failing(now) {
                            self.stats.failed_picks += 1;
                        }
                    }
                }
                let (t, ok) = server.serve(now, self.timeout, &mut self.rng);
                if t >= self.timeout {
                    (self.timeout, false)
                } else {
                    (t, ok)
                }
            }
        };
        slot.ok = ok;
        slot.server = pick.as_ref().map_or(NO_SERVER, |p| p.index() as u32);
        slot.pick = pick;
        self.heap.push(event(now + took, KIND_CALL, s as u32));
    }

    #[inline]
    fn call_done(&mut self, s: usize, now: u64) {
        let slot = &mut self.slots[s];
        let ok = slot.ok;
        let c = self.stages[slot.stage as usize] as usize;
        let b = if self.client_side {
            slot.client as usize * self.n_clusters + c
        } else {
            c
        };
        if let Some(p) = slot.pick.take() {
            let outcome = if ok {
                Outcome::Success
            } else {
                Outcome::Failure
            };
            self.balancers[b].finish(p, outcome, dur(now));
        }
        if !ok {
            if slot.attempt < self.max_retries && self.budgets[b].try_retry(dur(now)) {
                if slot.server != NO_SERVER {
                    slot.avoid[slot.n_avoid] = self.ids[b][slot.server as usize];
                    slot.n_avoid += 1;
                }
                slot.attempt += 1;
                if slot.measured {
                    self.stats.retries += 1;
                }
                self.start_attempt(s, now);
                return;
            }
            slot.failed = true;
            if self.sc.abort_on_failure {
                self.end_request(s, now);
                return;
            }
        }
        slot.stage += 1;
        if slot.stage as usize == self.stages.len() {
            self.end_request(s, now);
        } else if let Some(gap) = self.call_gap {
            let t = gap.sample(&mut self.rng) as u64;
            self.heap.push(event(now + t, KIND_NEXT_CALL, s as u32));
        } else {
            self.start_call(s, now);
        }
    }

    fn end_request(&mut self, s: usize, now: u64) {
        let slot = &self.slots[s];
        if slot.measured {
            self.stats.requests += 1;
            if !slot.failed {
                self.stats.successes += 1;
            }
            self.stats.latency_sum_ns += u128::from(now - slot.started);
            self.unreported += 1;
            if self.unreported == PROGRESS_EVERY {
                (self.progress)(PROGRESS_EVERY);
                self.unreported = 0;
            }
        }
        match self.sc.load {
            Load::Closed { think_time, .. } => {
                if think_time.is_zero() {
                    self.start_request(s, now);
                } else {
                    self.heap
                        .push(event(now + ns(think_time), KIND_START, s as u32));
                }
            }
            Load::Open { .. } => {
                self.live -= 1;
                self.free.push(s as u32);
            }
        }
    }

    fn probe(&mut self, cluster: usize, now: u64, probes: &mut [Vec<ProbeState>]) {
        let sc = self.sc;
        let h = sc
            .health_check
            .as_ref()
            .expect("probes only with health checks");
        let per = sc.clusters[cluster].servers as usize;
        let owners = self.balancers.len() / self.n_clusters;
        for owner in 0..owners {
            let b = owner * self.n_clusters + cluster;
            for i in 0..per {
                let server = self.servers[self.offsets[cluster] + i];
                let passed = server.probe(now, self.timeout, &mut self.rng);
                let st = &mut probes[cluster][owner * per + i];
                if passed == st.healthy {
                    st.streak = 0;
                    continue;
                }
                st.streak += 1;
                let needed = if passed {
                    h.healthy_threshold
                } else {
                    h.unhealthy_threshold
                };
                if st.streak >= needed {
                    st.healthy = passed;
                    st.streak = 0;
                    self.balancers[b].set_healthy(self.ids[b][i], passed, dur(now));
                }
            }
        }
        self.heap.push(event(
            now + ns(h.interval).max(1),
            KIND_PROBE,
            cluster as u32,
        ));
    }
}
