//! Draws scripts/bench/overload.sh's convergence run: the adaptive limit and the requests in
//! flight against the application's capacity (in requests in flight it can serve: its workers),
//! and the latency the sidecar measured, over time. Same plotting crate (plotters, SVG) as
//! `sluice simulate --svg`.
//!
//! `cargo run --release --example overload_plot -- convergence.csv convergence.svg [LOAD_FACTOR]`

use plotters::prelude::*;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (input, output, factor) = match args.as_slice() {
        [input, output] => (input, output, "2"),
        [input, output, factor] => (input, output, factor.as_str()),
        _ => panic!("usage: overload_plot CSV SVG [LOAD_FACTOR]"),
    };
    let text = std::fs::read_to_string(input).expect("read the CSV");
    // seconds, limit, in_flight, latency_ms, capacity (requests/s); quoted by jq's @csv.
    let rows: Vec<Vec<f64>> = text
        .lines()
        .skip(1)
        .filter_map(|line| line.split(',').map(|f| f.trim_matches('"').parse::<f64>().ok()).collect::<Option<Vec<_>>>())
        .filter(|row| row.len() == 5)
        .collect();
    assert!(!rows.is_empty(), "no rows in {input}");
    let end = rows.iter().map(|r| r[0]).fold(0.0, f64::max) * 1.02;
    let top = rows.iter().map(|r| r[1].max(r[2])).fold(1.0, f64::max) * 1.15;
    let slowest = rows.iter().map(|r| r[3]).fold(1.0, f64::max) * 1.15;
    let root = SVGBackend::new(output, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).expect("fill");
    let (upper, lower) = root.split_vertically(340);
    let mut chart = ChartBuilder::on(&upper)
        .caption(
            format!("adaptive limit under {factor}x load; the application's capacity halved from 10 s to 20 s"),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end, 0f64..top)
        .expect("chart");
    chart.configure_mesh().y_desc("requests in flight").label_style(("sans-serif", 12)).draw().expect("mesh");
    let series = |i: usize| rows.iter().map(move |r| (r[0], r[i]));
    chart
        .draw_series(LineSeries::new(series(1), RGBColor(30, 90, 200).stroke_width(2)))
        .expect("limit")
        .label("limit")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RGBColor(30, 90, 200).stroke_width(2)));
    chart
        .draw_series(LineSeries::new(series(2), RGBColor(40, 150, 70).stroke_width(1)))
        .expect("in flight")
        .label("in flight")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RGBColor(40, 150, 70).stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .expect("legend");
    let mut latency = ChartBuilder::on(&lower)
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end, 0f64..slowest)
        .expect("chart");
    latency
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("latency (ms, last window)")
        .label_style(("sans-serif", 12))
        .draw()
        .expect("mesh");
    latency.draw_series(LineSeries::new(series(3), RGBColor(225, 125, 0).stroke_width(2))).expect("latency");
    root.present().expect("write the SVG");
}
