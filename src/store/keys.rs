//! Redis key names: the one place they are built.
//!
//! `sl1:{<tag>}:<rule-id as 16 hex digits>:<key>`
//!
//! - `sl1:` versions the layout: a change to the state encoding bumps it, so old and new
//!   replicas never read each other's state during a rollout (the old keys simply expire).
//! - `{<tag>}` is the Redis Cluster hash tag. Every rule a request matches must live in one slot
//!   for the decision script to read and write them atomically, so the tag is the request's
//!   namespace: all rules of one namespace's policies share it. The cost is that one namespace's
//!   keys all sit on one cluster shard; a tenant big enough to overload a shard needs its own
//!   namespaces.
//! - The rule id is the stable identity of the rule (not its numbers), so editing a limit keeps
//!   its counters.
//! - The key is the rule's joined key parts, binary-safe. Keys longer than [`MAX_INLINE_KEY`]
//!   bytes are replaced by their SHA-256 in hex, so a huge header value cannot make a huge Redis
//!   key.
//!
//! Rules that cannot share the request's tag (a future cluster-wide "global" rule keyed by its
//! own tag) cannot be decided in the same script. The store would then decide them in a second
//! call and, when that call denies after the first admitted, refund the first call's consumption
//! (check-then-consume with refund): atomic per slot, not across slots, and documented as such.
//! That path is not built: every rule of a request uses the request's tag.

use sha2::{Digest, Sha256};

use super::RuleId;

/// Version prefix of every key Sluice writes.
pub const PREFIX: &str = "sl1:";
use crate::rule::MAX_INLINE_KEY;
/// The tag of the keys Redis's start-up probe writes (no namespace can have a `:`); they live a
/// second and are not counted as anyone's.
pub const PROBE_TAG: &str = "sluice:probe";
/// The tag used when a request names no namespace.
pub const DEFAULT_TAG: &str = crate::rule::DEFAULT_NAMESPACE;

/// The Redis key holding the state of `rule` for `key`, in the hash-tag slot of `tag`.
pub fn state_key(tag: &str, rule: RuleId, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX.len() + tag.len() + 22 + key.len().min(64));
    out.extend_from_slice(PREFIX.as_bytes());
    out.push(b'{');
    push_tag(&mut out, tag);
    out.extend_from_slice(b"}:");
    out.extend_from_slice(format!("{rule:016x}").as_bytes());
    out.push(b':');
    if key.len() > MAX_INLINE_KEY {
        out.extend_from_slice(crate::rule::long_key_digest(key).as_bytes());
    } else {
        out.extend_from_slice(key);
    }
    out
}

/// The keys of `rule`'s queue of deferred writes in the slot of `tag` (lua/deferred.lua):
/// the stream, its per-key counts, the namespace's totals and the dead letters. `q`, `k`, `t`
/// and `d` are no hex digits' places: no state key is ever one of them.
pub fn queue_keys(tag: &str, rule: RuleId) -> [Vec<u8>; 4] {
    let mut base = Vec::with_capacity(PREFIX.len() + tag.len() + 24);
    base.extend_from_slice(PREFIX.as_bytes());
    base.push(b'{');
    push_tag(&mut base, tag);
    base.extend_from_slice(b"}:");
    let with = |kind: &str, rule: Option<RuleId>| {
        let mut key = base.clone();
        key.extend_from_slice(kind.as_bytes());
        if let Some(rule) = rule {
            key.extend_from_slice(format!(":{rule:016x}").as_bytes());
        }
        key
    };
    [with("q", Some(rule)), with("qk", Some(rule)), with("qt", None), with("qd", Some(rule))]
}

/// Where the reservations against a state key live (lua/reservation.lua derives it the same
/// way): `sl1:{<tag>}:r:<rule>:<key>`. The `r` is no hex digit, so no state key is ever one.
pub fn reservation_key(state_key: &[u8]) -> Vec<u8> {
    match state_key.windows(2).position(|w| w == b"}:") {
        Some(at) => [&state_key[..at + 2], b"r:", &state_key[at + 2..]].concat(),
        None => [state_key, b":r"].concat(),
    }
}

/// The hash tag the keys of `tag` (a request's namespace) carry, as [`state_key`] writes it.
pub fn hash_tag(tag: &str) -> String {
    let mut out = Vec::with_capacity(tag.len());
    push_tag(&mut out, tag);
    String::from_utf8_lossy(&out).into_owned()
}

/// The hash tag of a key Sluice wrote (`sl1:{<tag>}:…`), or `None` for any other key.
pub fn tag_of_key(key: &[u8]) -> Option<&str> {
    let rest = key.strip_prefix(PREFIX.as_bytes())?.strip_prefix(b"{")?;
    let end = rest.iter().position(|&b| b == b'}')?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The hash tag must be non-empty and free of braces, or Redis would hash a different part of
/// the key (an empty `{}` tag hashes the whole key, splitting a request's rules across slots).
/// Kubernetes namespace names never contain braces; anything else is replaced by a digest.
fn push_tag(out: &mut Vec<u8>, tag: &str) {
    if tag.is_empty() {
        out.extend_from_slice(DEFAULT_TAG.as_bytes());
    } else if tag.contains(['{', '}']) || tag.len() > MAX_INLINE_KEY {
        out.extend_from_slice(hex(&Sha256::digest(tag.as_bytes())[..8]).as_bytes());
    } else {
        out.extend_from_slice(tag.as_bytes());
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// The Redis Cluster slot of `key` (CRC16/XMODEM of its hash tag, mod 16384), for tests and
/// diagnostics.
pub fn cluster_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16_xmodem(hashed) % 16384
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= (byte as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_prefix_tag_rule_key() {
        let k = state_key("tenant-acme", 0xabc, b"203.0.113.7");
        assert_eq!(k, b"sl1:{tenant-acme}:0000000000000abc:203.0.113.7".to_vec());
    }

    #[test]
    fn keys_of_one_namespace_share_a_slot() {
        let a = state_key("tenant-acme", 1, b"ip:1.2.3.4");
        let b = state_key("tenant-acme", u64::MAX, b"{tricky}key");
        let c = state_key("tenant-acme", 7, &[0xff; 500]);
        assert_eq!(cluster_slot(&a), cluster_slot(&b));
        assert_eq!(cluster_slot(&a), cluster_slot(&c));
        assert_ne!(cluster_slot(&a), cluster_slot(&state_key("tenant-other", 1, b"ip:1.2.3.4")));
    }

    #[test]
    fn long_keys_are_hashed_short_ones_are_not() {
        let exact = vec![b'x'; MAX_INLINE_KEY];
        assert!(state_key("ns", 1, &exact).ends_with(&exact));
        let long = vec![b'x'; MAX_INLINE_KEY + 1];
        let k = state_key("ns", 1, &long);
        let tail = &k[k.len() - 64..];
        assert!(tail.iter().all(u8::is_ascii_hexdigit), "sha256 hex");
        assert_eq!(k.len(), "sl1:{ns}:0000000000000001:".len() + 64);
        assert_ne!(k, state_key("ns", 1, &[b'x'; MAX_INLINE_KEY + 2]));
    }

    #[test]
    fn braces_or_empty_tags_cannot_break_the_slot() {
        let k = state_key("a}b", 1, b"k");
        assert_eq!(k.iter().filter(|&&b| b == b'}').count(), 1);
        assert!(state_key("", 1, b"k").starts_with(b"sl1:{default}:"));
    }

    #[test]
    fn crc16_matches_the_cluster_spec() {
        // From the Redis Cluster specification: CRC16("123456789") = 0x31C3.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31c3);
        assert_eq!(cluster_slot(b"{user1000}.following"), cluster_slot(b"{user1000}.followers"));
        assert_eq!(cluster_slot(b"foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % 16384);
    }
}
