//! `GET /v1/snapshot`: the live snapshot as far as the caller may see it, pushed to a waiting
//! caller when it changes.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::{ApiState, Shared, answer};
use crate::api::check::BadRequest;
use crate::api::snapshot::{SnapshotBody, SnapshotView};
use crate::api::{MAX_SNAPSHOT_WAIT, SNAPSHOT_WAIT_HEADER};
use crate::engine::ReloadError;
use crate::server::auth::Caller;
use crate::store::{Store, StoreStatus};

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

/// A reload error as `caller` may see it: its text names other tenants' files, policies and
/// regexes, so only callers of every namespace get it; a tenant learns that (and when) the last
/// reload failed.
fn reload_error_for(caller: &Caller, error: ReloadError) -> ReloadError {
    match caller.visible_namespaces() {
        None => error,
        Some(_) => ReloadError {
            at: error.at,
            message: "the last reload failed; the last good policies stay enforced (the endpoint's log and a gateway's /v1/snapshot have the details)".into(),
        },
    }
}

/// The store's status as `caller` may see it: evictions and breakers of its own namespaces only.
fn store_status_for(caller: &Caller, mut status: StoreStatus) -> StoreStatus {
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

/// The caller's part of the live snapshot: a tenant gets its own namespaces' policies and header
/// names only, under the version a compile of exactly those would have. With `If-None-Match`
/// naming the current version and `?wait=DURATION`, the request is held until the part changes
/// (then 200 at once) or the wait ends (304): a sidecar learns of a policy change as soon as it
/// is installed, without polling.
pub(super) async fn snapshot<S: Store>(State(state): Shared<S>, uri: Uri, headers: HeaderMap) -> Response {
    answer(state.engine.metrics(), snapshot_part(&state, &uri, &headers).await)
}

async fn snapshot_part<S: Store>(state: &ApiState<S>, uri: &Uri, headers: &HeaderMap) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let caller = state.auth.caller(headers).await?;
    let wait = snapshot_wait(uri)?;
    let if_none_match = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok());
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
            Ok(response)
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
    Ok(response)
}
