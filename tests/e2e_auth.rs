//! Callers of the operator's check API, verified with the real TokenReview API of a real
//! kube-apiserver (e2e/control-plane.sh): tokens minted by the TokenRequest API for
//! ServiceAccounts in two tenant namespaces and one gateway, plus a wrong-audience and an expired
//! token. The operator runs as the least-privilege user of deploy/rbac.yaml.

#[path = "support/control_plane.rs"]
mod control_plane;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use control_plane::{ControlPlane, Operator, cluster, eventually, report};
use serde_json::{Value, json};

const TENANT_A: &str = "auth-tenant-a";
const TENANT_B: &str = "auth-tenant-b";
const GATEWAY_NS: &str = "auth-gateway";

/// Namespaces, ServiceAccounts and policies, applied once per test binary (tests run in parallel).
fn setup(cp: &ControlPlane) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| apply_setup(cp));
}

fn apply_setup(cp: &ControlPlane) {
    let policies = format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: {TENANT_A}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {TENANT_B}}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {GATEWAY_NS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: app, namespace: {TENANT_A}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: app, namespace: {TENANT_B}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: envoy, namespace: {GATEWAY_NS}}}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: web, namespace: {TENANT_A}}}
spec:
  rules:
    - name: per-client
      key: [{{clientIP: true}}]
      algorithm: fixedWindow
      limit: {{requests: 2, per: 1m}}
    - name: per-key
      match: {{paths: [{{prefix: /keyed}}]}}
      key: [{{header: X-API-Key}}]
      algorithm: fixedWindow
      limit: {{requests: 100, per: 1h}}
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: api, namespace: {TENANT_B}}}
spec:
  rules:
    - name: per-user
      key: [{{header: Authorization}}]
      algorithm: fixedWindow
      limit: {{requests: 5, per: 1h}}
"#
    );
    cp.kubectl(&["apply", "-f", "-"], Some(&policies));
}

/// A token from the TokenRequest API (what a projected volume holds).
fn token(cp: &ControlPlane, namespace: &str, account: &str, audience: &str) -> String {
    cp.kubectl(&["create", "token", account, "-n", namespace, "--audience", audience, "--duration", "10m"], None)
        .trim()
        .to_string()
}

/// A correctly signed ServiceAccount token that expired a minute ago: TokenRequest refuses
/// lifetimes under 10 minutes, so it is signed here with the API server's own key.
fn expired_token(cp: &ControlPlane, namespace: &str, account: &str) -> String {
    let key = cp.service_account_key.as_ref().expect("the local control plane's signing key");
    let uid = cp.kubectl(&["get", "serviceaccount", account, "-n", namespace, "-o", "jsonpath={.metadata.uid}"], None);
    let kubeconfig = std::fs::read_to_string(&cp.kubeconfig).expect("kubeconfig");
    let server = kubeconfig.split("server: \"").nth(1).and_then(|s| s.split('"').next()).expect("server");
    let now = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
    let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let header = b64(br#"{"alg":"RS256","typ":"JWT"}"#);
    let claims = json!({
        "iss": format!("{server}/"), "aud": ["sluice"], "sub": format!("system:serviceaccount:{namespace}:{account}"),
        "iat": now - 900, "nbf": now - 900, "exp": now - 60,
        "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": account, "uid": uid.trim()}},
    });
    let payload = b64(claims.to_string().as_bytes());
    let signing_input = format!("{header}.{payload}");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("input"), &signing_input).expect("write");
    let out = std::process::Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .arg(dir.path().join("input"))
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {}", String::from_utf8_lossy(&out.stderr));
    format!("{signing_input}.{}", b64(&out.stdout))
}

/// One client, so connections are reused and the warm-cache figure is the check, not a handshake.
fn http() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(|| reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("client")).clone()
}

async fn check(op: &Operator, token: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = http().post(op.url("/v1/check")).json(&body);
    if let Some(token) = token {
        request = request.header("x-sluice-authorization", format!("Bearer {token}"));
    }
    let response = request.send().await.expect("check");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn metric(op: &Operator, line_start: &str) -> u64 {
    let text = http().get(op.url("/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines().find_map(|l| l.strip_prefix(line_start)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_verified_and_tenants_stay_in_their_namespace() {
    let cp = cluster();
    setup(cp);
    let namespaces = format!("{TENANT_A},{TENANT_B}");
    let gateway = format!("{GATEWAY_NS}/envoy");
    let op = Operator::start(
        &cp.operator_kubeconfig,
        "auth-1",
        &[
            "--namespaces",
            &namespaces,
            "--lease-name",
            "e2e-auth",
            "--token-review=true",
            "--gateway-service-accounts",
            &gateway,
        ],
    );
    let a = token(cp, TENANT_A, "app", "sluice");
    let b = token(cp, TENANT_B, "app", "sluice");
    let gw = token(cp, GATEWAY_NS, "envoy", "sluice");
    let wrong_audience = token(cp, TENANT_A, "app", "someone-else");
    let expired = expired_token(cp, TENANT_A, "app");

    // Both policies enforced before anything is asked.
    eventually("both policies live", Duration::from_secs(30), || async {
        let (status, reply) = check(&op, Some(&gw), json!({"namespace": TENANT_B, "path": "/"})).await;
        let (_, other) =
            check(&op, Some(&gw), json!({"namespace": TENANT_A, "path": "/", "clientIp": "192.0.2.1"})).await;
        match (status, reply["rules"].as_array().map(Vec::len), other["rules"].as_array().map(Vec::len)) {
            (200, Some(1), Some(1)) => Ok(()),
            other => Err(format!("{other:?} {reply}")),
        }
    })
    .await;

    // No token, a token for another audience, an expired token: 401.
    let victim = json!({"namespace": TENANT_A, "path": "/", "clientIp": "203.0.113.7"});
    assert_eq!(check(&op, None, victim.clone()).await.0, 401);
    for (what, bad) in [("wrong audience", &wrong_audience), ("expired", &expired)] {
        for _ in 0..3 {
            let (status, reply) = check(&op, Some(bad), victim.clone()).await;
            assert_eq!(status, 401, "{what}: {reply}");
        }
    }

    // tenant-b asking about tenant-a: 403, and tenant-a's counter untouched.
    for _ in 0..3 {
        let (status, reply) = check(&op, Some(&b), victim.clone()).await;
        assert_eq!(status, 403, "{reply}");
        assert!(reply["error"].as_str().unwrap_or_default().contains(TENANT_A), "{reply}");
    }
    let (status, reply) = check(&op, Some(&a), victim.clone()).await;
    assert_eq!((status, reply["rules"][0]["remaining"].as_u64()), (200, Some(1)), "{reply}");

    // The snapshot: tenant-b sees its own policy and header names only.
    let snapshot: Value = http()
        .get(op.url("/v1/snapshot"))
        .header("x-sluice-authorization", format!("Bearer {b}"))
        .send()
        .await
        .expect("snapshot")
        .json()
        .await
        .expect("json");
    assert_eq!(snapshot["policies"], json!([format!("{TENANT_B}/api")]), "{snapshot}");
    assert_eq!(snapshot["headerNames"], json!(["authorization"]));

    // The gateway names namespace, cost and client; a tenant's x-sluice-cost: 0 and forged
    // client addresses through ext_authz change nothing (2/min still refuses the third).
    let (status, reply) =
        check(&op, Some(&gw), json!({"namespace": TENANT_A, "path": "/", "clientIp": "198.51.100.9", "cost": 2})).await;
    assert_eq!((status, reply["rules"][0]["remaining"].as_u64()), (200, Some(0)), "{reply}");
    let mut statuses = Vec::new();
    for forged in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let r = http()
            .get(op.url("/v1/authz/"))
            .header("x-sluice-authorization", format!("Bearer {a}"))
            .header("x-sluice-cost", "0")
            .header("x-envoy-external-address", forged)
            .header("x-forwarded-for", forged)
            .send()
            .await
            .expect("authz");
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);

    // One TokenReview per distinct token within the cache time, however often it is used:
    // three accepted (a, b, gateway); the two refused (wrong audience, expired) cost none, as
    // their claims say they cannot be ours.
    let started = Instant::now();
    let requests = 300;
    for i in 0..requests {
        let body = json!({"path": "/keyed", "clientIp": "192.0.2.50", "headers": {"x-api-key": format!("k{}", i % 7)}});
        assert_eq!(check(&op, Some(&a), body).await.0, 200);
    }
    let warm = started.elapsed() / requests;
    let accepted = metric(&op, "sluice_auth_token_reviews_total{result=\"authenticated\"} ").await;
    let refused = metric(&op, "sluice_auth_token_reviews_total{result=\"rejected\"} ").await;
    let unreviewed = metric(&op, "sluice_auth_token_reviews_total{result=\"refused_unreviewed\"} ").await;
    assert_eq!((accepted, refused, unreviewed), (3, 0, 2), "TokenReview calls by result");
    report(&format!(
        "token reviews: {} for {} authenticated checks; warm-cache check round trip {warm:?} (sequential, loopback)",
        accepted + refused,
        requests + 12
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_api_serves_tls_with_the_operators_certificate() {
    let cp = cluster();
    setup(cp);
    let admin_port = control_plane::free_port();
    let admin = format!("127.0.0.1:{admin_port}");
    let op = Operator::start(
        &cp.operator_kubeconfig,
        "auth-tls",
        &[
            "--namespaces",
            TENANT_A,
            "--lease-name",
            "e2e-auth-tls",
            "--token-review=true",
            "--check-api-tls=true",
            "--webhook-host",
            "127.0.0.1",
            "--admin-listen",
            &admin,
        ],
    );
    // Probes and scrapers use the plain admin port.
    eventually("admin /readyz", Duration::from_secs(30), || async {
        let r = http().get(format!("http://{admin}/readyz")).send().await.map_err(|e| e.to_string())?;
        if r.status() == 200 { Ok(()) } else { Err(r.status().to_string()) }
    })
    .await;
    // The check API only speaks TLS, with the certificate whose CA the Secret holds (the CA the
    // webhook gives injected sidecars).
    assert!(http().get(op.url("/healthz")).send().await.is_err(), "no plain HTTP on the check port");
    let ca = cp.kubectl(
        &["get", "secret", "sluice-webhook-tls", "-n", "sluice-system", "-o", "jsonpath={.data.ca\\.crt}"],
        None,
    );
    let ca = base64::engine::general_purpose::STANDARD.decode(ca.trim()).expect("base64 CA");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.crt"), ca).expect("write CA");
    let a = token(cp, TENANT_A, "app", "sluice");
    let url = format!("https://127.0.0.1:{}/v1/check", op.addr.port());
    let curl = |ca: &std::path::Path| {
        std::process::Command::new("curl")
            .args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}", "--cacert"])
            .arg(ca)
            .args(["-H", &format!("x-sluice-authorization: Bearer {a}"), "-H", "content-type: application/json"])
            .args(["--data", r#"{"path": "/", "clientIp": "192.0.2.7"}"#, &url])
            .output()
            .expect("curl runs")
    };
    let reply = eventually("a decision over TLS", Duration::from_secs(30), || async {
        let out = curl(&dir.path().join("ca.crt"));
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.ends_with("\n200") { Ok(text) } else { Err(format!("{text} {}", String::from_utf8_lossy(&out.stderr))) }
    })
    .await;
    assert!(reply.contains("\"allowed\":true"), "{reply}");
    // Another CA does not verify it.
    let other = sluice::admission::certs::generate(&["127.0.0.1".to_string()]).expect("certs");
    std::fs::write(dir.path().join("other.crt"), other.ca_pem).expect("write");
    let out = curl(&dir.path().join("other.crt"));
    assert!(!out.status.success(), "a certificate from the operator's CA only");
}

/// The chart with tenant isolation fully on (TLS, token review, a gateway, a gateway token
/// Secret, the NetworkPolicy) renders to objects the real API server accepts.
#[test]
fn the_chart_with_isolation_on_is_accepted_by_the_api_server() {
    let cp = cluster();
    let repo = env!("CARGO_MANIFEST_DIR");
    let helm = std::process::Command::new("bash")
        .arg(format!("{repo}/e2e/control-plane.sh"))
        .arg("helm")
        .output()
        .expect("helm build");
    assert!(helm.status.success(), "helm: {}", String::from_utf8_lossy(&helm.stderr));
    let helm = String::from_utf8_lossy(&helm.stdout).trim().to_string();
    let rendered = std::process::Command::new(&helm)
        .args(["template", "sluice", &format!("{repo}/charts/sluice"), "--namespace", "sluice-system"])
        .args(["--kube-version", "v1.36.3", "--set", "networkPolicy.enabled=true"])
        .args(["--set", "auth.gatewayServiceAccounts={gateways/envoy}"])
        .args(["--set", "auth.gatewayTokensSecret.name=sluice-gateway-tokens"])
        .args(["--set", "networkPolicy.checkPeers[0].podSelector.matchLabels.app=envoy"])
        .output()
        .expect("helm template");
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let manifest = String::from_utf8_lossy(&rendered.stdout).to_string();
    for needle in
        ["kind: NetworkPolicy", "--check-api-tls=true", "--gateway-service-accounts=gateways/envoy", "--tokens="]
    {
        assert!(manifest.contains(needle), "{needle} missing from the render");
    }
    let applied = cp.kubectl(&["apply", "--dry-run=server", "-f", "-"], Some(&manifest));
    assert!(applied.contains("networkpolicy.networking.k8s.io/sluice created (server dry run)"), "{applied}");
}
