//! Choosing the store from the command line: the in-process memory store, or Redis (one server or
//! a cluster) shared by every replica, with this process's memory as the local fallback.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::store::backend::Backend;
use crate::store::breaker::BreakerConfig;
use crate::store::memory::{DEFAULT_MAX_KEYS, MemoryStore};
use crate::store::redis::url::{UrlParts, redact_url, with_credentials};
use crate::store::redis::{RedisConfig, RedisConfigError, RedisEndpoint, RedisStore, SentinelEndpoint, TlsClient};

/// Store flags shared by `sluice serve` and `sluice operator`.
#[derive(clap::Args, Clone, Debug)]
pub struct StoreArgs {
    /// Memory for keys (the store itself, or the local fallback when Redis is used), in keys of
    /// a counter algorithm (~64 bytes each; a sliding-log key counts one more per four entries
    /// its log has room for). Beyond it keys are evicted from the namespaces above their share,
    /// those closest to a full quota first.
    #[arg(long, env = "SLUICE_MAX_KEYS", default_value_t = DEFAULT_MAX_KEYS)]
    pub max_keys: usize,
    /// Share state through this Redis: redis://[user@]host:port[/db] or rediss:// (TLS).
    #[arg(long, env = "SLUICE_REDIS", conflicts_with_all = ["redis_cluster", "redis_sentinel"])]
    pub redis: Option<String>,
    /// Share state through a Redis Cluster: seed node URLs, comma-separated.
    #[arg(long, env = "SLUICE_REDIS_CLUSTER", value_delimiter = ',', conflicts_with = "redis_sentinel")]
    pub redis_cluster: Vec<String>,
    /// Share state through the master these Redis Sentinels name (followed across failovers):
    /// sentinel URLs, comma-separated, redis://[user@]host:26379 or rediss:// (TLS to the
    /// sentinels and the master).
    #[arg(long, env = "SLUICE_REDIS_SENTINEL", value_delimiter = ',')]
    pub redis_sentinel: Vec<String>,
    /// The master's name in the sentinels' configuration (`sentinel monitor NAME …`).
    #[arg(long, env = "SLUICE_REDIS_SENTINEL_MASTER", default_value = "mymaster")]
    pub redis_sentinel_master: String,
    /// File holding the sentinels' password (their `requirepass`), when they have one.
    #[arg(long, env = "SLUICE_REDIS_SENTINEL_PASSWORD_FILE")]
    pub redis_sentinel_password_file: Option<PathBuf>,
    /// Redis ACL user (docs/redis.md gives the rule it needs), when the URL names none.
    #[arg(long, env = "SLUICE_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// File holding the Redis password (a mounted Secret), used when the URL has none. The
    /// SLUICE_REDIS_PASSWORD environment variable (from a Secret) does the same.
    #[arg(long, env = "SLUICE_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,
    /// PEM file of the CA that signed the Redis server's certificate (rediss://).
    #[arg(long, env = "SLUICE_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// PEM client certificate presented to Redis over TLS (servers with tls-auth-clients yes);
    /// needs --redis-client-key-file.
    #[arg(long, env = "SLUICE_REDIS_CLIENT_CERT_FILE", requires = "redis_client_key_file")]
    pub redis_client_cert_file: Option<PathBuf>,
    /// PEM private key of --redis-client-cert-file.
    #[arg(long, env = "SLUICE_REDIS_CLIENT_KEY_FILE", requires = "redis_client_cert_file")]
    pub redis_client_key_file: Option<PathBuf>,
    /// Deadline of one Redis decision; past it each rule's onStoreFailure decides.
    #[arg(long, env = "SLUICE_REDIS_TIMEOUT", default_value = "50ms", value_parser = crate::duration::parse_positive_std_duration)]
    pub redis_timeout: Duration,
    /// Consecutive Redis failures that open the circuit breaker (decisions then skip Redis).
    #[arg(long, env = "SLUICE_REDIS_BREAKER_FAILURES", default_value_t = 5)]
    pub redis_breaker_failures: u32,
    /// How long the open breaker waits before letting one probe through to Redis.
    #[arg(long, env = "SLUICE_REDIS_BREAKER_COOLDOWN", default_value = "1s", value_parser = crate::duration::parse_positive_std_duration)]
    pub redis_breaker_cooldown: Duration,
    /// Replicas sharing each limit; under onStoreFailure: localFallback each replica enforces
    /// 1/N of every limit in its own memory until Redis is back.
    #[arg(long, env = "SLUICE_FALLBACK_REPLICAS", default_value_t = 1)]
    pub fallback_replicas: u32,
    /// Keys of `consistency: leased` rules this replica follows to decide the hot ones from
    /// slices of their quota (docs/leasing.md); past it, new keys are decided exactly. 0: no
    /// leases here, every rule exact.
    #[arg(long, env = "SLUICE_QUOTA_LEASE_KEYS", default_value_t = crate::engine::leases::DEFAULT_MAX_KEYS)]
    pub quota_lease_keys: usize,
    /// (rule, key) denials kept to answer repeats without Redis until their retry-after (exact:
    /// such a request could not be admitted there either); 0 turns the cache off.
    #[arg(long, env = "SLUICE_REDIS_DENIAL_CACHE", default_value_t = RedisConfig::DEFAULT_DENIAL_CACHE)]
    pub redis_denial_cache: usize,
    /// Calls in flight at once on a single Redis; requests that arrive while all are under way
    /// go together in the next (one call decides them all, one after the other, each exactly as
    /// on its own). 0 (the default): one call per request, which is faster while Redis has CPU
    /// to spare; 2 when Redis's CPU is the bottleneck (it shares a core, or it is saturated):
    /// deep queues then share calls and cost Redis about a quarter less per decision.
    #[arg(long, env = "SLUICE_REDIS_BATCHES", default_value_t = RedisConfig::DEFAULT_BATCHES)]
    pub redis_batches: usize,
    /// Rule decisions of one namespace's requests on their way to Redis at once. A namespace
    /// whose lane is full waits for room in it (at most --redis-timeout), then its rules'
    /// onStoreFailure decides: one tenant's load queues behind itself, not in front of others.
    #[arg(long, env = "SLUICE_REDIS_NAMESPACE_LANE", default_value_t = crate::store::tenants::Tenants::DEFAULT_LANE, value_parser = clap::value_parser!(u32).range(1..))]
    pub redis_namespace_lane: u32,
    /// How often each replica counts the keys each namespace holds in Redis (SCAN on a single
    /// Redis, one CLUSTER COUNTKEYSINSLOT per namespace on a cluster); 0s: never.
    #[arg(long, env = "SLUICE_REDIS_USAGE_INTERVAL", default_value = "60s", value_parser = crate::duration::parse_std_duration)]
    pub redis_usage_interval: Duration,
    /// Keys a namespace may hold in Redis (as last counted); at or over it, its rules'
    /// onStoreFailure decides for it until the count falls below. 0: no bound.
    #[arg(long, env = "SLUICE_REDIS_NAMESPACE_MAX_KEYS", default_value_t = 0)]
    pub redis_namespace_max_keys: u64,
    /// File of the keys hold tokens (the `lease` of a check answer, given back to /v1/settle)
    /// are signed with, one per line: the first signs, each verifies (add a new key second, then
    /// move it first, then drop the old). Replicas that share a Redis need the same file, or a
    /// token is refused at every replica but its own. Re-read every 10 s. Without it, a random
    /// key of this process (`sluice operator`: the Secret --lease-keys-secret).
    #[arg(long, env = "SLUICE_LEASE_KEYS_FILE")]
    pub lease_keys_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Redis(#[from] RedisConfigError),
    #[error("cannot read {path}: {error}")]
    File { path: PathBuf, error: std::io::Error },
    #[error("--fallback-replicas must be at least 1")]
    NoReplicas,
    #[error("--lease-keys-file {path}: {error}")]
    LeaseKeys { path: PathBuf, error: crate::engine::hold::TokenKeysError },
}

/// A backend and the memory store that holds local fallback state (the same store when the
/// backend is memory).
pub struct BuiltBackend {
    pub backend: Backend,
    pub memory: Arc<MemoryStore>,
}

impl StoreArgs {
    /// The hold token keys of --lease-keys-file; `None` without it.
    pub fn lease_keys(&self) -> Result<Option<crate::engine::hold::TokenKeys>, BackendError> {
        let Some(path) = &self.lease_keys_file else { return Ok(None) };
        let text = std::fs::read_to_string(path).map_err(|error| BackendError::File { path: path.clone(), error })?;
        crate::engine::hold::TokenKeys::parse(&text)
            .map(Some)
            .map_err(|error| BackendError::LeaseKeys { path: path.clone(), error })
    }

    pub fn uses_redis(&self) -> bool {
        self.redis.is_some() || !self.redis_cluster.is_empty() || !self.redis_sentinel.is_empty()
    }

    /// Builds the store; Redis need not be up (connections are lazy and retried).
    pub async fn build(&self, clock: Arc<dyn Clock>) -> Result<BuiltBackend, BackendError> {
        if self.fallback_replicas == 0 {
            return Err(BackendError::NoReplicas);
        }
        let memory = Arc::new(MemoryStore::with_clock(self.max_keys, clock.clone()));
        let password = self.password()?;
        let user = self.redis_username.as_deref();
        let credentials = |url: &String| with_credentials(url, user, password.as_deref());
        for url in self.redis.iter().chain(&self.redis_cluster).chain(&self.redis_sentinel) {
            if UrlParts::of(url).and_then(|p| p.userinfo).is_some_and(|u| u.contains(':')) {
                tracing::warn!(
                    url = %redact_url(url),
                    "a password in a Redis URL shows in the process list and the pod spec: give it with --redis-password-file (a mounted Secret) instead"
                );
            }
        }
        let endpoint = if let Some(url) = &self.redis {
            RedisEndpoint::Single(credentials(url))
        } else if !self.redis_cluster.is_empty() {
            RedisEndpoint::Cluster(self.redis_cluster.iter().map(credentials).collect())
        } else if !self.redis_sentinel.is_empty() {
            let sentinel_password = self.redis_sentinel_password_file.as_ref().map(read_secret).transpose()?;
            RedisEndpoint::Sentinel(SentinelEndpoint {
                sentinels: self
                    .redis_sentinel
                    .iter()
                    .map(|u| with_credentials(u, None, sentinel_password.as_deref()))
                    .collect(),
                master: self.redis_sentinel_master.clone(),
                username: self.redis_username.clone(),
                password,
            })
        } else {
            return Ok(BuiltBackend { backend: Backend::Memory(memory.clone()), memory });
        };
        let mut config = RedisConfig::new(endpoint);
        config.timeout = self.redis_timeout;
        config.denial_cache = self.redis_denial_cache;
        config.batches = self.redis_batches;
        config.namespace_lane = self.redis_namespace_lane;
        config.usage_interval = Some(self.redis_usage_interval).filter(|every| !every.is_zero());
        config.namespace_max_keys = self.redis_namespace_max_keys;
        config.breaker = BreakerConfig {
            failure_threshold: self.redis_breaker_failures.max(1),
            cool_down: self.redis_breaker_cooldown,
        };
        if let Some(path) = &self.redis_ca_file {
            config.tls_root_ca = Some(read_file(path)?);
        }
        if let (Some(certificate), Some(key)) = (&self.redis_client_cert_file, &self.redis_client_key_file) {
            config.tls_client = Some(TlsClient { certificate: read_file(certificate)?, key: read_file(key)? });
        }
        let redis = RedisStore::connect_with_clock(config, clock).await?;
        if let Some(reason) = redis.probe(Duration::from_secs(2)).await? {
            tracing::error!(
                endpoint = %redis.endpoint(),
                %reason,
                "Redis does not answer: /readyz stays 503 and each rule's onStoreFailure decides until it does"
            );
            redis.await_first_answer(reason, Duration::from_secs(1));
        } else {
            for concern in redis.memory_settings(Duration::from_secs(2)).await {
                tracing::warn!(endpoint = %redis.endpoint(), "{concern}");
            }
        }
        Ok(BuiltBackend { backend: Backend::Redis(Box::new(redis)), memory })
    }

    fn password(&self) -> Result<Option<String>, BackendError> {
        if let Some(path) = &self.redis_password_file {
            return read_secret(path).map(Some);
        }
        Ok(std::env::var("SLUICE_REDIS_PASSWORD").ok().filter(|p| !p.is_empty()))
    }
}

fn read_file(path: &PathBuf) -> Result<Vec<u8>, BackendError> {
    std::fs::read(path).map_err(|error| BackendError::File { path: path.clone(), error })
}

/// A password file's content without its final line break (a Secret mounted from `echo`).
fn read_secret(path: &PathBuf) -> Result<String, BackendError> {
    let text = std::fs::read_to_string(path).map_err(|error| BackendError::File { path: path.clone(), error })?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_go_into_the_url_unless_it_has_them() {
        assert_eq!(with_credentials("redis://h:6379/0", None, Some("p@ss w")), "redis://:p%40ss%20w@h:6379/0");
        assert_eq!(with_credentials("redis://u:x@h:6379", Some("v"), Some("p")), "redis://u:x@h:6379");
        assert_eq!(with_credentials("rediss://h", None, None), "rediss://h");
        assert_eq!(with_credentials("redis://h", Some("sluice"), Some("p")), "redis://sluice:p@h");
        assert_eq!(with_credentials("redis://h", Some("sluice"), None), "redis://sluice@h");
        // A URL naming its user takes the password from the file.
        assert_eq!(with_credentials("redis://sluice@h", Some("other"), Some("p")), "redis://sluice:p@h");
    }
}
