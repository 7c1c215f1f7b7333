//! E8's and E9's rows: a run and its simulation (and, for random placement, queueing theory)
//! compared quantile by quantile by the lab's rule, the slowed server's share of calls in the
//! simulator's terms, and the sentences on each row.

use std::fmt::Write as _;
use std::time::Duration;

use keel_balance::StrategyKind;
use keel_model::sim::{self, Reaction, SimResult};
use keel_model::stats::{student_t95, Z95};
use serde::Serialize;

use crate::lab::compare::{side_se, z_score, Comparison};
use crate::lab::queueing::{mm1_quantile, Mg1};
use crate::lab::tail::{nearest_rank, Served, Step, TailCase, TailMeasured};

/// The quantiles every latency row compares.
pub const QUANTILES: [f64; 3] = [0.5, 0.99, 0.999];

/// Mean and quantiles, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Quant {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
}

impl Quant {
    /// The value at QUANTILES[i].
    pub fn at(&self, i: usize) -> f64 {
        [self.p50, self.p99, self.p999][i]
    }
}

/// 95 % intervals of p50, p99 and p99.9, ms.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Intervals {
    /// Of the median.
    pub p50: [f64; 2],
    /// Of the 99th percentile.
    pub p99: [f64; 2],
    /// Of the 99.9th percentile.
    pub p999: [f64; 2],
}

impl Intervals {
    /// The interval of QUANTILES[i].
    pub fn at(&self, i: usize) -> [f64; 2] {
        [self.p50, self.p99, self.p999][i]
    }
}

/// One quantile three ways.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct QuantileComparison {
    /// 0.5, 0.99 or 0.999.
    pub quantile: f64,
    /// Measured against the simulation (the lab's rule: within 1.96 standard errors of the
    /// difference).
    pub simulation: Comparison,
    /// Measured against the closed form (inside the measured 95 % interval); null without one.
    pub model: Option<Comparison>,
}

/// `(latency ms, nines = -log10(1 - F))` points of a distribution, for charts.
pub type Nines = Vec<(f64, f64)>;

/// One E8 row: a strategy's latency measured, simulated and (random) from queueing theory.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRow {
    /// `e8`.
    pub experiment: String,
    /// Strategy.
    pub strategy: String,
    /// `client-side`.
    pub placement: String,
    /// Clients, each with its own balancer.
    pub clients: u32,
    /// Backends.
    pub servers: u32,
    /// Calls each works on at once.
    pub concurrency: u32,
    /// Offered load asked for (at the nominal service time).
    pub load_asked: f64,
    /// Offered load the run really offered: measured rate x measured service / capacity.
    pub load_offered: f64,
    /// Measured arrivals per second.
    pub rate: f64,
    /// Measured requests.
    pub requests: u64,
    /// Of which answered 2xx.
    pub succeeded: u64,
    /// Of which timed out.
    pub timeouts: u64,
    /// The service time asked for, ms (mean).
    pub asked_ms: f64,
    /// What the backends served.
    pub served_ms: Served,
    /// Loopback round trip of a request that takes no work, ms (added to simulated and model
    /// latencies).
    pub round_trip_ms: f64,
    /// Median latency of the clients' load probes, ms (prequal; the simulation's probe delay).
    pub probe_ms: Option<f64>,
    /// 99th percentile of how late arrivals were sent against their schedule, ms.
    pub send_lag_p99_ms: f64,
    /// The latest an arrival was sent against its schedule, ms: the longest the load
    /// generator was held up (other work on the machine), which the backends felt too.
    pub send_lag_max_ms: f64,
    /// Measured latency.
    pub measured: Quant,
    /// Its 95 % intervals: 10 batches in arrival order, Student-t over the batches' quantiles
    /// widened for their autocorrelation, around the run's own quantile.
    pub measured_ci95: Intervals,
    /// The lag-1 autocorrelation of the batches' mean latencies, which widens the measured
    /// intervals by sqrt((1 + r1) / (1 - r1)).
    pub batch_autocorrelation: f64,
    /// Simulated latency (the run's twin), round trip added.
    pub simulated: Quant,
    /// Its 95 % intervals: Student-t over the replications' quantiles, centred on the pooled
    /// quantile with the larger of the two halves on both sides.
    pub simulated_ci95: Intervals,
    /// Simulated success.
    pub simulated_success: f64,
    /// Queueing theory, round trip added; null without a closed form.
    pub model: Option<Quant>,
    /// Which closed form.
    pub model_name: Option<String>,
    /// Pollaczek-Khinchine's mean sojourn for the measured service times and rate, round trip
    /// added (the closed form's mean, exactly), ms.
    pub model_pk_mean: Option<f64>,
    /// M/M/1 at the measured mean service time and load (random only), ms.
    pub mm1: Option<Quant>,
    /// p50, p99 and p99.9 compared.
    pub comparisons: Vec<QuantileComparison>,
    /// Every simulation comparison agrees.
    pub agrees_with_simulation: bool,
    /// Every model comparison agrees (null without a model).
    pub agrees_with_model: Option<bool>,
    /// Sentences on the row, from its numbers.
    pub explanation: String,
    /// Null without a departure; true when every quantile that departs (from the simulation
    /// or the closed form) lies above it by no more than a machine stall explains (see
    /// [`LatencyRow::stall_explains`]), false otherwise.
    pub explained: Option<bool>,
    /// Measured distribution, for the chart.
    pub measured_cdf: Nines,
    /// Simulated distribution.
    pub simulated_cdf: Nines,
    /// Closed form's distribution.
    pub model_cdf: Nines,
    /// Wall time of the measurement, s.
    pub seconds: f64,
}

/// The nines at which CDF charts are drawn: 0 to 3.3 in steps of 0.02.
fn nines() -> impl Iterator<Item = (f64, f64)> {
    (0..=165).map(|i| {
        let n = f64::from(i) * 0.02;
        (n, 1.0 - 10f64.powf(-n))
    })
}

fn cdf_of_sorted(sorted: &[f64]) -> Nines {
    if sorted.is_empty() {
        return Vec::new();
    }
    nines()
        .filter(|(_, f)| (f * sorted.len() as f64) < sorted.len() as f64 - 0.5)
        .map(|(n, f)| (nearest_rank(sorted, f), n))
        .collect()
}

fn compare_sim(m: f64, m_ci: [f64; 2], s: f64, s_ci: [f64; 2]) -> Comparison {
    let se_m = side_se(m, m_ci, s);
    let se_s = side_se(s, s_ci, m);
    let z = z_score(m, s, (se_m * se_m + se_s * se_s).sqrt());
    Comparison {
        agrees: z.abs() <= Z95,
        z,
    }
}

fn compare_model(m: f64, m_ci: [f64; 2], a: f64) -> Comparison {
    Comparison {
        agrees: (m_ci[0]..=m_ci[1]).contains(&a),
        z: z_score(m, a, side_se(m, m_ci, a)),
    }
}

/// Batches of the measured intervals.
const BATCHES: usize = 10;

/// The first-order autocorrelation of consecutive batch values, each group (a window) around
/// its own mean, clamped to [0, 0.9]: consecutive batches of a queue, or of a balancer that
/// herds, are not independent, and their standard error grows by sqrt((1 + r1) / (1 - r1)).
fn lag1(groups: &[Vec<f64>]) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for g in groups {
        if g.len() < 2 {
            continue;
        }
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let d: Vec<f64> = g.iter().map(|x| x - mean).collect();
        num += d.windows(2).map(|w| w[0] * w[1]).sum::<f64>();
        den += d.iter().map(|x| x * x).sum::<f64>();
    }
    if den > 0.0 {
        (num / den).clamp(0.0, 0.9)
    } else {
        0.0
    }
}

fn inflation(r1: f64) -> f64 {
    ((1.0 + r1) / (1.0 - r1)).sqrt()
}

/// The 95 % interval of a quantile from its batches' values: Student-t's half width over the
/// batches, widened for their autocorrelation `r1`, around the whole run's value `point`.
fn batch_interval(point: f64, batches: &[f64], r1: f64) -> [f64; 2] {
    match student_t95(batches) {
        Some((lo, hi)) => {
            let half = (hi - lo) / 2.0 * inflation(r1);
            [(point - half).max(0.0), point + half]
        }
        None => [point, point],
    }
}

/// E8's row from a run and its simulation.
pub fn latency_row(case: &TailCase, m: &TailMeasured, sim: &SimResult) -> LatencyRow {
    let r = &m.report;
    let rtt = m.rtt_ms;
    let capacity = f64::from(case.servers * case.concurrency);
    let load_offered = m.rate * m.served.mean / 1e3 / capacity;
    let measured = Quant {
        mean: r.latency.mean,
        p50: r.latency.p50,
        p99: r.latency.p99,
        p999: r.latency.p999,
    };
    // Batch means: the measured arrivals in arrival order in 10 batches, each batch's
    // quantile; the interval is centred on the whole run's quantile.
    let in_order: Vec<f64> = r
        .records
        .iter()
        .filter(|x| x.measured)
        .map(|x| x.latency_ms)
        .collect();
    let per = (in_order.len() / BATCHES).max(1);
    let batches: Vec<Vec<f64>> = in_order
        .chunks(per)
        .take(BATCHES)
        .map(|c| {
            let mut v = c.to_vec();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let batch_q = |q: f64| -> Vec<f64> { batches.iter().map(|b| nearest_rank(b, q)).collect() };
    let (b50, b99, b999) = (batch_q(0.5), batch_q(0.99), batch_q(0.999));
    // How correlated consecutive batches are, from their mean latency (the steadiest of
    // their statistics; the same queue lengths move all three quantiles).
    let means: Vec<f64> = batches
        .iter()
        .map(|b| b.iter().sum::<f64>() / b.len().max(1) as f64)
        .collect();
    let r1 = lag1(std::slice::from_ref(&means));
    let measured_ci95 = Intervals {
        p50: batch_interval(measured.p50, &b50, r1),
        p99: batch_interval(measured.p99, &b99, r1),
        p999: batch_interval(measured.p999, &b999, r1),
    };
    let l = &sim.latency_ms;
    let simulated = Quant {
        mean: l.mean + rtt,
        p50: l.p50 + rtt,
        p99: l.p99 + rtt,
        p999: l.p999 + rtt,
    };
    // The simulator's intervals are Student-t over the replications' quantiles, widened to
    // hold the pooled one, which can leave one side without width: centred on the pooled
    // quantile here, with the larger of its two halves on both sides.
    let c = &sim.latency_ci95_ms;
    let centred = |ci: [f64; 2], point: f64| {
        let half = (ci[1] - point).max(point - ci[0]).max(0.0);
        [(point - half).max(0.0) + rtt, point + half + rtt]
    };
    let simulated_ci95 = Intervals {
        p50: centred(c.p50, l.p50),
        p99: centred(c.p99, l.p99),
        p999: centred(c.p999, l.p999),
    };
    // Random onto FIFO servers serving one call at a time: M/G/1 per server.
    let mg1 = (case.strategy == StrategyKind::Random && case.concurrency == 1)
        .then(|| Mg1::new(&m.served_sample, m.rate / 1e3 / f64::from(case.servers)))
        .flatten();
    let model = mg1.as_ref().and_then(|q| {
        Some(Quant {
            mean: q.mean + rtt,
            p50: q.quantile(0.5)? + rtt,
            p99: q.quantile(0.99)? + rtt,
            p999: q.quantile(0.999)? + rtt,
        })
    });
    let mm1 = mg1.as_ref().map(|q| Quant {
        mean: q.service_mean / (1.0 - q.rho) + rtt,
        p50: mm1_quantile(q.service_mean, q.rho, 0.5) + rtt,
        p99: mm1_quantile(q.service_mean, q.rho, 0.99) + rtt,
        p999: mm1_quantile(q.service_mean, q.rho, 0.999) + rtt,
    });
    let comparisons: Vec<QuantileComparison> = QUANTILES
        .iter()
        .enumerate()
        .map(|(i, &q)| QuantileComparison {
            quantile: q,
            simulation: compare_sim(
                measured.at(i),
                measured_ci95.at(i),
                simulated.at(i),
                simulated_ci95.at(i),
            ),
            model: model.map(|a| compare_model(measured.at(i), measured_ci95.at(i), a.at(i))),
        })
        .collect();
    let mut sorted: Vec<f64> = r
        .records
        .iter()
        .filter(|x| x.measured)
        .map(|x| x.latency_ms)
        .collect();
    sorted.sort_by(f64::total_cmp);
    let simulated_cdf: Nines = nines()
        .filter_map(|(n, f)| {
            let (ms, _) = sim.latency_cdf.iter().find(|(_, c)| *c >= f)?;
            Some((ms + rtt, n))
        })
        .collect();
    let model_cdf: Nines = mg1
        .as_ref()
        .map(|q| {
            nines()
                .filter_map(|(n, f)| Some((q.quantile(f)? + rtt, n)))
                .collect()
        })
        .unwrap_or_default();
    let mut row = LatencyRow {
        experiment: case.experiment.into(),
        strategy: case.strategy.name().into(),
        placement: "client-side".into(),
        clients: case.clients,
        servers: case.servers,
        concurrency: case.concurrency,
        load_asked: case.load,
        load_offered,
        rate: m.rate,
        requests: r.requests,
        succeeded: r.succeeded,
        timeouts: r.timeouts,
        asked_ms: case.service.mean.as_secs_f64() * 1e3,
        served_ms: m.served,
        round_trip_ms: rtt,
        probe_ms: (r.probes.count > 0).then_some(r.probes.p50),
        send_lag_p99_ms: r.lag.p99,
        send_lag_max_ms: r.lag.max,
        measured,
        measured_ci95,
        batch_autocorrelation: r1,
        simulated,
        simulated_ci95,
        simulated_success: sim.success,
        model,
        model_name: model
            .map(|_| "M/G/1 per server (Pollaczek-Khinchine) on the measured service times".into()),
        model_pk_mean: mg1.as_ref().map(|q| q.pk_mean + rtt),
        mm1,
        agrees_with_simulation: comparisons.iter().all(|c| c.simulation.agrees),
        agrees_with_model: model.map(|_| {
            comparisons
                .iter()
                .all(|c| c.model.is_some_and(|m| m.agrees))
        }),
        comparisons,
        explanation: String::new(),
        explained: None,
        measured_cdf: cdf_of_sorted(&sorted),
        simulated_cdf,
        model_cdf,
        seconds: m.seconds,
    };
    row.explained = row.departs().then(|| row.stall_explains());
    row.explanation = explain_latency(&row);
    row
}

impl LatencyRow {
    /// Whether any quantile departs from the simulation or the closed form.
    fn departs(&self) -> bool {
        !self.agrees_with_simulation || self.agrees_with_model == Some(false)
    }

    /// The longest a stall of the machine can lengthen a latency: an arrival due during a
    /// stall of T waits up to T, and the queues the stall leaves drain at the spare capacity
    /// alone, about T rho / (1 - rho) more; T is the latest the load generator sent an arrival.
    fn stall_bound_ms(&self) -> f64 {
        let rho = self.load_offered.clamp(0.0, 0.99);
        self.send_lag_max_ms / (1.0 - rho)
    }

    /// Machine stall (queueing after a stall): applies when every departing quantile is above
    /// what it is compared with (a stall only lengthens latency) by no more than
    /// [`Self::stall_bound_ms`].
    fn stall_explains(&self) -> bool {
        let bound = self.stall_bound_ms();
        self.comparisons.iter().enumerate().all(|(i, c)| {
            let m = self.measured.at(i);
            let sim_ok = c.simulation.agrees || (0.0..=bound).contains(&(m - self.simulated.at(i)));
            let model_ok = match (c.model, self.model) {
                (Some(x), Some(model)) if !x.agrees => (0.0..=bound).contains(&(m - model.at(i))),
                _ => true,
            };
            sim_ok && model_ok
        })
    }

    /// The table's verdict: a CSS class (`ok`, `explained`, `model-off`, `off`) and the words.
    pub(crate) fn verdict(&self) -> (&'static str, String) {
        let differing = self
            .comparisons
            .iter()
            .filter(|c| !c.simulation.agrees)
            .count();
        match (self.agrees_with_simulation, self.agrees_with_model) {
            (true, Some(true)) => ("ok", "agrees with the simulation and the model".into()),
            (true, None) => ("ok", "agrees with the simulation (no closed form)".into()),
            _ if self.explained == Some(true) => (
                "explained",
                format!(
                    "explained: machine stall (an arrival sent {:.0} ms late; it can lengthen \
                     latency by up to {:.0} ms)",
                    self.send_lag_max_ms,
                    self.stall_bound_ms()
                ),
            ),
            (true, Some(false)) => (
                "model-off",
                "not explained, mechanism unknown: agrees with the simulation; the model misses".into(),
            ),
            (false, m) => (
                "off",
                format!(
                    "not explained, mechanism unknown: {differing} of 3 quantiles differ from the simulation{}",
                    match m {
                        Some(true) => "; the model agrees",
                        Some(false) => "; the model misses",
                        None => "",
                    }
                ),
            ),
        }
    }
}

impl ReactionRow {
    /// The table's verdict: `ok` when the shares while slow and after agree with the
    /// simulation, else `off` (no mechanism for E9's departures is named).
    pub(crate) fn verdict(&self) -> (&'static str, String) {
        if self.during.agrees && self.after.agrees {
            ("ok", "shares agree with the simulation".into())
        } else {
            (
                "off",
                format!(
                    "not explained, mechanism unknown: share while slow {:+.1} SE, after {:+.1} SE",
                    self.during.z, self.after.z
                ),
            )
        }
    }
}

fn q_name(q: f64) -> &'static str {
    if q == 0.5 {
        "p50"
    } else if q == 0.99 {
        "p99"
    } else {
        "p99.9"
    }
}

fn se_words(z: f64) -> String {
    if z.is_infinite() {
        "an interval of no width".into()
    } else {
        format!("{:.1} standard errors", z.abs())
    }
}

/// Sentences on an E8 row: what was served and offered, and each departure with its size.
fn explain_latency(r: &LatencyRow) -> String {
    let mut s = format!(
        "Served {:.2} ms on average for {:.0} ms asked (SCV {:.2}; exponential: 1), so the \
         offered load was {:.3} for {:.2} asked; {} requests, {} timed out.",
        r.served_ms.mean,
        r.asked_ms,
        r.served_ms.scv,
        r.load_offered,
        r.load_asked,
        r.requests,
        r.timeouts
    );
    let off: Vec<String> = r
        .comparisons
        .iter()
        .filter(|c| !c.simulation.agrees)
        .map(|c| {
            format!(
                "{} ({} {})",
                q_name(c.quantile),
                se_words(c.simulation.z),
                if c.simulation.z > 0.0 {
                    "above"
                } else {
                    "below"
                }
            )
        })
        .collect();
    let pct = |i: usize| (r.measured.at(i) / r.simulated.at(i) - 1.0) * 100.0;
    let _ = write!(
        s,
        " Measured p50 / p99 / p99.9 {:.1} / {:.1} / {:.1} ms, simulated {:.1} / {:.1} / {:.1} \
         ({:+.1} %, {:+.1} %, {:+.1} %).",
        r.measured.p50,
        r.measured.p99,
        r.measured.p999,
        r.simulated.p50,
        r.simulated.p99,
        r.simulated.p999,
        pct(0),
        pct(1),
        pct(2)
    );
    if off.is_empty() {
        s.push_str(" All three agree with the simulation.");
    } else {
        s.push_str(&format!(
            " Differs from the simulation at {}.",
            off.join(", ")
        ));
        if r.send_lag_max_ms > 50.0 {
            // Arrivals due during a stall go out together when it ends, and the queues they
            // build drain at the spare capacity alone.
            let rho = r.load_offered.min(0.99);
            let _ = write!(
                s,
                " The machine stalled: the load generator sent an arrival {:.0} ms late (1 % \
                 more than {:.1} ms late), and the backends' timers were held up with it (they \
                 served {:.2} ms for 10). The arrivals of a stall go out together when it \
                 ends, and at load {:.2} the queues they build drain at the {:.0} % of \
                 capacity left: a stall of T costs about T rho / (1 - rho) = {:.0} ms of \
                 longer queues, which the simulation, whose servers never stall, does not \
                 have.",
                r.send_lag_max_ms,
                r.send_lag_p99_ms,
                r.served_ms.mean,
                rho,
                (1.0 - rho) * 100.0,
                r.send_lag_max_ms * rho / (1.0 - rho)
            );
        }
    }
    if let Some(mm1) = &r.mm1 {
        let _ = write!(
            s,
            " M/M/1 at the measured mean service time and load: p50 {:.1}, p99 {:.1}, p99.9 \
             {:.1} ms.",
            mm1.p50, mm1.p99, mm1.p999
        );
    }
    if let (Some(m), Some(name)) = (&r.model, &r.model_name) {
        let off: Vec<String> = r
            .comparisons
            .iter()
            .enumerate()
            .filter(|(_, c)| c.model.is_some_and(|x| !x.agrees))
            .map(|(i, c)| {
                format!(
                    "{} {:.1} ms outside [{:.1}, {:.1}]",
                    q_name(c.quantile),
                    m.at(i),
                    r.measured_ci95.at(i)[0],
                    r.measured_ci95.at(i)[1]
                )
            })
            .collect();
        if off.is_empty() {
            s.push_str(&format!(
                " {name}: p50 {:.1}, p99 {:.1}, p99.9 {:.1} ms, each inside the measured \
                 interval.",
                m.p50, m.p99, m.p999
            ));
        } else {
            s.push_str(&format!(
                " {name}: p50 {:.1}, p99 {:.1}, p99.9 {:.1} ms; {}.",
                m.p50,
                m.p99,
                m.p999,
                off.join(", ")
            ));
        }
    }
    s
}

/// Share of calls to the slowed servers: before, during and after the step, and when it
/// crossed half its fair share (the simulator's definition: [`sim::REACTION_BIN`] bins, a
/// crossing holds for [`sim::REACTION_HOLD`]).
#[derive(Debug, Clone, Serialize)]
pub struct ReactionSummary {
    /// Share from the end of the warm-up to the step up.
    pub share_before: f64,
    /// Share while slowed.
    pub share_during: f64,
    /// Share from the step down to the end.
    pub share_after: f64,
    /// Time from the step up until the share fell below half the fair share for good.
    pub down_ms: Option<f64>,
    /// Time from the step down until it was back to half the fair share or more for good.
    pub back_ms: Option<f64>,
    /// p99 of request latency, ms.
    pub p99_ms: f64,
    /// Share of requests that succeeded.
    pub success: f64,
}

/// One E9 row: the slowed server's share of calls, measured and simulated.
#[derive(Debug, Clone, Serialize)]
pub struct ReactionRow {
    /// `e9`.
    pub experiment: String,
    /// Strategy.
    pub strategy: String,
    /// `client-side`.
    pub placement: String,
    /// Clients, each with its own balancer.
    pub clients: u32,
    /// Backends.
    pub servers: u32,
    /// Calls each works on at once.
    pub concurrency: u32,
    /// Offered load asked for.
    pub load_asked: f64,
    /// Offered load the run really offered (the servers at normal speed).
    pub load_offered: f64,
    /// Measured arrivals per second.
    pub rate: f64,
    /// The step.
    pub step: Step,
    /// The slowed servers' fair share of calls.
    pub fair_share: f64,
    /// What the servers served at normal speed.
    pub served_ms: Served,
    /// What the slowed server served while slow (calls whose service started in the step,
    /// answered within half the timeout).
    pub slowed_served_ms: Served,
    /// 99th percentile of how late arrivals were sent against their schedule, ms.
    pub send_lag_p99_ms: f64,
    /// The latest an arrival was sent against its schedule, ms.
    pub send_lag_max_ms: f64,
    /// Measured requests.
    pub requests: u64,
    /// Measured.
    pub measured: ReactionSummary,
    /// Simulated (the run's twin).
    pub simulated: ReactionSummary,
    /// Share while slowed, measured against simulated (standard errors from 1 s batches).
    pub during: Comparison,
    /// Share after the step, likewise.
    pub after: Comparison,
    /// Lag-1 autocorrelation of the 1 s batches, measured and simulated (their standard
    /// errors are widened by sqrt((1 + r1) / (1 - r1))).
    pub batch_autocorrelation: [f64; 2],
    /// Sentences on the row.
    pub explanation: String,
    /// `(seconds, share)` per 250 ms, measured.
    pub measured_series: Vec<(f64, f64)>,
    /// The same, simulated (replications pooled).
    pub simulated_series: Vec<(f64, f64)>,
    /// Wall time of the measurement, s.
    pub seconds: f64,
}

/// Bins of [`sim::REACTION_BIN`]: (calls to the slowed servers, calls) by arrival time.
fn bins(m: &TailMeasured, slowed: usize) -> Vec<[u64; 2]> {
    let bin_ms = sim::REACTION_BIN.as_secs_f64() * 1e3;
    let mut out: Vec<[u64; 2]> = Vec::new();
    for r in &m.report.records {
        let Some(t) = r.target else { continue };
        let b = (r.due_ms / bin_ms) as usize;
        if out.len() <= b {
            out.resize(b + 1, [0, 0]);
        }
        out[b][1] += 1;
        if t < slowed {
            out[b][0] += 1;
        }
    }
    out
}

/// The simulator's reaction summary of measured bins (the same rule as keel-model's).
fn reaction_of(
    pooled: &[[u64; 2]],
    fair: f64,
    warmup: Duration,
    step: &Step,
    end_ms: f64,
) -> Reaction {
    let bin = sim::REACTION_BIN.as_secs_f64() * 1e3;
    // The last bin is cut short by the end of the run.
    let n = pooled.len().min((end_ms / bin) as usize);
    let pooled = &pooled[..n];
    let start = step.start.as_secs_f64() * 1e3;
    let end = step.end.as_secs_f64() * 1e3;
    let warm = warmup.as_secs_f64() * 1e3;
    let share = |lo: f64, hi: f64| {
        let (mut a, mut c) = (0u64, 0u64);
        for (i, p) in pooled.iter().enumerate() {
            let t = i as f64 * bin;
            if t >= lo - 1e-9 && t + bin <= hi + 1e-9 {
                a += p[0];
                c += p[1];
            }
        }
        a as f64 / c.max(1) as f64
    };
    let bin_share = |p: &[u64; 2]| p[0] as f64 / p[1].max(1) as f64;
    let hold = ((sim::REACTION_HOLD.as_secs_f64() * 1e3 / bin).round() as usize).max(1);
    let first = |from: f64, below: bool| {
        let crossed = |p: &[u64; 2]| p[1] > 0 && (bin_share(p) < fair / 2.0) == below;
        (0..pooled.len()).find_map(|i| {
            let t = i as f64 * bin;
            let run = &pooled[i..(i + hold).min(pooled.len())];
            (t >= from - 1e-9 && run.iter().all(crossed)).then_some(t + bin - from)
        })
    };
    let down_ms = first(start, true).filter(|&d| d + start <= end);
    let back_ms = down_ms.and_then(|_| first(end, false));
    Reaction {
        fair_share: fair,
        share_before: share(warm, start),
        share_during: share(start, end),
        share_after: share(end, n as f64 * bin),
        down_ms,
        back_ms,
        series: pooled
            .iter()
            .enumerate()
            .map(|(i, p)| ((i as f64 + 0.5) * bin / 1e3, bin_share(p)))
            .collect(),
    }
}

/// The 1 s batch means of `series` (per-bin shares at their centres, s) within a window.
fn window_batches(series: &[(f64, f64)], lo_s: f64, hi_s: f64) -> Vec<f64> {
    let mut batches: Vec<Vec<f64>> = Vec::new();
    for &(t, s) in series {
        if t < lo_s || t >= hi_s {
            continue;
        }
        let b = (t - lo_s).floor() as usize;
        if batches.len() <= b {
            batches.resize(b + 1, Vec::new());
        }
        batches[b].push(s);
    }
    batches
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| b.iter().sum::<f64>() / b.len() as f64)
        .collect()
}

/// Mean of batch means and its standard error, widened for their autocorrelation `r1`.
fn mean_se(batches: &[f64], r1: f64) -> (f64, f64) {
    if batches.is_empty() {
        return (0.0, 0.0);
    }
    let n = batches.len() as f64;
    let mean = batches.iter().sum::<f64>() / n;
    if batches.len() < 2 {
        return (mean, 0.0);
    }
    let var = batches.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, (var / n).sqrt() * inflation(r1))
}

/// Batches of the three windows (before, while slow, after) and their autocorrelation.
fn windows(series: &[(f64, f64)], warmup: f64, a: f64, b: f64, end: f64) -> ([Vec<f64>; 3], f64) {
    let w = [
        window_batches(series, warmup, a),
        window_batches(series, a, b),
        window_batches(series, b, end),
    ];
    let r1 = lag1(&w);
    (w, r1)
}

fn compare_shares(m: (f64, f64), s: (f64, f64)) -> Comparison {
    let z = z_score(m.0, s.0, (m.1 * m.1 + s.1 * s.1).sqrt());
    Comparison {
        agrees: z.abs() <= Z95,
        z,
    }
}

/// Re-bins a per-bin share series to `width_s` (the mean of the bins' shares).
fn rebin(series: &[(f64, f64)], width_s: f64) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64, u32)> = Vec::new();
    for &(t, s) in series {
        let b = (t / width_s).floor() as usize;
        if out.len() <= b {
            out.resize(b + 1, (0.0, 0.0, 0));
        }
        out[b].1 += s;
        out[b].2 += 1;
    }
    out.iter()
        .enumerate()
        .filter(|(_, x)| x.2 > 0)
        .map(|(i, x)| ((i as f64 + 0.5) * width_s, x.1 / f64::from(x.2)))
        .collect()
}

/// E9's row from a run and its simulation.
pub fn reaction_row(case: &TailCase, m: &TailMeasured, sim: &SimResult) -> ReactionRow {
    let step = case.step.expect("an E9 case has a step");
    let fair = f64::from(step.servers) / f64::from(case.servers);
    let end_ms = (case.warmup + case.measured).as_secs_f64() * 1e3;
    let measured = reaction_of(
        &bins(m, step.servers as usize),
        fair,
        case.warmup,
        &step,
        end_ms,
    );
    let fallback = Reaction {
        fair_share: fair,
        share_before: f64::NAN,
        share_during: f64::NAN,
        share_after: f64::NAN,
        down_ms: None,
        back_ms: None,
        series: Vec::new(),
    };
    let simulated = sim.reaction.clone().unwrap_or(fallback);
    let (a, b) = (step.start.as_secs_f64(), step.end.as_secs_f64());
    let end_s = end_ms / 1e3;
    let warm = case.warmup.as_secs_f64();
    let (wm, rm) = windows(&measured.series, warm, a, b, end_s);
    let (ws, rs) = windows(&simulated.series, warm, a, b, end_s);
    let during = compare_shares(mean_se(&wm[1], rm), mean_se(&ws[1], rs));
    let after = compare_shares(mean_se(&wm[2], rm), mean_se(&ws[2], rs));
    let r = &m.report;
    let summary = |x: &Reaction, p99: f64, success: f64| ReactionSummary {
        share_before: x.share_before,
        share_during: x.share_during,
        share_after: x.share_after,
        down_ms: x.down_ms,
        back_ms: x.back_ms,
        p99_ms: p99,
        success,
    };
    let capacity = f64::from(case.servers * case.concurrency);
    let mut row = ReactionRow {
        experiment: case.experiment.into(),
        strategy: case.strategy.name().into(),
        placement: "client-side".into(),
        clients: case.clients,
        servers: case.servers,
        concurrency: case.concurrency,
        load_asked: case.load,
        load_offered: m.rate * m.served.mean / 1e3 / capacity,
        rate: m.rate,
        step,
        fair_share: fair,
        served_ms: m.served,
        slowed_served_ms: m.slowed.unwrap_or_default(),
        send_lag_p99_ms: r.lag.p99,
        send_lag_max_ms: r.lag.max,
        requests: r.requests,
        measured: summary(
            &measured,
            r.latency.p99,
            r.succeeded as f64 / r.requests.max(1) as f64,
        ),
        simulated: summary(&simulated, sim.latency_ms.p99 + m.rtt_ms, sim.success),
        during,
        after,
        batch_autocorrelation: [rm, rs],
        explanation: String::new(),
        measured_series: rebin(&measured.series, 0.25),
        simulated_series: rebin(&simulated.series, 0.25),
        seconds: m.seconds,
    };
    row.explanation = explain_reaction(&row);
    row
}

fn ms_or(x: Option<f64>, none: &str) -> String {
    x.map_or(none.to_string(), |v| format!("{v:.0} ms"))
}

fn explain_reaction(r: &ReactionRow) -> String {
    let m = &r.measured;
    let s = &r.simulated;
    let mut out = format!(
        "The slowed server served {:.1} ms on average while slow ({:.1}x the others' {:.2} \
         ms, over {} answered calls). Its share of calls: {:.3} before, {:.3} while slow, {:.3} after (simulated \
         {:.3}, {:.3}, {:.3}); below half its fair share after {} (simulated {}), back after \
         {} (simulated {}).",
        r.slowed_served_ms.mean,
        r.slowed_served_ms.mean / r.served_ms.mean.max(1e-9),
        r.served_ms.mean,
        r.slowed_served_ms.count,
        m.share_before,
        m.share_during,
        m.share_after,
        s.share_before,
        s.share_during,
        s.share_after,
        ms_or(m.down_ms, "never"),
        ms_or(s.down_ms, "never"),
        ms_or(m.back_ms, "-"),
        ms_or(s.back_ms, "-"),
    );
    for (name, c, mv, sv) in [
        ("while slow", r.during, m.share_during, s.share_during),
        ("after", r.after, m.share_after, s.share_after),
    ] {
        if !c.agrees {
            out.push_str(&format!(
                " The share {name} differs from the simulation by {:+.3} ({}).",
                mv - sv,
                se_words(c.z)
            ));
        }
    }
    if r.during.agrees && r.after.agrees {
        out.push_str(" The shares while slow and after agree with the simulation.");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaction_rule_is_the_simulators() {
        // 10 bins per second, fair share 0.1; the share drops at 2 s and is back at 4 s.
        let step = Step {
            factor: 5.0,
            servers: 1,
            start: Duration::from_secs(2),
            end: Duration::from_secs(4),
        };
        let pooled: Vec<[u64; 2]> = (0..70)
            .map(|i| {
                if (20..40).contains(&i) {
                    [0, 100]
                } else {
                    [10, 100]
                }
            })
            .collect();
        let r = reaction_of(&pooled, 0.1, Duration::ZERO, &step, 7000.0);
        assert_eq!(r.share_before, 0.1);
        assert_eq!(r.share_during, 0.0);
        assert_eq!(r.share_after, 0.1);
        assert_eq!(r.down_ms, Some(100.0));
        assert_eq!(r.back_ms, Some(100.0));
        let (w, r1) = windows(&r.series, 0.0, 2.0, 4.0, 7.0);
        assert_eq!(w.each_ref().map(|b| b.len()), [2, 2, 3]);
        assert_eq!(r1, 0.0);
        assert_eq!(mean_se(&w[1], r1), (0.0, 0.0));
        // Batches that drift are correlated: the standard error grows.
        let drift = [vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]];
        let r1 = lag1(&drift);
        assert!(r1 > 0.4, "{r1}");
        assert!(mean_se(&drift[0], r1).1 > 1.5 * mean_se(&drift[0], 0.0).1);
        // Centred on the run's own value, however the batches lean.
        let ci = batch_interval(10.0, &[7.0, 8.0, 9.0], 0.0);
        assert!((ci[1] - 10.0 - (10.0 - ci[0])).abs() < 1e-9);
    }
}
