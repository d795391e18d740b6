//! What a client without a credential can hold on the endpoint's listeners (`src/listen.rs`):
//! a connection whose headers never finish, an idle keep-alive connection, a connection that sends
//! nothing and a TLS handshake that never starts are all closed after the header-read timeout;
//! past the connection cap, a new connection takes the place of the one idle longest, and waits
//! (instead of taking file descriptors) only while every connection has a request in flight; and
//! a body is never read before the caller is verified. Each would hold its connection (or the
//! endpoint's attention) forever before; connections that sent nothing, opened past the cap, kept
//! every check from being answered (issue 37).

#[path = "support/sluice_process.rs"]
mod sluice_process;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_process::SluiceProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

const POLICY: &str = "apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: tenant-a}
spec:
  rules:
    - name: r
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 3, per: 1h}
";
const TOKEN: &str = "tenant-a-token-0123456789";

/// Far above the 1 s timeout the servers get, far below forever.
const PATIENCE: Duration = Duration::from_secs(15);

struct Server {
    process: SluiceProcess,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

fn serve(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let tokens = secrets.path().join("tokens.yaml");
    std::fs::write(&tokens, format!("tokens: [{{name: a, token: {TOKEN}, namespaces: [tenant-a]}}]\n")).unwrap();
    let mut args = vec![
        "serve",
        "--policies",
        dir.path().to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ];
    if !extra.contains(&"--header-read-timeout") {
        args.extend_from_slice(&["--header-read-timeout", "1s"]);
    }
    args.extend_from_slice(extra);
    let owned: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
    Server { process: SluiceProcess::start(&refs), _dirs: (dir, secrets) }
}

/// Reads until the peer closes; how long that took, or None if it stayed open for PATIENCE.
async fn closed_within(stream: &mut TcpStream) -> Option<Duration> {
    let start = Instant::now();
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout(PATIENCE.saturating_sub(start.elapsed()), stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => continue,
            Err(_) => return None,
        }
    }
}

async fn connect(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr).await.unwrap()
}

#[tokio::test]
async fn unfinished_headers_and_idle_connections_are_closed() {
    let server = serve(&[]);
    // Headers that never finish.
    let mut slow = connect(server.process.addr).await;
    slow.write_all(b"POST /v1/check HTTP/1.1\r\nHost: x\r\nX-Padding: ").await.unwrap();
    let slow_closed = closed_within(&mut slow);
    // A keep-alive connection that answered one request, then sits idle.
    let mut idle = connect(server.process.addr).await;
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut first = [0u8; 256];
    let n = idle.read(&mut first).await.unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    let idle_closed = closed_within(&mut idle);
    // A connection that never sends a byte (hyper could not even tell HTTP/1 from HTTP/2): the
    // listener's sweep closes it like the others.
    let mut silent = connect(server.process.addr).await;
    let silent_closed = closed_within(&mut silent);
    let (slow_closed, idle_closed, silent_closed) = tokio::join!(slow_closed, idle_closed, silent_closed);
    assert!(slow_closed.is_some(), "a connection with unfinished headers stayed open");
    assert!(idle_closed.is_some(), "an idle keep-alive connection stayed open");
    assert!(silent_closed.is_some(), "a connection that sent nothing stayed open");
}

#[tokio::test]
async fn a_tls_handshake_that_never_starts_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let pair = sluice::admission::certs::generate(&["127.0.0.1".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, &pair.cert_pem).unwrap();
    std::fs::write(&key, &pair.key_pem).unwrap();
    let server = serve(&["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    let mut silent = connect(server.process.addr).await;
    assert!(closed_within(&mut silent).await.is_some(), "a TLS connection without a handshake stayed open");
}

/// A verified check whose body has not finished arriving, on its own connection: once hyper
/// asks for the body (answering `Expect: 100-continue`), the request is in flight, so its
/// connection is one the listener will not close to make room. Returns the connection and the
/// rest of the body.
async fn check_in_flight(addr: SocketAddr) -> (TcpStream, &'static [u8]) {
    const BODY: &[u8] = br#"{"namespace": "tenant-a", "path": "/", "headers": {"x-api-key": "k"}}"#;
    let mut stream = connect(addr).await;
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nHost: x\r\nx-sluice-authorization: Bearer {TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        BODY.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let interim = read_until_blank_line(&mut stream).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    let (first, rest) = BODY.split_at(10);
    stream.write_all(first).await.unwrap();
    (stream, rest)
}

/// Reads one response head (up to its blank line), waiting up to PATIENCE.
async fn read_until_blank_line(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(PATIENCE, stream.read(&mut byte))
            .await
            .unwrap_or_else(|_| panic!("no response head: {:?}", String::from_utf8_lossy(&head)))
            .unwrap();
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

#[tokio::test]
async fn connections_past_the_cap_wait_while_every_one_has_a_request_in_flight() {
    let server = serve(&["--max-connections", "2", "--header-read-timeout", "30s"]);
    let addr = server.process.addr;
    let (mut a, a_rest) = check_in_flight(addr).await;
    let (_b, _) = check_in_flight(addr).await;
    // Both slots are taken by requests in flight: a third is accepted but not served, and
    // neither of them is closed for it.
    let mut third = connect(addr).await;
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut reply = Vec::new();
    let early = tokio::time::timeout(Duration::from_millis(700), third.read_to_end(&mut reply)).await;
    assert!(early.is_err() && reply.is_empty(), "served past the cap: {:?}", String::from_utf8_lossy(&reply));
    // A's request finishes; its connection stays open, idle between requests (the header-read
    // timeout, 30 s, would close it only later): the third takes its place at once.
    a.write_all(a_rest).await.unwrap();
    let answer = read_until_blank_line(&mut a).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    tokio::time::timeout(PATIENCE, third.read_to_end(&mut reply)).await.expect("served once a slot freed").unwrap();
    assert!(String::from_utf8_lossy(&reply).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&reply));
    assert!(closed_within(&mut a).await.is_some(), "the idle connection was not closed for the new one");
}

/// Starts `sluice serve` (as [`serve`] does) with its open-file limit, soft and hard, set to
/// `open_files`, so that its default `--max-connections` follows from it (three quarters).
fn serve_with_open_files_limit(open_files: u32, extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let tokens = secrets.path().join("tokens.yaml");
    std::fs::write(&tokens, format!("tokens: [{{name: a, token: {TOKEN}, namespaces: [tenant-a]}}]\n")).unwrap();
    // The shell's `ulimit` rather than a pre_exec hook: no unsafe code, no libc dependency.
    let mut child = std::process::Command::new("sh")
        .args(["-c", &format!("ulimit -n {open_files} && exec \"$0\" \"$@\""), env!("CARGO_BIN_EXE_sluice")])
        .args(["serve", "--policies", dir.path().to_str().unwrap(), "--tokens", tokens.to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0"])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("SLUICE_LOG_FORMAT", "text")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (found, addresses) = std::sync::mpsc::channel();
    let sink = logs.clone();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(at) = line.find("address=") {
                let _ = found.send(line[at + 8..].split_whitespace().next().unwrap_or("").to_string());
            }
            sink.lock().unwrap().push(line);
        }
    });
    let Ok(addr) = addresses.recv_timeout(Duration::from_secs(20)) else {
        let _ = child.kill();
        panic!("no listening line; logs:\n{}", logs.lock().unwrap().join("\n"));
    };
    let addr = addr.parse().unwrap();
    Server { process: SluiceProcess { child, addr, logs }, _dirs: (dir, secrets) }
}

/// Issue 37, round 3: under an open-file limit of 128, 130 connections that sent nothing kept a
/// tenant's check unanswered for as long as they stayed open (35 s and more). The slots are three
/// quarters of 128, 96; the connections past them take the places of the ones idle longest, and
/// the check's connection takes one more. The header-read timeout is far beyond the test, so only
/// that can answer the check in time.
#[tokio::test]
async fn connections_that_send_nothing_cannot_keep_a_check_from_being_answered() {
    const SILENT: usize = 130;
    const SLOTS: usize = 128 / 4 * 3;
    let server = serve_with_open_files_limit(128, &["--header-read-timeout", "120s"]);
    let addr = server.process.addr;
    let mut silent = Vec::with_capacity(SILENT);
    for _ in 0..SILENT {
        silent.push(connect(addr).await);
    }
    let client = reqwest::Client::new();
    let started = Instant::now();
    let check = client
        .post(server.process.url("/v1/check"))
        .header("x-sluice-authorization", format!("Bearer {TOKEN}"))
        .json(&serde_json::json!({"namespace": "tenant-a", "path": "/", "headers": {"x-api-key": "k"}}))
        .send();
    // Generous for a loaded machine: the answer takes milliseconds; before, it never came while
    // the silent connections stayed open.
    let check = tokio::time::timeout(Duration::from_secs(5), check)
        .await
        .unwrap_or_else(|_| panic!("no answer in {:?} while {SILENT} connections sent nothing", started.elapsed()))
        .unwrap();
    assert_eq!(check.status(), 200);
    // Room was made by closing silent connections, not by serving past the cap: with the check's
    // connection (kept alive by the client), at most SLOTS are open.
    let closed = futures::future::join_all(silent.iter_mut().map(|stream| async move {
        let mut buffer = [0u8; 64];
        matches!(tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buffer)).await, Ok(Ok(0) | Err(_)))
    }))
    .await
    .into_iter()
    .filter(|closed| *closed)
    .count();
    assert!(
        SILENT - closed < SLOTS,
        "{} silent connections still open beside the check's ({SLOTS} slots)",
        SILENT - closed
    );
}

/// An application for the sidecar to proxy to: `/hold` answers only once `release` is notified
/// (telling `entered` it has the request), anything else at once.
async fn start_application(entered: tokio::sync::mpsc::Sender<()>, release: Arc<Notify>) -> SocketAddr {
    let app = axum::Router::new()
        .route(
            "/hold",
            axum::routing::get(move || async move {
                entered.send(()).await.unwrap();
                release.notified().await;
                "released"
            }),
        )
        .fallback(|| async { "ok" });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The sidecar's proxy port is served by the same listener: a request the application is still
/// working on keeps its connection, the connections that send nothing take one another's places
/// (not its), and a new request is still served. Were the proxy's requests not counted in flight,
/// the held request's connection, idle longest, would be the one closed.
#[tokio::test]
async fn the_sidecars_proxy_port_makes_room_the_same_way() {
    let (entered, mut application_has_it) = tokio::sync::mpsc::channel(1);
    let release = Arc::new(Notify::new());
    let application = start_application(entered, release.clone()).await;
    // The endpoint's own timeout long too: the sidecar's pooled connections to it stay open.
    let endpoint = serve(&["--header-read-timeout", "60s"]);
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let sidecar = SluiceProcess::sidecar(
        &application.to_string(),
        &endpoint.process.url(""),
        "tenant-a",
        &["--token-file", token_file.to_str().unwrap(), "--max-connections", "2", "--header-read-timeout", "60s"],
    );
    // A new connection for every request: a pooled one would already hold a slot.
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let through_sidecar = |key: &'static str| client.get(sidecar.url("/")).header("x-api-key", key).send();
    // Until the sidecar has its policies (its first snapshot), it may not answer 200 yet.
    let deadline = Instant::now() + PATIENCE;
    while through_sidecar("warm-up").await.map(|r| r.status()).ok() != Some(reqwest::StatusCode::OK) {
        assert!(Instant::now() < deadline, "the sidecar never served a request");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut held = connect(sidecar.addr).await;
    held.write_all(b"GET /hold HTTP/1.1\r\nHost: app\r\nX-API-Key: held\r\n\r\n").await.unwrap();
    tokio::time::timeout(PATIENCE, application_has_it.recv()).await.expect("the held request reached the application");
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(connect(sidecar.addr).await);
    }
    let answer = tokio::time::timeout(Duration::from_secs(5), through_sidecar("new"))
        .await
        .expect("no answer while connections that sent nothing filled the other slot")
        .unwrap();
    assert_eq!(answer.status(), 200);
    release.notify_one();
    let head = read_until_blank_line(&mut held).await;
    assert!(head.starts_with("HTTP/1.1 200"), "the held request lost its connection: {head}");
}

/// The credential is checked before the body is read: a client without one is refused at once,
/// whatever body it announces (and never sends).
#[tokio::test]
async fn a_body_is_not_read_before_the_caller_is_verified() {
    let server = serve(&[]);
    for path in ["/v1/check", "/v1/checks", "/v1/explain"] {
        let mut stream = connect(server.process.addr).await;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 900000\r\n\r\n{{"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut buffer = [0u8; 512];
        let n = tokio::time::timeout(PATIENCE, stream.read(&mut buffer))
            .await
            .unwrap_or_else(|_| panic!("{path}: no answer while the body is outstanding"))
            .unwrap();
        let reply = String::from_utf8_lossy(&buffer[..n]);
        assert!(reply.starts_with("HTTP/1.1 401"), "{path}: {reply}");
    }
    // With the credential, the body is read and decided as before.
    let client = reqwest::Client::new();
    let check = client
        .post(server.process.url("/v1/check"))
        .header("x-sluice-authorization", format!("Bearer {TOKEN}"))
        .json(&serde_json::json!({"namespace": "tenant-a", "path": "/", "headers": {"x-api-key": "k"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(check.status(), 200);
    let too_big = client
        .post(server.process.url("/v1/check"))
        .header("x-sluice-authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(vec![b' '; 200_000])
        .send()
        .await
        .unwrap();
    assert_eq!(too_big.status(), 413);
}
