//! The check API's HTTP contract (`/v1/check`, ext_authz, errors, metrics) on the real router,
//! in-process through `tower::ServiceExt::oneshot`: no binary, no port. What needs a process
//! (start-up, reload of files, signals) is in tests/serve.rs.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use sluice::api;
use sluice::clock::SystemClock;
use sluice::engine::Engine;
use sluice::server::http;
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;
use tower::ServiceExt;

#[path = "support/check_api.rs"]
mod check_api;
use check_api::{POLICY, order};

/// The router of `sluice serve` over a memory store, authentication off.
struct Api {
    router: axum::Router,
}

/// One answer, read whole.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Api {
    fn new(policies: &str) -> Api {
        let loaded = sluice::policy::load_str(policies, std::path::Path::new("policies.yaml")).expect("policies");
        let compiled = sluice::policy::compile(loaded.into_iter().map(|l| l.policy).collect());
        assert!(compiled.rejected.is_empty(), "{:?}", compiled.rejected);
        let clock = Arc::new(SystemClock);
        let store = Arc::new(MemoryStore::with_clock(100_000, clock.clone()));
        let engine = Arc::new(Engine::new(store, clock, Arc::new(Metrics::new())));
        engine.install(Arc::new(compiled.snapshot));
        Api { router: http::router(engine) }
    }

    /// Sends `request` as if from 127.0.0.1 (the server records the peer for ext_authz).
    async fn send(&self, mut request: Request<Body>) -> Reply {
        request.extensions_mut().insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
        let response = self.router.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        Reply { status: parts.status, headers: parts.headers, body: body.collect().await.expect("body").to_bytes() }
    }

    async fn get(&self, path: &str) -> Reply {
        self.send(Request::get(path).body(Body::empty()).unwrap()).await
    }

    async fn post_body(&self, path: &str, body: Vec<u8>) -> Reply {
        self.send(Request::post(path).header("content-type", "application/json").body(Body::from(body)).unwrap()).await
    }

    /// `POST /v1/check` that must answer 200; its JSON.
    async fn check(&self, body: &Value) -> Value {
        let reply = self.post_body("/v1/check", serde_json::to_vec(body).unwrap()).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        reply.json()
    }
}

#[tokio::test]
async fn check_api_contract_limits_and_headers() {
    let api = Api::new(POLICY);

    let first = api.check(&order("k1")).await;
    assert_eq!(first["allowed"], true);
    assert_eq!(first["status"], 200);
    assert_eq!(first["retryAfterMs"], Value::Null);
    assert_eq!(first["delayMs"], 0);
    let rules = first["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    assert_eq!(rules[0]["policy"], "tenant-acme/orders-api");
    assert_eq!(rules[0]["rule"], "per-api-key");
    assert_eq!(rules[0]["limit"], 3);
    assert_eq!(rules[0]["remaining"], 2);
    assert_eq!(rules[0]["shadow"], false);
    assert!(rules[0]["resetMs"].as_u64().unwrap() > 0);
    assert_eq!(rules[1]["shadow"], true);
    let h = &first["headers"];
    assert_eq!(h["RateLimit-Policy"], r#""orders-api/per-api-key";q=3;w=3600"#);
    assert!(h["RateLimit"].as_str().unwrap().starts_with(r#""orders-api/per-api-key";r=2;t="#));
    assert_eq!(h["X-RateLimit-Limit"], "3");
    assert_eq!(h["X-RateLimit-Remaining"], "2");
    let reset: u64 = h["X-RateLimit-Reset"].as_str().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(reset > now && reset <= now + 3600, "X-RateLimit-Reset is Unix seconds: {reset}");
    assert!(h.get("Retry-After").is_none());

    // The shadow rule (1 per hour per client IP) would already limit the second request.
    let second = api.check(&order("k1")).await;
    assert_eq!(second["allowed"], true);
    assert_eq!(second["rules"][1]["allowed"], false, "shadow reports would-have-limited");

    api.check(&order("k1")).await;
    let denied = api.check(&order("k1")).await;
    assert_eq!(denied["allowed"], false);
    assert_eq!(denied["status"], 429);
    assert_eq!(denied["headers"]["X-RateLimit-Remaining"], "0");
    let retry_ms = denied["retryAfterMs"].as_u64().unwrap();
    assert!(retry_ms > 0 && retry_ms <= 3_600_000);
    let retry_s: u64 = denied["headers"]["Retry-After"].as_str().unwrap().parse().unwrap();
    assert_eq!(retry_s, retry_ms.div_ceil(1000));

    // Another key has its own counter.
    assert_eq!(api.check(&order("k2")).await["allowed"], true);

    // Not matching: another namespace, unselected labels, another method, another path.
    for body in [
        json!({"namespace": "other", "labels": {"app": "orders"}, "method": "POST", "path": "/orders/1", "headers": {"x-api-key": "k1"}}),
        json!({"namespace": "tenant-acme", "labels": {"app": "web"}, "method": "POST", "path": "/orders/1", "headers": {"x-api-key": "k1"}}),
        json!({"path": "/orders/1"}),
    ] {
        let r = api.check(&body).await;
        assert_eq!(r["allowed"], true);
        assert_eq!(r["rules"], json!([]), "{body}");
        assert_eq!(r["headers"], json!({}));
    }
    let get = json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "GET", "path": "/orders/1", "headers": {"x-api-key": "k1"}});
    let r = api.check(&get).await;
    assert_eq!(r["rules"].as_array().unwrap().len(), 1, "only the shadow rule matches GET");
    let elsewhere = json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "POST", "path": "/ordersX", "headers": {"x-api-key": "k1"}});
    assert_eq!(api.check(&elsewhere).await["rules"].as_array().unwrap().len(), 1);

    // Metrics count decisions by policy, rule and outcome, and would-have-limited shadows.
    let metrics = api.get("/metrics").await.text();
    assert!(
        metrics.contains(
            r#"sluice_decisions_total{policy="tenant-acme/orders-api",rule="per-api-key",outcome="limited"} 1"#
        ),
        "{metrics}"
    );
    assert!(metrics.contains(r#"outcome="would_limit""#), "{metrics}");
    assert!(metrics.contains("sluice_check_duration_seconds_bucket"));
    assert!(!metrics.contains("203.0.113.7") && !metrics.contains("k1"), "no label from keys or clients");
}

#[tokio::test]
async fn leaky_bucket_shaping_returns_a_delay() {
    let api = Api::new(POLICY);
    let body = json!({"namespace": "tenant-acme", "labels": {"app": "batch"}, "path": "/jobs"});
    let delays: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(api.check(&body).await["delayMs"].as_u64().unwrap());
        }
        v
    };
    assert_eq!(delays[0], 0);
    assert!(delays[1] > 50 && delays[2] > delays[1], "successive requests wait longer: {delays:?}");
}

#[tokio::test]
async fn bad_input_gets_400_with_a_reason_never_5xx() {
    let api = Api::new(POLICY);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("non-JSON", b"hello".to_vec(), "invalid JSON"),
        ("empty", Vec::new(), "empty body"),
        ("wrong type", br#"{"path": 5}"#.to_vec(), "path: invalid type"),
        ("negative cost", br#"{"path": "/", "cost": -1}"#.to_vec(), "cost: "),
        ("fractional cost", br#"{"path": "/", "cost": 0.5}"#.to_vec(), "cost: "),
        ("bad IP", br#"{"path": "/", "clientIp": "1.2.3"}"#.to_vec(), "clientIp: "),
        ("non-string header", br#"{"path": "/", "headers": {"a": ["x"]}}"#.to_vec(), "headers.a: "),
        ("unknown field", br#"{"path": "/", "clientIP": "1.2.3.4"}"#.to_vec(), "unknown field"),
        (
            "deep nesting",
            format!(r#"{{"path": "/", "labels": {}{}}}"#, "[".repeat(50_000), "]".repeat(50_000)).into_bytes(),
            "",
        ),
    ];
    for (name, body, needle) in cases {
        let r = api.post_body("/v1/check", body).await;
        let status = r.status.as_u16();
        let v: Value = serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
        assert!(status == 400 || status == 413, "{name}: {status}");
        let error = v["error"].as_str().unwrap_or_else(|| panic!("{name}: no error field: {v}"));
        assert!(error.contains(needle), "{name}: {error}");
    }
    let huge = format!(r#"{{"path": "/", "headers": {{"a": "{}"}}}}"#, "x".repeat(200_000));
    let r = api.post_body("/v1/check", huge.into_bytes()).await;
    assert_eq!(r.status, 413);
    assert!(r.json()["error"].as_str().unwrap().contains("larger than"));
    let r = api.get("/v1/check").await;
    assert_eq!(r.status, 405);
    let r = api.get("/nope").await;
    assert_eq!(r.status, 404);
    // Still serving after all that.
    assert_eq!(api.check(&order("after")).await["allowed"], true);
}

#[tokio::test]
async fn envoy_ext_authz_mode_answers_200_or_429_with_headers() {
    let api = Api::new(POLICY);
    let send = || {
        api.send(
            Request::post("/v1/authz/orders/9?x=1")
                .header("host", "api.example.com")
                .header("x-api-key", "authz")
                .header("x-sluice-namespace", "tenant-acme")
                .header("x-sluice-labels", "app=orders")
                .header("x-forwarded-for", "198.51.100.1, 10.0.0.1")
                .body(Body::empty())
                .unwrap(),
        )
    };
    for _ in 0..3 {
        let r = send().await;
        assert_eq!(r.status, 200);
        assert!(r.headers.contains_key("ratelimit-policy"));
    }
    let r = send().await;
    assert_eq!(r.status, 429);
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(r.headers["x-ratelimit-remaining"], "0");
    let bad = api.send(Request::get("/v1/authz/x").header("x-sluice-cost", "-3").body(Body::empty()).unwrap()).await;
    assert_eq!(bad.status, 400);
}

/// What a CGI, WSGI, Tomcat or IIS app reads as `POST /orders/…` with key `k` is limited as that,
/// at every entry point; a request with two values for the key, or two hosts, has none to decide.
#[tokio::test]
async fn spellings_apps_read_alike_are_limited_alike() {
    let api = Api::new(POLICY);
    let check = |path: &str, headers: Value| {
        json!({"namespace": "tenant-acme", "labels": {"app": "orders"},
        "method": "POST", "path": path, "headers": headers})
    };
    for path in ["/orders%2F1", "/orders;jsessionid=A/1", "/x/..;/orders"] {
        assert_eq!(api.check(&check(path, json!({"X_API_KEY": "spelled"}))).await["allowed"], true, "{path}");
    }
    let fourth = api.check(&check("/orders\\1", json!({"x-api-key": "spelled"}))).await;
    assert_eq!(fourth["allowed"], false, "one bucket: {fourth}");
    let both = check("/orders/1", json!({"x-api-key": "a", "x_api_key": "b"}));
    let r = api.post_body("/v1/check", serde_json::to_vec(&both).unwrap()).await;
    assert_eq!(r.status, 400, "{}", r.text());

    let authz = |path: &str, headers: &[(&str, &str)]| {
        let mut request = Request::post(format!("/v1/authz{path}"))
            .header("x-sluice-namespace", "tenant-acme")
            .header("x-sluice-labels", "app=orders");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        api.send(request.body(Body::empty()).unwrap())
    };
    for path in ["/orders%2F9", "/orders./9", "/orders;v=2"] {
        assert_eq!(authz(path, &[("host", "api.example.com"), ("x_api_key", "authz")]).await.status, 200, "{path}");
    }
    assert_eq!(authz("/orders/9", &[("x-api-key", "authz")]).await.status, 429);
    let r = authz("/orders/9", &[("x-api-key", "a"), ("x_api_key", "b")]).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("sent as both"), "{}", r.text());
    let r = authz("/orders/9", &[("host", "a.example.com"), ("host", "b.example.com"), ("x-api-key", "c")]).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("more than one Host"), "{}", r.text());

    // Issue #37: `/orders/..%2F1` is `/1` to a server decoding `%2F` and `/orders/…` to one
    // routing the raw path; read as `/1` it escaped the `/orders` limit. Refused at every entry.
    for path in ["/orders/..%2F1", "/orders/x/..%2F..%2F7", "/x/%2E%2E%2Forders/1"] {
        let r = api.post_body("/v1/check", serde_json::to_vec(&check(path, json!({"x-api-key": "k"}))).unwrap()).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(r.text().contains("encoded separator"), "{}", r.text());
        assert_eq!(authz(path, &[("x-api-key", "k")]).await.status, 400, "{path}");
    }
}

#[tokio::test]
async fn ext_authz_denial_status_can_be_403_for_nginx() {
    let api = Api::new(POLICY);
    let send = |deny_status: &'static str| {
        api.send(
            Request::post("/v1/authz/orders/9")
                .header("x-api-key", "nginx")
                .header("x-sluice-namespace", "tenant-acme")
                .header("x-sluice-labels", "app=orders")
                .header("x-sluice-deny-status", deny_status)
                .body(Body::empty())
                .unwrap(),
        )
    };
    for _ in 0..3 {
        assert_eq!(send("403").await.status, 200, "allowed stays 200");
    }
    let r = send("403").await;
    assert_eq!(r.status, 403);
    assert!(r.headers.contains_key("retry-after"), "the headers nginx copies are there");
    assert_eq!(send("429").await.status, 429);
    assert_eq!(send("401").await.status, 401);
    let bad = send("500").await;
    assert_eq!(bad.status, 400);
    assert!(bad.text().contains("x-sluice-deny-status"));
}

/// `POST /v1/checks` decides each check as `POST /v1/check` would, in order, with the same
/// headers; a bad check is refused on its own.
#[tokio::test]
async fn batch_checks_decide_like_single_checks_and_refuse_one_bad_check_alone() {
    let batch = Api::new(POLICY);
    let single = Api::new(POLICY);
    let mut requests: Vec<Value> = (0..5).map(|_| order("k1")).collect();
    requests.insert(2, json!({"path": "orders"}));
    requests.push(order("k2"));
    let reply = batch.post_body("/v1/checks", serde_json::to_vec(&json!({"requests": requests})).unwrap()).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let results = reply.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 7);
    assert_eq!(results[2], json!({"status": 400, "error": "path: must start with '/', got \"orders\""}));
    let decided: Vec<&Value> = results.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, r)| r).collect();
    let allowed: Vec<bool> = decided.iter().map(|r| r["allowed"].as_bool().unwrap()).collect();
    assert_eq!(allowed, [true, true, true, false, false, true], "limit 3 on k1, then k2 on its own");
    for (i, result) in decided.iter().enumerate() {
        let key = if i == 5 { "k2" } else { "k1" };
        let one = single.check(&order(key)).await;
        for field in ["allowed", "status", "delayMs", "snapshot"] {
            assert_eq!(result[field], one[field], "check {i}: {field}");
        }
        assert_eq!(result["retryAfterMs"].is_null(), one["retryAfterMs"].is_null(), "check {i}");
        let names = |v: &Value| v["headers"].as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(result), names(&one), "check {i}: header names");
        assert_eq!(result["headers"]["X-RateLimit-Remaining"], one["headers"]["X-RateLimit-Remaining"], "check {i}");
        assert!(result.get("rules").is_none(), "the batch answer leaves out the per-rule detail");
    }
    assert!(decided[3]["headers"]["Retry-After"].as_str().is_some(), "a denial says when to retry");

    let metrics = batch.get("/metrics").await.text();
    assert!(
        metrics.contains(
            r#"sluice_decisions_total{policy="tenant-acme/orders-api",rule="per-api-key",outcome="limited"} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn batch_envelope_and_size_are_checked() {
    let api = Api::new(POLICY);
    for (body, want) in [
        (json!([order("k1")]), "expected {\"requests\": [check, …]}"),
        (json!({"requests": [order("k1")], "extra": 1}), "unknown field `extra`"),
        (json!({"checks": []}), "expected {\"requests\""),
    ] {
        let reply = api.post_body("/v1/checks", serde_json::to_vec(&body).unwrap()).await;
        assert_eq!(reply.status, 400, "{body}");
        assert!(reply.json()["error"].as_str().unwrap().contains(want), "{body}: {}", reply.text());
    }
    let empty = api.post_body("/v1/checks", br#"{"requests": []}"#.to_vec()).await;
    assert_eq!((empty.status, empty.json()), (StatusCode::OK, json!({"results": []})));

    let too_many: Vec<Value> = (0..api::MAX_BATCH_CHECKS + 1).map(|i| order(&format!("k{i}"))).collect();
    let reply = api.post_body("/v1/checks", serde_json::to_vec(&json!({"requests": too_many})).unwrap()).await;
    assert_eq!(reply.status, 400);
    assert!(reply.text().contains("at most 256 per batch"), "{}", reply.text());

    // Larger than one check may be (64 KiB), within the batch limit: decided.
    let full: Vec<Value> = (0..api::MAX_BATCH_CHECKS).map(|i| order(&format!("{i}-{}", "x".repeat(300)))).collect();
    let body = serde_json::to_vec(&json!({"requests": full})).unwrap();
    assert!(body.len() > api::MAX_BODY_BYTES && body.len() < api::MAX_BATCH_BODY_BYTES);
    let reply = api.post_body("/v1/checks", body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["results"].as_array().unwrap().len(), api::MAX_BATCH_CHECKS);
    // One check over the single check's limit is refused on its own.
    let huge = json!({"path": "/", "headers": {"x-api-key": "x".repeat(api::MAX_BODY_BYTES)}});
    let reply =
        api.post_body("/v1/checks", serde_json::to_vec(&json!({"requests": [huge, order("k1")]})).unwrap()).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let results = reply.json()["results"].clone();
    assert_eq!(results[0], json!({"status": 413, "error": "check larger than 65536 bytes"}));
    assert_eq!(results[1]["allowed"], true);
    let reply = api.post_body("/v1/checks", vec![b' '; api::MAX_BATCH_BODY_BYTES + 1]).await;
    assert_eq!(reply.status, 413);
    assert!(reply.text().contains("larger than 1048576 bytes"), "{}", reply.text());
    // The single check keeps its own limit.
    let reply = api.post_body("/v1/check", vec![b' '; api::MAX_BODY_BYTES + 1]).await;
    assert_eq!(reply.status, 413);
}

fn engine_with(policies: &str) -> (Arc<Engine<Arc<MemoryStore>>>, axum::Router) {
    let clock = Arc::new(SystemClock);
    let engine =
        Arc::new(Engine::new(Arc::new(MemoryStore::with_clock(1000, clock.clone())), clock, Arc::new(Metrics::new())));
    engine.install(Arc::new(compile(policies)));
    let router = http::router(engine.clone());
    (engine, router)
}

fn compile(policies: &str) -> sluice::policy::Snapshot {
    let loaded = sluice::policy::load_str(policies, std::path::Path::new("policies.yaml")).expect("policies");
    sluice::policy::compile(loaded.into_iter().map(|l| l.policy).collect()).snapshot
}

async fn get_snapshot(router: &axum::Router, query: &str, etag: Option<&str>) -> Reply {
    let mut request = Request::get(format!("/v1/snapshot{query}"));
    if let Some(etag) = etag {
        request = request.header("if-none-match", etag);
    }
    let response = router.clone().oneshot(request.body(Body::empty()).unwrap()).await.expect("infallible");
    let (parts, body) = response.into_parts();
    Reply { status: parts.status, headers: parts.headers, body: body.collect().await.expect("body").to_bytes() }
}

/// `GET /v1/snapshot?wait=` with the current ETag is held until a new snapshot is installed
/// (answered at once, 200 with the new ETag) or the wait ends (304), and a stop ends it early.
#[tokio::test]
async fn a_snapshot_request_waits_for_a_change() {
    let (engine, router) = engine_with(POLICY);
    let first = get_snapshot(&router, "", None).await;
    let etag = first.headers["etag"].to_str().unwrap().to_string();
    assert!(first.headers.get(api::SNAPSHOT_WAIT_HEADER).is_none(), "no wait asked, none announced");

    // Unchanged: held for the whole wait, then 304 saying the wait was honoured.
    let started = std::time::Instant::now();
    let unchanged = get_snapshot(&router, "?wait=300ms", Some(&etag)).await;
    assert_eq!(unchanged.status, StatusCode::NOT_MODIFIED);
    assert!(started.elapsed() >= std::time::Duration::from_millis(300), "{:?}", started.elapsed());
    assert_eq!(unchanged.headers[api::SNAPSHOT_WAIT_HEADER], "300");

    // A change while held: answered with the new snapshot.
    let held = tokio::spawn({
        let (router, etag) = (router.clone(), etag.clone());
        async move { get_snapshot(&router, "?wait=30s", Some(&etag)).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(!held.is_finished(), "held while unchanged");
    engine.install(Arc::new(compile(&POLICY.replace("requests: 3", "requests: 4"))));
    let changed =
        tokio::time::timeout(std::time::Duration::from_secs(5), held).await.expect("answered on the change").unwrap();
    assert_eq!(changed.status, StatusCode::OK);
    let new_etag = changed.headers["etag"].to_str().unwrap().to_string();
    assert_ne!(new_etag, etag);
    assert_eq!(changed.json()["version"], new_etag.trim_matches('"'));

    // An ETag that is not current is answered at once.
    let stale =
        tokio::time::timeout(std::time::Duration::from_secs(5), get_snapshot(&router, "?wait=30s", Some(&etag)))
            .await
            .unwrap();
    assert_eq!(stale.status, StatusCode::OK);

    // The process stopping ends a held request at once.
    let held = tokio::spawn({
        let router = router.clone();
        async move { get_snapshot(&router, "?wait=30s", Some(&new_etag)).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    engine.stop_snapshot_waits();
    let stopped =
        tokio::time::timeout(std::time::Duration::from_secs(5), held).await.expect("ended by the stop").unwrap();
    assert_eq!(stopped.status, StatusCode::NOT_MODIFIED);
    assert!(stopped.headers.get(api::SNAPSHOT_WAIT_HEADER).is_none(), "a stopping endpoint pushes no more");

    for (query, want) in [
        ("?wait=61s", "wait: at most 60s"),
        ("?wait=soon", "wait: "),
        ("?since=1", "unknown query parameter \"since=1\""),
    ] {
        let reply = get_snapshot(&router, query, None).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{query}");
        assert!(reply.json()["error"].as_str().unwrap().contains(want), "{query}: {}", reply.text());
    }
}

const EXPORTS: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: exports, namespace: tenant-acme}
spec:
  rules:
    - name: exports-in-flight
      match: {paths: [{prefix: /exports}]}
      key: [{header: X-Tenant}]
      algorithm: concurrency
      limit: {requests: 2, per: 5m}
"#;

/// Issue 24, item 1: a concurrency rule through the check API. Two exports may be in progress
/// per tenant; each admitted check returns a lease, `POST /v1/release` gives the slot back
/// (idempotently: twice frees one slot, a forged lease frees none), and ext_authz, which has no
/// release signal, does not decide the rule at all.
#[tokio::test]
async fn concurrency_rules_hold_a_slot_until_released() {
    let api = Api::new(EXPORTS);
    let export = json!({"namespace": "tenant-acme", "path": "/exports/1", "headers": {"X-Tenant": "t1"}});
    let first = api.check(&export).await;
    let second = api.check(&export).await;
    assert_eq!((first["allowed"].clone(), second["allowed"].clone()), (json!(true), json!(true)));
    let third = api.check(&export).await;
    assert_eq!(third["allowed"], false, "{third}");
    assert_eq!(third["lease"], Value::Null, "a denied request holds nothing");
    assert_eq!(third["rules"][0]["remaining"], 0);
    let other_tenant =
        api.check(&json!({"namespace": "tenant-acme", "path": "/exports/1", "headers": {"X-Tenant": "t2"}})).await;
    assert_eq!(other_tenant["allowed"], true, "slots are per key");

    let lease = first["lease"].as_str().expect("an admitted request holds a lease").to_string();
    let release = |lease: &str| serde_json::to_vec(&json!({ "lease": lease })).unwrap();
    let released = api.post_body("/v1/release", release(&lease)).await;
    assert_eq!(released.status, 200, "{}", released.text());
    assert_eq!(released.json()["released"], true);
    assert_eq!(released.json()["settled"], 1);
    let again = api.post_body("/v1/release", release(&lease)).await;
    assert_eq!(again.status, 200, "releasing twice is fine: {}", again.text());
    assert_eq!(
        (again.json()["released"].clone(), again.json()["settled"].clone()),
        (json!(false), json!(0)),
        "the second release found no hold and says so"
    );
    assert_eq!(api.check(&export).await["allowed"], true, "one slot freed");
    assert_eq!(api.check(&export).await["allowed"], false, "and only one: the second release freed nothing");

    // The same rule and key under a hold id nobody was given: the token edited, so refused
    // before anything is freed.
    use base64::Engine as _;
    let token = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let (text, signature) = second["lease"].as_str().unwrap().split_once('.').expect("a signed token");
    let mut forged: Value = serde_json::from_slice(&token.decode(text).unwrap()).unwrap();
    forged["h"] = json!("12345");
    let forged = format!("{}.{signature}", token.encode(serde_json::to_vec(&forged).unwrap()));
    let refused = api.post_body("/v1/release", release(&forged)).await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    assert!(refused.json()["error"].as_str().unwrap().contains("signature"), "{}", refused.text());
    assert_eq!(api.check(&export).await["allowed"], false, "a forged lease freed no slot");

    for bad in [json!({"lease": "!!"}), json!({"lease": "e30"}), json!({"lease": 5}), json!({})] {
        let reply = api.post_body("/v1/release", serde_json::to_vec(&bad).unwrap()).await;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.text());
        assert!(reply.json()["error"].as_str().unwrap().contains("lease"), "{}", reply.text());
    }

    // ext_authz cannot release: the rule is not decided there (counted), so it never holds.
    for _ in 0..3 {
        let reply = api
            .send(
                Request::get("/v1/authz/exports/1")
                    .header("x-sluice-namespace", "tenant-acme")
                    .header("x-tenant", "t1")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let metrics = api.get("/metrics").await.text();
    assert!(metrics.contains(r#"sluice_holding_rules_skipped_total{api="authz"} 3"#), "{metrics}");
}
