//! Queueing theory for the lab's latency rows: the sojourn-time distribution of an M/G/1 FIFO
//! queue for any service-time distribution, here the one the backends actually served.
//!
//! Random placement splits a Poisson stream into independent Poisson streams, so each of n
//! FIFO servers that serve one call at a time is an M/G/1 queue with arrival rate lambda / n
//! (with exponential service, M/M/1). Its waiting time W has the Pollaczek-Khinchine (Benes)
//! form: with probability 1 - rho no wait, otherwise a geometric number N of independent
//! residual service times, P(N = k) = (1 - rho) rho^k, where a residual time has the density
//! P(S > t) / E[S]. The sojourn is W + S, W and S independent. Both are computed here on a
//! grid of E[S] / 200 from the sample of service times itself (its empirical distribution):
//! each cell's probability is split between its two grid points so that every term keeps its
//! exact mean, so the mean matches Pollaczek-Khinchine's E[S] + lambda E[S^2] / (2 (1 - rho))
//! and the quantiles are within a grid step of the exact ones.

/// The sojourn-time distribution of an M/G/1 FIFO queue, on a grid.
#[derive(Debug, Clone)]
pub struct Mg1 {
    /// Grid step, ms.
    step: f64,
    /// P(T <= k step).
    cdf: Vec<f64>,
    /// Utilisation.
    pub rho: f64,
    /// Mean service time, ms.
    pub service_mean: f64,
    /// Mean of the sojourn, ms (from the grid).
    pub mean: f64,
    /// Pollaczek-Khinchine's mean sojourn E[S] + lambda E[S^2] / (2 (1 - rho)), ms.
    pub pk_mean: f64,
}

/// Mass of the waiting time left beyond the grid at which it stops.
const TAIL: f64 = 1e-7;

/// Grid points per mean service time.
const POINTS_PER_MEAN: f64 = 200.0;

/// Most grid points of the waiting time (2 000 mean service times).
const MAX_POINTS: usize = 400_000;

impl Mg1 {
    /// The queue fed at `arrivals_per_ms` with service times distributed as `service_ms` (a
    /// sample, in ms); `None` if the sample is empty or has no positive mean, or if rho >= 1.
    pub fn new(service_ms: &[f64], arrivals_per_ms: f64) -> Option<Mg1> {
        let mut s: Vec<f64> = service_ms
            .iter()
            .copied()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .collect();
        if s.is_empty() || !(arrivals_per_ms.is_finite() && arrivals_per_ms > 0.0) {
            return None;
        }
        s.sort_by(f64::total_cmp);
        let n = s.len() as f64;
        let mean = s.iter().sum::<f64>() / n;
        let second = s.iter().map(|x| x * x).sum::<f64>() / n;
        let rho = arrivals_per_ms * mean;
        if mean <= 0.0 || rho >= 1.0 {
            return None;
        }
        let h = mean / POINTS_PER_MEAN;
        let max = s[s.len() - 1];
        let cells = (max / h).ceil() as usize + 1;

        // The residual's probability per cell, from G(t) = integral_0^t P(S > u) du
        // = (sum of the s_i <= t + t * #(s_i > t)) / n, split half and half between the
        // cell's two ends (the density is nearly flat over a cell).
        let mut residual = vec![0.0; cells + 1];
        let mut below = 0usize;
        let mut sum_below = 0.0;
        let g =
            |t: f64, below: usize, sum_below: f64| (sum_below + t * (s.len() - below) as f64) / n;
        let mut g_prev = 0.0;
        for j in 0..cells {
            let t = (j + 1) as f64 * h;
            while below < s.len() && s[below] <= t {
                sum_below += s[below];
                below += 1;
            }
            let g_t = g(t, below, sum_below);
            let mass = (g_t - g_prev) / mean;
            g_prev = g_t;
            residual[j] += mass / 2.0;
            residual[j + 1] += mass / 2.0;
        }

        // W: w = (1 - rho) delta_0 + rho (r * w), solved point by point.
        let denom = 1.0 - rho * residual[0];
        let mut w: Vec<f64> = Vec::with_capacity(4096);
        w.push((1.0 - rho) / denom);
        let mut total = w[0];
        while total < 1.0 - TAIL && w.len() < MAX_POINTS {
            let k = w.len();
            let top = k.min(residual.len() - 1);
            let mut acc = 0.0;
            for j in 1..=top {
                acc += residual[j] * w[k - j];
            }
            let v = rho * acc / denom;
            w.push(v);
            total += v;
        }

        // S on the same grid, each value split between its two neighbours (exact mean).
        let mut service = vec![0.0; cells + 1];
        for &x in &s {
            let pos = x / h;
            let lo = pos.floor() as usize;
            let frac = pos - lo as f64;
            service[lo.min(cells)] += (1.0 - frac) / n;
            service[(lo + 1).min(cells)] += frac / n;
        }

        // T = W + S.
        let len = w.len() + service.len() - 1;
        let mut pmf = vec![0.0; len];
        for (j, &p) in service.iter().enumerate() {
            if p == 0.0 {
                continue;
            }
            for (k, &q) in w.iter().enumerate() {
                pmf[j + k] += p * q;
            }
        }
        let mut cdf = Vec::with_capacity(len);
        let mut acc = 0.0;
        let mut first = 0.0;
        for (k, &p) in pmf.iter().enumerate() {
            acc += p;
            first += p * k as f64 * h;
            cdf.push(acc);
        }
        Some(Mg1 {
            step: h,
            cdf,
            rho,
            service_mean: mean,
            mean: first / acc.max(f64::MIN_POSITIVE),
            pk_mean: mean + arrivals_per_ms * second / (2.0 * (1.0 - rho)),
        })
    }

    /// The `q` quantile of the sojourn, ms (linear between grid points); `None` beyond the
    /// grid (q above 1 - 1e-7).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let k = self.cdf.iter().position(|&c| c >= q)?;
        if k == 0 {
            return Some(0.0);
        }
        let (lo, hi) = (self.cdf[k - 1], self.cdf[k]);
        let frac = if hi > lo { (q - lo) / (hi - lo) } else { 1.0 };
        Some((k as f64 - 1.0 + frac) * self.step)
    }
}

/// M/M/1's sojourn quantile: exponential with mean S / (1 - rho).
pub fn mm1_quantile(service_mean: f64, rho: f64, q: f64) -> f64 {
    -service_mean / (1.0 - rho) * (1.0 - q).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn exponential(n: usize, mean: f64, seed: u64) -> Vec<f64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| -mean * (1.0 - rng.gen::<f64>()).ln())
            .collect()
    }

    #[test]
    fn exponential_service_gives_mm1() {
        // 200 000 exponential draws of mean 10 ms at rho = 0.85 (85 per second per server).
        let s = exponential(200_000, 10.0, 1);
        let q = Mg1::new(&s, 0.085).unwrap();
        let m = q.service_mean;
        for p in [0.5, 0.9, 0.99, 0.999] {
            let want = mm1_quantile(m, q.rho, p);
            let got = q.quantile(p).unwrap();
            assert!(
                (got / want - 1.0).abs() < 0.01,
                "p{p}: {got:.2} against M/M/1 {want:.2} ms"
            );
        }
        // Mean: exactly Pollaczek-Khinchine's for the sample, and M/M/1's S / (1 - rho).
        assert!((q.mean / q.pk_mean - 1.0).abs() < 1e-3, "{q:?}");
        assert!((q.mean / (m / (1.0 - q.rho)) - 1.0).abs() < 0.01, "{q:?}");
    }

    #[test]
    fn fixed_service_gives_md1_mean() {
        // M/D/1: E[T] = S (1 + rho / (2 (1 - rho))); S = 10 ms, rho = 0.8: 30 ms.
        let q = Mg1::new(&[10.0; 10], 0.08).unwrap();
        assert!((q.mean - 30.0).abs() < 0.05, "{}", q.mean);
        assert!((q.pk_mean - 30.0).abs() < 1e-9);
        // No call takes less than its service.
        assert!(q.quantile(0.001).unwrap() >= 10.0 - q.step);
    }

    #[test]
    fn a_shift_moves_the_tail_less_than_a_longer_mean() {
        // Served as exponential 10 ms + 1 ms (tokio's timer) against exponential 11 ms, at the
        // same rate: the same mean service, less variability, a shorter tail.
        let shifted: Vec<f64> = exponential(100_000, 10.0, 2)
            .into_iter()
            .map(|x| x + 1.0)
            .collect();
        let longer = exponential(100_000, 11.0, 2);
        let a = Mg1::new(&shifted, 0.08).unwrap();
        let b = Mg1::new(&longer, 0.08).unwrap();
        assert!(a.quantile(0.99).unwrap() < 0.95 * b.quantile(0.99).unwrap());
        assert!(
            Mg1::new(&longer, 0.1).is_none(),
            "rho >= 1 has no steady state"
        );
    }
}
