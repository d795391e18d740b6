//! The HTTP API over the engine: `POST /v1/check`, its batch form `POST /v1/checks`,
//! `POST /v1/explain`, the Envoy ext_authz-compatible `/v1/authz/…`, health, readiness, metrics
//! and the live snapshot.
//!
//! The check, authz and snapshot APIs first establish the [`Caller`] (see [`super::auth`]):
//! 401 when no valid credential was presented, 403 when the caller asks about what it may not,
//! 503 when the credential cannot be verified right now. Health, readiness and metrics stay
//! open for probes and scrapers.

//! Each endpoint in its own file; [`error::ApiError`] is every way a request ends short of an
//! answer, counted and answered in one place ([`answer`]).

mod authz;
mod check;
mod deferred;
pub mod error;
mod leases;
mod settle;
mod snapshot;

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};

pub use self::authz::{COST_HEADER, DENY_STATUS_HEADER, LABELS_HEADER, NAMESPACE_HEADER};
use self::error::{ApiError, error_response};
use super::auth::Auth;
use crate::api::{MAX_BATCH_BODY_BYTES, MAX_BODY_BYTES};
use crate::engine::{CheckResponse, Engine};
use crate::store::Store;
use crate::telemetry::Metrics;

/// Checks of one `/v1/checks` batch decided at a time.
pub const BATCH_IN_FLIGHT: usize = 32;

/// What the handlers share.
pub struct ApiState<S> {
    pub engine: Arc<Engine<S>>,
    pub auth: Auth,
    /// X-Forwarded-For hops a gateway's ext_authz call carries that are its own (see
    /// [`crate::request::forwarded::gateway_client_ip`]).
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
        .route("/v1/check", post(check::check::<S>))
        .route("/v1/checks", post(check::checks::<S>).layer(DefaultBodyLimit::max(MAX_BATCH_BODY_BYTES)))
        .route("/v1/cancel", post(check::cancel::<S>))
        .route(
            "/v1/deferred",
            post(deferred::defer::<S>).layer(DefaultBodyLimit::max(crate::api::deferred::MAX_DEFER_BODY_BYTES)),
        )
        .route("/v1/deferred/claim", post(deferred::claim::<S>))
        .route("/v1/deferred/done", post(deferred::done::<S>))
        .route("/v1/deferred/status", post(deferred::status::<S>))
        .route("/v1/release", post(settle::settle::<S>))
        .route("/v1/settle", post(settle::settle::<S>))
        .route("/v1/leases", post(leases::leases::<S>))
        .route("/v1/explain", post(check::explain::<S>))
        .route("/v1/authz", any(authz::authz::<S>))
        .route("/v1/authz/", any(authz::authz::<S>))
        .route("/v1/authz/{*path}", any(authz::authz::<S>))
        .route("/v1/snapshot", get(snapshot::snapshot::<S>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz::<S>))
        .route("/metrics", get(metrics::<S>))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Arc::new(state))
}

type Shared<S> = State<Arc<ApiState<S>>>;

/// A handler's result as the response: an error is counted here, once, and answered by its
/// [`IntoResponse`].
fn answer(metrics: &Metrics, result: Result<Response, ApiError>) -> Response {
    result.unwrap_or_else(|error| {
        error.count(metrics);
        error.into_response()
    })
}

/// Reads a request body of at most `limit` bytes: only once the caller is verified, so a client
/// without a credential never gets the endpoint to buffer (or wait for) a body.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|error| {
        if error.into_inner().downcast_ref::<http_body_util::LengthLimitError>().is_some() {
            ApiError::TooLarge { limit }
        } else {
            ApiError::Unreadable
        }
    })
}

fn add_response_headers(map: &mut HeaderMap, headers: &[(std::borrow::Cow<'static, str>, String)]) {
    for (name, value) in headers {
        let name = match name {
            std::borrow::Cow::Borrowed(name) => {
                own_header_name(name).map_or_else(|| HeaderName::from_bytes(name.as_bytes()), Ok)
            }
            std::borrow::Cow::Owned(name) => HeaderName::from_bytes(name.as_bytes()),
        };
        if let (Ok(name), Ok(value)) = (name, HeaderValue::from_str(value)) {
            map.insert(name, value);
        }
    }
}

/// Sluice's own rate-limit headers, named once: `HeaderName::from_bytes` lowercases and copies a
/// name that is not one of HTTP's standard ones, on every response (the names in the JSON
/// answer keep their case: that is the wire contract).
fn own_header_name(name: &str) -> Option<HeaderName> {
    const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
    const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
    const LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
    const REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
    const RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
    Some(match name {
        "RateLimit" => RATELIMIT,
        "RateLimit-Policy" => RATELIMIT_POLICY,
        "X-RateLimit-Limit" => LIMIT,
        "X-RateLimit-Remaining" => REMAINING,
        "X-RateLimit-Reset" => RESET,
        "Retry-After" => header::RETRY_AFTER,
        _ => return None,
    })
}

/// A decision as the JSON answer, with `headers` (the rate-limit headers) on the response too.
fn json_response(
    status: StatusCode,
    decision: &CheckResponse,
    headers: Option<&[(std::borrow::Cow<'static, str>, String)]>,
) -> Result<Response, ApiError> {
    // Sized for a few rules up front.
    let mut body = Vec::with_capacity(512 + 384 * decision.rules.len());
    decision.write_json(&mut body);
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let map = response.headers_mut();
    map.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(headers) = headers {
        add_response_headers(map, headers);
    }
    Ok(response)
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
    engine.metrics().record_store_status(&engine.store_status());
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], engine.metrics().encode())
        .into_response()
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
    fn own_header_names_are_the_names_parsed() {
        for name in [
            "RateLimit",
            "RateLimit-Policy",
            "X-RateLimit-Limit",
            "X-RateLimit-Remaining",
            "X-RateLimit-Reset",
            "Retry-After",
        ] {
            assert_eq!(own_header_name(name), HeaderName::from_bytes(name.as_bytes()).ok(), "{name}");
        }
        assert_eq!(own_header_name("X-Custom"), None);
    }
}
