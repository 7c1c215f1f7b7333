//! keel-proxy's tests that read process-wide state (descriptors, resident memory, thread
//! names, latency under a fixed load), in a test binary of their own: the `proxy` binary's
//! tests would disturb them. Each runs through `alone()`, so that they also run one at a time here.

#[path = "../proxy/support/mod.rs"]
mod support;

mod chaos;
mod mirror;
mod proxy_workers;

use std::future::Future;
use std::sync::Mutex;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs a test alone: no other test of this binary runs, nor has a runtime, meanwhile (each
/// runtime's descriptors and threads are process-wide state too, so the runtime is built after
/// the lock is taken). A failed test does not stop the rest: the lock's poison is ignored.
pub fn alone(test: impl Future<Output = ()>) {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a test runtime");
    runtime.block_on(test);
}
