//! RedisStore over a three-master Redis Cluster: every request's rules share the namespace's hash
//! tag, so one script call decides them on whichever master owns that slot.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sluice::algorithm::{Algorithm, Limit, Micros};
use sluice::rule::RuleCheck;
use sluice::store::keys::{cluster_slot, state_key};
use sluice::store::redis::{RedisConfig, RedisStore};
use support::redis_server::{RedisCluster, cli};

const T0: Micros = 1_700_000_000_000_000;
const SEC: Micros = 1_000_000;

async fn store(cluster: &RedisCluster) -> RedisStore {
    let mut config = RedisConfig::cluster(cluster.urls());
    config.timeout = Duration::from_secs(5);
    RedisStore::connect(config).await.expect("cluster store")
}

fn check<'a>(rule: u64, limit: &'a Limit, key: &'a [u8], enforce: bool) -> RuleCheck<'a> {
    RuleCheck { rule, limit, key, cost: 1, enforce, hold: 0 }
}

/// The master port owning `slot`, read from CLUSTER NODES.
fn owner_port(cluster: &RedisCluster, slot: u16) -> u16 {
    for node in &cluster.nodes {
        let nodes = node.cli(&["cluster", "nodes"]);
        for line in nodes.lines().filter(|l| l.contains("myself")) {
            let owns = line.split_whitespace().skip(8).any(|range| match range.split_once('-') {
                Some((a, b)) => (a.parse::<u16>().unwrap()..=b.parse::<u16>().unwrap()).contains(&slot),
                None => range.parse::<u16>().ok() == Some(slot),
            });
            if owns {
                return node.port();
            }
        }
    }
    panic!("no owner for slot {slot}");
}

/// Namespaces land on different masters; in each, a multi-rule request is all-or-nothing.
#[tokio::test]
async fn multi_rule_requests_are_atomic_on_every_master() {
    let cluster = RedisCluster::shared();
    let store = store(cluster).await;
    let wide = Limit::new(Algorithm::TokenBucket, 100, 3_600 * SEC, None, None).unwrap();
    let narrow = Limit::new(Algorithm::SlidingWindowLog, 2, 60 * SEC, None, None).unwrap();
    let mut owners = HashSet::new();
    for ns in ["tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f"] {
        let checks = [check(1, &wide, b"ip", true), check(2, &narrow, b"tenant", true)];
        let slot = cluster_slot(&state_key(ns, 1, b"ip"));
        assert_eq!(slot, cluster_slot(&state_key(ns, 2, b"tenant")));
        let port = owner_port(cluster, slot);
        owners.insert(port);
        for i in 0..2 {
            assert!(store.check_tagged(ns, Some(T0 + i), &checks).await.unwrap().allowed, "{ns}");
        }
        let key = String::from_utf8(state_key(ns, 1, b"ip")).unwrap();
        let before = cli(port, &["hgetall", &key]);
        let denied = store.check_tagged(ns, Some(T0 + 10), &checks).await.unwrap();
        assert!(!denied.allowed && denied.decisions[0].allowed && !denied.decisions[1].allowed);
        assert_eq!(cli(port, &["hgetall", &key]), before, "{ns}: denial consumed the bucket");
        let pttl: i64 = cli(port, &["pttl", &key]).trim().parse().unwrap();
        assert!(pttl > 0, "{ns}: key without TTL");
    }
    assert!(owners.len() >= 2, "namespaces should spread over masters: {owners:?}");
}

/// SCRIPT FLUSH on every master: the next decisions reload the script wherever they land.
#[tokio::test]
async fn survives_script_flush_on_every_master() {
    let cluster = RedisCluster::shared();
    let store = store(cluster).await;
    let l = Limit::new(Algorithm::FixedWindow, 3, 60 * SEC, None, None).unwrap();
    for ns in ["flush-a", "flush-b", "flush-c"] {
        assert!(store.check_tagged(ns, Some(T0), &[check(5, &l, b"k", true)]).await.unwrap().allowed);
    }
    for node in &cluster.nodes {
        assert!(node.cli(&["script", "flush"]).contains("OK"));
    }
    for ns in ["flush-a", "flush-b", "flush-c"] {
        let v = store.check_tagged(ns, Some(T0), &[check(5, &l, b"k", true)]).await.expect("reloaded");
        assert_eq!(v.decisions[0].remaining, 1, "{ns}: state kept");
    }
}

/// Several clients through the cluster admit exactly the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_never_over_admit_on_a_cluster() {
    let cluster = RedisCluster::shared();
    let stores = [Arc::new(store(cluster).await), Arc::new(store(cluster).await)];
    let l = Arc::new(Limit::new(Algorithm::Gcra, 50, 3_600 * SEC, None, None).unwrap());
    let mut tasks = Vec::new();
    for t in 0..16 {
        let (store, l) = (stores[t % 2].clone(), l.clone());
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u64;
            for _ in 0..10 {
                admitted +=
                    store.check_tagged("race", Some(T0), &[check(9, &l, b"k", true)]).await.unwrap().allowed as u64;
            }
            admitted
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    assert_eq!(total, 50);
}

/// Keys per namespace on a cluster: each namespace's slot, counted on its master (issue 23,
/// item 6), with namespaces on different masters.
#[tokio::test]
async fn keys_are_counted_per_namespace_on_their_masters() {
    let cluster = RedisCluster::shared();
    let mut config = RedisConfig::cluster(cluster.urls());
    config.timeout = Duration::from_secs(5);
    config.usage_interval = Some(Duration::from_millis(50));
    let store = RedisStore::connect(config).await.expect("cluster store");
    let hourly = Limit::new(Algorithm::FixedWindow, 10, 3600 * SEC, None, None).unwrap();
    let namespaces = ["count-a", "count-b", "count-c", "count-d"];
    let masters: HashSet<u16> =
        namespaces.iter().map(|ns| owner_port(cluster, cluster_slot(format!("{{{ns}}}").as_bytes()))).collect();
    assert!(masters.len() > 1, "the namespaces should span masters");
    for (n, ns) in namespaces.iter().enumerate() {
        for i in 0..=n {
            let key = format!("k{i}");
            store.check_tagged(ns, None, &[check(1, &hourly, key.as_bytes(), true)]).await.expect("decided");
        }
    }
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let counted = sluice::store::Store::status(&store).redis_keys_by_namespace;
        if namespaces.iter().enumerate().all(|(n, ns)| counted.get(*ns) == Some(&(n as u64 + 1))) {
            break;
        }
        assert!(std::time::Instant::now() < give_up, "{counted:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
