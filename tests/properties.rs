//! Property tests of the bounds each algorithm promises, over random request sequences.

use proptest::prelude::*;
use sluice::algorithm::{Algorithm, Limit, Micros, State, check, decide};

const T0: Micros = 1_699_920_000_000_000;

/// Monotonic arrival times (gaps up to `max_gap`) and costs of 1 to `max_cost`.
fn arrivals(max_gap: Micros, max_cost: u64, len: usize) -> impl Strategy<Value = Vec<(Micros, u64)>> {
    prop::collection::vec((0..=max_gap, 1..=max_cost), 1..len).prop_map(|steps| {
        let mut now = T0;
        steps
            .into_iter()
            .map(|(gap, cost)| {
                now += gap;
                (now, cost)
            })
            .collect()
    })
}

/// Runs the sequence and returns the admitted (time, cost, delay) triples.
fn admitted(limit: &Limit, seq: &[(Micros, u64)]) -> Vec<(Micros, u64, Micros)> {
    let mut state = None;
    seq.iter()
        .filter_map(|&(now, cost)| {
            let d = decide(limit, &mut state, now, cost);
            d.allowed.then_some((now, cost, d.delay))
        })
        .collect()
}

/// Largest admitted cost inside any half-open interval [start, start + length) that starts at an
/// arrival (the worst case always starts at one).
fn max_in_any_interval(admitted: &[(Micros, u64, Micros)], length: Micros) -> u64 {
    admitted
        .iter()
        .map(|&(start, _, _)| admitted.iter().filter(|&&(t, _, _)| t >= start && t < start + length).map(|a| a.1).sum())
        .max()
        .unwrap_or(0)
}

fn limit(algorithm: Algorithm, requests: u64, per_ms: u64, burst: Option<u64>) -> Limit {
    Limit::new(algorithm, requests, per_ms * 1000, burst, None).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn fixed_window_at_most_n_per_aligned_window_and_2n_in_any_window(
        requests in 1u64..20, per_ms in 1u64..2000, seq in arrivals(400_000, 3, 200)
    ) {
        let l = limit(Algorithm::FixedWindow, requests, per_ms, None);
        let got = admitted(&l, &seq);
        let per = l.per();
        let mut by_window = std::collections::BTreeMap::<u64, u64>::new();
        for &(t, cost, _) in &got {
            *by_window.entry(t / per).or_default() += cost;
        }
        prop_assert!(by_window.values().all(|&n| n <= requests));
        prop_assert!(max_in_any_interval(&got, per) <= 2 * requests);
    }

    #[test]
    fn sliding_log_never_more_than_n_in_any_trailing_window(
        requests in 1u64..20, per_ms in 1u64..2000, seq in arrivals(300_000, 3, 200)
    ) {
        let l = limit(Algorithm::SlidingWindowLog, requests, per_ms, None);
        let got = admitted(&l, &seq);
        prop_assert!(max_in_any_interval(&got, l.per()) <= requests);
    }

    #[test]
    fn sliding_counter_never_more_than_n_per_aligned_window(
        requests in 1u64..20, per_ms in 1u64..2000, seq in arrivals(400_000, 3, 200)
    ) {
        let l = limit(Algorithm::SlidingWindowCounter, requests, per_ms, None);
        let got = admitted(&l, &seq);
        let mut by_window = std::collections::BTreeMap::<u64, u64>::new();
        for &(t, cost, _) in &got {
            *by_window.entry(t / l.per()).or_default() += cost;
        }
        prop_assert!(by_window.values().all(|&n| n <= requests));
    }

    #[test]
    fn buckets_admit_at_most_burst_plus_rate_times_t(
        algorithm in prop::sample::select(vec![Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::LeakyBucket]),
        requests in 1u64..50, per_ms in 1u64..2000, burst in 1u64..20,
        seq in arrivals(200_000, 3, 200), length_ms in 1u64..5000
    ) {
        let l = limit(algorithm, requests, per_ms, Some(burst));
        let got = admitted(&l, &seq);
        let length = length_ms * 1000;
        // [a, a + t) starts with at most burst·T of credit and refills t − 1 µs of it.
        prop_assert!(max_in_any_interval(&got, length) <= burst + (length - 1) / l.interval());
    }

    #[test]
    fn token_bucket_and_gcra_decide_identically(
        requests in 1u64..50, per_ms in 1u64..2000, burst in 1u64..20, seq in arrivals(200_000, 25, 200)
    ) {
        let tb = limit(Algorithm::TokenBucket, requests, per_ms, Some(burst));
        let gcra = limit(Algorithm::Gcra, requests, per_ms, Some(burst));
        let (mut a, mut b) = (None, None);
        for &(now, cost) in &seq {
            prop_assert_eq!(decide(&tb, &mut a, now, cost), decide(&gcra, &mut b, now, cost));
        }
    }

    #[test]
    fn shaped_leaky_bucket_departures_are_spaced_by_the_interval(
        requests in 1u64..50, per_ms in 1u64..2000, burst in 1u64..20, max_delay_ms in 0u64..3000,
        seq in arrivals(200_000, 3, 200)
    ) {
        let l = Limit::new(Algorithm::LeakyBucket, requests, per_ms * 1000, Some(burst), Some(max_delay_ms * 1000)).unwrap();
        let got = admitted(&l, &seq);
        for pair in got.windows(2) {
            let (t1, cost1, d1) = pair[0];
            let (t2, _, d2) = pair[1];
            prop_assert!(d1 <= max_delay_ms * 1000);
            prop_assert!(t2 + d2 >= t1 + d1 + cost1 * l.interval(), "departures {} then {}", t1 + d1, t2 + d2);
        }
    }

    #[test]
    fn a_denial_never_changes_state(
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        requests in 1u64..10, per_ms in 1u64..2000, seq in arrivals(300_000, 4, 100),
        probe_gap in 0u64..300_000, probe_cost in 1u64..12
    ) {
        let l = limit(algorithm, requests, per_ms, None);
        let mut state: Option<State> = None;
        let mut now = T0;
        for &(t, cost) in &seq {
            decide(&l, &mut state, t, cost);
            now = t;
        }
        let before = state.clone();
        let probe_at = now + probe_gap;
        let decision = decide(&l, &mut state, probe_at, probe_cost);
        if !decision.allowed {
            prop_assert_eq!(&state, &before);
        }
        // Checking alone never changes anything either, whatever it decides.
        let snapshot = state.clone();
        let _ = check(&l, state.as_ref(), probe_at, probe_cost);
        prop_assert_eq!(state, snapshot);
    }

    #[test]
    fn retry_after_is_exact_for_the_same_request(
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        requests in 1u64..10, per_ms in 1u64..2000, seq in arrivals(300_000, 3, 60), cost in 1u64..4
    ) {
        let l = limit(algorithm, requests, per_ms, None);
        let mut state = None;
        let mut now = T0;
        for &(t, c) in &seq {
            decide(&l, &mut state, t, c);
            now = t;
        }
        let d = check(&l, state.as_ref(), now, cost);
        if let Some(wait) = d.retry_after {
            prop_assert!(!d.allowed);
            // Admitted exactly at now + retry_after, and not a microsecond earlier.
            prop_assert!(check(&l, state.as_ref(), now + wait, cost).allowed, "not admitted after retry_after {}", wait);
            if wait > 0 {
                prop_assert!(!check(&l, state.as_ref(), now + wait - 1, cost).allowed);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Extreme costs (0, 1, the largest a gateway may send or a repeated descriptor may sum to)
    /// against the largest limits each algorithm accepts: no arithmetic overflows (the test build
    /// panics on one), and no algorithm admits more than its limit in one window.
    #[test]
    fn extreme_costs_and_limits_never_overflow(
        algorithm in prop::sample::select(vec![
            Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::LeakyBucket,
            Algorithm::FixedWindow, Algorithm::SlidingWindowCounter, Algorithm::SlidingWindowLog,
        ]),
        requests_pick in 0usize..3, per_pick in 0usize..3,
        steps in prop::collection::vec((0u64..=3_600_000_000, prop::sample::select(vec![0u64, 1, 2, u32::MAX as u64 - 1, u32::MAX as u64])), 1..40)
    ) {
        let max_requests = if algorithm == Algorithm::SlidingWindowLog { sluice::algorithm::MAX_LOG_REQUESTS } else { sluice::algorithm::MAX_REQUESTS };
        let requests = [1, 1000, max_requests][requests_pick];
        let per = [1_000, 3_600_000_000, 86_400_000_000 * 366][per_pick];
        // Combinations the policy refuses (too high a rate, too large a bucket) are not rules.
        let Ok(l) = Limit::new(algorithm, requests, per, None, None) else { return Ok(()) };
        let mut state = None;
        let mut now = T0;
        let mut admitted_in_window = 0u64;
        let mut window_start = T0;
        for (gap, cost) in steps {
            now += gap;
            if now >= window_start + l.per() {
                window_start = now;
                admitted_in_window = 0;
            }
            let decision = decide(&l, &mut state, now, cost);
            if decision.allowed {
                admitted_in_window = admitted_in_window.saturating_add(cost);
            }
            let bound = match algorithm {
                // Fixed windows are aligned to the epoch: up to two in one trailing period.
                Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => 2 * requests,
                _ => requests.max(l.burst()),
            };
            prop_assert!(admitted_in_window <= bound.saturating_add(requests), "{algorithm:?} admitted {admitted_in_window} (limit {requests})");
        }
    }
}

/// One step of a reservation sequence: after `gap` µs, either reserve `estimate` under a new
/// hold, or settle one of the holds taken (`pick` chooses which) to a share of its estimate.
#[derive(Debug, Clone)]
enum ReservationStep {
    Reserve { gap: Micros, estimate: u64 },
    Settle { gap: Micros, pick: usize, share_percent: u64 },
}

fn reservation_steps() -> impl Strategy<Value = Vec<ReservationStep>> {
    let step =
        prop_oneof![
            (0..2_000_000u64, 1..400u64).prop_map(|(gap, estimate)| ReservationStep::Reserve { gap, estimate }),
            (0..2_000_000u64, any::<usize>(), 0..=100u64)
                .prop_map(|(gap, pick, share_percent)| ReservationStep::Settle { gap, pick, share_percent }),
        ];
    prop::collection::vec(step, 1..200)
}

proptest! {
    /// The overspend bound when each estimate bounds its cost: however reservations and settles
    /// (repeated, late, after expiry) interleave, a fixed window never charges more than its
    /// limit — the settled costs charged in each window stay within `requests`.
    #[test]
    fn reservations_whose_estimate_bounds_the_cost_never_overspend(steps in reservation_steps()) {
        let per = 10_000_000;
        let limit = Limit::new(Algorithm::FixedWindow, 1000, per, None, None).unwrap().reserving(3_000_000).unwrap();
        let mut state: Option<State> = None;
        let mut now = T0;
        let mut holds: Vec<(u64, u64)> = Vec::new();
        let mut charged: std::collections::BTreeMap<Micros, u64> = Default::default();
        for (n, step) in steps.into_iter().enumerate() {
            match step {
                ReservationStep::Reserve { gap, estimate } => {
                    now += gap;
                    let hold = n as u64 + 1;
                    if check(&limit, state.as_ref(), now, estimate).allowed {
                        sluice::algorithm::apply_held(&limit, &mut state, now, estimate, hold);
                        holds.push((hold, estimate));
                    }
                }
                ReservationStep::Settle { gap, pick, share_percent } => {
                    now += gap;
                    if holds.is_empty() {
                        continue;
                    }
                    let (hold, estimate) = holds[pick % holds.len()];
                    let actual = estimate * share_percent / 100;
                    let (found, _) = sluice::algorithm::settle(&limit, &mut state, now, hold, actual);
                    if found {
                        *charged.entry(now / per).or_default() += actual;
                    }
                }
            }
            // used + reserved never passes the limit: a cost of 0 always fits.
            let reserved = sluice::algorithm::reservation::reserved(state.as_ref(), now);
            prop_assert!(check(&limit, state.as_ref(), now, 0).allowed, "over the limit at step {n}, {reserved} reserved");
        }
        for (window, total) in charged {
            prop_assert!(total <= 1000, "window {window} charged {total}");
        }
    }
}
