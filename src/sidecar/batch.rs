//! Checks to the endpoint, batched under load ([`crate::store::batching`]): the requests that wait for a
//! decision while every exchange is busy go together in the next one (`POST /v1/checks`), so one
//! HTTP exchange — one write and one read on each side — decides many requests. An idle sidecar
//! sends each check at once, as a batch of one.
//!
//! An endpoint that predates `/v1/checks` (404 or 405 during a rolling upgrade) gets single
//! checks (`POST /v1/check`) for a while before the batch path is tried again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;

use super::endpoint::Endpoint;
use super::metrics::SidecarMetrics;
use super::verdict::{Decision, EndpointError};
use crate::api::checks::BatchAnswer;
use crate::store::batching::{Batcher, Exchange, Pending};
use crate::telemetry::KindLabels;

/// How long single checks are sent after an endpoint said it has no batch API.
const SINGLE_CHECKS_FOR: Duration = Duration::from_secs(30);

type Outcome = Result<Decision, EndpointError>;
/// A check waiting for an exchange: its JSON body, and where its decision goes.
type Waiting = Pending<Vec<u8>, Outcome>;

pub(super) struct Checks {
    batcher: Arc<Batcher<Exchanges>>,
    /// Off: every check on its own.
    batching: bool,
}

impl Checks {
    /// `max_in_flight` 0: no batches, every check on its own.
    pub fn new(
        endpoint: Arc<Endpoint>,
        max_in_flight: usize,
        timeout: Duration,
        metrics: Arc<SidecarMetrics>,
    ) -> Checks {
        let exchanges = Exchanges { endpoint, metrics, timeout, single_until: parking_lot::Mutex::new(None) };
        Checks { batcher: Arc::new(Batcher::new(exchanges, max_in_flight)), batching: max_in_flight > 0 }
    }

    /// The endpoint's decision on one check (its JSON body).
    pub async fn check(&self, body: Vec<u8>) -> Outcome {
        let exchanges = self.batcher.exchange();
        if !self.batching || exchanges.singly_for_now() {
            return exchanges.check_one(body).await;
        }
        self.batcher
            .submit(body)
            .await
            .unwrap_or_else(|| Err(EndpointError::Unreachable("the batch was dropped".into())))
    }
}

struct Exchanges {
    endpoint: Arc<Endpoint>,
    metrics: Arc<SidecarMetrics>,
    timeout: Duration,
    /// Until then the endpoint gets single checks (it answered that it has no batch API).
    single_until: parking_lot::Mutex<Option<Instant>>,
}

impl Exchange for Exchanges {
    type Request = Vec<u8>;
    type Answer = Outcome;
    /// Within what the endpoint accepts (`MAX_BATCH_CHECKS`, `MAX_BATCH_BODY_BYTES` in
    /// src/server/http/check.rs), with room for the envelope.
    const MAX_REQUESTS: usize = crate::api::MAX_BATCH_CHECKS;
    const MAX_WEIGHT: usize = crate::api::MAX_BATCH_BODY_BYTES - 64;

    /// The body and its separating comma.
    fn weight(body: &Vec<u8>) -> usize {
        body.len() + 1
    }

    async fn call(&self, batch: Vec<Waiting>) {
        self.send(batch).await
    }
}

impl Exchanges {
    fn singly_for_now(&self) -> bool {
        self.single_until.lock().is_some_and(|until| Instant::now() < until)
    }

    async fn check_one(&self, body: Vec<u8>) -> Outcome {
        self.metrics.endpoint_exchanges.get_or_create(&KindLabels { kind: "single" }).inc();
        self.endpoint.check_one(body).await
    }

    async fn send(&self, batch: Vec<Waiting>) {
        self.metrics.endpoint_exchanges.get_or_create(&KindLabels { kind: "batch" }).inc();
        self.metrics.batched_checks.inc_by(batch.len() as u64);
        let body = crate::api::checks::batch_body(batch.iter().map(|w| w.request.as_slice()));
        let answered = match tokio::time::timeout(
            self.timeout,
            self.endpoint.post(&self.endpoint.checks_uri, body.into()),
        )
        .await
        {
            Ok(answered) => answered,
            Err(_) => Err(EndpointError::Timeout(self.timeout)),
        };
        let (status, answer) = match answered {
            Ok(answered) => answered,
            Err(error) => return fail_all(batch, &error),
        };
        if status == StatusCode::NOT_FOUND || status == StatusCode::METHOD_NOT_ALLOWED {
            tracing::info!(%status, "the endpoint has no batch API (an older release?); sending single checks for a while");
            *self.single_until.lock() = Some(Instant::now() + SINGLE_CHECKS_FOR);
            return self.send_singly(batch).await;
        }
        if status == StatusCode::BAD_REQUEST || status == StatusCode::PAYLOAD_TOO_LARGE {
            // The batch as a whole was refused, which no one check caused: ask each on its own
            // so that each gets its own answer.
            return self.send_singly(batch).await;
        }
        if !status.is_success() {
            return fail_all(batch, &EndpointError::Status(status));
        }
        let results = match serde_json::from_slice::<BatchAnswer>(&answer) {
            Ok(answer) if answer.results.len() == batch.len() => answer.results,
            Ok(answer) => {
                let error = format!("{} results for {} checks", answer.results.len(), batch.len());
                return fail_all(batch, &EndpointError::Decode(error));
            }
            Err(e) => return fail_all(batch, &EndpointError::Decode(e.to_string())),
        };
        for (waiting, result) in batch.into_iter().zip(results) {
            waiting.answer(result.decision());
        }
    }

    async fn send_singly(&self, batch: Vec<Waiting>) {
        futures::future::join_all(batch.into_iter().map(|waiting| async move {
            // Within the deadline like the batch itself: an endpoint that accepts and never
            // answers must not hold this exchange (and its slot) for ever.
            let (body, replier) = waiting.into_parts();
            let answer = match tokio::time::timeout(self.timeout, self.check_one(body)).await {
                Ok(answer) => answer,
                Err(_) => Err(EndpointError::Timeout(self.timeout)),
            };
            replier.answer(answer);
        }))
        .await;
    }
}

fn fail_all(batch: Vec<Waiting>, error: &EndpointError) {
    for waiting in batch {
        waiting.answer(Err(error.clone()));
    }
}
