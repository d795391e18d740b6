//! The conformance vectors through the HTTP check API, in-process on a fake clock: each vector
//! rule becomes a policy rule that applies when the request carries the header `x-rule-NAME`
//! and is keyed on `x-key`, and each step's repetitions go either as one `POST /v1/checks` batch
//! or as that many `POST /v1/check` calls. Compared: the overall decision, how many repetitions
//! were admitted, the retry-after and the shaping delay the request must wait (milliseconds,
//! rounded up as the API states them; a shadow rule's delay is not the request's), and through
//! `/v1/check` each rule's decision, remaining and reset.

// The runner's store-level half is not used here.
#[allow(dead_code)]
#[path = "common/conformance.rs"]
mod conformance;

use axum::body::Body;
use axum::http::Request;
use conformance::{T0, load};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sluice::duration::parse_duration;
use sluice::server::http;
use tower::ServiceExt;

/// Each rule matches requests carrying `x-rule-<name>` and counts per `x-key`.
fn selects(name: &str) -> String {
    format!("    match: {{headers: [{{name: x-rule-{name}, present: true}}]}}\n    key: [{{header: x-key}}]\n")
}

fn ms(text: &str) -> u64 {
    parse_duration(text).unwrap().div_ceil(1000)
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    /// Each step's repetitions as one `POST /v1/checks`.
    Batch,
    /// One `POST /v1/check` per repetition.
    Single,
}

async fn post(router: &axum::Router, path: &str, body: &Value) -> Value {
    let request = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap();
    let response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&bytes));
    serde_json::from_slice(&bytes).unwrap()
}

async fn run(api: Api) -> (Vec<String>, usize) {
    let vectors = load();
    let (engine, clock) = conformance::engine_for(&vectors, selects);
    let router = http::router(engine);

    let mut failures = Vec::new();
    let mut compared = 0;
    let mut leases = std::collections::HashMap::new();
    for (vi, vector) in vectors.iter().enumerate() {
        let all: Vec<String> = vector.rules.0.iter().map(|(name, _)| name.clone()).collect();
        for (si, step) in vector.steps.iter().enumerate() {
            let context = format!("{} / step {} (at {})", vector.name, si + 1, step.at);
            let names = step.rules.clone().unwrap_or_else(|| all.clone());
            let mut headers = serde_json::Map::new();
            headers.insert("x-key".into(), json!(step.key.clone().unwrap_or_else(|| "k".into())));
            for name in &names {
                headers.insert(format!("x-rule-{name}"), json!("1"));
            }
            let check = json!({
                "namespace": format!("v{vi}"), "path": "/", "headers": headers, "cost": step.cost,
                "requestFields": {"cost": step.cost},
            });
            clock.set(T0 + parse_duration(&step.at).unwrap());
            let reserving = vector.rules.0.iter().any(|(n, s)| names.contains(n) && s.reserve_for.is_some());
            if step.settle {
                let lease = leases.get(&(vi, step.hold)).cloned().unwrap_or(Value::Null);
                let reply = post(&router, "/v1/settle", &json!({"lease": lease, "cost": step.cost})).await;
                if let Some(want) = step.expect.found {
                    compared += 1;
                    if reply["settled"] != want {
                        failures.push(format!("{context}: found: expected {want}, got {}", reply["settled"]));
                    }
                }
                continue;
            }
            let answers: Vec<Value> = match api {
                Api::Batch => {
                    let requests: Vec<&Value> = (0..step.repeat).map(|_| &check).collect();
                    let reply = post(&router, "/v1/checks", &json!({"requests": requests})).await;
                    reply["results"].as_array().cloned().unwrap_or_default()
                }
                Api::Single => {
                    let mut answers = Vec::new();
                    for _ in 0..step.repeat {
                        answers.push(post(&router, "/v1/check", &check).await);
                    }
                    answers
                }
            };
            if answers.len() as u64 != step.repeat {
                failures.push(format!("{context}: {} answers for {} checks", answers.len(), step.repeat));
                continue;
            }
            let Some(last) = answers.last() else { continue };
            // Through the API an admitted request always holds its reservation: a step without
            // a hold settles it at once to its estimate, which is what the store does without one.
            for answer in answers.iter().filter(|a| reserving && a["lease"].is_string()) {
                if step.hold == 0 {
                    post(&router, "/v1/settle", &json!({"lease": answer["lease"]})).await;
                } else {
                    leases.insert((vi, step.hold), answer["lease"].clone());
                }
            }
            let admitted = answers.iter().filter(|a| a["allowed"] == true).count();
            let mut compare = |field: &str, want: String, got: String| {
                compared += 1;
                if want != got {
                    failures.push(format!("{context}: {field}: expected {want}, got {got}"));
                }
            };
            let e = &step.expect;
            if let Some(w) = e.allowed {
                compare("allowed", w.to_string(), last["allowed"].to_string());
            }
            if let Some(w) = e.admitted {
                compare("admitted", w.to_string(), admitted.to_string());
            }
            if let Some(w) = e.retry_after.as_deref() {
                let want = if w == "never" { "null".to_string() } else { ms(w).to_string() };
                // The request's retry-after exists only when it was refused.
                if last["allowed"] == false {
                    compare("retryAfterMs", want, last["retryAfterMs"].to_string());
                }
            }
            // A shadow rule's delay is its own (the vector's), never the request's.
            let any_shadow =
                vector.rules.0.iter().any(|(n, s)| names.contains(n) && s.mode.as_deref() == Some("shadow"));
            if let Some(w) = e.delay.as_deref()
                && last["allowed"] == true
                && !any_shadow
            {
                compare("delayMs", ms(w).to_string(), last["delayMs"].to_string());
            }
            if api == Api::Batch {
                continue;
            }
            let rules = last["rules"].as_array().cloned().unwrap_or_default();
            for name in &names {
                let (allowed, remaining, reset_after) = if let Some(w) = e.rules.get(name) {
                    (w.allowed, w.remaining, w.reset_after.clone())
                } else if names.len() == 1 {
                    (e.rule_allowed, e.remaining, e.reset_after.clone())
                } else {
                    continue;
                };
                let Some(rule) = rules.iter().find(|r| r["rule"] == name.as_str()) else {
                    compare(&format!("{name} in the answer"), "present".into(), "absent".into());
                    continue;
                };
                if let Some(w) = allowed {
                    compare(&format!("{name} allowed"), w.to_string(), rule["allowed"].to_string());
                }
                if let Some(w) = remaining {
                    compare(&format!("{name} remaining"), w.to_string(), rule["remaining"].to_string());
                }
                if let Some(w) = reset_after.as_deref() {
                    compare(&format!("{name} resetMs"), ms(w).to_string(), rule["resetMs"].to_string());
                }
            }
        }
    }
    (failures, compared)
}

#[tokio::test]
async fn every_vector_decides_the_same_through_batched_checks() {
    let (failures, compared) = run(Api::Batch).await;
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    assert!(compared > 100, "only {compared} comparisons: the mapping lost the vectors");
}

#[tokio::test]
async fn every_vector_decides_the_same_through_single_checks() {
    let (failures, compared) = run(Api::Single).await;
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    assert!(compared > 200, "only {compared} comparisons: the mapping lost the vectors");
}
