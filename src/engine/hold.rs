//! What a request admitted under rules that hold capacity (concurrency slots, reservations of a
//! cost known after the response) holds, as the token its caller gives back to `POST /v1/settle`
//! (or `/v1/release`) when the request ends.
//!
//! The token is the hold itself, not a reference to state kept here: the namespace, the
//! request's hold id (64 random bits), each held (rule, key) and the estimate reserved under it,
//! as base64url JSON, followed by `.` and an HMAC-SHA256 of that text under a key the replicas
//! share ([`TokenKeys`]). Any replica holding the key can settle it, and nothing is kept per
//! request. Everything a settle acts on comes from the signed text, so a caller can neither
//! forge a token (naming keys it never held, to make the store work for it) nor edit one (a
//! namespace, an estimate, a key): such a token is refused with 400 before the store is asked.
//! The namespace is then checked against the caller's like any request's. A hold taken in this
//! replica's memory (the store was down and the rule's `onStoreFailure` is `localFallback`) says
//! so: only this replica can release it, and elsewhere it runs out by itself.
//!
//! Keys rotate without breaking tokens in flight: the first key signs, every key verifies, so a
//! new key is added second everywhere, then moved first, and the old one removed once the
//! longest hold (`reservationTtl`) has passed.
//!
//! On the wire the token keeps the name it has always had: the `lease` field of a check answer
//! and of a settle, and the `--lease-keys-file` its keys come from. In the code "lease" means a
//! quota slice only ([`super::leases`]); this is a hold.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::algorithm::HoldId;
use crate::rule::RuleId;

/// The longest token accepted (a request matches at most a few dozen rules, each key at most
/// 128 bytes).
pub const MAX_TOKEN_LEN: usize = 32 * 1024;
/// The most holds one token carries (a request holds one per holding rule it matches; the token's
/// length bounds them further). A settle's store work is charged to the namespace's lane by this
/// count, like a check's.
pub const MAX_HELD: usize = 1024;
/// The shortest key accepted: 128 bits of secret.
pub const MIN_KEY_BYTES: usize = 16;
/// The most keys verified at once (a rotation needs two).
pub const MAX_KEYS: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
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
pub enum HoldError {
    #[error("lease: longer than {MAX_TOKEN_LEN} characters")]
    TooLong,
    #[error("lease: not base64url")]
    NotBase64,
    #[error("lease: not a lease this endpoint issued ({0})")]
    Malformed(String),
    #[error(
        "lease: its signature does not verify (edited, forged, or signed with a key this endpoint does not hold: give every replica the same lease keys)"
    )]
    Signature,
}

/// The keys hold tokens are signed and verified with: the first signs, each verifies.
pub struct TokenKeys {
    keys: Vec<hmac::Key>,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenKeys({} keys)", self.keys.len())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenKeysError {
    #[error("no lease key: give at least one, one per line")]
    Empty,
    #[error("lease key {0}: shorter than {MIN_KEY_BYTES} bytes (use e.g. `openssl rand -base64 32`)")]
    TooShort(usize),
    #[error("{0} lease keys: at most {MAX_KEYS} (the first signs, the others only verify)")]
    TooMany(usize),
}

impl TokenKeys {
    /// A key of 256 random bits, for a process whose tokens only it settles (the sidecar's own
    /// fallback engine, a single `sluice serve`).
    pub fn random() -> TokenKeys {
        let secret: [u8; 32] = rand::random();
        TokenKeys { keys: vec![hmac::Key::new(hmac::HMAC_SHA256, &secret)] }
    }

    /// Keys from text, one per line (blank lines and `#` comments skipped): the first signs.
    pub fn parse(text: &str) -> Result<TokenKeys, TokenKeysError> {
        let lines: Vec<&str> =
            text.lines().map(str::trim).filter(|line| !line.is_empty() && !line.starts_with('#')).collect();
        if lines.is_empty() {
            return Err(TokenKeysError::Empty);
        }
        if lines.len() > MAX_KEYS {
            return Err(TokenKeysError::TooMany(lines.len()));
        }
        if let Some(short) = lines.iter().position(|line| line.len() < MIN_KEY_BYTES) {
            return Err(TokenKeysError::TooShort(short + 1));
        }
        Ok(TokenKeys { keys: lines.iter().map(|line| hmac::Key::new(hmac::HMAC_SHA256, line.as_bytes())).collect() })
    }

    fn sign(&self, text: &[u8]) -> hmac::Tag {
        // `parse` and `random` never make an empty set.
        hmac::sign(&self.keys[0], text)
    }

    fn verifies(&self, text: &[u8], tag: &[u8]) -> bool {
        self.keys.iter().any(|key| hmac::verify(key, text, tag).is_ok())
    }
}

impl Hold {
    /// The signed token: the lease's base64url JSON, `.`, its base64url HMAC.
    pub fn token(&self, keys: &TokenKeys) -> String {
        // Serializing plain strings and integers cannot fail.
        let text = URL_SAFE_NO_PAD.encode(serde_json::to_vec(self).unwrap_or_default());
        let tag = URL_SAFE_NO_PAD.encode(keys.sign(text.as_bytes()).as_ref());
        format!("{text}.{tag}")
    }

    /// The lease a token carries once its signature verifies under one of `keys`, and every
    /// field is within bounds.
    pub fn verify(token: &str, keys: &TokenKeys) -> Result<Hold, HoldError> {
        let token = token.trim();
        if token.len() > MAX_TOKEN_LEN {
            return Err(HoldError::TooLong);
        }
        let Some((text, tag)) = token.split_once('.') else {
            return Err(HoldError::Signature);
        };
        let tag = URL_SAFE_NO_PAD.decode(tag).map_err(|_| HoldError::NotBase64)?;
        if !keys.verifies(text.as_bytes(), &tag) {
            return Err(HoldError::Signature);
        }
        Self::decode(text)
    }

    /// What a token says, without checking who signed it: for the holder that was given it
    /// (a sidecar reading which rules its request holds), never for acting on it.
    pub fn read_unverified(token: &str) -> Result<Hold, HoldError> {
        let token = token.trim();
        if token.len() > MAX_TOKEN_LEN {
            return Err(HoldError::TooLong);
        }
        Self::decode(token.split_once('.').map_or(token, |(text, _)| text))
    }

    fn decode(text: &str) -> Result<Hold, HoldError> {
        let json = URL_SAFE_NO_PAD.decode(text).map_err(|_| HoldError::NotBase64)?;
        let lease: Hold = serde_json::from_slice(&json).map_err(|e| HoldError::Malformed(e.to_string()))?;
        if lease.hold == 0 || lease.held.is_empty() {
            return Err(HoldError::Malformed("it holds nothing".into()));
        }
        if lease.held.len() > MAX_HELD {
            return Err(HoldError::Malformed(format!("it holds {} keys, at most {MAX_HELD}", lease.held.len())));
        }
        if !lease.reserved.is_empty() && lease.reserved.len() != lease.held.len() {
            return Err(HoldError::Malformed("one estimate per hold".into()));
        }
        if lease.reserved.iter().any(|&e| e > super::MAX_COST) {
            return Err(HoldError::Malformed(format!("an estimate above {}", super::MAX_COST)));
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

    use crate::rule::RuleId;

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

    fn lease() -> Hold {
        Hold {
            namespace: "tenant-a".into(),
            hold: u64::MAX - 1,
            held: vec![(0x0123_4567_89ab_cdef, "5:alice".into())],
            reserved: vec![300],
            local: false,
        }
    }

    #[test]
    fn a_token_carries_the_lease_and_nothing_else_decodes() {
        let keys = TokenKeys::random();
        let token = lease().token(&keys);
        assert!(!token.contains(['+', '/', '=']), "{token}");
        assert_eq!(Hold::verify(&token, &keys), Ok(lease()));
        assert_eq!(Hold::read_unverified(&token), Ok(lease()));
        assert_eq!(Hold::verify("not base64!", &keys), Err(HoldError::Signature));
        assert_eq!(Hold::verify(&"a".repeat(MAX_TOKEN_LEN + 1), &keys), Err(HoldError::TooLong));
        let signed = |json: &[u8]| {
            let text = URL_SAFE_NO_PAD.encode(json);
            let tag = URL_SAFE_NO_PAD.encode(keys.sign(text.as_bytes()).as_ref());
            format!("{text}.{tag}")
        };
        assert!(matches!(Hold::verify(&signed(b"{}"), &keys), Err(HoldError::Malformed(_))));
        let empty = signed(br#"{"n":"a","h":"5","r":[]}"#);
        assert!(matches!(Hold::verify(&empty, &keys), Err(HoldError::Malformed(m)) if m.contains("holds nothing")));
        let huge = signed(br#"{"n":"a","h":"5","r":[["0000000000000001","k"]],"e":[18446744073709551515]}"#);
        assert!(matches!(Hold::verify(&huge, &keys), Err(HoldError::Malformed(m)) if m.contains("estimate")));
    }

    #[test]
    fn an_edited_or_forged_token_is_refused() {
        let keys = TokenKeys::random();
        let token = lease().token(&keys);
        // The namespace rewritten, the estimate raised: re-encoded, the old signature kept.
        for edit in [
            Hold { namespace: "tenant-b".into(), ..lease() },
            Hold { reserved: vec![u64::MAX - 100], ..lease() },
            Hold { held: vec![(1, "x".into()); 3], reserved: vec![], ..lease() },
        ] {
            let (_, tag) = token.split_once('.').unwrap();
            let text = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&edit).unwrap());
            assert_eq!(Hold::verify(&format!("{text}.{tag}"), &keys), Err(HoldError::Signature));
        }
        // Unsigned, as tokens were before signing, and signed by another endpoint's key.
        let (text, _) = token.split_once('.').unwrap();
        assert_eq!(Hold::verify(text, &keys), Err(HoldError::Signature));
        assert_eq!(Hold::verify(&lease().token(&TokenKeys::random()), &keys), Err(HoldError::Signature));
    }

    #[test]
    fn keys_rotate_without_breaking_tokens_in_flight() {
        let old = "old-key-0123456789abcdef";
        let new = "new-key-0123456789abcdef";
        let before = TokenKeys::parse(old).unwrap();
        let during = TokenKeys::parse(&format!("# rotation\n{new}\n\n{old}\n")).unwrap();
        let after = TokenKeys::parse(new).unwrap();
        let issued_before = lease().token(&before);
        let issued_during = lease().token(&during);
        assert_eq!(Hold::verify(&issued_before, &during), Ok(lease()));
        assert_eq!(Hold::verify(&issued_during, &after), Ok(lease()));
        assert_eq!(Hold::verify(&issued_before, &after), Err(HoldError::Signature));
        assert_eq!(TokenKeys::parse(" \n# none\n").unwrap_err(), TokenKeysError::Empty);
        assert_eq!(TokenKeys::parse("short").unwrap_err(), TokenKeysError::TooShort(1));
    }
}
