//! The timeline picture: one panel per rule, offered / admitted / denied per time bucket on the
//! left axis and the lowest remaining quota on the right one.
//!
//! SVG only, through plotters' SVG backend without a font backend: text is written as SVG
//! `<text>` elements that the viewer renders with its own fonts, so nothing needs a font file at
//! build or render time (plotters only estimates text extents for layout). PNG would need a
//! rasterizing font shipped with the binary and is not offered.

use std::path::Path;

use plotters::prelude::*;

use super::SimulateError;
use super::replay::SimulationReport;

const PANEL_HEIGHT: u32 = 320;
const WIDTH: u32 = 1100;

/// Draws `report`'s timelines to an SVG file at `path`.
pub fn write_svg(report: &SimulationReport, path: &Path) -> Result<(), SimulateError> {
    let plot_error = |e: &dyn std::fmt::Display| SimulateError::Plot(format!("{}: {e}", path.display()));
    let rules: Vec<_> = report.rules.iter().filter(|r| r.offered > 0).collect();
    let panels = rules.len().max(1);
    let root = SVGBackend::new(path, (WIDTH, PANEL_HEIGHT * panels as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    if rules.is_empty() {
        root.draw(&Text::new("no rule matched any arrival", (40, 40), ("sans-serif", 20)))
            .map_err(|e| plot_error(&e))?;
    }
    let bucket_s = report.bucket_ms / 1000.0;
    let end_s = ((report.duration_ms / 1000.0) + bucket_s).max(bucket_s);
    for (area, rule) in root.split_evenly((panels, 1)).iter().zip(&rules) {
        let timeline = &rule.timeline;
        let most = timeline.offered.iter().copied().max().unwrap_or(0).max(1) as f64 * 1.1;
        let quota = timeline.remaining.iter().flatten().copied().max().unwrap_or(0).max(rule.requests) as f64 * 1.1;
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
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .right_y_label_area_size(60)
            .build_cartesian_2d(0f64..end_s, 0f64..most)
            .map_err(|e| plot_error(&e))?
            .set_secondary_coord(0f64..end_s, 0f64..quota);
        chart
            .configure_mesh()
            .x_desc("simulated time (s)")
            .y_desc(format!("requests per {} ms", report.bucket_ms))
            .draw()
            .map_err(|e| plot_error(&e))?;
        chart.configure_secondary_axes().y_desc("lowest remaining quota").draw().map_err(|e| plot_error(&e))?;
        let steps = |values: &[u64]| -> Vec<(f64, f64)> {
            values
                .iter()
                .enumerate()
                .flat_map(|(i, &v)| [(i as f64 * bucket_s, v as f64), ((i + 1) as f64 * bucket_s, v as f64)])
                .collect()
        };
        let series = [
            ("offered", &timeline.offered, RGBColor(90, 90, 90)),
            ("admitted", &timeline.admitted, RGBColor(0, 140, 60)),
            ("denied", &timeline.denied, RGBColor(200, 30, 30)),
        ];
        for (label, values, color) in series {
            chart
                .draw_series(LineSeries::new(steps(values), color.stroke_width(2)))
                .map_err(|e| plot_error(&e))?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        let remaining: Vec<(f64, f64)> = timeline
            .remaining
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| ((i as f64 + 0.5) * bucket_s, r as f64)))
            .collect();
        let blue = RGBColor(30, 90, 200);
        chart
            .draw_secondary_series(PointSeries::of_element(remaining, 2, blue.filled(), &|c, s, st| {
                Circle::new(c, s, st)
            }))
            .map_err(|e| plot_error(&e))?
            .label("lowest remaining quota (right axis)")
            .legend(move |(x, y)| Circle::new((x + 10, y), 3, blue.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot_error(&e))?;
    }
    root.present().map_err(|e| plot_error(&e))?;
    Ok(())
}
