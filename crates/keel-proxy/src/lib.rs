//! # keel-proxy
//!
//! The network driver of keel-balance: an HTTP reverse proxy. (The experiment backend and the
//! load generator its tests and the lab use live in keel-testbed.)
//!
//! Every choice (which endpoint, whether it is ejected, whether a retry fits the budget) is
//! keel-balance's; this crate only calls `pick`, `finish`, `set_healthy` and `RetryBudget`,
//! with time measured from one monotonic epoch taken at [`start`].
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
pub mod body;
pub mod cluster;
pub mod config;
pub mod forward;
mod h1;
mod health;
pub mod metrics;
pub mod pool;
mod server;
pub mod tls;

pub use config::{ConfigError, ProxyConfig};
pub use server::{start, start_with_workers, ProxyHandle};
