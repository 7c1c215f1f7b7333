//! The peers' rows in the lab's report: the mechanism of each departure from the closed form,
//! the terminal table and the HTML section, each opening with what the run found.

use std::fmt::Write as _;

use keel_model::analytic;

use crate::lab::answer::Finding;

use super::{Peer, PeerCase, PeerRow, PeerStrategy, PeersReport, Setting};

/// Mean index (1-based) of the failing call among failed requests: a request stops at its
/// first failed call, so the failed requests made every call but the successful ones' k each.
fn mean_failing_call(r: &PeerRow) -> Option<f64> {
    let failed = r.requests.checked_sub(r.succeeded)?;
    (failed > 0).then(|| (r.calls as f64 - r.k as f64 * r.succeeded as f64) / failed as f64)
}

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

/// What moves a row off its closed form, when the closed form is outside its interval.
pub(super) fn mechanism(peer: Option<Peer>, case: &PeerCase, r: &PeerRow) -> Option<String> {
    if r.agrees != Some(false) {
        return None;
    }
    let hang = r.failure_mode == "hang";
    let s = match case.setting {
        Setting::Operators => {
            let mut s = operators(peer, case.strategy, hang);
            envoy_evidence(&mut s, r);
            s
        }
        Setting::Bare => bare(peer, case, r)?,
    };
    Some(s)
}

/// Envoy's own counts of the row, when they show why its protections fell short.
fn envoy_evidence(s: &mut String, r: &PeerRow) {
    let st = |k: &str| r.peer_stats.get(k).copied().unwrap_or(0);
    let (retries, overflow) = (st("upstream_rq_retry"), st("upstream_rq_retry_overflow"));
    if overflow > 0 {
        let _ = write!(
            s,
            "; the default circuit breaker allows 3 retries in flight (max_retries): {overflow} \
             retries overflowed it, {retries} ran"
        );
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
    }
}

fn operators(peer: Option<Peer>, strategy: PeerStrategy, hang: bool) -> String {
    let lc = strategy == PeerStrategy::LeastConnections;
    match peer {
        None => "keel's defaults: a retry on another endpoint for a connect error, reset, timeout \
                 or 502/503/504, and outlier detection (5 failures in a row eject): the closed form \
                 has neither"
            .into(),
        Some(Peer::Nginx) if hang => "NGINX fail_timeout/max_fails: proxy_next_upstream error \
             timeout retries the timed-out call on the next server, and max_fails=1 \
             fail_timeout=10s takes the hung server out for 10 s after that one failure"
            .into(),
        Some(Peer::Nginx) => format!(
            "NGINX passes a 503 through: it is neither `error` nor `timeout` to \
             proxy_next_upstream, so it is not retried and max_fails does not count it{}",
            if lc {
                "; least_conn then sends most calls to the server that answers at once (q < 1: \
                 the source's fast-failure trap)"
            } else {
                ""
            }
        ),
        Some(Peer::Haproxy) => format!(
            "HAProxy observe layer7 counts each {} and marks the server down after error-limit \
             10, until two TCP checks in a row (inter 1s) bring it back; retries 3 with \
             redispatch apply to failed connections only (retry-on's default)",
            if hang { "timed-out answer (504)" } else { "503" }
        ),
        Some(Peer::Envoy) => format!(
            "Envoy retry_on 5xx,connect-failure retries a {} (num_retries 2) and outlier \
             detection ejects the server after 5 consecutive 5xx{}",
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
    }
}

fn bare(peer: Option<Peer>, case: &PeerCase, r: &PeerRow) -> Option<String> {
    let analytic = r.analytic?;
    let p = r.p;
    let model_share =
        r.q.and_then(|q| analytic::failed_share(case.strategy.model(), p, q))
            .unwrap_or(p);
    let share_explains =
        (r.measured_ci95[0]..=r.measured_ci95[1]).contains(&r.implied_by_measured_share);
    match case.strategy {
        PeerStrategy::LeastConnections if peer == Some(Peer::Envoy) => Some(format!(
            "P2C: Envoy's LEAST_REQUEST picks the less loaded of two random hosts \
             (choice_count 2), not the least loaded of all five: the failed server got {:.3} of \
             the calls, least-connections' model {:.3}",
            r.measured_failed_share, model_share
        )),
        PeerStrategy::Hash if share_explains => Some(format!(
            "hash keys: the ring gives the failed server {:.3} of the keys, not p = {p:.1}; \
             (1 - {:.3})^{} = {:.3}",
            r.measured_failed_share, r.measured_failed_share, r.k, r.implied_by_measured_share
        )),
        PeerStrategy::RoundRobin | PeerStrategy::Random | PeerStrategy::Hash
            if r.k > 1 && r.measured < analytic =>
        {
            let at = mean_failing_call(r)?;
            let ind = independent_failing_call(r.measured_failed_share.max(1e-9), r.k);
            (at > ind).then(|| {
                format!(
                    "closed loop: a client's calls after a failure are not independent: the \
                     failed server got {:.3} of the calls (the model's {:.1}), but failed \
                     requests failed at call {at:.2} on average, against {ind:.2} for \
                     independent calls (a request that fails at once frees its client at once, \
                     and the rotation's next turn on the failed server falls on later calls)",
                    r.measured_failed_share, model_share
                )
            })
        }
        PeerStrategy::LeastConnections => {
            // The q that the measured share implies (the share's formula solved for q), and
            // the closed form at that q.
            let f = r.measured_failed_share.clamp(1e-6, 1.0 - 1e-6);
            let q_eff = p * (1.0 - f) / (f * (1.0 - p));
            let at = analytic::success(case.strategy.model(), p, q_eff, r.k)?;
            let why = if r.failure_mode == "hang" {
                "least-connections' counts are small integers (24 calls over 5 servers): when \
                 the hung server's calls time out together it is the least loaded at once and \
                 refills"
            } else {
                "a failure \"at once\" still costs the balancer's own round trip, and with 24 \
                 calls over 5 servers the counts are small integers with frequent ties"
            };
            Some(format!(
                "q: {why}; the failed server got {:.3} of the calls (the model {:.3} at q = \
                 {:.3}), which implies q = {q_eff:.3}, where the closed form gives {at:.3}{}",
                r.measured_failed_share,
                model_share,
                r.q.unwrap_or(f64::NAN),
                if r.k > 1 && !(r.measured_ci95[0]..=r.measured_ci95[1]).contains(&at) {
                    "; and a request's calls are not independent: a closed-loop client whose \
                     request failed at once starts the next one at once"
                } else {
                    ""
                }
            ))
        }
        PeerStrategy::Random if share_explains => {
            let n = r.attempts.iter().sum::<u64>().max(1) as f64;
            let z = (r.measured_failed_share - p) / (p * (1.0 - p) / n).sqrt();
            Some(format!(
                "picks: the random draws gave the failed server {:.3} of {n:.0} calls ({z:+.1} \
                 standard deviations from p = {p:.1}); at that share (1 - {:.3})^{} = {:.3} is \
                 inside the measured interval",
                r.measured_failed_share, r.measured_failed_share, r.k, r.implied_by_measured_share
            ))
        }
        _ if share_explains => Some(format!(
            "picks: the balancer sent {:.3} of the calls to the failed server, the model {:.3}; \
             (1 - {:.3})^{} = {:.3} is inside the measured interval",
            r.measured_failed_share,
            model_share,
            r.measured_failed_share,
            r.k,
            r.implied_by_measured_share,
        )),
        _ => None,
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
        }) {
            Some(l) => l.push(r),
            None => out.push(vec![r]),
        }
    }
    out
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
        s.push_str("every departure names its mechanism.");
    } else {
        let _ = write!(s, "{unexplained} departures are not explained (marked !).");
    }
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
            a.strategy,
            a.failure_mode,
            a.k,
            a.analytic
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into())
        );
        for b in &bs {
            let _ = write!(line, " {:>8}", cell(&l, b));
        }
        println!("{line}");
    }
    println!("* outside the 95 % interval of the closed form, mechanism below; ! not explained");
    for r in &report.rows {
        if let Some(m) = &r.mechanism {
            say(
                &format!(
                    "{} {} {} {} k={}: {:.3} [{:.3}, {:.3}]: {m}",
                    r.balancer,
                    r.setting,
                    r.strategy,
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
            a.strategy,
            a.failure_mode,
            a.k,
            a.analytic
                .map(|v| format!("{v:.3}"))
                .unwrap_or_else(|| "-".into())
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
                        "<td style=\"background:{bg}\" title=\"{} [{:.3}, {:.3}]{}\">{:.3}{}</td>",
                        esc(&r.native_strategy),
                        r.measured_ci95[0],
                        r.measured_ci95[1],
                        r.mechanism
                            .as_deref()
                            .map(|m| format!(": {}", esc(m)))
                            .unwrap_or_default(),
                        r.measured,
                        if r.agrees == Some(false) { "*" } else { "" }
                    );
                }
                None => h.push_str("<td>-</td>"),
            }
        }
        h.push_str("</tr>");
    }
    h.push_str(
        "</table><p>* the closed form is outside the row's measured 95 % interval; the \
         mechanism:</p><ul>",
    );
    for r in &report.rows {
        if let Some(m) = &r.mechanism {
            let _ = write!(
                h,
                "<li>{} {} {} {} k={}: {:.3} [{:.3}, {:.3}]: {}</li>",
                r.balancer,
                r.setting,
                r.strategy,
                r.failure_mode,
                r.k,
                r.measured,
                r.measured_ci95[0],
                r.measured_ci95[1],
                esc(m)
            );
        }
    }
    h.push_str("</ul>");
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
