//! `sluice operator --grpc-listen` against a real kube-apiserver: RateLimitPolicies with
//! `match.descriptor` pass the real API server's schema and CEL (and a mistaken one is refused
//! with its message), are enforced through `ShouldRateLimit` as soon as they are accepted, and a
//! change reaches the gRPC answers without a restart. Driven by e2e/rls-client (Go).

#[path = "support/control_plane.rs"]
mod control_plane;
#[path = "support/rls_client.rs"]
mod rls_client;

use std::time::Duration;

use control_plane::{Operator, cluster, eventually, free_port, namespace};
use kube::Api;
use kube::api::{Patch, PatchParams};
use rls_client::{Client, overall};
use serde_json::{Value, json};
use sluice::policy::RateLimitPolicy;

fn descriptor_policy(ns: &str, requests: u64) -> Value {
    json!({
        "apiVersion": "sluice.dev/v1alpha1", "kind": "RateLimitPolicy",
        "metadata": {"name": "edge", "namespace": ns},
        "spec": {"rules": [{
            "name": "per-client",
            "match": {"descriptor": [{"key": "generic_key", "exact": "edge"}, {"key": "remote_address", "notIn": ["10.0.0.1"]}]},
            "key": [{"namespace": true}, {"descriptor": "remote_address"}],
            "algorithm": "fixedWindow",
            "limit": {"requests": requests, "per": "1h"}
        }]}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_policies_are_admitted_by_the_api_server_and_enforced_over_grpc() {
    let cp = cluster();
    let client = cp.client().await;
    let ns = "e2e-rls";
    namespace(&client, ns, json!({})).await;
    let grpc = format!("127.0.0.1:{}", free_port());
    let _op = Operator::start(
        &cp.operator_kubeconfig,
        "rls-1",
        &["--namespaces", ns, "--lease-name", "e2e-rls", "--grpc-listen", &grpc],
    );
    let api: Api<RateLimitPolicy> = Api::namespaced(client.clone(), ns);
    let apply = |body: Value| {
        let api = api.clone();
        async move { api.patch("edge", &PatchParams::apply("e2e-test").force(), &Patch::Apply(&body)).await }
    };
    apply(descriptor_policy(ns, 3)).await.expect("the API server admits a descriptor policy with a namespace key part");

    // A mistake CEL catches on the real API server, with its message.
    let mut wrong = descriptor_policy(ns, 3);
    wrong["spec"]["rules"][0]["key"] = json!([{"descriptor": "path"}]);
    let refused = apply(wrong).await.expect_err("refused by CEL");
    assert!(refused.to_string().contains("a descriptor key part needs an entry with that key"), "{refused}");

    let mut rls = Client::connect(&grpc);
    let descriptor = [("generic_key", "edge"), ("remote_address", "192.0.2.9")];
    let ask = |rls: &mut Client| rls.rls_in(ns, None, &[&descriptor], json!({"wait_for_ready": true}));
    let first = eventually("the policy enforced over gRPC", Duration::from_secs(30), || {
        let answer = ask(&mut rls);
        async move {
            match answer["statuses"][0]["current_limit"]["name"].as_str() {
                Some("edge/per-client") => Ok(answer),
                _ => Err(answer.to_string()),
            }
        }
    })
    .await;
    assert_eq!(first["statuses"][0]["limit_remaining"], 2);
    assert_eq!(overall(&ask(&mut rls)), "OK");
    assert_eq!(overall(&ask(&mut rls)), "OK");
    assert_eq!(overall(&ask(&mut rls)), "OVER_LIMIT");
    let monitor = rls.rls_in(ns, None, &[&[("generic_key", "edge"), ("remote_address", "10.0.0.1")]], json!({}));
    assert!(monitor["statuses"][0]["current_limit"].is_null(), "notIn leaves the monitor unlimited: {monitor}");

    // Raising the limit reaches the answers without a restart; the counter is kept.
    apply(descriptor_policy(ns, 5)).await.expect("applies");
    eventually("the raised limit over gRPC", Duration::from_secs(30), || {
        let answer = ask(&mut rls);
        async move {
            if answer["overall_code"] == "OK" && answer["statuses"][0]["limit_remaining"] == 1 {
                Ok(())
            } else {
                Err(answer.to_string())
            }
        }
    })
    .await;
}
