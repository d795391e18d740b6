//! Constant-rate checks against several `sluice serve` replicas while something fails, and what
//! the limiter decided: scripts/reliability/ drives it around a fault (a Redis failover, a killed
//! replica, a partition) and compares the figures with the same run without the fault.
//!
//! Each path (one rule per path in the script's policy) gets `--rate` checks per second, spread
//! round-robin over the endpoints, all keyed by `x-run: <--run>` so runs never share counters.
//! Prints one JSON object: per path the checks sent, admitted, refused, decided by each
//! `onStoreFailure` mode, transport errors and non-200 answers, the most admitted in one aligned
//! window of `--window` seconds, and the longest stretch in which one endpoint's decisions all
//! came from `onStoreFailure` (the time without shared decisions there).
//!
//! `cargo run --release --example failover_load -- --endpoints 127.0.0.1:8081,127.0.0.1:8082 \
//!      --paths /fixed,/log --rate 60 --duration 40 --window 10 --run r1`

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct Args {
    endpoints: Vec<String>,
    paths: Vec<String>,
    namespace: String,
    rate: f64,
    duration: f64,
    window: u64,
    run: String,
}

fn parse_args() -> Args {
    let mut args = Args {
        endpoints: vec!["127.0.0.1:8080".into()],
        paths: vec!["/".into()],
        namespace: "failover".into(),
        rate: 50.0,
        duration: 30.0,
        window: 10,
        run: "run".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let list = |v: &str| v.split(',').map(str::to_string).collect::<Vec<_>>();
        match flag.as_str() {
            "--endpoints" => args.endpoints = list(&value),
            "--paths" => args.paths = list(&value),
            "--namespace" => args.namespace = value,
            "--rate" => args.rate = value.parse().expect("--rate: a number"),
            "--duration" => args.duration = value.parse().expect("--duration: seconds"),
            "--window" => args.window = value.parse().expect("--window: whole seconds"),
            "--run" => args.run = value,
            other => panic!("unknown flag {other}"),
        }
    }
    args
}

/// What one check came back as.
#[derive(Clone, Copy)]
struct Answer {
    /// Unix time the check was sent, ms.
    sent_ms: u64,
    endpoint: usize,
    outcome: Outcome,
}

#[derive(Clone, Copy, PartialEq)]
enum Outcome {
    Admitted {
        store_failure: Option<&'static str>,
    },
    Refused {
        store_failure: Option<&'static str>,
    },
    /// Not a 200 from the check API.
    Status(u16),
    Transport,
}

fn failure_mode(body: &serde_json::Value) -> Option<&'static str> {
    let modes = body["rules"].as_array()?.iter().filter_map(|r| r["storeFailure"].as_str()).collect::<Vec<_>>();
    modes.first().map(|m| match *m {
        "allow" => "allow",
        "deny" => "deny",
        "localFallback" => "localFallback",
        _ => "other",
    })
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(64)
        .build()
        .expect("an HTTP client");
    let answers: Arc<Mutex<BTreeMap<String, Vec<Answer>>>> = Arc::default();
    let started = Instant::now();
    let total = (args.rate * args.duration) as u64;
    let mut tasks = Vec::new();
    for (p, path) in args.paths.iter().enumerate() {
        for k in 0..total {
            // Paths are offset within a tick so they do not all fire at once.
            let at = Duration::from_secs_f64((k as f64 + p as f64 / args.paths.len() as f64) / args.rate);
            let endpoint = (k as usize + p) % args.endpoints.len();
            let url = format!("http://{}/v1/check", args.endpoints[endpoint]);
            let body = serde_json::json!({
                "namespace": args.namespace, "method": "GET", "path": path,
                "headers": {"x-run": args.run},
            });
            let (client, answers, path) = (client.clone(), answers.clone(), path.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((started + at).into()).await;
                let sent_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
                let outcome = match client.post(&url).json(&body).send().await {
                    Err(_) => Outcome::Transport,
                    Ok(response) if response.status() != 200 => Outcome::Status(response.status().as_u16()),
                    Ok(response) => match response.json::<serde_json::Value>().await {
                        Err(_) => Outcome::Transport,
                        Ok(body) => {
                            let store_failure = failure_mode(&body);
                            if body["allowed"].as_bool() == Some(true) {
                                Outcome::Admitted { store_failure }
                            } else {
                                Outcome::Refused { store_failure }
                            }
                        }
                    },
                };
                answers.lock().unwrap().entry(path).or_default().push(Answer { sent_ms, endpoint, outcome });
            }));
        }
    }
    for task in tasks {
        let _ = task.await;
    }
    let answers = answers.lock().unwrap();
    let mut report = serde_json::Map::new();
    for (path, list) in answers.iter() {
        let mut list = list.clone();
        list.sort_by_key(|a| a.sent_ms);
        let count = |f: &dyn Fn(&Outcome) -> bool| list.iter().filter(|a| f(&a.outcome)).count();
        let mut by_mode: BTreeMap<&str, usize> = BTreeMap::new();
        let mut per_window: BTreeMap<u64, u64> = BTreeMap::new();
        for answer in &list {
            match answer.outcome {
                Outcome::Admitted { store_failure } => {
                    *per_window.entry(answer.sent_ms / (args.window * 1000)).or_default() += 1;
                    if let Some(mode) = store_failure {
                        *by_mode.entry(mode).or_default() += 1;
                    }
                }
                Outcome::Refused { store_failure: Some(mode) } => *by_mode.entry(mode).or_default() += 1,
                _ => {}
            }
        }
        // The longest stretch, on one endpoint, from its first decision by onStoreFailure to its
        // next decision by the store.
        let mut longest_ms = 0;
        for endpoint in 0..args.endpoints.len() {
            let mut since: Option<u64> = None;
            for answer in list.iter().filter(|a| a.endpoint == endpoint) {
                let failed = matches!(
                    answer.outcome,
                    Outcome::Admitted { store_failure: Some(_) } | Outcome::Refused { store_failure: Some(_) }
                );
                match (failed, since) {
                    (true, None) => since = Some(answer.sent_ms),
                    (false, Some(from)) => {
                        longest_ms = longest_ms.max(answer.sent_ms - from);
                        since = None;
                    }
                    _ => {}
                }
            }
            if let (Some(from), Some(last)) = (since, list.last()) {
                longest_ms = longest_ms.max(last.sent_ms - from);
            }
        }
        report.insert(
            path.clone(),
            serde_json::json!({
                "sent": list.len(),
                "admitted": count(&|o| matches!(o, Outcome::Admitted { .. })),
                "refused": count(&|o| matches!(o, Outcome::Refused { .. })),
                "by_store_failure": by_mode,
                "non_200": count(&|o| matches!(o, Outcome::Status(_))),
                "transport_errors": count(&|o| matches!(o, Outcome::Transport)),
                "max_admitted_in_a_window": per_window.values().max().copied().unwrap_or(0),
                "admitted_per_window": per_window.values().collect::<Vec<_>>(),
                "longest_without_store_ms": longest_ms,
            }),
        );
    }
    println!("{}", serde_json::Value::Object(report));
}
