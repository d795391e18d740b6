//! Getting a decision for a request: from the enforcement endpoint when it answers in time,
//! otherwise from the cached snapshot (local fallback), otherwise from `--on-endpoint-failure`.
//!
//! A circuit breaker sits in front of the endpoint so that once it is known to be down, requests
//! stop paying the timeout: they go straight to the fallback until a probe finds it back.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{ETAG, HeaderName, HeaderValue, IF_NONE_MATCH};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use tokio::sync::watch;

use super::batch::Checks;
use super::config::{Config, OnFailure};
use super::endpoint::{Credential, Endpoint, ExchangeFailure, MAX_ENDPOINT_BODY, endpoint_client};
use super::metrics::{DecisionLabels, KindLabels, SidecarMetrics};
pub use super::verdict::{Decision, EndpointError, HeaderList, Refusal};
use super::verdict::{Held, decision_of, error_chain};
use crate::api::check::CheckInput;
use crate::api::snapshot::SnapshotDocument;
use crate::clock::{Clock, SystemClock};
use crate::engine::{CheckResponse, Engine, Holds, SettleCost, WithoutStore};
use crate::policy::RequestView;
use crate::policy::response_cost::ResponseCost;
use crate::request::headers::UsedHeaderProblem;
use crate::store::breaker::{Breaker, BreakerConfig};
use crate::store::memory::MemoryStore;
use crate::telemetry::Metrics;

/// Keys the local fallback may hold: a sidecar sees one pod's traffic.
const LOCAL_MAX_KEYS: usize = 100_000;
/// Keys of leased rules a sidecar follows for slices (its pod's hot keys are few).
const LOCAL_LEASE_KEYS: usize = 16_384;
/// Retry-After when refusing because the limiter is unreachable.
const FAILURE_RETRY_AFTER_SECS: u64 = 1;

/// Most bytes of header values one check carries: with the 8 KiB path bound, a check stays below
/// the endpoint's 64 KiB body limit unless its Host is huge (the request head's own limit is
/// far larger); the endpoint refuses such a check as too large, and the sidecar answers 431.
pub const MAX_CHECK_HEADER_BYTES: usize = 16 * 1024;

/// Who decided, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Endpoint,
    /// A slice of the key's quota held here (`consistency: leased`): no call at all.
    Lease,
    Local,
    FailureMode,
    /// No rule of the live snapshot applies: allowed without asking (see `Decider::without_endpoint`).
    NoRule,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Endpoint => "endpoint",
            Source::Lease => "lease",
            Source::Local => "local",
            Source::FailureMode => "failure_mode",
            Source::NoRule => "no_rule",
        }
    }
}

/// Which request headers the check carries: only the ones this namespace's policies use. Until
/// a snapshot says which, no check is sent: sending every header would hand the client's
/// cookies and credentials to the endpoint, and sending none would decide header-keyed rules
/// on a missing key.
#[derive(Debug)]
enum HeaderFilter {
    Unknown,
    /// Lowercase names.
    Only(Vec<String>),
}

/// What a snapshot request brought: the new snapshot's ETag (`None`: unchanged), and whether the
/// endpoint held the request (it pushes changes).
struct Fetched {
    etag: Option<HeaderValue>,
    held: bool,
}

/// How long the endpoint may hold a snapshot request while nothing changes.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(30);

/// What the sidecar's `/readyz` answers. An endpoint that is away leaves readiness alone (taking
/// every pod out of its Service because a shared dependency is down would be worse than the
/// failure modes); one whose answers show this sidecar is configured wrong for it (a scheme, TLS
/// or credential mismatch: [`ExchangeFailure::Misconfigured`]) makes it not ready, naming the
/// cause, since that never heals by itself and every request would go to the failure mode: the
/// pod should take no traffic it cannot limit. Cleared by the next exchange that succeeds.
#[derive(Debug, Default)]
pub struct Readiness {
    misconfigured: parking_lot::Mutex<Option<String>>,
}

impl Readiness {
    /// Why the sidecar is not ready, or `None` when it is.
    pub fn not_ready_because(&self) -> Option<String> {
        self.misconfigured.lock().clone()
    }

    /// Records the latest exchange's verdict on the configuration; true when that changed it.
    fn record(&self, misconfigured: Option<String>) -> bool {
        let mut current = self.misconfigured.lock();
        let changed = *current != misconfigured;
        *current = misconfigured;
        changed
    }
}

pub struct Decider {
    endpoint: Arc<Endpoint>,
    checks: Checks,
    timeout: Duration,
    on_failure: OnFailure,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    breaker: Breaker,
    header_filter: ArcSwap<HeaderFilter>,
    /// One first-snapshot fetch at a time, shared by the requests that wait for it.
    first_snapshot: tokio::sync::Mutex<()>,
    /// The last snapshot fetched, enforced locally while the endpoint is away.
    local: Engine<Arc<MemoryStore>>,
    /// Slices of hot keys' quota held for this pod (`consistency: leased` rules), granted by
    /// the endpoint.
    leases: crate::engine::leases::QuotaLeases,
    /// The cached snapshot compiled to the endpoint's own version (nothing rejected here).
    local_is_exact: AtomicBool,
    /// The last snapshot request succeeded and the endpoint holds unchanged-snapshot requests
    /// (it answers as soon as the snapshot changes), so the cached one is current.
    snapshot_is_pushed: AtomicBool,
    /// The ETag of the snapshot installed; installs happen one at a time under this lock.
    installed: parking_lot::Mutex<Option<HeaderValue>>,
    /// The breaker's and the local fallback's time, and the check timings.
    clock: Arc<dyn Clock>,
    metrics: Arc<SidecarMetrics>,
    /// The application's protection from overload, configured by each snapshot installed.
    pub protection: Arc<super::overload::Protection>,
    /// What `/readyz` answers, from the snapshot requests' outcomes.
    pub readiness: Arc<Readiness>,
}

impl Decider {
    pub fn new(config: &Config, metrics: Arc<SidecarMetrics>) -> Result<Decider, super::SidecarError> {
        Decider::with_clock(config, metrics, Arc::new(SystemClock))
    }

    /// [`Decider::new`] on `clock` (the process's clock, or a test's).
    pub fn with_clock(
        config: &Config,
        metrics: Arc<SidecarMetrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Decider, super::SidecarError> {
        let endpoint = Arc::new(Endpoint {
            client: endpoint_client(config)?,
            check_uri: config.check_uri.clone(),
            checks_uri: config.checks_uri.clone(),
            settle_uri: config.settle_uri.clone(),
            leases_uri: config.leases_uri.clone(),
            snapshot_uri: config.snapshot_uri.clone(),
            snapshot_wait_uri: format!("{}?wait={}s", config.snapshot_uri, SNAPSHOT_WAIT.as_secs())
                .parse()
                .map_err(|_| super::SidecarError::Config(format!("cannot append ?wait= to {}", config.snapshot_uri)))?,
            credential: config.token_file.clone().map(Credential::new),
        });
        let checks = Checks::new(endpoint.clone(), config.endpoint_batches, config.endpoint_timeout, metrics.clone());
        let store = Arc::new(MemoryStore::with_clock(LOCAL_MAX_KEYS, clock.clone()));
        Ok(Decider {
            endpoint,
            checks,
            timeout: config.endpoint_timeout,
            on_failure: config.on_failure,
            namespace: config.namespace.clone(),
            labels: config.labels.clone(),
            breaker: Breaker::new(BreakerConfig::default()),
            header_filter: ArcSwap::from_pointee(HeaderFilter::Unknown),
            first_snapshot: tokio::sync::Mutex::new(()),
            local: Engine::new(store, clock.clone(), Arc::new(Metrics::new())),
            leases: crate::engine::leases::QuotaLeases::new(LOCAL_LEASE_KEYS),
            local_is_exact: AtomicBool::new(false),
            snapshot_is_pushed: AtomicBool::new(false),
            installed: parking_lot::Mutex::new(None),
            clock,
            protection: super::overload::Protection::new(metrics.clone(), config.cgroup_root.clone()),
            metrics,
            readiness: Arc::default(),
        })
    }

    /// Settles what an admitted request held, once its response has ended (or its client gone):
    /// concurrency slots are given back, reservations charged `cost`; with the endpoint, or with
    /// the local engine that admitted it. A settle that fails is logged and left to the holds,
    /// which run out by themselves.
    pub async fn settle(&self, held: Held, cost: SettleCost) {
        let started = self.clock.now();
        let outcome = match held {
            Held::Local(token) => match self.local.verify_hold(&token) {
                Ok(lease) => self.local.settle(&lease, &cost).await.map(|_| ()).map_err(|e| e.to_string()),
                Err(error) => Err(error.to_string()),
            },
            Held::Endpoint(token) => {
                let body = serde_json::to_vec(&crate::api::settle::SettleBody::new(token, &cost)).unwrap_or_default();
                match tokio::time::timeout(self.timeout, self.endpoint.post(&self.endpoint.settle_uri, body.into()))
                    .await
                {
                    Ok(Ok((status, _))) if status.is_success() => Ok(()),
                    Ok(Ok((status, body))) => {
                        Err(format!("endpoint answered {status}: {}", endpoint_reason(&String::from_utf8_lossy(&body))))
                    }
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err(format!("no answer within {:?}", self.timeout)),
                }
            }
        };
        self.metrics.settle_seconds.observe(self.clock.now().saturating_sub(started) as f64 / 1e6);
        match outcome {
            Ok(()) => {
                self.metrics.releases.get_or_create(&super::metrics::ResultLabels { result: "released" }).inc();
            }
            Err(reason) => {
                self.metrics.releases.get_or_create(&super::metrics::ResultLabels { result: "failed" }).inc();
                tracing::warn!(%reason, "could not settle a request's holds; they run out by themselves");
            }
        }
    }

    /// How the costs of what `held` holds are read from the response: each rule's name and its
    /// `responseCost`, from the cached snapshot (empty for concurrency slots alone).
    pub fn response_costs(&self, held: &Held) -> Vec<(String, Arc<ResponseCost>)> {
        let (Held::Endpoint(token) | Held::Local(token)) = held;
        match crate::engine::hold::Hold::read_unverified(token) {
            Ok(lease) => self.local.response_costs(&lease),
            Err(_) => Vec::new(),
        }
    }

    /// The top-level request body fields the estimates of `namespace`'s rules read.
    pub fn estimate_fields(&self) -> Vec<String> {
        self.local.live().snapshot.estimate_fields(&self.namespace)
    }

    /// The class of a request when the application is overloaded (the cached snapshot's
    /// `priorities`; `default` before the first snapshot);
    /// `None` for a request `overload.exempt` leaves alone.
    pub fn classify(&self, input: &CheckInput<'_>) -> Option<crate::overload::Class> {
        let live = self.local.live();
        let view = view_of(input);
        (!live.snapshot.exempt_from_overload(&view)).then(|| live.snapshot.classify(&view).0)
    }

    /// The local fallback's store, for the sweeper that drops idle keys.
    pub fn local_store(&self) -> Arc<MemoryStore> {
        self.local.store().clone()
    }

    /// The request headers a check should carry, under the names the snapshot gave (a value sent
    /// as `X_API_KEY` goes as `x-api-key`); `None` while no snapshot has said which (the first one
    /// is fetched here, once, within the endpoint timeout).
    ///
    /// A used header sent more than once (under one spelling or several), or not UTF-8, is
    /// refused with 400 (no single value says which bucket it belongs to); used headers over
    /// [`MAX_CHECK_HEADER_BYTES`] with 431.
    pub async fn check_headers(&self, headers: &HeaderMap) -> Result<Option<BTreeMap<String, String>>, Refusal> {
        if matches!(**self.header_filter.load(), HeaderFilter::Unknown) {
            let _one = self.first_snapshot.lock().await;
            // Behind the breaker like a check: a dead endpoint costs five waits, not one per request.
            if matches!(**self.header_filter.load(), HeaderFilter::Unknown)
                && let Some(permit) = self.breaker.try_acquire(self.clock.now())
            {
                let fetched =
                    tokio::time::timeout(self.timeout, self.fetch_snapshot(None, false)).await.unwrap_or_else(|_| {
                        Err(ExchangeFailure::Unavailable(format!("no answer within {:?}", self.timeout)))
                    });
                match fetched {
                    Ok(_) => {
                        permit.success(self.clock.now());
                    }
                    Err(error) => {
                        permit.failure(self.clock.now());
                        tracing::debug!(%error, "first snapshot not available");
                    }
                }
                let open = self.breaker.state(self.clock.now()) != crate::store::breaker::BreakerState::Closed;
                self.metrics.breaker_open.set(i64::from(open));
            }
        }
        let filter = self.header_filter.load();
        let HeaderFilter::Only(names) = &**filter else { return Ok(None) };
        crate::request::headers::check_used_headers(headers, names).map_err(|problem| match problem {
            UsedHeaderProblem::Malformed(detail) => Refusal::new(StatusCode::BAD_REQUEST, detail),
            UsedHeaderProblem::TooLarge(detail) => Refusal::new(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, detail),
        })?;
        let mut out = BTreeMap::new();
        let mut bytes = 0;
        for name in names {
            // Under the name the snapshot gave, whichever spelling (`x_api_key`) the client used.
            if let Some(value) = crate::request::headers::used_header_value(headers, name) {
                bytes += name.len() + value.len();
                out.insert(name.clone(), value.to_string());
            }
        }
        if bytes > MAX_CHECK_HEADER_BYTES {
            return Err(Refusal::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!("the rate-limited headers take {bytes} bytes, more than {MAX_CHECK_HEADER_BYTES}"),
            ));
        }
        Ok(Some(out))
    }

    /// The decision for a request that could not be put to the endpoint (no snapshot yet says
    /// what a check must carry): `--on-endpoint-failure`.
    pub fn undecidable(&self) -> Decision {
        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "no_snapshot" }).inc();
        let decision = self.failure_mode();
        self.count(Source::FailureMode, &decision);
        decision
    }

    fn failure_mode(&self) -> Decision {
        match self.on_failure {
            OnFailure::Allow => Decision::Allow { delay: Duration::ZERO, headers: Vec::new(), lease: None },
            OnFailure::Deny => {
                Decision::Deny { retry_after_secs: Some(FAILURE_RETRY_AFTER_SECS), headers: Vec::new(), declared: None }
            }
        }
    }

    pub async fn decide(&self, input: &CheckInput<'_>) -> Decision {
        if let Some((source, decision)) = self.without_endpoint(input).await {
            self.count(source, &decision);
            return decision;
        }
        let started = self.clock.now();
        let error = match self.breaker.try_acquire(started) {
            None => {
                self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "breaker_open" }).inc();
                // An endpoint that cannot be asked cannot be trusted to push either.
                self.set_pushed(false);
                None
            }
            Some(permit) => {
                let outcome = match tokio::time::timeout(self.timeout, self.ask(input)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(EndpointError::Timeout(self.timeout)),
                };
                let now = self.clock.now();
                match outcome {
                    Ok(decision) => {
                        permit.success(now);
                        self.metrics.check_seconds.observe(now.saturating_sub(started) as f64 / 1e6);
                        self.metrics.breaker_open.set(0);
                        self.count(Source::Endpoint, &decision);
                        return decision;
                    }
                    Err(EndpointError::Rejected(status, detail)) => {
                        // The endpoint is fine; this request cannot be decided as sent, and
                        // forwarding it unchecked would be a bypass.
                        permit.success(now);
                        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "rejected" }).inc();
                        let status = if status == StatusCode::PAYLOAD_TOO_LARGE {
                            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
                        } else {
                            StatusCode::BAD_REQUEST
                        };
                        let decision = Decision::Refuse(Refusal::new(status, endpoint_reason(&detail)));
                        self.count(Source::Endpoint, &decision);
                        return decision;
                    }
                    Err(error) => {
                        permit.failure(now);
                        self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: error.kind() }).inc();
                        // The held snapshot request may be just as stuck: until it answers
                        // again, every request is asked about.
                        self.set_pushed(false);
                        Some(error)
                    }
                }
            }
        };
        let open = self.breaker.state(self.clock.now()) != crate::store::breaker::BreakerState::Closed;
        self.metrics.breaker_open.set(i64::from(open));
        if let Some(error) = &error {
            tracing::debug!(%error, "endpoint check failed; falling back");
        }
        let (source, decision) = self.fallback(input).await;
        self.count(source, &decision);
        decision
    }

    /// A request decided here with the endpoint's answer, without the exchange, while the
    /// cached snapshot is exactly the endpoint's (same version): one that no rule applies to is
    /// allowed with no headers, while the snapshot is also kept current by a held snapshot
    /// request (so a new or changed policy reaches this pod as soon as the endpoint installs
    /// it); one whose every rule is `consistency: leased` is decided from the slices held here
    /// (renewed from the endpoint when the table asks). Otherwise, and for a request the
    /// endpoint would refuse as malformed, `None`: the endpoint is asked as always.
    async fn without_endpoint(&self, input: &CheckInput<'_>) -> Option<(Source, Decision)> {
        if !self.local_is_exact.load(Ordering::Acquire) || crate::api::check::check_path(input.path).is_err() {
            return None;
        }
        let view = view_of(input);
        match self.local.check_without_store(&view, &self.leases, &*self.endpoint, Some(self.timeout)).await {
            WithoutStore::NoRule if self.snapshot_is_pushed.load(Ordering::Acquire) => {
                Some((Source::NoRule, Decision::Allow { delay: Duration::ZERO, headers: Vec::new(), lease: None }))
            }
            WithoutStore::FromLeases(response) => Some((Source::Lease, from_engine(response))),
            WithoutStore::NoRule | WithoutStore::AskTheStore => None,
        }
    }

    /// Settles this pod's slices as they end, until `shutdown`; then gives every one back.
    pub async fn keep_leases(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        crate::engine::leasing::keep(&self.leases, &*self.endpoint, &*self.clock, shutdown).await;
    }

    fn count(&self, source: Source, decision: &Decision) {
        let result = match decision {
            Decision::Allow { .. } => "allow",
            Decision::Deny { .. } => "deny",
            Decision::Refuse(_) => "refuse",
        };
        self.metrics.decisions.get_or_create(&DecisionLabels { source: source.name(), result }).inc();
    }

    async fn ask(&self, input: &CheckInput<'_>) -> Result<Decision, EndpointError> {
        let body =
            serde_json::to_vec(input).map_err(|e| EndpointError::Rejected(StatusCode::BAD_REQUEST, e.to_string()))?;
        self.checks.check(body).await
    }

    async fn fallback(&self, input: &CheckInput<'_>) -> (Source, Decision) {
        if self.local.is_loaded() {
            return (Source::Local, from_engine(self.local.check(&view_of(input), Holds::Returned).await));
        }
        (Source::FailureMode, self.failure_mode())
    }

    /// Keeps the header filter and the local fallback current until `shutdown`: `GET
    /// /v1/snapshot` with If-None-Match and `?wait=`, which the endpoint holds until the
    /// snapshot changes (then it answers at once) or the wait ends (304), and which is renewed as
    /// soon as it ends. An endpoint that answers at once (an older release) is asked every
    /// `interval` instead, and a failed request is retried after `interval`.
    pub async fn poll_snapshots(self: Arc<Self>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut was_failing = false;
        loop {
            let started = tokio::time::Instant::now();
            if let Some(credential) = &self.endpoint.credential {
                credential.refresh();
            }
            // A snapshot can be large; give it more time than a check but never hang the loop.
            let limit = SNAPSHOT_WAIT + interval.max(Duration::from_secs(2));
            // About what is installed (which the first request's own fetch may have changed).
            let asked = self.installed.lock().clone();
            let fetch = tokio::time::timeout(limit, self.fetch_snapshot(asked.clone(), true));
            let outcome = tokio::select! {
                outcome = fetch => outcome.unwrap_or_else(|_| Err(ExchangeFailure::Unavailable("timed out".into()))),
                _ = shutdown.wait_for(|stop| *stop) => return,
            };
            let held = match outcome {
                Ok(fetched) => {
                    was_failing = false;
                    if self.readiness.record(None) {
                        tracing::info!("the endpoint accepts this sidecar's configuration now: /readyz answers ready");
                    }
                    // Pushed: the endpoint held a request about exactly the installed snapshot,
                    // or answered it with the one this fetch installed.
                    fetched.held && (fetched.etag.is_some() || *self.installed.lock() == asked)
                }
                Err(ExchangeFailure::Misconfigured(cause)) => {
                    if self.readiness.record(Some(cause.clone())) {
                        tracing::error!(
                            error = %cause,
                            on_endpoint_failure = ?self.on_failure,
                            "the sidecar is configured wrong for its endpoint: /readyz answers 503 until that is fixed, and requests that still come are decided by --on-endpoint-failure"
                        );
                    }
                    was_failing = true;
                    false
                }
                Err(ExchangeFailure::Unavailable(message)) => {
                    // Log transitions only: a dead endpoint must not flood the log once a second.
                    if !was_failing {
                        if self.installed.lock().is_some() {
                            tracing::warn!(error = %message, "cannot fetch the policy snapshot; keeping the cached one");
                        } else {
                            tracing::warn!(
                                error = %message,
                                on_endpoint_failure = ?self.on_failure,
                                "cannot fetch the policy snapshot, and none is cached: requests are decided by --on-endpoint-failure until it arrives"
                            );
                        }
                    }
                    was_failing = true;
                    false
                }
            };
            self.set_pushed(held);
            if !held {
                tokio::select! {
                    _ = tokio::time::sleep_until(started + interval) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return,
                }
            }
        }
    }

    fn set_pushed(&self, pushed: bool) {
        self.snapshot_is_pushed.store(pushed, Ordering::Release);
        self.metrics.snapshot_pushed.set(i64::from(pushed));
    }

    /// Installs the endpoint's snapshot when it differs from `etag`; with `wait` (the poller),
    /// asks the endpoint to hold the request while it does not. An install by the first request's
    /// fetch (no `wait`) clears the pushed state: the poller's held request may be about another
    /// version, so only its next answer says the installed one is current.
    async fn fetch_snapshot(&self, etag: Option<HeaderValue>, wait: bool) -> Result<Fetched, ExchangeFailure> {
        let uri = if wait { &self.endpoint.snapshot_wait_uri } else { &self.endpoint.snapshot_uri };
        let mut request = self.endpoint.authorize(Request::get(uri.clone()));
        if let Some(etag) = &etag {
            request = request.header(IF_NONE_MATCH, etag.clone());
        }
        let unavailable = |message: String| ExchangeFailure::Unavailable(message);
        let request = request.body(Full::new(Bytes::new())).map_err(|e| unavailable(e.to_string()))?;
        let response = self
            .endpoint
            .client
            .request(request)
            .await
            .map_err(|e| ExchangeFailure::of_transport(uri, error_chain(&e)))?;
        let held = response.headers().contains_key(crate::api::SNAPSHOT_WAIT_HEADER);
        if response.status() == StatusCode::NOT_MODIFIED {
            return Ok(Fetched { etag: None, held });
        }
        if !response.status().is_success() {
            return Err(ExchangeFailure::of_status(response.status(), "GET /v1/snapshot"));
        }
        let new_etag = response.headers().get(ETAG).cloned();
        let body = Limited::new(response.into_body(), MAX_ENDPOINT_BODY)
            .collect()
            .await
            .map_err(|e| unavailable(e.to_string()))?
            .to_bytes();
        let document: SnapshotDocument =
            serde_json::from_slice(&body).map_err(|e| unavailable(format!("snapshot: {e}")))?;
        if !document.loaded {
            // The endpoint has no policies yet; an empty cache would wrongly admit everything.
            return Ok(Fetched { etag: None, held: false });
        }
        let names = document
            .header_names
            .iter()
            .filter(|n| HeaderName::from_bytes(n.as_bytes()).is_ok())
            .map(|n| n.to_ascii_lowercase())
            .collect();
        let compiled = crate::policy::compile(document.sources);
        if !compiled.rejected.is_empty() {
            tracing::warn!(
                rejected = compiled.rejected.len(),
                "some policies of the endpoint's snapshot did not compile here"
            );
        }
        if compiled.snapshot.version() != document.version {
            tracing::warn!(
                endpoint = %document.version,
                local = %compiled.snapshot.version(),
                "the cached snapshot compiles to another version (different sluice releases?)"
            );
        }
        let exact = compiled.rejected.is_empty() && compiled.snapshot.version() == document.version;
        let etag = new_etag.or_else(|| HeaderValue::from_str(&format!("\"{}\"", document.version)).ok());
        let mut installed = self.installed.lock();
        if !wait {
            self.set_pushed(false);
        }
        // Not exact while the new snapshot goes in: no request may skip the endpoint on a
        // snapshot whose exactness is not yet known.
        self.local_is_exact.store(false, Ordering::Release);
        self.protection.configure(compiled.snapshot.overload_for(&self.namespace, &self.labels));
        self.local.install(Arc::new(compiled.snapshot));
        self.local_is_exact.store(exact, Ordering::Release);
        self.header_filter.store(Arc::new(HeaderFilter::Only(names)));
        installed.clone_from(&etag);
        drop(installed);
        self.metrics.snapshot_cached.set(1);
        self.metrics.snapshot_updates.inc();
        tracing::info!(version = %document.version, "policy snapshot cached");
        Ok(Fetched { etag, held })
    }
}

/// The request as the local engine sees it: what the endpoint gets in the check.
pub fn view_of<'a>(input: &'a CheckInput<'_>) -> RequestView<'a> {
    RequestView {
        namespace: input.namespace,
        labels: input.labels,
        method: input.method,
        path: input.path,
        host: input.host,
        client_ip: Some(input.client_ip),
        headers: &input.headers,
        cost: 1,
        fields: &input.request_fields,
        descriptor: None,
    }
}

fn from_engine(response: CheckResponse) -> Decision {
    let headers = response.headers.iter().map(|(k, v)| (k.as_ref(), v.as_str()));
    decision_of(
        response.allowed,
        response.retry_after_ms,
        response.delay_ms,
        headers,
        response.lease.clone().map(Held::Local),
        response.status,
        response.body.as_deref(),
    )
}

/// The endpoint's `{"error": "…"}` message, or its body as text.
fn endpoint_reason(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| body.chars().take(200).collect())
}
