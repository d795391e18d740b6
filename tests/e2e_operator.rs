//! `sluice operator` against a real kube-apiserver + etcd (e2e/control-plane.sh), or any cluster
//! named by SLUICE_E2E_KUBECONFIG. Operators run as user `sluice-operator`, bound only to the
//! roles in deploy/rbac.yaml, so every test also proves those roles are enough.
//!
//! Each test uses its own namespace (`--namespaces`) and Lease, so tests run in parallel without
//! seeing each other's policies or leaders.

#[path = "support/control_plane.rs"]
mod control_plane;

use std::time::{Duration, Instant};

use control_plane::{Operator, cluster, eventually, free_port, namespace, report};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use sluice::policy::RateLimitPolicy;

fn policy(ns: &str, name: &str, rule: &str, requests: u64) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": name}}, "rules": [{
            "name": rule, "key": [{"header": "X-API-Key"}], "algorithm": "fixedWindow",
            "limit": {"requests": requests, "per": "1h"}
        }]}
    })
}

async fn apply(client: &Client, ns: &str, body: &Value) -> Result<RateLimitPolicy, kube::Error> {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let name = body["metadata"]["name"].as_str().expect("name");
    api.patch(name, &PatchParams::apply("e2e-test").force(), &Patch::Apply(body)).await
}

fn condition<'a>(
    p: &'a RateLimitPolicy,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    p.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
}

/// Waits until the policy's status describes its current generation with `Accepted` = `accepted`.
async fn settled(client: &Client, ns: &str, name: &str, accepted: &str) -> RateLimitPolicy {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    eventually(&format!("status of {ns}/{name}"), Duration::from_secs(30), || async {
        let p = api.get(name).await.map_err(|e| e.to_string())?;
        let status = p.status.clone().unwrap_or_default();
        let current = status.observed_generation == p.metadata.generation;
        match condition(&p, "Accepted") {
            Some(c) if current && c.status == accepted && c.observed_generation == p.metadata.generation => Ok(p),
            _ => Err(format!("status {:?}", p.status)),
        }
    })
    .await
}

async fn check_limit(http: &reqwest::Client, op: &Operator, ns: &str, app: &str) -> Option<u64> {
    let body = json!({"namespace": ns, "labels": {"app": app}, "path": "/", "headers": {"x-api-key": "k"}});
    let reply: Value = http.post(op.url("/v1/check")).json(&body).send().await.ok()?.json().await.ok()?;
    reply["rules"].get(0)?["limit"].as_u64()
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("http client")
}

async fn ready(http: &reqwest::Client, op: &Operator) {
    eventually("operator /readyz", Duration::from_secs(30), || async {
        let status = http.get(op.url("/readyz")).send().await.map_err(|e| e.to_string())?.status();
        if status == 200 { Ok(()) } else { Err(format!("{status}")) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_policies_are_accepted_and_enforced_invalid_ones_rejected() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-status";
    namespace(&client, ns, json!({})).await;
    let op = Operator::start(&cp.operator_kubeconfig, "status-1", &["--namespaces", ns, "--lease-name", "e2e-status"]);
    let http = http();
    ready(&http, &op).await;

    apply(&client, ns, &policy(ns, "orders", "per-key", 7)).await.expect("valid policy applies");
    let p = settled(&client, ns, "orders", "True").await;
    let enforced = condition(&p, "Enforced").expect("Enforced");
    assert_eq!(enforced.status, "True", "{enforced:?}");
    let snapshot: Value = http.get(op.url("/v1/snapshot")).send().await.expect("snapshot").json().await.expect("json");
    let version = snapshot["version"].as_str().or(snapshot["view"]["version"].as_str()).unwrap_or_default().to_string();
    assert!(!version.is_empty() && enforced.message.contains(&version), "{enforced:?} vs {snapshot}");
    assert_eq!(check_limit(&http, &op, ns, "orders").await, Some(7));

    // Valid for CEL, invalid for the shared validation (a regex that does not compile): with no
    // webhook in front it is stored, and its status says why it is not enforced.
    let mut bad = policy(ns, "broken", "per-key", 5);
    bad["spec"]["rules"][0]["match"] = json!({"paths": [{"regex": "(unclosed"}]});
    apply(&client, ns, &bad).await.expect("stored without the webhook");
    let p = settled(&client, ns, "broken", "False").await;
    let accepted = condition(&p, "Accepted").expect("Accepted");
    assert_eq!(accepted.reason, "Invalid");
    assert!(accepted.message.contains("spec.rules[0].match.paths[0].regex"), "{accepted:?}");
    assert_eq!(condition(&p, "Enforced").map(|c| c.status.as_str()), Some("False"));
    // The valid policy stays enforced beside the broken one.
    assert_eq!(check_limit(&http, &op, ns, "orders").await, Some(7));

    // Events for both outcomes.
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    eventually("Accepted and Rejected events", Duration::from_secs(10), || async {
        let list = events.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
        let reasons: Vec<_> = list.items.iter().filter_map(|e| e.reason.clone()).collect();
        if reasons.iter().any(|r| r == "Accepted") && reasons.iter().any(|r| r == "Rejected") {
            Ok(())
        } else {
            Err(format!("{reasons:?}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cel_refuses_invalid_policies_with_messages() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-cel";
    namespace(&client, ns, json!({})).await;
    // Through the API server's schema: rule-level CEL with its message and field.
    let mut burst = policy(ns, "burst", "r", 1);
    burst["spec"]["rules"][0]["limit"]["burst"] = json!(5);
    let err = apply(&client, ns, &burst).await.expect_err("burst on fixedWindow refused").to_string();
    assert!(
        err.contains("spec.rules[0]") && err.contains("limit.burst is only used by tokenBucket, gcra and leakyBucket"),
        "{err}"
    );

    let mut per = policy(ns, "per", "r", 1);
    per["spec"]["rules"][0]["limit"]["per"] = json!("10 seconds");
    let err = apply(&client, ns, &per).await.expect_err("bad duration refused").to_string();
    assert!(err.contains("spec.rules[0].limit.per") && err.contains("must be a duration such as 1s"), "{err}");

    // Duplicate rule names: rules is a list-map keyed by name, so a create is refused naming the
    // duplicate (server-side apply refuses it even earlier, when building the typed patch).
    let mut dup = policy(ns, "dup", "same", 1);
    let rule = dup["spec"]["rules"][0].clone();
    dup["spec"]["rules"] = json!([rule.clone(), rule]);
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let typed: RateLimitPolicy = serde_json::from_value(dup).expect("typed");
    let err = api.create(&PostParams::default(), &typed).await.expect_err("duplicate rule names refused").to_string();
    assert!(
        err.contains("spec.rules[1]") && (err.contains("Duplicate value") || err.contains("rule names must be unique")),
        "{err}"
    );
}

async fn holder(client: &Client, lease: &str) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    api.get_opt(lease).await.ok()??.spec?.holder_identity
}

/// How many times the Lease changed hands (kube-lease-manager counts every acquisition).
async fn transitions(client: &Client, lease: &str) -> i32 {
    let api: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    api.get_opt(lease).await.ok().flatten().and_then(|l| l.spec?.lease_transitions).unwrap_or(0)
}

/// reportingInstance of every Event about `policy` (the status writer's identity).
async fn reporters(client: &Client, ns: &str, policy: &str) -> Vec<String> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events.list(&ListParams::default()).await.expect("events");
    list.items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(policy))
        .filter_map(|e| e.reporting_instance)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_writes_status_and_a_killed_leader_is_replaced() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-leader";
    namespace(&client, ns, json!({})).await;
    let lease_seconds = 6;
    let args = ["--namespaces", ns, "--lease-name", "e2e-leader", "--lease-duration", "6s"];
    let mut a = Operator::start(&cp.operator_kubeconfig, "leader-a", &args);
    let mut b = Operator::start(&cp.operator_kubeconfig, "leader-b", &args);
    let http = http();
    ready(&http, &a).await;
    ready(&http, &b).await;
    let first = eventually("a Lease holder", Duration::from_secs(30), || async {
        holder(&client, "e2e-leader").await.ok_or_else(|| "no holder".to_string())
    })
    .await;
    let transitions_at_first = transitions(&client, "e2e-leader").await;

    apply(&client, ns, &policy(ns, "one", "r", 3)).await.expect("applies");
    settled(&client, ns, "one", "True").await;
    // Both replicas enforce it; only the leader wrote status and events.
    for op in [&a, &b] {
        let limit = eventually("both replicas enforce", Duration::from_secs(10), || async {
            check_limit(&http, op, ns, "one").await.ok_or_else(|| "no rule".to_string())
        })
        .await;
        assert_eq!(limit, 3);
    }
    let seen = eventually("the leader's Accepted event", Duration::from_secs(10), || async {
        let r = reporters(&client, ns, "one").await;
        if r.is_empty() { Err("no events".into()) } else { Ok(r) }
    })
    .await;
    if !seen.iter().all(|r| *r == first) {
        // Two reporters are only right if the Lease really changed hands in between (a renewal
        // missed its 2 s grace on a loaded machine), never two writers under one leadership.
        let now = transitions(&client, "e2e-leader").await;
        assert!(
            now > transitions_at_first && seen.iter().all(|r| r == "leader-a" || r == "leader-b"),
            "events from {seen:?} while the Lease stayed with {first} (transitions {transitions_at_first} -> {now})"
        );
        report(&format!(
            "the Lease changed hands during the status check ({transitions_at_first} -> {now} transitions)"
        ));
    }
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let managers: Vec<String> = api
        .get("one")
        .await
        .expect("get")
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.manager)
        .collect();
    assert_eq!(managers, ["sluice-operator"], "one field manager owns status");

    // Kill the leader (the holder now, which is `first` unless the Lease changed hands above)
    // without a chance to release its Lease.
    let current = holder(&client, "e2e-leader").await.unwrap_or(first);
    let (leader, survivor) = if current == "leader-a" { (&mut a, "leader-b") } else { (&mut b, "leader-a") };
    let leases: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    leader.kill();
    let killed = Instant::now();
    // The last renewal before the kill: no one may take over before it expires.
    let renewed = leases.get("e2e-leader").await.expect("lease").spec.and_then(|s| s.renew_time).expect("renewTime");
    eventually("the survivor takes the Lease", Duration::from_secs(lease_seconds * 3), || async {
        match holder(&client, "e2e-leader").await {
            Some(h) if h == survivor => Ok(()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    let failover = killed.elapsed();
    let since_renewal = k8s_openapi::jiff::Timestamp::now().duration_since(renewed.0);
    report(&format!(
        "failover: {failover:?} after the kill, {since_renewal:?} after the last renewal (lease duration {lease_seconds}s)"
    ));
    // The Lease cannot change hands before it expires (up to one lease duration after the kill);
    // then the survivor force-releases it, waits a random 0.1-1 s (kube-lease-manager's collision
    // avoidance) and takes it: about 6.1-6.7 s on an idle 2-core machine. The bounds leave room
    // for a loaded machine while still failing if the survivor waited for a second expiry.
    assert!(failover < Duration::from_secs(lease_seconds * 2), "failover took {failover:?}");
    assert!(since_renewal.as_secs_f64() < (lease_seconds * 2) as f64, "{since_renewal:?} after the last renewal");

    // The new leader writes status.
    apply(&client, ns, &policy(ns, "two", "r", 4)).await.expect("applies");
    settled(&client, ns, "two", "True").await;
    // Events are recorded after the status write; wait for them rather than racing it.
    let seen = eventually("the new leader's Accepted event", Duration::from_secs(10), || async {
        let r = reporters(&client, ns, "two").await;
        if r.is_empty() { Err("no events".into()) } else { Ok(r) }
    })
    .await;
    assert!(seen.iter().all(|r| r == survivor), "events from {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_reaches_both_replicas_quickly() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-latency";
    namespace(&client, ns, json!({})).await;
    let args = ["--namespaces", ns, "--lease-name", "e2e-latency"];
    let a = Operator::start(&cp.operator_kubeconfig, "latency-a", &args);
    let b = Operator::start(&cp.operator_kubeconfig, "latency-b", &args);
    let http = http();
    ready(&http, &a).await;
    ready(&http, &b).await;

    let mut delays = Vec::new();
    for i in 0..20u64 {
        let requests = 100 + i;
        let started = Instant::now();
        apply(&client, ns, &policy(ns, "tuned", "r", requests)).await.expect("applies");
        for op in [&a, &b] {
            eventually("the new limit on every replica", Duration::from_secs(10), || async {
                match check_limit(&http, op, ns, "tuned").await {
                    Some(l) if l == requests => Ok(()),
                    other => Err(format!("limit {other:?}")),
                }
            })
            .await;
        }
        delays.push(started.elapsed());
    }
    delays.sort();
    let median = delays[delays.len() / 2];
    let p99 = delays[(delays.len() * 99).div_ceil(100) - 1];
    report(&format!(
        "apply-to-enforced on both replicas over {} changes: median {median:?}, p99 {p99:?}",
        delays.len()
    ));
    assert!(median < Duration::from_secs(1), "median {median:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_refuse_invalid_policies_and_inject_labelled_pods() {
    let cp = cluster();
    // The webhooks are registered at https://127.0.0.1:<port>, reachable only by an API server
    // on this machine; a kind cluster reaches them through the chart's Service instead.
    assert!(
        std::env::var_os("SLUICE_E2E_KUBECONFIG").is_none(),
        "this test needs the local control plane: unset SLUICE_E2E_KUBECONFIG or run it with --skip webhooks"
    );
    let client = cp.client().await;
    let ns = "e2e-webhook";
    namespace(&client, ns, json!({"sluice-e2e": "webhook"})).await;
    let port = free_port();
    // The configurations exist before the operator starts, which patches their caBundle.
    let scope = json!({"matchLabels": {"sluice-e2e": "webhook"}});
    let validating = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "sluice"},
        "webhooks": [{
            "name": "policies.sluice.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail", "namespaceSelector": scope,
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate-policy")},
            "rules": [{"apiGroups": ["sluice.dev"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"], "resources": ["ratelimitpolicies"]}]
        }]
    });
    let mutating = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "sluice"},
        "webhooks": [{
            "name": "inject.sluice.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            // A down operator must never block pods.
            "failurePolicy": "Ignore", "reinvocationPolicy": "Never", "namespaceSelector": scope,
            "objectSelector": {"matchLabels": {"sluice.dev/inject": "true"}},
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/mutate-pod")},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
        }]
    });
    cp.kubectl(&["apply", "-f", "-"], Some(&validating.to_string()));
    cp.kubectl(&["apply", "-f", "-"], Some(&mutating.to_string()));
    let op = Operator::start(
        &cp.operator_kubeconfig,
        "webhook-1",
        &[
            "--token-review=true",
            "--namespaces",
            ns,
            "--lease-name",
            "e2e-webhook",
            "--webhook-listen",
            &format!("127.0.0.1:{port}"),
            "--webhook-host",
            "127.0.0.1",
            "--sidecar-image",
            "sluice:e2e",
            "--sidecar-endpoint",
            "http://sluice.sluice-system.svc:8080",
        ],
    );
    let http = http();
    ready(&http, &op).await;

    // A regex that does not compile passes CEL; the webhook refuses it naming the field.
    let mut bad = policy(ns, "broken", "per-key", 5);
    bad["spec"]["rules"][0]["match"] = json!({"paths": [{"regex": "(unclosed"}]});
    let refusal = eventually("the webhook refuses", Duration::from_secs(30), || async {
        match apply(&client, ns, &bad).await {
            Err(e) if e.to_string().contains("spec.rules[0].match.paths[0].regex") => Ok(e.to_string()),
            Err(e) => Err(e.to_string()),
            Ok(_) => {
                // Admitted before the caBundle/listener were in place: remove and retry.
                let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
                let _ = api.delete("broken", &Default::default()).await;
                Err("admitted".into())
            }
        }
    })
    .await;
    assert!(refusal.contains("denied the request"), "{refusal}");

    // Cross-policy conflict: same selector, same rule name.
    apply(&client, ns, &policy(ns, "first", "per-key", 5)).await.expect("first applies");
    let mut second = policy(ns, "second", "per-key", 9);
    second["spec"]["selector"] = json!({"matchLabels": {"app": "first"}});
    let err = apply(&client, ns, &second).await.expect_err("conflict refused").to_string();
    assert!(err.contains("conflicts with policy first"), "{err}");

    // Risky but valid: admitted, with the shared warnings() as admission warnings (kubectl prints them).
    let out = cp.kubectl(&["apply", "-f", "-"], Some(&policy(ns, "warned", "per-key", 5).to_string()));
    assert!(out.contains("Warning:") && out.contains("keyed on header X-API-Key"), "{out}");

    // Layers: a namespace-wide limit per tenant, and a per-route rule behind it that can never
    // refuse. Admitted with the layering report as a warning, the condition set to False with
    // an Event; refused when the policy asks for strict mode.
    let edge = json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": "edge", "namespace": ns},
        "spec": {"rules": [{"name": "per-tenant", "key": [{"header": "X-Tenant"}], "algorithm": "fixedWindow",
                            "limit": {"requests": 10, "per": "1m"}}]}
    });
    apply(&client, ns, &edge).await.expect("edge applies");
    let routes = |name: &str, strict: bool| {
        let mut body = json!({
            "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": {"app": name}}, "rules": [{
                "name": "per-tenant-route", "match": {"paths": [{"prefix": "/orders"}]},
                "key": [{"header": "X-Tenant"}, {"path": true}], "algorithm": "fixedWindow",
                "limit": {"requests": 100, "per": "1m"}}]}
        });
        if strict {
            body["spec"]["layering"] = json!("strict");
        }
        body
    };
    let out = cp.kubectl(&["apply", "-f", "-"], Some(&routes("routes", false).to_string()));
    assert!(
        out.contains("Warning: layering: e2e-webhook/routes spec.rules[0] (per-tenant-route): unreachable"),
        "{out}"
    );
    assert!(out.contains("e2e-webhook/edge rule per-tenant"), "{out}");
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let layered = eventually("LayeringConsistent False", Duration::from_secs(30), || async {
        let p = api.get("routes").await.map_err(|e| e.to_string())?;
        match condition(&p, "LayeringConsistent") {
            Some(c) if c.status == "False" => Ok(c.clone()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert_eq!(layered.reason, "Unreachable");
    assert!(layered.message.starts_with("spec.rules[0] (per-tenant-route): unreachable"), "{}", layered.message);
    let edge_status = settled(&client, ns, "edge", "True").await;
    assert_eq!(condition(&edge_status, "LayeringConsistent").map(|c| c.status.as_str()), Some("True"));
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    eventually("an Unreachable event", Duration::from_secs(10), || async {
        let list = events.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
        let found = list.items.iter().any(|e| {
            e.reason.as_deref() == Some("Unreachable")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("routes")
        });
        if found { Ok(()) } else { Err("no event yet".to_string()) }
    })
    .await;
    let err = apply(&client, ns, &routes("strict-routes", true)).await.expect_err("strict refuses").to_string();
    assert!(err.contains("layering: unreachable") && err.contains("spec.layering: strict"), "{err}");

    // Every replica serves the keypair kept in this Secret (the CA the caBundle holds).
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), "sluice-system");
    let secret = secrets.get("sluice-webhook-tls").await.expect("webhook Secret");
    let data = secret.data.unwrap_or_default();
    assert!(["ca.crt", "tls.crt", "tls.key"].iter().all(|k| data.contains_key(*k)), "{:?}", data.keys());

    // A second replica reuses the Secret's keypair: with the webhook pointed at it (caBundle
    // unchanged), the API server still trusts it and it refuses the same policy.
    let port2 = free_port();
    let second_replica = Operator::start(
        &cp.operator_kubeconfig,
        "webhook-2",
        &[
            "--namespaces",
            ns,
            "--lease-name",
            "e2e-webhook",
            "--webhook-listen",
            &format!("127.0.0.1:{port2}"),
            "--webhook-host",
            "127.0.0.1",
        ],
    );
    ready(&http, &second_replica).await;
    let configs: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    let mut config = configs.get("sluice").await.expect("config");
    let hook = &mut config.webhooks.as_mut().expect("webhooks")[0];
    assert_eq!(
        hook.client_config.ca_bundle.as_ref().map(|b| &b.0),
        Some(&data["ca.crt"].0),
        "caBundle is the Secret's CA"
    );
    hook.client_config.url = Some(format!("https://127.0.0.1:{port2}/validate-policy"));
    configs.replace("sluice", &PostParams::default(), &config).await.expect("repoint the webhook");
    let err = eventually("the second replica refuses", Duration::from_secs(20), || async {
        match apply(&client, ns, &bad).await {
            Err(e) if e.to_string().contains("spec.rules[0].match.paths[0].regex") => Ok(e.to_string()),
            Err(e) => Err(e.to_string()),
            Ok(_) => Err("admitted".into()),
        }
    })
    .await;
    assert!(err.contains("denied the request"), "{err}");

    // Pods: only the labelled one gets the sidecar (no nodes: they stay Pending, but the stored
    // spec shows what admission did).
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for (name, labels) in
        [("injected", json!({"app": "a", "sluice.dev/inject": "true"})), ("plain", json!({"app": "a"}))]
    {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "app", "image": "app:1"}]}
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod).await.expect("pod created");
    }
    let containers = |p: Pod| -> Vec<String> {
        p.spec.map(|s| s.containers.into_iter().map(|c| c.name).collect()).unwrap_or_default()
    };
    let injected = pods.get("injected").await.expect("get");
    // Native (an init container, API servers from 1.29) or classic (a container).
    let sidecar = injected.spec.as_ref().and_then(|s| {
        s.containers.iter().chain(s.init_containers.iter().flatten()).find(|c| c.name == "sluice-sidecar").cloned()
    });
    let sidecar = sidecar.unwrap_or_else(|| panic!("no sidecar in {:?}; operator logs:\n{}", injected.spec, op.logs()));
    assert_eq!(sidecar.image.as_deref(), Some("sluice:e2e"));
    // The API server accepted the projected, audience-bound token the sidecar presents.
    let volumes = injected.spec.as_ref().and_then(|s| s.volumes.clone()).unwrap_or_default();
    let token = volumes.iter().find(|v| v.name == "sluice-token").expect("token volume");
    let projection = token.projected.as_ref().and_then(|p| p.sources.as_ref()).and_then(|s| s.first()).cloned();
    let audience = projection.and_then(|p| p.service_account_token).and_then(|t| t.audience);
    assert_eq!(audience.as_deref(), Some("sluice"));
    assert!(sidecar.env.iter().flatten().any(|e| e.name == "SLUICE_TOKEN_FILE"));
    assert_eq!(containers(pods.get("plain").await.expect("get")), ["app"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_gracefully_and_releases_the_lease() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-release";
    namespace(&client, ns, json!({})).await;
    let args = ["--namespaces", ns, "--lease-name", "e2e-release", "--lease-duration", "30s"];
    let mut a = Operator::start(&cp.operator_kubeconfig, "release-a", &args);
    let http = http();
    ready(&http, &a).await;
    eventually("release-a leads", Duration::from_secs(30), || async {
        match holder(&client, "e2e-release").await {
            Some(h) if h == "release-a" => Ok(()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    let status = a.terminate();
    assert!(status.success(), "operator exit {status:?}:\n{}", a.logs());
    // Released on the way out: a successor need not wait out the 30 s lease.
    let lease = holder(&client, "e2e-release").await;
    assert!(lease.as_deref() != Some("release-a"), "still held by {lease:?}");
}

/// Two replicas that start together can both see the Lease orphaned; the second one's
/// acquisition (kube-lease-manager's server-side apply of holderIdentity, without
/// resourceVersion or force) must then conflict instead of overwriting the first one's hold, or
/// both lead until the loser's first renewal and status and events are written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_replica_cannot_take_a_held_lease_by_applying_it() {
    let cp = cluster();
    let client = control_plane::client_for(&cp.operator_kubeconfig).await;
    let name = "e2e-held";
    let (leading, task) =
        sluice::operator::leader::elect(client.clone(), "sluice-system", name, "held-a", Duration::from_secs(6))
            .await
            .expect("joins");
    let mut watch = leading.clone();
    tokio::time::timeout(Duration::from_secs(20), watch.wait_for(|l| *l)).await.expect("held-a leads").expect("open");

    let leases: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(k8s_openapi::jiff::Timestamp::now());
    let taking = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "spec": {"acquireTime": now, "renewTime": now, "holderIdentity": "held-b", "leaseDurationSeconds": 6}
    });
    let manager = sluice::operator::leader::lease_field_manager("held-b");
    let outcome = leases
        .patch(name, &PatchParams { field_manager: Some(manager), ..Default::default() }, &Patch::Apply(&taking))
        .await;
    assert!(
        matches!(&outcome, Err(kube::Error::Api(e)) if e.code == 409),
        "a second replica's apply must conflict, got {outcome:?}"
    );
    assert_eq!(holder(&client, name).await.as_deref(), Some("held-a"));
    drop((leading, watch));
    let _ = task.await;
}

/// The leader loses the API server (its connections drop, new ones are closed) for longer than
/// its Lease: it stops acting as leader before the Lease expires, the other replica takes over
/// and writes status, the cut-off replica goes on enforcing its last snapshot, and once it is
/// back it follows (its watches resume) without writing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_the_api_server_steps_down_and_the_other_takes_over() {
    let cp = cluster();
    let client = cp.client().await;
    let (ns, lease) = ("e2e-partition", "e2e-partition");
    namespace(&client, ns, json!({})).await;
    let lease_seconds = 6;
    let args = ["--namespaces", ns, "--lease-name", lease, "--lease-duration", "6s"];
    let proxy = control_plane::CuttableProxy::start(cp.api_server()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let through_proxy = control_plane::kubeconfig_via(&cp.operator_kubeconfig, cp.api_server(), proxy.addr, dir.path());
    let a = Operator::start(&through_proxy, "partition-a", &args);
    let http = http();
    ready(&http, &a).await;
    eventually("partition-a leads", Duration::from_secs(30), || async {
        match holder(&client, lease).await {
            Some(h) if h == "partition-a" => Ok(()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    let b = Operator::start(&cp.operator_kubeconfig, "partition-b", &args);
    ready(&http, &b).await;
    apply(&client, ns, &policy(ns, "one", "r", 3)).await.expect("applies");
    settled(&client, ns, "one", "True").await;
    for op in [&a, &b] {
        eventually("both replicas enforce", Duration::from_secs(10), || async {
            check_limit(&http, op, ns, "one").await.filter(|l| *l == 3).ok_or_else(|| "no rule".to_string())
        })
        .await;
    }

    proxy.cut();
    let cut = Instant::now();
    let (mut stepped_down, mut taken_over) = (None, None);
    while (stepped_down.is_none() || taken_over.is_none()) && cut.elapsed() < Duration::from_secs(lease_seconds * 4) {
        if stepped_down.is_none() && a.logs().contains("stopped leading") {
            stepped_down = Some(cut.elapsed());
        }
        if taken_over.is_none() && holder(&client, lease).await.as_deref() == Some("partition-b") {
            taken_over = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    report(&format!("leader cut off: stepped down after {stepped_down:?}, the other took over after {taken_over:?}"));
    let (Some(stepped_down), Some(taken_over)) = (stepped_down, taken_over) else {
        panic!("stepped down {stepped_down:?}, taken over {taken_over:?}; partition-a's log:\n{}", a.logs());
    };
    assert!(
        stepped_down < taken_over,
        "the cut-off leader acted until {stepped_down:?}, the other led from {taken_over:?}"
    );
    assert!(stepped_down < Duration::from_secs(lease_seconds), "stepped down only after {stepped_down:?}");

    // Cut off, it still enforces what it had; the new leader writes status.
    assert_eq!(check_limit(&http, &a, ns, "one").await, Some(3), "the last snapshot stays enforced");
    apply(&client, ns, &policy(ns, "two", "r", 4)).await.expect("applies");
    settled(&client, ns, "two", "True").await;

    proxy.restore();
    eventually("partition-a's watches resume", Duration::from_secs(30), || async {
        check_limit(&http, &a, ns, "two").await.filter(|l| *l == 4).ok_or_else(|| "not yet".to_string())
    })
    .await;
    apply(&client, ns, &policy(ns, "three", "r", 5)).await.expect("applies");
    settled(&client, ns, "three", "True").await;
    for name in ["two", "three"] {
        let seen = eventually("the new leader's Accepted event", Duration::from_secs(10), || async {
            let r = reporters(&client, ns, name).await;
            if r.is_empty() { Err("no events".into()) } else { Ok(r) }
        })
        .await;
        assert!(seen.iter().all(|r| r == "partition-b"), "events about {name} from {seen:?}");
    }
    assert_eq!(holder(&client, lease).await.as_deref(), Some("partition-b"));
}
