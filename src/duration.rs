//! Durations as users write them in policies: `1s`, `250ms`, `1m30s`, `1.5h`, `1d`.
//!
//! Parsed to whole microseconds, the unit every algorithm works in.

use std::fmt;

/// Microseconds: the one time unit of the pure core (Unix epoch based when a point in time).
pub type Micros = u64;

pub const MICROS_PER_MS: u64 = 1_000;
pub const MICROS_PER_SECOND: u64 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration; write a number and a unit such as 1s, 500ms, 1m, 1h or 1d")]
    Empty,
    #[error("invalid duration {0:?}: expected a number followed by a unit (us, ms, s, m, h, d), e.g. 1s or 1m30s")]
    Syntax(String),
    #[error("invalid duration {0:?}: unknown unit {1:?} (use us, ms, s, m, h or d)")]
    Unit(String, String),
    #[error("invalid duration {0:?}: too large")]
    Overflow(String),
}

/// Parses a duration such as `1s`, `250ms`, `1m30s`, `1.5h` into microseconds.
pub fn parse_duration(text: &str) -> Result<Micros, DurationError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(DurationError::Empty);
    }
    if trimmed == "0" {
        return Ok(0);
    }
    let syntax = || DurationError::Syntax(text.to_string());
    let overflow = || DurationError::Overflow(text.to_string());
    let bytes = trimmed.as_bytes();
    let mut total: u128 = 0;
    let mut i = 0;
    while i < bytes.len() {
        let number_start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let number = &trimmed[number_start..i];
        if number.is_empty() {
            return Err(syntax());
        }
        let unit_start = i;
        while i < bytes.len() && !(bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let unit = &trimmed[unit_start..i];
        let unit_micros: u128 = match unit {
            "us" | "µs" => 1,
            "ms" => 1_000,
            "s" => 1_000_000,
            "m" => 60_000_000,
            "h" => 3_600_000_000,
            "d" => 86_400_000_000,
            "" => return Err(syntax()),
            other => return Err(DurationError::Unit(text.to_string(), other.to_string())),
        };
        let (whole, fraction) = match number.split_once('.') {
            Some((w, f)) => (w, f),
            None => (number, ""),
        };
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(syntax());
        }
        let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| overflow())? };
        total = total.checked_add(whole.checked_mul(unit_micros).ok_or_else(overflow)?).ok_or_else(overflow)?;
        if !fraction.is_empty() {
            if fraction.len() > 18 {
                return Err(syntax());
            }
            let digits: u128 = fraction.parse().map_err(|_| syntax())?;
            let scale = 10u128.pow(fraction.len() as u32);
            // Fractions finer than a microsecond are rounded down.
            total = total.checked_add(digits * unit_micros / scale).ok_or_else(overflow)?;
        }
    }
    u64::try_from(total).map_err(|_| overflow())
}

/// A command-line duration (`250ms`, `1s`): the policy syntax, as a `std::time::Duration`.
pub fn parse_std_duration(text: &str) -> Result<std::time::Duration, String> {
    parse_duration(text).map(std::time::Duration::from_micros).map_err(|e| e.to_string())
}

/// [`parse_std_duration`] for flags where zero makes no sense (intervals, deadlines).
pub fn parse_positive_std_duration(text: &str) -> Result<std::time::Duration, String> {
    let duration = parse_std_duration(text)?;
    if duration.is_zero() {
        return Err("must be above zero".into());
    }
    Ok(duration)
}

/// Formats microseconds the way policies write durations (`1s`, `250ms`, `1m30s`).
pub struct HumanDuration(pub Micros);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        if rest == 0 {
            return f.write_str("0s");
        }
        for (unit, size) in [
            ("d", 86_400_000_000u64),
            ("h", 3_600_000_000),
            ("m", 60_000_000),
            ("s", 1_000_000),
            ("ms", 1_000),
            ("us", 1),
        ] {
            if rest >= size {
                write!(f, "{}{}", rest / size, unit)?;
                rest %= size;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_and_compounds() {
        assert_eq!(parse_duration("1s"), Ok(1_000_000));
        assert_eq!(parse_duration("250ms"), Ok(250_000));
        assert_eq!(parse_duration("1m30s"), Ok(90_000_000));
        assert_eq!(parse_duration("1.5h"), Ok(5_400_000_000));
        assert_eq!(parse_duration("1d"), Ok(86_400_000_000));
        assert_eq!(parse_duration("10us"), Ok(10));
        assert_eq!(parse_duration("0"), Ok(0));
    }

    #[test]
    fn rejects_bad_input_with_a_reason() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(parse_duration("10"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse_duration("1x"), Err(DurationError::Unit(_, u)) if u == "x"));
        assert!(matches!(parse_duration("s"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse_duration("1.2.3s"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse_duration("99999999999999999999d"), Err(DurationError::Overflow(_))));
    }

    #[test]
    fn command_line_durations() {
        assert_eq!(parse_std_duration("0"), Ok(std::time::Duration::ZERO));
        assert_eq!(parse_positive_std_duration("250ms"), Ok(std::time::Duration::from_millis(250)));
        assert_eq!(parse_positive_std_duration("0"), Err("must be above zero".to_string()));
        assert!(parse_positive_std_duration("1x").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn formats_back() {
        assert_eq!(HumanDuration(90_000_000).to_string(), "1m30s");
        assert_eq!(HumanDuration(250_000).to_string(), "250ms");
    }
}
