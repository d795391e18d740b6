//! An exact local cache of denials, in front of a shared store.
//!
//! When the shared store refuses cost `c` for a (rule, key) with a retry-after of `r`, no request
//! of cost ≥ `c` can be admitted there before `r` has passed, whatever other replicas do: until
//! then the state only moves toward denial (time has to pass for a bucket to refill or a window
//! to slide, and other replicas can only consume). So this replica answers such requests itself
//! until that instant, without asking the store — exactly the answer the store would give,
//! unlike caches that admit locally and settle later.
//!
//! The instant is measured from when the call was *sent*, which is no later than when the store
//! decided, so the cache never outlives the denial. An entry applies only to the same limit (an
//! edit of the rule's numbers or algorithm is a miss) and to enforcing rules. A cost that can
//! never fit (no retry-after) is not kept: its answer is not a repeat that time bounds.
//!
//! What a cached answer reports for its rule is the store's answer at the denial, aged: the
//! retry-after and reset count down from it, and `remaining` is the value at the denial (since
//! then refill or expiry may have added to it, never enough for the cost).
//!
//! A request refused from the cache was decided by its cached rule alone: the other rules of the
//! request were not asked (see [`super::Verdict::cached_denial`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::RuleCheck;
use crate::algorithm::{Decision, Limit, Micros};
use crate::rule::Verdict;

#[derive(Debug, Clone)]
struct Denial {
    limit: Limit,
    cost: u64,
    /// Until when (µs, the cache's clock) cost ≥ `cost` cannot be admitted.
    until: Micros,
    /// When the rule's state would be pristine, as the store said at the denial.
    reset_at: Micros,
    /// What the rule had left at the denial.
    remaining: u64,
}

/// Shards of the cache: it is consulted before every Redis call, so one lock would serialize
/// every decision of the process.
const SHARDS: usize = 16;

/// Denials by state key; bounded.
#[derive(Debug)]
pub struct DenialCache {
    shards: Vec<Mutex<HashMap<Vec<u8>, Denial>>>,
    /// Entries per shard.
    shard_capacity: usize,
    /// Entries in all shards, so an empty cache (the usual case) costs one atomic load.
    held: AtomicUsize,
    hits: AtomicU64,
}

impl DenialCache {
    /// A cache of at most `capacity` (rule, key) denials; 0 keeps nothing.
    pub fn new(capacity: usize) -> DenialCache {
        DenialCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            shard_capacity: capacity.div_ceil(SHARDS),
            held: AtomicUsize::new(0),
            hits: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &[u8]) -> &Mutex<HashMap<Vec<u8>, Denial>> {
        static HASHER: std::sync::LazyLock<ahash::RandomState> = std::sync::LazyLock::new(ahash::RandomState::new);
        &self.shards[HASHER.hash_one(key) as usize % SHARDS]
    }

    /// The denial that answers this request at `now`, if any: the index of the rule whose
    /// cached denial covers it, and the verdict. `keys[i]` is the state key of `checks[i]`.
    pub fn answer(&self, keys: &[Vec<u8>], checks: &[RuleCheck<'_>], now: Micros) -> Option<Verdict> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let (index, denial) = checks.iter().zip(keys).enumerate().find_map(|(i, (check, key))| {
            if !check.enforce {
                return None;
            }
            let entries = self.shard(key).lock();
            let denial = entries.get(key)?;
            let covers = now < denial.until && check.cost >= denial.cost && denial.limit == *check.limit;
            covers.then(|| (i, denial.clone()))
        })?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        let decision = Decision {
            allowed: false,
            remaining: denial.remaining,
            reset_after: denial.reset_at.saturating_sub(now),
            retry_after: Some(denial.until - now),
            delay: 0,
        };
        Some(Verdict::refused_by(index, decision, checks.iter().map(|check| check.limit)))
    }

    /// Keeps the denials of a verdict the store gave for a call sent at `sent_at`.
    pub fn record(&self, keys: &[Vec<u8>], checks: &[RuleCheck<'_>], verdict: &Verdict, sent_at: Micros) {
        if self.shard_capacity == 0 || verdict.allowed {
            return;
        }
        for ((check, key), decision) in checks.iter().zip(keys).zip(&verdict.decisions) {
            let (false, true, Some(retry_after)) = (decision.allowed, check.enforce, decision.retry_after) else {
                continue;
            };
            // A reservation settled below its estimate frees capacity before the retry-after:
            // the denial is no bound on when the key admits again.
            if check.limit.reservation_ttl().is_some() {
                continue;
            }
            let until = sent_at.saturating_add(retry_after);
            let mut entries = self.shard(key).lock();
            if entries.len() >= self.shard_capacity && !entries.contains_key(key) {
                let before = entries.len();
                entries.retain(|_, d| d.until > sent_at);
                self.held.fetch_sub(before - entries.len(), Ordering::Relaxed);
                if entries.len() >= self.shard_capacity {
                    continue;
                }
            }
            let denial = Denial {
                limit: check.limit.clone(),
                cost: check.cost,
                until,
                reset_at: sent_at.saturating_add(decision.reset_after),
                remaining: decision.remaining,
            };
            if entries.insert(key.clone(), denial).is_none() {
                self.held.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Requests answered from the cache since start.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Denials held (expired ones included until room is needed).
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;

    fn denied(retry_after: Option<Micros>) -> Verdict {
        let decision = Decision { allowed: false, remaining: 1, reset_after: 500, retry_after, delay: 0 };
        Verdict { allowed: false, decisions: vec![decision], cached_denial: None, at: None }
    }

    #[test]
    fn a_denial_answers_larger_or_equal_costs_of_the_same_limit_until_its_retry_after() {
        let limit = Limit::new(Algorithm::TokenBucket, 10, 1_000_000, Some(5), None).unwrap();
        let keys = vec![b"k".to_vec()];
        let cache = DenialCache::new(16);
        let check = |cost| RuleCheck { rule: 1, limit: &limit, key: b"k", cost, enforce: true, hold: 0 };
        cache.record(&keys, &[check(3)], &denied(Some(200)), 1_000);
        let hit = cache.answer(&keys, &[check(3)], 1_100).expect("covered");
        assert_eq!((hit.allowed, hit.cached_denial), (false, Some(0)));
        assert_eq!(
            hit.decisions[0],
            Decision { allowed: false, remaining: 1, reset_after: 400, retry_after: Some(100), delay: 0 }
        );
        assert!(cache.answer(&keys, &[check(4)], 1_100).is_some(), "a larger cost cannot fit either");
        assert!(cache.answer(&keys, &[check(2)], 1_100).is_none(), "a smaller cost may fit: ask the store");
        assert!(cache.answer(&keys, &[check(3)], 1_200).is_none(), "from the retry-after on, ask the store");
        let edited = Limit::new(Algorithm::TokenBucket, 10, 1_000_000, Some(6), None).unwrap();
        let other = RuleCheck { limit: &edited, ..check(3) };
        assert!(cache.answer(&keys, &[other], 1_100).is_none(), "an edited limit is another limit");
        let shadow = RuleCheck { enforce: false, ..check(3) };
        assert!(cache.answer(&keys, &[shadow], 1_100).is_none(), "shadow rules never deny");
        assert_eq!(cache.hits(), 2);
    }

    #[test]
    fn the_other_rules_of_a_cached_denial_are_not_asked_and_memory_is_bounded() {
        let limit = Limit::new(Algorithm::FixedWindow, 10, 1_000_000, None, None).unwrap();
        let cache = DenialCache::new(SHARDS);
        let check = |key: &'static [u8]| RuleCheck { rule: 1, limit: &limit, key, cost: 1, enforce: true, hold: 0 };
        cache.record(&[b"n".to_vec()], &[check(b"n")], &denied(None), 0);
        assert!(cache.is_empty(), "a cost that never fits is no repeat bounded in time");
        cache.record(&[b"a".to_vec()], &[check(b"a")], &denied(Some(100)), 0);
        let keys = vec![b"b".to_vec(), b"a".to_vec()];
        let hit = cache.answer(&keys, &[check(b"b"), check(b"a")], 10).expect("rule 1 covers it");
        assert_eq!(hit.cached_denial, Some(1));
        assert!(hit.decisions[0].allowed, "not asked: it refused nothing");
        assert_eq!(hit.decisions[1].retry_after, Some(90));
        let many: Vec<Vec<u8>> = (0..20 * SHARDS).map(|i| format!("k{i}").into_bytes()).collect();
        for key in &many {
            let c = RuleCheck { rule: 1, limit: &limit, key, cost: 1, enforce: true, hold: 0 };
            cache.record(std::slice::from_ref(key), &[c], &denied(Some(100)), 10);
        }
        assert!(cache.len() <= SHARDS, "one entry per shard at most: {}", cache.len());
        assert!(DenialCache::new(0).answer(&keys, &[check(b"b"), check(b"a")], 10).is_none());
    }
}
