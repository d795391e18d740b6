//! Issue 9, item 5, end to end: through the real engine on the memory backend, a flood of
//! distinct keys from one namespace's long-window rule does not evict another namespace's
//! exhausted key (which would hand it a fresh quota), and the evictions are counted against the
//! flooding namespace.

use std::path::Path;
use std::sync::Arc;

use sluice::api::check::CheckRequest;
use sluice::clock::FakeClock;
use sluice::engine::{CheckResponse, Engine};
use sluice::policy::{compile, load_str};
use sluice::server::auth::Caller;
use sluice::store::Store;
use sluice::store::backend::Backend;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;

/// A day boundary (2023-11-14T00:00Z): both rules' fixed windows start here, so the victim's
/// window ends in an hour and every flood key's in a day.
const T0: u64 = 1_699_920_000_000_000;
const CAP: usize = 4096;
const FLOOD: usize = 10_000;

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: hourly, namespace: tenant-a}
spec:
  rules:
    - name: per-key
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: daily, namespace: tenant-b}
spec:
  rules:
    - name: per-key
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 24h}
"#;

fn engine() -> (Engine<Backend>, Arc<MemoryStore>) {
    let clock = FakeClock::new(T0);
    let memory = Arc::new(MemoryStore::with_clock(CAP, Arc::new(clock.clone())));
    let engine = Engine::new(Backend::Memory(memory.clone()), Arc::new(clock), Arc::new(Metrics::new()));
    let loaded = load_str(POLICIES, Path::new("fair.yaml")).expect("valid policies");
    let compiled = compile(loaded.into_iter().map(|p| p.policy).collect());
    assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
    engine.install(Arc::new(compiled.snapshot));
    (engine, memory)
}

/// A check API request of `namespace` keyed by `api_key`, decided by the engine (no
/// authentication: the caller may name any namespace).
async fn check(engine: &Engine<Backend>, namespace: &str, api_key: &str) -> CheckResponse {
    let body = serde_json::json!({"namespace": namespace, "path": "/", "headers": {"x-api-key": api_key}});
    let request = CheckRequest::from_json(body.to_string().as_bytes()).expect("valid request");
    engine
        .check(
            &request.view(&Caller::Open).expect("an open caller may name any namespace"),
            sluice::engine::Holds::Returned,
        )
        .await
}

/// Exhausts tenant-a's victim key, then floods tenant-b with distinct keys.
async fn exhaust_then_flood(engine: &Engine<Backend>) {
    assert!(check(engine, "tenant-a", "victim").await.allowed);
    let denied = check(engine, "tenant-a", "victim").await;
    assert!(!denied.allowed && denied.status == 429, "exhausted: {denied:?}");
    for i in 0..FLOOD {
        let response = check(engine, "tenant-b", &format!("flood-{i}")).await;
        assert!(response.allowed, "each flood key is new");
    }
}

#[tokio::test]
async fn another_namespaces_flood_does_not_reset_an_exhausted_key() {
    let (engine, memory) = engine();
    exhaust_then_flood(&engine).await;
    let after = check(&engine, "tenant-a", "victim").await;
    assert!(!after.allowed, "the victim's key was evicted and its quota reset: {after:?}");
    assert_eq!(after.rules[0].remaining, 0);

    let stats = memory.stats();
    assert!(stats.live_keys <= memory.max_keys() as u64, "{stats:?}");
    assert!(stats.evicted >= (FLOOD - CAP) as u64, "the cap did evict: {stats:?}");
}

#[tokio::test]
async fn evictions_are_counted_against_the_flooding_namespace() {
    let (engine, memory) = engine();
    exhaust_then_flood(&engine).await;

    let live = memory.live_keys_by_namespace();
    assert_eq!(live[0], ("tenant-a".to_string(), 1), "{live:?}");
    let flood_live = live[1].1;
    assert!(flood_live < CAP as u64, "{live:?}");
    let evicted = FLOOD as u64 - flood_live;
    assert_eq!(memory.evictions_by_namespace(), [("tenant-b".to_string(), evicted)]);

    let status = engine.store().status();
    assert_eq!(status.evicted_keys, evicted);
    assert_eq!(status.evicted_keys_by_namespace.into_iter().collect::<Vec<_>>(), [("tenant-b".to_string(), evicted)]);

    // What /metrics shows once the handler records the store's status (twice: still counted once).
    let metrics = engine.metrics();
    metrics.record_store_status(&engine.store().status());
    metrics.record_store_status(&engine.store().status());
    let text = metrics.encode();
    let line = format!("sluice_memory_evictions_total{{namespace=\"tenant-b\"}} {evicted}");
    assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
    assert!(!text.contains("namespace=\"tenant-a\""), "tenant-a lost nothing:\n{text}");
    assert!(text.contains(&format!("sluice_memory_evicted_keys {evicted}")), "{text}");
}
