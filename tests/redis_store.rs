//! RedisStore against a real redis-server: the Lua script must give the pure Rust algorithms'
//! decisions, atomically, with TTLs, surviving script-cache loss and outages.

mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use redis::{AsyncCommands, Value};
use sluice::algorithm::{self, Algorithm, Decision, Limit, Micros, State};
use sluice::clock::FakeClock;
use sluice::rule::Verdict;
use sluice::rule::{RuleCheck, RuleId};
use sluice::store::breaker::BreakerConfig;
use sluice::store::keys::state_key;
use sluice::store::redis::{RedisConfig, RedisStore};
use sluice::store::{Settle, Store, StoreError};
use support::redis_server::RedisServer;

const T0: Micros = 1_700_000_000_000_000;
const SEC: Micros = 1_000_000;
const MS: Micros = 1_000;

async fn store(server: &RedisServer) -> RedisStore {
    let mut config = RedisConfig::single(server.url());
    // Debug builds on a busy 2-core box: the default 50 ms would make these tests flaky.
    config.timeout = Duration::from_secs(5);
    // These tests compare every call's answer with Redis's own; the denial cache answers repeats
    // itself (tested on its own below).
    config.denial_cache = 0;
    RedisStore::connect(config).await.expect("store")
}

async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url()).unwrap().get_multiplexed_async_connection().await.unwrap()
}

fn limit(algorithm: Algorithm, requests: u64, per: Micros, burst: Option<u64>, max_delay: Option<Micros>) -> Limit {
    Limit::new(algorithm, requests, per, burst, max_delay).unwrap()
}

fn check<'a>(rule: RuleId, limit: &'a Limit, key: &'a [u8], cost: u64, enforce: bool) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key, cost, enforce, hold: 0 }
}

/// Limits exercising every algorithm, odd intervals (rounded up), tiny and long windows, and the
/// leaky bucket both policing and shaping.
fn limit_pool() -> Vec<Limit> {
    use Algorithm::*;
    vec![
        limit(TokenBucket, 10, SEC, Some(5), None),
        limit(TokenBucket, 3, SEC, None, None),
        limit(TokenBucket, 1, MS, Some(3), None),
        limit(Gcra, 10, SEC, Some(5), None),
        limit(Gcra, 3, SEC, None, None),
        limit(Gcra, 7, 10 * MS, Some(2), None),
        limit(LeakyBucket, 10, SEC, Some(5), None),
        limit(LeakyBucket, 5, SEC, Some(3), Some(300 * MS)),
        limit(LeakyBucket, 2, 100 * MS, Some(4), Some(0)),
        limit(FixedWindow, 5, SEC, None, None),
        limit(FixedWindow, 100, 60 * SEC, None, None),
        limit(FixedWindow, 3, 7 * MS, None, None),
        limit(SlidingWindowLog, 5, SEC, None, None),
        limit(SlidingWindowLog, 3, 10 * MS, None, None),
        limit(SlidingWindowLog, 40, SEC, None, None),
        limit(SlidingWindowCounter, 7, 60 * SEC, None, None),
        limit(SlidingWindowCounter, 5, SEC, None, None),
        limit(SlidingWindowCounter, 3, 10 * MS, None, None),
    ]
}

/// The reference: the pure algorithms driven exactly as every store must drive them (decide all,
/// then consume in each admitting rule only when no enforcing rule denied).
/// What a step must have left as a key's TTL.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Ttl {
    /// No key.
    Gone,
    /// This many ms, set by this step.
    Set(u64),
    /// Untouched by this step: a fixed window or sliding counter going on, whose TTL an earlier
    /// step already set to end where the state is pristine (the test has persisted it since).
    Kept,
}

/// For each key a step wrote, what its TTL must be.
type Written = Vec<(Vec<u8>, Ttl)>;

#[derive(Default)]
struct Model {
    states: HashMap<Vec<u8>, State>,
    /// For windowed states: the pristine instant the key's TTL was last set to end at (the
    /// script's `e` field).
    ttl_ends_at: HashMap<Vec<u8>, Micros>,
}

/// The window start of the states whose script keeps their TTL while the window goes on.
fn window_start(state: Option<&State>) -> Option<(u8, Micros)> {
    match state {
        Some(State::Window { start, .. }) => Some((0, *start)),
        Some(State::Counter { start, .. }) => Some((1, *start)),
        _ => None,
    }
}

impl Model {
    /// Returns the verdict and, for each key written, the TTL (ms) the script must have set
    /// (`None`: the key must not exist).
    fn decide(&mut self, now: Micros, checks: &[(Vec<u8>, RuleCheck<'_>)]) -> (Verdict, Written) {
        let decisions: Vec<Decision> =
            checks.iter().map(|(k, c)| algorithm::check(c.limit, self.states.get(k), now, c.cost)).collect();
        let plain: Vec<RuleCheck<'_>> = checks.iter().map(|(_, c)| *c).collect();
        let mut verdict = Verdict::from_decisions(&plain, decisions);
        if !verdict.allowed {
            // Nothing is consumed: a rule that had room reports its state as it stands.
            for ((key, c), d) in checks.iter().zip(verdict.decisions.iter_mut()) {
                if d.allowed {
                    *d = algorithm::check(c.limit, self.states.get(key), now, 0);
                }
            }
        }
        let mut written = Vec::new();
        if verdict.allowed {
            for ((key, c), d) in checks.iter().zip(&verdict.decisions) {
                if !d.allowed {
                    continue;
                }
                let mut state = self.states.remove(key);
                let existed = state.is_some();
                let window_before = window_start(state.as_ref());
                let pristine_at = algorithm::apply(c.limit, &mut state, now, c.cost);
                let empty_log = matches!(&state, Some(State::Log(l)) if l.is_empty());
                if (!existed && pristine_at <= now) || empty_log {
                    // Not created (zero cost on a fresh key) or an empty log (pristine, like no
                    // state at all): no key in Redis.
                    self.ttl_ends_at.remove(key);
                    written.push((key.clone(), Ttl::Gone));
                } else {
                    let window_after = window_start(state.as_ref());
                    self.states.insert(key.clone(), state.expect("applied"));
                    let us = pristine_at.saturating_sub(now);
                    let set = Ttl::Set(us.div_ceil(1000).max(1));
                    if window_after.is_none() {
                        self.ttl_ends_at.remove(key);
                        written.push((key.clone(), set));
                    } else if window_after == window_before && self.ttl_ends_at.get(key) == Some(&pristine_at) {
                        // Set by an earlier write of this same step, if any, else by an earlier step.
                        let earlier = written.iter().rev().find(|(k, _)| k == key).map(|(_, t)| *t);
                        written.push((key.clone(), earlier.unwrap_or(Ttl::Kept)));
                    } else {
                        self.ttl_ends_at.insert(key.clone(), pristine_at);
                        written.push((key.clone(), set));
                    }
                }
            }
        }
        (verdict, written)
    }
}

/// THE key test: for random sequences of (time, cost) over random sets of rules (including rules
/// whose algorithm changes under the same key, clocks stepping back, zero and oversized costs),
/// the Lua script decides exactly what the Rust algorithms decide and sets the TTLs they imply.
#[tokio::test]
async fn lua_decisions_equal_rust_algorithms() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let pool = limit_pool();
    let tag = "equal-rust";
    for seed in 0..36u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut model = Model::default();
        // Four rule ids per sequence, each bound to a limit that may be edited (re-bound) later.
        let mut bound: Vec<usize> = (0..4).map(|_| rng.random_range(0..pool.len())).collect();
        let mut now = T0 + rng.random_range(0..10 * SEC);
        for step in 0..120 {
            now = match rng.random_range(0..10) {
                0 | 1 => now,
                2 | 3 => now + rng.random_range(1..1_000),
                4..=6 => now + rng.random_range(1_000..400_000),
                7 => now + rng.random_range(400_000..3 * SEC),
                8 => now.saturating_sub(rng.random_range(1..50_000)),
                _ => now + rng.random_range(1..120 * SEC),
            };
            if rng.random_ratio(1, 25) {
                // An edit of the rule: any other limit, algorithm and `per` included, under the
                // same rule id and so the same stored state.
                let slot = rng.random_range(0..4);
                bound[slot] = rng.random_range(0..pool.len());
            }
            // One to three rules, or now and then nine to twelve (past the script's scan for a key
            // written twice, lua/check.lua), drawn with replacement: the same rule and key twice in
            // one request consumes on top of the first write.
            let count = if rng.random_ratio(1, 10) { rng.random_range(9..=12) } else { rng.random_range(1..=3) };
            let rules: Vec<usize> = (0..count).map(|_| rng.random_range(0..4)).collect();
            let key_values: Vec<Vec<u8>> =
                (0..count).map(|_| format!("k{}", rng.random_range(0..2)).into_bytes()).collect();
            let cost = match rng.random_range(0..10) {
                0 => 0,
                1..=5 => 1,
                6..=8 => rng.random_range(2..5),
                _ => rng.random_range(5..60),
            };
            let checks: Vec<(Vec<u8>, RuleCheck<'_>)> = (0..count)
                .map(|i| {
                    let rule = seed * 100 + rules[i] as u64;
                    let c = check(rule, &pool[bound[rules[i]]], &key_values[i], cost, !rng.random_ratio(1, 5));
                    (state_key(tag, rule, c.key), c)
                })
                .collect();
            let model_before = model.states.clone();
            let (expected, written) = model.decide(now, &checks);
            let plain: Vec<RuleCheck<'_>> = checks.iter().map(|(_, c)| *c).collect();
            // Redis answers the decision's instant (what a shaped slot is given back by); the
            // model does not keep one.
            let got = store.check_tagged(tag, Some(now), &plain).await.map(|verdict| {
                assert_eq!(verdict.at, Some(now), "the decision's instant");
                Verdict { at: None, ..verdict }
            });
            let context = || {
                format!(
                    "seed {seed} step {step} now {now} cost {cost} rules {:?}",
                    checks
                        .iter()
                        .map(|(k, c)| (String::from_utf8_lossy(k).into_owned(), c.limit.clone(), c.enforce))
                        .collect::<Vec<_>>()
                )
            };
            if got.as_ref() != Ok(&expected) {
                let mut states = String::new();
                for (key, _) in &checks {
                    let kind: String = redis::cmd("TYPE").arg(key).query_async(&mut con).await.unwrap();
                    let pttl: i64 = con.pttl(key).await.unwrap();
                    states += &format!(
                        "\n  {} model {:?} redis {kind} pttl {pttl}",
                        String::from_utf8_lossy(key),
                        model_before.get(key)
                    );
                }
                panic!("{}\n  redis {got:?}\n  rust  {expected:?}{states}", context());
            }
            for (i, (key, ttl)) in written.iter().enumerate() {
                if written[i + 1..].iter().any(|(later, _)| later == key) {
                    // Written again by a later rule of the request: its TTL is the last write's.
                    continue;
                }
                let ttl = *ttl;
                let pttl: i64 = con.pttl(key).await.unwrap();
                // The test's clock is not Redis's: keep the key until the test's time says it is
                // pristine (the model never expires anything either).
                let persisted: bool = con.persist(key).await.unwrap();
                match ttl {
                    Ttl::Gone => assert_eq!(pttl, -2, "key must not exist: {}", context()),
                    Ttl::Kept => {
                        assert_eq!(pttl, -1, "the TTL should have been left alone: {}", context());
                    }
                    Ttl::Set(ttl) => {
                        let ttl = ttl as i64;
                        if pttl != -2 {
                            assert!(pttl <= ttl && pttl >= ttl - 250, "pttl {pttl} expected {ttl}: {}", context());
                        }
                        if !persisted {
                            // A short TTL ran out in real time before we could persist it: Redis
                            // forgot a nearly pristine key, so the model must forget it too.
                            assert!(ttl <= 250, "key with a {ttl} ms TTL vanished: {}", context());
                            model.states.remove(key);
                            model.ttl_ends_at.remove(key);
                        }
                    }
                }
            }
        }
    }
}

/// Hand-checked values against the seed examples, through Redis: 5 then 3 for a bucket of 5 at
/// 10/s, and the sliding-counter book example (limit 7, previous 5, current 3, 30% in).
#[tokio::test]
async fn seed_examples_through_redis() {
    let server = RedisServer::shared();
    let store = store(server).await;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::LeakyBucket] {
        let l = limit(algorithm, 10, SEC, Some(5), None);
        let key = algorithm.name().as_bytes();
        let mut first = 0;
        for _ in 0..20 {
            first += store.check_tagged("seed", Some(T0), &[check(1, &l, key, 1, true)]).await.unwrap().allowed as u32;
        }
        let mut later = 0;
        for _ in 0..20 {
            later +=
                store.check_tagged("seed", Some(T0 + 300_000), &[check(1, &l, key, 1, true)]).await.unwrap().allowed
                    as u32;
        }
        assert_eq!((first, later), (5, 3), "{algorithm}");
    }
    let l = limit(Algorithm::SlidingWindowCounter, 7, 60 * SEC, None, None);
    let minute = 28_333_333 * 60 * SEC;
    for _ in 0..5 {
        assert!(
            store.check_tagged("seed", Some(minute + SEC), &[check(2, &l, b"swc", 1, true)]).await.unwrap().allowed
        );
    }
    let now = minute + 60 * SEC; // next window
    for _ in 0..3 {
        assert!(store.check_tagged("seed", Some(now + SEC), &[check(2, &l, b"swc", 1, true)]).await.unwrap().allowed);
    }
    let at_30 = now + 18 * SEC;
    let v = store.check_tagged("seed", Some(at_30), &[check(2, &l, b"swc", 1, true)]).await.unwrap();
    assert!(v.allowed);
    assert_eq!(v.decisions[0].remaining, 0);
    assert!(!store.check_tagged("seed", Some(at_30), &[check(2, &l, b"swc", 1, true)]).await.unwrap().allowed);
}

async fn dump(con: &mut redis::aio::MultiplexedConnection, key: &[u8]) -> Option<Vec<u8>> {
    redis::cmd("DUMP").arg(key).query_async(con).await.unwrap()
}

/// A denial by one enforcing rule writes nothing in any rule; a shadow rule's denial blocks
/// nothing; an admitted request consumes in every rule that admitted it.
#[tokio::test]
async fn denial_writes_nothing_anywhere() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let tag = "all-or-nothing";
    // Hour-long limits: keys expire in real time (PEXPIRE) even though the decisions use a
    // passed-in `now`, so short ones could vanish between two dumps on a slow machine.
    let wide = limit(Algorithm::Gcra, 100, 3600 * SEC, None, None);
    let log = limit(Algorithm::SlidingWindowLog, 100, 3600 * SEC, None, None);
    let narrow = limit(Algorithm::FixedWindow, 1, 60 * SEC, None, None);
    let checks =
        [check(1, &wide, b"ip", 1, true), check(2, &log, b"ip", 1, true), check(3, &narrow, b"tenant", 1, true)];
    let keys: Vec<Vec<u8>> = checks.iter().map(|c| state_key(tag, c.rule, c.key)).collect();

    let first = store.check_tagged(tag, Some(T0), &checks).await.unwrap();
    assert!(first.allowed);
    let before: Vec<_> = dump_all(&mut con, &keys).await;
    assert!(before.iter().all(Option::is_some), "every admitting rule consumed");

    let denied = store.check_tagged(tag, Some(T0 + 1), &checks).await.unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.decisions.iter().map(|d| d.allowed).collect::<Vec<_>>(), [true, true, false]);
    assert_eq!(dump_all(&mut con, &keys).await, before, "a denial changed state");

    // The narrow rule in shadow mode: admitted, the others consume, the shadow rule does not.
    let shadow = [checks[0], checks[1], check(3, &narrow, b"tenant", 1, false)];
    let admitted = store.check_tagged(tag, Some(T0 + 2), &shadow).await.unwrap();
    assert!(admitted.allowed);
    assert!(!admitted.decisions[2].allowed);
    let after = dump_all(&mut con, &keys).await;
    assert_ne!(after[0], before[0]);
    assert_ne!(after[1], before[1]);
    assert_eq!(after[2], before[2], "the denying shadow rule consumed");
}

async fn dump_all(con: &mut redis::aio::MultiplexedConnection, keys: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
    let mut out = Vec::new();
    for key in keys {
        out.push(dump(con, key).await);
    }
    out
}

/// On Redis's own clock (production mode), every key written carries a TTL no longer than the
/// time until its state is pristine.
#[tokio::test]
async fn every_key_gets_a_ttl_on_redis_time() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let tag = "ttl";
    // Periods of a second or more, so no key can expire before it is inspected.
    let pool: Vec<Limit> = limit_pool().into_iter().filter(|l| l.per() >= SEC).collect();
    for (i, l) in pool.iter().enumerate() {
        let v = store.check_tagged(tag, None, &[check(i as u64, l, b"k", 1, true)]).await.unwrap();
        assert!(v.allowed, "{l:?}");
    }
    // A key can only be missing by expiring, which proves it had a TTL: a bucket's state is pristine
    // again one interval (100 ms) after a request, a fixed window's at its end, and a loaded
    // machine can take that long between the checks and KEYS. A key without a TTL never goes.
    let keys: Vec<Vec<u8>> = redis::cmd("KEYS").arg("sl1:{ttl}:*").query_async(&mut con).await.unwrap();
    assert!(keys.len() <= pool.len() && keys.len() * 2 >= pool.len(), "{} keys of {}", keys.len(), pool.len());
    for key in &keys {
        let pttl: i64 = con.pttl(key).await.unwrap();
        // -2: it expired between KEYS and PTTL (a loaded machine), which proves a TTL too; -1 is
        // the failure this test is for, a key that never expires.
        assert!(pttl == -2 || (pttl > 0 && pttl <= 120_000), "{} has pttl {pttl}", String::from_utf8_lossy(key));
    }
    // The sliding counter of 60 s is pristine only two windows on: its key must be there.
    let counter = pool.iter().position(|l| l.algorithm() == Algorithm::SlidingWindowCounter && l.per() == 60 * SEC);
    let counter_key = format!(":{:016x}:", counter.expect("in the pool"));
    assert!(keys.iter().any(|k| String::from_utf8_lossy(k).contains(&counter_key)), "{keys:?}");
}

/// Loaded functions can be lost (a restart without persistence, a failover to a node that never
/// saw them, FUNCTION FLUSH): the call that finds its function missing loads the library and
/// repeats, keeping the state.
#[tokio::test]
async fn survives_function_flush() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let l = limit(Algorithm::FixedWindow, 3, 60 * SEC, None, None);
    let c = [check(1, &l, b"k", 1, true)];
    assert!(store.check_tagged("flush", Some(T0), &c).await.unwrap().allowed);
    let _: () = redis::cmd("FUNCTION").arg("FLUSH").query_async(&mut con).await.unwrap();
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut con).await.unwrap();
    let second = store.check_tagged("flush", Some(T0), &c).await.expect("reloaded after the flush");
    assert!(second.allowed);
    assert_eq!(second.decisions[0].remaining, 1, "state kept across the reload");
    let libraries: Value = redis::cmd("FUNCTION").arg("LIST").query_async(&mut con).await.unwrap();
    assert!(format!("{libraries:?}").contains(&*sluice::store::redis::library::FUNCTION_NAME), "{libraries:?}");
}

/// Many clients on one key at one instant admit exactly the bound, never more: 32 tasks over
/// four stores (four replicas' connections) × 20 requests against a limit of 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_never_over_admit() {
    let server = RedisServer::shared();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(store(server).await));
    }
    for algorithm in Algorithm::ALL {
        let l = Arc::new(limit(algorithm, 100, 3_600 * SEC, None, None));
        let mut tasks = Vec::new();
        for t in 0..32 {
            let (store, l) = (stores[t % 4].clone(), l.clone());
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..20 {
                    let v = store
                        .check_tagged("race", Some(T0), &[check(7, &l, algorithm.name().as_bytes(), 1, true)])
                        .await;
                    admitted += v.expect("decision").allowed as u64;
                }
                admitted
            }));
        }
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        assert_eq!(total, 100, "{algorithm}");
    }
}

/// Generic code over `Store` gets the Redis store's decisions (default tag).
#[tokio::test]
async fn usable_through_the_store_trait() {
    async fn admitted<S: Store>(store: &S, l: &Limit, n: usize) -> usize {
        let mut count = 0;
        for _ in 0..n {
            count += store.check(Some(T0), &[check(99, l, b"trait", 1, true)]).await.unwrap().allowed as usize;
        }
        count
    }
    let server = RedisServer::shared();
    let store = store(server).await;
    let l = limit(Algorithm::TokenBucket, 3, SEC, None, None);
    assert_eq!(admitted(&store, &l, 5).await, 3);
    assert!(store.check_tagged("other-ns", Some(T0), &[check(99, &l, b"trait", 1, true)]).await.unwrap().allowed);
    assert_eq!(
        store.check(Some(T0), &[]).await.unwrap(),
        Verdict { allowed: true, decisions: vec![], cached_denial: None, at: None }
    );
}

/// Redis killed: calls fail within the deadline, the breaker opens and then fails calls at once;
/// Redis back on the same port: decisions resume by themselves and the breaker closes.
///
/// The outage runs on tokio's paused clock (the deadline is a tokio timer) and the breaker on a
/// fake clock, so no assertion depends on how fast the machine is.
#[tokio::test]
async fn outage_fails_fast_and_recovers() {
    let mut server = RedisServer::start();
    let clock = FakeClock::new(T0);
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_millis(50);
    config.breaker = BreakerConfig { failure_threshold: 3, cool_down: Duration::from_millis(300) };
    let deadline = config.timeout;
    let cool_down = config.breaker.cool_down.as_micros() as Micros;
    let store = RedisStore::connect_with_clock(config, Arc::new(clock.clone())).await.unwrap();
    let l = limit(Algorithm::Gcra, 1_000, SEC, None, None);
    let c = [check(1, &l, b"k", 1, true)];
    // Warm up, in real time: the first call connects and loads the script on a slow debug build.
    let mut warm = Err(StoreError::Timeout(0));
    for _ in 0..50 {
        warm = store.check_tagged("outage", None, &c).await;
        if warm.is_ok() {
            break;
        }
    }
    assert!(warm.is_ok(), "{warm:?}");
    assert_eq!(store.breaker_state(), "closed");

    server.kill();
    // From here tokio's time moves only to its next timer: a call bounded by its deadline takes
    // at most the deadline (to the timer wheel's millisecond), however loaded the machine.
    tokio::time::pause();
    let mut failures = 0;
    while store.breaker_state() == "closed" {
        let started = tokio::time::Instant::now();
        let result = store.check_tagged("outage", None, &c).await;
        let elapsed = started.elapsed();
        assert!(matches!(result, Err(StoreError::Timeout(_) | StoreError::Unavailable(_))), "{result:?}");
        assert!(elapsed <= deadline + Duration::from_millis(1), "took {elapsed:?} with a 50 ms deadline");
        failures += 1;
        assert!(failures <= 3, "breaker did not open after 3 failures");
    }
    assert_eq!(store.breaker_state(), "open");
    // The open breaker answers without touching the network: the call completes on its first
    // poll, without waiting for anything.
    let fast = store.check_tagged("outage", None, &c).now_or_never().expect("open breaker must not wait");
    assert!(matches!(&fast, Err(StoreError::Unavailable(m)) if m.contains("breaker")), "{fast:?}");
    // No time passes on the store's clock: the breaker stays open, whatever the wall clock does.
    assert_eq!(store.breaker_state(), "open");
    tokio::time::resume();

    server.restart();
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        // Each attempt after a full cool-down: the probe the breaker lets through.
        clock.advance(cool_down);
        if let Ok(v) = store.check_tagged("outage", None, &c).await {
            assert!(v.allowed);
            break;
        }
        assert!(Instant::now() < give_up, "decisions did not resume after Redis came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(store.breaker_state(), "closed");
}

/// A store whose Redis never existed still constructs (the process must start and apply
/// failure modes), and reports the outage as an error, not a hang: within the deadline, on
/// tokio's paused clock.
#[tokio::test(start_paused = true)]
async fn unreachable_redis_is_an_error_not_a_hang() {
    let port = support::redis_server::free_port(false);
    let mut config = RedisConfig::single(format!("redis://:secret@127.0.0.1:{port}"));
    config.timeout = Duration::from_millis(50);
    let deadline = config.timeout;
    let store = RedisStore::connect(config).await.expect("lazy connect");
    assert!(!format!("{store:?}").contains("secret"));
    let l = limit(Algorithm::Gcra, 10, SEC, None, None);
    let started = tokio::time::Instant::now();
    let result = store.check_tagged("nowhere", None, &[check(1, &l, b"k", 1, true)]).await;
    assert!(result.is_err());
    assert!(!result.unwrap_err().to_string().contains("secret"));
    assert!(started.elapsed() <= deadline + Duration::from_millis(1), "{:?}", started.elapsed());
}

/// TTLs are the time until pristine rounded UP to whole milliseconds (a key must never expire
/// while its state still matters), at least 1 ms. The script and PTTL run in one MULTI so no
/// time passes between them.
#[tokio::test]
async fn ttl_rounds_up_to_whole_milliseconds() {
    use sluice::store::redis::{codec::script_args, library::SCRIPT_SOURCE};
    let server = RedisServer::shared();
    let mut con = raw(server).await;
    let gcra = limit(Algorithm::Gcra, 7, 10 * MS, Some(2), None); // interval 1429 µs
    let window = limit(Algorithm::FixedWindow, 5, SEC, None, None);
    let second = 1_700_000_000 * SEC;
    let cases: [(&Limit, Micros, u64, i64); 5] = [
        (&gcra, T0, 1, 2),                 // 1429 µs → 2 ms
        (&gcra, T0 + 10 * SEC, 2, 3),      // 2858 µs → 3 ms
        (&window, second + 999_500, 1, 1), // 500 µs → 1 ms
        (&window, second + 1, 1, 1_000),   // 999 999 µs → 1000 ms
        (&window, second, 1, 1_000),       // exactly 1 s
    ];
    for (i, (l, now, cost, expected)) in cases.into_iter().enumerate() {
        let key = state_key("ttl-exact", i as u64, b"k");
        let checks = [check(i as u64, l, b"k", cost, true)];
        let (_, pttl): (Value, i64) = redis::pipe()
            .atomic()
            .cmd("EVAL")
            .arg(&*SCRIPT_SOURCE)
            .arg(1)
            .arg(&key)
            .arg(script_args(Some(now), &checks))
            .cmd("PTTL")
            .arg(&key)
            .query_async(&mut con)
            .await
            .unwrap();
        // Redis's millisecond clock may tick between the script's PEXPIRE and PTTL, even in one
        // MULTI; the TTL set is the expected one, what PTTL reads may be one less.
        assert!(pttl == expected || pttl == expected - 1, "case {i}: pttl {pttl}, expected {expected}");
    }
}

/// `rediss://` works with a private CA, and an untrusted certificate is an error, not a panic
/// (redis's rustls needs a crypto provider the store installs).
#[tokio::test]
async fn tls_with_a_private_ca() {
    let (_server, tls_port, ca, _dir) = support::redis_server::start_tls();
    let l = limit(Algorithm::Gcra, 10, SEC, None, None);
    let c = [check(1, &l, b"k", 1, true)];

    let mut config = RedisConfig::single(format!("rediss://127.0.0.1:{tls_port}"));
    config.timeout = Duration::from_secs(5);
    config.tls_root_ca = Some(ca);
    let store = RedisStore::connect(config.clone()).await.expect("tls store");
    let v = store.check_tagged("tls", None, &c).await.expect("decision over TLS");
    assert!(v.allowed);

    config.tls_root_ca = None;
    config.timeout = Duration::from_millis(500);
    let untrusted = RedisStore::connect(config).await.expect("lazy");
    assert!(untrusted.check_tagged("tls", None, &c).await.is_err());
}

/// The decision script of the release before Redis Functions, as an old replica sends it.
const V1_SCRIPT: &str = include_str!("fixtures/check-v1.lua");

/// What an old replica sends: EVAL of the v1 script with its eight arguments per rule.
async fn v1_decide(
    con: &mut redis::aio::MultiplexedConnection,
    key: &[u8],
    check: &RuleCheck<'_>,
    now: Micros,
) -> bool {
    let l = check.limit;
    let code = sluice::store::redis::codec::algorithm_code(l.algorithm());
    let max_delay = l.max_delay().map_or(-1, |d| d as i64);
    let reply: Vec<i64> = redis::Script::new(V1_SCRIPT)
        .key(key)
        .arg(now)
        .arg(code)
        .arg(l.requests())
        .arg(l.per())
        .arg(l.burst())
        .arg(l.interval())
        .arg(max_delay)
        .arg(check.cost)
        .arg(u8::from(check.enforce))
        .invoke_async(con)
        .await
        .expect("v1 script");
    reply[0] == 1
}

/// A rolling upgrade: an old replica (the v1 script) and a new one (the Functions library) on one
/// key, alternating, count together: every algorithm admits exactly its bound, not up to twice
/// it, and each reads what the other wrote (the state layout is the same).
#[tokio::test]
async fn an_old_and_a_new_replica_count_one_key_together() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let cases = [
        limit(Algorithm::TokenBucket, 1, 3600 * SEC, Some(10), None),
        limit(Algorithm::Gcra, 1, 3600 * SEC, Some(10), None),
        limit(Algorithm::LeakyBucket, 1, 3600 * SEC, Some(10), None),
        limit(Algorithm::FixedWindow, 10, 3600 * SEC, None, None),
        limit(Algorithm::SlidingWindowLog, 10, 3600 * SEC, None, None),
        limit(Algorithm::SlidingWindowCounter, 10, 3600 * SEC, None, None),
    ];
    for (i, l) in cases.iter().enumerate() {
        let rule = 9_000 + i as u64;
        let c = check(rule, l, b"shared", 1, true);
        let key = state_key("upgrade", rule, b"shared");
        let mut admitted = 0;
        for step in 0..30u64 {
            // Distinct microseconds, so the log keeps one entry per request.
            let now = T0 + step;
            let allowed = if step % 2 == 0 {
                v1_decide(&mut con, &key, &c, now).await
            } else {
                store.check_tagged("upgrade", Some(now), &[c]).await.expect("decided").allowed
            };
            admitted += u64::from(allowed);
        }
        assert_eq!(admitted, 10, "{:?}: old and new replicas together admit the bound", l.algorithm());
    }
}

/// The denial cache: a repeat of a denial before its retry-after is answered without Redis (no
/// function call), the same way Redis would; a smaller cost, the retry-after passed, or an edited
/// limit go to Redis; and several replicas' caches never admit more than the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_denials_are_answered_without_redis_and_stay_exact() {
    let server = RedisServer::start();
    let mut con = raw(&server).await;
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_secs(5);
    let store = RedisStore::connect(config.clone()).await.expect("store");
    let calls = |stats: String| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_fcall:"))
            .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    let bucket = limit(Algorithm::TokenBucket, 10, SEC, Some(2), None);
    let c = |cost| [check(1, &bucket, b"hot", cost, true)];
    for _ in 0..2 {
        assert!(store.check_tagged("cache", Some(T0), &c(1)).await.unwrap().allowed);
    }
    let denied = store.check_tagged("cache", Some(T0), &c(1)).await.unwrap();
    assert!(!denied.allowed && denied.cached_denial.is_none(), "Redis's own denial");
    let before: String = redis::cmd("INFO").arg("commandstats").query_async(&mut con).await.unwrap();
    for step in 0..50 {
        let repeat = store.check_tagged("cache", Some(T0 + step * MS), &c(1)).await.unwrap();
        assert_eq!(repeat.cached_denial, Some(0));
        assert_eq!(repeat.decisions[0].retry_after, Some(100 * MS - step * MS), "counts down");
    }
    let after: String = redis::cmd("INFO").arg("commandstats").query_async(&mut con).await.unwrap();
    assert_eq!(calls(after) - calls(before), 0, "50 repeats, no call to Redis");
    assert_eq!(store.status().denial_cache.map(|d| d.hits), Some(50));
    // Past the retry-after Redis is asked again, and admits.
    assert!(store.check_tagged("cache", Some(T0 + 100 * MS), &c(1)).await.unwrap().allowed);
    let edited = limit(Algorithm::TokenBucket, 10, SEC, Some(3), None);
    let answer = store.check_tagged("cache", Some(T0 + 100 * MS), &[check(1, &edited, b"hot", 1, true)]).await.unwrap();
    assert!(answer.cached_denial.is_none(), "an edited limit is asked anew: {answer:?}");

    // Three replicas, each with its cache, 16 clients each, one key: exactly the bound.
    let window = limit(Algorithm::FixedWindow, 30, 3600 * SEC, None, None);
    let replicas: Vec<Arc<RedisStore>> = futures::future::join_all((0..3).map(|_| RedisStore::connect(config.clone())))
        .await
        .into_iter()
        .map(|s| Arc::new(s.expect("store")))
        .collect();
    let window = Arc::new(window);
    let mut tasks = Vec::new();
    for replica in &replicas {
        for _ in 0..16 {
            let (replica, window) = (replica.clone(), window.clone());
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..10 {
                    let checks = [check(2, &window, b"shared", 1, true)];
                    admitted += u64::from(replica.check_tagged("cache", None, &checks).await.unwrap().allowed);
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    assert_eq!(admitted, 30, "zero over-admission with three caches");
    let hits: u64 = replicas.iter().filter_map(|r| r.status().denial_cache).map(|d| d.hits).sum();
    assert!(hits > 0, "the denials after the bound were answered from the caches");
}

/// Requests that arrive while the store's calls are under way go together in the next call
/// (`decide_many`), each decided exactly as on its own: here Redis is paused, so the first two
/// requests' calls wait, and the 18 that arrive meanwhile share the third. A batch mixing
/// requests on one key admits exactly the limit, in order, and the three-rule requests in it
/// stay all-or-nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_requests_share_one_call_and_are_decided_as_on_their_own() {
    let server = RedisServer::start();
    let mut con = raw(&server).await;
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_secs(10);
    config.denial_cache = 0;
    config.batches = 2;
    let store = Arc::new(RedisStore::connect(config).await.expect("store"));
    let window = limit(Algorithm::FixedWindow, 5, 60 * SEC, None, None);
    let tight = limit(Algorithm::FixedWindow, 100, 60 * SEC, None, None);
    let bucket = limit(Algorithm::TokenBucket, 3, 60 * SEC, Some(3), None);
    // Load the library first, so that the counted calls below are decisions only.
    store.check_tagged("batch", Some(T0), &[check(9, &window, b"warm", 1, true)]).await.unwrap();

    // Within the client's own response timeout (500 ms).
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(350).arg("ALL").query_async(&mut con).await.unwrap();
    let decide = |i: usize| {
        let (store, window, tight, bucket) = (store.clone(), window.clone(), tight.clone(), bucket.clone());
        tokio::spawn(async move {
            // Odd requests: one rule on the shared key; even: three rules, the last a bucket of 3.
            let checks: Vec<RuleCheck<'_>> = if i % 2 == 1 {
                vec![check(1, &window, b"shared", 1, true)]
            } else {
                vec![check(2, &tight, b"a", 1, true), check(3, &tight, b"b", 1, true), check(4, &bucket, b"c", 1, true)]
            };
            store.check_tagged("batch", Some(T0 + SEC), &checks).await.unwrap()
        })
    };
    let first: Vec<_> = (0..2).map(decide).collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let rest: Vec<_> = (2..20).map(decide).collect();
    let mut verdicts = Vec::new();
    for task in first.into_iter().chain(rest) {
        verdicts.push(task.await.unwrap());
    }

    let single: Vec<&Verdict> = verdicts.iter().enumerate().filter(|(i, _)| i % 2 == 1).map(|(_, v)| v).collect();
    assert_eq!(single.iter().filter(|v| v.allowed).count(), 5, "exactly the limit of the shared key");
    let multi: Vec<&Verdict> = verdicts.iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(_, v)| v).collect();
    assert_eq!(multi.iter().filter(|v| v.allowed).count(), 3, "the bucket of 3 admits 3 three-rule requests");
    for verdict in &multi {
        assert_eq!(verdict.decisions.len(), 3);
        assert_eq!(verdict.allowed, verdict.decisions[2].allowed, "the bucket decides each request");
    }
    // All-or-nothing inside the batch: the two windows counted only the 3 admitted requests.
    let counted: Vec<Option<String>> =
        redis::cmd("HMGET").arg(state_key("batch", 2, b"a")).arg("count").query_async(&mut con).await.unwrap();
    assert_eq!(counted, [Some("3".to_string())]);

    let status = store.status().batches.expect("batches on a single Redis");
    assert_eq!(status.decisions, 21, "the warm-up, then 20");
    assert_eq!(status.calls, 4, "the warm-up, the two calls Redis held, then one call for the 18 that waited");
}

/// A Redis that needs a password, and a store given none: every call is refused the same way,
/// so the breaker opens (and says so in the log) instead of counting each refusal as a one-off
/// bad answer from a healthy server, which kept it closed forever.
#[tokio::test]
async fn a_missing_password_opens_the_breaker() {
    let port = support::redis_server::free_port(false);
    let _server = RedisServer::start_with(port, &["--requirepass".into(), "s3cret-pass".into()]);
    let mut config = RedisConfig::single(format!("redis://127.0.0.1:{port}"));
    config.breaker = BreakerConfig { failure_threshold: 3, cool_down: Duration::from_secs(60) };
    let store = RedisStore::connect(config).await.expect("lazy connect");
    let l = limit(Algorithm::FixedWindow, 10, SEC, None, None);
    let mut errors = Vec::new();
    for _ in 0..6 {
        match store.check_tagged("noauth", None, &[check(1, &l, b"k", 1, true)]).await {
            Err(error) => errors.push(error.to_string()),
            Ok(verdict) => panic!("decided without the password: {verdict:?}"),
        }
    }
    assert_eq!(store.breaker_state(), "open", "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("NOAUTH") || e.to_lowercase().contains("auth")), "{errors:?}");
    assert!(errors.last().is_some_and(|e| e.contains("breaker")), "{errors:?}");
}

/// Issue 23, item 1: one namespace flooding the store (ten thousand concurrent requests of 64
/// rules each) neither queues another namespace's decisions past their deadline nor opens its
/// breaker. The flood waits in its own namespace's lane and gets `Busy` there (its rules'
/// onStoreFailure decides); before lanes, its keys filled the shared calls, the other
/// namespace's calls timed out behind them, and the one shared breaker opened for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_namespace_flood_leaves_another_deciding() {
    let server = RedisServer::start();
    let mut config = RedisConfig::single(server.url());
    // A deadline a loaded debug build meets with room to spare, which the flood's queue (without
    // lanes: 640 000 keys ahead of b, seconds of calls) still exceeds.
    config.timeout = Duration::from_secs(1);
    config.denial_cache = 0;
    config.namespace_lane = 64;
    config.breaker = BreakerConfig { failure_threshold: 3, cool_down: Duration::from_secs(60) };
    let store = Arc::new(RedisStore::connect(config).await.expect("store"));
    let wide = limit(Algorithm::FixedWindow, 1_000_000, 60 * SEC, None, None);
    let one = [check(1, &wide, b"warm", 1, true)];
    for tag in ["a", "b"] {
        let mut warm = Err(StoreError::Timeout(0));
        for _ in 0..50 {
            warm = store.check_tagged(tag, None, &one).await;
            if warm.is_ok() {
                break;
            }
        }
        assert!(warm.is_ok(), "{warm:?}");
    }

    // The flood's 640 000 keys are made before it starts: made inside its tasks (a debug build,
    // on the two workers that also poll b's calls) they took the CPU that b's 1 s deadline is
    // measured against, and on a loaded machine b timed out behind the test's own key-making
    // rather than behind the store's calls (which is what the lanes are about).
    let flood_keys: Vec<Vec<Vec<u8>>> =
        (0..10_000).map(|request| (0..64).map(|rule| format!("{request}:{rule}").into_bytes()).collect()).collect();
    let flood: Vec<_> = flood_keys
        .into_iter()
        .map(|keys| {
            let store = store.clone();
            tokio::spawn(async move {
                let wide = limit(Algorithm::FixedWindow, 1_000_000, 60 * SEC, None, None);
                let checks: Vec<RuleCheck<'_>> =
                    keys.iter().enumerate().map(|(rule, key)| check(rule as RuleId, &wide, key, 1, true)).collect();
                store.check_tagged("a", None, &checks).await
            })
        })
        .collect();
    let mut b_results = Vec::new();
    for _ in 0..20 {
        b_results.push(store.check_tagged("b", None, &one).await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut a_busy = 0;
    for request in flood {
        if let Err(StoreError::Busy(_)) = request.await.expect("flood task") {
            a_busy += 1;
        }
    }
    // b's lane is never full, so it never gets `busy`; on a loaded 2-core machine one of its calls
    // may still wait its deadline behind a's calls already in Redis. Without the lanes nearly
    // all of them fail.
    let b_busy = b_results.iter().filter(|r| matches!(r, Err(StoreError::Busy(_)))).count();
    let b_failed: Vec<_> = b_results.iter().filter(|r| r.is_err()).collect();
    assert!(b_busy == 0 && b_failed.len() <= 2, "b's decisions failed while a flooded: {b_failed:?}");
    assert!(a_busy > 0, "the flood never filled its lane: the test did not flood");
    let status = store.status();
    assert!(!status.breakers_by_namespace.contains_key("b"), "{:?}", status.breakers_by_namespace);
}

/// A sliding log of a thousand entries decides like the Rust log at every step (denials that walk
/// out more than one page of entries included), and a set written before the script kept its
/// running sum (entries only) is read and upgraded without losing a count.
#[tokio::test]
async fn long_sliding_logs_decide_like_rust_and_old_sets_upgrade() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let mut con = raw(server).await;
    let log = limit(Algorithm::SlidingWindowLog, 1_000, 10 * SEC, None, None);
    let tag = "long-log";
    let key = state_key(tag, 1, b"k");
    let mut model: Option<State> = None;
    let mut now = T0;
    let step = |now: Micros, cost: u64, model: &mut Option<State>| {
        let expected = algorithm::check(&log, model.as_ref(), now, cost);
        if expected.allowed {
            algorithm::apply(&log, model, now, cost);
        }
        expected
    };
    for i in 0..1_100u64 {
        now += 7 * MS + i % 5;
        let cost = if i % 97 == 0 { 150 } else { 1 };
        let expected = step(now, cost, &mut model);
        let got = store.check_tagged(tag, Some(now), &[check(1, &log, b"k", cost, true)]).await.unwrap();
        assert_eq!(got.decisions[0], expected, "step {i} at {now}, cost {cost}");
    }

    // The same entries, written as a set without the sum (the shape before it existed).
    let members: Vec<(f64, String)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async::<Vec<(String, f64)>>(&mut con)
        .await
        .unwrap()
        .into_iter()
        .filter(|(member, _)| member != "sum")
        .map(|(member, score)| (score, member))
        .collect();
    assert!(members.len() > 300, "{} entries", members.len());
    let old = state_key(tag, 2, b"k");
    let _: () = con.zadd_multiple(&old, &members).await.unwrap();
    let _: () = con.pexpire(&old, 60_000).await.unwrap();
    for cost in [1, 0, 40] {
        now += 3 * MS;
        let expected = step(now, cost, &mut model);
        let got = store.check_tagged(tag, Some(now), &[check(2, &log, b"k", cost, true)]).await.unwrap();
        assert_eq!(got.decisions[0], expected, "old set, cost {cost}");
    }
}

/// Issue 23, item 6: keys per namespace are counted, and a namespace at its bound is decided by
/// its failure mode (it adds no more keys to Redis) while the others go on.
#[tokio::test]
async fn a_namespace_at_its_key_bound_stops_adding_keys_and_the_others_go_on() {
    let server = RedisServer::start();
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_secs(5);
    config.denial_cache = 0;
    config.namespace_max_keys = 50;
    config.usage_interval = Some(Duration::from_millis(50));
    let store = RedisStore::connect(config).await.expect("store");
    let hourly = limit(Algorithm::FixedWindow, 10, 3600 * SEC, None, None);
    // 60 keys in one call, decided before any count could see 50 of them (a loop of 60 calls
    // raced the 50 ms counter on a loaded machine).
    let keys: Vec<String> = (0..60).map(|i| format!("user-{i}")).collect();
    let checks: Vec<RuleCheck<'_>> = keys.iter().map(|key| check(1, &hourly, key.as_bytes(), 1, true)).collect();
    store.check_tagged("flood", None, &checks).await.expect("under the bound");
    store.check_tagged("quiet", None, &[check(1, &hourly, b"one", 1, true)]).await.expect("quiet");
    // The counts come from SCAN passes, each published whole: a pass that started between the
    // two writes counts flood's 60 keys without quiet's one. Wait for a pass that began after
    // both (one that sees both counts), not merely for flood's; 30 s: a pass every 50 ms, but a
    // loaded 2-core machine can starve the counting task for seconds.
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let counts = store.status().redis_keys_by_namespace;
        if counts.get("flood").copied().unwrap_or(0) >= 60 && counts.contains_key("quiet") {
            assert_eq!(counts.get("flood"), Some(&60), "{counts:?}");
            assert_eq!(counts.get("quiet"), Some(&1), "{counts:?}");
            break;
        }
        assert!(Instant::now() < give_up, "no pass counted both namespaces: {counts:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = store.check_tagged("flood", None, &[check(1, &hourly, b"one-more", 1, true)]).await;
    assert!(matches!(&refused, Err(StoreError::OverBound(m)) if m.contains("60 keys")), "{refused:?}");
    let mut con = raw(&server).await;
    let keys: Vec<Vec<u8>> = con.keys("sl1:{flood}:*").await.unwrap();
    assert_eq!(keys.len(), 60, "the refused decision added no key");
    assert!(store.check_tagged("quiet", None, &[check(1, &hourly, b"two", 1, true)]).await.is_ok());
}

/// Issue 23, item 6: Redis settings that let one tenant's keys hurt the others are named at
/// start-up.
#[tokio::test]
async fn memory_settings_that_reset_limits_are_named() {
    let server = RedisServer::start();
    let store = store(&server).await;
    let mut con = raw(&server).await;
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("maxmemory-policy").arg("allkeys-lru").query_async(&mut con).await.unwrap();
    let concerns = store.memory_settings(Duration::from_secs(5)).await;
    assert!(concerns.iter().any(|c| c.contains("allkeys-lru") && c.contains("volatile-ttl")), "{concerns:?}");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-ttl")
        .query_async(&mut con)
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg("64mb").query_async(&mut con).await.unwrap();
    assert_eq!(store.memory_settings(Duration::from_secs(5)).await, Vec::<String>::new());
}

/// Concurrency on Redis decides and releases exactly as the Rust algorithm does, step by step:
/// random acquires under random hold ids, releases (repeated, and of holds never taken), leases
/// running out, across two keys; every decision and every release compared.
#[tokio::test]
async fn concurrency_holds_and_releases_like_rust() {
    use sluice::algorithm::concurrency;
    let server = RedisServer::shared();
    let store = store(server).await;
    let tag = "concurrency-equal";
    let l = limit(Algorithm::Concurrency, 3, 2 * SEC, None, None);
    for seed in 0..12u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys: Vec<Vec<u8>> = (0..2).map(|k| format!("s{seed}-k{k}").into_bytes()).collect();
        let mut model: Vec<Option<State>> = vec![None, None];
        let mut now = T0 + seed * 100 * SEC;
        let mut taken: Vec<u64> = Vec::new();
        for step in 0..150 {
            now += rng.random_range(0..400 * MS);
            let k = rng.random_range(0..2);
            if rng.random_ratio(1, 3) && !taken.is_empty() || rng.random_ratio(1, 20) {
                let hold = if taken.is_empty() || rng.random_ratio(1, 5) {
                    rng.random_range(1..u64::MAX)
                } else {
                    taken[rng.random_range(0..taken.len())]
                };
                concurrency::release(&mut model[k], hold, now);
                let settle = Settle { rule: 1, limit: &l, key: &keys[k], cost: 0, reserved: 0 };
                store.settle_tagged(tag, Some(now), &[settle], hold).await.expect("released");
                continue;
            }
            let hold = rng.random_range(1..u64::MAX);
            let cost = u64::from(!rng.random_ratio(1, 10));
            let expected = algorithm::check(&l, model[k].as_ref(), now, cost);
            if expected.allowed {
                algorithm::apply_held(&l, &mut model[k], now, cost, hold);
                taken.push(hold);
            }
            let checks = [RuleCheck { hold, ..check(1, &l, &keys[k], cost, true) }];
            let got = store.check_tagged(tag, Some(now), &checks).await.expect("decided");
            assert_eq!(got.decisions[0], expected, "seed {seed} step {step} key {k} at {now}");
        }
    }
}

/// Reservations on Redis decide and settle exactly as the Rust algorithm does, step by step:
/// random estimates reserved under random hold ids, settles above and below the estimate
/// (repeated, late, and of holds never taken), reservations running out, for every algorithm
/// that reserves; every decision and every settle's outcome compared.
#[tokio::test]
async fn reservations_reserve_and_settle_like_rust() {
    let server = RedisServer::shared();
    let store = store(server).await;
    let tag = "reservation-equal";
    for (a, algorithm) in
        [Algorithm::TokenBucket, Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindowCounter]
            .into_iter()
            .enumerate()
    {
        let l = limit(algorithm, 1000, 2 * SEC, None, None).reserving(SEC).unwrap();
        for seed in 0..6u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let keys: Vec<Vec<u8>> = (0..2).map(|k| format!("a{a}-s{seed}-k{k}").into_bytes()).collect();
            let mut model: Vec<Option<State>> = vec![None, None];
            let mut now = T0 + seed * 100 * SEC;
            let mut taken: Vec<u64> = Vec::new();
            for step in 0..200 {
                now += rng.random_range(0..150 * MS);
                let k = rng.random_range(0..2);
                let cost = rng.random_range(0..700);
                if rng.random_ratio(2, 5) && !taken.is_empty() {
                    let hold = if rng.random_ratio(1, 6) {
                        rng.random_range(1..u64::MAX)
                    } else {
                        taken[rng.random_range(0..taken.len())]
                    };
                    let (found, _) = algorithm::settle(&l, &mut model[k], now, hold, cost);
                    let settle = Settle { rule: 2, limit: &l, key: &keys[k], cost, reserved: 1 };
                    let got = store.settle_tagged(tag, Some(now), &[settle], hold).await.expect("settled");
                    assert_eq!(got, u64::from(found), "{algorithm} seed {seed} step {step}: settle found");
                    continue;
                }
                let hold = if rng.random_ratio(1, 8) { 0 } else { rng.random_range(1..u64::MAX) };
                let expected = algorithm::check(&l, model[k].as_ref(), now, cost);
                if expected.allowed {
                    algorithm::apply_held(&l, &mut model[k], now, cost, hold);
                    if hold != 0 {
                        taken.push(hold);
                    }
                }
                let checks = [RuleCheck { hold, ..check(2, &l, &keys[k], cost, true) }];
                let got = store.check_tagged(tag, Some(now), &checks).await.expect("decided");
                assert_eq!(got.decisions[0], expected, "{algorithm} seed {seed} step {step} key {k} at {now}");
            }
        }
    }
}

/// The overspend bound under concurrency: three replicas on one Redis reserve estimates that
/// bound each request's cost (as `max_tokens` bounds an LLM's output) and settle to random
/// actual costs at most the estimate. However the reservations and settles interleave, what a
/// fixed window charges never exceeds the limit. Fails if a reservation stops counting before
/// its settle, or a settle charges more than once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reservations_never_overspend_when_the_estimate_bounds_the_cost() {
    let server = RedisServer::start();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Arc::new(store(&server).await));
    }
    let window = limit(Algorithm::FixedWindow, 10_000, 3600 * SEC, None, None).reserving(600 * SEC).unwrap();
    let charged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks: Vec<_> = (0..24u64)
        .map(|task| {
            let (store, window, charged) = (replicas[task as usize % 3].clone(), window.clone(), charged.clone());
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(task);
                for round in 0..40u64 {
                    let hold = (task << 32) | (round + 1);
                    let estimate = rng.random_range(100..1000);
                    let checks = [RuleCheck { hold, ..check(3, &window, b"tenant", estimate, true) }];
                    let verdict = store.check_tagged("llm", None, &checks).await.expect("decided");
                    if verdict.allowed {
                        let actual = rng.random_range(0..=estimate);
                        let settle =
                            Settle { rule: 3, limit: &window, key: b"tenant", cost: actual, reserved: estimate };
                        // Settled twice: the second charges nothing.
                        for _ in 0..2 {
                            store.settle_tagged("llm", None, &[settle], hold).await.expect("settled");
                        }
                        charged.fetch_add(actual, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let total = charged.load(std::sync::atomic::Ordering::SeqCst);
    let checks = [check(3, &window, b"tenant", 0, true)];
    let left = replicas[0].check_tagged("llm", None, &checks).await.unwrap().decisions[0].remaining;
    assert!(total <= 10_000, "charged {total} of a 10000 limit");
    assert_eq!(10_000 - left, total, "the window holds exactly the settled costs");
    assert!(total > 5_000, "the limit was reached: {total}");
}

/// Three replicas (three stores on one Redis) admitting and releasing concurrently: the
/// requests observed in progress never exceed the limit, and every slot comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_never_hold_more_than_the_limit_in_progress() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let server = RedisServer::start();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Arc::new(store(&server).await));
    }
    let in_progress = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let admitted = Arc::new(AtomicUsize::new(0));
    let limit_of = 4;
    let tasks: Vec<_> = (0..24u64)
        .map(|task| {
            let store = replicas[task as usize % 3].clone();
            let (in_progress, most, admitted) = (in_progress.clone(), most.clone(), admitted.clone());
            tokio::spawn(async move {
                let slots = limit(Algorithm::Concurrency, limit_of, 60 * SEC, None, None);
                for round in 0..20u64 {
                    let hold = (task << 32) | (round + 1);
                    let checks = [RuleCheck { hold, ..check(1, &slots, b"exports", 1, true) }];
                    let verdict = store.check_tagged("in-flight", None, &checks).await.expect("decided");
                    if verdict.allowed {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        let now = in_progress.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        // Counted out before the release: the store may admit the next one as
                        // soon as the slot is back.
                        in_progress.fetch_sub(1, Ordering::SeqCst);
                        let settle = Settle { rule: 1, limit: &slots, key: b"exports", cost: 0, reserved: 0 };
                        store.settle_tagged("in-flight", None, &[settle], hold).await.expect("released");
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= limit_of as usize, "{most} in progress with a limit of {limit_of}");
    assert!(admitted.load(Ordering::SeqCst) >= 20, "the slots kept coming back");
    let mut con = raw(&server).await;
    let left: i64 = redis::cmd("ZCARD").arg(state_key("in-flight", 1, b"exports")).query_async(&mut con).await.unwrap();
    assert_eq!(left, 0, "every slot was given back");
}

/// Giving back shaped slots (`cancel` in lua/check.lua, `give_back` in lua/gcra.lua) agrees with
/// the Rust algorithm (the memory store): random admissions with waits and random give-backs of
/// earlier ones, the last or not, due or not, on one key, answer and count the same.
#[tokio::test]
async fn lua_gives_back_slots_as_rust_does() {
    use rand::{Rng, SeedableRng};
    let server = RedisServer::shared();
    let store = store(server).await;
    for seed in 0..20u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let shaper = limit(Algorithm::LeakyBucket, 10, SEC, Some(40), Some(2 * SEC));
        let memory = sluice::store::memory::MemoryStore::new(1_000);
        let tag = format!("giveback-{seed}");
        let key = format!("k{seed}").into_bytes();
        let mut now = T0;
        let mut slots: Vec<Micros> = Vec::new();
        for step in 0..200 {
            now += rng.random_range(0..60 * MS);
            let context = format!("seed {seed} step {step} now {now}");
            if rng.random_bool(0.3) && !slots.is_empty() {
                // Sometimes the last slot, sometimes one behind it, sometimes one already due.
                let until =
                    if rng.random_bool(0.6) { *slots.last().unwrap() } else { slots[rng.random_range(0..slots.len())] };
                let cancel = [sluice::store::Cancel { rule: 7, limit: &shaper, key: &key, cost: 1, until }];
                let rust = memory.cancel_at(&tag, now, &cancel);
                let lua = store.cancel_tagged(&tag, Some(now), &cancel).await.unwrap();
                assert_eq!(lua, rust, "{context}: given back");
            } else {
                let checks = [check(7, &shaper, &key, 1, true)];
                let rust = memory.check_scoped_at(&tag, now, &checks);
                let lua = store.check_tagged(&tag, Some(now), &checks).await.unwrap();
                assert_eq!(lua, rust, "{context}: decided");
                if rust.allowed {
                    slots.push(now + rust.decisions[0].reset_after);
                }
            }
        }
    }
}

/// Two servers on one port would be one server shared by two tests, where the first test's end
/// resets the other's connections (a flake seen under load, when `free_port` gave one port
/// twice): the second start refuses instead of sharing.
#[test]
fn a_second_server_on_a_taken_port_refuses_to_start() {
    let first = RedisServer::start();
    let port = first.port();
    let second = std::panic::catch_unwind(|| RedisServer::start_with(port, &[]));
    let message = second.err().and_then(|panic| panic.downcast::<String>().ok()).expect("the second start panics");
    assert!(message.contains("served by another process"), "{message}");
    assert_eq!(first.cli(&["ping"]).trim(), "PONG");
}
