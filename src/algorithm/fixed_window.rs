//! Fixed window: windows aligned to multiples of `per` since the Unix epoch.

use super::{Decision, Limit, Micros, State};

pub(super) fn view(state: Option<&State>) -> Option<(u64, u64)> {
    match state {
        Some(State::Window { index, count }) => Some((*index, *count)),
        _ => None,
    }
}

/// The window in force and its count; a clock behind the stored window stays in that window.
fn current(limit: &Limit, window: Option<(u64, u64)>, now: Micros) -> (u64, u64) {
    let index = now / limit.per;
    match window {
        Some((stored, count)) if stored >= index => (stored, count),
        _ => (index, 0),
    }
}

pub(super) fn check(limit: &Limit, window: Option<(u64, u64)>, now: Micros, cost: u64) -> Decision {
    let (index, count) = current(limit, window, now);
    let reset_after = ((index + 1) * limit.per).saturating_sub(now);
    if count + cost <= limit.requests {
        Decision {
            allowed: true,
            remaining: limit.requests - count - cost,
            reset_after,
            retry_after: None,
            delay: 0,
        }
    } else {
        Decision {
            allowed: false,
            remaining: limit.requests.saturating_sub(count),
            reset_after,
            retry_after: (cost <= limit.requests).then_some(reset_after),
            delay: 0,
        }
    }
}

pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let (index, count) = current(limit, view(state.as_ref()), now);
    *state = Some(State::Window { index, count: count + cost });
    (index + 1) * limit.per
}
