//! A discrete-event simulator of requests crossing clusters of servers through keel-balance's
//! own balancers, on a virtual clock, deterministic for a seed.
//!
//! - **Load**: open loop (Poisson arrivals at a rate) or closed loop (clients keeping a fixed
//!   number of requests in flight).
//! - **Servers**: healthy service time (fixed, exponential, log-normal) and a failure mode for
//!   the failed ones: hang to the caller's timeout, fail fast, slow down, error with a
//!   probability, flap. Without a `capacity` a server has no queue: a call's time does not
//!   depend on load (the reliability model's assumption: what the balancer changes is *where*
//!   calls go). With one, at most `concurrency` calls are in service and the rest wait in FIFO
//!   order, or all share the server (processor sharing): queueing theory's M/M/1, M/M/c, M/D/1
//!   and the supermarket model come out (see `tests/sim_queues.rs`). Antagonists slow a new
//!   random set of servers each period; a slowdown steps the first servers up for a while.
//! - **Call graph**: a request calls each cluster `calls` times in sequence and succeeds iff
//!   every call does; balancers server-side (one shared per cluster), client-side (one per
//!   client and cluster), or per connection (one per cluster at L4: each client's calls go
//!   over the one connection it opened at the start).
//! - **Balancing and protections** are [`keel_balance`]'s: every call is a
//!   [`keel_balance::Balancer::pick`] at the virtual now and a `finish` with the outcome when it
//!   ends, so in-flight counts, latency estimates and outlier ejection evolve as in the proxy.
//!   Retries go to endpoints the call has not tried (`PickContext::with_avoid`), within a
//!   [`keel_balance::RetryBudget`]; active health checks are periodic probe events that call
//!   `set_healthy`. Hedged requests send a second try to another endpoint when a call has had no
//!   answer after a delay (a fixed one, or a quantile of the first tries' latency); the first
//!   good answer wins and the other try is cancelled.
//! - **Results**: success with its confidence interval, where the focus cluster's calls went,
//!   and the latency of requests (mean, p50, p99, p99.9 from a histogram within 0.4 %).
//!
//! Replications run in parallel (rayon). See [`SimResult::ci95`] for the interval.

mod engine;
pub mod scenario;
mod server;
mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use serde::Serialize;

pub use engine::{
    replication_seed, run_replication, run_replication_with, RepStats, RunOptions, REACTION_BIN,
};
pub use scenario::{
    AntagonistConfig, Arrivals, CapacityConfig, ClusterConfig, ClusterRef, Discipline,
    EndpointConfig, FailedPosition, FailureShare, FleetConfig, HealthCheckConfig, HedgeConfig,
    HedgeDelay, Load, Placement, RetryConfig, Scenario, ScenarioError, ScenarioProblem,
    SharedEvidenceConfig, SimError, SlowdownConfig,
};
pub use stats::LatencyHistogram;

use crate::stats::{student_t95, wilson95};

/// One scenario's results over all its replications.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    /// The scenario's label (what distinguishes it from its siblings).
    pub label: String,
    /// The focus cluster's strategy (the first cluster with failed servers).
    pub strategy: String,
    /// `none`, or the protections in force, e.g. `outlier+retry`.
    pub protections: String,
    /// The focus cluster's failure mode.
    pub failure_mode: String,
    /// `server-side` or `client-side`.
    pub placement: String,
    /// Failed share of the focus cluster's servers.
    pub p: f64,
    /// t_fail / t_ok of the focus cluster when its failure mode fixes it ([`Scenario::q`]).
    pub q: Option<f64>,
    /// Calls a request makes to the focus cluster.
    pub k: u32,
    /// Measured requests over all replications.
    pub requests: u64,
    /// Share of requests that succeeded.
    pub success: f64,
    /// 95 % confidence interval of `success`: the union of a Student-t interval over the
    /// replications' rates (which carries correlation inside a replication: ejection cycles,
    /// lockstep) and a Wilson interval on the pooled counts (which stays honest when every
    /// replication gives the same rate, e.g. 1.0).
    pub ci95: [f64; 2],
    /// Share of the focus cluster's attempts that landed on a server failing at that moment.
    pub failed_pick_share: f64,
    /// The closed form's success for this setup, when one applies (no protections; hang or
    /// fail-fast; a strategy with a closed form). It is the model's prediction, shown even where
    /// the simulation departs from it.
    pub analytic_success: Option<f64>,
    /// Largest share of the focus cluster's attempts that went to one server (1/m when even).
    pub max_server_share: f64,
    /// Retries granted per request.
    pub retries_per_request: f64,
    /// Attempts for which the balancer had no endpoint at all.
    pub no_endpoint: u64,
    /// Mean request latency in milliseconds (virtual time).
    pub mean_latency_ms: f64,
    /// Offered load as a fraction of the focus cluster's capacity (open loop into servers with
    /// a capacity; see [`Scenario::offered_load`]).
    pub load: Option<f64>,
    /// Request latency (queueing, retries, hedges included; failed requests at the time they
    /// failed), in milliseconds.
    pub latency_ms: LatencySummary,
    /// 95 % intervals of `latency_ms`'s quantiles, over the replications (see
    /// [`LatencyIntervals`]).
    pub latency_ci95_ms: LatencyIntervals,
    /// Hedged tries and retries per request: the calls a strategy's protections added.
    pub extra_calls: f64,
    /// Hedged tries sent.
    pub hedges: u64,
    /// Calls whose hedged try answered first.
    pub hedges_won: u64,
    /// With a slowdown on the focus cluster: how the slowed servers' share of calls moved.
    pub reaction: Option<Reaction>,
    /// `(latency in ms, share of requests at or below it)`, for charts.
    #[serde(skip)]
    pub latency_cdf: Vec<(f64, f64)>,
    /// Replications run.
    pub replications: u32,
    /// Calls simulated, warm-up included (for the speed figure).
    #[serde(skip)]
    pub calls_simulated: u64,
    /// Each replication's own latency summary, in order (for paired comparisons of two
    /// scenarios run on common random numbers, replication by replication).
    #[serde(skip)]
    pub replication_latency_ms: Vec<LatencySummary>,
}

/// How long a share must stay across a threshold to count as having crossed it (E9).
pub const REACTION_HOLD: Duration = Duration::from_secs(1);

/// Request latency statistics, in milliseconds. Quantiles come from a log-linear histogram and
/// are within 0.4 % of the exact order statistic; the mean is exact.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LatencySummary {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl LatencySummary {
    /// The summary of a histogram of nanoseconds.
    pub fn of(h: &LatencyHistogram) -> Self {
        Self {
            mean: h.mean_ns() / 1e6,
            p50: h.quantile_ns(0.5) / 1e6,
            p99: h.quantile_ns(0.99) / 1e6,
            p999: h.quantile_ns(0.999) / 1e6,
        }
    }
}

/// 95 % confidence intervals of the request latency quantiles, in milliseconds: a Student-t
/// interval of the mean of the replications' own quantiles (replications are independent, so
/// their quantiles are too), widened where needed to hold the pooled quantile of
/// [`LatencySummary`]. With one replication, the pooled quantile alone.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LatencyIntervals {
    /// Of the median.
    pub p50: [f64; 2],
    /// Of the 99th percentile.
    pub p99: [f64; 2],
    /// Of the 99.9th percentile.
    pub p999: [f64; 2],
}

impl LatencyIntervals {
    /// The intervals from the replications' histograms, around the pooled summary.
    pub fn of(pooled: &LatencySummary, reps: &[&LatencyHistogram]) -> Self {
        let one = |q: f64, point: f64| {
            let xs: Vec<f64> = reps.iter().map(|h| h.quantile_ns(q) / 1e6).collect();
            match student_t95(&xs) {
                Some((lo, hi)) => [lo.min(point).max(0.0), hi.max(point)],
                None => [point, point],
            }
        };
        Self {
            p50: one(0.5, pooled.p50),
            p99: one(0.99, pooled.p99),
            p999: one(0.999, pooled.p999),
        }
    }
}

/// How the balancers moved calls off servers that slowed down for a while and back on when they
/// recovered (experiment E9). Shares are pooled over replications, per [`REACTION_BIN`] of
/// virtual time. A threshold counts as crossed at the first bin after which the share stays
/// across it for [`REACTION_HOLD`] (so that a strategy whose share swings does not cross by
/// chance); times run to the end of that bin, upper bounds at the bins' resolution.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reaction {
    /// The slowed servers' fair share of calls (slowed / servers).
    pub fair_share: f64,
    /// Their share from the end of the warm-up to the step up.
    pub share_before: f64,
    /// Their share while slowed.
    pub share_during: f64,
    /// Their share from the step down to the end of the run.
    pub share_after: f64,
    /// Time from the step up until their share fell below half the fair share, to stay below
    /// for [`REACTION_HOLD`]; `None`: it never did while they were slow.
    pub down_ms: Option<f64>,
    /// Time from the step down until their share was back to half the fair share or more, to
    /// stay there for [`REACTION_HOLD`]; `None`: not within the run (or it never fell).
    pub back_ms: Option<f64>,
    /// `(seconds, share)` per bin, for charts.
    #[serde(skip)]
    pub series: Vec<(f64, f64)>,
}

/// Results of a batch of scenarios, with the simulator's speed.
#[derive(Debug, Clone)]
pub struct BatchReport {
    /// One result per scenario, in order.
    pub results: Vec<SimResult>,
    /// Calls simulated in all.
    pub calls: u64,
    /// Wall time.
    pub wall: Duration,
    /// Worker threads that ran replications.
    pub threads: usize,
    /// CPU time the replications used (summed over threads), where the platform reports it.
    pub cpu: Option<Duration>,
}

impl BatchReport {
    /// Simulated calls per wall-clock second per thread used. On a machine shared with other
    /// work this understates the simulator's speed; see [`Self::calls_per_cpu_second`].
    pub fn calls_per_second(&self) -> f64 {
        self.calls as f64 / self.wall.as_secs_f64().max(1e-9) / self.threads.max(1) as f64
    }

    /// Simulated calls per second of CPU time actually spent, independent of other load.
    pub fn calls_per_cpu_second(&self) -> Option<f64> {
        self.cpu
            .map(|c| self.calls as f64 / c.as_secs_f64().max(1e-9))
    }
}

/// Measured requests a batch will complete (for a progress bar's length).
pub fn total_requests(scenarios: &[Scenario]) -> u64 {
    scenarios
        .iter()
        .map(|s| s.requests * u64::from(s.replications))
        .sum()
}

/// Runs one scenario (its replications in parallel).
pub fn run(scenario: &Scenario) -> Result<SimResult, SimError> {
    Ok(run_batch(std::slice::from_ref(scenario), &|_| {})?
        .results
        .remove(0))
}

/// Runs every replication of every scenario as one parallel job list (so that many small
/// scenarios keep every core busy), then summarises each scenario. `progress` receives counts
/// of completed measured requests, from any thread.
pub fn run_batch(
    scenarios: &[Scenario],
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BatchReport, SimError> {
    run_batch_with(scenarios, RunOptions::default(), progress)
}

/// [`run_batch`] with options (e.g. common random numbers).
pub fn run_batch_with(
    scenarios: &[Scenario],
    options: RunOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<BatchReport, SimError> {
    for (i, s) in scenarios.iter().enumerate() {
        s.validate()
            .map_err(|e| SimError::Invalid(format!("scenario {i} ({}): {e}", s.name)))?;
    }
    let jobs: Vec<(usize, u32)> = scenarios
        .iter()
        .enumerate()
        .flat_map(|(i, s)| (0..s.replications).map(move |r| (i, r)))
        .collect();
    let started = Instant::now();
    let calls = AtomicU64::new(0);
    let cpu_ns = AtomicU64::new(0);
    let reps: Vec<RepStats> = jobs
        .par_iter()
        .map(|&(i, r)| {
            let cpu_start = thread_cpu_ns();
            let st = run_replication_with(&scenarios[i], r, options, progress)?;
            if let (Some(a), Some(b)) = (cpu_start, thread_cpu_ns()) {
                cpu_ns.fetch_add(b.saturating_sub(a), Ordering::Relaxed);
            }
            calls.fetch_add(st.calls, Ordering::Relaxed);
            Ok(st)
        })
        .collect::<Result<_, SimError>>()?;
    let wall = started.elapsed();
    let mut results = Vec::with_capacity(scenarios.len());
    let mut at = 0;
    for s in scenarios {
        let n = s.replications as usize;
        results.push(summarise(s, &reps[at..at + n]));
        at += n;
    }
    Ok(BatchReport {
        results,
        calls: calls.into_inner(),
        wall,
        threads: rayon::current_num_threads().min(jobs.len()).max(1),
        cpu: thread_cpu_ns().map(|_| Duration::from_nanos(cpu_ns.into_inner())),
    })
}

/// CPU time of the calling thread, in nanoseconds.
#[cfg(unix)]
fn thread_cpu_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes to it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

#[cfg(not(unix))]
fn thread_cpu_ns() -> Option<u64> {
    None
}

fn summarise(s: &Scenario, reps: &[RepStats]) -> SimResult {
    let sum = |f: fn(&RepStats) -> u64| reps.iter().map(f).sum::<u64>();
    let requests = sum(|r| r.requests);
    let successes = sum(|r| r.successes);
    let success = successes as f64 / requests.max(1) as f64;
    let rates: Vec<f64> = reps
        .iter()
        .map(|r| r.successes as f64 / r.requests.max(1) as f64)
        .collect();
    let (wl, wh) = wilson95(successes, requests);
    let ci95 = match student_t95(&rates) {
        Some((tl, th)) => [wl.min(tl).max(0.0), wh.max(th).min(1.0)],
        None => [wl, wh],
    };
    let focus = &s.clusters[s.focus()];
    let mut per_server = vec![0u64; focus.servers as usize];
    for r in reps {
        for (a, b) in per_server.iter_mut().zip(&r.focus_picks) {
            *a += b;
        }
    }
    let focus_total: u64 = per_server.iter().sum();
    let mut latency = LatencyHistogram::new();
    for r in reps {
        latency.merge(&r.latency);
    }
    let q = s.q(focus);
    let summary = LatencySummary::of(&latency);
    SimResult {
        label: s.label.clone(),
        strategy: s.strategy().name().to_string(),
        protections: s.protections(),
        failure_mode: focus.failure.name().to_string(),
        placement: match s.placement {
            Placement::ServerSide => "server-side".into(),
            Placement::ClientSide => "client-side".into(),
            Placement::PerConnection => "per-connection".into(),
        },
        p: f64::from(focus.failed) / f64::from(focus.servers),
        q,
        k: focus.calls,
        requests,
        success,
        ci95,
        failed_pick_share: sum(|r| r.failed_picks) as f64 / focus_total.max(1) as f64,
        analytic_success: s.analytic_success(),
        max_server_share: per_server.iter().copied().max().unwrap_or(0) as f64
            / focus_total.max(1) as f64,
        retries_per_request: sum(|r| r.retries) as f64 / requests.max(1) as f64,
        no_endpoint: sum(|r| r.no_endpoint),
        mean_latency_ms: reps.iter().map(|r| r.latency_sum_ns).sum::<u128>() as f64
            / requests.max(1) as f64
            / 1e6,
        load: s.offered_load(),
        latency_ms: summary,
        latency_ci95_ms: LatencyIntervals::of(
            &summary,
            &reps.iter().map(|r| &r.latency).collect::<Vec<_>>(),
        ),
        extra_calls: (sum(|r| r.hedges) + sum(|r| r.retries)) as f64 / requests.max(1) as f64,
        hedges: sum(|r| r.hedges),
        hedges_won: sum(|r| r.hedges_won),
        reaction: reaction(s, reps),
        latency_cdf: latency
            .cdf_ns()
            .into_iter()
            .map(|(v, f)| (v / 1e6, f))
            .collect(),
        replications: s.replications,
        calls_simulated: sum(|r| r.calls),
        replication_latency_ms: reps
            .iter()
            .map(|r| LatencySummary::of(&r.latency))
            .collect(),
    }
}

/// The slowed servers' share of calls over time, and how fast it left and came back.
fn reaction(s: &Scenario, reps: &[RepStats]) -> Option<Reaction> {
    let focus = &s.clusters[s.focus()];
    let step = focus.slowdown.as_ref()?;
    let bins = reps.iter().map(|r| r.reaction_bins.len()).max()?;
    // The last bin is cut short by the end of the run.
    let bins = bins.saturating_sub(1);
    let mut pooled = vec![[0u64; 2]; bins];
    for r in reps {
        for (p, b) in pooled.iter_mut().zip(&r.reaction_bins) {
            p[0] += b[0];
            p[1] += b[1];
        }
    }
    let bin_ns = REACTION_BIN.as_nanos() as u64;
    let start = step.start.as_nanos() as u64;
    let end = step.end.as_nanos() as u64;
    let warmup = s.warmup.as_nanos() as u64;
    let fair = f64::from(step.servers) / f64::from(focus.servers);
    let share = |lo: u64, hi: u64| {
        let (mut a, mut n) = (0, 0);
        for (i, p) in pooled.iter().enumerate() {
            let t = i as u64 * bin_ns;
            if t >= lo && t + bin_ns <= hi {
                a += p[0];
                n += p[1];
            }
        }
        a as f64 / n.max(1) as f64
    };
    let bin_share = |p: &[u64; 2]| p[0] as f64 / p[1].max(1) as f64;
    // The first bin from `from` on after which the share stays on the far side of half the
    // fair share for `REACTION_HOLD` (or to the end of the run), as a time since `from`.
    let hold = (REACTION_HOLD.as_nanos() as u64 / bin_ns).max(1) as usize;
    let first = |from: u64, below: bool| {
        let crossed = |p: &[u64; 2]| p[1] > 0 && (bin_share(p) < fair / 2.0) == below;
        (0..pooled.len()).find_map(|i| {
            let t = i as u64 * bin_ns;
            let run = &pooled[i..(i + hold).min(pooled.len())];
            (t >= from && run.iter().all(crossed)).then(|| (t + bin_ns - from) as f64 / 1e6)
        })
    };
    let down_ms = first(start, true).filter(|&d| (d * 1e6) as u64 + start <= end);
    let back_ms = down_ms.and_then(|_| first(end, false));
    Some(Reaction {
        fair_share: fair,
        share_before: share(warmup, start),
        share_during: share(start, end),
        share_after: share(end, bins as u64 * bin_ns),
        down_ms,
        back_ms,
        series: pooled
            .iter()
            .enumerate()
            .map(|(i, p)| ((i as f64 + 0.5) * bin_ns as f64 / 1e9, bin_share(p)))
            .collect(),
    })
}
