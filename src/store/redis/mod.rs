//! The shared store: per-key state in Redis (a single server or a Redis Cluster), every request
//! decided by one Lua script call.
//!
//! One call per request, whatever the number of rules: the script (lua/check.lua) decides every
//! rule read-only, and consumes in all of them only when every enforcing rule admits the request.
//! All of a request's keys share a hash tag (the namespace, see [`super::keys`]) so the call is
//! legal on a cluster. The decision code is a Redis Functions library (FUNCTION LOAD once, FCALL
//! per decision): the module definitions run once per server instead of on every call, which is
//! most of a script's cost. The library and its function are named after a hash of their code, so
//! replicas of two Sluice versions on one Redis (a rolling upgrade) each call their own. When
//! Redis answers that the function is missing (a restart without persistence, a failover to a
//! node that never saw it, FUNCTION FLUSH) the library is loaded and the call repeated; a Redis
//! without Functions (before 7.0) gets the same code as an EVALSHA script, NOSCRIPT reloading it.
//!
//! Failure handling stops at an error: each call has a deadline ([`StoreError::Timeout`]) and a
//! circuit breaker fails calls at once while Redis is known to be down
//! ([`StoreError::Unavailable`]). Applying each rule's `on_store_failure` to that error is the
//! caller's job, since only the caller has the local fallback store. The breaker runs on the
//! injected [`Clock`]; the decisions themselves use Redis `TIME` (or the `now` passed in).

mod batches;
pub mod codec;
mod config;
pub mod library;
mod primary;
mod queue;
mod setup;
pub mod url;
pub mod usage;

use self::codec::{
    classify, lease_args, parse_lease_reply, parse_reply, refuses_us, rule_params, script_args, value_kind,
};
pub use self::config::{RedisConfig, RedisConfigError, RedisEndpoint, TlsClient, memory_concerns};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{RedisError, Script, Value};

use self::batches::{Batches, Decide, Outcome};
use self::library::{
    CANCEL_FUNCTION_NAME, CANCEL_SCRIPT_SOURCE, DEFERRED_FUNCTION_NAME, DEFERRED_SCRIPT_SOURCE, FUNCTION_NAME,
    LEASE_FUNCTION_NAME, LEASE_SCRIPT_SOURCE, LIBRARY_SOURCE, SCRIPT_SOURCE, SETTLE_FUNCTION_NAME,
    SETTLE_SCRIPT_SOURCE,
};
use self::library::{function_missing, functions_unsupported};
pub use self::primary::SentinelEndpoint;
use self::primary::{Followed, Primary};
use self::setup::{HandshakeRefusal, replay_handshake, scheme_problem};
use self::url::redact_url;
use self::usage::{Usage, count_cluster, count_single};
use super::breaker::Transition;
use super::denials::DenialCache;
use super::keys::{self, DEFAULT_TAG};
use super::tenants::{Tenants, overall_breaker};
use super::{RuleCheck, Store, StoreError};
use crate::algorithm::{Algorithm, Micros};
use crate::clock::{Clock, SystemClock};
use crate::rule::Verdict;

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(&SCRIPT_SOURCE));
static SETTLE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(&SETTLE_SCRIPT_SOURCE));
static LEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(&LEASE_SCRIPT_SOURCE));
static CANCEL_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(&CANCEL_SCRIPT_SOURCE));
static DEFERRED_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(&DEFERRED_SCRIPT_SOURCE));

#[derive(Clone)]
enum Connection {
    /// Multiplexed: concurrent decisions are pipelined over one socket; reconnects by itself
    /// (and, behind Sentinels, follows the master).
    Single(Primary),
    /// Connected on first use (and again after a failed first use), so the process starts while
    /// the cluster is down; afterwards the cluster connection re-routes and reconnects by itself.
    Cluster(Arc<ClusterState>),
}

struct ClusterState {
    client: ClusterClient,
    connection: tokio::sync::OnceCell<ClusterConnection>,
}

pub struct RedisStore {
    connection: Connection,
    /// Cleared for good once Redis says it has no Functions (before 7.0): scripts from then on.
    functions: Arc<std::sync::atomic::AtomicBool>,
    /// On a single Redis with `batches` > 0: concurrent requests share calls.
    batches: Option<Arc<Batches>>,
    denials: DenialCache,
    /// Each namespace's breaker and lane.
    tenants: Arc<Tenants>,
    /// Keys per namespace in Redis, and their bound.
    usage: Arc<Usage>,
    /// Keys are counted per namespace (`--redis-usage-interval` is not 0).
    counts_usage: bool,
    /// Counts `usage` (and follows a Sentinel master) in the background; stopped with the store.
    background: Vec<tokio::task::JoinHandle<()>>,
    /// The breakers' time (their cool-down).
    clock: Arc<dyn Clock>,
    timeout: Duration,
    endpoint: String,
    /// Why Redis has not answered since start; `None` once it has ([`Self::not_answered_yet`]).
    first_answer: Arc<std::sync::Mutex<Option<String>>>,
    /// A URL (with its credentials: never shown) and TLS to repeat the handshake with when it
    /// fails at start-up, to name what Redis refused ([`replay_handshake`]); not behind Sentinels,
    /// where the master is found later.
    handshake: Option<(String, Option<::redis::TlsCertificates>)>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("endpoint", &self.endpoint)
            .field("timeout", &self.timeout)
            .field("breaker", &self.breaker_state())
            .finish()
    }
}

impl RedisStore {
    /// Prepares the store. Connections are made lazily and re-made in the background, so this
    /// succeeds while Redis is down (decisions then fail until it is back); it fails only on an
    /// unusable configuration (a malformed URL). Must run inside a Tokio runtime.
    pub async fn connect(config: RedisConfig) -> Result<RedisStore, RedisConfigError> {
        RedisStore::connect_with_clock(config, Arc::new(SystemClock)).await
    }

    /// [`RedisStore::connect`] with the breaker on `clock` (the process's clock, or a test's).
    pub async fn connect_with_clock(
        config: RedisConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<RedisStore, RedisConfigError> {
        let endpoint = config.endpoint.redacted();
        // Only the error's category: its detail may echo the URL, password included.
        let invalid =
            |e: RedisError| RedisConfigError::Invalid { endpoint: endpoint.clone(), reason: e.category().to_string() };
        // redis's rustls needs a process-wide crypto provider; without one the first TLS
        // handshake panics. Keep one the embedding program installed.
        if rustls::crypto::CryptoProvider::get_default().is_none() {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let client_tls = config
            .tls_client
            .as_ref()
            .map(|c| ::redis::ClientTlsConfig { client_cert: c.certificate.clone(), client_key: c.key.clone() });
        let certificates =
            || ::redis::TlsCertificates { client_tls: client_tls.clone(), root_cert: config.tls_root_ca.clone() };
        let custom_tls = config.tls_root_ca.is_some() || config.tls_client.is_some();
        let urls: Vec<&String> = match &config.endpoint {
            RedisEndpoint::Single(url) => vec![url],
            RedisEndpoint::Cluster(urls) => urls.iter().collect(),
            RedisEndpoint::Sentinel(endpoint) => endpoint.sentinels.iter().collect(),
        };
        // The client's own answer is "invalid client config", naming nothing.
        for url in &urls {
            if let Some(reason) = scheme_problem(url) {
                return Err(RedisConfigError::Invalid { endpoint: redact_url(url), reason });
            }
        }
        let handshake = match &config.endpoint {
            RedisEndpoint::Sentinel(_) => None,
            _ => urls.first().map(|url| (url.to_string(), custom_tls.then(certificates))),
        };
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            // Retry a lost connection quickly a few times; a call arriving after the
            // retries gave up starts a new round, so recovery needs no restart.
            .set_number_of_retries(3)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(500));
        let mut background = Vec::new();
        let connection = match &config.endpoint {
            RedisEndpoint::Single(url) => {
                let client = match custom_tls {
                    true => ::redis::Client::build_with_tls(url.as_str(), certificates()),
                    false => ::redis::Client::open(url.as_str()),
                }
                .map_err(invalid)?;
                Connection::Single(Primary::Fixed(
                    ConnectionManager::new_lazy_with_config(client, manager_config).map_err(invalid)?,
                ))
            }
            RedisEndpoint::Sentinel(endpoint) => {
                let followed =
                    Arc::new(Followed::new(endpoint, custom_tls.then(certificates), manager_config).map_err(invalid)?);
                background.extend(followed.follow_in_background());
                Connection::Single(Primary::Followed(followed))
            }
            RedisEndpoint::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(RedisConfigError::NoClusterNodes);
                }
                let mut builder = ClusterClient::builder(urls.iter().map(String::as_str))
                    .connection_timeout(config.connect_timeout)
                    .retries(2);
                if custom_tls {
                    builder = builder.certs(certificates());
                }
                let client = builder.build().map_err(invalid)?;
                Connection::Cluster(Arc::new(ClusterState { client, connection: Default::default() }))
            }
        };
        let functions = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let tenants = Arc::new(Tenants::new(config.breaker, config.namespace_lane));
        let usage = Arc::new(Usage::new(config.namespace_max_keys));
        let batches = match &connection {
            Connection::Single(primary) if config.batches > 0 => {
                Some(Arc::new(batches::batches(primary.clone(), functions.clone(), config.batches, config.timeout)))
            }
            _ => None,
        };
        if let Some(every) = config.usage_interval {
            background.push(tokio::spawn(count_usage(connection.clone(), tenants.clone(), usage.clone(), every)));
        }
        Ok(RedisStore {
            connection,
            functions,
            batches,
            denials: DenialCache::new(config.denial_cache),
            background,
            counts_usage: config.usage_interval.is_some(),
            tenants,
            usage,
            clock,
            timeout: config.timeout,
            endpoint,
            first_answer: Arc::default(),
            handshake,
        })
    }

    /// The endpoint with any password redacted.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// For metrics and status: `closed`, `open` when any namespace's breaker is open, or
    /// `halfOpen` when one is probing.
    pub fn breaker_state(&self) -> &'static str {
        overall_breaker(&self.tenants.open_breakers(self.clock.now()))
    }

    /// Decides `checks` atomically in the cluster slot of `tag` (the request's namespace).
    ///
    /// `now` is `None` in production (Redis `TIME`, one clock for every replica); conformance
    /// tests pass a time.
    pub async fn check_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> Result<Verdict, StoreError> {
        if checks.is_empty() {
            return Ok(Verdict { allowed: true, decisions: Vec::new(), cached_denial: None, at: None });
        }
        let keys: Vec<Vec<u8>> = checks.iter().map(|check| keys::state_key(tag, check.rule, check.key)).collect();
        // The denial cache's time: when the call is sent, never later than when Redis decides.
        let sent_at = now.unwrap_or_else(|| self.clock.now());
        if let Some(verdict) = self.denials.answer(&keys, checks, sent_at) {
            return Ok(verdict);
        }
        if self.usage.max_keys() > 0
            && let Some(held) = self.usage.over_bound(&keys::hash_tag(tag))
        {
            return Err(StoreError::OverBound(format!(
                "the namespace holds {held} keys in Redis, at or over --redis-namespace-max-keys {}",
                self.usage.max_keys()
            )));
        }
        let tenant = self.tenants.of(tag, self.clock.now());
        let Some(permit) = tenant.breaker.try_acquire(self.clock.now()) else {
            return Err(StoreError::Unavailable("circuit breaker open".into()));
        };
        // Waiting for its namespace's lane is not the store's time: the deadline starts after.
        // A full lane drops the permit unreported: no failure is counted, a probe slot is freed.
        let _lane = tenant.enter(checks.len(), self.timeout).await?;
        let args = script_args(now, checks);
        let call = async {
            let batches = self.batches.as_ref().filter(|_| self.functions.load(std::sync::atomic::Ordering::Relaxed));
            let args = match batches {
                // The keys stay here too: the denial cache records the verdict under them.
                Some(batches) => match batches::decide(batches, Decide { keys: keys.clone(), args }).await {
                    Outcome::Reply(reply) => return Ok(reply),
                    Outcome::Failed(error) => return Err(error),
                    Outcome::Unbatched(request) => request.args,
                },
                None => args,
            };
            self.decide(&keys, &args).await
        };
        match tokio::time::timeout(self.timeout, call).await {
            Err(_elapsed) => {
                let error = StoreError::Timeout(self.timeout.as_millis() as u64);
                self.tell(tag, permit.failure(self.clock.now()), &error);
                Err(error)
            }
            Ok(Err(error)) => {
                let (error, store_down) = classify(&error);
                let transition = if store_down {
                    permit.failure(self.clock.now())
                } else {
                    // Redis answered: it is up, whatever went wrong with this call.
                    permit.success(self.clock.now())
                };
                self.tell(tag, transition, &error);
                tracing::debug!(endpoint = %self.endpoint, %error, "redis decision failed");
                Err(error)
            }
            Ok(Ok(reply)) => {
                self.tell(tag, permit.success(self.clock.now()), &StoreError::Unavailable(String::new()));
                let verdict = parse_reply(&reply, checks.len())?;
                self.denials.record(&keys, checks, &verdict, sent_at);
                Ok(verdict)
            }
        }
    }
}

impl RedisStore {
    /// Settles `hold`'s holds under each of `settles`, in the slot of `tag` (see `settle` in
    /// lua/check.lua). Like a decision, it goes through the namespace's breaker and lane (one
    /// place in the lane per key), within the store's deadline: settles are a tenant's store
    /// work like its checks, so a flood of them slows or fails that tenant alone. Returns how
    /// many holds were found.
    pub async fn settle_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        settles: &[super::Settle<'_>],
        hold: crate::algorithm::HoldId,
    ) -> Result<u64, StoreError> {
        if settles.is_empty() || hold == 0 {
            return Ok(0);
        }
        let keys: Vec<Vec<u8>> = settles.iter().map(|s| keys::state_key(tag, s.rule, s.key)).collect();
        let mut args = Vec::with_capacity(2 + 3 * settles.len());
        args.push(now.map_or_else(String::new, |n| n.to_string()));
        args.push(hold.to_string());
        for settle in settles {
            args.push(rule_params(settle.limit, true));
            args.push(settle.reserved.to_string());
            args.push(settle.cost.to_string());
        }
        self.count_in_lane(tag, &SETTLE_FUNCTION_NAME, &SETTLE_SCRIPT, &keys, &args, "settle").await
    }

    /// Gives back the shaped slots of `cancels` in the slot of `tag` (see `cancel` in
    /// lua/check.lua), through the namespace's breaker and lane like a settle. Returns how many
    /// went back.
    pub async fn cancel_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        cancels: &[super::Cancel<'_>],
    ) -> Result<u64, StoreError> {
        if cancels.is_empty() {
            return Ok(0);
        }
        let keys: Vec<Vec<u8>> = cancels.iter().map(|c| keys::state_key(tag, c.rule, c.key)).collect();
        let mut args = Vec::with_capacity(1 + 3 * cancels.len());
        args.push(now.map_or_else(String::new, |n| n.to_string()));
        for cancel in cancels {
            args.push(rule_params(cancel.limit, true));
            args.push(cancel.cost.to_string());
            args.push(cancel.until.to_string());
        }
        self.count_in_lane(tag, &CANCEL_FUNCTION_NAME, &CANCEL_SCRIPT, &keys, &args, "cancel").await
    }

    /// Runs a call answering a count (`settle`, `cancel`) through the namespace's breaker and
    /// lane (one place per key), within the store's deadline.
    async fn count_in_lane(
        &self,
        tag: &str,
        function: &str,
        script: &Script,
        keys: &[Vec<u8>],
        args: &[String],
        what: &str,
    ) -> Result<u64, StoreError> {
        match self.in_lane(tag, function, script, keys, args).await? {
            Value::Int(found) => Ok(found.max(0) as u64),
            other => Err(StoreError::Protocol(format!("{what} answered {}", value_kind(&other)))),
        }
    }

    /// Runs a call through the namespace's breaker and lane (one place per key), within the
    /// store's deadline. A reply that is no error counts as Redis answering, whatever it says.
    async fn in_lane<A: ::redis::ToRedisArgs + Sync>(
        &self,
        tag: &str,
        function: &str,
        script: &Script,
        keys: &[Vec<u8>],
        args: &[A],
    ) -> Result<Value, StoreError> {
        let tenant = self.tenants.of(tag, self.clock.now());
        let Some(permit) = tenant.breaker.try_acquire(self.clock.now()) else {
            return Err(StoreError::Unavailable("circuit breaker open".into()));
        };
        let _lane = tenant.enter(keys.len(), self.timeout).await?;
        let outcome = tokio::time::timeout(self.timeout, self.call(function, script, keys, args)).await;
        let (result, transition) = match outcome {
            Err(_) => {
                let error = StoreError::Timeout(self.timeout.as_millis() as u64);
                (Err(error), permit.failure(self.clock.now()))
            }
            Ok(Err(error)) => {
                let (error, store_down) = classify(&error);
                let now = self.clock.now();
                (Err(error), if store_down { permit.failure(now) } else { permit.success(now) })
            }
            Ok(Ok(value)) => (Ok(value), permit.success(self.clock.now())),
        };
        let reported = match &result {
            Err(error) => error.clone(),
            Ok(_) => StoreError::Unavailable(String::new()),
        };
        self.tell(tag, transition, &reported);
        result
    }

    /// Runs a holder's quota-lease operations in the slot of `tag` (see `lease` in
    /// lua/check.lua). Bounded by the store's deadline and, like decisions, by the namespace's
    /// breaker: a holder whose store is down spends what it holds, then its rules'
    /// `onStoreFailure` decide.
    pub async fn lease_tagged(
        &self,
        tag: &str,
        now: Option<Micros>,
        ops: &[super::LeaseOp<'_>],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, StoreError> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<Vec<u8>> = ops.iter().map(|op| keys::state_key(tag, op.rule, op.key)).collect();
        let tenant = self.tenants.of(tag, self.clock.now());
        let Some(permit) = tenant.breaker.try_acquire(self.clock.now()) else {
            return Err(StoreError::Unavailable("circuit breaker open".into()));
        };
        let _lane = tenant.enter(ops.len(), self.timeout).await?;
        let args = lease_args(now, ops);
        let outcome =
            tokio::time::timeout(self.timeout, self.call(&LEASE_FUNCTION_NAME, &LEASE_SCRIPT, &keys, &args)).await;
        let reply = match outcome {
            Err(_) => {
                let error = StoreError::Timeout(self.timeout.as_millis() as u64);
                self.tell(tag, permit.failure(self.clock.now()), &error);
                return Err(error);
            }
            Ok(Err(error)) => {
                let (error, store_down) = classify(&error);
                let now = self.clock.now();
                self.tell(tag, if store_down { permit.failure(now) } else { permit.success(now) }, &error);
                return Err(error);
            }
            Ok(Ok(reply)) => {
                self.tell(tag, permit.success(self.clock.now()), &StoreError::Unavailable(String::new()));
                reply
            }
        };
        parse_lease_reply(&reply, ops.len())
    }

    /// Says so in the log when the breaker opens (the store just became unusable: every rule's
    /// `onStoreFailure` decides now) or closes again; metrics and `/v1/snapshot` show the state,
    /// but someone reading the log must not have to guess.
    fn tell(&self, namespace: &str, transition: Option<Transition>, error: &StoreError) {
        match transition {
            Some(Transition::Opened) => tracing::error!(
                endpoint = %self.endpoint,
                namespace,
                %error,
                "redis is unusable for this namespace: its circuit breaker is open, each of its rules' onStoreFailure decides until redis answers again"
            ),
            Some(Transition::Closed) => {
                tracing::warn!(endpoint = %self.endpoint, namespace, "redis answers again: the namespace's circuit breaker closed")
            }
            None => {}
        }
    }

    /// Asks Redis once at start-up, within `within`: Ok when it answers and lets Sluice do its
    /// work; `Err(Refused)` when it refuses our credentials or a permission (a configuration
    /// mistake that would fail every decision: better a clear error now than shared limits
    /// silently lost); otherwise Ok with the reason it did not answer (it may come up later:
    /// rules use onStoreFailure meanwhile, and the caller says so).
    ///
    /// The permissions are tried by doing the work: one decision of every algorithm (and a
    /// reservation) on probe keys, and the settle of its holds, runs every command the decision
    /// code runs under the ACL user's key pattern, and loads the library if Redis lacks it; then
    /// the key count's SCAN on a single Redis. Probe keys live for a second.
    pub async fn probe(&self, within: Duration) -> Result<Option<String>, RedisConfigError> {
        let refused = |error: &RedisError| {
            refuses_us(error).then(|| RedisConfigError::Refused {
                endpoint: self.endpoint.clone(),
                reason: match error.code() {
                    Some("NOAUTH" | "WRONGPASS") => error.to_string(),
                    _ => format!("the ACL user lacks a permission Sluice's decisions need ({error})"),
                },
            })
        };
        let work = async {
            self.query(&::redis::cmd("PING")).await?;
            self.try_every_command().await?;
            if matches!(self.connection, Connection::Single(_)) && self.counts_usage {
                let mut scan = ::redis::cmd("SCAN");
                scan.arg(0).arg("MATCH").arg(format!("{}{{sluice:probe}}*", keys::PREFIX)).arg("COUNT").arg(1);
                self.query(&scan).await?;
            }
            Ok::<(), RedisError>(())
        };
        match tokio::time::timeout(within, work).await {
            Ok(Ok(())) => Ok(None),
            Ok(Err(error)) => {
                if let Some(refusal) = self.handshake_refusal(&error).await {
                    return Err(RedisConfigError::Handshake {
                        endpoint: self.endpoint.clone(),
                        reason: refusal.describe(),
                    });
                }
                match refused(&error) {
                    Some(refusal) => Err(refusal),
                    None => Ok(Some(error.to_string())),
                }
            }
            Err(_) => Ok(Some(format!("no answer within {within:?}"))),
        }
    }

    /// What the connection's handshake was refused, if it was (see [`HandshakeRefusal`]): with
    /// Redis's own words about the credentials where a second handshake can get them.
    async fn handshake_refusal(&self, error: &RedisError) -> Option<HandshakeRefusal> {
        let url = self.handshake.as_ref().map(|(url, _)| url.as_str());
        let refusal = HandshakeRefusal::of(error, url)?;
        if let (HandshakeRefusal::Credentials(_), Some((url, tls))) = (&refusal, &self.handshake)
            && let Some(words) = replay_handshake(url, tls.clone(), Duration::from_secs(1)).await
        {
            return Some(HandshakeRefusal::Credentials(words));
        }
        Some(refusal)
    }

    /// One decision of every algorithm and a reservation, then their settle (see [`Self::probe`]).
    async fn try_every_command(&self) -> Result<(), RedisError> {
        use crate::algorithm::Limit;
        use crate::duration::MICROS_PER_SECOND;
        let limit = |algorithm| Limit::new(algorithm, 1000, MICROS_PER_SECOND, None, None);
        let mut limits: Vec<Limit> = Algorithm::EVERY.iter().filter_map(|&a| limit(a).ok()).collect();
        limits.extend(limit(Algorithm::TokenBucket).and_then(|l| l.reserving(MICROS_PER_SECOND)));
        let hold: crate::algorithm::HoldId = 1 + u64::from(std::process::id());
        let checks: Vec<RuleCheck<'_>> = limits
            .iter()
            .enumerate()
            .map(|(rule, limit)| RuleCheck {
                rule: rule as u64 + 1,
                limit,
                key: b"probe",
                cost: 1,
                enforce: true,
                hold: if limit.holds() { hold } else { 0 },
            })
            .collect();
        let keys: Vec<Vec<u8>> = checks.iter().map(|c| keys::state_key(keys::PROBE_TAG, c.rule, c.key)).collect();
        self.decide(&keys, &script_args(None, &checks)).await?;
        let mut args = vec![String::new(), hold.to_string()];
        for check in &checks {
            // Reserved 1 at admission (cost 1), settled to 1.
            args.push(rule_params(check.limit, true));
            args.push("1".into());
            args.push("1".into());
        }
        self.call(&SETTLE_FUNCTION_NAME, &SETTLE_SCRIPT, &keys, &args).await?;
        // A quota lease granted and returned, as an enforcer does.
        if let Some(leased) = limit(Algorithm::FixedWindow).ok().and_then(|l| l.leasing().ok()) {
            let ask = crate::algorithm::lease::LeaseAsk { hold, want: 1, cap: 1, ttl: MICROS_PER_SECOND };
            let op = |settle, ask| super::LeaseOp { rule: 99, limit: &leased, key: b"probe", settle, ask };
            let keys = vec![keys::state_key(keys::PROBE_TAG, 99, b"probe")];
            self.call(&LEASE_FUNCTION_NAME, &LEASE_SCRIPT, &keys, &lease_args(None, &[op(None, Some(ask))])).await?;
            self.call(&LEASE_FUNCTION_NAME, &LEASE_SCRIPT, &keys, &lease_args(None, &[op(Some((hold, 0)), None)]))
                .await?;
        }
        // A shaped slot given back, as a sidecar whose caller left does (a write: SET).
        if let Ok(shaper) = Limit::new(Algorithm::LeakyBucket, 1000, MICROS_PER_SECOND, None, Some(MICROS_PER_SECOND)) {
            let keys = vec![keys::state_key(keys::PROBE_TAG, 98, b"probe")];
            let decided = self
                .decide(
                    &keys,
                    &script_args(
                        None,
                        &[RuleCheck { rule: 98, limit: &shaper, key: b"probe", cost: 1, enforce: true, hold: 0 }],
                    ),
                )
                .await?;
            let until =
                parse_reply(&decided, 1).ok().and_then(|v| Some(v.at? + v.decisions.first()?.reset_after)).unwrap_or(0);
            let args = vec![String::new(), rule_params(&shaper, true), "1".into(), until.to_string()];
            self.call(&CANCEL_FUNCTION_NAME, &CANCEL_SCRIPT, &keys, &args).await?;
        }
        Ok(())
    }

    /// What is wrong with Redis's memory settings for rate limiting, read at start-up (`CONFIG
    /// GET`; on a cluster, of the node that answers): each concern a sentence for the log.
    pub async fn memory_settings(&self, within: Duration) -> Vec<String> {
        let mut get = ::redis::cmd("CONFIG");
        get.arg("GET").arg("maxmemory*");
        let reply = match tokio::time::timeout(within, self.query(&get)).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(error)) => {
                return vec![format!(
                    "cannot read Redis's memory settings ({error}): check that maxmemory-policy is volatile-ttl or noeviction (docs/security.md, \"Redis memory\")"
                )];
            }
            Err(_) => return Vec::new(),
        };
        let settings: std::collections::HashMap<String, String> = ::redis::from_redis_value(reply).unwrap_or_default();
        memory_concerns(
            settings.get("maxmemory").map(String::as_str).unwrap_or("0"),
            settings.get("maxmemory-policy").map(String::as_str).unwrap_or("noeviction"),
            self.usage.max_keys(),
        )
    }

    /// One decision call (see [`Self::call`]).
    async fn decide(&self, keys: &[Vec<u8>], args: &[String]) -> Result<Value, RedisError> {
        self.call(&FUNCTION_NAME, &SCRIPT, keys, args).await
    }

    /// One call of the library's `function`: FCALL, loading the library when Redis lacks it;
    /// `script` by EVALSHA on a Redis without Functions.
    async fn call<A: ::redis::ToRedisArgs + Sync>(
        &self,
        function: &str,
        script: &Script,
        keys: &[Vec<u8>],
        args: &[A],
    ) -> Result<Value, RedisError> {
        use std::sync::atomic::Ordering;
        if self.functions.load(Ordering::Relaxed) {
            let mut fcall = ::redis::cmd("FCALL");
            fcall.arg(function).arg(keys.len()).arg(keys).arg(args);
            match self.query(&fcall).await {
                Err(error) if function_missing(&error) => {
                    let mut load = ::redis::cmd("FUNCTION");
                    load.arg("LOAD").arg("REPLACE").arg(&*LIBRARY_SOURCE);
                    self.query(&load).await?;
                    return self.query(&fcall).await;
                }
                Err(error) if functions_unsupported(&error) => {
                    tracing::warn!(endpoint = %self.endpoint, "Redis has no Functions (before 7.0): deciding by EVALSHA");
                    self.functions.store(false, Ordering::Relaxed);
                }
                result => return result,
            }
        }
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(key);
        }
        for arg in args {
            invocation.arg(arg);
        }
        match &self.connection {
            Connection::Single(primary) => {
                let result = invocation.invoke_async::<Value>(&mut primary.manager().await?).await;
                primary.heard(&result);
                result
            }
            Connection::Cluster(cluster) => invocation.invoke_async::<Value>(&mut self.cluster(cluster).await?).await,
        }
    }

    async fn cluster(&self, cluster: &ClusterState) -> Result<ClusterConnection, RedisError> {
        cluster.connect().await
    }

    /// Sends `command`: on a cluster to the node of its keys (FUNCTION LOAD: to every master).
    async fn query(&self, command: &::redis::Cmd) -> Result<Value, RedisError> {
        self.connection.query(command).await
    }

    /// Why Redis has not answered since start (`None` once it has): `/readyz` stays 503 with it,
    /// so a misconfigured Redis stops a rollout instead of passing every decision to
    /// `onStoreFailure` unnoticed.
    pub fn not_answered_yet(&self) -> Option<String> {
        self.first_answer.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records that Redis did not answer at start (`reason`), and asks again every `every` until
    /// it does: then the reason is cleared and the log says so, once. A refusal of the
    /// credentials or a permission is logged as the error it is.
    pub fn await_first_answer(&self, reason: String, every: Duration) {
        *self.first_answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
        let (connection, first_answer, endpoint) =
            (self.connection.clone(), self.first_answer.clone(), self.endpoint.clone());
        tokio::spawn(async move {
            let mut logged_refusal = false;
            loop {
                tokio::time::sleep(every).await;
                let reason = match tokio::time::timeout(every, connection.query(&::redis::cmd("PING"))).await {
                    Ok(Ok(_)) => {
                        *first_answer.lock().unwrap_or_else(|e| e.into_inner()) = None;
                        tracing::info!(%endpoint, "Redis answers: decisions are shared from now on");
                        return;
                    }
                    Ok(Err(error)) => {
                        if !logged_refusal {
                            if let Some(refusal) = HandshakeRefusal::of(&error, None) {
                                logged_refusal = true;
                                tracing::error!(%endpoint, error = refusal.describe(), "Redis refuses Sluice's configuration");
                            } else if refuses_us(&error) {
                                logged_refusal = true;
                                tracing::error!(%endpoint, %error, "Redis refuses Sluice's credentials or permissions");
                            }
                        }
                        error.to_string()
                    }
                    Err(_) => format!("no answer within {every:?}"),
                };
                *first_answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
            }
        });
    }
}

impl Connection {
    /// Sends `command`: on a cluster to the node of its keys (FUNCTION LOAD: to every master).
    async fn query(&self, command: &::redis::Cmd) -> Result<Value, RedisError> {
        match self {
            Connection::Single(primary) => primary.query(command).await,
            Connection::Cluster(cluster) => command.query_async(&mut cluster.connect().await?).await,
        }
    }
}

impl ClusterState {
    async fn connect(&self) -> Result<ClusterConnection, RedisError> {
        Ok(self.connection.get_or_try_init(|| self.client.get_async_connection()).await?.clone())
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        for task in &self.background {
            task.abort();
        }
    }
}

/// Counts keys per namespace into `usage` now and every `every` ([`self::usage`]).
async fn count_usage(connection: Connection, tenants: Arc<Tenants>, usage: Arc<Usage>, every: Duration) {
    loop {
        let counted = match &connection {
            Connection::Single(primary) => match primary.manager().await {
                Ok(manager) => count_single(&manager).await,
                Err(error) => Err(error),
            },
            Connection::Cluster(cluster) => {
                match cluster.connection.get_or_try_init(|| cluster.client.get_async_connection()).await {
                    Ok(connection) => {
                        let tags: Vec<String> = tenants.namespaces().iter().map(|n| keys::hash_tag(n)).collect();
                        count_cluster(connection, &tags).await
                    }
                    Err(error) => Err(error),
                }
            }
        };
        match counted {
            Ok(counts) => usage.replace(counts),
            // Redis down or the command refused (an ACL without SCAN): the decisions say more.
            Err(error) => tracing::debug!(%error, "cannot count keys per namespace"),
        }
        tokio::time::sleep(every).await;
    }
}

impl Store for RedisStore {
    fn check(
        &self,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        self.check_tagged(DEFAULT_TAG, now, checks)
    }

    /// The namespace is the request's hash tag: one slot, one script, every rule.
    fn check_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        checks: &[RuleCheck<'_>],
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        self.check_tagged(namespace, now, checks)
    }

    async fn cancel_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        cancels: &[super::Cancel<'_>],
    ) -> Result<u64, StoreError> {
        self.cancel_tagged(namespace, now, cancels).await
    }

    async fn defer_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        deferral: &super::queue::Deferral<'_>,
    ) -> Result<super::queue::Queued, StoreError> {
        self.defer_tagged(namespace, now, deferral).await
    }

    async fn claim_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        claim: &super::queue::Claim<'_>,
    ) -> Result<super::queue::Claimed, StoreError> {
        self.claim_tagged(namespace, now, claim).await
    }

    async fn finish_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        finish: &super::queue::Finish<'_>,
    ) -> Result<super::queue::Finished, StoreError> {
        self.finish_tagged(namespace, now, finish).await
    }

    async fn entry_status_for(
        &self,
        namespace: &str,
        rule: crate::rule::RuleId,
        id: &str,
        token: &str,
    ) -> Result<Option<super::queue::EntryStatus>, StoreError> {
        self.entry_status_tagged(namespace, rule, id, token).await
    }

    async fn queue_stats_for(
        &self,
        namespace: &str,
        rule: crate::rule::RuleId,
    ) -> Result<super::queue::QueueStats, StoreError> {
        self.queue_stats_tagged(namespace, rule).await
    }

    async fn settle_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        settles: &[super::Settle<'_>],
        hold: crate::algorithm::HoldId,
    ) -> Result<u64, StoreError> {
        self.settle_tagged(namespace, now, settles, hold).await
    }

    async fn lease_for(
        &self,
        namespace: &str,
        now: Option<Micros>,
        ops: &[super::LeaseOp<'_>],
    ) -> Result<Vec<crate::algorithm::lease::LeaseGrant>, StoreError> {
        self.lease_tagged(namespace, now, ops).await
    }

    fn status(&self) -> super::StoreStatus {
        let breakers_by_namespace = self.tenants.open_breakers(self.clock.now());
        super::StoreStatus {
            kind: if matches!(self.connection, Connection::Cluster(_)) { "redisCluster" } else { "redis" },
            endpoint: Some(self.endpoint().to_string()),
            breaker: Some(overall_breaker(&breakers_by_namespace)),
            breakers_by_namespace,
            redis_keys_by_namespace: self.usage.keys_by_tag(),
            timeout_ms: Some(self.timeout.as_millis() as u64),
            not_answered_yet: self.not_answered_yet(),
            denial_cache: Some(super::DenialCacheStatus {
                entries: self.denials.len() as u64,
                hits: self.denials.hits(),
            }),
            batches: self.batches.as_ref().map(|b| super::BatchStatus {
                calls: b.exchange().calls.load(std::sync::atomic::Ordering::Relaxed),
                decisions: b.exchange().decisions.load(std::sync::atomic::Ordering::Relaxed),
            }),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests;
