//! `sluice serve` as a process: start-up, hot reload of files, SIGTERM. The HTTP contract itself is
//! tested in-process (tests/http_contract.rs).

#[path = "support/check_api.rs"]
mod check_api;
#[path = "support/sluice_process.rs"]
mod support;

use std::time::{Duration, Instant};

use check_api::{POLICY, order};
use serde_json::Value;
use support::{SluiceProcess, run_for_at_most, run_to_end};

fn start(dir: &std::path::Path) -> SluiceProcess {
    SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--reload-interval",
        "50ms",
    ])
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap()
}

async fn check(c: &reqwest::Client, s: &SluiceProcess, body: &Value) -> Value {
    let r = c.post(s.url("/v1/check")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn policy_dir(text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), text).unwrap();
    dir
}

#[tokio::test]
async fn hot_reload_applies_edits_and_keeps_the_last_good_snapshot() {
    let dir = policy_dir(POLICY);
    let file = dir.path().join("policies.yaml");
    let s = start(dir.path());
    let c = client();
    let ready = c.get(s.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(c.get(s.url("/healthz")).send().await.unwrap().status(), 200);

    let snap: Value = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
    let v1 = snap["version"].as_str().unwrap().to_string();
    assert_eq!(snap["lastReloadError"], Value::Null);
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 3);

    // Edit the limit: enforced within a second, and counters survive (1 already used).
    std::fs::write(&file, POLICY.replace("requests: 3, per: 1h", "requests: 5, per: 1h")).unwrap();
    let started = Instant::now();
    let mut after = Value::Null;
    while started.elapsed() < Duration::from_secs(1) {
        after = check(&c, &s, &order("r")).await;
        if after["rules"][0]["limit"] == 5 {
            break;
        }
    }
    assert_eq!(after["rules"][0]["limit"], 5, "reload within a second");
    assert!(after["rules"][0]["remaining"].as_u64().unwrap() <= 3, "counters kept: {after}");

    // A bad edit: the last good snapshot stays and the error is visible.
    std::fs::write(&file, POLICY.replace("requests: 3, per: 1h", "requests: 3, per: 1x")).unwrap();
    let started = Instant::now();
    let mut snap = Value::Null;
    while started.elapsed() < Duration::from_secs(5) {
        snap = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        if !snap["lastReloadError"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let error = snap["lastReloadError"]["message"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("policies.yaml") && error.contains("spec.rules[0].limit.per"), "{snap}");
    assert_ne!(snap["version"], v1.as_str());
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 5, "still the last good snapshot");

    // Fixing it clears the error.
    std::fs::write(&file, POLICY).unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        snap = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        if snap["lastReloadError"].is_null() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(snap["version"], v1.as_str());
    assert!(snap["lastReloadError"].is_null());
}

#[tokio::test]
async fn sigterm_drains_and_exits_zero() {
    let dir = policy_dir(POLICY);
    let mut s = start(dir.path());
    // A sidecar's snapshot request, held while nothing changes: the stop must end it, not wait
    // out its 60 s.
    let etag = reqwest::get(s.url("/v1/snapshot")).await.unwrap().headers()["etag"].to_str().unwrap().to_string();
    let held = tokio::spawn({
        let url = s.url("/v1/snapshot?wait=60s");
        async move { reqwest::Client::new().get(url).header("if-none-match", etag).send().await.map(|r| r.status()) }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!held.is_finished(), "the snapshot request is held");
    let started = std::time::Instant::now();
    let status = tokio::task::spawn_blocking(move || s.terminate()).await.unwrap();
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(30), "the held request delayed the stop: {:?}", started.elapsed());
    assert_eq!(held.await.unwrap().expect("answered before the exit").as_u16(), 304);
}

#[test]
fn a_bad_file_at_startup_exits_non_zero_naming_file_and_field() {
    let dir = policy_dir(&POLICY.replace("requests: 3, per: 1h", "requests: 0, per: 1h"));
    let (code, stderr) =
        run_to_end(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"], dir.path());
    assert_ne!(code, Some(0));
    assert!(stderr.contains("policies.yaml"), "{stderr}");
    assert!(stderr.contains("spec.rules[0].limit.requests"), "{stderr}");
}

/// No policy at all is an allow-all that looks healthy: a directory whose policies sit one level
/// down (loading is not recursive), an empty directory or an empty file refuse to start, naming
/// the path and the subdirectory that holds YAML, unless --allow-empty says it is meant.
#[tokio::test]
async fn an_empty_policy_set_refuses_to_start_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let below = dir.path().join("policies");
    std::fs::create_dir(&below).unwrap();
    std::fs::write(below.join("policies.yaml"), POLICY).unwrap();
    let empty_file = dir.path().join("empty.yaml");
    std::fs::write(&empty_file, "# nothing yet\n").unwrap();
    let empty_dir = tempfile::tempdir().unwrap();

    let serve = |path: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["serve", "--policies", path.to_str().unwrap(), "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        run_for_at_most(&args, Duration::from_secs(20))
    };
    let (code, stderr) = serve(dir.path(), &[]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("hold no RateLimitPolicy document"), "{stderr}");
    assert!(stderr.contains(&format!("e.g. --policies {}", below.display())), "names the subdirectory: {stderr}");
    assert!(stderr.contains("--allow-empty"), "{stderr}");
    for path in [empty_dir.path(), empty_file.as_path()] {
        let (code, stderr) = serve(path, &[]);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(stderr.contains(&path.display().to_string()) && stderr.contains("--allow-empty"), "{stderr}");
    }

    let allowed = SluiceProcess::start(&[
        "serve",
        "--policies",
        empty_dir.path().to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--allow-empty",
    ]);
    let ready = client().get(allowed.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "--allow-empty starts on no policies");
}

/// A policy file emptied (or moved away) after start would lift every limit: the reload is
/// refused, the last good snapshot stays in force, and `/v1/snapshot` says why.
#[tokio::test]
async fn a_reload_to_no_policies_keeps_the_last_good_snapshot() {
    let dir = policy_dir(POLICY);
    let s = start(dir.path());
    let c = client();
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 3);
    std::fs::remove_file(dir.path().join("policies.yaml")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let snapshot = loop {
        let snapshot: Value = c.get(s.url("/v1/snapshot")).send().await.unwrap().json().await.unwrap();
        if !snapshot["lastReloadError"].is_null() {
            break snapshot;
        }
        assert!(Instant::now() < deadline, "no reload error: {snapshot}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let message = snapshot["lastReloadError"]["message"].as_str().unwrap();
    assert!(message.contains("hold no RateLimitPolicy document"), "{message}");
    assert!(message.contains("keeping the last good snapshot"), "{message}");
    assert_eq!(check(&c, &s, &order("r")).await["rules"][0]["limit"], 3, "still limited");
    let logs = s.logs.lock().unwrap().join("\n");
    assert!(logs.contains("policy reload refused: the policies now hold none"), "{logs}");
}
