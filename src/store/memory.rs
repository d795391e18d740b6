//! The in-process store: sharded hash maps of compact per-key state.
//!
//! Keys are 128-bit digests of (rule identity, key): two aHash hashers under independent
//! per-process random keys. A key costs the same few bytes however long the header value it came
//! from, and without the keys nobody can aim collisions at another client's counter (aHash is
//! keyed for HashDoS resistance; 128 bits make accidental collisions negligible). It replaced
//! SipHash-1-3-128, which took about 45% of a single-rule decision's instructions. Each entry
//! remembers when its state becomes pristine again (full bucket, empty window); past that moment
//! it is dropped, because a missing key means exactly that state.
//!
//! # The key cap, fair per namespace
//!
//! A cap on live keys bounds memory under a flood of distinct keys. Every entry belongs to the
//! namespace whose request created it (its *scope*): [`Store::check_for`] and
//! [`MemoryStore::check_scoped_at`] take the request's namespace, interned once per request into a
//! 16-bit id that lives in 16 of the slot key's 128 bits (so the entry grows by nothing; 112 bits
//! are left to tell keys apart, still negligible collisions). Untagged checks ([`Store::check`],
//! [`MemoryStore::check_at`]) share one unnamed scope, reported as namespace `""`. Only
//! namespaces that have policies reach the store, so the ids are bounded; past 65,535 named
//! namespaces the rest share the unnamed scope.
//!
//! A full shard first drops what has expired. If it is still full it must evict (an eighth of its
//! entries at a time), and the guarantee is stated per shard, where a namespace's *share* is the
//! shard's capacity divided by the namespaces holding entries in it, the one asking for room
//! included:
//!
//! - a namespace holding no more than its share never loses an entry to another namespace's new
//!   keys, whatever the windows of either;
//! - a namespace above its share gives up only entries above it: the largest excess goes first
//!   (levelled down, max-min fairness), never below the share;
//! - when nobody else is above their share, the namespace asking for room evicts its own entries.
//!
//! So a namespace flooding distinct keys evicts its own, and a newcomer's first keys take room
//! from whoever holds more than the new share. Within a namespace the entries closest to pristine
//! go first. Keys spread evenly over shards, so the shares per shard are, up to sampling noise,
//! the shares of the whole cap. Evictions are counted in [`MemoryStats::evicted`] and per
//! namespace in [`MemoryStore::evictions_by_namespace`] (an evicted key starts over). A decision
//! on an existing key pays only for the interning; the per-namespace counts are taken while a
//! full shard is scanned for room anyway.

use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use super::{RuleCheck, RuleId, Store, StoreError};
use crate::algorithm::{self, Decision, Micros, State};
use crate::clock::{Clock, SystemClock};
use crate::rule::Verdict;

/// Default cap: a million counter keys' worth ([`UNIT_BYTES`] each), about 64 MB of state.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Keys per shard when the cap allows it; also the point below which one shard is used.
const TARGET_SHARD_KEYS: usize = 4096;
const MAX_SHARDS: usize = 256;

/// Where a slot key keeps its scope id: bits 64..80, clear of the shard index (the top bits) and
/// of the table hash (the low 64 bits).
const SCOPE_SHIFT: u32 = 64;
const SCOPE_MASK: u128 = (u16::MAX as u128) << SCOPE_SHIFT;

/// The namespace a request's entries are charged to under the key cap, interned per store by
/// [`MemoryStore::scope`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Scope(u16);

impl Scope {
    /// The scope of untagged checks (and of namespaces past the 65,535 named ones).
    pub const UNNAMED: Scope = Scope(0);
}

#[derive(Debug)]
struct Entry {
    state: State,
    /// When `state` is pristine again; the entry may be dropped from then on.
    expires_at: Micros,
}

/// A slot's identity (112 bits of the (rule, key) digest) plus the scope that owns it. Equality
/// and hashing ignore the scope, so a lookup finds the entry whichever scope asks.
#[derive(Clone, Copy, Debug)]
struct SlotKey(u128);

impl SlotKey {
    fn new(digest: u128, scope: Scope) -> SlotKey {
        SlotKey((digest & !SCOPE_MASK) | (u128::from(scope.0) << SCOPE_SHIFT))
    }
    fn scope(self) -> usize {
        ((self.0 & SCOPE_MASK) >> SCOPE_SHIFT) as usize
    }
}

impl PartialEq for SlotKey {
    fn eq(&self, other: &SlotKey) -> bool {
        (self.0 ^ other.0) & !SCOPE_MASK == 0
    }
}

impl Eq for SlotKey {}

impl Hash for SlotKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0 as u64);
    }
}

// Slot keys are already uniform hashes: their low half is the table hash.
type Slots = HashMap<SlotKey, Entry, BuildHasherDefault<crate::rule::PrehashedHasher>>;

/// One shard's entries, the units of memory they hold ([`units_of`]), and what its cap has
/// evicted, by scope id.
#[derive(Default)]
struct Table {
    slots: Slots,
    units: usize,
    evicted: Vec<u64>,
}

/// Bytes one unit of the cap stands for: about what an entry of a counter algorithm costs (the
/// slot key, the state and the table's own share), so `--max-keys` counter keys fit the cap.
pub const UNIT_BYTES: usize = 64;

/// What an entry holds of the cap: one unit, plus, for a sliding log of more than one entry,
/// its deque's allocation in units (16 bytes per entry it has room for, 96 of deque and box):
/// a log of 1000 entries holds about 250 units, so the cap bounds bytes, not only keys.
fn units_of(state: &State) -> usize {
    match state {
        State::Log(entries) => {
            1 + (96 + entries.capacity() * std::mem::size_of::<algorithm::LogEntry>()).div_ceil(UNIT_BYTES)
        }
        State::Holds(holds) => 1 + (holds.len() * std::mem::size_of::<algorithm::Hold>()).div_ceil(UNIT_BYTES),
        State::Reserved(r) => 2 + (r.holds.len() * std::mem::size_of::<algorithm::Hold>()).div_ceil(UNIT_BYTES),
        _ => 1,
    }
}

/// Removes consecutive duplicates from a sorted slice in place; returns the distinct count.
fn dedup_sorted(values: &mut [usize]) -> usize {
    let mut distinct = 0;
    for i in 0..values.len() {
        if distinct == 0 || values[i] != values[distinct - 1] {
            values[distinct] = values[i];
            distinct += 1;
        }
    }
    distinct
}

/// How many entries each scope gives up when `evict` must go from a shard whose scopes hold
/// `held` entries (indexed by scope id): the largest holders are levelled down, ties broken
/// towards the lower id. The quotas sum to `evict`, which must not exceed the entries held.
fn level_down(held: &[u32], evict: u32) -> Vec<u32> {
    let mut quotas = vec![0; held.len()];
    let mut order: Vec<usize> = (0..held.len()).filter(|&s| held[s] > 0).collect();
    order.sort_by_key(|&s| std::cmp::Reverse(held[s]));
    let Some(&largest) = order.first() else { return quotas };
    let (mut left, mut level, mut group) = (evict, held[largest], 0);
    loop {
        while group < order.len() && held[order[group]] == level {
            group += 1;
        }
        let next = order.get(group).map_or(0, |&s| held[s]);
        let to_next = group as u64 * u64::from(level - next);
        if to_next >= u64::from(left) || next == 0 {
            let (each, extra) = (left / group as u32, left as usize % group);
            // With `extra` > 0, `level - each` stays above `next`, so nobody goes below zero.
            let level = level.saturating_sub(each);
            for (i, &s) in order[..group].iter().enumerate() {
                quotas[s] = (held[s] - level + u32::from(i < extra)).min(held[s]);
            }
            return quotas;
        }
        left -= to_next as u32;
        level = next;
    }
}

/// How many entries each scope gives up when `evict` must go from a shard of `capacity` whose
/// scopes hold `held` (indexed by scope id) and `asking` needs room: first the entries above the
/// share (capacity / scopes holding entries, `asking` counted), largest excess first; what is
/// still missing, from `asking` itself.
fn eviction_quotas(held: &[u32], capacity: usize, evict: u32, asking: usize) -> Vec<u32> {
    let holders = held.iter().enumerate().filter(|&(scope, &h)| h > 0 || scope == asking).count().max(1);
    let share = u32::try_from(capacity / holders).unwrap_or(u32::MAX);
    let excess: Vec<u32> = held.iter().map(|&h| h.saturating_sub(share)).collect();
    let available: u64 = excess.iter().map(|&e| u64::from(e)).sum();
    let from_excess = u32::try_from(available.min(u64::from(evict))).unwrap_or(evict);
    let mut quotas = level_down(&excess, from_excess);
    if let (Some(quota), Some(&own)) = (quotas.get_mut(asking), held.get(asking)) {
        *quota += (evict - from_excess).min(own - *quota);
    }
    quotas
}

/// The `quota`-th smallest of `expiries` (reordered) and how many entries at exactly it are to
/// go besides those below it.
fn cut_at(expiries: &mut [Micros], quota: u32) -> (Micros, u32) {
    let (_, &mut threshold, _) = expiries.select_nth_unstable(quota as usize - 1);
    let below = expiries.iter().filter(|&&at| at < threshold).count() as u32;
    (threshold, quota - below)
}

/// [`cut_at`] for entries of several units: the expiry up to which entries go so that at least
/// `quota` units go, and how many units at exactly that expiry go besides those below it.
fn weighted_cut(entries: &mut [(Micros, u32)], quota: u32) -> (Micros, u32) {
    entries.sort_unstable_by_key(|&(expires_at, _)| expires_at);
    let mut taken: u32 = 0;
    let Some(&(threshold, _)) = entries.iter().find(|&&(_, size)| {
        taken = taken.saturating_add(size);
        taken >= quota
    }) else {
        // Not enough to meet the quota: all of them.
        return (Micros::MAX, 0);
    };
    let strictly_below: u32 = entries.iter().take_while(|&&(at, _)| at < threshold).map(|&(_, size)| size).sum();
    (threshold, quota.saturating_sub(strictly_below))
}

/// Namespace names to scope ids. Reads are lock-free (one `ArcSwap` load and one lookup);
/// a new namespace takes the lock once and republishes the map.
struct Scopes {
    ids: ArcSwap<HashMap<Box<str>, Scope, ahash::RandomState>>,
    /// Names by id; id 0 is the unnamed scope.
    names: Mutex<Vec<Box<str>>>,
}

impl Scopes {
    fn new() -> Scopes {
        let mut ids = HashMap::default();
        ids.insert("".into(), Scope::UNNAMED);
        Scopes { ids: ArcSwap::from_pointee(ids), names: Mutex::new(vec!["".into()]) }
    }

    fn intern(&self, namespace: &str) -> Scope {
        if let Some(&scope) = self.ids.load().get(namespace) {
            return scope;
        }
        self.insert(namespace)
    }

    #[cold]
    fn insert(&self, namespace: &str) -> Scope {
        let mut names = self.names.lock();
        let current = self.ids.load_full();
        if let Some(&scope) = current.get(namespace) {
            return scope;
        }
        let scope = match u16::try_from(names.len()) {
            Ok(id) => {
                names.push(namespace.into());
                Scope(id)
            }
            // Past 65,535 namespaces the rest share the unnamed scope (remembered, so they do
            // not come back here).
            Err(_) => Scope::UNNAMED,
        };
        let mut ids = (*current).clone();
        ids.insert(namespace.into(), scope);
        self.ids.store(Arc::new(ids));
        scope
    }

    fn name(&self, scope: usize) -> String {
        self.names.lock().get(scope).map_or_else(String::new, |n| n.to_string())
    }
}

#[derive(Default)]
#[repr(align(128))]
struct Shard {
    table: Mutex<Table>,
}

/// Counters for telemetry.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    pub live_keys: u64,
    /// Units of the cap the live keys hold ([`UNIT_BYTES`] each: one per counter key, more for a
    /// sliding log of many entries).
    pub live_units: u64,
    /// Entries dropped because their state was pristine again.
    pub expired: u64,
    /// Live entries evicted by the key cap (their counters started over).
    pub evicted: u64,
}

pub struct MemoryStore {
    shards: Box<[Shard]>,
    shard_bits: u32,
    shard_capacity: usize,
    /// Two independently keyed hashers give the 128-bit slot key.
    seed: (ahash::RandomState, ahash::RandomState),
    scopes: Scopes,
    clock: Arc<dyn Clock>,
    expired: AtomicU64,
    evicted: AtomicU64,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("shard_capacity", &self.shard_capacity)
            .finish()
    }
}

impl MemoryStore {
    /// A store on the system clock holding at most about `max_keys` live keys.
    pub fn new(max_keys: usize) -> MemoryStore {
        MemoryStore::with_clock(max_keys, Arc::new(SystemClock))
    }

    pub fn with_clock(max_keys: usize, clock: Arc<dyn Clock>) -> MemoryStore {
        let max_keys = max_keys.max(1);
        let shard_count = (max_keys / TARGET_SHARD_KEYS).clamp(1, MAX_SHARDS).next_power_of_two().min(MAX_SHARDS);
        let shards = (0..shard_count).map(|_| Shard::default()).collect();
        MemoryStore {
            shards,
            shard_bits: shard_count.trailing_zeros(),
            shard_capacity: max_keys.div_ceil(shard_count),
            seed: (
                ahash::RandomState::with_seeds(rand::random(), rand::random(), rand::random(), rand::random()),
                ahash::RandomState::with_seeds(rand::random(), rand::random(), rand::random(), rand::random()),
            ),
            scopes: Scopes::new(),
            clock,
            expired: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// The most keys this store holds at once.
    pub fn max_keys(&self) -> usize {
        self.shard_capacity * self.shards.len()
    }

    /// The scope of `namespace` (interned on first sight): a lock-free lookup, meant to be done
    /// once per request.
    pub fn scope(&self, namespace: &str) -> Scope {
        self.scopes.intern(namespace)
    }

    fn slot_key(&self, scope: Scope, rule: RuleId, key: &[u8]) -> SlotKey {
        let half = |state: &ahash::RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write_u64(rule);
            hasher.write(key);
            hasher.finish()
        };
        SlotKey::new((u128::from(half(&self.seed.0)) << 64) | u128::from(half(&self.seed.1)), scope)
    }

    fn shard_of(&self, slot: SlotKey) -> usize {
        if self.shard_bits == 0 { 0 } else { (slot.0 >> (128 - self.shard_bits)) as usize }
    }

    /// Decides one request's rules atomically at `now`, writing one decision per check into
    /// `decisions`; returns whether the request is admitted. New keys go to the unnamed scope.
    pub fn check_into(&self, now: Micros, checks: &[RuleCheck<'_>], decisions: &mut Vec<Decision>) -> bool {
        self.check_scoped_into(Scope::UNNAMED, now, checks, decisions)
    }

    /// [`Self::check_into`] for a request of `scope` (see [`Self::scope`]): keys it creates are
    /// charged to that scope under the key cap.
    pub fn check_scoped_into(
        &self,
        scope: Scope,
        now: Micros,
        checks: &[RuleCheck<'_>],
        decisions: &mut Vec<Decision>,
    ) -> bool {
        decisions.clear();
        if let [only] = checks {
            let slot = self.slot_key(scope, only.rule, only.key);
            let mut table = self.shards[self.shard_of(slot)].table.lock();
            // One table lookup: decide and consume on the entry found, instead of `get` here and
            // `get_mut` again in `consume`.
            let decision = if let Some(entry) = table.slots.get_mut(&slot) {
                let decision = algorithm::check(only.limit, Some(&entry.state), now, only.cost);
                if decision.allowed {
                    let resized = Self::consume_entry(entry, only, now);
                    self.resized(&mut table, slot, resized, now);
                }
                decision
            } else {
                let decision = algorithm::check(only.limit, None, now, only.cost);
                if decision.allowed {
                    self.consume(&mut table, slot, only, now);
                }
                decision
            };
            decisions.push(decision);
            return decision.allowed || !only.enforce;
        }
        // Requests rarely match more than a handful of rules: keep their bookkeeping on the stack.
        const INLINE: usize = 8;
        if checks.len() <= INLINE {
            let mut slots = [(SlotKey(0), 0usize); INLINE];
            let mut shard_ids = [0usize; INLINE];
            let mut guards: [Option<MutexGuard<'_, Table>>; INLINE] = Default::default();
            self.check_many(
                scope,
                now,
                checks,
                decisions,
                &mut slots[..checks.len()],
                &mut shard_ids[..checks.len()],
                &mut guards,
            )
        } else {
            let mut slots = vec![(SlotKey(0), 0usize); checks.len()];
            let mut shard_ids = vec![0usize; checks.len()];
            let mut guards: Vec<Option<MutexGuard<'_, Table>>> = (0..checks.len()).map(|_| None).collect();
            self.check_many(scope, now, checks, decisions, &mut slots, &mut shard_ids, &mut guards)
        }
    }

    /// The several-rules case of [`Self::check_scoped_into`], on caller-provided scratch space
    /// (`slots` and `shard_ids` as long as `checks`, `guards` at least as long, all `None`).
    #[allow(clippy::too_many_arguments)]
    fn check_many<'s>(
        &'s self,
        scope: Scope,
        now: Micros,
        checks: &[RuleCheck<'_>],
        decisions: &mut Vec<Decision>,
        slots: &mut [(SlotKey, usize)],
        shard_ids: &mut [usize],
        guards: &mut [Option<MutexGuard<'s, Table>>],
    ) -> bool {
        for ((check, slot), shard_id) in checks.iter().zip(slots.iter_mut()).zip(shard_ids.iter_mut()) {
            let key = self.slot_key(scope, check.rule, check.key);
            *slot = (key, self.shard_of(key));
            *shard_id = slot.1;
        }
        // Locks are always taken in shard order, so concurrent requests cannot deadlock.
        shard_ids.sort_unstable();
        let distinct = dedup_sorted(shard_ids);
        let shard_ids = &shard_ids[..distinct];
        for (guard, &s) in guards.iter_mut().zip(shard_ids) {
            *guard = Some(self.shards[s].table.lock());
        }
        let guard_of = |shard: usize| shard_ids.binary_search(&shard).unwrap_or(0);

        for (check, &(slot, shard)) in checks.iter().zip(slots.iter()) {
            let state = guards[guard_of(shard)].as_ref().and_then(|g| g.slots.get(&slot)).map(|e| &e.state);
            decisions.push(algorithm::check(check.limit, state, now, check.cost));
        }
        let allowed = crate::rule::admits(checks, decisions);
        if allowed {
            for ((check, &(slot, shard)), decision) in checks.iter().zip(slots.iter()).zip(decisions.iter()) {
                if decision.allowed
                    && let Some(guard) = guards[guard_of(shard)].as_mut()
                {
                    self.consume(guard, slot, check, now);
                }
            }
        } else {
            // Nothing was consumed: a rule that had room reports its state as it stands, not as
            // it would have been after this request.
            for ((check, &(slot, shard)), decision) in checks.iter().zip(slots.iter()).zip(decisions.iter_mut()) {
                if decision.allowed {
                    let state = guards[guard_of(shard)].as_ref().and_then(|g| g.slots.get(&slot)).map(|e| &e.state);
                    *decision = algorithm::check(check.limit, state, now, 0);
                }
            }
        }
        allowed
    }

    /// Decides at `now` (tests and benchmarks pass a time; [`Store::check`] reads the clock).
    /// New keys go to the unnamed scope; see [`Self::check_scoped_at`].
    pub fn check_at(&self, now: Micros, checks: &[RuleCheck<'_>]) -> Verdict {
        self.check_scoped(Scope::UNNAMED, now, checks)
    }

    /// [`Self::check_at`] for a request of `namespace`: the keys it creates are charged to that
    /// namespace under the key cap, so another namespace's flood cannot evict them.
    pub fn check_scoped_at(&self, namespace: &str, now: Micros, checks: &[RuleCheck<'_>]) -> Verdict {
        self.check_scoped(self.scope(namespace), now, checks)
    }

    /// What [`Self::check_at`] would decide at `now`, consuming nothing (for `sluice explain`
    /// and `POST /v1/explain`). Each rule's state is read under its own shard's lock in turn, so
    /// a concurrent request may be seen half-way: an answer to show, never one to enforce.
    pub fn peek_at(&self, now: Micros, checks: &[RuleCheck<'_>]) -> Verdict {
        let decisions = checks
            .iter()
            .map(|check| {
                let slot = self.slot_key(Scope::UNNAMED, check.rule, check.key);
                let table = self.shards[self.shard_of(slot)].table.lock();
                algorithm::check(check.limit, table.slots.get(&slot).map(|e| &e.state), now, check.cost)
            })
            .collect();
        Verdict::from_decisions(checks, decisions)
    }

    fn check_scoped(&self, scope: Scope, now: Micros, checks: &[RuleCheck<'_>]) -> Verdict {
        let mut decisions = Vec::with_capacity(checks.len());
        let allowed = self.check_scoped_into(scope, now, checks, &mut decisions);
        Verdict { allowed, decisions, cached_denial: None, at: Some(now) }
    }

    /// Consumes on an existing entry; returns its units before and after.
    fn consume_entry(entry: &mut Entry, check: &RuleCheck<'_>, now: Micros) -> (usize, usize) {
        let before = units_of(&entry.state);
        let mut state = Some(std::mem::replace(&mut entry.state, State::Tat(0)));
        entry.expires_at = algorithm::apply_held(check.limit, &mut state, now, check.cost, check.hold);
        if let Some(state) = state {
            entry.state = state;
        }
        (before, units_of(&entry.state))
    }

    /// Accounts for an entry of `slot` that went from `before` to `after` units; makes room when
    /// the shard is now over its cap (a log that grew).
    fn resized(&self, table: &mut Table, slot: SlotKey, (before, after): (usize, usize), now: Micros) {
        table.units = (table.units + after).saturating_sub(before);
        if after > before && table.units > self.shard_capacity {
            self.make_room(table, now, slot.scope(), 0);
        }
    }

    fn consume(&self, table: &mut Table, slot: SlotKey, check: &RuleCheck<'_>, now: Micros) {
        if let Some(entry) = table.slots.get_mut(&slot) {
            let resized = Self::consume_entry(entry, check, now);
            self.resized(table, slot, resized, now);
            return;
        }
        let mut state = None;
        let expires_at = algorithm::apply_held(check.limit, &mut state, now, check.cost, check.hold);
        let Some(state) = state else { return };
        if expires_at <= now {
            return; // a zero-cost check leaves nothing worth keeping
        }
        let units = units_of(&state);
        if table.units + units > self.shard_capacity {
            self.make_room(table, now, slot.scope(), units);
        }
        table.units += units;
        table.slots.insert(slot, Entry { state, expires_at });
    }

    /// Drops expired entries; if the shard still has no room for `incoming` more units, evicts
    /// an eighth of its cap (or what `incoming` needs, if more) as [`eviction_quotas`] shares it
    /// out (`asking`: the scope of the entry that needs the room), each scope's entries closest
    /// to pristine first.
    fn make_room(&self, table: &mut Table, now: Micros, asking: usize, incoming: usize) {
        let Table { slots, units, evicted } = table;
        // Units held per scope id, counted while dropping the expired entries.
        let mut held: Vec<u32> = vec![0; asking + 1];
        let before = slots.len();
        let mut weighted = false;
        slots.retain(|slot, e| {
            let size = units_of(&e.state);
            if e.expires_at <= now {
                *units -= size;
                return false;
            }
            weighted |= size > 1;
            let scope = slot.scope();
            if scope >= held.len() {
                held.resize(scope + 1, 0);
            }
            held[scope] += u32::try_from(size).unwrap_or(u32::MAX);
            true
        });
        self.expired.fetch_add((before - slots.len()) as u64, Ordering::Relaxed);
        if *units + incoming <= self.shard_capacity {
            return;
        }
        let needed = (*units + incoming - self.shard_capacity).max(self.shard_capacity / 8).max(1);
        let quotas = eviction_quotas(&held, self.shard_capacity, u32::try_from(needed).unwrap_or(u32::MAX), asking);

        // Per scope giving entries up: the expiry up to which its entries go, and how many units
        // at exactly that expiry go besides those below it (a flood arriving in one instant is
        // evicted only up to the quota, not wholesale).
        let mut cut: Vec<Option<(Micros, u32)>> = vec![None; held.len()];
        let mut givers = quotas.iter().enumerate().filter(|&(_, &quota)| quota > 0);
        match (givers.next(), givers.next(), weighted) {
            (None, _, _) => return,
            // The usual case (one namespace floods, or only one holds keys, every entry one
            // unit): its expiries alone, a linear selection.
            (Some((scope, &quota)), None, false) => {
                let mut mine: Vec<Micros> = if held[scope] as usize == slots.len() {
                    slots.values().map(|e| e.expires_at).collect()
                } else {
                    slots.iter().filter(|(slot, _)| slot.scope() == scope).map(|(_, e)| e.expires_at).collect()
                };
                cut[scope] = Some(cut_at(&mut mine, quota));
            }
            // Several scopes, or entries of several units: each giver's (expiry, units), sorted.
            _ => {
                let mut by_scope: Vec<Vec<(Micros, u32)>> = vec![Vec::new(); held.len()];
                for (slot, e) in slots.iter() {
                    let scope = slot.scope();
                    if quotas[scope] > 0 {
                        by_scope[scope].push((e.expires_at, u32::try_from(units_of(&e.state)).unwrap_or(u32::MAX)));
                    }
                }
                for (scope, &quota) in quotas.iter().enumerate().filter(|&(_, &quota)| quota > 0) {
                    cut[scope] = Some(weighted_cut(&mut by_scope[scope], quota));
                }
            }
        }
        if evicted.len() < held.len() {
            evicted.resize(held.len(), 0);
        }
        let before = slots.len();
        slots.retain(|slot, e| {
            let scope = slot.scope();
            let Some((threshold, ties)) = &mut cut[scope] else { return true };
            let size = units_of(&e.state);
            let evict = if e.expires_at < *threshold {
                true
            } else if e.expires_at == *threshold && *ties > 0 {
                *ties = ties.saturating_sub(u32::try_from(size).unwrap_or(u32::MAX));
                true
            } else {
                false
            };
            if evict {
                evicted[scope] += 1;
                *units -= size;
            }
            !evict
        });
        self.evicted.fetch_add((before - slots.len()) as u64, Ordering::Relaxed);
    }

    /// Settles what `hold` holds under each (rule, key) of `settles` (see
    /// [`algorithm::settle`]); idempotent, but for reservations of 0, which held nothing and are
    /// charged at once ([`algorithm::settle_unreserved`]). Returns how many holds were found
    /// (a reservation of 0 counts as found). A key a charge creates goes to the unnamed scope.
    pub fn settle_at(&self, now: Micros, settles: &[super::Settle<'_>], hold: algorithm::HoldId) -> u64 {
        self.settle_scoped_at(Scope::UNNAMED, now, settles, hold)
    }

    /// Gives back the shaped slots `cancels` name at `now` ([`algorithm::give_back`]); returns
    /// how many went back. Only existing keys are touched.
    pub fn cancel_at(&self, namespace: &str, now: Micros, cancels: &[super::Cancel<'_>]) -> u64 {
        let scope = self.scope(namespace);
        let mut given = 0;
        for cancel in cancels {
            let slot = self.slot_key(scope, cancel.rule, cancel.key);
            let mut table = self.shards[self.shard_of(slot)].table.lock();
            let Some(entry) = table.slots.get_mut(&slot) else { continue };
            let mut state = Some(entry.state.clone());
            if algorithm::give_back(cancel.limit, &mut state, now, cancel.until, cancel.cost)
                && let Some(state) = state
            {
                // The TAT only steps back: the entry is pristine no later than before.
                entry.state = state;
                given += 1;
            }
        }
        given
    }

    /// Moves a shaping key's queue end (its TAT) to at least `tat`, at `now`: the local
    /// fallback continuing the queue the shared store had promised, instead of starting a
    /// second one beside it. Any other state of the key is replaced (the rule is a shaper).
    pub fn continue_queue_at(&self, namespace: &str, now: Micros, rule: crate::rule::RuleId, key: &[u8], tat: Micros) {
        if tat <= now {
            return;
        }
        let scope = self.scope(namespace);
        let slot = self.slot_key(scope, rule, key);
        let mut table = self.shards[self.shard_of(slot)].table.lock();
        if let Some(entry) = table.slots.get_mut(&slot) {
            let ahead = matches!(entry.state, State::Tat(t) if t >= tat);
            if !ahead {
                entry.state = State::Tat(tat);
                entry.expires_at = entry.expires_at.max(tat);
            }
            return;
        }
        let state = State::Tat(tat);
        let units = units_of(&state);
        if table.units + units > self.shard_capacity {
            self.make_room(&mut table, now, slot.scope(), units);
        }
        table.units += units;
        table.slots.insert(slot, Entry { state, expires_at: tat });
    }

    fn settle_scoped_at(
        &self,
        scope: Scope,
        now: Micros,
        settles: &[super::Settle<'_>],
        hold: algorithm::HoldId,
    ) -> u64 {
        let mut found = 0;
        for settle in settles {
            let slot = self.slot_key(scope, settle.rule, settle.key);
            let mut table = self.shards[self.shard_of(slot)].table.lock();
            let unreserved = settle.reserved == 0 && settle.limit.reservation_ttl().is_some();
            if unreserved && !table.slots.contains_key(&slot) {
                // Nothing held and nothing counted yet: the charge is a consumption like any.
                found += 1;
                let mut state = None;
                let (_, pristine_at) = algorithm::settle_unreserved(settle.limit, &mut state, now, hold, settle.cost);
                if let (Some(state), Some(expires_at)) = (state, pristine_at) {
                    let units = units_of(&state);
                    if table.units + units > self.shard_capacity {
                        self.make_room(&mut table, now, slot.scope(), units);
                    }
                    table.units += units;
                    table.slots.insert(slot, Entry { state, expires_at });
                }
                continue;
            }
            let Table { slots, units, .. } = &mut *table;
            let Some(entry) = slots.get_mut(&slot) else { continue };
            let before = units_of(&entry.state);
            let mut state = Some(std::mem::replace(&mut entry.state, State::Tat(0)));
            let (held, pristine_at) = if unreserved {
                algorithm::settle_unreserved(settle.limit, &mut state, now, hold, settle.cost)
            } else {
                algorithm::settle(settle.limit, &mut state, now, hold, settle.cost)
            };
            found += u64::from(held);
            match (pristine_at, state) {
                (Some(pristine_at), Some(state)) => {
                    entry.expires_at = pristine_at;
                    entry.state = state;
                    *units = (*units + units_of(&entry.state)).saturating_sub(before);
                }
                _ => {
                    slots.remove(&slot);
                    *units = units.saturating_sub(before);
                }
            }
        }
        found
    }

    /// Runs each of `ops` at `now` (see [`super::LeaseOp`]): settles the lease the holder had,
    /// then grants it a new one; each key under its own shard's lock. New keys are charged to
    /// `namespace` under the key cap.
    pub fn lease_at(
        &self,
        namespace: &str,
        now: Micros,
        ops: &[super::LeaseOp<'_>],
    ) -> Vec<algorithm::lease::LeaseGrant> {
        let scope = self.scope(namespace);
        ops.iter()
            .map(|op| {
                let slot = self.slot_key(scope, op.rule, op.key);
                let mut table = self.shards[self.shard_of(slot)].table.lock();
                let table = &mut *table;
                let mut state = None;
                let mut before = 0;
                if let Some(entry) = table.slots.get_mut(&slot) {
                    before = units_of(&entry.state);
                    state = Some(std::mem::replace(&mut entry.state, State::Tat(0)));
                }
                if let Some((hold, used)) = op.settle {
                    algorithm::settle(op.limit, &mut state, now, hold, used);
                }
                let granted = match op.ask {
                    Some(ask) => algorithm::lease::grant(op.limit, &mut state, now, ask).0,
                    None => algorithm::lease::LeaseGrant {
                        amount: 0,
                        lasts: 0,
                        holders: algorithm::lease::live_holds(state.as_ref(), now),
                        after: algorithm::check(op.limit, state.as_ref(), now, 0),
                    },
                };
                // Whatever the operations left, kept until it is pristine (a settle of the
                // last lease may leave nothing).
                let pristine_at = state.as_ref().map(|s| {
                    let mut probe = Some(s.clone());
                    algorithm::apply(op.limit, &mut probe, now, 0)
                });
                match (state, pristine_at) {
                    (Some(state), Some(expires_at)) if expires_at > now => {
                        let after = units_of(&state);
                        let existed = table.slots.contains_key(&slot);
                        if !existed && table.units + after > self.shard_capacity {
                            self.make_room(table, now, slot.scope(), after);
                        }
                        table.slots.insert(slot, Entry { state, expires_at });
                        table.units = (table.units + after).saturating_sub(if existed { before } else { 0 });
                    }
                    _ => {
                        if table.slots.remove(&slot).is_some() {
                            table.units = table.units.saturating_sub(before);
                        }
                    }
                }
                granted
            })
            .collect()
    }

    /// Drops every entry whose state is pristine at `now`; returns how many. Run periodically so
    /// idle keys do not linger until their shard fills.
    pub fn sweep_expired(&self, now: Micros) -> usize {
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut table = shard.table.lock();
            let Table { slots, units, .. } = &mut *table;
            let before = slots.len();
            slots.retain(|_, e| {
                let live = e.expires_at > now;
                if !live {
                    *units -= units_of(&e.state);
                }
                live
            });
            removed += before - slots.len();
            if slots.capacity() > 64 && slots.len() < slots.capacity() / 4 {
                slots.shrink_to_fit();
            }
        }
        self.expired.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    pub fn stats(&self) -> MemoryStats {
        let (mut live_keys, mut live_units) = (0, 0);
        for shard in self.shards.iter() {
            let table = shard.table.lock();
            live_keys += table.slots.len() as u64;
            live_units += table.units as u64;
        }
        MemoryStats {
            live_keys,
            live_units,
            expired: self.expired.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }

    /// Live keys evicted by the key cap since start, by the namespace that owned them (`""`:
    /// untagged checks), sorted by namespace; namespaces that lost nothing are left out. Bounded
    /// by the namespaces that have reached the store, i.e. that have policies.
    pub fn evictions_by_namespace(&self) -> Vec<(String, u64)> {
        let mut by_scope: Vec<u64> = Vec::new();
        for shard in self.shards.iter() {
            let table = shard.table.lock();
            if by_scope.len() < table.evicted.len() {
                by_scope.resize(table.evicted.len(), 0);
            }
            by_scope.iter_mut().zip(&table.evicted).for_each(|(sum, n)| *sum += n);
        }
        self.named(by_scope)
    }

    /// Live keys by the namespace that owns them (`""`: untagged checks), sorted by namespace.
    /// Scans every entry (each shard locked in turn): for diagnostics and tests, not per request.
    pub fn live_keys_by_namespace(&self) -> Vec<(String, u64)> {
        let mut by_scope: Vec<u64> = Vec::new();
        for shard in self.shards.iter() {
            for slot in shard.table.lock().slots.keys() {
                let scope = slot.scope();
                if scope >= by_scope.len() {
                    by_scope.resize(scope + 1, 0);
                }
                by_scope[scope] += 1;
            }
        }
        self.named(by_scope)
    }

    fn named(&self, by_scope: Vec<u64>) -> Vec<(String, u64)> {
        let mut named: Vec<(String, u64)> = by_scope
            .into_iter()
            .enumerate()
            .filter(|&(_, n)| n > 0)
            .map(|(scope, n)| (self.scopes.name(scope), n))
            .collect();
        named.sort();
        named
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }
}

impl Store for MemoryStore {
    async fn check(&self, now: Option<Micros>, checks: &[RuleCheck<'_>]) -> Result<Verdict, StoreError> {
        let now = now.unwrap_or_else(|| self.clock.now());
        Ok(self.check_at(now, checks))
    }

    async fn peek_for(
        &self,
        _namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> Result<Option<Verdict>, StoreError> {
        Ok(Some(self.peek_at(now.unwrap_or_else(|| self.clock.now()), checks)))
    }

    /// The namespace is the scope the request's new keys are charged to under the key cap.
    async fn check_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> Result<Verdict, StoreError> {
        let scope = self.scope(namespace);
        let now = now.unwrap_or_else(|| self.clock.now());
        Ok(self.check_scoped(scope, now, checks))
    }

    async fn settle_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        settles: &[super::Settle<'_>],
        hold: algorithm::HoldId,
    ) -> Result<u64, StoreError> {
        Ok(self.settle_scoped_at(self.scope(namespace), now.unwrap_or_else(|| self.clock.now()), settles, hold))
    }

    async fn cancel_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        cancels: &[super::Cancel<'_>],
    ) -> Result<u64, StoreError> {
        Ok(self.cancel_at(namespace, now.unwrap_or_else(|| self.clock.now()), cancels))
    }

    async fn lease_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        ops: &[super::LeaseOp<'_>],
    ) -> Result<Vec<algorithm::lease::LeaseGrant>, StoreError> {
        Ok(self.lease_at(namespace, now.unwrap_or_else(|| self.clock.now()), ops))
    }

    fn status(&self) -> super::StoreStatus {
        let stats = self.stats();
        super::StoreStatus {
            kind: "memory",
            live_keys: stats.live_keys,
            live_units: stats.live_units,
            evicted_keys: stats.evicted,
            evicted_keys_by_namespace: self.evictions_by_namespace().into_iter().collect(),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests;
