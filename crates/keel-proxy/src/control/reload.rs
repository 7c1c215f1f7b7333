//! Reload: a new configuration built beside the running one (clusters keep the state of the
//! endpoints that stay, listeners are kept, added or drained by address) and swapped in whole;
//! discovery's sets applied the same way, and the health checks and discovery tasks of the
//! clusters in force restarted.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use keel_balance::EndpointSpec;
use tokio::net::TcpListener;

use crate::config::{ClusterConfig, ProxyConfig};
use crate::exchange::trace::Tracing;
use crate::route::ListenerRoutes;
use crate::state::{ListenerCtx, ListenerSlot, ReloadError, Routing, Shared};
use crate::upstream::cluster::Cluster;
use crate::upstream::discovered::Discovered;

impl Shared {
    /// Builds a cluster (from the running one of the same name, whose endpoints that stay keep
    /// their state).
    pub(crate) fn build_cluster(
        &self,
        config: ClusterConfig,
        old: Option<&Cluster>,
        tracing: Option<Arc<Tracing>>,
    ) -> anyhow::Result<Arc<Cluster>> {
        let name = config.name.clone();
        let mut cluster = Cluster::build(config, old, &self.registry, self.epoch, self.workers)
            .with_context(|| format!("cluster `{name}`"))?;
        cluster.tracing = tracing;
        if cluster.config.protections.health_check.is_none() {
            // Without checks nothing would ever mark an endpoint up again.
            for e in &cluster.endpoints {
                cluster.balancer.set_healthy(e.id, true, cluster.now());
            }
        }
        Ok(Arc::new(cluster))
    }

    /// The listeners' route tables over `clusters`, by listener index: `indexes[i]` is the
    /// index of `config.listeners[i]`. A removed listener keeps its last table while
    /// connections are open on it (they drain on the clusters they started on), then routes
    /// nothing.
    pub(crate) fn build_listeners(
        &self,
        config: &ProxyConfig,
        clusters: &[Arc<Cluster>],
        indexes: &[usize],
        previous: Option<&Routing>,
    ) -> anyhow::Result<Vec<Arc<ListenerRoutes>>> {
        let len = indexes
            .iter()
            .map(|i| i + 1)
            .chain(previous.map(|p| p.listeners.len()))
            .max()
            .unwrap_or(0);
        let all = self.listening.all_listeners.load();
        let none = Arc::new(ListenerRoutes::none());
        let mut out: Vec<Arc<ListenerRoutes>> = (0..len)
            .map(|i| {
                let draining = all.get(i).is_some_and(|l| l.open.load(Relaxed) > 0);
                match previous.and_then(|p| p.listeners.get(i)) {
                    Some(table) if draining => table.clone(),
                    _ => none.clone(),
                }
            })
            .collect();
        for (i, l) in config.listeners.iter().enumerate() {
            let table = ListenerRoutes::build(
                l,
                |name| clusters.iter().find(|c| c.name() == name).cloned(),
                &self.registry,
                &l.listen.to_string(),
            )
            .with_context(|| format!("listener[{i}]"))?;
            out[indexes[i]] = Arc::new(table);
        }
        Ok(out)
    }

    /// The indexes of the listeners in force, in configuration order.
    pub(crate) fn live_indexes(&self) -> Vec<usize> {
        self.listening
            .listeners
            .load()
            .iter()
            .map(|l| l.index)
            .collect()
    }

    /// Builds what requests see from `config`; a cluster with discovery gets the endpoints
    /// `discovered` last found for it. `indexes`: see [`Self::build_listeners`].
    pub(crate) fn build_routing(
        &self,
        config: &ProxyConfig,
        previous: Option<&Routing>,
        discovered: &HashMap<String, Arc<Discovered>>,
        indexes: &[usize],
    ) -> anyhow::Result<Routing> {
        let tracing = match (&config.tracing, previous.and_then(|p| p.tracing.as_ref())) {
            (Some(t), Some(old)) if old.config == *t => Some(old.clone()),
            (Some(t), _) => Some(Arc::new(crate::observe::tracing(t, &self.registry)?)),
            (None, _) => None,
        };
        let mut clusters = Vec::with_capacity(config.clusters.len());
        for c in &config.clusters {
            let old = previous.and_then(|r| r.clusters.iter().find(|o| o.name() == c.name));
            let mut c = c.clone();
            if let Some(d) = discovered.get(&c.name) {
                c.endpoints = d.endpoints();
            }
            clusters.push(self.build_cluster(c, old.map(|o| &**o), tracing.clone())?);
        }
        let listeners = self.build_listeners(config, &clusters, indexes, previous)?;
        Ok(Routing {
            listeners,
            clusters,
            tracing,
        })
    }

    /// The discovery state of `config`'s clusters: kept for a cluster whose source did not
    /// change; a new file source is read at once (DNS sources are first resolved by their
    /// task).
    pub(crate) fn sync_discovery(&self, config: &ProxyConfig) -> HashMap<String, Arc<Discovered>> {
        let old = self
            .control
            .discovery
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut now = HashMap::new();
        for c in &config.clusters {
            let Some(d) = &c.discovery else { continue };
            let entry = match old.get(&c.name) {
                Some(e) if e.config == *d => e.clone(),
                _ => {
                    let e = Arc::new(Discovered::new(d.clone()));
                    if let crate::config::DiscoveryConfig::File { path } = d {
                        e.record(
                            &c.name,
                            crate::control::discovery::read_file(path).map_err(|e| {
                                crate::control::discovery::DiscoveryError::from(e).shared()
                            }),
                        );
                    }
                    e
                }
            };
            now.insert(c.name.clone(), entry);
        }
        now
    }

    /// Puts `discovered` in force and (re)starts one discovery task per cluster that has it.
    pub(crate) fn restart_discovery(&self, discovered: HashMap<String, Arc<Discovered>>) {
        let mut tasks = self
            .control
            .discovery_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for t in tasks.drain(..) {
            t.abort();
        }
        // In force before the tasks start: a set they find is applied only to the current
        // source (and it is recorded once, so one found too early would be lost).
        *self
            .control
            .discovery
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = discovered.clone();
        let etcd = self.config.load().etcd.clone();
        for (name, d) in discovered {
            let me = self.me.clone();
            tasks.push(self.runtime.spawn(crate::control::discovery::run(
                name,
                d,
                move |cluster, d, set| {
                    if let Some(shared) = me.upgrade() {
                        shared.apply_discovered(cluster, d, set);
                    }
                },
                etcd.clone(),
            )));
        }
    }

    /// Applies a new set of endpoints found for cluster `name`: the cluster is rebuilt from the
    /// running one (endpoints that stay keep their state) and swapped in, with the route tables
    /// that lead to it.
    pub(crate) fn apply_discovered(
        &self,
        name: &str,
        discovered: &Arc<Discovered>,
        set: Vec<EndpointSpec>,
    ) {
        let _serial = self
            .control
            .reload_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // A reload may have replaced the source since this set was found.
        let current = self
            .control
            .discovery
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .is_some_and(|d| Arc::ptr_eq(d, discovered));
        if !current {
            return;
        }
        let config = self.config.load();
        let routing = self.routing.load();
        let Some(pos) = routing.clusters.iter().position(|c| c.name() == name) else {
            return;
        };
        let old = &routing.clusters[pos];
        let mut cc = old.config.clone();
        // An endpoint at one of this process's own sockets would send keel's requests back to
        // keel, each one again, until the connections ran out.
        let own = self.own_addrs();
        cc.endpoints = set
            .into_iter()
            .filter(|e| {
                let loops = crate::state::is_own(&e.address, &own);
                if loops {
                    tracing::warn!(
                        cluster = name,
                        endpoint = %crate::control::escape::escaped(&e.address),
                        "discovery: endpoint skipped: it is this proxy's own listener or admin address"
                    );
                }
                !loops
            })
            .collect();
        let tracing = routing.tracing.clone();
        let applied = self
            .build_cluster(cc, Some(old), tracing.clone())
            .and_then(|cluster| {
                let mut clusters = routing.clusters.clone();
                clusters[pos] = cluster;
                let listeners =
                    self.build_listeners(&config, &clusters, &self.live_indexes(), Some(&routing))?;
                Ok(Routing {
                    listeners,
                    clusters,
                    tracing,
                })
            });
        match applied {
            Ok(next) => {
                self.restart_health_checks_of(&next.clusters[pos]);
                self.routing.store(Arc::new(next));
            }
            Err(e) => {
                discovered.errors.fetch_add(1, Relaxed);
                tracing::warn!(
                    cluster = name,
                    "discovery: the endpoints found cannot be applied: {e:#}"
                );
            }
        }
    }

    pub(crate) fn restart_health_checks(&self, routing: &Routing) {
        let mut tasks = self
            .control
            .health_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (_, t) in tasks.drain(..) {
            t.abort();
        }
        for c in &routing.clusters {
            let engine = crate::upstream::signals::spawn(c, &self.runtime);
            for t in crate::control::health::spawn(c, &self.runtime)
                .into_iter()
                .chain(engine)
            {
                tasks.push((c.name().to_string(), t));
            }
        }
    }

    /// Restarts the health checks of one cluster (rebuilt by discovery).
    pub(crate) fn restart_health_checks_of(&self, cluster: &Arc<Cluster>) {
        let mut tasks = self
            .control
            .health_tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        tasks.retain(|(name, t)| {
            let other = name != cluster.name();
            if !other {
                t.abort();
            }
            other
        });
        let engine = crate::upstream::signals::spawn(cluster, &self.runtime);
        for t in crate::control::health::spawn(cluster, &self.runtime)
            .into_iter()
            .chain(engine)
        {
            tasks.push((cluster.name().to_string(), t));
        }
    }

    /// Reads the configuration file again and reloads it. Every refusal, the file's own
    /// errors included, is logged and counted (`keel_config_reloads_total{result="refused"}`).
    pub fn reload_from_file(&self) -> Result<(), ReloadError> {
        let Some(path) = self.config.load().source.clone() else {
            return Err(ReloadError::NoFile);
        };
        match ProxyConfig::from_file(&path) {
            Ok(config) => self.reload(config).map_err(ReloadError::Refused),
            Err(e) => {
                self.control.reload_failures.fetch_add(1, Relaxed);
                tracing::error!("configuration reload refused, the old one keeps serving: {e}");
                Err(ReloadError::Refused(e.into()))
            }
        }
    }

    /// Validates that the new configuration can be applied to the running listeners, then
    /// swaps it in.
    pub fn reload(&self, config: ProxyConfig) -> anyhow::Result<()> {
        let _serial = self
            .control
            .reload_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let result = self.try_reload(config);
        match &result {
            Ok(()) => {
                self.control.reloads.fetch_add(1, Relaxed);
                tracing::info!("configuration reloaded");
            }
            Err(e) => {
                self.control.reload_failures.fetch_add(1, Relaxed);
                tracing::error!("configuration reload refused, the old one keeps serving: {e:#}");
            }
        }
        result
    }

    pub(crate) fn try_reload(&self, config: ProxyConfig) -> anyhow::Result<()> {
        if self.listening.stopping.load(Relaxed) {
            anyhow::bail!("the proxy is shutting down");
        }
        let old = self.config.load();
        let live = self.listening.listeners.load_full();
        // Everything that can fail comes first, the swap after: a listener that cannot be bound,
        // a certificate that cannot be read, an access log that cannot be opened or a cluster
        // that cannot be built refuses the whole reload, and the old configuration keeps
        // serving untouched (sockets bound for it are closed again when `plan` is dropped).
        let mut taken = vec![false; live.len()];
        let mut plan = Vec::with_capacity(config.listeners.len());
        let mut next_index = self.listening.all_listeners.load().len();
        for (i, l) in config.listeners.iter().enumerate() {
            let ctx_for = |index| {
                ListenerCtx::build(index, l)
                    .with_context(|| format!("listener[{i}] ({})", l.listen))
            };
            let kept = live
                .iter()
                .enumerate()
                .find(|(k, s)| !taken[*k] && s.listen == l.listen);
            match kept {
                Some((k, slot)) => {
                    taken[k] = true;
                    plan.push(Planned::Keep(slot.clone(), ctx_for(slot.index)?));
                }
                None => {
                    let ctx = ctx_for(next_index)?;
                    let listener = self
                        .bind(l.listen)
                        .with_context(|| format!("listener[{i}]: cannot listen on {}", l.listen))?;
                    plan.push(Planned::New(listener, ctx));
                    next_index += 1;
                }
            }
        }
        let admin = match (&config.admin, old.admin.as_ref()) {
            (Some(new), Some(was)) if new.listen == was.listen => AdminPlan::Keep,
            (Some(new), _) => AdminPlan::Move(Some(
                self.bind_admin(new.listen)
                    .with_context(|| format!("cannot listen on {} (admin)", new.listen))?,
            )),
            (None, Some(_)) => AdminPlan::Move(None),
            (None, None) => AdminPlan::Keep,
        };
        let access_log = if old.access_log == config.access_log {
            None
        } else {
            Some(
                config
                    .access_log
                    .as_ref()
                    .map(|a| {
                        crate::observe::access_log::AccessLog::start(a, self.workers).map(Arc::new)
                    })
                    .transpose()?,
            )
        };
        let indexes: Vec<usize> = plan.iter().map(Planned::index).collect();
        let previous = self.routing.load();
        let discovered = self.sync_discovery(&config);
        let routing = self.build_routing(&config, Some(&previous), &discovered, &indexes)?;

        // The swap: nothing below fails.
        let mut now_live = Vec::with_capacity(plan.len());
        for p in plan {
            match p {
                Planned::Keep(slot, ctx) => {
                    slot.set_ctx(ctx);
                    now_live.push(slot);
                }
                Planned::New(listener, ctx) => now_live.push(self.open_listener(listener, ctx)),
            }
        }
        self.restart_health_checks(&routing);
        self.routing.store(Arc::new(routing));
        self.listening.listeners.store(Arc::new(now_live));
        self.config.store(Arc::new(config));
        self.restart_discovery(discovered);
        self.restart_evidence();
        let drain = self.config.load().drain_timeout;
        for (k, slot) in live.iter().enumerate() {
            if !taken[k] {
                self.remove_listener(slot.clone(), drain);
            }
        }
        if let AdminPlan::Move(admin) = admin {
            let old = self
                .listening
                .admin
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(old) = old {
                old.stop.send_replace(Some(Duration::ZERO));
                tracing::info!(admin = %old.addr, "admin listener closed");
            }
            if let Some(listener) = admin {
                self.open_admin(listener);
            }
        }
        if let Some(log) = access_log {
            let old = self.access_log.swap(log);
            // Requests that took the old log a moment ago still write to it; it is closed (its
            // lines written) when the last of them lets it go, or here after a grace period.
            if let Some(old) = old {
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(2));
                    drop(old);
                });
            }
        }
        Ok(())
    }
}

/// What a reload does with one listener of the new configuration.
pub(crate) enum Planned {
    /// The listener of that address stays; its settings and certificate are swapped.
    Keep(Arc<ListenerSlot>, ListenerCtx),
    /// A new listener, already bound.
    New(TcpListener, ListenerCtx),
}

impl Planned {
    pub(crate) fn index(&self) -> usize {
        match self {
            Planned::Keep(slot, _) => slot.index,
            Planned::New(_, ctx) => ctx.index,
        }
    }
}

pub(crate) enum AdminPlan {
    Keep,
    /// Bound at its new address (or none), the old one closed after the swap.
    Move(Option<TcpListener>),
}
