//! keel's one HTTP/1.1 path (keel-proxy's `front/h1/`, `codec/`, `leg/h1/`) on real loopback sockets, over plain
//! TCP and over TLS: one proxy with a plain listener and a TLS listener (certificates made by
//! rcgen at test time) on the same cluster, raw clients and raw upstreams, so that every byte
//! each side sees is checked against what keel must send: the exact request head and body the
//! upstream received, the exact response bytes the client got (head, framing, body), and
//! whether the connection stays open as announced.
//!
//! What keel sends, as these tests expect it (`exchange/rewrite.rs`, `codec/response.rs`,
//! `front/h1/conn.rs`):
//! - upstream: the request line in origin form and `HTTP/1.1`; the client's headers in their
//!   order and case, without hop-by-hop ones, the names `Connection` lists, `Content-Length`,
//!   `Expect` and `X-Forwarded-*`; then `host` (from an absolute-form target), then
//!   `x-forwarded-for` (the client's address; appended to the client's own only when the
//!   client is one of `trusted_proxies`), `x-forwarded-proto`, `x-forwarded-host` (when there
//!   is a Host), `content-length` or `transfer-encoding: chunked`, and `host: <endpoint>` when
//!   the client sent none;
//! - client: `HTTP/1.1` whatever the client's version, the endpoint's headers without
//!   hop-by-hop ones, then `x-keel-endpoint`, the framing (`content-length`, or
//!   `transfer-encoding: chunked` to HTTP/1.1 clients), `date` when the endpoint sent none
//!   (taken out of `Resp::raw` before comparing), and `connection: close` when the connection
//!   ends (`connection: keep-alive` to HTTP/1.0 clients when it stays);
//! - keel's own answers: `content-type`, `content-length`, `date`, the body
//!   `"<status> <reason>: <cause>\n"` (brief unless `error_detail = "full"`).
//!
//! Bugs these tests found in keel's path, all fixed, their tests kept: a chunked response to
//! an HTTP/1.0 client repeated the head before each chunk's data; an HTTP/1.0 client's
//! `Expect: 100-continue` got a 100; an absolute-form target with a different `Host`
//! forwarded that `Host`; a forwarded response without `Date` got none; a slow streamed
//! upload that outlasted `request_timeout` was counted as the endpoint's failure.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::any_port;
use keel_proxy::ProxyConfig;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest wait for any one read in these tests.
const IO_LIMIT: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------
// Raw upstream: parses requests itself, records their bytes and answers what its handler
// scripts.

/// A request as the upstream received it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    /// The head's bytes, blank line included.
    head: Vec<u8>,
    /// The body's bytes as they came (chunk framing included).
    body_raw: Vec<u8>,
    /// The body's data (decoded when chunked).
    body: Vec<u8>,
    /// The body came chunked.
    chunked: bool,
    /// Trailer lines of a chunked body.
    trailers: Vec<String>,
}

impl Seen {
    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    /// Every byte received for this request.
    fn raw(&self) -> Vec<u8> {
        [&self.head[..], &self.body_raw[..]].concat()
    }

    fn head_text(&self) -> String {
        String::from_utf8_lossy(&self.head).into_owned()
    }
}

/// The upstream's answer to one request: these bytes, then close if `close`.
struct Reply {
    bytes: Vec<u8>,
    close: bool,
}

impl Reply {
    fn keep(bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            bytes: bytes.into(),
            close: false,
        }
    }
    fn close(bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            bytes: bytes.into(),
            close: true,
        }
    }
}

type Handler = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

struct Upstream {
    addr: SocketAddr,
    /// Connections accepted.
    accepts: Arc<AtomicUsize>,
    /// Requests received whole, in order.
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Upstream {
    async fn start(handler: Handler) -> Self {
        let listener = tokio::net::TcpListener::bind(any_port()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepts = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (a, s) = (accepts.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                a.fetch_add(1, SeqCst);
                tokio::spawn(upstream_connection(stream, handler.clone(), s.clone()));
            }
        });
        Self {
            addr,
            accepts,
            seen,
        }
    }

    /// The endpoint as keel names it (`x-keel-endpoint`, and `host` when the client sent none).
    fn ep(&self) -> String {
        self.addr.to_string()
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn seen_paths(&self) -> Vec<String> {
        self.seen().iter().map(|s| s.path().to_string()).collect()
    }

    /// The requests received since the first `from`, `/after` left out.
    fn seen_since(&self, from: usize) -> Vec<Seen> {
        self.seen()[from..]
            .iter()
            .filter(|s| s.path() != "/after")
            .cloned()
            .collect()
    }
}

async fn upstream_connection(mut s: TcpStream, handler: Handler, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    loop {
        let req = loop {
            match parse_upstream_request(&buf) {
                Ok(Some((req, used))) => {
                    buf.drain(..used);
                    break req;
                }
                Ok(None) => {}
                Err(_) => return,
            }
            let mut chunk = [0u8; 16384];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        seen.lock().unwrap().push(req.clone());
        let reply = handler(&req);
        if s.write_all(&reply.bytes).await.is_err() {
            return;
        }
        if reply.close {
            let _ = s.shutdown().await;
            // Reads what may still come so that the close is a FIN, not a reset.
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_millis(200), async {
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
            return;
        }
    }
}

/// A whole request at the start of `buf` and its length, `None` if incomplete.
fn parse_upstream_request(buf: &[u8]) -> Result<Option<(Seen, usize)>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 128];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf).map_err(|e| e.to_string())? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_string(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect();
    let find = |n: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(n))
            .map(|(_, v)| v.clone())
    };
    let mut seen = Seen {
        method: req.method.unwrap_or("").to_string(),
        target: req.path.unwrap_or("").to_string(),
        head: buf[..head_len].to_vec(),
        body_raw: Vec::new(),
        body: Vec::new(),
        chunked: false,
        trailers: Vec::new(),
    };
    let rest = &buf[head_len..];
    if find("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().ends_with("chunked")) {
        match decode_chunked(rest)? {
            Some((body, trailers, used)) => {
                seen.body = body;
                seen.body_raw = rest[..used].to_vec();
                seen.trailers = trailers;
                seen.chunked = true;
                Ok(Some((seen, head_len + used)))
            }
            None => Ok(None),
        }
    } else {
        let n: usize = find("content-length")
            .map(|v| v.trim().parse().map_err(|_| "bad content-length"))
            .transpose()?
            .unwrap_or(0);
        if rest.len() < n {
            return Ok(None);
        }
        seen.body = rest[..n].to_vec();
        seen.body_raw = seen.body.clone();
        Ok(Some((seen, head_len + n)))
    }
}

/// Decodes a whole chunked body at the start of `buf` (strictly, RFC 9112 section 7.1):
/// the data, the trailer lines and the bytes used; `None` if incomplete.
#[allow(clippy::type_complexity)]
fn decode_chunked(buf: &[u8]) -> Result<Option<(Vec<u8>, Vec<String>, usize)>, String> {
    let mut at = 0;
    let mut body = Vec::new();
    let line = |at: usize| -> Option<(usize, &[u8])> {
        let end = buf[at..].windows(2).position(|w| w == b"\r\n")?;
        Some((at + end + 2, &buf[at..at + end]))
    };
    loop {
        let Some((next, size_line)) = line(at) else {
            return Ok(None);
        };
        let size_text = size_line.split(|b| *b == b';').next().unwrap_or(b"");
        let size_text = std::str::from_utf8(size_text).map_err(|e| e.to_string())?;
        let size = usize::from_str_radix(size_text.trim_end_matches([' ', '\t']), 16)
            .map_err(|_| format!("bad chunk size line {size_line:?}"))?;
        at = next;
        if size == 0 {
            let mut trailers = Vec::new();
            loop {
                let Some((next, l)) = line(at) else {
                    return Ok(None);
                };
                at = next;
                if l.is_empty() {
                    return Ok(Some((body, trailers, at)));
                }
                trailers.push(String::from_utf8_lossy(l).into_owned());
            }
        }
        if buf.len() < at + size + 2 {
            return Ok(None);
        }
        body.extend_from_slice(&buf[at..at + size]);
        if &buf[at + size..at + size + 2] != b"\r\n" {
            return Err("chunk data not followed by CRLF".into());
        }
        at += size + 2;
    }
}

/// The size lines of a chunked body (to check that keel framed it itself: no extensions).
fn chunk_size_lines(raw: &[u8]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut at = 0;
    while let Some(end) = raw[at..].windows(2).position(|w| w == b"\r\n") {
        let line = String::from_utf8_lossy(&raw[at..at + end]).into_owned();
        let size = usize::from_str_radix(line.split(';').next().unwrap_or(""), 16).unwrap_or(0);
        lines.push(line);
        if size == 0 {
            break;
        }
        at += end + 2 + size + 2;
        if at >= raw.len() {
            break;
        }
    }
    lines
}

/// A response head for the upstream's scripts: status line, headers, CRLF.
fn head(status_line: &str, headers: &[&str]) -> String {
    let mut h = format!("{status_line}\r\n");
    for x in headers {
        h.push_str(x);
        h.push_str("\r\n");
    }
    h.push_str("\r\n");
    h
}

/// A 200 with this body and a Content-Length.
fn ok_with(body: &[u8]) -> Vec<u8> {
    let mut v = head(
        "HTTP/1.1 200 OK",
        &[&format!("Content-Length: {}", body.len()), "X-Up: yes"],
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

/// What keel sends a client for the upstream's `ok_with(body)`: exact bytes.
fn ok_with_forwarded(ep: &str, body: &[u8], connection: &str) -> Vec<u8> {
    let mut v = format!(
        "HTTP/1.1 200 OK\r\nX-Up: yes\r\nx-keel-endpoint: {ep}\r\ncontent-length: {}\r\n{}\r\n",
        body.len(),
        connection_line(connection)
    )
    .into_bytes();
    v.extend_from_slice(body);
    v
}

/// `connection: <value>\r\n`, or nothing for an empty value.
fn connection_line(value: &str) -> String {
    if value.is_empty() {
        String::new()
    } else {
        format!("connection: {value}\r\n")
    }
}

// ---------------------------------------------------------------------------------------
// Raw client over TCP or TLS: writes bytes, reads responses with strict framing checks and
// keeps the bytes each response took.

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// How a response body was delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyFraming {
    /// No body (HEAD, 204, 304).
    None,
    Length,
    Chunked,
    /// Until the connection closed.
    Close,
}

/// A response as the client read it.
#[derive(Debug, Clone)]
struct Resp {
    status: u16,
    /// Names lower-cased, in arrival order.
    headers: Vec<(String, String)>,
    /// The body's data (decoded when chunked).
    body: Vec<u8>,
    framing: BodyFraming,
    trailers: Vec<String>,
    /// Interim (1xx) statuses that reached the client before this response.
    interim: Vec<u16>,
    /// Every byte this response took on the connection, interim responses included, but
    /// for the `date` line keel adds to a forwarded response that had none (see
    /// `added_date`), so that expected bytes need not know the time.
    raw: Vec<u8>,
    /// The `date` keel added right after `x-keel-endpoint` (checked to be an IMF-fixdate).
    added_date: Option<String>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn connection_has(&self, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n == "connection")
            .flat_map(|(_, v)| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    /// Whether the response says the connection stays open (RFC 9112 section 9.3).
    fn announces_open(&self, http10_client: bool) -> bool {
        if self.framing == BodyFraming::Close || self.connection_has("close") {
            return false;
        }
        !http10_client || self.connection_has("keep-alive")
    }

    /// The raw bytes as text, for messages.
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.raw).into_owned()
    }

    /// The head's bytes (up to and with the blank line).
    fn head_text(&self) -> String {
        let t = self.text();
        match t.find("\r\n\r\n") {
            Some(i) => t[..i + 4].to_string(),
            None => t,
        }
    }
}

/// The raw bytes of a response of keel's own with its `date` value replaced by `<date>`,
/// after checking it is an IMF-fixdate (RFC 9110 section 5.6.7).
fn masked_date(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw).into_owned();
    let Some(at) = text.find("\r\ndate: ") else {
        return text;
    };
    let start = at + "\r\ndate: ".len();
    let end = start + text[start..].find("\r\n").unwrap_or(0);
    let value = &text[start..end];
    let fixdate = value.len() == 29
        && value.ends_with(" GMT")
        && value.as_bytes()[3] == b','
        && ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"].contains(&&value[..3]);
    assert!(fixdate, "date is not an IMF-fixdate: {value:?}");
    format!("{}<date>{}", &text[..start], &text[end..])
}

/// Takes out of `resp.raw` the `date` line keel adds to a forwarded response without one:
/// right after the `x-keel-endpoint` line (keel's own answers have theirs before it).
fn strip_added_date(resp: &mut Resp) {
    let text = String::from_utf8_lossy(&resp.raw).into_owned();
    let Some(at) = text.find("\r\nx-keel-endpoint: ") else {
        return;
    };
    let line_end = at + 2 + text[at + 2..].find("\r\n").unwrap_or(0);
    let rest = &text[line_end..];
    if let Some(after) = rest.strip_prefix("\r\ndate: ") {
        let end = after.find("\r\n").unwrap_or(after.len());
        let value = after[..end].to_string();
        masked_date(format!("x\r\ndate: {value}\r\n").as_bytes());
        let cut = line_end..line_end + "\r\ndate: ".len() + end;
        resp.raw.drain(cut);
        resp.added_date = Some(value);
    }
}

/// The exact bytes of keel's own answer (with `<date>` for the date).
fn own_answer(status_line: &str, endpoint: Option<&str>, connection: &str, text: &str) -> String {
    let status = &status_line["HTTP/1.1 ".len()..];
    let body = format!("{status}: {text}\n");
    format!(
        "{status_line}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\ndate: <date>\r\n{}{}\r\n{body}",
        body.len(),
        endpoint.map_or(String::new(), |e| format!("x-keel-endpoint: {e}\r\n")),
        connection_line(connection)
    )
}

struct Client {
    s: Box<dyn Io>,
    buf: Vec<u8>,
}

impl Client {
    async fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
        self.s.flush().await.unwrap();
    }

    /// Reads more; `Ok(false)` at EOF (for TLS: after the server's close_notify).
    async fn fill(&mut self) -> Result<bool, String> {
        let mut chunk = [0u8; 65536];
        match tokio::time::timeout(IO_LIMIT, self.s.read(&mut chunk)).await {
            Err(_) => Err("no answer within the time limit".into()),
            Ok(Err(e)) => Err(format!("read failed: {e}")),
            Ok(Ok(0)) => Ok(false),
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Ok(true)
            }
        }
    }

    /// True if the proxy closes the connection (EOF or reset) without sending anything more.
    async fn closes(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        match self.fill().await {
            Ok(more) => !more,
            Err(e) => e.starts_with("read failed"),
        }
    }

    /// Reads until `n` bytes are buffered or the connection ends.
    async fn read_exactly(&mut self, n: usize) -> Result<Vec<u8>, String> {
        while self.buf.len() < n {
            if !self.fill().await? {
                break;
            }
        }
        let n = n.min(self.buf.len());
        Ok(self.buf.drain(..n).collect())
    }

    /// Reads one response to a request (`head_req`: it was a HEAD; `http10`: the client spoke
    /// HTTP/1.0), checking its framing strictly.
    async fn response(&mut self, head_req: bool, http10: bool) -> Result<Resp, String> {
        let mut interim = Vec::new();
        let mut raw = Vec::new();
        loop {
            let parsed = {
                let mut headers = [httparse::EMPTY_HEADER; 128];
                let mut r = httparse::Response::new(&mut headers);
                match r.parse(&self.buf) {
                    Err(e) => {
                        return Err(format!(
                            "invalid response head ({e}): {:?}",
                            String::from_utf8_lossy(&self.buf)
                        ))
                    }
                    Ok(httparse::Status::Partial) => None,
                    Ok(httparse::Status::Complete(n)) => Some((
                        n,
                        r.code.unwrap_or(0),
                        r.headers
                            .iter()
                            .map(|h| {
                                (
                                    h.name.to_ascii_lowercase(),
                                    String::from_utf8_lossy(h.value).into_owned(),
                                )
                            })
                            .collect::<Vec<_>>(),
                    )),
                }
            };
            let Some((n, status, headers)) = parsed else {
                if !self.fill().await? {
                    return Err(format!(
                        "closed before a complete response head ({} bytes read: {:?})",
                        self.buf.len(),
                        String::from_utf8_lossy(&self.buf)
                    ));
                }
                continue;
            };
            raw.extend(self.buf.drain(..n));
            if (100..200).contains(&status) {
                if http10 {
                    return Err(format!(
                        "interim {status} sent to an HTTP/1.0 client: {:?}",
                        String::from_utf8_lossy(&raw)
                    ));
                }
                interim.push(status);
                continue;
            }
            let mut resp = Resp {
                status,
                headers,
                body: Vec::new(),
                framing: BodyFraming::None,
                trailers: Vec::new(),
                interim,
                raw,
                added_date: None,
            };
            strip_added_date(&mut resp);
            let te = resp.header("transfer-encoding").map(str::to_string);
            let lengths: Vec<&str> = resp
                .headers
                .iter()
                .filter(|(n, _)| n == "content-length")
                .map(|(_, v)| v.as_str())
                .collect();
            if te.is_some() && !lengths.is_empty() {
                return Err("both Transfer-Encoding and Content-Length".into());
            }
            if lengths.len() > 1 {
                return Err(format!("several Content-Length headers: {lengths:?}"));
            }
            if te.is_some() && http10 {
                return Err("Transfer-Encoding sent to an HTTP/1.0 client".into());
            }
            let length: Option<usize> = match lengths.first() {
                Some(v) => Some(v.parse().map_err(|_| format!("bad Content-Length {v}"))?),
                None => None,
            };
            if head_req || status == 204 || status == 304 {
                if status == 204 && (te.is_some() || length.is_some_and(|n| n > 0)) {
                    return Err("a 204 with framing headers".into());
                }
                return Ok(resp);
            }
            if let Some(te) = te {
                if !te.to_ascii_lowercase().trim().ends_with("chunked") {
                    return Err(format!("Transfer-Encoding without chunked last: {te}"));
                }
                resp.framing = BodyFraming::Chunked;
                loop {
                    if let Some((body, trailers, used)) = decode_chunked(&self.buf)? {
                        resp.raw.extend(self.buf.drain(..used));
                        resp.body = body;
                        resp.trailers = trailers;
                        return Ok(resp);
                    }
                    if !self.fill().await? {
                        return Err(format!(
                            "closed in the middle of a chunked body ({} bytes buffered)",
                            self.buf.len()
                        ));
                    }
                }
            }
            if let Some(n) = length {
                resp.framing = BodyFraming::Length;
                while self.buf.len() < n {
                    if !self.fill().await? {
                        return Err(format!(
                            "closed after {} of {n} body bytes (status {status})",
                            self.buf.len()
                        ));
                    }
                }
                resp.body = self.buf.drain(..n).collect();
                resp.raw.extend_from_slice(&resp.body.clone());
                return Ok(resp);
            }
            resp.framing = BodyFraming::Close;
            while self.fill().await? {}
            resp.body = std::mem::take(&mut self.buf);
            resp.raw.extend_from_slice(&resp.body.clone());
            return Ok(resp);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The proxy: a plain listener and a TLS listener on one cluster.

/// A directory of PEM files made for one test (a CA and a server certificate for
/// `localhost` signed by it), removed on drop.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn generate() -> Pki {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "keel-h1-path-{}-{}",
            std::process::id(),
            N.fetch_add(1, SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "keel h1 test CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        Pki { dir }
    }

    fn toml(&self, name: &str) -> String {
        format!("{:?}", self.dir.join(name).display().to_string())
    }

    /// A client trusting the test CA, offering ALPN `http/1.1`.
    fn connector(&self) -> tokio_rustls::TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(self.dir.join("ca.pem")).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let mut config = rustls::ClientConfig::builder_with_provider(keel_proxy::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsConnector::from(Arc::new(config))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One of the proxy's listeners as a client reaches it.
#[derive(Clone)]
struct Front {
    name: &'static str,
    addr: SocketAddr,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Front {
    /// `x-forwarded-proto` for this listener.
    fn proto(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// A new client connection (for TLS: handshake done, `http/1.1` negotiated).
    async fn connect(&self) -> Client {
        let tcp = TcpStream::connect(self.addr).await.unwrap();
        let s: Box<dyn Io> = match &self.tls {
            None => Box::new(tcp),
            Some(connector) => {
                let name = ServerName::try_from("localhost").unwrap();
                let tls = connector.connect(name, tcp).await.unwrap();
                assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
                Box::new(tls)
            }
        };
        Client { s, buf: Vec::new() }
    }
}

struct Proxy {
    handle: keel_proxy::ProxyHandle,
    /// The plain listener, then the TLS one.
    fronts: [Front; 2],
    _pki: Pki,
}

impl Proxy {
    /// A plain listener and a TLS listener, each with `listener_extra` lines, on one cluster
    /// over `upstreams` with `cluster_extra` lines. No retries.
    /// (No `x-request-id` is made: these tests compare the bytes endpoints get, and
    /// `hostile_requests.rs` checks the id.)
    async fn start(upstreams: &[SocketAddr], listener_extra: &str, cluster_extra: &str) -> Self {
        let pki = Pki::generate();
        let eps: Vec<String> = upstreams
            .iter()
            .map(|a| format!("{{ address = \"{a}\" }}"))
            .collect();
        let text = format!(
            r#"
[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
generate_request_id = false
{listener_extra}

[[listener]]
listen = "127.0.0.1:0"
cluster = "app"
generate_request_id = false
{listener_extra}
[listener.tls]
cert = {}
key = {}

[[cluster]]
name = "app"
response_headers = {{ endpoint = true }}
endpoints = [{}]
{cluster_extra}
[cluster.retry]
attempts = 0
"#,
            pki.toml("server.pem"),
            pki.toml("server.key"),
            eps.join(", ")
        );
        let cfg = ProxyConfig::from_toml_str(&text, "h1_path.toml")
            .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"));
        let handle = keel_proxy::start(cfg).await.unwrap();
        let a = handle.listener_addrs();
        let fronts = [
            Front {
                name: "plain",
                addr: a[0],
                tls: None,
            },
            Front {
                name: "tls",
                addr: a[1],
                tls: Some(pki.connector()),
            },
        ];
        Self {
            handle,
            fronts,
            _pki: pki,
        }
    }

    fn failures(&self) -> u64 {
        self.handle.cluster_status("app").unwrap()[0].failures
    }

    async fn shutdown(self) {
        self.handle.shutdown(Duration::from_secs(1)).await;
    }
}

/// One request on a new connection; the response and whether the connection stayed open
/// (checked: open means a second request on it is answered, closed means EOF).
async fn one_shot(front: &Front, raw: &[u8]) -> (Result<Resp, String>, Option<bool>) {
    let head_req = raw.starts_with(b"HEAD ");
    let http10 = first_line(raw).ends_with("HTTP/1.0");
    let mut c = front.connect().await;
    c.send(raw).await;
    let r = c.response(head_req, http10).await;
    let open = match &r {
        Err(_) => None,
        Ok(resp) if resp.announces_open(http10) => {
            let follow = if http10 {
                &b"GET /after HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"[..]
            } else {
                b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n"
            };
            c.send(follow).await;
            let after = c.response(false, http10).await;
            Some(matches!(after, Ok(a) if a.status == 200 && a.body == b"after"))
        }
        Ok(_) => Some(!c.closes().await),
    };
    (r, open)
}

fn first_line(raw: &[u8]) -> String {
    let end = raw
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// The echo upstream: answers every request with the bytes it received (`/after`: `after`);
/// a HEAD gets their length and no body.
fn echo_handler() -> Handler {
    Arc::new(|req: &Seen| {
        if req.path() == "/after" {
            return Reply::keep(ok_with(b"after"));
        }
        let raw = req.raw();
        let mut bytes = head(
            "HTTP/1.1 200 OK",
            &[
                &format!("Content-Length: {}", raw.len()),
                "Content-Type: text/plain",
                "X-Up: echo",
            ],
        )
        .into_bytes();
        if req.method != "HEAD" {
            bytes.extend_from_slice(&raw);
        }
        Reply::keep(bytes)
    })
}

/// What keel sends a client for the echo upstream's answer to `received`: exact bytes. (The
/// answer to a HEAD keeps the endpoint's `Content-Length` where it was: it describes the
/// body a GET would get; other answers get keel's own after `x-keel-endpoint`.)
fn echo_forwarded(ep: &str, received: &[u8], head_req: bool, connection: &str) -> Vec<u8> {
    let n = received.len();
    let connection = connection_line(connection);
    if head_req {
        return format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nContent-Type: text/plain\r\nX-Up: echo\r\nx-keel-endpoint: {ep}\r\n{connection}\r\n"
        )
        .into_bytes();
    }
    let mut v = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Up: echo\r\nx-keel-endpoint: {ep}\r\ncontent-length: {n}\r\n{connection}\r\n"
    )
    .into_bytes();
    v.extend_from_slice(received);
    v
}

/// The `X-Forwarded-*` lines keel writes for an untrusted client on loopback.
fn forwarded(proto: &str, host: Option<&str>) -> String {
    let mut s = format!("x-forwarded-for: 127.0.0.1\r\nx-forwarded-proto: {proto}\r\n");
    if let Some(h) = host {
        s.push_str(&format!("x-forwarded-host: {h}\r\n"));
    }
    s
}

// ---------------------------------------------------------------------------------------
// 1. Requests forwarded: the exact bytes upstream, the exact answer, the connection.

/// A request of the corpus: its bytes, what the upstream must receive (`{P}`: the
/// listener's `x-forwarded-proto`, `{EP}`: the endpoint's address) and the `connection`
/// header keel must answer with (empty: none; `close`: the connection then closes).
struct Case {
    name: &'static str,
    request: Vec<u8>,
    upstream: String,
    connection: &'static str,
}

fn corpus() -> Vec<Case> {
    let f = |host: Option<&str>| forwarded("{P}", host);
    let fh = f(Some("h"));
    let long_path = format!("/long/{}?{}", "p".repeat(3000), "q=1&".repeat(200));
    let put_body = "x".repeat(5000);
    let case = |name, request: &[u8], upstream: String, connection| Case {
        name,
        request: request.to_vec(),
        upstream,
        connection,
    };
    vec![
        case(
            "plain GET",
            b"GET /plain HTTP/1.1\r\nHost: app.example\r\nUser-Agent: t/1\r\nAccept: */*\r\n\r\n",
            format!(
                "GET /plain HTTP/1.1\r\nHost: app.example\r\nUser-Agent: t/1\r\nAccept: */*\r\n{}\r\n",
                f(Some("app.example"))
            ),
            "",
        ),
        case(
            "query string",
            b"GET /q?a=1&b=%20x&c HTTP/1.1\r\nHost: h:8080\r\n\r\n",
            format!(
                "GET /q?a=1&b=%20x&c HTTP/1.1\r\nHost: h:8080\r\n{}\r\n",
                f(Some("h:8080"))
            ),
            "",
        ),
        case(
            "long target",
            format!("GET {long_path} HTTP/1.1\r\nHost: h\r\n\r\n").as_bytes(),
            format!("GET {long_path} HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "Connection-named and hop-by-hop headers",
            b"GET /conn HTTP/1.1\r\nHost: h\r\nConnection: x-a, close\r\nX-A: secret\r\nX-B: kept\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: websocket\r\nProxy-Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\nTrailer: X-T\r\n\r\n",
            format!("GET /conn HTTP/1.1\r\nHost: h\r\nX-B: kept\r\n{fh}\r\n"),
            "close",
        ),
        case(
            "Connection keep-alive and an option",
            b"GET /ka HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, X-Drop\r\nx-drop: 1\r\n\r\n",
            format!("GET /ka HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "two Connection headers",
            b"GET /conn2 HTTP/1.1\r\nHost: h\r\nConnection: x-one\r\nConnection: x-two\r\nX-One: 1\r\nX-Two: 2\r\nX-Three: 3\r\n\r\n",
            format!("GET /conn2 HTTP/1.1\r\nHost: h\r\nX-Three: 3\r\n{fh}\r\n"),
            "",
        ),
        case(
            "existing X-Forwarded-* from an untrusted client",
            b"GET /xff HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2, 10.0.0.3\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: spoofed.example\r\n\r\n",
            format!("GET /xff HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "absolute-form without Host",
            b"GET http://abs.example:1/p?q HTTP/1.1\r\n\r\n",
            format!(
                "GET /p?q HTTP/1.1\r\nhost: abs.example:1\r\n{}\r\n",
                f(Some("abs.example:1"))
            ),
            "",
        ),
        case(
            // The target's authority replaces `Host` (RFC 9112 section 3.2.2).
            "absolute-form with the same Host",
            b"GET http://abs.example:1/p?q HTTP/1.1\r\nHost: abs.example:1\r\n\r\n",
            format!(
                "GET /p?q HTTP/1.1\r\nhost: abs.example:1\r\n{}\r\n",
                f(Some("abs.example:1"))
            ),
            "",
        ),
        case(
            "absolute-form, empty path",
            b"GET http://abs.example HTTP/1.1\r\nHost: abs.example\r\n\r\n",
            format!(
                "GET / HTTP/1.1\r\nhost: abs.example\r\n{}\r\n",
                f(Some("abs.example"))
            ),
            "",
        ),
        case(
            "HTTP/1.0 without Host",
            b"GET /ten HTTP/1.0\r\nUser-Agent: old\r\n\r\n",
            format!(
                "GET /ten HTTP/1.1\r\nUser-Agent: old\r\n{}host: {{EP}}\r\n\r\n",
                f(None)
            ),
            "close",
        ),
        case(
            "HTTP/1.0 without Host, spoofed X-Forwarded-Host",
            b"GET /ten-spoof HTTP/1.0\r\nX-Forwarded-Host: spoofed.example\r\n\r\n",
            format!("GET /ten-spoof HTTP/1.1\r\n{}host: {{EP}}\r\n\r\n", f(None)),
            "close",
        ),
        case(
            "HTTP/1.0 keep-alive",
            b"GET /ten-ka HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n",
            format!("GET /ten-ka HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "keep-alive",
        ),
        case(
            "HTTP/1.0 POST",
            b"POST /ten-post HTTP/1.0\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc",
            format!("POST /ten-post HTTP/1.1\r\nHost: h\r\n{fh}content-length: 3\r\n\r\nabc"),
            "close",
        ),
        case(
            "HEAD",
            b"HEAD /head HTTP/1.1\r\nHost: h\r\n\r\n",
            format!("HEAD /head HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "POST with a body",
            b"POST /post HTTP/1.1\r\nHost: h\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n\r\nhello world",
            format!(
                "POST /post HTTP/1.1\r\nHost: h\r\nContent-Type: text/plain\r\n{fh}content-length: 11\r\n\r\nhello world"
            ),
            "",
        ),
        case(
            "PUT with 5000 bytes",
            format!("PUT /put HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\n\r\n{put_body}")
                .as_bytes(),
            format!("PUT /put HTTP/1.1\r\nHost: h\r\n{fh}content-length: 5000\r\n\r\n{put_body}"),
            "",
        ),
        case(
            "POST Content-Length 0",
            b"POST /post0 HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
            format!("POST /post0 HTTP/1.1\r\nHost: h\r\n{fh}content-length: 0\r\n\r\n"),
            "",
        ),
        case(
            "DELETE",
            b"DELETE /item/7 HTTP/1.1\r\nHost: h\r\n\r\n",
            format!("DELETE /item/7 HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "PATCH with a body",
            b"PATCH /item/7 HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\n{}",
            format!("PATCH /item/7 HTTP/1.1\r\nHost: h\r\n{fh}content-length: 2\r\n\r\n{{}}"),
            "",
        ),
        case(
            "extension method",
            b"PURGE /cache HTTP/1.1\r\nHost: h\r\n\r\n",
            format!("PURGE /cache HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "OPTIONS *",
            b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
            format!("OPTIONS * HTTP/1.1\r\nHost: h\r\n{fh}\r\n"),
            "",
        ),
        case(
            "repeated headers",
            b"GET /rep HTTP/1.1\r\nHost: h\r\nAccept: a/a\r\nX-Rep: 1\r\nAccept: b/b\r\nX-Rep: 2\r\nCookie: a=1\r\nCookie: b=2\r\n\r\n",
            format!(
                "GET /rep HTTP/1.1\r\nHost: h\r\nAccept: a/a\r\nX-Rep: 1\r\nAccept: b/b\r\nX-Rep: 2\r\nCookie: a=1\r\nCookie: b=2\r\n{fh}\r\n"
            ),
            "",
        ),
        case(
            "odd but valid values",
            b"GET /odd HTTP/1.1\r\nHost: h\r\nX-Empty:\r\nX-Pad: \t v v \r\nX-MiXeD-CaSe: V\r\nX-Utf8: caf\xc3\xa9\r\n\r\n",
            format!(
                "GET /odd HTTP/1.1\r\nHost: h\r\nX-Empty: \r\nX-Pad: v v\r\nX-MiXeD-CaSe: V\r\nX-Utf8: caf\u{e9}\r\n{fh}\r\n"
            ),
            "",
        ),
        // RFC 9112 section 2.2: a recipient MAY take a bare LF as a line end; keel does, and
        // sends CRLF on.
        case(
            "bare LF line ends",
            b"GET /lf HTTP/1.1\nHost: h\nX-A: 1\n\n",
            format!("GET /lf HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n{fh}\r\n"),
            "",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_forwarded_as_expected() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    let corpus = corpus();
    assert_eq!(corpus.len(), 25);
    let mut wrong = Vec::new();
    for front in &proxy.fronts {
        for case in &corpus {
            let what = format!("{}, {}", front.name, case.name);
            let head_req = case.request.starts_with(b"HEAD ");
            let before = up.seen().len();
            let (resp, open) = one_shot(front, &case.request).await;
            let resp = resp.unwrap_or_else(|e| panic!("{what}: {e}"));
            let saw = up.seen_since(before);
            assert_eq!(saw.len(), 1, "{what}: {:?}", up.seen_paths());
            let expected_up = case
                .upstream
                .replace("{P}", front.proto())
                .replace("{EP}", &ep);
            let got_up = String::from_utf8_lossy(&saw[0].raw()).into_owned();
            if got_up != expected_up {
                wrong.push(format!(
                    "{what}: the upstream received\n{got_up:?}\nexpected\n{expected_up:?}"
                ));
            }
            let expected = echo_forwarded(&ep, expected_up.as_bytes(), head_req, case.connection);
            if resp.raw != expected {
                wrong.push(format!(
                    "{what}: the client got\n{:?}\nexpected\n{:?}",
                    resp.text(),
                    String::from_utf8_lossy(&expected)
                ));
            }
            assert_eq!(
                open,
                Some(case.connection != "close"),
                "{what}: connection open?\n{}",
                resp.head_text()
            );
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    assert_eq!(proxy.failures(), 0);
    proxy.shutdown().await;
}

/// RFC 9112 section 3.2.2: a request in absolute form names its host in the target; "a
/// proxy that forwards such a request MUST generate a new Host field value based on the
/// received request-target rather than forward the received Host field value" (and an origin
/// server MUST ignore the received Host). keel forwarded the client's `Host` (`exchange/rewrite.rs`,
/// `rewrite`: `(Some(h), _) => Some(h)`), so the endpoint and `x-forwarded-host` see another
/// host than the one the target names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_s_authority_wins_over_host() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    for front in &proxy.fronts {
        let before = up.seen().len();
        let (resp, _) = one_shot(
            front,
            b"GET http://abs.example/p HTTP/1.1\r\nHost: other.example\r\n\r\n",
        )
        .await;
        assert_eq!(resp.unwrap().status, 200);
        let head = up.seen_since(before)[0].head_text();
        let hosts: Vec<&str> = head
            .lines()
            .filter(|l| l.to_ascii_lowercase().starts_with("host:"))
            .collect();
        assert!(
            hosts.len() == 1
                && hosts[0][5..].trim() == "abs.example"
                && head.contains("x-forwarded-host: abs.example\r\n")
                && !head.contains("other.example"),
            "{}: the upstream received\n{head:?}",
            front.name
        );
    }
    proxy.shutdown().await;
}

/// `X-Forwarded-For` from a client in `trusted_proxies` is kept (every such header, in
/// order) and the client's address appended; from any other client it is replaced (the
/// corpus above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxy_s_x_forwarded_for_is_appended_to() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "trusted_proxies = [\"127.0.0.0/8\"]", "").await;
    for front in &proxy.fronts {
        let before = up.seen().len();
        let (resp, open) = one_shot(
            front,
            b"GET /xff HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2, 10.0.0.3\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: spoofed.example\r\n\r\n",
        )
        .await;
        assert_eq!(resp.unwrap().status, 200);
        assert_eq!(open, Some(true));
        let saw = up.seen_since(before);
        assert_eq!(
            saw[0].head_text(),
            format!(
                "GET /xff HTTP/1.1\r\nHost: h\r\nx-forwarded-for: 10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.1\r\nx-forwarded-proto: {}\r\nx-forwarded-host: h\r\n\r\n",
                front.proto()
            ),
            "{}",
            front.name
        );
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 2. Response framings.

/// The chunked body of `/chunked`: extensions, a trailer; decodes to `hello world!`.
const CHUNKED: &str =
    "5;name=value\r\nhello\r\n1;a=b;c\r\n \r\n6\r\nworld!\r\n0\r\nX-Sum: 42\r\n\r\n";

/// The chunked body of `/chunked-big`: 100 chunks of 1000 bytes.
fn big_chunked_body() -> (Vec<u8>, Vec<u8>) {
    let mut raw = Vec::new();
    let mut data = Vec::new();
    for i in 0..100u8 {
        let piece = vec![b'a' + i % 26; 1000];
        raw.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        raw.extend_from_slice(&piece);
        raw.extend_from_slice(b"\r\n");
        data.extend_from_slice(&piece);
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    (raw, data)
}

/// Scripted answers by path (anything else: the echo).
fn framing_handler() -> Handler {
    let echo = echo_handler();
    Arc::new(move |req: &Seen| match req.path() {
        "/cl" => Reply::keep(ok_with(b"hello framing")),
        "/chunked" => Reply::keep(
            head(
                "HTTP/1.1 200 OK",
                &["Transfer-Encoding: chunked", "Trailer: X-Sum", "X-Up: yes"],
            ) + CHUNKED,
        ),
        "/chunked-big" => {
            let mut v = head(
                "HTTP/1.1 200 OK",
                &["Transfer-Encoding: chunked", "X-Up: yes"],
            )
            .into_bytes();
            v.extend_from_slice(&big_chunked_body().0);
            Reply::keep(v)
        }
        "/close10" => Reply::close(head("HTTP/1.0 200 OK", &["X-Up: yes"]) + "ends at close"),
        "/close11" => Reply::close(
            head("HTTP/1.1 200 OK", &["Connection: close", "X-Up: yes"]) + "ends at close",
        ),
        "/ten-cl" => {
            Reply::close(head("HTTP/1.0 200 OK", &["Content-Length: 5", "X-Up: yes"]) + "ten!!")
        }
        "/204" => Reply::keep(head("HTTP/1.1 204 No Content", &["X-Up: yes"])),
        "/304" => Reply::keep(head(
            "HTTP/1.1 304 Not Modified",
            &["ETag: \"v1\"", "Content-Length: 13", "X-Up: yes"],
        )),
        "/head-cl" => Reply::keep(head(
            "HTTP/1.1 200 OK",
            &["Content-Length: 1234", "X-Up: yes"],
        )),
        "/head-chunked" => Reply::keep(head(
            "HTTP/1.1 200 OK",
            &["Transfer-Encoding: chunked", "X-Up: yes"],
        )),
        "/1xx" => Reply::keep(
            head("HTTP/1.1 100 Continue", &[])
                + &head("HTTP/1.1 103 Early Hints", &["Link: </s.css>; rel=preload"])
                + &head("HTTP/1.1 200 OK", &["Content-Length: 5", "X-Up: yes"])
                + "final",
        ),
        "/hop" => Reply::keep(
            head(
                "HTTP/1.1 200 OK",
                &[
                    "Connection: x-secret, keep-alive",
                    "X-Secret: s",
                    "Keep-Alive: timeout=5",
                    "Proxy-Connection: keep-alive",
                    "X-Up: yes",
                    "Content-Length: 2",
                ],
            ) + "ok",
        ),
        "/reason" => Reply::keep(
            head(
                "HTTP/1.1 299 Fine Thanks",
                &["Content-Length: 2", "X-Up: yes"],
            ) + "ok",
        ),
        _ => echo(req),
    })
}

/// How keel must frame a response body to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// `content-length`, the body as it is.
    Length,
    /// The endpoint's chunks passed through as they are to HTTP/1.1 clients; the data only,
    /// until close, to HTTP/1.0 clients.
    Chunks,
    /// A body the endpoint ends by closing: chunked by keel to HTTP/1.1 clients (where the
    /// chunks fall depends on reads: the data is checked), until close to HTTP/1.0 clients.
    UntilClose,
    /// No body.
    Empty,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_framing_reaches_http11_and_http10_clients_as_expected() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    let (big_raw, big) = big_chunked_body();
    // (path, method, status line, the endpoint's headers keel keeps, framing, body data, body
    // as the endpoint chunked it)
    let ok = "HTTP/1.1 200 OK";
    let x_up = "X-Up: yes\r\n";
    let cases = vec![
        (
            "/cl",
            "GET",
            ok,
            x_up,
            Out::Length,
            b"hello framing".to_vec(),
            vec![],
        ),
        (
            "/chunked",
            "GET",
            ok,
            x_up,
            Out::Chunks,
            b"hello world!".to_vec(),
            CHUNKED.into(),
        ),
        ("/chunked-big", "GET", ok, x_up, Out::Chunks, big, big_raw),
        (
            "/close10",
            "GET",
            ok,
            x_up,
            Out::UntilClose,
            b"ends at close".to_vec(),
            vec![],
        ),
        (
            "/close11",
            "GET",
            ok,
            x_up,
            Out::UntilClose,
            b"ends at close".to_vec(),
            vec![],
        ),
        (
            "/ten-cl",
            "GET",
            ok,
            x_up,
            Out::Length,
            b"ten!!".to_vec(),
            vec![],
        ),
        (
            "/204",
            "GET",
            "HTTP/1.1 204 No Content",
            x_up,
            Out::Empty,
            vec![],
            vec![],
        ),
        (
            "/304",
            "GET",
            "HTTP/1.1 304 Not Modified",
            // RFC 9110 section 8.6: a 304 may keep the length of the response it stands for.
            "ETag: \"v1\"\r\nContent-Length: 13\r\nX-Up: yes\r\n",
            Out::Empty,
            vec![],
            vec![],
        ),
        (
            "/head-cl",
            "HEAD",
            ok,
            "Content-Length: 1234\r\nX-Up: yes\r\n",
            Out::Empty,
            vec![],
            vec![],
        ),
        (
            "/head-chunked",
            "HEAD",
            ok,
            x_up,
            Out::Empty,
            vec![],
            vec![],
        ),
        (
            "/1xx",
            "GET",
            ok,
            x_up,
            Out::Length,
            b"final".to_vec(),
            vec![],
        ),
        ("/hop", "GET", ok, x_up, Out::Length, b"ok".to_vec(), vec![]),
        (
            "/reason",
            "GET",
            "HTTP/1.1 299 Fine Thanks",
            x_up,
            Out::Length,
            b"ok".to_vec(),
            vec![],
        ),
    ];
    assert_eq!(cases.len(), 13);
    let clients = [
        ("HTTP/1.1", ""),
        ("HTTP/1.0", "Connection: keep-alive\r\n"),
        ("HTTP/1.0", ""),
    ];
    let mut wrong = Vec::new();
    let mut figures = Vec::new();
    for front in &proxy.fronts {
        for (path, method, status_line, kept, out, body, chunks) in &cases {
            for (version, extra) in clients {
                let http10 = version == "HTTP/1.0";
                if http10 && *out == Out::Chunks {
                    // See a_chunked_response_reaches_an_http10_client_with_one_head.
                    continue;
                }
                let what = format!("{}: {method} {path} {version} {extra:?}", front.name);
                let raw = format!("{method} {path} {version}\r\nHost: h\r\n{extra}\r\n");
                let (resp, open) = one_shot(front, raw.as_bytes()).await;
                let resp = resp.unwrap_or_else(|e| panic!("{what}: {e}"));
                // Keep-alive exactly when it is safe: always for HTTP/1.1 (a body without
                // length is chunked), for HTTP/1.0 only if asked and the length is known.
                let streamed = matches!(out, Out::Chunks | Out::UntilClose);
                let keep = !http10 || (!extra.is_empty() && !streamed);
                let connection = match (keep, http10) {
                    (false, _) => "connection: close\r\n",
                    (true, true) => "connection: keep-alive\r\n",
                    (true, false) => "",
                };
                let framing = match out {
                    Out::Length => format!("content-length: {}\r\n", body.len()),
                    Out::Chunks | Out::UntilClose if !http10 => {
                        "transfer-encoding: chunked\r\n".to_string()
                    }
                    _ => String::new(),
                };
                let expected_head = format!(
                    "{status_line}\r\n{kept}x-keel-endpoint: {ep}\r\n{framing}{connection}\r\n"
                );
                let expected_body: Option<&[u8]> = match out {
                    Out::Chunks if !http10 => Some(chunks.as_slice()),
                    Out::UntilClose if !http10 => None,
                    _ => Some(body.as_slice()),
                };
                let mut expected = expected_head.clone().into_bytes();
                expected.extend_from_slice(expected_body.unwrap_or_default());
                let exact = expected_body.is_some();
                if (exact && resp.raw != expected)
                    || (!exact && resp.head_text() != expected_head)
                    || &resp.body != body
                {
                    wrong.push(format!(
                        "{what}: the client got\n{:?}\nexpected\n{:?}",
                        resp.text(),
                        String::from_utf8_lossy(&expected)
                    ));
                }
                assert_eq!(open, Some(keep), "{what}: connection open?");
                if *path == "/chunked" && !http10 {
                    assert_eq!(resp.trailers, ["X-Sum: 42"], "{what}: trailers passed");
                }
                if front.name == "plain" {
                    figures.push(format!(
                        "{method} {path} {version} {}: {:?} body, open {:?}",
                        if extra.is_empty() { "" } else { "keep-alive" },
                        resp.framing,
                        open
                    ));
                }
            }
        }
    }
    eprintln!("response framings:\n  {}", figures.join("\n  "));
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    assert_eq!(proxy.failures(), 0);
    proxy.shutdown().await;
}

/// A chunked response to an HTTP/1.0 client: its data only, after one head, until the
/// close. keel writes the response head again before every run of data it decodes
/// (relay.rs, `relay_response`, `Framing::Chunked` when not `chunked_to_client`: `head` is
/// cleared only after the inner loop), so the client reads the head, then the status line
/// and headers again inside the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_response_reaches_an_http10_client_with_one_head() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    let (_, big) = big_chunked_body();
    for front in &proxy.fronts {
        for (path, data) in [("/chunked", &b"hello world!"[..]), ("/chunked-big", &big)] {
            for extra in ["Connection: keep-alive\r\n", ""] {
                let what = format!("{}: GET {path} HTTP/1.0 {extra:?}", front.name);
                let raw = format!("GET {path} HTTP/1.0\r\nHost: h\r\n{extra}\r\n");
                let (resp, open) = one_shot(front, raw.as_bytes()).await;
                let resp = resp.unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut expected = format!(
                    "HTTP/1.1 200 OK\r\nX-Up: yes\r\nx-keel-endpoint: {ep}\r\nconnection: close\r\n\r\n"
                )
                .into_bytes();
                expected.extend_from_slice(data);
                assert!(
                    resp.raw == expected,
                    "{what}: the client got {} bytes, {} expected; they start\n{:?}",
                    resp.raw.len(),
                    expected.len(),
                    &resp.text()[..resp.text().len().min(300)]
                );
                assert_eq!(open, Some(false), "{what}");
            }
        }
    }
    proxy.shutdown().await;
}

/// RFC 9110 section 6.6.1: "A recipient with a clock that receives a response message
/// without a Date header field MUST record the time it was received and append a
/// corresponding Date header field to the message's header section if it is cached or
/// forwarded downstream." keel adds its own after `x-keel-endpoint` (its own answers carry
/// one too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_response_without_date_gets_one() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    for front in &proxy.fronts {
        let (resp, _) = one_shot(front, b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n").await;
        let resp = resp.unwrap();
        assert!(
            resp.header("date").is_some() && resp.added_date.is_some(),
            "{}: {:?}",
            front.name,
            resp.text()
        );
    }
    proxy.shutdown().await;
}

/// RFC 9112 section 6.3: a response with both `Transfer-Encoding: chunked` and
/// `Content-Length` is delimited by the chunks; an intermediary that forwards it must drop the
/// `Content-Length` (a stale one beside the chunks would desynchronise the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_with_content_length_and_chunked_is_delimited_by_the_chunks() {
    let handler: Handler = Arc::new(|_: &Seen| {
        Reply::keep(
            head(
                "HTTP/1.1 200 OK",
                &["Content-Length: 50", "Transfer-Encoding: chunked"],
            ) + "2\r\nok\r\n0\r\n\r\n",
        )
    });
    let up = Upstream::start(handler).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let expected = format!(
        "HTTP/1.1 200 OK\r\nx-keel-endpoint: {}\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        up.ep()
    );
    for front in &proxy.fronts {
        let mut c = front.connect().await;
        for _ in 0..2 {
            c.send(b"GET /both HTTP/1.1\r\nHost: h\r\n\r\n").await;
            let r = c
                .response(false, false)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", front.name));
            assert_eq!(r.text(), expected, "{}", front.name);
        }
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 3. Pipelining.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    for front in &proxy.fronts {
        let name = front.name;
        let mut c = front.connect().await;
        c.send(
            b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n\
              HEAD /head-cl HTTP/1.1\r\nHost: h\r\n\r\n\
              POST /echo-post HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc\
              GET /chunked HTTP/1.1\r\nHost: h\r\n\r\n\
              GET /204 HTTP/1.1\r\nHost: h\r\n\r\n\
              HEAD /cl HTTP/1.1\r\nHost: h\r\n\r\n\
              GET /close11 HTTP/1.1\r\nHost: h\r\n\r\n\
              GET /cl HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        )
        .await;
        let echo = format!(
            "POST /echo-post HTTP/1.1\r\nHost: h\r\n{}content-length: 3\r\n\r\nabc",
            forwarded(front.proto(), Some("h"))
        );
        let x = format!("x-keel-endpoint: {ep}\r\n");
        let expected: [(bool, String); 8] = [
            (
                false,
                String::from_utf8(ok_with_forwarded(&ep, b"hello framing", "")).unwrap(),
            ),
            (
                true,
                format!("HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nX-Up: yes\r\n{x}\r\n"),
            ),
            (
                false,
                String::from_utf8(echo_forwarded(&ep, echo.as_bytes(), false, "")).unwrap(),
            ),
            (
                false,
                format!("HTTP/1.1 200 OK\r\nX-Up: yes\r\n{x}transfer-encoding: chunked\r\n\r\n{CHUNKED}"),
            ),
            (false, format!("HTTP/1.1 204 No Content\r\nX-Up: yes\r\n{x}\r\n")),
            (
                true,
                format!("HTTP/1.1 200 OK\r\nContent-Length: 13\r\nX-Up: yes\r\n{x}\r\n"),
            ),
            // Chunked by keel (where the chunks fall depends on reads): the head is checked.
            (
                false,
                format!("HTTP/1.1 200 OK\r\nX-Up: yes\r\n{x}transfer-encoding: chunked\r\n\r\n"),
            ),
            (
                false,
                String::from_utf8(ok_with_forwarded(&ep, b"hello framing", "close")).unwrap(),
            ),
        ];
        for (i, (head_req, bytes)) in expected.iter().enumerate() {
            let r = c
                .response(*head_req, false)
                .await
                .unwrap_or_else(|e| panic!("{name}: response {i}: {e}"));
            if i == 6 {
                assert_eq!(r.head_text(), *bytes, "{name}: response {i}");
                assert_eq!(r.body, b"ends at close", "{name}: response {i}");
            } else {
                assert_eq!(r.text(), *bytes, "{name}: response {i}");
            }
        }
        assert!(c.closes().await, "{name}: closed after `Connection: close`");
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 4. Request bodies that stream (chunked, or over 64 KiB) and `Expect: 100-continue`.

/// The request head keel sends upstream for a request with only `Host: h`, then `framing`
/// (e.g. `content-length: 5`).
fn up_head(method: &str, path: &str, proto: &str, framing: &str) -> String {
    format!(
        "{method} {path} HTTP/1.1\r\nHost: h\r\n{}{framing}\r\n\r\n",
        forwarded(proto, Some("h"))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_and_large_request_bodies_stream_through_keel_s_path() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    // Extensions and a trailer: keel decodes the chunks and frames the data again.
    let chunked_post = b"POST /chunked-up HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nX-T: 1\r\n\r\n";
    let large = format!(
        "POST /large-up HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\n{}",
        "z".repeat(100_000)
    );
    // A chunked body of 200 KB in 2000-byte chunks.
    let big_chunked: Vec<u8> = {
        let mut v =
            b"PUT /big-chunked HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for i in 0..100u8 {
            v.extend_from_slice(b"7d0\r\n");
            v.extend_from_slice(&[b'A' + i % 26; 2000]);
            v.extend_from_slice(b"\r\n");
        }
        v.extend_from_slice(b"0\r\n\r\n");
        v
    };
    let big_data: Vec<u8> = (0..100u8).flat_map(|i| [b'A' + i % 26; 2000]).collect();
    let echo_len = |r: &Resp| r.header("content-length").map(str::to_string);
    for front in &proxy.fronts {
        let name = front.name;
        let p = front.proto();
        let from = up.seen().len();
        // One at a time on one connection: GET, chunked POST, GET, large POST, chunked PUT, GET.
        let mut c = front.connect().await;
        c.send(b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n").await;
        assert_eq!(
            c.response(false, false).await.unwrap().body,
            b"hello framing"
        );
        c.send(chunked_post).await;
        let r = c.response(false, false).await.unwrap();
        assert_eq!(r.status, 200, "{name}");
        c.send(b"GET /chunked HTTP/1.1\r\nHost: h\r\n\r\n").await;
        assert_eq!(
            c.response(false, false).await.unwrap().body,
            b"hello world!"
        );
        c.send(large.as_bytes()).await;
        let r = c.response(false, false).await.unwrap();
        assert_eq!(r.status, 200, "{name}");
        assert_eq!(
            echo_len(&r),
            Some(
                (up_head("POST", "/large-up", p, "content-length: 100000").len() + 100_000)
                    .to_string()
            ),
            "{name}"
        );
        c.send(&big_chunked).await;
        let r = c.response(false, false).await.unwrap();
        assert_eq!(r.status, 200, "{name}");
        c.send(b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n").await;
        assert_eq!(
            c.response(false, false).await.unwrap().raw,
            ok_with_forwarded(&ep, b"hello framing", "")
        );

        let saw = up.seen_since(from);
        let paths: Vec<&str> = saw.iter().map(Seen::path).collect();
        assert_eq!(
            paths,
            [
                "/cl",
                "/chunked-up",
                "/chunked",
                "/large-up",
                "/big-chunked",
                "/cl"
            ],
            "{name}"
        );
        // The small chunked body: read whole, decoded (extensions and trailer gone) and sent
        // with its length.
        let up_chunked = &saw[1];
        assert_eq!(
            up_chunked.head_text(),
            up_head("POST", "/chunked-up", p, "content-length: 11"),
            "{name}"
        );
        assert!(!up_chunked.chunked, "{name}");
        assert_eq!(up_chunked.body, b"hello world", "{name}");
        assert!(up_chunked.trailers.is_empty(), "{name}: trailers forwarded");
        // Over 64 KiB with a length: forwarded with its length, every byte.
        let up_large = &saw[3];
        assert_eq!(
            up_large.head_text(),
            up_head("POST", "/large-up", p, "content-length: 100000"),
            "{name}"
        );
        assert!(up_large.body == "z".repeat(100_000).as_bytes(), "{name}");
        // A chunked body over 64 KiB: streamed, re-chunked without the client's extensions,
        // every byte.
        let up_big = &saw[4];
        let sizes = chunk_size_lines(&up_big.body_raw);
        assert!(
            sizes.iter().all(|l| !l.contains(';')) && sizes.last().map(String::as_str) == Some("0"),
            "{name}: chunk lines {sizes:?}"
        );
        assert_eq!(
            up_big.head_text(),
            up_head("PUT", "/big-chunked", p, "transfer-encoding: chunked"),
            "{name}"
        );
        assert!(
            up_big.chunked && up_big.body == big_data,
            "{name}: {} bytes",
            up_big.body.len()
        );

        // Either side of the largest body keel reads whole before forwarding (64 KiB): both
        // forwarded with their length, and the connection serves the next request.
        for n in [65_536, 65_537] {
            let mut c = front.connect().await;
            for _ in 0..2 {
                let from = up.seen().len();
                let req = format!(
                    "PUT /edge HTTP/1.1\r\nHost: h\r\nContent-Length: {n}\r\n\r\n{}",
                    "e".repeat(n)
                );
                c.send(req.as_bytes()).await;
                let r = c.response(false, false).await.unwrap();
                assert_eq!(r.status, 200, "{name} {n}");
                let saw = up.seen_since(from);
                assert_eq!(
                    saw[0].head_text(),
                    up_head("PUT", "/edge", p, &format!("content-length: {n}")),
                    "{name} {n}"
                );
                assert!(saw[0].body == "e".repeat(n).as_bytes(), "{name} {n}");
            }
        }

        // Trickled a few bytes at a time: chunk sizes, data and the end split across reads.
        let mut c = front.connect().await;
        let from = up.seen().len();
        for piece in chunked_post.chunks(3) {
            c.send(piece).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let r = c.response(false, false).await.unwrap();
        assert_eq!(r.status, 200, "{name}: trickled");
        let saw = up.seen_since(from);
        assert_eq!(
            (saw[0].head_text(), saw[0].body.as_slice()),
            (
                up_head("POST", "/chunked-up", p, "content-length: 11"),
                &b"hello world"[..]
            ),
            "{name}: trickled"
        );

        // The same, pipelined in one write: the chunked body's end is where the next request
        // starts.
        let mut c = front.connect().await;
        let mut all = b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n".to_vec();
        all.extend_from_slice(chunked_post);
        all.extend_from_slice(large.as_bytes());
        all.extend_from_slice(b"GET /cl HTTP/1.1\r\nHost: h\r\n\r\n");
        let from = up.seen().len();
        c.send(&all).await;
        for i in 0..4 {
            let r = c
                .response(false, false)
                .await
                .unwrap_or_else(|e| panic!("{name}: pipelined {i}: {e}"));
            assert_eq!(r.status, 200, "{name}: pipelined {i}");
            if i == 0 || i == 3 {
                assert_eq!(r.body, b"hello framing", "{name}: pipelined {i}");
            }
        }
        let saw = up.seen_since(from);
        assert_eq!(saw[1].body, b"hello world", "{name}");
        assert_eq!(saw[2].body.len(), 100_000, "{name}");
    }
    assert_eq!(proxy.failures(), 0);
    proxy.shutdown().await;
}

/// keel answers `Expect: 100-continue` itself (`HTTP/1.1 100 Continue` before it reads the
/// body, whether it reads the body whole or streams it) and does not forward `Expect`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_by_keel_before_the_body_is_read() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    let big = "c".repeat(100_000);
    // (what, head, body sent after the 100, upstream framing line, upstream body data)
    let cases = [
        (
            "read whole",
            "Content-Length: 5\r\n",
            b"12345".to_vec(),
            "content-length: 5",
            b"12345".to_vec(),
        ),
        (
            "over 64 KiB, streamed",
            "Content-Length: 100000\r\n",
            big.clone().into_bytes(),
            "content-length: 100000",
            big.clone().into_bytes(),
        ),
        (
            "chunked, read whole",
            "Transfer-Encoding: chunked\r\n",
            b"3\r\nabc\r\n0\r\n\r\n".to_vec(),
            "content-length: 3",
            b"abc".to_vec(),
        ),
        (
            "chunked over 64 KiB, streamed",
            "Transfer-Encoding: chunked\r\n",
            format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len()).into_bytes(),
            "transfer-encoding: chunked",
            big.clone().into_bytes(),
        ),
    ];
    for front in &proxy.fronts {
        let name = front.name;
        let mut c = front.connect().await;
        for (what, framing, body, up_framing, up_body) in &cases {
            let from = up.seen().len();
            c.send(
                format!("PUT /expect HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n{framing}\r\n")
                    .as_bytes(),
            )
            .await;
            let interim = c.read_exactly(25).await.unwrap();
            assert_eq!(
                String::from_utf8_lossy(&interim),
                "HTTP/1.1 100 Continue\r\n\r\n",
                "{name}, {what}"
            );
            c.send(body).await;
            let r = c.response(false, false).await.unwrap();
            assert!(r.interim.is_empty(), "{name}, {what}: a second 100");
            let saw = up.seen_since(from);
            assert_eq!(
                saw[0].head_text(),
                up_head("PUT", "/expect", front.proto(), up_framing),
                "{name}, {what}: Expect must not be forwarded"
            );
            assert!(saw[0].body == *up_body, "{name}, {what}");
            assert_eq!(r.status, 200, "{name}, {what}");
            assert_eq!(
                r.raw,
                echo_forwarded(&ep, &saw[0].raw(), false, ""),
                "{name}, {what}"
            );
        }
    }
    proxy.shutdown().await;
}

/// RFC 9110 section 10.1.1: "A server that receives a 100-continue expectation in an
/// HTTP/1.0 request MUST ignore that expectation", and section 15.2: "A server MUST NOT send
/// a 1xx response to an HTTP/1.0 client." keel sends `HTTP/1.1 100 Continue` to an HTTP/1.0
/// client that sent `Expect: 100-continue` (`front/h1/relay.rs` checks `expect_continue`,
/// which `exchange/rewrite.rs` set whatever the version).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http10_client_s_expect_is_ignored() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    for front in &proxy.fronts {
        let mut c = front.connect().await;
        c.send(b"PUT /expect10 HTTP/1.0\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            .await;
        // An HTTP/1.0 client does not wait: it sends its body a moment later.
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.send(b"12345").await;
        let r = c.response(false, true).await;
        let r = r.unwrap_or_else(|e| panic!("{}: {e}", front.name));
        assert_eq!(r.status, 200, "{}", front.name);
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 5. Pooled upstream connections.

/// Sends `method path` `n` times on one client connection, `gap` apart; every answer must
/// be a 200 with `body`.
async fn sequential(front: &Front, method: &str, path: &str, n: usize, gap: Duration, body: &[u8]) {
    let mut c = front.connect().await;
    for i in 0..n {
        let req = if method == "POST" {
            format!("POST {path} HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\ndata")
        } else {
            format!("{method} {path} HTTP/1.1\r\nHost: h\r\n\r\n")
        };
        c.send(req.as_bytes()).await;
        let r = c
            .response(false, false)
            .await
            .unwrap_or_else(|e| panic!("{} {method} {path} #{i}: {e}", front.name));
        assert_eq!(
            (r.status, r.body.as_slice()),
            (200, body),
            "{} {method} {path} #{i}: {}",
            front.name,
            r.text()
        );
        tokio::time::sleep(gap).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused_and_closed_ones_are_not_an_error() {
    let handler: Handler = Arc::new(|req: &Seen| match req.path() {
        "/bye" => Reply::close(
            head(
                "HTTP/1.1 200 OK",
                &["Content-Length: 3", "Connection: close"],
            ) + "bye",
        ),
        // Closes without saying so.
        "/bye-silent" => Reply::close(head("HTTP/1.1 200 OK", &["Content-Length: 3"]) + "bye"),
        // Sends more than its Content-Length: what follows must never be taken for the next
        // request's response.
        "/extra" => Reply::keep(
            head("HTTP/1.1 200 OK", &["Content-Length: 2"])
                + "ok"
                + &head("HTTP/1.1 200 OK", &["Content-Length: 5"])
                + "stale",
        ),
        _ => Reply::keep(ok_with(b"kept")),
    });
    let mut figures = Vec::new();
    // A proxy of its own for each listener: one pool per endpoint, whatever the listener.
    for f in 0..2 {
        let up = Upstream::start(handler.clone()).await;
        let proxy = Proxy::start(&[up.addr], "", "").await;
        let front = &proxy.fronts[f];
        let name = front.name;
        // Sequential requests on one client connection, then on new client connections:
        // one upstream connection for all of them. (A new client connection's request may
        // race the task that finishes the previous response and puts its upstream connection
        // back, which happens after the client has the last byte: hence the short pauses.)
        sequential(front, "GET", "/keep", 10, Duration::ZERO, b"kept").await;
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            sequential(front, "GET", "/keep", 1, Duration::ZERO, b"kept").await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        sequential(front, "POST", "/keep", 5, Duration::ZERO, b"kept").await;
        let used = up.accepts.load(SeqCst);
        assert_eq!(
            used, 1,
            "{name}: 18 sequential requests used {used} upstream connections"
        );

        // An upstream that closes after each response: no client error, one connection each.
        for path in ["/bye", "/bye-silent"] {
            let before = up.accepts.load(SeqCst);
            sequential(front, "GET", path, 10, Duration::from_millis(20), b"bye").await;
            sequential(front, "POST", path, 5, Duration::from_millis(20), b"bye").await;
            let used = up.accepts.load(SeqCst) - before;
            // The first `/bye` goes on the connection kept from `/keep`.
            let new = if path == "/bye" { 14 } else { 15 };
            assert_eq!(
                used, new,
                "{name} {path}: {used} new upstream connections for 15 requests"
            );
        }
        // Back to back: a GET may meet a connection whose close is still in flight; it is
        // sent again on a new one, never answered with an error.
        sequential(front, "GET", "/bye-silent", 20, Duration::ZERO, b"bye").await;

        // Bytes beyond a response's length: that connection is not reused.
        let before = up.accepts.load(SeqCst);
        let mut c = front.connect().await;
        for (path, body) in [
            ("/extra", &b"ok"[..]),
            ("/keep", b"kept"),
            ("/keep", b"kept"),
        ] {
            c.send(format!("GET {path} HTTP/1.1\r\nHost: h\r\n\r\n").as_bytes())
                .await;
            let r = c.response(false, false).await.unwrap();
            assert_eq!(r.body, body, "{name} {path}: {}", r.text());
        }
        assert_eq!(up.accepts.load(SeqCst) - before, 2, "{name}");
        assert_eq!(proxy.failures(), 0, "{name}");
        figures.push(format!("{name}: 1 upstream connection for 18 requests"));
        proxy.shutdown().await;
    }
    eprintln!("{}", figures.join("; "));
}

// ---------------------------------------------------------------------------------------
// 6. Large streamed responses, whole and cut.

const BIG: usize = 300_000;

fn big_body() -> Vec<u8> {
    (0..BIG).map(|i| b'a' + (i % 23) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_response_streams_whole_and_a_cut_one_is_never_complete() {
    let handler: Handler = Arc::new(|req: &Seen| {
        let body = big_body();
        match req.path() {
            "/big" => Reply::keep(ok_with(&body)),
            "/big-cut" => {
                let mut v =
                    head("HTTP/1.1 200 OK", &[&format!("Content-Length: {BIG}")]).into_bytes();
                v.extend_from_slice(&body[..BIG / 3]);
                Reply::close(v)
            }
            "/chunked-cut" => {
                let mut v = head("HTTP/1.1 200 OK", &["Transfer-Encoding: chunked"]).into_bytes();
                for piece in body[..BIG / 2].chunks(10_000) {
                    v.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                    v.extend_from_slice(piece);
                    v.extend_from_slice(b"\r\n");
                }
                Reply::close(v)
            }
            _ => Reply::keep(ok_with(b"small")),
        }
    });
    let up = Upstream::start(handler).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    for front in &proxy.fronts {
        let name = front.name;
        let mut c = front.connect().await;
        for _ in 0..2 {
            c.send(b"GET /big HTTP/1.1\r\nHost: h\r\n\r\n").await;
            let r = c.response(false, false).await.unwrap();
            assert!(
                r.raw == ok_with_forwarded(&ep, &big_body(), ""),
                "{name}: the 300 KB response differs: {}",
                r.head_text()
            );
        }
        for (path, framing) in [("/big-cut", "Content-Length"), ("/chunked-cut", "chunked")] {
            let before = proxy.failures();
            let mut c = front.connect().await;
            let start = Instant::now();
            c.send(format!("GET {path} HTTP/1.1\r\nHost: h\r\n\r\n").as_bytes())
                .await;
            let r = c.response(false, false).await;
            match &r {
                Err(e) => assert!(e.starts_with("closed"), "{name} {path}: {e}"),
                Ok(r) => panic!(
                    "{name} {path}: a cut {framing} body reached the client as complete: {} bytes",
                    r.body.len()
                ),
            }
            assert!(start.elapsed() < Duration::from_secs(2), "{name} {path}");
            assert!(
                crate::support::eventually(Duration::from_secs(2), || proxy.failures()
                    == before + 1)
                .await,
                "{name} {path}: endpoint failures {before} -> {}",
                proxy.failures()
            );
        }
        // A client that goes away in the middle of the body is not the endpoint's failure.
        let before = proxy.failures();
        let mut c = front.connect().await;
        c.send(b"GET /big HTTP/1.1\r\nHost: h\r\n\r\n").await;
        assert!(c.fill().await.unwrap(), "{name}: no answer to /big");
        drop(c);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            proxy.failures(),
            before,
            "{name}: a client gone mid-body blamed the endpoint"
        );
        // A client that goes away in the middle of its request body (read whole, or
        // streamed): not the endpoint's failure, and a body read whole is never forwarded.
        for (path, length) in [("/gone-inline", 50_000), ("/gone-streamed", 200_000)] {
            let before = proxy.failures();
            let mut c = front.connect().await;
            c.send(
                format!("PUT {path} HTTP/1.1\r\nHost: h\r\nContent-Length: {length}\r\n\r\n")
                    .as_bytes(),
            )
            .await;
            c.send(&vec![b'g'; 20_000]).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(c);
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(
                proxy.failures(),
                before,
                "{name} {path}: a client gone mid-request-body blamed the endpoint"
            );
            assert!(
                !up.seen_paths().iter().any(|p| p.starts_with("/gone")),
                "{name} {path}: an incomplete request was forwarded whole"
            );
        }
        // The proxy is fine afterwards.
        sequential(front, "GET", "/small", 2, Duration::ZERO, b"small").await;
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 7. Refusals, limits and timeouts.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_delivered_and_close_the_connection() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(
        &[up.addr],
        "max_request_body_bytes = 1024\nmax_header_bytes = 10000\nmax_headers = 20",
        "",
    )
    .await;
    let big_body = format!(
        "POST /too-big HTTP/1.1\r\nHost: h\r\nContent-Length: 200000\r\n\r\n{}",
        "b".repeat(200_000)
    );
    let big_chunked = format!(
        "POST /too-big-chunked HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n{}0\r\n\r\n",
        format!("200\r\n{}\r\n", "c".repeat(512)).repeat(4)
    );
    let many: String = (0..25).map(|i| format!("X-H{i}: v\r\n")).collect();
    let after = "GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n";
    // (what, bytes, status line, cause; the connection closes after each refusal, and what
    // followed the refused request is never forwarded)
    let corpus: Vec<(&str, String, &str, &str)> = vec![
        (
            "Content-Length over the body limit, body sent",
            big_body.clone(),
            "HTTP/1.1 413 Payload Too Large",
            "request body larger than max_request_body_bytes",
        ),
        (
            "Content-Length over the body limit, no body",
            "POST /too-big HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\n\r\n".into(),
            "HTTP/1.1 413 Payload Too Large",
            "request body larger than max_request_body_bytes",
        ),
        (
            "chunked body over the body limit",
            big_chunked + after,
            "HTTP/1.1 413 Payload Too Large",
            "request body larger than max_request_body_bytes",
        ),
        (
            "more than max_headers",
            format!("GET /many HTTP/1.1\r\nHost: h\r\n{many}\r\n{after}"),
            "HTTP/1.1 431 Request Header Fields Too Large",
            "more request headers than max_headers",
        ),
        (
            "malformed header",
            format!("GET /bad HTTP/1.1\r\nHost: h\r\nBad Name: v\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "malformed request head",
        ),
        (
            "invalid Content-Length",
            format!("POST /bad-cl HTTP/1.1\r\nHost: h\r\nContent-Length: 1x\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "invalid Content-Length",
        ),
        // RFC 9112 section 3.2 (HTTP/1.0 without Host and absolute form without Host are
        // forwarded: the corpus has them).
        (
            "HTTP/1.1 without Host",
            format!("GET /no-host HTTP/1.1\r\nAccept: */*\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "Host header missing (required since HTTP/1.1)",
        ),
        (
            "two Host headers",
            format!("GET /two-hosts HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "more than one Host header",
        ),
        // RFC 9112 section 6.3: a request smuggling vector, refused (as NGINX does).
        (
            "Content-Length then Transfer-Encoding",
            format!("POST /cl-te HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)",
        ),
        (
            "Transfer-Encoding then Content-Length",
            format!("POST /te-cl HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "both Content-Length and Transfer-Encoding (RFC 9112 section 6.3)",
        ),
        (
            "malformed chunked body",
            format!("POST /bad-chunks HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "the request body is malformed or was cut short",
        ),
        (
            "a transfer coding before chunked",
            format!("POST /gzip HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n{after}"),
            "HTTP/1.1 501 Not Implemented",
            "only the chunked transfer coding is supported",
        ),
        (
            "an expectation other than 100-continue",
            format!("PUT /teapot HTTP/1.1\r\nHost: h\r\nExpect: teapot\r\nContent-Length: 0\r\n\r\n{after}"),
            "HTTP/1.1 417 Expectation Failed",
            "only Expect: 100-continue is supported",
        ),
        (
            "HTTP/1.0 with Transfer-Encoding",
            format!("POST /te10 HTTP/1.0\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "Transfer-Encoding must end in chunked, and needs HTTP/1.1",
        ),
        // RFC 9112 section 5.2: obsolete line folding is refused or replaced; keel refuses.
        (
            "obsolete line folding",
            format!("GET /fold HTTP/1.1\r\nHost: h\r\nX-Fold: a\r\n b\r\n\r\n{after}"),
            "HTTP/1.1 400 Bad Request",
            "malformed request head",
        ),
        // RFC 9112 section 5.1: whitespace between a field name and the colon MUST be refused.
        (
            "space before the colon",
            format!("POST /space HTTP/1.1\r\nHost: h\r\nContent-Length : 5\r\n\r\nhello{after}"),
            "HTTP/1.1 400 Bad Request",
            "malformed request head",
        ),
        (
            "CONNECT",
            format!("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n{after}"),
            "HTTP/1.1 501 Not Implemented",
            "CONNECT is not supported (keel is a reverse proxy)",
        ),
    ];
    let at_limit = format!(
        "POST /at-limit HTTP/1.1\r\nHost: h\r\nContent-Length: 1024\r\n\r\n{}",
        "b".repeat(1024)
    );
    let mut failed = Vec::new();
    for front in &proxy.fronts {
        let name = front.name;
        for (what, bytes, status_line, cause) in &corpus {
            let expected = own_answer(status_line, None, "close", cause);
            // Twice: a refusal must reach the client even when the proxy closes with unread
            // bytes (a reset can destroy an answer not yet read).
            for round in 0..2 {
                let c = front.connect().await;
                let (mut rd, mut wr) = tokio::io::split(c.s);
                let bytes = bytes.clone();
                let writer = tokio::spawn(async move {
                    let _ = wr.write_all(bytes.as_bytes()).await;
                    let _ = wr.flush().await;
                    wr
                });
                let mut out = Vec::new();
                let read = tokio::time::timeout(IO_LIMIT, async {
                    let mut chunk = [0u8; 4096];
                    loop {
                        match rd.read(&mut chunk).await {
                            Ok(0) => return "closed",
                            Ok(n) => out.extend_from_slice(&chunk[..n]),
                            Err(_) => return "reset",
                        }
                    }
                })
                .await;
                let got = masked_date(&out);
                if got != expected || read.is_err() {
                    failed.push(format!(
                        "{name}, {what}, round {round}: {}, got\n{got:?}\nexpected\n{expected:?}",
                        read.unwrap_or("left open"),
                    ));
                }
                let _ = writer.await;
            }
        }
        let mut c = front.connect().await;
        c.send(at_limit.as_bytes()).await;
        let r = c.response(false, false).await.unwrap();
        assert_eq!(r.status, 200, "{name}: {}", r.text());
    }
    assert!(
        failed.is_empty(),
        "refusals not as expected:\n  {}",
        failed.join("\n  ")
    );
    let paths = up.seen_paths();
    assert_eq!(paths, ["/at-limit", "/at-limit"], "forwarded");
    assert_eq!(
        proxy.failures(),
        0,
        "a client's refusal counted against the endpoint"
    );
    proxy.shutdown().await;
}

/// `max_header_bytes` is the most bytes of a request head, beyond which the answer is 431,
/// however the head arrives (one read may bring more than the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_over_max_header_bytes_is_refused_however_it_arrives() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "max_header_bytes = 10000", "").await;
    let big_head = format!(
        "GET /big-head HTTP/1.1\r\nHost: h\r\nX-Big: {}\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n",
        "h".repeat(12_000)
    );
    let expected = own_answer(
        "HTTP/1.1 431 Request Header Fields Too Large",
        None,
        "close",
        "request head larger than max_header_bytes",
    );
    for front in &proxy.fronts {
        // In one write, and trickled in pieces of 1000 bytes.
        for piece in [big_head.len(), 1000] {
            let mut c = front.connect().await;
            for p in big_head.as_bytes().chunks(piece) {
                c.send(p).await;
            }
            let r = c.response(false, false).await.unwrap();
            assert_eq!(masked_date(&r.raw), expected, "{} {piece}", front.name);
            assert!(c.closes().await, "{} {piece}", front.name);
        }
    }
    assert!(up.seen().is_empty(), "forwarded: {:?}", up.seen_paths());
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_idle_timeout_cuts_a_body_that_stalls() {
    let handler: Handler = Arc::new(|req: &Seen| match req.path() {
        "/stall" => {
            // A promised megabyte, a tenth sent, then nothing (the connection stays open).
            let mut v = head("HTTP/1.1 200 OK", &["Content-Length: 1000000"]).into_bytes();
            v.extend_from_slice(&vec![b's'; 100_000]);
            Reply::keep(v)
        }
        _ => Reply::keep(ok_with(b"fine")),
    });
    let up = Upstream::start(handler).await;
    let proxy = Proxy::start(&[up.addr], "", "upstream_idle_timeout = \"600ms\"").await;
    for front in &proxy.fronts {
        let name = front.name;
        let before = proxy.failures();
        let mut c = front.connect().await;
        let start = Instant::now();
        c.send(b"GET /stall HTTP/1.1\r\nHost: h\r\n\r\n").await;
        let r = c.response(false, false).await;
        let took = start.elapsed();
        match r {
            Err(e) => assert!(
                e.starts_with("closed after 100000 of 1000000"),
                "{name}: {e}"
            ),
            Ok(r) => panic!("{name}: complete after a stall? {} bytes", r.body.len()),
        }
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_millis(2500),
            "{name}: cut after {took:?} (upstream_idle_timeout 600ms)"
        );
        assert!(
            crate::support::eventually(Duration::from_secs(2), || proxy.failures() == before + 1)
                .await,
            "{name}: the stall is the endpoint's failure"
        );
        sequential(front, "GET", "/fine", 1, Duration::ZERO, b"fine").await;
        eprintln!("{name}: stalled body cut after {took:?}");
    }
    proxy.shutdown().await;
}

/// A request body that stops arriving: each read of it has `header_read_timeout`. A streamed
/// body gets keel's 408 (the endpoint, which has the head, is not blamed); a body read whole
/// before forwarding is never forwarded; either way the connection closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_that_stalls_is_cut_after_client_idle_timeout() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "client_idle_timeout = \"300ms\"", "").await;
    let expected_408 = own_answer(
        "HTTP/1.1 408 Request Timeout",
        None,
        "close",
        "the request's body stalled: nothing arrived within client_idle_timeout",
    );
    for front in &proxy.fronts {
        let name = front.name;
        for (what, head, part) in [
            (
                "streamed, with a length",
                "PUT /stall-up HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\n",
                "s".repeat(1000),
            ),
            (
                "streamed, chunked",
                "PUT /stall-up HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
                format!("3e8\r\n{}\r\n", "s".repeat(1000)),
            ),
            (
                "read whole",
                "PUT /stall-inline HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\n\r\n",
                "s".repeat(1000),
            ),
        ] {
            let mut c = front.connect().await;
            let start = Instant::now();
            c.send(head.as_bytes()).await;
            c.send(part.as_bytes()).await;
            let mut got = Vec::new();
            while c.fill().await.unwrap_or(false) {
                got.append(&mut c.buf);
            }
            got.append(&mut c.buf);
            let took = start.elapsed();
            assert!(
                took >= Duration::from_millis(250) && took < Duration::from_millis(2000),
                "{name}, {what}: closed after {took:?} (client_idle_timeout 300ms)"
            );
            if what == "read whole" {
                // Closed with keel's 408 or without a word (both allowed, RFC 9110 section
                // 15.5.9), never forwarded.
                assert!(
                    got.is_empty() || masked_date(&got) == expected_408,
                    "{name}, {what}: {:?}",
                    String::from_utf8_lossy(&got)
                );
            } else {
                assert_eq!(masked_date(&got), expected_408, "{name}, {what}");
            }
        }
    }
    assert!(up.seen().is_empty(), "forwarded: {:?}", up.seen_paths());
    assert_eq!(
        proxy.failures(),
        0,
        "the client's stall blamed the endpoint"
    );
    proxy.shutdown().await;
}

/// A client that uploads a streamed body slowly (every read well within
/// `client_idle_timeout`) for longer than `request_timeout`: the time waiting on the client
/// never counts against the endpoint (the try's clock restarts from each piece of the body), so
/// the upload succeeds and the endpoint is not blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_not_held_against_the_endpoint() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "request_timeout = \"600ms\"").await;
    for front in &proxy.fronts {
        let before = proxy.failures();
        let mut c = front.connect().await;
        c.send(b"PUT /slow HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\n")
            .await;
        // 10 KB every 100 ms: a second for the whole body.
        for _ in 0..10 {
            if c.s.write_all(&[b'u'; 10_000]).await.is_err() || c.s.flush().await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let r = c.response(false, false).await;
        let answer = r.map(|r| r.text()).unwrap_or_else(|e| e);
        assert_eq!(
            proxy.failures(),
            before,
            "{}: the endpoint was blamed; the client got {answer:?}",
            front.name
        );
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "{}: a 1 s upload behind a 600 ms request timeout: {answer:?}",
            front.name
        );
    }
    proxy.shutdown().await;
}

/// A client that half-closes its side after writing its request (`shutdown(SHUT_WR)`, as
/// `nc -N` or some scripts do; over TLS, close_notify) is answered, then the connection
/// closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_after_its_request_is_answered() {
    let up = Upstream::start(framing_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    for front in &proxy.fronts {
        for path in ["/cl", "/chunked", "/close11"] {
            let mut c = front.connect().await;
            c.send(format!("GET {path} HTTP/1.1\r\nHost: h\r\n\r\n").as_bytes())
                .await;
            c.s.shutdown().await.unwrap();
            let r = c
                .response(false, false)
                .await
                .unwrap_or_else(|e| panic!("{} {path}: {e}", front.name));
            let chunked_head = format!(
                "HTTP/1.1 200 OK\r\nX-Up: yes\r\nx-keel-endpoint: {ep}\r\ntransfer-encoding: chunked\r\n\r\n"
            );
            match path {
                "/cl" => assert_eq!(r.raw, ok_with_forwarded(&ep, b"hello framing", "")),
                "/chunked" => assert_eq!(r.text(), format!("{chunked_head}{CHUNKED}")),
                // Chunked by keel: where the chunks fall depends on reads.
                _ => assert_eq!(
                    (r.head_text(), r.body.as_slice()),
                    (chunked_head, &b"ends at close"[..])
                ),
            }
            assert!(
                c.closes().await,
                "{} {path}: closed after the answer",
                front.name
            );
        }
    }
    proxy.shutdown().await;
}

/// RFC 9112 section 9.3: with the `close` option the connection does not persist, whatever
/// else `Connection` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_wins_over_keep_alive_on_http10() {
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    for front in &proxy.fronts {
        for conn in ["keep-alive, close", "close, keep-alive"] {
            let raw = format!("GET /ckc HTTP/1.0\r\nHost: h\r\nConnection: {conn}\r\n\r\n");
            let (r, open) = one_shot(front, raw.as_bytes()).await;
            let r = r.unwrap();
            assert_eq!(
                r.header("connection"),
                Some("close"),
                "{}, {conn}: {}",
                front.name,
                r.head_text()
            );
            assert_eq!(open, Some(false), "{}, {conn}", front.name);
        }
    }
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// 8. keel's own answers, and HTTP/2 with prior knowledge.

/// An endpoint that cannot be reached: a 502 of keel's own, with `date`, the brief cause by
/// default (no address, no system error) and the full one with `error_detail = "full"`; the
/// connection stays open when the request was read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_gets_keel_s_502_brief_or_full() {
    // A port with nothing behind it.
    let dead = std::net::TcpListener::bind(any_port())
        .unwrap()
        .local_addr()
        .unwrap();
    let ep = dead.to_string();
    for (detail, cause) in [
        ("", "cannot connect to an endpoint".to_string()),
        (
            "error_detail = \"full\"",
            format!("cannot connect to upstream {ep}: Connection refused (os error 111)"),
        ),
    ] {
        let proxy = Proxy::start(&[dead], detail, "").await;
        for front in &proxy.fronts {
            let what = format!("{} {detail:?}", front.name);
            let mut c = front.connect().await;
            for (request, connection, head_req) in [
                ("GET /a HTTP/1.1\r\nHost: h\r\n\r\n", "", false),
                (
                    "POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi",
                    "",
                    false,
                ),
                ("HEAD /c HTTP/1.1\r\nHost: h\r\n\r\n", "", true),
                (
                    "GET /d HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n",
                    "keep-alive",
                    false,
                ),
                (
                    "GET /e HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
                    "close",
                    false,
                ),
            ] {
                c.send(request.as_bytes()).await;
                let http10 = request.contains("HTTP/1.0");
                let r = c
                    .response(head_req, http10)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut expected =
                    own_answer("HTTP/1.1 502 Bad Gateway", Some(&ep), connection, &cause);
                if head_req {
                    expected.truncate(expected.find("\r\n\r\n").unwrap() + 4);
                }
                assert_eq!(masked_date(&r.raw), expected, "{what}: {request:?}");
            }
            assert!(c.closes().await, "{what}");
            // A streamed body that the failed try never read: the connection cannot carry
            // another request, so it closes.
            let mut c = front.connect().await;
            c.send(b"PUT /f HTTP/1.1\r\nHost: h\r\nContent-Length: 100000\r\n\r\n")
                .await;
            let r = c
                .response(false, false)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(
                masked_date(&r.raw),
                own_answer("HTTP/1.1 502 Bad Gateway", Some(&ep), "close", &cause),
                "{what}: streamed body"
            );
            assert!(c.closes().await, "{what}: streamed body");
        }
        proxy.shutdown().await;
    }
}

/// HTTP/2's connection preface on the plain listener (prior knowledge, RFC 9113 section
/// 3.3): the connection goes to the HTTP/2 front end, whose requests reach the upstream as
/// HTTP/1.1 by the same rewrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_prior_knowledge_on_the_plain_listener_goes_to_the_http2_front_end() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let up = Upstream::start(echo_handler()).await;
    let proxy = Proxy::start(&[up.addr], "", "").await;
    let ep = up.ep();
    let tcp = TcpStream::connect(proxy.fronts[0].addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    for (method, body) in [("GET", ""), ("POST", "hello")] {
        let from = up.seen().len();
        let req = hyper::Request::builder()
            .method(method)
            .uri("http://h2.example/p2?x=1")
            .header("x-h2", "yes")
            .header("content-length", body.len().to_string())
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let resp = tokio::time::timeout(IO_LIMIT, sender.send_request(req))
            .await
            .expect("no HTTP/2 answer")
            .unwrap();
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()
                .get("x-keel-endpoint")
                .unwrap()
                .to_str()
                .unwrap(),
            ep
        );
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        let saw = up.seen_since(from);
        let expected = format!(
            "{method} /p2?x=1 HTTP/1.1\r\nx-h2: yes\r\nhost: h2.example\r\n{}content-length: {}\r\n\r\n{body}",
            forwarded("http", Some("h2.example")),
            body.len()
        );
        assert_eq!(String::from_utf8_lossy(&saw[0].raw()), expected);
        assert_eq!(&got[..], expected.as_bytes(), "the echo");
    }
    proxy.shutdown().await;
}
