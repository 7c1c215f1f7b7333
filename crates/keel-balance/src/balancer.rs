//! The one API every driver uses: build a [`Balancer`], [`Balancer::pick`] an endpoint, then
//! [`Balancer::finish`] the [`Pick`] with its [`Outcome`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::{check_endpoints, BalancerConfig};
use crate::endpoint::{Endpoint, EndpointId, EndpointSpec, EndpointStatus};
use crate::load::LoadReport;
use crate::rng::SharedRng;
use crate::strategy::{self, Observation, Strategy, View};
use crate::time::nanos;

/// What a call to an endpoint came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The endpoint answered as it should.
    Success,
    /// The endpoint failed the call: refused, reset, timed out, or answered with an error that
    /// the driver counts as the endpoint's fault.
    Failure,
}

/// Why a balancer could not be built or updated. [`BuildError::invalid_field`] names the
/// field at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BuildError {
    /// The configuration is out of range.
    #[error("invalid balancer configuration: {0}")]
    Config(#[from] crate::InvalidField),
    /// Two endpoints share an address.
    #[error("endpoint `{address}` is listed twice")]
    DuplicateEndpoint {
        /// Position of the second one in the list.
        index: usize,
        /// The address.
        address: String,
    },
    /// A weight of zero.
    #[error("endpoint `{address}` has weight 0; weights start at 1")]
    ZeroWeight {
        /// Position in the list.
        index: usize,
        /// The endpoint's address.
        address: String,
    },
    /// More endpoints than the strategy supports (ring-hash: 2^20).
    #[error("{strategy} supports at most {max} endpoints, got {count}")]
    TooManyEndpoints {
        /// The strategy.
        strategy: crate::StrategyKind,
        /// Its limit.
        max: usize,
        /// Endpoints given.
        count: usize,
    },
    /// More endpoints than a Maglev table of this size can hold.
    #[error("maglev table_size {size} must be larger than the endpoint count {count}")]
    TableTooSmall {
        /// Table size.
        size: u64,
        /// Endpoints.
        count: usize,
    },
}

/// What one pick is about.
#[derive(Debug, Clone, Copy)]
pub struct PickContext<'a> {
    /// The current time on the driver's clock (monotonic, any epoch).
    pub now: Duration,
    /// The request's key for the hash strategies (see [`crate::hash_key`]); without one they
    /// use a random key.
    pub hash_key: Option<u64>,
    /// Endpoints not to pick (the ones a retry already tried), unless no other is left.
    pub avoid: &'a [EndpointId],
}

impl<'a> PickContext<'a> {
    /// A context at `now` with no key and nothing to avoid.
    pub fn new(now: Duration) -> Self {
        Self {
            now,
            hash_key: None,
            avoid: &[],
        }
    }

    /// The same context with a hash key.
    pub fn with_hash_key(mut self, key: u64) -> Self {
        self.hash_key = Some(key);
        self
    }

    /// The same context, avoiding these endpoints.
    pub fn with_avoid(mut self, avoid: &'a [EndpointId]) -> Self {
        self.avoid = avoid;
        self
    }
}

/// A picked endpoint: one call in flight on it until [`Balancer::finish`] records the outcome.
/// Dropping it unfinished (a cancelled call) releases the in-flight slot and records nothing.
#[derive(Debug)]
#[must_use = "finish the pick with its outcome, or drop it to cancel"]
pub struct Pick {
    endpoint: Arc<Endpoint>,
    index: usize,
    picked_at: u64,
    group: Option<Arc<AtomicU64>>,
    open: bool,
}

impl Pick {
    /// The endpoint.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// Its position in the endpoint list when it was picked.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Its address.
    pub fn address(&self) -> &str {
        self.endpoint.address()
    }

    /// When it was picked, on the driver's clock (`PickContext::now`).
    pub fn picked_at(&self) -> Duration {
        Duration::from_nanos(self.picked_at)
    }

    /// Its identity (put it in [`PickContext::avoid`] for a retry).
    pub fn id(&self) -> EndpointId {
        self.endpoint.id()
    }

    fn release(&mut self) {
        if self.open {
            self.open = false;
            self.endpoint.end_call();
            if let Some(g) = &self.group {
                g.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Pick {
    fn drop(&mut self) {
        self.release();
    }
}

/// How many endpoints are out (unhealthy or ejected), recounted lazily when an ejection ends or
/// health changes, so that a pick does not scan every endpoint to apply the panic threshold.
#[derive(Debug)]
struct HealthSummary {
    unavailable: AtomicUsize,
    /// Recount at or after this instant (0: at the next pick; u64::MAX: nothing pending).
    recount_at: AtomicU64,
}

impl HealthSummary {
    fn refresh(&self, eps: &[Arc<Endpoint>], now: u64) {
        let mut out = 0;
        let mut next = u64::MAX;
        for e in eps {
            let until = e.ejected_until_ns();
            if until > now {
                next = next.min(until);
            }
            if !e.is_available(now) {
                out += 1;
            }
        }
        self.unavailable.store(out, Ordering::Relaxed);
        self.recount_at.store(next, Ordering::Relaxed);
    }
}

struct Snapshot {
    endpoints: Vec<Arc<Endpoint>>,
    strategy: Box<dyn Strategy>,
    health: HealthSummary,
}

/// A load balancer over a set of endpoints: one strategy, its protections (outlier ejection,
/// panic threshold, slow start) and the live state of every endpoint.
///
/// `Send + Sync`: share it in an `Arc` and pick from any number of threads. Picks are lock-free
/// except for weighted round-robin, whose smooth sequence needs one short lock.
pub struct Balancer {
    config: BalancerConfig,
    rng: SharedRng,
    /// Calls in flight over all endpoints (kept only for bounded loads).
    group: Arc<AtomicU64>,
    snapshot: ArcSwap<Snapshot>,
    /// The strategy's [`Strategy::follows_calls`] (fixed for a balancer's life), so that
    /// `finish` can skip the snapshot without loading it.
    follows_calls: bool,
}

impl std::fmt::Debug for Balancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer")
            .field("strategy", &self.config.strategy)
            .field("endpoints", &self.snapshot.load().endpoints.len())
            .finish()
    }
}

impl Balancer {
    /// Builds a balancer. Endpoints present at build time start at full weight (no slow start).
    pub fn new(config: BalancerConfig, endpoints: &[EndpointSpec]) -> Result<Self, BuildError> {
        config.validate()?;
        check_endpoints(&config, endpoints)?;
        let eps = Self::carry_over(&[], endpoints, 0);
        let snapshot = Self::snapshot(&config, eps);
        Ok(Self {
            rng: SharedRng::new(config.seed),
            config,
            group: Arc::new(AtomicU64::new(0)),
            follows_calls: snapshot.strategy.follows_calls(),
            snapshot: ArcSwap::from_pointee(snapshot),
        })
    }

    /// A new balancer (e.g. from a reloaded configuration) that keeps the live state of the
    /// endpoints it shares with `self`: in-flight counts, health, ejections, latency estimates.
    /// New endpoints start their slow start at `now`.
    pub fn rebuild(
        &self,
        config: BalancerConfig,
        endpoints: &[EndpointSpec],
        now: Duration,
    ) -> Result<Self, BuildError> {
        config.validate()?;
        check_endpoints(&config, endpoints)?;
        let old = self.snapshot.load();
        let eps = Self::carry_over(&old.endpoints, endpoints, nanos(now).max(1));
        let snapshot = Self::snapshot(&config, eps);
        Ok(Self {
            rng: SharedRng::new(config.seed),
            config,
            group: self.group.clone(),
            follows_calls: snapshot.strategy.follows_calls(),
            snapshot: ArcSwap::from_pointee(snapshot),
        })
    }

    /// Replaces the endpoint list in place (add, remove, re-weight). Endpoints that stay keep
    /// their state; hash tables are rebuilt; picks in flight finish normally.
    pub fn update(&self, endpoints: &[EndpointSpec], now: Duration) -> Result<(), BuildError> {
        check_endpoints(&self.config, endpoints)?;
        let old = self.snapshot.load();
        let eps = Self::carry_over(&old.endpoints, endpoints, nanos(now).max(1));
        let snapshot = Self::snapshot(&self.config, eps);
        self.snapshot.store(Arc::new(snapshot));
        Ok(())
    }

    /// Changes one endpoint's weight (a rebuild of the tables that depend on weights).
    /// Returns false if no endpoint has that address.
    pub fn set_weight(
        &self,
        address: &str,
        weight: u32,
        now: Duration,
    ) -> Result<bool, BuildError> {
        let mut specs = self.specs();
        let Some(s) = specs.iter_mut().find(|s| s.address == address) else {
            return Ok(false);
        };
        s.weight = weight;
        self.update(&specs, now)?;
        Ok(true)
    }

    /// The endpoints of `specs` (checked by `check_endpoints`), reusing those of `old`.
    fn carry_over(
        old: &[Arc<Endpoint>],
        specs: &[EndpointSpec],
        ramp_from: u64,
    ) -> Vec<Arc<Endpoint>> {
        // Indexed by address so that an update of n endpoints is O(n), not O(n^2).
        let old: std::collections::HashMap<&str, &Arc<Endpoint>> =
            old.iter().map(|e| (e.address(), e)).collect();
        specs
            .iter()
            .map(|s| match old.get(s.address.as_str()) {
                Some(e) => {
                    e.set_weight(s.weight);
                    Arc::clone(e)
                }
                None => Arc::new(Endpoint::new(s, ramp_from)),
            })
            .collect()
    }

    fn snapshot(config: &BalancerConfig, endpoints: Vec<Arc<Endpoint>>) -> Snapshot {
        Snapshot {
            strategy: strategy::build(config.strategy, &config.options, &endpoints),
            health: HealthSummary {
                unavailable: AtomicUsize::new(0),
                recount_at: AtomicU64::new(0),
            },
            endpoints,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BalancerConfig {
        &self.config
    }

    /// The endpoints, in configuration order.
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.snapshot.load().endpoints.clone()
    }

    /// The endpoint list as specs (address and weight).
    pub fn specs(&self) -> Vec<EndpointSpec> {
        self.snapshot
            .load()
            .endpoints
            .iter()
            .map(|e| EndpointSpec::new(e.address()).with_weight(e.weight()))
            .collect()
    }

    /// Number of ring points (ring-hash only).
    pub fn ring_points(&self) -> Option<usize> {
        self.snapshot.load().strategy.ring_points()
    }

    /// True while fewer than `panic_threshold` percent of the endpoints are available, so that
    /// picks ignore health.
    pub fn is_panicking(&self, now: Duration) -> bool {
        let snap = self.snapshot.load();
        self.panic(&snap, nanos(now))
    }

    fn panic(&self, snap: &Snapshot, now: u64) -> bool {
        let h = &snap.health;
        if now >= h.recount_at.load(Ordering::Relaxed) {
            h.refresh(&snap.endpoints, now);
            // An ejection ended or a health verdict changed: strategies that index the
            // available endpoints re-read them.
            snap.strategy.refresh(&self.view(snap, now), None);
        }
        let out = h.unavailable.load(Ordering::Relaxed);
        if out == 0 || self.config.panic_threshold <= 0.0 {
            return false;
        }
        let n = snap.endpoints.len();
        ((n - out.min(n)) as f64) * 100.0 < self.config.panic_threshold * n as f64
    }

    /// A view of every endpoint at `now`, health respected, nothing avoided.
    fn view<'a>(&'a self, snap: &'a Snapshot, now: u64) -> View<'a> {
        View {
            eps: &snap.endpoints,
            now,
            avoid: &[],
            ignore_health: false,
            slow_start: self.config.slow_start.as_ref(),
            rng: &self.rng,
            group: &self.group,
            half_open: false,
        }
    }

    /// Picks an endpoint for one call. `None` when no endpoint may take it (empty list, or all
    /// unavailable with the panic threshold off). Endpoints in `ctx.avoid` are skipped while
    /// another one is allowed.
    pub fn pick(&self, ctx: &PickContext<'_>) -> Option<Pick> {
        let snap = self.snapshot.load();
        let now = nanos(ctx.now);
        let mut view = View {
            eps: &snap.endpoints,
            now,
            avoid: ctx.avoid,
            ignore_health: self.panic(&snap, now),
            slow_start: self.config.slow_start.as_ref(),
            rng: &self.rng,
            group: &self.group,
            half_open: false,
        };
        let strategy = &snap.strategy;
        view.half_open = strategy.half_open();
        let mut index = strategy.pick(&view, ctx.hash_key);
        if index.is_none() && !ctx.avoid.is_empty() {
            // Nothing else left: a retry may go back to an endpoint it already tried.
            view.avoid = &[];
            index = strategy.pick(&view, ctx.hash_key);
        }
        if index.is_none() && view.half_open {
            // Every endpoint left is on trial with its trial call in flight: better a second
            // call there than none at all.
            view.half_open = false;
            index = strategy.pick(&view, ctx.hash_key);
        }
        let index = index?;
        let endpoint = snap.endpoints[index].clone();
        endpoint.begin_call();
        if strategy.follows_calls() {
            strategy.started(&view, index);
        }
        let group = strategy.uses_group_load().then(|| {
            self.group.fetch_add(1, Ordering::Relaxed);
            self.group.clone()
        });
        Some(Pick {
            endpoint,
            index,
            picked_at: now,
            group,
            open: true,
        })
    }

    /// Records the outcome of a picked call that ended at `now` (its latency is `now` minus the
    /// pick's time): in-flight counts, latency estimates, outlier detection. Returns true when
    /// this outcome ejected the endpoint.
    pub fn finish(&self, mut pick: Pick, outcome: Outcome, now: Duration) -> bool {
        pick.release();
        let now = nanos(now);
        let e = &*pick.endpoint;
        let failed = outcome == Outcome::Failure;
        e.count_outcome(failed);
        // Only strategies that follow calls and outlier detection need the snapshot: the
        // others skip its load.
        let follows = self.follows_calls;
        if !follows && self.config.outlier_detection.is_none() {
            return false;
        }
        let snap = self.snapshot.load();
        // The pick's index is the endpoint's place in the snapshot it came from; after an
        // update, look it up again.
        let index = || {
            if snap
                .endpoints
                .get(pick.index)
                .is_some_and(|x| Arc::ptr_eq(x, &pick.endpoint))
            {
                Some(pick.index)
            } else {
                snap.endpoints
                    .iter()
                    .position(|x| Arc::ptr_eq(x, &pick.endpoint))
            }
        };
        if follows {
            if snap.strategy.half_open() {
                e.set_trial(failed);
            }
            if let Some(i) = index() {
                snap.strategy.observe(
                    &self.view(&snap, now),
                    i,
                    &Observation::CallEnded {
                        outcome,
                        latency_ns: now.saturating_sub(pick.picked_at),
                    },
                );
            }
        }
        if let Some(od) = &self.config.outlier_detection {
            let mut st = e.outlier();
            if st.record(od, failed, now) && e.ejected_until_ns() <= now {
                let ejected = snap
                    .endpoints
                    .iter()
                    .filter(|x| x.ejected_until_ns() > now)
                    .count();
                if ejected < od.max_ejected(snap.endpoints.len()) {
                    let until = st.eject(od, now);
                    e.eject(until);
                    if let Some(i) = index() {
                        snap.strategy.refresh(&self.view(&snap, now), Some(i));
                    }
                    snap.health.unavailable.fetch_add(1, Ordering::Relaxed);
                    snap.health.recount_at.fetch_min(until, Ordering::Relaxed);
                    return true;
                }
            }
        }
        false
    }

    /// True if the strategy balances on the endpoints' load reports (prequal): only then are
    /// [`Self::probe_targets`] and [`Self::report_load`] worth the driver's work.
    pub fn uses_load_reports(&self) -> bool {
        self.snapshot.load().strategy.uses_load_reports()
    }

    /// Appends to `out` the endpoints the strategy wants probed now (prequal: a few random
    /// ones, to call after each pick; the others: none). The driver sends the probes as it
    /// likes and hands the answers to [`Self::report_load`].
    pub fn probe_targets(&self, now: Duration, out: &mut Vec<EndpointId>) {
        let snap = self.snapshot.load();
        if !snap.strategy.uses_load_reports() {
            return;
        }
        let now = nanos(now);
        let view = View {
            eps: &snap.endpoints,
            now,
            avoid: &[],
            ignore_health: self.panic(&snap, now),
            slow_start: self.config.slow_start.as_ref(),
            rng: &self.rng,
            group: &self.group,
            half_open: false,
        };
        snap.strategy.probe_targets(&view, out);
    }

    /// What endpoint `id` says about its load (a probe's answer, or an answer's headers),
    /// received at `now`. Returns false if no endpoint has that id. Strategies that do not
    /// balance on reports ignore it.
    pub fn report_load(&self, id: EndpointId, report: LoadReport, now: Duration) -> bool {
        let snap = self.snapshot.load();
        let Some(index) = snap.endpoints.iter().position(|e| e.id() == id) else {
            return false;
        };
        if snap.strategy.uses_load_reports() {
            let view = View {
                eps: &snap.endpoints,
                now: nanos(now),
                avoid: &[],
                ignore_health: false,
                slow_start: self.config.slow_start.as_ref(),
                rng: &self.rng,
                group: &self.group,
                half_open: false,
            };
            snap.strategy
                .observe(&view, index, &Observation::Load(report));
        }
        true
    }

    /// Sets an endpoint's active-health-check verdict. Back to healthy starts its slow start.
    /// Returns false if no endpoint has that id.
    pub fn set_healthy(&self, id: EndpointId, healthy: bool, now: Duration) -> bool {
        let snap = self.snapshot.load();
        let Some(e) = snap.endpoints.iter().find(|e| e.id() == id) else {
            return false;
        };
        if e.set_healthy(healthy, nanos(now)) {
            snap.health.recount_at.store(0, Ordering::Relaxed);
        }
        true
    }

    /// A copy of every endpoint's state, for status pages and reports.
    pub fn status(&self, now: Duration) -> Vec<EndpointStatus> {
        let snap = self.snapshot.load();
        let view = self.view(&snap, nanos(now));
        snap.endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let (successes, failures) = e.outcomes();
                let (ejections, ejections_total) = {
                    let st = e.outlier();
                    (st.ejections, st.ejections_total)
                };
                EndpointStatus {
                    id: e.id().0,
                    address: e.address().to_string(),
                    weight: e.weight(),
                    effective_weight: e.weight() as f64 * view.ramp(i),
                    healthy: e.is_healthy(),
                    ejected_until: e.ejected_until(now),
                    ejections,
                    ejections_total,
                    in_flight: e.in_flight(),
                    latency_estimate: e.latency_estimate(),
                    successes,
                    failures,
                }
            })
            .collect()
    }
}
