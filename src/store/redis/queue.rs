//! The queues of deferred writes on Redis: arguments and replies of lua/deferred.lua's
//! operations. Each runs through the namespace's breaker and lane, within the store's deadline,
//! like a decision: a tenant's queue work slows or fails that tenant alone.

use ::redis::Value;

use super::{DEFERRED_FUNCTION_NAME, DEFERRED_SCRIPT, RedisStore, value_kind};
use crate::algorithm::Micros;
use crate::rule::RuleId;
use crate::store::StoreError;
use crate::store::keys;
use crate::store::queue::{
    Claim, Claimed, ClaimedEntry, Deferral, DeferredRequest, EntryStatus, Finish, Finished, NAMESPACE_MAX_BYTES,
    NAMESPACE_MAX_ENTRIES, QueueStats, Queued,
};

fn now_arg(now: Option<Micros>) -> Vec<u8> {
    now.map_or_else(Vec::new, |n| n.to_string().into_bytes())
}

fn ms(micros: u64) -> Vec<u8> {
    micros.div_ceil(1000).max(1).to_string().into_bytes()
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(bytes) => Some(bytes.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

fn int(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

fn protocol(what: &str, value: &Value) -> StoreError {
    StoreError::Protocol(format!("deferred {what} answered {}", value_kind(value)))
}

/// Header pairs as kept in a stream field: JSON, which the store never reads.
fn encode_headers(headers: &[(String, String)]) -> Vec<u8> {
    serde_json::to_vec(headers).unwrap_or_default()
}

impl RedisStore {
    async fn deferred_call(&self, tag: &str, rule: RuleId, args: &[Vec<u8>]) -> Result<Value, StoreError> {
        let keys = keys::queue_keys(tag, rule);
        self.in_lane(tag, &DEFERRED_FUNCTION_NAME, &DEFERRED_SCRIPT, &keys, args).await
    }

    pub(super) async fn defer_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        deferral: &Deferral<'_>,
    ) -> Result<Queued, StoreError> {
        let request: &DeferredRequest = deferral.request;
        let args = vec![
            b"put".to_vec(),
            now_arg(now),
            deferral.key.to_vec(),
            deferral.idempotency.unwrap_or("").as_bytes().to_vec(),
            deferral.max_queued.to_string().into_bytes(),
            deferral.max_queued_bytes.to_string().into_bytes(),
            NAMESPACE_MAX_ENTRIES.to_string().into_bytes(),
            NAMESPACE_MAX_BYTES.to_string().into_bytes(),
            request.method.as_bytes().to_vec(),
            request.path.as_bytes().to_vec(),
            request.host.as_deref().unwrap_or("").as_bytes().to_vec(),
            encode_headers(&request.checked),
            encode_headers(&request.replayed),
            request.client_ip.as_deref().unwrap_or("").as_bytes().to_vec(),
            request.body.clone(),
            deferral.token.as_bytes().to_vec(),
        ];
        let reply = self.deferred_call(tag, deferral.rule, &args).await?;
        let Value::Array(items) = &reply else { return Err(protocol("put", &reply)) };
        let parsed = (|| {
            let depth = int(items.get(2)?)?;
            match int(items.first()?)? {
                1 => Some(Queued::Accepted { id: text(items.get(1)?)?, depth, token: text(items.get(3)?)? }),
                2 => Some(Queued::Duplicate { id: text(items.get(1)?)?, depth, token: text(items.get(3)?)? }),
                0 => {
                    let scope = if text(items.get(1)?)? == "namespace" { "namespace" } else { "key" };
                    Some(Queued::Full { scope, depth })
                }
                _ => None,
            }
        })();
        parsed.ok_or_else(|| protocol("put", &reply))
    }

    pub(super) async fn claim_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        claim: &Claim<'_>,
    ) -> Result<Claimed, StoreError> {
        let mut args = vec![
            b"claim".to_vec(),
            now_arg(now),
            claim.consumer.as_bytes().to_vec(),
            ms(claim.retry_interval),
            claim.most.to_string().into_bytes(),
            claim.max_attempts.to_string().into_bytes(),
            ms(claim.keep_status),
        ];
        args.extend(claim.holding.iter().map(|id| id.as_bytes().to_vec()));
        let reply = self.deferred_call(tag, claim.rule, &args).await?;
        let Value::Array(parts) = &reply else { return Err(protocol("claim", &reply)) };
        let [Value::Array(entries), Value::Array(kept)] = parts.as_slice() else {
            return Err(protocol("claim", &reply));
        };
        let entries = entries
            .iter()
            .map(|entry| parse_entry(entry).ok_or_else(|| protocol("claim", entry)))
            .collect::<Result<Vec<_>, _>>()?;
        let kept = kept.iter().filter_map(text).collect();
        Ok(Claimed { entries, kept })
    }

    pub(super) async fn finish_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        finish: &Finish<'_>,
    ) -> Result<Finished, StoreError> {
        let args = vec![
            b"done".to_vec(),
            now_arg(now),
            finish.id.as_bytes().to_vec(),
            if finish.delivered { b"delivered".to_vec() } else { b"failed".to_vec() },
            finish.status.to_string().into_bytes(),
            finish.max_attempts.to_string().into_bytes(),
            ms(finish.retry_interval),
            ms(finish.keep_status),
            finish.consumer.as_bytes().to_vec(),
        ];
        let reply = self.deferred_call(tag, finish.rule, &args).await?;
        match int(&reply) {
            Some(0) => Ok(Finished::Unknown),
            Some(1) => Ok(Finished::Delivered),
            Some(2) => Ok(Finished::DeadLettered),
            Some(3) => Ok(Finished::Retrying),
            _ => Err(protocol("done", &reply)),
        }
    }

    pub(super) async fn entry_status_tagged(
        &self,
        tag: &str,
        rule: RuleId,
        id: &str,
        token: &str,
    ) -> Result<Option<EntryStatus>, StoreError> {
        let args = vec![b"status".to_vec(), Vec::new(), id.as_bytes().to_vec(), token.as_bytes().to_vec()];
        let reply = self.deferred_call(tag, rule, &args).await?;
        let Value::Array(items) = &reply else { return Err(protocol("status", &reply)) };
        if items.is_empty() {
            return Ok(None);
        }
        let mut status = EntryStatus::default();
        for pair in items.chunks(2) {
            let [name, value] = pair else { return Err(protocol("status", &reply)) };
            match text(name).as_deref() {
                Some("state") => {
                    status.state = match text(value).as_deref() {
                        Some("dead") => "deadLettered".into(),
                        Some(state) => state.into(),
                        None => String::new(),
                    }
                }
                Some("code") => status.status = int(value).and_then(|n| u16::try_from(n).ok()).unwrap_or(0),
                Some("a") => status.attempts = int(value).and_then(|n| u32::try_from(n).ok()).unwrap_or(0),
                Some("accepted") => status.accepted_ms = int(value).unwrap_or(0),
                Some("ended") => status.ended_ms = int(value),
                Some("k") => status.key = bytes(value).unwrap_or_default(),
                Some("m") => status.method = text(value).unwrap_or_default(),
                Some("p") => status.path = text(value).unwrap_or_default(),
                _ => {}
            }
        }
        Ok(Some(status))
    }
}

impl RedisStore {
    pub(super) async fn queue_stats_tagged(&self, tag: &str, rule: RuleId) -> Result<QueueStats, StoreError> {
        let reply = self.deferred_call(tag, rule, &[b"stats".to_vec(), Vec::new()]).await?;
        let Value::Array(items) = &reply else { return Err(protocol("stats", &reply)) };
        let [queued, held, oldest, dead] = items.as_slice() else { return Err(protocol("stats", &reply)) };
        let oldest_accepted_ms = text(oldest).and_then(|id| id.split_once('-')?.0.parse().ok());
        Ok(QueueStats {
            queued: int(queued).unwrap_or(0),
            held: int(held).unwrap_or(0),
            oldest_accepted_ms,
            dead_letters: int(dead).unwrap_or(0),
        })
    }
}

/// `{id, attempts, field, value, …}` of a claim's reply.
fn parse_entry(entry: &Value) -> Option<ClaimedEntry> {
    let Value::Array(items) = entry else { return None };
    let id = text(items.first()?)?;
    let attempt = u32::try_from(int(items.get(1)?)?).ok()?;
    let mut request = DeferredRequest::default();
    let mut accepted_ms = 0;
    for pair in items.get(2..)?.chunks(2) {
        let [name, value] = pair else { return None };
        match text(name)?.as_str() {
            "m" => request.method = text(value)?,
            "p" => request.path = text(value)?,
            "h" => request.host = text(value).filter(|h| !h.is_empty()),
            "c" => request.checked = serde_json::from_slice(&bytes(value)?).ok()?,
            "f" => request.replayed = serde_json::from_slice(&bytes(value)?).ok()?,
            "ip" => request.client_ip = text(value).filter(|ip| !ip.is_empty()),
            "b" => request.body = bytes(value)?,
            "t" => accepted_ms = int(value)?,
            _ => {}
        }
    }
    Some(ClaimedEntry { id, attempt, request, accepted_ms })
}
