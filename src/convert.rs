//! `sluice convert envoy-ratelimit FILE`: an envoyproxy/ratelimit configuration (a domain and its
//! tree of descriptors) as RateLimitPolicy documents that decide the same way when Sluice is the
//! rate limit service.
//!
//! envoyproxy/ratelimit walks a request descriptor's entries down the tree, at each level taking
//! the child with the entry's exact `key_value` if there is one, else the first wildcard child
//! (`value: prefix*`, in file order) whose prefix the value has, else the child with the key
//! alone (any value); the limit is that of the node the last entry reaches. Sluice's rules are
//! independent, so each limited node becomes a rule whose `match.descriptor` is its path from the
//! root, each level excluding what a more specific sibling takes (`notIn` the exact siblings'
//! values, `notPrefix` the earlier wildcards'). Counters are per distinct value wherever the
//! tree accepts more than one value, as there. `unlimited: true` nodes get no rule: their
//! siblings exclude them, so nothing limits them.

use std::collections::BTreeSet;

use serde::Deserialize;

use crate::algorithm::Algorithm;
use crate::policy::crd::{
    DescriptorEntryMatch, KeyPart, LimitSpec, MAX_DESCRIPTOR_ENTRIES, MAX_MATCH_ITEMS, MAX_RULES, Match, Mode,
    PolicyRule, RateLimitPolicy, RateLimitPolicySpec,
};

/// One envoyproxy/ratelimit configuration file (one YAML document per domain).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyRateLimitConfig {
    pub domain: String,
    #[serde(default)]
    pub descriptors: Vec<EnvoyDescriptor>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyDescriptor {
    pub key: String,
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub rate_limit: Option<EnvoyRateLimit>,
    #[serde(default)]
    pub descriptors: Vec<EnvoyDescriptor>,
    #[serde(default)]
    pub shadow_mode: bool,
    /// Statistics options of envoyproxy/ratelimit; Sluice's metrics are per rule already.
    #[serde(default)]
    pub detailed_metric: bool,
    #[serde(default)]
    pub value_to_metric: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyRateLimit {
    #[serde(default)]
    pub unit: Option<String>,
    #[serde(default)]
    pub requests_per_unit: Option<u64>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub name: Option<String>,
    /// Limits this one replaces; Sluice decides every matching rule, so this has no equivalent.
    #[serde(default)]
    pub replaces: Vec<serde_yaml::Value>,
}

/// What a conversion produced: the policies, and what of the input has no effect in Sluice.
#[derive(Debug)]
pub struct Converted {
    pub policies: Vec<RateLimitPolicy>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConvertError(pub String);

/// How a tree level accepts the entry's value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ValueSpec {
    Exact(String),
    Prefix(String),
    Any,
}

impl ValueSpec {
    fn of(value: &Option<String>) -> ValueSpec {
        match value.as_deref() {
            None | Some("") => ValueSpec::Any,
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) => ValueSpec::Prefix(prefix.to_string()),
                None => ValueSpec::Exact(v.to_string()),
            },
        }
    }
}

/// Converts every document of `yaml`. `namespace` is where the policies go and must then be the
/// domain Envoy sends; without it, each document's domain is its namespace.
pub fn envoy_ratelimit(yaml: &str, namespace: Option<&str>, algorithm: Algorithm) -> Result<Converted, ConvertError> {
    let mut policies = Vec::new();
    let mut notes = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(yaml).enumerate() {
        let config = EnvoyRateLimitConfig::deserialize(document)
            .map_err(|e| ConvertError(format!("document {}: {e}", index + 1)))?;
        let namespace = namespace.unwrap_or(&config.domain);
        if !crate::policy::validate::is_dns_label(namespace) {
            return Err(ConvertError(format!(
                "document {}: domain {:?} is not a namespace name (lowercase letters, digits and '-', at most 63): \
                 pass --namespace NS and set the Envoy filter's domain to NS",
                index + 1,
                config.domain
            )));
        }
        let mut rules = Vec::new();
        walk(&config.descriptors, &mut Vec::new(), algorithm, &mut rules, &mut notes)?;
        if rules.is_empty() {
            notes.push(format!("domain {}: no limited descriptors, no policy written", config.domain));
            continue;
        }
        let base = label(&config.domain, 50);
        let chunks: Vec<Vec<PolicyRule>> = rules.chunks(MAX_RULES).map(<[PolicyRule]>::to_vec).collect();
        let several = chunks.len() > 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let name = if several { format!("{base}-{}", i + 1) } else { base.clone() };
            let mut policy = RateLimitPolicy::new(
                &name,
                RateLimitPolicySpec {
                    selector: None,
                    rules: chunk,
                    priorities: Vec::new(),
                    overload: None,
                    layering: None,
                    egress: Vec::new(),
                },
            );
            policy.metadata.namespace = Some(namespace.to_string());
            if let Err(errors) = crate::policy::validate(&policy) {
                return Err(ConvertError(format!(
                    "domain {}: the converted policy is invalid: {errors}",
                    config.domain
                )));
            }
            policies.push(policy);
        }
    }
    Ok(Converted { policies, notes })
}

/// One level of the tree as a descriptor entry condition, given its siblings (all children of the
/// same parent, in file order).
fn entry_condition(node: &EnvoyDescriptor, siblings: &[EnvoyDescriptor]) -> Result<DescriptorEntryMatch, ConvertError> {
    let same_key = siblings.iter().filter(|s| s.key == node.key);
    let exact_values: BTreeSet<String> = same_key
        .clone()
        .filter_map(|s| match ValueSpec::of(&s.value) {
            ValueSpec::Exact(v) => Some(v),
            _ => None,
        })
        .collect();
    let mut condition = DescriptorEntryMatch { key: node.key.clone(), ..DescriptorEntryMatch::default() };
    match ValueSpec::of(&node.value) {
        ValueSpec::Exact(v) => condition.exact = Some(v),
        ValueSpec::Prefix(prefix) => {
            condition.not_in = exact_values.into_iter().filter(|v| v.starts_with(&prefix)).collect();
            // Wildcards are tried in file order: the earlier ones take their values first.
            let earlier = same_key.take_while(|s| !std::ptr::eq(*s, node));
            condition.not_prefix = earlier
                .filter_map(|s| match ValueSpec::of(&s.value) {
                    ValueSpec::Prefix(p) if p.starts_with(&prefix) || prefix.starts_with(&p) => Some(p),
                    _ => None,
                })
                .collect();
            condition.prefix = Some(prefix);
        }
        ValueSpec::Any => {
            condition.not_in = exact_values.into_iter().collect();
            condition.not_prefix = same_key
                .filter_map(|s| match ValueSpec::of(&s.value) {
                    ValueSpec::Prefix(p) => Some(p),
                    _ => None,
                })
                .collect();
        }
    }
    if condition.prefix.as_deref() == Some("") && condition.not_in.is_empty() && condition.not_prefix.is_empty() {
        condition.prefix = None; // `*`: any value
    }
    for (field, n) in [("exact values", condition.not_in.len()), ("wildcards", condition.not_prefix.len())] {
        if n > MAX_MATCH_ITEMS {
            return Err(ConvertError(format!(
                "descriptor key {}: more than {MAX_MATCH_ITEMS} sibling {field} to exclude",
                node.key
            )));
        }
    }
    Ok(condition)
}

fn walk(
    nodes: &[EnvoyDescriptor],
    path: &mut Vec<(DescriptorEntryMatch, String)>,
    algorithm: Algorithm,
    rules: &mut Vec<PolicyRule>,
    notes: &mut Vec<String>,
) -> Result<(), ConvertError> {
    for node in nodes {
        let condition = entry_condition(node, nodes)?;
        let readable = match &node.value {
            Some(v) if !v.is_empty() => format!("{}={v}", node.key),
            _ => node.key.clone(),
        };
        path.push((condition, readable));
        if path.len() > MAX_DESCRIPTOR_ENTRIES {
            return Err(ConvertError(format!(
                "descriptor {}: deeper than {MAX_DESCRIPTOR_ENTRIES} entries",
                describe(path)
            )));
        }
        if node.detailed_metric || node.value_to_metric {
            notes.push(format!(
                "{}: detailed_metric/value_to_metric have no equivalent (metrics are per rule)",
                describe(path)
            ));
        }
        if let Some(limit) = &node.rate_limit {
            if !limit.replaces.is_empty() {
                notes.push(format!(
                    "{}: `replaces` has no equivalent: Sluice decides every rule a request matches",
                    describe(path)
                ));
            }
            if !limit.unlimited {
                rules.push(rule_for(path, node, limit, algorithm, rules)?);
            }
        } else if node.descriptors.is_empty() {
            notes.push(format!("{}: neither rate_limit nor descriptors, ignored", describe(path)));
        }
        walk(&node.descriptors, path, algorithm, rules, notes)?;
        path.pop();
    }
    Ok(())
}

fn describe(path: &[(DescriptorEntryMatch, String)]) -> String {
    path.iter().map(|(_, r)| r.as_str()).collect::<Vec<_>>().join(" / ")
}

fn rule_for(
    path: &[(DescriptorEntryMatch, String)],
    node: &EnvoyDescriptor,
    limit: &EnvoyRateLimit,
    algorithm: Algorithm,
    existing: &[PolicyRule],
) -> Result<PolicyRule, ConvertError> {
    let at = describe(path);
    let unit = limit.unit.as_deref().ok_or_else(|| ConvertError(format!("{at}: rate_limit.unit is required")))?;
    let per = match unit.to_ascii_lowercase().as_str() {
        "second" => "1s",
        "minute" => "1m",
        "hour" => "1h",
        "day" => "1d",
        "week" => "7d",
        // envoyproxy/ratelimit's own lengths of these units.
        "month" => "30d",
        "year" => "365d",
        other => return Err(ConvertError(format!("{at}: unknown unit {other:?}"))),
    };
    let requests = limit
        .requests_per_unit
        .filter(|&n| n >= 1)
        .ok_or_else(|| ConvertError(format!("{at}: rate_limit.requests_per_unit must be at least 1")))?;
    // Wherever more than one value reaches this node, each value counts separately.
    let key = path
        .iter()
        .filter(|(c, _)| c.exact.is_none())
        .map(|(c, _)| KeyPart { descriptor: Some(c.key.clone()), ..KeyPart::default() })
        .collect();
    let base = label(limit.name.as_deref().unwrap_or(&at), 56);
    let mut name = base.clone();
    let mut n = 2;
    while existing.iter().any(|r| r.name == name) {
        name = format!("{base}-{n}");
        n += 1;
    }
    Ok(PolicyRule {
        name,
        matches: Some(Match { descriptor: path.iter().map(|(c, _)| c.clone()).collect(), ..Match::default() }),
        key,
        algorithm,
        limit: LimitSpec { requests, per: per.to_string(), burst: None, max_delay: None },
        cost: 1,
        mode: if node.shadow_mode { Mode::Shadow } else { Mode::Enforce },
        on_store_failure: Default::default(),
        refusal: None,
        retry_after_jitter: None,
        response_cost: None,
        consistency: None,
        stale_if_limited: None,
        defer_if_limited: None,
    })
}

/// `text` as a DNS label of at most `max` characters: lowercase alphanumerics, runs of anything
/// else as one '-'.
fn label(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let trimmed: String = out.trim_matches('-').chars().take(max).collect();
    let trimmed = trimmed.trim_end_matches('-');
    if trimmed.is_empty() { "descriptor".to_string() } else { trimmed.to_string() }
}

/// The policies as a multi-document YAML stream, headed by the notes.
pub fn to_yaml(converted: &Converted) -> Result<String, ConvertError> {
    let mut out = String::from("# Converted by `sluice convert envoy-ratelimit`.\n");
    for note in &converted.notes {
        out.push_str(&format!("# note: {note}\n"));
    }
    for policy in &converted.policies {
        let yaml = serde_yaml::to_string(policy).map_err(|e| ConvertError(e.to_string()))?;
        out.push_str("---\n");
        out.push_str(&yaml);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_dns_labels() {
        assert_eq!(label("remote_address / path=/foo*", 56), "remote-address-path-foo");
        assert_eq!(label("__", 56), "descriptor");
        assert_eq!(label(&"a".repeat(80), 56).len(), 56);
    }

    #[test]
    fn siblings_give_way_to_the_more_specific() {
        let yaml = r#"
domain: edge
descriptors:
  - {key: k, value: vip, rate_limit: {unlimited: true}}
  - {key: k, value: "team-*", rate_limit: {unit: second, requests_per_unit: 5}}
  - {key: k, value: "team-a*", rate_limit: {unit: second, requests_per_unit: 7}}
  - {key: k, rate_limit: {unit: minute, requests_per_unit: 10}}
"#;
        let converted = envoy_ratelimit(yaml, None, Algorithm::FixedWindow).unwrap();
        let rules = &converted.policies[0].spec.rules;
        assert_eq!(rules.len(), 3, "unlimited gets no rule");
        let entry = |i: usize| rules[i].matches.as_ref().unwrap().descriptor[0].clone();
        assert_eq!((entry(0).prefix.as_deref(), entry(0).not_prefix.len()), (Some("team-"), 0));
        assert_eq!(entry(1).not_prefix, ["team-"], "the earlier wildcard wins");
        assert_eq!(
            (entry(2).not_in.clone(), entry(2).not_prefix.clone()),
            (vec!["vip".to_string()], vec!["team-".to_string(), "team-a".to_string()])
        );
        assert_eq!(rules[2].key.len(), 1);
    }
}
