//! The compiled policies an engine decides with: the [`Snapshot`] (immutable, swapped whole), its
//! policies and rules as matching and key building need them, and the part of it one caller may
//! see ([`SnapshotPart`]). [`super::compile`] builds it; [`super::matching`] reads it.

use std::collections::HashMap;
use std::ops::Range;

use super::pattern::PolicyRegex as Regex;
use sha2::{Digest, Sha256};

use super::crd::FailureMode;
use super::crd::{Missing, Mode, OverloadSpec, RateLimitPolicy, RefusalSpec};
use crate::algorithm::{Algorithm, Limit};
use crate::duration::Micros;
use crate::overload::Class;
use crate::rule::{RuleCheck, RuleId};

/// Every rule in force, immutable once built; share it as `Arc<Snapshot>` and swap whole.
#[derive(Debug)]
pub struct Snapshot {
    pub(super) version: String,
    /// Sorted by (namespace, name), so each namespace is one contiguous range.
    pub(super) policies: Vec<CompiledPolicy>,
    pub(super) by_namespace: HashMap<String, NamespaceIndex>,
    pub(super) header_names: Vec<String>,
    /// The accepted policies themselves, sorted like `policies`.
    pub(super) sources: Vec<RateLimitPolicy>,
    /// Whether any rule has `staleIfLimited` (the sidecar looks no further when none has).
    pub(super) serves_stale: bool,
    /// Whether any rule has `deferIfLimited`.
    pub(super) defers: bool,
}

/// One namespace's share of a snapshot.
#[derive(Debug)]
pub(super) struct NamespaceIndex {
    /// Its policies in [`Snapshot::policies`].
    pub(super) range: Range<usize>,
    /// The headers its rules match or key on, sorted.
    pub(super) header_names: Vec<String>,
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
    /// `spec.egress`: downstreams the selected workloads' sidecars shape.
    pub(super) egress: Vec<super::egress::CompiledEgress>,
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
    pub(super) leasing: Option<crate::rule::Leasing>,
    /// `staleIfLimited`: a limited read gets the last good response kept for its URL.
    pub(super) stale: Option<Stale>,
    /// `deferIfLimited`: a limited write is queued and replayed at the rule's rate.
    pub(super) defer: Option<std::sync::Arc<Defer>>,
}

/// The methods whose limited requests `deferIfLimited` may queue.
pub const WRITE_METHODS: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];

/// A rule's `deferIfLimited`, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defer {
    pub max_body_bytes: usize,
    /// Lowercase names of the request headers the replay carries, `content-type` first.
    pub headers: Vec<String>,
    /// Lowercase.
    pub idempotency_header: Option<String>,
    /// Per key: entries, and bytes.
    pub max_queued: u64,
    pub max_queued_bytes: u64,
    pub max_attempts: u32,
    /// µs.
    pub retry_interval: Micros,
    pub keep_status: Micros,
}

/// A rule's `staleIfLimited`, compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    /// The oldest kept response served (µs).
    pub max_stale: Micros,
    /// The largest response body kept.
    pub max_entry_bytes: usize,
    /// At most one read per URL per this (µs) refreshes the kept response while limited.
    pub revalidate_every: Option<Micros>,
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
    pub fn leasing(&self) -> Option<crate::rule::Leasing> {
        self.leasing
    }
    /// `staleIfLimited`, when a limited read may be answered with a kept response.
    pub fn stale(&self) -> Option<Stale> {
        self.stale
    }
    /// `deferIfLimited`, when a limited write may be queued.
    pub fn defer(&self) -> Option<&Defer> {
        self.defer.as_deref()
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
    /// `spec.egress`, compiled.
    pub fn egress(&self) -> &[super::egress::CompiledEgress] {
        &self.egress
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

/// Content hash of compiled policies in (namespace, name) order: 16 hex digits of SHA-256 over
/// each policy's qualified name and spec. The same function names a whole snapshot and the part
/// of it one caller may see, so a sidecar that compiles the sources it was given gets the
/// version it was told.
pub(super) fn version_of<'a>(policies: impl IntoIterator<Item = &'a CompiledPolicy>) -> String {
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
pub(super) fn header_names_of<'a>(policies: impl IntoIterator<Item = &'a CompiledPolicy>) -> Vec<String> {
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
    /// The `staleIfLimited` of the rules `req` matches (the longest `maxStale` and largest
    /// entry among them); `None` when none has it.
    pub fn stale_for(&self, req: &super::RequestView<'_>) -> Option<Stale> {
        if !self.serves_stale {
            return None;
        }
        let mut matched = Vec::new();
        self.resolve(req, &mut matched);
        matched.iter().filter_map(|m| m.rule.stale).reduce(|a, b| Stale {
            max_stale: a.max_stale.max(b.max_stale),
            max_entry_bytes: a.max_entry_bytes.max(b.max_entry_bytes),
            // The least often: each rule's interval is a bound on what reaches the application.
            revalidate_every: match (a.revalidate_every, b.revalidate_every) {
                (Some(x), Some(y)) => Some(x.max(y)),
                _ => None,
            },
        })
    }
    /// The `deferIfLimited` rule a limited write `req` is queued under: the first rule it
    /// matches that has it (policies by name, rules as written). `None` for a method that is
    /// not a write.
    pub fn defer_for(&self, req: &super::RequestView<'_>) -> Option<&CompiledRule> {
        if !self.defers || !WRITE_METHODS.iter().any(|m| req.method.eq_ignore_ascii_case(m)) {
            return None;
        }
        let mut matched = Vec::new();
        self.resolve(req, &mut matched);
        matched.into_iter().map(|m| m.rule).find(|rule| rule.defer.is_some())
    }
    /// The `deferIfLimited` rules of the policies selecting a workload of `namespace` with
    /// `labels`: the queues its sidecars replay.
    pub fn deferring_rules_for(
        &self,
        namespace: &str,
        labels: &dyn crate::request::names::StrMap,
    ) -> Vec<&CompiledRule> {
        if !self.defers {
            return Vec::new();
        }
        self.namespace_policies(namespace)
            .iter()
            .filter(|p| super::matching::selector_matches_labels(&p.selector, labels))
            .flat_map(|p| p.rules.iter().filter(|r| r.defer.is_some()))
            .collect()
    }
    /// The shaping rules of every policy's `spec.egress` (one per entry; entries naming one
    /// destination in a namespace share their rule's id).
    pub fn egress_rules(&self) -> impl Iterator<Item = &CompiledRule> {
        self.policies.iter().flat_map(|p| p.egress.iter().map(|e| &e.rule))
    }
    /// The `spec.egress` entries a workload of `namespace` with `labels` may call: those of the
    /// policies selecting it, by policy name, each name once (the first policy's).
    pub fn egress_for(
        &self,
        namespace: &str,
        labels: &dyn crate::request::names::StrMap,
    ) -> Vec<(&str, &super::egress::CompiledEgress)> {
        let mut offered: Vec<(&str, &super::egress::CompiledEgress)> = Vec::new();
        for policy in self.namespace_policies(namespace) {
            if !super::matching::selector_matches_labels(&policy.selector, labels) {
                continue;
            }
            for entry in &policy.egress {
                if !offered.iter().any(|(_, e)| e.name == entry.name) {
                    offered.push((policy.qualified_name(), entry));
                }
            }
        }
        offered
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
