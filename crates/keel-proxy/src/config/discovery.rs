//! `discovery` of a cluster: where its endpoints come from when they are not listed.
//!
//! [`DiscoveryConfig`] is an enum, so that a source cannot be written with another's keys
//! (`port` with `srv`, `refresh` with `file`, ...). Users write one inline table, as before:
//! `{ dns = "NAME", port = N }`, `{ srv = "NAME" }` or `{ file = "PATH" }`, with `resolver`
//! and `refresh` for the DNS kinds; the deserializer refuses a key of another kind at that
//! key. Names are checked here (syntax only); reading a file source is the discovery
//! component's check (`discovery::check`), which does I/O.

use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use keel_balance::{InvalidField, Problem};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

/// `discovery` of a cluster: one source of its endpoints, e.g. `{ dns = "api.internal.test",
/// port = 9000 }`, `{ srv = "_http._tcp.api.internal.test" }` or `{ file = "endpoints.toml" }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryConfig {
    /// `{ dns = "NAME", port = N }`: the A and AAAA records of `name` are the endpoints (each
    /// address with `port`, weight 1).
    Dns {
        /// The name resolved.
        name: String,
        /// The endpoints' port; 0 when the table has none, which [`DiscoveryConfig::validate`]
        /// refuses.
        port: u16,
        /// The DNS server to ask; the system's (`/etc/resolv.conf`) when `None`.
        resolver: Option<SocketAddr>,
        /// Time between two resolutions; [`DEFAULT_DISCOVERY_REFRESH`] when `None`, at least
        /// 1 s.
        refresh: Option<Duration>,
    },
    /// `{ srv = "_service._proto.name" }` (RFC 2782): each target of the lowest priority in
    /// use, with the record's port and weight.
    Srv {
        /// The SRV name resolved.
        name: String,
        /// As for [`DiscoveryConfig::Dns`].
        resolver: Option<SocketAddr>,
        /// As for [`DiscoveryConfig::Dns`].
        refresh: Option<Duration>,
    },
    /// `{ file = "PATH" }`: a TOML file holding `endpoints = [...]` as in the configuration,
    /// read again when it changes; relative to the configuration file.
    File {
        /// The file.
        path: PathBuf,
    },
    /// `{ etcd = "/keel/clusters/app/" }`: every key under the prefix is one endpoint, its value
    /// JSON `{"address": "host:port", "weight": 1, "zone": "a", "priority": 0}` (only `address`
    /// required); read, then watched. Needs the top-level `[etcd]`.
    Etcd {
        /// The key prefix, ending in `/`.
        prefix: String,
    },
}

/// How often a DNS source is resolved unless `refresh` says otherwise.
pub const DEFAULT_DISCOVERY_REFRESH: Duration = Duration::from_secs(5);

/// The kind of a discovery source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscoveryKind {
    /// A and AAAA records.
    Dns,
    /// SRV records.
    Srv,
    /// A file.
    File,
    /// An etcd key prefix.
    Etcd,
}

impl DiscoveryKind {
    /// The source's key in the table, as in `/status`: `dns`, `srv` or `file`.
    pub fn as_str(self) -> &'static str {
        match self {
            DiscoveryKind::Dns => "dns",
            DiscoveryKind::Srv => "srv",
            DiscoveryKind::File => "file",
            DiscoveryKind::Etcd => "etcd",
        }
    }
}

impl DiscoveryConfig {
    /// The kind of source.
    pub fn kind(&self) -> DiscoveryKind {
        match self {
            DiscoveryConfig::Dns { .. } => DiscoveryKind::Dns,
            DiscoveryConfig::Srv { .. } => DiscoveryKind::Srv,
            DiscoveryConfig::File { .. } => DiscoveryKind::File,
            DiscoveryConfig::Etcd { .. } => DiscoveryKind::Etcd,
        }
    }

    /// Time between two resolutions (a file is looked at every second whatever this says).
    pub fn refresh(&self) -> Duration {
        match self {
            DiscoveryConfig::Dns { refresh, .. } | DiscoveryConfig::Srv { refresh, .. } => {
                refresh.unwrap_or(DEFAULT_DISCOVERY_REFRESH)
            }
            DiscoveryConfig::File { .. } | DiscoveryConfig::Etcd { .. } => {
                DEFAULT_DISCOVERY_REFRESH
            }
        }
    }

    /// The DNS server asked (the DNS kinds), `None` for the system's.
    pub fn resolver(&self) -> Option<SocketAddr> {
        match self {
            DiscoveryConfig::Dns { resolver, .. } | DiscoveryConfig::Srv { resolver, .. } => {
                *resolver
            }
            DiscoveryConfig::File { .. } | DiscoveryConfig::Etcd { .. } => None,
        }
    }

    /// The source in words, e.g. `dns api.internal.test:9000 via 127.0.0.1:5353`.
    pub fn describe(&self) -> String {
        let via = self
            .resolver()
            .map_or(" via the system's resolver".to_string(), |r| {
                format!(" via {r}")
            });
        match self {
            DiscoveryConfig::Dns { name, port, .. } => format!("dns {name}:{port}{via}"),
            DiscoveryConfig::Srv { name, .. } => format!("srv {name}{via}"),
            DiscoveryConfig::File { path } => format!("file {}", path.display()),
            DiscoveryConfig::Etcd { prefix } => format!("etcd {prefix}"),
        }
    }

    /// Checks the source without resolving or reading anything: a valid name, a port, the
    /// refresh period. Paths are relative to `discovery`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        let refresh = match self {
            DiscoveryConfig::Dns {
                name,
                port,
                refresh,
                ..
            } => {
                if let Err(e) = check_name(name, false) {
                    return Err(InvalidField::at("dns", Problem::Invalid(e.to_string())));
                }
                if *port == 0 {
                    return Err(InvalidField::at(
                        "port",
                        Problem::Invalid("`dns` needs the endpoints' `port` (1..=65535)".into()),
                    ));
                }
                refresh
            }
            DiscoveryConfig::Srv { name, refresh, .. } => {
                if let Err(e) = check_name(name, true) {
                    return Err(InvalidField::at("srv", Problem::Invalid(e.to_string())));
                }
                refresh
            }
            DiscoveryConfig::File { .. } => &None,
            DiscoveryConfig::Etcd { prefix } => {
                crate::config::etcd::check_prefix(prefix)
                    .map_err(|e| InvalidField::at("etcd", Problem::Invalid(e.to_string())))?;
                &None
            }
        };
        if let Some(r) = *refresh {
            if r < Duration::from_secs(1) {
                return Err(InvalidField::at(
                    "refresh",
                    Problem::out_of_range("at least 1s", humantime::format_duration(r)),
                ));
            }
        }
        Ok(())
    }
}

/// True for a host name of DNS labels (at most 253 bytes; labels of 1-63 letters, digits, `-`
/// or `_`), without a final dot.
pub(crate) fn is_dns_name(name: &str) -> bool {
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    name.len() <= 253 && name.split('.').all(label_ok)
}

/// A discovery name that is refused, and which name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NameError {
    /// Not a host name of DNS labels.
    #[error("`{0}` is not a DNS name; expected e.g. \"api.internal.test\"")]
    NotDns(String),
    /// A DNS name, but not `_service._proto.name`.
    #[error("`{0}` is not an SRV name; expected _service._proto.name, e.g. \"_http._tcp.api.internal.test\" (RFC 2782)")]
    NotSrv(String),
}

/// Checks a DNS name (an SRV name: `_service._proto.name`) without resolving it.
pub(crate) fn check_name(name: &str, srv: bool) -> Result<(), NameError> {
    let trimmed = name.strip_suffix('.').unwrap_or(name);
    if !is_dns_name(trimmed) {
        return Err(NameError::NotDns(name.to_string()));
    }
    if srv {
        let labels: Vec<&str> = trimmed.split('.').collect();
        if labels.len() < 3 || !labels[0].starts_with('_') || !labels[1].starts_with('_') {
            return Err(NameError::NotSrv(name.to_string()));
        }
    }
    Ok(())
}

/// The keys of a `discovery` table.
const KEYS: &[&str] = &["dns", "srv", "file", "etcd", "port", "resolver", "refresh"];

/// One key of a `discovery` table; any other is refused at that key.
enum Key {
    Dns,
    Srv,
    File,
    Etcd,
    Port,
    Resolver,
    Refresh,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a discovery key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "dns" => Key::Dns,
                    "srv" => Key::Srv,
                    "file" => Key::File,
                    "etcd" => Key::Etcd,
                    "port" => Key::Port,
                    "resolver" => Key::Resolver,
                    "refresh" => Key::Refresh,
                    _ => return Err(E::unknown_field(v, KEYS)),
                })
            }
        }
        d.deserialize_identifier(KeyVisitor)
    }
}

/// A duration as the configuration writes it (`"5s"`).
struct Refresh(Duration);

impl<'de> Deserialize<'de> for Refresh {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        keel_balance::duration_serde::deserialize(d).map(Refresh)
    }
}

/// A value read in place, then refused with `why` when its key does not apply to the source:
/// the error is raised while the value is read, so that it carries the value's position.
struct Value<T> {
    why: Option<String>,
    t: PhantomData<T>,
}

impl<T> Value<T> {
    fn refused_if(why: Option<String>) -> Self {
        Value {
            why,
            t: PhantomData,
        }
    }
}

impl<'de, T: Deserialize<'de>> DeserializeSeed<'de> for Value<T> {
    type Value = T;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<T, D::Error> {
        let v = T::deserialize(d)?;
        match self.why {
            Some(why) => Err(de::Error::custom(Problem::NotApplicable(why))),
            None => Ok(v),
        }
    }
}

/// Why `key` does not apply to a source of `kind`, if it does not.
fn not_for(kind: DiscoveryKind, key: Key) -> Option<&'static str> {
    match (kind, key) {
        (DiscoveryKind::Srv, Key::Port) => Some("SRV records carry the port"),
        (DiscoveryKind::File, Key::Port) => Some("the file lists addresses with their ports"),
        (DiscoveryKind::File, Key::Resolver) => Some("a file is not resolved"),
        (DiscoveryKind::File, Key::Refresh) => {
            Some("a file is looked at every second and read again when it changes")
        }
        (DiscoveryKind::Etcd, Key::Port) => Some("each key's value carries its address and port"),
        (DiscoveryKind::Etcd, Key::Resolver) => {
            Some("etcd's members are those of the top-level [etcd]")
        }
        (DiscoveryKind::Etcd, Key::Refresh) => {
            Some("etcd is watched: changes arrive as they happen")
        }
        _ => None,
    }
}

impl<'de> Deserialize<'de> for DiscoveryConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(TableVisitor)
    }
}

struct TableVisitor;

impl<'de> Visitor<'de> for TableVisitor {
    type Value = DiscoveryConfig;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a table: { dns = \"NAME\", port = N }, { srv = \"NAME\" }, { file = \"PATH\" } or { etcd = \"/PREFIX/\" }",
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<DiscoveryConfig, A::Error> {
        let (mut dns, mut srv, mut file) = (None, None, None::<PathBuf>);
        let mut etcd = None::<String>;
        let (mut port, mut resolver, mut refresh) = (None, None, None::<Refresh>);
        // The one kind named so far (two kinds are refused at the table, below).
        let kind = |dns: &Option<String>,
                    srv: &Option<String>,
                    file: &Option<PathBuf>,
                    etcd: &Option<String>| match (
            dns.is_some(),
            srv.is_some(),
            file.is_some(),
            etcd.is_some(),
        ) {
            (true, false, false, false) => Some(DiscoveryKind::Dns),
            (false, true, false, false) => Some(DiscoveryKind::Srv),
            (false, false, true, false) => Some(DiscoveryKind::File),
            (false, false, false, true) => Some(DiscoveryKind::Etcd),
            _ => None,
        };
        while let Some(key) = map.next_key::<Key>()? {
            let now = kind(&dns, &srv, &file, &etcd);
            let refused = |key| now.and_then(|k| not_for(k, key)).map(String::from);
            match key {
                Key::Port => {
                    port = Some(map.next_value_seed(Value::refused_if(refused(Key::Port)))?)
                }
                Key::Resolver => {
                    resolver = Some(map.next_value_seed(Value::refused_if(refused(Key::Resolver)))?)
                }
                Key::Refresh => {
                    refresh = Some(map.next_value_seed(Value::refused_if(refused(Key::Refresh)))?)
                }
                // A kind after keys that do not apply to it: refused at the kind, naming them.
                kind_key => {
                    let k = match kind_key {
                        Key::Dns => DiscoveryKind::Dns,
                        Key::Srv => DiscoveryKind::Srv,
                        Key::Etcd => DiscoveryKind::Etcd,
                        _ => DiscoveryKind::File,
                    };
                    let set = [
                        ("port", Key::Port, port.is_some()),
                        ("resolver", Key::Resolver, resolver.is_some()),
                        ("refresh", Key::Refresh, refresh.is_some()),
                    ];
                    let why = set.into_iter().find_map(|(name, key, is_set)| {
                        is_set
                            .then(|| not_for(k, key))
                            .flatten()
                            .map(|why| format!("`{name}` is set, and {why}"))
                    });
                    match k {
                        DiscoveryKind::Dns => {
                            dns = Some(map.next_value_seed(Value::refused_if(why))?)
                        }
                        DiscoveryKind::Srv => {
                            srv = Some(map.next_value_seed(Value::refused_if(why))?)
                        }
                        DiscoveryKind::File => {
                            file = Some(map.next_value_seed(Value::refused_if(why))?)
                        }
                        DiscoveryKind::Etcd => {
                            etcd = Some(map.next_value_seed(Value::refused_if(why))?)
                        }
                    }
                }
            }
        }
        let refresh = refresh.map(|r| r.0);
        match (dns, srv, file, etcd) {
            (None, None, None, Some(prefix)) => Ok(DiscoveryConfig::Etcd { prefix }),
            (Some(name), None, None, None) => Ok(DiscoveryConfig::Dns {
                name,
                port: port.unwrap_or(0),
                resolver,
                refresh,
            }),
            (None, Some(name), None, None) => Ok(DiscoveryConfig::Srv {
                name,
                resolver,
                refresh,
            }),
            (None, None, Some(path), None) => Ok(DiscoveryConfig::File { path }),
            _ => Err(de::Error::custom(
                "set one of `dns` (with `port`), `srv`, `file` or `etcd`",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_without_resolving() {
        assert!(check_name("api.internal.test", false).is_ok());
        assert!(check_name("api.internal.test.", false).is_ok());
        assert!(check_name("_http._tcp.api.internal.test", true).is_ok());
        assert_eq!(
            check_name("api..test", false),
            Err(NameError::NotDns("api..test".into()))
        );
        assert!(check_name("api.test:53", false).is_err());
        assert!(check_name("", false).is_err());
        let e = check_name("api.internal.test", true).unwrap_err();
        assert_eq!(e, NameError::NotSrv("api.internal.test".into()));
        assert!(e.to_string().contains("RFC 2782"), "{e}");
    }

    /// The keys of one kind are refused with another, in either order, at a key of theirs.
    #[test]
    fn keys_of_another_kind_are_refused_where_they_are() {
        #[derive(Deserialize, Debug)]
        struct Doc {
            #[allow(dead_code)]
            discovery: DiscoveryConfig,
        }
        for (text, words) in [
            (
                "discovery = { srv = \"_a._tcp.b.test\", port = 80 }",
                "SRV records carry the port",
            ),
            (
                "discovery = { port = 80, srv = \"_a._tcp.b.test\" }",
                "`port` is set, and SRV",
            ),
            (
                "discovery = { file = \"e.toml\", resolver = \"127.0.0.1:53\" }",
                "not resolved",
            ),
            (
                "discovery = { refresh = \"2s\", file = \"e.toml\" }",
                "`refresh` is set",
            ),
            (
                "discovery = { etcd = \"/keel/app/\", port = 80 }",
                "each key's value carries",
            ),
            (
                "discovery = { etcd = \"/keel/app/\", file = \"e.toml\" }",
                "set one of",
            ),
            ("discovery = { port = 80 }", "set one of"),
            (
                "discovery = { file = \"e.toml\", dns = \"a.test\" }",
                "set one of",
            ),
        ] {
            let e = toml::from_str::<Doc>(text).unwrap_err();
            assert!(e.message().contains(words), "{text}: {e}");
            assert!(e.span().is_some(), "{text}: located");
        }
        let d = toml::from_str::<Doc>(
            "discovery = { resolver = \"127.0.0.1:53\", dns = \"a.test\", refresh = \"2s\" }",
        )
        .unwrap()
        .discovery;
        assert_eq!(
            d,
            DiscoveryConfig::Dns {
                name: "a.test".into(),
                port: 0,
                resolver: Some("127.0.0.1:53".parse().unwrap()),
                refresh: Some(Duration::from_secs(2)),
            }
        );
        assert!(d
            .validate()
            .unwrap_err()
            .problem
            .to_string()
            .contains("port"));
    }
}
