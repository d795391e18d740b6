//! Quota leases in the stores: Redis's Lua gives the pure Rust grants and decisions, and no mix of
//! holders, crashes and lease ends admits more than the declared bound allows.

mod support;

use std::time::Duration;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice::algorithm::lease::{LeaseAsk, LeaseGrant};
use sluice::algorithm::{Algorithm, Limit, Micros};
use sluice::rule::RuleCheck;
use sluice::store::memory::MemoryStore;
use sluice::store::redis::{RedisConfig, RedisStore};
use sluice::store::{LeaseOp, Store};
use support::redis_server::{RedisCluster, RedisServer};

const T0: Micros = 1_700_000_040_000_000; // a whole minute
const SEC: Micros = 1_000_000;
const MS: Micros = 1_000;
/// How far ahead of a lease's end a healthy holder settles it.
const MARGIN: Micros = 50 * MS;

fn leased(algorithm: Algorithm, requests: u64, per: Micros, burst: Option<u64>) -> Limit {
    Limit::new(algorithm, requests, per, burst, None).unwrap().leasing().unwrap()
}

fn pool() -> Vec<Limit> {
    use Algorithm::*;
    vec![
        leased(TokenBucket, 100, SEC, Some(50)),
        leased(Gcra, 100, SEC, None),
        leased(LeakyBucket, 30, SEC, Some(10)),
        leased(FixedWindow, 100, SEC, None),
        leased(FixedWindow, 20, 60 * SEC, None),
        leased(SlidingWindowCounter, 100, SEC, None),
        leased(SlidingWindowCounter, 7, 10 * SEC, None),
    ]
}

/// Every lease operation and every decision between them, on memory and on Redis at the same
/// instants: the same grants (amount, end, remaining) and the same decisions.
#[tokio::test]
async fn redis_grants_and_decides_as_the_rust_algorithms_do() {
    let server = RedisServer::shared();
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_secs(5);
    config.denial_cache = 0;
    let redis = RedisStore::connect(config).await.expect("redis store");
    let memory = MemoryStore::new(10_000);
    let limits = pool();
    let mut rng = StdRng::seed_from_u64(27);
    let run: u64 = rng.random();
    let mut now = T0;
    // Per limit, the leases given out and not yet settled: (hold, amount).
    let mut held: Vec<Vec<(u64, u64)>> = vec![Vec::new(); limits.len()];
    let mut compared = 0;
    for step in 0..3000 {
        now += rng.random_range(0..40 * MS);
        let i = rng.random_range(0..limits.len());
        let limit = &limits[i];
        let rule = 1000 + i as u64;
        let key = format!("lease-{run}-{i}");
        match rng.random_range(0..3) {
            0 => {
                let settle = (!held[i].is_empty() && rng.random_bool(0.6)).then(|| {
                    let pick = rng.random_range(0..held[i].len());
                    let (hold, amount) = held[i].swap_remove(pick);
                    (hold, rng.random_range(0..=amount + 1))
                });
                let ask = rng.random_bool(0.8).then(|| LeaseAsk {
                    hold: rng.random::<u64>() >> 12 | 1,
                    want: rng.random_range(1..40),
                    cap: rng.random_range(1..60),
                    ttl: rng.random_range(1..3000) * MS,
                });
                let ops = [LeaseOp { rule, limit, key: key.as_bytes(), settle, ask }];
                let from_memory = memory.lease_for("default", Some(now), &ops).await.unwrap();
                let from_redis = redis.lease_for("default", Some(now), &ops).await.unwrap();
                let visible = |g: &LeaseGrant| (g.amount, g.lasts, g.after.remaining, g.after.reset_after, g.holders);
                assert_eq!(
                    visible(&from_redis[0]),
                    visible(&from_memory[0]),
                    "step {step}: lease {:?} on {limit:?} at {now}",
                    ops[0]
                );
                if let (Some(ask), amount @ 1..) = (ask, from_memory[0].amount) {
                    held[i].push((ask.hold, amount));
                }
            }
            _ => {
                let cost = rng.random_range(0..4);
                let checks = [RuleCheck { rule, limit, key: key.as_bytes(), cost, enforce: true, hold: 0 }];
                let from_memory = memory.check_for("default", Some(now), &checks).await.unwrap();
                let from_redis = redis.check_for("default", Some(now), &checks).await.unwrap();
                assert_eq!(
                    from_redis.decisions, from_memory.decisions,
                    "step {step}: cost {cost} on {limit:?} at {now}"
                );
            }
        }
        compared += 1;
    }
    assert_eq!(compared, 3000);
}

/// On a Redis Cluster a namespace's slices live in its hash tag's slot, like its counters: a
/// grant, the decisions beside it and the settle agree with the memory store.
#[tokio::test]
async fn a_redis_cluster_grants_and_settles_in_the_namespace_slot() {
    let cluster = RedisCluster::shared();
    let mut config = RedisConfig::cluster(cluster.urls());
    config.timeout = Duration::from_secs(5);
    config.denial_cache = 0;
    let redis = RedisStore::connect(config).await.expect("cluster store");
    let limit = leased(Algorithm::FixedWindow, 100, 60 * SEC, None);
    let run: u64 = rand::random();
    for namespace in ["tenant-a", "tenant-b", "tenant-c"] {
        // Rule ids name their namespace in production; here one id serves three namespaces.
        let memory = MemoryStore::new(1000);
        let key = format!("cluster-{run}");
        let op = |settle, ask| LeaseOp { rule: 7, limit: &limit, key: key.as_bytes(), settle, ask };
        let ask = LeaseAsk { hold: 11, want: 30, cap: 40, ttl: SEC };
        let now = T0 + 5 * SEC;
        let visible = |g: &LeaseGrant| (g.amount, g.lasts, g.after.remaining, g.holders);
        let granted = redis.lease_for(namespace, Some(now), &[op(None, Some(ask))]).await.unwrap();
        assert_eq!(
            visible(&granted[0]),
            visible(&memory.lease_for(namespace, Some(now), &[op(None, Some(ask))]).await.unwrap()[0])
        );
        assert_eq!(visible(&granted[0]), (30, SEC, 70, 1), "{namespace}");
        let checks = [RuleCheck { rule: 7, limit: &limit, key: key.as_bytes(), cost: 1, enforce: true, hold: 0 }];
        let decided = redis.check_for(namespace, Some(now), &checks).await.unwrap();
        assert_eq!(decided.decisions[0].remaining, 69, "{namespace}: the slice counts");
        let settled = redis.lease_for(namespace, Some(now + 1), &[op(Some((11, 12)), None)]).await.unwrap();
        assert_eq!(settled[0].after.remaining, 100 - 1 - 12, "{namespace}: 12 spent, 18 back");
    }
}

/// The lease call refuses a rule that is not leased, and malformed arguments, writing nothing.
#[tokio::test]
async fn redis_refuses_a_lease_of_an_exact_rule() {
    let server = RedisServer::shared();
    let mut config = RedisConfig::single(server.url());
    config.timeout = Duration::from_secs(5);
    let redis = RedisStore::connect(config).await.expect("redis store");
    let exact = Limit::new(Algorithm::FixedWindow, 10, SEC, None, None).unwrap();
    let ask = LeaseAsk { hold: 7, want: 5, cap: 5, ttl: SEC };
    let ops = [LeaseOp { rule: 1, limit: &exact, key: b"exact", settle: None, ask: Some(ask) }];
    let error = redis.lease_for("default", None, &ops).await.unwrap_err();
    assert!(error.to_string().contains("bad lease arguments for key 1"), "{error}");
}

/// A holder in the model below: the lease it holds (hold id, units left, its end) and whether
/// it has crashed (it then spends what it holds and never settles).
#[derive(Clone, Debug)]
struct Holder {
    lease: Option<(u64, u64, u64, Micros)>, // hold, amount, spent, until
    crashed: bool,
}

#[derive(Clone, Debug)]
enum Event {
    /// Holder `h` has a request of cost 1: spent from its lease, else decided by the store.
    Request {
        holder: usize,
    },
    /// Holder `h` settles what it spent and asks for `want` more.
    Renew {
        holder: usize,
        want: u64,
    },
    /// Holder `h` crashes: what it spent and did not settle is lost to the store.
    Crash {
        holder: usize,
    },
    Advance {
        ms: u64,
    },
}

fn event(holders: usize) -> impl Strategy<Value = Event> {
    prop_oneof![
        6 => (0..holders).prop_map(|holder| Event::Request { holder }),
        2 => (0..holders, 1u64..30).prop_map(|(holder, want)| Event::Renew { holder, want }),
        1 => (0..holders).prop_map(|holder| Event::Crash { holder }),
        2 => (1u64..400).prop_map(|ms| Event::Advance { ms }),
    ]
}

/// Runs `events` on one key of `limit` with leases capped at `cap` and lasting `ttl`: holders
/// stop spending a lease at its end (the holder's clock may run early by `skew`, never late),
/// crashed ones spend without settling. Returns every admitted request's instant, and the units
/// spent from leases that were never settled.
fn play(limit: &Limit, cap: u64, ttl: Micros, skew: Micros, holders: usize, events: &[Event]) -> (Vec<Micros>, u64) {
    let store = MemoryStore::new(1000);
    let mut hs = vec![Holder { lease: None, crashed: false }; holders];
    let mut now = T0;
    let mut admitted = Vec::new();
    let mut next_hold = 1u64;
    let mut lost = 0;
    let key = b"hot".as_slice();
    let op = |settle, ask| LeaseOp { rule: 1, limit, key, settle, ask };
    for e in events {
        match *e {
            Event::Advance { ms } => {
                // A healthy holder settles a lease before it ends (the enforcers' keeper does,
                // a margin ahead); a crashed one never does.
                let next = now + ms * MS;
                for h in hs.iter_mut().filter(|h| !h.crashed) {
                    if let Some((hold, _, spent, until)) = h.lease
                        && until <= next + MARGIN
                    {
                        store.lease_at("default", now, &[op(Some((hold, spent)), None)]);
                        h.lease = None;
                    }
                }
                now = next;
            }
            Event::Crash { holder } => {
                if let Some((_, _, spent, _)) = hs[holder].lease.take() {
                    lost += spent;
                }
                hs[holder].crashed = true;
            }
            Event::Request { holder } => {
                let h = &mut hs[holder];
                // Spend only before the end as this holder's clock (early by up to `skew`) sees it.
                match &mut h.lease {
                    Some((_, amount, spent, until)) if *spent < *amount && now + skew + MARGIN < *until => {
                        *spent += 1;
                        admitted.push(now);
                    }
                    _ => {
                        let checks = [RuleCheck { rule: 1, limit, key, cost: 1, enforce: true, hold: 0 }];
                        if store.check_at(now, &checks).allowed {
                            admitted.push(now);
                        }
                    }
                }
            }
            Event::Renew { holder, want } => {
                if hs[holder].crashed {
                    continue;
                }
                let settle = hs[holder].lease.take().map(|(hold, _, spent, _)| (hold, spent));
                next_hold += 1;
                let ask = LeaseAsk { hold: next_hold, want, cap, ttl };
                let grant = store.lease_at("default", now, &[op(settle, Some(ask))])[0];
                if grant.amount > 0 {
                    hs[holder].lease = Some((next_hold, grant.amount, 0, now + grant.lasts));
                }
            }
        }
    }
    (admitted, lost)
}

/// The most admitted in any fixed window of `per`.
fn most_in_a_window(admitted: &[Micros], per: Micros) -> u64 {
    let mut counts = std::collections::BTreeMap::new();
    for &t in admitted {
        *counts.entry(t - t % per).or_insert(0u64) += 1;
    }
    counts.values().copied().max().unwrap_or(0)
}

/// The most admitted beyond the token bucket's envelope `burst + rate × (t2 − t1)` over any span
/// [t1, t2] of admissions.
fn most_over_the_envelope(admitted: &[Micros], limit: &Limit) -> i64 {
    let mut worst = i64::MIN;
    for i in 0..admitted.len() {
        for j in i..admitted.len() {
            let span = admitted[j] - admitted[i];
            let allowed = limit.burst() + span / limit.interval();
            worst = worst.max((j - i + 1) as i64 - allowed as i64);
        }
    }
    worst
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Fixed window: whatever the holders do (crash mid-lease included), no window admits more
    /// than the limit, since a lease ends with its window.
    #[test]
    fn a_fixed_window_never_admits_more_than_its_limit(
        events in proptest::collection::vec(event(8), 1..400),
        cap in 1u64..40,
        skew_ms in 0u64..50,
    ) {
        let limit = leased(Algorithm::FixedWindow, 40, SEC, None);
        let (admitted, _) = play(&limit, cap, 300 * MS, skew_ms * MS, 8, &events);
        prop_assert!(most_in_a_window(&admitted, SEC) <= 40);
    }

    /// Token bucket and GCRA: over any span, at most the bucket's envelope plus the units spent
    /// from leases that were never settled (crashed holders), and those never exceed the cap.
    #[test]
    fn a_bucket_admits_at_most_its_envelope_plus_what_crashed_holders_spent(
        events in proptest::collection::vec(event(6), 1..250),
        cap in 1u64..20,
        gcra in any::<bool>(),
    ) {
        let algorithm = if gcra { Algorithm::Gcra } else { Algorithm::TokenBucket };
        let limit = leased(algorithm, 20, SEC, Some(10));
        let (admitted, lost) = play(&limit, cap, 500 * MS, 0, 6, &events);
        let over = most_over_the_envelope(&admitted, &limit);
        prop_assert!(over <= lost as i64, "{over} over the envelope, {lost} lost to crashes");
        prop_assert!(lost <= cap * 6);
    }

    /// Without crashes, leased decisions are exact: a bucket never leaves its envelope and a
    /// sliding counter's windows never pass its limit.
    #[test]
    fn healthy_holders_admit_no_more_than_exact_decisions_would(
        events in proptest::collection::vec(event(5), 1..250),
        cap in 1u64..30,
    ) {
        let events: Vec<Event> = events.into_iter().filter(|e| !matches!(e, Event::Crash { .. })).collect();
        let bucket = leased(Algorithm::TokenBucket, 20, SEC, Some(10));
        let (admitted, lost) = play(&bucket, cap, 400 * MS, 0, 5, &events);
        prop_assert_eq!(lost, 0);
        prop_assert!(most_over_the_envelope(&admitted, &bucket) <= 0);
        let counter = leased(Algorithm::SlidingWindowCounter, 30, SEC, None);
        let (admitted, _) = play(&counter, cap, 400 * MS, 0, 5, &events);
        prop_assert!(most_in_a_window(&admitted, SEC) <= 30);
    }
}
