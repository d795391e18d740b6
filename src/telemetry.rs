//! Prometheus metrics. Labels are bounded: policy and rule names and namespaces come from
//! configuration, never from keys, paths or client addresses.

use std::sync::atomic::{AtomicI64, AtomicU64};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `allowed` (the rule admitted the request), `limited` (an enforcing rule refused it) or
/// `would_limit` (a shadow rule would have refused it).
pub type RuleOutcome = &'static str;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabels {
    pub policy: String,
    pub rule: String,
    pub outcome: RuleOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: u16,
}

/// A rule, named as decisions name it (`policy` is `namespace/name`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub policy: String,
    pub rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    pub mode: &'static str,
}

/// A gRPC status code name of the rate limit service's answers: `OK`, `OVER_LIMIT`, or an
/// error code (`INVALID_ARGUMENT`, `UNAUTHENTICATED`, `PERMISSION_DENIED`, `UNAVAILABLE`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub code: &'static str,
}

/// An entry point by name (`authz`, `rls`, `checks`, `sidecar`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    pub api: &'static str,
}

/// A namespace that has policies (only those reach the store), or `""` for checks without one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NamespaceLabels {
    pub namespace: String,
}

/// Counters for one rule, resolved once per snapshot so a decision only touches atomics.
#[derive(Clone, Debug, Default)]
pub struct RuleCounters {
    pub allowed: Counter,
    pub limited: Counter,
    pub would_limit: Counter,
    /// For a rule whose cost is known after the response (`responseCost`).
    pub reservations: Option<ReservationCounters>,
}

#[derive(Clone, Debug, Default)]
pub struct ReservationCounters {
    /// Estimates reserved at admission.
    pub reserved: Counter,
    /// Actual costs charged by settles.
    pub settled: Counter,
    /// Estimates whose reservation was gone when settled (run out, or settled before): their
    /// actual cost was not charged.
    pub expired: Counter,
}

/// Outcomes of `sluice_reservation_cost_total`.
const RESERVATION_OUTCOMES: [RuleOutcome; 3] = ["reserved", "settled", "expired"];

pub struct Metrics {
    pub registry: Registry,
    pub decisions: Family<RuleLabels, Counter>,
    /// Cost of `responseCost` rules by outcome: reserved, settled, expired.
    pub reservation_cost: Family<RuleLabels, Counter>,
    pub responses: Family<StatusLabels, Counter>,
    /// `responses` for status 200, resolved once: the check API's hot path skips the family's
    /// lock and label hashing.
    pub responses_ok: Counter,
    pub check_seconds: Histogram,
    pub reloads: Family<ResultLabels, Counter>,
    pub snapshot_rules: Gauge,
    pub snapshot_loaded_seconds: Gauge<f64, AtomicU64>,
    pub store_errors: Family<KindLabels, Counter>,
    pub store_fallbacks: Family<ModeLabels, Counter>,
    pub store_circuit_open: Gauge<i64, AtomicI64>,
    pub live_keys: Gauge,
    pub evicted_keys: Gauge,
    /// Requests refused before any decision because the caller could not be verified or asked
    /// about what it may not, by reason.
    pub auth_failures: Family<ReasonLabels, Counter>,
    /// Envoy rate limit service (`ShouldRateLimit`) answers by code.
    pub rls_requests: Family<CodeLabels, Counter>,
    /// Requests the shared store's denial cache refused without asking Redis.
    pub denial_cache_hits: Counter,
    /// Values counted as matching a policy regex without being matched, its time bound reached
    /// (`policy::pattern`).
    pub regex_undecided: Counter,
    /// (rule, key) denials the cache holds.
    pub denial_cache_entries: Gauge,
    /// Batched Redis calls, and the decisions they carried.
    pub redis_batched_calls: Counter,
    pub redis_batched_decisions: Counter,
    /// Calls to the Kubernetes TokenReview API, by result (cache hits make none).
    pub token_reviews: Family<ResultLabels, Counter>,
    /// `evicted_keys` by the namespace that owned the keys; brought up to the store's totals by
    /// [`Metrics::record_store_status`].
    pub memory_evictions: Family<NamespaceLabels, Counter>,
    /// Keys each namespace holds in Redis, as last counted (`store::redis::usage`).
    pub redis_keys: Family<NamespaceLabels, Gauge>,
    /// Rules that hold capacity (concurrency) matched where nothing can release it, so not
    /// decided there, by entry point.
    pub holding_rules_skipped: Family<ApiLabels, Counter>,
    /// Slots of shaping rules given back by callers that left before departing
    /// (`POST /v1/cancel`, abandoned waits).
    pub slots_given_back: Counter,
    /// `sluice_deferred_writes_total{result}`: deferred writes by what became of them.
    pub deferred_writes: Family<ResultLabels, Counter>,
    /// Per `deferIfLimited` rule: entries queued, the oldest one's age, dead letters.
    pub deferred_queued: Family<QueueLabels, Gauge>,
    pub deferred_oldest_seconds: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    pub deferred_dead_letters: Family<QueueLabels, Gauge>,
    /// Quota leases (`consistency: leased`): requests of leased rules by who decided them
    /// (`admitted_locally`, `refused_locally`, `store`), renewals by outcome (`granted`,
    /// `empty`, `failed`), units by what became of them (`granted`, `spent`, `returned`), and
    /// the slices held now with their unspent units.
    pub lease_requests: Family<KindLabels, Counter>,
    pub lease_renewals: Family<ResultLabels, Counter>,
    pub lease_units: Family<KindLabels, Counter>,
    pub leases_held: Gauge,
    pub lease_units_held: Gauge,
    /// Serializes [`Metrics::record_store_status`] so concurrent scrapes add each eviction once.
    record_lock: parking_lot::Mutex<()>,
    /// (policy, rule) of the decision series in `decisions`, for [`Metrics::retain_rules`].
    rule_series: parking_lot::Mutex<std::collections::HashSet<(String, String)>>,
    /// Unix time the served certificate (webhooks, check API TLS) expires.
    pub certificate_expiry_seconds: Gauge,
    /// Certificate Secret writes by this replica, by reason (`absent`, `expiring`, `hosts`, …).
    pub certificate_renewals: Family<ReasonLabels, Counter>,
    /// Pods the mutating webhook answered, by result (`injected`, `annotated`: already had the
    /// sidecar, `skipped`: not labelled or the operator's namespace).
    pub pod_admissions: Family<ResultLabels, Counter>,
    /// Annotations the injecting webhook ignored (bad values; the defaults were used).
    pub injection_warnings: Counter,
    /// Pods labelled for injection that run without the sidecar (measured by the Lease holder;
    /// 0 on the other replicas).
    pub pods_without_sidecar: Gauge,
    /// SidecarMissing Events this replica created (one per such pod, whichever replica leads).
    pub sidecar_missing_events: Counter,
    /// Services reaching an injected application's guarded port by number, past the sidecar
    /// (by the Lease holder; 0 elsewhere).
    pub services_bypassing_sidecar: Gauge,
    /// SidecarBypassed Events this replica created.
    pub sidecar_bypass_events: Counter,
    /// NetworkPolicies for injected pods this replica applied (once per namespace and port set
    /// per leadership term).
    pub network_policies_applied: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// A fixed vocabulary per metric, e.g. `missing`, `invalid`, `unavailable` or `forbidden`
    /// for authentication failures.
    pub reason: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        let decisions = Family::<RuleLabels, Counter>::default();
        registry.register("decisions", "Rule decisions by policy, rule and outcome", decisions.clone());
        let reservation_cost = Family::<RuleLabels, Counter>::default();
        registry.register(
            "reservation_cost",
            "Cost of responseCost rules: estimates reserved at admission, actual costs settled, and estimates whose reservation ran out before its settle",
            reservation_cost.clone(),
        );
        let responses = Family::<StatusLabels, Counter>::default();
        registry.register("check_responses", "Check API responses by HTTP status", responses.clone());
        // 5 µs to ~80 ms.
        let check_seconds = Histogram::new(exponential_buckets(0.000_005, 2.0, 15));
        registry.register("check_duration_seconds", "Time to decide one check request", check_seconds.clone());
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register("snapshot_reloads", "Policy snapshot reloads by result", reloads.clone());
        let snapshot_rules = Gauge::default();
        registry.register("snapshot_rules", "Rules in the live snapshot", snapshot_rules.clone());
        let snapshot_loaded_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "snapshot_loaded_timestamp_seconds",
            "Unix time the live snapshot was loaded",
            snapshot_loaded_seconds.clone(),
        );
        let store_errors = Family::<KindLabels, Counter>::default();
        registry.register("store_errors", "Shared store calls that failed, by kind", store_errors.clone());
        let store_fallbacks = Family::<ModeLabels, Counter>::default();
        registry.register(
            "store_failure_decisions",
            "Rule decisions made by onStoreFailure because the shared store failed, by mode",
            store_fallbacks.clone(),
        );
        let store_circuit_open = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "store_circuit_open",
            "1 while the shared store's circuit breaker is open (calls skip the store)",
            store_circuit_open.clone(),
        );
        let live_keys = Gauge::default();
        registry.register(
            "memory_live_keys",
            "Keys held in this process's memory (the memory store, or the local fallback with Redis)",
            live_keys.clone(),
        );
        let evicted_keys = Gauge::default();
        registry.register(
            "memory_evicted_keys",
            "Live keys evicted by the key cap since start (their counters started over)",
            evicted_keys.clone(),
        );
        let auth_failures = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "auth_failures",
            "Requests refused because the caller was not verified or not allowed, by reason",
            auth_failures.clone(),
        );
        let rls_requests = Family::<CodeLabels, Counter>::default();
        registry.register(
            "rls_requests",
            "Envoy rate limit service (gRPC ShouldRateLimit) answers, by code (OK, OVER_LIMIT, or the gRPC error)",
            rls_requests.clone(),
        );
        let denial_cache_hits = Counter::default();
        registry.register(
            "redis_denial_cache_hits",
            "Requests refused from the denial cache without asking Redis (exact: each was a repeat of a denial before its retry-after)",
            denial_cache_hits.clone(),
        );
        let regex_undecided = Counter::default();
        registry.register(
            "regex_undecided",
            "Values counted as matching a policy regex without being matched: the regex reached its time bound (docs/policy.md, Budgets), and its rule applies",
            regex_undecided.clone(),
        );
        let denial_cache_entries = Gauge::default();
        registry.register(
            "redis_denial_cache_entries",
            "(rule, key) denials held by the denial cache",
            denial_cache_entries.clone(),
        );
        let redis_batched_calls = Counter::default();
        registry.register(
            "redis_batched_calls",
            "Redis calls that carried the decisions of every request waiting for one (single Redis)",
            redis_batched_calls.clone(),
        );
        let redis_batched_decisions = Counter::default();
        registry.register(
            "redis_batched_decisions",
            "Requests decided in batched Redis calls; divided by the calls, the mean batch",
            redis_batched_decisions.clone(),
        );
        let token_reviews = Family::<ResultLabels, Counter>::default();
        registry.register(
            "auth_token_reviews",
            "TokenReview API calls by result (authenticated, rejected, error)",
            token_reviews.clone(),
        );
        let redis_keys = Family::<NamespaceLabels, Gauge>::default();
        registry.register(
            "redis_keys",
            "Keys each namespace holds in Redis, as last counted (--redis-usage-interval); --redis-namespace-max-keys bounds it",
            redis_keys.clone(),
        );
        let slots_given_back = Counter::default();
        registry.register(
            "slots_given_back",
            "Slots of shaping rules given back by callers that left before their departure",
            slots_given_back.clone(),
        );
        let deferred_writes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "deferred_writes",
            "Writes of deferIfLimited rules by what became of them: accepted, duplicate (an idempotency value seen), full (refused), delivered, retried, dead_lettered, unknown (finished twice)",
            deferred_writes.clone(),
        );
        let deferred_queued = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "deferred_queued",
            "Entries in each deferIfLimited rule's queue, not yet delivered nor dead-lettered (read every few seconds)",
            deferred_queued.clone(),
        );
        let deferred_oldest_seconds = Family::<QueueLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "deferred_oldest_seconds",
            "Age of the oldest entry in each deferIfLimited rule's queue (0 when empty)",
            deferred_oldest_seconds.clone(),
        );
        let deferred_dead_letters = Family::<QueueLabels, Gauge>::default();
        registry.register(
            "deferred_dead_letters",
            "Entries in each deferIfLimited rule's dead-letter stream (the newest 10000 kept)",
            deferred_dead_letters.clone(),
        );
        let holding_rules_skipped = Family::<ApiLabels, Counter>::default();
        registry.register(
            "holding_rules_skipped",
            "Concurrency rules matched by requests of an entry point that cannot release them (ext_authz, the rate limit service), so not decided there",
            holding_rules_skipped.clone(),
        );
        let memory_evictions = Family::<NamespaceLabels, Counter>::default();
        registry.register(
            "memory_evictions",
            "Live keys evicted by the key cap since start, by the namespace that owned them",
            memory_evictions.clone(),
        );
        let certificate_expiry_seconds = Gauge::default();
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "Unix time the served webhook and check API certificate expires",
            certificate_expiry_seconds.clone(),
        );
        let certificate_renewals = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "certificate_renewals",
            "Certificate Secret writes by this replica, by reason (absent, expiring, ca_expiring, expired, hosts, unreadable)",
            certificate_renewals.clone(),
        );
        let pod_admissions = Family::<ResultLabels, Counter>::default();
        registry.register(
            "pod_admissions",
            "Pods answered by the injecting webhook, by result (injected, annotated, skipped)",
            pod_admissions.clone(),
        );
        let injection_warnings = Counter::default();
        registry.register(
            "injection_warnings",
            "Pod annotations the injecting webhook ignored for a default (bad values), returned as admission warnings",
            injection_warnings.clone(),
        );
        let pods_without_sidecar = Gauge::default();
        registry.register(
            "pods_without_sidecar",
            "Pods labelled sluice.dev/inject=true running without the sidecar (by the Lease holder; 0 elsewhere)",
            pods_without_sidecar.clone(),
        );
        let sidecar_missing_events = Counter::default();
        registry.register(
            "sidecar_missing_events",
            "SidecarMissing Events this replica created (one per pod labelled for injection found without the sidecar)",
            sidecar_missing_events.clone(),
        );
        let services_bypassing_sidecar = Gauge::default();
        registry.register(
            "services_bypassing_sidecar",
            "Services whose numeric targetPort reaches an injected application's port past the sidecar (by the Lease holder; 0 elsewhere)",
            services_bypassing_sidecar.clone(),
        );
        let sidecar_bypass_events = Counter::default();
        registry.register(
            "sidecar_bypass_events",
            "SidecarBypassed Events this replica created (one per Service and set of bypassing ports)",
            sidecar_bypass_events.clone(),
        );
        let network_policies_applied = Counter::default();
        registry.register(
            "network_policies_applied",
            "NetworkPolicies admitting ingress to injected pods only on the sidecar's ports, applied by this replica",
            network_policies_applied.clone(),
        );
        let lease_requests = Family::<KindLabels, Counter>::default();
        registry.register(
            "quota_lease_requests",
            "Requests whose every rule is consistency: leased, by who decided them (kind: admitted_locally from a slice held here, refused_locally because the store had nothing left, store)",
            lease_requests.clone(),
        );
        let lease_renewals = Family::<ResultLabels, Counter>::default();
        registry.register(
            "quota_lease_renewals",
            "Store calls asking for slices of hot keys' quota, by result (granted, empty: nothing granted, failed)",
            lease_renewals.clone(),
        );
        let lease_units = Family::<KindLabels, Counter>::default();
        registry.register(
            "quota_lease_units",
            "Units of quota by what became of them (kind: granted to this replica, spent from slices, returned unspent)",
            lease_units.clone(),
        );
        let leases_held = Gauge::default();
        registry.register("quota_leases_held", "Slices of quota this replica holds now", leases_held.clone());
        let lease_units_held = Gauge::default();
        registry.register(
            "quota_lease_units_held",
            "Units of quota held in slices here and not yet spent: with every replica's, at most the rules' maxOvershoot per key",
            lease_units_held.clone(),
        );
        let responses_ok = responses.get_or_create_owned(&StatusLabels { status: 200 });
        Metrics {
            registry,
            lease_requests,
            lease_renewals,
            lease_units,
            leases_held,
            lease_units_held,
            decisions,
            reservation_cost,
            responses,
            responses_ok,
            check_seconds,
            reloads,
            snapshot_rules,
            snapshot_loaded_seconds,
            store_errors,
            store_fallbacks,
            store_circuit_open,
            live_keys,
            evicted_keys,
            auth_failures,
            rls_requests,
            denial_cache_hits,
            regex_undecided,
            denial_cache_entries,
            redis_batched_calls,
            redis_batched_decisions,
            token_reviews,
            memory_evictions,
            redis_keys,
            holding_rules_skipped,
            slots_given_back,
            deferred_writes,
            deferred_queued,
            deferred_oldest_seconds,
            deferred_dead_letters,
            record_lock: parking_lot::Mutex::new(()),
            rule_series: parking_lot::Mutex::new(std::collections::HashSet::new()),
            certificate_expiry_seconds,
            certificate_renewals,
            pod_admissions,
            injection_warnings,
            pods_without_sidecar,
            sidecar_missing_events,
            services_bypassing_sidecar,
            sidecar_bypass_events,
            network_policies_applied,
        }
    }

    /// Copies a store's self-description into the store metrics (call before encoding).
    /// Counts a deferred write's step (`result` one of the bounded names of
    /// `sluice_deferred_writes_total`).
    pub fn deferred(&self, result: &'static str) {
        self.deferred_writes.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn record_store_status(&self, status: &crate::store::StoreStatus) {
        let _one_at_a_time = self.record_lock.lock();
        self.store_circuit_open.set(i64::from(status.breaker == Some("open")));
        self.live_keys.set(status.live_keys as i64);
        self.evicted_keys.set(status.evicted_keys as i64);
        self.regex_undecided.inc_by(crate::policy::pattern::undecided().saturating_sub(self.regex_undecided.get()));
        if let Some(cache) = status.denial_cache {
            self.denial_cache_hits.inc_by(cache.hits.saturating_sub(self.denial_cache_hits.get()));
            self.denial_cache_entries.set(cache.entries as i64);
        }
        if let Some(batches) = status.batches {
            self.redis_batched_calls.inc_by(batches.calls.saturating_sub(self.redis_batched_calls.get()));
            self.redis_batched_decisions.inc_by(batches.decisions.saturating_sub(self.redis_batched_decisions.get()));
        }
        if let Some(leases) = status.quota_leases {
            let bring_up = |counter: &Counter, total: u64| counter.inc_by(total.saturating_sub(counter.get()));
            for (kind, total) in [
                ("admitted_locally", leases.admitted_locally),
                ("refused_locally", leases.refused_locally),
                ("store", leases.to_store),
            ] {
                bring_up(&self.lease_requests.get_or_create(&KindLabels { kind }), total);
            }
            let failed = leases.renewal_failures;
            for (result, total) in [("granted", leases.grants), ("empty", leases.empty_grants), ("failed", failed)] {
                bring_up(&self.lease_renewals.get_or_create(&ResultLabels { result }), total);
            }
            for (kind, total) in
                [("granted", leases.units_granted), ("spent", leases.units_spent), ("returned", leases.units_returned)]
            {
                bring_up(&self.lease_units.get_or_create(&KindLabels { kind }), total);
            }
            self.leases_held.set(leases.held as i64);
            self.lease_units_held.set(leases.units_held as i64);
        }
        // Namespaces no longer counted lose their series.
        self.redis_keys.clear();
        for (namespace, &keys) in &status.redis_keys_by_namespace {
            self.redis_keys.get_or_create(&NamespaceLabels { namespace: namespace.clone() }).set(keys as i64);
        }
        for (namespace, &total) in &status.evicted_keys_by_namespace {
            let counter = self.memory_evictions.get_or_create(&NamespaceLabels { namespace: namespace.clone() });
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// Drops the decision series of rules that are no longer in `live` (deleted or renamed), so
    /// the series count follows the policies instead of growing with every edit.
    pub fn retain_rules(&self, live: std::collections::HashSet<(String, String)>) {
        let mut known = self.rule_series.lock();
        for (policy, rule) in known.difference(&live) {
            for outcome in ["allowed", "limited", "would_limit"] {
                self.decisions.remove(&RuleLabels { policy: policy.clone(), rule: rule.clone(), outcome });
            }
            for outcome in RESERVATION_OUTCOMES {
                self.reservation_cost.remove(&RuleLabels { policy: policy.clone(), rule: rule.clone(), outcome });
            }
        }
        *known = live;
    }

    /// A rule's counters; `reserving`: its cost is known after the response.
    pub fn rule_counters(&self, policy: &str, rule: &str, reserving: bool) -> RuleCounters {
        let labels = |outcome| RuleLabels { policy: policy.to_string(), rule: rule.to_string(), outcome };
        RuleCounters {
            allowed: self.decisions.get_or_create_owned(&labels("allowed")),
            limited: self.decisions.get_or_create_owned(&labels("limited")),
            would_limit: self.decisions.get_or_create_owned(&labels("would_limit")),
            reservations: reserving.then(|| ReservationCounters {
                reserved: self.reservation_cost.get_or_create_owned(&labels("reserved")),
                settled: self.reservation_cost.get_or_create_owned(&labels("settled")),
                expired: self.reservation_cost.get_or_create_owned(&labels("expired")),
            }),
        }
    }

    pub fn encode(&self) -> String {
        encode(&self.registry)
    }
}

/// A registry in the OpenMetrics text format (every role's `/metrics`).
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}
