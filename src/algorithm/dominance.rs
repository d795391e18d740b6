//! When one limit makes another unreachable: the arithmetic behind the layering report
//! ([`crate::policy::layering`]).
//!
//! Every request an *inner* rule counts has first passed an enforcing *outer* rule (a request
//! refused by any enforcing rule consumes nothing anywhere), so the inner rule only ever sees the
//! stream the outer one admits. [`never_refuses`] proves, from the two limits alone, that this
//! stream always fits the inner limit: then the inner rule can never refuse anything. It answers
//! only what it can prove; `None` means "not proven", never "reachable".
//!
//! The proofs, with `r = inner cost / outer cost` (units one request counts in each):
//! - **Buckets** (tokenBucket, gcra, leakyBucket: one theoretical arrival time per key): each
//!   admitted request moves the inner TAT by no more than the outer one (`ci·Ti ≤ co·To`), so the
//!   inner TAT never passes the outer's; and the inner tolerance is at least the outer's
//!   (`bi·Ti ≥ bo·To`), so whatever fits the outer fits the inner. A shaping inner bucket also
//!   needs the outer to shape with a `maxDelay` no longer than its own.
//! - **Same window algorithm**: fixed windows are aligned to the clock, so an inner window `k`
//!   times as long as the outer's holds `k` outer windows; a sliding log's trailing window no
//!   longer than the outer's lies inside one; sliding counters of one period weigh the same
//!   counts alike.
//! - **Otherwise, envelopes**: the most requests the outer limit admits in any interval of a
//!   given length, against what the inner limit admits in its own window (a fixed window or log
//!   counts one interval of its period; a sliding counter's estimate spans at most two).

use super::{Algorithm, Limit, Micros};

/// Why the inner limit can never refuse, in words for the report; `None`: not proven.
pub fn never_refuses(outer: &Limit, outer_cost: u64, inner: &Limit, inner_cost: u64) -> Option<&'static str> {
    use Algorithm::*;
    if outer_cost == 0 || inner.algorithm == Concurrency || outer.algorithm == Concurrency {
        return None;
    }
    if inner_cost == 0 {
        return Some("it counts nothing (cost 0)");
    }
    let (co, ci) = (u128::from(outer_cost), u128::from(inner_cost));
    let bucket = |a: Algorithm| matches!(a, TokenBucket | Gcra | LeakyBucket);
    if bucket(outer.algorithm) && bucket(inner.algorithm) {
        // Time per unit, cross-multiplied: T = per / requests.
        let (po, ro, pi, ri) = (wide(outer.per), wide(outer.requests), wide(inner.per), wide(inner.requests));
        let slower = ci * pi * ro <= co * po * ri;
        let tolerant = wide(inner.burst) * pi * ro >= wide(outer.burst) * po * ri;
        let shaped = match (inner.max_delay, outer.max_delay) {
            (None, _) => true,
            (Some(inner_delay), Some(outer_delay)) => outer_delay <= inner_delay,
            (Some(_), None) => false,
        };
        return (slower && tolerant && shaped).then_some("its bucket fills no faster and holds at least as much");
    }
    if inner.max_delay.is_some() {
        return None;
    }
    // Requests the outer limit admits per window (window algorithms).
    let per_window = u128::from(outer.requests) / co;
    match (outer.algorithm, inner.algorithm) {
        (FixedWindow, FixedWindow) if inner.per.is_multiple_of(outer.per) => {
            let windows = wide(inner.per / outer.per);
            (ci * per_window * windows <= wide(inner.requests))
                .then_some("its windows hold whole windows of the other, which admit no more")
        }
        (SlidingWindowLog, SlidingWindowLog) if inner.per <= outer.per => (ci * per_window <= wide(inner.requests))
            .then_some("its window lies inside the other's, which admits no more"),
        (SlidingWindowCounter, SlidingWindowCounter) if inner.per == outer.per => (ci * wide(outer.requests)
            <= co * wide(inner.requests))
        .then_some("it weighs the same windows and allows at least as much"),
        _ => {
            let window = if inner.algorithm == SlidingWindowCounter { 2 * inner.per } else { inner.per };
            match inner.algorithm {
                FixedWindow | SlidingWindowLog | SlidingWindowCounter => {
                    let most = envelope(outer, co, window)?;
                    (ci * most <= wide(inner.requests))
                        .then_some("the other admits no more in any of its windows than it allows")
                }
                TokenBucket | Gcra | LeakyBucket => {
                    // The outer is a window algorithm (buckets were handled above): its envelope
                    // is `per_window · (k + first)` for intervals just over k periods, against
                    // the `burst − cost + elapsed / T` the inner bucket admits from full.
                    let first = if outer.algorithm == SlidingWindowLog { 1 } else { 2 };
                    let start = ci * per_window * first + ci <= wide(inner.burst);
                    let slope = ci * per_window * wide(inner.per) <= wide(outer.per) * wide(inner.requests);
                    (start && slope).then_some("the other's windows admit no more than its bucket refills")
                }
                Concurrency => None,
            }
        }
    }
}

/// The most requests `limit` (charging `cost` units each) admits in any interval of `length`.
fn envelope(limit: &Limit, cost: u128, length: Micros) -> Option<u128> {
    let periods = wide(length.div_ceil(limit.per));
    let per_window = wide(limit.requests) / cost;
    match limit.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => {
            let refill = (wide(length) * wide(limit.requests)).div_ceil(wide(limit.per));
            Some((wide(limit.burst) + refill) / cost + 1)
        }
        // An interval meets at most one more window than it spans.
        Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => Some(per_window * (periods + 1)),
        Algorithm::SlidingWindowLog => Some(per_window * periods),
        Algorithm::Concurrency => None,
    }
}

fn wide(n: u64) -> u128 {
    u128::from(n)
}

/// Whether the inner limit's sustained rate per request is above the outer's: the inner rule
/// then binds at most on bursts, and never once the outer one is the bottleneck.
pub fn sustains_more(outer: &Limit, outer_cost: u64, inner: &Limit, inner_cost: u64) -> bool {
    if outer_cost == 0 || inner.algorithm == Algorithm::Concurrency || outer.algorithm == Algorithm::Concurrency {
        return false;
    }
    // inner requests/(per·cost) > outer requests/(per·cost), cross-multiplied.
    wide(inner.requests) * wide(outer.per) * wide(outer_cost)
        > wide(outer.requests) * wide(inner.per) * wide(inner_cost)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{State, decide};

    const SECOND: Micros = 1_000_000;

    fn limit(algorithm: Algorithm, requests: u64, per: Micros, burst: Option<u64>) -> Limit {
        Limit::new(algorithm, requests, per, burst, None).expect("limit")
    }

    #[test]
    fn identical_limits_and_looser_ones_behind_them_never_refuse() {
        for algorithm in Algorithm::ALL {
            let outer = limit(algorithm, 10, SECOND, None);
            assert!(never_refuses(&outer, 1, &outer, 1).is_some(), "{algorithm:?}");
            let looser = limit(algorithm, 20, SECOND, None);
            assert!(never_refuses(&outer, 1, &looser, 1).is_some(), "{algorithm:?}");
            assert!(never_refuses(&looser, 1, &outer, 1).is_none(), "{algorithm:?}");
            // Counting twice as much per request makes the same limit bind.
            assert!(never_refuses(&outer, 1, &looser, 3).is_none(), "{algorithm:?}");
        }
    }

    #[test]
    fn a_larger_burst_or_a_slower_refill_behind_a_bucket_is_reachable() {
        let outer = limit(Algorithm::Gcra, 10, SECOND, Some(10));
        assert!(never_refuses(&outer, 1, &limit(Algorithm::Gcra, 10, SECOND, Some(5)), 1).is_none());
        assert!(never_refuses(&outer, 1, &limit(Algorithm::Gcra, 5, SECOND, Some(20)), 1).is_none());
        assert!(sustains_more(&outer, 1, &limit(Algorithm::Gcra, 11, SECOND, Some(5)), 1));
        assert!(!sustains_more(&outer, 1, &limit(Algorithm::Gcra, 10, SECOND, Some(5)), 1));
        // A shaping bucket waits at most its maxDelay: behind one that lets requests wait
        // longer, it refuses what the other delayed.
        let shaping = |max_delay| Limit::new(Algorithm::LeakyBucket, 10, SECOND, Some(10), Some(max_delay)).unwrap();
        assert!(never_refuses(&shaping(500_000), 1, &shaping(100_000), 1).is_none());
        assert!(never_refuses(&shaping(100_000), 1, &shaping(500_000), 1).is_some());
        let (outer, inner) = (shaping(500_000), shaping(100_000));
        let (mut outer_state, mut inner_state) = (None, None);
        let refused = (0..5).any(|_| {
            decide(&outer, &mut outer_state, SECOND, 1).allowed && !decide(&inner, &mut inner_state, SECOND, 1).allowed
        });
        assert!(refused, "the shorter maxDelay binds");
    }

    #[test]
    fn windows_against_buckets_use_the_envelope() {
        // 100 per minute in fixed windows can never exhaust 1000 per second.
        let outer = limit(Algorithm::FixedWindow, 100, 60 * SECOND, None);
        assert!(never_refuses(&outer, 1, &limit(Algorithm::TokenBucket, 1000, SECOND, None), 1).is_some());
        // ...but a burst of 100 at a window's end and 100 more at the next one's start can
        // exhaust a bucket of 150.
        assert!(never_refuses(&outer, 1, &limit(Algorithm::TokenBucket, 150, SECOND, None), 1).is_none());
        // A token bucket of 10/s (burst 10) admits at most 10 + 600 + 1 in a minute.
        let bucket = limit(Algorithm::TokenBucket, 10, SECOND, None);
        assert!(never_refuses(&bucket, 1, &limit(Algorithm::FixedWindow, 611, 60 * SECOND, None), 1).is_some());
        assert!(never_refuses(&bucket, 1, &limit(Algorithm::FixedWindow, 600, 60 * SECOND, None), 1).is_none());
    }

    /// The proofs checked against the algorithms themselves: random request streams pass an
    /// outer rule and then (only when admitted, as in a request's all-or-nothing decision) an
    /// inner one; whenever `never_refuses` claims the inner one never refuses, it must not.
    #[test]
    fn claimed_unreachable_limits_never_refuse_a_stream_the_outer_one_admitted() {
        use rand::{Rng, SeedableRng};
        let algorithms = Algorithm::ALL;
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let mut claimed = 0;
        for _ in 0..3000 {
            let pick = |rng: &mut rand::rngs::StdRng| {
                let algorithm = algorithms[rng.random_range(0..algorithms.len())];
                let requests = rng.random_range(1..=12);
                let per = rng.random_range(1..=4) * 250_000;
                let burst = algorithm.uses_burst().then(|| rng.random_range(1..=14));
                let shaping = algorithm == Algorithm::LeakyBucket && rng.random_bool(0.5);
                let max_delay = shaping.then(|| rng.random_range(0..=4) * 100_000);
                let limit = Limit::new(algorithm, requests, per, burst, max_delay).expect("limit");
                (limit, rng.random_range(1..=2u64))
            };
            let (outer, co) = pick(&mut rng);
            let (inner, ci) = pick(&mut rng);
            if co > outer.capacity() || ci > inner.capacity() || never_refuses(&outer, co, &inner, ci).is_none() {
                continue;
            }
            claimed += 1;
            let (mut outer_state, mut inner_state): (Option<State>, Option<State>) = (None, None);
            let mut now: Micros = rng.random_range(0..SECOND);
            for _ in 0..400 {
                now += [0, 1_000, 20_000, 90_000, 400_000][rng.random_range(0..5)];
                let mut trial = outer_state.clone();
                if !decide(&outer, &mut trial, now, co).allowed {
                    continue;
                }
                outer_state = trial;
                let inner_decision = decide(&inner, &mut inner_state, now, ci);
                assert!(
                    inner_decision.allowed,
                    "{outer:?} cost {co} admitted what {inner:?} cost {ci} refused at {now}"
                );
            }
        }
        assert!(claimed > 200, "too few pairs proven to test the proofs: {claimed}");
    }
}
