//! A sweep over the settings E8 fixes: offered load, share and slowness of slow servers,
//! cluster size, number of clients and placement, for random, round-robin, least-request,
//! peak-EWMA and prequal, each with and without hedging. Every cell is an E8-like scenario
//! (FIFO servers of one call at a time, exponential 10 ms service, Poisson arrivals, 2 s
//! timeout); its rows run as one parallel batch. The verdicts the sweep gives are computed
//! here ([`Verdict`]), and the heat maps of p99 ratios per strategy pair drawn by [`heat_maps`].

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_balance::{BalancerConfig, HedgeConfig, HedgeDelay, StrategyKind};
use plotters::prelude::*;
use serde::Serialize;

use crate::plot::PlotError;
use crate::sim::{
    self, CapacityConfig, ClusterConfig, Discipline, Load, Placement, Scenario, SimError,
};
use crate::{FailureMode, Latency, LatencyDist};

/// The strategies compared in every cell.
pub const STRATEGIES: [StrategyKind; 5] = [
    StrategyKind::Random,
    StrategyKind::RoundRobin,
    StrategyKind::LeastRequest,
    StrategyKind::PeakEwma,
    StrategyKind::Prequal,
];

/// One setting of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cell {
    /// Offered load as a fraction of capacity (slow servers counted at their speed).
    pub load: f64,
    /// Share of servers that are slow.
    pub slow_share: f64,
    /// How many times slower they work.
    pub slow_factor: f64,
    /// Servers in the cluster.
    pub servers: u32,
    /// Balancers: 1 is one balancer that sees every call (server-side placement); more are
    /// clients each with its own (client-side), arrivals spread over them at random.
    pub clients: u32,
}

impl Cell {
    /// Slow servers (the share of `servers`, rounded).
    pub fn slow(&self) -> u32 {
        (self.slow_share * f64::from(self.servers)).round() as u32
    }

    /// `server-side` or `client-side`.
    pub fn placement(&self) -> &'static str {
        if self.clients == 1 {
            "server-side"
        } else {
            "client-side"
        }
    }

    /// The row label of the heat maps: servers, placement, slow servers.
    pub fn setting(&self) -> String {
        let who = if self.clients == 1 {
            "1 balancer".to_string()
        } else {
            format!("{} clients", self.clients)
        };
        let slow = if self.slow() == 0 || self.slow_factor == 1.0 {
            "no slow".to_string()
        } else {
            format!("{:.0}% x{}", self.slow_share * 100.0, self.slow_factor)
        };
        format!("{} srv, {who}, {slow}", self.servers)
    }
}

/// The grid: loads x heterogeneity x topology.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Grid {
    /// Offered loads.
    pub loads: Vec<f64>,
    /// (share of slow servers, slow factor) pairs.
    pub heterogeneity: Vec<(f64, f64)>,
    /// (servers, clients) pairs; clients = 1 is server-side placement.
    pub topologies: Vec<(u32, u32)>,
    /// Measured requests per replication.
    pub requests: u64,
    /// Replications per row.
    pub replications: u32,
    /// Virtual time before measuring (queues start empty).
    pub warmup: Duration,
}

impl Grid {
    /// The documented grid (docs/tail-latency.md, "The sweep"): 4 loads x 4 kinds of slow
    /// servers x 5 topologies = 80 cells, 10 rows each, 8 replications of 15 000 requests.
    pub fn full() -> Self {
        Self {
            loads: vec![0.5, 0.8, 0.9, 0.97],
            heterogeneity: vec![(0.0, 1.0), (0.1, 3.0), (0.3, 2.0), (0.3, 5.0)],
            topologies: vec![(10, 1), (10, 10), (50, 100), (200, 1000), (200, 1)],
            requests: 15_000,
            // Eight, so that a paired difference of two rows' quantiles has a usable interval
            // (Student's t with 7 degrees of freedom: 2.36; with 1, as at 2 replications, 12.7).
            replications: 8,
            warmup: Duration::from_secs(2),
        }
    }

    /// A CI-sized grid: 2 loads x 2 kinds x 3 topologies = 12 cells, fewer requests.
    pub fn quick() -> Self {
        Self {
            loads: vec![0.5, 0.9],
            heterogeneity: vec![(0.0, 1.0), (0.3, 5.0)],
            topologies: vec![(10, 1), (10, 10), (50, 100)],
            requests: 5_000,
            replications: 1,
            warmup: Duration::from_secs(1),
        }
    }

    /// Every cell, load fastest.
    pub fn cells(&self) -> Vec<Cell> {
        let mut out = Vec::new();
        for &(servers, clients) in &self.topologies {
            for &(slow_share, slow_factor) in &self.heterogeneity {
                for &load in &self.loads {
                    out.push(Cell {
                        load,
                        slow_share,
                        slow_factor,
                        servers,
                        clients,
                    });
                }
            }
        }
        out
    }

    /// The scenario of one cell for one strategy, hedged (p95, 5 % budget) or not.
    pub fn scenario(&self, cell: &Cell, strategy: StrategyKind, hedged: bool) -> Scenario {
        let slow = cell.slow();
        let mut sc = Scenario {
            name: "sweep".into(),
            seed: 1,
            replications: self.replications,
            requests: self.requests,
            warmup: self.warmup,
            timeout: Duration::from_secs(2),
            placement: if cell.clients == 1 {
                Placement::ServerSide
            } else {
                Placement::ClientSide
            },
            load: Load::Open {
                rate: 1.0,
                clients: cell.clients,
            },
            hedge: hedged.then_some(HedgeConfig {
                delay: HedgeDelay::Quantile(0.95),
                max: 1,
                budget_percent: 5.0,
            }),
            clusters: vec![ClusterConfig {
                name: "backend".into(),
                servers: cell.servers,
                failed: if cell.slow_factor == 1.0 { 0 } else { slow },
                failure: FailureMode::Slow {
                    factor: cell.slow_factor,
                },
                latency: Latency {
                    dist: LatencyDist::Exponential,
                    mean: Duration::from_millis(10),
                },
                capacity: Some(CapacityConfig {
                    concurrency: 1,
                    discipline: Discipline::Fifo,
                }),
                balancer: BalancerConfig::new(strategy),
                ..ClusterConfig::default()
            }],
            ..Scenario::default()
        };
        sc.set_offered_load(cell.load)
            .expect("open loop into servers that queue");
        sc.label = format!(
            "load {:.2}, {}{}",
            cell.load,
            cell.setting(),
            if hedged { ", hedged" } else { "" }
        );
        sc
    }
}

/// One row's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Its cell.
    #[serde(flatten)]
    pub cell: Cell,
    /// The strategy.
    pub strategy: String,
    /// Hedged (p95 delay, 5 % budget).
    pub hedged: bool,
    /// Share of requests that succeeded.
    pub success: f64,
    /// Request latency in ms.
    pub mean_ms: f64,
    /// Median, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// 99.9th percentile, ms.
    pub p999_ms: f64,
    /// Hedges and retries per request.
    pub extra_calls: f64,
    /// Each replication's p99 and p99.9, ms (replication r of every row of a cell ran on the
    /// same random streams: see [`run`]).
    #[serde(skip)]
    pub replications_ms: Vec<[f64; 2]>,
}

/// The sweep's results and what it took.
#[derive(Debug, Clone)]
pub struct Sweep {
    /// The grid run.
    pub grid: Grid,
    /// Every row, cell by cell.
    pub rows: Vec<Row>,
    /// Calls simulated.
    pub calls: u64,
    /// Wall time.
    pub wall: Duration,
}

/// The scenarios of a grid, cell by cell, strategy by strategy, unhedged then hedged.
pub fn scenarios(grid: &Grid) -> Vec<(Cell, Scenario)> {
    let mut out = Vec::new();
    for cell in grid.cells() {
        for s in STRATEGIES {
            for hedged in [false, true] {
                out.push((cell, grid.scenario(&cell, s, hedged)));
            }
        }
    }
    out
}

/// Runs the grid (every replication of every row as one parallel job list); `progress`
/// receives counts of completed measured requests.
pub fn run(grid: &Grid, progress: &(dyn Fn(u64) + Sync)) -> Result<Sweep, SimError> {
    let (cells, rows): (Vec<Cell>, Vec<Scenario>) = scenarios(grid).into_iter().unzip();
    // Common random numbers: the rows of a cell share their seed, so replication r of each
    // sees the same arrivals and the same work per try, and a pair of rows differs by its
    // strategy or its hedging, not by its luck.
    let options = sim::RunOptions {
        common_random_numbers: true,
    };
    let report = sim::run_batch_with(&rows, options, progress)?;
    let rows = cells
        .into_iter()
        .zip(&rows)
        .zip(&report.results)
        .map(|((cell, sc), r)| Row {
            cell,
            strategy: r.strategy.clone(),
            hedged: sc.hedge.is_some(),
            success: r.success,
            mean_ms: r.latency_ms.mean,
            p50_ms: r.latency_ms.p50,
            p99_ms: r.latency_ms.p99,
            p999_ms: r.latency_ms.p999,
            extra_calls: r.extra_calls,
            replications_ms: r
                .replication_latency_ms
                .iter()
                .map(|l| [l.p99, l.p999])
                .collect(),
        })
        .collect();
    Ok(Sweep {
        grid: grid.clone(),
        rows,
        calls: report.calls,
        wall: report.wall,
    })
}

impl Sweep {
    /// The row of `strategy` (hedged or not) in `cell`.
    pub fn find(&self, cell: &Cell, strategy: StrategyKind, hedged: bool) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.cell == *cell && r.strategy == strategy.name() && r.hedged == hedged)
    }

    /// Every row as CSV, with a header.
    pub fn csv(&self) -> String {
        let mut s = String::from(
            "load,slow_share,slow_factor,servers,clients,placement,strategy,hedged,success,mean_ms,p50_ms,p99_ms,p999_ms,extra_calls\n",
        );
        for r in &self.rows {
            let c = &r.cell;
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{},{},{:.5},{:.2},{:.2},{:.2},{:.2},{:.4}",
                c.load,
                c.slow_share,
                c.slow_factor,
                c.servers,
                c.clients,
                c.placement(),
                r.strategy,
                r.hedged,
                r.success,
                r.mean_ms,
                r.p50_ms,
                r.p99_ms,
                r.p999_ms,
                r.extra_calls
            );
        }
        s
    }

    /// The herd's acceptance checks (see `herd` in presets).
    pub fn verdict(&self) -> Verdict {
        let mut v = Verdict::default();
        for cell in self.grid.cells() {
            let (Some(pq), Some(lr)) = (
                self.find(&cell, StrategyKind::Prequal, false),
                self.find(&cell, StrategyKind::LeastRequest, false),
            ) else {
                continue;
            };
            v.prequal_vs_least_request.push(Comparison {
                cell,
                strategy: StrategyKind::Prequal,
                a: pq.p99_ms,
                b: lr.p99_ms,
                difference: paired(pq, lr, 0),
            });
            for s in STRATEGIES {
                let (Some(off), Some(on)) = (self.find(&cell, s, false), self.find(&cell, s, true))
                else {
                    continue;
                };
                v.hedging.push(Comparison {
                    cell,
                    strategy: s,
                    a: on.p999_ms,
                    b: off.p999_ms,
                    difference: paired(on, off, 1),
                });
            }
        }
        v
    }
}

/// The 95 % interval (Student's t) of the mean over replications of `a`'s quantile minus
/// `b`'s (`q`: 0 for p99, 1 for p99.9), replication by replication: on common random numbers
/// replication r of both rows saw the same arrivals and work, so the differences carry less
/// noise than either quantile. `None` with fewer than two replications.
fn paired(a: &Row, b: &Row, q: usize) -> Option<[f64; 2]> {
    let d: Vec<f64> = a
        .replications_ms
        .iter()
        .zip(&b.replications_ms)
        .map(|(x, y)| x[q] - y[q])
        .collect();
    crate::stats::student_t95(&d).map(|(lo, hi)| [lo, hi])
}

/// One acceptance comparison in one cell: quantile `a` against quantile `b` (pooled over
/// replications, ms), and the paired interval of a - b.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// The cell.
    pub cell: Cell,
    /// The strategy (prequal against least-request: prequal).
    pub strategy: StrategyKind,
    /// Prequal's p99; or the hedged p99.9.
    pub a: f64,
    /// Least-request's p99; or the unhedged p99.9.
    pub b: f64,
    /// 95 % interval of the mean per-replication difference a - b, ms.
    pub difference: Option<[f64; 2]>,
}

impl Comparison {
    /// a / b.
    pub fn ratio(&self) -> f64 {
        self.a / self.b.max(1e-9)
    }

    /// a is above b beyond the interval: every value of the paired interval is above 0.
    pub fn worse_beyond_noise(&self) -> bool {
        self.a > self.b && self.difference.is_some_and(|[lo, _]| lo > 0.0)
    }

    /// "[lo, hi]" of the interval, or "-".
    fn interval(&self) -> String {
        self.difference
            .map_or("-".into(), |[lo, hi]| format!("[{lo:+.1}, {hi:+.1}]"))
    }
}

/// The acceptance checks: prequal's p99 against least-request's (same placement) per cell, and
/// each strategy's p99.9 with and without hedging per cell.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Per cell: prequal's p99 (a) against least-request's (b).
    pub prequal_vs_least_request: Vec<Comparison>,
    /// Per cell and strategy: p99.9 hedged (a) against unhedged (b).
    pub hedging: Vec<Comparison>,
}

impl Verdict {
    /// Cells where prequal's p99 is above least-request's.
    pub fn prequal_losses(&self) -> Vec<&Comparison> {
        self.prequal_vs_least_request
            .iter()
            .filter(|x| x.a > x.b)
            .collect()
    }

    /// (cell, strategy) pairs where hedging raised p99.9.
    pub fn hedging_hurts(&self) -> Vec<&Comparison> {
        self.hedging.iter().filter(|x| x.a > x.b).collect()
    }

    /// The verdict in words, one finding a line.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let n = self.prequal_vs_least_request.len();
        let losses = self.prequal_losses();
        let mut wins: Vec<f64> = self
            .prequal_vs_least_request
            .iter()
            .map(Comparison::ratio)
            .filter(|&r| r <= 1.0)
            .collect();
        wins.sort_by(f64::total_cmp);
        let _ = writeln!(
            s,
            "prequal p99 <= least-request p99 (same placement): {} of {n} cells{}",
            n - losses.len(),
            if wins.is_empty() {
                String::new()
            } else {
                format!(
                    " (ratio {:.2}-{:.2}, median {:.2}, where it wins)",
                    wins[0],
                    wins[wins.len() - 1],
                    wins[wins.len() / 2]
                )
            }
        );
        for c in losses {
            let _ = writeln!(
                s,
                "  loses: load {:.2}, {}: {:.1} vs {:.1} ms ({:.2}x; paired difference {} ms{})",
                c.cell.load,
                c.cell.setting(),
                c.a,
                c.b,
                c.ratio(),
                c.interval(),
                match (c.difference, c.worse_beyond_noise()) {
                    (None, _) => "",
                    (_, true) => ", beyond noise",
                    (_, false) => ", within noise",
                }
            );
        }
        let hurts = self.hedging_hurts();
        let beyond = hurts.iter().filter(|c| c.worse_beyond_noise()).count();
        let _ = writeln!(
            s,
            "hedging never raises p99.9: {} of {} (cell, strategy) pairs; raised beyond the paired 95 % interval in {beyond}",
            self.hedging.len() - hurts.len(),
            self.hedging.len()
        );
        for c in hurts {
            let _ = writeln!(
                s,
                "  hurts: load {:.2}, {}, {}: p99.9 {:.1} -> {:.1} ms (paired difference {} ms{})",
                c.cell.load,
                c.cell.setting(),
                c.strategy.name(),
                c.b,
                c.a,
                c.interval(),
                if c.worse_beyond_noise() {
                    ", beyond noise"
                } else {
                    ""
                }
            );
        }
        s
    }
}

/// The pairs drawn as heat maps: (numerator, denominator, hedged numerator, quantile), so that
/// each map shows numerator / denominator of that quantile per cell.
const PAIRS: [(StrategyKind, StrategyKind, bool, Quantile); 6] = [
    (
        StrategyKind::Prequal,
        StrategyKind::LeastRequest,
        false,
        Quantile::P99,
    ),
    (
        StrategyKind::Prequal,
        StrategyKind::PeakEwma,
        false,
        Quantile::P99,
    ),
    (
        StrategyKind::LeastRequest,
        StrategyKind::Random,
        false,
        Quantile::P99,
    ),
    (
        StrategyKind::PeakEwma,
        StrategyKind::LeastRequest,
        false,
        Quantile::P99,
    ),
    (
        StrategyKind::Prequal,
        StrategyKind::Prequal,
        true,
        Quantile::P999,
    ),
    (
        StrategyKind::LeastRequest,
        StrategyKind::LeastRequest,
        true,
        Quantile::P999,
    ),
];

#[derive(Debug, Clone, Copy)]
enum Quantile {
    P99,
    P999,
}

/// Writes one SVG heat map per strategy pair into `dir` (rows: settings; columns: loads;
/// colour: log2 of the ratio, blue below 1, red above; each cell printed with its ratio).
pub fn heat_maps(dir: &Path, sweep: &Sweep) -> Result<Vec<PathBuf>, PlotError> {
    let mut out = Vec::new();
    for (num, den, hedged, q) in PAIRS {
        let (name, title) = if hedged {
            (
                format!("sweep_{}_hedged_p999.svg", num.name()),
                format!("{}: p99.9 hedged / unhedged", num.name()),
            )
        } else {
            (
                format!("sweep_{}_vs_{}_p99.svg", num.name(), den.name()),
                format!("p99 {} / {}", num.name(), den.name()),
            )
        };
        let path = dir.join(name);
        heat_map(&path, &title, sweep, |cell| {
            let a = sweep.find(cell, num, hedged)?;
            let b = sweep.find(cell, den, false)?;
            let (x, y) = match q {
                Quantile::P99 => (a.p99_ms, b.p99_ms),
                Quantile::P999 => (a.p999_ms, b.p999_ms),
            };
            Some(x / y.max(1e-9))
        })?;
        out.push(path);
    }
    Ok(out)
}

fn heat_map(
    path: &Path,
    title: &str,
    sweep: &Sweep,
    ratio: impl Fn(&Cell) -> Option<f64>,
) -> Result<(), PlotError> {
    let g = &sweep.grid;
    let mut settings: Vec<Cell> = Vec::new();
    for c in g.cells() {
        if !settings.iter().any(|s| s.setting() == c.setting()) {
            settings.push(c);
        }
    }
    let (cols, rows) = (g.loads.len(), settings.len());
    let (w, h) = (260 + 90 * cols as u32, 70 + 26 * rows as u32 + 40);
    let root = SVGBackend::new(path, (w, h)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        title: title.to_string(),
        message: e.to_string(),
    };
    root.fill(&WHITE).map_err(|e| err(&e))?;
    root.draw(&Text::new(
        title.to_string(),
        (10, 10),
        ("sans-serif", 18).into_font(),
    ))
    .map_err(|e| err(&e))?;
    let x0 = 250;
    let y0 = 60;
    for (j, load) in g.loads.iter().enumerate() {
        root.draw(&Text::new(
            format!("load {load:.2}"),
            (x0 + 90 * j as i32 + 14, y0 - 18),
            ("sans-serif", 13).into_font(),
        ))
        .map_err(|e| err(&e))?;
    }
    for (i, s) in settings.iter().enumerate() {
        let y = y0 + 26 * i as i32;
        root.draw(&Text::new(
            s.setting(),
            (10, y + 6),
            ("sans-serif", 12).into_font(),
        ))
        .map_err(|e| err(&e))?;
        for (j, &load) in g.loads.iter().enumerate() {
            let cell = Cell { load, ..*s };
            let x = x0 + 90 * j as i32;
            let r = ratio(&cell);
            let color = r.map_or(RGBColor(220, 220, 220), ratio_color);
            root.draw(&Rectangle::new([(x, y), (x + 88, y + 24)], color.filled()))
                .map_err(|e| err(&e))?;
            let label = r.map_or("-".to_string(), |r| format!("{r:.2}"));
            root.draw(&Text::new(
                label,
                (x + 28, y + 6),
                ("sans-serif", 12).into_font(),
            ))
            .map_err(|e| err(&e))?;
        }
    }
    root.draw(&Text::new(
        "blue: ratio < 1 (the first is better); red: > 1; full colour at 8x or 1/8".to_string(),
        (10, y0 + 26 * rows as i32 + 12),
        ("sans-serif", 11).into_font(),
    ))
    .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// White at 1, towards blue below and red above, saturated at 8x either way.
fn ratio_color(r: f64) -> RGBColor {
    let t = (r.max(1e-9).log2() / 3.0).clamp(-1.0, 1.0);
    let fade = |t: f64| (255.0 * (1.0 - 0.75 * t.abs())) as u8;
    if t < 0.0 {
        RGBColor(fade(t), fade(t), 255)
    } else {
        RGBColor(255, fade(t), fade(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pair is worse beyond noise only when every value of the paired interval is above
    /// zero: hedged p99.9 above unhedged in each of 4 replications by 9-11 ms is; by -5 to +20
    /// ms (the same mean excess) is not, and one replication gives no interval.
    #[test]
    fn a_pair_is_worse_beyond_noise_only_when_its_paired_interval_is_above_zero() {
        let cell = Grid::quick().cells()[0];
        let row = |reps: &[f64]| Row {
            cell,
            strategy: "prequal".into(),
            hedged: false,
            success: 1.0,
            mean_ms: 10.0,
            p50_ms: 10.0,
            p99_ms: 100.0,
            p999_ms: reps.iter().sum::<f64>() / reps.len() as f64,
            extra_calls: 0.0,
            replications_ms: reps.iter().map(|&x| [100.0, x]).collect(),
        };
        let compare = |on: &Row, off: &Row| Comparison {
            cell,
            strategy: StrategyKind::Prequal,
            a: on.p999_ms,
            b: off.p999_ms,
            difference: paired(on, off, 1),
        };
        let off = row(&[200.0, 210.0, 190.0, 200.0]);
        let steady = compare(&row(&[210.0, 219.0, 201.0, 210.0]), &off);
        let [lo, hi] = steady.difference.unwrap();
        assert!(lo > 0.0 && hi < 15.0, "{lo} {hi}");
        assert!(steady.worse_beyond_noise());
        let noisy = compare(&row(&[195.0, 230.0, 210.0, 205.0]), &off);
        assert_eq!(noisy.a - noisy.b, steady.a - steady.b);
        assert!(!noisy.worse_beyond_noise());
        let one = compare(&row(&[250.0]), &row(&[200.0]));
        assert_eq!(one.difference, None);
        assert!(!one.worse_beyond_noise());
    }

    #[test]
    fn the_grid_spans_80_cells_and_cells_hit_their_load() {
        let g = Grid::full();
        assert_eq!(g.cells().len(), 80);
        let cells = g.cells();
        let min = |f: fn(&Cell) -> f64| cells.iter().map(f).fold(f64::INFINITY, f64::min);
        let max = |f: fn(&Cell) -> f64| cells.iter().map(f).fold(0.0, f64::max);
        assert_eq!((min(|c| c.load), max(|c| c.load)), (0.5, 0.97));
        assert_eq!((min(|c| c.slow_share), max(|c| c.slow_share)), (0.0, 0.3));
        assert_eq!((min(|c| c.slow_factor), max(|c| c.slow_factor)), (1.0, 5.0));
        assert_eq!(
            (min(|c| f64::from(c.clients)), max(|c| f64::from(c.clients))),
            (1.0, 1000.0)
        );
        assert_eq!(
            (min(|c| f64::from(c.servers)), max(|c| f64::from(c.servers))),
            (10.0, 200.0)
        );
        for c in &cells {
            let sc = g.scenario(c, StrategyKind::Prequal, true);
            sc.validate().unwrap();
            assert!((sc.offered_load().unwrap() - c.load).abs() < 1e-9, "{c:?}");
            assert_eq!(
                sc.clusters[0].failed,
                if c.slow_factor == 1.0 { 0 } else { c.slow() }
            );
        }
        assert_eq!(scenarios(&Grid::quick()).len(), 12 * 10);
    }
}
