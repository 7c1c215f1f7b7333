//! NGINX's access log, in the `log_format` the user wrote in nginx.conf (given as a string,
//! `$variable` or `${variable}` between literal text, as NGINX reads it).
//!
//! The format must log `$upstream_addr`, `$upstream_status` and `$upstream_response_time` (one
//! entry per try, `, ` between tries and ` : ` between upstream groups, as NGINX writes them)
//! and a time: `$msec` (the request's end, milliseconds: recommended), `$time_iso8601` or
//! `$time_local` (seconds). `$request_time` gives the request's duration (else the tries' sum),
//! `$status` the answer, `$proxy_host` the upstream group. Other variables are read and ignored.
//!
//! A try's class follows keel's rule ([`TryClass::of_status`]): a 504 is a timeout, every other
//! 5xx but 501 and 505 an error, anything else the application's answer. A try without a status (`-`) is the client's doing when the request's
//! `$status` is 499 (the client closed the connection); otherwise the line is unreadable.

use super::log::TryClass;
use super::log::{parse_clf_time, parse_rfc3339, LineError, ParsedRequest, ParsedTry};
use super::template::Template;

/// What is wrong with a `log_format` string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Variables the fit needs are missing.
    #[error("the log_format lacks {}: keel advise needs $upstream_addr, $upstream_status, $upstream_response_time and a time ($msec, $time_iso8601 or $time_local)", .0.join(", "))]
    Missing(Vec<String>),
    /// Two variables with nothing between them cannot be told apart.
    #[error(
        "${0} and ${1} follow each other with nothing between them: a line cannot be split there"
    )]
    Adjacent(String, String),
    /// `${` without its `}`.
    #[error("`${{` without a closing `}}` at byte {0}")]
    Unclosed(usize),
}

/// A parsed `log_format`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    template: Template,
}

/// The format docs/advise.md recommends: NGINX's `combined` plus what the fit reads.
pub const RECOMMENDED: &str = "$remote_addr - $remote_user [$time_local] \"$request\" $status $body_bytes_sent \"$http_referer\" \"$http_user_agent\" $msec $request_time $proxy_host \"$upstream_addr\" \"$upstream_status\" \"$upstream_response_time\"";

/// Variables whose value is a list of tries (`a, b : c`).
fn is_list(var: &str) -> bool {
    var.starts_with("upstream_")
}

impl Format {
    /// Reads a `log_format` string (the part between the quotes in nginx.conf; several quoted
    /// pieces must be joined first).
    pub fn parse(s: &str) -> Result<Format, FormatError> {
        let mut template = Template::default();
        let b = s.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'$' {
                let (name, next) = if b.get(i + 1) == Some(&b'{') {
                    let end = s[i + 2..].find('}').ok_or(FormatError::Unclosed(i))?;
                    (&s[i + 2..i + 2 + end], i + 3 + end)
                } else {
                    let len = s[i + 1..]
                        .bytes()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == b'_')
                        .count();
                    (&s[i + 1..i + 1 + len], i + 1 + len)
                };
                if name.is_empty() {
                    template.literal('$');
                    i += 1;
                    continue;
                }
                template
                    .field(name)
                    .map_err(|(prev, next)| FormatError::Adjacent(prev, next))?;
                i = next;
            } else {
                let c = s[i..].chars().next().expect("in bounds");
                template.literal(c);
                i += c.len_utf8();
            }
        }
        let template = template.finish();
        let has = |v: &str| template.has(v);
        let mut missing: Vec<String> =
            ["upstream_addr", "upstream_status", "upstream_response_time"]
                .into_iter()
                .filter(|v| !has(v))
                .map(|v| format!("${v}"))
                .collect();
        if !["msec", "time_iso8601", "time_local"].into_iter().any(has) {
            missing.push("a time ($msec, $time_iso8601 or $time_local)".into());
        }
        if !missing.is_empty() {
            return Err(FormatError::Missing(missing));
        }
        Ok(Format { template })
    }

    /// Splits a line into its variables' values, or says where it departs from the format.
    fn fields<'a>(&'a self, line: &'a str) -> Result<Vec<(&'a str, &'a str)>, LineError> {
        self.template.split(
            line,
            |v| format!("${v}"),
            |v, rest| {
                if is_list(v) {
                    Some(list_len(rest))
                } else if v == "time_local" {
                    // `02/Dec/2026:09:26:06 +0000`: its own space is not a separator.
                    Some(26)
                } else {
                    None
                }
            },
        )
    }

    /// Reads one line.
    pub fn read(&self, line: &str) -> Result<Option<ParsedRequest>, LineError> {
        let fields = self.fields(line)?;
        let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let end = if let Some(m) = get("msec") {
            m.parse::<f64>()
                .map_err(|_| LineError::not_a("$msec", m, "seconds"))?
        } else if let Some(t) = get("time_iso8601") {
            parse_rfc3339(t).ok_or_else(|| LineError::not_a("$time_iso8601", t, "ISO 8601"))?
        } else {
            let t = get("time_local").expect("the format has a time");
            parse_clf_time(t)
                .ok_or_else(|| LineError::not_a("$time_local", t, "dd/Mon/yyyy:hh:mm:ss +zone"))?
        };
        let status = match get("status") {
            Some(s) => Some(
                s.parse::<u16>()
                    .map_err(|_| LineError::not_a("$status", s, "a status"))?,
            ),
            None => None,
        };
        let addrs = items(get("upstream_addr").expect("required"));
        let statuses = items(get("upstream_status").expect("required"));
        let times = items(get("upstream_response_time").expect("required"));
        // No upstream at all (served by NGINX itself: a redirect, a static file): not a
        // request to the cluster.
        if addrs == ["-"] {
            return Ok(None);
        }
        if statuses.len() != addrs.len() || times.len() != addrs.len() {
            return Err(LineError::shape(format!(
                "$upstream_addr has {} tries, $upstream_status {} and $upstream_response_time {}",
                addrs.len(),
                statuses.len(),
                times.len()
            )));
        }
        let mut tries = Vec::with_capacity(addrs.len());
        for ((addr, st), t) in addrs.iter().zip(&statuses).zip(&times) {
            // "no live upstreams": NGINX logs the group's name, no try was made.
            if !addr.contains(':') {
                continue;
            }
            let duration_ms = match *t {
                "-" => 0.0,
                t => {
                    t.parse::<f64>()
                        .map_err(|_| LineError::not_a("$upstream_response_time", t, "seconds"))?
                        * 1e3
                }
            };
            let class = match *st {
                "-" if status == Some(499) => None,
                "-" => {
                    return Err(LineError::shape(format!(
                    "no $upstream_status for the try of {addr} and the request's status is not 499"
                )))
                }
                s => match s.parse::<u16>() {
                    Ok(s) => Some(TryClass::of_status(s)),
                    Err(_) => return Err(LineError::not_a("$upstream_status", s, "a status")),
                },
            };
            tries.push(ParsedTry {
                endpoint: addr.to_string(),
                class,
                duration_ms,
            });
        }
        let tries_ms: f64 = tries.iter().map(|t| t.duration_ms).sum();
        let duration_ms = match get("request_time") {
            Some(r) => {
                r.parse::<f64>()
                    .map_err(|_| LineError::not_a("$request_time", r, "seconds"))?
                    * 1e3
            }
            None => tries_ms,
        };
        let cluster = get("proxy_host").unwrap_or("").to_string();
        Ok(Some(ParsedRequest {
            cluster,
            start: end - duration_ms / 1e3,
            duration_ms,
            tries,
            hidden_tries: false,
            proxy_side: false,
        }))
    }
}

/// The length of a list value at the start of `s`: items without spaces, joined by `, `
/// (tries) or ` : ` (upstream groups).
fn list_len(s: &str) -> usize {
    let item = |s: &str| s.find([' ', '"', ',']).unwrap_or(s.len());
    let mut len = item(s);
    loop {
        let rest = &s[len..];
        let sep = if rest.starts_with(", ") {
            2
        } else if rest.starts_with(" : ") {
            3
        } else {
            return len;
        };
        let next = item(&rest[sep..]);
        if next == 0 {
            return len;
        }
        len += sep + next;
    }
}

/// The items of a list value, groups flattened.
fn items(v: &str) -> Vec<&str> {
    v.split(" : ")
        .flat_map(|g| g.split(", "))
        .map(str::trim)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recommended_format_reads_tries_groups_and_times() {
        let f = Format::parse(RECOMMENDED).unwrap();
        let line = r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET /a HTTP/1.1" 200 12 "-" "curl/8.5.0" 1764667566.250 0.031 backend "10.0.0.2:80, 10.0.0.1:80 : 10.0.0.3:80" "502, 200 : 504" "0.001, 0.010 : 0.020""#;
        let r = f.read(line).unwrap().unwrap();
        assert_eq!(r.cluster, "backend");
        assert!((r.duration_ms - 31.0).abs() < 1e-9);
        assert!((r.start - (1_764_667_566.250 - 0.031)).abs() < 1e-6);
        let got: Vec<(&str, Option<TryClass>)> = r
            .tries
            .iter()
            .map(|t| (t.endpoint.as_str(), t.class))
            .collect();
        assert_eq!(
            got,
            [
                ("10.0.0.2:80", Some(TryClass::Error)),
                ("10.0.0.1:80", Some(TryClass::Ok)),
                ("10.0.0.3:80", Some(TryClass::Timeout)),
            ]
        );
        assert!((r.tries[1].duration_ms - 10.0).abs() < 1e-9);
    }

    #[test]
    fn unquoted_lists_and_time_local_read_too() {
        let f = Format::parse(
            "$time_local $upstream_addr $upstream_status ${upstream_response_time} $status",
        )
        .unwrap();
        let r = f
            .read("02/Dec/2026:09:26:06 +0100 10.0.0.1:80, 10.0.0.2:80 502, 200 0.000, 0.012 200")
            .unwrap()
            .unwrap();
        assert_eq!(r.tries.len(), 2);
        // No $request_time: the tries' sum.
        assert!((r.duration_ms - 12.0).abs() < 1e-9);
        // 09:26:06 at +01:00 is 08:26:06 UTC.
        assert!((r.start + 0.012 - parse_rfc3339("2026-12-02T08:26:06Z").unwrap()).abs() < 1e-6);
    }

    #[test]
    fn formats_without_what_the_fit_needs_are_refused() {
        let e = Format::parse("$remote_addr [$time_local] \"$request\" $status").unwrap_err();
        assert!(e.to_string().contains("$upstream_addr"), "{e}");
        let e =
            Format::parse("$upstream_addr $upstream_status $upstream_response_time").unwrap_err();
        assert!(e.to_string().contains("a time"), "{e}");
        let e = Format::parse("$msec$upstream_addr $upstream_status $upstream_response_time")
            .unwrap_err();
        assert_eq!(
            e,
            FormatError::Adjacent("msec".into(), "upstream_addr".into())
        );
    }

    #[test]
    fn what_cannot_be_read_says_why() {
        let f = Format::parse(RECOMMENDED).unwrap();
        // A combined-format line: the format's fields after the user agent are missing.
        let combined = r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET / HTTP/1.1" 200 12 "-" "curl/8.5.0""#;
        assert!(f.read(combined).is_err());
        let uneven = r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET /a HTTP/1.1" 200 12 "-" "curl" 1764667566.250 0.031 backend "10.0.0.2:80, 10.0.0.1:80" "200" "0.001, 0.010""#;
        let e = f.read(uneven).unwrap_err().to_string();
        assert!(
            e.contains("2 tries") && e.contains("$upstream_status 1"),
            "{e}"
        );
        let no_upstream = r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET /a HTTP/1.1" 301 0 "-" "curl" 1764667566.250 0.000 backend "-" "-" "-""#;
        assert_eq!(f.read(no_upstream), Ok(None));
        let no_live = r#"127.0.0.1 - - [02/Dec/2026:09:26:06 +0000] "GET /a HTTP/1.1" 502 0 "-" "curl" 1764667566.250 0.000 backend "backend" "502" "0.000""#;
        assert!(f.read(no_live).unwrap().unwrap().tries.is_empty());
    }
}
