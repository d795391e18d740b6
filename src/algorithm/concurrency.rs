//! Concurrency: at most `requests` requests *in progress* per key, each holding one slot from
//! its admission until it is released or its lease (`per`) runs out, whichever comes first.
//!
//! This is the first use of the stores' holds: capacity taken now under a hold id and settled
//! later ([`release`]). A request holds at most one slot per key, whatever its cost (a cost of 0
//! asks without holding); its hold id is the request's, chosen by whoever admits it. A lease
//! that runs out frees its slot by itself, so a holder that crashed cannot keep a slot longer
//! than `per`. Releasing is idempotent and never frees another request's slot.
//!
//! Decision fields: `remaining` is the slots still free; `reset_after` the time until the
//! latest live lease runs out (the key is pristine then); `retry_after` is always `None` on a
//! denial — a slot frees when a request ends, which nothing here can predict.

use super::{Decision, Hold, HoldId, Limit, Micros, State};

pub(super) fn view(state: Option<&State>) -> &[Hold] {
    match state {
        Some(State::Holds(holds)) => holds,
        _ => &[],
    }
}

fn live(holds: &[Hold], now: Micros) -> impl Iterator<Item = &Hold> {
    holds.iter().filter(move |h| h.until > now)
}

pub(super) fn check(limit: &Limit, holds: &[Hold], now: Micros, cost: u64) -> Decision {
    let used = live(holds, now).count() as u64;
    let latest = live(holds, now).map(|h| h.until).max();
    let wanted = u64::from(cost > 0);
    if used + wanted <= limit.requests {
        let reset_at = if wanted > 0 { now + limit.per } else { latest.unwrap_or(now) };
        return Decision {
            allowed: true,
            remaining: limit.requests - used - wanted,
            reset_after: reset_at.max(latest.unwrap_or(now)) - now,
            retry_after: None,
            delay: 0,
        };
    }
    Decision {
        allowed: false,
        remaining: limit.requests.saturating_sub(used),
        reset_after: latest.map_or(0, |at| at - now),
        retry_after: None,
        delay: 0,
    }
}

/// Takes a slot for `hold` (cost > 0), dropping the leases that ran out; returns when the state
/// is pristine again (its latest lease's end).
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64, hold: HoldId) -> Micros {
    let mut holds = match state.take() {
        Some(State::Holds(holds)) => holds,
        _ => Box::default(),
    };
    holds.retain(|h| h.until > now);
    // Hold 0 is no hold: nothing to release it by, so nothing is taken (as in the script).
    if cost > 0 && hold != 0 {
        let until = now + limit.per;
        match holds.iter_mut().find(|h| h.id == hold) {
            Some(held) => held.until = held.until.max(until),
            None => holds.push(Hold { id: hold, until, amount: 1 }),
        }
    }
    let pristine_at = holds.iter().map(|h| h.until).max().unwrap_or(now);
    if !holds.is_empty() {
        *state = Some(State::Holds(holds));
    }
    pristine_at
}

/// Gives back `hold`'s slot, if it still holds one; returns when the state is pristine again
/// (`None`: no live lease is left, the key can go).
pub fn release(state: &mut Option<State>, hold: HoldId, now: Micros) -> Option<Micros> {
    let Some(State::Holds(holds)) = state else { return None };
    holds.retain(|h| h.id != hold && h.until > now);
    let pristine_at = holds.iter().map(|h| h.until).max();
    if pristine_at.is_none() {
        *state = None;
    }
    pristine_at
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    const T0: Micros = 1_700_000_000_000_000;
    const SEC: Micros = 1_000_000;

    fn limit(requests: u64) -> Limit {
        Limit::new(Algorithm::Concurrency, requests, 30 * SEC, None, None).unwrap()
    }

    fn take(l: &Limit, state: &mut Option<State>, now: Micros, hold: HoldId) -> Decision {
        let decision = check(l, view(state.as_ref()), now, 1);
        if decision.allowed {
            apply(l, state, now, 1, hold);
        }
        decision
    }

    #[test]
    fn holds_at_most_the_limit_in_flight_and_frees_on_release() {
        let l = limit(2);
        let mut state = None;
        assert!(take(&l, &mut state, T0, 1).allowed);
        assert!(take(&l, &mut state, T0, 2).allowed);
        let third = take(&l, &mut state, T0, 3);
        assert!(!third.allowed);
        assert_eq!((third.remaining, third.retry_after), (0, None));
        assert_eq!(release(&mut state, 1, T0 + 1), Some(T0 + 30 * SEC));
        assert!(take(&l, &mut state, T0 + 2, 3).allowed, "a released slot is free again");
    }

    #[test]
    fn release_is_idempotent_and_never_frees_another_slot() {
        let l = limit(2);
        let mut state = None;
        assert!(take(&l, &mut state, T0, 1).allowed);
        assert!(take(&l, &mut state, T0, 2).allowed);
        release(&mut state, 1, T0);
        release(&mut state, 1, T0);
        release(&mut state, 99, T0);
        assert_eq!(view(state.as_ref()).len(), 1, "only hold 2 is left");
        assert!(take(&l, &mut state, T0, 3).allowed);
        assert!(!take(&l, &mut state, T0, 4).allowed, "two in flight: 2 and 3");
        assert_eq!(release(&mut state, 2, T0), Some(T0 + 30 * SEC));
        assert_eq!(release(&mut state, 3, T0), None, "nothing left: the key can go");
        assert_eq!(state, None);
    }

    #[test]
    fn a_lease_runs_out_by_itself() {
        let l = limit(1);
        let mut state = None;
        assert!(take(&l, &mut state, T0, 1).allowed);
        assert!(!take(&l, &mut state, T0 + 30 * SEC - 1, 2).allowed);
        assert!(take(&l, &mut state, T0 + 30 * SEC, 2).allowed, "the crashed holder's lease ended");
    }

    #[test]
    fn cost_zero_asks_without_holding() {
        let l = limit(1);
        let mut state = None;
        let peek = check(&l, view(state.as_ref()), T0, 0);
        assert!(peek.allowed);
        assert_eq!(apply(&l, &mut state, T0, 0, 7), T0);
        assert_eq!(state, None);
    }
}
