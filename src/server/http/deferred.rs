//! The deferred-write API (`deferIfLimited`): `POST /v1/deferred` queues a limited write,
//! `/v1/deferred/claim` hands a workload's pod entries to deliver, `/v1/deferred/done` records a
//! delivery, `/v1/deferred/status` tells an entry's state to a request of its key. Every one
//! acts in the caller's verified namespace only, and finds rules and keys with the engine's one
//! reading of a request.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::{ApiState, Shared, answer, read_body};
use crate::api::MAX_BODY_BYTES;
use crate::api::check::CheckRequest;
use crate::api::deferred::{
    ClaimAnswer, ClaimBody, DeferAnswer, DeferBody, DeferredRequest, DoneAnswer, DoneBody, FullAnswer, MAX_CLAIM,
    MAX_DEFER_BODY_BYTES, StatusBody,
};
use crate::engine::deferred::{DeferError, DeferOutcome};
use crate::server::auth::Caller;
use crate::store::Store;
use crate::store::queue::Finished;

/// The longest path with query a deferred write may have.
const MAX_TARGET_BYTES: usize = 8 * 1024;
/// The longest idempotency value: it is part of a Redis key.
const MAX_IDEMPOTENCY_BYTES: usize = 256;
/// The most header bytes kept for a replay.
const MAX_HEADER_BYTES: usize = 16 * 1024;

async fn caller_and_body<S: Store, B: DeserializeOwned>(
    state: &ApiState<S>,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<(Caller, B), ApiError> {
    let caller = state.auth.caller(headers).await?;
    let body = read_body(body, limit).await?;
    let parsed = serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("deferred-write body: {e}")))?;
    Ok((caller, parsed))
}

fn check_of(value: &serde_json::Value) -> Result<CheckRequest, ApiError> {
    let text = serde_json::to_vec(value).map_err(|e| ApiError::bad(format!("check: {e}")))?;
    CheckRequest::from_json(&text).map_err(|e| ApiError::bad(format!("check: {e}")))
}

fn refused(error: DeferError) -> ApiError {
    match error {
        DeferError::NotDeferrable(_) => ApiError::bad(error.to_string()),
        DeferError::TooLarge { .. } => ApiError::TooLargeBecause(error.to_string()),
        DeferError::Unknown(_) => ApiError::NotFound(error.to_string()),
        DeferError::Store(error) => ApiError::Store {
            kind: error.kind(),
            message: format!("the deferred-write queue did not answer ({error}): nothing was queued or changed"),
        },
    }
}

pub(super) async fn defer<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), queue(&state, &headers, body).await)
}

async fn queue<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, body): (Caller, DeferBody) = caller_and_body(state, headers, body, MAX_DEFER_BODY_BYTES).await?;
    let check = check_of(&body.check)?;
    let view = check.view(&caller).map_err(ApiError::forbidden)?;
    if body.target.len() > MAX_TARGET_BYTES {
        return Err(ApiError::bad(format!("target: at most {MAX_TARGET_BYTES} bytes")));
    }
    if body.idempotency_key.as_ref().is_some_and(|k| k.len() > MAX_IDEMPOTENCY_BYTES) {
        return Err(ApiError::bad(format!("idempotencyKey: at most {MAX_IDEMPOTENCY_BYTES} bytes")));
    }
    if body.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() > MAX_HEADER_BYTES {
        return Err(ApiError::bad(format!("headers: at most {MAX_HEADER_BYTES} bytes in all")));
    }
    if body.target.split('?').next() != Some(check.path.as_str()) {
        return Err(ApiError::bad(format!("target: {:?} is not a target of check.path {:?}", body.target, check.path)));
    }
    let request = DeferredRequest {
        method: check.method.clone(),
        path: body.target,
        host: check.host.clone(),
        checked: check.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        replayed: body.headers,
        client_ip: check.client_ip.map(|ip| ip.to_string()),
        body: body.body,
    };
    match state.engine.defer(&view, request, body.idempotency_key.as_deref()).await.map_err(refused)? {
        DeferOutcome::Accepted { id, status_id, depth, duplicate } => {
            Ok((StatusCode::ACCEPTED, axum::Json(DeferAnswer { id, status_id, depth, duplicate })).into_response())
        }
        DeferOutcome::Full { scope, retry_after_ms } => {
            let error = format!("the {scope}'s queue of deferred writes is full");
            let mut response =
                (StatusCode::TOO_MANY_REQUESTS, axum::Json(FullAnswer { error, retry_after_ms })).into_response();
            if let Ok(value) = retry_after_ms.div_ceil(1000).to_string().parse() {
                response.headers_mut().insert(axum::http::header::RETRY_AFTER, value);
            }
            Ok(response)
        }
    }
}

pub(super) async fn claim<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), take(&state, &headers, body).await)
}

async fn take<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, body): (Caller, ClaimBody) = caller_and_body(state, headers, body, MAX_BODY_BYTES).await?;
    let namespace = caller.namespace_of(body.namespace.as_deref()).map_err(ApiError::forbidden)?;
    if body.consumer.is_empty() || body.consumer.len() > 253 || body.holding.len() > MAX_CLAIM as usize {
        return Err(ApiError::bad(format!("consumer: 1 to 253 characters, holding: at most {MAX_CLAIM} entries")));
    }
    let most = body.most.min(MAX_CLAIM);
    let claimed = state
        .engine
        .claim_deferred(namespace, &body.labels, &body.consumer, &body.holding, most)
        .await
        .map_err(|e| refused(DeferError::Store(e)))?;
    Ok(axum::Json(ClaimAnswer { entries: claimed.entries, kept: claimed.kept }).into_response())
}

pub(super) async fn done<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), finish(&state, &headers, body).await)
}

async fn finish<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, body): (Caller, DoneBody) = caller_and_body(state, headers, body, MAX_BODY_BYTES).await?;
    let namespace = caller.namespace_of(body.namespace.as_deref()).map_err(ApiError::forbidden)?;
    let finished = state
        .engine
        .finish_deferred(namespace, &body.consumer, &body.id, body.delivered, body.status)
        .await
        .map_err(refused)?;
    let result = match finished {
        Finished::Delivered => "delivered",
        Finished::Retrying => "retrying",
        Finished::DeadLettered => "deadLettered",
        Finished::Unknown => "unknown",
    };
    Ok(axum::Json(DoneAnswer { result: result.into() }).into_response())
}

pub(super) async fn status<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), read_status(&state, &headers, body).await)
}

async fn read_status<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, body): (Caller, StatusBody) = caller_and_body(state, headers, body, MAX_BODY_BYTES).await?;
    let check = check_of(&body.check)?;
    let view = check.view(&caller).map_err(ApiError::forbidden)?;
    let status = state.engine.deferred_status(&view, &body.id).await.map_err(refused)?;
    Ok(axum::Json(status).into_response())
}
