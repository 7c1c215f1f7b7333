//! The report's E8 and E9 sections: tables, CDF charts of measured next to simulated (and
//! closed-form) latency, the slowed server's share of calls over time, and the sentences.

use std::fmt::Write as _;

use keel_model::plot::{render_svg, ChartSpec, Series, Style};

use crate::lab::results::LabReport;
use crate::lab::style::{css, esc, strategy_colour, REFERENCE};
use crate::lab::tail;
use crate::lab::tail_rows::{LatencyRow, ReactionRow, QUANTILES};

fn chart(spec: &ChartSpec, series: &[Series]) -> Option<String> {
    match render_svg(spec, series) {
        Ok(svg) => Some(svg),
        Err(e) => {
            tracing::warn!("chart {}: {e}", spec.title);
            None
        }
    }
}

fn figure(h: &mut String, title: &str, svg: Option<String>) {
    if let Some(svg) = svg {
        let _ = write!(h, "<figure aria-label=\"{}\">{svg}</figure>", esc(title));
    }
}

const NINES_LABEL: &str = "-log10(1 - F): 2 = p99, 3 = p99.9";

/// The x range of a set of CDFs: up to the largest p99.9 shown.
fn x_max(rows: &[&LatencyRow]) -> f64 {
    rows.iter()
        .flat_map(|r| {
            [r.measured.p999, r.simulated.p999]
                .into_iter()
                .chain(r.model.map(|m| m.p999))
        })
        .fold(0.0, f64::max)
        * 1.08
}

fn tail_charts(rows: &[LatencyRow]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let all: Vec<&LatencyRow> = rows.iter().collect();
    let load = rows.first().map_or(0.0, |r| r.load_asked);
    // Every strategy at once: measured solid, simulated dashed.
    let mut series = Vec::new();
    for r in rows {
        let c = strategy_colour(&r.strategy);
        series.push(
            Series::line(format!("measured: {}", r.strategy), r.measured_cdf.clone()).with_color(c),
        );
        series.push(
            Series::new(
                format!("simulated: {}", r.strategy),
                r.simulated_cdf.clone(),
                Style::Dashed,
            )
            .with_color(c),
        );
    }
    let spec = ChartSpec::new(
        format!("E8: request latency at load {load:.2}, every strategy"),
        "latency (ms)",
        NINES_LABEL,
    )
    .x_range(0.0, x_max(&all))
    .y_range(0.0, 3.3);
    out.push((spec.title.clone(), chart(&spec, &series)));
    // One chart per strategy: measured, simulated and the closed form.
    for r in rows {
        let max = x_max(&[r]);
        let c = strategy_colour(&r.strategy);
        let mut series = vec![
            Series::line("measured", r.measured_cdf.clone()).with_color(c),
            Series::new("simulated", r.simulated_cdf.clone(), Style::Dashed).with_color(c),
        ];
        if !r.model_cdf.is_empty() {
            series.push(
                Series::new("M/G/1 model", r.model_cdf.clone(), Style::Dotted)
                    .with_color(REFERENCE),
            );
        }
        let mut spec = ChartSpec::new(
            format!("E8 {}: measured and simulated", r.strategy),
            "latency (ms)",
            NINES_LABEL,
        )
        .x_range(0.0, max)
        .y_range(0.0, 3.3);
        spec.size = (580, 360);
        out.push((spec.title.clone(), chart(&spec, &series)));
    }
    out
}

fn reaction_charts(rows: &[ReactionRow]) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let top = rows
        .iter()
        .flat_map(|r| r.measured_series.iter().chain(&r.simulated_series))
        .map(|p| p.1)
        .fold(0.2, f64::max)
        .min(1.0);
    for r in rows {
        let c = strategy_colour(&r.strategy);
        let end = r
            .measured_series
            .last()
            .map_or(r.step.end.as_secs_f64() + 1.0, |p| p.0 + 0.125);
        let (a, b) = (r.step.start.as_secs_f64(), r.step.end.as_secs_f64());
        let series = vec![
            Series::line("measured", r.measured_series.clone()).with_color(c),
            Series::new("simulated", r.simulated_series.clone(), Style::Dashed).with_color(c),
            Series::new(
                "fair share",
                vec![(0.0, r.fair_share), (end, r.fair_share)],
                Style::Dotted,
            )
            .with_color(REFERENCE),
            Series::new(
                format!("{:.0}x slower", r.step.factor),
                vec![(a, 0.0), (a, top), (b, top), (b, 0.0)],
                Style::Dotted,
            )
            .with_color((170, 170, 170)),
        ];
        let mut spec = ChartSpec::new(
            format!(
                "E9 {}: the slowed server's share of calls ({:.0}x slower from {a:.0} s to {b:.0} s)",
                r.strategy, r.step.factor
            ),
            "time (s), 250 ms bins",
            "share of calls",
        )
        .x_range(0.0, end)
        .y_range(0.0, top);
        spec.size = (960, 320);
        out.push((spec.title.clone(), chart(&spec, &series)));
    }
    out
}

fn cell(x: f64, ci: [f64; 2]) -> String {
    format!("{x:.1} <small>[{:.1}, {:.1}]</small>", ci[0], ci[1])
}

fn tail_section(h: &mut String, rows: &[LatencyRow]) {
    let Some(first) = rows.first() else { return };
    let comparisons: usize = rows.iter().map(|r| r.comparisons.len()).sum::<usize>()
        + rows
            .iter()
            .filter(|r| r.model.is_some())
            .map(|r| r.comparisons.len())
            .sum::<usize>();
    let _ = write!(
        h,
        "<h2>E8: tail latency under open-loop load</h2><p>{} <code>keel backend</code>s in process \
         on loopback, each serving {} call at a time in FIFO order (the others wait), asked for \
         exponential service of mean {:.0} ms and timing it with keel-testbed's precise timer. \
         Poisson arrivals at {:.2} of capacity at that mean, each sent to one of {} clients drawn \
         at random, each client with its own keel-balance balancer (client-side placement, the \
         simulator's <code>load = {{ kind = \"open\", clients = {} }}</code>); prequal's clients \
         probe (<code>GET /keel/load</code>, 3 per pick) and read every answer's load report, as \
         keel proxy does. Latency runs from the send to the end of the answer's body; failed \
         requests count at the time they failed (2 s timeout).</p>\
         <p>What the backends served is measured (every answer's <code>x-keel-service-us</code>), \
         and the simulation is the run's twin: its measured arrival rate, the measured mean \
         service time (exponential: the measured squared coefficient of variation, SCV, is \
         shown next to it), the measured probe round trip as the probe delay, 8 replications; \
         then the measured round trip of a request that takes no work (before the run, \
         <code>GET /keel/load</code>) is added to simulated and closed-form latency, which the \
         simulated servers do not have. Random placement has a closed form: a Poisson stream \
         split at random is a Poisson stream per server, so each server is an M/G/1 queue, whose \
         sojourn distribution (Pollaczek-Khinchine) is computed from the measured service times \
         themselves (with exponential service it is M/M/1: exponential, mean S / (1 - rho)). \
         Measured intervals: the run's arrivals in arrival order cut into 10 batches, Student-t \
         over the batches' quantiles around the run's own, widened by sqrt((1 + r1) / (1 - r1)) \
         for the lag-1 autocorrelation r1 of the batches' mean latency (a queue at this load \
         remembers for seconds); simulated: Student-t over the replications, centred on the \
         pooled quantile. The lab's rule: the simulation agrees when the two differ by \
         less than 1.96 standard errors of their difference, the model when its value is inside \
         the measured interval. At 95 % each of the {comparisons} comparisons below misses by \
         chance one time in 20.</p>",
        first.servers,
        first.concurrency,
        first.asked_ms,
        first.load_asked,
        first.clients,
        first.clients,
    );
    h.push_str(
        "<table><tr><th class=l rowspan=2>strategy</th><th rowspan=2>offered load</th>\
         <th rowspan=2>served ms (SCV)</th><th colspan=3>p50 ms</th><th colspan=3>p99 ms</th>\
         <th colspan=3>p99.9 ms</th><th rowspan=2>requests</th><th rowspan=2>send lag max ms</th>\
         <th class=l rowspan=2>verdict</th></tr><tr>",
    );
    for _ in QUANTILES {
        h.push_str("<th>measured [95 %]</th><th>simulated [95 %]</th><th>model</th>");
    }
    h.push_str("</tr>");
    for r in rows {
        let (class, verdict) = r.verdict();
        let _ = write!(
            h,
            "<tr class=\"{class}\"><td class=l><span style=\"color:{}\">&#9632;</span> {}</td><td>{:.3}</td><td>{:.2} ({:.2})</td>",
            css(strategy_colour(&r.strategy)),
            esc(&r.strategy),
            r.load_offered,
            r.served_ms.mean,
            r.served_ms.scv
        );
        for (i, c) in r.comparisons.iter().enumerate() {
            let mark = |ok: bool| if ok { "" } else { " &#10007;" };
            let _ = write!(
                h,
                "<td>{}</td><td>{}{}</td><td>{}</td>",
                cell(r.measured.at(i), r.measured_ci95.at(i)),
                cell(r.simulated.at(i), r.simulated_ci95.at(i)),
                mark(c.simulation.agrees),
                match (r.model, c.model) {
                    (Some(m), Some(x)) => format!("{:.1}{}", m.at(i), mark(x.agrees)),
                    _ => "-".into(),
                }
            );
        }
        let _ = write!(
            h,
            "<td>{}</td><td>{:.0}</td><td class=\"l v\">{}</td></tr>",
            r.requests,
            r.send_lag_max_ms,
            esc(&verdict)
        );
    }
    h.push_str(
        "</table><p>&#10007;: outside the lab's rule. Green: every quantile agrees; grey \
         (explained): every quantile that misses lies above by no more than the run's longest \
         machine stall can add (the stall T plus the queues it leaves, T rho / (1 - rho)); amber: \
         the model misses without that explanation; red: the simulation does. Send lag: how late the load generator sent its most delayed arrival, the longest \
         the machine held the run up (on shared cores, other work); at this load the queues of a \
         stall take several times its length to drain, and the simulated servers never stall.</p>",
    );
    h.push_str(
        "<p>Charts: y is -log10(1 - F), so p90, p99 and p99.9 sit at 1, 2 and 3; solid: \
         measured, dashed: simulated, dotted: the closed form; one colour per strategy in every \
         chart of this report.</p>",
    );
    let charts = tail_charts(rows);
    let mut iter = charts.into_iter();
    if let Some((title, svg)) = iter.next() {
        figure(h, &title, svg);
    }
    h.push_str("<div class=grid>");
    for (title, svg) in iter {
        figure(h, &title, svg);
    }
    h.push_str("</div>");
    explanations(h, rows.iter().map(|r| (&r.strategy, &r.explanation)));
}

/// Each row's explanation, under its strategy's name.
fn explanations<'a>(h: &mut String, rows: impl Iterator<Item = (&'a String, &'a String)>) {
    h.push_str("<ul>");
    for (strategy, explanation) in rows {
        let _ = write!(h, "<li><b>{}</b>: {}</li>", esc(strategy), esc(explanation));
    }
    h.push_str("</ul>");
}

fn ms(x: Option<f64>, none: &str) -> String {
    x.map_or(none.to_string(), |v| format!("{v:.0}"))
}

fn reaction_section(h: &mut String, rows: &[ReactionRow]) {
    let Some(first) = rows.first() else { return };
    let _ = write!(
        h,
        "<h2>E9: reaction to a server that slows down</h2><p>{} backends serving {} calls at \
         a time each (FIFO, exponential {:.0} ms asked, precise timer) at {:.2} of capacity; \
         {} clients with their own balancers, as in E8. Server 0 works {:.0}x slower from {:.0} \
         s to {:.0} s of the run (<code>--fault slow</code> switched on and off while it runs; \
         a call's speed is the one in force when its service starts, as in the simulator), so \
         it can take {:.0} calls a second against the {:.0} a fair share sends it. The share of \
         calls it gets is counted per 100 ms by the time of the pick, as the simulator counts \
         it: <b>down</b> is the time from the step until its share falls below half its fair \
         share and stays there for 1 s, <b>back</b> the time from the step down until it is at \
         half its fair share or more for 1 s (to the end of the 100 ms bin). The simulation is \
         the run's twin (measured rate and service time of the servers at normal speed, \
         measured probe delay, the same step), 4 replications pooled. The shares while slow and \
         after are compared by the lab's rule, with standard errors from 1 s batches of the \
         per-bin shares widened for the batches' lag-1 autocorrelation (a balancer that herds \
         moves a server's share for seconds). The charts show 250 ms bins.</p>",
        first.servers,
        first.concurrency,
        tail::service().mean.as_secs_f64() * 1e3,
        first.load_asked,
        first.clients,
        first.step.factor,
        first.step.start.as_secs_f64(),
        first.step.end.as_secs_f64(),
        f64::from(first.concurrency) / (first.served_ms.mean * first.step.factor / 1e3),
        first.rate * first.fair_share,
    );
    h.push_str(
        "<table><tr><th class=l>strategy</th><th>served while slow, ms</th><th>share before</th>\
         <th>share while slow</th><th>share after</th><th>down (ms)</th><th>back (ms)</th>\
         <th>p99 ms</th><th>success</th><th class=l>verdict</th></tr>\
         <tr><th></th><th>measured (x others)</th><th colspan=7>measured / simulated</th><th></th></tr>",
    );
    for r in rows {
        let (m, s) = (&r.measured, &r.simulated);
        let (class, verdict) = r.verdict();
        let mark = |ok: bool| if ok { "" } else { " &#10007;" };
        let _ = write!(
            h,
            "<tr class=\"{}\"><td class=l><span style=\"color:{}\">&#9632;</span> {}</td>\
             <td>{:.1} ({:.1}x)</td>\
             <td>{:.3} / {:.3}</td><td>{:.3} / {:.3}{}</td><td>{:.3} / {:.3}{}</td>\
             <td>{} / {}</td><td>{} / {}</td><td>{:.1} / {:.1}</td>\
             <td>{:.4} / {:.4}</td><td class=\"l v\">{}</td></tr>",
            class,
            css(strategy_colour(&r.strategy)),
            esc(&r.strategy),
            r.slowed_served_ms.mean,
            r.slowed_served_ms.mean / r.served_ms.mean.max(1e-9),
            m.share_before,
            s.share_before,
            m.share_during,
            s.share_during,
            mark(r.during.agrees),
            m.share_after,
            s.share_after,
            mark(r.after.agrees),
            ms(m.down_ms, "never"),
            ms(s.down_ms, "never"),
            ms(m.back_ms, "-"),
            ms(s.back_ms, "-"),
            m.p99_ms,
            s.p99_ms,
            m.success,
            s.success,
            esc(&verdict)
        );
    }
    h.push_str("</table>");
    for (title, svg) in reaction_charts(rows) {
        figure(h, &title, svg);
    }
    explanations(h, rows.iter().map(|r| (&r.strategy, &r.explanation)));
}

/// The E8 and E9 sections of the HTML report (empty when neither ran).
pub(crate) fn html(report: &LabReport) -> String {
    let mut h = String::new();
    tail_section(&mut h, &report.tail_rows);
    reaction_section(&mut h, &report.reaction_rows);
    h
}

fn opt_ms(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.1}"))
}

/// The E8 and E9 tables, for a terminal: at most 100 columns (measured / simulated; the
/// intervals are in the page), or every column with `wide`.
pub(crate) fn print_tables(report: &LabReport, wide: bool) {
    if wide {
        print_wide_tables(report);
        return;
    }
    let short = |class: &str| match class {
        "ok" => "agrees",
        "explained" => "explained",
        _ => "unexplained",
    };
    if let Some(first) = report.tail_rows.first() {
        println!(
            "E8: {} servers x {} call at a time, exp. {:.0} ms asked, {} clients, load {:.2}",
            first.servers, first.concurrency, first.asked_ms, first.clients, first.load_asked
        );
        println!(
            "{:<18} {:>5} {:>15} {:>15} {:>15}  verdict",
            "strategy", "load", "p50 ms mea/sim", "p99 ms mea/sim", "p99.9 mea/sim"
        );
        for r in &report.tail_rows {
            let q = |i: usize| format!("{:.1}/{:.1}", r.measured.at(i), r.simulated.at(i));
            println!(
                "{:<18} {:>5.3} {:>15} {:>15} {:>15}  {}",
                r.strategy,
                r.load_offered,
                q(0),
                q(1),
                q(2),
                short(r.verdict().0)
            );
        }
    }
    if let Some(first) = report.reaction_rows.first() {
        println!(
            "E9: {} servers, load {:.2}, server 0 {:.0}x slower from {:.0} s to {:.0} s; its share \
             (fair {:.2})",
            first.servers,
            first.load_asked,
            first.step.factor,
            first.step.start.as_secs_f64(),
            first.step.end.as_secs_f64(),
            first.fair_share
        );
        println!(
            "{:<16} {:>11} {:>11} {:>11} {:>11} {:>11}  verdict",
            "strategy", "before", "while slow", "after", "down ms", "back ms"
        );
        for r in &report.reaction_rows {
            let (m, s) = (&r.measured, &r.simulated);
            let pair = |a: f64, b: f64| format!("{a:.3}/{b:.3}");
            println!(
                "{:<16} {:>11} {:>11} {:>11} {:>11} {:>11}  {}",
                r.strategy,
                pair(m.share_before, s.share_before),
                pair(m.share_during, s.share_during),
                pair(m.share_after, s.share_after),
                format!("{}/{}", ms(m.down_ms, "-"), ms(s.down_ms, "-")),
                format!("{}/{}", ms(m.back_ms, "-"), ms(s.back_ms, "-")),
                short(r.verdict().0)
            );
        }
        println!("measured/simulated; -: never. Every column and interval: --wide, or the page.");
    }
}

fn print_wide_tables(report: &LabReport) {
    let rows = &report.tail_rows;
    if let Some(first) = rows.first() {
        println!(
            "E8: {} servers x {} call at a time, exponential {:.0} ms asked, {} clients, load {:.2} asked; latency ms, measured [95 %] / simulated [95 %] / model",
            first.servers, first.concurrency, first.asked_ms, first.clients, first.load_asked
        );
        println!(
            "{:<18} {:>6} {:>12} {:>36} {:>38} {:>40}  verdict",
            "strategy", "load", "served (SCV)", "p50", "p99", "p99.9"
        );
        for r in rows {
            let q = |i: usize| {
                let m = r.measured_ci95.at(i);
                let s = r.simulated_ci95.at(i);
                format!(
                    "{:.1} [{:.1},{:.1}] / {:.1} [{:.1},{:.1}] / {}",
                    r.measured.at(i),
                    m[0],
                    m[1],
                    r.simulated.at(i),
                    s[0],
                    s[1],
                    opt_ms(r.model.map(|x| x.at(i)))
                )
            };
            println!(
                "{:<18} {:>6.3} {:>6.2} ({:.2}) {:>36} {:>38} {:>40}  {}",
                r.strategy,
                r.load_offered,
                r.served_ms.mean,
                r.served_ms.scv,
                q(0),
                q(1),
                q(2),
                r.verdict().1
            );
        }
    }
    let rows = &report.reaction_rows;
    if let Some(first) = rows.first() {
        println!(
            "E9: {} servers x {} calls at a time, load {:.2}, server 0 {:.0}x slower from {:.0} s to {:.0} s; its share of calls (fair {:.2}), measured / simulated",
            first.servers,
            first.concurrency,
            first.load_asked,
            first.step.factor,
            first.step.start.as_secs_f64(),
            first.step.end.as_secs_f64(),
            first.fair_share
        );
        println!(
            "{:<18} {:>13} {:>13} {:>13} {:>13} {:>13} {:>15}  verdict",
            "strategy", "before", "while slow", "after", "down ms", "back ms", "p99 ms"
        );
        for r in rows {
            let (m, s) = (&r.measured, &r.simulated);
            println!(
                "{:<18} {:>6.3}/{:<6.3} {:>6.3}/{:<6.3} {:>6.3}/{:<6.3} {:>6}/{:<6} {:>6}/{:<6} {:>7.1}/{:<7.1}  {}",
                r.strategy,
                m.share_before,
                s.share_before,
                m.share_during,
                s.share_during,
                m.share_after,
                s.share_after,
                ms(m.down_ms, "never"),
                ms(s.down_ms, "never"),
                ms(m.back_ms, "-"),
                ms(s.back_ms, "-"),
                m.p99_ms,
                s.p99_ms,
                r.verdict().1
            );
        }
    }
}
