//! Closed forms: the share of prompt tokens served from cache under prefix affinity and under
//! load balancing, and where affinity stops paying. Derivation and limits: docs/inference.md,
//! "When prefix affinity pays: the closed form".
//!
//! One model serves both routings: a *mix*, the share of all requests that are of group `g`
//! and land on engine `j`. Load balancing (round-robin, least-request) spreads every group over
//! every engine; affinity partitions the groups (largest first onto the least loaded engine),
//! optionally capped at `bound / N` of the requests per engine with the excess spread over the
//! others. Each engine is then an LRU cache of blocks fed by its own mix, solved by Che's
//! approximation, and a server of continuous batching whose mean step and TTFT solve Little's
//! law (see [`pool`]).

use keel_balance::prefix::MAX_BLOCK_TOKENS;

use super::EngineSpec;

/// How requests spread over the prefix groups.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Popularity {
    /// Group `i` (from 0) has weight `1 / (i + 1)^s`; `s = 0` is uniform.
    Zipf(f64),
    /// Group 0 takes this share of the requests; the others split the rest evenly.
    Hot(f64),
}

impl Popularity {
    /// The share of requests of each of `groups` groups (sums to 1).
    pub fn shares(self, groups: usize) -> Vec<f64> {
        let groups = groups.max(1);
        let raw: Vec<f64> = match self {
            Popularity::Zipf(s) => (0..groups).map(|i| ((i + 1) as f64).powf(-s)).collect(),
            Popularity::Hot(h) if groups == 1 => vec![h.max(f64::MIN_POSITIVE)],
            Popularity::Hot(h) => {
                let h = h.clamp(0.0, 1.0);
                let rest = (1.0 - h) / (groups - 1) as f64;
                (0..groups).map(|i| if i == 0 { h } else { rest }).collect()
            }
        };
        let sum: f64 = raw.iter().sum();
        raw.into_iter().map(|x| x / sum).collect()
    }
}

/// A workload of prompts that share prefixes: every request is one group's prefix, then its own
/// suffix, then its answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// Prefix groups.
    pub groups: usize,
    /// Tokens of a group's prefix.
    pub prefix_tokens: usize,
    /// Tokens of each request's own suffix.
    pub unique_tokens: usize,
    /// Tokens of each answer.
    pub output_tokens: usize,
    /// How requests spread over the groups.
    pub popularity: Popularity,
    /// Requests in a finite run: each group's first request on an engine misses (the cache
    /// starts cold). `None`: the steady state.
    pub requests: Option<u64>,
}

fn block_tokens(spec: &EngineSpec) -> usize {
    spec.block_tokens.clamp(1, MAX_BLOCK_TOKENS)
}

impl Workload {
    /// Prompt tokens of a request.
    pub fn prompt_tokens(&self) -> usize {
        self.prefix_tokens + self.unique_tokens
    }

    /// Full blocks of a group's prefix: what another request of the group can find cached
    /// (only full blocks are named, `keel_balance::prefix`).
    pub fn shared_blocks(&self, spec: &EngineSpec) -> usize {
        self.prefix_tokens / block_tokens(spec)
    }

    /// Tokens a cached prefix saves.
    pub fn shared_tokens(&self, spec: &EngineSpec) -> usize {
        self.shared_blocks(spec) * block_tokens(spec)
    }

    /// Blocks a running request holds beyond its group's shared ones (its suffix, answer and
    /// the partial blocks): pinned while it runs.
    pub fn own_blocks(&self, spec: &EngineSpec) -> usize {
        let total = (self.prompt_tokens() + self.output_tokens).div_ceil(block_tokens(spec));
        total - self.shared_blocks(spec)
    }

    /// Blocks a finished request leaves in the engine's free queue that no other request will
    /// ask for (its suffix, answer and partial blocks, named or not): they take LRU room, as
    /// the engine evicts the least recently freed block whatever it holds.
    pub fn one_time_blocks(&self, spec: &EngineSpec) -> usize {
        self.own_blocks(spec)
    }
}

/// How requests are routed to engines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// Every engine sees every group in proportion (round-robin, least-request, random).
    Balanced,
    /// Groups partitioned over the engines, largest first onto the least loaded; with a bound
    /// `c >= 1`, no engine takes more than `c / N` of the requests (the excess spreads over the
    /// engines below the cap, where it is another group to cache).
    Affinity {
        /// The cap on an engine's share, as a multiple of the mean share.
        bound: Option<f64>,
    },
}

/// The share of all requests that are of group `g` and land on engine `j`: `mix[j][g]`.
pub fn mix(shares: &[f64], engines: usize, routing: Routing) -> Vec<Vec<f64>> {
    let n = engines.max(1);
    let mut m = vec![vec![0.0; shares.len()]; n];
    match routing {
        Routing::Balanced => {
            for row in m.iter_mut() {
                for (g, &p) in shares.iter().enumerate() {
                    row[g] = p / n as f64;
                }
            }
        }
        Routing::Affinity { bound } => {
            let mut order: Vec<usize> = (0..shares.len()).collect();
            order.sort_by(|&a, &b| shares[b].total_cmp(&shares[a]).then(a.cmp(&b)));
            let mut load = vec![0.0f64; n];
            for g in order {
                let j = (0..n)
                    .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
                    .unwrap_or(0);
                m[j][g] = shares[g];
                load[j] += shares[g];
            }
            if let Some(c) = bound {
                cap(&mut m, c.max(1.0) / n as f64);
            }
        }
    }
    m
}

/// The `prefix-affinity` strategy's own mix: the groups partitioned (see [`mix`]), and an
/// engine full only at `bound` times the mean share **and** `slack` requests ahead of the least
/// loaded, of `in_flight` requests in flight (keel-balance's rule, its calls in flight taken in
/// proportion to the engines' shares): the cap on a share is
/// `max(bound / N, least share + slack / in_flight)`. At a few requests in flight the slack is
/// the larger and a partition of uneven shares stands (2 groups on 3 engines: 1/2, 1/2, 0 at
/// 6 in flight, where `bound` alone would move a sixth of the requests to the idle engine).
pub fn affinity_mix(
    shares: &[f64],
    engines: usize,
    bound: f64,
    slack: f64,
    in_flight: f64,
) -> Vec<Vec<f64>> {
    let mut m = mix(shares, engines, Routing::Affinity { bound: None });
    let n = engines.max(1) as f64;
    let least = m
        .iter()
        .map(|r| r.iter().sum::<f64>())
        .fold(f64::INFINITY, f64::min);
    let slack = if in_flight > 0.0 {
        slack.max(0.0) / in_flight
    } else {
        f64::INFINITY
    };
    let c = (bound.max(1.0) / n).max(least + slack);
    if c < 1.0 {
        cap(&mut m, c);
    }
    m
}

/// Caps every engine's share at `cap`, moving each over-full engine's excess (from all its
/// groups in proportion) to the engines below the cap in proportion to their room.
fn cap(m: &mut [Vec<f64>], cap: f64) {
    let groups = m.first().map_or(0, Vec::len);
    let loads: Vec<f64> = m.iter().map(|r| r.iter().sum()).collect();
    let room: Vec<f64> = loads.iter().map(|&l| (cap - l).max(0.0)).collect();
    let total_room: f64 = room.iter().sum();
    if total_room <= 0.0 {
        return;
    }
    let mut moved = vec![0.0; groups];
    for (j, row) in m.iter_mut().enumerate() {
        if loads[j] > cap {
            let keep = cap / loads[j];
            for (g, x) in row.iter_mut().enumerate() {
                moved[g] += *x * (1.0 - keep);
                *x *= keep;
            }
        }
    }
    let total_moved: f64 = moved.iter().sum();
    // The excess is spread in proportion to room: with `cap >= 1 / N` it never exceeds it.
    for (j, row) in m.iter_mut().enumerate() {
        if room[j] > 0.0 && total_moved > 0.0 {
            let take = room[j] / total_room;
            for g in 0..groups {
                row[g] += moved[g] * take;
            }
        }
    }
}

/// Che's characteristic time of an LRU cache of `capacity` blocks: the `t` with
/// `sum_i blocks_i (1 - e^{-q_i (t + held)}) + one_time t = capacity + one_time`, where item `i`
/// is `blocks_i` blocks asked for by a share `q_i` of requests, and each request also leaves
/// `one_time` blocks asked for never again. Time counts requests at this cache.
///
/// Two terms go beyond Che's form, both checked against the engine: `held`, the requests that
/// arrive while one runs (Little's law: the requests in flight), because a running request
/// references its prefix and a referenced block cannot be evicted, so an item is lost only
/// after `t` requests *since its last request finished*; and `+ one_time` on the right, because
/// a request's own one-time blocks are freed before its prefix (tail first), so they sit below
/// it and do not push it out (without it Che's form is up to 0.06 low against an exact LRU,
/// with it within 0.03: the test `che_against_an_exact_lru`).
/// Infinite when everything fits; 0 when the cache has no room.
pub fn che_time(items: &[(f64, f64)], one_time: f64, capacity: f64, held: f64) -> f64 {
    if capacity <= 0.0 {
        return 0.0;
    }
    let capacity = capacity + one_time.max(0.0);
    let held = held.max(0.0);
    let occupied = |t: f64| -> f64 {
        items
            .iter()
            .map(|&(q, b)| b * -(-q * (t + held)).exp_m1())
            .sum::<f64>()
            + one_time * t
    };
    let all: f64 = items.iter().filter(|i| i.0 > 0.0).map(|i| i.1).sum();
    if one_time <= 0.0 && all <= capacity {
        return f64::INFINITY;
    }
    let mut hi = 1.0;
    while occupied(hi) < capacity {
        hi *= 2.0;
        if hi > 1e15 {
            return f64::INFINITY;
        }
    }
    let mut lo = 0.0;
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if occupied(mid) < capacity {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Che's hit ratio of an item asked for by a share `q` of requests: `1 - e^{-q t}` (pass
/// `t + held` for an item held by running requests, see [`che_time`]).
pub fn che_hit(q: f64, t: f64) -> f64 {
    if t.is_infinite() {
        if q > 0.0 {
            1.0
        } else {
            0.0
        }
    } else {
        -(-q * t).exp_m1()
    }
}

/// One engine under a routing at a load.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineLoad {
    /// Its share of all requests.
    pub share: f64,
    /// Share of its prompt tokens served from cache.
    pub cached: f64,
    /// Its utilization (arrival rate x mean service time).
    pub utilization: f64,
    /// Requests in flight (Little's law), each pinning its own blocks.
    pub in_flight: f64,
    /// Cache blocks left for LRU after the pinned ones.
    pub lru_blocks: f64,
    /// Mean service time alone (prefill of the uncached tokens + the decode steps), seconds.
    pub service: f64,
    /// Mean time to first token (continuous batching, see [`pool`]), seconds; infinite when
    /// the engine is overloaded.
    pub ttft: f64,
}

/// A pool of engines under one routing.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolLoad {
    /// Per engine.
    pub engines: Vec<EngineLoad>,
    /// Share of all prompt tokens served from cache.
    pub cached: f64,
    /// Mean service time over requests, seconds.
    pub service: f64,
    /// Mean time to first token over requests, seconds.
    pub ttft: f64,
}

impl PoolLoad {
    /// The busiest engine's share of requests times N (1 when even).
    pub fn hot_spot(&self) -> f64 {
        let n = self.engines.len() as f64;
        self.engines.iter().map(|e| e.share).fold(0.0, f64::max) * n
    }
}

/// How the pool's requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// Open loop (Poisson) at this offered load per engine under balancing: arrivals per
    /// engine x the mean service time of a request served alone (prefill of its uncached
    /// tokens + its decode steps at one sequence), with the balanced routing's own hit ratio
    /// (see [`pool`]). Continuous batching serves several at once, so an engine keeps up
    /// past 1.
    Load(f64),
    /// Closed loop: this many clients, each with one request in flight.
    Clients(usize),
}

/// Service time of a request served alone with `uncached` prompt tokens to prefill, seconds.
fn service_alone(spec: &EngineSpec, w: &Workload, uncached: f64) -> f64 {
    uncached / spec.prefill_tps + w.output_tokens as f64 * step_alone(spec)
}

fn step_alone(spec: &EngineSpec) -> f64 {
    (spec.step_ms + spec.step_per_seq_ms) / 1000.0
}

/// An engine under continuous batching, solved for its mean step and TTFT.
struct Batching {
    /// Mean TTFT, seconds (infinite when the engine cannot keep up).
    ttft: f64,
    /// Requests in the engine (Little's law).
    in_flight: f64,
    /// Requests per second.
    rate: f64,
}

/// Continuous batching at `lambda` requests per second (open loop), or with `n` requests always
/// in the engine (closed loop, `lambda = None`), with a mean prefill of `prefill` seconds per
/// request. Steps run back to back while there is work: a step takes `s0 + s1 n` plus the
/// prefill of the requests that arrived during the previous one, so its mean is
/// `D = (s0 + s1 n) / (1 - lambda prefill)`; a request waits for the step under way (half of
/// one, when the engine is busy: probability `1 - e^{-n}`), then its own step:
/// `TTFT = (1 - e^{-n}) D / 2 + D + s1 + prefill`; and it stays for `output - 1` more steps:
/// `n = lambda (TTFT + (output - 1) D)`. Fixed point by damped iteration.
fn batching(
    spec: &EngineSpec,
    w: &Workload,
    lambda: Option<f64>,
    n: f64,
    prefill: f64,
) -> Batching {
    let (s0, s1) = (spec.step_ms / 1000.0, spec.step_per_seq_ms / 1000.0);
    let more = w.output_tokens.saturating_sub(1) as f64;
    let (mut n, mut rate) = (n.max(0.0), lambda.unwrap_or(0.0));
    let mut ttft = f64::INFINITY;
    for _ in 0..500 {
        let load = rate * prefill;
        if load >= 1.0 || n > 1e7 {
            return Batching {
                ttft: f64::INFINITY,
                in_flight: f64::INFINITY,
                rate,
            };
        }
        let d = (s0 + s1 * n) / (1.0 - load);
        let busy = if lambda.is_none() && n >= 1.0 {
            1.0
        } else {
            -(-n).exp_m1()
        };
        ttft = busy * d / 2.0 + d + s1 + prefill;
        let stay = ttft + more * d;
        match lambda {
            Some(l) => {
                let next = l * stay;
                if (next - n).abs() < 1e-10 * (1.0 + n) {
                    break;
                }
                n = 0.5 * (n + next);
            }
            None => {
                let next = n / stay;
                if (next - rate).abs() < 1e-10 * (1.0 + rate) {
                    break;
                }
                rate = 0.5 * (rate + next);
            }
        }
    }
    Batching {
        ttft,
        in_flight: n,
        rate,
    }
}

/// Mean TTFT of an engine with `n` requests always in it (closed loop) whose prompts find a
/// share `cached` of their tokens in its cache, seconds: continuous batching as in [`pool`].
pub fn closed_loop_ttft(spec: &EngineSpec, w: &Workload, n: f64, cached: f64) -> f64 {
    let prefill = w.prompt_tokens() as f64 * (1.0 - cached.clamp(0.0, 1.0)) / spec.prefill_tps;
    batching(spec, w, None, n, prefill).ttft
}

/// What a mix's cells are: shares expected of a routing, or a run's own counts over its
/// requests (then each cell's first request is a miss for certain, not in expectation).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cells {
    Expected,
    Counted,
}

/// The share of a group's requests at one engine that find its prefix, over a run of `n`
/// requests at that engine from a cold cache, the group a share `q` of them and `tau` Che's
/// characteristic time (plus the requests in flight, see [`che_time`]).
///
/// A request finds the prefix when one of the group's requests came within the last `tau`
/// requests (what LRU keeps); the `k`-th request of the run looks back over only `k - 1`, so
/// it misses with probability `(1 - q)^(k - 1)` while `k <= tau` (the cache is still filling:
/// nothing is evicted) and `e^{-q tau}` after. Summed over the run:
/// `1 - [(1 - (1 - q)^K) / q + (n - K) e^{-q tau}] / n` with `K = min(ceil(tau), n)`. With
/// everything fitting (`tau` infinite) this is the compulsory first misses,
/// `1 - (1 - (1 - q)^n) / (n q)`; with a small cache it is Che's hit ratio less a warm-up of
/// `tau` requests. (Scaling Che's ratio by the share of requests that are not a group's
/// first, as this form did before, counts a rarely asked group's misses twice: its gaps are
/// already misses in Che's ratio; 0.03 against the simulator's 0.08, 48 groups round-robin.)
pub fn run_hit(q: f64, tau: f64, n: f64) -> f64 {
    if q <= 0.0 || n <= 0.0 {
        return 0.0;
    }
    let q = q.min(1.0);
    let k = if tau.is_finite() {
        tau.ceil().min(n)
    } else {
        n
    };
    let warm = if q >= 1.0 {
        1.0f64.min(k)
    } else {
        -(k * (-q).ln_1p()).exp_m1() / q
    };
    let steady = (n - k).max(0.0) * (1.0 - che_hit(q, tau));
    (1.0 - (warm + steady) / n).clamp(0.0, 1.0)
}

/// [`run_hit`] when the run is known: `c` of the engine's `n` requests were the group's. The
/// first misses; each other one finds the prefix when the gap since the group's previous
/// request is under `tau` requests, a gap between `c` points spread over `n` being over `tau`
/// with probability `(1 - tau / n)^c`.
pub fn counted_hit(c: f64, tau: f64, n: f64) -> f64 {
    if c < 1.0 || n <= 0.0 {
        return 0.0;
    }
    let close = if tau >= n {
        1.0
    } else {
        1.0 - (1.0 - tau / n).powf(c)
    };
    (c - 1.0) / c * close
}

/// The pool under `routing`. `rate` is the arrival rate in requests per second for the whole
/// pool (open loop), or `None` with `clients` in flight (closed loop; waits are not modelled
/// then and the TTFT is the service's).
fn pool_at(
    spec: &EngineSpec,
    w: &Workload,
    mix: &[Vec<f64>],
    cells: Cells,
    rate: Option<f64>,
    clients: usize,
) -> PoolLoad {
    let b = w.shared_blocks(spec) as f64;
    let shared = w.shared_tokens(spec) as f64;
    let prompt = w.prompt_tokens().max(1) as f64;
    let own = w.own_blocks(spec) as f64;
    let one_time = w.one_time_blocks(spec) as f64;
    let mut engines = Vec::with_capacity(mix.len());
    for row in mix {
        let share: f64 = row.iter().sum();
        let lambda = rate.map(|r| r * share);
        let mut in_flight = match lambda {
            Some(_) => 0.0,
            None => clients as f64 * share,
        };
        let mut out = None;
        // The cache's room depends on what is in flight, which depends on the hit ratio
        // through the service time: iterate to the fixed point (it contracts fast).
        for _ in 0..100 {
            let lru = (spec.kv_blocks as f64 - in_flight * own).max(0.0);
            let items: Vec<(f64, f64)> = row
                .iter()
                .map(|&x| (if share > 0.0 { x / share } else { 0.0 }, b))
                .collect();
            let t = che_time(&items, one_time, lru, in_flight);
            // Hits and first-use misses per group.
            let (mut hit_tokens, mut reqs, mut s1) = (0.0, 0.0, 0.0);
            for &(q, _) in &items {
                if q <= 0.0 {
                    continue;
                }
                let tau = t + in_flight;
                let h = match w.requests {
                    Some(r) => {
                        let here = r as f64 * share;
                        match cells {
                            Cells::Expected => run_hit(q, tau, here),
                            Cells::Counted => counted_hit((q * here).round(), tau, here),
                        }
                    }
                    None => che_hit(q, tau),
                };
                hit_tokens += q * h * shared;
                reqs += q;
                let s_hit = service_alone(spec, w, prompt - shared);
                let s_miss = service_alone(spec, w, prompt);
                s1 += q * (h * s_hit + (1.0 - h) * s_miss);
            }
            if reqs <= 0.0 {
                out = Some(EngineLoad {
                    share,
                    cached: 0.0,
                    utilization: 0.0,
                    in_flight: 0.0,
                    lru_blocks: spec.kv_blocks as f64,
                    service: 0.0,
                    ttft: 0.0,
                });
                break;
            }
            let cached = hit_tokens / (reqs * prompt);
            let prefill = prompt * (1.0 - cached) / spec.prefill_tps;
            let b = batching(spec, w, lambda, in_flight, prefill);
            let next = match lambda {
                Some(_) => b.in_flight.min(spec.max_running as f64),
                None => in_flight,
            };
            let e = EngineLoad {
                share,
                cached,
                utilization: b.rate * s1,
                in_flight,
                lru_blocks: lru,
                service: s1,
                ttft: b.ttft,
            };
            let done = (next - in_flight).abs() < 1e-9 || !next.is_finite();
            out = Some(e);
            if done {
                break;
            }
            in_flight = next;
        }
        engines.push(out.expect("at least one round"));
    }
    let cached = engines.iter().map(|e| e.share * e.cached).sum();
    let service = engines.iter().map(|e| e.share * e.service).sum();
    let ttft = engines
        .iter()
        .filter(|e| e.share > 0.0)
        .map(|e| e.share * e.ttft)
        .sum();
    PoolLoad {
        engines,
        cached,
        service,
        ttft,
    }
}

/// The pool of `engines` engines under `routing`: with [`Arrivals::Load`] `rho`, the pool's
/// arrival rate is the one that loads each engine to `rho` under [`Routing::Balanced`]
/// (`rho = lambda / N x` the balanced mean service time), whatever `routing` is, so that two
/// routings compare at the same traffic.
///
/// Per engine: the hit ratio by Che's approximation on its own mix with the blocks pinned by
/// the requests in flight taken out, and the TTFT of continuous batching: steps run back to
/// back while there is work; a step takes `s0 + s1 n` plus the prefill of the requests that
/// arrived during the previous one, so its mean is `D = (s0 + s1 n) / (1 - lambda a)` (`a`
/// the mean prefill time, `n` the requests in the engine); a request waits for the step under
/// way (half of one when the engine is busy, probability `1 - e^{-n}`), then runs its own:
/// `TTFT = (1 - e^{-n}) D / 2 + D + s1 + a`; it stays `output - 1` more steps, so
/// `n = lambda (TTFT + (output - 1) D)`. The cache, `n` and `TTFT` are solved together.
pub fn pool(
    spec: &EngineSpec,
    w: &Workload,
    engines: usize,
    routing: Routing,
    arrivals: Arrivals,
) -> PoolLoad {
    let shares = w.popularity.shares(w.groups);
    pool_with_mix(spec, w, &mix(&shares, engines, routing), arrivals)
}

/// The pool with a mix that a run of `w.requests` requests made (`mix[j][g]` x the requests is
/// how many of group `g` went to engine `j`): as [`pool_with_mix`], but a group's first request
/// on an engine is a miss for certain where it came at all ([`counted_hit`]), where an expected
/// mix counts it in expectation (a group seen once on an engine is all miss, which an
/// expected share of 1 / 150 is not).
pub fn pool_of_run(
    spec: &EngineSpec,
    w: &Workload,
    mix: &[Vec<f64>],
    arrivals: Arrivals,
) -> PoolLoad {
    with_cells(spec, w, mix, Cells::Counted, arrivals)
}

/// The pool with a given mix (`mix[j][g]`: the share of all requests of group `g` on engine
/// `j`), e.g. the one a simulated or measured run made.
pub fn pool_with_mix(
    spec: &EngineSpec,
    w: &Workload,
    mix: &[Vec<f64>],
    arrivals: Arrivals,
) -> PoolLoad {
    with_cells(spec, w, mix, Cells::Expected, arrivals)
}

fn with_cells(
    spec: &EngineSpec,
    w: &Workload,
    mix: &[Vec<f64>],
    cells: Cells,
    arrivals: Arrivals,
) -> PoolLoad {
    match arrivals {
        Arrivals::Clients(c) => pool_at(spec, w, mix, cells, None, c),
        Arrivals::Load(rho) => {
            let rate = rate_at_load(spec, w, mix.len(), rho);
            pool_at(spec, w, mix, cells, Some(rate), 0)
        }
    }
}

/// The pool's arrival rate (requests per second) that loads each engine to `rho` under
/// balancing (the balanced service time depends on the rate through the pinned blocks: solved
/// by iteration).
pub fn rate_at_load(spec: &EngineSpec, w: &Workload, engines: usize, rho: f64) -> f64 {
    let shares = w.popularity.shares(w.groups);
    let m = mix(&shares, engines, Routing::Balanced);
    let n = engines.max(1) as f64;
    let mut rate = rho * n / service_alone(spec, w, w.prompt_tokens() as f64);
    for _ in 0..50 {
        let p = pool_at(spec, w, &m, Cells::Expected, Some(rate), 0);
        let next = rho * n / p.service.max(1e-12);
        if (next - rate).abs() <= 1e-9 * rate {
            break;
        }
        rate = next;
    }
    rate
}

/// Affinity against balancing for one workload at one load.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// The pool under prefix affinity.
    pub affinity: PoolLoad,
    /// The pool under load balancing.
    pub balanced: PoolLoad,
    /// `r`: the busiest affinity engine's mean service time over the balanced one's.
    pub r: f64,
    /// `k`: N x the busiest engine's share under affinity.
    pub k: f64,
    /// The load per engine.
    pub rho: f64,
    /// First order (the hot engine as M/M/1 against a balanced one): affinity wins where
    /// `r < 1 / (1 + (k - 1) rho)`.
    pub first_order_wins: bool,
    /// Continuous batching per engine (see [`pool`]), mean TTFT over requests: affinity wins
    /// where its mean is lower.
    pub wins: bool,
}

/// The first-order boundary: affinity wins where `r < 1 / (1 + (k - 1) rho)`.
pub fn first_order_wins(r: f64, k: f64, rho: f64) -> bool {
    r < 1.0 / (1.0 + (k - 1.0) * rho)
}

/// The load above which the first-order rule says affinity stops paying:
/// `rho* = (1 / r - 1) / (k - 1)`; infinite when `k = 1` and `r < 1`, 0 when `r >= 1`.
pub fn first_order_limit(r: f64, k: f64) -> f64 {
    if r >= 1.0 {
        0.0
    } else if k <= 1.0 + 1e-12 {
        f64::INFINITY
    } else {
        (1.0 / r - 1.0) / (k - 1.0)
    }
}

/// Compares affinity (with an optional bound) and balancing at load `rho` per engine.
pub fn compare(
    spec: &EngineSpec,
    w: &Workload,
    engines: usize,
    bound: Option<f64>,
    rho: f64,
) -> Comparison {
    let arrivals = Arrivals::Load(rho);
    let affinity = pool(spec, w, engines, Routing::Affinity { bound }, arrivals);
    let balanced = pool(spec, w, engines, Routing::Balanced, arrivals);
    let hot = affinity
        .engines
        .iter()
        .max_by(|a, b| a.share.total_cmp(&b.share))
        .map_or(0.0, |e| e.service);
    let r = if balanced.service > 0.0 {
        hot / balanced.service
    } else {
        1.0
    };
    let k = affinity.hot_spot();
    let wins = affinity.ttft < balanced.ttft;
    Comparison {
        r,
        k,
        rho,
        first_order_wins: first_order_wins(r, k, rho),
        wins,
        affinity,
        balanced,
    }
}

/// The load below which affinity's mean TTFT is below balancing's: the highest load of the
/// first run of wins from low load, on a grid of 0.01 up to 1 and 0.1 up to 10 (`load` is
/// offered load, see [`Arrivals::Load`]: a batching engine takes more than 1). `None` when
/// affinity does not win even at 0.01; infinite when it wins over the whole grid.
pub fn affinity_limit(
    spec: &EngineSpec,
    w: &Workload,
    engines: usize,
    bound: Option<f64>,
) -> Option<f64> {
    let grid = (1..=100)
        .map(|i| i as f64 / 100.0)
        .chain((11..=100).map(|i| i as f64 / 10.0));
    let mut last_win = None;
    for rho in grid {
        if compare(spec, w, engines, bound, rho).wins {
            last_win = Some(rho);
        } else {
            return last_win;
        }
    }
    last_win.map(|_| f64::INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::VecDeque;

    fn spec(kv_blocks: usize) -> EngineSpec {
        EngineSpec {
            kv_blocks,
            ..EngineSpec::default()
        }
    }

    fn workload(groups: usize, skew: f64) -> Workload {
        Workload {
            groups,
            prefix_tokens: 400,
            unique_tokens: 40,
            output_tokens: 24,
            popularity: Popularity::Zipf(skew),
            requests: None,
        }
    }

    #[test]
    fn blocks_of_a_request_by_hand() {
        let w = workload(6, 0.0);
        let s = spec(120);
        // 400 tokens = 25 blocks of 16; 464 tokens in all = 29 blocks (the last partial).
        assert_eq!(w.shared_blocks(&s), 25);
        assert_eq!(w.shared_tokens(&s), 400);
        assert_eq!(w.own_blocks(&s), 4);
        assert_eq!(w.one_time_blocks(&s), 4);
        let odd = Workload {
            prefix_tokens: 410,
            ..w
        };
        assert_eq!(odd.shared_blocks(&s), 25);
        assert_eq!(odd.own_blocks(&s), 30 - 25);
    }

    #[test]
    fn popularity_shares() {
        let z = Popularity::Zipf(1.0).shares(3);
        let h = 1.0 + 0.5 + 1.0 / 3.0;
        assert!((z[0] - 1.0 / h).abs() < 1e-12 && (z[2] - 1.0 / 3.0 / h).abs() < 1e-12);
        assert_eq!(Popularity::Zipf(0.0).shares(4), vec![0.25; 4]);
        let hot = Popularity::Hot(0.7).shares(4);
        assert!((hot[0] - 0.7).abs() < 1e-12 && (hot[3] - 0.1).abs() < 1e-12);
        assert_eq!(Popularity::Hot(0.3).shares(1), vec![1.0]);
    }

    #[test]
    fn che_by_hand() {
        // Two items of 10 blocks, equal shares, no one-timers, room for 10: each half cached,
        // 20 (1 - e^{-t/2}) = 10, t = 2 ln 2.
        let t = che_time(&[(0.5, 10.0), (0.5, 10.0)], 0.0, 10.0, 0.0);
        assert!((t - 2.0 * 2f64.ln()).abs() < 1e-9, "{t}");
        assert!((che_hit(0.5, t) - 0.5).abs() < 1e-9);
        // Everything fits: infinite; no room: zero.
        assert!(che_time(&[(1.0, 5.0)], 0.0, 5.0, 0.0).is_infinite());
        assert_eq!(che_time(&[(1.0, 5.0)], 1.0, 0.0, 0.0), 0.0);
        // Uniform items under LRU hit C / n (IRM): here 30 of 60.
        let items = vec![(1.0 / 6.0, 10.0); 6];
        let t = che_time(&items, 0.0, 30.0, 0.0);
        assert!((che_hit(1.0 / 6.0, t) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn mixes_partition_spread_and_cap() {
        let u = Popularity::Zipf(0.0).shares(6);
        let aff = mix(&u, 3, Routing::Affinity { bound: None });
        for row in &aff {
            assert_eq!(row.iter().filter(|&&x| x > 0.0).count(), 2);
            assert!((row.iter().sum::<f64>() - 1.0 / 3.0).abs() < 1e-12);
        }
        let one = mix(&[1.0], 3, Routing::Affinity { bound: None });
        assert_eq!(
            one.iter().map(|r| r[0]).collect::<Vec<_>>(),
            vec![1.0, 0.0, 0.0]
        );
        let capped = mix(&[1.0], 3, Routing::Affinity { bound: Some(1.5) });
        assert!((capped[0][0] - 0.5).abs() < 1e-12);
        assert!((capped[1][0] - 0.25).abs() < 1e-12 && (capped[2][0] - 0.25).abs() < 1e-12);
        let lb = mix(&u, 3, Routing::Balanced);
        assert!(lb.iter().flatten().all(|&x| (x - 1.0 / 18.0).abs() < 1e-12));
    }

    #[test]
    fn one_group_that_fits_is_the_same_under_both() {
        let w = workload(1, 0.0);
        let s = spec(120);
        let a = pool(
            &s,
            &w,
            3,
            Routing::Affinity { bound: None },
            Arrivals::Clients(6),
        );
        let b = pool(&s, &w, 3, Routing::Balanced, Arrivals::Clients(6));
        // Every request finds its 400 prefix tokens of 440.
        assert!((a.cached - 400.0 / 440.0).abs() < 1e-6, "{}", a.cached);
        assert!((b.cached - a.cached).abs() < 1e-6);
        assert!((a.hot_spot() - 3.0).abs() < 1e-12);
        assert!((b.hot_spot() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_small_cache_hurts_balancing_not_affinity() {
        // 12 uniform groups of 25 blocks = 300 blocks; each engine holds 120 less pinned.
        let w = workload(12, 0.0);
        let s = spec(120);
        let a = pool(
            &s,
            &w,
            3,
            Routing::Affinity { bound: None },
            Arrivals::Clients(6),
        );
        let b = pool(&s, &w, 3, Routing::Balanced, Arrivals::Clients(6));
        let full = 400.0 / 440.0;
        // Affinity: 4 groups = 100 blocks per engine + one-timers in 112 blocks: most stay.
        assert!(a.cached > 0.8 * full, "{}", a.cached);
        assert!(b.cached < 0.4 * full, "{}", b.cached);
        // With a cache large enough, both serve the whole prefix.
        let big = spec(100_000);
        let a = pool(
            &big,
            &w,
            3,
            Routing::Affinity { bound: None },
            Arrivals::Clients(6),
        );
        let b = pool(&big, &w, 3, Routing::Balanced, Arrivals::Clients(6));
        assert!((a.cached - full).abs() < 1e-6 && (b.cached - full).abs() < 1e-6);
    }

    #[test]
    fn even_groups_give_k_one_and_affinity_wins_at_every_load() {
        let w = workload(6, 0.0);
        let s = spec(120);
        for rho in [0.1, 0.5, 0.9] {
            let c = compare(&s, &w, 3, None, rho);
            assert!((c.k - 1.0).abs() < 1e-12);
            assert!(c.r < 1.0, "r {}", c.r);
            assert!(c.first_order_wins && c.wins, "rho {rho}: {c:?}");
        }
        assert_eq!(first_order_limit(0.5, 1.0), f64::INFINITY);
    }

    #[test]
    fn one_shared_prefix_unbounded_loses() {
        // All requests to one engine (k = 3) for no cache gain (r ~ 1): loses at any load.
        let w = workload(1, 0.0);
        let s = spec(120);
        let c = compare(&s, &w, 3, None, 0.3);
        assert!((c.k - 3.0).abs() < 1e-12);
        assert!(!c.first_order_wins && !c.wins, "{c:?}");
        // A bound of 1.0 spreads it back: k = 1.
        let c = compare(&s, &w, 3, Some(1.0), 0.3);
        assert!((c.k - 1.0).abs() < 1e-9);
    }

    #[test]
    fn first_order_boundary_by_hand() {
        // r = 0.5, k = 2: wins below rho = 1.
        assert!((first_order_limit(0.5, 2.0) - 1.0).abs() < 1e-12);
        assert!(first_order_wins(0.5, 2.0, 0.99) && !first_order_wins(0.5, 2.0, 1.01));
        // r = 0.8, k = 3: rho* = 0.25 / 2 = 0.125.
        assert!((first_order_limit(0.8, 3.0) - 0.125).abs() < 1e-12);
        assert_eq!(first_order_limit(1.0, 3.0), 0.0);
    }

    #[test]
    fn skew_ends_affinitys_lead_at_some_load() {
        // 3 groups with a hot one (80 %): affinity's hot engine takes 0.8 of the traffic.
        let mut w = workload(3, 0.0);
        w.popularity = Popularity::Hot(0.8);
        let s = spec(60); // 75 blocks of prefixes do not fit in 60
        let lim = affinity_limit(&s, &w, 3, None).expect("wins at low load");
        assert!(lim > 0.01 && lim.is_finite(), "limit {lim}");
        assert!(compare(&s, &w, 3, None, 0.05).wins);
        assert!(!compare(&s, &w, 3, None, lim + 0.1).wins);
        // The first-order rule is stricter: the hot engine as M/M/1 at k = 2.4.
        let c = compare(&s, &w, 3, None, 0.05);
        assert!((c.k - 2.4).abs() < 1e-9, "{}", c.k);
        let first = first_order_limit(c.r, c.k);
        assert!(first > 0.0 && first < lim, "{first}");
    }

    #[test]
    fn a_finite_run_counts_first_misses() {
        // The measured workload: 150 requests, 6 groups; affinity misses each group once:
        // (150 - 6) x 400 / (150 x 440) = 0.8727.
        let mut w = workload(6, 0.0);
        w.requests = Some(150);
        let a = pool(
            &spec(120),
            &w,
            3,
            Routing::Affinity { bound: None },
            Arrivals::Clients(6),
        );
        assert!(
            (a.cached - 144.0 * 400.0 / (150.0 * 440.0)).abs() < 1e-3,
            "{}",
            a.cached
        );
    }

    #[test]
    fn a_run_from_cold_by_hand() {
        // Everything fits: only each group's first request misses; 2 groups of equal share in
        // 50 requests: 1 - (1 - 0.5^50) / 25 = 0.96.
        assert!((run_hit(0.5, f64::INFINITY, 50.0) - 0.96).abs() < 1e-9);
        // One group: one miss in n.
        assert!((run_hit(1.0, f64::INFINITY, 10.0) - 0.9).abs() < 1e-12);
        // A small cache: Che's ratio less the warm-up. q = 1/48, tau = 4 in 50 requests:
        // misses sum_{k<4} (47/48)^k + 46 e^{-4/48}.
        let q: f64 = 1.0 / 48.0;
        let misses: f64 = (0..4).map(|k| (1.0 - q).powi(k)).sum::<f64>() + 46.0 * (-4.0 * q).exp();
        assert!((run_hit(q, 4.0, 50.0) - (1.0 - misses / 50.0)).abs() < 1e-9);
        // A long run tends to Che's ratio; the old scaling by (n - first) / n is well below it.
        let long = run_hit(q, 4.0, 1e6);
        assert!((long - che_hit(q, 4.0)).abs() < 1e-4, "{long}");
        // Counted: a group seen once misses; seen c times with every gap short, (c - 1) / c.
        assert_eq!(counted_hit(1.0, f64::INFINITY, 50.0), 0.0);
        assert!((counted_hit(4.0, 60.0, 50.0) - 0.75).abs() < 1e-12);
        // Many times over a long run: Che's ratio.
        let c = counted_hit(1000.0, 4.0, 48_000.0);
        assert!((c - che_hit(q, 4.0)).abs() < 2e-3, "{c}");
    }

    #[test]
    fn affinity_mix_spills_only_past_the_slack() {
        // 2 groups on 3 engines at 6 in flight: the slack (5 of 6) allows 1/2, 1/2, 0.
        let two = Popularity::Zipf(0.0).shares(2);
        let m = affinity_mix(&two, 3, 1.25, 5.0, 6.0);
        let loads: Vec<f64> = m.iter().map(|r| r.iter().sum()).collect();
        assert_eq!(loads, vec![0.5, 0.5, 0.0]);
        // At 60 in flight the relative bound decides: at most 1.25 / 3 an engine.
        let m = affinity_mix(&two, 3, 1.25, 5.0, 60.0);
        for r in &m {
            let l: f64 = r.iter().sum();
            assert!(l <= 1.25 / 3.0 + 1e-12, "{l}");
        }
        // One prefix at 12 in flight: 5 ahead of an idle engine, 5 of 12.
        let m = affinity_mix(&[1.0], 3, 1.25, 5.0, 12.0);
        assert!((m[0][0] - 5.0 / 12.0).abs() < 1e-12, "{m:?}");
    }

    /// An exact LRU of blocks: each request asks for its group's `b` blocks (a hit is the
    /// longest cached run from the first), then leaves `u` blocks of its own; blocks are
    /// refreshed tail first so that a prefix loses its last blocks first, as vLLM frees them.
    fn lru_hit_ratio(shares: &[f64], b: usize, u: usize, cap: usize, n: usize, seed: u64) -> f64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cache: VecDeque<u64> = VecDeque::new(); // front = most recent
        let (mut hits, mut asked) = (0usize, 0usize);
        let mut fresh = 1u64 << 40;
        let warm = n / 5;
        for i in 0..n {
            let x: f64 = rng.gen();
            let mut acc = 0.0;
            let mut g = shares.len() - 1;
            for (k, &p) in shares.iter().enumerate() {
                acc += p;
                if x < acc {
                    g = k;
                    break;
                }
            }
            let names: Vec<u64> = (0..b as u64).map(|k| ((g as u64) << 20) | k).collect();
            let run = names.iter().take_while(|n| cache.contains(n)).count();
            if i >= warm {
                hits += run;
                asked += b;
            }
            let touch = |name: u64, cache: &mut VecDeque<u64>| {
                if let Some(pos) = cache.iter().position(|&c| c == name) {
                    cache.remove(pos);
                }
                cache.push_front(name);
                cache.truncate(cap);
            };
            for _ in 0..u {
                fresh += 1;
                touch(fresh, &mut cache);
            }
            for &name in names.iter().rev() {
                touch(name, &mut cache);
            }
        }
        hits as f64 / asked as f64
    }

    #[test]
    fn che_against_an_exact_lru() {
        // Tolerance 0.03 over groups x skew x room x one-timers (largest seen 0.023 at this seed).
        let mut worst: f64 = 0.0;
        for groups in [2, 6, 12, 48] {
            for skew in [0.0, 1.0] {
                for cap in [20usize, 50, 90] {
                    for u in [0usize, 3] {
                        let shares = Popularity::Zipf(skew).shares(groups);
                        let b = 10;
                        let exact = lru_hit_ratio(&shares, b, u, cap, 6000, 7);
                        let items: Vec<(f64, f64)> =
                            shares.iter().map(|&q| (q, b as f64)).collect();
                        let t = che_time(&items, u as f64, cap as f64, 0.0);
                        let che: f64 = shares.iter().map(|&q| q * che_hit(q, t)).sum();
                        let err = (che - exact).abs();
                        worst = worst.max(err);
                        assert!(
                            err < 0.03,
                            "groups {groups} skew {skew} cap {cap} u {u}: che {che:.3} exact {exact:.3}"
                        );
                    }
                }
            }
        }
        eprintln!("largest |Che - exact LRU|: {worst:.4}");
    }
}
