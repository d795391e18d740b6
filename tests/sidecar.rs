//! `sluice sidecar` end to end on loopback: a real upstream (axum, in this test), the real
//! `sluice serve` as the endpoint, and the real `sluice sidecar` between a client and the upstream.

#[path = "support/sluice_process.rs"]
mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use bytes::Bytes;
use hyper::body::Frame;
use sluice::clock::FakeClock;
use sluice::sidecar::decide::{Decider, Decision};
use sluice::sidecar::metrics::SidecarMetrics;
use sluice::sidecar::{Config, OnFailure};
use support::SluiceProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

const POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: web, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: web}}
  rules:
    - name: per-key
      match: {paths: [{prefix: /limited}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1h}
    - name: per-ip
      match: {paths: [{prefix: /by-ip}]}
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
"#;

// ---------------------------------------------------------------------------------------------
// The upstream application.

#[derive(Default)]
struct Upstream {
    hits: AtomicUsize,
    /// The streaming handler sends its last chunk only once this is notified.
    release: Notify,
}

/// A response body fed from a channel, so the test decides when each chunk is sent.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }
}

fn pattern(len: usize) -> Vec<u8> {
    // Not periodic in any small power of two, so a dropped or repeated chunk shows.
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

async fn start_upstream() -> (SocketAddr, Arc<Upstream>) {
    let state = Arc::new(Upstream::default());
    let app = Router::new()
        .route(
            "/echo",
            post(|State(s): State<Arc<Upstream>>, request: Request| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                // The request body goes straight back: streaming in both directions.
                Response::new(Body::new(request.into_body()))
            }),
        )
        .route(
            "/big/{mb}",
            get(|State(s): State<Arc<Upstream>>, axum::extract::Path(mb): axum::extract::Path<usize>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                pattern(mb << 20)
            }),
        )
        .route(
            "/stream",
            get(|State(s): State<Arc<Upstream>>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                let (tx, rx) = mpsc::channel(2);
                tokio::spawn(async move {
                    let _ = tx.send(Bytes::from_static(b"first\n")).await;
                    s.release.notified().await;
                    let _ = tx.send(Bytes::from_static(b"last\n")).await;
                });
                Response::new(Body::new(ChannelBody(rx)))
            }),
        )
        .route(
            "/slow/{ms}",
            get(|State(s): State<Arc<Upstream>>, axum::extract::Path(ms): axum::extract::Path<u64>| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                // An application still working on the request: no byte of the answer yet.
                tokio::time::sleep(Duration::from_millis(ms)).await;
                "slow\n"
            }),
        )
        .route(
            "/ws",
            get(|State(s): State<Arc<Upstream>>, mut request: Request| async move {
                s.hits.fetch_add(1, Ordering::SeqCst);
                let upgrade = hyper::upgrade::on(&mut request);
                tokio::spawn(async move {
                    if let Ok(upgraded) = upgrade.await {
                        let mut io = hyper_util::rt::TokioIo::new(upgraded);
                        let mut buf = [0u8; 1024];
                        while let Ok(n) = io.read(&mut buf).await {
                            if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                });
                Response::builder()
                    .status(StatusCode::SWITCHING_PROTOCOLS)
                    .header("connection", "upgrade")
                    .header("upgrade", "websocket")
                    .body(Body::empty())
                    .unwrap()
            }),
        )
        .fallback(any(|State(s): State<Arc<Upstream>>, headers: HeaderMap| async move {
            s.hits.fetch_add(1, Ordering::SeqCst);
            let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
            axum::Json(serde_json::json!({
                "xff": get("x-forwarded-for"),
                "proto": get("x-forwarded-proto"),
                "host": get("host"),
                "connection": get("connection"),
                "hop": get("x-hop"),
                "upgrade": get("upgrade"),
                "http2Settings": get("http2-settings"),
                "apiKey": get("x-api-key"),
            }))
            .into_response()
        }))
        .with_state(state.clone());
    let addr = serve_on_loopback(app).await;
    (addr, state)
}

// ---------------------------------------------------------------------------------------------
// Processes.

fn policy_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICY).unwrap();
    dir
}

fn start_serve(dir: &std::path::Path, listen: &str) -> SluiceProcess {
    SluiceProcess::start(&["serve", "--policies", dir.to_str().unwrap(), "--listen", listen])
}

struct Sidecar {
    process: SluiceProcess,
    admin: SocketAddr,
}

fn start_sidecar(upstream: SocketAddr, endpoint: &str, extra: &[&str]) -> Sidecar {
    start_sidecar_with_timeout(upstream, endpoint, "300ms", extra)
}

fn start_sidecar_with_timeout(upstream: SocketAddr, endpoint: &str, timeout: &str, extra: &[&str]) -> Sidecar {
    // One thread, as a sidecar given one CPU runs (the current-thread scheduler); the e2e flows
    // and tests/serve_leases.rs run the default pool.
    let mut args = vec!["--labels", "app=web,tier=front", "--endpoint-timeout", timeout, "--worker-threads", "1"];
    args.extend_from_slice(extra);
    let process = SluiceProcess::sidecar(&upstream.to_string(), endpoint, "tenant-acme", &args);
    let admin = process.logged_address("admin");
    Sidecar { process, admin }
}

impl Sidecar {
    fn url(&self, path: &str) -> String {
        self.process.url(path)
    }

    async fn metrics(&self) -> String {
        client().get(format!("http://{}/metrics", self.admin)).send().await.unwrap().text().await.unwrap()
    }

    /// Waits until the metrics page contains `needle`.
    async fn await_metric(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let page = self.metrics().await;
            if page.contains(needle) {
                return;
            }
            assert!(Instant::now() < deadline, "metrics never showed {needle:?}:\n{page}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap()
}

/// A port nobody listens on (bound, then released).
fn dead_endpoint() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

async fn get_with_key(c: &reqwest::Client, url: &str, key: &str) -> reqwest::Response {
    c.get(url).header("x-api-key", key).send().await.unwrap()
}

/// Serves `app` on a free loopback port for the rest of the test.
async fn serve_on_loopback(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn limits_with_headers_and_never_touches_the_upstream_when_denied() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();

    for remaining in ["1", "0"] {
        let r = get_with_key(&c, &sidecar.url("/limited/a"), "k1").await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-ratelimit-limit"], "2");
        assert_eq!(r.headers()["x-ratelimit-remaining"], remaining);
        assert!(r.headers()["ratelimit-policy"].to_str().unwrap().contains("q=2;w=3600"));
        assert!(r.headers().get("ratelimit").is_some());
    }
    let hits = state.hits.load(Ordering::SeqCst);
    assert_eq!(hits, 2);

    let denied = get_with_key(&c, &sidecar.url("/limited/a"), "k1").await;
    assert_eq!(denied.status(), 429);
    let retry: u64 = denied.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry > 0 && retry <= 3600, "Retry-After {retry}");
    assert_eq!(denied.headers()["x-ratelimit-remaining"], "0");
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    assert_eq!(denied.headers()["cache-control"], "no-store");
    let problem: serde_json::Value = denied.json().await.unwrap();
    assert_eq!(problem["status"], 429);
    assert_eq!(problem["title"], "Too Many Requests");
    assert_eq!(state.hits.load(Ordering::SeqCst), hits, "a 429 never reaches the application");

    // Another key and an unlimited path go through; the unlimited one carries no rate headers.
    assert_eq!(get_with_key(&c, &sidecar.url("/limited/a"), "k2").await.status(), 200);
    let free = c.get(sidecar.url("/free")).send().await.unwrap();
    assert_eq!(free.status(), 200);
    assert!(free.headers().get("x-ratelimit-limit").is_none());

    let metrics = sidecar.metrics().await;
    assert!(metrics.contains(r#"sluice_sidecar_requests_total{outcome="limited"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"sluice_sidecar_decisions_total{source="endpoint",result="deny"} 1"#), "{metrics}");
    let health = c.get(format!("http://{}/healthz", sidecar.admin)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn bodies_of_several_megabytes_stream_intact_both_ways() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();

    let upload = pattern(8 << 20);
    let echoed = c.post(sidecar.url("/echo")).body(upload.clone()).send().await.unwrap();
    assert_eq!(echoed.status(), 200);
    let echoed = echoed.bytes().await.unwrap();
    assert_eq!(echoed.len(), upload.len());
    assert!(echoed[..] == upload[..], "the echoed body differs");

    let big = c.get(sidecar.url("/big/6")).send().await.unwrap().bytes().await.unwrap();
    assert_eq!(big.len(), 6 << 20);
    assert!(big[..] == pattern(6 << 20)[..]);
}

#[tokio::test]
async fn responses_stream_chunk_by_chunk() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();

    let mut response = c.get(sidecar.url("/stream")).send().await.unwrap();
    // The upstream holds its last chunk until we have seen the first; a buffering proxy would
    // deadlock here, so the timeout is the failure.
    let first = tokio::time::timeout(Duration::from_secs(10), response.chunk()).await.expect("first chunk streamed");
    assert_eq!(first.unwrap().unwrap(), Bytes::from_static(b"first\n"));
    state.release.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, b"last\n");
}

#[tokio::test]
async fn websocket_upgrade_is_relayed() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);

    let mut tcp = tokio::net::TcpStream::connect(sidecar.process.addr).await.unwrap();
    tcp.write_all(
        b"GET /ws HTTP/1.1\r\nHost: app\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(tcp.read(&mut byte).await.unwrap(), 1, "connection closed in the head: {head:?}");
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    for message in [&b"hello"[..], b"second frame, longer", &[0u8, 255, 1, 2]] {
        tcp.write_all(message).await.unwrap();
        let mut back = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(10), tcp.read_exact(&mut back)).await.unwrap().unwrap();
        assert_eq!(back, message);
    }
    sidecar.await_metric("\nsluice_sidecar_upgrades_active 1\n").await;
}

#[tokio::test]
async fn http2_cleartext_clients_are_served() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);

    let tcp = tokio::net::TcpStream::connect(sidecar.process.addr).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(connection);
    for expected in [200, 200, 429] {
        let request = hyper::Request::get("http://app.example/limited/h2")
            .header("x-api-key", "h2")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), expected);
        assert_eq!(response.version(), hyper::Version::HTTP_2);
        if expected == 200 {
            use http_body_util::BodyExt;
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let seen: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(seen["host"], "app.example", "the :authority becomes Host upstream");
        }
    }
}

#[tokio::test]
async fn client_ip_comes_from_trusted_hops_and_is_forwarded() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &["--trusted-hops", "1"]);
    let c = client();

    let seen: serde_json::Value = c
        .get(sidecar.url("/headers"))
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-forwarded-proto", "https")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "must not reach the app")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(seen["xff"], "203.0.113.7, 127.0.0.1");
    assert_eq!(seen["proto"], "https", "kept from the trusted hop");
    assert_eq!(seen["hop"], "", "headers named in Connection are hop-by-hop");

    // The per-IP rule keys on the forwarded client, not on the loopback peer.
    let by_ip = |ip: &'static str| c.get(sidecar.url("/by-ip")).header("x-forwarded-for", ip).send();
    assert_eq!(by_ip("203.0.113.7").await.unwrap().status(), 200);
    assert_eq!(by_ip("203.0.113.7").await.unwrap().status(), 429);
    assert_eq!(by_ip("198.51.100.4").await.unwrap().status(), 200);
}

#[tokio::test]
async fn untrusted_forwarded_for_cannot_choose_the_key() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();
    let by_ip = |ip: &'static str| c.get(sidecar.url("/by-ip")).header("x-forwarded-for", ip).send();
    assert_eq!(by_ip("203.0.113.7").await.unwrap().status(), 200);
    assert_eq!(by_ip("198.51.100.4").await.unwrap().status(), 429, "both are the loopback peer");
}

/// Fail open and fail closed without a snapshot, through the real binary. How many requests
/// wait for the dead endpoint is [`the_breaker_makes_a_dead_endpoint_cheap`]'s job, in-process
/// on tokio's paused clock: measured here in wall time it would depend on the machine's load.
#[tokio::test]
async fn dead_endpoint_without_snapshot_allows_or_denies() {
    let (up, state) = start_upstream().await;
    let hole = black_hole().await;
    let allow = start_sidecar(up, &format!("http://{hole}"), &["--on-endpoint-failure", "allow"]);
    let c = client();
    for _ in 0..8 {
        let r = get_with_key(&c, &allow.url("/limited/x"), "k").await;
        assert_eq!(r.status(), 200, "fail open");
    }
    // Five failures open the breaker; it stays open (or half-open) while the endpoint is dead.
    assert_eq!(get_with_key(&c, &allow.url("/limited/x"), "k").await.status(), 200);
    allow.await_metric("\nsluice_sidecar_endpoint_circuit_open 1\n").await;
    assert_eq!(state.hits.load(Ordering::SeqCst), 9);

    let deny = start_sidecar(up, &dead_endpoint(), &["--on-endpoint-failure", "deny"]);
    let r = get_with_key(&c, &deny.url("/limited/x"), "k").await;
    assert_eq!(r.status(), 429, "fail closed");
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(state.hits.load(Ordering::SeqCst), 9, "denied requests do not reach the app");
}

/// A black hole: accepts connections and never answers, so each check waits for the timeout.
async fn black_hole() -> SocketAddr {
    let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = hole.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = hole.accept().await {
            held.push(socket);
        }
    });
    addr
}

/// The sidecar's decision for one request, made as the proxy makes it before any snapshot said
/// which headers a check carries; returns how long it took on tokio's (paused) clock.
async fn decide_without_snapshot(decider: &Decider) -> Duration {
    let started = tokio::time::Instant::now();
    let decision = match decider.check_headers(&HeaderMap::new()).await {
        Ok(None) => decider.undecidable(),
        other => panic!("no snapshot can have been fetched: {other:?}"),
    };
    assert!(matches!(decision, Decision::Allow { .. }), "fail open: {decision:?}");
    started.elapsed()
}

/// The breaker in front of a dead endpoint, in-process: the endpoint timeout is a tokio timer on
/// the paused clock (which moves only to the next timer) and the breaker runs on a fake clock,
/// so the count of requests that waited is exact whatever the machine's load.
#[tokio::test(start_paused = true)]
async fn the_breaker_makes_a_dead_endpoint_cheap() {
    let hole = black_hole().await;
    let endpoint = |path: &str| format!("http://{hole}{path}").parse().unwrap();
    let timeout = Duration::from_secs(1);
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        cgroup_root: "/sys/fs/cgroup".into(),
        stale_cache_bytes: 0,
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        upstream: "127.0.0.1:1".parse().unwrap(),
        check_uri: endpoint("/v1/check"),
        checks_uri: endpoint("/v1/checks"),
        settle_uri: endpoint("/v1/settle"),
        cancel_uri: endpoint("/v1/cancel"),
        deferred_uris: [
            endpoint("/v1/deferred"),
            endpoint("/v1/deferred/claim"),
            endpoint("/v1/deferred/done"),
            endpoint("/v1/deferred/status"),
        ],
        leases_uri: endpoint("/v1/leases"),
        snapshot_uri: endpoint("/v1/snapshot"),
        namespace: "tenant-acme".into(),
        labels: [("app".to_string(), "web".to_string())].into(),
        on_failure: OnFailure::Allow,
        endpoint_timeout: timeout,
        trusted_hops: 0,
        snapshot_interval: Duration::from_millis(100),
        token_file: None,
        endpoint_ca: None,
        endpoint_batches: 4,
        app_probes: Default::default(),
        inbound_ports: Vec::new(),
        listen_limits: Default::default(),
    };
    let clock = FakeClock::new(1_700_000_000_000_000);
    let metrics = Arc::new(SidecarMetrics::new());
    let decider = Decider::with_clock(&config, metrics.clone(), Arc::new(clock.clone()), Box::new(|_| {})).unwrap();

    let mut waited = 0;
    for _ in 0..8 {
        let elapsed = decide_without_snapshot(&decider).await;
        if elapsed >= timeout {
            waited += 1;
        } else {
            assert_eq!(elapsed, Duration::ZERO, "either the whole timeout or nothing");
        }
    }
    // Five failures open the breaker (1 s cool-down); after that no request waits for the timeout.
    assert_eq!(waited, 5, "requests that waited for the dead endpoint");
    assert_eq!(decide_without_snapshot(&decider).await, Duration::ZERO, "breaker open");
    let page = metrics.encode();
    assert!(page.contains("\nsluice_sidecar_endpoint_circuit_open 1\n"), "{page}");

    // The cool-down is over on the breaker's clock: one probe waits, fails and reopens it.
    clock.advance(1_000_000);
    assert!(decide_without_snapshot(&decider).await >= timeout, "the probe waits for the endpoint");
    assert_eq!(decide_without_snapshot(&decider).await, Duration::ZERO, "open again after the failed probe");
}

#[tokio::test]
async fn cached_snapshot_enforces_while_the_endpoint_is_away_and_the_endpoint_takes_over_again() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let mut serve = start_serve(dir.path(), "127.0.0.1:0");
    let endpoint_addr = serve.addr;
    // Deny mode: if the fallback were not the cached snapshot, the first request would be a 429.
    let sidecar = start_sidecar(up, &serve.url(""), &["--on-endpoint-failure", "deny"]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    assert_eq!(get_with_key(&c, &sidecar.url("/free"), "k").await.status(), 200);

    serve.child.kill().unwrap();
    serve.child.wait().unwrap();

    // The cached policy: 2 per hour per key, enforced locally, with headers.
    for remaining in ["1", "0"] {
        let r = get_with_key(&c, &sidecar.url("/limited/local"), "fallback").await;
        assert_eq!(r.status(), 200, "{:?}", sidecar.process.logs.lock().unwrap());
        assert_eq!(r.headers()["x-ratelimit-remaining"], remaining);
    }
    let hits = state.hits.load(Ordering::SeqCst);
    let denied = get_with_key(&c, &sidecar.url("/limited/local"), "fallback").await;
    assert_eq!(denied.status(), 429);
    assert!(denied.headers().get("retry-after").is_some());
    assert_eq!(state.hits.load(Ordering::SeqCst), hits);
    // Paths no rule matches are allowed, not denied by the failure mode.
    assert_eq!(c.get(sidecar.url("/free")).send().await.unwrap().status(), 200);
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains(r#"sluice_sidecar_decisions_total{source="local",result="deny"} 1"#), "{metrics}");

    // The endpoint comes back on the same address: decisions are the endpoint's again (its fresh
    // memory store has not seen this key, so the request is admitted).
    let _serve = start_serve(dir.path(), &endpoint_addr.to_string());
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = get_with_key(&c, &sidecar.url("/limited/local"), "fallback").await;
        if r.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the sidecar never went back to the endpoint");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A stand-in endpoint that records the check requests it gets and answers from a script.
async fn start_fake_endpoint() -> (SocketAddr, Arc<std::sync::Mutex<Vec<serde_json::Value>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let app = Router::new()
        .route(
            "/v1/snapshot",
            get(|| async {
                (
                    [("etag", "\"v1\"")],
                    axum::Json(serde_json::json!({
                        "version": "v1", "loaded": true, "headerNames": ["x-api-key"], "sources": [],
                    })),
                )
            }),
        )
        .route(
            "/v1/check",
            post(
                |State(seen): State<Arc<std::sync::Mutex<Vec<serde_json::Value>>>>,
                 axum::Json(body): axum::Json<serde_json::Value>| async move {
                    let delay = if body["path"] == "/slow" { 300 } else { 0 };
                    seen.lock().unwrap().push(body);
                    axum::Json(serde_json::json!({
                        "allowed": true, "status": 200, "retryAfterMs": null, "delayMs": delay,
                        "headers": {"X-RateLimit-Limit": "10"}, "rules": [],
                    }))
                },
            ),
        )
        .with_state(seen.clone());
    let addr = serve_on_loopback(app).await;
    (addr, seen)
}

#[tokio::test]
async fn checks_carry_the_pod_identity_and_only_the_headers_policies_use() {
    let (up, _state) = start_upstream().await;
    let (endpoint, seen) = start_fake_endpoint().await;
    let sidecar = start_sidecar(up, &format!("http://{endpoint}"), &[]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    let r = c
        .post(sidecar.url("/orders/1?page=2"))
        .header("host", "api.example.com")
        .header("x-api-key", "k1")
        .header("authorization", "Bearer secret")
        .header("cookie", "session=secret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-ratelimit-limit"], "10", "the decision's headers are added");
    let check = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(check["namespace"], "tenant-acme");
    assert_eq!(check["labels"], serde_json::json!({"app": "web", "tier": "front"}));
    assert_eq!(check["method"], "POST");
    assert_eq!(check["path"], "/orders/1");
    assert_eq!(check["host"], "api.example.com");
    assert_eq!(check["clientIp"], "127.0.0.1");
    assert_eq!(check["headers"], serde_json::json!({"x-api-key": "k1"}), "credentials never leave the pod");
}

#[tokio::test]
async fn a_shaping_delay_is_waited_before_forwarding() {
    let (up, state) = start_upstream().await;
    let (endpoint, _seen) = start_fake_endpoint().await;
    let sidecar = start_sidecar(up, &format!("http://{endpoint}"), &[]);
    let c = client();
    let before = state.hits.load(Ordering::SeqCst);
    let started = Instant::now();
    assert_eq!(c.get(sidecar.url("/slow")).send().await.unwrap().status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(300), "delayMs honoured: {:?}", started.elapsed());
    assert_eq!(state.hits.load(Ordering::SeqCst), before + 1);
}

#[tokio::test]
async fn sigterm_lets_in_flight_requests_finish_and_exits_zero() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let mut sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();
    // A response in flight: its first chunk is out, the last is held by the upstream.
    let mut response = c.get(sidecar.url("/stream")).send().await.unwrap();
    assert_eq!(response.chunk().await.unwrap().unwrap(), Bytes::from_static(b"first\n"));
    let pid = sidecar.process.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sidecar.process.logs.lock().unwrap().iter().any(|l| l.contains("shutting down")) {
        assert!(Instant::now() < deadline, "no shutdown log line");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Draining: the held chunk still arrives once released.
    state.release.notify_one();
    let rest = tokio::time::timeout(Duration::from_secs(10), response.chunk()).await.unwrap().unwrap().unwrap();
    assert_eq!(rest, Bytes::from_static(b"last\n"));
    let status = sidecar.process.terminate();
    assert!(status.success(), "{status:?}");
}

/// A classic sidecar gets SIGTERM with the application: a request the application is still
/// working on (no byte of its answer sent yet) is answered in full; a new connection is refused
/// at once, not left hanging while the sidecar drains.
#[tokio::test]
async fn sigterm_answers_a_request_the_app_is_still_working_on_and_refuses_new_connections() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let mut sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();
    let before = state.hits.load(Ordering::SeqCst);
    let in_flight = tokio::spawn(c.get(sidecar.url("/slow/3000")).send());
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.hits.load(Ordering::SeqCst) == before {
        assert!(Instant::now() < deadline, "the request never reached the app");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = sidecar.process.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    while !sidecar.process.logs.lock().unwrap().iter().any(|l| l.contains("shutting down")) {
        assert!(Instant::now() < deadline, "no shutdown log line");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Draining: the listener is closed, so a new connection is refused at once (not accepted by
    // the kernel into a backlog nobody serves any more).
    let url = reqwest::Url::parse(&sidecar.url("/")).unwrap();
    let address = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap());
    let refused_by = Instant::now() + Duration::from_secs(2);
    while tokio::net::TcpStream::connect(&address).await.is_ok() {
        assert!(Instant::now() < refused_by, "new connections are still accepted while draining");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!in_flight.is_finished(), "the request was answered before the sidecar drained");
    let response = in_flight.await.unwrap().expect("the in-flight request is answered");
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "slow\n");
    let status = sidecar.process.terminate();
    assert!(status.success(), "{status:?}");
}

// ---------------------------------------------------------------------------------------------
// Trust between sidecar and endpoint: TLS verified against one CA, and the sidecar's token.

/// A CA and a serving certificate for 127.0.0.1, written as PEM files into `dir`.
fn tls_files(dir: &std::path::Path, prefix: &str) -> (String, String, String) {
    let pair = sluice::admission::certs::generate(&["127.0.0.1".to_string()]).unwrap();
    let path = |name: &str| dir.join(format!("{prefix}-{name}")).to_str().unwrap().to_string();
    std::fs::write(path("ca.pem"), &pair.ca_pem).unwrap();
    std::fs::write(path("cert.pem"), &pair.cert_pem).unwrap();
    std::fs::write(path("key.pem"), &pair.key_pem).unwrap();
    (path("ca.pem"), path("cert.pem"), path("key.pem"))
}

#[tokio::test]
async fn the_sidecar_verifies_the_endpoint_and_presents_its_token() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let (ca, cert, key) = tls_files(dir.path(), "real");
    let (other_ca, _, _) = tls_files(dir.path(), "impostor");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "sidecar-token-0123456789\n").unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, "tokens: [{name: sidecars, token: sidecar-token-0123456789, namespaces: [tenant-acme]}]\n")
        .unwrap();
    let policies = dir.path().join("policies.yaml");
    let serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        policies.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tokens",
        tokens.to_str().unwrap(),
    ]);
    let endpoint = format!("https://127.0.0.1:{}", serve.addr.port());
    let token = token_file.to_str().unwrap();
    let c = client();

    // The real CA and the token: decided by the endpoint (2 per key, then 429 from the endpoint).
    let good = start_sidecar(up, &endpoint, &["--endpoint-ca", &ca, "--token-file", token]);
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for _ in 0..3 {
            s.push(get_with_key(&c, &good.url("/limited/tls"), "k-tls").await.status().as_u16());
        }
        s
    };
    assert_eq!(statuses, [200, 200, 429]);
    good.await_metric("sluice_sidecar_decisions_total{source=\"endpoint\",result=\"deny\"} 1").await;

    // Plain HTTP to the TLS port gets nothing.
    assert!(c.get(format!("http://127.0.0.1:{}/healthz", serve.addr.port())).send().await.is_err());

    // Anyone else answering at that address with another CA's certificate cannot decide: the
    // sidecar treats it as an endpoint failure (fail closed here) and the app is not reached.
    let hits = state.hits.load(Ordering::SeqCst);
    let impostor = start_sidecar(up, &endpoint, &["--endpoint-ca", &other_ca, "--on-endpoint-failure", "deny"]);
    assert_eq!(get_with_key(&c, &impostor.url("/limited/x"), "k").await.status(), 429);
    assert_eq!(state.hits.load(Ordering::SeqCst), hits, "nothing forwarded on a forged endpoint");

    // Without its token, the endpoint refuses the sidecar: also an endpoint failure, never
    // relayed to the client as 401.
    let anonymous = start_sidecar(up, &endpoint, &["--endpoint-ca", &ca, "--on-endpoint-failure", "deny"]);
    let r = get_with_key(&c, &anonymous.url("/limited/y"), "k").await;
    assert_eq!(r.status(), 429);
    assert_eq!(state.hits.load(Ordering::SeqCst), hits);
    // And its log says so, and that nothing is cached (not "keeping the cached one").
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = anonymous.process.logs.lock().unwrap().join("\n");
        if logs.contains("refused this sidecar's credential (401 Unauthorized")
            && logs.contains("decided by --on-endpoint-failure")
        {
            break;
        }
        assert!(Instant::now() < deadline, "the refusal is not in the log:\n{logs}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The sidecar's log once `wanted` holds of it (within 10 s; the log is read by a thread of its
/// own, which a loaded machine may run late).
async fn logs_once(sidecar: &Sidecar, wanted: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = sidecar.process.logs.lock().unwrap().join("\n");
        if wanted(&logs) {
            return logs;
        }
        assert!(Instant::now() < deadline, "not in the log within 10 s:\n{logs}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `/readyz` of `sidecar` once it answers `status` (within 10 s): its body.
async fn readiness_once(sidecar: &Sidecar, status: u16) -> String {
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = c.get(format!("http://{}/readyz", sidecar.admin)).send().await.unwrap();
        let (got, body) = (response.status().as_u16(), response.text().await.unwrap());
        if got == status {
            return body;
        }
        assert!(Instant::now() < deadline, "/readyz still answers {got} ({body}), not {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A scheme, TLS or credential mismatch with the endpoint is a configuration error, not an
/// outage: the sidecar names the cause in its log and on `/readyz`, which answers 503 so that the
/// pod takes no traffic it cannot limit. An endpoint that is merely away leaves it ready.
#[tokio::test]
async fn a_sidecar_configured_wrong_for_its_endpoint_names_the_cause_and_is_not_ready() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let (ca, cert, key) = tls_files(dir.path(), "real");
    let (other_ca, _, _) = tls_files(dir.path(), "impostor");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "sidecar-token-0123456789\n").unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, "tokens: [{name: sidecars, token: sidecar-token-0123456789, namespaces: [tenant-acme]}]\n")
        .unwrap();
    let policies = dir.path().join("policies.yaml");
    let policies = policies.to_str().unwrap();
    let tls_serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        policies,
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tokens",
        tokens.to_str().unwrap(),
    ]);
    let plain_serve = SluiceProcess::start(&["serve", "--policies", policies, "--listen", "127.0.0.1:0"]);
    let tls_port = tls_serve.addr.port();
    let token = token_file.to_str().unwrap();

    let cases: [(String, Vec<&str>, String); 4] = [
        // The docs' hand-written pod once did this against the chart's defaults.
        (
            format!("http://127.0.0.1:{tls_port}"),
            vec!["--endpoint-ca", &ca, "--token-file", token],
            format!(
                "does not answer plain HTTP (client error (SendRequest): invalid HTTP version parsed): it serves HTTPS, so --endpoint must be https://127.0.0.1:{tls_port}"
            ),
        ),
        (
            format!("https://127.0.0.1:{}", plain_serve.addr.port()),
            vec!["--endpoint-ca", &ca],
            "does not answer TLS".to_string(),
        ),
        (
            format!("https://127.0.0.1:{tls_port}"),
            vec!["--endpoint-ca", &other_ca, "--token-file", token],
            "presents a certificate --endpoint-ca does not vouch for".to_string(),
        ),
        (
            format!("https://127.0.0.1:{tls_port}"),
            vec!["--endpoint-ca", &ca],
            "the endpoint refused this sidecar's credential (401 Unauthorized".to_string(),
        ),
    ];
    for (endpoint, extra, cause) in &cases {
        let sidecar = start_sidecar(up, endpoint, extra);
        let body = readiness_once(&sidecar, 503).await;
        assert!(body.starts_with("not ready: ") && body.contains(cause.as_str()), "{endpoint} {extra:?}: {body}");
        // The log is read by a thread of its own, which a loaded machine may run late.
        let logs = logs_once(&sidecar, |logs| {
            logs.contains("the sidecar is configured wrong for its endpoint")
                && logs.contains(cause.as_str())
                && (!endpoint.starts_with("http://") || logs.contains("--endpoint is http://, so the CA given"))
        })
        .await;
        if endpoint.starts_with("http://") {
            assert!(logs.contains("--endpoint is http://, so the CA given"), "the unused CA is named: {logs}");
        }
    }

    // Configured right: ready; and an endpoint that is only away leaves readiness alone.
    let good =
        start_sidecar(up, &format!("https://127.0.0.1:{tls_port}"), &["--endpoint-ca", &ca, "--token-file", token]);
    readiness_once(&good, 200).await;
    // A port nothing listens on: bound, then let go.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let away = start_sidecar(up, &format!("http://127.0.0.1:{closed}"), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !away.process.logs.lock().unwrap().iter().any(|l| l.contains("cannot fetch the policy snapshot")) {
        assert!(Instant::now() < deadline, "the endpoint's absence is not logged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(readiness_once(&away, 200).await, "ready\n");
}

// ---------------------------------------------------------------------------------------------
// The limiter decides on exactly what the application receives.

const STRICT: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: strict, namespace: tenant-acme}
spec:
  rules:
    - name: everything
      match: {paths: [{prefix: /all}]}
      algorithm: fixedWindow
      limit: {requests: 1, per: 1m}
    - name: per-key
      match: {paths: [{prefix: /keyed}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1m}
    - name: orders
      match: {paths: [{prefix: /orders}]}
      algorithm: fixedWindow
      limit: {requests: 1, per: 1m}
"#;

fn strict_serve() -> (tempfile::TempDir, SluiceProcess) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("strict.yaml"), STRICT).unwrap();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    (dir, serve)
}

/// Sends `head` (request line and headers, without the blank line) as is, on its own
/// connection, and returns the status code and the body: clients such as reqwest normalize
/// paths and manage `Connection` themselves.
async fn raw(addr: SocketAddr, head: &str) -> (u16, String) {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(format!("{head}\r\nHost: app\r\n\r\n").as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut reply)).await;
    let reply = String::from_utf8_lossy(&reply).to_string();
    let status = reply.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn requests_the_endpoint_cannot_decide_are_answered_here_and_never_forwarded() {
    let (up, state) = start_upstream().await;
    let (_dir, serve) = strict_serve();
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let c = client();
    assert_eq!(c.get(sidecar.url("/all")).send().await.unwrap().status(), 200);
    let long = format!("/all/{}", "a".repeat(9000));
    let r = c.get(sidecar.url(&long)).send().await.unwrap();
    assert_eq!(r.status(), 414, "a path over 8 KiB is the client's problem, not a bypass");
    assert_eq!(state.hits.load(Ordering::SeqCst), 1, "the upstream saw one request");
    // A CONNECT has no path to decide on.
    let (status, _) = raw(sidecar.process.addr, "CONNECT app:443 HTTP/1.1\r\nConnection: close").await;
    assert_eq!(status, 400);
    assert_eq!(state.hits.load(Ordering::SeqCst), 1);

    // A 70 KiB key: 431 five times, and the breaker stays closed (the endpoint did nothing wrong).
    let huge = "k".repeat(70 * 1024);
    for _ in 0..5 {
        let r = c.get(sidecar.url("/keyed")).header("x-api-key", &huge).send().await.unwrap();
        assert_eq!(r.status(), 431);
    }
    sidecar.await_metric("\nsluice_sidecar_endpoint_circuit_open 0\n").await;
    assert_eq!(get_with_key(&c, &sidecar.url("/keyed"), "k1").await.status(), 200);
    assert_eq!(get_with_key(&c, &sidecar.url("/keyed"), "k1").await.status(), 429, "limits still enforced");
    assert_eq!(state.hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_client_cannot_pick_its_bucket_with_hop_by_hop_or_repeated_headers() {
    let (up, state) = start_upstream().await;
    let (_dir, serve) = strict_serve();
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    // `Connection: x-api-key` makes the key hop-by-hop: the application never receives it, so
    // the limiter does not either. Both requests are anonymous: one shared bucket.
    let (first, body) =
        raw(sidecar.process.addr, "GET /keyed HTTP/1.1\r\nX-API-Key: random-1\r\nConnection: x-api-key, close").await;
    assert_eq!(first, 200);
    assert!(body.contains("\"apiKey\":\"\""), "the application got no key: {body}");
    let (second, _) =
        raw(sidecar.process.addr, "GET /keyed HTTP/1.1\r\nX-API-Key: random-2\r\nConnection: x-api-key, close").await;
    assert_eq!(second, 429, "not a fresh bucket per random key");

    // A second copy of the key: refused, not joined into a new key nor resolved either way.
    let c = client();
    assert_eq!(get_with_key(&c, &sidecar.url("/keyed"), "k2").await.status(), 200);
    let hits = state.hits.load(Ordering::SeqCst);
    let (status, body) =
        raw(sidecar.process.addr, "GET /keyed HTTP/1.1\r\nX-API-Key: k2\r\nX-API-Key: random\r\nConnection: close")
            .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("x-api-key"), "{body}");
    assert_eq!(state.hits.load(Ordering::SeqCst), hits);
}

#[tokio::test]
async fn spellings_of_a_path_share_its_limit() {
    let (up, _state) = start_upstream().await;
    let (_dir, serve) = strict_serve();
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    assert_eq!(raw(sidecar.process.addr, "GET /orders/1 HTTP/1.1\r\nConnection: close").await.0, 200);
    for variant in ["//orders/1", "/%6Frders/1", "/x/../orders/1", "/orders/./1"] {
        let (status, _) = raw(sidecar.process.addr, &format!("GET {variant} HTTP/1.1\r\nConnection: close")).await;
        assert_eq!(status, 429, "{variant} is /orders/1 to the application, and to the limiter");
    }
    // Spellings only some servers read as /orders/1 count against its limit too.
    for (variant, who) in [
        ("/orders%2F1", "WSGI decodes %2F"),
        ("/orders;x=1/1", "Tomcat and Jetty drop path parameters"),
        ("/orders;jsessionid=1", "Tomcat"),
        ("/x/..;/orders/1", "Tomcat reads ..; as .."),
        ("/orders%5C1", "IIS: an encoded backslash"),
        ("/orders\\1", "IIS: a backslash"),
        ("/orders./1", "IIS drops trailing dots"),
    ] {
        let (status, body) = raw(sidecar.process.addr, &format!("GET {variant} HTTP/1.1\r\nConnection: close")).await;
        assert_eq!(status, 429, "{variant}: {who}: {body}");
    }
    // Case is kept unless a rule says otherwise: on a case-sensitive server this is another path.
    assert_eq!(raw(sidecar.process.addr, "GET /Orders/1 HTTP/1.1\r\nConnection: close").await.0, 200);
}

#[tokio::test]
async fn header_name_spellings_are_one_header_and_a_request_names_one_host() {
    let (up, state) = start_upstream().await;
    let (_dir, serve) = strict_serve();
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let addr = sidecar.process.addr;
    assert_eq!(raw(addr, "GET /keyed HTTP/1.1\r\nX-API-Key: k1\r\nConnection: close").await.0, 200);
    // CGI and WSGI servers read X_API_KEY as X-API-Key (both are HTTP_X_API_KEY): k1's bucket.
    let (status, body) = raw(addr, "GET /keyed HTTP/1.1\r\nX_API_KEY: k1\r\nConnection: close").await;
    assert_eq!(status, 429, "not a fresh bucket for an underscore spelling: {body}");
    assert_eq!(raw(addr, "GET /keyed HTTP/1.1\r\nx_api-key: k2\r\nConnection: close").await.0, 200);
    assert_eq!(raw(addr, "GET /keyed HTTP/1.1\r\nX-Api-Key: k2\r\nConnection: close").await.0, 429);

    // Both spellings: two values for one header, refused like a repeated header.
    let hits = state.hits.load(Ordering::SeqCst);
    let (status, body) = raw(addr, "GET /keyed HTTP/1.1\r\nX-API-Key: k3\r\nX_API_KEY: k4\r\nConnection: close").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("x-api-key") && body.contains("x_api_key"), "names both spellings: {body}");

    // `raw` adds `Host: app`; a second Host, or a Host another than the absolute target's, is
    // refused (RFC 9112 §3.2) instead of limited as one host and served as another.
    let (status, body) = raw(addr, "GET /all HTTP/1.1\r\nHost: other.example\r\nConnection: close").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("more than one Host header"), "{body}");
    let (status, body) = raw(addr, "GET http://other.example/all HTTP/1.1\r\nConnection: close").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("differs from"), "{body}");
    assert_eq!(state.hits.load(Ordering::SeqCst), hits, "none of them reached the application");
    let (status, body) = raw(addr, "GET http://app/all HTTP/1.1\r\nConnection: close").await;
    assert_eq!(status, 200, "an absolute target naming the Host's host is fine: {body}");
}

#[tokio::test]
async fn an_h2c_upgrade_is_declined_and_served_as_http1() {
    let (up, _state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar(up, &serve.url(""), &[]);
    let (status, body) = raw(
        sidecar.process.addr,
        "GET /anything HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\n\
         HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    )
    .await;
    assert_eq!(status, 200, "no 101: the upgrade is declined");
    let seen: serde_json::Value = serde_json::from_str(body.trim()).unwrap_or_default();
    assert_eq!(seen["upgrade"], "", "{body}");
    assert_eq!(seen["http2Settings"], "", "HTTP2-Settings never reaches an HTTP/1.1 application");
}

/// An endpoint that answers `POST /v1/checks` (and records each batch's size), holding the first
/// batch for `hold` so that the requests arriving meanwhile must wait for the next exchange. Each
/// answer names the key of the check it answers, so a decision handed to the wrong request shows.
async fn start_batch_endpoint(hold: Duration) -> (SocketAddr, Arc<std::sync::Mutex<Vec<usize>>>) {
    let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let app = Router::new()
        .route(
            "/v1/snapshot",
            get(|| async {
                let snapshot =
                    serde_json::json!({"version": "v1", "loaded": true, "headerNames": ["x-api-key"], "sources": []});
                ([("etag", "\"v1\"")], axum::Json(snapshot))
            }),
        )
        .route(
            "/v1/checks",
            post(
                move |State(sizes): State<Arc<std::sync::Mutex<Vec<usize>>>>,
                      axum::Json(body): axum::Json<serde_json::Value>| async move {
                    let requests = body["requests"].as_array().cloned().unwrap_or_default();
                    let first = {
                        let mut sizes = sizes.lock().unwrap();
                        sizes.push(requests.len());
                        sizes.len() == 1
                    };
                    if first {
                        tokio::time::sleep(hold).await;
                    }
                    let results: Vec<serde_json::Value> = requests
                        .iter()
                        .map(|check| {
                            let key = check["headers"]["x-api-key"].as_str().unwrap_or("").to_string();
                            let allowed = !key.starts_with("deny");
                            serde_json::json!({"allowed": allowed, "status": if allowed { 200 } else { 429 },
                                "retryAfterMs": if allowed { None } else { Some(1500) }, "delayMs": 0,
                                "headers": {"X-Answer-For": key}, "snapshot": "v1"})
                        })
                        .collect();
                    axum::Json(serde_json::json!({"results": results}))
                },
            ),
        )
        .with_state(sizes.clone());
    let addr = serve_on_loopback(app).await;
    (addr, sizes)
}

/// While an exchange with the endpoint is under way, the requests that arrive wait and then go
/// together in one `POST /v1/checks`; each gets its own decision back.
#[tokio::test]
async fn requests_waiting_for_a_busy_endpoint_share_one_exchange() {
    let (up, _state) = start_upstream().await;
    let (endpoint, sizes) = start_batch_endpoint(Duration::from_millis(1500)).await;
    let sidecar = start_sidecar_with_timeout(up, &format!("http://{endpoint}"), "5s", &["--endpoint-batches", "1"]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    let first = tokio::spawn({
        let (c, url) = (c.clone(), sidecar.url("/plain"));
        async move { get_with_key(&c, &url, "first").await }
    });
    // The first exchange is held by the endpoint; these 20 arrive meanwhile.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let keys: Vec<String> = (0..20).map(|i| if i % 4 == 0 { format!("deny-{i}") } else { format!("k{i}") }).collect();
    let url = sidecar.url("/plain");
    let replies = futures::future::join_all(keys.iter().map(|key| get_with_key(&c, &url, key))).await;
    assert_eq!(first.await.unwrap().status(), 200);
    for (key, reply) in keys.iter().zip(&replies) {
        assert_eq!(reply.headers()["x-answer-for"], key.as_str(), "each request gets its own decision");
        let want = if key.starts_with("deny") { 429 } else { 200 };
        assert_eq!(reply.status(), want, "{key}");
        if want == 429 {
            assert_eq!(reply.headers()["retry-after"], "2", "{key}: 1500 ms, rounded up");
        }
    }
    assert_eq!(*sizes.lock().unwrap(), [1, 20], "one exchange alone, then the 20 that waited together");
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains("\nsluice_sidecar_endpoint_exchanges_total{kind=\"batch\"} 2\n"), "{metrics}");
    assert!(metrics.contains("\nsluice_sidecar_batched_checks_total 21\n"), "{metrics}");
    assert!(metrics.contains("sluice_sidecar_decisions_total{source=\"endpoint\",result=\"deny\"} 5"), "{metrics}");
}

/// Concurrent requests on one key through the real endpoint, batched: exactly the limit reaches
/// the app, every decision from the endpoint.
#[tokio::test]
async fn batched_checks_through_the_real_endpoint_admit_exactly_the_limit() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar_with_timeout(up, &serve.url(""), "5s", &[]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    let url = sidecar.url("/limited");
    let replies = futures::future::join_all((0..60).map(|_| get_with_key(&c, &url, "hot"))).await;
    let admitted = replies.iter().filter(|r| r.status() == 200).count();
    let limited = replies.iter().filter(|r| r.status() == 429).count();
    assert_eq!((admitted, limited), (2, 58), "limit 2 per hour on one key");
    assert_eq!(state.hits.load(Ordering::SeqCst), 2, "denied requests never reach the app");
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains("\nsluice_sidecar_batched_checks_total 60\n"), "{metrics}");
    assert!(metrics.contains("sluice_sidecar_decisions_total{source=\"endpoint\",result=\"deny\"} 58"), "{metrics}");
    assert!(!metrics.contains("kind=\"single\""), "{metrics}");
}

/// An endpoint without `/v1/checks` (a release before it, during a rolling upgrade) still decides
/// every request: after its 404 the sidecar sends single checks.
#[tokio::test]
async fn an_endpoint_without_the_batch_api_gets_single_checks() {
    let (up, _state) = start_upstream().await;
    let (endpoint, seen) = start_fake_endpoint().await;
    let sidecar = start_sidecar(up, &format!("http://{endpoint}"), &[]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    for key in ["a", "b", "c"] {
        let reply = get_with_key(&c, &sidecar.url("/plain"), key).await;
        assert_eq!(reply.status(), 200);
        assert_eq!(reply.headers()["x-ratelimit-limit"], "10", "decided by the endpoint");
    }
    assert_eq!(seen.lock().unwrap().len(), 3);
    let metrics = sidecar.metrics().await;
    assert!(
        metrics.contains("\nsluice_sidecar_endpoint_exchanges_total{kind=\"batch\"} 1\n"),
        "only the first tried: {metrics}"
    );
    assert!(metrics.contains("\nsluice_sidecar_endpoint_exchanges_total{kind=\"single\"} 3\n"), "{metrics}");
    assert!(!metrics.contains("source=\"local\""), "{metrics}");
}

const OTHER_POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: other, namespace: tenant-acme}
spec:
  rules:
    - name: per-key
      match: {paths: [{prefix: /other}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 1, per: 1h}
"#;

/// While the endpoint pushes the snapshot (it holds the sidecar's snapshot request until a
/// change), a request that no rule applies to is allowed without an exchange; a policy added at
/// the endpoint applies to the next request at once, not after the poll interval (30 s here).
#[tokio::test]
async fn requests_no_rule_applies_to_skip_the_endpoint_and_new_policies_arrive_at_once() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.path().to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--reload-interval",
        "50ms",
    ]);
    let sidecar = start_sidecar(up, &serve.url(""), &["--snapshot-interval", "30s"]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_pushed 1\n").await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(get_with_key(&c, &sidecar.url("/other/1"), "k").await.status(), 200);
    }
    let metrics = sidecar.metrics().await;
    assert!(metrics.contains("sluice_sidecar_decisions_total{source=\"no_rule\",result=\"allow\"} 3"), "{metrics}");
    assert!(!metrics.contains("sluice_sidecar_endpoint_exchanges_total"), "no exchange for them: {metrics}");
    // A rule that applies is still asked about.
    assert_eq!(get_with_key(&c, &sidecar.url("/limited"), "k").await.status(), 200);
    assert!(sidecar.metrics().await.contains("sluice_sidecar_batched_checks_total 1\n"));

    let before = reqwest::get(serve.url("/v1/snapshot")).await.unwrap().headers()["etag"].clone();
    let written = Instant::now();
    std::fs::write(dir.path().join("other.yaml"), OTHER_POLICY).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let etag = reqwest::get(serve.url("/v1/snapshot")).await.unwrap().headers()["etag"].clone();
        if etag != before {
            break;
        }
        assert!(Instant::now() < deadline, "the endpoint never loaded the new policy");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let installed = Instant::now();
    // Within a few seconds, far below the 30 s poll interval: only a push gets it there.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if sidecar.metrics().await.contains("\nsluice_sidecar_snapshot_updates_total 2\n") {
            break;
        }
        assert!(Instant::now() < deadline, "the sidecar did not get the new snapshot: {}", sidecar.metrics().await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "e2e measurement: new policy installed at the endpoint {} ms after the write; cached by the sidecar {} ms later",
        (installed - written).as_millis(),
        installed.elapsed().as_millis()
    );
    let hits_before = state.hits.load(Ordering::SeqCst);
    assert_eq!(get_with_key(&c, &sidecar.url("/other/1"), "k2").await.status(), 200);
    let denied = get_with_key(&c, &sidecar.url("/other/1"), "k2").await;
    assert_eq!(denied.status(), 429, "the new rule is enforced");
    assert_eq!(state.hits.load(Ordering::SeqCst), hits_before + 1);
}

/// An endpoint that refuses batches as a whole (400) and hangs on the first two single checks:
/// each of those exchanges ends at the deadline, so later requests get exchanges again and are
/// decided by the endpoint once it answers.
#[tokio::test]
async fn a_hanging_single_check_does_not_hold_an_exchange_for_ever() {
    let (up, _state) = start_upstream().await;
    let singles = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/v1/snapshot",
            get(|| async {
                let snapshot =
                    serde_json::json!({"version": "v1", "loaded": true, "headerNames": ["x-api-key"], "sources": []});
                ([("etag", "\"v1\"")], axum::Json(snapshot))
            }),
        )
        .route("/v1/checks", post(|| async { (StatusCode::BAD_REQUEST, "no batches here") }))
        .route(
            "/v1/check",
            post(|State(singles): State<Arc<AtomicUsize>>| async move {
                if singles.fetch_add(1, Ordering::SeqCst) < 2 {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                axum::Json(serde_json::json!({"allowed": true, "status": 200, "retryAfterMs": null, "delayMs": 0,
                    "headers": {"X-RateLimit-Limit": "10"}, "rules": []}))
            }),
        )
        .with_state(singles.clone());
    let endpoint = serve_on_loopback(app).await;
    let sidecar = start_sidecar(up, &format!("http://{endpoint}"), &["--endpoint-batches", "2"]);
    sidecar.await_metric("\nsluice_sidecar_snapshot_cached 1\n").await;
    let c = client();
    for key in ["a", "b"] {
        let reply = get_with_key(&c, &sidecar.url("/plain"), key).await;
        assert_eq!(reply.status(), 200);
        assert!(reply.headers().get("x-ratelimit-limit").is_none(), "{key}: decided without the endpoint");
    }
    // Both exchanges hung; once their deadline passes they are free again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in ["c", "d"] {
        let reply = get_with_key(&c, &sidecar.url("/plain"), key).await;
        assert_eq!(reply.headers()["x-ratelimit-limit"], "10", "{key}: decided by the endpoint again");
    }
    assert!(singles.load(Ordering::SeqCst) >= 4);
}

/// The app's probes, moved to the admin port by the webhook, reach the app without a check: a
/// probe never spends a limit, and is never refused by one.
#[tokio::test]
async fn the_apps_probes_run_on_the_admin_port_without_a_limit() {
    let (up, state) = start_upstream().await;
    let dir = policy_dir();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let probes = serde_json::json!({
        "/app-health/app/readyz": {"port": up.port(), "http": {"path": "/limited/a", "scheme": "HTTP",
                                    "headers": [["X-API-Key", "k1"]]}, "timeoutSeconds": 1},
        "/app-health/app/livez": {"port": up.port(), "timeoutSeconds": 1},
    })
    .to_string();
    let sidecar = start_sidecar(up, &serve.url(""), &["--app-probes", &probes]);
    let c = client();
    for _ in 0..5 {
        let probe = c.get(format!("http://{}/app-health/app/readyz", sidecar.admin)).send().await.unwrap();
        assert_eq!(probe.status(), 200);
    }
    assert_eq!(state.hits.load(Ordering::SeqCst), 5, "every probe reached the app");
    let live = c.get(format!("http://{}/app-health/app/livez", sidecar.admin)).send().await.unwrap();
    assert_eq!(live.status(), 200, "a TCP probe connects");
    let unknown = c.get(format!("http://{}/app-health/other/readyz", sidecar.admin)).send().await.unwrap();
    assert_eq!(unknown.status(), 404);
    // The key the probe used still has its whole limit (2) through the proxy.
    for _ in 0..2 {
        assert_eq!(get_with_key(&c, &sidecar.url("/limited/a"), "k1").await.status(), 200);
    }
    assert_eq!(get_with_key(&c, &sidecar.url("/limited/a"), "k1").await.status(), 429);
}

const STREAMS_IN_FLIGHT: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: streams, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: web}}
  rules:
    - name: one-stream
      match: {paths: [{exact: /stream}]}
      key: [{header: X-API-Key}]
      algorithm: concurrency
      limit: {requests: 1, per: 5m}
"#;

/// Issue 24, item 1, through the sidecar: a concurrency slot is held while the response streams,
/// given back when its last chunk is sent, and given back when the client goes away mid-response.
#[tokio::test]
async fn a_concurrency_slot_is_held_until_the_response_ends_or_the_client_leaves() {
    let (up, state) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), STREAMS_IN_FLIGHT).unwrap();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let sidecar = start_sidecar_with_timeout(up, &serve.url(""), "2s", &[]);
    let c = client();

    let mut first = get_with_key(&c, &sidecar.url("/stream"), "k").await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.chunk().await.unwrap().unwrap(), "first\n");
    let second = get_with_key(&c, &sidecar.url("/stream"), "k").await;
    assert_eq!(second.status(), 429, "one stream in progress per key");
    // Another key's stream: admitted, and its client leaves at once (one release).
    assert_eq!(get_with_key(&c, &sidecar.url("/stream"), "other").await.status(), 200, "slots are per key");
    state.release.notify_waiters();
    assert_eq!(first.chunk().await.unwrap().unwrap(), "last\n");
    assert!(first.chunk().await.unwrap().is_none());
    sidecar.await_metric(r#"sluice_sidecar_releases_total{result="released"} 2"#).await;

    // The slot came back with the last chunk: the next stream is admitted, and its client leaves
    // after the first chunk, which gives the slot back too.
    let mut leaving = get_with_key(&c, &sidecar.url("/stream"), "k").await;
    assert_eq!(leaving.status(), 200, "the first stream's slot was released");
    assert_eq!(leaving.chunk().await.unwrap().unwrap(), "first\n");
    drop(leaving);
    sidecar.await_metric(r#"sluice_sidecar_releases_total{result="released"} 3"#).await;
    let after = get_with_key(&c, &sidecar.url("/stream"), "k").await;
    assert_eq!(after.status(), 200, "a client that left gave its slot back");
    state.release.notify_waiters();
}

/// Issue 24: a sidecar killed (-9) while a request holds a concurrency slot never releases it;
/// the slot comes back when its lease runs out, not before and not much after.
#[tokio::test]
async fn a_killed_sidecar_slots_come_back_when_their_lease_runs_out() {
    let (up, state) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = STREAMS_IN_FLIGHT.replace("per: 5m", "per: 2s");
    std::fs::write(dir.path().join("policies.yaml"), policy).unwrap();
    let serve = start_serve(dir.path(), "127.0.0.1:0");
    let mut crashed = start_sidecar_with_timeout(up, &serve.url(""), "2s", &[]);
    let c = client();

    let admitted_at = Instant::now();
    let mut holding = get_with_key(&c, &crashed.url("/stream"), "k").await;
    assert_eq!(holding.status(), 200);
    assert_eq!(holding.chunk().await.unwrap().unwrap(), "first\n");
    crashed.process.child.kill().unwrap();
    crashed.process.child.wait().unwrap();
    drop(holding);

    let fresh = start_sidecar_with_timeout(up, &serve.url(""), "2s", &[]);
    assert_eq!(
        get_with_key(&c, &fresh.url("/stream"), "k").await.status(),
        429,
        "the crashed holder's slot is still held"
    );
    let came_back = loop {
        let response = get_with_key(&c, &fresh.url("/stream"), "k").await;
        if response.status() == 200 {
            break admitted_at.elapsed();
        }
        assert_eq!(response.status(), 429);
        assert!(admitted_at.elapsed() < Duration::from_secs(10), "the slot never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(came_back >= Duration::from_secs(2), "back after {came_back:?}, before its 2 s lease ran out");
    state.release.notify_waiters();
}
