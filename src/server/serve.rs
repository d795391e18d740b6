//! `sluice serve`: the enforcement endpoint on policies read from files, hot-reloaded.
//!
//! Files are polled rather than watched with inotify: polling sees every way an editor or a
//! Kubernetes ConfigMap (which swaps a symlinked directory) can replace a file, costs a read of a
//! few small files per interval, and keeps reload latency bounded by the interval.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::auth::{Auth, AuthArgs, Authenticator};
use super::reload::SettledChange;
use super::{http, rls};
use crate::clock::SystemClock;
use crate::engine::Engine;
use crate::listen::ConnectionLimits;
use crate::policy::{load_snapshot, policy_files, why_empty};
use crate::role::{self, store::StoreArgs};
use crate::store::Store;
use crate::telemetry::Metrics;

/// Flags of `sluice serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Policy files or directories (their *.yaml and *.yml files); multi-document YAML.
    #[arg(long = "policies", short = 'p', required = true, num_args = 1.., env = "SLUICE_POLICIES", value_delimiter = ',')]
    pub policies: Vec<PathBuf>,
    /// Start, and reload, even when the policies hold no RateLimitPolicy document (every
    /// request is then allowed). Without it an empty set refuses to start, and a reload that
    /// leaves none keeps the last good snapshot: a mistyped path must not look like a limiter.
    #[arg(long, env = "SLUICE_ALLOW_EMPTY")]
    pub allow_empty: bool,
    /// Address of the check API.
    #[arg(long, env = "SLUICE_LISTEN", default_value = "127.0.0.1:8080", value_parser = crate::listen::parse_listen_address)]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub auth: AuthArgs,
    #[command(flatten)]
    pub grpc: crate::server::rls::GrpcArgs,
    /// PEM certificate chain to serve the check API over HTTPS (with --tls-key); plain HTTP
    /// without it.
    #[arg(long, env = "SLUICE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "SLUICE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// How often policy and token files are checked for changes.
    #[arg(long, env = "SLUICE_RELOAD_INTERVAL", default_value = "250ms", value_parser = crate::duration::parse_positive_std_duration)]
    pub reload_interval: Duration,
    #[command(flatten)]
    pub listen_limits: crate::listen::ListenArgs,
}

/// Why `sluice serve` did not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot start: invalid policies:\n{0}")]
    Policies(String),
    #[error("cannot start: {0}")]
    Empty(String),
    #[error("cannot start")]
    Tokens(#[source] super::auth::TokenFileError),
    #[error("cannot start: --grpc-tls serves the certificate of --tls-cert and --tls-key, which are not given")]
    GrpcTlsWithoutCert,
    #[error("cannot load --tls-cert {} / --tls-key {}", cert.display(), key.display())]
    Tls {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("cannot set up the store")]
    Store(#[source] crate::role::store::BackendError),
    #[error("cannot listen on {0}")]
    Listen(String, #[source] std::io::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("a task of the endpoint failed")]
    Task(#[from] tokio::task::JoinError),
    #[error("HTTP server failed")]
    Http(#[source] std::io::Error),
    #[error("gRPC server failed")]
    Grpc(#[source] tonic::transport::Error),
}

/// `sluice serve`: the endpoint on policies read from files until SIGTERM, then drained.
pub async fn run(args: ServeArgs) -> Result<(), ServeError> {
    let paths = args.policies.clone();
    // The fingerprint read before the load is the watcher's baseline: an edit made while the
    // process starts is then seen as a change, not taken for what was loaded.
    let replicas = args.store.fallback_replicas;
    let (baseline, loaded) =
        tokio::task::spawn_blocking(move || (fingerprint(&paths), load_snapshot(&paths, replicas))).await?;
    let snapshot = match loaded {
        Ok(snapshot) => snapshot,
        Err(message) => return Err(ServeError::Policies(message)),
    };
    if snapshot.policies().is_empty() && !args.allow_empty {
        return Err(ServeError::Empty(empty_policy_set(&args.policies)));
    }
    let tokens = args.auth.static_tokens().map_err(ServeError::Tokens)?;
    if args.grpc.grpc_tls && args.tls_cert.is_none() {
        return Err(ServeError::GrpcTlsWithoutCert);
    }
    // One process-wide rustls provider before the first TLS configuration (ring, as elsewhere).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tls =
        match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(
                axum_server::tls_rustls::RustlsConfig::from_pem_file(cert, key)
                    .await
                    .map_err(|error| ServeError::Tls { cert: cert.clone(), key: key.clone(), error })?,
            ),
            _ => None,
        };
    let metrics = Arc::new(Metrics::new());
    let clock = Arc::new(SystemClock);
    let (engine, memory) = role::engine(&args.store, clock, metrics).await.map_err(ServeError::Store)?;
    let store = Store::status(engine.store());
    tracing::info!(
        kind = store.kind,
        endpoint = store.endpoint.as_deref().unwrap_or("this process"),
        breaker = store.breaker.unwrap_or("none"),
        timeout_ms = store.timeout_ms,
        "store set up"
    );
    tracing::info!(version = snapshot.version(), rules = snapshot.rule_count(), "policies loaded");
    engine.install(Arc::new(snapshot));

    // Register for SIGTERM before announcing the address: a signal future only installs its
    // handler when first polled, and a supervisor may signal as soon as it sees the address.
    let mut terminated = std::pin::pin!(role::termination_signal());
    let _ = futures::poll!(&mut terminated);
    // The gRPC listener first: whoever waits for the check API's address finds both open.
    let grpc_listener = match args.grpc.grpc_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|error| ServeError::Listen(format!("--grpc-listen {addr}"), error))?;
            tracing::info!(grpc = %listener.local_addr()?, tls = args.grpc.grpc_tls, "rate limit service (gRPC) listening");
            Some(listener)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|error| ServeError::Listen(args.listen.to_string(), error))?;
    let address = listener.local_addr()?;
    tracing::info!(%address, tls = tls.is_some(), "check API listening");
    match &tokens {
        Some(tokens) => {
            tracing::info!(path = %tokens.path().display(), tokens = tokens.table().len(), "authentication on")
        }
        None if !address.ip().is_loopback() => tracing::warn!(
            %address,
            "authentication is off on a non-loopback address: anyone who can connect may spend or block any \
             namespace's limits; start with --tokens FILE (docs/security.md)"
        ),
        None => {}
    }

    let (stop, stopped) = watch::channel(false);
    let watcher = tokio::spawn(watch_policies(
        engine.clone(),
        args.policies,
        baseline,
        args.reload_interval,
        args.allow_empty,
        stopped.clone(),
    ));
    let token_watcher = tokens.clone().map(|t| tokio::spawn(t.watch(args.reload_interval, stopped.clone())));
    let sweeper = tokio::spawn(role::sweep_memory(memory, stopped.clone()));
    tokio::spawn(role::follow_lease_keys(args.store.clone(), engine.clone(), stopped.clone()));
    let lease_keeper = tokio::spawn(engine.clone().keep_leases(stopped.clone()));
    tokio::spawn(engine.clone().keep_queue_stats(crate::engine::deferred::QUEUE_STATS_INTERVAL, stopped.clone()));
    let verifiers: Vec<Arc<dyn Authenticator>> = tokens.into_iter().map(|t| t as Arc<dyn Authenticator>).collect();
    let auth = Auth::new(verifiers);
    let grpc_server = grpc_listener.map(|listener| {
        let limiter = rls::RateLimiter::from_args(engine.clone(), auth.clone(), &args.grpc);
        let tls = if args.grpc.grpc_tls { tls.clone() } else { None };
        let (grpc, stopped) = (args.grpc.clone(), stopped.clone());
        tokio::spawn(async move { rls::serve_grpc(listener, limiter, &grpc, tls, stopped).await })
    });
    let state = http::ApiState { engine: engine.clone(), auth, gateway_trusted_hops: args.auth.gateway_trusted_hops };
    let router = http::router_with(state);
    let server = match tls {
        Some(tls) => tokio::spawn(serve_https(listener, router, tls, args.listen_limits.limits(), stopped)),
        None => tokio::spawn(serve_http(listener, router, args.listen_limits.limits(), stopped)),
    };

    terminated.await;
    tracing::info!("shutting down: draining in-flight requests");
    let _ = stop.send(true);
    engine.stop_snapshot_waits();
    server.await?.map_err(ServeError::Http)?;
    if let Some(grpc_server) = grpc_server {
        grpc_server.await?.map_err(ServeError::Grpc)?;
    }
    let _ = tokio::join!(watcher, sweeper, lease_keeper);
    if let Some(token_watcher) = token_watcher {
        let _ = token_watcher.await;
    }
    Ok(())
}

/// Why a start-up on `paths` is refused when they hold no policy: with none, every request is
/// admitted unlimited while `/readyz` says ready, which is what a mistyped path or a ConfigMap
/// mounted one level off looks like. `--allow-empty` says it is meant.
pub fn empty_policy_set(paths: &[PathBuf]) -> String {
    format!(
        "the policies hold no RateLimitPolicy document: {}. With no policies every request is allowed; start with --allow-empty if that is meant",
        why_empty(paths)
    )
}

/// A digest of the policy files' names and contents: a change in any of them means reload.
pub fn fingerprint(paths: &[PathBuf]) -> Vec<u8> {
    let mut hasher = Sha256::new();
    match policy_files(paths) {
        Ok(files) => {
            for file in files {
                hasher.update(file.as_os_str().as_encoded_bytes());
                match std::fs::read(&file) {
                    Ok(bytes) => hasher.update(&bytes),
                    Err(e) => hasher.update(e.to_string().as_bytes()),
                }
            }
        }
        Err(e) => hasher.update(e.to_string().as_bytes()),
    }
    hasher.finalize().to_vec()
}

/// Polls `paths` every `interval` and swaps in a new snapshot when they have changed and then
/// stood still for one interval ([`SettledChange`]: a file caught half-way through a write is not
/// loaded). A bad edit keeps the last good snapshot; the error is logged and shown at
/// `/v1/snapshot`. So does an edit that leaves no policy where there were some (a file emptied
/// or moved away is far likelier a mistake than the wish to lift every limit), unless
/// `allow_empty` (`--allow-empty`) says an empty set is meant: then it goes live with a warning.
///
/// `loaded` is the [`fingerprint`] read before the running snapshot was loaded.
pub async fn watch_policies<S: Store>(
    engine: Arc<Engine<S>>,
    paths: Vec<PathBuf>,
    loaded: Vec<u8>,
    interval: Duration,
    allow_empty: bool,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut change = SettledChange::new(loaded);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        poll_policies(&engine, &paths, &mut change, allow_empty).await;
    }
}

/// One poll of [`watch_policies`]: reads the files' fingerprint and, when `change` says the new
/// content has settled, loads it.
async fn poll_policies<S: Store>(engine: &Engine<S>, paths: &[PathBuf], change: &mut SettledChange, allow_empty: bool) {
    let paths_for_read = paths.to_vec();
    let Ok(current) = tokio::task::spawn_blocking(move || fingerprint(&paths_for_read)).await else {
        return;
    };
    if !change.poll(current) {
        return;
    }
    let paths_for_load = paths.to_vec();
    let replicas = engine.fallback_replicas();
    match tokio::task::spawn_blocking(move || load_snapshot(&paths_for_load, replicas)).await {
        Ok(Ok(snapshot)) if snapshot.policies().is_empty() && !engine.live().snapshot.policies().is_empty() => {
            let rules = engine.live().snapshot.rule_count();
            if allow_empty {
                tracing::warn!(
                    previous_rules = rules,
                    "policies reloaded to none (--allow-empty): every request is allowed from now on"
                );
                engine.install(Arc::new(snapshot));
            } else {
                let message = format!(
                    "{}; keeping the last good snapshot ({rules} rule{})",
                    empty_policy_set(paths).replacen("start with", "restart with", 1),
                    if rules == 1 { "" } else { "s" },
                );
                tracing::error!(error = %message, "policy reload refused: the policies now hold none");
                engine.reload_failed(message);
            }
        }
        Ok(Ok(snapshot)) => {
            let version = snapshot.version().to_string();
            let rules = snapshot.rule_count();
            engine.install(Arc::new(snapshot));
            tracing::info!(%version, rules, "policies reloaded");
        }
        Ok(Err(message)) => {
            tracing::error!(error = %message, "policy reload failed; keeping the last good snapshot");
            engine.reload_failed(message);
        }
        Err(join) => engine.reload_failed(format!("reload task failed: {join}")),
    }
}

/// Serves the router on `listener` until `shutdown` flips, then drains in-flight requests; the
/// header-read timeout and connection cap of [`super::listen`].
pub async fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    limits: ConnectionLimits,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    crate::listen::serve(listener, router, None, limits, shutdown).await
}

/// [`serve_http`] over TLS: the same router, the certificate of `tls` (which can be reloaded in
/// place, e.g. when the operator's certificate Secret changes: each handshake takes the current one).
pub async fn serve_https(
    listener: TcpListener,
    router: axum::Router,
    tls: axum_server::tls_rustls::RustlsConfig,
    limits: ConnectionLimits,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    crate::listen::serve(listener, router, Some(tls), limits, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::store::memory::MemoryStore;
    use crate::telemetry::Metrics;

    const POLICY: &str = "apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: default}
spec:
  rules:
    - name: r
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
";

    fn installs(engine: &Engine<Arc<MemoryStore>>) -> u64 {
        engine.snapshot_events().borrow().installs
    }

    /// A file written in place is empty between its truncation and its write: a poll that reads
    /// it then must not lift every limit, and the finished file goes live on the next poll.
    #[tokio::test]
    async fn a_policy_file_caught_half_written_is_not_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policies.yaml");
        std::fs::write(&file, POLICY).unwrap();
        let paths = vec![dir.path().to_path_buf()];
        let clock = Arc::new(SystemClock);
        let engine =
            Engine::new(Arc::new(MemoryStore::with_clock(100, clock.clone())), clock, Arc::new(Metrics::new()));
        engine.install(Arc::new(load_snapshot(&paths, 1).unwrap()));
        let mut change = SettledChange::new(fingerprint(&paths));
        assert_eq!(installs(&engine), 1);

        std::fs::write(&file, "").unwrap();
        poll_policies(&engine, &paths, &mut change, false).await;
        std::fs::write(&file, POLICY.replace("requests: 3", "requests: 5")).unwrap();
        poll_policies(&engine, &paths, &mut change, false).await;
        assert_eq!(installs(&engine), 1, "neither the empty file nor the new one seen once is loaded");
        poll_policies(&engine, &paths, &mut change, false).await;
        assert_eq!(installs(&engine), 2, "the new file, read twice alike, is");
        poll_policies(&engine, &paths, &mut change, false).await;
        assert_eq!(installs(&engine), 2, "and only once");
    }

    /// A file emptied and left so takes every limit away: without --allow-empty that reload is
    /// refused (the last good snapshot stays, `/v1/snapshot` shows why); with it, it goes live.
    #[tokio::test]
    async fn a_reload_to_no_policies_keeps_the_last_good_snapshot_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policies.yaml");
        std::fs::write(&file, POLICY).unwrap();
        let paths = vec![dir.path().to_path_buf()];
        let clock = Arc::new(SystemClock);
        let engine =
            Engine::new(Arc::new(MemoryStore::with_clock(100, clock.clone())), clock, Arc::new(Metrics::new()));
        engine.install(Arc::new(load_snapshot(&paths, 1).unwrap()));
        let mut change = SettledChange::new(fingerprint(&paths));

        std::fs::write(&file, "# moved to another ConfigMap\n").unwrap();
        poll_policies(&engine, &paths, &mut change, false).await;
        poll_policies(&engine, &paths, &mut change, false).await;
        assert_eq!(installs(&engine), 1, "the empty set is not installed");
        assert_eq!(engine.live().snapshot.rule_count(), 1);
        let error = engine.last_error().expect("the refusal is shown").message;
        assert!(error.contains("no RateLimitPolicy document") && error.contains("--allow-empty"), "{error}");
        assert!(error.contains(&file.display().to_string()), "names the file: {error}");

        std::fs::write(&file, "").unwrap();
        poll_policies(&engine, &paths, &mut change, true).await;
        poll_policies(&engine, &paths, &mut change, true).await;
        assert_eq!(installs(&engine), 2, "with --allow-empty the empty set goes live");
        assert_eq!(engine.live().snapshot.rule_count(), 0);
    }

    /// The refusal names what it read, and the subdirectory a non-recursive read skipped.
    #[test]
    fn an_empty_policy_set_is_explained() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("policies")).unwrap();
        std::fs::write(dir.path().join("policies/p.yaml"), POLICY).unwrap();
        std::fs::write(dir.path().join("README.md"), "not YAML").unwrap();
        let message = empty_policy_set(&[dir.path().to_path_buf()]);
        let below = dir.path().join("policies").display().to_string();
        assert!(message.contains("has no *.yaml or *.yml files"), "{message}");
        assert!(message.contains(&format!("e.g. --policies {below}")), "{message}");
        assert!(message.contains("--allow-empty"), "{message}");

        let empty = dir.path().join("empty.yaml");
        std::fs::write(&empty, "---\n").unwrap();
        let message = empty_policy_set(std::slice::from_ref(&empty));
        assert!(message.contains(&format!("{} holds none (it is empty", empty.display())), "{message}");
    }

    /// A deleted or renamed rule's decision series go with it: 12 renames leave one rule's
    /// series, not thirteen.
    #[test]
    fn metric_series_follow_the_rules() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policies.yaml");
        let paths = vec![dir.path().to_path_buf()];
        let clock = Arc::new(SystemClock);
        let metrics = Arc::new(Metrics::new());
        let engine = Engine::new(Arc::new(MemoryStore::with_clock(100, clock.clone())), clock, metrics.clone());
        let series = |name: &str| metrics.encode().lines().filter(|l| l.contains(&format!("rule=\"{name}\""))).count();
        for n in 0..13 {
            std::fs::write(&file, POLICY.replace("name: r", &format!("name: r{n}"))).unwrap();
            engine.install(Arc::new(load_snapshot(&paths, 1).unwrap()));
        }
        assert_eq!(series("r12"), 3, "allowed, limited, would_limit");
        assert_eq!((0..12).map(|n| series(&format!("r{n}"))).sum::<usize>(), 0, "{}", metrics.encode());
    }
}
