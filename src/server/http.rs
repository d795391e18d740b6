//! The HTTP API over the engine: `POST /v1/check`, the Envoy ext_authz-compatible `/v1/authz/…`,
//! health, readiness, metrics and the live snapshot.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use serde::Serialize;
use serde_json::json;

use super::engine::{CheckResponse, Engine};
use super::request::{BadRequest, CheckRequest};
use crate::store::Store;
use crate::telemetry::StatusLabels;

/// Check bodies are small; anything larger is refused with 413 before parsing.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Request headers the ext_authz mode reads for what Envoy cannot put in the path.
pub const NAMESPACE_HEADER: &str = "x-sluice-namespace";
pub const LABELS_HEADER: &str = "x-sluice-labels";
pub const COST_HEADER: &str = "x-sluice-cost";
/// Opt-in status for a denial in the ext_authz mode. nginx `auth_request` turns any answer but
/// 2xx, 401 and 403 into a 500, so nginx asks for 403 and maps it back to 429 itself.
pub const DENY_STATUS_HEADER: &str = "x-sluice-deny-status";

pub fn router<S: Store>(engine: Arc<Engine<S>>) -> Router {
    Router::new()
        .route("/v1/check", post(check::<S>))
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
        .with_state(engine)
}

fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({ "error": message.into() }))).into_response()
}

fn bad_request(engine_metrics: &crate::telemetry::Metrics, error: BadRequest) -> Response {
    engine_metrics.responses.get_or_create(&StatusLabels { status: 400 }).inc();
    error_response(StatusCode::BAD_REQUEST, error.0)
}

fn body_rejection(engine_metrics: &crate::telemetry::Metrics, rejection: BytesRejection) -> Response {
    let status = rejection.status();
    engine_metrics.responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!("request body larger than {MAX_BODY_BYTES} bytes")
    } else {
        format!("could not read the request body: {}", rejection.body_text())
    };
    error_response(status, message)
}

async fn check<S: Store>(State(engine): State<Arc<Engine<S>>>, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return body_rejection(engine.metrics(), rejection),
    };
    let request = match CheckRequest::from_json(&body) {
        Ok(request) => request,
        Err(error) => return bad_request(engine.metrics(), error),
    };
    let decision = engine.check(&request).await;
    engine.metrics().responses_ok.inc();
    json_response(StatusCode::OK, &decision, None)
}

/// Envoy's ext_authz HTTP service: the original method and path (after the `/v1/authz` prefix),
/// Host and headers arrive as they were; 200 admits, 429 with the rate-limit headers refuses.
async fn authz<S: Store>(State(engine): State<Arc<Engine<S>>>, request: axum::extract::Request) -> Response {
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let deny_status = match deny_status(request.headers()) {
        Ok(status) => status,
        Err(error) => return bad_request(engine.metrics(), error),
    };
    let request = match authz_request(request.method(), request.uri(), request.headers(), peer) {
        Ok(request) => request,
        Err(error) => return bad_request(engine.metrics(), error),
    };
    let decision = engine.check(&request).await;
    let status = if decision.allowed { StatusCode::OK } else { deny_status };
    engine.metrics().responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    json_response(status, &decision, Some(&decision.headers))
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

fn authz_request(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    peer: Option<SocketAddr>,
) -> Result<CheckRequest, BadRequest> {
    let full = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
    let path = full.strip_prefix("/v1/authz").unwrap_or(full);
    let path = if path.is_empty() || path.starts_with('?') { format!("/{path}") } else { path.to_string() };
    let text = |name: &str| -> Result<Option<String>, BadRequest> {
        match headers.get(name) {
            None => Ok(None),
            Some(value) => value
                .to_str()
                .map(|v| Some(v.to_string()))
                .map_err(|_| BadRequest(format!("header {name}: not visible ASCII"))),
        }
    };
    let mut labels = BTreeMap::new();
    if let Some(list) = text(LABELS_HEADER)? {
        for pair in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| BadRequest(format!("header {LABELS_HEADER}: expected key=value pairs, got {pair:?}")))?;
            labels.insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    let cost = match text(COST_HEADER)? {
        None => None,
        Some(c) => Some(
            c.trim()
                .parse::<u64>()
                .map_err(|_| BadRequest(format!("header {COST_HEADER}: {c:?} is not a non-negative integer")))?,
        ),
    };
    // Envoy puts the downstream address in x-envoy-external-address; otherwise the first
    // X-Forwarded-For hop; otherwise whoever connected.
    let client_ip = text("x-envoy-external-address")?
        .or(text("x-forwarded-for")?.and_then(|xff| xff.split(',').next().map(|s| s.trim().to_string())))
        .or(peer.map(|p| p.ip().to_string()));
    let mut forwarded = BTreeMap::new();
    for (name, value) in headers {
        if let Ok(value) = value.to_str() {
            forwarded.insert(name.as_str().to_string(), value.to_string());
        }
    }
    CheckRequest::from_parts(
        text(NAMESPACE_HEADER)?,
        labels,
        Some(method.as_str().to_string()),
        path,
        text("host")?,
        client_ip,
        forwarded,
        cost,
    )
}

fn json_response(
    status: StatusCode,
    decision: &CheckResponse,
    headers: Option<&Vec<(&'static str, String)>>,
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
    for (name, value) in headers.into_iter().flatten() {
        if let Ok(value) = HeaderValue::from_str(value) {
            map.insert(*name, value);
        }
    }
    response
}

async fn readyz<S: Store>(State(engine): State<Arc<Engine<S>>>) -> Response {
    if engine.is_loaded() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no policy snapshot loaded yet\n").into_response()
    }
}

async fn metrics<S: Store>(State(engine): State<Arc<Engine<S>>>) -> Response {
    let status = engine.store().status();
    let metrics = engine.metrics();
    metrics.store_circuit_open.set(i64::from(status.breaker == Some("open")));
    metrics.live_keys.set(status.live_keys as i64);
    metrics.evicted_keys.set(status.evicted_keys as i64);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], engine.metrics().encode())
        .into_response()
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SnapshotBody<'a> {
    // No `version` here: the flattened view carries it, and a second copy made the JSON object
    // repeat the key, which strict parsers (serde structs among them) refuse.
    loaded: bool,
    loaded_at_ms: u64,
    #[serde(flatten)]
    view: crate::policy::SnapshotView,
    /// The policies in force, as documents a sidecar can compile into the same snapshot.
    sources: &'a [crate::policy::RateLimitPolicy],
    last_reload_error: Option<super::engine::ReloadError>,
    store: crate::store::StoreStatus,
}

async fn snapshot<S: Store>(State(engine): State<Arc<Engine<S>>>, request_headers: HeaderMap) -> Response {
    let live = engine.live();
    let version = live.snapshot.version();
    let etag = format!("\"{version}\"");
    if request_headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) == Some(etag.as_str()) {
        return (StatusCode::NOT_MODIFIED, [(header::ETAG, etag)]).into_response();
    }
    let body = SnapshotBody {
        loaded: engine.is_loaded(),
        loaded_at_ms: live.loaded_at / 1000,
        view: live.snapshot.view(),
        sources: live.snapshot.sources(),
        last_reload_error: engine.last_error(),
        store: engine.store().status(),
    };
    ([(header::ETAG, etag)], axum::Json(body)).into_response()
}

async fn not_found(uri: Uri) -> Response {
    error_response(StatusCode::NOT_FOUND, format!("no such endpoint: {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error_response(StatusCode::METHOD_NOT_ALLOWED, format!("{method} is not allowed on {}", uri.path()))
}
