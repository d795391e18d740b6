//! The sliding window counter's accuracy against the exact sliding log (docs/accuracy.md):
//! heavy-tailed traffic generated on the fly from a fixed seed, replayed through both with the
//! same limit, every decision compared.
//!
//! `cargo run --release --example accuracy -- [REQUESTS] [--svg docs/accuracy.svg]`
//! (defaults: 100,000,000 requests, 100,000 keys, Zipf alpha 1.0, one simulated day, a limit of
//! 100 requests per minute, seed 1).

use std::time::Instant;

use plotters::prelude::*;
use sluice::simulate::accuracy::{Accuracy, HeavyTailedTraffic, compare, limits};

const S: u64 = 1_000_000;
const KEYS: usize = 100_000;
const ALPHA: f64 = 1.0;
const DURATION: u64 = 86_400 * S;
const REQUESTS_PER_WINDOW: u64 = 100;
const PER: u64 = 60 * S;
const SEED: u64 = 1;
/// A window boundary (a multiple of a minute since the epoch).
const START: u64 = 1_700_000_040 * S;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let total: u64 = args.first().filter(|a| !a.starts_with("--")).map_or(Ok(100_000_000), |a| a.parse())?;
    let svg = args.iter().position(|a| a == "--svg").and_then(|i| args.get(i + 1)).cloned();
    let (counter, log) = limits(REQUESTS_PER_WINDOW, PER)?;
    let started = Instant::now();
    let traffic = HeavyTailedTraffic::new(total, KEYS, DURATION, START, ALPHA, SEED);
    let result = compare(&counter, &log, KEYS, DURATION, traffic);
    let took = started.elapsed();
    println!(
        "{} requests, {KEYS} keys (Zipf {ALPHA}), one day, limit {REQUESTS_PER_WINDOW}/min, seed {SEED} ({took:.1?})",
        result.decisions
    );
    println!(
        "admitted by the log: {} ({:.2}%)",
        result.admitted_exact,
        100.0 * result.admitted_exact as f64 / result.decisions.max(1) as f64
    );
    let admitted_estimate = result.admitted_exact + result.wrongly_admitted - result.wrongly_refused;
    println!(
        "admitted by the counter: {admitted_estimate} ({:+.3}% against the log)",
        100.0 * (admitted_estimate as f64 / result.admitted_exact.max(1) as f64 - 1.0)
    );
    println!(
        "wrong: {} ({:.4}%): wrongly admitted {} ({:.4}%), wrongly refused {} ({:.4}%)",
        result.wrong(),
        100.0 * result.wrong_share(),
        result.wrongly_admitted,
        100.0 * result.wrongly_admitted as f64 / result.decisions.max(1) as f64,
        result.wrongly_refused,
        100.0 * result.wrongly_refused as f64 / result.decisions.max(1) as f64,
    );
    println!("\n| key rate ÷ limit rate | keys | decisions | wrong | wrong share |");
    println!("|---|---:|---:|---:|---:|");
    for class in &result.by_rate {
        println!(
            "| {} | {} | {} | {} | {:.4}% |",
            class_label(class.class),
            class.keys,
            class.decisions,
            class.wrong,
            100.0 * class.wrong as f64 / class.decisions.max(1) as f64
        );
    }
    if let Some(path) = svg {
        draw(&result, &path)?;
        println!("\npicture: {path}");
    }
    Ok(())
}

fn class_label(class: i32) -> String {
    format!("2^{class} – 2^{}", class + 1)
}

fn draw(result: &Accuracy, path: &str) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let classes: Vec<_> = result.by_rate.iter().filter(|c| c.decisions > 0).collect();
    let (first, last) = match (classes.first(), classes.last()) {
        (Some(a), Some(b)) => (a.class, b.class),
        _ => return Ok(()),
    };
    let share = |c: &sluice::simulate::accuracy::RateClass| 100.0 * c.wrong as f64 / c.decisions as f64;
    let top = classes.iter().map(|c| share(c)).fold(0.0, f64::max).max(1e-4) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "slidingWindowCounter vs slidingWindowLog: {:.4}% of {} decisions differ",
                100.0 * result.wrong_share(),
                result.decisions
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(first as f64 - 0.5..last as f64 + 0.5, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("a key's offered rate ÷ the limit's rate (log2 classes; 0 = up to 2×)")
        .y_desc("wrong decisions of the key's requests (%)")
        .x_label_formatter(&|x| format!("2^{}", x.round() as i32))
        .draw()?;
    chart
        .draw_series(classes.iter().map(|c| {
            let x = c.class as f64;
            Rectangle::new([(x - 0.35, 0.0), (x + 0.35, share(c))], BLUE.mix(0.6).filled())
        }))?
        .label("wrong share per rate class")
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], BLUE.mix(0.6).filled()));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()?;
    root.present()?;
    Ok(())
}
