//! The baseline for the check API load benchmark (scripts/bench/check-load.sh): the least an axum
//! JSON endpoint can do with the same request, built like `sluice serve` (same crate versions,
//! release profile and multi-thread runtime). It parses the body as JSON and answers a JSON object
//! the size and shape of a one-rule check response, so the difference to Sluice is the rate
//! limiting itself (strict request validation, matching, key building, the store, headers,
//! metrics) and nothing else.
//!
//! `cargo run --release --example minimal_axum -- 127.0.0.1:8081`

use std::collections::BTreeMap;

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Serialize;

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Answer {
    allowed: bool,
    status: u16,
    retry_after_ms: Option<u64>,
    delay_ms: u64,
    headers: BTreeMap<&'static str, String>,
    rules: Vec<RuleAnswer>,
    snapshot: &'static str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RuleAnswer {
    policy: String,
    rule: &'static str,
    allowed: bool,
    shadow: bool,
    limit: u64,
    remaining: u64,
    reset_ms: u64,
    retry_after_ms: Option<u64>,
}

async fn check(body: Bytes) -> Response {
    let value: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value) => value,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, axum::Json(serde_json::json!({ "error": e.to_string() })))
                .into_response();
        }
    };
    let namespace = value.get("namespace").and_then(|v| v.as_str()).unwrap_or("default");
    let mut headers = BTreeMap::new();
    headers.insert("RateLimit-Policy", "\"bench/per-api-key\";q=1000000;w=1".to_string());
    headers.insert("RateLimit", "\"bench/per-api-key\";r=999999;t=1".to_string());
    headers.insert("X-RateLimit-Limit", "1000000".to_string());
    headers.insert("X-RateLimit-Remaining", "999999".to_string());
    headers.insert("X-RateLimit-Reset", "1800000000".to_string());
    let answer = Answer {
        allowed: true,
        status: 200,
        retry_after_ms: None,
        delay_ms: 0,
        headers,
        rules: vec![RuleAnswer {
            policy: format!("{namespace}/bench"),
            rule: "per-api-key",
            allowed: true,
            shadow: false,
            limit: 1_000_000,
            remaining: 999_999,
            reset_ms: 1,
            retry_after_ms: None,
        }],
        snapshot: "0123456789abcdef",
    };
    axum::Json(answer).into_response()
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:8081".to_string());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr).await?;
        eprintln!("minimal_axum listening on {}", listener.local_addr()?);
        let app = Router::new().route("/v1/check", post(check));
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
    })
}
