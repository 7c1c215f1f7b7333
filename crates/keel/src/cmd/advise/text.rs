//! Numbers of `keel advise` in words, shared by the terminal table and the HTML report.

use keel_model::fit;
use keel_model::vocab::LatencyDist;

/// The fitted family in words.
pub(crate) fn family(l: &keel_model::Latency) -> String {
    let mean = l.mean.as_secs_f64() * 1e3;
    match l.dist {
        LatencyDist::Fixed => format!("fixed {mean:.2} ms"),
        LatencyDist::Exponential => format!("exponential {mean:.2} ms"),
        LatencyDist::LogNormal { sigma } => format!("lognormal {mean:.2} ms s={sigma:.2}"),
    }
}

/// A rate in percent with its 95 % interval.
pub(crate) fn rate(r: &fit::Rate) -> String {
    if r.count == 0 {
        return format!("0 [0, {:.3}]", r.ci95[1] * 100.0);
    }
    format!(
        "{:.2} [{:.2}, {:.2}]",
        r.share * 100.0,
        r.ci95[0] * 100.0,
        r.ci95[1] * 100.0
    )
}
