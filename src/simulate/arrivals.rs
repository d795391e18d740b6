//! Where simulated traffic comes from: a trace file or a pattern.
//!
//! # Trace format
//!
//! One arrival per line, whitespace-separated: the time in seconds since the start of the trace
//! (decimal, at most 6 fractional digits: exact to the microsecond), then optionally the key
//! value (`-` for none), then optionally the cost (a whole number). `#` starts a comment; blank
//! lines are ignored. Lines need not be in time order (arrivals are sorted, ties keep file order).
//!
//! # Pattern language
//!
//! Items separated by `;`, each a shape of arrivals; times (`at`, `from`) and lengths (`for`,
//! `on`, `off`) are durations (`300ms`, `1.5s`, `1m`) or plain seconds (`0.3`). Every item
//! takes `key K` (the key value of its arrivals) and `cost C`.
//!
//! | item | arrivals |
//! |---|---|
//! | `burst N [at T]` | N at time T (default 0) |
//! | `steady R/s for D [from T]` | R per second (also `/ms`, `/m`, `/h`, `/10s`) evenly spaced over D from T: the k-th at T + k/R |
//! | `onoff R/s on A off B for D [from T]` | `steady` during A, silence during B, repeated over D |
//! | `boundary N at T` | the boundary attack: N at T − 1 ms and N at T (put T on a window boundary) |
//! | `clients K R/s for D [alpha A] [seed S] [from T]` | K clients sharing R per second with Zipf weights (client i gets R·i^−A / Σ j^−A; A default 1.2), each a Poisson process from a fixed seed (default 1); keys `client-1` … `client-K` (a `key` prefix replaces `client`) |

use rand::{Rng, SeedableRng};

use super::SimulateError;
use crate::algorithm::Micros;
use crate::duration::{MICROS_PER_SECOND, parse_duration};

/// The most arrivals one simulation generates, so a typo in a pattern cannot eat the memory.
pub const MAX_ARRIVALS: usize = 20_000_000;

/// One simulated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// Microseconds since the start of the trace.
    pub at: Micros,
    /// Replaces the value of what the rules key on (see the module docs of [`super`]).
    pub key: Option<String>,
    /// Replaces the request's cost.
    pub cost: Option<u64>,
    /// How long the request is in progress (its service time): what a `concurrency` rule's slot
    /// is held for. `None`: the run's `--hold`.
    pub hold: Option<Micros>,
}

/// Seconds as written in a trace (`12`, `0.25`, `1.000001`) to microseconds, exactly.
pub fn parse_seconds(text: &str) -> Result<Micros, String> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if (whole.is_empty() && fraction.is_empty())
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(format!("{text:?} is not a number of seconds"));
    }
    if fraction.len() > 6 {
        return Err(format!("{text:?} is finer than a microsecond"));
    }
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| format!("{text:?} is too large"))? };
    let fraction: u64 = if fraction.is_empty() { 0 } else { format!("{fraction:0<6}").parse().unwrap_or(0) };
    whole
        .checked_mul(MICROS_PER_SECOND)
        .and_then(|w| w.checked_add(fraction))
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// A trace time no trace of seconds reaches (about 3,170 years) and every Unix time in
/// milliseconds since March 1973 passes: a trace written in epoch milliseconds (or
/// microseconds), which read as seconds would replay an empty millennium.
const EPOCH_MILLIS_AS_SECONDS: Micros = 100_000_000_000 * MICROS_PER_SECOND;

/// Parses a trace file (format in the module docs), sorted by time.
pub fn parse_trace(text: &str) -> Result<Vec<Arrival>, SimulateError> {
    let mut arrivals = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line_number = index + 1;
        let content = line.split('#').next().unwrap_or("");
        let mut fields = content.split_whitespace();
        let Some(time) = fields.next() else { continue };
        let bad = |message: String| SimulateError::Trace { line: line_number, message };
        let at = parse_seconds(time).map_err(bad)?;
        if at >= EPOCH_MILLIS_AS_SECONDS {
            return Err(bad(format!(
                "{time} seconds is over 3,000 years: times are seconds since the trace's start, and this looks like \
                 Unix time in milliseconds (or microseconds); convert it to seconds from the first arrival \
                 (docs/simulate.md shows how)"
            )));
        }
        let key = fields.next().filter(|k| *k != "-").map(str::to_string);
        let cost = match fields.next() {
            None | Some("-") => None,
            Some(c) => Some(c.parse::<u64>().map_err(|_| bad(format!("cost {c:?} is not a whole number")))?),
        };
        let hold = match fields.next() {
            None => None,
            Some(h) => Some(parse_seconds(h).map_err(|e| bad(format!("in-progress seconds {h:?}: {e}")))?),
        };
        if let Some(extra) = fields.next() {
            return Err(bad(format!("unexpected {extra:?}: a line is `seconds [key [cost [in-progress seconds]]]`")));
        }
        if arrivals.len() == MAX_ARRIVALS {
            return Err(bad(format!("more than {MAX_ARRIVALS} arrivals")));
        }
        arrivals.push(Arrival { at, key, cost, hold });
    }
    arrivals.sort_by_key(|a| a.at);
    Ok(arrivals)
}

fn time_value(text: &str) -> Result<Micros, String> {
    parse_seconds(text).or_else(|_| parse_duration(text).map_err(|e| e.to_string()))
}

/// `R/s`, `R/100ms`, `R/m`: requests per second.
fn rate_value(text: &str) -> Result<f64, String> {
    let (count, per) = text.split_once('/').ok_or_else(|| format!("rate {text:?}: expected R/s"))?;
    let count: f64 = count.parse().map_err(|_| format!("rate {text:?}: {count:?} is not a number"))?;
    let per = if per.starts_with(|c: char| c.is_ascii_digit()) { per.to_string() } else { format!("1{per}") };
    let per = parse_duration(&per).map_err(|e| format!("rate {text:?}: {e}"))?;
    if per == 0 || !(count.is_finite() && count > 0.0) {
        return Err(format!("rate {text:?}: must be positive"));
    }
    Ok(count * MICROS_PER_SECOND as f64 / per as f64)
}

/// The words of one pattern item after its kind: positional values, then `name value` options.
struct Item<'a> {
    words: Vec<&'a str>,
    position: usize,
    text: &'a str,
}

impl<'a> Item<'a> {
    fn error(&self, message: impl std::fmt::Display) -> SimulateError {
        SimulateError::Pattern { item: self.text.to_string(), message: message.to_string() }
    }
    fn positional(&mut self, what: &str) -> Result<&'a str, SimulateError> {
        let word = self.words.get(self.position).copied().ok_or_else(|| self.error(format!("missing {what}")))?;
        self.position += 1;
        Ok(word)
    }
    /// The value after option `name`, if given.
    fn option(&self, name: &str) -> Result<Option<&'a str>, SimulateError> {
        match self.words[self.position..].iter().position(|w| *w == name) {
            None => Ok(None),
            Some(i) => self
                .words
                .get(self.position + i + 1)
                .copied()
                .map(Some)
                .ok_or_else(|| self.error(format!("{name} needs a value"))),
        }
    }
    fn time_option(&self, name: &str) -> Result<Option<Micros>, SimulateError> {
        self.option(name)?.map(|v| time_value(v).map_err(|e| self.error(format!("{name}: {e}")))).transpose()
    }
    fn required_time(&self, name: &str) -> Result<Micros, SimulateError> {
        self.time_option(name)?.ok_or_else(|| self.error(format!("missing `{name} DURATION`")))
    }
    /// The end of `[from, from + length)`, or an error naming both when it is past the last
    /// representable time (a trace's times are microseconds in a u64).
    fn end(&self, from: Micros, length: Micros) -> Result<Micros, SimulateError> {
        from.checked_add(length).ok_or_else(|| self.error("from + for is too far in the future"))
    }
    fn count(&mut self, what: &str) -> Result<u64, SimulateError> {
        let word = self.positional(what)?;
        word.parse().map_err(|_| self.error(format!("{what} {word:?} is not a whole number")))
    }
    /// Checks that every word after the positional ones is a known option with its value.
    fn only_options(&self, known: &[&str]) -> Result<(), SimulateError> {
        let rest = &self.words[self.position..];
        let mut i = 0;
        while i < rest.len() {
            if !known.contains(&rest[i]) {
                return Err(self.error(format!("unexpected {:?}; options here: {}", rest[i], known.join(", "))));
            }
            i += 2;
        }
        Ok(())
    }
}

/// Evenly spaced arrivals at `rate` per second over `[from, from + length)`.
fn steady(
    from: Micros,
    rate: f64,
    length: Micros,
    push: &mut impl FnMut(Micros) -> Result<(), SimulateError>,
) -> Result<(), SimulateError> {
    let count = (rate * length as f64 / MICROS_PER_SECOND as f64).floor() as u64;
    for k in 0..count {
        push(from + (k as f64 * MICROS_PER_SECOND as f64 / rate).round() as Micros)?;
    }
    Ok(())
}

/// Generates a pattern's arrivals (language in the module docs), sorted by time.
pub fn parse_pattern(spec: &str) -> Result<Vec<Arrival>, SimulateError> {
    let mut arrivals: Vec<Arrival> = Vec::new();
    for text in spec.split(';').map(str::trim).filter(|t| !t.is_empty()) {
        let mut words: Vec<&str> = text.split_whitespace().collect();
        let kind = words.remove(0);
        let mut item = Item { words, position: 0, text };
        let too_many =
            || SimulateError::Pattern { item: text.to_string(), message: format!("more than {MAX_ARRIVALS} arrivals") };
        let mut generated: Vec<(Micros, Option<String>)> = Vec::new();
        let mut push = |at: Micros| {
            if arrivals.len() + generated.len() >= MAX_ARRIVALS {
                return Err(too_many());
            }
            generated.push((at, None));
            Ok(())
        };
        // `clients` names its own keys; the other shapes take `key`.
        let mut keys_are_clients = false;
        match kind {
            "burst" => {
                let n = item.count("N")?;
                item.only_options(&["at", "key", "cost", "hold"])?;
                let at = item.time_option("at")?.unwrap_or(0);
                for _ in 0..n {
                    push(at)?;
                }
            }
            "steady" => {
                let rate = rate_value(item.positional("R/s")?).map_err(|e| item.error(e))?;
                item.only_options(&["for", "from", "key", "cost", "hold"])?;
                let (from, length) = (item.time_option("from")?.unwrap_or(0), item.required_time("for")?);
                item.end(from, length)?;
                steady(from, rate, length, &mut push)?;
            }
            "onoff" => {
                let rate = rate_value(item.positional("R/s")?).map_err(|e| item.error(e))?;
                item.only_options(&["on", "off", "for", "from", "key", "cost", "hold"])?;
                let (on, off, length) =
                    (item.required_time("on")?, item.required_time("off")?, item.required_time("for")?);
                if on == 0 {
                    return Err(item.error("on must be positive"));
                }
                let from = item.time_option("from")?.unwrap_or(0);
                let end = item.end(from, length)?;
                let period = on.checked_add(off).ok_or_else(|| item.error("on + off is too long"))?;
                let mut start = from;
                while start < end {
                    steady(start, rate, on.min(end - start), &mut push)?;
                    // Past the last representable time there is nothing left of the span.
                    let Some(next) = start.checked_add(period) else { break };
                    start = next;
                }
            }
            "boundary" => {
                let n = item.count("N")?;
                item.only_options(&["at", "key", "cost", "hold"])?;
                let at = item.required_time("at")?;
                let before = at.checked_sub(1_000).ok_or_else(|| item.error("at must be at least 1ms"))?;
                for _ in 0..n {
                    push(before)?;
                }
                for _ in 0..n {
                    push(at)?;
                }
            }
            "clients" => {
                let clients = item.count("K")?;
                let rate = rate_value(item.positional("R/s")?).map_err(|e| item.error(e))?;
                item.only_options(&["for", "from", "alpha", "seed", "key", "cost", "hold"])?;
                let length = item.required_time("for")?;
                let from = item.time_option("from")?.unwrap_or(0);
                item.end(from, length)?;
                let alpha: f64 = match item.option("alpha")? {
                    None => 1.2,
                    Some(a) => a.parse().map_err(|_| item.error(format!("alpha {a:?} is not a number")))?,
                };
                // Outside it the weights overflow or vanish (NaN, infinite rates): a trace that
                // never ends instead of the one the pattern says.
                if !(0.0..=10.0).contains(&alpha) {
                    return Err(item.error(format!("alpha {alpha} must be from 0 to 10")));
                }
                let seed: u64 = match item.option("seed")? {
                    None => 1,
                    Some(s) => s.parse().map_err(|_| item.error(format!("seed {s:?} is not a whole number")))?,
                };
                if clients == 0 || clients > 10_000_000 {
                    return Err(item.error("K must be from 1 to 10000000"));
                }
                let prefix = item.option("key")?.unwrap_or("client").to_string();
                let weights: Vec<f64> = (1..=clients).map(|i| (i as f64).powf(-alpha)).collect();
                let total: f64 = weights.iter().sum();
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                for (i, weight) in weights.iter().enumerate() {
                    let client_rate = rate * weight / total / MICROS_PER_SECOND as f64; // per µs
                    let mut t = 0.0f64;
                    loop {
                        // Exponential gaps: a Poisson process of the client's rate.
                        let u: f64 = rng.random::<f64>();
                        t += -(1.0 - u).ln() / client_rate;
                        if t >= length as f64 {
                            break;
                        }
                        if arrivals.len() + generated.len() >= MAX_ARRIVALS {
                            return Err(too_many());
                        }
                        generated.push((from + t as Micros, Some(format!("{prefix}-{}", i + 1))));
                    }
                }
                keys_are_clients = true;
            }
            other => {
                return Err(SimulateError::Pattern {
                    item: text.to_string(),
                    message: format!("unknown shape {other:?}; expected burst, steady, onoff, boundary or clients"),
                });
            }
        }
        let key = if keys_are_clients { None } else { item.option("key")?.map(str::to_string) };
        let cost = match item.option("cost")? {
            None => None,
            Some(c) => Some(c.parse::<u64>().map_err(|_| item.error(format!("cost {c:?} is not a whole number")))?),
        };
        let hold = item.time_option("hold")?;
        arrivals.extend(generated.into_iter().map(|(at, client)| Arrival {
            at,
            key: client.or_else(|| key.clone()),
            cost,
            hold,
        }));
    }
    if arrivals.is_empty() {
        return Err(SimulateError::Pattern { item: spec.to_string(), message: "no arrivals".to_string() });
    }
    arrivals.sort_by_key(|a| a.at);
    Ok(arrivals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_exact_to_the_microsecond() {
        assert_eq!(parse_seconds("1.5"), Ok(1_500_000));
        assert_eq!(parse_seconds("0.000001"), Ok(1));
        assert_eq!(parse_seconds(".25"), Ok(250_000));
        assert_eq!(parse_seconds("12"), Ok(12_000_000));
        assert!(parse_seconds("0.0000001").unwrap_err().contains("microsecond"));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("1e3").is_err());
    }

    #[test]
    fn traces_have_optional_key_and_cost() {
        let trace = "# header\n0.5 k1 2\n0.25\n\n1 - 3 # comment\n";
        let arrivals = parse_trace(trace).unwrap();
        assert_eq!(
            arrivals,
            vec![
                Arrival { at: 250_000, key: None, cost: None, hold: None },
                Arrival { at: 500_000, key: Some("k1".into()), cost: Some(2), hold: None },
                Arrival { at: 1_000_000, key: None, cost: Some(3), hold: None },
            ]
        );
        let error = parse_trace("0\nx\n").unwrap_err().to_string();
        assert!(error.contains("line 2"), "{error}");
        assert!(parse_trace("1 k 2 extra").unwrap_err().to_string().contains("extra"));
    }

    #[test]
    fn a_trace_in_epoch_milliseconds_is_refused_not_replayed_as_seconds() {
        let error = parse_trace("0.5\n1733390000123 k1\n").unwrap_err().to_string();
        assert!(error.starts_with("trace line 2: 1733390000123 seconds is over 3,000 years"), "{error}");
        assert!(error.contains("milliseconds"), "{error}");
        // Unix time in seconds is a long lead-in, not a unit mistake: still read as written.
        assert_eq!(parse_trace("1733390000.5\n").unwrap()[0].at, 1_733_390_000_500_000);
    }

    #[test]
    fn patterns_generate_the_documented_shapes() {
        let burst = parse_pattern("burst 20 at 300ms key a cost 2").unwrap();
        assert_eq!(burst.len(), 20);
        assert!(burst.iter().all(|a| a.at == 300_000 && a.key.as_deref() == Some("a") && a.cost == Some(2)));
        let steady = parse_pattern("steady 10/s for 1s from 2s").unwrap();
        assert_eq!(
            steady.iter().map(|a| a.at).collect::<Vec<_>>(),
            (0..10).map(|k| 2_000_000 + k * 100_000).collect::<Vec<_>>()
        );
        assert_eq!(parse_pattern("steady 120/m for 1m").unwrap().len(), 120);
        let onoff = parse_pattern("onoff 10/s on 1s off 1s for 4s").unwrap();
        assert_eq!(onoff.len(), 20);
        assert!(onoff.iter().all(|a| (a.at / 1_000_000) % 2 == 0));
        let boundary = parse_pattern("boundary 5 at 1m").unwrap();
        assert_eq!(boundary.iter().filter(|a| a.at == 59_999_000).count(), 5);
        assert_eq!(boundary.iter().filter(|a| a.at == 60_000_000).count(), 5);
        let clients = parse_pattern("clients 100 1000/s for 10s seed 7").unwrap();
        assert!((9_000..11_000).contains(&clients.len()), "{}", clients.len());
        assert_eq!(clients, parse_pattern("clients 100 1000/s for 10s seed 7").unwrap(), "a fixed seed");
        let count = |k: &str| clients.iter().filter(|a| a.key.as_deref() == Some(k)).count();
        assert!(count("client-1") > 10 * count("client-50"), "heavy-tailed");
        let both = parse_pattern("burst 1; burst 1 at 1s").unwrap();
        assert_eq!(both.len(), 2);
    }

    #[test]
    fn pattern_errors_name_the_item() {
        let error = parse_pattern("burst 5; steady 10/s").unwrap_err().to_string();
        assert!(error.contains("steady 10/s") && error.contains("for"), "{error}");
        assert!(parse_pattern("wobble 3").unwrap_err().to_string().contains("unknown shape"));
        assert!(parse_pattern("burst 3 at").unwrap_err().to_string().contains("needs a value"));
        assert!(parse_pattern("burst 3 sometime 2").unwrap_err().to_string().contains("unexpected"));
        assert!(parse_pattern("steady 100000000/s for 1h").unwrap_err().to_string().contains("more than"));
    }

    /// Found by reading the parser for the `simulate_pattern` fuzz target: times that wrap past
    /// the last microsecond looped forever (onoff) and a NaN or huge alpha made rates NaN, so
    /// the trace ran to MAX_ARRIVALS (1.26 GB) instead of the pattern's few arrivals.
    #[test]
    fn patterns_at_the_edges_of_time_and_weight_are_refused_or_bounded() {
        let huge = "9223372036854.775808"; // 2^63 µs in seconds
        let error = parse_pattern(&format!("onoff 0.5/s on {huge} off {huge} for 1")).unwrap_err().to_string();
        assert!(error.contains("on + off"), "{error}");
        let error = parse_pattern(&format!("steady 1/s from {huge} for {huge}")).unwrap_err().to_string();
        assert!(error.contains("too far"), "{error}");
        // A span that reaches the last representable microsecond ends there.
        let near_end = parse_pattern(&format!("onoff 1/s on 1s off {huge} for {huge}")).unwrap();
        assert_eq!(near_end.len(), 1);
        for alpha in ["nan", "-2000", "inf", "10.5"] {
            let error = parse_pattern(&format!("clients 2 1/s for 1s alpha {alpha}")).unwrap_err().to_string();
            assert!(error.contains("alpha"), "{alpha}: {error}");
        }
        assert!(parse_pattern("clients 2 1/s for 10s alpha 0").is_ok());
    }
}
