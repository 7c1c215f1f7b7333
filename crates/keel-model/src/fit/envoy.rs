//! Envoy's default access-log format:
//!
//! ```text
//! [%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" %RESPONSE_CODE%
//! %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%
//! "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" "%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%"
//! "%UPSTREAM_HOST%"
//! ```
//!
//! One line per request, naming the last try's host only; the default format does not say how
//! many tries there were, so with retries on, earlier tries' failures are not in the log (the
//! docs say so). The try's class comes from the response flags: `UT` a timeout, `UF` an error
//! (connection failure), `UC`, `UR`, `UPE` a reset, `DC` the client's doing, `UH` / `NR` / no
//! host a request that reached no endpoint, `UO` / `RL` / `UAEX` / `LR` the proxy's own;
//! otherwise the status, with keel's rule ([`super::TryClass::of_status`]).

use super::log::{parse_rfc3339, LineError, ParsedRequest, ParsedTry};
use super::TryClass;

/// Reads one line.
pub fn read(line: &str) -> Result<Option<ParsedRequest>, LineError> {
    let line = line.trim_end();
    let rest = line
        .strip_prefix('[')
        .ok_or_else(|| LineError::shape("does not start with [%START_TIME%]"))?;
    let (time, rest) = rest
        .split_once(']')
        .ok_or_else(|| LineError::shape("[%START_TIME% without its ]"))?;
    let start =
        parse_rfc3339(time).ok_or_else(|| LineError::not_a("START_TIME", time, "RFC 3339"))?;
    // The request line is quoted; the numbers follow it.
    let rest = rest.trim_start();
    let rest = rest
        .strip_prefix('"')
        .ok_or(LineError::Missing("quoted request line"))?;
    let (_request, rest) = rest
        .split_once('"')
        .ok_or_else(|| LineError::shape("unclosed request line"))?;
    let mut f = rest.split_whitespace();
    let mut next = |what: &'static str| f.next().ok_or(LineError::Missing(what));
    let status = next("RESPONSE_CODE")?;
    let status: u16 = status
        .parse()
        .map_err(|_| LineError::not_a("RESPONSE_CODE", status, "a number"))?;
    let flags = next("RESPONSE_FLAGS")?.to_string();
    let _rx = next("BYTES_RECEIVED")?;
    let _tx = next("BYTES_SENT")?;
    let d = next("DURATION")?;
    let duration_ms: f64 = d
        .parse()
        .map_err(|_| LineError::not_a("DURATION", d, "a number of ms"))?;
    // The upstream host is the last quoted field.
    let host = line
        .strip_suffix('"')
        .and_then(|l| l.rsplit_once('"'))
        .map(|(_, h)| h)
        .ok_or(LineError::Missing("quoted %UPSTREAM_HOST% at the end"))?;
    if line.matches('"').count() < 12 {
        return Err(LineError::Count {
            found: line.matches('"').count(),
            what: "quotes",
            expected: "the default format's 12 (six quoted fields)",
        });
    }
    let has = |f: &str| flags.split(',').any(|x| x == f);
    let mut r = ParsedRequest {
        cluster: String::new(),
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
}
