//! The timeline picture: one panel per rule that saw traffic. Each panel has a title with the
//! rule's totals, a legend row above the plots (never over the data), a chart of the requests
//! per time bucket as stacked bars (admitted at the bottom, denied on top, so a bar's height is
//! what was offered), a strip below it with the lowest remaining quota on its own axis, and for
//! a shaping leaky bucket a strip with the longest shaping delay per bucket against `maxDelay`.
//! The strips share the time axis, which leaves room at both ends.
//!
//! SVG only, through plotters' SVG backend without a font backend: text is written as SVG
//! `<text>` elements that the viewer renders with its own fonts, so nothing needs a font file at
//! build or render time (plotters only estimates text extents for layout). PNG would need a
//! rasterizing font shipped with the binary and is not offered.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::SimulateError;
use super::replay::{RuleReport, SimulationReport};

const WIDTH: u32 = 1100;
const TITLE_HEIGHT: u32 = 28;
const LEGEND_HEIGHT: u32 = 22;
const CHART_HEIGHT: u32 = 230;
const STRIP_HEIGHT: u32 = 120;
const PANEL_GAP: u32 = 18;
/// The same on every strip, so their time axes line up.
const Y_LABEL_AREA: u32 = 70;
const LEFT_MARGIN: u32 = 10;
const RIGHT_MARGIN: u32 = 28;

const ADMITTED: RGBColor = RGBColor(40, 150, 70);
const DENIED: RGBColor = RGBColor(210, 50, 40);
const REMAINING: RGBColor = RGBColor(30, 90, 200);
const DELAY: RGBColor = RGBColor(225, 125, 0);
const DEPARTED: RGBColor = RGBColor(20, 20, 20);
const QUEUE: RGBColor = RGBColor(130, 60, 170);
const FONT: &str = "sans-serif";

/// Draws `report`'s timelines to an SVG file at `path`.
pub fn write_svg(report: &SimulationReport, path: &Path) -> Result<(), SimulateError> {
    let plot_error = |e: &dyn std::fmt::Display| SimulateError::Plot(format!("{}: {e}", path.display()));
    let rules: Vec<&RuleReport> = report.rules.iter().filter(|r| r.offered > 0).collect();
    let height = rules.iter().map(|r| panel_height(r)).sum::<u32>().max(80);
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    if rules.is_empty() {
        root.draw(&Text::new("no rule matched any arrival", (40, 40), (FONT, 20))).map_err(|e| plot_error(&e))?;
    }
    let time = time_axis(report);
    let mut rest = root.clone();
    for rule in rules {
        let (panel, below) = rest.split_vertically(panel_height(rule));
        rest = below;
        draw_panel(&panel, rule, report.bucket_ms, time.clone()).map_err(|e| plot_error(&e))?;
    }
    root.present().map_err(|e| plot_error(&e))?;
    Ok(())
}

fn shapes(rule: &RuleReport) -> bool {
    rule.max_delay_ms.is_some()
}

fn panel_height(rule: &RuleReport) -> u32 {
    TITLE_HEIGHT + LEGEND_HEIGHT + CHART_HEIGHT + STRIP_HEIGHT + if shapes(rule) { STRIP_HEIGHT } else { 0 } + PANEL_GAP
}

/// The time axis in seconds: the trace and its last bucket, with room at both ends so the
/// first and last bars stand clear of the axes. A trace at one instant gets a hundred buckets
/// (by default about the shortest rule's window), not a sliver.
fn time_axis(report: &SimulationReport) -> Range<f64> {
    let bucket = report.bucket_ms / 1000.0;
    let duration = report.duration_ms / 1000.0;
    let end = if duration > 0.0 { duration + bucket } else { 100.0 * bucket };
    let pad = (end * 0.02).max(bucket * 0.5);
    -pad..end + pad
}

type Strip<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// One strip's chart: the shared time axis, `0..top` upwards, the same label areas as every
/// other strip (so their axes line up), room under it for the time axis' title when
/// `time_title`.
fn strip<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    time: Range<f64>,
    top: f64,
    time_title: bool,
) -> Result<Strip<'a, DB>, String> {
    ChartBuilder::on(area)
        .margin_left(LEFT_MARGIN)
        .margin_right(RIGHT_MARGIN)
        .margin_top(5)
        .x_label_area_size(if time_title { 44 } else { 28 })
        .y_label_area_size(Y_LABEL_AREA)
        .build_cartesian_2d(time, 0f64..top)
        .map_err(error)
}

/// A dashed line across the strip at `y` (the legend names it; text here would cover bars).
fn reference_line<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    y: f64,
    color: RGBColor,
) -> Result<(), String> {
    let (start, end) = (chart.x_range().start, chart.x_range().end);
    chart
        .draw_series(DashedLineSeries::new([(start, y), (end, y)], 6, 4, color.mix(0.5).stroke_width(1)))
        .map_err(error)?;
    Ok(())
}

/// Counts and milliseconds are whole: no `10.0` on their axes.
fn whole(value: &f64) -> String {
    format!("{value:.0}")
}

fn error(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn draw_panel<DB: DrawingBackend>(
    panel: &DrawingArea<DB, Shift>,
    rule: &RuleReport,
    bucket_ms: f64,
    time: Range<f64>,
) -> Result<(), String> {
    let caption = format!(
        "{}/{}: {} {} per {} ms  —  offered {}, admitted {}, denied {}, max in any window {} (bound {})",
        rule.policy,
        rule.rule,
        rule.algorithm,
        rule.requests,
        rule.per_ms,
        rule.offered,
        rule.admitted,
        rule.denied,
        rule.max_admitted_in_any_window,
        rule.bound.map_or_else(|| "-".to_string(), |b| b.to_string())
    );
    let (title, rest) = panel.split_vertically(TITLE_HEIGHT);
    title
        .draw(&Text::new(caption, (LEFT_MARGIN as i32 + 4, 8), (FONT, 15).into_font().color(&BLACK)))
        .map_err(error)?;
    let (legend, rest) = rest.split_vertically(LEGEND_HEIGHT);
    draw_legend(&legend, rule)?;
    let (main, rest) = rest.split_vertically(CHART_HEIGHT);
    let (quota, rest) = rest.split_vertically(STRIP_HEIGHT);
    draw_requests(&main, rule, bucket_ms, time.clone())?;
    draw_remaining(&quota, rule, bucket_ms, time.clone(), !shapes(rule))?;
    if shapes(rule) {
        let (delay, _) = rest.split_vertically(STRIP_HEIGHT);
        draw_delays(&delay, rule, bucket_ms, time)?;
    }
    Ok(())
}

/// One row of swatches and names, above the plots.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, rule: &RuleReport) -> Result<(), String> {
    let capacity = rule.burst.unwrap_or(rule.requests);
    let mut entries = vec![
        (ADMITTED, "admitted".to_string()),
        (DENIED, "denied (bar height = offered)".to_string()),
        (REMAINING, format!("lowest remaining quota (below; dashed: capacity {capacity})")),
    ];
    if let Some(max_delay) = rule.max_delay_ms {
        entries.push((DEPARTED, "departed (line)".to_string()));
        entries.push((QUEUE, "waiting (line)".to_string()));
        entries.push((DELAY, format!("longest shaping delay (dashed: maxDelay {max_delay} ms)")));
    }
    if !rule.timeline.deferred.is_empty() {
        entries.push((DEPARTED, "replayed (line)".to_string()));
        entries.push((QUEUE, "queued writes (line)".to_string()));
    }
    let mut x = (LEFT_MARGIN + Y_LABEL_AREA) as i32;
    for (color, name) in entries {
        if color == DEPARTED || color == QUEUE {
            area.draw(&PathElement::new(vec![(x, 11), (x + 14, 11)], color.stroke_width(2))).map_err(error)?;
        } else if color == REMAINING {
            // Drawn as it is drawn below: a line through dots.
            area.draw(&PathElement::new(vec![(x, 11), (x + 14, 11)], color.stroke_width(2))).map_err(error)?;
            area.draw(&Circle::new((x + 7, 11), 3, color.filled())).map_err(error)?;
        } else {
            area.draw(&Rectangle::new([(x, 5), (x + 14, 17)], color.filled())).map_err(error)?;
        }
        // Text extents are estimated without a font: about 6 px a character at 13 px.
        let width = 20 + 6 * name.chars().count() as i32 + 28;
        area.draw(&Text::new(name, (x + 20, 5), (FONT, 13))).map_err(error)?;
        x += width;
    }
    Ok(())
}

fn draw_requests<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    rule: &RuleReport,
    bucket_ms: f64,
    time: Range<f64>,
) -> Result<(), String> {
    let timeline = &rule.timeline;
    let tallest = timeline
        .offered
        .iter()
        .chain(&timeline.departed)
        .chain(&timeline.queue)
        .chain(&timeline.replayed)
        .chain(&timeline.deferred)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let mut chart = strip(area, time, tallest * 1.15, false)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE.mix(0.0))
        .y_desc(format!("requests per {bucket_ms} ms"))
        .y_label_formatter(&whole)
        .label_style((FONT, 12))
        .draw()
        .map_err(error)?;
    let bucket = bucket_ms / 1000.0;
    // A sliver between neighbours, so adjacent bars stay two bars.
    let gap = bucket * 0.08;
    let bars = timeline.admitted.iter().zip(&timeline.denied).enumerate().filter(|(_, (a, d))| **a + **d > 0);
    for (i, (&admitted, &denied)) in bars {
        let (x0, x1) = (i as f64 * bucket + gap, (i + 1) as f64 * bucket - gap);
        let (admitted, offered) = (admitted as f64, (admitted + denied) as f64);
        if admitted > 0.0 {
            chart.draw_series([Rectangle::new([(x0, 0.0), (x1, admitted)], ADMITTED.filled())]).map_err(error)?;
        }
        if offered > admitted {
            chart.draw_series([Rectangle::new([(x0, admitted), (x1, offered)], DENIED.filled())]).map_err(error)?;
        }
    }
    // A shaping rule: when its requests leave (what the downstream sees), and how many wait; a
    // deferring rule: its replays, and how many writes are queued.
    let lines = [
        (&timeline.departed, DEPARTED),
        (&timeline.queue, QUEUE),
        (&timeline.replayed, DEPARTED),
        (&timeline.deferred, QUEUE),
    ];
    for (series, color) in lines {
        if series.is_empty() {
            continue;
        }
        let points = series.iter().enumerate().map(|(i, &n)| ((i as f64 + 0.5) * bucket, n as f64));
        chart.draw_series(LineSeries::new(points, color.stroke_width(2))).map_err(error)?;
    }
    Ok(())
}

fn draw_remaining<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    rule: &RuleReport,
    bucket_ms: f64,
    time: Range<f64>,
    time_label: bool,
) -> Result<(), String> {
    let timeline = &rule.timeline;
    let capacity =
        rule.burst.unwrap_or(rule.requests).max(timeline.remaining.iter().flatten().copied().max().unwrap_or(0));
    let mut chart = strip(area, time, (capacity.max(1) as f64) * 1.1, time_label)?;
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(WHITE.mix(0.0))
        .y_desc("remaining quota")
        .y_labels(4)
        .y_label_formatter(&whole)
        .label_style((FONT, 12));
    if time_label {
        mesh.x_desc("simulated time (s)");
    }
    mesh.draw().map_err(error)?;
    // The capacity, for scale: what a key has when nothing was spent.
    reference_line(&mut chart, capacity as f64, REMAINING)?;
    let bucket = bucket_ms / 1000.0;
    let points: Vec<(f64, f64)> = timeline
        .remaining
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.map(|r| ((i as f64 + 0.5) * bucket, r as f64)))
        .collect();
    // Joined only across neighbouring buckets: a gap without traffic stays a gap.
    let mut run: Vec<(f64, f64)> = Vec::new();
    let mut flush = |run: &mut Vec<(f64, f64)>| -> Result<(), String> {
        if run.len() > 1 {
            chart.draw_series(LineSeries::new(run.clone(), REMAINING.stroke_width(2))).map_err(error)?;
        }
        run.clear();
        Ok(())
    };
    for point in points.iter().copied() {
        if run.last().is_some_and(|last| point.0 - last.0 > bucket * 1.5) {
            flush(&mut run)?;
        }
        run.push(point);
    }
    flush(&mut run)?;
    chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, REMAINING.filled()))).map_err(error)?;
    Ok(())
}

fn draw_delays<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    rule: &RuleReport,
    bucket_ms: f64,
    time: Range<f64>,
) -> Result<(), String> {
    let delays = &rule.timeline.max_delay_ms;
    let max_delay = rule.max_delay_ms.unwrap_or(0).max(delays.iter().copied().max().unwrap_or(0)).max(1) as f64;
    let mut chart = strip(area, time, max_delay * 1.15, true)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE.mix(0.0))
        .x_desc("simulated time (s)")
        .y_desc("shaping delay (ms)")
        .y_labels(4)
        .y_label_formatter(&whole)
        .label_style((FONT, 12))
        .draw()
        .map_err(error)?;
    if let Some(limit) = rule.max_delay_ms {
        reference_line(&mut chart, limit as f64, DELAY)?;
    }
    let bucket = bucket_ms / 1000.0;
    let gap = bucket * 0.08;
    let bars = delays.iter().enumerate().filter(|(_, d)| **d > 0);
    chart
        .draw_series(bars.map(|(i, &d)| {
            Rectangle::new([(i as f64 * bucket + gap, 0.0), ((i + 1) as f64 * bucket - gap, d as f64)], DELAY.filled())
        }))
        .map_err(error)?;
    Ok(())
}
