//! How a Redis store is configured: where Redis is, how to reach it, and what a configuration
//! cannot be used for; the memory settings a shared Redis should have.

use std::time::Duration;

use super::SentinelEndpoint;
use super::url::redact_url;
use crate::store::breaker::BreakerConfig;
use crate::store::tenants::Tenants;

/// Where Redis is.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisEndpoint {
    /// `redis://[user:password@]host:port[/db]` or `rediss://…` (TLS).
    Single(String),
    /// Seed nodes of a Redis Cluster (`--redis-cluster URL[,URL…]`); the rest is discovered.
    Cluster(Vec<String>),
    /// The master a set of Redis Sentinels names (`--redis-sentinel URL[,URL…]
    /// --redis-sentinel-master NAME`), followed across failovers.
    Sentinel(SentinelEndpoint),
}

impl std::fmt::Debug for RedisEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl RedisEndpoint {
    /// The endpoint with passwords replaced, safe to log and show in status.
    pub fn redacted(&self) -> String {
        match self {
            RedisEndpoint::Single(url) => redact_url(url),
            RedisEndpoint::Cluster(urls) => {
                format!("cluster[{}]", urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(","))
            }
            RedisEndpoint::Sentinel(endpoint) => format!(
                "sentinel[{}]/{}",
                endpoint.sentinels.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(","),
                endpoint.master
            ),
        }
    }
}

/// Why a Redis configuration cannot be used at all (as opposed to Redis being unreachable, which
/// [`RedisStore::connect`] tolerates).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedisConfigError {
    #[error("invalid Redis endpoint {endpoint}: {reason}")]
    Invalid { endpoint: String, reason: String },
    #[error("--redis-cluster needs at least one node URL")]
    NoClusterNodes,
    #[error(
        "Redis at {endpoint} refuses us: {reason} (give its password with --redis-password-file, SLUICE_REDIS_PASSWORD or the URL, and an ACL user allowed Sluice's commands: docs/redis.md)"
    )]
    Refused { endpoint: String, reason: String },
    /// The connection's handshake failed on the credentials or the database of the URL.
    #[error("Redis at {endpoint}: {reason}")]
    Handshake { endpoint: String, reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisConfig {
    pub endpoint: RedisEndpoint,
    /// Deadline of one decision, connection wait included. Past it the call fails with
    /// [`StoreError::Timeout`] and the rules' failure modes apply.
    pub timeout: Duration,
    /// Deadline of one connection attempt (re-connections happen in the background).
    pub connect_timeout: Duration,
    pub breaker: BreakerConfig,
    /// PEM root certificate(s) trusted for `rediss://` instead of the built-in web PKI roots
    /// (in-cluster Redis usually has a private CA).
    pub tls_root_ca: Option<Vec<u8>>,
    /// PEM client certificate and key presented to Redis (mutual TLS: `tls-auth-clients yes`).
    pub tls_client: Option<TlsClient>,
    /// (rule, key) denials this replica keeps to answer repeats without Redis (0: none); see
    /// [`super::denials`].
    pub denial_cache: usize,
    /// Calls in flight at once on a single Redis, each carrying every request that waited for
    /// it (see [`self::batches`]); 0: one call per request.
    pub batches: usize,
    /// Rule decisions of one namespace's requests on their way to Redis at once (see
    /// [`super::tenants`]).
    pub namespace_lane: u32,
    /// How often keys are counted per namespace ([`self::usage`]); `None`: never.
    pub usage_interval: Option<Duration>,
    /// Keys a namespace may hold in Redis before its rules' onStoreFailure decides for it; 0: no
    /// bound (counted all the same).
    pub namespace_max_keys: u64,
}

impl RedisConfig {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
    pub const DEFAULT_DENIAL_CACHE: usize = 100_000;
    /// One call per request: with Redis on a core of its own, calls share nothing worth the wait
    /// (docs/benchmarks.md, "The batching default re-checked").
    pub const DEFAULT_BATCHES: usize = 0;
    pub const DEFAULT_USAGE_INTERVAL: Duration = Duration::from_secs(60);

    pub fn single(url: impl Into<String>) -> RedisConfig {
        RedisConfig::new(RedisEndpoint::Single(url.into()))
    }

    pub fn cluster<S: Into<String>>(urls: impl IntoIterator<Item = S>) -> RedisConfig {
        RedisConfig::new(RedisEndpoint::Cluster(urls.into_iter().map(Into::into).collect()))
    }

    pub fn new(endpoint: RedisEndpoint) -> RedisConfig {
        RedisConfig {
            endpoint,
            timeout: RedisConfig::DEFAULT_TIMEOUT,
            connect_timeout: RedisConfig::DEFAULT_CONNECT_TIMEOUT,
            breaker: BreakerConfig::default(),
            tls_root_ca: None,
            tls_client: None,
            denial_cache: RedisConfig::DEFAULT_DENIAL_CACHE,
            batches: RedisConfig::DEFAULT_BATCHES,
            namespace_lane: Tenants::DEFAULT_LANE,
            usage_interval: Some(RedisConfig::DEFAULT_USAGE_INTERVAL),
            namespace_max_keys: 0,
        }
    }
}

/// A client certificate and its key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsClient {
    pub certificate: Vec<u8>,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClient { .. }")
    }
}

/// The concerns [`RedisStore::memory_settings`] reports for these settings: an eviction policy
/// that picks counters without regard to their state resets spent limits; a bounded Redis that
/// refuses writes when full fails every tenant's decisions unless namespaces are bounded; an
/// unbounded one grows with the keys.
pub fn memory_concerns(maxmemory: &str, policy: &str, namespace_max_keys: u64) -> Vec<String> {
    let mut concerns = Vec::new();
    let bounded = maxmemory.trim() != "0";
    match policy {
        "volatile-ttl" => {}
        "noeviction" if bounded && namespace_max_keys == 0 => concerns.push(
            "Redis has maxmemory and noeviction: once full, every decision of every namespace fails (OOM) and rules fall to onStoreFailure; bound each namespace with --redis-namespace-max-keys".to_string(),
        ),
        "noeviction" => {}
        other => concerns.push(format!(
            "Redis evicts with maxmemory-policy {other}: under memory pressure it drops counters whatever their state, and a spent limit whose key is dropped starts over; use volatile-ttl (every Sluice key's TTL is the time until its state is a full quota, so the least used go first) or noeviction"
        )),
    }
    if !bounded && namespace_max_keys == 0 {
        concerns.push(
            "Redis has no maxmemory and --redis-namespace-max-keys is 0: nothing bounds the keys a namespace can add"
                .to_string(),
        );
    }
    concerns
}
