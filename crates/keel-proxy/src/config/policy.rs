//! What a route or a cluster does to the requests it serves besides choosing an endpoint:
//! local rate limits (`rate_limit`).

use keel_balance::{InvalidField, Problem};
use serde::Deserialize;

/// `rate_limit = { rate, burst, key, max_keys, per_worker }` on a route or a cluster: a token
/// bucket; a request that finds it empty is answered `429 Too Many Requests` with
/// `Retry-After`, without trying an endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Requests a second the bucket refills with (may be fractional: `0.5` is one every 2 s).
    pub rate: f64,
    /// Most requests taken at once from a full bucket; default: one second's worth
    /// (`rate` rounded up, at least 1).
    #[serde(default)]
    pub burst: Option<u32>,
    /// One bucket per client IP or per value of a header; unset: one bucket for all.
    #[serde(default)]
    pub key: Option<RateKey>,
    /// Most keys followed at once (a keyed limit); beyond, the key closest to a full bucket is
    /// forgotten. Bounds memory whatever the clients send.
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// Each worker thread has its own buckets, each with a worker's share of `rate` and
    /// `burst`: no state shared between threads, the limit exact only when connections spread
    /// evenly. Default: one set of buckets for the proxy.
    #[serde(default)]
    pub per_worker: bool,
}

fn default_max_keys() -> usize {
    10_000
}

/// Most keys a keyed limit may follow.
pub const MAX_RATE_KEYS: usize = 1 << 24;

/// The key of a keyed rate limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateKey {
    /// The client's IP address (the connection's peer).
    ClientIp,
    /// This request header's value (lower-case name); requests without it are not limited.
    Header(hyper::header::HeaderName),
}

impl<'de> Deserialize<'de> for RateKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "client-ip" => Ok(RateKey::ClientIp),
            _ => match s.strip_prefix("header:") {
                Some(name) => hyper::header::HeaderName::from_bytes(name.trim().as_bytes())
                    .map(RateKey::Header)
                    .map_err(|_| {
                        serde::de::Error::custom(format!("`{name}` is not a header name"))
                    }),
                None => Err(serde::de::Error::custom(format!(
                    "unknown key `{s}`; allowed: \"client-ip\", \"header:NAME\""
                ))),
            },
        }
    }
}

impl RateLimitConfig {
    /// The burst in force.
    pub fn burst(&self) -> u32 {
        self.burst
            .unwrap_or_else(|| self.rate.ceil().clamp(1.0, f64::from(u32::MAX)) as u32)
    }

    /// Checks the values; paths are relative to the `rate_limit` table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if !(self.rate.is_finite() && self.rate >= 0.001 && self.rate <= 1e9) {
            return Err(InvalidField::at(
                "rate",
                Problem::out_of_range("within 0.001..=1e9 (requests a second)", self.rate),
            ));
        }
        if self.burst == Some(0) {
            return Err(InvalidField::at(
                "burst",
                Problem::out_of_range("at least 1", 0),
            ));
        }
        if self.max_keys == 0 || self.max_keys > MAX_RATE_KEYS {
            return Err(InvalidField::at(
                "max_keys",
                Problem::out_of_range(format!("within 1..={MAX_RATE_KEYS}"), self.max_keys),
            ));
        }
        Ok(())
    }
}
