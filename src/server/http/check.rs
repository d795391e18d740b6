//! `POST /v1/check`, its batch form `POST /v1/checks`, and `POST /v1/explain`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{ApiState, BATCH_IN_FLIGHT, Shared, answer, json_response, read_body};
use crate::api::check::CheckRequest;
use crate::api::checks::{BatchBody, BatchResult, BatchResults, LeanDecision};
use crate::api::{MAX_BATCH_BODY_BYTES, MAX_BATCH_CHECKS, MAX_BODY_BYTES};
use crate::engine::Holds;
use crate::policy::RequestView;
use crate::server::auth::Caller;
use crate::store::Store;
use crate::telemetry::{ReasonLabels, StatusLabels};

/// The verified caller and its parsed check body: what `/v1/check` and `/v1/explain` both start
/// from.
async fn caller_and_request<S: Store>(
    state: &ApiState<S>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Caller, CheckRequest), ApiError> {
    let caller = state.auth.caller(headers).await?;
    let body = read_body(body, MAX_BODY_BYTES).await?;
    Ok((caller, CheckRequest::from_json(&body)?))
}

pub(super) async fn check<S: Store>(State(state): Shared<S>, request: Request) -> Response {
    // The whole request rather than a `HeaderMap` extractor, which clones the headers.
    let (parts, body) = request.into_parts();
    answer(state.engine.metrics(), decide(&state, &parts.headers, body).await)
}

async fn decide<S: Store>(state: &Arc<ApiState<S>>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, request) = caller_and_request(state, headers, body).await?;
    if request.slot.is_some() {
        return Err(ApiError::bad("slot: only POST /v1/cancel takes a slot back"));
    }
    let view = request.view(&caller).map_err(ApiError::forbidden)?;
    let mut decision = state.engine.check(&view, Holds::Returned).await;
    if let Some(error) = unoffered(&request, &decision) {
        return Err(ApiError::bad(error));
    }
    if request.wait
        && let Some(slot) = decision.slot.take()
    {
        // The wait form: answer when the slot is due. A caller that goes away first drops this
        // future, and the guard gives its slot back.
        let guard = AbandonedWait { state: state.clone(), caller, request, slot: Some(slot) };
        tokio::time::sleep(std::time::Duration::from_millis(decision.delay_ms)).await;
        guard.departed();
        decision.delay_ms = 0;
    }
    state.engine.metrics().responses_ok.inc();
    json_response(StatusCode::OK, &decision, None)
}

/// An egress check no entry answered: the caller named a `spec.egress` entry no policy
/// selecting its workload offers. Refused, never admitted with no rule.
fn unoffered(request: &CheckRequest, decision: &crate::engine::CheckResponse) -> Option<String> {
    let name = request.egress.as_deref()?;
    decision
        .rules
        .is_empty()
        .then(|| format!("egress: no policy selecting this workload offers a spec.egress entry named {name:?}"))
}

/// A wait under way at the endpoint (`"wait": true`): dropped before [`Self::departed`], its
/// caller left, and the slot goes back ([`crate::engine::Engine::cancel`]) in a task of its own.
struct AbandonedWait<S: Store> {
    state: Arc<ApiState<S>>,
    caller: Caller,
    request: CheckRequest,
    slot: Option<String>,
}

impl<S: Store> AbandonedWait<S> {
    fn departed(mut self) {
        self.slot = None;
    }
}

impl<S: Store> Drop for AbandonedWait<S> {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else { return };
        let (state, caller, request) = (self.state.clone(), self.caller.clone(), self.request.clone());
        tokio::spawn(async move {
            let Some(slots) = crate::engine::parse_slot(&slot) else { return };
            if let Ok(view) = request.view(&caller)
                && let Err(error) = state.engine.cancel(&view, &slots).await
            {
                tracing::debug!(%error, "an abandoned wait's slot was not given back");
            }
        });
    }
}

/// `POST /v1/cancel`: the check's body with the `slot` its answer carried; gives back the slots
/// of an admission with a wait whose caller will not depart (Go's `Reservation.Cancel()`). Only
/// the last slot of a key goes back, before it is due; the answer says how many did.
pub(super) async fn cancel<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), cancel_slots(&state, &headers, body).await)
}

async fn cancel_slots<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, request) = caller_and_request(state, headers, body).await?;
    let Some(slots) = request.slot.as_deref().and_then(crate::engine::parse_slot) else {
        return Err(ApiError::bad("slot: required (the check answer's slot)"));
    };
    let view = request.view(&caller).map_err(ApiError::forbidden)?;
    let given = state.engine.cancel(&view, &slots).await.map_err(|error| ApiError::Store {
        kind: error.kind(),
        message: format!("the cancel did not reach the store ({error}); the slot stays taken"),
    })?;
    state.engine.metrics().responses_ok.inc();
    Ok((StatusCode::OK, axum::Json(serde_json::json!({ "givenBack": given }))).into_response())
}

/// Many checks in one call, for a proxy that has several requests waiting (the sidecar under
/// load): one HTTP exchange instead of one per request. Each check is parsed, authorized and
/// decided exactly as `POST /v1/check` would, concurrently, and answered in order; one bad check
/// is refused on its own (`{"status": 400, "error": …}`) without failing the others. The
/// caller's credential covers the whole batch.
pub(super) async fn checks<S: Store>(State(state): Shared<S>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    answer(state.engine.metrics(), decide_batch(&state, &parts.headers, body).await)
}

async fn decide_batch<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let metrics = engine.metrics();
    let caller = state.auth.caller(headers).await?;
    let body = read_body(body, MAX_BATCH_BODY_BYTES).await?;
    let batch: BatchBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad(format!("expected {{\"requests\": [check, …]}}: {e}")))?;
    if batch.requests.len() > MAX_BATCH_CHECKS {
        return Err(ApiError::bad(format!(
            "requests: {} checks, at most {MAX_BATCH_CHECKS} per batch",
            batch.requests.len()
        )));
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
            Ok(view) => match decisions.next() {
                Some(decision) if decision.rules.is_empty() && view.egress.is_some() => {
                    metrics.responses.get_or_create(&StatusLabels { status: 400 }).inc();
                    BatchResult::Refused {
                        status: 400,
                        error: "egress: no policy selecting this workload offers that spec.egress entry".into(),
                    }
                }
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
                        slot: decision.slot.as_deref(),
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
    BatchResults { results: &results }.write_json(&mut body);
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(response)
}

/// Why each rule of the caller's namespace applies or not, with the decision a check would make
/// now; the same body and caller rules as `/v1/check`, and it consumes nothing.
pub(super) async fn explain<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), explain_request(&state, &headers, body).await)
}

async fn explain_request<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (caller, request) = caller_and_request(state, headers, body).await?;
    let view = request.view(&caller).map_err(ApiError::forbidden)?;
    let live = state.engine.live();
    let explanation = live.snapshot.explain(&view, state.engine.fallback_replicas());
    // A store that cannot read without consuming (Redis) leaves the decision unknown.
    let verdict = state.engine.store().peek_for(view.namespace, None, &explanation.checks()).await.ok().flatten();
    Ok(axum::Json(explanation.report(verdict.as_ref())).into_response())
}
