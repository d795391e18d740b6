//! Debt, zero reservations, huge amounts and holds of nothing, on the memory store and on a real
//! Redis, seen from the store's own state (what the conformance vectors cannot show):
//!
//! - a settle of an enormous cost (an edited lease token's estimate, 2^64 − 100) saturates the
//!   count, never wraps it round to a fresh window or bucket (issue 37, items 9–10);
//! - a reservation of 0 (`max_tokens: 0` with no `plus`, or `reportAfter`) leaves no hold on the
//!   key, and its settle still charges (issue 37, item 8);
//! - an asker of a quota lease waiting on a full key under fresh hold ids leaves a bounded
//!   number of holds of nothing, and the answers do not change; slices of one unit under fresh
//!   ids stop at a bounded number of holds too, and so do reservations left unsettled (issue 37,
//!   item 2).

mod support;

use redis::AsyncCommands;
use sluice::algorithm::lease::{LeaseAsk, MAX_LEASE_HOLDS, MAX_WAITING_HOLDS};
use sluice::algorithm::reservation::MAX_RESERVATIONS;
use sluice::algorithm::{Algorithm, HoldId, Limit, MAX_EXACT, Micros};
use sluice::rule::RuleCheck;
use sluice::store::keys::{reservation_key, state_key};
use sluice::store::memory::MemoryStore;
use sluice::store::redis::{RedisConfig, RedisStore};
use sluice::store::{LeaseOp, Settle, Store};
use support::redis_server::RedisServer;

const T0: Micros = 1_699_920_000_000_000; // a whole day
const SEC: Micros = 1_000_000;
const TAG: &str = "debt";
const HUGE: u64 = u64::MAX - 100;

/// Every algorithm that can reserve, hence owe.
const OWING: [Algorithm; 5] = [
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowCounter,
];

async fn redis_store(server: &RedisServer) -> RedisStore {
    let mut config = RedisConfig::single(server.url());
    // Debug builds on a busy 2-core box.
    config.timeout = std::time::Duration::from_secs(5);
    config.denial_cache = 0;
    RedisStore::connect(config).await.expect("store")
}

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url()).unwrap().get_multiplexed_async_connection().await.unwrap()
}

fn reserving(algorithm: Algorithm, requests: u64) -> Limit {
    Limit::new(algorithm, requests, 3600 * SEC, None, None).unwrap().reserving(600 * SEC).unwrap()
}

fn reserve<'a>(rule: u64, limit: &'a Limit, key: &'a [u8], estimate: u64, hold: HoldId) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key, cost: estimate, enforce: true, hold }
}

fn settle<'a>(rule: u64, limit: &'a Limit, key: &'a [u8], reserved: u64, cost: u64) -> Settle<'a> {
    Settle { rule, limit, key, cost, reserved }
}

/// Spends a limit of 10 (three reservations of 1, seven requests consumed at once), then
/// settles the three reservations at [`HUGE`], as a lease token whose estimate was edited would,
/// and charges [`HUGE`] for a reservation of 0 twice; returns how many of 30 requests a second
/// later are admitted, and whether a cost of 0 is.
async fn admitted_after_huge_settles<S: Store>(store: &S, rule: u64, limit: &Limit) -> (usize, bool) {
    let key = b"tenant";
    let algorithm = limit.algorithm();
    for hold in 1..=3 {
        let verdict = store.check_for(TAG, Some(T0), &[reserve(rule, limit, key, 1, hold)]).await.unwrap();
        assert!(verdict.allowed, "{algorithm}: reservation {hold}");
    }
    for _ in 0..7 {
        assert!(store.check_for(TAG, Some(T0), &[reserve(rule, limit, key, 1, 0)]).await.unwrap().allowed);
    }
    assert!(!store.check_for(TAG, Some(T0), &[reserve(rule, limit, key, 1, 0)]).await.unwrap().allowed);
    for hold in 1..=3 {
        let found = store.settle_for(TAG, Some(T0), &[settle(rule, limit, key, HUGE, HUGE)], hold).await.unwrap();
        assert_eq!(found, 1, "{algorithm}: hold {hold}");
    }
    for hold in [7, 7] {
        store.settle_for(TAG, Some(T0), &[settle(rule, limit, key, 0, HUGE)], hold).await.unwrap();
    }
    let mut admitted = 0;
    for _ in 0..30 {
        let verdict = store.check_for(TAG, Some(T0 + SEC), &[reserve(rule, limit, key, 1, 0)]).await.unwrap();
        admitted += usize::from(verdict.allowed);
    }
    let free = store.check_for(TAG, Some(T0 + SEC), &[reserve(rule, limit, key, 0, 0)]).await.unwrap().allowed;
    (admitted, free)
}

#[tokio::test]
async fn memory_a_settle_with_a_huge_cost_never_resets_a_spent_limit() {
    let store = MemoryStore::new(10_000);
    for (rule, algorithm) in OWING.into_iter().enumerate() {
        let limit = reserving(algorithm, 10);
        assert_eq!(admitted_after_huge_settles(&store, rule as u64, &limit).await, (0, false), "{algorithm}");
    }
}

#[tokio::test]
async fn redis_a_settle_with_a_huge_cost_never_resets_a_spent_limit() {
    let server = RedisServer::start();
    let store = redis_store(&server).await;
    let mut redis = raw(&server).await;
    for (rule, algorithm) in OWING.into_iter().enumerate() {
        let limit = reserving(algorithm, 10);
        assert_eq!(admitted_after_huge_settles(&store, rule as u64, &limit).await, (0, false), "{algorithm}");
        // Every number the script wrote is an integer a double holds exactly: none past 2^53,
        // none wrapped negative by '%d'.
        let key = state_key(TAG, rule as u64, b"tenant");
        let written: Vec<String> = match redis.hgetall::<_, Vec<String>>(&key).await {
            Ok(fields) => fields.into_iter().skip(1).step_by(2).collect(),
            Err(_) => vec![redis.get::<_, String>(&key).await.unwrap()], // gcra: a string
        };
        for text in written.iter().filter(|t| t.bytes().all(|b| b.is_ascii_digit() || b == b'-')) {
            let n: i128 = text.parse().unwrap();
            assert!((0..=i128::from(MAX_EXACT)).contains(&n), "{algorithm}: {text} in {written:?}");
        }
    }
}

/// `max_tokens: 0` with no `plus` (or `reportAfter`) reserves 0 on every admission: nothing may
/// be held for it, or each admission would leave a hold on the key for the reservation's ttl.
#[tokio::test]
async fn a_reservation_of_zero_holds_nothing_on_either_store() {
    let server = RedisServer::start();
    let redis_store = redis_store(&server).await;
    let mut redis = raw(&server).await;
    let memory = MemoryStore::new(10_000);
    let limit = reserving(Algorithm::TokenBucket, 1000);
    for hold in 1..=500 {
        let admission = [reserve(1, &limit, b"zero", 0, hold)];
        assert!(redis_store.check_for(TAG, Some(T0), &admission).await.unwrap().allowed);
        assert!(memory.check_for(TAG, Some(T0), &admission).await.unwrap().allowed);
    }
    let holds: u64 = redis.hlen(reservation_key(&state_key(TAG, 1, b"zero"))).await.unwrap();
    assert_eq!(holds, 0, "Redis holds of nothing");
    assert_eq!(memory.stats().live_keys, 0, "nothing was taken, so the memory store keeps nothing");
    // Settled as reserved 0: charged all the same, on both.
    for store_settles in [
        redis_store.settle_for(TAG, Some(T0), &[settle(1, &limit, b"zero", 0, 300)], 17).await,
        memory.settle_for(TAG, Some(T0), &[settle(1, &limit, b"zero", 0, 300)], 17).await,
    ] {
        assert_eq!(store_settles, Ok(1));
    }
    let after = [reserve(1, &limit, b"zero", 0, 0)];
    assert_eq!(redis_store.check_for(TAG, Some(T0), &after).await.unwrap().decisions[0].remaining, 700);
    assert_eq!(memory.check_for(TAG, Some(T0), &after).await.unwrap().decisions[0].remaining, 700);
}

fn leased(algorithm: Algorithm) -> Limit {
    Limit::new(algorithm, 1000, 3600 * SEC, None, None).unwrap().leasing().unwrap()
}

fn ask(hold: HoldId, want: u64) -> LeaseAsk {
    LeaseAsk { hold, want, cap: 10, ttl: 60 * SEC }
}

/// A key whose overshoot bound (10) is out in one holder's slice, then thousands of asks under
/// fresh hold ids: each is answered "nothing" with the key's room, and the key keeps at most
/// the slice and [`MAX_WAITING_HOLDS`] holds of nothing (before: one hash field per ask, kept to
/// the window's end and read by every later operation).
#[tokio::test]
async fn holds_of_nothing_stay_bounded_on_a_full_key() {
    const ASKS: u64 = 3000;
    let server = RedisServer::start();
    let redis_store = redis_store(&server).await;
    let mut redis = raw(&server).await;
    let memory = MemoryStore::new(10_000);
    for (rule, algorithm) in [Algorithm::FixedWindow, Algorithm::TokenBucket].into_iter().enumerate() {
        let limit = leased(algorithm);
        let rule = rule as u64 + 1;
        let op = |hold, want| LeaseOp { rule, limit: &limit, key: b"hot", settle: None, ask: Some(ask(hold, want)) };
        let first = redis_store.lease_tagged(TAG, Some(T0), &[op(1, 10)]).await.unwrap();
        assert_eq!(first[0].amount, 10, "{algorithm}");
        assert_eq!(memory.lease_at(TAG, T0, &[op(1, 10)])[0].amount, 10, "{algorithm}");
        let mut answers = Vec::new();
        for batch in 0..ASKS / 100 {
            let ops: Vec<LeaseOp<'_>> = (0..100).map(|i| op(1000 + batch * 100 + i, 1)).collect();
            let now = T0 + batch * 10_000;
            answers.extend(redis_store.lease_tagged(TAG, Some(now), &ops).await.unwrap());
            answers.extend(memory.lease_at(TAG, now, &ops));
        }
        assert!(answers.iter().all(|g| g.amount == 0 && g.after.remaining == 990), "{algorithm}: {:?}", answers[0]);
        let most = 1 + MAX_WAITING_HOLDS as u64;
        assert!(answers.iter().all(|g| g.holders <= most), "{algorithm}: holders past {most}");
        let fields: u64 = redis.hlen(reservation_key(&state_key(TAG, rule, b"hot"))).await.unwrap();
        assert!(fields <= most, "{algorithm}: {fields} hash fields after {ASKS} asks");
        // The slice's holder still settles as before.
        let settle_op = LeaseOp { rule, limit: &limit, key: b"hot", settle: Some((1, 4)), ask: None };
        let after = redis_store.lease_tagged(TAG, Some(T0 + 40 * SEC), &[settle_op]).await.unwrap();
        assert_eq!(after[0].after.remaining, 996, "{algorithm}");
    }
}

/// Slices of one unit under fresh hold ids with an overshoot bound (10 000) far above
/// [`MAX_LEASE_HOLDS`]: the key keeps at most that many holds, on both stores alike, and the
/// units they hold count.
#[tokio::test]
async fn lease_holds_stay_bounded_under_slices_of_one() {
    let server = RedisServer::start();
    let redis_store = redis_store(&server).await;
    let mut redis = raw(&server).await;
    let memory = MemoryStore::new(10_000);
    let limit = Limit::new(Algorithm::FixedWindow, 100_000, 3600 * SEC, None, None).unwrap().leasing().unwrap();
    let wide = |hold| LeaseOp {
        rule: 9,
        limit: &limit,
        key: b"wide",
        settle: None,
        ask: Some(LeaseAsk { hold, want: 1, cap: 10_000, ttl: 60 * SEC }),
    };
    let (mut from_redis, mut from_memory) = (Vec::new(), Vec::new());
    for batch in 0..10u64 {
        let ops: Vec<LeaseOp<'_>> = (0..100).map(|i| wide(1 + batch * 100 + i)).collect();
        from_redis.extend(redis_store.lease_tagged(TAG, Some(T0), &ops).await.unwrap());
        from_memory.extend(memory.lease_at(TAG, T0, &ops));
    }
    assert_eq!(from_redis, from_memory, "both stores answer alike");
    let granted: u64 = from_redis.iter().map(|g| g.amount).sum();
    assert_eq!(granted, MAX_LEASE_HOLDS as u64);
    let fields: u64 = redis.hlen(reservation_key(&state_key(TAG, 9, b"wide"))).await.unwrap();
    assert_eq!(fields, MAX_LEASE_HOLDS as u64, "hash fields after 1000 asks");
    assert_eq!(from_redis.last().map(|g| g.after.remaining), Some(100_000 - MAX_LEASE_HOLDS as u64));
}

/// Reservations of 1 left unsettled under fresh hold ids: past [`MAX_RESERVATIONS`] each is
/// charged at once, so the key's hash stops growing, and both stores decide alike.
#[tokio::test]
async fn unsettled_reservations_stay_bounded_per_key() {
    let server = RedisServer::start();
    let redis_store = redis_store(&server).await;
    let mut redis = raw(&server).await;
    let memory = MemoryStore::new(10_000);
    let limit = reserving(Algorithm::FixedWindow, 100_000);
    let total = MAX_RESERVATIONS as u64 + 100;
    for hold in 1..=total {
        let admission = [reserve(4, &limit, b"many", 1, hold)];
        let (from_redis, from_memory) = (
            redis_store.check_for(TAG, Some(T0), &admission).await.unwrap(),
            memory.check_for(TAG, Some(T0), &admission).await.unwrap(),
        );
        assert_eq!(from_redis, from_memory, "admission {hold}");
        assert!(from_redis.allowed);
    }
    let fields: u64 = redis.hlen(reservation_key(&state_key(TAG, 4, b"many"))).await.unwrap();
    assert_eq!(fields, MAX_RESERVATIONS as u64, "hash fields after {total} reservations");
    let after = [reserve(4, &limit, b"many", 0, 0)];
    assert_eq!(redis_store.check_for(TAG, Some(T0), &after).await.unwrap().decisions[0].remaining, 100_000 - total);
}
