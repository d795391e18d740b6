//! The Redis store (the Lua script) passes every conformance vector, as the memory store does,
//! on one Redis and on a 3-master Redis Cluster.

#[allow(dead_code)] // the policy text generator serves the HTTP and RLS suites
#[path = "common/conformance.rs"]
mod conformance;
mod support;

use std::time::Duration;

use sluice::store::redis::{RedisConfig, RedisStore};
use support::redis_server::RedisServer;

/// Every vector on a single Redis, `batches` calls in flight (0: one call per request).
async fn single_redis_passes_every_vector(batches: usize) {
    let server = RedisServer::start();
    let mut config = RedisConfig::single(server.url());
    // Generous for debug builds on a loaded machine; deadlines are tested in redis_store.rs.
    config.timeout = Duration::from_secs(5);
    // Every answer from the Lua itself; the cluster run below keeps the denial cache on, so its
    // answers to repeated denials are held to the same vectors.
    config.denial_cache = 0;
    config.batches = batches;
    let store = RedisStore::connect(config).await.expect("store");
    let failures = conformance::run(&store).await;
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[tokio::test]
async fn redis_store_passes_every_vector() {
    single_redis_passes_every_vector(0).await;
}

/// Through batched calls (`--redis-batches 2`): requests decided in `decide_many`.
#[tokio::test]
async fn batched_redis_store_passes_every_vector() {
    single_redis_passes_every_vector(2).await;
}

#[tokio::test]
async fn redis_cluster_store_passes_every_vector() {
    let cluster = support::redis_server::RedisCluster::start();
    let mut config = RedisConfig::cluster(cluster.urls());
    config.timeout = Duration::from_secs(5);
    let store = RedisStore::connect(config).await.expect("store");
    let failures = conformance::run(&store).await;
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}
