//! Sliding window log: the admitted requests of the trailing `per`, exact.
//!
//! An entry admitted at `at` counts while `now < at + per`. Entries admitted at the same
//! microsecond are merged, so memory is at most one entry per admitted request.

use std::collections::VecDeque;

use super::{Decision, Limit, LogEntry, Micros, State};

pub(super) fn view(state: Option<&State>) -> Option<&VecDeque<LogEntry>> {
    match state {
        Some(State::Log(entries)) => Some(entries),
        _ => None,
    }
}

/// A clock behind the newest entry counts as the newest entry's time.
fn effective_now(log: Option<&VecDeque<LogEntry>>, now: Micros) -> Micros {
    log.and_then(|l| l.back()).map_or(now, |newest| newest.at.max(now))
}

pub(super) fn check(limit: &Limit, log: Option<&VecDeque<LogEntry>>, now: Micros, cost: u64) -> Decision {
    let now_eff = effective_now(log, now);
    let live = || log.into_iter().flatten().filter(|e| e.at + limit.per > now_eff);
    let used: u64 = live().map(|e| e.cost).sum();
    let newest_expiry = live().next_back().map_or(now, |e| e.at + limit.per);
    if used + cost <= limit.requests {
        let reset_at = if cost > 0 { now_eff + limit.per } else { newest_expiry };
        return Decision {
            allowed: true,
            remaining: limit.requests - used - cost,
            reset_after: reset_at - now,
            retry_after: None,
            delay: 0,
        };
    }
    let retry_after = if cost > limit.requests {
        None
    } else {
        // Walk out the oldest entries until the request fits.
        let mut still_used = used;
        live()
            .find(|e| {
                still_used -= e.cost;
                still_used + cost <= limit.requests
            })
            .map(|e| e.at + limit.per - now)
    };
    Decision {
        allowed: false,
        remaining: limit.requests.saturating_sub(used),
        reset_after: newest_expiry - now,
        retry_after,
        delay: 0,
    }
}

pub(super) fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    if !matches!(state, Some(State::Log(_))) {
        *state = Some(State::Log(Box::default()));
    }
    let Some(State::Log(log)) = state else { unreachable!("just set to a log") };
    let now_eff = effective_now(Some(log), now);
    while log.front().is_some_and(|e| e.at + limit.per <= now_eff) {
        log.pop_front();
    }
    if cost > 0 {
        match log.back_mut() {
            Some(newest) if newest.at == now_eff => newest.cost += cost,
            _ => log.push_back(LogEntry { at: now_eff, cost }),
        }
    }
    log.back().map_or(now_eff, |newest| newest.at + limit.per)
}
