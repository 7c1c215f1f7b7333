//! `[cluster.token_budget]`: tokens per unit of time per tenant, for an `inference = true`
//! cluster. Spelled as Envoy AI Gateway's `BackendTrafficPolicy` rate limit on
//! `llm_total_token` has it where the two meet (`limit.requests` and `limit.unit` are `tokens`
//! and `unit`; a `Distinct` header selector is `key = "header:NAME"`).

use std::time::Duration;

use keel_balance::{InvalidField, Problem};
use serde::Deserialize;

use crate::config::policy::MAX_RATE_KEYS;

/// Most tokens a budget may hold: one token is then at least a nanosecond of refill, whatever
/// the unit (the buckets count time in nanoseconds).
pub const MAX_BUDGET_TOKENS: u64 = 1_000_000_000;

/// `[cluster.token_budget] = { tokens, unit, key, without_key, default_max_tokens, max_keys,
/// per_worker }`: each tenant may spend `tokens` a `unit` (prompt plus completion, as the
/// engines' `usage` counts them). A request is admitted on an estimate from its body before
/// the pick, and its answer's `usage` replaces the estimate after; a tenant whose budget cannot
/// cover a request's estimate gets `429` with `Retry-After`, without trying an engine.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBudgetConfig {
    /// Tokens a tenant may spend in one `unit` (Envoy's `limit.requests` with a `TotalToken`
    /// cost); also the most it may spend at once, from a full budget.
    pub tokens: u64,
    /// `"second"`, `"minute"` (default), `"hour"` or `"day"` (Envoy's `limit.unit`).
    #[serde(default)]
    pub unit: BudgetUnit,
    /// Who a tenant is: `"api-key"` (the `Authorization: Bearer` token) or `"header:NAME"`.
    pub key: BudgetKey,
    /// What a request without the key gets: `"shared"` (default: one budget, of the same size,
    /// for all of them) or `"unlimited"` (no budget).
    #[serde(default)]
    pub without_key: WithoutKey,
    /// Completion tokens assumed by the estimate of a request that names no `max_tokens` (nor
    /// `max_completion_tokens`). Default 256.
    #[serde(default = "default_max_tokens")]
    pub default_max_tokens: u64,
    /// Most tenants followed at once (as `rate_limit`'s `max_keys`). Default 10000.
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// Each worker thread has its own budgets, each with a worker's share of `tokens` (as
    /// `rate_limit`'s `per_worker`). Default: one set for the proxy.
    #[serde(default)]
    pub per_worker: bool,
}

fn default_max_tokens() -> u64 {
    256
}

fn default_max_keys() -> usize {
    10_000
}

/// The time a budget's `tokens` refill in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BudgetUnit {
    /// `"second"` (or Envoy's `Second`).
    #[serde(alias = "Second")]
    Second,
    /// `"minute"` (or `Minute`): tokens per minute, the default.
    #[default]
    #[serde(alias = "Minute")]
    Minute,
    /// `"hour"` (or `Hour`).
    #[serde(alias = "Hour")]
    Hour,
    /// `"day"` (or `Day`).
    #[serde(alias = "Day")]
    Day,
}

impl BudgetUnit {
    /// Its length.
    pub fn duration(self) -> Duration {
        Duration::from_secs(match self {
            BudgetUnit::Second => 1,
            BudgetUnit::Minute => 60,
            BudgetUnit::Hour => 3600,
            BudgetUnit::Day => 86_400,
        })
    }

    /// Its name, as configured.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetUnit::Second => "second",
            BudgetUnit::Minute => "minute",
            BudgetUnit::Hour => "hour",
            BudgetUnit::Day => "day",
        }
    }
}

/// Who a budget's tenant is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetKey {
    /// The bearer token of `Authorization` (OpenAI's API key); only its keyed hash is kept.
    ApiKey,
    /// This request header's value (lower-case name).
    Header(hyper::header::HeaderName),
}

impl<'de> Deserialize<'de> for BudgetKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        match s.as_str() {
            "api-key" => Ok(BudgetKey::ApiKey),
            _ => match s.strip_prefix("header:") {
                Some(name) => hyper::header::HeaderName::from_bytes(name.trim().as_bytes())
                    .map(BudgetKey::Header)
                    .map_err(|_| {
                        serde::de::Error::custom(format!("`{name}` is not a header name"))
                    }),
                None => Err(serde::de::Error::custom(format!(
                    "unknown key `{s}`; allowed: \"api-key\", \"header:NAME\""
                ))),
            },
        }
    }
}

/// What a request without the tenant's key gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WithoutKey {
    /// One budget shared by every request without a key.
    #[default]
    Shared,
    /// No budget.
    Unlimited,
}

impl TokenBudgetConfig {
    /// Checks the values; paths are relative to the `token_budget` table.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.tokens == 0 || self.tokens > MAX_BUDGET_TOKENS {
            return Err(InvalidField::at(
                "tokens",
                Problem::out_of_range(format!("within 1..={MAX_BUDGET_TOKENS}"), self.tokens),
            ));
        }
        if self.default_max_tokens > MAX_BUDGET_TOKENS {
            return Err(InvalidField::at(
                "default_max_tokens",
                Problem::out_of_range(
                    format!("within 0..={MAX_BUDGET_TOKENS}"),
                    self.default_max_tokens,
                ),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProxyConfig;

    const HEAD: &str = "[[listener]]\nlisten = \"127.0.0.1:0\"\ncluster = \"app\"\n\n[[cluster]]\nname = \"app\"\nendpoints = [{ address = \"127.0.0.1:9001\" }]\n";

    #[test]
    fn a_budget_loads_with_its_defaults() {
        let text = format!(
            "{HEAD}inference = true\n[cluster.token_budget]\ntokens = 60000\nkey = \"api-key\"\n"
        );
        let c = ProxyConfig::from_toml_str(&text, "ok.toml").unwrap();
        let b = c.clusters[0].token_budget.clone().unwrap();
        assert_eq!(
            b,
            TokenBudgetConfig {
                tokens: 60000,
                unit: BudgetUnit::Minute,
                key: BudgetKey::ApiKey,
                without_key: WithoutKey::Shared,
                default_max_tokens: 256,
                max_keys: 10_000,
                per_worker: false,
            }
        );
        let text = format!(
            "{HEAD}inference = true\ntoken_budget = {{ tokens = 5, unit = \"Hour\", key = \"header:X-Tenant-Id\", without_key = \"unlimited\" }}\n"
        );
        let b = ProxyConfig::from_toml_str(&text, "ok.toml")
            .unwrap()
            .clusters[0]
            .token_budget
            .clone()
            .unwrap();
        assert_eq!(b.unit, BudgetUnit::Hour);
        assert_eq!(
            b.key,
            BudgetKey::Header(hyper::header::HeaderName::from_static("x-tenant-id"))
        );
        assert_eq!(b.without_key, WithoutKey::Unlimited);
    }

    #[test]
    fn bad_values_are_refused_at_their_key() {
        for (table, key) in [
            (
                "tokens = 0\nkey = \"api-key\"",
                "cluster[0].token_budget.tokens",
            ),
            (
                "tokens = 2000000000\nkey = \"api-key\"",
                "cluster[0].token_budget.tokens",
            ),
            (
                "tokens = 10\nkey = \"api-key\"\nmax_keys = 0",
                "cluster[0].token_budget.max_keys",
            ),
            (
                "tokens = 10\nkey = \"api-key\"\ndefault_max_tokens = 2000000000",
                "cluster[0].token_budget.default_max_tokens",
            ),
            (
                "tokens = 10\nkey = \"cookie:x\"",
                "cluster[0].token_budget.key",
            ),
            (
                "tokens = 10\nkey = \"api-key\"\nunit = \"week\"",
                "cluster[0].token_budget.unit",
            ),
            (
                "tokens = 10\nkey = \"api-key\"\nnonsense = 1",
                "cluster[0].token_budget.nonsense",
            ),
        ] {
            let text = format!("{HEAD}inference = true\n[cluster.token_budget]\n{table}\n");
            let e = ProxyConfig::from_toml_str(&text, "bad.toml").unwrap_err();
            assert_eq!(e.key.as_deref(), Some(key), "{table}: {e}");
        }
        // Charged from `usage`: only where answers are metered.
        let text = format!("{HEAD}[cluster.token_budget]\ntokens = 10\nkey = \"api-key\"\n");
        let e = ProxyConfig::from_toml_str(&text, "bad.toml").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("cluster[0].token_budget"), "{e}");
        assert!(e.to_string().contains("inference = true"), "{e}");
    }
}
