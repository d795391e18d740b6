//! `sluice serve --grpc-listen` driven by an independent client: e2e/rls-client, a Go program
//! built against Envoy's own published protos (github.com/envoyproxy/go-control-plane) and
//! grpc-go. Descriptor matching, hits_addend, OVER_LIMIT with statuses and headers, atomicity
//! across descriptors, shadow rules, callers, per-rule failure modes with Redis blackholed inside
//! Envoy's 20 ms deadline and with Redis gone, health, and the drain on SIGTERM.

#[path = "support/rls_client.rs"]
mod rls_client;
#[path = "support/sluice_process.rs"]
mod sluice_process;
#[allow(dead_code)]
mod support;

use std::time::Duration;

use rls_client::{Client, GATEWAY_TOKEN, header, overall};
use serde_json::{Value, json};
use sluice_process::SluiceProcess;
use support::redis_server::{RedisServer, free_port};

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: edge, namespace: gateway-limits}
spec:
  rules:
    - name: per-client
      match: {descriptor: [{key: remote_address}]}
      key: [{descriptor: remote_address}]
      algorithm: fixedWindow
      limit: {requests: 100, per: 1h}
    - name: per-api-key
      match: {descriptor: [{key: api_key, notIn: [unlimited]}]}
      key: [{descriptor: api_key}]
      algorithm: tokenBucket
      limit: {requests: 1, per: 1h, burst: 5}
    - name: bots
      match: {descriptor: [{key: user_agent, prefix: bot}]}
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
      mode: shadow
    - name: fail-open
      match: {descriptor: [{key: failure, exact: allow}]}
      algorithm: gcra
      limit: {requests: 1000, per: 1h}
      onStoreFailure: allow
    - name: fail-closed
      match: {descriptor: [{key: failure, exact: deny}]}
      algorithm: gcra
      limit: {requests: 1000, per: 1h}
      onStoreFailure: deny
    - name: fallback
      match: {descriptor: [{key: failure, exact: local}]}
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
      onStoreFailure: localFallback
---
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: own, namespace: tenant-a}
spec:
  rules:
    - name: any
      match: {descriptor: [{key: k}]}
      algorithm: fixedWindow
      limit: {requests: 100, per: 1h}
"#;

const TENANT_TOKEN: &str = "tenant-a-token-0123456789";

fn tokens_file(dir: &std::path::Path) -> String {
    let path = dir.join("tokens.yaml");
    std::fs::write(
        &path,
        format!(
            "tokens:\n  - {{name: edge, token: {GATEWAY_TOKEN}, gateway: true}}\n  - {{name: tenant-a, token: {TENANT_TOKEN}, namespaces: [tenant-a]}}\n"
        ),
    )
    .unwrap();
    path.display().to_string()
}

struct Server {
    process: SluiceProcess,
    grpc: String,
    _dir: tempfile::TempDir,
}

fn serve(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICIES).unwrap();
    let tokens = tokens_file(dir.path());
    let grpc = format!("127.0.0.1:{}", free_port(false));
    let policies = dir.path().join("p.yaml").display().to_string();
    let mut args =
        vec!["serve", "-p", &policies, "--listen", "127.0.0.1:0", "--grpc-listen", &grpc, "--tokens", &tokens];
    args.extend_from_slice(extra);
    let process = SluiceProcess::start(&args);
    Server { process, grpc, _dir: dir }
}

#[test]
fn descriptors_are_decided_with_statuses_headers_and_atomically() {
    let server = serve(&[]);
    let mut client = Client::connect(&server.grpc);
    let health = client.send(json!({"op": "health", "service": "", "wait_for_ready": true}));
    assert_eq!(health["status"], "SERVING", "{health}");
    let health = client.send(json!({"op": "health", "service": "envoy.service.ratelimit.v3.RateLimitService"}));
    assert_eq!(health["status"], "SERVING", "{health}");

    // hits_addend is the cost: 5 tokens, 3 then 2, then nothing left.
    let key = [("api_key", "k1")];
    let first = client.rls(&[&key], json!({"hits_addend": 3}));
    assert_eq!(overall(&first), "OK");
    let status = &first["statuses"][0];
    assert_eq!((status["code"].as_str(), status["limit_remaining"].as_u64()), (Some("OK"), Some(2)));
    assert_eq!(status["current_limit"]["name"], "edge/per-api-key");
    assert_eq!(header(&first, "RateLimit-Policy"), Some("\"edge/per-api-key\";q=5;w=18000"));
    assert_eq!(overall(&client.rls(&[&key], json!({"hits_addend": 2}))), "OK");

    // Denied: OVER_LIMIT with its status and Retry-After, and the other descriptor of the same
    // request consumed nothing (it reports its unchanged state).
    let address = [("remote_address", "192.0.2.7")];
    let denied = client.rls(&[&address, &key], json!({}));
    assert_eq!(overall(&denied), "OVER_LIMIT", "{denied}");
    assert_eq!(denied["statuses"][0]["code"], "OK");
    assert_eq!(denied["statuses"][0]["limit_remaining"], 100, "the address rule consumed nothing");
    assert_eq!(denied["statuses"][1]["code"], "OVER_LIMIT");
    assert_eq!(denied["statuses"][1]["limit_remaining"], 0);
    assert!(header(&denied, "Retry-After").is_some(), "{denied}");
    let after = client.rls(&[&address], json!({}));
    assert_eq!(after["statuses"][0]["limit_remaining"], 99);

    // Matching: notIn leaves `unlimited` to no rule; unmatched descriptors are OK without a limit.
    let free = client.rls(&[&[("api_key", "unlimited")], &[("nothing", "here")]], json!({"hits_addend": 50}));
    assert_eq!(overall(&free), "OK");
    assert!(free["statuses"][0]["current_limit"].is_null() && free["statuses"][1]["current_limit"].is_null());
    assert_eq!(free["statuses"].as_array().unwrap().len(), 2, "one status per descriptor");

    // Shadow: reported, never denying.
    for _ in 0..3 {
        let bot = client.rls(&[&[("user_agent", "bot-x")]], json!({}));
        assert_eq!(overall(&bot), "OK");
    }
    let bot = client.rls(&[&[("user_agent", "bot-x")]], json!({}));
    assert_eq!(
        (bot["statuses"][0]["code"].as_str(), bot["statuses"][0]["limit_remaining"].as_u64()),
        (Some("OK"), Some(0))
    );

    // Callers and bad requests get gRPC errors naming the problem.
    let error = |answer: Value| (answer["grpc_code"].as_str().unwrap_or("").to_string(), answer["message"].to_string());
    let no_token = client.send(
        json!({"op": "rls", "domain": "gateway-limits", "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]}),
    );
    assert_eq!(error(no_token).0, "Unauthenticated");
    let tenant = |domain: &str, hits: u64| {
        json!({"op": "rls", "domain": domain, "token": TENANT_TOKEN, "hits_addend": hits,
               "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]})
    };
    assert_eq!(overall(&client.send(tenant("tenant-a", 0))), "OK", "a tenant in its own namespace");
    let (code, message) = error(client.send(tenant("gateway-limits", 0)));
    assert_eq!(code, "PermissionDenied");
    assert!(message.contains("gateway-limits"), "{message}");
    assert_eq!(error(client.send(tenant("tenant-a", 2))).0, "PermissionDenied", "tenants may not set the cost");
    let (code, message) = error(client.send(json!({"op": "rls", "domain": "gateway-limits", "token": GATEWAY_TOKEN,
        "descriptors": [{"entries": [{"key": "api_key", "value": "k9"}], "limit": {"requests_per_unit": 1000, "unit": "SECOND"}}]})));
    assert_eq!(code, "InvalidArgument");
    assert!(message.contains("descriptors[0].limit"), "{message}");
    let (code, message) = error(client.send(json!({"op": "rls", "domain": "Not_A_Namespace", "token": GATEWAY_TOKEN,
        "descriptors": [{"entries": [{"key": "k", "value": "v"}]}]})));
    assert_eq!(code, "InvalidArgument");
    assert!(message.contains("domain"), "{message}");
}

#[test]
fn response_headers_can_be_left_to_envoy() {
    let server = serve(&["--grpc-response-headers", "off"]);
    let mut client = Client::connect(&server.grpc);
    let answer = client.rls(&[&[("api_key", "h1")]], json!({"wait_for_ready": true}));
    assert_eq!(overall(&answer), "OK");
    assert_eq!(answer["response_headers_to_add"].as_array().map(Vec::len), Some(0), "{answer}");
    assert_eq!(answer["statuses"][0]["limit_remaining"], 4, "statuses still carry what Envoy needs");
}

#[test]
fn rules_fail_their_way_within_envoys_deadline_when_redis_stalls_or_dies() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    // A Redis timeout longer than Envoy's 20 ms: the caller's deadline must decide first.
    let server = serve(&["--redis", &url, "--redis-timeout", "2s", "--redis-breaker-failures", "1000"]);
    let mut client = Client::connect(&server.grpc);
    let decide = |client: &mut Client, value: &str| {
        let answer = client.rls(&[&[("failure", value)]], json!({"timeout_ms": 20, "wait_for_ready": true}));
        assert_eq!(answer["ok"], true, "a decision, not a gRPC error: {answer}");
        answer["overall_code"].as_str().unwrap().to_string()
    };
    for value in ["allow", "deny", "local"] {
        assert_eq!(decide(&mut client, value), "OK", "Redis up");
    }
    // Every decision is one script call, however many descriptors.
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for _ in 0..10 {
        let answer = client
            .rls(&[&[("failure", "allow")], &[("failure", "deny")], &[("remote_address", "192.0.2.1")]], json!({}));
        assert_eq!(overall(&answer), "OK");
    }
    let stats = redis.cli(&["INFO", "commandstats"]);
    let calls = |command: &str| {
        stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
            .and_then(|l| l.split("calls=").nth(1))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(calls("fcall") + calls("evalsha") + calls("eval"), 10, "{stats}");

    // Blackholed: Redis accepts but answers nothing for 3 s.
    redis.cli(&["CLIENT", "PAUSE", "3000", "ALL"]);
    assert_eq!(decide(&mut client, "allow"), "OK");
    assert_eq!(decide(&mut client, "deny"), "OVER_LIMIT");
    assert_eq!(decide(&mut client, "local"), "OK");

    // Gone: the same, and the local fallback enforces its limit of 3 in this replica.
    redis.kill();
    assert_eq!(decide(&mut client, "allow"), "OK");
    assert_eq!(decide(&mut client, "deny"), "OVER_LIMIT");
    let local: Vec<String> = (0..4).map(|_| decide(&mut client, "local")).collect();
    assert_eq!(local.last().map(String::as_str), Some("OVER_LIMIT"), "{local:?}");
}

#[test]
fn sigterm_drains_in_flight_calls_and_refuses_new_ones() {
    let redis = RedisServer::start();
    let url = redis.url();
    let mut server = serve(&["--redis", &url, "--redis-timeout", "5s"]);
    let mut client = Client::connect(&server.grpc);
    assert_eq!(overall(&client.rls(&[&[("api_key", "d1")]], json!({"wait_for_ready": true}))), "OK");
    // A call that is in flight when the signal comes (Redis holds it for a second) still gets
    // its decision; the process then exits cleanly and the port is closed.
    redis.cli(&["CLIENT", "PAUSE", "1000", "ALL"]);
    let grpc = server.grpc.clone();
    let in_flight = std::thread::spawn(move || {
        let mut client = Client::connect(&grpc);
        client.rls(&[&[("api_key", "d2")]], json!({"timeout_ms": 10000, "wait_for_ready": true}))
    });
    std::thread::sleep(Duration::from_millis(300));
    let status = server.process.terminate();
    let answer = in_flight.join().unwrap();
    assert_eq!(overall(&answer), "OK", "the in-flight call was answered: {answer}");
    assert!(status.success(), "exit {status:?}");
    let refused = client.send(json!({"op": "health", "service": "", "timeout_ms": 500}));
    assert_eq!(refused["ok"], false, "nothing serves after the drain: {refused}");
    drop(redis);
}

#[test]
fn grpc_tls_serves_the_check_apis_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let pair = sluice::admission::certs::generate(&["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let (ca, cert, key) =
        (write("ca.pem", &pair.ca_pem), write("cert.pem", &pair.cert_pem), write("key.pem", &pair.key_pem));
    let impostor = sluice::admission::certs::generate(&["localhost".to_string()]).unwrap();
    let other_ca = write("other-ca.pem", &impostor.ca_pem);
    let server = serve(&["--tls-cert", &cert, "--tls-key", &key, "--grpc-tls", "true"]);

    let mut client = Client::connect_with(&server.grpc, &["-tls-ca", &ca]);
    assert_eq!(overall(&client.rls(&[&[("api_key", "t1")]], json!({"wait_for_ready": true}))), "OK");
    let mut wrong = Client::connect_with(&server.grpc, &["-tls-ca", &other_ca]);
    let refused = wrong.rls(&[&[("api_key", "t1")]], json!({"timeout_ms": 2000}));
    assert_eq!(refused["ok"], false, "a certificate of another CA is not trusted: {refused}");
    let mut plain = Client::connect(&server.grpc);
    let refused = plain.rls(&[&[("api_key", "t1")]], json!({"timeout_ms": 2000}));
    assert_eq!(refused["ok"], false, "no cleartext on a TLS listener: {refused}");
}

#[test]
fn calls_without_a_credential_may_be_trusted_as_a_gateway_and_credentials_are_still_checked() {
    let server = serve(&["--grpc-unauthenticated-gateway", "true"]);
    let mut client = Client::connect(&server.grpc);
    let anonymous = client.rls_in(
        "gateway-limits",
        None,
        &[&[("api_key", "u1")]],
        json!({"hits_addend": 4, "wait_for_ready": true}),
    );
    assert_eq!(overall(&anonymous), "OK", "{anonymous}");
    assert_eq!(anonymous["statuses"][0]["limit_remaining"], 1, "a gateway's cost counts");
    let forged = client.rls_in("gateway-limits", Some("not-a-token-0123456789"), &[&[("api_key", "u1")]], json!({}));
    assert_eq!(forged["grpc_code"], "Unauthenticated", "{forged}");
    let tenant = client.rls_in("gateway-limits", Some(TENANT_TOKEN), &[&[("api_key", "u1")]], json!({}));
    assert_eq!(tenant["grpc_code"], "PermissionDenied", "a tenant stays a tenant: {tenant}");
}

/// A tenant may not set a cost, and repeating a descriptor is no way to: a counter several of its
/// descriptors reach is charged once. A gateway's repeats add up, as its costs may.
#[test]
fn repeated_descriptors_charge_a_tenant_once() {
    let server = serve(&[]);
    let mut client = Client::connect(&server.grpc);
    let same: &[(&str, &str)] = &[("k", "x")];
    let answer = client.rls_in("tenant-a", Some(TENANT_TOKEN), &[same, same, same], json!({"wait_for_ready": true}));
    assert_eq!(overall(&answer), "OK", "{answer}");
    assert_eq!(answer["statuses"][0]["limit_remaining"], 99, "charged once: {answer}");
    let answer = client.rls_in("tenant-a", Some(GATEWAY_TOKEN), &[same, same, same], json!({}));
    assert_eq!(answer["statuses"][0]["limit_remaining"], 96, "a gateway's repeats add up: {answer}");
}
