//! A rule's `consistency`: exact decisions, or quota leases within a declared overshoot bound
//! ([`crate::algorithm::lease`]).

use super::crd::{ConsistencyMode, ConsistencySpec};
use super::errors::ValidationErrors;
use crate::algorithm::{Limit, Micros};
use crate::duration::{HumanDuration, MICROS_PER_MS, MICROS_PER_SECOND, parse_duration};

/// How long an enforcer decides from a slice when the rule does not say.
pub const DEFAULT_STALENESS: Micros = MICROS_PER_SECOND;
const MIN_STALENESS: Micros = 50 * MICROS_PER_MS;
const MAX_STALENESS: Micros = 60 * MICROS_PER_SECOND;

use crate::rule::Leasing;

/// Compiles `spec` (at `path`) for a rule of `limit`: the limit made leased and its terms for
/// `leased`, `None` for `exact`; what is wrong goes to `errs`.
pub fn compile(
    spec: &ConsistencySpec,
    limit: Option<&Limit>,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<(Limit, Leasing)> {
    if spec.mode == ConsistencyMode::Exact {
        for (field, set) in
            [("maxOvershoot", spec.max_overshoot.is_some()), ("maxStaleness", spec.max_staleness.is_some())]
        {
            if set {
                errs.push(format!("{path}.{field}"), "applies to mode: leased only".to_string());
            }
        }
        return None;
    }
    let staleness = match spec.max_staleness.as_deref().map(parse_duration) {
        None => Some(DEFAULT_STALENESS),
        Some(Ok(d)) if (MIN_STALENESS..=MAX_STALENESS).contains(&d) => Some(d),
        Some(Ok(d)) => {
            errs.push(format!("{path}.maxStaleness"), format!("{} is outside 50ms..1m", HumanDuration(d)));
            None
        }
        Some(Err(e)) => {
            errs.push(format!("{path}.maxStaleness"), e.to_string());
            None
        }
    };
    let limit = limit?;
    let leased = match limit.clone().leasing() {
        Ok(leased) => leased,
        Err(e) => {
            errs.push(path.to_string(), e.to_string());
            return None;
        }
    };
    let Some(text) = spec.max_overshoot.as_deref() else {
        errs.push(
            format!("{path}.maxOvershoot"),
            "leased needs maxOvershoot, the most a key may admit over its limit".to_string(),
        );
        return None;
    };
    let max_overshoot = match overshoot(text, limit.capacity()) {
        Ok(n) => n,
        Err(message) => {
            errs.push(format!("{path}.maxOvershoot"), message);
            return None;
        }
    };
    Some((leased, Leasing { max_overshoot, staleness: staleness? }))
}

/// `text` ("20" or "2%", up to four decimals) as units of a limit of `capacity`.
fn overshoot(text: &str, capacity: u64) -> Result<u64, String> {
    let (number, percent) = match text.strip_suffix('%') {
        Some(n) => (n, true),
        None => (text, false),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits_ok = |s: &str, max: usize| s.len() <= max && s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty() || !digits_ok(whole, 10) || !digits_ok(fraction, 4) || (!percent && !fraction.is_empty()) {
        return Err(format!("{text:?} is not a number of requests (20) or a percentage of the limit (2%, 0.5%)"));
    }
    let scaled = |s: &str| -> u128 {
        let padded = format!("{s:0<4}");
        padded.parse::<u128>().unwrap_or(0)
    };
    let ten_thousandths = whole.parse::<u128>().unwrap_or(u128::MAX / 2) * 10_000 + scaled(fraction);
    let units = if percent {
        if ten_thousandths > 100 * 10_000 {
            return Err(format!("{text} is more than the limit itself: at most 100%"));
        }
        u128::from(capacity) * ten_thousandths / (100 * 10_000)
    } else {
        ten_thousandths / 10_000
    };
    if units == 0 {
        return Err(format!(
            "{text} of a limit of {capacity} is less than one request: a slice needs at least one; raise maxOvershoot or use mode: exact"
        ));
    }
    if units > u128::from(capacity) {
        return Err(format!("{text} is more than the limit itself ({capacity}): at most {capacity}"));
    }
    Ok(units as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    fn spec(overshoot: Option<&str>, staleness: Option<&str>) -> ConsistencySpec {
        ConsistencySpec {
            mode: ConsistencyMode::Leased,
            max_overshoot: overshoot.map(String::from),
            max_staleness: staleness.map(String::from),
        }
    }

    fn compiled(algorithm: Algorithm, requests: u64, s: &ConsistencySpec) -> Result<Leasing, String> {
        let limit = Limit::new(algorithm, requests, MICROS_PER_SECOND, None, None).unwrap();
        let mut errs = ValidationErrors::default();
        match compile(s, Some(&limit), "spec.rules[0].consistency", &mut errs) {
            Some((leased, terms)) if errs.is_empty() => {
                assert!(leased.leased());
                Ok(terms)
            }
            _ => Err(errs.to_string()),
        }
    }

    #[test]
    fn the_bound_is_a_number_or_a_share_of_the_limit() {
        let terms = compiled(Algorithm::FixedWindow, 1000, &spec(Some("2%"), None)).unwrap();
        assert_eq!(terms, Leasing { max_overshoot: 20, staleness: DEFAULT_STALENESS });
        assert_eq!(compiled(Algorithm::Gcra, 1000, &spec(Some("0.25%"), Some("200ms"))).unwrap().max_overshoot, 2);
        assert_eq!(compiled(Algorithm::TokenBucket, 1000, &spec(Some("7"), None)).unwrap().max_overshoot, 7);
    }

    #[test]
    fn a_bound_that_cannot_be_kept_is_refused_with_the_reason() {
        let less_than_one = compiled(Algorithm::FixedWindow, 10, &spec(Some("2%"), None)).unwrap_err();
        assert!(less_than_one.contains("less than one request"), "{less_than_one}");
        let log = compiled(Algorithm::SlidingWindowLog, 100, &spec(Some("2%"), None)).unwrap_err();
        assert!(log.contains("slidingWindowLog cannot be leased"), "{log}");
        let concurrency = compiled(Algorithm::Concurrency, 100, &spec(Some("2"), None)).unwrap_err();
        assert!(concurrency.contains("concurrency cannot be leased"), "{concurrency}");
        assert!(compiled(Algorithm::FixedWindow, 100, &spec(Some("120%"), None)).unwrap_err().contains("at most 100%"));
        assert!(compiled(Algorithm::FixedWindow, 100, &spec(Some("101"), None)).unwrap_err().contains("at most 100"));
        assert!(compiled(Algorithm::FixedWindow, 100, &spec(Some("2.5"), None)).unwrap_err().contains("not a number"));
        assert!(compiled(Algorithm::FixedWindow, 100, &spec(None, None)).unwrap_err().contains("needs maxOvershoot"));
        assert!(
            compiled(Algorithm::FixedWindow, 100, &spec(Some("2"), Some("10ms"))).unwrap_err().contains("50ms..1m")
        );
    }
}
