//! Rate-limit policies: the `RateLimitPolicy` custom resource ([`crd`]), its validation
//! ([`validate`]), loading from YAML files ([`load`]), compilation into an immutable
//! [`Snapshot`] ([`compile`] builds, [`snapshot`] holds) and request matching with key building
//! ([`matching`]).
//!
//! Pure: specs in, snapshot out. Nothing here talks HTTP or to the Kubernetes API.

pub mod compile;
pub mod consistency;
pub mod crd;
pub mod egress;
pub mod errors;
pub mod explain;
pub mod layering;
pub mod load;
pub mod matching;
pub mod path;
pub mod pattern;
pub mod response_cost;
pub mod snapshot;
pub mod validate;

pub use compile::validate;
pub use compile::{Compiled, Rejected, compile};
pub use crd::{
    FailureMode, HeaderMatch, KeyPart, LastAccepted, LayeringMode, LimitSpec, Match, Missing, Mode, OverloadSpec,
    PathMatch, PolicyRule, PriorityEntry, RateLimitPolicy, RateLimitPolicySpec, RateLimitPolicyStatus, RefusalSpec,
    ResponseCostMode, ResponseCostSpec, crd_yaml,
};
pub use errors::{FieldError, ValidationErrors};
pub use explain::{ExplainReport, Explanation};
pub use load::{
    LoadError, LoadErrors, LoadedPolicy, load_paths, load_snapshot, load_snapshot_with_warnings, load_str, parse_paths,
    policy_files, why_empty,
};
pub use matching::{Descriptor, Matched, RequestView, encode_key};
pub use snapshot::{
    CompiledPolicy, CompiledRule, DeclaredRefusal, Defer, Snapshot, SnapshotPart, WRITE_METHODS, rule_id,
};
pub use validate::warnings;

#[cfg(test)]
mod tests;

pub use crate::rule::DEFAULT_NAMESPACE;

/// A Kubernetes namespace name (an RFC 1123 label): lowercase letters, digits and '-', at most
/// 63 characters.
pub fn validate_dns_label(name: &str) -> Result<(), String> {
    validate::check_rule_name(name)
}
