//! SVG line charts for keel's reliability figures, shared by `keel analyze`, `keel simulate` and
//! the measurement lab: analytic curves drawn as lines, simulated or measured values drawn as
//! points over them (optionally with confidence-interval bars).
//!
//! The charts use plotters' SVG backend with its built-in text layout estimate, so they need no
//! font files and no system libraries (fontconfig, freetype): text goes into the SVG as `<text>`
//! elements and the viewer renders it.
//!
//! ```no_run
//! use keel_model::plot::{line_chart, Series};
//! let curve = Series::line("analytic", (0..=100).map(|i| i as f64 / 100.0).map(|p| (p, (1.0 - p).powi(3))).collect());
//! let measured = Series::points("measured", vec![(0.2, 0.509)]).with_error_bars(vec![(0.49, 0.53)]);
//! line_chart("f.svg".as_ref(), "round-robin, k = 3", "p", "f(p)", &[curve, measured]).unwrap();
//! ```

use std::path::{Path, PathBuf};

use plotters::prelude::*;

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A solid line through the points, in order (an analytic curve).
    Line,
    /// A dashed line through the points, to tell apart curves that share a colour.
    Dashed,
    /// A dotted line, a third line style for curves that share a colour.
    Dotted,
    /// A filled marker at each point (measured values).
    Points,
    /// A ring at each point: another kind of value (simulated) stays visible over or under a
    /// filled marker at the same place.
    Rings,
}

/// One labelled series of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` values; non-finite ones are skipped.
    pub points: Vec<(f64, f64)>,
    /// How to draw it.
    pub style: Style,
    /// RGB colour; `None` takes the next colour of the palette by series position.
    pub color: Option<(u8, u8, u8)>,
    /// Per point `(low, high)` of y (a confidence interval), drawn as a vertical bar; empty for
    /// none, otherwise as long as `points`.
    pub error_bars: Vec<(f64, f64)>,
}

impl Series {
    /// A solid line.
    pub fn line(label: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series::new(label, points, Style::Line)
    }

    /// A dashed line.
    pub fn dashed(label: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series::new(label, points, Style::Dashed)
    }

    /// Markers only.
    pub fn points(label: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series::new(label, points, Style::Points)
    }

    /// A series drawn in `style`.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>, style: Style) -> Series {
        Series {
            label: label.into(),
            points,
            style,
            color: None,
            error_bars: Vec::new(),
        }
    }

    /// Sets the colour.
    pub fn with_color(mut self, rgb: (u8, u8, u8)) -> Series {
        self.color = Some(rgb);
        self
    }

    /// Adds a `(low, high)` bar per point.
    pub fn with_error_bars(mut self, bars: Vec<(f64, f64)>) -> Series {
        self.error_bars = bars;
        self
    }
}

/// Title, axis labels, ranges and size of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct ChartSpec {
    /// Title above the chart.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// Fixed x range; `None` fits the data.
    pub x_range: Option<(f64, f64)>,
    /// Fixed y range; `None` fits the data.
    pub y_range: Option<(f64, f64)>,
    /// Width and height in pixels (the legend takes a column on the right).
    pub size: (u32, u32),
    /// Names of the categories of a categorical x axis, drawn at x = 1, 2, ...; empty: a
    /// numeric axis.
    pub x_categories: Vec<String>,
}

impl ChartSpec {
    /// A 960 x 560 chart with ranges fitted to the data.
    pub fn new(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
    ) -> ChartSpec {
        ChartSpec {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            x_range: None,
            y_range: None,
            size: (960, 560),
            x_categories: Vec::new(),
        }
    }

    /// Makes the x axis categorical: category i (from 0) sits at x = i + 1, labelled with its
    /// name, and the x range is 0.5..n + 0.5. Place several series within a category by small
    /// offsets from its x.
    pub fn x_categories(mut self, names: Vec<String>) -> ChartSpec {
        self.x_range = Some((0.5, names.len() as f64 + 0.5));
        self.x_categories = names;
        self
    }

    /// Fixes the x range.
    pub fn x_range(mut self, lo: f64, hi: f64) -> ChartSpec {
        self.x_range = Some((lo, hi));
        self
    }

    /// Fixes the y range.
    pub fn y_range(mut self, lo: f64, hi: f64) -> ChartSpec {
        self.y_range = Some((lo, hi));
        self
    }
}

/// Why a chart could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// No series had a finite point, so there is nothing to scale the axes by.
    #[error("chart `{0}` has no finite data point")]
    NoData(String),
    /// A series' error bars do not match its points.
    #[error("series `{label}` has {points} points but {bars} error bars")]
    ErrorBars {
        /// The series.
        label: String,
        /// Its point count.
        points: usize,
        /// Its error-bar count.
        bars: usize,
    },
    /// plotters failed to draw.
    #[error("drawing chart `{title}`: {message}")]
    Draw {
        /// The chart's title.
        title: String,
        /// plotters' error.
        message: String,
    },
    /// The SVG could not be written.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Tableau 10: distinguishable, and readable for the common colour-vision deficiencies.
const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

/// The palette colour for series number `i` (what a series without a colour gets).
pub fn palette(i: usize) -> (u8, u8, u8) {
    PALETTE[i % PALETTE.len()]
}

/// Writes an SVG line chart with ranges fitted to the data.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), PlotError> {
    write_svg(path, &ChartSpec::new(title, x_label, y_label), series)
}

/// Writes the chart described by `spec` to `path` as SVG.
pub fn write_svg(path: &Path, spec: &ChartSpec, series: &[Series]) -> Result<(), PlotError> {
    let svg = render_svg(spec, series)?;
    std::fs::write(path, svg).map_err(|source| PlotError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Renders the chart as an SVG document.
pub fn render_svg(spec: &ChartSpec, series: &[Series]) -> Result<String, PlotError> {
    for s in series {
        if !s.error_bars.is_empty() && s.error_bars.len() != s.points.len() {
            return Err(PlotError::ErrorBars {
                label: s.label.clone(),
                points: s.points.len(),
                bars: s.error_bars.len(),
            });
        }
    }
    let x_range = match spec.x_range {
        Some(r) => r,
        None => fit_range(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)))
            .ok_or_else(|| PlotError::NoData(spec.title.clone()))?,
    };
    let y_range = match spec.y_range {
        Some(r) => r,
        None => fit_range(series.iter().flat_map(|s| {
            s.points
                .iter()
                .map(|p| p.1)
                .chain(s.error_bars.iter().flat_map(|b| [b.0, b.1]))
        }))
        .ok_or_else(|| PlotError::NoData(spec.title.clone()))?,
    };
    let mut svg = String::new();
    draw(&mut svg, spec, series, x_range, y_range).map_err(|e| PlotError::Draw {
        title: spec.title.clone(),
        message: e.to_string(),
    })?;
    Ok(svg)
}

/// Min and max of the finite values, widened a little so that nothing sits on the frame.
fn fit_range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return None;
    }
    let pad = if hi > lo {
        (hi - lo) * 0.03
    } else {
        lo.abs().max(1.0) * 0.5
    };
    Some((lo - pad, hi + pad))
}

/// Width of the legend column: fits the longest label (about 7.5 px a character at 14 px),
/// at most 45% of the chart.
fn legend_width(series: &[Series], chart_width: u32) -> u32 {
    let longest = series
        .iter()
        .map(|s| s.label.chars().count())
        .max()
        .unwrap_or(0);
    let wanted = 60 + (longest as f64 * 7.5).ceil() as u32;
    wanted.clamp(120, chart_width * 45 / 100)
}

fn draw(
    svg: &mut String,
    spec: &ChartSpec,
    series: &[Series],
    x_range: (f64, f64),
    y_range: (f64, f64),
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(svg, spec.size).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root.titled(&spec.title, ("sans-serif", 22))?;
    let (plot_area, legend_area) = body.split_horizontally(
        spec.size
            .0
            .saturating_sub(legend_width(series, spec.size.0)),
    );

    let mut chart = ChartBuilder::on(&plot_area)
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range.0..x_range.1, y_range.0..y_range.1)?;
    let category = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 1.0 {
            spec.x_categories
                .get(i as usize - 1)
                .cloned()
                .unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.x_desc(spec.x_label.as_str())
        .y_desc(spec.y_label.as_str())
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(RGBColor(235, 235, 235));
    if !spec.x_categories.is_empty() {
        // One key point per category, at its integer position.
        mesh.x_labels(spec.x_categories.len())
            .x_label_formatter(&category)
            .disable_x_mesh();
    }
    mesh.draw()?;

    let in_range = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    for (i, s) in series.iter().enumerate() {
        let (r, g, b) = s.color.unwrap_or_else(|| palette(i));
        let color = RGBColor(r, g, b);
        let points: Vec<(f64, f64)> = s.points.iter().copied().filter(in_range).collect();
        match s.style {
            Style::Line => {
                chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?;
            }
            Style::Dashed => {
                chart.draw_series(DashedLineSeries::new(points, 8, 5, color.stroke_width(2)))?;
            }
            Style::Dotted => {
                chart.draw_series(DashedLineSeries::new(points, 2, 4, color.stroke_width(2)))?;
            }
            Style::Points => {
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            Style::Rings => {
                chart.draw_series(
                    points
                        .iter()
                        .map(|&p| Circle::new(p, 6, color.stroke_width(2))),
                )?;
            }
        }
        for (&(x, _), &(lo, hi)) in s.points.iter().zip(&s.error_bars) {
            if x.is_finite() && lo.is_finite() && hi.is_finite() {
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(x, lo), (x, hi)],
                    color.stroke_width(1),
                )))?;
            }
        }
    }

    // The legend sits in its own column so it never hides a curve.
    let row = 20;
    for (i, s) in series.iter().enumerate() {
        let (r, g, b) = s.color.unwrap_or_else(|| palette(i));
        let color = RGBColor(r, g, b);
        let y = 30 + row * i as i32;
        match s.style {
            Style::Line => legend_area.draw(&PathElement::new(
                vec![(8, y), (38, y)],
                color.stroke_width(2),
            ))?,
            Style::Dashed => {
                legend_area.draw(&PathElement::new(
                    vec![(8, y), (17, y)],
                    color.stroke_width(2),
                ))?;
                legend_area.draw(&PathElement::new(
                    vec![(22, y), (31, y)],
                    color.stroke_width(2),
                ))?;
            }
            Style::Dotted => {
                for x in [8, 14, 20, 26, 32] {
                    legend_area.draw(&PathElement::new(
                        vec![(x, y), (x + 2, y)],
                        color.stroke_width(2),
                    ))?;
                }
            }
            Style::Points => legend_area.draw(&Circle::new((23, y), 4, color.filled()))?,
            Style::Rings => legend_area.draw(&Circle::new((23, y), 6, color.stroke_width(2)))?,
        }
        let font = ("sans-serif", 14).into_font().color(&BLACK);
        legend_area.draw(&Text::new(s.label.clone(), (46, y - 7), font))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_svg_with_title_labels_and_legend() {
        let curve = Series::line(
            "analytic k=3",
            (0..=10)
                .map(|i| (i as f64 / 10.0, (1.0 - i as f64 / 10.0).powi(3)))
                .collect(),
        );
        let dashed = Series::dashed("analytic k=1", vec![(0.0, 1.0), (1.0, 0.0)]);
        let measured =
            Series::points("measured", vec![(0.2, 0.51)]).with_error_bars(vec![(0.49, 0.53)]);
        let spec = ChartSpec::new(
            "f(p) test",
            "fraction of failed servers p",
            "request success rate f(p)",
        )
        .x_range(0.0, 1.0)
        .y_range(0.0, 1.0);
        let svg = render_svg(&spec, &[curve, dashed, measured]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "f(p) test",
            "fraction of failed servers p",
            "request success rate f(p)",
            "analytic k=3",
            "analytic k=1",
            "measured",
        ] {
            assert!(svg.contains(text), "missing {text}");
        }
        assert!(svg.contains("<circle"), "points are drawn as circles");
        assert!(svg.contains("<polyline"), "lines are drawn as polylines");
    }

    #[test]
    fn a_categorical_axis_labels_each_category_and_rings_are_hollow() {
        let spec = ChartSpec::new("cats", "mode", "y")
            .x_categories(vec!["hang".into(), "refuse".into(), "reset".into()])
            .y_range(0.0, 1.0);
        assert_eq!(spec.x_range, Some((0.5, 3.5)));
        let measured = Series::points("measured", vec![(1.0, 0.5), (2.0, 0.6), (3.0, 0.7)]);
        let simulated = Series::new("simulated", vec![(1.1, 0.5)], Style::Rings);
        let svg = render_svg(&spec, &[measured, simulated]).unwrap();
        for name in ["hang", "refuse", "reset"] {
            assert!(
                svg.contains(&format!("\n{name}\n</text>")),
                "no tick label {name}"
            );
        }
        // A ring is a circle without a fill.
        assert!(svg.contains("fill=\"none\""), "{svg}");
    }

    #[test]
    fn fits_ranges_and_rejects_bad_input() {
        assert_eq!(
            fit_range([0.0, 1.0, f64::NAN].into_iter()),
            Some((-0.03, 1.03))
        );
        assert_eq!(fit_range([2.0].into_iter()), Some((1.0, 3.0)));
        assert_eq!(fit_range([f64::NAN].into_iter()), None);
        let spec = ChartSpec::new("empty", "x", "y");
        assert!(matches!(render_svg(&spec, &[]), Err(PlotError::NoData(_))));
        let bad =
            Series::points("bad", vec![(0.0, 0.0), (1.0, 1.0)]).with_error_bars(vec![(0.0, 1.0)]);
        assert!(matches!(
            render_svg(&spec, &[bad]),
            Err(PlotError::ErrorBars { .. })
        ));
    }
}
