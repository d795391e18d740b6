//! `/v1/authz/…`: Envoy's ext_authz HTTP service (and nginx `auth_request`).

use std::collections::BTreeMap;
use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::Response;

use super::error::ApiError;
use super::{ApiState, Shared, add_response_headers, answer, json_response};
use crate::api::check::{BadRequest, check_path};
use crate::engine::{CheckResponse, Holds, MAX_COST};
use crate::policy::RequestView;
use crate::request::forwarded::gateway_client_ip;
use crate::request::headers::{HeaderLookup, check_used_headers};
use crate::request::host::request_host;
use crate::request::labels::parse_label_list;
use crate::server::auth::Caller;
use crate::store::Store;
use crate::telemetry::StatusLabels;

/// Request headers the ext_authz mode reads for what Envoy cannot put in the path.
pub const NAMESPACE_HEADER: &str = "x-sluice-namespace";
pub const LABELS_HEADER: &str = "x-sluice-labels";
pub const COST_HEADER: &str = "x-sluice-cost";
/// Opt-in status for a denial in the ext_authz mode. nginx `auth_request` turns any answer but
/// 2xx, 401 and 403 into a 500, so nginx asks for 403 and maps it back to 429 itself.
pub const DENY_STATUS_HEADER: &str = "x-sluice-deny-status";

/// The original method and path (after the `/v1/authz` prefix), Host and headers arrive as they
/// were; 200 admits, 429 with the rate-limit headers refuses.
///
/// Only a trusted caller (a gateway) may name the namespace (`x-sluice-namespace`), the cost
/// (`x-sluice-cost`) and the client (`x-envoy-external-address`, X-Forwarded-For). From a tenant
/// the namespace must be its own, the cost is 1 and the client is the connection's peer.
pub(super) async fn authz<S: Store>(State(state): Shared<S>, request: axum::extract::Request) -> Response {
    answer(state.engine.metrics(), authorize(&state, request).await)
}

async fn authorize<S: Store>(state: &ApiState<S>, request: axum::extract::Request) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let headers = request.headers();
    let deny_status = deny_status(headers)?;
    // Where a denial is 403 (nginx), 403 cannot also mean "not allowed".
    let forbidden_status =
        if deny_status == StatusCode::FORBIDDEN { StatusCode::UNAUTHORIZED } else { StatusCode::FORBIDDEN };
    let caller = state.auth.caller(headers).await?;
    let parts = AuthzParts::read(request.uri(), headers, &caller).map_err(|error| match error {
        AuthzError::Bad(error) => ApiError::Bad(error),
        AuthzError::Forbidden(error) => ApiError::Forbidden { error, status: forbidden_status },
    })?;
    let live = engine.live();
    check_used_headers(headers, live.snapshot.namespace_header_names(&parts.namespace))
        .map_err(|problem| ApiError::bad(problem.to_string()))?;
    // The URI is this call's own, not the original request's: only Host names the host.
    let host = request_host(headers, None).map_err(|problem| ApiError::bad(problem.to_string()))?;
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
        egress: None,
        max_wait: None,
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
    engine.metrics().responses.get_or_create(&StatusLabels { status: status.as_u16() }).inc();
    if declared && !decision.allowed {
        return Ok(declared_refusal(status, &decision));
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
    Forbidden(crate::server::auth::Forbidden),
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
            Some(c) if caller.is_trusted() => c.parse::<u64>().ok().filter(|&c| c <= MAX_COST).ok_or_else(|| {
                BadRequest(format!("header {COST_HEADER}: {c:?} is not an integer from 0 to {MAX_COST}"))
            })?,
            _ => 1,
        };
        Ok(AuthzParts { namespace, labels, path, cost })
    }
}
