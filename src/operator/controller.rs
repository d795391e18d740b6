//! Reflectors over RateLimitPolicy and the compile loop: every change recompiles the whole store
//! into one snapshot (a snapshot is a function of all policies, never patched one object at a
//! time) and swaps it into the engine.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::policy::{RateLimitPolicy, ValidationErrors, compile};
use crate::server::engine::Engine;
use crate::store::Store as RateStore;

/// One reflector per watched namespace (or one over all), and a notification on every event.
pub struct Reflectors {
    pub readers: Vec<Store<RateLimitPolicy>>,
    pub changed: Arc<Notify>,
    pub task: JoinHandle<()>,
}

impl Reflectors {
    pub fn start(client: Client, namespaces: &[String], mut stop: watch::Receiver<bool>) -> Reflectors {
        let apis: Vec<Api<RateLimitPolicy>> = if namespaces.is_empty() {
            vec![Api::all(client)]
        } else {
            namespaces.iter().map(|ns| Api::namespaced(client.clone(), ns)).collect()
        };
        let changed = Arc::new(Notify::new());
        let mut readers = Vec::new();
        let mut streams = Vec::new();
        for api in apis {
            let (reader, writer) = reflector::store();
            readers.push(reader);
            // any_semantic: the initial list may be served from the API server's watch cache.
            // managedFields are dropped before they reach the store: they are never read and are
            // the bulk of each object.
            let stream = watcher(api, watcher::Config::default().any_semantic())
                .default_backoff()
                .modify(|p| {
                    p.managed_fields_mut().clear();
                })
                .reflect(writer);
            streams.push(stream.boxed());
        }
        let notify = changed.clone();
        let task = tokio::spawn(async move {
            let mut all = futures::stream::select_all(streams);
            loop {
                tokio::select! {
                    event = all.next() => match event {
                        Some(Ok(_)) => notify.notify_one(),
                        // The watcher retries with backoff by itself; the store keeps the last
                        // state meanwhile, so enforcement goes on unchanged.
                        Some(Err(error)) => tracing::warn!(%error, "policy watch failed; retrying"),
                        None => return,
                    },
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
        Reflectors { readers, changed, task }
    }
}

/// What one compile produced, for the status writer.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Version of the snapshot this compile produced, which is now live in the engine.
    pub version: String,
    /// The policies compiled, as the reflector held them.
    pub policies: Vec<Arc<RateLimitPolicy>>,
    /// Why policies were left out, by `namespace/name`.
    pub rejected: HashMap<String, ValidationErrors>,
}

/// (uid, generation) of each policy: a change here is a change the snapshot may depend on.
/// Status-only writes (ours) leave it unchanged, so they never cause a recompile or a requeue.
fn fingerprint(policies: &[Arc<RateLimitPolicy>]) -> Vec<(String, Option<i64>)> {
    let mut out: Vec<_> = policies
        .iter()
        .map(|p| (format!("{}/{}", p.uid().unwrap_or_default(), p.qualified_name()), p.metadata.generation))
        .collect();
    out.sort();
    out
}

/// Waits for the first full sync of every reflector, then compiles after each change (debounced)
/// and publishes each outcome. The engine is not loaded — /readyz answers 503 — until the first
/// compile of the fully synced store.
pub async fn compile_loop<S: RateStore>(
    engine: Arc<Engine<S>>,
    readers: Vec<Store<RateLimitPolicy>>,
    changed: Arc<Notify>,
    debounce: Duration,
    outcomes: watch::Sender<Option<Arc<Outcome>>>,
    mut stop: watch::Receiver<bool>,
) {
    for reader in &readers {
        tokio::select! {
            ready = reader.wait_until_ready() => if ready.is_err() {
                tracing::error!("policy reflector stopped before its first sync");
                return;
            },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
    let mut last: Option<Vec<(String, Option<i64>)>> = None;
    loop {
        let policies: Vec<Arc<RateLimitPolicy>> = readers.iter().flat_map(|r| r.state()).collect();
        let print = fingerprint(&policies);
        if last.as_ref() != Some(&print) {
            last = Some(print);
            let owned: Vec<RateLimitPolicy> = policies.iter().map(|p| (**p).clone()).collect();
            match tokio::task::spawn_blocking(move || compile(owned)).await {
                Ok(compiled) => {
                    let version = compiled.snapshot.version().to_string();
                    if !engine.is_loaded() || engine.live().snapshot.version() != version {
                        tracing::info!(
                            %version,
                            rules = compiled.snapshot.rule_count(),
                            rejected = compiled.rejected.len(),
                            "snapshot installed"
                        );
                        engine.install(Arc::new(compiled.snapshot));
                    }
                    let rejected = compiled.rejected.into_iter().map(|r| (r.policy, r.errors)).collect();
                    outcomes.send_replace(Some(Arc::new(Outcome { version, policies, rejected })));
                }
                Err(join) => engine.reload_failed(format!("compile task failed: {join}")),
            }
        }
        tokio::select! {
            _ = changed.notified() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Absorb a burst (one `kubectl apply -f dir/`) into one compile.
        loop {
            tokio::select! {
                _ = changed.notified() => continue,
                _ = tokio::time::sleep(debounce) => break,
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}
