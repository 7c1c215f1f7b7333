//! A fake vLLM server: keel-model's pure inference engine run in real time behind vLLM's
//! OpenAI-compatible HTTP/1.1 API (`keel backend --llm`), good enough to be balanced as a real
//! engine is: it caches prompt prefixes in KV blocks, so a prompt sent where its prefix is warm
//! gets its first token sooner.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: whole answers or server-sent events
//!   (one `data: {chunk}` per token, `data: [DONE]` last; with `stream_options.include_usage` a
//!   last chunk with `usage`); `usage.prompt_tokens_details.cached_tokens` is what the prefix
//!   cache served. A whole answer carries vLLM's ORCA header when the request asks
//!   (`endpoint-load-metrics-format: text|json`).
//! - `POST /tokenize`, `POST /v1/completions/render`, `POST /v1/chat/completions/render`: the
//!   prompt's tokens, as routers that tokenize through the engine ask for them.
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (vLLM's metric names).
//!
//! The failure modes are the testbed backend's ([`FailureMode`]): `refuse`, `hang`,
//! `fail-fast`, `server-error`, `flap` and `error` act before the request reaches the engine
//! (`error` on generation requests only), `reset` cuts an answer halfway (a stream after half
//! of its tokens) and resets the connection, `slow` stretches every engine step by its factor.

mod api;
mod metrics;
mod runner;

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use keel_balance::{mix64, SharedRng, ORCA_HEADER};
use keel_model::inference::{engine, EngineSpec};
use keel_model::vocab::{FailureMode, RESET_CUT};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::backend::{self, Control, ResponseBody};
use api::{Api, ApiError, Head, Piece};
use runner::{EngineHandle, Generation, Out};

/// The most bytes of a request body read (a prompt of 64 MiB is about 16 M tokens).
const MAX_BODY: usize = 64 << 20;

/// How an LLM backend behaves.
#[derive(Clone, Debug)]
pub struct LlmConfig {
    /// The engine.
    pub spec: EngineSpec,
    /// The model name served (`model` in requests and answers, `model_name` in metrics).
    pub model: String,
    /// The seed of the generated words and of the `error` mode's draws.
    pub seed: u64,
    /// The failure mode at start; change it with [`LlmHandle::set_fault`].
    pub fault: FailureMode,
    /// Value of the `x-backend` header; empty: the bound address.
    pub name: String,
}

impl Default for LlmConfig {
    fn default() -> Self {
        LlmConfig {
            spec: EngineSpec::default(),
            model: "keel-llm".to_string(),
            seed: 0,
            fault: FailureMode::None,
            name: String::new(),
        }
    }
}

struct Shared {
    engine: EngineHandle,
    spec: EngineSpec,
    model: Arc<str>,
    seed: u64,
    name: HeaderValue,
    renders: AtomicU64,
    created: u64,
    error_rng: SharedRng,
    requests: AtomicU64,
    control: watch::Sender<Control>,
    listening: watch::Sender<bool>,
}

/// A running LLM backend. Dropping it stops it too (without waiting).
pub struct LlmHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Starts an LLM backend on `listen` (port 0: any free port).
pub async fn spawn(listen: SocketAddr, cfg: LlmConfig) -> io::Result<LlmHandle> {
    cfg.fault
        .validate()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    if cfg.model.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the model name is empty",
        ));
    }
    let listener = backend::bind(listen)?;
    let addr = listener.local_addr()?;
    let name = if cfg.name.is_empty() {
        addr.to_string()
    } else {
        cfg.name.clone()
    };
    let name = HeaderValue::from_str(&name).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("backend name {name:?} is not a valid header value"),
        )
    })?;
    let refusing = cfg.fault == FailureMode::Refuse;
    let (control, _) = watch::channel(Control {
        fault: cfg.fault,
        since: Instant::now(),
        shutdown: false,
    });
    let engine = EngineHandle::start(cfg.spec);
    if let FailureMode::Slow { factor } = cfg.fault {
        engine.set_slowdown(factor);
    }
    let shared = Arc::new(Shared {
        engine,
        spec: cfg.spec,
        model: cfg.model.into(),
        renders: AtomicU64::new(1),
        seed: cfg.seed,
        name,
        created: unix_now(),
        error_rng: SharedRng::new(mix64(cfg.seed ^ 0xE77)),
        requests: AtomicU64::new(0),
        control,
        listening: watch::channel(!refusing).0,
    });
    let first = if refusing { None } else { Some(listener) };
    let task = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let serve = |stream| {
                tokio::spawn(serve_connection(shared.clone(), stream));
            };
            backend::listen_loop(&shared.control, &shared.listening, first, addr, serve).await;
        })
    };
    Ok(LlmHandle {
        addr,
        shared,
        task: Some(task),
    })
}

impl LlmHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The value of the `x-backend` header.
    pub fn name(&self) -> &str {
        self.shared.name.to_str().unwrap_or("")
    }

    /// The model name served.
    pub fn model(&self) -> &str {
        &self.shared.model
    }

    /// Generation requests received so far (whatever their answer).
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// Changes the failure mode now (an invalid one is ignored with a warning), as
    /// [`crate::backend::BackendHandle::set_fault`] does.
    pub fn set_fault(&self, fault: FailureMode) {
        if let Err(e) = fault.validate() {
            tracing::warn!(backend = %self.addr, "ignoring fault: {e}");
            return;
        }
        self.shared.engine.set_slowdown(match fault {
            FailureMode::Slow { factor } => factor,
            _ => 1.0,
        });
        self.shared.control.send_modify(|c| {
            c.fault = fault;
            c.since = Instant::now();
        });
    }

    /// Stops listening, closes every connection and waits for the listener to end.
    pub async fn shutdown(mut self) {
        self.shared.control.send_modify(|c| c.shutdown = true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for LlmHandle {
    fn drop(&mut self) {
        self.shared.control.send_modify(|c| c.shutdown = true);
    }
}

impl std::fmt::Debug for LlmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlmHandle")
            .field("addr", &self.addr)
            .field("model", &self.shared.model)
            .finish_non_exhaustive()
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    let svc = shared.clone();
    backend::serve_http1(&shared.control, stream, move |req, reset| {
        handle(svc.clone(), req, reset)
    })
    .await;
}

/// An answer's body: whole (or cut by `reset`), or a stream of server-sent events.
enum LlmBody {
    Plain(ResponseBody),
    Stream(Box<Sse>),
}

impl Body for LlmBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.get_mut() {
            LlmBody::Plain(b) => Pin::new(b).poll_frame(cx),
            LlmBody::Stream(s) => s.poll(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            LlmBody::Plain(b) => b.is_end_stream(),
            LlmBody::Stream(s) => s.ended && s.ready.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            LlmBody::Plain(b) => b.size_hint(),
            LlmBody::Stream(_) => SizeHint::default(),
        }
    }
}

/// A streamed answer: one event per token as the engine makes them.
struct Sse {
    generation: Generation,
    head: Head,
    seed: u64,
    max_tokens: usize,
    include_usage: bool,
    /// Events ready to send.
    ready: std::collections::VecDeque<Bytes>,
    tokens: usize,
    /// `reset`: after this many tokens, reset the connection.
    cut_after: Option<(usize, Arc<AtomicBool>)>,
    ended: bool,
}

impl Sse {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        loop {
            if let Some(b) = self.ready.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            if let Some((cut, reset)) = &self.cut_after {
                if self.tokens >= *cut {
                    reset.store(true, Ordering::Relaxed);
                    self.ended = true;
                    return Poll::Ready(Some(Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "injected reset",
                    ))));
                }
            }
            match self.generation.poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(io::Error::other("the engine stopped"))));
                }
                Poll::Ready(Some(Out::Token)) => {
                    let k = self.tokens;
                    self.tokens += 1;
                    let text = api::word(self.seed, self.generation.id, k);
                    let piece = format!("{text} ");
                    self.ready.push_back(api::chunk(
                        &self.head,
                        Piece::Token {
                            text: &piece,
                            last: self.tokens == self.max_tokens,
                        },
                    ));
                }
                Poll::Ready(Some(Out::Finished(u))) => {
                    if self.include_usage {
                        let usage =
                            api::usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens);
                        self.ready.push_back(api::usage_chunk(&self.head, usage));
                    }
                    self.ready.push_back(Bytes::from_static(api::DONE));
                    self.ended = true;
                }
            }
        }
    }
}

fn respond(
    shared: &Shared,
    status: StatusCode,
    kind: &'static str,
    body: LlmBody,
) -> Response<LlmBody> {
    let len = body.size_hint().exact();
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert("x-backend", shared.name.clone());
    h.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    if let Some(len) = len {
        h.insert(CONTENT_LENGTH, HeaderValue::from(len));
    }
    resp
}

const JSON: &str = "application/json";

fn json(shared: &Shared, status: StatusCode, body: Bytes) -> Response<LlmBody> {
    respond(
        shared,
        status,
        JSON,
        LlmBody::Plain(ResponseBody::whole(body)),
    )
}

fn error(shared: &Shared, e: &ApiError) -> Response<LlmBody> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    json(shared, status, e.body())
}

/// The answer of a failing server (503 or 500), after `after`.
async fn failing(shared: &Shared, status: u16, after: Duration, why: &str) -> Response<LlmBody> {
    if !after.is_zero() {
        tokio::time::sleep(after).await;
    }
    let e = ApiError {
        status,
        message: format!("backend {}: {why}", shared.name.to_str().unwrap_or("")),
        param: None,
    };
    error(shared, &e)
}

/// Holds a request unanswered until the failure mode set at `since` changes or the server
/// stops, then drops the connection.
async fn hang(shared: &Shared, since: Instant) -> Result<Response<LlmBody>, io::Error> {
    let mut rx = shared.control.subscribe();
    let _ = rx.wait_for(|c| c.shutdown || c.since != since).await;
    Err(io::Error::new(io::ErrorKind::ConnectionAborted, "hung"))
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    reset: Arc<AtomicBool>,
) -> Result<Response<LlmBody>, io::Error> {
    let control = shared.control.borrow().clone();
    let generation = matches!(req.uri().path(), "/v1/completions" | "/v1/chat/completions");
    if generation {
        shared.requests.fetch_add(1, Ordering::Relaxed);
    }
    match control.fault {
        FailureMode::None | FailureMode::Reset | FailureMode::Slow { .. } => {}
        FailureMode::Refuse => {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "refusing"))
        }
        FailureMode::Hang => return hang(&shared, control.since).await,
        FailureMode::FailFast { after } => {
            return Ok(failing(&shared, 503, after, "fail-fast").await)
        }
        FailureMode::ServerError { after } => {
            return Ok(failing(&shared, 500, after, "server-error").await)
        }
        FailureMode::Flap {
            up,
            down,
            down_fails_after,
        } => {
            if !backend::flap_is_up(control.since, Instant::now(), up, down) {
                return match down_fails_after {
                    None => hang(&shared, control.since).await,
                    Some(after) => Ok(failing(&shared, 503, after, "flapping (down)").await),
                };
            }
        }
        FailureMode::Error { probability } => {
            if generation && unit(shared.error_rng.next_u64()) < probability {
                return Ok(failing(&shared, 503, Duration::ZERO, "error (probability)").await);
            }
        }
    }
    let cut = (control.fault == FailureMode::Reset).then_some(reset);
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let orca_form = req
        .headers()
        .get(metrics::ORCA_FORMAT_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let get = method == Method::GET;
    let post = method == Method::POST;
    let resp = match path.as_str() {
        "/health" if get => respond(
            &shared,
            StatusCode::OK,
            JSON,
            LlmBody::Plain(ResponseBody::whole(Bytes::new())),
        ),
        "/metrics" if get => {
            let text = metrics::prometheus(&shared.engine.snapshot(), &shared.model);
            respond(
                &shared,
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                LlmBody::Plain(ResponseBody::whole(Bytes::from(text))),
            )
        }
        "/v1/models" if get => json(
            &shared,
            StatusCode::OK,
            api::models(&shared.model, shared.created, max_model_len(&shared.spec)),
        ),
        "/v1/completions" if post => {
            generate(&shared, Api::Completions, req, orca_form, cut).await?
        }
        "/v1/chat/completions" if post => generate(&shared, Api::Chat, req, orca_form, cut).await?,
        "/tokenize" if post => tokenize(&shared, None, req).await?,
        "/v1/completions/render" if post => tokenize(&shared, Some(Api::Completions), req).await?,
        "/v1/chat/completions/render" if post => tokenize(&shared, Some(Api::Chat), req).await?,
        "/health"
        | "/metrics"
        | "/v1/models"
        | "/v1/completions"
        | "/v1/chat/completions"
        | "/tokenize"
        | "/v1/completions/render"
        | "/v1/chat/completions/render" => json(
            &shared,
            StatusCode::METHOD_NOT_ALLOWED,
            Bytes::from_static(br#"{"detail":"Method Not Allowed"}"#),
        ),
        _ => json(
            &shared,
            StatusCode::NOT_FOUND,
            Bytes::from_static(br#"{"detail":"Not Found"}"#),
        ),
    };
    Ok(resp)
}

/// A uniform draw in [0, 1) from 53 random bits.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

fn max_model_len(spec: &EngineSpec) -> usize {
    spec.kv_blocks.max(1) * spec.block_tokens.max(1)
}

/// The request body, whole (a body over [`MAX_BODY`] is a 413).
async fn read_body(req: Request<Incoming>) -> Result<Result<Bytes, ApiError>, io::Error> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(Ok(b.to_bytes())),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Ok(Err(ApiError {
            status: 413,
            message: format!("the request body is over {MAX_BODY} bytes"),
            param: None,
        })),
        Err(e) => Err(io::Error::other(e)),
    }
}

/// Reads and checks a request: its JSON, and the model it names.
async fn read(
    shared: &Shared,
    api: Option<Api>,
    req: Request<Incoming>,
    want_ids: bool,
) -> Result<Result<api::Parsed, ApiError>, io::Error> {
    let body = match read_body(req).await? {
        Ok(b) => b,
        Err(e) => return Ok(Err(e)),
    };
    let parsed = match api::parse(api, &body, shared.spec.block_tokens.max(1), want_ids) {
        Ok(p) => p,
        Err(e) => return Ok(Err(e)),
    };
    if let Some(m) = &parsed.model {
        if **m != *shared.model {
            return Ok(Err(ApiError::no_model(m)));
        }
    }
    Ok(Ok(parsed))
}

async fn tokenize(
    shared: &Shared,
    api: Option<Api>,
    req: Request<Incoming>,
) -> Result<Response<LlmBody>, io::Error> {
    let parsed = match read(shared, api, req, true).await? {
        Ok(p) => p,
        Err(e) => return Ok(error(shared, &e)),
    };
    let ids = parsed.token_ids.as_deref().unwrap_or_default();
    let body = match api {
        None => api::tokenize(ids, max_model_len(&shared.spec)),
        Some(api) => {
            let head = Head {
                api,
                request: shared.renders.fetch_add(1, Ordering::Relaxed),
                created: unix_now(),
                model: shared.model.clone(),
            };
            api::render(&head, &parsed, ids)
        }
    };
    Ok(json(shared, StatusCode::OK, body))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn generate(
    shared: &Shared,
    api: Api,
    req: Request<Incoming>,
    orca_form: Option<String>,
    cut: Option<Arc<AtomicBool>>,
) -> Result<Response<LlmBody>, io::Error> {
    let parsed = match read(shared, Some(api), req, false).await? {
        Ok(p) => p,
        Err(e) => return Ok(error(shared, &e)),
    };
    if let Err(e) = engine::validate(&shared.spec, parsed.prompt_tokens, parsed.max_tokens) {
        let param = match e {
            engine::SubmitError::EmptyPrompt => "prompt",
            _ => "max_tokens",
        };
        return Ok(error(shared, &ApiError::bad(e.to_string(), Some(param))));
    }
    let mut generation =
        shared
            .engine
            .submit(parsed.blocks, parsed.prompt_tokens, parsed.max_tokens);
    let head = Head {
        api,
        request: generation.id,
        created: unix_now(),
        model: shared.model.clone(),
    };
    if parsed.stream {
        let mut ready = std::collections::VecDeque::new();
        if api == Api::Chat {
            ready.push_back(api::chunk(&head, Piece::Role));
        }
        let sse = Sse {
            generation,
            head,
            seed: shared.seed,
            max_tokens: parsed.max_tokens,
            include_usage: parsed.include_usage,
            ready,
            tokens: 0,
            cut_after: cut.map(|r| (parsed.max_tokens / 2, r)),
            ended: false,
        };
        let mut resp = respond(
            shared,
            StatusCode::OK,
            "text/event-stream; charset=utf-8",
            LlmBody::Stream(Box::new(sse)),
        );
        resp.headers_mut().remove(CONTENT_LENGTH);
        return Ok(resp);
    }
    let mut tokens = 0;
    let usage = loop {
        match generation.next().await {
            Some(Out::Token) => tokens += 1,
            Some(Out::Finished(u)) => break u,
            None => return Err(io::Error::other("the engine stopped")),
        }
    };
    let text = api::text(shared.seed, generation.id, tokens);
    let usage = api::usage(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
    );
    let whole = api::answer(&head, &text, usage);
    let body = match cut {
        Some(reset) => ResponseBody::Reset {
            first: Some(whole.slice(..whole.len() / 2)),
            pause: Box::pin(tokio::time::sleep(RESET_CUT)),
            reset,
            total: whole.len() as u64,
        },
        None => ResponseBody::whole(whole),
    };
    let mut resp = respond(shared, StatusCode::OK, JSON, LlmBody::Plain(body));
    if let Some(value) = orca_form.and_then(|f| metrics::orca(&shared.engine.snapshot(), &f)) {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(ORCA_HEADER, v);
        }
    }
    Ok(resp)
}
