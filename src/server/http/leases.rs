//! `POST /v1/leases`: quota slices for a holder elsewhere (a sidecar).

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{ApiState, Shared, answer, read_body};
use crate::api::check::BadRequest;
use crate::api::leases::{Grant, Granted, LeasesBody};
use crate::engine::{HolderLease, HolderLeaseError, MAX_COST};
use crate::store::Store;

/// Most lease operations in one `POST /v1/leases`, and the longest key.
const MAX_LEASE_OPS: usize = 64;
const MAX_LEASE_KEY_BYTES: usize = 1024;

/// A holder settles the quota leases it held and asks for new ones, for `consistency: leased`
/// rules of a namespace it may act in. 200 `{"grants": [{"amount", "lastsUs", "remaining",
/// "resetAfterUs", "holders"}, …]}` in order (amount 0: none), 400 naming what is wrong, 403 for
/// another namespace, 503 when the store did not answer.
pub(super) async fn leases<S: Store>(State(state): Shared<S>, headers: HeaderMap, body: Body) -> Response {
    answer(state.engine.metrics(), lease(&state, &headers, body).await)
}

async fn lease<S: Store>(state: &ApiState<S>, headers: &HeaderMap, body: Body) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let caller = state.auth.caller(headers).await?;
    let body = read_body(body, 256 * 1024).await?;
    let parsed = serde_json::from_slice::<LeasesBody>(&body).map_err(|error| {
        ApiError::bad(format!(
            "expected {{\"namespace\": \"…\", \"leases\": [{{\"rule\", \"key\", \"settle\", \"ask\"}}]}}: {error}"
        ))
    })?;
    if parsed.leases.len() > MAX_LEASE_OPS {
        return Err(ApiError::bad(format!("leases: at most {MAX_LEASE_OPS} per call")));
    }
    caller.namespace_of(Some(&parsed.namespace)).map_err(ApiError::forbidden)?;
    let asks =
        parsed.leases.iter().enumerate().map(|(i, entry)| holder_lease(i, entry)).collect::<Result<Vec<_>, _>>()?;
    let grants = engine.lease_for_holder(&parsed.namespace, &asks).await.map_err(|error| match error {
        HolderLeaseError::Refused(message) => ApiError::bad(message),
        HolderLeaseError::Store(error) => {
            ApiError::Store { kind: error.kind(), message: format!("the leases did not reach the store ({error})") }
        }
    })?;
    engine.metrics().responses_ok.inc();
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
    Ok((StatusCode::OK, axum::Json(Granted { grants })).into_response())
}

/// Entry `i` of the body, its ids parsed and its key and spending bounded.
fn holder_lease(i: usize, entry: &crate::api::leases::LeaseEntry) -> Result<HolderLease, BadRequest> {
    let id = |text: &str, field: String| -> Result<u64, BadRequest> {
        text.parse::<u64>().map_err(|_| BadRequest(format!("{field}: expected a decimal id, got {text:?}")))
    };
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
    Ok(HolderLease { rule: id(&entry.rule, format!("leases[{i}].rule"))?, key: entry.key.clone(), settle, ask })
}
