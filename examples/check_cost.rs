//! Per-request CPU cost of the check API's handler path without the network: the full axum
//! router (`tower::ServiceExt::oneshot`) for Sluice and for a minimal JSON handler like
//! examples/minimal_axum.rs, on the bodies of scripts/bench/check.lua. Single thread, so it shows
//! what the rate limiting adds per request, which the load benchmark cannot isolate from the
//! kernel's share. Each policy set runs twice: authentication off, and with a static gateway
//! token verified per request (what `sluice serve --tokens` and a warm TokenReview cache cost).
//! `cargo run --release --example check_cost -- scripts/bench/policies-1rule`

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use sluice::clock::SystemClock;
use sluice::engine::Engine;
use sluice::server::auth::{Auth, StaticTokens};
use sluice::server::http;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;
use tower::ServiceExt;

async fn minimal(body: Bytes) -> Response {
    let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let ns = value.get("namespace").and_then(|v| v.as_str()).unwrap_or("default");
    axum::Json(serde_json::json!({
        "allowed": true, "status": 200, "retryAfterMs": null, "delayMs": 0,
        "headers": {"RateLimit-Policy": "\"bench/per-api-key\";q=1000000;w=1", "RateLimit": "\"bench/per-api-key\";r=999999;t=1",
            "X-RateLimit-Limit": "1000000", "X-RateLimit-Remaining": "999999", "X-RateLimit-Reset": "1800000000"},
        "rules": [{"policy": format!("{ns}/bench"), "rule": "per-api-key", "allowed": true, "shadow": false,
            "limit": 1000000, "remaining": 999999, "resetMs": 1, "retryAfterMs": null}],
        "snapshot": "0123456789abcdef"
    }))
    .into_response()
}

fn bodies(n: usize) -> Vec<Bytes> {
    (1..=n)
        .map(|i| {
            Bytes::from(format!(
                r#"{{"namespace":"bench","labels":{{"app":"orders"}},"method":"POST","path":"/orders/{}","host":"api.example.com","clientIp":"10.{}.{}.{}","headers":{{"x-api-key":"key-{}"}},"cost":1}}"#,
                i % 100, (i >> 16) & 255, (i >> 8) & 255, i & 255, i
            ))
        })
        .collect()
}

const TOKEN: &str = "bench-gateway-token-0123456789";

async fn run(name: &str, router: Router, bodies: &[Bytes], iterations: usize, token: Option<&str>) {
    let mut bytes = 0;
    let started = Instant::now();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..iterations {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let body = bodies[(x % bodies.len() as u64) as usize].clone();
        let mut request = Request::post("/v1/check").header("content-type", "application/json");
        if let Some(token) = token {
            request = request.header("x-sluice-authorization", format!("Bearer {token}"));
        }
        let request = request.body(Body::from(body)).unwrap();
        let response = router.clone().oneshot(request).await.unwrap();
        bytes += response.into_body().collect().await.unwrap().to_bytes().len();
    }
    let ns = started.elapsed().as_nanos() as f64 / iterations as f64;
    println!("{name:<14} {ns:8.0} ns/request  ({} bytes/response)", bytes / iterations);
}

fn tokens_file() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), format!("tokens: [{{name: bench, token: {TOKEN}, gateway: true}}]\n")).expect("write");
    file
}

fn main() {
    // As `sluice serve` runs: a subscriber at `info`, so debug spans are disabled callsites.
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new("info")).init();
    let dirs: Vec<String> = std::env::args().skip(1).collect();
    // CHECK_COST_ITERATIONS makes a short run for instruction counts under valgrind.
    let iterations = std::env::var("CHECK_COST_ITERATIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(300_000);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let bodies = bodies(100_000);
        let minimal_router = Router::new().route("/v1/check", post(minimal));
        for round in 0..3 {
            println!("round {round}");
            run("minimal", minimal_router.clone(), &bodies, iterations, None).await;
            for dir in &dirs {
                let snapshot = sluice::policy::load_snapshot(&[dir.into()], 1).expect("policies");
                let clock = Arc::new(SystemClock);
                let store = Arc::new(MemoryStore::with_clock(1_000_000, clock.clone()));
                let engine = Arc::new(Engine::new(store, clock, Arc::new(Metrics::new())));
                engine.install(Arc::new(snapshot));
                let name = dir.rsplit('/').next().unwrap_or(dir);
                run(name, http::router(engine.clone()), &bodies, iterations, None).await;
                let tokens = tokens_file();
                let verifier = Arc::new(StaticTokens::load(tokens.path()).expect("tokens"));
                let state = http::ApiState { engine, auth: Auth::new(vec![verifier]), gateway_trusted_hops: 1 };
                run(&format!("{name}+token"), http::router_with(state), &bodies, iterations, Some(TOKEN)).await;
            }
        }
    });
}
