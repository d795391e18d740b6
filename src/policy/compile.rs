//! From validated policies to an immutable [`Snapshot`]: rules ready to match, with their
//! limits parsed, regexes compiled and identities hashed once.

use std::collections::HashMap;
use std::ops::Range;

use super::pattern::PolicyRegex as Regex;
use sha2::{Digest, Sha256};

use super::crd::FailureMode;
use super::crd::{KeyPart, Match, Missing, Mode, OverloadSpec, PolicyRule, RateLimitPolicy, RefusalSpec};
use super::matching::canonical_header_name;
use super::validate::{CompiledRegexes, ValidationErrors, build_limit, compile_regex, validate_keeping_regexes};
use crate::algorithm::{Algorithm, Limit};
use crate::duration::{Micros, parse_duration};
use crate::overload::Class;
use crate::rule::{RuleCheck, RuleId};

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

/// Every rule in force, immutable once built; share it as `Arc<Snapshot>` and swap whole.
#[derive(Debug)]
pub struct Snapshot {
    version: String,
    /// Sorted by (namespace, name), so each namespace is one contiguous range.
    policies: Vec<CompiledPolicy>,
    by_namespace: HashMap<String, NamespaceIndex>,
    header_names: Vec<String>,
    /// The accepted policies themselves, sorted like `policies`.
    sources: Vec<RateLimitPolicy>,
}

/// One namespace's share of a snapshot.
#[derive(Debug)]
struct NamespaceIndex {
    /// Its policies in [`Snapshot::policies`].
    range: Range<usize>,
    /// The headers its rules match or key on, sorted.
    header_names: Vec<String>,
}

#[derive(Debug)]
pub struct CompiledPolicy {
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) qualified: String,
    pub(super) selector: Selector,
    pub(super) rules: Vec<CompiledRule>,
    /// `spec.priorities`: the first entry matching a request gives its class.
    pub(super) priorities: Vec<(Class, RuleMatch)>,
    pub(super) overload: Option<OverloadSpec>,
    /// `spec.overload.exempt`: requests the overload protection leaves alone.
    pub(super) exempt: Vec<RuleMatch>,
    /// The spec as JSON: what the version hashes.
    pub(super) canonical: String,
}

/// One rule, ready to match and to check.
///
/// Its [`RuleId`] hashes only the identity `namespace/policy/rule`, never the numbers, so editing
/// a rule's limit keeps its counters. Changing its algorithm keeps the id too: the store then
/// finds state of another algorithm's shape under the key, and that key starts fresh (a full
/// bucket, an empty window) — once, at the change.
#[derive(Debug)]
pub struct CompiledRule {
    pub(super) id: RuleId,
    pub(super) identity: String,
    /// Shared, so results can name the rule without copying (`namespace/policy`).
    pub(super) policy: std::sync::Arc<str>,
    pub(super) name: std::sync::Arc<str>,
    pub(super) limit: Limit,
    pub(super) per_text: String,
    pub(super) max_delay_text: Option<String>,
    pub(super) mode: Mode,
    pub(super) on_store_failure: FailureMode,
    pub(super) cost: u64,
    pub(super) matcher: RuleMatch,
    pub(super) key: Vec<KeySource>,
    /// `refusal`: what a request this rule refuses gets instead of the default 429.
    pub(super) refusal: Option<std::sync::Arc<DeclaredRefusal>>,
    /// `retryAfterJitter`: the most added at random to `Retry-After` when this rule refuses.
    pub(super) retry_after_jitter: Micros,
    /// `responseCost`: the cost is read from the response; admission reserves an estimate.
    pub(super) response_cost: Option<std::sync::Arc<super::response_cost::ResponseCost>>,
    /// `consistency: leased`: enforcers may decide hot keys from slices of their quota.
    pub(super) leasing: Option<super::consistency::Leasing>,
}

#[derive(Debug, Default)]
pub(super) struct Selector {
    pub(super) labels: Vec<(String, String)>,
    pub(super) expressions: Vec<(String, SelectorOp, Vec<String>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SelectorOp {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Debug, Default)]
pub(super) struct RuleMatch {
    pub(super) methods: Vec<String>,
    pub(super) paths: Vec<PathMatcher>,
    pub(super) hosts: Vec<HostMatcher>,
    pub(super) headers: Vec<HeaderMatcher>,
    /// Non-empty: the rule applies to rate limit descriptors with exactly these entries, and to
    /// nothing else.
    pub(super) descriptor: Vec<DescriptorEntryMatcher>,
}

/// A rule's or the overload protection's declared refusal, ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredRefusal {
    pub status: u16,
    /// Lowercase names, as declared.
    pub headers: Vec<(String, String)>,
    pub body: Option<std::sync::Arc<str>>,
}

impl From<&RefusalSpec> for DeclaredRefusal {
    fn from(spec: &RefusalSpec) -> Self {
        DeclaredRefusal {
            status: spec.status,
            headers: spec.headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())).collect(),
            body: spec.body.as_deref().map(std::sync::Arc::from),
        }
    }
}

#[derive(Debug)]
pub(super) struct DescriptorEntryMatcher {
    pub(super) key: String,
    /// `Present(true)`: any value.
    pub(super) test: HeaderTest,
    pub(super) not_in: Vec<String>,
    pub(super) not_prefix: Vec<String>,
}

#[derive(Debug)]
pub(super) enum PathMatcher {
    /// `ignore_case`: ASCII letters compare in either case.
    Exact { path: String, ignore_case: bool },
    /// Without a trailing '/', except the root, which matches everything.
    Prefix { prefix: String, ignore_case: bool },
    /// Compiled case-insensitively for `ignoreCase`.
    Regex(Regex),
}

#[derive(Debug)]
pub(super) enum HostMatcher {
    /// Lowercase.
    Exact(String),
    /// Lowercase, with the leading dot: `*.example.com` is stored as `.example.com`.
    Suffix(String),
}

#[derive(Debug)]
pub(super) struct HeaderMatcher {
    /// Canonical ([`canonical_header_name`]).
    pub(super) name: String,
    pub(super) test: HeaderTest,
}

#[derive(Debug)]
pub(super) enum HeaderTest {
    Exact(String),
    Prefix(String),
    Regex(Regex),
    Present(bool),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum KeySource {
    /// Canonical name ([`canonical_header_name`]).
    Header(String, Missing),
    ClientIp(Missing),
    Namespace,
    Path,
    /// The path with ASCII letters lowercased: a rule that matches paths ignoring case keys on
    /// them ignoring case too.
    LowercasePath,
    Method,
    Host,
    /// The value of the descriptor entry with this key.
    Descriptor(String),
    Literal(String),
}

impl CompiledRule {
    /// Stable hash of [`Self::identity`].
    pub fn id(&self) -> RuleId {
        self.id
    }
    /// `namespace/policy/rule`: what the id hashes, and a readable name for keys and logs.
    pub fn identity(&self) -> &str {
        &self.identity
    }
    /// `namespace/policy`.
    pub fn policy(&self) -> &str {
        &self.policy
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// [`Self::policy`] and [`Self::name`] as shared strings, for results that outlive a borrow.
    pub fn shared_names(&self) -> (std::sync::Arc<str>, std::sync::Arc<str>) {
        (self.policy.clone(), self.name.clone())
    }
    pub fn limit(&self) -> &Limit {
        &self.limit
    }
    pub fn algorithm(&self) -> Algorithm {
        self.limit.algorithm()
    }
    /// `false` for shadow rules: decided and reported, never refusing.
    pub fn enforce(&self) -> bool {
        self.mode == Mode::Enforce
    }
    pub fn on_store_failure(&self) -> FailureMode {
        self.on_store_failure
    }
    /// What a request this rule refuses gets instead of the default 429 (`refusal`).
    pub fn refusal(&self) -> Option<&std::sync::Arc<DeclaredRefusal>> {
        self.refusal.as_ref()
    }
    /// The most added at random to `Retry-After` when this rule refuses (`retryAfterJitter`).
    /// What `req` counts against this rule: its estimate for a cost known after the response
    /// (a descriptor's cost is what Envoy reports, after the response with apply_on_stream_done);
    /// otherwise the rule's cost × the request's.
    pub fn cost_for(&self, req: &super::RequestView<'_>) -> u64 {
        match (&self.response_cost, req.descriptor) {
            (Some(response_cost), None) => response_cost.estimate(req.fields),
            _ => self.cost.saturating_mul(req.cost),
        }
    }

    /// `responseCost`: how the cost is read from the response, and the estimate reserved.
    pub fn response_cost(&self) -> Option<&std::sync::Arc<super::response_cost::ResponseCost>> {
        self.response_cost.as_ref()
    }
    /// The rule's lease terms, when it is `consistency: leased`.
    pub fn leasing(&self) -> Option<super::consistency::Leasing> {
        self.leasing
    }
    pub fn retry_after_jitter(&self) -> Micros {
        self.retry_after_jitter
    }
    /// The rule's own weight; a request's effective cost is this times the request's cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }
    /// What the store needs to decide this rule for one key.
    pub fn check<'a>(&'a self, key: &'a [u8], cost: u64) -> RuleCheck<'a> {
        RuleCheck { rule: self.id, limit: &self.limit, key, cost, enforce: self.enforce(), hold: 0 }
    }
    /// Human description of the key, e.g. `header x-api-key, clientIP`.
    /// `per` as the policy wrote it (`/v1/snapshot` shows it so).
    pub fn per_text(&self) -> &str {
        &self.per_text
    }
    /// `maxDelay` as the policy wrote it.
    pub fn max_delay_text(&self) -> Option<&str> {
        self.max_delay_text.as_deref()
    }
    pub fn mode(&self) -> Mode {
        self.mode
    }
    pub fn key_description(&self) -> String {
        if self.key.is_empty() {
            return "(one shared counter)".to_string();
        }
        self.key
            .iter()
            .map(|k| match k {
                KeySource::Header(name, Missing::Share) => format!("header {name}"),
                KeySource::Header(name, Missing::Skip) => format!("header {name} (skip if missing)"),
                KeySource::ClientIp(Missing::Share) => "clientIP".to_string(),
                KeySource::ClientIp(Missing::Skip) => "clientIP (skip if missing)".to_string(),
                KeySource::Namespace => "namespace".to_string(),
                KeySource::Path => "path".to_string(),
                KeySource::LowercasePath => "path (lowercased)".to_string(),
                KeySource::Method => "method".to_string(),
                KeySource::Host => "host".to_string(),
                KeySource::Descriptor(key) => format!("descriptor {key}"),
                KeySource::Literal(text) => format!("literal {text:?}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl CompiledPolicy {
    /// `namespace/name`.
    pub fn qualified_name(&self) -> &str {
        &self.qualified
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn rules(&self) -> &[CompiledRule] {
        &self.rules
    }
    /// `spec.overload`, when the policy protects its workloads from overload.
    pub fn overload(&self) -> Option<&OverloadSpec> {
        self.overload.as_ref()
    }
}

/// `RuleId` of `namespace/policy/rule`: the first 8 bytes of its SHA-256, big-endian.
pub fn rule_id(identity: &str) -> RuleId {
    let digest = Sha256::digest(identity.as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(bytes)
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

/// Content hash of compiled policies in (namespace, name) order: 16 hex digits of SHA-256 over
/// each policy's qualified name and spec. The same function names a whole snapshot and the part
/// of it one caller may see, so a sidecar that compiles the sources it was given gets the
/// version it was told.
fn version_of<'a>(policies: impl IntoIterator<Item = &'a CompiledPolicy>) -> String {
    let mut hasher = Sha256::new();
    for p in policies {
        hasher.update(p.qualified.as_bytes());
        hasher.update([0]);
        hasher.update(p.canonical.as_bytes());
        hasher.update([0]);
    }
    let digest = hasher.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Canonical names of every header the policies' rules and priorities match or key on, sorted,
/// once each.
fn header_names_of<'a>(policies: impl IntoIterator<Item = &'a CompiledPolicy>) -> Vec<String> {
    let mut names: Vec<String> = policies
        .into_iter()
        .flat_map(|p| {
            let rules = p.rules.iter().flat_map(|r| {
                let matched = r.matcher.headers.iter().map(|h| h.name.clone());
                let keyed = r.key.iter().filter_map(|k| match k {
                    KeySource::Header(name, _) => Some(name.clone()),
                    _ => None,
                });
                matched.chain(keyed).collect::<Vec<_>>()
            });
            let classified = p.priorities.iter().map(|(_, m)| m).chain(&p.exempt);
            let classified = classified.flat_map(|m| m.headers.iter().map(|h| h.name.clone()));
            rules.chain(classified).collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    names
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
    e.errors.push(super::validate::FieldError { path: path.to_string(), message });
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
                errs.errors.push(super::validate::FieldError { path: field, message: m });
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

impl Snapshot {
    /// The accepted policies (name, namespace, spec) this snapshot was compiled from.
    pub fn sources(&self) -> &[RateLimitPolicy] {
        &self.sources
    }

    /// Content hash: 16 hex digits of SHA-256 over the valid policies, sorted by namespace/name.
    /// The same policies give the same version whatever order they arrived in.
    pub fn version(&self) -> &str {
        &self.version
    }
    /// All compiled policies, sorted by namespace and name.
    pub fn policies(&self) -> &[CompiledPolicy] {
        &self.policies
    }
    /// The policies of one namespace, sorted by name.
    pub fn namespace_policies(&self, namespace: &str) -> &[CompiledPolicy] {
        match self.by_namespace.get(namespace) {
            Some(index) => &self.policies[index.range.clone()],
            None => &[],
        }
    }
    /// The headers the rules of `namespace` match or key on, sorted.
    pub fn namespace_header_names(&self, namespace: &str) -> &[String] {
        self.by_namespace.get(namespace).map_or(&[], |index| &index.header_names)
    }
    /// The part of the snapshot that callers limited to `namespaces` may see (`None`: all).
    pub fn part(&self, namespaces: Option<&[String]>) -> SnapshotPart<'_> {
        let indices = match namespaces {
            None => (0..self.policies.len()).collect(),
            Some(namespaces) => {
                let mut ranges: Vec<Range<usize>> =
                    namespaces.iter().filter_map(|ns| self.by_namespace.get(ns)).map(|i| i.range.clone()).collect();
                ranges.sort_by_key(|r| r.start);
                ranges.dedup();
                ranges.into_iter().flatten().collect()
            }
        };
        SnapshotPart { snapshot: self, whole: namespaces.is_none(), indices }
    }
    /// The request body fields the estimates of `namespace`'s rules read (`responseCost.estimate.
    /// requestField`), sorted, without repeats.
    pub fn estimate_fields(&self, namespace: &str) -> Vec<String> {
        let mut fields: Vec<String> = self
            .namespace_policies(namespace)
            .iter()
            .flat_map(|p| p.rules())
            .filter_map(|r| r.response_cost()?.request_field().map(str::to_string))
            .collect();
        fields.sort();
        fields.dedup();
        fields
    }

    pub fn rules(&self) -> impl Iterator<Item = &CompiledRule> {
        self.policies.iter().flat_map(|p| &p.rules)
    }
    pub fn rule_count(&self) -> usize {
        self.policies.iter().map(|p| p.rules.len()).sum()
    }
    /// Canonical names ([`canonical_header_name`]) of every header a rule matches on or keys on,
    /// sorted: the only headers the sidecar needs to forward to the check API.
    pub fn header_names(&self) -> &[String] {
        &self.header_names
    }
}

/// Some namespaces' policies of a snapshot, in the snapshot's order.
pub struct SnapshotPart<'s> {
    snapshot: &'s Snapshot,
    whole: bool,
    indices: Vec<usize>,
}

impl<'s> SnapshotPart<'s> {
    pub fn policies(&self) -> impl Iterator<Item = &'s CompiledPolicy> + '_ {
        self.indices.iter().map(|&i| &self.snapshot.policies[i])
    }
    /// What [`compile`] of [`Self::sources`] would name its snapshot.
    pub fn version(&self) -> String {
        if self.whole { self.snapshot.version.clone() } else { version_of(self.policies()) }
    }
    pub fn sources(&self) -> Vec<&'s RateLimitPolicy> {
        self.indices.iter().map(|&i| &self.snapshot.sources[i]).collect()
    }
    pub fn header_names(&self) -> Vec<String> {
        if self.whole { self.snapshot.header_names.clone() } else { header_names_of(self.policies()) }
    }
}
