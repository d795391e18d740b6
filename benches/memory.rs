//! Bytes per live key, and memory under a flood of distinct keys.
//!
//! Not a criterion bench: a counting global allocator (wrapping `System`) tracks the bytes
//! currently allocated (requested sizes; allocator headers and size-class rounding are not
//! counted, so the RSS delta is printed next to it as a cross-check).
//!
//! 1. Per algorithm: 1,000,000 distinct keys, one decision each, into `MemoryStore::new(2M)`
//!    (the same store the `decisions` bench uses); bytes/key = (allocated after − before) / 1M.
//!    The slidingWindowLog is also shown with a full log (10 admitted requests per key), since
//!    its memory is O(requests) per key. governor's keyed limiter and limitador's in-memory
//!    limiter get the same 1M keys for comparison.
//! 2. Flood: `MemoryStore::new(DEFAULT_MAX_KEYS)`, 10,000,000 distinct keys, printing live keys
//!    and allocated bytes after every 1M. Memory must stay flat once the cap is reached.
//!
//! Run: `cargo bench --bench memory` (about a minute).

// A global allocator is an unsafe trait: counting bytes needs it, and nothing else here does.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use common::{LIVE_KEYS, SECOND, T0, keys, mix, variants};
use sluice::algorithm::{Algorithm, Decision, Limit};
use sluice::rule::RuleCheck;
use sluice::store::memory::{DEFAULT_MAX_KEYS, MemoryStore};

/// Bytes currently allocated through the global allocator.
static ALLOCATED: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            ALLOCATED.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            ALLOCATED.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        ALLOCATED.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            ALLOCATED.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocated() -> isize {
    ALLOCATED.load(Ordering::Relaxed)
}

/// Resident set size in bytes, from /proc/self/statm (0 where unavailable).
fn rss() -> isize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<isize>().ok()))
        .map_or(0, |pages| pages * 4096)
}

fn one<'a>(rule: u64, limit: &'a Limit, key: &'a [u8]) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key, cost: 1, enforce: true, hold: 0 }
}

/// Builds a structure with `fill`, returns it with (allocated bytes, RSS bytes) it added.
fn measured<T>(fill: impl FnOnce() -> T) -> (T, isize, isize) {
    let (a0, r0) = (allocated(), rss());
    let value = fill();
    (value, allocated() - a0, rss() - r0)
}

fn row(name: &str, live: u64, bytes: isize, rss_bytes: isize) {
    println!(
        "| {name} | {live} | {:.1} | {:.1} | {:.1} |",
        bytes as f64 / live as f64,
        rss_bytes as f64 / live as f64,
        bytes as f64 / 1e6,
    );
}

/// governor's clock trait, driven by hand (time never matters for this measurement).
#[derive(Clone, Default)]
struct FixedClock;

impl governor::clock::Clock for FixedClock {
    type Instant = governor::nanos::Nanos;
    fn now(&self) -> Self::Instant {
        0u64.into()
    }
}

fn per_key(all_keys: &[String]) {
    println!("## Bytes per live key ({} keys, store cap {})\n", all_keys.len(), 2 * LIVE_KEYS);
    println!("| structure | live keys | allocated bytes/key | RSS bytes/key | allocated MB |");
    println!("|---|---|---|---|---|");
    let mut decisions: Vec<Decision> = Vec::with_capacity(1);
    for variant in variants() {
        let (store, bytes, rss_bytes) = measured(|| {
            let store = MemoryStore::new(2 * LIVE_KEYS);
            for k in all_keys {
                store.check_into(T0, &[one(1, &variant.limit, k.as_bytes())], &mut decisions);
            }
            store
        });
        let stats = store.stats();
        assert_eq!(stats.evicted, 0, "{stats:?}");
        row(&format!("sluice {} (1 request/key)", variant.name), stats.live_keys, bytes, rss_bytes);
        drop(store);
    }
    // The log's memory grows with what it holds: 10 admitted requests per key at distinct times.
    let log10 = Limit::new(Algorithm::SlidingWindowLog, 10, 60 * SECOND, None, None).expect("valid limit");
    let (store, bytes, rss_bytes) = measured(|| {
        let store = MemoryStore::new(2 * LIVE_KEYS);
        for t in 0..10 {
            for k in all_keys {
                store.check_into(T0 + t, &[one(1, &log10, k.as_bytes())], &mut decisions);
            }
        }
        store
    });
    row("sluice slidingWindowLog (10 requests/key, full log)", store.stats().live_keys, bytes, rss_bytes);
    drop(store);

    // governor: keyed by the same Strings (the map must own a copy of each key).
    let quota = governor::Quota::per_second(NonZeroU32::new(1_000_000).expect("non-zero"));
    let (limiter, bytes, rss_bytes) = measured(|| {
        let limiter = governor::RateLimiter::dashmap_with_clock(quota, FixedClock);
        for k in all_keys {
            let _ = black_box(limiter.check_key(k));
        }
        limiter
    });
    row("governor gcra (dashmap)", limiter.len() as u64, bytes, rss_bytes);
    drop(limiter);

    // limitador: one qualified counter per key in its moka cache.
    let (limiter, bytes, rss_bytes) = measured(|| {
        let limiter = limitador::RateLimiter::new(2 * LIVE_KEYS as u64);
        let var = limitador::limit::Expression::parse("key").expect("valid variable");
        limiter.add_limit(limitador::limit::Limit::new("bench", 60_000_000, 60, [], [var]));
        let ns: limitador::limit::Namespace = "bench".into();
        for k in all_keys {
            let values: HashMap<String, String> = HashMap::from([("key".to_string(), k.clone())]);
            let _ = black_box(limiter.check_rate_limited_and_update(&ns, &values.into(), 1));
        }
        limiter
    });
    // limitador does not expose a count of its qualified counters; each key was admitted once.
    row("limitador fixedWindow (in-memory)", all_keys.len() as u64, bytes, rss_bytes);
    drop(limiter);
    println!();
}

fn flood() {
    // An hour-long bucket: every key stays live (far from pristine) for the whole flood, so the
    // cap has to evict live keys, the worst case.
    let limit = Limit::new(Algorithm::TokenBucket, 100, 3600 * SECOND, None, None).expect("valid limit");
    let (a0, r0) = (allocated(), rss());
    let store = MemoryStore::new(DEFAULT_MAX_KEYS);
    println!(
        "## Flood: 10,000,000 distinct keys, tokenBucket 100/h, cap DEFAULT_MAX_KEYS = {} (max_keys() = {})\n",
        DEFAULT_MAX_KEYS,
        store.max_keys()
    );
    println!("| keys fed | live keys | evicted | expired | allocated MB | RSS delta MB | seconds |");
    println!("|---|---|---|---|---|---|---|");
    let mut decisions: Vec<Decision> = Vec::with_capacity(1);
    let mut key = String::with_capacity(32); // reused: the flood's keys are not counted
    let start = Instant::now();
    for i in 0..10_000_000u64 {
        key.clear();
        // Offset past the per-key bench's keys; still distinct (mix is a bijection).
        let _ = write!(key, "k{:016x}", mix(i + (1 << 40)));
        // 1 µs apart, as distinct clients arriving over ten seconds.
        store.check_into(T0 + i, &[one(1, &limit, key.as_bytes())], &mut decisions);
        if (i + 1) % 1_000_000 == 0 {
            let stats = store.stats();
            println!(
                "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} |",
                i + 1,
                stats.live_keys,
                stats.evicted,
                stats.expired,
                (allocated() - a0) as f64 / 1e6,
                (rss() - r0) as f64 / 1e6,
                start.elapsed().as_secs_f64()
            );
        }
    }
    println!();
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let all_keys = keys(LIVE_KEYS);
    per_key(&all_keys);
    drop(all_keys);
    flood();
}
