//! Deferred writes end to end: a real application recording what reaches it, the real
//! `sluice serve` on a real Redis, and two real sidecars of one workload. Limited writes are
//! answered 202 and replayed once each, never faster than the rule together with live traffic;
//! an idempotency value is queued once; a full queue refuses with `Retry-After`; a status URL
//! answers only a request of the write's key; a delivery that keeps failing is retried with
//! backoff and dead-lettered; without a store that can keep them, limited writes are refused.

#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sluice_process.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::any;
use redis_server::RedisServer;
use support::SluiceProcess;

/// What reached the application: path, body, the replay's id and attempt, when.
#[derive(Clone, Debug)]
struct Arrival {
    path: String,
    body: String,
    deferred_id: Option<String>,
    attempt: Option<u32>,
    content_type: Option<String>,
    authorization: Option<String>,
    at: Instant,
}

type Arrivals = Arc<Mutex<Vec<Arrival>>>;

async fn start_app() -> (std::net::SocketAddr, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let answer = |State(arrivals): State<Arrivals>, request: Request| async move {
        let (parts, body) = request.into_parts();
        let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
        let header = |name: &str| parts.headers.get(name).map(|v| v.to_str().unwrap().to_string());
        arrivals.lock().unwrap().push(Arrival {
            path: parts.uri.path().to_string(),
            body: String::from_utf8_lossy(&body).into_owned(),
            deferred_id: header("sluice-deferred-id"),
            attempt: header("sluice-deferred-attempt").map(|a| a.parse().unwrap()),
            content_type: header("content-type"),
            authorization: header("authorization"),
            at: Instant::now(),
        });
        if parts.uri.path() == "/fail" { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED }.into_response()
    };
    let app = Router::new().fallback(any(answer)).with_state(arrivals.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, arrivals)
}

/// Five writes a second per API key (one every 200 ms), limited writes queued; `/fail` is
/// retried after 1 s and dead-lettered at the second failure.
const POLICY: &str = r#"apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders, namespace: shop}
spec:
  rules:
  - name: writes
    match: {methods: [POST]}
    key: [{header: x-api-key}]
    algorithm: gcra
    limit: {requests: 5, per: 1s, burst: 1}
    deferIfLimited:
      headers: [x-request-id]
      idempotencyHeader: Idempotency-Key
      maxQueued: 40
      maxAttempts: 2
      retryInterval: 1s
"#;

fn serve(dir: &std::path::Path, redis: Option<&RedisServer>) -> SluiceProcess {
    let mut args = vec![
        "serve".to_string(),
        "--policies".into(),
        dir.to_str().unwrap().into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    if let Some(redis) = redis {
        args.extend(["--redis".into(), redis.url(), "--redis-timeout".into(), "5s".into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    SluiceProcess::start(&args)
}

struct Answer {
    status: u16,
    retry_after: Option<String>,
    location: Option<String>,
    json: serde_json::Value,
}

async fn post(client: &reqwest::Client, url: String, key: &str, body: String, idempotency: Option<&str>) -> Answer {
    let mut request = client
        .post(url)
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .header("x-request-id", "r-1")
        .header("authorization", "Bearer expires-soon")
        .body(body);
    if let Some(value) = idempotency {
        request = request.header("idempotency-key", value);
    }
    let response = request.send().await.unwrap();
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_string());
    let (status, retry_after, location) = (response.status().as_u16(), header("retry-after"), header("location"));
    let json = response.json().await.unwrap_or(serde_json::Value::Null);
    Answer { status, retry_after, location, json }
}

/// The most arrivals in any window of `width` starting at an arrival.
fn most_in_any(arrivals: &[Instant], width: Duration) -> usize {
    (0..arrivals.len())
        .map(|i| arrivals[i..].iter().take_while(|t| **t - arrivals[i] < width).count())
        .max()
        .unwrap_or(0)
}

async fn until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_writes_are_accepted_and_replayed_once_each_within_the_limit() {
    let redis = RedisServer::start();
    let (app, arrivals) = start_app().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let endpoint = serve(dir.path(), Some(&redis));
    let upstream = app.to_string();
    let sidecars = [
        SluiceProcess::sidecar(&upstream, &endpoint.url(""), "shop", &[]),
        SluiceProcess::sidecar(&upstream, &endpoint.url(""), "shop", &[]),
    ];
    let client = reqwest::Client::new();

    // 30 writes at once through both sidecars: the first pass live, the rest are queued.
    let mut sent = Vec::new();
    for i in 0..30 {
        let url = sidecars[i % 2].url("/orders?from=test");
        let client = client.clone();
        sent.push(tokio::spawn(async move {
            let idempotency = format!("order-{i}");
            (i, post(&client, url, "tenant-a", format!("{{\"order\": {i}}}"), Some(&idempotency)).await)
        }));
    }
    let mut queued = Vec::new();
    for task in sent {
        let (i, answer) = task.await.unwrap();
        match answer.status {
            201 => {}
            202 => {
                let id = answer.json["id"].as_str().unwrap().to_string();
                let url = answer.json["status"].as_str().unwrap().to_string();
                assert_eq!(answer.location.as_deref(), Some(url.as_str()));
                // The status URL names the entry and a token only the writer got.
                let token = url.strip_prefix(&format!("/.well-known/sluice/deferred/{id}.")).expect(&url);
                assert_eq!(token.len(), 32, "{url}");
                assert_eq!(answer.retry_after, None, "a 202 asks for no retry");
                queued.push((i, id, url));
            }
            other => panic!("write {i}: {other} {:?}", answer.json),
        }
    }
    assert!(queued.len() >= 10, "only {} of 30 writes were queued", queued.len());

    // A re-submission of a queued write: the same entry, queued once.
    let (i, first_id, first_url) = &queued[0];
    let again = post(
        &client,
        sidecars[1].url("/orders?from=test"),
        "tenant-a",
        format!("{{\"order\": {i}}}"),
        Some(&format!("order-{i}")),
    )
    .await;
    assert_eq!(
        (again.status, again.json["id"].as_str(), again.json["status"].as_str(), again.json["duplicate"].as_bool()),
        (202, Some(first_id.as_str()), Some(first_url.as_str()), Some(true))
    );

    // Every write reaches the application exactly once.
    until(Duration::from_secs(30), "every write delivered", || arrivals.lock().unwrap().len() >= 30).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let seen = arrivals.lock().unwrap().clone();
    let mut bodies: Vec<&str> = seen.iter().map(|a| a.body.as_str()).collect();
    bodies.sort_unstable();
    bodies.dedup();
    assert_eq!((seen.len(), bodies.len()), (30, 30), "a write lost or delivered twice: {seen:?}");
    for (i, id, _) in &queued {
        let replay = seen.iter().find(|a| a.body == format!("{{\"order\": {i}}}")).unwrap();
        assert_eq!(replay.deferred_id.as_deref(), Some(id.as_str()));
        assert_eq!(replay.attempt, Some(1));
        assert_eq!(replay.path, "/orders");
        assert_eq!(replay.content_type.as_deref(), Some("application/json"));
        assert_eq!(replay.authorization, None, "credentials are not replayed");
    }
    // Live and replayed together: never more than the rule allows (5/s, one every 200 ms,
    // burst 1: at most 6 admitted in any second; one more for the way to the application,
    // which a loaded machine may make uneven). Replays that skipped the check would all arrive
    // at once.
    let times: Vec<Instant> = seen.iter().map(|a| a.at).collect();
    let most = most_in_any(&times, Duration::from_secs(1));
    assert!(most <= 7, "{most} writes reached the application within one second");

    // The status URL: for the same key, the state and the application's status; for another
    // key, nothing at all.
    let status = |key: &'static str, url: String, sidecar: usize| {
        let request = client.get(sidecars[sidecar].url(&url)).header("x-api-key", key);
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.json::<serde_json::Value>().await.unwrap_or_default())
        }
    };
    let (code, state) = status("tenant-a", first_url.clone(), 0).await;
    assert_eq!(
        (code, state["state"].as_str(), state["status"].as_u64()),
        (200, Some("delivered"), Some(201)),
        "{state}"
    );
    assert_eq!(status("tenant-b", first_url.clone(), 1).await.0, 404, "another key read the status");
    let guessed = format!("/.well-known/sluice/deferred/{first_id}.{}", "0".repeat(32));
    assert_eq!(status("tenant-a", guessed, 0).await.0, 404, "the id without its token read the status");
    let bare = format!("/.well-known/sluice/deferred/{first_id}");
    assert_eq!(status("tenant-a", bare, 0).await.0, 404);

    // A full queue: 40 per key; the refusal carries the drain time.
    let mut full = None;
    for i in 0..60 {
        let answer = post(&client, sidecars[0].url("/orders"), "tenant-c", format!("{{\"bulk\": {i}}}"), None).await;
        if answer.status == 429 {
            full = Some(answer);
            break;
        }
    }
    let full = full.expect("the queue never refused");
    // The queue, as /v1/snapshot and the metrics show it.
    let snapshot_url = endpoint.url("/v1/snapshot");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let body: serde_json::Value = client.get(&snapshot_url).send().await.unwrap().json().await.unwrap();
        let queue = &body["store"]["deferredQueues"][0];
        if queue["queued"].as_u64().unwrap_or(0) > 0 {
            assert_eq!((queue["policy"].as_str(), queue["rule"].as_str()), (Some("shop/orders"), Some("writes")));
            assert!(queue["oldestAcceptedMs"].as_u64().is_some(), "{queue}");
            break;
        }
        assert!(Instant::now() < deadline, "no queue in /v1/snapshot: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics = client.get(endpoint.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("sluice_deferred_queued{policy=\"shop/orders\",rule=\"writes\"}"), "{metrics}");
    assert!(metrics.contains("sluice_deferred_writes_total{result=\"full\"} 1"), "{metrics}");
    let retry_after: u64 = full.retry_after.expect("Retry-After").parse().unwrap();
    assert!((2..=10).contains(&retry_after), "a full queue of 40 at 5/s drains in about 8 s, not {retry_after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_keeps_failing_is_retried_with_backoff_then_dead_lettered() {
    let redis = RedisServer::start();
    let (app, arrivals) = start_app().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let endpoint = serve(dir.path(), Some(&redis));
    let sidecar = SluiceProcess::sidecar(&app.to_string(), &endpoint.url(""), "shop", &[]);
    let client = reqwest::Client::new();
    // Spend the key's burst, then a write to /fail is queued.
    let mut queued = None;
    for i in 0..5 {
        let answer = post(&client, sidecar.url("/fail"), "tenant-f", format!("{i}"), None).await;
        if answer.status == 202 {
            queued = Some((
                answer.json["id"].as_str().unwrap().to_string(),
                answer.json["status"].as_str().unwrap().to_string(),
            ));
            break;
        }
    }
    let (id, url) = queued.expect("no write was queued");
    let attempts = || {
        arrivals.lock().unwrap().iter().filter(|a| a.deferred_id.as_deref() == Some(&id)).cloned().collect::<Vec<_>>()
    };
    until(Duration::from_secs(20), "two attempts", || attempts().len() >= 2).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let tried = attempts();
    assert_eq!(tried.iter().map(|a| a.attempt).collect::<Vec<_>>(), [Some(1), Some(2)], "maxAttempts 2");
    let gap = tried[1].at - tried[0].at;
    assert!(gap >= Duration::from_millis(900), "retried after {gap:?}, before its 1 s backoff");
    let response = client.get(sidecar.url(&url)).header("x-api-key", "tenant-f").send().await.unwrap();
    let state: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        (state["state"].as_str(), state["status"].as_u64(), state["attempts"].as_u64()),
        (Some("deadLettered"), Some(503), Some(2)),
        "{state}"
    );
    let dead = redis.cli(&["XLEN", &format!("sl1:{{shop}}:qd:{}", &id[..16])]);
    assert_eq!(dead.trim(), "1", "the dead-letter stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_store_that_keeps_queues_a_limited_write_is_refused() {
    let (app, arrivals) = start_app().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let endpoint = serve(dir.path(), None);
    let sidecar = SluiceProcess::sidecar(&app.to_string(), &endpoint.url(""), "shop", &[]);
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for i in 0..4 {
        statuses.push(post(&client, sidecar.url("/orders"), "tenant-m", format!("{i}"), None).await.status);
    }
    assert_eq!(statuses[0], 201);
    assert!(statuses[1..].iter().all(|s| *s == 429), "memory store: {statuses:?}");
    assert_eq!(arrivals.lock().unwrap().len(), statuses.iter().filter(|s| **s == 201).count());
    // Not silent: /v1/snapshot names the queue that cannot be kept.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let body: serde_json::Value =
            client.get(endpoint.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        let error = body["store"]["deferredQueues"][0]["error"].as_str().unwrap_or_default().to_string();
        if error.contains("deferIfLimited needs the Redis store") {
            break;
        }
        assert!(Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The queue's API refuses what it cannot keep with a 4xx naming the field, before any store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_api_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let endpoint = serve(dir.path(), None);
    let client = reqwest::Client::new();
    let check =
        serde_json::json!({"namespace": "shop", "method": "POST", "path": "/orders", "headers": {"x-api-key": "k"}});
    let cases = [
        (serde_json::json!({"check": check, "target": "/other"}), 400, "target"),
        (
            serde_json::json!({"check": check, "target": "/orders", "idempotencyKey": "k".repeat(300)}),
            400,
            "idempotencyKey",
        ),
        (serde_json::json!({"check": check, "target": "/orders", "extra": 1}), 400, "unknown field `extra`"),
        (serde_json::json!({"check": {"path": "/orders", "bogus": 1}, "target": "/orders"}), 400, "check:"),
        (
            serde_json::json!({"check": {"namespace": "shop", "method": "GET", "path": "/orders"}, "target": "/orders"}),
            400,
            "no deferIfLimited rule",
        ),
        (serde_json::json!({"check": check, "target": "/orders", "body": "not base64!"}), 400, "deferred-write body"),
        (serde_json::json!({"check": check, "target": "/orders"}), 503, "deferIfLimited needs the Redis store"),
    ];
    for (body, status, named) in cases {
        let response = client.post(endpoint.url("/v1/deferred")).json(&body).send().await.unwrap();
        let got = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert!(got == status && text.contains(named), "{body}: {got} {text}");
    }
    let status = serde_json::json!({"check": check, "id": "0000000000000001-1-1.00ff"});
    let response = client.post(endpoint.url("/v1/deferred/status")).json(&status).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let done =
        serde_json::json!({"namespace": "shop", "consumer": "c", "id": "0000000000000001-1-1", "delivered": true});
    let response = client.post(endpoint.url("/v1/deferred/done")).json(&done).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 404, "an entry of no deferring rule");
}
