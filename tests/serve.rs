//! `sluice serve` end to end: the real binary, real HTTP, policy files on disk.

#[path = "support/sluice_process.rs"]
mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{SluiceProcess, run_to_end};

const POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders-api, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: orders}}
  rules:
    - name: per-api-key
      match: {methods: [POST], paths: [{prefix: /orders}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
    - name: trial
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
      mode: shadow
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shaping, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: batch}}
  rules:
    - name: smooth
      algorithm: leakyBucket
      limit: {requests: 10, per: 1s, burst: 5, maxDelay: 1s}
"#;

fn order(key: &str) -> Value {
    json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "POST", "path": "/orders/1",
           "host": "api.example.com", "clientIp": "203.0.113.7", "headers": {"x-api-key": key}})
}

fn start(dir: &std::path::Path) -> SluiceProcess {
    SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--reload-interval",
        "50ms",
    ])
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

async fn check(c: &reqwest::Client, s: &SluiceProcess, body: &Value) -> Value {
    let r = c.post(s.url("/v1/check")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn policy_dir(text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), text).unwrap();
    dir
}

#[tokio::test]
async fn check_api_contract_limits_and_headers() {
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();

    let first = check(&c, &s, &order("k1")).await;
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
    let second = check(&c, &s, &order("k1")).await;
    assert_eq!(second["allowed"], true);
    assert_eq!(second["rules"][1]["allowed"], false, "shadow reports would-have-limited");

    check(&c, &s, &order("k1")).await;
    let denied = check(&c, &s, &order("k1")).await;
    assert_eq!(denied["allowed"], false);
    assert_eq!(denied["status"], 429);
    assert_eq!(denied["headers"]["X-RateLimit-Remaining"], "0");
    let retry_ms = denied["retryAfterMs"].as_u64().unwrap();
    assert!(retry_ms > 0 && retry_ms <= 3_600_000);
    let retry_s: u64 = denied["headers"]["Retry-After"].as_str().unwrap().parse().unwrap();
    assert_eq!(retry_s, retry_ms.div_ceil(1000));

    // Another key has its own counter.
    assert_eq!(check(&c, &s, &order("k2")).await["allowed"], true);

    // Not matching: another namespace, unselected labels, another method, another path.
    for body in [
        json!({"namespace": "other", "labels": {"app": "orders"}, "method": "POST", "path": "/orders/1", "headers": {"x-api-key": "k1"}}),
        json!({"namespace": "tenant-acme", "labels": {"app": "web"}, "method": "POST", "path": "/orders/1", "headers": {"x-api-key": "k1"}}),
        json!({"path": "/orders/1"}),
    ] {
        let r = check(&c, &s, &body).await;
        assert_eq!(r["allowed"], true);
        assert_eq!(r["rules"], json!([]), "{body}");
        assert_eq!(r["headers"], json!({}));
    }
    let get = json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "GET", "path": "/orders/1", "headers": {"x-api-key": "k1"}});
    let r = check(&c, &s, &get).await;
    assert_eq!(r["rules"].as_array().unwrap().len(), 1, "only the shadow rule matches GET");
    let elsewhere = json!({"namespace": "tenant-acme", "labels": {"app": "orders"}, "method": "POST", "path": "/ordersX", "headers": {"x-api-key": "k1"}});
    assert_eq!(check(&c, &s, &elsewhere).await["rules"].as_array().unwrap().len(), 1);

    // Metrics count decisions by policy, rule and outcome, and would-have-limited shadows.
    let metrics = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
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
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();
    let body = json!({"namespace": "tenant-acme", "labels": {"app": "batch"}, "path": "/jobs"});
    let delays: Vec<u64> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(check(&c, &s, &body).await["delayMs"].as_u64().unwrap());
        }
        v
    };
    assert_eq!(delays[0], 0);
    assert!(delays[1] > 50 && delays[2] > delays[1], "successive requests wait longer: {delays:?}");
}

#[tokio::test]
async fn bad_input_gets_400_with_a_reason_never_5xx() {
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();
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
        let r = c.post(s.url("/v1/check")).body(body).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
        assert!(status == 400 || status == 413, "{name}: {status}");
        let error = v["error"].as_str().unwrap_or_else(|| panic!("{name}: no error field: {v}"));
        assert!(error.contains(needle), "{name}: {error}");
    }
    let huge = format!(r#"{{"path": "/", "headers": {{"a": "{}"}}}}"#, "x".repeat(200_000));
    let r = c.post(s.url("/v1/check")).body(huge).send().await.unwrap();
    assert_eq!(r.status(), 413);
    assert!(r.json::<Value>().await.unwrap()["error"].as_str().unwrap().contains("larger than"));
    let r = c.get(s.url("/v1/check")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let r = c.get(s.url("/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // Still serving after all that.
    assert_eq!(check(&c, &s, &order("after")).await["allowed"], true);
}

#[tokio::test]
async fn hot_reload_applies_edits_and_keeps_the_last_good_snapshot() {
    let dir = policy_dir(POLICY);
    let file = dir.path().join("policies.yaml");
    let s = start(dir.path());
    let c = client();
    let ready = c.get(s.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(c.get(s.url("/healthz")).send().await.unwrap().status(), 200);

    let snap: Value = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
    let v1 = snap["version"].as_str().unwrap().to_string();
    assert_eq!(snap["lastReloadError"], Value::Null);
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 3);

    // Edit the limit: enforced within a second, and counters survive (1 already used).
    std::fs::write(&file, POLICY.replace("requests: 3, per: 1h", "requests: 5, per: 1h")).unwrap();
    let started = Instant::now();
    let mut after = Value::Null;
    while started.elapsed() < Duration::from_secs(1) {
        after = check(&c, &s, &order("r")).await;
        if after["rules"][0]["limit"] == 5 {
            break;
        }
    }
    assert_eq!(after["rules"][0]["limit"], 5, "reload within a second");
    assert!(after["rules"][0]["remaining"].as_u64().unwrap() <= 3, "counters kept: {after}");

    // A bad edit: the last good snapshot stays and the error is visible.
    std::fs::write(&file, POLICY.replace("requests: 3, per: 1h", "requests: 3, per: 1x")).unwrap();
    let started = Instant::now();
    let mut snap = Value::Null;
    while started.elapsed() < Duration::from_secs(5) {
        snap = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        if !snap["lastReloadError"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let error = snap["lastReloadError"]["message"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("policies.yaml") && error.contains("spec.rules[0].limit.per"), "{snap}");
    assert_ne!(snap["version"], v1.as_str());
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 5, "still the last good snapshot");

    // Fixing it clears the error.
    std::fs::write(&file, POLICY).unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        snap = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        if snap["lastReloadError"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(snap["version"], v1.as_str());
    assert!(snap["lastReloadError"].is_null());
}

#[tokio::test]
async fn envoy_ext_authz_mode_answers_200_or_429_with_headers() {
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();
    let send = || {
        c.post(s.url("/v1/authz/orders/9?x=1"))
            .header("host", "api.example.com")
            .header("x-api-key", "authz")
            .header("x-sluice-namespace", "tenant-acme")
            .header("x-sluice-labels", "app=orders")
            .header("x-forwarded-for", "198.51.100.1, 10.0.0.1")
            .send()
    };
    for _ in 0..3 {
        let r = send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers().contains_key("ratelimit-policy"));
    }
    let r = send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
    let bad = c.get(s.url("/v1/authz/x")).header("x-sluice-cost", "-3").send().await.unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn ext_authz_denial_status_can_be_403_for_nginx() {
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();
    let send = |deny_status: &'static str| {
        c.post(s.url("/v1/authz/orders/9"))
            .header("x-api-key", "nginx")
            .header("x-sluice-namespace", "tenant-acme")
            .header("x-sluice-labels", "app=orders")
            .header("x-sluice-deny-status", deny_status)
            .send()
    };
    for _ in 0..3 {
        assert_eq!(send("403").await.unwrap().status(), 200, "allowed stays 200");
    }
    let r = send("403").await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.headers().contains_key("retry-after"), "the headers nginx copies are there");
    assert_eq!(send("429").await.unwrap().status(), 429);
    assert_eq!(send("401").await.unwrap().status(), 401);
    let bad = send("500").await.unwrap();
    assert_eq!(bad.status(), 400);
    assert!(bad.text().await.unwrap().contains("x-sluice-deny-status"));
}

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let dir = policy_dir(POLICY);
    let mut s = start(dir.path());
    let status = s.terminate();
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_bad_file_at_startup_exits_non_zero_naming_file_and_field() {
    let dir = policy_dir(&POLICY.replace("requests: 3, per: 1h", "requests: 0, per: 1h"));
    let (code, stderr) =
        run_to_end(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"], dir.path());
    assert_ne!(code, Some(0));
    assert!(stderr.contains("policies.yaml"), "{stderr}");
    assert!(stderr.contains("spec.rules[0].limit.requests"), "{stderr}");
}
