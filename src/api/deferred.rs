//! The bodies of the deferred-write API (`deferIfLimited`): `POST /v1/deferred` (queue a
//! limited write), `/v1/deferred/claim` (take entries to deliver), `/v1/deferred/done` (how a
//! delivery ended) and `/v1/deferred/status` (an entry's state, for a request of its key). The
//! sidecar writes them (`sidecar/deferral.rs`), the endpoint reads them (`server/http/deferred.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::store::queue::{ClaimedEntry, DeferredRequest, EntryStatus};

/// The most bytes a `POST /v1/deferred` body may have: the largest `maxBodyBytes` in base64,
/// with room for the head.
pub const MAX_DEFER_BODY_BYTES: usize = (1 << 20) * 4 / 3 + 64 * 1024;
/// The most entries one claim takes.
pub const MAX_CLAIM: u64 = 64;

/// `POST /v1/deferred`: a write a `deferIfLimited` rule refused, to queue.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeferBody {
    /// The write's check, as `POST /v1/check` takes it: it names the namespace, and the rule
    /// and key are found from it as the check found them.
    pub check: serde_json::Value,
    /// The path with its query, as the application is to get it; its path is `check.path`.
    pub target: String,
    /// The write's headers offered for the replay: only the rule's `deferIfLimited.headers` are
    /// kept.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// The body, base64.
    #[serde(default, with = "crate::store::queue::base64_bytes")]
    pub body: Vec<u8>,
    /// The rule's `idempotencyHeader` value, when the write sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
}

/// `202` to `POST /v1/deferred`: the entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeferAnswer {
    /// The entry (what the replay's `Sluice-Deferred-Id` says).
    pub id: String,
    /// What its status URL names: the id and a random token.
    pub status_id: String,
    /// Entries queued for the key, this one included.
    pub depth: u64,
    /// The idempotency value was seen: `id` is the first write's.
    #[serde(default)]
    pub duplicate: bool,
}

/// `429` to `POST /v1/deferred`: the queue is full.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FullAnswer {
    pub error: String,
    /// The time the key's queue needs to drain at the rule's rate.
    pub retry_after_ms: u64,
}

/// `POST /v1/deferred/claim`: a pod of a workload takes entries to deliver.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The workload's labels: the policies selecting it name the queues.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The pod: an entry it took is its own until it finishes it or stops holding it.
    pub consumer: String,
    /// Entries it took and still holds (waiting for the limit).
    #[serde(default)]
    pub holding: Vec<String>,
    /// At most this many new entries (at most [`MAX_CLAIM`]).
    pub most: u64,
}

/// The answer to a claim.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimAnswer {
    pub entries: Vec<ClaimedEntry>,
    /// Which of the entries it held are still its own; another consumer took the others.
    #[serde(default)]
    pub kept: Vec<String>,
}

/// `POST /v1/deferred/done`: how one delivery ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DoneBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Who delivered (as it claimed): only the entry's holder is heard.
    pub consumer: String,
    pub id: String,
    /// The application answered, with anything but a 5xx or 429.
    pub delivered: bool,
    /// Its status (0: it did not answer).
    #[serde(default)]
    pub status: u16,
}

/// The answer to a `done`: `delivered`, `retrying`, `deadLettered` or `unknown` (already
/// finished).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DoneAnswer {
    pub result: String,
}

/// `POST /v1/deferred/status`: an entry's state, asked by a request (`check`) of its key.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StatusBody {
    pub check: serde_json::Value,
    /// The status URL's id: the entry's and its token.
    pub id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_defer_body_round_trips_with_its_body_in_base64() {
        let body = DeferBody {
            check: serde_json::json!({"path": "/orders", "method": "POST"}),
            target: "/orders?x=1".into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: b"{\"q\":\x00\xff}".to_vec(),
            idempotency_key: Some("k1".into()),
        };
        let text = serde_json::to_string(&body).unwrap();
        assert!(text.contains("\"idempotencyKey\":\"k1\""), "{text}");
        let back: DeferBody = serde_json::from_str(&text).unwrap();
        assert_eq!((back.body, back.target, back.headers), (body.body, body.target, body.headers));
        let unknown = serde_json::from_str::<DeferBody>(r#"{"check": {}, "target": "/", "extra": 1}"#).unwrap_err();
        assert!(unknown.to_string().contains("unknown field `extra`"), "{unknown}");
    }
}
