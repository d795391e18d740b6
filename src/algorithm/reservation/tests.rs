use super::*;
use crate::algorithm::{Algorithm, apply_held, check, settle as settle_any, settle_unreserved};

const T0: Micros = 1_699_920_000_000_000;
const SEC: Micros = 1_000_000;

fn limit(algorithm: Algorithm, requests: u64) -> Limit {
    Limit::new(algorithm, requests, 60 * SEC, None, None).unwrap().reserving(30 * SEC).unwrap()
}

fn reserve(l: &Limit, state: &mut Option<State>, now: Micros, estimate: u64, hold: HoldId) -> Decision {
    let decision = check(l, state.as_ref(), now, estimate);
    if decision.allowed {
        apply_held(l, state, now, estimate, hold);
    }
    decision
}

const RATE: [Algorithm; 4] =
    [Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindowCounter];

#[test]
fn reservations_count_against_the_limit_until_settled() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        assert!(reserve(&l, &mut state, T0, 400, 1).allowed, "{algorithm}");
        assert!(reserve(&l, &mut state, T0, 400, 2).allowed, "{algorithm}");
        let third = reserve(&l, &mut state, T0, 400, 3);
        assert!(!third.allowed, "{algorithm}: 800 reserved + 400 > 1000");
        assert_eq!(third.remaining, 200, "{algorithm}");
        // Settling below the estimate gives the difference back at once.
        assert!(settle_any(&l, &mut state, T0, 1, 100).0);
        assert!(reserve(&l, &mut state, T0, 400, 3).allowed, "{algorithm}: 100 + 400 + 400 fits");
        assert_eq!(reserved(state.as_ref(), T0), 800);
    }
}

#[test]
fn settling_is_idempotent_and_never_touches_another_reservation() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        reserve(&l, &mut state, T0, 500, 1);
        reserve(&l, &mut state, T0, 300, 2);
        assert!(settle_any(&l, &mut state, T0, 1, 200).0);
        assert!(!settle_any(&l, &mut state, T0, 1, 200).0, "{algorithm}: a second settle charges nothing");
        assert!(!settle_any(&l, &mut state, T0, 9, 900).0, "{algorithm}: no such hold");
        assert_eq!(reserved(state.as_ref(), T0), 300);
        let d = check(&l, state.as_ref(), T0, 0);
        assert_eq!(d.remaining, 1000 - 200 - 300, "{algorithm}");
    }
}

#[test]
fn a_cost_above_its_estimate_is_debt() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        reserve(&l, &mut state, T0, 100, 1);
        settle_any(&l, &mut state, T0, 1, 1500);
        let d = check(&l, state.as_ref(), T0, 1);
        assert!(!d.allowed, "{algorithm}: 1500 used of 1000");
        assert!(d.retry_after.is_some(), "{algorithm}: the debt is paid off in time");
    }
}

#[test]
fn an_unsettled_reservation_runs_out_and_its_late_settle_charges_nothing() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        reserve(&l, &mut state, T0, 1000, 1);
        let denied = reserve(&l, &mut state, T0 + 10 * SEC, 1, 2);
        assert!(!denied.allowed, "{algorithm}");
        assert_eq!(denied.retry_after, Some(20 * SEC), "{algorithm}: when the reservation runs out (within per)");
        assert!(reserve(&l, &mut state, T0 + 30 * SEC, 1, 2).allowed, "{algorithm}: the reservation ran out");
        assert!(!settle_any(&l, &mut state, T0 + 31 * SEC, 1, 1000).0, "{algorithm}");
        assert_eq!(check(&l, state.as_ref(), T0 + 31 * SEC, 0).remaining, 999, "{algorithm}");
    }
}

/// `reportAfter` admits at cost 0 and charges after the response: a key whose settled
/// costs went past its limit must refuse those admissions until the debt is waited out, on
/// every algorithm that can be in debt (issue 38, item 1).
#[test]
fn a_key_in_debt_refuses_a_cost_of_zero() {
    for algorithm in [Algorithm::LeakyBucket].into_iter().chain(RATE) {
        let l = limit(algorithm, 10_000);
        let mut state = None;
        for (n, hold) in [1, 3, 5].into_iter().enumerate() {
            let admission = reserve(&l, &mut state, T0, 0, hold);
            assert_eq!(admission.allowed, n < 2, "{algorithm}: admission {n} after {} settled", n * 9000);
            if admission.allowed {
                assert!(settle_unreserved(&l, &mut state, T0, hold, 9000).0, "{algorithm}");
            }
        }
        let refused = check(&l, state.as_ref(), T0, 0);
        assert_eq!((refused.allowed, refused.remaining), (false, 0), "{algorithm}: 18000 charged of 10000");
        let wait = refused.retry_after.expect("a debt is waited out");
        assert!(wait > 0 && wait <= 120 * SEC, "{algorithm}: {wait}");
        assert!(check(&l, state.as_ref(), T0 + wait, 0).allowed, "{algorithm}: the debt is paid at {wait}");
    }
}

/// An empty key out of debt (exactly spent) still admits a cost of 0, as it always did.
#[test]
fn an_exactly_spent_key_admits_a_cost_of_zero() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        reserve(&l, &mut state, T0, 0, 1);
        settle_unreserved(&l, &mut state, T0, 1, 1000);
        let d = check(&l, state.as_ref(), T0, 0);
        assert_eq!((d.allowed, d.remaining), (true, 0), "{algorithm}");
        assert!(!check(&l, state.as_ref(), T0, 1).allowed, "{algorithm}");
    }
}

/// A reservation of 0 takes nothing, so it holds nothing: no hold stays on the key for the
/// ttl (issue 37, item 8). Its settle, told the reservation was 0, charges the actual cost.
#[test]
fn a_reservation_of_zero_holds_nothing_and_its_settle_charges() {
    for algorithm in RATE {
        let l = limit(algorithm, 1000);
        let mut state = None;
        for hold in 1..=500 {
            assert!(reserve(&l, &mut state, T0, 0, hold).allowed, "{algorithm}");
        }
        assert!(!matches!(state, Some(State::Reserved(_))), "{algorithm}: {state:?}");
        assert!(settle_unreserved(&l, &mut state, T0, 7, 300).0, "{algorithm}");
        assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 700, "{algorithm}");
        // Beside a live reservation of another request, which it leaves alone.
        reserve(&l, &mut state, T0, 200, 9);
        settle_unreserved(&l, &mut state, T0, 8, 100);
        assert_eq!(reserved(state.as_ref(), T0), 200, "{algorithm}");
        assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 400, "{algorithm}");
    }
}

/// An estimate or a cost past any count (an edited lease token: 2^64 − 100) is taken as
/// MAX_COST: the counts saturate, never wrap round to a fresh window (issue 37, items 9–10).
#[test]
fn a_settle_with_a_huge_cost_never_resets_a_spent_limit() {
    for algorithm in [Algorithm::LeakyBucket].into_iter().chain(RATE) {
        let l = limit(algorithm, 10);
        let mut state = None;
        for hold in 1..=10 {
            assert!(reserve(&l, &mut state, T0, 1, hold).allowed, "{algorithm}");
            settle_any(&l, &mut state, T0, hold, 1);
        }
        for hold in [11, 12, 13] {
            let mut probe = state.clone();
            apply_held(&l, &mut probe, T0, u64::MAX - 100, hold);
            settle_any(&l, &mut state, T0, hold, u64::MAX - 100);
            settle_unreserved(&l, &mut state, T0, hold, u64::MAX - 100);
        }
        let admitted = (0..30).filter(|_| crate::algorithm::decide(&l, &mut state, T0 + SEC, 1).allowed).count();
        assert_eq!(admitted, 0, "{algorithm}: {state:?}");
        assert!(!check(&l, state.as_ref(), T0 + SEC, 0).allowed, "{algorithm}: deep in debt");
        assert!(!check(&l, state.as_ref(), T0 + SEC, u64::MAX).allowed, "{algorithm}");
    }
}

/// Past MAX_RESERVATIONS live reservations on one key, admissions are charged at once: the
/// key's holds stay bounded, and nothing is admitted past the limit.
#[test]
fn reservations_per_key_are_bounded() {
    for algorithm in RATE {
        let l = limit(algorithm, 100_000);
        let mut state = None;
        let extra = 100;
        for hold in 1..=(MAX_RESERVATIONS as u64 + extra) {
            assert!(reserve(&l, &mut state, T0, 1, hold).allowed, "{algorithm}");
        }
        assert_eq!(reserved(state.as_ref(), T0), MAX_RESERVATIONS as u64, "{algorithm}");
        let total = MAX_RESERVATIONS as u64 + extra;
        assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 100_000 - total, "{algorithm}: all counted");
        assert!(!settle_any(&l, &mut state, T0, total, 1).0, "{algorithm}: charged at admission");
        // A settle makes room for one more hold.
        assert!(settle_any(&l, &mut state, T0, 1, 1).0, "{algorithm}");
        reserve(&l, &mut state, T0, 1, total + 1);
        assert!(settle_any(&l, &mut state, T0, total + 1, 1).0, "{algorithm}: held again");
    }
}

#[test]
fn hold_zero_consumes_at_once() {
    let l = limit(Algorithm::FixedWindow, 1000);
    let mut state = None;
    assert!(check(&l, state.as_ref(), T0, 600).allowed);
    apply_held(&l, &mut state, T0, 600, 0);
    assert_eq!(reserved(state.as_ref(), T0), 0);
    assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 400);
    assert!(matches!(state, Some(State::Window { .. })), "no reservation is kept");
}

#[test]
fn the_last_settle_leaves_the_plain_state_and_a_pristine_key_goes() {
    let l = limit(Algorithm::FixedWindow, 1000);
    let mut state = None;
    reserve(&l, &mut state, T0, 10, 1);
    assert!(matches!(state, Some(State::Reserved(_))));
    let (found, pristine) = settle_any(&l, &mut state, T0 + SEC, 1, 7);
    assert!(found);
    assert_eq!(state, Some(State::Window { start: T0, count: 7 }));
    assert_eq!(pristine, Some(T0 + 60 * SEC));
    let mut state = None;
    reserve(&l, &mut state, T0, 10, 1);
    assert_eq!(settle_any(&l, &mut state, T0 + SEC, 1, 0), (true, None), "nothing counted, nothing held");
    assert_eq!(state, None);
}

#[test]
fn algorithms_that_cannot_reserve_are_named() {
    let s = SEC;
    let log = Limit::new(Algorithm::SlidingWindowLog, 10, s, None, None).unwrap();
    assert!(log.reserving(s).unwrap_err().to_string().contains("slidingWindowLog"));
    let shaping = Limit::new(Algorithm::LeakyBucket, 10, s, None, Some(s)).unwrap();
    assert!(shaping.reserving(s).unwrap_err().to_string().contains("maxDelay"));
    let ok = Limit::new(Algorithm::TokenBucket, 10, s, None, None).unwrap();
    assert!(ok.clone().reserving(s / 2).is_err());
    assert!(ok.reserving(s).unwrap().holds());
}
