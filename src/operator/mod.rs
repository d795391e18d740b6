//! `sluice operator`: the in-cluster role.
//!
//! - [`controller`]: reflectors over RateLimitPolicy (all namespaces or the given ones), compiling
//!   the whole store into one snapshot after every change and swapping it into the embedded
//!   enforcement endpoint (the same `router(engine)` `sluice serve` has). Every replica does this.
//! - [`status`]: what each policy's status should say; written by the leader only, with
//!   server-side apply under one field manager, plus Kubernetes Events.
//! - [`leader`]: a `coordination.k8s.io/v1` Lease decides the leader.
//! - [`injection`]: the leader reports pods labelled for injection that run without the sidecar.
//! - [`exposure`]: the leader keeps NetworkPolicies closing injected applications' own ports, and
//!   reports Services that reach them past the sidecar.
//! - The admission webhooks live in [`crate::admission`] and are started from here.

pub mod controller;
pub mod exposure;
pub mod leader;
pub mod missing_sidecars;
pub mod status;
pub mod token_keys;
pub mod tokenreview;

/// How a watch retries after the API server failed it: from 250 ms, doubling, at most every 2 s,
/// back to 250 ms once an event arrives. kube's default (client-go's reflector: 0.8 s doubling up
/// to 30 s) left policy changes unseen for 15 s after a 5 s API server restart; a few requests a
/// second from each replica while the API server is away is a small price for enforcing changes
/// within 2 s of its return.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(250);
    const MOST: Duration = Duration::from_secs(2);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (now * 2).min(Self::MOST);
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::admission::{self, WebhookArgs};
use crate::clock::SystemClock;
use crate::role::{
    self,
    store::{BackendError, StoreArgs},
};
use crate::server::auth::{Auth, AuthArgs, Authenticator, TokenFileError};
use crate::server::{http, serve};
use crate::telemetry::Metrics;

/// The field manager of every status write; one name so server-side apply sees one owner whichever
/// replica leads.
pub const FIELD_MANAGER: &str = "sluice-operator";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes client: {0}")]
    Kube(#[from] kube::Error),
    #[error("kubeconfig: {0}")]
    Config(String),
    #[error("leader election: {0}")]
    Lease(#[from] kube_lease_manager::LeaseManagerError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("HTTP server: {0}")]
    Serve(std::io::Error),
    #[error("webhook: {0}")]
    Admission(#[from] admission::Error),
    #[error("store: {0}")]
    Store(#[from] BackendError),
    #[error(transparent)]
    Tokens(#[from] TokenFileError),
    #[error("--gateway-service-accounts: {0:?} is not NAMESPACE/NAME")]
    GatewayName(String),
    #[error("secret {0} lacks {1}")]
    IncompleteSecret(String, &'static str),
    #[error("secret {0}: {1}")]
    TokenKeys(String, crate::engine::hold::TokenKeysError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Flags of `sluice operator`.
#[derive(clap::Args, Debug, Clone)]
pub struct OperatorArgs {
    /// Address of the check API (and /readyz, /metrics, /v1/snapshot).
    #[arg(long, env = "SLUICE_LISTEN", default_value = "0.0.0.0:8080", value_parser = crate::listen::parse_listen_address)]
    pub listen: SocketAddr,
    /// Namespaces whose RateLimitPolicies are enforced; empty means all namespaces.
    #[arg(long, env = "SLUICE_NAMESPACES", value_delimiter = ',')]
    pub namespaces: Vec<String>,
    /// The store (memory, or Redis shared by every replica): the same flags as `sluice serve`.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The operator's own namespace: holds the Lease and the webhook Secret, and is never injected.
    #[arg(long = "operator-namespace", env = "POD_NAMESPACE", default_value = "sluice-system")]
    pub operator_namespace: String,
    /// This replica's identity in the Lease (the pod name in a cluster).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Name of the coordination.k8s.io/v1 Lease that elects the status writer.
    #[arg(long, env = "SLUICE_LEASE_NAME", default_value = "sluice-operator")]
    pub lease_name: String,
    /// How long a leader's Lease lasts without renewal (whole seconds); a killed leader is replaced
    /// within this time.
    #[arg(long, env = "SLUICE_LEASE_DURATION", default_value = "15s", value_parser = parse_seconds)]
    pub lease_duration: Duration,
    /// Quiet period after a policy change before compiling, so a `kubectl apply -f dir/` of many
    /// policies compiles once.
    #[arg(long, env = "SLUICE_DEBOUNCE", default_value = "20ms", value_parser = crate::duration::parse_std_duration)]
    pub debounce: Duration,
    #[command(flatten)]
    pub webhook: WebhookArgs,
    #[command(flatten)]
    pub listen_limits: crate::listen::ListenArgs,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub grpc: crate::server::rls::GrpcArgs,
    /// Verify callers' ServiceAccount tokens with the TokenReview API (sidecars present a
    /// projected token for --token-audience). Off, only --tokens are accepted; with neither,
    /// authentication is off and any caller may act for any namespace.
    #[arg(long, env = "SLUICE_TOKEN_REVIEW", default_value_t = true, action = clap::ArgAction::Set)]
    pub token_review: bool,
    /// The audience callers' ServiceAccount tokens must be issued for.
    #[arg(long, env = "SLUICE_TOKEN_AUDIENCE", default_value = "sluice")]
    pub token_audience: String,
    /// Serve the check API over HTTPS with the operator's certificate (the webhooks' shared
    /// keypair; --webhook-host must then include the check API Service's names). Injected
    /// sidecars are given the CA and verify it.
    #[arg(long, env = "SLUICE_CHECK_API_TLS", default_value_t = false, action = clap::ArgAction::Set)]
    pub check_api_tls: bool,
    /// Plain-HTTP address of /healthz, /readyz and /metrics only, for probes and scrapers (they
    /// are served on --listen too).
    #[arg(long, env = "SLUICE_ADMIN_LISTEN", value_parser = crate::listen::parse_listen_address)]
    pub admin_listen: Option<SocketAddr>,
    /// ServiceAccounts (NAMESPACE/NAME, comma-separated) trusted as gateways: they may name any
    /// namespace, a request's cost and the client IP.
    #[arg(long, env = "SLUICE_GATEWAY_SERVICE_ACCOUNTS", value_delimiter = ',')]
    pub gateway_service_accounts: Vec<String>,
    /// Secret (in --operator-namespace) holding the keys hold tokens are signed with, created
    /// with a random key when missing; every replica reads it (src/operator/token_keys.rs).
    /// --lease-keys-file, when given, is used instead.
    #[arg(long, env = "SLUICE_LEASE_KEYS_SECRET", default_value = "sluice-lease-keys")]
    pub lease_keys_secret: String,
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    let d = crate::duration::parse_std_duration(text)?;
    if d.as_secs() < 2 || d.subsec_nanos() != 0 {
        return Err("must be whole seconds, at least 2s (Lease durations are in seconds)".into());
    }
    Ok(d)
}

/// Runs the operator until SIGTERM or Ctrl-C.
pub async fn run(args: OperatorArgs) -> Result<()> {
    // kube, axum-server and rcgen all use rustls; one process-wide provider (ring, which the rest
    // of the binary uses) must be installed before the first TLS connection or they panic.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Install the SIGTERM handler before anything is announced: a supervisor (or a test) that
    // stops us right after "listening" must get a graceful stop, not the default kill.
    let shutdown = role::termination_signal();
    tokio::pin!(shutdown);
    let _ = futures::poll!(&mut shutdown);
    let client = kube::Client::try_default().await.map_err(|error| match error {
        // Neither a pod's service account nor a kubeconfig: say what the operator looked for
        // and how to give it one, once, rather than kube's nested restatements of one cause.
        kube::Error::InferConfig(cause) => Error::Config(format!(
            "no cluster to talk to: {cause}; run the operator in a pod (its service account) or point \
             KUBECONFIG at a kubeconfig"
        )),
        other => Error::Kube(other),
    })?;
    let identity = args.identity.clone().unwrap_or_else(default_identity);
    tracing::info!(%identity, namespaces = ?args.namespaces, "starting operator");

    // The same store selection as `sluice serve`: memory, or Redis with this replica's memory as
    // the local fallback.
    let metrics = Arc::new(Metrics::new());
    let clock = Arc::new(SystemClock);
    let tokens = args.auth.static_tokens()?;
    let mut verifiers: Vec<Arc<dyn Authenticator>> = Vec::new();
    if let Some(tokens) = &tokens {
        verifiers.push(tokens.clone());
    }
    if args.token_review {
        let mut gateways = std::collections::HashSet::new();
        for name in &args.gateway_service_accounts {
            match name.split_once('/') {
                Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                    gateways.insert(name.clone())
                }
                _ => return Err(Error::GatewayName(name.clone())),
            };
        }
        let config = tokenreview::ReviewConfig::new(args.token_audience.clone(), gateways);
        verifiers.push(Arc::new(tokenreview::TokenReviewer::new(
            client.clone(),
            config,
            clock.clone(),
            metrics.clone(),
        )));
    }
    if verifiers.is_empty() {
        tracing::warn!("authentication is off: any caller may spend or block any namespace's limits");
    }
    let auth = Auth::new(verifiers);
    let (engine, memory) = role::engine(&args.store, clock, metrics.clone()).await?;
    // Hold tokens are signed with the shared keys before any policy is compiled, so before any
    // hold is granted.
    let keys_from_secret = args.store.lease_keys_file.is_none();
    let keys_read = keys_from_secret
        && token_keys::install(&client, &args.operator_namespace, &args.lease_keys_secret, &engine, true).await;

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| Error::Listen { addr: args.listen, source })?;
    let local = listener.local_addr().map_err(Error::Serve)?;
    tracing::info!(address = %local, tls = args.check_api_tls, "check API listening");
    let grpc_listener = match args.grpc.grpc_listen {
        Some(addr) => {
            let listener =
                tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Listen { addr, source })?;
            tracing::info!(grpc = ?listener.local_addr().ok(), tls = args.grpc.grpc_tls, "rate limit service (gRPC) listening");
            Some(listener)
        }
        None => None,
    };
    let admin = match args.admin_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Listen { addr, source })?),
        None => None,
    };
    let (stop, stopped) = watch::channel(false);
    // Joined before the certificates, whose renewal is the leader's.
    let (leading, lease_task) =
        leader::elect(client.clone(), &args.operator_namespace, &args.lease_name, &identity, args.lease_duration)
            .await?;
    let certificates = if args.webhook.webhook_listen.is_some() || args.check_api_tls || args.grpc.grpc_tls {
        let (webhook, namespace) = (&args.webhook, &args.operator_namespace);
        Some(
            admission::Certificates::load(
                &client,
                webhook,
                namespace,
                leading.clone(),
                metrics.clone(),
                stopped.clone(),
            )
            .await?,
        )
    } else {
        None
    };
    let audit = (args.webhook.webhook_listen.is_some() && args.webhook.report_missing_sidecars).then(|| {
        let config = missing_sidecars::AuditConfig {
            namespaces: args.namespaces.clone(),
            operator_namespace: args.operator_namespace.clone(),
            identity: identity.clone(),
        };
        tokio::spawn(missing_sidecars::audit(client.clone(), config, metrics.clone(), leading.clone(), stopped.clone()))
    });
    let exposure = args.webhook.webhook_listen.is_some().then(|| {
        let config = exposure::ExposureConfig {
            namespaces: args.namespaces.clone(),
            operator_namespace: args.operator_namespace.clone(),
            identity: identity.clone(),
            network_policies: args.webhook.sidecar_network_policy,
        };
        tokio::spawn(exposure::watch_exposure(
            client.clone(),
            config,
            metrics.clone(),
            leading.clone(),
            stopped.clone(),
        ))
    });

    if keys_from_secret {
        let (namespace, name) = (args.operator_namespace.clone(), args.lease_keys_secret.clone());
        let follower = token_keys::follow(client.clone(), namespace, name, engine.clone(), keys_read, stopped.clone());
        tokio::spawn(follower);
    } else {
        tokio::spawn(role::follow_lease_keys(args.store.clone(), engine.clone(), stopped.clone()));
    }
    let reflectors = controller::Reflectors::start(client.clone(), &args.namespaces, stopped.clone());
    let (outcomes_tx, outcomes) = watch::channel(None);
    let compiler = tokio::spawn(controller::compile_loop(
        engine.clone(),
        reflectors.readers.clone(),
        reflectors.changed.clone(),
        args.debounce,
        outcomes_tx,
        stopped.clone(),
    ));
    let writer =
        tokio::spawn(status::status_loop(client.clone(), identity.clone(), outcomes, leading, stopped.clone()));

    let sidecar_trust = admission::SidecarTrust {
        token_audience: args.token_review.then_some(args.token_audience.as_str()),
        verify_endpoint: args.check_api_tls,
    };
    let webhook = match (args.webhook.webhook_listen, &certificates) {
        (Some(_), Some(certificates)) => Some(
            admission::start(
                client.clone(),
                &args.webhook,
                &args.operator_namespace,
                sidecar_trust,
                certificates,
                reflectors.readers.clone(),
                metrics.clone(),
                args.listen_limits.limits(),
                args.store.fallback_replicas,
                stopped.clone(),
            )
            .await?,
        ),
        _ => None,
    };
    let token_watcher = tokens.map(|t| tokio::spawn(t.watch(Duration::from_secs(1), stopped.clone())));
    let grpc_server = grpc_listener.map(|listener| {
        let limiter = crate::server::rls::RateLimiter::from_args(engine.clone(), auth.clone(), &args.grpc);
        let tls = certificates.as_ref().filter(|_| args.grpc.grpc_tls).map(|c| c.tls.clone());
        let (grpc, stopped) = (args.grpc.clone(), stopped.clone());
        tokio::spawn(async move { crate::server::rls::serve_grpc(listener, limiter, &grpc, tls, stopped).await })
    });
    let state = http::ApiState { engine: engine.clone(), auth, gateway_trusted_hops: args.auth.gateway_trusted_hops };
    let limits = args.listen_limits.limits();
    let admin_server = admin.map(|admin| {
        tracing::info!(address = ?admin.local_addr().ok(), "admin (healthz, readyz, metrics) listening");
        tokio::spawn(serve::serve_http(admin, http::admin_router(state.engine.clone()), limits, stopped.clone()))
    });
    let router = http::router_with(state);
    let server = match (&certificates, args.check_api_tls) {
        (Some(certificates), true) => {
            tokio::spawn(serve::serve_https(listener, router, certificates.tls.clone(), limits, stopped.clone()))
        }
        _ => tokio::spawn(serve::serve_http(listener, router, limits, stopped.clone())),
    };
    let lease_keeper = tokio::spawn(engine.clone().keep_leases(stopped.clone()));
    tokio::spawn(engine.clone().keep_queue_stats(crate::engine::deferred::QUEUE_STATS_INTERVAL, stopped.clone()));
    let sweeper = tokio::spawn(role::sweep_memory(memory, stopped));

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop.send(true);
    engine.stop_snapshot_waits();
    // Dropping the election's receivers (the status loop's, the audit's, the certificate
    // follower's: all end on stop) releases the Lease, so a graceful stop hands leadership over
    // at once instead of after the lease duration.
    let _ = writer.await;
    if let Some(audit) = audit {
        let _ = audit.await;
    }
    if let Some(exposure) = exposure {
        let _ = exposure.await;
    }
    let _ = lease_task.await;
    let served = server.await;
    if let Some(grpc_server) = grpc_server
        && let Ok(Err(error)) = grpc_server.await
    {
        tracing::error!(%error, "gRPC server failed");
    }
    let _ = tokio::join!(compiler, sweeper, lease_keeper, reflectors.task);
    if let Some(token_watcher) = token_watcher {
        let _ = token_watcher.await;
    }
    if let Some(webhook) = webhook {
        let _ = webhook.await;
    }
    if let Some(admin_server) = admin_server {
        let _ = admin_server.await;
    }
    match served {
        Ok(result) => result.map_err(Error::Serve),
        Err(_) => Ok(()),
    }
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}-{}-{:08x}", host.trim(), std::process::id(), rand::random::<u32>())
}

#[cfg(test)]
mod tests {
    use super::WatchBackoff;
    use kube::runtime::utils::Backoff;
    use std::time::Duration;

    #[test]
    fn watch_retries_double_to_two_seconds_and_reset_after_an_event() {
        let mut backoff = WatchBackoff::default();
        let waits: Vec<Duration> = backoff.by_ref().take(6).collect();
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 2000, 2000]);
        backoff.reset();
        assert_eq!(backoff.next(), Some(Duration::from_millis(250)));
    }
}
