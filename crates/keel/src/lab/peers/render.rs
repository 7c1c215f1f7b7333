//! The peers' rows in the lab's report: the mechanism of each departure from the closed form,
//! the terminal table and the HTML section, each opening with what the run found.

use std::fmt::Write as _;

use keel_model::analytic;

use crate::lab::answer::Finding;

use super::plan::{Peer, PeerCase, PeerStrategy, Setting};
use super::rows::{Evidence, PeerRow, PeersReport};

/// The same for independent calls that each fail with probability `f`: E[index | failure].
fn independent_failing_call(f: f64, k: u32) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for i in 1..=k {
        let pr = (1.0 - f).powi(i as i32 - 1) * f;
        num += i as f64 * pr;
        den += pr;
    }
    if den > 0.0 {
        num / den
    } else {
        1.0
    }
}

/// A number of the row, cited by its place in the row (a JSON pointer).
fn cite(field: &str, value: f64) -> Evidence {
    Evidence {
        field: field.into(),
        value,
    }
}

/// The failed server's index (the last one).
fn failed_index(r: &PeerRow) -> usize {
    r.attempts.len().saturating_sub(1)
}

/// What moves a row off its closed form, when the closed form is outside its interval (and,
/// for an all-calls round-robin row, whether the rotation showed, either way): the mechanism's
/// sentence and the row's numbers it cites.
pub(crate) fn mechanism(
    peer: Option<Peer>,
    case: &PeerCase,
    r: &PeerRow,
) -> Option<(String, Vec<Evidence>)> {
    if case.setting == Setting::Bare && case.strategy == PeerStrategy::RoundRobin {
        if let Some(m) = all_calls(case, r) {
            return Some(m);
        }
    }
    if r.agrees != Some(false) {
        return None;
    }
    let hang = r.failure_mode == "hang";
    match case.setting {
        Setting::Operators => {
            let (mut s, mut ev) = operators(peer, case.strategy, hang, r);
            envoy_evidence(&mut s, &mut ev, r);
            Some((s, ev))
        }
        Setting::Bare => bare(peer, case, r),
    }
}

/// Envoy's own counts of the row, when they show why its protections fell short.
fn envoy_evidence(s: &mut String, ev: &mut Vec<Evidence>, r: &PeerRow) {
    let st = |k: &str| r.peer_stats.get(k).copied().unwrap_or(0);
    let (retries, overflow) = (st("upstream_rq_retry"), st("upstream_rq_retry_overflow"));
    if overflow > 0 {
        let _ = write!(
            s,
            "; the default circuit breaker allows 3 retries in flight (max_retries): {overflow} \
             retries overflowed it, {retries} ran"
        );
        ev.push(cite(
            "/peer_stats/upstream_rq_retry_overflow",
            overflow as f64,
        ));
    }
    let (ejected, refused) = (
        st("outlier_detection.ejections_enforced_total"),
        st("outlier_detection.ejections_overflow"),
    );
    if refused > 0 {
        let _ = write!(
            s,
            "; {ejected} ejections enforced, {refused} refused by max_ejection_percent (default 10 %: \
             one host of five is 20 %)"
        );
        ev.push(cite(
            "/peer_stats/outlier_detection.ejections_overflow",
            refused as f64,
        ));
    } else if ejected > 0 {
        let _ = write!(s, "; {ejected} ejections enforced");
        ev.push(cite(
            "/peer_stats/outlier_detection.ejections_enforced_total",
            ejected as f64,
        ));
    }
}

/// The failed server's calls in the row and their share, as a mechanism cites them.
fn failed_calls(r: &PeerRow) -> (String, Evidence) {
    let i = failed_index(r);
    let n = r.attempts.get(i).copied().unwrap_or(0);
    (
        format!(
            "the failed server got {n} calls ({:.3} of all, retries included)",
            r.measured_failed_share
        ),
        cite(&format!("/attempts/{i}"), n as f64),
    )
}

fn operators(
    peer: Option<Peer>,
    strategy: PeerStrategy,
    hang: bool,
    r: &PeerRow,
) -> (String, Vec<Evidence>) {
    let lc = strategy == PeerStrategy::LeastConnections;
    let (calls, ev) = failed_calls(r);
    let text =
        match peer {
            None => format!(
                "keel's defaults: a retry on another endpoint for a connect error, reset, timeout \
             or 502/503/504, and outlier detection (5 failures in a row eject): the closed form \
             has neither; {calls}"
            ),
            Some(Peer::Nginx) if hang => format!(
                "NGINX fail_timeout/max_fails: proxy_next_upstream error timeout retries the \
             timed-out call on the next server, and max_fails=1 fail_timeout=10s takes the hung \
             server out for 10 s after one failure, counted in the zone both workers share; \
             {calls}, each one retried"
            ),
            Some(Peer::Nginx) => format!(
                "NGINX passes a 503 through: it is neither `error` nor `timeout` to \
             proxy_next_upstream, so it is not retried and max_fails does not count it; {calls}{}",
                if lc {
                    " (least_conn sends most calls to the server that answers at once: q < 1, the \
                 source's fast-failure trap)"
                } else {
                    ""
                }
            ),
            Some(Peer::Haproxy) => format!(
            "HAProxy observe layer7 counts each {} and marks the server down after error-limit \
             10, until two TCP checks in a row (inter 1s) bring it back; retries 3 with \
             redispatch apply to failed connections only (retry-on's default); {calls} in \
             {:.1} s",
            if hang { "timed-out answer (504)" } else { "503" },
            r.seconds
        ),
            Some(Peer::Envoy) => format!(
            "Envoy retry_on 5xx,connect-failure retries a {} (num_retries 2) and outlier \
             detection ejects the server after 5 consecutive 5xx{}; {calls}",
            if hang { "timed-out try (per_try_timeout)" } else { "503" },
            match strategy {
                PeerStrategy::Hash =>
                    "; a hashed call's retry goes back to the same host (no previous_hosts retry \
                     predicate), so only the ejection helps",
                PeerStrategy::LeastConnections =>
                    "; LEAST_REQUEST is P2C (two random hosts, the less loaded)",
                _ => "",
            }
        ),
        };
    let mut ev = vec![ev];
    if strategy == PeerStrategy::Hash {
        if let Some(k) = r.key_share {
            ev.push(cite("/key_share", k));
        }
    }
    (text, ev)
}

/// An all-calls round-robin row: its failed calls per failed request m against independent
/// calls', and what that makes of success (exactly 1 - k s / m, s the share of calls failed):
/// Rotation when m is lower (a fast failure's next call lands on the next, healthy server),
/// Interleaving when other clients' picks between a request's calls made it independent.
fn all_calls(case: &PeerCase, r: &PeerRow) -> Option<(String, Vec<Evidence>)> {
    let [m, independent] = r.repeat_failures?;
    if case.spread {
        let [after, failed_after] = r.after_failure?;
        return Some(spread(r, after, failed_after, r.analytic?));
    }
    let failed: u64 = r.failed_calls_per_request.iter().skip(1).sum();
    let twice: u64 = r.failed_calls_per_request.iter().skip(2).sum();
    let s = r.measured_failed_share;
    let identity = 1.0 - f64::from(r.k) * s / m;
    let rotation = m < independent && r.analytic.is_some_and(|a| r.measured < a);
    let in_step = r.concurrency <= crate::lab::rotation::IN_STEP_CLIENTS;
    let what = if in_step && r.agrees == Some(true) {
        "in step: with so few clients their picks keep their order, a client whose call fails \
         at once takes the next position itself, and a request's calls land on distinct \
         servers (closed form 1 - k p)"
    } else if rotation {
        "rotation: a call that fails at once frees its client, and round-robin gives its next \
         call the next, healthy server, so a request's failures rarely repeat and spread over \
         more requests"
    } else {
        "interleaving: other clients' picks came between a request's calls and moved each to \
         any place of the rotation, so its calls failed as independent calls do (on idle cores \
         the rotation keeps more of its effect and success falls towards 1 - k p)"
    };
    Some((
        format!(
            "{what}: all {} calls made, {twice} of {failed} failed requests failed more than \
             once, m = {m:.3} failed calls per failed request against {independent:.3} for \
             independent calls; success 1 - k s / m = 1 - {} x {s:.3} / {m:.3} = {identity:.3}",
            r.k, r.k
        ),
        vec![
            cite("/repeat_failures/0", m),
            cite("/measured_failed_share", s),
        ],
    ))
}

/// The all-calls row with spread healthy times: the picks' order shuffles, and the number that
/// sets success is the share of calls right after a failed call that failed too.
fn spread(r: &PeerRow, after: u64, failed_after: u64, analytic: f64) -> (String, Vec<Evidence>) {
    let s = failed_after as f64 / after.max(1) as f64;
    let what = if s < r.p / 2.0 {
        "rotation, picks shuffled: healthy times spread (exponential) shuffle the clients' \
         order, but a client whose call fails at once picks again before anyone else and gets \
         the next, healthy server, so the failed server's calls fall on more requests"
    } else {
        "interleaving: other clients' picks came between a failed call and its request's next \
         call, which then failed as often as any call"
    };
    (
        format!(
            "{what}: {failed_after} of {after} calls made right after a failed call failed \
             (s = {s:.3}; independent calls: p = {:.3}); closed form (1 - p)(1 - r)^(k - 1), \
             r = p(1 - s)/(1 - p): {analytic:.3} (independent calls: {:.3})",
            r.p,
            (1.0 - r.p).powi(r.k as i32)
        ),
        vec![
            cite("/after_failure/1", failed_after as f64),
            cite("/after_failure/0", after as f64),
        ],
    )
}

fn bare(peer: Option<Peer>, case: &PeerCase, r: &PeerRow) -> Option<(String, Vec<Evidence>)> {
    let analytic = r.analytic?;
    let p = r.p;
    let share = r.measured_failed_share;
    let model_share =
        r.q.and_then(|q| analytic::failed_share(case.strategy.model(), p, q))
            .unwrap_or(p);
    let share_explains =
        (r.measured_ci95[0]..=r.measured_ci95[1]).contains(&r.implied_by_measured_share);
    let on_share = cite("/measured_failed_share", share);
    let p2c = match (peer, case.strategy) {
        (Some(Peer::Envoy), PeerStrategy::LeastConnections) => Some(
            "Envoy's LEAST_REQUEST picks the less loaded of two random hosts (choice_count 2), \
             not the least loaded of all five",
        ),
        (Some(Peer::Haproxy), PeerStrategy::Random) => Some(
            "HAProxy's `balance random` (its default of two draws) takes the less loaded of two \
             random servers: a hung server holds its calls and loses the draws, a server that \
             fails at once holds none and wins them",
        ),
        _ => None,
    };
    if let Some(what) = p2c {
        return Some((
            format!(
                "P2C: {what}: the failed server got {share:.3} of the calls (a uniform pick: \
                 {p:.1}; least-connections' model {model_share:.3}); (1 - {share:.3})^{} = \
                 {:.3}",
                r.k, r.implied_by_measured_share
            ),
            vec![on_share],
        ));
    }
    match case.strategy {
        PeerStrategy::Hash => {
            let key = r.key_share?;
            // Without protections each request whose key is on the failed server makes one
            // call there and stops: the server's calls count those requests.
            let i = failed_index(r);
            let n = r.attempts.get(i).copied().unwrap_or(0);
            let of_requests = n as f64 / r.requests.max(1) as f64;
            let z = (of_requests - key) / (key * (1.0 - key) / r.requests.max(1) as f64).sqrt();
            Some((
                format!(
                    "where the keys went: the ring gives the failed server {key:.3} of the row's \
                     keys counted before the row, and the row's {} requests put {n} on it, \
                     {of_requests:.3} ({z:+.1} standard deviations)",
                    r.requests
                ),
                vec![
                    cite("/key_share", key),
                    cite(&format!("/attempts/{i}"), n as f64),
                ],
            ))
        }
        PeerStrategy::RoundRobin | PeerStrategy::Random
            if r.k > 1 && r.measured < analytic && r.mean_failing_call.is_some() =>
        {
            let at = r.mean_failing_call?;
            let ind = independent_failing_call(share.max(1e-9), r.k);
            (at > ind).then(|| {
                (
                    format!(
                        "closed loop: a client's calls after a failure are not independent: the \
                         failed server got {share:.3} of the calls (the model's {model_share:.1}), \
                         but failed requests failed at call {at:.2} on average, against {ind:.2} \
                         for independent calls (a request that fails at once frees its client at \
                         once, and the rotation's next turn on the failed server falls on later \
                         calls)"
                    ),
                    vec![cite("/mean_failing_call", at), on_share],
                )
            })
        }
        // No q is solved back from the row's own share: the row's share is set against the
        // model's at the row's q, with what moves it.
        PeerStrategy::LeastConnections => {
            let why = if r.failure_mode == "hang" {
                "least-connections' counts are small integers (24 calls over 5 servers): when \
                 the hung server's calls time out together it is the least loaded at once and \
                 refills"
            } else {
                "a failure \"at once\" still costs the balancer's own round trip, and with 24 \
                 calls over 5 servers the counts are small integers with frequent ties"
            };
            Some((
                format!(
                    "in-flight counts: {why}; the failed server got {share:.3} of the calls, the \
                     model {model_share:.3} at q = {:.3}; at the measured share (1 - \
                     {share:.3})^{} = {:.3}",
                    r.q.unwrap_or(f64::NAN),
                    r.k,
                    r.implied_by_measured_share
                ),
                vec![on_share],
            ))
        }
        PeerStrategy::Random if share_explains => {
            let n = r.attempts.iter().sum::<u64>().max(1) as f64;
            let z = (share - p) / (p * (1.0 - p) / n).sqrt();
            Some((
                format!(
                    "picks: the random draws gave the failed server {share:.3} of {n:.0} calls \
                     ({z:+.1} standard deviations from p = {p:.1}); at that share (1 - \
                     {share:.3})^{} = {:.3} is inside the measured interval",
                    r.k, r.implied_by_measured_share
                ),
                vec![on_share],
            ))
        }
        _ if share_explains => Some((
            format!(
                "picks: the balancer sent {share:.3} of the calls to the failed server, the \
                 model {model_share:.3}; (1 - {share:.3})^{} = {:.3} is inside the measured \
                 interval",
                r.k, r.implied_by_measured_share,
            ),
            vec![on_share],
        )),
        _ => None,
    }
}

/// Whether rows of the same case measure the same behaviour in every balancer: bare
/// round-robin, and bare random where the balancer draws once (HAProxy's two draws do not).
fn same_behaviour(r: &PeerRow) -> bool {
    r.setting == Setting::Bare.name()
        && (r.strategy == PeerStrategy::RoundRobin.name()
            || (r.strategy == PeerStrategy::Random.name() && r.balancer != Peer::Haproxy.name()))
}

/// Names, on each row, the other balancers' rows of the same case that measure the same
/// behaviour and whose 95 % intervals do not overlap its own.
pub(crate) fn flag_disagreements(rows: &mut [PeerRow]) {
    let mut flags: Vec<(usize, String)> = Vec::new();
    for (i, a) in rows.iter().enumerate() {
        for b in rows.iter() {
            let same_case = a.setting == b.setting
                && a.strategy == b.strategy
                && a.failure_mode == b.failure_mode
                && a.k == b.k
                && a.client == b.client
                && a.concurrency == b.concurrency;
            if a.balancer != b.balancer
                && same_case
                && same_behaviour(a)
                && same_behaviour(b)
                && (a.measured_ci95[1] < b.measured_ci95[0]
                    || b.measured_ci95[1] < a.measured_ci95[0])
            {
                flags.push((
                    i,
                    format!(
                        "{} {:.3} [{:.3}, {:.3}]",
                        b.balancer, b.measured, b.measured_ci95[0], b.measured_ci95[1]
                    ),
                ));
            }
        }
    }
    for (i, f) in flags {
        rows[i].disagrees_with.push(f);
    }
}

fn cell(rows: &[&PeerRow], balancer: &str) -> String {
    match rows.iter().find(|r| r.balancer == balancer) {
        Some(r) => format!(
            "{:.3}{}",
            r.measured,
            match (r.agrees, r.explained) {
                (Some(false), true) => "*",
                (Some(false), false) => "!",
                _ => " ",
            }
        ),
        None => "-".into(),
    }
}

/// Lines of (setting, strategy, failure, k), each with every balancer's row.
fn lines(report: &PeersReport) -> Vec<Vec<&PeerRow>> {
    let mut out: Vec<Vec<&PeerRow>> = Vec::new();
    for r in &report.rows {
        match out.iter_mut().find(|l| {
            let a = l[0];
            a.setting == r.setting
                && a.strategy == r.strategy
                && a.failure_mode == r.failure_mode
                && a.k == r.k
                && a.client == r.client
                && a.concurrency == r.concurrency
        }) {
            Some(l) => l.push(r),
            None => out.push(vec![r]),
        }
    }
    out
}

/// The strategy as the table names a line: `(all xN)` marks N clients that make all k calls.
fn strategy_label(r: &PeerRow) -> String {
    if r.client == keel_testbed::loadgen::Client::AllCalls.name() {
        format!("{} (all x{})", r.strategy, r.concurrency)
    } else {
        r.strategy.clone()
    }
}

/// The closed form's cell of a line: hash rows have one per balancer (1 minus the failed
/// server's key share on its own ring), listed under the table.
fn model_cell(a: &PeerRow) -> String {
    match (a.key_share, a.analytic) {
        (Some(_), _) => "1-ks".into(),
        (None, Some(v)) => format!("{v:.3}"),
        (None, None) => "-".into(),
    }
}

/// Hash lines: each balancer's closed form, 1 minus its key share.
fn key_share_lines(report: &PeersReport) -> Vec<String> {
    lines(report)
        .into_iter()
        .filter(|l| l[0].key_share.is_some())
        .map(|l| {
            let a = l[0];
            let each: Vec<String> = l
                .iter()
                .filter_map(|r| {
                    Some(format!(
                        "{} {:.3} (key share {:.3})",
                        r.balancer, r.analytic?, r.key_share?
                    ))
                })
                .collect();
            format!(
                "{} hash {} k={}: {}",
                a.setting,
                a.failure_mode,
                a.k,
                each.join(", ")
            )
        })
        .collect()
}

fn balancers(report: &PeersReport) -> Vec<&str> {
    let mut out = vec!["keel"];
    for p in Peer::ALL {
        if report.rows.iter().any(|r| r.balancer == p.name()) {
            out.push(p.name());
        }
    }
    out
}

/// The answer, from the numbers: how often bare rows reproduce the closed form, and each
/// balancer's worst row as operators configure it.
pub(crate) fn answer(report: &PeersReport) -> String {
    let mut s = String::new();
    let bare: Vec<&PeerRow> = report
        .rows
        .iter()
        .filter(|r| r.setting == "bare" && r.balancer != "keel" && r.agrees.is_some())
        .collect();
    let agree = bare.iter().filter(|r| r.agrees == Some(true)).count();
    let unexplained = report.rows.iter().filter(|r| !r.explained).count();
    let disagreeing = report
        .rows
        .iter()
        .filter(|r| !r.disagrees_with.is_empty())
        .count();
    let mut worst: Vec<(String, f64, String)> = Vec::new();
    for b in balancers(report) {
        if let Some(r) = report
            .rows
            .iter()
            .filter(|r| r.balancer == b && r.setting == "operators" && r.k == 3)
            .min_by(|a, b| a.measured.total_cmp(&b.measured))
        {
            worst.push((
                b.to_string(),
                r.measured,
                format!("{} on {}", r.native_strategy, r.failure_mode),
            ));
        }
    }
    worst.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some((best, v, _)) = worst.first() {
        let _ = write!(
            s,
            "As operators configure them, one server of five failed, 3 calls a request: {best} \
             holds the highest worst row ({v:.3}); "
        );
        let rest: Vec<String> = worst
            .iter()
            .map(|(b, v, what)| format!("{b} {v:.3} ({what})"))
            .collect();
        let _ = write!(s, "worst rows: {}. ", rest.join(", "));
    }
    let _ = write!(
        s,
        "Bare (no retries, no passive health), the closed form lies inside the measured 95 % \
         interval in {agree} of {} peer rows; ",
        bare.len()
    );
    if unexplained == 0 {
        s.push_str("every departure names its mechanism with a number from its own row.");
    } else {
        let _ = write!(
            s,
            "{unexplained} departures are not explained (marked !): mechanism unknown."
        );
    }
    if disagreeing > 0 {
        let _ = write!(
            s,
            " {disagreeing} rows disagree beyond their intervals with another balancer's row of              the same behaviour (marked ≠)."
        );
    }
    let _ = write!(
        s,
        " Every peer ran as operators run it, with {} workers.",
        super::plan::WORKERS
    );
    if !report.skipped.is_empty() {
        let names: Vec<&str> = report.skipped.iter().map(|s| s.balancer.as_str()).collect();
        let _ = write!(s, " Skipped: {} (see below).", names.join(", "));
    }
    s
}

/// The peers' finding for the run's answer: the balancer whose worst row, as operators
/// configure it (3 calls a request), is highest, against the next one; the text is [`answer`].
pub(crate) fn finding(report: &PeersReport) -> Option<Finding> {
    let mut worst: Vec<&PeerRow> = balancers(report)
        .into_iter()
        .filter_map(|b| {
            report
                .rows
                .iter()
                .filter(|r| r.balancer == b && r.setting == "operators" && r.k == 3)
                .min_by(|a, b| a.measured.total_cmp(&b.measured))
        })
        .collect();
    worst.sort_by(|a, b| b.measured.total_cmp(&a.measured));
    let best = *worst.first()?;
    let mut f = Finding::new(
        "peers",
        "Which balancer, as operators configure it, holds up best when one server of five fails?",
        format!("{} ({})", best.balancer, best.native_strategy),
        "as operators configure it".into(),
        best.measured,
        Some(best.measured_ci95),
    );
    f.text = answer(report);
    if let Some(next) = worst.get(1) {
        let ci = crate::lab::answer::difference_ci(
            best.measured,
            best.measured_ci95,
            next.measured,
            next.measured_ci95,
        );
        f.against(
            format!(
                "{}'s worst row ({} on {})",
                next.balancer, next.native_strategy, next.failure_mode
            ),
            next.measured,
            best.measured - next.measured,
            Some(ci),
            ci[0] <= 0.0,
        );
    }
    Some(f)
}

/// The peers' table for a terminal (under 100 columns), then each departure's mechanism (their
/// answer opens the run's, above it).
pub(crate) fn print_table(report: &PeersReport) {
    let say = |text: &str, indent: &str| {
        for line in crate::lab::answer::wrap(text, crate::lab::report::COLUMNS, indent) {
            println!("{line}");
        }
    };
    let bs = balancers(report);
    let mut head = format!(
        "{:<9} {:<17} {:<9} {:>1} {:>6}",
        "setting", "strategy", "failure", "k", "model"
    );
    for b in &bs {
        let _ = write!(head, " {:>8}", b);
    }
    println!("{head}");
    for l in lines(report) {
        let a = l[0];
        let mut line = format!(
            "{:<9} {:<17} {:<9} {:>1} {:>6}",
            a.setting,
            strategy_label(a),
            a.failure_mode,
            a.k,
            model_cell(a)
        );
        for b in &bs {
            let _ = write!(line, " {:>8}", cell(&l, b));
        }
        println!("{line}");
    }
    println!(
        "* outside the 95 % interval of the closed form, mechanism below; ! mechanism unknown; \
         (all xN): N clients that make all k calls (in step at 2: 1 - k p); 1-ks: 1 minus the failed server's share of the \
         keys on each balancer's own ring:"
    );
    for l in key_share_lines(report) {
        say(&l, "  ");
    }
    for r in &report.rows {
        if let Some(m) = &r.mechanism {
            say(
                &format!(
                    "{} {} {} {} k={}: {:.3} [{:.3}, {:.3}]: {m}",
                    r.balancer,
                    r.setting,
                    strategy_label(r),
                    r.failure_mode,
                    r.k,
                    r.measured,
                    r.measured_ci95[0],
                    r.measured_ci95[1]
                ),
                "  ",
            );
        }
    }
    for r in report.rows.iter().filter(|r| !r.disagrees_with.is_empty()) {
        say(
            &format!(
                "≠ {} {} {} {} k={}: {:.3} [{:.3}, {:.3}] disagrees with {}",
                r.balancer,
                r.setting,
                strategy_label(r),
                r.failure_mode,
                r.k,
                r.measured,
                r.measured_ci95[0],
                r.measured_ci95[1],
                r.disagrees_with.join(", ")
            ),
            "",
        );
    }
    for s in &report.skipped {
        say(&format!("skipped {}: {}", s.balancer, s.reason), "");
    }
    say(&report.method, "");
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The peers' section of the HTML report.
pub(crate) fn html(report: &PeersReport) -> String {
    let bs = balancers(report);
    let mut h = String::new();
    let _ = write!(
        h,
        "<h2 id=\"peers\">Peers: NGINX, HAProxy and Envoy next to keel</h2><p><b>{}</b></p>\
         <table><tr><th class=\"l\">setting</th><th class=\"l\">strategy</th>\
         <th class=\"l\">failure</th><th>k</th><th>closed form</th>",
        esc(&answer(report))
    );
    for b in &bs {
        let _ = write!(h, "<th>{b}</th>");
    }
    h.push_str("</tr>");
    for l in lines(report) {
        let a = l[0];
        let _ = write!(
            h,
            "<tr><td class=\"l\">{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td><td>{}</td>",
            a.setting,
            strategy_label(a),
            a.failure_mode,
            a.k,
            model_cell(a)
        );
        for b in &bs {
            match l.iter().find(|r| r.balancer == *b) {
                Some(r) => {
                    let bg = match (r.agrees, r.explained) {
                        (Some(false), false) => "#fdeaea",
                        _ => "#fff",
                    };
                    let _ = write!(
                        h,
                        "<td style=\"background:{bg}\" title=\"{} ({}) [{:.3}, {:.3}]{}\">{:.3}{}{}</td>",
                        esc(&r.native_strategy),
                        esc(&r.run_as),
                        r.measured_ci95[0],
                        r.measured_ci95[1],
                        match (&r.mechanism, r.agrees) {
                            (Some(m), _) => format!(": {}", esc(m)),
                            (None, Some(false)) => ": mechanism unknown".into(),
                            (None, _) => String::new(),
                        },
                        r.measured,
                        if r.agrees == Some(false) { "*" } else { "" },
                        if r.disagrees_with.is_empty() { "" } else { "≠" }
                    );
                }
                None => h.push_str("<td>-</td>"),
            }
        }
        h.push_str("</tr>");
    }
    h.push_str(
        "</table><p>(all): a client that makes all k calls (the others stop at a request's first \
         failed call). Hash: the client's x-lab-key header, one value per request; the closed \
         form is 1 minus the failed server's share of the keys on that balancer's own ring. \
         ≠: disagrees beyond the intervals with another balancer's row of the same behaviour \
         (listed below). * the closed form is outside the row's measured 95 % interval; the \
         mechanism:</p><ul>",
    );
    for r in &report.rows {
        if let Some(m) = &r.mechanism {
            let _ = write!(
                h,
                "<li>{} {} {} {} k={}: {:.3} [{:.3}, {:.3}]: {}</li>",
                r.balancer,
                r.setting,
                strategy_label(r),
                r.failure_mode,
                r.k,
                r.measured,
                r.measured_ci95[0],
                r.measured_ci95[1],
                esc(m)
            );
        }
    }
    h.push_str(
        "</ul><p>Hash rows' closed forms (1 minus the key share on each balancer's ring):</p><ul>",
    );
    for l in key_share_lines(report) {
        let _ = write!(h, "<li>{}</li>", esc(&l));
    }
    h.push_str("</ul>");
    for r in report.rows.iter().filter(|r| !r.disagrees_with.is_empty()) {
        let _ = write!(
            h,
            "<p>≠ {} {} {} {} k={}: {:.3} [{:.3}, {:.3}] disagrees with {}</p>",
            r.balancer,
            r.setting,
            strategy_label(r),
            r.failure_mode,
            r.k,
            r.measured,
            r.measured_ci95[0],
            r.measured_ci95[1],
            esc(&r.disagrees_with.join(", "))
        );
    }
    let _ = write!(
        h,
        "<p>Each balancer's rows ran {}.</p>",
        esc(&report
            .rows
            .iter()
            .fold(Vec::<String>::new(), |mut v, r| {
                let line = format!("{}: {}", r.balancer, r.run_as);
                if !v.contains(&line) {
                    v.push(line);
                }
                v
            })
            .join("; "))
    );
    for s in &report.skipped {
        let _ = write!(h, "<p>Skipped {}: {}</p>", s.balancer, esc(&s.reason));
    }
    let versions: Vec<String> = report
        .versions
        .iter()
        .map(|(p, v)| format!("{p} {v}"))
        .collect();
    let _ = write!(
        h,
        "<p><small>{} Versions: {}. {:.0} s.</small></p>",
        esc(&report.method),
        esc(&versions.join(", ")),
        report.seconds
    );
    h
}
