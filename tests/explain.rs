//! `POST /v1/explain` and `sluice explain`: reasons name the failing condition, the decision is
//! what a check would answer now, and explaining never consumes quota.

use std::sync::Arc;

use axum::body::Body;
use http::Request;
use serde_json::{Value, json};
use sluice::clock::FakeClock;
use sluice::engine::Engine;
use sluice::policy::{compile, load_str};
use sluice::server::auth::{Auth, AuthFuture, Authenticator, Caller};
use sluice::server::http::{ApiState, router_with};
use sluice::store::memory::MemoryStore;
use sluice::telemetry::Metrics;
use tower::ServiceExt;

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: orders-api, namespace: tenant-a}
spec:
  selector: {matchLabels: {app: orders}}
  rules:
    - name: per-api-key
      match: {methods: [POST], paths: [{prefix: /orders}], hosts: [api.example.com], headers: [{name: X-Tier, exact: gold}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: other, namespace: tenant-b}
spec:
  rules:
    - name: all
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
"#;

/// A token `a` for a tenant of namespace tenant-a.
struct OneTenant;
impl Authenticator for OneTenant {
    fn authenticate<'a>(&'a self, token: &'a str) -> AuthFuture<'a> {
        let caller = (token == "a")
            .then(|| Caller::Tenant { name: "sa-a".into(), namespaces: vec!["tenant-a".to_string()].into() });
        Box::pin(async move { Ok(caller) })
    }
}

fn router(auth: Auth) -> axum::Router {
    let loaded = load_str(POLICIES, std::path::Path::new("policies.yaml")).expect("policies parse");
    let compiled = compile(loaded.into_iter().map(|l| l.policy).collect());
    assert!(compiled.rejected.is_empty());
    let clock = Arc::new(FakeClock::new(1_700_000_000_000_000));
    let store = Arc::new(MemoryStore::with_clock(1000, clock.clone()));
    let engine = Arc::new(Engine::new(store, clock, Arc::new(Metrics::new())));
    engine.install(Arc::new(compiled.snapshot));
    router_with(ApiState { engine, auth, gateway_trusted_hops: 1 })
}

async fn post(router: &axum::Router, uri: &str, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = Request::post(uri).header("content-type", "application/json");
    if let Some(token) = token {
        request = request.header("x-sluice-authorization", format!("Bearer {token}"));
    }
    let response = router.clone().oneshot(request.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn order() -> Value {
    json!({"namespace": "tenant-a", "labels": {"app": "orders"}, "method": "POST", "path": "//orders/./1",
           "host": "API.example.com:443", "headers": {"x-api-key": "k1", "x-tier": "gold"}})
}

fn with(mut request: Value, field: &str, value: Value) -> Value {
    request[field] = value;
    request
}

fn rule<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["rules"].as_array().unwrap().iter().find(|r| r["rule"] == name).unwrap()
}

#[tokio::test]
async fn a_non_matching_request_names_the_failing_condition() {
    let router = router(Auth::off());
    let cases = [
        (with(order(), "labels", json!({"app": "search"})), "selector: matchLabels needs app=orders"),
        (with(order(), "method", json!("GET")), "methods: GET is not one of [POST]"),
        (with(order(), "path", json!("/carts/1")), "paths: /carts/1 (normalized) matches none of [prefix /orders]"),
        (with(order(), "host", json!("www.example.com")), "hosts: www.example.com matches none of [api.example.com]"),
        (
            with(order(), "headers", json!({"x-api-key": "k1"})),
            "headers[0]: x-tier is absent; the rule needs exact \"gold\"",
        ),
    ];
    for (request, reason) in cases {
        let (status, report) = post(&router, "/v1/explain", None, request).await;
        assert_eq!(status, 200, "{report}");
        let r = rule(&report, "per-api-key");
        assert_eq!(r["matched"], false, "{report}");
        assert!(r["reason"].as_str().unwrap().starts_with(reason), "{report}");
        assert_eq!(r["key"], Value::Null);
    }
    let (_, report) = post(&router, "/v1/explain", None, order()).await;
    let r = rule(&report, "per-api-key");
    assert_eq!(report["path"], "/orders/1", "the normalized path it matched");
    assert_eq!(report["host"], "API.example.com");
    assert_eq!((r["matched"].clone(), r["reason"].clone()), (json!(true), Value::Null));
    assert_eq!(r["key"], "2:k1");
    assert_eq!(r["keyParts"], json!([{"source": "header x-api-key", "value": "k1"}]));
    assert_eq!(r["decision"]["allowed"], true);
    assert_eq!(r["decision"]["remaining"], 2);
    assert_eq!(report["decision"]["status"], 200);
    let (status, report) = post(&router, "/v1/explain", None, json!({"path": "/", "clientIP": "x"})).await;
    assert_eq!((status, report["error"].as_str().unwrap().contains("clientIP")), (400, true));
}

#[tokio::test]
async fn explain_never_consumes() {
    let router = router(Auth::off());
    for _ in 0..10 {
        let (_, report) = post(&router, "/v1/explain", None, order()).await;
        assert_eq!(rule(&report, "per-api-key")["decision"]["remaining"], 2, "{report}");
        assert_eq!(report["consumed"], false);
    }
    // A check after explaining sees the full quota: 3 pass, the 4th is refused.
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let (_, decision) = post(&router, "/v1/check", None, order()).await;
        statuses.push(decision["status"].as_u64().unwrap());
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    let (_, report) = post(&router, "/v1/explain", None, order()).await;
    let r = rule(&report, "per-api-key");
    assert_eq!((r["decision"]["allowed"].clone(), r["decision"]["remaining"].clone()), (json!(false), json!(0)));
    assert_eq!(report["decision"]["status"], 429, "what a check would answer now");
    assert!(report["decision"]["retryAfterMs"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn explain_is_scoped_to_the_callers_namespace() {
    let router = router(Auth::new(vec![Arc::new(OneTenant)]));
    let (status, _) = post(&router, "/v1/explain", None, order()).await;
    assert_eq!(status, 401);
    let (status, report) = post(&router, "/v1/explain", Some("a"), json!({"path": "/orders"})).await;
    assert_eq!(status, 200);
    assert_eq!(report["namespace"], "tenant-a", "defaults to the caller's own");
    assert!(
        report["policies"].as_array().unwrap().iter().all(|p| p["policy"].as_str().unwrap().starts_with("tenant-a/"))
    );
    let (status, report) = post(&router, "/v1/explain", Some("a"), json!({"namespace": "tenant-b", "path": "/"})).await;
    assert_eq!(status, 403, "{report}");
}

#[test]
fn the_cli_prints_the_contract_fields() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policies.yaml");
    std::fs::write(&file, POLICIES).unwrap();
    let run = |request: &Value, json: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        command.args(["explain", "--policies"]).arg(&file).args(["--request", &request.to_string()]);
        if json {
            command.arg("--json");
        }
        let output = command.output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let report: Value = serde_json::from_str(&run(&with(order(), "method", json!("PUT")), true)).unwrap();
    let r = rule(&report, "per-api-key");
    for field in ["policy", "rule", "matched", "reason", "key", "decision"] {
        assert!(r.get(field).is_some(), "{field} in {r}");
    }
    assert!(r["reason"].as_str().unwrap().starts_with("methods: "));
    let text = run(&order(), false);
    assert!(text.contains("per-api-key (fixedWindow): matches; key header x-api-key=\"k1\""), "{text}");
    assert!(text.contains("nothing consumed"), "{text}");
    // The policies' risky choices (a key on a header whose values nothing restricts) on stderr.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["explain", "--policies"])
        .arg(&file)
        .args(["--request", &order().to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("warning: ") && stderr.contains("policies.yaml") && stderr.contains(".key["), "{stderr}");
}

#[test]
fn the_cli_says_whether_a_rule_is_exact_or_leased() {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/leasing");
    let request = json!({"namespace": "default", "path": "/api/orders", "headers": {"x-api-key": "k1"}});
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["explain", "--json", "--policies"])
        .arg(&examples)
        .args(["--request", &request.to_string()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        rule(&report, "per-key")["consistency"],
        "leased: at most 1200 over the limit, slices decided for up to 1s",
        "2% of 60000"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICIES).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["explain", "--json", "--policies"])
        .arg(dir.path())
        .args(["--request", &order().to_string()])
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(rule(&report, "per-api-key")["consistency"], "exact");
}
