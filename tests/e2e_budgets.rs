//! Policy budgets at admission, against a real kube-apiserver + etcd (e2e/control-plane.sh, see
//! tests/support/control_plane.rs): the CRD's schema and CEL refuse what they can count even
//! without the webhook, the validating webhook refuses every over-budget policy naming its field,
//! and a policy over the compiled-regex budget that only the webhook can measure is stored but
//! not enforced when the webhook is absent.
//!
//! Without a control plane these tests fail (they never skip): run e2e/control-plane.sh build.

#[path = "support/control_plane.rs"]
mod control_plane;

use std::time::Duration;

use control_plane::{Operator, cluster, eventually, free_port, namespace};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use sluice::policy::RateLimitPolicy;

const LOG_CAP: &str =
    "slidingWindowLog allows at most 1000 requests per window; use slidingWindowCounter for larger limits";
const REGEX_COUNT: &str = "at most 64 regexes per policy (match.paths, match.headers and match.descriptor of all rules and priorities together)";
const REGEX_SIZE: &str = "over the budget of 1 MiB (1048576 bytes) per policy";

fn rule(name: &str) -> Value {
    json!({"name": name, "algorithm": "gcra", "limit": {"requests": 5, "per": "1s"}})
}

fn policy(ns: &str, name: &str, rules: Vec<Value>) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": name}}, "rules": rules}
    })
}

/// Three rules, the third a slidingWindowLog of `requests`: refused at spec.rules[2].limit.requests
/// above 1000.
fn log_policy(ns: &str, name: &str, requests: u64) -> Value {
    let mut fixed = rule("b");
    fixed["algorithm"] = json!("fixedWindow");
    let log = json!({"name": "log", "algorithm": "slidingWindowLog", "limit": {"requests": requests, "per": "1m"}});
    policy(ns, name, vec![rule("a"), fixed, log])
}

/// 32 path and 32 header regexes in the first rule (the budget), plus `extra` path regexes in a
/// second rule.
fn regex_count_policy(ns: &str, name: &str, extra: usize) -> Value {
    let mut full = rule("a");
    full["match"] = json!({
        "paths": vec![json!({"regex": "/a[0-9]+"}); 32],
        "headers": vec![json!({"name": "x", "regex": "a[0-9]+"}); 32],
    });
    let mut more = rule("c");
    more["match"] = json!({"paths": vec![json!({"regex": "/c[0-9]+"}); extra]});
    policy(ns, name, if extra == 0 { vec![full] } else { vec![full, more] })
}

/// `n` header regexes of about 220 KB compiled each (`\w` is a large Unicode class): over the
/// 1 MiB budget from the fifth on.
fn regex_size_policy(ns: &str, name: &str, n: usize) -> Value {
    let mut big = rule("a");
    big["match"] = json!({"headers": vec![json!({"name": "x", "regex": r"\w{4}"}); n]});
    policy(ns, name, vec![big])
}

fn too_many_rules(ns: &str, name: &str) -> Value {
    policy(ns, name, (0..65).map(|i| rule(&format!("r{i}"))).collect())
}

/// What the shared validation says about `body`, as "path: message" lines.
fn validation_errors(body: &Value) -> Vec<String> {
    let typed: RateLimitPolicy = serde_json::from_value(body.clone()).expect("typed policy");
    match sluice::policy::validate(&typed) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(ToString::to_string).collect(),
    }
}

async fn apply(client: &Client, ns: &str, body: &Value) -> Result<RateLimitPolicy, kube::Error> {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let name = body["metadata"]["name"].as_str().expect("name");
    api.patch(name, &PatchParams::apply("e2e-budgets").force(), &Patch::Apply(body)).await
}

async fn refused(client: &Client, ns: &str, body: &Value) -> String {
    match apply(client, ns, body).await {
        Ok(_) => panic!("{} was admitted", body["metadata"]["name"]),
        Err(e) => e.to_string(),
    }
}

/// Waits for the operator's /readyz; fails with its logs if it exits or never gets ready.
async fn ready(op: &mut Operator) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("http client");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(response) = http.get(op.url("/readyz")).send().await
            && response.status() == 200
        {
            return;
        }
        if let Ok(Some(status)) = op.child.try_wait() {
            panic!("operator exited ({status}):\n{}", op.logs());
        }
        assert!(std::time::Instant::now() < deadline, "operator not ready after 30 s:\n{}", op.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_and_cel_refuse_the_budgets_they_can_count_without_the_webhook() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-budgets-cel";
    namespace(&client, ns, json!({})).await;

    let err = refused(&client, ns, &log_policy(ns, "log", 1001)).await;
    assert!(err.contains("spec.rules[2].limit.requests") && err.contains(LOG_CAP), "{err}");
    apply(&client, ns, &log_policy(ns, "log", 1000)).await.expect("1000 per window is within the budget");

    let err = refused(&client, ns, &regex_count_policy(ns, "count", 1)).await;
    assert!(err.contains("spec.rules") && err.contains(REGEX_COUNT), "{err}");
    apply(&client, ns, &regex_count_policy(ns, "count", 0)).await.expect("64 regexes are within the budget");

    let err = refused(&client, ns, &too_many_rules(ns, "rules")).await;
    assert!(err.contains("spec.rules") && err.contains("must have at most 64 items"), "{err}");

    // The compiled size is beyond CEL: without the webhook the policy is stored, and the operator
    // refuses to enforce it with the shared validation's message.
    let size = regex_size_policy(ns, "size", 8);
    let expected = validation_errors(&size);
    assert!(expected.len() == 1 && expected[0].contains(REGEX_SIZE), "{expected:?}");
    let path = expected[0].split(": ").next().expect("path").to_string();
    apply(&client, ns, &size).await.expect("stored without the webhook");
    let mut op = Operator::start(&cp.operator_kubeconfig, "budgets-status", &["--namespaces", ns, "--lease-name", ns]);
    ready(&mut op).await;
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let message = eventually("Accepted=False on the over-budget policy", Duration::from_secs(30), || async {
        let p = api.get("size").await.map_err(|e| e.to_string())?;
        let accepted = p.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == "Accepted")).cloned();
        match accepted {
            Some(c) if c.status == "False" => Ok(c.message),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(message.contains(&path) && message.contains(REGEX_SIZE), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_refuses_every_over_budget_policy_naming_its_field() {
    let cp = cluster();
    assert!(
        std::env::var_os("SLUICE_E2E_KUBECONFIG").is_none(),
        "the webhook e2e test registers https://127.0.0.1:<port>: it needs the local control plane"
    );
    let client = cp.client().await;
    let ns = "e2e-budgets-webhook";
    namespace(&client, ns, json!({"sluice-e2e": "budgets"})).await;
    let port = free_port();
    let config = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        // deploy/rbac.yaml lets the operator patch only the configurations named sluice.
        "metadata": {"name": "sluice"},
        "webhooks": [{
            "name": "policies.sluice.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail", "namespaceSelector": {"matchLabels": {"sluice-e2e": "budgets"}},
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate-policy")},
            "rules": [{"apiGroups": ["sluice.dev"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"], "resources": ["ratelimitpolicies"]}]
        }]
    });
    cp.kubectl(&["apply", "-f", "-"], Some(&config.to_string()));
    let listen = format!("127.0.0.1:{port}");
    let mut op = Operator::start(
        &cp.operator_kubeconfig,
        "budgets-webhook",
        &[
            "--namespaces",
            ns,
            "--lease-name",
            ns,
            "--webhook-listen",
            &listen,
            "--webhook-host",
            "127.0.0.1",
            "--mutating-webhook",
            "",
        ],
    );
    ready(&mut op).await;

    // Through the API server. The compiled size only the webhook measures; it names the first
    // regex over the budget, as validate() does here.
    let size = regex_size_policy(ns, "size", 8);
    let expected = validation_errors(&size);
    assert!(expected.len() == 1 && expected[0].contains(REGEX_SIZE), "{expected:?}");
    let path = expected[0].split(": ").next().expect("path").to_string();
    let err = eventually("the webhook refuses the compiled-size budget", Duration::from_secs(30), || async {
        match apply(&client, ns, &size).await {
            Err(e) if e.to_string().contains(&path) => Ok(e.to_string()),
            Err(e) => Err(e.to_string()),
            Ok(_) => {
                // Admitted before the caBundle and listener were in place: remove and retry.
                let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
                let _ = api.delete("size", &Default::default()).await;
                Err("admitted".into())
            }
        }
    })
    .await;
    assert!(err.contains("denied the request") && err.contains(REGEX_SIZE), "{err}");
    // The counted budgets: CEL runs before the webhook, with the same field and message.
    let err = refused(&client, ns, &log_policy(ns, "log", 1001)).await;
    assert!(err.contains("spec.rules[2].limit.requests") && err.contains(LOG_CAP), "{err}");
    let err = refused(&client, ns, &regex_count_policy(ns, "count", 1)).await;
    assert!(err.contains("spec.rules") && err.contains(REGEX_COUNT), "{err}");
    // Within every budget: admitted.
    apply(&client, ns, &log_policy(ns, "log", 1000)).await.expect("log within budget");
    apply(&client, ns, &regex_count_policy(ns, "count", 0)).await.expect("64 regexes");
    apply(&client, ns, &regex_size_policy(ns, "small", 1)).await.expect("one large regex");

    // The webhook itself, asked directly (the API server would stop these at the schema or CEL
    // first): it refuses each one with its field, so it does not rely on CEL.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "sluice-system");
    let ca = secrets.get("sluice-webhook-tls").await.expect("webhook Secret").data.expect("data")["ca.crt"].0.clone();
    let ca_file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(ca_file.path(), ca).expect("write CA");
    let url = format!("https://127.0.0.1:{port}/validate-policy");
    let cases = [
        (log_policy(ns, "log-direct", 1001), format!("spec.rules[2].limit.requests: {LOG_CAP}")),
        (regex_count_policy(ns, "count-direct", 1), format!("spec.rules: {REGEX_COUNT}, got 65")),
        (regex_size_policy(ns, "size-direct", 8), path.clone()),
        (too_many_rules(ns, "rules-direct"), "spec.rules: at most 64 rules, got 65".to_string()),
    ];
    for (body, want) in cases {
        let response = review(&url, ca_file.path(), &body);
        assert_eq!(response["allowed"], json!(false), "{} admitted: {response}", body["metadata"]["name"]);
        let message = response["status"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(&want), "{}: want {want:?} in {response}", body["metadata"]["name"]);
    }
    let response = review(&url, ca_file.path(), &log_policy(ns, "fine-direct", 1000));
    assert_eq!(response["allowed"], json!(true), "{response}");
}

/// Sends an AdmissionReview for creating `object` to the webhook at `url` (curl: the test's HTTP
/// client has no TLS) and returns its `response`.
fn review(url: &str, ca: &std::path::Path, object: &Value) -> Value {
    let body = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "00000000-0000-0000-0000-000000000001",
            "kind": {"group": "sluice.dev", "version": "v1alpha1", "kind": "RateLimitPolicy"},
            "resource": {"group": "sluice.dev", "version": "v1alpha1", "resource": "ratelimitpolicies"},
            "requestKind": {"group": "sluice.dev", "version": "v1alpha1", "kind": "RateLimitPolicy"},
            "requestResource": {"group": "sluice.dev", "version": "v1alpha1", "resource": "ratelimitpolicies"},
            "name": object["metadata"]["name"], "namespace": object["metadata"]["namespace"],
            "operation": "CREATE", "userInfo": {"username": "e2e"}, "object": object, "dryRun": false
        }
    });
    let mut child = std::process::Command::new("curl")
        .args(["-sS", "--fail", "--max-time", "10", "--cacert"])
        .arg(ca)
        .args(["-H", "Content-Type: application/json", "--data-binary", "@-", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("curl runs");
    {
        use std::io::Write;
        child.stdin.take().expect("stdin").write_all(body.to_string().as_bytes()).expect("write review");
    }
    let out = child.wait_with_output().expect("curl output");
    assert!(out.status.success(), "curl {url}: {}", String::from_utf8_lossy(&out.stderr));
    let reply: Value = serde_json::from_slice(&out.stdout).expect("AdmissionReview JSON");
    reply["response"].clone()
}
