//! The engine in real time: one task steps keel-model's pure engine, sleeps each step's
//! duration (on the precise timer, so that a step of 6.3 ms is not served as 7), then hands the
//! step's tokens to the requests over channels. Requests reach it over a channel too.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_model::inference::engine::{Counters, Engine, Event, Request, RequestId, Usage};
use keel_model::inference::EngineSpec;
use tokio::sync::mpsc;

/// What a request hears from the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Out {
    /// One output token (the first, or another).
    Token,
    /// The last token came just before; the request left the engine.
    Finished(Usage),
}

enum Msg {
    Submit {
        request: Request,
        arrived: Duration,
        out: mpsc::UnboundedSender<Out>,
    },
    Abort(RequestId),
}

/// The bounds of vLLM's `vllm:time_to_first_token_seconds` buckets.
pub(crate) const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// The engine's counters and its TTFT histogram as the last step left them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Snapshot {
    pub(crate) counters: Counters,
    /// Requests whose first token came within each bucket's bound (not cumulative).
    pub(crate) ttft_buckets: [u64; TTFT_BUCKETS.len()],
    pub(crate) ttft_count: u64,
    pub(crate) ttft_sum: f64,
}

impl Snapshot {
    fn record_ttft(&mut self, seconds: f64) {
        self.ttft_count += 1;
        self.ttft_sum += seconds;
        if let Some(i) = TTFT_BUCKETS.iter().position(|&b| seconds <= b) {
            self.ttft_buckets[i] += 1;
        }
    }
}

/// The requests' side of the engine task. The task ends when every handle is dropped.
#[derive(Clone)]
pub(crate) struct EngineHandle {
    tx: mpsc::UnboundedSender<Msg>,
    snapshot: Arc<Mutex<Snapshot>>,
    epoch: Instant,
    /// The factor on every step's duration (an `f64`'s bits): the `slow` fault.
    slowdown: Arc<AtomicU64>,
    next_id: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Starts the engine's task on the current runtime.
    pub(crate) fn start(spec: EngineSpec) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let handle = EngineHandle {
            tx,
            snapshot: Arc::new(Mutex::new(Snapshot::default())),
            epoch: Instant::now(),
            slowdown: Arc::new(AtomicU64::new(1f64.to_bits())),
            next_id: Arc::new(AtomicU64::new(1)),
        };
        tokio::spawn(run(
            Engine::new(spec),
            rx,
            handle.snapshot.clone(),
            handle.epoch,
            handle.slowdown.clone(),
        ));
        handle
    }

    /// Queues a prompt; its tokens come on the generation's channel. Dropping the generation
    /// before it finishes takes the request out of the engine.
    pub(crate) fn submit(
        &self,
        blocks: Vec<u64>,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Generation {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (out, rx) = mpsc::unbounded_channel();
        let _ = self.tx.send(Msg::Submit {
            request: Request {
                id,
                blocks,
                prompt_tokens,
                max_tokens,
            },
            arrived: self.epoch.elapsed(),
            out,
        });
        Generation {
            id,
            rx,
            tx: self.tx.clone(),
            finished: false,
        }
    }

    /// The counters now.
    pub(crate) fn snapshot(&self) -> Snapshot {
        self.snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Multiplies every later step's duration by `factor` (1: as the spec says).
    pub(crate) fn set_slowdown(&self, factor: f64) {
        self.slowdown.store(factor.to_bits(), Ordering::Relaxed);
    }
}

/// One request in the engine, as its handler holds it.
pub(crate) struct Generation {
    /// The engine's id for it (unique in this server).
    pub(crate) id: RequestId,
    rx: mpsc::UnboundedReceiver<Out>,
    tx: mpsc::UnboundedSender<Msg>,
    finished: bool,
}

impl Generation {
    /// The next token or the end; `None` if the engine stopped.
    pub(crate) async fn next(&mut self) -> Option<Out> {
        let out = self.rx.recv().await;
        self.finished |= matches!(out, Some(Out::Finished(_)));
        out
    }

    /// As [`Generation::next`], for a body's `poll_frame`.
    pub(crate) fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Out>> {
        let out = self.rx.poll_recv(cx);
        if let std::task::Poll::Ready(Some(Out::Finished(_))) = out {
            self.finished = true;
        }
        out
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Msg::Abort(self.id));
        }
    }
}

async fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    shared: Arc<Mutex<Snapshot>>,
    epoch: Instant,
    slowdown: Arc<AtomicU64>,
) {
    // Each request's channel and its arrival (for the TTFT it is actually served).
    let mut outs: HashMap<RequestId, (mpsc::UnboundedSender<Out>, Duration)> = HashMap::new();
    let mut events = Vec::new();
    let mut gone = Vec::new();
    let mut snapshot = Snapshot::default();
    loop {
        // What arrived during the last step; wait only when there is nothing to run.
        loop {
            let msg = if engine.is_idle() {
                match rx.recv().await {
                    Some(m) => m,
                    None => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(m) => m,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            };
            match msg {
                Msg::Submit {
                    request,
                    arrived,
                    out,
                } => {
                    let id = request.id;
                    // The handler checked the request against the spec already.
                    if engine.submit(request, arrived).is_ok() {
                        outs.insert(id, (out, arrived));
                    }
                }
                Msg::Abort(id) => {
                    engine.abort(id);
                    outs.remove(&id);
                }
            }
        }
        let start = Instant::now();
        let Some(step) = engine.step(start - epoch, &mut events) else {
            publish(&shared, &engine, &mut snapshot);
            continue;
        };
        publish(&shared, &engine, &mut snapshot);
        let factor = f64::from_bits(slowdown.load(Ordering::Relaxed)).max(1.0);
        crate::timer::sleep_until(start + step.duration.mul_f64(factor)).await;
        let delivered = epoch.elapsed();
        for event in events.drain(..) {
            match event {
                Event::FirstToken { id, .. } | Event::Token { id } => {
                    let Some((out, arrived)) = outs.get(&id) else {
                        continue;
                    };
                    if matches!(event, Event::FirstToken { .. }) {
                        snapshot.record_ttft(delivered.saturating_sub(*arrived).as_secs_f64());
                    }
                    if out.send(Out::Token).is_err() {
                        gone.push(id);
                    }
                }
                Event::Finished { id, usage } => {
                    if let Some((out, _)) = outs.remove(&id) {
                        let _ = out.send(Out::Finished(usage));
                    }
                }
            }
        }
        // Clients that went away: their requests leave the engine now.
        for id in gone.drain(..) {
            engine.abort(id);
            outs.remove(&id);
        }
        publish(&shared, &engine, &mut snapshot);
    }
}

fn publish(shared: &Mutex<Snapshot>, engine: &Engine, snapshot: &mut Snapshot) {
    snapshot.counters = engine.counters();
    *shared.lock().unwrap_or_else(|e| e.into_inner()) = snapshot.clone();
}
