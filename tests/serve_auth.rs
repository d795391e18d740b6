//! `sluice serve --tokens`: static bearer tokens bound to namespaces, and gateway tokens. The real
//! binary over real HTTP: who may ask about which namespace, who may set the cost and name the
//! client, what the snapshot shows each caller, and reloading the token file.

#[path = "support/sluice_process.rs"]
mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::SluiceProcess;

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: web, namespace: tenant-a}
spec:
  rules:
    - name: per-client
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1m}
    - name: per-key
      match: {paths: [{prefix: /keyed}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: api, namespace: tenant-b}
spec:
  rules:
    - name: per-user
      key: [{header: Authorization}]
      algorithm: fixedWindow
      limit: {requests: 5, per: 1h}
"#;

const TENANT_A: &str = "tenant-a-token-0123456789";
const TENANT_B: &str = "tenant-b-token-0123456789";
const GATEWAY: &str = "gateway-token-0123456789";

fn tokens_file() -> String {
    format!(
        "tokens:\n  - {{name: sidecars-a, token: {TENANT_A}, namespaces: [tenant-a]}}\n  \
         - {{name: sidecars-b, token: {TENANT_B}, namespaces: [tenant-b]}}\n  \
         - {{name: edge, token: {GATEWAY}, gateway: true}}\n"
    )
}

struct Setup {
    _dir: tempfile::TempDir,
    tokens: std::path::PathBuf,
    serve: SluiceProcess,
}

fn start() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICIES).unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, tokens_file()).unwrap();
    let serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.path().join("policies.yaml").to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--reload-interval",
        "50ms",
    ]);
    Setup { _dir: dir, tokens, serve }
}

/// `sluice serve` on `policies` with the token file `tokens` (kept in a directory of its own, so
/// it is not read as policies).
fn serve_with(policies: &str, tokens: &str) -> (SluiceProcess, [tempfile::TempDir; 2]) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), policies).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let token_file = secrets.path().join("tokens.yaml");
    std::fs::write(&token_file, tokens).unwrap();
    let serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.path().to_str().unwrap(),
        "--tokens",
        token_file.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    (serve, [dir, secrets])
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

async fn check(c: &reqwest::Client, s: &SluiceProcess, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = c.post(s.url("/v1/check")).json(&body);
    if let Some(token) = token {
        request = request.header("x-sluice-authorization", bearer(token));
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn callers_need_a_valid_token() {
    let s = start();
    let c = client();
    let body = json!({"namespace": "tenant-a", "path": "/"});
    let response = c.post(s.serve.url("/v1/check")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer realm=\"sluice\"");
    let (status, reply) = check(&c, &s.serve, Some("not-a-known-token-at-all"), body.clone()).await;
    assert_eq!(status, 401, "{reply}");
    assert!(reply["error"].as_str().unwrap().contains("invalid credentials"), "{reply}");
    // The client's own Authorization header is not Sluice's credential.
    let response =
        c.post(s.serve.url("/v1/check")).header("authorization", bearer(TENANT_A)).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    // Probes stay open.
    assert_eq!(c.get(s.serve.url("/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.serve.url("/readyz")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.serve.url("/v1/snapshot")).send().await.unwrap().status(), 401);
}

#[tokio::test]
async fn a_tenant_can_only_touch_its_own_limits() {
    let s = start();
    let c = client();
    // tenant-b's token asking about tenant-a: refused, and tenant-a's counter is untouched.
    let victim = json!({"namespace": "tenant-a", "path": "/", "clientIp": "203.0.113.7"});
    let (status, reply) = check(&c, &s.serve, Some(TENANT_B), victim.clone()).await;
    assert_eq!(status, 403, "{reply}");
    assert!(reply["error"].as_str().unwrap().contains("\"tenant-a\""), "{reply}");
    let (status, reply) = check(&c, &s.serve, Some(TENANT_A), victim.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(reply["rules"][0]["remaining"], 1, "first use of the victim's counter: {reply}");
    // Without a namespace the tenant's own is meant.
    let (_, reply) = check(&c, &s.serve, Some(TENANT_A), json!({"path": "/", "clientIp": "203.0.113.7"})).await;
    assert_eq!(reply["rules"][0]["policy"], "tenant-a/web", "{reply}");
    assert_eq!(reply["allowed"], true);
    // Only gateways set the cost.
    let (status, reply) = check(&c, &s.serve, Some(TENANT_A), json!({"path": "/", "cost": 0})).await;
    assert_eq!(status, 403, "{reply}");
    assert!(reply["error"].as_str().unwrap().contains("cost"), "{reply}");
    // A gateway names any namespace and the cost.
    let (status, reply) = check(
        &c,
        &s.serve,
        Some(GATEWAY),
        json!({"namespace": "tenant-a", "path": "/", "clientIp": "198.51.100.1", "cost": 2}),
    )
    .await;
    assert_eq!((status, reply["allowed"].as_bool()), (200, Some(true)), "{reply}");
    assert_eq!(reply["rules"][0]["remaining"], 0, "cost 2 of 2: {reply}");
}

#[tokio::test]
async fn the_snapshot_shows_a_tenant_only_its_own_policies() {
    let s = start();
    let c = client();
    let get = |token: &'static str| c.get(s.serve.url("/v1/snapshot")).header("x-sluice-authorization", bearer(token));
    let b: Value = get(TENANT_B).send().await.unwrap().json().await.unwrap();
    assert_eq!(b["policies"], json!(["tenant-b/api"]), "{b}");
    assert_eq!(b["headerNames"], json!(["authorization"]));
    assert_eq!(b["sources"].as_array().unwrap().len(), 1);
    let a: Value = get(TENANT_A).send().await.unwrap().json().await.unwrap();
    assert_eq!(a["policies"], json!(["tenant-a/web"]));
    assert_eq!(a["headerNames"], json!(["x-api-key"]), "tenant-b's authorization header is not tenant-a's business");
    assert_ne!(a["version"], b["version"]);
    let all: Value = get(GATEWAY).send().await.unwrap().json().await.unwrap();
    assert_eq!(all["policies"], json!(["tenant-a/web", "tenant-b/api"]));
    // The ETag is the part's version: a tenant's cached copy revalidates with 304.
    let etag = format!("\"{}\"", a["version"].as_str().unwrap());
    let revalidated = get(TENANT_A).header("if-none-match", &etag).send().await.unwrap();
    assert_eq!(revalidated.status(), 304);
}

#[tokio::test]
async fn through_authz_only_a_gateway_names_cost_and_client() {
    let s = start();
    let c = client();
    let authz = |token: &'static str, forged_ip: &str| {
        c.get(s.serve.url("/v1/authz/anything"))
            .header("x-sluice-authorization", bearer(token))
            .header("x-sluice-cost", "0")
            .header("x-envoy-external-address", forged_ip)
            .header("x-forwarded-for", forged_ip)
            .send()
    };
    // A tenant's cost 0 and rotating client addresses change nothing: the 2/min rule keys on
    // the connection's peer and counts 1 each.
    let statuses = [
        authz(TENANT_A, "203.0.113.1").await.unwrap().status().as_u16(),
        authz(TENANT_A, "203.0.113.2").await.unwrap().status().as_u16(),
        authz(TENANT_A, "203.0.113.3").await.unwrap().status().as_u16(),
    ];
    assert_eq!(statuses, [200, 200, 429]);
    // A tenant naming another namespace is refused (403: this caller asked for a 429 denial).
    let refused = c
        .get(s.serve.url("/v1/authz/"))
        .header("x-sluice-authorization", bearer(TENANT_B))
        .header("x-sluice-namespace", "tenant-a")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    // With nginx's 403 denials, an authorization failure is 401 so it never reads as a limit.
    let refused = c
        .get(s.serve.url("/v1/authz/"))
        .header("x-sluice-authorization", bearer(TENANT_B))
        .header("x-sluice-namespace", "tenant-a")
        .header("x-sluice-deny-status", "403")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    // A gateway names the namespace and the client: each address has its own counter.
    for ip in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
        let r = c
            .get(s.serve.url("/v1/authz/"))
            .header("x-sluice-authorization", bearer(GATEWAY))
            .header("x-sluice-namespace", "tenant-a")
            .header("x-envoy-external-address", ip)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{ip}");
    }
    // And its cost counts: 2 of 2 at once for a fresh client, then refused.
    let costly = |ip: &'static str| {
        c.get(s.serve.url("/v1/authz/"))
            .header("x-sluice-authorization", bearer(GATEWAY))
            .header("x-sluice-namespace", "tenant-a")
            .header("x-sluice-cost", "2")
            .header("x-forwarded-for", ip)
            .send()
    };
    assert_eq!(costly("192.0.2.9").await.unwrap().status(), 200);
    assert_eq!(costly("192.0.2.9").await.unwrap().status(), 429);
}

#[tokio::test]
async fn duplicate_values_of_a_keyed_header_are_refused() {
    let s = start();
    let c = client();
    let r = c
        .get(s.serve.url("/v1/authz/keyed"))
        .header("x-sluice-authorization", bearer(TENANT_A))
        .header("x-api-key", "k1")
        .header("x-api-key", "random")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("x-api-key"), "{body}");
}

#[tokio::test]
async fn the_token_file_is_reloaded() {
    let s = start();
    let c = client();
    const NEW: &str = "rotated-token-0123456789";
    let body = json!({"path": "/"});
    assert_eq!(check(&c, &s.serve, Some(NEW), body.clone()).await.0, 401);
    std::fs::write(&s.tokens, format!("tokens:\n  - {{name: new, token: {NEW}, namespaces: [tenant-a]}}\n")).unwrap();
    let mut status = 0;
    for _ in 0..100 {
        status = check(&c, &s.serve, Some(NEW), body.clone()).await.0;
        if status == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status, 200, "the new token is accepted after a reload");
    assert_eq!(check(&c, &s.serve, Some(TENANT_A), body.clone()).await.0, 401, "the old ones are gone");
    // A broken edit keeps the last good tokens.
    std::fs::write(&s.tokens, "tokens: [{name: x, token: short}]").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(check(&c, &s.serve, Some(NEW), body).await.0, 200);
    assert!(s.serve.logs.lock().unwrap().iter().any(|l| l.contains("token reload failed")));
}

#[test]
fn without_tokens_a_public_address_gets_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICIES).unwrap();
    let serve = SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "0.0.0.0:0"]);
    let warned = (0..50).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        serve.logs.lock().unwrap().iter().any(|l| l.contains("authentication is off on a non-loopback address"))
    });
    assert!(warned, "{:?}", serve.logs.lock().unwrap());
    let loopback =
        SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"]);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!loopback.logs.lock().unwrap().iter().any(|l| l.contains("authentication is off")));
}

#[test]
fn a_bad_token_file_stops_start_up() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICIES).unwrap();
    std::fs::write(dir.path().join("t.yaml"), "tokens: [{name: a, token: short, namespaces: [x]}]").unwrap();
    let (code, stderr) = support::run_to_end(
        &["serve", "--policies", "p.yaml", "--tokens", "t.yaml", "--listen", "127.0.0.1:0"],
        dir.path(),
    );
    assert_ne!(code, Some(0));
    assert!(stderr.contains("tokens[0].token"), "{stderr}");
}

/// A batch is one caller: each of its checks is held to what that caller may ask, and a check
/// about another tenant is refused on its own, consuming nothing there.
#[tokio::test]
async fn a_batch_holds_every_check_to_its_callers_namespaces() {
    let s = start();
    let c = client();
    let victim = json!({"namespace": "tenant-a", "path": "/", "clientIp": "203.0.113.9"});
    let own = json!({"path": "/", "headers": {"authorization": "Bearer user-1"}});
    let batch = json!({"requests": [victim, own, victim, {"path": "/", "cost": 0}]});
    let response = c.post(s.serve.url("/v1/checks")).json(&batch).send().await.unwrap();
    assert_eq!(response.status(), 401, "a batch needs a credential like a check");
    let response = c
        .post(s.serve.url("/v1/checks"))
        .header("x-sluice-authorization", bearer(TENANT_B))
        .json(&batch)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let reply: Value = response.json().await.unwrap();
    let results = reply["results"].as_array().unwrap();
    assert_eq!(results[0]["status"], 403, "{reply}");
    assert!(results[0]["error"].as_str().unwrap().contains("\"tenant-a\""), "{reply}");
    assert_eq!(results[1]["allowed"], true, "tenant-b's own check is decided: {reply}");
    assert_eq!(results[1]["headers"]["X-RateLimit-Remaining"], "4", "{reply}");
    assert_eq!(results[2]["status"], 403);
    assert!(results[3]["error"].as_str().unwrap().contains("cost: caller sidecars-b may not set"), "{reply}");
    let (_, reply) = check(&c, &s.serve, Some(TENANT_A), victim).await;
    assert_eq!(reply["rules"][0]["remaining"], 1, "the refused checks did not touch tenant-a: {reply}");
}

/// A token of two namespaces must name one: the request is not decided (nor its policies read)
/// in `default`, which the token was never given.
#[tokio::test]
async fn a_token_of_several_namespaces_must_name_one() {
    let both = "both-namespaces-token-0123";
    let (s, _dirs) = serve_with(
        POLICIES,
        &format!("tokens:\n  - {{name: both, token: {both}, namespaces: [tenant-a, tenant-b]}}\n"),
    );
    let c = client();
    let (status, body) = check(&c, &s, Some(both), json!({"path": "/"})).await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error"].as_str().unwrap().contains("namespace: required"), "{body}");
    let explain = c
        .post(s.url("/v1/explain"))
        .header("x-sluice-authorization", bearer(both))
        .json(&json!({"path": "/"}))
        .send()
        .await
        .unwrap();
    assert_eq!(explain.status(), 403);
    let authz = c.get(s.url("/v1/authz/")).header("x-sluice-authorization", bearer(both)).send().await.unwrap();
    assert_eq!(authz.status(), 403);
    let (status, _) = check(&c, &s, Some(both), json!({"namespace": "tenant-b", "path": "/"})).await;
    assert_eq!(status, 200, "naming one of its namespaces works");
}

/// Through a tenant's ext_authz, a client's `x-sluice-labels` chooses nothing: it could pick
/// labels that unselect a policy.
#[tokio::test]
async fn a_tenant_caller_cannot_choose_labels() {
    const SELECTED: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: not-canary, namespace: tenant-a}
spec:
  selector: {matchExpressions: [{key: track, operator: NotIn, values: [canary]}]}
  rules:
    - name: all
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
"#;
    let (s, _dirs) = serve_with(SELECTED, &tokens_file());
    let c = client();
    let authz = |token: &'static str| {
        c.get(s.url("/v1/authz/"))
            .header("x-sluice-authorization", bearer(token))
            .header("x-sluice-labels", "track=canary")
            .send()
    };
    assert_eq!(authz(TENANT_A).await.unwrap().status(), 200);
    assert_eq!(authz(TENANT_A).await.unwrap().status(), 429, "the forged label did not unselect the policy");
    // A gateway's labels count.
    let gateway = c
        .get(s.url("/v1/authz/"))
        .header("x-sluice-authorization", bearer(GATEWAY))
        .header("x-sluice-namespace", "tenant-a")
        .header("x-sluice-labels", "track=canary");
    assert_eq!(gateway.send().await.unwrap().status(), 200);
}

/// A failed reload's message names files, policies and regexes of every tenant: a tenant sees
/// only that (and when) the last reload failed.
#[tokio::test]
async fn a_reload_error_is_not_shown_to_tenants() {
    let s = start();
    let c = client();
    let policies = s._dir.path().join("policies.yaml");
    std::fs::write(
        &policies,
        POLICIES.replace("name: per-user", "name: per-user\n      match: {paths: [{regex: \"(secret-of-b\"}]}"),
    )
    .unwrap();
    let get = |token: &'static str| c.get(s.serve.url("/v1/snapshot")).header("x-sluice-authorization", bearer(token));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let gateway_view = loop {
        let view: Value = get(GATEWAY).send().await.unwrap().json().await.unwrap();
        if !view["lastReloadError"].is_null() {
            break view;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the bad edit was never reported: {view}\n{}",
            s.serve.logs.lock().unwrap().join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(gateway_view["lastReloadError"]["message"].as_str().unwrap().contains("secret-of-b"));
    let tenant_view: Value = get(TENANT_A).send().await.unwrap().json().await.unwrap();
    let message = tenant_view["lastReloadError"]["message"].as_str().unwrap();
    assert!(
        message.contains("the last reload failed")
            && !message.contains("secret-of-b")
            && !message.contains("policies.yaml"),
        "{message}"
    );
}
