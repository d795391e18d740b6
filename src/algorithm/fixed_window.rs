//! Fixed window: windows aligned to multiples of `per` since the Unix epoch.
//!
//! The state keeps the window's start time rather than its index, so editing `per` can never
//! reinterpret an old index as a window far in the future: a stored window that is not the
//! current one (and not ahead of it, which a stepped-back clock or a lengthened `per` produce)
//! is simply over.

use super::{Decision, Limit, MAX_EXACT, Micros, State};

pub(super) fn view(state: Option<&State>) -> Option<(Micros, u64)> {
    match state {
        Some(State::Window { start, count }) => Some((*start, *count)),
        _ => None,
    }
}

/// The window in force (its start) and its count; a clock behind the stored window stays in it.
fn current(limit: &Limit, window: Option<(Micros, u64)>, now: Micros) -> (Micros, u64) {
    let start = now - now % limit.per;
    match window {
        Some((stored, count)) if stored >= start => (stored, count),
        _ => (start, 0),
    }
}

pub(super) fn check(limit: &Limit, window: Option<(Micros, u64)>, now: Micros, cost: u64) -> Decision {
    let (start, count) = current(limit, window, now);
    let reset_after = (start + limit.per).saturating_sub(now);
    // Saturating: a stored count is at most MAX_EXACT and a cost at most MAX_COST, but a sum
    // that wrapped would read as an empty window.
    if count.saturating_add(cost) <= limit.requests {
        Decision { allowed: true, remaining: limit.requests - count - cost, reset_after, retry_after: None, delay: 0 }
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

/// Adds `cost` to the window's count, which saturates at [`MAX_EXACT`]: debt past that is still
/// far past any limit, and Redis keeps the same number exactly.
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let (start, count) = current(limit, view(state.as_ref()), now);
    *state = Some(State::Window { start, count: count.saturating_add(cost).min(MAX_EXACT) });
    start + limit.per
}
