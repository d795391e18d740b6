//! Token bucket with continuous refill, kept as credit in microseconds (one token is worth one
//! emission interval) so it shares GCRA's integer arithmetic and its exact decisions.

use super::{Decision, Limit, MAX_EXACT, Micros, State};

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
    // A bucket in debt (empty, and nothing refills before `updated`) refuses even a cost of 0:
    // the admission of a cost charged after the response (`reportAfter`) must wait the debt out
    // like any other request. An empty bucket out of debt still admits a cost of 0.
    let in_debt = level == 0 && waiting > 0;
    if level >= needed && !in_debt {
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
/// A debt saturates at [`MAX_EXACT`] µs since the epoch (the year 2255), where Redis keeps the
/// same number exactly: never a time that wraps round to a fresh bucket.
pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    let bucket = view(state.as_ref());
    let level = level(limit, bucket, now);
    let needed = cost.saturating_mul(limit.interval);
    let updated = bucket.map_or(now, |b| b.updated.max(now));
    let (credit, updated) = if level >= needed {
        (level - needed, updated)
    } else {
        (0, updated.saturating_add(needed - level).min(MAX_EXACT.max(updated)))
    };
    *state = Some(State::Bucket { credit, updated });
    updated + (limit.burst * limit.interval - credit)
}
