//! The HTTP API over the engine: `POST /v1/check`, its batch form `POST /v1/checks`,
//! `POST /v1/explain`, the Envoy ext_authz-compatible `/v1/authz/…`, health, readiness, metrics
//! and the live snapshot.
//!
//! The check, authz and snapshot APIs first establish the [`Caller`] (see [`super::auth`]):
//! 401 when no valid credential was presented, 403 when the caller asks about what it may not,
//! 503 when the credential cannot be verified right now. Health, readiness and metrics stay
//! open for probes and scrapers.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use serde_json::json;

use super::auth::{Auth, AuthError, Caller, Forbidden};
use crate::api::check::{BadRequest, CheckRequest, check_path};
use crate::api::checks::{BatchBody, BatchResult, BatchResults, LeanDecision};
use crate::api::leases::{Grant, Granted, LeasesBody};
use crate::api::settle::SettleBody;
use crate::api::snapshot::{SnapshotBody, SnapshotView};
use crate::api::{MAX_BATCH_BODY_BYTES, MAX_BATCH_CHECKS, MAX_BODY_BYTES, MAX_SNAPSHOT_WAIT, SNAPSHOT_WAIT_HEADER};
use crate::engine::MAX_COST;
use crate::engine::{CheckResponse, Engine, Holds};
use crate::policy::RequestView;
use crate::request::forwarded::gateway_client_ip;
use crate::request::headers::{HeaderLookup, check_used_headers};
use crate::request::host::request_host;
use crate::request::labels::parse_label_list;
use crate::store::Store;
use crate::telemetry::{ReasonLabels, StatusLabels};

/// Checks of one batch decided at once.
pub const BATCH_IN_FLIGHT: usize = 32;

/// Request headers the ext_authz mode reads for what Envoy cannot put in the path.
pub const NAMESPACE_HEADER: &str = "x-sluice-namespace";
pub const LABELS_HEADER: &str = "x-sluice-labels";
pub const COST_HEADER: &str = "x-sluice-cost";
/// Opt-in status for a denial in the ext_authz mode. nginx `auth_request` turns any answer but
/// 2xx, 401 and 403 into a 500, so nginx asks for 403 and maps it back to 429 itself.
pub const DENY_STATUS_HEADER: &str = "x-sluice-deny-status";

/// What the handlers share.
pub struct ApiState<S> {
    pub engine: Arc<Engine<S>>,
    pub auth: Auth,
    /// X-Forwarded-For hops a gateway's ext_authz call carries that are its own (see
    /// [`gateway_client_ip`]).
    pub gateway_trusted_hops: usize,
}

impl<S> ApiState<S> {
    /// Authentication off (every caller trusted), one gateway hop.
    pub fn open(engine: Arc<Engine<S>>) -> ApiState<S> {
        ApiState { engine, auth: Auth::off(), gateway_trusted_hops: 1 }
    }
}

/// The API with authentication off: for `sluice serve` without tokens, tests and tools.
pub fn router<S: Store>(engine: Arc<Engine<S>>) -> Router {
    router_with(ApiState::open(engine))
}

/// Health, readiness and metrics only: what probes and scrapers need, without the check API.
pub fn admin_router<S: Store>(engine: Arc<Engine<S>>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .with_state(Arc::new(ApiState::open(engine)))
}

pub fn router_with<S: Store>(state: ApiState<S>) -> Router {
    Router::new()
        .route("/v1/check", post(check::<S>))
        .route("/v1/checks", post(checks::<S>).layer(DefaultBodyLimit::max(MAX_BATCH_BODY_BYTES)))
        .route("/v1/release", post(settle::<S>))
        .route("/v1/settle", post(settle::<S>))
        .route("/v1/leases", post(leases::<S>))
        .route("/v1/explain", post(explain::<S>))
        .route("/v1/authz", any(authz::<S>))
        .route("/v1/authz/", any(authz::<S>))
        .route("/v1/authz/{*path}", any(authz::<S>))
        .route("/v1/snapshot", get(snapshot::<S>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Arc::new(state))
}

type Shared<S> = State<Arc<ApiState<S>>>;

fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

fn bad_request(engine_metrics: &crate::telemetry::Metrics, error: BadRequest) -> Response {
    engine_metrics.responses.get_or_create(&StatusLabels { status: 400 }).inc();
    error_response(StatusCode::BAD_REQUEST, error.0)
}

/// Reads a request body of at most `limit` bytes: only once the caller is verified, so a client
/// without a credential never gets the endpoint to buffer (or wait for) a body.
async fn read_body(engine_metrics: &crate::telemetry::Metrics, body: Body, limit: usize) -> Result<Bytes, Response> {
    let error = match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => return Ok(bytes),
        Err(error) => error,
    };
    let too_large = error.into_inner().downcast_ref::<http_body_util::LengthLimitError>().is_some();
    let (status, message) = if too_large {
        (StatusCode::PAYLOAD_TOO_LARGE, format!("request body larger than {limit} bytes"))
    } else {
        (StatusCode::BAD_REQUEST, "could not read the request body".to_string())
    };
    engine_metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    Err(error_response(status, message))
}

/// 401 (with a Bearer challenge) or 503, counted by reason.
fn auth_failure(metrics: &crate::telemetry::Metrics, error: AuthError) -> Response {
    let (status, reason) = match &error {
        AuthError::Missing => (StatusCode::UNAUTHORIZED, "missing"),
        AuthError::Invalid(_) => (StatusCode::UNAUTHORIZED, "invalid"),
        AuthError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    };
    metrics.auth_failures.get_or_create(&ReasonLabels { reason }).inc();
    metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    let mut response = error_response(status, error.to_string());
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"sluice\""));
    }
    response
}

/// `status` is 403, except where a denial itself is 403 (nginx): then 401, so an authorization
/// failure never reads as a rate-limit denial.
fn forbidden(metrics: &crate::telemetry::Metrics, error: Forbidden, status: StatusCode) -> Response {
    metrics.auth_failures.get_or_create(&ReasonLabels { reason: "forbidden" }).inc();
    metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    error_response(status, error.to_string())
}

/// The verified caller and its parsed check body: what `/v1/check` and `/v1/explain` both start
/// from, or the 4xx that ends the request.
async fn caller_and_request<S: Store>(
    state: &ApiState<S>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Caller, CheckRequest), Response> {
    let metrics = state.engine.metrics();
    let caller = state.auth.caller(headers).await.map_err(|error| auth_failure(metrics, error))?;
    let body = read_body(metrics, body, MAX_BODY_BYTES).await?;
    let request = CheckRequest::from_json(&body).map_err(|error| bad_request(metrics, error))?;
    Ok((caller, request))
}

async fn check<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    let engine = &state.engine;
    let (caller, request) = match caller_and_request(&state, &headers, body).await {
        Ok(parsed) => parsed,
        Err(response) => return response,
    };
    let view = match request.view(&caller) {
        Ok(view) => view,
        Err(error) => return forbidden(engine.metrics(), error, StatusCode::FORBIDDEN),
    };
    let decision = engine.check(&view, Holds::Returned).await;
    engine.metrics().responses_ok.inc();
    json_response(StatusCode::OK, &decision, None)
}

/// Most rule names a settle names.
const MAX_SETTLE_COSTS: usize = 64;

/// Settles what an admitted request held once it has ended: concurrency slots are given back,
/// reservations charged their actual cost. 200 `{"settled": N}` with the holds found (0 when
/// settled before, or run out: retrying is safe and charges nothing twice), 400 for a token
/// this endpoint did not issue or a malformed cost, 403 for a lease of a namespace the caller
/// may not act in, 503 when the store did not answer (the holds then run out by themselves).
async fn settle<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    let engine = &state.engine;
    let metrics = engine.metrics();
    let caller = match state.auth.caller(&headers).await {
        Ok(caller) => caller,
        Err(error) => return auth_failure(metrics, error),
    };
    let body = match read_body(metrics, body, crate::engine::hold::MAX_TOKEN_LEN + 8 * 1024).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let parsed = match serde_json::from_slice::<SettleBody>(&body) {
        Ok(parsed) => parsed,
        Err(error) => {
            return bad_request(
                metrics,
                BadRequest(format!("expected {{\"lease\": \"…\"}} with cost, costs or failed: {error}")),
            );
        }
    };
    let lease = match engine.verify_hold(&parsed.lease) {
        Ok(lease) => lease,
        Err(error) => return bad_request(metrics, BadRequest(error.to_string())),
    };
    let too_large = parsed.cost.into_iter().chain(parsed.costs.values().copied()).any(|c| c > MAX_COST);
    if too_large || parsed.costs.len() > MAX_SETTLE_COSTS {
        return bad_request(
            metrics,
            BadRequest(format!("cost: at most {MAX_COST} each, for at most {MAX_SETTLE_COSTS} rules")),
        );
    }
    let cost = match parsed.settle_cost() {
        Ok(cost) => cost,
        Err(message) => return bad_request(metrics, BadRequest(message)),
    };
    if let Err(error) = caller.namespace_of(Some(&lease.namespace)) {
        return forbidden(metrics, error, StatusCode::FORBIDDEN);
    }
    match engine.settle(&lease, &cost).await {
        Ok(found) => {
            metrics.responses_ok.inc();
            // `released` says whether this call found a hold to give back: a second release of
            // the same lease, or one whose hold ran out, frees nothing and must not say it did.
            (StatusCode::OK, axum::Json(json!({ "settled": found, "released": found > 0 }))).into_response()
        }
        Err(error) => {
            metrics.store_errors.get_or_create(&crate::telemetry::KindLabels { kind: error.kind() }).inc();
            metrics.responses.get_or_create(&StatusLabels { status: 503 }).inc();
            error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the settle did not reach the store ({error}); the holds run out by themselves, and retrying is safe"
                ),
            )
        }
    }
}

/// Most lease operations in one `POST /v1/leases`, and the longest key.
const MAX_LEASE_OPS: usize = 64;
const MAX_LEASE_KEY_BYTES: usize = 1024;

/// `POST /v1/leases`: a holder elsewhere (a sidecar) settles the quota leases it held and asks
/// for new ones, for `consistency: leased` rules of a namespace it may act in. 200
/// `{"grants": [{"amount", "lastsUs", "remaining", "resetAfterUs", "holders"}, …]}` in order (amount 0:
/// none), 400 naming what is wrong, 403 for another namespace, 503 when the store did not
/// answer.
async fn leases<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    let engine = &state.engine;
    let metrics = engine.metrics();
    let caller = match state.auth.caller(&headers).await {
        Ok(caller) => caller,
        Err(error) => return auth_failure(metrics, error),
    };
    let body = match read_body(metrics, body, 256 * 1024).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let parsed = match serde_json::from_slice::<LeasesBody>(&body) {
        Ok(parsed) => parsed,
        Err(error) => {
            return bad_request(
                metrics,
                BadRequest(format!(
                    "expected {{\"namespace\": \"…\", \"leases\": [{{\"rule\", \"key\", \"settle\", \"ask\"}}]}}: {error}"
                )),
            );
        }
    };
    if parsed.leases.len() > MAX_LEASE_OPS {
        return bad_request(metrics, BadRequest(format!("leases: at most {MAX_LEASE_OPS} per call")));
    }
    if let Err(error) = caller.namespace_of(Some(&parsed.namespace)) {
        return forbidden(metrics, error, StatusCode::FORBIDDEN);
    }
    let id = |text: &str, field: String| -> Result<u64, BadRequest> {
        text.parse::<u64>().map_err(|_| BadRequest(format!("{field}: expected a decimal id, got {text:?}")))
    };
    let mut asks = Vec::with_capacity(parsed.leases.len());
    for (i, entry) in parsed.leases.iter().enumerate() {
        let parsed_entry = (|| {
            if entry.key.len() > MAX_LEASE_KEY_BYTES {
                return Err(BadRequest(format!("leases[{i}].key: longer than {MAX_LEASE_KEY_BYTES} bytes")));
            }
            let settle = match &entry.settle {
                Some(s) => Some((id(&s.hold, format!("leases[{i}].settle.hold"))?, s.spent.min(MAX_COST))),
                None => None,
            };
            let ask = match &entry.ask {
                Some(a) => match id(&a.hold, format!("leases[{i}].ask.hold"))? {
                    0 => return Err(BadRequest(format!("leases[{i}].ask.hold: 0 is no hold id"))),
                    hold => Some((hold, a.want)),
                },
                None => None,
            };
            Ok(crate::engine::HolderLease {
                rule: id(&entry.rule, format!("leases[{i}].rule"))?,
                key: entry.key.clone(),
                settle,
                ask,
            })
        })();
        match parsed_entry {
            Ok(ask) => asks.push(ask),
            Err(error) => return bad_request(metrics, error),
        }
    }
    match engine.lease_for_holder(&parsed.namespace, &asks).await {
        Ok(grants) => {
            metrics.responses_ok.inc();
            let grants = grants
                .iter()
                .map(|g| Grant {
                    amount: g.amount,
                    lasts_us: g.lasts,
                    remaining: g.after.remaining,
                    reset_after_us: g.after.reset_after,
                    holders: g.holders,
                })
                .collect();
            (StatusCode::OK, axum::Json(Granted { grants })).into_response()
        }
        Err(crate::engine::HolderLeaseError::Refused(message)) => bad_request(metrics, BadRequest(message)),
        Err(crate::engine::HolderLeaseError::Store(error)) => {
            metrics.store_errors.get_or_create(&crate::telemetry::KindLabels { kind: error.kind() }).inc();
            metrics.responses.get_or_create(&StatusLabels { status: 503 }).inc();
            error_response(StatusCode::SERVICE_UNAVAILABLE, format!("the leases did not reach the store ({error})"))
        }
    }
}

/// Many checks in one call, for a proxy that has several requests waiting (the sidecar under
/// load): one HTTP exchange instead of one per request. Each check is parsed, authorized and
/// decided exactly as `POST /v1/check` would, concurrently, and answered in order; one bad check
/// is refused on its own (`{"status": 400, "error": …}`) without failing the others. The
/// caller's credential covers the whole batch.
async fn checks<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    let engine = &state.engine;
    let metrics = engine.metrics();
    let caller = match state.auth.caller(&headers).await {
        Ok(caller) => caller,
        Err(error) => return auth_failure(metrics, error),
    };
    let body = match read_body(metrics, body, MAX_BATCH_BODY_BYTES).await {
        Ok(body) => body,
        Err(response) => return response,
    };
    let batch: BatchBody = match serde_json::from_slice(&body) {
        Ok(batch) => batch,
        Err(e) => {
            return bad_request(metrics, BadRequest(format!("expected {{\"requests\": [check, …]}}: {e}")));
        }
    };
    if batch.requests.len() > MAX_BATCH_CHECKS {
        return bad_request(
            metrics,
            BadRequest(format!("requests: {} checks, at most {MAX_BATCH_CHECKS} per batch", batch.requests.len())),
        );
    }
    // Each check within what `POST /v1/check` takes, so a batch cannot carry one it would refuse.
    let parsed: Vec<Result<CheckRequest, (StatusCode, String)>> = batch
        .requests
        .iter()
        .map(|raw| {
            let text = raw.get();
            if text.len() > MAX_BODY_BYTES {
                return Err((StatusCode::PAYLOAD_TOO_LARGE, format!("check larger than {MAX_BODY_BYTES} bytes")));
            }
            CheckRequest::from_json(text.as_bytes()).map_err(|error| (StatusCode::BAD_REQUEST, error.0))
        })
        .collect();
    let views: Vec<Result<RequestView, (StatusCode, String)>> = parsed
        .iter()
        .map(|request| match request {
            Ok(request) => request.view(&caller).map_err(|error| {
                metrics.auth_failures.get_or_create(&ReasonLabels { reason: "forbidden" }).inc();
                (StatusCode::FORBIDDEN, error.to_string())
            }),
            Err((status, error)) => Err((*status, error.clone())),
        })
        .collect();
    // BATCH_IN_FLIGHT checks at a time, in order: each holds its rules' keys while the store
    // answers, so a batch of 256 checks of many rules and long keys holds 32 checks' worth of
    // keys, not all of them (a shared-Redis batch still groups them into a few calls).
    let decidable: Vec<&RequestView> = views.iter().filter_map(|view| view.as_ref().ok()).collect();
    let mut decisions = Vec::with_capacity(decidable.len());
    for chunk in decidable.chunks(BATCH_IN_FLIGHT) {
        decisions.extend(futures::future::join_all(chunk.iter().map(|view| engine.check(view, Holds::Returned))).await);
    }
    let mut decisions = decisions.iter();
    let results: Vec<BatchResult> = views
        .into_iter()
        .map(|view| match view {
            Ok(_) => match decisions.next() {
                Some(decision) => {
                    metrics.responses_ok.inc();
                    BatchResult::Decided(LeanDecision {
                        allowed: decision.allowed,
                        status: decision.status,
                        retry_after_ms: decision.retry_after_ms,
                        delay_ms: decision.delay_ms,
                        headers: &decision.headers,
                        body: decision.body.as_deref(),
                        snapshot: &decision.snapshot,
                        lease: decision.lease.as_deref(),
                    })
                }
                None => BatchResult::Refused { status: 500, error: "no decision".into() },
            },
            Err((status, error)) => {
                metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
                BatchResult::Refused { status: status.as_u16(), error }
            }
        })
        .collect();
    let mut body = Vec::with_capacity(32 + 320 * results.len());
    if let Err(e) = serde_json::to_writer(&mut body, &BatchResults { results: &results }) {
        return error_response(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the decisions: {e}"));
    }
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// Why each rule of the caller's namespace applies or not, with the decision a check would make
/// now; the same body and caller rules as `/v1/check`, and it consumes nothing.
async fn explain<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    let engine = &state.engine;
    let (caller, request) = match caller_and_request(&state, &headers, body).await {
        Ok(parsed) => parsed,
        Err(response) => return response,
    };
    let view = match request.view(&caller) {
        Ok(view) => view,
        Err(error) => return forbidden(engine.metrics(), error, StatusCode::FORBIDDEN),
    };
    let live = engine.live();
    let explanation = live.snapshot.explain(&view);
    // A store that cannot read without consuming (Redis) leaves the decision unknown.
    let verdict = engine.store().peek_for(view.namespace, None, &explanation.checks()).await.ok().flatten();
    axum::Json(explanation.report(verdict.as_ref())).into_response()
}

/// Envoy's ext_authz HTTP service: the original method and path (after the `/v1/authz` prefix),
/// Host and headers arrive as they were; 200 admits, 429 with the rate-limit headers refuses.
///
/// Only a trusted caller (a gateway) may name the namespace (`x-sluice-namespace`), the cost
/// (`x-sluice-cost`) and the client (`x-envoy-external-address`, X-Forwarded-For). From a tenant
/// the namespace must be its own, the cost is 1 and the client is the connection's peer.
async fn authz<S: Store>(State(state): Shared<S>, request: axum::extract::Request) -> Response {
    let engine = &state.engine;
    let metrics = engine.metrics();
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let headers = request.headers();
    let deny_status = match deny_status(headers) {
        Ok(status) => status,
        Err(error) => return bad_request(metrics, error),
    };
    // Where a denial is 403 (nginx), 403 cannot also mean "not allowed".
    let forbidden_status =
        if deny_status == StatusCode::FORBIDDEN { StatusCode::UNAUTHORIZED } else { StatusCode::FORBIDDEN };
    let caller = match state.auth.caller(headers).await {
        Ok(caller) => caller,
        Err(error) => return auth_failure(metrics, error),
    };
    let parts = match AuthzParts::read(request.uri(), headers, &caller) {
        Ok(parts) => parts,
        Err(AuthzError::Bad(error)) => return bad_request(metrics, error),
        Err(AuthzError::Forbidden(error)) => return forbidden(metrics, error, forbidden_status),
    };
    let live = engine.live();
    if let Err(problem) = check_used_headers(headers, live.snapshot.namespace_header_names(&parts.namespace)) {
        return bad_request(metrics, BadRequest(problem.to_string()));
    }
    // The URI is this call's own, not the original request's: only Host names the host.
    let host = match request_host(headers, None) {
        Ok(host) => host,
        Err(problem) => return bad_request(metrics, BadRequest(problem.to_string())),
    };
    let client_ip = match (caller.is_trusted(), peer) {
        (true, Some(peer)) => Some(gateway_client_ip(headers, peer.ip(), state.gateway_trusted_hops)),
        (false, Some(peer)) => Some(peer.ip().to_canonical()),
        (_, None) => None,
    };
    let view = RequestView {
        namespace: &parts.namespace,
        labels: &parts.labels,
        method: request.method().as_str(),
        path: &parts.path,
        host,
        client_ip,
        headers: &HeaderLookup(headers),
        cost: parts.cost,
        fields: &crate::request::names::NoEntries,
        descriptor: None,
    };
    let decision = engine.check(&view, Holds::Skipped("authz")).await;
    // A refusing rule's declared refusal replaces the default 429, unless the caller asked for
    // its own denial status (nginx passes on only 401 and 403, and no body).
    let declared = !decision.allowed
        && deny_status == StatusCode::TOO_MANY_REQUESTS
        && (decision.status != 429 || decision.body.is_some());
    let status = match (decision.allowed, declared) {
        (true, _) => StatusCode::OK,
        // To ext_authz any 2xx means "allow": a declared 2xx goes out as the denial status, with
        // the declared headers and body.
        (false, true) => StatusCode::from_u16(decision.status).ok().filter(|s| !s.is_success()).unwrap_or(deny_status),
        (false, false) => deny_status,
    };
    metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    if declared && !decision.allowed {
        return declared_refusal(status, &decision);
    }
    json_response(status, &decision, Some(&decision.headers))
}

/// A refused request's declared refusal: its status, the rate-limit and declared headers, its
/// body (Envoy's ext_authz passes all three to the client).
fn declared_refusal(status: StatusCode, decision: &CheckResponse) -> Response {
    let body = decision.body.as_deref().unwrap_or("").to_string();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let map = response.headers_mut();
    map.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    add_response_headers(map, &decision.headers);
    response
}

fn add_response_headers(map: &mut HeaderMap, headers: &[(std::borrow::Cow<'static, str>, String)]) {
    for (name, value) in headers {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
            map.insert(name, value);
        }
    }
}

/// 429 unless the caller asked for 401 or 403 (the only denials nginx `auth_request` passes on).
fn deny_status(headers: &HeaderMap) -> Result<StatusCode, BadRequest> {
    match headers.get(DENY_STATUS_HEADER).map(|v| v.as_bytes()) {
        None | Some(b"429") => Ok(StatusCode::TOO_MANY_REQUESTS),
        Some(b"403") => Ok(StatusCode::FORBIDDEN),
        Some(b"401") => Ok(StatusCode::UNAUTHORIZED),
        Some(other) => Err(BadRequest(format!(
            "header {DENY_STATUS_HEADER}: must be 401, 403 or 429, got {:?}",
            String::from_utf8_lossy(other)
        ))),
    }
}

enum AuthzError {
    Bad(BadRequest),
    Forbidden(Forbidden),
}

impl From<BadRequest> for AuthzError {
    fn from(error: BadRequest) -> Self {
        AuthzError::Bad(error)
    }
}

/// What an ext_authz call says besides the original request, with the caller's rights applied.
struct AuthzParts {
    namespace: String,
    labels: BTreeMap<String, String>,
    path: String,
    cost: u64,
}

impl AuthzParts {
    fn read(uri: &Uri, headers: &HeaderMap, caller: &Caller) -> Result<AuthzParts, AuthzError> {
        let full = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
        let path = full.strip_prefix("/v1/authz").unwrap_or(full);
        let path = if path.is_empty() || path.starts_with('?') { format!("/{path}") } else { path.to_string() };
        check_path(&path)?;
        let text = |name: &str| -> Result<Option<&str>, BadRequest> {
            match headers.get(name) {
                None => Ok(None),
                Some(value) => value
                    .to_str()
                    .map(|v| Some(v.trim()))
                    .map_err(|_| BadRequest(format!("header {name}: not visible ASCII"))),
            }
        };
        let namespace = caller.namespace_of(text(NAMESPACE_HEADER)?).map_err(AuthzError::Forbidden)?.to_string();
        // Labels choose which policies apply: a tenant's proxy passes its clients' headers
        // through, and a client must not pick a label that unselects a policy, so only a
        // gateway's count (as for the cost).
        let labels = match text(LABELS_HEADER)? {
            Some(list) if caller.is_trusted() => {
                parse_label_list(list).map_err(|e| BadRequest(format!("header {LABELS_HEADER}: {e}")))?
            }
            _ => BTreeMap::new(),
        };
        // A tenant's own proxy passes its clients' headers through: a client-sent x-sluice-cost
        // must not set the price of its own requests, so only a gateway's counts.
        let cost = match text(COST_HEADER)? {
            Some(c) if caller.is_trusted() => {
                c.parse::<u64>().ok().filter(|&c| c <= crate::engine::MAX_COST).ok_or_else(|| {
                    BadRequest(format!(
                        "header {COST_HEADER}: {c:?} is not an integer from 0 to {}",
                        crate::engine::MAX_COST
                    ))
                })?
            }
            _ => 1,
        };
        Ok(AuthzParts { namespace, labels, path, cost })
    }
}

fn json_response(
    status: StatusCode,
    decision: &CheckResponse,
    headers: Option<&[(std::borrow::Cow<'static, str>, String)]>,
) -> Response {
    // Sized for a few rules up front, instead of growing from serde_json's 128 bytes.
    let mut body = Vec::with_capacity(512 + 384 * decision.rules.len());
    if let Err(e) = serde_json::to_writer(&mut body, decision) {
        return error_response(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the decision: {e}"));
    }
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let map = response.headers_mut();
    map.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(headers) = headers {
        add_response_headers(map, headers);
    }
    response
}

async fn readyz<S: Store>(State(state): Shared<S>) -> Response {
    if !state.engine.is_loaded() {
        return (StatusCode::SERVICE_UNAVAILABLE, "no policy snapshot loaded yet\n").into_response();
    }
    // Only until the store first answers: later outages are the breaker's and onStoreFailure's,
    // never a reason to take every replica out of its Service at once.
    match state.engine.store_status().not_answered_yet {
        Some(reason) => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("the store has not answered since start: {reason}\n"))
                .into_response()
        }
        None => (StatusCode::OK, "ready\n").into_response(),
    }
}

async fn metrics<S: Store>(State(state): Shared<S>) -> Response {
    let engine = &state.engine;
    let status = engine.store_status();
    let metrics = engine.metrics();
    metrics.record_store_status(&status);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], engine.metrics().encode())
        .into_response()
}

/// The live snapshot as far as the caller may see it: a tenant gets its own namespaces' policies
/// and header names only, under the version a compile of exactly those would have.
/// `?wait=DURATION` of a snapshot request: none, or at most [`MAX_SNAPSHOT_WAIT`].
fn snapshot_wait(uri: &Uri) -> Result<Option<std::time::Duration>, BadRequest> {
    let Some(query) = uri.query() else { return Ok(None) };
    let mut wait = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("wait", text)) => {
                let duration =
                    crate::duration::parse_std_duration(text).map_err(|e| BadRequest(format!("wait: {e}")))?;
                if duration > MAX_SNAPSHOT_WAIT {
                    return Err(BadRequest(format!("wait: at most {}s", MAX_SNAPSHOT_WAIT.as_secs())));
                }
                wait = Some(duration);
            }
            _ => return Err(BadRequest(format!("unknown query parameter {pair:?} (only wait=DURATION)"))),
        }
    }
    Ok(wait)
}

/// The caller's part of the live snapshot. With `If-None-Match` naming the current version and
/// `?wait=DURATION`, the request is held until the part changes (then 200 at once) or the wait
/// ends (304): a sidecar learns of a policy change as soon as it is installed, without polling.
/// A reload error as `caller` may see it: its text names other tenants' files, policies and
/// regexes, so only callers of every namespace get it; a tenant learns that (and when) the last
/// reload failed.
fn reload_error_for(caller: &Caller, error: crate::engine::ReloadError) -> crate::engine::ReloadError {
    match caller.visible_namespaces() {
        None => error,
        Some(_) => crate::engine::ReloadError {
            at: error.at,
            message: "the last reload failed; the last good policies stay enforced (the endpoint's log and a gateway's /v1/snapshot have the details)".into(),
        },
    }
}

/// The store's status as `caller` may see it: evictions and breakers of its own namespaces only.
fn store_status_for(caller: &Caller, mut status: crate::store::StoreStatus) -> crate::store::StoreStatus {
    if let Some(visible) = caller.visible_namespaces() {
        let own = |namespace: &String| visible.iter().any(|v| v == namespace);
        status.evicted_keys_by_namespace.retain(|namespace, _| own(namespace));
        status.evicted_keys = status.evicted_keys_by_namespace.values().sum();
        status.breakers_by_namespace.retain(|namespace, _| own(namespace));
        status.redis_keys_by_namespace.retain(|namespace, _| own(namespace));
        // Counts over every namespace's leased keys: another tenant's traffic.
        status.quota_leases = None;
        if status.breaker.is_some() {
            status.breaker = Some(crate::store::tenants::overall_breaker(&status.breakers_by_namespace));
        }
    }
    status
}

async fn snapshot<S: Store>(State(state): Shared<S>, uri: Uri, request_headers: HeaderMap) -> Response {
    let engine = &state.engine;
    let caller = match state.auth.caller(&request_headers).await {
        Ok(caller) => caller,
        Err(error) => return auth_failure(engine.metrics(), error),
    };
    let wait = match snapshot_wait(&uri) {
        Ok(wait) => wait,
        Err(error) => return bad_request(engine.metrics(), error),
    };
    let if_none_match = request_headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok());
    let mut events = engine.snapshot_events();
    let deadline = wait.map(|wait| tokio::time::Instant::now() + wait);
    let (live, etag) = loop {
        events.borrow_and_update();
        let live = engine.live();
        let etag = format!("\"{}\"", live.snapshot.part(caller.visible_namespaces()).version());
        if if_none_match != Some(etag.as_str()) {
            break (live, etag);
        }
        // A stopping endpoint no longer pushes: its 304 does not say the wait was honoured, so
        // a sidecar goes back to asking every interval (elsewhere) instead of asking again at once.
        let unchanged = |held: bool| {
            let mut response = (StatusCode::NOT_MODIFIED, [(header::ETAG, etag.clone())]).into_response();
            if let Some(wait) = wait.filter(|_| held) {
                response.headers_mut().insert(SNAPSHOT_WAIT_HEADER, HeaderValue::from(wait.as_millis() as u64));
            }
            response
        };
        let Some(deadline) = deadline else { return unchanged(false) };
        if events.borrow().stopping {
            return unchanged(false);
        }
        tokio::select! {
            changed = events.changed() => {
                if changed.is_err() {
                    return unchanged(false);
                }
            }
            _ = tokio::time::sleep_until(deadline) => return unchanged(true),
        }
    };
    let part = live.snapshot.part(caller.visible_namespaces());
    let body = SnapshotBody {
        loaded: engine.is_loaded(),
        loaded_at_ms: live.loaded_at / 1000,
        view: SnapshotView::of(&part),
        sources: part.sources(),
        last_reload_error: engine.last_error().map(|error| reload_error_for(&caller, error)),
        store: store_status_for(&caller, engine.store_status()),
    };
    let mut response = ([(header::ETAG, etag)], axum::Json(body)).into_response();
    if let Some(wait) = wait {
        response.headers_mut().insert(SNAPSHOT_WAIT_HEADER, HeaderValue::from(wait.as_millis() as u64));
    }
    response
}

async fn not_found(uri: Uri) -> Response {
    error_response(StatusCode::NOT_FOUND, format!("no such endpoint: {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_view_shows_each_rule_as_written() {
        let policy: crate::policy::RateLimitPolicy = serde_yaml::from_str(
            r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  rules:
    - name: r
      match: {headers: [{name: X-Tenant, present: true}]}
      key: [{header: X-API-Key}, {clientIP: true}]
      algorithm: tokenBucket
      limit: {requests: 10, per: 1s, burst: 5}
      mode: shadow
      onStoreFailure: deny
"#,
        )
        .unwrap();
        let snapshot = crate::policy::compile(vec![policy]).snapshot;
        let v = serde_json::to_value(SnapshotView::of(&snapshot.part(None))).unwrap();
        assert_eq!(v["policies"][0], "ns/p");
        assert_eq!(v["headerNames"], serde_json::json!(["x-api-key", "x-tenant"]));
        let r = &v["rules"][0];
        assert_eq!(r["policy"], "ns/p");
        assert_eq!(r["rule"], "r");
        assert_eq!(r["algorithm"], "tokenBucket");
        assert_eq!(r["requests"], 10);
        assert_eq!(r["per"], "1s");
        assert_eq!(r["burst"], 5);
        assert_eq!(r["mode"], "shadow");
        assert_eq!(r["onStoreFailure"], "deny");
        assert_eq!(r["key"], "header x-api-key, clientIP");
    }
}
