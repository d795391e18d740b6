//! `spec.egress`: downstreams a workload calls, shaped by its sidecar against one budget per
//! destination shared by every replica of every workload of the namespace that names it.
//!
//! Each entry compiles to a leaky-bucket rule with `maxDelay` (a shaper: departures evenly
//! spaced, each caller told how long to wait for its own) whose identity is the namespace and
//! the destination, not the policy: two policies naming the same destination count one budget,
//! and must agree on its limit. Egress rules are not matched against requests: a check names
//! its egress entry ([`super::RequestView::egress`]), and only the policies selecting the
//! caller's workload offer it.

use super::crd::{EgressSpec, Mode};
use super::errors::ValidationErrors;
use super::snapshot::{CompiledRule, KeySource, RuleMatch, rule_id};
use super::validate::{build_limit, check_rule_name};
use crate::algorithm::{Algorithm, Limit};

/// Waiting requests one sidecar holds per entry when `maxWaiting` is not given.
pub const DEFAULT_MAX_WAITING: u32 = 256;
/// The body a waiting request may carry when `maxBodyBytes` is not given.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;

/// Where egress requests go: scheme, host and port, parsed once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub tls: bool,
    /// Without brackets for IPv6.
    pub host: String,
    pub port: u16,
}

impl Destination {
    /// `host:port` (IPv6 in brackets): the budget's key and the request's authority.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Parses `http://host[:port]` or `https://host[:port]` (a trailing `/` allowed).
    pub fn parse(text: &str) -> Result<Destination, String> {
        let lower = text.to_ascii_lowercase();
        let (tls, rest) = if let Some(rest) = lower.strip_prefix("https://") {
            (true, rest)
        } else if let Some(rest) = lower.strip_prefix("http://") {
            (false, rest)
        } else {
            return Err("must start with http:// or https://".into());
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#']) {
            return Err("must not have a path or query: requests keep the path the application sent".into());
        }
        if rest.contains('@') {
            return Err("must not carry a user".into());
        }
        let (host, port) = match rest.strip_prefix('[') {
            Some(bracketed) => {
                let (host, after) = bracketed.split_once(']').ok_or("an IPv6 address needs its closing ]")?;
                if host.parse::<std::net::Ipv6Addr>().is_err() {
                    return Err(format!("{host:?} is not an IPv6 address"));
                }
                (host, after.strip_prefix(':'))
            }
            None => match rest.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            },
        };
        let name_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        if host.is_empty() || !(host.contains(':') || host.chars().all(name_char)) {
            return Err(format!("{host:?} is not a host name or address"));
        }
        let port = match port {
            None => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(text) => {
                text.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("port {text:?} is not 1 to 65535"))?
            }
        };
        Ok(Destination { tls, host: host.to_string(), port })
    }
}

/// One compiled `spec.egress` entry.
#[derive(Debug)]
pub struct CompiledEgress {
    pub name: String,
    pub destination: Destination,
    pub listen_port: u16,
    pub ca_bundle: Option<String>,
    pub max_waiting: u32,
    pub max_body_bytes: u64,
    /// Lowercase.
    pub deadline_header: Option<String>,
    /// The shaping rule the entry's requests are decided by; its key is
    /// [`Destination::authority`].
    pub rule: CompiledRule,
    pub key: String,
}

/// Checks and compiles one entry at `path` (`spec.egress[i]`); `None` when it has problems (in
/// `errs`).
pub(super) fn compile(
    spec: &EgressSpec,
    namespace: &str,
    policy: &str,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<CompiledEgress> {
    let before = errs.errors.len();
    if let Err(m) = check_rule_name(&spec.name) {
        errs.push(format!("{path}.name"), m);
    }
    let destination = match Destination::parse(&spec.destination) {
        Ok(d) => Some(d),
        Err(m) => {
            errs.push(format!("{path}.destination"), format!("{m}: {:?}", spec.destination));
            None
        }
    };
    if spec.listen_port < 1024 {
        errs.push(
            format!("{path}.listenPort"),
            format!("must be 1024 to 65535 (the sidecar runs unprivileged), got {}", spec.listen_port),
        );
    }
    if spec.limit.max_delay.is_none() {
        errs.push(
            format!("{path}.limit.maxDelay"),
            "an egress limit shapes: limit.maxDelay (the longest a request waits for its slot) is required",
        );
    }
    if spec.limit.burst.is_some() {
        errs.push(format!("{path}.limit.burst"), "an egress queue is bounded by limit.maxDelay: remove limit.burst");
    }
    if let Some(pem) = &spec.ca_bundle {
        if destination.as_ref().is_some_and(|d| !d.tls) {
            errs.push(
                format!("{path}.caBundle"),
                "caBundle verifies an https:// destination: remove it, or use https://",
            );
        }
        if let Err(m) = check_certificates(pem) {
            errs.push(format!("{path}.caBundle"), m);
        }
    }
    let max_waiting = spec.max_waiting.unwrap_or(DEFAULT_MAX_WAITING);
    if !(1..=10_000).contains(&max_waiting) {
        errs.push(format!("{path}.maxWaiting"), format!("must be 1 to 10000, got {max_waiting}"));
    }
    let max_body_bytes = spec.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if max_body_bytes > 16 << 20 {
        errs.push(format!("{path}.maxBodyBytes"), format!("must be at most 16777216, got {max_body_bytes}"));
    }
    let deadline_header = spec.deadline_header.as_ref().map(|h| h.to_ascii_lowercase());
    if let Some(name) = &deadline_header
        && !crate::request::names::is_token(name)
    {
        errs.push(format!("{path}.deadlineHeader"), format!("{name:?} is not a header name"));
    }
    let limit = build_limit(Algorithm::LeakyBucket, &spec.limit, &format!("{path}.limit"), errs).and_then(queue_of);
    if errs.errors.len() > before {
        return None;
    }
    let destination = destination?;
    let limit = limit?;
    let key = destination.authority();
    let identity = format!("{namespace}/egress/{key}");
    let rule = CompiledRule {
        id: rule_id(&identity),
        identity,
        policy: format!("{namespace}/{policy}").into(),
        name: format!("egress-{}", spec.name).into(),
        limit,
        per_text: spec.limit.per.clone(),
        max_delay_text: spec.limit.max_delay.clone(),
        mode: Mode::Enforce,
        on_store_failure: spec.on_store_failure,
        cost: 1,
        matcher: RuleMatch::default(),
        key: vec![KeySource::Literal(key.clone())],
        refusal: None,
        retry_after_jitter: 0,
        response_cost: None,
        leasing: None,
        stale: None,
        defer: None,
    };
    Some(CompiledEgress {
        name: spec.name.clone(),
        destination,
        listen_port: spec.listen_port,
        ca_bundle: spec.ca_bundle.clone(),
        max_waiting,
        max_body_bytes,
        deadline_header,
        rule,
        key,
    })
}

/// The shaper with a queue as long as `maxDelay` holds: a queue of `burst` would otherwise
/// refuse requests `maxDelay` admits.
fn queue_of(limit: Limit) -> Option<Limit> {
    let max_delay = limit.max_delay()?;
    let queue = (max_delay / limit.interval()).saturating_add(1);
    Limit::new(Algorithm::LeakyBucket, limit.requests(), limit.per(), Some(queue), Some(max_delay))
        .or_else(|_| Limit::new(Algorithm::LeakyBucket, limit.requests(), limit.per(), None, Some(max_delay)))
        .ok()
}

/// How many certificates a PEM bundle holds, or what is wrong with it: each `CERTIFICATE` block
/// must hold base64 (the sidecar parses the certificates themselves when it connects).
pub fn check_certificates(pem: &str) -> Result<usize, String> {
    use base64::Engine as _;
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut count = 0;
    let mut rest = pem;
    while let Some(start) = rest.find(BEGIN) {
        let body = &rest[start + BEGIN.len()..];
        let end = body.find(END).ok_or("a CERTIFICATE block has no END line")?;
        let text: String = body[..end].chars().filter(|c| !c.is_ascii_whitespace()).collect();
        base64::engine::general_purpose::STANDARD
            .decode(&text)
            .map_err(|e| format!("certificate {} is not base64: {e}", count + 1))?;
        count += 1;
        rest = &body[end + END.len()..];
    }
    if count == 0 {
        return Err("holds no PEM certificate".into());
    }
    Ok(count)
}

/// Two policies of a namespace giving one destination different limits: the later one (by
/// name) is refused, naming the first.
pub(super) fn conflict(first: &CompiledEgress, first_policy: &str, other: &CompiledEgress) -> Option<String> {
    (first.rule.limit != other.rule.limit || first.rule.on_store_failure != other.rule.on_store_failure).then(|| {
        format!(
            "destination {} already has another limit in policy {first_policy} ({} per {}, maxDelay {}, onStoreFailure {}): one destination, one budget",
            first.key,
            first.rule.limit.requests(),
            first.rule.per_text,
            first.rule.max_delay_text.as_deref().unwrap_or("-"),
            first.rule.on_store_failure.name(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{RateLimitPolicy, compile};

    fn policy(name: &str, egress: &str) -> RateLimitPolicy {
        serde_yaml::from_str(&format!(
            "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: pay}}\nspec:\n  selector: {{matchLabels: {{app: {name}}}}}\n  egress:\n{egress}"
        ))
        .expect("parses")
    }

    fn entry(destination: &str, port: u16, limit: &str) -> String {
        format!("  - {{name: bank, destination: \"{destination}\", listenPort: {port}, limit: {limit}}}\n")
    }

    fn problems(p: &RateLimitPolicy) -> String {
        crate::policy::validate(p).map_or_else(|e| e.to_string(), |()| String::new())
    }

    #[test]
    fn destinations_parse_to_scheme_host_and_port() {
        let d = Destination::parse("https://Bank.Example.com").unwrap();
        assert_eq!(
            (d.tls, d.host.as_str(), d.port, d.authority()),
            (true, "bank.example.com", 443, "bank.example.com:443".into())
        );
        assert_eq!(Destination::parse("http://[::1]:8080/").unwrap().authority(), "[::1]:8080");
        for bad in ["ftp://b", "bank.example.com", "https://b/pay", "https://b?x=1", "https://u@b", "https://"] {
            assert!(Destination::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_mistake_is_named_by_its_field() {
        let ok = "{requests: 5, per: 1s, maxDelay: 1s}";
        assert_eq!(problems(&policy("a", &entry("https://b", 15100, ok))), "");
        let cases = [
            (entry("https://b/x", 15100, ok), "spec.egress[0].destination"),
            (entry("https://b", 80, ok), "spec.egress[0].listenPort"),
            (entry("https://b", 15100, "{requests: 5, per: 1s}"), "spec.egress[0].limit.maxDelay"),
            (entry("https://b", 15100, "{requests: 5, per: 1s, maxDelay: 1s, burst: 2}"), "spec.egress[0].limit.burst"),
            (entry("https://b", 15100, "{requests: 5, per: 1x, maxDelay: 1s}"), "spec.egress[0].limit.per"),
            (format!("{}{}", entry("https://b", 15100, ok), entry("https://c", 15101, ok)), "spec.egress[1].name"),
            (
                "  - {name: b, destination: \"https://b\", listenPort: 15100, caBundle: nope, limit: {requests: 5, per: 1s, maxDelay: 1s}}\n".into(),
                "spec.egress[0].caBundle",
            ),
            (
                "  - {name: b, destination: \"https://b\", listenPort: 15100, deadlineHeader: \"x y\", limit: {requests: 5, per: 1s, maxDelay: 1s}}\n".into(),
                "spec.egress[0].deadlineHeader",
            ),
        ];
        for (egress, field) in cases {
            let found = problems(&policy("a", &egress));
            assert!(found.contains(field), "{field}: {found}");
        }
    }

    #[test]
    fn the_queue_is_what_max_delay_holds() {
        let compiled = compile(vec![policy("a", &entry("https://b", 15100, "{requests: 10, per: 1s, maxDelay: 2s}"))]);
        let rule = &compiled.snapshot.policies()[0].egress()[0].rule;
        assert!(rule.limit().shapes());
        // 2 s at 100 ms apart: 20 waiting, plus the one leaving now.
        assert_eq!(rule.limit().burst(), 21);
    }

    #[test]
    fn one_destination_one_budget_across_policies() {
        let same = "{requests: 10, per: 1s, maxDelay: 2s}";
        let first = policy("a", &entry("https://b", 15100, same));
        let agreeing = policy("b", &entry("https://b:443", 15101, same));
        let compiled = compile(vec![first.clone(), agreeing]);
        assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
        let ids: Vec<_> = compiled.snapshot.egress_rules().map(|r| r.id()).collect();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids[0], ids[1], "one key for one destination");
        let other = policy("c", &entry("https://b", 15102, "{requests: 99, per: 1s, maxDelay: 2s}"));
        let compiled = compile(vec![first, other]);
        assert_eq!(compiled.rejected.len(), 1);
        let message = compiled.rejected[0].errors.to_string();
        assert!(compiled.rejected[0].policy == "pay/c" && message.contains("pay/a"), "{message}");
    }
}
