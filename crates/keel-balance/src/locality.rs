//! Priorities and zones: which group of endpoints a pick draws from before the strategy picks
//! within it. The endpoints are split into groups, one per priority level (and, with zone
//! routing, one per zone within a level), each with a strategy of its own built over its
//! members only, so the layer works over any strategy: hash rings, trees and heaps see only
//! their group.
//!
//! - **Priority levels** (Envoy's semantics): level p's health is
//!   `min(100 %, overprovisioning_factor x available_p / endpoints_p)`; level 0 takes
//!   `min(100 %, health_0 / H)`, level 1 `min(rest, health_1 / H)`, and so on, where
//!   `H = min(100 %, sum of the healths)` (so that traffic is never lost when every level is
//!   degraded). With the default factor 1.4 a level keeps everything while 71.4 % of it is up.
//! - **Zones, `host-count`** (Envoy's zone-aware routing, modelled for comparison): the local
//!   zone keeps `min(1, upstream_local / downstream_local)` of the picks, where upstream is the
//!   zone's share of the level's available endpoints and downstream its share of the
//!   balancers (`downstream`, one per zone if not given); the rest goes to the zones whose
//!   upstream share exceeds their downstream share, in proportion to the excess. It routes by
//!   counts, not load: with uneven inbound traffic a zone overloads.
//! - **Zones, `load`** (keel's): a pick stays in the local zone while the zone's load is below
//!   `threshold`; otherwise it goes to another zone in proportion to its headroom below the
//!   threshold (its weight times `threshold - load`), or, when no zone has headroom, to any
//!   zone in proportion to its weight. The load is calls in flight per unit of weight (the
//!   larger of this balancer's own count and the endpoint's last report, so that balancers in
//!   other zones count) or the endpoints' reported utilisation (ORCA).
//!
//! Health counts are refreshed with the balancer's health summary (after an ejection, a health
//! change, or when an ejection ends); zone loads are read at each pick (a scan of the level's
//! endpoints, no allocation).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::endpoint::{Endpoint, EndpointSpec};
use crate::field::{InvalidField, Problem};
use crate::rng::{mix64, unit_f64, SharedRng};
use crate::time::nanos;

/// How zone-aware routing splits picks between zones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ZoneMode {
    /// keel's: local while the local zone's load is under `threshold`, spill in proportion to
    /// the other zones' headroom.
    #[default]
    Load,
    /// Envoy's: by healthy endpoint counts per zone against balancer counts per zone.
    HostCount,
}

/// What "load" means for [`ZoneMode::Load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ZoneSignal {
    /// Calls in flight per unit of weight: the larger of this balancer's count and the
    /// endpoint's last reported requests in flight ([`crate::Balancer::report_load`]).
    #[default]
    InFlight,
    /// Reported utilisation, 0 to 1 ([`crate::Balancer::report_utilization`], ORCA).
    Utilization,
}

/// Zone-aware routing (`zone_routing`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZoneRouting {
    /// `load` (default) or `host-count`.
    pub mode: ZoneMode,
    /// `in-flight` (default) or `utilization`.
    pub signal: ZoneSignal,
    /// `load`: the local zone keeps picks while its load is below this (in-flight: calls per
    /// unit of weight, so with weight 1 and 8 calls of capacity per endpoint, 6.4 keeps each
    /// endpoint at 80 %; utilization: a fraction). Default 0.8.
    pub threshold: f64,
    /// Reports older than this are not used. Default 1 s.
    #[serde(with = "crate::duration_serde")]
    pub report_max_age: Duration,
    /// `host-count`: balancers per zone (Envoy reads them from the local cluster); empty: one
    /// per zone that has endpoints.
    pub downstream: BTreeMap<String, u32>,
}

impl Default for ZoneRouting {
    fn default() -> Self {
        Self {
            mode: ZoneMode::Load,
            signal: ZoneSignal::InFlight,
            threshold: 0.8,
            report_max_age: Duration::from_secs(1),
            downstream: BTreeMap::new(),
        }
    }
}

impl ZoneRouting {
    pub(crate) fn validate(&self) -> Result<(), InvalidField> {
        if !(self.threshold.is_finite() && self.threshold > 0.0) {
            return Err(InvalidField::at(
                "threshold",
                Problem::out_of_range("greater than zero", self.threshold),
            ));
        }
        if self.report_max_age.is_zero() {
            return Err(InvalidField::at(
                "report_max_age",
                Problem::out_of_range("greater than zero", "0s"),
            ));
        }
        if !self.downstream.is_empty() && self.mode != ZoneMode::HostCount {
            return Err(InvalidField::at(
                "downstream",
                Problem::NotApplicable("it is for mode = \"host-count\"".into()),
            ));
        }
        Ok(())
    }
}

/// Envoy disables zone-aware routing below this many endpoints (`min_cluster_size`, 6).
pub(crate) const HOST_COUNT_MIN_ENDPOINTS: usize = 6;

/// Shares are kept in millionths.
const SCALE: f64 = 1e6;

/// One group of endpoints: a priority level's, or one zone's within it.
pub(crate) struct Group {
    /// Its zone (an index into [`Layout::zones`]), when zone routing splits the level.
    pub zone: Option<usize>,
    /// The members' places in the balancer's endpoint list.
    pub members: Vec<usize>,
    pub eps: Vec<Arc<Endpoint>>,
}

/// One priority level and its groups.
pub(crate) struct Level {
    pub priority: u32,
    pub groups: Range<usize>,
    /// The group of the balancer's own zone.
    pub local: Option<usize>,
    /// host-count: cumulative shares (millionths) of the level's groups for a local pick.
    pub split: Vec<AtomicU32>,
}

/// What the layout needs of the balancer's configuration (its own zone, zone routing, the
/// overprovisioning factor), passed in so that this module does not import the configuration's.
pub(crate) struct LocalityConfig<'a> {
    pub zone: Option<&'a str>,
    pub routing: Option<&'a ZoneRouting>,
    pub factor: f64,
}

/// The groups of a balancer's endpoints.
pub(crate) struct Layout {
    pub groups: Vec<Group>,
    pub levels: Vec<Level>,
    /// Per endpoint: (group, place in the group).
    pub place: Vec<(u32, u32)>,
    /// Cumulative shares (millionths) of the levels.
    pub level_cum: Vec<AtomicU32>,
    pub zones: Vec<String>,
    routing: Option<ZoneRouting>,
    factor: f64,
}

impl Layout {
    /// The groups of `eps` (whose placement `specs` give, in the same order).
    pub fn new(config: &LocalityConfig<'_>, specs: &[Placement], eps: &[Arc<Endpoint>]) -> Self {
        let routing = config.routing.cloned().filter(|_| config.zone.is_some());
        let mut zones: Vec<String> = Vec::new();
        if routing.is_some() {
            for s in specs {
                if let Some(z) = &s.zone {
                    if !zones.contains(z) {
                        zones.push(z.clone());
                    }
                }
            }
            zones.sort();
        }
        let zone_of = |s: &Placement| {
            s.zone
                .as_ref()
                .and_then(|z| zones.iter().position(|x| x == z))
        };
        let mut priorities: Vec<u32> = specs.iter().map(|s| s.priority).collect();
        priorities.sort_unstable();
        priorities.dedup();
        if priorities.is_empty() {
            priorities.push(0);
        }
        let local_zone = config.zone.and_then(|z| zones.iter().position(|x| x == z));
        let mut groups = Vec::new();
        let mut levels = Vec::new();
        let mut place = vec![(0u32, 0u32); eps.len()];
        for &p in &priorities {
            let start = groups.len();
            // Zone keys of this level: None (no zone) sorts first.
            let mut keys: Vec<Option<usize>> = if routing.is_some() {
                specs
                    .iter()
                    .filter(|s| s.priority == p)
                    .map(zone_of)
                    .collect()
            } else {
                vec![None]
            };
            keys.sort_unstable();
            keys.dedup();
            if keys.is_empty() {
                keys.push(None);
            }
            let mut local = None;
            for key in keys {
                let g = groups.len();
                let mut members = Vec::new();
                for (i, s) in specs.iter().enumerate() {
                    if s.priority == p && (routing.is_none() || zone_of(s) == key) {
                        place[i] = (g as u32, members.len() as u32);
                        members.push(i);
                    }
                }
                if key.is_some() && key == local_zone {
                    local = Some(g);
                }
                groups.push(Group {
                    zone: key,
                    eps: members.iter().map(|&i| eps[i].clone()).collect(),
                    members,
                });
            }
            let n = groups.len() - start;
            levels.push(Level {
                priority: p,
                groups: start..groups.len(),
                local,
                split: (0..n).map(|_| AtomicU32::new(0)).collect(),
            });
        }
        let layout = Layout {
            level_cum: levels.iter().map(|_| AtomicU32::new(0)).collect(),
            groups,
            levels,
            place,
            zones,
            routing,
            factor: config.factor,
        };
        layout.refresh(0);
        layout
    }

    /// True when picks need the layer at all (more than one group).
    #[inline]
    pub fn is_trivial(&self) -> bool {
        self.groups.len() == 1
    }

    /// Recomputes the level shares and the host-count splits from availability at `now`.
    pub fn refresh(&self, now: u64) {
        let avail = |g: &Group| g.eps.iter().filter(|e| e.is_available(now)).count();
        // Envoy's priority loads.
        let mut health = [0f64; 64];
        let many = self.levels.len() > health.len();
        let level_health = |l: &Level| {
            let (mut up, mut all) = (0usize, 0usize);
            for g in &self.groups[l.groups.clone()] {
                up += avail(g);
                all += g.eps.len();
            }
            if all == 0 {
                0.0
            } else {
                (self.factor * up as f64 / all as f64).min(1.0)
            }
        };
        let mut total = 0.0;
        for (i, l) in self.levels.iter().enumerate() {
            let h = level_health(l);
            if !many {
                health[i] = h;
            }
            total += h;
        }
        let total = total.min(1.0);
        let mut rest = 1.0;
        let mut cum = 0.0;
        for (i, l) in self.levels.iter().enumerate() {
            let h = if many { level_health(l) } else { health[i] };
            let share = if total <= 0.0 {
                // Nothing is up anywhere: everything to the first level (panic mode decides).
                if i == 0 {
                    1.0
                } else {
                    0.0
                }
            } else {
                (h / total).min(rest)
            };
            rest -= share;
            cum += share;
            let last = i + 1 == self.levels.len();
            let v = if last { SCALE } else { (cum * SCALE).round() };
            self.level_cum[i].store(v as u32, Ordering::Relaxed);
        }
        if let Some(zr) = &self.routing {
            if zr.mode == ZoneMode::HostCount {
                for l in &self.levels {
                    self.host_count_split(l, zr, now);
                }
            }
        }
    }

    /// Envoy's zone-aware split of a level for a pick from the local zone.
    fn host_count_split(&self, l: &Level, zr: &ZoneRouting, now: u64) {
        let gs = &self.groups[l.groups.clone()];
        let up: Vec<f64> = gs
            .iter()
            .map(|g| g.eps.iter().filter(|e| e.is_available(now)).count() as f64)
            .collect();
        let up_total: f64 = up.iter().sum();
        let all: usize = gs.iter().map(|g| g.eps.len()).sum();
        let down: Vec<f64> = gs
            .iter()
            .map(|g| match g.zone {
                Some(_) if zr.downstream.is_empty() => 1.0,
                Some(z) => f64::from(*zr.downstream.get(&self.zones[z]).unwrap_or(&0)),
                None => 0.0,
            })
            .collect();
        let down_total: f64 = down.iter().sum();
        let mut shares = vec![0.0; gs.len()];
        let local = l.local.map(|g| g - l.groups.start);
        match local {
            Some(li) if all >= HOST_COUNT_MIN_ENDPOINTS && up_total > 0.0 && down_total > 0.0 => {
                let up_pct = |i: usize| up[i] / up_total;
                let down_pct = |i: usize| down[i] / down_total;
                if up_pct(li) >= down_pct(li) {
                    shares[li] = 1.0;
                } else {
                    shares[li] = up_pct(li) / down_pct(li);
                    let residual: Vec<f64> = (0..gs.len())
                        .map(|i| {
                            if i == li {
                                0.0
                            } else {
                                (up_pct(i) - down_pct(i)).max(0.0)
                            }
                        })
                        .collect();
                    let rsum: f64 = residual.iter().sum();
                    for i in 0..gs.len() {
                        if i != li {
                            shares[i] = (1.0 - shares[li])
                                * if rsum > 0.0 {
                                    residual[i] / rsum
                                } else {
                                    up_pct(i) / (1.0 - up_pct(li)).max(f64::MIN_POSITIVE)
                                };
                        }
                    }
                }
            }
            // Too small a cluster, or no local zone: by available endpoints, zone-unaware.
            _ => {
                for i in 0..gs.len() {
                    shares[i] = if up_total > 0.0 {
                        up[i] / up_total
                    } else {
                        gs[i].eps.len() as f64 / all.max(1) as f64
                    };
                }
            }
        }
        let mut cum = 0.0;
        for (i, s) in shares.iter().enumerate() {
            cum += s;
            let last = i + 1 == shares.len();
            let v = if last { SCALE } else { (cum * SCALE).round() };
            l.split[i].store(v as u32, Ordering::Relaxed);
        }
    }

    /// The group for one pick at `now`. With a hash key, the level and the host-count zone are
    /// drawn from the key (a key keeps its level and zone, and so its endpoint, while the
    /// shares stay), otherwise at random.
    pub fn choose(
        &self,
        now: u64,
        ignore_health: bool,
        rng: &SharedRng,
        key: Option<u64>,
    ) -> usize {
        let draw = |salt: u64| match key {
            Some(k) => mix64(k ^ salt),
            None => rng.next_u64(),
        };
        let level = if self.levels.len() == 1 {
            0
        } else {
            let u = (unit_f64(draw(0x6c65_7665_6c00)) * SCALE) as u32;
            self.level_cum
                .iter()
                .position(|c| u < c.load(Ordering::Relaxed))
                .unwrap_or(self.levels.len() - 1)
        };
        let l = &self.levels[level];
        if l.groups.len() == 1 {
            return l.groups.start;
        }
        let Some(zr) = &self.routing else {
            return l.groups.start;
        };
        match zr.mode {
            ZoneMode::HostCount => {
                let u = (unit_f64(draw(0x7a6f_6e65_0000)) * SCALE) as u32;
                let i = l
                    .split
                    .iter()
                    .position(|c| u < c.load(Ordering::Relaxed))
                    .unwrap_or(l.split.len() - 1);
                l.groups.start + i
            }
            ZoneMode::Load => self.by_load(l, zr, now, ignore_health, rng),
        }
    }

    /// keel's rule: local under the threshold, else spill in proportion to headroom.
    fn by_load(
        &self,
        l: &Level,
        zr: &ZoneRouting,
        now: u64,
        ignore_health: bool,
        rng: &SharedRng,
    ) -> usize {
        let t = zr.threshold;
        let max_age = nanos(zr.report_max_age);
        let load = |g: usize| zone_load(&self.groups[g], zr.signal, now, max_age, ignore_health);
        if let Some(local) = l.local {
            if let Some((lv, _)) = load(local) {
                if lv < t {
                    return local;
                }
            }
        }
        let headroom = |g: usize| match load(g) {
            Some((lv, w)) if Some(g) != l.local => (t - lv).max(0.0) * w,
            _ => 0.0,
        };
        let total: f64 = l.groups.clone().map(headroom).sum();
        if total > 0.0 {
            let mut x = unit_f64(rng.next_u64()) * total;
            let mut last = None;
            for g in l.groups.clone() {
                let h = headroom(g);
                if h > 0.0 {
                    last = Some(g);
                    if x < h {
                        return g;
                    }
                    x -= h;
                }
            }
            if let Some(g) = last {
                return g;
            }
        }
        // No zone has headroom: every zone in proportion to its weight.
        let weight = |g: usize| load(g).map_or(0.0, |(_, w)| w);
        let total: f64 = l.groups.clone().map(weight).sum();
        if total > 0.0 {
            let mut x = unit_f64(rng.next_u64()) * total;
            for g in l.groups.clone() {
                let w = weight(g);
                if x < w {
                    return g;
                }
                x -= w;
            }
        }
        l.local.unwrap_or(l.groups.start)
    }
}

/// A group's load and the weight it is over (available members only); `None` when no member is
/// available.
fn zone_load(
    g: &Group,
    signal: ZoneSignal,
    now: u64,
    max_age: u64,
    ignore_health: bool,
) -> Option<(f64, f64)> {
    let mut weight = 0.0;
    let mut load = 0.0;
    let mut reported_weight = 0.0;
    let mut any = false;
    for e in &g.eps {
        if !ignore_health && !e.is_available(now) {
            continue;
        }
        any = true;
        let w = f64::from(e.weight());
        weight += w;
        match signal {
            ZoneSignal::InFlight => {
                let own = e.in_flight();
                let rif = e.reported_rif(now, max_age).unwrap_or(0);
                load += f64::from(own.max(rif));
            }
            ZoneSignal::Utilization => {
                if let Some(u) = e.reported_util(now, max_age) {
                    load += u * w;
                    reported_weight += w;
                }
            }
        }
    }
    if !any {
        return None;
    }
    let over = match signal {
        ZoneSignal::InFlight => weight,
        // Endpoints with no fresh report say nothing; those with one speak for the zone.
        ZoneSignal::Utilization => reported_weight,
    };
    let lv = if over > 0.0 { load / over } else { 0.0 };
    Some((lv, weight))
}

/// Where an endpoint sits: its priority and zone (what the layout needs of its spec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    pub priority: u32,
    pub zone: Option<String>,
}

impl From<&EndpointSpec> for Placement {
    fn from(s: &EndpointSpec) -> Self {
        Self {
            priority: s.priority,
            zone: s.zone.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Balancer, BalancerConfig, EndpointSpec, LoadReport, PickContext, StrategyKind};

    fn two_levels() -> Vec<EndpointSpec> {
        (0..10)
            .map(|i| EndpointSpec::new(format!("10.0.0.{i}:80")).with_priority(i / 5))
            .collect()
    }

    fn config(strategy: StrategyKind) -> BalancerConfig {
        let mut c = BalancerConfig::new(strategy);
        c.panic_threshold = 0.0;
        c
    }

    /// Envoy's priority load by hand: health_p = min(1, 1.4 x up_p / n_p), H = min(1, sum),
    /// level 0 takes min(1, h_0 / H), level 1 the rest (capped at h_1 / H).
    fn closed_form(up0: usize, up1: usize) -> (f64, f64) {
        let h0 = (1.4 * up0 as f64 / 5.0).min(1.0);
        let h1 = (1.4 * up1 as f64 / 5.0).min(1.0);
        let total = (h0 + h1).min(1.0);
        let l0 = (h0 / total).min(1.0);
        let l1 = (h1 / total).min(1.0 - l0);
        (l0, l1)
    }

    #[test]
    fn the_next_priority_level_takes_traffic_as_the_first_loses_health() {
        let specs = two_levels();
        let now = Duration::from_secs(1);
        for (down0, down1) in [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (3, 4)] {
            let lb = Balancer::new(config(StrategyKind::RoundRobin), &specs).unwrap();
            let eps = lb.endpoints();
            for e in &eps[..down0] {
                lb.set_healthy(e.id(), false, now);
            }
            for e in &eps[5..5 + down1] {
                lb.set_healthy(e.id(), false, now);
            }
            let (want0, want1) = closed_form(5 - down0, 5 - down1);
            let shares = lb.priority_shares(now);
            assert!((shares[0].1 - want0).abs() < 1e-6, "{down0}: {shares:?}");
            assert!((shares[1].1 - want1).abs() < 1e-6, "{down0}: {shares:?}");
            let n = 20_000;
            let mut level1 = 0;
            for _ in 0..n {
                let p = lb.pick(&PickContext::new(now)).unwrap();
                assert!(lb.endpoints()[p.index()].is_healthy());
                level1 += usize::from(p.index() >= 5);
            }
            let got = level1 as f64 / n as f64;
            // Binomial standard deviation at most 0.0036: 0.015 is four of them.
            assert!(
                (got - want1).abs() < 0.015,
                "{down0},{down1}: {got} vs {want1}"
            );
        }
        // The table in docs/balancing.md: 1, 1, 0.84, 0.56, 0.28, 0 for 0..5 down.
        for (up, want) in [
            (5, 1.0),
            (4, 1.0),
            (3, 0.84),
            (2, 0.56),
            (1, 0.28),
            (0, 0.0),
        ] {
            assert!((closed_form(up, 5).0 - want).abs() < 1e-12, "{up}");
        }
    }

    #[test]
    fn strict_backup_needs_a_factor_of_the_levels_size() {
        // NGINX's and HAProxy's `backup`: two primaries and a backup, one primary down. With
        // Envoy's 1.4 the primaries' level is 1.4 x 1/2 = 0.7 healthy and the backup takes the
        // other 0.3; with a factor of at least the level's size (2) it takes nothing until every
        // primary is down.
        let specs: Vec<EndpointSpec> = (0..3)
            .map(|i| EndpointSpec::new(format!("10.0.0.{i}:80")).with_priority(u32::from(i == 2)))
            .collect();
        let now = Duration::from_secs(1);
        for (factor, want_backup) in [(1.4, 0.3), (2.0, 0.0), (1000.0, 0.0)] {
            let mut c = config(StrategyKind::RoundRobin);
            c.overprovisioning_factor = factor;
            let lb = Balancer::new(c, &specs).unwrap();
            lb.set_healthy(lb.endpoints()[0].id(), false, now);
            let n = 20_000;
            let backup = (0..n)
                .filter(|_| lb.pick(&PickContext::new(now)).unwrap().index() == 2)
                .count();
            let got = backup as f64 / n as f64;
            // Binomial standard deviation at most 0.0033 at 0.3: 0.015 is four and a half.
            assert!((got - want_backup).abs() < 0.015, "factor {factor}: {got}");
            // Every primary down: the backup takes everything, whatever the factor.
            lb.set_healthy(lb.endpoints()[1].id(), false, now);
            assert_eq!(lb.pick(&PickContext::new(now)).unwrap().index(), 2);
        }
    }

    fn zoned(mode: ZoneMode, local: &str, sizes: &[(&str, usize)]) -> Balancer {
        let mut specs = Vec::new();
        for (z, n) in sizes {
            for i in 0..*n {
                specs.push(EndpointSpec::new(format!("{z}-{i}:80")).with_zone(*z));
            }
        }
        let mut c = config(StrategyKind::LeastRequest);
        c.zone = Some(local.into());
        c.zone_routing = Some(ZoneRouting {
            mode,
            threshold: 1.0,
            ..ZoneRouting::default()
        });
        Balancer::new(c, &specs).unwrap()
    }

    fn zone_of(lb: &Balancer, index: usize) -> String {
        lb.specs()[index].zone.clone().unwrap()
    }

    #[test]
    fn host_count_routing_follows_envoys_formula() {
        // 4/4/3 endpoints, one balancer per zone: a and b have more than their third of the
        // endpoints (4/11 > 1/3) and keep everything; c keeps (3/11) / (1/3) = 9/11 and sends
        // the rest to a and b in proportion to their excess (4/11 - 1/3 each): 1/11 each.
        let sizes = [("a", 4), ("b", 4), ("c", 3)];
        let now = Duration::from_secs(1);
        for (local, want) in [
            ("a", [1.0, 0.0, 0.0]),
            ("c", [1.0 / 11.0, 1.0 / 11.0, 9.0 / 11.0]),
        ] {
            let lb = zoned(ZoneMode::HostCount, local, &sizes);
            let n = 30_000;
            let mut counts = [0usize; 3];
            for _ in 0..n {
                let p = lb.pick(&PickContext::new(now)).unwrap();
                let z = zone_of(&lb, p.index());
                counts[(z.as_bytes()[0] - b'a') as usize] += 1;
                lb.finish(p, crate::Outcome::Success, now);
            }
            for (c, w) in counts.iter().zip(want) {
                assert!(
                    (*c as f64 / n as f64 - w).abs() < 0.01,
                    "{local}: {counts:?}"
                );
            }
        }
    }

    #[test]
    fn load_routing_stays_local_under_the_threshold_and_spills_into_headroom() {
        // Two endpoints per zone, threshold 1 call in flight per unit of weight: zone a takes
        // two calls, then b and c take two each (only zones with headroom), then everyone in
        // proportion to weight.
        let lb = zoned(ZoneMode::Load, "a", &[("a", 2), ("b", 2), ("c", 2)]);
        let now = Duration::from_secs(1);
        let mut held = Vec::new();
        for k in 0..6 {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            let z = zone_of(&lb, p.index());
            if k < 2 {
                assert_eq!(z, "a", "pick {k}");
            } else {
                assert_ne!(z, "a", "pick {k}");
            }
            held.push(p);
        }
        let per_zone = |held: &[crate::Pick], z: &str| {
            held.iter().filter(|p| zone_of(&lb, p.index()) == z).count()
        };
        assert_eq!(per_zone(&held, "b"), 2);
        assert_eq!(per_zone(&held, "c"), 2);
        // One local call ends: the next pick is local again.
        let i = held
            .iter()
            .position(|p| zone_of(&lb, p.index()) == "a")
            .unwrap();
        drop(held.remove(i));
        let p = lb.pick(&PickContext::new(now)).unwrap();
        assert_eq!(zone_of(&lb, p.index()), "a");
        held.push(p);
        // Everyone full: picks spread by weight (6 endpoints of weight 1: a third each).
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            counts[(zone_of(&lb, p.index()).as_bytes()[0] - b'a') as usize] += 1;
            held.push(p);
        }
        for c in counts {
            assert!((c as f64 / 3000.0 - 1.0 / 3.0).abs() < 0.04, "{counts:?}");
        }
    }

    #[test]
    fn reported_load_from_other_balancers_counts() {
        let lb = zoned(ZoneMode::Load, "a", &[("a", 2), ("b", 2)]);
        let now = Duration::from_secs(1);
        // a's endpoints say they are busy (other balancers' calls): this balancer spills at
        // once, though it has nothing in flight there itself.
        for e in &lb.endpoints()[..2] {
            let r = LoadReport {
                in_flight: 3,
                latency: Duration::ZERO,
            };
            assert!(lb.report_load(e.id(), r, now));
        }
        let p = lb.pick(&PickContext::new(now)).unwrap();
        assert_eq!(zone_of(&lb, p.index()), "b");
        drop(p);
        // Reports older than report_max_age (1 s) no longer count.
        let later = now + Duration::from_millis(1500);
        let p = lb.pick(&PickContext::new(later)).unwrap();
        assert_eq!(zone_of(&lb, p.index()), "a");
    }

    #[test]
    fn a_hash_key_keeps_its_level_while_the_shares_stay() {
        // Level 0 at 3 of 5 up takes 0.84 of the keys, level 1 the rest; a key goes to the same
        // endpoint every time (the level is drawn from the key, not at random).
        let lb = Balancer::new(config(StrategyKind::RingHash), &two_levels()).unwrap();
        let now = Duration::from_secs(1);
        let eps = lb.endpoints();
        for e in &eps[..2] {
            lb.set_healthy(e.id(), false, now);
        }
        let mut level1 = 0;
        for k in 0..10_000u64 {
            let key = crate::mix64(k);
            let a = lb.pick(&PickContext::new(now).with_hash_key(key)).unwrap();
            let b = lb.pick(&PickContext::new(now).with_hash_key(key)).unwrap();
            assert_eq!(a.index(), b.index(), "key {k}");
            level1 += usize::from(a.index() >= 5);
        }
        assert!((level1 as f64 / 10_000.0 - 0.16).abs() < 0.015, "{level1}");
    }

    #[test]
    fn the_utilization_signal_reads_orca_reports() {
        let specs: Vec<EndpointSpec> = ["a", "a", "b", "b"]
            .iter()
            .enumerate()
            .map(|(i, z)| EndpointSpec::new(format!("{z}-{i}:80")).with_zone(*z))
            .collect();
        let mut c = config(StrategyKind::RoundRobin);
        c.zone = Some("a".into());
        c.zone_routing = Some(ZoneRouting {
            signal: ZoneSignal::Utilization,
            threshold: 0.8,
            ..ZoneRouting::default()
        });
        let lb = Balancer::new(c, &specs).unwrap();
        let now = Duration::from_secs(1);
        let eps = lb.endpoints();
        let report = |i: usize, cpu: f64| {
            let u = crate::Utilization {
                cpu,
                ..crate::Utilization::default()
            };
            assert!(lb.report_utilization(eps[i].id(), u, now));
        };
        // No report yet: local. Zone a at (0.9 + 0.8) / 2 = 0.85 >= 0.8: to b, whose reports
        // say 0.3 (headroom); at (0.7 + 0.8) / 2 = 0.75: local again.
        let zone = |lb: &Balancer| {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            zone_of(lb, p.index())
        };
        assert_eq!(zone(&lb), "a");
        report(0, 0.9);
        report(1, 0.8);
        report(2, 0.3);
        report(3, 0.3);
        for _ in 0..10 {
            assert_eq!(zone(&lb), "b");
        }
        report(0, 0.7);
        for _ in 0..10 {
            assert_eq!(zone(&lb), "a");
        }
    }

    #[test]
    fn a_retry_leaves_the_zone_when_the_zone_is_all_tried() {
        let lb = zoned(ZoneMode::Load, "a", &[("a", 1), ("b", 2)]);
        let now = Duration::from_secs(1);
        let first = lb.pick(&PickContext::new(now)).unwrap();
        assert_eq!(zone_of(&lb, first.index()), "a");
        let tried = [first.id()];
        drop(first);
        let again = lb.pick(&PickContext::new(now).with_avoid(&tried)).unwrap();
        assert_eq!(zone_of(&lb, again.index()), "b");
    }

    #[test]
    fn a_pinned_pick_keeps_its_endpoint_while_it_is_available() {
        let specs: Vec<EndpointSpec> = (0..5)
            .map(|i| EndpointSpec::new(format!("10.0.0.{i}:80")))
            .collect();
        let lb = Balancer::new(config(StrategyKind::RoundRobin), &specs).unwrap();
        let now = Duration::from_secs(1);
        let target = lb.endpoints()[3].clone();
        for _ in 0..10 {
            let p = lb
                .pick_pinned(&PickContext::new(now), target.token())
                .unwrap();
            assert_eq!(p.index(), 3);
        }
        lb.set_healthy(target.id(), false, now);
        let mut seen = [0usize; 5];
        for _ in 0..8 {
            let p = lb
                .pick_pinned(&PickContext::new(now), target.token())
                .unwrap();
            seen[p.index()] += 1;
        }
        // The strategy's picks (round-robin over the other four), never the failed one.
        assert_eq!(seen, [2, 2, 2, 0, 2]);
        // An unknown token is the strategy's pick.
        assert!(lb.pick_pinned(&PickContext::new(now), 42).is_some());
    }

    #[test]
    fn specs_keep_priority_and_zone_across_a_weight_change() {
        let specs = vec![
            EndpointSpec::new("a:1").with_zone("x").with_priority(1),
            EndpointSpec::new("b:1"),
        ];
        let lb = Balancer::new(config(StrategyKind::RoundRobin), &specs).unwrap();
        assert!(lb.set_weight("a:1", 3, Duration::ZERO).unwrap());
        let got = lb.specs();
        assert_eq!(got[0], specs[0].clone().with_weight(3));
        assert_eq!(got[1], specs[1]);
    }

    #[test]
    fn zone_routing_without_a_zone_is_refused_at_its_key() {
        let mut c = BalancerConfig::new(StrategyKind::RoundRobin);
        c.zone_routing = Some(ZoneRouting::default());
        assert_eq!(c.validate().unwrap_err().field.to_string(), "zone");
        c.zone = Some("a".into());
        c.zone_routing.as_mut().unwrap().threshold = 0.0;
        assert_eq!(
            c.validate().unwrap_err().field.to_string(),
            "zone_routing.threshold"
        );
        c.zone_routing = Some(ZoneRouting::default());
        c.overprovisioning_factor = 0.5;
        assert_eq!(
            c.validate().unwrap_err().field.to_string(),
            "overprovisioning_factor"
        );
    }
}
