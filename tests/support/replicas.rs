//! Several `sluice serve` replicas on one shared store, and many clients deciding through their
//! check APIs at once (tests/serve_redis.rs, tests/serve_leases.rs). The including test declares
//! `mod sluice_process` (support/sluice_process.rs).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::sluice_process::SluiceProcess;

/// `n` replicas serving the policies in `dir` on the store `store_args` name.
pub fn replicas(dir: &std::path::Path, store_args: &[String], n: usize) -> Vec<SluiceProcess> {
    (0..n)
        .map(|_| {
            let mut args = vec!["serve", "--policies", dir.to_str().unwrap(), "--listen", "127.0.0.1:0"];
            args.extend(store_args.iter().map(String::as_str));
            SluiceProcess::start(&args)
        })
        .collect()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(10)).pool_max_idle_per_host(64).build().unwrap()
}

/// The decision for a request to `path` in tenant-a, from `check` (a `/v1/check` URL).
pub async fn check(c: &reqwest::Client, check: &str, path: &str) -> Value {
    let r = c.post(check).json(&json!({"namespace": "tenant-a", "path": path})).send().await.unwrap();
    assert_eq!(r.status(), 200, "never anything but 200 from the check API");
    r.json().await.unwrap()
}

/// `clients` concurrent clients spread over the `/v1/check` URLs `checks` send `total` requests
/// to `path`; returns how many were admitted. Every decision must be the store's: a failure mode
/// deciding would hide what the test measures.
pub async fn hammer(checks: &Arc<Vec<String>>, path: &'static str, clients: usize, total: u64) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (checks, admitted, sent) = (checks.clone(), admitted.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut n = i;
            while sent.fetch_add(1, Ordering::SeqCst) < total {
                let url = &checks[n % checks.len()];
                n += 1;
                let decision = check(&c, url, path).await;
                assert!(decision["rules"][0].get("storeFailure").is_none(), "the store failed: {decision}");
                if decision["allowed"] == true {
                    admitted.fetch_add(1, Ordering::SeqCst);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    admitted.load(Ordering::SeqCst)
}
