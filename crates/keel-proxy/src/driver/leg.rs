//! The driver's side of a leg: the [`Leg`] trait every upstream protocol implements, and the
//! hedge [`Race`] of two tries on two legs (generic: it knows no protocol).

use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use keel_balance::{EndpointId, Pick, PickContext};
use tokio::time::Sleep;

use crate::driver::account::{failed, timed_out};
use crate::exchange::error::TryFailure;
use crate::exchange::request::Client;
use crate::exchange::trace::{Trace, TraceParent};
use crate::exchange::tries::TryOutcome;
use crate::route::Limits;
use crate::upstream::cluster::{Cluster, EndpointEntry};

/// An upstream protocol: one try of a request (or a connection) on one endpoint.
pub(crate) trait Leg {
    /// What a try yields when the endpoint answers.
    type Won;
    /// One try on the endpoint `entry` of `cluster`, from worker `worker`; `trace`: the
    /// `traceparent` this try sends (its own span), when the request is traced.
    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        worker: usize,
        trace: Option<&TraceParent>,
    ) -> Result<Self::Won, TryFailure<Self::Won>>;
    /// Prepares the request to go again (to another endpoint); false if it cannot.
    fn rewind(&mut self) -> bool;
    /// Sending the request twice has the effect of once (RFC 9110 section 9.2.2).
    fn idempotent(&self) -> bool;
    /// A try that ran out of time was waiting on the client, not on the endpoint.
    fn waiting_on_client(&self) -> bool;
    /// When an answer that failed asks to be retried ([`crate::codec::pushback`]).
    fn pushback(_won: &Self::Won) -> Option<crate::codec::pushback::Pushback> {
        None
    }
    /// A try counts as answered only once its answer's body has begun ([`Leg::first_byte`]):
    /// until then its failure is the try's, and may be retried.
    fn awaits_first_byte(&self) -> bool {
        false
    }
    /// Waits for the first byte of `won`'s body; the failure if the endpoint ends first.
    async fn first_byte(_won: &mut Self::Won) -> Result<(), crate::exchange::error::TryError> {
        Ok(())
    }
    /// The first try may be hedged (an idempotent HTTP/1.1 request whose body is in memory).
    fn hedgeable(&self) -> bool {
        false
    }
    /// The first try, hedged (see [`Race`]); only called when [`Self::hedgeable`].
    async fn hedged(
        &mut self,
        race: &Race<'_>,
        first: Tried,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (TryResult<Self::Won>, Tried, Option<EndpointId>) {
        let entry = &race.cluster.endpoints[first.pick.index()];
        let trace = race.traceparent(false);
        let one = self.try_once(race.cluster, entry, race.client.worker, trace.as_ref());
        (
            crate::io::until(timer, try_deadline, one).await,
            first,
            None,
        )
    }
}

/// A try's pick, and when it was made (the balancer's clock and the wall clock).
pub(crate) struct Tried {
    pub(crate) pick: Pick,
    pub(crate) at: Duration,
    pub(crate) wall: Instant,
}

/// A hedged first try: what it needs besides the tries themselves.
pub(crate) struct Race<'a> {
    pub(crate) cluster: &'a Arc<Cluster>,
    pub(crate) client: &'a Client,
    pub(crate) hash: Option<u64>,
    /// The prompt's block names (a `prefix-affinity` cluster).
    pub(crate) prefix: &'a [u64],
    pub(crate) deadline: Instant,
    pub(crate) limits: Limits,
    pub(crate) hedger: &'a keel_balance::Hedger,
    /// How long the first try runs alone.
    pub(crate) delay: Duration,
    /// Endpoints tried so far (the hedge avoids them).
    pub(crate) tried: &'a [EndpointId],
    /// The request's trace, if it is traced.
    pub(crate) trace: Option<&'a Trace>,
    /// The try that lost the race, if one did (set by [`Race::run`]): a span of the trace.
    /// A race has two tries: at most one loses.
    pub(crate) lost: OnceLock<Lost>,
}

/// A hedge race's losing try: cancelled when the other answered, or failed while the other
/// went on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lost {
    /// Its endpoint's index in the cluster.
    pub(crate) index: usize,
    pub(crate) outcome: TryOutcome,
    /// When it started, and how long it ran.
    pub(crate) wall: Instant,
    pub(crate) took: Duration,
    /// It was the hedge (not the first try).
    pub(crate) hedge: bool,
}

/// A try's result: `None` when it ran out of time.
pub(crate) type TryResult<W> = Option<Result<W, TryFailure<W>>>;

impl Race<'_> {
    /// Notes the try of `tried` as the race's loser (`hedge`: the hedge's).
    fn lose(&self, tried: &Tried, outcome: TryOutcome, hedge: bool) {
        let _ = self.lost.set(Lost {
            index: tried.pick.index(),
            outcome,
            wall: tried.wall,
            took: crate::io::since(tried.wall),
            hedge,
        });
    }

    /// The `traceparent` of the first try (a race is the first attempt's) or of its hedge.
    pub(crate) fn traceparent(&self, hedge: bool) -> Option<TraceParent> {
        self.trace.map(|t| t.traceparent(0, hedge))
    }

    /// Runs the first try (on `a`) alone for `delay`; if it has not answered by then and the
    /// budget allows, sends a hedge (on `b`) to another endpoint, and the first good answer
    /// wins. The loser's pick is dropped (cancelled, not failed); a try that fails while the
    /// other runs is finished as a failure at once. Returns the result to go on with (a
    /// success, or the last failure when both failed), the pick it belongs to, the hedge's
    /// endpoint if one went, and whether the result is the hedge's (`b`'s).
    pub(crate) async fn run<L: Leg>(
        &self,
        first: Tried,
        a: &mut L,
        b: &mut L,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (TryResult<L::Won>, Tried, Option<EndpointId>, bool) {
        let (hedger, delay, tried) = (self.hedger, self.delay, self.tried);
        let cluster = self.cluster;
        let worker = self.client.worker;
        let entry_a = &cluster.endpoints[first.pick.index()];
        let (trace_a, trace_b) = (self.traceparent(false), self.traceparent(true));
        let leg_a = a.try_once(cluster, entry_a, worker, trace_a.as_ref());
        tokio::pin!(leg_a);
        let hedge_at = first.wall + delay;
        let alone = crate::io::until(timer, try_deadline.min(hedge_at), &mut leg_a).await;
        if alone.is_some() || hedge_at >= try_deadline {
            hedger.observe(crate::io::since(first.wall));
            return (alone, first, None, false);
        }
        // No answer yet: a hedge, if the budget allows and another endpoint is there.
        let second = if hedger.try_hedge(cluster.now()) {
            let now = cluster.now();
            let mut ctx = PickContext::new(now)
                .with_avoid(tried)
                .with_prefix(self.prefix);
            if let Some(k) = self.hash {
                ctx = ctx.with_hash_key(k);
            }
            cluster
                .balancer
                .pick(&ctx)
                .filter(|p| p.id() != first.pick.id())
                .map(|pick| Tried {
                    pick,
                    at: now,
                    wall: crate::io::now(),
                })
        } else {
            None
        };
        let Some(second) = second else {
            let r = crate::io::until(timer, try_deadline, &mut leg_a).await;
            hedger.observe(crate::io::since(first.wall));
            return (r, first, None, false);
        };
        cluster.metrics.hedges.fetch_add(1, Relaxed);
        let hedged_id = second.pick.id();
        let entry_b = &cluster.endpoints[second.pick.index()];
        let leg_b = b.try_once(cluster, entry_b, worker, trace_b.as_ref());
        tokio::pin!(leg_b);
        let deadline_b = self.deadline.min(second.wall + self.limits.per_try_timeout);
        let (mut a, mut b) = (Some(first), Some(second));
        loop {
            tokio::select! {
                r = crate::io::until(timer, try_deadline, &mut leg_a), if a.is_some() => {
                    let Some(first) = a.take() else { unreachable!() };
                    hedger.observe(crate::io::since(first.wall));
                    let r = match r {
                        Some(r) => r,
                        None => Err(timed_out(&self.limits, try_deadline, self.deadline)),
                    };
                    match r {
                        Ok(won) => {
                            if let Some(second) = &b {
                                self.lose(second, TryOutcome::Cancelled, true);
                            }
                            return (Some(Ok(won)), first, Some(hedged_id), false);
                        }
                        Err(f) if b.is_none() => return (Some(Err(f)), first, Some(hedged_id), false),
                        Err(f) => {
                            self.lose(&first, TryOutcome::of_failure(&f), false);
                            failed(cluster, entry_a, &f, first.pick, first.at);
                        }
                    }
                }
                r = tokio::time::timeout_at(deadline_b.into(), &mut leg_b), if b.is_some() => {
                    let Some(second) = b.take() else { unreachable!() };
                    let r = match r {
                        Ok(r) => r,
                        Err(_) => Err(timed_out(&self.limits, deadline_b, self.deadline)),
                    };
                    match r {
                        Ok(won) => {
                            cluster.metrics.hedges_won.fetch_add(1, Relaxed);
                            if let Some(first) = &a {
                                // It would have taken at least this long.
                                hedger.observe(crate::io::since(first.wall));
                                self.lose(first, TryOutcome::Cancelled, false);
                            }
                            return (Some(Ok(won)), second, Some(hedged_id), true);
                        }
                        Err(f) if a.is_none() => return (Some(Err(f)), second, Some(hedged_id), true),
                        Err(f) => {
                            self.lose(&second, TryOutcome::of_failure(&f), true);
                            failed(cluster, entry_b, &f, second.pick, second.at);
                        }
                    }
                }
            }
        }
    }
}
