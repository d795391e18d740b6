//! The `RateLimitPolicy` custom resource: what users write, as the API server stores it.
//!
//! These raw types stay at the edge: [`super::validate`] checks them and [`super::compile`] turns
//! them into a [`super::Snapshot`] of ready-to-use rules. Doc comments here are what
//! `kubectl explain ratelimitpolicy.spec…` prints, so they are written for policy authors.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::core::Rule as CelRule;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::algorithm::{Algorithm, LimitError, MAX_LOG_REQUESTS, MAX_REQUESTS};
use crate::overload::Class;

/// Bounds that keep every CEL rule's estimated cost within the API server's budget, and a
/// policy small enough to read. The schema attributes below use these constants, so the CRD
/// and [`super::validate`] enforce the same numbers.
pub const MAX_RULES: usize = 64;
pub const MAX_MATCH_ITEMS: usize = 32;
pub const MAX_KEY_PARTS: usize = 8;
pub const MAX_PATTERN_LEN: usize = 1024;
pub const MAX_NAME_LEN: usize = 63;
pub const MAX_HEADER_NAME_LEN: usize = 256;
pub const MAX_LITERAL_LEN: usize = 256;
pub const MAX_DURATION_LEN: usize = 32;
/// Entries of one Envoy rate limit descriptor a rule matches (Envoy's own descriptors are a few
/// entries deep).
pub const MAX_DESCRIPTOR_ENTRIES: usize = 8;
/// Length of a descriptor entry's key.
pub const MAX_DESCRIPTOR_KEY_LEN: usize = 256;

/// Budget per policy: regexes (`match.paths[].regex`, `match.headers[].regex` and
/// `match.descriptor[].regex` of all rules together). Every regex is compiled by the webhook, every replica and every sidecar, and
/// each request a rule sees runs its regexes. The CRD's CEL enforces the count; only
/// [`super::validate`] (webhook, compile, `sluice serve`) can measure the compiled size.
pub const MAX_REGEXES_PER_POLICY: usize = 64;
/// Budget per policy: the sum of the compiled sizes (`regex_automata::meta::Regex::memory_usage`)
/// of all its regexes.
pub const MAX_REGEX_BYTES_PER_POLICY: usize = 1 << 20;
/// Per regex: each of its compiled NFAs (what `regex` calls `size_limit`) and each of its lazy DFA
/// caches (allocated as matching needs them, one forward and one reverse per matching thread) at
/// most this size.
pub const MAX_REGEX_BYTES: usize = 256 * 1024;

/// Regex (RE2 syntax, as CEL `matches` uses) of the duration syntax `crate::duration::parse_duration`
/// accepts, minus the oddities it tolerates (such as `1.s`).
pub const DURATION_PATTERN: &str = r"^(0|(([0-9]+(\.[0-9]+)?|\.[0-9]+)(us|µs|ms|s|m|h|d))+)$";

/// CEL check that a duration field has the accepted syntax.
fn duration_rule(field: &str) -> CelRule {
    // Inside a single-quoted CEL string a backslash is written twice.
    let pattern = DURATION_PATTERN.replace('\\', "\\\\");
    CelRule::new(format!("self.matches('{pattern}')"))
        .message(kube::core::Message::Message(format!("{field} must be a duration such as 1s, 500ms, 1m or 1h")))
}

/// CEL: a slidingWindowLog rule allows at most [`MAX_LOG_REQUESTS`] requests per window, with the
/// message `validate` gives (reported at `spec.rules[i].limit.requests`).
fn log_cap_rule() -> CelRule {
    CelRule::new(format!("self.algorithm != 'slidingWindowLog' || self.limit.requests <= {MAX_LOG_REQUESTS}"))
        .message(kube::core::Message::Message(LimitError::LogTooLong.to_string()))
        .field_path(".limit.requests")
}

/// The message of the regex count budget, shared by CEL and `validate`.
pub(crate) fn regex_count_message() -> String {
    format!(
        "at most {MAX_REGEXES_PER_POLICY} regexes per policy (match.paths, match.headers and match.descriptor of all rules and priorities together)"
    )
}

/// CEL: at most [`MAX_REGEXES_PER_POLICY`] regexes in the policy (reported at `spec.rules`).
fn regex_count_rule() -> CelRule {
    let count = |list: &str, var: &str| {
        format!("(has(r.match.{list}) ? r.match.{list}.filter({var}, has({var}.regex)).size() : 0)")
    };
    let in_priorities = |list: &str, var: &str| {
        format!("(has(e.match.{list}) ? e.match.{list}.filter({var}, has({var}.regex)).size() : 0)")
    };
    CelRule::new(format!(
        "(has(self.rules) ? self.rules.map(r, has(r.match) ? {} + {} + {} : 0).sum() : 0) + (has(self.priorities) ? self.priorities.map(e, {} + {}).sum() : 0) <= {MAX_REGEXES_PER_POLICY}",
        count("paths", "p"),
        count("headers", "h"),
        count("descriptor", "d"),
        in_priorities("paths", "p"),
        in_priorities("headers", "h"),
    ))
    .message(kube::core::Message::Message(regex_count_message()))
    .field_path(".rules")
}

/// A RateLimitPolicy declares rate limits for the workloads of one namespace.
///
/// Every request a selected workload receives is matched against each rule; a request that
/// matches several rules (of this or other policies) is admitted only if every enforcing rule
/// admits it, and only then does each of them count it.
// Several printer columns share `type_ = "string"`, which the lint mistakes for a repeated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "sluice.dev",
    version = "v1alpha1",
    kind = "RateLimitPolicy",
    namespaced,
    status = "RateLimitPolicyStatus",
    shortname = "rlp",
    category = "sluice",
    derive = "PartialEq",
    doc = "RateLimitPolicy declares rate limits for the workloads of one namespace.",
    printcolumn(
        name = "Accepted",
        type_ = "string",
        description = "Whether the policy is valid and was compiled",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Enforced",
        type_ = "string",
        description = "Whether the snapshot holding this policy is live in the enforcement endpoint",
        json_path = ".status.conditions[?(@.type==\"Enforced\")].status"
    ),
    printcolumn(
        name = "Snapshot",
        type_ = "string",
        description = "Version of the rule snapshot this policy was compiled into",
        json_path = ".status.snapshot",
        priority = 1
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = CelRule::new("!has(self.rules) || self.rules.all(r, self.rules.exists_one(s, s.name == r.name))").message("rule names must be unique within a policy"))]
#[x_kube(validation = regex_count_rule())]
#[x_kube(validation = CelRule::new("(has(self.rules) && size(self.rules) > 0) || has(self.overload) || (has(self.egress) && size(self.egress) > 0)").message("at least one rule is required (or spec.overload, or spec.egress)").field_path(".rules"))]
#[x_kube(validation = CelRule::new("!has(self.egress) || self.egress.all(e, self.egress.exists_one(f, f.name == e.name))").message("egress names must be unique within a policy").field_path(".egress"))]
#[x_kube(validation = CelRule::new("!has(self.egress) || self.egress.all(e, self.egress.exists_one(f, f.listenPort == e.listenPort))").message("egress listen ports must be unique within a policy").field_path(".egress"))]
#[serde(rename_all = "camelCase")]
pub struct RateLimitPolicySpec {
    /// Which workloads (pods, by their labels) of this namespace the policy applies to, as a
    /// standard label selector with `matchLabels` and `matchExpressions` (operators In, NotIn,
    /// Exists, DoesNotExist). Absent or empty: every workload in the namespace.
    ///
    /// Example: `selector: {matchLabels: {app: orders}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,

    /// The limits. Each rule counts the requests it matches, separately for each distinct key
    /// (for example per API key or per client IP). At least one rule (none only in a policy
    /// with `overload`), at most 64; names unique.
    ///
    /// Budget per policy, so that one policy cannot burden the shared system: at most 64 rules;
    /// at most 64 regexes (match.paths, match.headers and match.descriptor of all rules
    /// together), compiled to at most 1 MiB in total and 256 KiB each; slidingWindowLog at most
    /// 1000 requests per window.
    /// The regex sizes are measured by the admission webhook (and `sluice serve`), not by the
    /// schema.
    #[serde(default)]
    #[schemars(length(max = MAX_RULES))]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    pub rules: Vec<PolicyRule>,

    /// How much each request matters when the workload is overloaded (see `overload`): a list
    /// of classes with the requests they take, the first matching entry wins, and a request no
    /// entry matches is `default`. Classes, from the first refused to the last: `sheddable`,
    /// `default`, `critical`. `sluice explain` shows each request's class. At most 16 entries;
    /// their regexes count against the policy's regex budget (see `spec.rules`).
    ///
    /// Example: `priorities: [{class: critical, match: {paths: [{prefix: /checkout}]}},
    /// {class: sheddable, match: {paths: [{prefix: /reports}]}}]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_PRIORITIES))]
    pub priorities: Vec<PriorityEntry>,

    /// Protection of the selected workloads from overload, by their sidecar: it limits the
    /// requests in flight to the application with a limit it adapts to the application's own
    /// latency (and the container's CPU and memory pressure), and past it refuses the lowest
    /// class first (see `priorities`) with 503 and `Retry-After`. Absent: no such protection.
    /// When several policies select a workload, the first by namespace/name with `overload`
    /// decides. docs/overload.md explains the model and every field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overload: Option<OverloadSpec>,

    /// What admission does with the layering report about this policy's rules: a rule that can
    /// never refuse because a tighter rule in front of it (same or coarser key, taking in every
    /// request it counts) always refuses first, an inner rule whose sustained rate is above the
    /// one in front of it, a shadow rule whose enforcement would change nothing, and an
    /// `onStoreFailure: localFallback` whose per-replica shares add up to more than the limit.
    /// `warn` (default): the admission webhook answers the findings as warnings, and the
    /// operator sets the policy's `LayeringConsistent` condition to False and records an Event.
    /// `strict`: the webhook also refuses a policy with findings about its own rules. The rules
    /// of other policies of the namespace count as layers in front. docs/policy.md explains the
    /// report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layering: Option<LayeringMode>,

    /// Downstreams the selected workloads call, shaped by their sidecars so that the
    /// downstream sees at most the declared rate from all of them together: every replica of
    /// every workload in this namespace that names the same `destination` draws on one budget
    /// in the shared store. The application sends plain HTTP to `127.0.0.1:<listenPort>`; the
    /// sidecar asks for a departure slot, holds the request until its slot (at most
    /// `limit.maxDelay`), then sends it to the destination, originating TLS for `https://`.
    /// A request whose wait would exceed `maxDelay` (or its caller's own deadline) is refused
    /// at once with 429 and `Retry-After`. At most 16 entries; names and listen ports unique.
    /// docs/egress.md explains the model.
    ///
    /// Example: `egress: [{name: bank, destination: "https://bank.example.com", listenPort:
    /// 15100, limit: {requests: 50, per: 1s, maxDelay: 2s}}]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_EGRESS))]
    pub egress: Vec<EgressSpec>,
}

/// Most `spec.egress` entries per policy.
pub const MAX_EGRESS: usize = 16;

/// A downstream whose calls the sidecar shapes (`spec.egress`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = CelRule::new("self.destination.startsWith('http://') || self.destination.startsWith('https://')").message("destination must be an http:// or https:// URL").field_path(".destination"))]
#[x_kube(validation = CelRule::new("!has(self.caBundle) || self.destination.startsWith('https://')").message("caBundle verifies an https:// destination: remove it, or use https://").field_path(".caBundle"))]
#[x_kube(validation = CelRule::new("has(self.limit.maxDelay)").message("an egress limit shapes: limit.maxDelay (the longest a request waits for its slot) is required").field_path(".limit.maxDelay"))]
#[x_kube(validation = CelRule::new("!has(self.limit.burst)").message("an egress queue is bounded by limit.maxDelay: remove limit.burst").field_path(".limit.burst"))]
#[serde(rename_all = "camelCase")]
pub struct EgressSpec {
    /// Names the downstream in metrics, answers and `sluice explain`: lowercase letters, digits
    /// and '-', at most 63 characters.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,

    /// Where the requests go: `http://host[:port]` or `https://host[:port]`, without path,
    /// query or user. The budget is this destination's: every policy of the namespace that
    /// names it must give it the same limit.
    #[schemars(length(min = 1, max = 512))]
    pub destination: String,

    /// The port on 127.0.0.1 in the pod where the sidecar takes the application's plain
    /// HTTP requests for this destination (1024 to 65535, not the sidecar's own ports).
    #[schemars(range(min = 1024, max = 65535))]
    pub listen_port: u16,

    /// The destination's rate: `requests` per `per`, departures evenly spaced, and `maxDelay`,
    /// the longest a request waits for its departure (required). `burst` does not apply: the
    /// queue is what `maxDelay` holds.
    pub limit: LimitSpec,

    /// What happens while the shared store is away: `localFallback` (default) shapes in the
    /// endpoint replica's memory at its share of the rate (limit ÷ replicas), `allow` sends
    /// at once, `deny` refuses.
    #[serde(default)]
    pub on_store_failure: FailureMode,

    /// PEM certificates that verify an `https://` destination instead of the system roots
    /// (a private CA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 65536))]
    pub ca_bundle: Option<String>,

    /// The most requests one sidecar holds waiting for their slots; more are refused at once
    /// with 503. Default 256, at most 10000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_waiting: Option<u32>,

    /// The largest request body the sidecar holds while a request waits (it reads the body
    /// first, so that a caller going away is noticed and its slot given back); larger ones get
    /// 413. Default 1048576 (1 MiB), at most 16777216. A sidecar holds at most `maxWaiting` ×
    /// this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16777216))]
    pub max_body_bytes: Option<u64>,

    /// A request header carrying the caller's own deadline in milliseconds: a request whose
    /// wait would exceed it is refused at once instead of waiting in vain. `grpc-timeout` is
    /// always honoured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub deadline_header: Option<String>,
}

/// What admission does with the layering report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum LayeringMode {
    /// Warn, set the condition and record an Event; admit.
    #[default]
    Warn,
    /// Refuse a policy whose rules the report finds fault with.
    Strict,
}

/// Bound on `spec.priorities`: each entry's match runs on every request of the workload.
pub const MAX_PRIORITIES: usize = 16;

/// One entry of `spec.priorities`: requests it matches get its class.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PriorityEntry {
    /// `critical`, `default` or `sheddable`.
    pub class: Class,
    /// Which requests: methods, paths, hosts and headers as in a rule's `match` (no
    /// `descriptor`). Empty: every request.
    #[serde(default, rename = "match")]
    pub matches: Match,
}

/// The sidecar's adaptive protection of its application.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = CelRule::new("self.minLimit <= self.maxLimit").message("overload.minLimit must not exceed overload.maxLimit"))]
#[x_kube(validation = CelRule::new("self.sheddableShare <= self.defaultShare").message("overload.sheddableShare must not exceed overload.defaultShare: sheddable requests are refused first"))]
#[serde(rename_all = "camelCase")]
pub struct OverloadSpec {
    /// `enforce` (default): refuse over the limit. `shadow`: compute the limit and count what
    /// would be refused (`sluice_sidecar_overload_would_shed_total`), refuse nothing.
    #[serde(default)]
    pub mode: Mode,
    /// The limit on requests in flight to the application at start, before any latency is
    /// measured. Default 20.
    #[serde(default = "default_initial_limit")]
    #[schemars(range(min = 1, max = 100000))]
    pub initial_limit: u32,
    /// The limit never goes below this. Default 4.
    #[serde(default = "default_min_limit")]
    #[schemars(range(min = 1, max = 100000))]
    pub min_limit: u32,
    /// The limit never goes above this. Default 1000.
    #[serde(default = "default_max_limit")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_limit: u32,
    /// How much latency growth is tolerated before the limit comes down, in percent of the
    /// application's long-term latency: 120 (default) lets the recent latency reach 1.2 times
    /// it. Lower protects latency harder; higher lets more requests queue in the application
    /// (Netflix's Gradient2 uses 150).
    #[serde(default = "default_tolerance")]
    #[schemars(range(min = 100, max = 1000))]
    pub tolerance_percent: u32,
    /// The share of the limit, in percent, that `default` requests may fill; the rest is kept
    /// for `critical` ones. Default 80.
    #[serde(default = "default_default_share")]
    #[schemars(range(min = 0, max = 100))]
    pub default_share: u32,
    /// The share of the limit, in percent, that `sheddable` requests may fill. Default 50.
    #[serde(default = "default_sheddable_share")]
    #[schemars(range(min = 0, max = 100))]
    pub sheddable_share: u32,
    /// Critical requests over the limit may wait this long for a slot (a duration such as
    /// `100ms`), at most `criticalQueue` of them at once; absent or `0`: they are refused at
    /// once.
    #[x_kube(validation = duration_rule("criticalWait"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub critical_wait: Option<String>,
    /// How many critical requests may wait at once (with `criticalWait`). Default 32.
    #[serde(default = "default_critical_queue")]
    #[schemars(range(min = 0, max = 10000))]
    pub critical_queue: u32,
    /// The container's CPU pressure, in percent, past which the limit comes down whatever the
    /// latency: cgroup v2 `cpu.pressure` (some avg10), or the share of CPU periods throttled
    /// by the container's CPU limit (v1 and v2). Absent: CPU is not watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub cpu_pressure_percent: Option<u32>,
    /// The container's memory use, in percent of its limit, past which the limit comes down.
    /// Absent: memory is not watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub memory_percent: Option<u32>,
    /// `Retry-After` of a refused request, a duration (default `1s`), rounded up to seconds.
    #[x_kube(validation = duration_rule("retryAfter"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub retry_after: Option<String>,
    /// A spread added to `Retry-After`, uniformly at random per refusal, so refused clients do
    /// not all come back in the same second (e.g. `4s`). Absent: none.
    #[x_kube(validation = duration_rule("retryAfterJitter"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub retry_after_jitter: Option<String>,
    /// What a shed request gets instead of `503 Service Unavailable` with a problem+json body
    /// (e.g. a `200` with a reduced answer); `Retry-After` is added unless its headers set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<RefusalSpec>,
    /// Requests the protection leaves alone: never refused, never counted in flight, never a
    /// latency sample. For long polls and other requests whose response head waits on an event
    /// rather than on work (their time would read as queueing), and for health checks. Each
    /// entry matches like a rule's `match` (no `descriptor`), at most 16; WebSocket upgrades and
    /// server-sent event streams need none (their slot ends at the response head).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_PRIORITIES))]
    pub exempt: Vec<Match>,
}

fn default_initial_limit() -> u32 {
    20
}
fn default_min_limit() -> u32 {
    4
}
fn default_max_limit() -> u32 {
    1000
}
fn default_tolerance() -> u32 {
    120
}
fn default_default_share() -> u32 {
    80
}
fn default_sheddable_share() -> u32 {
    50
}
fn default_critical_queue() -> u32 {
    32
}

/// One rate limit: which requests it counts, how they are grouped into counters, and how many
/// are allowed.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = CelRule::new("!has(self.limit.burst) || self.algorithm in ['tokenBucket', 'gcra', 'leakyBucket']").message("limit.burst is only used by tokenBucket, gcra and leakyBucket"))]
#[x_kube(validation = CelRule::new("!has(self.limit.maxDelay) || self.algorithm == 'leakyBucket'").message("limit.maxDelay is only used by leakyBucket"))]
#[x_kube(validation = CelRule::new("!has(self.cost) || self.cost <= (has(self.limit.burst) ? self.limit.burst : self.limit.requests)").message("cost must not exceed limit.burst (or limit.requests when there is no burst): such a request could never be admitted"))]
#[x_kube(validation = log_cap_rule())]
#[x_kube(validation = CelRule::new("self.key.all(k, !has(k.descriptor) || (has(self.match) && has(self.match.descriptor) && self.match.descriptor.exists(e, e.key == k.descriptor)))").message("a descriptor key part needs an entry with that key in match.descriptor"))]
#[x_kube(validation = CelRule::new("!has(self.match) || !has(self.match.descriptor) || size(self.match.descriptor) == 0 || self.key.all(k, !has(k.header) && !has(k.clientIP) && !has(k.path) && !has(k.method) && !has(k.host))").message("a rule matching descriptors keys only on descriptor, namespace and literal parts: a descriptor carries no HTTP request"))]
#[x_kube(validation = CelRule::new("!has(self.deferIfLimited) || self.algorithm != 'concurrency'").message("deferIfLimited: a concurrency slot ends with a response, and a replay has no client to answer").field_path(".deferIfLimited"))]
#[x_kube(validation = CelRule::new("!has(self.deferIfLimited) || !has(self.responseCost)").message("deferIfLimited: a cost known after the response cannot be checked before a replay").field_path(".deferIfLimited"))]
#[x_kube(validation = CelRule::new("!has(self.deferIfLimited) || !has(self.mode) || self.mode != 'shadow'").message("deferIfLimited: a shadow rule never refuses, so nothing would be deferred").field_path(".deferIfLimited"))]
#[serde(rename_all = "camelCase")]
pub struct PolicyRule {
    /// Name of the rule, unique within the policy: lowercase letters, digits and '-', at most
    /// 63 characters, starting and ending with a letter or digit. Counters belong to the
    /// rule's identity (namespace, policy name, rule name): renaming a rule starts its counters
    /// afresh, editing its limit does not.
    #[schemars(length(min = 1, max = MAX_NAME_LEN), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub name: String,

    /// Which requests the rule applies to. Every listed condition must hold (methods AND
    /// paths AND hosts AND headers); within one list any entry may match. Absent or empty:
    /// every request.
    #[serde(default, rename = "match", skip_serializing_if = "Option::is_none")]
    pub matches: Option<Match>,

    /// How matching requests are grouped into counters: the values of these parts, in order,
    /// form the counter's key. Each part is an object with exactly one of `header: NAME`,
    /// `clientIP: true`, `namespace: true`, `path: true`, `method: true`, `host: true`,
    /// `descriptor: KEY` (rules matching descriptors only) or `literal: TEXT`. Empty: one
    /// counter shared by every matching request.
    ///
    /// Example: `key: [{header: X-API-Key}]` counts each API key separately.
    #[serde(default)]
    #[schemars(length(max = MAX_KEY_PARTS))]
    pub key: Vec<KeyPart>,

    /// The algorithm that decides: tokenBucket (bursts up to `burst`, refill at
    /// requests/per), gcra (same decisions, one timestamp per key), leakyBucket (constant
    /// drain; with maxDelay it delays instead of rejecting), fixedWindow (requests per
    /// window aligned to the clock; up to twice the limit across a boundary),
    /// slidingWindowLog (exact; keeps one entry per admitted request, so at most 1000 requests
    /// per window), slidingWindowCounter (weighted estimate of the trailing window, two counters
    /// per key, any limit), or concurrency (at most `requests` requests in progress per key,
    /// each holding its slot until it is released through `POST /v1/release` or its lease of
    /// `per` runs out; decided by the sidecar, which releases when the response ends, and by
    /// `POST /v1/check` and `/v1/checks`, whose callers release; ext_authz and the rate limit
    /// service, which never learn that a request ended, skip it).
    pub algorithm: Algorithm,

    /// How many requests are allowed per period.
    pub limit: LimitSpec,

    /// How much one matching request counts against the limit. The request's own cost (for
    /// example set by the caller of the check API) is multiplied by this. 0 counts nothing
    /// (the rule only observes). Default 1. Must not exceed burst (or requests).
    #[serde(default = "default_cost")]
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub cost: u64,

    /// `enforce` (default): requests over the limit are refused with 429. `shadow`: the rule
    /// is decided and reported ("would have limited") but never refuses a request and never
    /// blocks other rules; use it to try a limit safely.
    #[serde(default)]
    pub mode: Mode,

    /// What this rule decides when the shared store (Redis) is slow or unreachable: `allow`
    /// (fail open), `deny` (fail closed) or `localFallback` (default: enforce the limit in
    /// each replica's memory until the store is back).
    #[serde(default)]
    pub on_store_failure: FailureMode,

    /// What a request this rule refuses gets, instead of `429 Too Many Requests` with a
    /// problem+json body: graceful degradation, such as a `200` with a cached or reduced answer
    /// for a read, or a `503` that names a status page. The rate-limit headers are added as
    /// usual. Served by the sidecar and by `/v1/authz`, and given by `/v1/check` as the answer's
    /// `status`, `headers` and `body`; Envoy's rate limit service can carry no body (it uses
    /// the status only through its own configuration). When several enforcing rules refuse a
    /// request, the first one's refusal is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<RefusalSpec>,

    /// A spread added at random to the `Retry-After` header of each request this rule refuses
    /// (a duration such as `2s`), so clients refused together do not all retry in the same
    /// second. `retryAfterMs` in the check API's answer stays exact.
    #[x_kube(validation = duration_rule("retryAfterJitter"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub retry_after_jitter: Option<String>,

    /// The cost of a request known only after its response: an LLM's tokens, or any work the
    /// application counts. Admission reserves an estimate (admitted only if used + reserved +
    /// estimate fits the limit); when the response ends the reservation is settled to the
    /// actual cost, read from the response. Replaces `cost`. The sidecar reads the response
    /// itself; `POST /v1/check` callers settle through `POST /v1/settle`; ext_authz charges the
    /// estimate; Envoy's rate limit service charges what Envoy reports after the response
    /// (`hits_addend`, unbounded overspend). Algorithms: tokenBucket, gcra, fixedWindow,
    /// slidingWindowCounter, leakyBucket without maxDelay. See docs/llm.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_cost: Option<ResponseCostSpec>,

    /// How the enforcers (endpoint replicas) share this rule's counters. Absent, or
    /// `mode: exact`: every decision asks the shared store, and the limit is never exceeded.
    /// `mode: leased`: an enforcer that sees a key often takes a slice of the key's remaining
    /// quota from the store and decides from it without a round trip, settling what it spent;
    /// cold keys stay exact. The units out in slices never exceed `maxOvershoot`, so that is the
    /// most a key can admit over its limit, and only when enforcers crash or lose the store
    /// while holding slices (healthy ones settle in time and admit exactly what exact decisions
    /// would). See docs/leasing.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consistency: Option<ConsistencySpec>,

    /// Degrade instead of refusing reads: a `GET` or `HEAD` this rule's limits refuse (or any
    /// limit refusing a request this rule matches) gets the last good response the sidecar
    /// kept for the same URL instead of the refusal, when it is at most `maxStale` old; marked
    /// with `Age` and `Sluice-Stale: limited`. The sidecar keeps successful (200) responses of
    /// matching requests, never one marked `Cache-Control: no-store`, `private` or `no-cache`,
    /// one setting a cookie, or one to a request carrying `Authorization` or `Cookie`; `Vary`
    /// is respected. Per pod, bounded by the sidecar's `--stale-cache-bytes`; with nothing
    /// kept, the refusal is answered as always. docs/degradation.md explains it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_if_limited: Option<StaleIfLimitedSpec>,

    /// Degrade instead of refusing writes: a `POST`, `PUT`, `PATCH` or `DELETE` this rule
    /// matches that a limit refuses (this rule's or another's) is accepted instead. The sidecar
    /// stores it in the namespace's queue on Redis (a stream), answers `202 Accepted` with the
    /// entry's id and a status URL, and the workload's sidecars replay it to the application at
    /// the rule's rate: replays are checked like live requests, so the application never sees
    /// more than the limits of both together. At least once; an entry whose delivery keeps
    /// failing (5xx, 429, no answer) is retried with backoff and dead-lettered after
    /// `maxAttempts`. Needs the Redis store: without a store that can keep it (memory, or Redis
    /// unreachable) the write gets the refusal. Not for `concurrency` rules nor costs known after
    /// the response. docs/degradation.md explains it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defer_if_limited: Option<DeferIfLimitedSpec>,
}

/// `deferIfLimited`: a limited write is queued and replayed at the rule's rate.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DeferIfLimitedSpec {
    /// The largest request body queued (bytes, default 65536, at most 1048576); a larger write
    /// gets 413.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub max_body_bytes: Option<u64>,
    /// Request headers kept and sent with the replay besides `Content-Type` (at most 16; e.g.
    /// `x-request-id`). Nothing else of the original head reaches the application: credentials
    /// that expire are not replayed; the replay carries `Sluice-Deferred-Id` instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub headers: Vec<String>,
    /// A request header whose value deduplicates re-submissions of one write (e.g.
    /// `Idempotency-Key`): a second write of one key with the same value gets the first one's
    /// entry, for as long as `keepStatus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub idempotency_header: Option<String>,
    /// The most entries queued per key (default 100, at most 100000); past it the write gets
    /// the refusal, with `Retry-After` the time the queue needs to drain at the rule's rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_queued: Option<u64>,
    /// The most bytes queued per key (default 1048576, at most 67108864), as `maxQueued`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 67108864))]
    pub max_queued_bytes: Option<u64>,
    /// Deliveries tried before an entry goes to the dead-letter stream (default 5, 1 to 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub max_attempts: Option<u32>,
    /// The first wait before a failed delivery is retried, doubled at each attempt (default
    /// 5s, from 1s to 1h). Also how long an entry a replica took stays its own before another
    /// replica may deliver it (a replica that died mid-delivery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule("retryInterval"))]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub retry_interval: Option<String>,
    /// How long an entry's status (and its idempotency key) is kept after it was accepted,
    /// delivered or dead-lettered (default 1h, from 1m to 7d).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule("keepStatus"))]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub keep_status: Option<String>,
}

/// `staleIfLimited`: what a limited read may get instead of the refusal.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StaleIfLimitedSpec {
    /// The oldest kept response served, a duration from 1s to 1d (e.g. `5m`).
    #[x_kube(validation = duration_rule("maxStale"))]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub max_stale: String,
    /// The largest response body kept (bytes, default 262144, at most 8388608): a larger one
    /// is passed on and not kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8388608))]
    pub max_entry_bytes: Option<u64>,
    /// Stale-while-revalidate at the limiter: while limited reads of a URL are answered with
    /// its kept response, at most one read of it per `revalidateEvery` (a duration from 1s to
    /// 1h) goes on to the application in the background, and its response replaces the kept
    /// one. The application then sees the limit plus one read per URL per interval. Absent:
    /// the kept response only ages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = duration_rule("revalidateEvery"))]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub revalidate_every: Option<String>,
}

/// Exact or leased decisions, and the bound of a leased rule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[x_kube(validation = CelRule::new("self.mode != 'leased' || has(self.maxOvershoot)").message("consistency: leased needs maxOvershoot, the most a key may admit over its limit"))]
#[x_kube(validation = CelRule::new("self.mode == 'leased' || (!has(self.maxOvershoot) && !has(self.maxStaleness))").message("maxOvershoot and maxStaleness apply to consistency: leased only"))]
#[serde(rename_all = "camelCase")]
pub struct ConsistencySpec {
    /// `exact` (the default) or `leased`.
    pub mode: ConsistencyMode,

    /// leased: the most units a key may admit over its limit, as a number of requests (`20`) or
    /// a percentage of the limit (`requests`, or `burst` for the bucket algorithms: `2%`). It
    /// caps the units out in slices at any moment, so it must come to at least one request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), regex(pattern = r"^[0-9]{1,10}(\.[0-9]{1,4})?%?$"))]
    pub max_overshoot: Option<String>,

    /// leased: the longest an enforcer decides from a slice without asking the store, a
    /// duration between 50ms and 1m; default 1s. A slice of a window algorithm also ends with
    /// its window. Longer means fewer store calls for a steady key and capacity held longer by
    /// an enforcer that stops using it.
    #[x_kube(validation = duration_rule("maxStaleness"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub max_staleness: Option<String>,
}

/// How a rule's decisions use the shared store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ConsistencyMode {
    /// Every decision asks the store.
    #[default]
    Exact,
    /// Hot keys are decided from slices of their quota held by the enforcers.
    Leased,
}

/// Most JSON fields a response cost sums.
pub const MAX_COST_FIELDS: usize = 8;

/// Where a rule's cost comes from when the response tells it, and what is reserved meanwhile.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[x_kube(validation = CelRule::new("(has(self.fields) && size(self.fields) > 0) || has(self.header)").message("responseCost needs fields or a header to read the cost from"))]
#[serde(rename_all = "camelCase")]
pub struct ResponseCostSpec {
    /// JSON fields of the response whose sum is the cost, as dotted paths: OpenAI
    /// `usage.total_tokens` (or `usage.prompt_tokens` and `usage.completion_tokens` apart),
    /// Anthropic `usage.input_tokens` and `usage.output_tokens` (streamed: `message.usage.input_tokens`
    /// from `message_start`). Read from a JSON body (up to 1 MiB) or from a server-sent event
    /// stream, where each field's last value counts (OpenAI with `stream_options.include_usage`).
    /// The response passes to the client unchanged. At most 8.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_COST_FIELDS))]
    pub fields: Vec<String>,

    /// A response header whose value is the cost (decimal digits), e.g. `x-sluice-cost`, for an
    /// application that counts its own work. When the response carries it, it wins over
    /// `fields`. The sidecar removes it from the response the client gets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub header: Option<String>,

    /// What admission reserves.
    pub estimate: EstimateSpec,

    /// What a failed request costs: the application answered 5xx, or its response broke off, or
    /// the client left before any of the response. Default 0.
    #[serde(default)]
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub on_failure: u64,

    /// How long a reservation holds its estimate when nobody settles it (a crashed sidecar):
    /// then its capacity returns, and a settle arriving later charges nothing. Longer than the
    /// slowest response. A duration between 1s and 1d; default 10m.
    #[x_kube(validation = duration_rule("reservationTtl"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub reservation_ttl: Option<String>,

    /// `reserve` (default): reserve the estimate, settle to the actual cost. `reportAfter`:
    /// reserve nothing and charge the actual cost afterwards, the model of Envoy AI Gateway and
    /// of Kuadrant's first token limits; concurrent requests then overspend without bound. For
    /// comparison only.
    #[serde(default)]
    pub mode: ResponseCostMode,
}

/// What a request reserves: `constant`, or a field of its JSON body (`requestField`) plus
/// `plus`, at most `cap`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[x_kube(validation = CelRule::new("has(self.constant) != has(self.requestField)").message("estimate takes exactly one of constant or requestField"))]
#[x_kube(validation = CelRule::new("!has(self.requestField) || has(self.cap)").message("estimate.requestField needs a cap"))]
#[serde(rename_all = "camelCase")]
pub struct EstimateSpec {
    /// The same estimate for every request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub constant: Option<u64>,
    /// A top-level integer field of the request's JSON body, e.g. `max_tokens` (OpenAI chat),
    /// `max_output_tokens` (OpenAI responses) or `max_tokens` (Anthropic). The sidecar reads
    /// bodies of up to 1 MiB for it; a request without it, or with a larger body, reserves `cap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 64))]
    pub request_field: Option<String>,
    /// Added to the request field's value: what the prompt may cost on top of the output.
    #[serde(default)]
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub plus: u64,
    /// The most a request reserves: required with `requestField` (a request whose body lacks the
    /// field, or is too large to read, reserves `cap`); not used with `constant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_REQUESTS))]
    pub cap: Option<u64>,
}

/// How a response cost is charged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum ResponseCostMode {
    /// Reserve the estimate at admission; settle to the actual cost.
    #[default]
    Reserve,
    /// Charge only afterwards: the overspend is unbounded (for comparison).
    ReportAfter,
}

/// Bounds on a declared refusal: what every replica and sidecar holds per rule.
pub const MAX_REFUSAL_HEADERS: usize = 16;
pub const MAX_REFUSAL_HEADER_VALUE_LEN: usize = 1024;
pub const MAX_REFUSAL_BODY_LEN: usize = 4096;

/// The response a refused request gets.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RefusalSpec {
    /// The status, 200 to 599. Default 429.
    #[serde(default = "default_refusal_status")]
    #[schemars(range(min = 200, max = 599))]
    pub status: u16,
    /// Headers to send (e.g. `content-type: application/json`), at most 16, values at most 1024
    /// bytes; not hop-by-hop ones, `content-length` or the rate-limit headers Sluice sets.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    #[schemars(length(max = MAX_REFUSAL_HEADERS))]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body, at most 4096 bytes of text. Absent: an empty body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_REFUSAL_BODY_LEN))]
    pub body: Option<String>,
}

fn default_refusal_status() -> u16 {
    429
}

fn default_cost() -> u64 {
    1
}

/// Whether a rule refuses requests or only reports what it would have done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    /// Refuse requests over the limit.
    #[default]
    Enforce,
    /// Decide and report, never refuse.
    Shadow,
}

/// Conditions on a request; all present lists must match.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = CelRule::new("!has(self.descriptor) || size(self.descriptor) == 0 || ((!has(self.methods) || size(self.methods) == 0) && (!has(self.paths) || size(self.paths) == 0) && (!has(self.hosts) || size(self.hosts) == 0) && (!has(self.headers) || size(self.headers) == 0))").message("match.descriptor cannot be combined with methods, paths, hosts or headers: a descriptor carries no HTTP request"))]
#[serde(rename_all = "camelCase")]
pub struct Match {
    /// HTTP methods (case-insensitive), e.g. `[GET, HEAD]`. Empty: any method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub methods: Vec<String>,

    /// Request paths; any entry may match. The query string is ignored, and the path is
    /// normalized first: every spelling some common server routes to `/orders/1` (`//orders/1`,
    /// `/x/../orders/1`, `/orders%2F1`, `/orders;x=1/1`, `\orders\1`, `/orders./1`) is matched
    /// as `/orders/1`. Each entry has exactly one of `exact` (the whole path), `prefix` (whole path
    /// segments: `/orders` matches `/orders` and `/orders/1`, not `/ordersX`; `/` matches
    /// everything) or `regex` (RE2 syntax, must match the whole path; counts against the policy's
    /// regex budget, see `spec.rules`), and may set `ignoreCase`. Empty: any path.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub paths: Vec<PathMatch>,

    /// Host names (case-insensitive, port ignored): exact such as `api.example.com`, or a
    /// wildcard `*.example.com` matching any name below example.com (not example.com itself).
    /// Empty: any host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub hosts: Vec<String>,

    /// Request headers that must all match. Each has a `name` (case-insensitive) and exactly
    /// one of `exact`, `prefix`, `regex` (RE2, whole value) or `present` (true: the header is
    /// sent, with any value; false: it is not sent). Regexes count against the policy's regex
    /// budget (see `spec.rules`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub headers: Vec<HeaderMatch>,

    /// For Envoy's rate limit service (gRPC `ShouldRateLimit`): the rule applies to a request
    /// descriptor whose entries are exactly these, in this order (as a path through an
    /// envoyproxy/ratelimit descriptor tree). Each entry names its `key` and optionally tests its
    /// value. A rule with `descriptor` applies only to descriptors, never to HTTP checks, and
    /// cannot also match methods, paths, hosts or headers; a rule without it never applies to a
    /// descriptor. The descriptor's domain is the namespace of the policy.
    ///
    /// Example: `descriptor: [{key: remote_address}]` matches every descriptor
    /// `[(remote_address, <any value>)]`; with `key: [{descriptor: remote_address}]` each address
    /// gets its own counter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_DESCRIPTOR_ENTRIES))]
    pub descriptor: Vec<DescriptorEntryMatch>,
}

/// One entry of a rate limit descriptor: its key, and at most one of exact, prefix or regex on
/// its value, plus values it must not have.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = CelRule::new("[has(self.exact), has(self.prefix), has(self.regex)].filter(x, x).size() <= 1").message("a descriptor entry takes at most one of exact, prefix or regex"))]
#[serde(rename_all = "camelCase")]
pub struct DescriptorEntryMatch {
    /// The entry's key, compared exactly, e.g. `remote_address`, `generic_key`, `header_match`.
    #[schemars(length(min = 1, max = MAX_DESCRIPTOR_KEY_LEN))]
    pub key: String,
    /// The whole value, compared exactly (case-sensitive). Absent (with prefix and regex): any
    /// value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub exact: Option<String>,
    /// The start of the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub prefix: Option<String>,
    /// An RE2 regular expression that must match the whole value. Counts against the policy's
    /// regex budget (see `spec.rules`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub regex: Option<String>,
    /// Values the entry must not have, compared exactly: how a catch-all rule leaves the
    /// values that have rules of their own to them (envoyproxy/ratelimit's most specific match
    /// wins, e.g. an `unlimited` value beside a per-value default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub not_in: Vec<String>,
    /// Prefixes the value must not start with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_MATCH_ITEMS))]
    pub not_prefix: Vec<String>,
}

/// One path condition: exactly one of exact, prefix or regex, and optionally ignoreCase.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = CelRule::new("[has(self.exact), has(self.prefix), has(self.regex)].filter(x, x).size() == 1").message("a path match needs exactly one of exact, prefix or regex"))]
#[serde(rename_all = "camelCase")]
pub struct PathMatch {
    /// The whole path, e.g. `/healthz`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub exact: Option<String>,
    /// A path prefix matched by whole segments, e.g. `/orders` (matches `/orders/1`, not
    /// `/ordersX`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub prefix: Option<String>,
    /// An RE2 regular expression that must match the whole path, e.g. `/users/[0-9]+/orders`.
    /// At most 1024 characters and 256 KiB compiled; a policy's regexes together at most 64
    /// and 1 MiB compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub regex: Option<String>,
    /// Match whatever the case of ASCII letters, for apps whose router ignores case (Express by
    /// default, ASP.NET): `/Orders` and `/ORDERS` are then limited as `/orders`, and a `path` key
    /// part of this rule is lowercased, so a new spelling is no new counter. Default false: on a
    /// case-sensitive server `/Orders` and `/orders` are different resources with counters of
    /// their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_case: Option<bool>,
}

/// One header condition: a name and exactly one of exact, prefix, regex or present.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = CelRule::new("[has(self.exact), has(self.prefix), has(self.regex), has(self.present)].filter(x, x).size() == 1").message("a header match needs exactly one of exact, prefix, regex or present"))]
#[serde(rename_all = "camelCase")]
pub struct HeaderMatch {
    /// Header name, case-insensitive, e.g. `X-Tenant`.
    #[schemars(length(min = 1, max = MAX_HEADER_NAME_LEN))]
    pub name: String,
    /// The whole value, compared exactly (case-sensitive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub exact: Option<String>,
    /// The start of the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub prefix: Option<String>,
    /// An RE2 regular expression that must match the whole value. At most 1024 characters and
    /// 256 KiB compiled; a policy's regexes together at most 64 and 1 MiB compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_PATTERN_LEN))]
    pub regex: Option<String>,
    /// true: the header must be sent (any value); false: it must not be sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
}

/// One part of a counter key: exactly one source field.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = CelRule::new("[has(self.header), has(self.clientIP), has(self.__namespace__), has(self.path), has(self.method), has(self.host), has(self.descriptor), has(self.literal)].filter(x, x).size() == 1").message("a key part needs exactly one of header, clientIP, namespace, path, method, host, descriptor or literal"))]
#[x_kube(validation = CelRule::new("(!has(self.clientIP) || self.clientIP) && (!has(self.__namespace__) || self.__namespace__) && (!has(self.path) || self.path) && (!has(self.method) || self.method) && (!has(self.host) || self.host)").message("clientIP, namespace, path, method and host key parts are written as `NAME: true`"))]
#[x_kube(validation = CelRule::new("!has(self.missing) || has(self.header) || has(self.clientIP)").message("missing only applies to header and clientIP key parts"))]
#[serde(rename_all = "camelCase")]
pub struct KeyPart {
    /// The value of this request header (as sent), e.g. `header: X-API-Key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_HEADER_NAME_LEN))]
    pub header: Option<String>,
    /// `clientIP: true`: the client's IP address.
    #[serde(default, rename = "clientIP", skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<bool>,
    /// `namespace: true`: the namespace of the workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<bool>,
    /// `path: true`: the request path without the query string. Beware: every distinct path
    /// gets its own counter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<bool>,
    /// `method: true`: the HTTP method, uppercased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<bool>,
    /// `host: true`: the host name, lowercased, without port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<bool>,
    /// `descriptor: KEY`: the value of the descriptor entry with this key (rules with
    /// `match.descriptor` naming that key only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DESCRIPTOR_KEY_LEN))]
    pub descriptor: Option<String>,
    /// A fixed text, e.g. to keep counters of two rules apart by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_LITERAL_LEN))]
    pub literal: Option<String>,
    /// For header and clientIP parts, what happens to a request without that value: `share`
    /// (default) counts all such requests under one shared key, so leaving the header out is
    /// no way around the limit; `skip` exempts such requests from this rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing: Option<Missing>,
}

/// What a key part does when the request lacks its value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Missing {
    /// All requests without the value share one key (the empty value).
    #[default]
    Share,
    /// The rule does not apply to requests without the value.
    Skip,
}

/// How many requests are allowed per period.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = CelRule::new("self.requests >= 1").message("limit.requests must be at least 1"))]
#[x_kube(validation = CelRule::new("!has(self.burst) || self.burst >= 1").message("limit.burst must be at least 1"))]
#[serde(rename_all = "camelCase")]
pub struct LimitSpec {
    /// Requests allowed per `per` (the refill or drain rate for the bucket algorithms, the
    /// window quota for the window algorithms; concurrency: requests in progress at once). At
    /// least 1, at most 4294967295; slidingWindowLog: at most 1000 (it keeps one entry per
    /// admitted request; use slidingWindowCounter for larger limits); concurrency: at most 10000.
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub requests: u64,

    /// The period, a duration such as `1s`, `500ms`, `1m`, `1h`, `1d` or `1m30s`; a whole number
    /// of milliseconds between 1ms and 366d. concurrency: the lease, the longest a request holds
    /// its slot when nobody releases it (a crashed caller); longer than the slowest request.
    #[x_kube(validation = duration_rule("per"))]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub per: String,

    /// tokenBucket and gcra: the most requests admitted at once (bucket capacity); leakyBucket:
    /// the queue size. Default: `requests`. Not allowed for the window algorithms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = MAX_REQUESTS))]
    pub burst: Option<u64>,

    /// leakyBucket only: instead of rejecting a request that does not fit right now, admit it
    /// with a delay of up to this duration (the caller waits: traffic shaping). Example: `2s`.
    #[x_kube(validation = duration_rule("maxDelay"))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_DURATION_LEN))]
    pub max_delay: Option<String>,
}

/// What the operator observed and enforces.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitPolicyStatus {
    /// `Accepted`: whether the current generation (metadata.generation) is valid and compiled
    /// (reason and message say what is wrong when False). `Enforced`: whether rules of this policy
    /// are live in the enforcement endpoint, and of which generation: the current one (reason
    /// `Live`) or, while the current one is not accepted, the last accepted one (reason
    /// `LastAccepted`). Both conditions carry the observedGeneration of the generation the operator
    /// judged when it wrote them, so they are up to date when it equals metadata.generation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation these conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Version (content hash) of the live rule snapshot that contains this policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The generation whose rules are live in the snapshot named by `snapshot`: observedGeneration
    /// when the current generation is accepted, lastAccepted.generation while it is not. Absent
    /// when nothing of the policy is enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforced_generation: Option<i64>,
    /// The newest generation the operator accepted, with its spec. While a newer generation is
    /// invalid, every replica of the operator, including one started later, enforces this spec
    /// instead of dropping the policy's limits; a valid update replaces it. Written by the operator
    /// only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_accepted: Option<LastAccepted>,
}

/// An accepted generation of a policy, kept in its status.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastAccepted {
    /// The metadata.generation that had this spec.
    pub generation: i64,
    /// The spec of that generation as the operator read it (defaults filled in). The schema does
    /// not check it: the operator validates it again before enforcing it, and enforces nothing of
    /// the policy if it is no longer valid.
    #[schemars(schema_with = "any_object")]
    pub spec: serde_json::Value,
}

/// Schema of an object whose fields the API server keeps without checking them.
fn any_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
}

impl RateLimitPolicy {
    /// `namespace/name`, the policy's name in errors, status and the check API; the namespace
    /// defaults to `default` as it does for `kubectl apply` without one.
    pub fn qualified_name(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or(super::DEFAULT_NAMESPACE),
            self.metadata.name.as_deref().unwrap_or("")
        )
    }
}

/// Renders the CustomResourceDefinition as YAML, as committed in `crds/ratelimitpolicy.yaml`.
pub fn crd_yaml() -> String {
    // Serializing a CRD built from our own derives cannot fail; fall back to an obviously broken
    // document rather than panicking in a library.
    let rendered = serde_json::to_value(RateLimitPolicy::crd()).map(|mut crd| {
        strip_unsigned_formats(&mut crd);
        crd
    });
    match rendered.map_err(|e| e.to_string()).and_then(|crd| serde_yaml::to_string(&crd).map_err(|e| e.to_string())) {
        Ok(yaml) => format!(
            "# Generated by `sluice crd` (sluice::policy::crd_yaml); do not edit.\n\
             # Regenerate: SLUICE_BLESS=1 cargo test --test crd_generated\n---\n{yaml}"
        ),
        Err(e) => format!("# error rendering CRD: {e}\n"),
    }
}

/// Removes the `format: uint16`, `uint32` and `uint64` schemars gives Rust's unsigned integers:
/// Kubernetes knows only `int32` and `int64`, and the API server warns of every unknown format
/// on every apply. The bounds stay, as each such field also has a `minimum` and a `maximum`.
fn strip_unsigned_formats(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(map) => {
            if map.get("format").and_then(serde_json::Value::as_str).is_some_and(|f| f.starts_with("uint")) {
                map.remove("format");
            }
            map.values_mut().for_each(strip_unsigned_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_unsigned_formats),
        _ => {}
    }
}

/// What a rule decides when its shared store (Redis) is slow or unreachable.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum FailureMode {
    /// Admit the request (fail open).
    Allow,
    /// Refuse the request (fail closed).
    Deny,
    /// Enforce the same rule in this replica's memory with its share of the limit.
    #[default]
    LocalFallback,
}

impl FailureMode {
    pub fn name(self) -> &'static str {
        match self {
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
            FailureMode::LocalFallback => "localFallback",
        }
    }
}
