//! Deferred writes at the sidecar (`deferIfLimited`): a limited write is handed to the
//! endpoint's queue and answered `202 Accepted` with its status URL; the status URL is answered
//! for requests of the write's key; and a loop takes this workload's queued writes and replays
//! them to the application, each checked like a live request first, so replays and live traffic
//! together stay within the limits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, LOCATION, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::watch;

use super::decide::Decider;
use super::metrics::SidecarMetrics;
use super::verdict::Decision;
use crate::api::check::CheckInput;
use crate::api::deferred::{
    ClaimAnswer, ClaimBody, ClaimedEntry, DeferAnswer, DeferBody, DoneBody, FullAnswer, StatusBody,
};

/// Where the sidecar answers an entry's status: `<prefix><id>`, on the application's own host.
pub const STATUS_PREFIX: &str = "/.well-known/sluice/deferred/";
/// Set on every replay: the entry's id. The sidecar removes it from live requests, so the
/// application can trust it (a replay's original credentials are not replayed).
pub const DEFERRED_ID_HEADER: HeaderName = HeaderName::from_static("sluice-deferred-id");
/// Set on every replay: which delivery this is, from 1 (at least once: more than 1 may repeat a
/// write the application already took).
pub const ATTEMPT_HEADER: HeaderName = HeaderName::from_static("sluice-deferred-attempt");
/// The most entries the loop holds at once (waiting for their keys' limits).
const MOST_HELD: usize = 32;
/// The most it takes in one claim.
const MOST_TAKEN: usize = 8;
/// The longest a replay waits for the application's answer; then it is tried again later.
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// What became of one held entry this round.
enum Delivery {
    /// Refused by a limit: checked again after this.
    Limited(Duration),
    /// Another consumer holds it now.
    Lost,
    /// Delivered, or failed and left to its retry.
    Done,
}
/// How often the loop asks for entries when it has none.
const POLL: Duration = Duration::from_millis(250);

/// What became of a limited write offered to the queue.
pub enum Offered {
    /// Queued: answer `202` with this body and status URL.
    Accepted(DeferAnswer),
    /// The queue is full: refuse, with `Retry-After` its drain time.
    Full { retry_after_secs: u64 },
    /// Too large to queue.
    TooLarge(usize),
    /// The queue could not take it (no Redis, the endpoint away): the refusal stands.
    Failed,
}

pub struct Deferral {
    decider: Arc<Decider>,
    metrics: Arc<SidecarMetrics>,
    uris: [Uri; 4],
    /// This process, as the queues' consumer.
    consumer: String,
    upstream: http::uri::Authority,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Deliveries whose end the queue could not be told yet (the endpoint or Redis away).
    unfinished: parking_lot::Mutex<Vec<DoneBody>>,
}

impl Deferral {
    /// `uris`: the endpoint's `/v1/deferred`, `…/claim`, `…/done` and `…/status`.
    pub fn new(
        decider: Arc<Decider>,
        metrics: Arc<SidecarMetrics>,
        uris: [Uri; 4],
        upstream: http::uri::Authority,
    ) -> Arc<Deferral> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let consumer = format!("{}-{:08x}", host.trim(), rand::random::<u32>());
        let client = Client::builder(TokioExecutor::new()).build_http();
        Arc::new(Deferral { decider, metrics, uris, consumer, upstream, client, unfinished: Default::default() })
    }

    /// Offers a limited write (`check`: its check, as sent) to the queue: its body read up to
    /// `max_body_bytes`, the headers
    /// `kept` and the idempotency header's value taken from `headers`.
    pub async fn offer<B>(
        &self,
        check: serde_json::Value,
        target: &str,
        headers: &HeaderMap,
        body: B,
        terms: &crate::policy::Defer,
    ) -> Offered
    where
        B: hyper::body::Body<Data = Bytes> + Send,
        B::Error: std::error::Error + Send + Sync + 'static,
    {
        let body = match Limited::new(body, terms.max_body_bytes).collect().await {
            Ok(body) => body.to_bytes(),
            Err(error) if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                return Offered::TooLarge(terms.max_body_bytes);
            }
            Err(_) => return Offered::Failed,
        };
        let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        let kept = terms.headers.iter().filter_map(|name| Some((name.clone(), value(name)?))).collect();
        let idempotency_key = terms.idempotency_header.as_deref().and_then(value);
        let request =
            DeferBody { check, target: target.to_string(), headers: kept, body: body.to_vec(), idempotency_key };
        let Ok(body) = serde_json::to_vec(&request) else { return Offered::Failed };
        let offered = match self.decider.endpoint().post(&self.uris[0], Bytes::from(body)).await {
            Ok((StatusCode::ACCEPTED, answer)) => {
                serde_json::from_slice::<DeferAnswer>(&answer).map_or(Offered::Failed, Offered::Accepted)
            }
            Ok((StatusCode::TOO_MANY_REQUESTS, answer)) => match serde_json::from_slice::<FullAnswer>(&answer) {
                Ok(full) => Offered::Full { retry_after_secs: full.retry_after_ms.div_ceil(1000).max(1) },
                Err(_) => Offered::Failed,
            },
            Ok((status, answer)) => {
                tracing::warn!(%status, answer = %String::from_utf8_lossy(&answer), "the endpoint did not queue a deferred write");
                Offered::Failed
            }
            Err(error) => {
                tracing::warn!(%error, "the endpoint did not queue a deferred write");
                Offered::Failed
            }
        };
        self.metrics.deferred(match &offered {
            Offered::Accepted(_) => "accepted",
            Offered::Full { .. } => "full",
            Offered::TooLarge(_) => "too_large",
            Offered::Failed => "failed",
        });
        offered
    }

    /// The status of entry `id` for `input`, a request of the same key: the endpoint's answer
    /// (200 with the state, 404 for anything else), or 503 when it cannot be asked.
    pub async fn status(&self, input: &CheckInput<'_>, id: &str) -> (StatusCode, Bytes) {
        let Ok(check) = serde_json::to_value(input) else {
            return (StatusCode::BAD_REQUEST, Bytes::new());
        };
        let Ok(body) = serde_json::to_vec(&StatusBody { check, id: id.to_string() }) else {
            return (StatusCode::BAD_REQUEST, Bytes::new());
        };
        match self.decider.endpoint().post(&self.uris[3], Bytes::from(body)).await {
            Ok((status, answer)) if status == StatusCode::OK || status == StatusCode::NOT_FOUND => (status, answer),
            Ok((status, _)) => {
                tracing::warn!(%status, "the endpoint did not tell a deferred write's status");
                (StatusCode::SERVICE_UNAVAILABLE, Bytes::new())
            }
            Err(error) => {
                tracing::warn!(%error, "the endpoint did not tell a deferred write's status");
                (StatusCode::SERVICE_UNAVAILABLE, Bytes::new())
            }
        }
    }

    /// Takes this workload's queued writes and replays them, until `stop`.
    pub async fn replay(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut held: Vec<ClaimedEntry> = Vec::new();
        loop {
            // Deliveries whose end the queue has not heard of go first: told late, an entry is
            // not delivered again; not told at all, it is after its retry interval.
            let told = self.tell_unfinished().await;
            if *stop.borrow() {
                return;
            }
            let mut pause = POLL;
            if told && self.decider.snapshots.delivers(&self.decider.namespace, &self.decider.labels) {
                let most = MOST_HELD.saturating_sub(held.len()).min(MOST_TAKEN);
                match self.claim(&held, most).await {
                    Ok(answer) => {
                        // One another consumer took (this one was too slow to keep it) is its now.
                        held.retain(|entry| answer.kept.contains(&entry.id));
                        held.extend(answer.entries);
                        pause = self.deliver_round(&mut held).await.map_or(Duration::ZERO, |wait| wait.min(POLL));
                    }
                    // What it holds cannot be kept now: nothing is delivered until it can.
                    Err(error) => tracing::debug!(%error, "no deferred writes taken"),
                }
            }
            if !pause.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }

    /// Tells the queue of the deliveries it has not heard of; whether it heard of all.
    async fn tell_unfinished(&self) -> bool {
        let unfinished = std::mem::take(&mut *self.unfinished.lock());
        let mut still = Vec::new();
        for done in unfinished {
            if !self.tell(&done).await {
                still.push(done);
            }
        }
        let told = still.is_empty();
        self.unfinished.lock().extend(still);
        told
    }

    /// One pass over the entries held: each is checked (one refusal a round per request shape:
    /// the entries behind it, of the same key, would be refused too, and asking costs the
    /// endpoint a check each) and, admitted, delivered. The delivered leave `held`. The wait
    /// until the next pass: `None` when something was delivered (at once), else the shortest
    /// the limits asked for.
    async fn deliver_round(&self, held: &mut Vec<ClaimedEntry>) -> Option<Duration> {
        let mut wait: Option<Duration> = Some(POLL);
        // Where in `waiting` each refused entry is: no copy of what it carries.
        let mut refused: Vec<usize> = Vec::new();
        let mut waiting: Vec<ClaimedEntry> = Vec::new();
        for entry in std::mem::take(held) {
            if refused.iter().any(|&i| same_check(&waiting[i].request, &entry.request)) {
                waiting.push(entry);
                continue;
            }
            match self.deliver(&entry).await {
                Delivery::Limited(after) => {
                    wait = wait.map(|w| w.min(after));
                    refused.push(waiting.len());
                    waiting.push(entry);
                }
                Delivery::Lost => {}
                Delivery::Done => wait = None,
            }
        }
        *held = waiting;
        wait
    }

    async fn claim(&self, held: &[ClaimedEntry], most: usize) -> Result<ClaimAnswer, String> {
        let body = ClaimBody {
            namespace: Some(self.decider.namespace.clone()),
            labels: self.decider.labels.clone(),
            consumer: self.consumer.clone(),
            holding: held.iter().map(|e| e.id.clone()).collect(),
            most: most as u64,
        };
        let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
        match self.decider.endpoint().post(&self.uris[1], Bytes::from(body)).await {
            Ok((StatusCode::OK, answer)) => serde_json::from_slice::<ClaimAnswer>(&answer).map_err(|e| e.to_string()),
            Ok((status, answer)) => Err(format!("{status}: {}", String::from_utf8_lossy(&answer))),
            Err(error) => Err(error.to_string()),
        }
    }

    /// Whether `entry` is still this consumer's, keeping it so (its idle time restarts).
    async fn keep(&self, entry: &ClaimedEntry) -> bool {
        self.claim(std::slice::from_ref(entry), 0).await.is_ok_and(|answer| answer.kept.contains(&entry.id))
    }

    /// Checks one entry like a live request and, admitted, replays it and says how it went.
    /// Only while the entry is this consumer's: it is confirmed before the check and kept during
    /// the send, so two consumers never deliver it at once.
    async fn deliver(&self, entry: &ClaimedEntry) -> Delivery {
        if !self.keep(entry).await {
            return Delivery::Lost;
        }
        let request = &entry.request;
        let headers: BTreeMap<String, String> = request.checked.iter().cloned().collect();
        let path = request.path.split('?').next().unwrap_or("/");
        let input = CheckInput {
            namespace: &self.decider.namespace,
            labels: &self.decider.labels,
            method: &request.method,
            path,
            host: request.host.as_deref(),
            client_ip: request.client_ip.as_deref().and_then(|ip| ip.parse().ok()).unwrap_or([127, 0, 0, 1].into()),
            headers,
            request_fields: BTreeMap::new(),
            egress: None,
            deadline_ms: None,
            slot: None,
        };
        match self.decider.decide(&input).await {
            Decision::Deny { retry_after_ms, .. } => {
                // Asked again when the limit says, but within a quarter of the shortest retry
                // interval (1 s), so the entry stays this consumer's.
                let wait = Duration::from_millis(retry_after_ms.unwrap_or(1000)).clamp(Duration::from_millis(1), POLL);
                return Delivery::Limited(wait);
            }
            Decision::Refuse(refusal) => {
                tracing::warn!(id = %entry.id, detail = %refusal.detail, "a deferred write cannot be checked as kept");
                self.finish(entry, false, refusal.status.as_u16()).await;
            }
            Decision::Allow { delay, lease, .. } => {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let sent = self.send_kept(entry).await;
                if let Some(lease) = lease {
                    // What the replay held under other rules (their concurrency slots) goes back.
                    self.decider.settle(lease, crate::engine::SettleCost::AsReserved).await;
                }
                let (delivered, status) = match sent {
                    Ok(status) => {
                        (!(status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS), status.as_u16())
                    }
                    Err(error) => {
                        tracing::warn!(id = %entry.id, %error, "a deferred write was not delivered");
                        (false, 0)
                    }
                };
                self.metrics.deferred(if delivered { "delivered" } else { "retried" });
                self.finish(entry, delivered, status).await;
            }
        }
        Delivery::Done
    }

    /// [`Self::send`], keeping the entry this consumer's while it lasts, for at most
    /// [`SEND_TIMEOUT`].
    async fn send_kept(&self, entry: &ClaimedEntry) -> Result<StatusCode, String> {
        let send = tokio::time::timeout(SEND_TIMEOUT, self.send(entry));
        tokio::pin!(send);
        let mut renew = tokio::time::interval_at(tokio::time::Instant::now() + POLL, POLL);
        loop {
            tokio::select! {
                sent = &mut send => {
                    return sent.unwrap_or_else(|_| Err(format!("no answer within {SEND_TIMEOUT:?}")));
                }
                _ = renew.tick() => {
                    self.keep(entry).await;
                }
            }
        }
    }

    async fn send(&self, entry: &ClaimedEntry) -> Result<StatusCode, String> {
        let request = &entry.request;
        let uri = Uri::builder()
            .scheme("http")
            .authority(self.upstream.clone())
            .path_and_query(request.path.as_str())
            .build()
            .map_err(|e| e.to_string())?;
        let method = Method::from_bytes(request.method.as_bytes()).map_err(|e| e.to_string())?;
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in &request.replayed {
            builder = builder.header(name.as_str(), value.as_str());
        }
        if let Some(host) = &request.host {
            builder = builder.header(HOST, host.as_str());
        }
        let builder =
            builder.header(DEFERRED_ID_HEADER, entry.id.as_str()).header(ATTEMPT_HEADER, entry.attempt.to_string());
        let request = builder.body(Full::new(Bytes::from(request.body.clone()))).map_err(|e| e.to_string())?;
        let response = self.client.request(request).await.map_err(|e| super::verdict::error_chain(&e))?;
        let status = response.status();
        // Read to the end so the connection is kept; the body itself is not kept.
        let _ = response.into_body().collect().await;
        Ok(status)
    }

    async fn finish(&self, entry: &ClaimedEntry, delivered: bool, status: u16) {
        let done = DoneBody {
            namespace: Some(self.decider.namespace.clone()),
            consumer: self.consumer.clone(),
            id: entry.id.clone(),
            delivered,
            status,
        };
        if !self.tell(&done).await {
            self.unfinished.lock().push(done);
        }
    }

    /// Tells the queue how a delivery ended; `false` when it could not be told (kept to tell
    /// again).
    async fn tell(&self, done: &DoneBody) -> bool {
        let Ok(body) = serde_json::to_vec(done) else { return true };
        match self.decider.endpoint().post(&self.uris[2], Bytes::from(body)).await {
            Ok((StatusCode::OK, _)) => true,
            Ok((status, answer)) => {
                tracing::warn!(id = %done.id, %status, answer = %String::from_utf8_lossy(&answer), "a delivery's end was not recorded yet");
                // A 4xx will not change by asking again: the entry is delivered again instead.
                !status.is_server_error()
            }
            Err(error) => {
                tracing::warn!(id = %done.id, %error, "a delivery's end was not recorded yet");
                false
            }
        }
    }
}

/// Whether two kept writes are checked alike (the same rules, the same keys).
fn same_check(a: &crate::api::deferred::DeferredRequest, b: &crate::api::deferred::DeferredRequest) -> bool {
    (&a.method, a.path.split('?').next(), &a.host, &a.checked, &a.client_ip)
        == (&b.method, b.path.split('?').next(), &b.host, &b.checked, &b.client_ip)
}

/// The `202 Accepted` answer to a deferred write.
pub fn accepted(answer: &DeferAnswer) -> (StatusCode, HeaderMap, Bytes) {
    let location = format!("{STATUS_PREFIX}{}", answer.status_id);
    let body = serde_json::json!({
        "id": answer.id,
        "status": location,
        "queued": answer.depth,
        "duplicate": answer.duplicate,
    });
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(value) = HeaderValue::from_str(&location) {
        headers.insert(LOCATION, value);
    }
    headers.insert(HeaderName::from_static("sluice-deferred"), HeaderValue::from_static("limited"));
    (StatusCode::ACCEPTED, headers, Bytes::from(body.to_string()))
}

/// `Retry-After` for a full queue.
pub fn retry_after(secs: u64) -> (HeaderName, HeaderValue) {
    (RETRY_AFTER, HeaderValue::from(secs))
}
