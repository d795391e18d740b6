//! A fake LLM upstream: an OpenAI-compatible (and Anthropic-style) chat endpoint that streams
//! made-up tokens at a chosen pace and reports their usage the way real providers do, in the
//! response body. It is the upstream behind Sluice's sidecar in the tests and in
//! scripts/bench/llm-tokens.sh of Sluice's response-cost limits (tokens read from the response's
//! `usage`, charged after the fact), which compare what Sluice charged with what the upstream
//! really produced: the `--ledger` file. tests/fake_llm.rs checks the fake itself.
//!
//! `cargo run --release --example fake_llm -- --listen 127.0.0.1:9000 --seed 1 --ledger /tmp/ledger`
//!
//! The first line on stdout is `listening on ADDRESS` (flushed), so a script or test can start it
//! on port 0 and read the port.
//!
//! Flags:
//!
//! - `--listen 127.0.0.1:0`: the address to bind.
//! - `--tokens-min 500 --tokens-max 4000`: completion tokens per response, uniform in
//!   [min, max], unless the request's `x-fake-completion-tokens: N` header fixes them. Either way
//!   they are then capped at the request's `max_tokens` (or `max_completion_tokens`), as a real
//!   upstream honours it.
//! - `--token-interval-us 200`: time between streamed chunks (0: no pacing). A non-streamed
//!   answer is held for as long as streaming it would take.
//! - `--tokens-per-chunk 50`: completion tokens per streamed chunk.
//! - `--error-rate 0.0`: the fraction of requests that fail. Half of them answer 500 with a JSON
//!   error body before any output; the other half send their headers and part of the body (streamed:
//!   half the tokens, at least one chunk; not streamed: the first half of the JSON after half
//!   the generation time) and then abort the connection without the body's end (no terminating
//!   chunk).
//! - `--seed N`: deterministic randomness (token counts, failures, ids; in arrival order).
//! - `--ledger PATH`: append one line per finished response (flushed per line):
//!
//!   `<unix_ms_at_start> <unix_ms_at_end> <tenant> <prompt_tokens> <completion_tokens> <outcome>`
//!
//!   tenant is the `x-tenant` request header (`-` when absent; whitespace replaced by `_`);
//!   outcome is `ok`, `error500`, `aborted` (the upstream cut the response), `cancelled` (the
//!   client went away first) or `bad_request` (400). completion_tokens are those produced before
//!   the response ended: all of them when `ok`, 0 for `error500` and `bad_request` (whose
//!   prompt_tokens are 0 too), those sent for `aborted` and `cancelled`.
//!
//! Endpoints:
//!
//! - `POST /v1/chat/completions`: `{"model", "messages": [{"content"}…], "stream", "max_tokens",
//!   "stream_options": {"include_usage"}}`. Prompt tokens: the characters of every
//!   `messages[].content` (a string, or the `text` of its parts), divided by 4 and rounded up, at
//!   least 1. Completion text: `tok ` once per token. Not streamed: a `chat.completion` object
//!   with `usage`. Streamed (`text/event-stream`): `chat.completion.chunk` events of
//!   `--tokens-per-chunk` tokens each, one with an empty delta and the `finish_reason` (`stop`,
//!   or `length` when `max_tokens` cut the answer), the usage chunk (`choices: []`) when
//!   `stream_options.include_usage` is true, then `data: [DONE]`. No header carries the usage.
//! - `POST /v1/messages` (Anthropic-style; `system` counts towards the prompt too): not
//!   streamed, a `message` object with `usage.input_tokens`/`output_tokens`; streamed,
//!   `message_start` (with `usage.input_tokens`), `content_block_start`, `content_block_delta`
//!   events, `content_block_stop`, `message_delta` (with `usage.output_tokens`), `message_stop`.
//! - `GET /healthz`: 200 `ok`.
//!
//! Malformed JSON, or a malformed `x-fake-completion-tokens`, answers 400.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Parser;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::{Interval, MissedTickBehavior};

#[derive(Parser, Debug)]
#[command(about = "A fake OpenAI-compatible LLM upstream for Sluice's tests and benchmarks")]
struct Args {
    /// Address to listen on; the bound address is printed as `listening on ADDRESS`.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Least completion tokens per response (uniform in [min, max]).
    #[arg(long, default_value_t = 500)]
    tokens_min: u64,
    /// Most completion tokens per response.
    #[arg(long, default_value_t = 4000)]
    tokens_max: u64,
    /// Microseconds between streamed chunks (0: none).
    #[arg(long, default_value_t = 200)]
    token_interval_us: u64,
    /// Completion tokens per streamed chunk.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..))]
    tokens_per_chunk: u64,
    /// Fraction of requests that fail: half with a 500, half aborted mid-stream.
    #[arg(long, default_value_t = 0.0)]
    error_rate: f64,
    /// Seed for deterministic randomness.
    #[arg(long)]
    seed: Option<u64>,
    /// Append one line per finished response to this file.
    #[arg(long)]
    ledger: Option<PathBuf>,
}

struct App {
    args: Args,
    rng: Mutex<StdRng>,
    ledger: Option<Mutex<BufWriter<File>>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    OpenAi,
    Anthropic,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Failure {
    None,
    Error500,
    Abort,
}

fn unix_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// One response's ledger line, written when it is dropped: at the end of the response body, or
/// when the client goes away (`cancelled` unless an outcome was set).
struct Record {
    app: Arc<App>,
    start_ms: u128,
    tenant: String,
    prompt: u64,
    completion: u64,
    outcome: Option<&'static str>,
}

impl Drop for Record {
    fn drop(&mut self) {
        let Some(ledger) = &self.app.ledger else { return };
        let line = format!(
            "{} {} {} {} {} {}\n",
            self.start_ms,
            unix_ms(),
            self.tenant,
            self.prompt,
            self.completion,
            self.outcome.unwrap_or("cancelled")
        );
        let mut writer = ledger.lock();
        let written = writer.write_all(line.as_bytes()).and_then(|()| writer.flush());
        if let Err(error) = written {
            eprintln!("fake_llm: ledger: {error}");
        }
    }
}

#[derive(Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Vec<Message>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Anthropic's system prompt: a string or text blocks.
    #[serde(default)]
    system: Option<Value>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Value,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Characters of a message content: a string, or the strings and `text` fields of its parts.
fn content_chars(content: &Value) -> u64 {
    match content {
        Value::String(text) => text.chars().count() as u64,
        Value::Array(parts) => parts
            .iter()
            .map(|part| match part {
                Value::String(text) => text.chars().count() as u64,
                Value::Object(fields) => fields.get("text").map_or(0, content_chars),
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}

fn error_body(format: Format, status: StatusCode, kind: &str, message: &str) -> Response {
    let body = match format {
        Format::OpenAi => json!({"error": {"message": message, "type": kind, "code": null}}),
        Format::Anthropic => json!({"type": "error", "error": {"type": kind, "message": message}}),
    };
    (status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// What one response will be.
struct Plan {
    format: Format,
    id: String,
    model: String,
    prompt: u64,
    completion: u64,
    /// `max_tokens` cut the completion short.
    capped: bool,
    include_usage: bool,
    failure: Failure,
}

async fn openai(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    respond(app, Format::OpenAi, &headers, &body).await
}

async fn anthropic(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    respond(app, Format::Anthropic, &headers, &body).await
}

async fn respond(app: Arc<App>, format: Format, headers: &HeaderMap, body: &[u8]) -> Response {
    let tenant = headers
        .get("x-tenant")
        .and_then(|v| v.to_str().ok())
        .map(|t| t.split_whitespace().collect::<Vec<_>>().join("_"))
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "-".into());
    let mut record = Record { app: app.clone(), start_ms: unix_ms(), tenant, prompt: 0, completion: 0, outcome: None };
    let request: ChatRequest = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(error) => {
            record.outcome = Some("bad_request");
            let message = format!("malformed request body: {error}");
            return error_body(format, StatusCode::BAD_REQUEST, "invalid_request_error", &message);
        }
    };
    let fixed = match headers
        .get("x-fake-completion-tokens")
        .map(|v| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()))
    {
        None => None,
        Some(Some(n)) => Some(n),
        Some(None) => {
            record.outcome = Some("bad_request");
            return error_body(
                format,
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "x-fake-completion-tokens: not a number",
            );
        }
    };

    let chars: u64 = request.messages.iter().map(|m| content_chars(&m.content)).sum::<u64>()
        + request.system.as_ref().map_or(0, content_chars);
    let prompt = chars.div_ceil(4).max(1);
    let (wanted, draw, id) = {
        let mut rng = app.rng.lock();
        let wanted = fixed.unwrap_or_else(|| rng.random_range(app.args.tokens_min..=app.args.tokens_max));
        let draw: f64 = rng.random();
        let id: u64 = rng.random();
        (wanted, draw, id)
    };
    let limit = request.max_tokens.or(request.max_completion_tokens);
    let completion = limit.map_or(wanted, |limit| wanted.min(limit));
    let failure = if draw < app.args.error_rate / 2.0 {
        Failure::Error500
    } else if draw < app.args.error_rate {
        Failure::Abort
    } else {
        Failure::None
    };
    let plan = Plan {
        format,
        id: match format {
            Format::OpenAi => format!("chatcmpl-{id:016x}"),
            Format::Anthropic => format!("msg_{id:016x}"),
        },
        model: request.model.unwrap_or_else(|| "fake-llm".into()),
        prompt,
        completion,
        capped: completion < wanted,
        include_usage: request.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        failure,
    };
    record.prompt = prompt;

    if failure == Failure::Error500 {
        record.outcome = Some("error500");
        let kind = if format == Format::OpenAi { "server_error" } else { "api_error" };
        return error_body(format, StatusCode::INTERNAL_SERVER_ERROR, kind, "fake upstream failure");
    }
    if request.stream.unwrap_or(false) {
        let interval = (app.args.token_interval_us > 0).then(|| {
            let mut interval = tokio::time::interval(Duration::from_micros(app.args.token_interval_us));
            interval.set_missed_tick_behavior(MissedTickBehavior::Burst);
            interval
        });
        let stream = Stream {
            per_chunk: app.args.tokens_per_chunk,
            plan,
            interval,
            stage: Stage::Head,
            sent: 0,
            chunks: 0,
            record,
        };
        let body = Body::from_stream(futures::stream::unfold(stream, |mut stream| async move {
            let item = stream.next().await?;
            Some((item, stream))
        }));
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(body)
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }

    // Not streamed: held for as long as streaming would take.
    let chunks = completion.div_ceil(app.args.tokens_per_chunk);
    let generation = Duration::from_micros(app.args.token_interval_us.saturating_mul(chunks));
    let text = whole(&plan).to_string();
    if failure == Failure::Abort {
        // Headers and the first half of the body after half the generation time, the cut after
        // the rest of it (at least a millisecond, so that hyper flushes the half first).
        tokio::time::sleep(generation / 2).await;
        record.completion = completion / 2;
        record.outcome = Some("aborted");
        let text = Bytes::from(text);
        let half = text.slice(..text.len() / 2);
        let rest = (generation / 2).max(Duration::from_millis(1));
        let parts = futures::stream::unfold((Some(half), Some(record)), move |(half, record)| async move {
            match half {
                Some(half) => Some((Ok(half), (None, record))),
                None => {
                    tokio::time::sleep(rest).await;
                    // Dropping the record here writes the ledger line at the cut.
                    record.map(|_| (Err(io::Error::other("fake upstream: response aborted")), (None, None)))
                }
            }
        });
        return ([(header::CONTENT_TYPE, "application/json")], Body::from_stream(parts)).into_response();
    }
    tokio::time::sleep(generation).await;
    record.completion = completion;
    record.outcome = Some("ok");
    drop(record);
    ([(header::CONTENT_TYPE, "application/json")], text).into_response()
}

/// The whole non-streamed answer.
fn whole(plan: &Plan) -> Value {
    let text = "tok ".repeat(plan.completion as usize);
    match plan.format {
        Format::OpenAi => json!({
            "id": plan.id,
            "object": "chat.completion",
            "created": unix_ms() / 1000,
            "model": plan.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": if plan.capped { "length" } else { "stop" },
            }],
            "usage": {
                "prompt_tokens": plan.prompt,
                "completion_tokens": plan.completion,
                "total_tokens": plan.prompt + plan.completion,
            },
        }),
        Format::Anthropic => json!({
            "id": plan.id,
            "type": "message",
            "role": "assistant",
            "model": plan.model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": if plan.capped { "max_tokens" } else { "end_turn" },
            "stop_sequence": null,
            "usage": {"input_tokens": plan.prompt, "output_tokens": plan.completion},
        }),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Head,
    Tokens,
    Tail,
    Done,
}

/// A streamed answer, one server-sent-events chunk at a time.
struct Stream {
    per_chunk: u64,
    plan: Plan,
    interval: Option<Interval>,
    stage: Stage,
    sent: u64,
    chunks: u64,
    record: Record,
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(event) => format!("event: {event}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

impl Stream {
    /// An aborted response stops once half its tokens (and at least one chunk) are out.
    fn aborts_now(&self) -> bool {
        self.plan.failure == Failure::Abort
            && self.sent >= self.plan.completion / 2
            && (self.chunks >= 1 || self.plan.completion == 0)
    }

    async fn abort(&mut self) -> Option<Result<Bytes, io::Error>> {
        // Pending once first, so that hyper flushes what was sent before the cut.
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.stage = Stage::Done;
        self.record.completion = self.sent;
        self.record.outcome = Some("aborted");
        Some(Err(io::Error::other("fake upstream: stream aborted")))
    }

    async fn next(&mut self) -> Option<Result<Bytes, io::Error>> {
        loop {
            match self.stage {
                Stage::Head => {
                    self.stage = Stage::Tokens;
                    if let Some(head) = self.head() {
                        return Some(Ok(Bytes::from(head)));
                    }
                }
                Stage::Tokens => {
                    if self.aborts_now() {
                        return self.abort().await;
                    }
                    if self.sent >= self.plan.completion {
                        self.stage = Stage::Tail;
                        continue;
                    }
                    if let Some(interval) = &mut self.interval {
                        interval.tick().await;
                    }
                    let n = self.per_chunk.min(self.plan.completion - self.sent);
                    self.sent += n;
                    self.chunks += 1;
                    self.record.completion = self.sent;
                    return Some(Ok(Bytes::from(self.token_chunk(n))));
                }
                Stage::Tail => {
                    if self.aborts_now() {
                        return self.abort().await;
                    }
                    self.stage = Stage::Done;
                    self.record.outcome = Some("ok");
                    return Some(Ok(Bytes::from(self.tail())));
                }
                Stage::Done => return None,
            }
        }
    }

    fn head(&self) -> Option<String> {
        let plan = &self.plan;
        match plan.format {
            Format::OpenAi => None,
            Format::Anthropic => {
                let start = json!({
                    "type": "message_start",
                    "message": {
                        "id": plan.id,
                        "type": "message",
                        "role": "assistant",
                        "model": plan.model,
                        "content": [],
                        "stop_reason": null,
                        "stop_sequence": null,
                        "usage": {"input_tokens": plan.prompt, "output_tokens": 1},
                    },
                });
                let block =
                    json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
                Some(sse(Some("message_start"), &start) + &sse(Some("content_block_start"), &block))
            }
        }
    }

    fn token_chunk(&self, n: u64) -> String {
        let text = "tok ".repeat(n as usize);
        let plan = &self.plan;
        match plan.format {
            Format::OpenAi => sse(
                None,
                &json!({
                    "id": plan.id,
                    "object": "chat.completion.chunk",
                    "model": plan.model,
                    "choices": [{"index": 0, "delta": {"content": text}}],
                }),
            ),
            Format::Anthropic => sse(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
            ),
        }
    }

    fn tail(&self) -> String {
        let plan = &self.plan;
        match plan.format {
            Format::OpenAi => {
                let mut tail = sse(
                    None,
                    &json!({
                        "id": plan.id,
                        "object": "chat.completion.chunk",
                        "model": plan.model,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": if plan.capped { "length" } else { "stop" }}],
                    }),
                );
                if plan.include_usage {
                    tail += &sse(
                        None,
                        &json!({
                            "id": plan.id,
                            "object": "chat.completion.chunk",
                            "model": plan.model,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": plan.prompt,
                                "completion_tokens": plan.completion,
                                "total_tokens": plan.prompt + plan.completion,
                            },
                        }),
                    );
                }
                tail + "data: [DONE]\n\n"
            }
            Format::Anthropic => {
                sse(Some("content_block_stop"), &json!({"type": "content_block_stop", "index": 0}))
                    + &sse(
                        Some("message_delta"),
                        &json!({
                            "type": "message_delta",
                            "delta": {"stop_reason": if plan.capped { "max_tokens" } else { "end_turn" }, "stop_sequence": null},
                            "usage": {"output_tokens": plan.completion},
                        }),
                    )
                    + &sse(Some("message_stop"), &json!({"type": "message_stop"}))
            }
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.tokens_min > args.tokens_max {
        return Err("--tokens-min must not exceed --tokens-max".into());
    }
    if !(0.0..=1.0).contains(&args.error_rate) {
        return Err("--error-rate must be within [0, 1]".into());
    }
    let rng = match args.seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    };
    let ledger = match &args.ledger {
        Some(path) => Some(Mutex::new(BufWriter::new(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("--ledger {}: {e}", path.display()))?,
        ))),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let app = Arc::new(App { args, rng: Mutex::new(rng), ledger });
    let router = Router::new()
        .route("/v1/chat/completions", post(openai))
        .route("/v1/messages", post(anthropic))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app);
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "listening on {}", listener.local_addr()?)?;
    stdout.flush()?;
    drop(stdout);
    axum::serve(listener, router).await?;
    Ok(())
}
