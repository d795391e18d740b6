//! examples/fake_llm.rs, the fake LLM upstream of the response-cost tests and of
//! scripts/bench/llm-tokens.sh, run as its own process and asked over HTTP.
//!
//! Finding the binary: Cargo builds a crate's examples for a plain `cargo test` but not for
//! `cargo test --test fake_llm`, and gives tests no `CARGO_BIN_EXE_*` for examples. So the test
//! runs `cargo build --example fake_llm` itself (the cargo running the test, `$CARGO`, in the
//! test's profile: `--release` when the test binary sits under a `release` directory) and takes
//! the executable's path from Cargo's JSON messages. When the example is fresh that is a no-op
//! of a second or so; the first time it compiles just the example, as the crate and its
//! dependencies are already built for the test. `FAKE_LLM_BIN=/path/to/fake_llm` skips the build.

#[path = "support/fake_llm.rs"]
mod fake_llm;

use fake_llm::FakeLlm;
use serde_json::{Value, json};

/// The `data:` payloads of a server-sent-events body, and the event names seen.
fn events(body: &str) -> Vec<(Option<String>, String)> {
    body.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut event = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = Some(name.to_string());
                } else if let Some(payload) = line.strip_prefix("data: ") {
                    data = Some(payload.to_string());
                }
            }
            (event, data.unwrap_or_else(|| panic!("an event without data: {block:?}")))
        })
        .collect()
}

fn count_tokens(text: &str) -> usize {
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.iter().all(|w| *w == "tok"), "unexpected text {text:?}");
    words.len()
}

const PROMPT: &str = "Say something long about rate limits, please."; // 45 characters: 12 tokens

#[tokio::test]
async fn streams_openai_chunks_capped_at_max_tokens_with_usage_at_the_end() {
    let upstream = FakeLlm::start(&["--seed", "1", "--tokens-per-chunk", "30", "--token-interval-us", "100"]);
    let client = reqwest::Client::new();
    assert_eq!(client.get(upstream.url("/healthz")).send().await.unwrap().text().await.unwrap(), "ok");

    let response = client
        .post(upstream.url("/v1/chat/completions"))
        .header("x-fake-completion-tokens", "120")
        .header("x-tenant", "acme")
        .json(&json!({
            "model": "fake",
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": true,
            "max_tokens": 100,
            "stream_options": {"include_usage": true},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert!(response.headers().get("x-fake-usage").is_none(), "usage only in the body");
    let body = response.text().await.unwrap();
    let events = events(&body);
    assert_eq!(events.last().unwrap().1, "[DONE]", "{body}");

    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|(_, data)| serde_json::from_str(data).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(count_tokens(&content), 100, "max_tokens caps the completion");
    assert_eq!(content.len(), 400);
    // 100 tokens in chunks of 30: 30, 30, 30, 10.
    assert_eq!(chunks.iter().filter(|c| c["choices"][0]["delta"]["content"].is_string()).count(), 4);
    assert_eq!(chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str()), Some("length"));

    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], json!({"prompt_tokens": 12, "completion_tokens": 100, "total_tokens": 112}));
}

#[tokio::test]
async fn answers_a_whole_chat_completion_with_consistent_usage() {
    let upstream = FakeLlm::start(&["--seed", "2", "--tokens-min", "10", "--tokens-max", "20"]);
    let client = reqwest::Client::new();
    let response = client
        .post(upstream.url("/v1/chat/completions"))
        .json(&json!({"model": "fake", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["object"], "chat.completion");
    assert!(answer["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let usage = &answer["usage"];
    let (prompt, completion) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap());
    assert_eq!(prompt, (8 + 45u64).div_ceil(4));
    assert!((10..=20).contains(&completion), "{completion}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(count_tokens(content) as u64, completion);
    assert_eq!(content.len() as u64, completion * 4);
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");

    let bad = client.post(upstream.url("/v1/chat/completions")).body("{not json").send().await.unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test]
async fn streams_anthropic_events() {
    let upstream = FakeLlm::start(&["--seed", "3", "--tokens-per-chunk", "7"]);
    let body = reqwest::Client::new()
        .post(upstream.url("/v1/messages"))
        .header("x-fake-completion-tokens", "20")
        .json(&json!({"model": "fake", "max_tokens": 1000, "stream": true, "system": "abcd", "messages": [{"role": "user", "content": [{"type": "text", "text": "efgh"}]}]}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = events(&body);
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let data: Vec<Value> = events.iter().map(|(_, data)| serde_json::from_str(data).unwrap()).collect();
    assert_eq!(data[0]["message"]["usage"]["input_tokens"], 2);
    let text: String = data.iter().filter_map(|d| d["delta"]["text"].as_str()).collect();
    assert_eq!(count_tokens(&text), 20);
    assert_eq!(data[6]["usage"]["output_tokens"], 20);
    assert_eq!(data[6]["delta"]["stop_reason"], "end_turn");
}

#[tokio::test]
async fn fails_with_500s_and_aborted_streams_and_keeps_a_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger");
    let upstream = FakeLlm::start(&[
        "--seed",
        "4",
        "--error-rate",
        "1",
        "--tokens-min",
        "100",
        "--tokens-max",
        "100",
        "--tokens-per-chunk",
        "10",
        "--ledger",
        ledger.to_str().unwrap(),
    ]);
    let client = reqwest::Client::new();
    let (mut errors, mut aborted) = (0, 0);
    for i in 0..20 {
        let response = client
            .post(upstream.url("/v1/chat/completions"))
            .header("x-tenant", "t1")
            .json(&json!({"messages": [{"role": "user", "content": "hi"}], "stream": i % 2 == 0}))
            .send()
            .await
            .unwrap();
        if response.status() == 500 {
            let error: Value = response.json().await.unwrap();
            assert!(error["error"]["message"].is_string());
            errors += 1;
        } else {
            assert_eq!(response.status(), 200);
            assert!(response.text().await.is_err(), "an aborted response is a body error");
            aborted += 1;
        }
    }
    assert!(errors > 0 && aborted > 0, "{errors} errors, {aborted} aborted");

    // The ledger line of the last aborted stream may be written just after the client saw the cut.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let lines = loop {
        let text = std::fs::read_to_string(&ledger).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() >= 20 || std::time::Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(lines.len(), 20, "{lines:?}");
    let mut outcomes = (0, 0);
    for line in &lines {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields.len(), 6, "{line}");
        let (start, end): (u128, u128) = (fields[0].parse().unwrap(), fields[1].parse().unwrap());
        assert!(start <= end, "{line}");
        assert_eq!(&fields[2..4], ["t1", "1"], "{line}");
        match fields[5] {
            "error500" => {
                assert_eq!(fields[4], "0");
                outcomes.0 += 1;
            }
            "aborted" => {
                assert_eq!(fields[4], "50", "half the tokens went out");
                outcomes.1 += 1;
            }
            other => panic!("outcome {other}"),
        }
    }
    assert_eq!(outcomes, (errors, aborted));
}
