//! Quota leases: a slice of a key's remaining quota handed to an enforcer, which spends it with no
//! store call and settles what it spent.
//!
//! The third use of the stores' holds (after [`super::concurrency`]'s slots and
//! [`super::reservation`]'s estimates), and a thin one: a lease is a reservation whose holder is
//! an enforcer instead of a request. A lease of `amount` under hold id `h` counts against the
//! limit from its grant like any reservation (`used + reserved` must fit); the holder admits up
//! to `amount` requests locally before `until`; settling `h` with what it spent consumes that
//! from the algorithm's state and frees the rest. What a lease adds to a reservation:
//!
//! - **A bound on what is out.** A grant never takes the live holds of the key past `cap`, the
//!   rule's declared overshoot bound: whatever happens to the holders, at most `cap` units are
//!   spent outside the store's view at any moment.
//! - **An end inside the window.** For the window algorithms a lease ends with the window it was
//!   granted in, so a lease never carries one window's quota into the next; and the store holds
//!   its units until that window ends unless it is settled, so a holder that vanished can cost
//!   capacity, never admit over the limit.
//! - **A partial grant.** A holder asks for what its observed rate needs; it gets what fits,
//!   possibly less, possibly nothing (then its requests are decided by the store, exactly).
//!   When the bound is out in others' slices, the asker is recorded as a holder of nothing, so
//!   the key's holder count, which every grant reports, tells each holder its share.
//!
//! Why the bound holds. While the holders settle before their leases end, every unit they spend
//! was held by a live lease when it was spent, so `used + spent-but-unsettled ≤ used + reserved`,
//! which the admission rule keeps within the limit: leased decisions admit what exact ones would
//! (for the bucket algorithms, held units are subtracted from a level capped at the burst, which
//! is at least as strict as consuming them at the grant). Units are lost from the count only
//! when a lease ends unsettled after its holder spent from it (a crash, a partition, a pause
//! longer than the holder's margin): those units were held, and the holds of a key never exceed
//! `cap`. For the fixed window even that costs nothing (the units stay held to the window's end); for the
//! sliding counter the next window's estimate misses at most `cap`; for the token bucket and
//! GCRA at most `cap` per lease lifetime. docs/leasing.md gives the argument per algorithm.

use super::{Algorithm, Decision, Hold, HoldId, Limit, Micros, State, check, reservation};

/// The most holds of nothing (askers counted as holders while the bound is out in others'
/// slices) one key keeps. Each ask under a fresh hold id would add one, kept to its lease's end,
/// and every later operation on the key reads them all: past this many, an asker is not
/// recorded (it still gets its answer; the holders the others size their slices by stop
/// growing, at a count where a share is small anyway). Redis keeps the same bound
/// in its reservation script.
pub const MAX_WAITING_HOLDS: usize = 32;

/// The most live quota-lease holds (slices and holds of nothing) one key keeps. Slices of one
/// unit under fresh hold ids would otherwise add a field per ask up to the overshoot bound,
/// which every operation on the key reads: past this many, a new holder is granted nothing and
/// not recorded, and its requests are decided by the store, exactly. Holders already recorded
/// renew as before. Redis keeps the same bound in its reservation script.
pub const MAX_LEASE_HOLDS: usize = 256;

/// What a holder asks of one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseAsk {
    /// The new lease's id (never 0), chosen by the holder.
    pub hold: HoldId,
    /// Units wanted.
    pub want: u64,
    /// The most the key's live holds may add up to: the rule's overshoot bound.
    pub cap: u64,
    /// The longest a lease lasts (the rule's staleness); window algorithms end it sooner.
    pub ttl: Micros,
}

/// What a grant gave.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LeaseGrant {
    /// Units granted (0: none, and nothing was written).
    pub amount: u64,
    /// How long from the grant the holder may spend it (0 when nothing was granted): relative,
    /// so the holder measures it on its own clock from when it asked, which can only end it
    /// early, whatever the clocks' offset.
    pub lasts: Micros,
    /// The key's state after the grant, as a decision of cost 0 (what a caller would be told).
    pub after: Decision,
    /// Live holds of the key after the grant (this one included): how many holders share its
    /// bound, for the next slice's size.
    pub holders: u64,
}

/// When a lease granted at `now` ends for its holder, and when the store lets its units go
/// unless settled sooner: `now + ttl` for both, except that for the window algorithms the holder
/// stops by the end of `now`'s window and the store holds the units until then, so a lease whose
/// holder vanished never frees its window's units inside that window.
pub fn lease_end(limit: &Limit, now: Micros, ttl: Micros) -> (Micros, Micros) {
    let end = now.saturating_add(ttl);
    match limit.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
            let window_end = now - now % limit.per() + limit.per();
            (end.min(window_end), window_end)
        }
        _ => (end, end),
    }
}

/// Grants what fits of `ask` at `now`: at most `want`, within `cap` with the key's other live
/// holds, and within what the algorithm would admit beside them. Returns the grant and, when it
/// wrote, when the key is pristine again.
pub fn grant(limit: &Limit, state: &mut Option<State>, now: Micros, ask: LeaseAsk) -> (LeaseGrant, Option<Micros>) {
    let outstanding = reservation::reserved(state.as_ref(), now);
    let room = super::clamp_cost(ask.cap).saturating_sub(outstanding).min(super::clamp_cost(ask.want));
    let free = check(limit, state.as_ref(), now, 0);
    let mut amount = if free.allowed { room.min(free.remaining) } else { 0 };
    // `remaining` is what costs of 1 may still take; one lease of that much must fit too.
    if amount > 0 && !check(limit, state.as_ref(), now, amount).allowed {
        amount = 0;
    }
    let (until, held_until) = lease_end(limit, now, ask.ttl);
    if ask.hold == 0 || until <= now || crowded(state.as_ref(), now, ask.hold) {
        let holders = live_holds(state.as_ref(), now);
        return (LeaseGrant { amount: 0, lasts: 0, after: free, holders }, None);
    }
    if amount == 0 {
        // The key has room but the bound is out in others' slices: the asker is counted as a
        // holder (a hold of nothing) so the others size their next slices to leave it a share.
        let waiting = room == 0 && free.allowed && free.remaining > 0 && may_wait(state.as_ref(), now, ask.hold);
        let pristine = waiting
            .then(|| reservation::hold_units(limit, state, now, Hold { id: ask.hold, until: held_until, amount: 0 }));
        let holders = live_holds(state.as_ref(), now);
        return (LeaseGrant { amount: 0, lasts: 0, after: free, holders }, pristine);
    }
    let pristine = reservation::hold_units(limit, state, now, Hold { id: ask.hold, until: held_until, amount });
    let after = check(limit, state.as_ref(), now, 0);
    let holders = live_holds(state.as_ref(), now);
    (LeaseGrant { amount, lasts: until - now, after, holders }, Some(pristine))
}

/// Whether `hold` may be recorded as a holder of nothing: it is one already, or the key has
/// fewer than [`MAX_WAITING_HOLDS`] live holds of nothing.
fn may_wait(state: Option<&State>, now: Micros, hold: HoldId) -> bool {
    let Some(State::Reserved(r)) = state else { return true };
    let live = || r.holds.iter().filter(|h| h.until > now);
    live().any(|h| h.id == hold) || live().filter(|h| h.amount == 0).count() < MAX_WAITING_HOLDS
}

/// Whether the key has [`MAX_LEASE_HOLDS`] live holds, none of them `hold`'s.
fn crowded(state: Option<&State>, now: Micros, hold: HoldId) -> bool {
    let Some(State::Reserved(r)) = state else { return false };
    let mut live = r.holds.iter().filter(|h| h.until > now);
    live.clone().count() >= MAX_LEASE_HOLDS && !live.any(|h| h.id == hold)
}

/// How many holds of `state` are live at `now`.
pub fn live_holds(state: Option<&State>, now: Micros) -> u64 {
    match state {
        Some(State::Reserved(r)) => r.holds.iter().filter(|h| h.until > now).count() as u64,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{apply, decide, settle};

    const T0: Micros = 1_699_920_000_000_000; // a whole minute
    const SEC: Micros = 1_000_000;

    const LEASABLE: [Algorithm; 5] = [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ];

    fn limit(algorithm: Algorithm, requests: u64) -> Limit {
        Limit::new(algorithm, requests, 60 * SEC, None, None).unwrap().leasing().unwrap()
    }

    fn ask(hold: HoldId, want: u64) -> LeaseAsk {
        LeaseAsk { hold, want, cap: 100, ttl: 10 * SEC }
    }

    #[test]
    fn a_grant_takes_what_fits_within_the_cap_and_counts_until_settled() {
        for algorithm in LEASABLE {
            let l = limit(algorithm, 1000);
            let mut state = None;
            let (g, _) = grant(&l, &mut state, T0, ask(1, 70));
            assert_eq!(g.amount, 70, "{algorithm}");
            let (g, _) = grant(&l, &mut state, T0, ask(2, 70));
            assert_eq!(g.amount, 30, "{algorithm}: the cap of 100 holds 70 already");
            assert_eq!(grant(&l, &mut state, T0, ask(3, 1)).0.amount, 0, "{algorithm}: the cap is full");
            assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 900, "{algorithm}: held units count");
            // The first holder spent 50 of its 70: 50 are consumed, 20 come back.
            assert!(settle(&l, &mut state, T0 + SEC, 1, 50).0, "{algorithm}");
            assert!(!settle(&l, &mut state, T0 + SEC, 1, 50).0, "{algorithm}: a second settle charges nothing");
            assert_eq!(check(&l, state.as_ref(), T0 + SEC, 0).remaining, 1000 - 50 - 30, "{algorithm}");
        }
    }

    #[test]
    fn a_grant_never_takes_more_than_the_limit_has_left() {
        for algorithm in LEASABLE {
            let l = limit(algorithm, 1000);
            let mut state = None;
            apply(&l, &mut state, T0, 960);
            let (g, _) = grant(&l, &mut state, T0, ask(1, 100));
            assert_eq!(g.amount, 40, "{algorithm}");
            assert_eq!(g.after.remaining, 0, "{algorithm}");
            assert!(!check(&l, state.as_ref(), T0, 1).allowed, "{algorithm}: the lease holds the rest");
            assert!(!decide(&l, &mut state, T0, 1).allowed, "{algorithm}");
        }
    }

    #[test]
    fn a_window_lease_ends_with_its_window() {
        for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowCounter] {
            let l = limit(algorithm, 1000);
            let mut state = None;
            let (g, _) = grant(&l, &mut state, T0 + 55 * SEC, ask(1, 10));
            assert_eq!(g.lasts, 5 * SEC, "{algorithm}");
        }
        let l = limit(Algorithm::TokenBucket, 1000);
        assert_eq!(grant(&l, &mut None, T0 + 55 * SEC, ask(1, 10)).0.lasts, 10 * SEC);
    }

    #[test]
    fn an_unsettled_lease_frees_its_units_when_it_ends() {
        let l = limit(Algorithm::TokenBucket, 1000);
        let mut state = None;
        grant(&l, &mut state, T0, ask(1, 100));
        assert_eq!(check(&l, state.as_ref(), T0 + 10 * SEC - 1, 0).remaining, 900);
        assert_eq!(check(&l, state.as_ref(), T0 + 10 * SEC, 0).remaining, 1000);
        assert!(!settle(&l, &mut state, T0 + 10 * SEC, 1, 100).0, "a settle after the end charges nothing");
    }

    /// Askers waiting on a key whose bound is out are counted, up to MAX_WAITING_HOLDS: asks
    /// under ever fresh hold ids leave the key's holds bounded and every answer the same.
    #[test]
    fn holds_of_nothing_are_bounded_per_key() {
        for algorithm in LEASABLE {
            let l = limit(algorithm, 1000);
            let mut state = None;
            assert_eq!(grant(&l, &mut state, T0, ask(1, 100)).0.amount, 100, "{algorithm}");
            let first = grant(&l, &mut state, T0, ask(2, 1)).0;
            assert_eq!((first.amount, first.holders), (0, 2), "{algorithm}: the asker is counted in");
            for hold in 3..3000 {
                let answer = grant(&l, &mut state, T0 + hold, ask(hold, 1)).0;
                assert_eq!((answer.amount, answer.after.remaining), (0, 900), "{algorithm}: ask {hold}");
            }
            assert_eq!(live_holds(state.as_ref(), T0 + 3000), 1 + MAX_WAITING_HOLDS as u64, "{algorithm}");
            // One already waiting asks again: still counted, nothing added.
            assert_eq!(grant(&l, &mut state, T0 + 3000, ask(2, 1)).0.holders, 1 + MAX_WAITING_HOLDS as u64);
        }
    }

    /// Slices of one unit under fresh hold ids, with an overshoot bound far above
    /// MAX_LEASE_HOLDS: the key keeps at most that many holds, and what it holds counts.
    #[test]
    fn lease_holds_are_bounded_per_key() {
        for algorithm in LEASABLE {
            let l = limit(algorithm, 100_000);
            let mut state = None;
            let wide = |hold| LeaseAsk { hold, want: 1, cap: 10_000, ttl: 10 * SEC };
            let granted: u64 = (1..=1000).map(|hold| grant(&l, &mut state, T0, wide(hold)).0.amount).sum();
            assert_eq!(granted, MAX_LEASE_HOLDS as u64, "{algorithm}");
            assert_eq!(live_holds(state.as_ref(), T0), MAX_LEASE_HOLDS as u64, "{algorithm}");
            assert_eq!(check(&l, state.as_ref(), T0, 0).remaining, 100_000 - MAX_LEASE_HOLDS as u64, "{algorithm}");
            // A recorded holder still renews; once a slice is settled, a new holder gets its place.
            assert_eq!(grant(&l, &mut state, T0, wide(7)).0.amount, 1, "{algorithm}");
            assert!(settle(&l, &mut state, T0, 8, 1).0, "{algorithm}");
            assert_eq!(grant(&l, &mut state, T0, wide(5000)).0.amount, 1, "{algorithm}");
        }
    }

    #[test]
    fn hold_zero_or_nothing_left_grants_nothing_and_writes_nothing() {
        let l = limit(Algorithm::FixedWindow, 10);
        let mut state = None;
        assert_eq!(grant(&l, &mut state, T0, ask(0, 5)).0.amount, 0);
        assert_eq!(state, None);
        apply(&l, &mut state, T0, 10);
        let before = state.clone();
        assert_eq!(
            grant(&l, &mut state, T0, ask(1, 5)),
            (LeaseGrant { amount: 0, lasts: 0, after: check(&l, before.as_ref(), T0, 0), holders: 0 }, None)
        );
        assert_eq!(state, before);
    }
}
