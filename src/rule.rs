//! What a store needs to know of a compiled rule, and nothing more: the neutral ground between
//! `policy` (which compiles rules) and `store` (which decides them), so neither depends on the
//! other. What a rule does when its store fails is the engine's business, not the store's.

use crate::algorithm::Limit;

/// The namespace of a policy or request that names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Stable identity of a rule (a hash of namespace, policy and rule name, never of its numbers),
/// so editing a limit keeps its counters.
pub type RuleId = u64;

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
}
