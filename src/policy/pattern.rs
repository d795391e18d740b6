//! A policy's regex, matched in bounded time.
//!
//! Rust's regex engines are linear in the input, but the constant is the compiled size: when
//! the lazy DFA gives up on a pattern whose states explode (`[ab]*a[ab]{2000}`), the fallback
//! simulates the whole NFA at every byte. Measured (`examples/regex_worst.rs`, release build):
//! that pattern (95 KiB compiled) took 151 ms on an 8 KiB header value, and the compiled-size
//! budget (1 MiB per policy) lets a tenant put ten of them in one policy — 1.5 s of the
//! endpoint's CPU per request, every other tenant's checks waiting behind it.
//!
//! So matching goes in two steps, and its time is bounded whatever the pattern and input:
//!
//! 1. the lazy DFA alone, with a cache of at most [`super::crd::MAX_REGEX_BYTES`] that may be
//!    cleared at most [`CACHE_CLEARS`] times and must search at least
//!    [`MIN_BYTES_PER_STATE`] bytes per state it builds, else it gives up. This answers every
//!    pattern whose DFA stays small, in time linear in the input with a small constant;
//! 2. when it gives up, the full engine, but only while the compiled size times the input's
//!    length stays within [`EXACT_WORK`]; beyond that the value **counts as a match** (the
//!    rule applies: the reading that limits, as for every ambiguity in [`super::path`]) and
//!    [`undecided`] counts it.
//!
//! Regexes only ever select rules (never exempt a request), so a match that was not computed
//! can make a rule apply to a request it would not have matched, never let a request past a
//! rule it matches.

use std::panic::{RefUnwindSafe, UnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::meta;
use regex_automata::util::pool::Pool;
use regex_automata::util::syntax;
use regex_automata::{Anchored, Input, MatchKind, nfa::thompson};

use super::crd::MAX_REGEX_BYTES;

/// Times the lazy DFA may clear its cache in one search before it may give up.
pub const CACHE_CLEARS: usize = 3;
/// Bytes searched per state built, below which (after [`CACHE_CLEARS`]) the lazy DFA gives up.
pub const MIN_BYTES_PER_STATE: usize = 10;
/// Compiled bytes × input bytes the full engine may be given after the lazy DFA gave up: at
/// most about 0.8 ms of one core at the worst measured 0.19 ns per unit
/// (`examples/regex_worst.rs`).
pub const EXACT_WORK: u64 = 1 << 22;

static UNDECIDED: AtomicU64 = AtomicU64::new(0);

/// Values counted as matching a regex without being matched (see the module's documentation),
/// since the process started.
pub fn undecided() -> u64 {
    UNDECIDED.load(Ordering::Relaxed)
}

type CacheMaker = Box<dyn Fn() -> Cache + Send + Sync + UnwindSafe + RefUnwindSafe>;

/// A compiled policy regex, anchored to the whole input. Boxed: the engines are large, and
/// rules hold it beside short strings.
pub struct PolicyRegex(Box<Engines>);

struct Engines {
    exact: meta::Regex,
    /// `None` for a pattern the lazy DFA cannot take (the full engine decides alone).
    lazy: Option<(DFA, Pool<Cache, CacheMaker>)>,
}

impl std::fmt::Debug for PolicyRegex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyRegex").field("exact", &self.0.exact).field("lazy", &self.0.lazy.is_some()).finish()
    }
}

impl PolicyRegex {
    /// Compiles `pattern` anchored to the whole input (`^(?:pattern)$`), its automata at most
    /// [`MAX_REGEX_BYTES`] each; the error says why it cannot be used.
    pub fn new(pattern: &str) -> Result<PolicyRegex, Box<meta::BuildError>> {
        let anchored = format!("^(?:{pattern})$");
        let syntax = syntax::Config::new().utf8(true);
        let config = meta::Config::new()
            .match_kind(MatchKind::LeftmostFirst)
            .utf8_empty(true)
            .nfa_size_limit(Some(MAX_REGEX_BYTES))
            .hybrid_cache_capacity(MAX_REGEX_BYTES);
        let exact = meta::Builder::new().configure(config).syntax(syntax).build(&anchored).map_err(Box::new)?;
        let lazy = DFA::builder()
            .syntax(syntax)
            .thompson(thompson::Config::new().nfa_size_limit(Some(MAX_REGEX_BYTES)))
            .configure(
                DFA::config()
                    .match_kind(MatchKind::LeftmostFirst)
                    .cache_capacity(MAX_REGEX_BYTES)
                    .skip_cache_capacity_check(true)
                    .minimum_cache_clear_count(Some(CACHE_CLEARS))
                    .minimum_bytes_per_state(Some(MIN_BYTES_PER_STATE))
                    .unicode_word_boundary(true),
            )
            .build(&anchored)
            .ok()
            .map(|dfa| {
                let maker = dfa.clone();
                let make: CacheMaker = Box::new(move || maker.create_cache());
                (dfa, Pool::new(make))
            });
        Ok(PolicyRegex(Box::new(Engines { exact, lazy })))
    }

    /// The compiled size, as the policy's regex budget counts it.
    pub fn memory_usage(&self) -> usize {
        self.0.exact.memory_usage()
    }

    /// Whether `text` matches, or counts as matching (see the module's documentation).
    pub fn is_match(&self, text: &str) -> bool {
        let Engines { exact, lazy } = &*self.0;
        if let Some((dfa, caches)) = lazy {
            let input = Input::new(text).anchored(Anchored::Yes).earliest(true);
            let mut cache = caches.get();
            if let Ok(found) = dfa.try_search_fwd(&mut cache, &input) {
                return found.is_some();
            }
        }
        let work = (exact.memory_usage() as u64).saturating_mul(text.len() as u64);
        if work <= EXACT_WORK {
            return exact.is_match(text);
        }
        UNDECIDED.fetch_add(1, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_like_the_full_engine_where_both_decide() {
        let cases = [
            ("/users/[0-9]+/orders", "/users/42/orders", true),
            ("/users/[0-9]+/orders", "/users/x/orders", false),
            ("/users/[0-9]+/orders", "/users/42/orders/1", false),
            ("(?:[a-z]+-)*[a-z]+", "abc-def", true),
            ("caf\u{e9}", "caf\u{e9}", true),
            ("\\bword\\b", "word", true),
            ("\\bword\\b", "wordy", false),
            ("\\w{4}", "\u{e9}t\u{e9}s", true),
            ("", "", true),
            ("a|", "", true),
        ];
        for (pattern, text, expected) in cases {
            let re = PolicyRegex::new(pattern).expect(pattern);
            assert_eq!(re.is_match(text), expected, "{pattern:?} on {text:?}");
            assert_eq!(re.0.exact.is_match(text), expected, "{pattern:?} on {text:?} (full engine)");
        }
    }

    /// The issue 23 pattern: its lazy DFA cannot run in the cache budget, and the full engine
    /// took 75-150 ms on 8 KiB values; such a value counts as a match instead (here one the
    /// full engine would not match: the 2001st byte from the end is a 'b').
    #[test]
    fn an_exploding_pattern_on_a_long_value_counts_as_a_match() {
        let re = PolicyRegex::new("[ab]*a[ab]{2000}").expect("within the size budget");
        let long = format!("{}{}", "a".repeat(6000), "b".repeat(2192));
        assert!(!re.0.exact.is_match(&long));
        let before = undecided();
        assert!(re.is_match(&long), "counted as a match, not computed");
        assert!(undecided() > before);
        // A short value is decided exactly.
        assert!(!re.is_match("ab"));
    }
}
