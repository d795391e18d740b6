//! The admission decision for a RateLimitPolicy: the one shared validation, then the checks that
//! need the other policies of the namespace, which neither CEL nor compile of one object can see.

use crate::policy::layering::{Finding, report};
use crate::policy::{LayeringMode, RateLimitPolicy, validate, warnings};

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Why the policy is refused (every problem, each naming its field); None admits it.
    pub denial: Option<String>,
    /// Admission warnings: risky but valid choices.
    pub warnings: Vec<String>,
}

/// Judges `policy` (being created or updated in `namespace`) against the namespace's `others`,
/// with `replicas` enforcers sharing each `localFallback` limit (the layering report).
pub fn review(policy: &RateLimitPolicy, namespace: &str, others: &[RateLimitPolicy], replicas: u32) -> Verdict {
    let mut problems: Vec<String> = Vec::new();
    // The API server fills in metadata.namespace from the request; validate the object as stored.
    let mut stored = policy.clone();
    if stored.metadata.namespace.is_none() {
        stored.metadata.namespace = Some(namespace.to_string());
    }
    if let Err(errors) = validate(&stored) {
        problems.extend(errors.iter().map(ToString::to_string));
    }
    problems.extend(conflicts(&stored, others));
    problems.extend(egress_conflicts(&stored, others));
    let mut warned = warnings(&stored);
    let findings = layering(&stored, others, replicas);
    if stored.spec.layering == Some(LayeringMode::Strict) {
        let qualified = stored.qualified_name();
        problems.extend(findings.iter().filter(|f| f.policy == qualified).map(|f| {
            format!(
                "spec.rules[{}] ({}): layering: {}: {} (spec.layering: strict)",
                f.index,
                f.rule,
                f.kind.name(),
                f.message
            )
        }));
    }
    warned.extend(findings.iter().map(|f| format!("layering: {f}")));
    Verdict { denial: (!problems.is_empty()).then(|| problems.join("; ")), warnings: warned }
}

/// The layering report of the namespace with `policy` in place of its stored version: the
/// findings about `policy`'s rules, and about other policies' rules that `policy` puts behind
/// (or in front of) its own.
fn layering(policy: &RateLimitPolicy, others: &[RateLimitPolicy], replicas: u32) -> Vec<Finding> {
    let qualified = policy.qualified_name();
    let mut namespace: Vec<RateLimitPolicy> = others
        .iter()
        .filter(|o| o.metadata.namespace == policy.metadata.namespace && o.qualified_name() != qualified)
        .cloned()
        .collect();
    namespace.push(policy.clone());
    // Only policies that compile take part: an invalid one is refused on its own merits.
    namespace.retain(|p| validate(p).is_ok());
    report(&namespace, replicas).into_iter().filter(|f| f.involves(&qualified)).collect()
}

/// Two policies of one namespace that select the same workloads (equal selectors; an absent
/// selector is the empty one) and both have a rule of the same name: their rule headers and
/// metrics would collide and users could not tell which limit answered.
fn conflicts(policy: &RateLimitPolicy, others: &[RateLimitPolicy]) -> Vec<String> {
    let name = policy.metadata.name.as_deref().unwrap_or_default();
    let selector = policy.spec.selector.clone().unwrap_or_default();
    let mut out = Vec::new();
    for other in others {
        if other.metadata.name.as_deref() == Some(name) || other.metadata.namespace != policy.metadata.namespace {
            continue;
        }
        if other.spec.selector.clone().unwrap_or_default() != selector {
            continue;
        }
        for (i, rule) in policy.spec.rules.iter().enumerate() {
            if other.spec.rules.iter().any(|r| r.name == rule.name) {
                out.push(format!(
                    "spec.rules[{i}].name: rule {:?} conflicts with policy {} that selects the same workloads and has a rule of the same name",
                    rule.name,
                    other.metadata.name.as_deref().unwrap_or_default()
                ));
            }
        }
    }
    out
}

/// A `spec.egress` destination the namespace's other policies already give another limit: one
/// destination, one budget. The stored policies win, whatever their names.
fn egress_conflicts(policy: &RateLimitPolicy, others: &[RateLimitPolicy]) -> Vec<String> {
    if policy.spec.egress.is_empty() {
        return Vec::new();
    }
    let qualified = policy.qualified_name();
    let mine = crate::policy::compile(vec![policy.clone()]).snapshot;
    let namespace: Vec<RateLimitPolicy> = others
        .iter()
        .filter(|o| o.metadata.namespace == policy.metadata.namespace && o.qualified_name() != qualified)
        .cloned()
        .collect();
    let theirs = crate::policy::compile(namespace).snapshot;
    mine.policies()
        .iter()
        .flat_map(|p| crate::policy::compile::egress_conflicts(p, theirs.policies().iter()).errors)
        .map(|e| e.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, app: &str, rule: &str, per: &str) -> RateLimitPolicy {
        serde_yaml::from_str(&format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  selector: {{matchLabels: {{app: {app}}}}}\n  rules:\n    - name: {rule}\n      algorithm: fixedWindow\n      limit: {{requests: 1, per: {per}}}\n"
        ))
        .expect("policy parses")
    }

    #[test]
    fn a_destination_given_another_limit_is_refused_whatever_the_names() {
        let egress = |name: &str, requests: u32| -> RateLimitPolicy {
            serde_yaml::from_str(&format!(
                "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  egress:\n  - {{name: bank, destination: \"https://b\", listenPort: 15100, limit: {{requests: {requests}, per: 1s, maxDelay: 1s}}}}\n"
            ))
            .expect("policy parses")
        };
        let stored = egress("zz", 10);
        assert_eq!(review(&egress("aa", 10), "ns", std::slice::from_ref(&stored), 1).denial, None);
        let denial = review(&egress("aa", 99), "ns", &[stored], 1).denial.expect("refused");
        assert!(denial.contains("spec.egress[0].destination") && denial.contains("ns/zz"), "{denial}");
    }

    #[test]
    fn valid_policy_is_admitted() {
        let verdict = review(&policy("a", "x", "r", "1s"), "ns", &[], 1);
        assert_eq!(verdict.denial, None);
    }

    #[test]
    fn invalid_policy_names_the_field() {
        let verdict = review(&policy("a", "x", "r", "0s"), "ns", &[], 1);
        let denial = verdict.denial.expect("denied");
        assert!(denial.contains("spec.rules[0].limit"), "{denial}");
    }

    #[test]
    fn over_budget_policies_are_denied_naming_the_field() {
        let mut log = policy("a", "x", "r", "1m");
        log.spec.rules[0].algorithm = crate::algorithm::Algorithm::SlidingWindowLog;
        log.spec.rules[0].limit.requests = 1001;
        let denial = review(&log, "ns", &[], 1).denial.expect("denied");
        assert_eq!(
            denial,
            "spec.rules[0].limit.requests: slidingWindowLog allows at most 1000 requests per window; use slidingWindowCounter for larger limits"
        );
        let mut regexes = policy("a", "x", "r", "1m");
        let path = crate::policy::PathMatch { regex: Some("/a[0-9]+".into()), ..Default::default() };
        regexes.spec.rules[0].matches = Some(crate::policy::Match { paths: vec![path; 32], ..Default::default() });
        let mut second = regexes.spec.rules[0].clone();
        second.name = "s".into();
        regexes.spec.rules.extend([second.clone(), second]);
        regexes.spec.rules[2].name = "t".into();
        let denial = review(&regexes, "ns", &[], 1).denial.expect("denied");
        assert!(denial.starts_with("spec.rules: at most 64 regexes per policy"), "{denial}");
    }

    #[test]
    fn same_selector_and_rule_name_conflict() {
        let others = [policy("b", "x", "r", "1s")];
        let denial = review(&policy("a", "x", "r", "1s"), "ns", &others, 1).denial.expect("denied");
        assert!(denial.contains("spec.rules[0].name") && denial.contains("policy b"), "{denial}");
        // Another selector, another rule name, or the policy's own older version: no conflict.
        assert_eq!(review(&policy("a", "y", "r", "1s"), "ns", &others, 1).denial, None);
        assert_eq!(review(&policy("a", "x", "s", "1s"), "ns", &others, 1).denial, None);
        assert_eq!(review(&policy("b", "x", "r", "1s"), "ns", &others, 1).denial, None);
    }

    #[test]
    fn layering_findings_warn_and_refuse_only_in_strict_mode() {
        let edge: RateLimitPolicy = serde_yaml::from_str(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: edge, namespace: ns}\nspec:\n  rules:\n    - {name: per-ip, key: [{clientIP: true}], algorithm: fixedWindow, limit: {requests: 10, per: 1s}}\n",
        )
        .expect("policy parses");
        let inner = |mode: &str| -> RateLimitPolicy {
            serde_yaml::from_str(&format!(
                "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: routes, namespace: ns}}\nspec:\n  {mode}selector: {{matchLabels: {{app: x}}}}\n  rules:\n    - {{name: per-ip-route, key: [{{clientIP: true}}, {{path: true}}], match: {{paths: [{{prefix: /a}}]}}, algorithm: fixedWindow, limit: {{requests: 50, per: 1s}}}}\n"
            ))
            .expect("policy parses")
        };
        let others = [edge.clone()];
        let warned = review(&inner(""), "ns", &others, 1);
        assert_eq!(warned.denial, None);
        assert!(
            warned
                .warnings
                .iter()
                .any(|w| w.starts_with("layering: ns/routes spec.rules[0] (per-ip-route): unreachable:")
                    && w.contains("ns/edge rule per-ip")),
            "{:?}",
            warned.warnings
        );
        let denial = review(&inner("layering: strict\n  "), "ns", &others, 1).denial.expect("strict refuses");
        assert!(denial.starts_with("spec.rules[0] (per-ip-route): layering: unreachable:"), "{denial}");
        // The outer policy is told which of the namespace's rules it makes unreachable, and
        // is admitted even in strict mode: the finding is about another policy's rule.
        let mut strict_edge = edge.clone();
        strict_edge.spec.layering = Some(LayeringMode::Strict);
        let outer = review(&strict_edge, "ns", &[inner("")], 1);
        assert_eq!(outer.denial, None);
        assert!(outer.warnings.iter().any(|w| w.contains("per-ip-route): unreachable")), "{:?}", outer.warnings);
        // A fallback share above the limit is reported with the replicas given.
        assert!(review(&edge, "ns", &[], 20).warnings.iter().any(|w| w.contains("fallbackExceedsLimit")));
        assert!(!review(&edge, "ns", &[], 10).warnings.iter().any(|w| w.contains("fallbackExceedsLimit")));
    }
}
