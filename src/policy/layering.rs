//! Layered limits that agree: the report of rules that can never bind, inner rules looser than
//! the outer ones they sit behind, shadow rules whose enforcement would change nothing, and
//! `localFallback` shares that add up to more than the limit.
//!
//! Layers, in Sluice, are rules that count the same requests: an *outer* rule whose key is the
//! same as or coarser than an *inner* rule's (per client IP, per tenant) and whose match and
//! selector take in every request the inner one counts. A request must pass every enforcing rule,
//! and a refused request consumes nothing anywhere, so an inner rule only sees what its enforcing
//! outer rules admit: when the arithmetic of [`crate::algorithm::dominance`] shows that stream
//! always fits the inner limit, the inner rule never refuses anything. The getting-it-wrong case
//! is the silent one — a tighter limit meant for a tenant that is written looser than the limit
//! in front of it, accepted and never applying.
//!
//! Coverage is judged from the specs, conservatively: an outer rule covers an inner one only when
//! that is evident from their text (absent or equal conditions, path prefixes that contain the
//! inner paths, header conditions the inner rule repeats). A report is therefore always true;
//! some layerings it cannot see through are not reported. Rules charged by their response
//! (`responseCost`), leased rules (which may overshoot) and concurrency limits are left out.
//!
//! One report serves every entry point: `sluice serve` and `sluice simulate` print it when they
//! load policies, `sluice explain` names the findings of the rules a request meets, the
//! admission webhook answers them as warnings (a refusal under `spec.layering: strict`), and the
//! operator sets each policy's `LayeringConsistent` condition.

use std::fmt;

use super::crd::{FailureMode, HeaderMatch, KeyPart, Match, Mode, PathMatch, PolicyRule, RateLimitPolicy};
use super::errors::ValidationErrors;
use super::validate::build_limit;
use crate::algorithm::dominance::{never_refuses, sustains_more};
use crate::algorithm::{Algorithm, Limit};
use crate::duration::HumanDuration;
use crate::request::names::same_header_name;

/// What is wrong with a rule's place among the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An enforcing rule that can never refuse: a tighter rule in front of it always refuses
    /// first.
    Unreachable,
    /// An enforcing rule behind another (same or coarser key) with a sustained rate above the
    /// other's: it binds at most on bursts.
    LooserInner,
    /// A shadow rule that would refuse nothing if it were enforced.
    ShadowChangesNothing,
    /// `onStoreFailure: localFallback` whose per-replica shares add up to more than the limit.
    FallbackExceedsLimit,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Unreachable => "unreachable",
            Kind::LooserInner => "looserInner",
            Kind::ShadowChangesNothing => "shadowChangesNothing",
            Kind::FallbackExceedsLimit => "fallbackExceedsLimit",
        }
    }
}

/// One finding about one rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub kind: Kind,
    /// The policy of the rule the finding is about (`namespace/name`).
    pub policy: String,
    /// That rule's index and name.
    pub index: usize,
    pub rule: String,
    /// The other rule involved (`namespace/policy` and rule name), when there is one.
    pub other: Option<(String, String)>,
    /// What is wrong and why, in words.
    pub message: String,
}

impl Finding {
    /// Whether the finding names the policy `qualified` (as the rule's or the other one's).
    pub fn involves(&self, qualified: &str) -> bool {
        self.policy == qualified || self.other.as_ref().is_some_and(|(policy, _)| policy == qualified)
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} spec.rules[{}] ({}): {}: {}", self.policy, self.index, self.rule, self.kind.name(), self.message)
    }
}

/// A rule ready for comparison: its policy, place and compiled limit.
struct Entry<'a> {
    policy: &'a RateLimitPolicy,
    qualified: String,
    index: usize,
    rule: &'a PolicyRule,
    limit: Limit,
}

/// The report for `policies` (any namespaces; rules are only compared within one), with
/// `replicas` enforcers sharing each `localFallback` limit (`--fallback-replicas`).
pub fn report(policies: &[RateLimitPolicy], replicas: u32) -> Vec<Finding> {
    let entries: Vec<Entry<'_>> = policies
        .iter()
        .flat_map(|policy| {
            let qualified = policy.qualified_name();
            policy.spec.rules.iter().enumerate().filter_map(move |(index, rule)| {
                let mut errs = ValidationErrors::default();
                let limit = build_limit(rule.algorithm, &rule.limit, "", &mut errs).filter(|_| errs.is_empty())?;
                Some(Entry { policy, qualified: qualified.clone(), index, rule, limit })
            })
        })
        .collect();
    let mut out = Vec::new();
    for inner in &entries {
        if let Some(finding) = layered(inner, &entries) {
            out.push(finding);
        }
        if let Some(finding) = fallback(inner, replicas) {
            out.push(finding);
        }
    }
    out
}

/// The finding about `inner` among `entries`, if any: the first outer rule that makes it
/// unreachable, else the first it is looser than.
fn layered(inner: &Entry<'_>, entries: &[Entry<'_>]) -> Option<Finding> {
    if !comparable(inner.rule) {
        return None;
    }
    let mut looser = None;
    for outer in entries {
        if std::ptr::eq(outer, inner) || !comparable(outer.rule) || outer.rule.mode != Mode::Enforce {
            continue;
        }
        if !covers(outer, inner) {
            continue;
        }
        if let Some(why) = never_refuses(&outer.limit, outer.rule.cost, &inner.limit, inner.rule.cost) {
            // Two rules that make each other unreachable (equal limits on equal keys): the
            // second one named is the one to report.
            let mutual = covers(inner, outer)
                && inner.rule.mode == Mode::Enforce
                && never_refuses(&inner.limit, inner.rule.cost, &outer.limit, outer.rule.cost).is_some();
            if mutual && (inner.qualified.as_str(), inner.index) < (outer.qualified.as_str(), outer.index) {
                continue;
            }
            let (kind, consequence) = match inner.rule.mode {
                Mode::Enforce => (Kind::Unreachable, "it can never refuse a request"),
                Mode::Shadow => (Kind::ShadowChangesNothing, "enforcing it would change nothing"),
            };
            return Some(finding(
                kind,
                inner,
                outer,
                format!(
                    "{consequence}: every request it counts passes {} ({}) first, and {why}; make it tighter than that rule or remove it",
                    name(outer),
                    describe(outer)
                ),
            ));
        }
        if looser.is_none()
            && inner.rule.mode == Mode::Enforce
            && sustains_more(&outer.limit, outer.rule.cost, &inner.limit, inner.rule.cost)
        {
            looser = Some(finding(
                Kind::LooserInner,
                inner,
                outer,
                format!(
                    "it sits behind {} ({}) with the same or a coarser key, and sustains a higher rate ({}): it can bind on bursts only, never once that rule is the bottleneck; an inner layer is meant to be tighter",
                    name(outer),
                    describe(outer),
                    describe(inner)
                ),
            ));
        }
    }
    looser
}

fn finding(kind: Kind, inner: &Entry<'_>, outer: &Entry<'_>, message: String) -> Finding {
    Finding {
        kind,
        policy: inner.qualified.clone(),
        index: inner.index,
        rule: inner.rule.name.clone(),
        other: Some((outer.qualified.clone(), outer.rule.name.clone())),
        message,
    }
}

fn name(entry: &Entry<'_>) -> String {
    format!("{} rule {}", entry.qualified, entry.rule.name)
}

/// `tokenBucket 50 per 1s, burst 100, cost 1`.
fn describe(entry: &Entry<'_>) -> String {
    let limit = &entry.limit;
    let mut text = format!("{} {} per {}", limit.algorithm().name(), limit.requests(), HumanDuration(limit.per()));
    if limit.algorithm().uses_burst() && limit.burst() != limit.requests() {
        text.push_str(&format!(", burst {}", limit.burst()));
    }
    if entry.rule.cost != 1 {
        text.push_str(&format!(", cost {}", entry.rule.cost));
    }
    text
}

/// Rules the arithmetic can speak for: a request's cost known at admission, exact decisions.
fn comparable(rule: &PolicyRule) -> bool {
    rule.response_cost.is_none()
        && rule.algorithm != Algorithm::Concurrency
        && rule.consistency.as_ref().is_none_or(|c| c.mode == super::crd::ConsistencyMode::Exact)
}

/// Whether `outer` counts every request `inner` counts, under a key no finer than `inner`'s.
fn covers(outer: &Entry<'_>, inner: &Entry<'_>) -> bool {
    let (op, ip) = (outer.policy, inner.policy);
    if op.metadata.namespace != ip.metadata.namespace {
        return false;
    }
    // An absent selector is every workload of the namespace.
    let selects = match (&op.spec.selector, &ip.spec.selector) {
        (None, _) => true,
        (Some(o), i) => is_empty_selector(o) || Some(o) == i.as_ref(),
    };
    selects
        && matches_cover(outer.rule.matches.as_ref(), inner.rule.matches.as_ref())
        && key_covers(&outer.rule.key, &inner.rule.key)
}

fn is_empty_selector(s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector) -> bool {
    s.match_labels.as_ref().is_none_or(|l| l.is_empty()) && s.match_expressions.as_ref().is_none_or(|e| e.is_empty())
}

/// Whether every request `inner` matches is matched by `outer`, as evident from their text.
fn matches_cover(outer: Option<&Match>, inner: Option<&Match>) -> bool {
    let empty = Match::default();
    let (o, i) = (outer.unwrap_or(&empty), inner.unwrap_or(&empty));
    // Any-of lists: the outer list takes in every entry of the inner one.
    let methods = o.methods.is_empty()
        || (!i.methods.is_empty() && i.methods.iter().all(|m| o.methods.iter().any(|n| n.eq_ignore_ascii_case(m))));
    let hosts = o.hosts.is_empty()
        || (!i.hosts.is_empty() && i.hosts.iter().all(|h| o.hosts.iter().any(|g| g.eq_ignore_ascii_case(h))));
    let paths = o.paths.is_empty()
        || (!i.paths.is_empty() && i.paths.iter().all(|p| o.paths.iter().any(|q| path_covers(q, p))));
    // All-of list: every outer condition is one the inner rule also requires.
    let headers = o.headers.iter().all(|h| i.headers.iter().any(|g| same_header_condition(h, g)));
    // A descriptor is matched as a whole: only an equal one takes in the same descriptors.
    let descriptor = o.descriptor == i.descriptor;
    methods && hosts && paths && headers && descriptor
}

fn same_header_condition(a: &HeaderMatch, b: &HeaderMatch) -> bool {
    same_header_name(&a.name, &b.name)
        && a.exact == b.exact
        && a.prefix == b.prefix
        && a.regex == b.regex
        && a.present == b.present
}

/// Whether path entry `outer` matches every path `inner` matches.
fn path_covers(outer: &PathMatch, inner: &PathMatch) -> bool {
    if outer == inner {
        return true;
    }
    if outer.ignore_case.unwrap_or(false) != inner.ignore_case.unwrap_or(false) || outer.regex.is_some() {
        return false;
    }
    let Some(prefix) = outer.prefix.as_deref() else { return false };
    let Some(path) = inner.prefix.as_deref().or(inner.exact.as_deref()) else { return false };
    // Prefixes match whole segments: `/orders` takes in `/orders` and `/orders/...`.
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty() || path == prefix || path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('/'))
}

/// Whether `outer`'s key is the same as or coarser than `inner`'s: each part that splits
/// requests into counters is one the inner key also has. Namespace and literal parts are one
/// value per rule, and split nothing.
fn key_covers(outer: &[KeyPart], inner: &[KeyPart]) -> bool {
    outer
        .iter()
        .filter(|part| part.namespace.is_none() && part.literal.is_none())
        .all(|part| inner.iter().any(|other| same_key_part(part, other)))
}

fn same_key_part(a: &KeyPart, b: &KeyPart) -> bool {
    let header = match (&a.header, &b.header) {
        (Some(x), Some(y)) => same_header_name(x, y),
        (None, None) => true,
        _ => false,
    };
    // An outer part that skips requests without the value counts fewer requests than one that
    // shares them: it covers only an inner part that skips them too.
    let skips = |p: &KeyPart| p.missing == Some(super::crd::Missing::Skip);
    header
        && a.client_ip == b.client_ip
        && a.path == b.path
        && a.method == b.method
        && a.host == b.host
        && a.descriptor == b.descriptor
        && (!skips(a) || skips(b))
}

/// The `localFallback` finding about `entry`: each of `replicas` enforcers keeps at least one
/// request (and one of burst) of the limit while the store is away, so a limit smaller than the
/// replicas is exceeded together.
fn fallback(entry: &Entry<'_>, replicas: u32) -> Option<Finding> {
    if entry.rule.on_store_failure != FailureMode::LocalFallback || replicas <= 1 || entry.rule.mode != Mode::Enforce {
        return None;
    }
    let limit = &entry.limit;
    let share = |n: u64| (n / u64::from(replicas)).max(1);
    let total = share(limit.requests()) * u64::from(replicas);
    let burst_total = share(limit.burst()) * u64::from(replicas);
    let over_burst = limit.algorithm().uses_burst() && burst_total > limit.burst();
    if total <= limit.requests() && !over_burst {
        return None;
    }
    let (what, each, together, declared) = if total > limit.requests() {
        ("requests", share(limit.requests()), total, limit.requests())
    } else {
        ("burst", share(limit.burst()), burst_total, limit.burst())
    };
    Some(Finding {
        kind: Kind::FallbackExceedsLimit,
        policy: entry.qualified.clone(),
        index: entry.index,
        rule: entry.rule.name.clone(),
        other: None,
        message: format!(
            "onStoreFailure: localFallback: while the store is away each of the {replicas} replicas enforces {what} {each} per {} alone (its share, at least one), {together} together, above the declared {declared}; raise the limit, or choose deny or allow",
            HumanDuration(limit.per())
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::load_str;

    fn policies(yaml: &str) -> Vec<RateLimitPolicy> {
        load_str(yaml, std::path::Path::new("test.yaml")).expect("policies").into_iter().map(|l| l.policy).collect()
    }

    fn kinds(report: &[Finding]) -> Vec<(String, &'static str)> {
        report.iter().map(|f| (f.rule.clone(), f.kind.name())).collect()
    }

    #[test]
    fn the_examples_layered_setup_is_consistent() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/policies/layered.yaml"))
            .expect("examples/policies/layered.yaml");
        assert_eq!(report(&policies(&text), 1), Vec::new());
    }

    #[test]
    fn an_inner_rule_looser_than_the_one_in_front_of_it_is_unreachable() {
        let report = report(
            &policies(
                r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: edge, namespace: shop}
spec:
  rules:
    - {name: per-tenant, key: [{header: X-Tenant}], algorithm: gcra, limit: {requests: 20, per: 1s, burst: 40}}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: routes, namespace: shop}
spec:
  selector: {matchLabels: {app: orders}}
  rules:
    - name: per-tenant-route
      match: {paths: [{prefix: /orders}]}
      key: [{header: x-tenant}, {path: true}]
      algorithm: slidingWindowCounter
      limit: {requests: 5000, per: 1m}
    - name: per-tenant-bursty
      key: [{header: X-Tenant}]
      algorithm: tokenBucket
      limit: {requests: 30, per: 1s, burst: 10}
    - name: shadow-copy
      key: [{header: X-Tenant}, {method: true}]
      algorithm: gcra
      limit: {requests: 20, per: 1s, burst: 40}
      mode: shadow
    - name: other-key
      key: [{clientIP: true}]
      algorithm: gcra
      limit: {requests: 1000, per: 1s}
"#,
            ),
            1,
        );
        assert_eq!(
            kinds(&report),
            vec![
                ("per-tenant-route".to_string(), "unreachable"),
                ("per-tenant-bursty".to_string(), "looserInner"),
                ("shadow-copy".to_string(), "shadowChangesNothing"),
            ],
            "{report:#?}"
        );
        let unreachable = &report[0];
        assert_eq!(unreachable.other, Some(("shop/edge".to_string(), "per-tenant".to_string())));
        assert!(unreachable.message.contains("gcra 20 per 1s, burst 40"), "{}", unreachable.message);
    }

    #[test]
    fn rules_that_do_not_take_in_each_others_requests_are_not_compared() {
        let report = report(
            &policies(
                r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: shop}
spec:
  rules:
    - name: orders
      match: {paths: [{prefix: /orders}], headers: [{name: X-Tier, exact: free}]}
      key: [{header: X-Tenant}]
      algorithm: fixedWindow
      limit: {requests: 10, per: 1s}
    - name: narrower-match-outer
      match: {paths: [{prefix: /ordersx}]}
      key: [{header: X-Tenant}]
      algorithm: fixedWindow
      limit: {requests: 100, per: 1s}
    - name: finer-outer-key
      match: {paths: [{prefix: /orders/1}], headers: [{name: X-Tier, exact: free}]}
      key: []
      algorithm: fixedWindow
      limit: {requests: 100, per: 1s}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: elsewhere}
spec:
  rules:
    - {name: orders, key: [{header: X-Tenant}], algorithm: fixedWindow, limit: {requests: 100, per: 1s}}
"#,
            ),
            1,
        );
        assert_eq!(kinds(&report), Vec::new(), "{report:#?}");
    }

    #[test]
    fn equal_rules_report_the_second_only() {
        let report = report(
            &policies(
                r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: shop}
spec:
  rules:
    - {name: first, key: [{clientIP: true}], algorithm: fixedWindow, limit: {requests: 10, per: 1s}}
    - {name: second, key: [{clientIP: true}], algorithm: fixedWindow, limit: {requests: 10, per: 1s}}
"#,
            ),
            1,
        );
        assert_eq!(kinds(&report), vec![("second".to_string(), "unreachable")]);
    }

    #[test]
    fn local_fallback_shares_above_the_limit_are_reported() {
        let text = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: shop}
spec:
  rules:
    - {name: tiny, algorithm: fixedWindow, limit: {requests: 2, per: 1s}, key: [{header: A}]}
    - {name: bursty, algorithm: tokenBucket, limit: {requests: 100, per: 1s, burst: 2}, key: [{header: B}]}
    - {name: denies, algorithm: fixedWindow, limit: {requests: 2, per: 1s}, onStoreFailure: deny, key: [{header: C}]}
    - {name: roomy, algorithm: fixedWindow, limit: {requests: 300, per: 1s}, key: [{header: D}]}
"#;
        assert_eq!(report(&policies(text), 1), Vec::new());
        let report = report(&policies(text), 3);
        assert_eq!(
            kinds(&report),
            vec![("tiny".to_string(), "fallbackExceedsLimit"), ("bursty".to_string(), "fallbackExceedsLimit")]
        );
        assert!(report[0].message.contains("3 replicas enforces requests 1 per 1s alone"), "{}", report[0].message);
        assert!(report[1].message.contains("burst 1"), "{}", report[1].message);
    }
}
