//! Rewrites of a route's and its cluster's requests and responses: the path's prefix, `Host`,
//! headers removed, set and added (values with variables), redirects answered by keel, and
//! `Location`/`Refresh` naming the endpoint turned back to the client-facing host.
//!
//! Requests are edited in their front end's form (`exchange::head`: an HTTP/1.1 client's
//! text, an HTTP/2 client's header map), responses in their leg's (`exchange::response`).
//! Only targets that configure a rewrite pay for it.

use hyper::header::HeaderName;

use crate::config::{HeaderEdits, RedirectConfig, ReplacePrefix};
use crate::exchange::head::{HeadView, RequestHeaders};
use crate::exchange::response::{Edit, ResponseHeaders};

/// A piece of a configured value.
#[derive(Debug, Clone)]
enum Piece {
    Lit(Box<[u8]>),
    ClientIp,
    RequestId,
    Route,
    Host,
    Path,
    /// The verified client certificate's subject, SAN and SHA-256 (empty without one).
    CertSubject,
    CertSan,
    CertFingerprint,
    /// The request's W3C trace id (`[tracing]`; empty without it).
    TraceId,
}

/// A configured value, its variables found once at load time.
#[derive(Debug, Clone)]
pub(crate) struct Template(Box<[Piece]>);

impl Template {
    /// Compiles a value (validated: every `$` starts a known variable or is `$$`).
    pub fn new(text: &str) -> Self {
        let vars: [(&str, Piece); 9] = [
            ("$client_ip", Piece::ClientIp),
            ("$client_cert_subject", Piece::CertSubject),
            ("$client_cert_san", Piece::CertSan),
            ("$client_cert_fingerprint", Piece::CertFingerprint),
            ("$request_id", Piece::RequestId),
            ("$trace_id", Piece::TraceId),
            ("$route", Piece::Route),
            ("$host", Piece::Host),
            ("$path", Piece::Path),
        ];
        let mut pieces = Vec::new();
        let mut lit = Vec::new();
        let mut rest = text;
        while let Some(i) = rest.find('$') {
            lit.extend_from_slice(&rest.as_bytes()[..i]);
            rest = &rest[i..];
            if let Some(r) = rest.strip_prefix("$$") {
                lit.push(b'$');
                rest = r;
                continue;
            }
            match vars.iter().find(|(name, _)| rest.starts_with(name)) {
                Some((name, piece)) => {
                    if !lit.is_empty() {
                        pieces.push(Piece::Lit(std::mem::take(&mut lit).into()));
                    }
                    pieces.push(piece.clone());
                    rest = &rest[name.len()..];
                }
                None => {
                    lit.push(b'$');
                    rest = &rest[1..];
                }
            }
        }
        lit.extend_from_slice(rest.as_bytes());
        if !lit.is_empty() {
            pieces.push(Piece::Lit(lit.into()));
        }
        Template(pieces.into())
    }

    fn uses(&self, f: fn(&Piece) -> bool) -> bool {
        self.0.iter().any(f)
    }

    /// Appends the value with the request's variables.
    pub fn expand(&self, vars: &Vars<'_>, out: &mut Vec<u8>) {
        for p in self.0.iter() {
            match p {
                Piece::Lit(b) => out.extend_from_slice(b),
                Piece::ClientIp => out.extend_from_slice(vars.client_ip.as_bytes()),
                Piece::RequestId => out.extend_from_slice(vars.request_id()),
                Piece::Route => out.extend_from_slice(vars.route),
                Piece::Host => out.extend_from_slice(&vars.host),
                Piece::Path => out.extend_from_slice(&vars.path),
                Piece::TraceId => {
                    if let Some(id) = &vars.trace_id {
                        out.extend_from_slice(id);
                    }
                }
                Piece::CertSubject | Piece::CertSan | Piece::CertFingerprint => {
                    if let Some(c) = vars.client_cert {
                        out.extend_from_slice(match p {
                            Piece::CertSubject => c.subject.as_bytes(),
                            Piece::CertSan => c.san.as_bytes(),
                            _ => c.fingerprint.as_bytes(),
                        });
                    }
                }
            }
        }
    }
}

/// The values a request's variables take.
pub(crate) struct Vars<'a> {
    pub client_ip: &'a str,
    /// The connection's verified client certificate, if any.
    pub client_cert: Option<&'a crate::tls::ClientCert>,
    /// The route's index in its listener (empty for the listener's `cluster`).
    pub route: &'a [u8],
    /// The request's host as the client sent it (only when a rewrite uses it).
    pub host: Vec<u8>,
    /// The request's target (only when a redirect uses it).
    pub path: Vec<u8>,
    /// The request id: the head's `x-request-id` (the client's, or keel's with
    /// `generate_request_id`), else made up (only when used).
    pub id: [u8; 64],
    pub id_len: usize,
    /// The trace id as 32 hex digits (only when used, and the request is traced).
    pub trace_id: Option<[u8; 32]>,
}

impl Vars<'_> {
    fn request_id(&self) -> &[u8] {
        &self.id[..self.id_len]
    }
}

/// Header edits, compiled.
#[derive(Debug, Default)]
struct Edits {
    /// Names whose lines go (`remove`, and `set`'s names).
    drop: Vec<Box<str>>,
    /// Lines appended: `set`'s then `add`'s.
    push: Vec<(HeaderName, Template)>,
}

impl Edits {
    /// Adds the edits of `e` after those already here: its `remove` and `set` also drop the
    /// lines earlier edits add (so a route's `set` wins over its cluster's).
    fn then(&mut self, e: &HeaderEdits) {
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes()).ok();
        for n in e.remove.iter().chain(e.set.keys()) {
            let n = n.to_ascii_lowercase();
            self.push.retain(|(p, _)| p.as_str() != n);
            self.drop.push(n.into());
        }
        self.push.extend(
            e.set
                .iter()
                .chain(&e.add)
                .filter_map(|(n, v)| Some((name(n)?, Template::new(v)))),
        );
    }

    fn is_empty(&self) -> bool {
        self.drop.is_empty() && self.push.is_empty()
    }

    fn drops(&self, name: &[u8]) -> bool {
        self.drop
            .iter()
            .any(|d| d.as_bytes().eq_ignore_ascii_case(name))
    }
}

/// How the path's prefix changes.
#[derive(Debug)]
enum PathRewrite {
    Strip(Box<str>),
    Replace(Box<str>, Box<str>),
}

/// How `Host` changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HostRewrite {
    /// This value.
    Literal(Box<[u8]>),
    /// The endpoint's address (each try's own).
    Endpoint,
}

/// What a route or a cluster rewrites (`None` fields: nothing).
pub(crate) struct RewriteSource<'a> {
    pub strip_prefix: Option<&'a String>,
    pub replace_prefix: Option<&'a ReplacePrefix>,
    pub host_rewrite: Option<&'a String>,
    pub request_headers: Option<&'a HeaderEdits>,
    pub response_headers: Option<HeaderEdits>,
    pub redirect: Option<&'a RedirectConfig>,
    pub rewrite_location: bool,
}

/// A target's rewrites: its route's and its cluster's together.
#[derive(Debug, Default)]
pub(crate) struct Rewrites {
    /// The route's, then the cluster's.
    paths: Vec<PathRewrite>,
    /// The route's, else the cluster's.
    pub host: Option<HostRewrite>,
    /// The cluster's, then the route's (a route's `set` wins).
    request: Edits,
    response: Edits,
    /// The status and `Location` of a redirect route.
    pub redirect: Option<(u16, Template)>,
    /// `Location`/`Refresh` back to the client-facing host.
    pub rewrite_location: bool,
    /// Some value uses `$request_id`, `$host`, `$path`, `$trace_id`.
    uses_id: bool,
    uses_trace_id: bool,
    uses_host: bool,
    uses_path: bool,
}

impl Rewrites {
    /// The rewrites of a route (first) and its cluster; `None` when neither has any.
    pub fn new(route: Option<RewriteSource<'_>>, cluster: RewriteSource<'_>) -> Option<Self> {
        let mut r = Rewrites::default();
        let sources: Vec<&RewriteSource<'_>> = route.iter().chain([&cluster]).collect();
        for s in &sources {
            if let Some(p) = s.strip_prefix {
                r.paths.push(PathRewrite::Strip(p.as_str().into()));
            }
            if let Some(p) = s.replace_prefix {
                r.paths.push(PathRewrite::Replace(
                    p.from.as_str().into(),
                    p.to.as_str().into(),
                ));
            }
            if r.host.is_none() {
                r.host = s.host_rewrite.map(|h| match h.as_str() {
                    "$endpoint" => HostRewrite::Endpoint,
                    h => HostRewrite::Literal(h.as_bytes().into()),
                });
            }
            if let Some(d) = s.redirect {
                r.redirect = Some((d.status, Template::new(&d.location)));
            }
            r.rewrite_location |= s.rewrite_location;
        }
        for s in sources.iter().rev() {
            if let Some(e) = s.request_headers {
                r.request.then(e);
            }
            if let Some(e) = &s.response_headers {
                r.response.then(e);
            }
        }
        let templates = || {
            r.request
                .push
                .iter()
                .chain(&r.response.push)
                .map(|(_, t)| t)
                .chain(r.redirect.as_ref().map(|(_, t)| t))
        };
        let uses_id = templates().any(|t| t.uses(|p| matches!(p, Piece::RequestId)));
        let uses_host = templates().any(|t| t.uses(|p| matches!(p, Piece::Host)));
        let uses_path = templates().any(|t| t.uses(|p| matches!(p, Piece::Path)));
        r.uses_id = uses_id;
        r.uses_host = uses_host || r.rewrite_location;
        r.uses_path = uses_path;
        r.uses_trace_id = templates().any(|t| t.uses(|p| matches!(p, Piece::TraceId)));
        let nothing = r.paths.is_empty()
            && r.host.is_none()
            && r.request.is_empty()
            && r.response.is_empty()
            && r.redirect.is_none()
            && !r.rewrite_location;
        (!nothing).then_some(r)
    }

    /// The request's variables, read from its head (before any rewrite) and its trace.
    pub fn vars<'a>(
        &self,
        head: HeadView<'_>,
        client: &'a crate::exchange::request::Client,
        route: &'a [u8],
        trace: Option<&crate::exchange::trace::Trace>,
    ) -> Vars<'a> {
        let mut v = Vars {
            client_ip: &client.ip,
            client_cert: client.client_cert.as_deref(),
            route,
            host: Vec::new(),
            path: Vec::new(),
            id: [0; 64],
            id_len: 0,
            trace_id: None,
        };
        if self.uses_trace_id {
            v.trace_id = trace.map(|t| t.trace_id_hex());
        }
        if self.uses_host {
            v.host = head.value("host").unwrap_or_default().to_vec();
        }
        if self.uses_path {
            v.path = head.target().to_vec();
        }
        if self.uses_id {
            // The id the head carries: the client's or keel's (`generate_request_id`), the
            // one the endpoint gets; a new one only when it has none.
            match head.value("x-request-id").filter(|id| id.len() <= 64) {
                Some(id) => {
                    v.id[..id.len()].copy_from_slice(id);
                    v.id_len = id.len();
                }
                None => {
                    let id = crate::exchange::request::new_request_id();
                    v.id[..id.len()].copy_from_slice(&id);
                    v.id_len = id.len();
                }
            }
        }
        v
    }

    /// Rewrites the request head for the endpoint (path, `Host`, headers), in either form.
    /// With [`HostRewrite::Endpoint`] the head is left without `Host` (each try adds its
    /// endpoint's).
    pub fn request(&self, head: &mut RequestHeaders<'_>, vars: &Vars<'_>) {
        if !self.paths.is_empty() {
            let target = head.view().target();
            let path_end = target
                .iter()
                .position(|b| *b == b'?')
                .unwrap_or(target.len());
            let mut path = target[..path_end].to_vec();
            for p in &self.paths {
                rewrite_path(p, &mut path);
            }
            head.set_path(&path);
        }
        if !self.request.drop.is_empty() {
            head.remove(|name| self.request.drops(name));
        }
        match &self.host {
            Some(HostRewrite::Literal(h)) => head.set_host(Some(h)),
            Some(HostRewrite::Endpoint) => head.set_host(None),
            None => {}
        }
        let mut value = Vec::new();
        for (name, t) in &self.request.push {
            value.clear();
            t.expand(vars, &mut value);
            head.append(name, &value);
        }
    }

    /// Rewrites an endpoint's response headers for the client (either leg's form).
    /// `endpoint`: the answering endpoint's address; `proto`: the client's scheme.
    pub fn response(
        &self,
        headers: &mut ResponseHeaders<'_>,
        vars: &Vars<'_>,
        endpoint: &str,
        proto: &str,
    ) {
        let relocates = self.relocates(vars);
        if self.response.is_empty() && !relocates {
            return;
        }
        headers.edit(|name, value| {
            if self.response.drops(name) {
                return Edit::Drop;
            }
            let moved = relocates
                .then(|| relocate(name, value, endpoint, proto, &vars.host))
                .flatten();
            moved.map_or(Edit::Keep, Edit::Replace)
        });
        let mut buf = Vec::new();
        for (name, t) in &self.response.push {
            buf.clear();
            t.expand(vars, &mut buf);
            headers.append(name, &buf);
        }
    }

    fn relocates(&self, vars: &Vars<'_>) -> bool {
        self.rewrite_location && !vars.host.is_empty()
    }
}

/// Applies a prefix rewrite to a path (without its query). A stripped prefix only counts at a
/// segment's end (`/echo` strips `/echo` and `/echo/x`, not `/echoes`); the path left always
/// starts with `/`.
fn rewrite_path(p: &PathRewrite, path: &mut Vec<u8>) {
    match p {
        PathRewrite::Strip(prefix) => {
            let prefix = prefix.as_bytes();
            let Some(rest) = path.strip_prefix(prefix) else {
                return;
            };
            if !(prefix.ends_with(b"/") || rest.is_empty() || rest[0] == b'/') {
                return;
            }
            let mut new = Vec::with_capacity(rest.len() + 1);
            if rest.first() != Some(&b'/') {
                new.push(b'/');
            }
            new.extend_from_slice(rest);
            *path = new;
        }
        PathRewrite::Replace(from, to) => {
            if let Some(rest) = path.strip_prefix(from.as_bytes()) {
                let mut new = Vec::with_capacity(to.len() + rest.len());
                new.extend_from_slice(to.as_bytes());
                new.extend_from_slice(rest);
                *path = new;
            }
        }
    }
}

/// A `Location` or `Refresh` value naming the endpoint (`http(s)://ENDPOINT/...`), with the
/// client's scheme and host in its place (NGINX's `proxy_redirect default`); `None` for other
/// headers and other values.
fn relocate(
    name: &[u8],
    value: &[u8],
    endpoint: &str,
    proto: &str,
    host: &[u8],
) -> Option<Vec<u8>> {
    let (keep, url) = if name.eq_ignore_ascii_case(b"location") {
        (0, value)
    } else if name.eq_ignore_ascii_case(b"refresh") {
        // `5; url=http://...`
        let at = value
            .windows(4)
            .position(|w| w.eq_ignore_ascii_case(b"url="))?
            + 4;
        (at, &value[at..])
    } else {
        return None;
    };
    let after_scheme = if url.len() >= 7 && url[..7].eq_ignore_ascii_case(b"http://") {
        7
    } else if url.len() >= 8 && url[..8].eq_ignore_ascii_case(b"https://") {
        8
    } else {
        return None;
    };
    let rest = &url[after_scheme..];
    let ep = endpoint.as_bytes();
    if rest.len() < ep.len() || !rest[..ep.len()].eq_ignore_ascii_case(ep) {
        return None;
    }
    let tail = &rest[ep.len()..];
    if !matches!(tail.first(), None | Some(b'/' | b'?' | b'#')) {
        return None;
    }
    let mut out = Vec::with_capacity(value.len() + host.len());
    out.extend_from_slice(&value[..keep]);
    out.extend_from_slice(proto.as_bytes());
    out.extend_from_slice(b"://");
    out.extend_from_slice(host);
    out.extend_from_slice(tail);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> Vars<'static> {
        Vars {
            client_ip: "10.0.0.9",
            client_cert: None,
            route: b"3",
            host: b"app.example".to_vec(),
            path: b"/a?b".to_vec(),
            id: [b'x'; 64],
            id_len: 4,
            trace_id: None,
        }
    }

    #[test]
    fn templates_expand_their_variables() {
        let mut out = Vec::new();
        Template::new("ip=$client_ip r=$route id=$request_id $$5 https://$host$path $nope")
            .expand(&vars(), &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "ip=10.0.0.9 r=3 id=xxxx $5 https://app.example/a?b $nope"
        );
        // The client certificate's variables: empty without one.
        let t = Template::new("[$client_cert_subject|$client_cert_san|$client_cert_fingerprint]");
        let mut out = Vec::new();
        t.expand(&vars(), &mut out);
        assert_eq!(out, b"[||]");
        let cert = crate::tls::ClientCert {
            subject: "CN=a,O=b".into(),
            san: "a.test".into(),
            fingerprint: "00ff".into(),
        };
        let with = Vars {
            client_cert: Some(&cert),
            ..vars()
        };
        let mut out = Vec::new();
        t.expand(&with, &mut out);
        assert_eq!(out, b"[CN=a,O=b|a.test|00ff]");
        // The trace id: empty when the request is not traced.
        let t = Template::new("<$trace_id>");
        let mut out = Vec::new();
        t.expand(&vars(), &mut out);
        assert_eq!(out, b"<>");
        let traced = Vars {
            trace_id: Some(*b"4bf92f3577b34da6a3ce929d0e0e4736"),
            ..vars()
        };
        let mut out = Vec::new();
        t.expand(&traced, &mut out);
        assert_eq!(out, b"<4bf92f3577b34da6a3ce929d0e0e4736>");
    }

    #[test]
    fn paths_lose_or_change_their_prefix_at_segment_ends() {
        let strip = PathRewrite::Strip("/echo".into());
        for (from, to) in [
            ("/echo/status", "/status"),
            ("/echo", "/"),
            ("/echoes", "/echoes"),
            ("/other", "/other"),
        ] {
            let mut p = from.as_bytes().to_vec();
            rewrite_path(&strip, &mut p);
            assert_eq!(p, to.as_bytes(), "{from}");
        }
        let mut p = b"/echo/x".to_vec();
        rewrite_path(&PathRewrite::Strip("/echo/".into()), &mut p);
        assert_eq!(p, b"/x");
        let mut p = b"/v1/users".to_vec();
        rewrite_path(&PathRewrite::Replace("/v1/".into(), "/v2/".into()), &mut p);
        assert_eq!(p, b"/v2/users");
    }

    #[test]
    fn locations_naming_the_endpoint_come_back_to_the_client_host() {
        let r = |n: &str, v: &str| {
            relocate(
                n.as_bytes(),
                v.as_bytes(),
                "127.0.0.1:9101",
                "https",
                b"app.example",
            )
            .map(|v| String::from_utf8(v).unwrap())
        };
        assert_eq!(
            r("Location", "http://127.0.0.1:9101/landed?x"),
            Some("https://app.example/landed?x".into())
        );
        assert_eq!(
            r("location", "http://127.0.0.1:9101"),
            Some("https://app.example".into())
        );
        assert_eq!(r("Location", "http://127.0.0.1:91010/x"), None);
        assert_eq!(r("Location", "http://other/x"), None);
        assert_eq!(r("Location", "/relative"), None);
        assert_eq!(
            r("Refresh", "5; url=http://127.0.0.1:9101/next"),
            Some("5; url=https://app.example/next".into())
        );
        assert_eq!(r("X-Other", "http://127.0.0.1:9101/"), None);
    }
}
