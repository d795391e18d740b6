//! The sidecar's copy of the endpoint's policy snapshot (`GET /v1/snapshot`): what says which
//! request headers a check carries, the local engine that decides while the endpoint is away,
//! and whether that copy is current enough to decide some requests without asking at all.
//!
//! Apart from the exchange and the settling because it lives on its own schedule (a poller that
//! the endpoint holds until the snapshot changes, plus one fetch by the first request), and
//! because others follow what it installs: the proxy's overload protection is configured by each
//! snapshot the moment it goes in ([`OnInstall`]), before any request is decided on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, Guard};
use bytes::Bytes;
use http::header::{ETAG, HeaderName, HeaderValue, IF_NONE_MATCH};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use tokio::sync::watch;

use super::config::{Config, OnFailure};
use super::endpoint::{Endpoint, ExchangeFailure, MAX_ENDPOINT_BODY};
use super::exchange::EndpointExchange;
use super::metrics::SidecarMetrics;
use super::verdict::error_chain;
use crate::api::check::CheckInput;
use crate::api::snapshot::SnapshotDocument;
use crate::clock::Clock;
use crate::engine::Engine;
use crate::policy::Snapshot;
use crate::store::memory::MemoryStore;
use crate::telemetry::Metrics;

/// Keys the local fallback may hold: a sidecar sees one pod's traffic.
const LOCAL_MAX_KEYS: usize = 100_000;

/// How long the endpoint may hold a snapshot request while nothing changes.
pub(super) const SNAPSHOT_WAIT: Duration = Duration::from_secs(30);

/// Told of each snapshot as it is installed, before any request can be decided on it (called
/// while installs are serialized, so calls come in install order).
pub type OnInstall = Box<dyn Fn(&Snapshot) + Send + Sync>;

/// Which request headers the check carries: only the ones this namespace's policies use. Until
/// a snapshot says which, no check is sent: sending every header would hand the client's
/// cookies and credentials to the endpoint, and sending none would decide header-keyed rules
/// on a missing key.
#[derive(Debug)]
pub(super) enum HeaderFilter {
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

/// The cached snapshot, the local engine it is installed in, and what is known of how current
/// it is.
pub struct SnapshotCache {
    endpoint: Arc<Endpoint>,
    namespace: String,
    /// Named in the logs of failed fetches: what decides requests while none is cached.
    on_failure: OnFailure,
    header_filter: ArcSwap<HeaderFilter>,
    /// One first-snapshot fetch at a time, shared by the requests that wait for it.
    first_snapshot: tokio::sync::Mutex<()>,
    /// The last snapshot fetched, enforced locally while the endpoint is away.
    local: Engine<Arc<MemoryStore>>,
    /// The cached snapshot compiled to the endpoint's own version (nothing rejected here).
    local_is_exact: AtomicBool,
    /// The last snapshot request succeeded and the endpoint holds unchanged-snapshot requests
    /// (it answers as soon as the snapshot changes), so the cached one is current.
    snapshot_is_pushed: AtomicBool,
    /// The ETag of the snapshot installed; installs happen one at a time under this lock.
    installed: parking_lot::Mutex<Option<HeaderValue>>,
    on_install: OnInstall,
    metrics: Arc<SidecarMetrics>,
    /// What `/readyz` answers, from the snapshot requests' outcomes.
    pub readiness: Arc<Readiness>,
}

impl SnapshotCache {
    /// An empty cache of `endpoint`'s snapshot for `config`'s namespace; the local engine runs
    /// on `clock`.
    pub(super) fn new(
        config: &Config,
        endpoint: Arc<Endpoint>,
        clock: Arc<dyn Clock>,
        metrics: Arc<SidecarMetrics>,
        on_install: OnInstall,
    ) -> SnapshotCache {
        let store = Arc::new(MemoryStore::with_clock(LOCAL_MAX_KEYS, clock.clone()));
        SnapshotCache {
            endpoint,
            namespace: config.namespace.clone(),
            on_failure: config.on_failure,
            header_filter: ArcSwap::from_pointee(HeaderFilter::Unknown),
            first_snapshot: tokio::sync::Mutex::new(()),
            local: Engine::new(store, clock, Arc::new(Metrics::new())),
            local_is_exact: AtomicBool::new(false),
            snapshot_is_pushed: AtomicBool::new(false),
            installed: parking_lot::Mutex::new(None),
            on_install,
            metrics,
            readiness: Arc::default(),
        }
    }

    /// The engine of the cached snapshot: the local fallback, and what settles its holds.
    pub(super) fn local(&self) -> &Engine<Arc<MemoryStore>> {
        &self.local
    }

    /// The cached snapshot compiles to the endpoint's own version.
    pub(super) fn is_exact(&self) -> bool {
        self.local_is_exact.load(Ordering::Acquire)
    }

    /// The cached snapshot is current: the endpoint holds this sidecar's snapshot request and
    /// would have answered it with a change.
    pub(super) fn is_pushed(&self) -> bool {
        self.snapshot_is_pushed.load(Ordering::Acquire)
    }

    /// Which headers a check carries. While no snapshot has said, the first one is fetched here,
    /// once for all the requests waiting, behind `exchange`'s breaker and within its timeout
    /// (a dead endpoint costs the breaker's few waits, not one per request).
    pub(super) async fn header_filter(&self, exchange: &EndpointExchange) -> Guard<Arc<HeaderFilter>> {
        if matches!(**self.header_filter.load(), HeaderFilter::Unknown) {
            let _one = self.first_snapshot.lock().await;
            if matches!(**self.header_filter.load(), HeaderFilter::Unknown)
                && let Some(Err(error)) = exchange.through_breaker(self.fetch_snapshot(None, false)).await
            {
                tracing::debug!(%error, "first snapshot not available");
            }
        }
        self.header_filter.load()
    }

    /// The top-level request body fields the estimates of the namespace's rules read.
    pub fn estimate_fields(&self) -> Vec<String> {
        self.local.live().snapshot.estimate_fields(&self.namespace)
    }

    /// The class of a request when the application is overloaded (the cached snapshot's
    /// `priorities`; `default` before the first snapshot);
    /// `None` for a request `overload.exempt` leaves alone.
    pub fn classify(&self, input: &CheckInput<'_>) -> Option<crate::overload::Class> {
        let live = self.local.live();
        let view = input.view();
        (!live.snapshot.exempt_from_overload(&view)).then(|| live.snapshot.classify(&view).0)
    }

    /// The `staleIfLimited` of the cached snapshot's rules that match a request.
    pub fn stale_for(&self, input: &CheckInput<'_>) -> Option<crate::policy::snapshot::Stale> {
        self.local.live().snapshot.stale_for(&input.view())
    }

    /// The `deferIfLimited` of the first rule of the cached snapshot a write matches that has it.
    pub fn defer_for(&self, input: &CheckInput<'_>) -> Option<crate::policy::Defer> {
        self.local.live().snapshot.defer_for(&input.view()).and_then(|rule| rule.defer().cloned())
    }

    /// Whether the cached snapshot gives a workload of `namespace` with `labels` queues of
    /// deferred writes to deliver.
    pub fn delivers(&self, namespace: &str, labels: &std::collections::BTreeMap<String, String>) -> bool {
        !self.local.live().snapshot.deferring_rules_for(namespace, labels).is_empty()
    }

    /// The local fallback's store, for the sweeper that drops idle keys.
    pub fn local_store(&self) -> Arc<MemoryStore> {
        self.local.store().clone()
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

    /// Records whether the cached snapshot is known current (see `snapshot_is_pushed`).
    pub(super) fn set_pushed(&self, pushed: bool) {
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
        (self.on_install)(&compiled.snapshot);
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
