//! A request's head on its way to an endpoint, in the form its leg sends: HTTP/1.1 text (an
//! HTTP/1.1 client's as keel rewrote it, sent as it is by the HTTP/1.1 leg; an HTTP/2
//! client's written once at its first HTTP/1.1 try), or hyper's parts (an HTTP/2 client's
//! edited in place, an HTTP/1.1 client's built from its fields), which the HTTP/2 leg turns
//! into a stream's HEADERS without text between. The policies and the access log read and
//! edit either through the same operations, as `exchange::response` does for responses.

use hyper::header::{HeaderName, HeaderValue};
use hyper::http::request::Parts;
use hyper::http::uri::{Authority, PathAndQuery};

use crate::codec::head::{header_lines, header_value, request_line};
use crate::codec::{push_content_length, push_header};

/// A request head to read: the policies' lookups, the access log's fields.
#[derive(Clone, Copy)]
pub(crate) enum HeadView<'a> {
    /// HTTP/1.1 text: the request line, then header lines each ended by CRLF.
    Lines(&'a [u8]),
    /// An HTTP/2 client's head; its target's authority is its `Host`.
    Map(&'a Parts),
}

impl<'a> HeadView<'a> {
    /// The value of the first header `name`, trimmed; `host` is the authority.
    pub fn value(self, name: &str) -> Option<&'a [u8]> {
        match self {
            HeadView::Lines(head) => header_value(head, name),
            HeadView::Map(p) if name.eq_ignore_ascii_case("host") => {
                p.uri.authority().map(|a| a.as_str().as_bytes())
            }
            HeadView::Map(p) => p.headers.get(name).map(|v| v.as_bytes().trim_ascii()),
        }
    }

    /// The first `f` gives of the values of every header `name`, in order.
    pub fn find_value<T>(self, name: &str, mut f: impl FnMut(&'a [u8]) -> Option<T>) -> Option<T> {
        match self {
            HeadView::Lines(head) => header_lines(head)
                .filter(|(n, _, _)| n.eq_ignore_ascii_case(name.as_bytes()))
                .find_map(|(_, v, _)| f(v)),
            HeadView::Map(p) => p
                .headers
                .get_all(name)
                .iter()
                .find_map(|v| f(v.as_bytes().trim_ascii())),
        }
    }

    /// The method.
    pub fn method(self) -> Option<&'a [u8]> {
        match self {
            HeadView::Lines(head) => Some(request_line(head).0).filter(|m| !m.is_empty()),
            HeadView::Map(p) => Some(p.method.as_str().as_bytes()),
        }
    }

    /// The target in origin form (path and query).
    pub fn target(self) -> &'a [u8] {
        match self {
            HeadView::Lines(head) => request_line(head).1,
            HeadView::Map(p) => p
                .uri
                .path_and_query()
                .map_or(b"/", |t| t.as_str().as_bytes()),
        }
    }
}

/// A request head to edit: the policies' rewrites of path, `Host` and headers.
pub(crate) enum RequestHeaders<'a> {
    /// An HTTP/1.1 client's head, as `exchange::rewrite::rewrite` wrote it (no final CRLF).
    Lines(&'a mut Vec<u8>),
    /// An HTTP/2 client's head, as `exchange::rewrite::rewrite_h2` left it.
    Map(&'a mut Parts),
}

impl RequestHeaders<'_> {
    /// The head to read.
    pub fn view(&self) -> HeadView<'_> {
        match self {
            RequestHeaders::Lines(head) => HeadView::Lines(head),
            RequestHeaders::Map(p) => HeadView::Map(p),
        }
    }

    /// Replaces the target's path; its query stays.
    pub fn set_path(&mut self, path: &[u8]) {
        match self {
            RequestHeaders::Lines(head) => {
                let (method, target, _) = request_line(head);
                let start = method.len() + 1;
                let end = start
                    + target
                        .iter()
                        .position(|b| *b == b'?')
                        .unwrap_or(target.len());
                if start <= end && end <= head.len() {
                    head.splice(start..end, path.iter().copied());
                }
            }
            RequestHeaders::Map(p) => {
                let query = p.uri.query();
                let mut target = path.to_vec();
                if let Some(q) = query {
                    target.push(b'?');
                    target.extend_from_slice(q.as_bytes());
                }
                let Ok(target) = PathAndQuery::from_maybe_shared(bytes::Bytes::from(target)) else {
                    return;
                };
                let mut uri = p.uri.clone().into_parts();
                uri.path_and_query = Some(target);
                set_uri(p, uri);
            }
        }
    }

    /// Sets `Host`, or removes it (`None`: each try then names its endpoint).
    pub fn set_host(&mut self, host: Option<&[u8]>) {
        match self {
            RequestHeaders::Lines(head) => {
                remove_lines(head, |n| n.eq_ignore_ascii_case(b"host"));
                if let Some(h) = host {
                    push_header(head, b"host", h);
                }
            }
            RequestHeaders::Map(p) => {
                let mut uri = p.uri.clone().into_parts();
                uri.authority = host.and_then(|h| Authority::try_from(h).ok());
                set_uri(p, uri);
            }
        }
    }

    /// Removes every header whose name `drop` picks (names are compared as written).
    pub fn remove(&mut self, drop: impl Fn(&[u8]) -> bool) {
        match self {
            RequestHeaders::Lines(head) => remove_lines(head, drop),
            RequestHeaders::Map(p) => {
                // One removal per name, all its values at once.
                while let Some(name) = p
                    .headers
                    .keys()
                    .find(|n| drop(n.as_str().as_bytes()))
                    .cloned()
                {
                    p.headers.remove(&name);
                }
            }
        }
    }

    /// Adds a header after the others (a value that is not a valid header value is not sent).
    pub fn append(&mut self, name: &HeaderName, value: &[u8]) {
        match self {
            RequestHeaders::Lines(head) => push_header(head, name.as_str().as_bytes(), value),
            RequestHeaders::Map(p) => {
                if let Ok(v) = HeaderValue::from_bytes(value) {
                    p.headers.append(name.clone(), v);
                }
            }
        }
    }
}

/// The head an HTTP/1.1 client's request goes upstream with, in the form its leg sends:
/// text for an HTTP/1.1 endpoint, a map for an HTTP/2 one (`map` set). Kept by the
/// connection from request to request, so the text's buffer is reused.
#[derive(Default)]
pub(crate) struct UpstreamHead {
    pub text: Vec<u8>,
    pub map: Option<Parts>,
}

impl UpstreamHead {
    /// The head to edit.
    pub fn headers(&mut self) -> RequestHeaders<'_> {
        match &mut self.map {
            Some(p) => RequestHeaders::Map(p),
            None => RequestHeaders::Lines(&mut self.text),
        }
    }

    /// The head to read.
    pub fn view(&self) -> HeadView<'_> {
        match &self.map {
            Some(p) => HeadView::Map(p),
            None => HeadView::Lines(&self.text),
        }
    }

    /// Frames a chunked body read and decoded whole with `Content-Length: n` instead.
    pub fn reframe_as_length(&mut self, n: u64) {
        match &mut self.map {
            Some(p) => {
                p.headers
                    .insert(hyper::header::CONTENT_LENGTH, HeaderValue::from(n));
            }
            None => {
                // `rewrite` writes the framing last.
                const CHUNKED: &[u8] = b"transfer-encoding: chunked\r\n";
                debug_assert!(self.text.ends_with(CHUNKED));
                if self.text.ends_with(CHUNKED) {
                    self.text.truncate(self.text.len() - CHUNKED.len());
                    push_content_length(&mut self.text, n);
                }
            }
        }
    }
}

/// Gives a head the target `uri` (a scheme when it has an authority, none when it has not, as
/// `Uri` wants); a target that is not valid leaves the head's as it was.
pub(crate) fn set_uri(p: &mut Parts, mut uri: hyper::http::uri::Parts) {
    uri.scheme = match uri.authority {
        Some(_) => uri.scheme.or(Some(hyper::http::uri::Scheme::HTTP)),
        None => None,
    };
    if let Ok(uri) = hyper::Uri::from_parts(uri) {
        p.uri = uri;
    }
}

/// Removes the header lines of an HTTP/1.1 head whose name `drop` picks.
fn remove_lines(head: &mut Vec<u8>, drop: impl Fn(&[u8]) -> bool) {
    // One line at a time, from the first again: no list of lines to allocate (the trace
    // context removes a `traceparent` from every request).
    loop {
        let found = header_lines(head)
            .find(|(n, _, _)| drop(n))
            .map(|(_, _, r)| r);
        let Some(range) = found else { return };
        head.drain(range);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAME: HeaderName = HeaderName::from_static("x-added");

    fn map(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = hyper::Request::builder().uri(uri);
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// Every edit, applied to both forms of one request, gives the same HTTP/1.1 head.
    #[test]
    fn both_forms_edit_alike() {
        let mut text = b"GET /api/v1?q=1 HTTP/1.1\r\nhost: a.example\r\nx-drop: 1\r\nx-keep: 2\r\nx-drop: 3\r\n".to_vec();
        let mut parts = map(
            "http://a.example/api/v1?q=1",
            &[("x-drop", "1"), ("x-keep", "2"), ("x-drop", "3")],
        );
        for head in [
            RequestHeaders::Lines(&mut text),
            RequestHeaders::Map(&mut parts),
        ] {
            let mut head = head;
            assert_eq!(head.view().target(), b"/api/v1?q=1");
            assert_eq!(head.view().value("host"), Some(&b"a.example"[..]));
            assert_eq!(
                head.view()
                    .find_value("x-drop", |v| (v == b"3").then_some(v)),
                Some(&b"3"[..])
            );
            head.set_path(b"/v1");
            head.remove(|n| n.eq_ignore_ascii_case(b"x-drop"));
            head.set_host(Some(b"b.example"));
            head.append(&NAME, b"yes");
            assert_eq!(head.view().target(), b"/v1?q=1");
            assert_eq!(head.view().method(), Some(&b"GET"[..]));
            assert_eq!(head.view().value("x-drop"), None);
        }
        let mut rendered = Vec::new();
        crate::codec::request::write_request_head(&parts, false, &mut rendered);
        let sorted = |h: &[u8]| {
            let s = String::from_utf8(h.to_vec()).unwrap();
            let mut lines: Vec<String> = s.lines().map(str::to_owned).collect();
            lines[1..].sort();
            lines
        };
        assert_eq!(sorted(&text), sorted(&rendered));
        let mut parts = parts;
        RequestHeaders::Map(&mut parts).set_host(None);
        assert_eq!(HeadView::Map(&parts).value("host"), None);
        assert_eq!(HeadView::Map(&parts).target(), b"/v1?q=1");
    }
}
