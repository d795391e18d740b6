//! Shared by the `decisions` and `memory` benches: the key set and the limits, so both benches
//! (and every contender inside them) see exactly the same workload.
#![allow(dead_code)] // each bench uses a different subset

use sluice::algorithm::{Algorithm, Limit, Micros};

/// Number of distinct live keys in the "1M" workloads.
pub const LIVE_KEYS: usize = 1_000_000;

/// An arbitrary fixed instant (2023-11-14) so runs are repeatable.
pub const T0: Micros = 1_699_920_000_000_000;

pub const SECOND: Micros = 1_000_000;

/// splitmix64: a cheap bijection, so `key(i)` values are distinct and look random (keys that
/// share long prefixes or arrive in order would flatter some hash tables).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The i-th key: "k" + 16 hex digits (17 bytes), about the size of an API key id or an IPv6
/// prefix. Every contender is given these same `String`s.
pub fn key(i: u64) -> String {
    format!("k{:016x}", mix(i))
}

pub fn keys(n: usize) -> Vec<String> {
    (0..n as u64).map(key).collect()
}

/// xorshift64*: picks keys at random inside the timed loop for a nanosecond or two, identically
/// for every contender (same seed, same sequence).
pub struct Pick(u64);

impl Pick {
    pub fn new() -> Pick {
        Pick(0x2545_F491_4F6C_DD1D)
    }
    #[inline(always)]
    pub fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // Multiply-shift instead of `%`: unbiased enough and no division.
        ((r as u128 * n as u128) >> 64) as usize
    }
}

/// A benchmark variant: an algorithm plus the limit it runs with.
pub struct Variant {
    pub name: &'static str,
    pub limit: Limit,
}

/// The limits used everywhere. They are chosen so that, with the fake clock advancing 1 µs per
/// decision on the hot key, an admitting algorithm keeps admitting (1 per µs for the buckets,
/// 60 M per minute for the windows): the admitted path (check + consume) is the one measured.
/// The sliding-window log is the exception: its memory and time are O(requests) per key, so it
/// runs with a small `requests` like a real policy would, and the hot key is mostly *denied*
/// after its first 64 (a denial still scans the 64-entry log).
pub fn variants() -> Vec<Variant> {
    let v = |name, algorithm, requests, per, max_delay| Variant {
        name,
        limit: Limit::new(algorithm, requests, per, None, max_delay)
            .unwrap_or_else(|e| panic!("bench limit for {name} is invalid: {e}")),
    };
    vec![
        v("tokenBucket", Algorithm::TokenBucket, 1_000_000, SECOND, None),
        v("gcra", Algorithm::Gcra, 1_000_000, SECOND, None),
        v("leakyBucket", Algorithm::LeakyBucket, 1_000_000, SECOND, None),
        v("leakyBucket+maxDelay", Algorithm::LeakyBucket, 1_000_000, SECOND, Some(SECOND)),
        v("fixedWindow", Algorithm::FixedWindow, 60_000_000, 60 * SECOND, None),
        v("slidingWindowLog", Algorithm::SlidingWindowLog, 64, 60 * SECOND, None),
        v("slidingWindowCounter", Algorithm::SlidingWindowCounter, 60_000_000, 60 * SECOND, None),
    ]
}
