//! GCRA and the leaky bucket: one theoretical arrival time (TAT) per key.
//!
//! With emission interval T and capacity B: `new_tat = max(tat, now) + cost·T`, admitted when
//! `new_tat − now ≤ B·T`. The leaky bucket polices with exactly that rule; with `maxDelay` it
//! shapes instead: the request leaves at `max(tat, now)` (the caller waits `max(tat, now) − now`)
//! and is refused when that wait exceeds `maxDelay` or the queue of B is full.

use super::{Algorithm, Decision, Limit, MAX_EXACT, Micros, State};

pub(super) fn view(state: Option<&State>) -> Option<Micros> {
    match state {
        Some(State::Tat(tat)) => Some(*tat),
        _ => None,
    }
}

pub(super) fn check(limit: &Limit, tat: Option<Micros>, now: Micros, cost: u64) -> Decision {
    let interval = limit.interval;
    let capacity = limit.burst * interval;
    let base = tat.unwrap_or(now).max(now);
    let backlog = base - now;
    let free_now = capacity.saturating_sub(backlog) / interval;
    if cost > limit.burst {
        return Decision { allowed: false, remaining: free_now, reset_after: backlog, retry_after: None, delay: 0 };
    }
    let new_tat = base + cost * interval;
    let fits = new_tat - now <= capacity;
    let shaping_delay = match (limit.algorithm, limit.max_delay) {
        (Algorithm::LeakyBucket, Some(max_delay)) => Some((backlog, max_delay)),
        _ => None,
    };
    let within_delay = shaping_delay.is_none_or(|(wait, max_delay)| wait <= max_delay);
    if fits && within_delay {
        Decision {
            allowed: true,
            remaining: (capacity - (new_tat - now)) / interval,
            reset_after: new_tat - now,
            retry_after: None,
            delay: shaping_delay.map_or(0, |(wait, _)| wait),
        }
    } else {
        let until_fits = (new_tat - now).saturating_sub(capacity);
        let until_short_wait = shaping_delay.map_or(0, |(wait, max_delay)| wait.saturating_sub(max_delay));
        Decision {
            allowed: false,
            remaining: free_now,
            reset_after: backlog,
            retry_after: Some(until_fits.max(until_short_wait)),
            delay: 0,
        }
    }
}

/// Moves the TAT by `cost` intervals. A settled cost far above the limit (debt) saturates the
/// TAT at [`MAX_EXACT`] µs since the epoch (the year 2255), which Redis keeps exactly.
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let base = view(state.as_ref()).unwrap_or(now).max(now);
    let new_tat = base.saturating_add(cost.saturating_mul(limit.interval)).min(MAX_EXACT.max(base));
    *state = Some(State::Tat(new_tat));
    new_tat
}

/// Gives back the slot a shaped request took, when it never departed (its caller went away
/// while it waited): `until` is the TAT its admission set, `cost` what it took. Only the last
/// slot taken can go back exactly (the TAT still equals `until` and its departure, `until −
/// cost·T`, is still ahead): the TAT steps back by `cost·T`, and the next request gets that
/// departure. A slot with later ones behind it stays taken: moving the TAT back would hand a
/// later caller a departure already promised to another, and the downstream would see two at
/// once. So a cancelled wait never lets the downstream see more than the rate; a cancelled
/// wait in the middle of the queue leaves a gap. Returns whether the slot went back.
pub(super) fn give_back(limit: &Limit, state: &mut Option<State>, now: Micros, until: Micros, cost: u64) -> bool {
    let Some(tat) = view(state.as_ref()) else { return false };
    let departure = until.saturating_sub(cost.saturating_mul(limit.interval));
    if tat != until || departure <= now {
        return false;
    }
    *state = Some(State::Tat(departure));
    true
}
