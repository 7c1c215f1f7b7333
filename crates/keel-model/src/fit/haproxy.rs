//! HAProxy's `option httplog` default format, with or without the syslog prefix:
//!
//! ```text
//! haproxy[14389]: 10.0.1.2:33317 [06/Feb/2009:12:14:14.655] http-in static/srv1 10/0/30/69/109 200 2750 - - ---- 1/1/1/1/0 0/0 {1wt.eu} {} "GET /index.html HTTP/1.1"
//! ```
//!
//! client `[accept date]` frontend `backend/server` `TR/Tw/Tc/Tr/Ta` (`Tq/Tw/Tc/Tr/Tt` before
//! 1.9) status bytes cookies termination-state `actconn/feconn/beconn/srv_conn/retries`
//! `srv_queue/backend_queue` captures request. HAProxy logs the server's *name*, not its
//! address, and one line per request: with `retries` above 0 the earlier tries are not named
//! (`+` when redispatched to another server), so such requests are left out of the
//! per-endpoint fit, as keel's own multi-try lines are.
//!
//! The try's class comes from the termination state: `s` (server timeout) a timeout; `SC`
//! (refused or failed connection) an error; `SH` / `SD` (the server closed or reset before the
//! whole answer) a reset; `C`/`c` the client's doing; `P`, `R`, `I`, `D`, `K`, `U`, `L` the
//! proxy's own (left out); a normal end (`-`) by the status, with keel's rule
//! ([`TryClass::of_status`]).

use super::log::TryClass;
use super::log::{parse_clf_time, LineError, ParsedRequest, ParsedTry};

fn timer(s: &str) -> Result<i64, LineError> {
    s.trim_start_matches('+')
        .parse::<i64>()
        .map_err(|_| LineError::not_a("timer", s, "a number of ms"))
}

/// Reads one line.
pub fn read(line: &str) -> Result<Option<ParsedRequest>, LineError> {
    // The accept date: the first `[...]` that reads as one (the syslog tag's `[pid]` does not).
    let mut from = 0;
    let (start, rest) = loop {
        let Some(open) = line[from..].find('[').map(|i| i + from) else {
            return Err(LineError::Missing(
                "[accept date] (dd/Mon/yyyy:hh:mm:ss.mmm)",
            ));
        };
        let close = line[open..]
            .find(']')
            .map(|i| i + open)
            .ok_or_else(|| LineError::shape("a [ without its ]"))?;
        if let Some(t) = parse_clf_time(&line[open + 1..close]) {
            break (t, &line[close + 1..]);
        }
        from = close;
    };
    let mut f = rest.split_whitespace();
    let mut next = |what: &'static str| f.next().ok_or(LineError::Missing(what));
    let _frontend = next("frontend")?;
    let (backend, server) = next("backend/server")?
        .split_once('/')
        .ok_or_else(|| LineError::shape("backend/server without a /"))?;
    let timers: Vec<&str> = next("timers TR/Tw/Tc/Tr/Ta")?.split('/').collect();
    let [tr, tw, tc, _tresp, ta] = timers.as_slice() else {
        return Err(LineError::Count {
            found: timers.len(),
            what: "timers",
            expected: "5 (TR/Tw/Tc/Tr/Ta)",
        });
    };
    let (tr, tw, tc, ta) = (timer(tr)?, timer(tw)?, timer(tc)?, timer(ta)?);
    let status = next("status")?;
    let status: i32 = status
        .parse()
        .map_err(|_| LineError::not_a("status", status, "a number"))?;
    let _bytes = next("bytes")?;
    let _cookie_req = next("captured request cookie")?;
    let _cookie_resp = next("captured response cookie")?;
    let term = next("termination state")?;
    if term.len() < 2 {
        return Err(LineError::shape(format!(
            "termination state {term:?} is shorter than 2 characters"
        )));
    }
    let conns: Vec<&str> = next("actconn/feconn/beconn/srv_conn/retries")?
        .split('/')
        .collect();
    let [_, _, _, _, retries] = conns.as_slice() else {
        return Err(LineError::Count {
            found: conns.len(),
            what: "connection counts",
            expected: "5 (actconn/feconn/beconn/srv_conn/retries)",
        });
    };
    let retries: u32 = retries
        .trim_start_matches('+')
        .parse()
        .map_err(|_| LineError::not_a("retries", retries, "a number"))?;
    let _queues = next("srv_queue/backend_queue")?;
    if ta < 0 {
        return Err(LineError::Missing("total time (Ta is -1)"));
    }
    let duration_ms = ta as f64;
    let mut r = ParsedRequest {
        cluster: backend.to_string(),
        start,
        duration_ms,
        ..ParsedRequest::default()
    };
    if server == "<NOSRV>" {
        // No server was available (or the request was refused before one was chosen).
        return Ok(Some(r));
    }
    if retries > 0 {
        r.hidden_tries = true;
        return Ok(Some(r));
    }
    let mut chars = term.chars();
    let (cause, phase) = (chars.next().unwrap_or('-'), chars.next().unwrap_or('-'));
    let class = match (cause, phase) {
        ('s', _) => Some(TryClass::Timeout),
        ('S', 'C') => Some(TryClass::Error),
        ('S', _) => Some(TryClass::Reset),
        ('C' | 'c', _) => None,
        // -1: no status at all (HAProxy's own answer would have one): the endpoint failed.
        ('-', _) => Some(u16::try_from(status).map_or(TryClass::Error, TryClass::of_status)),
        (p, _) if "PRIDKUL".contains(p) => {
            r.proxy_side = true;
            return Ok(Some(r));
        }
        (other, _) => {
            return Err(LineError::Unknown {
                what: "termination cause",
                value: other.to_string(),
            })
        }
    };
    // The server's part: the whole time less the request's arrival and the queue.
    let try_ms = (ta - tr.max(0) - tw.max(0)).max(0) as f64;
    let _ = tc;
    r.tries.push(ParsedTry {
        endpoint: server.to_string(),
        class,
        duration_ms: try_ms,
    });
    Ok(Some(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    // The example of HAProxy's configuration manual (section 8.2.3), and variations of it.
    const DOC: &str = r#"Feb  6 12:14:14 localhost haproxy[14389]: 10.0.1.2:33317 [06/Feb/2009:12:14:14.655] http-in static/srv1 10/0/30/69/109 200 2750 - - ---- 1/1/1/1/0 0/0 {1wt.eu} {} "GET /index.html HTTP/1.1""#;

    #[test]
    fn the_manuals_example_reads() {
        let r = read(DOC).unwrap().unwrap();
        assert_eq!(r.cluster, "static");
        assert_eq!(r.tries.len(), 1);
        assert_eq!(r.tries[0].endpoint, "srv1");
        assert_eq!(r.tries[0].class, Some(TryClass::Ok));
        assert!((r.duration_ms - 109.0).abs() < 1e-9);
        // Ta less TR and Tw.
        assert!((r.tries[0].duration_ms - 99.0).abs() < 1e-9);
        let t = parse_clf_time("06/Feb/2009:12:14:14.655").unwrap();
        assert!((r.start - t).abs() < 1e-9);
    }

    #[test]
    fn termination_states_and_retries_classify() {
        let with = |term: &str, status: &str, conns: &str| {
            DOC.replace(" ---- ", &format!(" {term} "))
                .replace(" 200 2750", &format!(" {status} 2750"))
                .replace("1/1/1/1/0", conns)
        };
        let class = |l: &str| {
            read(l)
                .unwrap()
                .unwrap()
                .tries
                .first()
                .and_then(|t| t.class)
        };
        assert_eq!(
            class(&with("sH--", "504", "1/1/1/1/0")),
            Some(TryClass::Timeout)
        );
        assert_eq!(
            class(&with("SC--", "503", "1/1/1/1/0")),
            Some(TryClass::Error)
        );
        assert_eq!(
            class(&with("SH--", "502", "1/1/1/1/0")),
            Some(TryClass::Reset)
        );
        assert_eq!(
            class(&with("----", "503", "1/1/1/1/0")),
            Some(TryClass::Error)
        );
        assert_eq!(
            class(&with("----", "500", "1/1/1/1/0")),
            Some(TryClass::Error)
        );
        assert_eq!(class(&with("----", "501", "1/1/1/1/0")), Some(TryClass::Ok));
        assert_eq!(class(&with("----", "404", "1/1/1/1/0")), Some(TryClass::Ok));
        assert_eq!(class(&with("CD--", "200", "1/1/1/1/0")), None);
        let retried = read(&with("----", "200", "1/1/1/1/+2")).unwrap().unwrap();
        assert!(retried.hidden_tries);
        let nosrv = DOC
            .replace("static/srv1", "static/<NOSRV>")
            .replace(" ---- ", " SC-- ");
        assert!(read(&nosrv).unwrap().unwrap().tries.is_empty());
        let proxy = read(&with("PR--", "403", "1/1/1/1/0")).unwrap().unwrap();
        assert!(proxy.proxy_side && proxy.tries.is_empty());
    }

    #[test]
    fn what_cannot_be_read_says_why() {
        assert!(read("Feb  6 12:14:14 localhost kernel: eth0 up").is_err());
        let e = read(&DOC.replace("10/0/30/69/109", "10/0/30")).unwrap_err();
        assert!(
            matches!(
                e,
                LineError::Count {
                    found: 3,
                    what: "timers",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().starts_with("3 timers, not 5"), "{e}");
        let e = read(&DOC.replace("1/1/1/1/0", "1/1/1/1/x")).unwrap_err();
        assert_eq!(e, LineError::not_a("retries", "x", "a number"));
        assert_eq!(e.to_string(), r#"retries "x" is not a number"#);
    }
}
