//! 95 % confidence intervals, the one definition the simulator, the load generator and the lab
//! all use: Wilson's for a success rate from counts, Student's t for a mean over replications.

/// The 97.5 % quantile of the standard normal: a two-sided 95 % interval is +-Z95 standard
/// errors.
pub const Z95: f64 = 1.959_963_984_540_054;

/// Wilson score 95 % interval for `successes` out of `n` (`n = 0` gives [0, 1]). At 0 or `n`
/// successes the bound on that side is exactly 0 or 1.
pub fn wilson95(successes: u64, n: u64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let successes = successes.min(n);
    let z2 = Z95 * Z95;
    let n_f = n as f64;
    let p = successes as f64 / n_f;
    let centre = (p + z2 / (2.0 * n_f)) / (1.0 + z2 / n_f);
    let half = Z95 / (1.0 + z2 / n_f) * (p * (1.0 - p) / n_f + z2 / (4.0 * n_f * n_f)).sqrt();
    // Exact at the edges: rounding would otherwise leave a 1e-17 crumb.
    let lo = if successes == 0 {
        0.0
    } else {
        (centre - half).max(0.0)
    };
    let hi = if successes == n {
        1.0
    } else {
        (centre + half).min(1.0)
    };
    (lo, hi)
}

/// Student-t interval of the mean of `xs` (at least two values).
pub fn student_t95(xs: &[f64]) -> Option<(f64, f64)> {
    let n = xs.len();
    if n < 2 {
        return None;
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t975(n - 1) * (var / n as f64).sqrt();
    Some((mean - half, mean + half))
}

/// The 97.5 % quantile of Student's t with `dof` degrees of freedom.
fn t975(dof: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match dof {
        0 => f64::INFINITY,
        1..=30 => TABLE[dof - 1],
        31..=60 => 2.000,
        61..=120 => 1.980,
        _ => 1.960,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_textbook_values_and_is_exact_at_the_edges() {
        // 80 of 100: the textbook Wilson interval is (0.7112, 0.8666).
        let (lo, hi) = wilson95(80, 100);
        assert!(
            (lo - 0.7112).abs() < 5e-4 && (hi - 0.8666).abs() < 5e-4,
            "{lo} {hi}"
        );
        // All successes: upper bound 1, lower bound n / (n + z^2).
        let (lo, hi) = wilson95(50, 50);
        assert_eq!(hi, 1.0);
        assert!((lo - 50.0 / (50.0 + Z95 * Z95)).abs() < 1e-12, "{lo}");
        let (lo, hi) = wilson95(0, 50);
        assert_eq!(lo, 0.0);
        assert!((hi - Z95 * Z95 / (50.0 + Z95 * Z95)).abs() < 1e-12, "{hi}");
        assert_eq!(wilson95(0, 0), (0.0, 1.0));
    }

    #[test]
    fn wilson_matches_a_known_value() {
        // 512 of 1000: p = 0.512, Wilson 95 % = [0.4810, 0.5429].
        let (lo, hi) = wilson95(512, 1000);
        assert!(
            (lo - 0.4810).abs() < 5e-4 && (hi - 0.5429).abs() < 5e-4,
            "{lo} {hi}"
        );
        let (lo, hi) = wilson95(1000, 1000);
        assert!(hi == 1.0 && lo > 0.995 && lo < 0.9975, "{lo}");
    }

    #[test]
    fn student_t_widens_with_few_samples() {
        let (lo, hi) = student_t95(&[0.5, 0.6]).unwrap();
        // mean 0.55, s = 0.0707, se = 0.05, t = 12.706
        assert!((hi - lo - 2.0 * 12.706 * 0.05).abs() < 1e-9);
        assert!(student_t95(&[0.5]).is_none());
    }
}
