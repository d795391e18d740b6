//! A soak at a fixed load through the check API and the sidecar, on Redis: the endpoint's and
//! the sidecar's memory stays within a stated band and their open files do not grow. The test
//! command runs it for `SLUICE_SOAK_SECONDS` (60); scripts/reliability/soak.sh runs it for 30
//! minutes on the release build and docs/reliability.md has the figures. Latency per interval is
//! printed (a p99 that drifts upward is a leak of another kind) but never asserted: the machines
//! are shared.
//!
//! The load rotates over many keys (new keys all the time, old ones expiring in Redis), so a
//! structure that grows per key or per connection shows up as growth here.

#[path = "support/sluice_process.rs"]
mod sluice_process;
#[allow(dead_code)]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice_process::SluiceProcess;
use support::redis_server::RedisServer;

const POLICY: &str = r#"
apiVersion: sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: soak, namespace: soak}
spec:
  rules:
    - name: per-user
      key: [{header: x-user}]
      algorithm: slidingWindowCounter
      limit: {requests: 5, per: 2s}
    - name: per-route
      key: [{path: true}]
      algorithm: tokenBucket
      limit: {requests: 50, per: 1s}
"#;

/// Resident memory (KiB) and open files of a process.
fn resources(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    (rss, fds)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn upstream() -> std::net::SocketAddr {
    let app = axum::Router::new().fallback(|| async { "ok" });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the upstream");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("upstream") });
    address
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_open_files_stay_flat_under_a_fixed_load() {
    let seconds: u64 = std::env::var("SLUICE_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("soak.yaml"), POLICY).unwrap();
    let endpoint = SluiceProcess::start(&[
        "serve",
        "--policies",
        dir.path().to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--redis",
        &redis.url(),
        "--redis-timeout",
        "2s",
    ]);
    let app = upstream().await;
    let sidecar = SluiceProcess::sidecar(&app.to_string(), &endpoint.url(""), "soak", &[]);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();

    // 200 checks/s on the check API and 100 requests/s through the sidecar, keys rotating over
    // 2000 users and 500 routes.
    let stop = Instant::now() + Duration::from_secs(seconds);
    let latencies = Arc::new(std::sync::Mutex::new(Vec::<(u64, u64)>::new()));
    let (sent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    let mut n: u64 = 0;
    while Instant::now() < stop {
        ticker.tick().await;
        for k in 0..3 {
            n += 1;
            let (client, latencies, sent, failed) = (client.clone(), latencies.clone(), sent.clone(), failed.clone());
            let user = format!("user-{}", n % 2000);
            let route = format!("/route/{}", n % 500);
            let (check_url, sidecar_url) = (endpoint.url("/v1/check"), sidecar.url(&route));
            tokio::spawn(async move {
                let at = Instant::now();
                let ok = if k < 2 {
                    let body = serde_json::json!({"namespace": "soak", "path": route, "headers": {"x-user": user}});
                    client.post(check_url).json(&body).send().await.is_ok_and(|r| r.status() == 200)
                } else {
                    client
                        .get(sidecar_url)
                        .header("x-user", user)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200 || r.status() == 429)
                };
                sent.fetch_add(1, Ordering::Relaxed);
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                let micros = at.elapsed().as_micros() as u64;
                latencies.lock().unwrap().push((started.elapsed().as_secs(), micros));
            });
        }
        if n.is_multiple_of(300) {
            samples.push((started.elapsed().as_secs(), resources(endpoint.child.id()), resources(sidecar.child.id())));
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let final_sample = (started.elapsed().as_secs(), resources(endpoint.child.id()), resources(sidecar.child.id()));
    samples.push(final_sample);

    let interval = (seconds / 6).max(10);
    let latencies = latencies.lock().unwrap().clone();
    eprintln!(
        "soak: {seconds} s, {} requests, {} not answered as expected",
        sent.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    for from in (0..seconds).step_by(interval as usize) {
        let mut window: Vec<u64> =
            latencies.iter().filter(|(at, _)| (from..from + interval).contains(at)).map(|(_, us)| *us).collect();
        window.sort_unstable();
        eprintln!(
            "soak: {from:>5}–{:<5} s  p50 {:>6} µs  p99 {:>6} µs  ({} requests)",
            from + interval,
            percentile(&window, 0.5),
            percentile(&window, 0.99),
            window.len()
        );
    }
    let every = (samples.len() / 12).max(1);
    let shown = samples.iter().enumerate().filter(|(i, _)| i % every == 0 || *i == samples.len() - 1);
    for (_, (at, (endpoint_rss, endpoint_fds), (sidecar_rss, sidecar_fds))) in shown {
        eprintln!(
            "soak: at {at:>5} s  endpoint {endpoint_rss} KiB, {endpoint_fds} files; sidecar {sidecar_rss} KiB, {sidecar_fds} files"
        );
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "every request answered (200, or 429 from the sidecar)");

    // The band: after the first fifth (connections made, caches warm), memory grows by at most
    // 25% + 8 MiB and open files by at most 16 to the end.
    let settled = samples.iter().find(|(at, _, _)| *at >= seconds / 5).unwrap_or(&samples[0]);
    let (_, (endpoint_rss_0, endpoint_fds_0), (sidecar_rss_0, sidecar_fds_0)) = *settled;
    let (_, (endpoint_rss_1, endpoint_fds_1), (sidecar_rss_1, sidecar_fds_1)) = final_sample;
    let band = |rss: u64| rss + rss / 4 + 8 * 1024;
    assert!(endpoint_rss_1 <= band(endpoint_rss_0), "endpoint memory grew: {endpoint_rss_0} → {endpoint_rss_1} KiB");
    assert!(sidecar_rss_1 <= band(sidecar_rss_0), "sidecar memory grew: {sidecar_rss_0} → {sidecar_rss_1} KiB");
    assert!(endpoint_fds_1 <= endpoint_fds_0 + 16, "endpoint files grew: {endpoint_fds_0} → {endpoint_fds_1}");
    assert!(sidecar_fds_1 <= sidecar_fds_0 + 16, "sidecar files grew: {sidecar_fds_0} → {sidecar_fds_1}");
}
