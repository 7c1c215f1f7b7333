//! What every part of the report writes the same way: colours, escaping, numbers.

use keel_balance::StrategyKind;

/// The colour of lines that belong to no strategy (the uniform model's curve, goals, fair
/// shares): near black, which no strategy has.
pub(crate) const REFERENCE: (u8, u8, u8) = (40, 40, 40);

/// One colour per strategy, the same in every chart of the report (and the same as `keel
/// simulate --plot`'s: keel-model's palette by the strategy's place in
/// [`StrategyKind::ALL`]): a strategy's measured points, simulated rings, closed-form curve
/// and latency distributions all take it.
pub(crate) fn strategy_colour(strategy: &str) -> (u8, u8, u8) {
    let i = StrategyKind::ALL
        .iter()
        .position(|k| k.name() == strategy)
        .unwrap_or(StrategyKind::ALL.len());
    keel_model::plot::palette(i)
}

/// Escapes text for HTML.
pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A colour in CSS.
pub(crate) fn css(c: (u8, u8, u8)) -> String {
    format!("rgb({},{},{})", c.0, c.1, c.2)
}

/// A rate in percent, with two decimals below 1 %.
pub(crate) fn pct(x: f64) -> String {
    if x > 0.0 && x < 0.01 {
        format!("{:.2}%", x * 100.0)
    } else {
        format!("{:.1}%", x * 100.0)
    }
}

/// A distance in standard errors, in words.
pub(crate) fn se_text(z: f64) -> String {
    if z.is_infinite() {
        "infinitely many standard errors (the interval has no width on that side)".into()
    } else {
        format!("{:.1} standard errors", z.abs())
    }
}

/// q with three significant digits or so.
pub(crate) fn fmt_q(q: f64) -> String {
    if q >= 10.0 {
        format!("{q:.1}")
    } else if q >= 1.0 {
        format!("{q:.2}")
    } else {
        format!("{q:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_colour_per_strategy_and_none_for_references() {
        let lab = [
            StrategyKind::RoundRobin,
            StrategyKind::Random,
            StrategyKind::LeastConnections,
            StrategyKind::LeastRequest,
            StrategyKind::LeastTime,
            StrategyKind::PeakEwma,
            StrategyKind::Prequal,
        ];
        let colours: Vec<_> = lab.iter().map(|k| strategy_colour(k.name())).collect();
        for (i, c) in colours.iter().enumerate() {
            assert_ne!(*c, REFERENCE, "{}", lab[i].name());
            for (j, d) in colours.iter().enumerate().skip(i + 1) {
                assert_ne!(c, d, "{} and {}", lab[i].name(), lab[j].name());
            }
        }
        // The same name gives the same colour wherever it is drawn.
        assert_eq!(strategy_colour("prequal"), strategy_colour("prequal"));
    }
}
