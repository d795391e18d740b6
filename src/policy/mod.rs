//! Rate-limit policies: the `RateLimitPolicy` custom resource ([`crd`]), its validation
//! ([`validate`]), loading from YAML files ([`load`]), compilation into an immutable
//! [`Snapshot`] ([`compile`]) and request matching with key building ([`matching`]).
//!
//! Pure: specs in, snapshot out. Nothing here talks HTTP or to the Kubernetes API.

pub mod compile;
pub mod crd;
pub mod load;
pub mod matching;
pub mod validate;

pub use compile::{compile, rule_id, CompiledPolicy, CompiledRule, Compiled, Rejected, RuleView, Snapshot, SnapshotView};
pub use crd::{
    crd_yaml, HeaderMatch, KeyPart, LimitSpec, Match, Missing, Mode, PathMatch, RateLimitPolicy, RateLimitPolicySpec,
    PolicyRule, RateLimitPolicyStatus,
};
pub use load::{policy_files, load_paths, load_str, LoadError, LoadErrors, LoadedPolicy};
pub use matching::{encode_key, Matched, NoEntries, Pairs, RequestView, StrMap};
pub use validate::{validate, warnings, FieldError, ValidationErrors};

#[cfg(test)]
mod tests;
