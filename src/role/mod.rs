//! What every long-running role (`serve`, `operator`, `sidecar`) shares: the store flags and
//! the engine built from them ([`store`]), the sweeper of idle keys and the termination signal.

pub mod store;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::clock::Clock;
use crate::engine::Engine;
use crate::store::backend::Backend;
use crate::telemetry::Metrics;
use store::{BackendError, StoreArgs};

/// The engine of `serve` and `operator` on the store `args` choose, with this process's memory
/// as the local fallback when the store is Redis; returns the memory store for the sweeper.
pub async fn engine(
    args: &StoreArgs,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
) -> Result<(Arc<Engine<Backend>>, Arc<crate::store::memory::MemoryStore>), BackendError> {
    let built = args.build(clock.clone()).await?;
    let memory = built.memory.clone();
    let mut engine = Engine::new(built.backend, clock, metrics);
    match args.lease_keys()? {
        Some(keys) => engine.set_token_keys(keys),
        None if args.uses_redis() => tracing::warn!(
            "no --lease-keys-file: hold tokens are signed with a key of this process, so a settle sent to another replica sharing this Redis is refused (its holds then run out by themselves)"
        ),
        None => {}
    }
    if args.uses_redis() {
        engine = engine.with_local_fallback(memory.clone(), args.fallback_replicas);
        if args.quota_lease_keys > 0 {
            engine = engine.with_quota_leases(args.quota_lease_keys);
        }
    }
    Ok((Arc::new(engine), memory))
}

/// Re-reads --lease-keys-file every 10 s (a rotation, or a Secret the kubelet updated) until
/// `shutdown`; a file that cannot be read or parsed leaves the keys in force and says why.
pub async fn follow_lease_keys<S: crate::store::Store>(
    args: StoreArgs,
    engine: Arc<Engine<S>>,
    mut shutdown: watch::Receiver<bool>,
) {
    if args.lease_keys_file.is_none() {
        return;
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(10)) => {}
            _ = shutdown.changed() => return,
        }
        match args.lease_keys() {
            Ok(Some(keys)) => engine.set_token_keys(keys),
            Ok(None) => return,
            Err(error) => tracing::warn!(%error, "could not re-read the hold token keys; the last ones stay in force"),
        }
    }
}

/// Drops idle keys of a memory store once a second.
pub async fn sweep_memory(store: Arc<crate::store::memory::MemoryStore>, mut shutdown: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        let store = store.clone();
        let _ = tokio::task::spawn_blocking(move || store.sweep_expired(store.clock().now())).await;
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn termination_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
