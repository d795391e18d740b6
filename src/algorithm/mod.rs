//! The six rate-limit algorithms and the concurrency limit, as pure functions of (state, now,
//! limit, cost).
//!
//! Nothing here reads a clock, allocates shared state or talks to a store: a store keeps one
//! [`State`] per (rule, key), calls [`check`] to decide without changing anything and, when every
//! rule of a request admits it, [`apply`] to consume. All arithmetic is on integers of at most 53
//! bits (microseconds, request counts) so the Redis Lua scripts, whose numbers are doubles,
//! reproduce every decision exactly.
//!
//! A clock that steps backwards is treated as no time passing for the bucket and window
//! algorithms. GCRA and the leaky bucket keep a single timestamp and cannot tell a stepped-back
//! clock from a busy key: they stay conservative (they may deny a little longer, never admit more).

pub mod concurrency;
pub mod dominance;
mod fixed_window;
mod gcra;
pub mod lease;
pub mod reservation;
mod sliding_counter;
mod sliding_log;
mod token_bucket;

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

pub use crate::duration::Micros;
use crate::duration::{HumanDuration, MICROS_PER_MS};

/// Largest integer a Lua number (an IEEE double) holds exactly.
pub const MAX_EXACT: u64 = (1 << 53) - 1;
/// The largest `requests` or `burst` a rule may declare.
pub const MAX_REQUESTS: u64 = u32::MAX as u64;
/// The largest cost, estimate or settled amount the algorithms take: anything larger is taken as
/// this much. The APIs refuse larger costs already (`engine::MAX_COST`, the same
/// number); the algorithms clamp again because a store operation must never let an amount
/// overflow a count, whoever called it (a lease token's estimate, a settle, a quota lease).
/// No limit's capacity exceeds it, so a clamped cost decides as the original would.
pub const MAX_COST: u64 = MAX_REQUESTS;

/// `amount` as the algorithms take it: at most [`MAX_COST`].
pub fn clamp_cost(amount: u64) -> u64 {
    amount.min(MAX_COST)
}
/// The largest `requests` a slidingWindowLog rule may declare. The log keeps one entry per
/// admitted request: a full log of 1 000 entries takes about 110 KB of Redis memory and 250
/// units of the memory store's cap; slidingWindowCounter keeps two counters whatever the limit.
pub const MAX_LOG_REQUESTS: u64 = 1000;
/// The largest `requests` (slots) a concurrency rule may declare: its key keeps one lease per
/// request in progress.
pub const MAX_CONCURRENT: u64 = 10_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Algorithm {
    /// Capacity `burst`, refilled continuously at `requests` per `per`; starts full.
    TokenBucket,
    /// Generic cell rate algorithm: the token bucket's decisions with one timestamp per key.
    Gcra,
    /// Drains `requests` per `per` with a queue of `burst`; with `maxDelay` it shapes (admits with
    /// a delay), without it it polices (rejects when full).
    LeakyBucket,
    /// `requests` per window of `per`, windows aligned to multiples of `per` since the Unix epoch.
    /// Up to twice the limit can pass across a window boundary.
    FixedWindow,
    /// Exact: never more than `requests` in any trailing `per`. Memory and the cost of each
    /// decision grow with `requests`, at most [`MAX_LOG_REQUESTS`].
    SlidingWindowLog,
    /// Weighted estimate of the trailing window from the previous and current fixed windows.
    SlidingWindowCounter,
    /// At most `requests` requests in progress at once; `per` is the lease: a slot not released
    /// within it is freed (a holder that crashed keeps it no longer).
    Concurrency,
}

impl Algorithm {
    /// The rate algorithms (every algorithm but [`Algorithm::Concurrency`]).
    pub const ALL: [Algorithm; 6] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
    ];
    /// Every algorithm a rule may name: the rate algorithms, then concurrency.
    pub const EVERY: [Algorithm; 7] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::Concurrency,
    ];

    /// The name used in policies and scripts.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::TokenBucket => "tokenBucket",
            Algorithm::Gcra => "gcra",
            Algorithm::LeakyBucket => "leakyBucket",
            Algorithm::FixedWindow => "fixedWindow",
            Algorithm::SlidingWindowLog => "slidingWindowLog",
            Algorithm::SlidingWindowCounter => "slidingWindowCounter",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Whether a request's admission holds capacity until it is released (see
    /// [`concurrency`]): only the stores and APIs that see a request end can enforce it.
    pub fn holds(self) -> bool {
        self == Algorithm::Concurrency
    }

    /// Whether `burst` means anything to this algorithm.
    pub fn uses_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket)
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::EVERY.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            format!("unknown algorithm {s:?}; expected one of {}", Algorithm::EVERY.map(Algorithm::name).join(", "))
        })
    }
}

/// Why a set of limit numbers cannot be enforced exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("requests must be at least 1")]
    ZeroRequests,
    #[error("requests must be at most {MAX_REQUESTS}")]
    TooManyRequests,
    #[error(
        "slidingWindowLog allows at most {MAX_LOG_REQUESTS} requests per window; use slidingWindowCounter for larger limits"
    )]
    LogTooLong,
    #[error("concurrency allows at most {MAX_CONCURRENT} requests in progress per key")]
    TooManyConcurrent,
    #[error("per must be at least 1ms")]
    PeriodTooShort,
    #[error("per must be a whole number of milliseconds, got {0}")]
    PeriodNotWholeMilliseconds(String),
    #[error("per must be at most 366d")]
    PeriodTooLong,
    #[error("burst must be at least 1")]
    ZeroBurst,
    #[error("burst must be at most {MAX_REQUESTS}")]
    BurstTooLarge,
    #[error("burst is only used by tokenBucket, gcra and leakyBucket, not {0}")]
    BurstNotApplicable(Algorithm),
    #[error("maxDelay is only used by leakyBucket, not {0}")]
    MaxDelayNotApplicable(Algorithm),
    #[error("rate too high: {requests} per {per} is faster than one request per microsecond")]
    RateTooHigh { requests: u64, per: String },
    #[error("(requests + 1) × per (in ms) must stay below 2^53 so every store computes the same estimate")]
    WindowProductTooLarge,
    #[error("burst × emission interval must stay below 2^53 µs")]
    BucketTooLarge,
    #[error(
        "{0} cannot take a cost known after the response: use tokenBucket, gcra, fixedWindow or slidingWindowCounter"
    )]
    ReservationNotApplicable(Algorithm),
    #[error("a cost known after the response cannot be shaped: remove maxDelay")]
    ReservationWithShaping,
    #[error("the reservation's ttl must be between 1s and 1d")]
    ReservationTtlOutOfRange,
    #[error("{0} cannot be leased: a lease hands out units of a count, and {0} admits by {1}; use consistency: exact")]
    LeaseNotApplicable(Algorithm, &'static str),
    #[error(
        "a cost known after the response cannot be leased: its holder would not know what it spent; use consistency: exact"
    )]
    LeaseWithReservation,
}

/// A validated limit, ready for the algorithms. Build it with [`Limit::new`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    algorithm: Algorithm,
    requests: u64,
    per: Micros,
    burst: u64,
    max_delay: Option<Micros>,
    /// Emission interval T = per / requests, rounded up to whole microseconds so that rounding can
    /// only ever admit slightly less, never more.
    interval: Micros,
    /// Set when a request's cost is known only after its response ([`reservation`]): how long an
    /// unsettled reservation holds its estimate.
    reservation_ttl: Option<Micros>,
    /// Set when enforcers may hold quota leases of this limit ([`lease`]): the store counts the
    /// leases held against it.
    leased: bool,
}

impl Limit {
    /// `burst` defaults to `requests`; it must be `None` for window algorithms, as must
    /// `max_delay` for anything but the leaky bucket.
    pub fn new(
        algorithm: Algorithm,
        requests: u64,
        per: Micros,
        burst: Option<u64>,
        max_delay: Option<Micros>,
    ) -> Result<Limit, LimitError> {
        if requests == 0 {
            return Err(LimitError::ZeroRequests);
        }
        if requests > MAX_REQUESTS {
            return Err(LimitError::TooManyRequests);
        }
        if per < MICROS_PER_MS {
            return Err(LimitError::PeriodTooShort);
        }
        if !per.is_multiple_of(MICROS_PER_MS) {
            return Err(LimitError::PeriodNotWholeMilliseconds(HumanDuration(per).to_string()));
        }
        if per > 366 * 86_400_000_000 {
            return Err(LimitError::PeriodTooLong);
        }
        if burst.is_some() && !algorithm.uses_burst() {
            return Err(LimitError::BurstNotApplicable(algorithm));
        }
        if max_delay.is_some() && algorithm != Algorithm::LeakyBucket {
            return Err(LimitError::MaxDelayNotApplicable(algorithm));
        }
        if algorithm == Algorithm::SlidingWindowLog && requests > MAX_LOG_REQUESTS {
            return Err(LimitError::LogTooLong);
        }
        if algorithm == Algorithm::Concurrency && requests > MAX_CONCURRENT {
            return Err(LimitError::TooManyConcurrent);
        }
        let burst = burst.unwrap_or(requests);
        if burst == 0 {
            return Err(LimitError::ZeroBurst);
        }
        if burst > MAX_REQUESTS {
            return Err(LimitError::BurstTooLarge);
        }
        if requests > per {
            return Err(LimitError::RateTooHigh { requests, per: HumanDuration(per).to_string() });
        }
        // One more than `requests`: the sliding counter keeps counts up to the largest that stays
        // exact when weighted, and that must tell a spent window from one in debt.
        if (requests + 1).saturating_mul(per / MICROS_PER_MS) > MAX_EXACT {
            return Err(LimitError::WindowProductTooLarge);
        }
        let interval = per.div_ceil(requests);
        if burst.saturating_mul(interval) > MAX_EXACT / 4 {
            return Err(LimitError::BucketTooLarge);
        }
        Ok(Limit { algorithm, requests, per, burst, max_delay, interval, reservation_ttl: None, leased: false })
    }

    /// This limit for costs known only after the response: admission reserves an estimate for at
    /// most `ttl`, settled later to the actual cost ([`reservation`]).
    pub fn reserving(mut self, ttl: Micros) -> Result<Limit, LimitError> {
        if matches!(self.algorithm, Algorithm::SlidingWindowLog | Algorithm::Concurrency) {
            return Err(LimitError::ReservationNotApplicable(self.algorithm));
        }
        if self.max_delay.is_some() {
            return Err(LimitError::ReservationWithShaping);
        }
        if self.leased {
            return Err(LimitError::LeaseWithReservation);
        }
        if !(1_000_000..=86_400_000_000).contains(&ttl) {
            return Err(LimitError::ReservationTtlOutOfRange);
        }
        self.reservation_ttl = Some(ttl);
        Ok(self)
    }

    /// This limit with quota leases ([`lease`]): enforcers may hold slices of a key's quota.
    pub fn leasing(mut self) -> Result<Limit, LimitError> {
        let why = match self.algorithm {
            Algorithm::SlidingWindowLog => Some("the time of each request it admitted"),
            Algorithm::Concurrency => Some("the requests in progress"),
            Algorithm::LeakyBucket if self.max_delay.is_some() => Some("delaying each request (maxDelay)"),
            _ => None,
        };
        if let Some(why) = why {
            return Err(LimitError::LeaseNotApplicable(self.algorithm, why));
        }
        if self.reservation_ttl.is_some() {
            return Err(LimitError::LeaseWithReservation);
        }
        self.leased = true;
        Ok(self)
    }

    /// Whether admission delays requests instead of refusing them (a leaky bucket with
    /// `maxDelay`): the caller waits for its departure.
    pub fn shapes(&self) -> bool {
        self.algorithm == Algorithm::LeakyBucket && self.max_delay.is_some()
    }

    /// This limit with a shorter longest wait: a caller whose own deadline is nearer than
    /// `maxDelay` is refused at once instead of admitted to wait past it. Unchanged when it
    /// does not shape or `max_delay` is not shorter.
    pub fn waiting_at_most(&self, max_delay: Micros) -> Limit {
        let mut limit = self.clone();
        if let Some(own) = limit.max_delay {
            limit.max_delay = Some(own.min(max_delay));
        }
        limit
    }

    /// Whether enforcers may hold quota leases of this limit.
    pub fn leased(&self) -> bool {
        self.leased
    }

    /// How long an unsettled reservation lasts; `None` for a limit whose cost is known up front.
    pub fn reservation_ttl(&self) -> Option<Micros> {
        self.reservation_ttl
    }

    /// Whether admission holds capacity under the request's hold id until it is settled: a
    /// concurrency slot, or a reservation of a cost known after the response.
    pub fn holds(&self) -> bool {
        self.algorithm.holds() || self.reservation_ttl.is_some()
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    pub fn requests(&self) -> u64 {
        self.requests
    }
    pub fn per(&self) -> Micros {
        self.per
    }
    /// Capacity of the bucket algorithms; equals `requests` for the window algorithms.
    pub fn burst(&self) -> u64 {
        self.burst
    }
    pub fn max_delay(&self) -> Option<Micros> {
        self.max_delay
    }
    /// Emission interval in microseconds (per / requests, rounded up).
    pub fn interval(&self) -> Micros {
        self.interval
    }
    /// The most a request may cost and still ever be admitted.
    pub fn capacity(&self) -> u64 {
        if self.algorithm.uses_burst() { self.burst } else { self.requests }
    }
}

/// What one rule says about one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Decision {
    pub allowed: bool,
    /// Requests of cost 1 still admissible right now (after this one, when it is admitted).
    pub remaining: u64,
    /// Time until the key is back to a full quota.
    pub reset_after: Micros,
    /// On a denial, how long until the same request would be admitted; `None` when its cost can
    /// never fit, and always `None` when admitted.
    pub retry_after: Option<Micros>,
    /// How long the caller must hold an admitted request (leaky-bucket shaping); 0 otherwise.
    pub delay: Micros,
}

/// One entry of a sliding-window log: when requests were admitted and their total cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub at: Micros,
    pub cost: u64,
}

/// Whose capacity a hold is: the request's id, chosen by whoever admits it (0: none).
pub type HoldId = u64;

/// Capacity a request holds until it is settled or `until` passes: a concurrency slot (amount 1)
/// or a reserved estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hold {
    pub id: HoldId,
    pub until: Micros,
    pub amount: u64,
}

/// Per-key state. A key without state is pristine (full bucket, empty window).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// GCRA and leaky bucket: theoretical arrival time.
    Tat(Micros),
    /// Token bucket: credit in microseconds of emission (one token = one interval) and the time
    /// it was computed at.
    Bucket { credit: Micros, updated: Micros },
    /// Fixed window: the window's start (a multiple of `per`) and the cost admitted in it.
    Window { start: Micros, count: u64 },
    /// Sliding window counter: the current window's start and the counts of the previous and
    /// current windows.
    Counter { start: Micros, previous: u32, current: u32 },
    /// Sliding window log holding one entry, inline: most keys of a log limit see one request
    /// per window (or one burst in one microsecond), and the boxed deque would add 96 bytes.
    LogOne(LogEntry),
    /// Sliding window log: admitted requests still inside the window, oldest first.
    Log(Box<VecDeque<LogEntry>>),
    /// Concurrency: the leases of the requests in progress.
    Holds(Box<Vec<Hold>>),
    /// A rate algorithm's state with the reservations not yet settled ([`reservation`]); only
    /// while at least one is held.
    Reserved(Box<reservation::Reserved>),
}

/// Decides whether `cost` may pass now, without changing anything.
pub fn check(limit: &Limit, state: Option<&State>, now: Micros, cost: u64) -> Decision {
    let cost = clamp_cost(cost);
    // Holds count whatever the limit says now: leases and reservations taken before an edit
    // still hold their units until they end.
    if limit.reservation_ttl.is_some() || matches!(state, Some(State::Reserved(_))) {
        return reservation::check(limit, state, now, cost);
    }
    check_counted(limit, reservation::counted(state), now, cost)
}

/// [`check`] on the algorithm's own state, reservations aside.
fn check_counted(limit: &Limit, state: Option<&State>, now: Micros, cost: u64) -> Decision {
    match limit.algorithm {
        Algorithm::TokenBucket => token_bucket::check(limit, token_bucket::view(state), now, cost),
        Algorithm::Gcra | Algorithm::LeakyBucket => gcra::check(limit, gcra::view(state), now, cost),
        Algorithm::FixedWindow => fixed_window::check(limit, fixed_window::view(state), now, cost),
        Algorithm::SlidingWindowLog => sliding_log::check(limit, sliding_log::view(state), now, cost),
        Algorithm::SlidingWindowCounter => sliding_counter::check(limit, sliding_counter::view(state), now, cost),
        Algorithm::Concurrency => concurrency::check(limit, concurrency::view(state), now, cost),
    }
}

/// Consumes `cost` (the caller has checked that every rule admits it) and returns the time at
/// which the new state is pristine again, after which the key can be forgotten.
///
/// A state of another algorithm's shape (the rule's algorithm was edited) is replaced.
pub fn apply(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Micros {
    apply_held(limit, state, now, cost, 0)
}

/// [`apply`] for a request whose holds are `hold` (its id: see [`concurrency`] and
/// [`reservation`]).
pub fn apply_held(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64, hold: HoldId) -> Micros {
    let cost = clamp_cost(cost);
    if matches!(state, Some(State::Reserved(_))) || (limit.reservation_ttl.is_some() && hold != 0) {
        return reservation::apply(limit, state, now, cost, hold);
    }
    apply_counted(limit, state, now, cost, hold)
}

/// Consumes `cost` from the algorithm's own state (a rate algorithm consumes it even past the
/// limit: a settled cost above its estimate is debt that later requests wait out).
fn apply_counted(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64, hold: HoldId) -> Micros {
    match limit.algorithm {
        Algorithm::TokenBucket => token_bucket::apply(limit, state, now, cost),
        Algorithm::Gcra | Algorithm::LeakyBucket => gcra::apply(limit, state, now, cost),
        Algorithm::FixedWindow => fixed_window::apply(limit, state, now, cost),
        Algorithm::SlidingWindowLog => sliding_log::apply(limit, state, now, cost),
        Algorithm::SlidingWindowCounter => sliding_counter::apply(limit, state, now, cost),
        Algorithm::Concurrency => concurrency::apply(limit, state, now, cost, hold),
    }
}

/// Settles what `hold` holds in this key at `now`: a concurrency slot is given back; a reservation
/// is replaced by its `actual` cost. Idempotent: a hold already settled, or run out, is left
/// alone. Returns whether the hold was found, and when the state is pristine again (`None`:
/// the key can go).
pub fn settle(
    limit: &Limit,
    state: &mut Option<State>,
    now: Micros,
    hold: HoldId,
    actual: u64,
) -> (bool, Option<Micros>) {
    let actual = clamp_cost(actual);
    if limit.algorithm == Algorithm::Concurrency {
        let held = concurrency::view(state.as_ref()).iter().any(|h| h.id == hold && h.until > now);
        return (held, concurrency::release(state, hold, now));
    }
    reservation::settle(limit, state, now, hold, actual)
}

/// Settles a reservation of nothing under `hold`: admission held nothing for it (see
/// [`reservation`]), so `actual` is charged at once, even past the limit, as any settle charges
/// its actual cost. Nothing tells a repeated settle from the first here: the caller (the lease
/// token) says the reservation was 0. A hold of that id left by an older version is dropped.
/// For a concurrency rule, [`settle`]: its slot is a hold whatever it reserved.
pub fn settle_unreserved(
    limit: &Limit,
    state: &mut Option<State>,
    now: Micros,
    hold: HoldId,
    actual: u64,
) -> (bool, Option<Micros>) {
    if limit.algorithm == Algorithm::Concurrency || limit.reservation_ttl.is_none() {
        return settle(limit, state, now, hold, actual);
    }
    reservation::charge(limit, state, now, hold, clamp_cost(actual))
}

/// Gives back the slot of a request a shaping rule (leaky bucket with `maxDelay`) admitted
/// with a delay, whose caller went away before it departed; `until` is what its admission
/// set the key's state to ([`Verdict`](crate::rule::Verdict)'s instant plus the decision's
/// `reset_after`). Only the last slot taken goes back ([`gcra::give_back`]); any other state,
/// algorithm or slot is left alone. Returns whether it went back.
pub fn give_back(limit: &Limit, state: &mut Option<State>, now: Micros, until: Micros, cost: u64) -> bool {
    limit.shapes() && gcra::give_back(limit, state, now, until, clamp_cost(cost))
}

/// `check`, then `apply` when admitted: the single-rule decision.
pub fn decide(limit: &Limit, state: &mut Option<State>, now: Micros, cost: u64) -> Decision {
    let decision = check(limit, state.as_ref(), now, cost);
    if decision.allowed {
        apply(limit, state, now, cost);
    }
    decision
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::duration::parse_duration;

    fn limit(algorithm: Algorithm, requests: u64, per: &str, burst: Option<u64>) -> Limit {
        Limit::new(algorithm, requests, parse_duration(per).unwrap(), burst, None).unwrap()
    }

    #[test]
    fn limit_validation_names_the_problem() {
        let s = 1_000_000;
        assert_eq!(Limit::new(Algorithm::Gcra, 0, s, None, None), Err(LimitError::ZeroRequests));
        assert_eq!(Limit::new(Algorithm::Gcra, 1, 10, None, None), Err(LimitError::PeriodTooShort));
        assert!(matches!(
            Limit::new(Algorithm::Gcra, 1, 1_500, None, None),
            Err(LimitError::PeriodNotWholeMilliseconds(_))
        ));
        assert_eq!(
            Limit::new(Algorithm::FixedWindow, 1, s, Some(2), None),
            Err(LimitError::BurstNotApplicable(Algorithm::FixedWindow))
        );
        assert_eq!(
            Limit::new(Algorithm::Gcra, 1, s, None, Some(5)),
            Err(LimitError::MaxDelayNotApplicable(Algorithm::Gcra))
        );
        assert!(matches!(Limit::new(Algorithm::Gcra, 2_000_000, s, None, None), Err(LimitError::RateTooHigh { .. })));
        assert_eq!(Limit::new(Algorithm::Gcra, 1, s, Some(0), None), Err(LimitError::ZeroBurst));
        let log = |requests| Limit::new(Algorithm::SlidingWindowLog, requests, 60 * s, None, None);
        assert!(log(MAX_LOG_REQUESTS).is_ok());
        assert_eq!(log(MAX_LOG_REQUESTS + 1), Err(LimitError::LogTooLong));
        assert!(Limit::new(Algorithm::SlidingWindowCounter, MAX_LOG_REQUESTS + 1, 60 * s, None, None).is_ok());
    }

    #[test]
    fn interval_rounds_up() {
        assert_eq!(limit(Algorithm::Gcra, 3, "1s", None).interval(), 333_334);
        assert_eq!(limit(Algorithm::Gcra, 10, "1s", None).interval(), 100_000);
    }

    #[test]
    fn algorithm_names_round_trip() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>(), Ok(a));
        }
        assert!("bogus".parse::<Algorithm>().unwrap_err().contains("tokenBucket"));
    }

    /// The seed note's measurement with golang.org/x/time/rate: capacity 5 refilled 10/s admits
    /// 5 of 20 immediate requests, then 3 of 20 after 300 ms.
    #[test]
    fn seed_token_bucket_5_then_3() {
        for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::LeakyBucket] {
            let l = limit(algorithm, 10, "1s", Some(5));
            let mut state = None;
            let t0 = 1_700_000_000_000_000;
            let first = (0..20).filter(|_| decide(&l, &mut state, t0, 1).allowed).count();
            let later = (0..20).filter(|_| decide(&l, &mut state, t0 + 300_000, 1).allowed).count();
            assert_eq!((first, later), (5, 3), "{algorithm}");
        }
    }

    /// The book's sliding-window-counter example: limit 7, previous window 5, current 3, 30% into
    /// the window: 3 + 5 × 0.7 = 6.5, floored to 6, so one more request is admitted.
    #[test]
    fn seed_sliding_counter_book_example() {
        let l = limit(Algorithm::SlidingWindowCounter, 7, "1m", None);
        let start = 28_333_333 * 60_000_000; // any whole minute
        let state = State::Counter { start, previous: 5, current: 3 };
        let now = start + 18_000_000; // 30% into the window
        let d = check(&l, Some(&state), now, 1);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        // A second request would make floor(6.5) + 1 + 1 = 8 > 7.
        let mut state = Some(state);
        apply(&l, &mut state, now, 1);
        assert!(!check(&l, state.as_ref(), now, 1).allowed);
    }

    /// The fixed window's nature: N at the end of one window and N at the start of the next.
    #[test]
    fn seed_fixed_window_two_n_across_boundary() {
        let l = limit(Algorithm::FixedWindow, 100, "1m", None);
        let boundary = 28_333_334 * 60_000_000;
        let mut state = None;
        let before = (0..150).filter(|_| decide(&l, &mut state, boundary - 1_000_000, 1).allowed).count();
        let after = (0..150).filter(|_| decide(&l, &mut state, boundary + 1_000_000, 1).allowed).count();
        assert_eq!(before + after, 200, "2N within two seconds across the boundary");
    }

    /// Editing `per` of a window algorithm never panics, never overflows and never leaves a key
    /// stuck in a far-future window: at worst the stored window runs out under the new length.
    #[test]
    fn editing_per_of_window_algorithms_is_safe() {
        let now = 1_699_920_000_000_000 + 7_123_000;
        for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
            for (old_per, new_per) in [("7ms", "1m"), ("1m", "1h"), ("1h", "7ms"), ("1d", "366d")] {
                let old = limit(algorithm, 3, old_per, None);
                let new = limit(algorithm, 100, new_per, None);
                let mut state = None;
                for _ in 0..3 {
                    decide(&old, &mut state, now, 1);
                }
                let d = decide(&new, &mut state, now + 1, 1);
                assert!(d.allowed, "{algorithm} {old_per}->{new_per}");
                let expires_at = apply(&new, &mut state, now + 2, 1);
                assert!(expires_at <= now + 2 + 2 * new.per() + old.per(), "{algorithm} {old_per}->{new_per}");
            }
        }
    }

    /// Cutting `requests` and raising `per` keeps the counter's arithmetic exact.
    #[test]
    fn cutting_requests_after_a_busy_window_stays_exact() {
        let now = 1_699_920_000_000_000;
        let busy = limit(Algorithm::SlidingWindowCounter, 900_000, "1s", None);
        let mut state = None;
        decide(&busy, &mut state, now, 800_000);
        let strict = limit(Algorithm::SlidingWindowCounter, 10, "1s", None);
        let d = decide(&strict, &mut state, now + 1_000_000, 1);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 0);
        assert!(d.retry_after.is_some());
    }

    #[test]
    fn a_cancelled_wait_gives_back_only_the_last_slot_and_only_before_it_departs() {
        let ms = 1_000;
        // 10 per second: one departure every 100 ms, waits of up to 1 s.
        let limit = Limit::new(Algorithm::LeakyBucket, 10, 1_000 * ms, Some(20), Some(1_000 * ms)).unwrap();
        let mut state = None;
        let until = |d: &Decision, now: Micros| now + d.reset_after;
        let first = decide(&limit, &mut state, 0, 1);
        let second = decide(&limit, &mut state, 0, 1);
        let third = decide(&limit, &mut state, 0, 1);
        assert_eq!((first.delay, second.delay, third.delay), (0, 100 * ms, 200 * ms));
        // The middle one leaves: later slots are promised, so its slot stays taken.
        assert!(!give_back(&limit, &mut state, 10 * ms, until(&second, 0), 1));
        // The last one leaves before departing: its slot goes back, and the next caller gets it.
        assert!(give_back(&limit, &mut state, 10 * ms, until(&third, 0), 1));
        assert!(!give_back(&limit, &mut state, 10 * ms, until(&third, 0), 1), "given back twice");
        let next = decide(&limit, &mut state, 10 * ms, 1);
        assert_eq!(next.delay, 190 * ms, "departs when the cancelled one would have");
        // A slot whose departure has come went: nothing to give back.
        assert!(!give_back(&limit, &mut state, 200 * ms, until(&next, 10 * ms), 1));
        // A policer, or any other algorithm, has no slots to give back.
        let gcra = Limit::new(Algorithm::Gcra, 10, 1_000 * ms, None, None).unwrap();
        let mut policed = None;
        let d = decide(&gcra, &mut policed, 0, 1);
        assert!(!give_back(&gcra, &mut policed, 0, d.reset_after, 1));
    }

    #[test]
    fn a_deadline_shortens_the_longest_wait_and_nothing_else() {
        let ms = 1_000;
        let limit = Limit::new(Algorithm::LeakyBucket, 10, 1_000 * ms, Some(20), Some(1_000 * ms)).unwrap();
        assert_eq!(limit.waiting_at_most(250 * ms).max_delay(), Some(250 * ms));
        assert_eq!(limit.waiting_at_most(5_000 * ms).max_delay(), Some(1_000 * ms));
        let mut state = None;
        for _ in 0..3 {
            decide(&limit, &mut state, 0, 1);
        }
        // The fourth would wait 300 ms: admitted by the rule, refused to a caller with 250 ms.
        assert!(check(&limit, state.as_ref(), 0, 1).allowed);
        let refused = check(&limit.waiting_at_most(250 * ms), state.as_ref(), 0, 1);
        assert!(!refused.allowed);
        assert_eq!(refused.retry_after, Some(50 * ms));
        let gcra = Limit::new(Algorithm::Gcra, 10, 1_000 * ms, None, None).unwrap();
        assert_eq!(gcra.waiting_at_most(1), gcra);
    }
}
