//! Why each rule of a snapshot applies to a request or not: `sluice explain` and
//! `POST /v1/explain`.
//!
//! Pure: it answers with the same functions [`Snapshot::resolve`] matches with
//! ([`super::matching::selector_mismatch`], [`super::matching::rule_mismatch`],
//! [`super::matching::build_key`]), so an explanation can never disagree with a check. The
//! decision a check would make is supplied by the caller (a store's read-only peek), so nothing
//! here reads a clock or consumes quota.

use serde::Serialize;

use super::compile::{CompiledPolicy, CompiledRule, HeaderTest, KeySource, SelectorOp, Snapshot};
use super::crd::{Missing, PolicyRule};
use super::matching::{
    Matched, RequestView, RuleMismatch, SelectorMismatch, build_key, matching_inputs, rule_mismatch, selector_mismatch,
};
use crate::algorithm::{Decision, Micros};
use crate::duration::MICROS_PER_MS;
use crate::overload::Class;
use crate::store::{RuleCheck, Verdict};

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
    /// Explains every policy of the request's namespace (the only ones a check considers).
    pub fn explain<'s>(&'s self, req: &RequestView<'_>) -> Explanation<'s> {
        let (path, host) = matching_inputs(req);
        let policies: Vec<PolicyExplanation<'_>> = self
            .namespace_policies(req.namespace)
            .iter()
            .map(|policy| {
                let sources = self.source_rules(policy);
                let selector_failure =
                    selector_mismatch(&policy.selector, req.labels).map(|m| describe_selector_failure(policy, m, req));
                let rules = policy
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
                    .collect();
                PolicyExplanation { policy, selector_failure, rules }
            })
            .collect();
        let (class, classified_by) = self.classify(req);
        let protected = policies
            .iter()
            .any(|p| p.selector_failure.is_none() && (!p.policy.priorities.is_empty() || p.policy.overload.is_some()));
        Explanation {
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
                rules.push(RuleReport {
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
            }
        }
        let _ = match &self.decision {
            Some(d) if d.allowed => {
                writeln!(out, "a check now: {} allowed (delay {} ms); nothing consumed", d.status, d.delay_ms)
            }
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
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PolicyReport {
    pub policy: String,
    pub selector_matched: bool,
    pub reason: Option<String>,
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
    /// What this rule would decide now (when matched and the store can tell).
    pub decision: Option<RuleDecision>,
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
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::policy::{compile, load_str};

    const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders, namespace: shop}
spec:
  selector:
    matchLabels: {app: orders}
    matchExpressions: [{key: tier, operator: NotIn, values: [free]}]
  rules:
    - name: writes
      match: {methods: [POST, PUT], paths: [{prefix: /orders}, {regex: "/carts/[0-9]+"}]}
      key: [{header: X-API-Key}]
      algorithm: tokenBucket
      limit: {requests: 10, per: 1s, burst: 5}
    - name: by-host
      match: {hosts: ["*.example.com"], headers: [{name: X-Tier, exact: gold}]}
      key: [{clientIP: true, missing: skip}, {host: true}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1m}
    - name: exact-health
      match: {paths: [{exact: /healthz}], headers: [{name: X-Probe, present: false}]}
      algorithm: slidingWindowLog
      limit: {requests: 2, per: 1s}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: everything, namespace: shop}
spec:
  rules:
    - name: all
      key: [{path: true}, {method: true}]
      algorithm: gcra
      limit: {requests: 100, per: 1s}
"#;

    fn snapshot() -> Snapshot {
        let loaded = load_str(POLICIES, std::path::Path::new("test.yaml")).unwrap();
        let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
        assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
        compiled.snapshot
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Explain and resolve are the same decision: for every combination of a few methods, paths
    /// (normal and not), hosts, headers, labels and client IPs, a rule is explained as matched
    /// exactly when resolve returns it, with the same key and cost.
    #[test]
    fn explain_agrees_with_resolve_on_many_requests() {
        let snapshot = snapshot();
        let methods = ["GET", "post", "PUT", "DELETE"];
        let paths = ["/orders", "/orders/1?x=1", "//orders/./2", "/ordersX", "/carts/12", "/carts/x", "/healthz", "/"];
        let hosts = [None, Some("a.example.com:8443"), Some("example.com"), Some("A.EXAMPLE.COM.")];
        let header_sets = [map(&[]), map(&[("x-api-key", "k1")]), map(&[("x-tier", "gold"), ("x-probe", "1")])];
        let label_sets = [map(&[]), map(&[("app", "orders")]), map(&[("app", "orders"), ("tier", "free")])];
        let ips = [None, Some("203.0.113.7".parse().unwrap())];
        let mut cases = 0;
        let mut matched_total = 0;
        for method in methods {
            for path in paths {
                for host in hosts {
                    for headers in &header_sets {
                        for labels in &label_sets {
                            for client_ip in ips {
                                let req = RequestView {
                                    namespace: "shop",
                                    labels,
                                    method,
                                    path,
                                    host,
                                    client_ip,
                                    headers,
                                    cost: 2,
                                    fields: &crate::policy::NoEntries,
                                    descriptor: None,
                                };
                                let mut resolved = Vec::new();
                                snapshot.resolve(&req, &mut resolved);
                                let explanation = snapshot.explain(&req);
                                let explained = explanation.matched();
                                assert_eq!(resolved.len(), explained.len(), "{req:?}");
                                for (r, e) in resolved.iter().zip(&explained) {
                                    assert_eq!(r.rule.identity(), e.rule.identity(), "{req:?}");
                                    assert_eq!((&r.key, r.cost), (&e.key, e.cost), "{req:?}");
                                }
                                for rule in explanation.policies.iter().flat_map(|p| &p.rules) {
                                    if let Err(reason) = &rule.outcome {
                                        assert!(!reason.is_empty());
                                    }
                                }
                                cases += 1;
                                matched_total += resolved.len();
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(cases, 4 * 8 * 4 * 3 * 3 * 2);
        assert!(matched_total > cases / 2, "the cases exercise matches too");
    }

    fn reasons(req: &RequestView<'_>) -> Vec<(String, Option<String>)> {
        let snapshot = snapshot();
        let report = snapshot.explain(req).report(None);
        report.rules.into_iter().map(|r| (r.rule, r.reason)).collect()
    }

    fn reason_of(req: &RequestView<'_>, rule: &str) -> String {
        reasons(req).into_iter().find(|(name, _)| name == rule).and_then(|(_, reason)| reason).unwrap_or_default()
    }

    #[test]
    fn reasons_name_the_failing_condition() {
        let orders = map(&[("app", "orders")]);
        let free = map(&[("app", "orders"), ("tier", "free")]);
        let gold = map(&[("x-tier", "gold")]);
        let mut req = RequestView::new("/orders/1");
        req.namespace = "shop";
        assert!(reason_of(&req, "writes").starts_with("selector: matchLabels needs app=orders"));
        req.labels = &free;
        assert!(reason_of(&req, "writes").starts_with("selector: matchExpressions[0] needs tier NotIn [free]"));
        req.labels = &orders;
        assert_eq!(reason_of(&req, "writes"), "methods: GET is not one of [POST, PUT]");
        req.method = "POST";
        req.path = "//ordersX/../ordersY";
        assert_eq!(
            reason_of(&req, "writes"),
            "paths: /ordersY (normalized) matches none of [prefix /orders, regex /carts/[0-9]+]"
        );
        assert_eq!(reason_of(&req, "by-host"), "hosts: the request has no host; the rule needs one of [*.example.com]");
        req.host = Some("example.com:80");
        assert_eq!(reason_of(&req, "by-host"), "hosts: example.com matches none of [*.example.com]");
        req.host = Some("a.example.com");
        assert_eq!(reason_of(&req, "by-host"), "headers[0]: x-tier is absent; the rule needs exact \"gold\"");
        req.headers = &gold;
        assert!(reason_of(&req, "by-host").starts_with("key[0]: clientIP has no value"));
        req.client_ip = Some("203.0.113.7".parse().unwrap());
        assert_eq!(reason_of(&req, "by-host"), "");
    }

    #[test]
    fn keys_are_shown_part_by_part() {
        let snapshot = snapshot();
        let headers = map(&[("x-api-key", "a|b:c")]);
        let labels = map(&[("app", "orders")]);
        let mut req = RequestView::new("/orders/%31");
        req.namespace = "shop";
        req.method = "POST";
        req.headers = &headers;
        req.labels = &labels;
        let report = snapshot.explain(&req).report(None);
        assert_eq!(report.path, "/orders/1", "the normalized path");
        let writes = report.rules.iter().find(|r| r.rule == "writes").unwrap();
        assert_eq!(writes.key.as_deref(), Some("5:a|b:c"));
        assert_eq!(writes.key_parts[0].source, "header x-api-key");
        assert_eq!(writes.key_parts[0].value, "a|b:c");
        let all = report.rules.iter().find(|r| r.rule == "all").unwrap();
        assert_eq!(all.key_parts.iter().map(|p| p.value.as_str()).collect::<Vec<_>>(), ["/orders/1", "POST"]);
        assert_eq!(report.decision, None, "no store consulted: unknown");
    }

    #[test]
    fn decode_key_inverts_encode_key() {
        for parts in [vec![], vec![""], vec!["a|b", "c"], vec!["1:2", "", "é"]] {
            let encoded = crate::policy::encode_key(parts.iter().copied());
            assert_eq!(decode_key(&encoded), Some(parts.clone()));
        }
        assert_eq!(decode_key("3:ab"), None);
        assert_eq!(decode_key("x:ab"), None);
    }
}
