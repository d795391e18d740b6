//! What a store needs to know of a compiled rule, and nothing more: the neutral ground between
//! `policy` (which compiles rules) and `store` (which decides them), so neither depends on the
//! other: the checks a store is asked ([`RuleCheck`]) and the verdict it answers ([`Verdict`]).
//! What a rule does when its store fails is the engine's business, not the store's.

use crate::algorithm::{Decision, Limit};

/// The namespace of a policy or request that names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Stable identity of a rule (a hash of namespace, policy and rule name, never of its numbers),
/// so editing a limit keeps its counters.
pub type RuleId = u64;

/// Keys up to this many bytes are kept as they are; a longer one is replaced by
/// [`long_key_digest`] as soon as it is built, so a request's keys hold at most this many bytes
/// each however long the header values they came from (and a huge value makes no huge Redis key).
pub const MAX_INLINE_KEY: usize = 128;

/// The stand-in of a key longer than [`MAX_INLINE_KEY`]: its SHA-256 in lowercase hex.
pub fn long_key_digest(key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    Sha256::digest(key).iter().fold(String::with_capacity(64), |mut out, b| {
        let _ = write!(out, "{b:02x}");
        out
    })
}

/// A leased rule's terms (`consistency: leased`; [`crate::algorithm::lease`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leasing {
    /// The most units of a key out in slices at once: the most it can admit over its limit.
    pub max_overshoot: u64,
    /// The longest a slice is decided from without asking the store (µs).
    pub staleness: crate::algorithm::Micros,
}

/// One rule's part in a request.
#[derive(Clone, Copy, Debug)]
pub struct RuleCheck<'a> {
    pub rule: RuleId,
    pub limit: &'a Limit,
    /// The rule's key for this request (the joined key parts).
    pub key: &'a [u8],
    pub cost: u64,
    /// Shadow rules (`false`) are decided and counted but never deny the request.
    pub enforce: bool,
    /// The request's hold id, for the rules whose admission holds capacity until released
    /// (`Algorithm::holds`); 0 otherwise.
    pub hold: crate::algorithm::HoldId,
}

/// A hasher for keys that already are uniform hashes (rule ids, the memory store's slot keys):
/// their `u64` is the table hash, with no hashing work per lookup.
#[derive(Default)]
pub struct PrehashedHasher(u64);

impl std::hash::Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by the keys above; stay correct for anything else.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(word);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// The decision for a whole request.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Every enforcing rule admitted the request.
    pub allowed: bool,
    /// One decision per [`RuleCheck`], in order.
    pub decisions: Vec<Decision>,
    /// Set when a cached denial of this rule answered the request without asking the store
    /// ([`crate::store::denials`]): the other rules were not decided, and their decisions only say that they
    /// refused nothing.
    pub cached_denial: Option<usize>,
    /// The store's instant of the decision (µs since the epoch, the store's own clock), when
    /// it said: a shaped admission's slot ends at this plus its `reset_after`, which is what a
    /// caller gives back if it never departs ([`crate::algorithm::give_back`]).
    pub at: Option<crate::algorithm::Micros>,
}

impl Verdict {
    /// A request refused by its rule `by` alone, before the others were asked (a cached denial,
    /// a dry quota lease): `decision` is that rule's; the others, whose `limits` are given in
    /// order, refused nothing, and nothing is known of their state.
    pub fn refused_by<'a>(by: usize, decision: Decision, limits: impl IntoIterator<Item = &'a Limit>) -> Verdict {
        let decisions = limits
            .into_iter()
            .enumerate()
            .map(|(i, limit)| {
                if i == by {
                    decision
                } else {
                    Decision { allowed: true, remaining: limit.capacity(), ..Decision::default() }
                }
            })
            .collect();
        Verdict { allowed: false, decisions, cached_denial: Some(by), at: None }
    }

    /// Combines per-rule decisions the way every store must.
    pub fn from_decisions(checks: &[RuleCheck<'_>], decisions: Vec<Decision>) -> Verdict {
        let allowed = admits(checks, &decisions);
        Verdict { allowed, decisions, cached_denial: None, at: None }
    }
}

/// A request is admitted when every enforcing rule admits it; shadow rules never deny.
pub fn admits(checks: &[RuleCheck<'_>], decisions: &[Decision]) -> bool {
    checks.iter().zip(decisions).all(|(c, d)| d.allowed || !c.enforce)
}
