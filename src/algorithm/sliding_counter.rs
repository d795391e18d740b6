//! Sliding window counter: estimate = previous × (per − elapsed) / per + current, admitted when
//! floor(estimate) + cost ≤ requests. The weight is computed in whole milliseconds so that
//! `previous × per_ms` stays an exact integer in every store.
//!
//! The state keeps the current window's start time (not its index, which an edit of `per` would
//! reinterpret), and counts are capped when read at the largest count whose `previous × per_ms`
//! stays exact (below 2^53, in every store, whatever `requests` is now). Validation keeps that cap
//! above `requests`, so a count over the limit — debt, from a settled cost above its estimate —
//! is still seen as over it: it refuses even a cost of 0 and is waited out as the window slides.

use super::{Decision, Limit, MAX_EXACT, Micros, State};
use crate::duration::MICROS_PER_MS;

#[derive(Clone, Copy)]
pub(super) struct Counts {
    start: Micros,
    previous: u64,
    current: u64,
}

pub(super) fn view(state: Option<&State>) -> Option<Counts> {
    match state {
        Some(State::Counter { start, previous, current }) => {
            Some(Counts { start: *start, previous: *previous as u64, current: *current as u64 })
        }
        _ => None,
    }
}

/// The counts as seen from `now`'s window (a clock behind the stored window stays in it).
fn roll(limit: &Limit, counts: Option<Counts>, now: Micros) -> Counts {
    let start = now - now % limit.per;
    let most = count_cap(limit);
    let capped = |n: u64| n.min(most);
    match counts {
        Some(c) if c.start >= start => {
            Counts { start: c.start, previous: capped(c.previous), current: capped(c.current) }
        }
        Some(c) if c.start + limit.per == start => Counts { start, previous: capped(c.current), current: 0 },
        _ => Counts { start, previous: 0, current: 0 },
    }
}

/// The largest count kept when read: `previous × per_ms` stays exact. At least `requests + 1`
/// ([`super::Limit::new`] checks it), so a count in debt stays above the limit.
fn count_cap(limit: &Limit) -> u64 {
    MAX_EXACT / (limit.per / MICROS_PER_MS)
}

/// floor(previous × (per − elapsed) / per) with per and elapsed in whole milliseconds.
fn weighted_previous(previous: u64, per_ms: u64, elapsed_ms: u64) -> u64 {
    previous * (per_ms - elapsed_ms.min(per_ms)) / per_ms
}

/// Smallest elapsed (ms) into a window at which floor(previous × (per − e) / per) ≤ allowance.
fn first_fit_ms(previous: u64, per_ms: u64, allowance: u64) -> u64 {
    if previous == 0 {
        return 0;
    }
    per_ms.saturating_sub(((allowance + 1) * per_ms - 1) / previous)
}

pub(super) fn check(limit: &Limit, counts: Option<Counts>, now: Micros, cost: u64) -> Decision {
    let c = roll(limit, counts, now);
    let per_ms = limit.per / MICROS_PER_MS;
    let start = c.start;
    let elapsed_ms = now.saturating_sub(start) / MICROS_PER_MS;
    let estimate = weighted_previous(c.previous, per_ms, elapsed_ms) + c.current;
    let pristine_at = |current: u64| pristine_at(limit, Counts { current, ..c }, now);
    if estimate + cost <= limit.requests {
        return Decision {
            allowed: true,
            remaining: limit.requests - estimate - cost,
            reset_after: pristine_at(c.current + cost).saturating_sub(now),
            retry_after: None,
            delay: 0,
        };
    }
    let retry_after = (cost <= limit.requests).then(|| {
        // This window, if the current count leaves room; else the next, whose previous count is
        // this window's current; else the one after, which starts empty.
        let this_window = (c.current + cost <= limit.requests)
            .then(|| first_fit_ms(c.previous, per_ms, limit.requests - c.current - cost))
            .filter(|&e| e < per_ms)
            .map(|e| start + e * MICROS_PER_MS);
        let next_window = || {
            let e = first_fit_ms(c.current, per_ms, limit.requests - cost);
            (e < per_ms).then(|| start + limit.per + e * MICROS_PER_MS)
        };
        this_window.or_else(next_window).unwrap_or(start + 2 * limit.per).saturating_sub(now)
    });
    Decision {
        allowed: false,
        remaining: limit.requests.saturating_sub(estimate),
        reset_after: pristine_at(c.current).saturating_sub(now),
        retry_after,
        delay: 0,
    }
}

pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let c = roll(limit, view(state.as_ref()), now);
    let current = c.current + cost;
    *state = Some(State::Counter {
        start: c.start,
        previous: c.previous as u32,
        current: current.min(u32::MAX as u64) as u32,
    });
    pristine_at(limit, Counts { current, ..c }, now)
}

/// When the counts no longer weigh on any estimate: the current count still counts (as the
/// previous one) until the end of the next window.
fn pristine_at(limit: &Limit, c: Counts, now: Micros) -> Micros {
    if c.current > 0 {
        c.start + 2 * limit.per
    } else if c.previous > 0 {
        c.start + limit.per
    } else {
        now
    }
}
