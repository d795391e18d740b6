//! Decision latency of the memory store, side by side with governor and limitador.
//!
//! Groups (criterion ids are `group/variant`):
//! - `memory/<algorithm>/hot` and `memory/<algorithm>/1M`: `MemoryStore::check_into` with one
//!   rule, on one hot key, or on keys drawn at random from 1,000,000 pre-populated live keys.
//! - `memory/gcra/hot-scoped`: the hot key through `check_scoped_into` with the request's
//!   namespace interned first (one of 100 known namespaces), as the engine's `check_tagged` does.
//! - `memory/multi3/hot` and `memory/multi3/1M`: three rules in one call (per-IP tokenBucket,
//!   per-tenant slidingWindowCounter, per-route fixedWindow).
//! - `governor/gcra/{hot,1M}`: governor's keyed (DashMap) limiter, `check_key(&String)`.
//! - `limitador/fixedWindow/{hot,1M}` and `limitador/multi3/{hot,1M}`: limitador's in-memory
//!   `RateLimiter::check_rate_limited_and_update`.
//! - `baseline/keypick/1M`: just picking a random key and touching its bytes, the part of every
//!   `…/1M` figure that is the benchmark's own (two likely cache misses: the `Vec<String>` slot
//!   and the string's heap bytes).
//! - `clock/system_now`: what reading the real clock adds in production (the benches pass a fake
//!   `now`; see docs/benchmarks.md).
//!
//! Run: `cargo bench --bench decisions -- --warm-up-time 1 --measurement-time 3`

mod common;

use std::collections::HashMap;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::{LIVE_KEYS, Pick, SECOND, T0, keys, variants};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use sluice::algorithm::{Algorithm, Decision, Limit, Micros};
use sluice::clock::{Clock, SystemClock};
use sluice::rule::RuleCheck;
use sluice::store::memory::MemoryStore;

/// Room for every live key of the 1M workloads (plus the multi-rule tenants and routes), so
/// nothing is evicted while measuring.
const STORE_CAP: usize = 2 * LIVE_KEYS;

/// On the 1M workloads the fake clock advances 1 µs every 64 decisions: over a run of a few tens
/// of millions of decisions that is well under a second, so fixed windows of a minute do not
/// roll over and keys stay live, as the brief asks. The hot key advances 1 µs per decision
/// (see `common::variants` for why the limits then keep admitting).
const COLD_TICK_SHIFT: u32 = 6;

fn one<'a>(rule: u64, limit: &'a Limit, key: &'a [u8]) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key, cost: 1, enforce: true, hold: 0 }
}

/// Runs `n` decisions outside the timer and reports how many were admitted, so a table reader
/// knows which path (admit or deny) a figure measures. Printed, not asserted: the
/// slidingWindowLog hot key is expected to deny.
fn report_admitted(name: &str, n: u64, mut decide: impl FnMut(u64) -> bool) {
    let admitted = (0..n).filter(|&i| decide(i)).count();
    eprintln!("sanity {name}: {admitted}/{n} admitted");
}

fn sluice_single(c: &mut Criterion, all_keys: &[String]) {
    let variants = variants();
    // Every algorithm the product offers is covered.
    for algorithm in Algorithm::ALL {
        assert!(variants.iter().any(|v| v.limit.algorithm() == algorithm), "no bench for {algorithm}");
    }
    let mut group = c.benchmark_group("memory");
    for variant in &variants {
        let limit = &variant.limit;

        // (a) One hot key.
        {
            let store = MemoryStore::new(STORE_CAP);
            let key = all_keys[0].as_bytes();
            let mut decisions: Vec<Decision> = Vec::with_capacity(1);
            let mut now: Micros = T0;
            report_admitted(&format!("memory/{}/hot", variant.name), 100_000, |_| {
                now += 1;
                store.check_into(now, &[one(1, limit, key)], &mut decisions)
            });
            group.bench_function(format!("{}/hot", variant.name), |b| {
                b.iter(|| {
                    now += 1;
                    let checks = [one(1, limit, black_box(key))];
                    black_box(store.check_into(now, &checks, &mut decisions));
                    black_box(&decisions);
                })
            });
            // The engine's path: the request's namespace interned (one lookup) per request.
            if variant.name == "gcra" {
                let namespaces: Vec<String> = (0..100).map(|i| format!("tenant-{i:03}")).collect();
                let namespace = namespaces[42].as_str();
                for n in &namespaces {
                    store.scope(n);
                }
                group.bench_function(format!("{}/hot-scoped", variant.name), |b| {
                    b.iter(|| {
                        now += 1;
                        let checks = [one(1, limit, black_box(key))];
                        let scope = store.scope(black_box(namespace));
                        black_box(store.check_scoped_into(scope, now, &checks, &mut decisions));
                        black_box(&decisions);
                    })
                });
            }
        }

        // (b) 1M live keys, drawn at random.
        {
            let store = MemoryStore::new(STORE_CAP);
            for k in all_keys {
                store.check_into(T0, &[one(1, limit, k.as_bytes())], &mut Vec::new());
            }
            let live = store.stats().live_keys;
            assert_eq!(live, all_keys.len() as u64, "pre-population must not evict");
            let mut decisions: Vec<Decision> = Vec::with_capacity(1);
            let mut pick = Pick::new();
            let mut tick: u64 = 0;
            report_admitted(&format!("memory/{}/1M", variant.name), 100_000, |_| {
                tick += 1;
                let k = &all_keys[pick.next(all_keys.len())];
                store.check_into(T0 + (tick >> COLD_TICK_SHIFT), &[one(1, limit, k.as_bytes())], &mut decisions)
            });
            group.bench_function(format!("{}/1M", variant.name), |b| {
                b.iter(|| {
                    tick += 1;
                    let k = &all_keys[pick.next(all_keys.len())];
                    let checks = [one(1, limit, k.as_bytes())];
                    black_box(store.check_into(T0 + (tick >> COLD_TICK_SHIFT), &checks, &mut decisions));
                    black_box(&decisions);
                })
            });
            // The same 1M keys, but the request's key is already in cache, as in a server that
            // has just parsed it: the setup (untimed) copies a random key into a fresh String,
            // so only the store's own memory accesses are measured.
            group.bench_function(format!("{}/1M-cachedkey", variant.name), |b| {
                b.iter_batched_ref(
                    || {
                        tick += 1;
                        (all_keys[pick.next(all_keys.len())].clone(), T0 + (tick >> COLD_TICK_SHIFT))
                    },
                    |(k, now)| {
                        let checks = [one(1, limit, k.as_bytes())];
                        black_box(store.check_into(*now, &checks, &mut decisions));
                        black_box(&decisions);
                    },
                    BatchSize::SmallInput,
                )
            });
            let stats = store.stats();
            assert_eq!(stats.evicted, 0, "a 1M run must not evict: {stats:?}");
        }
    }
    group.finish();
}

/// The tiers of one request: 1M client IPs, 1,000 tenants, 100 routes.
struct Tiers {
    tenants: Vec<String>,
    routes: Vec<String>,
}

impl Tiers {
    fn new() -> Tiers {
        Tiers {
            tenants: (0..1_000).map(|i| format!("tenant-{i:04}")).collect(),
            routes: (0..100).map(|i| format!("/api/v1/route-{i:03}")).collect(),
        }
    }
    /// The tenant and route that client `i` talks to (fixed, so keys stay consistent).
    fn of(&self, i: usize) -> (&str, &str) {
        (&self.tenants[i % self.tenants.len()], &self.routes[i % self.routes.len()])
    }
}

struct MultiLimits {
    per_ip: Limit,
    per_tenant: Limit,
    per_route: Limit,
}

impl MultiLimits {
    fn new() -> MultiLimits {
        let l = |algorithm, requests, per| {
            Limit::new(algorithm, requests, per, None, None).unwrap_or_else(|e| panic!("multi limit: {e}"))
        };
        MultiLimits {
            per_ip: l(Algorithm::TokenBucket, 1_000_000, SECOND),
            per_tenant: l(Algorithm::SlidingWindowCounter, 60_000_000, 60 * SECOND),
            per_route: l(Algorithm::FixedWindow, 60_000_000, 60 * SECOND),
        }
    }
    fn checks<'a>(&'a self, ip: &'a str, tenant: &'a str, route: &'a str) -> [RuleCheck<'a>; 3] {
        [
            one(11, &self.per_ip, ip.as_bytes()),
            one(12, &self.per_tenant, tenant.as_bytes()),
            one(13, &self.per_route, route.as_bytes()),
        ]
    }
}

fn sluice_multi(c: &mut Criterion, all_keys: &[String]) {
    let tiers = Tiers::new();
    let limits = MultiLimits::new();
    let mut group = c.benchmark_group("memory");
    {
        let store = MemoryStore::new(STORE_CAP);
        let (tenant, route) = tiers.of(0);
        let ip = all_keys[0].as_str();
        let mut decisions: Vec<Decision> = Vec::with_capacity(3);
        let mut now = T0;
        report_admitted("memory/multi3/hot", 100_000, |_| {
            now += 1;
            store.check_into(now, &limits.checks(ip, tenant, route), &mut decisions)
        });
        group.bench_function("multi3/hot", |b| {
            b.iter(|| {
                now += 1;
                let checks = limits.checks(black_box(ip), tenant, route);
                black_box(store.check_into(now, &checks, &mut decisions));
                black_box(&decisions);
            })
        });
    }
    {
        let store = MemoryStore::new(STORE_CAP);
        let mut scratch = Vec::with_capacity(3);
        for (i, ip) in all_keys.iter().enumerate() {
            let (tenant, route) = tiers.of(i);
            store.check_into(T0, &limits.checks(ip, tenant, route), &mut scratch);
        }
        let mut decisions: Vec<Decision> = Vec::with_capacity(3);
        let mut pick = Pick::new();
        let mut tick: u64 = 0;
        let decide = |decisions: &mut Vec<Decision>, tick: &mut u64, pick: &mut Pick| {
            *tick += 1;
            let i = pick.next(all_keys.len());
            let (tenant, route) = tiers.of(i);
            let checks = limits.checks(&all_keys[i], tenant, route);
            store.check_into(T0 + (*tick >> COLD_TICK_SHIFT), &checks, decisions)
        };
        report_admitted("memory/multi3/1M", 100_000, |_| decide(&mut decisions, &mut tick, &mut pick));
        group.bench_function("multi3/1M", |b| {
            b.iter(|| {
                black_box(decide(&mut decisions, &mut tick, &mut pick));
                black_box(&decisions);
            })
        });
        // See `1M-cachedkey` above: the request's three keys are in cache.
        group.bench_function("multi3/1M-cachedkey", |b| {
            b.iter_batched_ref(
                || {
                    tick += 1;
                    let i = pick.next(all_keys.len());
                    let (tenant, route) = tiers.of(i);
                    (all_keys[i].clone(), tenant.to_string(), route.to_string(), T0 + (tick >> COLD_TICK_SHIFT))
                },
                |(ip, tenant, route, now)| {
                    let checks = limits.checks(ip, tenant, route);
                    black_box(store.check_into(*now, &checks, &mut decisions));
                    black_box(&decisions);
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// governor's clock trait lets the caller own time. This clock is set with a plain relaxed
/// store, the way our benches pass `now` as an argument, so neither side pays for reading (or
/// CAS-advancing) a clock inside the timed loop.
#[derive(Clone, Default)]
struct SetClock(Arc<AtomicU64>);

impl governor::clock::Clock for SetClock {
    type Instant = governor::nanos::Nanos;
    fn now(&self) -> Self::Instant {
        self.0.load(Ordering::Relaxed).into()
    }
}

fn governor_gcra(c: &mut Criterion, all_keys: &[String]) {
    use governor::{Quota, RateLimiter};
    // Same rate as our gcra variant: 1,000,000 per second, burst 1,000,000.
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).expect("non-zero"));
    let mut group = c.benchmark_group("governor");
    {
        let clock = SetClock::default();
        let limiter = RateLimiter::dashmap_with_clock(quota, clock.clone());
        let key = &all_keys[0];
        let mut ns: u64 = 0;
        report_admitted("governor/gcra/hot", 100_000, |_| {
            ns += 1_000;
            clock.0.store(ns, Ordering::Relaxed);
            limiter.check_key(key).is_ok()
        });
        group.bench_function("gcra/hot", |b| {
            b.iter(|| {
                ns += 1_000; // 1 µs per decision, like ours
                clock.0.store(ns, Ordering::Relaxed);
                black_box(limiter.check_key(black_box(key)).is_ok())
            })
        });
    }
    {
        let clock = SetClock::default();
        let limiter = RateLimiter::dashmap_with_clock(quota, clock.clone());
        for k in all_keys {
            let _ = black_box(limiter.check_key(k));
        }
        assert_eq!(limiter.len(), all_keys.len());
        let mut pick = Pick::new();
        let mut tick: u64 = 0;
        report_admitted("governor/gcra/1M", 100_000, |_| {
            tick += 1;
            clock.0.store((tick >> COLD_TICK_SHIFT) * 1_000, Ordering::Relaxed);
            limiter.check_key(&all_keys[pick.next(all_keys.len())]).is_ok()
        });
        group.bench_function("gcra/1M", |b| {
            b.iter(|| {
                tick += 1;
                clock.0.store((tick >> COLD_TICK_SHIFT) * 1_000, Ordering::Relaxed);
                let k = &all_keys[pick.next(all_keys.len())];
                black_box(limiter.check_key(k).is_ok())
            })
        });
        group.bench_function("gcra/1M-cachedkey", |b| {
            b.iter_batched_ref(
                || {
                    tick += 1;
                    (all_keys[pick.next(all_keys.len())].clone(), (tick >> COLD_TICK_SHIFT) * 1_000)
                },
                |(k, ns)| {
                    clock.0.store(*ns, Ordering::Relaxed);
                    black_box(limiter.check_key(k).is_ok())
                },
                BatchSize::SmallInput,
            )
        });
    }
    {
        // For reference: governor as most users run it, on its default (quanta/TSC) clock. The
        // quota is huge so the hot key keeps admitting at whatever real rate the loop reaches.
        let limiter = RateLimiter::dashmap(Quota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero")));
        let key = &all_keys[0];
        group.bench_function("gcra/hot-defaultclock", |b| {
            b.iter(|| black_box(limiter.check_key(black_box(key)).is_ok()))
        });
    }
    group.finish();
}

/// limitador: a Context must be built from the request's values on every call (its API takes a
/// `&Context`, a CEL context, not a key); that cost is part of deciding with limitador, as it is
/// in limitador-server, so it is inside the timed loop. `limitador/fixedWindow/hot-prebuilt-ctx`
/// shows the figure without it.
fn limitador_ctx(pairs: &[(&str, &str)]) -> limitador::limit::Context<'static> {
    let values: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    values.into()
}

fn limitador_fixed(c: &mut Criterion, all_keys: &[String]) {
    use limitador::RateLimiter;
    use limitador::limit::{Expression, Limit as LLimit};
    let var = |name: &str| Expression::parse(name).unwrap_or_else(|e| panic!("limitador variable {name}: {e:?}"));
    // Same limit as our fixedWindow variant: 60,000,000 per 60 s window, one counter per key.
    let make = |cache: u64| {
        let limiter = RateLimiter::new(cache);
        limiter.add_limit(LLimit::new("bench", 60_000_000, 60, [], [var("key")]));
        limiter
    };
    let ns: limitador::limit::Namespace = "bench".into();
    let mut group = c.benchmark_group("limitador");
    {
        let limiter = make(STORE_CAP as u64);
        let key = all_keys[0].as_str();
        report_admitted("limitador/fixedWindow/hot", 100_000, |_| {
            limiter.check_rate_limited_and_update(&ns, &limitador_ctx(&[("key", key)]), 1).is_ok_and(|r| !r.limited)
        });
        group.bench_function("fixedWindow/hot", |b| {
            b.iter(|| {
                let ctx = limitador_ctx(&[("key", black_box(key))]);
                black_box(limiter.check_rate_limited_and_update(&ns, &ctx, 1).is_ok_and(|r| !r.limited))
            })
        });
        let ctx = limitador_ctx(&[("key", key)]);
        group.bench_function("fixedWindow/hot-prebuilt-ctx", |b| {
            b.iter(|| {
                black_box(limiter.check_rate_limited_and_update(&ns, black_box(&ctx), 1).is_ok_and(|r| !r.limited))
            })
        });
    }
    {
        let limiter = make(STORE_CAP as u64);
        for k in all_keys {
            let _ = black_box(limiter.check_rate_limited_and_update(&ns, &limitador_ctx(&[("key", k)]), 1));
        }
        let mut pick = Pick::new();
        let mut decide = || {
            let k = &all_keys[pick.next(all_keys.len())];
            let ctx = limitador_ctx(&[("key", k)]);
            limiter.check_rate_limited_and_update(&ns, &ctx, 1).is_ok_and(|r| !r.limited)
        };
        report_admitted("limitador/fixedWindow/1M", 100_000, |_| decide());
        group.bench_function("fixedWindow/1M", |b| b.iter(|| black_box(decide())));
        let mut pick = Pick::new();
        group.bench_function("fixedWindow/1M-cachedkey", |b| {
            b.iter_batched_ref(
                || all_keys[pick.next(all_keys.len())].clone(),
                |k| {
                    let ctx = limitador_ctx(&[("key", k)]);
                    black_box(limiter.check_rate_limited_and_update(&ns, &ctx, 1).is_ok_and(|r| !r.limited))
                },
                BatchSize::SmallInput,
            )
        });
    }
    // Three limits in one call, like memory/multi3 (limitador has only fixed windows).
    let tiers = Tiers::new();
    let make3 = || {
        let limiter = RateLimiter::new(STORE_CAP as u64);
        limiter.add_limit(LLimit::new("multi", 1_000_000, 1, [], [var("ip")]));
        limiter.add_limit(LLimit::new("multi", 60_000_000, 60, [], [var("tenant")]));
        limiter.add_limit(LLimit::new("multi", 60_000_000, 60, [], [var("route")]));
        limiter
    };
    let ns3: limitador::limit::Namespace = "multi".into();
    {
        let limiter = make3();
        let (tenant, route) = tiers.of(0);
        let ip = all_keys[0].as_str();
        let decide = || {
            let ctx = limitador_ctx(&[("ip", black_box(ip)), ("tenant", tenant), ("route", route)]);
            limiter.check_rate_limited_and_update(&ns3, &ctx, 1).is_ok_and(|r| !r.limited)
        };
        report_admitted("limitador/multi3/hot", 100_000, |_| decide());
        group.bench_function("multi3/hot", |b| b.iter(|| black_box(decide())));
    }
    {
        let limiter = make3();
        for (i, ip) in all_keys.iter().enumerate() {
            let (tenant, route) = tiers.of(i);
            let ctx = limitador_ctx(&[("ip", ip), ("tenant", tenant), ("route", route)]);
            let _ = black_box(limiter.check_rate_limited_and_update(&ns3, &ctx, 1));
        }
        let mut pick = Pick::new();
        let mut decide = || {
            let i = pick.next(all_keys.len());
            let (tenant, route) = tiers.of(i);
            let ctx = limitador_ctx(&[("ip", &all_keys[i]), ("tenant", tenant), ("route", route)]);
            limiter.check_rate_limited_and_update(&ns3, &ctx, 1).is_ok_and(|r| !r.limited)
        };
        report_admitted("limitador/multi3/1M", 100_000, |_| decide());
        group.bench_function("multi3/1M", |b| b.iter(|| black_box(decide())));
    }
    group.finish();
}

fn baselines(c: &mut Criterion, all_keys: &[String]) {
    let mut group = c.benchmark_group("baseline");
    let mut pick = Pick::new();
    group.bench_function("keypick/1M", |b| {
        b.iter(|| {
            let k = &all_keys[pick.next(all_keys.len())];
            // Touch the bytes as a hash would, so the heap miss is paid as well.
            black_box(k.as_bytes().iter().fold(0u8, |a, &x| a ^ x))
        })
    });
    group.finish();
    let mut group = c.benchmark_group("clock");
    group.bench_function("system_now", |b| b.iter(|| black_box(SystemClock.now())));
    group.finish();
}

fn all(c: &mut Criterion) {
    let all_keys = keys(LIVE_KEYS);
    baselines(c, &all_keys);
    sluice_single(c, &all_keys);
    sluice_multi(c, &all_keys);
    governor_gcra(c, &all_keys);
    limitador_fixed(c, &all_keys);
}

criterion_group!(benches, all);
criterion_main!(benches);
