//! `keel advise --out DIR`'s `index.html`: self-contained, in the lab report's style. One chart
//! of predicted success and one of p99 per configuration (with 95 % intervals), the fitted
//! per-endpoint latency against the log's own histogram, the ranking with each configuration's
//! `[[cluster]]` settings, and the sentences of the advice.

use std::fmt::Write as _;
use std::time::Duration;

use keel_model::advise::Advice;
use keel_model::plot::{render_svg, ChartSpec, Series, Style};

use crate::cmd::advise::text::family;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Short label of a configuration for a chart's axis.
fn short(strategy: &str, protections: &str) -> String {
    let p = match protections {
        "none" => "N",
        p if p.starts_with("keel defaults") => "D",
        p if p.starts_with("outlier") => "P",
        _ => "R",
    };
    let s: String = strategy
        .split('-')
        .map(|w| w.chars().next().unwrap_or('?'))
        .collect();
    format!("{s}/{p}")
}

/// The page's first screen: the answer, why, the traps, and the settings to paste.
fn answer(a: &Advice) -> String {
    let mut h = format!("<p class=answer><b>{}</b></p><ul>", esc(&a.answer));
    for w in &a.why {
        let _ = write!(h, "<li>{}</li>", esc(w));
    }
    for t in &a.traps {
        let _ = write!(h, "<li><b>Trap:</b> {}</li>", esc(t));
    }
    let _ = write!(h, "</ul>");
    if let Some(best) = a.ranking.first() {
        let _ = write!(
            h,
            "<p>To run it, {}:</p><pre>{}</pre>",
            if a.balancer == keel_model::advise::Balancer::Keel {
                "replace the cluster's <code>[[cluster]]</code> section with".to_string()
            } else {
                format!("in {}", a.balancer.name())
            },
            esc(best.paste())
        );
    }
    if !a.limits.is_empty() {
        let _ = write!(h, "<p>What {} cannot express:</p><ul>", a.balancer.name());
        for l in &a.limits {
            let _ = write!(h, "<li>{}</li>", esc(l));
        }
        let _ = write!(h, "</ul>");
    }
    h
}

/// Charts shown: the best configurations (all of them up to this many).
const CHARTED: usize = 20;

/// The report.
pub fn html(
    a: &Advice,
    source: &str,
    fitted: Duration,
    simulated: Duration,
) -> anyhow::Result<String> {
    let m = &a.model;
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>keel advise: {cluster}</title><style>\
         body{{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;line-height:1.45}}\
         table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}\
         td.l,th.l{{text-align:left}}tr.run td{{background:#fff3d6}}tr.best td{{background:#e6f4e6}}figure{{margin:1em 0}}\
         li{{margin:.4em 0}}code,pre{{background:#f4f4f4;padding:1px 3px}}pre{{padding:6px;margin:4px 0}}</style></head><body>\
         <h1>keel advise: cluster <code>{cluster}</code></h1>{answer}\
         <h2>How</h2><p>Fitted from <code>{source}</code>: {requests} requests and {tries} tries from {from} to {to} ({secs:.0} s), \
         {rate:.1} requests/s (index of dispersion {disp:.2}; Poisson: 1), {inflight:.2} requests in flight on average. \
         Fitted in {fit:.2} s; {configs} configurations simulated with {reps} replications of {per} requests each in {sim:.1} s. \
         The model is written to <code>fitted.toml</code> beside this page: <code>keel simulate --scenario fitted.toml</code> \
         reruns it, and editing it asks what if. <code>docs/advise.md</code> says what is fitted and what the model leaves out.</p>",
        cluster = esc(&m.cluster),
        answer = answer(a),
        source = esc(source),
        requests = m.requests,
        tries = m.tries,
        from = m.from,
        to = m.to,
        secs = m.seconds,
        rate = m.arrival.rate_per_s,
        disp = m.arrival.dispersion,
        inflight = m.arrival.mean_in_flight,
        fit = fitted.as_secs_f64(),
        configs = a.ranking.len(),
        reps = a.replications,
        per = a.requests_per_replication,
        sim = simulated.as_secs_f64(),
    );
    if !m.notes.is_empty() {
        let _ = write!(h, "<ul>");
        for n in &m.notes {
            let _ = write!(h, "<li><b>Note:</b> {}</li>", esc(n));
        }
        let _ = write!(h, "</ul>");
    }

    // Charts over the best configurations (and the running one, wherever it ranks).
    let mut shown: Vec<usize> = (0..a.ranking.len().min(CHARTED)).collect();
    if let Some(r) = a.running {
        if r >= CHARTED {
            shown.push(r);
        }
    }
    let names: Vec<String> = shown
        .iter()
        .map(|&i| {
            let r = &a.ranking[i];
            format!(
                "{}{}",
                short(&r.strategy, &r.protections),
                if r.running { "*" } else { "" }
            )
        })
        .collect();
    let xs = |f: &dyn Fn(usize) -> f64| -> Vec<(f64, f64)> {
        shown
            .iter()
            .enumerate()
            .map(|(x, &i)| ((x + 1) as f64, f(i)))
            .collect()
    };
    let bars = |f: &dyn Fn(usize) -> (f64, f64)| -> Vec<(f64, f64)> {
        shown.iter().map(|&i| f(i)).collect()
    };
    let success = Series::new(
        "predicted success (95 % interval)",
        xs(&|i| a.ranking[i].success[0]),
        Style::Points,
    )
    .with_error_bars(bars(&|i| {
        (a.ranking[i].success[1], a.ranking[i].success[2])
    }));
    let spec = ChartSpec::new(
        format!("Predicted success, best {} configurations", shown.len()),
        "configuration (strategy initials / N none, D keel defaults, P outlier+retry+health, R as configured; * running)",
        "success",
    )
    .x_categories(names.clone());
    let _ = write!(
        h,
        "<h2>Predictions</h2><figure>{}</figure>",
        render_svg(&spec, &[success])?
    );
    let p99 = Series::new(
        "predicted p99 (95 % interval)",
        xs(&|i| a.ranking[i].p99_ms[0]),
        Style::Points,
    )
    .with_error_bars(bars(&|i| (a.ranking[i].p99_ms[1], a.ranking[i].p99_ms[2])));
    let p999 = Series::new(
        "predicted p99.9",
        xs(&|i| a.ranking[i].p999_ms[0]),
        Style::Rings,
    );
    let spec = ChartSpec::new(
        "Predicted request latency, same configurations",
        "configuration",
        "ms",
    )
    .x_categories(names);
    let _ = write!(h, "<figure>{}</figure>", render_svg(&spec, &[p99, p999])?);

    // The ranking.
    let _ = write!(
        h,
        "<h2>Ranking</h2><p>Best first: success (compared at 0.01 %); rows whose success interval overlaps the best's \
         are a tie (marked =), ranked by more protection (outlier detection, retries and health checks on, then more \
         retries), then p99, then p99.9; the rest likewise in tiers. Success intervals are \
         the union of a Student-t interval over replications and a Wilson interval on the pooled counts; latency \
         intervals are Student-t over replications. Shares are of tries, retries included, in endpoint order.</p>\
         <table><tr><th>rank</th><th class=l>strategy</th><th class=l>protections</th><th>success %</th><th>95 %</th>\
         <th>p99 ms</th><th>95 %</th><th>p99.9 ms</th><th>mean ms</th><th>retries / request</th><th class=l>shares</th>\
         <th class=l>[[cluster]]</th></tr>"
    );
    for (i, r) in a.ranking.iter().enumerate() {
        let class = if r.running {
            " class=run"
        } else if i == 0 {
            " class=best"
        } else {
            ""
        };
        let shares: Vec<String> = r
            .pick_shares
            .iter()
            .map(|s| format!("{:.1}", s * 100.0))
            .collect();
        let _ = write!(
            h,
            "<tr{class}><td>{}{}{}</td><td class=l>{}</td><td class=l>{}</td><td>{:.3}</td><td>{:.3}-{:.3}</td>\
             <td>{:.1}</td><td>{:.1}-{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.3}</td><td class=l>{} %</td>\
             <td class=l><details><summary>settings</summary><pre>{}</pre></details></td></tr>",
            i + 1,
            if r.tier == 0 && a.tied > 1 { " =" } else { "" },
            if r.running { " (running)" } else { "" },
            esc(&r.strategy),
            esc(&r.protections),
            r.success[0] * 100.0,
            r.success[1] * 100.0,
            r.success[2] * 100.0,
            r.p99_ms[0],
            r.p99_ms[1],
            r.p99_ms[2],
            r.p999_ms[0],
            r.mean_ms,
            r.retries_per_request,
            shares.join(" / "),
            esc(r.paste())
        );
    }
    let _ = write!(h, "</table>");

    // The fitted model, endpoint by endpoint.
    let _ = write!(
        h,
        "<h2>Fitted model</h2><p>Per endpoint: the latency of its successes (the family with the smallest \
         Kolmogorov-Smirnov distance to the log's own distribution; with a capacity, fitted on the calls that did not \
         wait), and its failures with Wilson 95 % intervals. Errors and resets are simulated as failures after their \
         median time, timeouts as hangs to the timeout{}.</p><table><tr><th class=l>endpoint</th><th>tries</th>\
         <th>share</th><th>p50 ms</th><th>p99 ms</th><th>p99.9 ms</th><th class=l>fitted</th><th>KS</th>\
         <th>KS critical</th><th>errors %</th><th>error ms</th><th>timeouts %</th><th>resets %</th><th>capacity</th></tr>",
        m.timeout_ms
            .map_or(String::new(), |t| format!(" ({t:.0} ms)"))
    );
    let pct = |r: &keel_model::fit::Rate| {
        format!(
            "{:.2} [{:.2}, {:.2}]",
            r.share * 100.0,
            r.ci95[0] * 100.0,
            r.ci95[1] * 100.0
        )
    };
    for e in &m.endpoints {
        let l = &e.latency;
        let _ = write!(
            h,
            "<tr><td class=l>{}</td><td>{}</td><td>{:.1} %</td><td>{:.2}</td><td>{:.2}</td><td>{:.2}</td>\
             <td class=l>{}{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&e.name),
            e.tries,
            e.share * 100.0,
            l.p50_ms,
            l.p99_ms,
            l.p999_ms,
            family(&l.family),
            if l.pooled { " (pooled)" } else { "" },
            l.ks.map_or("-".into(), |k| format!("{k:.3}")),
            l.ks_critical,
            pct(&e.failures.error),
            e.failures
                .error_ms
                .map_or("-".into(), |t| format!("{t:.2}")),
            pct(&e.failures.timeout),
            pct(&e.failures.reset),
            e.capacity.as_ref().map_or("-".into(), |c| format!(
                "{} ({:.1} ms alone)",
                c.concurrency, c.service_ms
            ))
        );
    }
    let _ = write!(h, "</table>");
    for e in &m.endpoints {
        let l = &e.latency;
        if l.histogram.is_empty() {
            continue;
        }
        let n = l.samples.max(1) as f64;
        let log_points: Vec<(f64, f64)> = l
            .histogram
            .iter()
            .map(|&(lo, hi, c)| ((lo * hi).sqrt(), c as f64 / n))
            .collect();
        let fit_points: Vec<(f64, f64)> = l
            .histogram
            .iter()
            .map(|&(lo, hi, _)| ((lo * hi).sqrt(), l.family_cdf(hi) - l.family_cdf(lo)))
            .collect();
        let spec = ChartSpec::new(
            format!("{}: successes per latency bin", e.name),
            "latency, ms (bins of equal ratio)",
            "share of successes",
        );
        let svg = render_svg(
            &spec,
            &[
                Series::points("the log", log_points),
                Series::line(format!("fitted: {}", family(&l.family)), fit_points),
            ],
        )?;
        let _ = write!(h, "<figure>{svg}</figure>");
    }
    let _ = write!(h, "</body></html>");
    Ok(h)
}
