//! Deferred writes (`deferIfLimited`) at the engine: which rule's queue a limited write goes to
//! and under which key, the bounds it is held to, who may take entries to deliver, and who may
//! read an entry's status. The store keeps the queues ([`crate::store::queue`]); the replays
//! themselves are checked like any request, so they draw on the same limits.

use crate::policy::{CompiledRule, Matched, RequestView};
use crate::rule::RuleId;
use crate::store::queue::QueueStatus;
use crate::store::queue::{
    Claim, Claimed, Deferral, DeferredRequest, EntryStatus, Finish, Finished, Queued, entry_id, new_token,
    parse_entry_id, parse_status_id, status_id,
};
use crate::store::{Store, StoreError};
use crate::telemetry::QueueLabels;

use super::Engine;

/// How often endpoints read the queues of `deferIfLimited` rules for `/v1/snapshot` and metrics.
pub const QUEUE_STATS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a deferred-write operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum DeferError {
    #[error("no deferIfLimited rule of this namespace matches this {0} request")]
    NotDeferrable(String),
    #[error("the body has {size} bytes; deferIfLimited.maxBodyBytes is {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("no deferred write {0} here")]
    Unknown(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What became of a write offered to a queue, as the check API answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeferOutcome {
    /// Queued (or, `duplicate`, queued before under the same idempotency value) as `id`; its
    /// status is read as `status_id` (the id and a random token); the key has `depth` entries.
    Accepted { id: String, status_id: String, depth: u64, duplicate: bool },
    /// The queue is full: try again after `retry_after_ms`, the time the key's queue needs to
    /// drain at the rule's rate.
    Full { scope: &'static str, retry_after_ms: u64 },
}

impl<S: Store> Engine<S> {
    /// Queues `request`, a write `view` describes, under the first `deferIfLimited` rule it
    /// matches. Headers the rule does not keep are dropped; the idempotency header's value comes
    /// from `idempotency`. The caller says it was limited; a write that was not is queued just
    /// the same and replayed within the limits like any other, so nothing passes a limit by it.
    pub async fn defer(
        &self,
        view: &RequestView<'_>,
        mut request: DeferredRequest,
        idempotency: Option<&str>,
    ) -> Result<DeferOutcome, DeferError> {
        let live = self.live.load();
        let mut matched: Vec<Matched<'_>> = Vec::new();
        if crate::policy::WRITE_METHODS.iter().any(|m| view.method.eq_ignore_ascii_case(m)) {
            live.snapshot.resolve(view, &mut matched);
        }
        let Some((rule, defer, key)) = matched.iter().find_map(|m| Some((m.rule, m.rule.defer()?, m.key.as_str())))
        else {
            return Err(DeferError::NotDeferrable(view.method.to_string()));
        };
        if request.body.len() > defer.max_body_bytes {
            return Err(DeferError::TooLarge { size: request.body.len(), limit: defer.max_body_bytes });
        }
        request.replayed.retain(|(name, _)| defer.headers.iter().any(|kept| kept.eq_ignore_ascii_case(name)));
        let idempotency = idempotency.filter(|_| defer.idempotency_header.is_some()).filter(|v| !v.is_empty());
        let token = new_token();
        let deferral = Deferral {
            rule: rule.id(),
            key: key.as_bytes(),
            idempotency,
            max_queued: defer.max_queued,
            max_queued_bytes: defer.max_queued_bytes,
            request: &request,
            token: &token,
        };
        let queued = self.store.defer_for(view.namespace, None, &deferral).await?;
        let accepted = |id: &str, token: &str, depth, duplicate| {
            let id = entry_id(rule.id(), id);
            DeferOutcome::Accepted { status_id: status_id(&id, token), id, depth, duplicate }
        };
        let outcome = match queued {
            Queued::Accepted { id, depth, token } => accepted(&id, &token, depth, false),
            Queued::Duplicate { id, depth, token } => accepted(&id, &token, depth, true),
            Queued::Full { scope, depth } => {
                let limit = rule.limit();
                let drain = limit.per().saturating_mul(depth.max(1)) / limit.requests().max(1);
                DeferOutcome::Full { scope, retry_after_ms: drain.div_ceil(1000).max(1) }
            }
        };
        self.metrics.deferred(match &outcome {
            DeferOutcome::Accepted { duplicate: false, .. } => "accepted",
            DeferOutcome::Accepted { duplicate: true, .. } => "duplicate",
            DeferOutcome::Full { .. } => "full",
        });
        Ok(outcome)
    }

    /// Hands `consumer`, a pod of a workload of `namespace` with `labels`, up to `most` entries
    /// to deliver from the queues of the `deferIfLimited` rules of the policies selecting it.
    /// `holding`: the entries it still holds; the answer says which are still its own.
    pub async fn claim_deferred(
        &self,
        namespace: &str,
        labels: &dyn crate::request::names::StrMap,
        consumer: &str,
        holding: &[String],
        most: u64,
    ) -> Result<Claimed, StoreError> {
        let live = self.live.load();
        let mut out = Vec::new();
        let mut kept = Vec::new();
        for rule in live.snapshot.deferring_rules_for(namespace, labels) {
            let Some(defer) = rule.defer() else { continue };
            let held: Vec<String> = holding
                .iter()
                .filter_map(|id| parse_entry_id(id).filter(|(r, _)| *r == rule.id()).map(|(_, s)| s.to_string()))
                .collect();
            let left = most.saturating_sub(out.len() as u64);
            if left == 0 && held.is_empty() {
                break;
            }
            let claim = Claim {
                rule: rule.id(),
                consumer,
                holding: &held,
                most: left,
                max_attempts: defer.max_attempts,
                retry_interval: defer.retry_interval,
                keep_status: defer.keep_status,
            };
            let claimed = self.store.claim_for(namespace, None, &claim).await?;
            kept.extend(claimed.kept.iter().map(|id| entry_id(rule.id(), id)));
            for mut entry in claimed.entries {
                entry.id = entry_id(rule.id(), &entry.id);
                out.push(entry);
            }
        }
        Ok(Claimed { entries: out, kept })
    }

    /// Records how the delivery of entry `id` of `namespace` by `consumer` ended (unheard when
    /// another consumer holds it now).
    pub async fn finish_deferred(
        &self,
        namespace: &str,
        consumer: &str,
        id: &str,
        delivered: bool,
        status: u16,
    ) -> Result<Finished, DeferError> {
        let live = self.live.load();
        let (rule, stream_id) = self.deferring_rule(&live.snapshot, namespace, id)?;
        let defer = rule.defer().ok_or_else(|| DeferError::Unknown(id.to_string()))?;
        let finish = Finish {
            rule: rule.id(),
            id: stream_id,
            delivered,
            status,
            max_attempts: defer.max_attempts,
            retry_interval: defer.retry_interval,
            keep_status: defer.keep_status,
            consumer,
        };
        let finished = self.store.finish_for(namespace, None, &finish).await?;
        self.metrics.deferred(match finished {
            Finished::Delivered => "delivered",
            Finished::DeadLettered => "dead_lettered",
            Finished::Retrying => "retried",
            Finished::Unknown => "unknown",
        });
        Ok(finished)
    }

    /// The state of the entry `status_id` names (its id and token), for `view`, a request of
    /// the same key (the rule's key of `view` with the original's method and path equals the
    /// entry's): anyone else learns nothing, not even that it exists.
    pub async fn deferred_status(&self, view: &RequestView<'_>, status_id: &str) -> Result<EntryStatus, DeferError> {
        let live = self.live.load();
        let unknown = || DeferError::Unknown(status_id.to_string());
        let (_, _, token) = parse_status_id(status_id).ok_or_else(unknown)?;
        let id = status_id.split_once('.').map_or(status_id, |(id, _)| id);
        let (rule, stream_id) = self.deferring_rule(&live.snapshot, view.namespace, id)?;
        let status =
            self.store.entry_status_for(view.namespace, rule.id(), stream_id, token).await?.ok_or_else(unknown)?;
        let original = RequestView { method: &status.method, path: &status.path, ..*view };
        if rule.key_for(&original).is_none_or(|key| key.as_bytes() != status.key.as_slice()) {
            return Err(unknown());
        }
        Ok(status)
    }

    /// Reads the queue of every `deferIfLimited` rule of the snapshot: kept for `/v1/snapshot`
    /// and the metrics (`sluice_deferred_queued`, `_oldest_seconds`, `_dead_letters`).
    pub async fn refresh_queue_stats(&self) {
        let live = self.live.load();
        let now_ms = self.clock.now() / 1000;
        let mut read = Vec::new();
        let mut labels = std::collections::HashSet::new();
        for rule in live.snapshot.rules().filter(|rule| rule.defer().is_some()) {
            let namespace = rule.policy().split_once('/').map_or("", |(namespace, _)| namespace);
            let (stats, error) = match self.store.queue_stats_for(namespace, rule.id()).await {
                Ok(stats) => (stats, None),
                Err(error) => {
                    // Once per rule while it lasts: with no queue, its limited writes are refused.
                    let known = self
                        .queues
                        .lock()
                        .iter()
                        .any(|q| q.error.is_some() && *q.policy == *rule.policy() && *q.rule == *rule.name());
                    if !known {
                        tracing::warn!(policy = %rule.policy(), rule = %rule.name(), %error, "deferIfLimited: the rule's queue cannot be read; its limited writes get the refusal");
                    }
                    (Default::default(), Some(error.to_string()))
                }
            };
            let label = QueueLabels { policy: rule.policy().to_string(), rule: rule.name().to_string() };
            let metrics = &self.metrics;
            metrics.deferred_queued.get_or_create(&label).set(i64::try_from(stats.queued).unwrap_or(i64::MAX));
            let age = stats.oldest_accepted_ms.map_or(0, |at| now_ms.saturating_sub(at));
            metrics.deferred_oldest_seconds.get_or_create(&label).set(age as f64 / 1000.0);
            metrics
                .deferred_dead_letters
                .get_or_create(&label)
                .set(i64::try_from(stats.dead_letters).unwrap_or(i64::MAX));
            labels.insert(label.clone());
            read.push(QueueStatus { policy: label.policy, rule: label.rule, stats, error });
        }
        // Rules gone from the snapshot leave the metrics.
        let mut queues = self.queues.lock();
        for gone in queues.iter().map(|q| QueueLabels { policy: q.policy.clone(), rule: q.rule.clone() }) {
            if !labels.contains(&gone) {
                self.metrics.deferred_queued.remove(&gone);
                self.metrics.deferred_oldest_seconds.remove(&gone);
                self.metrics.deferred_dead_letters.remove(&gone);
            }
        }
        *queues = read;
    }

    /// [`Self::refresh_queue_stats`] every `every` until `stop`, while the snapshot has
    /// `deferIfLimited` rules.
    pub async fn keep_queue_stats(
        self: std::sync::Arc<Self>,
        every: std::time::Duration,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        loop {
            let deferring = self.live.load().snapshot.rules().any(|rule| rule.defer().is_some());
            if deferring || !self.queues.lock().is_empty() {
                self.refresh_queue_stats().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// The `deferIfLimited` rule of `namespace` entry `id` belongs to, and the entry's id in
    /// its queue.
    fn deferring_rule<'s, 'i>(
        &self,
        snapshot: &'s crate::policy::Snapshot,
        namespace: &str,
        id: &'i str,
    ) -> Result<(&'s CompiledRule, &'i str), DeferError> {
        let unknown = || DeferError::Unknown(id.to_string());
        let (rule_id, stream_id): (RuleId, &str) = parse_entry_id(id).ok_or_else(unknown)?;
        let rule = snapshot
            .namespace_policies(namespace)
            .iter()
            .flat_map(|p| p.rules())
            .find(|r| r.id() == rule_id && r.defer().is_some())
            .ok_or_else(unknown)?;
        Ok((rule, stream_id))
    }
}
