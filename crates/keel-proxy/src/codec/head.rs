//! Reading an HTTP/1.1 head as keel writes them (request or status line, then `Name: value`
//! lines each ended by CRLF): its header lines, what the policies look up and edit, and what an
//! edit of a response head's lines walks (`exchange::response`); a request line's parts.

/// The value of the first header `name` (any case) of an HTTP/1.1 head (request or status
/// line first, then `Name: value` lines each ended by CRLF), trimmed.
pub(crate) fn header_value<'h>(head: &'h [u8], name: &str) -> Option<&'h [u8]> {
    header_lines(head).find_map(|(n, v, _)| n.eq_ignore_ascii_case(name.as_bytes()).then_some(v))
}

/// The header lines of an HTTP/1.1 head: (name, trimmed value, the line's byte range with its
/// CRLF).
pub(crate) fn header_lines(
    head: &[u8],
) -> impl Iterator<Item = (&[u8], &[u8], std::ops::Range<usize>)> {
    let first = head
        .windows(2)
        .position(|w| w == b"\r\n")
        .map_or(head.len(), |p| p + 2);
    let mut at = first;
    std::iter::from_fn(move || loop {
        if at >= head.len() {
            return None;
        }
        let start = at;
        let end = head[at..]
            .windows(2)
            .position(|w| w == b"\r\n")
            .map_or(head.len(), |p| at + p);
        at = (end + 2).min(head.len());
        let line = &head[start..end];
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        return Some((&line[..colon], line[colon + 1..].trim_ascii(), start..at));
    })
}

/// `METHOD SP target SP version` of a head's first line.
pub(crate) fn request_line(head: &[u8]) -> (&[u8], &[u8], &[u8]) {
    let line = &head[..head
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(head.len())];
    let a = line.iter().position(|b| *b == b' ').unwrap_or(line.len());
    let z = line
        .iter()
        .rposition(|b| *b == b' ')
        .filter(|z| *z > a)
        .unwrap_or(line.len());
    (
        &line[..a],
        line.get(a + 1..z).unwrap_or_default(),
        line.get(z + 1..).unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lines_of_a_head() {
        let head = b"GET / HTTP/1.1\r\nHost: a\r\nX-User:  bob \r\nx-user: eve\r\n";
        assert_eq!(header_value(head, "x-user"), Some(&b"bob"[..]));
        assert_eq!(header_value(head, "HOST"), Some(&b"a"[..]));
        assert_eq!(header_value(head, "cookie"), None);
        let lines: Vec<_> = header_lines(head).map(|(_, _, r)| r).collect();
        assert_eq!(lines, vec![16..25, 25..40, 40..53]);
    }
}
