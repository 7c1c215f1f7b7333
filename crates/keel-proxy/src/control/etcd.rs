//! The etcd client of `[etcd]` (discovery, shared evidence) and `keel register`: how keel
//! connects, and the errors it reports.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, PutOptions};

use crate::config::EtcdConfig;
pub(crate) use crate::control::escape::escaped;

/// Why talking to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// A TLS file of `[etcd.tls]` could not be read.
    #[error("cannot read {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The client's own error (connection refused, no leader, ...).
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    /// etcd refused keel's TLS client (no certificate, or one its CA did not sign): the alert.
    #[error("etcd refused the TLS handshake ({0}): with --client-cert-auth, etcd needs [etcd.tls] cert and key, signed by a CA of its --trusted-ca-file")]
    TlsRefused(&'static str),
    /// The connection closed under a request: a member stopped, restarted or dropped it.
    #[error("etcd closed the connection ({0})")]
    Closed(etcd_client::Error),
    /// [`EtcdError::Closed`] on a TLS connection without a client certificate
    /// ([`EtcdError::for_config`]): over TLS 1.3 this is how a member with
    /// `--client-cert-auth` refuses such a client when its alert loses the race with the
    /// client's first request.
    #[error("etcd closed the connection ({0}): over TLS, a member with --client-cert-auth does this to a client without [etcd.tls] cert and key")]
    ClosedOverTls(etcd_client::Error),
    /// etcd refused the credentials, their absence, or what they may do: etcd's own words.
    #[error("etcd refused access: {0} (check [etcd] user and password, and the user's roles)")]
    Refused(String),
    /// No answer within `dial_timeout`.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// The watch stream ended or was cancelled by etcd.
    #[error("etcd's watch ended: {0}")]
    WatchEnded(String),
    /// A lease keep-alive came back with TTL 0: the lease is gone.
    #[error("lease {0:x} expired")]
    LeaseExpired(i64),
}

impl EtcdError {
    /// The error as said to the operator of `config`: a closed connection hints at a missing
    /// client certificate only when keel talks TLS to etcd without one (a plain-HTTP member
    /// that dies is just that).
    pub(crate) fn for_config(self, config: &EtcdConfig) -> Self {
        match self {
            EtcdError::Closed(e) if config.tls.as_ref().is_some_and(|t| t.cert.is_none()) => {
                EtcdError::ClosedOverTls(e)
            }
            other => other,
        }
    }
}

/// Runs `f` within `timeout` (the client's own timeouts do not cover a member that accepts the
/// connection and never answers, e.g. a stopped process).
pub(crate) async fn within<T>(
    timeout: Duration,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(explain),
        Err(_) => Err(EtcdError::Timeout(timeout)),
    }
}

/// The client's error, said plainly when etcd refused access (a wrong password, a user missing
/// while etcd requires one, or a role without permission on the key) instead of as a gRPC
/// status dump.
pub(crate) fn explain(e: etcd_client::Error) -> EtcdError {
    if let etcd_client::Error::GRpcStatus(s) = &e {
        let m = s.message();
        const REFUSALS: [&str; 4] = [
            "authentication failed",
            "user name is empty",
            "permission denied",
            "invalid auth token",
        ];
        if REFUSALS.iter().any(|r| m.contains(r)) {
            return EtcdError::Refused(m.to_string());
        }
    }
    // The TLS alert is deep in the transport error's sources; its text names it.
    let text = e.to_string();
    for alert in ["CertificateRequired", "BadCertificate", "UnknownCA"] {
        if text.contains(alert) {
            return EtcdError::TlsRefused(alert);
        }
    }
    // How the closing reaches the client depends on the race: "connection closed" when the
    // read sees it, "broken pipe" or "connection reset" when the write does (CI saw all three).
    let lower = text.to_ascii_lowercase();
    if ["connection closed", "broken pipe", "connection reset"]
        .iter()
        .any(|c| lower.contains(c))
    {
        return EtcdError::Closed(e);
    }
    EtcdError::Client(e)
}

/// A client of `config`'s members. HTTP/2 keep-alive pings every 5 s (etcd's default
/// `--grpc-keepalive-min-time`; more often gets the connection closed) so that a watch on a
/// member that stopped answering fails instead of waiting forever.
pub(crate) async fn connect(config: &EtcdConfig) -> Result<Client, EtcdError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(config.dial_timeout)
        .with_timeout(config.dial_timeout)
        .with_keep_alive(Duration::from_secs(5), config.dial_timeout)
        .with_keep_alive_while_idle(true);
    if let (Some(u), Some(p)) = (&config.user, &config.password) {
        options = options.with_user(u.clone(), p.clone());
    }
    if let Some(t) = &config.tls {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|source| EtcdError::File {
                path: p.display().to_string(),
                source,
            })
        };
        let mut tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read(&t.ca)?));
        if let (Some(c), Some(k)) = (&t.cert, &t.key) {
            tls = tls.identity(etcd_client::Identity::from_pem(read(c)?, read(k)?));
        }
        options = options.with_tls(tls);
    }
    within(
        config.dial_timeout,
        Client::connect(&config.endpoints, Some(options)),
    )
    .await
}

/// What `keel register` puts under its key.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Registration {
    /// `host:port` of the endpoint.
    pub address: String,
    /// Relative weight (at least 1).
    pub weight: u32,
    /// Zone, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Priority level.
    pub priority: u32,
}

/// `keel register`: puts `registration` under `key` with a lease of `ttl`, keeps the lease alive
/// (every third of `ttl`) until `stop` resolves, then deletes the key and revokes the lease.
/// Survives etcd's outages: while etcd is unreachable it retries every second, and a lease that
/// expired meanwhile is replaced (key written again). `on_registered` runs after each write.
pub async fn register(
    config: &EtcdConfig,
    key: &str,
    registration: &Registration,
    ttl: Duration,
    stop: impl std::future::Future<Output = ()>,
    mut on_registered: impl FnMut(i64),
) -> Result<(), EtcdError> {
    let value = serde_json::to_vec(registration).expect("a registration serializes");
    let ttl_s = ttl.as_secs().max(1) as i64;
    let every = Duration::from_secs_f64((ttl_s as f64 / 3.0).max(0.5));
    tokio::pin!(stop);
    let mut last: Option<(Client, i64)> = None;
    loop {
        let session = async {
            let mut client = connect(config).await?;
            let lease = within(config.dial_timeout, client.lease_grant(ttl_s, None))
                .await?
                .id();
            // Recorded before the put: a key written then lost to a timeout is still removed
            // at exit through its lease.
            last = Some((client.clone(), lease));
            within(
                config.dial_timeout,
                client.put(
                    key,
                    value.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
            )
            .await?;
            on_registered(lease);
            tracing::info!(key, lease = format!("{lease:x}"), "registered");
            let (mut keeper, mut answers) =
                within(config.dial_timeout, client.lease_keep_alive(lease)).await?;
            loop {
                keeper.keep_alive().await?;
                match within(config.dial_timeout, answers.message()).await? {
                    Some(a) if a.ttl() > 0 => {}
                    Some(_) => return Err(EtcdError::LeaseExpired(lease)),
                    None => return Err(EtcdError::WatchEnded("keep-alive stream".into())),
                }
                tokio::time::sleep(every).await;
            }
            #[allow(unreachable_code)]
            Ok::<(), EtcdError>(())
        };
        tokio::select! {
            r = session => {
                if let Err(e) = r {
                    let e = e.for_config(config);
                    tracing::warn!(key, "registration interrupted, retrying in 1 s: {e}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            () = &mut stop => break,
        }
    }
    if let Some((mut client, lease)) = last {
        // Deleting the key first: watchers see the endpoint go even if the revoke is lost.
        within(config.dial_timeout, client.delete(key, None)).await?;
        let _ = within(config.dial_timeout, client.lease_revoke(lease)).await;
        tracing::info!(key, "deregistered");
    }
    Ok(())
}

/// The options of a read of everything under `prefix`.
pub(crate) fn prefix_read() -> GetOptions {
    GetOptions::new().with_prefix()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closing_is_said_as_one_whichever_side_of_the_race_saw_it() {
        let io = |kind, text: &str| etcd_client::Error::IoError(std::io::Error::new(kind, text));
        use std::io::ErrorKind::*;
        for e in [
            io(BrokenPipe, "stream closed because of a broken pipe"),
            io(ConnectionReset, "Connection reset by peer (os error 104)"),
            io(UnexpectedEof, "connection closed before message completed"),
        ] {
            let plain = EtcdConfig {
                endpoints: vec!["http://127.0.0.1:2379".into()],
                dial_timeout: Duration::from_secs(1),
                user: None,
                password: None,
                tls: None,
            };
            let said = explain(e).to_string();
            assert!(said.starts_with("etcd closed the connection"), "{said}");
            assert!(!said.contains("TLS"), "no TLS, no TLS hint: {said}");
            let e = io(UnexpectedEof, "connection closed before message completed");
            let said = explain(e).for_config(&plain).to_string();
            assert!(!said.contains("TLS"), "plain HTTP: {said}");
            let tls = EtcdConfig {
                tls: Some(crate::config::EtcdTlsConfig {
                    ca: "ca.pem".into(),
                    cert: None,
                    key: None,
                }),
                ..plain
            };
            let e = io(BrokenPipe, "stream closed because of a broken pipe");
            let said = explain(e).for_config(&tls).to_string();
            assert!(said.contains("[etcd.tls] cert and key"), "{said}");
        }
        let refused = explain(io(ConnectionRefused, "Connection refused (os error 111)"));
        assert!(matches!(refused, EtcdError::Client(_)), "{refused}");
    }
}
