//! Several `sluice serve --redis` processes sharing state through real Redis servers: exact
//! bounds under concurrency, per-rule failure modes when Redis dies, recovery when it returns.

#[path = "support/replicas.rs"]
mod replicas;
#[path = "support/sluice_process.rs"]
mod sluice_process;
#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use replicas::{client, hammer, replicas};
use serde_json::Value;
use sluice_process::{SluiceProcess, run_for_at_most};
use support::redis_server::{RedisCluster, RedisServer, free_port};

const POLICIES: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: exact, namespace: tenant-a}
spec:
  rules:
    - name: window
      match: {paths: [{prefix: /window}]}
      algorithm: fixedWindow
      limit: {requests: 50, per: 1h}
    - name: bucket
      match: {paths: [{prefix: /bucket}]}
      algorithm: tokenBucket
      limit: {requests: 40, per: 24h}
    - name: log
      match: {paths: [{prefix: /log}]}
      algorithm: slidingWindowLog
      limit: {requests: 30, per: 1h}
    - name: counter
      match: {paths: [{prefix: /counter}]}
      algorithm: slidingWindowCounter
      limit: {requests: 20, per: 1h}
    - name: fail-open
      match: {paths: [{prefix: /open}]}
      algorithm: gcra
      limit: {requests: 2, per: 1h}
      onStoreFailure: allow
    - name: fail-closed
      match: {paths: [{prefix: /closed}]}
      algorithm: gcra
      limit: {requests: 1000, per: 1h}
      onStoreFailure: deny
    - name: fallback
      match: {paths: [{prefix: /local}]}
      algorithm: fixedWindow
      limit: {requests: 9, per: 1h}
      onStoreFailure: localFallback
"#;

fn policy_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICIES).unwrap();
    dir
}

/// The check API's decision from `s`.
async fn check(c: &reqwest::Client, s: &SluiceProcess, path: &str) -> Value {
    replicas::check(c, &s.url("/v1/check"), path).await
}

/// The replicas' check URLs.
fn checks(servers: &[SluiceProcess]) -> Arc<Vec<String>> {
    Arc::new(servers.iter().map(|s| s.url("/v1/check")).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_on_one_redis_admit_exactly_the_bound() {
    let redis = RedisServer::start();
    let dir = policy_dir();
    // A generous deadline: this test is about exactness, not about a loaded machine's latency.
    let store_args = ["--redis", &redis.url(), "--redis-timeout", "5s", "--redis-batches", "2"].map(String::from);
    let servers = replicas(dir.path(), &store_args, 3);
    for (path, bound) in [("/window", 50), ("/bucket", 40), ("/log", 30), ("/counter", 20)] {
        let admitted = hammer(&checks(&servers), path, 48, bound * 4).await;
        assert_eq!(admitted, bound, "{path}: zero over-admission across 3 replicas and 48 clients");
    }
    // At most one round trip per decision: every decision is in exactly one FCALL (a batched
    // call carries the requests that waited for it), or in none when a replica's denial cache
    // answered a repeated denial. A fresh Redis has no library loaded, so the very first calls
    // fail (function not found), load it and retry.
    let stats = redis.cli(&["INFO", "commandstats"]);
    let field = |cmd: &str, name: &str| -> u64 {
        stats
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
            .and_then(|l| l.split(&format!("{name}=")).nth(1))
            .and_then(|v| v.split(',').next())
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    // Each replica's start-up probe (docs/redis.md) makes six calls of its own: a decision of
    // every algorithm, their settle, a quota lease granted and returned, and a shaped slot taken
    // and given back.
    let answered = field("fcall", "calls") - field("fcall", "failed_calls") - 6 * 3;
    let c = client();
    let (mut cached, mut calls, mut batched) = (0, 0, 0);
    for server in servers.iter() {
        let metrics = c.get(server.url("/metrics")).send().await.unwrap().text().await.unwrap();
        let counter = |name: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in {metrics}"))
        };
        cached += counter("sluice_redis_denial_cache_hits_total");
        calls += counter("sluice_redis_batched_calls_total");
        batched += counter("sluice_redis_batched_decisions_total");
    }
    assert_eq!(answered, calls, "every call Redis answered is one the replicas made: {stats}");
    assert_eq!(batched + cached, 4 * (50 + 40 + 30 + 20), "each decision in exactly one call, or cached: {stats}");
    assert!(calls <= batched, "a call carries one decision or more");
    eprintln!("e2e measurement: {batched} decisions in {calls} calls, {cached} from the denial caches");
    assert!(cached > 0, "repeated denials were answered by the replicas' caches");
    assert_eq!(field("eval", "calls") + field("evalsha", "calls"), 0, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_applies_each_rules_failure_mode_and_recovers() {
    let mut redis = RedisServer::start();
    let dir = policy_dir();
    let servers = replicas(
        dir.path(),
        &[
            "--redis".into(),
            redis.url(),
            "--redis-timeout".into(),
            "50ms".into(),
            "--redis-breaker-cooldown".into(),
            "300ms".into(),
            // The failure modes on their own: a denial cached before the outage would still
            // (exactly) refuse /open until its retry-after (tested in tests/redis_store.rs).
            "--redis-denial-cache".into(),
            "0".into(),
        ],
        1,
    );
    let s = &servers[0];
    let c = client();
    // Shared counting works: the fail-open rule allows 2 per hour.
    assert_eq!(check(&c, s, "/open").await["allowed"], true);
    assert_eq!(check(&c, s, "/open").await["allowed"], true);
    assert_eq!(check(&c, s, "/open").await["allowed"], false);

    redis.kill();
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut local_admitted = 0;
    for i in 0..30 {
        let t = Instant::now();
        let open = check(&c, s, "/open").await;
        let closed = check(&c, s, "/closed").await;
        let local = check(&c, s, "/local").await;
        slowest = slowest.max(t.elapsed() / 3);
        assert_eq!(open["allowed"], true, "allow: fail open ({i})");
        assert_eq!(open["rules"][0]["storeFailure"], "allow");
        assert_eq!(closed["allowed"], false, "deny: fail closed ({i})");
        assert_eq!(closed["status"], 429);
        assert!(closed["headers"]["Retry-After"].is_string());
        local_admitted += (local["allowed"] == true) as u32;
    }
    assert_eq!(local_admitted, 9, "localFallback enforces the rule in memory (9 per hour, one replica)");
    eprintln!("Redis down: slowest decision {slowest:?}; 90 decisions in {:?}", started.elapsed());
    assert!(slowest < Duration::from_secs(2), "each decision bounded by the deadline, got {slowest:?}");
    let snapshot: Value = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
    assert_eq!(snapshot["store"]["kind"], "redis");
    assert_eq!(snapshot["store"]["breaker"], "open", "{}", snapshot["store"]);
    let metrics = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("sluice_store_circuit_open 1"), "{metrics}");
    assert!(metrics.contains(r#"sluice_store_failure_decisions_total{mode="localFallback"}"#));

    // Redis returns (empty): shared counting resumes by itself.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let open = check(&c, s, "/open").await;
        if open["rules"][0].get("storeFailure").is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "store did not recover: {open}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = check(&c, s, "/closed").await;
    assert_eq!(closed["allowed"], true, "deny rule admits again once Redis answers");
    assert!(redis.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap() > 0, "state is back in Redis");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_on_a_redis_cluster_admit_exactly_the_bound() {
    let cluster = RedisCluster::shared();
    let dir = policy_dir();
    let servers = replicas(
        dir.path(),
        &["--redis-cluster".into(), cluster.urls().join(","), "--redis-timeout".into(), "5s".into()],
        3,
    );
    assert_eq!(hammer(&checks(&servers), "/window", 48, 200).await, 50);
    assert_eq!(hammer(&checks(&servers), "/log", 48, 120).await, 30);
}

/// A Redis that does not answer at start keeps `/readyz` at 503 naming why (a rollout stops
/// there instead of running every decision on `onStoreFailure` unnoticed); once it has answered,
/// a later outage is the breaker's business and readiness stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_waits_for_redis_to_answer_once() {
    let port = free_port(false);
    let dir = policy_dir();
    let url = format!("redis://127.0.0.1:{port}");
    let servers = replicas(dir.path(), &["--redis".into(), url, "--redis-timeout".into(), "200ms".into()], 1);
    let s = &servers[0];
    let c = client();
    let ready = c.get(s.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    let why = ready.text().await.unwrap();
    assert!(why.contains("the store has not answered since start") && why.contains("refused"), "{why}");
    let snapshot: Value = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
    assert!(snapshot["store"]["notAnsweredYet"].is_string(), "{}", snapshot["store"]);
    // Decisions meanwhile follow each rule's onStoreFailure, and never 5xx.
    assert_eq!(check(&c, s, "/open").await["rules"][0]["storeFailure"], "allow");

    let mut redis = RedisServer::start_with(port, &[]);
    let deadline = Instant::now() + Duration::from_secs(15);
    while c.get(s.url("/readyz")).send().await.unwrap().status() != 200 {
        assert!(Instant::now() < deadline, "not ready after Redis came up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs = s.logs.lock().unwrap().join("\n");
    assert!(logs.contains("Redis does not answer: /readyz stays 503"), "{logs}");
    assert!(logs.contains("Redis answers: decisions are shared from now on"), "{logs}");

    redis.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.get(s.url("/readyz")).send().await.unwrap().status(), 200, "a later outage keeps readiness");
}

/// Credentials Redis refuses, a database it does not have and a URL without a scheme are
/// configuration mistakes that fail every call alike: start-up stops naming each (not "Redis
/// does not answer", which sends people to the network), while the right settings start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_redis_refuses_stops_start_up_naming_the_cause() {
    let redis = RedisServer::start();
    let port = redis.port();
    assert_eq!(redis.cli(&["ACL", "SETUSER", "sluice", "on", ">right", "~*", "+@all"]).trim(), "OK");
    assert_eq!(redis.cli(&["CONFIG", "SET", "requirepass", "right"]).trim(), "OK");
    let dir = policy_dir();
    let wrong_password = dir.path().join("wrong-password");
    std::fs::write(&wrong_password, "wrong\n").unwrap();
    let serve = |redis_args: &[&str]| {
        let mut args = vec!["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"];
        args.extend_from_slice(redis_args);
        run_for_at_most(&args, Duration::from_secs(20))
    };
    let refused = |redis_args: &[&str], cause: &str| {
        let (code, stderr) = serve(redis_args);
        assert_eq!(code, Some(1), "{redis_args:?} must stop start-up: {stderr}");
        assert!(stderr.contains(cause), "{redis_args:?}: expected {cause:?} in {stderr}");
        assert!(!stderr.contains("does not answer"), "{stderr}");
        stderr
    };

    let stderr =
        refused(&["--redis", &format!("redis://:wrong@127.0.0.1:{port}")], "Redis refused the credentials: WRONGPASS");
    assert!(!stderr.contains(":wrong@"), "the password is never shown: {stderr}");
    refused(
        &[
            "--redis",
            &format!("redis://sluice@127.0.0.1:{port}"),
            "--redis-password-file",
            wrong_password.to_str().unwrap(),
        ],
        "Redis refused the credentials: WRONGPASS",
    );
    refused(&["--redis", &format!("redis://:right@127.0.0.1:{port}/99")], "Redis has no database 99");
    let stderr = refused(&["--redis", &format!("127.0.0.1:{port}")], "the URL has no scheme");
    assert!(stderr.contains(&format!("write redis://127.0.0.1:{port}")) && stderr.contains("rediss://"), "{stderr}");

    // The right password starts, and is ready.
    let right = dir.path().join("right-password");
    std::fs::write(&right, "right").unwrap();
    let s = SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.path().to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--redis",
        &format!("redis://sluice@127.0.0.1:{port}/1"),
        "--redis-password-file",
        right.to_str().unwrap(),
    ]);
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.get(s.url("/readyz")).send().await.unwrap().status() != 200 {
        assert!(Instant::now() < deadline, "not ready: {:?}", s.logs.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The same on a Redis Cluster, whose client wraps a node's refusal into "Failed to create
/// initial connections": start-up stops with Redis's own words, not as a cluster that is away.
#[test]
fn a_redis_cluster_refusing_the_credentials_stops_start_up() {
    let cluster = RedisCluster::start();
    for node in &cluster.nodes {
        assert_eq!(node.cli(&["CONFIG", "SET", "requirepass", "right"]).trim(), "OK");
    }
    let urls: Vec<String> =
        cluster.nodes.iter().map(|node| format!("redis://:wrong@127.0.0.1:{}", node.port())).collect();
    let dir = policy_dir();
    let (code, stderr) = run_for_at_most(
        &[
            "serve",
            "--policies",
            dir.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--redis-cluster",
            &urls.join(","),
        ],
        Duration::from_secs(20),
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Redis refused the credentials: WRONGPASS"), "{stderr}");
}
