//! The one Redis a non-cluster store decides on: a fixed address, or the master a set of Redis
//! Sentinels names, followed across failovers without a restart.
//!
//! Following a master: the sentinels are asked which node is the master (and that node is asked
//! whether it thinks so, `ROLE`) before the first call; again as soon as a sentinel announces
//! `+switch-master` for it (the old master may still accept writes until the sentinels demote it,
//! and every write there is lost); after any call fails in a way that says the master may have
//! moved (the connection is gone or refused, or the node answers `READONLY`: it was demoted to a
//! replica); and every [`RECHECK_EVERY`] in the background, in case no announcement came through. A new master gets its own
//! connection; the decision code is on it already (Redis replicates `FUNCTION LOAD`), and when it
//! is not (a replica that joined after the load and never got a full sync) the first call loads
//! it, as after any restart.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use ::redis::{
    ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind, TlsCertificates,
    TlsMode,
};

/// How often the master's address is asked again while calls succeed.
pub const RECHECK_EVERY: Duration = Duration::from_secs(2);
/// The least time between two questions to the sentinels after failures: a master that is down
/// stays down until the sentinels agree on another, and asking faster would only load them.
const RESOLVE_AT_MOST_EVERY: Duration = Duration::from_millis(100);

/// Where a store's single Redis is.
#[derive(Clone)]
pub(super) enum Primary {
    Fixed(ConnectionManager),
    Followed(Arc<Followed>),
}

impl Primary {
    /// The connection to use for the next call.
    pub(super) async fn manager(&self) -> Result<ConnectionManager, RedisError> {
        match self {
            Primary::Fixed(manager) => Ok(manager.clone()),
            Primary::Followed(followed) => followed.manager().await,
        }
    }

    /// Hears how a call through [`Self::manager`] ended: an error that may mean the master moved
    /// makes the next call ask the sentinels first.
    pub(super) fn heard<T>(&self, result: &Result<T, RedisError>) {
        if let (Primary::Followed(followed), Err(error)) = (self, result)
            && master_may_have_moved(error)
        {
            followed.stale.store(true, Ordering::Relaxed);
        }
    }

    /// Sends `command` to the current master.
    pub(super) async fn query(&self, command: &::redis::Cmd) -> Result<::redis::Value, RedisError> {
        let mut manager = self.manager().await?;
        let result = command.query_async(&mut manager).await;
        self.heard(&result);
        result
    }
}

/// An error after which the master is worth looking up again.
fn master_may_have_moved(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || matches!(error.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown))
}

/// Redis behind Sentinels.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelEndpoint {
    /// Sentinel node URLs (`redis://[user:password@]host:port`), with the sentinels' own
    /// credentials; `rediss://` makes the sentinels and the master TLS.
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the master under (`sentinel monitor NAME …`).
    pub master: String,
    /// The master's ACL user and password.
    pub username: Option<String>,
    pub password: Option<String>,
}

pub(super) struct Followed {
    sentinel: tokio::sync::Mutex<Lookup>,
    /// A client per sentinel, for hearing `+switch-master` as soon as they announce it.
    announcers: Vec<::redis::Client>,
    current: std::sync::RwLock<Option<Master>>,
    stale: AtomicBool,
    config: ConnectionManagerConfig,
    master: String,
}

struct Lookup {
    client: SentinelClient,
    last: Option<Instant>,
    last_error: Option<RedisError>,
}

#[derive(Clone)]
struct Master {
    address: String,
    manager: ConnectionManager,
}

impl Followed {
    /// Prepares the lookup; nothing is asked yet (the first call asks), so this succeeds while
    /// the sentinels are down. Fails on a configuration that can never work.
    pub(super) fn new(
        settings: &SentinelEndpoint,
        certificates: Option<TlsCertificates>,
        config: ConnectionManagerConfig,
    ) -> Result<Followed, RedisError> {
        if settings.sentinels.is_empty() {
            return Err(RedisError::from((ErrorKind::InvalidClientConfig, "no sentinel URL given")));
        }
        let mut addresses = Vec::new();
        let mut announcers = Vec::new();
        let mut sentinel_auth = (None, None);
        for url in &settings.sentinels {
            announcers.push(match &certificates {
                Some(certificates) => ::redis::Client::build_with_tls(url.as_str(), certificates.clone())?,
                None => ::redis::Client::open(url.as_str())?,
            });
            let info: ConnectionInfo = url.as_str().into_connection_info()?;
            if sentinel_auth.0.is_none() && sentinel_auth.1.is_none() {
                let redis = info.redis_settings();
                sentinel_auth = (redis.username().map(str::to_string), redis.password().map(str::to_string));
            }
            addresses.push(info.addr().clone());
        }
        let tls = match addresses.iter().filter(|a| matches!(a, ConnectionAddr::TcpTls { .. })).count() {
            0 => false,
            n if n == addresses.len() => true,
            _ => {
                return Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "the sentinel URLs mix redis:// and rediss://",
                )));
            }
        };
        let mut builder = SentinelClientBuilder::new(addresses, &settings.master, SentinelServerType::Master)?;
        if let Some(user) = sentinel_auth.0 {
            builder = builder.set_client_to_sentinel_username(user);
        }
        if let Some(password) = sentinel_auth.1 {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if let Some(user) = &settings.username {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(password) = &settings.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if tls {
            builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
            if let Some(certificates) = certificates {
                builder = builder
                    .set_client_to_sentinel_certificates(certificates.clone())
                    .set_client_to_redis_certificates(certificates);
            }
        }
        Ok(Followed {
            sentinel: tokio::sync::Mutex::new(Lookup { client: builder.build()?, last: None, last_error: None }),
            announcers,
            current: std::sync::RwLock::new(None),
            stale: AtomicBool::new(false),
            config,
            master: settings.master.clone(),
        })
    }

    async fn manager(&self) -> Result<ConnectionManager, RedisError> {
        if !self.stale.load(Ordering::Relaxed)
            && let Some(master) = self.current()
        {
            return Ok(master.manager);
        }
        // Boxed: the lookup's future is deep, and every decision's future would carry its
        // layout (and hit the compiler's recursion limit in crates that embed the engine).
        Box::pin(self.resolve(false)).await
    }

    fn current(&self) -> Option<Master> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Asks the sentinels for the master and switches to it when it moved. Concurrent callers
    /// wait for one lookup; after a failed lookup, callers within [`RESOLVE_AT_MOST_EVERY`] get
    /// its error (or the last master, which may have come back) instead of asking again.
    async fn resolve(&self, periodic: bool) -> Result<ConnectionManager, RedisError> {
        let mut lookup = self.sentinel.lock().await;
        if !periodic && !self.stale.load(Ordering::Relaxed) {
            // Another caller looked it up while this one waited.
            if let Some(master) = self.current() {
                return Ok(master.manager);
            }
        }
        if !periodic && lookup.last.is_some_and(|at| at.elapsed() < RESOLVE_AT_MOST_EVERY) {
            return match (self.current(), &lookup.last_error) {
                (_, Some(error)) => Err(error.clone()),
                (Some(master), None) => Ok(master.manager),
                (None, None) => Err(RedisError::from((ErrorKind::Io, "the master is being looked up"))),
            };
        }
        lookup.last = Some(Instant::now());
        let client = match lookup.client.async_get_client().await {
            Ok(client) => client,
            Err(error) => {
                tracing::warn!(master = %self.master, %error, "the sentinels name no reachable master");
                lookup.last_error = Some(error.clone());
                return Err(error);
            }
        };
        lookup.last_error = None;
        let address = client.get_connection_info().addr().to_string();
        self.stale.store(false, Ordering::Relaxed);
        let previous = self.current();
        if let Some(master) = previous.as_ref().filter(|m| m.address == address) {
            return Ok(master.manager.clone());
        }
        let manager = ConnectionManager::new_lazy_with_config(client, self.config.clone())?;
        match &previous {
            Some(old) => {
                tracing::warn!(master = %self.master, from = %old.address, to = %address, "following a failover: the sentinels name a new master")
            }
            None => tracing::info!(master = %self.master, %address, "the sentinels name the master"),
        }
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(Master { address, manager: manager.clone() });
        Ok(manager)
    }

    /// Follows the master in the background while the store lives: at once when a sentinel
    /// announces `+switch-master` for it (while the old master may still take writes, every
    /// moment on it is writes lost), and every [`RECHECK_EVERY`] in case no announcement came
    /// through.
    pub(super) fn follow_in_background(self: &Arc<Followed>) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        let followed = Arc::downgrade(self);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(RECHECK_EVERY).await;
                let Some(followed) = followed.upgrade() else { return };
                if followed.current().is_some() {
                    let _ = followed.resolve(true).await;
                }
            }
        }));
        for announcer in &self.announcers {
            let (announcer, followed) = (announcer.clone(), Arc::downgrade(self));
            tasks.push(tokio::spawn(async move {
                loop {
                    if let Err(error) = hear_switches(&announcer, &followed).await {
                        tracing::debug!(%error, "listening to a sentinel's announcements");
                    }
                    if followed.strong_count() == 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }));
        }
        tasks
    }
}

/// Listens to one sentinel's `+switch-master` until the connection ends; each announcement for
/// the followed master looks the master up again.
async fn hear_switches(announcer: &::redis::Client, followed: &std::sync::Weak<Followed>) -> Result<(), RedisError> {
    use futures::StreamExt as _;
    let mut pubsub = announcer.get_async_pubsub().await?;
    pubsub.subscribe("+switch-master").await?;
    let mut messages = pubsub.into_on_message();
    while let Some(message) = messages.next().await {
        let Some(followed) = followed.upgrade() else { return Ok(()) };
        // "<master name> <old ip> <old port> <new ip> <new port>"
        let payload: String = message.get_payload().unwrap_or_default();
        if payload.split(' ').next() == Some(followed.master.as_str()) {
            followed.stale.store(true, Ordering::Relaxed);
            let _ = followed.resolve(true).await;
        }
    }
    Ok(())
}
