//! Envoy's access log, in its default format or the format string the user gives
//! (`--envoy-log-format`, as in the access logger's `text_format_source`). The default:
//!
//! ```text
//! [%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" %RESPONSE_CODE%
//! %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%
//! "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" "%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%"
//! "%UPSTREAM_HOST%"
//! ```
//!
//! Istio's default ([`ISTIO`]) adds the response code details, the upstream cluster and
//! addresses. A format must have `%START_TIME%`, `%RESPONSE_CODE%`, `%DURATION%` and
//! `%UPSTREAM_HOST%`; `%RESPONSE_FLAGS%` and `%UPSTREAM_CLUSTER%` (or `_RAW`) are read when
//! there, other fields are read and ignored.
//!
//! One line per request, naming the last try's host only; the default format does not say how
//! many tries there were, so with retries on, earlier tries' failures are not in the log (the
//! docs say so). The try's class comes from the response flags: `UT` a timeout, `UF` an error
//! (connection failure), `UC`, `UR`, `UPE` a reset, `DC` the client's doing, `UH` / `NR` / no
//! host a request that reached no endpoint, `UO` / `RL` / `UAEX` / `LR` the proxy's own;
//! otherwise the status, with keel's rule ([`TryClass::of_status`]).

use super::log::TryClass;
use super::log::{parse_rfc3339, LineError, ParsedRequest, ParsedTry};
use super::template::Template;

/// Envoy's default access-log format.
pub const DEFAULT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\"\n";

/// Istio's default access-log format (its sidecars' and gateways' `accessLogFormat`).
pub const ISTIO: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

/// The fields a format must have.
const REQUIRED: [&str; 4] = ["START_TIME", "RESPONSE_CODE", "DURATION", "UPSTREAM_HOST"];

/// What is wrong with a format string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Fields the fit needs are missing.
    #[error("the format lacks {}: keel advise needs %START_TIME%, %RESPONSE_CODE%, %DURATION% and %UPSTREAM_HOST% (Istio's default format has them: --envoy-log-format istio)", .0.join(", "))]
    Missing(Vec<String>),
    /// Two commands with nothing between them cannot be told apart.
    #[error(
        "%{0}% and %{1}% follow each other with nothing between them: a line cannot be split there"
    )]
    Adjacent(String, String),
    /// `%` that opens no command.
    #[error("`%` at byte {0} opens no %COMMAND%")]
    Unclosed(usize),
}

/// A parsed Envoy format string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    template: Template,
}

impl Default for Format {
    fn default() -> Self {
        Format::parse(DEFAULT).expect("the default format parses")
    }
}

impl Format {
    /// Reads a format string (`istio` names [`ISTIO`], `default` [`DEFAULT`]). A final
    /// newline, real or written `\n` as in YAML, is the line's end.
    pub fn parse(s: &str) -> Result<Format, FormatError> {
        let s = match s.trim() {
            "istio" => ISTIO,
            "default" => DEFAULT,
            _ => s,
        };
        let s = s.trim_end_matches(['\n', '\r']);
        let s = s.strip_suffix("\\n").unwrap_or(s);
        let mut template = Template::default();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] != b'%' {
                let c = s[i..].chars().next().expect("in bounds");
                template.literal(c);
                i += c.len_utf8();
                continue;
            }
            // %NAME%, %NAME(args)%, %NAME(args):N%
            let name_len = s[i + 1..]
                .bytes()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_')
                .count();
            if name_len == 0 {
                return Err(FormatError::Unclosed(i));
            }
            let mut j = i + 1 + name_len;
            if b.get(j) == Some(&b'(') {
                j += s[j..].find(')').ok_or(FormatError::Unclosed(i))? + 1;
            }
            let command = &s[i + 1..j];
            if b.get(j) == Some(&b':') {
                j += 1 + s[j + 1..].bytes().take_while(u8::is_ascii_digit).count();
            }
            if b.get(j) != Some(&b'%') {
                return Err(FormatError::Unclosed(i));
            }
            template
                .field(command)
                .map_err(|(prev, next)| FormatError::Adjacent(prev, next))?;
            i = j + 1;
        }
        let template = template.finish();
        let missing: Vec<String> = REQUIRED
            .into_iter()
            .filter(|r| !template.has(r))
            .map(|r| format!("%{r}%"))
            .collect();
        if !missing.is_empty() {
            return Err(FormatError::Missing(missing));
        }
        Ok(Format { template })
    }

    /// Splits a line into its commands' values, or says where it departs from the format.
    fn fields<'a>(&'a self, line: &'a str) -> Result<Vec<(&'a str, &'a str)>, LineError> {
        self.template.split(line, |c| format!("%{c}%"), |_, _| None)
    }

    /// Reads one line.
    pub fn read(&self, line: &str) -> Result<Option<ParsedRequest>, LineError> {
        let line = line.trim_end();
        let fields = self.fields(line)?;
        let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let time = get("START_TIME").expect("required");
        let start =
            parse_rfc3339(time).ok_or_else(|| LineError::not_a("START_TIME", time, "RFC 3339"))?;
        let status = get("RESPONSE_CODE").expect("required");
        let status: u16 = status
            .parse()
            .map_err(|_| LineError::not_a("RESPONSE_CODE", status, "a number"))?;
        let flags = get("RESPONSE_FLAGS").unwrap_or("-");
        let d = get("DURATION").expect("required");
        let duration_ms: f64 = d
            .parse()
            .map_err(|_| LineError::not_a("DURATION", d, "a number of ms"))?;
        let host = get("UPSTREAM_HOST").expect("required");
        let cluster = get("UPSTREAM_CLUSTER")
            .or_else(|| get("UPSTREAM_CLUSTER_RAW"))
            .filter(|c| *c != "-")
            .unwrap_or("");
        let has = |f: &str| flags.split(',').any(|x| x == f);
        let mut r = ParsedRequest {
            cluster: cluster.to_string(),
            start,
            duration_ms,
            ..ParsedRequest::default()
        };
        if host == "-" || has("UH") || has("NR") {
            return Ok(Some(r));
        }
        if ["UO", "RL", "UAEX", "LR", "RLSE", "IH", "SI"]
            .iter()
            .any(|f| has(f))
        {
            r.proxy_side = true;
            return Ok(Some(r));
        }
        let class = if has("DC") {
            None
        } else if has("UT") {
            Some(TryClass::Timeout)
        } else if has("UF") {
            Some(TryClass::Error)
        } else if has("UC") || has("UR") || has("UPE") {
            Some(TryClass::Reset)
        } else {
            Some(TryClass::of_status(status))
        };
        r.tries.push(ParsedTry {
            endpoint: host.trim_start_matches("tcp://").to_string(),
            class,
            duration_ms,
        });
        Ok(Some(r))
    }
}

/// Reads one line of the default format.
pub fn read(line: &str) -> Result<Option<ParsedRequest>, LineError> {
    static DEFAULT_FORMAT: std::sync::OnceLock<Format> = std::sync::OnceLock::new();
    DEFAULT_FORMAT.get_or_init(Format::default).read(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The example of Envoy's access-log documentation (default format), with today's
    // UPSTREAM_HOST spelling, and variations.
    const DOC: &str = r#"[2016-04-15T20:17:00.310Z] "POST /api/v1/locations HTTP/2" 204 - 154 0 226 100 "10.0.35.28" "nsq2http" "cc21d9b0-cf5c-432b-8c7e-98aeb7988cd2" "locations" "10.0.2.1:80""#;

    #[test]
    fn the_documented_example_reads() {
        let r = read(DOC).unwrap().unwrap();
        assert_eq!(r.tries.len(), 1);
        assert_eq!(r.tries[0].endpoint, "10.0.2.1:80");
        assert_eq!(r.tries[0].class, Some(TryClass::Ok));
        assert!((r.duration_ms - 226.0).abs() < 1e-9);
        assert_eq!(r.start, parse_rfc3339("2016-04-15T20:17:00.310Z").unwrap());
        let old = DOC.replace("\"10.0.2.1:80\"", "\"tcp://10.0.2.1:80\"");
        assert_eq!(
            read(&old).unwrap().unwrap().tries[0].endpoint,
            "10.0.2.1:80"
        );
    }

    #[test]
    fn response_flags_classify() {
        let with =
            |status: &str, flags: &str| DOC.replace(" 204 - ", &format!(" {status} {flags} "));
        let class = |l: &str| {
            read(l)
                .unwrap()
                .unwrap()
                .tries
                .first()
                .and_then(|t| t.class)
        };
        assert_eq!(class(&with("504", "UT")), Some(TryClass::Timeout));
        assert_eq!(class(&with("503", "UF,URX")), Some(TryClass::Error));
        assert_eq!(class(&with("503", "UC")), Some(TryClass::Reset));
        assert_eq!(class(&with("503", "-")), Some(TryClass::Error));
        assert_eq!(class(&with("500", "-")), Some(TryClass::Error));
        assert_eq!(class(&with("505", "-")), Some(TryClass::Ok));
        assert_eq!(class(&with("0", "DC")), None);
        let none = with("503", "UH").replace("\"10.0.2.1:80\"", "\"-\"");
        assert!(read(&none).unwrap().unwrap().tries.is_empty());
        assert!(read(&with("503", "UO")).unwrap().unwrap().proxy_side);
    }

    #[test]
    fn what_cannot_be_read_says_why() {
        assert!(read("GET / 200").is_err());
        let e = read(&DOC.replace(" 226 ", " x ")).unwrap_err();
        assert_eq!(e, LineError::not_a("DURATION", "x", "a number of ms"));
        let e = read(&DOC.replace("[2016-04-15T20:17:00.310Z]", "[yesterday]")).unwrap_err();
        assert_eq!(e.to_string(), r#"START_TIME "yesterday" is not RFC 3339"#);
    }

    // Istio's default format, as its sidecars write it (one line of a sidecar's inbound log).
    const ISTIO_LINE: &str = r#"[2022-04-18T12:09:44.091Z] "GET / HTTP/1.1" 200 - via_upstream - "-" 0 279879 3 2 "10.233.66.16" "Mozilla/5.0 (Windows NT 10.0; Win64; x64)" "8fcedd10-23a4-9b4d-8caa-ade8a92a66a8" "192.168.1.171:8080" "10.233.66.32:80" inbound|80|| 127.0.0.6:40305 10.233.66.32:80 10.233.66.16:0 outbound_.80_._.sa-frontend.demo.svc.cluster.local default"#;

    #[test]
    fn istios_format_and_a_given_format_read() {
        let f = Format::parse("istio").unwrap();
        assert_eq!(f, Format::parse(ISTIO).unwrap());
        let r = f.read(ISTIO_LINE).unwrap().unwrap();
        assert_eq!(r.cluster, "inbound|80||");
        assert_eq!(r.tries[0].endpoint, "10.233.66.32:80");
        assert_eq!(r.tries[0].class, Some(TryClass::Ok));
        assert!((r.duration_ms - 3.0).abs() < 1e-9);
        let failed = ISTIO_LINE.replace(
            "200 - via_upstream",
            "503 UF upstream_reset_before_response_started{connection_failure}",
        );
        assert_eq!(
            f.read(&failed).unwrap().unwrap().tries[0].class,
            Some(TryClass::Error)
        );
        // The default format does not read it, and says where.
        let e = read(ISTIO_LINE).unwrap_err().to_string();
        assert!(e.contains("column"), "{e}");
        // A format of one's own, with a length limit and a YAML `\n` at its end.
        let own = Format::parse(
            r#"%START_TIME% %UPSTREAM_HOST% %RESPONSE_CODE% %DURATION% %REQ(USER-AGENT):10%\n"#,
        )
        .unwrap();
        let r = own
            .read("2026-12-02T09:26:06.000Z 10.0.0.1:80 500 4 curl")
            .unwrap()
            .unwrap();
        assert_eq!(r.tries[0].class, Some(TryClass::Error));
    }

    #[test]
    fn a_format_without_what_the_fit_needs_is_refused_by_name() {
        let e = Format::parse("[%START_TIME%] %RESPONSE_CODE% %DURATION%").unwrap_err();
        assert_eq!(e, FormatError::Missing(vec!["%UPSTREAM_HOST%".into()]));
        assert!(e.to_string().contains("%UPSTREAM_HOST%"));
        assert_eq!(
            Format::parse("%START_TIME%%UPSTREAM_HOST% %RESPONSE_CODE% %DURATION%").unwrap_err(),
            FormatError::Adjacent("START_TIME".into(), "UPSTREAM_HOST".into())
        );
        assert_eq!(
            Format::parse("100% %START_TIME%").unwrap_err(),
            FormatError::Unclosed(3)
        );
    }
}
