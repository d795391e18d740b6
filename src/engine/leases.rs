//! The quota leases an enforcer holds ([`crate::algorithm::lease`]): which keys of leased rules
//! are hot here, the slices of their quota held, and what a request's leased rules decide
//! without asking the store.
//!
//! Pure bookkeeping on `now` (the enforcer's clock, µs): the engine asks the store for the
//! renewals this table plans and hands back what the store granted.
//!
//! - **Hot or cold.** Each (rule, key) a request reaches counts its units per second. A key is
//!   worth a slice once it has seen [`HOT_UNITS`] units in the last second; until then, and for
//!   the millions of keys that never get there, decisions go to the store as for an exact rule.
//!   The table holds at most `max_keys` keys: past that, new keys stay exact.
//! - **Slices.** A hot key's slice is what the key's demand here spends in a quarter of the
//!   rule's staleness, at most a quarter of the rule's bound (so several enforcers can hold one
//!   at once). The holder spends it until [`Held::stop_at`]: the store's lifetime for it,
//!   measured from when it was asked for, less a margin, so the holder's clock can only end it
//!   early. A lease spent out, or at its end, is settled with what it spent, in the renewal
//!   that asks for the next slice or by the keeper ([`QuotaLeases::due`]).
//! - **Renewed ahead.** Once a slice is down to its last quarter (of its units or of its life),
//!   the request that finds it so renews it: one call settles what it spent so far and asks for
//!   the next slice, at least as large as what is left. The slice goes on serving the requests
//!   that arrive meanwhile (a batch of checks, other connections), so nothing waits for a
//!   renewal and nothing goes to the store for want of a slice; what they spend is charged to
//!   the new slice when it comes. The call frees the old slice's rest before granting, so the
//!   store can always grant that much again: the units spent meanwhile are covered, and the
//!   bound is unchanged (one slice per holder and key, as before).
//! - **Dry keys.** When the store grants nothing because the key has nothing left, the holder
//!   refuses that key's requests itself for a while (the window's rest, at most the staleness;
//!   a quarter of it for the bucket algorithms, which refill all the time) instead of asking
//!   again for each: units given back meanwhile by other holders wait that long (an
//!   undershoot, never an overshoot). When the store grants nothing
//!   because the bound is taken by others' slices, the key is decided by the store meanwhile.

use crate::store::QuotaLeaseStatus;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::algorithm::lease::{LeaseAsk, LeaseGrant};
use crate::algorithm::{Decision, HoldId, Limit, Micros};
use crate::rule::{Leasing, PrehashedHasher, RuleId};

/// Units a key must see in a second here before it is decided from slices.
pub const HOT_UNITS: u64 = 16;
/// Keys the table follows by default.
pub const DEFAULT_MAX_KEYS: usize = 65_536;
const SECOND: Micros = 1_000_000;
/// A key untouched this long, holding nothing, is forgotten.
const IDLE: Micros = 5 * SECOND;
/// So close to its window's end a key is decided by the store: a slice asked for now could be
/// spent for a moment at most (it stops a margin before the window does), for two calls.
const WINDOW_END: Micros = 3_000;

/// One leased rule of a request, as the table needs it.
#[derive(Clone, Copy, Debug)]
pub struct LeasedCheck<'a> {
    pub rule: RuleId,
    pub limit: &'a Limit,
    pub key: &'a [u8],
    pub cost: u64,
    pub leasing: Leasing,
}

/// A slice held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub hold: HoldId,
    pub amount: u64,
    pub spent: u64,
    /// When this holder stops spending it (its clock).
    pub stop_at: Micros,
    /// When the key is back to a full quota, as the store said at the grant (its clock).
    pub reset_at: Micros,
    /// When it was asked for (its clock): with `stop_at`, the slice's life here.
    pub from: Micros,
    /// When the store lets it go (its clock, measured as `stop_at`): a fixed window's slice
    /// ending with its window needs no settle, the window's count going with it.
    pub ends: Micros,
    /// A renewal ahead is out that settled this many of `spent`: what is spent past it is
    /// charged to the next slice.
    pub settled: Option<u64>,
}

impl Held {
    fn has_room(&self, now: Micros, cost: u64) -> bool {
        self.stop_at > now && self.amount - self.spent >= cost
    }

    /// Down to its last quarter, of units or of life, once `cost` is spent now: time to renew,
    /// while this slice still serves the requests that arrive meanwhile. Life counts only where
    /// a new slice could outlive this one: a slice that ends with its window (the key resets
    /// then) is renewed by units, or after the window, never again and again as the window's
    /// end nears.
    fn running_low(&self, now: Micros, cost: u64) -> bool {
        let left = self.amount - self.spent - cost;
        // Saturating: a wall clock stepped back between the ask and the grant must not panic.
        let life = self.stop_at.saturating_sub(self.from);
        let outlivable = self.reset_at > self.stop_at.saturating_add(life / 2);
        left < self.amount.div_ceil(4) || (outlivable && self.stop_at.saturating_sub(now) < life / 4)
    }
}

#[derive(Debug)]
struct Entry {
    rule: RuleId,
    key: Box<[u8]>,
    namespace: Box<str>,
    limit: Limit,
    /// Units seen in the current second (starting at `second`) and the one before.
    second: Micros,
    this_second: u64,
    last_second: u64,
    held: Option<Held>,
    renewing: bool,
    /// Until then the key is refused here: the store had nothing left.
    dry_until: Micros,
    /// Until then the key is decided by the store: the bound was taken, or the store failed.
    exact_until: Micros,
    /// Holders sharing the key's bound, as the last grant said.
    holders: u64,
    /// When the key's window ends, as the last grant said (window algorithms; 0: unknown).
    window_ends: Micros,
    /// The hold of nothing the store keeps for this holder while the bound is out in others'
    /// slices (it counts this holder in), given back with the next renewal.
    waiting: Option<HoldId>,
    seen_at: Micros,
}

impl Entry {
    fn count(&mut self, now: Micros, units: u64) {
        if now >= self.second + SECOND {
            self.last_second = if now >= self.second + 2 * SECOND { 0 } else { self.this_second };
            self.this_second = 0;
            self.second = now - now % SECOND;
        }
        self.this_second = self.this_second.saturating_add(units);
        self.seen_at = now;
    }

    /// Units per second seen here lately: this second's so far or the last one's, whichever is
    /// more.
    fn demand(&self) -> u64 {
        self.this_second.max(self.last_second)
    }
}

/// A renewal to run: settle what the old slice spent and ask for a new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// Index of the check in the request.
    pub index: usize,
    pub settle: Option<(HoldId, u64)>,
    pub ask: LeaseAsk,
}

/// A slice to settle without asking for another: spent out, or at its end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    pub namespace: Box<str>,
    pub rule: RuleId,
    pub key: Box<[u8]>,
    pub limit: Limit,
    pub hold: HoldId,
    pub spent: u64,
}

/// What the table says of a request whose rules are all leased.
#[derive(Debug, PartialEq, Eq)]
pub enum Local {
    /// Decided here: admitted from slices (one decision per check), or refused by a dry key
    /// (its index; the other checks were not decided). `ahead`: slices running low, to renew
    /// now (the request is admitted whatever the renewal brings).
    Admitted {
        decisions: Vec<Decision>,
        ahead: Vec<Renewal>,
    },
    Refused {
        by: usize,
        decision: Decision,
    },
    /// Ask the store for these slices, then ask the table again.
    Renew(Vec<Renewal>),
    /// Let the store decide.
    Store,
}

/// Counts for metrics.
#[derive(Debug, Default)]
pub struct LeaseCounters {
    pub admitted_locally: AtomicU64,
    pub refused_locally: AtomicU64,
    pub to_store: AtomicU64,
    pub grants: AtomicU64,
    pub empty_grants: AtomicU64,
    pub units_granted: AtomicU64,
    pub units_spent: AtomicU64,
    pub units_returned: AtomicU64,
    pub store_calls: AtomicU64,
    pub store_failures: AtomicU64,
}

pub struct QuotaLeases {
    /// By a 128-bit digest of (rule, key): a lookup allocates nothing.
    entries: Mutex<HashMap<u128, Entry, BuildHasherDefault<PrehashedHasher>>>,
    seeds: (ahash::RandomState, ahash::RandomState),
    /// Slices to settle that left the table outside [`QuotaLeases::due`]'s scan (a renewal's
    /// settle that failed, a grant too short to use), for its next run.
    pending: Mutex<Vec<Due>>,
    /// The keys holding a slice (taken after `entries`): what the keeper scans every few
    /// milliseconds, instead of every key followed.
    holding: Mutex<std::collections::HashSet<u128, BuildHasherDefault<PrehashedHasher>>>,
    /// When idle keys were last forgotten (a scan of every key, once a second).
    last_sweep: AtomicU64,
    max_keys: usize,
    pub counters: LeaseCounters,
}

/// How far ahead of the store's end a holder stops spending a slice it was given for `lasts`.
fn margin(lasts: Micros) -> Micros {
    lasts / 10 + 2_000
}

impl QuotaLeases {
    pub fn new(max_keys: usize) -> QuotaLeases {
        QuotaLeases {
            entries: Mutex::new(HashMap::default()),
            seeds: (ahash::RandomState::new(), ahash::RandomState::new()),
            pending: Mutex::new(Vec::new()),
            holding: Mutex::new(std::collections::HashSet::default()),
            last_sweep: AtomicU64::new(0),
            max_keys,
            counters: LeaseCounters::default(),
        }
    }

    fn digest(&self, rule: RuleId, key: &[u8]) -> u128 {
        let half = |state: &ahash::RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write_u64(rule);
            hasher.write(key);
            hasher.finish()
        };
        (u128::from(half(&self.seeds.0)) << 64) | u128::from(half(&self.seeds.1))
    }

    /// What the table holds and has done, for `/v1/snapshot` and metrics.
    pub fn status(&self) -> QuotaLeaseStatus {
        let (keys, (held, units_held)) = {
            let entries = self.entries.lock();
            let held = entries
                .values()
                .filter_map(|e| e.held)
                .fold((0, 0), |(n, units), h| (n + 1, units + (h.amount - h.spent)));
            (entries.len() as u64, held)
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QuotaLeaseStatus {
            keys,
            held,
            units_held,
            admitted_locally: get(&c.admitted_locally),
            refused_locally: get(&c.refused_locally),
            to_store: get(&c.to_store),
            grants: get(&c.grants),
            empty_grants: get(&c.empty_grants),
            units_granted: get(&c.units_granted),
            units_spent: get(&c.units_spent),
            units_returned: get(&c.units_returned),
            renewals: get(&c.store_calls),
            renewal_failures: get(&c.store_failures),
        }
    }

    /// Decides a request whose every rule is leased and enforcing, from the slices held, if it
    /// can. `may_renew`: whether the caller will run renewals (once per request).
    pub fn decide(&self, namespace: &str, checks: &[LeasedCheck<'_>], now: Micros, may_renew: bool) -> Local {
        let mut entries = self.entries.lock();
        let mut spendable = true;
        // A rule not spendable that cannot be renewed either: the store decides the request.
        let mut store_decides = false;
        let mut renewals = Vec::new();
        // Checks whose slice serves them but runs low: renewed ahead if the request is admitted.
        let mut ahead = Vec::new();
        for (index, check) in checks.iter().enumerate() {
            let full = entries.len() >= self.max_keys;
            let slot = self.digest(check.rule, check.key);
            let entry = match entries.get_mut(&slot) {
                Some(entry) => entry,
                None if full => return self.to_store(),
                None => entries.entry(slot).or_insert_with(|| Entry {
                    rule: check.rule,
                    key: check.key.into(),
                    namespace: namespace.into(),
                    limit: check.limit.clone(),
                    second: now - now % SECOND,
                    this_second: 0,
                    last_second: 0,
                    held: None,
                    renewing: false,
                    dry_until: 0,
                    exact_until: 0,
                    holders: 4,
                    window_ends: 0,
                    waiting: None,
                    seen_at: now,
                }),
            };
            entry.count(now, check.cost);
            if entry.limit != *check.limit {
                // The rule was edited: slices of the old limit are settled as they end.
                entry.limit = check.limit.clone();
            }
            let window_ending = entry.window_ends > now && entry.window_ends - now < WINDOW_END;
            if let Some(held) = entry.held
                && held.has_room(now, check.cost)
            {
                if may_renew
                    && !window_ending
                    && !entry.renewing
                    && entry.exact_until <= now
                    && entry.demand() >= HOT_UNITS
                    && held.running_low(now, check.cost)
                {
                    ahead.push(index);
                }
                continue;
            }
            if entry.dry_until > now {
                let decision = Decision {
                    allowed: false,
                    remaining: 0,
                    reset_after: entry.held.map_or(0, |h| h.reset_at.saturating_sub(now)),
                    retry_after: Some(entry.dry_until - now),
                    delay: 0,
                };
                self.counters.refused_locally.fetch_add(1, Ordering::Relaxed);
                return Local::Refused { by: index, decision };
            }
            spendable = false;
            let hot = entry.demand() >= HOT_UNITS;
            if store_decides || !may_renew || entry.renewing || entry.exact_until > now || !hot || window_ending {
                // Decided by the store: keep looking for a dry key that refuses it here.
                store_decides = true;
                continue;
            }
            renewals.push(ask(index, check, entry));
        }
        if spendable {
            let mut decisions = Vec::with_capacity(checks.len());
            for check in checks {
                let Some(entry) = entries.get_mut(&self.digest(check.rule, check.key)) else { continue };
                let Some(held) = entry.held.as_mut() else { continue };
                held.spent += check.cost;
                decisions.push(Decision {
                    allowed: true,
                    remaining: held.amount - held.spent,
                    reset_after: held.reset_at.saturating_sub(now),
                    retry_after: None,
                    delay: 0,
                });
            }
            self.counters.units_spent.fetch_add(checks.iter().map(|c| c.cost).sum(), Ordering::Relaxed);
            self.counters.admitted_locally.fetch_add(1, Ordering::Relaxed);
            let mut renewals = Vec::with_capacity(ahead.len());
            for index in ahead {
                let check = &checks[index];
                let Some(entry) = entries.get_mut(&self.digest(check.rule, check.key)) else { continue };
                let mut renewal = ask(index, check, entry);
                let entry_holders = entry.holders.max(1);
                let Some(held) = entry.held.as_mut() else { continue };
                // What is left on top of a slice's worth, within the share: the call frees the
                // rest first, so the store can always grant at least that much again, which
                // covers what this slice serves while the renewal is out, and each call still
                // brings a slice's worth of new units.
                let left = held.amount - held.spent;
                let share = check.leasing.max_overshoot / entry_holders;
                renewal.ask.want = renewal.ask.want.saturating_add(left).min(share.max(left));
                renewal.settle = Some((held.hold, held.spent));
                held.settled = Some(held.spent);
                renewal.ask.hold = new_hold();
                entry.renewing = true;
                renewals.push(renewal);
            }
            return Local::Admitted { decisions, ahead: renewals };
        }
        // Renew only when every rule not spendable can be renewed: a rule the store must decide
        // anyway sends the request there, and a slice would sit unused.
        if store_decides {
            return self.to_store();
        }
        for renewal in &mut renewals {
            let check = &checks[renewal.index];
            let Some(entry) = entries.get_mut(&self.digest(check.rule, check.key)) else { continue };
            entry.renewing = true;
            // The old slice is done: no more spending from it; its spent units are settled with
            // the new one's asking.
            renewal.settle = match (entry.held.take(), entry.waiting.take()) {
                (Some(h), _) => {
                    self.counters.units_returned.fetch_add(h.amount - h.spent, Ordering::Relaxed);
                    Some((h.hold, h.spent))
                }
                (None, waiting) => waiting.map(|hold| (hold, 0)),
            };
            renewal.ask.hold = new_hold();
        }
        Local::Renew(renewals)
    }

    fn to_store(&self) -> Local {
        self.counters.to_store.fetch_add(1, Ordering::Relaxed);
        Local::Store
    }

    /// Takes what the store answered to `renewals` (asked at `sent_at`): new slices held, dry
    /// keys marked; on `Err`, the keys go to the store for a while, and the slices the renewal
    /// was to settle are settled by the next [`QuotaLeases::due`].
    pub fn renewed(
        &self,
        checks: &[LeasedCheck<'_>],
        renewals: &[Renewal],
        grants: Result<&[LeaseGrant], ()>,
        sent_at: Micros,
        now: Micros,
    ) {
        let mut entries = self.entries.lock();
        let mut returned = Vec::new();
        self.counters.store_calls.fetch_add(1, Ordering::Relaxed);
        for (i, renewal) in renewals.iter().enumerate() {
            let check = &checks[renewal.index];
            let slot = self.digest(check.rule, check.key);
            let Some(entry) = entries.get_mut(&slot) else { continue };
            entry.renewing = false;
            // Renewed ahead: the old slice stops here; what it served since the renewal left is
            // charged to the new one (on a failure, settled by the keeper with all it spent).
            let grant = match grants {
                Ok(grants) => grants.get(i).copied(),
                Err(()) => None,
            };
            let mut spent_meanwhile = 0;
            let mut settle = renewal.settle;
            if let Some(old) = entry.held.take_if(|held| held.settled.is_some()) {
                self.counters.units_returned.fetch_add(old.amount - old.spent, Ordering::Relaxed);
                if grant.is_some() {
                    // The store settled what the slice had spent when the call left, and freed
                    // its rest before granting: what it served since is the new slice's.
                    spent_meanwhile = old.spent - old.settled.unwrap_or(old.spent);
                } else {
                    // Not known to have reached the store: the keeper settles all it spent.
                    settle = Some((old.hold, old.spent));
                }
            }
            // A key the store had nothing left of is refused here until its window ends, for at
            // most the staleness (a bucket, which refills all the time: a quarter of it); a key
            // whose bound others hold asks again sooner (slices of a hot key turn over quickly).
            let pause = (check.leasing.staleness / 4).max(1_000);
            let dry_pause = if windowed(check.limit) { check.leasing.staleness } else { pause };
            let busy_pause = (check.leasing.staleness / 50).max(1_000);
            let Some(grant) = grant else {
                self.counters.store_failures.fetch_add(1, Ordering::Relaxed);
                entry.exact_until = now + pause;
                if let Some((hold, spent)) = settle {
                    // Not known to be settled: try again from the keeper.
                    returned.push(due(entry, hold, spent));
                }
                continue;
            };
            let stop_at = (sent_at + grant.lasts).saturating_sub(margin(grant.lasts));
            if windowed(check.limit) {
                entry.window_ends = sent_at + grant.after.reset_after;
            }
            if grant.amount == 0 || stop_at <= now {
                self.counters.empty_grants.fetch_add(1, Ordering::Relaxed);
                if grant.amount > 0 {
                    // Too short to use (the window ends first): give it back, with what was
                    // spent meanwhile; no slice can be had before the window turns.
                    entry.exact_until = (sent_at + grant.lasts).max(now + 1_000);
                    self.counters.units_returned.fetch_add(grant.amount, Ordering::Relaxed);
                    returned.push(due(entry, renewal.ask.hold, spent_meanwhile.min(grant.amount)));
                } else if grant.after.remaining < check.cost {
                    entry.dry_until = now + dry_pause.min(grant.after.reset_after.max(1_000));
                } else {
                    // The store counted this holder in (a hold of nothing): the others leave
                    // it a share at their next renewals.
                    entry.holders = grant.holders.max(1);
                    entry.waiting = Some(renewal.ask.hold);
                    entry.exact_until = now + busy_pause;
                }
                continue;
            }
            // More holders count at once; fewer only one at a time: holders falling away at a
            // window's end (dry, or their slices lapsing) would otherwise have the next window's
            // first askers take the whole bound and leave the others nothing.
            entry.holders = grant.holders.max(entry.holders.saturating_sub(1)).max(1);
            self.counters.grants.fetch_add(1, Ordering::Relaxed);
            self.counters.units_granted.fetch_add(grant.amount, Ordering::Relaxed);
            self.holding.lock().insert(slot);
            entry.held = Some(Held {
                hold: renewal.ask.hold,
                amount: grant.amount,
                spent: spent_meanwhile.min(grant.amount),
                stop_at,
                reset_at: sent_at + grant.after.reset_after,
                from: sent_at,
                ends: sent_at + grant.lasts,
                settled: None,
            });
        }
        drop(entries);
        if !returned.is_empty() {
            self.pending.lock().extend(returned);
        }
    }

    /// Slices at their end (or `all` of them, when the process stops), taken out to be settled,
    /// and keys idle long enough forgotten. A slice spent out is settled with the renewal that
    /// follows it, or here at its end: one call either way. Run every few milliseconds: a slice must be settled
    /// within its margin.
    pub fn due(&self, now: Micros, all: bool) -> Vec<Due> {
        let mut out = std::mem::take(&mut *self.pending.lock());
        let mut entries = self.entries.lock();
        let mut holding = self.holding.lock();
        holding.retain(|slot| {
            let Some(entry) = entries.get_mut(slot) else { return false };
            match entry.held {
                Some(held) if all || held.stop_at <= now => {
                    // A fixed window's slice that ends with its window: the window's count goes
                    // with it, so what it spent cannot escape and settling it now frees nothing
                    // worth a call. It is left for the key's next renewal to settle (in the same
                    // call, freeing its hold before the store grants the next window's slices),
                    // and forgotten once its window is long over.
                    let with_its_window = entry.limit.algorithm() == crate::algorithm::Algorithm::FixedWindow
                        && held.ends >= held.reset_at;
                    if !all && with_its_window && now < held.ends + SECOND {
                        return true;
                    }
                    entry.held = None;
                    self.counters.units_returned.fetch_add(held.amount - held.spent, Ordering::Relaxed);
                    if all || !with_its_window {
                        out.push(due(entry, held.hold, held.spent));
                    }
                    false
                }
                Some(_) => true,
                // Taken by a renewal since.
                None => false,
            }
        });
        drop(holding);
        if now >= self.last_sweep.load(Ordering::Relaxed) + SECOND {
            self.last_sweep.store(now, Ordering::Relaxed);
            entries.retain(|_, entry| entry.held.is_some() || entry.renewing || now < entry.seen_at + IDLE);
        }
        out
    }
}

/// The renewal of `check`'s key (its hold id and settle filled in by the caller): what the key's
/// demand here spends in a quarter of the staleness, and no more than this holder's share of the
/// bound among the holders the store last counted.
fn ask(index: usize, check: &LeasedCheck<'_>, entry: &Entry) -> Renewal {
    let share = check.leasing.max_overshoot / entry.holders.max(1);
    let want = (entry.demand().saturating_mul(check.leasing.staleness) / (4 * SECOND)).min(share).max(check.cost);
    Renewal {
        index,
        settle: None,
        ask: LeaseAsk { hold: 0, want, cap: check.leasing.max_overshoot, ttl: check.leasing.staleness },
    }
}

/// A fresh hold id: random, never 0 (no hold), within a double's exact integers (Lua).
fn new_hold() -> HoldId {
    rand::random::<u64>() >> 11 | 1
}

/// The window algorithms: a key's slices end with its window.
fn windowed(limit: &Limit) -> bool {
    matches!(
        limit.algorithm(),
        crate::algorithm::Algorithm::FixedWindow | crate::algorithm::Algorithm::SlidingWindowCounter
    )
}

fn due(entry: &Entry, hold: HoldId, spent: u64) -> Due {
    Due {
        namespace: entry.namespace.clone(),
        rule: entry.rule,
        key: entry.key.clone(),
        limit: entry.limit.clone(),
        hold,
        spent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    const T0: Micros = 1_700_000_040_000_000;
    const MS: Micros = 1_000;

    fn limit() -> Limit {
        Limit::new(Algorithm::FixedWindow, 1000, 60 * SECOND, None, None).unwrap().leasing().unwrap()
    }

    fn check<'a>(limit: &'a Limit, key: &'a [u8]) -> LeasedCheck<'a> {
        LeasedCheck { rule: 1, limit, key, cost: 1, leasing: Leasing { max_overshoot: 100, staleness: SECOND } }
    }

    fn grant(amount: u64, remaining: u64) -> LeaseGrant {
        LeaseGrant {
            amount,
            lasts: SECOND,
            after: Decision { allowed: true, remaining, reset_after: 30 * SECOND, retry_after: None, delay: 0 },
            holders: 1,
        }
    }

    /// Sends requests until the table asks for a slice; returns the renewals and the time.
    fn until_renewal(table: &QuotaLeases, checks: &[LeasedCheck<'_>], mut now: Micros) -> (Vec<Renewal>, Micros) {
        for _ in 0..HOT_UNITS + 1 {
            match table.decide("default", checks, now, true) {
                Local::Renew(renewals) => return (renewals, now),
                Local::Store => now += MS,
                other => panic!("{other:?}"),
            }
        }
        panic!("no renewal after {HOT_UNITS} units")
    }

    #[test]
    fn a_cold_key_goes_to_the_store_and_a_hot_one_asks_for_a_slice() {
        let table = QuotaLeases::new(100);
        let l = limit();
        let checks = [check(&l, b"k")];
        let (renewals, now) = until_renewal(&table, &checks, T0);
        assert_eq!(table.counters.to_store.load(Ordering::Relaxed), HOT_UNITS - 1, "cold until {HOT_UNITS} units");
        assert_eq!(renewals.len(), 1);
        let r = renewals[0];
        assert_eq!(r.settle, None);
        assert!(r.ask.hold != 0 && r.ask.cap == 100);
        assert!(r.ask.want >= 1 && r.ask.want <= 25, "a quarter of the bound at most: {}", r.ask.want);
        // While the renewal is out, others go to the store rather than ask again.
        assert_eq!(table.decide("default", &checks, now, true), Local::Store);
        table.renewed(&checks, &renewals, Ok(&[grant(5, 900)]), now, now);
        for i in 0..5 {
            match table.decide("default", &checks, now + MS, false) {
                Local::Admitted { decisions: d, .. } => assert_eq!(d[0].remaining, 4 - i),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(table.decide("default", &checks, now + MS, false), Local::Store, "spent out, no renewal asked");
        let (renewals, _) = until_renewal(&table, &checks, now + 2 * MS);
        assert_eq!(renewals[0].settle.map(|(_, spent)| spent), Some(5), "the spent slice is settled with the next ask");
    }

    /// Spends one unit of `checks` at `now`; the renewals asked for ahead.
    fn spend(table: &QuotaLeases, checks: &[LeasedCheck<'_>], now: Micros) -> Vec<Renewal> {
        match table.decide("default", checks, now, true) {
            Local::Admitted { ahead, .. } => ahead,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_slice_running_low_is_renewed_ahead_while_it_keeps_serving() {
        let table = QuotaLeases::new(100);
        let l = limit();
        let checks = [check(&l, b"k")];
        let (renewals, now) = until_renewal(&table, &checks, T0);
        table.renewed(&checks, &renewals, Ok(&[grant(8, 900)]), now, now);
        let first = renewals[0].ask.hold;
        // Six units leave two: not low yet. The seventh leaves one, under a quarter: renew ahead,
        // settling the seven spent and asking for at least the one left.
        for _ in 0..6 {
            assert!(spend(&table, &checks, now + MS).is_empty());
        }
        let ahead = spend(&table, &checks, now + MS);
        assert_eq!(ahead.len(), 1, "asked ahead by the request that found the slice low");
        assert_eq!(ahead[0].settle, Some((first, 7)));
        assert!(ahead[0].ask.want >= 1 && ahead[0].ask.hold != first);
        // While the renewal is out the slice serves its last unit, and nobody asks again.
        assert!(spend(&table, &checks, now + MS).is_empty());
        assert_eq!(table.decide("default", &checks, now + MS, true), Local::Store, "spent out, the renewal out");
        // The grant arrives: the unit served meanwhile is the new slice's.
        table.renewed(&checks, &ahead, Ok(&[grant(8, 800)]), now + MS, now + 2 * MS);
        match table.decide("default", &checks, now + 2 * MS, false) {
            Local::Admitted { decisions, .. } => assert_eq!(decisions[0].remaining, 6, "8 granted, 1 + 1 spent"),
            other => panic!("{other:?}"),
        }
        assert_eq!(table.status().held, 1, "one slice per key, as before");
        assert_eq!(table.counters.units_spent.load(Ordering::Relaxed), 9);
        // A renewal ahead that fails: the keeper settles all the slice spent, the key goes to
        // the store for a while.
        let mut ahead = Vec::new();
        for _ in 0..6 {
            ahead = spend(&table, &checks, now + 3 * MS);
            if !ahead.is_empty() {
                break;
            }
        }
        let (hold, settled) = ahead[0].settle.expect("settles what it spent");
        assert!(spend(&table, &checks, now + 3 * MS).is_empty());
        table.renewed(&checks, &ahead, Err(()), now + 3 * MS, now + 4 * MS);
        assert_eq!(table.decide("default", &checks, now + 4 * MS, true), Local::Store);
        let due = table.due(now + 4 * MS, false);
        assert_eq!(due.iter().map(|d| (d.hold, d.spent)).collect::<Vec<_>>(), vec![(hold, settled + 1)]);
    }

    #[test]
    fn a_key_the_store_has_nothing_left_of_is_refused_here_for_a_while() {
        let table = QuotaLeases::new(100);
        let l = limit();
        let checks = [check(&l, b"k")];
        let (renewals, now) = until_renewal(&table, &checks, T0);
        table.renewed(&checks, &renewals, Ok(&[grant(0, 0)]), now, now);
        match table.decide("default", &checks, now + MS, true) {
            Local::Refused { by: 0, decision } => {
                assert!(!decision.allowed);
                assert_eq!(
                    decision.retry_after,
                    Some(SECOND - MS),
                    "a window key: the staleness (the window ends later)"
                );
            }
            other => panic!("{other:?}"),
        }
        // Nothing granted because others hold the bound: the store decides, nothing is refused here.
        let table = QuotaLeases::new(100);
        let (renewals, now) = until_renewal(&table, &checks, T0);
        table.renewed(&checks, &renewals, Ok(&[grant(0, 500)]), now, now);
        assert_eq!(table.decide("default", &checks, now + MS, true), Local::Store);
        assert!(matches!(table.decide("default", &checks, now + SECOND, true), Local::Renew(_)), "asks again later");
    }

    #[test]
    fn a_slice_stops_before_the_store_ends_it_and_is_settled_with_what_it_spent() {
        let table = QuotaLeases::new(100);
        let l = limit();
        let checks = [check(&l, b"k")];
        let (renewals, now) = until_renewal(&table, &checks, T0);
        table.renewed(&checks, &renewals, Ok(&[grant(50, 900)]), now, now);
        assert!(matches!(table.decide("default", &checks, now + 10 * MS, false), Local::Admitted { .. }));
        assert!(table.due(now + 800 * MS, false).is_empty());
        // Stops a tenth and 2 ms ahead of the second the store gave it.
        let stop = now + SECOND - SECOND / 10 - 2 * MS;
        assert_eq!(table.decide("default", &checks, stop, false), Local::Store);
        let due = table.due(stop, false);
        assert_eq!(due.len(), 1);
        assert_eq!((due[0].hold, due[0].spent), (renewals[0].ask.hold, 1));
        assert_eq!(table.counters.units_returned.load(Ordering::Relaxed), 49);
        // A failed renewal sends the key to the store for a while, and what it was to settle is
        // settled by the keeper.
        let (renewals, now) = until_renewal(&table, &checks, stop + MS);
        table.renewed(&checks, &renewals, Ok(&[grant(20, 900)]), now, now);
        assert!(matches!(table.decide("default", &checks, now, false), Local::Admitted { .. }));
        let (renewals, now) = (
            match table.decide("default", &checks, now + 950 * MS, true) {
                Local::Renew(r) => r,
                other => panic!("{other:?}"),
            },
            now + 950 * MS,
        );
        assert_eq!(renewals[0].settle.map(|(_, spent)| spent), Some(1));
        table.renewed(&checks, &renewals, Err(()), now, now);
        assert_eq!(table.decide("default", &checks, now + MS, true), Local::Store);
        let due = table.due(now + MS, false);
        assert_eq!(due.iter().map(|d| (d.hold, d.spent)).collect::<Vec<_>>(), vec![(renewals[0].settle.unwrap().0, 1)]);
    }

    #[test]
    fn the_keeper_looks_at_held_slices_and_forgets_idle_keys_once_a_second() {
        let table = QuotaLeases::new(100_000);
        let l = limit();
        // Ten thousand cold keys followed, one hot key holding a slice.
        for i in 0..10_000u32 {
            let key = i.to_string();
            assert_eq!(table.decide("default", &[check(&l, key.as_bytes())], T0, true), Local::Store);
        }
        let hot = [check(&l, b"hot")];
        let (renewals, now) = until_renewal(&table, &hot, T0);
        table.renewed(&hot, &renewals, Ok(&[grant(5, 900)]), now, now);
        assert_eq!(table.holding.lock().len(), 1);
        assert!(table.due(now + MS, false).is_empty());
        // At the slice's stop it is settled; idle cold keys go once they are IDLE old.
        let due = table.due(now + SECOND, false);
        assert_eq!(due.len(), 1);
        assert!(table.holding.lock().is_empty());
        assert_eq!(table.status().keys, 10_001, "not idle yet");
        table.due(T0 + IDLE + 2 * SECOND, false);
        assert_eq!(table.status().keys, 0, "idle keys forgotten");
    }

    #[test]
    fn a_request_is_decided_here_only_when_every_rule_can_be() {
        let table = QuotaLeases::new(100);
        let l = limit();
        let both = [check(&l, b"hot"), LeasedCheck { rule: 2, ..check(&l, b"hot") }];
        let (renewals, now) = until_renewal(&table, &both, T0);
        assert_eq!(renewals.len(), 2, "both rules renew together");
        table.renewed(&both, &renewals, Ok(&[grant(3, 900), grant(0, 0)]), now, now);
        // The second rule's key is dry: the request is refused here, the first spends nothing.
        assert!(matches!(table.decide("default", &both, now + MS, true), Local::Refused { by: 1, .. }));
        assert_eq!(table.status().units_held, 3);
        // A table full of keys sends new ones to the store.
        let small = QuotaLeases::new(1);
        assert_eq!(small.decide("default", &[check(&l, b"a")], T0, true), Local::Store);
        assert_eq!(small.decide("default", &[check(&l, b"b")], T0, true), Local::Store);
        assert_eq!(small.status().keys, 1);
    }
}
