//! The access log: one line per request answered (keel's own answers included), as JSON or in
//! NGINX's `combined` format.
//!
//! Off the request path: a request's record ([`crate::observe::record::Record`], the one
//! place an [`Entry`] is made) is formatted into a reused per-thread buffer, and the line is
//! appended to its worker's shard (a buffer that only that worker and the writer ever lock,
//! so the lock is uncontended). A writer thread of its own swaps the shards'
//! buffers every 100 ms (or sooner when one is half full) and writes them with blocking I/O,
//! so a slow disk never holds up a request. A shard is bounded: a line that does not fit is
//! dropped and counted (`keel_access_log_dropped_total`), never waited for. SIGUSR1 (through
//! [`AccessLog::reopen`]) makes the writer reopen the file, for logrotate.

use crate::exchange::head::HeadView;
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::codec::push_u64;
use crate::config::{AccessLogConfig, AccessLogFormat, LinePiece, LogField};
use crate::driver::tries::{PromptName, Tries};
use crate::metrics::inference::Measured;
use crate::upstream::cluster::EndpointEntry;

/// Bytes a shard holds before lines are dropped (a little over 2 s of 10,000 lines a second
/// of 250 bytes, per worker).
const SHARD_BYTES: usize = 4 << 20;

/// How often the writer writes what the shards hold.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// What the access log says about one answered request.
#[derive(Debug, Default)]
pub(crate) struct Entry<'a> {
    /// The client's IP.
    pub client: &'a str,
    /// The subject of the client's verified certificate (JSON's `client_cert_subject`, only
    /// when there is one).
    pub client_cert_subject: Option<&'a str>,
    /// The request's method, target and headers, as sent upstream (or as keel read them).
    pub request: RequestLine<'a>,
    /// `HTTP/1.0`, `HTTP/1.1` or `HTTP/2.0`.
    pub protocol: &'static str,
    /// The status sent.
    pub status: u16,
    /// Bytes of the response written to the client: head and body over HTTP/1.1, the body
    /// over HTTP/2 (whose head HPACK compresses).
    pub bytes_sent: u64,
    /// Bytes of the response body written to the client.
    pub body_bytes_sent: u64,
    /// From the request's head to the end of its response.
    pub duration: Duration,
    /// The cluster that served it, if any.
    pub cluster: Option<&'a str>,
    /// The endpoint of the last try, if any.
    pub endpoint: Option<&'a [u8]>,
    /// Tries made.
    pub attempts: u32,
    /// The route's index, if a route matched.
    pub route: Option<u16>,
    /// Why keel answered itself.
    pub cause: Option<&'a str>,
    /// Every try (JSON's `tries`); `None`: none was made.
    pub tries: Option<TryLog<'a>>,
    /// The W3C trace id (`[tracing]`), as 32 hex digits.
    pub trace_id: Option<[u8; 32]>,
    /// What an inference answer measured (`inference = true`).
    pub inference: Option<&'a Measured>,
    /// Its prompt's name in blocks (`inference = true`).
    pub prompt: Option<PromptName>,
}

/// A request's tries with the endpoints of the cluster they index.
#[derive(Clone, Copy)]
pub(crate) struct TryLog<'a> {
    /// The tries.
    pub tries: &'a Tries,
    /// The cluster's endpoints.
    pub endpoints: &'a [EndpointEntry],
}

impl std::fmt::Debug for TryLog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.tries.logged()).finish()
    }
}

/// A request's line and the headers the log shows, read back from an HTTP/1.1 head.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct RequestLine<'a> {
    /// The method.
    pub method: Option<&'a [u8]>,
    /// The target in origin form.
    pub path: Option<&'a [u8]>,
    /// `Host`.
    pub host: Option<&'a [u8]>,
    /// `Referer`.
    pub referer: Option<&'a [u8]>,
    /// `User-Agent`.
    pub user_agent: Option<&'a [u8]>,
    /// `x-request-id` (the client's, or the one keel made).
    pub request_id: Option<&'a [u8]>,
}

impl<'a> RequestLine<'a> {
    /// The request line and headers the log shows, from either form of a head.
    pub fn of(head: HeadView<'a>) -> Self {
        match head {
            HeadView::Lines(text) => Self::parse(text),
            HeadView::Map(_) => RequestLine {
                method: head.method(),
                path: Some(head.target()),
                host: head.value("host"),
                referer: head.value("referer"),
                user_agent: head.value("user-agent"),
                request_id: head.value("x-request-id"),
            },
        }
    }

    /// Reads the request line and the `Host`, `Referer`, `User-Agent` and `x-request-id` headers of a head
    /// (`METHOD TARGET HTTP/1.1\r\nname: value\r\n...`), as keel wrote it for the upstream.
    pub fn parse(head: &'a [u8]) -> Self {
        let mut lines = head.split(|b| *b == b'\n');
        let mut r = RequestLine::default();
        if let Some(first) = lines.next() {
            let mut parts = first.trim_ascii_end().splitn(3, |b| *b == b' ');
            r.method = parts.next().filter(|m| !m.is_empty());
            r.path = parts.next();
        }
        for line in lines {
            let line = line.trim_ascii_end();
            if line.is_empty() {
                break;
            }
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
            if name.eq_ignore_ascii_case(b"host") {
                r.host.get_or_insert(value);
            } else if name.eq_ignore_ascii_case(b"referer") {
                r.referer.get_or_insert(value);
            } else if name.eq_ignore_ascii_case(b"user-agent") {
                r.user_agent.get_or_insert(value);
            } else if name.eq_ignore_ascii_case(b"x-request-id") {
                r.request_id.get_or_insert(value);
            }
        }
        r
    }
}

/// One worker's lines not yet written.
#[derive(Default)]
struct Shard {
    buf: Vec<u8>,
    lines: u64,
}

/// A format as lines are written in it, compiled at load.
enum Format {
    /// JSON, with these keys in this order.
    Json(Box<[LogField]>),
    /// NGINX's `combined`.
    Combined,
    /// The operator's line.
    Line(Box<[LinePiece]>),
}

impl Format {
    /// The format `config` names (checked by its `validate`: a bad one is JSON's default).
    fn of(config: &AccessLogConfig) -> Format {
        match &config.format {
            AccessLogFormat::Json if config.fields.is_empty() => {
                Format::Json(crate::config::DEFAULT_JSON_FIELDS.into())
            }
            AccessLogFormat::Json => Format::Json(
                crate::config::parse_json_fields(&config.fields)
                    .unwrap_or_else(|_| crate::config::DEFAULT_JSON_FIELDS.to_vec())
                    .into(),
            ),
            AccessLogFormat::Combined => Format::Combined,
            AccessLogFormat::Line(line) => Format::Line(
                crate::config::parse_log_line(line)
                    .unwrap_or_default()
                    .into(),
            ),
        }
    }
}

/// State shared by the front ends and the writer thread.
struct Inner {
    format: Format,
    /// Bytes a shard holds before lines are dropped.
    shard_bytes: usize,
    shards: Box<[Mutex<Shard>]>,
    dropped: AtomicU64,
    written: AtomicU64,
    write_errors: AtomicU64,
    reopen: AtomicBool,
    stop: AtomicBool,
}

/// The access log of a running proxy.
pub(crate) struct AccessLog {
    inner: Arc<Inner>,
    writer: std::thread::Thread,
    join: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Where it writes (`None`: standard output).
    pub path: Option<PathBuf>,
    /// Its format.
    pub format: AccessLogFormat,
}

/// The output: a file (reopened on demand) or standard output.
enum Output {
    File(PathBuf, File),
    Stdout,
}

impl Output {
    fn open(path: Option<&PathBuf>) -> std::io::Result<Output> {
        match path {
            None => Ok(Output::Stdout),
            Some(p) => Ok(Output::File(
                p.clone(),
                OpenOptions::new().create(true).append(true).open(p)?,
            )),
        }
    }

    fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
        match self {
            Output::File(_, f) => f.write_all(data),
            Output::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(data)?;
                out.flush()
            }
        }
    }
}

impl AccessLog {
    /// Opens the log (its file is created if need be, so that a bad path fails the start) and
    /// starts its writer thread. `workers`: threads that serve connections (one shard each).
    pub fn start(config: &AccessLogConfig, workers: usize) -> anyhow::Result<AccessLog> {
        Self::start_with(config, workers, SHARD_BYTES)
    }

    fn start_with(
        config: &AccessLogConfig,
        workers: usize,
        shard_bytes: usize,
    ) -> anyhow::Result<AccessLog> {
        let path = config.file();
        let mut output = Output::open(path.as_ref()).map_err(|e| {
            anyhow::anyhow!("cannot open the access log {}: {e}", config.path.display())
        })?;
        let inner = Arc::new(Inner {
            format: Format::of(config),
            shard_bytes,
            shards: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
            dropped: AtomicU64::new(0),
            written: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            reopen: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let state = inner.clone();
        let join = std::thread::Builder::new()
            .name("keel-access-log".into())
            .spawn(move || writer_loop(&state, &mut output))?;
        Ok(AccessLog {
            inner,
            writer: join.thread().clone(),
            join: Mutex::new(Some(join)),
            path,
            format: config.format.clone(),
        })
    }

    /// Formats an entry and queues its line on `worker`'s shard; a full shard drops it.
    pub fn log(&self, worker: usize, entry: &Entry<'_>) {
        thread_local! {
            static LINE: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(512));
        }
        LINE.with_borrow_mut(|line| {
            line.clear();
            match &self.inner.format {
                Format::Json(fields) => json(line, entry, SystemTime::now(), fields),
                Format::Combined => combined(line, entry, SystemTime::now()),
                Format::Line(pieces) => operator_line(line, entry, SystemTime::now(), pieces),
            }
            let shards = &self.inner.shards;
            let mut shard = shards[worker % shards.len()]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let limit = self.inner.shard_bytes;
            if shard.buf.len() + line.len() > limit {
                drop(shard);
                self.inner.dropped.fetch_add(1, Relaxed);
                return;
            }
            if shard.buf.capacity() == 0 {
                shard.buf.reserve((64 * 1024).min(limit));
            }
            shard.buf.extend_from_slice(line);
            shard.lines += 1;
            let half_full = shard.buf.len() > limit / 2;
            drop(shard);
            if half_full {
                self.writer.unpark();
            }
        });
    }

    /// Lines dropped because a shard was full (or the write failed).
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Relaxed)
    }

    /// Lines written.
    pub fn written(&self) -> u64 {
        self.inner.written.load(Relaxed)
    }

    /// Makes the writer reopen the file (after logrotate moved it).
    pub fn reopen(&self) {
        self.inner.reopen.store(true, Relaxed);
        self.writer.unpark();
    }

    /// Writes what is queued and stops the writer.
    pub fn close(&self) {
        self.inner.stop.store(true, Relaxed);
        self.writer.unpark();
        let join = self.join.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(j) = join {
            let _ = j.join();
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        self.close();
    }
}

/// The writer thread: every [`FLUSH_EVERY`] (or when woken), swaps each shard's buffer for
/// its own empty one and writes it.
fn writer_loop(inner: &Inner, output: &mut Output) {
    let mut spare: Vec<u8> = Vec::new();
    loop {
        std::thread::park_timeout(FLUSH_EVERY);
        let stopping = inner.stop.load(Relaxed);
        if inner.reopen.swap(false, Relaxed) {
            if let Output::File(path, _) = output {
                match Output::open(Some(path)) {
                    Ok(o) => *output = o,
                    Err(e) => {
                        tracing::warn!(path = %path.display(), "cannot reopen the access log: {e}")
                    }
                }
            }
        }
        for shard in inner.shards.iter() {
            let lines = {
                let mut s = shard.lock().unwrap_or_else(|e| e.into_inner());
                if s.buf.is_empty() {
                    continue;
                }
                std::mem::swap(&mut s.buf, &mut spare);
                std::mem::take(&mut s.lines)
            };
            match output.write_all(&spare) {
                Ok(()) => {
                    inner.written.fetch_add(lines, Relaxed);
                }
                Err(e) => {
                    inner.dropped.fetch_add(lines, Relaxed);
                    if inner.write_errors.fetch_add(1, Relaxed).is_multiple_of(100) {
                        tracing::warn!("cannot write the access log ({lines} lines lost): {e}");
                    }
                }
            }
            spare.clear();
        }
        if stopping {
            return;
        }
    }
}

/// Appends `n` with at least two digits.
fn push_2(out: &mut Vec<u8>, n: u64) {
    if n < 10 {
        out.push(b'0');
    }
    push_u64(out, n);
}

/// The civil date (year, month, day) of a day since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u64, u64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u64;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u64;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Time since the epoch as (days, second of the day, millisecond).
fn split_time(t: SystemTime) -> (i64, u64, u64) {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    (
        (secs / 86_400) as i64,
        secs % 86_400,
        u64::from(d.subsec_millis()),
    )
}

/// `2024-05-01T12:00:00.123Z` (RFC 3339, UTC, milliseconds).
pub(crate) fn push_rfc3339(out: &mut Vec<u8>, t: SystemTime) {
    let (days, sod, ms) = split_time(t);
    let (y, m, d) = civil(days);
    push_u64(out, y.max(0) as u64);
    out.push(b'-');
    push_2(out, m);
    out.push(b'-');
    push_2(out, d);
    out.push(b'T');
    push_2(out, sod / 3600);
    out.push(b':');
    push_2(out, sod / 60 % 60);
    out.push(b':');
    push_2(out, sod % 60);
    out.push(b'.');
    if ms < 100 {
        out.push(b'0');
    }
    push_2(out, ms);
    out.push(b'Z');
}

/// `01/May/2024:12:00:00 +0000` (NGINX's `$time_local`, in UTC).
fn push_clf_time(out: &mut Vec<u8>, t: SystemTime) {
    const MONTHS: [&[u8]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    let (days, sod, _) = split_time(t);
    let (y, m, d) = civil(days);
    push_2(out, d);
    out.push(b'/');
    out.extend_from_slice(MONTHS[(m - 1) as usize]);
    out.push(b'/');
    push_u64(out, y.max(0) as u64);
    out.push(b':');
    push_2(out, sod / 3600);
    out.push(b':');
    push_2(out, sod / 60 % 60);
    out.push(b':');
    push_2(out, sod % 60);
    out.extend_from_slice(b" +0000");
}

/// Appends a JSON string of `s`: valid UTF-8 as it is (escaped), other bytes as `\u00XX`.
fn push_json_str(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    push_json_inner(out, s);
    out.push(b'"');
}

/// `s` escaped as the inside of a JSON string.
fn push_json_inner(out: &mut Vec<u8>, s: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let utf8 = std::str::from_utf8(s).is_ok();
    for &b in s {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..=0x1f | 0x7f => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 15)]);
            }
            0x80.. if !utf8 => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 15)]);
            }
            _ => out.push(b),
        }
    }
}

fn push_json_opt(out: &mut Vec<u8>, s: Option<&[u8]>) {
    match s {
        Some(s) => push_json_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

/// One JSON object with `fields` (in order) and a newline; `client_cert_subject` only when
/// there is one.
fn json(out: &mut Vec<u8>, e: &Entry<'_>, now: SystemTime, fields: &[LogField]) {
    out.push(b'{');
    let mut first = true;
    for &f in fields {
        if f == LogField::ClientCertSubject && e.client_cert_subject.is_none() {
            continue;
        }
        if f.is_inference() && e.inference.is_none() {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.push(b'"');
        out.extend_from_slice(f.key().as_bytes());
        out.extend_from_slice(b"\":");
        json_value(out, e, now, f);
    }
    out.extend_from_slice(b"}\n");
}

/// A field's value as JSON.
fn json_value(out: &mut Vec<u8>, e: &Entry<'_>, now: SystemTime, f: LogField) {
    let r = &e.request;
    match f {
        LogField::Time | LogField::TimeLocal => {
            out.push(b'"');
            if f == LogField::Time {
                push_rfc3339(out, now);
            } else {
                push_clf_time(out, now);
            }
            out.push(b'"');
        }
        LogField::Client => push_json_str(out, e.client.as_bytes()),
        LogField::ClientCertSubject => push_json_opt(out, e.client_cert_subject.map(str::as_bytes)),
        LogField::Method => push_json_opt(out, r.method),
        LogField::Host => push_json_opt(out, r.host),
        LogField::Path => push_json_opt(out, r.path),
        LogField::Protocol => push_json_str(out, e.protocol.as_bytes()),
        LogField::Request => {
            out.push(b'"');
            push_request(out, e, push_json_inner);
            out.push(b'"');
        }
        LogField::Status => push_u64(out, u64::from(e.status)),
        LogField::BytesSent => push_u64(out, e.bytes_sent),
        LogField::BodyBytesSent => push_u64(out, e.body_bytes_sent),
        LogField::DurationMs => push_ms(out, e.duration.as_micros() as u64),
        LogField::RequestTime => push_ms(out, e.duration.as_millis() as u64),
        LogField::Cluster => push_json_opt(out, e.cluster.map(str::as_bytes)),
        LogField::Endpoint => push_json_opt(out, e.endpoint),
        LogField::Attempts => push_u64(out, u64::from(e.attempts)),
        LogField::Route => match e.route {
            Some(i) => push_u64(out, u64::from(i)),
            None => out.extend_from_slice(b"null"),
        },
        LogField::Cause => push_json_opt(out, e.cause.map(str::as_bytes)),
        LogField::RequestId => push_json_opt(out, r.request_id),
        LogField::TraceId => push_json_opt(out, e.trace_id.as_ref().map(|t| &t[..])),
        LogField::UserAgent => push_json_opt(out, r.user_agent),
        LogField::Referer => push_json_opt(out, r.referer),
        LogField::Tries => push_tries(out, e),
        LogField::Model => push_json_opt(out, model(e)),
        LogField::Prefix => match e.prompt {
            Some(p) => {
                out.push(b'"');
                push_hex16(out, p.first);
                out.push(b'"');
            }
            None => out.extend_from_slice(b"null"),
        },
        _ => match inference_number(e, f) {
            Some(Number::Ms(us)) => push_ms(out, us),
            Some(Number::Count(n)) => push_u64(out, n),
            None => out.extend_from_slice(b"null"),
        },
    }
}

/// An inference field's number.
enum Number {
    /// Microseconds, written as milliseconds.
    Ms(u64),
    Count(u64),
}

fn inference_number(e: &Entry<'_>, f: LogField) -> Option<Number> {
    let m = e.inference?;
    let us = |d: Option<Duration>| d.map(|d| Number::Ms(d.as_micros() as u64));
    match f {
        LogField::TtftMs => us(m.ttft),
        LogField::ItlMs => us(m.itl),
        LogField::PromptTokens => m.prompt_tokens.map(Number::Count),
        LogField::CompletionTokens => m.completion_tokens.map(Number::Count),
        LogField::CachedTokens => m.cached_tokens.map(Number::Count),
        LogField::PromptBlocks => e.prompt.map(|p| Number::Count(u64::from(p.blocks))),
        _ => None,
    }
}

fn model<'a>(e: &Entry<'a>) -> Option<&'a [u8]> {
    e.inference?.model.as_deref().map(str::as_bytes)
}

/// A block's name as 16 hex digits.
fn push_hex16(out: &mut Vec<u8>, name: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for i in (0..16).rev() {
        out.push(HEX[((name >> (4 * i)) & 15) as usize]);
    }
}

/// `tries` as a JSON array.
fn push_tries(out: &mut Vec<u8>, e: &Entry<'_>) {
    out.push(b'[');
    if let Some(t) = &e.tries {
        for (i, r) in t.tries.logged().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(b"{\"endpoint\":");
            let name = t
                .endpoints
                .get(r.endpoint as usize)
                .map(|e| e.header.as_bytes());
            push_json_opt(out, name);
            out.extend_from_slice(b",\"outcome\":\"");
            r.outcome.push_text(out);
            out.extend_from_slice(b"\",\"duration_ms\":");
            // The try that answered the client lasts until the response's end.
            let us = r.duration_us.map_or_else(
                || (e.duration.as_micros() as u64).saturating_sub(u64::from(r.start_us)),
                u64::from,
            );
            push_ms(out, us);
            out.extend_from_slice(b",\"in_flight\":");
            push_u64(out, u64::from(r.in_flight));
            out.push(b'}');
        }
    }
    out.push(b']');
}

/// `METHOD PATH PROTOCOL` (nothing when the head had no request line), each part through
/// `push` (the format's escaping).
fn push_request(out: &mut Vec<u8>, e: &Entry<'_>, push: impl Fn(&mut Vec<u8>, &[u8])) {
    if let (Some(m), Some(p)) = (e.request.method, e.request.path) {
        push(out, m);
        out.push(b' ');
        push(out, p);
        out.push(b' ');
        out.extend_from_slice(e.protocol.as_bytes());
    }
}

/// A line of the operator's: its text, and each variable's value as NGINX writes one (`-`
/// when absent; `"`, `\` and bytes that are not printable ASCII as `\xXX`), and a newline.
fn operator_line(out: &mut Vec<u8>, e: &Entry<'_>, now: SystemTime, pieces: &[LinePiece]) {
    let r = &e.request;
    for piece in pieces {
        let f = match piece {
            LinePiece::Text(t) => {
                out.extend_from_slice(t.as_bytes());
                continue;
            }
            LinePiece::Field(f) => *f,
        };
        match f {
            LogField::Time => push_rfc3339(out, now),
            LogField::TimeLocal => push_clf_time(out, now),
            LogField::Client => push_clf_field(out, Some(e.client.as_bytes())),
            LogField::ClientCertSubject => {
                push_clf_field(out, e.client_cert_subject.map(str::as_bytes))
            }
            LogField::Method => push_clf_field(out, r.method),
            LogField::Host => push_clf_field(out, r.host),
            LogField::Path => push_clf_field(out, r.path),
            LogField::Protocol => out.extend_from_slice(e.protocol.as_bytes()),
            LogField::Request => {
                let at = out.len();
                push_request(out, e, |out, s| push_clf_field(out, Some(s)));
                if out.len() == at {
                    out.push(b'-');
                }
            }
            LogField::Status => push_u64(out, u64::from(e.status)),
            LogField::BytesSent => push_u64(out, e.bytes_sent),
            LogField::BodyBytesSent => push_u64(out, e.body_bytes_sent),
            LogField::DurationMs => push_ms(out, e.duration.as_micros() as u64),
            LogField::RequestTime => push_ms(out, e.duration.as_millis() as u64),
            LogField::Cluster => push_clf_field(out, e.cluster.map(str::as_bytes)),
            LogField::Endpoint => push_clf_field(out, e.endpoint),
            LogField::Attempts => push_u64(out, u64::from(e.attempts)),
            LogField::Route => match e.route {
                Some(i) => push_u64(out, u64::from(i)),
                None => out.push(b'-'),
            },
            LogField::Cause => push_clf_field(out, e.cause.map(str::as_bytes)),
            LogField::RequestId => push_clf_field(out, r.request_id),
            LogField::TraceId => push_clf_field(out, e.trace_id.as_ref().map(|t| &t[..])),
            LogField::UserAgent => push_clf_field(out, r.user_agent),
            LogField::Referer => push_clf_field(out, r.referer),
            // Not a line's variable (refused at load).
            LogField::Tries => out.push(b'-'),
            LogField::Model => push_clf_field(out, model(e)),
            LogField::Prefix => match e.prompt {
                Some(p) => push_hex16(out, p.first),
                None => out.push(b'-'),
            },
            _ => match inference_number(e, f) {
                Some(Number::Ms(us)) => push_ms(out, us),
                Some(Number::Count(n)) => push_u64(out, n),
                None => out.push(b'-'),
            },
        }
    }
    out.push(b'\n');
}

/// Milliseconds with three decimals, from microseconds.
fn push_ms(out: &mut Vec<u8>, us: u64) {
    push_u64(out, us / 1000);
    out.push(b'.');
    let frac = us % 1000;
    if frac < 100 {
        out.push(b'0');
    }
    push_2(out, frac);
}

/// A quoted field of the combined format, escaped as NGINX escapes it (`"`, `\` and bytes
/// that are not printable ASCII as `\xXX`); `-` when absent.
fn push_clf_field(out: &mut Vec<u8>, s: Option<&[u8]>) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let Some(s) = s else {
        out.push(b'-');
        return;
    };
    for &b in s {
        if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) {
            out.extend_from_slice(b"\\x");
            out.push(HEX[usize::from(b >> 4)]);
            out.push(HEX[usize::from(b & 15)]);
        } else {
            out.push(b);
        }
    }
}

/// NGINX's `combined`: `$remote_addr - $remote_user [$time_local] "$request" $status
/// $body_bytes_sent "$http_referer" "$http_user_agent"`, and a newline.
fn combined(out: &mut Vec<u8>, e: &Entry<'_>, now: SystemTime) {
    let r = &e.request;
    out.extend_from_slice(e.client.as_bytes());
    out.extend_from_slice(b" - - [");
    push_clf_time(out, now);
    out.extend_from_slice(b"] \"");
    if let (Some(m), Some(p)) = (r.method, r.path) {
        push_clf_field(out, Some(m));
        out.push(b' ');
        push_clf_field(out, Some(p));
        out.push(b' ');
        out.extend_from_slice(e.protocol.as_bytes());
    }
    out.extend_from_slice(b"\" ");
    push_u64(out, u64::from(e.status));
    out.push(b' ');
    push_u64(out, e.body_bytes_sent);
    out.extend_from_slice(b" \"");
    push_clf_field(out, r.referer);
    out.extend_from_slice(b"\" \"");
    push_clf_field(out, r.user_agent);
    out.extend_from_slice(b"\"\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(secs * 1000 + ms)
    }

    #[test]
    fn times_are_rfc3339_and_nginx_local_time_in_utc() {
        let mut s = Vec::new();
        // 2000-02-29 23:59:59.007, a leap day.
        push_rfc3339(&mut s, at(951_868_799, 7));
        assert_eq!(s, b"2000-02-29T23:59:59.007Z");
        s.clear();
        push_clf_time(&mut s, at(1_714_564_800, 0));
        assert_eq!(s, b"01/May/2024:12:00:00 +0000");
        s.clear();
        push_rfc3339(&mut s, at(0, 999));
        assert_eq!(s, b"1970-01-01T00:00:00.999Z");
    }

    fn entry(head: &[u8]) -> Entry<'_> {
        Entry {
            client: "10.0.0.1",
            client_cert_subject: None,
            request: RequestLine::parse(head),
            protocol: "HTTP/1.1",
            status: 502,
            bytes_sent: 120,
            body_bytes_sent: 40,
            duration: Duration::from_micros(12_345),
            cluster: Some("api"),
            endpoint: Some(b"10.0.0.7:9000"),
            attempts: 2,
            route: Some(3),
            cause: Some("cannot connect to upstream 10.0.0.7:9000: \"refused\""),
            tries: None,
            trace_id: Some(*b"4bf92f3577b34da6a3ce929d0e0e4736"),
            inference: None,
            prompt: None,
        }
    }

    #[test]
    fn an_inference_answer_logs_its_measure_and_others_do_not() {
        let measured = Measured {
            ttft: Some(Duration::from_micros(41_250)),
            itl: Some(Duration::from_micros(9_500)),
            prompt_tokens: Some(420),
            completion_tokens: Some(3),
            cached_tokens: None,
            model: Some("keel-llm".into()),
        };
        let head = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\n";
        let json_of = |e: &Entry<'_>| {
            let mut line = Vec::new();
            json(&mut line, e, at(0, 5), crate::config::DEFAULT_JSON_FIELDS);
            serde_json::from_slice::<serde_json::Value>(&line).unwrap()
        };
        let plain = json_of(&entry(head));
        for k in [
            "ttft_ms",
            "itl_ms",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "model",
            "prefix",
            "prompt_blocks",
        ] {
            assert!(plain.get(k).is_none(), "{k} in {plain}");
        }
        let e = Entry {
            inference: Some(&measured),
            prompt: Some(PromptName {
                first: 0x00ab_cdef_0123_4567,
                blocks: 26,
            }),
            ..entry(head)
        };
        let v = json_of(&e);
        assert_eq!(v["ttft_ms"].as_f64(), Some(41.25));
        assert_eq!(v["itl_ms"].as_f64(), Some(9.5));
        assert_eq!(
            (v["prompt_tokens"].as_u64(), v["completion_tokens"].as_u64()),
            (Some(420), Some(3))
        );
        assert!(v["cached_tokens"].is_null());
        assert_eq!(v["model"], "keel-llm");
        assert_eq!(v["prefix"], "00abcdef01234567");
        assert_eq!(v["prompt_blocks"].as_u64(), Some(26));
        let pieces = crate::config::parse_log_line(
            "$model $prompt_tokens $cached_tokens $ttft_ms $prefix $prompt_blocks",
        )
        .unwrap();
        let mut line = Vec::new();
        operator_line(&mut line, &e, at(0, 0), &pieces);
        assert_eq!(line, b"keel-llm 420 - 41.250 00abcdef01234567 26\n");
    }

    #[test]
    fn a_json_line_has_every_field_escaped() {
        let head = b"GET /a?b=\"c\" HTTP/1.1\r\nHost: api.test\r\nUser-Agent: x\xffy\r\nReferer: https://r.test/\r\nx-forwarded-for: 1\r\nx-request-id: 5f0c\r\n";
        let mut line = Vec::new();
        json(
            &mut line,
            &entry(head),
            at(0, 5),
            crate::config::DEFAULT_JSON_FIELDS,
        );
        let text = String::from_utf8(line).unwrap();
        assert!(text.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["time"], "1970-01-01T00:00:00.005Z");
        assert_eq!(v["client"], "10.0.0.1");
        assert_eq!(v["method"], "GET");
        assert_eq!(v["host"], "api.test");
        assert_eq!(v["path"], "/a?b=\"c\"");
        assert_eq!(v["protocol"], "HTTP/1.1");
        assert_eq!(v["status"], 502);
        assert_eq!(v["bytes_sent"], 120);
        assert_eq!(v["duration_ms"], 12.345);
        assert_eq!(v["cluster"], "api");
        assert_eq!(v["endpoint"], "10.0.0.7:9000");
        assert_eq!(v["attempts"], 2);
        assert_eq!(v["route"], 3);
        assert!(v["cause"].as_str().unwrap().contains("\"refused\""));
        assert_eq!(v["user_agent"], "x\u{ff}y");
        assert_eq!(v["referer"], "https://r.test/");
        assert_eq!(v["request_id"], "5f0c");
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        let none = Entry {
            client: "::1",
            protocol: "HTTP/2.0",
            status: 200,
            ..Entry::default()
        };
        let mut line = Vec::new();
        json(
            &mut line,
            &none,
            at(0, 0),
            crate::config::DEFAULT_JSON_FIELDS,
        );
        let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
        for key in [
            "method",
            "host",
            "path",
            "cluster",
            "endpoint",
            "route",
            "cause",
            "request_id",
            "trace_id",
            "user_agent",
            "referer",
        ] {
            assert!(v[key].is_null(), "{key}: {v}");
        }
        assert_eq!(v["duration_ms"], 0.0);
    }

    #[test]
    fn lines_that_do_not_fit_are_dropped_and_counted_never_waited_for() {
        // The log writes into a pipe nobody reads yet: the writer blocks once the pipe's
        // buffer is full, the shard fills, and further lines are dropped at once.
        let dir = std::env::temp_dir().join(format!("keel-al-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("pipe");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        // A reader must exist for the log's open to return; it reads nothing until told.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || {
                let mut f = File::open(fifo).unwrap();
                wait.recv().unwrap();
                let mut all = Vec::new();
                std::io::Read::read_to_end(&mut f, &mut all).unwrap();
                all
            })
        };
        let config = AccessLogConfig {
            path: fifo,
            format: AccessLogFormat::Json,
            fields: Vec::new(),
        };
        let log = AccessLog::start_with(&config, 1, 16 * 1024).unwrap();
        let head = b"GET /some/path HTTP/1.1\r\nhost: example.test\r\n";
        let started = std::time::Instant::now();
        for _ in 0..5000 {
            log.log(0, &entry(head));
        }
        // 5,000 lines (about 1.5 MB) against 64 KiB of pipe and 16 KiB of shard.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "no wait on the writer"
        );
        let dropped = log.dropped();
        assert!(dropped > 4000, "{dropped} dropped");
        go.send(()).unwrap();
        log.close();
        drop(log);
        let all = reader.join().unwrap();
        let read = all.iter().filter(|b| **b == b'\n').count() as u64;
        assert_eq!(read + dropped, 5000, "every line written or counted");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_combined_line_is_nginxs() {
        let head = b"GET /a?b=\"c\" HTTP/1.1\r\nhost: api.test\r\nreferer: http://r.test/\r\nuser-agent: curl/8\r\n";
        let mut line = Vec::new();
        combined(&mut line, &entry(head), at(1_714_564_800, 0));
        assert_eq!(
            String::from_utf8(line).unwrap(),
            "10.0.0.1 - - [01/May/2024:12:00:00 +0000] \"GET /a?b=\\x22c\\x22 HTTP/1.1\" 502 40 \"http://r.test/\" \"curl/8\"\n"
        );
    }

    #[test]
    fn an_operators_line_has_each_variable_as_nginx_writes_it() {
        let head = b"GET /a?b=\"c\" HTTP/1.1\r\nhost: api.test\r\nuser-agent: curl/8\r\n";
        let line = |format: &str, e: &Entry<'_>| {
            let pieces = crate::config::parse_log_line(format).unwrap();
            let mut out = Vec::new();
            operator_line(&mut out, e, at(1_714_564_800, 7), &pieces);
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            line(
                "$remote_addr [$time_local] \"$request\" $status $body_bytes_sent $request_time ${upstream_addr}x $$ $http_referer",
                &entry(head)
            ),
            "10.0.0.1 [01/May/2024:12:00:00 +0000] \"GET /a?b=\\x22c\\x22 HTTP/1.1\" 502 40 0.012 10.0.0.7:9000x $ -\n"
        );
        assert_eq!(
            line(
                "$time $duration_ms $cluster $route $attempts $trace_id $host",
                &entry(head)
            ),
            "2024-05-01T12:00:00.007Z 12.345 api 3 2 4bf92f3577b34da6a3ce929d0e0e4736 api.test\n"
        );
        let none = Entry {
            client: "::1",
            protocol: "HTTP/2.0",
            status: 404,
            ..Entry::default()
        };
        assert_eq!(
            line(
                "$request|$endpoint|$route|$cause|$user_agent|$bytes_sent",
                &none
            ),
            "-|-|-|-|-|0\n"
        );
    }

    #[test]
    fn line_formats_are_parsed_once_and_unknown_variables_named() {
        use crate::config::{parse_log_line, LinePiece, LogField};
        assert_eq!(
            parse_log_line("a $status${status}b $$c").unwrap(),
            vec![
                LinePiece::Text("a ".into()),
                LinePiece::Field(LogField::Status),
                LinePiece::Field(LogField::Status),
                LinePiece::Text("b $c".into()),
            ]
        );
        let e = parse_log_line("$status $statuses").unwrap_err();
        assert_eq!(e.name, "statuses");
        assert!(e.to_string().contains("$remote_addr"), "{e}");
        // Every field has its keel name first, so a JSON key names each.
        for (name, f) in crate::config::LOG_NAMES {
            assert!(!f.key().is_empty(), "{name}");
        }
        assert_eq!(LogField::Client.key(), "client");
        assert_eq!(LogField::RequestTime.key(), "request_time");
    }

    #[test]
    fn a_json_line_has_the_chosen_fields_in_order() {
        use crate::config::LogField;
        let head = b"GET /x HTTP/1.1\r\nhost: api.test\r\n";
        let mut line = Vec::new();
        let fields = [
            LogField::Status,
            LogField::RequestTime,
            LogField::Request,
            LogField::ClientCertSubject,
            LogField::Route,
        ];
        json(&mut line, &entry(head), at(0, 0), &fields);
        assert_eq!(
            String::from_utf8(line).unwrap(),
            "{\"status\":502,\"request_time\":0.012,\"request\":\"GET /x HTTP/1.1\",\"route\":3}\n"
        );
    }
}
