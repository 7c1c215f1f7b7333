//! Sticky sessions (`sticky`): keel inserts a cookie naming the endpoint that answered, and
//! sends the session's next requests there while that endpoint may take them
//! (keel-balance's `pick_pinned`), else where the strategy picks, and re-pins the cookie.
//!
//! The cookie's value is opaque: a hash of a secret and the endpoint's token (itself a hash of its
//! address), 16 hex digits, mapped back through a table built with the cluster. Also the
//! cookie lookup for `hash_on = "cookie:NAME"`.

use std::collections::HashMap;
use std::sync::OnceLock;

use hyper::http::HeaderValue;

use crate::config::StickyConfig;
use crate::exchange::head::HeadView;

/// A cluster's sticky sessions, built with the cluster (one cookie value per endpoint).
pub(crate) struct Sticky {
    cookie: Box<str>,
    /// `Set-Cookie` by endpoint index.
    set_cookie: Vec<HeaderValue>,
    /// Cookie values to endpoint tokens.
    tokens: HashMap<u64, u64>,
}

/// The secret of clusters that set none: chosen once per process, so the same across reloads.
fn process_secret() -> &'static str {
    static SECRET: OnceLock<String> = OnceLock::new();
    SECRET.get_or_init(|| {
        use std::hash::BuildHasher;
        let s = std::collections::hash_map::RandomState::new();
        format!("{:016x}{:016x}", s.hash_one(1u8), s.hash_one(2u8))
    })
}

impl Sticky {
    /// The sessions of endpoints with these tokens (by balancer index).
    pub fn new(config: &StickyConfig, tokens: impl Iterator<Item = u64>) -> Self {
        let secret = config.secret.as_deref().unwrap_or_else(|| process_secret());
        let mut attrs = format!("; Path={}", config.path);
        if let Some(t) = config.ttl {
            attrs.push_str(&format!("; Max-Age={}", t.as_secs()));
        }
        if config.http_only {
            attrs.push_str("; HttpOnly");
        }
        if config.secure {
            attrs.push_str("; Secure");
        }
        if let Some(s) = &config.same_site {
            let s = match s.as_str() {
                "strict" => "Strict",
                "none" => "None",
                _ => "Lax",
            };
            attrs.push_str(&format!("; SameSite={s}"));
        }
        let mut by_value = HashMap::new();
        let set_cookie = tokens
            .map(|token| {
                let value = cookie_value(secret, token);
                by_value.insert(value, token);
                let text = format!("{}={value:016x}{attrs}", config.cookie);
                HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
            })
            .collect();
        Sticky {
            cookie: config.cookie.as_str().into(),
            set_cookie,
            tokens: by_value,
        }
    }

    /// The endpoint token the request's cookie names, if it names one of the cluster's.
    pub fn token(&self, head: HeadView<'_>) -> Option<u64> {
        let value = cookie(head, &self.cookie)?;
        let value = std::str::from_utf8(value).ok()?;
        if value.len() != 16 {
            return None;
        }
        self.tokens
            .get(&u64::from_str_radix(value, 16).ok()?)
            .copied()
    }

    /// The `Set-Cookie` naming the endpoint at `index`.
    pub fn set_cookie(&self, index: usize) -> Option<&HeaderValue> {
        self.set_cookie.get(index)
    }
}

/// The cookie's value for an endpoint's token: xxh3 of the secret and the token (computed at
/// build time; xxh3 is fixed, so a configured secret gives the same values in every keel
/// version and process, unlike std's unspecified `DefaultHasher`).
fn cookie_value(secret: &str, token: u64) -> u64 {
    let mut bytes = Vec::with_capacity(secret.len() + 9);
    bytes.extend_from_slice(secret.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(&token.to_le_bytes());
    keel_balance::hash_key(&bytes)
}

/// The value of cookie `name` in a request head's `Cookie` headers.
pub(crate) fn cookie<'h>(head: HeadView<'h>, name: &str) -> Option<&'h [u8]> {
    head.find_value("cookie", |v| {
        v.split(|b| *b == b';').find_map(|pair| {
            let pair = pair.trim_ascii();
            let eq = pair.iter().position(|b| *b == b'=')?;
            (pair[..eq].trim_ascii() == name.as_bytes()).then(|| {
                let v = pair[eq + 1..].trim_ascii();
                v.strip_prefix(b"\"")
                    .and_then(|v| v.strip_suffix(b"\""))
                    .unwrap_or(v)
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_found_among_others() {
        let text = b"GET / HTTP/1.1\r\nCookie: a=1; sid=\"x y\"\r\ncookie: srv=abc\r\n";
        // An HTTP/2 client may split its cookies over several `cookie` fields.
        let map = hyper::Request::builder()
            .header("cookie", "a=1; sid=\"x y\"")
            .header("cookie", "srv=abc")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        for head in [HeadView::Lines(text), HeadView::Map(&map)] {
            assert_eq!(cookie(head, "sid"), Some(&b"x y"[..]));
            assert_eq!(cookie(head, "srv"), Some(&b"abc"[..]));
            assert_eq!(cookie(head, "none"), None);
        }
    }

    #[test]
    fn the_cookie_names_its_endpoint_and_nothing_else() {
        let config = StickyConfig {
            cookie: "srv".into(),
            ttl: Some(std::time::Duration::from_secs(60)),
            path: "/".into(),
            secure: true,
            http_only: true,
            same_site: Some("lax".into()),
            secret: Some("s3cret".into()),
        };
        let s = Sticky::new(&config, [11u64, 22].into_iter());
        let set = s.set_cookie(1).unwrap().to_str().unwrap().to_string();
        assert!(
            set.ends_with("; Path=/; Max-Age=60; HttpOnly; Secure; SameSite=Lax"),
            "{set}"
        );
        let value = &set[4..20];
        let head = format!("GET / HTTP/1.1\r\nCookie: srv={value}\r\n");
        assert_eq!(s.token(HeadView::Lines(head.as_bytes())), Some(22));
        assert_eq!(
            s.token(HeadView::Lines(
                b"GET / HTTP/1.1\r\nCookie: srv=0123456789abcdef\r\n"
            )),
            None
        );
        // Another secret, other values.
        let other = Sticky::new(
            &StickyConfig {
                secret: Some("other".into()),
                ..config
            },
            [22u64].into_iter(),
        );
        assert_eq!(other.token(HeadView::Lines(head.as_bytes())), None);
    }
}
