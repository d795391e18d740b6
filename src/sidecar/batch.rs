//! Checks to the endpoint, batched under load: the requests that wait for a decision while every
//! exchange is busy go together in the next one (`POST /v1/checks`), so one HTTP exchange — one
//! write and one read on each side — decides many requests. An idle sidecar sends each check at
//! once, as a batch of one: batching adds no wait, it only fills the exchanges that load makes
//! wait anyway.
//!
//! An endpoint that predates `/v1/checks` (404 or 405 during a rolling upgrade) gets single
//! checks (`POST /v1/check`) for a while before the batch path is tried again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use serde::Deserialize;
use tokio::sync::oneshot;

use super::decide::{Decision, EndpointError};
use super::endpoint::{Answer, Endpoint};
use super::metrics::{KindLabels, SidecarMetrics};

/// Checks per batch, and the bytes of their bodies: within what the endpoint accepts
/// (`MAX_BATCH_CHECKS`, `MAX_BATCH_BODY_BYTES` in src/server/http.rs), with room for the envelope.
const MAX_BATCH_CHECKS: usize = crate::server::http::MAX_BATCH_CHECKS;
const MAX_BATCH_BYTES: usize = crate::server::http::MAX_BATCH_BODY_BYTES - 64;
/// How long single checks are sent after an endpoint said it has no batch API.
const SINGLE_CHECKS_FOR: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
struct BatchAnswer {
    results: Vec<Answer>,
}

type Reply = oneshot::Sender<Result<Decision, EndpointError>>;

/// A check waiting for an exchange: its JSON body, and where its decision goes.
struct Waiting {
    body: Vec<u8>,
    reply: Reply,
}

struct Queue {
    waiting: Vec<Waiting>,
    /// Exchanges under way; each one, when done, takes the next batch from `waiting`.
    in_flight: usize,
    /// Until then the endpoint gets single checks (it answered that it has no batch API).
    single_until: Option<Instant>,
}

pub(super) struct Batcher {
    endpoint: Arc<Endpoint>,
    metrics: Arc<SidecarMetrics>,
    max_in_flight: usize,
    timeout: Duration,
    queue: parking_lot::Mutex<Queue>,
}

impl Batcher {
    /// `max_in_flight` 0: no batches, every check on its own.
    pub fn new(
        endpoint: Arc<Endpoint>,
        max_in_flight: usize,
        timeout: Duration,
        metrics: Arc<SidecarMetrics>,
    ) -> Batcher {
        Batcher {
            endpoint,
            metrics,
            max_in_flight,
            timeout,
            queue: parking_lot::Mutex::new(Queue { waiting: Vec::new(), in_flight: 0, single_until: None }),
        }
    }

    /// The endpoint's decision on one check (its JSON body).
    pub async fn check(self: &Arc<Self>, body: Vec<u8>) -> Result<Decision, EndpointError> {
        if self.max_in_flight == 0 || self.queue.lock().single_until.is_some_and(|until| Instant::now() < until) {
            return self.check_one(body).await;
        }
        let (reply, answer) = oneshot::channel();
        let batch = {
            let mut queue = self.queue.lock();
            queue.waiting.push(Waiting { body, reply });
            if queue.in_flight < self.max_in_flight {
                queue.in_flight += 1;
                Some(take_batch(&mut queue.waiting))
            } else {
                None
            }
        };
        if let Some(batch) = batch {
            // Its own task: the exchange serves every check in it, so no one request's
            // cancellation (a client gone, its timeout) may drop it.
            tokio::spawn(self.clone().exchange(batch));
        }
        answer.await.unwrap_or_else(|_| Err(EndpointError::Unreachable("the batch was dropped".into())))
    }

    /// Sends `batch`, then every batch that gathered meanwhile, until none waits.
    async fn exchange(self: Arc<Self>, mut batch: Vec<Waiting>) {
        let slot = InFlight(&self.queue);
        loop {
            self.send(batch).await;
            let next = {
                let mut queue = self.queue.lock();
                let next = take_batch(&mut queue.waiting);
                if next.is_empty() {
                    // Under the lock that saw the queue empty: a check queued after this finds
                    // the slot free and starts an exchange itself.
                    queue.in_flight -= 1;
                    std::mem::forget(slot);
                    return;
                }
                next
            };
            batch = next;
        }
    }

    async fn check_one(&self, body: Vec<u8>) -> Result<Decision, EndpointError> {
        self.metrics.endpoint_exchanges.get_or_create(&KindLabels { kind: "single" }).inc();
        self.endpoint.check_one(body).await
    }

    async fn send(&self, batch: Vec<Waiting>) {
        self.metrics.endpoint_exchanges.get_or_create(&KindLabels { kind: "batch" }).inc();
        self.metrics.batched_checks.inc_by(batch.len() as u64);
        let mut body = Vec::with_capacity(16 + batch.iter().map(|w| w.body.len() + 1).sum::<usize>());
        body.extend_from_slice(b"{\"requests\":[");
        for (i, waiting) in batch.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(&waiting.body);
        }
        body.extend_from_slice(b"]}");
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
            self.queue.lock().single_until = Some(Instant::now() + SINGLE_CHECKS_FOR);
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
            // A receiver gone (its request timed out or was cancelled) needs no answer.
            let _ = waiting.reply.send(result.decision());
        }
    }

    async fn send_singly(&self, batch: Vec<Waiting>) {
        futures::future::join_all(batch.into_iter().map(|waiting| async move {
            // Within the deadline like the batch itself: an endpoint that accepts and never
            // answers must not hold this exchange (and its slot) for ever.
            let answer = match tokio::time::timeout(self.timeout, self.check_one(waiting.body)).await {
                Ok(answer) => answer,
                Err(_) => Err(EndpointError::Timeout(self.timeout)),
            };
            let _ = waiting.reply.send(answer);
        }))
        .await;
    }
}

/// Gives the exchange's slot back if its task ends abnormally (a panic), so that the batcher
/// cannot run out of exchanges; the normal end gives it back under the queue's lock itself.
struct InFlight<'a>(&'a parking_lot::Mutex<Queue>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
    }
}

/// The oldest waiting checks, as many as one batch may carry.
fn take_batch(waiting: &mut Vec<Waiting>) -> Vec<Waiting> {
    // One whose deadline passed while it waited was answered by its failure mode already: sending
    // it now would spend its limit for a request that is gone.
    waiting.retain(|w| !w.reply.is_closed());
    let mut count = 0;
    let mut bytes = 0;
    for w in waiting.iter() {
        if count == MAX_BATCH_CHECKS || (count > 0 && bytes + w.body.len() + 1 > MAX_BATCH_BYTES) {
            break;
        }
        count += 1;
        bytes += w.body.len() + 1;
    }
    if count == waiting.len() {
        return std::mem::take(waiting);
    }
    let rest = waiting.split_off(count);
    std::mem::replace(waiting, rest)
}

fn fail_all(batch: Vec<Waiting>, error: &EndpointError) {
    for waiting in batch {
        let _ = waiting.reply.send(Err(error.clone()));
    }
}
