//! Token bucket with continuous refill, kept as credit in microseconds (one token is worth one
//! emission interval) so it shares GCRA's integer arithmetic and its exact decisions.

use super::{Decision, Limit, Micros, State};

#[derive(Clone, Copy)]
pub(super) struct Bucket {
    credit: Micros,
    updated: Micros,
}

pub(super) fn view(state: Option<&State>) -> Option<Bucket> {
    match state {
        Some(State::Bucket { credit, updated }) => Some(Bucket { credit: *credit, updated: *updated }),
        _ => None,
    }
}

/// Credit available at `now`; a clock behind `updated` refills nothing.
fn level(limit: &Limit, bucket: Option<Bucket>, now: Micros) -> Micros {
    let capacity = limit.burst * limit.interval;
    match bucket {
        None => capacity,
        Some(b) => b.credit.saturating_add(now.saturating_sub(b.updated)).min(capacity),
    }
}

pub(super) fn check(limit: &Limit, bucket: Option<Bucket>, now: Micros, cost: u64) -> Decision {
    let interval = limit.interval;
    let capacity = limit.burst * interval;
    let level = level(limit, bucket, now);
    if cost > limit.burst {
        return Decision {
            allowed: false,
            remaining: level / interval,
            reset_after: capacity - level,
            retry_after: None,
            delay: 0,
        };
    }
    let needed = cost * interval;
    if level >= needed {
        let left = level - needed;
        Decision {
            allowed: true,
            remaining: left / interval,
            reset_after: capacity - left,
            retry_after: None,
            delay: 0,
        }
    } else {
        Decision {
            allowed: false,
            remaining: level / interval,
            reset_after: capacity - level,
            retry_after: Some(needed - level),
            delay: 0,
        }
    }
}

pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let bucket = view(state.as_ref());
    let level = level(limit, bucket, now);
    let credit = level.saturating_sub(cost * limit.interval);
    let updated = bucket.map_or(now, |b| b.updated.max(now));
    *state = Some(State::Bucket { credit, updated });
    updated + (limit.burst * limit.interval - credit)
}
