//! From validated policies to an immutable [`Snapshot`]: rules ready to match, with their
//! limits parsed, regexes compiled and identities hashed once.

use std::collections::HashMap;
use std::ops::Range;

use super::crd::{KeyPart, Match, PolicyRule, RateLimitPolicy};
use super::errors::ValidationErrors;
use super::snapshot::{
    CompiledPolicy, CompiledRule, DeclaredRefusal, DescriptorEntryMatcher, HeaderMatcher, HeaderTest, HostMatcher,
    KeySource, NamespaceIndex, PathMatcher, RuleMatch, Selector, SelectorOp, Snapshot, header_names_of, rule_id,
    version_of,
};
use super::validate::{CompiledRegexes, build_limit, compile_regex, validate_keeping_regexes};
use crate::duration::parse_duration;
use crate::request::names::canonical_header_name;

/// The result of compiling a set of policies: the valid ones, and why the others were left out.
#[derive(Debug)]
pub struct Compiled {
    pub snapshot: Snapshot,
    pub rejected: Vec<Rejected>,
}

/// A policy excluded from the snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// `namespace/name`.
    pub policy: String,
    pub errors: ValidationErrors,
}

/// Validates and compiles every policy; invalid ones are left out and reported.
///
/// When two policies share a namespace and name (impossible in a cluster; `load` refuses it for
/// files) the first in input order is kept and the others are rejected.
pub fn compile(policies: Vec<RateLimitPolicy>) -> Compiled {
    let mut rejected = Vec::new();
    let mut compiled: Vec<(CompiledPolicy, RateLimitPolicy)> = Vec::new();
    for policy in policies {
        let qualified = policy.qualified_name();
        if compiled.iter().any(|(p, _)| p.qualified == qualified) {
            rejected.push(Rejected {
                policy: qualified.clone(),
                errors: single_error("metadata.name", format!("duplicate policy {qualified}")),
            });
            continue;
        }
        match compile_policy(&policy) {
            Ok(c) => compiled.push((c, source_of(&policy))),
            Err(errors) => rejected.push(Rejected { policy: qualified, errors }),
        }
    }
    compiled.sort_by(|(a, _), (b, _)| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let version = version_of(compiled.iter().map(|(p, _)| p));

    let (policies, sources): (Vec<CompiledPolicy>, Vec<RateLimitPolicy>) = compiled.into_iter().unzip();
    let mut ranges: HashMap<String, Range<usize>> = HashMap::new();
    for (i, p) in policies.iter().enumerate() {
        ranges.entry(p.namespace.clone()).and_modify(|r| r.end = i + 1).or_insert(i..i + 1);
    }
    let by_namespace = ranges
        .into_iter()
        .map(|(ns, range)| {
            let header_names = header_names_of(&policies[range.clone()]);
            (ns, NamespaceIndex { range, header_names })
        })
        .collect();
    let header_names = header_names_of(&policies);
    rejected.sort_by(|a, b| a.policy.cmp(&b.policy));

    Compiled { snapshot: Snapshot { version, policies, by_namespace, header_names, sources }, rejected }
}

/// The policy as compiled: name, namespace and spec, without status or server bookkeeping, so a
/// sidecar can rebuild the same snapshot from `/v1/snapshot`.
fn source_of(policy: &RateLimitPolicy) -> RateLimitPolicy {
    let mut source = RateLimitPolicy::new(&policy.metadata.name.clone().unwrap_or_default(), policy.spec.clone());
    source.metadata.namespace =
        Some(policy.metadata.namespace.clone().unwrap_or_else(|| super::DEFAULT_NAMESPACE.to_string()));
    source
}

fn single_error(path: &str, message: String) -> ValidationErrors {
    let mut e = ValidationErrors::default();
    e.errors.push(super::errors::FieldError { path: path.to_string(), message });
    e
}

fn compile_policy(policy: &RateLimitPolicy) -> Result<CompiledPolicy, ValidationErrors> {
    let mut regexes = validate_keeping_regexes(policy)?;
    let namespace = policy.metadata.namespace.clone().unwrap_or_else(|| super::DEFAULT_NAMESPACE.to_string());
    let name = policy.metadata.name.clone().unwrap_or_default();
    let qualified = format!("{namespace}/{name}");
    let mut selector = Selector::default();
    if let Some(s) = &policy.spec.selector {
        selector.labels = s.match_labels.iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect();
        for e in s.match_expressions.iter().flatten() {
            let op = match e.operator.as_str() {
                "In" => SelectorOp::In,
                "NotIn" => SelectorOp::NotIn,
                "Exists" => SelectorOp::Exists,
                "DoesNotExist" => SelectorOp::DoesNotExist,
                // validate() refuses every other operator; should the two ever disagree, refuse
                // the policy rather than guess what the selector meant.
                other => {
                    return Err(single_error(
                        "spec.selector.matchExpressions",
                        format!("unknown operator {other:?}; expected In, NotIn, Exists or DoesNotExist"),
                    ));
                }
            };
            selector.expressions.push((e.key.clone(), op, e.values.clone().unwrap_or_default()));
        }
    }
    let mut rules = Vec::with_capacity(policy.spec.rules.len());
    for (i, rule) in policy.spec.rules.iter().enumerate() {
        rules.push(compile_rule(rule, &namespace, &name, &format!("spec.rules[{i}]"), &mut regexes)?);
    }
    let mut priorities = Vec::with_capacity(policy.spec.priorities.len());
    let mut errs = ValidationErrors::default();
    for (i, entry) in policy.spec.priorities.iter().enumerate() {
        let matcher = compile_match(&entry.matches, &format!("spec.priorities[{i}].match"), &mut regexes, &mut errs);
        priorities.push((entry.class, matcher));
    }
    let mut exempt = Vec::new();
    for (i, m) in policy.spec.overload.iter().flat_map(|o| o.exempt.iter()).enumerate() {
        exempt.push(compile_match(m, &format!("spec.overload.exempt[{i}]"), &mut regexes, &mut errs));
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    // The hash covers what the policy says, not bookkeeping such as resourceVersion, so a re-list
    // of unchanged objects yields the same version.
    let canonical = serde_json::to_string(&policy.spec).unwrap_or_default();
    debug_assert!(regexes.is_empty(), "validation and compile name regexes differently: {:?}", regexes.keys());
    let overload = policy.spec.overload.clone();
    Ok(CompiledPolicy { namespace, name, qualified, selector, rules, priorities, overload, exempt, canonical })
}

fn compile_rule(
    rule: &PolicyRule,
    namespace: &str,
    policy: &str,
    path: &str,
    validated: &mut CompiledRegexes,
) -> Result<CompiledRule, ValidationErrors> {
    let mut errs = ValidationErrors::default();
    // Validation already passed, so these only fail if validate and compile disagree; report
    // rather than panic.
    let mut limit = build_limit(rule.algorithm, &rule.limit, &format!("{path}.limit"), &mut errs);
    let mut response_cost = None;
    if let Some(spec) = &rule.response_cost {
        let compiled = super::response_cost::compile(spec, limit.as_ref(), &format!("{path}.responseCost"), &mut errs);
        if let Some((reserving, cost)) = compiled {
            limit = Some(reserving);
            response_cost = Some(std::sync::Arc::new(cost));
        }
    }
    let mut leasing = None;
    if let Some(spec) = &rule.consistency
        && let Some((leased, terms)) =
            super::consistency::compile(spec, limit.as_ref(), &format!("{path}.consistency"), &mut errs)
    {
        limit = Some(leased);
        leasing = Some(terms);
    }
    let matcher = match &rule.matches {
        Some(m) => compile_match(m, &format!("{path}.match"), validated, &mut errs),
        None => RuleMatch::default(),
    };
    let paths_ignore_case =
        rule.matches.as_ref().is_some_and(|m| m.paths.iter().any(|p| p.ignore_case.unwrap_or(false)));
    let key = rule.key.iter().map(|part| key_source(part, paths_ignore_case)).collect();
    let (Some(limit), true) = (limit, errs.is_empty()) else {
        return Err(errs);
    };
    let identity = format!("{namespace}/{policy}/{}", rule.name);
    Ok(CompiledRule {
        id: rule_id(&identity),
        identity,
        policy: format!("{namespace}/{policy}").into(),
        name: rule.name.as_str().into(),
        limit,
        per_text: rule.limit.per.clone(),
        max_delay_text: rule.limit.max_delay.clone(),
        mode: rule.mode,
        on_store_failure: rule.on_store_failure,
        cost: rule.cost,
        matcher,
        key,
        refusal: rule.refusal.as_ref().map(|r| std::sync::Arc::new(DeclaredRefusal::from(r))),
        retry_after_jitter: rule.retry_after_jitter.as_deref().and_then(|j| parse_duration(j).ok()).unwrap_or(0),
        response_cost,
        leasing,
    })
}

/// A `match` (of a rule at `path`, or of a priority entry), with the regexes validation compiled.
fn compile_match(m: &Match, path: &str, validated: &mut CompiledRegexes, errs: &mut ValidationErrors) -> RuleMatch {
    // Each regex was compiled once by validation; take it from there.
    let mut regex = |pattern: &str, ignore_case: bool, field: String, errs: &mut ValidationErrors| {
        let compiled = match validated.remove(&field) {
            Some(re) => Ok(re),
            None => compile_regex(pattern, ignore_case),
        };
        match compiled {
            Ok(re) => Some(re),
            Err(m) => {
                errs.errors.push(super::errors::FieldError { path: field, message: m });
                None
            }
        }
    };
    let mut matcher = RuleMatch::default();
    {
        matcher.methods = m.methods.iter().map(|s| s.to_ascii_uppercase()).collect();
        for (j, p) in m.paths.iter().enumerate() {
            let ignore_case = p.ignore_case.unwrap_or(false);
            if let Some(exact) = &p.exact {
                matcher.paths.push(PathMatcher::Exact { path: exact.clone(), ignore_case });
            } else if let Some(prefix) = &p.prefix {
                let trimmed = prefix.trim_end_matches('/');
                let prefix = if trimmed.is_empty() { "/".into() } else { trimmed.into() };
                matcher.paths.push(PathMatcher::Prefix { prefix, ignore_case });
            } else if let Some(re) = &p.regex
                && let Some(re) = regex(re, ignore_case, format!("{path}.paths[{j}].regex"), errs)
            {
                matcher.paths.push(PathMatcher::Regex(re));
            }
        }
        for host in &m.hosts {
            // Request hosts lose their trailing dot before matching; so do the patterns.
            let host = host.trim_end_matches('.').to_ascii_lowercase();
            matcher.hosts.push(match host.strip_prefix('*') {
                Some(suffix) => HostMatcher::Suffix(suffix.to_string()),
                None => HostMatcher::Exact(host),
            });
        }
        // A value test from a header or descriptor entry condition: exact, prefix, regex, or
        // `otherwise` when none is written.
        let mut value_test = |exact: &Option<String>,
                              prefix: &Option<String>,
                              pattern: &Option<String>,
                              field: String,
                              otherwise: HeaderTest,
                              errs: &mut ValidationErrors| {
            match (exact, prefix, pattern) {
                (Some(v), _, _) => Some(HeaderTest::Exact(v.clone())),
                (_, Some(v), _) => Some(HeaderTest::Prefix(v.clone())),
                (_, _, Some(v)) => regex(v, false, field, errs).map(HeaderTest::Regex),
                _ => Some(otherwise),
            }
        };
        for (j, h) in m.headers.iter().enumerate() {
            let field = format!("{path}.headers[{j}].regex");
            let present = HeaderTest::Present(h.present.unwrap_or(true));
            let Some(test) = value_test(&h.exact, &h.prefix, &h.regex, field, present, errs) else { continue };
            matcher.headers.push(HeaderMatcher { name: canonical_header_name(&h.name), test });
        }
        for (j, entry) in m.descriptor.iter().enumerate() {
            let field = format!("{path}.descriptor[{j}].regex");
            let any = HeaderTest::Present(true);
            let Some(test) = value_test(&entry.exact, &entry.prefix, &entry.regex, field, any, errs) else {
                continue;
            };
            matcher.descriptor.push(DescriptorEntryMatcher {
                key: entry.key.clone(),
                test,
                not_in: entry.not_in.clone(),
                not_prefix: entry.not_prefix.clone(),
            });
        }
    }
    matcher
}

fn key_source(k: &KeyPart, paths_ignore_case: bool) -> KeySource {
    let missing = k.missing.unwrap_or_default();
    if let Some(name) = &k.header {
        KeySource::Header(canonical_header_name(name), missing)
    } else if k.client_ip.is_some() {
        KeySource::ClientIp(missing)
    } else if k.namespace.is_some() {
        KeySource::Namespace
    } else if k.path.is_some() {
        if paths_ignore_case { KeySource::LowercasePath } else { KeySource::Path }
    } else if k.method.is_some() {
        KeySource::Method
    } else if k.host.is_some() {
        KeySource::Host
    } else if let Some(key) = &k.descriptor {
        KeySource::Descriptor(key.clone())
    } else {
        KeySource::Literal(k.literal.clone().unwrap_or_default())
    }
}

impl Default for Snapshot {
    /// No policies, with the version of the empty set (not an empty string), so "nothing loaded
    /// yet" is a snapshot like any other.
    fn default() -> Self {
        compile(Vec::new()).snapshot
    }
}
