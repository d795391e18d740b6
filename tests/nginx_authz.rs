//! examples/nginx/sluice.conf against Debian's nginx and the real `sluice serve`: nginx's
//! auth_request asks the ext_authz mode, and over-limit requests come back as 429 with
//! Retry-After without reaching the application. Needs the `nginx` package (scripts/test.sh
//! installs it).

#[path = "support/sluice_process.rs"]
mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::any;
use support::SluiceProcess;

const POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: web, namespace: tenant-acme}
spec:
  selector: {matchLabels: {app: web}}
  rules:
    - name: writes-per-key
      match: {methods: [POST], paths: [{prefix: /orders}]}
      key: [{header: X-API-Key}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1h}
    - name: per-client
      match: {paths: [{prefix: /by-client}]}
      key: [{clientIP: true}]
      algorithm: fixedWindow
      limit: {requests: 2, per: 1h}
"#;

const GATEWAY_TOKEN: &str = "nginx-gateway-token-0123456789";

struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn nginx_binary() -> &'static str {
    if Path::new("/usr/sbin/nginx").exists() { "/usr/sbin/nginx" } else { "nginx" }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Runs nginx in the foreground, single-process, with everything under `prefix`.
fn start_nginx(prefix: &Path, endpoint: SocketAddr, app: SocketAddr, port: u16) -> Nginx {
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/nginx/sluice.conf")).unwrap();
    let site = example
        .replace("127.0.0.1:8080", &endpoint.to_string())
        .replace("127.0.0.1:3000", &app.to_string())
        .replace("listen 127.0.0.1:8000", &format!("listen 127.0.0.1:{port}"))
        .replace("CHANGE-ME-gateway-token", GATEWAY_TOKEN);
    assert_ne!(site, example, "the example's addresses changed; update this test");
    std::fs::write(prefix.join("sluice.conf"), site).unwrap();
    let p = prefix.display();
    // Debian's build puts temp paths under /var/lib/nginx; keep this run self-contained.
    let main = format!(
        "events {{}}\nhttp {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n  \
         fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n  \
         include {p}/sluice.conf;\n}}\n"
    );
    std::fs::write(prefix.join("nginx.conf"), main).unwrap();
    let globals = format!("daemon off; master_process off; error_log stderr notice; pid {p}/nginx.pid;");
    let child = Command::new(nginx_binary())
        .arg("-p")
        .arg(prefix)
        .arg("-c")
        .arg(prefix.join("nginx.conf"))
        .arg("-g")
        .arg(globals)
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run nginx ({e}); install Debian's nginx package (scripts/test.sh does)"));
    let mut nginx = Nginx(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = nginx.0.try_wait() {
            panic!("nginx exited: {status}");
        }
        assert!(Instant::now() < deadline, "nginx did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    nginx
}

/// The app (counting hits), `sluice serve` with the gateway token, and nginx in front.
struct Site {
    hits: Arc<AtomicUsize>,
    url: String,
    _serve: SluiceProcess,
    _nginx: Nginx,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

async fn site() -> Site {
    let hits = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .fallback(any(|State(hits): State<Arc<AtomicUsize>>| async move {
            hits.fetch_add(1, Ordering::SeqCst);
            "from the app\n"
        }))
        .with_state(hits.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policies.yaml"), POLICY).unwrap();
    let policies = dir.path().join("policies.yaml");
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, format!("tokens: [{{name: nginx, token: {GATEWAY_TOKEN}, gateway: true}}]\n")).unwrap();
    let serve = SluiceProcess::start(&[
        "serve",
        "--policies",
        policies.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    let prefix = tempfile::tempdir().unwrap();
    let port = free_port();
    let nginx = start_nginx(prefix.path(), serve.addr, app_addr, port);
    Site { hits, url: format!("http://127.0.0.1:{port}"), _serve: serve, _nginx: nginx, _dirs: (dir, prefix) }
}

#[tokio::test]
async fn nginx_auth_request_answers_429_with_retry_after() {
    let site = site().await;
    let hits = site.hits.clone();
    let c = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let url = format!("{}/orders/7?x=1", site.url);
    let post = || c.post(&url).header("x-api-key", "nginx-key").body("{}").send();
    for remaining in ["1", "0"] {
        let r = post().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-ratelimit-remaining"], remaining, "headers copied onto allowed responses");
        assert!(r.headers()["ratelimit-policy"].to_str().unwrap().contains("q=2;w=3600"));
        assert_eq!(r.text().await.unwrap(), "from the app\n");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    let denied = post().await.unwrap();
    assert_eq!(denied.status(), 429);
    let retry: u64 = denied.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry > 0 && retry <= 3600, "Retry-After {retry}");
    assert_eq!(denied.headers()["x-ratelimit-remaining"], "0");
    assert!(denied.headers().contains_key("ratelimit"));
    assert_eq!(denied.headers()["content-type"], "application/problem+json");
    assert!(denied.text().await.unwrap().contains("\"status\":429"));
    assert_eq!(hits.load(Ordering::SeqCst), 2, "nginx did not forward the denied request");

    // The rule is POST-only: the subrequest carries the original method, so a GET passes.
    let get = c.get(&url).header("x-api-key", "nginx-key").send().await.unwrap();
    assert_eq!(get.status(), 200);
    assert_eq!(hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_client_cannot_lower_its_cost_or_pick_its_address_through_nginx() {
    let site = site().await;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let url = format!("{}/by-client", site.url);
    let mut statuses = Vec::new();
    for forged in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let r = c
            .get(&url)
            .header("x-sluice-cost", "0")
            .header("x-envoy-external-address", forged)
            .header("x-forwarded-for", forged)
            .header("x-sluice-namespace", "someone-else")
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429], "2 per client address: nginx names the real one, at cost 1");
    assert_eq!(site.hits.load(Ordering::SeqCst), 2);
}
