//! keel on a real three-member etcd cluster on loopback: discovery from a key prefix
//! (adds, removals, lease expiry, a bad value skipped, `register`'s lease), the last set kept and
//! said while every member is down, followed again once they are back; and shared outlier
//! evidence across three proxies.
//!
//! Ignored by a plain `cargo test` (they need Debian's `etcd-server`); `scripts/test-etcd.sh`
//! installs it when missing and runs them. Built only with the `etcd` feature.

mod discovery;
mod evidence;
mod faults;
mod scale;
mod security;

use std::time::Duration;

use etcd_client::{Client, PutOptions};
use keel_proxy::{ProxyConfig, ProxyHandle};
use keel_testbed::etcd::EtcdCluster;

pub use crate::support::*;

/// A three-member cluster (panics with the install hint when `etcd` is missing).
pub fn etcd3() -> EtcdCluster {
    EtcdCluster::start(3).unwrap_or_else(|e| panic!("{e}"))
}

/// A client of `etcd`'s members.
pub async fn client_of(etcd: &EtcdCluster) -> Client {
    Client::connect(etcd.endpoints(), None).await.unwrap()
}

/// Puts `{"address": addr}` under `key`, with `lease` if given.
pub async fn put(c: &mut Client, key: &str, value: &str, lease: Option<i64>) {
    let opts = lease.map(|l| PutOptions::new().with_lease(l));
    c.put(key, value, opts).await.unwrap();
}

/// The endpoint value of `addr`.
pub fn value(addr: std::net::SocketAddr) -> String {
    format!("{{\"address\":\"{addr}\"}}")
}

/// The proxy's endpoints of `cluster`, sorted.
pub fn endpoints(proxy: &ProxyHandle, cluster: &str) -> Vec<String> {
    let mut v: Vec<_> = proxy
        .cluster_status(cluster)
        .unwrap()
        .into_iter()
        .map(|s| s.address)
        .collect();
    v.sort();
    v
}

/// Waits (at most `limit`) until `cluster` has exactly `want`; returns how long it took.
pub async fn follows(
    proxy: &ProxyHandle,
    cluster: &str,
    want: &[std::net::SocketAddr],
    limit: Duration,
) -> Duration {
    let start = std::time::Instant::now();
    let mut want: Vec<String> = want.iter().map(|a| a.to_string()).collect();
    want.sort();
    let ok = eventually(limit, || endpoints(proxy, cluster) == want).await;
    assert!(
        ok,
        "{cluster}: {:?}, want {want:?} within {limit:?}",
        endpoints(proxy, cluster)
    );
    start.elapsed()
}

/// The admin's `/status` as JSON.
pub async fn status(proxy: &ProxyHandle) -> serde_json::Value {
    let text = get(&format!("http://{}/status", proxy.admin_addr().unwrap()))
        .await
        .unwrap()
        .text();
    serde_json::from_str(&text).unwrap()
}

/// A proxy configuration: admin and listener on ephemeral ports, `[etcd]` over `etcd`, top-level
/// `name`, one cluster `api` with `cluster_lines`.
pub fn config(etcd: &EtcdCluster, name: &str, cluster_lines: &str) -> ProxyConfig {
    config_of(&etcd.endpoints(), name, cluster_lines)
}

/// As [`config`], with `[etcd]` naming only `members` (client URLs).
pub fn config_of(members: &[String], name: &str, cluster_lines: &str) -> ProxyConfig {
    let members: Vec<String> = members.iter().map(|e| format!("\"{e}\"")).collect();
    let text = format!(
        "name = \"{name}\"\n\n[etcd]\nendpoints = [{}]\ndial_timeout = \"1s\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\n\n[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"api\"\n\n[[cluster]]\nname = \"api\"\nresponse_headers = {{ endpoint = true }}\n{cluster_lines}\n",
        members.join(", ")
    );
    ProxyConfig::from_toml_str(&text, "etcd.toml")
        .unwrap_or_else(|e| panic!("{e}\n--- config ---\n{text}"))
}
