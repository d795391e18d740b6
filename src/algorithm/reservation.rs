//! Reservations: costs known only after the response (an LLM's tokens), held as an estimate at
//! admission and settled to the actual cost when the response ends.
//!
//! The second use of the stores' holds (after [`super::concurrency`]'s slots): capacity taken now
//! under the request's hold id and settled later. A key's state is its algorithm's own state
//! (what settled costs consumed) plus the live reservations, each `(hold id, until, amount)`.
//!
//! - **Admission** of `estimate` is the algorithm's decision for `reserved + estimate`, where
//!   `reserved` is the sum of live reservations: admitted only if `used + reserved + estimate`
//!   fits. An admitted request adds its reservation and consumes nothing yet; a denied one
//!   reserves nothing.
//! - **Settling** removes the reservation and consumes the `actual` cost from the algorithm's
//!   state, even past the limit: a cost above its estimate is debt that later requests wait out.
//!   Since `used + reserved` only grows by `actual − estimate` at a settle, the limit is exceeded
//!   at most by the sum of `actual − estimate` over the reservations settled above their
//!   estimate (none when the estimate bounds the cost). Idempotent: a reservation already
//!   settled, or run out, is left alone.
//! - **Expiry**: a reservation unsettled `ttl` after admission counts no more: its capacity
//!   returns, and a settle arriving later charges nothing.
//!
//! A request with hold id 0 (an entry point that never sees the response end) consumes its cost
//! at once, as a plain rate limit.

use super::{Decision, Hold, HoldId, Limit, Micros, State};

/// A rate algorithm's state and the reservations held against it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reserved {
    /// What settled (or up-front) costs consumed; `None`: pristine.
    pub counted: Option<State>,
    /// Reservations not yet settled; some may have run out (dropped at the next write).
    pub holds: Vec<Hold>,
}

/// The algorithm's own state, whether or not reservations are held against it.
pub(super) fn counted(state: Option<&State>) -> Option<&State> {
    match state {
        Some(State::Reserved(r)) => r.counted.as_ref(),
        other => other,
    }
}

fn holds(state: Option<&State>) -> &[Hold] {
    match state {
        Some(State::Reserved(r)) => &r.holds,
        _ => &[],
    }
}

fn live(holds: &[Hold], now: Micros) -> impl Iterator<Item = &Hold> {
    holds.iter().filter(move |h| h.until > now)
}

/// The estimate reserved by live reservations at `now`.
pub fn reserved(state: Option<&State>, now: Micros) -> u64 {
    live(holds(state), now).fold(0u64, |sum, h| sum.saturating_add(h.amount))
}

pub(super) fn check(limit: &Limit, state: Option<&State>, now: Micros, estimate: u64) -> Decision {
    let counted = counted(state);
    let reserved = reserved(state, now);
    let wanted = super::check_counted(limit, counted, now, reserved.saturating_add(estimate));
    if wanted.allowed || reserved == 0 {
        return wanted;
    }
    // What is left once the reservations are taken. When the estimate cannot fit beside them,
    // its wait depends on when they settle, which nothing here knows: the answer is when the
    // last one runs out, but at most one period (reservations settle long before their ttl),
    // plus whatever the counted state alone still needs then.
    let left = super::check_counted(limit, counted, now, reserved);
    let retry_after = wanted.retry_after.or_else(|| {
        let last = live(holds(state), now).map(|h| h.until).max()?;
        let wait = (last - now).min(limit.per());
        let later = super::check_counted(limit, counted, now + wait, estimate);
        (estimate <= limit.capacity()).then(|| wait + later.retry_after.unwrap_or(0))
    });
    Decision {
        allowed: false,
        remaining: if left.allowed { left.remaining } else { 0 },
        reset_after: wanted.reset_after,
        retry_after,
        delay: 0,
    }
}

/// When the counted state is pristine again (`now` for none).
fn counted_pristine_at(limit: &Limit, counted: &Option<State>, now: Micros) -> Micros {
    match counted {
        None => now,
        // Consuming nothing computes the state's pristine time without changing its meaning.
        Some(state) => super::apply_counted(limit, &mut Some(state.clone()), now, 0, 0),
    }
}

/// Puts `counted` and `holds` back into `state`: the plain algorithm state when no reservation
/// is left. Returns when the key is pristine.
fn store(limit: &Limit, state: &mut Option<State>, counted: Option<State>, holds: Vec<Hold>, now: Micros) -> Micros {
    let pristine = counted_pristine_at(limit, &counted, now).max(holds.iter().map(|h| h.until).max().unwrap_or(now));
    *state = if holds.is_empty() { counted } else { Some(State::Reserved(Box::new(Reserved { counted, holds }))) };
    pristine
}

fn take(state: &mut Option<State>) -> (Option<State>, Vec<Hold>) {
    match state.take() {
        Some(State::Reserved(r)) => (r.counted, r.holds),
        other => (other, Vec::new()),
    }
}

/// Admits `estimate` under `hold` (a reservation for the limit's ttl); with hold 0, consumes it
/// at once. A reservation of 0 holds nothing: it would take no capacity, yet each would stay on
/// the key for the whole ttl (a `reportAfter` rule reserves 0 on every admission); its settle
/// charges the actual cost without one ([`charge`]). Returns when the key is pristine again.
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, estimate: u64, hold: HoldId) -> Micros {
    match limit.reservation_ttl() {
        Some(ttl) if hold != 0 && estimate > 0 && !full(state.as_ref(), now, hold) => {
            hold_units(limit, state, now, Hold { id: hold, until: now.saturating_add(ttl), amount: estimate })
        }
        _ => {
            let (mut counted, mut holds) = take(state);
            holds.retain(|h| h.until > now);
            super::apply_counted(limit, &mut counted, now, estimate, 0);
            store(limit, state, counted, holds, now)
        }
    }
}

/// The most live reservations one key keeps. Every decision on the key reads them all (Redis
/// reads the whole hash), so a tenant leaving many small reservations unsettled would slow the
/// store for everyone: past this many, an admission is charged its estimate at once, as without
/// a hold id, and its settle finds nothing to replace (the request costs its estimate). Redis
/// keeps the same bound in its reservation script, which mirrors this one.
pub const MAX_RESERVATIONS: usize = 1024;

/// Whether the key has [`MAX_RESERVATIONS`] live holds, none of them `hold`'s (a second
/// reservation under one id adds to the first and takes no more room).
fn full(state: Option<&State>, now: Micros, hold: HoldId) -> bool {
    let holds = holds(state);
    live(holds, now).count() >= MAX_RESERVATIONS && !live(holds, now).any(|h| h.id == hold)
}

/// Adds `new` to the key's holds (a second hold under one id adds its amount to the first,
/// keeping the first's end), dropping those that ran out. Returns when the key is pristine.
pub(super) fn hold_units(limit: &Limit, state: &mut Option<State>, now: Micros, new: Hold) -> Micros {
    let (counted, mut holds) = take(state);
    holds.retain(|h| h.until > now);
    match holds.iter_mut().find(|h| h.id == new.id) {
        Some(held) => held.amount = held.amount.saturating_add(new.amount).min(super::MAX_COST),
        None => holds.push(Hold { amount: new.amount.min(super::MAX_COST), ..new }),
    }
    store(limit, state, counted, holds, now)
}

/// Charges `actual` for a reservation of nothing under `hold` (see [`super::settle_unreserved`]):
/// consumed at once, even past the limit, and a hold of that id (left by an older version,
/// which held reservations of 0) is dropped with the holds that ran out. Returns `true` (the
/// charge is made) and when the key is pristine again (`None`: nothing is left).
pub(super) fn charge(
    limit: &Limit,
    state: &mut Option<State>,
    now: Micros,
    hold: HoldId,
    actual: u64,
) -> (bool, Option<Micros>) {
    let (mut counted, mut holds) = take(state);
    holds.retain(|h| h.id != hold && h.until > now);
    if actual > 0 {
        super::apply_counted(limit, &mut counted, now, actual, 0);
    }
    let pristine = store(limit, state, counted, holds, now);
    (true, state.is_some().then_some(pristine))
}

/// Replaces `hold`'s live reservation by its `actual` cost. Returns whether it was found, and
/// when the key is pristine again (`None`: nothing is left, the key can go).
pub(super) fn settle(
    limit: &Limit,
    state: &mut Option<State>,
    now: Micros,
    hold: HoldId,
    actual: u64,
) -> (bool, Option<Micros>) {
    let (mut counted, mut holds) = take(state);
    let found = holds.iter().any(|h| h.id == hold && h.until > now);
    holds.retain(|h| h.id != hold && h.until > now);
    if found && actual > 0 {
        super::apply_counted(limit, &mut counted, now, actual, 0);
    }
    let pristine = store(limit, state, counted, holds, now);
    (found, state.is_some().then_some(pristine))
}

#[cfg(test)]
mod tests;
