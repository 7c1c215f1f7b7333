//! W3C Trace Context (`traceparent`, `tracestate`) for every HTTP request, whatever its front
//! end: [`Tracing::begin`] continues a client's valid `traceparent` (same trace, keel's own
//! span as the child of the client's) or starts a new trace (random 128-bit trace id), and
//! decides sampling (parent-based: a continued trace keeps its caller's sampled flag; a new
//! one is sampled at `[tracing] sample`). Each try then carries its own span id
//! ([`Trace::traceparent`]): the endpoint's parent is keel's try, not keel's request.
//!
//! A sampled request's spans leave through a [`SpanQueue`] as one [`Finished`], copied out
//! at its end; the exporter (`crate::observe::otlp`, `[tracing] otlp`) drains the queue on a
//! thread of its own.
//!
//! Nothing here allocates: ids are byte arrays, written as text into fixed arrays.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper::header::HeaderValue;

use crate::config::TracingConfig;
use crate::exchange::head::RequestHeaders;
use crate::exchange::request::{hex16, mix64, random_u64};
use crate::exchange::tries::TryRecord;
use crate::metrics::SpanCounters;

/// A `traceparent` value's length (version `00`).
pub(crate) const TRACEPARENT_LEN: usize = 55;

/// Most bytes of `tracestate` passed on (all its headers together, as one list). W3C asks a
/// vendor to pass at least 512; a longer one is dropped whole rather than cut mid-entry.
pub(crate) const MAX_TRACESTATE: usize = 512;

/// The `traceparent` flag of a sampled trace.
const SAMPLED: u8 = 0x01;
/// The `traceparent` flag of a trace id that is random (Trace Context level 2).
const RANDOM: u8 = 0x02;

/// The running proxy's tracing settings (`[tracing]`).
#[derive(Debug)]
pub(crate) struct Tracing {
    /// What it was made of.
    pub config: TracingConfig,
    /// A new trace is sampled when a random `u64` is below this; `None`: always.
    threshold: Option<u64>,
    /// Where sampled requests' spans go (`[tracing] otlp`); `None`: nowhere.
    pub export: Option<SpanQueue>,
}

impl Tracing {
    /// The settings of `[tracing]` (its ratio checked within 0..=1 by the configuration).
    pub fn new(config: &TracingConfig) -> Self {
        let sample = config.sample;
        let threshold = if sample >= 1.0 {
            None
        } else {
            // The ratio of the u64 range: 0.01 samples 1 % of new traces.
            Some((sample.max(0.0) * u64::MAX as f64) as u64)
        };
        Tracing {
            config: config.clone(),
            threshold,
            export: None,
        }
    }

    fn sample_new(&self) -> bool {
        self.threshold.is_none_or(|t| random_u64() < t)
    }

    /// The trace of a request whose head (as rewritten for the endpoint) is `head`: the
    /// client's `traceparent` continued if it is valid (and the only one), else a new trace.
    /// The client's `traceparent` is removed from the head (each try adds its own); its
    /// `tracestate` stays as sent unless the trace is new (it belongs to the trace it came
    /// with) or longer than [`MAX_TRACESTATE`].
    pub fn begin(&self, head: &mut RequestHeaders<'_>) -> Trace {
        let view = head.view();
        let (mut parents, mut first) = (0, None);
        view.find_value("traceparent", |v| {
            parents += 1;
            first.get_or_insert(v);
            None::<()>
        });
        // Two `traceparent` headers: which one is meant is unknown; W3C says start anew.
        let incoming = first.filter(|_| parents == 1).and_then(parse_traceparent);
        let (mut states, mut state_len) = (0, 0);
        view.find_value("tracestate", |v| {
            states += 1;
            state_len += v.len() + usize::from(states > 1);
            None::<()>
        });
        let drop_state = states > 0 && (incoming.is_none() || state_len > MAX_TRACESTATE);
        let trace = match incoming {
            Some(p) => Trace {
                trace_id: p.trace_id,
                parent: p.parent,
                span: new_span(),
                flags: p.flags & (SAMPLED | RANDOM),
            },
            None => Trace {
                trace_id: new_trace_id(),
                parent: [0; 8],
                span: new_span(),
                flags: RANDOM | if self.sample_new() { SAMPLED } else { 0 },
            },
        };
        if parents > 0 || drop_state {
            head.remove(|n| {
                n.eq_ignore_ascii_case(b"traceparent")
                    || (drop_state && n.eq_ignore_ascii_case(b"tracestate"))
            });
        }
        trace
    }
}

/// One request's place in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trace {
    /// The trace's id (the caller's, or a new random one).
    pub trace_id: [u8; 16],
    /// The caller's span (keel's span's parent); all zero when keel started the trace.
    pub parent: [u8; 8],
    /// keel's span for the request (the server span).
    pub span: [u8; 8],
    /// `traceparent` flags sent on: sampled, random.
    pub flags: u8,
}

/// Finished requests on their way to the exporter: a bounded queue that never blocks. A full
/// queue (the collector slow or gone) drops a request's spans and counts them.
#[derive(Debug)]
pub(crate) struct SpanQueue {
    tx: SyncSender<Finished>,
    counters: Arc<SpanCounters>,
}

impl SpanQueue {
    /// A queue of `capacity` finished requests, and its receiving end (the exporter's).
    #[cfg_attr(not(feature = "otlp"), allow(dead_code))]
    pub fn new(capacity: usize, counters: Arc<SpanCounters>) -> (Self, Receiver<Finished>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
        (SpanQueue { tx, counters }, rx)
    }

    /// Queues a finished request's spans, or drops and counts them when the queue is full.
    pub fn push(&self, finished: Finished) {
        if let Err(TrySendError::Full(f) | TrySendError::Disconnected(f)) =
            self.tx.try_send(finished)
        {
            self.counters.dropped.fetch_add(f.spans(), Relaxed);
        }
    }
}

/// Bytes of text of at most `N` bytes, in place (a longer text is cut).
#[derive(Clone, Copy)]
pub(crate) struct Text<const N: usize> {
    len: u16,
    bytes: [u8; N],
}

impl<const N: usize> Text<N> {
    pub fn new(text: &[u8]) -> Self {
        let len = text.len().min(N);
        let mut bytes = [0; N];
        bytes[..len].copy_from_slice(&text[..len]);
        Text {
            len: len as u16,
            bytes,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl<const N: usize> std::fmt::Debug for Text<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_bytes()))
    }
}

/// One try of a finished request: its record and its endpoint's address.
#[cfg_attr(not(feature = "otlp"), allow(dead_code))] // read by the exporter only
#[derive(Debug)]
pub(crate) struct TrySpan {
    pub record: TryRecord,
    pub endpoint: HeaderValue,
}

/// A sampled request as its spans are exported: the request's (server) span and one (client)
/// span per try, a hedge race's loser included. Fixed fields: a request of one try is
/// queued without an allocation.
#[cfg_attr(not(feature = "otlp"), allow(dead_code))] // read by the exporter only
#[derive(Debug)]
pub(crate) struct Finished {
    pub trace: Trace,
    /// When the request arrived, on the wall clock, and how long until its answer ended.
    pub start: SystemTime,
    pub duration: Duration,
    pub status: u16,
    /// `HTTP/1.1`, `HTTP/2.0`, ...
    pub protocol: &'static str,
    pub method: Text<16>,
    /// The target as sent upstream (cut at 128 bytes).
    pub target: Text<128>,
    pub cluster: Text<64>,
    pub client: Text<48>,
    /// The first try, and the others (retries, a hedge: on the heap, as in the access log).
    pub first: Option<TrySpan>,
    pub more: Vec<TrySpan>,
}

impl Finished {
    /// Its spans: the request's and one per try.
    pub fn spans(&self) -> u64 {
        1 + u64::from(self.first.is_some()) + self.more.len() as u64
    }

    /// Every try, first first.
    #[cfg_attr(not(feature = "otlp"), allow(dead_code))]
    pub fn tries(&self) -> impl Iterator<Item = &TrySpan> {
        self.first.iter().chain(&self.more)
    }
}

/// A `traceparent` value, written into a fixed array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TraceParent(pub [u8; TRACEPARENT_LEN]);

impl Trace {
    /// The trace is sampled (its spans are exported).
    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// keel continued a caller's trace.
    #[cfg_attr(not(feature = "otlp"), allow(dead_code))]
    pub fn continued(&self) -> bool {
        self.parent != [0; 8]
    }

    /// The span id of a try: the `attempt`-th (0 first), or the hedge of the first try. Made
    /// from the request's span id, so that nothing per try is stored: distinct for each try
    /// of a request, and as random as the request's span id.
    pub fn try_span(&self, attempt: u8, hedge: bool) -> [u8; 8] {
        let n = u64::from(attempt) * 2 + u64::from(hedge) + 1;
        let x = mix64(u64::from_be_bytes(self.span) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        nonzero(x).to_be_bytes()
    }

    /// The `traceparent` a try sends: this trace, the try's span as the parent.
    pub fn traceparent(&self, attempt: u8, hedge: bool) -> TraceParent {
        let mut v = [b'-'; TRACEPARENT_LEN];
        v[..2].copy_from_slice(b"00");
        v[3..35].copy_from_slice(&self.trace_id_hex());
        v[36..52].copy_from_slice(&hex16(u64::from_be_bytes(self.try_span(attempt, hedge))));
        v[53..].copy_from_slice(&hex2(self.flags));
        TraceParent(v)
    }

    /// The trace id as 32 lowercase hex digits (the access log's `trace_id`).
    pub fn trace_id_hex(&self) -> [u8; 32] {
        let mut out = [0; 32];
        out[..16].copy_from_slice(&hex16(u64::from_be_bytes(
            self.trace_id[..8].try_into().unwrap_or_default(),
        )));
        out[16..].copy_from_slice(&hex16(u64::from_be_bytes(
            self.trace_id[8..].try_into().unwrap_or_default(),
        )));
        out
    }
}

fn hex2(b: u8) -> [u8; 2] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    [HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]
}

/// W3C: an id of all zeros is invalid.
fn nonzero(x: u64) -> u64 {
    if x == 0 {
        1
    } else {
        x
    }
}

fn new_span() -> [u8; 8] {
    nonzero(random_u64()).to_be_bytes()
}

fn new_trace_id() -> [u8; 16] {
    let mut id = [0; 16];
    id[..8].copy_from_slice(&random_u64().to_be_bytes());
    id[8..].copy_from_slice(&nonzero(random_u64()).to_be_bytes());
    id
}

/// What a valid `traceparent` carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Incoming {
    pub trace_id: [u8; 16],
    pub parent: [u8; 8],
    pub flags: u8,
}

/// Parses a `traceparent` value (W3C Trace Context: `version-traceid-parentid-flags`,
/// lowercase hex). Version `00` is exactly 55 bytes; a later version (not `ff`) may be longer,
/// after a `-`, and is read as `00`. All-zero ids are invalid.
pub(crate) fn parse_traceparent(v: &[u8]) -> Option<Incoming> {
    if v.len() < TRACEPARENT_LEN || v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let version = hex_byte(&v[..2])?;
    match version {
        0 if v.len() != TRACEPARENT_LEN => return None,
        0xff => return None,
        _ if v.len() > TRACEPARENT_LEN && v[TRACEPARENT_LEN] != b'-' => return None,
        _ => {}
    }
    let mut trace_id = [0; 16];
    for (i, b) in trace_id.iter_mut().enumerate() {
        *b = hex_byte(&v[3 + 2 * i..5 + 2 * i])?;
    }
    let mut parent = [0; 8];
    for (i, b) in parent.iter_mut().enumerate() {
        *b = hex_byte(&v[36 + 2 * i..38 + 2 * i])?;
    }
    let flags = hex_byte(&v[53..55])?;
    if trace_id == [0; 16] || parent == [0; 8] {
        return None;
    }
    Some(Incoming {
        trace_id,
        parent,
        flags,
    })
}

/// Two lowercase hex digits (W3C refuses uppercase).
fn hex_byte(d: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    Some(digit(d[0])? << 4 | digit(d[1])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracing(sample: f64) -> Tracing {
        Tracing::new(&TracingConfig {
            sample,
            ..TracingConfig::default()
        })
    }

    const VALID: &[u8] = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparents_are_parsed_as_w3c_says() {
        let p = parse_traceparent(VALID).unwrap();
        assert_eq!(p.trace_id[0], 0x4b);
        assert_eq!(p.parent, 0x00f0_67aa_0ba9_02b7u64.to_be_bytes());
        assert_eq!(p.flags, 1);
        // A later version may carry more after a dash.
        assert!(
            parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz")
                .is_some()
        );
        for bad in [
            &b""[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            b"00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        ] {
            assert_eq!(
                parse_traceparent(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    fn text_head(extra: &str) -> Vec<u8> {
        format!("GET / HTTP/1.1\r\nhost: a\r\n{extra}x-other: 1\r\n").into_bytes()
    }

    #[test]
    fn a_valid_traceparent_is_continued_and_removed_from_the_head() {
        let tracing = tracing(0.0);
        let mut text = text_head(&format!(
            "traceparent: {}\r\ntracestate: a=1,b=2\r\n",
            std::str::from_utf8(VALID).unwrap()
        ));
        let t = tracing.begin(&mut RequestHeaders::Lines(&mut text));
        assert_eq!(&t.trace_id_hex(), b"4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(
            t.continued() && t.sampled(),
            "parent-based: the caller's flag"
        );
        assert_eq!(
            text,
            text_head("tracestate: a=1,b=2\r\n"),
            "traceparent goes, tracestate stays"
        );
        let sent = t.traceparent(0, false);
        let again = parse_traceparent(&sent.0).unwrap();
        assert_eq!(again.trace_id, t.trace_id);
        assert_eq!(again.parent, t.try_span(0, false));
        assert_ne!(again.parent, t.parent);
        assert_eq!(again.flags, 1);
        let spans = [
            t.try_span(0, false),
            t.try_span(0, true),
            t.try_span(1, false),
            t.try_span(2, false),
            t.span,
        ];
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn an_absent_malformed_or_repeated_traceparent_starts_a_new_trace() {
        let always = tracing(1.0);
        let never = tracing(0.0);
        for extra in [
            String::new(),
            "traceparent: nonsense\r\ntracestate: a=1\r\n".to_string(),
            format!(
                "traceparent: {v}\r\ntraceparent: {v}\r\n",
                v = std::str::from_utf8(VALID).unwrap()
            ),
        ] {
            let mut text = text_head(&extra);
            let t = always.begin(&mut RequestHeaders::Lines(&mut text));
            assert!(!t.continued() && t.sampled());
            assert_ne!(&t.trace_id_hex(), b"4bf92f3577b34da6a3ce929d0e0e4736");
            assert_eq!(text, text_head(""), "{extra:?}: its tracestate goes too");
            let mut text = text_head(&extra);
            assert!(!never.begin(&mut RequestHeaders::Lines(&mut text)).sampled());
            assert!(parse_traceparent(&t.traceparent(0, false).0).is_some());
        }
        // A ratio samples about that share of new traces.
        let tenth = tracing(0.1);
        let sampled = (0..10_000)
            .filter(|_| {
                tenth
                    .begin(&mut RequestHeaders::Lines(&mut text_head("")))
                    .sampled()
            })
            .count();
        assert!((700..1300).contains(&sampled), "{sampled}");
    }

    #[test]
    fn a_tracestate_too_long_is_dropped_whole() {
        let long = format!("k={}", "v".repeat(MAX_TRACESTATE));
        let mut text = text_head(&format!(
            "traceparent: {}\r\ntracestate: {long}\r\n",
            std::str::from_utf8(VALID).unwrap()
        ));
        let t = tracing(1.0).begin(&mut RequestHeaders::Lines(&mut text));
        assert!(t.continued());
        assert_eq!(text, text_head(""));
        let mut parts = hyper::Request::builder()
            .uri("http://a/")
            .header("traceparent", std::str::from_utf8(VALID).unwrap())
            .header("tracestate", "a=1")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let t = tracing(1.0).begin(&mut RequestHeaders::Map(&mut parts));
        assert!(t.continued());
        assert!(parts.headers.get("traceparent").is_none());
        assert_eq!(parts.headers.get("tracestate").unwrap(), "a=1");
    }
}
