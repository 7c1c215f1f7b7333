//! `[etcd]`: the etcd cluster (v3 API) that discovery (`discovery = { etcd = "/prefix/" }`)
//! and shared outlier evidence use. One section per proxy: every use talks to the same etcd.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use keel_balance::{FieldPath, InvalidField, Problem};
use serde::Deserialize;

/// `[etcd]`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdConfig {
    /// The members' client URLs, e.g. `["http://127.0.0.1:2379"]` (`https://` with `[etcd.tls]`).
    pub endpoints: Vec<String>,
    /// How long connecting to a member, and each request, may take. Default 2 s.
    #[serde(
        default = "default_dial_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub dial_timeout: Duration,
    /// etcd user (with `password`), for an etcd with authentication on.
    #[serde(default)]
    pub user: Option<String>,
    /// The user's password.
    #[serde(default)]
    pub password: Option<String>,
    /// TLS to the members: `[etcd.tls]` with `ca`, and `cert`/`key` for a client certificate.
    #[serde(default)]
    pub tls: Option<EtcdTlsConfig>,
}

/// `[etcd.tls]`. Relative paths are taken from the configuration file's directory.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EtcdTlsConfig {
    /// PEM file with the CA certificates the members' certificates must chain to.
    pub ca: PathBuf,
    /// PEM file with a client certificate chain (etcd's `--client-cert-auth`); with `key`.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// PEM file with the client certificate's private key.
    #[serde(default)]
    pub key: Option<PathBuf>,
}

fn default_dial_timeout() -> Duration {
    Duration::from_secs(2)
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the password (configurations are logged and shown in errors).
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("dial_timeout", &self.dial_timeout)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

impl EtcdConfig {
    /// `[etcd]` with these member URLs, other keys at their defaults.
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            dial_timeout: default_dial_timeout(),
            user: None,
            password: None,
            tls: None,
        }
    }

    /// URLs that parse, a scheme that matches `tls`, user and password together, a client
    /// certificate whole. Paths are relative to `[etcd]`; the files are read at load.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.endpoints.is_empty() {
            return Err(InvalidField::at(
                "endpoints",
                Problem::Invalid(
                    "at least one member's client URL, e.g. [\"http://127.0.0.1:2379\"]".into(),
                ),
            ));
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            let at = FieldPath::key("endpoints").at(i);
            let uri = e.parse::<hyper::http::Uri>().ok().filter(|u| {
                u.authority().is_some_and(|a| a.port_u16().is_some())
                    && matches!(u.scheme_str(), Some("http" | "https"))
            });
            let Some(uri) = uri else {
                return Err(InvalidField::new(
                    at,
                    Problem::Invalid(format!(
                        "`{e}` is not a member URL; expected http://host:port or https://host:port"
                    )),
                ));
            };
            let https = uri.scheme_str() == Some("https");
            if https != self.tls.is_some() {
                let why = if https {
                    "an https:// member needs [etcd.tls] (at least `ca`)"
                } else {
                    "with [etcd.tls] the members are reached over TLS: write https://"
                };
                return Err(InvalidField::new(at, Problem::Invalid(why.into())));
            }
        }
        if self.dial_timeout < Duration::from_millis(100) {
            return Err(InvalidField::at(
                "dial_timeout",
                Problem::out_of_range(
                    "at least 100ms",
                    humantime::format_duration(self.dial_timeout),
                ),
            ));
        }
        match (&self.user, &self.password) {
            (Some(_), None) => {
                return Err(InvalidField::at(
                    "password",
                    Problem::Invalid("`user` is set: set its `password` too".into()),
                ))
            }
            (None, Some(_)) => {
                return Err(InvalidField::at(
                    "user",
                    Problem::Invalid("`password` is set: set the `user` it belongs to".into()),
                ))
            }
            _ => {}
        }
        if let Some(t) = &self.tls {
            if t.cert.is_some() != t.key.is_some() {
                let missing = if t.cert.is_some() { "key" } else { "cert" };
                return Err(InvalidField::new(
                    FieldPath::key("tls").then(missing),
                    Problem::Invalid("a client certificate needs both `cert` and `key`".into()),
                ));
            }
        }
        Ok(())
    }
}

/// Checks an etcd key prefix (a discovery source's or evidence's): not empty, ends with `/`, so
/// that `/keel/app/` does not also hold `/keel/app2/...`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), NotAKeyPrefix> {
    if prefix.is_empty() || !prefix.ends_with('/') {
        return Err(NotAKeyPrefix {
            prefix: prefix.to_string(),
        });
    }
    Ok(())
}

/// An etcd key prefix that is empty or does not end in `/`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{prefix}` is not a key prefix; expected one ending in `/`, e.g. \"/keel/clusters/app/\" (every key under it is one endpoint)")]
pub(crate) struct NotAKeyPrefix {
    /// The prefix given.
    pub prefix: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_urls_tls_and_credentials_are_checked() {
        let ok = EtcdConfig::new(vec!["http://127.0.0.1:2379".into()]);
        assert!(ok.validate().is_ok());
        let mut c = ok.clone();
        c.endpoints = vec!["127.0.0.1:2379".into()];
        assert!(c.validate().unwrap_err().to_string().contains("member URL"));
        c.endpoints = vec!["https://127.0.0.1:2379".into()];
        assert!(c.validate().unwrap_err().to_string().contains("[etcd.tls]"));
        let mut c = ok.clone();
        c.user = Some("keel".into());
        assert_eq!(c.validate().unwrap_err().field.to_string(), "password");
        assert!(check_prefix("/keel/app/").is_ok());
        assert_eq!(
            check_prefix("/keel/app"),
            Err(NotAKeyPrefix {
                prefix: "/keel/app".into()
            })
        );
        assert!(!format!(
            "{:?}",
            EtcdConfig {
                password: Some("secret".into()),
                ..c
            }
        )
        .contains("secret"));
    }
}
