//! A response body read for its cost (src/response/usage.rs): any bytes, any content type, in any frame
//! sizes. Never a panic; the meter holds no more than its bound; the answer does not depend on
//! how the body was split into frames; a cost is never beyond 2^53.
#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use sluice::response::usage::{JsonPath, MAX_COST, MAX_EVENT_BYTES, MAX_HEADER_DIGITS, UsageMeter, UsageSpec, cost_from_header};

/// Small, so that the fuzzer reaches the JSON bound.
const MAX_JSON_BYTES: usize = 4096;

fn spec(paths: &[&str]) -> Arc<UsageSpec> {
    let fields = paths.iter().map(|p| JsonPath::parse(p).expect("a valid path")).collect();
    let mut spec = UsageSpec::new(fields).expect("a valid spec");
    spec.max_json_bytes = MAX_JSON_BYTES;
    Arc::new(spec)
}

/// The OpenAI fields, and fields that share prefixes (one ending where another goes on).
static SPECS: LazyLock<[Arc<UsageSpec>; 2]> =
    LazyLock::new(|| [spec(&["usage.prompt_tokens", "usage.completion_tokens"]), spec(&["a", "a.b", "a.c.d", "b"])]);

fn meter(spec: &Arc<UsageSpec>, content_type: Option<&str>, body: &[u8], frame: usize) -> Result<u64, String> {
    let bound = match content_type {
        Some("application/json") => MAX_JSON_BYTES,
        Some("text/event-stream") => MAX_EVENT_BYTES,
        _ => 0,
    };
    let mut meter = UsageMeter::new(spec.clone(), content_type);
    for piece in body.chunks(frame) {
        meter.feed(piece);
        assert!(meter.buffered_bytes() <= bound, "{} bytes held, bound {bound}", meter.buffered_bytes());
    }
    let result = meter.finish();
    if let Ok(cost) = result {
        assert!(cost <= MAX_COST, "cost {cost}");
    }
    result.map_err(|problem| format!("{problem:?}"))
}

fuzz_target!(|input: &[u8]| {
    let Some((&control, body)) = input.split_first() else { return };
    // Bits 0-1: content type (event streams twice as often: theirs is the stateful parser; bit
    // 7 picks between text/plain and none); bit 2: which spec; bits 3-7: frame size 1..=32.
    let content_type = match control & 3 {
        0 => Some("application/json"),
        1 | 2 => Some("text/event-stream"),
        _ if control & 0x80 == 0 => Some("text/plain"),
        _ => None,
    };
    let spec = &SPECS[usize::from((control >> 2) & 1)];
    let frame = usize::from(control >> 3) + 1;

    let whole = meter(spec, content_type, body, body.len().max(1));
    assert_eq!(meter(spec, content_type, body, frame), whole, "frames of {frame}");
    assert_eq!(meter(spec, content_type, body, 1), whole, "frames of 1");
    if content_type.is_none_or(|t| t == "text/plain") {
        assert!(whole.as_ref().is_err_and(|problem| problem == "NotJson"), "{whole:?}");
    }

    if let Ok(cost) = cost_from_header(body) {
        assert!(!body.is_empty() && body.len() <= MAX_HEADER_DIGITS && body.iter().all(u8::is_ascii_digit));
        assert_eq!(std::str::from_utf8(body).map(str::parse::<u64>).ok(), Some(Ok(cost)));
    }
});
