//! Token budgets per tenant (`[cluster.token_budget]`): a token bucket per tenant, holding
//! `tokens` and refilling them over `unit`, kept in the rate limits' GCRA table
//! ([`Gcra`]: bounded keys, one word per bucket, a lock per set of 8 keys or none).
//!
//! A request is admitted before its pick on an estimate ([`estimate`]): its body's length in
//! bytes / 4, rounded up, plus its `max_tokens` (or `max_completion_tokens`, else the
//! configured `default_max_tokens`). The estimate is taken from the budget then ([`Charge`]),
//! and when the answer's `usage` is read, the difference to prompt + completion tokens is taken
//! or given back, as of the admission. An answer without `usage` (cut, failed, an error, keel's
//! own) keeps its estimate. A tenant is a header's value or the API key, never kept itself:
//! only its hash, keyed with a secret chosen when the budget is made.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use crate::config::{BudgetKey, TokenBudgetConfig, WithoutKey};
use crate::exchange::head::HeadView;
use crate::metrics::ClusterMetrics;
use crate::policy::rate::{Gcra, Limited, SHARED_KEY};

/// A compiled `token_budget`.
pub(crate) struct TokenBudget {
    pub(crate) config: TokenBudgetConfig,
    /// Tokens each bucket holds (each worker's share, with `per_worker`).
    tokens: u64,
    /// Nanoseconds of refill per token.
    per_token: u64,
    gcra: Gcra,
}

/// A request the budget refused: what it needed, and how long until the budget has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spent {
    /// The request's estimate, in tokens.
    pub estimate: u64,
    pub wait: Limited,
}

/// The estimate of a request whose body is `len` bytes long and asks for `max_tokens`
/// completion tokens (`None`: `default_max_tokens`).
pub(crate) fn estimate(len: u64, max_tokens: Option<u64>, config: &TokenBudgetConfig) -> u64 {
    let prompt = len.div_ceil(keel_balance::prefix::BYTES_PER_TOKEN as u64);
    prompt.saturating_add(max_tokens.unwrap_or(config.default_max_tokens))
}

impl TokenBudget {
    /// The budget of `config` for `workers` worker threads.
    pub fn new(config: &TokenBudgetConfig, workers: usize) -> Self {
        let shares = if config.per_worker { workers.max(1) } else { 1 };
        let tokens = (config.tokens / shares as u64).max(1);
        let per_token = (config.unit.duration().as_nanos() as u64 / tokens).max(1);
        Self {
            config: config.clone(),
            tokens,
            per_token,
            gcra: Gcra::new(
                tokens * per_token,
                shares,
                true,
                config.max_keys.div_ceil(shares),
            ),
        }
    }

    /// The tenant of a request (its head as the client sent it: a rewrite may replace the
    /// key the endpoint gets): its key's hash, [`SHARED_KEY`] for a request without one that
    /// shares a budget, `None` for one that has no budget.
    pub fn tenant(&self, head: HeadView<'_>) -> Option<u64> {
        let key = match &self.config.key {
            BudgetKey::Header(name) => head.value(name.as_str()),
            BudgetKey::ApiKey => head.value("authorization").and_then(bearer),
        };
        match key.filter(|k| !k.is_empty()) {
            Some(k) => Some(self.gcra.key(k)),
            None => match self.config.without_key {
                WithoutKey::Shared => Some(SHARED_KEY),
                WithoutKey::Unlimited => None,
            },
        }
    }

    /// Admits a request of `estimate` tokens at `now` from the budget of `tenant` (of
    /// [`Self::tenant`]): its charge. An estimate above the whole budget is taken as the
    /// whole budget (admitted from a full one), so that no request is refused for ever.
    pub fn admit(
        self: &Arc<Self>,
        worker: usize,
        tenant: u64,
        estimate: u64,
        now: Instant,
        metrics: &Arc<ClusterMetrics>,
    ) -> Result<Charge, Spent> {
        let taken = estimate.min(self.tokens);
        if let Err(wait) = self
            .gcra
            .take(worker, Some(tenant), taken * self.per_token, now)
        {
            let series = metrics.inference.get_or_init(Default::default);
            series.budget_refused.fetch_add(1, Relaxed);
            return Err(Spent { estimate, wait });
        }
        Ok(Charge {
            budget: self.clone(),
            metrics: metrics.clone(),
            worker,
            key: tenant,
            taken,
            settled: false,
        })
    }
}

/// The token of `Authorization: Bearer TOKEN` (the scheme's case ignored).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let (scheme, rest) = value.split_at(value.len().min(7));
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| rest.trim_ascii())
}

/// What a request admitted by a budget took from it: its estimate, until the answer's usage
/// replaces it ([`Charge::settle`]). Dropped unsettled, the estimate stands.
pub(crate) struct Charge {
    budget: Arc<TokenBudget>,
    metrics: Arc<ClusterMetrics>,
    worker: usize,
    key: u64,
    /// Tokens taken at admission.
    taken: u64,
    settled: bool,
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charge")
            .field("taken", &self.taken)
            .finish()
    }
}

impl Charge {
    /// The answer's tokens are known (prompt + completion of its `usage`), or will never be
    /// (`None`): the budget is charged them instead of the estimate, or keeps the estimate.
    pub fn settle(&mut self, used: Option<u64>) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let series = self.metrics.inference.get_or_init(Default::default);
        match used {
            Some(used) => {
                let b = &self.budget;
                let more = i128::from(used) - i128::from(self.taken);
                let nanos =
                    (more * i128::from(b.per_token)).clamp(i64::MIN.into(), i64::MAX.into());
                if nanos != 0 {
                    b.gcra.adjust(self.worker, Some(self.key), nanos as i64);
                }
                series.budget_tokens[0].fetch_add(used, Relaxed);
            }
            None => {
                series.budget_tokens[1].fetch_add(self.taken, Relaxed);
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.settle(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BudgetUnit;
    use std::time::Duration;

    fn config(tokens: u64, unit: BudgetUnit) -> TokenBudgetConfig {
        TokenBudgetConfig {
            tokens,
            unit,
            key: BudgetKey::Header(hyper::header::HeaderName::from_static("x-tenant")),
            without_key: WithoutKey::Shared,
            default_max_tokens: 16,
            max_keys: 64,
            per_worker: false,
        }
    }

    #[test]
    fn usage_replaces_the_estimate_as_of_the_admission() {
        let b = Arc::new(TokenBudget::new(&config(1000, BudgetUnit::Day), 1));
        let m = Arc::new(ClusterMetrics::default());
        let head = HeadView::Lines(b"GET / HTTP/1.1\r\nx-tenant: a\r\n");
        let a = b.tenant(head).unwrap();
        let t0 = Instant::now() + Duration::from_secs(1);
        // 600 estimated, 100 used: 900 left.
        let mut c = b.admit(0, a, 600, t0, &m).unwrap();
        assert!(b.admit(0, a, 500, t0, &m).is_err(), "600 taken");
        c.settle(Some(100));
        let c2 = b.admit(0, a, 900, t0, &m).unwrap();
        drop(c2);
        let spent = b.admit(0, a, 1, t0, &m).unwrap_err();
        // One token of a day's 1000 refills in 86.4 s.
        assert_eq!(spent.wait.seconds(), 87);
        let series = m.inference.get().unwrap();
        assert_eq!(series.budget_tokens[0].load(Relaxed), 100);
        assert_eq!(series.budget_tokens[1].load(Relaxed), 900);
        assert_eq!(series.budget_refused.load(Relaxed), 2);
        // Another tenant has its own; requests without the header share one.
        let other = b.tenant(HeadView::Lines(b"GET / HTTP/1.1\r\nx-tenant: b\r\n"));
        assert!(b.admit(0, other.unwrap(), 1000, t0, &m).is_ok());
        let none = b.tenant(HeadView::Lines(b"GET / HTTP/1.1\r\n"));
        assert_eq!(none, Some(SHARED_KEY));
        let mut c = config(1000, BudgetUnit::Day);
        c.without_key = WithoutKey::Unlimited;
        let free = TokenBudget::new(&c, 1);
        assert_eq!(free.tenant(HeadView::Lines(b"GET / HTTP/1.1\r\n")), None);
    }

    #[test]
    fn the_api_key_is_the_bearer_token() {
        assert_eq!(bearer(b"Bearer sk-abc "), Some(&b"sk-abc"[..]));
        assert_eq!(bearer(b"bearer  sk-abc"), Some(&b"sk-abc"[..]));
        assert_eq!(bearer(b"Basic dXNlcg=="), None);
        assert_eq!(bearer(b"Bear"), None);
    }

    #[test]
    fn the_estimate_is_the_body_in_tokens_and_the_completion_asked() {
        let c = config(10, BudgetUnit::Minute);
        assert_eq!(estimate(401, Some(10), &c), 111);
        assert_eq!(estimate(400, None, &c), 116);
    }
}
