//! TLS with rustls and its `ring` crypto provider: the listeners' server side
//! ([`server_config`]) and the connections to a cluster's endpoints ([`UpstreamTls`], used by
//! the pools of [`crate::upstream::pool`]).
//!
//! The crypto provider is passed to every config builder explicitly, so nothing depends on a
//! process-wide default provider being installed (or on which one).

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use std::collections::HashMap;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{CipherSuite, ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use keel_balance::{FieldPath, InvalidField, Problem};

use crate::config::cluster::{ClusterConfig, UpstreamTlsConfig};
use crate::config::listener::{ClientAuth, ListenerTlsConfig, TlsVersion};

pub use crate::config::cluster::{ALPN_H2, ALPN_HTTP11};

mod client_cert;
pub use client_cert::ClientCert;

/// The `ring` crypto provider, built once.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// A TLS setting that cannot be used: the key of its `tls` table and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("`{key}`: {problem}")]
pub struct TlsSettingError {
    /// The key in the `tls` table (`cert`, `key`, `ca`, `server_name`).
    pub key: &'static str,
    /// What is wrong.
    pub problem: TlsProblem,
}

/// What is wrong with a TLS setting.
#[derive(Debug, thiserror::Error)]
pub enum TlsProblem {
    /// Its PEM file cannot be read or holds nothing usable.
    #[error(transparent)]
    File(#[from] PemFileError),
    /// Its name is neither a DNS name nor an IP address.
    #[error(transparent)]
    ServerName(#[from] InvalidServerName),
    /// One entry of a list (`certificates`) is refused.
    #[error("[{index}]: {source}")]
    Entry {
        /// The entry's index.
        index: usize,
        /// What is wrong with it.
        #[source]
        source: Box<TlsProblem>,
    },
    /// Anything else (a key that does not match its certificate, an unknown cipher suite), in
    /// words.
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for TlsProblem {
    fn from(why: String) -> Self {
        TlsProblem::Invalid(why)
    }
}

impl TlsSettingError {
    fn new(key: &'static str, problem: impl Into<TlsProblem>) -> Self {
        Self {
            key,
            problem: problem.into(),
        }
    }

    /// The error at its key, relative to the `tls` table.
    fn into_field(self) -> InvalidField {
        InvalidField::at(self.key, Problem::Invalid(self.problem.to_string()))
    }
}

/// A PEM file (certificate, key, CA bundle) that cannot be used: which file, and why.
#[derive(Debug, thiserror::Error)]
pub enum PemFileError {
    /// The file cannot be read.
    #[error("cannot read `{}`: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Not a regular file (a device would be read forever, a FIFO would block the load).
    #[error("cannot read `{}`: not a regular file", path.display())]
    NotAFile {
        /// The file.
        path: PathBuf,
    },
    /// Larger than [`MAX_PEM_BYTES`].
    #[error("cannot read `{}`: larger than {MAX_PEM_BYTES} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// The PEM does not parse.
    #[error("`{}` is not valid PEM: {source}", path.display())]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// No certificate in the file.
    #[error(
        "no certificate in `{}` (expected PEM blocks `-----BEGIN CERTIFICATE-----`)",
        path.display()
    )]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// No private key in the file.
    #[error(
        "no private key in `{}` (expected a PEM block `PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`)",
        path.display()
    )]
    NoPrivateKey {
        /// The file.
        path: PathBuf,
    },
}

/// A host that cannot be verified against a certificate: neither a DNS name nor an IP address.
#[derive(Debug, thiserror::Error)]
#[error("`{host}` is neither a DNS name nor an IP address")]
pub struct InvalidServerName {
    /// The host (without an IPv6 address's brackets).
    pub host: String,
    /// rustls's refusal.
    #[source]
    pub source: rustls::pki_types::InvalidDnsNameError,
}

/// Largest PEM file read: certificate chains and CA bundles are kilobytes (a full public CA
/// bundle is about 200 KiB).
const MAX_PEM_BYTES: u64 = 1 << 20;

/// Reads a PEM file: a regular file (a device such as `/dev/zero` would be read forever and a
/// FIFO would block the load) of at most [`MAX_PEM_BYTES`].
fn read_file(path: &Path) -> Result<Vec<u8>, PemFileError> {
    use std::io::Read as _;
    let cannot = |source| PemFileError::Read {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(cannot)?;
    if !meta.is_file() {
        return Err(PemFileError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let mut data = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_BYTES + 1).read_to_end(&mut data))
        .map_err(cannot)?;
    if data.len() as u64 > MAX_PEM_BYTES {
        return Err(PemFileError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(data)
}

/// Every certificate of a PEM file, in file order.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemFileError> {
    let pem = read_file(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| PemFileError::Pem {
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PemFileError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 RSA or SEC1 EC).
pub fn load_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemFileError> {
    let pem = read_file(path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => PemFileError::NoPrivateKey {
            path: path.to_path_buf(),
        },
        source => PemFileError::Pem {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// The crypto provider of a listener: rustls's safe defaults, or only the `cipher_suites`
/// named, in their order.
fn listener_provider(names: &[String]) -> Result<Arc<CryptoProvider>, TlsSettingError> {
    let base = provider();
    if names.is_empty() {
        return Ok(base);
    }
    let mut suites = Vec::with_capacity(names.len());
    for name in names {
        let found = base
            .cipher_suites
            .iter()
            .find(|s| suite_names(s.suite()).any(|n| n.eq_ignore_ascii_case(name)))
            .ok_or_else(|| {
                let known: Vec<String> = base
                    .cipher_suites
                    .iter()
                    .map(|s| suite_names(s.suite()).collect::<Vec<_>>().join(" or "))
                    .collect();
                TlsSettingError::new(
                    "cipher_suites",
                    format!("unknown cipher suite `{name}`; known: {}", known.join(", ")),
                )
            })?;
        suites.push(*found);
    }
    Ok(Arc::new(CryptoProvider {
        cipher_suites: suites,
        ..(*base).clone()
    }))
}

/// The names a cipher suite goes by: IANA's (the registry's, e.g. `TLS_AES_128_GCM_SHA256`,
/// `TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256`), OpenSSL's where it differs
/// (`ECDHE-RSA-AES128-GCM-SHA256`), and rustls's where that differs (`TLS13_AES_128_GCM_SHA256`).
fn suite_names(suite: CipherSuite) -> impl Iterator<Item = String> {
    const OTHER: [(CipherSuite, &str, &str); 9] = [
        (
            CipherSuite::TLS13_AES_128_GCM_SHA256,
            "TLS_AES_128_GCM_SHA256",
            "",
        ),
        (
            CipherSuite::TLS13_AES_256_GCM_SHA384,
            "TLS_AES_256_GCM_SHA384",
            "",
        ),
        (
            CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
            "TLS_CHACHA20_POLY1305_SHA256",
            "",
        ),
        (
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            "",
            "ECDHE-ECDSA-AES128-GCM-SHA256",
        ),
        (
            CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            "",
            "ECDHE-ECDSA-AES256-GCM-SHA384",
        ),
        (
            CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            "",
            "ECDHE-ECDSA-CHACHA20-POLY1305",
        ),
        (
            CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            "",
            "ECDHE-RSA-AES128-GCM-SHA256",
        ),
        (
            CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            "",
            "ECDHE-RSA-AES256-GCM-SHA384",
        ),
        (
            CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            "",
            "ECDHE-RSA-CHACHA20-POLY1305",
        ),
    ];
    let rustls = format!("{suite:?}");
    let (iana, openssl) = OTHER
        .iter()
        .find(|(s, _, _)| *s == suite)
        .map_or(("", ""), |(_, i, o)| (*i, *o));
    // IANA's name first: rustls's is IANA's for TLS 1.2.
    let iana = if iana.is_empty() {
        rustls.clone()
    } else {
        iana.to_string()
    };
    let rustls = (rustls != iana).then_some(rustls);
    std::iter::once(iana)
        .chain((!openssl.is_empty()).then(|| openssl.to_string()))
        .chain(rustls)
}

/// A certificate chain and its key, loaded and checked to match.
fn certified_key(
    provider: &CryptoProvider,
    cert: &Path,
    key: &Path,
    keys: (&'static str, &'static str),
) -> Result<Arc<CertifiedKey>, TlsSettingError> {
    let certs = load_certs(cert).map_err(|m| TlsSettingError::new(keys.0, m))?;
    let der = load_private_key(key).map_err(|m| TlsSettingError::new(keys.1, m))?;
    let signing = provider.key_provider.load_private_key(der).map_err(|e| {
        TlsSettingError::new(
            keys.1,
            format!("unusable private key in `{}`: {e}", key.display()),
        )
    })?;
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| {
        let message = match e {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => format!(
                "the private key in `{}` does not match the certificate in `{}`",
                key.display(),
                cert.display()
            ),
            e => format!("unusable private key in `{}`: {e}", key.display()),
        };
        TlsSettingError::new(keys.1, message)
    })?;
    Ok(Arc::new(certified))
}

/// The certificate for a client's SNI: the first of a listener's `certificates` one of whose
/// DNS names is the name asked for (a `*.` wildcard covers one label), else the listener's
/// own `cert`. Names are read from each certificate once, at load.
#[derive(Debug)]
struct SniCertificates {
    default: Arc<CertifiedKey>,
    /// Exact names, lower-case, to the certificate.
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// The part after `*.` of wildcard names, lower-case.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
}

impl SniCertificates {
    fn add(&mut self, key: &Arc<CertifiedKey>) {
        let Some(leaf) = key.cert.first() else {
            return;
        };
        let Ok(parsed) = webpki::EndEntityCert::try_from(leaf) else {
            return;
        };
        for name in parsed.valid_dns_names() {
            let name = name.to_ascii_lowercase();
            match name.strip_prefix("*.") {
                Some(rest) => self.wildcard.entry(rest.to_string()),
                None => self.exact.entry(name),
            }
            .or_insert_with(|| key.clone());
        }
    }

    fn choose(&self, sni: &str) -> Option<&Arc<CertifiedKey>> {
        // rustls hands SNI over lower-case already (RFC 6066 host names are ASCII).
        self.exact.get(sni).or_else(|| {
            let (_, parent) = sni.split_once('.')?;
            self.wildcard.get(parent)
        })
    }
}

impl ResolvesServerCert for SniCertificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            hello
                .server_name()
                .and_then(|n| self.choose(n))
                .unwrap_or(&self.default)
                .clone(),
        )
    }
}

/// The server side of a TLS listener: its certificates (the default one and those chosen by
/// SNI), each checked to match its key; the client certificates it asks for (`client_ca`);
/// the versions and cipher suites it accepts; ALPN offering `h2` then `http/1.1`.
pub fn server_config(c: &ListenerTlsConfig) -> Result<Arc<ServerConfig>, TlsSettingError> {
    let provider = listener_provider(&c.cipher_suites)?;
    let versions: &[&rustls::SupportedProtocolVersion] = match c.min_version {
        TlsVersion::Tls12 => rustls::DEFAULT_VERSIONS,
        TlsVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| TlsSettingError::new("cipher_suites", e.to_string()))?;
    let builder = match &c.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let roots = root_store(ca, "client_ca")?;
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let verifier = match c.client_auth {
                ClientAuth::Require => verifier,
                ClientAuth::Request => verifier.allow_unauthenticated(),
            }
            .build()
            .map_err(|e| TlsSettingError::new("client_ca", e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut sni = SniCertificates {
        default: certified_key(&provider, &c.cert, &c.key, ("cert", "key"))?,
        exact: HashMap::new(),
        wildcard: HashMap::new(),
    };
    for (i, files) in c.certificates.iter().enumerate() {
        let key = certified_key(
            &provider,
            &files.cert,
            &files.key,
            ("certificates", "certificates"),
        )
        .map_err(|e| {
            TlsSettingError::new(
                "certificates",
                TlsProblem::Entry {
                    index: i,
                    source: Box::new(e.problem),
                },
            )
        })?;
        sni.add(&key);
    }
    let mut config = builder.with_cert_resolver(Arc::new(sni));
    config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// ALPN of HTTP/3.
pub const ALPN_H3: &[u8] = b"h3";

/// The QUIC side of a TLS listener that serves HTTP/3: its TCP side's TLS configuration (the
/// same certificates, client certificates and cipher suites; QUIC speaks TLS 1.3 only, whatever
/// `min_version` allows) with ALPN `h3` and no early data (0-RTT is not accepted), and the
/// listener's limits: HTTP/2's 200 request streams and 1 MiB windows (a stream's and the
/// connection's, each way: what a client that stops reading can hold in keel's memory), and
/// `idle_timeout` as QUIC's idle timeout (a client that vanished without a word).
pub fn quic_server_config(
    tcp: &ServerConfig,
    settings: &crate::config::ListenerConfig,
) -> Result<quinn::ServerConfig, TlsSettingError> {
    const WINDOW: u32 = 1 << 20;
    let mut config = tcp.clone();
    config.alpn_protocols = vec![ALPN_H3.to_vec()];
    config.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(config).map_err(|_| {
        TlsSettingError::new(
            "cipher_suites",
            "HTTP/3 needs TLS13_AES_128_GCM_SHA256 (QUIC's initial packets use it): add it to `cipher_suites`".to_string(),
        )
    })?;
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(MAX_H3_STREAMS.into())
        .stream_receive_window(WINDOW.into())
        .receive_window(WINDOW.into())
        .send_window(u64::from(WINDOW))
        .max_idle_timeout(quinn::IdleTimeout::try_from(settings.idle_timeout).ok());
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(transport));
    Ok(server)
}

/// Request streams an HTTP/3 client may have open at once (HTTP/2's `max_concurrent_streams`).
pub const MAX_H3_STREAMS: u32 = 200;

/// The CA certificates of a PEM file, as trust roots; `key` names the setting in errors.
fn root_store(path: &Path, key: &'static str) -> Result<RootCertStore, TlsSettingError> {
    let certs = load_certs(path).map_err(|m| TlsSettingError::new(key, m))?;
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|e| {
            TlsSettingError::new(
                key,
                format!(
                    "certificate {} in `{}` is not usable as a CA: {e}",
                    i + 1,
                    path.display()
                ),
            )
        })?;
    }
    Ok(roots)
}

/// The system's CA certificates (`SSL_CERT_FILE`, `SSL_CERT_DIR`, else the platform's store).
/// Certificates the store holds but rustls cannot use are skipped, as browsers skip them.
fn system_roots(roots: &mut RootCertStore) -> Result<(), TlsSettingError> {
    let found = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "the store is empty".to_string(), |e| e.to_string());
        return Err(TlsSettingError::new(
            "system_roots",
            format!("no usable CA certificate in the system's store: {why}"),
        ));
    }
    Ok(())
}

/// The client side of TLS to a cluster's endpoints: trusts the certificates of `ca` (and the
/// system's, with `system_roots`), presents `cert` when set, offers ALPN `alpn`
/// ([`ALPN_HTTP11`] or [`ALPN_H2`]).
pub fn client_config(
    c: &UpstreamTlsConfig,
    alpn: &[u8],
) -> Result<Arc<ClientConfig>, TlsSettingError> {
    let mut roots = match &c.ca {
        Some(ca) => root_store(ca, "ca")?,
        None => RootCertStore::empty(),
    };
    if c.system_roots {
        system_roots(&mut roots)?;
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSettingError::new("ca", e.to_string()))?
        .with_root_certificates(roots);
    let mut config = match (&c.cert, &c.key) {
        (Some(cert), Some(key)) => {
            let certs = load_certs(cert).map_err(|m| TlsSettingError::new("cert", m))?;
            let der = load_private_key(key).map_err(|m| TlsSettingError::new("key", m))?;
            builder.with_client_auth_cert(certs, der).map_err(|e| {
                TlsSettingError::new(
                    "key",
                    format!(
                        "the private key in `{}` does not fit the certificate in `{}`: {e}",
                        key.display(),
                        cert.display()
                    ),
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(Arc::new(config))
}

/// The name to verify an endpoint's certificate against (and send as SNI): an IP address is
/// matched against the certificate's IP SANs, anything else against its DNS names.
pub fn server_name(host: &str) -> Result<ServerName<'static>, InvalidServerName> {
    // URIs write IPv6 hosts in brackets.
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(host.to_string()).map_err(|source| InvalidServerName {
        host: host.to_string(),
        source,
    })
}

/// The check of `[listener.tls]`: loads the certificate and key as a start would (so that
/// `--check` and a reload catch a bad certificate). Paths are relative to `[listener.tls]`.
pub(crate) fn check_listener(c: &ListenerTlsConfig) -> Result<(), InvalidField> {
    server_config(c)
        .map(drop)
        .map_err(TlsSettingError::into_field)
}

/// The check of a cluster's `[cluster.tls]`: loads the CA file, and without `server_name`
/// checks that every endpoint's host can be verified against a certificate. Paths are
/// relative to the `[[cluster]]`.
pub(crate) fn check_upstream(c: &ClusterConfig) -> Result<(), InvalidField> {
    let Some(t) = &c.tls else {
        return Ok(());
    };
    if let Err(e) = UpstreamTls::new(t, c.timeouts.connect, c.alpn()) {
        return Err(e.into_field().under(FieldPath::key("tls")));
    }
    if t.server_name.is_none() {
        for (j, e) in c.endpoints.iter().enumerate() {
            let host = e
                .address
                .parse::<hyper::http::uri::Authority>()
                .map(|a| a.host().to_string())
                .unwrap_or_default();
            if let Err(m) = server_name(&host) {
                return Err(InvalidField::new(
                    FieldPath::key("endpoints").at(j).then("address"),
                    Problem::Invalid(format!(
                        "{m}: it cannot be verified against a certificate; set `server_name` in [cluster.tls]"
                    )),
                ));
            }
        }
    }
    Ok(())
}

/// TLS to one cluster's endpoints: the handshake on an open TCP connection, bounded in time.
/// Independent of any HTTP client, so that a connection pool can call [`UpstreamTls::connect`]
/// itself.
#[derive(Clone)]
pub struct UpstreamTls {
    connector: TlsConnector,
    /// Fixed name to verify (`server_name`), else each endpoint's host.
    server_name: Option<ServerName<'static>>,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl UpstreamTls {
    /// Loads the CA file; `handshake_timeout` bounds each handshake; `alpn` is offered.
    pub fn new(
        c: &UpstreamTlsConfig,
        handshake_timeout: Duration,
        alpn: &[u8],
    ) -> Result<UpstreamTls, TlsSettingError> {
        let server_name = c
            .server_name
            .as_deref()
            .map(server_name)
            .transpose()
            .map_err(|m| TlsSettingError::new("server_name", m))?;
        Ok(UpstreamTls {
            connector: TlsConnector::from(client_config(c, alpn)?),
            server_name,
            handshake_timeout,
        })
    }

    /// Performs the TLS handshake on `tcp`, verifying the endpoint's certificate against the
    /// CA and the configured `server_name` or else `host` (the endpoint's host).
    pub async fn connect(&self, tcp: TcpStream, host: &str) -> io::Result<TlsStream<TcpStream>> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => {
                server_name(host).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?
            }
        };
        let shown = name.to_str().into_owned();
        match tokio::time::timeout(self.handshake_timeout, self.connector.connect(name, tcp)).await
        {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(io::Error::new(
                e.kind(),
                format!("TLS handshake with `{shown}` failed: {e}"),
            )),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "TLS handshake with `{shown}` not finished within {}",
                    humantime::format_duration(self.handshake_timeout)
                ),
            )),
        }
    }
}

/// A connection to an endpoint: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum UpstreamStream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for UpstreamStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpstreamStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            UpstreamStream::Plain(s) => s.is_write_vectored(),
            UpstreamStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_flush(cx),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        // A device would be read forever (found by the config fuzzer).
        let e = load_certs(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(e, PemFileError::NotAFile { .. }), "{e:?}");
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let big = std::env::temp_dir().join(format!("keel-tls-big-{}.pem", std::process::id()));
        std::fs::write(&big, vec![b'a'; (MAX_PEM_BYTES + 1) as usize]).unwrap();
        let e = load_certs(&big).unwrap_err();
        let _ = std::fs::remove_file(&big);
        assert!(matches!(e, PemFileError::TooLarge { .. }), "{e:?}");
        assert!(e.to_string().contains("larger than"), "{e}");
    }

    #[test]
    fn server_names_from_hosts() {
        assert!(matches!(
            server_name("127.0.0.1").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name("[::1]").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            server_name("backend.internal").unwrap(),
            ServerName::DnsName(_)
        ));
        let e = server_name("not a name").unwrap_err();
        assert_eq!(e.host, "not a name");
    }

    #[test]
    fn missing_and_empty_files_are_explained() {
        let e = load_certs(Path::new("/nonexistent/keel/cert.pem")).unwrap_err();
        match &e {
            PemFileError::Read { path, source } => {
                assert_eq!(path, Path::new("/nonexistent/keel/cert.pem"));
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
        let e = e.to_string();
        assert!(
            e.contains("cannot read") && e.contains("/nonexistent/keel/cert.pem"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("keel-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "just text\n").unwrap();
        let e = load_certs(&empty).unwrap_err().to_string();
        assert!(e.contains("no certificate"), "{e}");
        let e = load_private_key(&empty).unwrap_err().to_string();
        assert!(e.contains("no private key"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
