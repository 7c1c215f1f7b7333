//! The one entry every HTTP front end hands a request to: the policy phases of its route and
//! cluster (a redirect, the rate limits, the request's rewrites, the sticky session's pin),
//! then the attempt driver over the cluster's leg, then the response phase (the response's
//! rewrites, the sticky cookie, compression). A route's `mirror` gets its copy here too, once
//! the request's rewrites are done: the same for every front end.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use hyper::header::ALT_SVC;
use tokio::time::Sleep;

use crate::config::HashOn;
use crate::driver::answer::{Answer, OwnAnswer, Upstream};
use crate::driver::{drive, DriverRequest};
use crate::exchange::error::Cause;
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{BodyFraming, Client, RequestBody, RequestHead};
use crate::exchange::trace::Trace;
use crate::leg::{HttpAnswer, HttpLeg};
use crate::metrics::{MirrorResult, RouteMetrics};
use crate::policy::inference::ForwardBody;
use crate::policy::rate::{Limited, RateLimiter};
use crate::policy::rewrite::HostRewrite;
use crate::policy::sticky::cookie;
use crate::policy::Policy;
use crate::route::{Limits, Mirror, ModelChoice, Models, RouteState};
use crate::upstream::cluster::Cluster;

/// What the driver needs to forward one request.
pub(crate) struct Request<'a> {
    /// The head for the upstream (see `crate::exchange::rewrite`): an HTTP/1.1 client's text,
    /// without its per-try end (the leg appends that), or an HTTP/2 client's parts.
    pub head: RequestHeaders<'a>,
    /// What was learned of the request.
    pub meta: &'a RequestHead,
    /// When the request arrived (its deadline counts from here).
    pub start: Instant,
    /// Its timeouts and retries (the cluster's, or its route's).
    pub limits: Limits,
    /// What its route and cluster do besides choosing an endpoint (rate limits); `None`
    /// when nothing is configured.
    pub policy: Option<&'a Policy>,
    /// Where its body is, when it streams from the client.
    pub body_progress: Option<&'a crate::io::BodyProgress>,
    /// Its route's counters and mirror.
    pub route: &'a RouteState,
}

/// Forwards a request to `cluster`: picks, tries, retries, and returns the answer to send.
/// `out` receives the endpoint's HTTP/1.1 response head; `timer` is the connection's
/// reusable per-try timer. A listener that serves HTTP/3 too announces it on every answer
/// to its TCP clients (`Alt-Svc`).
pub(crate) async fn forward<B: RequestBody>(
    cluster: &Arc<Cluster>,
    client: &Client,
    req: Request<'_>,
    body: &mut B,
    out: &mut Vec<u8>,
    timer: &mut Pin<Box<Sleep>>,
) -> HttpAnswer {
    let route = req.route;
    let mut answer = match route.models.as_deref() {
        Some(models) => by_model(models, client, req, body, out, timer).await,
        None => {
            let body = ForwardBody::Untouched(body);
            forward_once(cluster, client, req, body, out, timer, false).await
        }
    };
    if let Some(v) = &client.alt_svc {
        match &mut answer {
            Answer::Upstream(up) => up.response.headers_mut(out).append(&ALT_SVC, v.as_bytes()),
            Answer::Own(own) => own.headers.push((ALT_SVC, v.clone())),
        }
    }
    answer
}

/// The most bytes of a request's body a `models` route reads to find its `model`.
pub(crate) const MODEL_READ_LIMIT: usize = 1 << 20;

/// A `models` route's request: its body read until it names its model (or ends, or
/// [`MODEL_READ_LIMIT`] bytes are in), then forwarded to that model's target, those bytes
/// first and unchanged; keel answers a model the route does not list with `404`, and a body
/// naming none with `400` unless the route has a default `cluster`.
async fn by_model<'a, B: RequestBody>(
    models: &'a Models,
    client: &Client,
    req: Request<'a>,
    body: &mut B,
    out: &mut Vec<u8>,
    timer: &mut Pin<Box<Sleep>>,
) -> HttpAnswer {
    use crate::policy::inference::{model, ModelField, PromptBody};
    let has_body = req.meta.body != BodyFraming::None;
    let decide = |field: ModelField<'_>| match field {
        ModelField::Named(name) => match models.choose(Some(&name)) {
            ModelChoice::Target(t) => Ok((t, true)),
            _ => Err(Box::new(crate::driver::answer::model_not_found(&name))),
        },
        ModelField::Missing | ModelField::Undecided => match models.choose(None) {
            ModelChoice::Target(t) => Ok((t, false)),
            _ => Err(Box::new(crate::driver::answer::model_missing(
                MODEL_READ_LIMIT,
            ))),
        },
    };
    let (decided, body) = if !has_body {
        (decide(ModelField::Missing), ForwardBody::Untouched(body))
    } else if let Some(whole) = body.inline() {
        (decide(model(whole, true)), ForwardBody::Untouched(body))
    } else {
        let sized = matches!(req.meta.body, BodyFraming::Length(_));
        let mut read = Box::new(PromptBody::new(body, sized));
        read.fill(MODEL_READ_LIMIT, |head, whole| {
            model(head, whole) != ModelField::Undecided
        })
        .await;
        let decided = decide(model(read.head(), read.ended()));
        (decided, ForwardBody::Read(read))
    };
    let (target, named) = match decided {
        Ok(t) => t,
        Err(own) => return Answer::Own(*own),
    };
    let req = Request {
        limits: target.limits,
        policy: target.policy.as_deref(),
        route: &target.route,
        ..req
    };
    forward_once(&target.cluster, client, req, body, out, timer, named).await
}

/// One request to `cluster`: the policy phases, the prompt's reading, the driver, the
/// response phase. `named`: a `models` route read the request's model from its body.
async fn forward_once<B: RequestBody>(
    cluster: &Arc<Cluster>,
    client: &Client,
    req: Request<'_>,
    body: ForwardBody<'_, B>,
    out: &mut Vec<u8>,
    timer: &mut Pin<Box<Sleep>>,
    named: bool,
) -> HttpAnswer {
    let hash = match &cluster.config.balance.hash_on {
        Some(HashOn::ClientIp) => Some(crate::upstream::cluster::client_ip_key(client.peer)),
        Some(HashOn::Cookie(name)) => cookie(req.head.view(), name).map(keel_balance::hash_key),
        _ => req.meta.hash,
    };
    // The endpoint token a sticky session's cookie names (read before the rewrites, which may
    // remove the cookie).
    let pin = cluster.sticky.as_ref().map(|s| s.token(req.head.view()));
    // The tenant of a token budget, as the client named it (a rewrite may replace the key
    // the endpoint gets with the engines' own).
    let tenant = cluster
        .token_budget
        .as_ref()
        .and_then(|b| Some((b, b.tenant(req.head.view())?)));
    let mut head = req.head;
    // The trace context first (`[tracing]`): keel's own answers below are in the trace too.
    // Boxed: only a traced request moves it with its answer.
    let trace = cluster
        .tracing
        .as_deref()
        .map(|t| Box::new(t.begin(&mut head)));
    // A route's or cluster's policy, in this order: a redirect, the rate limits, the
    // request's rewrites (the response's follow the answer).
    let mut meta = req.meta;
    // The coding the client takes, read before any rewrite (which may remove the
    // `Accept-Encoding` an endpoint gets, so that keel compresses instead).
    let compression = req
        .policy
        .and_then(|p| p.compression.as_ref())
        .map(|c| (c, c.offer(head.view(), meta)));
    let own_meta;
    let mut rewrites = None;
    if let Some(policy) = req.policy {
        // `allow`/`deny` first: a refused client gets nothing else of the route.
        if let Err((refused, ip)) = policy.access(client, head.view()) {
            return traced(forbidden(cluster, refused, ip), trace);
        }
        if let Some(rw) = &policy.rewrites {
            let vars = rw.vars(head.view(), client, &policy.route, trace.as_deref());
            if let Some((status, location)) = &rw.redirect {
                let mut value = Vec::new();
                location.expand(&vars, &mut value);
                return traced(crate::driver::answer::redirect(*status, &value), trace);
            }
            rewrites = Some((rw, vars));
        }
        if let Err((limit, limited)) = policy.limit(client, head.view(), req.start) {
            return traced(rate_limited(cluster, client, limit, limited), trace);
        }
        if let Some((rw, vars)) = &rewrites {
            rw.request(&mut head, vars);
            // Each try adds the endpoint's `Host` when the head has none (see `end_head`): with
            // `$endpoint` always, with a value never (an HTTP/1.0 client may have sent none).
            let has_host = match rw.host {
                Some(HostRewrite::Endpoint) => Some(false),
                Some(HostRewrite::Literal(_)) => Some(true),
                None => None,
            };
            if let Some(has_host) = has_host.filter(|h| *h != meta.has_host) {
                own_meta = RequestHead {
                    has_host,
                    ..meta.clone()
                };
                meta = &own_meta;
            }
        }
    }
    if let Some(m) = req.route.mirror.as_ref().filter(|m| m.sample()) {
        mirror(m, &req.route.metrics, client, &head, meta, body.inline());
    }
    // A `prefix-affinity` cluster reads the prompt before the pick, and an `inference` one
    // a streamed request's `stream_options` (both within `prompt_read_limit`; a `models`
    // route's reading goes on from where it stopped).
    let framing = meta.body;
    let read = crate::policy::inference::read_prompt(&cluster.config, framing, body).await;
    let (prompt, mut body, usage_added) = (read.prompt, read.body, read.usage_added);
    // A token budget admits a request with a body on its estimate, before the pick.
    let mut charge = None;
    if let Some((budget, key)) = tenant.filter(|_| framing != BodyFraming::None) {
        let bytes = body.read_bytes();
        let len = match framing {
            BodyFraming::Length(n) => n,
            _ => bytes.len() as u64,
        };
        let max_tokens = crate::policy::inference::max_tokens(bytes);
        let estimate = crate::policy::budget::estimate(len, max_tokens, &budget.config);
        let now = Instant::now();
        match budget.admit(client.worker, key, estimate, now, &cluster.metrics) {
            Ok(c) => charge = Some(c),
            Err(spent) => return traced(budget_spent(cluster, &budget.config, spent), trace),
        }
    }
    let sized_meta;
    if let Some(n) = usage_added {
        // The body keel sends is longer than the client's: its length follows.
        if let crate::exchange::request::BodyFraming::Length(_) = meta.body {
            use hyper::header::CONTENT_LENGTH;
            head.remove(|name| name.eq_ignore_ascii_case(CONTENT_LENGTH.as_str().as_bytes()));
            let mut digits = Vec::with_capacity(20);
            crate::codec::push_u64(&mut digits, n);
            head.append(&CONTENT_LENGTH, &digits);
            sized_meta = RequestHead {
                body: crate::exchange::request::BodyFraming::Length(n),
                ..meta.clone()
            };
            meta = &sized_meta;
        }
    }
    // The pick reads the prompt's blocks only under `prefix-affinity`; an `inference`
    // cluster's access log names them under any strategy.
    let affinity = cluster.config.balance.strategy == keel_balance::StrategyKind::PrefixAffinity;
    let prefix = prompt
        .as_deref()
        .filter(|_| affinity)
        .map_or(&[][..], |h| h.blocks());
    let prompt_name = prompt
        .as_deref()
        .and_then(|h| crate::driver::tries::PromptName::of(h.blocks()));
    // Read as an OpenAI request: its model named, or its prompt found.
    let openai = named || !prefix.is_empty();
    let mut leg = HttpLeg::new(cluster, head, meta, &mut body, out).openai(openai);
    let asked = DriverRequest {
        hash,
        prefix,
        body_progress: req.body_progress,
        pin: pin.flatten(),
        trace,
        ..DriverRequest::new(cluster, client, req.start, req.limits)
    };
    // The answer is changed where the driver left it: it holds the endpoint's response and
    // its tail (hundreds of bytes), each move of which is a copy per request.
    let mut answer = drive(asked, &mut leg, timer).await;
    if let Answer::Upstream(Upstream { response, tail }) = &mut answer {
        if let Some((rw, vars)) = &rewrites {
            let endpoint = cluster.endpoints[tail.endpoint].authority.as_str();
            let mut headers = response.headers_mut(leg.out());
            rw.response(&mut headers, vars, endpoint, client.proto);
        }
        if let Some(sticky) = &cluster.sticky {
            // A session without a cookie, or whose endpoint could not take it, is pinned
            // to the endpoint that answered.
            let token = Some(cluster.endpoints[tail.endpoint].token);
            if pin.flatten() != token {
                if let Some(v) = sticky.set_cookie(tail.endpoint) {
                    let mut headers = response.headers_mut(leg.out());
                    headers.append(&hyper::header::SET_COOKIE, v.as_bytes());
                }
            }
        }
    }
    // A metered or compressed response is another one (moved, rarely).
    if cluster.config.inference || compression.is_some() {
        answer = match answer {
            Answer::Upstream(Upstream {
                mut response,
                mut tail,
            }) => {
                if cluster.config.inference {
                    // Measured before any compression, which reads what the meter hands on.
                    let slot = crate::metrics::inference::MeasuredSlot::default();
                    tail.tries.inference = Some(slot.clone());
                    tail.tries.prompt = prompt_name;
                    let (strip, metrics) = (usage_added.is_some(), cluster.metrics.clone());
                    response = response.meter(leg.out(), req.start, strip, slot, metrics, charge);
                }
                if let Some((c, offer)) = compression {
                    response = response.compress(leg.out(), c, offer);
                }
                Answer::Upstream(Upstream { response, tail })
            }
            own => own,
        };
    }
    answer
}

/// A request's head, owned by its copy to a mirror.
enum OwnedHead {
    Lines(Vec<u8>),
    Map(Box<hyper::http::request::Parts>),
}

/// Sends a copy of the request (its head as rewritten for the endpoint, and its body when
/// it is held whole) to the route's mirror, on a task of its own: the request never waits
/// for it. At most `max_in_flight` copies are under way; each ends within the mirror
/// cluster's `request_timeout`, its answer read and dropped.
fn mirror(
    m: &Arc<Mirror>,
    metrics: &Arc<RouteMetrics>,
    client: &Client,
    head: &RequestHeaders<'_>,
    meta: &RequestHead,
    inline: Option<&[u8]>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let count = |r: MirrorResult| metrics.mirrored[r as usize].fetch_add(1, Relaxed);
    let has_body = meta.body != crate::exchange::request::BodyFraming::None;
    let body = match inline {
        _ if meta.upgrade => None,
        Some(b) => Some(b),
        None if !has_body => Some(&[][..]),
        None => None,
    };
    let Some(body) = body else {
        count(MirrorResult::Skipped);
        return;
    };
    if m.in_flight.fetch_add(1, Relaxed) >= m.max_in_flight {
        m.in_flight.fetch_sub(1, Relaxed);
        count(MirrorResult::Dropped);
        return;
    }
    let owned = match head {
        RequestHeaders::Lines(text) => OwnedHead::Lines(text.to_vec()),
        RequestHeaders::Map(p) => {
            let mut parts = hyper::Request::new(()).into_parts().0;
            parts.method = p.method.clone();
            parts.uri = p.uri.clone();
            parts.version = p.version;
            parts.headers = p.headers.clone();
            OwnedHead::Map(Box::new(parts))
        }
    };
    let meta = RequestHead {
        expect_continue: false,
        hash: None,
        ..meta.clone()
    };
    let (m, metrics, client, body) = (m.clone(), metrics.clone(), client.clone(), body.to_vec());
    tokio::spawn(async move {
        let result = mirror_once(&m, &client, owned, &meta, &body).await;
        m.in_flight.fetch_sub(1, Relaxed);
        metrics.mirrored[result as usize].fetch_add(1, Relaxed);
    });
}

/// One copy to a mirror: one try, its answer's body read to its end and dropped, all within
/// the mirror cluster's `request_timeout`.
async fn mirror_once(
    m: &Mirror,
    client: &Client,
    mut head: OwnedHead,
    meta: &RequestHead,
    body: &[u8],
) -> MirrorResult {
    use crate::exchange::error::BodyEnd;
    let start = Instant::now();
    let deadline = tokio::time::Instant::from_std(start + m.limits.request_timeout);
    let mut out = Vec::new();
    let mut timer = crate::io::idle_timer();
    let mut body = body;
    let headers = match &mut head {
        OwnedHead::Lines(text) => RequestHeaders::Lines(text),
        OwnedHead::Map(parts) => RequestHeaders::Map(parts),
    };
    let mut leg = HttpLeg::new(&m.cluster, headers, meta, &mut body, &mut out);
    let asked = DriverRequest::new(&m.cluster, client, start, m.limits);
    let Answer::Upstream(Upstream { response, tail }) = drive(asked, &mut leg, &mut timer).await
    else {
        return MirrorResult::Failed;
    };
    let Ok((_, mut answer)) = response.into_parts(leg.out()) else {
        tail.end(BodyEnd::UpstreamFailed, None);
        return MirrorResult::Failed;
    };
    let drained = tokio::time::timeout_at(deadline, async {
        loop {
            match std::future::poll_fn(|cx| answer.poll_frame(cx)).await {
                None => return true,
                Some(Ok(_)) => {}
                Some(Err(_)) => return false,
            }
        }
    })
    .await;
    match drained {
        Ok(true) => {
            let end = answer.end();
            let conn = answer.reusable();
            tail.end(end, conn);
            MirrorResult::Answered
        }
        Ok(false) => {
            tail.end(BodyEnd::UpstreamFailed, None);
            MirrorResult::Failed
        }
        Err(_) => {
            tail.end(BodyEnd::Timeout, None);
            MirrorResult::Failed
        }
    }
}

/// keel's own answer to a request, in its trace if it has one.
fn traced(mut own: OwnAnswer, trace: Option<Box<Trace>>) -> HttpAnswer {
    own.tries.trace = trace;
    Answer::Own(own)
}

/// keel's `429 Too Many Requests` for a request a rate limit refused: counted, and with
/// `Retry-After` (whole seconds, at least 1, as RFC 9110 section 10.2.3 has it).
fn rate_limited(
    cluster: &Cluster,
    client: &Client,
    limit: &RateLimiter,
    limited: Limited,
) -> crate::driver::answer::OwnAnswer {
    cluster
        .metrics
        .rate_limited
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let cause = Cause::RateLimited {
        scope: limit.scope.clone(),
        rate: limit.config.rate,
        burst: limit.config.burst(),
    };
    let mut own = crate::driver::answer::own(cluster, client, 429, &cause, None, None, 0);
    own.headers.push((
        hyper::header::RETRY_AFTER,
        hyper::http::HeaderValue::from(limited.seconds()),
    ));
    own
}

/// keel's `429` to a request its tenant's token budget cannot cover (see
/// `crate::policy::budget`).
fn budget_spent(
    cluster: &Cluster,
    config: &crate::config::TokenBudgetConfig,
    spent: crate::policy::budget::Spent,
) -> OwnAnswer {
    let (unit, secs) = (config.unit.as_str(), spent.wait.seconds());
    let message = format!(
        "Token budget reached on tokens per {unit}: limit {}, requested {} (estimated). Please try again in {secs}s.",
        config.tokens, spent.estimate
    );
    let cause = format!(
        "token budget spent: cluster {}'s token_budget ({} tokens a {unit}) cannot cover the request's estimate of {} tokens for {secs} s; refused without trying an endpoint",
        cluster.name(),
        config.tokens,
        spent.estimate
    );
    crate::driver::answer::token_budget_spent(&message, secs, cause)
}

/// keel's `403` to a client that `allow`/`deny` refuse, counted on the cluster.
fn forbidden(
    cluster: &Cluster,
    refused: crate::policy::access::Refused,
    ip: Option<std::net::IpAddr>,
) -> crate::driver::answer::OwnAnswer {
    cluster
        .metrics
        .access_denied
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let who = ip.map_or_else(
        || "a client whose X-Forwarded-For entry is not an address".to_string(),
        |ip| format!("client {ip}"),
    );
    crate::driver::answer::OwnAnswer {
        status: 403,
        text: crate::driver::answer::answer_text(403, "access denied"),
        endpoint: None,
        show_endpoint: false,
        guard: None,
        attempts: 0,
        cause: format!(
            "access denied: {who} refused by {} allow/deny",
            refused.as_str()
        ),
        tries: Default::default(),
        headers: Vec::new(),
    }
}
