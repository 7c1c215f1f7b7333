//! Every try of one request, as the access log's `tries` records them (what `keel advise`
//! fits endpoints from): the endpoint, what the try came to, when it started and how long it
//! took, and the endpoint's calls in flight when it was picked; and a hedge race's loser,
//! which only the span export (`[tracing] otlp`) shows. Kept inline in the request's answer:
//! no allocation for a request of one try.

use std::time::Duration;

use crate::config::MAX_RETRY_ATTEMPTS;
use crate::exchange::trace::Trace;
pub(crate) use crate::exchange::tries::{TryOutcome, TryRecord};

/// Most tries a request makes: the first, its retries, and a hedge (or a hedge race's loser).
const MAX_TRIES: usize = MAX_RETRY_ATTEMPTS as usize + 2;

/// Every try of one request, in order. The first is held inline and the others (retries,
/// a hedge: rare) on the heap: a request's record moves with its answer through the
/// driver and into the response body, and a fixed list of every possible try made that
/// 340 bytes, copied at each move.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Tries {
    /// The request's trace (`[tracing]`): each try's span id is made from it. Boxed: the
    /// record moves with the answer through every future on the way, and untraced requests
    /// (no `[tracing]`) should not move a trace's 33 bytes with it.
    pub trace: Option<Box<Trace>>,
    /// What the answer measured (`inference = true`), filled when its body ends.
    pub inference: Option<crate::metrics::inference::MeasuredSlot>,
    /// Its prompt as keel named it (`inference = true`), for the access log.
    pub prompt: Option<PromptName>,
    len: u8,
    first: TryRecord,
    /// All the tries, the first included, once there is more than one.
    spilled: Vec<TryRecord>,
}

/// A prompt as keel named it in blocks (`keel_balance::prefix`): what `keel advise` groups
/// requests by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PromptName {
    /// The first block's name: requests sharing a prefix of a block or more share it.
    pub first: u64,
    /// Full blocks named (within `prompt_read_limit`).
    pub blocks: u32,
}

impl PromptName {
    /// The name of a prompt's blocks; `None` when it has no full block.
    pub fn of(blocks: &[u64]) -> Option<Self> {
        Some(PromptName {
            first: *blocks.first()?,
            blocks: u32::try_from(blocks.len()).unwrap_or(u32::MAX),
        })
    }
}

fn micros(d: Duration) -> u32 {
    d.as_micros().min(u128::from(u32::MAX)) as u32
}

impl Tries {
    /// No try yet, in `trace` if any.
    pub fn traced(trace: Option<Box<Trace>>) -> Self {
        Tries {
            trace,
            ..Tries::default()
        }
    }

    /// The request's trace is sampled (its spans are exported).
    pub fn sampled(&self) -> bool {
        self.trace.as_ref().is_some_and(|t| t.sampled())
    }

    /// Records a try that started `start` after the request and ended after `took` (`None`:
    /// it goes on with the response); `attempt` and `hedge` as [`TryRecord`] has them.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        endpoint: usize,
        outcome: TryOutcome,
        start: Duration,
        took: Option<Duration>,
        in_flight: u32,
        attempt: usize,
        hedge: bool,
    ) {
        let record = TryRecord {
            endpoint: endpoint as u32,
            outcome,
            start_us: micros(start),
            duration_us: took.map(micros),
            in_flight,
            attempt: attempt.min(usize::from(u8::MAX)) as u8,
            hedge,
            lost: false,
        };
        self.add(record);
    }

    /// Records a hedge race's losing try (`lost`: cancelled, or failed while the other went
    /// on): a span of the trace, not a line of the access log.
    pub fn push_lost(
        &mut self,
        endpoint: usize,
        outcome: TryOutcome,
        start: Duration,
        took: Duration,
        hedge: bool,
    ) {
        self.add(TryRecord {
            endpoint: endpoint as u32,
            outcome,
            start_us: micros(start),
            duration_us: Some(micros(took)),
            in_flight: 0,
            attempt: 0,
            hedge,
            lost: true,
        });
    }

    fn add(&mut self, record: TryRecord) {
        match self.len as usize {
            0 => self.first = record,
            n if n < MAX_TRIES => {
                if self.spilled.is_empty() {
                    self.spilled.reserve_exact(MAX_TRIES);
                    self.spilled.push(self.first);
                }
                self.spilled.push(record);
            }
            _ => return,
        }
        self.len += 1;
    }

    /// The tries the access log shows (a hedge race's loser left out), first first.
    pub fn logged(&self) -> impl Iterator<Item = &TryRecord> {
        self.as_slice().iter().filter(|r| !r.lost)
    }

    /// Every try, a hedge race's loser included, first first.
    pub fn as_slice(&self) -> &[TryRecord] {
        match self.len {
            0 => &[],
            1 => std::slice::from_ref(&self.first),
            _ => &self.spilled,
        }
    }
}
