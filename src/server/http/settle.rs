//! `POST /v1/settle` (and its older name `/v1/release`): what an admitted request held, given
//! back or charged once it has ended.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ApiError;
use super::{ApiState, Shared, answer, read_body};
use crate::api::settle::SettleBody;
use crate::engine::MAX_COST;
use crate::store::Store;

/// Most rule names a settle names.
const MAX_SETTLE_COSTS: usize = 64;

/// Settles what an admitted request held once it has ended: concurrency slots are given back,
/// reservations charged their actual cost. 200 `{"settled": N}` with the holds found (0 when
/// settled before, or run out: retrying is safe and charges nothing twice), 400 for a token
/// this endpoint did not issue or a malformed cost, 403 for a lease of a namespace the caller
/// may not act in, 503 when the store did not answer (the holds then run out by themselves).
pub(super) async fn settle<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), settle_hold(&state, &headers, body).await)
}

async fn settle_hold<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let caller = state.auth.caller(headers).await?;
    let body = read_body(body, crate::engine::hold::MAX_TOKEN_LEN + 8 * 1024).await?;
    let parsed = serde_json::from_slice::<SettleBody>(&body)
        .map_err(|error| ApiError::bad(format!("expected {{\"lease\": \"…\"}} with cost, costs or failed: {error}")))?;
    let lease = engine.verify_hold(&parsed.lease).map_err(|error| ApiError::bad(error.to_string()))?;
    let too_large = parsed.cost.into_iter().chain(parsed.costs.values().copied()).any(|c| c > MAX_COST);
    if too_large || parsed.costs.len() > MAX_SETTLE_COSTS {
        return Err(ApiError::bad(format!("cost: at most {MAX_COST} each, for at most {MAX_SETTLE_COSTS} rules")));
    }
    let cost = parsed.settle_cost().map_err(ApiError::bad)?;
    caller.namespace_of(Some(&lease.namespace)).map_err(ApiError::forbidden)?;
    let found = engine.settle(&lease, &cost).await.map_err(|error| ApiError::Store {
        kind: error.kind(),
        message: format!(
            "the settle did not reach the store ({error}); the holds run out by themselves, and retrying is safe"
        ),
    })?;
    engine.metrics().responses_ok.inc();
    // `released` says whether this call found a hold to give back: a second release of the same
    // lease, or one whose hold ran out, frees nothing and must not say it did.
    Ok((StatusCode::OK, axum::Json(json!({ "settled": found, "released": found > 0 }))).into_response())
}
