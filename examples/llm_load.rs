//! The load of scripts/bench/llm-tokens.sh: closed-loop clients of an OpenAI-compatible chat
//! endpoint (Sluice's sidecars in front of examples/fake_llm.rs), every request streamed with
//! `stream_options.include_usage`, so that the tokens each response cost arrive in its last
//! events.
//!
//! Each of `--clients` clients, on its own, in a loop until `--duration` has passed: waits its
//! think time (uniform in [0, 2 × `--think-ms`]; the first wait is uniform in
//! [0, `--think-ms`], which spreads the first requests), sends one request to the next of
//! `--targets` (client i starts at target i mod n, then goes round-robin), reads the whole
//! stream, and on a 429 sleeps its `Retry-After` plus up to `--jitter-ms` instead of thinking
//! (1 s instead of a Retry-After that is missing or longer than `--max-retry-after-s`, 60, the
//! longest OpenAI's Python SDK honours). Past the duration no request starts; those under way
//! finish (each is bounded by `--timeout-s`).
//!
//! Every request: `POST /v1/chat/completions`, header `x-tenant: <--tenant>`, body
//! `{"model", "stream": true, "stream_options": {"include_usage": true}, "max_tokens", "messages"}`
//! with `max_tokens` = `--max-tokens N`, or `--max-tokens random` for a uniform draw in
//! [`--random-min`, `--random-max`] per request.
//!
//! `--out FILE` gets one line per request (bounded: a client sends at most one request per
//! completed response or refusal):
//!
//!   `<start_unix_ms> <end_unix_ms> <client> <status> <total_tokens> <outcome> <retry_after_s>`
//!
//! status 0 when no response came; total_tokens from the usage event (0 without one);
//! retry_after_s the response's Retry-After (`-` without one); outcome
//! `ok` (2xx and a usage event), `nousage` (2xx without one), `refused` (429), `error` (another
//! status), `broken` (the body broke off) or `transport` (no response). One summary JSON line goes
//! to stdout.
//!
//! `cargo run --release --example llm_load -- --targets 127.0.0.1:8001,127.0.0.1:8002 \
//!      --clients 200 --duration 120 --think-ms 88000 --out /tmp/requests.txt`

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser, Debug)]
#[command(about = "Closed-loop streamed chat-completion clients (scripts/bench/llm-tokens.sh)")]
struct Args {
    /// HOST:PORT of each target, comma-separated; clients are spread over them round-robin.
    #[arg(long, value_delimiter = ',', required = true)]
    targets: Vec<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 200)]
    clients: usize,
    /// Seconds during which requests start.
    #[arg(long, default_value_t = 300.0)]
    duration: f64,
    /// `max_tokens` of every request (a number), or `random`: uniform in [random-min, random-max].
    #[arg(long, default_value = "4000")]
    max_tokens: String,
    #[arg(long, default_value_t = 500)]
    random_min: u64,
    #[arg(long, default_value_t = 4000)]
    random_max: u64,
    /// Mean think time between a client's responses and its next request, in ms.
    #[arg(long, default_value_t = 0)]
    think_ms: u64,
    /// The longest Retry-After honoured, in seconds; a longer one is replaced by 1 s.
    #[arg(long, default_value_t = 60)]
    max_retry_after_s: u64,
    /// Most extra random wait on top of a 429's Retry-After, in ms.
    #[arg(long, default_value_t = 1000)]
    jitter_ms: u64,
    /// The x-tenant header of every request.
    #[arg(long, default_value = "t1")]
    tenant: String,
    /// Longest a request may take, response included, in seconds.
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    /// Per-request lines go here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    NoUsage,
    Refused,
    Error,
    Broken,
    Transport,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::NoUsage => "nousage",
            Outcome::Refused => "refused",
            Outcome::Error => "error",
            Outcome::Broken => "broken",
            Outcome::Transport => "transport",
        }
    }
}

struct Record {
    start_ms: u128,
    end_ms: u128,
    client: usize,
    status: u16,
    tokens: u64,
    outcome: Outcome,
    /// Time to the last byte.
    elapsed: Duration,
    retry_after: Option<Duration>,
}

fn unix_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// Keeps the last `TAIL` bytes of a stream: the usage event is among the last ones.
const TAIL: usize = 8192;

/// `usage.total_tokens` of the last `data:` event of `tail` that carries a usage object.
fn usage_tokens(tail: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(tail);
    text.lines().rev().filter_map(|line| line.strip_prefix("data:")).map(str::trim).find_map(|data| {
        let value: serde_json::Value = serde_json::from_str(data).ok()?;
        value.get("usage")?.get("total_tokens")?.as_u64()
    })
}

/// Seconds of a Retry-After header (delta-seconds only).
fn retry_after(headers: &http::HeaderMap) -> Option<Duration> {
    let seconds: f64 = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds.min(3600.0)))
}

/// Sends one request; its outcome, status, tokens and Retry-After.
async fn one(
    client: &Client<HttpConnector, Full<Bytes>>,
    uri: &hyper::Uri,
    tenant: &str,
    body: String,
) -> (Outcome, u16, u64, Option<Duration>) {
    let request = Request::post(uri.clone())
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("x-tenant", tenant)
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let Ok(response) = client.request(request).await else {
        return (Outcome::Transport, 0, 0, None);
    };
    let status = response.status().as_u16();
    let wait = retry_after(response.headers());
    let mut body = response.into_body();
    let mut tail: Vec<u8> = Vec::with_capacity(2 * TAIL);
    loop {
        match body.frame().await {
            None => break,
            Some(Err(_)) => return (Outcome::Broken, status, usage_tokens(&tail).unwrap_or(0), wait),
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    tail.extend_from_slice(data);
                    if tail.len() > 2 * TAIL {
                        tail.drain(..tail.len() - TAIL);
                    }
                }
            }
        }
    }
    let outcome = match status {
        429 => Outcome::Refused,
        200..=299 => match usage_tokens(&tail) {
            Some(tokens) => return (Outcome::Ok, status, tokens, wait),
            None => Outcome::NoUsage,
        },
        _ => Outcome::Error,
    };
    (outcome, status, 0, wait)
}

fn percentile(sorted: &[Duration], q: f64) -> serde_json::Value {
    if sorted.is_empty() {
        return serde_json::Value::Null;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    serde_json::json!((sorted[i].as_secs_f64() * 1000.0).round())
}

#[tokio::main]
async fn main() {
    let args = Arc::new(Args::parse());
    let fixed_max: Option<u64> = match args.max_tokens.as_str() {
        "random" => {
            assert!(args.random_min <= args.random_max, "--random-min must not exceed --random-max");
            None
        }
        n => Some(n.parse().expect("--max-tokens: a number or `random`")),
    };
    assert!(args.clients > 0 && !args.targets.is_empty());
    let uris: Arc<Vec<hyper::Uri>> = Arc::new(
        args.targets
            .iter()
            .map(|t| format!("http://{t}/v1/chat/completions").parse().expect("--targets: HOST:PORT"))
            .collect(),
    );
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(args.clients)
        .build_http::<Full<Bytes>>();
    let records: Arc<Mutex<Vec<Record>>> = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(args.duration);
    let timeout = Duration::from_secs(args.timeout_s);

    let mut tasks = Vec::with_capacity(args.clients);
    for id in 0..args.clients {
        let (args, uris, client, records) = (args.clone(), uris.clone(), client.clone(), records.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(1_000_003).wrapping_add(id as u64));
            let mut target = id % uris.len();
            // The first wait spreads the first requests over a mean think time.
            let mut wait = Duration::from_millis(rng.random_range(0..=args.think_ms));
            loop {
                let now = Instant::now();
                if now + wait >= deadline {
                    break;
                }
                tokio::time::sleep(wait).await;
                let max_tokens = fixed_max.unwrap_or_else(|| rng.random_range(args.random_min..=args.random_max));
                let body = serde_json::json!({
                    "model": "fake-llm",
                    "stream": true,
                    "stream_options": {"include_usage": true},
                    "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": "Explain token rate limits for LLM APIs, briefly."}],
                })
                .to_string();
                let start_ms = unix_ms();
                let sent = Instant::now();
                let (outcome, status, tokens, retry) = tokio::time::timeout(
                    timeout,
                    one(&client, &uris[target], &args.tenant, body),
                )
                .await
                .unwrap_or((Outcome::Transport, 0, 0, None));
                let elapsed = sent.elapsed();
                records.lock().push(Record {
                    start_ms,
                    end_ms: unix_ms(),
                    client: id,
                    status,
                    tokens,
                    outcome,
                    elapsed,
                    retry_after: retry,
                });
                target = (target + 1) % uris.len();
                wait = if outcome == Outcome::Refused {
                    let honoured = retry.filter(|r| *r <= Duration::from_secs(args.max_retry_after_s));
                    honoured.unwrap_or(Duration::from_secs(1))
                        + Duration::from_millis(rng.random_range(0..=args.jitter_ms))
                } else {
                    Duration::from_millis(rng.random_range(0..=2 * args.think_ms))
                };
            }
        }));
    }
    for task in tasks {
        task.await.expect("client task");
    }
    let seconds = started.elapsed().as_secs_f64();

    let mut records = std::mem::take(&mut *records.lock());
    records.sort_by_key(|r| r.start_ms);
    if let Some(path) = &args.out {
        let mut text = String::with_capacity(records.len() * 48);
        for r in &records {
            let retry = r.retry_after.map_or_else(|| "-".to_string(), |d| d.as_secs_f64().to_string());
            let _ = writeln!(
                text,
                "{} {} {} {} {} {} {retry}",
                r.start_ms,
                r.end_ms,
                r.client,
                r.status,
                r.tokens,
                r.outcome.name()
            );
        }
        std::fs::write(path, text).unwrap_or_else(|e| panic!("--out {}: {e}", path.display()));
    }
    let count = |o: Outcome| records.iter().filter(|r| r.outcome == o).count();
    let mut streams: Vec<Duration> = records.iter().filter(|r| r.outcome == Outcome::Ok).map(|r| r.elapsed).collect();
    streams.sort();
    let mut refusals: Vec<Duration> =
        records.iter().filter(|r| r.outcome == Outcome::Refused).map(|r| r.elapsed).collect();
    refusals.sort();
    let honoured = Duration::from_secs(args.max_retry_after_s);
    let over = records.iter().filter(|r| r.outcome == Outcome::Refused && r.retry_after.is_some_and(|d| d > honoured));
    let summary = serde_json::json!({
        "clients": args.clients,
        "targets": args.targets.len(),
        "seconds": (seconds * 10.0).round() / 10.0,
        "requests": records.len(),
        "ok": count(Outcome::Ok),
        "noUsage": count(Outcome::NoUsage),
        "refused": count(Outcome::Refused),
        "error": count(Outcome::Error),
        "broken": count(Outcome::Broken),
        "transport": count(Outcome::Transport),
        "tokens": records.iter().filter(|r| r.outcome == Outcome::Ok).map(|r| r.tokens).sum::<u64>(),
        "streamP50Ms": percentile(&streams, 0.5),
        "streamP99Ms": percentile(&streams, 0.99),
        "refusalP50Ms": percentile(&refusals, 0.5),
        "refusalP99Ms": percentile(&refusals, 0.99),
        "retryAfterOverMax": over.clone().count(),
        "retryAfterMaxS": over.filter_map(|r| r.retry_after).max().map(|d| d.as_secs_f64()),
    });
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{summary}");
}
