//! The store a process decides with, chosen at start from the command line (`crate::role::store`):
//! the in-process memory store, or Redis (one server, a cluster or a Sentinel-followed master)
//! shared by every replica. One type, so the engine is built once for either.

use std::sync::Arc;

use crate::algorithm::{HoldId, Micros};
use crate::rule::RuleCheck;
use crate::rule::Verdict;
use crate::store::memory::MemoryStore;
use crate::store::redis::RedisStore;
use crate::store::{Store, StoreError, StoreStatus};

/// The store a process decides with.
pub enum Backend {
    Memory(Arc<MemoryStore>),
    Redis(Box<RedisStore>),
}

impl Store for Backend {
    async fn check(&self, now: Option<Micros>, checks: &[RuleCheck<'_>]) -> Result<Verdict, StoreError> {
        match self {
            Backend::Memory(store) => store.check(now, checks).await,
            Backend::Redis(store) => Store::check(&**store, now, checks).await,
        }
    }

    async fn check_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> Result<Verdict, StoreError> {
        match self {
            Backend::Memory(store) => store.check_for(namespace, now, checks).await,
            Backend::Redis(store) => Store::check_for(&**store, namespace, now, checks).await,
        }
    }

    /// Redis state is only read inside its scripts, which always consume: no peek there.
    async fn peek_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> Result<Option<Verdict>, StoreError> {
        match self {
            Backend::Memory(store) => store.peek_for(namespace, now, checks).await,
            Backend::Redis(_) => Ok(None),
        }
    }

    async fn settle_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        settles: &[crate::store::Settle<'_>],
        hold: HoldId,
    ) -> Result<u64, StoreError> {
        match self {
            Backend::Memory(store) => store.settle_for(namespace, now, settles, hold).await,
            Backend::Redis(store) => Store::settle_for(&**store, namespace, now, settles, hold).await,
        }
    }

    async fn cancel_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        cancels: &[crate::store::Cancel<'_>],
    ) -> Result<u64, StoreError> {
        match self {
            Backend::Memory(store) => store.cancel_for(namespace, now, cancels).await,
            Backend::Redis(store) => Store::cancel_for(&**store, namespace, now, cancels).await,
        }
    }

    async fn defer_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        deferral: &crate::store::queue::Deferral<'_>,
    ) -> Result<crate::store::queue::Queued, StoreError> {
        match self {
            Backend::Memory(store) => store.defer_for(namespace, now, deferral).await,
            Backend::Redis(store) => Store::defer_for(&**store, namespace, now, deferral).await,
        }
    }

    async fn claim_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        claim: &crate::store::queue::Claim<'_>,
    ) -> Result<crate::store::queue::Claimed, StoreError> {
        match self {
            Backend::Memory(store) => store.claim_for(namespace, now, claim).await,
            Backend::Redis(store) => Store::claim_for(&**store, namespace, now, claim).await,
        }
    }

    async fn finish_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        finish: &crate::store::queue::Finish<'_>,
    ) -> Result<crate::store::queue::Finished, StoreError> {
        match self {
            Backend::Memory(store) => store.finish_for(namespace, now, finish).await,
            Backend::Redis(store) => Store::finish_for(&**store, namespace, now, finish).await,
        }
    }

    async fn entry_status_for(
        &self,
        namespace: &str,
        rule: crate::rule::RuleId,
        id: &str,
        token: &str,
    ) -> Result<Option<crate::store::queue::EntryStatus>, StoreError> {
        match self {
            Backend::Memory(store) => store.entry_status_for(namespace, rule, id, token).await,
            Backend::Redis(store) => Store::entry_status_for(&**store, namespace, rule, id, token).await,
        }
    }

    async fn queue_stats_for(
        &self,
        namespace: &str,
        rule: crate::rule::RuleId,
    ) -> Result<crate::store::queue::QueueStats, StoreError> {
        match self {
            Backend::Memory(store) => store.queue_stats_for(namespace, rule).await,
            Backend::Redis(store) => Store::queue_stats_for(&**store, namespace, rule).await,
        }
    }

    async fn lease_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        ops: &[crate::store::LeaseOp<'_>],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, StoreError> {
        match self {
            Backend::Memory(store) => store.lease_for(namespace, now, ops).await,
            Backend::Redis(store) => Store::lease_for(&**store, namespace, now, ops).await,
        }
    }

    fn status(&self) -> StoreStatus {
        match self {
            Backend::Memory(store) => store.status(),
            Backend::Redis(store) => Store::status(&**store),
        }
    }
}
