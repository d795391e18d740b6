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
//!
//! `--cold-keys N --cold-rate R` adds, per path, R checks a second spread over N other keys
//! (`<run>-cold-<i>`), reported apart as `<path> cold`: a hot key among many cold ones.
//!
//! `--protocol proxy` sends plain `GET <path>` requests (with `x-run`) to proxies that enforce
//! (sidecars): a 200 is admitted, a 429 refused, anything else counted as not a 200.
//!
//! `--protocol rls` sends the same load to any server of Envoy's rate limit service (gRPC
//! `ShouldRateLimit`: `sluice serve --grpc-listen`, Limitador, envoyproxy/ratelimit), one HTTP/2
//! connection per endpoint as Envoy keeps: each check is one descriptor
//! `[(--descriptor-key, path), (--run-key, --run)]` in domain `--domain` (default: the namespace),
//! sent with a `grpc-timeout` of `--timeout-ms` (also the client's own deadline). `OK` counts as
//! admitted, `OVER_LIMIT` as refused; a gRPC error (the deadline passing included) as a
//! transport error, by code in `errors`, and an `UNKNOWN` overall code as a non-200. The server's
//! own `onStoreFailure` decisions are not marked in the protocol; Sluice's are recognised by the
//! status it gives them (a rule's limit with `duration_until_reset` 0, which a decision by the
//! store never has but at the very end of a window), so `by_store_failure` and
//! `longest_without_store_ms` mean the same in both modes for Sluice (check them against its
//! `sluice_store_failure_decisions_total`). `longest_without_decision_ms` is the longest
//! stretch, on one endpoint, from its first answer that was not a decision (an error) to its
//! next decision, in both modes.
//!
//! `cargo run --release --example failover_load -- --protocol rls --endpoints 127.0.0.1:8081 \
//!      --paths /fixed --domain failover --descriptor-key path --run-key run --rate 60 \
//!      --duration 40 --window 10 --run r1 --timeout-ms 1000`

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

struct Args {
    endpoints: Vec<String>,
    paths: Vec<String>,
    namespace: String,
    rate: f64,
    duration: f64,
    window: u64,
    run: String,
    protocol: Protocol,
    domain: Option<String>,
    descriptor_key: String,
    run_key: String,
    timeout: Duration,
    /// Besides each path's one key (`--run`), this many other keys (`<run>-cold-<i>`), taking
    /// `--cold-rate` checks per second between them, reported as `<path> cold`.
    cold_keys: u64,
    cold_rate: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Protocol {
    /// `POST /v1/check` of `sluice serve`.
    Http,
    /// Envoy's `ShouldRateLimit`.
    Rls,
    /// Plain `GET <path>` through a proxy that enforces (the sidecar): 200 admitted, 429 refused.
    Proxy,
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
        protocol: Protocol::Http,
        domain: None,
        descriptor_key: "path".into(),
        run_key: "run".into(),
        timeout: Duration::from_secs(5),
        cold_keys: 0,
        cold_rate: 0.0,
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
            "--protocol" => {
                args.protocol = match value.as_str() {
                    "http" => Protocol::Http,
                    "rls" => Protocol::Rls,
                    "proxy" => Protocol::Proxy,
                    other => panic!("--protocol: http, rls or proxy, not {other}"),
                }
            }
            "--domain" => args.domain = Some(value),
            "--descriptor-key" => args.descriptor_key = value,
            "--run-key" => args.run_key = value,
            "--timeout-ms" => args.timeout = Duration::from_millis(value.parse().expect("--timeout-ms: milliseconds")),
            "--cold-keys" => args.cold_keys = value.parse().expect("--cold-keys: a count"),
            "--cold-rate" => args.cold_rate = value.parse().expect("--cold-rate: a number"),
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
    /// From sending to the answer (or the error), µs.
    latency_us: u64,
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
    /// Not a 200 from the check API; in RLS mode, an `UNKNOWN` overall code.
    Status(u16),
    Transport,
    /// A gRPC error (RLS mode), the client's deadline passing included: a transport error.
    Grpc(tonic::Code),
}

impl Outcome {
    /// A decision by the server (by its store or by its failure mode), as opposed to an error.
    fn decided(&self) -> bool {
        matches!(self, Outcome::Admitted { .. } | Outcome::Refused { .. })
    }
}

/// gRPC code names as in the spec.
fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// One `ShouldRateLimit` call, within `timeout` (sent as `grpc-timeout` and enforced here).
async fn check_rls(
    mut client: RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
    timeout: Duration,
) -> Outcome {
    let mut request = tonic::Request::new(request);
    request.set_timeout(timeout);
    let response = match tokio::time::timeout(timeout, client.should_rate_limit(request)).await {
        Err(_) => return Outcome::Grpc(tonic::Code::DeadlineExceeded),
        // tonic reports its own enforcement of grpc-timeout as CANCELLED "Timeout expired".
        Ok(Err(status))
            if status.code() == tonic::Code::Cancelled && status.message() == tonic::TimeoutExpired(()).to_string() =>
        {
            return Outcome::Grpc(tonic::Code::DeadlineExceeded);
        }
        Ok(Err(status)) => return Outcome::Grpc(status.code()),
        Ok(Ok(response)) => response.into_inner(),
    };
    // Sluice answers a rule's onStoreFailure with the rule's limit and nothing until reset
    // (src/engine/mod.rs: reset_after 0); a decision by the store counts down to the end of
    // its window. Limitador sends no statuses.
    let by_failure = response
        .statuses
        .iter()
        .any(|s| s.current_limit.is_some() && s.duration_until_reset.is_some_and(|d| d.seconds == 0 && d.nanos == 0));
    match Code::try_from(response.overall_code) {
        Ok(Code::Ok) => Outcome::Admitted { store_failure: by_failure.then_some("allow") },
        Ok(Code::OverLimit) => Outcome::Refused { store_failure: by_failure.then_some("deny") },
        _ => Outcome::Status(0),
    }
}

/// The descriptor of one check: `[(key, path), (run_key, run)]` (no run entry if `run_key` is
/// empty).
fn rls_request(args: &Args, path: &str, run: &str) -> RateLimitRequest {
    let mut entries = vec![Entry { key: args.descriptor_key.clone(), value: path.to_string() }];
    if !args.run_key.is_empty() {
        entries.push(Entry { key: args.run_key.clone(), value: run.to_string() });
    }
    RateLimitRequest {
        domain: args.domain.clone().unwrap_or_else(|| args.namespace.clone()),
        descriptors: vec![RateLimitDescriptor { entries, ..RateLimitDescriptor::default() }],
        hits_addend: 1,
    }
}

/// Latency quantile `q` of sorted `us`, in ms.
fn quantile_ms(us: &[u64], q: f64) -> f64 {
    if us.is_empty() {
        return 0.0;
    }
    let i = ((us.len() as f64 * q).ceil() as usize).clamp(1, us.len()) - 1;
    (us[i] as f64 / 10.0).round() / 100.0
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

/// The longest stretch, on one endpoint, from the first answer `within` holds for to that
/// endpoint's next answer it does not (or the last answer sent, if none came), in ms. `list` is
/// in the order sent.
fn longest_stretch(list: &[Answer], endpoints: usize, within: impl Fn(&Outcome) -> bool) -> u64 {
    let mut longest = 0;
    for endpoint in 0..endpoints {
        let mut since: Option<u64> = None;
        for answer in list.iter().filter(|a| a.endpoint == endpoint) {
            match (within(&answer.outcome), since) {
                (true, None) => since = Some(answer.sent_ms),
                (false, Some(from)) => {
                    longest = longest.max(answer.sent_ms - from);
                    since = None;
                }
                _ => {}
            }
        }
        if let (Some(from), Some(last)) = (since, list.last()) {
            longest = longest.max(last.sent_ms - from);
        }
    }
    longest
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let client =
        reqwest::Client::builder().timeout(args.timeout).pool_max_idle_per_host(64).build().expect("an HTTP client");
    // One HTTP/2 connection per endpoint, calls multiplexed on it (as Envoy does per worker).
    let channels: Vec<RateLimitServiceClient<Channel>> = if args.protocol == Protocol::Rls {
        args.endpoints
            .iter()
            .map(|e| {
                let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{e}"))
                    .expect("an endpoint host:port")
                    .tcp_nodelay(true)
                    .connect_timeout(args.timeout);
                RateLimitServiceClient::new(endpoint.connect_lazy())
            })
            .collect()
    } else {
        Vec::new()
    };
    let answers: Arc<Mutex<BTreeMap<String, Vec<Answer>>>> = Arc::default();
    let started = Instant::now();
    let mut tasks = Vec::new();
    // Each path's one key at --rate, and its cold keys at --cold-rate.
    let mut streams: Vec<(usize, String, String, f64, bool)> = Vec::new();
    for (p, path) in args.paths.iter().enumerate() {
        streams.push((p, path.clone(), path.clone(), args.rate, false));
        if args.cold_keys > 0 && args.cold_rate > 0.0 {
            streams.push((p, format!("{path} cold"), path.clone(), args.cold_rate, true));
        }
    }
    for (p, label, path, rate, cold) in &streams {
        let (p, rate) = (*p, *rate);
        let total = (rate * args.duration) as u64;
        for k in 0..total {
            // Paths are offset within a tick so they do not all fire at once.
            let at = Duration::from_secs_f64((k as f64 + p as f64 / args.paths.len() as f64) / rate);
            let run = if *cold { format!("{}-cold-{}", args.run, k % args.cold_keys) } else { args.run.clone() };
            let endpoint = (k as usize + p) % args.endpoints.len();
            let url = match args.protocol {
                Protocol::Proxy => format!("http://{}{path}", args.endpoints[endpoint]),
                _ => format!("http://{}/v1/check", args.endpoints[endpoint]),
            };
            let proxied = args.protocol == Protocol::Proxy;
            let body = serde_json::json!({
                "namespace": args.namespace, "method": "GET", "path": path,
                "headers": {"x-run": run},
            });
            let rls =
                (args.protocol == Protocol::Rls).then(|| (channels[endpoint].clone(), rls_request(&args, path, &run)));
            let timeout = args.timeout;
            let (client, answers, path) = (client.clone(), answers.clone(), label.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until((started + at).into()).await;
                let sent_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
                let sent = Instant::now();
                let outcome = match rls {
                    Some((channel, request)) => check_rls(channel, request, timeout).await,
                    None if proxied => match client.get(&url).header("x-run", &run).send().await {
                        Err(_) => Outcome::Transport,
                        Ok(response) => match response.status().as_u16() {
                            200 => Outcome::Admitted { store_failure: None },
                            429 => Outcome::Refused { store_failure: None },
                            other => Outcome::Status(other),
                        },
                    },
                    None => match client.post(&url).json(&body).send().await {
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
                    },
                };
                let latency_us = sent.elapsed().as_micros() as u64;
                answers.lock().unwrap().entry(path).or_default().push(Answer {
                    sent_ms,
                    latency_us,
                    endpoint,
                    outcome,
                });
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
        let longest_ms = longest_stretch(&list, args.endpoints.len(), |o| {
            matches!(o, Outcome::Admitted { store_failure: Some(_) } | Outcome::Refused { store_failure: Some(_) })
        });
        // The same for answers that were no decision at all (errors), from the first to the
        // next decision on that endpoint.
        let longest_undecided_ms = longest_stretch(&list, args.endpoints.len(), |o| !o.decided());
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        for answer in &list {
            let name = match answer.outcome {
                Outcome::Grpc(code) => grpc_code_name(code).to_string(),
                Outcome::Status(0) => "UNKNOWN overall_code".to_string(),
                Outcome::Status(status) => status.to_string(),
                Outcome::Transport => "transport".to_string(),
                _ => continue,
            };
            *errors.entry(name).or_default() += 1;
        }
        let mut latencies: Vec<u64> = list.iter().map(|a| a.latency_us).collect();
        latencies.sort_unstable();
        report.insert(
            path.clone(),
            serde_json::json!({
                "sent": list.len(),
                "admitted": count(&|o| matches!(o, Outcome::Admitted { .. })),
                "refused": count(&|o| matches!(o, Outcome::Refused { .. })),
                "by_store_failure": by_mode,
                "non_200": count(&|o| matches!(o, Outcome::Status(_))),
                "transport_errors": count(&|o| matches!(o, Outcome::Transport | Outcome::Grpc(_))),
                "errors": errors,
                "max_admitted_in_a_window": per_window.values().max().copied().unwrap_or(0),
                "admitted_per_window": per_window.values().collect::<Vec<_>>(),
                "longest_without_store_ms": longest_ms,
                "longest_without_decision_ms": longest_undecided_ms,
                "latency_ms": {
                    "p50": quantile_ms(&latencies, 0.5),
                    "p99": quantile_ms(&latencies, 0.99),
                    "max": quantile_ms(&latencies, 1.0),
                },
            }),
        );
    }
    println!("{}", serde_json::Value::Object(report));
}
