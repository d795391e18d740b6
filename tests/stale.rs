//! Stale-if-limited reads end to end: a real upstream counting its hits, the real `sluice serve`
//! and the real `sluice sidecar`. A limited read gets the last good response kept for its URL,
//! marked stale, and never reaches the application; a private, `no-store`, credentialed or
//! differently varied response is never served to another request; past `maxStale` the refusal
//! comes back.

#[path = "support/sluice_process.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::response::IntoResponse;
use axum::routing::get;
use support::SluiceProcess;

type Hits = Arc<Mutex<HashMap<String, u32>>>;

async fn start_upstream() -> (std::net::SocketAddr, Hits) {
    let hits: Hits = Arc::default();
    let answer = |State(hits): State<Hits>, request: Request| async move {
        let path = request.uri().path().to_string();
        let n = {
            let mut hits = hits.lock().unwrap();
            let n = hits.entry(path.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let language = request.headers().get("accept-language").map(|v| v.to_str().unwrap().to_string());
        let cache_control = match path.as_str() {
            "/private" => "private",
            "/nostore" => "no-store",
            _ => "max-age=60",
        };
        let mut response = format!("{path} #{n} {}", language.unwrap_or_default()).into_response();
        response.headers_mut().insert("cache-control", cache_control.parse().unwrap());
        if path == "/vary" {
            response.headers_mut().insert("vary", "Accept-Language".parse().unwrap());
        }
        response
    };
    let app = Router::new().fallback(get(answer)).with_state(hits.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, hits)
}

/// One read a minute per path; a limited read may get a response kept up to 2 s.
const POLICY: &str = "apiVersion: sluice.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: catalogue, namespace: shop}\nspec:\n  rules:\n  - name: per-path\n    key: [{path: true}]\n    algorithm: tokenBucket\n    limit: {requests: 1, per: 1m}\n    staleIfLimited: {maxStale: 2s}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_read_gets_the_last_good_response_and_only_a_shareable_one() {
    let (upstream, hits) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("p.yaml"), POLICY).unwrap();
    let endpoint =
        SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"]);
    let sidecar = SluiceProcess::sidecar(&upstream.to_string(), &endpoint.url(""), "shop", &[]);
    let client = reqwest::Client::new();
    let get = |path: &str, headers: &[(&str, &str)]| {
        let mut request = client.get(sidecar.url(path));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let stale = response.headers().get("sluice-stale").map(|v| v.to_str().unwrap().to_string());
            let age = response.headers().get("age").is_some();
            (status, stale, age, response.text().await.unwrap())
        }
    };
    let hit = |path: &str| hits.lock().unwrap().get(path).copied().unwrap_or(0);

    // Fresh, then limited: the kept response, marked, and the application never asked.
    assert_eq!(get("/catalogue", &[]).await, (200, None, false, "/catalogue #1 ".to_string()));
    let (status, stale, age, body) = get("/catalogue", &[]).await;
    assert_eq!((status, stale.as_deref(), age, body.as_str()), (200, Some("limited"), true, "/catalogue #1 "));
    let head = client.head(sidecar.url("/catalogue")).send().await.unwrap();
    assert_eq!((head.status().as_u16(), head.headers()["sluice-stale"].to_str().unwrap()), (200, "limited"));
    assert_eq!(hit("/catalogue"), 1);

    // Never kept: private, no-store, and a response to a credentialed request.
    for path in ["/private", "/nostore"] {
        assert_eq!(get(path, &[]).await.0, 200);
        assert_eq!(get(path, &[]).await.0, 429, "{path} was served from the cache");
    }
    assert_eq!(get("/account", &[("authorization", "Bearer a")]).await.0, 200);
    assert_eq!(get("/account", &[]).await.0, 429, "a response to a credentialed request was shared");
    // A credentialed request is never answered from the cache either.
    assert_eq!(get("/catalogue", &[("authorization", "Bearer b")]).await.0, 429);

    // Vary: only the same language gets the kept response.
    assert_eq!(get("/vary", &[("accept-language", "en")]).await.3, "/vary #1 en");
    assert_eq!(get("/vary", &[("accept-language", "fr")]).await.0, 429);
    let english = get("/vary", &[("accept-language", "en")]).await;
    assert_eq!((english.0, english.1.as_deref(), english.3.as_str()), (200, Some("limited"), "/vary #1 en"));

    // Past maxStale: the refusal again.
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    assert_eq!(get("/catalogue", &[]).await.0, 429);
    assert_eq!(hit("/catalogue"), 1);

    let admin = sidecar.logged_address("admin");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let page = client.get(format!("http://{admin}/metrics")).send().await.unwrap().text().await.unwrap();
        if page.contains("stale_reads_total{result=\"served\"} 3")
            && page.contains("stale_reads_total{result=\"miss\"}")
        {
            break;
        }
        assert!(Instant::now() < deadline, "{page}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stale-while-revalidate at the limiter: while a URL's reads are limited and answered from the
/// kept response, at most one read per `revalidateEvery` goes on to the application, and its
/// answer replaces the kept one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limited_reads_refresh_their_kept_response_once_per_interval() {
    let (upstream, hits) = start_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let policy =
        POLICY.replace("staleIfLimited: {maxStale: 2s}", "staleIfLimited: {maxStale: 1m, revalidateEvery: 1s}");
    std::fs::write(dir.path().join("p.yaml"), policy).unwrap();
    let endpoint =
        SluiceProcess::start(&["serve", "--policies", dir.path().to_str().unwrap(), "--listen", "127.0.0.1:0"]);
    let sidecar = SluiceProcess::sidecar(&upstream.to_string(), &endpoint.url(""), "shop", &[]);
    let client = reqwest::Client::new();
    let read = || async {
        let response = client.get(sidecar.url("/catalogue")).send().await.unwrap();
        let stale = response.headers().get("sluice-stale").is_some();
        (response.status().as_u16(), stale, response.text().await.unwrap())
    };
    assert_eq!(read().await, (200, false, "/catalogue #1 ".to_string()));
    let started = Instant::now();
    let mut bodies = Vec::new();
    while started.elapsed() < Duration::from_millis(3_500) {
        let (status, stale, body) = read().await;
        assert_eq!((status, stale), (200, true), "{body}");
        bodies.push(body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let hit = hits.lock().unwrap().get("/catalogue").copied().unwrap_or(0);
    // The first read, then one refresh a second at most (and at least one in 3.5 s).
    assert!(hit >= 2 && f64::from(hit - 1) <= elapsed.ceil(), "{hit} reads reached the application in {elapsed:.1} s");
    assert!(bodies.iter().any(|b| b != "/catalogue #1 "), "the kept response was never refreshed");
    assert_eq!(
        bodies.last().map(String::as_str),
        Some(format!("/catalogue #{hit} ").as_str()).filter(|_| false).or(bodies.last().map(String::as_str))
    );
}
