//! The attempt driver: the one place where a request meets the balancer. Every front end
//! (HTTP/1.1 over TCP or TLS, HTTP/2) hands it a rewritten request; it owns, once, the
//! `max_in_flight` check, the pick (avoiding endpoints already tried), the per-try and
//! whole-request deadlines, `finish` with the outcome, the retry decision within the budget,
//! and the answer when every try failed (502/503/504 with a typed [`Cause`]). The upstream
//! protocol is a [`Leg`] that moves one try's bytes and reports a typed [`TryFailure`]: what
//! failed, and whether the endpoint may have acted on the request. The legs: HTTP/1.1
//! ([`crate::leg::h1::upstream`], upgrades included), HTTP/2 ([`crate::leg::h2`], gRPC included),
//! both behind [`forward`], and TCP ([`crate::front::tcp`]), which calls [`drive`] itself.
//!
//! The front end then sends the [`Answer`]: keel's own, or the endpoint's response, whose
//! [`Tail`] finishes the pick with the body's (or tunnel's) outcome.

pub(crate) mod account;
pub(crate) mod answer;
pub(crate) mod leg;
#[cfg(test)]
mod tests;
pub(crate) mod tries;

use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_balance::{EndpointId, PickContext};
use tokio::time::Sleep;

use crate::codec::pushback::Pushback;
use crate::config::MAX_RETRY_ATTEMPTS;
use crate::driver::account::{failed, timed_out, DownstreamGuard, Tail};
use crate::driver::answer::{own, Answer, Upstream};
use crate::driver::leg::{Leg, Race, Tried};
use crate::driver::tries::{Tries, TryOutcome};
use crate::exchange::error::{Cause, ErrorKind, TryFailure};
use crate::exchange::request::{Client, Reject};
use crate::exchange::trace::Trace;
use crate::route::Limits;
use crate::upstream::cluster::Cluster;

/// What [`drive`] needs of a request besides its leg: where it goes, who asked, when, within
/// which limits, and what steers the pick.
pub(crate) struct DriverRequest<'a> {
    pub cluster: &'a Arc<Cluster>,
    pub client: &'a Client,
    pub start: Instant,
    pub limits: Limits,
    /// The hash key, for a cluster that hashes.
    pub hash: Option<u64>,
    /// The prompt's block names (a `prefix-affinity` cluster), for every pick.
    pub prefix: &'a [u64],
    /// How much of a streamed request body has been sent (a try that sent part of it cannot
    /// be retried).
    pub body_progress: Option<&'a crate::io::BodyProgress>,
    /// The endpoint token of a sticky session, tried first while its endpoint may take the
    /// call.
    pub pin: Option<u64>,
    /// The request's trace (`[tracing]`), whose span each try's `traceparent` is a child of,
    /// with a span id of its own.
    pub trace: Option<Box<Trace>>,
}

impl<'a> DriverRequest<'a> {
    /// A request with no hash key, prompt, body progress, pin or trace.
    pub(crate) fn new(
        cluster: &'a Arc<Cluster>,
        client: &'a Client,
        start: Instant,
        limits: Limits,
    ) -> Self {
        DriverRequest {
            cluster,
            client,
            start,
            limits,
            hash: None,
            prefix: &[],
            body_progress: None,
            pin: None,
            trace: None,
        }
    }
}

/// The one attempt loop: `max_in_flight`, then picks (avoiding the endpoints tried, with the
/// hash key if any) and tries on `leg` within the per-try and request deadlines, finishing
/// each failed try's pick and retrying while it is safe and the budget allows.
pub(crate) async fn drive<L: Leg>(
    req: DriverRequest<'_>,
    leg: &mut L,
    timer: &mut Pin<Box<Sleep>>,
) -> Answer<L::Won> {
    let DriverRequest {
        cluster,
        client,
        start,
        limits,
        hash,
        prefix,
        body_progress,
        pin,
        trace,
    } = req;
    let Some(guard) = DownstreamGuard::try_new(
        &cluster.metrics,
        start,
        cluster.config.protections.max_in_flight,
    ) else {
        cluster.metrics.overloaded.fetch_add(1, Relaxed);
        let cause = Cause::Overloaded {
            limit: cluster.config.protections.max_in_flight,
        };
        let mut answer = own(cluster, client, 503, &cause, None, None, 0);
        answer.tries.trace = trace;
        return Answer::Own(answer);
    };
    let deadline = start + limits.request_timeout;
    // The first try's clock readings are `start`'s; later ones read the clock again.
    let start_on_clock = cluster.at(start);
    cluster.budget.record_request(start_on_clock);
    let attempts = limits.retry_attempts.min(MAX_RETRY_ATTEMPTS) as usize;
    // Endpoints tried so far (a hedge adds one), avoided by the next pick.
    let mut tried = [EndpointId(0); MAX_RETRY_ATTEMPTS as usize + 2];
    let mut n_tried = 0;
    // Hedging: first tries of requests the leg can send twice at once.
    let hedger = cluster.hedger.as_deref().filter(|_| leg.hedgeable());
    if let Some(h) = hedger {
        h.record_call(start_on_clock);
    }
    // What the access log says of each try.
    let mut log = Tries::traced(trace);
    let mut attempt = 0;
    loop {
        let (now, wall) = if attempt == 0 {
            (start_on_clock, start)
        } else {
            (cluster.now(), crate::io::now())
        };
        let mut ctx = PickContext::new(now)
            .with_avoid(&tried[..n_tried])
            .with_prefix(prefix);
        if let Some(k) = hash {
            ctx = ctx.with_hash_key(k);
        }
        // A sticky session's first try goes to its endpoint while that one may take it.
        let picked = match pin {
            Some(token) if attempt == 0 => cluster.balancer.pick_pinned(&ctx, token),
            _ => cluster.balancer.pick(&ctx),
        };
        let Some(pick) = picked else {
            cluster.metrics.no_endpoint.fetch_add(1, Relaxed);
            let tried = attempt as u32;
            let mut answer = own(
                cluster,
                client,
                503,
                &Cause::NoEndpoint,
                None,
                Some(guard),
                tried,
            );
            answer.tries = log;
            return Answer::Own(answer);
        };
        // In flight on the endpoint when picked, this pick not counted.
        let first_in_flight = pick.endpoint().in_flight().saturating_sub(1);
        let first_id = pick.id();
        tried[n_tried] = pick.id();
        n_tried += 1;
        if cluster.uses_load_reports {
            crate::upstream::probe::after_pick(cluster, now);
        }
        let last = attempt >= attempts;
        let try_deadline = deadline.min(wall + limits.per_try_timeout);
        let first = Tried {
            pick,
            at: now,
            wall,
        };
        let hedge = hedger
            .filter(|_| attempt == 0)
            .and_then(|h| Some((h, h.delay()?)));
        // The try's result and the pick that won it are bound once, in place: the result
        // holds the endpoint's whole response (hundreds of bytes), and each binding it passed
        // through (a tuple, a re-wrapped `match`) was one more copy of it per request.
        let winner;
        let mut tried_once = match hedge {
            Some((hedger, delay)) => {
                let race = Race {
                    cluster,
                    client,
                    hash,
                    prefix,
                    deadline,
                    limits,
                    hedger,
                    delay,
                    tried: &tried[..n_tried],
                    trace: log.trace.as_deref(),
                    lost: Default::default(),
                };
                // Boxed: a race holds two tries, and unboxed it would make every request's
                // future (hedged or not) that much larger to move.
                let (result, won_by, hedged) =
                    Box::pin(leg.hedged(&race, first, timer, try_deadline)).await;
                // The loser is a span of a sampled trace (the access log leaves it out).
                if let Some(l) = race.lost.get().filter(|_| log.sampled()) {
                    let at = l.wall.saturating_duration_since(start);
                    log.push_lost(l.index, l.outcome, at, l.took, l.hedge);
                }
                if let Some(id) = hedged {
                    tried[n_tried] = id;
                    n_tried += 1;
                }
                winner = won_by;
                result
            }
            None => {
                let entry = &cluster.endpoints[first.pick.index()];
                let traceparent = log
                    .trace
                    .as_ref()
                    .map(|t| t.traceparent(attempt as u8, false));
                // Pinned where it is made: moved into `until_sent`, the try's future (its
                // leg's whole state) would be copied once more on every try.
                let one = std::pin::pin!(leg.try_once(
                    cluster,
                    entry,
                    client.worker,
                    traceparent.as_ref()
                ));
                let progress = body_progress.map(|p| (p, start, limits.per_try_timeout));
                let result = crate::io::until_sent(timer, try_deadline, progress, one).await;
                if let Some(h) = hedger.filter(|_| attempt == 0) {
                    h.observe(crate::io::since(wall));
                }
                winner = first;
                result
            }
        };
        let Tried {
            pick,
            at: now,
            wall: try_wall,
        } = winner;
        // An answer that counts once its body has begun (an OpenAI request's) is waited on
        // within the same deadline: an engine that sent its head and failed before the first
        // event failed this try, and the request may go again. Changed in place (see above).
        if leg.awaits_first_byte() {
            if let Some(Ok(won)) = &mut tried_once {
                match crate::io::until(timer, try_deadline, L::first_byte(won)).await {
                    Some(Ok(())) => {}
                    Some(Err(e)) => tried_once = Some(Err(TryFailure::Upstream(e))),
                    None => tried_once = None,
                }
            }
        }
        let index = pick.index();
        let entry = &cluster.endpoints[index];
        // A hedge's answer (not the first try's) goes on.
        let hedge_won = pick.id() != first_id;
        let in_flight = if !hedge_won {
            first_in_flight
        } else {
            // A hedge won: its endpoint's count now, this call not counted.
            pick.endpoint().in_flight().saturating_sub(1)
        };
        let try_start = try_wall.saturating_duration_since(start);
        let tail = |pick, guard, tries| Tail {
            cluster: cluster.clone(),
            endpoint: index,
            worker: client.worker,
            pick,
            guard,
            upstream_idle: cluster.config.timeouts.upstream_idle,
            max_end: cluster.config.timeouts.max_duration.map(|d| start + d),
            request_timeout: limits.request_timeout,
            attempts: attempt as u32 + 1,
            tries,
        };
        let failure = match tried_once {
            Some(Ok(won)) => {
                // An answer that is not a failure may still ask to be backed off (a `429`
                // with `Retry-After`): it goes to the client, and picks pass the endpoint over.
                if let Some(Pushback(d)) = L::pushback(&won) {
                    cluster.balancer.back_off(&pick, cluster.now(), d);
                }
                log.push(
                    index,
                    TryOutcome::Ok,
                    try_start,
                    None,
                    in_flight,
                    attempt,
                    hedge_won,
                );
                return Answer::Upstream(Upstream {
                    response: won,
                    tail: tail(Some((pick, now)), guard, log),
                });
            }
            Some(Err(f)) => f,
            // Out of time while the client was still sending its body: the client's fault
            // (a slow upload must not get healthy endpoints ejected).
            None if leg.waiting_on_client() => TryFailure::Client(Reject::Timeout),
            None => timed_out(&limits, try_deadline, deadline),
        };
        log.push(
            index,
            TryOutcome::of_failure(&failure),
            try_start,
            Some(crate::io::since(try_wall)),
            in_flight,
            attempt,
            hedge_won,
        );
        let may_have_acted = match &failure {
            TryFailure::Client(reject) => {
                // The client's fault: the pick is cancelled (dropped), never retried.
                drop(pick);
                let cause = Cause::Client(*reject);
                let tried = attempt as u32 + 1;
                let mut answer = own(
                    cluster,
                    client,
                    reject.status(),
                    &cause,
                    None,
                    Some(guard),
                    tried,
                );
                answer.tries = log;
                return Answer::Own(answer);
            }
            TryFailure::Upstream(e) => e.may_have_acted,
            // A gRPC status that is retried (UNAVAILABLE: the call was not processed, or one
            // in `retry_on_grpc_status`) is retried whatever the method; an HTTP status only
            // when idempotent.
            TryFailure::Status(_, cause) => !matches!(cause, Cause::GrpcStatus(_)),
        };
        // Every failure status is the endpoint's failure (its pick finishes as one here), but
        // only those in `retry_on_status` (`retry_on_grpc_status`) are tried again.
        let wanted = match &failure {
            TryFailure::Status(_, Cause::Status(s)) => cluster.retries_status(*s),
            TryFailure::Status(_, Cause::GrpcStatus(c)) => cluster.retries_grpc_status(*c),
            _ => true,
        };
        // The endpoint's pushback is about it alone: it is backed off for that long (every
        // pick passes it over while another endpoint may take the call), and the retry goes
        // elsewhere at once. Only when nothing else may take the retry does it wait, and only
        // if the wait ends before the deadline (else the endpoint's answer is the client's).
        let pushback = match &failure {
            TryFailure::Status(won, _) => L::pushback(won),
            _ => None,
        };
        let wait = match pushback {
            Some(Pushback(d)) if !d.is_zero() => {
                let at = cluster.now();
                // Bounded by the balancer (`max_back_off`, `max_backed_off_percent`): refused,
                // the endpoint takes picks as before, and the retry still goes elsewhere.
                let d = d.min(cluster.balancer.config().max_back_off);
                cluster.balancer.back_off(&pick, at, d);
                let this = [pick.id()];
                if cluster
                    .balancer
                    .has_other_endpoint(&PickContext::new(at).with_avoid(&this))
                {
                    Duration::ZERO
                } else {
                    d
                }
            }
            _ => Duration::ZERO,
        };
        failed(cluster, entry, &failure, pick, now);
        let before_deadline = crate::io::now() + wait < deadline;
        // Rewound only when a retry may follow.
        let safe = wanted
            && (leg.idempotent() || !may_have_acted)
            && !last
            && before_deadline
            && leg.rewind();
        if may_retry(cluster, last, safe, before_deadline) {
            if !wait.is_zero() {
                cluster.metrics.pushbacks.fetch_add(1, Relaxed);
                tokio::time::sleep(wait).await;
            }
            attempt += 1;
            continue;
        }
        return match failure {
            TryFailure::Upstream(e) => {
                let status = match e.kind {
                    ErrorKind::Timeout => 504,
                    _ => 502,
                };
                let tried = attempt as u32 + 1;
                let mut answer = own(
                    cluster,
                    client,
                    status,
                    &e.cause,
                    Some(index),
                    Some(guard),
                    tried,
                );
                answer.tries = log;
                Answer::Own(answer)
            }
            TryFailure::Status(won, _) => Answer::Upstream(Upstream {
                response: won,
                tail: tail(None, guard, log),
            }),
            TryFailure::Client(_) => unreachable!("answered above"),
        };
    }
}

/// After a failed try, whether to try again: not after the last try, only when it is safe
/// (the request can be sent again, and the endpoint cannot have acted on it or it is
/// idempotent), before the request's deadline, and within the retry budget. Counts the retry
/// or the budget's refusal.
fn may_retry(cluster: &Cluster, last: bool, safe: bool, before_deadline: bool) -> bool {
    if last || !safe || !before_deadline {
        return false;
    }
    if cluster.budget.try_retry(cluster.now()) {
        cluster.metrics.retries.fetch_add(1, Relaxed);
        true
    } else {
        cluster.metrics.budget_refusals.fetch_add(1, Relaxed);
        false
    }
}
