//! Costs known after the response, end to end: `sluice serve` and the real sidecar in front of an
//! LLM-like upstream. The sidecar reserves each rule's estimate, passes the response through byte
//! for byte while reading its usage, and settles the reservation to the tokens it reports; a
//! failed request costs its `onFailure`; concurrent requests never charge past the limit while
//! the estimate bounds each response's cost (and the peers' report-after model does).

#[path = "support/fake_llm.rs"]
mod fake_llm;
#[path = "support/sluice_process.rs"]
mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fake_llm::FakeLlm;
use serde_json::json;
use support::SluiceProcess;

const LIMIT: u64 = 6000;

/// The policy of namespace `ai`: `reserve` for requests with `X-Mode: reserve` (the estimate is
/// max_tokens + 100, at most 1000), `report` for `X-Mode: report` (reportAfter: the peers'
/// model), both `LIMIT` tokens an hour, and `header` for requests to /stated, whose cost the
/// application states in `x-sluice-cost`.
fn policy() -> String {
    let rule = |name: &str, mode: &str| {
        format!(
            "  - name: {name}\n    match: {{headers: [{{name: X-Mode, exact: {name}}}]}}\n    algorithm: fixedWindow\n    limit: {{requests: {LIMIT}, per: 1h}}\n    responseCost:\n      fields: [usage.total_tokens]\n      estimate: {{requestField: max_tokens, plus: 100, cap: 1000}}\n      mode: {mode}\n"
        )
    };
    format!(
        "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: llm, namespace: ai}}\nspec:\n  rules:\n{}{}  - name: header\n    match: {{paths: [{{prefix: /stated}}]}}\n    algorithm: fixedWindow\n    limit: {{requests: {LIMIT}, per: 1h}}\n    responseCost: {{header: x-sluice-cost, estimate: {{constant: 50}}}}\n",
        rule("reserve", "reserve"),
        rule("report", "reportAfter"),
    )
}

struct Setup {
    _dir: tempfile::TempDir,
    serve: SluiceProcess,
    sidecar: SluiceProcess,
    admin: SocketAddr,
}

fn start(upstream: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("llm.yaml"), policy()).unwrap();
    let serve = SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"]);
    let endpoint = format!("http://{}", serve.addr);
    let sidecar = SluiceProcess::sidecar(upstream, &endpoint, "ai", &[]);
    let admin = sidecar.logged_address("admin");
    Setup { _dir: dir, serve, sidecar, admin }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// A counter of `/metrics` text by name and label fragment (0 when absent).
fn counter(metrics: &str, name: &str, labels: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

impl Setup {
    async fn endpoint_metrics(&self) -> String {
        client().get(self.serve.url("/metrics")).send().await.unwrap().text().await.unwrap()
    }

    async fn settles(&self) -> u64 {
        let text = client().get(format!("http://{}/metrics", self.admin)).send().await.unwrap().text().await.unwrap();
        counter(&text, "sluice_sidecar_releases_total", "result=\"released\"")
    }

    /// Waits until the sidecar has settled `n` requests (settles run after the response ends).
    async fn await_settles(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.settles().await < n {
            assert!(Instant::now() < deadline, "{} of {n} settles: {:?}", self.settles().await, self.sidecar.logs);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn reservation_cost(&self, rule: &str, outcome: &str) -> u64 {
        let labels = format!("rule=\"{rule}\",outcome=\"{outcome}\"");
        counter(&self.endpoint_metrics().await, "sluice_reservation_cost_total", &labels)
    }

    /// One chat completion through the sidecar in `mode`; its status, and the body as far as it
    /// came (an upstream that aborts leaves it short).
    async fn complete(&self, mode: &str, max_tokens: u64, completion_tokens: u64) -> (u16, Vec<u8>) {
        let body = json!({
            "model": "m", "stream": true, "max_tokens": max_tokens,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "Say something long about rate limits, please."}],
        });
        let response = client()
            .post(self.sidecar.url("/v1/chat/completions"))
            .header("x-mode", mode)
            .header("accept-encoding", "gzip, br")
            .header("x-fake-completion-tokens", completion_tokens.to_string())
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.bytes().await.map(|b| b.to_vec()).unwrap_or_default())
    }
}

/// An upstream that answers every request with `chunks`, one frame each, 5 ms apart, as a
/// server-sent event stream (and `stated`'s `x-sluice-cost` header when set); 406 to a request
/// that accepts a compressed answer.
async fn scripted_upstream(chunks: Vec<Bytes>, stated: Option<&'static str>) -> SocketAddr {
    let app = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
        let chunks = chunks.clone();
        async move {
            // The sidecar asks for the body uncompressed, since it reads it.
            if headers.contains_key("accept-encoding") {
                let mut refused = axum::response::Response::new(axum::body::Body::from("compressed?"));
                *refused.status_mut() = axum::http::StatusCode::NOT_ACCEPTABLE;
                return refused;
            }
            let stream = futures::stream::iter(chunks).then(|chunk| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Ok::<_, std::convert::Infallible>(chunk)
            });
            let mut response = axum::response::Response::new(axum::body::Body::from_stream(stream));
            response.headers_mut().insert("content-type", "text/event-stream".parse().unwrap());
            if let Some(cost) = stated {
                response.headers_mut().insert("x-sluice-cost", cost.parse().unwrap());
            }
            response
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

use futures::StreamExt as _;

/// The stream reaches the client exactly as the application wrote it — split inside a UTF-8
/// character and inside a CRLF, with a comment, an event larger than the reader keeps, and the
/// usage in its last event — and the reservation settles to the usage it reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_passes_byte_for_byte_and_settles_to_its_usage() {
    let big = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n", "x".repeat(70_000));
    // Split after the first byte of the two of 'é', and between the CR and LF of a CRLF.
    let line = "data: {\"choices\":[{\"delta\":{\"content\":\"h\u{e9}llo\"}}]}\r".as_bytes();
    let chunks: Vec<Bytes> = vec![
        Bytes::from_static(b": keep-alive\n\n"),
        Bytes::copy_from_slice(&line[..41]),
        Bytes::copy_from_slice(&line[41..]),
        Bytes::from_static(b"\n\r\n"),
        Bytes::from(big),
        Bytes::from_static(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"total_tokens\":777}}\n\n"),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ];
    let expected: Vec<u8> = chunks.iter().flat_map(|c| c.to_vec()).collect();
    let upstream = scripted_upstream(chunks, None).await;
    let setup = start(&upstream.to_string());
    let (status, body) = setup.complete("reserve", 400, 0).await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), expected.len());
    assert!(body == expected, "the client got other bytes than the application sent");
    setup.await_settles(1).await;
    assert_eq!(setup.reservation_cost("reserve", "reserved").await, 500, "max_tokens 400 + 100");
    assert_eq!(setup.reservation_cost("reserve", "settled").await, 777, "usage.total_tokens");
}

/// A cost the application states in a header wins, and the header does not reach the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stated_cost_header_settles_and_stays_with_sluice() {
    let upstream = scripted_upstream(vec![Bytes::from_static(b"data: {}\n\n")], Some("42")).await;
    let setup = start(&upstream.to_string());
    let response = client().get(setup.sidecar.url("/stated")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-sluice-cost").is_none(), "the cost header is Sluice's");
    response.bytes().await.unwrap();
    setup.await_settles(1).await;
    assert_eq!(setup.reservation_cost("header", "settled").await, 42);
}

/// Concurrent streams on one key: reserve-then-settle never charges past the limit when the
/// estimate bounds the cost, and what it charges is exactly what the responses reported; the
/// report-after mode, deciding each request at cost 0, lets the same traffic overspend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_stay_within_the_limit_only_when_reserved() {
    let ledger = tempfile::NamedTempFile::new().unwrap();
    // 10 chunks of 50 tokens, 40 ms apart: every stream lasts 0.4 s, so a wave overlaps.
    let upstream = FakeLlm::start(&[
        "--tokens-per-chunk",
        "50",
        "--token-interval-us",
        "40000",
        "--ledger",
        ledger.path().to_str().unwrap(),
    ]);
    let setup = start(upstream.base.trim_start_matches("http://"));
    let mut sent = 0;
    for wave in 0..3 {
        let requests = (0..20).map(|i| setup.complete("reserve", 500, 300 + (wave * 20 + i) % 300));
        let answers = futures::future::join_all(requests).await;
        sent += answers.iter().filter(|(status, _)| *status == 200).count() as u64;
    }
    setup.await_settles(sent).await;
    let settled = setup.reservation_cost("reserve", "settled").await;
    let served: u64 = std::fs::read_to_string(ledger.path())
        .unwrap()
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .filter(|f| f[5] == "ok")
        .map(|f| f[3].parse::<u64>().unwrap() + f[4].parse::<u64>().unwrap())
        .sum();
    assert_eq!(settled, served, "charged exactly the tokens served");
    assert!(served <= LIMIT, "reserve-then-settle served {served} tokens of a {LIMIT} limit");
    assert!(served > LIMIT / 2, "the limit was reached: {served}");

    let requests = (0..20).map(|i| setup.complete("report", 500, 400 + i));
    let admitted = futures::future::join_all(requests).await.iter().filter(|(s, _)| *s == 200).count() as u64;
    setup.await_settles(sent + admitted).await;
    let reported = setup.reservation_cost("report", "settled").await;
    assert!(reported > LIMIT, "report-after let {reported} tokens through a {LIMIT} limit");
}

/// Failed requests (a 500 before any output, or a stream the application breaks off) cost their
/// `onFailure` (0): the capacity they reserved comes back, so more requests fit than the
/// reservations alone would allow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_requests_cost_their_declared_failure_cost() {
    let failing = FakeLlm::start(&["--error-rate", "1", "--seed", "7"]);
    let setup = start(failing.base.trim_start_matches("http://"));
    // Each reserves 600 of 6000: without the refunds the 11th would be refused.
    for n in 1..=12 {
        let (status, _) = setup.complete("reserve", 500, 300).await;
        assert_ne!(status, 429, "request {n} refused: a failed request's reservation was kept");
        setup.await_settles(n).await;
    }
    assert_eq!(setup.reservation_cost("reserve", "reserved").await, 12 * 600);
    assert_eq!(setup.reservation_cost("reserve", "settled").await, 0, "onFailure: 0");
}
