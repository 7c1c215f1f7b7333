//! `[cluster.health_check]` (active health checks) and `[cluster.probe]` (prequal's load
//! probes): how keel asks endpoints about themselves, apart from the requests it forwards.

use std::time::Duration;

use keel_balance::{InvalidField, Problem, StrategyOptions};
use serde::Deserialize;

use crate::config::locate::{none, zero};

/// `[cluster.probe]`: after each pick, a prequal balancer names `probes_per_request` random
/// endpoints, and each gets `GET path` on a connection of its own; the `x-keel-rif` and
/// `x-keel-latency-us` headers of the answer are its load report (`keel backend` answers them
/// at `/keel/load`). Answers to requests carry the same headers and count too.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Path requested. Default `/keel/load`.
    #[serde(default = "default_probe_path")]
    pub path: String,
    /// Endpoints probed after each pick (prequal's `probes_per_pick`), 0 to 16; 0 sends none
    /// (reports come from answers only). Default 3.
    #[serde(default = "default_probes_per_request")]
    pub probes_per_request: u32,
    /// Time allowed for one probe (connect and answer); a late answer is dropped. Default
    /// 100 ms.
    #[serde(
        default = "default_probe_timeout",
        with = "keel_balance::duration_serde"
    )]
    pub timeout: Duration,
}

fn default_probe_path() -> String {
    keel_balance::LOAD_PATH.into()
}
fn default_probes_per_request() -> u32 {
    StrategyOptions::default().probes_per_pick
}
fn default_probe_timeout() -> Duration {
    Duration::from_millis(100)
}

impl Default for ProbeConfig {
    /// `GET /keel/load` to 3 endpoints after each pick, 100 ms to answer.
    fn default() -> Self {
        Self {
            path: default_probe_path(),
            probes_per_request: default_probes_per_request(),
            timeout: default_probe_timeout(),
        }
    }
}

impl ProbeConfig {
    /// Checks the probe settings; paths are relative to `[cluster.probe]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.probes_per_request > 16 {
            return Err(InvalidField::at(
                "probes_per_request",
                Problem::out_of_range("within 0..=16", self.probes_per_request),
            ));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        Ok(())
    }
}

/// `[cluster.health_check]`: a periodic probe of every endpoint: `GET path` (a 2xx answer
/// within the timeout passes), a TCP connect, or gRPC's `grpc.health.v1.Health/Check`
/// (`SERVING` passes).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// `"http"` (default), `"tcp"` (connect only) or `"grpc"` (an h2 or h2c cluster).
    #[serde(default)]
    pub kind: HealthCheckKind,
    /// gRPC: the service asked about (empty: the server as a whole). Default `""`.
    #[serde(default)]
    pub service: String,
    /// Path requested. Default `/healthz`.
    #[serde(default = "default_hc_path")]
    pub path: String,
    /// Time between checks of one endpoint. Default 5 s.
    #[serde(default = "default_hc_interval", with = "keel_balance::duration_serde")]
    pub interval: Duration,
    /// Time allowed for one check (connect, headers and body). Default 1 s.
    #[serde(default = "default_hc_timeout", with = "keel_balance::duration_serde")]
    pub timeout: Duration,
    /// Failed checks in a row that mark a healthy endpoint unhealthy. Default 2.
    #[serde(default = "default_threshold")]
    pub unhealthy_threshold: u32,
    /// Passed checks in a row that mark an unhealthy endpoint healthy again. Default 2.
    #[serde(default = "default_threshold")]
    pub healthy_threshold: u32,
}

/// `kind` of a health check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HealthCheckKind {
    /// `GET path`, 2xx passes.
    #[default]
    Http,
    /// A TCP connect (and TLS handshake with `[cluster.tls]`) passes.
    Tcp,
    /// `grpc.health.v1.Health/Check`, `SERVING` passes.
    Grpc,
}

fn default_hc_path() -> String {
    "/healthz".into()
}
fn default_hc_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_hc_timeout() -> Duration {
    Duration::from_secs(1)
}
fn default_threshold() -> u32 {
    2
}

impl HealthCheckConfig {
    /// Checks the probe settings; paths are relative to `[cluster.health_check]`.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !self.service.is_empty() && self.kind != HealthCheckKind::Grpc {
            return Err(InvalidField::at(
                "service",
                Problem::NotApplicable("`service` is for kind = \"grpc\"".into()),
            ));
        }
        if !self.path.starts_with('/')
            || self.path.parse::<hyper::http::uri::PathAndQuery>().is_err()
        {
            return Err(InvalidField::at(
                "path",
                Problem::Invalid(format!(
                    "`{}` is not a path; it must start with `/`",
                    self.path
                )),
            ));
        }
        if self.interval.is_zero() {
            return Err(zero("interval"));
        }
        if self.timeout.is_zero() {
            return Err(zero("timeout"));
        }
        if self.unhealthy_threshold == 0 {
            return Err(none("unhealthy_threshold"));
        }
        if self.healthy_threshold == 0 {
            return Err(none("healthy_threshold"));
        }
        Ok(())
    }
}

impl Default for HealthCheckConfig {
    /// `GET /healthz` every 5 s, 1 s to answer, 2 to fail and 2 to pass.
    fn default() -> Self {
        HealthCheckConfig {
            kind: HealthCheckKind::default(),
            service: String::new(),
            path: default_hc_path(),
            interval: default_hc_interval(),
            timeout: default_hc_timeout(),
            unhealthy_threshold: default_threshold(),
            healthy_threshold: default_threshold(),
        }
    }
}
