//! Text from outside (etcd keys and values, discovered addresses) as it reaches the log.

/// An etcd key or value, or a discovered address, as log text: control characters escaped (`\n` as the two characters
/// `\` `n`), so that whoever writes a key cannot forge a line of the text log; bytes that are
/// not UTF-8 shown as U+FFFD.
pub(crate) struct Escaped<'a>(pub(crate) &'a [u8]);

impl std::fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        for c in String::from_utf8_lossy(self.0).chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// [`Escaped`], of text.
pub(crate) fn escaped(s: &(impl AsRef<[u8]> + ?Sized)) -> Escaped<'_> {
    Escaped(s.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_reach_the_log_with_their_control_characters_escaped() {
        let key = b"/keel/services/api/x\n2026-12-06T00:00:00Z  INFO forged\r\x1b[31m\xff";
        let shown = escaped(&key[..]).to_string();
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
        assert_eq!(
            shown,
            "/keel/services/api/x\\n2026-12-06T00:00:00Z  INFO forged\\r\\u{1b}[31m\u{fffd}"
        );
        assert_eq!(escaped("plain/ключ").to_string(), "plain/ключ");
    }
}
