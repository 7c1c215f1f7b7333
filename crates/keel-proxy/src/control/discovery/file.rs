//! The file source: a TOML file holding `endpoints = [...]` as in the configuration, looked
//! at every second and read again when it changed.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use keel_balance::EndpointSpec;
use serde::Deserialize;

use crate::control::discovery::error::{DiscoveryError, EndpointError, FileSourceError};
use crate::control::discovery::source::Source;

/// How often a file source is looked at.
const FILE_POLL: Duration = Duration::from_secs(1);

/// `{ file = "PATH" }`.
pub(crate) struct File {
    pub(crate) path: PathBuf,
    /// The version last read.
    stamp: Option<(SystemTime, u64)>,
}

impl File {
    /// Follows `path`, not read yet.
    pub(crate) fn new(path: PathBuf) -> Self {
        File { path, stamp: None }
    }
}

impl Source for File {
    fn every(&self) -> Duration {
        FILE_POLL
    }

    async fn look(
        &mut self,
        last_failed: bool,
    ) -> Option<Result<Vec<EndpointSpec>, DiscoveryError>> {
        // Read again only when it changed (or could not be read last time).
        let now = file_stamp(&self.path);
        if now.is_some() && now == self.stamp && !last_failed {
            return None;
        }
        self.stamp = now;
        let path = self.path.clone();
        Some(
            match tokio::task::spawn_blocking(move || read_file(&path)).await {
                Ok(read) => read.map_err(DiscoveryError::from),
                Err(e) => Err(DiscoveryError::from(e)),
            },
        )
    }
}

/// What identifies a version of a file (it is read again when this changes).
fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// A file source's content: `endpoints = [...]`, as in a cluster.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointsFile {
    endpoints: Vec<EndpointSpec>,
}

/// Reads a file source and checks its endpoints as a cluster's are checked.
pub(crate) fn read_file(path: &Path) -> Result<Vec<EndpointSpec>, FileSourceError> {
    let text = std::fs::read_to_string(path).map_err(|source| FileSourceError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let file: EndpointsFile = toml::from_str(&text).map_err(|source| FileSourceError::Syntax {
        path: path.to_path_buf(),
        source,
    })?;
    check_endpoints(&file.endpoints).map_err(|source| FileSourceError::Endpoint {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(file.endpoints)
}

/// An address `host:port` and a weight of at least 1: what every discovered endpoint needs.
pub(crate) fn check_endpoint(e: &EndpointSpec) -> Result<(), EndpointError> {
    let not_an_address = |source| EndpointError::NotAnAddress {
        address: e.address.clone(),
        source,
    };
    let authority = e
        .address
        .parse::<hyper::http::uri::Authority>()
        .map_err(|err| not_an_address(Some(err)))?;
    if authority.port_u16().is_none() || authority.host().is_empty() {
        return Err(not_an_address(None));
    }
    if e.weight == 0 {
        return Err(EndpointError::ZeroWeight {
            address: e.address.clone(),
        });
    }
    Ok(())
}

/// Each endpoint checked ([`check_endpoint`]), each address once.
fn check_endpoints(endpoints: &[EndpointSpec]) -> Result<(), EndpointError> {
    let mut seen = std::collections::HashSet::new();
    for e in endpoints {
        check_endpoint(e)?;
        if !seen.insert(e.address.as_str()) {
            return Err(EndpointError::Duplicate {
                address: e.address.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_errors_keep_the_path_and_their_source() {
        let dir = std::env::temp_dir().join(format!("keel-discovery-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.toml");
        match read_file(&missing).unwrap_err() {
            FileSourceError::Read { path, source } => {
                assert_eq!(path, missing);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
        let twice = dir.join("twice.toml");
        std::fs::write(
            &twice,
            "endpoints = [{ address = \"10.0.0.1:80\" }, { address = \"10.0.0.1:80\" }]\n",
        )
        .unwrap();
        let e = read_file(&twice).unwrap_err();
        assert!(
            matches!(
                &e,
                FileSourceError::Endpoint {
                    source: EndpointError::Duplicate { address },
                    ..
                } if address == "10.0.0.1:80"
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("{}: `10.0.0.1:80` is listed twice", twice.display())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_address_needs_a_host_and_a_port() {
        let e = check_endpoint(&EndpointSpec::new("10.0.0.1")).unwrap_err();
        assert!(
            matches!(e, EndpointError::NotAnAddress { source: None, .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "`10.0.0.1` is not an address; expected host:port"
        );
        let e = check_endpoint(&EndpointSpec::new("a b:80")).unwrap_err();
        assert!(
            matches!(
                e,
                EndpointError::NotAnAddress {
                    source: Some(_),
                    ..
                }
            ),
            "{e:?}"
        );
        let e = check_endpoint(&EndpointSpec::new("10.0.0.1:80").with_weight(0)).unwrap_err();
        assert!(matches!(e, EndpointError::ZeroWeight { .. }), "{e:?}");
    }
}
