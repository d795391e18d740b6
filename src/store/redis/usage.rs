//! How many keys each namespace holds in Redis, counted in the background, and the per-namespace
//! bound on them.
//!
//! Redis memory is shared: with `maxmemory` and `noeviction` one tenant's keys made every
//! tenant's decisions fail (OOM), and with an eviction policy they pushed other tenants' spent
//! counters out (their users were allowed again). Counting keys per namespace makes that visible
//! (`/v1/snapshot`, `sluice_redis_keys{namespace}`), and `--redis-namespace-max-keys` makes it
//! enforceable: a namespace holding that many keys is decided by its rules' `onStoreFailure`
//! (`localFallback`: this replica's memory, under its share there) until its count falls back
//! below, so it stops adding keys to Redis and the others keep their room.
//!
//! Counting: on a single Redis, one `SCAN MATCH sl1:{*` pass over the keyspace (about a
//! millisecond of Redis time per thousand keys, in pages of 1000); on a cluster, where each
//! namespace's keys sit in one slot, `CLUSTER COUNTKEYSINSLOT` for each namespace this replica
//! decided for, on the slot's master. The count is as old as the last pass
//! (`--redis-usage-interval`), so the bound is enforced within one interval of being reached.

use std::collections::{BTreeMap, HashMap};

use ::redis::aio::ConnectionManager;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{RedisError, Value};
use parking_lot::RwLock;

use crate::store::keys::{PREFIX, PROBE_TAG, cluster_slot, tag_of_key};

/// Namespaces counted at most (every namespace with policies is one; more means keys of
/// another program under our prefix, not worth a label each).
pub const MAX_COUNTED: usize = 10_000;

/// The last pass's counts, by hash tag (the namespace, as keys carry it).
#[derive(Debug, Default)]
pub struct Usage {
    keys_by_tag: RwLock<HashMap<String, u64>>,
    /// 0: no bound.
    max_keys: u64,
}

impl Usage {
    pub fn new(max_keys: u64) -> Usage {
        Usage { keys_by_tag: RwLock::default(), max_keys }
    }

    /// The namespace's key count when it is at or over the bound.
    pub fn over_bound(&self, tag: &str) -> Option<u64> {
        if self.max_keys == 0 {
            return None;
        }
        self.keys_by_tag.read().get(tag).copied().filter(|&keys| keys >= self.max_keys)
    }

    pub fn max_keys(&self) -> u64 {
        self.max_keys
    }

    pub fn keys_by_tag(&self) -> BTreeMap<String, u64> {
        self.keys_by_tag.read().iter().map(|(tag, &keys)| (tag.clone(), keys)).collect()
    }

    pub(super) fn replace(&self, counts: HashMap<String, u64>) {
        *self.keys_by_tag.write() = counts;
    }
}

/// Keys per hash tag on a single Redis: one SCAN pass.
pub(super) async fn count_single(manager: &ConnectionManager) -> Result<HashMap<String, u64>, RedisError> {
    let mut connection = manager.clone();
    let pattern = format!("{PREFIX}{{*");
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await?;
        for key in &keys {
            let Some(tag) = tag_of_key(key).filter(|&tag| tag != PROBE_TAG) else { continue };
            if let Some(count) = counts.get_mut(tag) {
                *count += 1;
            } else if counts.len() < MAX_COUNTED {
                counts.insert(tag.to_string(), 1);
            }
        }
        if next == 0 {
            return Ok(counts);
        }
        cursor = next;
    }
}

/// Keys per hash tag on a cluster, for `tags`: each one's slot, asked of its master.
pub(super) async fn count_cluster(
    connection: &ClusterConnection,
    tags: &[String],
) -> Result<HashMap<String, u64>, RedisError> {
    let mut connection = connection.clone();
    let mut counts = HashMap::new();
    for tag in tags.iter().take(MAX_COUNTED) {
        let slot = cluster_slot(format!("{{{tag}}}").as_bytes());
        let mut count = ::redis::cmd("CLUSTER");
        count.arg("COUNTKEYSINSLOT").arg(slot);
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)));
        if let Value::Int(keys) = connection.route_command(count, routing).await? {
            counts.insert(tag.clone(), u64::try_from(keys).unwrap_or(0));
        }
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_applies_from_the_count_that_reaches_it() {
        let usage = Usage::new(100);
        usage.replace(HashMap::from([("a".to_string(), 100), ("b".to_string(), 99)]));
        assert_eq!(usage.over_bound("a"), Some(100));
        assert_eq!(usage.over_bound("b"), None);
        assert_eq!(usage.over_bound("never-counted"), None);
        let unbounded = Usage::new(0);
        unbounded.replace(HashMap::from([("a".to_string(), u64::MAX)]));
        assert_eq!(unbounded.over_bound("a"), None, "0 is no bound");
    }
}
