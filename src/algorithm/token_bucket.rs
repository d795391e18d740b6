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
    // Nothing refills before `updated`: a debt (a settled cost above its reservation) or a clock
    // behind the last write.
    let waiting = bucket.map_or(0, |b| b.updated.saturating_sub(now));
    if cost > limit.burst {
        return Decision {
            allowed: false,
            remaining: level / interval,
            reset_after: capacity - level + waiting,
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
            reset_after: capacity - left + waiting,
            retry_after: None,
            delay: 0,
        }
    } else {
        Decision {
            allowed: false,
            remaining: level / interval,
            reset_after: capacity - level + waiting,
            retry_after: Some(needed - level + waiting),
            delay: 0,
        }
    }
}

/// Takes `cost` tokens. More than the bucket holds (a settled cost above its reservation) is debt:
/// `updated` moves past `now` by the shortfall, and nothing refills until the clock passes it.
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let bucket = view(state.as_ref());
    let level = level(limit, bucket, now);
    let needed = cost.saturating_mul(limit.interval);
    let updated = bucket.map_or(now, |b| b.updated.max(now));
    let (credit, updated) =
        if level >= needed { (level - needed, updated) } else { (0, updated.saturating_add(needed - level)) };
    *state = Some(State::Bucket { credit, updated });
    updated + (limit.burst * limit.interval - credit)
}
