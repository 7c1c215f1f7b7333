//! Reading keel proxy's JSON access log, one line at a time, into compact per-try records.
//!
//! Two forms are read: today's (one line per request with `endpoint` = the last try's endpoint,
//! `attempts`, `status`, `duration_ms`, `cause`), of which only single-try lines say what one
//! endpoint did, and the richer one with `tries: [{endpoint, outcome, duration_ms,
//! in_flight}]`, where every try counts. Unknown keys are ignored.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::BufRead;

use serde::Deserialize;

/// What cannot be fitted, and why. The edge (the CLI) turns it into text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// The input could not be read.
    #[error("cannot read the access log: {0}")]
    Read(String),
    /// More than 65,536 distinct names.
    #[error("more than 65536 distinct {0} in the log")]
    TooManyNames(&'static str),
    /// Not an access log: most lines are not JSON objects of it.
    #[error("{skipped} of {lines} lines are not {format} access-log lines (first: line {first}: {why}); {hint}")]
    Unparsable {
        /// The format read.
        format: &'static str,
        /// What to check.
        hint: &'static str,
        /// Lines read.
        lines: u64,
        /// Lines skipped.
        skipped: u64,
        /// The first skipped line.
        first: u64,
        /// Why it was skipped.
        why: String,
    },
    /// No line has a `time`, so neither the arrival rate nor `--since` can be worked out.
    #[error("no line has a `time`: the arrival rate cannot be fitted")]
    NoTimes,
    /// Several clusters in the window and none chosen.
    #[error("the log mixes {} clusters ({}); choose one with --cluster", clusters.len(), clusters.iter().map(|(c, n)| format!("`{c}`: {n} requests")).collect::<Vec<_>>().join(", "))]
    MixedClusters {
        /// Each cluster with its request count.
        clusters: Vec<(String, u64)>,
    },
    /// The chosen cluster is not in the window.
    #[error("no request of cluster `{name}` in the log{}; clusters seen: {}", if *.since { " within --since" } else { "" }, if known.is_empty() { "none".to_string() } else { known.join(", ") })]
    UnknownCluster {
        /// The cluster asked for.
        name: String,
        /// Whether `--since` narrowed the window.
        since: bool,
        /// The clusters present.
        known: Vec<String>,
    },
    /// Too few requests to fit anything honest.
    #[error("cluster `{cluster}` has {have} requests in the window; at least {need} are needed for a fit")]
    TooFewLines {
        /// The cluster.
        cluster: String,
        /// Requests found.
        have: u64,
        /// Requests needed.
        need: u64,
    },
    /// No try names an endpoint (no `endpoint` or `tries`, or only multi-try lines of today's
    /// form, whose earlier tries are unknown).
    #[error("no request of cluster `{cluster}` says which endpoint served it ({multi_try} lines with several tries name only the last); log with the proxy's JSON format, whose `tries` records every try")]
    NoEndpoints {
        /// The cluster.
        cluster: String,
        /// Lines left out for having several tries.
        multi_try: u64,
    },
}

/// What one try came to, as the model distinguishes failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TryClass {
    /// A good answer (or the application's own answer: a status the proxy does not count as
    /// the endpoint's failure).
    Ok,
    /// An error answered without waiting for the timeout: a failure status (`status 503`), a
    /// refused connection, an invalid response.
    Error,
    /// No answer within the timeout.
    Timeout,
    /// The connection closed or reset before the whole answer.
    Reset,
}

impl TryClass {
    /// Reads an outcome as the proxy writes it in `tries`: `ok`, `status 503`, `connect
    /// refused`, `timeout`, `reset`, ...
    pub fn of_outcome(outcome: &str) -> TryClass {
        let o = outcome.trim();
        if o == "ok" {
            TryClass::Ok
        } else if o.contains("timeout") || o.contains("timed out") {
            TryClass::Timeout
        } else if o.starts_with("reset") || o.contains("closed") || o.contains("body") {
            TryClass::Reset
        } else {
            TryClass::Error
        }
    }

    /// A status as keel counts it ([`keel_balance::Outcome::of_status`]): a 504 is a timeout,
    /// every other 5xx but 501 and 505 an error, anything else the application's answer.
    pub fn of_status(status: u16) -> TryClass {
        match status {
            504 => TryClass::Timeout,
            s if keel_balance::Outcome::of_status(s) == keel_balance::Outcome::Failure => {
                TryClass::Error
            }
            _ => TryClass::Ok,
        }
    }

    /// Reads today's single-try line: the proxy's own answer's `cause` when it has one, else
    /// the status ([`TryClass::of_status`]).
    pub fn of_line(status: u16, cause: Option<&str>) -> TryClass {
        match cause {
            Some(c) if c.contains("did not answer") || c.contains("timed out") => TryClass::Timeout,
            Some(c)
                if c.contains("closed the connection")
                    || c.contains("in the middle")
                    || c.contains("reset") =>
            {
                TryClass::Reset
            }
            Some(_) => TryClass::Error,
            None => TryClass::of_status(status),
        }
    }
}

/// One try of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TryRecord {
    /// Index into [`Log::endpoints`].
    pub endpoint: u16,
    /// Index into [`Log::clusters`].
    pub cluster: u16,
    /// What it came to.
    pub class: TryClass,
    /// When it started, in seconds since the Unix epoch (0 when the line has no `time`).
    pub start: f64,
    /// How long it took, in milliseconds.
    pub duration_ms: f32,
    /// The endpoint's calls in flight when it was picked (this one not counted), when known.
    pub in_flight: Option<u32>,
}

/// One request (for the arrival process).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestRecord {
    /// Index into [`Log::clusters`].
    pub cluster: u16,
    /// When it arrived, in seconds since the Unix epoch (0 when the line has no `time`).
    pub start: f64,
    /// Its whole duration, in milliseconds.
    pub duration_ms: f32,
}

/// A whole access log, compacted: about 40 bytes per request.
#[derive(Debug, Clone, Default)]
pub struct Log {
    /// Endpoint names (addresses), in order of first appearance.
    pub endpoints: Vec<String>,
    /// Cluster names, in order of first appearance (`""` for lines without one).
    pub clusters: Vec<String>,
    /// Every request.
    pub requests: Vec<RequestRecord>,
    /// Every try whose endpoint and outcome the log tells.
    pub tries: Vec<TryRecord>,
    /// Lines read (non-empty).
    pub lines: u64,
    /// Lines that were not a JSON object of the access log (skipped).
    pub skipped: u64,
    /// The first skipped line's number (1-based) and why.
    pub first_skipped: Option<(u64, String)>,
    /// Requests of today's form with several tries, of which only the last endpoint is known
    /// (left out of the per-endpoint fit).
    pub multi_try_lines: u64,
    /// Lines carrying `tries`.
    pub rich_lines: u64,
    /// Lines without a `time` (then `--since` cannot apply).
    pub untimed: u64,
    /// The first [`UNREADABLE_KEPT`] lines the format could not read: line number (1-based)
    /// and why. Counted in `skipped`, never guessed.
    pub unreadable: Vec<(u64, String)>,
    /// Requests that reached no endpoint (NGINX's "no live upstreams", HAProxy's `<NOSRV>`,
    /// Envoy's `UH`): failures of the balancer, not of an endpoint.
    pub unattributed: u64,
    /// Tries the balancer ended for its own reasons (HAProxy's proxy-side terminations,
    /// Envoy's overflow): not the endpoint's doing, left out.
    pub proxy_side: u64,
    /// The format's name, for messages ("keel's JSON", "NGINX log_format", ...).
    pub format: &'static str,
}

/// Unreadable lines kept with their numbers (all are counted).
pub const UNREADABLE_KEPT: usize = 20;

impl Log {
    /// Counts an unreadable line and keeps its number and why (the first few).
    pub fn skip(&mut self, number: u64, why: impl Into<String>) {
        self.skipped += 1;
        if self.unreadable.len() < UNREADABLE_KEPT {
            let why = why.into();
            self.first_skipped.get_or_insert((number, why.clone()));
            self.unreadable.push((number, why));
        }
    }
}

/// Why a line of another balancer's log is not read: which field, and what is wrong with it.
/// Counted in [`Log::skipped`]; the report turns it into text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// A field the format has is not on the line.
    #[error("no {0}")]
    Missing(&'static str),
    /// A field's value does not read as what it must be.
    #[error("{field} {value:?} is not {expected}")]
    NotA {
        /// The field, in the format's own words (`$msec`, `DURATION`, `timer`).
        field: &'static str,
        /// Its value on the line.
        value: String,
        /// What it must be (`seconds`, `a number of ms`).
        expected: &'static str,
    },
    /// A field holds the wrong number of parts.
    #[error("{found} {what}, not {expected}")]
    Count {
        /// How many the line has.
        found: usize,
        /// Of what (`timers`, `quotes`).
        what: &'static str,
        /// How many the format has, in words.
        expected: &'static str,
    },
    /// A value the reader does not know (a termination cause).
    #[error("unknown {what} {value:?}")]
    Unknown {
        /// The field.
        what: &'static str,
        /// Its value.
        value: String,
    },
    /// The line departs from the format's shape elsewhere, in words (a bracket without its
    /// pair, text left after the format's end).
    #[error("{0}")]
    Shape(String),
}

impl LineError {
    /// [`LineError::NotA`].
    pub fn not_a(field: &'static str, value: &str, expected: &'static str) -> Self {
        LineError::NotA {
            field,
            value: value.to_string(),
            expected,
        }
    }

    /// [`LineError::Shape`].
    pub fn shape(why: impl Into<String>) -> Self {
        LineError::Shape(why.into())
    }
}

/// One try as another balancer's log tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedTry {
    /// The endpoint (address, or server name where the log has no address).
    pub endpoint: String,
    /// What it came to; `None` when the client ended it (not the endpoint's doing).
    pub class: Option<TryClass>,
    /// How long it took, in milliseconds.
    pub duration_ms: f64,
}

/// One request as another balancer's log tells it; the format modules (nginx, haproxy,
/// envoy) read a line into this, and [`read_lines`] turns it into the shared records.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedRequest {
    /// The cluster (upstream group, backend) when the line says; `""` otherwise.
    pub cluster: String,
    /// When it started, in seconds since the Unix epoch.
    pub start: f64,
    /// Its whole duration, in milliseconds.
    pub duration_ms: f64,
    /// Its tries, in order (empty: it reached no endpoint).
    pub tries: Vec<ParsedTry>,
    /// Earlier tries happened whose endpoints the line does not name (HAProxy's retry count):
    /// the request is left out of the per-endpoint fit, as keel's own multi-try lines are.
    pub hidden_tries: bool,
    /// Tries ended by the balancer itself (left out, counted).
    pub proxy_side: bool,
}

/// Reads a log of another balancer one line at a time: `parse` reads a line into a
/// [`ParsedRequest`], or says why it cannot (`Err`: counted with its line number), or that
/// the line is not a request (`Ok(None)`, e.g. a syslog line of another program).
pub fn read_lines(
    mut input: impl BufRead,
    format: &'static str,
    mut parse: impl FnMut(&str) -> Result<Option<ParsedRequest>, LineError>,
) -> Result<Log, FitError> {
    let mut log = Log {
        format,
        ..Log::default()
    };
    let mut endpoint_index = HashMap::new();
    let mut cluster_index = HashMap::new();
    each_line(&mut input, |number, text| {
        log.lines += 1;
        let r = match parse(text) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(()),
            Err(why) => {
                log.skip(number, why.to_string());
                return Ok(());
            }
        };
        let Some(cluster) = intern(&mut log.clusters, &mut cluster_index, &r.cluster) else {
            return Err(FitError::TooManyNames("clusters"));
        };
        log.requests.push(RequestRecord {
            cluster,
            start: r.start,
            duration_ms: r.duration_ms as f32,
        });
        if r.proxy_side {
            log.proxy_side += 1;
        }
        if r.hidden_tries {
            log.multi_try_lines += 1;
            return Ok(());
        }
        if r.tries.is_empty() && !r.proxy_side {
            log.unattributed += 1;
        }
        let mut at = r.start;
        for t in &r.tries {
            let start = at;
            at += t.duration_ms / 1e3;
            let Some(class) = t.class else { continue };
            let Some(endpoint) = intern(&mut log.endpoints, &mut endpoint_index, &t.endpoint)
            else {
                return Err(FitError::TooManyNames("endpoints"));
            };
            log.tries.push(TryRecord {
                endpoint,
                cluster,
                class,
                start,
                duration_ms: t.duration_ms as f32,
                in_flight: None,
            });
        }
        Ok(())
    })?;
    Ok(log)
}

/// Seconds since the Unix epoch of the common log format's time, `02/Dec/2026:09:26:06 +0000`
/// (NGINX's `$time_local`), with optional milliseconds and without the zone (HAProxy's
/// `06/Feb/2009:12:14:14.655`, local time: read as UTC, which only shifts every line alike).
pub fn parse_clf_time(t: &str) -> Option<f64> {
    let (date, zone) = match t.split_once(' ') {
        Some((d, z)) => (d, Some(z)),
        None => (t, None),
    };
    let b = date.as_bytes();
    if b.len() < 20 || b[2] != b'/' || b[6] != b'/' || b[11] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { date.get(r)?.parse().ok() };
    let d = num(0..2)?;
    let mo = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| date.get(3..6) == Some(*m))? as i64
        + 1;
    let y = num(7..11)?;
    let (h, mi, s) = (num(12..14)?, num(15..17)?, num(18..20)?);
    if !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let frac = match date.get(20..) {
        None | Some("") => 0.0,
        Some(f)
            if f.starts_with('.') && f.len() > 1 && f[1..].bytes().all(|c| c.is_ascii_digit()) =>
        {
            format!("0{f}").parse().ok()?
        }
        Some(_) => return None,
    };
    let offset = match zone {
        None => 0,
        Some(z) if z.len() == 5 && (z.starts_with('+') || z.starts_with('-')) => {
            let sign = if z.starts_with('-') { -1 } else { 1 };
            let oh: i64 = z.get(1..3)?.parse().ok()?;
            let om: i64 = z.get(3..5)?.parse().ok()?;
            sign * (oh * 3600 + om * 60)
        }
        Some(_) => return None,
    };
    Some((days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + s - offset) as f64 + frac)
}

#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow, default)]
    time: Option<Cow<'a, str>>,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    duration_ms: Option<f64>,
    #[serde(borrow, default)]
    cluster: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    endpoint: Option<Cow<'a, str>>,
    #[serde(default)]
    attempts: Option<u32>,
    #[serde(borrow, default)]
    cause: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tries: Option<Vec<TryLine<'a>>>,
}

#[derive(Deserialize)]
struct TryLine<'a> {
    #[serde(borrow)]
    endpoint: Cow<'a, str>,
    #[serde(borrow)]
    outcome: Cow<'a, str>,
    duration_ms: f64,
    #[serde(default)]
    in_flight: Option<u32>,
}

fn intern(names: &mut Vec<String>, index: &mut HashMap<String, u16>, name: &str) -> Option<u16> {
    if let Some(&i) = index.get(name) {
        return Some(i);
    }
    let i = u16::try_from(names.len()).ok()?;
    names.push(name.to_string());
    index.insert(name.to_string(), i);
    Some(i)
}

/// Calls `line` with each line of `input` that is not blank (its number from 1, without the line
/// end), through one buffer, reused.
fn each_line(
    input: &mut impl BufRead,
    mut line: impl FnMut(u64, &str) -> Result<(), FitError>,
) -> Result<(), FitError> {
    let mut buf = String::new();
    let mut number = 0u64;
    loop {
        buf.clear();
        let n = input
            .read_line(&mut buf)
            .map_err(|e| FitError::Read(e.to_string()))?;
        if n == 0 {
            return Ok(());
        }
        number += 1;
        let text = buf.trim_end_matches(['\n', '\r']);
        if !text.trim().is_empty() {
            line(number, text)?;
        }
    }
}

/// Reads a log from `input`, one line at a time (one line buffer, reused).
pub fn read_log(mut input: impl BufRead) -> Result<Log, FitError> {
    let mut log = Log {
        format: "keel proxy's JSON",
        ..Log::default()
    };
    let mut endpoint_index = HashMap::new();
    let mut cluster_index = HashMap::new();
    each_line(&mut input, |number, text| {
        let text = text.trim();
        log.lines += 1;
        let line: Line = match serde_json::from_str(text) {
            Ok(l) => l,
            Err(e) => {
                log.skip(number, e.to_string());
                return Ok(());
            }
        };
        let Some(duration_ms) = line.duration_ms else {
            log.skip(number, "no `duration_ms`");
            return Ok(());
        };
        let end = match line.time.as_deref() {
            Some(t) => match parse_rfc3339(t) {
                Some(s) => s,
                None => {
                    log.skip(number, format!("`time` {t:?} is not RFC 3339"));
                    return Ok(());
                }
            },
            None => {
                log.untimed += 1;
                0.0
            }
        };
        let cluster_name = line.cluster.as_deref().unwrap_or("");
        let Some(cluster) = intern(&mut log.clusters, &mut cluster_index, cluster_name) else {
            return Err(FitError::TooManyNames("clusters"));
        };
        let start = if end > 0.0 {
            end - duration_ms / 1e3
        } else {
            0.0
        };
        log.requests.push(RequestRecord {
            cluster,
            start,
            duration_ms: duration_ms as f32,
        });
        if let Some(tries) = &line.tries {
            log.rich_lines += 1;
            let mut at = start;
            for t in tries {
                // The client's fault (its body broke the try) says nothing of the endpoint.
                if t.outcome.trim() == "client" {
                    if at > 0.0 {
                        at += t.duration_ms / 1e3;
                    }
                    continue;
                }
                let Some(endpoint) = intern(&mut log.endpoints, &mut endpoint_index, &t.endpoint)
                else {
                    return Err(FitError::TooManyNames("endpoints"));
                };
                log.tries.push(TryRecord {
                    endpoint,
                    cluster,
                    class: TryClass::of_outcome(&t.outcome),
                    start: at,
                    duration_ms: t.duration_ms as f32,
                    in_flight: t.in_flight,
                });
                if at > 0.0 {
                    at += t.duration_ms / 1e3;
                }
            }
            return Ok(());
        }
        let Some(endpoint) = line.endpoint.as_deref() else {
            return Ok(());
        };
        if line.attempts.unwrap_or(1) > 1 {
            log.multi_try_lines += 1;
            return Ok(());
        }
        let Some(endpoint) = intern(&mut log.endpoints, &mut endpoint_index, endpoint) else {
            return Err(FitError::TooManyNames("endpoints"));
        };
        log.tries.push(TryRecord {
            endpoint,
            cluster,
            class: TryClass::of_line(line.status.unwrap_or(0), line.cause.as_deref()),
            start,
            duration_ms: duration_ms as f32,
            in_flight: None,
        });
        Ok(())
    })?;
    Ok(log)
}

/// Seconds since the Unix epoch of an RFC 3339 time (`2024-05-01T12:00:00.123Z`, or with an
/// offset `+02:00`).
pub fn parse_rfc3339(t: &str) -> Option<f64> {
    let b = t.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { t.get(r)?.parse().ok() };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let mut rest = &t[19..];
    let mut frac = 0.0;
    if let Some(r) = rest.strip_prefix('.') {
        let digits = r.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        frac = format!("0.{}", &r[..digits]).parse().ok()?;
        rest = &r[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 && (o.starts_with('+') || o.starts_with('-')) => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let oh: i64 = o.get(1..3)?.parse().ok()?;
            let om: i64 = o.get(4..6)?.parse().ok()?;
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo, d);
    Some((days * 86_400 + h * 3600 + mi * 60 + s - offset) as f64 + frac)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The RFC 3339 form (UTC, milliseconds) of seconds since the Unix epoch, as the proxy writes
/// `time`.
pub fn format_rfc3339(secs: f64) -> String {
    let ms_total = (secs * 1e3).round() as i64;
    let (days, ms_of_day) = (
        ms_total.div_euclid(86_400_000),
        ms_total.rem_euclid(86_400_000),
    );
    // Civil from days (Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let s = ms_of_day / 1000;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        ms_of_day % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip_and_match_known_instants() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0.0));
        // 2024-05-01T12:00:00Z is 1714564800 (date -d ... +%s).
        let t = parse_rfc3339("2024-05-01T12:00:00.123Z").unwrap();
        assert!((t - 1_714_564_800.123).abs() < 1e-6, "{t}");
        assert_eq!(
            parse_rfc3339("2024-05-01T14:00:00+02:00"),
            Some(1_714_564_800.0)
        );
        assert_eq!(
            format_rfc3339(1_714_564_800.123),
            "2024-05-01T12:00:00.123Z"
        );
        for bad in [
            "2024-05-01",
            "2024-13-01T00:00:00Z",
            "2024-05-01T00:00:00",
            "x",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn both_forms_are_read_and_classified() {
        let text = r#"{"time":"2024-05-01T12:00:00.100Z","status":200,"duration_ms":10.0,"cluster":"app","endpoint":"a:1","attempts":1,"cause":null}
{"time":"2024-05-01T12:00:00.200Z","status":503,"duration_ms":1.0,"cluster":"app","endpoint":"b:1","attempts":1,"cause":null}
{"time":"2024-05-01T12:00:00.300Z","status":504,"duration_ms":1000.0,"cluster":"app","endpoint":"b:1","attempts":1,"cause":"upstream b:1 did not answer within 1s"}
{"time":"2024-05-01T12:00:00.400Z","status":200,"duration_ms":20.0,"cluster":"app","endpoint":"a:1","attempts":2,"cause":null}
not json
{"time":"2024-05-01T12:00:00.500Z","status":200,"duration_ms":12.0,"cluster":"app","endpoint":"a:1","attempts":2,"tries":[{"endpoint":"b:1","outcome":"connect refused","duration_ms":0.2,"in_flight":0},{"endpoint":"a:1","outcome":"ok","duration_ms":11.5,"in_flight":3}]}
"#;
        let log = read_log(text.as_bytes()).unwrap();
        assert_eq!(log.lines, 6);
        assert_eq!(log.skipped, 1);
        assert_eq!(log.first_skipped.as_ref().unwrap().0, 5);
        assert_eq!(log.requests.len(), 5);
        assert_eq!(log.multi_try_lines, 1);
        assert_eq!(log.rich_lines, 1);
        let classes: Vec<TryClass> = log.tries.iter().map(|t| t.class).collect();
        assert_eq!(
            classes,
            [
                TryClass::Ok,
                TryClass::Error,
                TryClass::Timeout,
                TryClass::Error,
                TryClass::Ok
            ]
        );
        assert_eq!(log.endpoints, ["a:1", "b:1"]);
        assert_eq!(log.tries[4].in_flight, Some(3));
        // The second try starts when the first ended (epoch seconds in f64: 0.25 us steps).
        assert!((log.tries[4].start - log.tries[3].start - 0.0002).abs() < 1e-6);
        assert_eq!(TryClass::of_outcome("status 503"), TryClass::Error);
        assert_eq!(TryClass::of_outcome("timeout"), TryClass::Timeout);
        assert_eq!(TryClass::of_outcome("reset"), TryClass::Reset);
        assert_eq!(TryClass::of_outcome("connect refused"), TryClass::Error);
        assert_eq!(TryClass::of_outcome("connect timeout"), TryClass::Timeout);
        let client = r#"{"time":"2024-05-01T12:00:00.500Z","status":408,"duration_ms":12.0,"cluster":"app","attempts":1,"tries":[{"endpoint":"a:1","outcome":"client","duration_ms":11.5,"in_flight":0}]}"#;
        assert!(read_log(client.as_bytes()).unwrap().tries.is_empty());
    }
}
