//! The driver on a fake leg: tries scripted (how long each takes, how it ends, whether the
//! endpoint may have acted), on tokio's paused clock, so that retries, deadlines, overload
//! and the hedge race are checked without sockets and without waiting.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_balance::{EndpointId, EndpointSpec, HedgeConfig};
use tokio::time::Sleep;

use crate::config::{ClusterConfig, ErrorDetail};
use crate::driver::account::DownstreamGuard;
use crate::driver::answer::{Answer, Upstream};
use crate::driver::leg::{Leg, Race, Tried, TryResult};
use crate::driver::{drive, DriverRequest};
use crate::exchange::error::{Cause, ErrorKind, TryError, TryFailure};
use crate::exchange::request::{Client, Reject};
use crate::exchange::trace::{parse_traceparent, Trace, TraceParent};
use crate::exchange::tries::TryOutcome;
use crate::metrics::Registry;
use crate::route::Limits;
use crate::upstream::cluster::{Cluster, EndpointEntry};

/// How one scripted try ends.
#[derive(Debug, Clone, Copy)]
enum End {
    /// The endpoint answers.
    Answer,
    /// No usable answer, of this kind; `acted`: the request (or part of it) had left.
    Fail { kind: ErrorKind, acted: bool },
    /// The client's body broke the try.
    Client,
    /// The endpoint answers with this status, which the leg reports as the endpoint's
    /// failure when the cluster counts it as one (as the HTTP legs do).
    Status(u16),
}

/// One try of the script: it takes `after`, then ends with `end`.
#[derive(Debug, Clone, Copy)]
struct Step {
    after: Duration,
    end: End,
}

fn step(after_ms: u64, end: End) -> Step {
    Step {
        after: Duration::from_millis(after_ms),
        end,
    }
}

const CONNECT_FAILS: End = End::Fail {
    kind: ErrorKind::Connect,
    acted: false,
};
const RESET_AFTER_SENDING: End = End::Fail {
    kind: ErrorKind::Reset,
    acted: true,
};

/// A leg whose tries follow a script (shared with the two legs of a hedge race, which take
/// their steps from it in the order they start). It answers with the index of the endpoint
/// that answered, and records where each try went.
#[derive(Clone)]
struct FakeLeg {
    script: Rc<RefCell<VecDeque<Step>>>,
    tries: Rc<RefCell<Vec<usize>>>,
    /// The `traceparent` each try was handed, in the order the tries started.
    traces: Rc<RefCell<Vec<Option<TraceParent>>>>,
    idempotent: bool,
    hedge: bool,
}

impl FakeLeg {
    fn new(steps: &[Step]) -> Self {
        FakeLeg {
            script: Rc::new(RefCell::new(steps.iter().copied().collect())),
            tries: Rc::default(),
            traces: Rc::default(),
            idempotent: true,
            hedge: false,
        }
    }

    fn tries(&self) -> Vec<usize> {
        self.tries.borrow().clone()
    }
}

impl Leg for FakeLeg {
    type Won = usize;

    async fn try_once(
        &mut self,
        cluster: &Cluster,
        entry: &EndpointEntry,
        _worker: usize,
        trace: Option<&TraceParent>,
    ) -> Result<usize, TryFailure<usize>> {
        self.traces.borrow_mut().push(trace.copied());
        let index = cluster
            .endpoints
            .iter()
            .position(|e| e.id == entry.id)
            .expect("an endpoint of the cluster");
        self.tries.borrow_mut().push(index);
        let Some(step) = self.script.borrow_mut().pop_front() else {
            panic!("try {} was not in the script", self.tries.borrow().len());
        };
        tokio::time::sleep(step.after).await;
        match step.end {
            End::Answer => Ok(index),
            End::Fail { kind, acted } => Err(TryFailure::Upstream(if acted {
                TryError::after_sending(kind, Cause::ClosedEarly)
            } else {
                TryError::before_sending(kind, Cause::ClosedEarly)
            })),
            End::Client => Err(TryFailure::Client(Reject::InvalidBody)),
            End::Status(s) if cluster.is_failure_status(s) => {
                Err(TryFailure::Status(index, Cause::Status(s)))
            }
            End::Status(_) => Ok(index),
        }
    }

    fn rewind(&mut self) -> bool {
        true
    }

    fn idempotent(&self) -> bool {
        self.idempotent
    }

    fn waiting_on_client(&self) -> bool {
        false
    }

    fn hedgeable(&self) -> bool {
        self.hedge
    }

    async fn hedged(
        &mut self,
        race: &Race<'_>,
        first: Tried,
        timer: &mut Pin<Box<Sleep>>,
        try_deadline: Instant,
    ) -> (TryResult<usize>, Tried, Option<EndpointId>) {
        let (mut a, mut b) = (self.clone(), self.clone());
        let (result, winner, hedged, _) =
            race.run(first, &mut a, &mut b, timer, try_deadline).await;
        (result, winner, hedged)
    }
}

/// A round-robin cluster of three endpoints (nothing listens: the fake leg never connects).
fn cluster(edit: impl FnOnce(&mut ClusterConfig)) -> Arc<Cluster> {
    let endpoints = (1..=3)
        .map(|i| EndpointSpec::new(format!("127.0.0.1:{}", 9000 + i)))
        .collect();
    let mut config = ClusterConfig::new("fake", endpoints);
    edit(&mut config);
    config.validate().expect("a valid cluster");
    let registry = Registry::default();
    Arc::new(Cluster::build(config, None, &registry, Instant::now(), 1).unwrap())
}

fn client() -> Client {
    Client {
        peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
        ip: "127.0.0.1".into(),
        ip_value: hyper::header::HeaderValue::from_static("127.0.0.1"),
        proto: "http",
        trust_forwarded: false,
        trusted_hops: 1,
        worker: 0,
        error_detail: ErrorDetail::Brief,
        client_cert: None,
        alt_svc: None,
    }
}

/// What `drive` decided, and how long it took on the (paused) clock.
struct Outcome {
    driven: Answer<usize>,
    took: Duration,
}

async fn run(cluster: &Arc<Cluster>, leg: &mut FakeLeg) -> Outcome {
    run_traced(cluster, leg, None).await
}

async fn run_traced(cluster: &Arc<Cluster>, leg: &mut FakeLeg, trace: Option<Trace>) -> Outcome {
    let limits = Limits::new(&cluster.config, None, None);
    let start = crate::io::now();
    let mut timer = crate::io::idle_timer();
    let client = client();
    let asked = DriverRequest {
        trace: trace.map(Box::new),
        ..DriverRequest::new(cluster, &client, start, limits)
    };
    let driven = drive(asked, leg, &mut timer).await;
    Outcome {
        driven,
        took: crate::io::since(start),
    }
}

/// The endpoint that answered and the tries the tail counts.
fn won(o: &Outcome) -> (usize, u32) {
    match &o.driven {
        Answer::Upstream(Upstream { response, tail }) => (*response, tail.attempts),
        Answer::Own(own) => panic!("keel answered {}: {}", own.status, own.cause),
    }
}

/// keel's own status, its tries and its text.
fn own(o: &Outcome) -> (u16, u32, &str) {
    match &o.driven {
        Answer::Own(own) => (own.status, own.attempts, own.text.as_str()),
        Answer::Upstream(up) => panic!("endpoint {} answered", up.response),
    }
}

#[tokio::test(start_paused = true)]
async fn a_try_that_fails_before_sending_is_retried_on_another_endpoint() {
    let c = cluster(|c| c.protections.retry.attempts = 2);
    let mut leg = FakeLeg::new(&[step(5, CONNECT_FAILS), step(5, End::Answer)]);
    leg.idempotent = false;
    let o = run(&c, &mut leg).await;
    let (index, attempts) = won(&o);
    let tries = leg.tries();
    assert_eq!(attempts, 2);
    assert_eq!(tries.len(), 2);
    assert_ne!(tries[0], tries[1], "the retry avoids the endpoint tried");
    assert_eq!(index, tries[1]);
    assert_eq!(c.metrics.retries.load(Relaxed), 1);
    assert_eq!(o.took, Duration::from_millis(10));
}

#[tokio::test(start_paused = true)]
async fn a_request_the_endpoint_may_have_acted_on_is_retried_only_when_idempotent() {
    // POST: a reset after the request left is not retried (the endpoint may have acted).
    let c = cluster(|c| c.protections.retry.attempts = 2);
    let mut post = FakeLeg::new(&[step(5, RESET_AFTER_SENDING)]);
    post.idempotent = false;
    let o = run(&c, &mut post).await;
    assert_eq!(own(&o).0, 502);
    assert_eq!(own(&o).1, 1);
    assert_eq!(post.tries().len(), 1);
    assert_eq!(c.metrics.retries.load(Relaxed), 0);
    // GET: the same failure is retried.
    let mut get = FakeLeg::new(&[step(5, RESET_AFTER_SENDING), step(5, End::Answer)]);
    let o = run(&c, &mut get).await;
    assert_eq!(won(&o).1, 2);
    assert_eq!(c.metrics.retries.load(Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn retries_stop_at_the_attempts_and_at_an_empty_budget() {
    // Every try fails: 1 + attempts tries, then 502.
    let c = cluster(|c| c.protections.retry.attempts = 2);
    let mut leg = FakeLeg::new(&[step(1, CONNECT_FAILS); 3]);
    let o = run(&c, &mut leg).await;
    assert_eq!(own(&o), (502, 3, "502 Bad Gateway: the endpoint failed\n"));
    assert_eq!(c.metrics.retries.load(Relaxed), 2);
    // A budget that allows no retry: one try, the refusal counted.
    let c = cluster(|c| {
        c.protections.retry.attempts = 2;
        c.protections.retry.budget_percent = 0.0;
        c.protections.retry.min_retries_per_second = 0.0;
    });
    let mut leg = FakeLeg::new(&[step(1, CONNECT_FAILS)]);
    let o = run(&c, &mut leg).await;
    assert_eq!(own(&o).1, 1);
    assert_eq!(c.metrics.budget_refusals.load(Relaxed), 1);
    assert_eq!(c.metrics.retries.load(Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn the_client_s_fault_is_answered_at_once_and_never_retried() {
    let c = cluster(|c| c.protections.retry.attempts = 2);
    let mut leg = FakeLeg::new(&[step(1, End::Client)]);
    let o = run(&c, &mut leg).await;
    assert_eq!(own(&o).0, Reject::InvalidBody.status());
    assert_eq!(leg.tries().len(), 1);
    assert_eq!(c.metrics.retries.load(Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn slow_tries_time_out_per_try_and_the_request_ends_at_its_deadline() {
    // 900 ms for the request, 2 retries: 300 ms a try. Every try would take 10 s.
    let c = cluster(|c| {
        c.timeouts.request = Duration::from_millis(900);
        c.protections.retry.attempts = 2;
    });
    let mut leg = FakeLeg::new(&[step(10_000, End::Answer); 3]);
    let o = run(&c, &mut leg).await;
    let (status, attempts, text) = own(&o);
    assert_eq!((status, attempts), (504, 3));
    assert!(text.contains("did not answer in time"), "{text}");
    assert_eq!(o.took, Duration::from_millis(900));
    // A per-try timeout as long as the request's: the first try meets the request's deadline,
    // and no retry follows (none would fit).
    let c = cluster(|c| {
        c.timeouts.request = Duration::from_millis(900);
        c.protections.retry.attempts = 2;
        c.protections.retry.per_try_timeout = Some(Duration::from_millis(900));
    });
    let mut leg = FakeLeg::new(&[step(10_000, End::Answer)]);
    let o = run(&c, &mut leg).await;
    assert_eq!(own(&o).0, 504);
    assert_eq!(own(&o).1, 1);
    assert_eq!(leg.tries().len(), 1);
    assert_eq!(o.took, Duration::from_millis(900));
}

#[tokio::test(start_paused = true)]
async fn a_full_cluster_answers_503_without_trying() {
    let c = cluster(|c| c.protections.max_in_flight = 1);
    let held = DownstreamGuard::try_new(&c.metrics, crate::io::now(), 1);
    assert!(held.is_some());
    let mut leg = FakeLeg::new(&[]);
    let o = run(&c, &mut leg).await;
    let (status, attempts, text) = own(&o);
    assert_eq!((status, attempts), (503, 0));
    assert!(text.contains("overloaded"), "{text}");
    assert!(leg.tries().is_empty());
    assert_eq!(c.metrics.overloaded.load(Relaxed), 1);
    drop(held);
    let mut leg = FakeLeg::new(&[step(1, End::Answer)]);
    assert_eq!(won(&run(&c, &mut leg).await).1, 1, "room again");
}

/// A cluster that hedges a first try still running after 100 ms (every call may be hedged).
fn hedging() -> Arc<Cluster> {
    cluster(|c| {
        c.protections.hedge = Some(HedgeConfig {
            delay: "100ms".parse().unwrap(),
            max: 1,
            budget_percent: 100.0,
        })
    })
}

#[tokio::test(start_paused = true)]
async fn a_slow_first_try_is_hedged_and_the_hedge_wins() {
    let c = hedging();
    let mut leg = FakeLeg::new(&[step(5_000, End::Answer), step(20, End::Answer)]);
    leg.hedge = true;
    let o = run(&c, &mut leg).await;
    let tries = leg.tries();
    let (index, _) = won(&o);
    assert_eq!(tries.len(), 2);
    assert_ne!(tries[0], tries[1], "the hedge goes to another endpoint");
    assert_eq!(index, tries[1], "the hedge's answer");
    assert_eq!(o.took, Duration::from_millis(120));
    assert_eq!(c.metrics.hedges.load(Relaxed), 1);
    assert_eq!(c.metrics.hedges_won.load(Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fast_first_try_sends_no_hedge_and_a_failed_one_leaves_the_hedge() {
    let c = hedging();
    let mut leg = FakeLeg::new(&[step(50, End::Answer)]);
    leg.hedge = true;
    let o = run(&c, &mut leg).await;
    assert_eq!(won(&o).0, leg.tries()[0]);
    assert_eq!(o.took, Duration::from_millis(50));
    assert_eq!(c.metrics.hedges.load(Relaxed), 0);
    // The first try fails while the hedge runs: the hedge's answer is the request's.
    let mut leg = FakeLeg::new(&[step(150, CONNECT_FAILS), step(200, End::Answer)]);
    leg.hedge = true;
    let o = run(&c, &mut leg).await;
    let tries = leg.tries();
    assert_eq!(won(&o).0, tries[1]);
    assert_eq!(o.took, Duration::from_millis(300));
    assert_eq!(c.metrics.hedges.load(Relaxed), 1);
    assert_eq!(c.metrics.hedges_won.load(Relaxed), 1);
}

/// The balancer's successes and failures of endpoint `index`.
fn counted(c: &Cluster, index: usize) -> (u64, u64) {
    let st = &c.balancer.status(c.now())[index];
    (st.successes, st.failures)
}

#[tokio::test(start_paused = true)]
async fn a_500_that_is_not_retried_finishes_its_pick_as_the_endpoint_s_failure() {
    // The defaults: 500 is not in `retry_on_status`. The endpoint's 500 goes to the client,
    // untried elsewhere, and its pick is finished as a failure already (the tail has none).
    let c = cluster(|c| c.protections.retry.attempts = 2);
    let mut leg = FakeLeg::new(&[step(1, End::Status(500))]);
    let o = run(&c, &mut leg).await;
    let Answer::Upstream(Upstream {
        response: index,
        tail,
    }) = &o.driven
    else {
        panic!("keel answered instead of the endpoint");
    };
    assert_eq!(leg.tries(), vec![*index]);
    assert!(
        tail.pick.is_none(),
        "the pick is finished, not left to the body"
    );
    assert_eq!(counted(&c, *index), (0, 1));
    assert_eq!(c.metrics.retries.load(Relaxed), 0);
    // A 503 (in `retry_on_status`) is the endpoint's failure too, and is retried.
    let mut leg = FakeLeg::new(&[step(1, End::Status(503)), step(1, End::Answer)]);
    let o = run(&c, &mut leg).await;
    let tries = leg.tries();
    assert_eq!(won(&o), (tries[1], 2));
    assert_eq!(counted(&c, tries[0]).1, 1);
    assert_eq!(c.metrics.retries.load(Relaxed), 1);
    // 501 answers the request (its method), not the endpoint's health: its pick is left to
    // the body, and finishes as a success.
    let mut leg = FakeLeg::new(&[step(1, End::Status(501))]);
    let o = run(&c, &mut leg).await;
    let Answer::Upstream(Upstream {
        response: index,
        tail,
    }) = o.driven
    else {
        panic!("keel answered instead of the endpoint");
    };
    let before = counted(&c, index);
    tail.end(crate::exchange::error::BodyEnd::Done, None);
    assert_eq!(counted(&c, index), (before.0 + 1, before.1));
}

#[tokio::test(start_paused = true)]
async fn a_500_in_retry_on_status_is_retried_on_another_endpoint() {
    let c = cluster(|c| {
        c.protections.retry.attempts = 1;
        c.protections.retry.retry_on_status.push(500);
    });
    let mut leg = FakeLeg::new(&[step(1, End::Status(500)), step(1, End::Answer)]);
    let o = run(&c, &mut leg).await;
    let tries = leg.tries();
    assert_ne!(tries[0], tries[1]);
    assert_eq!(won(&o), (tries[1], 2));
    assert_eq!(counted(&c, tries[0]), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn each_try_hedge_and_retry_sends_a_span_of_its_own_in_the_requests_trace() {
    let c = hedging();
    // The first try is hedged at 100 ms; both fail; the retry answers.
    let mut leg = FakeLeg::new(&[
        step(150, CONNECT_FAILS),
        step(200, CONNECT_FAILS),
        step(10, End::Answer),
    ]);
    leg.hedge = true;
    let trace = Trace {
        trace_id: [7; 16],
        parent: [9; 8],
        span: [3; 8],
        flags: 1,
    };
    let o = run_traced(&c, &mut leg, Some(trace)).await;
    won(&o);
    let sent: Vec<_> = leg
        .traces
        .borrow()
        .iter()
        .map(|t| parse_traceparent(&t.expect("every try is traced").0).unwrap())
        .collect();
    assert_eq!(sent.len(), 3);
    let mut spans: Vec<[u8; 8]> = sent.iter().map(|p| p.parent).collect();
    assert_eq!(
        spans,
        [
            trace.try_span(0, false),
            trace.try_span(0, true),
            trace.try_span(1, false)
        ]
    );
    assert!(sent
        .iter()
        .all(|p| p.trace_id == trace.trace_id && p.flags == 1));
    spans.extend([trace.span, trace.parent]);
    spans.sort();
    spans.dedup();
    assert_eq!(spans.len(), 5, "each try's span is its own");
    // The answer's record keeps the trace, and which try was the hedge and the retry.
    let Answer::Upstream(Upstream { tail, .. }) = &o.driven else {
        unreachable!()
    };
    assert_eq!(tail.tries.trace.as_deref(), Some(&trace));
    let last = tail.tries.as_slice().last().unwrap();
    assert_eq!((last.attempt, last.hedge), (1, false));
    // The first try failed while its hedge ran: a span of the trace (lost), not a line of the
    // access log, which shows the hedge and the retry.
    let all: Vec<_> = tail
        .tries
        .as_slice()
        .iter()
        .map(|r| (r.attempt, r.hedge, r.lost, r.outcome))
        .collect();
    assert_eq!(
        all,
        [
            (0, false, true, TryOutcome::Reset),
            (0, true, false, TryOutcome::Reset),
            (1, false, false, TryOutcome::Ok)
        ]
    );
    assert_eq!(tail.tries.logged().count(), 2);
    // Untraced: no traceparent at all.
    let mut leg = FakeLeg::new(&[step(1, End::Answer)]);
    run(&c, &mut leg).await;
    assert_eq!(*leg.traces.borrow(), [None]);
}

#[tokio::test(start_paused = true)]
async fn a_hedge_race_loser_is_recorded_cancelled_in_a_sampled_trace_only() {
    let trace = Trace {
        trace_id: [7; 16],
        parent: [0; 8],
        span: [3; 8],
        flags: 1,
    };
    for (sampled, flags) in [(true, 1), (false, 0)] {
        let c = hedging();
        // The first try would answer at 500 ms; its hedge (sent at 100 ms) answers at 110 ms.
        let mut leg = FakeLeg::new(&[step(500, End::Answer), step(10, End::Answer)]);
        leg.hedge = true;
        let o = run_traced(&c, &mut leg, Some(Trace { flags, ..trace })).await;
        let tries = leg.tries();
        let Answer::Upstream(Upstream { tail, .. }) = &o.driven else {
            unreachable!()
        };
        let all: Vec<_> = tail
            .tries
            .as_slice()
            .iter()
            .map(|r| {
                (
                    r.endpoint as usize,
                    r.hedge,
                    r.lost,
                    r.outcome,
                    r.duration_us,
                )
            })
            .collect();
        if sampled {
            assert_eq!(
                all,
                [
                    (tries[0], false, true, TryOutcome::Cancelled, Some(110_000)),
                    (tries[1], true, false, TryOutcome::Ok, None)
                ]
            );
        } else {
            assert_eq!(all, [(tries[1], true, false, TryOutcome::Ok, None)]);
        }
        assert_eq!(tail.tries.logged().count(), 1);
    }
}
