//! Where per-key state lives: in this process ([`memory::MemoryStore`]) or shared through Redis.
//!
//! Every store decides all the rules a request matched in one atomic step: the request is
//! admitted only when every enforcing rule admits it, and only then does each admitting rule
//! consume. A denial consumes nothing anywhere.

pub mod backend;
pub mod batching;
pub mod breaker;
pub mod denials;
pub mod keys;
pub mod memory;
pub mod queue;
pub mod redis;
pub mod tenants;

use std::future::Future;

use crate::algorithm::lease::{LeaseAsk, LeaseGrant};
use crate::algorithm::{HoldId, Limit, Micros};

use crate::rule::Verdict;
use crate::rule::{RuleCheck, RuleId};

/// One (rule, key) under which a request holds capacity, and what it settles to.
#[derive(Clone, Copy, Debug)]
pub struct Settle<'a> {
    pub rule: RuleId,
    /// The rule's limit now (a reservation's actual cost is consumed by its algorithm).
    pub limit: &'a Limit,
    pub key: &'a [u8],
    /// A reservation's actual cost; ignored for a concurrency slot, which is given back.
    pub cost: u64,
    /// What the request reserved here at admission (its lease says): a reservation of 0 holds
    /// nothing in the store, so its settle charges `cost` without looking for a hold
    /// ([`crate::algorithm::settle_unreserved`]). Ignored for a concurrency slot.
    pub reserved: u64,
}

/// The slot a shaping rule's admission took for a request whose caller went away before it
/// departed ([`crate::algorithm::give_back`]).
#[derive(Clone, Copy, Debug)]
pub struct Cancel<'a> {
    pub rule: RuleId,
    pub limit: &'a Limit,
    pub key: &'a [u8],
    /// What the request took.
    pub cost: u64,
    /// The key's state its admission set: the decision's instant plus its `reset_after`.
    pub until: Micros,
}

/// One key's quota-lease operation for a holder ([`crate::algorithm::lease`]): settle the lease it
/// had (hold id, units spent), then ask for a new one. Either may be absent.
#[derive(Clone, Copy, Debug)]
pub struct LeaseOp<'a> {
    pub rule: RuleId,
    pub limit: &'a Limit,
    pub key: &'a [u8],
    pub settle: Option<(HoldId, u64)>,
    pub ask: Option<LeaseAsk>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("store did not answer within {0} ms")]
    Timeout(u64),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store gave an unexpected answer: {0}")]
    Protocol(String),
    /// The request's namespace already had its share of the store's calls under way: its own
    /// load, not the store's failure ([`tenants`]).
    #[error("store busy for this namespace: {0}")]
    Busy(String),
    /// The request's namespace holds more of the shared store than it may ([`redis::usage`]).
    #[error("namespace over its share of the store: {0}")]
    OverBound(String),
}

impl StoreError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Protocol(_) => "protocol",
            StoreError::Busy(_) => "busy",
            StoreError::OverBound(_) => "over_bound",
        }
    }
}

/// A place that decides requests against shared per-key state.
pub trait Store: Send + Sync + 'static {
    /// Decides `checks` atomically. `now` is `None` in production (the store's own clock: the
    /// process clock for memory, Redis `TIME` for Redis); tests pass a time.
    fn check(
        &self,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send;

    /// [`Store::check`] for a request of `namespace`, the tenant whose limits these are. What a
    /// store does with it is its own business: the memory store charges new keys to it under
    /// the key cap, Redis keeps the request's keys in its hash slot.
    fn check_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        let _ = namespace;
        self.check(now, checks)
    }

    /// What [`Store::check_for`] would decide now, consuming nothing (`POST /v1/explain`);
    /// `Ok(None)` from a store that cannot decide without consuming (the default).
    fn peek_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Option<Verdict>, StoreError>> + Send {
        let _ = (namespace, now, checks);
        std::future::ready(Ok(None))
    }

    /// Settles a request's holds (`hold`: the request's id) in `namespace`: each concurrency slot
    /// is given back, each reservation replaced by its actual cost ([`crate::algorithm::settle`]).
    /// Idempotent; a hold already gone (settled, or run out) is left alone. Returns how many holds
    /// were found. `now` as for [`Store::check`].
    fn settle_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        settles: &[Settle<'_>],
        hold: HoldId,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Gives back, in `namespace`, the slots `cancels` name where the algorithm allows (only the
    /// last slot of a key: [`crate::algorithm::give_back`]). Returns how many went back. A store
    /// that cannot give back (the default) leaves each slot taken: the downstream then sees a
    /// gap, never more than the rate.
    fn cancel_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        cancels: &[Cancel<'_>],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        let _ = (namespace, now, cancels);
        std::future::ready(Ok(0))
    }

    /// Runs each of `ops` in `namespace` (each key atomically, the keys independently): the
    /// lease it settles is settled as [`Store::settle_for`] would (idempotent: a lease already
    /// settled or ended charges nothing), then a new one is granted
    /// ([`crate::algorithm::lease::grant`]). One grant per op, `amount` 0 where none was asked
    /// or none fits. `now` as for [`Store::check`]. A store that cannot lease (the default)
    /// grants nothing, so every decision of its leased rules stays exact.
    fn lease_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        ops: &[LeaseOp<'_>],
    ) -> impl Future<Output = Result<Vec<LeaseGrant>, StoreError>> + Send {
        let _ = (namespace, now);
        std::future::ready(Ok(vec![LeaseGrant::default(); ops.len()]))
    }

    /// Queues a write a `deferIfLimited` rule accepted instead of refusing, in `namespace`'s
    /// queue of its rule, within the key's and the namespace's bounds; deduplicated by its
    /// idempotency value. A store that cannot keep it durably (the default) refuses: a write is
    /// never accepted that cannot be stored.
    fn defer_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        deferral: &queue::Deferral<'_>,
    ) -> impl Future<Output = Result<queue::Queued, StoreError>> + Send {
        let _ = (namespace, now, deferral);
        std::future::ready(Err(no_queues()))
    }

    /// Hands `claim.consumer` entries of a rule's queue in `namespace` to deliver: those whose
    /// holder went away or whose retry is due first, then new ones.
    fn claim_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        claim: &queue::Claim<'_>,
    ) -> impl Future<Output = Result<queue::Claimed, StoreError>> + Send {
        let _ = (namespace, now, claim);
        std::future::ready(Err(no_queues()))
    }

    /// Records how a delivery ended: delivered, to be retried, or dead-lettered after its last
    /// attempt.
    fn finish_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        finish: &queue::Finish<'_>,
    ) -> impl Future<Output = Result<queue::Finished, StoreError>> + Send {
        let _ = (namespace, now, finish);
        std::future::ready(Err(no_queues()))
    }

    /// The state of a rule's queue in `namespace`.
    fn queue_stats_for(
        &self,
        namespace: &str,
        rule: RuleId,
    ) -> impl Future<Output = Result<queue::QueueStats, StoreError>> + Send {
        let _ = (namespace, rule);
        std::future::ready(Err(no_queues()))
    }

    /// An entry's state (`None`: unknown, or its status has expired).
    fn entry_status_for(
        &self,
        namespace: &str,
        rule: RuleId,
        id: &str,
        token: &str,
    ) -> impl Future<Output = Result<Option<queue::EntryStatus>, StoreError>> + Send {
        let _ = (namespace, rule, id, token);
        std::future::ready(Err(no_queues()))
    }

    /// What the store is and how it is doing, for `/v1/snapshot` and metrics.
    fn status(&self) -> StoreStatus {
        StoreStatus::default()
    }
}

/// Why a store without queues refuses a deferred write.
fn no_queues() -> StoreError {
    StoreError::Unavailable("this store keeps no queue of deferred writes: deferIfLimited needs the Redis store".into())
}

/// Where quota leases come from: a [`Store`] (the endpoint's Redis), or the endpoint itself for a
/// sidecar that holds slices for its pod.
pub trait LeaseStore: Send + Sync {
    /// As [`Store::lease_for`].
    fn lease(
        &self,
        namespace: &str,
        ops: &[LeaseOp<'_>],
    ) -> impl Future<Output = Result<Vec<LeaseGrant>, StoreError>> + Send;
}

impl<S: Store> LeaseStore for S {
    fn lease(
        &self,
        namespace: &str,
        ops: &[LeaseOp<'_>],
    ) -> impl Future<Output = Result<Vec<LeaseGrant>, StoreError>> + Send {
        self.lease_for(namespace, None, ops)
    }
}

/// A store's self-description.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoreStatus {
    /// `memory`, `redis` or `redisCluster`.
    pub kind: &'static str,
    /// Where the shared store is, password redacted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The shared store's circuit breaker: `closed` (calls go through), `open` (calls fail at
    /// once and rules use their `onStoreFailure`) or `halfOpen` (one probe in flight).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<&'static str>,
    /// Namespaces whose own breaker is not closed (each namespace's failures open its own:
    /// [`tenants`]), and its state.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub breakers_by_namespace: std::collections::BTreeMap<String, &'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Why the shared store has not answered since this process started (auth refused, no such
    /// host, TLS, no answer); absent once it has. While present, `/readyz` answers 503 with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_answered_yet: Option<String>,
    /// Keys held in this process's memory (the store itself, or the local fallback).
    pub live_keys: u64,
    /// Units of the memory cap (`--max-keys`) they hold: one per counter key, more for a sliding
    /// log of many entries (64 bytes a unit).
    pub live_units: u64,
    /// Keys each namespace holds in Redis, as last counted ([`redis::usage`]); empty when not
    /// counted.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub redis_keys_by_namespace: std::collections::BTreeMap<String, u64>,
    /// Live keys evicted by the key cap since start.
    pub evicted_keys: u64,
    /// `evicted_keys` by the namespace that owned the keys (`""`: checks without a namespace);
    /// only namespaces that lost keys. Filled by the memory store.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub evicted_keys_by_namespace: std::collections::BTreeMap<String, u64>,
    /// The shared store's denial cache: (rule, key) denials held, and requests it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub denial_cache: Option<DenialCacheStatus>,
    /// Calls that carried several requests' decisions (single Redis), and those decisions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batches: Option<BatchStatus>,
    /// The quota leases this process holds for `consistency: leased` rules (filled by the
    /// engine).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quota_leases: Option<QuotaLeaseStatus>,
    /// The queues of `deferIfLimited` rules, as last read (filled by the engine).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deferred_queues: Vec<queue::QueueStatus>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchStatus {
    pub calls: u64,
    pub decisions: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DenialCacheStatus {
    pub entries: u64,
    pub hits: u64,
}

impl<T: Store> Store for std::sync::Arc<T> {
    fn check(
        &self,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        (**self).check(now, checks)
    }

    fn check_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        (**self).check_for(namespace, now, checks)
    }

    fn peek_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Option<Verdict>, StoreError>> + Send {
        (**self).peek_for(namespace, now, checks)
    }

    fn settle_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        settles: &[Settle<'_>],
        hold: HoldId,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        (**self).settle_for(namespace, now, settles, hold)
    }

    fn lease_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        ops: &[LeaseOp<'_>],
    ) -> impl Future<Output = Result<Vec<LeaseGrant>, StoreError>> + Send {
        (**self).lease_for(namespace, now, ops)
    }

    fn cancel_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        cancels: &[Cancel<'_>],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        (**self).cancel_for(namespace, now, cancels)
    }

    fn defer_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        deferral: &queue::Deferral<'_>,
    ) -> impl Future<Output = Result<queue::Queued, StoreError>> + Send {
        (**self).defer_for(namespace, now, deferral)
    }

    fn claim_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        claim: &queue::Claim<'_>,
    ) -> impl Future<Output = Result<queue::Claimed, StoreError>> + Send {
        (**self).claim_for(namespace, now, claim)
    }

    fn finish_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        finish: &queue::Finish<'_>,
    ) -> impl Future<Output = Result<queue::Finished, StoreError>> + Send {
        (**self).finish_for(namespace, now, finish)
    }

    fn entry_status_for(
        &self,
        namespace: &str,
        rule: RuleId,
        id: &str,
        token: &str,
    ) -> impl Future<Output = Result<Option<queue::EntryStatus>, StoreError>> + Send {
        (**self).entry_status_for(namespace, rule, id, token)
    }

    fn queue_stats_for(
        &self,
        namespace: &str,
        rule: RuleId,
    ) -> impl Future<Output = Result<queue::QueueStats, StoreError>> + Send {
        (**self).queue_stats_for(namespace, rule)
    }

    fn status(&self) -> StoreStatus {
        (**self).status()
    }
}

/// The quota lease table's self-description (`crate::engine::leases`) (`/v1/snapshot`'s `store.quotaLeases`, and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QuotaLeaseStatus {
    /// Keys of leased rules followed here (hot or not).
    pub keys: u64,
    /// Slices held now, and their units not yet spent.
    pub held: u64,
    pub units_held: u64,
    /// Requests of leased rules admitted from slices, refused here (their key had nothing left
    /// at the store), and sent to the store.
    pub admitted_locally: u64,
    pub refused_locally: u64,
    pub to_store: u64,
    /// Renewals answered with a slice, and with none.
    pub grants: u64,
    pub empty_grants: u64,
    pub units_granted: u64,
    pub units_spent: u64,
    /// Units given back unspent (a slice settled below its amount).
    pub units_returned: u64,
    /// Store calls that renewed slices, and those that failed.
    pub renewals: u64,
    pub renewal_failures: u64,
}
