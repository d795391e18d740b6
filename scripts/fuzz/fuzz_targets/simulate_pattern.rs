//! `sluice simulate --pattern` specs (src/simulate/arrivals.rs): any text is arrivals or an error
//! naming the item. Besides "no panic": arrivals come sorted by time and never empty; a spec
//! decides the same twice (`clients` is seeded); and items are independent: a spec's arrivals
//! are its items' arrivals, each parsed alone, merged in time order (ties in item order), and a
//! spec fails with the first item that fails alone.
//!
//! Specs are the input after its first byte: as text when that byte is even, otherwise written
//! by [`generate`] from it: items of the documented shapes with numbers, units, options and
//! values from lists that take in the edges (0, 2^63 µs, u64::MAX, NaN), and words of the input's
//! own.
//!
//! `parse_pattern` generates while it parses, up to `MAX_ARRIVALS` (20 million): far more than
//! one fuzz input may cost. So a spec is only parsed when [`work_bound`], read off its words as
//! the language documents them, without generating, puts it under [`MAX_GENERATED`] arrivals
//! (and under [`MAX_SEGMENTS`] `onoff` periods); the bound is asserted as well.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::duration::parse_duration;
use sluice::simulate::arrivals::{Arrival, parse_seconds};
use sluice::simulate::{SimulateError, parse_pattern};

/// Arrivals one input may generate, over all its items (each spec is parsed three times over:
/// whole, again, and item by item).
const MAX_GENERATED: f64 = 20_000.0;
/// `onoff` on-periods one input may walk through (each may generate nothing).
const MAX_SEGMENTS: f64 = 100_000.0;
/// `clients K`: weights are computed for every client.
const MAX_CLIENTS: u64 = 20_000;
/// `clients … alpha A`: i^−A stays finite and positive for i ≤ MAX_CLIENTS.
const MAX_ALPHA: f64 = 10.0;

/// A time or length as the pattern language reads it: seconds, else a duration.
fn time_value(text: &str) -> Option<u64> {
    parse_seconds(text).ok().or_else(|| parse_duration(text).ok())
}

/// Requests per second of `R/s`, `R/100ms`, …; `None` where the parser refuses the rate.
fn rate_value(text: &str) -> Option<f64> {
    let (count, per) = text.split_once('/')?;
    let count: f64 = count.parse().ok()?;
    let per = if per.starts_with(|c: char| c.is_ascii_digit()) { per.to_string() } else { format!("1{per}") };
    let per = parse_duration(&per).ok()?;
    (per != 0 && count.is_finite() && count > 0.0).then(|| count * 1e6 / per as f64)
}

/// The time option `name` of an item whose words (its shape first) have `positional` values
/// before the options, read as the language reads options: the first word `name`, then its
/// value.
fn option_time(words: &[&str], positional: usize, name: &str) -> Option<u64> {
    let options = words.get(1 + positional..)?;
    let i = options.iter().position(|w| *w == name)?;
    time_value(options.get(i + 1)?)
}

/// An upper bound of the arrivals one item generates and the `onoff` periods it walks, as the
/// language documents them: N (2N for `boundary`); R × D (`steady`, `onoff`: on during at most
/// all of D; `clients`: a Poisson count of mean R × D, well within twice it plus slack for small
/// means); D / (A + B) periods, rounded up. Nothing without the values the shape needs. `None`
/// when it cannot be bounded cheaply.
fn item_bound(item: &str) -> Option<(f64, f64)> {
    let words: Vec<&str> = item.split_whitespace().collect();
    let count = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0) as f64;
    let rate = |i: usize| words.get(i).and_then(|w| rate_value(w)).unwrap_or(0.0);
    // R × D, for a shape with `positional` values; nothing without `for`.
    let rate_times_length = |positional: usize| match option_time(&words, positional, "for") {
        Some(length) => rate(positional) * length as f64 / 1e6,
        None => 0.0,
    };
    match words.first().copied() {
        Some("burst") => Some((count(1), 0.0)),
        Some("boundary") => Some((2.0 * count(1), 0.0)),
        Some("steady") => Some((rate_times_length(1), 0.0)),
        Some("onoff") => {
            let (on, off, length) =
                (option_time(&words, 1, "on"), option_time(&words, 1, "off"), option_time(&words, 1, "for"));
            let periods = match (on, off, length) {
                (Some(on), Some(off), Some(length)) if on > 0 => (length as f64 / (on as f64 + off as f64)).ceil(),
                _ => 0.0,
            };
            Some((rate_times_length(1), periods))
        }
        Some("clients") => {
            if count(1) > MAX_CLIENTS as f64 {
                return None;
            }
            let alphas = words.windows(2).filter(|w| w[0] == "alpha").filter_map(|w| w[1].parse::<f64>().ok());
            if alphas.into_iter().any(|a| !(a.abs() <= MAX_ALPHA)) {
                return None;
            }
            Some((2.0 * rate_times_length(2) + 1_000.0, 0.0))
        }
        _ => Some((0.0, 0.0)),
    }
}

fn items(spec: &str) -> impl Iterator<Item = &str> {
    spec.split(';').map(str::trim).filter(|t| !t.is_empty())
}

/// Arrivals and `onoff` periods the whole spec may generate and walk, if bounded.
fn work_bound(spec: &str) -> Option<(f64, f64)> {
    items(spec).try_fold((0.0, 0.0), |(a, s), item| item_bound(item).map(|(ia, is)| (a + ia, s + is)))
}

/// The fuzz input, read front to back; zeros once it runs out.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    fn pick<'l>(&mut self, list: &[&'l str]) -> &'l str {
        list[usize::from(self.byte()) % list.len()]
    }

    /// A word of the input's own (up to 15 bytes).
    fn word(&mut self) -> String {
        let n = usize::from(self.byte() % 16).min(self.0.len());
        let (word, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8_lossy(word).into_owned()
    }

    fn number(&mut self) -> String {
        const EDGES: [&str; 12] = [
            "0",
            "1e3",
            "nan",
            "inf",
            "-1",
            ".5",
            "0.000001",
            "18446744073709551615",
            "18446744073709.551615",
            "9223372036854.775808",
            "4611686018427.387904",
            "1.",
        ];
        match self.byte() % 8 {
            0..4 => (self.byte() % 20).to_string(),
            4 => format!("{}.{}", self.byte() % 10, self.byte()),
            5 => u16::from_le_bytes([self.byte(), self.byte()]).to_string(),
            6 => self.pick(&EDGES).to_string(),
            _ => self.word(),
        }
    }

    fn time(&mut self) -> String {
        let number = self.number();
        number + self.pick(&["", "", "ms", "s", "m", "h", "us", "µs", "d", "1s", "x"])
    }

    fn rate(&mut self) -> String {
        let number = self.number();
        format!("{number}/{}", self.pick(&["s", "s", "ms", "m", "h", "10s", "0s", "100ms", "1.5s", ""]))
    }
}

/// A spec written from the bytes: up to 4 items, each a shape with its positional values, mostly
/// the options it needs, and up to 4 options more.
fn generate(r: &mut Reader<'_>) -> String {
    const OPTIONS: [&str; 11] = ["at", "for", "from", "on", "off", "key", "cost", "hold", "alpha", "seed", "for"];
    let mut items = Vec::new();
    for _ in 0..1 + r.byte() % 4 {
        let kind = r.pick(&["burst", "steady", "onoff", "boundary", "clients", "", "wobble"]);
        let mut words = vec![kind.to_string()];
        match kind {
            "burst" | "boundary" => words.push(r.number()),
            "steady" | "onoff" => words.push(r.rate()),
            "clients" => {
                words.push(r.number());
                words.push(r.rate());
            }
            _ => words.push(r.word()),
        }
        // Mostly with the options the shape needs.
        let needed: &[&str] = match kind {
            "steady" | "clients" => &["for"],
            "onoff" => &["on", "off", "for"],
            "boundary" => &["at"],
            _ => &[],
        };
        if r.byte() % 4 != 0 {
            for option in needed {
                words.push(option.to_string());
                words.push(r.time());
            }
        }
        for _ in 0..r.byte() % 5 {
            let option = r.pick(&OPTIONS);
            words.push(option.to_string());
            words.push(match option {
                "key" => r.word(),
                "cost" | "alpha" | "seed" => r.number(),
                _ => r.time(),
            });
        }
        items.push(words.join(" "));
    }
    items.join(r.pick(&["; ", ";", " ;; "]))
}

fn is_no_arrivals(error: &SimulateError) -> bool {
    matches!(error, SimulateError::Pattern { message, .. } if message == "no arrivals")
}

fuzz_target!(|data: &[u8]| {
    let generated;
    let spec = match data.split_first() {
        Some((first, rest)) if first & 1 == 1 => {
            generated = generate(&mut Reader(rest));
            generated.as_str()
        }
        Some((_, rest)) => match std::str::from_utf8(rest) {
            Ok(spec) => spec,
            Err(_) => return,
        },
        None => return,
    };
    let Some((arrivals_bound, segments)) = work_bound(spec) else { return };
    // `!(x <= max)`: a NaN bound (an infinite rate over no time) is no bound.
    if !(arrivals_bound <= MAX_GENERATED) || !(segments <= MAX_SEGMENTS) {
        return;
    }
    let whole = parse_pattern(spec);
    if let Ok(arrivals) = &whole {
        assert!(!arrivals.is_empty(), "Ok with no arrivals");
        assert!(arrivals.windows(2).all(|w| w[0].at <= w[1].at), "sorted by time");
        assert!(arrivals.len() as f64 <= arrivals_bound, "{} arrivals, bound {arrivals_bound}", arrivals.len());
    }
    match (&whole, parse_pattern(spec)) {
        (Ok(first), Ok(second)) => assert!(*first == second, "the same spec twice gives other arrivals"),
        (Err(first), Err(second)) => assert_eq!(first.to_string(), second.to_string()),
        (first, second) => panic!("the same spec twice: {first:?}, then {second:?}"),
    }

    // Each item alone: the first failure is the spec's; otherwise their arrivals, merged.
    let mut merged: Vec<Arrival> = Vec::new();
    let mut failed: Option<SimulateError> = None;
    for item in items(spec) {
        match parse_pattern(item) {
            Ok(arrivals) => merged.extend(arrivals),
            Err(error) if is_no_arrivals(&error) => {}
            Err(error) => {
                failed = Some(error);
                break;
            }
        }
    }
    match (failed, &whole) {
        (Some(error), Err(got)) => assert_eq!(got.to_string(), error.to_string()),
        (Some(error), Ok(_)) => panic!("the spec parses, but its item fails alone: {error}"),
        (None, _) => {
            merged.sort_by_key(|a| a.at);
            match &whole {
                Ok(arrivals) => assert!(*arrivals == merged, "the spec's arrivals differ from its items' merged"),
                Err(error) => {
                    assert!(
                        merged.is_empty() && is_no_arrivals(error),
                        "{error}; the items alone give {}",
                        merged.len()
                    )
                }
            }
        }
    }
});
