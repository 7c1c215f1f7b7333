//! The measure of an OpenAI-style answer as it passes (completions, chat completions): time to
//! first token, the mean time between tokens, the `usage` an engine sends (prompt, completion
//! and cached tokens) and the model named. Bytes are looked at as they go by and never held
//! back: a server-sent event is kept only while it is incomplete, in one buffer of bounded
//! size allocated once per answer, and an event longer than that (a large piece of text) is
//! timed without being read.

use std::time::{Duration, Instant};

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
    /// The event the stream ended with carried `usage` and no token (what a client that did
    /// not ask for usage must not get).
    pub saw_usage_event: bool,
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
            saw_usage_event: false,
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

    /// Reads a whole (non-streamed) JSON answer's first bytes for its `usage` and `model`;
    /// `done`: the body ended with these bytes. Its time to first token is the whole answer's.
    pub(crate) fn feed_whole(&mut self, bytes: &[u8], now: Instant, done: bool) {
        let room = MAX_EVENT.saturating_sub(self.event.len());
        self.event
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
        if done {
            let body = std::mem::take(&mut self.event);
            self.read_fields(&body);
            self.first.get_or_insert(now);
        }
    }

    fn event_done(&mut self, event: &[u8], now: Instant) {
        let Some(data) = data_of(event) else { return };
        if data.trim_ascii() == b"[DONE]" {
            return;
        }
        self.read_fields(data);
        let usage_only =
            find(data, b"\"choices\":[]").is_some() && find(data, b"\"usage\":").is_some();
        self.saw_usage_event = usage_only;
        if !usage_only && has_content(data) {
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
            assert!(m.saw_usage_event);
            if step == 1 {
                // Event k ends at (k + 1) x 10 ms: the first token is event 1's.
                assert_eq!(m.ttft(), Some(Duration::from_millis(20)));
                assert_eq!(m.itl(), Some(Duration::from_millis(10)));
            }
        }
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
