//! The zone experiment (`keel simulate --preset zones`): uneven inbound traffic over three zones
//! (60/30/10 % of requests arrive in zones a, b, c, which run 4, 4 and 3 endpoints). One
//! balancer per zone (the proxy in that zone) picks with keel-balance's own API (`pick`,
//! `finish`, `report_load`), under four rules: zone-unaware, Envoy's host-count rule, and
//! keel's load rule at two thresholds.
//!
//! Each endpoint serves `slots` calls at once (exponential service times, mean `service`) and
//! queues the rest in FIFO order; it reports its requests in flight on every answer, to the
//! balancer whose call it answers (as `keel backend` does with `x-keel-rif`). Endpoints have
//! weight `slots`, so that calls in flight per unit of weight is the share of slots in use and
//! the threshold reads as a utilisation.
//!
//! Closed forms (for `rho` = offered load / cluster capacity, lambda_z the zone's arrivals and
//! mu_z its capacity, both in endpoints' worth):
//! - zone-unaware: cross-zone share `1 - sum_z share_z x endpoints_z / endpoints`, every zone at
//!   `rho`;
//! - host-count (one balancer per zone): a, b keep everything (4/11 > 1/3), c keeps 9/11 and
//!   sends 1/11 to each of a and b: cross-zone share `0.1 x 2/11`, zone a at
//!   `rho x (0.6 + 0.1/11) x 11/4` (1.17 at rho = 0.7: over capacity);
//! - the least cross-zone share that keeps every zone at or under a utilisation `u`:
//!   `sum_z max(0, lambda_z - u x mu_z) / lambda` (a fluid bound: it needs a zone held at
//!   exactly `u` on average, with a queue whenever arrivals bunch up);
//! - keel's load rule at threshold `t`: a zone that only its own balancer sends to admits a
//!   call while fewer than `N = ceil(t x slots_z)` are in flight there and sends the rest away,
//!   which is Erlang's loss system: it spills `B(N, A_z)` of its arrivals (Erlang B, offered
//!   traffic `A_z = lambda_z x service` in calls). So the cross-zone share is about
//!   `sum_z share_z x B(N_z, A_z)`, above the fluid bound by what it costs never to queue.
//!
//! Why not on the simulator's engine (sim/engine.rs): the engine has no zones. Its endpoints
//! carry no zone and its clients share one `BalancerConfig` (here each zone's balancer has its
//! own zone and `ZoneRouting`), it deals arrivals to clients evenly or in turn (here 60/30/10),
//! and its load reports carry requests in flight but not the `Utilization` the utilization rule
//! reads. Those three are what the four zone rules are made of. The zone-unaware row, which
//! needs none of them, measures the same on the engine (`tests/engine_twins.rs`: three
//! least-request balancers fed each answer's requests in flight, arrivals dealt evenly): p50
//! 7.03 ms here against 7.06 ms, p99 45.74 ms against 46.27 ms [46.07, 46.47] over the
//! engine's 8 replications. So moving would change the unaware row by about 1 % at p99; the
//! rules wait for zones in the engine's scenario (a zone per endpoint and per client, arrival
//! shares per client, utilization reports), after which this loop goes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use keel_balance::{
    Balancer, BalancerConfig, EndpointSpec, LoadReport, Outcome, Pick, PickContext, StrategyKind,
    Utilization, ZoneMode, ZoneRouting, ZoneSignal,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Exp};

use crate::sim::LatencyHistogram;

/// How the balancers split calls between zones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ZoneRule {
    /// No zone routing: the strategy over every endpoint.
    Unaware,
    /// Envoy's zone-aware routing by healthy endpoint counts.
    HostCount,
    /// keel's: local under this share of slots in use, spill over in proportion to headroom.
    Load(f64),
    /// keel's rule on reported utilisation (ORCA's signal: each answer carries its endpoint's
    /// busy share of slots) instead of calls in flight.
    Utilization(f64),
}

impl ZoneRule {
    /// The row's name.
    pub fn name(self) -> String {
        match self {
            ZoneRule::Unaware => "zone-unaware".into(),
            ZoneRule::HostCount => "host-count (Envoy)".into(),
            ZoneRule::Load(t) => format!("load, threshold {t}"),
            ZoneRule::Utilization(t) => format!("utilization, thr. {t}"),
        }
    }
}

/// One row of the experiment.
#[derive(Debug, Clone, PartialEq)]
pub struct ZoneScenario {
    /// The rule.
    pub rule: ZoneRule,
    /// Zone names, endpoints and share of the inbound requests.
    pub zones: Vec<(String, u32, f64)>,
    /// Calls an endpoint serves at once.
    pub slots: u32,
    /// Mean service time.
    pub service: Duration,
    /// Offered load as a share of the whole cluster's capacity.
    pub rho: f64,
    /// Virtual time before counting.
    pub warmup: Duration,
    /// Virtual time counted.
    pub measure: Duration,
    /// Seed of arrivals, service times and the balancers.
    pub seed: u64,
    /// The strategy within a zone.
    pub strategy: StrategyKind,
}

impl ZoneScenario {
    /// The preset's setup under `rule`: 60/30/10 over 4/4/3 endpoints of 8 slots, 10 ms
    /// calls, offered load 0.7, 2 s of warm-up and 20 s counted.
    pub fn preset(rule: ZoneRule, seed: u64) -> Self {
        Self {
            rule,
            zones: vec![
                ("a".into(), 4, 0.6),
                ("b".into(), 4, 0.3),
                ("c".into(), 3, 0.1),
            ],
            slots: 8,
            service: Duration::from_millis(10),
            rho: 0.7,
            warmup: Duration::from_secs(2),
            measure: Duration::from_secs(20),
            seed,
            strategy: StrategyKind::LeastRequest,
        }
    }

    fn endpoints(&self) -> u32 {
        self.zones.iter().map(|z| z.1).sum()
    }

    /// The least cross-zone share that keeps every zone at or under utilisation `u` (with
    /// the other zones able to take the excess).
    pub fn min_cross_zone(&self, u: f64) -> f64 {
        let n = f64::from(self.endpoints());
        let lambda = self.rho * n;
        self.zones
            .iter()
            .map(|(_, m, share)| (share * lambda - u * f64::from(*m)).max(0.0))
            .sum::<f64>()
            / lambda
    }

    /// keel's load rule's cross-zone share by Erlang's loss formula (see the module's doc).
    /// A zone is offered its own arrivals plus what the others spill into it; a balancer
    /// spills its own arrivals while its zone is full (time congestion `B(N_z, A_z)`, arrivals
    /// being Poisson), into the other zones in proportion to their mean free places. A fixed
    /// point of the two (spill is burstier than Poisson, so this is a little low).
    pub fn erlang_cross_zone(&self, t: f64) -> f64 {
        let per_endpoint = f64::from(self.slots);
        let lambda = self.rho * per_endpoint * f64::from(self.endpoints());
        let k = self.zones.len();
        let own: Vec<f64> = self.zones.iter().map(|z| z.2 * lambda).collect();
        let places: Vec<u32> = self
            .zones
            .iter()
            .map(|z| (t * per_endpoint * f64::from(z.1)).ceil() as u32)
            .collect();
        let mut offered = own.clone();
        let mut full = vec![0.0; k];
        for _ in 0..200 {
            for z in 0..k {
                full[z] = erlang_b(places[z], offered[z]);
            }
            let free: Vec<f64> = (0..k)
                .map(|z| (f64::from(places[z]) - offered[z] * (1.0 - full[z])).max(0.0))
                .collect();
            for z in 0..k {
                let mut received = 0.0;
                for y in 0..k {
                    let others: f64 = (0..k).filter(|&x| x != y).map(|x| free[x]).sum();
                    if y != z && others > 0.0 {
                        received += own[y] * full[y] * free[z] / others;
                    }
                }
                offered[z] = own[z] + received;
            }
        }
        (0..k).map(|z| own[z] * full[z]).sum::<f64>() / lambda
    }

    /// The rule's own closed form where it has one: (cross-zone share, offered load per zone).
    pub fn closed_form(&self) -> Option<(f64, Vec<f64>)> {
        let n = f64::from(self.endpoints());
        let cap: Vec<f64> = self.zones.iter().map(|z| f64::from(z.1) / n).collect();
        let inbound: Vec<f64> = self.zones.iter().map(|z| z.2).collect();
        let k = self.zones.len();
        // routed[from][to]
        let mut routed = vec![vec![0.0; k]; k];
        match self.rule {
            ZoneRule::Unaware => {
                for (from, row) in routed.iter_mut().enumerate() {
                    for (to, cell) in row.iter_mut().enumerate() {
                        *cell = inbound[from] * cap[to];
                    }
                }
            }
            ZoneRule::HostCount => {
                let down = 1.0 / k as f64;
                for from in 0..k {
                    if cap[from] >= down {
                        routed[from][from] = inbound[from];
                        continue;
                    }
                    let keep = cap[from] / down;
                    routed[from][from] = inbound[from] * keep;
                    let excess: Vec<f64> = (0..k)
                        .map(|z| {
                            if z == from {
                                0.0
                            } else {
                                (cap[z] - down).max(0.0)
                            }
                        })
                        .collect();
                    let sum: f64 = excess.iter().sum();
                    for to in 0..k {
                        if to != from {
                            routed[from][to] = inbound[from] * (1.0 - keep) * excess[to] / sum;
                        }
                    }
                }
            }
            ZoneRule::Load(_) | ZoneRule::Utilization(_) => return None,
        }
        let cross = (0..k)
            .map(|f| {
                (0..k)
                    .filter(|&t| t != f)
                    .map(|t| routed[f][t])
                    .sum::<f64>()
            })
            .sum();
        let load = (0..k)
            .map(|t| (0..k).map(|f| routed[f][t]).sum::<f64>() * self.rho / cap[t])
            .collect();
        Some((cross, load))
    }
}

/// Erlang B: the share of calls lost by `n` servers offered `a` erlangs (the stable
/// recursion `B(k) = a B(k-1) / (k + a B(k-1))`).
pub fn erlang_b(n: u32, a: f64) -> f64 {
    (1..=n).fold(1.0, |b, k| a * b / (f64::from(k) + a * b))
}

/// What one row measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ZoneResult {
    /// The setup.
    pub scenario: ZoneScenario,
    /// Calls counted.
    pub calls: u64,
    /// Share of calls served outside the zone they arrived in.
    pub cross_zone: f64,
    /// Per zone: the work routed there over its capacity (service time of the calls sent
    /// there / (slots x time)); above 1 the zone cannot keep up and its queue grows.
    pub offered: Vec<f64>,
    /// Per zone: the share of slot time actually busy (at most 1).
    pub busy: Vec<f64>,
    /// Call latency (queueing included), milliseconds: p50, p99.
    pub p50_ms: f64,
    /// p99.
    pub p99_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request arrives in zone `z`.
    Arrive(usize),
    /// Call `c` ends its service.
    Done(usize),
}

struct Call {
    pick: Option<Pick>,
    from: usize,
    endpoint: usize,
    arrived: Duration,
    service: Duration,
    counted: bool,
}

/// Runs one row.
pub fn run(s: &ZoneScenario) -> ZoneResult {
    let mut rng = StdRng::seed_from_u64(s.seed);
    let mut specs = Vec::new();
    let mut zone_of = Vec::new();
    for (zi, (name, m, _)) in s.zones.iter().enumerate() {
        for i in 0..*m {
            specs.push(
                EndpointSpec::new(format!("{name}-{i}:80"))
                    .with_weight(s.slots)
                    .with_zone(name.clone()),
            );
            zone_of.push(zi);
        }
    }
    let balancers: Vec<Balancer> = s
        .zones
        .iter()
        .enumerate()
        .map(|(zi, (name, _, _))| {
            let mut c = BalancerConfig::new(s.strategy);
            c.seed = s.seed ^ (zi as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            c.zone = Some(name.clone());
            c.zone_routing = match s.rule {
                ZoneRule::Unaware => None,
                ZoneRule::HostCount => Some(ZoneRouting {
                    mode: ZoneMode::HostCount,
                    ..ZoneRouting::default()
                }),
                ZoneRule::Load(t) => Some(ZoneRouting {
                    threshold: t,
                    ..ZoneRouting::default()
                }),
                ZoneRule::Utilization(t) => Some(ZoneRouting {
                    threshold: t,
                    signal: ZoneSignal::Utilization,
                    ..ZoneRouting::default()
                }),
            };
            Balancer::new(c, &specs).expect("a valid zone balancer")
        })
        .collect();
    let ids: Vec<Vec<_>> = balancers
        .iter()
        .map(|b| b.endpoints().iter().map(|e| e.id()).collect())
        .collect();
    let n = specs.len();
    let capacity = f64::from(s.slots) / s.service.as_secs_f64();
    let total_rate = s.rho * capacity * n as f64;
    let service = Exp::new(1.0 / s.service.as_secs_f64()).expect("service > 0");
    let arrivals: Vec<Exp<f64>> = s
        .zones
        .iter()
        .map(|z| Exp::new(total_rate * z.2).expect("rate > 0"))
        .collect();
    let mut queue: BinaryHeap<Reverse<(Duration, u64, Event)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |q: &mut BinaryHeap<_>, at: Duration, e: Event| {
        seq += 1;
        q.push(Reverse((at, seq, e)));
    };
    for (z, a) in arrivals.iter().enumerate() {
        let t = Duration::from_secs_f64(a.sample(&mut rng));
        push(&mut queue, t, Event::Arrive(z));
    }
    let end = s.warmup + s.measure;
    let mut calls: Vec<Call> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut in_service = vec![0u32; n];
    let mut waiting: Vec<VecDeque<usize>> = vec![VecDeque::new(); n];
    let mut offered_ns = vec![0f64; s.zones.len()];
    let mut busy_ns = vec![0f64; s.zones.len()];
    let (mut counted, mut cross) = (0u64, 0u64);
    let mut latency = LatencyHistogram::new();
    while let Some(Reverse((now, _, ev))) = queue.pop() {
        if now > end {
            break;
        }
        match ev {
            Event::Arrive(z) => {
                let next = now + Duration::from_secs_f64(arrivals[z].sample(&mut rng));
                push(&mut queue, next, Event::Arrive(z));
                let pick = balancers[z]
                    .pick(&PickContext::new(now))
                    .expect("an endpoint");
                let e = pick.index();
                let counts = now >= s.warmup;
                let call = Call {
                    pick: Some(pick),
                    from: z,
                    endpoint: e,
                    arrived: now,
                    service: Duration::from_secs_f64(service.sample(&mut rng)),
                    counted: counts,
                };
                if counts {
                    counted += 1;
                    cross += u64::from(zone_of[e] != z);
                    offered_ns[zone_of[e]] += call.service.as_nanos() as f64;
                }
                let c = match free.pop() {
                    Some(c) => {
                        calls[c] = call;
                        c
                    }
                    None => {
                        calls.push(call);
                        calls.len() - 1
                    }
                };
                if in_service[e] < s.slots {
                    in_service[e] += 1;
                    push(&mut queue, now + calls[c].service, Event::Done(c));
                } else {
                    waiting[e].push_back(c);
                }
            }
            Event::Done(c) => {
                let e = calls[c].endpoint;
                let from = calls[c].from;
                if now >= s.warmup {
                    let started = (now - calls[c].service).max(s.warmup);
                    busy_ns[zone_of[e]] += (now - started).as_nanos() as f64;
                }
                if calls[c].counted {
                    latency.record((now - calls[c].arrived).as_nanos() as u64);
                }
                in_service[e] -= 1;
                if let Some(next) = waiting[e].pop_front() {
                    in_service[e] += 1;
                    push(&mut queue, now + calls[next].service, Event::Done(next));
                }
                let rif = in_service[e] + waiting[e].len() as u32;
                let b = &balancers[from];
                if let Some(p) = calls[c].pick.take() {
                    b.finish(p, Outcome::Success, now);
                }
                b.report_load(
                    ids[from][e],
                    LoadReport {
                        in_flight: rif,
                        latency: Duration::ZERO,
                    },
                    now,
                );
                if let ZoneRule::Utilization(_) = s.rule {
                    let busy = Utilization {
                        cpu: f64::from(in_service[e]) / f64::from(s.slots),
                        ..Utilization::default()
                    };
                    b.report_utilization(ids[from][e], busy, now);
                }
                free.push(c);
            }
        }
    }
    let secs = s.measure.as_nanos() as f64;
    let slot_ns = |z: usize| f64::from(s.zones[z].1 * s.slots) * secs;
    let k = s.zones.len();
    ZoneResult {
        scenario: s.clone(),
        calls: counted,
        cross_zone: cross as f64 / counted.max(1) as f64,
        offered: (0..k).map(|z| offered_ns[z] / slot_ns(z)).collect(),
        busy: (0..k).map(|z| busy_ns[z] / slot_ns(z)).collect(),
        p50_ms: latency.quantile_ns(0.5) / 1e6,
        p99_ms: latency.quantile_ns(0.99) / 1e6,
    }
}

/// The preset's rows.
pub fn preset(seed: u64) -> Vec<ZoneScenario> {
    [
        ZoneRule::Unaware,
        ZoneRule::HostCount,
        ZoneRule::Load(0.8),
        ZoneRule::Load(0.95),
        ZoneRule::Utilization(0.8),
    ]
    .into_iter()
    .map(|r| ZoneScenario::preset(r, seed))
    .collect()
}

/// The results as a text table, with the closed forms.
pub fn table(results: &[ZoneResult]) -> String {
    let mut out = String::new();
    let names: Vec<&str> = results
        .first()
        .map(|r| r.scenario.zones.iter().map(|z| z.0.as_str()).collect())
        .unwrap_or_default();
    out.push_str(&format!(
        "  {:<22} {:>10} {:>11}  {:<16} {:<14} {:>6} {:>8}\n",
        "rule",
        "cross-zone",
        "closed form",
        format!("offered {}", names.join("/")),
        "busy",
        "p50 ms",
        "p99 ms"
    ));
    for r in results {
        let s = &r.scenario;
        let closed = match (s.rule, s.closed_form()) {
            (_, Some((c, _))) => format!("{c:.4}"),
            (ZoneRule::Load(t), None) => format!("{:.4} (B)", s.erlang_cross_zone(t)),
            _ => String::new(),
        };
        let fmt = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        out.push_str(&format!(
            "  {:<22} {:>10.4} {:>11}  {:<16} {:<14} {:>6.2} {:>8.2}\n",
            s.rule.name(),
            r.cross_zone,
            closed,
            fmt(&r.offered),
            fmt(&r.busy),
            r.p50_ms,
            r.p99_ms
        ));
    }
    if let Some(r) = results.first() {
        let s = &r.scenario;
        out.push_str(&format!(
            "  least cross-zone share keeping every zone at or under 1.0: {:.4}, 0.8: {:.4}, 0.95: {:.4}\n",
            s.min_cross_zone(1.0),
            s.min_cross_zone(0.8),
            s.min_cross_zone(0.95)
        ));
    }
    out
}

/// A chart of each rule's offered load per zone, with the capacity line at 1.
pub fn chart(path: &std::path::Path, results: &[ZoneResult]) -> Result<(), crate::plot::PlotError> {
    use crate::plot::{write_svg, ChartSpec, Series};
    let Some(first) = results.first() else {
        return Ok(());
    };
    let names: Vec<String> = first
        .scenario
        .zones
        .iter()
        .map(|z| {
            format!(
                "zone {} ({} endpoints, {:.0} % of arrivals)",
                z.0,
                z.1,
                z.2 * 100.0
            )
        })
        .collect();
    let k = names.len();
    let mut series: Vec<Series> = results
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let dx = (i as f64 - (results.len() as f64 - 1.0) / 2.0) * 0.08;
            Series::points(
                format!(
                    "{} (cross-zone {:.1} %)",
                    r.scenario.rule.name(),
                    r.cross_zone * 100.0
                ),
                r.offered
                    .iter()
                    .enumerate()
                    .map(|(z, &y)| (z as f64 + 1.0 + dx, y))
                    .collect(),
            )
        })
        .collect();
    series.push(Series::dashed(
        "capacity",
        vec![(0.5, 1.0), (k as f64 + 0.5, 1.0)],
    ));
    let spec = ChartSpec::new(
        "Zones: offered load per zone, 60/30/10 % arrivals over 4/4/3 endpoints, rho = 0.7",
        "zone",
        "work routed / capacity",
    )
    .x_categories(names)
    .y_range(0.0, 1.4);
    write_svg(path, &spec, &series)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_forms_by_hand() {
        let s = ZoneScenario::preset(ZoneRule::HostCount, 1);
        let (cross, load) = s.closed_form().unwrap();
        assert!((cross - 0.2 / 11.0).abs() < 1e-12);
        assert!((load[0] - 0.7 * (0.6 + 0.1 / 11.0) * 11.0 / 4.0).abs() < 1e-12);
        let s = ZoneScenario::preset(ZoneRule::Unaware, 1);
        let (cross, load) = s.closed_form().unwrap();
        assert!((cross - (1.0 - 3.9 / 11.0)).abs() < 1e-12);
        assert!(load.iter().all(|l| (l - 0.7).abs() < 1e-12));
        // 0.6 x 7.7 = 4.62 endpoints' worth arrive in a, which has 4.
        assert!((s.min_cross_zone(1.0) - 0.62 / 7.7).abs() < 1e-12);
        assert!((s.min_cross_zone(0.8) - 1.42 / 7.7).abs() < 1e-12);
        // Erlang B by hand: B(1, a) = a / (1 + a); B(2, 1) = 1/5.
        assert!((erlang_b(1, 3.0) - 0.75).abs() < 1e-12);
        assert!((erlang_b(2, 1.0) - 0.2).abs() < 1e-12);
    }
}
