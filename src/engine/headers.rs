//! Rate-limit response headers: `RateLimit-Policy` and `RateLimit`
//! (draft-ietf-httpapi-ratelimit-headers-11), the legacy `X-RateLimit-*` trio for the most
//! restrictive rule, and `Retry-After` on 429.
//!
//! Shadow rules are left out: they must not change what clients do.

use std::borrow::Cow;

use crate::algorithm::{Decision, Micros};
use crate::decimal::{decimal_string, push_decimal};
use crate::duration::MICROS_PER_SECOND;

use super::ResponseHeaders;

/// What a rule's headers say whatever the decision, written once per snapshot: its quota's
/// name as an sf-string, and its `RateLimit-Policy` item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleHeader {
    /// `"policy/rule"`: the quota's name (`policy/rule`) as an sf-string.
    label: String,
    /// `"policy/rule";q=<requests>;w=<seconds>`.
    policy: String,
    requests: u64,
}

impl RuleHeader {
    /// The header parts of the quota `name` (`policy/rule`) of `requests` per `per`.
    pub fn new(name: &str, requests: u64, per: Micros) -> RuleHeader {
        let mut label = String::with_capacity(name.len() + 2);
        push_sf_string(&mut label, name);
        let mut policy = String::with_capacity(label.len() + 32);
        policy.push_str(&label);
        policy.push_str(";q=");
        push_decimal(&mut policy, requests);
        policy.push_str(";w=");
        push_decimal(&mut policy, ceil_seconds(per).max(1));
        RuleHeader { label, policy, requests }
    }
}

/// One matched rule's decision, as the headers need it.
#[derive(Debug, Clone, Copy)]
pub struct RuleHeaderInput<'a> {
    pub header: &'a RuleHeader,
    pub shadow: bool,
    pub decision: &'a Decision,
}

pub fn ceil_seconds(micros: Micros) -> u64 {
    micros.div_ceil(MICROS_PER_SECOND)
}

/// An sf-string (RFC 8941): printable ASCII with `"` and `\` escaped; anything else becomes `?`.
#[cfg(test)]
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    push_sf_string(&mut out, text);
    out
}

/// Appends `text` to `out` as an sf-string.
fn push_sf_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
}

/// The rule whose figures the `X-RateLimit-*` headers show: on a denial the denying rule that
/// makes the client wait longest; otherwise the one with the least remaining.
fn most_restrictive<'a, 'r>(
    rules: impl Iterator<Item = &'r RuleHeaderInput<'a>>,
    allowed: bool,
) -> Option<&'r RuleHeaderInput<'a>> {
    if !allowed {
        let wait = |r: &RuleHeaderInput<'_>| r.decision.retry_after.unwrap_or(Micros::MAX);
        return rules.filter(|r| !r.decision.allowed).max_by_key(|r| wait(r));
    }
    // The least remaining, then the longest reset; the first of equals, as `min_by` would.
    let key = |r: &RuleHeaderInput<'_>| (r.decision.remaining, std::cmp::Reverse(r.decision.reset_after));
    rules.fold(None, |best, r| match best {
        Some(b) if key(b) <= key(r) => Some(b),
        _ => Some(r),
    })
}

/// The headers for a decided request, in a stable order. `now` is the decision time.
pub fn rate_limit_headers(rules: &[RuleHeaderInput<'_>], allowed: bool, now: Micros) -> ResponseHeaders {
    // Walked twice rather than collected: this runs on every check.
    let enforcing = || rules.iter().filter(|r| !r.shadow);
    let count = enforcing().count();
    let mut headers = ResponseHeaders::with_capacity(6);
    if count == 0 {
        return headers;
    }
    // Written straight into one string per header, from the parts each rule has ready.
    let mut policy = String::with_capacity(48 * count);
    let mut state = String::with_capacity(48 * count);
    for (i, r) in enforcing().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        policy.push_str(&r.header.policy);
        state.push_str(&r.header.label);
        state.push_str(";r=");
        push_decimal(&mut state, r.decision.remaining);
        state.push_str(";t=");
        push_decimal(&mut state, ceil_seconds(r.decision.reset_after));
    }
    headers.push((Cow::Borrowed("RateLimit-Policy"), policy));
    headers.push((Cow::Borrowed("RateLimit"), state));
    if let Some(top) = most_restrictive(enforcing(), allowed) {
        headers.push((Cow::Borrowed("X-RateLimit-Limit"), decimal_string(top.header.requests)));
        headers.push((Cow::Borrowed("X-RateLimit-Remaining"), decimal_string(top.decision.remaining)));
        headers
            .push((Cow::Borrowed("X-RateLimit-Reset"), decimal_string(ceil_seconds(now + top.decision.reset_after))));
    }
    if !allowed && let Some(wait) = retry_after(rules) {
        headers.push((Cow::Borrowed("Retry-After"), decimal_string(ceil_seconds(wait).max(1))));
    }
    headers
}

/// How long until every denying enforcing rule would admit the request; `None` when one of them
/// never will (its cost exceeds the capacity) or nothing denied.
pub fn retry_after(rules: &[RuleHeaderInput<'_>]) -> Option<Micros> {
    let mut longest = None;
    for r in rules.iter().filter(|r| !r.shadow && !r.decision.allowed) {
        let wait = r.decision.retry_after?;
        longest = Some(longest.map_or(wait, |l: Micros| l.max(wait)));
    }
    longest
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Micros = 1_700_000_000_000_000;

    /// The headers with plain names, to compare.
    fn rate_limit_headers(rules: &[RuleHeaderInput<'_>], allowed: bool, now: Micros) -> Vec<(&'static str, String)> {
        super::rate_limit_headers(rules, allowed, now)
            .into_iter()
            .map(|(name, value)| match name {
                Cow::Borrowed(name) => (name, value),
                Cow::Owned(name) => panic!("an owned name {name}"),
            })
            .collect()
    }

    fn decision(allowed: bool, remaining: u64, reset_ms: u64, retry_ms: Option<u64>) -> Decision {
        Decision { allowed, remaining, reset_after: reset_ms * 1000, retry_after: retry_ms.map(|m| m * 1000), delay: 0 }
    }

    #[test]
    fn allowed_request_names_every_enforcing_rule() {
        let a = decision(true, 7, 1500, None);
        let b = decision(true, 2, 60_000, None);
        let s = decision(false, 0, 1000, Some(1000));
        let rules = [
            RuleHeaderInput { header: &RuleHeader::new("orders/per-ip", 10, 1_000_000), shadow: false, decision: &a },
            RuleHeaderInput {
                header: &RuleHeader::new("orders/per-tenant", 100, 60_000_000),
                shadow: false,
                decision: &b,
            },
            RuleHeaderInput { header: &RuleHeader::new("orders/trial", 1, 1_000_000), shadow: true, decision: &s },
        ];
        let h = rate_limit_headers(&rules, true, NOW);
        assert_eq!(
            h,
            vec![
                ("RateLimit-Policy", r#""orders/per-ip";q=10;w=1, "orders/per-tenant";q=100;w=60"#.to_string()),
                ("RateLimit", r#""orders/per-ip";r=7;t=2, "orders/per-tenant";r=2;t=60"#.to_string()),
                ("X-RateLimit-Limit", "100".to_string()),
                ("X-RateLimit-Remaining", "2".to_string()),
                ("X-RateLimit-Reset", "1700000060".to_string()),
            ]
        );
    }

    #[test]
    fn denied_request_gets_retry_after_rounded_up_from_the_longest_wait() {
        let a = decision(false, 0, 900, Some(100));
        let b = decision(false, 0, 30_000, Some(2_500));
        let rules = [
            RuleHeaderInput { header: &RuleHeader::new("p/a", 10, 1_000_000), shadow: false, decision: &a },
            RuleHeaderInput { header: &RuleHeader::new("p/b", 5, 60_000_000), shadow: false, decision: &b },
        ];
        let h = rate_limit_headers(&rules, false, NOW);
        assert!(h.contains(&("Retry-After", "3".to_string())), "{h:?}");
        assert!(h.contains(&("X-RateLimit-Limit", "5".to_string())), "{h:?}");
        assert_eq!(retry_after(&rules), Some(2_500_000));
    }

    #[test]
    fn a_cost_that_never_fits_gets_no_retry_after() {
        let a = decision(false, 5, 0, None);
        let rules = [RuleHeaderInput { header: &RuleHeader::new("p/a", 5, 1_000_000), shadow: false, decision: &a }];
        let h = rate_limit_headers(&rules, false, NOW);
        assert!(!h.iter().any(|(n, _)| *n == "Retry-After"), "{h:?}");
        assert_eq!(retry_after(&rules), None);
    }

    #[test]
    fn only_shadow_rules_means_no_headers() {
        let s = decision(false, 0, 1000, Some(1000));
        let rules = [RuleHeaderInput { header: &RuleHeader::new("p/s", 1, 1_000_000), shadow: true, decision: &s }];
        assert!(rate_limit_headers(&rules, true, NOW).is_empty());
    }

    #[test]
    fn names_are_escaped_sf_strings() {
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(sf_string("é"), r#""?""#);
    }
}
