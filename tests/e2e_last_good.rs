//! The last good generation of a policy stays enforced in operator mode, against a real
//! kube-apiserver + etcd (e2e/control-plane.sh), or any cluster named by SLUICE_E2E_KUBECONFIG.
//!
//! Without the admission webhook an update that CEL admits but validate() refuses (a path regex
//! that does not compile) is stored. The operator must keep enforcing the previous accepted
//! generation — from `status.lastAccepted`, so that a replica started afterwards does too — and
//! say so in the status; a valid update replaces it.

#[path = "support/control_plane.rs"]
mod control_plane;

use std::time::Duration;

use control_plane::{Operator, cluster, eventually};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use sluice::policy::{RateLimitPolicy, RateLimitPolicySpec, RateLimitPolicyStatus};

const NS: &str = "e2e-last-good";
const LEASE: &str = "e2e-last-good";
const NAME: &str = "orders";

/// `orders` with one fixedWindow rule of `requests` per minute per API key; with `regex`, only
/// for paths matching it.
fn policy(requests: u64, regex: Option<&str>) -> Value {
    let mut rule = json!({
        "name": "per-key", "key": [{"header": "X-API-Key"}], "algorithm": "fixedWindow",
        "limit": {"requests": requests, "per": "1m"}
    });
    if let Some(regex) = regex {
        rule["match"] = json!({"paths": [{"regex": regex}]});
    }
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"selector": {"matchLabels": {"app": "orders"}}, "rules": [rule]}
    })
}

async fn apply(client: &Client, body: &Value) -> RateLimitPolicy {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), NS);
    api.patch(NAME, &PatchParams::apply("e2e-test").force(), &Patch::Apply(body)).await.expect("policy applies")
}

fn condition<'a>(p: &'a RateLimitPolicy, type_: &str) -> &'a Condition {
    let conditions = p.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    conditions.iter().find(|c| c.type_ == type_).unwrap_or_else(|| panic!("no {type_} condition: {:?}", p.status))
}

/// Waits until the status describes `generation` with `Accepted` = `accepted`.
async fn settled(client: &Client, generation: i64, accepted: &str) -> RateLimitPolicy {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), NS);
    eventually(&format!("status of generation {generation}"), Duration::from_secs(30), || async {
        let p = api.get(NAME).await.map_err(|e| e.to_string())?;
        let status = p.status.clone().unwrap_or_default();
        let current = p.metadata.generation == Some(generation) && status.observed_generation == Some(generation);
        let judged = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Accepted" && c.status == accepted && c.observed_generation == Some(generation));
        if current && judged {
            Ok(p)
        } else {
            Err(format!("generation {:?}, status {:?}", p.metadata.generation, p.status))
        }
    })
    .await
}

/// The status without timestamps, to compare what two operators wrote.
fn essence(status: &RateLimitPolicyStatus) -> Value {
    let conditions: Vec<Value> = status
        .conditions
        .iter()
        .map(|c| json!([c.type_, c.status, c.reason, c.message, c.observed_generation]))
        .collect();
    json!({
        "conditions": conditions, "observedGeneration": status.observed_generation, "snapshot": status.snapshot,
        "enforcedGeneration": status.enforced_generation, "lastAccepted": status.last_accepted,
    })
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

async fn check(http: &reqwest::Client, op: &Operator, key: &str) -> Value {
    let body = json!({"namespace": NS, "labels": {"app": "orders"}, "method": "POST", "path": "/orders/1",
                      "headers": {"x-api-key": key}});
    let reply = http.post(op.url("/v1/check")).json(&body).send().await.expect("check answers");
    assert_eq!(reply.status(), 200);
    reply.json().await.expect("check json")
}

/// Two checks with a fresh API key: the first is admitted, the second refused by a rule of limit
/// `limit` (1 per minute: the limit really is enforced, not only listed). Returns the snapshot
/// version the checks were decided by.
async fn enforces_one_per_minute(http: &reqwest::Client, op: &Operator, key: &str) -> String {
    let first = check(http, op, key).await;
    let second = check(http, op, key).await;
    assert_eq!(first["allowed"], true, "{first}");
    assert_eq!(first["rules"][0]["limit"], 1, "{first}");
    assert_eq!((second["allowed"].clone(), second["status"].clone()), (json!(false), json!(429)), "{second}");
    assert_eq!(second["rules"][0]["limit"], 1, "{second}");
    assert_eq!(first["snapshot"], second["snapshot"]);
    second["snapshot"].as_str().expect("snapshot version").to_string()
}

async fn live_version(http: &reqwest::Client, op: &Operator) -> String {
    let snapshot: Value = http.get(op.url("/v1/snapshot")).send().await.expect("snapshot").json().await.expect("json");
    snapshot["version"].as_str().or(snapshot["view"]["version"].as_str()).expect("version").to_string()
}

async fn holder(client: &Client) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    api.get_opt(LEASE).await.ok()??.spec?.holder_identity
}

fn spec_of(body: &Value) -> RateLimitPolicySpec {
    serde_json::from_value(body["spec"].clone()).expect("spec")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_update_keeps_the_last_accepted_generation_enforced_across_restarts() {
    let cp = cluster();
    let client = cp.client().await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).expect("namespace");
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("namespace {NS}: {e}"),
    }
    // Generations count from 1: no policy left over from an earlier run on the same cluster.
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), NS);
    let _ = api.delete(NAME, &Default::default()).await;
    eventually("no leftover policy", Duration::from_secs(30), || async {
        match api.get_opt(NAME).await {
            Ok(None) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let args = ["--namespaces", NS, "--lease-name", LEASE];
    let mut first = Operator::start(&cp.operator_kubeconfig, "last-good-1", &args);
    let http = http();
    ready(&http, &first).await;

    // Generation 1: valid, 1 per minute.
    let v1 = policy(1, None);
    apply(&client, &v1).await;
    let p = settled(&client, 1, "True").await;
    let status = p.status.clone().expect("status");
    let version1 = live_version(&http, &first).await;
    let enforced = condition(&p, "Enforced");
    assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("True", "Live"), "{enforced:?}");
    assert_eq!(enforced.message, format!("generation 1 is enforced in snapshot {version1}"));
    assert_eq!((status.enforced_generation, status.snapshot.as_deref()), (Some(1), Some(version1.as_str())));
    let persisted = status.last_accepted.clone().expect("lastAccepted persisted");
    assert_eq!(persisted.generation, 1);
    assert_eq!(serde_json::from_value::<RateLimitPolicySpec>(persisted.spec).expect("spec"), spec_of(&v1));
    assert_eq!(enforces_one_per_minute(&http, &first, "k1").await, version1);

    // Generation 2: CEL admits it, validate() refuses the regex; it would also allow 2.
    apply(&client, &policy(2, Some("(unclosed"))).await;
    let p = settled(&client, 2, "False").await;
    let status = p.status.clone().expect("status");
    let accepted = condition(&p, "Accepted");
    assert_eq!(accepted.reason, "Invalid");
    assert!(accepted.message.contains("spec.rules[0].match.paths[0].regex"), "{accepted:?}");
    let enforced = condition(&p, "Enforced");
    assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("True", "LastAccepted"), "{enforced:?}");
    // The snapshot hashes what is enforced: generation 1's spec, so the version has not changed.
    assert_eq!(live_version(&http, &first).await, version1);
    let prefix = format!("generation 1 is enforced in snapshot {version1}; generation 2 was not accepted: ");
    assert!(enforced.message.starts_with(&prefix), "{enforced:?}");
    assert!(enforced.message.contains("spec.rules[0].match.paths[0].regex"), "{enforced:?}");
    // Both conditions judged generation 2; generation 1 is what is live.
    assert_eq!((accepted.observed_generation, enforced.observed_generation), (Some(2), Some(2)));
    assert_eq!((status.enforced_generation, status.snapshot.as_deref()), (Some(1), Some(version1.as_str())));
    assert_eq!(status.last_accepted.as_ref().map(|l| l.generation), Some(1));
    assert_eq!(enforces_one_per_minute(&http, &first, "k2").await, version1);
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    eventually("the Rejected event naming the enforced generation", Duration::from_secs(10), || async {
        let list = events.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
        let notes: Vec<_> = list
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Rejected"))
            .filter_map(|e| e.note.clone())
            .collect();
        if notes.iter().any(|n| n.starts_with(&prefix)) { Ok(()) } else { Err(format!("{notes:?}")) }
    })
    .await;
    let written = essence(&status);

    // A new operator: fresh process, fresh memory. The status it would write is wiped first (all
    // but lastAccepted), so what it enforces and reports can only come from what was persisted.
    let stopped = first.terminate();
    assert!(stopped.success(), "operator exit {stopped:?}:\n{}", first.logs());
    let wipe = json!({"status": {"conditions": null, "observedGeneration": null, "snapshot": null,
                                 "enforcedGeneration": null}});
    api.patch_status(NAME, &PatchParams::default(), &Patch::Merge(&wipe)).await.expect("status wiped");
    let mut second = Operator::start(&cp.operator_kubeconfig, "last-good-2", &args);
    ready(&http, &second).await;
    // Ready means its first compile is live: generation 1 from the status, the same snapshot.
    assert_eq!(live_version(&http, &second).await, version1);
    assert_eq!(enforces_one_per_minute(&http, &second, "k3").await, version1);
    eventually("the new operator leads", Duration::from_secs(30), || async {
        match holder(&client).await {
            Some(h) if h == "last-good-2" => Ok(()),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await;
    let p = settled(&client, 2, "False").await;
    let rewritten = essence(p.status.as_ref().expect("status"));
    assert_eq!(rewritten, written, "the new operator reports what the first one did");

    // Generation 3: valid, 5 per minute. Enforced, and it replaces the persisted spec.
    let v3 = policy(5, None);
    apply(&client, &v3).await;
    let p = settled(&client, 3, "True").await;
    let status = p.status.clone().expect("status");
    let version3 = live_version(&http, &second).await;
    assert_ne!(version3, version1);
    let enforced = condition(&p, "Enforced");
    assert_eq!((enforced.status.as_str(), enforced.reason.as_str()), ("True", "Live"), "{enforced:?}");
    assert_eq!(enforced.message, format!("generation 3 is enforced in snapshot {version3}"));
    assert_eq!(status.enforced_generation, Some(3));
    let persisted = status.last_accepted.clone().expect("lastAccepted");
    assert_eq!(persisted.generation, 3);
    assert_eq!(serde_json::from_value::<RateLimitPolicySpec>(persisted.spec).expect("spec"), spec_of(&v3));
    let reply = check(&http, &second, "k4").await;
    assert_eq!((reply["allowed"].clone(), reply["rules"][0]["limit"].clone()), (json!(true), json!(5)), "{reply}");

    // Deleted: nothing of it is enforced.
    api.delete(NAME, &Default::default()).await.expect("deleted");
    eventually("the deleted policy's rules are gone", Duration::from_secs(10), || async {
        let reply = check(&http, &second, "k4").await;
        if reply["rules"] == json!([]) { Ok(()) } else { Err(reply.to_string()) }
    })
    .await;
    let stopped = second.terminate();
    assert!(stopped.success(), "operator exit {stopped:?}:\n{}", second.logs());
}
