//! The HTTP/1.1 front end's request: the head as the codec parsed it in place
//! (`crate::codec::request`), routed with the listener's routes, and rewritten for the upstream
//! (`crate::exchange::rewrite`) in the form its leg sends: text for an HTTP/1.1 endpoint, a
//! map for an HTTP/2 one.

use crate::codec::request::{parse_request as parse_head, HeadError, ParsedRequest, Unparsed};
use crate::config::UpstreamProtocol;
use crate::exchange::head::UpstreamHead;
use crate::exchange::request::{
    hash_rule, request_target, Reject, RequestHead, RequestRules, RouteRef,
};
use crate::exchange::rewrite::{rewrite, rewrite_to_parts};
use crate::route::ListenerRoutes;

/// The outcome of reading an HTTP/1.1 request head.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RequestParse {
    /// The head is not complete yet.
    Partial,
    /// Complete and rewritten.
    Ready(RequestHead),
    /// HTTP/2's connection preface: the connection is HTTP/2 with prior knowledge.
    Http2Preface,
    /// Refused.
    Reject(Reject),
}

/// Room for what keel adds to a request head (`X-Forwarded-*`, a request id, `Host`).
const HEAD_MARGIN: usize = 256;

/// Parses the request head at the start of `buf`; when complete, writes into `out` the head
/// to send upstream: as text without `Host` when the client sent none and without the final
/// CRLF (both are per try), or as a map when the route's cluster speaks HTTP/2.
pub(crate) fn parse_request(
    buf: &[u8],
    rules: &RequestRules<'_>,
    routes: Option<&ListenerRoutes>,
    out: &mut UpstreamHead,
) -> RequestParse {
    parse_head(buf, rules.max_headers, |head| match head {
        Ok(req) => route_and_rewrite(req, buf, rules, routes, out),
        Err(Unparsed::Partial) => RequestParse::Partial,
        Err(Unparsed::Http2Preface) => RequestParse::Http2Preface,
        Err(Unparsed::Invalid(HeadError::TooManyHeaders)) => {
            RequestParse::Reject(Reject::TooManyHeaders)
        }
        Err(Unparsed::Invalid(HeadError::Malformed)) => RequestParse::Reject(Reject::Malformed),
    })
}

#[inline]
fn route_and_rewrite(
    req: &ParsedRequest<'_>,
    buf: &[u8],
    rules: &RequestRules<'_>,
    routes: Option<&ListenerRoutes>,
    out: &mut UpstreamHead,
) -> RequestParse {
    let (method, head_len, http10) = (req.method, req.head_len, req.http10);
    let (path, authority) = match request_target(method, req.target) {
        Ok(t) => t,
        Err(r) => return RequestParse::Reject(r),
    };
    let fields = || req.fields();
    let (route, routed);
    let mut http2 = false;
    let rules = match routes {
        Some(routes) => {
            route = routes.choose(method, path, authority, fields);
            let cluster = routes.target(route).map(|t| &t.cluster.config);
            http2 = cluster.is_some_and(|c| c.protocol != UpstreamProtocol::Http1);
            let (hash_header, hash_path) =
                hash_rule(cluster.and_then(|c| c.balance.hash_on.as_ref()));
            routed = RequestRules {
                hash_header,
                hash_path,
                ..*rules
            };
            &routed
        }
        None => {
            route = RouteRef::NotFound;
            rules
        }
    };
    out.map = None;
    let rewritten = if http2 {
        rewrite_to_parts(
            method,
            path,
            authority,
            http10,
            fields,
            rules,
            &buf[..head_len],
        )
        .map(|(head, parts)| {
            out.map = Some(parts);
            head
        })
    } else {
        // Sized by the connection's first request (what keel adds, X-Forwarded-For and the
        // like, fits in the margin), not a fixed 1 KB: a connection holds it while its answer
        // is awaited. Kept from request to request: a larger head grows it once.
        if out.text.capacity() == 0 {
            out.text.reserve(head_len + HEAD_MARGIN);
        }
        rewrite(
            method,
            path,
            authority,
            http10,
            false,
            fields,
            rules,
            &mut out.text,
        )
    };
    match rewritten {
        Ok(mut head) => {
            head.head_len = head_len;
            head.route = route;
            RequestParse::Ready(head)
        }
        Err(r) => RequestParse::Reject(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::request::BodyFraming;

    fn rules() -> RequestRules<'static> {
        RequestRules {
            client_ip: "127.0.0.1",
            client_ip_value: Box::leak(Box::new(hyper::header::HeaderValue::from_static(
                "127.0.0.1",
            ))),
            proto: "http",
            trust_forwarded: true,
            hash_header: None,
            hash_path: false,
            max_headers: 20,
            max_body: 1024,
            request_id: true,
            join_cookies: false,
        }
    }

    fn ready(raw: &[u8], rules: &RequestRules<'_>) -> (RequestHead, String) {
        let mut out = UpstreamHead::default();
        match parse_request(raw, rules, None, &mut out) {
            RequestParse::Ready(h) => (h, String::from_utf8(out.text).unwrap()),
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(raw)),
        }
    }

    #[test]
    fn a_request_is_rewritten_for_the_upstream() {
        let raw = b"GET /p?q=1 HTTP/1.1\r\nHost: app.example\r\nConnection: x-hop, keep-alive\r\nX-Hop: 1\r\nTE: trailers\r\nProxy-Authorization: b\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: ftp\r\nX-Keep: yes\r\n\r\nNEXT";
        let (h, out) = ready(raw, &rules());
        assert_eq!(h.head_len, raw.len() - 4);
        assert!(h.keep_alive && h.idempotent && h.has_host && !h.http10 && !h.is_head);
        // A request id was made (its value is random): checked, then left out.
        let id_line = out
            .split_inclusive("\r\n")
            .find(|l| l.starts_with("x-request-id: "))
            .expect("a request id");
        assert_eq!(
            id_line.len(),
            "x-request-id: \r\n".len() + 36,
            "{id_line:?}"
        );
        let out = out.replace(id_line, "");
        assert_eq!(
            out,
            "GET /p?q=1 HTTP/1.1\r\nHost: app.example\r\nX-Keep: yes\r\nx-forwarded-for: 10.0.0.1, 127.0.0.1\r\nx-forwarded-proto: http\r\nx-forwarded-host: app.example\r\n"
        );
        // From a client that is not a trusted proxy, the header is replaced.
        let mut untrusted = rules();
        untrusted.trust_forwarded = false;
        let (_, out) = ready(raw, &untrusted);
        assert!(out.contains("x-forwarded-for: 127.0.0.1\r\n"), "{out}");
        assert!(!out.contains("10.0.0.1"), "{out}");
    }

    #[test]
    fn framing_and_connection_options() {
        let (h, out) = ready(
            b"POST /u HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello",
            &rules(),
        );
        assert_eq!(
            (h.body, h.keep_alive, h.idempotent, h.has_host),
            (BodyFraming::Length(5), false, false, false)
        );
        assert!(out.ends_with("content-length: 5\r\n"), "{out}");
        let (h, _) = ready(
            b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, close\r\n\r\n",
            &rules(),
        );
        assert!(!h.keep_alive, "close wins");
        let (h, _) = ready(b"GET / HTTP/1.0\r\n\r\n", &rules());
        assert!(h.http10 && !h.keep_alive);
        let (h, _) = ready(
            b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n",
            &rules(),
        );
        assert!(h.http10 && h.keep_alive);
        let (h, out) = ready(b"GET http://a.example:8080/x?y HTTP/1.1\r\n\r\n", &rules());
        assert!(h.has_host);
        assert!(
            out.starts_with("GET /x?y HTTP/1.1\r\nhost: a.example:8080\r\n"),
            "{out}"
        );
        let (_, out) = ready(b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", &rules());
        assert!(out.starts_with("OPTIONS * HTTP/1.1\r\n"), "{out}");
        let (h, out) = ready(
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n",
            &rules(),
        );
        assert_eq!((h.body, h.expect_continue), (BodyFraming::Chunked, true));
        assert!(out.ends_with("transfer-encoding: chunked\r\n"), "{out}");
        assert!(!out.to_ascii_lowercase().contains("expect"), "{out}");
        let (h, _) = ready(
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\n",
            &RequestRules {
                max_body: u64::MAX,
                ..rules()
            },
        );
        assert_eq!(h.body, BodyFraming::Length(100_000), "large bodies stream");
    }

    #[test]
    fn bad_requests_are_refused_with_their_status() {
        let mut out = UpstreamHead::default();
        let r = |raw: &[u8], out: &mut UpstreamHead| parse_request(raw, &rules(), None, out);
        assert_eq!(
            r(b"GET / HTTP/1.1\r\nHost: x\r\n", &mut out),
            RequestParse::Partial
        );
        assert_eq!(r(b"PRI * HTTP/2", &mut out), RequestParse::Partial);
        assert_eq!(
            r(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", &mut out),
            RequestParse::Http2Preface
        );
        for (raw, status) in [
            (&b"HELLO THERE\r\n\r\n"[..], 400),
            (b"GET / HTTP/7.3\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nBad Name: v\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1025\r\n\r\n",
                413,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                501,
            ),
            (
                b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
            ),
            (
                b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
                400,
            ),
            (
                b"PUT / HTTP/1.1\r\nHost: a\r\nExpect: teapot\r\n\r\n",
                417,
            ),
            (b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", 501),
            (b"GET ftp://x/ HTTP/1.1\r\n\r\n", 400),
            (b"GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            (b"GET a/b HTTP/1.1\r\nHost: a\r\n\r\n", 400),
            (b"GET http://u@a/ HTTP/1.1\r\n\r\n", 400),
            (b"GET http://a:99999/ HTTP/1.1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: evil/x?\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: a:\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: \r\n\r\n", 400),
        ] {
            match r(raw, &mut out) {
                RequestParse::Reject(rej) => {
                    assert_eq!(rej.status(), status, "{:?}", String::from_utf8_lossy(raw))
                }
                other => panic!("{other:?} for {:?}", String::from_utf8_lossy(raw)),
            }
        }
        let many: String = (0..21).map(|i| format!("X-{i}: v\r\n")).collect();
        let raw = format!("GET / HTTP/1.1\r\n{many}\r\n");
        assert_eq!(
            r(raw.as_bytes(), &mut out),
            RequestParse::Reject(Reject::TooManyHeaders)
        );
    }

    #[test]
    fn hash_keys_from_a_header_or_the_path() {
        let mut rules = rules();
        rules.hash_header = Some("x-user");
        let (h, _) = ready(
            b"GET / HTTP/1.1\r\nHost: h\r\nX-User: alice\r\n\r\n",
            &rules,
        );
        assert_eq!(h.hash, Some(keel_balance::hash_key(b"alice")));
        rules.hash_header = None;
        rules.hash_path = true;
        let (h, _) = ready(b"GET /a/b?c=1 HTTP/1.1\r\nHost: h\r\n\r\n", &rules);
        assert_eq!(h.hash, Some(keel_balance::hash_key(b"/a/b")));
    }
}
