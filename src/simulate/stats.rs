//! What a window of `per` can hold: measured over admitted arrivals, and the theoretical bound
//! of each algorithm as Sluice implements it.

use crate::algorithm::{Algorithm, Limit, Micros};

/// The most cost admitted in any window `[s, s + per)` (sliding, half-open, exact to the
/// microsecond), over `admitted` (time, cost) pairs in time order. Two pointers: the window
/// ending at each arrival drops from its start whatever is `per` or more older.
pub fn max_admitted_in_any_window(admitted: &[(Micros, u64)], per: Micros) -> u64 {
    let (mut oldest, mut inside, mut most) = (0, 0u64, 0u64);
    for &(at, cost) in admitted {
        inside += cost;
        while admitted[oldest].0 + per <= at {
            inside -= admitted[oldest].1;
            oldest += 1;
        }
        most = most.max(inside);
    }
    most
}

/// The theoretical maximum of [`max_admitted_in_any_window`] for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub value: Option<u64>,
    /// How it follows from the limit, for reports and docs.
    pub formula: &'static str,
}

/// The bound per algorithm (docs/simulate.md derives each):
///
/// - tokenBucket, gcra, leakyBucket without `maxDelay` (policing): `burst` at the window's start
///   plus what refills before its last microsecond, `burst + floor((per − 1µs) / interval)` with
///   `interval = per / requests` rounded up — the design notes' `b + r·t`;
/// - leakyBucket with `maxDelay` (shaping): an admitted request waits at most `maxDelay`, so the
///   queue ahead of the window holds `min(burst − 1, floor(maxDelay / interval))` besides the one
///   departing: `1 + floor((per − 1µs) / interval) + min(burst − 1, floor(maxDelay / interval))`;
/// - fixedWindow: `2 × requests` (all of one window at its end, all of the next at its start);
/// - slidingWindowLog: `requests`, exactly;
/// - slidingWindowCounter: `2 × requests`: a window of `per` overlaps two fixed windows, each
///   admitting at most `requests`, and when the previous window's traffic came at its very end
///   the estimate lets the current one fill up before that traffic leaves the trailing window.
pub fn theoretical_bound(limit: &Limit) -> Bound {
    let refill = (limit.per() - 1) / limit.interval();
    match (limit.algorithm(), limit.max_delay()) {
        (Algorithm::LeakyBucket, Some(max_delay)) => Bound {
            value: Some(1 + refill + (limit.burst() - 1).min(max_delay / limit.interval())),
            formula: "1 + floor((per - 1us) / interval) + min(burst - 1, floor(maxDelay / interval)) (shaping)",
        },
        (Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket, _) => {
            Bound { value: Some(limit.burst() + refill), formula: "burst + floor((per - 1us) / interval): b + r*t" }
        }
        (Algorithm::FixedWindow, _) => {
            Bound { value: Some(2 * limit.requests()), formula: "2 x requests across a window boundary" }
        }
        (Algorithm::SlidingWindowLog, _) => Bound { value: Some(limit.requests()), formula: "requests, exactly" },
        (Algorithm::SlidingWindowCounter, _) => Bound {
            value: Some(2 * limit.requests()),
            formula: "approaches 2 x requests when the previous window's traffic came at its end",
        },
        // The report's maximum for a concurrency rule is the most in progress at once.
        (Algorithm::Concurrency, _) => Bound {
            value: Some(limit.requests()),
            formula: "requests in progress at once (maxInWindow: the most in progress for one key)",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_half_open_and_exact() {
        let per = 1_000_000;
        assert_eq!(max_admitted_in_any_window(&[], per), 0);
        let admitted = [(0, 1), (999_999, 1), (1_000_000, 1), (1_000_001, 2)];
        // [0, 1s) holds 2; [999_999, 1_999_999) holds 1 + 1 + 2.
        assert_eq!(max_admitted_in_any_window(&admitted, per), 4);
        assert_eq!(max_admitted_in_any_window(&[(5, 3), (5, 3)], per), 6);
    }

    #[test]
    fn bounds_follow_the_limit() {
        let limit = |a, burst, max_delay| Limit::new(a, 10, 1_000_000, burst, max_delay).unwrap();
        assert_eq!(theoretical_bound(&limit(Algorithm::TokenBucket, Some(5), None)).value, Some(14));
        assert_eq!(theoretical_bound(&limit(Algorithm::Gcra, None, None)).value, Some(19));
        assert_eq!(theoretical_bound(&limit(Algorithm::LeakyBucket, Some(5), Some(200_000))).value, Some(12));
        assert_eq!(theoretical_bound(&limit(Algorithm::FixedWindow, None, None)).value, Some(20));
        assert_eq!(theoretical_bound(&limit(Algorithm::SlidingWindowLog, None, None)).value, Some(10));
        assert_eq!(theoretical_bound(&limit(Algorithm::SlidingWindowCounter, None, None)).value, Some(20));
    }
}
