//! What each namespace gets of the shared store: its own circuit breaker and its own lane.
//!
//! Redis is shared by every tenant, and before this one tenant's load could fail everyone's
//! decisions: its calls queued past the deadline, the timeouts opened the one breaker, and every
//! tenant's rules fell to `onStoreFailure`. Now:
//!
//! - each namespace has a breaker: the failures of its calls open it for its rules only (an
//!   outage of Redis opens every namespace's breaker, each after its own failures);
//! - each namespace has a lane: at most `lane` rule decisions of its requests are on their way to
//!   Redis at once. A request that finds its namespace's lane full waits for room in it, and only
//!   there, for at most the store's deadline; past that it gets [`StoreError::Busy`], which is not
//!   a store failure (the breaker is not told) and its rules' `onStoreFailure` decides. Its store
//!   deadline starts once it is in the lane, so it never counts the time another tenant's
//!   requests kept it waiting there: what waits ahead of it in the shared calls is bounded by one
//!   lane per busy namespace.
//!
//! Entries are kept for namespaces that decided something; the map is bounded by the namespaces
//! with policies, and idle entries are dropped when it grows past [`Tenants::MAX_IDLE_KEPT`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Semaphore, SemaphorePermit};

use super::StoreError;
use super::breaker::{Breaker, BreakerConfig, BreakerState};
use crate::duration::Micros;

/// One namespace's share of the store.
#[derive(Debug)]
pub struct Tenant {
    pub breaker: Breaker,
    lane: Semaphore,
    lane_size: u32,
}

impl Tenant {
    /// Room in the lane for a request of `rules` rule decisions (a request larger than the whole
    /// lane takes all of it), waiting at most `within`.
    pub async fn enter(&self, rules: usize, within: Duration) -> Result<SemaphorePermit<'_>, StoreError> {
        let wanted = u32::try_from(rules).unwrap_or(u32::MAX).clamp(1, self.lane_size);
        match tokio::time::timeout(within, self.lane.acquire_many(wanted)).await {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; treated like a full lane all the same.
            Ok(Err(_)) | Err(_) => Err(StoreError::Busy(format!(
                "the namespace's lane to the store was full for {} ms ({} rule decisions in flight)",
                within.as_millis(),
                self.lane_size
            ))),
        }
    }

    fn idle(&self, now: Micros) -> bool {
        self.lane.available_permits() == self.lane_size as usize && self.breaker.state(now) == BreakerState::Closed
    }
}

/// The namespaces' breakers and lanes.
#[derive(Debug)]
pub struct Tenants {
    breaker: BreakerConfig,
    lane_size: u32,
    by_namespace: Mutex<HashMap<Box<str>, Arc<Tenant>>>,
}

impl Tenants {
    /// Idle entries beyond this many are dropped (a new entry starts closed and empty, exactly
    /// what an idle one is).
    pub const MAX_IDLE_KEPT: usize = 4096;
    pub const DEFAULT_LANE: u32 = 1024;

    pub fn new(breaker: BreakerConfig, lane_size: u32) -> Tenants {
        Tenants { breaker, lane_size: lane_size.max(1), by_namespace: Mutex::new(HashMap::new()) }
    }

    pub fn of(&self, namespace: &str, now: Micros) -> Arc<Tenant> {
        let mut map = self.by_namespace.lock();
        if let Some(tenant) = map.get(namespace) {
            return tenant.clone();
        }
        if map.len() >= Self::MAX_IDLE_KEPT {
            map.retain(|_, tenant| Arc::strong_count(tenant) > 1 || !tenant.idle(now));
        }
        let tenant = Arc::new(Tenant {
            breaker: Breaker::new(self.breaker),
            lane: Semaphore::new(self.lane_size as usize),
            lane_size: self.lane_size,
        });
        map.insert(namespace.into(), tenant.clone());
        tenant
    }

    /// The namespaces this store has decided for (and still keeps an entry for).
    pub fn namespaces(&self) -> Vec<String> {
        self.by_namespace.lock().keys().map(|namespace| namespace.to_string()).collect()
    }

    /// The namespaces whose breaker is not closed, and its state.
    pub fn open_breakers(&self, now: Micros) -> BTreeMap<String, &'static str> {
        self.by_namespace
            .lock()
            .iter()
            .filter_map(|(namespace, tenant)| match tenant.breaker.state(now) {
                BreakerState::Closed => None,
                state => Some((namespace.to_string(), state.name())),
            })
            .collect()
    }
}

/// The store-wide breaker state shown beside the namespaces' own: `open` when any namespace's is
/// open, else `halfOpen` when any is probing, else `closed`.
pub fn overall_breaker(open_breakers: &BTreeMap<String, &'static str>) -> &'static str {
    let open = BreakerState::Open.name();
    if open_breakers.values().any(|state| *state == open) {
        open
    } else if open_breakers.is_empty() {
        BreakerState::Closed.name()
    } else {
        BreakerState::HalfOpen.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Micros = 1_700_000_000_000_000;

    fn tenants() -> Tenants {
        Tenants::new(BreakerConfig { failure_threshold: 2, cool_down: Duration::from_secs(1) }, 8)
    }

    #[test]
    fn one_namespace_failing_opens_only_its_breaker() {
        let tenants = tenants();
        let a = tenants.of("a", NOW);
        for _ in 0..2 {
            let _ = a.breaker.try_acquire(NOW).expect("closed").failure(NOW);
        }
        assert!(a.breaker.try_acquire(NOW).is_none(), "a's breaker is open");
        assert!(tenants.of("b", NOW).breaker.try_acquire(NOW).is_some(), "b's is not");
        let open = tenants.open_breakers(NOW);
        assert_eq!(open.into_iter().collect::<Vec<_>>(), vec![("a".to_string(), "open")]);
    }

    #[tokio::test]
    async fn a_full_lane_refuses_its_namespace_only() {
        let tenants = tenants();
        let a = tenants.of("a", NOW);
        let held = a.enter(100, Duration::from_millis(10)).await.expect("an empty lane");
        assert_eq!(held.num_permits(), 8, "a request larger than the lane takes all of it");
        let refused = a.enter(1, Duration::from_millis(10)).await;
        assert!(matches!(refused, Err(StoreError::Busy(_))), "{refused:?}");
        let b = tenants.of("b", NOW);
        assert!(b.enter(8, Duration::from_millis(10)).await.is_ok(), "b's lane is its own");
        drop(held);
        assert!(a.enter(1, Duration::from_millis(10)).await.is_ok(), "room again once released");
    }

    #[test]
    fn idle_entries_are_dropped_when_the_map_is_full() {
        let tenants = tenants();
        let busy = tenants.of("busy", NOW);
        for i in 0..Tenants::MAX_IDLE_KEPT + 10 {
            let _ = tenants.of(&format!("ns{i}"), NOW);
        }
        let kept = tenants.by_namespace.lock().len();
        assert!(kept <= Tenants::MAX_IDLE_KEPT + 1, "{kept} entries");
        assert!(Arc::ptr_eq(&busy, &tenants.of("busy", NOW)), "an entry in use is kept");
    }

    #[test]
    fn overall_state_is_the_worst() {
        let mut states = BTreeMap::new();
        assert_eq!(overall_breaker(&states), "closed");
        states.insert("a".to_string(), "halfOpen");
        assert_eq!(overall_breaker(&states), "halfOpen");
        states.insert("b".to_string(), "open");
        assert_eq!(overall_breaker(&states), "open");
    }
}
