//! The checks of a policy's fields. [`super::compile`] walks a policy once, checking each field
//! with these and building its compiled form in the same step, and the admission webhook's
//! [`super::compile::validate`] is that same walk: admission never accepts what compile rejects,
//! and nothing is checked twice. The checks cover everything the CRD's CEL rules check (a policy
//! loaded from a file never saw an API server) plus what CEL cannot: regexes, header names, the
//! numeric limits of the algorithms.

use super::pattern::PolicyRegex as Regex;

use super::crd::{
    DescriptorEntryMatch, HeaderMatch, KeyPart, LimitSpec, MAX_DESCRIPTOR_KEY_LEN, MAX_DURATION_LEN,
    MAX_HEADER_NAME_LEN, MAX_LITERAL_LEN, MAX_MATCH_ITEMS, MAX_NAME_LEN, MAX_PATTERN_LEN, MAX_REFUSAL_BODY_LEN,
    MAX_REFUSAL_HEADER_VALUE_LEN, MAX_REFUSAL_HEADERS, MAX_REGEX_BYTES, MAX_REGEX_BYTES_PER_POLICY,
    MAX_REGEXES_PER_POLICY, Missing, OverloadSpec, PathMatch, PolicyRule, RateLimitPolicy, RefusalSpec,
    regex_count_message,
};
use super::errors::ValidationErrors;
use super::path::normalize;
use crate::algorithm::{Algorithm, Limit, LimitError};
use crate::duration::{Micros, parse_duration};
use crate::request::names::{HOP_BY_HOP, is_token, same_header_name};

/// Above this many requests per window a slidingWindowLog rule is admitted with a warning.
const LOG_WARN_REQUESTS: u64 = 100;

/// The regexes of one policy in walk order: field path and compiled size (0 for one that does
/// not compile, or that was not compiled because the policy already has too many).
#[derive(Default)]
pub(super) struct RegexBudget {
    sizes: Vec<(String, usize)>,
}

impl RegexBudget {
    /// Compiles a policy regex, noting its size for the budget or reporting why it does not
    /// compile. Past the count budget (reported once for the policy by [`RegexBudget::check`])
    /// regexes are only counted: a policy file for `sluice serve`, which no CEL checked, may hold
    /// thousands.
    pub(super) fn regex(
        &mut self,
        pattern: &str,
        ignore_case: bool,
        path: String,
        errs: &mut ValidationErrors,
    ) -> Option<Regex> {
        if self.sizes.len() >= MAX_REGEXES_PER_POLICY {
            self.sizes.push((path, 0));
            return None;
        }
        match compile_regex(pattern, ignore_case) {
            Ok(re) => {
                self.sizes.push((path, re.memory_usage()));
                Some(re)
            }
            Err(m) => {
                errs.push(path.clone(), m);
                self.sizes.push((path, 0));
                None
            }
        }
    }

    /// The policy's regex budget: how many regexes (the CRD's CEL counts them too) and their
    /// compiled size in total (which only this can measure).
    pub(super) fn check(&self, errs: &mut ValidationErrors) {
        let regexes = &self.sizes;
        if regexes.len() > MAX_REGEXES_PER_POLICY {
            errs.push(
                "spec.rules",
                format!(
                    "{}, got {} (the first over the budget: {})",
                    regex_count_message(),
                    regexes.len(),
                    regexes[MAX_REGEXES_PER_POLICY].0
                ),
            );
        }
        let total: usize = regexes.iter().map(|(_, size)| size).sum();
        if total > MAX_REGEX_BYTES_PER_POLICY {
            let mut sum = 0;
            if let Some((path, size)) = regexes.iter().find(|(_, size)| {
                sum += size;
                sum > MAX_REGEX_BYTES_PER_POLICY
            }) {
                errs.push(
                path.clone(),
                format!(
                    "the policy's regexes take {total} bytes compiled, over the budget of {} per policy; this one \
                     ({size} bytes) is the first over it: simplify or merge regexes (Unicode classes such as \\w, \\d or \\p{{L}} \
                     are large, ASCII classes such as [a-z0-9] or (?-u) small; counted repetitions multiply the size)",
                    human_bytes(MAX_REGEX_BYTES_PER_POLICY)
                ),
            );
            }
        }
    }
}

/// Parses a rule's limit, reporting problems at the right field path.
///
/// `Limit::new` stops at the first problem, so once it blames burst or maxDelay for not applying
/// to the algorithm, it is asked again without that field: the user then learns of the other
/// problems (such as a cost above the capacity) in the same round. The limit returned may
/// therefore exist although errors were reported; callers decide by `errs`.
pub(crate) fn build_limit(
    algorithm: Algorithm,
    spec: &LimitSpec,
    path: &str,
    errs: &mut ValidationErrors,
) -> Option<Limit> {
    for (field, text) in [("per", Some(&spec.per)), ("maxDelay", spec.max_delay.as_ref())] {
        if text.is_some_and(|t| t.len() > MAX_DURATION_LEN) {
            errs.push(format!("{path}.{field}"), format!("at most {MAX_DURATION_LEN} characters"));
        }
    }
    let per = match parse_duration(&spec.per) {
        Ok(per) => Some(per),
        Err(e) => {
            errs.push(format!("{path}.per"), e.to_string());
            None
        }
    };
    let mut max_delay: Option<Micros> = None;
    if let Some(text) = &spec.max_delay {
        match parse_duration(text) {
            Ok(d) => max_delay = Some(d),
            Err(e) => {
                errs.push(format!("{path}.maxDelay"), e.to_string());
            }
        }
    }
    let per = per?;
    let mut burst = spec.burst;
    for _ in 0..3 {
        match Limit::new(algorithm, spec.requests, per, burst, max_delay) {
            Ok(limit) => return Some(limit),
            Err(e) => {
                let field = match &e {
                    LimitError::ZeroRequests
                    | LimitError::TooManyRequests
                    | LimitError::LogTooLong
                    | LimitError::TooManyConcurrent => "requests",
                    LimitError::PeriodTooShort
                    | LimitError::PeriodNotWholeMilliseconds(_)
                    | LimitError::PeriodTooLong => "per",
                    LimitError::ZeroBurst | LimitError::BurstTooLarge | LimitError::BucketTooLarge => "burst",
                    LimitError::BurstNotApplicable(_) => "burst",
                    LimitError::MaxDelayNotApplicable(_) => "maxDelay",
                    LimitError::RateTooHigh { .. } | LimitError::WindowProductTooLarge => "requests",
                    LimitError::ReservationNotApplicable(_) => "algorithm",
                    LimitError::ReservationWithShaping => "maxDelay",
                    LimitError::ReservationTtlOutOfRange => "responseCost.reservationTtl",
                    LimitError::LeaseNotApplicable(..) | LimitError::LeaseWithReservation => "consistency",
                };
                errs.push(format!("{path}.{field}"), e.to_string());
                match e {
                    LimitError::BurstNotApplicable(_) => burst = None,
                    LimitError::MaxDelayNotApplicable(_) => max_delay = None,
                    _ => return None,
                }
            }
        }
    }
    None
}

/// Headers a declared refusal may not set: connection-level ones, the body's length (Sluice
/// frames the body), and the rate-limit headers Sluice writes itself.
const RESERVED_REFUSAL_HEADERS: [&str; 7] = [
    "content-length",
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "retry-after",
];

pub(super) fn check_refusal(r: &RefusalSpec, path: &str, errs: &mut ValidationErrors) {
    if !(200..=599).contains(&r.status) {
        errs.push(format!("{path}.status"), format!("{} is not a status between 200 and 599", r.status));
    }
    if r.headers.len() > MAX_REFUSAL_HEADERS {
        errs.push(format!("{path}.headers"), format!("at most {MAX_REFUSAL_HEADERS}, got {}", r.headers.len()));
    }
    for (name, value) in &r.headers {
        let lower = name.to_ascii_lowercase();
        if !is_token(name) {
            errs.push(format!("{path}.headers"), format!("{name:?} is not a header name"));
        } else if HOP_BY_HOP.contains(&lower.as_str()) || RESERVED_REFUSAL_HEADERS.contains(&lower.as_str()) {
            errs.push(format!("{path}.headers"), format!("{name} is set by Sluice or the connection, not by a policy"));
        }
        if value.len() > MAX_REFUSAL_HEADER_VALUE_LEN || value.bytes().any(|b| b < 0x20 && b != b'\t' || b == 0x7f) {
            errs.push(
                format!("{path}.headers.{name}"),
                format!("a header value of at most {MAX_REFUSAL_HEADER_VALUE_LEN} bytes without control characters"),
            );
        }
    }
    if r.body.as_ref().is_some_and(|b| b.len() > MAX_REFUSAL_BODY_LEN) {
        errs.push(format!("{path}.body"), format!("at most {MAX_REFUSAL_BODY_LEN} bytes"));
    }
}

/// Checks `spec.overload` but its `exempt` conditions, which compile walks as matches.
pub(super) fn check_overload(o: &OverloadSpec, errs: &mut ValidationErrors) {
    let path = "spec.overload";
    if let Some(refusal) = &o.refusal {
        check_refusal(refusal, &format!("{path}.refusal"), errs);
    }
    if o.min_limit > o.max_limit {
        errs.push(format!("{path}.minLimit"), format!("{} exceeds maxLimit {}", o.min_limit, o.max_limit));
    }
    if o.initial_limit < o.min_limit || o.initial_limit > o.max_limit {
        errs.push(
            format!("{path}.initialLimit"),
            format!("{} is outside [minLimit, maxLimit] = [{}, {}]", o.initial_limit, o.min_limit, o.max_limit),
        );
    }
    if o.default_share > 100 || o.sheddable_share > 100 {
        errs.push(format!("{path}.defaultShare"), "shares are percentages, at most 100");
    }
    if o.sheddable_share > o.default_share {
        errs.push(
            format!("{path}.sheddableShare"),
            "must not exceed defaultShare: sheddable requests are refused first",
        );
    }
    if !(100..=1000).contains(&o.tolerance_percent) {
        errs.push(format!("{path}.tolerancePercent"), "between 100 and 1000");
    }
    for (field, value) in [("cpuPressurePercent", o.cpu_pressure_percent), ("memoryPercent", o.memory_percent)] {
        if value.is_some_and(|v| v == 0 || v > 100) {
            errs.push(format!("{path}.{field}"), "a percentage between 1 and 100");
        }
    }
    for (field, value) in [
        ("criticalWait", &o.critical_wait),
        ("retryAfter", &o.retry_after),
        ("retryAfterJitter", &o.retry_after_jitter),
    ] {
        if let Some(text) = value
            && let Err(e) = parse_duration(text)
        {
            errs.push(format!("{path}.{field}"), e.to_string());
        }
    }
}

/// Checks a path condition; its regex, compiled, when it has one that compiles.
pub(super) fn check_path_match(
    p: &PathMatch,
    path: &str,
    budget: &mut RegexBudget,
    errs: &mut ValidationErrors,
) -> Option<Regex> {
    let set = [p.exact.is_some(), p.prefix.is_some(), p.regex.is_some()].iter().filter(|b| **b).count();
    if set != 1 {
        errs.push(path, format!("needs exactly one of exact, prefix or regex, got {set}"));
    }
    for (field, value) in [("exact", &p.exact), ("prefix", &p.prefix)] {
        if let Some(v) = value {
            if !v.starts_with('/') {
                errs.push(format!("{path}.{field}"), format!("must start with '/', got {v:?}"));
            } else if v.contains('?') {
                errs.push(format!("{path}.{field}"), "must not contain '?': the query string is not matched");
            }
            if v.len() > MAX_PATTERN_LEN {
                errs.push(format!("{path}.{field}"), format!("at most {MAX_PATTERN_LEN} characters"));
            }
        }
    }
    let re = p.regex.as_ref()?;
    budget.regex(re, p.ignore_case.unwrap_or(false), format!("{path}.regex"), errs)
}

/// Checks a header condition; its regex, compiled, when it has one that compiles.
pub(super) fn check_header_match(
    h: &HeaderMatch,
    path: &str,
    budget: &mut RegexBudget,
    errs: &mut ValidationErrors,
) -> Option<Regex> {
    if !is_token(&h.name) || h.name.len() > MAX_HEADER_NAME_LEN {
        errs.push(format!("{path}.name"), format!("invalid header name {:?}", h.name));
    }
    for (field, value) in [("exact", &h.exact), ("prefix", &h.prefix)] {
        if value.as_ref().is_some_and(|v| v.len() > MAX_PATTERN_LEN) {
            errs.push(format!("{path}.{field}"), format!("at most {MAX_PATTERN_LEN} characters"));
        }
    }
    let set =
        [h.exact.is_some(), h.prefix.is_some(), h.regex.is_some(), h.present.is_some()].iter().filter(|b| **b).count();
    if set != 1 {
        errs.push(path, format!("needs exactly one of exact, prefix, regex or present, got {set}"));
    }
    let re = h.regex.as_ref()?;
    budget.regex(re, false, format!("{path}.regex"), errs)
}

/// Checks a descriptor entry condition; its regex, compiled, when it has one that compiles.
pub(super) fn check_descriptor_entry(
    entry: &DescriptorEntryMatch,
    path: &str,
    budget: &mut RegexBudget,
    errs: &mut ValidationErrors,
) -> Option<Regex> {
    if entry.key.is_empty() || entry.key.len() > MAX_DESCRIPTOR_KEY_LEN {
        errs.push(format!("{path}.key"), format!("must be 1 to {MAX_DESCRIPTOR_KEY_LEN} characters"));
    }
    let set = [entry.exact.is_some(), entry.prefix.is_some(), entry.regex.is_some()].iter().filter(|b| **b).count();
    if set > 1 {
        errs.push(path, format!("takes at most one of exact, prefix or regex, got {set}"));
    }
    for (field, value) in [("exact", &entry.exact), ("prefix", &entry.prefix)] {
        if value.as_ref().is_some_and(|v| v.len() > MAX_PATTERN_LEN) {
            errs.push(format!("{path}.{field}"), format!("at most {MAX_PATTERN_LEN} characters"));
        }
    }
    for (field, values) in [("notIn", &entry.not_in), ("notPrefix", &entry.not_prefix)] {
        if values.len() > MAX_MATCH_ITEMS {
            errs.push(format!("{path}.{field}"), format!("at most {MAX_MATCH_ITEMS} entries, got {}", values.len()));
        }
        if let Some(j) = values.iter().position(|v| v.len() > MAX_PATTERN_LEN) {
            errs.push(format!("{path}.{field}[{j}]"), format!("at most {MAX_PATTERN_LEN} characters"));
        }
    }
    let re = entry.regex.as_ref()?;
    budget.regex(re, false, format!("{path}.regex"), errs)
}

/// Descriptor key parts belong to rules that match descriptors, and name one of their entries;
/// such rules key on nothing an HTTP request carries.
pub(super) fn check_descriptor_keys(rule: &PolicyRule, path: &str, errs: &mut ValidationErrors) {
    let entries = rule.matches.as_ref().map_or(&[][..], |m| m.descriptor.as_slice());
    for (j, part) in rule.key.iter().enumerate() {
        if let Some(key) = &part.descriptor
            && !entries.iter().any(|e| &e.key == key)
        {
            errs.push(
                format!("{path}.key[{j}].descriptor"),
                format!("{key:?} is not the key of an entry in match.descriptor"),
            );
        }
        let http = part.header.is_some()
            || part.client_ip.is_some()
            || part.path.is_some()
            || part.method.is_some()
            || part.host.is_some();
        if !entries.is_empty() && http {
            errs.push(
                format!("{path}.key[{j}]"),
                "a rule matching descriptors keys only on descriptor, namespace and literal parts: a descriptor carries no HTTP request",
            );
        }
    }
}

pub(super) fn check_key_part(k: &KeyPart, path: &str, errs: &mut ValidationErrors) {
    let flags = [
        ("clientIP", k.client_ip),
        ("namespace", k.namespace),
        ("path", k.path),
        ("method", k.method),
        ("host", k.host),
    ];
    let set = flags.iter().filter(|(_, v)| v.is_some()).count()
        + usize::from(k.header.is_some())
        + usize::from(k.descriptor.is_some())
        + usize::from(k.literal.is_some());
    if set != 1 {
        errs.push(
            path,
            format!(
                "needs exactly one of header, clientIP, namespace, path, method, host, descriptor or literal, got {set}"
            ),
        );
    }
    if k.descriptor.as_ref().is_some_and(|d| d.is_empty() || d.len() > MAX_DESCRIPTOR_KEY_LEN) {
        errs.push(format!("{path}.descriptor"), format!("must be 1 to {MAX_DESCRIPTOR_KEY_LEN} characters"));
    }
    for (field, value) in flags {
        if value == Some(false) {
            errs.push(format!("{path}.{field}"), format!("write `{field}: true` (false is not meaningful)"));
        }
    }
    if let Some(name) = &k.header
        && (!is_token(name) || name.len() > MAX_HEADER_NAME_LEN)
    {
        errs.push(format!("{path}.header"), format!("invalid header name {name:?}"));
    }
    if k.literal.as_ref().is_some_and(|l| l.len() > MAX_LITERAL_LEN) {
        errs.push(format!("{path}.literal"), format!("at most {MAX_LITERAL_LEN} characters"));
    }
    if k.missing.is_some() && k.header.is_none() && k.client_ip.is_none() {
        errs.push(format!("{path}.missing"), "only applies to header and clientIP key parts");
    }
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters: rule names appear in metrics, headers
/// and keys.
pub(crate) fn check_rule_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    let ok_char = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    if b.is_empty() {
        return Err("required".into());
    }
    if b.len() > MAX_NAME_LEN {
        return Err(format!("at most {MAX_NAME_LEN} characters"));
    }
    if !b.iter().all(ok_char) || b[0] == b'-' || b[b.len() - 1] == b'-' {
        return Err(format!(
            "invalid name {name:?}: use lowercase letters, digits and '-', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// An RFC 1123 label such as a namespace name: what [`check_rule_name`] accepts.
pub(crate) fn is_dns_label(name: &str) -> bool {
    check_rule_name(name).is_ok()
}

pub(super) fn check_host_pattern(host: &str) -> Result<(), String> {
    let name = host.strip_prefix("*.").unwrap_or(host);
    if name.is_empty() {
        return Err(format!("invalid host {host:?}"));
    }
    if name.contains('*') {
        return Err(format!(
            "invalid host {host:?}: a wildcard is only allowed as the whole first label, as in *.example.com"
        ));
    }
    if name.contains(':') && !name.starts_with('[') {
        return Err(format!("invalid host {host:?}: write the name without a port (ports are ignored)"));
    }
    if !name.bytes().all(|c| c.is_ascii_alphanumeric() || b"-.[]:".contains(&c)) {
        return Err(format!("invalid host {host:?}"));
    }
    Ok(())
}

/// Compiles a user regex anchored to the whole input, with size caps: the compiled program
/// (NFA) and the lazy DFA's cache at most [`MAX_REGEX_BYTES`] each, matched in bounded time
/// ([`super::pattern`]); `memory_usage()` of the result is what the policy's regex budget counts.
/// `ignore_case`: letters match in either case (a path match's `ignoreCase`).
pub fn compile_regex(pattern: &str, ignore_case: bool) -> Result<Regex, String> {
    if pattern.len() > MAX_PATTERN_LEN {
        return Err(format!("at most {MAX_PATTERN_LEN} characters"));
    }
    // An inline flag rather than a builder option: the text carries it to every engine built
    // from it.
    let flags = if ignore_case { "(?i)" } else { "" };
    Regex::new(&format!("{flags}{pattern}")).map_err(|e| {
        if e.size_limit().is_some() {
            format!("regex {pattern:?} is too complex: it compiles to more than {}", human_bytes(MAX_REGEX_BYTES))
        } else {
            let detail = e.syntax_error().map_or_else(|| e.to_string(), ToString::to_string);
            format!("invalid regex {pattern:?}: {}", one_line(&detail))
        }
    })
}

/// `1048576` → `1 MiB (1048576 bytes)`, for messages.
pub(crate) fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB ({n} bytes)", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{} KiB ({n} bytes)", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// Risky but valid choices, for the webhook to return as admission warnings.
pub fn warnings(policy: &RateLimitPolicy) -> Vec<String> {
    let mut out = Vec::new();
    for (i, rule) in policy.spec.rules.iter().enumerate() {
        let path = format!("spec.rules[{i}]");
        let m = rule.matches.clone().unwrap_or_default();
        for (j, part) in rule.key.iter().enumerate() {
            if part.path == Some(true) && m.paths.is_empty() {
                out.push(format!(
                    "{path}.key[{j}]: keyed on the path with no match.paths restriction: every distinct path (including scanners' random ones) gets its own counter"
                ));
            }
            if let Some(name) = &part.header {
                let restricted = m.headers.iter().any(|h| {
                    same_header_name(&h.name, name) && (h.exact.is_some() || h.prefix.is_some() || h.regex.is_some())
                });
                if !restricted {
                    out.push(format!(
                        "{path}.key[{j}]: keyed on header {name} whose values are not restricted by match.headers: each distinct value (chosen by the client) gets its own counter"
                    ));
                }
                if part.missing == Some(Missing::Skip) {
                    out.push(format!(
                        "{path}.key[{j}]: missing: skip exempts requests without header {name} from this rule: a client can leave the header out to avoid the limit"
                    ));
                }
            }
            if part.client_ip.is_some() && part.missing == Some(Missing::Skip) {
                out.push(format!("{path}.key[{j}]: missing: skip exempts requests without a client IP from this rule"));
            }
        }
        for (j, p) in m.paths.iter().enumerate() {
            for (field, pattern) in [("exact", &p.exact), ("prefix", &p.prefix)] {
                let Some(pattern) = pattern.as_deref().filter(|v| v.starts_with('/')) else { continue };
                let read_as = normalize(pattern);
                if read_as != pattern {
                    out.push(format!(
                        "{path}.match.paths[{j}].{field}: requests are matched on their normalized path, which never reads {pattern:?} (it reads {read_as:?}): this entry never matches as written"
                    ));
                }
            }
        }
        if rule.algorithm == Algorithm::SlidingWindowLog && rule.limit.requests > LOG_WARN_REQUESTS {
            out.push(format!(
                "{path}.algorithm: slidingWindowLog keeps one entry per admitted request and reads them all on every decision: {} requests per window per key cost memory and store time; consider slidingWindowCounter",
                rule.limit.requests
            ));
        }
        if rule.cost == 0 {
            out.push(format!("{path}.cost: 0 means this rule never counts anything"));
        }
    }
    out
}
