//! Worst-case regex matching time within the policy budgets: patterns the webhook accepts,
//! matched against inputs of the longest length a request may carry (8 KiB header values and
//! paths), in this process on one thread. Prints µs per match, the compiled size, the matches
//! out of 20 and how many of those were counted as matches without being matched (the bound of
//! src/policy/pattern.rs).
//!
//!   cargo run --release --example regex_worst
use std::time::Instant;

use sluice::policy::pattern::undecided;
use sluice::policy::validate::compile_regex;

fn main() {
    let inputs: Vec<(&str, String)> = vec![
        ("8 KiB of 'a'", "a".repeat(8192)),
        ("8 KiB of 'ab'", "ab".repeat(4096)),
        ("8 KiB of 'b' then 'a'", format!("{}a", "b".repeat(8191))),
        ("60 bytes", "ab".repeat(30)),
    ];
    let mut patterns: Vec<String> =
        ["[ab]*a[ab]{2000}", "[ab]*a[ab]{200}", "(a|aa)*b", "/users/[0-9]+/orders", "(?:[a-z]+-)*[a-z]+", "\\w{4}"]
            .map(String::from)
            .to_vec();
    // The exploding family at every size, ASCII and Unicode: the worst case is wherever the lazy
    // DFA works longest before it gives up.
    for n in [10, 20, 50, 100, 300, 500, 1000] {
        patterns.push(format!("[ab]*a[ab]{{{n}}}"));
        patterns.push(format!("(?s:.)*a(?s:.){{{n}}}"));
    }
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let random_ab: String = (0..8192)
        .map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if rng & 1 == 0 { 'a' } else { 'b' }
        })
        .collect();
    let mut inputs = inputs;
    inputs.push(("8 KiB of random a/b", random_ab));
    for pattern in &patterns {
        let pattern = pattern.as_str();
        let Ok(re) = compile_regex(pattern, false) else {
            println!("{pattern:30} refused at admission");
            continue;
        };
        for (what, input) in &inputs {
            let rounds = 20;
            let started = Instant::now();
            let mut hits = 0;
            let undecided_before = undecided();
            for _ in 0..rounds {
                hits += usize::from(re.is_match(input.as_str()));
            }
            let per = started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds);
            let counted = undecided() - undecided_before;
            println!(
                "{pattern:30} {what:24} {per:>12.1} µs/match  {:>8} bytes compiled  {hits} matches, {counted} undecided",
                re.memory_usage()
            );
        }
    }
}
