//! What discovery knows of one cluster (its source, the last set found, how refreshes went):
//! state the routing keeps per cluster, written by `control::discovery`'s tasks and read by
//! the admin.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use keel_balance::EndpointSpec;

use crate::config::discovery::DiscoveryConfig;

/// Why a refresh failed, shared with the admin: the source's own error
/// (`control::discovery`'s `DiscoveryError`) or [`NoEndpoint`].
pub(crate) type RefreshError = Arc<dyn std::error::Error + Send + Sync>;

/// A source that answered with no endpoint at all (kept as a failure: the last set stays).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the answer has no endpoint")]
pub(crate) struct NoEndpoint;

/// What discovery knows of one cluster: its source, the last set found, and how the last
/// refreshes went. Kept across reloads while the cluster's source stays the same.
pub(crate) struct Discovered {
    /// The source.
    pub config: DiscoveryConfig,
    state: Mutex<State>,
    /// Failed refreshes.
    pub errors: AtomicU64,
}

/// The mutable part of [`Discovered`] (cold path: a refresh a second at most).
#[derive(Default, Clone)]
pub(crate) struct State {
    /// The last set found (`None` until the source first answered).
    pub endpoints: Option<Vec<EndpointSpec>>,
    /// When the source last answered with endpoints (a file: was last looked at, unchanged
    /// or read).
    pub last_refresh: Option<SystemTime>,
    /// When the set last changed.
    pub last_change: Option<SystemTime>,
    /// The last failure, if the last refresh failed.
    pub last_error: Option<RefreshError>,
}

impl Discovered {
    /// Nothing found yet from `config`.
    pub fn new(config: DiscoveryConfig) -> Self {
        Self {
            config,
            state: Mutex::new(State::default()),
            errors: AtomicU64::new(0),
        }
    }

    /// A copy of the state.
    pub fn state(&self) -> State {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last set found (empty until the source first answered).
    pub fn endpoints(&self) -> Vec<EndpointSpec> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .endpoints
            .clone()
            .unwrap_or_default()
    }

    /// Records that a file source was looked at and had not changed (its last read stands).
    pub(crate) fn unchanged(&self) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_refresh = Some(SystemTime::now());
    }

    /// Records a refresh's result; returns the new set when it differs from the last one.
    pub fn record(
        &self,
        cluster: &str,
        result: Result<Vec<EndpointSpec>, RefreshError>,
    ) -> Option<Vec<EndpointSpec>> {
        let now = SystemTime::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let found = match result {
            Ok(v) if v.is_empty() => Err(Arc::new(NoEndpoint) as RefreshError),
            other => other,
        };
        match found {
            Ok(mut set) => {
                set.sort_by(|a, b| a.address.cmp(&b.address));
                state.last_refresh = Some(now);
                if state.last_error.take().is_some() {
                    tracing::info!(
                        cluster,
                        "discovery: {} answers again",
                        self.config.describe()
                    );
                }
                if state.endpoints.as_ref() == Some(&set) {
                    return None;
                }
                state.endpoints = Some(set.clone());
                state.last_change = Some(now);
                Some(set)
            }
            Err(e) => {
                self.errors.fetch_add(1, Relaxed);
                let kept = state.endpoints.as_ref().map_or(0, Vec::len);
                tracing::warn!(
                    cluster,
                    source = %self.config.describe(),
                    kept,
                    "discovery failed, the last known endpoints stay: {e}"
                );
                state.last_error = Some(e);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_or_empty_refresh_keeps_the_last_set_and_counts() {
        let d = Discovered::new(DiscoveryConfig::Dns {
            name: "a.test".into(),
            port: 80,
            resolver: None,
            refresh: None,
        });
        let set = vec![
            EndpointSpec::new("10.0.0.2:80"),
            EndpointSpec::new("10.0.0.1:80"),
        ];
        let applied = d.record("c", Ok(set)).unwrap();
        assert_eq!(applied[0].address, "10.0.0.1:80", "sorted");
        assert!(d.record("c", Ok(applied.clone())).is_none(), "unchanged");
        let timeout: Box<dyn std::error::Error + Send + Sync> = "timeout".into();
        assert!(d.record("c", Err(timeout.into())).is_none());
        assert!(d.record("c", Ok(Vec::new())).is_none());
        assert_eq!(d.errors.load(Relaxed), 2);
        assert_eq!(d.endpoints(), applied);
        assert_eq!(
            d.state().last_error.map(|e| e.to_string()).as_deref(),
            Some("the answer has no endpoint")
        );
    }
}
