//! An endpoint's response head as everything between the leg and the front end edits it (the
//! policies' rewrites, the sticky cookie), whichever form its leg read it in: one set of
//! operations, so that an edit is written once, not once per protocol.

use hyper::header::{HeaderMap, HeaderName, HeaderValue};

use crate::codec::head::header_lines;
use crate::codec::push_header;

/// The headers of an endpoint's response, to edit in place.
pub(crate) enum ResponseHeaders<'a> {
    /// The head an HTTP/1.1 leg wrote for the client (status line, then header lines, each
    /// ended by CRLF, hop-by-hop headers already removed).
    Lines(&'a mut Vec<u8>),
    /// An HTTP/2 endpoint's header map.
    Map(&'a mut HeaderMap),
}

/// What an edit does with one header.
pub(crate) enum Edit {
    Keep,
    Drop,
    /// The header with this value instead.
    Replace(Vec<u8>),
}

impl ResponseHeaders<'_> {
    /// Keeps, drops or replaces each header as `f` says, given its name and value (`f` must
    /// answer the same for every value of a name: a dropped name loses all its values).
    pub fn edit(&mut self, mut f: impl FnMut(&[u8], &[u8]) -> Edit) {
        match self {
            ResponseHeaders::Lines(head) => {
                let mut out = Vec::with_capacity(head.len() + 64);
                let line_end = head
                    .windows(2)
                    .position(|w| w == b"\r\n")
                    .map_or(head.len(), |p| p + 2);
                out.extend_from_slice(&head[..line_end]);
                for (name, value, range) in header_lines(head) {
                    match f(name, value) {
                        Edit::Keep => out.extend_from_slice(&head[range]),
                        Edit::Drop => {}
                        Edit::Replace(v) => push_header(&mut out, name, &v),
                    }
                }
                **head = out;
            }
            ResponseHeaders::Map(map) => {
                let mut dropped = Vec::new();
                let mut replaced = Vec::new();
                for (name, value) in map.iter() {
                    match f(name.as_str().as_bytes(), value.as_bytes()) {
                        Edit::Keep => {}
                        Edit::Drop => dropped.push(name.clone()),
                        Edit::Replace(v) => {
                            if let Ok(v) = HeaderValue::from_bytes(&v) {
                                replaced.push((name.clone(), v));
                            }
                        }
                    }
                }
                for name in dropped {
                    map.remove(name);
                }
                for (name, value) in replaced {
                    map.insert(name, value);
                }
            }
        }
    }

    /// Adds a header (another value when the name is there already). A value that is not a
    /// valid header value goes nowhere in the map form.
    pub fn append(&mut self, name: &HeaderName, value: &[u8]) {
        match self {
            ResponseHeaders::Lines(head) => push_header(head, name.as_str().as_bytes(), value),
            ResponseHeaders::Map(map) => {
                if let Ok(v) = HeaderValue::from_bytes(value) {
                    map.append(name.clone(), v);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same edit gives the same headers in both forms.
    #[test]
    fn an_edit_does_the_same_to_lines_and_to_a_map() {
        let edit = |h: &mut ResponseHeaders<'_>| {
            h.edit(|name, value| {
                if name.eq_ignore_ascii_case(b"server") {
                    Edit::Drop
                } else if name.eq_ignore_ascii_case(b"location") {
                    Edit::Replace([b"/moved".as_slice(), value].concat())
                } else {
                    Edit::Keep
                }
            });
            h.append(&hyper::header::SET_COOKIE, b"a=1");
        };
        let mut lines =
            b"HTTP/1.1 302 Found\r\nServer: x\r\nLocation: /a\r\nX-Y: z\r\nserver: y\r\n".to_vec();
        edit(&mut ResponseHeaders::Lines(&mut lines));
        assert_eq!(
            lines,
            b"HTTP/1.1 302 Found\r\nLocation: /moved/a\r\nX-Y: z\r\nset-cookie: a=1\r\n"
        );
        let mut map = HeaderMap::new();
        for (n, v) in [
            ("server", "x"),
            ("location", "/a"),
            ("x-y", "z"),
            ("server", "y"),
        ] {
            map.append(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        edit(&mut ResponseHeaders::Map(&mut map));
        // A map keeps the order of a name's values, not the order between names.
        let mut got: Vec<(&str, &str)> = map
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                ("location", "/moved/a"),
                ("set-cookie", "a=1"),
                ("x-y", "z")
            ]
        );
    }
}
