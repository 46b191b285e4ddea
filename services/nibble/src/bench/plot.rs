//! The plots `nibble bench` draws from a sweep's summaries, as PNGs:
//!
//! - `pareto.png`: the Pareto curve of throughput against interactivity: output tokens/s per
//!   worker (prefill and decode) against each user's tokens/s, one line per configuration through its load
//!   points, each point labelled with its load (`c=4`).
//! - `latency.png`: TTFT (left) and inter-token latency (right) p50, p90 and p99 against load.
//! - `goodput.png`: requests/s that met the SLO against load, with every completed request/s as
//!   a thin line for reference; only when the sweep had an SLO.
//! - `resident.png`: requests running on the cluster over time at each configuration's highest
//!   load, with the decode workers' KV-page usage below when the metrics had it.
//! - `shift.png`, for loads of several phases: TTFT p90 and ITL p90 over time (per window of
//!   sending time) and the decode workers the router saw, at each configuration's highest load,
//!   with the phases' starts marked.
//!
//! Each configuration keeps its colour across the plots; non-finite values are left out, and a
//! plot with nothing to show is not written.

use std::error::Error;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::summary::{Percentiles, Slo, Summary};
use super::timeline::{PhaseStats, Window};

/// Width and height of every plot, in pixels.
pub const SIZE: (u32, u32) = (1000, 640);

/// The family DejaVu Sans is registered as.
const FONT: &str = "sans-serif";

/// Colours given to configurations in order of first appearance (from Tableau 10).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// A plot that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write plot {}: {reason}", path.display())]
pub struct PlotError {
    /// The file (or folder) it was writing.
    pub path: PathBuf,
    /// Why it failed.
    pub reason: String,
}

impl PlotError {
    fn new(path: &Path, reason: String) -> Self {
        let path = path.to_path_buf();
        PlotError { path, reason }
    }
}

type Area<'b> = DrawingArea<BitMapBackend<'b>, Shift>;
type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;
type Drawn = Result<(), Box<dyn Error>>;

/// One configuration's summaries in sweep order (by load), with its colour.
struct Config<'s> {
    name: &'s str,
    color: RGBColor,
    points: Vec<&'s Summary>,
}

/// How a series is drawn: 2 px solid with circles, dashed with triangles, dotted with crosses,
/// or a solid line this many px wide without markers.
#[derive(Clone, Copy)]
enum Stroke {
    Solid,
    Dashed,
    Dotted,
    Line(u32),
}

/// One line on a chart.
struct Series {
    label: String,
    color: RGBColor,
    stroke: Stroke,
    /// Finite points only.
    points: Vec<(f64, f64)>,
    /// Text written by each point (the Pareto curve's loads), or none.
    tags: Vec<String>,
}

impl Config<'_> {
    /// A series in its colour through the finite ones of `points`.
    fn series(
        &self,
        label: String,
        stroke: Stroke,
        points: impl Iterator<Item = (f64, f64)>,
    ) -> Series {
        let points = points
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let (color, tags) = (self.color, Vec::new());
        Series {
            label,
            color,
            stroke,
            points,
            tags,
        }
    }
}

/// One chart: titles, ranges (from the data unless given) and series.
#[derive(Default)]
struct Panel {
    caption: String,
    axes: (&'static str, &'static str),
    x_range: Option<Range<f64>>,
    y_range: Option<Range<f64>>,
    legend: Option<SeriesLabelPosition>,
    series: Vec<Series>,
}

/// How a file's panels share it.
enum Layout {
    Single,
    /// Side by side under a title.
    SideBySide(&'static str),
    /// One above the other, the second smaller (or alone on the whole area).
    Stacked,
    /// One above the other, evenly.
    Rows,
}

/// One file's panels.
struct Plot(Layout, Vec<Panel>);

impl Plot {
    /// Whether no panel has a point to show.
    fn is_empty(&self) -> bool {
        let empty = |p: &Panel| p.series.iter().all(|s| s.points.is_empty());
        self.1.iter().all(empty)
    }
}

/// Renders every plot the summaries allow into `dir` (created if missing); returns the files
/// written. Each is drawn to a temporary file in `dir` and renamed into place.
pub fn render(summaries: &[Summary], dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    if summaries.is_empty() {
        return Ok(Vec::new());
    }
    let mkdir = |e| PlotError::new(dir, format!("cannot create the folder: {e}"));
    std::fs::create_dir_all(dir).map_err(mkdir)?;
    let configs = group(summaries);
    let axis = summaries[0].load.axis();
    let slo = summaries.iter().find_map(|s| s.slo).unwrap_or_default();
    let plots = [
        ("pareto.png", pareto(&configs)),
        ("latency.png", latency(&configs, axis)),
        ("goodput.png", goodput(&configs, axis, slo)),
        ("resident.png", resident(&configs)),
        ("shift.png", shift(&configs)),
    ];
    let drawable = plots.into_iter().filter(|(_, plot)| !plot.is_empty());
    let write = |(name, plot)| write(dir, name, |area| draw(area, &plot));
    drawable.map(write).collect()
}

/// Registers DejaVu Sans as [`FONT`], once per process.
fn font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    let register =
        || plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
    let registered = REGISTERED
        .get_or_init(|| register().map_err(|_| "DejaVu Sans is not a usable font".into()));
    registered.clone()
}

/// Draws `name` in `dir` with `draw`, through a temporary file renamed into place.
fn write(dir: &Path, name: &str, draw: impl FnOnce(&Area) -> Drawn) -> Result<PathBuf, PlotError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(name);
    let fail = |reason| PlotError::new(&path, reason);
    font().map_err(fail)?;
    // The encoder picks the format from the extension, so the temporary name ends in .png too.
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}-{n}.tmp.png", std::process::id()));
    let drawn = (|| -> Drawn {
        let root = BitMapBackend::new(&tmp, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
        Ok(())
    })();
    let done = drawn.map_err(|e| fail(e.to_string())).and_then(|()| {
        std::fs::rename(&tmp, &path).map_err(|e| fail(format!("cannot rename it into place: {e}")))
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp); // it may not exist
    }
    done.map(|()| path)
}

/// Groups summaries by configuration in order of first appearance, each sorted by load.
fn group(summaries: &[Summary]) -> Vec<Config<'_>> {
    let mut configs: Vec<Config> = Vec::new();
    for s in summaries {
        match configs.iter_mut().find(|c| c.name == s.config) {
            Some(c) => c.points.push(s),
            None => {
                let color = PALETTE[configs.len() % PALETTE.len()];
                configs.push(Config {
                    name: &s.config,
                    color,
                    points: vec![s],
                });
            }
        }
    }
    for c in &mut configs {
        c.points
            .sort_by(|a, b| a.load.value().total_cmp(&b.load.value()));
    }
    configs
}

/// An axis range from 0 (or the least value, if negative) to the largest value plus headroom;
/// `0..1` when there is nothing to show.
fn span(values: impl IntoIterator<Item = f64>) -> Range<f64> {
    let extremes = |(lo, hi): (f64, f64), v: f64| (lo.min(v), hi.max(v));
    let (lo, hi) = values.into_iter().fold((0.0, f64::NEG_INFINITY), extremes);
    let hi = if hi > lo { hi } else { lo + 1.0 };
    lo..hi + (hi - lo) * 0.08
}

/// An axis label without needless zeros: `0`, `2.5`, `1200`.
fn tick(v: &f64) -> String {
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    match text {
        "-0" => "0".into(),
        text => text.into(),
    }
}

/// Draws `plot`'s panels on `area`.
fn draw(area: &Area, plot: &Plot) -> Drawn {
    let Plot(layout, panels) = plot;
    let areas = match layout {
        Layout::SideBySide(title) => area
            .titled(title, (FONT, 24))?
            .split_evenly((1, panels.len())),
        Layout::Stacked if panels.len() > 1 => {
            let (top, bottom) = area.split_vertically(60.percent_height());
            vec![top, bottom]
        }
        Layout::Rows => area.split_evenly((panels.len(), 1)),
        Layout::Single | Layout::Stacked => vec![area.clone()],
    };
    let mut each = areas.iter().zip(panels);
    each.try_for_each(|(area, panel)| chart(area, panel))
}

/// Draws one panel: axes, its series and their legend.
fn chart(area: &Area, panel: &Panel) -> Drawn {
    let points = || panel.series.iter().flat_map(|s| s.points.iter());
    let (x, y) = (&panel.x_range, &panel.y_range);
    let x = x.clone().unwrap_or_else(|| span(points().map(|p| p.0)));
    let y = y.clone().unwrap_or_else(|| span(points().map(|p| p.1)));
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, (FONT, 20))
        .margin(14)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(panel.axes.0)
        .y_desc(panel.axes.1)
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 13))
        .max_light_lines(4)
        .light_line_style(RGBColor(238, 238, 238))
        .y_labels(8)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .draw()?;
    for series in &panel.series {
        line(&mut chart, series)?;
    }
    if let Some(position) = panel.legend.clone() {
        chart
            .configure_series_labels()
            .position(position)
            .margin(10)
            .legend_area_size(34)
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
    }
    Ok(())
}

/// Draws one series (line, markers and tags) with a legend entry.
fn line<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, series: &Series) -> Drawn {
    let (points, stroke, color) = (&series.points, series.stroke, series.color);
    if points.is_empty() {
        return Ok(());
    }
    let pts = points.iter().copied();
    let (style, fill) = (color.stroke_width(2), color.filled());
    match stroke {
        Stroke::Solid => chart.draw_series(LineSeries::new(pts, style))?,
        Stroke::Dashed => chart.draw_series(DashedLineSeries::new(pts, 9, 5, style))?,
        Stroke::Dotted => chart.draw_series(DashedLineSeries::new(pts, 2, 4, style))?,
        Stroke::Line(px) => chart.draw_series(LineSeries::new(pts, color.stroke_width(px)))?,
    };
    // The legend's key: the line's style over 24 px with the marker in its middle.
    let (key, seg) = (|(x, y)| EmptyElement::at((x, y)), [(0, 0), (24, 0)]);
    let lone = points.iter().filter(|_| points.len() == 1); // would not show as a line
    let anno = match stroke {
        Stroke::Solid => chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, fill)))?
            .legend(move |p| key(p) + PathElement::new(seg, style) + Circle::new((12, 0), 4, fill)),
        Stroke::Dashed => chart
            .draw_series(points.iter().map(|&p| TriangleMarker::new(p, 5, fill)))?
            .legend(move |p| {
                key(p)
                    + DashedPathElement::new(seg, 6, 3, style)
                    + TriangleMarker::new((12, 0), 5, fill)
            }),
        Stroke::Dotted => chart
            .draw_series(points.iter().map(|&p| Cross::new(p, 4, style)))?
            .legend(move |p| {
                key(p) + DashedPathElement::new(seg, 2, 4, style) + Cross::new((12, 0), 4, style)
            }),
        Stroke::Line(px) => chart
            .draw_series(lone.map(|&p| Circle::new(p, 3, fill)))?
            .legend(move |p| key(p) + PathElement::new(seg, color.stroke_width(px))),
    };
    anno.label(&series.label);
    let font = (FONT, 13).into_font().color(&color);
    let tags = points.iter().zip(&series.tags);
    chart.draw_series(
        tags.map(|(&p, tag)| EmptyElement::at(p) + Text::new(tag.clone(), (7, -18), font.clone())),
    )?;
    Ok(())
}

/// Output tokens/s per worker (prefill and decode) against tokens/s per user, one curve per
/// configuration.
fn pareto(configs: &[Config]) -> Plot {
    let curve = |c: &Config| {
        let point = |s: &Summary| {
            Some((
                (s.tokens_per_s_per_user?, s.output_tokens_per_s_per_worker),
                s.load.label(),
            ))
        };
        let finite = |((x, y), _): &((f64, f64), String)| x.is_finite() && y.is_finite();
        let (points, tags): (Vec<_>, Vec<_>) = c
            .points
            .iter()
            .filter_map(|s| point(s))
            .filter(finite)
            .unzip();
        let name = c.name.to_string();
        Series {
            tags,
            ..c.series(name, Stroke::Solid, points.into_iter())
        }
    };
    let panel = Panel {
        caption: "Throughput against interactivity".into(),
        axes: (
            "tokens/s per user (median over requests)",
            "output tokens/s per worker",
        ),
        legend: Some(SeriesLabelPosition::UpperRight),
        series: configs.iter().map(curve).collect(),
        ..Panel::default()
    };
    Plot(Layout::Single, vec![panel])
}

/// A percentile a latency panel shows: its name, its stroke and how to read it.
type Quantile = (&'static str, Stroke, fn(&Percentiles) -> f64);

const QUANTILES: [Quantile; 3] = [
    ("p50", Stroke::Solid, |p| p.p50),
    ("p90", Stroke::Dashed, |p| p.p90),
    ("p99", Stroke::Dotted, |p| p.p99),
];

/// TTFT and ITL percentiles against load, side by side.
fn latency(configs: &[Config], axis: &'static str) -> Plot {
    let panel = |caption: &str, y_axis, of: fn(&Summary) -> Option<Percentiles>| {
        let series = configs.iter().flat_map(|c| {
            QUANTILES.iter().map(move |&(name, stroke, q)| {
                let points = c
                    .points
                    .iter()
                    .filter_map(|s| Some((s.load.value(), q(&of(s)?))));
                c.series(format!("{} {name}", c.name), stroke, points)
            })
        });
        let legend = Some(SeriesLabelPosition::UpperLeft);
        Panel {
            caption: caption.into(),
            axes: (axis, y_axis),
            legend,
            series: series.collect(),
            ..Panel::default()
        }
    };
    let ttft = panel("Time to first token", "TTFT (ms)", |s| s.ttft_ms);
    let itl = panel("Inter-token latency", "ITL (ms)", |s| s.itl_ms);
    Plot(Layout::SideBySide("Latency against load"), vec![ttft, itl])
}

/// The objectives in words: `TTFT ≤ 500 ms, mean ITL ≤ 50 ms`.
fn slo_text(slo: Slo) -> String {
    let ttft = slo.ttft_ms.map(|ms| format!("TTFT ≤ {ms} ms"));
    let itl = slo.itl_ms.map(|ms| format!("mean ITL ≤ {ms} ms"));
    ttft.into_iter().chain(itl).collect::<Vec<_>>().join(", ")
}

/// Goodput against load per configuration, with every completed request/s as a thin line; no
/// series at all when no summary has goodput.
fn goodput(configs: &[Config], axis: &'static str, slo: Slo) -> Plot {
    let has_goodput = configs
        .iter()
        .flat_map(|c| &c.points)
        .any(|s| s.goodput_requests_per_s.is_some());
    let series = configs.iter().filter(|_| has_goodput).flat_map(|c| {
        let good = c
            .points
            .iter()
            .filter_map(|s| Some((s.load.value(), s.goodput_requests_per_s?)));
        let all = c.points.iter().map(|s| (s.load.value(), s.requests_per_s));
        [
            c.series(format!("{} goodput", c.name), Stroke::Solid, good),
            c.series(format!("{} all completed", c.name), Stroke::Line(1), all),
        ]
    });
    let panel = Panel {
        caption: format!("Goodput: requests/s meeting the SLO ({})", slo_text(slo)),
        axes: (axis, "requests/s"),
        legend: Some(SeriesLabelPosition::UpperLeft),
        series: series.collect(),
        ..Panel::default()
    };
    Plot(Layout::Single, vec![panel])
}

/// Running requests over time at each configuration's highest load that has a timeline, with
/// KV usage below when any sample has it.
fn resident<'s>(configs: &[Config<'s>]) -> Plot {
    let last = |c: &Config<'s>| {
        c.points
            .iter()
            .rev()
            .find(|s| !s.timeline.is_empty())
            .copied()
    };
    let runs: Vec<_> = configs.iter().filter_map(|c| Some((c, last(c)?))).collect();
    let times = span(
        runs.iter()
            .flat_map(|(_, s)| &s.timeline)
            .map(|t| t.t_s)
            .filter(|t| t.is_finite()),
    );
    let series = |of: fn(f64, Option<f64>) -> Option<f64>| {
        let series = runs.iter().map(|(c, s)| {
            let points = s
                .timeline
                .iter()
                .filter_map(|t| Some((t.t_s, of(t.running, t.kv_usage)?)));
            c.series(
                format!("{} {}", c.name, s.load.label()),
                Stroke::Line(2),
                points,
            )
        });
        series.collect::<Vec<_>>()
    };
    let time = "time since the load point started (s)";
    let running = Panel {
        caption: "Requests running at each configuration's highest load".into(),
        axes: (time, "running requests"),
        x_range: Some(times.clone()),
        legend: Some(SeriesLabelPosition::LowerMiddle),
        series: series(|running, _| Some(running)),
        ..Panel::default()
    };
    let kv = Panel {
        caption: "Decode workers' KV pages in use".into(),
        axes: (time, "KV in use (%)"),
        x_range: Some(times),
        y_range: Some(0.0..105.0),
        series: series(|_, kv| kv.map(|u| u * 100.0)),
        ..Panel::default()
    };
    let mut panels = vec![running];
    panels.extend(kv.series.iter().any(|s| !s.points.is_empty()).then_some(kv));
    Plot(Layout::Stacked, panels)
}

/// A shifting load at each configuration's highest load with phases: TTFT and ITL p90 per
/// window, and the decode workers the router saw, each phase's start marked by a grey line.
fn shift<'s>(configs: &[Config<'s>]) -> Plot {
    let last = |c: &Config<'s>| {
        c.points
            .iter()
            .rev()
            .find(|s| !s.phases.is_empty())
            .copied()
    };
    let runs: Vec<_> = configs.iter().filter_map(|c| Some((c, last(c)?))).collect();
    let label = |c: &Config, s: &Summary| format!("{} {}", c.name, s.load.label());
    let time = "time since the load point started (s; latencies by when requests were sent)";
    // Each later phase's start, a thin line in its configuration's colour over `y`.
    let marks = |y: &Range<f64>| {
        let starts = runs
            .iter()
            .flat_map(|(c, s)| s.phases.iter().skip(1).map(move |p| (c, p)));
        let mark = |(c, p): (&&Config, &PhaseStats)| Series {
            label: format!("{}: phase {} starts", c.name, p.phase + 1),
            color: c.color,
            stroke: Stroke::Line(1),
            points: vec![(p.start_s, y.start), (p.start_s, y.end)],
            tags: Vec::new(),
        };
        starts.map(mark).collect::<Vec<_>>()
    };
    let panel = |caption: &str, axis, of: fn(&Window) -> Option<f64>| {
        let mut series: Vec<Series> = runs
            .iter()
            .map(|(c, s)| {
                let points = s.windows.iter().filter_map(|w| Some((w.start_s, of(w)?)));
                c.series(label(c, s), Stroke::Solid, points)
            })
            .collect();
        let y = span(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
        series.extend(marks(&y));
        Panel {
            caption: caption.into(),
            axes: (time, axis),
            y_range: Some(y),
            legend: Some(SeriesLabelPosition::UpperRight),
            series,
            ..Panel::default()
        }
    };
    let ttft = panel("TTFT p90 over time", "TTFT p90 (ms)", |w| w.ttft_p90_ms);
    let itl = panel("ITL p90 over time", "ITL p90 (ms)", |w| w.itl_p90_ms);
    let mut decode: Vec<Series> = runs
        .iter()
        .map(|(c, s)| {
            let points = s
                .timeline
                .iter()
                .filter_map(|t| Some((t.t_s, t.decode_workers?)));
            c.series(label(c, s), Stroke::Line(2), points)
        })
        .collect();
    let y = span(decode.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    decode.extend(marks(&y));
    let workers = Panel {
        caption: "Decode workers (the rest prefill)".into(),
        axes: (time, "decode workers"),
        y_range: Some(y),
        legend: Some(SeriesLabelPosition::LowerRight),
        series: decode,
        ..Panel::default()
    };
    let panels = vec![ttft, itl, workers];
    match runs.is_empty() {
        true => Plot(Layout::Rows, Vec::new()),
        false => Plot(Layout::Rows, panels),
    }
}

#[cfg(test)]
mod tests {
    use super::super::summary::{ClusterStats, Load, Of, RequestRecord, Sample};
    use super::*;

    /// A request with 64 tokens after a `ttft` ms first one, `gap` ms apart.
    fn record(ttft: f64, gap: f64) -> RequestRecord {
        let itl_ms = vec![gap; 63];
        let e2e_ms = ttft + 63.0 * gap;
        let (prompt_tokens, completion_tokens) = (512, 64);
        RequestRecord {
            ttft_ms: Some(ttft),
            itl_ms,
            e2e_ms,
            prompt_tokens,
            completion_tokens,
            ..Default::default()
        }
    }

    /// A run at concurrency `c` of a configuration `speed` times as fast as the first.
    fn point(name: &str, speed: f64, c: usize, slo: Option<Slo>) -> Summary {
        let load = c as f64;
        let records: Vec<_> = (0..40)
            .map(|i| {
                let spread = 1.0 + (i % 10) as f64 / 20.0;
                record(
                    (40.0 + 25.0 * load) * spread / speed,
                    (8.0 + load) * spread / speed,
                )
            })
            .collect();
        let end = 30.0 / speed.sqrt();
        let sample = |i: usize| {
            let t_s = i as f64 * 0.5;
            let running = load * (t_s / 3.0).min(1.0) * ((end - t_s) / 3.0).clamp(0.0, 1.0);
            Sample {
                t_s,
                running,
                kv_usage: Some(running / 20.0 / speed),
                ..Sample::default()
            }
        };
        let duration = 40.0 * 64.0 * (8.0 + load) / speed / 1e3 / load;
        let stats = ClusterStats::default();
        let of = Of {
            config: name,
            load: Load::Concurrency(c),
            workers: 2,
            slo,
            window_s: 10.0,
        };
        Summary::new(of, &records, duration, stats, (0..60).map(sample).collect())
    }

    /// Two configurations at three concurrencies each, out of order.
    fn sweep(slo: Option<Slo>) -> Vec<Summary> {
        let configs = [("bf16", 1.0), ("nvfp4", 1.6)];
        configs
            .iter()
            .flat_map(|&(name, speed)| [16, 1, 4].map(|c| point(name, speed, c, slo)))
            .collect()
    }

    /// Asserts `path` is a PNG of [`SIZE`].
    fn assert_png(path: &Path) {
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{} is not a PNG",
            path.display()
        );
        let dim = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        assert_eq!((dim(16), dim(20)), SIZE, "{}", path.display());
    }

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let entries = std::fs::read_dir(dir).unwrap();
        let mut names: Vec<String> = entries
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_sweep_with_an_slo_draws_four_pngs_and_leaves_no_temporary_file() {
        let summaries = sweep(Some(Slo::parse("ttft=400,itl=20").unwrap()));
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("plots"); // render creates it
        let written = render(&summaries, &out).unwrap();
        written.iter().for_each(|p| assert_png(p));
        assert_eq!(
            names(&out),
            ["goodput.png", "latency.png", "pareto.png", "resident.png"]
        );
        assert_eq!(written.len(), 4);
        // NIBBLE_BENCH_PLOTS=DIR keeps a copy to look at.
        if let Some(keep) = std::env::var_os("NIBBLE_BENCH_PLOTS") {
            render(&summaries, Path::new(&keep)).unwrap();
        }
    }

    #[test]
    fn a_load_of_phases_also_draws_the_shift() {
        let mut phased = point("planner", 1.0, 4, None);
        let mut records: Vec<RequestRecord> = (0..40)
            .map(|i| {
                let phase = usize::from(i >= 20);
                RequestRecord {
                    phase: Some(phase),
                    start_s: f64::from(i) * 1.5,
                    ..record(100.0 + 50.0 * f64::from(i % 20), 10.0 + 5.0 * phase as f64)
                }
            })
            .collect();
        records[3].ttft_ms = None;
        let timeline: Vec<Sample> = (0..120)
            .map(|i| {
                let moved = (20..80).contains(&i);
                Sample {
                    t_s: f64::from(i) * 0.5,
                    prefill_workers: Some(if moved { 2.0 } else { 1.0 }),
                    decode_workers: Some(if moved { 2.0 } else { 3.0 }),
                    ..Sample::default()
                }
            })
            .collect();
        let of = Of {
            config: "planner",
            load: Load::Concurrency(4),
            workers: 4,
            slo: None,
            window_s: 5.0,
        };
        phased = Summary::new(of, &records, 60.0, phased.cluster, timeline);
        assert_eq!(phased.phases.len(), 2);
        assert_eq!(phased.phases[0].reaction_s, Some(10.0));
        assert_eq!(phased.phases[1].reaction_s, Some(10.0));
        let dir = tempfile::tempdir().unwrap();
        let written = render(&[phased, point("static", 1.0, 4, None)], dir.path()).unwrap();
        written.iter().for_each(|p| assert_png(p));
        assert!(names(dir.path()).contains(&"shift.png".to_string()));
        if let Some(keep) = std::env::var_os("NIBBLE_BENCH_PLOTS") {
            std::fs::copy(
                dir.path().join("shift.png"),
                Path::new(&keep).join("shift.png"),
            )
            .unwrap();
        }
    }

    #[test]
    fn nothing_is_written_for_no_summaries_and_no_goodput_without_an_slo() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        assert!(render(&[], &empty).unwrap().is_empty());
        assert!(!empty.exists());
        render(&sweep(None), dir.path()).unwrap();
        assert_eq!(
            names(dir.path()),
            ["latency.png", "pareto.png", "resident.png"]
        );
    }

    #[test]
    fn a_single_point_and_non_finite_values_still_draw() {
        let mut s = point("bf16", 1.0, 4, None);
        s.tokens_per_s_per_user = Some(f64::NAN); // no Pareto point left
        s.timeline[3].running = f64::INFINITY;
        s.timeline[4].t_s = f64::NAN;
        let dir = tempfile::tempdir().unwrap();
        let written = render(&[s], dir.path()).unwrap();
        written.iter().for_each(|p| assert_png(p));
        assert_eq!(names(dir.path()), ["latency.png", "resident.png"]);
    }

    #[test]
    fn an_error_names_the_path_it_could_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-folder");
        std::fs::write(&file, b"").unwrap();
        let err = render(&sweep(None), &file).unwrap_err();
        assert_eq!(err.path, file);
        assert!(err.to_string().contains("not-a-folder"), "{err}");
    }
}
