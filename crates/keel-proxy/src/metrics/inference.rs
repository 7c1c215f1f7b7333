//! What inference answers measured (`inference = true` clusters): one answer's measure
//! ([`Measured`], shared by its response body, which fills it, and its record, which logs it)
//! and a cluster's series by model ([`InferenceMetrics`]): time to first token, time between
//! tokens, and tokens by kind. Models are counted under their own name up to [`MAX_MODELS`];
//! later ones under `other`, so that a client naming models at will cannot grow `/metrics`.
//! A cluster with a token budget also counts the tokens its budget charged and the requests it
//! refused (by cluster only: tenants are never labels).

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::text::{header, label, Histogram};

/// Models counted under their own name per cluster; the rest are `other`.
pub const MAX_MODELS: usize = 16;

/// The label of the models past [`MAX_MODELS`].
const OTHER: &str = "other";

/// What one answer measured: set once, when its body ends.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    /// From the request's arrival to the first token (a whole answer: to its end).
    pub ttft: Option<Duration>,
    /// Mean time between two tokens of a stream.
    pub itl: Option<Duration>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// The model the answer named.
    pub model: Option<Box<str>>,
}

/// Where an answer's measure goes when its body ends, for its record to read (the record is
/// written after the body's end by every front end).
pub type MeasuredSlot = Arc<OnceLock<Measured>>;

/// Tokens by kind, as `keel_inference_tokens_total`'s `kind` label names them.
const KINDS: [&str; 3] = ["prompt", "completion", "cached"];

/// One model's series.
#[derive(Debug, Default)]
struct ModelSeries {
    name: OnceLock<Box<str>>,
    answers: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
    tokens: [AtomicU64; 3],
}

/// A cluster's inference series, by model: [`MAX_MODELS`] named, then `other`.
#[derive(Debug)]
pub struct InferenceMetrics {
    models: Box<[ModelSeries]>,
    /// Held only to name a model not seen before.
    naming: Mutex<()>,
    /// The cluster has a token budget (its series are shown).
    pub budgeted: AtomicBool,
    /// Tokens the budget charged, by [`BASES`]: the answers' `usage`, or the estimate of an
    /// answer without one.
    pub budget_tokens: [AtomicU64; 2],
    /// Requests the budget refused.
    pub budget_refused: AtomicU64,
}

/// What a budget's charge was based on, as `keel_token_budget_tokens_total`'s `basis` label
/// names it.
const BASES: [&str; 2] = ["usage", "estimate"];

impl Default for InferenceMetrics {
    fn default() -> Self {
        InferenceMetrics {
            models: (0..=MAX_MODELS).map(|_| ModelSeries::default()).collect(),
            naming: Mutex::new(()),
            budgeted: AtomicBool::new(false),
            budget_tokens: Default::default(),
            budget_refused: AtomicU64::new(0),
        }
    }
}

/// A model's figures for `/status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelView {
    pub model: String,
    pub answers: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    /// Mean time to first token, in milliseconds (`None` before any).
    pub ttft_ms: Option<f64>,
    /// Mean time between tokens, in milliseconds.
    pub itl_ms: Option<f64>,
}

impl InferenceMetrics {
    /// The series of `model` (`None`: the answer named none, counted as `other`).
    fn series(&self, model: Option<&str>) -> &ModelSeries {
        let other = &self.models[MAX_MODELS];
        let Some(model) = model else { return other };
        let named = &self.models[..MAX_MODELS];
        let find = || {
            named
                .iter()
                .take_while(|s| s.name.get().is_some())
                .find(|s| s.name.get().map(|n| &**n) == Some(model))
        };
        if let Some(s) = find() {
            return s;
        }
        let _naming = self.naming.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = find() {
            return s;
        }
        match named.iter().find(|s| s.name.get().is_none()) {
            Some(s) => {
                let _ = s.name.set(model.into());
                s
            }
            None => other,
        }
    }

    /// Counts one measured answer.
    pub fn observe(&self, m: &Measured) {
        let s = self.series(m.model.as_deref());
        s.answers.fetch_add(1, Relaxed);
        if let Some(t) = m.ttft {
            s.ttft.observe(t);
        }
        if let Some(t) = m.itl {
            s.itl.observe(t);
        }
        for (counter, n) in
            s.tokens
                .iter()
                .zip([m.prompt_tokens, m.completion_tokens, m.cached_tokens])
        {
            if let Some(n) = n {
                counter.fetch_add(n, Relaxed);
            }
        }
    }

    /// The models seen (`other` last, if anything was counted there).
    fn seen(&self) -> impl Iterator<Item = (&str, &ModelSeries)> {
        self.models.iter().enumerate().filter_map(|(i, s)| {
            let name = if i == MAX_MODELS {
                (s.answers.load(Relaxed) > 0).then_some(OTHER)?
            } else {
                s.name.get()?
            };
            Some((name, s))
        })
    }

    /// Each model's figures.
    pub fn view(&self) -> Vec<ModelView> {
        let mean_ms = |h: &Histogram| {
            let n = h.count();
            (n > 0).then(|| h.sum_nanos() as f64 / 1e6 / n as f64)
        };
        self.seen()
            .map(|(name, s)| ModelView {
                model: name.to_string(),
                answers: s.answers.load(Relaxed),
                prompt_tokens: s.tokens[0].load(Relaxed),
                completion_tokens: s.tokens[1].load(Relaxed),
                cached_tokens: s.tokens[2].load(Relaxed),
                ttft_ms: mean_ms(&s.ttft),
                itl_ms: mean_ms(&s.itl),
            })
            .collect()
    }
}

/// The inference series of every cluster that has them, by cluster and model (nothing at all
/// when none has).
pub(crate) fn render(out: &mut String, clusters: &[(&str, &InferenceMetrics)]) {
    if clusters.is_empty() {
        return;
    }
    let labels = |cluster: &str, model: &str| {
        format!("cluster=\"{}\",model=\"{}\"", label(cluster), label(model))
    };
    header(
        out,
        "keel_inference_answers_total",
        "counter",
        "Answers of inference requests measured (inference = true clusters), by cluster and model (models past the first 16 of a cluster: other).",
    );
    for (cluster, m) in clusters {
        for (model, s) in m.seen() {
            let _ = writeln!(
                out,
                "keel_inference_answers_total{{{}}} {}",
                labels(cluster, model),
                s.answers.load(Relaxed)
            );
        }
    }
    for (name, help, h) in [
        (
            "keel_inference_time_to_first_token_seconds",
            "Time from an inference request's arrival to its first token (a whole answer: to its end).",
            (|s: &ModelSeries| &s.ttft) as fn(&ModelSeries) -> &Histogram,
        ),
        (
            "keel_inference_inter_token_seconds",
            "Mean time between two tokens of one streamed answer.",
            |s: &ModelSeries| &s.itl,
        ),
    ] {
        header(out, name, "histogram", help);
        for (cluster, m) in clusters {
            for (model, s) in m.seen() {
                h(s).render(out, name, &labels(cluster, model));
            }
        }
    }
    header(
        out,
        "keel_inference_tokens_total",
        "counter",
        "Tokens of inference answers as the engines' usage counted them, by kind: prompt, completion, and cached (prompt tokens the engine's prefix cache held).",
    );
    for (cluster, m) in clusters {
        for (model, s) in m.seen() {
            for (kind, v) in KINDS.iter().zip(&s.tokens) {
                let _ = writeln!(
                    out,
                    "keel_inference_tokens_total{{{},kind=\"{kind}\"}} {}",
                    labels(cluster, model),
                    v.load(Relaxed)
                );
            }
        }
    }
    let budgeted: Vec<_> = clusters
        .iter()
        .filter(|(_, m)| m.budgeted.load(Relaxed))
        .collect();
    if budgeted.is_empty() {
        return;
    }
    header(
        out,
        "keel_token_budget_tokens_total",
        "counter",
        "Tokens charged to the tenants' token budgets, by cluster and basis: usage (prompt + completion of the answer's usage) or estimate (an answer without usage keeps its estimate).",
    );
    for (cluster, m) in &budgeted {
        for (basis, v) in BASES.iter().zip(&m.budget_tokens) {
            let _ = writeln!(
                out,
                "keel_token_budget_tokens_total{{cluster=\"{}\",basis=\"{basis}\"}} {}",
                label(cluster),
                v.load(Relaxed)
            );
        }
    }
    header(
        out,
        "keel_token_budget_refused_total",
        "counter",
        "Requests answered 429 because their tenant's token budget could not cover their estimate, by cluster.",
    );
    for (cluster, m) in &budgeted {
        let _ = writeln!(
            out,
            "keel_token_budget_refused_total{{cluster=\"{}\"}} {}",
            label(cluster),
            m.budget_refused.load(Relaxed)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(model: &str, prompt: u64) -> Measured {
        Measured {
            ttft: Some(Duration::from_millis(20)),
            itl: None,
            prompt_tokens: Some(prompt),
            completion_tokens: Some(1),
            cached_tokens: Some(0),
            model: Some(model.into()),
        }
    }

    #[test]
    fn models_past_the_cap_count_as_other() {
        let m = InferenceMetrics::default();
        for i in 0..MAX_MODELS + 5 {
            m.observe(&answer(&format!("m{i}"), 10));
        }
        m.observe(&answer("m0", 5));
        let view = m.view();
        assert_eq!(view.len(), MAX_MODELS + 1);
        assert_eq!(view[0].model, "m0");
        assert_eq!((view[0].answers, view[0].prompt_tokens), (2, 15));
        let other = view.last().unwrap();
        assert_eq!((other.model.as_str(), other.answers), ("other", 5));
        assert_eq!(view[0].ttft_ms, Some(20.0));
        let mut text = String::new();
        render(&mut text, &[("c", &m)]);
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("keel_inference_answers_total{"))
                .count(),
            MAX_MODELS + 1
        );
        assert!(text.contains(
            "keel_inference_tokens_total{cluster=\"c\",model=\"m0\",kind=\"prompt\"} 15\n"
        ));
    }
}
