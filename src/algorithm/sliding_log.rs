//! Sliding window log: the admitted requests of the trailing `per`, exact.
//!
//! An entry admitted at `at` counts while `now < at + per`. Entries admitted at the same
//! microsecond are merged, so memory is at most one entry per admitted request. A log of one
//! entry lives inline in the state (`State::LogOne`); a second entry moves it into a boxed
//! deque, and pruning back to one entry moves it back inline.

use std::collections::VecDeque;

use super::{Decision, Limit, LogEntry, Micros, State};

/// A log as two slices, oldest first (a deque's two halves, or the inline entry).
#[derive(Clone, Copy, Default)]
pub(super) struct LogView<'a>(&'a [LogEntry], &'a [LogEntry]);

impl<'a> LogView<'a> {
    fn entries(self) -> impl DoubleEndedIterator<Item = &'a LogEntry> {
        self.0.iter().chain(self.1.iter())
    }

    fn newest(self) -> Option<&'a LogEntry> {
        self.1.last().or(self.0.last())
    }
}

pub(super) fn view(state: Option<&State>) -> LogView<'_> {
    match state {
        Some(State::LogOne(entry)) => LogView(std::slice::from_ref(entry), &[]),
        Some(State::Log(entries)) => view_deque(entries),
        _ => LogView::default(),
    }
}

/// A clock behind the newest entry counts as the newest entry's time.
fn effective_now(log: LogView<'_>, now: Micros) -> Micros {
    log.newest().map_or(now, |newest| newest.at.max(now))
}

pub(super) fn check(limit: &Limit, log: LogView<'_>, now: Micros, cost: u64) -> Decision {
    let now_eff = effective_now(log, now);
    let live = || log.entries().filter(|e| e.at + limit.per > now_eff);
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
    match state {
        Some(State::LogOne(entry)) => {
            let now_eff = entry.at.max(now);
            let live = entry.at + limit.per > now_eff;
            if cost == 0 {
                if live {
                    return entry.at + limit.per;
                }
                // Pruned to nothing: the empty log a deque would leave, pristine now.
                *state = Some(State::Log(Box::default()));
                return now_eff;
            }
            if !live {
                *entry = LogEntry { at: now_eff, cost };
            } else if entry.at == now_eff {
                entry.cost += cost;
            } else {
                let older = *entry;
                let mut log = VecDeque::with_capacity(4.min(usize::try_from(limit.requests).unwrap_or(4)).max(2));
                log.push_back(older);
                log.push_back(LogEntry { at: now_eff, cost });
                *state = Some(State::Log(Box::new(log)));
            }
            now_eff + limit.per
        }
        Some(State::Log(log)) => {
            let now_eff = effective_now(view_deque(log), now);
            while log.front().is_some_and(|e| e.at + limit.per <= now_eff) {
                log.pop_front();
            }
            if cost > 0 {
                match log.back_mut() {
                    Some(newest) if newest.at == now_eff => newest.cost += cost,
                    _ => {
                        if log.len() == log.capacity() {
                            // Live entries never outnumber `requests` (each costs at least 1):
                            // grow towards that bound, not past it as doubling would.
                            let bound = usize::try_from(limit.requests).unwrap_or(usize::MAX);
                            log.reserve_exact(log.len().max(1).min(bound.saturating_sub(log.len()).max(1)));
                        }
                        log.push_back(LogEntry { at: now_eff, cost });
                    }
                }
            }
            let pristine_at = log.back().map_or(now_eff, |newest| newest.at + limit.per);
            let only = if log.len() == 1 { log.front().copied() } else { None };
            if let Some(only) = only {
                *state = Some(State::LogOne(only));
            }
            pristine_at
        }
        // Nothing yet, or another algorithm's state (the rule was edited): start a log.
        _ if cost > 0 => {
            *state = Some(State::LogOne(LogEntry { at: now, cost }));
            now + limit.per
        }
        _ => {
            *state = Some(State::Log(Box::default()));
            now
        }
    }
}

fn view_deque(log: &VecDeque<LogEntry>) -> LogView<'_> {
    let (older, newer) = log.as_slices();
    LogView(older, newer)
}
