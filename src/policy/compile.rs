//! From policies to an immutable [`Snapshot`]: each policy checked and compiled in one pass
//! (rules ready to match, limits parsed, regexes compiled and identities hashed once), the
//! invalid ones left out with every problem named.

use std::collections::HashMap;
use std::ops::Range;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::crd::{
    KeyPart, MAX_DESCRIPTOR_ENTRIES, MAX_KEY_PARTS, MAX_MATCH_ITEMS, MAX_PRIORITIES, MAX_RULES, Match, PolicyRule,
    RateLimitPolicy,
};
use super::errors::ValidationErrors;
use super::pattern::PolicyRegex as Regex;
use super::snapshot::{
    CompiledPolicy, CompiledRule, DeclaredRefusal, DescriptorEntryMatcher, HeaderMatcher, HeaderTest, HostMatcher,
    KeySource, NamespaceIndex, PathMatcher, RuleMatch, Selector, SelectorOp, Snapshot, WRITE_METHODS, header_names_of,
    rule_id, version_of,
};
use super::validate::{
    RegexBudget, build_limit, check_descriptor_entry, check_descriptor_keys, check_header_match, check_host_pattern,
    check_key_part, check_overload, check_path_match, check_refusal, check_rule_name,
};
use crate::algorithm::MAX_REQUESTS;
use crate::duration::parse_duration;
use crate::request::names::{canonical_header_name, is_token};

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
    refuse_egress_conflicts(&mut compiled, &mut rejected);
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

    let serves_stale = policies.iter().flat_map(|p| &p.rules).any(|r| r.stale.is_some());
    let defers = policies.iter().flat_map(|p| &p.rules).any(|r| r.defer.is_some());
    Compiled {
        snapshot: Snapshot { version, policies, by_namespace, header_names, sources, serves_stale, defers },
        rejected,
    }
}

/// One destination, one budget: a policy giving a destination of its namespace another limit
/// than a policy before it (by name) already did is refused, naming that policy. (The webhook
/// refuses such a policy before it is stored: [`egress_conflicts`].)
fn refuse_egress_conflicts(compiled: &mut Vec<(CompiledPolicy, RateLimitPolicy)>, rejected: &mut Vec<Rejected>) {
    let mut i = 0;
    while i < compiled.len() {
        let (before, rest) = compiled.split_at(i);
        let errors = egress_conflicts(&rest[0].0, before.iter().map(|(p, _)| p));
        if errors.is_empty() {
            i += 1;
        } else {
            let (policy, _) = compiled.remove(i);
            rejected.push(Rejected { policy: policy.qualified, errors });
        }
    }
}

/// The entries of `policy`'s `spec.egress` that give a destination another limit than one of
/// `others` (of any namespace: only the same namespace's count) already gives it.
pub fn egress_conflicts<'a>(
    policy: &CompiledPolicy,
    others: impl Iterator<Item = &'a CompiledPolicy> + Clone,
) -> ValidationErrors {
    let mut errs = ValidationErrors::default();
    for (i, entry) in policy.egress.iter().enumerate() {
        let first = others
            .clone()
            .filter(|o| o.namespace == policy.namespace && o.qualified != policy.qualified)
            .flat_map(|o| o.egress.iter().map(move |e| (o, e)))
            .find(|(_, e)| e.key == entry.key);
        if let Some((other, earlier)) = first
            && let Some(message) = super::egress::conflict(earlier, &other.qualified, entry)
        {
            errs.push(format!("spec.egress[{i}].destination"), message);
        }
    }
    errs
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

/// Checks a policy and reports every problem with its field path: the walk [`compile`] makes,
/// its result dropped. The admission webhook and `sluice validate` call this, so they accept
/// exactly what compile accepts.
pub fn validate(policy: &RateLimitPolicy) -> Result<(), ValidationErrors> {
    compile_policy(policy).map(drop)
}

/// The one pass over a policy: each field is checked (the checks live in `validate.rs`) and built
/// into its compiled form in the same step, in the order the fields are written, so every problem
/// is reported at once and nothing is checked twice.
fn compile_policy(policy: &RateLimitPolicy) -> Result<CompiledPolicy, ValidationErrors> {
    let mut errs = ValidationErrors::default();
    match policy.metadata.name.as_deref() {
        None | Some("") => errs.push("metadata.name", "required"),
        Some(_) => {}
    }
    let namespace = policy.metadata.namespace.clone().unwrap_or_else(|| super::DEFAULT_NAMESPACE.to_string());
    let name = policy.metadata.name.clone().unwrap_or_default();
    let qualified = format!("{namespace}/{name}");
    let spec = &policy.spec;
    let selector = spec.selector.as_ref().map(|s| selector_of(s, &mut errs)).unwrap_or_default();
    if spec.rules.is_empty() && spec.overload.is_none() && spec.egress.is_empty() {
        errs.push("spec.rules", "at least one rule is required (or spec.overload, or spec.egress)");
    }
    if spec.rules.len() > MAX_RULES {
        errs.push("spec.rules", format!("at most {MAX_RULES} rules, got {}", spec.rules.len()));
    }
    let mut budget = RegexBudget::default();
    let mut rules = Vec::with_capacity(spec.rules.len());
    for (i, rule) in spec.rules.iter().enumerate() {
        let path = format!("spec.rules[{i}]");
        rules.extend(compile_rule(rule, &namespace, &name, &path, &mut budget, &mut errs));
        if let Some(first) = spec.rules[..i].iter().position(|r| r.name == rule.name) {
            errs.push(
                format!("{path}.name"),
                format!("duplicate rule name {:?} (also spec.rules[{first}])", rule.name),
            );
        }
    }
    if spec.priorities.len() > MAX_PRIORITIES {
        errs.push("spec.priorities", format!("at most {MAX_PRIORITIES} entries, got {}", spec.priorities.len()));
    }
    let mut priorities = Vec::with_capacity(spec.priorities.len());
    for (i, entry) in spec.priorities.iter().enumerate() {
        let path = format!("spec.priorities[{i}].match");
        if !entry.matches.descriptor.is_empty() {
            errs.push(format!("{path}.descriptor"), "a priority matches HTTP requests: descriptor has no place here");
        }
        priorities.push((entry.class, compile_match(&entry.matches, &path, &mut budget, &mut errs)));
    }
    let mut exempt = Vec::new();
    if let Some(overload) = &spec.overload {
        if overload.exempt.len() > MAX_PRIORITIES {
            errs.push(
                "spec.overload.exempt",
                format!("at most {MAX_PRIORITIES} entries, got {}", overload.exempt.len()),
            );
        }
        for (i, m) in overload.exempt.iter().enumerate() {
            let path = format!("spec.overload.exempt[{i}]");
            if !m.descriptor.is_empty() {
                errs.push(
                    format!("{path}.descriptor"),
                    "the overload protection sees HTTP requests: descriptor has no place here",
                );
            }
            exempt.push(compile_match(m, &path, &mut budget, &mut errs));
        }
        check_overload(overload, &mut errs);
    }
    if spec.egress.len() > super::crd::MAX_EGRESS {
        errs.push("spec.egress", format!("at most {} entries, got {}", super::crd::MAX_EGRESS, spec.egress.len()));
    }
    let mut egress = Vec::with_capacity(spec.egress.len());
    for (i, entry) in spec.egress.iter().enumerate() {
        let path = format!("spec.egress[{i}]");
        egress.extend(super::egress::compile(entry, &namespace, &name, &path, &mut errs));
        if let Some(first) = spec.egress[..i].iter().position(|e| e.name == entry.name) {
            errs.push(
                format!("{path}.name"),
                format!("duplicate egress name {:?} (also spec.egress[{first}])", entry.name),
            );
        }
        if let Some(first) = spec.egress[..i].iter().position(|e| e.listen_port == entry.listen_port) {
            errs.push(
                format!("{path}.listenPort"),
                format!("port {} is also spec.egress[{first}]'s", entry.listen_port),
            );
        }
    }
    budget.check(&mut errs);
    if !errs.is_empty() {
        return Err(errs);
    }
    // The hash covers what the policy says, not bookkeeping such as resourceVersion, so a re-list
    // of unchanged objects yields the same version.
    let canonical = serde_json::to_string(&policy.spec).unwrap_or_default();
    let overload = policy.spec.overload.clone();
    Ok(CompiledPolicy { namespace, name, qualified, selector, rules, priorities, overload, exempt, canonical, egress })
}

/// The label selector, its expressions checked and their operators read.
fn selector_of(selector: &LabelSelector, errs: &mut ValidationErrors) -> Selector {
    let mut compiled = Selector {
        labels: selector.match_labels.iter().flatten().map(|(k, v)| (k.clone(), v.clone())).collect(),
        ..Selector::default()
    };
    for (j, e) in selector.match_expressions.iter().flatten().enumerate() {
        let path = format!("spec.selector.matchExpressions[{j}]");
        let values = e.values.as_deref().unwrap_or_default();
        let op = match e.operator.as_str() {
            "In" => Some(SelectorOp::In),
            "NotIn" => Some(SelectorOp::NotIn),
            "Exists" => Some(SelectorOp::Exists),
            "DoesNotExist" => Some(SelectorOp::DoesNotExist),
            other => {
                errs.push(
                    format!("{path}.operator"),
                    format!("unknown operator {other:?}; expected In, NotIn, Exists or DoesNotExist"),
                );
                None
            }
        };
        match op {
            Some(SelectorOp::In | SelectorOp::NotIn) if values.is_empty() => {
                errs.push(format!("{path}.values"), format!("operator {} needs at least one value", e.operator));
            }
            Some(SelectorOp::Exists | SelectorOp::DoesNotExist) if !values.is_empty() => {
                errs.push(format!("{path}.values"), format!("operator {} takes no values", e.operator));
            }
            _ => {}
        }
        if e.key.is_empty() {
            errs.push(format!("{path}.key"), "required");
        }
        if let Some(op) = op {
            compiled.expressions.push((e.key.clone(), op, values.to_vec()));
        }
    }
    if compiled.labels.iter().any(|(key, _)| key.is_empty()) {
        errs.push("spec.selector.matchLabels", "label keys must not be empty");
    }
    compiled
}

/// A rule checked and compiled; `None` when its limit could not be built (the reasons are in
/// `errs`, which also holds any other problem of the rule).
fn compile_rule(
    rule: &PolicyRule,
    namespace: &str,
    policy: &str,
    path: &str,
    budget: &mut RegexBudget,
    errs: &mut ValidationErrors,
) -> Option<CompiledRule> {
    if let Err(m) = check_rule_name(&rule.name) {
        errs.push(format!("{path}.name"), m);
    }
    let matcher = match &rule.matches {
        Some(m) => compile_match(m, &format!("{path}.match"), budget, errs),
        None => RuleMatch::default(),
    };
    if rule.key.len() > MAX_KEY_PARTS {
        errs.push(format!("{path}.key"), format!("at most {MAX_KEY_PARTS} parts, got {}", rule.key.len()));
    }
    for (j, part) in rule.key.iter().enumerate() {
        check_key_part(part, &format!("{path}.key[{j}]"), errs);
    }
    check_descriptor_keys(rule, path, errs);
    let mut limit = build_limit(rule.algorithm, &rule.limit, &format!("{path}.limit"), errs);
    let mut response_cost = None;
    if let Some(spec) = &rule.response_cost {
        if let Some((reserving, cost)) =
            super::response_cost::compile(spec, limit.as_ref(), &format!("{path}.responseCost"), errs)
        {
            limit = Some(reserving);
            response_cost = Some(std::sync::Arc::new(cost));
        }
        if rule.cost != 1 {
            errs.push(format!("{path}.cost"), "responseCost replaces cost: remove cost".to_string());
        }
    }
    // A request's cost is held to the limit's capacity as written, before any lease terms.
    let capacity = limit.as_ref().map(|l| l.capacity());
    let mut leasing = None;
    if let Some(spec) = &rule.consistency
        && let Some((leased, terms)) =
            super::consistency::compile(spec, limit.as_ref(), &format!("{path}.consistency"), errs)
    {
        limit = Some(leased);
        leasing = Some(terms);
    }
    if let Some(capacity) = capacity
        && rule.cost > capacity
    {
        let what = if rule.algorithm.uses_burst() { "burst" } else { "requests" };
        errs.push(
            format!("{path}.cost"),
            format!("cost {} exceeds limit.{what} {capacity}: such a request could never be admitted", rule.cost),
        );
    }
    if rule.cost > MAX_REQUESTS {
        errs.push(format!("{path}.cost"), format!("must be at most {MAX_REQUESTS}"));
    }
    if let Some(refusal) = &rule.refusal {
        check_refusal(refusal, &format!("{path}.refusal"), errs);
    }
    let retry_after_jitter = match rule.retry_after_jitter.as_deref().map(parse_duration) {
        None => 0,
        Some(Ok(jitter)) => jitter,
        Some(Err(e)) => {
            errs.push(format!("{path}.retryAfterJitter"), e.to_string());
            0
        }
    };
    if rule.algorithm.holds() {
        if rule.cost != 1 {
            errs.push(
                format!("{path}.cost"),
                "a concurrency rule counts requests in progress, one slot each: cost does not apply".to_string(),
            );
        }
        if rule.matches.as_ref().is_some_and(|m| !m.descriptor.is_empty()) {
            errs.push(
                format!("{path}.match.descriptor"),
                "a concurrency rule needs to learn when each request ends, and descriptors reach Sluice only through the rate limit service, which never says: match on paths, methods and headers (the check API with POST /v1/release)".to_string(),
            );
        }
    }
    let stale = rule.stale_if_limited.as_ref().and_then(|spec| compile_stale(spec, rule, path, errs));
    let defer = rule.defer_if_limited.as_ref().and_then(|spec| compile_defer(spec, rule, path, errs));
    let paths_ignore_case =
        rule.matches.as_ref().is_some_and(|m| m.paths.iter().any(|p| p.ignore_case.unwrap_or(false)));
    let key = rule.key.iter().map(|part| key_source(part, paths_ignore_case)).collect();
    let identity = format!("{namespace}/{policy}/{}", rule.name);
    Some(CompiledRule {
        id: rule_id(&identity),
        identity,
        policy: format!("{namespace}/{policy}").into(),
        name: rule.name.as_str().into(),
        limit: limit?,
        per_text: rule.limit.per.clone(),
        max_delay_text: rule.limit.max_delay.clone(),
        mode: rule.mode,
        on_store_failure: rule.on_store_failure,
        cost: rule.cost,
        matcher,
        key,
        refusal: rule.refusal.as_ref().map(|r| std::sync::Arc::new(DeclaredRefusal::from(r))),
        retry_after_jitter,
        response_cost,
        leasing,
        stale,
        defer,
    })
}

/// `deferIfLimited` checked: bounded bodies, queues and retries, header names that are tokens,
/// and a rule whose refusals can be replayed: an HTTP rule matching writes, enforcing, neither
/// holding capacity (a concurrency slot ends with a response a replay has no client for) nor
/// charging by the response.
fn compile_defer(
    spec: &super::crd::DeferIfLimitedSpec,
    rule: &PolicyRule,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<std::sync::Arc<super::snapshot::Defer>> {
    let at = format!("{path}.deferIfLimited");
    let errors_before = errs.errors.len();
    let bounded = |errs: &mut ValidationErrors, field: &str, value: u64, max: u64| {
        if value == 0 || value > max {
            errs.push(format!("{at}.{field}"), format!("must be 1 to {max}"));
        }
        value
    };
    let max_body_bytes = bounded(errs, "maxBodyBytes", spec.max_body_bytes.unwrap_or(64 * 1024), 1 << 20);
    let max_queued = bounded(errs, "maxQueued", spec.max_queued.unwrap_or(100), 100_000);
    let max_queued_bytes = bounded(errs, "maxQueuedBytes", spec.max_queued_bytes.unwrap_or(1 << 20), 64 << 20);
    let max_attempts = bounded(errs, "maxAttempts", spec.max_attempts.unwrap_or(5).into(), 100);
    let mut duration = |field: &str,
                        text: Option<&str>,
                        default: crate::duration::Micros,
                        range: std::ops::RangeInclusive<crate::duration::Micros>,
                        words: &str| {
        match text.map(parse_duration) {
            None => default,
            Some(Ok(d)) if range.contains(&d) => d,
            Some(Ok(_)) => {
                errs.push(format!("{at}.{field}"), format!("must be from {words}"));
                default
            }
            Some(Err(e)) => {
                errs.push(format!("{at}.{field}"), e.to_string());
                default
            }
        }
    };
    let retry_interval =
        duration("retryInterval", spec.retry_interval.as_deref(), 5_000_000, 1_000_000..=3_600_000_000, "1s to 1h");
    let keep_status =
        duration("keepStatus", spec.keep_status.as_deref(), 3_600_000_000, 60_000_000..=604_800_000_000, "1m to 7d");
    let mut headers = vec!["content-type".to_string()];
    if spec.headers.len() > 16 {
        errs.push(format!("{at}.headers"), "at most 16 headers");
    }
    for (i, name) in spec.headers.iter().enumerate() {
        if !crate::request::names::is_token(name) || name.len() > super::crd::MAX_HEADER_NAME_LEN {
            errs.push(format!("{at}.headers[{i}]"), format!("invalid header name {name:?}"));
        } else if name.to_ascii_lowercase().starts_with("sluice-") {
            errs.push(format!("{at}.headers[{i}]"), format!("{name}: the sidecar's own headers are never kept"));
        } else if crate::request::names::HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
            || name.eq_ignore_ascii_case("host")
            || name.eq_ignore_ascii_case("content-length")
        {
            errs.push(format!("{at}.headers[{i}]"), format!("{name} describes a connection, not the request"));
        } else if !headers.iter().any(|h| h.eq_ignore_ascii_case(name)) {
            headers.push(name.to_ascii_lowercase());
        }
    }
    let idempotency_header = spec.idempotency_header.as_ref().map(|name| {
        if !crate::request::names::is_token(name) || name.len() > super::crd::MAX_HEADER_NAME_LEN {
            errs.push(format!("{at}.idempotencyHeader"), format!("invalid header name {name:?}"));
        }
        name.to_ascii_lowercase()
    });
    if let Some(m) = &rule.matches {
        if !m.descriptor.is_empty() {
            errs.push(at.clone(), "replays HTTP requests: a rule matching descriptors has none");
        }
        if !m.methods.is_empty() && !m.methods.iter().any(|x| WRITE_METHODS.iter().any(|w| x.eq_ignore_ascii_case(w))) {
            errs.push(at.clone(), "queues writes: match.methods has none of POST, PUT, PATCH or DELETE");
        }
    }
    if rule.algorithm.holds() {
        errs.push(
            at.clone(),
            "a concurrency slot ends with a response, and a replay has no client to answer: remove one of them",
        );
    }
    if rule.response_cost.is_some() {
        errs.push(at.clone(), "a cost known after the response cannot be checked before a replay: remove one of them");
    }
    if rule.mode == super::crd::Mode::Shadow {
        errs.push(at.clone(), "a shadow rule never refuses, so nothing would be deferred");
    }
    if errs.errors.len() > errors_before {
        return None;
    }
    Some(std::sync::Arc::new(super::snapshot::Defer {
        max_body_bytes: usize::try_from(max_body_bytes).ok()?,
        headers,
        idempotency_header,
        max_queued,
        max_queued_bytes,
        max_attempts: u32::try_from(max_attempts).ok()?,
        retry_interval,
        keep_status,
    }))
}

/// The largest body `staleIfLimited` may keep per response.
const MAX_STALE_ENTRY_BYTES: u64 = 8 << 20;

/// `staleIfLimited` checked: a duration from 1s to 1d, a bounded entry, and a rule that can
/// match reads of HTTP requests.
fn compile_stale(
    spec: &super::crd::StaleIfLimitedSpec,
    rule: &PolicyRule,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<super::snapshot::Stale> {
    let at = format!("{path}.staleIfLimited");
    let max_stale = match parse_duration(&spec.max_stale) {
        Ok(d) if (1_000_000..=86_400_000_000).contains(&d) => Some(d),
        Ok(_) => {
            errs.push(format!("{at}.maxStale"), "must be from 1s to 1d");
            None
        }
        Err(e) => {
            errs.push(format!("{at}.maxStale"), e.to_string());
            None
        }
    };
    let max_entry_bytes = spec.max_entry_bytes.unwrap_or(256 * 1024);
    if max_entry_bytes == 0 || max_entry_bytes > MAX_STALE_ENTRY_BYTES {
        errs.push(format!("{at}.maxEntryBytes"), format!("must be 1 to {MAX_STALE_ENTRY_BYTES}"));
    }
    if let Some(m) = &rule.matches {
        if !m.descriptor.is_empty() {
            errs.push(at.clone(), "serves kept HTTP responses: a rule matching descriptors has none");
        }
        if !m.methods.is_empty()
            && !m.methods.iter().any(|x| x.eq_ignore_ascii_case("GET") || x.eq_ignore_ascii_case("HEAD"))
        {
            errs.push(at.clone(), "serves reads: match.methods has neither GET nor HEAD");
        }
    }
    if rule.response_cost.is_some() {
        errs.push(at.clone(), "a cost known after the response is charged by the response served: remove one of them");
    }
    let revalidate_every = match spec.revalidate_every.as_deref().map(parse_duration) {
        None => Ok(None),
        Some(Ok(d)) if (1_000_000..=3_600_000_000).contains(&d) => Ok(Some(d)),
        Some(Ok(_)) => Err("must be from 1s to 1h".to_string()),
        Some(Err(e)) => Err(e.to_string()),
    };
    let revalidate_every = revalidate_every.map_err(|e| errs.push(format!("{at}.revalidateEvery"), e)).ok()?;
    Some(super::snapshot::Stale {
        max_stale: max_stale?,
        max_entry_bytes: usize::try_from(max_entry_bytes).ok()?,
        revalidate_every,
    })
}

/// A value test of a header or descriptor entry condition: exact, prefix, its regex, or
/// `otherwise` when none is written; `None` when its regex did not compile.
fn value_test(
    exact: &Option<String>,
    prefix: &Option<String>,
    pattern: &Option<String>,
    regex: Option<Regex>,
    otherwise: HeaderTest,
) -> Option<HeaderTest> {
    match (exact, prefix, pattern) {
        (Some(v), _, _) => Some(HeaderTest::Exact(v.clone())),
        (_, Some(v), _) => Some(HeaderTest::Prefix(v.clone())),
        (_, _, Some(_)) => regex.map(HeaderTest::Regex),
        _ => Some(otherwise),
    }
}

/// A `match` (of a rule at `path`, a priority entry or an overload exemption), checked and
/// compiled, each regex compiled once.
fn compile_match(m: &Match, path: &str, budget: &mut RegexBudget, errs: &mut ValidationErrors) -> RuleMatch {
    let mut matcher = RuleMatch::default();
    for (field, len) in
        [("methods", m.methods.len()), ("paths", m.paths.len()), ("hosts", m.hosts.len()), ("headers", m.headers.len())]
    {
        if len > MAX_MATCH_ITEMS {
            errs.push(format!("{path}.{field}"), format!("at most {MAX_MATCH_ITEMS} entries, got {len}"));
        }
    }
    if !m.descriptor.is_empty() {
        if m.descriptor.len() > MAX_DESCRIPTOR_ENTRIES {
            errs.push(
                format!("{path}.descriptor"),
                format!("at most {MAX_DESCRIPTOR_ENTRIES} entries, got {}", m.descriptor.len()),
            );
        }
        if !(m.methods.is_empty() && m.paths.is_empty() && m.hosts.is_empty() && m.headers.is_empty()) {
            errs.push(
                format!("{path}.descriptor"),
                "cannot be combined with methods, paths, hosts or headers: a descriptor carries no HTTP request",
            );
        }
        for (j, entry) in m.descriptor.iter().enumerate() {
            let regex = check_descriptor_entry(entry, &format!("{path}.descriptor[{j}]"), budget, errs);
            let any = HeaderTest::Present(true);
            if let Some(test) = value_test(&entry.exact, &entry.prefix, &entry.regex, regex, any) {
                matcher.descriptor.push(DescriptorEntryMatcher {
                    key: entry.key.clone(),
                    test,
                    not_in: entry.not_in.clone(),
                    not_prefix: entry.not_prefix.clone(),
                });
            }
        }
    }
    for (j, method) in m.methods.iter().enumerate() {
        if !is_token(method) {
            errs.push(format!("{path}.methods[{j}]"), format!("invalid HTTP method {method:?}"));
        }
        matcher.methods.push(method.to_ascii_uppercase());
    }
    for (j, p) in m.paths.iter().enumerate() {
        let regex = check_path_match(p, &format!("{path}.paths[{j}]"), budget, errs);
        let ignore_case = p.ignore_case.unwrap_or(false);
        if let Some(exact) = &p.exact {
            matcher.paths.push(PathMatcher::Exact { path: exact.clone(), ignore_case });
        } else if let Some(prefix) = &p.prefix {
            let trimmed = prefix.trim_end_matches('/');
            let prefix = if trimmed.is_empty() { "/".into() } else { trimmed.into() };
            matcher.paths.push(PathMatcher::Prefix { prefix, ignore_case });
        } else if let Some(re) = regex {
            matcher.paths.push(PathMatcher::Regex(re));
        }
    }
    for (j, host) in m.hosts.iter().enumerate() {
        if let Err(msg) = check_host_pattern(host) {
            errs.push(format!("{path}.hosts[{j}]"), msg);
        }
        // Request hosts lose their trailing dot before matching; so do the patterns.
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        matcher.hosts.push(match host.strip_prefix('*') {
            Some(suffix) => HostMatcher::Suffix(suffix.to_string()),
            None => HostMatcher::Exact(host),
        });
    }
    for (j, h) in m.headers.iter().enumerate() {
        let regex = check_header_match(h, &format!("{path}.headers[{j}]"), budget, errs);
        let present = HeaderTest::Present(h.present.unwrap_or(true));
        if let Some(test) = value_test(&h.exact, &h.prefix, &h.regex, regex, present) {
            matcher.headers.push(HeaderMatcher { name: canonical_header_name(&h.name), test });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(extra: &str) -> Result<(), String> {
        let yaml = format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: p, namespace: ns}}\nspec:\n  rules:\n  - name: r\n    algorithm: tokenBucket\n    limit: {{requests: 5, per: 1s}}\n{extra}"
        );
        let policy: RateLimitPolicy = serde_yaml::from_str(&yaml).expect("parses");
        validate(&policy).map_err(|e| e.to_string())
    }

    #[test]
    fn defer_if_limited_is_checked_by_field() {
        assert_eq!(rule("    deferIfLimited: {}\n"), Ok(()));
        assert_eq!(
            rule(
                "    deferIfLimited: {headers: [x-request-id], idempotencyHeader: Idempotency-Key, retryInterval: 2s, keepStatus: 1d}\n"
            ),
            Ok(())
        );
        let cases = [
            (
                "    deferIfLimited: {maxBodyBytes: 0}\n",
                "spec.rules[0].deferIfLimited.maxBodyBytes: must be 1 to 1048576",
            ),
            ("    deferIfLimited: {maxBodyBytes: 2000000}\n", "spec.rules[0].deferIfLimited.maxBodyBytes"),
            ("    deferIfLimited: {maxQueued: 0}\n", "spec.rules[0].deferIfLimited.maxQueued"),
            ("    deferIfLimited: {maxAttempts: 101}\n", "spec.rules[0].deferIfLimited.maxAttempts"),
            (
                "    deferIfLimited: {retryInterval: 10ms}\n",
                "spec.rules[0].deferIfLimited.retryInterval: must be from 1s to 1h",
            ),
            ("    deferIfLimited: {keepStatus: 30s}\n", "spec.rules[0].deferIfLimited.keepStatus"),
            (
                "    deferIfLimited: {headers: [\"bad name\"]}\n",
                "spec.rules[0].deferIfLimited.headers[0]: invalid header name",
            ),
            ("    deferIfLimited: {headers: [Transfer-Encoding]}\n", "describes a connection"),
            ("    deferIfLimited: {headers: [Sluice-Deferred-Id]}\n", "the sidecar's own headers are never kept"),
            ("    deferIfLimited: {idempotencyHeader: \"a b\"}\n", "spec.rules[0].deferIfLimited.idempotencyHeader"),
            ("    match: {methods: [GET]}\n    deferIfLimited: {}\n", "queues writes: match.methods has none of POST"),
            ("    mode: shadow\n    deferIfLimited: {}\n", "a shadow rule never refuses"),
            ("    match: {descriptor: [{key: k}]}\n    deferIfLimited: {}\n", "a rule matching descriptors has none"),
        ];
        for (extra, wanted) in cases {
            let found = rule(extra).expect_err(extra);
            assert!(found.contains(wanted), "{wanted}: {found}");
        }
    }

    #[test]
    fn stale_if_limited_is_checked_by_field() {
        assert_eq!(rule("    staleIfLimited: {maxStale: 5m}\n"), Ok(()));
        let cases = [
            ("    staleIfLimited: {maxStale: 10ms}\n", "spec.rules[0].staleIfLimited.maxStale"),
            ("    staleIfLimited: {maxStale: 2d}\n", "spec.rules[0].staleIfLimited.maxStale"),
            ("    staleIfLimited: {maxStale: 1m, maxEntryBytes: 0}\n", "spec.rules[0].staleIfLimited.maxEntryBytes"),
            (
                "    staleIfLimited: {maxStale: 1m, revalidateEvery: 2h}\n",
                "spec.rules[0].staleIfLimited.revalidateEvery: must be from 1s to 1h",
            ),
            (
                "    staleIfLimited: {maxStale: 1m, revalidateEvery: soon}\n",
                "spec.rules[0].staleIfLimited.revalidateEvery",
            ),
            (
                "    match: {methods: [POST]}\n    staleIfLimited: {maxStale: 1m}\n",
                "match.methods has neither GET nor HEAD",
            ),
            (
                "    match: {descriptor: [{key: k}]}\n    staleIfLimited: {maxStale: 1m}\n",
                "a rule matching descriptors has none",
            ),
        ];
        for (extra, wanted) in cases {
            let found = rule(extra).expect_err(extra);
            assert!(found.contains(wanted), "{wanted}: {found}");
        }
    }
}
