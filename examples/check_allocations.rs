//! Heap allocations per decision, counted by a global allocator that counts calls: the engine
//! alone (`Engine::check` on a borrowed view, memory store), and the whole check API handler
//! (axum router through `tower::ServiceExt::oneshot`, JSON in and out), with 1 and 3 rules.
//! Allocation counts are exact and independent of the machine's load.
//!
//! `cargo run --release --example check_allocations`

// A global allocator is an unsafe trait: counting needs it, and nothing else here does.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body, Bytes};
use axum::http::Request;
use http_body_util::BodyExt;
use sluice::clock::SystemClock;
use sluice::engine::Engine;
use sluice::policy::RequestView;
use sluice::request::names::Pairs;
use sluice::server::http;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;
use tower::ServiceExt;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the counter
// is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const ROUNDS: u64 = 10_000;

fn engine(policies: &str) -> Arc<Engine<Arc<MemoryStore>>> {
    let snapshot = sluice::policy::load_snapshot(&[std::path::PathBuf::from(policies)], 1).expect("policies");
    let clock = Arc::new(SystemClock);
    let store = Arc::new(MemoryStore::with_clock(1_000_000, clock.clone()));
    let engine = Arc::new(Engine::new(store, clock, Arc::new(Metrics::new())));
    engine.install(Arc::new(snapshot));
    engine
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    println!("| policies | allocations per Engine::check | allocations per POST /v1/check (router, JSON) |");
    println!("|---|---:|---:|");
    for policies in ["scripts/bench/policies-1rule", "scripts/bench/policies-3rules"] {
        let engine = engine(policies);
        let keys: Vec<String> = (0..ROUNDS).map(|i| format!("key-{i}")).collect();
        let labels = [("app", "orders")];
        // The headers the bench policies key on (scripts/bench/check.lua sends the same).
        let mut per_check = 0.0;
        for pass in 0..2 {
            let before = ALLOCATIONS.load(Ordering::Relaxed);
            for key in &keys {
                let headers = [("x-api-key", key.as_str())];
                let view = RequestView {
                    namespace: "bench",
                    labels: &Pairs(&labels),
                    method: "POST",
                    path: "/orders/1",
                    host: Some("api.example.com"),
                    client_ip: Some(std::net::IpAddr::from([10, 0, 0, 1])),
                    headers: &Pairs(&headers),
                    cost: 1,
                    fields: &sluice::request::names::NoEntries,
                    descriptor: None,
                    egress: None,
                    max_wait: None,
                };
                std::hint::black_box(engine.check(&view, sluice::engine::Holds::Returned).await);
            }
            // The first pass creates the keys; the second is the steady state.
            if pass == 1 {
                per_check = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / ROUNDS as f64;
            }
        }
        let router = http::router(engine.clone());
        let bodies: Vec<Bytes> = keys
            .iter()
            .map(|key| {
                Bytes::from(format!(
                    r#"{{"namespace":"bench","labels":{{"app":"orders"}},"method":"POST","path":"/orders/1","host":"api.example.com","clientIp":"10.0.0.1","headers":{{"x-api-key":"{key}"}}}}"#
                ))
            })
            .collect();
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        for body in &bodies {
            let request = Request::post("/v1/check")
                .header("content-type", "application/json")
                .body(Body::from(body.clone()))
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("infallible");
            std::hint::black_box(response.into_body().collect().await.expect("body"));
        }
        let per_request = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / ROUNDS as f64;
        println!("| {policies} | {per_check:.1} | {per_request:.1} |");
    }
}
