//! Getting a decision for a request: from the enforcement endpoint when it answers in time,
//! otherwise from the cached snapshot (local fallback), otherwise from `--on-endpoint-failure`.
//!
//! A circuit breaker sits in front of the endpoint so that once it is known to be down, requests
//! stop paying the timeout: they go straight to the fallback until a probe finds it back.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, ETAG, HeaderName, HeaderValue, IF_NONE_MATCH};
use http::{HeaderMap, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::config::{Config, OnFailure};
use super::metrics::{DecisionLabels, KindLabels, SidecarMetrics};
use crate::clock::{Clock, SystemClock};
use crate::policy::{RateLimitPolicy, RequestView};
use crate::server::engine::{CheckResponse, Engine};
use crate::store::breaker::{Breaker, BreakerConfig};
use crate::store::memory::MemoryStore;
use crate::telemetry::Metrics;

/// The endpoint's answers are small; this only guards against a misdirected URL.
const MAX_ENDPOINT_BODY: usize = 4 << 20;
/// Keys the local fallback may hold: a sidecar sees one pod's traffic.
const LOCAL_MAX_KEYS: usize = 100_000;
/// Retry-After when refusing because the limiter is unreachable.
const FAILURE_RETRY_AFTER_SECS: u64 = 1;

pub type HeaderList = Vec<(HeaderName, HeaderValue)>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow {
        delay: Duration,
        headers: HeaderList,
    },
    Deny {
        retry_after_secs: Option<u64>,
        headers: HeaderList,
    },
    /// The request cannot be decided as sent: answered with a 4xx, never forwarded.
    Refuse(Refusal),
}

/// Why a request is answered with a 4xx by the sidecar itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub detail: String,
}

impl Refusal {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Refusal {
        Refusal { status, detail: detail.into() }
    }
}

/// Most bytes of header values one check carries: with the 8 KiB path bound, a check stays far
/// below the endpoint's 64 KiB body limit, so the endpoint never refuses one as too large.
pub const MAX_CHECK_HEADER_BYTES: usize = 16 * 1024;

/// Who decided, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Endpoint,
    Local,
    FailureMode,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Endpoint => "endpoint",
            Source::Local => "local",
            Source::FailureMode => "failure_mode",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint unreachable: {0}")]
    Unreachable(String),
    #[error("endpoint answered {0}")]
    Status(StatusCode),
    #[error("endpoint refused the check request ({0}): {1}")]
    Rejected(StatusCode, String),
    #[error("endpoint answer not understood: {0}")]
    Decode(String),
    #[error("endpoint did not answer within {0:?}")]
    Timeout(Duration),
}

impl EndpointError {
    pub fn kind(&self) -> &'static str {
        match self {
            EndpointError::Unreachable(_) => "unreachable",
            EndpointError::Status(_) => "status",
            EndpointError::Rejected(..) => "rejected",
            EndpointError::Decode(_) => "decode",
            EndpointError::Timeout(_) => "timeout",
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

/// The bearer token the sidecar presents, re-read from its file as the kubelet rotates it.
struct Credential {
    path: std::path::PathBuf,
    value: arc_swap::ArcSwapOption<HeaderValue>,
}

impl Credential {
    fn new(path: std::path::PathBuf) -> Credential {
        let credential = Credential { path, value: arc_swap::ArcSwapOption::empty() };
        credential.refresh();
        credential
    }

    /// Re-reads the file; a read error keeps the last token (a rotation replaces the file
    /// atomically, so a failed read is transient).
    fn refresh(&self) {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => match HeaderValue::from_str(&format!("Bearer {}", text.trim())) {
                Ok(mut value) => {
                    value.set_sensitive(true);
                    if self.value.load().as_deref() != Some(&value) {
                        self.value.store(Some(Arc::new(value)));
                    }
                }
                Err(_) => tracing::warn!(path = %self.path.display(), "token file does not hold a usable token"),
            },
            Err(error) => tracing::warn!(path = %self.path.display(), %error, "cannot read the token file"),
        }
    }
}

/// One request as the limiter sees it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckInput<'a> {
    pub namespace: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub method: &'a str,
    pub path: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<&'a str>,
    pub client_ip: IpAddr,
    pub headers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointDecision {
    allowed: bool,
    #[serde(default)]
    retry_after_ms: Option<u64>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SnapshotDocument {
    version: String,
    #[serde(default = "yes")]
    loaded: bool,
    #[serde(default)]
    header_names: Vec<String>,
    #[serde(default)]
    sources: Vec<RateLimitPolicy>,
}

fn yes() -> bool {
    true
}

type EndpointClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The client to the endpoint: plain HTTP, or HTTPS verified against the given CA only (never
/// the system roots: in a cluster the endpoint's certificate comes from the operator's CA, and
/// anything else answering at that name is an impostor).
fn endpoint_client(config: &Config) -> Result<EndpointClient, super::SidecarError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut http = HttpConnector::new();
    // Checks are one small write and one small read: Nagle would add a delayed-ACK wait.
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.endpoint_timeout));
    http.enforce_http(false);
    let mut roots = rustls::RootCertStore::empty();
    if let Some(pem) = &config.endpoint_ca {
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| super::SidecarError::Config(format!("endpoint CA: {e}")))?;
            roots.add(cert).map_err(|e| super::SidecarError::Config(format!("endpoint CA: {e}")))?;
        }
        if roots.is_empty() {
            return Err(super::SidecarError::Config("endpoint CA: no certificate in the PEM".into()));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| super::SidecarError::Config(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).build(connector))
}

pub struct Decider {
    client: EndpointClient,
    check_uri: Uri,
    snapshot_uri: Uri,
    timeout: Duration,
    on_failure: OnFailure,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    breaker: Breaker,
    header_filter: ArcSwap<HeaderFilter>,
    /// One first-snapshot fetch at a time, shared by the requests that wait for it.
    first_snapshot: tokio::sync::Mutex<()>,
    credential: Option<Credential>,
    /// The last snapshot fetched, enforced locally while the endpoint is away.
    local: Engine<Arc<MemoryStore>>,
    /// The breaker's and the local fallback's time, and the check timings.
    clock: Arc<dyn Clock>,
    metrics: Arc<SidecarMetrics>,
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
        let client = endpoint_client(config)?;
        let store = Arc::new(MemoryStore::with_clock(LOCAL_MAX_KEYS, clock.clone()));
        Ok(Decider {
            client,
            check_uri: config.check_uri.clone(),
            snapshot_uri: config.snapshot_uri.clone(),
            timeout: config.endpoint_timeout,
            on_failure: config.on_failure,
            namespace: config.namespace.clone(),
            labels: config.labels.clone(),
            breaker: Breaker::new(BreakerConfig::default()),
            header_filter: ArcSwap::from_pointee(HeaderFilter::Unknown),
            first_snapshot: tokio::sync::Mutex::new(()),
            credential: config.token_file.clone().map(Credential::new),
            local: Engine::new(store, clock.clone(), Arc::new(Metrics::new())),
            clock,
            metrics,
        })
    }

    /// The local fallback's store, for the sweeper that drops idle keys.
    pub fn local_store(&self) -> Arc<MemoryStore> {
        self.local.store().clone()
    }

    /// The request headers a check should carry, lower-case names, repeated values joined; `None`
    /// while no snapshot has said which (the first one is fetched here, once, within the endpoint
    /// timeout).
    ///
    /// A used header sent more than once, or not UTF-8, is refused with 400 (no single value
    /// says which bucket it belongs to); used headers over [`MAX_CHECK_HEADER_BYTES`] with 431.
    pub async fn check_headers(&self, headers: &HeaderMap) -> Result<Option<BTreeMap<String, String>>, Refusal> {
        if matches!(**self.header_filter.load(), HeaderFilter::Unknown) {
            let _one = self.first_snapshot.lock().await;
            // Behind the breaker like a check: a dead endpoint costs five waits, not one per request.
            if matches!(**self.header_filter.load(), HeaderFilter::Unknown)
                && let Some(permit) = self.breaker.try_acquire(self.clock.now())
            {
                let fetched = tokio::time::timeout(self.timeout, self.fetch_snapshot(None))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.timeout)));
                match fetched {
                    Ok(_) => permit.success(self.clock.now()),
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
        crate::request::headers::check_used_headers(headers, names)
            .map_err(|detail| Refusal::new(StatusCode::BAD_REQUEST, detail))?;
        let mut out = BTreeMap::new();
        let mut bytes = 0;
        for name in names {
            if let Some(value) = headers.get(name.as_str()).and_then(|v| std::str::from_utf8(v.as_bytes()).ok()) {
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
            OnFailure::Allow => Decision::Allow { delay: Duration::ZERO, headers: Vec::new() },
            OnFailure::Deny => Decision::Deny { retry_after_secs: Some(FAILURE_RETRY_AFTER_SECS), headers: Vec::new() },
        }
    }

    fn authorize(&self, request: http::request::Builder) -> http::request::Builder {
        match self.credential.as_ref().and_then(|c| c.value.load_full()) {
            Some(value) => request.header(crate::server::auth::AUTHORIZATION_HEADER, (*value).clone()),
            None => request,
        }
    }

    pub async fn decide(&self, input: &CheckInput<'_>) -> Decision {
        let started = self.clock.now();
        let error = match self.breaker.try_acquire(started) {
            None => {
                self.metrics.endpoint_errors.get_or_create(&KindLabels { kind: "breaker_open" }).inc();
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
        let request = self
            .authorize(Request::post(self.check_uri.clone()))
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| EndpointError::Rejected(StatusCode::BAD_REQUEST, e.to_string()))?;
        let response = self.client.request(request).await.map_err(|e| EndpointError::Unreachable(error_chain(&e)))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ENDPOINT_BODY)
            .collect()
            .await
            .map_err(|e| EndpointError::Unreachable(e.to_string()))?
            .to_bytes();
        if status == StatusCode::BAD_REQUEST || status == StatusCode::PAYLOAD_TOO_LARGE {
            return Err(EndpointError::Rejected(status, String::from_utf8_lossy(&body).into_owned()));
        }
        if !status.is_success() {
            return Err(EndpointError::Status(status));
        }
        let answer: EndpointDecision =
            serde_json::from_slice(&body).map_err(|e| EndpointError::Decode(e.to_string()))?;
        let headers = answer.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        Ok(decision_of(answer.allowed, answer.retry_after_ms, answer.delay_ms, headers))
    }

    async fn fallback(&self, input: &CheckInput<'_>) -> (Source, Decision) {
        if self.local.is_loaded() {
            let view = RequestView {
                namespace: input.namespace,
                labels: input.labels,
                method: input.method,
                path: input.path,
                host: input.host,
                client_ip: Some(input.client_ip),
                headers: &input.headers,
                cost: 1,
                descriptor: None,
            };
            return (Source::Local, from_engine(self.local.check(&view).await));
        }
        (Source::FailureMode, self.failure_mode())
    }

    /// Polls `GET /v1/snapshot` (If-None-Match, so an unchanged snapshot costs a 304) until
    /// `shutdown`, keeping the header filter and the local fallback current.
    pub async fn poll_snapshots(self: Arc<Self>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut etag: Option<HeaderValue> = None;
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut was_failing = false;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            if let Some(credential) = &self.credential {
                credential.refresh();
            }
            // A snapshot can be large; give it more time than a check but never hang the loop.
            let fetch = tokio::time::timeout(interval.max(Duration::from_secs(2)), self.fetch_snapshot(etag.clone()));
            match fetch.await.unwrap_or_else(|_| Err("timed out".into())) {
                Ok(Some(new_etag)) => {
                    etag = Some(new_etag);
                    was_failing = false;
                }
                Ok(None) => was_failing = false,
                Err(message) => {
                    // Log transitions only: a dead endpoint must not flood the log once a second.
                    if !was_failing {
                        tracing::warn!(error = %message, "cannot fetch the policy snapshot; keeping the cached one");
                    }
                    was_failing = true;
                }
            }
        }
    }

    /// `Ok(Some(etag))` after installing a new snapshot, `Ok(None)` when unchanged.
    async fn fetch_snapshot(&self, etag: Option<HeaderValue>) -> Result<Option<HeaderValue>, String> {
        let mut request = self.authorize(Request::get(self.snapshot_uri.clone()));
        if let Some(etag) = &etag {
            request = request.header(IF_NONE_MATCH, etag.clone());
        }
        let request = request.body(Full::new(Bytes::new())).map_err(|e| e.to_string())?;
        let response = self.client.request(request).await.map_err(|e| error_chain(&e))?;
        if response.status() == StatusCode::NOT_MODIFIED {
            return Ok(None);
        }
        if !response.status().is_success() {
            return Err(format!("snapshot request answered {}", response.status()));
        }
        let new_etag = response.headers().get(ETAG).cloned();
        let body = Limited::new(response.into_body(), MAX_ENDPOINT_BODY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let document: SnapshotDocument = serde_json::from_slice(&body).map_err(|e| format!("snapshot: {e}"))?;
        if !document.loaded {
            // The endpoint has no policies yet; an empty cache would wrongly admit everything.
            return Ok(None);
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
        self.local.install(Arc::new(compiled.snapshot));
        self.header_filter.store(Arc::new(HeaderFilter::Only(names)));
        self.metrics.snapshot_cached.set(1);
        self.metrics.snapshot_updates.inc();
        tracing::info!(version = %document.version, "policy snapshot cached");
        Ok(new_etag.or_else(|| HeaderValue::from_str(&format!("\"{}\"", document.version)).ok()))
    }
}

fn from_engine(response: CheckResponse) -> Decision {
    let headers = response.headers.iter().map(|(k, v)| (*k, v.as_str()));
    decision_of(response.allowed, response.retry_after_ms, response.delay_ms, headers)
}

/// A check answer (the endpoint's, or the local engine's) as what the proxy does; headers that
/// are not valid HTTP are dropped rather than failing the request.
fn decision_of<'a>(
    allowed: bool,
    retry_after_ms: Option<u64>,
    delay_ms: u64,
    headers: impl Iterator<Item = (&'a str, &'a str)>,
) -> Decision {
    let headers = headers
        .filter_map(|(k, v)| Some((HeaderName::from_bytes(k.as_bytes()).ok()?, HeaderValue::from_str(v).ok()?)))
        .collect();
    if allowed {
        Decision::Allow { delay: Duration::from_millis(delay_ms), headers }
    } else {
        Decision::Deny { retry_after_secs: retry_after_ms.map(|ms| ms.div_ceil(1000)), headers }
    }
}

/// The endpoint's `{"error": "…"}` message, or its body as text.
fn endpoint_reason(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| body.chars().take(200).collect())
}

/// hyper-util's errors put the useful part (connection refused…) in the source chain.
pub(super) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
