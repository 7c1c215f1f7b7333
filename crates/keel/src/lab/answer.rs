//! What a lab run shows, from its own numbers, said before anything else: the best strategy and
//! protections for each experiment's question, the margin over the alternative with its 95 %
//! interval, and the closed form that predicts it. The terminal and the page open with these
//! findings; `results.json` carries them as `answer`.
//!
//! A margin between two measured success rates gets Newcombe's interval for a difference of
//! proportions, built from the two rates' own (Wilson) intervals; when it contains 0 the two
//! are a tie and the finding says so.

use keel_balance::StrategyKind;
use keel_model::analytic;
use keel_testbed::loadgen::Client;
use serde::Serialize;

use crate::lab::rows::Row;
use crate::lab::tail_rows::{LatencyRow, ReactionRow};

/// One finding: a question of an experiment and its answer.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// `all` for the run's answer, else the experiment (e1..e6b, e8, e9).
    pub experiment: String,
    /// The question it answers.
    pub question: String,
    /// The best strategy.
    pub strategy: String,
    /// Its protections (`none`, `outlier+retry+health`, `keel defaults`).
    pub protections: String,
    /// What it measured: a success rate (E1-E6B), p99 in ms (E8), the slowed server's share of
    /// calls while slow (E9).
    pub value: f64,
    /// Its 95 % interval (null where the run has none).
    pub ci95: Option<[f64; 2]>,
    /// What it is compared with, in words.
    pub versus: Option<String>,
    /// That alternative's value.
    pub versus_value: Option<f64>,
    /// `value - versus_value`.
    pub margin: Option<f64>,
    /// Its 95 % interval.
    pub margin_ci95: Option<[f64; 2]>,
    /// The margin's interval contains 0: the two are a tie.
    pub tie: bool,
    /// The closed form that predicts the best, with its value; null without one.
    pub formula: Option<String>,
    /// The finding in a sentence or three.
    pub text: String,
    /// The run's answer only: in each failure mode measured with the recommended protections,
    /// its row against the best row without them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_failure: Vec<FailureMargin>,
}

/// One failure mode of the answer: the recommendation's row against the best row without
/// protections that the run measured in the same failure mode.
#[derive(Debug, Clone, Serialize)]
pub struct FailureMargin {
    /// The failure mode, in keel's vocabulary.
    pub failure_mode: String,
    /// The protected row's strategy.
    pub strategy: String,
    /// Its measured success and 95 % interval.
    pub value: f64,
    pub ci95: [f64; 2],
    /// The best row without protections in that failure mode, in words, and its experiment.
    pub versus: String,
    pub versus_experiment: String,
    pub versus_value: f64,
    /// `value - versus_value`, Newcombe's 95 % interval, and whether it contains 0.
    pub margin: f64,
    pub margin_ci95: [f64; 2],
    pub tie: bool,
    /// The closed form that the protected row's interval holds, else the unprotected row's.
    pub formula: Option<String>,
}

impl Finding {
    /// A finding whose best is `best`, measured by its success, not yet compared with anything
    /// (no margin) and without its text.
    fn of(experiment: &str, question: &str, strategy: String, best: &Row) -> Finding {
        let mut f = Finding::new(
            experiment,
            question,
            strategy,
            best.protections.clone(),
            best.measured,
            Some(best.measured_ci95),
        );
        f.formula = formula(best);
        f
    }

    /// A finding whose best measured `value` (with its interval), not yet compared with
    /// anything, without a formula or text.
    pub(crate) fn new(
        experiment: &str,
        question: &str,
        strategy: String,
        protections: String,
        value: f64,
        ci95: Option<[f64; 2]>,
    ) -> Finding {
        Finding {
            experiment: experiment.into(),
            question: question.into(),
            strategy,
            protections,
            value,
            ci95,
            versus: None,
            versus_value: None,
            margin: None,
            margin_ci95: None,
            tie: false,
            formula: None,
            text: String::new(),
            by_failure: Vec::new(),
        }
    }

    /// Compared with `versus` (its value `value`): the margin, its interval and whether it is a
    /// tie.
    pub(crate) fn against(
        &mut self,
        versus: String,
        value: f64,
        margin: f64,
        ci: Option<[f64; 2]>,
        tie: bool,
    ) {
        self.versus = Some(versus);
        self.versus_value = Some(value);
        self.margin = Some(margin);
        self.margin_ci95 = ci;
        self.tie = tie;
    }
}

/// Newcombe's 95 % interval of `a - b` from the two rates' own 95 % intervals.
pub(crate) fn difference_ci(a: f64, a_ci: [f64; 2], b: f64, b_ci: [f64; 2]) -> [f64; 2] {
    let d = a - b;
    let below = ((a - a_ci[0]).powi(2) + (b_ci[1] - b).powi(2)).sqrt();
    let above = ((a_ci[1] - a).powi(2) + (b - b_ci[0]).powi(2)).sqrt();
    [d - below, d + above]
}

pub(crate) fn ci_text(ci: [f64; 2]) -> String {
    format!("[{:.4}, {:.4}]", ci[0], ci[1])
}

pub(crate) fn margin_text(m: f64, ci: [f64; 2]) -> String {
    format!("{m:+.4} [{:+.4}, {:+.4}]", ci[0], ci[1])
}

/// A row's strategy, with its tie-break and where the failed server sits when client-side.
fn who(r: &Row) -> String {
    match (&r.tie_break, &r.failed_position) {
        (Some(t), Some(pos)) => format!("{} ({t} ties, failed server {pos})", r.strategy),
        _ => r.strategy.clone(),
    }
}

fn with_protections(r: &Row) -> String {
    if r.protections == "none" {
        format!("{} without protections", who(r))
    } else {
        format!("{} with {}", who(r), r.protections)
    }
}

fn kind(name: &str) -> Option<StrategyKind> {
    StrategyKind::ALL.into_iter().find(|k| k.name() == name)
}

/// The closed form of an unprotected row, in words, with its value at the row's p, q and k.
fn formula(r: &Row) -> Option<String> {
    let a = r.analytic?;
    let k = r.k;
    if let Some(share) = r.key_share.filter(|_| r.protections == "none") {
        return Some(format!(
            "one key per request, so 1 minus the failed server's share of the row's keys on the \
             ring, 1 - {share:.4} = {a:.4}"
        ));
    }
    if r.client == Client::AllCalls.name() && (a - (1.0 - f64::from(k) * r.p)).abs() < 1e-12 {
        return Some(format!(
            "{} clients in step: a request's {k} calls on {k} distinct servers, 1 - k p = {a:.4}",
            r.concurrency
        ));
    }
    Some(match kind(&r.strategy)? {
        StrategyKind::LeastConnections => format!(
            "least-connections' (1 - p / (p + q (1 - p)))^k at p = {:.2}, q = {}, k = {k}: {a:.4}",
            r.p,
            crate::lab::style::fmt_q(r.q?)
        ),
        _ if r.protections != "none" => {
            let m = r.measured_attempts.len() as u64;
            let failed = (r.p * m as f64).round() as u64;
            // A 500 is not in the default `retry_on_status`: such a row's closed form has no
            // retry (what outlier detection adds is not in it).
            let not_retried = r.failure_mode == "server-error";
            let retries = if not_retried {
                0
            } else if r.protections == "keel defaults" {
                crate::lab::cases::DEFAULT_RETRIES
            } else {
                crate::lab::cases::PROTECTIONS.retries
            };
            format!(
                "{}with {retries} {} on distinct servers a call fails with C({failed}, {r1}) / \
                 C({m}, {r1}) = {:.4}, so (1 - that)^{k} = {a:.4}{}",
                if not_retried {
                    "a 500 is not retried (retry_on_status 502, 503, 504): "
                } else {
                    ""
                },
                if retries == 1 { "retry" } else { "retries" },
                analytic::retry_call_failure(m, failed, u64::from(retries)),
                if not_retried {
                    "; outlier detection, which takes the server out after its first failures, \
                     is what lifts the measurement above it"
                } else {
                    ""
                },
                r1 = retries + 1
            )
        }
        _ => format!("(1 - p)^k at p = {:.2}, k = {k}: {a:.4}", r.p),
    })
}

/// `best` against `other`: margin, interval, tie.
fn compare(best: &Row, other: &Row) -> ([f64; 2], f64, bool) {
    let m = best.measured - other.measured;
    let ci = difference_ci(
        best.measured,
        best.measured_ci95,
        other.measured,
        other.measured_ci95,
    );
    (ci, m, ci[0] <= 0.0)
}

fn by_success(a: &&Row, b: &&Row) -> std::cmp::Ordering {
    b.measured
        .total_cmp(&a.measured)
        .then(b.measured_ci95[0].total_cmp(&a.measured_ci95[0]))
}

/// A finding that ranks `rows` by measured success: the best against the runner-up.
fn ranked(experiment: &str, question: &str, rows: &[&Row], lead: &str) -> Option<Finding> {
    let mut sorted = rows.to_vec();
    sorted.sort_by(by_success);
    let best = *sorted.first()?;
    let mut f = Finding::of(experiment, question, who(best), best);
    let mut text = format!(
        "{lead}{} is best at {:.4} {}",
        with_protections(best),
        best.measured,
        ci_text(best.measured_ci95)
    );
    // The runner-up is another strategy in the same failure mode: a row is never compared with
    // itself under another failure.
    let rivals: Vec<&Row> = sorted
        .iter()
        .copied()
        .filter(|r| r.failure_mode == best.failure_mode && who(r) != who(best))
        .collect();
    let modes = sorted.iter().any(|r| r.failure_mode != best.failure_mode);
    if modes {
        text.push_str(&format!(
            " with the server {}",
            mode_words(&best.failure_mode)
        ));
    }
    if let Some(next) = rivals.first() {
        let (ci, m, tie) = compare(best, next);
        f.against(with_protections(next), next.measured, m, Some(ci), tie);
        text.push_str(&format!(
            ", {} {} ahead of {} ({:.4}){}",
            if tie { "a tie:" } else { "" },
            margin_text(m, ci),
            who(next),
            next.measured,
            if tie {
                ", the interval of the margin contains 0"
            } else {
                ""
            }
        ));
        if let Some(worst) = rivals
            .last()
            .filter(|w| rivals.len() > 1 && w.measured < next.measured)
        {
            text.push_str(&format!("; {} lowest at {:.4}", who(worst), worst.measured));
        }
    }
    text.push('.');
    if let Some(fm) = &f.formula {
        text.push_str(&format!(" Closed form: {fm}."));
    }
    f.text = text.replace("  ", " ");
    Some(f)
}

/// Rows with one of five servers failed, k = 3 calls, through the proxy: the source's example.
fn source_example(r: &Row) -> bool {
    r.placement == "server-side"
        && r.measured_attempts.len() == 5
        && (r.p - 0.2).abs() < 1e-9
        && r.k == 3
}

/// The run's answer: which protections and strategy keep success highest when a server fails,
/// and, in each failure mode measured with them, by how much over the best choice without them.
fn headline(rows: &[Row]) -> Option<Finding> {
    let example: Vec<&Row> = rows.iter().filter(|r| source_example(r)).collect();
    let protected: Vec<&Row> = example
        .iter()
        .copied()
        .filter(|r| r.protections != "none")
        .collect();
    let bare: Vec<&Row> = example
        .iter()
        .copied()
        .filter(|r| r.protections == "none")
        .collect();
    if protected.is_empty() {
        return headline_without_protections(&bare);
    }
    // The recommended set is the one measured in the most failure modes (its claims cover the
    // most), then the one whose lowest row is highest. Its claims are about itself only: rows
    // of another set are stated apart, each with what it measured.
    let modes_of = |set: &str| -> Vec<&str> {
        let mut modes: Vec<&str> = Vec::new();
        for r in protected.iter().filter(|r| r.protections == set) {
            if !modes.contains(&r.failure_mode.as_str()) {
                modes.push(&r.failure_mode);
            }
        }
        modes
    };
    let lowest_of = |set: &str| {
        protected
            .iter()
            .filter(|r| r.protections == set)
            .map(|r| r.measured)
            .fold(f64::INFINITY, f64::min)
    };
    let set = protected
        .iter()
        .map(|r| r.protections.as_str())
        .max_by(|a, b| {
            modes_of(a)
                .len()
                .cmp(&modes_of(b).len())
                .then(lowest_of(a).total_cmp(&lowest_of(b)))
        })?
        .to_string();
    let modes = modes_of(&set);
    let others = other_sets(&protected, &set);
    let protected: Vec<&Row> = protected
        .into_iter()
        .filter(|r| r.protections == set)
        .collect();
    // Each strategy's worst row; the strategies measured in every failure mode of the set come
    // first, then the highest worst.
    let modes_measured = |strategy: &str| {
        modes
            .iter()
            .filter(|m| {
                protected
                    .iter()
                    .any(|r| r.strategy == strategy && r.failure_mode == **m)
            })
            .count()
    };
    let mut worst_per_strategy: Vec<&Row> = Vec::new();
    for r in &protected {
        match worst_per_strategy
            .iter_mut()
            .find(|w| w.strategy == r.strategy)
        {
            Some(w) if r.measured < w.measured => *w = r,
            Some(_) => {}
            None => worst_per_strategy.push(r),
        }
    }
    worst_per_strategy.sort_by(|a, b| {
        modes_measured(&b.strategy)
            .cmp(&modes_measured(&a.strategy))
            .then(by_success(a, b))
    });
    let best = worst_per_strategy[0];
    let everywhere: Vec<&str> = worst_per_strategy
        .iter()
        .filter(|w| modes_measured(&w.strategy) == modes.len())
        .map(|w| w.strategy.as_str())
        .collect();
    let tied = worst_per_strategy
        .get(1)
        .is_some_and(|next| modes_measured(&next.strategy) == modes.len() && compare(best, next).2);
    let lowest = protected
        .iter()
        .copied()
        .min_by(|a, b| a.measured.total_cmp(&b.measured))?;
    let lowest_bound = protected
        .iter()
        .map(|r| r.measured_ci95[0])
        .fold(f64::INFINITY, f64::min);
    let mut f = Finding::of(
        "all",
        "Which strategy and protections keep requests succeeding when one of five servers fails?",
        best.strategy.clone(),
        best,
    );
    // What was measured, failure mode by failure mode: the strategies each ran with the set.
    let measured_with: Vec<String> = modes
        .iter()
        .map(|m| {
            let names: Vec<&str> = protected
                .iter()
                .filter(|r| r.failure_mode == *m)
                .map(|r| r.strategy.as_str())
                .collect();
            if names.len() == everywhere.len() && everywhere.len() == worst_per_strategy.len() {
                (*m).to_string()
            } else {
                format!("{m} ({})", names.join(", "))
            }
        })
        .collect();
    let mut text = format!(
        "Use {} with {}: with one of 5 servers failed and {} calls per request, {} kept success \
         at {:.4} or more (lowest 95% bound {:.4}) in the {} failure mode{} measured with them: {}.",
        best.protections,
        if everywhere.len() < 2 {
            best.strategy.clone()
        } else if tied {
            format!("any of {} (a tie under protections)", everywhere.join(", "))
        } else {
            format!("{} (best at worst, {:.4})", best.strategy, best.measured)
        },
        best.k,
        if worst_per_strategy.len() > 1 {
            format!("the {} strategies measured", worst_per_strategy.len())
        } else {
            "it".into()
        },
        lowest.measured,
        lowest_bound,
        modes.len(),
        if modes.len() == 1 { "" } else { "s" },
        measured_with.join(", "),
    );
    // Each failure mode: the recommendation (or, where it did not run, the set's best row)
    // against the best row without protections in that mode, never a row against itself.
    let mut margins: Vec<FailureMargin> = Vec::new();
    let mut unmatched: Vec<&str> = Vec::new();
    for mode in &modes {
        let in_mode = |r: &&&Row| r.failure_mode == *mode;
        let Some(without) = bare.iter().filter(in_mode).min_by(|a, b| by_success(a, b)) else {
            unmatched.push(mode);
            continue;
        };
        let with = protected
            .iter()
            .filter(in_mode)
            .filter(|r| r.strategy == best.strategy)
            .min_by(|a, b| a.measured.total_cmp(&b.measured))
            .or_else(|| {
                protected
                    .iter()
                    .filter(in_mode)
                    .min_by(|a, b| by_success(a, b))
            })?;
        let (ci, m, tie) = compare(with, without);
        margins.push(FailureMargin {
            failure_mode: (*mode).to_string(),
            strategy: with.strategy.clone(),
            value: with.measured,
            ci95: with.measured_ci95,
            versus: with_protections(without),
            versus_experiment: without.experiment.clone(),
            versus_value: without.measured,
            margin: m,
            margin_ci95: ci,
            tie,
            // The protected row's closed form where its interval holds it; else the one the
            // protections beat (ejection, which lifts a 500's row, has no closed form here).
            formula: formula(with)
                .filter(|_| {
                    with.analytic
                        .is_some_and(|a| with.measured_ci95[0] <= a && a <= with.measured_ci95[1])
                })
                .map(|f| format!("with them, {f}"))
                .or_else(|| formula(without).map(|f| format!("without them, {f}"))),
        });
    }
    // The headline margin is the failure mode where the protections gain most surely (the
    // largest lower bound): a tie is the headline only when every mode is one. The others
    // follow it, each with its own numbers.
    margins.sort_by(|a, b| b.margin_ci95[0].total_cmp(&a.margin_ci95[0]));
    if let Some(top) = margins.first() {
        f.strategy = top.strategy.clone();
        f.value = top.value;
        f.ci95 = Some(top.ci95);
        f.against(
            top.versus.clone(),
            top.versus_value,
            top.margin,
            Some(top.margin_ci95),
            top.tie,
        );
        f.formula = top.formula.clone();
        let parts: Vec<String> = margins
            .iter()
            .map(|g| {
                format!(
                    "{}: {} {:.4} against {} {:.4} ({}), {}{}",
                    mode_words(&g.failure_mode),
                    g.strategy,
                    g.value,
                    g.versus,
                    g.versus_value,
                    g.versus_experiment.to_uppercase(),
                    margin_text(g.margin, g.margin_ci95),
                    if g.tie { " (a tie)" } else { "" }
                )
            })
            .collect();
        text.push_str(&format!(
            " Against the best choice without them, in each failure mode: {}.",
            parts.join("; ")
        ));
    }
    if !unmatched.is_empty() {
        text.push_str(&format!(
            " Not compared (no row without protections in this run): {}.",
            unmatched.join(", ")
        ));
    }
    if margins.is_empty() {
        text.push_str(" This run measured no strategy without protections to compare with.");
    }
    if let Some(fm) = &f.formula {
        text.push_str(&format!(" Closed form: {fm}."));
    }
    text.push_str(&others);
    f.text = text;
    f.by_failure = margins;
    Some(f)
}

/// One sentence for each protection set other than `set`: what it kept, in which failure
/// modes, with which strategies (as measured, nothing more).
fn other_sets(protected: &[&Row], set: &str) -> String {
    let mut sets: Vec<&str> = Vec::new();
    for r in protected {
        if r.protections != set && !sets.contains(&r.protections.as_str()) {
            sets.push(&r.protections);
        }
    }
    let mut out = String::new();
    for s in sets {
        let rows: Vec<&&Row> = protected.iter().filter(|r| r.protections == s).collect();
        let mut modes: Vec<&str> = Vec::new();
        let mut strategies: Vec<&str> = Vec::new();
        for r in &rows {
            if !modes.contains(&r.failure_mode.as_str()) {
                modes.push(&r.failure_mode);
            }
            if !strategies.contains(&r.strategy.as_str()) {
                strategies.push(&r.strategy);
            }
        }
        let lowest = rows
            .iter()
            .map(|r| r.measured)
            .fold(f64::INFINITY, f64::min);
        out.push_str(&format!(
            " With {s}: {} kept success at {lowest:.4} or more in {} failure mode{} ({}).",
            strategies.join(", "),
            modes.len(),
            if modes.len() == 1 { "" } else { "s" },
            modes.join(", "),
        ));
    }
    out
}

fn mode_words(mode: &str) -> String {
    match mode {
        "hang" => "hanging".into(),
        "fail-fast" => "failing fast (503 at once)".into(),
        "refuse" => "refusing connections".into(),
        "reset" => "resetting connections".into(),
        "server-error" => "answering 500 at once".into(),
        other => format!("as {other}"),
    }
}

/// Without protected rows: per failure mode, the best strategy.
fn headline_without_protections(bare: &[&Row]) -> Option<Finding> {
    let mut modes: Vec<&str> = Vec::new();
    for r in bare {
        if !modes.contains(&r.failure_mode.as_str()) {
            modes.push(&r.failure_mode);
        }
    }
    // The failure mode with the widest spread between strategies decides the most.
    let spread = |mode: &str| {
        let xs: Vec<f64> = bare
            .iter()
            .filter(|r| r.failure_mode == mode)
            .map(|r| r.measured)
            .collect();
        xs.iter().copied().fold(0.0, f64::max) - xs.iter().copied().fold(1.0, f64::min)
    };
    let mode = modes
        .iter()
        .copied()
        .max_by(|a, b| spread(a).total_cmp(&spread(b)))?;
    let rows: Vec<&Row> = bare
        .iter()
        .copied()
        .filter(|r| r.failure_mode == mode)
        .collect();
    let mut f = ranked(
        "all",
        "Which strategy keeps requests succeeding when one of five servers fails?",
        &rows,
        &format!("Without protections, with a server {}: ", mode_words(mode)),
    )?;
    f.text.push_str(
        " This run measured no protections; with them (keel lab --experiments e6) every strategy \
         is expected to reach 0.999.",
    );
    Some(f)
}

/// The findings of E1-E6B: the run's answer first, then one per experiment.
pub fn reliability(all_rows: &[Row]) -> Vec<Finding> {
    // Rankings and the headline compare what applications see: requests that stop at their
    // first failed call. The all-calls rows (the model's client) have a finding of their own.
    let app: Vec<Row> = all_rows
        .iter()
        .filter(|r| r.client == Client::StopsAtFirstFailure.name())
        .cloned()
        .collect();
    let rows = &app[..];
    let mut out: Vec<Finding> = headline(rows).into_iter().collect();
    let of = |e: &str| -> Vec<&Row> { rows.iter().filter(|r| r.experiment == e).collect() };
    out.extend(ranked(
        "e1",
        "Which strategy without protections when a server fails?",
        &of("e1"),
        "E1: ",
    ));
    out.extend(clients(all_rows));
    out.extend(e2(rows));
    out.extend(e3(&of("e3")));
    out.extend(ranked(
        "e4",
        "Which strategy avoids a server that fails fast (q < 1)?",
        &of("e4"),
        "E4 (fast failure): ",
    ));
    out.extend(e5(&of("e5")));
    out.extend(protected("e6", &of("e6"), rows));
    out.extend(protected("e6b", &of("e6b"), rows));
    if !of("e6b").is_empty() {
        out.push(failing_forever());
    }
    out
}

/// Round-robin's rows with one failing fast, made by both clients: what the rotation does to a
/// client that makes all k calls, against one that stops at its first failure.
fn clients(rows: &[Row]) -> Option<Finding> {
    let in_step = |r: &Row| r.concurrency <= crate::lab::rotation::IN_STEP_CLIENTS;
    let all = rows.iter().find(|r| {
        r.client == Client::AllCalls.name()
            && r.strategy == "round-robin"
            && r.protections == "none"
            && !in_step(r)
    })?;
    let stepped = rows.iter().find(|r| {
        r.client == Client::AllCalls.name()
            && r.strategy == "round-robin"
            && r.protections == "none"
            && in_step(r)
    });
    let stops = rows.iter().find(|r| {
        r.client == Client::StopsAtFirstFailure.name()
            && r.experiment == all.experiment
            && r.strategy == all.strategy
            && r.failure_mode == all.failure_mode
            && r.protections == "none"
    })?;
    let mut f = Finding::of(
        &all.experiment,
        "Does the client that makes all k calls measure what the application's client does?",
        all.strategy.clone(),
        all,
    );
    let (ci, m, tie) = compare(all, stops);
    f.against(
        format!("{} stopping at the first failure", who(stops)),
        stops.measured,
        m,
        Some(ci),
        tie,
    );
    let mut text = format!(
        "Clients: {} with all {} calls made measured {:.4} {}, stopping at the first failure \
         {:.4} {} ({}{}).",
        who(all),
        all.k,
        all.measured,
        ci_text(all.measured_ci95),
        stops.measured,
        ci_text(stops.measured_ci95),
        margin_text(m, ci),
        if tie { ", a tie" } else { "" }
    );
    if let Some((measured, independent)) = all.repeat_failures() {
        text.push_str(&format!(
            " A failed request of the all-calls client failed {measured:.3} times on average \
             against {independent:.3} for independent calls"
        ));
        if let Some(sim) = all.simulated_repeat_failures() {
            text.push_str(&format!(
                " and {sim:.3} in the simulation, where the rotation sends the call after a fast \
                 failure to the next, healthy server (simulated {:.4})",
                all.simulated
            ));
        }
        text.push_str(
            ": the further from independent, the more of the rotation's effect the real loop \
             keeps.",
        );
    }
    if let Some(st) = stepped {
        text.push_str(&format!(
            " With {} all-calls clients, whose picks keep their order, the rotation shows in \
             full: {:.4} {}, closed form 1 - k p = {:.4}{}.",
            st.concurrency,
            st.measured,
            ci_text(st.measured_ci95),
            1.0 - f64::from(st.k) * st.p,
            st.repeat_failures()
                .map(|(m, _)| format!(" (m = {m:.3})"))
                .unwrap_or_default()
        ));
    }
    f.formula = Some(format!(
        "stopping at the first failure, (1 - p)^k = {:.4}; all calls, 1 - k s / m (s: share of \
         calls failed, m: failed calls per failed request), at least 1 - k p = {:.4}",
        (1.0 - all.p).powi(all.k as i32),
        1.0 - f64::from(all.k) * all.p
    ));
    f.text = text;
    Some(f)
}

/// One endpoint of five answering with a failure forever under steady traffic, through keel's
/// balancer with the default outlier detection on a virtual clock (100 calls a second,
/// round-robin, two hours): the failed calls it costs in the first hour and in the second.
pub(crate) fn failures_per_hour() -> (u64, u64) {
    use keel_balance::PickContext;
    use keel_balance::{Balancer, BalancerConfig, EndpointSpec, Outcome, OutlierConfig};
    use std::time::Duration;
    let mut cfg = BalancerConfig::new(StrategyKind::RoundRobin);
    cfg.outlier_detection = Some(OutlierConfig::default());
    let specs: Vec<EndpointSpec> = (0..5)
        .map(|i| EndpointSpec::new(format!("127.0.0.1:{}", 9001 + i)))
        .collect();
    let b = Balancer::new(cfg, &specs).expect("a valid balancer");
    let mut hours = [0u64; 2];
    for tick in 0..2 * 3600 * 100u64 {
        let now = Duration::from_millis(tick * 10);
        let Some(p) = b.pick(&PickContext::new(now)) else {
            continue;
        };
        let failed = p.index() == 4;
        hours[(tick / (3600 * 100)) as usize] += u64::from(failed);
        let outcome = if failed {
            Outcome::Failure
        } else {
            Outcome::Success
        };
        b.finish(p, outcome, now + Duration::from_millis(4));
    }
    (hours[0], hours[1])
}

/// The finding of [`failures_per_hour`].
fn failing_forever() -> Finding {
    let (first, second) = failures_per_hour();
    let mut f = Finding::new(
        "e6b",
        "What does an endpoint that answers 500 forever cost in an hour?",
        "round-robin".into(),
        "keel defaults".into(),
        second as f64,
        None,
    );
    f.text = format!(
        "E6B over hours: one endpoint of five failing forever, 100 calls a second, keel's \
         default outlier detection (keel-balance on a virtual clock): {first} failed calls in the \
         first hour, {second} an hour after. Each return is half-open, so one failure ejects it \
         again, for 30 s x ejections up to 300 s: 5 for the first ejection, then one per return."
    );
    f
}

/// The findings of E8 and E9.
pub fn latency(tail: &[LatencyRow], reaction: &[ReactionRow]) -> Vec<Finding> {
    e8(tail).into_iter().chain(e9(reaction)).collect()
}

/// E2: least-connections when a server hangs, against round-robin measured at the same p (E3)
/// or, when the run has none, round-robin's closed form.
fn e2(rows: &[Row]) -> Option<Finding> {
    let lc = rows.iter().find(|r| r.experiment == "e2")?;
    let rr = rows.iter().find(|r| {
        r.strategy == "round-robin"
            && r.failure_mode == lc.failure_mode
            && r.protections == "none"
            && (r.p - lc.p).abs() < 1e-9
            && r.k == lc.k
    });
    let mut f = ranked(
        "e2",
        "Least-connections when a server hangs?",
        &[lc],
        "E2 (a server hangs): ",
    )?;
    let (versus, v, ci) = match rr {
        Some(rr) => (
            format!("round-robin measured ({})", rr.experiment.to_uppercase()),
            rr.measured,
            difference_ci(lc.measured, lc.measured_ci95, rr.measured, rr.measured_ci95),
        ),
        None => {
            let v = (1.0 - lc.p).powi(lc.k as i32);
            (
                "round-robin's closed form (1 - p)^k".to_string(),
                v,
                [lc.measured_ci95[0] - v, lc.measured_ci95[1] - v],
            )
        }
    };
    let m = lc.measured - v;
    f.against(versus.clone(), v, m, Some(ci), ci[0] <= 0.0);
    f.text = format!(
        "E2 (a server hangs): least-connections measured {:.4} {}, {} over {versus}, {v:.4}: a \
         hung server holds its calls, so least-connections sends it few. Closed form: {}.",
        lc.measured,
        ci_text(lc.measured_ci95),
        margin_text(m, ci),
        f.formula.clone().unwrap_or_else(|| "none".into())
    );
    Some(f)
}

/// E3: least-connections against round-robin at every p, the smallest margin.
fn e3(rows: &[&Row]) -> Option<Finding> {
    let mut pairs: Vec<(&Row, &Row)> = Vec::new();
    for lc in rows
        .iter()
        .filter(|r| r.strategy == "least-connections" && r.p > 0.0)
    {
        if let Some(rr) = rows
            .iter()
            .find(|r| r.strategy == "round-robin" && (r.p - lc.p).abs() < 1e-9)
        {
            pairs.push((lc, rr));
        }
    }
    let (lc, rr) = pairs
        .iter()
        .copied()
        .min_by(|a, b| (a.0.measured - a.1.measured).total_cmp(&(b.0.measured - b.1.measured)))?;
    let (ci, m, tie) = compare(lc, rr);
    let range: Vec<String> = pairs
        .iter()
        .map(|(l, r)| format!("p = {:.1}: {:+.3}", l.p, l.measured - r.measured))
        .collect();
    Some(Finding {
        experiment: "e3".into(),
        question: "As more servers hang, does least-connections stay ahead of round-robin?".into(),
        strategy: lc.strategy.clone(),
        protections: lc.protections.clone(),
        value: lc.measured,
        ci95: Some(lc.measured_ci95),
        versus: Some(format!("round-robin at p = {:.1}", rr.p)),
        versus_value: Some(rr.measured),
        margin: Some(m),
        margin_ci95: Some(ci),
        tie,
        formula: formula(lc),
        text: format!(
            "E3 (0 to 4 of 5 servers hang): least-connections ahead of round-robin at every p \
             measured ({}); its smallest margin, at p = {:.1}, is {}{}. Closed form: {}.",
            range.join(", "),
            lc.p,
            margin_text(m, ci),
            if tie { " (a tie)" } else { "" },
            formula(lc).unwrap_or_else(|| "none".into())
        ),
        by_failure: Vec::new(),
    })
}

/// E5: the tie-break whose worst case is best, against the other's worst case.
fn e5(rows: &[&Row]) -> Option<Finding> {
    let mut worst: Vec<&Row> = Vec::new();
    for r in rows {
        match worst.iter_mut().find(|w| w.tie_break == r.tie_break) {
            Some(w) if r.measured < w.measured => *w = r,
            Some(_) => {}
            None => worst.push(r),
        }
    }
    worst.sort_by(by_success);
    let best = *worst.first()?;
    let tie_of = |r: &Row| r.tie_break.clone().unwrap_or_default();
    let mut f = Finding::of(
        "e5",
        "Client-side least-connections with one call in flight per client: which tie-break?",
        who(best),
        best,
    );
    f.formula = Some(format!(
        "every count is 0 at a pick, so random ties spread calls as random picks do: (1 - p)^k = \
         {:.4}",
        (1.0 - best.p).powi(best.k as i32)
    ));
    let mut text = format!(
        "E5 (client-side, one call in flight per client): {} ties are best in the worst case, \
         {:.4} {}",
        tie_of(best),
        best.measured,
        ci_text(best.measured_ci95)
    );
    if let Some(other) = worst.get(1) {
        let (ci, m, tie) = compare(best, other);
        f.against(
            format!("{} ties at worst ({})", tie_of(other), who(other)),
            other.measured,
            m,
            Some(ci),
            tie,
        );
        text.push_str(&format!(
            ", {} over {} ties at worst ({:.4}, {}): lowest-index succeeds or fails by where the \
             failed server is listed",
            margin_text(m, ci),
            tie_of(other),
            other.measured,
            who(other)
        ));
    }
    text.push_str(&format!(
        ". Closed form: {}.",
        f.formula.clone().unwrap_or_default()
    ));
    f.text = text;
    Some(f)
}

/// E6 and E6B: protections on; their worst row, and the margin over the same strategy and
/// failure without protections where this run measured it.
fn protected(e: &str, rows: &[&Row], all: &[Row]) -> Option<Finding> {
    let worst = rows
        .iter()
        .copied()
        .min_by(|a, b| a.measured.total_cmp(&b.measured))?;
    let best = rows.iter().copied().min_by(by_success)?;
    let lowest_bound = rows
        .iter()
        .map(|r| r.measured_ci95[0])
        .fold(f64::INFINITY, f64::min);
    let question = if e == "e6" {
        "With outlier ejection, retries and health checks, does every strategy hold 0.999?"
    } else {
        "With keel proxy's defaults alone (one endpoint failed), does it hold 0.999?"
    };
    let mut f = Finding::of(e, question, best.strategy.clone(), worst);
    f.protections = best.protections.clone();
    let mut text = format!(
        "{} ({}): lowest success {:.4} {} ({}, {}) over {} rows, lowest 95% bound {:.4}; {}",
        e.to_uppercase(),
        worst.protections,
        worst.measured,
        ci_text(worst.measured_ci95),
        who(worst),
        worst.failure_mode,
        rows.len(),
        lowest_bound,
        if rows.iter().all(|r| r.measured >= 0.999) {
            "every row holds the 0.999 goal"
        } else {
            "below the 0.999 goal in some rows"
        }
    );
    // Without protections: the same strategy, failure and servers measured bare in this run.
    let bare = rows.iter().copied().find_map(|r| {
        all.iter()
            .find(|b| {
                b.protections == "none"
                    && b.placement == r.placement
                    && b.strategy == r.strategy
                    && b.failure_mode == r.failure_mode
                    && (b.p - r.p).abs() < 1e-9
                    && b.k == r.k
            })
            .map(|b| (r, b))
    });
    if let Some((with, without)) = bare {
        let (ci, m, tie) = compare(with, without);
        f.strategy = with.strategy.clone();
        f.value = with.measured;
        f.ci95 = Some(with.measured_ci95);
        f.against(
            with_protections(without),
            without.measured,
            m,
            Some(ci),
            tie,
        );
        f.formula = formula(with);
        text.push_str(&format!(
            "; {} with the server {}: {:.4}, {} over {:.4} without protections ({})",
            with.strategy,
            mode_words(&with.failure_mode),
            with.measured,
            margin_text(m, ci),
            without.measured,
            without.experiment.to_uppercase()
        ));
    }
    text.push('.');
    if let Some(fm) = &f.formula {
        text.push_str(&format!(" Closed form: {fm}."));
    }
    f.text = text;
    Some(f)
}

/// E8: the strategy with the lowest measured p99, against the runner-up.
fn e8(rows: &[LatencyRow]) -> Option<Finding> {
    let mut sorted: Vec<&LatencyRow> = rows.iter().collect();
    sorted.sort_by(|a, b| a.measured.p99.total_cmp(&b.measured.p99));
    let best = *sorted.first()?;
    let ci = best.measured_ci95.p99;
    let mut f = Finding {
        experiment: "e8".into(),
        question: format!(
            "Which strategy keeps p99 latency lowest at load {:.2}?",
            best.load_asked
        ),
        strategy: best.strategy.clone(),
        protections: "none".into(),
        value: best.measured.p99,
        ci95: Some(ci),
        versus: None,
        versus_value: None,
        margin: None,
        margin_ci95: None,
        tie: false,
        formula: None,
        text: String::new(),
        by_failure: Vec::new(),
    };
    let mut text = format!(
        "E8 (open-loop load {:.2}, {} servers): {} has the lowest p99, {:.1} ms [{:.1}, {:.1}]",
        best.load_asked, best.servers, best.strategy, best.measured.p99, ci[0], ci[1]
    );
    if let Some(next) = sorted.get(1) {
        // Lower is better: the margin is how much less, with the intervals' halves combined.
        let m = next.measured.p99 - best.measured.p99;
        let mci = difference_ci(
            next.measured.p99,
            next.measured_ci95.p99,
            best.measured.p99,
            ci,
        );
        f.against(
            next.strategy.clone(),
            next.measured.p99,
            m,
            Some(mci),
            mci[0] <= 0.0,
        );
        text.push_str(&format!(
            ", {:.1} ms [{:.1}, {:.1}] below {} ({:.1} ms){}",
            m,
            mci[0],
            mci[1],
            next.strategy,
            next.measured.p99,
            if f.tie { ", a tie" } else { "" }
        ));
    }
    text.push('.');
    if let Some(random) = rows.iter().find(|r| r.model.is_some()) {
        let name = random.model_name.clone().unwrap_or_default();
        let m = random.model.map_or(f64::NAN, |m| m.p99);
        f.formula = Some(format!("{} p99 {m:.1} ms ({name})", random.strategy));
        text.push_str(&format!(
            " Closed form for random placement: {name}, p99 {m:.1} ms (measured {:.1}).",
            random.measured.p99
        ));
    }
    f.text = text;
    Some(f)
}

/// E9: the strategy that sends the slowed server the smallest share while it is slow.
fn e9(rows: &[ReactionRow]) -> Option<Finding> {
    let mut sorted: Vec<&ReactionRow> = rows.iter().collect();
    sorted.sort_by(|a, b| a.measured.share_during.total_cmp(&b.measured.share_during));
    let best = *sorted.first()?;
    let mut f = Finding {
        experiment: "e9".into(),
        question: format!(
            "Which strategy moves calls off a server slowed {:.0}x soonest?",
            best.step.factor
        ),
        strategy: best.strategy.clone(),
        protections: "none".into(),
        value: best.measured.share_during,
        ci95: None,
        versus: None,
        versus_value: None,
        margin: None,
        margin_ci95: None,
        tie: false,
        formula: Some(format!("fair share 1 / servers = {:.3}", best.fair_share)),
        text: String::new(),
        by_failure: Vec::new(),
    };
    let mut text = format!(
        "E9 (one of {} servers {:.0}x slower for {:.0} s): {} gave it the smallest share while \
         slow, {:.3} against a fair {:.3}, below half of fair after {}",
        best.servers,
        best.step.factor,
        (best.step.end - best.step.start).as_secs_f64(),
        best.strategy,
        best.measured.share_during,
        best.fair_share,
        best.measured
            .down_ms
            .map_or("never".to_string(), |d| format!("{d:.0} ms"))
    );
    if let Some(next) = sorted.get(1) {
        let m = next.measured.share_during - best.measured.share_during;
        f.against(
            next.strategy.clone(),
            next.measured.share_during,
            m,
            None,
            false,
        );
        text.push_str(&format!(
            "; {m:.3} less than {} ({:.3}; shares per 100 ms have no interval here)",
            next.strategy, next.measured.share_during
        ));
    }
    text.push('.');
    f.text = text;
    Some(f)
}

/// `text` cut into lines of at most `width` columns, each after `indent`.
pub(crate) fn wrap(text: &str, width: usize, indent: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && indent.len() + line.len() + 1 + word.len() > width {
            lines.push(format!("{indent}{line}"));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(format!("{indent}{line}"));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newcombe_interval_of_a_difference() {
        // Two equal rates: the interval straddles 0 symmetrically.
        let ci = difference_ci(0.5, [0.45, 0.55], 0.5, [0.45, 0.55]);
        assert!((ci[0] + ci[1]).abs() < 1e-12 && ci[0] < 0.0);
        // 1.0 against 0.5 with no width above 1: the upper half comes from b's lower half.
        let ci = difference_ci(1.0, [0.998, 1.0], 0.5, [0.48, 0.52]);
        assert!((ci[1] - 0.52).abs() < 1e-12, "{ci:?}");
        assert!(ci[0] > 0.47 && ci[0] < 0.5, "{ci:?}");
    }

    #[test]
    fn wrapped_lines_fit() {
        let text = "word ".repeat(100);
        for l in wrap(&text, 40, "  ") {
            assert!(l.len() <= 40, "{l}");
            assert!(l.starts_with("  "));
        }
    }
}
