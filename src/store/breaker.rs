//! Circuit breaker in front of the shared store.
//!
//! When Redis is down every call would otherwise wait out the whole deadline before the rule's
//! failure mode applies, adding that deadline to every request. After `failure_threshold`
//! consecutive failures the breaker opens and calls fail at once; after `cool_down` one call is
//! let through as a probe (half-open); its success closes the breaker, its failure opens it again.
//!
//! Time is passed in, read by the caller from its [`crate::clock::Clock`] (the clock every
//! decision uses), so the state machine and its users are tested without sleeping.

use std::time::Duration;

use parking_lot::Mutex;

use crate::duration::Micros;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (at least 1).
    pub failure_threshold: u32,
    /// How long the breaker stays open before letting a probe through.
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { failure_threshold: 5, cool_down: Duration::from_secs(1) }
    }
}

/// The breaker's state, for metrics and status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls fail immediately.
    Open,
    /// The cool-down is over: the next call (only one at a time) probes the store.
    HalfOpen,
}

impl BreakerState {
    pub fn name(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "halfOpen",
        }
    }
}

impl std::fmt::Display for BreakerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A change worth telling the operator about: the breaker opened from closed (the store just
/// became unusable), or closed again (it is back). A failed probe reopening it is neither.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    Opened,
    Closed,
}

#[derive(Debug)]
enum Phase {
    Closed {
        failures: u32,
    },
    /// Opened at `since` (the clock's time).
    Open {
        since: Micros,
    },
    HalfOpen {
        probing: bool,
    },
}

#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    /// `config.cool_down` on the clock's scale.
    cool_down: Micros,
    phase: Mutex<Phase>,
}

/// Permission to make one call. Report how it went with [`Permit::success`] or
/// [`Permit::failure`]; dropping it unreported (the caller gave up) frees a half-open probe slot
/// without counting a failure, because the store did nothing wrong.
#[must_use = "report the call's outcome"]
#[derive(Debug)]
pub struct Permit<'a> {
    breaker: &'a Breaker,
    probe: bool,
    reported: bool,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Breaker {
        let config = BreakerConfig { failure_threshold: config.failure_threshold.max(1), ..config };
        let cool_down = Micros::try_from(config.cool_down.as_micros()).unwrap_or(Micros::MAX);
        Breaker { config, cool_down, phase: Mutex::new(Phase::Closed { failures: 0 }) }
    }

    /// Whether a breaker opened at `since` is still cooling down at `now`. The clock is the wall
    /// clock (not monotonic): a step back ends the cool-down, because one probe costs less than
    /// a breaker held open for as long as the step.
    fn cooling(&self, since: Micros, now: Micros) -> bool {
        now.checked_sub(since).is_some_and(|open_for| open_for < self.cool_down)
    }

    /// A permit to call the store, or `None` when the call must fail fast.
    pub fn try_acquire(&self, now: Micros) -> Option<Permit<'_>> {
        let mut phase = self.phase.lock();
        let probe = match *phase {
            Phase::Closed { .. } => false,
            Phase::Open { since } if self.cooling(since, now) => return None,
            Phase::Open { .. } | Phase::HalfOpen { probing: false } => {
                *phase = Phase::HalfOpen { probing: true };
                true
            }
            Phase::HalfOpen { probing: true } => return None,
        };
        Some(Permit { breaker: self, probe, reported: false })
    }

    pub fn state(&self, now: Micros) -> BreakerState {
        match *self.phase.lock() {
            Phase::Closed { .. } => BreakerState::Closed,
            Phase::Open { since } if self.cooling(since, now) => BreakerState::Open,
            Phase::Open { .. } | Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    fn record(&self, probe: bool, ok: bool, now: Micros) -> Option<Transition> {
        let mut phase = self.phase.lock();
        let was_closed = matches!(*phase, Phase::Closed { .. });
        *phase = match (&*phase, ok) {
            (_, true) => Phase::Closed { failures: 0 },
            (Phase::Closed { failures }, false) => {
                let failures = failures + 1;
                if failures >= self.config.failure_threshold {
                    Phase::Open { since: now }
                } else {
                    Phase::Closed { failures }
                }
            }
            // A failed probe reopens; a call admitted before the breaker opened that fails
            // late must not extend or re-arm anything.
            (Phase::HalfOpen { .. }, false) if probe => Phase::Open { since: now },
            (Phase::HalfOpen { probing }, false) => Phase::HalfOpen { probing: *probing },
            (Phase::Open { since }, false) => Phase::Open { since: *since },
        };
        match (&*phase, was_closed) {
            (Phase::Open { .. }, true) => Some(Transition::Opened),
            (Phase::Closed { .. }, false) => Some(Transition::Closed),
            _ => None,
        }
    }

    fn release_probe(&self) {
        let mut phase = self.phase.lock();
        if let Phase::HalfOpen { probing: true } = *phase {
            *phase = Phase::HalfOpen { probing: false };
        }
    }
}

impl Permit<'_> {
    pub fn success(mut self, now: Micros) -> Option<Transition> {
        self.reported = true;
        self.breaker.record(self.probe, true, now)
    }

    pub fn failure(mut self, now: Micros) -> Option<Transition> {
        self.reported = true;
        self.breaker.record(self.probe, false, now)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if !self.reported && self.probe {
            self.breaker.release_probe();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Micros = 1_000;

    fn breaker() -> (Breaker, Micros) {
        let b = Breaker::new(BreakerConfig { failure_threshold: 3, cool_down: Duration::from_millis(100) });
        (b, 1_700_000_000_000_000)
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let (b, t) = breaker();
        b.try_acquire(t).unwrap().failure(t);
        b.try_acquire(t).unwrap().failure(t);
        b.try_acquire(t).unwrap().success(t); // resets the count
        b.try_acquire(t).unwrap().failure(t);
        b.try_acquire(t).unwrap().failure(t);
        assert_eq!(b.state(t), BreakerState::Closed);
        b.try_acquire(t).unwrap().failure(t);
        assert_eq!(b.state(t), BreakerState::Open);
        assert!(b.try_acquire(t + 99 * MS).is_none(), "fails fast while open");
    }

    #[test]
    fn half_open_lets_one_probe_through_and_closes_on_success() {
        let (b, t) = breaker();
        for _ in 0..3 {
            b.try_acquire(t).unwrap().failure(t);
        }
        let later = t + 100 * MS;
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        let probe = b.try_acquire(later).expect("probe");
        assert!(b.try_acquire(later).is_none(), "only one probe at a time");
        probe.success(later);
        assert_eq!(b.state(later), BreakerState::Closed);
        assert!(b.try_acquire(later).is_some());
    }

    #[test]
    fn failed_probe_reopens_for_a_full_cool_down() {
        let (b, t) = breaker();
        for _ in 0..3 {
            b.try_acquire(t).unwrap().failure(t);
        }
        let later = t + 150 * MS;
        b.try_acquire(later).expect("probe").failure(later);
        assert_eq!(b.state(later), BreakerState::Open);
        assert!(b.try_acquire(later + 99 * MS).is_none());
        assert!(b.try_acquire(later + 100 * MS).is_some());
    }

    #[test]
    fn abandoned_probe_frees_the_slot_without_counting() {
        let (b, t) = breaker();
        for _ in 0..3 {
            b.try_acquire(t).unwrap().failure(t);
        }
        let later = t + 100 * MS;
        drop(b.try_acquire(later).expect("probe"));
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        assert!(b.try_acquire(later).is_some(), "a new probe may go");
    }

    #[test]
    fn late_failure_of_a_pre_open_call_does_not_rearm() {
        let (b, t) = breaker();
        let slow = b.try_acquire(t).unwrap();
        for _ in 0..3 {
            b.try_acquire(t).unwrap().failure(t);
        }
        let later = t + 100 * MS;
        let probe = b.try_acquire(later).expect("probe");
        slow.failure(later);
        assert_eq!(b.state(later), BreakerState::HalfOpen);
        probe.success(later);
        assert_eq!(b.state(later), BreakerState::Closed);
    }

    #[test]
    fn a_clock_stepping_back_ends_the_cool_down_with_one_probe() {
        let (b, t) = breaker();
        for _ in 0..3 {
            b.try_acquire(t).unwrap().failure(t);
        }
        let earlier = t - 3_600_000 * MS;
        assert_eq!(b.state(earlier), BreakerState::HalfOpen, "not open for the hour the clock stepped back");
        b.try_acquire(earlier).expect("probe").failure(earlier);
        assert_eq!(b.state(earlier + 99 * MS), BreakerState::Open, "a full cool-down from the new time");
        assert!(b.try_acquire(earlier + 100 * MS).is_some());
    }

    #[test]
    fn names_for_status() {
        assert_eq!(BreakerState::HalfOpen.to_string(), "halfOpen");
        assert_eq!(BreakerState::Closed.name(), "closed");
        assert_eq!(BreakerState::Open.name(), "open");
    }
}
