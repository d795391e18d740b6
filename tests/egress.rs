//! Egress shaping (`spec.egress`) end to end: a "bank" downstream that records when each
//! request arrives, the real `sluice serve` on real Redis as the endpoint, and three real
//! `sluice sidecar`s, each offered the bank by its own policy, calling it together. The bank
//! must never see more than the declared rate plus one request per caller; no request waits
//! past `maxDelay`; what does not fit is refused at once; and a wait given up gives its slot
//! back.

#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sluice_process.rs"]
mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::any;
use redis_server::RedisServer;
use serde_json::{Value, json};
use support::SluiceProcess;

/// 20 requests a second, waits of at most 3 s.
const RATE: u64 = 20;
const MAX_DELAY_MS: u64 = 3_000;

async fn start_bank() -> (SocketAddr, Arc<Mutex<Vec<Instant>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new()
        .fallback(any(|State(arrivals): State<Arc<Mutex<Vec<Instant>>>>| async move {
            arrivals.lock().unwrap().push(Instant::now());
            "paid\n"
        }))
        .with_state(arrivals.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, arrivals)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One policy per caller (its own selector and listen port), all naming the same bank: one
/// budget.
fn policies(bank: SocketAddr, ports: &[u16]) -> String {
    ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            format!(
                "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: caller-{i}, namespace: pay}}\nspec:\n  selector: {{matchLabels: {{app: caller-{i}}}}}\n  egress:\n  - name: bank\n    destination: http://{bank}\n    listenPort: {port}\n    limit: {{requests: {RATE}, per: 1s, maxDelay: {MAX_DELAY_MS}ms}}\n    deadlineHeader: x-deadline-ms\n"
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

fn serve(dir: &std::path::Path, redis: Option<&RedisServer>) -> SluiceProcess {
    let mut args = vec![
        "serve".to_string(),
        "--policies".into(),
        dir.to_str().unwrap().into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
    ];
    if let Some(redis) = redis {
        args.extend(["--redis".into(), redis.url(), "--redis-timeout".into(), "5s".into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    SluiceProcess::start(&args)
}

async fn until_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "no egress listener on {port}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The most arrivals in any window of `width` starting at an arrival.
fn most_in_any(arrivals: &[Instant], width: Duration) -> usize {
    (0..arrivals.len())
        .map(|i| arrivals[i..].iter().take_while(|t| **t - arrivals[i] < width).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_callers_share_one_budget_and_the_bank_never_sees_more_than_its_rate() {
    let redis = RedisServer::start();
    let (bank, arrivals) = start_bank().await;
    let ports = [free_port(), free_port(), free_port()];
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("egress.yaml"), policies(bank, &ports)).unwrap();
    let endpoint = serve(dir.path(), Some(&redis));
    let endpoint_url = endpoint.url("");
    let _sidecars: Vec<SluiceProcess> = (0..3)
        .map(|i| {
            let labels = format!("app=caller-{i}");
            SluiceProcess::sidecar("127.0.0.1:9", &endpoint_url, "pay", &["--labels", &labels])
        })
        .collect();
    for port in ports {
        until_listening(port).await;
    }

    // 3 callers × 25 requests at once: 75 requests at 20/s need 3.7 s, so those past maxDelay
    // (3 s: about the first 61) are refused at once.
    let client = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let started = Instant::now();
    let calls = ports.iter().flat_map(|port| {
        let client = client.clone();
        (0..25).map(move |i| {
            let client = client.clone();
            async move {
                let sent = Instant::now();
                let response = client
                    .post(format!("http://127.0.0.1:{port}/transfer?n={i}"))
                    .body("amount=1")
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let waited = response
                    .headers()
                    .get("sluice-egress-waited-ms")
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                let retry_after = response.headers().get("retry-after").is_some();
                let text = response.text().await.unwrap();
                (status, waited, retry_after, sent.elapsed(), text)
            }
        })
    });
    let answers = futures::future::join_all(calls).await;
    let sent: Vec<_> = answers.iter().filter(|a| a.0 == 200).collect();
    let refused: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert_eq!(sent.len() + refused.len(), answers.len(), "only sent or refused: {answers:?}");
    assert!(sent.len() >= 55 && !refused.is_empty(), "{} sent, {} refused", sent.len(), refused.len());
    for (_, waited, _, _, text) in &sent {
        assert_eq!(text, "paid\n");
        let waited = waited.expect("every egress answer says how long it waited");
        assert!(waited <= MAX_DELAY_MS, "waited {waited} ms, past maxDelay");
    }
    for (_, _, retry_after, _, text) in &refused {
        assert!(*retry_after, "a refusal says when to come back");
        assert!(text.contains("egress bank"), "{text}");
    }
    // Each refusal came without waiting: refused ones finish long before the queue drains.
    let slowest_refusal = refused.iter().map(|a| a.3).max().unwrap();
    let slowest_sent = sent.iter().map(|a| a.3).max().unwrap();
    assert!(slowest_refusal < slowest_sent, "a refusal waited: {slowest_refusal:?} vs {slowest_sent:?}");

    let mut seen = arrivals.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen.len(), sent.len(), "every request sent reached the bank once");
    let callers = 3;
    let per_second = most_in_any(&seen, Duration::from_secs(1));
    assert!(per_second <= RATE as usize + callers, "the bank saw {per_second} in one second (rate {RATE})");
    // Departures were spaced: the whole lot took at least (n − 1) intervals, less the slack.
    let span = *seen.last().unwrap() - seen[0];
    let least = Duration::from_millis(1000 / RATE * (seen.len() as u64 - 1 - callers as u64));
    assert!(span >= least, "{} requests in {span:?}, faster than {RATE}/s", seen.len());
    eprintln!(
        "sent {} refused {} in {:?}; most in 1 s {per_second}, in 100 ms {}",
        sent.len(),
        refused.len(),
        started.elapsed(),
        most_in_any(&seen, Duration::from_millis(100))
    );

    // A caller's deadline nearer than the wait is refused at once.
    let late =
        client.get(format!("http://127.0.0.1:{}/balance", ports[0])).header("x-deadline-ms", "0").send().await.unwrap();
    // The queue may have drained by now (no wait: sent) — but never waited past the deadline.
    match late.status().as_u16() {
        200 => assert_eq!(late.headers()["sluice-egress-waited-ms"], "0"),
        429 => assert!(late.headers().contains_key("retry-after")),
        other => panic!("answered {other}"),
    }
}

async fn check(client: &reqwest::Client, endpoint: &SluiceProcess, body: Value) -> Value {
    let response = client.post(endpoint.url("/v1/check")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// A wait given up gives its slot back when it is the last one; one with others queued behind
/// keeps it; a deadline shorter than the wait is refused without taking a slot. On the memory
/// store and on Redis (lua/gcra.lua's `give_back`).
async fn cancelled_waits(redis: Option<&RedisServer>) {
    let (bank, _) = start_bank().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("egress.yaml"), policies(bank, &[free_port()])).unwrap();
    let endpoint = serve(dir.path(), redis);
    let client = reqwest::Client::new();
    let ask = json!({"namespace": "pay", "labels": {"app": "caller-0"}, "path": "/", "egress": "bank"});
    let first = check(&client, &endpoint, ask.clone()).await;
    assert_eq!(first["allowed"], true);
    let second = check(&client, &endpoint, ask.clone()).await;
    let third = check(&client, &endpoint, ask.clone()).await;
    let (second_delay, third_delay) = (second["delayMs"].as_u64().unwrap(), third["delayMs"].as_u64().unwrap());
    assert!(third_delay > second_delay && second_delay > 0, "{second} {third}");
    let cancel = |slot: &Value| {
        let mut body = ask.clone();
        body["slot"] = slot.clone();
        let client = client.clone();
        let url = endpoint.url("/v1/cancel");
        async move { client.post(url).json(&body).send().await.unwrap().json::<Value>().await.unwrap() }
    };
    // The second has the third queued behind it: its slot stays taken (the bank would
    // otherwise see two at once).
    assert_eq!(cancel(&second["slot"]).await["givenBack"], 0);
    // The third is the last: its slot goes back, once, and the next caller departs then.
    assert_eq!(cancel(&third["slot"]).await["givenBack"], 1);
    assert_eq!(cancel(&third["slot"]).await["givenBack"], 0, "given back twice");
    let next = check(&client, &endpoint, ask.clone()).await;
    let next_delay = next["delayMs"].as_u64().unwrap();
    assert!(next_delay <= third_delay && next_delay + 100 > third_delay, "{next} after {third}");
    // A deadline shorter than the wait: refused at once, taking nothing.
    let mut hurried = ask.clone();
    hurried["deadlineMs"] = json!(1);
    let refused = check(&client, &endpoint, hurried).await;
    assert_eq!(refused["allowed"], false, "{refused}");
    assert!(refused["retryAfterMs"].as_u64().unwrap() > 0);
    let after = check(&client, &endpoint, ask.clone()).await;
    assert!(after["delayMs"].as_u64().unwrap() >= next_delay + 40, "the refusal took a slot: {after} after {next}");
    // The wait form: the answer comes when the slot is due, with nothing left to wait.
    let mut waiting = ask.clone();
    waiting["wait"] = json!(true);
    let sent = Instant::now();
    let waited = check(&client, &endpoint, waiting).await;
    assert_eq!((waited["allowed"].as_bool(), waited["delayMs"].as_u64()), (Some(true), Some(0)), "{waited}");
    assert!(sent.elapsed() >= Duration::from_millis(100), "answered before its slot: {:?}", sent.elapsed());
    // A workload no policy offers the bank to cannot name it: refused, never admitted unruled.
    let stranger = client
        .post(endpoint.url("/v1/check"))
        .json(&json!({"namespace": "pay", "labels": {"app": "other"}, "path": "/", "egress": "bank"}))
        .send()
        .await
        .unwrap();
    assert_eq!(stranger.status(), 400, "no entry is offered to that workload");
    let text = stranger.text().await.unwrap();
    assert!(text.contains("spec.egress") && text.contains("bank"), "{text}");
}

#[tokio::test]
async fn a_cancelled_wait_gives_its_slot_back_in_memory() {
    cancelled_waits(None).await;
}

#[tokio::test]
async fn a_cancelled_wait_gives_its_slot_back_in_redis() {
    let redis = RedisServer::start();
    cancelled_waits(Some(&redis)).await;
}

/// A caller that gives up while its request waits: its sidecar notices (the connection closes)
/// and gives the slot back, so the next caller departs in it instead of an interval later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_while_waiting_gives_its_slot_back() {
    use tokio::io::AsyncWriteExt;
    let (bank, _) = start_bank().await;
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    // 2 a second: departures 500 ms apart.
    let policy = policies(bank, &[port]).replace(&format!("requests: {RATE}, per: 1s"), "requests: 2, per: 1s");
    std::fs::write(dir.path().join("egress.yaml"), policy).unwrap();
    let endpoint = serve(dir.path(), None);
    let sidecar = SluiceProcess::sidecar("127.0.0.1:9", &endpoint.url(""), "pay", &["--labels", "app=caller-0"]);
    until_listening(port).await;
    let head = format!("GET /balance HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n");
    // Three callers in turn: departing now, in 500 ms, in 1000 ms.
    let mut callers = Vec::new();
    for _ in 0..3 {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        callers.push(stream);
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    // The last one goes away while it waits.
    drop(callers.pop());
    let admin = sidecar.logged_address("admin");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = client.get(format!("http://{admin}/metrics")).send().await.unwrap().text().await.unwrap();
        if metrics.contains("egress_requests_total{outcome=\"abandoned\"} 1") {
            break;
        }
        assert!(Instant::now() < deadline, "the abandoned wait was not counted:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The next caller gets the abandoned slot (about 1000 ms after the first), not the one
    // after it (1500 ms).
    let next = client.get(format!("http://127.0.0.1:{port}/balance")).send().await.unwrap();
    assert_eq!(next.status(), 200);
    let waited: u64 = next.headers()["sluice-egress-waited-ms"].to_str().unwrap().parse().unwrap();
    assert!(waited < 1_000, "waited {waited} ms: the abandoned slot was kept");
    drop(callers);
}

/// TLS origination: the application speaks plain HTTP to its egress port and the sidecar opens
/// TLS to an https:// destination, verifying its certificate against the entry's caBundle; an
/// entry trusting only the system roots refuses the same server (a private CA), never sending
/// the request in the clear or unverified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_originates_tls_verified_against_the_declared_ca() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pair = sluice::admission::certs::generate(&["127.0.0.1".to_string()]).unwrap();
    let tls = axum_server::tls_rustls::RustlsConfig::from_pem(
        pair.cert_pem.clone().into_bytes(),
        pair.key_pem.clone().into_bytes(),
    )
    .await
    .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let bank = listener.local_addr().unwrap();
    let app = Router::new().fallback(any(|| async { "paid over tls\n" }));
    tokio::spawn(
        async move { axum_server::from_tcp_rustls(listener, tls).unwrap().serve(app.into_make_service()).await },
    );
    let (trusted, untrusted) = (free_port(), free_port());
    let ca = pair.ca_pem.lines().map(|l| format!("        {l}\n")).collect::<String>();
    let policy = format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: caller-0, namespace: pay}}\nspec:\n  selector: {{matchLabels: {{app: caller-0}}}}\n  egress:\n  - name: trusted\n    destination: https://{bank}\n    listenPort: {trusted}\n    limit: {{requests: 50, per: 1s, maxDelay: 1s}}\n    caBundle: |\n{ca}  - name: system-roots\n    destination: https://{bank}\n    listenPort: {untrusted}\n    limit: {{requests: 50, per: 1s, maxDelay: 1s}}\n"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("egress.yaml"), policy).unwrap();
    let endpoint = serve(dir.path(), None);
    let _sidecar = SluiceProcess::sidecar("127.0.0.1:9", &endpoint.url(""), "pay", &["--labels", "app=caller-0"]);
    until_listening(trusted).await;
    until_listening(untrusted).await;
    let client = reqwest::Client::new();
    let verified = client.get(format!("http://127.0.0.1:{trusted}/pay")).send().await.unwrap();
    assert_eq!(verified.status(), 200);
    assert_eq!(verified.text().await.unwrap(), "paid over tls\n");
    let refused = client.get(format!("http://127.0.0.1:{untrusted}/pay")).send().await.unwrap();
    assert_eq!(refused.status(), 502);
    let why = refused.text().await.unwrap();
    assert!(why.contains("system-roots") && why.to_lowercase().contains("certificate"), "{why}");
}
