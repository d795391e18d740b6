//! Redis CPU per decision, measured by Redis itself: for each algorithm, with 1 and 3 rules per
//! decision, `RedisStore` decides N requests (random keys, limits high enough that every request
//! is admitted, so each one reads and writes its state), and Redis's own accounting is read
//! around the run: `used_cpu_user + used_cpu_sys` (INFO cpu) per decision, the decision call's
//! `usec_per_call` (INFO commandstats), and the commands the script runs per decision. The same
//! run measures a minimal script, `return redis.call('INCRBY', KEYS[1], 1)`, as the yardstick.
//!
//! `cargo run --release --example redis_cost -- redis://127.0.0.1:6379 [decisions] [concurrency]`
//! (scripts/bench/redis-cost.sh starts a private Redis for it). The Redis must be otherwise idle.
//! `BATCHES=N` sets the store's batched calls in flight (`--redis-batches`; 0: one call per
//! request); the default is the store's.

use std::collections::BTreeMap;
use std::sync::Arc;

use sluice::algorithm::{Algorithm, Limit};
use sluice::rule::RuleCheck;
use sluice::store::redis::{RedisConfig, RedisStore};

const ALGORITHMS: [Algorithm; 6] = [
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowLog,
    Algorithm::SlidingWindowCounter,
];
const KEYS: u64 = 10_000;

/// A limit that admits everything the run sends and keeps every key's state for the hour (a
/// limit whose state is pristine again within microseconds would let Redis expire the keys, and
/// measure key creation instead of the steady state).
fn limit(algorithm: Algorithm) -> Limit {
    const HOUR: u64 = 3_600_000_000;
    match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra | Algorithm::LeakyBucket => {
            Limit::new(algorithm, 100, HOUR, Some(100_000), None)
        }
        Algorithm::SlidingWindowLog => Limit::new(algorithm, 1000, HOUR, None, None),
        _ => Limit::new(algorithm, 1_000_000, HOUR, None, None),
    }
    .expect("valid limit")
}

struct Sample {
    cpu_us: f64,
    stats: BTreeMap<String, (u64, f64)>,
}

async fn info(conn: &mut redis::aio::MultiplexedConnection, section: &str) -> String {
    redis::cmd("INFO").arg(section).query_async(conn).await.expect("INFO")
}

async fn reset(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(conn).await.expect("CONFIG RESETSTAT");
    cpu(&info(conn, "cpu").await)
}

fn cpu(text: &str) -> f64 {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("used_cpu_user") + field("used_cpu_sys")) * 1e6
}

/// `cmdstat_NAME:calls=N,usec=U,usec_per_call=P,…` → NAME → (calls, usec_per_call).
fn commandstats(text: &str) -> BTreeMap<String, (u64, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let value = |key: &str| rest.split(',').find_map(|kv| kv.strip_prefix(&format!("{key}=")));
            Some((name.to_string(), (value("calls")?.parse().ok()?, value("usec_per_call")?.parse().ok()?)))
        })
        .collect()
}

async fn measure<F, Fut>(conn: &mut redis::aio::MultiplexedConnection, run: F) -> Sample
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let before = reset(conn).await;
    run().await;
    let after = cpu(&info(conn, "cpu").await);
    let stats = commandstats(&info(conn, "commandstats").await);
    Sample { cpu_us: after - before, stats }
}

/// Decision calls are the script entry points; everything else they run counts as inside.
const ENTRY_POINTS: [&str; 4] = ["evalsha", "eval", "fcall", "fcall_ro"];
const BOOKKEEPING: [&str; 5] = ["info", "config|resetstat", "config", "script|load", "function|load"];

fn row(name: &str, sample: &Sample, decisions: u64, yardstick: Option<f64>) -> String {
    let entry: Vec<&(u64, f64)> =
        ENTRY_POINTS.iter().filter_map(|e| sample.stats.get(*e)).filter(|(calls, _)| *calls > 0).collect();
    let calls: u64 = entry.iter().map(|(c, _)| c).sum();
    let usec = entry.iter().map(|(c, u)| *c as f64 * u).sum::<f64>() / calls.max(1) as f64;
    let inside: u64 = sample
        .stats
        .iter()
        .filter(|(n, _)| !ENTRY_POINTS.contains(&n.as_str()) && !BOOKKEEPING.contains(&n.as_str()))
        .map(|(_, (c, _))| c)
        .sum();
    let ratio = yardstick.map_or(String::new(), |y| format!("{:.1}×", usec / y));
    format!(
        "| {name} | {:.2} | {:.2} | {ratio} | {:.3} | {:.2} |",
        sample.cpu_us / decisions as f64,
        usec,
        calls as f64 / decisions as f64,
        inside as f64 / decisions as f64,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = args.get(1).cloned().unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let decisions: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let concurrency: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(32);
    let client = redis::Client::open(url.as_str()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect");
    let batches: usize =
        std::env::var("BATCHES").ok().and_then(|b| b.parse().ok()).unwrap_or(RedisConfig::DEFAULT_BATCHES);
    let config = |url: &str| {
        let mut config = RedisConfig::single(url);
        config.batches = batches;
        config
    };
    println!("batched calls in flight: {batches}");
    let store = Arc::new(RedisStore::connect(config(&url)).await.expect("store"));

    // The yardstick: one INCRBY in a script, on random keys, at the same concurrency.
    let incr = redis::Script::new("return redis.call('INCRBY', KEYS[1], 1)");
    let _: i64 = incr.key("warm").invoke_async(&mut conn.clone()).await.expect("INCRBY script");
    let load = conn.clone();
    let yardstick = measure(&mut conn, || async {
        let tasks: Vec<_> = (0..concurrency)
            .map(|t| {
                let mut conn = load.clone();
                let incr = incr.clone();
                tokio::spawn(async move {
                    for i in 0..decisions / concurrency {
                        let key = format!("incr:{}", (t * 7919 + i * 104_729) % KEYS);
                        let _: i64 = incr.key(key).invoke_async(&mut conn).await.expect("INCRBY script");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
    })
    .await;
    let per_call = yardstick.stats.get("evalsha").map_or(0.0, |(_, u)| *u);

    // A hot denied key: one rule, one key, exhausted at once; the same requests with and without
    // the denial cache, which answers the repeats without Redis.
    println!("| hot denied key | decisions/s (client) | Redis CPU µs/decision | calls/decision |");
    println!("|---|---:|---:|---:|");
    for cache in [0usize, RedisConfig::DEFAULT_DENIAL_CACHE] {
        let mut config = config(&url);
        config.denial_cache = cache;
        let store = Arc::new(RedisStore::connect(config).await.expect("store"));
        let hot = Arc::new(Limit::new(Algorithm::FixedWindow, 1, 3_600_000_000, None, None).expect("valid limit"));
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
        let started = std::time::Instant::now();
        let sample = measure(&mut conn, || async {
            let tasks: Vec<_> = (0..concurrency)
                .map(|_| {
                    let (store, hot) = (store.clone(), hot.clone());
                    tokio::spawn(async move {
                        for _ in 0..decisions / concurrency {
                            let checks =
                                [RuleCheck { rule: 77, limit: &hot, key: b"hot", cost: 1, enforce: true, hold: 0 }];
                            let _ = store.check_tagged("bench", None, &checks).await.expect("decided");
                        }
                    })
                })
                .collect();
            for task in tasks {
                task.await.expect("task");
            }
        })
        .await;
        let elapsed = started.elapsed().as_secs_f64();
        let n = decisions / concurrency * concurrency;
        let calls: u64 = ENTRY_POINTS.iter().filter_map(|e| sample.stats.get(*e)).map(|(c, _)| c).sum();
        println!(
            "| denial cache {} | {:.0} | {:.2} | {:.3} |",
            if cache == 0 { "off" } else { "on" },
            n as f64 / elapsed,
            sample.cpu_us / n as f64,
            calls as f64 / n as f64
        );
    }
    println!();

    println!(
        "| decision | Redis CPU µs/decision | µs per call (commandstats) | × INCRBY script | calls/decision | commands inside/decision |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    println!("{}", row("INCRBY script (yardstick)", &yardstick, decisions / concurrency * concurrency, None));
    for rules in [1usize, 3] {
        for algorithm in ALGORITHMS {
            let limit = Arc::new(limit(algorithm));
            let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.expect("FLUSHALL");
            // A first pass creates every key, so the measured pass sees the steady state: each
            // decision reads an existing state and writes it back.
            let pass = || async {
                let tasks: Vec<_> = (0..concurrency)
                    .map(|t| {
                        let store = store.clone();
                        let limit = limit.clone();
                        tokio::spawn(async move {
                            for i in 0..decisions / concurrency {
                                let key = format!("k{}", (t * 7919 + i * 104_729) % KEYS).into_bytes();
                                let checks: Vec<RuleCheck<'_>> = (0..rules as u64)
                                    .map(|rule| RuleCheck {
                                        rule,
                                        limit: &limit,
                                        key: &key,
                                        cost: 1,
                                        enforce: true,
                                        hold: 0,
                                    })
                                    .collect();
                                let verdict = store.check_tagged("bench", None, &checks).await.expect("decided");
                                assert!(verdict.allowed, "{algorithm:?} denied: the limit must admit the run");
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.expect("task");
                }
            };
            pass().await;
            let sample = measure(&mut conn, pass).await;
            let name = format!("{} × {rules}", algorithm.name());
            println!("{}", row(&name, &sample, decisions / concurrency * concurrency, Some(per_call)));
        }
    }
}
