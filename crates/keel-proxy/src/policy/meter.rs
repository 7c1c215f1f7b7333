//! An OpenAI-style answer measured as it passes (completions, chat completions; an
//! `inference = true` cluster's): time to first token, the mean time between tokens, the
//! `usage` an engine sends (prompt, completion and cached tokens) and the model named.
//! Bytes are looked at as they go by and never held back to be measured: a server-sent event
//! is kept only while it is incomplete, in one buffer of bounded size allocated once per
//! answer, and an event longer than that (a large piece of text) is timed without being read.
//!
//! When keel asked the engine for `usage` on a client's behalf ([`Metering`]'s `strip`), the
//! usage-only event is taken out of what the client gets: the incomplete event at the end of
//! a frame is then held until its end (at most [`MAX_EVENT`] bytes; a longer one is passed on
//! at once, since a usage event is short).

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use hyper::body::Frame;

use crate::metrics::inference::{Measured, MeasuredSlot};
use crate::metrics::ClusterMetrics;
use crate::policy::budget::Charge;

/// Longest event read for its `usage` and `model` (vLLM's usage event is about 300 bytes).
const MAX_EVENT: usize = 4096;

/// Longest model name kept.
const MAX_MODEL: usize = 128;

/// What an answer's bytes said, so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// Follows one answer: a stream of server-sent events, or a whole JSON body.
#[derive(Debug)]
pub(crate) struct StreamMeter {
    /// When the request arrived: time to first token counts from it.
    started: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    /// Gaps between tokens, summed, and their number.
    gaps: Duration,
    n_gaps: u32,
    /// The incomplete event (or, for a whole body, the body's first bytes).
    event: Vec<u8>,
    /// The event being read outgrew [`MAX_EVENT`]: the rest of it is skipped.
    skipping: bool,
    /// The last byte looked at was a line end (an empty line ends an event).
    after_newline: bool,
    pub usage: Usage,
    model: [u8; MAX_MODEL],
    model_len: usize,
    /// A whole answer's last bytes, once it is longer than [`MAX_EVENT`].
    tail: Option<Vec<u8>>,
}

impl StreamMeter {
    /// A meter for the answer of a request that arrived at `started`.
    pub(crate) fn new(started: Instant) -> Self {
        Self {
            started,
            first: None,
            last: None,
            gaps: Duration::ZERO,
            n_gaps: 0,
            event: Vec::with_capacity(512),
            skipping: false,
            after_newline: false,
            usage: Usage::default(),
            model: [0; MAX_MODEL],
            model_len: 0,
            tail: None,
        }
    }

    /// Looks at the next bytes of a server-sent event stream, arrived at `now`.
    pub(crate) fn feed(&mut self, bytes: &[u8], now: Instant) {
        let mut rest = bytes;
        while !rest.is_empty() {
            // Up to the end of the current event (an empty line), or all of `rest`.
            let mut end = None;
            for (i, &b) in rest.iter().enumerate() {
                if b == b'\n' {
                    if self.after_newline {
                        end = Some(i + 1);
                        break;
                    }
                    self.after_newline = true;
                } else if b != b'\r' {
                    self.after_newline = false;
                }
            }
            let take = end.unwrap_or(rest.len());
            if !self.skipping {
                if self.event.len() + take > MAX_EVENT {
                    // Too long to read: a token (usage events are short), timed at its end.
                    self.skipping = true;
                    self.event.clear();
                } else {
                    self.event.extend_from_slice(&rest[..take]);
                }
            }
            rest = &rest[take..];
            if end.is_some() {
                self.after_newline = false;
                if std::mem::take(&mut self.skipping) {
                    self.token(now);
                } else {
                    let event = std::mem::take(&mut self.event);
                    self.event_done(&event, now);
                    self.event = event;
                    self.event.clear();
                }
            }
        }
    }

    /// Reads a whole (non-streamed) JSON answer for its `usage` and `model`: its first and
    /// its last [`MAX_EVENT`] bytes are kept (vLLM writes `model` first and `usage` last);
    /// `done`: the body ended with these bytes. Its time to first token is the whole answer's.
    pub(crate) fn feed_whole(&mut self, bytes: &[u8], now: Instant, done: bool) {
        let room = MAX_EVENT.saturating_sub(self.event.len());
        let (head, rest) = bytes.split_at(bytes.len().min(room));
        self.event.extend_from_slice(head);
        if !rest.is_empty() {
            let tail = self
                .tail
                .get_or_insert_with(|| Vec::with_capacity(2 * MAX_EVENT));
            tail.extend_from_slice(rest);
            if tail.len() > 2 * MAX_EVENT {
                tail.drain(..tail.len() - MAX_EVENT);
            }
        }
        if done {
            let body = std::mem::take(&mut self.event);
            self.read_fields(&body);
            if let Some(tail) = self.tail.take() {
                self.read_fields(&tail[tail.len().saturating_sub(MAX_EVENT)..]);
            }
            self.first.get_or_insert(now);
        }
    }

    fn event_done(&mut self, event: &[u8], now: Instant) {
        let Some(data) = data_of(event) else { return };
        if data.trim_ascii() == b"[DONE]" {
            return;
        }
        self.read_fields(data);
        if !usage_only(data) && has_content(data) {
            self.token(now);
        }
    }

    fn token(&mut self, now: Instant) {
        if self.first.is_none() {
            self.first = Some(now);
        } else if let Some(last) = self.last {
            self.gaps += now.saturating_duration_since(last);
            self.n_gaps += 1;
        }
        self.last = Some(now);
    }

    fn read_fields(&mut self, json: &[u8]) {
        if self.model_len == 0 {
            if let Some(m) = string_after(json, b"\"model\":") {
                let n = m.len().min(MAX_MODEL);
                self.model[..n].copy_from_slice(&m[..n]);
                self.model_len = n;
            }
        }
        if find(json, b"\"usage\":").is_some() {
            let u = &mut self.usage;
            u.prompt_tokens = number_after(json, b"\"prompt_tokens\":").or(u.prompt_tokens);
            u.completion_tokens =
                number_after(json, b"\"completion_tokens\":").or(u.completion_tokens);
            u.cached_tokens = number_after(json, b"\"cached_tokens\":").or(u.cached_tokens);
        }
    }

    /// Time from the request's arrival to the first token.
    pub(crate) fn ttft(&self) -> Option<Duration> {
        self.first
            .map(|f| f.saturating_duration_since(self.started))
    }

    /// Mean time between two tokens.
    pub(crate) fn itl(&self) -> Option<Duration> {
        (self.n_gaps > 0).then(|| self.gaps / self.n_gaps)
    }

    /// The model the answer named.
    pub(crate) fn model(&self) -> Option<&str> {
        std::str::from_utf8(&self.model[..self.model_len])
            .ok()
            .filter(|m| !m.is_empty())
    }

    /// What was measured so far.
    pub(crate) fn measured(&self) -> Measured {
        Measured {
            ttft: self.ttft(),
            itl: self.itl(),
            prompt_tokens: self.usage.prompt_tokens,
            completion_tokens: self.usage.completion_tokens,
            cached_tokens: self.usage.cached_tokens,
            model: self.model().map(Into::into),
        }
    }
}

/// True if an event's data carries `usage` and no choice: the last event of a stream whose
/// request had `stream_options.include_usage` (vLLM's, OpenAI's and keel's engine's spelling).
fn usage_only(data: &[u8]) -> bool {
    find(data, b"\"choices\":[]").is_some() && find(data, b"\"usage\":").is_some()
}

/// The shape of an answer: server-sent events, or one JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Events,
    Whole,
}

/// Takes the usage-only event out of a stream of server-sent events.
#[derive(Debug, Default)]
struct Strip {
    /// The current event's bytes so far, not yet handed on.
    held: Vec<u8>,
    /// The current event outgrew [`MAX_EVENT`]: its bytes go on as they come.
    passing: bool,
    after_newline: bool,
}

impl Strip {
    /// What of `data` goes on now: complete events that are not usage-only, and a long
    /// event's bytes; the rest of an incomplete short event waits for its end.
    fn filter(&mut self, data: &Bytes) -> Bytes {
        let untouched = self.held.is_empty() && !self.passing;
        let mut out = BytesMut::new();
        let mut dropped = false;
        let mut start = 0;
        for (i, &b) in data.iter().enumerate() {
            if b == b'\n' {
                if !self.after_newline {
                    self.after_newline = true;
                    continue;
                }
                self.after_newline = false;
                let event = &data[start..=i];
                start = i + 1;
                if std::mem::take(&mut self.passing) {
                    out.extend_from_slice(event);
                    continue;
                }
                self.held.extend_from_slice(event);
                match data_of(&self.held) {
                    Some(d) if usage_only(d) => dropped = true,
                    _ => out.extend_from_slice(&self.held),
                }
                self.held.clear();
            } else if b != b'\r' {
                self.after_newline = false;
            }
        }
        let rest = &data[start..];
        if self.passing {
            out.extend_from_slice(rest);
        } else if self.held.len() + rest.len() > MAX_EVENT {
            out.extend_from_slice(&self.held);
            out.extend_from_slice(rest);
            self.held.clear();
            self.passing = true;
        } else {
            self.held.extend_from_slice(rest);
        }
        if untouched && !dropped && self.held.is_empty() && !self.passing {
            return data.clone();
        }
        out.freeze()
    }

    /// What was held when the stream ended (an event without its blank line).
    fn rest(&mut self) -> Option<Bytes> {
        (!self.held.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.held)))
    }
}

/// A frame of a body, or its end.
type Polled<E> = Poll<Option<Result<Frame<Bytes>, E>>>;

/// An answer's body measured on its way: each frame fed to the meter and handed on (without
/// the usage-only event when `strip`). At its end (or when it is dropped before, cut) the
/// measure goes to the request's record and to the cluster's series, once, and its `usage` to
/// the tenant's token budget (the estimate stands without it).
#[derive(Debug)]
pub(crate) struct Metering {
    meter: StreamMeter,
    shape: Shape,
    strip: Option<Strip>,
    slot: MeasuredSlot,
    metrics: Arc<ClusterMetrics>,
    /// What the request took from its tenant's token budget, if it has one.
    charge: Option<Charge>,
    /// The source has ended.
    ended: bool,
    finished: bool,
}

impl Metering {
    /// Measures an answer of `shape` to a request that arrived at `started`; `strip`: keel
    /// asked for the usage the client did not; `charge`: its token budget's charge.
    pub(crate) fn new(
        started: Instant,
        shape: Shape,
        strip: bool,
        slot: MeasuredSlot,
        metrics: Arc<ClusterMetrics>,
        charge: Option<Charge>,
    ) -> Self {
        Metering {
            meter: StreamMeter::new(started),
            shape,
            strip: (strip && shape == Shape::Events).then(Strip::default),
            slot,
            metrics,
            charge,
            ended: false,
            finished: false,
        }
    }

    /// True once every frame was handed on (`source_ended`: the source says it has ended).
    pub(crate) fn is_end_stream(&self, source_ended: bool) -> bool {
        (self.ended || source_ended) && self.strip.as_ref().is_none_or(|s| s.held.is_empty())
    }

    /// The next frame, read with `source`, which also tells whether the source has ended with
    /// it (a body that knows its end is not polled past it).
    pub(crate) fn poll_frame<E>(
        &mut self,
        cx: &mut Context<'_>,
        mut source: impl FnMut(&mut Context<'_>) -> (Polled<E>, bool),
    ) -> Polled<E> {
        loop {
            if self.ended {
                return Poll::Ready(
                    self.strip
                        .as_mut()
                        .and_then(Strip::rest)
                        .map(|b| Ok(Frame::data(b))),
                );
            }
            let (polled, source_ended) = source(cx);
            match polled {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            let now = Instant::now();
                            match self.shape {
                                Shape::Events => self.meter.feed(&data, now),
                                Shape::Whole => self.meter.feed_whole(&data, now, false),
                            }
                            let data = match &mut self.strip {
                                Some(s) => s.filter(&data),
                                None => data,
                            };
                            if source_ended {
                                self.end();
                                if let Some(rest) = self.strip.as_mut().and_then(Strip::rest) {
                                    let mut all = BytesMut::from(&data[..]);
                                    all.extend_from_slice(&rest);
                                    return Poll::Ready(Some(Ok(Frame::data(all.freeze()))));
                                }
                            } else if data.is_empty() {
                                // All held back or taken out: nothing to hand on yet.
                                continue;
                            }
                            Frame::data(data)
                        }
                        Err(trailers) => {
                            self.end();
                            trailers
                        }
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => self.end(),
                other => return other,
            }
        }
    }

    fn end(&mut self) {
        self.ended = true;
        if self.shape == Shape::Whole {
            self.meter.feed_whole(&[], Instant::now(), true);
        }
        self.finish();
    }

    /// Hands the measure on, once.
    fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let measured = self.meter.measured();
        if let Some(charge) = &mut self.charge {
            let used = measured
                .prompt_tokens
                .zip(measured.completion_tokens)
                .map(|(p, c)| p.saturating_add(c));
            charge.settle(used);
        }
        self.metrics
            .inference
            .get_or_init(Default::default)
            .observe(&measured);
        let _ = self.slot.set(measured);
    }
}

impl Drop for Metering {
    fn drop(&mut self) {
        // Cut (the client or the endpoint went away): what was measured still counts.
        self.finish();
    }
}

/// The data of an event: its `data:` lines (one in OpenAI's streams).
fn data_of(event: &[u8]) -> Option<&[u8]> {
    event
        .split(|b| *b == b'\n')
        .find_map(|l| l.strip_prefix(b"data:"))
        .map(|d| d.trim_ascii())
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Bytes after `key` and blanks.
fn after<'a>(json: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let at = find(json, key)? + key.len();
    Some(json[at..].trim_ascii_start())
}

fn number_after(json: &[u8], key: &[u8]) -> Option<u64> {
    let rest = after(json, key)?;
    let n = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..n]).ok()?.parse().ok()
}

/// A string value without escapes (model names have none).
fn string_after<'a>(json: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let rest = after(json, key)?.strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"' || *b == b'\\')?;
    (rest[end] == b'"').then(|| &rest[..end])
}

/// True if a chunk carries generated text: a `text` or `content` string that is not empty
/// (chat's first chunk names the role with empty content).
fn has_content(data: &[u8]) -> bool {
    [&b"\"text\":"[..], b"\"content\":"]
        .iter()
        .any(|k| after(data, k).is_some_and(|v| v.starts_with(b"\"") && !v.starts_with(b"\"\"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"\",\"role\":\"assistant\"},\"index\":0}],\"model\":\"keel-llm\",\"object\":\"chat.completion.chunk\"}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"one \"},\"index\":0}],\"model\":\"keel-llm\"}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"two \"},\"index\":0}],\"model\":\"keel-llm\"}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"three\"},\"finish_reason\":\"length\",\"index\":0}],\"model\":\"keel-llm\"}\n\n",
        "data: {\"choices\":[],\"model\":\"keel-llm\",\"usage\":{\"completion_tokens\":3,\"prompt_tokens\":420,\"prompt_tokens_details\":{\"cached_tokens\":400},\"total_tokens\":423}}\n\n",
        "data: [DONE]\n\n",
    );

    /// Feeds `text` in pieces of `step` bytes, each at (events ended before it + 1) x 10 ms.
    fn meter(text: &str, step: usize) -> StreamMeter {
        let t0 = Instant::now();
        let mut m = StreamMeter::new(t0);
        let mut fed = 0;
        for piece in text.as_bytes().chunks(step) {
            let ended = text[..fed].matches("\n\n").count() as u32;
            m.feed(piece, t0 + Duration::from_millis(10) * (ended + 1));
            fed += piece.len();
        }
        m
    }

    #[test]
    fn a_chat_stream_gives_its_tokens_times_and_usage_whatever_its_pieces() {
        for step in [1, 7, 64, STREAM.len()] {
            let m = meter(STREAM, step);
            assert_eq!(m.model(), Some("keel-llm"), "step {step}");
            assert_eq!(
                m.usage,
                Usage {
                    prompt_tokens: Some(420),
                    completion_tokens: Some(3),
                    cached_tokens: Some(400)
                },
                "step {step}"
            );
            if step == 1 {
                // Event k ends at (k + 1) x 10 ms: the first token is event 1's.
                assert_eq!(m.ttft(), Some(Duration::from_millis(20)));
                assert_eq!(m.itl(), Some(Duration::from_millis(10)));
            }
        }
    }

    /// Polls a metered body fed `text` in pieces of `step` bytes; the bytes handed on.
    fn metered(text: &str, step: usize, strip: bool) -> (Vec<u8>, Measured) {
        let slot = MeasuredSlot::default();
        let metrics = Arc::new(ClusterMetrics::default());
        let mut m = Metering::new(
            Instant::now(),
            Shape::Events,
            strip,
            slot.clone(),
            metrics,
            None,
        );
        let mut pieces: std::collections::VecDeque<Bytes> = text
            .as_bytes()
            .chunks(step)
            .map(Bytes::copy_from_slice)
            .collect();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        loop {
            let polled = m.poll_frame::<std::io::Error>(&mut cx, |_| {
                let p = pieces.pop_front();
                let ended = pieces.is_empty();
                (Poll::Ready(p.map(|b| Ok(Frame::data(b)))), ended)
            });
            match polled {
                Poll::Ready(Some(Ok(f))) => out.extend_from_slice(&f.into_data().unwrap()),
                Poll::Ready(None) => break,
                other => panic!("{other:?}"),
            }
            if m.is_end_stream(pieces.is_empty()) {
                break;
            }
        }
        assert!(m.is_end_stream(true));
        (out, slot.get().cloned().expect("measured at the end"))
    }

    #[test]
    fn the_usage_event_is_taken_out_only_when_keel_asked_for_it() {
        let usage_event = STREAM
            .split_inclusive("\n\n")
            .find(|e| e.contains("\"usage\""))
            .unwrap();
        let without = STREAM.replace(usage_event, "");
        for step in [1, 5, 64, 200, STREAM.len()] {
            let (out, m) = metered(STREAM, step, true);
            assert_eq!(String::from_utf8(out).unwrap(), without, "step {step}");
            assert_eq!(m.prompt_tokens, Some(420));
            assert_eq!(m.cached_tokens, Some(400));
            assert_eq!(m.model.as_deref(), Some("keel-llm"));
            let (out, m) = metered(STREAM, step, false);
            assert_eq!(String::from_utf8(out).unwrap(), STREAM, "step {step}");
            assert_eq!(m.completion_tokens, Some(3));
        }
        // An event without its blank line at the end is handed on at the end.
        let cut = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]";
        assert_eq!(metered(cut, 3, true).0, cut.as_bytes());
    }

    #[test]
    fn a_whole_answer_gives_its_usage() {
        let t0 = Instant::now();
        let mut m = StreamMeter::new(t0);
        let body = br#"{"choices":[{"text":"a b"}],"model":"m1","usage":{"completion_tokens":2,"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        let (a, b) = body.split_at(40);
        m.feed_whole(a, t0, false);
        m.feed_whole(b, t0 + Duration::from_millis(30), true);
        assert_eq!(m.model(), Some("m1"));
        assert_eq!(m.usage.prompt_tokens, Some(5));
        assert_eq!(m.usage.cached_tokens, Some(0));
        assert_eq!(m.ttft(), Some(Duration::from_millis(30)));
        assert_eq!(m.itl(), None);
        // A long answer: `usage` is in its last bytes, read whatever the pieces.
        let long = format!(
            r#"{{"model":"m2","choices":[{{"text":"{}"}}],"usage":{{"completion_tokens":900,"prompt_tokens":7,"prompt_tokens_details":{{"cached_tokens":3}}}}}}"#,
            "word ".repeat(3000)
        );
        for step in [100, 4000, long.len()] {
            let mut m = StreamMeter::new(t0);
            for piece in long.as_bytes().chunks(step) {
                m.feed_whole(piece, t0, false);
            }
            m.feed_whole(&[], t0, true);
            assert_eq!(m.model(), Some("m2"), "step {step}");
            assert_eq!(
                (
                    m.usage.prompt_tokens,
                    m.usage.completion_tokens,
                    m.usage.cached_tokens
                ),
                (Some(7), Some(900), Some(3)),
                "step {step}"
            );
        }
    }

    #[test]
    fn a_long_event_is_timed_unread_and_memory_stays_bounded() {
        let big = format!(
            "data: {{\"choices\":[{{\"text\":\"{}\"}}]}}\n\ndata: {{\"choices\":[{{\"text\":\"x\"}}]}}\n\n",
            "y".repeat(3 * MAX_EVENT)
        );
        let m = meter(&big, 1000);
        assert!(m.ttft().is_some() && m.itl().is_some());
        assert!(m.event.capacity() <= 2 * MAX_EVENT);
    }
}
