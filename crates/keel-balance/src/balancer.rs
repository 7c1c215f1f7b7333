//! The one API every driver uses: build a [`Balancer`], [`Balancer::pick`] an endpoint, then
//! [`Balancer::finish`] the [`Pick`] with its [`Outcome`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::{check_endpoints, BalancerConfig};
use crate::endpoint::{Endpoint, EndpointId, EndpointSpec, EndpointStatus};
use crate::load::{LoadReport, Utilization};
use crate::locality::{Layout, LocalityConfig, Placement};
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

impl Outcome {
    /// What an endpoint's HTTP status says of the endpoint, whatever is retried: every 5xx but
    /// 501 and 505 is its failure (those two answer the request's method or HTTP version, not
    /// the endpoint's health). The one rule the proxy, the lab and `keel advise`'s fits share.
    #[inline]
    pub fn of_status(status: u16) -> Outcome {
        if matches!(status, 500..=599) && status != 501 && status != 505 {
            Outcome::Failure
        } else {
            Outcome::Success
        }
    }
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
    /// use a random key. For `prefix-affinity`, a session's key: its calls go to one endpoint
    /// among those that match the prompt equally well.
    pub hash_key: Option<u64>,
    /// Endpoints not to pick (the ones a retry already tried), unless no other is left.
    pub avoid: &'a [EndpointId],
    /// The prompt's block names for `prefix-affinity` ([`crate::prefix::PrefixHasher::blocks`]),
    /// first block first; empty when the request has no prompt (the pick is then by load).
    pub prefix: &'a [u64],
}

impl<'a> PickContext<'a> {
    /// A context at `now` with no key and nothing to avoid.
    pub fn new(now: Duration) -> Self {
        Self {
            now,
            hash_key: None,
            avoid: &[],
            prefix: &[],
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

    /// The same context with the prompt's block names.
    pub fn with_prefix(mut self, blocks: &'a [u64]) -> Self {
        self.prefix = blocks;
        self
    }

    /// What the strategy reads of the request.
    #[inline]
    fn call(&self) -> strategy::Call<'a> {
        strategy::Call {
            key: self.hash_key,
            prefix: self.prefix,
        }
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
    /// Of those, drained by the operator: out of the panic threshold's count altogether.
    draining: AtomicUsize,
    /// Recount at or after this instant (0: at the next pick; u64::MAX: nothing pending).
    recount_at: AtomicU64,
}

impl HealthSummary {
    fn refresh(&self, eps: &[Arc<Endpoint>], now: u64) {
        let mut out = 0;
        let mut draining = 0;
        let mut next = u64::MAX;
        for e in eps {
            if e.is_draining() {
                draining += 1;
            }
            let until = e.ejected_until_ns();
            if until > now {
                next = next.min(until);
            }
            if !e.is_available(now) {
                out += 1;
            }
        }
        self.unavailable.store(out, Ordering::Relaxed);
        self.draining.store(draining, Ordering::Relaxed);
        self.recount_at.store(next, Ordering::Relaxed);
    }
}

struct Snapshot {
    endpoints: Vec<Arc<Endpoint>>,
    /// Each endpoint's priority and zone, as configured.
    placements: Vec<Placement>,
    /// The groups a pick chooses between (priority levels, zones) before the strategy.
    layout: Layout,
    /// One strategy per group of the layout, built over the group's members only.
    strategies: Vec<Box<dyn Strategy>>,
    /// Endpoint tokens to places, for pinned picks.
    tokens: std::collections::HashMap<u64, usize>,
    health: HealthSummary,
}

impl Snapshot {
    /// `v` over group `g`'s members.
    #[inline]
    fn in_group<'a>(&'a self, v: &View<'a>, g: usize) -> View<'a> {
        v.over(&self.layout.groups[g].eps)
    }

    /// Tells endpoint `i`'s group strategy what the balancer learned.
    #[inline]
    fn observe(&self, v: &View<'_>, i: usize, what: &Observation) {
        if self.layout.is_trivial() {
            // One group of every endpoint in order, as `pick`'s fast path: no remapping.
            return self.strategies[0].observe(v, i, what);
        }
        let (g, local) = self.layout.place[i];
        self.strategies[g as usize].observe(&self.in_group(v, g as usize), local as usize, what);
    }

    /// Every group strategy re-reads availability (and the layout its health counts).
    fn refresh_all(&self, v: &View<'_>) {
        for (g, s) in self.strategies.iter().enumerate() {
            s.refresh(&self.in_group(v, g), None);
        }
        self.layout.refresh(v.now);
    }
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
    /// Bumped after every store into `snapshot`, so that the `_mut` methods know when their
    /// copy (`local`) is out of date.
    generation: AtomicU64,
    /// The snapshot as the `_mut` methods last read it, with `generation` then. A balancer
    /// that one owner drives alone (the simulator's thousands) reads it through `&mut self`,
    /// without arc-swap's load (about a tenth of a simulated call); shared balancers never
    /// read it.
    local: (u64, Arc<Snapshot>),
    /// The strategy's [`Strategy::follows_calls`] (fixed for a balancer's life), so that
    /// `finish` can skip the snapshot without loading it.
    follows_calls: bool,
    /// The latest end of any endpoint's back-off (nanoseconds; 0: none ever): until then,
    /// picks look at each endpoint's, and after it they skip that check.
    backed_off_until: AtomicU64,
    /// Held while a back-off is checked against `max_backed_off_percent` and set, so that two
    /// at once cannot both pass the cap (taken only when an endpoint asks to be backed off).
    back_off_lock: std::sync::Mutex<()>,
    /// `config.queue_max_age` in nanoseconds (0: reported queues are not read), for the views.
    queue_max_age_ns: u64,
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
        let snapshot = Self::snapshot(&config, endpoints, eps);
        Ok(Self::with(config, Arc::new(AtomicU64::new(0)), snapshot))
    }

    fn with(config: BalancerConfig, group: Arc<AtomicU64>, snapshot: Snapshot) -> Self {
        let snapshot = Arc::new(snapshot);
        Self {
            rng: SharedRng::new(config.seed),
            queue_max_age_ns: config.queue_max_age.map_or(0, |a| nanos(a).max(1)),
            config,
            group,
            follows_calls: snapshot.strategies[0].follows_calls(),
            local: (0, snapshot.clone()),
            snapshot: ArcSwap::new(snapshot),
            generation: AtomicU64::new(0),
            backed_off_until: AtomicU64::new(0),
            back_off_lock: std::sync::Mutex::new(()),
        }
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
        let snapshot = Self::snapshot(&config, endpoints, eps);
        let new = Self::with(config, self.group.clone(), snapshot);
        // The endpoints kept keep their back-offs.
        let backed_off = self.backed_off_until.load(Ordering::Relaxed);
        new.backed_off_until.store(backed_off, Ordering::Relaxed);
        Ok(new)
    }

    /// Replaces the endpoint list in place (add, remove, re-weight). Endpoints that stay keep
    /// their state; hash tables are rebuilt; picks in flight finish normally.
    pub fn update(&self, endpoints: &[EndpointSpec], now: Duration) -> Result<(), BuildError> {
        check_endpoints(&self.config, endpoints)?;
        let old = self.snapshot.load();
        let eps = Self::carry_over(&old.endpoints, endpoints, nanos(now).max(1));
        let snapshot = Self::snapshot(&self.config, endpoints, eps);
        self.snapshot.store(Arc::new(snapshot));
        self.generation.fetch_add(1, Ordering::Release);
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

    fn snapshot(
        config: &BalancerConfig,
        specs: &[EndpointSpec],
        endpoints: Vec<Arc<Endpoint>>,
    ) -> Snapshot {
        let placements: Vec<Placement> = specs.iter().map(Placement::from).collect();
        let locality = LocalityConfig {
            zone: config.zone.as_deref(),
            routing: config.zone_routing.as_ref(),
            factor: config.overprovisioning_factor,
        };
        let layout = Layout::new(&locality, &placements, &endpoints);
        let strategies = layout
            .groups
            .iter()
            .map(|g| strategy::build(config.strategy, &config.options, &g.eps))
            .collect();
        Snapshot {
            strategies,
            layout,
            placements,
            tokens: endpoints
                .iter()
                .enumerate()
                .map(|(i, e)| (e.token(), i))
                .collect(),
            health: HealthSummary {
                unavailable: AtomicUsize::new(0),
                draining: AtomicUsize::new(0),
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

    /// The endpoint list as specs (address, weight, priority, zone).
    pub fn specs(&self) -> Vec<EndpointSpec> {
        let snap = self.snapshot.load();
        snap.endpoints
            .iter()
            .zip(&snap.placements)
            .map(|(e, p)| EndpointSpec {
                address: e.address().to_string(),
                weight: e.weight(),
                priority: p.priority,
                zone: p.zone.clone(),
            })
            .collect()
    }

    /// Number of ring points (ring-hash only; summed over priority levels and zones).
    pub fn ring_points(&self) -> Option<usize> {
        let snap = self.snapshot.load();
        snap.strategies
            .iter()
            .map(|s| s.ring_points())
            .try_fold(0, |a, b| b.map(|b| a + b))
    }

    /// The share of picks each priority level takes now, as (priority, share), lowest first.
    pub fn priority_shares(&self, now: Duration) -> Vec<(u32, f64)> {
        let snap = self.snapshot.load();
        self.panic(&snap, nanos(now));
        let mut prev = 0u32;
        snap.layout
            .levels
            .iter()
            .zip(&snap.layout.level_cum)
            .map(|(l, c)| {
                let c = c.load(Ordering::Relaxed);
                let share = f64::from(c - prev.min(c)) / 1e6;
                prev = c;
                (l.priority, share)
            })
            .collect()
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
            // available endpoints re-read them, and the priority shares are recounted.
            snap.refresh_all(&self.view(snap, now));
        }
        let out = h.unavailable.load(Ordering::Relaxed);
        if out == 0 || self.config.panic_threshold <= 0.0 {
            return false;
        }
        // Drained endpoints are neither up nor down: the operator took them out of the set,
        // and they take no call in panic mode either (`View::allowed`).
        let drained = h.draining.load(Ordering::Relaxed);
        let n = snap.endpoints.len() - drained.min(snap.endpoints.len());
        let out = out - drained.min(out);
        out > 0 && ((n - out.min(n)) as f64) * 100.0 < self.config.panic_threshold * n as f64
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
            back_off: false,
            queue_max_age: self.queue_max_age_ns,
        }
    }

    /// Picks an endpoint for one call. `None` when no endpoint may take it (empty list, or all
    /// unavailable with the panic threshold off). Endpoints in `ctx.avoid` are skipped while
    /// another one is allowed. With priority levels or zone routing, the level and zone are
    /// chosen first (see docs/balancing.md, "Priorities and zones"), then the strategy picks
    /// within them; a group with nothing left to pick passes the pick to the next.
    pub fn pick(&self, ctx: &PickContext<'_>) -> Option<Pick> {
        let snap = self.snapshot.load();
        self.pick_in(&snap, ctx)
    }

    /// The snapshot for the `_mut` methods: their copy, re-read after an update (checked
    /// without an atomic operation: `&mut self` means no update runs meanwhile).
    #[inline]
    fn local(&mut self) -> (&Self, &Snapshot) {
        let generation = *self.generation.get_mut();
        if self.local.0 != generation {
            self.local = (generation, self.snapshot.load_full());
        }
        (self, &self.local.1)
    }

    /// [`Self::pick`] by the balancer's one owner (`&mut`): the same pick, on the snapshot it
    /// read last unless an update came since, instead of arc-swap's atomic load.
    pub fn pick_mut(&mut self, ctx: &PickContext<'_>) -> Option<Pick> {
        let (this, snap) = self.local();
        this.pick_in(snap, ctx)
    }

    #[inline(always)]
    fn pick_in(&self, snap: &Snapshot, ctx: &PickContext<'_>) -> Option<Pick> {
        let now = nanos(ctx.now);
        let panic = self.panic(snap, now);
        let mut view = View {
            eps: &snap.endpoints,
            now,
            avoid: ctx.avoid,
            ignore_health: panic,
            slow_start: self.config.slow_start.as_ref(),
            rng: &self.rng,
            group: &self.group,
            half_open: snap.strategies[0].half_open(),
            back_off: self.backing_off(now),
            queue_max_age: self.queue_max_age_ns,
        };
        if snap.layout.is_trivial() {
            // One group holding every endpoint in order (no priorities, no zones): the
            // strategy's index is the endpoint's, and no group is chosen.
            let s = &snap.strategies[0];
            let index = s
                .pick(&view, ctx.call())
                .or_else(|| relaxed(&mut view, ctx, |v| s.pick(v, ctx.call())));
            let i = index?;
            return Some(self.start(snap, &view, 0, i, i, now));
        }
        self.pick_grouped(snap, view, ctx, panic)
    }

    /// [`Self::pick`] with priority levels or zones: the group first, then the strategy.
    #[inline(never)]
    fn pick_grouped(
        &self,
        snap: &Snapshot,
        mut view: View<'_>,
        ctx: &PickContext<'_>,
        panic: bool,
    ) -> Option<Pick> {
        let now = view.now;
        let first = snap.layout.choose(now, panic, &self.rng, ctx.hash_key);
        let (g, local) = Self::pick_from(snap, &view, first, ctx.call()).or_else(|| {
            relaxed(&mut view, ctx, |v| {
                Self::pick_from(snap, v, first, ctx.call())
            })
        })?;
        let index = snap.layout.groups[g].members[local];
        Some(self.start(snap, &view, g, local, index, now))
    }

    /// The strategy's pick in group `first`, or else in the others in order (priority order).
    fn pick_from(
        snap: &Snapshot,
        view: &View<'_>,
        first: usize,
        call: strategy::Call<'_>,
    ) -> Option<(usize, usize)> {
        let n = snap.strategies.len();
        let order = std::iter::once(first).chain((0..n).filter(move |&g| g != first));
        for g in order {
            if let Some(local) = snap.strategies[g].pick(&snap.in_group(view, g), call) {
                return Some((g, local));
            }
        }
        None
    }

    /// Counts a call on member `local` of group `g`, endpoint `index`, and makes its pick.
    #[inline(always)]
    fn start(
        &self,
        snap: &Snapshot,
        view: &View<'_>,
        g: usize,
        local: usize,
        index: usize,
        now: u64,
    ) -> Pick {
        let endpoint = snap.endpoints[index].clone();
        endpoint.begin_call();
        let strategy = &snap.strategies[g];
        if self.follows_calls {
            strategy.started(&snap.in_group(view, g), local);
        }
        let group = strategy.uses_group_load().then(|| {
            self.group.fetch_add(1, Ordering::Relaxed);
            self.group.clone()
        });
        Pick {
            endpoint,
            index,
            picked_at: now,
            group,
            open: true,
        }
    }

    /// A pick for a pinned session (a sticky cookie): the endpoint whose
    /// [`Endpoint::token`] is `token` while it may take the call (available, or panic mode;
    /// not in `ctx.avoid`), otherwise the strategy's pick, as [`Self::pick`]. The caller
    /// re-pins the session to the endpoint it gets, so that a session moves once when its
    /// endpoint fails, and stays where it moved when the endpoint comes back.
    pub fn pick_pinned(&self, ctx: &PickContext<'_>, token: u64) -> Option<Pick> {
        let snap = self.snapshot.load();
        if let Some(&i) = snap.tokens.get(&token) {
            let now = nanos(ctx.now);
            let view = View {
                eps: &snap.endpoints,
                now,
                avoid: ctx.avoid,
                ignore_health: self.panic(&snap, now),
                slow_start: self.config.slow_start.as_ref(),
                rng: &self.rng,
                group: &self.group,
                half_open: false,
                back_off: self.backing_off(now),
                queue_max_age: self.queue_max_age_ns,
            };
            if view.allowed(i) {
                let (g, local) = snap.layout.place[i];
                return Some(self.start(&snap, &view, g as usize, local as usize, i, now));
            }
        }
        drop(snap);
        self.pick(ctx)
    }

    /// Backs the picked endpoint off for `asked` from `now`, because it asked (an HTTP
    /// `Retry-After`, a gRPC pushback): every pick passes it over while another endpoint may
    /// take the call (health, ejection and the retry's avoid list respected), and takes it
    /// again when none else may, so that a back-off never leaves a cluster without an endpoint.
    /// What an answer can do is bounded: at most `max_back_off` long, and at most
    /// `max_backed_off_percent` of the endpoints backed off at once (counted as
    /// `max_ejection_percent` counts ejections); past that share the back-off is refused. It is
    /// not an ejection and does not count toward one: the failure the answer was is recorded
    /// by [`Self::finish`] as any other, outlier detection included. Returns the end of the
    /// endpoint's back-off, or `None` when it was refused (or `asked` is zero).
    pub fn back_off(&self, pick: &Pick, now: Duration, asked: Duration) -> Option<Duration> {
        let asked = asked.min(self.config.max_back_off);
        if asked.is_zero() {
            return None;
        }
        let (now_ns, until) = (nanos(now), nanos(now + asked));
        let _one_at_a_time = self.back_off_lock.lock().unwrap_or_else(|p| p.into_inner());
        if !pick.endpoint.backed_off(now_ns) {
            let snap = self.snapshot.load();
            let cap =
                crate::outlier::share_of(snap.endpoints.len(), self.config.max_backed_off_percent);
            let out = snap
                .endpoints
                .iter()
                .filter(|e| e.backed_off(now_ns))
                .count();
            if out >= cap {
                return None;
            }
        }
        pick.endpoint.back_off(until);
        self.backed_off_until.fetch_max(until, Ordering::Relaxed);
        // A longer back-off it already had stands.
        pick.endpoint.backed_off_until(now)
    }

    /// True when a pick at `ctx.now` has an endpoint outside `ctx.avoid` that may take the
    /// call (health and ejection respected, back-offs not): then a retry need not wait for an
    /// endpoint that asked to be backed off.
    pub fn has_other_endpoint(&self, ctx: &PickContext<'_>) -> bool {
        let snap = self.snapshot.load();
        let now = nanos(ctx.now);
        let view = View {
            avoid: ctx.avoid,
            ignore_health: self.panic(&snap, now),
            ..self.view(&snap, now)
        };
        (0..snap.endpoints.len()).any(|i| view.allowed(i))
    }

    /// True while some endpoint may be backed off at `now` (one atomic load per pick).
    #[inline(always)]
    fn backing_off(&self, now: u64) -> bool {
        self.backed_off_until.load(Ordering::Relaxed) > now
    }

    /// Records the outcome of a picked call that ended at `now` (its latency is `now` minus the
    /// pick's time): in-flight counts, latency estimates, outlier detection. Returns true when
    /// this outcome ejected the endpoint.
    pub fn finish(&self, mut pick: Pick, outcome: Outcome, now: Duration) -> bool {
        if !self.finish_counts(&mut pick, outcome) {
            return false;
        }
        let snap = self.snapshot.load();
        self.finish_in(&snap, pick, outcome, nanos(now))
    }

    /// [`Self::finish`] by the balancer's one owner (`&mut`), as [`Self::pick_mut`].
    pub fn finish_mut(&mut self, mut pick: Pick, outcome: Outcome, now: Duration) -> bool {
        if !self.finish_counts(&mut pick, outcome) {
            return false;
        }
        let (this, snap) = self.local();
        this.finish_in(snap, pick, outcome, nanos(now))
    }

    /// What every finish does: releases the pick and counts its outcome. True when the rest
    /// needs the snapshot (strategies that follow calls, outlier detection): the others skip
    /// its load.
    #[inline(always)]
    fn finish_counts(&self, pick: &mut Pick, outcome: Outcome) -> bool {
        pick.release();
        pick.endpoint.count_outcome(outcome == Outcome::Failure);
        self.follows_calls || self.config.outlier_detection.is_some()
    }

    #[inline(always)]
    fn finish_in(&self, snap: &Snapshot, pick: Pick, outcome: Outcome, now: u64) -> bool {
        let e = &*pick.endpoint;
        let failed = outcome == Outcome::Failure;
        let follows = self.follows_calls;
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
            if snap.strategies[0].half_open() {
                e.set_trial(failed);
            }
            if let Some(i) = index() {
                snap.observe(
                    &self.view(snap, now),
                    i,
                    &Observation::CallEnded {
                        outcome,
                        latency_ns: now.saturating_sub(pick.picked_at),
                    },
                );
            }
        }
        self.judge(snap, e, failed, crate::outlier::LOCAL_SOURCE, now, index)
    }

    /// Outlier detection's part of an outcome on endpoint `e` (observed by `source`): records it
    /// and ejects the endpoint when a rule says so and the cap allows. `index` finds `e`'s place
    /// in `snap` (looked up only when it ejects). True when it ejected.
    #[inline(always)]
    fn judge(
        &self,
        snap: &Snapshot,
        e: &Endpoint,
        failed: bool,
        source: u64,
        now: u64,
        index: impl Fn() -> Option<usize>,
    ) -> bool {
        if let Some(od) = &self.config.outlier_detection {
            let mut st = e.outlier();
            if st.record(od, failed, source, now) && e.ejected_until_ns() <= now {
                let ejected = snap
                    .endpoints
                    .iter()
                    .filter(|x| x.ejected_until_ns() > now)
                    .count();
                if ejected < od.max_ejected(snap.endpoints.len()) {
                    let until = st.eject(od, now);
                    e.eject(until);
                    if let Some(i) = index() {
                        let (g, local) = snap.layout.place[i];
                        let v = self.view(snap, now);
                        snap.strategies[g as usize]
                            .refresh(&snap.in_group(&v, g as usize), Some(local as usize));
                    }
                    snap.health.unavailable.fetch_add(1, Ordering::Relaxed);
                    // Priority shares depend on health: recount at the next pick.
                    let at = if snap.layout.is_trivial() { until } else { 0 };
                    snap.health.recount_at.fetch_min(at, Ordering::Relaxed);
                    return true;
                }
            }
        }
        false
    }

    /// Records an outcome of a call to endpoint `id` that *another* balancer observed (a fleet
    /// sharing its evidence): outlier detection counts it as it counts this balancer's own
    /// outcomes, in the order they arrive (consecutive failures across the fleet, the fleet's
    /// failure rate), and ejects the endpoint here when a rule says so, within
    /// `max_ejection_percent`. `source` names the balancer that observed it (any number but 0,
    /// which stands for this balancer's own calls), for [`crate::SharedEvidence`]'s quorum. It
    /// touches nothing else: no in-flight count, latency estimate or outcome counter. Returns
    /// true when it ejected the endpoint; false too when no endpoint has that id or outlier
    /// detection is off.
    pub fn record_remote(
        &self,
        id: EndpointId,
        outcome: Outcome,
        source: u64,
        now: Duration,
    ) -> bool {
        if self.config.outlier_detection.is_none() {
            return false;
        }
        let snap = self.snapshot.load();
        let Some(i) = snap.endpoints.iter().position(|e| e.id() == id) else {
            return false;
        };
        let e = &*snap.endpoints[i];
        self.judge(
            &snap,
            e,
            outcome == Outcome::Failure,
            source,
            nanos(now),
            || Some(i),
        )
    }

    /// True if the strategy balances on the endpoints' load reports (prequal): only then are
    /// [`Self::probe_targets`] and [`Self::report_load`] worth the driver's work.
    pub fn uses_load_reports(&self) -> bool {
        self.snapshot.load().strategies[0].uses_load_reports()
    }

    /// Appends to `out` the endpoints the strategy wants probed now (prequal: a few random
    /// ones, to call after each pick; the others: none). The driver sends the probes as it
    /// likes and hands the answers to [`Self::report_load`].
    pub fn probe_targets(&self, now: Duration, out: &mut Vec<EndpointId>) {
        let snap = self.snapshot.load();
        self.probe_targets_in(&snap, now, out);
    }

    /// [`Self::probe_targets`] by the balancer's one owner (`&mut`), as [`Self::pick_mut`].
    pub fn probe_targets_mut(&mut self, now: Duration, out: &mut Vec<EndpointId>) {
        let (this, snap) = self.local();
        this.probe_targets_in(snap, now, out);
    }

    fn probe_targets_in(&self, snap: &Snapshot, now: Duration, out: &mut Vec<EndpointId>) {
        if !snap.strategies[0].uses_load_reports() {
            return;
        }
        let now = nanos(now);
        let view = View {
            eps: &snap.endpoints,
            now,
            avoid: &[],
            ignore_health: self.panic(snap, now),
            slow_start: self.config.slow_start.as_ref(),
            rng: &self.rng,
            group: &self.group,
            half_open: false,
            back_off: false,
            queue_max_age: self.queue_max_age_ns,
        };
        for (g, s) in snap.strategies.iter().enumerate() {
            s.probe_targets(&snap.in_group(&view, g), out);
        }
    }

    /// What endpoint `id` says about its load (a probe's answer, or an answer's headers),
    /// received at `now`. Returns false if no endpoint has that id. Strategies that do not
    /// balance on reports ignore it; zone routing counts its requests in flight.
    pub fn report_load(&self, id: EndpointId, report: LoadReport, now: Duration) -> bool {
        let snap = self.snapshot.load();
        self.report_load_in(&snap, id, report, now)
    }

    /// [`Self::report_load`] by the balancer's one owner (`&mut`), as [`Self::pick_mut`].
    pub fn report_load_mut(&mut self, id: EndpointId, report: LoadReport, now: Duration) -> bool {
        let (this, snap) = self.local();
        this.report_load_in(snap, id, report, now)
    }

    fn report_load_in(
        &self,
        snap: &Snapshot,
        id: EndpointId,
        report: LoadReport,
        now: Duration,
    ) -> bool {
        let Some(index) = snap.endpoints.iter().position(|e| e.id() == id) else {
            return false;
        };
        if self.config.zone_routing.is_some() {
            snap.endpoints[index].set_reported_rif(report.in_flight, nanos(now));
        }
        if snap.strategies[0].uses_load_reports() {
            let view = View {
                eps: &snap.endpoints,
                now: nanos(now),
                avoid: &[],
                ignore_health: false,
                slow_start: self.config.slow_start.as_ref(),
                rng: &self.rng,
                group: &self.group,
                half_open: false,
                back_off: false,
                queue_max_age: self.queue_max_age_ns,
            };
            snap.observe(&view, index, &Observation::Load(report));
        }
        true
    }

    /// What endpoint `id` says is waiting in its own queue (an inference engine's
    /// `num_requests_waiting`), received at `now`. With `queue_max_age` set, least-request and
    /// the bounded loads count it in the endpoint's load until it is that old; otherwise it is
    /// kept and not read. Returns false if no endpoint has that id.
    pub fn report_queue(&self, id: EndpointId, waiting: u32, now: Duration) -> bool {
        let snap = self.snapshot.load();
        match snap.endpoints.iter().find(|e| e.id() == id) {
            Some(e) => {
                e.set_reported_queue(waiting, nanos(now));
                true
            }
            None => false,
        }
    }

    /// What endpoint `id` says about its utilisation (an ORCA report: the
    /// `endpoint-load-metrics` header of an answer or a probe's), received at `now`. Returns
    /// false if no endpoint has that id. Zone routing with `signal = "utilization"` and
    /// `orca-wrr` use it; other strategies ignore it.
    pub fn report_utilization(&self, id: EndpointId, u: Utilization, now: Duration) -> bool {
        let snap = self.snapshot.load();
        let Some(index) = snap.endpoints.iter().position(|e| e.id() == id) else {
            return false;
        };
        if self.config.zone_routing.is_some() {
            snap.endpoints[index].set_reported_util(u.value(), nanos(now));
        }
        if snap.strategies[0].uses_utilization() {
            let view = self.view(&snap, nanos(now));
            snap.observe(&view, index, &Observation::Utilization(u));
        }
        true
    }

    /// True if the strategy or zone routing uses utilisation reports (ORCA): only then is
    /// reading them worth the driver's work.
    pub fn uses_utilization(&self) -> bool {
        self.config.zone_routing.is_some() || self.snapshot.load().strategies[0].uses_utilization()
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

    /// Takes endpoint `id` out of new picks (`true`: an operator's drain, as Envoy's
    /// `DRAINING` health status or HAProxy's `set server ... state drain`) or puts it back
    /// (`false`, with a slow start if one is configured). Calls in flight finish as usual. A
    /// drained endpoint takes no call in panic mode either, and counts neither as up nor as
    /// down for the panic threshold; for priority levels and zones it counts as down. The
    /// state lives with the endpoint, so it survives an update that keeps the endpoint, and
    /// goes with it when an update removes it. Returns false if no endpoint has that id.
    pub fn set_draining(&self, id: EndpointId, draining: bool, now: Duration) -> bool {
        let snap = self.snapshot.load();
        let Some(e) = snap.endpoints.iter().find(|e| e.id() == id) else {
            return false;
        };
        if e.set_draining(draining, nanos(now)) {
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
                    draining: e.is_draining(),
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

/// When a pick found nothing, the same pick with its limits relaxed one at a time, least
/// important first: an endpoint that asked to be backed off (better one of them than none),
/// then a second call on an endpoint on half-open trial, and only then a retry back to an
/// endpoint it already tried (the one this request just failed on is the worse choice), with
/// the trial limit again and then without it. `view` ends as the pick that found one saw it.
#[cold]
fn relaxed<T>(
    view: &mut View<'_>,
    ctx: &PickContext<'_>,
    mut pick: impl FnMut(&View<'_>) -> Option<T>,
) -> Option<T> {
    if view.back_off {
        view.back_off = false;
        if let Some(found) = pick(view) {
            return Some(found);
        }
    }
    let half_open = view.half_open;
    if half_open {
        view.half_open = false;
        if let Some(found) = pick(view) {
            return Some(found);
        }
    }
    if ctx.avoid.is_empty() {
        return None;
    }
    view.avoid = &[];
    view.half_open = half_open;
    if let Some(found) = pick(view) {
        return Some(found);
    }
    if half_open {
        view.half_open = false;
        return pick(view);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StrategyKind;

    fn specs(n: usize) -> Vec<EndpointSpec> {
        (0..n).map(|i| EndpointSpec::new(format!("e{i}"))).collect()
    }

    /// The `_mut` methods keep their own copy of the snapshot: after an update they must pick
    /// from the new endpoint list, and pick as `pick` does.
    #[test]
    fn the_mut_methods_follow_updates_and_pick_as_the_shared_ones() {
        let config = BalancerConfig {
            seed: 7,
            ..BalancerConfig::new(StrategyKind::LeastRequest)
        };
        let shared = Balancer::new(config.clone(), &specs(3)).unwrap();
        let mut own = Balancer::new(config, &specs(3)).unwrap();
        let ctx = PickContext::new(Duration::ZERO);
        for _ in 0..50 {
            let (a, b) = (shared.pick(&ctx).unwrap(), own.pick_mut(&ctx).unwrap());
            assert_eq!(a.address(), b.address());
            shared.finish(a, Outcome::Success, Duration::from_millis(1));
            own.finish_mut(b, Outcome::Success, Duration::from_millis(1));
        }
        own.update(&specs(5)[3..], Duration::from_secs(1)).unwrap();
        for _ in 0..20 {
            let p = own.pick_mut(&ctx).unwrap();
            assert!(["e3", "e4"].contains(&p.address()), "{}", p.address());
            own.finish_mut(p, Outcome::Success, Duration::from_secs(1));
        }
    }

    fn fleet_member(quorum: u32) -> Balancer {
        let config = BalancerConfig {
            outlier_detection: Some(crate::OutlierConfig {
                consecutive_failures: 3,
                shared: Some(crate::SharedEvidence { quorum }),
                ..crate::OutlierConfig::default()
            }),
            ..BalancerConfig::new(StrategyKind::RoundRobin)
        };
        Balancer::new(config, &specs(3)).unwrap()
    }

    /// Fails calls to `address` through `lb` until `failures` of them failed; returns whether
    /// the last one ejected it.
    fn fail_own(lb: &Balancer, address: &str, failures: u32, now: Duration) -> bool {
        let (mut failed, mut ejected) = (0, false);
        while failed < failures {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            if p.address() == address {
                failed += 1;
                ejected = lb.finish(p, Outcome::Failure, now);
            } else {
                lb.finish(p, Outcome::Success, now);
            }
        }
        ejected
    }

    /// Shared evidence: two failures seen here and one seen by another balancer make the three
    /// in a row that eject; the remote outcome touches nothing but the detector.
    #[test]
    fn remote_evidence_counts_toward_consecutive_failures() {
        let now = Duration::from_secs(1);
        let lb = fleet_member(1);
        let bad = lb.endpoints()[2].clone();
        assert!(!fail_own(&lb, "e2", 2, now));
        assert!(lb.record_remote(bad.id(), Outcome::Failure, 7, now));
        assert!(bad.ejected_until(now).is_some());
        assert_eq!(
            bad.outcomes(),
            (0, 2),
            "the remote failure is not this balancer's call"
        );
        assert_eq!(bad.in_flight(), 0);
        // A remote success breaks a run as a local one does.
        let lb = fleet_member(1);
        let bad = lb.endpoints()[2].clone();
        assert!(!fail_own(&lb, "e2", 2, now));
        assert!(!lb.record_remote(bad.id(), Outcome::Success, 7, now));
        assert!(!lb.record_remote(bad.id(), Outcome::Failure, 7, now));
        assert!(bad.ejected_until(now).is_none());
        // Unknown ids and balancers without outlier detection ignore it.
        assert!(!lb.record_remote(EndpointId(u64::MAX), Outcome::Failure, 7, now));
        let plain =
            Balancer::new(BalancerConfig::new(StrategyKind::RoundRobin), &specs(3)).unwrap();
        let id = plain.endpoints()[0].id();
        for _ in 0..10 {
            assert!(!plain.record_remote(id, Outcome::Failure, 7, now));
        }
    }

    /// With a quorum of 2, one balancer's own failures never eject, however many; one failure
    /// from another source completes the quorum.
    #[test]
    fn a_quorum_of_two_needs_a_second_source() {
        let now = Duration::from_secs(1);
        let lb = fleet_member(2);
        let bad = lb.endpoints()[2].clone();
        assert!(!fail_own(&lb, "e2", 10, now));
        assert!(bad.ejected_until(now).is_none());
        assert!(lb.record_remote(bad.id(), Outcome::Failure, 7, now));
        assert!(bad.ejected_until(now).is_some());
    }

    /// Every strategy: a drained endpoint gets no pick (with or without a hash key) while the
    /// others share the calls, and picks come back to it once it is undrained.
    #[test]
    fn a_drained_endpoint_gets_no_pick_under_any_strategy_until_undrained() {
        for kind in StrategyKind::ALL {
            let config = BalancerConfig {
                seed: 11,
                ..BalancerConfig::new(kind)
            };
            let lb = Balancer::new(config, &specs(3)).unwrap();
            let drained = lb.endpoints()[1].id();
            let mut now = Duration::from_millis(1);
            assert!(lb.set_draining(drained, true, now));
            assert!(lb.status(now)[1].draining);
            let mut counts = [0usize; 3];
            for k in 0..300u64 {
                now += Duration::from_millis(1);
                let ctx = PickContext::new(now).with_hash_key(crate::mix64(k));
                let p = lb.pick(&ctx).unwrap_or_else(|| panic!("{kind:?}: no pick"));
                counts[p.index()] += 1;
                lb.finish(p, Outcome::Success, now + Duration::from_micros(300));
            }
            assert_eq!(counts[1], 0, "{kind:?}: {counts:?}");
            assert_eq!(counts[0] + counts[2], 300, "{kind:?}");
            assert!(lb.set_draining(drained, false, now));
            assert!(!lb.status(now)[1].draining);
            let mut back = 0;
            for k in 0..600u64 {
                // Past any slow start's ramp (none is configured here).
                now += Duration::from_millis(1);
                let ctx = PickContext::new(now).with_hash_key(crate::mix64(k));
                let p = lb.pick(&ctx).unwrap();
                back += usize::from(p.index() == 1);
                lb.finish(p, Outcome::Success, now + Duration::from_micros(300));
            }
            assert!(back > 0, "{kind:?}: no pick after undrain");
            assert!(
                !lb.set_draining(EndpointId(u64::MAX), true, now),
                "no such id"
            );
        }
    }

    /// Panic mode ignores health, not a drain; drained endpoints do not push the balancer into
    /// panic (2 of 3 drained with a 50 % threshold is not 33 % healthy).
    #[test]
    fn a_drain_holds_in_panic_mode_and_does_not_cause_it() {
        let config = BalancerConfig {
            seed: 3,
            panic_threshold: 50.0,
            ..BalancerConfig::new(StrategyKind::RoundRobin)
        };
        let lb = Balancer::new(config, &specs(4)).unwrap();
        let eps = lb.endpoints();
        let now = Duration::from_millis(1);
        lb.set_draining(eps[0].id(), true, now);
        lb.set_draining(eps[1].id(), true, now);
        assert!(
            !lb.is_panicking(now),
            "drained endpoints are not unhealthy ones"
        );
        // One of the two left unhealthy: 1 of 2 up is not under 50 %.
        lb.set_healthy(eps[2].id(), false, now);
        assert!(!lb.is_panicking(now));
        for _ in 0..20 {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            assert_eq!(p.index(), 3);
            lb.finish(p, Outcome::Success, now);
        }
        // Both left unhealthy: panic, and the picks go to them, never to the drained ones.
        lb.set_healthy(eps[3].id(), false, now);
        assert!(lb.is_panicking(now));
        for _ in 0..20 {
            let p = lb.pick(&PickContext::new(now)).unwrap();
            assert!(p.index() >= 2, "{}", p.index());
            lb.finish(p, Outcome::Success, now);
        }
        // Everything drained: no pick at all.
        lb.set_draining(eps[2].id(), true, now);
        lb.set_draining(eps[3].id(), true, now);
        assert!(lb.pick(&PickContext::new(now)).is_none());
    }

    /// One answer's back-off is bounded: at most `max_backed_off_percent` of the endpoints
    /// backed off at once (the share `max_ejection_percent` would eject), for at most
    /// `max_back_off`; a longer back-off of an endpoint already backed off is not refused.
    #[test]
    fn back_offs_are_capped_in_share_and_in_time() {
        let s = Duration::from_secs;
        let b = Balancer::new(BalancerConfig::new(StrategyKind::RoundRobin), &specs(3)).unwrap();
        let picks: Vec<_> = (0..3)
            .map(|_| b.pick(&PickContext::new(s(1))).unwrap())
            .collect();
        assert_eq!(
            b.back_off(&picks[0], s(1), s(30)),
            Some(s(11)),
            "capped at 10 s"
        );
        assert_eq!(b.back_off(&picks[1], s(1), s(30)), None, "1 of 3 at 10 %");
        assert_eq!(
            b.back_off(&picks[0], s(2), s(5)),
            Some(s(11)),
            "kept, not shortened"
        );
        assert_eq!(
            b.back_off(&picks[1], s(12), s(1)),
            Some(s(13)),
            "room again"
        );
        let wide = BalancerConfig {
            max_backed_off_percent: 70.0,
            max_back_off: s(60),
            ..BalancerConfig::new(StrategyKind::RoundRobin)
        };
        let b = Balancer::new(wide, &specs(3)).unwrap();
        let picks: Vec<_> = (0..3)
            .map(|_| b.pick(&PickContext::new(s(1))).unwrap())
            .collect();
        let got: Vec<_> = picks.iter().map(|p| b.back_off(p, s(1), s(30))).collect();
        assert_eq!(got, [Some(s(31)), Some(s(31)), None], "2 of 3 at 70 %");
        let off = BalancerConfig {
            max_backed_off_percent: 0.0,
            ..BalancerConfig::new(StrategyKind::RoundRobin)
        };
        let b = Balancer::new(off, &specs(3)).unwrap();
        let p = b.pick(&PickContext::new(s(1))).unwrap();
        assert_eq!(b.back_off(&p, s(1), s(5)), None, "0 %: never");
    }

    /// The drain lives with the endpoint: an update that keeps it keeps the drain.
    #[test]
    fn a_drain_survives_an_update_that_keeps_the_endpoint() {
        let lb = Balancer::new(BalancerConfig::new(StrategyKind::RoundRobin), &specs(3)).unwrap();
        let now = Duration::from_millis(1);
        lb.set_draining(lb.endpoints()[1].id(), true, now);
        lb.update(&specs(4), now).unwrap();
        let st = lb.status(now);
        assert!(st.iter().any(|s| s.address == "e1" && s.draining), "{st:?}");
        assert_eq!(st.iter().filter(|s| s.draining).count(), 1);
    }
    /// An endpoint that asked to be backed off is passed over by every strategy until its
    /// time is up, is still taken when no other endpoint may take the call, and its failures
    /// still count toward its ejection.
    #[test]
    fn a_backed_off_endpoint_is_passed_over_until_its_time_and_still_counts_toward_ejection() {
        let s = Duration::from_secs;
        for kind in [
            StrategyKind::RoundRobin,
            StrategyKind::LeastRequest,
            StrategyKind::RingHash,
            StrategyKind::Prequal,
            StrategyKind::OrcaWrr,
        ] {
            let config = BalancerConfig {
                seed: 7,
                outlier_detection: Some(crate::OutlierConfig {
                    consecutive_failures: 2,
                    max_ejection_percent: 100.0,
                    ..crate::OutlierConfig::default()
                }),
                ..BalancerConfig::new(kind)
            };
            let b = Balancer::new(config, &specs(3)).unwrap();
            let ctx = PickContext::new(s(1));
            let mut first = b.pick(&ctx).unwrap();
            while first.address() != "e0" {
                b.finish(first, Outcome::Success, s(1));
                first = b.pick(&ctx).unwrap();
            }
            b.back_off(&first, s(1), s(9));
            assert!(!b.finish(first, Outcome::Failure, s(1)), "{kind:?}");
            for _ in 0..200 {
                let p = b.pick(&PickContext::new(s(5)).with_hash_key(3)).unwrap();
                assert_ne!(p.address(), "e0", "{kind:?}: picked while backed off");
                b.finish(p, Outcome::Success, s(5));
            }
            // The only endpoint a retry has left: taken, back-off or not.
            let others: Vec<_> = b.endpoints()[1..].iter().map(|e| e.id()).collect();
            let p = b.pick(&PickContext::new(s(5)).with_avoid(&others)).unwrap();
            assert_eq!(p.address(), "e0", "{kind:?}");
            // Its second failure in a row ejects it.
            assert!(b.finish(p, Outcome::Failure, s(5)), "{kind:?}: not ejected");
            let mut seen = false;
            for _ in 0..200 {
                let p = b.pick(&PickContext::new(s(100)).with_hash_key(3)).unwrap();
                seen |= p.address() == "e0";
                b.finish(p, Outcome::Success, s(100));
            }
            // Ring hash sends key 3 to one endpoint: e0 comes back only if it is that one.
            if kind != StrategyKind::RingHash {
                assert!(
                    seen,
                    "{kind:?}: e0 never picked after its back-off and ejection"
                );
            }
        }
    }
}
