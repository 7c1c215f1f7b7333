//! The file source: a TOML file holding `endpoints = [...]` as in the configuration, looked
//! at every second and read again when it changed.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use keel_balance::EndpointSpec;
use serde::Deserialize;

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

    async fn look(&mut self, last_failed: bool) -> Option<Result<Vec<EndpointSpec>, String>> {
        // Read again only when it changed (or could not be read last time).
        let now = file_stamp(&self.path);
        if now.is_some() && now == self.stamp && !last_failed {
            return None;
        }
        self.stamp = now;
        let path = self.path.clone();
        Some(
            tokio::task::spawn_blocking(move || read_file(&path))
                .await
                .unwrap_or_else(|e| Err(e.to_string())),
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
pub(crate) fn read_file(path: &Path) -> Result<Vec<EndpointSpec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: EndpointsFile = toml::from_str(&text).map_err(|e| {
        format!(
            "{}: expected `endpoints = [{{ address = \"host:port\" }}, ...]`: {}",
            path.display(),
            e.message().trim()
        )
    })?;
    check_endpoints(&file.endpoints).map_err(|m| format!("{}: {m}", path.display()))?;
    Ok(file.endpoints)
}

/// An address `host:port` and a weight of at least 1: what every discovered endpoint needs.
pub(crate) fn check_endpoint(e: &EndpointSpec) -> Result<(), String> {
    let ok = e
        .address
        .parse::<hyper::http::uri::Authority>()
        .ok()
        .filter(|a| a.port_u16().is_some() && !a.host().is_empty());
    if ok.is_none() {
        return Err(format!(
            "`{}` is not an address; expected host:port",
            e.address
        ));
    }
    if e.weight == 0 {
        return Err(format!("`{}` has weight 0; at least 1", e.address));
    }
    Ok(())
}

/// Each endpoint checked ([`check_endpoint`]), each address once.
fn check_endpoints(endpoints: &[EndpointSpec]) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    for e in endpoints {
        check_endpoint(e)?;
        if !seen.insert(e.address.as_str()) {
            return Err(format!("`{}` is listed twice", e.address));
        }
    }
    Ok(())
}
