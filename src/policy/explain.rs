//! Why each rule of a snapshot applies to a request or not: `sluice explain` and
//! `POST /v1/explain`.
//!
//! Pure: it answers with the same functions [`Snapshot::resolve`] matches with
//! ([`super::matching::selector_mismatch`], [`super::matching::rule_mismatch`],
//! [`super::matching::build_key`]), so an explanation can never disagree with a check. The
//! decision a check would make is supplied by the caller (a store's read-only peek), so nothing
//! here reads a clock or consumes quota.

use serde::Serialize;

use super::crd::{Missing, PolicyRule, RateLimitPolicy};
use super::matching::{
    Matched, RequestView, RuleMismatch, SelectorMismatch, build_key, matching_inputs, rule_mismatch, selector_mismatch,
};
use super::snapshot::{CompiledPolicy, CompiledRule, HeaderTest, KeySource, SelectorOp, Snapshot};
use crate::algorithm::{Decision, Micros};
use crate::duration::MICROS_PER_MS;
use crate::overload::Class;
use crate::rule::RuleCheck;
use crate::rule::Verdict;

/// How a snapshot treats one request, policy by policy and rule by rule.
#[derive(Debug)]
pub struct Explanation<'s> {
    pub namespace: String,
    /// The path matching and keys see: without query, normalized (`src/policy/path.rs`).
    pub path: String,
    /// The host matching sees: without port or trailing dot.
    pub host: Option<String>,
    pub snapshot: String,
    pub policies: Vec<PolicyExplanation<'s>>,
    /// The request's class under overload ([`Snapshot::classify`]), and the policy whose
    /// `priorities` gave it (`None`: no entry matched, so `default`).
    pub class: Class,
    pub classified_by: Option<String>,
    /// Whether any policy selecting the workload has `priorities` or `overload` (the text
    /// report names the class only then).
    pub protected: bool,
    /// Whether `overload.exempt` leaves the request alone.
    pub exempt: bool,
    /// The layering report of the namespace's policies ([`super::layering`]).
    pub layering: Vec<super::layering::Finding>,
    /// The `spec.egress` entry the request calls, when it is an egress call.
    pub egress: Option<String>,
}

#[derive(Debug)]
pub struct PolicyExplanation<'s> {
    pub policy: &'s CompiledPolicy,
    /// Why the workload's labels fail the selector; `None` when they match.
    pub selector_failure: Option<String>,
    pub rules: Vec<RuleExplanation<'s>>,
}

#[derive(Debug)]
pub struct RuleExplanation<'s> {
    pub rule: &'s CompiledRule,
    /// The match with its key and cost, or why the rule does not apply.
    pub outcome: Result<Matched<'s>, String>,
}

impl Snapshot {
    /// Explains every policy of the request's namespace (the only ones a check considers), with
    /// the layering report of their rules (`replicas` sharing each `localFallback` limit).
    pub fn explain<'s>(&'s self, req: &RequestView<'_>, replicas: u32) -> Explanation<'s> {
        let (path, host) = matching_inputs(req);
        let policies: Vec<PolicyExplanation<'_>> = self
            .namespace_policies(req.namespace)
            .iter()
            .map(|policy| {
                let sources = self.source_rules(policy);
                let selector_failure =
                    selector_mismatch(&policy.selector, req.labels).map(|m| describe_selector_failure(policy, m, req));
                let rules = match req.egress {
                    // An egress call is decided by the entry it names alone.
                    Some(name) => policy
                        .egress
                        .iter()
                        .map(|entry| {
                            let outcome = match &selector_failure {
                                Some(reason) => Err(reason.clone()),
                                None if entry.name == name => {
                                    Ok(Matched { rule: &entry.rule, key: entry.key.clone(), cost: 1 })
                                }
                                None => {
                                    Err(format!("spec.egress entry {:?}, not the one called ({name:?})", entry.name))
                                }
                            };
                            RuleExplanation { rule: &entry.rule, outcome }
                        })
                        .collect(),
                    None => policy
                        .rules
                        .iter()
                        .enumerate()
                        .map(|(i, rule)| {
                            let outcome = match &selector_failure {
                                Some(reason) => Err(reason.clone()),
                                None => explain_rule(rule, sources.and_then(|s| s.get(i)), req, &path, host),
                            };
                            RuleExplanation { rule, outcome }
                        })
                        .collect(),
                };
                PolicyExplanation { policy, selector_failure, rules }
            })
            .collect();
        let (class, classified_by) = self.classify(req);
        let protected = policies
            .iter()
            .any(|p| p.selector_failure.is_none() && (!p.policy.priorities.is_empty() || p.policy.overload.is_some()));
        let namespace_sources: Vec<RateLimitPolicy> = self
            .sources()
            .iter()
            .filter(|p| p.metadata.namespace.as_deref().unwrap_or(crate::rule::DEFAULT_NAMESPACE) == req.namespace)
            .cloned()
            .collect();
        Explanation {
            egress: req.egress.map(str::to_string),
            layering: super::layering::report(&namespace_sources, replicas),
            namespace: req.namespace.to_string(),
            path: path.into_owned(),
            host: host.map(str::to_string),
            snapshot: self.version().to_string(),
            policies,
            class,
            classified_by: classified_by.map(str::to_string),
            protected,
            exempt: self.exempt_from_overload(req),
        }
    }

    /// The rules as written, for quoting patterns (compiled regexes keep no source text).
    fn source_rules(&self, policy: &CompiledPolicy) -> Option<&[PolicyRule]> {
        let index = self.policies().iter().position(|p| std::ptr::eq(p, policy))?;
        self.sources().get(index).map(|source| source.spec.rules.as_slice())
    }
}

fn explain_rule<'s>(
    rule: &'s CompiledRule,
    source: Option<&PolicyRule>,
    req: &RequestView<'_>,
    path: &str,
    host: Option<&str>,
) -> Result<Matched<'s>, String> {
    if let Some(mismatch) = rule_mismatch(&rule.matcher, req, path, host) {
        return Err(describe_rule_failure(rule, source, mismatch, req, path, host));
    }
    match build_key(&rule.key, req, path, host) {
        Ok(key) => Ok(Matched { rule, key, cost: rule.cost_for(req) }),
        Err(part) => Err(format!(
            "key[{part}]: {} has no value and the part says missing: skip, so the rule does not apply",
            rule.key.get(part).map_or_else(|| "a part".to_string(), describe_key_source)
        )),
    }
}

fn quoted(value: Option<&str>) -> String {
    value.map_or_else(|| "absent".to_string(), |v| format!("{v:?}"))
}

fn describe_selector_failure(policy: &CompiledPolicy, mismatch: SelectorMismatch, req: &RequestView<'_>) -> String {
    match mismatch {
        SelectorMismatch::Label(i) => {
            let (key, want) = &policy.selector.labels[i];
            format!(
                "selector: matchLabels needs {key}={want}; the workload's label {key} is {}",
                quoted(req.labels.get_str(key))
            )
        }
        SelectorMismatch::Expression(i) => {
            let (key, op, values) = &policy.selector.expressions[i];
            let op = match op {
                SelectorOp::In => format!("In [{}]", values.join(", ")),
                SelectorOp::NotIn => format!("NotIn [{}]", values.join(", ")),
                SelectorOp::Exists => "Exists".to_string(),
                SelectorOp::DoesNotExist => "DoesNotExist".to_string(),
            };
            format!(
                "selector: matchExpressions[{i}] needs {key} {op}; the workload's label {key} is {}",
                quoted(req.labels.get_str(key))
            )
        }
    }
}

fn describe_rule_failure(
    rule: &CompiledRule,
    source: Option<&PolicyRule>,
    mismatch: RuleMismatch,
    req: &RequestView<'_>,
    path: &str,
    host: Option<&str>,
) -> String {
    let written = source.and_then(|s| s.matches.as_ref());
    match mismatch {
        RuleMismatch::Method => {
            format!("methods: {} is not one of [{}]", req.method, rule.matcher.methods.join(", "))
        }
        RuleMismatch::Path => {
            let patterns: Vec<String> = written
                .map(|m| {
                    m.paths
                        .iter()
                        .map(|p| {
                            let pattern = match (&p.exact, &p.prefix, &p.regex) {
                                (Some(x), _, _) => format!("exact {x}"),
                                (_, Some(x), _) => format!("prefix {x}"),
                                (_, _, Some(x)) => format!("regex {x}"),
                                _ => "?".to_string(),
                            };
                            if p.ignore_case == Some(true) { format!("{pattern} (ignoring case)") } else { pattern }
                        })
                        .collect()
                })
                .unwrap_or_default();
            format!("paths: {path} (normalized) matches none of [{}]", patterns.join(", "))
        }
        RuleMismatch::Host => {
            let hosts = written.map(|m| m.hosts.join(", ")).unwrap_or_default();
            match host {
                None => format!("hosts: the request has no host; the rule needs one of [{hosts}]"),
                Some(h) => format!("hosts: {h} matches none of [{hosts}]"),
            }
        }
        RuleMismatch::Header(i) => {
            let Some(condition) = rule.matcher.headers.get(i) else { return format!("headers[{i}]: failed") };
            let name = &condition.name;
            let needs = match &condition.test {
                HeaderTest::Exact(x) => format!("exact {x:?}"),
                HeaderTest::Prefix(x) => format!("prefix {x:?}"),
                HeaderTest::Regex(_) => {
                    let pattern = written.and_then(|m| m.headers.get(i)).and_then(|h| h.regex.clone());
                    format!("regex {}", pattern.unwrap_or_default())
                }
                HeaderTest::Present(true) => "it present".to_string(),
                HeaderTest::Present(false) => "it absent".to_string(),
            };
            format!("headers[{i}]: {name} is {}; the rule needs {needs}", quoted(req.headers.get_str(name)))
        }
        RuleMismatch::Kind if req.descriptor.is_none() => {
            "match.descriptor: the rule applies to Envoy rate limit descriptors, not HTTP requests".to_string()
        }
        RuleMismatch::Kind => "the rule applies to HTTP requests, not to rate limit descriptors".to_string(),
        RuleMismatch::DescriptorLength => format!(
            "match.descriptor: the descriptor has {} entries; the rule needs {}",
            req.descriptor.map_or(0, |d| d.entry_count()),
            rule.matcher.descriptor.len()
        ),
        RuleMismatch::DescriptorEntry(i) => {
            let entry = req.descriptor.and_then(|d| d.entry(i));
            let wanted = rule.matcher.descriptor.get(i).map_or("", |e| e.key.as_str());
            match entry {
                Some((key, value)) => {
                    format!("match.descriptor[{i}]: entry ({key}, {value:?}) does not pass the rule's entry {wanted}")
                }
                None => format!("match.descriptor[{i}]: no such entry"),
            }
        }
    }
}

fn describe_key_source(source: &KeySource) -> String {
    match source {
        KeySource::Header(name, _) => format!("header {name}"),
        KeySource::ClientIp(_) => "clientIP".to_string(),
        KeySource::Namespace => "namespace".to_string(),
        KeySource::Path => "path".to_string(),
        KeySource::LowercasePath => "path (lowercased)".to_string(),
        KeySource::Method => "method".to_string(),
        KeySource::Host => "host".to_string(),
        KeySource::Descriptor(key) => format!("descriptor {key}"),
        KeySource::Literal(_) => "literal".to_string(),
    }
}

/// Splits a key encoded as in [`super::matching`] (`<byte length>:<value>` per part) back into
/// its values; `None` if it is not such an encoding.
pub fn decode_key(mut key: &str) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    while !key.is_empty() {
        let colon = key.find(':')?;
        let len: usize = key[..colon].parse().ok()?;
        let rest = &key[colon + 1..];
        if rest.len() < len || !rest.is_char_boundary(len) {
            return None;
        }
        parts.push(&rest[..len]);
        key = &rest[len..];
    }
    Some(parts)
}

impl CompiledRule {
    /// Lowercase names of the headers this rule keys on, in key order.
    pub fn keyed_headers(&self) -> impl Iterator<Item = &str> {
        self.key.iter().filter_map(|k| match k {
            KeySource::Header(name, _) => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether a part of this rule's key is the client IP.
    pub fn keys_on_client_ip(&self) -> bool {
        self.key.iter().any(|k| matches!(k, KeySource::ClientIp(_)))
    }
}

impl<'s> Explanation<'s> {
    /// The rules a check would decide, in the order [`Snapshot::resolve`] gives them.
    pub fn matched(&self) -> Vec<&Matched<'s>> {
        self.policies.iter().flat_map(|p| &p.rules).filter_map(|r| r.outcome.as_ref().ok()).collect()
    }

    /// What a store needs to decide (or peek at) the matched rules.
    pub fn checks(&self) -> Vec<RuleCheck<'_>> {
        self.matched().into_iter().map(Matched::check).collect()
    }

    /// The serializable report. `verdict` is what a store says about [`Self::checks`] without
    /// consuming (`None`: the store cannot tell without consuming).
    pub fn report(&self, verdict: Option<&Verdict>) -> ExplainReport {
        let mut decisions = verdict.map(|v| v.decisions.iter());
        let mut rules = Vec::new();
        for policy in &self.policies {
            for r in &policy.rules {
                let (matched, reason, key, key_parts, cost, decision) = match &r.outcome {
                    Ok(m) => {
                        let decision = decisions.as_mut().and_then(Iterator::next).map(RuleDecision::from);
                        let values = decode_key(&m.key).unwrap_or_default();
                        let key_parts = r
                            .rule
                            .key
                            .iter()
                            .zip(values)
                            .map(|(source, value)| KeyPartView {
                                source: describe_key_source(source),
                                missing_shares: matches!(
                                    source,
                                    KeySource::Header(_, Missing::Share) | KeySource::ClientIp(Missing::Share)
                                ) && value.is_empty(),
                                value: value.to_string(),
                            })
                            .collect();
                        (true, None, Some(m.key.clone()), key_parts, Some(m.cost), decision)
                    }
                    Err(reason) => (false, Some(reason.clone()), None, Vec::new(), None, None),
                };
                let reserves = r.rule.response_cost().map(|rc| describe_response_cost(rc));
                let consistency = match r.rule.leasing() {
                    None => "exact".to_string(),
                    Some(l) => format!(
                        "leased: at most {} over the limit, slices decided for up to {}",
                        l.max_overshoot,
                        crate::duration::HumanDuration(l.staleness)
                    ),
                };
                let layering = self
                    .layering
                    .iter()
                    .filter(|f| f.policy == r.rule.policy() && f.rule == r.rule.name())
                    .map(LayeringNote::from)
                    .collect();
                let stale = r.rule.stale().map(|stale| {
                    format!(
                        "a limited GET or HEAD gets the response kept for its URL if at most {} old (else the refusal)",
                        crate::duration::HumanDuration(stale.max_stale)
                    )
                });
                let deferred = r.rule.defer().map(|defer| {
                    format!(
                        "a limited POST, PUT, PATCH or DELETE is accepted (202, with a status URL) into this rule's queue and replayed within the limits, at most {} tries (else the refusal: queue full at {} per key, or no Redis)",
                        defer.max_attempts, defer.max_queued
                    )
                });
                let when_limited = match (stale, deferred) {
                    (Some(stale), Some(deferred)) => Some(format!("{stale}; {deferred}")),
                    (stale, deferred) => stale.or(deferred),
                };
                rules.push(RuleReport {
                    when_limited,
                    layering,
                    reserves,
                    consistency,
                    policy: r.rule.policy().to_string(),
                    rule: r.rule.name().to_string(),
                    algorithm: r.rule.algorithm().name(),
                    shadow: !r.rule.enforce(),
                    matched,
                    reason,
                    key,
                    key_parts,
                    cost,
                    decision,
                });
            }
        }
        let matched = self.matched();
        let decision = match (verdict, matched.is_empty()) {
            // An egress call no entry answers is refused by the check API (400), never admitted.
            (_, true) if self.egress.is_some() => {
                Some(RequestDecision { allowed: false, status: 400, retry_after_ms: None, delay_ms: 0 })
            }
            (_, true) => Some(RequestDecision { allowed: true, status: 200, retry_after_ms: None, delay_ms: 0 }),
            (Some(v), false) => Some(RequestDecision::from_verdict(&matched, v)),
            (None, false) => None,
        };
        ExplainReport {
            namespace: self.namespace.clone(),
            path: self.path.clone(),
            host: self.host.clone(),
            snapshot: self.snapshot.clone(),
            policies: self
                .policies
                .iter()
                .map(|p| PolicyReport {
                    policy: p.policy.qualified_name().to_string(),
                    selector_matched: p.selector_failure.is_none(),
                    reason: p.selector_failure.clone(),
                })
                .collect(),
            rules,
            class: self.class,
            classified_by: self.classified_by.clone(),
            protected: self.protected,
            exempt_from_overload: self.exempt,
            decision,
            consumed: false,
            egress: self.egress.clone(),
        }
    }
}

impl ExplainReport {
    /// The report for a terminal, one line per rule.
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let host = self.host.as_deref().unwrap_or("(none)");
        let _ = writeln!(
            out,
            "namespace {}, path {} (normalized), host {host}, snapshot {}",
            self.namespace, self.path, self.snapshot
        );
        if self.policies.is_empty() {
            let _ = writeln!(out, "no policy in namespace {}", self.namespace);
        }
        if self.exempt_from_overload {
            let _ = writeln!(out, "exempt from overload protection (spec.overload.exempt)");
        } else if self.classified_by.is_some() || self.class != Class::Default {
            let by = self.classified_by.as_deref().unwrap_or("");
            let _ = writeln!(out, "class {} under overload (spec.priorities of {by})", self.class);
        } else if self.protected {
            let _ = writeln!(out, "class default under overload (no spec.priorities entry matches)");
        }
        for policy in &self.policies {
            match &policy.reason {
                None => {
                    let _ = writeln!(out, "policy {}: selector matches", policy.policy);
                }
                Some(reason) => {
                    let _ = writeln!(out, "policy {}: not applied: {reason}", policy.policy);
                }
            }
            for rule in self.rules.iter().filter(|r| r.policy == policy.policy) {
                let shadow = if rule.shadow { ", shadow" } else { "" };
                if !rule.matched {
                    if policy.selector_matched {
                        let reason = rule.reason.as_deref().unwrap_or("");
                        let _ = writeln!(out, "  - {} ({}{shadow}): no match: {reason}", rule.rule, rule.algorithm);
                    }
                    continue;
                }
                let parts: Vec<String> = rule.key_parts.iter().map(|p| format!("{}={:?}", p.source, p.value)).collect();
                let key = if parts.is_empty() { "(one shared counter)".to_string() } else { parts.join(", ") };
                let decision = match &rule.decision {
                    Some(d) if d.allowed => format!("would admit, {} left", d.remaining),
                    Some(d) => match d.retry_after_ms {
                        Some(ms) => format!("would refuse, retry in {ms} ms"),
                        None => "would refuse: the cost can never fit".to_string(),
                    },
                    None => "decision unknown".to_string(),
                };
                let cost = match &rule.reserves {
                    Some(how) => format!("reserves {} ({how})", rule.cost.unwrap_or(0)),
                    None => format!("cost {}", rule.cost.unwrap_or(0)),
                };
                let consistency =
                    if rule.consistency == "exact" { String::new() } else { format!("; {}", rule.consistency) };
                let _ = writeln!(
                    out,
                    "  + {} ({}{shadow}): matches; key {key} (encoded {:?}); {cost}; {decision}{consistency}",
                    rule.rule,
                    rule.algorithm,
                    rule.key.as_deref().unwrap_or("")
                );
                if let Some(when_limited) = &rule.when_limited {
                    let _ = writeln!(out, "    limited: {when_limited}");
                }
                for note in &rule.layering {
                    let _ = writeln!(out, "    ! layering: {}: {}", note.kind, note.message);
                }
            }
        }
        let _ = match &self.decision {
            Some(d) if d.allowed && d.delay_ms > 0 => writeln!(
                out,
                "a check now: {} allowed after waiting {} ms for its slot (shaping); nothing consumed",
                d.status, d.delay_ms
            ),
            Some(d) if d.allowed => {
                writeln!(out, "a check now: {} allowed (delay {} ms); nothing consumed", d.status, d.delay_ms)
            }
            Some(d) if d.status == 400 && self.egress.is_some() => writeln!(
                out,
                "a check now: 400: no policy selecting this workload offers a spec.egress entry named {:?}",
                self.egress.as_deref().unwrap_or("")
            ),
            Some(d) => writeln!(out, "a check now: {} refused; nothing consumed", d.status),
            None => writeln!(out, "a check now: unknown (this store cannot read without consuming); nothing consumed"),
        };
        out
    }
}

fn ceil_ms(micros: Micros) -> u64 {
    micros.div_ceil(MICROS_PER_MS)
}

/// What `sluice explain --json` and `POST /v1/explain` answer.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ExplainReport {
    pub namespace: String,
    /// The normalized path rules matched.
    pub path: String,
    pub host: Option<String>,
    pub snapshot: String,
    /// Every policy of the namespace: the ones a check considers.
    pub policies: Vec<PolicyReport>,
    pub rules: Vec<RuleReport>,
    /// The request's class when the workload is overloaded: `critical`, `default` or
    /// `sheddable`.
    pub class: Class,
    /// The policy whose `spec.priorities` gave the class; `null` when none matched.
    pub classified_by: Option<String>,
    /// Whether a policy selecting the workload classifies or protects it (the text names the
    /// class only then).
    #[serde(skip)]
    pub protected: bool,
    /// Whether `spec.overload.exempt` leaves the request alone (never refused for overload).
    pub exempt_from_overload: bool,
    /// What a check would answer now; `null` when the store cannot tell without consuming.
    pub decision: Option<RequestDecision>,
    /// Always false: explaining consumes nothing.
    pub consumed: bool,
    /// The `spec.egress` entry the request calls, when it is an egress call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<String>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyReport {
    pub policy: String,
    pub selector_matched: bool,
    pub reason: Option<String>,
}

/// One layering finding about a rule, as explain reports it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LayeringNote {
    /// `unreachable`, `looserInner`, `shadowChangesNothing` or `fallbackExceedsLimit`.
    pub kind: &'static str,
    /// The other rule involved, as `namespace/policy rule`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other: Option<String>,
    pub message: String,
}

impl From<&super::layering::Finding> for LayeringNote {
    fn from(f: &super::layering::Finding) -> LayeringNote {
        LayeringNote {
            kind: f.kind.name(),
            other: f.other.as_ref().map(|(policy, rule)| format!("{policy} rule {rule}")),
            message: f.message.clone(),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RuleReport {
    pub policy: String,
    pub rule: String,
    pub algorithm: &'static str,
    pub shadow: bool,
    pub matched: bool,
    /// The failing condition when not matched, naming its field (`selector`, `methods`,
    /// `paths`, `hosts`, `headers[i]`, `key[i]`).
    pub reason: Option<String>,
    /// The encoded key (`<byte length>:<value>` per part) when matched.
    pub key: Option<String>,
    /// The key readably: each part's source and value.
    pub key_parts: Vec<KeyPartView>,
    /// rule cost × request cost, when matched; for a cost known after the response, the
    /// estimate its admission reserves.
    pub cost: Option<u64>,
    /// For a cost known after the response: where the actual cost is read, what settles it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserves: Option<String>,
    /// `exact`, or `leased` with its bound and staleness (`consistency`): how its decisions use
    /// the shared store.
    pub consistency: String,
    /// `staleIfLimited` and `deferIfLimited`: what a limited read or write gets instead of the
    /// refusal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub when_limited: Option<String>,
    /// What this rule would decide now (when matched and the store can tell).
    pub decision: Option<RuleDecision>,
    /// What the layering report says of this rule: unreachable behind another, looser than the
    /// rule in front of it, a shadow rule that would change nothing, a fallback above the limit.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layering: Vec<LayeringNote>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct KeyPartView {
    pub source: String,
    pub value: String,
    /// The value is missing and `missing: share` put every such request on one counter.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub missing_shares: bool,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RuleDecision {
    pub allowed: bool,
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: Option<u64>,
    pub delay_ms: u64,
}

impl From<&Decision> for RuleDecision {
    fn from(d: &Decision) -> Self {
        RuleDecision {
            allowed: d.allowed,
            remaining: d.remaining,
            reset_ms: ceil_ms(d.reset_after),
            retry_after_ms: d.retry_after.map(ceil_ms),
            delay_ms: ceil_ms(d.delay),
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RequestDecision {
    pub allowed: bool,
    pub status: u16,
    /// On a refusal, when the request would pass (the longest wait of the refusing enforcing
    /// rules; `null` when one of them can never admit it).
    pub retry_after_ms: Option<u64>,
    pub delay_ms: u64,
}

impl RequestDecision {
    fn from_verdict(matched: &[&Matched<'_>], verdict: &Verdict) -> RequestDecision {
        let enforced = || matched.iter().zip(&verdict.decisions).filter(|(m, _)| m.rule.enforce()).map(|(_, d)| d);
        if verdict.allowed {
            let delay = enforced().map(|d| d.delay).max().unwrap_or(0);
            return RequestDecision { allowed: true, status: 200, retry_after_ms: None, delay_ms: ceil_ms(delay) };
        }
        let waits: Option<Vec<Micros>> = enforced().filter(|d| !d.allowed).map(|d| d.retry_after).collect();
        RequestDecision {
            allowed: false,
            status: 429,
            retry_after_ms: waits.and_then(|w| w.into_iter().max()).map(ceil_ms),
            delay_ms: 0,
        }
    }
}

/// How a rule whose cost is known after the response settles, in words.
fn describe_response_cost(cost: &super::response_cost::ResponseCost) -> String {
    use super::crd::ResponseCostMode;
    let mut read = Vec::new();
    if let Some(header) = &cost.header {
        read.push(format!("header {header}"));
    }
    if let Some(usage) = &cost.usage {
        read.push(usage.fields.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(" + "));
    }
    let read = read.join(", else ");
    match cost.mode {
        ResponseCostMode::Reserve => {
            format!("the estimate, settled to {read} of the response; a failed request costs {}", cost.on_failure)
        }
        ResponseCostMode::ReportAfter => format!("nothing: reportAfter charges {read} of the response afterwards"),
    }
}

#[cfg(test)]
mod tests;
