//! How a cluster's shared outlier evidence (`[cluster.outlier_detection] shared`) is going:
//! written by `control::evidence`'s task, read by the admin.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// The state of one cluster's evidence exchange.
#[derive(Default)]
pub(crate) struct Evidence {
    state: Mutex<State>,
    /// Batches this proxy published.
    pub published: AtomicU64,
    /// Batches received from other proxies.
    pub received: AtomicU64,
    /// Ejections the others' evidence completed here.
    pub remote_ejections: AtomicU64,
}

/// The mutable part (cold path).
#[derive(Default, Clone)]
pub(crate) struct State {
    /// Connected to etcd: publishing and receiving.
    pub connected: bool,
    /// Why not, when not.
    pub last_error: Option<String>,
    /// Other proxies whose evidence was received since connecting.
    pub peers: usize,
}

impl Evidence {
    /// A copy of the state.
    pub fn state(&self) -> State {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes the state under its lock.
    pub fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()));
    }
}
