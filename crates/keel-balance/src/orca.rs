//! ORCA load reports: the `endpoint-load-metrics` response header (Open Request Cost
//! Aggregation, as gRPC, Envoy and vLLM write it), in its TEXT and JSON forms:
//!
//! ```text
//! endpoint-load-metrics: TEXT cpu_utilization=0.3, rps_fractional=10, named_metrics.foo=1
//! endpoint-load-metrics: JSON {"cpu_utilization":0.3,"rps_fractional":10,"named_metrics":{"foo":1}}
//! ```
//!
//! [`OrcaReport::parse`] never panics (a property test feeds it arbitrary bytes) and says what is
//! wrong with a typed [`OrcaError`] (its kind, the metric at fault, the byte offset). The binary
//! form (`BIN`, a base64 protobuf) is refused as [`OrcaErrorKind::Unsupported`]. A report becomes
//! a [`Utilization`] for [`crate::Balancer::report_utilization`].

use std::fmt;

use crate::load::Utilization;

/// The response header that carries an ORCA report.
pub const ORCA_HEADER: &str = "endpoint-load-metrics";

/// One ORCA report (xDS `OrcaLoadReport`'s fields; absent ones are 0 or empty).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OrcaReport {
    /// `cpu_utilization`, at least 0 (may exceed 1 where the endpoint counts per core).
    pub cpu_utilization: f64,
    /// `mem_utilization`, 0 to 1.
    pub mem_utilization: f64,
    /// `application_utilization`, at least 0.
    pub application_utilization: f64,
    /// `rps_fractional` (or the older integer `rps`): queries per second.
    pub rps_fractional: f64,
    /// `eps`: errors per second.
    pub eps: f64,
    /// `named_metrics.NAME`.
    pub named_metrics: Vec<(String, f64)>,
    /// `utilization.NAME`.
    pub utilization: Vec<(String, f64)>,
    /// `request_cost.NAME`.
    pub request_cost: Vec<(String, f64)>,
}

/// What is wrong with an ORCA header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrcaErrorKind {
    /// Nothing but blanks.
    Empty,
    /// Neither `TEXT ` nor `JSON ` (nor `BIN `) at the start.
    UnknownFormat,
    /// The binary form, which keel does not read.
    Unsupported,
    /// Not the form's grammar: a missing `=`, `:`, quote, brace or comma.
    Syntax,
    /// A value that is not a number.
    BadNumber,
    /// A number out of its range (negative, above 1 for `mem_utilization`, not finite).
    OutOfRange,
    /// A metric given twice.
    Duplicate,
    /// Not UTF-8.
    Encoding,
}

/// An ORCA header that could not be read: what, at which metric, where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct OrcaError {
    /// What is wrong.
    pub kind: OrcaErrorKind,
    /// The metric at fault (`cpu_utilization`, `named_metrics.foo`), when there is one.
    pub field: Option<String>,
    /// Byte offset in the header value.
    pub offset: usize,
}

impl fmt::Display for OrcaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            OrcaErrorKind::Empty => "empty",
            OrcaErrorKind::UnknownFormat => "not TEXT or JSON",
            OrcaErrorKind::Unsupported => "the binary form is not supported",
            OrcaErrorKind::Syntax => "syntax error",
            OrcaErrorKind::BadNumber => "not a number",
            OrcaErrorKind::OutOfRange => "out of range",
            OrcaErrorKind::Duplicate => "given twice",
            OrcaErrorKind::Encoding => "not UTF-8",
        };
        write!(f, "{ORCA_HEADER}: {what}")?;
        if let Some(field) = &self.field {
            write!(f, " at `{field}`")?;
        }
        write!(f, " (byte {})", self.offset)
    }
}

fn err(kind: OrcaErrorKind, field: Option<&str>, offset: usize) -> OrcaError {
    OrcaError {
        kind,
        field: field.map(str::to_string),
        offset,
    }
}

/// Most entries of each map a report keeps, so that a hostile header cannot make keel hold
/// an unbounded list.
pub const MAX_NAMED: usize = 64;

impl OrcaReport {
    /// Reads a header value, TEXT or JSON form.
    pub fn parse(value: &[u8]) -> Result<Self, OrcaError> {
        let text = std::str::from_utf8(value)
            .map_err(|e| err(OrcaErrorKind::Encoding, None, e.valid_up_to()))?;
        let start = text.len() - text.trim_start().len();
        let t = text.trim();
        if t.is_empty() {
            return Err(err(OrcaErrorKind::Empty, None, 0));
        }
        let (form, rest) = match t.find(|c: char| c.is_ascii_whitespace()) {
            Some(i) => (&t[..i], &t[i..]),
            None => (t, ""),
        };
        let body_at = start + form.len();
        let mut r = OrcaReport::default();
        let mut seen = Seen::default();
        if form.eq_ignore_ascii_case("TEXT") {
            parse_text(rest, body_at, &mut r, &mut seen)?;
        } else if form.eq_ignore_ascii_case("JSON") {
            Json {
                s: rest.as_bytes(),
                i: 0,
                base: body_at,
            }
            .parse(&mut r, &mut seen)?;
        } else if form.eq_ignore_ascii_case("BIN") {
            return Err(err(OrcaErrorKind::Unsupported, None, start));
        } else {
            return Err(err(OrcaErrorKind::UnknownFormat, None, start));
        }
        if !seen.rps_fractional && seen.rps {
            r.rps_fractional = seen.rps_value;
        }
        Ok(r)
    }

    /// The report as keel's load vocabulary (what weighted round-robin and zone routing use).
    pub fn utilization(&self) -> Utilization {
        Utilization {
            cpu: self.cpu_utilization,
            application: self.application_utilization,
            qps: self.rps_fractional,
            eps: self.eps,
        }
    }

    /// The report in the TEXT form (what `keel backend --orca text` writes).
    pub fn to_text(&self) -> String {
        let mut parts = vec![
            format!("cpu_utilization={}", self.cpu_utilization),
            format!("mem_utilization={}", self.mem_utilization),
            format!("application_utilization={}", self.application_utilization),
            format!("rps_fractional={}", self.rps_fractional),
            format!("eps={}", self.eps),
        ];
        for (prefix, map) in self.maps() {
            for (k, v) in map {
                parts.push(format!("{prefix}.{k}={v}"));
            }
        }
        format!("TEXT {}", parts.join(", "))
    }

    /// The report in the JSON form (what `keel backend --orca json` writes).
    pub fn to_json(&self) -> String {
        let mut out = format!(
            "JSON {{\"cpu_utilization\":{},\"mem_utilization\":{},\"application_utilization\":{},\"rps_fractional\":{},\"eps\":{}",
            self.cpu_utilization,
            self.mem_utilization,
            self.application_utilization,
            self.rps_fractional,
            self.eps
        );
        for (prefix, map) in self.maps() {
            if map.is_empty() {
                continue;
            }
            out.push_str(&format!(",\"{prefix}\":{{"));
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&format!("{}:{v}", json_string(k)));
            }
            out.push('}');
        }
        out.push('}');
        out
    }

    fn maps(&self) -> [(&'static str, &Vec<(String, f64)>); 3] {
        [
            ("named_metrics", &self.named_metrics),
            ("utilization", &self.utilization),
            ("request_cost", &self.request_cost),
        ]
    }

    /// Sets one metric, checking its range and that it is new.
    fn set(&mut self, seen: &mut Seen, key: &str, v: f64, at: usize) -> Result<(), OrcaError> {
        if !v.is_finite() {
            return Err(err(OrcaErrorKind::OutOfRange, Some(key), at));
        }
        let (map, name) = match key.split_once('.') {
            Some(("named_metrics", n)) => (Some(&mut self.named_metrics), n),
            Some(("utilization", n)) => (Some(&mut self.utilization), n),
            Some(("request_cost", n)) => (Some(&mut self.request_cost), n),
            _ => (None, key),
        };
        if let Some(map) = map {
            if name.is_empty() {
                return Err(err(OrcaErrorKind::Syntax, Some(key), at));
            }
            if map.iter().any(|(k, _)| k == name) {
                return Err(err(OrcaErrorKind::Duplicate, Some(key), at));
            }
            if map.len() < MAX_NAMED {
                map.push((name.to_string(), v));
            }
            return Ok(());
        }
        let (slot, flag, max) = match key {
            "cpu_utilization" => (&mut self.cpu_utilization, &mut seen.cpu, f64::INFINITY),
            "mem_utilization" => (&mut self.mem_utilization, &mut seen.mem, 1.0),
            "application_utilization" => (
                &mut self.application_utilization,
                &mut seen.app,
                f64::INFINITY,
            ),
            "rps_fractional" => (
                &mut self.rps_fractional,
                &mut seen.rps_fractional,
                f64::INFINITY,
            ),
            "eps" => (&mut self.eps, &mut seen.eps, f64::INFINITY),
            "rps" => (&mut seen.rps_value, &mut seen.rps, f64::INFINITY),
            // Fields keel does not know (a newer report): ignored, as protobuf readers do.
            _ => return Ok(()),
        };
        if *flag {
            return Err(err(OrcaErrorKind::Duplicate, Some(key), at));
        }
        if !(0.0..=max).contains(&v) {
            return Err(err(OrcaErrorKind::OutOfRange, Some(key), at));
        }
        *flag = true;
        *slot = v;
        Ok(())
    }
}

impl std::str::FromStr for OrcaReport {
    type Err = OrcaError;
    fn from_str(s: &str) -> Result<Self, OrcaError> {
        Self::parse(s.as_bytes())
    }
}

/// Which top-level metrics a report has given (for duplicates and `rps`).
#[derive(Default)]
struct Seen {
    cpu: bool,
    mem: bool,
    app: bool,
    rps_fractional: bool,
    eps: bool,
    rps: bool,
    rps_value: f64,
}

/// `key=value` pairs separated by commas.
fn parse_text(
    body: &str,
    base: usize,
    r: &mut OrcaReport,
    seen: &mut Seen,
) -> Result<(), OrcaError> {
    let mut at = base;
    for part in body.split(',') {
        let here = at + (part.len() - part.trim_start().len());
        at += part.len() + 1;
        let p = part.trim();
        if p.is_empty() {
            return Err(err(OrcaErrorKind::Syntax, None, here));
        }
        let Some((k, v)) = p.split_once('=') else {
            return Err(err(OrcaErrorKind::Syntax, Some(p), here));
        };
        let k = k.trim();
        if k.is_empty() {
            return Err(err(OrcaErrorKind::Syntax, None, here));
        }
        let v: f64 =
            number(v.trim()).ok_or_else(|| err(OrcaErrorKind::BadNumber, Some(k), here))?;
        r.set(seen, k, v, here)?;
    }
    Ok(())
}

/// A decimal number as ORCA writes one (digits, sign, point, exponent; no `inf` or `nan`).
fn number(s: &str) -> Option<f64> {
    let ok = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'))
        && s.bytes().any(|b| b.is_ascii_digit());
    if !ok {
        return None;
    }
    s.parse().ok()
}

/// A JSON string with the escapes JSON requires.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The JSON form: one object of numbers, and of objects of numbers for the three maps. Two
/// levels at most, so no recursion to bound.
struct Json<'a> {
    s: &'a [u8],
    i: usize,
    base: usize,
}

impl Json<'_> {
    fn at(&self) -> usize {
        self.base + self.i
    }

    fn blank(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8, field: Option<&str>) -> Result<(), OrcaError> {
        self.blank();
        if self.s.get(self.i) == Some(&b) {
            self.i += 1;
            Ok(())
        } else {
            Err(err(OrcaErrorKind::Syntax, field, self.at()))
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.blank();
        self.s.get(self.i).copied()
    }

    fn string(&mut self) -> Result<String, OrcaError> {
        self.eat(b'"', None)?;
        let mut out = Vec::new();
        loop {
            let Some(&b) = self.s.get(self.i) else {
                return Err(err(OrcaErrorKind::Syntax, None, self.at()));
            };
            self.i += 1;
            match b {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.s.get(self.i) else {
                        return Err(err(OrcaErrorKind::Syntax, None, self.at()));
                    };
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let hex = self
                                .s
                                .get(self.i..self.i + 4)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u32::from_str_radix(h, 16).ok())
                                .ok_or_else(|| err(OrcaErrorKind::Syntax, None, self.at()))?;
                            self.i += 4;
                            // A lone surrogate stands for itself as U+FFFD.
                            let c = char::from_u32(hex).unwrap_or('\u{fffd}');
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => return Err(err(OrcaErrorKind::Syntax, None, self.at())),
                    }
                }
                b if b < 0x20 => return Err(err(OrcaErrorKind::Syntax, None, self.at())),
                b => out.push(b),
            }
        }
        // The input is UTF-8 and escapes were encoded as UTF-8.
        String::from_utf8(out).map_err(|_| err(OrcaErrorKind::Encoding, None, self.at()))
    }

    fn number(&mut self, field: &str) -> Result<f64, OrcaError> {
        self.blank();
        let start = self.i;
        while self.i < self.s.len()
            && matches!(
                self.s[self.i],
                b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'
            )
        {
            self.i += 1;
        }
        std::str::from_utf8(&self.s[start..self.i])
            .ok()
            .and_then(number)
            .ok_or_else(|| err(OrcaErrorKind::BadNumber, Some(field), self.base + start))
    }

    /// `{ "k": v, ... }`, calling `each` for every member.
    fn object(
        &mut self,
        field: Option<&str>,
        mut each: impl FnMut(&mut Self, String) -> Result<(), OrcaError>,
    ) -> Result<(), OrcaError> {
        self.eat(b'{', field)?;
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(());
        }
        loop {
            let key = self.string()?;
            self.eat(b':', Some(&key))?;
            each(self, key)?;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => return Err(err(OrcaErrorKind::Syntax, field, self.at())),
            }
        }
    }

    fn parse(mut self, r: &mut OrcaReport, seen: &mut Seen) -> Result<(), OrcaError> {
        self.object(None, |j, key| {
            if j.peek() == Some(b'{') {
                if !matches!(
                    key.as_str(),
                    "named_metrics" | "utilization" | "request_cost"
                ) {
                    return Err(err(OrcaErrorKind::Syntax, Some(&key), j.at()));
                }
                return j.object(Some(&key.clone()), |j, name| {
                    let full = format!("{key}.{name}");
                    let at = j.at();
                    let v = j.number(&full)?;
                    r.set(seen, &full, v, at)
                });
            }
            let at = j.at();
            let v = j.number(&key)?;
            r.set(seen, &key, v, at)
        })?;
        if self.peek().is_some() {
            return Err(err(OrcaErrorKind::Syntax, None, self.at()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_text_form() {
        let r = OrcaReport::parse(
            b"TEXT cpu_utilization=0.3, rps_fractional=10, named_metrics.foo=1,eps=0.5",
        )
        .unwrap();
        assert_eq!(r.cpu_utilization, 0.3);
        assert_eq!(r.rps_fractional, 10.0);
        assert_eq!(r.eps, 0.5);
        assert_eq!(r.named_metrics, vec![("foo".to_string(), 1.0)]);
        let u = r.utilization();
        assert_eq!((u.value(), u.qps, u.eps), (0.3, 10.0, 0.5));
        // application_utilization wins over cpu when above zero (A58).
        let r: OrcaReport = "TEXT cpu_utilization=0.3, application_utilization=0.7"
            .parse()
            .unwrap();
        assert_eq!(r.utilization().value(), 0.7);
        // The older integer rps counts when rps_fractional is absent.
        let r: OrcaReport = "TEXT rps=12".parse().unwrap();
        assert_eq!(r.rps_fractional, 12.0);
    }

    #[test]
    fn the_json_form() {
        let r = OrcaReport::parse(
            br#"JSON {"cpu_utilization": 0.3, "rps_fractional":10, "named_metrics": {"foo": 1, "b\"ar": -2e1}, "future_field": 3}"#,
        )
        .unwrap();
        assert_eq!(r.cpu_utilization, 0.3);
        assert_eq!(r.rps_fractional, 10.0);
        assert_eq!(
            r.named_metrics,
            vec![("foo".to_string(), 1.0), ("b\"ar".to_string(), -20.0)]
        );
        assert_eq!(
            OrcaReport::parse(b"JSON {}").unwrap(),
            OrcaReport::default()
        );
    }

    #[test]
    fn errors_say_what_and_where() {
        use OrcaErrorKind::*;
        let cases: [(&[u8], OrcaErrorKind, Option<&str>); 14] = [
            (b"", Empty, None),
            (b"  ", Empty, None),
            (b"XML <a/>", UnknownFormat, None),
            (b"BIN CgQIARAB", Unsupported, None),
            (b"TEXT cpu_utilization", Syntax, Some("cpu_utilization")),
            (
                b"TEXT cpu_utilization=abc",
                BadNumber,
                Some("cpu_utilization"),
            ),
            (
                b"TEXT cpu_utilization=-0.1",
                OutOfRange,
                Some("cpu_utilization"),
            ),
            (
                b"TEXT mem_utilization=1.5",
                OutOfRange,
                Some("mem_utilization"),
            ),
            (b"TEXT eps=1e999", OutOfRange, Some("eps")),
            (b"TEXT eps=inf", BadNumber, Some("eps")),
            (b"TEXT eps=1, eps=2", Duplicate, Some("eps")),
            (b"TEXT cpu_utilization=1,", Syntax, None),
            (
                br#"JSON {"cpu_utilization": "0.3"}"#,
                BadNumber,
                Some("cpu_utilization"),
            ),
            (br#"JSON {"named_metrics": {"a": 1}"#, Syntax, None),
        ];
        for (input, kind, field) in cases {
            let e = OrcaReport::parse(input).unwrap_err();
            assert_eq!(e.kind, kind, "{}", String::from_utf8_lossy(input));
            assert_eq!(
                e.field.as_deref(),
                field,
                "{}",
                String::from_utf8_lossy(input)
            );
        }
        let e = OrcaReport::parse(b"TEXT cpu_utilization=0.1, eps=x").unwrap_err();
        assert_eq!(e.offset, 26);
        assert_eq!(
            e.to_string(),
            "endpoint-load-metrics: not a number at `eps` (byte 26)"
        );
        assert_eq!(
            OrcaReport::parse(b"TEXT a=1\xff").unwrap_err().kind,
            OrcaErrorKind::Encoding
        );
    }

    fn report() -> impl Strategy<Value = OrcaReport> {
        let metric = || 0.0..1e6f64;
        let name = "[a-z_][a-z0-9_]{0,8}";
        (
            (metric(), 0.0..=1.0f64, metric(), metric(), metric()),
            proptest::collection::btree_map(name, -1e6..1e6f64, 0..4),
        )
            .prop_map(|((cpu, mem, app, rps, eps), named)| OrcaReport {
                cpu_utilization: cpu,
                mem_utilization: mem,
                application_utilization: app,
                rps_fractional: rps,
                eps,
                named_metrics: named.into_iter().collect(),
                ..OrcaReport::default()
            })
    }

    proptest! {
        #[test]
        fn never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = OrcaReport::parse(&bytes);
        }

        #[test]
        fn never_panics_on_near_misses(tail in "[ -~]{0,80}", json in any::<bool>()) {
            let head = if json { "JSON {" } else { "TEXT " };
            let _ = OrcaReport::parse(format!("{head}{tail}").as_bytes());
        }

        #[test]
        fn both_forms_read_back(r in report()) {
            prop_assert_eq!(OrcaReport::parse(r.to_text().as_bytes()).unwrap(), r.clone());
            prop_assert_eq!(OrcaReport::parse(r.to_json().as_bytes()).unwrap(), r);
        }
    }
}
