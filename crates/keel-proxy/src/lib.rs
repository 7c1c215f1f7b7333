//! # keel-proxy
//!
//! The network driver of keel-balance: an HTTP reverse proxy. HTTP/1.1 (keel's own codec, over
//! TCP or TLS) and HTTP/2 (the `h2` crate's server) front ends hand every request to one
//! attempt driver, which picks, tries through an upstream leg, retries and answers. (The
//! experiment backend and the load generator its tests and the lab use live in keel-testbed.)
//!
//! Every choice (which endpoint, whether it is ejected, whether a retry fits the budget) is
//! keel-balance's; this crate only calls `pick`, `finish`, `set_healthy` and `RetryBudget`,
//! with time measured from one monotonic epoch taken at [`start`].
//!
//! The crate's rooms (serve, front ends, legs, driver, upstream state, control, observe,
//! config) and a request's path through them: `ARCHITECTURE.md` beside `Cargo.toml`.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let config = keel_proxy::ProxyConfig::from_file("examples/proxy.toml".as_ref())?;
//! let proxy = keel_proxy::start(config).await?;
//! println!("listening on {:?}", proxy.listener_addrs());
//! proxy.shutdown(std::time::Duration::from_secs(10)).await;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod admin;
mod codec;
pub mod config;
mod control;
mod driver;
mod exchange;
mod forward;
mod front;
#[cfg(test)]
mod future_size;
mod io;
mod leg;
mod metrics;
mod observe;
mod policy;
mod route;
mod serve;
mod state;
pub mod tls;
mod upstream;

pub use config::{ConfigError, ProxyConfig};
pub use route::RouteMatcher;
pub use serve::{
    start, start_with, start_with_workers, Drained, ProxyHandle, ProxyRefusals, StartOptions,
};
pub use state::ReloadError;

/// etcd (feature `etcd`): `keel register`'s registration, and the client's errors.
#[cfg(feature = "etcd")]
pub mod etcd {
    pub use crate::control::etcd::{register, EtcdError, Registration};
}
