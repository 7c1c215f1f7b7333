//! A cluster at run time: its keel-balance [`Balancer`] and [`RetryBudget`], and per endpoint
//! its keep-alive pool ([`EndpointPool`]) and data prepared once so that the hot path does not
//! parse addresses.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::http::uri::Authority;
use hyper::http::HeaderValue;
use keel_balance::{Balancer, EndpointId, Outcome, Pick, RetryBudget};

use crate::config::ClusterConfig;
use crate::metrics::{ClusterMetrics, EndpointMetrics, ErrorKind, Registry};
use crate::policy::budget::TokenBudget;
use crate::policy::rate::RateLimiter;
use crate::policy::sticky::Sticky;
use crate::tls::UpstreamTls;
use crate::upstream::h2_conns::H2Conns;
use crate::upstream::pool::{EndpointPool, PoolSettings};

/// One endpoint's prepared data, by its index in the balancer.
pub struct EndpointEntry {
    /// keel-balance identity.
    pub id: EndpointId,
    /// keel-balance's stable token of the endpoint (sticky sessions).
    pub token: u64,
    /// `host:port`, parsed.
    pub authority: Authority,
    /// The address as a header value (`x-keel-endpoint`).
    pub header: HeaderValue,
    /// Counters.
    pub metrics: Arc<EndpointMetrics>,
    /// Its keep-alive connections (and the connector of its HTTP/2 ones).
    pub pool: Arc<EndpointPool>,
    /// Its multiplexed HTTP/2 connections (clusters with `protocol = "h2c"` or `"h2"`).
    pub(crate) h2: Arc<H2Conns>,
}

/// Most load probes under way per cluster: beyond that, picks send none (a burst of requests
/// does not become a burst of connections several times as large).
pub(crate) const MAX_PROBES_IN_FLIGHT: usize = 256;

/// A cluster at run time. Immutable once built; a reload builds a new one (sharing endpoint
/// state through [`Balancer::rebuild`]) and swaps it in.
pub struct Cluster {
    /// Its configuration.
    pub config: ClusterConfig,
    /// The balancer: every choice is its.
    pub balancer: Balancer,
    /// The retry budget (kept across reloads while its settings stay).
    pub budget: Arc<RetryBudget>,
    /// The hedging policy, with `[cluster.hedge]` (kept across reloads while its settings
    /// stay, with the latencies it observed).
    pub hedger: Option<Arc<keel_balance::Hedger>>,
    /// Endpoint data by balancer index.
    pub endpoints: Vec<EndpointEntry>,
    /// Client-facing counters.
    pub metrics: Arc<ClusterMetrics>,
    /// Rate limit of the lines logged about this cluster's failures.
    pub(crate) log_budget: crate::metrics::log_budget::LogBudget,
    /// The strategy balances on the load endpoints report (`x-keel-rif`, probes).
    pub uses_load_reports: bool,
    /// The strategy or zone routing balances on ORCA reports (`endpoint-load-metrics`).
    pub uses_utilization: bool,
    /// Outcomes are published to the fleet (`[cluster.outlier_detection] shared`).
    pub shares_evidence: bool,
    /// Requests ask the engines for their ORCA report (`[cluster.engine_signals]`, `source =
    /// "orca"`).
    pub(crate) asks_orca: bool,
    /// Load probes under way (bounded by [`MAX_PROBES_IN_FLIGHT`]).
    pub(crate) probes_in_flight: std::sync::atomic::AtomicUsize,
    /// Worker threads serving connections (`rate_limit.per_worker` divides by it).
    pub(crate) workers: usize,
    /// The cluster's `rate_limit`, shared by every route to it (kept across reloads while
    /// its settings stay, with its buckets).
    pub(crate) rate_limit: Option<Arc<RateLimiter>>,
    /// The cluster's `token_budget` (kept across reloads while its settings stay, with its
    /// buckets).
    pub(crate) token_budget: Option<Arc<TokenBudget>>,
    /// Sticky sessions (`sticky`): cookie values of the endpoints, by balancer index.
    pub(crate) sticky: Option<Sticky>,
    /// W3C Trace Context (`[tracing]`, the proxy's, shared by its clusters); `None`: off.
    pub(crate) tracing: Option<Arc<crate::exchange::trace::Tracing>>,
    epoch: Instant,
}

/// True if endpoints that stay can keep their pools (and idle connections).
fn same_client_settings(a: &ClusterConfig, b: &ClusterConfig) -> bool {
    a.timeouts.connect == b.timeouts.connect
        && a.protocol == b.protocol
        && a.timeouts.pool_idle == b.timeouts.pool_idle
        && a.pool_max_idle_per_endpoint == b.pool_max_idle_per_endpoint
        && a.tls == b.tls
}

impl Cluster {
    /// Builds a cluster; with `previous` (same name, older configuration) the endpoints that
    /// stay keep their state, and the pool and retry budget are kept when their settings did
    /// not change. `workers`: threads serving connections (one pool stack each).
    pub fn build(
        config: ClusterConfig,
        previous: Option<&Cluster>,
        registry: &Registry,
        epoch: Instant,
        workers: usize,
    ) -> anyhow::Result<Cluster> {
        let now = epoch.elapsed();
        let bc = config.balancer_config();
        let balancer = match previous {
            Some(old) => old.balancer.rebuild(bc, &config.endpoints, now)?,
            None => Balancer::new(bc, &config.endpoints)?,
        };
        let budget_config = config.protections.retry.budget();
        let budget = match previous {
            Some(old) if *old.budget.config() == budget_config => old.budget.clone(),
            _ => Arc::new(RetryBudget::new(budget_config)),
        };
        let hedger = config.protections.hedge.as_ref().map(|h| {
            match previous.and_then(|o| o.hedger.as_ref()) {
                Some(old) if old.config() == h => old.clone(),
                _ => Arc::new(keel_balance::Hedger::new(h)),
            }
        });
        let rate_limit = config.policy.rate_limit.as_ref().map(|r| {
            match previous.and_then(|o| o.rate_limit.as_ref()) {
                Some(old) if old.config == *r && o_workers(previous) == workers.max(1) => {
                    old.clone()
                }
                _ => Arc::new(RateLimiter::new(
                    r,
                    format!("cluster {}", config.name),
                    workers.max(1),
                )),
            }
        });
        let token_budget = config.token_budget.as_ref().map(|b| {
            match previous.and_then(|o| o.token_budget.as_ref()) {
                Some(old) if old.config == *b && o_workers(previous) == workers.max(1) => {
                    old.clone()
                }
                _ => Arc::new(TokenBudget::new(b, workers.max(1))),
            }
        });
        let metrics = registry.cluster(&config.name);
        if token_budget.is_some() {
            metrics
                .inference
                .get_or_init(Default::default)
                .budgeted
                .store(true, Relaxed);
        }
        // The handshake gets its own connect_timeout, after the TCP connect's.
        let tls = config
            .tls
            .as_ref()
            .map(|t| UpstreamTls::new(t, config.timeouts.connect, config.alpn()))
            .transpose()?;
        let pool_settings = PoolSettings {
            connect_timeout: config.timeouts.connect,
            idle_timeout: config.timeouts.pool_idle,
            max_idle: config.pool_max_idle_per_endpoint,
            workers: workers.max(1),
        };
        // Endpoints that stay keep their idle connections when the pool settings stay.
        let old_pools: HashMap<&str, &EndpointEntry> = match previous {
            Some(old) if same_client_settings(&old.config, &config) => old
                .endpoints
                .iter()
                .map(|e| (e.authority.as_str(), e))
                .collect(),
            _ => HashMap::new(),
        };
        let endpoints = balancer
            .endpoints()
            .iter()
            .map(|e| {
                Ok(EndpointEntry {
                    id: e.id(),
                    token: e.token(),
                    authority: e.address().parse()?,
                    header: HeaderValue::from_str(e.address())?,
                    metrics: registry.endpoint(&config.name, e.address()),
                    pool: match old_pools.get(e.address()) {
                        Some(old) => Arc::clone(&old.pool),
                        None => EndpointPool::new(e.address(), pool_settings, tls.clone()),
                    },
                    h2: match old_pools.get(e.address()) {
                        Some(old) => Arc::clone(&old.h2),
                        None => Arc::new(H2Conns::new(pool_settings.workers)),
                    },
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Cluster {
            metrics,
            log_budget: crate::metrics::log_budget::LogBudget::new(10, epoch),
            uses_load_reports: balancer.uses_load_reports(),
            uses_utilization: balancer.uses_utilization(),
            shares_evidence: config
                .protections
                .outlier_detection
                .as_ref()
                .is_some_and(|o| o.shared.is_some()),
            asks_orca: config
                .engine_signals
                .as_ref()
                .is_some_and(|s| s.source == crate::config::SignalSource::Orca),
            probes_in_flight: std::sync::atomic::AtomicUsize::new(0),
            workers: workers.max(1),
            rate_limit,
            token_budget,
            sticky: config
                .sticky
                .as_ref()
                .map(|s| Sticky::new(s, balancer.endpoints().iter().map(|e| e.token()))),
            config,
            balancer,
            budget,
            hedger,
            endpoints,
            tracing: None,
            epoch,
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Time on the proxy's clock (since its start), as keel-balance wants it.
    #[inline]
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// An instant already read, on the proxy's clock (saves reading the clock again).
    #[inline]
    pub fn at(&self, instant: Instant) -> Duration {
        instant.saturating_duration_since(self.epoch)
    }

    /// True if an endpoint's status counts as its failure, retried or not: for outlier
    /// detection, half-open re-admission and the latency estimates (a fast error must not make
    /// an endpoint look fast). Every 5xx but 501 and 505, which answer the request (its method,
    /// its HTTP version), not the endpoint's health, and the statuses in `retry_on_status`.
    #[inline]
    pub fn is_failure_status(&self, status: u16) -> bool {
        keel_balance::Outcome::of_status(status) == keel_balance::Outcome::Failure
            || self.retries_status(status)
    }

    /// True if a failure status is tried again on another endpoint (`retry_on_status`).
    #[inline]
    pub fn retries_status(&self, status: u16) -> bool {
        self.config
            .protections
            .retry
            .retry_on_status
            .contains(&status)
    }

    /// True if a gRPC call's `grpc-status` counts as the endpoint's failure, retried or not:
    /// the codes that say the server failed (2 UNKNOWN, 13 INTERNAL, 14 UNAVAILABLE,
    /// 15 DATA_LOSS) and those in `retry_on_grpc_status`.
    #[inline]
    pub fn is_failure_grpc_status(&self, code: u32) -> bool {
        crate::exchange::grpc::server_failed(code) || self.retries_grpc_status(code)
    }

    /// True if a failed gRPC call is tried again: 14 UNAVAILABLE (the call was not processed),
    /// and the codes in `retry_on_grpc_status`.
    #[inline]
    pub fn retries_grpc_status(&self, code: u32) -> bool {
        code == crate::exchange::grpc::UNAVAILABLE
            || self
                .config
                .protections
                .retry
                .retry_on_grpc_status
                .contains(&code)
    }

    /// Finishes a pick made at `picked_at` with its outcome, counting the try's latency, the
    /// error kind and any ejection it caused.
    pub fn finish(
        &self,
        pick: Pick,
        picked_at: Duration,
        outcome: Outcome,
        kind: Option<ErrorKind>,
    ) {
        let now = self.now();
        let index = pick.index();
        let entry = self.endpoints.get(index);
        if let Some(e) = entry {
            e.metrics.latency.observe(now.saturating_sub(picked_at));
            if let Some(k) = kind {
                e.metrics.errors[k as usize].fetch_add(1, Relaxed);
            }
            if self.shares_evidence {
                e.metrics.evidence.record(outcome == Outcome::Failure);
            }
        }
        if self.balancer.finish(pick, outcome, now) {
            if let Some(e) = entry {
                e.metrics.ejections.fetch_add(1, Relaxed);
                let until = self
                    .balancer
                    .endpoints()
                    .get(index)
                    .and_then(|ep| ep.ejected_until(now));
                let time =
                    until.map(|u| humantime::format_duration(u.saturating_sub(now)).to_string());
                tracing::warn!(
                    cluster = %self.config.name,
                    endpoint = %e.authority,
                    ejected_for = time.as_deref().unwrap_or("?"),
                    "endpoint ejected by outlier detection"
                );
            }
        }
    }
}

/// The worker count a previous cluster was built for.
fn o_workers(previous: Option<&Cluster>) -> usize {
    previous.map_or(0, |o| o.workers)
}

/// The hash key of a client's IP address (`hash_on = "client-ip"`).
pub fn client_ip_key(peer: SocketAddr) -> u64 {
    match peer.ip() {
        std::net::IpAddr::V4(ip) => keel_balance::hash_key(&ip.octets()),
        std::net::IpAddr::V6(ip) => keel_balance::hash_key(&ip.octets()),
    }
}
