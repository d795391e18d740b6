//! What a client without a credential can hold on the endpoint's listeners (`src/server/listen.rs`):
//! a connection whose headers never finish, an idle keep-alive connection and a TLS handshake
//! that never starts are all closed after the header-read timeout; connections past the cap wait
//! instead of taking file descriptors; and a body is never read before the caller is verified.
//! Each would hold its connection (or the endpoint's attention) forever before.

#[path = "support/sluice_process.rs"]
mod sluice_process;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use sluice_process::SluiceProcess;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    let (slow_closed, idle_closed) = tokio::join!(slow_closed, idle_closed);
    assert!(slow_closed.is_some(), "a connection with unfinished headers stayed open");
    assert!(idle_closed.is_some(), "an idle keep-alive connection stayed open");
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

#[tokio::test]
async fn connections_past_the_cap_wait_for_a_free_one() {
    let server = serve(&["--max-connections", "2", "--header-read-timeout", "30s"]);
    let addr = server.process.addr;
    let (mut a, _b) = (connect(addr).await, connect(addr).await);
    // Both slots are taken (by connections that have sent nothing): a third is accepted by the
    // kernel but not served.
    let mut third = connect(addr).await;
    third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut reply = Vec::new();
    let early = tokio::time::timeout(Duration::from_millis(700), third.read_to_end(&mut reply)).await;
    assert!(early.is_err() && reply.is_empty(), "served past the cap: {:?}", String::from_utf8_lossy(&reply));
    // One slot frees: the third is served.
    a.shutdown().await.unwrap();
    drop(a);
    tokio::time::timeout(PATIENCE, third.read_to_end(&mut reply)).await.expect("served once a slot freed").unwrap();
    assert!(String::from_utf8_lossy(&reply).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&reply));
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
