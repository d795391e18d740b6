//! Which rules a request matches, and the counter key each of them uses.
//!
//! # Key encoding
//!
//! A rule's key is its parts' values in order, each written as `<byte length>:<value>` with the
//! length in decimal, and nothing between parts: `["a|b", "c"]` is `3:a|b1:c`, `["a", "b|c"]`
//! is `1:a3:b|c`. Length prefixes make the encoding unambiguous whatever bytes the values hold
//! (header values are client-chosen). A rule without key parts has the empty key. The key does
//! not name the rule: stores pair it with the rule's [`RuleId`](crate::rule::RuleId).

use std::fmt::Write as _;
use std::net::IpAddr;

use super::crd::{Missing, OverloadSpec};
use super::snapshot::{
    CompiledPolicy, CompiledRule, DescriptorEntryMatcher, HeaderTest, HostMatcher, KeySource, PathMatcher, RuleMatch,
    Selector, SelectorOp, Snapshot,
};
use crate::overload::Class;
use crate::request::names::{NoEntries, StrMap};

/// One rate limit descriptor (Envoy's `RateLimitDescriptor`): an ordered list of (key, value)
/// entries, borrowed from whatever the gRPC layer decoded.
pub trait Descriptor: Sync {
    fn entry_count(&self) -> usize;
    /// Entry `i` as (key, value); `None` past the end.
    fn entry(&self, i: usize) -> Option<(&str, &str)>;

    /// The value of the first entry with `key`.
    fn value_of(&self, key: &str) -> Option<&str> {
        (0..self.entry_count()).filter_map(|i| self.entry(i)).find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

impl<K: AsRef<str> + Sync, V: AsRef<str> + Sync> Descriptor for Vec<(K, V)> {
    fn entry_count(&self) -> usize {
        self.len()
    }
    fn entry(&self, i: usize) -> Option<(&str, &str)> {
        self.get(i).map(|(k, v)| (k.as_ref(), v.as_ref()))
    }
}

/// A request as the matcher sees it, borrowed from whatever the HTTP layer parsed.
#[derive(Clone, Copy)]
pub struct RequestView<'a> {
    /// The workload's namespace (the check API defaults it to `default`).
    pub namespace: &'a str,
    /// The workload's labels, for policy selectors.
    pub labels: &'a dyn StrMap,
    pub method: &'a str,
    /// May include `?query`, which matching and keys ignore; matched and keyed in its
    /// normalized form ([`super::path::normalize`]).
    pub path: &'a str,
    /// As sent (any case, possibly with `:port`).
    pub host: Option<&'a str>,
    pub client_ip: Option<IpAddr>,
    /// Looked up by canonical name ([`canonical_header_name`]).
    pub headers: &'a dyn StrMap,
    /// The request's own cost, multiplied by each rule's cost.
    pub cost: u64,
    /// Top-level fields of the request's JSON body that rules' `responseCost.estimate` read
    /// (their values as text), by name.
    pub fields: &'a dyn StrMap,
    /// Set for one descriptor of an Envoy rate limit request (then method, path, host, client
    /// IP and headers are empty): only rules with `match.descriptor` apply to it. `None` for an
    /// HTTP request, to which no such rule applies.
    pub descriptor: Option<&'a dyn Descriptor>,
    /// Set for a call to a `spec.egress` downstream (by entry name): only that entry's shaping
    /// rule applies, and no other rule. `None` for a request to the workload.
    pub egress: Option<&'a str>,
    /// The caller's own deadline (µs): a shaping rule refuses at once a request whose wait
    /// would exceed it, instead of admitting it to wait in vain.
    pub max_wait: Option<crate::algorithm::Micros>,
}

impl<'a> RequestView<'a> {
    /// A `GET` of `path` in namespace `default`, without labels, host, client IP or headers, of
    /// cost 1; set the other fields directly.
    pub fn new(path: &'a str) -> Self {
        RequestView {
            namespace: super::DEFAULT_NAMESPACE,
            labels: &NoEntries,
            method: "GET",
            path,
            host: None,
            client_ip: None,
            headers: &NoEntries,
            cost: 1,
            fields: &NoEntries,
            descriptor: None,
            egress: None,
            max_wait: None,
        }
    }

    /// One descriptor of an Envoy rate limit request in `namespace` (the request's domain), of
    /// `cost`.
    pub fn descriptor(namespace: &'a str, descriptor: &'a dyn Descriptor, cost: u64) -> Self {
        RequestView { namespace, cost, descriptor: Some(descriptor), ..RequestView::new("/") }
    }

    fn path_only(&self) -> &'a str {
        match self.path.find('?') {
            Some(i) => &self.path[..i],
            None => self.path,
        }
    }
}

impl std::fmt::Debug for RequestView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestView")
            .field("namespace", &self.namespace)
            .field("method", &self.method)
            .field("path", &self.path)
            .field("host", &self.host)
            .field("client_ip", &self.client_ip)
            .field("cost", &self.cost)
            .finish_non_exhaustive()
    }
}

/// A rule that applies to a request, with the request's key and effective cost for it.
#[derive(Debug, Clone)]
pub struct Matched<'s> {
    pub rule: &'s CompiledRule,
    /// Encoded as described in the [module docs](self).
    pub key: String,
    /// rule cost × request cost (saturating).
    pub cost: u64,
}

impl<'s> Matched<'s> {
    /// What the store needs for this rule.
    pub fn check(&self) -> crate::rule::RuleCheck<'_> {
        self.rule.check(self.key.as_bytes(), self.cost)
    }
}

impl Snapshot {
    /// Replaces `out` with the rules `req` matches, in a deterministic order: the namespace's
    /// policies by name, each policy's rules in the order written. Allocates only the keys.
    pub fn resolve<'s>(&'s self, req: &RequestView<'_>, out: &mut Vec<Matched<'s>>) {
        out.clear();
        if let Some(name) = req.egress {
            // An egress check: only the entry it names, offered by a policy selecting the caller.
            if let Some((_, entry)) =
                self.egress_for(req.namespace, req.labels).into_iter().find(|(_, e)| e.name == name)
            {
                out.push(Matched { rule: &entry.rule, key: entry.key.clone(), cost: 1 });
            }
            return;
        }
        // Matching and keys see the path the way the application's router does.
        let (path, host) = matching_inputs(req);
        let path = path.as_ref();
        for policy in self.namespace_policies(req.namespace) {
            if !selector_matches(&policy.selector, req.labels) {
                continue;
            }
            resolve_policy(policy, req, path, host, out);
        }
    }
}

impl Snapshot {
    /// The class of `req` when its workload is overloaded: the first `spec.priorities` entry it
    /// matches, over the policies selecting its workload in their order (by name); `default`
    /// when none does. With the policy that classified it.
    pub fn classify(&self, req: &RequestView<'_>) -> (Class, Option<&str>) {
        let (path, host) = matching_inputs(req);
        let path = path.as_ref();
        for policy in self.namespace_policies(req.namespace) {
            if policy.priorities.is_empty() || !selector_matches(&policy.selector, req.labels) {
                continue;
            }
            if let Some((class, _)) = policy.priorities.iter().find(|(_, m)| rule_matches(m, req, path, host)) {
                return (*class, Some(policy.qualified_name()));
            }
        }
        (Class::Default, None)
    }

    /// Whether the overload protection leaves `req` alone: an `overload.exempt` entry of a
    /// policy selecting its workload matches it.
    pub fn exempt_from_overload(&self, req: &RequestView<'_>) -> bool {
        let (path, host) = matching_inputs(req);
        let path = path.as_ref();
        self.namespace_policies(req.namespace)
            .iter()
            .filter(|p| !p.exempt.is_empty() && selector_matches(&p.selector, req.labels))
            .any(|p| p.exempt.iter().any(|m| rule_matches(m, req, path, host)))
    }

    /// The overload protection of a workload of `namespace` with `labels`: the first policy (by
    /// name) selecting it that has `spec.overload`, and that spec.
    pub fn overload_for(&self, namespace: &str, labels: &dyn StrMap) -> Option<(&str, &OverloadSpec)> {
        self.namespace_policies(namespace)
            .iter()
            .filter(|p| selector_matches(&p.selector, labels))
            .find_map(|p| Some((p.qualified_name(), p.overload()?)))
    }
}

impl CompiledRule {
    /// This rule's key for `req`, whether or not the rule matches it (`None`: a `missing: skip`
    /// part has no value): what a deferred write's status URL is checked against.
    pub fn key_for(&self, req: &RequestView<'_>) -> Option<String> {
        let (path, host) = matching_inputs(req);
        build_key(&self.key, req, path.as_ref(), host).ok()
    }
}

fn resolve_policy<'s>(
    policy: &'s CompiledPolicy,
    req: &RequestView<'_>,
    path: &str,
    host: Option<&str>,
    out: &mut Vec<Matched<'s>>,
) {
    for rule in &policy.rules {
        if !rule_matches(&rule.matcher, req, path, host) {
            continue;
        }
        if let Ok(key) = build_key(&rule.key, req, path, host) {
            out.push(Matched { rule, key, cost: rule.cost_for(req) });
        }
    }
}

/// The path and host rules see: the path without query, normalized; the host without port or
/// trailing dot. What [`Snapshot::resolve`] matches on, for tools that explain it.
pub(super) fn matching_inputs<'r>(req: &RequestView<'r>) -> (std::borrow::Cow<'r, str>, Option<&'r str>) {
    (super::path::normalize(req.path_only()), req.host.map(host_without_port))
}

fn selector_matches(selector: &Selector, labels: &dyn StrMap) -> bool {
    selector_mismatch(selector, labels).is_none()
}

/// Whether a policy's selector takes in a workload with `labels`.
pub(super) fn selector_matches_labels(selector: &Selector, labels: &dyn StrMap) -> bool {
    selector_matches(selector, labels)
}

/// The first selector condition the labels fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SelectorMismatch {
    /// `matchLabels` entry (index into [`Selector::labels`]).
    Label(usize),
    /// `matchExpressions` entry (index into [`Selector::expressions`]).
    Expression(usize),
}

/// Why `labels` fail `selector`, or `None` when they match. [`selector_matches`] is defined by
/// it, so explaining and matching cannot drift apart.
pub(super) fn selector_mismatch(selector: &Selector, labels: &dyn StrMap) -> Option<SelectorMismatch> {
    if let Some(i) = selector.labels.iter().position(|(k, v)| labels.get_str(k) != Some(v.as_str())) {
        return Some(SelectorMismatch::Label(i));
    }
    selector
        .expressions
        .iter()
        .position(|(key, op, values)| {
            let value = labels.get_str(key);
            !match op {
                SelectorOp::In => value.is_some_and(|v| values.iter().any(|x| x == v)),
                SelectorOp::NotIn => value.is_none_or(|v| values.iter().all(|x| x != v)),
                SelectorOp::Exists => value.is_some(),
                SelectorOp::DoesNotExist => value.is_none(),
            }
        })
        .map(SelectorMismatch::Expression)
}

fn rule_matches(m: &RuleMatch, req: &RequestView<'_>, path: &str, host: Option<&str>) -> bool {
    rule_mismatch(m, req, path, host).is_none()
}

/// The first condition of a rule's `match` a request fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RuleMismatch {
    Method,
    Path,
    Host,
    /// Index into [`RuleMatch::headers`].
    Header(usize),
    /// The rule matches descriptors and this is an HTTP request, or the other way round.
    Kind,
    /// The descriptor has another number of entries than the rule's `match.descriptor`.
    DescriptorLength,
    /// Index into [`RuleMatch::descriptor`]: that entry's key or value differs.
    DescriptorEntry(usize),
}

/// Why a request fails `m` (conditions in the order they are written: methods, paths, hosts,
/// headers), or `None` when it matches. [`rule_matches`] is defined by it, so explaining and
/// matching cannot drift apart. `path` and `host` as [`matching_inputs`] gives them.
pub(super) fn rule_mismatch(
    m: &RuleMatch,
    req: &RequestView<'_>,
    path: &str,
    host: Option<&str>,
) -> Option<RuleMismatch> {
    match (m.descriptor.is_empty(), req.descriptor) {
        (true, None) => {}
        (false, Some(descriptor)) => return descriptor_mismatch(&m.descriptor, descriptor),
        _ => return Some(RuleMismatch::Kind),
    }
    if !(m.methods.is_empty() || m.methods.iter().any(|x| x.eq_ignore_ascii_case(req.method))) {
        return Some(RuleMismatch::Method);
    }
    if !(m.paths.is_empty() || m.paths.iter().any(|p| path_matches(p, path))) {
        return Some(RuleMismatch::Path);
    }
    if !(m.hosts.is_empty() || host.is_some_and(|h| m.hosts.iter().any(|x| host_matches(x, h)))) {
        return Some(RuleMismatch::Host);
    }
    m.headers.iter().position(|h| !value_passes(&h.test, req.headers.get_str(&h.name))).map(RuleMismatch::Header)
}

fn descriptor_mismatch(entries: &[DescriptorEntryMatcher], descriptor: &dyn Descriptor) -> Option<RuleMismatch> {
    if descriptor.entry_count() != entries.len() {
        return Some(RuleMismatch::DescriptorLength);
    }
    entries
        .iter()
        .enumerate()
        .position(|(i, e)| {
            let Some((key, value)) = descriptor.entry(i) else { return true };
            key != e.key
                || !value_passes(&e.test, Some(value))
                || e.not_in.iter().any(|x| x == value)
                || e.not_prefix.iter().any(|p| value.starts_with(p.as_str()))
        })
        .map(RuleMismatch::DescriptorEntry)
}

/// Whether a header (or descriptor entry) value, `None` when absent, passes `test`.
fn value_passes(test: &HeaderTest, value: Option<&str>) -> bool {
    match test {
        HeaderTest::Exact(x) => value == Some(x.as_str()),
        HeaderTest::Prefix(x) => value.is_some_and(|v| v.starts_with(x.as_str())),
        HeaderTest::Regex(re) => value.is_some_and(|v| re.is_match(v)),
        HeaderTest::Present(want) => value.is_some() == *want,
    }
}

/// Prefixes match whole segments, as in the Gateway API: `/orders` matches `/orders` and
/// `/orders/1` but not `/ordersX`.
fn path_matches(m: &PathMatcher, path: &str) -> bool {
    let same = |a: &[u8], b: &[u8], ignore_case: bool| if ignore_case { a.eq_ignore_ascii_case(b) } else { a == b };
    match m {
        PathMatcher::Exact { path: x, ignore_case } => same(path.as_bytes(), x.as_bytes(), *ignore_case),
        PathMatcher::Prefix { prefix, .. } if prefix == "/" => true,
        PathMatcher::Prefix { prefix, ignore_case } => {
            let (path, prefix) = (path.as_bytes(), prefix.as_bytes());
            path.get(..prefix.len()).is_some_and(|head| same(head, prefix, *ignore_case))
                && matches!(path.get(prefix.len()), None | Some(b'/'))
        }
        PathMatcher::Regex(re) => re.is_match(path),
    }
}

fn host_matches(m: &HostMatcher, host: &str) -> bool {
    match m {
        HostMatcher::Exact(x) => host.eq_ignore_ascii_case(x),
        HostMatcher::Suffix(suffix) => {
            host.len() > suffix.len()
                && host.is_char_boundary(host.len() - suffix.len())
                && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        }
    }
}

/// `Host` without port or trailing dot: `API.example.com:8443` → `API.example.com`,
/// `[::1]:80` → `[::1]`. A bare IPv6 address (several colons) has no port to strip.
fn host_without_port(host: &str) -> &str {
    let host = if host.starts_with('[') {
        match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        }
    } else {
        match host.rfind(':') {
            Some(i) if !host[..i].contains(':') => &host[..i],
            _ => host,
        }
    };
    host.strip_suffix('.').unwrap_or(host)
}

/// `Err(i)` when part `i` has `missing: skip` and no value: the rule does not apply.
pub(super) fn build_key(
    parts: &[KeySource],
    req: &RequestView<'_>,
    path: &str,
    host: Option<&str>,
) -> Result<String, usize> {
    if parts.is_empty() {
        return Ok(String::new());
    }
    let mut key = String::with_capacity(parts.len() * 24);
    for (i, part) in parts.iter().enumerate() {
        match part {
            KeySource::Header(name, missing) => match req.headers.get_str(name) {
                Some(v) => push_part(&mut key, v),
                None if *missing == Missing::Skip => return Err(i),
                None => push_part(&mut key, ""),
            },
            KeySource::ClientIp(missing) => match req.client_ip {
                Some(ip) => push_ip(&mut key, ip.to_canonical()),
                None if *missing == Missing::Skip => return Err(i),
                None => push_part(&mut key, ""),
            },
            KeySource::Namespace => push_part(&mut key, req.namespace),
            KeySource::Path => push_part(&mut key, path),
            KeySource::LowercasePath => {
                push_len(&mut key, path.len());
                key.extend(path.chars().map(|c| c.to_ascii_lowercase()));
            }
            KeySource::Method => {
                push_len(&mut key, req.method.len());
                key.extend(req.method.chars().map(|c| c.to_ascii_uppercase()));
            }
            KeySource::Host => {
                let h = host.unwrap_or("");
                push_len(&mut key, h.len());
                key.extend(h.chars().map(|c| c.to_ascii_lowercase()));
            }
            KeySource::Descriptor(entry) => {
                // validate() ties the part to an entry of match.descriptor, which matched.
                push_part(&mut key, req.descriptor.and_then(|d| d.value_of(entry)).unwrap_or(""))
            }
            KeySource::Literal(text) => push_part(&mut key, text),
        }
    }
    // What a store would make of it anyway (store::keys), done now: the request holds 64 bytes
    // per rule while it waits for the store, not every key part's value again.
    if key.len() > crate::rule::MAX_INLINE_KEY {
        key = crate::rule::long_key_digest(key.as_bytes());
    }
    Ok(key)
}

fn push_len(key: &mut String, len: usize) {
    crate::decimal::push_decimal(key, len as u64);
    key.push(':');
}

fn push_part(key: &mut String, value: &str) {
    push_len(key, value.len());
    key.push_str(value);
}

/// An IP's canonical text, after its length: an IPv4's length counted from its octets, an IPv6's
/// (at most 39 bytes) learnt by formatting it on the stack first.
fn push_ip(key: &mut String, ip: IpAddr) {
    if let IpAddr::V4(v4) = ip {
        // The common case without `fmt`: the text's length first, then the text.
        push_len(key, crate::decimal::ipv4_text_len(v4));
        crate::decimal::push_ipv4(key, v4);
        return;
    }
    let mut buf = StackBuf { bytes: [0; 48], len: 0 };
    let _ = write!(buf, "{ip}");
    push_part(key, buf.as_str());
}

struct StackBuf {
    bytes: [u8; 48],
    len: usize,
}

impl StackBuf {
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or("")
    }
}

impl std::fmt::Write for StackBuf {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = self.len + s.len();
        if end > self.bytes.len() {
            return Err(std::fmt::Error);
        }
        self.bytes[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// Encodes key parts the way [`Snapshot::resolve`] does, for tests and tools.
pub fn encode_key<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut key = String::new();
    for p in parts {
        push_part(&mut key, p);
    }
    key
}
