//! The sidecar's overload protection end to end: `sluice serve` with a policy that has
//! `priorities` and `overload`, the real sidecar binary in front of an application that holds
//! each request, and requests of each class at once.

#[path = "support/sluice_process.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::any;
use serde_json::Value;
use support::SluiceProcess;

/// An application that holds every request for `hold` and remembers the most it held at once.
struct App {
    address: SocketAddr,
    in_flight: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

async fn start_app(hold: Duration) -> App {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (now, peak) = (in_flight.clone(), most.clone());
    let app = Router::new().fallback(any(move || {
        let (now, peak) = (now.clone(), peak.clone());
        async move {
            let current = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(current, Ordering::SeqCst);
            tokio::time::sleep(hold).await;
            now.fetch_sub(1, Ordering::SeqCst);
            "ok\n"
        }
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    App { address, in_flight, most }
}

const PRIORITIES: &str = r#"
  priorities:
    - {class: critical, match: {paths: [{prefix: /checkout}]}}
    - {class: sheddable, match: {paths: [{prefix: /reports}]}}
"#;

struct Setup {
    _dir: tempfile::TempDir,
    serve: SluiceProcess,
    sidecar: SluiceProcess,
    admin: SocketAddr,
}

/// `sluice serve` on a policy with `overload` (the YAML of its fields) and the sidecar in front
/// of `app`; returns once the sidecar has the policy's protection on.
async fn start(app: &App, overload: &str, sidecar_args: &[&str]) -> Setup {
    start_with_spec(app, &format!("{PRIORITIES}  overload: {overload}\n  rules: []\n"), sidecar_args).await
}

/// [`start`] with the whole spec of the policy (YAML under `spec:`).
async fn start_with_spec(app: &App, spec: &str, sidecar_args: &[&str]) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let policy = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: protect, namespace: shop}}\nspec:{spec}"
    );
    std::fs::write(dir.path().join("p.yaml"), policy).unwrap();
    let serve = SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"]);
    let endpoint = format!("http://{}", serve.addr);
    let sidecar = SluiceProcess::sidecar(&app.address.to_string(), &endpoint, "shop", sidecar_args);
    let admin = sidecar.logged_address("admin");
    let setup = Setup { _dir: dir, serve, sidecar, admin };
    let deadline = Instant::now() + Duration::from_secs(15);
    while setup.overload().await["protection"].is_null() {
        assert!(Instant::now() < deadline, "protection never on: {:?}", setup.sidecar.logs.lock().unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    setup
}

impl Setup {
    async fn overload(&self) -> Value {
        client().get(format!("http://{}/overload", self.admin)).send().await.unwrap().json().await.unwrap()
    }

    async fn metrics(&self) -> String {
        client().get(format!("http://{}/metrics", self.admin)).send().await.unwrap().text().await.unwrap()
    }

    /// `n` requests to `path` at once; their statuses, in order.
    async fn burst(&self, path: &str, n: usize) -> Vec<(u16, Option<String>)> {
        let c = client();
        let requests = (0..n).map(|_| {
            let request = c.get(self.sidecar.url(path)).send();
            async move {
                let response = request.await.unwrap();
                let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
                (response.status().as_u16(), retry_after)
            }
        });
        futures::future::join_all(requests).await
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap()
}

fn count(statuses: &[(u16, Option<String>)], status: u16) -> usize {
    statuses.iter().filter(|(s, _)| *s == status).count()
}

/// A fixed limit of 4: sheddable requests may fill half of it, default 80%, critical all; past
/// their share they get 503 with Retry-After and never reach the application.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lowest_class_is_shed_first_and_critical_requests_keep_the_rest() {
    let app = start_app(Duration::from_millis(400)).await;
    let setup = start(&app, "{initialLimit: 4, minLimit: 4, maxLimit: 4, retryAfter: 2s}", &[]).await;

    let reports = tokio::spawn({
        let url = setup.sidecar.url("/reports");
        async move {
            let c = client();
            let all = (0..6).map(|_| c.get(&url).send());
            futures::future::join_all(all).await
        }
    });
    // While the reports hold their two slots, critical requests take the other two.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let checkout = setup.burst("/checkout", 2).await;
    let reports: Vec<u16> = reports.await.unwrap().into_iter().map(|r| r.unwrap().status().as_u16()).collect();
    assert_eq!(reports.iter().filter(|s| **s == 200).count(), 2, "sheddable: 50% of 4 {reports:?}");
    assert_eq!(reports.iter().filter(|s| **s == 503).count(), 4, "{reports:?}");
    assert_eq!(count(&checkout, 200), 2, "critical: the rest of the limit {checkout:?}");
    assert!(app.most.load(Ordering::SeqCst) <= 4, "the application never held more than the limit");

    let shed = setup.burst("/reports", 3).await;
    assert!(shed.iter().any(|(s, r)| *s == 200 || r.as_deref() == Some("2")), "503s carry Retry-After: 2 {shed:?}");
    let state = setup.overload().await;
    assert_eq!(state["protection"]["policy"], "shop/protect");
    assert_eq!(state["protection"]["state"]["limit"], 4);
    assert!(state["protection"]["state"]["shed"]["sheddable"].as_u64().unwrap() >= 4, "{state}");
    assert_eq!(state["protection"]["state"]["shed"]["critical"], 0);
    let metrics = setup.metrics().await;
    assert!(metrics.contains(r#"sluice_sidecar_overload_shed_total{class="sheddable"}"#), "{metrics}");
    assert!(metrics.contains("sluice_sidecar_overload_limit 4"), "{metrics}");
    assert_eq!(app.in_flight.load(Ordering::SeqCst), 0);
}

/// Shadow mode: the same traffic, nothing refused, what would have been counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shadow_mode_refuses_nothing_and_counts_what_it_would_shed() {
    let app = start_app(Duration::from_millis(300)).await;
    let setup = start(&app, "{mode: shadow, initialLimit: 4, minLimit: 4, maxLimit: 4}", &[]).await;
    let reports = setup.burst("/reports", 6).await;
    assert_eq!(count(&reports, 200), 6, "{reports:?}");
    let state = setup.overload().await;
    assert_eq!(state["protection"]["state"]["wouldShed"]["sheddable"], 4, "{state}");
    assert_eq!(state["protection"]["state"]["shed"]["sheddable"], 0);
}

/// A critical request over the limit waits (criticalWait) for a slot instead of being refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_critical_request_waits_for_a_slot_within_its_wait() {
    let app = start_app(Duration::from_millis(300)).await;
    let setup =
        start(&app, "{initialLimit: 2, minLimit: 2, maxLimit: 2, criticalWait: 2s, criticalQueue: 4}", &[]).await;
    let started = Instant::now();
    let checkout = setup.burst("/checkout", 4).await;
    assert_eq!(count(&checkout, 200), 4, "two at once, two after waiting {checkout:?}");
    assert!(started.elapsed() >= Duration::from_millis(550), "the last two waited for the first two");
    assert!(app.most.load(Ordering::SeqCst) <= 2);
}

/// The container's cgroup (here a directory laid out like cgroup v2) reports memory past the
/// policy's threshold: the protection sees the pressure and the limit comes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_pressure_in_the_cgroup_lowers_the_limit() {
    let cgroup = tempfile::tempdir().unwrap();
    std::fs::write(cgroup.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
    std::fs::write(cgroup.path().join("memory.current"), "95\n").unwrap();
    std::fs::write(cgroup.path().join("memory.max"), "100\n").unwrap();
    let app = start_app(Duration::from_millis(5)).await;
    let root = cgroup.path().to_str().unwrap().to_string();
    let setup = start(&app, "{initialLimit: 20, memoryPercent: 90}", &["--cgroup-root", &root]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while setup.overload().await["protection"]["pressure"] != true {
        assert!(Instant::now() < deadline, "pressure never seen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A window (500 ms, 10 responses) under pressure lowers the limit by a tenth.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        setup.burst("/", 12).await;
        let limit = setup.overload().await["protection"]["state"]["limit"].as_u64().unwrap();
        if limit < 20 {
            break;
        }
        assert!(Instant::now() < deadline, "the limit stayed at {limit}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Memory back under the threshold: the pressure ends.
    std::fs::write(cgroup.path().join("memory.current"), "10\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while setup.overload().await["protection"]["pressure"] != false {
        assert!(Instant::now() < deadline, "pressure never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A rule's declared refusal (graceful degradation): a refused read gets a 200 with a reduced
/// answer from the sidecar and in `/v1/check`'s answer, and `/v1/authz` (where 2xx would mean
/// "allow") sends it as 429 with the same headers and body; Retry-After carries the jitter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_declared_refusal_replaces_the_429_everywhere() {
    let app = start_app(Duration::from_millis(1)).await;
    // overload is on so that `start_with_spec` can tell when the sidecar has the policy.
    let spec = r#"
  overload: {initialLimit: 100}
  rules:
    - name: catalog
      algorithm: tokenBucket
      limit: {requests: 1, per: 1h}
      retryAfterJitter: 30s
      refusal:
        status: 200
        headers: {content-type: application/json, x-degraded: "true"}
        body: '{"items": [], "degraded": true}'
"#;
    let setup = start_with_spec(&app, spec, &[]).await;
    let c = client();
    assert_eq!(c.get(setup.sidecar.url("/catalog")).send().await.unwrap().text().await.unwrap(), "ok\n");
    let before = app.most.load(Ordering::SeqCst);
    let refused = c.get(setup.sidecar.url("/catalog")).send().await.unwrap();
    assert_eq!(refused.status(), 200);
    assert_eq!(refused.headers()["x-degraded"], "true");
    assert_eq!(refused.headers()["content-type"], "application/json");
    let retry: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((3599..=3631).contains(&retry), "an hour to refill plus up to 30 s: {retry}");
    let mut spread = std::collections::BTreeSet::new();
    for _ in 0..8 {
        let again = c.get(setup.sidecar.url("/catalog")).send().await.unwrap();
        spread.insert(again.headers()["retry-after"].to_str().unwrap().to_string());
    }
    assert!(spread.len() >= 2, "the jitter spreads Retry-After: {spread:?}");
    assert!(refused.headers().contains_key("ratelimit"), "the rate-limit headers stay");
    assert_eq!(refused.text().await.unwrap(), r#"{"items": [], "degraded": true}"#);
    assert_eq!(app.most.load(Ordering::SeqCst), before, "the application never saw it");

    let endpoint = setup.serve.url("");
    let check: Value = c
        .post(format!("{endpoint}/v1/check"))
        .json(&serde_json::json!({"namespace": "shop", "path": "/catalog"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((check["allowed"].as_bool(), check["status"].as_u64()), (Some(false), Some(200)), "{check}");
    assert_eq!(check["body"], r#"{"items": [], "degraded": true}"#);
    assert_eq!(check["headers"]["x-degraded"], "true");
    let authz =
        c.get(format!("{endpoint}/v1/authz/catalog")).header("x-sluice-namespace", "shop").send().await.unwrap();
    assert_eq!(authz.status(), 429, "a 2xx through ext_authz would admit the request");
    assert_eq!(authz.headers()["x-degraded"], "true");
    assert_eq!(authz.text().await.unwrap(), r#"{"items": [], "degraded": true}"#);
}

/// `overload.refusal` replaces the default 503 of a shed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shed_request_gets_the_declared_refusal() {
    let app = start_app(Duration::from_millis(300)).await;
    let setup = start(
        &app,
        "{initialLimit: 2, minLimit: 2, maxLimit: 2, refusal: {status: 503, headers: {content-type: text/plain}, body: busy}}",
        &[],
    )
    .await;
    let c = client();
    let all = (0..3).map(|_| c.get(setup.sidecar.url("/reports")).send());
    let responses = futures::future::join_all(all).await;
    let mut bodies = Vec::new();
    for response in responses {
        let response = response.unwrap();
        let status = response.status().as_u16();
        let retry_after = response.headers().contains_key("retry-after");
        bodies.push((status, retry_after, response.text().await.unwrap()));
    }
    assert_eq!(bodies.iter().filter(|(s, r, b)| *s == 503 && *r && b == "busy").count(), 2, "{bodies:?}");
}

/// `overload.exempt` (a long-poll path): never refused, never in flight, whatever the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exempt_requests_pass_untouched() {
    let app = start_app(Duration::from_millis(300)).await;
    let setup =
        start(&app, "{initialLimit: 2, minLimit: 2, maxLimit: 2, exempt: [{paths: [{prefix: /events}]}]}", &[]).await;
    let events = setup.burst("/events/stream", 6).await;
    assert_eq!(count(&events, 200), 6, "{events:?}");
    let state = setup.overload().await;
    assert_eq!(state["protection"]["state"]["shed"]["default"], 0, "{state}");
    // The same burst on another path is limited.
    let other = setup.burst("/search", 6).await;
    assert!(count(&other, 503) >= 3, "{other:?}");
    // Issue #37: spelled to climb out of an exempt or critical prefix by a decoded `%2F`, a
    // request was exempt (or critical) while the application served it as `/reports/…`.
    for path in ["/events/..%2F..%2Fsearch", "/checkout/..%2F..%2Freports", "/reports/..%2f..%2fevents"] {
        let reply = setup.burst(path, 1).await;
        assert_eq!(reply[0].0, 400, "{path}: {reply:?}");
    }
}

/// Issue #37: a critical request waiting for a slot whose client goes away gives its place in
/// the queue back (it stayed counted as waiting, and a full queue refused every later critical
/// request until the sidecar restarted).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_critical_request_whose_client_leaves_gives_its_place_back() {
    let app = start_app(Duration::from_secs(3)).await;
    let setup =
        start(&app, "{initialLimit: 1, minLimit: 1, maxLimit: 1, criticalWait: 20s, criticalQueue: 4}", &[]).await;
    let c = client();
    // One in the application, four waiting; the four clients give up after 500 ms.
    let busy = tokio::spawn(c.get(setup.sidecar.url("/checkout/0")).send());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    let waiting: Vec<_> = (0..4).map(|i| impatient.get(setup.sidecar.url(&format!("/checkout/{i}"))).send()).collect();
    for reply in futures::future::join_all(waiting).await {
        assert!(reply.is_err(), "the client gave up: {reply:?}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = setup.overload().await;
        if state["protection"]["state"]["waiting"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the places were never given back: {state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(busy.await.unwrap().unwrap().status(), 200);
    // The queue has room again: a critical request over the limit waits and is served.
    let checkout = setup.burst("/checkout/1", 2).await;
    assert_eq!(count(&checkout, 200), 2, "{checkout:?}");
    let state = setup.overload().await;
    assert_eq!(state["protection"]["state"]["shed"]["critical"], 0, "leaving is not being shed: {state}");
}

/// Sends a request head with `Content-Length: 1000` and then 5 bytes a second; returns the
/// socket so the upload lasts as long as the caller keeps it.
async fn slow_upload(address: SocketAddr, path: &str) -> tokio::task::JoinHandle<()> {
    use tokio::io::AsyncWriteExt as _;
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: shop\r\ncontent-type: application/octet-stream\r\ncontent-length: 1000\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::spawn(async move {
        for _ in 0..200 {
            if stream.write_all(b"xxxxx").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
}

/// Issue #37: clients trickling small uploads held every default-class slot while the
/// application was idle (20 of 20 `GET /` refused). A body of a declared length up to 64 KiB is
/// read before the request takes a slot, within the read-ahead deadline (then 408).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_uploads_hold_no_slot_under_overload_protection() {
    let app = start_app(Duration::from_millis(10)).await;
    let setup = start(&app, "{initialLimit: 8, minLimit: 8, maxLimit: 8}", &[]).await;
    let mut uploads = Vec::new();
    for i in 0..8 {
        uploads.push(slow_upload(setup.sidecar.addr, &format!("/upload/{i}")).await);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut gets = Vec::new();
    for _ in 0..20 {
        gets.extend(setup.burst("/", 1).await);
    }
    assert_eq!(count(&gets, 200), 20, "the application is idle: {gets:?}");
    assert_eq!(setup.overload().await["protection"]["state"]["inFlight"], 0, "no upload holds a slot");
    for upload in uploads {
        upload.abort();
    }
}

/// Issue #37: a body read ahead for an estimate (up to 1 MiB of JSON) had no deadline: stalled
/// uploads pinned sidecar memory for as long as their clients liked. Now they are answered 408
/// after the read-ahead deadline, and what they sent is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_body_read_ahead_is_answered_408_at_the_deadline() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let app = start_app(Duration::from_millis(10)).await;
    let spec = "\n  rules:\n    - name: tokens\n      algorithm: fixedWindow\n      limit: {requests: 100000, per: 1h}\n      responseCost:\n        fields: [usage.total_tokens]\n        estimate: {requestField: max_tokens, cap: 1000}\n";
    let setup = start_with_spec(&app, &format!("{PRIORITIES}  overload: {{initialLimit: 100}}\n{spec}"), &[]).await;
    let mut stream = tokio::net::TcpStream::connect(setup.sidecar.addr).await.unwrap();
    let head =
        "POST /v1/chat HTTP/1.1\r\nhost: shop\r\ncontent-type: application/json\r\ncontent-length: 1048576\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b' '; 512 * 1024]).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "no answer within 30 s: the read-ahead has no deadline");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(started.elapsed() >= Duration::from_secs(5), "answered at the deadline, not before");
    assert_eq!(app.most.load(Ordering::SeqCst), 0, "never forwarded");
}
