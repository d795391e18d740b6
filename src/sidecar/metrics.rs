//! The sidecar's Prometheus metrics. Every label takes a value from a fixed set named here, never
//! from paths, hosts, client addresses or error texts.

use std::sync::atomic::AtomicI64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `forwarded`, `limited`, `upstream_error`, `upgraded`.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `endpoint`, `local` (cached snapshot) or `failure_mode`.
    pub source: &'static str,
    /// `allow`, `deny` or `refuse` (a request answered 4xx as malformed).
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `released` or `failed`.
    pub result: &'static str,
}

/// `kind` is an [`super::verdict::EndpointError::kind`], `breaker_open` or `no_snapshot`.
use crate::telemetry::KindLabels;

pub struct SidecarMetrics {
    pub registry: Registry,
    pub requests: Family<OutcomeLabels, Counter>,
    /// Egress requests (`spec.egress`) by outcome.
    pub egress: Family<OutcomeLabels, Counter>,
    pub decisions: Family<DecisionLabels, Counter>,
    pub endpoint_errors: Family<KindLabels, Counter>,
    pub check_seconds: Histogram,
    /// Time to settle an admitted request's holds with the endpoint, once its response ended.
    pub settle_seconds: Histogram,
    pub upstream_seconds: Histogram,
    pub breaker_open: Gauge<i64, AtomicI64>,
    pub snapshot_cached: Gauge<i64, AtomicI64>,
    pub snapshot_updates: Counter,
    pub snapshot_pushed: Gauge<i64, AtomicI64>,
    pub upgrades_active: Gauge<i64, AtomicI64>,
    /// HTTP exchanges with the endpoint for checks: `batch` (`POST /v1/checks`) or `single`.
    pub endpoint_exchanges: Family<KindLabels, Counter>,
    /// Checks sent in batches; ÷ batch exchanges = the mean batch size.
    pub batched_checks: Counter,
    pub releases: Family<ResultLabels, Counter>,
    /// Stale-if-limited reads: `served` (a kept response instead of the refusal), `miss`
    /// (limited with nothing to serve: refused), `kept` (a response kept).
    pub stale: Family<ResultLabels, Counter>,
    /// `deferIfLimited` writes, by what became of them.
    pub deferred: Family<ResultLabels, Counter>,
    /// Bytes of responses kept for stale-if-limited reads (bounded by `--stale-cache-bytes`).
    pub stale_bytes: Gauge<i64, AtomicI64>,
    /// Overload protection: the adaptive limit, the requests in flight to the application, the
    /// long-term latency estimate (microseconds), and requests shed (or, in shadow mode, that
    /// would have been) by class.
    pub overload_limit: Gauge<i64, AtomicI64>,
    pub overload_in_flight: Gauge<i64, AtomicI64>,
    pub overload_latency_ms: Gauge<i64, AtomicI64>,
    pub overload_shed: Family<ClassLabels, Counter>,
    pub overload_would_shed: Family<ClassLabels, Counter>,
}

impl Default for SidecarMetrics {
    fn default() -> Self {
        SidecarMetrics::new()
    }
}

impl SidecarMetrics {
    pub fn new() -> SidecarMetrics {
        let mut registry = Registry::with_prefix("sluice_sidecar");
        let requests = Family::<OutcomeLabels, Counter>::default();
        registry.register("requests", "Proxied requests by outcome", requests.clone());
        let egress = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "egress_requests",
            "Requests to spec.egress downstreams by outcome (sent, refused, queue_full, too_large, abandoned, failed, undeclared)",
            egress.clone(),
        );
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register("decisions", "Rate-limit decisions by who decided and the result", decisions.clone());
        let endpoint_errors = Family::<KindLabels, Counter>::default();
        registry.register("endpoint_errors", "Checks the endpoint did not answer, by kind", endpoint_errors.clone());
        // 50 µs to ~0.8 s.
        let check_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 15));
        registry.register("check_duration_seconds", "Time to get a decision from the endpoint", check_seconds.clone());
        let settle_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 15));
        registry.register(
            "settle_duration_seconds",
            "Time to settle an admitted request's holds (slots, reservations) after its response ended",
            settle_seconds.clone(),
        );
        let upstream_seconds = Histogram::new(exponential_buckets(0.000_05, 2.0, 18));
        registry.register(
            "upstream_duration_seconds",
            "Time until the application's response head arrived",
            upstream_seconds.clone(),
        );
        let breaker_open = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "endpoint_circuit_open",
            "Whether the endpoint's circuit breaker is open, so checks skip the endpoint (0 or 1)",
            breaker_open.clone(),
        );
        let snapshot_cached = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "snapshot_cached",
            "Whether a policy snapshot is cached for the local fallback (0 or 1)",
            snapshot_cached.clone(),
        );
        let snapshot_updates = Counter::default();
        registry.register("snapshot_updates", "New snapshots fetched from the endpoint", snapshot_updates.clone());
        let snapshot_pushed = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "snapshot_pushed",
            "Whether the endpoint holds this sidecar's snapshot request and answers it on a change, so requests no rule applies to skip the endpoint (0 or 1)",
            snapshot_pushed.clone(),
        );
        let upgrades_active = Gauge::<i64, AtomicI64>::default();
        registry.register("upgrades_active", "Upgraded connections (WebSocket) being relayed", upgrades_active.clone());
        let endpoint_exchanges = Family::<KindLabels, Counter>::default();
        registry.register(
            "endpoint_exchanges",
            "HTTP exchanges with the endpoint for checks, by kind (batch or single)",
            endpoint_exchanges.clone(),
        );
        let batched_checks = Counter::default();
        registry.register("batched_checks", "Checks sent to the endpoint in batches", batched_checks.clone());
        let releases = Family::<ResultLabels, Counter>::default();
        registry.register(
            "releases",
            "Settles of what an admitted request held (concurrency slots, reservations) when its response ended, by result (a failed one runs out with its lease)",
            releases.clone(),
        );
        let stale = Family::<ResultLabels, Counter>::default();
        registry.register(
            "stale_reads",
            "staleIfLimited: limited reads served a kept response (served) or refused with nothing kept (miss), and responses kept (kept)",
            stale.clone(),
        );
        let deferred = Family::<ResultLabels, Counter>::default();
        registry.register(
            "deferred_writes",
            "deferIfLimited: limited writes queued (accepted) or refused (full, too_large, failed: no queue could take it), and replays delivered or to be retried",
            deferred.clone(),
        );
        let stale_bytes = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "stale_cache_bytes",
            "Bytes of responses kept for staleIfLimited reads (at most --stale-cache-bytes)",
            stale_bytes.clone(),
        );
        let overload_limit = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "overload_limit",
            "Overload protection: the adaptive limit on requests in flight to the application",
            overload_limit.clone(),
        );
        let overload_in_flight = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "overload_in_flight",
            "Overload protection: requests in flight to the application",
            overload_in_flight.clone(),
        );
        let overload_latency_ms = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "overload_latency_microseconds",
            "Overload protection: the application's long-term latency estimate",
            overload_latency_ms.clone(),
        );
        let overload_shed = Family::<ClassLabels, Counter>::default();
        registry.register(
            "overload_shed",
            "Overload protection: requests refused with 503 because the application is at its limit, by class",
            overload_shed.clone(),
        );
        let overload_would_shed = Family::<ClassLabels, Counter>::default();
        registry.register(
            "overload_would_shed",
            "Overload protection in shadow mode: requests that would have been refused, by class",
            overload_would_shed.clone(),
        );
        SidecarMetrics {
            overload_limit,
            overload_in_flight,
            overload_latency_ms,
            overload_shed,
            overload_would_shed,
            registry,
            requests,
            egress,
            decisions,
            endpoint_errors,
            check_seconds,
            settle_seconds,
            upstream_seconds,
            breaker_open,
            snapshot_cached,
            snapshot_updates,
            snapshot_pushed,
            upgrades_active,
            endpoint_exchanges,
            batched_checks,
            releases,
            stale,
            deferred,
            stale_bytes,
        }
    }

    pub fn outcome(&self, outcome: &'static str) {
        self.requests.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// Counts a deferred write's step (one of the bounded names of
    /// `sluice_sidecar_deferred_writes_total`).
    pub fn deferred(&self, result: &'static str) {
        self.deferred.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn encode(&self) -> String {
        crate::telemetry::encode(&self.registry)
    }
}

/// The priority class of a request the overload protection shed (or would have).
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ClassLabels {
    /// `critical`, `default` or `sheddable`.
    pub class: &'static str,
}
