//! Queues of deferred writes (`deferIfLimited`): what a store keeps of a write it accepted in
//! place of a refusal, and the operations of its queue. Only a store that can keep them durably
//! has queues (Redis: lua/deferred.lua); the others refuse ([`Store::defer_for`](super::Store)).

use crate::rule::RuleId;

/// A write as kept for its replay: what the application will get, and what the replay's check
/// needs to find the same rules and key as the original.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeferredRequest {
    pub method: String,
    /// With the query.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The headers the original check carried (the ones rules read).
    #[serde(default)]
    pub checked: Vec<(String, String)>,
    /// The headers the rule keeps for the application (`deferIfLimited.headers`).
    #[serde(default)]
    pub replayed: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<String>,
    /// Base64 on the wire.
    #[serde(default, with = "base64_bytes")]
    pub body: Vec<u8>,
}

/// A write to queue under `rule` for `key`, within its bounds.
#[derive(Clone, Copy, Debug)]
pub struct Deferral<'a> {
    pub rule: RuleId,
    pub key: &'a [u8],
    /// The idempotency header's value, if the rule has one and the request sent it.
    pub idempotency: Option<&'a str>,
    pub max_queued: u64,
    pub max_queued_bytes: u64,
    pub request: &'a DeferredRequest,
    /// What the status URL must carry besides the id (random, from the caller).
    pub token: &'a str,
}

/// The most entries and bytes one namespace may have queued over all its rules: a tenant's
/// writes cannot fill the shared Redis whatever its policies say.
pub const NAMESPACE_MAX_ENTRIES: u64 = 100_000;
pub const NAMESPACE_MAX_BYTES: u64 = 256 << 20;

/// What became of a write offered to a queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Queued {
    /// Accepted as entry `id` with its status `token`; the key now has `depth` entries queued.
    Accepted { id: String, depth: u64, token: String },
    /// The idempotency value was seen: the entry it made, and its token.
    Duplicate { id: String, depth: u64, token: String },
    /// The key's queue (`scope` "key") or the namespace's (`scope` "namespace") is full; the key
    /// has `depth` entries.
    Full { scope: &'static str, depth: u64 },
}

/// A consumer taking entries of a rule's queue to deliver.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    pub rule: RuleId,
    /// Who delivers (a pod): an entry it took stays its own while it holds it.
    pub consumer: &'a str,
    /// Entries it still holds (waiting for the limit): not handed to another consumer.
    pub holding: &'a [String],
    pub most: u64,
    pub max_attempts: u32,
    /// µs: how long a taken entry is its holder's before another may take it, and the first
    /// backoff after a failed delivery.
    pub retry_interval: u64,
    /// µs: how long an ended entry's status is kept.
    pub keep_status: u64,
}

/// An entry handed to a consumer.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedEntry {
    pub id: String,
    /// This delivery's number, from 1.
    pub attempt: u32,
    pub request: DeferredRequest,
    /// When it was accepted (ms since the epoch).
    pub accepted_ms: u64,
}

/// What a claim hands out: new entries, and which of the entries the consumer held are still
/// its own (another consumer takes one left idle for a retry interval).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    pub entries: Vec<ClaimedEntry>,
    pub kept: Vec<String>,
}

/// How one delivery ended.
#[derive(Clone, Copy, Debug)]
pub struct Finish<'a> {
    pub rule: RuleId,
    pub id: &'a str,
    /// The application answered (anything but 5xx, 429 or no answer).
    pub delivered: bool,
    /// The application's status, 0 when it did not answer.
    pub status: u16,
    pub max_attempts: u32,
    pub retry_interval: u64,
    pub keep_status: u64,
    /// Who delivered: only the entry's holder is heard.
    pub consumer: &'a str,
}

/// What a finished delivery did to its entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// No such queued entry (already ended, or unknown).
    Unknown,
    Delivered,
    DeadLettered,
    /// To be tried again after its backoff.
    Retrying,
}

/// An entry's state, as its status URL tells it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryStatus {
    /// `queued`, `delivered` or `deadLettered`.
    pub state: String,
    /// The application's last status (0: none yet).
    pub status: u16,
    pub attempts: u32,
    pub accepted_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
    /// The rule's key the entry was queued under: only a request of the same key may read it.
    #[serde(skip)]
    pub key: Vec<u8>,
    #[serde(skip)]
    pub method: String,
    #[serde(skip)]
    pub path: String,
}

/// A queue's state, as read now.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStats {
    /// Entries not yet delivered nor dead-lettered.
    pub queued: u64,
    /// Of those, the ones a consumer holds (delivering, or waiting for the limit).
    pub held: u64,
    /// When the oldest was accepted (ms since the epoch); `None` when empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oldest_accepted_ms: Option<u64>,
    pub dead_letters: u64,
}

/// One rule's queue in `/v1/snapshot`'s `store.deferredQueues`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    /// `namespace/name`.
    pub policy: String,
    pub rule: String,
    #[serde(flatten)]
    pub stats: QueueStats,
    /// Why it could not be read, when it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The wire form of an entry's id: the rule's id and the stream's id, so an id names its queue.
pub fn entry_id(rule: RuleId, stream_id: &str) -> String {
    format!("{rule:016x}-{stream_id}")
}

/// The id a status URL names: the entry's id and its token, so holding the URL is needed
/// besides being of the write's key.
pub fn status_id(entry_id: &str, token: &str) -> String {
    format!("{entry_id}.{token}")
}

/// [`status_id`] read back: the entry's rule, stream id and token.
pub fn parse_status_id(text: &str) -> Option<(RuleId, &str, &str)> {
    let (id, token) = text.split_once('.')?;
    if token.is_empty() || token.len() > 64 || !token.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (rule, stream) = parse_entry_id(id)?;
    Some((rule, stream, token))
}

/// A new status token: 128 random bits in hex.
pub fn new_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// [`entry_id`] read back: `None` for anything else (a stream id is `<ms>-<seq>`).
pub fn parse_entry_id(text: &str) -> Option<(RuleId, &str)> {
    let (rule, stream) = text.split_once('-')?;
    let (ms, seq) = stream.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    if rule.len() != 16 || !digits(ms) || !digits(seq) {
        return None;
    }
    Some((RuleId::from_str_radix(rule, 16).ok()?, stream))
}

pub(crate) mod base64_bytes {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;

    pub fn serialize<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text: std::borrow::Cow<'de, str> = serde::Deserialize::deserialize(d)?;
        STANDARD.decode(text.as_bytes()).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ids_name_their_rule_and_read_back() {
        let id = entry_id(0xabc, "1700000000000-3");
        assert_eq!(id, "0000000000000abc-1700000000000-3");
        assert_eq!(parse_entry_id(&id), Some((0xabc, "1700000000000-3")));
        for bad in ["", "abc-1-2", "0000000000000abc-1", "0000000000000abc-1-x", "000000000000zabc-1-2"] {
            assert_eq!(parse_entry_id(bad), None, "{bad}");
        }
        let status = status_id(&id, "00ff");
        assert_eq!(parse_status_id(&status), Some((0xabc, "1700000000000-3", "00ff")));
        for bad in [id.as_str(), "0000000000000abc-1-2.", "0000000000000abc-1-2.xyz", "x.00ff"] {
            assert_eq!(parse_status_id(bad), None, "{bad}");
        }
        assert_eq!(new_token().len(), 32);
        assert_ne!(new_token(), new_token());
    }
}
