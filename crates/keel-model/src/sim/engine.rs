//! One replication: a discrete-event loop on a virtual clock (nanoseconds since 0).
//!
//! Hot-path layout, chosen for speed: an event is one `u128` (time in the high 64 bits, kind and
//! index below) in a `BinaryHeap`, so that ordering is one integer compare and ties break
//! deterministically by kind then index; every request in progress lives in a preallocated
//! `Slot` that also holds its tries (the call's try and, when hedging, a second one) with their
//! open [`Pick`]s; servers, balancers and counters are flat vectors indexed by position. One call
//! to a server without a capacity costs one pick, one heap push and pop, one finish: no
//! allocation, no map. A server with a capacity adds a job (from a free list) and its own
//! completion event.
//!
//! Stale events are not removed from the heap: an event carries the time it was due, and the
//! thing it is about (a try, a hedge timer, a processor-sharing server) remembers when its live
//! event is due; a popped event that does not match is ignored.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use keel_balance::{
    mix64, Balancer, BalancerConfig, EndpointId, EndpointSpec, LoadReport, Outcome, Pick,
    PickContext, RetryBudget, ServerLoad, StrategyKind, Ticket,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

use super::scenario::SimError;
use super::scenario::{Arrivals, FailedPosition, Load, Placement, Scenario, MAX_RETRIES};
use super::server::{ns, ps_rate, Demand, Job, Mix, Server, Station};
use super::stats::LatencyHistogram;
use crate::vocab::FailureMode;
use keel_balance::Hedger;

const KIND_CALL: u128 = 0;
const KIND_START: u128 = 1;
const KIND_ARRIVAL: u128 = 2;
const KIND_PROBE: u128 = 3;
const KIND_NEXT_CALL: u128 = 4;
const KIND_JOB: u128 = 5;
const KIND_PS: u128 = 6;
const KIND_HEDGE: u128 = 7;
const KIND_ANTAGONIST: u128 = 8;
const KIND_SLOWDOWN: u128 = 9;
const KIND_REPORT: u128 = 10;
const KIND_EVIDENCE: u128 = 11;
const NO_SERVER: u32 = u32::MAX;
const NO_JOB: u32 = u32::MAX;
const NEVER: u64 = u64::MAX;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// Measured requests between two progress reports.
const PROGRESS_EVERY: u64 = 1 << 14;
/// Endpoints a call remembers having tried: every retry's, and a hedged try's.
const AVOID: usize = MAX_RETRIES as usize + 2;

/// Width of the bins of [`RepStats::reaction_bins`].
pub const REACTION_BIN: Duration = Duration::from_millis(100);

#[inline]
fn event(time: u64, kind: u128, index: u32) -> Reverse<u128> {
    Reverse(((time as u128) << 64) | (kind << 32) | index as u128)
}

#[inline]
fn dur(ns: u64) -> Duration {
    Duration::from_nanos(ns)
}

#[inline]
fn scaled(t: u64, factor: f64) -> u64 {
    if factor == 1.0 {
        t
    } else {
        (t as f64 * factor) as u64
    }
}

/// What one replication counted (only measured requests, except `calls` and `reaction_bins`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RepStats {
    /// Measured requests.
    pub requests: u64,
    /// Of which succeeded.
    pub successes: u64,
    /// Every attempt simulated, warm-up included (for the speed figure).
    pub calls: u64,
    /// Attempts of measured requests (hedges and retries included).
    pub attempts: u64,
    /// Attempts of measured requests on the focus cluster that landed on a server failing at
    /// that moment.
    pub failed_picks: u64,
    /// Attempts for which the balancer had no endpoint.
    pub no_endpoint: u64,
    /// Retries granted.
    pub retries: u64,
    /// Hedged tries sent.
    pub hedges: u64,
    /// Calls whose hedged try answered first.
    pub hedges_won: u64,
    /// Attempts per server of the focus cluster.
    pub focus_picks: Vec<u64>,
    /// Sum of request latencies, in nanoseconds.
    pub latency_sum_ns: u128,
    /// Request latencies (queueing, retries and hedges included).
    pub latency: LatencyHistogram,
    /// With a slowdown on the focus cluster: per [`REACTION_BIN`] of virtual time from 0
    /// (warm-up and unmeasured requests included), the attempts on the slowed servers and all
    /// attempts on the cluster.
    pub reaction_bins: Vec<[u64; 2]>,
    /// With a fleet (`ClusterConfig::fleet`): tries on that cluster's failing servers until
    /// every proxy had ejected every failed server, warm-up included.
    pub fleet_failed_tries: u64,
    /// With a fleet: when every proxy had ejected every failed server (`None`: not within the
    /// run).
    pub fleet_ejected_at: Option<Duration>,
}

/// One try of a call.
#[derive(Default)]
struct Attempt {
    pick: Option<Pick>,
    /// Index in its cluster of the server the pick went to (`NO_SERVER`: none).
    server: u32,
    /// Whether the answer is good (known at the start unless the server queues it).
    ok: bool,
    /// The call still waits for this try's answer.
    pending: bool,
    /// When its `KIND_CALL` event is due: the answer, or the caller's timeout.
    due: u64,
    /// Its job at a server with a capacity (`NO_JOB`: none).
    job: u32,
    started: u64,
    /// This is a hedged try.
    hedge: bool,
    /// How its server saw it arrive (for the server's load estimate).
    ticket: Ticket,
}

/// A request in progress (or a closed-loop client slot between requests).
struct Slot {
    client: u32,
    stage: u32,
    retries: u32,
    failed: bool,
    measured: bool,
    started: u64,
    tries: [Attempt; 2],
    /// Tries of the current call still waiting for an answer.
    outstanding: u8,
    /// The current call has been hedged.
    hedged: bool,
    /// When the current call's hedge timer is due (`NEVER`: none).
    hedge_due: u64,
    /// The caller's deadline for a hedged try: the first try's (`NEVER` otherwise). The call
    /// waits no longer for its hedge than it would have for its first try, as the proxy's
    /// `request_timeout` bounds a request with its hedges; a hedge with a timeout of its own
    /// made a hedged call last up to about twice the timeout (3.8 s at a 2 s timeout).
    hedge_deadline: u64,
    n_avoid: usize,
    avoid: [EndpointId; AVOID],
    /// The request's number, in the order requests began.
    request: u64,
    /// Tries the request has started (a try's number keys its stream with `crn`).
    tries_started: u64,
}

impl Slot {
    fn new(client: u32) -> Self {
        Self {
            client,
            stage: 0,
            retries: 0,
            failed: false,
            measured: false,
            started: 0,
            tries: [Attempt::default(), Attempt::default()],
            outstanding: 0,
            hedged: false,
            hedge_due: NEVER,
            hedge_deadline: NEVER,
            n_avoid: 0,
            avoid: [EndpointId(0); AVOID],
            request: 0,
            tries_started: 0,
        }
    }

    #[inline]
    fn remember(&mut self, id: EndpointId) {
        if self.n_avoid < AVOID && !self.avoid[..self.n_avoid].contains(&id) {
            self.avoid[self.n_avoid] = id;
            self.n_avoid += 1;
        }
    }
}

/// A probe's answer on its way back to a balancer.
#[derive(Clone, Copy)]
struct PendingReport {
    balancer: u32,
    index: u32,
    report: LoadReport,
}

/// An outcome one proxy of a fleet observed, on its way to the others' balancers.
#[derive(Clone, Copy)]
struct PendingEvidence {
    /// The client (proxy) that observed it.
    source: u32,
    /// The server's index in the fleet's cluster.
    server: u32,
    ok: bool,
}

/// A fleet's cluster and what the engine does for it.
struct Fleet {
    cluster: usize,
    /// Shared evidence's delay, if the fleet shares.
    shared: Option<u64>,
    /// Indices of the cluster's failed servers.
    failed: Vec<usize>,
    evidence: Vec<PendingEvidence>,
    free: Vec<u32>,
}

/// Per (balancer, server) state of the active health checker.
#[derive(Clone, Copy)]
struct ProbeState {
    healthy: bool,
    streak: u32,
}

/// How a replication draws its random numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Common random numbers: open-loop arrivals (times and clients) come from a stream of
    /// their own, and each try's service time from a stream keyed by its request's number and
    /// its try's number, so that two runs of the same seed that differ only in how they
    /// balance or hedge see the same arrivals and the same work per try (with one shared
    /// stream, a hedge's draw shifts every later draw, and the pair differs by as much noise
    /// as two seeds). Off by default: it changes every number of a seed.
    pub common_random_numbers: bool,
}

/// A small counter-based generator (SplitMix64) for the per-try streams of
/// [`RunOptions::common_random_numbers`]: seeding a ChaCha generator per try would cost more
/// than the try.
struct SplitMix(u64);

impl rand::RngCore for SplitMix {
    fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for chunk in dest.chunks_mut(8) {
            let bytes = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
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
    run_replication_with(sc, rep, RunOptions::default(), progress)
}

/// [`run_replication`] with options.
pub fn run_replication_with(
    sc: &Scenario,
    rep: u32,
    options: RunOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<RepStats, SimError> {
    let seed = replication_seed(sc.seed, rep);
    let mut rng = StdRng::seed_from_u64(seed);
    let n_clusters = sc.clusters.len();

    // Servers, flattened; the call graph as a list of cluster indices.
    let mut offsets = Vec::with_capacity(n_clusters);
    let mut servers = Vec::new();
    let mut stations = Vec::new();
    for c in &sc.clusters {
        offsets.push(servers.len());
        let latency = c.latency.sampler();
        let n = c.servers as usize;
        let nf = c.failed as usize;
        if !c.endpoints.is_empty() {
            // Servers described one by one (validated: one entry each, `failed` = 0).
            for e in &c.endpoints {
                let mut server = Server::new(
                    e.latency.unwrap_or(c.latency).sampler(),
                    FailureMode::None,
                    0,
                );
                server.mix = Mix::new(&e.failures);
                servers.push(server);
                let capacity = e.capacity.as_ref().or(c.capacity.as_ref());
                stations.push(Station::new(
                    capacity.map(|k| (k.concurrency, k.discipline)),
                ));
            }
            continue;
        }
        for i in 0..n {
            let is_failed = match c.failed_position {
                FailedPosition::Last => i >= n - nf,
                FailedPosition::First => i < nf,
            };
            let failure = if is_failed {
                c.failure
            } else {
                FailureMode::None
            };
            let flap_offset = match failure {
                FailureMode::Flap { up, down, .. } => rng.gen_range(0..ns(up) + ns(down)),
                _ => 0,
            };
            servers.push(Server::new(latency, failure, flap_offset));
            stations.push(Station::new(
                c.capacity.as_ref().map(|k| (k.concurrency, k.discipline)),
            ));
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
        Placement::ServerSide | Placement::PerConnection => 1,
        Placement::ClientSide => sc.load.clients() as usize,
    };
    let fleet = sc
        .clusters
        .iter()
        .position(|c| c.fleet.is_some())
        .map(|ci| {
            let c = &sc.clusters[ci];
            let nf = c.failed as usize;
            let n = c.servers as usize;
            Fleet {
                cluster: ci,
                shared: c.fleet.and_then(|f| f.shared).map(|sh| ns(sh.delay)),
                failed: (0..n)
                    .filter(|&i| match c.failed_position {
                        FailedPosition::Last => i >= n - nf,
                        FailedPosition::First => i < nf,
                    })
                    .collect(),
                evidence: Vec::new(),
                free: Vec::new(),
            }
        });
    let mut balancers = Vec::with_capacity(owners * n_clusters);
    let mut budgets = Vec::new();
    let mut hedgers = Vec::new();
    let mut ids: Vec<Vec<EndpointId>> = Vec::new();
    for owner in 0..owners {
        for (ci, c) in sc.clusters.iter().enumerate() {
            let specs: Vec<EndpointSpec> = (0..c.servers)
                .map(|i| {
                    let weight = c.endpoints.get(i as usize).map_or(1, |e| e.weight);
                    EndpointSpec::new(format!("c{ci}-s{i}")).with_weight(weight)
                })
                .collect();
            let b = owner * n_clusters + ci;
            let mut config = BalancerConfig {
                seed: mix64(seed ^ (b as u64 + 1).wrapping_mul(GOLDEN)),
                ..c.balancer.clone()
            };
            if let (Some(sh), Some(od)) = (
                c.fleet.and_then(|f| f.shared),
                config.outlier_detection.as_mut(),
            ) {
                od.shared = Some(keel_balance::SharedEvidence { quorum: sh.quorum });
            }
            let lb = Balancer::new(config, &specs).map_err(|e| {
                SimError::Invalid(format!("cluster {ci}: cannot build its balancer: {e}"))
            })?;
            ids.push(lb.endpoints().iter().map(|e| e.id()).collect());
            balancers.push(lb);
            if let Some(r) = &sc.retry {
                budgets.push(RetryBudget::new(r.budget.clone()));
            }
            if let Some(h) = &sc.hedge {
                hedgers.push(Hedger::new(h));
            }
        }
    }

    // Per connection: every client's connection to every cluster, picked in client order at
    // 0 and held (dropped with the run).
    let mut held: Vec<Pick> = Vec::new();
    let mut connections: Vec<u32> = Vec::new();
    if sc.placement == Placement::PerConnection {
        for _client in 0..sc.load.clients() {
            for (ci, b) in balancers.iter_mut().enumerate() {
                let pick = b
                    .pick_mut(&PickContext::new(Duration::ZERO))
                    .ok_or_else(|| {
                        SimError::Invalid(format!("cluster {ci}: no endpoint for a connection"))
                    })?;
                connections.push(pick.index() as u32);
                held.push(pick);
            }
        }
    }

    let load_reports = sc.load_reports.clone().unwrap_or_default();
    let mut sim = Sim {
        connections,
        _held: held,
        sc,
        loads: vec![ServerLoad::default(); servers.len()],
        reporting: sc
            .clusters
            .iter()
            .map(|c| c.balancer.strategy == StrategyKind::Prequal)
            .collect(),
        tracked: sc
            .clusters
            .iter()
            .flat_map(|c| {
                let prequal = c.balancer.strategy == StrategyKind::Prequal;
                (0..c.servers).map(move |_| prequal)
            })
            .collect(),
        probe_delay: ns(load_reports.probe_delay),
        on_answers: load_reports.on_answers,
        targets: Vec::new(),
        reports: Vec::new(),
        free_reports: Vec::new(),
        servers,
        stations,
        jobs: Vec::new(),
        free_jobs: Vec::new(),
        finished: Vec::new(),
        draw: Vec::new(),
        offsets,
        stages,
        focus,
        reaction_servers: sc.clusters[focus].slowdown.as_ref().map(|s| s.servers),
        n_clusters,
        client_side: sc.placement == Placement::ClientSide,
        in_turn: sc
            .clusters
            .iter()
            .any(|c| c.fleet.is_some_and(|f| f.arrivals == Arrivals::InTurn)),
        next_client: 0,
        fleet,
        balancers,
        ids,
        budgets,
        hedgers,
        max_retries: sc.retry.as_ref().map_or(0, |r| r.max_retries),
        call_gap: (!sc.call_gap.is_zero())
            .then(|| Exp::new(1.0 / ns(sc.call_gap) as f64).expect("gap > 0")),
        timeout: ns(sc.timeout),
        round_trip: ns(sc.round_trip),
        warmup: ns(sc.warmup),
        rng,
        crn: options.common_random_numbers,
        arrival_rng: StdRng::seed_from_u64(mix64(seed ^ 0xA55A_A55A_A55A_A55A)),
        service_seed: mix64(seed ^ 0x5EE5_5EE5_5EE5_5EE5),
        next_request: 0,
        heap: BinaryHeap::new(),
        deadlines: VecDeque::new(),
        slots: Vec::new(),
        free: Vec::new(),
        live: 0,
        measured_started: 0,
        arrivals_open: false,
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
    /// Per connection: the endpoint each client's connection to each cluster is on (by
    /// `client x clusters + cluster`); empty otherwise.
    connections: Vec<u32>,
    /// The connections' picks, held for the run.
    _held: Vec<Pick>,
    /// Each server's own load (requests in flight, latency estimate), for load reports.
    loads: Vec<ServerLoad>,
    /// Per cluster: its balancers balance on load reports (send probes after each pick).
    reporting: Vec<bool>,
    /// Per server (global position): its cluster's `reporting`, so that servers nobody asks
    /// for reports skip the bookkeeping of their `ServerLoad`.
    tracked: Vec<bool>,
    probe_delay: u64,
    on_answers: bool,
    /// Scratch: endpoints to probe.
    targets: Vec<EndpointId>,
    reports: Vec<PendingReport>,
    free_reports: Vec<u32>,
    servers: Vec<Server>,
    stations: Vec<Station>,
    jobs: Vec<Job>,
    free_jobs: Vec<u32>,
    /// Scratch: jobs a processor-sharing server finished at one instant.
    finished: Vec<u32>,
    /// Scratch: server positions for the antagonists' draw.
    draw: Vec<u32>,
    offsets: Vec<usize>,
    stages: Vec<u32>,
    focus: usize,
    /// With a slowdown on the focus cluster: how many of its first servers are slowed.
    reaction_servers: Option<u32>,
    n_clusters: usize,
    client_side: bool,
    /// Open-loop arrivals go to the clients in turn, not at random.
    in_turn: bool,
    /// With `in_turn`: the client the next arrival goes to.
    next_client: u32,
    fleet: Option<Fleet>,
    balancers: Vec<Balancer>,
    /// Endpoint ids per balancer, by position (for retries' avoid lists and health checks).
    ids: Vec<Vec<EndpointId>>,
    budgets: Vec<RetryBudget>,
    hedgers: Vec<Hedger>,
    max_retries: u32,
    call_gap: Option<Exp<f64>>,
    timeout: u64,
    /// Added to every try's time at a server without a capacity ([`Scenario::round_trip`]).
    round_trip: u64,
    warmup: u64,
    rng: StdRng,
    /// [`RunOptions::common_random_numbers`].
    crn: bool,
    /// With `crn`: the arrivals' stream.
    arrival_rng: StdRng,
    /// With `crn`: the key of the per-try streams.
    service_seed: u64,
    /// Requests begun so far (with `crn`, a request's number keys its tries' streams).
    next_request: u64,
    heap: BinaryHeap<Reverse<u128>>,
    /// Events in ascending order, beside the heap: the callers' deadlines of calls queued at
    /// servers. They are pushed a timeout ahead, so nearly always in order, and nearly all go
    /// stale (the answer comes first); in the heap, thousands of them made every push and pop
    /// deeper (a quarter of E8's time). The loop takes the smaller of the two fronts, so the
    /// events come out in the same order as from one heap.
    deadlines: VecDeque<u128>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Slots in a request or waiting to start one.
    live: u64,
    measured_started: u64,
    arrivals_open: bool,
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
        for (c, cluster) in sc.clusters.iter().enumerate() {
            if cluster.antagonist.is_some() {
                self.heap.push(event(0, KIND_ANTAGONIST, c as u32));
            }
            if let Some(s) = &cluster.slowdown {
                self.heap.push(event(ns(s.start), KIND_SLOWDOWN, c as u32));
                self.heap.push(event(ns(s.end), KIND_SLOWDOWN, c as u32));
            }
        }
        while let Some(ev) = self.next_event() {
            if self.live == 0 && !self.arrivals_open {
                break;
            }
            let now = (ev >> 64) as u64;
            let index = ev as u32;
            match (ev >> 32) as u32 as u128 {
                KIND_CALL => self.call_event(index as usize, now),
                KIND_START => self.start_request(index as usize, now),
                KIND_ARRIVAL => self.arrival(now),
                KIND_NEXT_CALL => self.start_call(index as usize, now),
                KIND_PROBE => self.probe(index as usize, now, &mut probes),
                KIND_JOB => self.fifo_done(index, now),
                KIND_PS => self.ps_event(index as usize, now),
                KIND_HEDGE => self.hedge(index as usize, now),
                KIND_ANTAGONIST => self.antagonists(index as usize, now),
                KIND_SLOWDOWN => self.slowdown(index as usize, now),
                KIND_EVIDENCE => self.deliver_evidence(index, now),
                _ => self.deliver_report(index, now),
            }
        }
    }

    /// The earliest event of the heap and `deadlines`.
    #[inline]
    fn next_event(&mut self) -> Option<u128> {
        match (self.heap.peek(), self.deadlines.front()) {
            (Some(&Reverse(h)), Some(&d)) if d < h => self.deadlines.pop_front(),
            (None, Some(_)) => self.deadlines.pop_front(),
            _ => self.heap.pop().map(|Reverse(e)| e),
        }
    }

    /// Schedules a caller's deadline: in `deadlines` if it keeps them in order, else in the
    /// heap.
    #[inline]
    fn push_deadline(&mut self, time: u64, kind: u128, index: u32) {
        let Reverse(ev) = event(time, kind, index);
        if !matches!(self.deadlines.back(), Some(&last) if last > ev) {
            self.deadlines.push_back(ev);
        } else {
            self.heap.push(Reverse(ev));
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
        // Each arrival goes to a client drawn at random, so that every client's requests are
        // a Poisson stream of their own (dealing arrivals out in turn would make them as
        // regular as clockwork, and lock clients' round-robin counters together).
        let client = if clients == 1 {
            0
        } else if self.in_turn {
            let c = self.next_client;
            self.next_client = (c + 1) % clients;
            c
        } else if self.crn {
            self.arrival_rng.gen_range(0..clients)
        } else {
            self.rng.gen_range(0..clients)
        };
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
        let rng = if self.crn {
            &mut self.arrival_rng
        } else {
            &mut self.rng
        };
        let gap = Exp::new(rate).expect("rate > 0").sample(rng) * 1e9;
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
        slot.request = self.next_request;
        slot.tries_started = 0;
        self.next_request += 1;
        self.start_call(s, now);
    }

    /// The balancer that serves slot `s`'s current call.
    #[inline]
    fn balancer_of(&self, s: usize) -> (usize, usize) {
        let slot = &self.slots[s];
        let c = self.stages[slot.stage as usize] as usize;
        let b = if self.client_side {
            slot.client as usize * self.n_clusters + c
        } else {
            c
        };
        (c, b)
    }

    #[inline]
    fn start_call(&mut self, s: usize, now: u64) {
        let (_, b) = self.balancer_of(s);
        let slot = &mut self.slots[s];
        slot.retries = 0;
        slot.n_avoid = 0;
        slot.hedged = false;
        slot.hedge_due = NEVER;
        if !self.budgets.is_empty() {
            self.budgets[b].record_request(dur(now));
        }
        if !self.hedgers.is_empty() {
            let h = &self.hedgers[b];
            h.record_call(dur(now));
            if let Some(d) = h.delay() {
                let d = (d.as_nanos().min(u128::from(u64::MAX / 4)) as u64).max(1);
                slot.hedge_due = now + d;
                self.heap.push(event(now + d, KIND_HEDGE, s as u32));
            }
        }
        self.start_attempt(s, 0, now);
    }

    #[inline]
    fn start_attempt(&mut self, s: usize, which: usize, now: u64) {
        let (c, b) = self.balancer_of(s);
        let slot = &mut self.slots[s];
        // Per connection: the call goes over its client's connection, with no pick of its own.
        let connection = (!self.connections.is_empty())
            .then(|| self.connections[slot.client as usize * self.n_clusters + c] as usize);
        let pick = match connection {
            Some(_) => None,
            None => {
                let mut ctx = PickContext::new(dur(now)).with_avoid(&slot.avoid[..slot.n_avoid]);
                if self.sc.clusters[c].hash_key_per_request {
                    ctx =
                        ctx.with_hash_key(mix64(slot.request.wrapping_add(1).wrapping_mul(GOLDEN)));
                }
                self.balancers[b].pick_mut(&ctx)
            }
        };
        self.stats.calls += 1;
        slot.outstanding += 1;
        let measured = slot.measured;
        let a = &mut slot.tries[which];
        a.pending = true;
        a.started = now;
        a.job = NO_JOB;
        a.hedge = false;
        let (index, pick) = match (connection, pick) {
            (Some(index), _) => (index, None),
            (None, Some(p)) => (p.index(), Some(p)),
            (None, None) => (usize::MAX, None),
        };
        if index == usize::MAX {
            if measured {
                self.stats.attempts += 1;
                self.stats.no_endpoint += 1;
            }
            a.ok = false;
            a.server = NO_SERVER;
            a.due = now;
            self.heap
                .push(event(now, KIND_CALL, (s * 2 + which) as u32));
            return;
        }
        a.server = index as u32;
        a.pick = pick;
        let g = self.offsets[c] + index;
        let server = self.servers[g];
        let ticket = if self.reporting[c] {
            self.loads[g].start(dur(now))
        } else {
            Ticket::default()
        };
        self.slots[s].tries[which].ticket = ticket;
        if self.reporting[c] {
            self.send_probes(b, c, now);
        }
        if let Some(f) = &self.fleet {
            if f.cluster == c && self.stats.fleet_ejected_at.is_none() && server.failing(now) {
                self.stats.fleet_failed_tries += 1;
            }
        }
        if measured {
            self.stats.attempts += 1;
            if c == self.focus {
                self.stats.focus_picks[index] += 1;
                if server.failing(now) {
                    self.stats.failed_picks += 1;
                }
            }
        }
        if c == self.focus {
            if let Some(slowed) = self.reaction_servers {
                let bin = (now / ns(REACTION_BIN)) as usize;
                if self.stats.reaction_bins.len() <= bin {
                    self.stats.reaction_bins.resize(bin + 1, [0, 0]);
                }
                let counts = &mut self.stats.reaction_bins[bin];
                counts[1] += 1;
                if (index as u32) < slowed {
                    counts[0] += 1;
                }
            }
        }
        let deadline = (now + self.timeout).min(self.slots[s].hedge_deadline);
        let patience = deadline - now;
        let slot = &mut self.slots[s];
        let try_number = slot.tries_started;
        slot.tries_started += 1;
        let demand = if self.crn {
            let key = self.service_seed ^ mix64(slot.request.wrapping_mul(GOLDEN) ^ try_number);
            server.demand(now, patience, &mut SplitMix(key))
        } else {
            server.demand(now, patience, &mut self.rng)
        };
        let (took, ok) = match demand {
            Demand::Work(w, ok) if !matches!(self.stations[g], Station::Unlimited) => {
                let job = self.new_job(Job {
                    server: g as u32,
                    slot: s as u32,
                    which: which as u8,
                    ok,
                    abandoned: false,
                    started: false,
                    work: w,
                    ticket,
                });
                let a = &mut self.slots[s].tries[which];
                a.job = job;
                a.due = deadline;
                self.push_deadline(deadline, KIND_CALL, (s * 2 + which) as u32);
                self.arrive(g, job, now);
                return;
            }
            Demand::Work(t, ok) => (scaled(t, server.factor()) + self.round_trip, ok),
            Demand::Bypass(t, ok) => (t.saturating_add(self.round_trip), ok),
        };
        let (took, ok) = if took >= patience {
            (patience, false)
        } else {
            (took, ok)
        };
        let a = &mut self.slots[s].tries[which];
        a.ok = ok;
        a.due = now + took;
        self.heap
            .push(event(now + took, KIND_CALL, (s * 2 + which) as u32));
    }

    /// A try's event: its answer from a server without a queue, or the caller's timeout.
    #[inline]
    fn call_event(&mut self, index: usize, now: u64) {
        let (s, which) = (index / 2, index % 2);
        let a = &mut self.slots[s].tries[which];
        if !a.pending || a.due != now {
            return;
        }
        let ok = if a.job != NO_JOB {
            // Timed out while the server still had it.
            let job = a.job;
            a.job = NO_JOB;
            self.abandon(job);
            false
        } else {
            if a.server != NO_SERVER {
                let (c, _) = self.balancer_of(s);
                let a = &self.slots[s].tries[which];
                let g = self.offsets[c] + a.server as usize;
                if self.tracked[g] {
                    self.loads[g].finish(a.ticket, dur(now));
                }
            }
            self.slots[s].tries[which].ok
        };
        self.try_done(s, which, ok, now);
    }

    /// Try `which` of slot `s` answered (or failed) at `now`.
    fn try_done(&mut self, s: usize, which: usize, ok: bool, now: u64) {
        let (c, b) = self.balancer_of(s);
        if self.on_answers && self.reporting[c] {
            let server = self.slots[s].tries[which].server;
            if server != NO_SERVER {
                let report = self.loads[self.offsets[c] + server as usize].report(dur(now));
                self.balancers[b].report_load_mut(self.ids[b][server as usize], report, dur(now));
            }
        }
        let slot = &mut self.slots[s];
        let a = &mut slot.tries[which];
        a.pending = false;
        slot.outstanding -= 1;
        if let Some(p) = a.pick.take() {
            let outcome = if ok {
                Outcome::Success
            } else {
                Outcome::Failure
            };
            let ejected = self.balancers[b].finish_mut(p, outcome, dur(now));
            if self.fleet.as_ref().is_some_and(|f| f.cluster == c) {
                let server = self.slots[s].tries[which].server;
                let client = self.slots[s].client;
                self.observed(client, server, ok, ejected, now);
            }
        }
        let slot = &mut self.slots[s];
        let a = &mut slot.tries[which];
        if ok {
            if !self.hedgers.is_empty() && !a.hedge {
                self.hedgers[b].observe(Duration::from_nanos(now - a.started));
            }
            if a.hedge && slot.measured {
                self.stats.hedges_won += 1;
            }
            if slot.outstanding > 0 {
                self.cancel(s, b, 1 - which, now);
            }
            self.call_ended(s, now);
            return;
        }
        if slot.outstanding > 0 {
            // The other try may still answer.
            return;
        }
        if slot.retries < self.max_retries && self.budgets[b].try_retry(dur(now)) {
            let server = slot.tries[which].server;
            if server != NO_SERVER {
                slot.remember(self.ids[b][server as usize]);
            }
            slot.retries += 1;
            if slot.measured {
                self.stats.retries += 1;
            }
            self.start_attempt(s, which, now);
            return;
        }
        slot.failed = true;
        if self.sc.abort_on_failure {
            slot.hedge_due = NEVER;
            self.end_request(s, now);
            return;
        }
        self.call_ended(s, now);
    }

    /// Drops a try whose call no longer needs it (the other try won): its pick is released as
    /// cancelled (no outcome recorded), and a server that has not started its work drops it.
    ///
    /// A first try that loses to its hedge would have taken at least as long as it ran: the
    /// hedge delay's quantile counts it at that time. Leaving it out would keep the slowest
    /// first tries out of the sample and pull the quantile down (more hedging, so more left
    /// out: at p95 it hedged 10 % of calls instead of 5 %).
    fn cancel(&mut self, s: usize, b: usize, which: usize, now: u64) {
        let slot = &mut self.slots[s];
        let a = &mut slot.tries[which];
        debug_assert!(a.pending);
        if !a.hedge {
            self.hedgers[b].observe(Duration::from_nanos(now - a.started));
        }
        a.pending = false;
        slot.outstanding -= 1;
        drop(a.pick.take());
        if a.job != NO_JOB {
            let job = a.job;
            a.job = NO_JOB;
            self.abandon(job);
        } else if a.server != NO_SERVER {
            let g = self.offsets[self.stages[slot.stage as usize] as usize] + a.server as usize;
            if self.tracked[g] {
                self.loads[g].cancel(a.ticket);
            }
        }
    }

    /// The caller of `job` has gone: a server that has not started it drops it (lazily, from
    /// its queue); started work runs on, and nobody takes its answer.
    fn abandon(&mut self, job: u32) {
        let j = &mut self.jobs[job as usize];
        j.abandoned = true;
        if !j.started && self.tracked[j.server as usize] {
            self.loads[j.server as usize].cancel(j.ticket);
        }
    }

    /// Sends the probes balancer `b` (of cluster `c`) asks for: each reads its server's load now
    /// and answers `probe_delay` later. A server that hangs does not answer.
    fn send_probes(&mut self, b: usize, c: usize, now: u64) {
        self.targets.clear();
        self.balancers[b].probe_targets_mut(dur(now), &mut self.targets);
        for t in 0..self.targets.len() {
            let id = self.targets[t];
            let Some(index) = self.ids[b].iter().position(|&x| x == id) else {
                continue;
            };
            let g = self.offsets[c] + index;
            if !self.servers[g].answers_probes(now) {
                continue;
            }
            let report = PendingReport {
                balancer: b as u32,
                index: index as u32,
                report: self.loads[g].report(dur(now)),
            };
            if self.probe_delay == 0 {
                self.balancers[b].report_load_mut(id, report.report, dur(now));
                continue;
            }
            let r = match self.free_reports.pop() {
                Some(r) => {
                    self.reports[r as usize] = report;
                    r
                }
                None => {
                    self.reports.push(report);
                    (self.reports.len() - 1) as u32
                }
            };
            self.heap
                .push(event(now + self.probe_delay, KIND_REPORT, r));
        }
    }

    /// A proxy of the fleet observed an outcome on `server` (and its balancer ejected it, or
    /// not): the evidence leaves for the other proxies, and the run notes when every proxy has
    /// ejected every failed server.
    fn observed(&mut self, client: u32, server: u32, ok: bool, ejected: bool, now: u64) {
        if ejected {
            self.check_fleet(now);
        }
        let Some(f) = &mut self.fleet else { return };
        let Some(delay) = f.shared else { return };
        let e = PendingEvidence {
            source: client,
            server,
            ok,
        };
        if delay == 0 {
            self.spread_evidence(e, now);
            return;
        }
        let r = match f.free.pop() {
            Some(r) => {
                f.evidence[r as usize] = e;
                r
            }
            None => {
                f.evidence.push(e);
                (f.evidence.len() - 1) as u32
            }
        };
        self.heap.push(event(now + delay, KIND_EVIDENCE, r));
    }

    fn deliver_evidence(&mut self, r: u32, now: u64) {
        let Some(f) = &mut self.fleet else { return };
        let e = f.evidence[r as usize];
        f.free.push(r);
        self.spread_evidence(e, now);
    }

    /// Hands one proxy's outcome to every other proxy's balancer (the simulator's side of
    /// shared evidence: what a store and its watches would carry).
    fn spread_evidence(&mut self, e: PendingEvidence, now: u64) {
        let Some(c) = self.fleet.as_ref().map(|f| f.cluster) else {
            return;
        };
        let outcome = if e.ok {
            Outcome::Success
        } else {
            Outcome::Failure
        };
        let mut ejected = false;
        for client in 0..(self.balancers.len() / self.n_clusters) as u32 {
            if client == e.source {
                continue;
            }
            let b = client as usize * self.n_clusters + c;
            let id = self.ids[b][e.server as usize];
            // Sources are numbered from 1: 0 is each balancer's own calls.
            ejected |=
                self.balancers[b].record_remote(id, outcome, u64::from(e.source) + 1, dur(now));
        }
        if ejected {
            self.check_fleet(now);
        }
    }

    /// Notes the first instant every proxy has every failed server of the fleet's cluster
    /// ejected.
    fn check_fleet(&mut self, now: u64) {
        let Some(f) = &self.fleet else { return };
        if self.stats.fleet_ejected_at.is_some() {
            return;
        }
        let owners = self.balancers.len() / self.n_clusters;
        let all = (0..owners).all(|o| {
            let eps = self.balancers[o * self.n_clusters + f.cluster].endpoints();
            f.failed
                .iter()
                .all(|&i| eps[i].ejected_until(dur(now)).is_some())
        });
        if all {
            self.stats.fleet_ejected_at = Some(dur(now));
        }
    }

    fn deliver_report(&mut self, r: u32, now: u64) {
        let p = self.reports[r as usize];
        self.free_reports.push(r);
        let b = p.balancer as usize;
        self.balancers[b].report_load_mut(self.ids[b][p.index as usize], p.report, dur(now));
    }

    /// The current call of slot `s` is over (answered, or failed without aborting).
    #[inline]
    fn call_ended(&mut self, s: usize, now: u64) {
        let slot = &mut self.slots[s];
        slot.hedge_due = NEVER;
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

    /// The hedge timer of slot `s`'s call: if it still waits on its only try, and the budget
    /// allows, a second try goes to another endpoint.
    fn hedge(&mut self, s: usize, now: u64) {
        let slot = &mut self.slots[s];
        if slot.hedge_due != now {
            return;
        }
        slot.hedge_due = NEVER;
        if slot.outstanding != 1 || slot.hedged {
            return;
        }
        let (_, b) = self.balancer_of(s);
        let slot = &mut self.slots[s];
        if !self.hedgers[b].try_hedge(dur(now)) {
            return;
        }
        slot.hedged = true;
        if slot.measured {
            self.stats.hedges += 1;
        }
        let waiting = if slot.tries[0].pending { 0 } else { 1 };
        let server = slot.tries[waiting].server;
        if server != NO_SERVER {
            slot.remember(self.ids[b][server as usize]);
        }
        slot.hedge_deadline = slot.tries[waiting].started + self.timeout;
        self.start_attempt(s, 1 - waiting, now);
        let slot = &mut self.slots[s];
        slot.hedge_deadline = NEVER;
        slot.tries[1 - waiting].hedge = true;
    }

    fn end_request(&mut self, s: usize, now: u64) {
        let slot = &self.slots[s];
        if slot.measured {
            self.stats.requests += 1;
            if !slot.failed {
                self.stats.successes += 1;
            }
            self.stats.latency_sum_ns += u128::from(now - slot.started);
            self.stats.latency.record(now - slot.started);
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

    fn new_job(&mut self, job: Job) -> u32 {
        match self.free_jobs.pop() {
            Some(j) => {
                self.jobs[j as usize] = job;
                j
            }
            None => {
                self.jobs.push(job);
                (self.jobs.len() - 1) as u32
            }
        }
    }

    /// Job `job` arrives at server `g` (a global position), which has a capacity.
    fn arrive(&mut self, g: usize, job: u32, now: u64) {
        let factor = self.servers[g].factor();
        match &mut self.stations[g] {
            Station::Unlimited => unreachable!("only servers with a capacity take jobs"),
            Station::Fifo {
                concurrency,
                busy,
                queue,
            } => {
                if *busy < *concurrency {
                    *busy += 1;
                    self.jobs[job as usize].started = true;
                    let t = scaled(self.jobs[job as usize].work, factor);
                    self.heap.push(event(now + t, KIND_JOB, job));
                } else {
                    queue.push_back(job);
                }
            }
            Station::Ps { .. } => {
                self.jobs[job as usize].started = true;
                self.ps_advance(g, now);
                let Station::Ps { v, finishes, .. } = &mut self.stations[g] else {
                    unreachable!()
                };
                let done_at = (*v + self.jobs[job as usize].work as f64).ceil() as u64;
                finishes.push(Reverse((done_at, job)));
                self.ps_schedule(g, now);
            }
        }
    }

    /// A FIFO server finished `job`: it takes the next waiting call, then answers.
    fn fifo_done(&mut self, job: u32, now: u64) {
        let g = self.jobs[job as usize].server as usize;
        let factor = self.servers[g].factor();
        let Station::Fifo { busy, queue, .. } = &mut self.stations[g] else {
            unreachable!("job events come from FIFO servers")
        };
        *busy -= 1;
        while let Some(next) = queue.pop_front() {
            if self.jobs[next as usize].abandoned {
                self.free_jobs.push(next);
                continue;
            }
            *busy += 1;
            self.jobs[next as usize].started = true;
            let t = scaled(self.jobs[next as usize].work, factor);
            self.heap.push(event(now + t, KIND_JOB, next));
            break;
        }
        self.deliver(job, now);
    }

    /// The answer of a finished job reaches its caller, unless the caller has gone.
    fn deliver(&mut self, job: u32, now: u64) {
        self.free_jobs.push(job);
        let j = self.jobs[job as usize];
        if self.tracked[j.server as usize] {
            self.loads[j.server as usize].finish(j.ticket, dur(now));
        }
        if j.abandoned {
            return;
        }
        let (s, which) = (j.slot as usize, j.which as usize);
        let a = &mut self.slots[s].tries[which];
        debug_assert!(a.pending && a.job == job);
        a.job = NO_JOB;
        self.try_done(s, which, j.ok, now);
    }

    fn ps_advance(&mut self, g: usize, now: u64) {
        let factor = self.servers[g].factor();
        let Station::Ps {
            concurrency,
            v,
            at,
            finishes,
            ..
        } = &mut self.stations[g]
        else {
            return;
        };
        *v += (now - *at) as f64 * ps_rate(*concurrency, finishes.len(), factor);
        *at = now;
    }

    /// Schedules a processor-sharing server's next completion (after `ps_advance`).
    fn ps_schedule(&mut self, g: usize, now: u64) {
        let factor = self.servers[g].factor();
        let Station::Ps {
            concurrency,
            v,
            due,
            finishes,
            ..
        } = &mut self.stations[g]
        else {
            return;
        };
        let Some(Reverse((done_at, _))) = finishes.peek() else {
            *due = NEVER;
            return;
        };
        let rate = ps_rate(*concurrency, finishes.len(), factor);
        let wait = ((*done_at as f64 - *v).max(0.0) / rate).ceil() as u64;
        *due = now + wait;
        self.heap.push(event(*due, KIND_PS, g as u32));
    }

    fn ps_event(&mut self, g: usize, now: u64) {
        if !matches!(self.stations[g], Station::Ps { due, .. } if due == now) {
            return;
        }
        self.ps_advance(g, now);
        let Station::Ps { v, finishes, .. } = &mut self.stations[g] else {
            unreachable!()
        };
        self.finished.clear();
        while let Some(&Reverse((done_at, job))) = finishes.peek() {
            // The wait was rounded up, so every call due by now has v >= done_at (less a
            // rounding error far below a nanosecond).
            if done_at as f64 > *v + 1e-3 {
                break;
            }
            finishes.pop();
            self.finished.push(job);
        }
        self.ps_schedule(g, now);
        for i in 0..self.finished.len() {
            let job = self.finished[i];
            self.deliver(job, now);
        }
    }

    /// Sets a server's slow-downs (a processor-sharing server first accounts for the service
    /// given at the old speed).
    fn set_speed(&mut self, g: usize, antagonist: Option<f64>, slowdown: Option<f64>, now: u64) {
        let ps = matches!(self.stations[g], Station::Ps { .. });
        if ps {
            self.ps_advance(g, now);
        }
        let server = &mut self.servers[g];
        if let Some(a) = antagonist {
            server.antagonist = a;
        }
        if let Some(s) = slowdown {
            server.slowdown = s;
        }
        if ps {
            self.ps_schedule(g, now);
        }
    }

    fn antagonists(&mut self, c: usize, now: u64) {
        let a = self.sc.clusters[c]
            .antagonist
            .as_ref()
            .expect("antagonist events only with antagonists");
        let (k, factor, period) = (a.servers as usize, a.factor, ns(a.period).max(1));
        let m = self.sc.clusters[c].servers as usize;
        let base = self.offsets[c];
        for i in 0..m {
            if self.servers[base + i].antagonist != 1.0 {
                self.set_speed(base + i, Some(1.0), None, now);
            }
        }
        // A partial Fisher-Yates shuffle: k distinct servers, uniformly.
        self.draw.clear();
        self.draw.extend(0..m as u32);
        for i in 0..k {
            let j = self.rng.gen_range(i..m);
            self.draw.swap(i, j);
            let g = base + self.draw[i] as usize;
            self.set_speed(g, Some(factor), None, now);
        }
        self.heap
            .push(event(now + period, KIND_ANTAGONIST, c as u32));
    }

    fn slowdown(&mut self, c: usize, now: u64) {
        let s = self.sc.clusters[c]
            .slowdown
            .as_ref()
            .expect("slowdown events only with a slowdown");
        let factor = if now >= ns(s.end) { 1.0 } else { s.factor };
        for i in 0..s.servers as usize {
            self.set_speed(self.offsets[c] + i, None, Some(factor), now);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::ClusterConfig;
    use crate::{Latency, LatencyDist};
    use keel_balance::BalancerConfig;

    /// Identical servers without queues, hedging at a fixed 20 ms: a request that takes less
    /// was never hedged, and its latency is its first try's work. On common random numbers
    /// that work is the request's own, so the hedged and unhedged runs record the very same
    /// latencies below 20 ms; on one shared stream every hedge's draw shifts the later
    /// requests' work, and they do not.
    #[test]
    fn common_random_numbers_give_hedged_and_unhedged_runs_the_same_work() {
        let sc = |hedged: bool| Scenario {
            requests: 3_000,
            load: Load::Open {
                rate: 50.0,
                clients: 3,
            },
            hedge: hedged.then_some(keel_balance::HedgeConfig {
                delay: keel_balance::HedgeDelay::Fixed(Duration::from_millis(20)),
                max: 1,
                budget_percent: 100.0,
            }),
            clusters: vec![ClusterConfig {
                servers: 4,
                latency: Latency {
                    dist: LatencyDist::Exponential,
                    mean: Duration::from_millis(10),
                },
                balancer: BalancerConfig::new(StrategyKind::Random),
                ..ClusterConfig::default()
            }],
            placement: Placement::ClientSide,
            ..Scenario::default()
        };
        let below_20ms = |hedged, crn| {
            let options = RunOptions {
                common_random_numbers: crn,
            };
            let st = run_replication_with(&sc(hedged), 0, options, &|_| {}).unwrap();
            assert_eq!(st.requests, 3_000);
            assert_eq!(st.hedges > 0, hedged);
            let cdf: Vec<(f64, f64)> = st.latency.cdf_ns();
            cdf.into_iter()
                .filter(|&(ns, _)| ns < 19.9e6)
                .collect::<Vec<_>>()
        };
        let (off, on) = (below_20ms(false, true), below_20ms(true, true));
        // About 1 - e^-2 = 86 % of the requests, in hundreds of bins.
        assert!(off.len() > 100 && (off[off.len() - 1].1 - 0.86).abs() < 0.03);
        assert_eq!(off, on);
        assert_ne!(below_20ms(false, false), below_20ms(true, false));
    }
}
