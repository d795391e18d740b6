//! The in-process store: sharded hash maps of compact per-key state.
//!
//! Keys are 128-bit digests of (rule identity, key): two aHash hashers under independent
//! per-process random keys. A key costs the same few bytes however long the header value it came
//! from, and without the keys nobody can aim collisions at another client's counter (aHash is
//! keyed for HashDoS resistance; 128 bits make accidental collisions negligible). It replaced
//! SipHash-1-3-128, which took about 45% of a single-rule decision's instructions. Each entry remembers when its state becomes
//! pristine again (full bucket, empty window); past that moment it is dropped, because a missing
//! key means exactly that state. A cap on live keys bounds memory under a flood of distinct keys:
//! a full shard first drops what has expired, then evicts the eighth of its entries closest to
//! pristine (counted in [`MemoryStats::evicted`], since an evicted key starts over).

use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashMap;
use parking_lot::{Mutex, MutexGuard};

use super::{RuleCheck, RuleId, Store, StoreError, Verdict};
use crate::algorithm::{self, Decision, Micros, State};
use crate::clock::{Clock, SystemClock};

/// Default cap on live keys: about 60 MB of state at the measured bytes per key.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Keys per shard when the cap allows it; also the point below which one shard is used.
const TARGET_SHARD_KEYS: usize = 4096;
const MAX_SHARDS: usize = 256;

#[derive(Debug)]
struct Entry {
    state: State,
    /// When `state` is pristine again; the entry may be dropped from then on.
    expires_at: Micros,
}

/// The slot keys are already uniform hashes: use their low half as the table hash.
#[derive(Default)]
struct SlotHasher(u64);

impl Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u128 slot keys are hashed; keep a correct fallback anyway.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }
    fn write_u128(&mut self, value: u128) {
        self.0 = value as u64;
    }
}

type Slots = HashMap<u128, Entry, BuildHasherDefault<SlotHasher>>;

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

#[derive(Default)]
#[repr(align(128))]
struct Shard {
    slots: Mutex<Slots>,
}

/// Counters for telemetry.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    pub live_keys: u64,
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
            clock,
            expired: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// The most keys this store holds at once.
    pub fn max_keys(&self) -> usize {
        self.shard_capacity * self.shards.len()
    }

    fn slot_key(&self, rule: RuleId, key: &[u8]) -> u128 {
        let half = |state: &ahash::RandomState| {
            let mut hasher = state.build_hasher();
            hasher.write_u64(rule);
            hasher.write(key);
            hasher.finish()
        };
        (u128::from(half(&self.seed.0)) << 64) | u128::from(half(&self.seed.1))
    }

    fn shard_of(&self, slot: u128) -> usize {
        if self.shard_bits == 0 { 0 } else { (slot >> (128 - self.shard_bits)) as usize }
    }

    /// Decides one request's rules atomically at `now`, writing one decision per check into
    /// `decisions`; returns whether the request is admitted.
    pub fn check_into(&self, now: Micros, checks: &[RuleCheck<'_>], decisions: &mut Vec<Decision>) -> bool {
        decisions.clear();
        if let [only] = checks {
            let slot = self.slot_key(only.rule, only.key);
            let mut slots = self.shards[self.shard_of(slot)].slots.lock();
            // One table lookup: decide and consume on the entry found, instead of `get` here and
            // `get_mut` again in `consume`.
            let decision = if let Some(entry) = slots.get_mut(&slot) {
                let decision = algorithm::check(only.limit, Some(&entry.state), now, only.cost);
                if decision.allowed {
                    Self::consume_entry(entry, only, now);
                }
                decision
            } else {
                let decision = algorithm::check(only.limit, None, now, only.cost);
                if decision.allowed {
                    self.consume(&mut slots, slot, only, now);
                }
                decision
            };
            decisions.push(decision);
            return decision.allowed || !only.enforce;
        }
        // Requests rarely match more than a handful of rules: keep their bookkeeping on the stack.
        const INLINE: usize = 8;
        if checks.len() <= INLINE {
            let mut slots = [(0u128, 0usize); INLINE];
            let mut shard_ids = [0usize; INLINE];
            let mut guards: [Option<MutexGuard<'_, Slots>>; INLINE] = Default::default();
            self.check_many(
                now,
                checks,
                decisions,
                &mut slots[..checks.len()],
                &mut shard_ids[..checks.len()],
                &mut guards,
            )
        } else {
            let mut slots = vec![(0u128, 0usize); checks.len()];
            let mut shard_ids = vec![0usize; checks.len()];
            let mut guards: Vec<Option<MutexGuard<'_, Slots>>> = (0..checks.len()).map(|_| None).collect();
            self.check_many(now, checks, decisions, &mut slots, &mut shard_ids, &mut guards)
        }
    }

    /// The several-rules case of [`Self::check_into`], on caller-provided scratch space
    /// (`slots` and `shard_ids` as long as `checks`, `guards` at least as long, all `None`).
    fn check_many<'s>(
        &'s self,
        now: Micros,
        checks: &[RuleCheck<'_>],
        decisions: &mut Vec<Decision>,
        slots: &mut [(u128, usize)],
        shard_ids: &mut [usize],
        guards: &mut [Option<MutexGuard<'s, Slots>>],
    ) -> bool {
        for ((check, slot), shard_id) in checks.iter().zip(slots.iter_mut()).zip(shard_ids.iter_mut()) {
            let key = self.slot_key(check.rule, check.key);
            *slot = (key, self.shard_of(key));
            *shard_id = slot.1;
        }
        // Locks are always taken in shard order, so concurrent requests cannot deadlock.
        shard_ids.sort_unstable();
        let distinct = dedup_sorted(shard_ids);
        let shard_ids = &shard_ids[..distinct];
        for (guard, &s) in guards.iter_mut().zip(shard_ids) {
            *guard = Some(self.shards[s].slots.lock());
        }
        let guard_of = |shard: usize| shard_ids.binary_search(&shard).unwrap_or(0);

        for (check, &(slot, shard)) in checks.iter().zip(slots.iter()) {
            let state = guards[guard_of(shard)].as_ref().and_then(|g| g.get(&slot)).map(|e| &e.state);
            decisions.push(algorithm::check(check.limit, state, now, check.cost));
        }
        let allowed = super::admits(checks, decisions);
        if allowed {
            for ((check, &(slot, shard)), decision) in checks.iter().zip(slots.iter()).zip(decisions.iter()) {
                if decision.allowed
                    && let Some(guard) = guards[guard_of(shard)].as_mut()
                {
                    self.consume(guard, slot, check, now);
                }
            }
        }
        allowed
    }

    /// Decides at `now` (tests and benchmarks pass a time; [`Store::check`] reads the clock).
    pub fn check_at(&self, now: Micros, checks: &[RuleCheck<'_>]) -> Verdict {
        let mut decisions = Vec::with_capacity(checks.len());
        let allowed = self.check_into(now, checks, &mut decisions);
        Verdict { allowed, decisions }
    }

    fn consume_entry(entry: &mut Entry, check: &RuleCheck<'_>, now: Micros) {
        let mut state = Some(std::mem::replace(&mut entry.state, State::Tat(0)));
        entry.expires_at = algorithm::apply(check.limit, &mut state, now, check.cost);
        if let Some(state) = state {
            entry.state = state;
        }
    }

    fn consume(&self, slots: &mut Slots, slot: u128, check: &RuleCheck<'_>, now: Micros) {
        if let Some(entry) = slots.get_mut(&slot) {
            Self::consume_entry(entry, check, now);
            return;
        }
        let mut state = None;
        let expires_at = algorithm::apply(check.limit, &mut state, now, check.cost);
        let Some(state) = state else { return };
        if expires_at <= now {
            return; // a zero-cost check leaves nothing worth keeping
        }
        if slots.len() >= self.shard_capacity {
            self.make_room(slots, now);
        }
        slots.insert(slot, Entry { state, expires_at });
    }

    /// Drops expired entries; if the shard is still full, evicts the eighth closest to pristine.
    fn make_room(&self, slots: &mut Slots, now: Micros) {
        let before = slots.len();
        slots.retain(|_, e| e.expires_at > now);
        self.expired.fetch_add((before - slots.len()) as u64, Ordering::Relaxed);
        if slots.len() < self.shard_capacity {
            return;
        }
        let mut expiries: Vec<Micros> = slots.values().map(|e| e.expires_at).collect();
        let cut = (expiries.len() / 8).max(1) - 1;
        let (_, &mut threshold, _) = expiries.select_nth_unstable(cut);
        // Ties at the threshold (a flood arriving in one instant) are evicted only up to the
        // eighth, not wholesale.
        let mut ties_to_evict = cut + 1 - expiries.iter().filter(|&&at| at < threshold).count();
        let before = slots.len();
        slots.retain(|_, e| {
            if e.expires_at < threshold {
                return false;
            }
            if e.expires_at == threshold && ties_to_evict > 0 {
                ties_to_evict -= 1;
                return false;
            }
            true
        });
        self.evicted.fetch_add((before - slots.len()) as u64, Ordering::Relaxed);
    }

    /// Drops every entry whose state is pristine at `now`; returns how many. Run periodically so
    /// idle keys do not linger until their shard fills.
    pub fn sweep_expired(&self, now: Micros) -> usize {
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut slots = shard.slots.lock();
            let before = slots.len();
            slots.retain(|_, e| e.expires_at > now);
            removed += before - slots.len();
            if slots.capacity() > 64 && slots.len() < slots.capacity() / 4 {
                slots.shrink_to_fit();
            }
        }
        self.expired.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            live_keys: self.shards.iter().map(|s| s.slots.lock().len() as u64).sum(),
            expired: self.expired.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
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

    fn status(&self) -> super::StoreStatus {
        let stats = self.stats();
        super::StoreStatus {
            kind: "memory",
            live_keys: stats.live_keys,
            evicted_keys: stats.evicted,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{Algorithm, Limit};
    use crate::clock::FakeClock;

    const T0: Micros = 1_699_920_000_000_000;

    fn limit(algorithm: Algorithm, requests: u64) -> Limit {
        Limit::new(algorithm, requests, 1_000_000, None, None).unwrap()
    }

    fn one<'a>(rule: RuleId, limit: &'a Limit, key: &'a str) -> RuleCheck<'a> {
        RuleCheck {
            rule,
            limit,
            key: key.as_bytes(),
            cost: 1,
            enforce: true,
            on_store_failure: super::super::FailureMode::Allow,
        }
    }

    #[test]
    fn a_denial_by_one_rule_consumes_nothing_anywhere() {
        let loose = limit(Algorithm::TokenBucket, 10);
        let strict = limit(Algorithm::FixedWindow, 1);
        let store = MemoryStore::new(1000);
        let both = [one(1, &loose, "k"), one(2, &strict, "k")];
        assert!(store.check_at(T0, &both).allowed);
        let denied = store.check_at(T0, &both);
        assert!(!denied.allowed);
        assert!(denied.decisions[0].allowed && !denied.decisions[1].allowed);
        // The loose rule still has 9 left: the denied request took nothing from it.
        assert_eq!(store.check_at(T0, &[one(1, &loose, "k")]).decisions[0].remaining, 8);
    }

    #[test]
    fn shadow_rules_never_deny_but_count() {
        let strict = limit(Algorithm::FixedWindow, 1);
        let store = MemoryStore::new(1000);
        let shadow = [RuleCheck { enforce: false, ..one(1, &strict, "k") }];
        assert!(store.check_at(T0, &shadow).allowed);
        let second = store.check_at(T0, &shadow);
        assert!(second.allowed, "shadow never denies");
        assert!(!second.decisions[0].allowed, "but reports that it would have");
    }

    #[test]
    fn keys_and_rules_are_independent() {
        let l = limit(Algorithm::FixedWindow, 1);
        let store = MemoryStore::new(1000);
        assert!(store.check_at(T0, &[one(1, &l, "a")]).allowed);
        assert!(store.check_at(T0, &[one(1, &l, "b")]).allowed);
        assert!(store.check_at(T0, &[one(2, &l, "a")]).allowed);
        assert!(!store.check_at(T0, &[one(1, &l, "a")]).allowed);
    }

    #[test]
    fn idle_keys_expire_once_pristine() {
        let l = limit(Algorithm::TokenBucket, 10);
        let store = MemoryStore::new(1000);
        for i in 0..100 {
            store.check_at(T0, &[one(1, &l, &format!("k{i}"))]);
        }
        assert_eq!(store.stats().live_keys, 100);
        assert_eq!(store.sweep_expired(T0 + 99_999), 0, "one token not yet back");
        assert_eq!(store.sweep_expired(T0 + 100_000), 100);
        assert_eq!(store.stats().live_keys, 0);
    }

    #[test]
    fn flood_of_distinct_keys_stays_under_the_cap() {
        let l = limit(Algorithm::SlidingWindowCounter, 10);
        let store = MemoryStore::new(10_000);
        for i in 0..200_000u32 {
            store.check_at(T0, &[one(1, &l, &i.to_string())]);
        }
        let stats = store.stats();
        assert!(stats.live_keys <= store.max_keys() as u64, "{stats:?}");
        assert!(stats.live_keys >= 8_000, "the cap is used, not emptied: {stats:?}");
        assert!(stats.evicted >= 190_000 - 10_000, "{stats:?}");
    }

    #[test]
    fn eviction_prefers_keys_closest_to_pristine() {
        let l = Limit::new(Algorithm::FixedWindow, 10, 60_000_000, None, None).unwrap();
        let store = MemoryStore::new(100);
        let hot = "hot";
        // The hot key's hour-long window keeps it far from pristine; the flood's minute windows
        // are closer, so they go first.
        let long = Limit::new(Algorithm::FixedWindow, 10, 3_600_000_000, None, None).unwrap();
        store.check_at(T0, &[one(9, &long, hot)]);
        for i in 0..1_000u32 {
            store.check_at(T0, &[one(1, &l, &i.to_string())]);
        }
        let again = store.check_at(T0, &[one(9, &long, hot)]);
        assert_eq!(again.decisions[0].remaining, 8, "hot key survived the flood");
    }

    #[test]
    fn store_trait_reads_the_clock() {
        let clock = FakeClock::new(T0);
        let store = MemoryStore::with_clock(100, Arc::new(clock.clone()));
        let l = limit(Algorithm::FixedWindow, 1);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            assert!(store.check(None, &[one(1, &l, "k")]).await.unwrap().allowed);
            assert!(!store.check(None, &[one(1, &l, "k")]).await.unwrap().allowed);
            clock.advance(1_000_000);
            assert!(store.check(None, &[one(1, &l, "k")]).await.unwrap().allowed);
        });
    }

    #[test]
    fn many_threads_never_over_admit() {
        let l = limit(Algorithm::Gcra, 100);
        let store = Arc::new(MemoryStore::new(1000));
        let admitted = Arc::new(AtomicU64::new(0));
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let (store, admitted, l) = (store.clone(), admitted.clone(), &l);
                scope.spawn(move || {
                    for _ in 0..1000 {
                        if store.check_at(T0, &[one(1, l, "k")]).allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 100);
    }
}
