//! The check API's answer written as JSON by hand: byte for byte what `serde_json` writes for
//! [`CheckResponse`] (a property test holds the two together), at a fraction of the cost.
//!
//! `serde_json` escapes every string it writes, the object keys included, byte by byte through
//! its escape table: for an answer of ~500 bytes that was a tenth of the check's instructions
//! (callgrind, docs/benchmarks.md). Here the keys are written as the literals they are, a string
//! with nothing to escape (every key, name and number Sluice itself makes) is found so eight
//! bytes at a time and copied whole, `"` and `\` (the `RateLimit` headers' quoted names) are
//! escaped here as `serde_json` escapes them, and a string with a control character (only what
//! a policy author or a client wrote) goes through `serde_json` itself.

use super::{CheckResponse, RuleResult};
use crate::decimal::push_decimal_bytes;

impl CheckResponse {
    /// Appends the answer's JSON to `out`: exactly `serde_json::to_writer(out, self)`.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        write_decision(
            out,
            &Decision {
                allowed: self.allowed,
                status: self.status,
                retry_after_ms: self.retry_after_ms,
                delay_ms: self.delay_ms,
                headers: &self.headers,
                body: self.body.as_deref(),
                rules: Some(&self.rules),
                snapshot: &self.snapshot,
                lease: self.lease.as_deref(),
                slot: self.slot.as_deref(),
            },
        );
    }
}

/// The fields of a decision as the check APIs answer it: `/v1/check` with its rules, each result
/// of `/v1/checks` without.
pub(crate) struct Decision<'a> {
    pub allowed: bool,
    pub status: u16,
    pub retry_after_ms: Option<u64>,
    pub delay_ms: u64,
    pub headers: &'a [(std::borrow::Cow<'static, str>, String)],
    pub body: Option<&'a str>,
    pub rules: Option<&'a [RuleResult]>,
    pub snapshot: &'a str,
    pub lease: Option<&'a str>,
    pub slot: Option<&'a str>,
}

/// Appends `decision` as a JSON object, in the field order and with the omissions of the serde
/// definitions ([`CheckResponse`], `api::checks::LeanDecision`).
pub(crate) fn write_decision(out: &mut Vec<u8>, decision: &Decision<'_>) {
    out.extend_from_slice(b"{\"allowed\":");
    push_bool(out, decision.allowed);
    out.extend_from_slice(b",\"status\":");
    push_decimal_bytes(out, u64::from(decision.status));
    out.extend_from_slice(b",\"retryAfterMs\":");
    push_option(out, decision.retry_after_ms);
    out.extend_from_slice(b",\"delayMs\":");
    push_decimal_bytes(out, decision.delay_ms);
    out.extend_from_slice(b",\"headers\":{");
    for (i, (name, value)) in decision.headers.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        push_str(out, name);
        out.push(b':');
        push_str(out, value);
    }
    out.push(b'}');
    if let Some(body) = decision.body {
        out.extend_from_slice(b",\"body\":");
        push_str(out, body);
    }
    if let Some(rules) = decision.rules {
        out.extend_from_slice(b",\"rules\":[");
        for (i, rule) in rules.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            rule.write_json(out);
        }
        out.push(b']');
    }
    out.extend_from_slice(b",\"snapshot\":");
    push_str(out, decision.snapshot);
    if let Some(lease) = decision.lease {
        out.extend_from_slice(b",\"lease\":");
        push_str(out, lease);
    }
    if let Some(slot) = decision.slot {
        out.extend_from_slice(b",\"slot\":");
        push_str(out, slot);
    }
    out.push(b'}');
}

/// A rule result's JSON up to its names, `{"policy":…,"rule":…`: what every answer naming the rule
/// begins its result with, so the engine makes it once per snapshot.
pub(crate) fn names_json(policy: &str, rule: &str) -> std::sync::Arc<str> {
    let mut out = Vec::with_capacity(policy.len() + rule.len() + 24);
    push_names(&mut out, policy, rule);
    // Only whole UTF-8 strings and ASCII went in.
    String::from_utf8_lossy(&out).into()
}

fn push_names(out: &mut Vec<u8>, policy: &str, rule: &str) {
    out.extend_from_slice(b"{\"policy\":");
    push_str(out, policy);
    out.extend_from_slice(b",\"rule\":");
    push_str(out, rule);
}

impl RuleResult {
    fn write_json(&self, out: &mut Vec<u8>) {
        match &self.names_json {
            Some(names) => out.extend_from_slice(names.as_bytes()),
            None => push_names(out, &self.policy, &self.rule),
        }
        out.extend_from_slice(b",\"allowed\":");
        push_bool(out, self.allowed);
        out.extend_from_slice(b",\"shadow\":");
        push_bool(out, self.shadow);
        out.extend_from_slice(b",\"limit\":");
        push_decimal_bytes(out, self.limit);
        out.extend_from_slice(b",\"remaining\":");
        push_decimal_bytes(out, self.remaining);
        out.extend_from_slice(b",\"resetMs\":");
        push_decimal_bytes(out, self.reset_ms);
        out.extend_from_slice(b",\"retryAfterMs\":");
        push_option(out, self.retry_after_ms);
        if let Some(failure) = self.store_failure {
            out.extend_from_slice(b",\"storeFailure\":");
            push_str(out, failure);
        }
        if self.not_decided {
            out.extend_from_slice(b",\"notDecided\":true");
        }
        out.push(b'}');
    }
}

fn push_bool(out: &mut Vec<u8>, value: bool) {
    out.extend_from_slice(if value { b"true" } else { b"false" });
}

fn push_option(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        Some(n) => push_decimal_bytes(out, n),
        None => out.extend_from_slice(b"null"),
    }
}

/// The index of the first byte from `from` on that needs escaping (`"`, `\\` or a control
/// character), or `bytes.len()`: eight bytes at a time, a byte at a time only in the eight that
/// hold it. Every string Sluice makes but the `RateLimit` headers has none.
fn next_to_escape(bytes: &[u8], from: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    // Some byte of `v` is below `n` (n <= 128): the classic word-at-a-time test, exact as a
    // yes/no answer.
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGHS != 0;
    let flagged =
        |v: u64| below(v, 0x20) || below(v ^ (ONES * u64::from(b'"')), 1) || below(v ^ (ONES * u64::from(b'\\')), 1);
    let rest = bytes.get(from..).unwrap_or_default();
    let mut chunks = rest.chunks_exact(8);
    let mut at = from;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        if flagged(u64::from_le_bytes(word)) {
            break;
        }
        at += 8;
    }
    bytes[at..].iter().position(|&b| ESCAPE[usize::from(b)] != 0).map_or(bytes.len(), |i| at + i)
}

/// What `serde_json` does with each byte of a string: 0 copies it, 1 writes a backslash before
/// it (`"` and `\`), 2 hands the whole string to `serde_json` (the control characters below
/// 0x20, which it writes as `\n`, `\u001f`…).
static ESCAPE: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 0x20 {
        table[b] = 2;
        b += 1;
    }
    table[b'"' as usize] = 1;
    table[b'\\' as usize] = 1;
    table
};

/// A JSON string, byte for byte as `serde_json` writes it: copied whole when nothing in it needs
/// escaping (every key, name and number Sluice itself makes), `"` and `\` escaped here (the
/// `RateLimit` headers' quoted names), and a string with control characters (only what a policy
/// author or a client wrote) written by `serde_json` itself.
fn push_str(out: &mut Vec<u8>, text: &str) {
    let bytes = text.as_bytes();
    out.reserve(bytes.len() + 2);
    let begin = out.len();
    out.push(b'"');
    let mut start = 0;
    loop {
        let i = next_to_escape(bytes, start);
        out.extend_from_slice(&bytes[start..i]);
        let Some(&b) = bytes.get(i) else { break };
        if ESCAPE[usize::from(b)] != 1 {
            // A control character: the whole string again, by serde_json.
            out.truncate(begin);
            if serde_json::to_writer(&mut *out, text).is_err() {
                // Writing a string into a Vec cannot fail; should it, the answer stays valid JSON.
                out.extend_from_slice(b"\"\"");
            }
            return;
        }
        out.push(b'\\');
        out.push(b);
        start = i + 1;
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::sync::Arc;

    use rand::{Rng, SeedableRng};

    use super::*;

    fn text(rng: &mut rand::rngs::StdRng) -> String {
        const PIECES: [&str; 12] =
            ["a", "bench/per-key", "\"", "\\", "\n", "\u{1}", "\u{1f}", " ", "é", "\u{7f}", "🦀", ";q=10"];
        (0..rng.random_range(0..24)).map(|_| PIECES[rng.random_range(0..PIECES.len())]).collect()
    }

    fn option(rng: &mut rand::rngs::StdRng) -> Option<u64> {
        rng.random_bool(0.5).then(|| [0, 9, 10, 99, 1000, u64::MAX][rng.random_range(0..6)])
    }

    #[test]
    fn the_answer_is_what_serde_json_writes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..5000 {
            let rules = (0..rng.random_range(0..4))
                .map(|_| {
                    let (policy, rule) = (text(&mut rng), text(&mut rng));
                    // Both ways of writing the names: made once (as the engine does) or each time.
                    let names_json = rng.random_bool(0.5).then(|| names_json(&policy, &rule));
                    RuleResult {
                        policy: Arc::from(policy),
                        rule: Arc::from(rule),
                        allowed: rng.random(),
                        shadow: rng.random(),
                        limit: rng.random(),
                        remaining: rng.random_range(0..1_000_000),
                        reset_ms: rng.random(),
                        retry_after_ms: option(&mut rng),
                        quota_window_ms: rng.random(),
                        store_failure: rng.random_bool(0.3).then_some("localFallback"),
                        not_decided: rng.random_bool(0.3),
                        names_json,
                    }
                })
                .collect();
            let headers = (0..rng.random_range(0..6))
                .map(|_| {
                    let name =
                        if rng.random() { Cow::Borrowed("RateLimit-Policy") } else { Cow::Owned(text(&mut rng)) };
                    (name, text(&mut rng))
                })
                .collect();
            let response = CheckResponse {
                allowed: rng.random(),
                status: rng.random(),
                retry_after_ms: option(&mut rng),
                delay_ms: rng.random(),
                headers,
                body: rng.random_bool(0.3).then(|| Arc::from(text(&mut rng))),
                rules,
                snapshot: Arc::from(text(&mut rng)),
                lease: rng.random_bool(0.3).then(|| text(&mut rng)),
                slot: rng.random_bool(0.3).then(|| text(&mut rng)),
            };
            let mut written = Vec::new();
            response.write_json(&mut written);
            let expected = serde_json::to_vec(&response).expect("serde_json");
            assert_eq!(String::from_utf8_lossy(&written), String::from_utf8_lossy(&expected));
        }
    }
}
