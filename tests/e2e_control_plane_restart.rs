//! The control plane itself fails under a running operator: etcd and the API server are killed
//! and started again (e2e/control-plane.sh restart). This binary starts its own control plane, so
//! the restart does not disturb the other e2e tests.
//!
//! Held: the last snapshot stays enforced and the replica stays ready while the API server is
//! away; afterwards its watches resume (changes, new policies and deletions arrive), status
//! catches up, and no policy is dropped or reverted.

#[path = "support/control_plane.rs"]
mod control_plane;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use control_plane::{Operator, cluster, eventually, namespace, report};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use sluice::policy::RateLimitPolicy;

fn policy(ns: &str, name: &str, requests: u64) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": {"matchLabels": {"app": name}}, "rules": [{
            "name": "r", "key": [{"header": "X-API-Key"}], "algorithm": "fixedWindow",
            "limit": {"requests": requests, "per": "1h"}
        }]}
    })
}

async fn apply(client: &Client, ns: &str, body: &Value) {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let name = body["metadata"]["name"].as_str().expect("name");
    api.patch(name, &PatchParams::apply("e2e-test").force(), &Patch::Apply(body)).await.expect("applies");
}

/// Waits until the status describes the current generation, accepted.
async fn settled(client: &Client, ns: &str, name: &str) {
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    eventually(&format!("status of {ns}/{name}"), Duration::from_secs(60), || async {
        let p = api.get(name).await.map_err(|e| e.to_string())?;
        let status = p.status.clone().unwrap_or_default();
        let accepted = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Accepted" && c.status == "True" && c.observed_generation == p.metadata.generation);
        if accepted && status.observed_generation == p.metadata.generation {
            Ok(())
        } else {
            Err(format!("status {:?}", p.status))
        }
    })
    .await;
}

async fn limit(http: &reqwest::Client, op: &Operator, ns: &str, app: &str) -> Option<u64> {
    let body = json!({"namespace": ns, "labels": {"app": app}, "path": "/", "headers": {"x-api-key": "k"}});
    let reply: Value = http.post(op.url("/v1/check")).json(&body).send().await.ok()?.json().await.ok()?;
    reply["rules"].get(0)?["limit"].as_u64()
}

async fn enforces(http: &reqwest::Client, op: &Operator, ns: &str, app: &str, want: Option<u64>) {
    eventually(&format!("{app} enforced as {want:?}"), Duration::from_secs(60), || async {
        let got = limit(http, op, ns, app).await;
        if got == want { Ok(()) } else { Err(format!("limit {got:?}")) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_rides_out_an_api_server_and_etcd_restart() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-restart";
    namespace(&client, ns, json!({})).await;
    let args = ["--namespaces", ns, "--lease-name", "e2e-restart", "--lease-duration", "6s"];
    let op = Operator::start(&cp.operator_kubeconfig, "restart-a", &args);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().expect("http client");
    eventually("operator ready", Duration::from_secs(30), || async {
        let status = http.get(op.url("/readyz")).send().await.map_err(|e| e.to_string())?.status();
        if status == 200 { Ok(()) } else { Err(format!("{status}")) }
    })
    .await;
    for (name, requests) in [("one", 3), ("two", 4)] {
        apply(&client, ns, &policy(ns, name, requests)).await;
        settled(&client, ns, name).await;
        enforces(&http, &op, ns, name, Some(requests)).await;
    }

    // While the control plane is down and coming back: every check still sees both policies,
    // and the replica stays ready (a control-plane outage must not take pods out of Services).
    let (checks, wrong, unready) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let restarting = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (http, url_check, url_ready) = (http.clone(), op.url("/v1/check"), op.url("/readyz"));
        let (checks, wrong, unready, restarting) = (checks.clone(), wrong.clone(), unready.clone(), restarting.clone());
        tokio::spawn(async move {
            while restarting.load(Ordering::SeqCst) {
                for (app, want) in [("one", 3), ("two", 4)] {
                    let body =
                        json!({"namespace": ns, "labels": {"app": app}, "path": "/", "headers": {"x-api-key": "k"}});
                    let got = match http.post(&url_check).json(&body).send().await {
                        Ok(reply) => {
                            reply.json::<Value>().await.ok().and_then(|v| v["rules"].get(0)?["limit"].as_u64())
                        }
                        Err(_) => None,
                    };
                    checks.fetch_add(1, Ordering::SeqCst);
                    if got != Some(want) {
                        wrong.fetch_add(1, Ordering::SeqCst);
                    }
                }
                if !http.get(&url_ready).send().await.is_ok_and(|r| r.status() == 200) {
                    unready.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let started = Instant::now();
    tokio::task::spawn_blocking(|| cluster().restart()).await.expect("restart");
    let outage = started.elapsed();
    restarting.store(false, Ordering::SeqCst);
    watcher.await.expect("watcher");
    let (checks, wrong, unready) =
        (checks.load(Ordering::SeqCst), wrong.load(Ordering::SeqCst), unready.load(Ordering::SeqCst));
    assert!(checks > 20, "only {checks} checks during the restart");
    assert_eq!(wrong, 0, "{wrong} of {checks} checks during the restart did not see the last snapshot");
    assert_eq!(unready, 0, "the replica was unready {unready} times during the restart");

    // Afterwards: a change, a new policy and a deletion all arrive, and status catches up.
    let back = Instant::now();
    apply(&client, ns, &policy(ns, "one", 30)).await;
    enforces(&http, &op, ns, "one", Some(30)).await;
    let resumed = back.elapsed();
    settled(&client, ns, "one").await;
    apply(&client, ns, &policy(ns, "three", 5)).await;
    settled(&client, ns, "three").await;
    enforces(&http, &op, ns, "three", Some(5)).await;
    enforces(&http, &op, ns, "two", Some(4)).await;
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    api.delete("two", &DeleteParams::default()).await.expect("deletes");
    enforces(&http, &op, ns, "two", None).await;
    enforces(&http, &op, ns, "one", Some(30)).await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "sluice-system");
    let holder = leases.get("e2e-restart").await.expect("lease").spec.and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some("restart-a"), "the only replica leads again");
    report(&format!(
        "control plane restart: {outage:?} down and coming back, {checks} checks all on the last snapshot; \
         a change applied after it enforced in {resumed:?}"
    ));
}
