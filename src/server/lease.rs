//! What a request admitted under rules that hold capacity (concurrency slots, reservations of a
//! cost known after the response) holds, as the token its caller gives back to `POST /v1/settle`
//! (or `/v1/release`) when the request ends.
//!
//! The token is the lease itself, not a reference to state kept here: the namespace, the
//! request's hold id (64 random bits) and each held (rule, key), as base64url JSON. Any replica
//! can release it, and nothing is kept per request. Releasing needs the hold id, which only the
//! admitted caller was told: a forged token names a hold no request has and frees nothing. The
//! namespace is checked against the caller's like any request's, so a tenant can only ever
//! release in its own namespaces. A lease taken in this replica's memory (the store was down and
//! the rule's `onStoreFailure` is `localFallback`) says so: only this replica can release it,
//! and elsewhere it runs out by itself.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use crate::algorithm::HoldId;
use crate::store::RuleId;

/// The longest token accepted (a request matches at most a few dozen rules, each key at most
/// 128 bytes).
pub const MAX_TOKEN_LEN: usize = 32 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    #[serde(rename = "n")]
    pub namespace: String,
    #[serde(rename = "h", with = "decimal")]
    pub hold: HoldId,
    /// (rule id, key) of each slot held.
    #[serde(rename = "r", with = "held")]
    pub held: Vec<(RuleId, String)>,
    /// The estimate reserved under each of `held` (0 for a concurrency slot): what a settle whose
    /// cost is unknown charges.
    #[serde(rename = "e", default, skip_serializing_if = "Vec::is_empty")]
    pub reserved: Vec<u64>,
    /// Held in the memory of the replica that admitted it (the shared store had failed).
    #[serde(rename = "l", default, skip_serializing_if = "std::ops::Not::not")]
    pub local: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("lease: longer than {MAX_TOKEN_LEN} characters")]
    TooLong,
    #[error("lease: not base64url")]
    NotBase64,
    #[error("lease: not a lease this endpoint issued ({0})")]
    Malformed(String),
}

impl Lease {
    pub fn token(&self) -> String {
        // Serializing plain strings and integers cannot fail.
        URL_SAFE_NO_PAD.encode(serde_json::to_vec(self).unwrap_or_default())
    }

    pub fn from_token(token: &str) -> Result<Lease, LeaseError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(LeaseError::TooLong);
        }
        let json = URL_SAFE_NO_PAD.decode(token.trim()).map_err(|_| LeaseError::NotBase64)?;
        let lease: Lease = serde_json::from_slice(&json).map_err(|e| LeaseError::Malformed(e.to_string()))?;
        if lease.hold == 0 || lease.held.is_empty() {
            return Err(LeaseError::Malformed("it holds nothing".into()));
        }
        Ok(lease)
    }
}

/// Hold ids as decimal text: JSON numbers above 2^53 lose digits in many clients.
mod decimal {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Rule ids as 16 hex digits, like everywhere else they are shown.
mod held {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::store::RuleId;

    pub fn serialize<S: Serializer>(value: &[(RuleId, String)], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(value.iter().map(|(rule, key)| (format!("{rule:016x}"), key)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<(RuleId, String)>, D::Error> {
        let pairs = Vec::<(String, String)>::deserialize(deserializer)?;
        pairs
            .into_iter()
            .map(|(rule, key)| {
                let id = u64::from_str_radix(&rule, 16).map_err(serde::de::Error::custom)?;
                Ok((id, key))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_carries_the_lease_and_nothing_else_decodes() {
        let lease = Lease {
            namespace: "tenant-a".into(),
            hold: u64::MAX - 1,
            held: vec![(0x0123_4567_89ab_cdef, "5:alice".into())],
            reserved: vec![300],
            local: false,
        };
        let token = lease.token();
        assert!(!token.contains(['+', '/', '=']), "{token}");
        assert_eq!(Lease::from_token(&token), Ok(lease));
        assert_eq!(Lease::from_token("not base64!"), Err(LeaseError::NotBase64));
        assert!(matches!(Lease::from_token(&URL_SAFE_NO_PAD.encode(b"{}")), Err(LeaseError::Malformed(_))));
        let empty = URL_SAFE_NO_PAD.encode(br#"{"n":"a","h":"5","r":[]}"#);
        assert!(matches!(Lease::from_token(&empty), Err(LeaseError::Malformed(m)) if m.contains("holds nothing")));
        assert_eq!(Lease::from_token(&"a".repeat(MAX_TOKEN_LEN + 1)), Err(LeaseError::TooLong));
    }
}
