use std::collections::HashMap;

use super::*;
use crate::algorithm::{Algorithm, Limit};
use crate::clock::FakeClock;

const T0: Micros = 1_699_920_000_000_000;

fn limit(algorithm: Algorithm, requests: u64) -> Limit {
    Limit::new(algorithm, requests, 1_000_000, None, None).unwrap()
}

fn one<'a>(rule: RuleId, limit: &'a Limit, key: &'a str) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key: key.as_bytes(), cost: 1, enforce: true, hold: 0 }
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
fn levelling_takes_from_the_largest_holders_only() {
    assert_eq!(level_down(&[0, 4095, 1], 512), [0, 512, 0]);
    // Two tied largest holders share the eviction; the extra one goes to the lower id.
    assert_eq!(level_down(&[3, 10, 10], 5), [0, 3, 2]);
    // Down to the next largest, then both.
    assert_eq!(level_down(&[6, 10, 1], 6), [1, 5, 0]);
    assert_eq!(level_down(&[5, 5], 10), [5, 5]);
    assert_eq!(level_down(&[1, 1, 1], 1), [1, 0, 0]);
    assert_eq!(level_down(&[], 1), Vec::<u32>::new());
}

/// Issue 9, item 5: a flood of distinct keys from one namespace's long-window rule must not
/// evict another namespace's exhausted key (which would hand the victim a fresh quota).
#[test]
fn a_flood_from_one_namespace_does_not_evict_another_namespaces_keys() {
    let store = MemoryStore::with_clock(4096, Arc::new(FakeClock::new(T0)));
    let hourly = Limit::new(Algorithm::FixedWindow, 1, 3_600_000_000, None, None).unwrap();
    let daily = Limit::new(Algorithm::FixedWindow, 1, 86_400_000_000, None, None).unwrap();
    let victim = [one(1, &hourly, "victim")];
    assert!(store.check_scoped_at("tenant-a", T0, &victim).allowed);
    assert!(!store.check_scoped_at("tenant-a", T0, &victim).allowed, "exhausted");
    // Every flood key's window outlives the victim's, so closest-to-pristine alone would
    // pick the victim first.
    for i in 0..10_000u32 {
        let key = format!("flood-{i}");
        assert!(store.check_scoped_at("tenant-b", T0 + u64::from(i), &[one(2, &daily, &key)]).allowed);
    }
    assert!(!store.check_scoped_at("tenant-a", T0 + 10_000, &victim).allowed, "the victim was evicted");

    let live = store.live_keys_by_namespace();
    assert_eq!(live[0], ("tenant-a".to_string(), 1), "{live:?}");
    let flood_live = live[1].1;
    assert_eq!(live[1].0, "tenant-b");
    assert!(flood_live < store.max_keys() as u64 && flood_live >= 3_500, "{live:?}");
    assert_eq!(store.evictions_by_namespace(), [("tenant-b".to_string(), 10_000 - flood_live)]);
    assert_eq!(store.stats().evicted, 10_000 - flood_live);
}

#[test]
fn a_namespace_over_its_share_is_levelled_down_to_it_and_no_further() {
    let store = MemoryStore::new(4096);
    let l = Limit::new(Algorithm::TokenBucket, 10, 3_600_000_000, None, None).unwrap();
    for i in 0..3_000u32 {
        store.check_scoped_at("big", T0, &[one(1, &l, &format!("b{i}"))]);
    }
    for i in 0..200u32 {
        store.check_scoped_at("small", T0, &[one(2, &l, &format!("s{i}"))]);
    }
    for i in 0..20_000u32 {
        store.check_scoped_at("flood", T0, &[one(3, &l, &format!("f{i}"))]);
    }
    let live: HashMap<String, u64> = store.live_keys_by_namespace().into_iter().collect();
    assert_eq!(live["small"], 200, "below its share: untouched");
    // Three namespaces hold keys: each one's share is a third of the cap. `big` was above it
    // and gave up only its excess; the flood's own keys made the rest of its room.
    let share = 4096 / 3;
    assert!(live["big"] >= share, "{live:?}");
    assert!(live["flood"] >= share, "{live:?}");
    let evicted: HashMap<String, u64> = store.evictions_by_namespace().into_iter().collect();
    assert!(!evicted.contains_key("small"), "{evicted:?}");
    assert_eq!(evicted["big"], 3_000 - live["big"]);
    assert_eq!(evicted["flood"], 20_000 - live["flood"]);
}

/// Issue 23, item 7: with `--max-keys 4096`, a flood of distinct keys from one namespace
/// reset 1,208 of another's 3,000 exhausted counters (levelling took the victim down with the
/// flood, an eighth of the shard at a time, below half of the cap). Now the victim keeps its
/// share, half the cap with two namespaces, every one of those counters still exhausted.
#[test]
fn a_flood_never_takes_another_namespace_below_its_share() {
    let store = MemoryStore::with_clock(4096, Arc::new(FakeClock::new(T0)));
    let hourly = Limit::new(Algorithm::FixedWindow, 1, 3_600_000_000, None, None).unwrap();
    let daily = Limit::new(Algorithm::FixedWindow, 1, 86_400_000_000, None, None).unwrap();
    for i in 0..3_000u32 {
        assert!(store.check_scoped_at("b", T0, &[one(1, &hourly, &format!("user-{i}"))]).allowed);
    }
    for i in 0..100_000u32 {
        store.check_scoped_at("a", T0 + 1, &[one(2, &daily, &format!("flood-{i}"))]);
    }
    let still_exhausted =
        (0..3_000u32).filter(|i| !store.peek_at(T0 + 2, &[one(1, &hourly, &format!("user-{i}"))]).allowed).count();
    assert!(still_exhausted >= 4096 / 2, "{still_exhausted} of b's 3000 exhausted counters kept");
    let evicted: HashMap<String, u64> = store.evictions_by_namespace().into_iter().collect();
    assert!(evicted.get("b").copied().unwrap_or(0) <= 3_000 - 4096 / 2, "{evicted:?}");
}

/// Issue 23, item 3: the cap bounds bytes. A sliding log of 1000 entries is about 250 units,
/// so logs cannot take the store past its cap in bytes however few keys they are, and a
/// namespace of long logs is held to its share in units like any other.
#[test]
fn long_logs_count_by_their_bytes_under_the_cap() {
    let store = MemoryStore::with_clock(4096, Arc::new(FakeClock::new(T0)));
    let log = Limit::new(Algorithm::SlidingWindowLog, 1_000, 3_600_000_000, None, None).unwrap();
    let counter = Limit::new(Algorithm::FixedWindow, 1, 3_600_000_000, None, None).unwrap();
    for i in 0..1_000u32 {
        assert!(store.check_scoped_at("b", T0, &[one(1, &counter, &format!("user-{i}"))]).allowed);
    }
    for key in 0..100u32 {
        for at in 0..1_000u64 {
            store.check_scoped_at("a", T0 + at, &[one(2, &log, &format!("log-{key}"))]);
        }
    }
    let stats = store.stats();
    assert!(stats.live_units <= store.max_keys() as u64, "{stats:?}");
    let live: HashMap<String, u64> = store.live_keys_by_namespace().into_iter().collect();
    assert_eq!(live["b"], 1_000, "below its share: untouched, {live:?}");
    assert!(live["a"] <= 16, "{live:?}: a log of 1000 entries holds about 250 units of 4096");
    let evicted: HashMap<String, u64> = store.evictions_by_namespace().into_iter().collect();
    assert!(!evicted.contains_key("b"), "{evicted:?}");
}

#[test]
fn eviction_takes_the_excess_over_the_share_then_the_asker_own() {
    // Capacity 12, three holders: a share of 4. Only the 5 above it can go, largest first.
    assert_eq!(eviction_quotas(&[0, 9, 2, 1], 12, 3, 3), [0, 3, 0, 0]);
    assert_eq!(eviction_quotas(&[0, 9, 2, 1], 12, 6, 3), [0, 5, 0, 1], "then the asker's own");
    // Everyone at their share: the asker evicts its own.
    assert_eq!(eviction_quotas(&[0, 4, 4, 4], 12, 2, 2), [0, 0, 2, 0]);
    // A newcomer (holding nothing yet) counts as a holder: the share drops to 3.
    assert_eq!(eviction_quotas(&[0, 6, 6, 0], 12, 4, 3), [0, 2, 2, 0]);
}

#[test]
fn the_scope_charges_a_key_but_does_not_change_its_identity() {
    let l = limit(Algorithm::FixedWindow, 2);
    let store = MemoryStore::new(1000);
    assert!(store.check_scoped_at("a", T0, &[one(1, &l, "k")]).allowed);
    assert!(store.check_scoped_at("b", T0, &[one(1, &l, "k")]).allowed, "the same counter");
    assert!(!store.check_at(T0, &[one(1, &l, "k")]).allowed, "untagged finds it too");
    assert_eq!(store.live_keys_by_namespace(), [("a".to_string(), 1)], "owned by its creator");
    assert_eq!(store.scope("a"), store.scope("a"));
    assert_ne!(store.scope("a"), store.scope("b"));
    assert_eq!(store.scope(""), Scope::UNNAMED);
    // Several rules in one call are charged to the request's scope.
    store.check_scoped_at("c", T0, &[one(1, &l, "x"), one(2, &l, "y")]);
    assert_eq!(store.live_keys_by_namespace(), [("a".to_string(), 1), ("c".to_string(), 2)]);
}

#[test]
fn check_for_charges_the_namespace() {
    let store = MemoryStore::with_clock(100, Arc::new(FakeClock::new(T0)));
    let l = limit(Algorithm::FixedWindow, 1);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(async {
        assert!(store.check_for("tenant-a", None, &[one(1, &l, "k")]).await.unwrap().allowed);
        assert!(store.check(None, &[one(1, &l, "j")]).await.unwrap().allowed);
    });
    assert_eq!(store.live_keys_by_namespace(), [(String::new(), 1), ("tenant-a".to_string(), 1)]);
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
