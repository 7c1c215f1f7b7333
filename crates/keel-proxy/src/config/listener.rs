//! `[[listener]]` and `[listener.tls]`: where clients connect and what the connections may do.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use keel_balance::{FieldPath, InvalidField, Problem};
use serde::Deserialize;

use crate::config::locate::{none, zero};
use crate::config::route::RouteConfig;

/// `[[listener]]`: one address that clients connect to; its routes choose the cluster of each
/// request, its `cluster` serves the requests no route matches.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to listen on (port 0 = an ephemeral port).
    pub listen: SocketAddr,
    /// What clients speak: `"http"` (default: HTTP/1.1 and HTTP/2), `"h3"` (the same, plus
    /// HTTP/3: as `h3 = true`) or `"tcp"` (bytes: each connection goes to one endpoint, picked
    /// when it opens and finished when it closes).
    #[serde(default)]
    pub protocol: ListenerProtocol,
    /// A TLS listener also serves HTTP/3 over QUIC, on the same port number (UDP), with the
    /// same certificates, and announces it on its HTTP/1.1 and HTTP/2 answers with
    /// `Alt-Svc: h3=":PORT"`. Default false.
    #[serde(default)]
    pub h3: bool,
    /// Name of the cluster that serves the requests no route matches. Required without
    /// routes; without it, a request no route matches gets `404`.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Routes (`[[listener.route]]`), tried in order; the first match wins.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
    /// Most client connections open at once; further clients wait in the kernel's accept
    /// queue until one closes. Default 10000.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Most bytes of a request's line and headers (HTTP/1.1; the header list for HTTP/2);
    /// beyond it the answer is `431`. At least 8192 (hyper's smallest read buffer). Default
    /// 65536.
    #[serde(default = "default_max_header_bytes")]
    pub max_header_bytes: usize,
    /// Most header lines in an HTTP/1.1 request; beyond it the answer is `431`. Default 100.
    #[serde(default = "default_max_headers")]
    pub max_headers: usize,
    /// Time allowed to receive a request's headers, counted from the moment the connection
    /// waits for a request; then the connection is closed. HTTP/1.1 only. Default 10 s.
    #[serde(
        default = "default_header_read_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed. Default 60 s.
    #[serde(
        default = "default_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub idle_timeout: Duration,
    /// Largest request body accepted, in bytes; larger ones get `413` (at once when
    /// `Content-Length` says so, else when the streamed body passes the limit). Unset: no
    /// limit.
    #[serde(default)]
    pub max_request_body_bytes: Option<u64>,
    /// Terminate TLS on this listener (`[listener.tls]`); plain TCP unless present.
    #[serde(default)]
    pub tls: Option<ListenerTlsConfig>,
    /// Clients whose `X-Forwarded-For` is believed (CIDR blocks, e.g. `["10.0.0.0/8"]`): keel
    /// appends the client's address to theirs. From any other client the header is replaced
    /// by the client's address, so a client cannot pass itself off as another. Default: none.
    #[serde(default)]
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Proxies in front of keel whose `X-Forwarded-For` entries are believed, the nearest (a
    /// peer in `trusted_proxies`) counted first: the client is the entry this many from the
    /// right of the header keel receives (the leftmost if it has fewer). With two proxies in
    /// front, `2`: of `a, b, c` from the nearest, `b` is the client. Default 1.
    #[serde(default = "one_hop")]
    pub trusted_hops: u8,
    /// Every connection starts with a PROXY protocol header (version 1 or 2, as HAProxy's
    /// `send-proxy`/`send-proxy-v2` sends), whose source address is the client's from then on:
    /// allow/deny, rate limits, `X-Forwarded-For`, the access log; before TLS on a TLS
    /// listener. Only peers in `trusted_proxies` may connect; others, and headers that are
    /// malformed or not whole within `header_read_timeout`, are closed. Default false.
    #[serde(default)]
    pub proxy_protocol: bool,
    /// Clients (IP addresses or CIDR blocks; behind `trusted_proxies`, the address they
    /// forward) this listener serves; others get `403` (a TCP listener closes their
    /// connection). Empty: everyone not denied.
    #[serde(default)]
    pub allow: Vec<crate::config::route::Cidr>,
    /// Clients this listener refuses. Where a client is in both lists, the longer (more
    /// specific) prefix decides; at equal length, `deny`.
    #[serde(default)]
    pub deny: Vec<crate::config::route::Cidr>,
    /// How much of a failure's cause keel's own answers (502, 503, 504) tell the client:
    /// `"brief"` (default: the kind of failure, no addresses, no system errors) or `"full"`
    /// (the endpoint's address and the error, as logged). Logs and metrics always have it all.
    #[serde(default)]
    pub error_detail: ErrorDetail,
    /// An upgraded HTTP/1.1 connection (WebSocket and the like) with no byte either way for
    /// this long is closed. Default 1 h.
    #[serde(
        default = "default_tunnel_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub tunnel_idle_timeout: Duration,
    /// A client that takes no byte of its response (or, HTTP/2, opens no window for it), or
    /// sends no byte of a request body it streams, for this long is cut: HTTP/1.1 closed,
    /// HTTP/2 connection closed; its endpoint connection and slots are released. Default 10 s.
    #[serde(
        default = "default_client_idle_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub client_idle_timeout: Duration,
    /// A request body must have arrived whole within this from the end of its head, plus one
    /// second per `request_body_min_rate` bytes received; else `408` (cause
    /// `request_body_timeout`). Bounds a slow upload, which holds an endpoint slot while it
    /// streams. Default 60 s.
    #[serde(
        default = "default_request_body_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub request_body_timeout: Duration,
    /// Bytes of request body a second that earn one more second beyond
    /// `request_body_timeout` (so a large upload at least this fast is never cut by it). `0`:
    /// `request_body_timeout` bounds the whole body. Default 1024.
    #[serde(default = "default_request_body_min_rate")]
    pub request_body_min_rate: u64,
    /// Requests without a usable `x-request-id` get one made by keel (UUID v4 form), passed
    /// to the endpoint and logged. `false`: the client's header passes as any other and none
    /// is made. Default true (Envoy's `generate_request_id`).
    #[serde(default = "yes")]
    pub generate_request_id: bool,
}

fn yes() -> bool {
    true
}

fn one_hop() -> u8 {
    1
}

/// Most `trusted_hops`.
pub const MAX_TRUSTED_HOPS: u8 = 16;

/// `protocol` of a listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ListenerProtocol {
    /// HTTP/1.1 and HTTP/2 (by ALPN or prior knowledge).
    #[default]
    Http,
    /// HTTP/1.1 and HTTP/2, and HTTP/3 over QUIC (as `h3 = true`).
    H3,
    /// TCP: bytes both ways between the client and one endpoint.
    Tcp,
}

/// `error_detail` of a listener.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorDetail {
    /// The kind of failure only.
    #[default]
    Brief,
    /// The endpoint's address and the error too.
    Full,
}

impl ListenerConfig {
    /// True if the listener serves HTTP/3 too (`h3 = true` or `protocol = "h3"`).
    pub fn serves_h3(&self) -> bool {
        self.h3 || self.protocol == ListenerProtocol::H3
    }

    /// True if `ip` is one of `trusted_proxies`.
    pub fn trusts(&self, ip: std::net::IpAddr) -> bool {
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }
}

/// `[listener.tls]`: the listener terminates TLS (HTTP/2 or HTTP/1.1, chosen by ALPN).
/// Relative paths are taken from the configuration file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTlsConfig {
    /// PEM file with the certificate chain, the server's certificate first. Served to clients
    /// whose SNI names none of `certificates` (and to clients that send no SNI).
    pub cert: PathBuf,
    /// PEM file with the certificate's private key (PKCS#8, PKCS#1 RSA or SEC1 EC).
    pub key: PathBuf,
    /// More certificates, each chosen when the name a client asks for (SNI) is one of its
    /// DNS names (exact, or under a `*.` wildcard); the first that matches wins.
    #[serde(default)]
    pub certificates: Vec<CertificateFiles>,
    /// PEM file with the CAs that clients' certificates must chain to: the listener asks for
    /// a client certificate (mutual TLS). Default: none asked.
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
    /// With `client_ca`: `"require"` (default) refuses a handshake without a valid client
    /// certificate; `"request"` lets clients without one in (a presented one must be valid).
    #[serde(default)]
    pub client_auth: ClientAuth,
    /// The oldest TLS version accepted: `"1.2"` (default) or `"1.3"`.
    #[serde(default)]
    pub min_version: TlsVersion,
    /// Cipher suites offered, in order of preference, by their IANA names (e.g.
    /// `"TLS13_AES_128_GCM_SHA256"`). Default: rustls's safe defaults.
    #[serde(default)]
    pub cipher_suites: Vec<String>,
}

/// A certificate chain and its key (`{ cert = "...", key = "..." }`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateFiles {
    /// PEM file with the certificate chain, the server's certificate first.
    pub cert: PathBuf,
    /// PEM file with its private key.
    pub key: PathBuf,
}

/// Whether a listener with `client_ca` requires a client certificate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    /// No handshake without a valid client certificate (NGINX `ssl_verify_client on`).
    #[default]
    Require,
    /// A client certificate is asked for, not required (NGINX `ssl_verify_client optional`).
    Request,
}

/// A TLS protocol version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum TlsVersion {
    /// TLS 1.2 and 1.3.
    #[default]
    #[serde(rename = "1.2")]
    Tls12,
    /// TLS 1.3 only.
    #[serde(rename = "1.3")]
    Tls13,
}

fn default_max_connections() -> usize {
    10_000
}
fn default_max_header_bytes() -> usize {
    65536
}
fn default_max_headers() -> usize {
    100
}
fn default_header_read_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_idle_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_tunnel_idle_timeout() -> Duration {
    Duration::from_secs(3600)
}
fn default_client_idle_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_request_body_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_request_body_min_rate() -> u64 {
    1024
}

/// hyper's smallest HTTP/1 read buffer, hence the smallest `max_header_bytes`.
pub const MIN_HEADER_BYTES: usize = 8192;

impl ListenerConfig {
    /// Checks the limits and the routes; paths are relative to the `[[listener]]`. The cluster
    /// it names is checked by [`crate::config::ProxyConfig::validate`], and the TLS files by the
    /// TLS component (`tls::check_listener`, called from there too).
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.max_connections == 0 {
            return Err(none("max_connections"));
        }
        if self.max_header_bytes < MIN_HEADER_BYTES || self.max_header_bytes > u32::MAX as usize {
            return Err(InvalidField::at(
                "max_header_bytes",
                Problem::out_of_range(
                    format!("within {MIN_HEADER_BYTES}..={}", u32::MAX),
                    self.max_header_bytes,
                ),
            ));
        }
        if self.max_headers == 0 {
            return Err(none("max_headers"));
        }
        if self.header_read_timeout.is_zero() {
            return Err(zero("header_read_timeout"));
        }
        if self.idle_timeout.is_zero() {
            return Err(zero("idle_timeout"));
        }
        if self.client_idle_timeout.is_zero() {
            return Err(zero("client_idle_timeout"));
        }
        if self.tunnel_idle_timeout.is_zero() {
            return Err(zero("tunnel_idle_timeout"));
        }
        if self.request_body_timeout.is_zero() {
            return Err(zero("request_body_timeout"));
        }
        if self.trusted_hops == 0 || self.trusted_hops > MAX_TRUSTED_HOPS {
            return Err(InvalidField::at(
                "trusted_hops",
                Problem::out_of_range(
                    format!(
                        "within 1..={MAX_TRUSTED_HOPS} (to believe no `X-Forwarded-For`, leave `trusted_proxies` empty)"
                    ),
                    self.trusted_hops,
                ),
            ));
        }
        if self.proxy_protocol && self.trusted_proxies.is_empty() {
            return Err(InvalidField::at(
                "proxy_protocol",
                Problem::Invalid(
                    "a PROXY protocol header is accepted only from `trusted_proxies`: list the proxies that send it".into(),
                ),
            ));
        }
        if self.serves_h3() {
            let key = if self.h3 { "h3" } else { "protocol" };
            let why = if self.protocol == ListenerProtocol::Tcp {
                Some("HTTP/3 is served by HTTP listeners, not `protocol = \"tcp\"`")
            } else if self.tls.is_none() {
                Some("HTTP/3 runs over QUIC, which needs TLS: give the listener `[listener.tls]`")
            } else if self.proxy_protocol {
                Some("QUIC datagrams carry no PROXY protocol header: HTTP/3 cannot be served on a `proxy_protocol` listener")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(InvalidField::at(key, Problem::Invalid(why.into())));
            }
        }
        if self.protocol == ListenerProtocol::Tcp {
            if !self.routes.is_empty() {
                return Err(InvalidField::at(
                    "route",
                    Problem::NotApplicable(
                        "a TCP listener has no requests to route: give it `cluster` only".into(),
                    ),
                ));
            }
            if self.cluster.is_none() {
                return Err(InvalidField::at(
                    "cluster",
                    Problem::Invalid("a TCP listener needs its `cluster`".into()),
                ));
            }
        }
        if self.routes.len() > usize::from(u16::MAX) {
            return Err(InvalidField::at(
                "route",
                Problem::out_of_range(format!("at most {} routes", u16::MAX), self.routes.len()),
            ));
        }
        for (j, r) in self.routes.iter().enumerate() {
            r.validate()
                .map_err(|e| e.under(FieldPath::key("route").at(j)))?;
        }
        Ok(())
    }
}

impl ListenerConfig {
    /// A plain-TCP listener on `listen` routed to `cluster`, other options at their defaults.
    pub fn new(listen: SocketAddr, cluster: impl Into<String>) -> Self {
        ListenerConfig {
            listen,
            cluster: Some(cluster.into()),
            routes: Vec::new(),
            protocol: ListenerProtocol::default(),
            h3: false,
            tunnel_idle_timeout: default_tunnel_idle_timeout(),
            client_idle_timeout: default_client_idle_timeout(),
            request_body_timeout: default_request_body_timeout(),
            request_body_min_rate: default_request_body_min_rate(),
            generate_request_id: true,
            max_connections: default_max_connections(),
            max_header_bytes: default_max_header_bytes(),
            max_headers: default_max_headers(),
            header_read_timeout: default_header_read_timeout(),
            idle_timeout: default_idle_timeout(),
            max_request_body_bytes: None,
            tls: None,
            trusted_proxies: Vec::new(),
            trusted_hops: one_hop(),
            proxy_protocol: false,
            allow: Vec::new(),
            deny: Vec::new(),
            error_detail: ErrorDetail::default(),
        }
    }
}
